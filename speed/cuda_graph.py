"""CUDA graphs: a step's kernels recorded once and replayed with one launch.

Why: a small model on a big GPU spends most of a step in Python launching hundreds of small kernels
while the GPU waits; a replay costs one launch. What a graph needs: everything it touches stays at
the same address (inputs are copied into a static buffer, the learning rate is a tensor, gradients
and optimizer state are allocated once), and nothing in it waits for the host (no .item(), no Python
branch on a tensor's value). Two users: the training step (graph_step) and the decoding step
(speed/decoding.py, sample.py --compile).
"""
import torch


def record(fn, warmup: int = 2, generator: torch.Generator | None = None):
    """Call fn() `warmup` times on a side stream (compiling, allocating and choosing kernels
    outside the recording, as CUDA graphs require), then record one more call. Returns (graph,
    what that call returned): each graph.replay() runs the same kernels on the same tensors and
    overwrites those outputs. generator: one that fn draws from besides the default (which
    torch.cuda.graph registers itself): a replay draws what eager code would from its state."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_step(step, optimizer, capture: bool = True):
    """step(), a whole training step on static tensors (its windows in a buffer refilled before
    each call), recorded as a CUDA graph: returns run(), which replays it. capture=False runs the
    same step without recording (how it is tested on a CPU).

    The learning rates become tensors on the device (set_lr fills them in place). The warm-up
    before recording executes real updates: the parameters and the optimizer's state are put back
    afterwards, in place, so that training starts where it would have. Any failure puts the float
    learning rates back, for the eager step that replaces this one."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device=params[0].device)
    saved = [p.detach().clone() for p in params]
    saved_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                   for p, s in optimizer.state.items()}
    graph = out = None
    try:
        # the warm-up's dropout draws leave the generators as they were
        with torch.random.fork_rng(devices=[params[0].device] if capture else []):
            if capture:
                graph, out = record(step, warmup=3)
            else:
                for _ in range(3):
                    step()
    except Exception:
        for group in optimizer.param_groups:
            group["lr"] = float(group["lr"])
        raise
    # back to the state before the warm-up, at the same addresses
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
            for p, s in optimizer.state.items():
                for k, v in s.items():
                    if torch.is_tensor(v):
                        v.copy_(saved_state[p][k]) if p in saved_state else v.zero_()
        # a graph keeps the gradients it writes in its own memory
        optimizer.zero_grad(set_to_none=True)

    def run():
        if graph is None:
            return step()
        graph.replay()
        return out
    return run
