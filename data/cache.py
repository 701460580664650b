"""The prepared-data cache: one directory per (text, tokenizer, split, encoding errors), checked every
time it is used, built in a temporary directory and published by a rename.

An entry holds
    train.bin, val.bin   raw token ids (uint16, or uint32 when the vocabulary needs it)
    meta.json            the FORMAT, the tokenizer, dtype, tokens and UTF-8 bytes per split, the largest
                         token id, the sha256 of the source text, ...
and is used only when meta.json has every key of SCHEMA with its type and this FORMAT, the token
files have the sizes meta.json gives, the dtype fits the vocabulary, and the largest token id (found
while the files were written) is below the vocabulary size. These checks read only meta.json and two
file sizes. An entry that fails them is prepared again from its text (or, where the text is not at
hand, named in a DataError that says to delete it).

A temporary directory is named .<entry>.tmp-<pid>@<host>-<random>. The next preparation in the same
root removes those whose process has died on this host, and any (another host's, an unnamed one, and
on Windows, where a process cannot be asked whether it lives, any) untouched for STALE_SECONDS; a live
process's directory is never touched.
"""
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

import numpy as np

from common import WINDOWS, DataError, TokenizerError, type_problem


def alive(pid):  # temporary until the data rewrite lands
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True

from data.tokenizers import load_tokenizer

FORMAT = 2
STALE_SECONDS = 24 * 3600
SPLITS = ("train", "val")
SCHEMA = {
    "format": int, "source": str, "sha256": str, "files": int,
    "tokenizer_spec": str, "tokenizer": dict, "vocab_size": int, "dtype": str, "max_token": int,
    "encoding_errors": str,
    "split": {"val_fraction": float, "train_chars": int, "val_chars": int},
    "tokens": {"train": int, "val": int},
    "bytes": {"train": int, "val": int},   # UTF-8 bytes of each split's text (what bits per byte divides by)
}


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def entry_name(stem: str, tokenizer: str, sha256: str, val_fraction: float, encoding_errors: str) -> str:
    """The entry's directory name: everything that changes the token files is in it."""
    label = re.sub(r"[^A-Za-z0-9_.]", "", tokenizer)   # bpe:4096 -> bpe4096
    stem = stem[:64]   # a long file name must not make a name too long for the file system (255 bytes)
    return f"{stem}-{label}-{sha256[:12]}-val{val_fraction:g}" + ("-replace" if encoding_errors == "replace" else "")


def _problem(entry: Path, meta, expect: dict) -> str | None:
    """Why a read meta.json and its entry cannot be used, or None."""
    if not isinstance(meta, dict):
        return "is damaged (meta.json is not an object)"
    if type(meta.get("format")) is not int:
        return "is damaged (meta.json has no format)"
    if meta["format"] != FORMAT:
        return f"is outdated (format {meta['format']}; this code writes format {FORMAT})"
    problem = type_problem(meta, {k: (dict if isinstance(v, dict) else v) for k, v in SCHEMA.items()})
    if problem:
        return f"is damaged (meta.json: {problem})"
    for key, want in expect.items():
        got = meta["split"]["val_fraction"] if key == "val_fraction" else meta[key]
        if got != want:
            return f"holds another preparation (its {key} is {got!r}, not {want!r})"
    if meta["dtype"] != np.dtype(token_dtype(meta["vocab_size"])).name:
        return f"is damaged (dtype {meta['dtype']} does not fit a vocabulary of {meta['vocab_size']})"
    if meta["max_token"] >= meta["vocab_size"]:
        return f"is damaged (token id {meta['max_token']} is not below vocab_size {meta['vocab_size']})"
    kind = meta["tokenizer"].get("kind")
    if kind in ("char", "bpe"):   # cheap to rebuild and check; a named tiktoken BPE would load a file
        try:
            vocab = load_tokenizer(meta["tokenizer"]).vocab_size
        except TokenizerError as e:
            return f"is damaged ({e})"
        if vocab != meta["vocab_size"]:
            return f"is damaged (its tokenizer has {vocab} tokens, vocab_size says {meta['vocab_size']})"
    elif kind != "tiktoken" or not isinstance(meta["tokenizer"].get("name"), str):
        return "is damaged (meta.json's tokenizer is not a tokenizer description)"
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        try:
            size = os.stat(entry / f"{split}.bin").st_size
        except OSError:
            return f"is damaged ({split}.bin is missing)"
        if size != meta["tokens"][split] * itemsize:
            return (f"is damaged ({split}.bin has {size:,} bytes, meta.json says {meta['tokens'][split]:,} "
                    f"tokens of {itemsize} bytes)")
    return None


def read_entry(entry: Path, expect: dict | None = None) -> tuple[dict | None, str | None]:
    """(meta, None) for a sound entry, (None, why) for one that cannot be used, (None, None) for none.
    expect: meta values it must have (sha256, tokenizer_spec, encoding_errors, val_fraction)."""
    entry = Path(entry)
    if not entry.exists():
        return None, None
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "is unfinished (it has no meta.json)"
    except (OSError, ValueError) as e:   # unreadable, not UTF-8, not JSON
        return None, f"is damaged (meta.json cannot be read: {str(e)[:80]})"
    problem = _problem(entry, meta, expect or {})
    return (None, problem) if problem else (meta, None)


def load_meta(entry: Path) -> dict:
    """The checked meta.json of a prepared dataset; a damaged entry is a DataError naming it."""
    meta, problem = read_entry(entry)
    if meta is None:
        raise DataError(f"the prepared dataset {entry} {problem or 'does not exist'}: delete it and prepare the "
                        f"data again")
    return meta


def check_split_sizes(tokens: dict, block_size: int | None) -> None:
    """Each split must hold one training window: block_size + 1 tokens (None: no check)."""
    for split in SPLITS:
        if block_size is not None and tokens[split] < block_size + 1:
            raise DataError(f"the {split} split has {tokens[split]} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}; use a longer text or a smaller --model.block_size")


def bits_per_byte(loss_nats_per_token: float, tokens: int, nbytes: int) -> float:
    """A mean cross-entropy (nats per token) over `tokens` tokens as bits per byte of the `nbytes`
    bytes of text they encode: comparable across tokenizers, unlike a loss per token."""
    if nbytes <= 0:
        raise ValueError(f"bits per byte needs a positive byte count, got {nbytes}")
    return loss_nats_per_token * tokens / nbytes / math.log(2)


# ---------------------------------------------------------------- temporary directories

def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


_TEMP = re.compile(r"\..+\.tmp-(?:(\d+)@([A-Za-z0-9._]+)-)?[A-Za-z0-9_]+")


def make_temp_dir(out: Path) -> Path:
    """A new hidden directory beside out, named after this process and host."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}@{_host()}-", dir=out.parent))


def _last_change(path: Path) -> float:
    times = [path.stat().st_mtime]
    for child in path.iterdir():
        with suppress(OSError):   # removed meanwhile
            times.append(child.stat().st_mtime)
    return max(times)


def remove_stale_temp_dirs(root: Path) -> list[Path]:
    """Remove the temporary directories in root that no live preparation owns; return them."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        match = _TEMP.fullmatch(name)
        path = Path(root) / name
        if not match or path.is_symlink() or not path.is_dir():
            continue
        pid, host = match.groups()
        ask = pid and host == _host() and not WINDOWS   # whether its process can be asked about (not on Windows)
        try:
            stale = not alive(int(pid)) if ask else time.time() - _last_change(path) > STALE_SECONDS
        except OSError:   # removed meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            owner = f"by process {pid}, which is gone" if ask else "untouched for a day"
            print(f"notice: removed {path}, left {owner} by a preparation that was stopped", file=sys.stderr)
    return removed


def publish(tmp: Path, out: Path, expect: dict) -> None:
    """Rename the finished tmp dir to out. Where out exists: keep it if it is sound and as expected
    (another process finished the same dataset first), else replace it."""
    try:
        os.rename(tmp, out)
        return
    except OSError:
        if read_entry(out, expect)[0] is not None:
            return
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
