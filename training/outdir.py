"""A run's out dir: one run at a time, and nothing of an earlier run (or of yours) lost.

An out dir holds ckpt_<step>.pt, best.pt, config.toml, metrics.jsonl, curves.png and .lock.

Choices:
  one run     the operating system's lock on .lock (flock; msvcrt on Windows), which goes with its
              process however it ends; .lock holds the PID, to name the run that holds it
  never lost  a new run refuses an out dir holding a run's files (a run's, or the user's own of those
              names); --overwrite moves them to .replaced/ (through .replacing/, so that a kill
              midway leaves them in one place) until its own first checkpoint, and a run that ends
              before that (an error, or a kill: the next run sees it) puts them back
"""
import errno
import os
import shutil
import sys
from pathlib import Path

from common import UserError
from training.checkpoint import CKPT_RE, latest_checkpoint

try:
    import fcntl
    msvcrt = None
except ImportError:   # Windows
    import msvcrt
    fcntl = None

RUN_FILES = ("best.pt", "config.toml", "metrics.jsonl", "curves.png")   # and the ckpt_<step>.pt
ASIDE, MOVING = ".replaced", ".replacing"   # MOVING becomes ASIDE once every file is in it


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


def coming_back(path: Path) -> Path | None:
    """The folder whose files OutDir.check puts back into the out dir at path: a setting aside that a kill
    cut short, or what an --overwrite run that ended before its first checkpoint set aside."""
    if (path / MOVING).is_dir():
        return path / MOVING
    return path / ASIDE if (path / ASIDE).is_dir() and latest_checkpoint(path) is None else None


def run_config(path) -> Path:
    """The config.toml of the run in the out dir at path, as OutDir.check will leave it."""
    back = coming_back(Path(path))
    return back / "config.toml" if back and (back / "config.toml").is_file() else Path(path) / "config.toml"


class OutDir:
    """Where a run writes: check() (writes nothing), open() at its first write, committed() at its first
    checkpoint, abandon() when it ends without one, close() at its end."""

    def __init__(self, path):
        self.path, self.fd, self.created = Path(path), None, []
        self.new_run = self.opened = self.set_aside = self.overwrite = False

    def check(self, resume: bool, overwrite: bool, checkpoint=None) -> Path | None:
        """Whether this out dir can take the run; the checkpoint to resume (when resuming: `checkpoint`,
        else the latest)."""
        self.overwrite = overwrite
        if resume and overwrite:
            raise UserError("--resume and --overwrite contradict each other: continue the run, or start it over")
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"the out dir {self.path} is a file, not a directory")
        if (self.path / ".lock").is_file():   # held from here to the end of the run
            try:
                self.fd = os.open(self.path / ".lock", os.O_RDWR)
            except OSError as e:
                raise UserError(f"cannot write to the out dir {self.path} ({e.strerror}): choose another --out_dir") \
                    from None
            if not _lock(self.fd):
                pid = (self.path / ".lock").read_text(errors="replace").strip() or "unknown"
                self.close()
                raise UserError(f"{self.path} is in use by another run (PID {pid}); wait for it to end, or choose "
                               f"another --out_dir")
        if back := coming_back(self.path):   # give the earlier run back
            for p in self.run_files() if back.name == ASIDE else []:   # (beside it: the killed run's files)
                p.unlink()
            self.put_back(back, say=True)
        shutil.rmtree(self.path / ASIDE, ignore_errors=True)   # (a new run's checkpoint came before its removal)
        latest = latest_checkpoint(self.path) or (self.path / "best.pt" if (self.path / "best.pt").is_file() else None)
        if resume:
            if checkpoint is not None:
                return Path(checkpoint).resolve()
            if latest is None:
                raise UserError(f"--resume: no checkpoint (ckpt_*.pt or best.pt) in {self.path} to resume from; "
                               f"leave out --resume to start a new run")
            return latest
        theirs = [p.name for p in self.run_files()]
        if theirs and not overwrite and latest is None:
            raise UserError(f"{self.path} holds {', '.join(theirs)}, which a run writes: choose another --out_dir, "
                           f"or --overwrite to replace them (kept in {self.path / ASIDE} until this run's first "
                           f"checkpoint)")
        if theirs and not overwrite:
            raise UserError(f"{self.path} already holds {'checkpoints' if latest.name != 'best.pt' else 'best.pt'} of "
                           f"a run: continue it with --resume, start over with --overwrite, or choose another "
                           f"--out_dir")
        parent = next(p for p in [self.path, *self.path.parents] if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(f"cannot create the out dir {self.path}: {parent} is not a writable directory")
        self.new_run = True
        return None

    def run_files(self) -> list[Path]:
        return [p for p in sorted(self.path.glob("*")) if p.name in RUN_FILES or CKPT_RE.match(p.name)]

    def open(self) -> None:
        """Create and lock the out dir (the run's first write); a new run sets aside what it replaces."""
        lock = self.path / ".lock"
        try:
            self.created = [p for p in [self.path, *self.path.parents] if not p.exists()]   # deepest first
            self.path.mkdir(parents=True, exist_ok=True)
            if self.fd is None:
                try:
                    self.fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                    self.created.insert(0, lock)
                except FileExistsError:   # another run's, that started meanwhile, or one that ended
                    self.fd = os.open(lock, os.O_RDWR)
                if not _lock(self.fd):
                    raise UserError(f"{self.path} is in use by another run; choose another --out_dir")
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())
            for tmp in self.path.glob(".*.tmp"):   # a save a kill cut short; other hidden files are the user's
                if tmp.name[1:-4] in RUN_FILES or CKPT_RE.match(tmp.name[1:-4]):
                    tmp.unlink()
            if self.new_run and (replaced := self.run_files()):
                if not self.overwrite:   # a run that ended meanwhile: it is not this run's to replace
                    raise UserError(f"{self.path} now holds a run that ended while this one was starting: continue "
                                   f"it with --resume, start over with --overwrite, or choose another --out_dir")
                (self.path / MOVING).mkdir()
                self.set_aside = True
                for p in replaced:
                    os.replace(p, self.path / MOVING / p.name)
                os.replace(self.path / MOVING, self.path / ASIDE)
            self.opened = True
        except OSError as e:
            raise UserError(f"cannot write to the out dir {self.path} ({e.strerror}): choose another --out_dir") \
                from None

    def committed(self) -> None:
        """The run has a checkpoint of its own: what it replaced can go."""
        shutil.rmtree(self.path / ASIDE, ignore_errors=True)
        self.new_run = self.set_aside = False

    def abandon(self) -> None:
        """A run that ends without a checkpoint of its own: a new run's files go, what it set aside comes
        back, and so does the out dir as it was (a resumed run's files stay: they are the run it continues)."""
        self.close()
        if self.new_run and self.opened:   # (what it wrote: the old run's files were all set aside)
            for p in self.run_files():
                p.unlink()
        if self.set_aside:
            self.put_back(self.path / MOVING)
            self.put_back(self.path / ASIDE)
        for p in self.created if self.new_run else []:   # .lock, then the directories this run made
            p.unlink() if p.is_file() else p.rmdir() if p.is_dir() and not any(p.iterdir()) else None

    def put_back(self, aside: Path, say: bool = False) -> None:
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
