"""Ablation sweeps: one base config, a few named variants of it, each trained with every seed.

A sweep file (TOML):

    name = "attention_cpu"                        # optional: default the file's name (wandb group)
    base = "configs/shakespeare_char_cpu.toml"   # optional: a config file, relative to the working dir
    out_dir = "out/ablations/attention_cpu"       # optional: default out/ablations/<name>
    seeds = [1337, 1338]

    [overrides]                                   # optional: on top of base, for every run
    train.max_steps = 600

    [[variants]]                                  # the first variant is the baseline
    name = "sdpa"

    [[variants]]
    name = "gqa2"
    model.attention = "gqa"
    model.n_kv_head = 2

Every run is a normal training run (a subprocess, so each has its own peak memory) in
<out_dir>/<variant>/seed<seed>/. For a given seed all variants see the same batches in the same order
(the seed fixes the data order) and the same number of tokens: a variant may not change the data,
the seed, the step count, the batch shape or the evaluation. A finished run is skipped when the
sweep runs again; an unfinished one resumes from its last checkpoint.
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

from common import WINDOWS, ConfigError, atomic_write, on_stop_signals, type_problem
from data.prepare import prepare
from training.config import (WATCHING_KEYS, Config, apply_dict, describe, flat, get_key, load_toml, parse_overrides,
                             set_key)

SWEEP_KEYS = {"base": str, "out_dir": str, "seeds": list, "overrides": dict, "variants": list, "name": str}
# keys a variant must not change: the data, its order and the token budget, and how runs are scored
SHARED_KEYS = ["data.path", "data.tokenizer", "data.val_fraction", "train.seed", "train.max_steps",
               "train.batch_size", "train.grad_accum", "model.block_size", "train.eval_interval", "train.eval_iters"]
# keys that may differ between a run's start and its resumption: what is watched or kept of a run (a sweep
# moved to another out_dir continues its runs), and how fast it computes; log.* are labels too (a copy
# of a sweep under another name continues its runs). Not the evaluation: it scores the runs.
RESUMABLE_KEYS = WATCHING_KEYS | {"train.device", "train.compile", "train.cuda_graph"}
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
    """Parse and check a sweep file; build (and validate) every run's config before anything runs.
    overrides: command-line --section.key=value, applied to every run after the file's [overrides]."""
    path = Path(path)
    spec = load_toml(path)
    where = f"{path}: "
    unknown = set(spec) - set(SWEEP_KEYS)
    if unknown:
        raise ConfigError(f"{where}unknown sweep key(s) {', '.join(sorted(unknown))} "
                          f"(a sweep has {', '.join(sorted(SWEEP_KEYS))})")
    problem = type_problem(spec, {k: kind for k, kind in SWEEP_KEYS.items() if k in spec})
    if problem:
        raise ConfigError(f"{where}{problem.replace(' an object', ' a table')}")
    seeds = spec.get("seeds", [1337])
    if not seeds or any(type(s) is not int for s in seeds) or len(set(seeds)) != len(seeds):   # (a bool is no seed)
        raise ConfigError(f"{where}seeds must be a non-empty list of distinct integers, got {seeds!r}")
    variants = spec.get("variants")
    if not variants or not all(isinstance(v, dict) for v in variants):
        raise ConfigError(f"{where}needs at least one [[variants]] table (the first is the baseline)")
    named = []
    for i, v in enumerate(variants):
        name = v.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ConfigError(f"{where}variant {i + 1} needs a name of letters, digits and _.+- (got {name!r})")
        if name in [n for n, _ in named]:
            raise ConfigError(f"{where}two variants are named {name!r}")
        named.append((name, {k: x for k, x in v.items() if k != "name"}))

    cli = parse_overrides(list(overrides))
    sweep_name = spec.get("name", path.stem)
    out_dir = Path(next((v for k, v in cli if k == "out_dir"), None) or spec.get("out_dir") or
                   Path("out") / "ablations" / sweep_name)
    runs = []
    for name, values in named:
        for seed in seeds:
            cfg = Config()
            if "base" in spec:
                apply_dict(cfg, load_toml(Path(spec["base"])), where=f"{spec['base']}: ")
            apply_dict(cfg, spec.get("overrides", {}), where=f"{where}[overrides]: ")
            for key, value in cli:
                if key != "out_dir":
                    set_key(cfg, key, value)
            apply_dict(cfg, values, where=f"{where}variant {name!r}: ")
            run_dir = out_dir / name / f"seed{seed}"
            cfg.train.seed, cfg.out_dir = seed, str(run_dir)
            cfg.log.wandb_group = cfg.log.wandb_group or sweep_name
            cfg.log.wandb_run_name = f"{name}-seed{seed}"
            try:
                cfg.validate()
            except ConfigError as e:
                raise ConfigError(f"{where}variant {name!r}: {e}") from None
            runs.append(Run(name, seed, run_dir, cfg))
    check_shared(runs, named[0][0], where)
    return Sweep(sweep_name, out_dir, seeds, named, runs)


def check_shared(runs: list[Run], baseline_name: str, where: str) -> None:
    """Every variant sees the same data and token budget as the baseline of its seed."""
    baseline = {r.seed: r.cfg for r in runs if r.variant == baseline_name}
    for run in runs:
        for key in SHARED_KEYS:
            mine, theirs = get_key(run.cfg, key), get_key(baseline[run.seed], key)
            if mine != theirs:
                raise ConfigError(f"{where}variant {run.variant!r} changes {key} ({mine!r}, the baseline has "
                                  f"{theirs!r}): every variant must see the same data and token budget; "
                                  f"set it in [overrides] instead")


def read_json(path: Path) -> dict:
    """A JSON object the sweep wrote ({} where it is missing, or was cut or damaged: what it recorded is
    then done again)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def is_done(run: Run) -> bool:
    return read_json(run.dir / "result.json").get("done") is True


def check_not_stale(run: Run) -> None:
    """A run dir started with another config must not be mixed into the results (nor resumed)."""
    saved_path = run.dir / "sweep_run.toml"
    if not saved_path.exists():
        return
    saved = flat(load_toml(saved_path))
    diff = [f"{k}: {saved.get(k)!r} there, {v!r} now" for k, v in flat(run.cfg.to_dict()).items()
            if saved.get(k) != v and k not in RESUMABLE_KEYS and not k.startswith("log.")]
    if diff:
        raise ConfigError(f"{run.dir} holds a run with another config ({'; '.join(diff[:3])}); "
                          f"delete it, or give the sweep another out_dir")


def pass_stop_on(proc: subprocess.Popen, signum: int) -> None:
    """Ask the run to save a checkpoint and stop. POSIX: with SIGINT for a SIGINT, else SIGTERM.
    Windows sends no signal to another process (Popen.send_signal refuses SIGINT, and its SIGTERM is
    TerminateProcess): a CTRL_BREAK_EVENT to the run's process group, which its Python takes as
    SIGBREAK; where the sweep has no console to send it through, the run is terminated (it resumes from
    its last checkpoint)."""
    if not WINDOWS:
        proc.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        return
    try:
        proc.send_signal(signal.CTRL_BREAK_EVENT)
    except OSError:
        proc.terminate()


def execute(run: Run) -> tuple[int, int | None, bool]:
    """Run one training subprocess (its output appended to train.log); return its exit code, its peak
    resident memory in bytes (None where os.wait4 is missing) and whether a stop was requested.
    A Ctrl-C (or SIGTERM, SIGHUP) reaches this process, which passes it on, so the child saves a
    checkpoint and stops; a second one makes it exit at once."""
    run.dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run.dir / "sweep_run.toml", describe(run.cfg))
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8",   # train.log is UTF-8 everywhere
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    stops = []
    # the run's process is in a session (POSIX) or a process group (Windows) of its own: a Ctrl-C in the
    # terminal reaches the sweep alone, which passes it on (pass_stop_on)
    group = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if WINDOWS else {"start_new_session": True}
    with open(run.dir / "train.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ablation.run", str(run.dir)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, **group)

        def forward(signum):
            stops.append(signum)
            pass_stop_on(proc, signum)

        with on_stop_signals(forward):
            if hasattr(os, "wait4"):
                _, status, rusage = os.wait4(proc.pid, 0)   # (retried by Python when a signal interrupts it)
                proc.returncode = os.waitstatus_to_exitcode(status)
                rss = rusage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)   # bytes on macOS, KiB on Linux
            else:
                proc.wait()
                rss = None
    return proc.returncode, rss, bool(stops)


def record_attempt(run: Run, code: int, rss: int | None, seconds: float) -> None:
    """run.json: every process that worked on the run, so resumed runs report their largest peak."""
    attempts = read_json(run.dir / "run.json").get("attempts")
    attempts = (attempts if isinstance(attempts, list) else []) + [
        {"exit_code": code, "peak_rss_bytes": rss, "seconds": round(seconds, 2)}]
    atomic_write(run.dir / "run.json", json.dumps({"attempts": attempts}, indent=1))


def last_line(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return next((line for line in reversed(text.splitlines()) if line.strip()), "(no output)")


def run_sweep(sweep: Sweep) -> dict:
    """Run every unfinished run in order; return {'failed': [(run, its log's last line)], 'interrupted': bool}."""
    for run in sweep.runs:
        check_not_stale(run)
    prepare(sweep.runs[0].cfg.data)    # a data problem is reported once, before any run starts
    failed, total = [], len(sweep.runs)
    for i, run in enumerate(sweep.runs, 1):
        if is_done(run):
            print(f"[{i}/{total}] {run.label}: done before, skipped")
            continue
        resuming = any(run.dir.glob("ckpt_*.pt"))
        print(f"[{i}/{total}] {run.label}: {'resuming' if resuming else 'training'} -> {run.dir}/train.log", flush=True)
        start = time.perf_counter()
        code, rss, stopped = execute(run)
        record_attempt(run, code, rss, time.perf_counter() - start)
        if stopped or code == 130:
            print(f"interrupted during {run.label}; run the same command again to continue "
                f"(finished runs are skipped, this one resumes from its last checkpoint)")
            return {"failed": failed, "interrupted": True}
        if code != 0 or not is_done(run):
            failed.append((run, last_line(run.dir / "train.log")))
            print(f"    failed (exit code {code}): {failed[-1][1]}")
        else:
            result = read_json(run.dir / "result.json")
            print(f"    val loss {result['val_loss']:.4f} (best {result['best_val_loss']:.4f}) "
                f"in {time.perf_counter() - start:.0f} s")
    return {"failed": failed, "interrupted": False}
