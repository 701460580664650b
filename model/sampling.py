"""Autoregressive sampling: predict the next token, append it, repeat.

With the cache (the default), the prompt goes through the model once (prefill) and every later
step feeds only the newest token, reusing what the attention cached for the earlier ones (their keys
and values; only the last window of them, a latent, or a recurrent state for some variants). When the
context reaches block_size, the window slides: the cache is rebuilt from the last half block of
tokens (positions restart at 0, as learned position embeddings need), so the cost stays amortized
O(1) forwards of one token per step.
"""
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from model.gpt import GPT, InferenceCache


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth_best = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        # nucleus: keep the most likely tokens until their total probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = F.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cum - F.softmax(sorted_logits, dim=-1) >= top_p   # mass before this token already enough
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def use_decoding_layout(model: GPT) -> GPT:
    """Store the blocks' Linear weights (out, in) column-major: the same values, transposed strides.

    Decoding one token makes every Linear a vector-matrix product x Wᵀ, bound by reading W from
    memory. On a 2-core AMD EPYC, MKL streamed Wᵀ stored as (in, out) rows 1.3-1.6x faster than W's
    own rows; on a 2-core Intel Xeon both layouts ran at the same speed (bench.py sample measures
    it). Full-sequence matmuls run as fast either way.
    Training code should not see this model: optimizers expect the usual layout."""
    if next(model.parameters()).device.type == "cpu":
        for module in model.blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()
    return model


@torch.inference_mode()   # like no_grad, and skips autograd's version counting too
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
             use_cache: bool = True, cache_dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens next-token columns (B, 1) continuing the prompts idx (B, T)."""
    block_size = model.cfg.block_size
    tokens, cache = idx, None
    dtype = cache_dtype or next(model.parameters()).dtype
    for _ in range(max_new_tokens):
        if not use_cache:
            logits, _ = model(tokens[:, -block_size:])                   # recompute the whole window
        elif cache is None or cache.pos == block_size:
            keep = block_size if cache is None else max(1, block_size // 2)
            cache = InferenceCache(model, tokens.size(0), tokens.device, dtype)
            logits, _ = model(tokens[:, -keep:], cache=cache)            # prefill
        else:
            logits, _ = model(tokens[:, -1:], cache=cache)               # one new token
        next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)
        tokens = torch.cat([tokens, next_id], dim=1)
        yield next_id
