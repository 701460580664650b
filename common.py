"""What every command keeps to; imports neither torch nor the rest of the project.

  one line   a mistake a user can make is a UserError; run_cli turns it, an OSError, running out of
             memory and Ctrl-C into one line on stderr and an exit code, never a traceback
  settings   a config field is setting(default, "what it does", bounds): --help prints the text, and
             check_fields() holds every field to its bounds
  files      a file is written whole or not at all (atomic_write)
  progress   a long job says how far it is, on stderr (Progress)

Exit codes: 2 for a mistake (or the machine's fault: a full disk), 3 for out of memory, 130 for Ctrl-C
(a run stopped by a signal: 128 + its number).
"""
import argparse
import dataclasses
import math
import operator
import os
import sys
import time
from pathlib import Path


class UserError(Exception):
    """Something the user can fix (or the machine's fault), said in one line: `error: ...`, exit 2."""


def first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (torch's run over many lines)."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def silence_stdout() -> None:
    """Whatever is still to be printed goes nowhere: a stdout whose reader is gone (`| head`, a closed
    terminal) stops the printing, not the job, and Python's flush at exit does not fail either."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def run_cli(main, argv: list[str]) -> int:
    """main(argv)'s exit code; what a user can cause is one line on stderr instead of a traceback."""
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")   # a character the terminal cannot show prints as '?'
    try:
        return main(argv)
    except UserError as e:
        code, message = 2, f"error: {e}"
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    except BrokenPipeError:   # `python sample.py ... | head`
        silence_stdout()
        return 0
    except OSError as e:   # the machine's: a full disk, a read-only folder, a file that went away
        code, message = 2, f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    except (MemoryError, RuntimeError) as e:   # (torch's OutOfMemoryError is a RuntimeError)
        if not (isinstance(e, MemoryError) or "out of memory" in str(e) or "can't allocate memory" in str(e)):
            raise
        code, message = 3, (f"error: out of memory ({first_line(e, 100)}): try a smaller batch, block size or "
                            f"model (checkpoints already written are kept)")
    print(message, file=sys.stderr)
    return code


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose errors are one line like every other refusal: 'error: ... (see --help)'."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def setting(default, help: str, **bounds):
    """A config dataclass field with what it does (for --help) and the bounds check() holds it to."""
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def check(key: str, value, *, above=None, at_least=None, below=None, at_most=None, one_of=None) -> None:
    """A UserError naming key unless value is one of `one_of`, or a finite number within the bounds
    given: check("train.beta1", 1.5, at_least=0, below=1) says 'train.beta1 must be >= 0 and < 1, got 1.5'."""
    if one_of is not None and value not in one_of:
        raise UserError(f"{key}={value!r} is not one of {', '.join(map(str, one_of))}")
    bounds = [(op, b) for op, b in zip(OPS, (above, at_least, below, at_most)) if b is not None]
    if bounds and not (math.isfinite(value) and all(OPS[op](value, b) for op, b in bounds)):
        raise UserError(f"{key} must be {' and '.join(f'{op} {b}' for op, b in bounds)}, got {value}")


def check_fields(config, section: str) -> None:
    """check() every field of a config dataclass against the bounds its setting() gave."""
    for f in dataclasses.fields(config):
        if bounds := {k: v for k, v in f.metadata.items() if k != "help"}:
            check(f"{section}.{f.name}", getattr(config, f.name), **bounds)


def atomic_write(path, data) -> None:
    """Write data (str, bytes, or a function that writes to a binary file) to .<name>.tmp beside path,
    fsync it and rename it over path: a reader, or a process killed meanwhile, finds the old file or
    the new one, never part of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write = data if callable(data) else lambda f: f.write(data.encode() if isinstance(data, str) else data)
    try:
        tmp.unlink(missing_ok=True)   # a leftover could be a hard link to a checkpoint that must not change
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):   # said of the file the user knows, not of its temporary twin
            e.filename = str(path)
        raise


def duration(seconds: float) -> str:
    """3725 -> '1:02:05', 65 -> '1:05'."""
    h, rest = divmod(max(0, int(round(seconds))), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """How far a long job is, on stderr: 'label: done / total unit, rate unit/s, ETA'. On a terminal the
    line is redrawn at most 5 times a second; into a log a line is written every 10 s. quiet: nothing."""

    def __init__(self, label: str, total: float, unit: str, amount=lambda n: f"{n:,.0f}", quiet: bool = False):
        self.label, self.total, self.unit, self.amount, self.quiet = label, total, unit, amount, quiet
        self.done, self.drawn, self.tty = 0, False, sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def advance(self, n: float) -> None:
        self.done += n
        now = time.perf_counter()
        if self.quiet or now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last, self.drawn = now, True
        rate = self.done / max(now - self.start, 1e-9)
        line = (f"{self.label}: {self.amount(self.done)} / {self.amount(self.total)} {self.unit}, "
                f"{self.amount(rate)} {self.unit}/s, ETA {duration((self.total - self.done) / max(rate, 1e-9))}")
        print(f"\r{line}\033[K" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.drawn and self.tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- legacy: goes once no file uses it

import errno  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
from contextlib import contextmanager  # noqa: E402

WINDOWS = os.name == 'nt'


class Interrupted(KeyboardInterrupt):
    """A signal stopped a job after it cleaned up; exit_code is 128 + the signal's number."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def is_out_of_memory(error: BaseException) -> bool:
    """Any allocation failure: torch's (CUDA or CPU allocator), numpy's, Python's."""
    text = str(error).lower()
    return isinstance(error, MemoryError) or isinstance(error, RuntimeError) and (
        type(error).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or "out of memory" in text)


# what the user can do about the errors the system reports for a path
OS_ADVICE = {errno.ENOSPC: "the disk is full: free some space", errno.EROFS: "choose a writable place",
             errno.EACCES: "check its permissions, or choose another place", errno.EEXIST: "remove it, or choose "
             "another name", errno.ENOTDIR: "a file stands where a directory is needed", errno.EISDIR: "it is a "
             "directory, a file is needed", errno.ENAMETOOLONG: "choose a shorter name"}


def os_error(e: OSError) -> str:
    """An OSError in words: what failed, where, and what to do (not errno's bare text)."""
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}" + (f": {OS_ADVICE[e.errno]}" if e.errno in OS_ADVICE else "")


class Printer:
    """print(), flushed at once, which a lost stdout (a pipe's reader gone, a closed terminal) never
    stops: .lost is set and later lines go nowhere. Printer(False) prints nothing (quiet runs, ranks
    other than 0)."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.lost = enabled, False

    def __call__(self, *args, **kwargs) -> None:
        if not self.enabled or self.lost:
            return
        try:
            print(*args, **kwargs, flush=True)
        except (OSError, ValueError, AttributeError):   # a broken pipe, EIO, a closed (or no) stdout
            self.lost = True
            try:   # what is still buffered, and Python's flush at exit, go nowhere instead of failing
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass


# ---------------------------------------------------------------- signals

def stop_signals() -> list[int]:
    """The signals that ask a job to stop, of those this system has: SIGINT (Ctrl-C), SIGTERM, SIGHUP (a
    closed terminal; not on Windows) and SIGBREAK (Windows: Ctrl-Break, a closed console, a sweep's stop)."""
    return [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK") if hasattr(signal, name)]


@contextmanager
def on_stop_signals(handler):
    """While inside, the stop signals call handler(signum). A signal the shell ignores (nohup) stays
    ignored, one the system refuses a handler for is left as it is, and the previous handlers come back
    afterwards. (Python sets handlers in the main thread only: elsewhere nothing changes.)"""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in stop_signals():
            try:
                if signal.getsignal(s) is not signal.SIG_IGN:
                    previous[s] = signal.signal(s, lambda signum, frame: handler(signum))
            except (OSError, ValueError):
                pass
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


class StopRequest:
    """A handler for on_stop_signals where a job stops at a safe point: the first signal is recorded
    (.signal, its name) and said; a second one ends the process at once. (os.write: a print() here could
    land inside the print() the signal interrupted.)"""

    def __init__(self, doing: str):
        self.doing, self.signal = doing, None

    def __call__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        again = self.signal is not None
        self.signal = self.signal or name
        try:
            os.write(2, f"\n{name}{' again: exiting now' if again else f': {self.doing} (again to exit at once)'}\n"
                     .encode())
        except OSError:
            pass
        if again:
            os._exit(128 + signum)


def unwind_on_stop(message=None):
    """A handler for on_stop_signals where a job cleans up as it unwinds (its finally blocks): the first
    signal raises Interrupted (message(signum) its text, if given); later ones wait for the cleanup."""
    stopped = []

    def handler(signum: int) -> None:
        if not stopped:
            stopped.append(signum)
            raise Interrupted(signum, message(signum) if message else "")
    return handler


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
               bool: "true or false", type(None): "empty"}


def type_problem(values: dict, schema: dict, where: str = "") -> str | None:
    """What is wrong with a dict read from a file against schema ({key: type or tuple of types}), as
    'tokens is not an integer', or None. A float may hold an int; an int is never a bool."""
    for key, kind in schema.items():
        if key not in values:
            return f"{where}{key} is missing"
        value, kinds = values[key], kind if isinstance(kind, tuple) else (kind,)
        if not (any(isinstance(value, k) and (k is bool or not isinstance(value, bool)) for k in kinds)
                or float in kinds and isinstance(value, int) and not isinstance(value, bool)):
            return f"{where}{key} is not {' or '.join(_TYPE_NAMES[k] for k in kinds)}"
    return None
