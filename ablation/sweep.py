"""A sweep file (docs/ablations/README.md) read into runs, trained one after another."""
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

KINDS = {"name": str, "base": str, "out_dir": str, "seeds": list, "overrides": dict,
         "variants": list}
# what a variant may not set: the data, the token budget, how the runs are scored
SHARED_KEYS = {"data.path", "data.tokenizer", "data.val_fraction", "data.val_path",
               "train.max_steps", "train.batch_size", "train.grad_accum",
               "model.block_size", "train.eval_interval", "train.eval_iters"}
# a variant's name is a folder's
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
Run = namedtuple("Run", "variant seed dir cfg")
# variants: (name, settings), baseline first
Sweep = namedtuple("Sweep", "name out_dir seeds variants runs")


def as_overrides(values: dict, folder: Path) -> list[str]:
    return [f"--{k}={absolute(k, v, folder) if k in PATHS else v}"
            for k, v in flat(values).items()]


def load_sweep(path: str, overrides=()) -> Sweep:
    """Read and check a sweep file, and every run's config, before anything runs."""
    path, where = Path(path), f"{path}: "
    spec = load_toml(path)
    if unknown := sorted(set(spec) - set(KINDS)):
        raise UserError(f"{where}unknown sweep key {unknown[0]!r} (a sweep has {', '.join(KINDS)})")
    if wrong := [k for k, v in spec.items() if not isinstance(v, KINDS[k])]:
        kind = {str: "a string", list: "a list", dict: "a table"}[KINDS[wrong[0]]]
        raise UserError(f"{where}{wrong[0]} is not {kind}")
    seeds, variants = spec.get("seeds", [1337]), spec.get("variants")
    # type(), not isinstance: a bool is not a seed
    integers = all(type(s) is int for s in seeds)
    if not seeds or not integers or len(set(seeds)) != len(seeds):
        raise UserError(f"{where}seeds must be a non-empty list of distinct integers, "
                        f"got {seeds!r}")
    if not variants or not all(isinstance(v, dict) for v in variants):
        raise UserError(f"{where}needs at least one [[variants]] table (the first is the baseline)")
    named = [(v.get("name"), {k: x for k, x in v.items() if k != "name"}) for v in variants]
    for i, (name, values) in enumerate(named):
        taken = name in [n for n, _ in named[:i]]
        if not isinstance(name, str) or not NAME_RE.match(name) or taken:
            raise UserError(f"{where}variant {i + 1} needs a name of its own, "
                            f"of letters, digits and _.+-")
        if shared := sorted(SHARED_KEYS & set(flat(values))):
            raise UserError(f"{where}variant {name!r} changes {shared[0]}, "
                            f"which every variant shares")
    cli = dict(parse_overrides(list(overrides)))
    # as for a config file
    folder = ROOT if path.resolve().is_relative_to(ROOT) else path.parent
    name = spec.get("name", path.stem)
    if "out_dir" in cli:
        out_dir = Path(absolute("out_dir", cli.pop("out_dir"), Path.cwd()))
    else:
        default = ROOT / "out" / "ablations" / name
        out_dir = Path(absolute("out_dir", spec.get("out_dir", default), folder))
    base = absolute("base", spec["base"], folder) if "base" in spec else None
    shared = as_overrides(spec.get("overrides", {}), folder)
    # every run's, last (out_dir: the sweep's)
    rest = [f"--{k}={v}" for k, v in cli.items()]
    # a mistake in the settings is said with where it is
    runs, stage = [], f"{where}[overrides]: "
    try:
        build_config(base, shared)
        # the command line's
        stage = ""
        build_config(base, shared + rest)
        for variant, values in named:
            stage = f"{where}variant {variant!r}: "
            for seed in seeds:
                run_dir = out_dir / variant / f"seed{seed}"
                own = [f"--train.seed={seed}", f"--out_dir={run_dir}"]
                settings = shared + as_overrides(values, folder) + rest + own
                cfg = build_config(base, settings)
                # wandb overlays the runs of a sweep
                cfg.log.wandb_group = cfg.log.wandb_group or name
                cfg.log.wandb_run_name = f"{variant}-seed{seed}"
                runs.append(Run(variant, seed, run_dir, cfg))
    except UserError as e:
        raise UserError(f"{stage}{e}") from None
    return Sweep(name, out_dir, seeds, named, runs)


def read_json(path: Path) -> dict:
    """A JSON file; {} where it is missing or damaged: that run is done again."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def train_run(run: Run, resume: bool) -> dict:
    cfg, device = run.cfg, pick_device(run.cfg.train.device)
    cuda = device.type == "cuda"
    # fresh compile caches: dynamo compiles only so many models of one code
    if cfg.train.compile:
        torch._dynamo.reset()
    # nothing of the runs before this one holds memory
    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    # overwrite: a run killed before it saved is set aside
    summary = train(cfg, resume=resume, overwrite=not resume)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    # cfg now has the data's vocab size; on the CPU: a meta device's init imports dynamo
    model = GPT(cfg.model)
    block = cfg.model.block_size
    kv_bytes = model.kv_cache_bytes(block, pick_dtype(device, cfg.train.dtype))
    result = {"done": summary["step"] >= cfg.train.max_steps, "params": model.num_params(),
              "peak_gpu_bytes": peak, "kv_bytes_per_token": kv_bytes / block}
    atomic_write(run.dir / "result.json", json.dumps(result))
    return summary


def run_sweep(sweep: Sweep) -> tuple[int, list[str]]:
    """Train the unfinished runs in order -> (0, or the exit code of the run a signal
    stopped; each run that failed, and why: the others go on)."""
    # a data problem, said once
    first = sweep.runs[0].cfg
    prepare(first.data, first.model.block_size)
    failed = []
    for i, run in enumerate(sweep.runs, 1):
        label = f"{run.variant} seed {run.seed}"
        resume = bool(list_checkpoints(run.dir))
        if read_json(run.dir / "result.json").get("done") is True:
            print(f"[{i}/{len(sweep.runs)}] {label}: done before, skipped")
            continue
        doing = "resuming" if resume else "training"
        print(f"[{i}/{len(sweep.runs)}] {label}: {doing}", flush=True)
        try:
            code = train_run(run, resume)["exit_code"]
        # a diverged loss, a variant too big
        except (UserError, MemoryError, torch.OutOfMemoryError) as e:
            failed.append(f"{label}: {first_line(e)}")
            print(f"    failed: {failed[-1]}", flush=True)
            continue
        # stopped by a signal, with a checkpoint
        if code:
            print(f"stopped during {label}: the same command continues it "
                  f"(finished runs are skipped)")
            return code, failed
    return 0, failed
