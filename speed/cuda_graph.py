"""CUDA graphs: a step's kernels recorded once and replayed with one launch.

Why: a small model on a big GPU spends most of a step in Python launching hundreds of small kernels
while the GPU waits; a replay costs one launch. What a graph needs: everything it touches stays at
the same address (inputs are copied into a static buffer, the learning rate is a tensor, gradients
and optimizer state are allocated once), and nothing in it waits for the host (no .item(), no Python
branch on a tensor's value). Two users: the training step (GraphStep, train.cuda_graph) and the
decoding step (model/sampling.py, with --compile).
"""
import warnings

import torch


def record(fn, warmup: int = 2):
    """Call fn() `warmup` times on a side stream (compiling, allocating and choosing kernels outside
    the recording, as CUDA graphs require), then record one more call. Returns (graph, what that call
    returned): each graph.replay() runs the same kernels on the same tensors and overwrites those outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def use_tensor_lr(optimizer, capturable: bool) -> None:
    """Hold each group's lr in a one-element tensor on its parameters' device, so that a recorded
    optimizer step reads the current value (a Python float would be baked into the graph);
    capturable: tell torch's optimizers that their step will be recorded."""
    for group in optimizer.param_groups:
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=group["params"][0].device)
        if capturable and "capturable" in group:
            group["capturable"] = True


def use_float_lr(optimizer) -> None:
    """Undo use_tensor_lr."""
    for group in optimizer.param_groups:
        group["lr"] = float(group["lr"])
        if "capturable" in group:
            group["capturable"] = False


class GraphStep:
    """The training step (training/step.py's Step) recorded as a CUDA graph over a static buffer of
    one step's windows; each call copies the next step's windows into the buffer and replays.
    capture=False runs the same static-buffer step without recording (how it is tested on a CPU).

    The warm-up before recording executes real updates. Afterwards the parameters, the optimizer's
    state, the guard's records, the loader's position and the random generators are put back, in
    place, so that the graph's addresses stay valid and training starts exactly where it would have."""

    kind = "graph"
    WARMUP = 3

    def __init__(self, step, loader, capture: bool = True):
        self.step, self.loader = step, loader
        self.windows = torch.zeros(loader.grad_accum, loader.batch_size, loader.block_size + 1, dtype=torch.long,
                                   device=loader.device)                   # (accum, B, T + 1): the input buffer
        capture = capture and loader.device.type == "cuda"
        use_tensor_lr(step.optimizer, capturable=capture)
        self.graph, self.outputs = None, None
        try:
            self.warm_up_then_restore(capture)
        except Exception:
            use_float_lr(step.optimizer)   # for the eager step that replaces this one
            raise

    def run(self):
        return self.step.on(self.windows)

    def warm_up_then_restore(self, capture: bool):
        params, optimizer = list(self.step.model.parameters()), self.step.optimizer
        saved_params = [p.detach().clone() for p in params]
        saved_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                       for p, s in optimizer.state.items()}
        saved_guard, saved_loader = self.step.guard.state_dict(), self.loader.state_dict()
        devices = [self.loader.device] if self.loader.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # "capturable=True ... running without graph capture": on purpose
                self.windows.copy_(self.loader.step_windows())   # real data for the warm-up
                if capture:
                    self.graph, self.outputs = record(self.run, warmup=self.WARMUP)
                else:
                    for _ in range(self.WARMUP):
                        self.run()
        finally:   # back to the state before the warm-up, at the same addresses (also if recording failed)
            with torch.no_grad():
                for p, saved in zip(params, saved_params):
                    p.copy_(saved)
                for p, state in optimizer.state.items():
                    for k, v in state.items():
                        if torch.is_tensor(v):
                            v.copy_(saved_state[p][k]) if p in saved_state else v.zero_()
            self.step.guard.load_state_dict(saved_guard)
            self.loader.load_state_dict(saved_loader)
            optimizer.zero_grad(set_to_none=True)   # (a graph keeps the gradients it writes in its own memory)

    def __call__(self):
        self.windows.copy_(self.loader.step_windows(), non_blocking=True)
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.outputs
