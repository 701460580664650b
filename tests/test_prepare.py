"""Streaming preparation: the same tokens as encoding the whole text, bounded memory, directories
and globs (and what they took), errors that name the byte, nothing left behind that looks finished,
and what the command says and makes (a cached dataset, the umask), run from any directory."""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
import data.cache
import data.prepare as prep
import data.sources
from common import UserError
from data.loader import BatchLoader, Share
from data.tokenizers import CharTokenizer, load_tokenizer
from tests.conftest import (ROOT, TEXT, assert_refused, gpt2_or_skip, prepare_text, prepared,
                            run_limited, run_tool)

TRICKY = ("CRLF\r\nlines\r\n  two  spaces\n\n\nx.\ny 123 456\n\t tab \n   \n"
          + "héllo wörld ✓ 😀 <|endoftext|> it's 've\n" * 3)


@pytest.mark.parametrize("tokenizer", ["char", "gpt2", "bpe:300"])
def test_streaming_gives_the_tokens_of_the_whole_text(tmp_path, small_reads, tokenizer):
    text = TEXT[:1200] + TRICKY + TEXT[1200:]
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    if tokenizer == "gpt2":
        gpt2_or_skip()
    out = prepare_text(path, tokenizer, 0.2, tmp_path / "prep")
    split = int(len(text) * 0.8)
    (train, val), meta = prepared(out)
    # bpe:300: as trained, applied to the whole text
    tok = CharTokenizer.from_text(text) if tokenizer == "char" else load_tokenizer(meta["tokenizer"])
    assert train == tok.encode(text[:split]) and val == tok.encode(text[split:])
    assert meta["split"] == {"val_fraction": 0.2, "train_chars": split, "val_chars": len(text) - split}
    assert meta["tokens"] == {"train": len(train), "val": len(val)} and meta["dtype"] == "uint16"
    assert len(meta["sha256"]) == 64


def test_a_bad_byte_deep_in_the_file_is_named_by_its_offset(tmp_path, small_reads, capsys):
    path = tmp_path / "bad.txt"
    path.write_bytes(TEXT[:1000].encode() + b"\xff" + TEXT[1000:].encode())
    with pytest.raises(UserError, match=r"byte 0xff at offset 1000; set --data.encoding_errors=replace"):
        prepare_text(path, "char", 0.1, tmp_path / "prep")
    assert not (tmp_path / "prep").exists() or not os.listdir(tmp_path / "prep")
    prep.main([str(path), "--root", str(tmp_path / "prep"), "--data.encoding_errors=replace"])   # as advised
    out = Path(capsys.readouterr().out.splitlines()[0].split(" -> ")[-1].strip())
    (train, _), meta = prepared(out)
    assert load_tokenizer(meta["tokenizer"]).decode(train)[1000] == "\ufffd"


def test_a_binary_file_is_told_to_be_left_out_not_replaced(tmp_path):
    """Reading a binary file with encoding_errors=replace would train on junk: a file with a NUL byte
    near its start (a compiled .mo catalogue here) is said to look binary, with a glob that leaves it
    out, in one line."""
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text(TEXT)
    mo = tmp_path / "books" / "messages.mo"
    mo.write_bytes(b"\xde\x12\x04\x95\x00\x00\x00\x00\x02\x00\x00\x00\x1c\x00" + b"\xff\xfe msgid" * 20)
    with pytest.raises(UserError) as e:
        prepare_text(tmp_path / "books", "char", 0.1, tmp_path / "prep")
    assert str(e.value) == (f"{mo} is not UTF-8: byte 0xde at offset 0; it looks binary: leave it out of "
                            f"the data (e.g. with a glob such as '{mo.parent}/*.txt')"), e.value
    out = prepare_text(tmp_path / "books" / "*.txt", "char", 0.1, tmp_path / "prep")   # as advised
    (train, _), meta = prepared(out)
    assert load_tokenizer(meta["tokenizer"]).decode(train) == TEXT[:int(len(TEXT) * 0.9)]


def prepare_command(*argv, umask=None):
    """(exit code, stdout, stderr) of `python <repository>/data/prepare.py ARGV` run as a user runs
    it, from another directory."""
    r = subprocess.run([sys.executable, ROOT / "data" / "prepare.py", *map(str, argv)],
                       cwd=argv[0].parent, capture_output=True, text=True, timeout=120,   # (beside the text)
                       preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
    return r.returncode, r.stdout, r.stderr


def test_a_directory_or_a_glob_says_what_it_took(tmp_path, capsys):
    """A stray script among the books is in the data: the command says so, in one line, before it works."""
    books = tmp_path / "books"
    books.mkdir()
    for name in ("a.txt", "b.txt"):
        (books / name).write_text(TEXT)
    (books / "extract.py").write_text("import sys\nprint(sys.argv)\n")
    rc, out, err = run_tool(prep, [books, "--root", tmp_path / "prep"], capsys)
    size = sum(p.stat().st_size for p in books.iterdir()) / 1e6
    assert rc == 0 and out.splitlines()[0] == f"data: {books} (3 files: 2 .txt, 1 .py; {size:.1f} MB)", err
    rc, out, err = run_tool(prep, [books / "*.txt", "--root", tmp_path / "prep"], capsys)
    assert rc == 0 and out.splitlines()[0].startswith(f"data: {books}/*.txt (2 files: 2 .txt; "), (out, err)
    rc, out, err = run_tool(prep, [books / "a.txt", "--root", tmp_path / "prep"], capsys)
    assert rc == 0 and not out.startswith("data:"), "a single file needs no summary"


def test_a_cached_dataset_is_said_to_be_prepared_already(tmp_path, text_file, capsys):
    rc, first, err = run_tool(prep, [text_file, "--root", tmp_path / "prep"], capsys)
    assert rc == 0 and first.startswith(f"prepared {text_file}"), (first, err)
    out = first.splitlines()[0].split(" -> ")[-1].strip()
    meta = json.loads((tmp_path / "prep" / os.path.basename(out) / "meta.json").read_text())
    rc, again, err = run_tool(prep, [text_file, "--root", tmp_path / "prep"], capsys)
    assert rc == 0 and err == ""
    tokens = meta["tokens"]
    assert again == f"ready: {out} ({tokens['train']:,} train and {tokens['val']:,} val tokens)\n"
    assert first.splitlines()[1] == again.strip(), "said after a preparation too"


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes and umask")
def test_a_prepared_dataset_has_the_mode_the_umask_gives(tmp_path, text_file):
    """Like any file a command writes: with umask 022 others may read it (a shared cache), with 077 not."""
    for umask, dir_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
        root = tmp_path / f"prep{umask:o}"
        rc, out, err = prepare_command(text_file, "--root", root, umask=umask)
        assert rc == 0, err
        entry = next(root.iterdir())
        assert entry.stat().st_mode & 0o777 == dir_mode, oct(entry.stat().st_mode)
        assert {f.name: f.stat().st_mode & 0o777 for f in entry.iterdir()} == dict.fromkeys(
            ("train.bin", "val.bin", "meta.json"), file_mode)


def test_a_directory_or_a_glob_is_one_dataset(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("First document.\n")
    (docs / "b.txt").write_text("   \n")                    # blank: skipped
    (docs / "sub" / "c.txt").write_text("Third, in a subfolder.")
    (docs / ".hidden").write_text("never read")
    out = prepare_text(docs, "char", 0.1, tmp_path / "prep")
    (train, val), meta = prepared(out)
    tok = load_tokenizer(meta["tokenizer"])
    assert tok.decode(train + val) == "First document.\n\nThird, in a subfolder." and meta["files"] == 3

    gpt2_or_skip()
    out = prepare_text(docs, "gpt2", 0.1, tmp_path / "prep")
    (train, val), meta = prepared(out)
    tok = load_tokenizer(meta["tokenizer"])
    assert tok.decode(train + val) == "First document.\n<|endoftext|>Third, in a subfolder."
    assert (train + val).count(tok.start_token) == 1   # the real end-of-text token, once

    out = prepare_text(tmp_path / "docs" / "*.txt", "char", 0.1, tmp_path / "prep")
    (train, val), meta = prepared(out)
    assert load_tokenizer(meta["tokenizer"]).decode(train + val) == "First document.\n"


def test_in_a_directory_only_regular_files_are_documents(tmp_path):
    """A pipe in the data folder would never end: it is no document."""
    (tmp_path / "docs").mkdir()
    os.mkfifo(tmp_path / "docs" / "pipe")
    with pytest.raises(UserError, match="no files in the data directory"):
        prepare_text(tmp_path / "docs", "char", 0.1, tmp_path / "prep")


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01\xff binary", "is not UTF-8: byte 0xff at offset 2; it looks binary"),
    (b" \n\t\n", "data file is empty"),
], ids=["binary", "blank"])
def test_a_text_that_cannot_be_used_is_one_line_and_writes_nothing(tmp_path, text_file, capsys, content,
                                                                  message):
    """Refused before anything is written: not even a temporary directory comes and goes in the cache."""
    prepare_text(text_file, "char", 0.1, tmp_path / "prep")   # a cache that exists already
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    assert_refused(prep, [bad, "--root", tmp_path / "prep"], capsys, tmp_path, message)


@pytest.mark.parametrize("fraction", ["0", "1", "-0.1", "nan"])
def test_the_command_refuses_a_val_fraction_outside_0_to_1(tmp_path, text_file, fraction):
    with pytest.raises(UserError, match=r"data\.val_fraction must be .*, got"):
        prep.main([str(text_file), "--val-fraction", fraction, "--root", str(tmp_path / "prep")])
    assert not (tmp_path / "prep").exists()


def test_an_interrupted_preparation_leaves_nothing_that_looks_finished(tmp_path, text_file, monkeypatch,
                                                                      small_reads):
    """Ctrl-C while the token files are being written: the temporary directory goes with it."""
    calls = []
    real = CharTokenizer.encode_array

    def failing(self, text):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, text)
    monkeypatch.setattr(CharTokenizer, "encode_array", failing)
    with pytest.raises(KeyboardInterrupt):
        prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    assert os.listdir(tmp_path / "prep") == [], "no dataset dir and no temporary dir"
    monkeypatch.setattr(CharTokenizer, "encode_array", real)
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    assert CharTokenizer.from_text(TEXT).decode(prepared(out)[0][0]) == TEXT[:int(len(TEXT) * 0.9)]


def test_a_killed_preparation_s_folder_is_removed_by_the_next(tmp_path, text_file):
    """kill -9 (or a power cut) leaves the temporary folder: the next preparation removes those of
    processes on this machine that are gone, and keeps a running one's (and another machine's)."""
    root = tmp_path / "prep"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    left = [root / f".{name}-char-0123456789ab-val0.1{prep.TMP}{pid}-0a1b2c3d"
            for name, pid in (("dead", gone), ("live", os.getpid()))]
    left.append(root / f".other.tmp-another-host-{gone}-0a1b2c3d")
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "train.bin").write_bytes(bytes(1000))
    prepare_text(text_file, "char", 0.1, root)
    assert [folder.exists() for folder in left] == [False, True, True]


@pytest.mark.parametrize("tokenizer, phases", [("char", ["hashing", "scanning", "encoding"]),
                                               ("bpe:300", ["training the tokenizer", "encoding"])])
def test_progress_shows_throughput_on_stderr(tmp_path, text_file, monkeypatch, capsys, tokenizer,
                                             phases):
    """(A log gets a progress line every 10 s: here every reading of the clock is 20 s after the
    last.) bpe:N's training is the tokenizer's, not the model's."""
    monkeypatch.setattr(data.cache, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(common.time, "perf_counter", lambda clock=itertools.count(): 20.0 * next(clock))
    prepare_text(text_file, tokenizer, 0.1, tmp_path / "prep")
    err = capsys.readouterr().err
    assert all(f"\n{phase}: " in "\n" + err for phase in phases), err
    assert "MB/s, ETA" in err, err


def test_memory_does_not_grow_with_the_file(tmp_path):
    """The bound: preparing 30 MB takes less than 40 MB more peak memory than preparing 3 MB. A piece
    of at most 2M characters is being encoded at a time, at ~8 bytes a character (text, code points,
    ids); reading the file whole costs ~10 bytes a character, 300 MB here. Peak memory is the child
    process's own (os.wait4)."""
    line = (TEXT.replace("\n", " ") + "\n").encode()
    peaks = []
    for name, size in (("small", 3_000_000), ("big", 30_000_000)):
        (tmp_path / f"{name}.txt").write_bytes(line * (size // len(line)))
        rc, _, err, peak = run_limited(["data/prepare.py", tmp_path / f"{name}.txt", "--root", tmp_path / "p"])
        assert rc == 0, err
        peaks.append(peak / 1e6)
    assert len(list((tmp_path / "p").glob("*/meta.json"))) == 2
    assert peaks[1] - peaks[0] < 40, f"peak memory grew from {peaks[0]:.0f} to {peaks[1]:.0f} MB"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads resident memory from Linux's "
                    "/proc (and a 2 GB sparse file)")
def test_batches_are_read_from_disk_not_memory(tmp_path, text_file, monkeypatch):
    """2 GB (sparse) token files, more than a quarter of the memory free: a batch costs the batch, not
    the file."""
    import data.loader
    monkeypatch.setattr(data.loader, "free_memory", lambda device: 1 << 30)
    out = prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    meta = json.loads((out / "meta.json").read_text())
    n = 1 << 30
    for split in ("train", "val"):
        with open(out / f"{split}.bin", "wb") as f:
            f.truncate(2 * n)
    meta["tokens"] = {"train": n, "val": n}
    (out / "meta.json").write_text(json.dumps(meta))

    def rss_mb():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
    before = rss_mb()
    share = Share(grad_accum=2, rank=1, world=2)
    loader = BatchLoader(out, block_size=256, batch_size=16, share=share)
    assert not loader.resident
    for _ in range(2):
        assert loader.step_windows().shape == (2, 16, 257)
        loader.batch("val", torch.Generator())
    assert rss_mb() - before < 100


@pytest.mark.parametrize("more", ["More words.\n", "Жар-птица: characters the vocabulary lacks\n"])
def test_a_text_that_changes_while_it_is_prepared_is_refused_and_nothing_is_kept(tmp_path, text_file,
                                                                                 monkeypatch, more):
    """The entry is named after the bytes hashed first: a text grown meanwhile would be cached under
    a name that is not its own. What grew is said, not what the encoder made of it (an unknown
    character)."""
    import data.prepare
    real_scan = data.prepare.scan

    def scan_then_grow(files, *args):
        counted = real_scan(files, *args)
        with open(files[0], "a") as f:
            f.write(more)
        return counted
    monkeypatch.setattr(data.prepare, "scan", scan_then_grow)
    with pytest.raises(UserError, match=f"^{text_file} changed while it was prepared: try again"):
        prepare_text(text_file, "char", 0.1, tmp_path / "prep")
    assert list((tmp_path / "prep").iterdir()) == []
