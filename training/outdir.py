"""A run's out dir: checked before anything is written, locked while the run writes into it, and left
as it was found when the run fails before its first checkpoint."""
import errno
import os
from pathlib import Path

try:
    import fcntl
except ImportError:   # not on Windows
    fcntl = None

from common import RunError
from training.checkpoint import latest_checkpoint, list_checkpoints, remove_partial_saves


class OutDirLock:
    """An OS file lock on <out_dir>/.lock, held for the whole run, so that two runs never write into
    one out dir. The operating system releases it when the process ends, however it ends: a crash
    or kill -9 leaves no stale lock behind. (Where fcntl is missing, e.g. Windows, there is no lock.)"""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / ".lock"
        self.fd = None

    def _busy(self) -> RunError:
        try:
            pid = self.path.read_text().strip() or "unknown"
        except OSError:
            pid = "unknown"
        return RunError(f"{self.path.parent} is in use by another run (PID {pid}); wait for it to end, "
                        f"or choose another --out_dir")

    @staticmethod
    def _lock(fd: int) -> bool:
        """Take the lock without waiting: False where another process holds it. A file system that
        cannot lock (e.g. NFS without its lock daemon: ENOLCK) is not a busy out dir: no lock there."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        return True

    def check_free(self) -> None:
        """Raise if another process holds the lock; creates nothing."""
        if fcntl is None or not self.path.is_file():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if not self._lock(fd):
                raise self._busy()
        finally:
            os.close(fd)   # closing releases the probe's lock

    def acquire(self) -> None:
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._lock(fd):
            os.close(fd)
            raise self._busy()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class OutDir:
    """Where a run writes: ckpt_<step>.pt, best.pt, config.toml, metrics.jsonl and the .lock."""

    def __init__(self, path):
        self.path = Path(path)
        self.lock = OutDirLock(self.path)
        self.resume_from = None   # the checkpoint a resumed run continues (set by the trainer from check())
        self.created = False      # this run made the directory
        self.opened = False       # this run holds the lock and has written into it

    def check(self, resume: bool, overwrite: bool) -> Path | None:
        """Check, without writing anything, that the out dir can take this run; return the checkpoint
        to resume from (when resuming)."""
        if resume and overwrite:
            raise RunError("--resume and --overwrite contradict each other: continue the run, or start it over")
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"the out dir {self.path} is a file, not a directory")
        self.lock.check_free()
        latest, best = latest_checkpoint(self.path), self.path / "best.pt"
        if resume:
            if latest is None and best.is_file():
                return best   # the step checkpoints are gone; best.pt holds a whole training state too
            if latest is None:
                raise RunError(f"--resume: no checkpoint (ckpt_*.pt or best.pt) in {self.path} to resume from; "
                               f"leave out --resume to start a new run")
            return latest
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

    def open(self, overwrite: bool) -> None:
        """Create the out dir and lock it (the run's first writes); with overwrite, then delete the
        previous run's checkpoints and metrics. The lock is held until close()."""
        self.created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock.acquire()
        except OSError as e:
            raise RunError(f"cannot write to the out dir {self.path}: {e.strerror or e}") from None
        self.opened = True
        remove_partial_saves(self.path)
        if overwrite:
            for _, p in list_checkpoints(self.path):
                p.unlink()
            for name in ("best.pt", "metrics.jsonl"):
                (self.path / name).unlink(missing_ok=True)

    def forget(self) -> None:
        """For a new run that fails before its first checkpoint: remove what open() and the run wrote
        (config.toml, metrics.jsonl, the lock, and the directory if this run made it). Releases the lock."""
        self.close()
        if not self.opened or self.resume_from is not None:
            return
        for name in ("config.toml", "metrics.jsonl", ".lock"):
            (self.path / name).unlink(missing_ok=True)
        if self.created and not any(self.path.iterdir()):
            self.path.rmdir()

    def close(self) -> None:
        self.lock.release()
