"""Checkpoints and the out dir they live in: writing them, reading them, and one run at a time.

An out dir holds ckpt_<step>.pt (the newest train.keep_checkpoints), best.pt (the lowest val loss: a
hard link to one of them, or a copy), config.toml, metrics.jsonl, curves.png and .lock.

Choices:
  whole files   a checkpoint is written to a temporary file and renamed (common.atomic_write): a reader,
                or a run killed mid-save, finds the old checkpoint or the new one, never part of one
  safe reading  torch.load(weights_only=True): tensors and plain data only, so a file cannot run code;
                the weights are loaded strictly into the model their config describes
  one run       the operating system's lock on .lock (flock; msvcrt on Windows), which goes with its
                process however it ends; .lock holds the PID, to name the run that holds it
  never lost    a new run refuses an out dir holding a run's files (a run's, or the user's own of those
                names); --overwrite moves them to .replaced/ until its own first checkpoint, and a run
                that ends before that (an error, or a kill: the next run sees it) puts them back
"""
import dataclasses
import errno
import os
import pickle
import re
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from common import CheckpointError, RunError, TokenizerError, atomic_write, first_line, os_error, type_problem
from data.tokenizers import load_tokenizer
from model.config import ModelConfig
from model.gpt import GPT

try:
    import fcntl
    msvcrt = None
except ImportError:   # Windows
    import msvcrt
    fcntl = None

FORMAT, VERSION = "gpt-checkpoint", 2
CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")
RUN_FILES = ("best.pt", "config.toml", "metrics.jsonl", "curves.png")   # and the ckpt_<step>.pt
ASIDE = ".replaced"
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
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
        os.replace(tmp, best)
    except OSError:
        with open(path, "rb") as src:
            atomic_write(best, lambda f: shutil.copyfileobj(src, f))


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
    for step, later in list_checkpoints(out_dir):   # a run resumed from an earlier checkpoint replaces these
        if step > ckpt["step"]:
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


# ---------------------------------------------------------------- the out dir

def _lock(fd: int) -> bool:
    """Take the out dir's lock without waiting: False where another process holds it. A file system
    that cannot lock at all (NFS without its lock daemon: ENOLCK) runs unguarded. On Windows the lock
    is one byte far past the PID (locks there are mandatory: the PID must stay readable)."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 1 << 16, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError as e:
        return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, getattr(errno, "EDEADLOCK", -1))
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return True


class OutDir:
    """Where a run writes: check() (writes nothing), open() at its first write, committed() at its first
    checkpoint, abandon() when it ends without one, close() at its end."""

    def __init__(self, path):
        self.path, self.fd, self.created, self.new_run, self.opened = Path(path), None, [], False, False

    def check(self, resume: bool, overwrite: bool, checkpoint=None) -> Path | None:
        """Whether this out dir can take the run; the checkpoint to resume (when resuming: `checkpoint`,
        else the latest)."""
        if resume and overwrite:
            raise RunError("--resume and --overwrite contradict each other: continue the run, or start it over")
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"the out dir {self.path} is a file, not a directory")
        if (self.path / ".lock").is_file():   # held from here to the end of the run
            try:
                self.fd = os.open(self.path / ".lock", os.O_RDWR)
            except OSError as e:
                raise RunError(f"cannot write to the out dir {self.path} ({e.strerror}): choose another --out_dir") \
                    from None
            if not _lock(self.fd):
                pid = (self.path / ".lock").read_text(errors="replace").strip() or "unknown"
                self.close()
                raise RunError(f"{self.path} is in use by another run (PID {pid}); wait for it to end, or choose "
                               f"another --out_dir")
        aside = self.path / ASIDE
        if aside.is_dir():   # a run with --overwrite ended before its first checkpoint: give the run back
            if latest_checkpoint(self.path) is None:
                self.put_back(say=True)
            shutil.rmtree(aside, ignore_errors=True)
        latest = latest_checkpoint(self.path) or (self.path / "best.pt" if (self.path / "best.pt").is_file() else None)
        if resume:
            if checkpoint is not None:
                return Path(checkpoint).resolve()
            if latest is None:
                raise RunError(f"--resume: no checkpoint (ckpt_*.pt or best.pt) in {self.path} to resume from; "
                               f"leave out --resume to start a new run")
            return latest
        theirs = [p.name for p in self.run_files()]
        if theirs and not overwrite and latest is None:
            raise RunError(f"{self.path} holds {', '.join(theirs)}, which a run writes: choose another --out_dir, "
                           f"or --overwrite to replace them (kept in {self.path / ASIDE} until this run's first "
                           f"checkpoint)")
        if theirs and not overwrite:
            raise RunError(f"{self.path} already holds {'checkpoints' if latest.name != 'best.pt' else 'best.pt'} of "
                           f"a run: continue it with --resume, start over with --overwrite, or choose another "
                           f"--out_dir")
        parent = next(p for p in [self.path, *self.path.parents] if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise RunError(f"cannot create the out dir {self.path}: {parent} is not a writable directory")
        self.new_run = True
        return None

    def run_files(self) -> list[Path]:
        return [p for p in sorted(self.path.glob("*")) if p.name in RUN_FILES or CKPT_RE.match(p.name)]

    def open(self) -> None:
        """Create and lock the out dir (the run's first write); a new run sets aside what it replaces."""
        try:
            self.created = [p for p in [self.path, *self.path.parents] if not p.exists()]   # deepest first
            self.path.mkdir(parents=True, exist_ok=True)
            self.opened = True
            if self.fd is None:
                self.created.insert(0, self.path / ".lock")
                self.fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
                if not _lock(self.fd):
                    raise RunError(f"{self.path} is in use by another run; choose another --out_dir")
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())
            for tmp in self.path.glob(".*.tmp"):   # a save a kill cut short; other hidden files are the user's
                if tmp.name[1:-4] in RUN_FILES or CKPT_RE.match(tmp.name[1:-4]):
                    tmp.unlink()
            if self.new_run and (replaced := self.run_files()):
                (self.path / ASIDE).mkdir()
                for p in replaced:
                    os.replace(p, self.path / ASIDE / p.name)
        except OSError as e:
            raise RunError(f"cannot write to the out dir {self.path} ({e.strerror}): choose another --out_dir") \
                from None

    def committed(self) -> None:
        """The run has a checkpoint of its own: what it replaced can go."""
        shutil.rmtree(self.path / ASIDE, ignore_errors=True)
        self.new_run = False

    def abandon(self) -> None:
        """A run that ends without a checkpoint of its own: a new run's files go, what it set aside comes
        back, and so does the out dir as it was (a resumed run's files stay: they are the run it continues)."""
        self.close()
        if self.new_run and self.opened:
            for p in self.run_files():
                p.unlink()
            self.put_back()
            for p in self.created:   # .lock, then the directories this run made
                p.unlink() if p.is_file() else p.rmdir() if not any(p.iterdir()) else None

    def put_back(self, say: bool = False) -> None:
        aside = self.path / ASIDE
        if aside.is_dir():
            for p in aside.iterdir():
                os.replace(p, self.path / p.name)
            aside.rmdir()
            if say:   # (a run that ended without a checkpoint was killed: say what became of what it replaced)
                print(f"notice: moved back into {self.path} the files that a run with --overwrite, stopped before "
                      f"its first checkpoint, had set aside", file=sys.stderr)

    def close(self) -> None:
        if self.fd is not None:
            if msvcrt is not None:   # Windows frees a closed file's locks only after a while
                os.lseek(self.fd, 1 << 16, os.SEEK_SET)
                try:
                    msvcrt.locking(self.fd, msvcrt.LK_UNLCK, 1)
                except OSError:
                    pass
            os.close(self.fd)
            self.fd = None
