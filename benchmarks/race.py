"""Time to quality: the classic config, then the fast recipe, in one process, judged on the same text.

Both runs go through training.trainer.train, as `python train.py CONFIG` would run them. After
every `eval_every` steps the race evaluates the model on the same fixed val windows (the whole val
split cut into non-overlapping windows of the classic's block size: no sampling noise at all) and
stops its clock while it does, so the wall times below are training only: data, model and compile
setup included, the race's evaluations and the trainer's final checkpoint excluded. The target is
the classic run's best val loss, and its time is the time it first got there.
"""
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from data.cache import load_meta
from data.loader import consecutive_windows
from data.prepare import prepare
from training.config import build_config
from training.step import mean_loss
from training.trainer import train

# (classic, fast) by the kind of machine: `bench.py race` on a GPU races the GPU pair.
PAIRS = {"cpu": ("configs/shakespeare_char_cpu.toml", "configs/shakespeare_char_cpu_fast.toml"),
         "cuda": ("configs/shakespeare_char.toml", "configs/shakespeare_char_fast.toml")}


def val_windows(dataset: Path, block_size: int) -> torch.Tensor:
    """(N, block_size + 1) int64: the val split as consecutive windows."""
    meta = load_meta(dataset)
    return consecutive_windows(np.memmap(dataset / "val.bin", dtype=meta["dtype"], mode="r"), block_size)


def val_loss(model, windows: torch.Tensor, chunk: int = 128) -> float:
    """Mean next-token cross-entropy over every position of every window (fp32, eval mode)."""
    device = next(model.parameters()).device
    batches = ((w[:, :-1].to(device), w[:, 1:].to(device)) for w in windows.split(chunk))
    return mean_loss(model, batches).item()


def run(cfg, windows: torch.Tensor, eval_every: int, label: str, say=print) -> list[dict]:
    """Train cfg to the end; return the curve [{step, tokens, seconds, val}] at every eval_every steps."""
    curve, paused = [], 0.0
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size

    def on_step(step, model):
        nonlocal paused
        if step % eval_every and step != cfg.train.max_steps:
            return
        now = time.perf_counter()
        point = {"step": step, "tokens": step * tokens_per_step, "seconds": now - start - paused,
                 "val": val_loss(model, windows)}
        curve.append(point)
        say(f"{label:8s} step {step:5d} | {point['tokens']:>10,} tokens | {point['seconds']:6.1f} s | "
            f"val {point['val']:.4f}")
        paused += time.perf_counter() - now

    start = time.perf_counter()
    train(cfg, overwrite=True, quiet=True, on_step=on_step)
    return curve


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["val"] <= target), None)


def race(classic: str, fast: str, overrides: list[str], evals: int = 20, say=print) -> dict:
    """Train `classic` then `fast`; print and return the figures of the race."""
    with tempfile.TemporaryDirectory(prefix="race_", ignore_cleanup_errors=True) as out:
        cfgs = {}
        for label, path in (("classic", classic), ("fast", fast)):
            cfg = build_config(path, overrides + [f"--out_dir={Path(out) / label}"])
            cfg.train.eval_interval = cfg.train.max_steps   # the race evaluates; the trainer only at the end
            cfg.train.eval_iters = 1
            cfgs[label] = cfg
        windows = val_windows(prepare(cfgs["classic"].data), cfgs["classic"].model.block_size)
        say(f"# val: {windows.numel() - len(windows):,} tokens in {len(windows)} windows of "
            f"{windows.size(1) - 1}, the same for both runs; times exclude these evaluations")
        curves = {label: run(cfg, windows, max(1, cfg.train.max_steps // evals), label, say)
                  for label, cfg in cfgs.items()}

    end = min(curves["classic"], key=lambda p: p["val"])   # its best val: a long run may overfit after it
    target = end["val"]
    hit = first_reaching(curves["fast"], target)
    last = curves["classic"][-1]
    after = "" if last is end else f"; it ends at val {last['val']:.4f} after {last['step']} steps"
    say(f"classic  {classic}: best val {target:.4f} at step {end['step']}, {end['tokens']:,} tokens, "
        f"{end['seconds']:.1f} s{after}")
    if hit is None:
        best = min(p["val"] for p in curves["fast"])
        say(f"fast     {fast}: never reached val {target:.4f} (best {best:.4f}, "
            f"{curves['fast'][-1]['seconds']:.1f} s)")
        return {"curves": curves, "target": target, "ratio": math.inf}
    ratio = hit["seconds"] / end["seconds"]
    say(f"fast     {fast}: val {hit['val']:.4f} <= {target:.4f} at step {hit['step']}, {hit['tokens']:,} tokens, "
        f"{hit['seconds']:.1f} s (ends at val {curves['fast'][-1]['val']:.4f}, {curves['fast'][-1]['seconds']:.1f} s)")
    say(f"ratio    fast / classic wall time to val {target:.4f}: {ratio:.3f} "
        f"({1 / ratio:.2f}x faster; tokens {hit['tokens'] / end['tokens']:.2f}x)")
    return {"curves": curves, "target": target, "ratio": ratio, "hit": hit}
