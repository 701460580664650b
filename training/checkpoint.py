"""Checkpoints: the out dir, writing them, and resuming from one (loading.py reads them).
An out dir holds ckpt_<step>.pt (the newest train.keep_checkpoints), best.pt (the one of the
lowest val loss), config.toml, metrics.jsonl and curves.png.
"""
import errno
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from common import UserError, atomic_write, first_line
from loading import CKPT_RE, FORMAT, VERSION, list_checkpoints
from training.config import FIELDS, flat, fmt, load_toml

RUN_FILES = ("best.pt", "config.toml", "metrics.jsonl", "curves.png")
# the keys resuming needs besides the model's, which loading.py reads
FOR_RESUMING = ("optimizer", "scaler", "loader", "rng_ranks", "dataset", "elapsed",
                "tokens", "is_best")


@dataclass
class Progress:
    """Where a run is, as its checkpoints record it."""
    step: int = 0
    tokens: int = 0
    best_val_loss: float = math.inf
    # seconds of training before this process (a resumed run's)
    elapsed: float = 0.0
    is_best: bool = False


def run_files(out: Path) -> list[str]:
    names = (p.name for p in out.glob("*"))
    return sorted(n for n in names if n in RUN_FILES or CKPT_RE.match(n))


def check_out_dir(out: Path, run: dict, data, resume: bool, overwrite: bool, checkpoint, again):
    """The checkpoint a run on `data` continues (None: a new run), once out (its config.toml:
    `run`) can take it; a refusal names `again`, the command that continues it."""
    latest = (list_checkpoints(out) or [(0, out / "best.pt")])[-1][1]
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other: continue the run, "
                        "or start it over")
    if resume and checkpoint is not None and not Path(checkpoint).is_file():
        raise UserError(f"--resume {checkpoint}: no such checkpoint file")
    if resume and checkpoint is None and not latest.is_file():
        raise UserError(f"--resume: no checkpoint (ckpt_*.pt or best.pt) in {out} to resume "
                        f"from; leave out --resume to start a new run")
    # the folder it will be made in
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the out dir {out}: {parent} is not a writable folder")
    held = run_files(out)
    # stopped before its first checkpoint (a config.toml of this code's): no run to keep
    unsaved = not latest.is_file() and run and set(run) <= set(FIELDS) and "out_dir" in run
    if resume or overwrite or not held or unsaved:
        return Path(checkpoint or latest).resolve() if resume else None
    kept = (f"--overwrite starts over (keeping them in {out.name}.replaced-<time>), "
            f"or another --out_dir")
    if not latest.is_file():
        raise UserError(f"{out} holds {', '.join(held)}, which a run writes: {kept}")
    was = (run.get("data.path"), run.get("data.tokenizer"))
    now = (data.path, data.tokenizer)
    # an out dir given twice, or texts of one name in two folders
    if run and was != now:
        raise UserError(f"{out} already holds a run trained on {was[0]} ({was[1]}), not "
                        f"{now[0]} ({now[1]}): {again} would continue that run on other "
                        f"data; {kept}")
    raise UserError(f"{out} already holds a run: {again} continues it, {kept}")


def run_config(out: Path) -> dict:
    """The settings in out's config.toml ({}: none, or not TOML)."""
    try:
        return flat(load_toml(out / "config.toml"))
    except (OSError, UserError):
        return {}


def open_out_dir(out: Path, overwrite: bool, first_writes) -> Path | None:
    """Make out (--overwrite: an earlier run renamed aside first, returned), then first_writes();
    a UserError there undoes it all."""
    made, aside = not out.exists(), None
    if overwrite and run_files(out):
        now = datetime.now(timezone.utc)
        aside = out.with_name(f"{out.name}.replaced-{now:%Y%m%d-%H%M%S.%f}")
        os.rename(out, aside)
    out.mkdir(parents=True, exist_ok=True)
    try:
        first_writes()
    except UserError:
        if made or aside:
            shutil.rmtree(out, ignore_errors=True)
        if aside:
            os.rename(aside, out)
        raise
    return aside


def link_best(path: Path) -> None:
    """best.pt becomes path: a hard link (it outlives ckpt_*'s rotation), else a copy."""
    best = path.parent / "best.pt"
    tmp = path.parent / ".best.pt.tmp"
    if best.exists() and os.path.samefile(best, path):
        return
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        with open(path, "rb") as src:
            atomic_write(best, lambda f: shutil.copyfileobj(src, f))
        return
    os.replace(tmp, best)


class Saver(ThreadPoolExecutor):
    """Checkpoints written on a thread while the steps go on: save(state) waits for the write
    before and hands the thread a host copy; then(fn) runs fn there after it."""

    def __init__(self, out: Path | None, keep: int):
        super().__init__(1)
        self.out, self.keep, self.pending = out, keep, []

    def save(self, state: dict) -> None:
        if self.out is None:
            return
        self.wait()
        ckpt = {"format": FORMAT, "version": VERSION} | state
        self.then(save_checkpoint, to_host(ckpt), self.out, self.keep)

    def then(self, fn, *args) -> None:
        if self.out is not None:
            self.pending.append(self.submit(fn, *args))

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for write in pending:
            write.result()


def save_checkpoint(ckpt: dict, out_dir, keep: int) -> None:
    """Write ckpt_<step>.pt (and best.pt); keep the newest `keep`, none later (a run resumed
    from an earlier checkpoint replaces them)."""
    path = Path(out_dir) / f"ckpt_{ckpt['step']:07d}.pt"
    best = Path(out_dir) / "best.pt"
    # an abandoned run's checkpoint of this step is replaced
    if path.is_file() and best.is_file() and os.path.samefile(best, path):
        best.unlink()
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:
        raise UserError(f"could not write {path}: {why_unwritten(e)}") from None
    if ckpt.get("is_best"):
        link_best(path)
    for step, later in list_checkpoints(out_dir):
        if step > ckpt["step"]:
            if best.is_file() and os.path.samefile(best, later):
                best.unlink()
            later.unlink()
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink()


def to_host(obj, key=None):
    """obj's tensors copied to the host, an lr as a float (a CUDA graph's is a tensor): a
    checkpoint resumes with either kind of step."""
    if torch.is_tensor(obj):
        return float(obj) if key == "lr" else obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v, k) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


def training_state(cfg, model, optimizer, scaler, loader, at) -> dict:
    """A checkpoint's keys besides the progress (under torchrun every rank calls it)."""
    if at.ddp:
        model_state, optimizer_state = at.dist.full_state(model, optimizer)
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    # the generators dropout draws from: the CPU's, this process's GPU's
    cuda = [torch.cuda.get_rng_state()] if torch.cuda.is_available() else []
    rng = {"torch": torch.get_rng_state(), "cuda": cuda}
    rngs = at.dist.gather(rng) if at.ddp else [rng]
    meta = loader.meta
    return {"config": cfg.to_dict(), "tokenizer": meta["tokenizer"], "model": model_state,
            "optimizer": optimizer_state, "loader": loader.state_dict(),
            "dataset": {k: meta[k] for k in ("source", "sha256", "tokens", "bytes")},
            "scaler": scaler.state_dict() if scaler.is_enabled() else None, "rng_ranks": rngs}


def check_resumable(ckpt: dict, path, cfg) -> None:
    """Resuming needs the whole training state, and the run's own model and tokenizer."""
    if missing := [k for k in FOR_RESUMING if k not in ckpt]:
        raise UserError(f"{path} cannot be resumed from: it lacks {', '.join(missing)}")
    before, now = (flat(c) for c in (ckpt["config"], cfg.to_dict()))
    for key, value in now.items():
        kept = key.startswith("model.") or key == "data.tokenizer"
        # model.vocab_size = 0: the tokenizer's, whatever it is
        if kept and before.get(key) != value and (key, value) != ("model.vocab_size", 0):
            raise UserError(f"{key}: {fmt(before.get(key))} in the run, {fmt(value)} now: "
                            f"--resume goes on with the run's own model and tokenizer (another "
                            f"--out_dir starts a new run)")


def check_same_text(ckpt: dict, path, cfg, meta: dict, say) -> None:
    """A resumed run's text must give its tokens; another one of those tokens is said."""
    if ckpt["tokenizer"] != meta["tokenizer"]:
        raise UserError(f"{path} was trained on a text of other tokens than "
                        f"{cfg.data.path} now gives: the text changed, and --resume needs "
                        f"the one it was trained on")
    if ckpt["dataset"].get("sha256") != meta["sha256"]:
        say(f"warning: the training text changed since {path} was saved; training goes on "
            f"with the new text")


def restore(ckpt: dict, path, model, optimizer, scaler, loader, at) -> Progress:
    """Load ckpt into the run -> its progress."""
    try:
        if at.ddp:
            at.dist.load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"])
        else:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        loader.load_state_dict(ckpt["loader"])
        # one per rank of the run that saved it
        rngs = ckpt["rng_ranks"]
        rng = rngs[at.rank] if len(rngs) == at.world else rngs[0]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"][0])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{path} does not fit this run: {first_line(e)}") from None
    # another number of processes: new dropout streams
    if len(rngs) != at.world and at.rank:
        torch.manual_seed(ckpt["config"]["train"]["seed"] + 1000 * ckpt["step"] + at.rank)
    return Progress(ckpt["step"], ckpt["tokens"], ckpt["best_val_loss"], ckpt["elapsed"])


def why_unwritten(error: Exception) -> str:
    """Why a file was not written: its OSError, or the one behind torch's RuntimeError. EFBIG:
    this process's file-size limit (Python ignores SIGXFSZ) or the file system's."""
    cause = error if isinstance(error, OSError) else error.__context__
    if getattr(cause, "errno", None) == errno.EFBIG:
        if os.name == "posix":
            import resource
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            if limit != resource.RLIM_INFINITY:
                return (f"it is larger than this process's file-size limit of {limit:,} "
                        f"bytes (ulimit -f; `ulimit -f unlimited` lifts it)")
        return ("it is larger than its file system allows (FAT32: 4 GiB): write it to "
                "another one")
    if isinstance(cause, OSError):
        return cause.strerror or str(cause)
    return f"{first_line(error, 80)}: is the disk full?"
