"""The prepared-data cache: the files a data path names, and the entry (train.bin, val.bin,
meta.json written last) their bytes and settings key, which data/prepare.py builds. Deleting
an entry, or the whole cache, is always safe.
"""
import glob
import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import Progress, UserError, check_fields, setting
from data.tokenizers import bpe_vocab_size

# meta.json's layout and how a text is read: another is prepared again
FORMAT = 4
SPLITS = ("train", "val")
# a progress line for inputs this large
PROGRESS_MIN_BYTES = 64 << 20
# records, by a name's ending; any other file is a text
KINDS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".tex", ".html", ".xml", ".json", ".csv", ".py",
                 ".c", ".h", ".js", ".gz"}


@dataclass
class DataConfig:
    path: str = setting(
        "data/tinyshakespeare.txt", "the text to train on: a file, a folder or a glob")
    tokenizer: str = setting(
        "char", "char | bpe:N (N tokens, trained on the data) | gpt2, or any tiktoken")
    val_fraction: float = setting(
        0.1, "the last 10% of the text is for validation", above=0.0, below=1.0)
    prepared_dir: str = setting("data/prepared", "where prepared token files are cached")
    encoding_errors: str = setting("strict", "strict | replace: what to do with non-UTF-8 bytes",
                                   one_of=("strict", "replace"))
    text_field: str = setting("text", "the JSONL field or Parquet column that holds the text")
    val_path: str = setting("", "its own validation text: a file, folder or glob (\"\" = none)")
    workers: int = setting(0, "processes that encode BPE (0 = one per core)", at_least=0)

    def validate(self) -> None:
        check_fields(self, "data")
        # char and bpe:N without importing tiktoken
        if self.tokenizer != "char" and bpe_vocab_size(self.tokenizer) is None:
            from data.bpe import check_encoding
            check_encoding(self.tokenizer)


def mb_progress(label: str, total: int) -> Progress:
    return Progress(label, total, "MB", lambda n: f"{n / 1e6:.1f}", total < PROGRESS_MIN_BYTES)


def find_sources(source) -> list[Path]:
    """The regular files a data path (a file, a folder, a glob) names, sorted."""
    source = Path(source)
    # its name may hold glob characters
    if source.is_file():
        return [source]
    pattern = os.path.join(glob.escape(str(source)), "**", "*") if source.is_dir() else str(source)
    # not a pipe or a device: reading it could block, or never end
    files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if files:
        return files
    if source.is_dir():
        raise UserError(f"no files in the data directory {source}")
    if glob.has_magic(pattern):
        raise UserError(f"no files match {source}")
    raise UserError(f"data file not found: {source}")


def kind_suffix(name: str) -> str:
    """The ending that makes a file records (a KINDS key), or '' (a text)."""
    return next((suffix for suffix in KINDS if name.lower().endswith(suffix)), "")


def data_name(path) -> str:
    """The name of a data path's runs and entries: notes.txt.gz -> notes, books/*.txt -> books
    (a glob's last plain folder and file part, or data), licenses.jsonl -> licenses-jsonl."""
    path = Path(path)
    suffix = kind_suffix(path.name)
    stem = path.name[:-len(suffix)] if suffix else Path(path.name.removesuffix(".gz")).stem
    if glob.has_magic(str(path)):
        folders = [p for p in path.parent.parts
                   if p not in (path.anchor, "..") and not glob.has_magic(p)]
        stem = "-".join(folders[-1:] + [stem] * (not glob.has_magic(stem)))
    return (stem or "data") + (f"-{KINDS[suffix]}" if suffix else "")


def describe(source, files: list[Path], total: int, label: str) -> str:
    """What a folder or glob took: 'data: books (3 files: 2 .txt, 1 other; 3.2 MB)'."""
    known = [kind_suffix(p.name) or p.suffix.lower() for p in files]
    named = (s if s in KINDS or s in TEXT_SUFFIXES else "other" for s in known)
    kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(named).most_common())
    return (f"{label}: {source} ({len(files)} file{'s' * (len(files) > 1)}: {kinds}; "
            f"{total / 1e6:.1f} MB)")


def sha256(files: list[Path], progress: Progress) -> str:
    """One file's sha256, or that of several files' names and sha256s."""
    digests = []
    for path in files:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while data := f.read(1 << 20):
                h.update(data)
                progress.advance(len(data))
        digests.append(h.hexdigest())
    if len(files) == 1:
        return digests[0]
    base = os.path.commonpath([p.resolve() for p in files])
    names = (p.resolve().relative_to(base) for p in files)
    listing = "".join(f"{name}\0{d}\n" for name, d in zip(names, digests))
    return hashlib.sha256(listing.encode()).hexdigest()


def prepare(data: DataConfig, block_size: int | None = None) -> Path:
    """The entry of data's bytes and settings, prepared on a miss."""
    data.validate()
    val = find_sources(data.val_path) if data.val_path else []
    # val_path's files are not trained on
    taken = {p.resolve() for p in val}
    files = [p for p in find_sources(data.path) if p.resolve() not in taken]
    if not files:
        raise UserError(f"{data.path} holds no files but those of --data.val_path {data.val_path}")
    progress = mb_progress("hashing", sum(p.stat().st_size for p in files + val))
    sha = sha256(files, progress)
    if val:
        sha = hashlib.sha256(f"{sha}\0{sha256(val, progress)}".encode()).hexdigest()
    out = Path(data.prepared_dir) / entry_name(data, sha, files + val)
    for path, group, label in ((data.path, files, "data"), (data.val_path, val, "val")):
        if group and not Path(path).is_file():
            print(describe(path, group, sum(p.stat().st_size for p in group), label))
    if (meta := read_entry(out)) is None:
        from data.prepare import build
        meta = build(out, (files, val), sha, data, block_size)
    check_split_sizes(meta["tokens"], block_size)
    return out


def entry_name(data: DataConfig, sha256: str, files: list[Path]) -> str:
    """The data's name, then all that changes the token files (records: the field too)."""
    # bpe:4096 -> bpe4096
    label = re.sub(r"[^A-Za-z0-9_.]", "", data.tokenizer)
    errors = "-replace" * (data.encoding_errors == "replace")
    records = any(kind_suffix(p.name) for p in files)
    key = hashlib.sha256(f"{sha256}\0{data.text_field}".encode()).hexdigest() if records else sha256
    val = "files" if data.val_path else repr(data.val_fraction)
    return f"{data_name(data.path)[:64]}-{label}-{key[:12]}-val{val}{errors}"


def read_entry(entry: Path) -> dict | None:
    """A usable entry's meta.json (this FORMAT, the sizes it says), else None."""
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        want = [meta["tokens"][s] * np.dtype(meta["dtype"]).itemsize for s in SPLITS]
        sizes = [(entry / f"{s}.bin").stat().st_size for s in SPLITS]
        usable = meta["format"] == FORMAT and sizes == want
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if usable else None


def load_meta(entry) -> dict:
    """read_entry's meta.json, or a UserError naming the entry."""
    if (meta := read_entry(Path(entry))) is None:
        raise UserError(f"the prepared dataset {entry} is missing, unfinished, damaged "
                        f"or of an older format: delete it and prepare the data again")
    return meta


def check_split_sizes(tokens: dict, block_size: int | None) -> None:
    """Each split must hold block_size + 1 tokens (None: any)."""
    for split in SPLITS:
        if block_size is not None and tokens[split] < block_size + 1:
            raise UserError(f"the {split} split has {tokens[split]} tokens, fewer than "
                            f"block_size + 1 = {block_size + 1}; use a longer text or a "
                            f"smaller --model.block_size")
