"""Ablation sweeps: one base config, a few named variants of it, each trained with every seed.

A sweep file (TOML):

    name = "attention_cpu"                        # optional: default the file's name (wandb group)
    base = "configs/shakespeare_char_cpu.toml"   # optional: a config file
    out_dir = "out/ablations/attention_cpu"       # optional: default out/ablations/<name> in the repository
    seeds = [1337, 1338]

    [overrides]                                   # optional: on top of base, for every run
    train.max_steps = 600

    [[variants]]                                  # the first variant is the baseline
    name = "sdpa"

    [[variants]]
    name = "gqa2"
    model.attention = "gqa"
    model.n_kv_head = 2

Its paths resolve as a config file's (training/config.py): against the repository for a sweep file in
it, else against its folder. A command line's --section.key=value applies to every run, last (its
--out_dir is the sweep's). Each run is a training run in a process of its own (its own peak memory),
in <out_dir>/<variant>/seed<seed>/. For a given seed all variants see the same batches in the same
order and the same number of tokens: a variant may not change the data, the seed, the step count,
the batch shape or the evaluation. A finished run is skipped when the sweep runs again; an unfinished
one resumes.
"""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import UserError, WINDOWS, atomic_write, on_stop_signals, type_problem
from data.prepare import prepare
from training.config import (ROOT, SAME_RUN_KEYS, Config, build_config, describe, flat, folder_of, get_key, load_toml,
                             parse_overrides)
from viz.curves import read_records

SWEEP_KEYS = {"base": str, "out_dir": str, "seeds": list, "overrides": dict, "variants": list, "name": str}
# keys a variant must not change: the data, the token budget, how runs are scored (the seed is the sweep's)
SHARED_KEYS = ["data.path", "data.tokenizer", "data.val_fraction", "train.max_steps", "train.batch_size",
               "train.grad_accum", "model.block_size", "train.eval_interval", "train.eval_iters"]
# keys whose change a run's resumption allows (what is watched or kept of a run, how fast it computes: a
# sweep moved to another out_dir continues its runs), and log.* (labels: a copy of a sweep under another
# name continues them too); not the evaluation, which scores the runs
RESUMABLE_KEYS = SAME_RUN_KEYS - {"train.eval_interval", "train.eval_iters"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclasses.dataclass
class Run:
    variant: str
    seed: int
    dir: Path
    cfg: Config

    @property
    def label(self) -> str:
        return f"{self.variant} seed {self.seed}"


@dataclasses.dataclass
class Sweep:
    name: str
    out_dir: Path
    seeds: list[int]
    variants: list[tuple[str, dict]]    # (name, overrides as a nested dict), the baseline first
    runs: list[Run]


def load_sweep(path: str, overrides: list[str] = ()) -> Sweep:
    """Parse and check a sweep file; build (and validate) every run's config before anything runs."""
    path, where = Path(path), f"{path}: "
    spec = load_toml(path)
    if unknown := set(spec) - set(SWEEP_KEYS):
        raise UserError(f"{where}unknown sweep key(s) {', '.join(sorted(unknown))} "
                          f"(a sweep has {', '.join(sorted(SWEEP_KEYS))})")
    if problem := type_problem(spec, {k: kind for k, kind in SWEEP_KEYS.items() if k in spec}):
        raise UserError(f"{where}{problem.replace(' an object', ' a table')}")
    seeds = spec.get("seeds", [1337])
    if not seeds or any(type(s) is not int for s in seeds) or len(set(seeds)) != len(seeds):   # (a bool is no seed)
        raise UserError(f"{where}seeds must be a non-empty list of distinct integers, got {seeds!r}")
    variants = spec.get("variants")
    if not variants or not all(isinstance(v, dict) for v in variants):
        raise UserError(f"{where}needs at least one [[variants]] table (the first is the baseline)")
    names = [v.get("name") for v in variants]
    for i, name in enumerate(names):
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise UserError(f"{where}variant {i + 1} needs a name of letters, digits and _.+- (got {name!r})")
        if name in names[:i]:
            raise UserError(f"{where}two variants are named {name!r}")
    named = [(v["name"], {k: x for k, x in v.items() if k != "name"}) for v in variants]

    folder, cli = folder_of(path), parse_overrides(list(overrides))
    if clash := sorted({k for k, _ in cli} & {k for _, v in named for k in flat(v)}):
        raise UserError(f"--{clash[0]}: a variant of {path} sets it, and the command line, applied last, would "
                          f"make that variant its baseline's copy; give it in the sweep file's variants instead")
    sweep_name = spec.get("name", path.stem)
    out_dir = next((Path(v).resolve() for k, v in cli if k == "out_dir"), None) or \
        (folder / spec["out_dir"] if "out_dir" in spec else ROOT / "out" / "ablations" / sweep_name)
    base = str(folder / spec["base"]) if "base" in spec else None
    rest = [f"--{k}={v}" for k, v in cli if k != "out_dir"]   # (every run's out_dir is the sweep's)
    runs = []
    for name, values in named:
        for seed in seeds:
            cfg = build_config(base, rest, validate=False, layers=[
                (spec.get("overrides", {}), folder, f"{where}[overrides]: "),
                (values, folder, f"{where}variant {name!r}: ")])
            run_dir = out_dir / name / f"seed{seed}"
            cfg.train.seed, cfg.out_dir = seed, str(run_dir)
            cfg.log.wandb_group, cfg.log.wandb_run_name = cfg.log.wandb_group or sweep_name, f"{name}-seed{seed}"
            try:
                cfg.validate()
            except UserError as e:
                raise UserError(f"{where}variant {name!r}: {e}") from None
            runs.append(Run(name, seed, run_dir, cfg))
    for run in runs:   # every variant sees the same data and token budget as the baseline
        for key in SHARED_KEYS:
            if (mine := get_key(run.cfg, key)) != (theirs := get_key(runs[0].cfg, key)):
                raise UserError(f"{where}variant {run.variant!r} changes {key} ({mine!r}, the baseline has "
                                  f"{theirs!r}): every variant must see the same data and token budget; "
                                  f"set it in [overrides] instead")
    return Sweep(sweep_name, out_dir, seeds, named, runs)


def read_json(path: Path) -> dict:
    """A JSON object the sweep wrote ({} where it is missing, or was cut or damaged: what it recorded is
    then done again)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def check_not_stale(run: Run) -> None:
    """A run dir started with another config must not be mixed into the results (nor resumed)."""
    if not (run.dir / "sweep_run.toml").exists():
        return
    saved = flat(load_toml(run.dir / "sweep_run.toml"))
    diff = [f"{k}: {saved.get(k)!r} there, {v!r} now" for k, v in flat(run.cfg.to_dict()).items()
            if saved.get(k) != v and k not in RESUMABLE_KEYS and not k.startswith("log.")]
    if diff:
        raise UserError(f"{run.dir} holds a run with another config ({'; '.join(diff[:3])}); "
                          f"delete it, or give the sweep another out_dir")


def pass_stop_on(proc: subprocess.Popen, signum: int) -> None:
    """Ask the run to save a checkpoint and stop: on POSIX with SIGINT for a SIGINT, else SIGTERM. Windows
    sends another process no signal (send_signal refuses SIGINT; its SIGTERM is TerminateProcess): a
    CTRL_BREAK_EVENT to the run's process group, which its Python takes as SIGBREAK; without a console to
    send it through, the run is terminated (it resumes from its last checkpoint)."""
    if not WINDOWS:
        return proc.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
    try:
        proc.send_signal(signal.CTRL_BREAK_EVENT)
    except OSError:
        proc.terminate()


def execute(run: Run) -> tuple[int, bool]:
    """Run one training process, its output appended to train.log; (its exit code, whether a stop was
    asked for). A Ctrl-C (or SIGTERM, SIGHUP) reaches this process alone (the run has a session, or on
    Windows a process group, of its own), which passes it on: the run saves a checkpoint and stops."""
    run.dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run.dir / "sweep_run.toml", describe(run.cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}   # train.log is UTF-8 everywhere
    group = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if WINDOWS else {"start_new_session": True}
    stops = []
    with open(run.dir / "train.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ablation.run", str(run.dir)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=env, **group)
        with on_stop_signals(lambda signum: stops.append(signum) or pass_stop_on(proc, signum)):
            return proc.wait(), bool(stops)   # (Python waits on after a signal's handler has run)


def run_sweep(sweep: Sweep) -> dict:
    """Run every unfinished run in order; {'failed': [(run, its log's last line)], 'interrupted': bool}."""
    for run in sweep.runs:
        check_not_stale(run)
    prepare(sweep.runs[0].cfg.data)    # a data problem is reported once, before any run starts
    failed = []
    for i, run in enumerate(sweep.runs, 1):
        if read_json(run.dir / "result.json").get("done") is True:
            print(f"[{i}/{len(sweep.runs)}] {run.label}: done before, skipped")
            continue
        doing = "resuming" if any(run.dir.glob("ckpt_*.pt")) else "training"
        print(f"[{i}/{len(sweep.runs)}] {run.label}: {doing} -> {run.dir}/train.log", flush=True)
        start = time.perf_counter()
        code, stopped = execute(run)
        if stopped or code == 130:
            print(f"interrupted during {run.label}; run the same command again to continue "
                  f"(finished runs are skipped, this one resumes from its last checkpoint)")
            return {"failed": failed, "interrupted": True}
        result = read_json(run.dir / "result.json")
        if code != 0 or result.get("done") is not True:
            log = (run.dir / "train.log").read_text(encoding="utf-8", errors="replace").splitlines()
            failed.append((run, next((line for line in reversed(log) if line.strip()), "(no output)")))
            print(f"    failed (exit code {code}): {failed[-1][1]}")
        else:   # (the run's every evaluation: a run resumed at its end evaluates nothing in its last process)
            val = [r["val_loss"] for r in read_records(run.dir / "metrics.jsonl", warn=False) if r["kind"] == "eval"]
            print(f"    val loss {val[-1]:.4f} (best {min(val):.4f}) in {time.perf_counter() - start:.0f} s")
    return {"failed": failed, "interrupted": False}
