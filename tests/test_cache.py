"""The prepared-data cache never uses a damaged entry: it prepares it again (with a one-line notice),
or, where only the entry is at hand, names it in a one-line error. Text that cannot be used is
refused before anything is published; encoding errors are part of the key; the cache can be listed
and cleaned."""
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from data.cache import FORMAT, load_meta
from data.loader import BatchLoader
from common import UserError
from tests.conftest import ROOT, TEXT, gpt2_or_skip, prepare_text


def edit_meta(out, change):
    meta = json.loads((out / "meta.json").read_text())
    change(meta)
    (out / "meta.json").write_text(json.dumps(meta))


def truncate(path, by=1):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


DAMAGES = {   # what breaks the entry, and the reason the notice gives
    "truncated train.bin": (lambda out: truncate(out / "train.bin"), "train.bin is not the"),
    "deleted val.bin": (lambda out: (out / "val.bin").unlink(), "val.bin is not the"),
    "extra bytes in val.bin": (lambda out: open(out / "val.bin", "ab").write(b"\0\0"), "val.bin is not the"),
    "vocab_size too small": (lambda out: edit_meta(out, lambda m: m.update(vocab_size=10)), "is not below vocab_size 10"),
    "vocab_size too large": (lambda out: edit_meta(out, lambda m: m.update(vocab_size=70)),
                             "its tokenizer does not have vocab_size 70"),
    "dtype that does not fit": (lambda out: edit_meta(out, lambda m: m.update(dtype="uint32")), "dtype uint32 does not fit"),
    "meta.json not JSON": (lambda out: (out / "meta.json").write_text('{"format": 2,'), "meta.json cannot be read"),
    "meta.json not an object": (lambda out: (out / "meta.json").write_text("[]"), "not an object"),
    "a key missing": (lambda out: edit_meta(out, lambda m: m.pop("bytes")), "bytes is missing"),
    "a nested key missing": (lambda out: edit_meta(out, lambda m: m["tokens"].pop("val")), "tokens.val is missing"),
    "a wrong type": (lambda out: edit_meta(out, lambda m: m["tokens"].update(train="12")),
                     "tokens.train is not an integer"),
    "a negative count": (lambda out: edit_meta(out, lambda m: m["tokens"].update(val=-5)), "val.bin is not the"),
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

    with pytest.raises(UserError, match=rf"the prepared dataset {re.escape(str(out))} .*{re.escape(reason)}.*: delete it"):
        load_meta(out)   # where the text is not at hand: a one-line error that names the entry
    with pytest.raises(UserError, match="delete it"):
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
        with pytest.raises(UserError, match=r"the (train|val) split has \d+ tokens, fewer than block_size \+ 1 = 9; use a "
                                            r"longer text or a smaller --model.block_size"):
            prepare_text(short, tokenizer, 0.1, tmp_path / "prep", block_size=8)
        assert os.listdir(tmp_path / "prep") == [], "no entry and no temporary dir"
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")   # no block_size: no check
    with pytest.raises(UserError, match="the val split has 164 tokens, fewer than block_size"):
        prepare_text(text_file, "char", 0.1, tmp_path / "prep", block_size=200)   # a cache hit is checked too
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep", block_size=163) == out


def test_encoding_errors_are_part_of_the_cache_key(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(TEXT.encode() + b"\xff")
    replaced = prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="replace")
    assert load_meta(replaced)["encoding_errors"] == "replace"
    with pytest.raises(UserError, match="byte 0xff at offset"):
        prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="strict")
    assert load_meta(replaced)["encoding_errors"] == "replace", "kept"
    clean = tmp_path / "clean.txt"
    clean.write_text(TEXT)
    assert prepare_text(clean, "char", 0.1, tmp_path / "prep") != prepare_text(clean, "char", 0.1, tmp_path / "prep",
                                                                     encoding_errors="replace")
    with pytest.raises(UserError, match="data.encoding_errors='ignore' is not one of strict, replace"):
        prepare_text(path, "char", 0.1, tmp_path / "prep", encoding_errors="ignore")


def test_an_entry_of_another_text_under_the_same_name_is_not_used(tmp_path, text_file, capsys):
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    edit_meta(out, lambda m: m.update(sha256="0" * 64))
    capsys.readouterr()
    assert prepare_text(text_file, "char", 0.1, tmp_path / "prep") == out
    assert "holds another preparation (its sha256" in capsys.readouterr().err
    assert load_meta(out)["sha256"] != "0" * 64


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes, /dev/zero and Unix sockets: POSIX")
def test_a_pipe_a_device_or_a_socket_is_not_a_data_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    sock_path = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    try:
        for path in ("/dev/zero", sock_path):
            with pytest.raises(UserError, match=rf"data path {path} is not a regular file"):
                prepare_text(path, "char", 0.1, tmp_path / "prep")
    finally:
        server.close()
    # A FIFO would block whoever opens it to read: a child process, so a hang fails the test.
    r = subprocess.run([sys.executable, "-m", "data.prepare", str(fifo), "--root", str(tmp_path / "prep")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == f"error: data path {fifo} is not a regular file: save the text to a " \
                                             f"file and pass that\n", r.stderr
    (tmp_path / "docs").mkdir()   # in a directory, only regular files are documents
    os.mkfifo(tmp_path / "docs" / "pipe")
    (tmp_path / "docs" / "a.txt").write_text(TEXT)
    r = subprocess.run([sys.executable, "-m", "data.prepare", str(tmp_path / "docs"), "--root", str(tmp_path / "prep")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and load_meta(r.stdout.split(" -> ")[-1].strip())["files"] == 1, r.stderr


def data_prepare(*argv) -> str:
    """The stdout of `python -m data.prepare ARGV`, which must succeed."""
    r = subprocess.run([sys.executable, "-m", "data.prepare", *map(str, argv)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout


def test_the_cache_can_be_listed_and_cleaned(tmp_path, text_file):
    """--list: an entry a line (name, MB, tokenizer, source, tokens), a damaged one with what is wrong, and
    what a stopped preparation left; --clean removes them all (and nothing else) and says what it freed."""
    root = tmp_path / "prep"
    char, bpe = prepare_text(text_file, "char", 0.1, root), prepare_text(text_file, "bpe:300", 0.1, root)
    damaged = prepare_text(text_file, "char", 0.2, root)
    (damaged / "val.bin").unlink()
    leftover = root / f".{char.name}.tmp-0a1b2c3d"   # as a preparation killed with SIGKILL leaves it
    leftover.mkdir()
    (leftover / "train.bin").write_bytes(b"\0" * 300_000)
    (root / "notes.txt").write_text("mine")   # not the cache's: never listed nor removed
    meta = {entry: load_meta(entry) for entry in (char, bpe)}
    mb = {p.name: sum(f.stat().st_size for f in p.iterdir()) / 1e6 for p in (char, bpe, damaged, leftover)}

    lines = data_prepare("--list", "--root", root).splitlines()
    assert lines == sorted(lines[:-1]) + [f"4 entries, {sum(mb.values()):,.1f} MB in {root}"], lines
    for entry in (char, bpe):
        tokens = meta[entry]["tokens"]
        assert (f"{entry.name}  {mb[entry.name]:,.1f} MB  {meta[entry]['tokenizer_spec']}  {text_file}  "
                f"{tokens['train']:,} + {tokens['val']:,} tokens") in lines
    assert f"{damaged.name}  {mb[damaged.name]:,.1f} MB  is damaged (val.bin is not the" in "\n".join(lines)
    assert f"{leftover.name}  0.3 MB  left by a preparation that was stopped (or is still running); --clean " \
           f"removes it" in lines

    freed = f"{sum(mb.values()):,.1f} MB freed"
    assert data_prepare("--clean", "--root", root) == f"removed 4 entries from {root}: {freed}\n"
    assert os.listdir(root) == ["notes.txt"]
    assert data_prepare("--list", "--root", root) == f"0 entries, 0.0 MB in {root}\n"


def test_token_ids_past_the_vocabulary_in_a_file_of_the_right_size_are_one_line(tmp_path, text_file):
    """The cache's checks read meta.json and file sizes; a train.bin damaged in place is caught where its
    windows are read, before the embedding would fail on them: one line that names the entry."""
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prepared")
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    tokens[::7] = 60_000   # far past the 48 characters, same size, same dtype
    tokens.tofile(out / "train.bin")
    with pytest.raises(UserError) as e:
        BatchLoader(out, block_size=32, batch_size=8).step_windows()
    assert "\n" not in str(e.value) and f"{out} holds token id 60000 in train.bin" in str(e.value)
    assert "delete it and prepare the data again" in str(e.value)


def test_a_text_of_one_distinct_token_is_refused(tmp_path):
    """A file of NUL bytes (or any one character over and over) would train to a loss of 0 on nothing."""
    path = tmp_path / "zeros.txt"
    path.write_bytes(b"\0" * 5000)
    for tokenizer in ("char", "gpt2"):
        if tokenizer == "gpt2":
            gpt2_or_skip()   # (once the char case has passed)
        with pytest.raises(UserError, match=r"a single distinct token \(id \d+, '\\x00'\): there is nothing to learn"):
            prepare_text(path, tokenizer, 0.1, tmp_path / "prep")
    assert not list((tmp_path / "prep").glob("zeros*")), "nothing was kept"


def test_a_file_name_too_long_for_a_cache_entry_is_prepared(tmp_path):
    path = tmp_path / ("n" * 240 + ".txt")   # with the tokenizer, hash and split it would pass 255 bytes
    path.write_text(TEXT)
    assert load_meta(prepare_text(path, "char", 0.1, tmp_path / "prep"))["tokens"]["train"] > 0
