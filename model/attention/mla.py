"""Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2"): keys and values are
rebuilt from one small latent per token, and only the latent is cached.

    c      = norm(x W_down)             (T, d_c)   d_c = model.kv_latent_dim, << 2C
    K, V   = c W_key_up, c W_value_up   (T, C) each, split into heads as usual
    Q      = x W_q                      (T, C)

Decoding up-projects every cached latent again (DeepSeek folds the up-projections into the
query and output projections).

RoPE cannot rotate the latent (it would not commute with the up-projection): with rope, one
rotated key of hs channels per token, shared by the heads, is cached beside it (decoupled
RoPE); a head's scores are q·k + q_rope·k_rope, scaled by 1/√(2 hs).
"""
import math

import torch
import torch.nn as nn

from model.attention.mha import (Settings, merge_heads, naive_attention, sdpa_attention,
                                 split_heads, unit_rms)
from model.config import ModelConfig
from model.positions import alibi_slopes, apply_rotary_emb


class LatentCache:
    """One layer's latents (B, max_len, d_c) and rotated keys (B, 1, max_len, hs) by position."""

    def __init__(self, batch: int, max_len: int, latent_dim: int, rope_dim: int, device,
                 dtype):
        self.c = torch.zeros(batch, max_len, latent_dim, device=device, dtype=dtype)
        shape = (batch, 1, max_len, rope_dim)
        self.k_rope = torch.zeros(shape, device=device, dtype=dtype) if rope_dim else None
        self.k_pos = torch.arange(max_len, device=device)

    def update(self, pos, c, k_rope):
        """Write c (B, T, d_c) and k_rope at positions pos (T,) -> every slot's."""
        self.c.index_copy_(1, pos, c.to(self.c.dtype))
        if k_rope is not None:
            self.k_rope.index_copy_(2, pos, k_rope.to(self.k_rope.dtype))
        return self.c, self.k_rope, self.k_pos

    def reset(self) -> None:
        """Nothing to clear, as in mha.KVCache."""


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, self.n_head, self.head_dim = cfg.n_embd, cfg.n_head, cfg.head_dim
        self.latent_dim, self.rope = cfg.kv_latent_dim, cfg.pos == "rope"
        self.qk_norm = cfg.qk_norm
        # the channels of the shared rotated key (0: none)
        self.rope_dim = self.head_dim if self.rope else 0
        self.scale = 1.0 / math.sqrt(self.head_dim + self.rope_dim) if cfg.attn_scale else 1.0
        self.dropout_p = cfg.dropout
        self.query = nn.Linear(C, C, bias=cfg.bias)
        # x -> the latent (cached) -> every head's keys and values
        self.kv_down = nn.Linear(C, self.latent_dim, bias=cfg.bias)
        self.kv_norm = nn.RMSNorm(self.latent_dim)
        self.key_up = nn.Linear(self.latent_dim, C, bias=cfg.bias)
        self.value_up = nn.Linear(self.latent_dim, C, bias=cfg.bias)
        if self.rope:
            # decoupled RoPE
            self.query_rope = nn.Linear(C, C, bias=cfg.bias)
            self.key_rope = nn.Linear(C, self.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(C, C, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        slopes = alibi_slopes(cfg.n_head) if cfg.pos == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> LatentCache:
        return LatentCache(batch, max_len, self.latent_dim, self.rope_dim, device, dtype)

    def cache_size(self, seq_len: int) -> int:
        return (self.latent_dim + self.rope_dim) * seq_len

    def forward(self, x, rope=None, cache: LatentCache | None = None, pos=None,
                return_weights: bool = False, explicit: bool = False):
        norm = unit_rms if self.qk_norm else (lambda t: t)
        # (B, nh, T, hs)
        q = norm(split_heads(self.query(x), self.n_head))
        # (B, T, d_c)
        c = self.kv_norm(self.kv_down(x))
        k_rope = None
        if self.rope:
            q_rope = norm(split_heads(self.query_rope(x), self.n_head))
            q_rope = apply_rotary_emb(q_rope, *rope)
            # (B, 1, T, hs)
            k_rope = apply_rotary_emb(norm(split_heads(self.key_rope(x), 1)), *rope)
        # consecutive, without a cache
        q_pos = k_pos = None
        if cache is not None:
            # (B, T_cache, d_c), (T_cache,)
            c, k_rope, k_pos = cache.update(pos, c, k_rope)
            q_pos = pos
        k = norm(split_heads(self.key_up(c), self.n_head))
        v = split_heads(self.value_up(c), self.n_head)
        if self.rope:
            # (B, nh, T, 2 hs)
            q = torch.cat([q, q_rope], dim=-1)
            k = torch.cat([k, k_rope.expand(-1, self.n_head, -1, -1)], dim=-1)

        dropout_p = self.dropout_p if self.training else 0.0
        settings = Settings(self.scale, dropout_p, slopes=self.alibi_slopes)
        if return_weights or explicit:
            out, weights = naive_attention(q, k, v, settings, q_pos, k_pos)
        else:
            out = sdpa_attention(q, k, v, settings, q_pos, k_pos)
        out = self.resid_dropout(self.proj(merge_heads(out)))
        return (out, weights) if return_weights else out
