"""Causal self-attention and its variants, chosen by `model.attention`.

    naive, sdpa      plain multi-head attention, explicit or fused          mha.py
    gqa              fewer key/value heads (model.n_kv_head; 1 = MQA)       mha.py
    sliding_window   each token sees the last model.window tokens           mha.py
    linear           kernelized, O(T) memory, an RNN-like state             linear.py
    mla              keys and values from a cached low-rank latent          mla.py

Every variant has one interface, which the GPT and the sampler rely on:

    forward(x, rope=None, cache=None, pos=None) -> y
        x, y (B, T, C); rope: (cos, sin) of x's positions; with a cache, x is stored at
        its positions pos (T,) and attends to every cached one up to its own.
        return_weights=True also returns the (B, nh, T, T) weights (attention maps);
        explicit=True: softmax step by step, not fused (model/sampling.py)
    new_cache(batch, max_len, device, dtype)
        an empty cache of fixed shapes, written in place (reset() empties it)
    cache_size(seq_len)
        the numbers a cache holds for one sequence
"""
import importlib

from model.config import ATTENTIONS, ModelConfig

# name -> module.Class (a variant's module is imported when a model first uses it)
REGISTRY = {
    "naive": "mha.CausalSelfAttention",
    "sdpa": "mha.CausalSelfAttention",
    "gqa": "mha.CausalSelfAttention",
    "sliding_window": "mha.CausalSelfAttention",
    "linear": "linear.LinearAttention",
    "mla": "mla.MultiHeadLatentAttention",
}
assert tuple(REGISTRY) == ATTENTIONS, "model/config.py's ATTENTIONS must be these names"


def build_attention(cfg: ModelConfig):
    """The attention module that cfg.attention names."""
    module, name = REGISTRY[cfg.attention].split(".")
    return getattr(importlib.import_module(f"model.attention.{module}"), name)(cfg)
