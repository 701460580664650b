"""Optimizers and learning-rate schedules, each a config switch.

train.optimizer
  adamw  AdamW on every parameter; weight decay on matrices (linear weights, embeddings) only.
  muon   Muon on the hidden matrices (attention and MLP weights), AdamW on the rest: a row
         of an embedding is one token's vector, not a linear map.

train.schedule (a factor on every group's base learning rate)
  cosine  linear warmup, then cosine decay to min_lr at max_steps
  wsd     linear warmup, constant, then a linear decay to min_lr over the last warmdown_frac
          of the steps: fast progress at a high lr, collected by the short decay (Hägele et
          al., 2024).
"""
import math

import numpy as np
import torch
from torch.optim.adamw import adamw


def lr_at(step: int, t) -> float:
    """The learning-rate multiplier (0..1) of step `step` (0-based); its floor t.min_lr / t.lr."""
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
    """Set every group's lr to its base_lr times factor; a tensor lr (a CUDA graph's) in place."""
    for group in optimizer.param_groups:
        # rounded as a tensor lr holds it
        value = float(np.float32(group["base_lr"] * factor))
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to g (..., m, n), approximately: U Vᵀ of g = U S Vᵀ.

    Newton-Schulz: X <- a X + b (X Xᵀ) X + c (X Xᵀ)² X maps each singular value s through
    a s + b s³ + c s⁵; from all s <= 1, five rounds (tuned for speed, not exactness) push
    every s into about [0.7, 1.2] while U and V stay put. Only matmuls: cheap anywhere.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    wide = g.size(-2) <= g.size(-1)
    # X Xᵀ is the smaller Gram matrix
    x = g if wide else g.mT
    # Frobenius >= spectral: all s <= 1
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


def rekeyed(optim_state: dict, key) -> dict:
    """An optimizer state dict with each parameter p as key(p): a state_dict numbers them,
    torch's FSDP helpers name them."""
    groups = [{**g, "params": [key(p) for p in g["params"]]} for g in optim_state["param_groups"]]
    return {"state": {key(p): dict(s) for p, s in optim_state["state"].items()},
            "param_groups": groups}


class PlainOptimizer:
    """What AdamW and Muon share: parameter groups, a state per parameter, and state dicts in
    torch.optim's format, so checkpoints cross between these and torch.optim's optimizers.
    Not a torch.optim.Optimizer, whose methods import torch._dynamo (a second of start-up)."""

    def __init__(self, params, defaults: dict):
        params = list(params)
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state = {}

    def with_grads(self):
        """(group, its parameters with a gradient, their states) for each group with any; a
        state is made at its parameter's first step."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p not in self.state:
                    self.state[p] = self.new_state(p)
            if params:
                yield group, params, [self.state[p] for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict:
        """The state and the groups (their tensors not copied)."""
        index = {}
        mine = {"state": self.state, "param_groups": self.param_groups}
        return rekeyed(mine, lambda p: index.setdefault(p, len(index)))

    def load_state_dict(self, state_dict: dict) -> None:
        """A state_dict of this class or torch.optim's over the same groups: each state tensor
        goes where this one holds it. The hyperparameters stay this run's (its config's)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this one")
        params = {i: p for s, g in zip(saved, self.param_groups)
                  for i, p in zip(s["params"], g["params"])}
        self.state = {}
        for i, state in state_dict["state"].items():
            fresh = self.new_state(params[i])
            self.state[params[i]] = {k: state[k].to(v.device, v.dtype) for k, v in fresh.items()}


class AdamW(PlainOptimizer):
    """AdamW (Loshchilov and Hutter, 2019): per parameter p with gradient g, at step t,

        m <- beta1 m + (1 - beta1) g              a running mean of the gradient
        v <- beta2 v + (1 - beta2) g²             and of its square
        p <- p (1 - lr wd) - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

    (1 - beta^t undoes m's and v's start at zero). torch's functional AdamW does the
    arithmetic: fused (one kernel per tensor; lr and t may be tensors, as a CUDA graph needs),
    or multi-tensor (foreach) where that kernel is missing."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, fused: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.fused = fused

    def new_state(self, p):
        # t where torch's kernels read it: the fused one on the device, foreach's on the host
        steps_at = p.device if self.fused else "cpu"
        return {"step": torch.zeros((), dtype=torch.float32, device=steps_at),
                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):
        for group, params, states in self.with_grads():
            (beta1, beta2), fused = group["betas"], self.fused
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                  fused=fused, foreach=not fused, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)


class Muon(PlainOptimizer):
    """Muon: momentum SGD whose update of each weight matrix is orthogonalized (Keller Jordan,
    2024, https://kellerjordan.github.io/posts/muon/). Per matrix W (out, in), gradient G:

        M <- momentum M + G
        O  = orthogonalize(G + momentum M)    Nesterov; all singular values ~1
        W <- W - lr sqrt(max(1, out/in)) O

    Adam's update is dominated by a few large singular directions of the gradient; equalizing
    them lets the rare directions learn too. Same-shaped matrices are orthogonalized as one
    batch, in bf16 on a GPU (singular values near 1 are enough).
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    def new_state(self, p):
        return {"momentum": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure=None):
        for group, params, states in self.with_grads():
            grads = [p.grad for p in params]
            bufs = [s["momentum"] for s in states]
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, grads)
            updates = torch._foreach_add(grads, bufs, alpha=group["momentum"])
            # a tall matrix joins the wide ones of its transposed shape: fewer batches
            by_shape = {}
            for p, g in zip(params, updates):
                wide = g if p.size(0) <= p.size(1) else g.mT
                by_shape.setdefault(wide.shape, []).append((p, wide))
            for items in by_shape.values():
                stacked = torch.stack([g for _, g in items])
                # bf16 where its matmuls are faster
                fast = torch.bfloat16 if stacked.is_cuda else stacked.dtype
                ortho = orthogonalize(stacked.to(fast)).to(stacked.dtype)
                for (p, _), o in zip(items, ortho):
                    # a graph's lr is a tensor: the scale is one too
                    scale = -max(1.0, p.size(0) / p.size(1)) ** 0.5 * group["lr"]
                    p.add_((o if o.shape == p.shape else o.mT) * scale)


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
    """The optimizer t.optimizer over model's parameters (a tied weight once); weight decay on
    matrices only; every group's base_lr is what set_lr scales. AdamW's fused kernel beats
    the foreach one on CUDA and CPU."""
    params = list(model.parameters())
    in_blocks = set(model.blocks.parameters()) if t.optimizer == "muon" else set()
    hidden = [p for p in params if p.ndim == 2 and p in in_blocks]
    rest = [p for p in params if p.ndim != 2 or p not in in_blocks]
    groups = [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]
    groups = [{**g, "base_lr": t.lr} for g in groups if g["params"]]
    fused = device.type in ("cuda", "cpu")
    opt = AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)
    if not hidden:
        return opt
    muon = Muon([{"params": hidden, "base_lr": t.muon_lr}], lr=t.muon_lr, momentum=t.muon_momentum)
    return Optimizers(muon, opt)
