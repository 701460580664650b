"""Turn a text file into train/val token files plus a meta.json describing them.

A prepared dataset is a directory:
    train.bin, val.bin   raw token ids (uint16, or uint32 when the vocabulary needs it)
    meta.json            tokenizer, dtype, token counts, split, sha256 of the source text
It is cached by (source sha256, tokenizer, split): preparing the same file again reuses it.
It is written in a temporary directory renamed into place when complete, so it is never half there.
"""
import hashlib
import json
import os
import shutil
import urllib.request
from pathlib import Path

import numpy as np

from data.tokenizers import TokenizerError, build_tokenizer

FORMAT = 1


class DataError(ValueError):
    """A data file or setting that cannot be used; the message says which and why."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(url: str, path: Path) -> None:
    """Fetch url to path (through a temporary file, so a failed download leaves nothing behind)."""
    print(f"downloading {url} -> {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            f.write(r.read())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{path} is missing and could not be downloaded from {url} ({e}); "
                        f"pass a local copy with --data PATH") from None


def read_text(path: Path, errors: str = "strict") -> str:
    """The file as text; a non-UTF-8 byte is an error naming its offset (or replaced, errors='replace')."""
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    if not path.is_file():
        raise DataError(f"data path is not a file: {path}")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"data file is empty: {path}")
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}; "
                        f"set --data.encoding_errors=replace to replace such bytes") from None


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def prepare(source: Path, tokenizer: str, val_fraction: float, root: Path,
            encoding_errors: str = "strict") -> Path:
    """Prepare source (or reuse an earlier preparation of the same bytes); return the dataset dir."""
    source = Path(source)
    if not source.is_file():
        raise DataError(f"data path is not a file: {source}" if source.exists() else f"data file not found: {source}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
    sha = file_sha256(source)
    out = Path(root) / f"{source.stem}-{tokenizer}-{sha[:12]}-val{val_fraction:g}"
    if (out / "meta.json").exists():
        return out

    text = read_text(source, encoding_errors)
    split = int(len(text) * (1.0 - val_fraction))
    try:
        tok = build_tokenizer(tokenizer, text)
        parts = {"train": tok.encode(text[:split]), "val": tok.encode(text[split:])}
    except TokenizerError as e:
        raise DataError(str(e)) from None
    dtype = token_dtype(tok.vocab_size)
    meta = {
        "format": FORMAT, "source": str(source.resolve()), "sha256": sha,
        "tokenizer": tok.meta(), "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
        "split": {"val_fraction": val_fraction, "train_chars": split, "val_chars": len(text) - split},
        "tokens": {name: len(ids) for name, ids in parts.items()},
    }

    def write(folder: Path) -> None:
        for name, ids in parts.items():
            np.array(ids, dtype=dtype).tofile(folder / f"{name}.bin")
        (folder / "meta.json").write_text(json.dumps(meta, indent=1))

    publish(out, write)
    print(f"prepared {source} with tokenizer {tokenizer}: {meta['tokens']['train']:,} train and "
          f"{meta['tokens']['val']:,} val tokens (vocab {tok.vocab_size:,}) -> {out}")
    return out


def publish(out: Path, write) -> None:
    """write(folder) into a temporary folder next to out, then rename it to out: a prepared dataset
    is complete or absent, whatever kills the process (a crash leaves at most a .partial-* folder)."""
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        write(tmp)
        if out.exists() and not (out / "meta.json").exists():
            shutil.rmtree(out)           # an unfinished preparation from an older version: redo it
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "meta.json").exists():
                raise
            shutil.rmtree(tmp)           # another process finished the same preparation first
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"cannot write the prepared data to {out.parent}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_meta(dataset_dir: Path) -> dict:
    return json.loads((Path(dataset_dir) / "meta.json").read_text())
