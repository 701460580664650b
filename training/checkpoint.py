"""Checkpoints: writing them, reading them, a model to use from one, and a run continued from one.

A run's out dir (training/outdir.py) holds ckpt_<step>.pt (the newest train.keep_checkpoints) and
best.pt (the lowest val loss: a hard link to one of them, or a copy).

Choices:
  whole files   a checkpoint is written to a temporary file and renamed (common.atomic_write): a reader,
                or a run killed mid-save, finds the old checkpoint or the new one, never part of one
  safe reading  every member's checksum, then torch.load(weights_only=True): tensors and plain data
                only, so a file cannot run code; the weights are loaded strictly into the model their
                config describes, checked on shapes alone before memory is spent on them
  exact resume  a checkpoint holds the whole training state: the optimizer, the data order and every
                rank's random generators, besides the weights
"""
import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from common import UserError, atomic_write, first_line, os_error
from model.loading import (CKPT_RE, FORMAT, VERSION, LoadedModel, find_checkpoint, list_checkpoints,  # noqa: F401
                           load_model, read_checkpoint)

FOR_RESUMING = ("dataset", "optimizer", "scaler", "loader", "rng_ranks", "best_val_loss", "elapsed", "tokens",
                "skipped_steps", "is_best")   # besides what sampling needs: config, tokenizer, model, step


def latest_checkpoint(out_dir) -> Path | None:
    return (list_checkpoints(out_dir) or [(0, None)])[-1][1]


def link_best(path: Path) -> None:
    """best.pt becomes the checkpoint at path: a hard link (no space; it keeps the data when ckpt_* is
    rotated out), or a copy where the file system has none."""
    best, tmp = path.parent / "best.pt", path.parent / ".best.pt.tmp"
    if best.exists() and os.path.samefile(best, path):
        return
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:   # no hard links here
        with open(path, "rb") as src:
            atomic_write(best, lambda f: shutil.copyfileobj(src, f))
        return
    os.replace(tmp, best)


def save_checkpoint(ckpt: dict, out_dir, keep: int) -> Path:
    """Write ckpt_<step>.pt, make it best.pt if it is the best, then delete all but the newest `keep`.
    Any failure is one line and leaves the earlier checkpoints as they were."""
    path = Path(out_dir) / f"ckpt_{ckpt['step']:07d}.pt"
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
        if ckpt.get("is_best"):
            link_best(path)
    except (OSError, RuntimeError) as e:   # torch's zip writer reports a full disk as "unexpected pos ..."
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "unexpected pos" in str(e)
        reason = "the disk is full (no space left on device)" if full else os_error(e) if isinstance(e, OSError) \
            else first_line(e, 120)
        raise UserError(f"could not write the checkpoint {path}: {reason}; the checkpoints written before "
                              f"are kept") from None
    best = Path(out_dir) / "best.pt"
    for step, later in list_checkpoints(out_dir):   # a run resumed from an earlier checkpoint replaces these
        if step > ckpt["step"]:
            if best.is_file() and os.path.samefile(best, later):   # (and a best.pt of theirs)
                best.unlink()
            later.unlink(missing_ok=True)
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def rng_state() -> dict:
    """Every generator a run draws from, as tensors and plain data: numpy's, torch's CPU one, every GPU's, MPS's."""
    s = np.random.get_state()
    return {"numpy": s[1].tolist(), "numpy_pos": int(s[2]), "torch": torch.get_rng_state(),
            "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],   # this process's GPU
            "mps": torch.mps.get_rng_state() if torch.backends.mps.is_available() else None}


def set_rng_state(s: dict) -> None:
    np.random.set_state(("MT19937", np.array(s["numpy"], dtype=np.uint32), s["numpy_pos"], 0, 0.0))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"][0])
    if s.get("mps") is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(s["mps"])


# ---------------------------------------------------------------- resuming

def check_resumable(ckpt: dict, path, cfg) -> None:
    """Resuming needs the whole training state, and goes on with the run's own model and tokenizer."""
    if missing := [k for k in FOR_RESUMING if k not in ckpt]:
        raise UserError(f"{path} cannot be resumed from: it lacks {', '.join(missing)}")
    before = {f"model.{k}": v for k, v in ckpt["config"]["model"].items()}
    before["data.tokenizer"] = ckpt["config"].get("data", {}).get("tokenizer")
    for key, now in {**{f"model.{k}": v for k, v in cfg.to_dict()["model"].items()},
                     "data.tokenizer": cfg.data.tokenizer}.items():
        if before.get(key) != now and not (key == "model.vocab_size" and now == 0):
            raise UserError(f"{key}: {json.dumps(before.get(key))} in the run, {json.dumps(now)} now: "
                                  f"--resume goes on with the run's own model and tokenizer (another --out_dir starts "
                                  f"a new run)")


def check_same_text(ckpt: dict, path, meta: dict, data_path: str, say) -> None:
    """A resumed run's text must give the tokens it was trained on (a char text that gained characters
    does not); another text of the same tokens is said, and goes on."""
    if ckpt["tokenizer"] != meta["tokenizer"]:
        def vocab(tokenizer: dict) -> str:
            return f"{len(tokenizer['chars'])} characters" if tokenizer["kind"] == "char" else tokenizer.get("name")
        raise UserError(f"{path} was trained on a text of {vocab(ckpt['tokenizer'])}, {data_path} now gives "
                              f"{vocab(meta['tokenizer'])}: the text changed, and --resume needs the one it was "
                              f"trained on (or start a new run: --overwrite, or another --out_dir)")
    if (was := ckpt["dataset"].get("sha256")) != (now := meta.get("sha256")):
        say(f"warning: the training text changed since this checkpoint (sha256 {was[:12]}... then, {now[:12]}... "
            f"now); training goes on with the new text")


def restore(ckpt, path, model, optimizer, scaler, loader, rank: int, world: int, seed: int):
    """Continue the checkpoint: weights, optimizer, scaler, data order, every rank's generators;
    (step, best val loss, tokens, seconds, skipped steps) of the run so far."""
    try:
        if world > 1:
            from training import distributed
            distributed.load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"])
        else:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        rngs = ckpt["rng_ranks"]   # one per rank of the run that saved it
        set_rng_state(rngs[rank] if len(rngs) == world else rngs[0])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{path} does not fit this run: {first_line(e)}") from None
    if len(rngs) != world and rank:   # another number of processes: new dropout streams per rank
        torch.manual_seed(seed + 1000 * ckpt["step"] + rank)
    return ckpt["step"], ckpt["best_val_loss"], ckpt["tokens"], ckpt["elapsed"], ckpt["skipped_steps"]
