"""Checkpoints: written atomically, loaded without running code from the file.

An out dir holds ckpt_<step>.pt (the last `keep` of them) and best.pt (lowest val loss so far).
Each is a dict of tensors and plain Python values: format tag and version, resolved config,
tokenizer, model and optimizer state, step, best val loss, RNG and data-sampler states, elapsed time.

Saving writes a temporary file in the same directory, fsyncs it and renames it over the target, so
a reader (or a run killed mid-save) sees the old checkpoint or the new one, never half of one; old
checkpoints are deleted only after the new one is complete. Loading uses torch.load(weights_only=True):
unpickling is restricted to tensors and plain containers, so a malicious file cannot execute code.
"""
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

FORMAT, VERSION = "gpt-checkpoint", 1
CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")
WRAPPERS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}   # torch.compile, FSDP, checkpointing
RESUME_KEYS = ("optimizer", "rng", "loader", "best_val_loss", "elapsed")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, used or written; the message says which file and why."""


def clean_key(name: str) -> str:
    """'module._orig_mod.blocks.0.attn.weight' -> 'blocks.0.attn.weight': drop the names that
    torch.compile, FSDP and activation checkpointing insert anywhere, and DDP's leading 'module.'."""
    parts = [p for p in name.split(".") if p not in WRAPPERS]
    while len(parts) > 1 and parts[0] == "module":
        parts = [p for p in parts[1:] if p not in WRAPPERS]
    return ".".join(parts)


def clean_state_dict(state: dict) -> dict:
    """A model state dict with wrapper prefixes removed from its keys (see clean_key)."""
    return {clean_key(k): v for k, v in state.items()}


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


def _atomic_write(path: Path, write) -> None:
    """write(file) to a temporary file next to path, fsync, rename over path: all or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_save(obj, path: Path) -> None:
    """torch.save(obj) to path such that path is always either the old file or the complete new one."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def remove_partial_saves(out_dir: Path) -> None:
    """Delete the temporary files of saves that a kill interrupted (.<name>.tmp)."""
    for name in os.listdir(out_dir) if Path(out_dir).is_dir() else []:
        if name.startswith(".") and name.endswith(".tmp"):
            (Path(out_dir) / name).unlink(missing_ok=True)


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


def link_best(path: Path) -> None:
    """Make best.pt the checkpoint at path: a hard link (no space, no time; it keeps the data when
    ckpt_* is rotated out), or a copy where the file system has no hard links."""
    best, tmp = path.parent / "best.pt", path.parent / ".best.pt.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        with open(path, "rb") as src:
            _atomic_write(best, lambda f: shutil.copyfileobj(src, f))
        return
    os.replace(tmp, best)


def save_checkpoint(state: dict, out_dir: Path, step: int, keep: int, is_best: bool) -> Path:
    """Write ckpt_<step>.pt, point best.pt at it if is_best, then delete all but the last `keep`.
    A failed write (a full disk) is a CheckpointError and leaves the earlier checkpoints as they were."""
    out_dir = Path(out_dir)
    path = out_dir / f"ckpt_{step:07d}.pt"
    try:
        atomic_save({"format": FORMAT, "version": VERSION, **state, "is_best": is_best}, path)
        if is_best:
            link_best(path)
    except OSError as e:
        raise CheckpointError(f"could not write the checkpoint {path}: {e.strerror or e}; "
                              f"the checkpoints written before are kept") from None
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def repair_best(path: Path, ckpt: dict) -> None:
    """A run killed between writing its best checkpoint and linking best.pt to it left best.pt
    stale: resuming from that checkpoint links it now."""
    best = Path(path).parent / "best.pt"
    if ckpt.get("is_best") and not (best.exists() and os.path.samefile(best, path)):
        link_best(Path(path))


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


def _refusal_reason(error: Exception) -> str:
    """The line of torch's weights_only error that says what was refused (e.g. 'GLOBAL posix.system')."""
    lines = [l.strip() for l in str(error).splitlines() if l.strip()]
    named = [l for l in lines if "GLOBAL" in l or "Unsupported" in l]
    return (named or lines or ["unsupported content"])[0][:160]


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load and check a checkpoint file; any problem is a CheckpointError naming the file.
    Only tensors and plain data are unpickled: nothing in the file is ever executed."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint is not a file: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint is empty: {path}")
    if not zipfile.is_zipfile(path):   # torch.save writes a zip archive; its index is at the very end
        raise CheckpointError(f"{path} is not a readable checkpoint: truncated, or not a checkpoint file at all")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} was refused: it holds objects other than tensors and plain data, "
                              f"which could run code when loaded ({_refusal_reason(e)})") from None
    except Exception as e:   # a damaged archive can fail in many ways; none of them may escape as a traceback
        detail = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint (damaged or truncated: {detail})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this project")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {ckpt.get('version')!r}, "
                              f"this code reads version {VERSION}")
    for key, kind in (("config", dict), ("tokenizer", dict), ("model", dict), ("step", int)):
        if not isinstance(ckpt.get(key), kind):
            raise CheckpointError(f"{path} is damaged: {key!r} is missing or not a {kind.__name__}")
    if not isinstance(ckpt["config"].get("model"), dict):
        raise CheckpointError(f"{path} is damaged: its config has no model section")
    return ckpt


def check_resumable(ckpt: dict, path: Path) -> None:
    """A checkpoint to resume from must hold the whole training state, not only the weights."""
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} cannot be resumed from: it lacks {', '.join(missing)}")
