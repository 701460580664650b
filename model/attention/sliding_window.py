"""Sliding-window attention (`sliding_window`): each token sees only the last `model.window` tokens
(itself included), not the whole past.

The mask keeps the band i - window < j <= i of the causal triangle. Information from further back
still flows, one window per layer, through the layers (a receptive field of n_layer * window), as in
Longformer (Beltagy et al., 2020) and Mistral 7B (Jiang et al., 2023).

Cost: O(T * window * C) attention work with a kernel that skips masked blocks (this implementation
passes a mask to sdpa, so it saves memory in the cache, not time in training). The KV cache is a
rolling window: at most `window` keys and values per layer, whatever the length of the sequence.
"""
import torch

from model.attention.mha import CausalSelfAttention
from model.config import ModelConfig


class WindowKVCache:
    """The keys and values of the last `window` positions only (older ones can never be seen again)."""

    def __init__(self, batch: int, n_head: int, window: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_head, 0, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.window = window

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the kept keys and values followed by k, v (B, nh, T, hs), all consecutive positions
        (the caller's mask limits each query to its window); keep the last `window` of them."""
        k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k[:, :, -self.window:].clone(), v[:, :, -self.window:].clone()
        return k, v


class SlidingWindowAttention(CausalSelfAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, window=cfg.window)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> WindowKVCache:
        return WindowKVCache(batch, self.n_kv_head, self.window, self.head_dim, device, dtype)

    def cache_size(self, seq_len: int) -> int:
        return 2 * self.n_kv_head * self.head_dim * min(seq_len, self.window)
