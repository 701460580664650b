"""Masked (causal) multi-head self-attention, step by step (`naive` and `sdpa`).

For one head, with the sequence x (T, C) projected to queries, keys and values of size hs:

    Q, K, V  = x Wq, x Wk, x Wv                 (T, hs) each
    scores   = Q Kᵀ / √hs                       (T, T): how much token i attends to token j
    scores[i, j] = -inf  for j > i              the future is masked out...
    weights  = softmax(scores, dim=-1)          ...so row i is a distribution over tokens 0..i
    out      = weights V                        (T, hs): a weighted average of past values

The n_head heads work side by side on slices of the channels; their outputs are concatenated back
to (T, C) and mixed by an output projection. (Vaswani et al., 2017, "Attention Is All You Need".)

Why 1/√hs: if the entries of q and k have unit variance, q·k sums hs such products and has variance
hs. Dividing by √hs keeps the scores at unit scale, so the softmax does not saturate into a one-hot
(whose gradients vanish) as heads get wider. `model.attn_scale = false` drops it, to test that claim.

Two implementations of the same math, chosen by `model.attention`:
  naive  the explicit steps above, materializing the (T, T) weights.
  sdpa   torch's fused scaled_dot_product_attention (flash / memory-efficient kernels where present).
With return_weights=True either one takes the explicit path and also returns the weights (for
attention maps, model/inspect.py); training never asks for them, so it pays nothing.
Cost: O(T²·C) time per sequence; the KV cache holds 2·C numbers per token per layer.

This class is also the base of `gqa` (fewer key/value heads) and `sliding_window` (a local mask):
they only change n_kv_head, window and the cache.
"""
import math

import torch.nn as nn
import torch.nn.functional as F

from model.attention.core import KVCache, merge_heads, naive_attention, sdpa_attention, split_heads
from model.config import ModelConfig
from model.positions import alibi_slopes, apply_rotary_emb


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, n_kv_head: int = 0, window: int = 0):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.n_kv_head = n_kv_head or cfg.n_head        # key/value heads (fewer only in gqa)
        self.window = window                            # 0 = see the whole past
        self.impl, self.qk_norm = cfg.attention, cfg.qk_norm
        self.scale = 1.0 / math.sqrt(self.head_dim) if cfg.attn_scale else 1.0
        self.dropout_p = cfg.dropout
        kv_dim = self.n_kv_head * self.head_dim
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.key = nn.Linear(cfg.n_embd, kv_dim, bias=cfg.bias)
        self.value = nn.Linear(cfg.n_embd, kv_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        slopes = alibi_slopes(cfg.n_head) if cfg.pos == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> KVCache:
        return KVCache(batch, self.n_kv_head, max_len, self.head_dim, device, dtype)

    def cache_size(self, seq_len: int) -> int:
        """Numbers this layer's cache holds for one sequence of seq_len tokens: a key and a value
        per key/value head per token."""
        return 2 * self.n_kv_head * self.head_dim * seq_len

    def forward(self, x, rope=None, cache: KVCache | None = None, pos=None, return_weights: bool = False):
        """x (B, T, C) -> (B, T, C). With a cache, pos (T,) are the positions of x's tokens: they are
        stored at those positions and attend to every cached one up to their own. With return_weights
        also the (B, nh, T, T_all) weights (GQA: each query head's; sliding window: zero outside the
        window), computed by the explicit path."""
        q = split_heads(self.query(x), self.n_head)                      # (B, nh, T, hs)
        k = split_heads(self.key(x), self.n_kv_head)                     # (B, nkv, T, hs)
        v = split_heads(self.value(x), self.n_kv_head)
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if rope is not None:
            q, k = apply_rotary_emb(q, *rope), apply_rotary_emb(k, *rope)
        q_pos = k_pos = None                                             # consecutive, without a cache
        if cache is not None:
            k, v, k_pos = cache.update(pos, k, v)                        # (B, nkv, T_cache, hs), (T_cache,)
            q_pos = pos
        if self.n_kv_head != self.n_head:   # each key/value head serves a group of query heads
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        p = self.dropout_p if self.training else 0.0
        if self.impl == "naive" or return_weights:
            out, weights = naive_attention(q, k, v, self.scale, p, self.window, self.alibi_slopes, q_pos, k_pos)
        else:
            out = sdpa_attention(q, k, v, self.scale, p, self.window, self.alibi_slopes, q_pos, k_pos)

        out = merge_heads(out)                                           # (B, T, C): concatenate the heads
        out = self.resid_dropout(self.proj(out))
        return (out, weights) if return_weights else out
