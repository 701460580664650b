"""torch.compile tried at once, so that a failure (a missing C++ compiler, an op it cannot
handle) is one warning line and the eager code runs, not a traceback in the first step.
"""
import sys

import torch

from common import first_line


def compiled_or_eager(fn, trial, doing: str, **options):
    """torch.compile(fn, **options) tried by trial(compiled); fn itself if that fails."""
    compiled = torch.compile(fn, **options)
    try:
        trial(compiled)
    except Exception as e:
        print(f"warning: torch.compile failed, {doing} without it "
              f"({type(e).__name__}: {first_line(e)})", file=sys.stderr, flush=True)
        return fn
    return compiled
