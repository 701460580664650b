"""Optimizers and learning-rate schedules, each a config switch.

train.optimizer
  adamw  AdamW on every parameter; weight decay on matrices (linear weights, embeddings) only.
  muon   Muon on the hidden 2-D matrices (the attention and MLP weights inside the blocks),
         AdamW on the rest (embeddings, LM head, norm gains, biases), whose gradients are not
         "matrix-shaped" in the same way: a row of an embedding is one token's vector, not a
         linear map.

train.schedule (a factor on every group's base learning rate; all groups move together)
  cosine  linear warmup, then cosine decay to min_lr at max_steps
  wsd     linear warmup, constant ("stable"), then a linear warm-down to min_lr over the
          last warmdown_frac of the steps: the stable phase makes fast progress at a high lr,
          and the short decay at the end collects it (Hägele et al., 2024, "Scaling Laws and
          Compute-Optimal Training Beyond Fixed Training Durations").
"""
import math

import numpy as np
import torch
from torch.optim.adamw import adamw


def lr_at(step: int, t) -> float:
    """The learning-rate multiplier (0..1) of optimizer step `step` (0-based) under t's schedule:
    every group's lr is its base lr times it. The floor is t.min_lr / t.lr."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    floor = t.min_lr / t.lr if t.lr > 0 else 0.0
    if t.schedule == "wsd":
        decay_steps = max(1, round(t.warmdown_frac * t.max_steps))
        progress = (step - (t.max_steps - decay_steps)) / decay_steps
        return 1.0 + min(1.0, max(0.0, progress)) * (floor - 1.0)
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)


def set_lr(optimizer, factor: float) -> None:
    """Set every group's lr to its base_lr times factor (the schedule moves all groups together). A
    tensor lr (which a CUDA graph reads from its address) is filled in place."""
    for group in optimizer.param_groups:
        # rounded as a tensor lr holds it
        value = float(np.float32(group["base_lr"] * factor))
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to g (..., m, n), approximately: U Vᵀ of g = U S Vᵀ.

    A Newton-Schulz iteration X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X maps every singular value
    s of X through the odd polynomial p(s) = a s + b s³ + c s⁵; after scaling X so that all
    s <= 1, five rounds of this (steep at 0, with a, b, c tuned for speed rather than
    exactness) push them all into about [0.7, 1.2] while U and V stay put. Only matmuls: cheap
    on any accelerator.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    wide = g.size(-2) <= g.size(-1)
    # X Xᵀ is the smaller Gram matrix
    x = g if wide else g.mT
    # Frobenius >= spectral: all s <= 1
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        # (..., m, m)
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


class PlainOptimizer:
    """What AdamW and Muon share: parameter groups (dicts of "params" and hyperparameters), a
    state per parameter, zero_grad, and state_dict / load_state_dict in torch.optim's format, so
    that checkpoints cross between these and torch.optim's optimizers: "state" keyed by each
    parameter's index (counted over the groups in order), "param_groups" with the indices of their
    "params".

    Not a torch.optim.Optimizer: every method of one goes through torch._disable_dynamo, which
    imports torch._dynamo on its first call (a second of a run's start-up, more on a GPU machine),
    compiled or not. The arithmetic is torch's own kernels all the same."""

    def __init__(self, params, defaults: dict):
        params = list(params)
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state = {}

    def states(self, params: list) -> list[dict]:
        """The state of each of params, made at its first step by the subclass's new_state."""
        for p in params:
            if p not in self.state:
                self.state[p] = self.new_state(p)
        return [self.state[p] for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict:
        """The state and the groups (their tensors not copied)."""
        index = {}
        groups = [{**g, "params": [index.setdefault(p, len(index)) for p in g["params"]]}
                  for g in self.param_groups]
        state = {index[p]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The state_dict of an optimizer of the same state and groups (this class's or
        torch.optim's): each state tensor goes to the device and dtype this one holds it in; the
        saved hyperparameters replace these (torch.optim's options that this class has not are
        left out)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this one")
        params = {i: p for s, g in zip(saved, self.param_groups)
                  for i, p in zip(s["params"], g["params"])}
        self.state = {}
        for i, state in state_dict["state"].items():
            fresh = self.new_state(params[i])
            self.state[params[i]] = {k: state[k].to(v.device, v.dtype) for k, v in fresh.items()}
        for group, s in zip(self.param_groups, saved):
            group.update({k: v for k, v in s.items() if k in group and k != "params"})


class AdamW(PlainOptimizer):
    """AdamW (Loshchilov and Hutter, 2019, "Decoupled Weight Decay Regularization"): per parameter
    p with gradient g, at step t,

        m <- beta1 m + (1 - beta1) g              a running mean of the gradient
        v <- beta2 v + (1 - beta2) g²             and of its square
        p <- p (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

    (dividing by 1 - beta^t undoes m's and v's start at zero). torch's functional AdamW does the
    arithmetic: fused (one kernel over each tensor; it reads lr and t from tensors, which a CUDA
    graph can hold), or multi-tensor (foreach) where that kernel is missing."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, fused: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fused = fused

    def new_state(self, p):
        # t where torch's kernels read it: the fused one on the device, the foreach one on the host
        steps_at = p.device if self.fused else "cpu"
        return {"step": torch.zeros((), dtype=torch.float32, device=steps_at),
                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = self.states(params)
            (beta1, beta2), fused = group["betas"], self.fused
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], fused=fused,
                  foreach=not fused, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


class Muon(PlainOptimizer):
    """Muon: momentum SGD whose update, for each weight matrix, is orthogonalized.

    Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
    https://kellerjordan.github.io/posts/muon/. Per matrix W (out, in) with gradient G:

        M <- momentum M + G                 (Nesterov: use G + momentum M)
        O  = orthogonalize(M)               all singular values ~1: every direction moves equally
        W <- W - lr sqrt(max(1, out/in)) O

    Adam's update is dominated by a few large singular directions of the gradient; equalizing them
    lets the rare directions learn too. Same-shaped matrices are orthogonalized as one batch, in
    bf16 on a GPU (the iteration only needs singular values near 1, not exact ones).
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(params, defaults)

    def new_state(self, p):
        return {"momentum": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.ndim != 2 for p in params):
                raise ValueError("Muon updates 2-D matrices only")
            grads = [p.grad for p in params]
            bufs = [s["momentum"] for s in self.states(params)]
            # M <- momentum M + G, every matrix at once
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, grads)
            updates = bufs
            if group["nesterov"]:
                updates = torch._foreach_add(grads, bufs, alpha=group["momentum"])
            # a tall matrix joins the wide ones of its transposed shape: fewer batches
            by_shape = {}
            for p, g in zip(params, updates):
                tall = p.size(0) > p.size(1)
                item = (p, g.mT if tall else g, tall)
                by_shape.setdefault(tuple(sorted(p.shape)), []).append(item)
            for items in by_shape.values():
                # (n, rows, cols), rows <= cols
                stacked = torch.stack([g for _, g, _ in items])
                # bf16 where its matmuls are faster
                fast = torch.bfloat16 if stacked.is_cuda else stacked.dtype
                ortho = orthogonalize(stacked.to(fast), group["ns_steps"])
                for (p, _, tall), o in zip(items, ortho.to(stacked.dtype).unbind(0)):
                    # a graph's lr is a tensor: the scale is one too
                    scale = -max(1.0, p.size(0) / p.size(1)) ** 0.5 * group["lr"]
                    p.add_((o.mT if tall else o) * scale)


class Optimizers:
    """Several optimizers that act as one: step, zero_grad, param_groups, state_dict."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("optimizers", [])) != len(self.optimizers):
            raise ValueError("the saved optimizer state is for another train.optimizer")
        for opt, s in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(s)


def build_optimizer(model: torch.nn.Module, t, device: torch.device):
    """The optimizer t.optimizer (adamw | muon) over model's parameters (a tied weight once), with
    t's learning rates, betas and momentum; weight decay on matrices only. Every group carries
    base_lr, which set_lr scales by the schedule.

    AdamW runs its fused kernel (one pass over each tensor) on CUDA and CPU, where it beats
    the default per-tensor loop and the multi-tensor (foreach) one; foreach elsewhere."""
    params = list(model.parameters())
    lr, weight_decay = t.lr, t.weight_decay
    if t.optimizer == "adamw":
        hidden = []
    else:
        in_blocks = {id(p) for p in model.blocks.parameters()}
        hidden = [p for p in params if p.ndim == 2 and id(p) in in_blocks]
    rest = [p for p in params if id(p) not in {id(h) for h in hidden}]
    matrices = [p for p in rest if p.ndim >= 2]
    others = [p for p in rest if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay, "base_lr": lr},
              {"params": others, "weight_decay": 0.0, "base_lr": lr}]
    fused = device.type in ("cuda", "cpu")
    groups = [g for g in groups if g["params"]]
    opt = AdamW(groups, lr=lr, betas=(t.beta1, t.beta2), fused=fused)
    if not hidden:
        return opt
    muon_group = {"params": hidden, "base_lr": t.muon_lr}
    muon = Muon([muon_group], lr=t.muon_lr, momentum=t.muon_momentum)
    return Optimizers(muon, opt)
