"""What every command keeps to; imports neither torch nor the rest of the project.

  one line   a mistake a user can make is a UserError; run_cli turns it, an OSError,
             running out of memory and Ctrl-C into one line on stderr and an exit code,
             never a traceback; SIGTERM is a Ctrl-C, and so is a stop while torch imports
  settings   a config field is setting(default, "what it does", bounds): --help prints the
             text, and check_fields() holds every field to its bounds
  files      a file is written whole or not at all (atomic_write)
  progress   a long job says how far it is, on stderr (Progress)
  the CPU    how busy other processes keep the cores this one may use (cpu_clock): a CPU
             run leaves them their cores (model/device.py)

Exit codes: 2 for a mistake (or the machine's fault: a full disk), 3 for out of memory, 130
for Ctrl-C and 143 for SIGTERM (a run stopped by a signal: 128 + its number).
"""
import argparse
import dataclasses
import math
import operator
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path


class UserError(Exception):
    """Something the user can fix (or the machine's fault), said in one line: `error: ...`,
    exit 2."""


def first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (torch's run over many lines)."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def silence_stdout() -> None:
    """Whatever is still to be printed goes nowhere: a stdout whose reader is gone (`| head`,
    a closed terminal) stops the printing, not the job, and Python's flush at exit does not
    fail either."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


# the signals that reached this process outside the training loop (which takes them over)
STOPS = []


def stop_here(signum, frame):
    """SIGINT and SIGTERM (what kill, timeout and job schedulers send) outside the training loop:
    noted, and raised as KeyboardInterrupt, so that a command cleans up after either alike. Noted,
    because an error that a stop causes later (a half-done import, cut short) is that stop."""
    STOPS.append(signum)
    raise KeyboardInterrupt


def stopped(chain: list) -> tuple[int, str] | None:
    """(exit code, line) of a command a signal stopped: by STOPS, or by a KeyboardInterrupt among
    an error's causes (a Ctrl-C inside Python's own code comes out as another error)."""
    if not STOPS and not any(isinstance(e, KeyboardInterrupt) for e in chain):
        return None
    signum = STOPS[-1] if STOPS else signal.SIGINT
    return 128 + signum, "terminated" if signum == signal.SIGTERM else "interrupted"


def quiet_stop(kind, error, trace) -> None:
    """sys.excepthook: a stop while a command imports torch, before run_cli runs, is the one line
    it is under run_cli; anything else is Python's own traceback."""
    said = stopped(causes(error))
    if said is None:
        return sys.__excepthook__(kind, error, trace)
    print(said[1], file=sys.stderr, flush=True)
    os._exit(said[0])


# every command imports this module first
if threading.current_thread() is threading.main_thread():
    sys.excepthook = quiet_stop
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, stop_here)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop_here)


# how running out of memory reads: torch's allocators, C++'s, Python's
OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "bad_alloc")
# a C function that failed and could not make the exception: what an allocation that fails
# leaves, nearly always
NO_EXCEPTION = ("without setting an exception", "error return without exception set")
SMALLER = "try a smaller batch, block size or model (checkpoints already written are kept)"


def causes(error: BaseException) -> list[BaseException]:
    """error, the error it was raised from or while handling, and so on down."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def verdict(error: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for what a user or the machine can cause; None for a bug. A
    Ctrl-C that lands while Python builds a class comes out as another error: its causes
    tell."""
    chain = causes(error)
    if isinstance(error, UserError):
        return 2, f"error: {error}"
    if said := stopped(chain):
        return said
    if isinstance(error, OSError):
        # the machine's: a full disk, a read-only folder, a file that went away
        where = f": {error.filename}" if error.filename else ""
        return 2, f"error: {error.strerror or error}{where}"
    # Python's own allocations fail as MemoryError, or as a SystemError when a C function
    # could not even make the exception; torch's as a RuntimeError
    memory = [e for e in chain if isinstance(e, MemoryError) or isinstance(e, RuntimeError)
              and any(w in str(e) for w in OUT_OF_MEMORY) or isinstance(e, SystemError)
              and any(w in str(e) for w in NO_EXCEPTION)]
    if not memory:
        return None
    # the frames of the tracebacks hold what filled the memory: let it go before saying it
    for e in chain:
        e.__traceback__ = None
    try:
        return 3, f"error: out of memory ({first_line(memory[0], 100)}): {SMALLER}"
    except MemoryError:
        return 3, f"error: out of memory: {SMALLER}"


def run_cli(main, argv: list[str]) -> int:
    """main(argv)'s exit code, what a user can cause said in one line (verdict). SIGTERM is
    a Ctrl-C here; the training loop takes both signals over itself."""
    # a character the terminal cannot show prints as '?'
    strict = getattr(sys.stdout, "errors", None) == "strict"
    if strict and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    STOPS.clear()
    try:
        return main(argv)
    except BrokenPipeError:
        # `python sample.py ... | head`
        silence_stdout()
        return 0
    except BaseException as e:
        said = None if isinstance(e, SystemExit) else verdict(e)
        if said is None:
            raise
        code, message = said
    print(message, file=sys.stderr)
    return code


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose errors are one line like every other refusal:
    'error: ... (see --help)'."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def setting(default, help: str, **bounds):
    """A config dataclass field with what it does (for --help) and the bounds check() holds
    it to."""
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


# the repository: runs go to its out/ wherever a command runs
ROOT = Path(__file__).resolve().parent
OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def check(key: str, value, *, above=None, at_least=None, below=None, at_most=None,
          one_of=None) -> None:
    """A UserError naming key unless value is one of `one_of`, or a finite number within
    the bounds: 'train.beta1 must be >= 0 and < 1, got 1.5'."""
    if one_of is not None and value not in one_of:
        raise UserError(f"{key}={value!r} is not one of {', '.join(map(str, one_of))}")
    limits = zip(OPS, (above, at_least, below, at_most))
    bounds = [(op, b) for op, b in limits if b is not None]
    within = all(OPS[op](value, b) for op, b in bounds)
    if bounds and not (math.isfinite(value) and within):
        said = " and ".join(f"{op} {b}" for op, b in bounds)
        raise UserError(f"{key} must be {said}, got {value}")


def flat(values: dict, prefix: str = "") -> dict:
    """A config's nested tables as dotted keys:
    {'model': {'n_head': 4}} -> {'model.n_head': 4}."""
    out = {}
    for k, v in values.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out


def check_fields(config, section: str) -> None:
    """check() every field of a config dataclass against the bounds its setting() gave."""
    for f in dataclasses.fields(config):
        if bounds := {k: v for k, v in f.metadata.items() if k != "help"}:
            check(f"{section}.{f.name}", getattr(config, f.name), **bounds)


def atomic_write(path, data) -> None:
    """Write data (str, bytes, or a function that writes to a binary file) to .<name>.tmp
    beside path, fsync it and rename it over path: a reader, or a process killed meanwhile,
    finds the old file or the new one, never part of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if isinstance(data, str):
        data = data.encode()
    write = data if callable(data) else lambda f: f.write(data)
    try:
        # a leftover could be a hard link to a checkpoint that must not change
        tmp.unlink(missing_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        # said of the file the user knows, not of its temporary twin
        if isinstance(e, OSError):
            e.filename = str(path)
        raise


def typed(p) -> str:
    """A path as a user here types it: relative to the working directory when under it,
    else absolute."""
    if Path(p).absolute().is_relative_to(Path.cwd()):
        return os.path.relpath(p)
    return os.path.abspath(p)


def command(script: str, *args: str) -> str:
    """The command line that runs this repository's script with args from here, quoted for
    a shell."""
    return shlex.join(["python", typed(ROOT / script), *args])


def duration(seconds: float) -> str:
    """3725 -> '1:02:05', 65 -> '1:05'."""
    h, rest = divmod(max(0, int(round(seconds))), 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def cpu_clock() -> tuple[float, float, float] | None:
    """A reading of (seconds, busy seconds of the cores this process may run on, this
    process's own CPU seconds), from Linux's /proc/stat; None where there is none. Two
    readings tell how many cores other processes kept busy in between."""
    try:
        cores = os.sched_getaffinity(0)
        lines = Path("/proc/stat").read_text().splitlines()
    except (AttributeError, OSError):
        return None
    busy = 0
    for line in lines:
        name, *ticks = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cores:
            # user nice system idle iowait irq softirq steal: all but idle and iowait are
            # work
            t = [int(n) for n in ticks[:8]]
            busy += sum(t) - t[3] - t[4]
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()


# taken as the process starts: a command's first reading spans its imports
CPU_AT_START = cpu_clock()


class Progress:
    """How far a long job is, on stderr: 'label: done / total unit, rate unit/s, ETA'. On a
    terminal the line is redrawn at most 5 times a second; into a log a line is written every
    10 s. quiet: nothing."""

    def __init__(self, label: str, total: float, unit: str, amount=lambda n: f"{n:,.0f}",
                 quiet=False):
        self.label, self.total, self.unit = label, total, unit
        self.amount, self.quiet = amount, quiet
        self.done, self.drawn, self.tty = 0, False, sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def advance(self, n: float) -> None:
        self.done += n
        now = time.perf_counter()
        if self.quiet or now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last, self.drawn = now, True
        rate = self.done / max(now - self.start, 1e-9)
        left = duration((self.total - self.done) / max(rate, 1e-9))
        line = (f"{self.label}: {self.amount(self.done)} / {self.amount(self.total)} "
                f"{self.unit}, {self.amount(rate)} {self.unit}/s, ETA {left}")
        if self.tty:
            print(f"\r{line}\033[K", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.drawn and self.tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
