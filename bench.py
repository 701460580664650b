"""Benchmarks, each in one run whose first line names the machine and its load (ratios
travel; absolute times drift). The figures and their commands: docs/benchmarks/. train, race
and threads also take train.py's --section.key=value settings.

MFU = training FLOPs per second / the best torch.mm rate measured in the run. Per token: 6N
for the N weights of the Linear layers, plus 6 L T C for causal attention (2C each for the
scores and the sum, T/2 pairs on average, x3 with backward).
"""
import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# common first: a Ctrl-C while torch loads is then one quiet line
from common import ROOT, ArgumentParser, UserError, check, run_cli, usable_cores

import torch

from data.prepare import load_meta, prepare
from model import sampling
from model.config import ModelConfig
from model.device import autocast, dtype_name, pick_device, pick_dtype
from model.gpt import GPT
from training import trainer
from training.config import build_config
from viz.curves import read_records

# (classic, fast) by the kind of machine
PAIRS = {
    "cpu": ("configs/shakespeare_char_cpu.toml", "configs/shakespeare_char_cpu_fast.toml"),
    "cuda": ("configs/shakespeare_char.toml", "configs/shakespeare_char_fast.toml"),
}
# what sample decodes: the classic GPU shape, random weights (speed does not depend on them)
SAMPLE_SHAPE = dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)


def machine() -> str:
    # on Linux platform.processor() names only the architecture
    try:
        cpu = re.search(r"model name\s*: (.*)", Path("/proc/cpuinfo").read_text())[1]
    # no such file, or no such line
    except (OSError, TypeError):
        cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown"
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    return (f"# {cpu} x {os.cpu_count()} cores, {gpu} | torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads (OMP_NUM_THREADS {omp}) | load average {load}")


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def matmul_peak(device, dtype) -> float:
    # torch's benchmark loads setuptools: only a measuring command pays for it
    from torch.utils import benchmark
    best = 0.0
    for n in (1024, 2048) if device.type == "cpu" else (4096, 8192):
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        # Timer warms up and waits for the device (one thread unless told)
        timer = benchmark.Timer("mm(a, b)", globals={"mm": torch.mm, "a": a, "b": b},
                                num_threads=torch.get_num_threads())
        seconds = min(timer.blocked_autorange(min_run_time=0.5).times)
        best = max(best, 2 * n ** 3 / seconds)
    return best


def flops_per_token(model) -> tuple[float, float]:
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.cfg
    return 6.0 * n, 6.0 * c.n_layer * c.block_size * c.n_embd


def plain_ms_per_step(cfg, device, steps: int, rounds: int) -> float:
    """The median ms/step of plain PyTorch (eager, fp32, AdamW) on cfg's batch shape."""
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device)
    shape = (cfg.train.batch_size, cfg.model.block_size)
    x = torch.randint(0, cfg.model.vocab_size, shape, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    accum = cfg.train.grad_accum
    ms = []
    for _ in range(rounds + 1):
        start = now(device)
        for _ in range(steps):
            for _ in range(accum):
                _, loss = model(x, x)
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ms.append((now(device) - start) * 1000 / steps)
    return statistics.median(ms[1:])


def bench_train(config: str, overrides: list[str], steps: int, rounds: int) -> int:
    cfg = build_config(config, overrides)
    m, t, device = cfg.model, cfg.train, pick_device(cfg.train.device)
    dtype = pick_dtype(device, t.dtype)
    m.vocab_size = m.vocab_size or load_meta(prepare(cfg.data, m.block_size))["vocab_size"]
    # the config's model, its shapes only
    with torch.device("meta"):
        dense, attn = flops_per_token(GPT(m))
    tokens = t.batch_size * t.grad_accum * m.block_size
    peak = matmul_peak(device, dtype)
    print(f"# {device}, {dtype_name(dtype)} | matmul peak {peak / 1e9:,.1f} GFLOP/s "
          f"(torch.mm, measured now)\n"
          f"# {config}: {m.n_layer} layers x {m.n_embd}, block {m.block_size}, "
          f"batch {t.batch_size} x {t.grad_accum} ({tokens:,} tokens/step) | "
          f"FLOPs/token 6N + attention = {dense / 1e6:.2f}M + {attn / 1e6:.2f}M", flush=True)
    # rounds + 1 log intervals, then one evaluation of one batch and a checkpoint, untimed
    t.log_interval, t.max_steps = steps, steps * (rounds + 1)
    t.eval_interval, t.eval_iters, t.sample_every = t.max_steps, 1, 0
    cfg.log.wandb = cfg.log.curves = False
    with tempfile.TemporaryDirectory(prefix="bench_train_", ignore_cleanup_errors=True) as tmp:
        cfg.out_dir = str(Path(tmp) / "run")
        summary = trainer.train(cfg, quiet=True)
    # a signal stopped it (the trainer said so)
    if summary["exit_code"]:
        return summary["exit_code"]
    warm_up, *timed = (ms for _, ms in summary["intervals"])
    # one model at a time on the GPU
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ours = f"{summary['how']}, {dtype_name(dtype)}; warm-up {warm_up:.1f} ms/step"
    rows = [("trainer", statistics.median(timed), ours),
            ("plain", plain_ms_per_step(cfg, device, steps, rounds),
             "eager, float32, torch.optim.AdamW")]
    print(f"{'step':8s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>6s}  how")
    for name, ms, how in rows:
        per_s = tokens * 1000 / ms
        print(f"{name:8s} {ms:9.2f} {per_s:10,.0f} {(dense + attn) * per_s / peak:6.1%}  {how}")
    print(f"trainer: {rows[1][1] / rows[0][1]:.2f}x plain PyTorch's speed "
          f"(median of {rounds} intervals of {steps} steps, after a warm-up one)")
    return 0


def decode_rate(model, batch: int, new_tokens: int, use_cache: bool, speed_up) -> float:
    """tokens/s of one decode after `batch` one-token prompts, in sample.py's dtype."""
    device = next(model.parameters()).device
    dtype = pick_dtype(device)
    prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    starts = [now(device)]

    def set_up(run, decoder):
        faster = speed_up(run, decoder)
        # timed from here: compiling and recording the CUDA graphs are set-up, not decoding
        starts.append(now(device))
        return faster
    decoding = sampling.Decoding(use_cache=use_cache, cache_dtype=dtype,
                                 speed_up=set_up if speed_up else None)
    with autocast(device, dtype):
        *_, last = sampling.generate(model, prompt, new_tokens, generator=generator,
                                     decoding=decoding)
    last.cpu()
    return batch * new_tokens / (time.perf_counter() - starts[-1])


def bench_sample(device, new_tokens: int) -> int:
    from speed.decoding import compiled
    torch.manual_seed(0)
    s, dtype = SAMPLE_SHAPE, pick_dtype(device)
    model = GPT(ModelConfig(**s)).to(device).eval()
    # what a step reads: the weights as stored, each sequence's cache filled so far (on average)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = model.kv_cache_bytes((1 + min(new_tokens, s["block_size"])) // 2, dtype)
    print(f"# {new_tokens} new tokens after a 1-token prompt | {s['n_layer']} layers x "
          f"{s['n_embd']}, block {s['block_size']}, random weights | {device}, "
          f"{dtype_name(dtype)}, one decode each after a warm-up")
    print(f"{'batch':>5s} {'cached tok/s':>13s} {'recomputed tok/s':>17s} "
          f"{'compiled tok/s':>15s}  ratios")
    ways = ((True, None), (False, None), (True, compiled))
    for batch in (1, 16):
        # a short warm-up (allocations, compiling)
        for way in ways:
            decode_rate(model, batch, 8, *way)
        cached, recomputed, fast = (decode_rate(model, batch, new_tokens, *way) for way in ways)
        print(f"{batch:5d} {cached:13,.1f} {recomputed:17,.1f} {fast:15,.1f}  "
              f"cached {cached / recomputed:.1f}x recomputed, "
              f"compiled {fast / cached:.1f}x cached", flush=True)
        step_bytes = weights + batch * cache
        print(f"{'':5s} memory read: {step_bytes / 1e6:.2f} MB a step (weights "
              f"{weights / 1e6:.2f}, cache {batch} x {cache / 1e6:.2f}): cached "
              f"{step_bytes * cached / batch / 1e9:.1f} GB/s, compiled "
              f"{step_bytes * fast / batch / 1e9:.1f} GB/s", flush=True)
    return 0


def train_py(config: str, args: list[str], env=None) -> tuple[list[dict], str]:
    """(metrics.jsonl's records, stdout) of `python train.py CONFIG ARGS` in a temporary out dir."""
    with tempfile.TemporaryDirectory(prefix="bench_", ignore_cleanup_errors=True) as tmp:
        out_dir = Path(tmp) / "run"
        argv = [sys.executable, str(ROOT / "train.py"), config, *args, f"--out_dir={out_dir}"]
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, errors="replace", env=env)
        if done.returncode:
            raise UserError(f"python train.py {config} failed with exit code {done.returncode}")
        return read_records(out_dir / "metrics.jsonl"), done.stdout


def race(classic: str, fast: str, overrides: list[str]) -> dict:
    """Train classic, then fast: when did fast first reach classic's best val loss, from
    launch, against when classic did."""
    curves = {}
    for label, config in ("classic", classic), ("fast", fast):
        print(f"# {label}: python train.py {' '.join([config, *overrides])}", flush=True)
        # the clock of the records' "time"
        launch = time.time()
        records, _ = train_py(config, overrides)
        curves[label] = [{"step": r["step"], "seconds": r["time"] - launch,
                          "val": r["val_loss"]} for r in records if r["kind"] == "eval"]
        for p in curves[label]:
            print(f"{label:8s} step {p['step']:5d} | {p['seconds']:7.1f} s from launch | "
                  f"val {p['val']:.4f}")
    # a long run may overfit after its best
    best = min(curves["classic"], key=lambda p: p["val"])
    target, last = best["val"], curves["fast"][-1]
    hit = next((p for p in curves["fast"] if p["val"] <= target), None)
    print(f"classic  {classic}: best val {target:.4f} at step {best['step']}, "
          f"{best['seconds']:.1f} s from launch")
    reached = f"never reached val {target:.4f}"
    if hit:
        reached = f"val {hit['val']:.4f} at step {hit['step']}, {hit['seconds']:.1f} s from launch"
    print(f"fast     {fast}: {reached} (it ends at val {last['val']:.4f}, {last['seconds']:.1f} s)")
    # a time ratio in words: 0.49 is 2.04x faster
    if ratio := hit and hit["seconds"] / best["seconds"]:
        words = f"{max(ratio, 1 / ratio):.2f}x " + ("slower" if ratio > 1 else "faster")
        print(f"ratio    fast / classic time from launch to val {target:.4f}: "
              f"{ratio:.3f} ({words})")
    return {"curves": curves, "target": target, "hit": hit, "ratio": ratio}


def ms_per_step(config: str, overrides: list[str], threads: str | None, steps: int) -> tuple:
    """(ms/step of train.py's second log interval, the threads it used) with
    OMP_NUM_THREADS=threads, or unset."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env |= {"OMP_NUM_THREADS": threads} if threads else {}
    settings = [f"--train.max_steps={2 * steps}", f"--train.log_interval={steps}",
                f"--train.eval_interval={2 * steps}", "--train.eval_iters=1",
                "--log.curves=false", "--train.device=cpu"]
    records, out = train_py(config, [*overrides, *settings], env)
    # the banner's "cpu x N threads", then the log's "# threads a -> b"
    used = re.findall(r"cpu x (\d+) thread|# threads \d+ -> (\d+)", out)[-1]
    return [r for r in records if r["kind"] == "train"][-1]["ms_per_step"], used


def bench_threads(config: str, overrides: list[str], steps: int) -> int:
    cores = len(usable_cores())
    print(f"busy | 1 thread ms | {cores} threads ms | default ms (threads) | default / best",
          flush=True)
    for busy in (0, 1, 2):
        spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            (one, _), (every, _), (default, used) = [ms_per_step(config, overrides, threads, steps)
                                                     for threads in ("1", str(cores), None)]
        finally:
            for p in spin:
                p.kill()
                p.wait()
        print(f"{busy:4d} | {one:11.1f} | {every:{len(str(cores)) + 11}.1f} | "
              f"{default:10.1f} ({max(used)}) | {default / min(one, every):.2f}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="the trainer's step against plain PyTorch's")
    t.add_argument("config")
    t.add_argument("--steps", type=int, default=10, help="steps per log interval")
    t.add_argument("--rounds", type=int, default=3, help="timed intervals after a warm-up one")
    s = sub.add_parser("sample", help="tokens/s with and without the KV cache, and compiled")
    s.add_argument("--device", default="auto")
    s.add_argument("--new-tokens", type=int, default=256)
    r = sub.add_parser("race", help="seconds from launch to the classic config's best val")
    classic, fast = PAIRS["cuda" if torch.cuda.is_available() else "cpu"]
    r.add_argument("--classic", default=str(ROOT / classic), help="default: %(default)s")
    r.add_argument("--fast", default=str(ROOT / fast), help="default: %(default)s")
    b = sub.add_parser("threads", help="ms/step by threads, beside busy processes")
    b.add_argument("config", nargs="?", default=str(ROOT / PAIRS["cpu"][0]))
    b.add_argument("--steps", type=int, default=20, help="steps per log interval")
    args, overrides = p.parse_known_args(argv)
    # every check before any work
    if overrides and args.command == "sample":
        p.error(f"unrecognized arguments: {' '.join(overrides)}")
    for option in ("steps", "rounds", "new_tokens"):
        if hasattr(args, option):
            check("--" + option.replace("_", "-"), getattr(args, option), at_least=1)
    if args.command == "sample":
        args.device = pick_device(args.device, setting="--device")
    # a missing file or a bad override: one line
    for name in ("config", "classic", "fast"):
        if hasattr(args, name):
            build_config(getattr(args, name), overrides)
    print(machine(), flush=True)
    if args.command == "train":
        return bench_train(args.config, overrides, args.steps, args.rounds)
    if args.command == "sample":
        return bench_sample(args.device, args.new_tokens)
    if args.command == "threads":
        return bench_threads(args.config, overrides, args.steps)
    race(args.classic, args.fast, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
