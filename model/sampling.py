"""Autoregressive sampling: predict the next token, append it, repeat.

With the cache (the default), the prompt goes through the model once (prefill) and every later
step feeds only the newest token, reusing what the attention cached for the earlier ones (their keys
and values; only the last window of them, a latent, or a recurrent state for some variants). When the
context reaches block_size, the window slides: the cache is rebuilt from the last half block of
tokens (positions restart at 0, as learned position embeddings need), so the cost stays amortized
O(1) forwards of one token per step.

The cache has fixed shapes and the position of the new token is a tensor, so every decoding step
runs the same computation on the same buffers: torch.compile turns it into one graph, and on CUDA
into one CUDA graph replayed for every token (at batch 1 a step is a hundred small kernels, and
launching them one by one from Python costs more than running them).
"""
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from model.gpt import GPT, InferenceCache


class SamplingError(ValueError):
    """The model's output cannot be sampled from (its weights are damaged, or it diverged)."""


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). temperature 0 is greedy (argmax). noise (B, V): draws
    of Exponential(1) (draw_noise), the randomness of the choice.

    The logits are shifted so that the largest is 0 before they are divided by the temperature: the
    quotients are <= 0 and cannot overflow, so a temperature near 0 samples like greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if 0 < top_k < logits.size(-1):
        kth_best = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        # nucleus: keep the most likely tokens until their total probability reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = F.softmax(sorted_logits, dim=-1)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p   # the mass before it is enough
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if noise is None:
        noise = draw_noise(*probs.shape, probs.device)
    # The exponential race: token i wins argmax p_i / E_i with probability p_i (E_i / p_i is an
    # exponential of rate p_i, and the smallest of them is the i-th with that probability). The
    # same distribution as torch.multinomial, in ops that compile into the decoding step.
    return (probs / noise).argmax(dim=-1, keepdim=True)


def draw_noise(batch: int, vocab_size: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch, vocab_size) draws of Exponential(1), kept away from 0 (0 / 0 would be nan)."""
    noise = torch.empty(batch, vocab_size, device=device).exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def step(model: GPT, cache: InferenceCache | None, idx: torch.Tensor, pos: torch.Tensor | None,
         noise: torch.Tensor | None, temperature: float, top_k: int, top_p: float):
    """The model on the tokens idx (B, T) at positions pos, then the next token ids (B, 1) and
    whether every logit was finite (a flag on the device, read later: reading it here would make
    the host wait for the device at every token)."""
    logits, _ = model(idx, cache=cache, pos=pos)
    logits = logits[:, -1, :]                                            # (B, V)
    return sample_next(logits, temperature, top_k, top_p, noise), torch.isfinite(logits).all()


def compiled(fn, device: torch.device, warn=lambda msg: print(msg, file=sys.stderr, flush=True)):
    """torch.compile(fn) as one graph: on CUDA with CUDA graphs (mode reduce-overhead), so a call
    is one graph replay. Compiling is lazy, so the first calls (which compile, then record the
    CUDA graph) are tried: a failure there is a one-line warning and fn runs eagerly from then on."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    fast = torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
    trials = 3

    def run(*args):
        nonlocal fast, trials
        if trials == 0:
            return fast(*args)
        try:
            out = fast(*args)
            trials -= 1
            return out
        except Exception as e:   # dynamo, inductor or the C++/Triton toolchain
            reason = (str(e).strip().splitlines() or [""])[0][:160]
            warn(f"warning: compiling the decoding step failed, decoding without it ({type(e).__name__}: {reason})")
            fast, trials = fn, 0
            return fn(*args)
    return run


def default_compile(device: torch.device) -> bool:
    """Compile the decoding step on CUDA only: on CPU, compiling takes longer than it saves on the
    few hundred tokens of a sample (bench.py sample measures both)."""
    return device.type == "cuda"


@torch.inference_mode()   # like no_grad, and skips autograd's version counting too
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
             use_cache: bool = True, cache_dtype: torch.dtype | None = None, compile: bool | None = None,
             check_every: int | None = None) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens next-token columns (B, 1) continuing the prompts idx (B, T).

    compile: compile the one-token decoding step (default: default_compile). Raises SamplingError
    when the logits are not finite; the flags are read every check_every tokens (default: every
    token on CPU, every 32 on a GPU, where each read waits for the device)."""
    block_size, device, batch = model.cfg.block_size, idx.device, idx.size(0)
    check_every = check_every or (1 if device.type == "cpu" else 32)
    compile = default_compile(device) if compile is None else compile
    finite = torch.ones(max_new_tokens, dtype=torch.bool, device=device)   # one flag per new token
    if use_cache:
        cache = InferenceCache(model, batch, device, cache_dtype or next(model.parameters()).dtype)
        decode = step
        if compile:
            for t in cache.tensors():   # buffers updated in place: the CUDA graph may use them as they are
                torch._dynamo.mark_static_address(t)
            decode = compiled(step, device)
        pos = torch.zeros(1, dtype=torch.long, device=device)              # the new token's position
    tokens, filled = idx, 0                                                # filled: positions in the cache
    for i in range(max_new_tokens):
        noise = draw_noise(batch, model.cfg.vocab_size, device, generator) if temperature > 0 else None
        sampling = (noise, temperature, top_k, top_p)
        if not use_cache:
            next_id, ok = step(model, None, tokens[:, -block_size:], None, *sampling)   # recompute the window
        elif filled == 0 or filled == block_size:                          # prefill (the prompt, or a slide)
            keep = min(tokens.size(1), block_size if filled == 0 else max(1, block_size // 2))
            cache.reset()
            next_id, ok = step(model, cache, tokens[:, -keep:], torch.arange(keep, device=device), *sampling)
            filled = keep
        else:                                                              # one new token
            pos.fill_(filled)
            last = next_id.clone()          # not the step's own output, which its CUDA graph's next replay overwrites
            next_id, ok = decode(model, cache, last, pos, *sampling)
            filled += 1
        tokens = torch.cat([tokens, next_id], dim=1)
        finite[i] = ok
        if (i + 1) % check_every == 0 or i + 1 == max_new_tokens:
            check_finite(finite[:i + 1])
        yield tokens[:, -1:]


def check_finite(flags: torch.Tensor) -> None:
    """Raise SamplingError naming the first new token whose logits were not all finite."""
    if not flags.all():
        first = int((~flags).nonzero()[0, 0]) + 1
        raise SamplingError(f"the model's logits are not finite at new token {first}: "
                            "its weights are damaged or the model diverged")
