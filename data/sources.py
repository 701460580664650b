"""A data file's documents as str chunks, in bounded memory: a text file (a .gz one
gunzipped), a JSONL line, a Parquet row. A non-UTF-8 byte is an error naming its offset.
"""
import codecs
import gzip
import json
import re
import zlib
from itertools import chain
from pathlib import Path

from common import UserError
from data.cache import kind_suffix

READ_BYTES = 1 << 20
PROMPT_FILE_MAX = 1 << 20
PARQUET_ROWS = 1024
# JSON's "\ud800" alone: a code point no UTF-8 text holds
SURROGATE = re.compile("[\ud800-\udfff]")
# what reading a damaged .gz or .parquet raises
DAMAGED = (OSError, EOFError, zlib.error, ValueError)


def chunks(path: Path, take, progress=None):
    """take(f) on the file (a .gz gunzipped) until it gives nothing, progress advanced."""
    gz = path.name.lower().endswith(".gz")
    with open(path, "rb") as raw, (gzip.open(raw) if gz else raw) as f:
        done = 0
        while chunk := take(f):
            if progress:
                progress.advance(raw.tell() - done)
            done = raw.tell()
            yield chunk


def iter_text(path: Path, errors: str = "strict", progress=None,
              hint: str | None = "set --data.encoding_errors=replace to replace such bytes"):
    """The file's text as str chunks; hint: the advice for a byte that is not UTF-8."""
    # holds a character cut at a read's end
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    # bytes read before raw
    offset = 0
    try:
        # b"": the end, where a cut character is an error
        for raw in chain(chunks(path, lambda f: f.read(READ_BYTES), progress), [b""]):
            held = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                # e.object: the held bytes, then raw
                raise not_utf8(path, e.object[e.start], offset - held + e.start, hint) from None
            if text:
                yield text
            offset += len(raw)
    except DAMAGED as e:
        if not path.name.lower().endswith(".gz"):
            raise
        raise UserError(f"{path} cannot be read as gzip: {e}") from None


def not_utf8(path: Path, byte: int, offset: int, hint: str | None) -> UserError:
    """The error of a byte that is not UTF-8, with hint, or to leave out a file that looks
    binary (a NUL byte in its first 8 KB: git's test)."""
    if b"\0" in next(chunks(path, lambda f: f.read(8192)), b""):
        hint = (f"it looks binary: leave it out of the data (e.g. with a glob such as "
                f"'{path.parent}/*.txt')")
    advice = f"; {hint}" if hint else ""
    return UserError(f"{path} is not UTF-8: byte 0x{byte:02x} at offset {offset}{advice}")


def iter_documents(path: Path, errors: str = "strict", field: str = "text", progress=None):
    """The file's documents, each an iterable of str chunks: a text is one; a JSONL line
    or a Parquet row, its field's text (blank ones skipped)."""
    if not (suffix := kind_suffix(path.name)):
        yield iter_text(path, errors, progress)
        return
    where = "row" if suffix == ".parquet" else "line"
    texts = parquet_texts if where == "row" else jsonl_texts
    try:
        for n, text in texts(path, errors, field, progress):
            if not isinstance(text, str):
                got = type(text).__name__ if text is not None else "missing or null"
                raise UserError(f"{path}, {where} {n}: no string in {field!r} ({got}); "
                                f"--data.text_field names the field that holds the text")
            if (lone := SURROGATE.search(text)) and errors != "replace":
                raise UserError(f"{path}, {where} {n}: a lone surrogate \\u{ord(lone[0]):04x} is "
                                f"no character; set --data.encoding_errors=replace to replace it")
            if text and not text.isspace():
                yield (SURROGATE.sub("\ufffd", text) if lone else text,)
    except DAMAGED as e:
        raise UserError(f"{path} cannot be read as {suffix}: {e}") from None


def jsonl_texts(path: Path, errors: str, field: str, progress):
    """(line number, its record's field or None) of each non-blank line of a JSONL file."""
    lines = chain.from_iterable(chunks(path, lambda f: f.readlines(READ_BYTES), progress))
    for n, line in enumerate(lines, 1):
        if line.isspace():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors))
        except UnicodeDecodeError as e:
            raise UserError(f"{path}, line {n}: not UTF-8 ({e.reason})") from None
        except ValueError as e:
            raise UserError(f"{path}, line {n}: not JSON ({e.msg})") from None
        yield n, record.get(field) if isinstance(record, dict) else None


def parquet_texts(path: Path, errors: str, field: str, progress):
    """(row number, its text) of a Parquet file's column `field`, PARQUET_ROWS at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    f = pq.ParquetFile(path)
    if field not in (names := f.schema_arrow.names):
        raise UserError(f"{path} has no column {field!r} (it has: {', '.join(names)}); "
                        f"--data.text_field names the column that holds the text")
    # a row's share of the file, for progress
    row_bytes = path.stat().st_size / max(f.metadata.num_rows, 1)
    batches = f.iter_batches(PARQUET_ROWS, columns=[field])
    texts = chain.from_iterable(batch.column(0).to_pylist() for batch in batches)
    for n, text in enumerate(texts, 1):
        if progress:
            progress.advance(row_bytes)
        yield n, text


def read_prompt(prompt: str) -> str:
    """A prompt argument's text: itself, or with @FILE the file's."""
    if not prompt.startswith("@"):
        return prompt
    # a missing file: one line, from common.run_cli
    with open(prompt[1:], "rb") as f:
        if len(f.read(PROMPT_FILE_MAX + 1)) > PROMPT_FILE_MAX:
            raise UserError(f"the prompt file {prompt[1:]} is larger than "
                            f"{PROMPT_FILE_MAX >> 20} MB")
    return "".join(iter_text(Path(prompt[1:]), hint=None))
