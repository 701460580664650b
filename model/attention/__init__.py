"""Causal self-attention, chosen by `model.attention` (OTHERS below, else mha.py). The GPT
and the sampler rely on one interface:

    forward(x, rope=None, cache=None, pos=None) -> y
        x, y (B, T, C); rope: (cos, sin) of x's positions; with a cache, x is stored at pos
        (T,) and attends to every cached position up to its own. return_weights=True: also
        the (B, nh, T, T) weights; explicit=True: softmax step by step, not fused
    new_cache(batch, max_len, device, dtype)
        an empty cache of fixed shapes, written in place (reset() empties it)
    cache_size(seq_len)
        the numbers a cache holds for one sequence
"""
import importlib

from model.config import ModelConfig

# module.Class of the variants not in mha.py, imported when a model first uses one
OTHERS = {"linear": "linear.LinearAttention", "mla": "mla.MultiHeadLatentAttention"}


def build_attention(cfg: ModelConfig):
    module, name = OTHERS.get(cfg.attention, "mha.CausalSelfAttention").split(".")
    return getattr(importlib.import_module(f"model.attention.{module}"), name)(cfg)
