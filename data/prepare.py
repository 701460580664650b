"""Turn text (a file, a directory of files, or a glob) into train/val token files and a meta.json: an
entry of the cache (data/cache.py), reused when the same bytes are prepared with the same settings.

  streaming  the text is never held whole: each pass reads the files a chunk at a time, so memory
             stays bounded (tens of MB) whatever the size of the text and the number of cores
  passes     1 hash    the sha256 of the bytes: the cache key (a cache hit costs only this pass)
             2 scan    decode (a bad byte is an error naming its offset), count the characters (the
                       split point is a character index) and, for char, collect the vocabulary
             3 train   bpe:N only: learn the BPE from the training split (data/tokenizers.py)
             4 encode  pieces of text are encoded on a thread pool (tiktoken and numpy release the
                       GIL, so every core works), 2 x workers pieces at a time, the next batch while
                       the last is written in order. Passes 2-4 read the bytes pass 1 hashed (a text
                       that grows meanwhile is read as it was) and hash them again: an entry holds
                       exactly the bytes it is named after
  split      the last val_fraction of the characters is the validation split
  documents  several files are one text in sorted path order, with the end-of-text token (BPE) or a
             newline (char) between documents; a blank file among them is skipped
  BPE        its text is cut only where cutting does not change the tokens (safe_cut)
  signals    SIGINT, SIGTERM and SIGHUP remove the temporary directory and end with one line

    python -m data.prepare FILE|DIR|GLOB [--tokenizer char|gpt2|bpe:4096] [--val-fraction 0.1] [--root data/prepared]
    python -m data.prepare --list | --clean [--root data/prepared]
"""
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice, takewhile
from pathlib import Path

import numpy as np

from common import ArgumentParser, Progress, UserError, atomic_write, check, on_stop_signals, os_error, run_cli, setting, unwind_on_stop
from data.cache import (FORMAT, SPLITS, check_split_sizes, clean, entry_name, list_entries, make_temp_dir, publish,
                        read_entry, token_dtype)
from data.sources import combined_sha256, describe, find_sources, iter_text, sha256
from data.tokenizers import CharTokenizer, bpe_vocab_size, build_tokenizer, check_tokenizer_spec, code_points, \
    load_tokenizer, train_bpe

PIECE_CHARS = 1 << 20       # characters per encoding task at most (fewer where many cores share IN_FLIGHT_CHARS)
IN_FLIGHT_CHARS = 4 << 20   # characters read, being encoded or waiting to be written, whatever the core count
MAX_WORKERS = 32
TRAIN_MAX_CHARS = 256_000_000   # bpe:N learns from the first 256M characters of the train split at most
PROGRESS_MIN_BYTES = 64 << 20   # a progress line for inputs at least this large


@dataclass
class DataConfig:
    path: str = setting("data/tinyshakespeare.txt", "the text to train on: a file, a directory or a glob (the "
                        "default ships with the repo: data/README.md says where it comes from)")
    tokenizer: str = setting("char", "char | bpe:N (N tokens, trained on the data) | a tiktoken name (gpt2, ...)")
    val_fraction: float = setting(0.1, "the last 10% of the text is the validation split")
    prepared_dir: str = setting("data/prepared", "where prepared token files are cached")
    encoding_errors: str = setting("strict", "strict | replace: what to do with non-UTF-8 bytes")

    def validate(self) -> None:
        """A UserError (or UserError) naming the data setting that cannot be used; the text
        itself is checked as it is prepared."""
        check("data.val_fraction", self.val_fraction, above=0.0, below=1.0)
        check("data.encoding_errors", self.encoding_errors, one_of=("strict", "replace"))
        check_tokenizer_spec(self.tokenizer)


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def mb_progress(label: str, total: int) -> Progress:
    """A progress line in MB on stderr, for an input of at least PROGRESS_MIN_BYTES."""
    return Progress(label, total, "MB", lambda n: f"{n / 1e6:.1f}", quiet=total < PROGRESS_MIN_BYTES)


def prepare(data: DataConfig, block_size: int | None = None, say_cached: bool = False) -> Path:
    """Prepare data.path, or reuse a sound earlier preparation of the same bytes with the same settings
    (say_cached: and say so); the dataset's directory. block_size: each split must hold block_size + 1
    tokens (one training window), checked before anything is published."""
    data.validate()
    files = find_sources(data.path)
    stop = unwind_on_stop(lambda signum: f"preparing {data.path} stopped by {signal.Signals(signum).name}; "
                                         f"nothing was kept")
    with on_stop_signals(stop):
        total = sum(p.stat().st_size for p in files)
        sha, sizes = sha256(files, mb_progress("hashing", total))
        source, root = Path(data.path), Path(data.prepared_dir)
        stem = source.parent.name if glob.has_magic(str(source)) else source.stem
        out = root / entry_name(stem, data.tokenizer, sha, data.val_fraction, data.encoding_errors)
        expect = {"sha256": sha, "tokenizer_spec": data.tokenizer, "val_fraction": data.val_fraction,
                  "encoding_errors": data.encoding_errors}
        meta, problem = read_entry(out, expect)
        if not source.is_file() and (say_cached or meta is None):   # what a directory or glob took
            print(describe(source, files, total))
        if meta is not None:
            check_split_sizes(meta["tokens"], block_size)
            if say_cached:
                print(f"already prepared: {out} ({meta['tokens']['train']:,} train and {meta['tokens']['val']:,} "
                      f"val tokens)")
            return out
        if problem:
            print(f"notice: {out} {problem}; preparing it again", file=sys.stderr)
        meta = build(out, expect, files, sizes, data, block_size)
    print(f"prepared {data.path} with tokenizer {data.tokenizer}: {meta['tokens']['train']:,} train and "
          f"{meta['tokens']['val']:,} val tokens (vocab {meta['vocab_size']:,}) -> {out}")
    return out


def build(out: Path, expect: dict, files: list[Path], sizes: list[int], data: DataConfig, block_size) -> dict:
    """Passes 2 to 4 over the files' first `sizes` bytes: the entry at out, and its meta.json. Nothing
    is written before pass 4, so a text that cannot be used leaves no trace."""
    char, total = data.tokenizer == "char", sum(sizes)
    counts, chars = scan(files, sizes, data.encoding_errors, char, mb_progress("scanning", total))
    documents = sum(map(bool, counts))   # (the files with any text)
    n_chars = sum(counts) + (documents - 1 if char else 0)   # char: + the newlines between documents
    split_at = int(n_chars * (1.0 - data.val_fraction))
    workers = min(MAX_WORKERS, available_cpus())
    piece_chars = min(PIECE_CHARS, IN_FLIGHT_CHARS // (8 * workers))   # 2 batches of 2 x workers pieces in flight

    def text(label: str, train_chars: int, hashes=None):   # (split, piece) pairs, train_chars in "train"
        return pieces(files, sizes, counts, data.encoding_errors, train_chars, not char, piece_chars, hashes,
                      mb_progress(label, total))
    if char:   # with the newline between documents, which none of them may hold
        tok = CharTokenizer("".join(sorted(set(chars) | {"\n"})) if documents > 1 else chars)
    elif bpe_vocab_size(data.tokenizer) is None:
        tok = build_tokenizer(data.tokenizer)
    else:
        train_split = text("training", min(split_at, TRAIN_MAX_CHARS))
        tok = trained(data.tokenizer, takewhile(lambda item: item[0] == "train", train_split), workers)
    hashes = [hashlib.sha256() for _ in files]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(out)
        try:
            try:
                encoded = encode(text("encoding", split_at, hashes), tok, tmp, workers)
            except UserError:   # (char) a character the scan did not see: the text changed meanwhile
                encoded = None
            if encoded is None or combined_sha256(files, hashes) != expect["sha256"]:   # not the bytes hashed
                raise UserError(f"{data.path} changed while it was being prepared; nothing was kept: prepare it "
                                f"again once it no longer changes")
            check_split_sizes(encoded["tokens"], block_size)   # before publishing: a refused text leaves nothing
            meta = {"format": FORMAT, "source": str(Path(data.path).absolute()), "sha256": expect["sha256"],
                    "files": len(files), "tokenizer_spec": data.tokenizer, **encoded,
                    "encoding_errors": data.encoding_errors,
                    "split": {"val_fraction": data.val_fraction, "train_chars": split_at,
                              "val_chars": n_chars - split_at}}
            atomic_write(tmp / "meta.json", json.dumps(meta, indent=1))
            publish(tmp, out, expect)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:   # a full disk, a read-only or misplaced data.prepared_dir
        raise UserError(f"cannot write the prepared data to {out.parent}: {os_error(e)}") from None
    return meta


def scan(files, sizes, errors: str, want_chars: bool, progress) -> tuple[list[int], str | None]:
    """Pass 2: characters per file (0 for a blank one) and (want_chars) the sorted set of them all."""
    seen = np.zeros(0x110000, dtype=bool) if want_chars else None
    counts = []
    for path, size in zip(files, sizes):
        n, blank = 0, True
        for text in iter_text(path, errors, size, progress=progress):
            n, blank = n + len(text), blank and text.isspace()
            if want_chars:
                seen[code_points(text)] = True
        counts.append(0 if blank else n)
    if not any(counts):
        raise UserError(f"data file is empty: {files[0]}" if len(files) == 1 else
                        f"the data files are all empty ({len(files)} files, first {files[0]})")
    return counts, "".join(map(chr, np.flatnonzero(seen))) if want_chars else None


def trained(spec: str, train_split, workers: int):
    """Pass 3: the bpe:N tokenizer trained on the (split, piece) pairs of the train split."""
    vocab_size = bpe_vocab_size(spec)
    tok_meta, took = train_bpe((piece for _, piece in train_split if piece), vocab_size, batch=2 * workers)
    tok = load_tokenizer(tok_meta)
    short = "" if tok.vocab_size == vocab_size else " (the text has too few distinct pairs for more)"
    print(f"trained {spec} on the train split in {took:.1f} s: {tok.vocab_size:,} tokens{short}")
    return tok


# Cutting BPE input at these points gives the same tokens as encoding the whole text: no token of the
# gpt2 / cl100k / o200k pre-tokenizers (nor bpe:N's) runs across "x\n|y" or "x| y" (x, y not whitespace).
# The greedy .* makes a match end at the last such point.
_LAST_SAFE_CUT = re.compile(r".*(?:\S\n(?=\S)|\S(?= \S))", re.DOTALL)


def safe_cut(text: str) -> int:
    """The last index (> 0) at which text can be cut without changing its BPE tokens; 0 if none."""
    m = _LAST_SAFE_CUT.match(text)
    return m.end() if m else 0


def pieces(files, sizes, counts, errors: str, split_at: int, bpe: bool, piece_chars: int, hashes=None, bar=None):
    """The text as (split, piece) in order: its first split_at characters in "train", the rest in "val";
    between documents a piece of its own: a newline (char) or None, the end-of-text token (BPE). A piece holds
    piece_chars to 2 x piece_chars characters (fewer at a document's end or the split point); BPE's
    are cut at a safe_cut point. hashes: a hashlib object per file, given every byte read."""
    split, pos, buffer = "train", 0, ""
    last = max(i for i, count in enumerate(counts) if count)   # the last document (a blank one is left out)
    for i, (path, size) in enumerate(zip(files, sizes)):
        for text in iter_text(path, errors, size, piece_chars, hashes and hashes[i], bar):
            if not counts[i]:   # a blank document: read for its hash, and left out
                continue
            if split == "train" and pos + len(text) >= split_at:   # the end of the train split
                head, text = buffer + text[:split_at - pos], text[split_at - pos:]
                if head:
                    yield split, head
                split, buffer = "val", ""
            pos += len(text)
            buffer += text
            if len(buffer) >= piece_chars:   # (no safe cut in a whole piece: cut anyway)
                end = (safe_cut(buffer) or len(buffer)) if bpe else len(buffer)
                yield split, buffer[:end]
                buffer = buffer[end:]
        if counts[i] and i < last:   # between documents
            if buffer:
                yield split, buffer
            yield split, None if bpe else "\n"
            buffer, pos = "", pos if bpe else pos + 1   # (a newline is a character of the text; the token is not)
    if buffer:
        yield split, buffer


def encode(items, tok, tmp: Path, workers: int) -> dict:
    """Encode pieces on a thread pool (2 x workers at a time, the next batch while the last one is
    written) and append their ids to tmp/<split>.bin in order; the meta entries that describe them."""
    eot = tok.end_token
    dtype = token_dtype(tok.vocab_size)
    tok.encode_array("")   # build any lookup table before the threads share the tokenizer
    tokens, nbytes, ranges = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0), []

    def encode_one(item):   # (a piece is never empty)
        split, text = item
        ids = tok.encode_array(text) if text is not None else np.array([eot])
        size = 0 if text is None else len(text) if text.isascii() else len(text.encode("utf-8"))
        return split, ids.astype(dtype, copy=False), size, (int(ids.min()), int(ids.max()))   # before the cast

    def write(results):
        for split, ids, size, id_range in results:
            ids.tofile(files[split])
            tokens[split], nbytes[split] = tokens[split] + len(ids), nbytes[split] + size
            ranges.append(id_range)

    with ThreadPoolExecutor(workers) as pool, open(tmp / "train.bin", "wb") as train, \
            open(tmp / "val.bin", "wb") as val:
        files, last = {"train": train, "val": val}, []
        while batch := list(islice(items, 2 * workers)):
            now = pool.map(encode_one, batch)   # encoded while the last batch is written
            write(last)
            last = now
        write(last)
    low, high = min(low for low, _ in ranges), max(high for _, high in ranges)
    if low == high:
        raise UserError(f"the text holds a single distinct token (id {high}, {tok.decode([high])!r}): there is "
                        f"nothing to learn to predict")
    return {"tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name, "max_token": high,
            "tokens": tokens, "bytes": nbytes}


def main(argv: list[str]) -> int:
    p = ArgumentParser(description="Prepare a text file, directory or glob into token files; list or clean the "
                                   "prepared datasets.")
    p.add_argument("source", nargs="?", help="a text file, a directory of them, or a quoted glob")
    p.add_argument("--tokenizer", default=DataConfig.tokenizer, help="char | bpe:N (trained on the data) | a "
                   "tiktoken encoding")
    p.add_argument("--val-fraction", type=float, default=DataConfig.val_fraction)
    p.add_argument("--root", default=Path(__file__).resolve().parent / "prepared",
                   help="where the prepared datasets are (default: the repository's data/prepared)")
    p.add_argument("--encoding-errors", default=DataConfig.encoding_errors, help="strict | replace")
    p.add_argument("--block-size", type=int, default=None, help="refuse splits shorter than block_size + 1 tokens")
    p.add_argument("--list", action="store_true", help="list the prepared datasets in --root")
    p.add_argument("--clean", action="store_true", help="remove every prepared dataset in --root")
    args = p.parse_args(argv)
    if args.list or args.clean:
        (clean if args.clean else list_entries)(Path(args.root))
        return 0
    if args.source is None:
        p.error("name the text to prepare (FILE, DIR or GLOB), or give --list or --clean")
    data = DataConfig(args.source, args.tokenizer, args.val_fraction, args.root, args.encoding_errors)
    prepare(data, args.block_size, say_cached=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
