"""torch.compile tried at once, so that a failure is one warning line and the eager code runs:
compiling is lazy, and a missing C++ compiler or an op the compiler cannot handle would
otherwise be a long traceback in the first step.
"""
import sys

import torch

from common import first_line


def compiled_or_eager(fn, trial, doing: str, **options):
    """torch.compile(fn, **options), first called by trial(compiled) as it will run; after a
    failure there (dynamo, inductor, the toolchain), fn itself."""
    compiled = torch.compile(fn, **options)
    try:
        trial(compiled)
    except Exception as e:
        print(f"warning: torch.compile failed, {doing} without it "
              f"({type(e).__name__}: {first_line(e)})", file=sys.stderr, flush=True)
        return fn
    return compiled
