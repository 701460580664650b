"""Checkpoints: written atomically, loaded without running code from the file.

An out dir holds ckpt_<step>.pt (the last `keep` of them) and best.pt (lowest val loss so far).
Each is a dict of tensors and plain Python values: format tag and version, resolved config,
tokenizer, model and optimizer state, step, best val loss, RNG and data-sampler states, elapsed time.

Saving writes a temporary file in the same directory, fsyncs it and renames it over the target, so
a reader (or a run killed mid-save) sees the old checkpoint or the new one, never half of one.
Loading uses torch.load(weights_only=True): unpickling is restricted to tensors and plain
containers, so a malicious file cannot execute code.
"""
import os
import pickle
import re
import zipfile
from pathlib import Path

import torch

FORMAT, VERSION = "gpt-checkpoint", 1
CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and why."""


def clean_state_dict(state: dict) -> dict:
    """Drop torch.compile's and DDP's wrapper prefixes from parameter names."""
    out = {}
    for k, v in state.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k.replace("._orig_mod.", ".")] = v
    return out


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj, path: Path) -> None:
    """torch.save(obj) to path such that path is always either the old file or the complete new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step checkpoints in out_dir, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), out_dir / name) for name in os.listdir(out_dir) if (m := CKPT_RE.match(name))]
    return sorted(found)


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1][1] if ckpts else None


def save_checkpoint(state: dict, out_dir: Path, step: int, keep: int, is_best: bool) -> Path:
    """Write ckpt_<step>.pt, point best.pt at it if is_best, then delete all but the last `keep`."""
    out_dir = Path(out_dir)
    path = out_dir / f"ckpt_{step:07d}.pt"
    atomic_save({"format": FORMAT, "version": VERSION, **state}, path)
    if is_best:   # a hard link costs no space or time; best.pt keeps the data when ckpt_* is rotated out
        tmp = out_dir / ".best.pt.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
            os.replace(tmp, out_dir / "best.pt")
        except OSError:
            atomic_save({"format": FORMAT, "version": VERSION, **state}, out_dir / "best.pt")
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def resolve_path(path: Path) -> Path:
    """A checkpoint file, or a run dir -> its best.pt, else its latest ckpt_*.pt."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        if (path / "best.pt").is_file():
            return path / "best.pt"
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"no checkpoint (best.pt or ckpt_*.pt) in {path}")
        return latest
    return path


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load and check a checkpoint file; any problem is a CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint is empty: {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unsafe content"
        raise CheckpointError(f"{path} was refused: it holds more than tensors and plain data ({first[:120]})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or not a torch file): "
                              f"{str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this project")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {ckpt.get('version')}, "
                              f"this code reads version {VERSION}")
    for key in ("config", "tokenizer", "model", "step"):
        if key not in ckpt:
            raise CheckpointError(f"{path} is missing {key!r}")
    return ckpt
