"""The prepared-data cache never uses a damaged entry: it prepares it again (with a one-line notice),
or, where only the entry is at hand, names it in a one-line error. Text that cannot be used is
refused before anything is published; encoding errors are part of the key; temporary directories
of stopped preparations are removed, live ones never."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import data.cache as cache
from data.cache import FORMAT, load_meta
from data.loader import BatchLoader
from common import ConfigError, DataError
from tests.conftest import ROOT, TEXT, gpt2_or_skip, prepare_text


def edit_meta(out, change):
    meta = json.loads((out / "meta.json").read_text())
    change(meta)
    (out / "meta.json").write_text(json.dumps(meta))


def truncate(path, by=1):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


DAMAGES = {   # what breaks the entry, and the reason the notice gives
    "truncated train.bin": (lambda out: truncate(out / "train.bin"), "train.bin has"),
    "deleted val.bin": (lambda out: (out / "val.bin").unlink(), "val.bin is missing"),
    "extra bytes in val.bin": (lambda out: open(out / "val.bin", "ab").write(b"\0\0"), "val.bin has"),
    "vocab_size too small": (lambda out: edit_meta(out, lambda m: m.update(vocab_size=10)), "is not below vocab_size 10"),
    "vocab_size too large": (lambda out: edit_meta(out, lambda m: m.update(vocab_size=70)), "its tokenizer has"),
    "dtype that does not fit": (lambda out: edit_meta(out, lambda m: m.update(dtype="uint32")), "dtype uint32 does not fit"),
    "meta.json not JSON": (lambda out: (out / "meta.json").write_text('{"format": 2,'), "meta.json cannot be read"),
    "meta.json not an object": (lambda out: (out / "meta.json").write_text("[]"), "not an object"),
    "a key missing": (lambda out: edit_meta(out, lambda m: m.pop("bytes")), "bytes is missing"),
    "a nested key missing": (lambda out: edit_meta(out, lambda m: m["tokens"].pop("val")), "tokens.val is missing"),
    "a wrong type": (lambda out: edit_meta(out, lambda m: m["tokens"].update(train="12")),
                     "tokens.train is not an integer"),
    "a negative count": (lambda out: edit_meta(out, lambda m: m["tokens"].update(val=-5)), "val.bin has"),
    "a damaged tokenizer": (lambda out: edit_meta(out, lambda m: m["tokenizer"].update(chars="")),
                            "damaged char tokenizer"),
    "an older format": (lambda out: edit_meta(out, lambda m: m.update(format=FORMAT - 1) or m.pop("bytes")),
                        f"is outdated (format {FORMAT - 1}; this code writes format {FORMAT})"),
    "no meta.json": (lambda out: (out / "meta.json").unlink(), "is unfinished"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_entry_is_prepared_again_with_a_notice(tmp_path, text_file, capsys, damage):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    good = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    change, reason = DAMAGES[damage]
    change(out)
    capsys.readouterr()

    with pytest.raises(DataError, match=rf"the prepared dataset {re.escape(str(out))} .*{re.escape(reason)}.*: delete it"):
        load_meta(out)   # where the text is not at hand: a one-line error that names the entry
    with pytest.raises(DataError, match="delete it"):
        BatchLoader(out, block_size=8, batch_size=2)

    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") == out
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"notice: {out} ") and reason in err and err.endswith("preparing it again"), err
    assert "\n" not in err
    assert {name: (out / name).read_bytes() for name in good} == good, "the same entry as before the damage"
    assert os.listdir(tmp_path / "prep") == [out.name], "no temporary dir left"


def test_a_sound_entry_is_reused_without_a_notice(tmp_path, text_file, capsys):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    stamp = os.stat(out / "train.bin").st_mtime_ns
    capsys.readouterr()
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") == out
    assert capsys.readouterr() == ("", "") and os.stat(out / "train.bin").st_mtime_ns == stamp
    meta = load_meta(out)
    assert meta["format"] == FORMAT and meta["max_token"] == max(
        np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]).max() for s in ("train", "val"))


def test_a_text_too_short_for_the_block_is_refused_before_it_is_published(tmp_path, text_file):
    short = tmp_path / "short.txt"
    short.write_text("abcdefghij" * 3)
    for tokenizer in ("char", "bpe:300"):
        with pytest.raises(DataError, match=r"the (train|val) split has \d+ tokens, fewer than block_size \+ 1 = 9; use a "
                                            r"longer text or a smaller --model.block_size"):
            prepare_text(short, tokenizer, 0.1, tmp_path / "prep", block_size=8)
        assert os.listdir(tmp_path / "prep") == [], "no entry and no temporary dir"
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")   # no block_size: no check
    with pytest.raises(DataError, match="the val split has 164 tokens, fewer than block_size"):
        prepare_text(text_file, "char", 0.1, tmp_path / "prep", block_size=200)   # a cache hit is checked too
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep", block_size=163) == out


def test_encoding_errors_are_part_of_the_cache_key(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(TEXT.encode() + b"\xff")
    replaced = prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="replace")
    assert load_meta(replaced)["encoding_errors"] == "replace"
    with pytest.raises(DataError, match="byte 0xff at offset"):
        prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="strict")
    assert load_meta(replaced)["encoding_errors"] == "replace", "kept"
    clean = tmp_path / "clean.txt"
    clean.write_text(TEXT)
    assert prepare_text(clean, "char", 0.1, tmp_path / "prep") != prepare_text(clean, "char", 0.1, tmp_path / "prep",
                                                                     encoding_errors="replace")
    with pytest.raises(ConfigError, match="data.encoding_errors='ignore' is not one of strict, replace"):
        prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="ignore")


def test_an_entry_of_another_text_under_the_same_name_is_not_used(tmp_path, text_file, capsys):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    edit_meta(out, lambda m: m.update(sha256="0" * 64))
    capsys.readouterr()
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") == out
    assert "holds another preparation (its sha256" in capsys.readouterr().err
    assert load_meta(out)["sha256"] != "0" * 64


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes, /dev/null and Unix sockets: POSIX")
def test_a_pipe_a_device_or_a_socket_is_not_a_data_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock_path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    try:
        cases = {"/dev/null": "character device", "/dev/zero": "character device", sock_path: "socket"}
        for path, kind in cases.items():
            with pytest.raises(DataError, match=rf"data path {path} is a {kind}, not a regular file"):
                prepare_text(path, "char", 0.1, tmp_path / "prep")
    finally:
        server.close()
    # A FIFO would block whoever opens it to read: a child process, so a hang fails the test.
    r = subprocess.run([sys.executable, "-m", "data.prepare", str(fifo), "--root", str(tmp_path / "prep")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == f"error: data path {fifo} is a named pipe (FIFO), not a regular file: " \
                                             f"save the text to a file and pass that\n", r.stderr
    (tmp_path / "docs").mkdir()   # in a directory, only regular files are documents
    os.mkfifo(tmp_path / "docs" / "pipe")
    (tmp_path / "docs" / "a.txt").write_text(TEXT)
    r = subprocess.run([sys.executable, "-m", "data.prepare", str(tmp_path / "docs"), "--root", str(tmp_path / "prep")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and load_meta(r.stdout.split(" -> ")[-1].strip())["files"] == 1, r.stderr


@pytest.mark.skipif(cache.WINDOWS, reason="asks whether a process lives with os.kill(pid, 0), which would end it on "
                    "Windows: there a directory's age decides (tests/test_windows_signals.py)")
def test_temporary_dirs_of_stopped_preparations_are_removed_and_live_ones_kept(tmp_path, text_file, capsys):
    root = tmp_path / "prep"
    root.mkdir()
    host = cache._host()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()   # reaped: its PID names no process now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    day_old = time.time() - cache.STALE_SECONDS - 60
    dirs = {   # name: (age in seconds or None for now, removed?)
        f".x-char-0123456789ab-val0.1.tmp-{dead.pid}@{host}-a1b2c3d4": (None, True),   # its process is gone
        f".x-char-0123456789ab-val0.1.tmp-{live.pid}@{host}-e5f6g7h8": (day_old, False),   # alive, however old
        f".y-gpt2-0123456789ab-val0.1.tmp-{os.getpid()}@{host}-zz_zz_zz": (None, False),  # this very process
        f".z-char-0123456789ab-val0.1.tmp-{dead.pid}@other.host-q1w2e3r4": (None, False),  # another host: by age
        f".z-char-0123456789ab-val0.1.tmp-{dead.pid}@other.host-t5y6u7i8": (day_old, True),
        ".w-char-0123456789ab-val0.1.tmp-k9l0m1n2": (day_old, True),   # no owner named: by age
        ".w-char-0123456789ab-val0.1.tmp-o3p4q5r6": (None, False),
        ".hidden-notes": (day_old, False),   # not a temporary dir of ours
        "v-char-0123456789ab-val0.1.tmp-s7t8u9v0": (day_old, False),   # not hidden: not ours
    }
    try:
        for name, (when, _) in dirs.items():
            (root / name).mkdir()
            (root / name / "train.bin").write_bytes(b"\0" * 10)
            if when:
                for p in (root / name / "train.bin", root / name):
                    os.utime(p, (when, when))
        out = prepare_text(text_file, "char", 0.1, root)
    finally:
        live.kill()
        live.wait()
    left = set(os.listdir(root)) - {out.name}
    assert left == {name for name, (_, removed) in dirs.items() if not removed}
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: removed")]
    assert len(notices) == 3 and any(f"by process {dead.pid}, which is gone" in n for n in notices), notices


def test_token_ids_past_the_vocabulary_in_a_file_of_the_right_size_are_one_line(tmp_path, text_file, capsys):
    """The cache's checks read meta.json and file sizes; a train.bin damaged in place is caught where its
    windows are read, before the embedding would fail on them."""
    import train as train_cli
    from tests.conftest import run_tool, tiny_overrides
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tokens[::7] = 60_000   # far past the 48 characters, same size, same dtype
    tokens.tofile(out / "train.bin")
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and err.count("\n") == 1 and f"{out} holds token id 60000 in train.bin" in err, err
    assert "delete it and prepare the data again" in err


def test_a_text_of_one_distinct_token_is_refused(tmp_path):
    """A file of NUL bytes (or any one character over and over) would train to a loss of 0 on nothing."""
    path = tmp_path / "zeros.txt"
    path.write_bytes(b"\0" * 5000)
    for tokenizer in ("char", "gpt2"):
        if tokenizer == "gpt2":
            gpt2_or_skip()   # (once the char case has passed)
        with pytest.raises(DataError, match=r"a single distinct token \(id \d+, '\\x00'\): there is nothing to learn"):
            prepare_text(path, tokenizer, 0.1, tmp_path / "prep")
    assert not list((tmp_path / "prep").glob("zeros*")), "nothing was kept"


def test_a_file_name_too_long_for_a_cache_entry_is_prepared(tmp_path):
    path = tmp_path / ("n" * 240 + ".txt")   # with the tokenizer, hash and split it would pass 255 bytes
    path.write_text(TEXT)
    assert load_meta(prepare_text(path, "char", 0.1, tmp_path / "prep"))["tokens"]["train"] > 0
