"""Causal linear attention (`linear`): softmax's exp(q·k) replaced by a product of positive
features φ(q)·φ(k), φ(x) = elu(x) + 1 (Katharopoulos et al., 2020, "Transformers are
RNNs"). As it factorizes, the sums over the past are carried along, not redone:

    out_i = φ(q_i) S_i / φ(q_i) z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,  z_i = Σ_{j≤i} φ(k_j)

Sampling adds one token at a time to (S, z), a state of constant size; training goes chunk
by chunk, quadratic inside a chunk of L tokens: O(T·hs²) time per head and O(T·L) memory,
where softmax takes O(T²·hs) and O(T²), usually to a worse loss. With rope only the
numerator's features are rotated (RoFormer, 3.3): the denominator stays positive.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention.mha import (causal_mask, consecutive_positions, merge_heads,
                                 split_heads, unit_rms)
from model.config import ModelConfig
from model.positions import apply_rotary_emb

CHUNK = 64


def causal_linear_attention(q, k, v, state, chunk: int):
    """Σ_{j≤i} (q_i·k_j) v_j for every i, chunk by chunk. q, k (B, nh, T, dk),
    v (B, nh, T, dv), state (B, nh, dk, dv) or None -> out (B, nh, T, dv), the new state."""
    B, nh, T, dk = q.shape
    if T == 1 and state is not None:
        # one decoded token, as an RNN: S += k vᵀ, out = q S
        state = state + k.transpose(-2, -1) @ v
        return q @ state, state
    n = math.ceil(T / chunk)
    # zero keys and values at the end add nothing
    pad = n * chunk - T
    q, k, v = (F.pad(t, (0, 0, 0, pad)).view(B, nh, n, chunk, t.size(-1)) for t in (q, k, v))
    within = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # (B, nh, n, L, L): inside each chunk
    scores = (q @ k.transpose(-2, -1)).masked_fill(~within, 0.0)
    # (B, nh, n, dk, dv): each chunk's sum
    kv = k.transpose(-2, -1) @ v
    # the state at the start of each chunk
    before = kv.cumsum(dim=2) - kv
    if state is not None:
        before = before + state[:, :, None]
    # (B, nh, n, L, dv)
    out = scores @ v + q @ before
    return out.view(B, nh, n * chunk, -1)[:, :, :T], before[:, :, -1] + kv[:, :, -1]


def linear_attention_weights(q, k, q_num, k_num):
    """The (B, nh, T, T) weights a_ij = q_num_i·k_num_j / Σ_{j'≤i} q_i·k_j' (j ≤ i, else 0)
    of out_i = Σ_j a_ij v_j. q, k: the features φ(q), φ(k); q_num, k_num: the same rotated
    by rope (then a row need not sum to 1)."""
    future = ~causal_mask(*consecutive_positions(q.size(2), k.size(2), q.device))
    num = (q_num @ k_num.transpose(-2, -1)).masked_fill(future, 0.0)
    # (B, nh, T, 1)
    den = (q @ k.transpose(-2, -1)).masked_fill(future, 0.0).sum(-1, keepdim=True)
    return num / den.clamp_min(1e-6)


class LinearState:
    """One layer's state, updated in place: S (B, nh, hs, hs) and z (B, nh, hs, 1)."""

    def __init__(self, batch: int, n_head: int, head_dim: int, device, dtype):
        shape = (batch, n_head, head_dim)
        self.S = torch.zeros(*shape, head_dim, device=device, dtype=dtype)
        self.z = torch.zeros(*shape, 1, device=device, dtype=dtype)

    def reset(self) -> None:
        self.S.zero_()
        self.z.zero_()


class LinearAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.qk_norm = cfg.qk_norm
        self.scale = 1.0 / math.sqrt(self.head_dim) if cfg.attn_scale else 1.0
        C = cfg.n_embd
        self.query = nn.Linear(C, C, bias=cfg.bias)
        self.key = nn.Linear(C, C, bias=cfg.bias)
        self.value = nn.Linear(C, C, bias=cfg.bias)
        self.proj = nn.Linear(C, C, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.chunk = CHUNK

    def new_cache(self, batch: int, max_len: int, device, dtype) -> LinearState:
        return LinearState(batch, self.n_head, self.head_dim, device, dtype)

    def cache_size(self, seq_len: int) -> int:
        return self.n_head * self.head_dim * (self.head_dim + 1)

    def forward(self, x, rope=None, cache: LinearState | None = None, pos=None,
                return_weights: bool = False, explicit: bool = False):
        """With a cache, x continues the tokens its state sums over; explicit changes
        nothing (no softmax to fuse)."""
        if return_weights and cache is not None:
            raise ValueError("linear attention's weights need the whole sequence, not a cache")
        # (B, nh, T, hs)
        q, k, v = (split_heads(proj(x), self.n_head) for proj in (self.query, self.key, self.value))
        if self.qk_norm:
            q, k = unit_rms(q), unit_rms(k)
        # φ: positive features
        q, k = F.elu(q * self.scale) + 1, F.elu(k) + 1
        q_num, k_num = q, k
        if rope is not None:
            q_num, k_num = apply_rotary_emb(q, *rope), apply_rotary_emb(k, *rope)
        # the denominator: Σ φ(q)·φ(k) · 1
        ones = torch.ones_like(v[..., :1])

        S, z = (cache.S, cache.z) if cache is not None else (None, None)
        num, S = causal_linear_attention(q_num, k_num, v, S, self.chunk)
        den, z = causal_linear_attention(q, k, ones, z, self.chunk)
        if cache is not None:
            cache.S.copy_(S)
            cache.z.copy_(z)
        out = merge_heads(num / den.clamp_min(1e-6))
        out = self.resid_dropout(self.proj(out))
        if return_weights:
            return out, linear_attention_weights(q, k, q_num, k_num)
        return out
