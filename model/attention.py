"""Masked (causal) multi-head self-attention, step by step.

For one head, with the sequence x (T, C) projected to queries, keys and values of size hs:

    Q, K, V  = x Wq, x Wk, x Wv                 (T, hs) each
    scores   = Q Kᵀ / √hs                       (T, T): how much token i attends to token j
    scores[i, j] = -inf  for j > i              the future is masked out...
    weights  = softmax(scores, dim=-1)          ...so row i is a distribution over tokens 0..i
    out      = weights V                        (T, hs): a weighted average of past values

The n_head heads work side by side on slices of the channels; their outputs are concatenated back
to (T, C) and mixed by an output projection.

Why 1/√hs: if the entries of q and k have unit variance, q·k sums hs such products and has variance
hs. Dividing by √hs keeps the scores at unit scale, so the softmax does not saturate into a one-hot
(whose gradients vanish) as heads get wider. `model.attn_scale = false` drops it, to test that claim.

Two implementations of the same math, chosen by `model.attention`:
  naive  the explicit steps above, materializing the (T, T) weights; can return them for inspection.
  sdpa   torch's fused scaled_dot_product_attention (flash / memory-efficient kernels where present).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


def causal_mask(t_query: int, t_key: int, device) -> torch.Tensor:
    """(t_query, t_key) bool, True where attending is allowed.

    The queries are the last t_query of the t_key positions (they follow any cached keys), so query i
    sits at absolute position t_key - t_query + i and may see keys 0 .. that position.
    """
    return torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(diagonal=t_key - t_query)


def rope_tables(head_dim: int, max_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_len, head_dim/2) for rotary position embedding (Su et al., 2021)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels (first half, second half) of x (B, nh, T, hs) by position-dependent
    angles, so q·k depends only on the distance between the two positions."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class KVCache:
    """One layer's keys and values of the positions seen so far, preallocated for max_len of them."""

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.len = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached ones; return all keys and values so far."""
        end = self.len + k.size(2)
        self.k[:, :, self.len:end] = k
        self.v[:, :, self.len:end] = v
        self.len = end
        return self.k[:, :, :end], self.v[:, :, :end]


def naive_attention(q, k, v, scale: float, dropout: nn.Module):
    """The explicit math. q (B, nh, Tq, hs), k and v (B, nh, Tk, hs) -> out (B, nh, Tq, hs), weights."""
    scores = (q @ k.transpose(-2, -1)) * scale                         # (B, nh, Tq, Tk)
    future = ~causal_mask(q.size(2), k.size(2), q.device)
    scores = scores.masked_fill(future, float("-inf"))
    weights = F.softmax(scores, dim=-1)                                # rows sum to 1, zero above the diagonal
    out = dropout(weights) @ v                                         # (B, nh, Tq, hs)
    return out, weights


def sdpa_attention(q, k, v, scale: float, dropout_p: float):
    """The same math through torch's fused kernel; the (T, T) weights are never materialized."""
    t_query, t_key = q.size(2), k.size(2)
    if t_query == t_key:
        mask, is_causal = None, True
    elif t_query == 1:
        mask, is_causal = None, False   # one new token after the cache: it may see every key
    else:
        mask, is_causal = causal_mask(t_query, t_key, q.device), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.impl, self.pos, self.qk_norm = cfg.attention, cfg.pos, cfg.qk_norm
        self.scale = 1.0 / math.sqrt(self.head_dim) if cfg.attn_scale else 1.0
        self.dropout_p = cfg.dropout
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, C = t.shape
        return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)   # (B, nh, T, hs)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> KVCache:
        return KVCache(batch, self.n_head, max_len, self.head_dim, device, dtype)

    def forward(self, x, rope=None, cache: KVCache | None = None, return_weights: bool = False):
        """x (B, T, C) -> (B, T, C); with return_weights (naive only) also the (B, nh, T, T) weights."""
        B, T, C = x.shape
        q = self.split_heads(self.query(x))
        k = self.split_heads(self.key(x))
        v = self.split_heads(self.value(x))
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if rope is not None:
            q, k = apply_rotary_emb(q, *rope), apply_rotary_emb(k, *rope)
        if cache is not None:
            k, v = cache.append(k, v)                                     # (B, nh, T_past + T, hs)

        if self.impl == "naive":
            out, weights = naive_attention(q, k, v, self.scale, self.attn_dropout)
        else:
            if return_weights:
                raise ValueError("attention weights are only materialized by model.attention='naive'")
            p = self.dropout_p if self.training else 0.0
            out = sdpa_attention(q, k, v, self.scale, p)

        out = out.transpose(1, 2).contiguous().view(B, T, C)              # concatenate the heads
        out = self.resid_dropout(self.proj(out))
        return (out, weights) if return_weights else out
