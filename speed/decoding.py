"""sample.py --compile: the decoding step compiled, and on CUDA a run of several tokens
(model/sampling.py's Decoder.run) replayed as one CUDA graph.
"""
import functools
import sys

import torch

from common import first_line
from speed.compile import compiled_or_eager

# Tokens per run, one CUDA graph replay: 16 tokens share its launch and Python's turn of the
# loop, and 16 divides the half block a slide leaves when block_size is 2^n >= 32.
TOKENS_PER_RUN = 16


def run_lengths(block_size: int) -> list[int]:
    """TOKENS_PER_RUN (at most half a block), then halves for what is left before a slide or
    the end."""
    k = max(1, min(TOKENS_PER_RUN, block_size // 2))
    return [k >> i for i in range(k.bit_length())]


def compiled(run, decoder):
    """decoder.step compiled; on CUDA -> a run(n) replaying one CUDA graph per run length
    (decoder.sizes), else run. Inductor fuses explicit attention for one query into a few
    kernels; coordinate descent tuning fuses each one-row matmul with its neighbours."""
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
    sizes = run_lengths(decoder.model.cfg.block_size)
    # the warm-up's draws are undone: a seed gives the eager code's tokens
    with torch.random.fork_rng(devices=[decoder.pos.device]):
        state = generator and generator.get_state()
        try:
            for n in sizes:
                decoder.pos.zero_()
                graphs[n] = record(functools.partial(run, n), 1, generator)
        except Exception as e:
            print(f"warning: recording the decoding step as a CUDA graph failed, decoding "
                  f"without it ({type(e).__name__}: {first_line(e)})", file=sys.stderr, flush=True)
            return run
        finally:
            if generator:
                generator.set_state(state)
    decoder.sizes = sizes

    def replay(n):
        graph, out = graphs[n]
        graph.replay()
        return out
    return replay
