"""The text to prepare: which files a data path names (a file; every regular file under a
directory, hidden ones skipped; or a glob's matches; in sorted path order), their sha256, and their
text as str chunks, read READ_BYTES at a time whatever a file's size. A non-UTF-8 byte is an error
naming its offset, with advice: a file that looks binary (a NUL byte in its first 8 KB, git's test)
is to be left out; a text with a stray byte can be read with encoding_errors=replace.
"""
import codecs
import glob
import hashlib
import os
from collections import Counter
from itertools import chain
from pathlib import Path

from common import UserError

READ_BYTES = 1 << 20        # bytes read at a time
PROMPT_FILE_MAX = 1 << 20   # a prompt read from a file: at most this many bytes


def find_sources(source) -> list[Path]:
    """The regular files a data path names, sorted; a UserError saying why there are none."""
    source = Path(source)
    if source.is_file():   # (its name may hold glob characters)
        return [source]
    pattern = os.path.join(glob.escape(str(source)), "**", "*") if source.is_dir() else str(source)
    # (glob skips hidden files; a pipe or a device is no file: reading it could block, or never end)
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if files:
        return files
    if source.is_dir():
        raise UserError(f"no files in the data directory {source}")
    raise UserError(f"no files match {source}" if glob.has_magic(str(source)) else
                    f"data file not found: {source}")


def describe(source, files: list[Path], total: int) -> str:
    """What a folder or glob took: 'data: books (3 files: 2 .txt, 1 .py; 3.2 MB)' (a stray script shows)."""
    counts = Counter(p.suffix or "no extension" for p in files).most_common()
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts)
    return f"data: {source} ({len(files)} file{'s' * (len(files) > 1)}: {kinds}; {total / 1e6:.1f} MB)"


def read_bytes(path: Path, progress=None):   # (progress: a Progress advanced by their count)
    with open(path, "rb") as f:
        while data := f.read(READ_BYTES):
            progress and progress.advance(len(data))
            yield data


def sha256(files: list[Path], progress=None) -> str:
    """The cache key: one file's sha256, or that of several files' names and sha256s in order (so
    renaming or reordering files makes another dataset)."""
    digests = []
    for path in files:
        h = hashlib.sha256()
        for data in read_bytes(path, progress):
            h.update(data)
        digests.append(h.hexdigest())
    base = os.path.commonpath([p.resolve() for p in files])
    listing = "".join(f"{p.resolve().relative_to(base)}\0{d}\n" for p, d in zip(files, digests))
    return digests[0] if len(files) == 1 else hashlib.sha256(listing.encode()).hexdigest()


def iter_text(path: Path, errors: str = "strict", progress=None,
              hint: str | None = "set --data.encoding_errors=replace to replace such bytes"):
    """The file's text as str chunks that never split a character; a non-UTF-8 byte is a UserError
    (its advice, for a text: hint), or with errors='replace' a U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)   # holds a character cut at a read's end
    offset = 0   # bytes read before raw
    for raw in chain(read_bytes(path, progress), [b""]):   # b"": the end, where a cut character is an error
        held = len(decoder.getstate()[0])
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:   # e.object: the held bytes, then raw
            with open(path, "rb") as f:
                if b"\0" in f.read(8192):   # it looks binary (git's test)
                    hint = f"it looks binary: leave it out of the data (e.g. with a glob such as " \
                           f"'{path.parent}/*.txt')"
            raise UserError(f"{path} is not UTF-8: byte 0x{e.object[e.start]:02x} at offset "
                            f"{offset - held + e.start}" + (f"; {hint}" if hint else "")) from None
        if text:
            yield text
        offset += len(raw)


def read_prompt(prompt: str) -> str:
    """A prompt argument's text: itself, or with @FILE the file's (UTF-8, at most PROMPT_FILE_MAX
    bytes: a model sees only its last block_size tokens anyway, and /dev/zero never ends)."""
    if not prompt.startswith("@"):
        return prompt
    with open(prompt[1:], "rb") as f:   # (a missing file: one line, from common.run_cli)
        if len(f.read(PROMPT_FILE_MAX + 1)) > PROMPT_FILE_MAX:
            raise UserError(f"the prompt file {prompt[1:]} is larger than {PROMPT_FILE_MAX >> 20} MB")
    return "".join(iter_text(Path(prompt[1:]), hint=None))
