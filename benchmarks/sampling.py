"""Sampling speed: incremental decoding with the KV cache against recomputing the whole context for
every new token, at the 6-layer, 384-dim, block-256 shape (random weights: speed does not depend on
what the weights know)."""
import os
import time

import torch

from model.config import ModelConfig
from model.gpt import GPT, InferenceCache
from model.sampling import generate, use_decoding_layout

SHAPE = dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)


def make_model(device, decoding_layout: bool = True) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**SHAPE)).to(device).eval()
    return use_decoding_layout(model) if decoding_layout else model   # sample.py uses the layout


def tokens_per_s(model, new_tokens: int, use_cache: bool, samples: int = 1) -> float:
    prompt = torch.zeros(samples, 1, dtype=torch.long, device=next(model.parameters()).device)
    gen = torch.Generator(device=prompt.device).manual_seed(0)
    t0 = time.perf_counter()
    for col in generate(model, prompt, new_tokens, temperature=1.0, generator=gen, use_cache=use_cache):
        pass
    col.cpu()                                        # wait for the device
    return samples * new_tokens / (time.perf_counter() - t0)


@torch.inference_mode()
def ms_per_token_by_position(model, positions, use_cache: bool, reps: int = 3) -> dict[int, float]:
    """ms to produce the token at each position (pos tokens already in context), best of reps.

    With the cache, each step of an actual decode from a 1-token prompt is timed, so the cache is
    as warm as in sampling (timing the first step after a fresh prefill would add the cost of
    memory the prefill just displaced). Without it, the whole context is recomputed."""
    device = next(model.parameters()).device
    last = max(positions)
    idx = torch.randint(0, model.cfg.vocab_size, (1, last + 1), generator=torch.Generator().manual_seed(0)).to(device)
    best = {pos: float("inf") for pos in positions}
    for _ in range(reps):
        if use_cache:
            cache = InferenceCache(model, 1, device, torch.float32)
            model(idx[:, :1], cache=cache)
            for pos in range(1, last + 1):
                t0 = time.perf_counter()
                model(idx[:, pos:pos + 1], cache=cache)[0].cpu()
                if pos in best:
                    best[pos] = min(best[pos], time.perf_counter() - t0)
        else:
            for pos in positions:
                t0 = time.perf_counter()
                model(idx[:, :pos + 1])[0].cpu()
                best[pos] = min(best[pos], time.perf_counter() - t0)
    return {pos: sec * 1e3 for pos, sec in best.items()}


def bench_sample(new_tokens: int = 500, device: str = "cpu", say=print) -> dict:
    """tokens/s with and without the cache, for each CPU thread count up to the current one (decoding
    one token is bound by reading the weights from memory, recomputing by FLOPs: threads help only
    the latter), then ms per token by position at the current thread count."""
    model, plain = make_model(device), make_model(device, decoding_layout=False)
    c = model.cfg
    threads = torch.get_num_threads()
    say(f"# sampling {new_tokens} new tokens, {c.n_layer} layers x {c.n_embd}, block {c.block_size}, batch 1, "
        f"{device}, fp32, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    say(f"{'threads':>7s} {'cached tok/s':>13s} {'recomputed tok/s':>17s} {'speedup':>8s} "
        f"{'cached, usual weight layout':>28s}")
    rates = {}
    for n in (range(1, threads + 1) if device == "cpu" else [threads]):
        torch.set_num_threads(n)
        tokens_per_s(model, 20, True)                            # warm up
        tokens_per_s(plain, 20, True)
        cached, full = tokens_per_s(model, new_tokens, True), tokens_per_s(model, new_tokens, False)
        cached_plain = tokens_per_s(plain, new_tokens, True)
        rates[n] = (cached, full, cached_plain)
        say(f"{n:7d} {cached:13.1f} {full:17.1f} {cached / full:7.1f}x {cached_plain:28.1f}")
    torch.set_num_threads(threads)
    say(f"{'position':>8s} {'ms/token cached':>16s} {'ms/token recomputed':>20s}   ({threads} threads)")
    positions = (10, 100, 250)
    cached, full = (ms_per_token_by_position(model, positions, use_cache) for use_cache in (True, False))
    per_pos = {pos: (cached[pos], full[pos]) for pos in positions}
    for pos in positions:
        say(f"{pos:8d} {cached[pos]:16.2f} {full[pos]:20.2f}")
    return {"rates": rates, "per_position": per_pos}


def bench_samples_scaling(device: str = "cpu", new_tokens: int = 100, say=print) -> None:
    """Total tokens/s as more samples share each forward (one batch)."""
    model = make_model(device)
    say(f"sampling time vs number of samples ({new_tokens} new tokens each, KV cache, one batch)")
    say(f"{'samples':>7s} {'seconds':>8s} {'tokens/s':>9s}")
    tokens_per_s(model, 10, True)
    for samples in (1, 4, 16, 64):
        rate = tokens_per_s(model, new_tokens, True, samples)
        say(f"{samples:7d} {samples * new_tokens / rate:8.2f} {rate:9.0f}")
