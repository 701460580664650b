"""Autoregressive sampling: predict the next token, append it, repeat.

With the cache (the default), the prompt goes through the model once (prefill) and every
later step feeds only the newest token, reusing what the attention cached for the earlier
ones (their keys and values; only the last window of them, a latent, or a recurrent state
for some variants). When the context reaches block_size, the window slides: the cache is
rebuilt from the last half block of tokens (positions restart at 0, as learned position
embeddings need), so the cost stays amortized O(1) forwards of one token per step.

The cache has fixed shapes and the position of the new token is a tensor, so every decoding
step runs the same computation on the same buffers (decode_step): a compiler can turn it
into one graph, and on CUDA into one CUDA graph replayed for every token. generate() takes
that speed-up as a function (Decoding.speed_up, e.g. speed/decoding.py's compiled), so the
model needs nothing from speed/.
"""
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import UserError
from model.gpt import GPT, InferenceCache

# the smallest normal float32
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Choice:
    """How the next token is chosen from the logits (sample_next's settings)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class Decoding:
    """How generate() computes, which never changes the tokens.

    use_cache    reuse the keys and values of earlier tokens (False: recompute the window)
    cache_dtype  the cache's number format (None: the model's)
    check_every  read the finite flags every this many tokens (None: every token on CPU,
                 every 32 on a GPU, where a read waits for the device)
    speed_up     speed_up(decode_step, args) -> a faster function of the same args, which
                 it may call to warm up (the prefill resets the cache after it)"""
    use_cache: bool = True
    cache_dtype: torch.dtype | None = None
    check_every: int | None = None
    speed_up: Callable | None = None


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 is greedy (argmax). noise (B, V):
    draws of Exponential(1) (draw_noise), the randomness of the choice.

    The logits are shifted so that the largest is 0 before they are divided by the
    temperature: the quotients are <= 0 and cannot overflow, so a temperature near 0 samples
    like greedy. A subnormal temperature (below TINY, about 1e-38), which a GPU flushes to 0,
    counts as TINY."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, TINY)
    if 0 < top_k < logits.size(-1):
        kth_best = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        # nucleus: keep the most likely tokens until their total probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = F.softmax(sorted_logits, dim=-1)
        # dropped: a token whose more likely ones already reach top_p
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if noise is None:
        noise = draw_noise(torch.empty_like(probs))
    # The exponential race: token i wins argmax p_i / E_i with probability p_i (E_i / p_i is
    # an exponential of rate p_i, and the smallest of them is the i-th with that
    # probability). The same distribution as torch.multinomial, in ops that compile into the
    # decoding step. The clamp: a draw of 0 would make 0 / 0.
    return (probs / noise.clamp_min(TINY)).argmax(dim=-1, keepdim=True)


def draw_noise(noise: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill noise (B, V) with draws of Exponential(1), in place (where the compiled step
    reads it)."""
    return noise.exponential_(generator=generator)


def step(model: GPT, cache: InferenceCache | None, idx: torch.Tensor, pos: torch.Tensor | None,
         noise: torch.Tensor, choice: Choice, explicit: bool = False):
    """The model on idx (B, T) at positions pos -> (next token ids (B, 1), whether every
    logit was finite). The flag stays on the device: reading it here would make the host
    wait at every token. Only the first V = noise's width tokens are chosen from (a padded
    vocabulary has rows no tokenizer can decode). explicit: softmax attention by its
    explicit steps (model/attention/mha.py)."""
    logits, _ = model(idx, cache=cache, pos=pos, explicit_attention=explicit)
    # (B, V)
    logits = logits[:, -1, :noise.size(-1)]
    c = choice
    next_id = sample_next(logits, c.temperature, c.top_k, c.top_p, noise)
    return next_id, torch.isfinite(logits).all()


def decode_step(model: GPT, cache: InferenceCache, last: torch.Tensor, pos: torch.Tensor,
                noise: torch.Tensor, choice: Choice, explicit: bool = False):
    """One new token: step() on the newest tokens last (B, 1) at position pos (1,), which
    then move on in place. Every call has the same shapes and tensors: one compiled graph,
    one CUDA graph."""
    next_id, ok = step(model, cache, last, pos, noise, choice, explicit)
    last.copy_(next_id)
    pos.add_(1)
    return next_id, ok


# inference_mode: like no_grad, and skips autograd's version counting too
@torch.inference_mode()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int,
             choice: Choice = Choice(), generator: torch.Generator | None = None,
             vocab_limit: int | None = None,
             decoding: Decoding = Decoding()) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens next-token columns (B, 1) continuing the prompts idx (B, T),
    each chosen as `choice` says; `decoding` says how it computes (Decoding).

    vocab_limit: choose only among the first vocab_limit tokens (the tokenizer's vocabulary).
    Raises UserError when the logits are not finite, naming the first new token whose were
    not."""
    block_size, device, batch = model.cfg.block_size, idx.device, idx.size(0)
    use_cache, speed_up = decoding.use_cache, decoding.speed_up
    check_every = decoding.check_every or (1 if device.type == "cpu" else 32)
    # a flag per new token
    finite = torch.ones(max_new_tokens, dtype=torch.bool, device=device)
    vocab = min(vocab_limit or model.cfg.vocab_size, model.cfg.vocab_size)
    # Exponential(1) draws, redrawn per token
    noise = torch.ones(batch, vocab, device=device)
    sampling = (noise, choice)
    if use_cache:
        dtype = decoding.cache_dtype or next(model.parameters()).dtype
        cache = InferenceCache(model, batch, device, dtype)
        # the newest tokens and their position
        last = torch.zeros(batch, 1, dtype=torch.long, device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        args = (model, cache, last, pos, *sampling)
        decode = speed_up(decode_step, args) if speed_up else decode_step
    # filled: positions in the cache
    tokens, filled, checked = idx, 0, 0
    for i in range(max_new_tokens):
        if choice.temperature > 0:
            draw_noise(noise, generator)
        # recompute the window
        if not use_cache:
            next_id, ok = step(model, None, tokens[:, -block_size:], None, *sampling)
        # prefill: the prompt, or a slide
        elif filled == 0 or filled == block_size:
            keep = block_size if filled == 0 else max(1, block_size // 2)
            keep = min(tokens.size(1), keep)
            cache.reset()
            pos_keep = torch.arange(keep, device=device)
            next_id, ok = step(model, cache, tokens[:, -keep:], pos_keep, *sampling)
            filled = keep
            last.copy_(next_id)
            pos.fill_(filled)
        # one new token
        else:
            next_id, ok = decode(*args)
            filled += 1
        tokens = torch.cat([tokens, next_id], dim=1)
        finite[i] = ok
        if (i + 1) % check_every == 0 or i + 1 == max_new_tokens:
            check_finite(finite, checked, i + 1)
            checked = i + 1
        yield tokens[:, -1:]


def check_finite(flags: torch.Tensor, start: int, end: int) -> None:
    """Raise UserError naming the first new token in start..end-1 whose logits were not all
    finite."""
    window = flags[start:end]
    if not window.all():
        first = start + int((~window).nonzero()[0, 0]) + 1
        raise UserError(f"the model's logits are not finite at new token {first}: "
                        "its weights are damaged or the model diverged")


def prompt_ids(tokenizer, text: str, block_size: int, doing: str) -> list[int]:
    """A prompt's token ids (empty: the start token); one past block_size, the most a model
    sees, is said."""
    try:
        ids = tokenizer.encode(text) if text else [tokenizer.start_token]
    except UserError as e:
        raise UserError(f"the prompt has {e}") from None
    if len(ids) > block_size:
        print(f"note: the prompt has {len(ids):,} tokens, the model sees at most "
              f"{block_size}: {doing} the last {block_size}", file=sys.stderr)
    return ids
