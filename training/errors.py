"""How the command-line tools end on a user's mistake: one line on stderr and a non-zero exit.

    2    a usable message: a bad config, data file, checkpoint, prompt, out dir, or a run that
         cannot go on (non-finite loss, out of memory, full disk)
    3    out of memory outside the training loop (e.g. sampling)
    130  interrupted (Ctrl-C) outside the training loop, which handles its own signals
    129, 130, 143  SIGHUP, SIGINT, SIGTERM while data is prepared (nothing of it is kept)
"""
import sys


class RunError(RuntimeError):
    """A run that cannot start or go on (out dir, resume, numerical fault, memory); the message says why."""


def run_cli(main, argv: list[str]) -> int:
    """Run main(argv); turn the errors a user can cause into a one-line message and a non-zero exit."""
    import torch

    from data.prepare import DataError, Interrupted
    from data.tokenizers import TokenizerError
    from training.checkpoint import CheckpointError
    from training.config import ConfigError

    try:
        return main(argv)
    except (ConfigError, DataError, TokenizerError, CheckpointError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print("error: out of memory on the device; try a smaller --train.batch_size or --model.block_size "
              "(checkpoints already written are kept)", file=sys.stderr)
        return 3
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
