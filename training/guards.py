"""What keeps a run from being lost or corrupted: the out dir's checks, stop signals, and the
response to a non-finite loss or gradient."""
import errno
import os
import signal
import sys
import threading
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:   # not on Windows
    fcntl = None

from training.checkpoint import latest_checkpoint, list_checkpoints, remove_partial_saves
from training.errors import RunError

MAX_SKIPS_IN_A_ROW = 10   # on_nonfinite = "skip" still stops a run that has plainly diverged


def check_out_dir(out_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """Check, without writing anything, that out_dir can take this run; return the checkpoint to
    resume from (when resuming)."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other: continue the run, or start it over")
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"the out dir {out_dir} is a file, not a directory")
    OutDirLock(out_dir).check_free()
    latest = latest_checkpoint(out_dir)
    best = out_dir / "best.pt"
    if resume:
        if latest is None and best.is_file():
            return best   # the step checkpoints are gone; best.pt holds a whole training state too
        if latest is None:
            raise RunError(f"--resume: no checkpoint (ckpt_*.pt or best.pt) in {out_dir} to resume from; "
                           f"leave out --resume to start a new run")
        return latest
    if (latest is not None or best.exists()) and not overwrite:
        which = "checkpoints" if latest is not None else "best.pt"
        raise RunError(f"{out_dir} already holds {which} of a run: continue it with --resume, "
                       f"start over with --overwrite, or choose another --out_dir")
    parent = out_dir
    while not parent.exists():   # the nearest existing ancestor must be a writable directory
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise RunError(f"cannot create the out dir {out_dir}: {parent} is not a writable directory")
    return None


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


def make_out_dir(out_dir: Path, overwrite: bool) -> OutDirLock:
    """Create out_dir and lock it (the run's first writes); with overwrite, then delete the previous
    run's checkpoints. Returns the lock, which the run holds until it ends."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = OutDirLock(out_dir)
        lock.acquire()
    except OSError as e:
        raise RunError(f"cannot write to the out dir {out_dir}: {e.strerror or e}") from None
    remove_partial_saves(out_dir)
    if overwrite:
        for _, p in list_checkpoints(out_dir):
            p.unlink()
        for name in ("best.pt", "metrics.jsonl"):
            (out_dir / name).unlink(missing_ok=True)
    return lock


def say_now(text: str) -> None:
    """Write to stderr from a signal handler: print() could land inside a print() that the signal
    interrupted, and Python's buffered streams refuse such a reentrant call with an exception."""
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError):   # no file descriptor (e.g. captured by pytest)
        pass


class StopSignal:
    """SIGINT/SIGTERM: the first asks the loop to stop after the current step (and save);
    a second one exits at once (checkpoints are written atomically, so nothing is corrupted:
    a save cut short leaves only a temporary file, removed by the next run)."""

    def __init__(self):
        self.requested = None   # the name of the signal received, if any
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():   # Python allows handlers only there
            self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested is not None:
            say_now(f"\n{name} again: exiting now\n")
            os._exit(128 + signum)
        self.requested = name
        say_now(f"\n{name}: finishing this step and saving a checkpoint (again to exit at once)\n")

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    @property
    def exit_code(self) -> int:
        return 128 + signal.Signals[self.requested] if self.requested else 0


class NonFiniteGuard:
    """What a NaN or inf loss or gradient norm does (train.on_nonfinite):

      stop  raise RunError naming the first bad step; no checkpoint is written after it, so the
            last checkpoint is the last good state.
      skip  drop that step's update (its batch and LR-schedule slot are used up), count it, go on;
            MAX_SKIPS_IN_A_ROW bad steps in a row still stop the run.

    Reading a CUDA tensor waits for the GPU, so in stop mode on an accelerator the check is a
    device-side record of the first bad step (`deferred`), read only where the loop syncs anyway
    (log, eval, checkpoint and the last step); the updates of the few steps in between are
    discarded with the run. The step counter lives on the device too, so a CUDA graph can hold
    the check. Skip mode has to decide before the optimizer step, so it reads the flag every step.
    With fp16 loss scaling an inf gradient is routine (the scaler skips it and lowers the scale):
    check_grad=False leaves gradients to the scaler.
    """

    def __init__(self, mode: str, device: torch.device, check_grad: bool = True):
        self.mode, self.check_grad = mode, check_grad
        self.deferred = mode == "stop" and device.type != "cpu"
        self.steps = torch.zeros((), dtype=torch.long, device=device)       # steps checked: the last one's number
        self.first_bad = torch.zeros((), dtype=torch.long, device=device)   # 0: none yet
        self.bad_loss = torch.zeros((), dtype=torch.bool, device=device)    # was the first bad one the loss?
        self.skipped, self.in_a_row, self.last = 0, 0, None   # last: what the last skipped step had wrong
        self.saved_step = None   # the step of the newest checkpoint, for the message (None: none yet)

    def ok(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Called before each optimizer step: False means skip the update."""
        self.steps.add_(1)
        loss_bad = ~torch.isfinite(loss)
        bad = loss_bad | ~torch.isfinite(grad_norm) if self.check_grad else loss_bad
        if self.deferred:
            first = (self.first_bad == 0) & bad
            self.bad_loss.copy_(torch.where(first, loss_bad, self.bad_loss))
            self.first_bad.copy_(torch.where(first, self.steps, self.first_bad))
            return True
        if not bad.item():
            self.in_a_row = 0
            return True
        step = int(self.steps)
        what = self.last = "loss" if loss_bad.item() else "gradient"
        if self.mode == "stop":
            self.fail(step, what)
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise RunError(f"non-finite {what} at {self.in_a_row} steps in a row (up to step {step}); stopped, "
                           f"{self.kept()} (try a lower --train.lr)")
        return False

    def check(self) -> None:
        """Raise if a deferred check recorded a bad step (a no-op where every step is checked)."""
        if self.deferred and (step := int(self.first_bad)):
            self.fail(step, "loss" if bool(self.bad_loss) else "gradient")

    def start_at(self, step: int) -> None:
        """Continue counting after `step` (a resumed run)."""
        self.steps.fill_(step)

    def state(self) -> tuple:
        return (self.steps.clone(), self.first_bad.clone(), self.bad_loss.clone(), self.skipped, self.in_a_row)

    def load_state(self, state: tuple) -> None:
        """In place: a CUDA graph holds these tensors' addresses."""
        steps, first_bad, bad_loss, self.skipped, self.in_a_row = state
        self.steps.copy_(steps)
        self.first_bad.copy_(first_bad)
        self.bad_loss.copy_(bad_loss)

    def kept(self) -> str:
        if self.saved_step is None:
            return "no checkpoint had been written yet"
        return f"the last good checkpoint (step {self.saved_step}) is kept"

    def fail(self, step: int, what: str):
        raise RunError(f"non-finite {what} at step {step}; stopped, {self.kept()} (try a lower --train.lr, "
                       f"or --train.on_nonfinite=skip to skip such steps)")
