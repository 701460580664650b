"""How the command-line tools end on a user's mistake: one line on stderr and a non-zero exit.

    2    a usable message: a bad config, data file, checkpoint, prompt, out dir, or a run that
         cannot go on (non-finite loss, out of memory, full disk)
    3    out of memory outside the training loop (e.g. sampling)
    130  interrupted (Ctrl-C) outside the training loop, which handles its own signals
    129, 130, 143  SIGHUP, SIGINT, SIGTERM while data is prepared (nothing of it is kept)
"""
import re
import sys

ENFORCE_PREFIX = re.compile(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?")


def first_line(error: BaseException, limit: int = 160) -> str:
    """What a one-line message can quote of an exception: its message cut to the first line and to
    `limit` characters (its type's name when the message is empty); torch's run over many lines."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


class RunError(RuntimeError):
    """A run that cannot start or go on (out dir, resume, numerical fault, memory); the message says why."""


def memory_detail(error: BaseException, limit: int) -> str:
    """What an allocation failure says, without the C++ source location that torch puts first
    ('[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: ...'), which would
    crowd out the size it tried to allocate."""
    return first_line(ENFORCE_PREFIX.sub("", str(error).strip()) or type(error).__name__, limit)


def is_out_of_memory(error: BaseException) -> bool:
    """Any allocation failure: torch's (CUDA or CPU allocator), numpy's, Python's."""
    if isinstance(error, MemoryError):   # numpy's _ArrayMemoryError too
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (type(error).__name__ == "OutOfMemoryError" or
                                                "can't allocate memory" in text or "out of memory" in text.lower()
                                                or "not enough memory" in text)


def run_cli(main, argv: list[str]) -> int:
    """Run main(argv); turn the errors a user can cause into a one-line message and a non-zero exit."""
    from data.prepare import Interrupted
    from data.sources import DataError
    from data.tokenizers import TokenizerError
    from training.checkpoint import CheckpointError
    from training.config import ConfigError

    try:
        return main(argv)
    except (ConfigError, DataError, TokenizerError, CheckpointError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:   # a signal during data preparation, which has cleaned up
        print(f"interrupted: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # e.g. `python sample.py ... | head`
        return 0
    except OSError as e:      # the machine's fault, not the code's: a full disk, a vanished file system
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        print(f"error: out of memory ({memory_detail(e, 100)}); try a smaller batch, block size, model or number "
              f"of samples (checkpoints already written are kept)", file=sys.stderr)
        return 3
