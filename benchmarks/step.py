"""Training-step throughput: the machine's matmul peak, a config's step time, tokens/s and MFU for each
way the trainer can run its step (eager, compiled, CUDA graph), against plain PyTorch; and how step
time grows with block size and width.

MFU (model FLOPs utilization) = the FLOPs the model needs per second / the matmul peak measured
here. Per token, training needs 6N FLOPs for the N weights used in matmuls (2 forward, 4 backward)
plus 6 L T C for causal attention (the scores and the weighted sum, each 2 C FLOPs per pair of
positions, over T/2 visible positions on average, times 3 for forward and backward).
"""
import copy
import tempfile
import time
from pathlib import Path

import torch

from model.gpt import GPT
from speed.onednn import onednn_linear, onednn_works
from training.config import build_config
from training.runtime import pick_device, pick_dtype, sync, use_fast_matmuls
from training.run import build_step, join_world, set_up


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> dict[str, float]:
    """Best FLOP/s of n x n matmuls over a few sizes, per implementation: torch.mm (MKL on CPU, cuBLAS
    on CUDA) and, on CPU, oneDNN. The best of them is the peak that MFU divides by."""
    impls = {"torch.mm": torch.mm}
    if device.type == "cpu" and onednn_works():
        impls["oneDNN"] = lambda a, b: onednn_linear(a, b, None)     # a @ bᵀ: the same FLOPs
    best = {name: 0.0 for name in impls}
    for n in ((1024, 2048) if device.type == "cpu" else (4096, 8192)):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        reps = max(2, int(seconds * 1e11 / (2 * n ** 3))) if device.type == "cpu" else 20
        for _ in range(3):
            for name, mm in impls.items():
                mm(a, b)   # warm up
                best[name] = max(best[name], 2 * n ** 3 / time_step(lambda: mm(a, b), device, reps))
    return best


def flops_per_token(model: GPT) -> tuple[float, float]:
    """(6N, attention) training FLOPs per token; N counts the weights of every Linear (LM head too)."""
    cfg = model.cfg
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6.0 * n, 6.0 * cfg.n_layer * cfg.block_size * cfg.n_embd


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


def trainer_step(cfg, out_dir, compile: bool, graph: bool):
    """The trainer's own step (training/step.py) for cfg with these two switches, on real batches, at
    the peak learning rate."""
    cfg = copy.deepcopy(cfg)
    cfg.train.compile, cfg.train.cuda_graph, cfg.out_dir = compile, graph, str(out_dir)
    run, _ = set_up(cfg, join_world(pick_device(cfg.train.device)), resume=False, overwrite=True, quiet=True)
    build_step(run)
    return run.model, run.train_step


def variants_for(cfg, device) -> dict:
    """{name: (compile, graph)}: on CUDA every combination of the two switches; on CPU the config's."""
    if device.type == "cuda":
        return {"eager": (False, False), "compiled": (True, False), "graph": (False, True),
                "compiled+graph": (True, True)}
    return {"trainer": (cfg.train.compile, False)}


def time_step(step, device, steps: int) -> float:
    """Seconds per step over `steps` back-to-back steps."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def bench_train(config: str, overrides: list[str], steps: int = 10, rounds: int = 3, say=print) -> dict:
    """ms/step, tokens/s and MFU of the trainer's step for a config: on CUDA eager, compiled, CUDA graph
    and both; on CPU the config's step. Each against plain PyTorch (eager fp32, default AdamW)."""
    cfg = build_config(config, overrides)
    device = pick_device(cfg.train.device)
    dtype = pick_dtype(device, cfg.train.dtype)
    use_fast_matmuls(device)
    peaks = matmul_peak(device, dtype)                     # in the dtype the step's matmuls run in
    peak = max(peaks.values())
    say(f"# {device}, {torch.get_num_threads()} threads | matmul peak ({str(dtype).removeprefix('torch.')}, "
        f"measured now): " + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in peaks.items()))
    results, times, hows, pending = {}, {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_train_", ignore_cleanup_errors=True) as tmp:
        for name, (compile, graph) in variants_for(cfg, device).items():
            t0 = time.perf_counter()
            model, step = trainer_step(cfg, Path(tmp) / name, compile, graph)
            cfg.model.vocab_size = cfg.model.vocab_size or model.cfg.vocab_size   # as the data gave it
            hows[name] = f"{step.kind}{', compiled' if compile else ''}, setup {time.perf_counter() - t0:.1f} s"
            if device.type == "cuda":   # one variant at a time on the GPU (memory), timed at once
                step()
                times[name] = [time_step(step, device, steps) for _ in range(rounds)]
                del model, step
                torch.cuda.empty_cache()
            else:
                pending[name] = step
        plain_model, pending["plain"] = plain_step(cfg, device)
        hows["plain"] = "eager, fp32, default AdamW"
        dense, attn = flops_per_token(plain_model)
        m, t = cfg.model, cfg.train
        tokens = t.batch_size * t.grad_accum * m.block_size
        say(f"# {config}: {m.n_layer} layers x {m.n_embd}, block {m.block_size}, batch {t.batch_size} x "
            f"{t.grad_accum} ({tokens:,} tokens/step) | FLOPs/token 6N + attention = {dense / 1e6:.1f}M + "
            f"{attn / 1e6:.1f}M")
        for step in pending.values():
            step()                                            # warm up (allocations, autotuning)
        for _ in range(rounds):                               # alternate, so drift hits all alike
            for name, step in pending.items():
                times.setdefault(name, []).append(time_step(step, device, steps))
    say(f"{'step':15s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>6s}  how")
    for name, how in hows.items():
        sec = sorted(times[name])[len(times[name]) // 2]   # the median round
        achieved = (dense + attn) * tokens / sec
        results[name] = {"ms_per_step": sec * 1e3, "tokens_per_s": tokens / sec, "mfu": achieved / peak}
        say(f"{name:15s} {sec * 1e3:9.2f} {tokens / sec:10,.0f} {achieved / peak:6.1%}  {how}")
    best = min((n for n in results if n != "plain"), key=lambda n: results[n]["ms_per_step"])
    say(f"fastest: {best}, {results['plain']['ms_per_step'] / results[best]['ms_per_step']:.2f}x plain PyTorch "
        f"(median of {rounds} rounds of {steps} steps)")
    return {"peaks": peaks, **results}


def bench_scaling(device: str = "cpu", say=print) -> None:
    """Step time as block size grows at a fixed number of tokens per step, then as width grows."""
    device = torch.device(device)

    def ms_per_step(**model_kw) -> tuple[float, float]:
        block, batch = model_kw.pop("block_size"), model_kw.pop("batch_size")
        cfg = build_config(None, [f"--model.block_size={block}", f"--train.batch_size={batch}",
                                  "--train.device=" + device.type] + [f"--model.{k}={v}" for k, v in model_kw.items()])
        with tempfile.TemporaryDirectory(prefix="bench_scaling_", ignore_cleanup_errors=True) as tmp:
            model, step = trainer_step(cfg, tmp, compile=False, graph=False)
            step()
            dense, attn = flops_per_token(model)
            sec = min(time_step(step, device, 2) for _ in range(2))
        return sec * 1e3, attn / (dense + attn), (dense + attn) * block * batch / sec / 1e9

    say("step time vs block size (4 layers x 128, 8,192 tokens/step: the quadratic part grows with T)")
    say(f"{'block':>6s} {'batch':>6s} {'ms/step':>9s} {'attention FLOPs':>16s} {'GFLOP/s':>8s}")
    for block in (64, 128, 256, 512, 1024):
        ms, share, rate = ms_per_step(block_size=block, batch_size=8192 // block)
        say(f"{block:6d} {8192 // block:6d} {ms:9.1f} {share:16.0%} {rate:8.1f}")
    say("step time vs width (4 layers, block 256, batch 16: the weights grow as width^2)")
    say(f"{'n_embd':>6s} {'ms/step':>9s} {'GFLOP/s':>8s}")
    for width in (64, 128, 256, 384, 512):
        ms, _, rate = ms_per_step(block_size=256, batch_size=16, n_embd=width, n_head=max(1, width // 64))
        say(f"{width:6d} {ms:9.1f} {rate:8.1f}")
