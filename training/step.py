"""One training step: forward and backward over grad_accum micro-batches, gradient clipping, the update.

Two ways to run the same step (`train.cuda_graph`):

  eager  PyTorch launches each kernel as Python reaches it. Used on CPU and MPS, with several
         processes (DDP, FSDP), with fp16 loss scaling, and with train.on_nonfinite = "skip".
  graph  CUDA: the step's kernels are recorded once into a CUDA graph; each step then copies its
         batch into the graph's input buffer and replays the whole step with one launch.

Why a graph: a small model on a big GPU spends most of a step in Python launching hundreds of small
kernels, and the GPU waits. A replay costs one launch. Everything the graph touches must stay at the
same address (the batch buffer, the learning rate as a tensor, gradients, optimizer state) and nothing
in it may wait for the host (no .item(), no Python branch on a tensor's value): the loss, the gradient
norm and the non-finite check stay on the device until the loop reads them at a log line.
"""
import math
import warnings
from contextlib import nullcontext

import torch

from training.distributed import sync_gradients
from training.optim import use_float_lr, use_tensor_lr


def clip_gradients(params, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global norm is at most max_norm (0 = no limit); return the norm
    before clipping. No host sync: the scale factor is computed and applied on the device."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)


class EagerStep:
    """The step as plain PyTorch: what every other way of running it must match."""

    kind = "eager"

    def __init__(self, trained, model, optimizer, scaler, autocast, guard, loader, t, dist):
        self.trained, self.model, self.optimizer, self.scaler = trained, model, optimizer, scaler
        self.autocast, self.guard, self.loader, self.t, self.dist = autocast, guard, loader, t, dist

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """-> (mean loss over the global batch, gradient norm, whether the update was applied)."""
        loss_sum = torch.zeros((), device=self.loader.device)
        for micro, (x, y) in enumerate(self.loader.step_batches("train")):
            with sync_gradients(self.trained, sync=micro == self.t.grad_accum - 1):
                with self.autocast:
                    _, loss = self.trained(x, y)
                loss_sum += loss.detach()
                self.scaler.scale(loss / self.t.grad_accum).backward()   # DDP/FSDP average over the ranks
        self.dist.all_reduce_mean(loss_sum)   # the loss of the whole global batch, on every rank
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.model.parameters(), self.t.grad_clip)
        applied = self.guard.ok(loss_sum, grad_norm)   # every rank sees the same loss and norm: same decision
        if applied:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / self.t.grad_accum, grad_norm, applied


class GraphStep:
    """The same step, recorded once as a CUDA graph and replayed (capture=False: the identical
    static-buffer step without recording, which is how it is tested on a CPU).

    Recording runs the step's kernels without executing them, but the warm-up before it (which
    lets torch.compile compile and cuBLAS pick its kernels outside the graph) does execute real
    updates: the weights, optimizer state and random generators are put back afterwards, in place,
    so the graph's addresses stay valid and training starts exactly where it would have."""

    kind = "graph"
    WARMUP = 3

    def __init__(self, trained, model, optimizer, autocast, guard, loader, t, capture: bool = True):
        self.trained, self.model, self.optimizer, self.autocast = trained, model, optimizer, autocast
        self.guard, self.loader, self.t = guard, loader, t
        device = loader.device
        self.windows = torch.zeros(t.grad_accum, t.batch_size, loader.block_size + 1, dtype=torch.long,
                                   device=device)                            # (accum, B, T + 1): the batch buffer
        self.loss = torch.zeros((), device=device)
        self.grad_norm = torch.zeros((), device=device)
        capture = capture and device.type == "cuda"
        use_tensor_lr(optimizer, capturable=capture)
        self.graph = None
        self.windows.copy_(loader.step_windows("train", consume=False))   # real data for the warm-up
        try:
            self._warm_up_then_restore(capture)
        except Exception:
            use_float_lr(optimizer)   # the eager step that replaces this one
            raise

    def _body(self) -> None:
        """Everything the graph holds: forward and backward per micro-batch, clipping, the update."""
        self.loss.zero_()
        for micro in range(self.t.grad_accum):
            x = self.windows[micro, :, :-1].contiguous()                   # (B, T)
            y = self.windows[micro, :, 1:].contiguous()                    # (B, T): x shifted by one
            with self.autocast:
                _, loss = self.trained(x, y)
            self.loss.add_(loss.detach() / self.t.grad_accum)
            (loss / self.t.grad_accum).backward()
        self.grad_norm.copy_(clip_gradients(self.model.parameters(), self.t.grad_clip))
        self.guard.ok(self.loss, self.grad_norm)   # a device-side record only: never skips
        self.optimizer.step()

    def _warm_up_then_restore(self, capture: bool) -> None:
        params = list(self.model.parameters())
        saved_params = [p.detach().clone() for p in params]
        saved_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                       for p, s in self.optimizer.state.items()}
        saved_guard = self.guard.state()
        devices = [self.loader.device] if self.loader.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                self._warm_up(capture)
        finally:   # back to the state before the warm-up, at the same addresses (also if capturing failed)
            with torch.no_grad():
                for p, saved in zip(params, saved_params):
                    p.copy_(saved)
                for p, state in self.optimizer.state.items():
                    for k, v in state.items():
                        if torch.is_tensor(v):
                            v.copy_(saved_state[p][k]) if p in saved_state else v.zero_()
            self.guard.load_state(saved_guard)
            if self.graph is None:
                self.optimizer.zero_grad(set_to_none=True)

    def _warm_up(self, capture: bool) -> None:
        """WARMUP real steps (on a side stream when capturing, as CUDA graphs require), then the capture."""
        side = torch.cuda.Stream() if capture else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "capturable=True ... running without graph capture": on purpose
            for _ in range(self.WARMUP):
                self.optimizer.zero_grad(set_to_none=True)
                self._body()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
            self.optimizer.zero_grad(set_to_none=True)   # the graph allocates the gradients it writes
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._body()
            self.graph = graph

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        self.windows.copy_(self.loader.step_windows("train"), non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self._body()
        return self.loss, self.grad_norm, True


def graph_blockers(t, device: torch.device, world: int, dtype: torch.dtype) -> list[str]:
    """Why the step cannot be a CUDA graph here ([] = it can)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"graphs are CUDA only (device {device.type})")
    if world > 1:
        reasons.append("several processes (DDP/FSDP synchronize from the host)")
    if dtype == torch.float16:
        reasons.append("fp16 loss scaling decides on the host")
    if t.on_nonfinite == "skip":
        reasons.append("on_nonfinite = skip decides on the host")
    return reasons
