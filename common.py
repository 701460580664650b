"""What every command of this repository keeps to, imported by all of them and importing neither
torch nor any other module of the project:

  errors   a mistake a user can make (or a fault of the machine) is a UserError; run_cli turns it
           into one line on stderr and a non-zero exit, never a traceback
  files    a file is written whole or not at all (atomic_write)
  signals  SIGINT, SIGTERM and SIGHUP (SIGBREAK on Windows) go to one handler while a job runs
           (on_stop_signals)
  output   a character stdout's encoding lacks is written as '?', never a failure (run_cli); a long
           job says how far it is on stderr (Progress)
  checks   a config value out of range or not among its choices is a ConfigError naming it

Exit codes: 2 for a usable message (bad config, data, checkpoint, prompt, out dir; a run that cannot
go on), 3 for out of memory outside the training loop, 128 + the signal's number when a signal
stopped the job (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP, 149 for Windows' SIGBREAK).

(Over 300 lines on purpose: the one leaf module every command imports; its promises stay together.)
"""
import argparse
import codecs
import math
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


# ---------------------------------------------------------------- errors

class UserError(Exception):
    """Something the user can fix (or the machine's fault), said in one line: which file, key or
    value, and why."""


class ConfigError(UserError, ValueError):
    """A config key or value that cannot be used."""


class DataError(UserError, ValueError):
    """A data file or data setting that cannot be used."""


class TokenizerError(UserError, ValueError):
    """Text or a tokenizer description the tokenizer cannot handle."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read, used or written."""


class SamplingError(UserError, ValueError):
    """A model whose output cannot be sampled from (damaged weights, or a diverged run)."""


class RunError(UserError, RuntimeError):
    """A run that cannot start or go on (out dir, resume, a numerical fault, memory)."""


class Interrupted(KeyboardInterrupt):
    """A signal stopped a job after it cleaned up; exit_code is 128 + the signal's number."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum, self.exit_code = signum, 128 + signum


def first_line(error: BaseException, limit: int = 160) -> str:
    """What a one-line message can quote of an exception: the first line of its message, at most
    `limit` characters (its type's name when it has no message). torch's run over many lines, and
    some put a C++ source location first ('[enforce fail at alloc_cpu.cpp:127] err == 0.', gloo's
    '[.../pair.cc:537] Read error ...'): it is left out."""
    text = re.sub(r"^\[[^\]]*\]\s*(err == 0\.\s*)?", "", str(error).strip())
    return text.splitlines()[0][:limit] if text else type(error).__name__


def is_out_of_memory(error: BaseException) -> bool:
    """Any allocation failure: torch's (CUDA or CPU allocator), numpy's, Python's."""
    if isinstance(error, MemoryError):   # numpy's _ArrayMemoryError too
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (type(error).__name__ == "OutOfMemoryError" or any(
        s in text for s in ("can't allocate memory", "out of memory", "not enough memory")))


def run_cli(main, argv: list[str]) -> int:
    """Run main(argv); turn what a user can cause into one line on stderr and a non-zero exit.

    Ctrl-C: a command's script gives SIGINT its default action at its first line, so that a Ctrl-C
    ends it at once and quietly, wherever it is (a KeyboardInterrupt raised inside `import torch`
    aborts in native code instead of unwinding). Jobs that must stop cleanly take the signal
    themselves with on_stop_signals: training finishes its step and saves, preparing data removes
    its temporary files, a sweep stops its run."""
    message, unshown = None, Unshown.count
    tolerant_stdout()
    try:
        code = main(argv)
    except UserError as e:
        code, message = 2, f"error: {e}"
    except Interrupted as e:
        code, message = e.exit_code, f"interrupted: {e}"
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    except BrokenPipeError:   # e.g. `python sample.py ... | head`
        code = 0
    except OSError as e:      # the machine's fault, not the code's: a full disk, a vanished file system
        code, message = 2, f"error: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        code, message = 3, (f"error: out of memory ({first_line(e, 100)}); try a smaller batch, block size, model "
                            f"or number of samples (checkpoints already written are kept)")
    if Unshown.count > unshown:
        print(f"note: stdout's encoding ({sys.stdout.encoding}) lacks {Unshown.count - unshown} of the characters "
              f"written, shown as '?' (set PYTHONIOENCODING=utf-8 to write UTF-8)", file=sys.stderr)
    if message:
        print(message, file=sys.stderr)
    return code


class Unshown:
    """How many characters went to stdout as '?' because its encoding lacks them (tolerant_stdout)."""
    count = 0


def _as_question_marks(error: UnicodeError):
    """The codec error handler "unshown": each character the encoding lacks becomes '?', and is counted."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    Unshown.count += error.end - error.start
    return "?" * (error.end - error.start), error.end


codecs.register_error("unshown", _as_question_marks)


def tolerant_stdout() -> None:
    """Make sys.stdout write a character its encoding lacks as '?' instead of failing midway. A Windows
    console takes UTF-8, but output redirected to a file or pipe there is in the ANSI code page (cp1252
    in most Western setups), which lacks Δ, √ and most of the world's scripts. (Writing UTF-8 bytes
    instead would turn every non-ASCII character into two or three wrong ones for a reader that expects
    that code page.) A stream that encodes everything (UTF-8), has a lenient error handler already, or
    cannot be reconfigured (not a TextIOWrapper, or none at all: a closed stdout) stays as it is."""
    out = sys.stdout
    if getattr(out, "errors", None) != "strict" or not hasattr(out, "reconfigure"):
        return
    try:
        if not codecs.lookup(out.encoding).name.startswith("utf"):
            out.reconfigure(errors="unshown")
    except (LookupError, OSError, TypeError, ValueError):   # an unknown codec name, a closed stream
        pass


class Printer:
    """print() for a job's progress, flushed at once, which a lost stdout never stops: when a pipe's
    reader has ended or the terminal has gone, .lost is set and later lines go nowhere (the job decides
    what losing its output means). Printer(False) prints nothing (quiet runs, ranks other than 0)."""

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


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose errors are one line like every other refusal: 'error: ... (see --help)'."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------- files

def atomic_write(path: Path, data) -> None:
    """Write data (str, bytes, or a function that writes to a binary file) to a temporary file beside
    path, fsync it and rename it over path: a reader, or a process killed meanwhile, finds the old
    file or the new one, never part of one. The temporary file is .<name>.tmp."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write = data if callable(data) else (lambda f: f.write(data.encode("utf-8") if isinstance(data, str) else data))
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:   # the rename itself is durable once the directory is synced (not every system can)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------- signals

def stop_signals() -> list[int]:
    """The signals that ask a job to stop, of those this system has: SIGINT (Ctrl-C), SIGTERM, SIGHUP
    (a closed terminal; not on Windows) and SIGBREAK (Windows only: Ctrl-Break, what a sweep sends its
    run there, where SIGINT cannot be sent to another process, and a closed console window, after which
    Windows allows the process only a few seconds)."""
    return [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK") if hasattr(signal, name)]


@contextmanager
def on_stop_signals(handler):
    """While inside, the stop signals (above) call handler(signum) instead of ending the process.
    A signal the shell ignores (nohup) stays ignored, one this process may not take is left as it is,
    and the previous handlers come back afterwards. Python sets handlers in the main thread only:
    elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for s in stop_signals():
        try:
            if signal.getsignal(s) is not signal.SIG_IGN:
                previous[s] = signal.signal(s, lambda signum, frame: handler(signum))
        except (OSError, ValueError):   # a signal the system refuses a handler for
            pass
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


class StopRequest:
    """A handler for on_stop_signals where a job stops at a safe point: the first signal is recorded
    (the job reads .signal, its name) and said; a second one ends the process at once."""

    def __init__(self, doing: str):
        self.doing, self.signal = doing, None

    def __call__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            say_now(f"\n{name} again: exiting now\n")
            os._exit(128 + signum)
        self.signal = name
        say_now(f"\n{name}: {self.doing} (again to exit at once)\n")


def unwind_on_stop(message=None):
    """A handler for on_stop_signals where a job cleans up as it unwinds (its finally blocks): the first
    signal raises Interrupted (message(signum) its text, if given); later ones wait for the cleanup."""
    stopped = []

    def handler(signum: int) -> None:
        if not stopped:
            stopped.append(signum)
            raise Interrupted(signum, message(signum) if message else "")
    return handler


WINDOWS = os.name == "nt"


def alive(pid: int) -> bool:
    """Whether process pid (of this host) still runs. An ended process its parent has not yet reaped
    (a zombie) counts as ended. On Windows os.kill(pid, 0) would end the process, not ask: there
    every process is taken as alive."""
    if pid <= 0 or WINDOWS:
        return pid > 0
    try:
        os.kill(pid, 0)   # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:       # it exists, owned by someone else
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):   # no /proc (not Linux): taken as alive
        return True


def say_now(text: str) -> None:
    """Write to stderr from a signal handler: print() could land inside a print() that the signal
    interrupted, which Python's buffered streams refuse with an exception."""
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError):   # no file descriptor (e.g. captured by pytest), or a closed one
        pass


def duration(seconds: float) -> str:
    """3725 -> '1:02:05', 65 -> '1:05'."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """How far a long job is, on stderr: 'label: done / total unit, rate unit/s, ETA', amount(n) writing
    a number of units. On a terminal the line is redrawn at most 5 times a second; into a log a line is
    written every 10 s, so that a log gets a few lines and a short job none. quiet: nothing at all."""

    def __init__(self, label: str, total: float, unit: str, amount=lambda n: f"{n:,.0f}", quiet: bool = False):
        self.label, self.total, self.unit, self.amount, self.quiet = label, total, unit, amount, quiet
        self.done, self.drawn = 0, False
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

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

    def close(self, say_total: bool = False) -> None:
        """Erase the line from a terminal; say_total: then say how much the job did, and how fast."""
        if self.drawn and self.tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
        if say_total and not self.quiet:
            took = time.perf_counter() - self.start
            print(f"{self.label}: {self.amount(self.total)} {self.unit} in {took:.1f} s "
                  f"({self.amount(self.total / max(took, 1e-9))} {self.unit}/s)", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- checks

_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
               bool: "true or false", type(None): "empty"}


def type_problem(values: dict, schema: dict, where: str = "") -> str | None:
    """What is wrong with a dict read from a file against schema ({key: type, tuple of types, or a
    nested schema}), as 'tokens.train is not an integer', or None. A float may hold an int; an int
    is never a bool (JSON and pickles both tell them apart)."""
    for key, kind in schema.items():
        if key not in values:
            return f"{where}{key} is missing"
        value = values[key]
        if isinstance(kind, dict):
            problem = type_problem(value, kind, f"{where}{key}.") if isinstance(value, dict) else \
                f"{where}{key} is not an object"
            if problem:
                return problem
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any(isinstance(value, k) and (k is bool or not isinstance(value, bool)) for k in kinds) or \
            (float in kinds and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            return f"{where}{key} is not {' or '.join(_TYPE_NAMES[k] for k in kinds)}"
    return None


def check(key: str, value, *, above=None, at_least=None, below=None, at_most=None, one_of=None) -> None:
    """A ConfigError naming key unless value is one of `one_of`, or a finite number within the bounds
    given: check("train.beta1", b, at_least=0, below=1) says 'train.beta1 must be in [0, 1), got 1.5'."""
    if one_of is not None:
        if value not in one_of:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, one_of))}")
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    low, high = (above, at_least)[above is None], (below, at_most)[below is None]
    ok = ((above is None or value > above) and (at_least is None or value >= at_least)
          and (below is None or value < below) and (at_most is None or value <= at_most))
    if ok:
        return
    if high is None:
        bounds = f"> {above}" if above is not None else f">= {at_least}"
    elif low is None:
        bounds = f"< {below}" if below is not None else f"<= {at_most}"
    else:
        bounds = f"in {'(' if above is not None else '['}{low}, {high}{')' if below is not None else ']'}"
    raise ConfigError(f"{key} must be {bounds}, got {value}")
