"""Training-step throughput: the machine's matmul peak, then a config's ms/step, tokens/s and MFU as
the trainer runs it (on CUDA eager, compiled, CUDA graph and both) against plain PyTorch; and how
step time grows with block size and width.

The trainer's rows time training.trainer.train itself: one warm-up round of --steps steps, then
--rounds rounds, the median round; no log line or evaluation among them, and on CUDA the device
synchronized at round boundaries only, so that a row's ms/step compares with a log line's. After the
last round on_step ends the run by raising (a run without a checkpoint leaves its out dir as it was).

MFU (model FLOPs utilization) = the FLOPs the model needs per second / the matmul peak measured
here. Per token, training needs 6N FLOPs for the N weights used in matmuls (2 forward, 4 backward)
plus 6 L T C for causal attention (the scores and the weighted sum, each 2 C FLOPs per pair of
positions, over T/2 visible positions on average, times 3 for forward and backward).
"""
import contextlib
import copy
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import benchmark

from data.cache import load_meta
from data.prepare import prepare
from model.gpt import GPT
from speed.onednn import onednn_linear, onednn_works
from training.config import build_config
from model.loading import pick_device, pick_dtype
from training.trainer import train


def sync(device: torch.device) -> float:
    """The time once the device has done what it was given."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> dict[str, float]:
    """Best FLOP/s of n x n matmuls over a few sizes, per implementation: torch.mm (MKL on CPU, cuBLAS
    on CUDA) and, on CPU, oneDNN. The best of them is the peak that MFU divides by."""
    impls = {"torch.mm": torch.mm}
    if device.type == "cpu" and onednn_works():
        impls["oneDNN"] = lambda a, b: onednn_linear(a, b, None)     # a @ bᵀ: the same FLOPs
    best = dict.fromkeys(impls, 0.0)
    for n in ((1024, 2048) if device.type == "cpu" else (4096, 8192)):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        for name, mm in impls.items():   # (Timer warms up, waits for the device, and runs on 1 thread unless told)
            timer = benchmark.Timer("mm(a, b)", globals={"mm": mm, "a": a, "b": b}, num_threads=torch.get_num_threads())
            best[name] = max(best[name], 2 * n ** 3 / min(timer.blocked_autorange(min_run_time=seconds).times))
    return best


def flops_per_token(model: GPT) -> tuple[float, float]:
    """(6N, attention) training FLOPs per token; N counts the weights of every Linear (LM head too)."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6.0 * n, 6.0 * model.cfg.n_layer * model.cfg.block_size * model.cfg.n_embd


def plain_step(cfg, device):
    """A training step as plain PyTorch writes it: eager, fp32, torch.optim.AdamW's defaults, over as
    many micro-batches as the config's (train.grad_accum), so that it handles the same tokens per step.
    The reference every measured step is compared with."""
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.block_size), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    accum = cfg.train.grad_accum

    def step():
        for _ in range(accum):
            _, loss = model(x, x)
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, step


class Timed(Exception):
    """Raised from on_step after the last timed round: the run ends there."""


def time_trainer(cfg, out_dir, steps: int, rounds: int, between=None) -> tuple[list[float], float, str]:
    """train(cfg) for one warm-up round and `rounds` timed rounds of `steps` steps: (seconds of each
    timed round, seconds from the call to the end of the warm-up round, how the trainer ran its step:
    device, dtype and kind, in its banner's words). between(), if given, runs untimed at each boundary
    between rounds (bench_train alternates plain PyTorch's rounds with these, so that drift hits both)."""
    cfg, device = copy.deepcopy(cfg), pick_device(cfg.train.device)
    t = cfg.train
    cfg.out_dir, t.max_steps = str(out_dir), max(t.max_steps, steps * (rounds + 1))
    t.log_interval = t.eval_interval = t.max_steps + 1   # no log line or evaluation among the timed steps
    t.sample_every, cfg.log.wandb = 0, False
    starts, ends = [time.perf_counter()], []   # when each round began (the first: the call), when it ended

    def on_step(step, model):
        if step % steps:
            return
        ends.append(sync(device))
        if len(ends) == rounds + 1:
            raise Timed
        if between is not None:
            between()
        starts.append(time.perf_counter())

    said = io.StringIO()   # the banner, which says how the step runs (a graph that failed runs eagerly)
    with contextlib.redirect_stdout(said), contextlib.suppress(Timed):
        train(cfg, on_step=on_step)
    lines = said.getvalue().splitlines()
    for line in lines:
        if line.startswith("warning"):
            print(line, file=sys.stderr)
    how = next((line.split(" | ")[1] for line in lines if " parameters, vocab " in line), "?")
    return [end - start for start, end in zip(starts[1:], ends[1:])], ends[0] - starts[0], how


def bench_train(config: str, overrides: list[str], steps: int = 10, rounds: int = 3, say=print) -> dict:
    """ms/step, tokens/s and MFU of the trainer for a config: on CUDA eager, compiled, CUDA graph and
    both; on CPU as the config says. Each against plain PyTorch (eager fp32, default AdamW)."""
    cfg = build_config(config, overrides)
    device, (m, t) = pick_device(cfg.train.device), (cfg.model, cfg.train)
    dtype = pick_dtype(device, t.dtype)
    m.vocab_size = m.vocab_size or load_meta(prepare(cfg.data, m.block_size))["vocab_size"]
    peaks = matmul_peak(device, dtype)                     # in the dtype the step's matmuls run in
    say(f"# {device}, {torch.get_num_threads()} threads | matmul peak ({str(dtype).removeprefix('torch.')}, "
        f"measured now): " + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in peaks.items()))
    plain_model, plain = plain_step(cfg, device)
    dense, attn = flops_per_token(plain_model)
    tokens = t.batch_size * t.grad_accum * m.block_size
    say(f"# {config}: {m.n_layer} layers x {m.n_embd}, block {m.block_size}, batch {t.batch_size} x "
        f"{t.grad_accum} ({tokens:,} tokens/step) | FLOPs/token 6N + attention = {dense / 1e6:.1f}M + "
        f"{attn / 1e6:.1f}M")
    variants = {"eager": (False, False), "compiled": (True, False), "graph": (False, True),
                "compiled+graph": (True, True)} if device.type == "cuda" else {"trainer": (t.compile, t.cuda_graph)}
    plain()                                                # warm up (allocations)
    times, hows = {"plain": []}, {}   # plain PyTorch's rounds: on CPU between the trainer's, on CUDA after them

    def plain_round():
        start = sync(device)
        for _ in range(steps):
            plain()
        times["plain"].append(sync(device) - start)
    with tempfile.TemporaryDirectory(prefix="bench_train_", ignore_cleanup_errors=True) as tmp:
        for name, (t.compile, t.cuda_graph) in variants.items():
            between = plain_round if device.type != "cuda" else None
            times[name], setup, how = time_trainer(cfg, Path(tmp) / name, steps, rounds, between)
            hows[name] = f"{how}; set-up and warm-up round {setup:.1f} s"
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":   # (one model at a time) a warm-up round, then `rounds`
        for _ in range(rounds + 1):
            plain_round()
        del times["plain"][0]
    hows["plain"], results = "eager, fp32, default AdamW", {}
    say(f"{'step':15s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>6s}  how")
    for name, how in hows.items():
        sec = statistics.median(times[name]) / steps
        mfu = (dense + attn) * tokens / sec / max(peaks.values())
        results[name] = {"ms_per_step": sec * 1e3, "tokens_per_s": tokens / sec, "mfu": mfu}
        say(f"{name:15s} {sec * 1e3:9.2f} {tokens / sec:10,.0f} {mfu:6.1%}  {how}")
    best = min(variants, key=lambda n: results[n]["ms_per_step"])
    say(f"fastest: {best}, {results['plain']['ms_per_step'] / results[best]['ms_per_step']:.2f}x plain PyTorch "
        f"(median of {rounds} rounds of {steps} steps)")
    return {"peaks": peaks, **results}


def bench_scaling(say=print) -> None:
    """Step time of the trainer on CPU as block size grows at a fixed number of tokens per step, then
    as width grows (the fastest of 2 rounds of 2 steps)."""
    def measure(block: int, batch: int, **model) -> tuple[float, float, float]:
        cfg = build_config(None, [f"--model.block_size={block}", f"--train.batch_size={batch}", "--train.device=cpu",
                                  *(f"--model.{k}={v}" for k, v in model.items())])
        cfg.model.vocab_size = load_meta(prepare(cfg.data, block))["vocab_size"]
        with torch.device("meta"):
            dense, attn = flops_per_token(GPT(cfg.model))
        with tempfile.TemporaryDirectory(prefix="bench_scaling_", ignore_cleanup_errors=True) as tmp:
            sec = min(time_trainer(cfg, tmp, 2, 2)[0]) / 2
        return sec * 1e3, attn / (dense + attn), (dense + attn) * block * batch / sec / 1e9

    say("step time vs block size (4 layers x 128, 8,192 tokens/step: the quadratic part grows with T)")
    say(f"{'block':>6s} {'batch':>6s} {'ms/step':>9s} {'attention FLOPs':>16s} {'GFLOP/s':>8s}")
    for block in (64, 128, 256, 512, 1024):
        ms, share, rate = measure(block, 8192 // block)
        say(f"{block:6d} {8192 // block:6d} {ms:9.1f} {share:16.0%} {rate:8.1f}")
    say("step time vs width (4 layers, block 256, batch 16: the weights grow as width^2)")
    say(f"{'n_embd':>6s} {'ms/step':>9s} {'GFLOP/s':>8s}")
    for width in (64, 128, 256, 384, 512):
        ms, _, rate = measure(256, 16, n_embd=width, n_head=max(1, width // 64))
        say(f"{width:6d} {ms:9.1f} {rate:8.1f}")
