"""Turn text (a file, a directory of files, or a glob) into train/val token files plus a meta.json: an
entry of the cache (data/cache.py: its layout and checks), reused when the same text is prepared with
the same settings again.

The text is streamed, never held whole, so memory stays bounded (a few hundred MB at most) whatever
its size and the number of cores. The passes over the bytes:
  1. hash      sha256 of the bytes: the cache key (a cache hit costs only this pass)
  2. scan      decode UTF-8 (a bad byte is an error naming its offset), count the characters (the
               split point is a character index), and for `char` collect the vocabulary
  3. train     for `bpe:N` only: learn the BPE from the training split (data/tokenizers.py)
  4. encode    pieces of text are tokenized on a thread pool (tiktoken and the numpy lookup of the
               char tokenizer release the GIL, so all cores work) and written in order; at most
               IN_FLIGHT_CHARS characters are in flight, split into more, smaller pieces on more cores
The last val_fraction of the characters is the validation split. Several files are one text, in
sorted path order, with the end-of-text token between documents (BPE) or a newline (char).
SIGINT, SIGTERM and SIGHUP during preparation remove the entry's temporary directory and raise
Interrupted; one a killed run leaves is removed by the next preparation in the same root.

    python -m data.prepare FILE|DIR|GLOB [--tokenizer char|gpt2|bpe:4096] [--val-fraction 0.1] [--root data/prepared]

(Over 300 lines on purpose: one streaming pipeline, its passes in the order they run.)
"""
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import (setting, ArgumentParser, DataError, Progress, TokenizerError, atomic_write, check, on_stop_signals,
                    run_cli, unwind_on_stop)
from data.cache import (FORMAT, check_split_sizes, entry_name, make_temp_dir, publish, read_entry,
                        remove_stale_temp_dirs, token_dtype)
from data.sources import combined_sha256, find_sources, iter_text, sources_sha256
from data.tokenizers import (CharTokenizer, bpe_vocab_size, build_tokenizer, check_tokenizer_spec, code_points,
                             load_tokenizer, train_bpe)

PIECE_CHARS = 1 << 20       # characters per encoding task (fewer where many cores share IN_FLIGHT_CHARS)
IN_FLIGHT_CHARS = 4 << 20   # characters being encoded or waiting to be written, whatever the core count
MAX_WORKERS = 32
PROGRESS_MIN_BYTES = 64 << 20   # show a progress bar for inputs at least this large


def mb_progress(label: str, total: float, input_bytes: int) -> Progress:
    """A progress line in MB, for an input of at least PROGRESS_MIN_BYTES (a smaller one takes a moment)."""
    return Progress(label, total, "MB", lambda n: f"{n / 1e6:.1f}", quiet=input_bytes < PROGRESS_MIN_BYTES)


@dataclass
class DataConfig:
    path: str = setting("data/tinyshakespeare.txt", "the text to train on: a file, a directory or a glob (the default ships with the repo: data/README.md says where it comes from)")
    tokenizer: str = setting("char", "char | bpe:N (N tokens, trained on the data) | a tiktoken name (gpt2, ...)")
    val_fraction: float = setting(0.1, "the last 10% of the text is the validation split")
    prepared_dir: str = setting("data/prepared", "where prepared token files are cached")
    encoding_errors: str = setting("strict", "strict | replace: what to do with non-UTF-8 bytes")

    def validate(self) -> None:
        """A ConfigError (or TokenizerError) naming the data setting that cannot be used; the text
        itself is checked as it is prepared."""
        check("data.val_fraction", self.val_fraction, above=0.0, below=1.0)
        check("data.encoding_errors", self.encoding_errors, one_of=("strict", "replace"))
        check_tokenizer_spec(self.tokenizer)


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def scan(files: list[Path], errors: str, want_chars: bool, progress) -> tuple[list[int], str | None]:
    """Characters per file and (want_chars) the sorted set of all characters, in one streaming pass."""
    seen = np.zeros(0x110000, dtype=bool) if want_chars else None
    counts = []
    for path in files:
        n, blank = 0, True
        for text in iter_text(path, errors, progress):
            n += len(text)
            blank = blank and not text.strip()
            if want_chars:
                seen[code_points(text)] = True
        if blank and len(files) == 1:
            raise DataError(f"data file is empty: {path}")
        counts.append(0 if blank else n)   # a blank document in a directory is skipped
    if not any(counts):
        raise DataError(f"the data files are all empty ({len(files)} files, first {files[0]})")
    chars = "".join(map(chr, np.flatnonzero(seen))) if want_chars else None
    return counts, chars


# Cutting BPE input at these points gives the same tokens as encoding the whole text: no token of the
# gpt2 / cl100k / o200k pre-tokenizers (nor bpe:N's) runs across "x\n|y" or "x| y" (x, y not whitespace).
# The greedy .* makes a match end at the last such point.
_LAST_SAFE_CUT = re.compile(r".*(?:\S\n(?=\S)|\S(?= \S))", re.DOTALL)


def safe_cut(text: str) -> int:
    """The last index (> 0) at which text can be cut without changing its BPE tokens; 0 if none."""
    m = _LAST_SAFE_CUT.match(text)
    return m.end() if m else 0


def _cut(buffer: str, piece_chars: int, bpe: bool, final: bool) -> tuple[list[str], str]:
    """(whole pieces of buffer, the rest); with final, the rest is a piece too."""
    out, start = [], 0
    while len(buffer) - start >= piece_chars:
        window = buffer[start:start + piece_chars]
        cut = (safe_cut(window) if bpe else 0) or piece_chars   # no safe cut in a whole piece: cut anyway
        out.append(window[:cut])
        start += cut
    rest = buffer[start:]
    return (out + [rest], "") if final and rest else (out, rest)


def pieces(files, counts, errors: str, split_at: int, bpe: bool, piece_chars: int, shas=None):
    """The text as (split, piece) pairs in order: the first split_at characters in "train", the rest
    in "val". Between documents: a newline (char) or (split, None), the end-of-text token (bpe).
    BPE text is cut only at document ends, the split point, and safe_cut points. shas: a hashlib
    object per file, given every byte read."""
    def documents():
        first = True
        for i, (path, count) in enumerate(zip(files, counts)):
            texts = iter_text(path, errors, sha=shas[i] if shas else None)
            if not count:   # a blank document is read (for its hash) and skipped
                for _ in texts:
                    pass
                continue
            if not first:
                yield None if bpe else "\n"
            first = False
            yield from texts

    split, pos, buffer = "train", 0, ""
    for text in documents():
        if text is None:
            done, buffer = _cut(buffer, piece_chars, bpe, final=True)
            yield from ((split, p) for p in done)
            yield split, None
            continue
        if split == "train" and pos + len(text) >= split_at:
            head, text = text[:split_at - pos], text[split_at - pos:]
            done, buffer = _cut(buffer + head, piece_chars, bpe, final=True)
            yield from ((split, p) for p in done)
            split = "val"
        pos += len(text)
        done, buffer = _cut(buffer + text, piece_chars, bpe, final=False)
        yield from ((split, p) for p in done)
    done, _ = _cut(buffer, piece_chars, bpe, final=True)
    yield from ((split, p) for p in done)


class TokenWriter:
    """Encodes text pieces on a thread pool and appends the ids, in order, to <split>.bin files,
    counting tokens, UTF-8 bytes and the largest id. At most 2 x workers pieces are in flight."""

    def __init__(self, encode, dtype, out_dir: Path, workers: int, progress, bytes_per_char: float):
        self.encode, self.dtype, self.progress, self.bytes_per_char = encode, dtype, progress, bytes_per_char
        self.files = {s: open(out_dir / f"{s}.bin", "wb") for s in ("train", "val")}
        self.tokens, self.bytes = {"train": 0, "val": 0}, {"train": 0, "val": 0}
        self.min_token, self.max_token = np.inf, -1
        self.pool = ThreadPoolExecutor(workers)
        self.pending, self.limit = deque(), 2 * workers

    def _encode(self, text: str):
        ids = self.encode(text)
        low, top = (int(ids.min()), int(ids.max())) if len(ids) else (np.inf, -1)   # before the cast, which could wrap
        nbytes = len(text) if text.isascii() else len(text.encode("utf-8"))
        return ids.astype(self.dtype, copy=False), len(text), nbytes, low, top

    def text(self, split: str, text: str) -> None:
        self.pending.append((split, self.pool.submit(self._encode, text)))
        self._drain(self.limit)

    def token(self, split: str, token: int) -> None:
        done = Future()   # queued behind the pieces before it, without waiting for them
        done.set_result((np.array([token], dtype=self.dtype), 0, 0, token, token))
        self.pending.append((split, done))

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            split, future = self.pending.popleft()
            ids, nchars, nbytes, low, top = future.result()
            ids.tofile(self.files[split])
            self.tokens[split] += len(ids)
            self.bytes[split] += nbytes
            self.min_token, self.max_token = min(self.min_token, low), max(self.max_token, top)
            self.progress.advance(nchars * self.bytes_per_char)

    def close(self, ok: bool) -> None:
        try:
            if ok:
                self._drain(0)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            for f in self.files.values():
                f.close()


def prepare(data: DataConfig, block_size: int | None = None) -> Path:
    """Prepare data.path (a file, a directory, or a glob), or reuse a sound earlier preparation of the
    same bytes with the same settings; return the dataset dir. block_size: each split must hold
    block_size + 1 tokens (one training window), checked before anything is published."""
    data.validate()
    files = find_sources(data.path)
    stop = unwind_on_stop(lambda signum: f"preparing {data.path} stopped by {signal.Signals(signum).name}; "
                                         f"nothing was kept")
    with on_stop_signals(stop):
        return _prepare(files, data, block_size)


def file_stats(files: list[Path]) -> list[tuple[int, int]]:
    """(size, modification time) of each file: what tells that a file changed meanwhile."""
    return [(st.st_size, st.st_mtime_ns) for st in map(Path.stat, files)]


def _changed(what) -> DataError:
    return DataError(f"{what} changed while it was being prepared; nothing was kept: prepare it again once it no "
                     f"longer changes")


def _prepare(files: list[Path], data: DataConfig, block_size) -> Path:
    stats = file_stats(files)
    total = sum(size for size, _ in stats)
    progress = mb_progress("hashing", total, total)
    sha = sources_sha256(files, progress)
    progress.close()
    root, source = Path(data.prepared_dir), Path(data.path)
    stem = source.parent.name if glob.has_magic(str(data.path)) else source.stem
    out = root / entry_name(stem, data.tokenizer, sha, data.val_fraction, data.encoding_errors)
    remove_stale_temp_dirs(root)
    expect = {"sha256": sha, "tokenizer_spec": data.tokenizer, "val_fraction": data.val_fraction,
              "encoding_errors": data.encoding_errors}
    meta, problem = read_entry(out, expect)
    if meta is not None:
        check_split_sizes(meta["tokens"], block_size)
        return out
    if problem:
        print(f"notice: {out} {problem}; preparing it again", file=sys.stderr)
    try:
        return _prepare_anew(files, data, out, expect, block_size, total)
    except (DataError, TokenizerError):   # a file that changed meanwhile is the reason, whatever failed
        if file_stats(files) != stats:
            raise _changed(data.path) from None
        raise


def _prepare_anew(files, data: DataConfig, out: Path, expect: dict, block_size, total: int) -> Path:
    """Scan, tokenize and encode files (total bytes) into a new cache entry at out (published when
    complete); expect: the settings and the sha256 the entry is named after."""
    progress = mb_progress("scanning", total, total)
    counts, chars = scan(files, data.encoding_errors, data.tokenizer == "char", progress)
    progress.close()
    n_chars = sum(counts) + (sum(1 for c in counts if c) - 1 if data.tokenizer == "char" else 0)   # + newlines between
    split_at = int(n_chars * (1.0 - data.val_fraction))
    workers = min(MAX_WORKERS, available_cpus())
    piece_chars = min(PIECE_CHARS, IN_FLIGHT_CHARS // (2 * workers))
    root = out.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(out)
        try:
            tok = _tokenizer(data.tokenizer, chars, files, counts, data.encoding_errors, split_at, piece_chars,
                             workers, mb_progress("training", int(total * split_at / max(1, n_chars)), total))
            meta = _encode(files, counts, tok, data.encoding_errors, split_at, piece_chars, workers, tmp,
                           mb_progress("encoding", total, total), expect["sha256"])
            source = Path(data.path)
            split = {"val_fraction": data.val_fraction, "train_chars": split_at, "val_chars": n_chars - split_at}
            meta.update({"source": str(source.resolve() if source.exists() else source.absolute()),
                         "sha256": expect["sha256"], "files": len(files), "tokenizer_spec": data.tokenizer,
                         "encoding_errors": data.encoding_errors, "split": split})
            check_split_sizes(meta["tokens"], block_size)   # before publishing: a refused text leaves nothing
            atomic_write(tmp / "meta.json", json.dumps(meta, indent=1))
            publish(tmp, out, expect)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:   # a full disk, a read-only or misplaced data.prepared_dir
        raise DataError(f"cannot write the prepared data to {root}: {e.strerror or e}") from None
    print(f"prepared {data.path} with tokenizer {data.tokenizer}: {meta['tokens']['train']:,} train and "
          f"{meta['tokens']['val']:,} val tokens (vocab {tok.vocab_size:,}) -> {out}")
    return out


def _tokenizer(spec, chars, files, counts, errors, split_at, piece_chars, workers, progress):
    """The tokenizer to encode with: char's from the scanned characters, a named tiktoken encoding,
    or bpe:N trained on the training split."""
    if spec == "char":   # with the newline between documents, which none of them may hold
        return CharTokenizer("".join(sorted(set(chars) | {"\n"})) if sum(map(bool, counts)) > 1 else chars)
    vocab_size = bpe_vocab_size(spec)
    if vocab_size is None:
        return build_tokenizer(spec)

    def texts():   # the training split's text, read up to the split
        for split, text in pieces(files, counts, errors, split_at, True, piece_chars):
            if split != "train":
                return
            if text:
                progress.advance(len(text) * progress.total / max(1, split_at))
                yield text
    tok_meta, took = train_bpe(texts(), vocab_size, batch=2 * workers)
    progress.close()
    tok = load_tokenizer(tok_meta)
    short = "" if tok.vocab_size == vocab_size else " (the text has too few distinct pairs for more)"
    print(f"trained {spec} on the train split in {took:.1f} s: {tok.vocab_size:,} tokens{short}")
    return tok


def _encode(files, counts, tok, errors, split_at, piece_chars, workers, tmp, progress, sha) -> dict:
    """Write tmp/train.bin and tmp/val.bin; the meta entries that describe them."""
    eot = tok.enc.eot_token if hasattr(tok, "enc") else None
    dtype = token_dtype(tok.vocab_size)
    tok.encode_array("")   # build any lookup table before the threads share the tokenizer
    writer = TokenWriter(tok.encode_array, dtype, tmp, workers, progress, progress.total / max(1, sum(counts)))
    shas, ok = [hashlib.sha256() for _ in files], False
    try:
        for split, piece in pieces(files, counts, errors, split_at, eot is not None, piece_chars, shas):
            writer.text(split, piece) if piece is not None else writer.token(split, eot)
        ok = True
    finally:
        writer.close(ok)
    progress.close()
    # an entry holds exactly the bytes it is named after
    if combined_sha256(files, [h.hexdigest() for h in shas]) != sha:
        raise _changed(files[0] if len(files) == 1 else "a data file")
    if writer.min_token == writer.max_token:
        raise DataError(f"the text holds a single distinct token (id {writer.max_token}, "
                        f"{tok.decode([writer.max_token])!r}): there is nothing to learn to predict")
    return {"format": FORMAT, "tokenizer": tok.meta(), "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name, "max_token": writer.max_token,
            "tokens": dict(writer.tokens), "bytes": dict(writer.bytes)}


def main(argv: list[str]) -> int:
    p = ArgumentParser(description="Prepare a text file, directory or glob into token files.")
    p.add_argument("source")
    p.add_argument("--tokenizer", default="char", help="char | bpe:N (trained on the data) | a tiktoken encoding")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--root", default="data/prepared")
    p.add_argument("--encoding-errors", default="strict", help="strict | replace")
    p.add_argument("--block-size", type=int, default=None, help="refuse splits shorter than block_size + 1 tokens")
    args = p.parse_args(argv)
    data = DataConfig(args.source, args.tokenizer, args.val_fraction, args.root, args.encoding_errors)
    prepare(data, args.block_size)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
