"""Time to quality: the classic config, then the fast recipe, each run as a user runs it (`python
train.py CONFIG`, in a process of its own), judged on the classic's best val loss.

Each run evaluates and checkpoints every 1/--evals of its steps, and every checkpoint is kept. The
time of an evaluation is when its `eval` line came out, counted from the process's launch: Python's
start, the data, the model and compiling are in it, as a user waits for them. Those in-run
evaluations draw one batch (train.eval_iters = 1), so they cost next to nothing; once the run has
ended the race scores each checkpoint exactly, on every token of the val split (model.gpt.score over
data.loader.strided_windows, as train.eval_iters = 0 does, which would also score the whole train split
at every evaluation). The target is the classic run's best val loss; each run's figure is its first
evaluation at or below it.
"""
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Progress, UserError, on_stop_signals, unwind_on_stop
from data.loader import BatchLoader, strided_windows
from data.prepare import prepare
from model.gpt import score
from model.loading import list_checkpoints, load_model
from training.config import ROOT, build_config
from model.loading import autocast, pick_device, pick_dtype

# (classic, fast) by the kind of machine: `bench.py race` on a GPU races the GPU pair.
PAIRS = {"cpu": ("configs/shakespeare_char_cpu.toml", "configs/shakespeare_char_cpu_fast.toml"),
         "cuda": ("configs/shakespeare_char.toml", "configs/shakespeare_char_fast.toml")}
EVAL_LINE = re.compile(r"^eval +(\d+) \|")
NANOGPT_BEST = 1.4697   # nanoGPT's README: its best val loss on the classic GPU setting (a published figure)


def run(config: str, overrides: list[str], evals: int, out_dir: Path, label: str, say=print) -> list[dict]:
    """Train config in a train.py process; its curve [{step, seconds (from launch), val}], scored afterwards."""
    cfg = build_config(config, overrides)
    every = max(1, cfg.train.max_steps // evals)
    argv = [sys.executable, str(ROOT / "train.py"), config, *overrides, f"--train.eval_interval={every}",
            "--train.eval_iters=1", f"--train.keep_checkpoints={-(-cfg.train.max_steps // every)}",
            "--log.curves=false", f"--out_dir={out_dir}"]
    say(f"# {label}: {shlex.join(['python', 'train.py', config, *overrides])} ({cfg.train.max_steps} steps, an "
        f"evaluation every {every})")
    launch, seconds, progress = time.perf_counter(), {}, Progress(label, cfg.train.max_steps, "steps")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}) as proc:
        try:
            for line in proc.stdout:   # (its stderr, notes and errors, goes where this command's goes)
                if m := EVAL_LINE.match(line):
                    seconds[int(m[1])] = time.perf_counter() - launch
                    progress.advance(int(m[1]) - progress.done)
        except BaseException:   # a signal: the run ends with this command (Popen's exit waits for it)
            proc.kill()
            raise
        finally:
            progress.close()
    if proc.returncode:
        raise UserError(f"the {label} run (python train.py {config}) failed with exit code {proc.returncode}")
    curve = []
    for step, path in list_checkpoints(out_dir):
        curve.append({"step": step, "seconds": seconds[step], "val": exact_val_loss(cfg, path)})
        say(f"{label:8s} step {step:5d} | {seconds[step]:7.1f} s from launch | val {curve[-1]['val']:.4f}")
    return curve


def exact_val_loss(cfg, checkpoint) -> float:
    """The mean loss of a checkpoint's model (or of a run's latest) over every token of cfg's val split
    (as train.eval_iters = 0)."""
    device, block = pick_device(cfg.train.device), cfg.model.block_size
    val = BatchLoader(prepare(cfg.data, block), block, 1).splits["val"]
    nats, count = score(load_model(checkpoint, device).model, strided_windows(val, block, block, cfg.train.batch_size),
                        autocast(device, pick_dtype(device, cfg.train.dtype)))
    return nats / count


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["val"] <= target), None)


def faster_or_slower(ratio: float) -> str:
    """A ratio of times in words: 0.49 -> '2.04x faster', 2.037 -> '2.04x slower'."""
    return "as fast" if ratio == 1 else f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio:.2f}x slower"


def race(classic: str, fast: str, overrides: list[str], evals: int = 20, say=print) -> dict:
    """Train `classic` then `fast`; print and return the figures of the race."""
    with tempfile.TemporaryDirectory(prefix="race_", ignore_cleanup_errors=True) as out, \
            on_stop_signals(unwind_on_stop()):   # a signal ends the run and removes what it wrote
        curves = {label: run(path, overrides, evals, Path(out) / label, label, say)
                  for label, path in (("classic", classic), ("fast", fast))}
    best = min(curves["classic"], key=lambda p: p["val"])   # a long run may overfit after its best
    target, last = best["val"], curves["classic"][-1]
    say(f"classic  {classic}: best val {target:.4f} at step {best['step']}, {best['seconds']:.1f} s from launch"
        + ("" if last is best else f"; it ends at val {last['val']:.4f} after {last['step']} steps"))
    if Path(classic).name == Path(PAIRS["cuda"][0]).name:   # beside it, the figure other repos are judged by
        say(f"nanoGPT  its README's best val loss for this setting: {NANOGPT_BEST} (published, not measured here)")
    hit, end = first_reaching(curves["fast"], target), curves["fast"][-1]
    if hit is None:
        say(f"fast     {fast}: never reached val {target:.4f} (best {min(p['val'] for p in curves['fast']):.4f}, "
            f"{end['seconds']:.1f} s from launch)")
        return {"curves": curves, "target": target, "ratio": math.inf}
    ratio = hit["seconds"] / best["seconds"]
    say(f"fast     {fast}: val {hit['val']:.4f} <= {target:.4f} at step {hit['step']}, {hit['seconds']:.1f} s from "
        f"launch (it ends at val {end['val']:.4f}, {end['seconds']:.1f} s)")
    say(f"ratio    fast / classic time from launch to val {target:.4f}: {ratio:.3f} ({faster_or_slower(ratio)})")
    return {"curves": curves, "target": target, "ratio": ratio, "hit": hit}
