"""How the command-line tools end on a user's mistake: one line on stderr and exit code 2."""
import sys


def run_cli(main, argv: list[str]) -> int:
    """Run main(argv); turn the errors a user can cause into a one-line message and a non-zero exit."""
    import torch

    from data.prepare import DataError
    from data.tokenizers import TokenizerError
    from training.checkpoint import CheckpointError
    from training.config import ConfigError
    from training.trainer import RunError

    try:
        return main(argv)
    except (ConfigError, DataError, TokenizerError, CheckpointError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print("error: out of memory on the device; try a smaller --train.batch_size or --model.block_size "
              "(checkpoints already written are kept)", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # e.g. `python sample.py ... | head`
        return 0
