"""CUDA graphs: a step's kernels recorded once and replayed with one launch (a small model on
a big GPU spends most of a step launching kernels). Everything a graph touches stays at one
address (static buffers, the learning rate a tensor), and nothing in it waits for the host.
"""
import torch


def record(fn, warmup: int, generator: torch.Generator | None = None):
    """Call fn() `warmup` times on a side stream (compiling, allocating, choosing kernels),
    then record one more call -> (graph, what it returned, which each replay overwrites).
    generator: one fn draws from besides the default, advanced by each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # before torch 2.14 only the default generator registers itself (after, this call warns)
    if generator is not None and torch.__version__ < "2.14.0a0":
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_step(step, optimizer, capture: bool = True):
    """step(), a training step on static tensors, recorded as a CUDA graph -> run(), which
    replays it (capture=False: the same warm-up, then step itself). The learning rates become
    tensors on the device."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device=params[0].device)
    saved = [p.detach().clone() for p in params]
    saved_state = {p: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                   for p, s in optimizer.state.items()}
    graph = out = None
    try:
        # the warm-up's dropout draws leave the generators as they were
        with torch.random.fork_rng(devices=[params[0].device] if capture else []):
            if capture:
                graph, out = record(step, 3)
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
