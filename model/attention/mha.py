"""Masked (causal) multi-head self-attention, step by step (`naive`, `sdpa`, `gqa`,
`sliding_window`).

For one head, with x (T, C) projected to queries, keys and values of size hs:

    Q, K, V  = x Wq, x Wk, x Wv          (T, hs) each
    scores   = Q Kᵀ / √hs                (T, T): how much token i attends to token j
    scores[i, j] = -inf  for j > i       the future is masked out...
    weights  = softmax(scores, dim=-1)   ...so row i is a distribution over tokens 0..i
    out      = weights V                 (T, hs): a weighted average of past values

The n_head heads work side by side on slices of the channels; their outputs are
concatenated back to (T, C) and mixed by an output projection. (Vaswani et al., 2017,
"Attention Is All You Need".)

Why 1/√hs: if the entries of q and k have unit variance, q·k sums hs such products and
has variance hs. Dividing by √hs keeps the scores at unit scale, so the softmax does not
saturate into a one-hot (whose gradients vanish) as heads get wider.
`model.attn_scale = false` drops it, to test that claim.

Two implementations of the same math, chosen by `model.attention`:
  naive  the explicit steps above, materializing the (T, T) weights (naive_attention).
  sdpa   torch's fused scaled_dot_product_attention (flash / memory-efficient kernels).
With return_weights=True either one takes the explicit path and also returns the weights
(for attention maps, model/attention_maps.py); training never asks for them, so it pays
nothing. Cost: O(T²·C) time per sequence; the KV cache holds 2·C numbers per token per
layer.

Two variants are settings of the same module:
  gqa             model.n_kv_head key/value heads, each shared by a group of
                  n_head / n_kv_head query heads: 1 is multi-query attention
                  (Shazeer, 2019), n_head plain multi-head, between them GQA (Ainslie
                  et al., 2023).
                  The key and value projections and the KV cache shrink to
                  n_kv_head / n_head of their size; decoding, bound by reading the cache
                  from memory, gets faster. The attention itself costs the same.
  sliding_window  each token sees only the last model.window tokens, itself included: the
                  band i - window < j <= i of the causal triangle. Further back,
                  information still flows one window per layer (Longformer, Beltagy et
                  al., 2020; Mistral 7B, Jiang et al., 2023). Its cache is a ring of
                  `window` slots, whatever the sequence's length. The mask is passed
                  to sdpa, so training saves no time: a kernel that skipped masked
                  blocks would.

Positions: without a cache, the Tq queries are the LAST Tq of Tk consecutive positions,
so query i sits at position Tk - Tq + i. With a cache, the caller passes the positions of
the queries and of the cache's slots (q_pos, k_pos): a slot not yet written holds a
position in the future, masked like one.
"""
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.positions import alibi_bias, alibi_slopes, apply_rotary_emb


def heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, n_head * hs) -> (B, T, n_head, hs): each head's slice of the features."""
    B, T, C = t.shape
    return t.view(B, T, n_head, C // n_head)


def split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, n_head * hs) -> (B, n_head, T, hs): each head attends on its own slice."""
    return heads(t, n_head).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hs) -> (B, T, nh * hs): the heads' outputs concatenated."""
    B, nh, T, hs = t.shape
    return t.transpose(1, 2).contiguous().view(B, T, nh * hs)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for this kind of device (some kinds have none)."""
    available = torch.amp.is_autocast_available(device_type)
    return available and torch.is_autocast_enabled(device_type)


def unit_rms(t: torch.Tensor) -> torch.Tensor:
    """t scaled to a root mean square of 1 over its last dim (QK-norm), in t's own dtype:
    autocast would run it in float32, and hand the attention float32 queries and keys to
    cast back."""
    on = autocast_on(t.device.type)
    with torch.autocast(t.device.type, enabled=False) if on else nullcontext():
        return F.rms_norm(t, (t.size(-1),))


def consecutive_positions(t_query: int, t_key: int, device):
    """The positions of t_query queries that follow t_key - t_query earlier keys, and of
    the t_key keys."""
    q_pos = torch.arange(t_key - t_query, t_key, device=device)
    return q_pos, torch.arange(t_key, device=device)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0):
    """(Tq, Tk) bool, True where attending is allowed: the key's position <= the
    query's, and with a window also query - key < window (the window - 1 before it)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    return allowed


@dataclass
class Settings:
    """What shapes attention besides q, k and v: the scores' scale, dropout on the
    weights, the window (0: the whole past) and ALiBi's per-head slopes (None: none)."""
    scale: float
    dropout_p: float = 0.0
    window: int = 0
    slopes: torch.Tensor | None = None


def naive_attention(q, k, v, s: Settings, q_pos=None, k_pos=None):
    """The explicit math. q (B, nh, Tq, hs), k (B, nh, Tk, hs), v (B, nh, Tk, hv)
    -> out (B, nh, Tq, hv) and the weights (B, nh, Tq, Tk). q_pos (Tq,), k_pos (Tk,):
    the positions of queries and keys (default: consecutive)."""
    if q_pos is None:
        q_pos, k_pos = consecutive_positions(q.size(2), k.size(2), q.device)
    # (B, nh, Tq, Tk)
    scores = (q @ k.transpose(-2, -1)) * s.scale
    if s.slopes is not None:
        scores = scores + alibi_bias(s.slopes, q_pos, k_pos)
    future = ~causal_mask(q_pos, k_pos, s.window)
    scores = scores.masked_fill(future, float("-inf"))
    # rows sum to 1, 0 above the diagonal
    weights = F.softmax(scores, dim=-1)
    # (B, nh, Tq, hv)
    out = F.dropout(weights, s.dropout_p) @ v
    return out, weights


def sdpa_attention(q, k, v, s: Settings, q_pos=None, k_pos=None):
    """The same math through torch's fused kernel; the (T, T) weights are never
    materialized. The plain causal case takes the flash path (is_causal); a window, ALiBi
    or a cache's positions need an explicit mask."""
    t_query, t_key = q.size(2), k.size(2)
    mask, is_causal = None, False
    if q_pos is None and not s.window and s.slopes is None and t_query == t_key:
        is_causal = True
    else:
        if q_pos is None:
            q_pos, k_pos = consecutive_positions(t_query, t_key, q.device)
        allowed = causal_mask(q_pos, k_pos, s.window)
        if s.slopes is None:
            mask = allowed
        else:
            # a float mask is added to the scores: the ALiBi bias, -inf where not allowed
            bias = alibi_bias(s.slopes, q_pos, k_pos).to(q.dtype)
            mask = bias.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=s.dropout_p,
                                          is_causal=is_causal, scale=s.scale)


class KVCache:
    """One layer's keys and values, preallocated for max_len positions: slot j holds
    position j.

    Its shapes never change, so one compiled decoding step serves every position; the
    slots not yet written hold positions after the query's, masked like any future key."""

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device,
                 dtype):
        self.k = torch.zeros(batch, n_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        # the position in each slot
        self.k_pos = torch.arange(max_len, device=device)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, nh, T, hs) of the positions pos (T,) into their slots; return
        every slot's keys and values (B, nh, max_len, hs) and positions (max_len,)."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v, self.k_pos

    def reset(self) -> None:
        """Start again from position 0. Nothing to clear: a stale slot holds a position
        after the new tokens' and is overwritten before any query reaches it."""


class WindowKVCache:
    """The keys and values of the last `window` positions only, in `window` slots used in
    turn (a ring): position p goes to slot p % window, over position p - window, which no
    later query sees."""

    def __init__(self, batch: int, n_head: int, window: int, head_dim: int, device,
                 dtype):
        self.k = torch.zeros(batch, n_head, window, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.window = window
        # each slot's position (-window: none)
        self.k_pos = torch.full((window,), -window, device=device)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Return the cached keys and values followed by k, v (B, nh, T, hs) of the
        positions pos (T,), and the position of each (the mask limits each query to its
        window); then store the last `window` of the new ones in their slots."""
        keys = torch.cat([self.k, k.to(self.k.dtype)], dim=2)
        values = torch.cat([self.v, v.to(self.v.dtype)], dim=2)
        # (window + T,)
        k_pos = torch.cat([self.k_pos, pos])
        # only the last window are kept: earlier ones would share their slots
        kept = pos[-self.window:]
        slots = kept % self.window
        self.k.index_copy_(2, slots, keys[:, :, -kept.size(0):])
        self.v.index_copy_(2, slots, values[:, :, -kept.size(0):])
        self.k_pos.index_copy_(0, slots, kept)
        return keys, values, k_pos

    def reset(self) -> None:
        """Start again from position 0: forget every slot's position (a stale one
        could be visible)."""
        self.k_pos.fill_(-self.window)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        # key/value heads (fewer only in gqa)
        self.n_kv_head = cfg.n_kv_head or cfg.n_head
        # 0 = see the whole past
        self.window = cfg.window
        self.explicit, self.qk_norm = cfg.attention == "naive", cfg.qk_norm
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

    def new_cache(self, batch: int, max_len: int, device, dtype):
        cache = WindowKVCache if self.window else KVCache
        slots = self.window or max_len
        return cache(batch, self.n_kv_head, slots, self.head_dim, device, dtype)

    def cache_size(self, seq_len: int) -> int:
        """Numbers this layer's cache holds for one sequence of seq_len tokens: a key
        and a value per key/value head per token (per token of the window at most)."""
        tokens = min(seq_len, self.window) if self.window else seq_len
        return 2 * self.n_kv_head * self.head_dim * tokens

    def forward(self, x, rope=None, cache=None, pos=None, return_weights: bool = False,
                explicit: bool = False):
        """x (B, T, C) -> (B, T, C). With a cache, pos (T,) are the positions of x's
        tokens: they are stored at those positions and attend to every cached one up to
        their own. With return_weights also the (B, nh, T, T_all) weights (GQA: each query
        head's; sliding window: zero outside the window), computed by the explicit path,
        which explicit=True also asks for."""
        # (B, T, nh, hs), then (B, T, nkv, hs) for the keys and values
        q = heads(self.query(x), self.n_head)
        k = heads(self.key(x), self.n_kv_head)
        v = heads(self.value(x), self.n_kv_head)
        # QK-norm and the rotation before the heads go first: on these contiguous rows,
        # no copy; the rotation's (cos, sin) rows, one per position, serve every head
        if self.qk_norm:
            q, k = unit_rms(q), unit_rms(k)
        if rope is not None:
            cos, sin = rope[0][:, None], rope[1][:, None]
            q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        # (B, nh or nkv, T, hs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # consecutive, without a cache
        q_pos = k_pos = None
        if cache is not None:
            # (B, nkv, T_cache, hs), (T_cache,)
            k, v, k_pos = cache.update(pos, k, v)
            q_pos = pos
        if self.n_kv_head != self.n_head:
            # each key/value head serves a group of query heads
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        dropout_p = self.dropout_p if self.training else 0.0
        settings = Settings(self.scale, dropout_p, self.window, self.alibi_slopes)
        if self.explicit or explicit or return_weights:
            out, weights = naive_attention(q, k, v, settings, q_pos, k_pos)
        else:
            out = sdpa_attention(q, k, v, settings, q_pos, k_pos)

        # (B, T, C): concatenate the heads
        out = merge_heads(out)
        out = self.resid_dropout(self.proj(out))
        return (out, weights) if return_weights else out
