"""sample.py --compile: the decoding step compiled, and on CUDA a run of several tokens
replayed as one CUDA graph.

At batch 1 a decoding step is a hundred small kernels, and launching them from Python costs
more than running them. Compiled, the step is one graph; a CUDA graph replays a run of
model/sampling.py's Decoder (k steps with their draws and writes) with one launch and no
wait for the host. On a CPU compiling costs more than a sample saves (bench.py sample).
"""
import functools
import sys

import torch

from common import first_line
from speed.compile import compiled_or_eager


def compiled(run, decoder):
    """decoder.step compiled; on CUDA -> a run(n) that replays the CUDA graph of run(n) for
    each n of decoder.sizes, else run. A failure is one warning line and the code without it.

    explicit=True: the compiler fuses the explicit attention math into a few kernels for one
    query. Coordinate descent tuning makes inductor turn each one-row matmul into a
    reduction it tunes and fuses with its neighbours."""
    cuda, generator = decoder.pos.is_cuda, decoder.generator
    options = {"coordinate_descent_tuning": True} if cuda else None

    def trial(fn):
        for _ in range(2):
            fn(*decoder.args)
    explicit = functools.partial(decoder.step, explicit=True)
    decoder.step = compiled_or_eager(explicit, trial, "decoding",
                                     fullgraph=True, dynamic=False, options=options)
    if not cuda:
        return run
    from speed.cuda_graph import record
    graphs = {}
    # the draws of the warm-up are undone: a seed gives the tokens of the eager code
    with torch.random.fork_rng(devices=[decoder.pos.device]):
        state = None if generator is None else generator.get_state()
        try:
            for n in decoder.sizes:
                decoder.pos.zero_()
                graphs[n] = record(functools.partial(run, n), 1, generator)
        except Exception as e:
            print(f"warning: recording the decoding step as a CUDA graph failed, decoding "
                  f"without it ({type(e).__name__}: {first_line(e)})", file=sys.stderr,
                  flush=True)
            return run
        finally:
            if state is not None:
                generator.set_state(state)

    def replay(n):
        graph, out = graphs[n]
        graph.replay()
        return out
    return replay
