"""`python bench.py gpu`: everything a GPU user compares, in one command and one report.

Each part runs as a child process (this Python, from the repository root) whose stdout and stderr go
to <part>.log in the report directory, under a time limit. A part that fails or runs out of time is
recorded with its exit code and the end of its log, and the next part runs. report.md
(benchmarks/gpu_report.py) is rewritten after every part, so a run stopped halfway still leaves a
report of what it measured.

With a CUDA GPU (minutes each, much of it torch.compile compiling):
  tests          the CUDA-only tests: those marked skipif(not torch.cuda.is_available(), ...)
  train-classic  bench.py train configs/shakespeare_char.toml: eager, compiled, graph, both; plain PyTorch
  train-124m     bench.py train configs/gpt2_124m.toml: GPT-2 small's shape, 0.5M tokens per step
  sample         bench.py sample --device cuda: batch 1 and 16
  race           bench.py race: configs/shakespeare_char_fast.toml against configs/shakespeare_char.toml
Without one, the GPU parts are skipped and the report says so; the CUDA-only tests still run (to be
seen skipping), and tiny CPU versions of train and sample exercise the plumbing. --quick runs the
GPU parts on small settings (the race not at all): for checking the command, not for figures.
"""
import ast
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.gpu_report import (environment, race_figures, render, sample_figures, tests_figures,
                                   train_figures)
from benchmarks.race import PAIRS
from benchmarks.sampling import SHAPE
from common import WINDOWS, RunError, atomic_write, on_stop_signals, unwind_on_stop
from training.config import build_config

ROOT = Path(__file__).resolve().parents[1]
CLASSIC, GPT2 = PAIRS["cuda"][0], "configs/gpt2_124m.toml"
SAMPLED = f"{SHAPE['n_layer']} x {SHAPE['n_embd']}, block {SHAPE['block_size']}"   # bench.py sample's model
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False here)"
# The CPU stand-ins: the classic config's data and code path at a size a CPU does in seconds.
TINY = ["--train.device=cpu", "--train.compile=false", "--model.n_layer=1", "--model.n_head=1",
        "--model.n_embd=32", "--model.block_size=32", "--train.batch_size=2"]


@dataclass
class Part:
    name: str
    what: str                  # what it measures, with which counts: a line of the report
    argv: list[str]            # the child's arguments after the interpreter
    limit_s: float             # it is stopped after this many seconds
    skip: str = ""             # why it does not run here ('' = it runs)
    figures: object = None     # log text -> markdown lines of its key figures ([] = none recognized)
    notes: list[str] = field(default_factory=list)   # what its figures mean beyond `what`

    def command(self) -> str:
        return shlex.join(["python", *self.argv])


def is_cuda_skip(node: ast.AST) -> bool:
    """Whether node is a call of ...skipif(...) whose arguments mention cuda.is_available."""
    return (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("skipif")
            and "cuda.is_available" in ast.unparse(node))


def cuda_only_tests(tests: Path = ROOT / "tests") -> list[str]:
    """Pytest ids (path::function) of the test functions marked skipif(not torch.cuda.is_available(),
    ...), directly or through a module-level name bound to such a mark; read from the source, so a new
    CUDA test is found without a list to keep. Paths are relative to the folder above `tests`."""
    ids = []
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        marks = {target.id for node in tree.body if isinstance(node, ast.Assign) and is_cuda_skip(node.value)
                 for target in node.targets if isinstance(target, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and any(
                    is_cuda_skip(d) or (isinstance(d, ast.Name) and d.id in marks) for d in node.decorator_list):
                ids.append(f"{path.relative_to(tests.parent)}::{node.name}")
    return ids


def build(config: str, overrides: list[str]):
    return build_config(str(ROOT / config), overrides)


def describe(cfg) -> str:
    """What one training step of cfg computes, in words."""
    m, t = cfg.model, cfg.train
    return (f"{m.n_layer} x {m.n_embd}, block {m.block_size}, batch {t.batch_size} x grad_accum {t.grad_accum} "
            f"= {t.batch_size * t.grad_accum * m.block_size:,} tokens/step")


def train_part(name: str, config: str, steps: int, rounds: int, extra: list[str], limit_s: float,
               what: str, skip: str = "") -> Part:
    """bench.py train on config: every step variant, `rounds` rounds of `steps` steps each."""
    counts = f"per variant 1 warm-up step, then {rounds} round(s) of {steps} step(s); the figures are the median round"
    mfu = ("MFU: the model's FLOPs per second (6N + attention per token, benchmarks/step.py) over the matmul "
           "peak measured in the same run, in the step's number format")
    return Part(name, f"{what}; {counts}", ["bench.py", "train", config, "--steps", str(steps),
                                            "--rounds", str(rounds), *extra], limit_s, skip, train_figures, [mfu])


def gpt2_part(quick: bool, grad_accum: int | None, overrides: list[str], skip: str) -> Part:
    """bench.py train on GPT-2 small's shape; a few steps suffice, each is 0.5M tokens at the full shape."""
    full = build(GPT2, overrides).train.grad_accum
    accum = grad_accum if grad_accum is not None else 1 if quick else full
    extra = [f"--train.grad_accum={accum}", *overrides]
    part = train_part("train-124m", GPT2, 1, 1 if quick else 3, extra, 480,
                      f"GPT-2 small's shape (124M parameters, {describe(build(GPT2, extra))}), on tinyshakespeare with "
                      f"the gpt2 tokenizer: eager, compiled, CUDA graph, compiled + graph, and plain PyTorch", skip)
    part.notes.append("the gpt2 tokenizer is tiktoken's: offline it needs TIKTOKEN_CACHE_DIR to hold its files")
    if accum != full:
        part.notes.append(f"grad_accum {accum} instead of the shape's {full}: every step counts the same FLOPs per "
                          f"token, but the optimizer update and gradient clipping, paid once per step, are shared "
                          f"by {accum} micro-batches instead of {full}, so MFU here is a little below the full "
                          f"shape's (a lower bound of it)")
    return part


def cpu_parts(overrides: list[str]) -> list[Part]:
    """Without a GPU: tiny CPU runs of train and sample that check the plumbing (no figure worth keeping)."""
    tiny = [*TINY, *overrides]
    return [train_part("train-cpu-quick", CLASSIC, 1, 1, tiny, 120, f"CPU plumbing check: the classic GPU config at "
                       f"{describe(build(CLASSIC, tiny))}, the trainer's step and plain PyTorch"),
            Part("sample-cpu-quick", f"CPU plumbing check: sampling 4 new tokens ({SAMPLED}) with and without the "
                 "KV cache, and compiled", ["bench.py", "sample", "--new-tokens", "4"], 180, figures=sample_figures)]


def plan(cuda: bool, quick: bool, grad_accum: int | None, overrides: list[str]) -> list[Part]:
    """Every part, in the order they run; those that cannot run here carry the reason."""
    gpu_skip = "" if cuda else NO_GPU
    tests = cuda_only_tests()
    parts = [Part("tests", f"the {len(tests)} CUDA-only test functions, with pytest"
                  + ("" if cuda else " (without a GPU each is collected and skips)"),
                  ["-m", "pytest", "-q", "-rfEs", *tests], 480, figures=tests_figures,
                  skip="" if tests else "no test is marked skipif(not torch.cuda.is_available(), ...)")]
    parts.append(train_part("train-classic", CLASSIC, 2 if quick else 20, 1 if quick else 3, overrides, 420,
                            f"the classic GPU config's training step ({describe(build(CLASSIC, overrides))}): eager, "
                            f"compiled, CUDA graph, compiled + graph, and plain PyTorch", gpu_skip))
    parts.append(gpt2_part(quick, grad_accum, overrides, gpu_skip))
    tokens = 50 if quick else 500
    parts.append(Part("sample", f"sampling {tokens} new tokens at batch 1 and 16 ({SAMPLED}, fp32): the "
                      f"compiled decoding step as a CUDA graph, eager with the KV cache, and recomputing the context; "
                      f"best of 3", ["bench.py", "sample", "--device", "cuda", "--new-tokens", str(tokens)], 300,
                      gpu_skip, sample_figures))
    classic, fast = PAIRS["cuda"]
    steps = [build(config, overrides).train.max_steps for config in (classic, fast)]
    parts.append(Part("race", f"wall time of the fast GPU recipe ({fast}) to the best val loss of the classic GPU "
                      f"config ({classic}), each trained to its end ({steps[0]} and {steps[1]} steps), evaluated 20 "
                      f"times", ["bench.py", "race", "--classic", classic, "--fast", fast, *overrides], 600,
                      gpu_skip or ("--quick: a race trains both configs to their end; it has no short version"
                                   if quick else ""), race_figures))
    return parts + ([] if cuda else cpu_parts(overrides))


def stop(proc: subprocess.Popen) -> None:
    """End a child and everything it started (it leads its own session: compile workers too): SIGTERM
    first, so it can clean up; SIGKILL to whatever is left after 10 s. Windows has neither sessions
    nor those signals: there the child alone is ended."""
    if WINDOWS:
        proc.kill()
        proc.wait()
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:   # the whole group has already gone
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def run_part(part: Part, log: Path) -> tuple[str, int | None]:
    """Run part's child with its stdout and stderr in log; (status, exit code): 'ok', 'failed' or
    'timed out'. A signal or Ctrl-C meanwhile ends the child before it goes on up."""
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, *part.argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            code = proc.wait(timeout=part.limit_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            return "timed out", proc.returncode
        except BaseException:
            stop(proc)
            raise
    return ("ok" if code == 0 else "failed"), code


def git(*args: str) -> str:
    """git's output in the repository root; '' where git or the checkout is missing."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def default_out_dir(commit: str) -> Path:
    """out/bench_gpu/<date>-<time>-<commit>: beside the runs' outputs, which git ignores."""
    return ROOT / "out" / "bench_gpu" / f"{time.strftime('%Y%m%d-%H%M%S')}-{commit or 'nogit'}"


def bench_gpu(argv: list[str], out: str | None = None, quick: bool = False, grad_accum: int | None = None,
              overrides: list[str] = (), say=print) -> int:
    """Run every part that can run here, writing report.md after each; 0 if all of them passed, 1 if
    any failed or ran out of time. argv: this command's, as the report quotes it."""
    commit = git("rev-parse", "--short=12", "HEAD")
    env = environment(commit, bool(git("status", "--porcelain", "--untracked-files=no")), argv)
    parts = plan(torch.cuda.is_available(), quick, grad_accum, list(overrides))   # checks the overrides
    todo, results = [p for p in parts if not p.skip], {}
    out_dir = Path(out) if out else default_out_dir(commit)
    if (out_dir / "report.md").exists():
        raise RunError(f"{out_dir} already holds a report.md; give another --out (or delete it)")
    out_dir.mkdir(parents=True, exist_ok=True)

    def write(stopped: str = "") -> None:
        atomic_write(out_dir / "report.md", render(env, parts, results, out_dir, quick, stopped))

    say(f"# {env['GPU']} | report in {out_dir} | {len(todo)} parts to run, {len(parts) - len(todo)} skipped")
    write()                                   # every part 'not run' yet: what a killed run leaves
    with on_stop_signals(unwind_on_stop()):
        for i, part in enumerate(todo, 1):
            say(f"[{i}/{len(todo)}] {part.name}: {part.command()} (at most {part.limit_s:.0f} s)")
            t0 = time.perf_counter()
            try:
                status, code = run_part(part, out_dir / f"{part.name}.log")
            except BaseException as e:
                results[part.name] = {"status": "interrupted", "exit_code": None, "seconds": time.perf_counter() - t0}
                write(f"{str(e) or type(e).__name__} during {part.name}")
                raise
            results[part.name] = {"status": status, "exit_code": code, "seconds": time.perf_counter() - t0}
            say(f"    {status} in {results[part.name]['seconds']:.1f} s, log {out_dir / part.name}.log")
            write()
    bad = [name for name, r in results.items() if r["status"] != "ok"]
    say(f"report: {out_dir / 'report.md'}" + (f" ({', '.join(bad)} did not pass)" if bad else ""))
    return 1 if bad else 0
