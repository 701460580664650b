"""What every command keeps to; imports neither torch nor the rest of the project.

run_cli says a UserError, an OSError, out of memory or a stop (Ctrl-C, SIGTERM) in one line
on stderr: exit 2 for a mistake or a full disk, 3 for out of memory, 128 + signal for a stop.
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
import tomllib
from contextlib import contextmanager, suppress
from pathlib import Path


class UserError(Exception):
    """Something the user can fix (or the machine's fault): `error: ...`, exit 2."""


def first_line(error: BaseException, limit: int = 160) -> str:
    """torch's messages run over many lines."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def silence_stdout() -> None:
    """Print nothing more: a stdout whose reader is gone (`| head`) stops the printing only."""
    with suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def printer(enabled: bool):
    """print(), flushed, or nothing; see silence_stdout."""
    def say(*args, **kwargs):
        try:
            if enabled:
                print(*args, **kwargs, flush=True)
        except (OSError, ValueError):
            silence_stdout()
    return say


# SIGINT and SIGTERM: quit_now while a command starts (imports torch), stop_here once it runs
# (run_cli), stop_after_step's in the training loop. STOPS: the signals stop_here got
STOPS = []
# Python's own handlers, which a command replaces
DEFAULTS = (signal.default_int_handler, signal.SIG_DFL)


@contextmanager
def handling(handler, when):
    """Inside, handler for SIGINT and SIGTERM where when(the handler before) holds."""
    swapped = {}
    # only the main thread can set them
    if threading.current_thread() is threading.main_thread():
        for stop in (signal.SIGINT, signal.SIGTERM):
            if when(before := signal.getsignal(stop)):
                swapped[stop] = before
                signal.signal(stop, handler)
    try:
        yield
    finally:
        for stop, before in swapped.items():
            # None: a handler that was not set from Python
            signal.signal(stop, before if before is not None else signal.SIG_DFL)


def stop_line(signum: int) -> tuple[int, str]:
    return 128 + signum, "terminated" if signum == signal.SIGTERM else "interrupted"


def quit_now(signum, frame):
    """Exit at once: a KeyboardInterrupt could land in torch's C++, which aborts or swallows it."""
    code, line = stop_line(signum)
    # os.write: a print() could land inside one the signal cut short
    os.write(2, f"{line}\n".encode())
    os._exit(code)


def stop_here(signum, frame):
    """A KeyboardInterrupt, noted: a later error it causes is that stop."""
    STOPS.append(signum)
    raise KeyboardInterrupt


ROOT = Path(__file__).resolve().parent
# a command (a script here) imports this module first: a stop while it starts is its line at
# once; a user's program that imports the project keeps Python's handlers
if Path(getattr(sys.modules["__main__"], "__file__", None) or "/").resolve().parent in (
        ROOT, ROOT / "data"):
    for stop in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(stop) in DEFAULTS:
            signal.signal(stop, quit_now)


@contextmanager
def stop_after_step(loud: bool):
    """Inside, a signal asks for a stop (in the yielded list), which the loop acts on after its
    step; a second one exits at once."""
    asked = []

    def ask(signum, frame):
        asked.append(signum)
        said = "again: exiting now" if len(asked) > 1 else \
            "finishing this step and saving a checkpoint (again to exit at once)"
        # os.write: see quit_now; a stderr whose reader is gone must not end the run unsaved
        with suppress(OSError):
            loud and os.write(2, f"\n{signal.Signals(signum).name}: {said}\n".encode())
        if len(asked) > 1:
            os._exit(128 + signum)
    # a signal the shell ignores (`cmd &`) stays so
    with handling(ask, lambda h: h is not signal.SIG_IGN):
        yield asked


def out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError (or the SystemError when it could not be made), torch's, C++'s."""
    if isinstance(e, RuntimeError):
        return any(w in str(e) for w in ("out of memory", "can't allocate memory", "bad_alloc"))
    if isinstance(e, SystemError):
        return "without setting an exception" in str(e) or "without exception set" in str(e)
    return isinstance(e, MemoryError)


def verdict(error: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for what a user or the machine can cause; None for a bug."""
    # the error and the ones it was raised from or while handling
    chain, cause = [], error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, UserError):
        return 2, f"error: {error}"
    # a stop: a signal stop_here got, or a Ctrl-C that Python's own code made another error
    if STOPS or any(isinstance(e, KeyboardInterrupt) for e in chain):
        return stop_line(STOPS[-1] if STOPS else signal.SIGINT)
    if isinstance(error, OSError):
        # a full disk, a read-only folder, a file that went away
        where = f": {error.filename}" if error.filename else ""
        return 2, f"error: {error.strerror or error}{where}"
    memory = [e for e in chain if out_of_memory(e)]
    if not memory:
        return None
    # the tracebacks' frames hold what filled the memory: let it go before saying it
    for e in chain:
        e.__traceback__ = None
    # a SystemError's text names C internals, nothing a user can act on
    first = memory[0]
    try:
        what = "an allocation failed" if isinstance(first, SystemError) else first_line(first, 100)
        why = f" ({what})"
    except MemoryError:
        why = ""
    return 3, (f"error: out of memory{why}: try a smaller batch, block size or model "
               f"(checkpoints already written are kept)")


def run_cli(main, argv: list[str]) -> int:
    # a character the terminal cannot show prints as '?'
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    STOPS.clear()
    try:
        # after, the handlers it found (a command's: a stop while Python shuts down is its line)
        with handling(stop_here, lambda h: h is quit_now or h in DEFAULTS):
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
    """argparse, whose errors are one line: 'error: ... (see --help)'."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def setting(default, help: str, **bounds):
    """A config dataclass field with its --help and its bounds (check)."""
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def check(key: str, value, *, above=None, at_least=None, below=None, at_most=None,
          one_of=None) -> None:
    """A UserError unless value is one of `one_of`, or a finite number within the bounds."""
    if one_of is not None and value not in one_of:
        raise UserError(f"{key}={value!r} is not one of {', '.join(map(str, one_of))}")
    bounds = [(op, b) for op, b in zip(OPS, (above, at_least, below, at_most)) if b is not None]
    if bounds and not (math.isfinite(value) and all(OPS[op](value, b) for op, b in bounds)):
        said = " and ".join(f"{op} {b}" for op, b in bounds)
        raise UserError(f"{key} must be {said}, got {value}")


def flat(values: dict, prefix: str = "") -> dict:
    """Nested tables as dotted keys: {'model': {'n_head': 4}} -> {'model.n_head': 4}."""
    out = {}
    for k, v in values.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out


def check_fields(config, section: str) -> None:
    for f in dataclasses.fields(config):
        if bounds := {k: v for k, v in f.metadata.items() if k != "help"}:
            check(f"{section}.{f.name}", getattr(config, f.name), **bounds)


def atomic_write(path, data) -> None:
    """Write data (str, bytes, or a function that writes to a binary file) over path: a reader
    finds the old file or the new one."""
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


def load_toml(path, what: str = "a TOML config file") -> dict:
    try:
        return tomllib.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        hint = f" (did you mean --data {path}?)" if Path(path).suffix != ".toml" else ""
        raise UserError(f"{path} is not {what} ({first_line(e, 80)}){hint}") from None


def typed(p) -> str:
    """A path as a user here types it: relative to the working directory when under it."""
    if Path(p).absolute().is_relative_to(Path.cwd()):
        return os.path.relpath(p)
    return os.path.abspath(p)


def command(script: str, *args: str) -> str:
    return shlex.join(["python", typed(ROOT / script), *args])


def duration(seconds: float) -> str:
    """3725 -> '1:02:05', 65 -> '1:05'."""
    h, rest = divmod(max(0, int(round(seconds))), 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def usable_cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def cpu_clock() -> tuple[float, float, float] | None:
    """(seconds, busy seconds of the usable cores, this process's CPU seconds); Linux only."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    cores = usable_cores()
    busy = 0
    for line in lines:
        name, *ticks = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cores:
            # user nice system idle iowait irq softirq steal: all but idle and iowait work
            t = [int(n) for n in ticks[:8]]
            busy += sum(t) - t[3] - t[4]
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()


# a command's first reading spans its imports
CPU_AT_START = cpu_clock()


class Progress:
    """'label: done / total unit, rate unit/s, ETA' on stderr, a terminal's line redrawn."""

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
        end = "\033[K" if self.tty else "\n"
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.drawn and self.tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
