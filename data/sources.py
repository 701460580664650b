"""The text to prepare: which files a data path names, and their text as a stream.

  files      a file; every regular file under a directory (hidden ones skipped); or a glob's matches,
             in sorted path order. What a directory or glob took is said in one line (describe), so a
             stray extract.py among the books shows
  reading    a file is read at most READ_BYTES at a time, and only its first `size` bytes when given
             (its size when it was hashed: the bytes the cache entry is named after), so memory never
             grows with it; the text comes as str chunks that never split a character
  bad bytes  a non-UTF-8 byte is an error naming its offset, with advice: a file that looks binary (a
             NUL byte in its first 8 KB, git's test) is to be left out; a text with a stray byte can
             be read with encoding_errors=replace
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
REPLACE_HINT = "set --data.encoding_errors=replace to replace such bytes"   # what training says of a stray byte


def find_sources(source) -> list[Path]:
    """The files a data path names, sorted; a UserError saying why there are none."""
    source = Path(source)
    if source.is_file():
        return [source]
    if source.exists() and not source.is_dir():   # a FIFO, a device, a socket: stat() tells without opening
        raise UserError(f"data path {source} is not a regular file: save the text to a file and pass that")
    pattern = os.path.join(glob.escape(str(source)), "**", "*") if source.is_dir() else str(source)
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))   # (glob skips .hidden)
    if files:
        return files
    if source.is_dir():
        raise UserError(f"no files in the data directory {source}")
    raise UserError(f"no files match {source}" if glob.has_magic(str(source)) else f"data file not found: {source}")


def describe(source, files: list[Path], total: int) -> str:
    """What a directory or glob took (total: its bytes), in one line: 'data: books/ (13 files: 12 .txt,
    1 .py; 3.2 MB)'."""
    kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(p.suffix or "no extension" for p in files).most_common())
    return f"data: {source} ({len(files)} file{'s' * (len(files) > 1)}: {kinds}; {total / 1e6:.1f} MB)"


def read_bytes(path: Path, size: int | None = None, chunk: int = READ_BYTES, sha=None, progress=None):
    """The file's bytes (its first `size` when given), at most chunk (and READ_BYTES) at a time. sha: a
    hashlib object given every byte read; progress: a Progress advanced by their count."""
    try:
        f = open(path, "rb")
    except OSError as e:   # removed or made unreadable since it was found
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        left = float("inf") if size is None else size
        while left > 0 and (data := f.read(min(chunk, READ_BYTES, left))):
            left -= len(data)
            sha and sha.update(data)
            progress and progress.advance(len(data))
            yield data


def sha256(files: list[Path], progress=None) -> tuple[str, list[int]]:
    """(the text's sha256, each file's size): the bytes a cache entry is named after."""
    hashes = [hashlib.sha256() for _ in files]
    sizes = [sum(map(len, read_bytes(path, sha=h, progress=progress))) for path, h in zip(files, hashes)]
    return combined_sha256(files, hashes), sizes


def combined_sha256(files: list[Path], hashes: list) -> str:
    """One file's sha256 is its bytes'; several files' is that of their names and digests in order, so
    renaming or reordering files makes another dataset."""
    if len(files) == 1:
        return hashes[0].hexdigest()
    base = os.path.commonpath([str(p.resolve()) for p in files])
    listing = "".join(f"{os.path.relpath(p.resolve(), base)}\0{h.hexdigest()}\n" for p, h in zip(files, hashes))
    return hashlib.sha256(listing.encode()).hexdigest()


def iter_text(path: Path, errors: str = "strict", size: int | None = None, chunk: int = READ_BYTES, sha=None,
              progress=None, hint: str | None = REPLACE_HINT):
    """The text of read_bytes(path, ...) as str chunks that never split a character. A non-UTF-8 byte
    is a UserError naming its offset, with advice: a file that looks binary is to be left out; in a
    text, hint (or U+FFFD for each such byte with errors='replace')."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)   # holds a character cut at a read's end
    offset = 0   # bytes read before raw
    for raw in chain(read_bytes(path, size, chunk, sha, progress), [b""]):
        held = len(decoder.getstate()[0])
        try:
            text = decoder.decode(raw, final=not raw)   # b"": the end, where a character cut short is an error
        except UnicodeDecodeError as e:   # e.object: the held bytes, then raw
            with open(path, "rb") as f:
                if b"\0" in f.read(8192):   # it looks binary (git's test)
                    hint = f"it looks binary: leave it out of the data (e.g. with a glob such as '{path.parent}/*.txt')"
            raise UserError(f"{path} is not UTF-8: byte 0x{e.object[e.start]:02x} at offset {offset - held + e.start}"
                            + (f"; {hint}" if hint else "")) from None
        if text:
            yield text
        offset += len(raw)


def read_text(path, errors: str = "strict", hint: str | None = REPLACE_HINT) -> str:
    """A whole (small) file, one find_sources found, as text, with the checks of preparing: not UTF-8
    (the message ends with hint, if any), empty."""
    path = Path(path)
    text = "".join(iter_text(path, errors, hint=hint))
    if not text.strip():
        raise UserError(f"data file is empty: {path}")
    return text


def read_prompt(prompt: str) -> str:
    """A prompt argument's text: itself, or with @FILE the file's (UTF-8, at most PROMPT_FILE_MAX
    bytes: a model sees only its last block_size tokens anyway, and /dev/zero never ends)."""
    if not prompt.startswith("@"):
        return prompt
    path = Path(prompt[1:])
    if not path.exists():
        raise UserError(f"prompt file not found: {path}")
    data = b"".join(read_bytes(path, PROMPT_FILE_MAX + 1))   # (one that cannot be read: a UserError that says why)
    if len(data) > PROMPT_FILE_MAX:
        raise UserError(f"the prompt file {path} is larger than {PROMPT_FILE_MAX >> 20} MB "
                        f"(a model sees only its last block_size tokens)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"the prompt file {path} is not UTF-8 (byte offset {e.start})") from None
