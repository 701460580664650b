"""Autoregressive sampling: predict the next token, append it, repeat.

With the cache (the default), the prompt runs once, then each step feeds only the newest
token; at block_size the cache is rebuilt from the last half block (positions from 0).
"""
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import UserError
from model.gpt import GPT, InferenceCache

TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Choice:
    """How the next token is chosen from the logits (sample_next's)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class Decoding:
    """How generate() computes, never which tokens. check_every: tokens between reads of the
    finite flags."""
    use_cache: bool = True
    cache_dtype: torch.dtype | None = None
    check_every: int | None = None
    speed_up: Callable | None = None


def sample_next(logits: torch.Tensor, choice: Choice, noise: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1); temperature 0 is greedy. noise (B, V): draws of
    Exponential(1). Logits shifted to a maximum of 0 cannot overflow; a subnormal temperature
    (0 on a GPU) counts as TINY."""
    if choice.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(choice.temperature, TINY)
    if 0 < choice.top_k < logits.size(-1):
        kth_best = torch.topk(logits, choice.top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if choice.top_p < 1.0:
        # nucleus: drop a token whose more likely ones already reach top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = F.softmax(sorted_logits, dim=-1)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= choice.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    # The exponential race: the smallest E_i / p_i is the i-th with probability p_i, as
    # torch.multinomial draws, in ops that compile. A draw of 0 would make 0 / 0.
    return (probs / noise.clamp_min(TINY)).argmax(dim=-1, keepdim=True)


def step(model: GPT, cache: InferenceCache | None, idx: torch.Tensor, pos: torch.Tensor | None,
         noise: torch.Tensor, choice: Choice, explicit: bool = False):
    """idx (B, T) at positions pos -> (next ids (B, 1) among the first noise.size(-1), whether
    the logits were all finite, on the device)."""
    logits, _ = model(idx, cache=cache, pos=pos, explicit_attention=explicit)
    logits = logits[:, -1, :noise.size(-1)]
    next_id = sample_next(logits, choice, noise)
    return next_id, torch.isfinite(logits).all()


def decode_step(model: GPT, cache: InferenceCache, last: torch.Tensor, pos: torch.Tensor,
                noise: torch.Tensor, choice: Choice, explicit: bool = False):
    """step() on the newest tokens, then last and pos moved on in place."""
    next_id, ok = step(model, cache, last, pos, noise, choice, explicit)
    last.copy_(next_id)
    pos.add_(1)
    return next_id, ok


class Decoder:
    """The cache and the tensors decoding updates in place, at fixed addresses as a CUDA
    graph needs: the newest tokens `last` (B, 1) at `pos` (1,), the noise (B, V)."""

    def __init__(self, model: GPT, batch: int, vocab: int, sampling: tuple, dtype):
        device = next(model.parameters()).device
        self.model = model
        self.choice, self.generator = sampling
        # run lengths, longest first: 1 streams each token once chosen (speed/decoding.py's
        # CUDA graphs replay longer runs)
        self.sizes = [1]
        self.cache = InferenceCache(model, batch, device, dtype) if dtype else None
        self.last = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.noise = torch.ones(batch, vocab, device=device)
        self.args = (model, self.cache, self.last, self.pos, self.noise, self.choice)
        # what speed_up compiles
        self.step = decode_step

    def draw(self) -> None:
        if self.choice.temperature > 0:
            self.noise.exponential_(generator=self.generator)

    def prefill(self, idx: torch.Tensor):
        """step() on idx (B, T) from position 0: the prompt, a slide, an uncached step."""
        self.draw()
        if self.cache is not None:
            self.cache.reset()
        next_id, ok = step(self.model, self.cache, idx, None, self.noise, self.choice)
        self.last.copy_(next_id)
        self.pos.fill_(idx.size(1))
        return next_id, ok

    def run(self, n: int):
        """n new tokens -> (their ids (B, n), finite flags (n,))."""
        steps = []
        for _ in range(n):
            self.draw()
            steps.append(self.step(*self.args))
        ids, flags = zip(*steps)
        return torch.cat(ids, dim=1), torch.stack(flags)


@torch.inference_mode()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int,
             choice: Choice = Choice(), generator: torch.Generator | None = None,
             vocab_limit: int | None = None,
             decoding: Decoding = Decoding()) -> Iterator[torch.Tensor]:
    """Yield max_new_tokens columns (B, 1) continuing the prompts idx (B, T), among the first
    vocab_limit tokens: the same draws in the same order whatever the runs."""
    block, device = model.cfg.block_size, idx.device
    check_every = decoding.check_every or (1 if device.type == "cpu" else 32)
    finite = torch.ones(max_new_tokens, dtype=torch.bool, device=device)
    vocab = min(vocab_limit or model.cfg.vocab_size, model.cfg.vocab_size)
    dtype = decoding.cache_dtype or next(model.parameters()).dtype
    decoder = Decoder(model, idx.size(0), vocab, (choice, generator),
                      dtype if decoding.use_cache else None)
    if decoding.use_cache and decoding.speed_up:
        decoder.run = decoding.speed_up(decoder.run, decoder)
    # filled: positions cached; i: tokens yielded; checked: tokens whose flags were read
    tokens, filled, i, checked = idx, 0, 0, 0
    while i < max_new_tokens:
        if decoder.cache is None or filled in (0, block):
            keep = min(tokens.size(1), block if filled == 0 else max(1, block // 2))
            new, ok = decoder.prefill(tokens[:, -keep:])
            filled = keep if decoder.cache is not None else 0
        else:
            room = min(block - filled, max_new_tokens - i)
            new, ok = decoder.run(next(n for n in decoder.sizes if n <= room))
            filled += new.size(1)
        n = new.size(1)
        tokens = torch.cat([tokens, new], dim=1)[:, -block:]
        finite[i:i + n] = ok
        # tokens' copies: a CUDA graph's replay overwrites the new ids it returned before
        for column in tokens[:, -n:].split(1, dim=1):
            i += 1
            if i % check_every == 0 or i == max_new_tokens:
                # only the flags since the last read: a long sample stays linear
                if not (window := finite[checked:i]).all():
                    first = checked + int((~window).nonzero()[0, 0]) + 1
                    raise UserError(f"the model's logits are not finite at new token {first}: "
                                    "its weights are damaged or the model diverged")
                checked = i
            yield column


def prompt_ids(tokenizer, text: str, block_size: int, doing: str) -> list[int]:
    """A prompt's token ids (empty: the start token); one past block_size is said."""
    try:
        ids = tokenizer.encode(text) if text else [tokenizer.start_token]
    except UserError as e:
        raise UserError(f"the prompt has {e}") from None
    if len(ids) > block_size:
        print(f"note: the prompt has {len(ids):,} tokens, the model sees at most "
              f"{block_size}: {doing} the last {block_size}", file=sys.stderr)
    return ids
