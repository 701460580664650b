"""The out dir's lock (<out_dir>/.lock): one run at a time writes into an out dir. The file holds the
holder's PID, for the message that turns a second run away; the lock itself is the operating system's,
so that it goes with its process however the process ends (a crash or kill -9 leaves no stale lock).

    POSIX     flock on the whole file
    Windows   msvcrt.locking on one byte (there is no fcntl)
"""
import errno
import os
from pathlib import Path

try:
    import fcntl
except ImportError:   # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:   # not Windows
    msvcrt = None

from common import RunError

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
