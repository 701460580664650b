"""The text to prepare: which files a data path names (a file; every regular file under a directory,
hidden ones skipped; or a glob's matches; in sorted path order), its name, their sha256, and their
documents as str chunks in bounded memory: a text file (read READ_BYTES at a time; a .gz one
gunzipped as it is read), a JSONL line, a Parquet row (KINDS). A non-UTF-8 byte is an error naming
its offset, with advice: a file that looks binary (a NUL byte in its first 8 KB, git's test) is to
be left out; in a text, encoding_errors=replace.
"""
import codecs
import glob
import gzip
import hashlib
import json
import os
import re
import zlib
from collections import Counter
from itertools import chain, count
from pathlib import Path

from common import UserError

READ_BYTES = 1 << 20        # bytes read at a time
PROMPT_FILE_MAX = 1 << 20   # a prompt read from a file: at most this many bytes
PARQUET_ROWS = 1024         # rows read at a time
KINDS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}   # by a name's ending; else text
SURROGATE = re.compile("[\ud800-\udfff]")   # JSON's "\ud800" alone: a code point no UTF-8 text holds
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".tex", ".html", ".xml", ".json", ".csv", ".py", ".c", ".h",
                 ".js", ".gz"}
# what reading a damaged file raises: a .gz cut short or not gzip; a .parquet that is not Parquet
DAMAGED = (OSError, EOFError, zlib.error, ValueError)


def find_sources(source) -> list[Path]:
    """The regular files a data path names, sorted; a UserError saying why there are none."""
    source = Path(source)
    if source.is_file():   # (its name may hold glob characters)
        return [source]
    pattern = os.path.join(glob.escape(str(source)), "**", "*") if source.is_dir() else str(source)
    # (glob skips hidden files; a pipe or a device is no file: reading it could block, or never end)
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise UserError(f"no files in the data directory {source}" if source.is_dir() else f"no files match "
                        f"{source}" if glob.has_magic(str(source)) else f"data file not found: {source}")
    return files


def kind_suffix(name: str) -> str:
    """The ending that makes a file records ('.jsonl', '.jsonl.gz', '.parquet'), or '' (a text)."""
    return next((suffix for suffix in KINDS if name.lower().endswith(suffix)), "")


def data_name(path) -> str:
    """The name of a data path's runs (out/<name>) and cache entries: a file's or folder's name without
    its extension (my_notes.txt -> my_notes); a glob's last folder and file part, each where it holds no
    glob character (books/*.txt -> books, /usr/share/doc/*/copyright -> doc-copyright; neither: data).
    Records add their kind (licenses.jsonl -> licenses-jsonl): never the name of the same-named
    text. A text's .gz goes too (notes.txt.gz -> notes)."""
    path, suffix = Path(path), kind_suffix(Path(path).name)
    stem = path.name[:-len(suffix)] if suffix else Path(path.name.removesuffix(".gz")).stem
    if glob.has_magic(str(path)):
        folders = [p for p in path.parent.parts if p not in (path.anchor, "..") and not glob.has_magic(p)]
        stem = "-".join(folders[-1:] + [stem] * (not glob.has_magic(stem)))
    return (stem or "data") + (f"-{KINDS[suffix]}" if suffix else "")


def describe(source, files: list[Path], total: int, label: str = "data") -> str:
    """What a folder or glob took: 'data: books (4 files: 2 .txt, 1 .jsonl, 1 other; 3.2 MB)' (a
    stray file shows; label: 'val' for data.val_path's). A kind is named for records and known text
    extensions only (foo.so.0: other)."""
    known = [kind_suffix(p.name) or p.suffix.lower() for p in files]
    counts = Counter(s if s in KINDS or s in TEXT_SUFFIXES else "other" for s in known).most_common()
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts)
    return (f"{label}: {source} ({len(files)} file{'s' * (len(files) > 1)}: {kinds}; "
            f"{total / 1e6:.1f} MB)")


def read_bytes(path: Path, progress=None, gz: bool = False):
    """The file's bytes, READ_BYTES at a time (gz: gunzipped); progress: a Progress advanced by the
    bytes read from the file. A damaged .gz is a UserError naming it."""
    with open(path, "rb") as raw, (gzip.open(raw) if gz else raw) as f:
        done = 0   # bytes read from the file (gz: fewer than data's)
        try:
            while data := f.read(READ_BYTES):
                progress and progress.advance(-done + (done := raw.tell()))
                yield data
        except DAMAGED as e:
            if not gz:
                raise
            raise UserError(f"{path} cannot be read as gzip: {e}") from None


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
    (its advice, for a text: hint), or with errors='replace' a U+FFFD. A .gz file is gunzipped."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)   # holds a character cut at a read's end
    offset, gz = 0, path.name.lower().endswith(".gz")   # offset: bytes read before raw
    # b"": the end, where a cut character is an error
    for raw in chain(read_bytes(path, progress, gz), [b""]):
        held = len(decoder.getstate()[0])
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:   # e.object: the held bytes, then raw
            with (gzip.open if gz else open)(path, "rb") as f:
                if b"\0" in f.read(8192):   # it looks binary (git's test)
                    hint = f"it looks binary: leave it out of the data (e.g. with a glob such as " \
                           f"'{path.parent}/*.txt')"
            raise UserError(f"{path} is not UTF-8: byte 0x{e.object[e.start]:02x} at offset "
                            f"{offset - held + e.start}" + (f"; {hint}" if hint else "")) from None
        if text:
            yield text
        offset += len(raw)


def iter_documents(path: Path, errors: str = "strict", field: str = "text", progress=None):
    """The file's documents, each an iterable of str chunks, by its kind (KINDS): a text is one; a
    JSONL line or a Parquet row, its field's text, one each (blank ones skipped, as blank files are)."""
    if not (suffix := kind_suffix(path.name)):
        yield iter_text(path, errors, progress)
        return
    where = "row" if suffix == ".parquet" else "line"
    try:
        for n, text in (parquet_texts if where == "row" else jsonl_texts)(path, errors, field, progress):
            if not isinstance(text, str):   # (None: no such field, or null)
                got = type(text).__name__ if text is not None else "missing or null"
                raise UserError(f"{path}, {where} {n}: no string in {field!r} ({got}); --data.text_field "
                                f"names the field that holds the text")
            if (lone := SURROGATE.search(text)) and errors != "replace":
                raise UserError(f"{path}, {where} {n}: a lone surrogate \\u{ord(lone[0]):04x} is no "
                                f"character; set --data.encoding_errors=replace to replace it")
            if text and not text.isspace():
                yield (SURROGATE.sub("\ufffd", text) if lone else text,)
    except DAMAGED as e:   # not gzip, cut short, not Parquet (a Git LFS pointer)
        raise UserError(f"{path} cannot be read as {suffix}: {e}") from None


def jsonl_texts(path: Path, errors: str, field: str, progress):
    """(line number, its record's field or None) of each line of a JSON Lines file (.gz: gzip)."""
    with open(path, "rb") as raw, (gzip.open(raw) if path.name.lower().endswith(".gz") else raw) as f:
        numbers, done = count(1), 0   # line numbers; the bytes read before these lines
        while lines := f.readlines(READ_BYTES):
            progress and progress.advance(-done + (done := raw.tell()))   # (gzip: the compressed bytes)
            for line, n in zip(lines, numbers):   # (lines first: zip stops before taking a number)
                try:
                    record = json.loads(line.decode("utf-8", errors)) if not line.isspace() else {field: ""}
                except ValueError as e:   # UnicodeDecodeError, json.JSONDecodeError
                    why = f"UTF-8 ({e.reason})" if isinstance(e, UnicodeDecodeError) else f"JSON ({e.msg})"
                    raise UserError(f"{path}, line {n}: not {why}") from None
                yield n, record.get(field) if isinstance(record, dict) else None


def parquet_texts(path: Path, errors: str, field: str, progress):
    """(row number, its text) of each row of a Parquet file's column `field`, PARQUET_ROWS at a time
    (a row group at most is read at once). pyarrow is imported only here: it is needed only here."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    f = pq.ParquetFile(path)
    if field not in (names := f.schema_arrow.names):
        raise UserError(f"{path} has no column {field!r} (it has: {', '.join(names)}); --data.text_field "
                        f"names the column that holds the text")
    row_bytes = path.stat().st_size / max(f.metadata.num_rows, 1)   # (a row's share, for progress)
    batches = f.iter_batches(PARQUET_ROWS, columns=[field])
    for n, text in enumerate(chain.from_iterable(batch.column(0).to_pylist() for batch in batches), 1):
        progress and progress.advance(row_bytes)
        yield n, text


def read_prompt(prompt: str) -> str:
    """A prompt argument's text: itself, or with @FILE the file's (UTF-8, at most PROMPT_FILE_MAX
    bytes: a model sees only its last block_size tokens anyway, and /dev/zero never ends)."""
    if not prompt.startswith("@"):
        return prompt
    with open(prompt[1:], "rb") as f:   # (a missing file: one line, from common.run_cli)
        if len(f.read(PROMPT_FILE_MAX + 1)) > PROMPT_FILE_MAX:
            raise UserError(f"the prompt file {prompt[1:]} is larger than {PROMPT_FILE_MAX >> 20} MB")
    return "".join(iter_text(Path(prompt[1:]), hint=None))
