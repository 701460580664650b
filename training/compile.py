"""torch.compile, tried at once so that a failure is a one-line warning and the eager model."""
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn

from training.errors import first_line


def compile_model(model: nn.Module, batch_shape: tuple[int, int], vocab_size: int,
                  autocast=nullcontext(), warn=lambda msg: print(msg, file=sys.stderr, flush=True)):
    """torch.compile(model), tried at once on one forward and backward of a batch of batch_shape.

    Compiling is lazy: without the trial, a missing C++ compiler or an unsupported op would surface
    as a long traceback in the middle of the first step. Here it is a one-line warning and the eager
    model. The trial compiles the graphs the training step reuses (same shapes, same autocast) and
    leaves no trace: no gradients, and the RNG states (dropout draws) are restored afterwards.
    """
    compiled = torch.compile(model)
    device = next(model.parameters()).device
    x = torch.randint(0, vocab_size, batch_shape, device=device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
            _, loss = compiled(x, x)
            loss.backward()
    except Exception as e:   # any failure in dynamo, inductor or the C++/Triton toolchain
        warn(f"warning: torch.compile failed, training without it ({type(e).__name__}: {first_line(e)})")
        return model
    finally:
        model.zero_grad(set_to_none=True)
    return compiled
