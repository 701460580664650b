"""A sweep file (its format: ablate.py) read into runs, and the runs trained one after another in-process."""
import gc
import json
import re
from collections import namedtuple
from pathlib import Path

import torch

from common import UserError, atomic_write, first_line, flat
from data.prepare import prepare
from model.gpt import GPT
from model.device import pick_device, pick_dtype
from loading import list_checkpoints
from training.config import PATHS, ROOT, absolute, build_config, load_toml, parse_overrides
from training.trainer import train

KINDS = {"name": (str, "a string"), "base": (str, "a string"), "out_dir": (str, "a string"),
         "seeds": (list, "a list"), "overrides": (dict, "a table"), "variants": (list, "a list")}
# what a variant may not set: the data, the token budget, how the runs are scored
SHARED_KEYS = {"data.path", "data.tokenizer", "data.val_fraction", "data.val_path", "train.max_steps",
               "train.batch_size", "train.grad_accum", "model.block_size", "train.eval_interval",
               "train.eval_iters"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")   # a variant's name is a folder's
Run = namedtuple("Run", "variant seed dir cfg")
Sweep = namedtuple("Sweep", "name out_dir seeds variants runs")   # variants: (name, settings), baseline first


def as_overrides(values: dict, folder: Path) -> list[str]:
    """A table of settings as command-line overrides, its paths made absolute against folder."""
    return [f"--{k}={absolute(k, v, folder) if k in PATHS else v}" for k, v in flat(values).items()]


def load_sweep(path: str, overrides=()) -> Sweep:
    """Read and check a sweep file; build (and validate) every run's config before anything runs."""
    path, where = Path(path), f"{path}: "
    spec = load_toml(path)
    if unknown := sorted(set(spec) - set(KINDS)):
        raise UserError(f"{where}unknown sweep key {unknown[0]!r} (a sweep has {', '.join(KINDS)})")
    if wrong := [k for k, v in spec.items() if not isinstance(v, KINDS[k][0])]:
        raise UserError(f"{where}{wrong[0]} is not {KINDS[wrong[0]][1]}")
    seeds, variants = spec.get("seeds", [1337]), spec.get("variants")
    if not seeds or any(type(s) is not int for s in seeds) or len(set(seeds)) != len(seeds):   # (no bools)
        raise UserError(f"{where}seeds must be a non-empty list of distinct integers, got {seeds!r}")
    if not variants or not all(isinstance(v, dict) for v in variants):
        raise UserError(f"{where}needs at least one [[variants]] table (the first is the baseline)")
    named = [(v.get("name"), {k: x for k, x in v.items() if k != "name"}) for v in variants]
    for i, (name, values) in enumerate(named):
        if not isinstance(name, str) or not NAME_RE.match(name) or name in [n for n, _ in named[:i]]:
            raise UserError(f"{where}variant {i + 1} needs a name of its own, of letters, digits and _.+-")
        if shared := sorted(SHARED_KEYS & set(flat(values))):
            raise UserError(f"{where}variant {name!r} changes {shared[0]}, which every variant shares")
    cli = parse_overrides(list(overrides))
    folder = ROOT if path.resolve().is_relative_to(ROOT) else path.parent   # as for a config file
    name, cli_dir = spec.get("name", path.stem), dict(cli).get("out_dir")
    out_dir = Path(absolute("out_dir", cli_dir, Path.cwd()) if cli_dir is not None else
                   absolute("out_dir", spec["out_dir"], folder) if "out_dir" in spec else
                   ROOT / "out" / "ablations" / name)
    base = absolute("base", spec["base"], folder) if "base" in spec else None
    shared = as_overrides(spec.get("overrides", {}), folder)
    rest = [f"--{k}={v}" for k, v in cli if k != "out_dir"]   # every run's, last (out_dir: the sweep's)
    runs, stage = [], f"{where}[overrides]: "   # a mistake in the settings is said with where it is
    try:
        build_config(base, shared)
        stage = ""   # (the command line's)
        build_config(base, shared + rest)
        for variant, values in named:
            stage = f"{where}variant {variant!r}: "
            for seed in seeds:
                run_dir = out_dir / variant / f"seed{seed}"
                cfg = build_config(base, shared + as_overrides(values, folder) + rest +
                                   [f"--train.seed={seed}", f"--out_dir={run_dir}"])
                cfg.log.wandb_group = cfg.log.wandb_group or name   # wandb overlays the runs of a sweep
                cfg.log.wandb_run_name = f"{variant}-seed{seed}"
                runs.append(Run(variant, seed, run_dir, cfg))
    except UserError as e:
        raise UserError(f"{stage}{e}") from None
    return Sweep(name, out_dir, seeds, named, runs)


def read_json(path: Path) -> dict:   # ({} where it is missing, cut or damaged: that run is done again)
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def train_run(run: Run, resume: bool) -> dict:
    """train() the run, then write its result.json: whether it finished, its size, its KV cache per token,
    its peak GPU memory on CUDA (none on the CPU, where this process's peak holds every run before it)."""
    cfg, device, result = run.cfg, pick_device(run.cfg.train.device), run.dir / "result.json"
    if cfg.train.compile:   # fresh compile caches: dynamo compiles only so many models of one code
        torch._dynamo.reset()
    gc.collect()   # nothing of the runs before this one holds memory
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    summary = train(cfg, resume=resume, overwrite=not resume)   # (a run killed before it saved: set aside)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None   # (its last attempt's)
    # the model's size (cfg now has the data's vocab size), on the CPU: the meta device's random
    # init imports torch._dynamo, a second of every sweep's time
    model, block = GPT(cfg.model), cfg.model.block_size
    atomic_write(result, json.dumps({
        "done": summary["step"] >= cfg.train.max_steps,
        "params": model.num_params(), "peak_gpu_bytes": peak,
        "kv_bytes_per_token": model.kv_cache_bytes(block, pick_dtype(device, cfg.train.dtype)) / block}))
    return summary


def run_sweep(sweep: Sweep) -> tuple[int, list[str]]:
    """Train the unfinished runs in order: (0, or the exit code of the run a signal stopped, and with it
    the sweep; each run that failed, and why: the others go on)."""
    prepare(sweep.runs[0].cfg.data, sweep.runs[0].cfg.model.block_size)   # (a data problem, said once)
    failed = []
    for i, run in enumerate(sweep.runs, 1):
        label, resume = f"{run.variant} seed {run.seed}", bool(list_checkpoints(run.dir))
        if read_json(run.dir / "result.json").get("done") is True:
            print(f"[{i}/{len(sweep.runs)}] {label}: done before, skipped")
            continue
        print(f"[{i}/{len(sweep.runs)}] {label}: {'resuming' if resume else 'training'}", flush=True)
        try:
            code = train_run(run, resume)["exit_code"]
        except (UserError, MemoryError, torch.OutOfMemoryError) as e:   # (a diverged loss; a variant too big)
            failed.append(f"{label}: {first_line(e)}")
            print(f"    failed: {failed[-1]}", flush=True)
            continue
        if code:   # stopped by a signal, with a checkpoint
            print(f"stopped during {label}: the same command continues it (finished runs are skipped)")
            return code, failed
    return 0, failed
