"""Training-step throughput: the machine's matmul peak, a config's step time, tokens/s and MFU, with
and without the throughput levers; and how step time grows with block size and width.

MFU (model FLOPs utilization) = the FLOPs the model needs per second / the matmul peak measured
here. Per token, training needs 6N FLOPs for the N weights used in matmuls (2 forward, 4 backward)
plus 6 L T C for causal attention (the scores and the weighted sum, each 2 C FLOPs per pair of
positions, over T/2 visible positions on average, times 3 for forward and backward).
"""
import time
from contextlib import nullcontext

import torch

from model.gpt import GPT
from training.config import build_config
from training.optim import build_optimizer
from training.compile import compile_model
from training.onednn import onednn_linear, onednn_works, use_onednn_linears
from training.runtime import autocast as autocast_for, pick_device, pick_dtype, sync, use_fast_matmuls

CHAR_VOCAB = 65   # tinyshakespeare's characters: the vocabulary when a config leaves it to the data


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> dict[str, float]:
    """Best FLOP/s of n x n matmuls over a few sizes, per implementation: torch.mm (MKL on CPU, cuBLAS
    on CUDA) and, on CPU, oneDNN. The best of them is the peak that MFU divides by."""
    impls = {"torch.mm": lambda a, b: torch.mm(a, b)}
    if device.type == "cpu" and onednn_works():
        impls["oneDNN"] = lambda a, b: onednn_linear(a, b, None)     # a @ bᵀ: the same FLOPs
    best = {name: 0.0 for name in impls}
    for n in ((1024, 2048) if device.type == "cpu" else (4096, 8192)):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        reps = max(2, int(seconds * 1e11 / (2 * n ** 3))) if device.type == "cpu" else 20
        for _ in range(3):
            for name, mm in impls.items():
                mm(a, b)
                sync(device)
                t0 = time.perf_counter()
                for _ in range(reps):
                    mm(a, b)
                sync(device)
                best[name] = max(best[name], 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def flops_per_token(model: GPT) -> tuple[float, float]:
    """(6N, attention) training FLOPs per token; N counts the weights of every Linear (LM head too)."""
    cfg = model.cfg
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6.0 * n, 6.0 * cfg.n_layer * cfg.block_size * cfg.n_embd


def make_step(cfg, device, dtype, levers: bool):
    """A closure running one training step of cfg, with the levers or as plain eager PyTorch would."""
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    t = cfg.train
    x = torch.randint(0, cfg.model.vocab_size, (t.batch_size, cfg.model.block_size), device=device)
    if levers:
        autocast = autocast_for(device, dtype)
        if t.onednn:
            use_onednn_linears(model, device, dtype)
        optimizer = build_optimizer(model, t, device)
        forward = compile_model(model, tuple(x.shape), cfg.model.vocab_size, autocast) if t.compile else model
    else:
        autocast, forward = nullcontext(), model
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr)   # the default: a loop over tensors

    def step():
        with autocast:
            _, loss = forward(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, step


def time_step(step, device, steps: int) -> float:
    """Seconds per step over `steps` back-to-back steps."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def bench_train(config: str, overrides: list[str], steps: int = 10, rounds: int = 3, say=print) -> dict:
    cfg = build_config(config, overrides)
    cfg.model.vocab_size = cfg.model.vocab_size or CHAR_VOCAB
    device = pick_device(cfg.train.device)
    dtype = pick_dtype(device, cfg.train.dtype)
    use_fast_matmuls(device)
    peaks = matmul_peak(device, dtype)                     # in the dtype the step's matmuls run in
    peak = max(peaks.values())
    m = cfg.model
    say(f"# {device}, {torch.get_num_threads()} threads | matmul peak ({str(dtype).removeprefix('torch.')}, "
        f"measured now): " + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP/s" for k, v in peaks.items()))

    variants = {}
    t0 = time.perf_counter()
    variants["levers"] = make_step(cfg, device, dtype, levers=True)
    setup = time.perf_counter() - t0
    variants["plain"] = make_step(cfg, device, dtype, levers=False)
    dense, attn = flops_per_token(variants["plain"][0])
    tokens = cfg.train.batch_size * m.block_size
    say(f"# {config}: {m.n_layer} layers x {m.n_embd}, block {m.block_size}, batch {cfg.train.batch_size} "
        f"({tokens:,} tokens/step) | FLOPs/token 6N + attention = {dense / 1e6:.1f}M + {attn / 1e6:.1f}M")
    onednn = cfg.train.onednn and onednn_works() and device.type == "cpu" and dtype == torch.float32
    levers = (f"{'compiled' if cfg.train.compile else 'eager'}, {cfg.train.optimizer} (fused AdamW), "
              f"{str(dtype).removeprefix('torch.')}{', oneDNN linears' if onednn else ''}")
    say(f"# levers: {levers} (setup incl. compile {setup:.1f} s) | plain: eager, default AdamW, float32")

    best = {name: float("inf") for name in variants}
    for _, step in variants.values():
        step()                                                # warm up (allocations, autotuning)
    for _ in range(rounds):                                   # alternate, so drift hits both alike
        for name, (_, step) in variants.items():
            best[name] = min(best[name], time_step(step, device, steps))
    results = {}
    say(f"{'':8s} {'ms/step':>9s} {'tokens/s':>10s} {'GFLOP/s':>9s} {'MFU':>6s}")
    for name, sec in best.items():
        achieved = (dense + attn) * tokens / sec
        results[name] = {"ms_per_step": sec * 1e3, "tokens_per_s": tokens / sec, "flops": achieved, "mfu": achieved / peak}
        say(f"{name:8s} {sec * 1e3:9.1f} {tokens / sec:10,.0f} {achieved / 1e9:9.1f} {achieved / peak:6.1%}")
    say(f"speedup of the levers: {best['plain'] / best['levers']:.2f}x tokens/s "
        f"(best of {rounds} alternating rounds of {steps} steps)")
    return {"peaks": peaks, **results}


def bench_scaling(device: str = "cpu", say=print) -> None:
    """Step time as block size grows at a fixed number of tokens per step, then as width grows."""
    device = torch.device(device)

    def ms_per_step(**model_kw) -> tuple[float, float]:
        block, batch = model_kw.pop("block_size"), model_kw.pop("batch_size")
        cfg = build_config(None, [f"--model.block_size={block}", f"--train.batch_size={batch}",
                                  f"--model.vocab_size={CHAR_VOCAB}", "--train.device=" + device.type]
                           + [f"--model.{k}={v}" for k, v in model_kw.items()])
        model, step = make_step(cfg, device, torch.float32, levers=True)
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
