"""Sampling speed: incremental decoding with the KV cache against recomputing the whole context for
every new token, at the 6-layer, 384-dim, block-256 shape (random weights: speed does not depend on
what the weights know). On CPU by thread count and by position, and what compiling the decoding step
costs and gives; on CUDA at batch 1 and 16, with and without the compiled step (a CUDA graph)."""
import time

import torch

from model.config import ModelConfig
from model.gpt import GPT
from model.sampling import Decoding, generate

SHAPE = dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)


def make_model(device) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**SHAPE)).to(device).eval()


def decode(model, new_tokens: int, use_cache: bool, samples: int = 1, compile: bool = False) -> list[float]:
    """Seconds from the start of a decode (of `samples` continuations of a 1-token prompt) to each of its
    new tokens; the last once the device has made it. On CPU, where decoding checks every token, each
    stamp is the token's; on CUDA only the last is waited for."""
    device = next(model.parameters()).device
    prompt = torch.zeros(samples, 1, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stamps, t0 = [], time.perf_counter()
    for col in generate(model, prompt, new_tokens, temperature=1.0, generator=gen,
                        decoding=Decoding(use_cache=use_cache, compile=compile)):
        stamps.append(time.perf_counter() - t0)
    col.cpu()                                        # wait for the device
    stamps[-1] = time.perf_counter() - t0
    return stamps


def tokens_per_s(model, new_tokens: int, use_cache: bool, samples: int = 1, compile: bool = False) -> float:
    return samples * new_tokens / decode(model, new_tokens, use_cache, samples, compile)[-1]


def ms_per_token_by_position(model, positions, use_cache: bool, reps: int = 3) -> dict[int, float]:
    """ms to produce the token at each position (pos tokens already in context), best of reps decodes on
    CPU: with the cache each token of an actual decode, the cache as warm as in sampling; without it,
    each recomputes the whole context."""
    best = dict.fromkeys(positions, float("inf"))
    for _ in range(reps):
        stamps = decode(model, max(positions), use_cache)
        for pos in positions:   # (the new token i has i + 1 tokens before it)
            best[pos] = min(best[pos], stamps[pos - 1] - stamps[pos - 2])
    return {pos: sec * 1e3 for pos, sec in best.items()}


def bench_sample(new_tokens: int = 500, device: str | torch.device = "cpu", say=print) -> None:
    """tokens/s with and without the cache: on CPU for each thread count up to the current one
    (decoding one token is bound by reading the weights from memory, recomputing by FLOPs: threads
    help only the latter), then ms per token by position, then whether compiling the decoding step
    pays (sample.py decodes eagerly on CPU unless this says otherwise); on CUDA see bench_sample_cuda."""
    if torch.device(device).type == "cuda":
        return bench_sample_cuda(new_tokens, device, say)
    model, threads = make_model(device), torch.get_num_threads()
    say(f"# sampling {new_tokens} new tokens, {SHAPE['n_layer']} layers x {SHAPE['n_embd']}, block "
        f"{SHAPE['block_size']}, batch 1, {device}, fp32")
    say(f"{'threads':>7s} {'cached tok/s':>13s} {'recomputed tok/s':>17s} {'speedup':>8s}")
    for n in range(1, threads + 1):
        torch.set_num_threads(n)
        tokens_per_s(model, 20, True)                            # warm up
        cached, full = tokens_per_s(model, new_tokens, True), tokens_per_s(model, new_tokens, False)
        say(f"{n:7d} {cached:13.1f} {full:17.1f} {cached / full:7.1f}x")
    say(f"{'position':>8s} {'ms/token cached':>16s} {'ms/token recomputed':>20s}   ({threads} threads)")
    positions = (10, 100, 250)
    cached_ms = ms_per_token_by_position(model, positions, True)
    full_ms = ms_per_token_by_position(model, positions, False, reps=1)   # (each token long enough to time once)
    for pos in positions:
        say(f"{pos:8d} {cached_ms[pos]:16.2f} {full_ms[pos]:20.2f}")
    t0 = time.perf_counter()
    tokens_per_s(model, 3, True, compile=True)                   # compiles (inductor, C++)
    compile_s = time.perf_counter() - t0
    rate = tokens_per_s(model, new_tokens, True, compile=True)
    say(f"compiled decoding step: {compile_s:.1f} s to compile, then {rate:.1f} tok/s ({rate / cached:.2f}x eager); "
        f"a {new_tokens}-token sample takes {compile_s + new_tokens / rate:.1f} s with it, "
        f"{new_tokens / cached:.1f} s without")


def bench_sample_cuda(new_tokens: int, device: str, say=print, reps: int = 3) -> None:
    """tokens/s at batch 1 and 16: the compiled decoding step replayed as a CUDA graph, the same
    step eager, and recomputing the context; best of reps runs each (other work only slows a run
    down). Compiling and recording the graph happen in a warm-up run before the timed ones."""
    model = make_model(device)
    say(f"# sampling {new_tokens} new tokens, {SHAPE['n_layer']} layers x {SHAPE['n_embd']}, block "
        f"{SHAPE['block_size']}, {torch.cuda.get_device_name(device)}, fp32, torch {torch.__version__}, best of {reps}")
    say(f"{'batch':>5s} {'compiled tok/s':>15s} {'eager tok/s':>12s} {'recomputed tok/s':>17s} "
        f"{'compiled/eager':>15s} {'compiled/recomputed':>20s} {'compile s':>10s}")
    for batch in (1, 16):
        t0 = time.perf_counter()
        tokens_per_s(model, new_tokens, True, batch, compile=True)   # warm up: compile
        compile_s = time.perf_counter() - t0
        tokens_per_s(model, 20, True, batch)
        tokens_per_s(model, 20, False, batch)
        compiled, eager, full = (max(tokens_per_s(model, new_tokens, use_cache, batch, compile=compile)
                                     for _ in range(reps))
                                 for use_cache, compile in ((True, True), (True, False), (False, False)))
        say(f"{batch:5d} {compiled:15.0f} {eager:12.0f} {full:17.0f} {compiled / eager:14.1f}x "
            f"{compiled / full:19.1f}x {compile_s:10.1f}")


def bench_samples_scaling(device: str = "cpu", new_tokens: int = 100, say=print) -> None:
    """Total tokens/s as more samples share each forward (one batch)."""
    model = make_model(device)
    say(f"sampling time vs number of samples ({new_tokens} new tokens each, KV cache, one batch)")
    say(f"{'samples':>7s} {'seconds':>8s} {'tokens/s':>9s}")
    tokens_per_s(model, 10, True)
    for samples in (1, 4, 16, 64):
        rate = tokens_per_s(model, new_tokens, True, samples)
        say(f"{samples:7d} {samples * new_tokens / rate:8.2f} {rate:9.0f}")
