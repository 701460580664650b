"""Grouped-query attention (`gqa`): fewer key/value heads than query heads.

The n_head query heads are split into n_kv_head groups; all heads of a group attend with the same
keys and values. n_kv_head = n_head is plain multi-head attention, n_kv_head = 1 is multi-query
attention (Shazeer, 2019, "Fast Transformer Decoding: One Write-Head is All You Need"); in between
is GQA (Ainslie et al., 2023, "GQA: Training Generalized Multi-Query Transformer Models").

Cost: the key and value projections shrink to n_kv_head / n_head of their size, and so does the KV
cache: 2 * n_kv_head * hs numbers per token per layer instead of 2 * C. That is the point: decoding
is bound by reading the cache from memory, not by arithmetic. The attention itself costs the same
O(T² C) (each key/value head is repeated for its group; sdpa's enable_gqa can avoid the copy).
"""
from model.attention.mha import CausalSelfAttention
from model.config import ModelConfig


class GroupedQueryAttention(CausalSelfAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, n_kv_head=cfg.n_kv_head)
