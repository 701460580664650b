"""A signal during preparation (SIGINT, SIGTERM, SIGHUP) removes the temporary directory and ends
with one line and 128 + the signal number, from `python -m data.prepare` and from train.py alike.
Real processes, real signals: each is sent once the temporary directory (and, for encoding, its
token files) exists, on a text large enough that the preparation is still running then."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TEXT, posix_signals


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.txt"
    line = (TEXT.replace("\n", " ") + "\n").encode()
    path.write_bytes(line * (40_000_000 // len(line)))   # 40 MB: seconds of work after the temp dir appears
    return path


def signal_when_ready(argv, root, sig, ready_file):
    """Start argv, wait until a temporary dir in root holds ready_file (any file if None), send sig;
    (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            temps = list(root.glob(".*.tmp-*")) if root.exists() else []
            if temps and (ready_file is None or any((t / ready_file).exists() for t in temps)):
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
    ("SIGTERM", "bpe:4096", None),      # while the BPE is being trained
], ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGTERM-bpe"])
def test_a_signal_stops_data_prepare_cleanly(tmp_path, big_text, name, tokenizer, ready_file):
    root, sig = tmp_path / "prep", getattr(signal, name)
    rc, err = signal_when_ready(["-m", "data.prepare", big_text, "--tokenizer", tokenizer, "--root", root],
                                root, sig, ready_file)
    assert rc == 128 + sig, (rc, err)
    assert err == f"interrupted: preparing {big_text} stopped by {name}; nothing was kept\n", err
    assert os.listdir(root) == [], "no temporary dir and no entry"


@posix_signals
def test_a_signal_stops_train_py_while_it_prepares(tmp_path, big_text):
    root = tmp_path / "prep"
    argv = ["train.py", "--data", big_text, "--data.prepared_dir", root, "--out_dir", tmp_path / "out"]
    rc, err = signal_when_ready(argv, root, signal.SIGTERM, "train.bin")
    assert rc == 143 and err == f"interrupted: preparing {big_text} stopped by SIGTERM; nothing was kept\n", (rc, err)
    assert os.listdir(root) == []


@pytest.mark.parametrize("more", ["more of the same text\n", "€ and a character the text had not\n"])
def test_a_text_that_grows_while_it_is_prepared_is_not_kept_under_the_old_bytes_name(tmp_path, big_text, more):
    """The cache names an entry after the sha256 of its text: an entry must hold exactly those bytes. A
    real preparation, and text appended to its file while it encodes."""
    path, root = tmp_path / "notes.txt", tmp_path / "prep"
    path.write_bytes(big_text.read_bytes())
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", path, "--root", root], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not any((t / "train.bin").exists() for t in root.glob(".*.tmp-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.005)
    with open(path, "a") as f:
        f.write(more)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and f"{path} changed while it was being prepared; nothing was kept" in err, err
    assert os.listdir(root) == []
