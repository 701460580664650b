"""Turn text (a file, a directory of files, or a glob) into train/val token files plus a meta.json.

A prepared dataset is a directory:
    train.bin, val.bin   raw token ids (uint16, or uint32 when the vocabulary needs it)
    meta.json            tokenizer, dtype, token counts, split, sha256 of the source text
It is cached by (source sha256, tokenizer, split): preparing the same text again reuses it.

The text is streamed, never held whole, so memory stays bounded (a few hundred MB at most) whatever
its size. Three passes over the bytes:
  1. hash      sha256 of the bytes: the cache key (a cache hit costs only this pass)
  2. scan      decode UTF-8 (a bad byte is an error naming its offset), count the characters (the
               split point is a character index), and for `char` collect the vocabulary
  3. encode    pieces of ~1M characters are tokenized on a thread pool (tiktoken and the numpy
               lookup of the char tokenizer release the GIL, so all cores work) and written in order
The last val_fraction of the characters is the validation split. Several files are one text, in
sorted path order, with the end-of-text token between documents (BPE) or a newline (char).
Everything is written to a hidden temporary directory that is renamed into place when complete, so
an interrupted preparation never leaves a dataset that looks finished.

    python -m data.prepare FILE|DIR|GLOB [--tokenizer gpt2] [--val-fraction 0.1] [--root data/prepared]
"""
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from data.tokenizers import CharTokenizer, TokenizerError, build_tokenizer

FORMAT = 1
READ_BYTES = 4 << 20        # bytes read at a time
PIECE_CHARS = 1 << 20       # characters per encoding task
PROGRESS_MIN_BYTES = 64 << 20   # show a progress bar for inputs at least this large


class DataError(ValueError):
    """A data file or setting that cannot be used; the message says which and why."""


def download(url: str, path: Path) -> None:
    """Fetch url to path (through a temporary file, so a failed download leaves nothing behind)."""
    print(f"downloading {url} -> {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{path} is missing and could not be downloaded from {url} ({e}); "
                        f"pass a local copy with --data PATH") from None


def find_sources(source) -> list[Path]:
    """The files a data path names: itself, the files under a directory, or a glob's matches; sorted."""
    source = Path(source)
    if source.is_file():
        return [source]
    if source.is_dir():
        files = sorted(p for p in source.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts))
        if not files:
            raise DataError(f"no files in the data directory {source}")
        return files
    if glob.has_magic(str(source)):
        files = sorted(Path(p) for p in glob.glob(str(source), recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"no files match {source}")
        return files
    raise DataError(f"data file not found: {source}")


def sources_sha256(files: list[Path], progress=None) -> str:
    """A single file's sha256 (the cache key as it has always been); for several, the sha256 of
    their names and contents in order, so renaming or reordering files makes a new dataset."""
    shas = []
    for path in files:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(READ_BYTES), b""):
                h.update(chunk)
                progress and progress.advance(len(chunk))
        shas.append(h.hexdigest())
    if len(files) == 1:
        return shas[0]
    base = os.path.commonpath([str(p.resolve()) for p in files])
    listing = "".join(f"{os.path.relpath(p.resolve(), base)}\0{sha}\n" for p, sha in zip(files, shas))
    return hashlib.sha256(listing.encode()).hexdigest()


def _utf8_cut(buf: bytes) -> int:
    """The length of buf without a UTF-8 sequence cut off at its end (carried over to the next read)."""
    n = len(buf)
    i = n - 1
    while i >= 0 and n - i <= 4 and buf[i] & 0xC0 == 0x80:   # continuation bytes 10xxxxxx
        i -= 1
    if i < 0 or n - i > 4:
        return n
    lead = buf[i]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return i if n - i < need else n


def iter_text(path: Path, errors: str = "strict", progress=None):
    """The file as str chunks of about READ_BYTES bytes each, never splitting a character.
    A non-UTF-8 byte is a DataError naming its offset in the file (or U+FFFD with errors='replace')."""
    offset, carry = 0, b""
    with open(path, "rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            buf = carry + raw
            cut = _utf8_cut(buf) if raw else len(buf)
            buf, carry = buf[:cut], buf[cut:]
            if not raw and not buf:
                return
            try:
                yield buf.decode("utf-8", errors=errors)
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8: byte 0x{buf[e.start]:02x} at offset {offset + e.start}; "
                                f"set --data.encoding_errors=replace to replace such bytes") from None
            offset += len(buf)
            progress and progress.advance(len(buf))


def read_text(path: Path, errors: str = "strict") -> str:
    """A whole (small) file as text, with the same checks as preparing: missing, empty, not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    if not path.is_file():
        raise DataError(f"data path is not a file: {path}")
    text = "".join(iter_text(path, errors))
    if not text.strip():
        raise DataError(f"data file is empty: {path}")
    return text


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


class Progress:
    """One line on stderr, redrawn at most 5 times a second: done/total MB, MB/s, ETA."""

    def __init__(self, label: str, total: int, show: bool):
        self.label, self.total, self.show, self.done = label, total, show, 0
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.show and now - self.last >= (0.2 if self.tty else 10.0):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            line = (f"{self.label:8s} {self.done / 1e6:9.1f} / {self.total / 1e6:.1f} MB  "
                    f"{rate / 1e6:6.1f} MB/s  ETA {int(eta) // 60}:{int(eta) % 60:02d}")
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.show:
            took = time.perf_counter() - self.start
            print(f"{chr(13) if self.tty else ''}{self.label:8s} {self.total / 1e6:9.1f} MB in {took:.1f} s "
                  f"({self.total / 1e6 / max(took, 1e-9):.1f} MB/s)" + " " * 20, file=sys.stderr, flush=True)


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
                enc = ("ascii", np.uint8) if text.isascii() else ("utf-32-le", np.uint32)
                seen[np.frombuffer(text.encode(enc[0]), dtype=enc[1])] = True
        if blank and len(files) == 1:
            raise DataError(f"data file is empty: {path}")
        counts.append(0 if blank else n)   # a blank document in a directory is skipped
    if not any(counts):
        raise DataError(f"the data files are all empty ({len(files)} files, first {files[0]})")
    chars = "".join(map(chr, np.flatnonzero(seen))) if want_chars else None
    return counts, chars


# Cutting BPE input at these points gives the same tokens as encoding the whole text: no token of
# the gpt2 / cl100k / o200k pre-tokenizers runs across "x\n|y" or "x| y" (x, y not whitespace).
_SAFE_CUT = re.compile(r"\S\n(?=\S)|\S(?= \S)")


def safe_cut(text: str) -> int:
    """The last index (> 0) at which text can be cut without changing its BPE tokens; 0 if none."""
    for start in (max(0, len(text) - 4096), 0):
        m = None
        for m in _SAFE_CUT.finditer(text, start):
            pass
        if m:
            return m.end()
    return 0


class TokenWriter:
    """Encodes text pieces on a thread pool and appends the ids, in order, to <split>.bin files.
    At most 2 x workers pieces are in flight, which bounds the memory."""

    def __init__(self, encode, dtype, out_dir: Path, workers: int, progress, bytes_per_char: float):
        self.encode, self.dtype, self.progress, self.bytes_per_char = encode, dtype, progress, bytes_per_char
        self.files = {s: open(out_dir / f"{s}.bin", "wb") for s in ("train", "val")}
        self.tokens = {"train": 0, "val": 0}
        self.pool = ThreadPoolExecutor(workers)
        self.pending, self.limit = deque(), 2 * workers

    def _encode(self, text: str):
        return self.encode(text).astype(self.dtype, copy=False), len(text)

    def text(self, split: str, text: str) -> None:
        self.pending.append((split, self.pool.submit(self._encode, text)))
        self._drain(self.limit)

    def token(self, split: str, token: int) -> None:
        done = Future()   # queued behind the pieces before it, without waiting for them
        done.set_result((np.array([token], dtype=self.dtype), 0))
        self.pending.append((split, done))

    def _write(self, split, ids) -> None:
        ids.tofile(self.files[split])
        self.tokens[split] += len(ids)

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            split, future = self.pending.popleft()
            ids, nchars = future.result()
            self._write(split, ids)
            self.progress.advance(nchars * self.bytes_per_char)

    def close(self, ok: bool) -> None:
        try:
            if ok:
                self._drain(0)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            for f in self.files.values():
                f.close()


def encode_files(files, counts, eot, errors, split_at: int, writer: TokenWriter) -> None:
    """Stream the files through the writer: the first split_at characters to train, the rest to val.
    BPE text is cut only at document ends, the split point, and safe_cut points."""
    bpe = eot is not None
    split, pos, buffer = "train", 0, ""

    def flush(final: bool) -> None:   # send whole pieces on; the rest too if final
        nonlocal buffer
        while len(buffer) >= PIECE_CHARS:
            cut = (safe_cut(buffer[:PIECE_CHARS]) if bpe else 0) or PIECE_CHARS   # no safe cut in a whole
            writer.text(split, buffer[:cut])                                      # piece: cut anyway
            buffer = buffer[cut:]
        if final and buffer:
            writer.text(split, buffer)
            buffer = ""

    def add(text: str) -> None:
        nonlocal buffer, split, pos
        if split == "train" and pos + len(text) >= split_at:
            head, text = text[:split_at - pos], text[split_at - pos:]
            buffer += head
            pos += len(head)
            flush(final=True)
            split = "val"
        buffer += text
        pos += len(text)
        flush(final=False)

    first = True
    for path, count in zip(files, counts):
        if count == 0:
            continue
        if not first:
            flush(final=True)
            writer.token(split, eot) if bpe else add("\n")
        first = False
        for text in iter_text(path, errors):
            add(text)
    flush(final=True)


def prepare(source: Path, tokenizer: str, val_fraction: float, root: Path,
            encoding_errors: str = "strict") -> Path:
    """Prepare source (a file, a directory, or a glob), or reuse an earlier preparation of the same
    bytes; return the dataset dir."""
    files = find_sources(source)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
    total = sum(p.stat().st_size for p in files)
    show = total >= PROGRESS_MIN_BYTES

    progress = Progress("hashing", total, show)
    sha = sources_sha256(files, progress)
    progress.close()
    name = Path(source).parent.name if glob.has_magic(str(source)) else Path(source).stem
    out = Path(root) / f"{name}-{tokenizer}-{sha[:12]}-val{val_fraction:g}"
    if (out / "meta.json").exists():
        return out

    progress = Progress("scanning", total, show)
    counts, chars = scan(files, encoding_errors, tokenizer == "char", progress)
    progress.close()
    try:
        tok = CharTokenizer(chars) if tokenizer == "char" else build_tokenizer(tokenizer)
    except TokenizerError as e:
        raise DataError(str(e)) from None
    eot = None if tokenizer == "char" else tok.enc.eot_token
    n_chars = sum(counts) + (sum(1 for c in counts if c) - 1 if eot is None else 0)   # + newlines between
    split_at = int(n_chars * (1.0 - val_fraction))
    dtype = token_dtype(tok.vocab_size)
    tok.encode_array("")   # build any lookup table before the threads share the tokenizer

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))   # unique, even across machines
        ok = False
        try:
            progress = Progress("encoding", total, show)
            workers = min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
            writer = TokenWriter(tok.encode_array, dtype, tmp, workers, progress, total / max(1, n_chars))
            try:
                encode_files(files, counts, eot, encoding_errors, split_at, writer)
                ok = True
            finally:
                writer.close(ok)
            progress.close()
            src = Path(source)
            meta = {
                "format": FORMAT, "source": str(src.resolve()) if src.exists() else str(src.absolute()),
                "sha256": sha, "files": len(files),
                "tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
                "split": {"val_fraction": val_fraction, "train_chars": split_at, "val_chars": n_chars - split_at},
                "tokens": dict(writer.tokens),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            publish(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:   # a full disk, a read-only or misplaced data.prepared_dir
        raise DataError(f"cannot write the prepared data to {out.parent}: {e.strerror or e}") from None
    print(f"prepared {source} with tokenizer {tokenizer}: {meta['tokens']['train']:,} train and "
          f"{meta['tokens']['val']:,} val tokens (vocab {tok.vocab_size:,}) -> {out}")
    return out


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished tmp dir to out. If out exists: another process finished the same dataset
    first (keep it) or it is an unfinished leftover without meta.json (replace it)."""
    try:
        os.rename(tmp, out)
    except OSError:
        if (out / "meta.json").exists():
            return
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)


def load_meta(dataset_dir: Path) -> dict:
    return json.loads((Path(dataset_dir) / "meta.json").read_text())


def main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(description="Prepare a text file, directory or glob into token files.")
    p.add_argument("source")
    p.add_argument("--tokenizer", default="char")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--root", default="data/prepared")
    p.add_argument("--encoding-errors", choices=("strict", "replace"), default="strict")
    args = p.parse_args(argv)
    prepare(args.source, args.tokenizer, args.val_fraction, Path(args.root), args.encoding_errors)
    return 0


if __name__ == "__main__":   # without training.errors.run_cli, which imports torch (300 MB of memory)
    try:
        sys.exit(main(sys.argv[1:]))
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
