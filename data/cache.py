"""The prepared-data cache: an entry (a directory) per text and settings under data.prepared_dir
(data/prepared/ by default; deleting it, or any entry in it, is always safe).

  an entry   train.bin, val.bin: the token ids (uint16, or uint32 for a larger vocabulary), and
             meta.json: FORMAT, the tokenizer, dtype, tokens and UTF-8 bytes per split, ... Its
             name holds the text's sha256 and the settings: another text or setting, another entry
  usable     a meta.json of this FORMAT and .bin files of the sizes it says; nothing more is checked,
             since meta.json is written whole and last (a new layout comes with a new FORMAT). An
             entry that is not usable is prepared again, or, where the text is not at hand, named in
             an error that says to delete it
  published  built in a temporary directory beside it (.<entry>.tmp-<random>), renamed into place
"""
import glob
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from common import UserError

FORMAT = 3   # meta.json's layout
SPLITS = ("train", "val")


def entry_name(source: str, tokenizer: str, sha256: str, val_fraction: float, errors: str) -> str:
    """The entry's name: the text's (a glob's folder's), cut to 64 characters (a file system allows
    255 bytes), then all that changes the token files."""
    stem = Path(source).parent.name if glob.has_magic(str(source)) else Path(source).stem
    label = re.sub(r"[^A-Za-z0-9_.]", "", tokenizer)   # bpe:4096 -> bpe4096
    return f"{stem[:64]}-{label}-{sha256[:12]}-val{val_fraction!r}{'-replace' * (errors == 'replace')}"


def read_entry(entry: Path) -> tuple[dict | None, str | None]:
    """(meta, None) for a usable entry, (None, why) for one that is not, (None, None) for none."""
    if not entry.exists():
        return None, None
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):   # missing (an unfinished entry), unreadable, not UTF-8, not JSON
        return None, "has no readable meta.json"
    version = meta.get("format") if isinstance(meta, dict) else None
    if version != FORMAT:
        return None, f"is of format {version}, not this code's {FORMAT}"
    for split in SPLITS:
        path, size = entry / f"{split}.bin", meta["tokens"][split] * np.dtype(meta["dtype"]).itemsize
        if not path.is_file() or path.stat().st_size != size:
            return None, f"has a {split}.bin that is not the {size:,} bytes meta.json says"
    return meta, None


def load_meta(entry) -> dict:
    """The meta.json of a usable prepared dataset; an unusable one is a UserError naming it."""
    meta, problem = read_entry(Path(entry))
    if meta is None:
        raise UserError(f"the prepared dataset {entry} {problem or 'does not exist'}: delete it and "
                        f"prepare the data again")
    return meta


def check_split_sizes(tokens: dict, block_size: int | None) -> None:
    """Each split must hold one training window: block_size + 1 tokens (None: no check)."""
    for split in SPLITS:
        if block_size is not None and tokens[split] < block_size + 1:
            raise UserError(f"the {split} split has {tokens[split]} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}; use a longer text or a smaller --model.block_size")


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished tmp to out, replacing an unusable entry there (a usable one, which
    another process has just published, is kept)."""
    if read_entry(out)[0] is None:
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
