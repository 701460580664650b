"""The prepared-data cache: a directory per (text, tokenizer, split, encoding errors) under the root
(data.prepared_dir), built in a temporary directory beside it and published by a rename.

  an entry    train.bin, val.bin: raw token ids (uint16, or uint32 when the vocabulary needs it), and
              meta.json: the tokenizer, dtype, tokens and UTF-8 bytes per split, the largest token id,
              the text's sha256, ... Its name holds the sha256 and the settings
  checked     each time it is used, from meta.json and two file sizes alone: the keys and their types,
              the settings asked for, a dtype that fits the vocabulary and the largest id below it, file
              sizes that match the token counts. One that fails is prepared again (or, where the text
              is not at hand, named in a UserError that says to delete it)
  temporary   .<entry>.tmp-<random>, made with os.mkdir, so the umask applies as to any file; removed
              on any failure or signal. One a killed process left shows in --list and goes with --clean
"""
import json
import os
import re
import secrets
import shutil
from pathlib import Path

import numpy as np

from common import UserError, type_problem
from data.tokenizers import load_tokenizer

FORMAT = 2
SPLITS = ("train", "val")
SCHEMA = {"format": int, "source": str, "sha256": str, "files": int, "tokenizer_spec": str, "tokenizer": dict,
          "vocab_size": int, "dtype": str, "max_token": int, "encoding_errors": str, "split": dict, "tokens": dict,
          "bytes": dict}   # bytes: the UTF-8 bytes of each split's text (what bits per byte divides by)
PARTS = {"split": {"val_fraction": float, "train_chars": int, "val_chars": int},
         "tokens": {"train": int, "val": int}, "bytes": {"train": int, "val": int}}
NAME = re.compile(r".+-[0-9a-f]{12}-val[0-9.e+-]+(-replace)?(?P<tmp>\.tmp-[0-9a-f]+)?")   # an entry's, a temp dir's


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def entry_name(stem: str, tokenizer: str, sha256: str, val_fraction: float, encoding_errors: str) -> str:
    """Everything that changes the token files is in the name (a long file name is cut to 64 characters:
    the file system allows 255 bytes)."""
    label = re.sub(r"[^A-Za-z0-9_.]", "", tokenizer)   # bpe:4096 -> bpe4096
    replace = "-replace" if encoding_errors == "replace" else ""
    return f"{stem[:64]}-{label}-{sha256[:12]}-val{val_fraction:g}{replace}"


def _problem(entry: Path, meta, expect: dict) -> str | None:
    """Why a read meta.json and its entry cannot be used, or None."""
    if not isinstance(meta, dict):
        return "is damaged (meta.json is not an object)"
    if meta.get("format") != FORMAT:
        return f"is outdated (format {meta.get('format')}; this code writes format {FORMAT})"
    problem = type_problem(meta, SCHEMA)
    for key, schema in PARTS.items():
        problem = problem or type_problem(meta[key], schema, f"{key}.")
    if problem:
        return f"is damaged (meta.json: {problem})"
    for key, want in expect.items():
        got = meta["split"][key] if key == "val_fraction" else meta[key]
        if got != want:
            return f"holds another preparation (its {key} is {got!r}, not {want!r})"
    vocab = meta["vocab_size"]
    if meta["dtype"] != np.dtype(token_dtype(vocab)).name:
        return f"is damaged (dtype {meta['dtype']} does not fit a vocabulary of {vocab})"
    if meta["max_token"] >= vocab:
        return f"is damaged (token id {meta['max_token']} is not below vocab_size {vocab})"
    try:   # char and a trained BPE are rebuilt from meta.json at once; a named tiktoken one would load files
        if meta["tokenizer"].get("kind") != "tiktoken" and load_tokenizer(meta["tokenizer"]).vocab_size != vocab:
            return f"is damaged (its tokenizer does not have vocab_size {vocab} tokens)"
    except UserError as e:
        return f"is damaged ({e})"
    for split in SPLITS:
        path, size = entry / f"{split}.bin", meta["tokens"][split] * np.dtype(meta["dtype"]).itemsize
        if not path.is_file() or path.stat().st_size != size:
            return f"is damaged ({split}.bin is not the {size:,} bytes meta.json says)"
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
    """The checked meta.json of a prepared dataset; a damaged entry is a UserError naming it."""
    meta, problem = read_entry(entry)
    if meta is None:
        raise UserError(f"the prepared dataset {entry} {problem or 'does not exist'}: delete it and prepare the "
                        f"data again")
    return meta


def check_split_sizes(tokens: dict, block_size: int | None) -> None:
    """Each split must hold one training window: block_size + 1 tokens (None: no check)."""
    for split in SPLITS:
        if block_size is not None and tokens[split] < block_size + 1:
            raise UserError(f"the {split} split has {tokens[split]} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}; use a longer text or a smaller --model.block_size")


def make_temp_dir(out: Path) -> Path:
    """A new hidden directory beside out, of the mode the umask gives (tempfile.mkdtemp's is 0700)."""
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, out: Path, expect: dict) -> None:
    """Rename the finished tmp to out, unless another process has just published the same dataset
    there; a damaged or unfinished out is replaced."""
    if read_entry(out, expect)[0] is None:
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)


# ---------------------------------------------------------------- python -m data.prepare --list / --clean

def entries(root: Path) -> list[tuple[Path, float]]:
    """(path, MB) of each entry and temporary directory in root, by name."""
    found = sorted(p for p in Path(root).glob("*") if NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    return [(p, sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e6) for p in found]


def list_entries(root: Path) -> None:
    """A line per entry: its name, MB, tokenizer, source and tokens (or what is wrong with it)."""
    found = entries(root)
    for path, mb in found:
        if NAME.fullmatch(path.name)["tmp"]:
            what = "left by a preparation that was stopped (or is still running); --clean removes it"
        elif (entry := read_entry(path))[0] is None:
            what = entry[1]   # what is wrong with it
        else:
            meta, tokens = entry[0], entry[0]["tokens"]
            what = f"{meta['tokenizer_spec']}  {meta['source']}  {tokens['train']:,} + {tokens['val']:,} tokens"
        print(f"{path.name}  {mb:,.1f} MB  {what}")
    print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {sum(mb for _, mb in found):,.1f} MB in {root}")


def clean(root: Path) -> None:
    """Remove every entry and temporary directory in root; say how much space that freed."""
    found = entries(root)
    for path, _ in found:
        shutil.rmtree(path)
    print(f"removed {len(found)} entr{'y' if len(found) == 1 else 'ies'} from {root}: "
          f"{sum(mb for _, mb in found):,.1f} MB freed")
