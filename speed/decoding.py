"""The one-token decoding step, compiled, and on CUDA replayed as a CUDA graph: sample.py
--compile.

At batch 1 a decoding step is a hundred small kernels, and launching them one by one from
Python costs more than running them. model/sampling.py's decode_step has fixed shapes and
updates its tensors in place, so torch.compile makes it one graph, and a CUDA graph replays
that graph with one launch per token. generate(..., decoding=Decoding(speed_up=compiled))
asks for it; on a CPU, compiling costs tens of seconds, more than a sample saves (bench.py
sample measures both).
"""
import functools
import sys

from common import first_line
from speed.compile import compiled_or_eager


def compiled(step, args: tuple):
    """step (decode_step) compiled for args, which it updates in place; on CUDA a graph
    replay that returns the graph's own outputs (the next replay overwrites them). A failure
    is one warning line and the step without it.

    explicit=True: the compiler fuses the explicit attention math into a few kernels for one
    query (the fused attention kernels are made for many). Coordinate descent tuning makes
    inductor turn each one-row matmul into a reduction it tunes and fuses with its
    neighbours."""
    model = args[0]
    cuda = next(model.parameters()).is_cuda
    options = {"coordinate_descent_tuning": True} if cuda else None

    def trial(fn):
        for _ in range(2):
            fn(*args)
    explicit = functools.partial(step, explicit=True)
    decode = compiled_or_eager(explicit, trial, "decoding",
                               fullgraph=True, dynamic=False, options=options)
    if not cuda:
        return decode
    from speed.cuda_graph import record
    try:
        graph, out = record(lambda: decode(*args))
    except Exception as e:
        print(f"warning: recording the decoding step as a CUDA graph failed, decoding "
              f"without it ({type(e).__name__}: {first_line(e)})", file=sys.stderr, flush=True)
        return decode

    def replay(*same_args):
        graph.replay()
        return out
    return replay
