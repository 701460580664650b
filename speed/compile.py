"""torch.compile, tried at once, so that a failure is one warning line and the eager code
runs instead.

Compiling is lazy: without a trial, a missing C++ compiler or an op the compiler cannot
handle would surface as a long traceback in the middle of the first step or token.
"""
import sys

import torch

from common import first_line


def compiled_or_eager(fn, trial, doing: str, **options):
    """torch.compile(fn, **options), first called by trial(compiled) (which should run it as
    it will run). Any failure there (dynamo, inductor, the C++/Triton toolchain) prints
    'warning: torch.compile failed, <doing> without it (...)' and returns fn itself."""
    compiled = torch.compile(fn, **options)
    try:
        trial(compiled)
    except Exception as e:
        print(f"warning: torch.compile failed, {doing} without it "
              f"({type(e).__name__}: {first_line(e)})", file=sys.stderr, flush=True)
        return fn
    return compiled
