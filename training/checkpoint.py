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
import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

from common import CheckpointError, TokenizerError, atomic_write, first_line, os_error, type_problem
from data.tokenizers import load_tokenizer
from model.config import ModelConfig
from model.gpt import GPT

FORMAT, VERSION = "gpt-checkpoint", 2
CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")
FOR_RESUMING = ("dataset", "optimizer", "scaler", "loader", "rng_ranks", "best_val_loss", "elapsed", "tokens",
                "skipped_steps", "is_best")   # besides what sampling needs: config, tokenizer, model, step


def list_checkpoints(out_dir) -> list[tuple[int, Path]]:
    """(step, path) of the step checkpoints in out_dir, oldest first."""
    names = os.listdir(out_dir) if Path(out_dir).is_dir() else []
    return sorted((int(m.group(1)), Path(out_dir) / n) for n in names if (m := CKPT_RE.match(n)))


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
        raise CheckpointError(f"could not write the checkpoint {path}: {reason}; the checkpoints written before "
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


def load_checkpoint(path, mmap: bool = True) -> dict:
    """A checkpoint file's dict, read without running code; any problem is one line naming the file (and
    an earlier checkpoint beside a damaged one). mmap: tensors are read from the file as they are used."""
    path = Path(path)
    here = CKPT_RE.match(path.name)
    older = [p for s, p in list_checkpoints(path.parent) if here and s < int(here.group(1))]
    hint = f"; the earlier checkpoint {older[-1].name} in the same directory may be intact" if older else ""
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}" if not path.exists() else f"{path} is not a file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint is empty: {path}{hint}")
    try:   # torch.save writes an uncompressed zip: every member's checksum, before torch reads a byte of it
        with zipfile.ZipFile(path) as archive:
            compressed = any(m.compress_type != zipfile.ZIP_STORED for m in archive.infolist())
            bad = None if compressed else archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint: truncated, or not a checkpoint file at all "
                              f"({first_line(e, 60)}){hint}") from None
    if compressed or bad:
        raise CheckpointError(f"{path} is damaged: {bad} does not match its checksum{hint}" if bad else
                              f"{path} is not a checkpoint written by this project (compressed members)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        refused = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
        raise CheckpointError(f"{path} was refused: it holds objects other than tensors and plain data, which "
                              f"could run code when loaded ({(refused or [first_line(e)])[0][:120]})") from None
    except Exception as e:   # damaged in a way the checksums do not show: never a traceback
        raise CheckpointError(f"{path} is not a readable checkpoint ({first_line(e, 100)}){hint}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this project")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {ckpt.get('version')!r}, this code reads "
                              f"{VERSION}")
    if problem := type_problem(ckpt, {"config": dict, "tokenizer": dict, "model": dict, "step": int}):
        raise CheckpointError(f"{path} is damaged: {problem}")
    return ckpt


def resolve(path) -> Path:
    """A checkpoint file, or a run dir -> its best.pt, else its latest ckpt_*.pt."""
    path = Path(path)
    if path.is_dir():
        found = path / "best.pt" if (path / "best.pt").is_file() else latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"no checkpoint (best.pt or ckpt_*.pt) in {path}")
        return found
    return path


@dataclasses.dataclass
class LoadedModel:
    """A model read from a checkpoint, ready to use (eval mode), with what came with it."""
    model: GPT
    tokenizer: object
    path: Path | str
    description: str          # one line: where it came from, its step and val loss
    step: int | None = None


def load_model(path, device=torch.device("cpu")) -> LoadedModel:
    """The model of a checkpoint (a file, or a run dir) or of a Hugging Face GPT-2 (a name such as gpt2,
    or a directory with config.json), with its tokenizer. Its config, tokenizer and weights are checked
    before the model is built: a small file cannot make this allocate a huge model."""
    source, path = str(path), Path(path)
    if (path / "config.json").is_file() and not (path / "best.pt").is_file() and latest_checkpoint(path) is None \
            or not path.exists() and "/" not in source and os.sep not in source:
        from hf.hub import load_gpt2   # a Hugging Face directory or hub name: the optional hf/ room
        model, tokenizer, description = load_gpt2(source)
        return LoadedModel(model.to(device), tokenizer, source, description)
    path = resolve(path)
    ckpt = load_checkpoint(path)
    stored, fields = ckpt["config"].get("model", {}), {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    try:
        if problem := type_problem(stored, fields, "model."):
            raise ValueError(problem)
        cfg = ModelConfig(**stored)
        cfg.validate()
    except Exception as e:
        raise CheckpointError(f"{path} does not hold a usable model: {first_line(e, 200)}") from None
    try:
        tokenizer = load_tokenizer(ckpt["tokenizer"])
    except TokenizerError as e:
        if ckpt["tokenizer"].get("kind") == "tiktoken":   # a named encoding whose files are missing here
            raise
        raise CheckpointError(f"{path} does not hold a usable tokenizer: {e}") from None
    try:
        with torch.device("meta"):   # shapes only: the weights must fit before memory is spent on them
            GPT(cfg).load_state_dict(ckpt["model"], strict=True, assign=True)
    except RuntimeError as e:   # its first problem, in torch's words
        problems = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        raise CheckpointError(f"{path}: its weights do not match its config: {(problems or [''])[0][:200]}") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path} is damaged: its tokenizer has {tokenizer.vocab_size} tokens, its model only "
                              f"model.vocab_size={cfg.vocab_size}")
    if bad := [k for k, v in ckpt["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]:
        raise CheckpointError(f"{path} holds non-finite weights (NaN or inf in {bad[0]}): the run diverged or the "
                              f"file is damaged; try an earlier checkpoint")
    model = GPT(cfg)
    model.load_state_dict(ckpt["model"])
    best = ckpt.get("best_val_loss")
    val = f", val loss {best:.4f}" if isinstance(best, float) else ""
    return LoadedModel(model.to(device).eval(), tokenizer, path, f"{path} (step {ckpt['step']}{val})", ckpt["step"])


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
        raise CheckpointError(f"{path} cannot be resumed from: it lacks {', '.join(missing)}")
    before = {f"model.{k}": v for k, v in ckpt["config"]["model"].items()}
    before["data.tokenizer"] = ckpt["config"].get("data", {}).get("tokenizer")
    for key, now in {**{f"model.{k}": v for k, v in cfg.to_dict()["model"].items()},
                     "data.tokenizer": cfg.data.tokenizer}.items():
        if before.get(key) != now and not (key == "model.vocab_size" and now == 0):
            raise CheckpointError(f"{key}: {json.dumps(before.get(key))} in the run, {json.dumps(now)} now: "
                                  f"--resume goes on with the run's own model and tokenizer (another --out_dir starts "
                                  f"a new run)")


def check_same_text(ckpt: dict, path, meta: dict, data_path: str, say) -> None:
    """A resumed run's text must give the tokens it was trained on (a char text that gained characters
    does not); another text of the same tokens is said, and goes on."""
    if ckpt["tokenizer"] != meta["tokenizer"]:
        def vocab(tokenizer: dict) -> str:
            return f"{len(tokenizer['chars'])} characters" if tokenizer["kind"] == "char" else tokenizer.get("name")
        raise CheckpointError(f"{path} was trained on a text of {vocab(ckpt['tokenizer'])}, {data_path} now gives "
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
        raise CheckpointError(f"{path} does not fit this run: {first_line(e)}") from None
    if len(rngs) != world and rank:   # another number of processes: new dropout streams per rank
        torch.manual_seed(seed + 1000 * ckpt["step"] + rank)
    return ckpt["step"], ckpt["best_val_loss"], ckpt["tokens"], ckpt["elapsed"], ckpt["skipped_steps"]
