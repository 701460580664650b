"""Sliding-window attention (`sliding_window`): each token sees only the last `model.window` tokens
(itself included), not the whole past.

The mask keeps the band i - window < j <= i of the causal triangle. Information from further back
still flows, one window per layer, through the layers (a receptive field of n_layer * window), as in
Longformer (Beltagy et al., 2020) and Mistral 7B (Jiang et al., 2023).

Cost: O(T * window * C) attention work with a kernel that skips masked blocks (this implementation
passes a mask to sdpa, so it saves memory in the cache, not time in training). The KV cache is a
ring of `window` slots: at most `window` keys and values per layer, whatever the length of the sequence.
"""
import torch

from model.attention.mha import CausalSelfAttention
from model.config import ModelConfig


class WindowKVCache:
    """The keys and values of the last `window` positions only, in `window` slots used in turn (a
    ring): position p goes to slot p % window, over position p - window, which no later query sees."""

    def __init__(self, batch: int, n_head: int, window: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_head, window, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.window = window
        self.k_pos = torch.full((window,), -window, device=device)    # the position in each slot (-window: none)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Return the cached keys and values followed by k, v (B, nh, T, hs) of the positions pos (T,),
        and the position of each (the caller's mask limits each query to its window); then store the
        last `window` of the new ones in their slots."""
        keys, values = torch.cat([self.k, k.to(self.k.dtype)], dim=2), torch.cat([self.v, v.to(self.v.dtype)], dim=2)
        k_pos = torch.cat([self.k_pos, pos])                           # (window + T,)
        kept = pos[-self.window:]                                      # (earlier ones would share their slots)
        slots = kept % self.window
        self.k.index_copy_(2, slots, keys[:, :, -kept.size(0):])
        self.v.index_copy_(2, slots, values[:, :, -kept.size(0):])
        self.k_pos.index_copy_(0, slots, kept)
        return keys, values, k_pos

    def reset(self) -> None:
        """Start again from position 0: forget every slot's position (a stale one could be visible)."""
        self.k_pos.fill_(-self.window)


class SlidingWindowAttention(CausalSelfAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, window=cfg.window)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> WindowKVCache:
        return WindowKVCache(batch, self.n_kv_head, self.window, self.head_dim, device, dtype)

    def cache_size(self, seq_len: int) -> int:
        return 2 * self.n_kv_head * self.head_dim * min(seq_len, self.window)
