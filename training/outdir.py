"""A run's out dir and what the run records there besides checkpoints.

    ckpt_<step>.pt, best.pt   checkpoints (training/checkpoint.py)
    config.toml               the run's resolved config
    metrics.jsonl             one JSON record per log line, evaluation and sample (and wandb, when on)
    curves.png                the loss curves so far, redrawn at each evaluation (log.curves)
    .lock                     held while a run writes into the directory (OutDirLock)

Nothing is lost: the out dir is checked before anything is written; a run that replaces files
already there (an earlier run's with --overwrite, or a config.toml or metrics.jsonl of any origin)
moves them into .replaced/ and deletes them only once its own first checkpoint is written; a run
that fails before that removes what it created and moves them back. A run killed outright leaves
.replaced/ behind, and the next run into the out dir moves it back first.

(Over 300 lines on purpose: all that a run does to its out dir, the lock included, stays in one place.)
"""
import errno
import json
import os
import shutil
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:   # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:   # not Windows
    msvcrt = None

from common import ConfigError, RunError, atomic_write, first_line
from training.checkpoint import CKPT_RE, latest_checkpoint, repair_best
from training.config import Config, load_toml

ASIDE = ".replaced"   # an earlier run's files while a new run has no checkpoint yet
RUN_FILES = ("best.pt", "config.toml", "metrics.jsonl", "curves.png")   # and the checkpoints


# ---------------------------------------------------------------- the lock: one run at a time
# The file holds the holder's PID, for the message that turns a second run away; the lock itself is the
# operating system's, so that it goes with its process however the process ends (a crash or kill -9
# leaves no stale lock). POSIX: flock on the whole file. Windows (no fcntl): msvcrt.locking on one byte.
# Windows' locks are byte ranges, and mandatory: no other process can read a locked byte. The lock is
# on one byte far past the PID that .lock holds (a lock may lie past the end of a file), so that a
# refused run can still read whose lock it is.
WINDOWS_LOCKED_BYTE = 1 << 16


def _lock(fd: int) -> bool:
    """Take the lock without waiting: False where another process holds it. A file system that cannot
    lock (e.g. NFS without its lock daemon: ENOLCK), or a system without file locks, is not a busy out
    dir: no lock there."""
    if fcntl is not None:   # released when the file is closed
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    elif msvcrt is not None:   # msvcrt locks from the file's current position
        os.lseek(fd, WINDOWS_LOCKED_BYTE, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as e:
            return e.errno not in (errno.EACCES, errno.EDEADLOCK)
        finally:
            os.lseek(fd, 0, os.SEEK_SET)
    return True


def _unlock(fd: int) -> None:
    """Windows: release the lock now (Windows releases the locks of a closed file only after a while,
    and a probe's lock must not turn away the run that follows it). flock's goes with the file's closing."""
    if fcntl is None and msvcrt is not None:
        os.lseek(fd, WINDOWS_LOCKED_BYTE, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        except OSError:   # not locked (the file system could not lock)
            pass


class OutDirLock:
    """The lock on <out_dir>/.lock, held for the whole run."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / ".lock"
        self.fd = None

    def _busy(self) -> RunError:
        try:
            pid = self.path.read_text(encoding="utf-8").strip() or "unknown"
        except (OSError, UnicodeDecodeError):
            pid = "unknown"
        return RunError(f"{self.path.parent} is in use by another run (PID {pid}); wait for it to end, "
                        f"or choose another --out_dir")

    def check_free(self) -> None:
        """Raise if another process holds the lock; creates nothing."""
        if not self.path.is_file():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if not _lock(fd):
                raise self._busy()
            _unlock(fd)
        finally:
            os.close(fd)

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _lock(fd):
            os.close(fd)
            raise self._busy()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            _unlock(self.fd)
            os.close(self.fd)
            self.fd = None


def is_run_file(name: str) -> bool:
    return bool(CKPT_RE.match(name)) or name in RUN_FILES


def run_files(directory: Path) -> list[Path]:
    names = os.listdir(directory) if Path(directory).is_dir() else []
    return [Path(directory) / n for n in sorted(names) if is_run_file(n)]


class OutDir:
    """Where a run writes; check(), then open() under the lock, then committed() at the first
    checkpoint, or forget() when the run fails before it."""

    def __init__(self, path):
        self.path = Path(path)
        self.lock = OutDirLock(self.path)
        self.resume_from = None   # the checkpoint a resumed run continues (set by the trainer from check())
        self.resumes_best = False  # it is the run's best: best.pt must be it (a kill may have cut its relinking)
        self.stored = None        # a resumed run's config.toml as it was, to say what the resumed run changes
        self.created = []         # what this run created (the directory, .lock, config.toml, ...), to undo
        self.opened = False       # this run holds the lock and may have written

    def check(self, resume: bool, overwrite: bool) -> Path | None:
        """Check that the out dir can take this run and return the checkpoint to resume from (when
        resuming). Writes nothing, but for moving back an earlier run's files that a killed run left
        aside (once no live run holds the lock)."""
        if resume and overwrite:
            raise RunError("--resume and --overwrite contradict each other: continue the run, or start it over")
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"the out dir {self.path} is a file, not a directory")
        self.lock.check_free()
        self.restore_aside("a run that was stopped before its first checkpoint")
        latest, best = latest_checkpoint(self.path), self.path / "best.pt"
        if resume:
            self.stored = self.stored_config()
            if latest is None and not best.is_file():
                raise RunError(f"--resume: no checkpoint (ckpt_*.pt or best.pt) in {self.path} to resume from; "
                               f"leave out --resume to start a new run")
            return latest or best   # without step checkpoints, best.pt holds a whole training state too
        if (latest is not None or best.exists()) and not overwrite:
            which = "checkpoints" if latest is not None else "best.pt"
            raise RunError(f"{self.path} already holds {which} of a run: continue it with --resume, "
                           f"start over with --overwrite, or choose another --out_dir")
        parent = self.path
        while not parent.exists():   # the nearest existing ancestor must be a writable directory
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise RunError(f"cannot create the out dir {self.path}: {parent} is not a writable directory")
        return None

    def stored_config(self) -> dict | None:
        """The config.toml of the run this out dir holds (of the run set aside, when a run that replaced it
        was stopped before its first checkpoint), as a dict; None where there is none."""
        aside = self.path / ASIDE / "config.toml"
        path = aside if aside.is_file() and latest_checkpoint(self.path) is None else self.path / "config.toml"
        return load_toml(path) if path.is_file() else None

    def open(self) -> None:
        """Create the out dir and lock it (the run's first writes). A new run moves the files a run
        would write that are already there into .replaced/. The lock is held until close()."""
        try:
            missing = [p for p in [*reversed(self.path.parents), self.path] if not p.exists()]
            self.path.mkdir(parents=True, exist_ok=True)
            self.created += missing[::-1]   # (undone deepest first)
            if not self.lock.path.exists():
                self.created.insert(0, self.lock.path)
            self.lock.acquire()
            self.opened = True
            for tmp in self.path.glob(".*.tmp"):   # a save that a kill interrupted; other hidden files are the user's
                if is_run_file(tmp.name.removeprefix(".").removesuffix(".tmp")):
                    tmp.unlink(missing_ok=True)
            replaced = run_files(self.path) if self.resume_from is None else []
            if replaced:
                (self.path / ASIDE).mkdir()
                for p in replaced:
                    os.replace(p, self.path / ASIDE / p.name)
            if self.resumes_best:
                repair_best(self.resume_from)
        except OSError as e:
            raise RunError(f"cannot write to the out dir {self.path}: {e.strerror or e}") from None

    def write(self, name: str, data: str | bytes) -> None:
        """A file of this run, written whole."""
        path = self.path / name
        if not path.exists():
            self.created.insert(0, path)
        try:
            atomic_write(path, data)
        except OSError as e:
            raise RunError(f"could not write {path}: {e.strerror or e}") from None

    def committed(self) -> None:
        """The run has a checkpoint of its own: the files it replaced can go."""
        shutil.rmtree(self.path / ASIDE, ignore_errors=True)
        self.created = []

    def forget(self) -> None:
        """A run that fails before its first checkpoint: remove what it created, move back what it
        replaced, release the lock. A resumed run's files stay: they are the run it continues."""
        self.close()
        if not self.opened or self.resume_from is not None:
            return
        for path in self.created:
            try:
                path.rmdir() if path.is_dir() else path.unlink(missing_ok=True)
            except OSError:   # a directory that holds something else now stays
                pass
        self.restore_aside()
        self.created = []

    def restore_aside(self, left_by: str = "") -> None:
        """Move the files in .replaced/ back into the out dir, over what a run without a checkpoint
        wrote there."""
        aside = self.path / ASIDE
        if not aside.is_dir() or latest_checkpoint(self.path) is not None:
            shutil.rmtree(aside, ignore_errors=True)   # (after a checkpoint of the run that replaced them)
            return
        for p in aside.iterdir():
            os.replace(p, self.path / p.name)
        aside.rmdir()
        if left_by:
            print(f"notice: moved back into {self.path} the files that {left_by} had set aside", file=sys.stderr)

    def close(self) -> None:
        self.lock.release()


# ---------------------------------------------------------------- metrics.jsonl and wandb

def read_records(path: Path, warn=True) -> list[dict]:
    """The records of a metrics.jsonl. It is a log: a damaged line (cut by a kill, a bad byte, a value of
    the wrong kind) is skipped, with one warning on stderr naming the file and how many."""
    records, damaged = [], 0
    text = Path(path).read_bytes().decode("utf-8", errors="replace") if Path(path).exists() else ""
    for line in text.splitlines():
        try:
            record = json.loads(line)
            ok = isinstance(record, dict) and type(record.get("step")) is int and isinstance(record.get("kind"), str)
        except ValueError:
            ok = False
        if ok:
            records.append(record)
        elif line.strip():
            damaged += 1
    if damaged and warn:
        print(f"warning: {path}: skipped {damaged} damaged line(s)", file=sys.stderr)
    return records


class Metrics:
    """metrics.jsonl and wandb. resume_step: keep the records up to that step, drop the rest (what a
    run killed after its last checkpoint logged is logged again when it resumes)."""

    def __init__(self, cfg: Config, out: OutDir, resume_step: int | None):
        if cfg.log.wandb:   # before metrics.jsonl is touched
            try:
                import wandb
            except ImportError:
                raise ConfigError("log.wandb = true but wandb is not installed (pip install wandb)") from None
        self.path = out.path / "metrics.jsonl"
        kept = [r for r in read_records(self.path) if r["step"] <= resume_step] if resume_step is not None else []
        out.write(self.path.name, "".join(json.dumps(r) + "\n" for r in kept))
        self.wandb = None
        if cfg.log.wandb:
            try:
                self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or out.path.name,
                                        group=cfg.log.wandb_group or None, config=cfg.to_dict(),
                                        dir=str(out.path), resume="allow")
            except Exception as e:   # no login, no network, a bad project: wandb's own errors
                raise ConfigError(f"log.wandb = true but wandb did not start ({type(e).__name__}: {first_line(e, 100)}); "
                                  f"run `wandb login`, set WANDB_MODE=offline, or leave log.wandb off") from None
        self.file = open(self.path, "a", encoding="utf-8")   # once wandb runs: a failure above leaves nothing open

    def log(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            raise RunError(f"could not write {self.path}: {e.strerror or e}") from None
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind")}, step=record["step"])

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:   # what a full disk kept from the last write is lost with the run's failure, said once
            pass
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class NoMetrics:
    """What ranks other than 0 record: nothing."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
