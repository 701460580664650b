"""A sweep's results: results.csv and .md (a row per variant), runs.csv, loss_curves.png."""
import csv
import io
import os
import platform
import statistics
from math import isnan, nan, sqrt

import numpy as np
import torch

from ablation.sweep import read_json
from common import atomic_write, flat
from viz.curves import Line, Panel, draw, read_records

# a difference beyond this many standard errors is beyond the noise
NOISE_Z = 2.0
FIGURES = ("final_val", "tokens_per_s", "wall_s", "peak_gpu_bytes", "kv_bytes_per_token")
HEADER = ("| variant | changes | params | final val loss | Δ vs baseline | beyond noise? "
          "| tokens/s | wall s | peak GPU MB | KV cache B/token |\n"
          "|---|---|--:|--:|--:|:-:|--:|--:|--:|--:|")


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def read_run(run) -> dict:
    """One run's numbers; one it lacks is None or NaN."""
    records = read_records(run.dir / "metrics.jsonl")
    result = read_json(run.dir / "result.json")
    evals = [r for r in records if r["kind"] == "eval"]
    speeds = [r["tokens_per_s"] for r in records if r["kind"] == "train" and "tokens_per_s" in r]
    last = evals[-1] if evals else {}
    sizes = {k: result.get(k) for k in ("params", "peak_gpu_bytes", "kv_bytes_per_token")}
    return {"variant": run.variant, "seed": run.seed, "done": result.get("done") is True,
            "steps": [r["step"] for r in evals], "val": [r["val_loss"] for r in evals],
            "elapsed": [r.get("elapsed_s", nan) for r in evals],
            "final_val": last.get("val_loss", nan), "wall_s": last.get("elapsed_s", nan),
            "tokens_per_s": statistics.median(speeds or [nan]), **sizes}


def summarize(sweep, runs: list[dict]) -> list[dict]:
    """A row per variant: means over its finished seeds, its difference from the baseline,
    whether beyond the noise."""
    rows = []
    for name, values in sweep.variants:
        done = [r for r in runs if r["variant"] == name and r["done"]]
        finals = [r["final_val"] for r in done]
        row = {"variant": name, "changes": " ".join(f"{k}={v}" for k, v in flat(values).items()),
               "seeds_done": len(done), "seeds": len(sweep.seeds),
               "params": (done or [{}])[0].get("params"), "_final": finals}
        for key in FIGURES:
            known = [r[key] for r in done if r[key] is not None]
            row[key] = statistics.fmean(known) if known else nan
        row["final_val_std"] = statistics.stdev(finals) if len(done) > 1 else nan
        rows.append(row)
    variances = [statistics.variance(r["_final"]) for r in rows if len(r["_final"]) > 1]
    sigma = sqrt(statistics.fmean(variances)) if variances else nan
    base = rows[0]
    for row in rows:
        n, n0 = len(row["_final"]), len(base["_final"])
        se = sigma * sqrt(1 / n + 1 / n0) if n * n0 else nan
        delta = row["final_val"] - base["final_val"]
        verdict = "n/a" if isnan(se + delta) else "yes" if abs(delta) > NOISE_Z * se else "no"
        row.update(delta=delta, sigma=sigma, noise_se=se,
                   beyond_noise="baseline" if row is base else verdict)
    return rows


def write_csv(path, rows: list[dict]) -> None:
    text = io.StringIO(newline="")
    columns = [k for k, v in rows[0].items() if not isinstance(v, list)]
    w = csv.DictWriter(text, columns, "", "ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in r.items()})
    atomic_write(path, text.getvalue())


def fmt(x, digits=0, std=nan) -> str:
    if x is None or isnan(x):
        return "—"
    return f"{x:.{digits}f}" + ("" if isnan(std) else f" ± {std:.{digits}f}")


def table_row(r: dict) -> str:
    partial = 0 < r["seeds_done"] < r["seeds"]
    seeds = f" ({r['seeds_done']}/{r['seeds']} seeds)" if partial else ""
    base = r["beyond_noise"] == "baseline"
    cells = [r["variant"] + seeds, r["changes"] or "(baseline)"]
    if r["params"] is None:
        cells.append("no finished run")
    else:
        cells += [f"{r['params']:,}", fmt(r["final_val"], 4, r["final_val_std"]),
                  "" if base else fmt(r["delta"], 4), "" if base else r["beyond_noise"],
                  fmt(r["tokens_per_s"]), fmt(r["wall_s"]),
                  fmt(r["peak_gpu_bytes"] / 2**20), fmt(r["kv_bytes_per_token"])]
    return f"| {' | '.join(cells)} |"


def write_md(sweep, rows: list[dict], command: str) -> None:
    cfg = sweep.runs[0].cfg
    t, comparisons = cfg.train, len(rows) - 1
    tokens = t.batch_size * t.grad_accum * cfg.model.block_size
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    machine = (f"{platform.platform(terse=True)}, {os.cpu_count()} CPU cores, {gpu}, "
               f"torch {torch.__version__}")
    note = (f"±: the seeds' standard deviation. Beyond noise: "
            f"|Δ| > {NOISE_Z:g} σ·√(1/n + 1/n_baseline), "
            f"σ = {fmt(rows[0]['sigma'], 4)} pooled over all variants' seeds: about 95% "
            f"confidence for one comparison; among {plural(comparisons, 'comparison')} "
            f"about {0.05 * comparisons:.1f} may say yes by chance, and 'no' is not resolved, "
            f"not equal (python ablate.py --help).")
    lines = [f"# Ablation: {sweep.name}", "",
             f"`{command}`: {t.max_steps} steps of {tokens:,} tokens a run. {machine}.", "",
             HEADER, *map(table_row, rows), "", "![val loss curves](loss_curves.png)", "", note]
    atomic_write(sweep.out_dir / "results.md", "\n".join(lines) + "\n")


def plot(sweep, runs: list[dict]) -> None:
    by_step = Panel("val loss by step", "step", "val loss")
    by_time = Panel("val loss by wall-clock time", "wall-clock seconds (training + evals)",
                    "val loss")
    for i, (name, _) in enumerate(sweep.variants):
        done = [r for r in runs if r["variant"] == name and r["done"] and r["steps"]]
        if not done:
            continue
        n = min(len(r["steps"]) for r in done)
        # (seeds, evaluations)
        val = np.array([r["val"][:n] for r in done])
        secs = np.array([r["elapsed"][:n] for r in done]).mean(axis=0)
        for panel, x in ((by_step, done[0]["steps"][:n]), (by_time, secs)):
            line = Line(name, x, val.mean(0), val.min(0), val.max(0), emphasis=i == 0)
            panel.lines.append(line)
    title = f"{sweep.name}: mean over {plural(len(sweep.seeds), 'seed')}, shaded min to max"
    picture = draw([by_step, by_time], title, legend_below=True)
    atomic_write(sweep.out_dir / "loss_curves.png", picture)


def write_report(sweep, command: str) -> None:
    runs = [read_run(r) for r in sweep.runs]
    rows = summarize(sweep, runs)
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(sweep.out_dir / "results.csv", rows)
    write_csv(sweep.out_dir / "runs.csv", runs)
    write_md(sweep, rows, command)
    plot(sweep, runs)
