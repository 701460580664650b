"""A sweep's results: results.csv and results.md (one row per variant), runs.csv (one row per run) and
loss_curves.png (val loss against step and against wall-clock time, mean over seeds with their spread).

Whether a variant differs from the baseline beyond the seed noise: the seed-to-seed standard deviation
of the final val loss, pooled over all variants (one number, estimated from every seed of every
variant, steadier than each variant's own two or three seeds), gives the standard error of a
difference of two means, σ·√(1/n_variant + 1/n_baseline). A difference larger than twice that is
called beyond the noise (about 95% confidence for one comparison).
"""
import csv
import datetime
import io
import math
import statistics
from pathlib import Path

import numpy as np

from ablation.sweep import Sweep, read_json
from benchmarks.machine import machine
from common import atomic_write
from training.config import flat
from viz.curves import Line, Panel, draw, read_records

NOISE_Z = 2.0
FIGURES = ("final_val", "final_bpb", "best_val", "tokens_per_s", "wall_s", "peak_mem_bytes", "kv_bytes_per_token")


def plural(n: int, word: str) -> str:
    """1 comparison, 2 comparisons."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def read_run(run) -> dict:
    """One run's numbers from its metrics.jsonl and result.json (missing ones are None or nan)."""
    records = read_records(run.dir / "metrics.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    speeds = [r["tokens_per_s"] for r in records if r["kind"] == "train" and "tokens_per_s" in r]
    result, last = read_json(run.dir / "result.json"), evals[-1] if evals else {}
    return {"variant": run.variant, "seed": run.seed, "done": bool(result.get("done")),
            "steps": [r["step"] for r in evals], "val": [r["val_loss"] for r in evals],
            "elapsed": [r.get("elapsed_s", math.nan) for r in evals],
            "final_val": last.get("val_loss", math.nan), "final_bpb": last.get("val_bpb", math.nan),
            "best_val": min((r["val_loss"] for r in evals), default=math.nan),
            "tokens_per_s": statistics.median(speeds) if speeds else math.nan,
            "wall_s": last.get("elapsed_s", math.nan),
            "params": result.get("params"), "kv_bytes_per_token": result.get("kv_cache_bytes_per_token"),
            "peak_mem_bytes": result.get("peak_gpu_bytes") or result.get("peak_rss_bytes"),
            "peak_mem_kind": "GPU allocated" if result.get("peak_gpu_bytes") else "process RSS"}


def mean_std(values) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan, statistics.stdev(values) if len(values) > 1 else math.nan


def summarize(sweep: Sweep, runs: list[dict]) -> list[dict]:
    """One row per variant: the mean and spread of its finished seeds, and its difference from the baseline."""
    rows = []
    for name, overrides in sweep.variants:
        done = [r for r in runs if r["variant"] == name and r["done"]]
        row = {"variant": name, "changes": " ".join(f"{k}={v}" for k, v in flat(overrides).items()) or "(baseline)",
               "seeds_done": len(done), "seeds": len(sweep.seeds), "params": done[0]["params"] if done else None,
               "peak_mem_kind": done[0]["peak_mem_kind"] if done else "", "_final": [r["final_val"] for r in done]}
        for key in FIGURES:
            row[key], row[key + "_std"] = mean_std([r[key] for r in done])
        rows.append(row)
    variances = [statistics.variance(r["_final"]) for r in rows if len(r["_final"]) > 1]
    sigma, base = math.sqrt(statistics.fmean(variances)) if variances else math.nan, rows[0]
    for row in rows:
        n, n0 = len(row["_final"]), len(base["_final"])
        row.update(delta=row["final_val"] - base["final_val"], seed_sigma=sigma,
                   noise_se=sigma * math.sqrt(1 / n + 1 / n0) if n and n0 else math.nan)
        row["beyond_noise"] = "baseline" if row is base else "n/a" if math.isnan(row["noise_se"] + row["delta"]) \
            else "yes" if abs(row["delta"]) > NOISE_Z * row["noise_se"] else "no"
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    """rows as CSV: every column but the lists (a run's curve, a variant's final val losses)."""
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, [k for k, v in rows[0].items() if not isinstance(v, list)], extrasaction="ignore")
    w.writeheader()
    w.writerows({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    atomic_write(path, text.getvalue())


def fmt(x, digits=4, std=None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None and not math.isnan(std) else "")


def write_md(sweep: Sweep, rows: list[dict], out: Path, command: str) -> None:
    cfg = sweep.runs[0].cfg
    t, block, comparisons = cfg.train, cfg.model.block_size, len(rows) - 1
    lines = [
        f"# Ablation: {sweep.name}", "",
        f"`{command}`: {plural(len(sweep.variants), 'variant')} x {plural(len(sweep.seeds), 'seed')} "
        f"({', '.join(map(str, sweep.seeds))}), {t.max_steps} steps of {t.batch_size * t.grad_accum} x {block} tokens "
        f"({t.max_steps * t.batch_size * t.grad_accum * block:,} tokens per run), val loss on "
        f"{f'the same {t.eval_iters} batches' if t.eval_iters else 'every token of the val split'} every "
        f"{t.eval_interval} steps. Machine: {machine()}. Written "
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}.", "",
        "| variant | changes | params | final val loss | val bits/byte | best val loss "
        f"| Δ final vs {rows[0]['variant']} | beyond noise? | tokens/s | wall s | peak mem MB | KV cache B/token |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["params"] is None:
            lines.append(f"| {r['variant']} | {r['changes']} | no finished run | | | | | | | | | |")
            continue
        status = "" if r["seeds_done"] == r["seeds"] else f" ({r['seeds_done']}/{r['seeds']} seeds done)"
        baseline = r["beyond_noise"] == "baseline"
        cells = [f"{r['variant']}{status}", r["changes"], f"{r['params']:,}",
                 fmt(r["final_val"], 4, r["final_val_std"]), fmt(r["final_bpb"]),
                 fmt(r["best_val"], 4, r["best_val_std"]), "" if baseline else fmt(r["delta"]),
                 "" if baseline else r["beyond_noise"], fmt(r["tokens_per_s"], 0), fmt(r["wall_s"], 0),
                 fmt(r["peak_mem_bytes"] / 2**20, 0), fmt(r["kv_bytes_per_token"], 0)]
        lines.append(f"| {' | '.join(cells)} |")
    lines += [
        "", "![val loss curves](loss_curves.png)", "", "How to read it:", "",
        "- **val bits/byte**: the final val loss per byte of text instead of per token (loss x tokens / bytes / ln 2), "
        "comparable across tokenizers (char, gpt2, bpe:N).",
        "- **final / best val loss**: the val loss after the last step / the lowest one seen, mean ± standard "
        "deviation over the seeds. For a given seed every variant saw the same batches in the same order.",
        f"- **Δ** is the variant's mean final val loss minus the baseline's (negative = better). **beyond noise?** "
        f"says whether |Δ| exceeds {NOISE_Z:g} standard errors of a difference of means, with the seed-to-seed "
        f"standard deviation pooled over all variants (σ = {fmt(rows[0]['seed_sigma'])}): "
        f"SE = σ·√(1/n + 1/n_baseline). "
        f"That is about 95% confidence for one comparison; among {plural(comparisons, 'comparison')} about "
        f"{0.05 * comparisons:.1f} may say yes by chance, and a 'no' means not resolved, not equal.",
        "- **tokens/s**: median training throughput over the logged intervals (timings on a shared machine "
        "are noisy). **wall s**: training time of a run, evaluations and checkpoints included.",
        f"- **peak mem**: {rows[0]['peak_mem_kind'] or 'peak memory'} of each run's process (largest over "
        "its attempts if it was resumed), mean over seeds; it includes the memory of Python and torch themselves.",
        "- **KV cache**: bytes a sampler keeps per token of context (all layers, the run's dtype), for a full "
        f"block of {block} tokens. sliding_window's cache stops growing at its window and "
        "linear attention's is a constant-size state: theirs is that size divided by the block.",
        "", "Per-run numbers: runs.csv; every run's log, metrics and checkpoints: <variant>/seed<seed>/."]
    atomic_write(out / "results.md", "\n".join(lines) + "\n")


def plot(sweep: Sweep, runs: list[dict], out: Path) -> None:
    """loss_curves.png: each variant's val loss by step and by wall-clock time, the mean over its seeds
    with the band from the lowest to the highest seed."""
    by_step = Panel("val loss by step", "step", "val loss")
    by_time = Panel("val loss by wall-clock time", "wall-clock seconds (training + evals)", "val loss")
    for i, (name, _) in enumerate(sweep.variants):
        done = [r for r in runs if r["variant"] == name and r["done"] and r["steps"]]
        if not done:
            continue
        n = min(len(r["steps"]) for r in done)
        val = np.array([r["val"][:n] for r in done])                          # (seeds, evals)
        secs = np.array([r["elapsed"][:n] for r in done]).mean(axis=0)
        for panel, x in ((by_step, done[0]["steps"][:n]), (by_time, secs)):
            panel.lines.append(Line(name, x, val.mean(axis=0), val.min(axis=0), val.max(axis=0), emphasis=i == 0))
    title = f"{sweep.name}: mean over {plural(len(sweep.seeds), 'seed')}, shaded min to max"
    atomic_write(out / "loss_curves.png", draw([by_step, by_time], title, legend_below=True))


def write_report(sweep: Sweep, command: str) -> list[dict]:
    """Write results.csv, runs.csv, results.md and loss_curves.png into the sweep's out dir."""
    runs = [read_run(r) for r in sweep.runs]
    rows = summarize(sweep, runs)
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(sweep.out_dir / "results.csv", rows)
    write_csv(sweep.out_dir / "runs.csv", runs)
    write_md(sweep, rows, sweep.out_dir, command)
    plot(sweep, runs, sweep.out_dir)
    return rows
