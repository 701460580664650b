"""A signal during preparation (SIGINT, SIGTERM, SIGHUP) removes the temporary directory and ends
with one line and 128 + the signal number, from `python -m data.prepare` and from train.py alike.
Real processes, real signals: each is sent once the temporary directory (and, for encoding, its
token files) exists, on a text large enough that the preparation is still running then."""
import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from data.cache import load_meta
from tests.conftest import ROOT, TEXT, posix_signals, prepare_text


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.txt"
    line = (TEXT.replace("\n", " ") + "\n").encode()
    path.write_bytes(line * (40_000_000 // len(line)))   # 40 MB: seconds of work after the temp dir appears
    return path


def signal_when_ready(argv, root, sig, ready_file):
    """Start argv, wait until a temporary dir in root holds ready_file (if None: 3 s, while a BPE trains on
    the big text, before anything is written), send sig; (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    start = time.monotonic()
    try:
        while time.monotonic() < start + 180:
            temps = list(root.glob(".*.tmp-*")) if root.exists() else []
            if any((t / ready_file).exists() for t in temps) if ready_file else time.monotonic() > start + 3:
                break
            assert proc.poll() is None, f"it ended before it could be interrupted: {proc.stderr.read()}"
            time.sleep(0.005)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@posix_signals
@pytest.mark.parametrize("name, tokenizer, ready_file", [
    ("SIGTERM", "char", "train.bin"),   # while encoding on the thread pool
    ("SIGINT", "char", "train.bin"),
    ("SIGHUP", "char", "train.bin"),
    ("SIGTERM", "bpe:4096", None),      # while the BPE is being trained (nothing is written before it is)
], ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGTERM-bpe"])
def test_a_signal_stops_data_prepare_cleanly(tmp_path, big_text, name, tokenizer, ready_file):
    root, sig = tmp_path / "prep", getattr(signal, name)
    rc, err = signal_when_ready(["-m", "data.prepare", big_text, "--tokenizer", tokenizer, "--root", root],
                                root, sig, ready_file)
    assert rc == 128 + sig, (rc, err)
    assert err == f"interrupted: preparing {big_text} stopped by {name}; nothing was kept\n", err
    assert not root.exists() or os.listdir(root) == [], "no temporary dir and no entry"


@posix_signals
def test_a_signal_stops_train_py_while_it_prepares(tmp_path, big_text):
    root = tmp_path / "prep"
    argv = ["train.py", "--data", big_text, "--data.prepared_dir", root, "--out_dir", tmp_path / "out"]
    rc, err = signal_when_ready(argv, root, signal.SIGTERM, "train.bin")
    assert rc == 143 and err == f"interrupted: preparing {big_text} stopped by SIGTERM; nothing was kept\n", (rc, err)
    assert os.listdir(root) == []


def start_and_wait_for_encoding(path, root):
    """A real `python -m data.prepare path`, once it has begun writing token files."""
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", path, "--root", root], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not any((t / "train.bin").exists() for t in root.glob(".*.tmp-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.005)
    return proc


@pytest.mark.parametrize("more", ["more of the same text\n", "€ and a character the text had not\n"])
def test_a_text_that_grows_while_it_is_prepared_is_kept_under_the_bytes_it_was_named_after(tmp_path, big_text, more):
    """The cache names an entry after the sha256 of its text: an entry holds exactly those bytes. A real
    preparation, and text appended to its file while it encodes: the entry is of the bytes that were
    hashed, and the next preparation, of the longer text, makes another one."""
    path, root = tmp_path / "notes.txt", tmp_path / "prep"
    path.write_bytes(big_text.read_bytes())
    proc = start_and_wait_for_encoding(path, root)
    with open(path, "a") as f:
        f.write(more)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    (entry,) = root.iterdir()
    meta = load_meta(entry)
    assert meta["sha256"] == hashlib.sha256(big_text.read_bytes()).hexdigest()
    assert sum(meta["bytes"].values()) == big_text.stat().st_size, "the appended text is not in it"
    assert prepare_text(path, "char", 0.1, root) != entry


@pytest.mark.parametrize("new", [b"e", b"x"], ids=["a character of the text", "one it had not"])
def test_a_text_rewritten_while_it_is_prepared_is_not_kept(tmp_path, big_text, new):
    """Bytes that change in place while they are encoded are not the bytes the entry would be named
    after: nothing is kept, and the message says why."""
    path, root = tmp_path / "notes.txt", tmp_path / "prep"
    path.write_bytes(big_text.read_bytes())
    proc = start_and_wait_for_encoding(path, root)
    with open(path, "r+b") as f:   # the last line, which has not been encoded yet: same size, other bytes
        f.seek(-100, os.SEEK_END)
        f.write(new * 99)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err == f"error: {path} changed while it was being prepared; nothing was kept: " \
                                           f"prepare it again once it no longer changes\n", err
    assert os.listdir(root) == []


@posix_signals
def test_what_a_killed_preparation_left_is_listed_and_cleaned(tmp_path, big_text):
    """SIGKILL leaves no chance to clean up: the temporary directory stays, --list shows it as a
    preparation's leftover, and --clean removes it, saying how much space that freed."""
    root = tmp_path / "prep"
    proc = start_and_wait_for_encoding(big_text, root)
    proc.kill()
    proc.communicate(timeout=60)
    (leftover,) = root.iterdir()
    mb = sum(f.stat().st_size for f in leftover.iterdir()) / 1e6

    def command(*argv):
        r = subprocess.run([sys.executable, "-m", "data.prepare", *argv, "--root", root], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        return r.stdout
    assert command("--list") == (f"{leftover.name}  {mb:,.1f} MB  left by a preparation that was stopped (or is "
                                 f"still running); --clean removes it\n1 entry, {mb:,.1f} MB in {root}\n")
    assert command("--clean") == f"removed 1 entry from {root}: {mb:,.1f} MB freed\n"
    assert os.listdir(root) == []
