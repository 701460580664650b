"""The text to prepare: which files a data path names, their sha256, and their text as a stream of
str chunks that never splits a character. Nothing here holds a whole file in memory."""
import codecs
import glob
import hashlib
import os
import stat
from itertools import chain
from pathlib import Path

from common import DataError

READ_BYTES = 1 << 20        # bytes read at a time
PROMPT_FILE_MAX = 1 << 20   # a prompt read from a file: at most this many bytes
REPLACE_HINT = "set --data.encoding_errors=replace to replace such bytes"   # what training says of a non-UTF-8 byte


def special_kind(path: Path) -> str | None:
    """What path is when it exists but is neither a regular file nor a directory (found with stat,
    which never opens it, so a FIFO cannot block); None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")


def find_sources(source) -> list[Path]:
    """The files a data path names: itself, the regular files under a directory (hidden ones
    skipped), or a glob's matches; sorted."""
    source = Path(source)
    if source.is_file():
        return [source]
    if source.is_dir():
        files = sorted(p for p in source.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts))
        if not files:
            raise DataError(f"no files in the data directory {source}")
        return files
    kind = special_kind(source)
    if kind:
        raise DataError(f"data path {source} is a {kind}, not a regular file: save the text to a file and pass that")
    if glob.has_magic(str(source)):
        files = sorted(Path(p) for p in glob.glob(str(source), recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"no files match {source}")
        return files
    raise DataError(f"data file not found: {source}")


def _chunks(path: Path):
    """The file's bytes, READ_BYTES at a time."""
    try:
        f = open(path, "rb")
    except OSError as e:   # removed or made unreadable since it was found
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        yield from iter(lambda: f.read(READ_BYTES), b"")


def sources_sha256(files: list[Path], progress=None) -> str:
    """A single file's sha256; for several, the sha256 of their names and contents in order, so
    renaming or reordering files makes a new dataset."""
    shas = []
    for path in files:
        h = hashlib.sha256()
        for chunk in _chunks(path):
            h.update(chunk)
            progress and progress.advance(len(chunk))
        shas.append(h.hexdigest())
    return combined_sha256(files, shas)


def combined_sha256(files: list[Path], shas: list[str]) -> str:
    """The dataset's sha256 from its files' own: the file's for one, else that of their names and digests."""
    if len(files) == 1:
        return shas[0]
    base = os.path.commonpath([str(p.resolve()) for p in files])
    listing = "".join(f"{os.path.relpath(p.resolve(), base)}\0{sha}\n" for p, sha in zip(files, shas))
    return hashlib.sha256(listing.encode()).hexdigest()


def iter_text(path: Path, errors: str = "strict", progress=None, hint: str | None = REPLACE_HINT, sha=None):
    """The file as str chunks of about READ_BYTES bytes each, never splitting a character.
    A non-UTF-8 byte is a DataError naming its offset in the file, followed by hint if any (or
    U+FFFD with errors='replace'). sha: a hashlib object given every byte read."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)   # holds a character cut at a read's end
    offset = 0   # bytes read before raw
    for raw in chain(_chunks(path), [b""]):   # b"": the end, where a character cut short is an error
        sha and sha.update(raw)
        held = len(decoder.getstate()[0])
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:   # e.object: the held bytes, then raw
            raise DataError(f"{path} is not UTF-8: byte 0x{e.object[e.start]:02x} at offset "
                            f"{offset - held + e.start}" + (f"; {hint}" if hint else "")) from None
        if text:
            yield text
        offset += len(raw)
        progress and progress.advance(len(raw))


def read_text(path: Path, errors: str = "strict", hint: str | None = REPLACE_HINT) -> str:
    """A whole (small) file as text, with the same checks as preparing: missing, not a regular
    file, empty, not UTF-8 (the message ends with hint, if any)."""
    path = Path(path)
    if not path.is_file():
        kind = "directory" if path.is_dir() else special_kind(path)
        raise DataError(f"data path {path} is a {kind}, not a regular file" if kind else f"data file not found: {path}")
    text = "".join(iter_text(path, errors, hint=hint))
    if not text.strip():
        raise DataError(f"data file is empty: {path}")
    return text


def read_prompt(prompt: str) -> str:
    """A prompt argument's text: itself, or with @FILE the file's (UTF-8, at most PROMPT_FILE_MAX
    bytes: a model sees only its last block_size tokens anyway, and /dev/zero never ends)."""
    if not prompt.startswith("@"):
        return prompt
    path = Path(prompt[1:])
    try:
        with open(path, "rb") as f:
            data = f.read(PROMPT_FILE_MAX + 1)
    except FileNotFoundError:
        raise DataError(f"prompt file not found: {path}") from None
    except OSError as e:
        raise DataError(f"cannot read the prompt file {path}: {e.strerror or e}") from None
    if len(data) > PROMPT_FILE_MAX:
        raise DataError(f"the prompt file {path} is larger than {PROMPT_FILE_MAX >> 20} MB "
                        f"(a model sees only its last block_size tokens)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"the prompt file {path} is not UTF-8 (byte offset {e.start})") from None
