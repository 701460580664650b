"""One optimizer step, the guard against non-finite numbers, the evaluation loss, and scoring a text.

The step runs eagerly: PyTorch launches each kernel as Python reaches it. On a single CUDA GPU the
same step can be recorded once as a CUDA graph and replayed (train.cuda_graph, speed/cuda_graph.py):
it is written so that it can be, with no host sync inside (the loss, the gradient norm and the
non-finite record stay on the device until the loop reads them at a log line).
"""
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from common import RunError
from data.loader import strided_windows

MAX_SKIPS_IN_A_ROW = 10   # on_nonfinite = "skip" still stops a run that has plainly diverged


def clip_gradients(params, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global norm is at most max_norm (0 = no limit); return the norm
    before clipping. No host sync: the scale factor is computed and applied on the device."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)


class Step:
    """One optimizer step: forward and backward over the step's micro-batches (gradients averaged over
    the processes by the wrapped module), clipping, the non-finite check, the update."""

    kind = "eager"

    def __init__(self, wrapped, model, optimizer, scaler, autocast, guard, world, loader, grad_clip: float):
        self.wrapped, self.model, self.optimizer, self.scaler = wrapped, model, optimizer, scaler
        self.autocast, self.guard, self.world, self.loader, self.grad_clip = autocast, guard, world, loader, grad_clip

    def __call__(self):
        """The next step, on the loader's next windows."""
        return self.on(self.loader.step_windows().to(self.loader.device, non_blocking=True))

    def on(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """windows (grad_accum, B, T + 1) on the device -> (mean loss over the global batch, gradient
        norm before clipping, whether the update was applied)."""
        accum = windows.size(0)
        loss_sum = torch.zeros((), device=windows.device)
        for micro in range(accum):
            x, y = windows[micro, :, :-1], windows[micro, :, 1:]        # (B, T) each: y is x shifted by one
            with self.world.no_sync(self.wrapped, last=micro == accum - 1), self.autocast:
                _, loss = self.wrapped(x, y)
            loss_sum += loss.detach()
            self.scaler.scale(loss / accum).backward()
        self.world.all_reduce_mean(loss_sum)   # the loss of the whole global batch, on every rank
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.model.parameters(), self.grad_clip)
        applied = self.guard.ok(loss_sum, grad_norm)   # every rank sees the same loss and norm: same decision
        if applied:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / accum, grad_norm, applied


def graph_blockers(on_nonfinite: str, device: torch.device, processes: int, dtype: torch.dtype) -> list[str]:
    """Why the step cannot be recorded as a CUDA graph here ([] = it can)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"graphs are CUDA only (device {device.type})")
    if processes > 1:
        reasons.append("several processes (DDP/FSDP synchronize from the host)")
    if dtype == torch.float16:
        reasons.append("fp16 loss scaling decides on the host")
    if on_nonfinite == "skip":
        reasons.append("on_nonfinite = skip decides on the host")
    return reasons


class NonFiniteGuard:
    """What a NaN or inf loss or gradient norm does (train.on_nonfinite):

      stop  raise RunError naming the first bad step; no checkpoint is written after it, so the
            last checkpoint is the last good state.
      skip  drop that step's update (its batch and LR-schedule slot are used up), count it, go on;
            MAX_SKIPS_IN_A_ROW bad steps in a row still stop the run.

    Reading a CUDA tensor waits for the GPU, so in stop mode on an accelerator the check is a
    device-side record of the first bad step (`deferred`), read only where the loop syncs anyway
    (log, eval, checkpoint and the last step); the updates of the few steps in between are
    discarded with the run. The step counter lives on the device too, so a CUDA graph can hold
    the check. Skip mode has to decide before the optimizer step, so it reads the flag every step.
    With fp16 loss scaling an inf gradient is routine (the scaler skips it and lowers the scale):
    check_grad=False leaves gradients to the scaler.
    """

    def __init__(self, mode: str, device: torch.device, check_grad: bool = True):
        self.mode, self.check_grad = mode, check_grad
        self.deferred = mode == "stop" and device.type != "cpu"
        self.steps = torch.zeros((), dtype=torch.long, device=device)       # steps checked: the last one's number
        self.first_bad = torch.zeros((), dtype=torch.long, device=device)   # 0: none yet
        self.bad_loss = torch.zeros((), dtype=torch.bool, device=device)    # was the first bad one the loss?
        self.skipped, self.in_a_row, self.last = 0, 0, None   # last: what the last skipped step had wrong
        self.saved_step = None   # the step of the newest checkpoint, for the message (None: none yet)

    def ok(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Called before each optimizer step: False means skip the update."""
        self.steps.add_(1)
        loss_bad = ~torch.isfinite(loss)
        bad = loss_bad | ~torch.isfinite(grad_norm) if self.check_grad else loss_bad
        if self.deferred:
            first = (self.first_bad == 0) & bad
            self.bad_loss.copy_(torch.where(first, loss_bad, self.bad_loss))
            self.first_bad.copy_(torch.where(first, self.steps, self.first_bad))
            return True
        if not bad.item():
            self.in_a_row = 0
            return True
        step = int(self.steps)
        what = self.last = "loss" if loss_bad.item() else "gradient"
        if self.mode == "stop":
            self.fail(step, what)
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= MAX_SKIPS_IN_A_ROW:
            raise RunError(f"non-finite {what} at {self.in_a_row} steps in a row (up to step {step}); stopped, "
                           f"{self.kept()} (try a lower --train.lr)")
        return False

    def check(self) -> None:
        """Raise if a deferred check recorded a bad step (a no-op where every step is checked)."""
        if self.deferred and (step := int(self.first_bad)):
            self.fail(step, "loss" if bool(self.bad_loss) else "gradient")

    def start_at(self, step: int, skipped: int = 0) -> None:
        """Continue counting after `step`, with `skipped` steps skipped so far (a resumed run)."""
        self.steps.fill_(step)
        self.skipped = skipped

    def state_dict(self) -> dict:
        return {"steps": self.steps.clone(), "first_bad": self.first_bad.clone(), "bad_loss": self.bad_loss.clone(),
                "skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """In place: a CUDA graph holds these tensors' addresses."""
        for name in ("steps", "first_bad", "bad_loss"):
            getattr(self, name).copy_(state[name])
        self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]

    def kept(self) -> str:
        if self.saved_step is None:
            return "no checkpoint had been written yet"
        return f"the last good checkpoint (step {self.saved_step}) is kept"

    def fail(self, step: int, what: str):
        raise RunError(f"non-finite {what} at step {step}; stopped, {self.kept()} (try a lower --train.lr, "
                       f"or --train.on_nonfinite=skip to skip such steps)")


@torch.no_grad()
def mean_loss(model, batches, autocast=nullcontext()) -> torch.Tensor:
    """The mean next-token loss over every target of the (x, y) batches (targets of -1 are not scored),
    as a 0-d tensor on the device, computed in eval mode (the model's mode is restored after)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        with autocast:
            _, loss = model(x, y)
        scored = (y >= 0).sum()
        total, count = total + loss.float() * scored, count + scored
    model.train(was_training)
    return total / count


@torch.no_grad()
def score_tokens(model, tokens, block_size: int, stride: int, batch_size: int, autocast=nullcontext(),
                 on_batch=None) -> tuple[float, int]:
    """(total next-token loss in nats, tokens scored) of the model on the token ids (a 1-d numpy
    array), in the windows of data.loader.strided_windows: every token after the first is scored
    once. Eval mode (the model's mode is restored after); the sum is kept in float64 on the host, so
    a long text loses no precision. on_batch(tokens scored) is called after each batch."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in strided_windows(tokens, block_size, stride, batch_size):
        scored = int((y >= 0).sum())   # counted on the host: one wait for the device per batch, for nats
        x, y = x.to(device), y.to(device)
        with autocast:
            logits, _ = model(x, all_logits=True)
        nats = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
        total, count = total + nats.item(), count + scored
        if on_batch is not None:
            on_batch(scored)
    model.train(was_training)
    return total, count
