"""`python bench.py gpu`: every GPU measurement in one command, one report.

Each part is a child process (this Python, in the repository) under a time limit, its output shown
as it comes and kept in <part>.log in the report directory. report.md, rewritten after every part (a
run stopped halfway still leaves one), says what the figures were taken on, then each part's status,
time and the last lines of its log: its figures (each bench.py command ends with them), or its error.
A part that fails or runs out of time does not stop the next. The parts: the CUDA-only tests (their
names say on_cuda); bench.py train on the classic GPU config and on GPT-2 small's shape (every step
kind and plain PyTorch); bench.py sample on CUDA; bench.py race (the GPU pair).

Without a CUDA GPU nothing runs: the report says so, and what would have. --quick: fewer steps and
tokens, and no race (it has no short version): it checks the command, its figures are not for use.
"""
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.machine import machine
from common import UserError, WINDOWS, atomic_write, on_stop_signals, unwind_on_stop

ROOT = Path(__file__).resolve().parents[1]
TAIL = 15   # lines of a part's log in the report


def parts(quick: bool, overrides: list[str]) -> list[tuple[str, list[str], int]]:
    """(name, the child's arguments after `python`, its time limit in seconds), in the order they run."""
    rounds = ["--rounds", "1" if quick else "3"]
    return [("tests", ["-m", "pytest", "-q", "-rfEs", "tests", "-k", "on_cuda"], 600),
            ("train-classic", ["bench.py", "train", "configs/shakespeare_char.toml", "--steps", "2" if quick else "20",
                               *rounds, *overrides], 480),
            ("train-124m", ["bench.py", "train", "configs/gpt2_124m.toml", "--steps", "1", *rounds, *overrides], 600),
            ("sample", ["bench.py", "sample", "--device", "cuda", "--new-tokens", "50" if quick else "500"], 300),
            *([] if quick else [("race", ["bench.py", "race", *overrides], 1200)])]


def stop(proc: subprocess.Popen) -> None:
    """End a child and all it started (its session: compile workers too): SIGTERM, so that it cleans up,
    then SIGKILL after 10 s. Windows has neither sessions nor those signals: there the child is killed."""
    if WINDOWS:
        return proc.kill()
    with contextlib.suppress(ProcessLookupError):   # (the whole group has gone)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_part(argv: list[str], limit: int, log: Path, say) -> tuple[str, int | None]:
    """Run `python ARGV` in the repository, its output shown and written to log; (status: ok, failed or
    timed out; exit code). A signal meanwhile ends the child before it goes on up."""
    fired = []
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, encoding="utf-8", errors="replace", start_new_session=not WINDOWS,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"})
        timer = threading.Timer(limit, lambda: (fired.append(True), stop(proc)))
        timer.start()
        try:
            for line in proc.stdout:
                f.write(line)
                say(line, end="", flush=True)
            code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                stop(proc)
    return ("ok" if code == 0 else "timed out" if fired else "failed"), code


def environment(argv: list[str]) -> dict:
    """What the figures were taken on, and with: the report's first table."""
    def output(*command) -> str:   # '' where the command is missing or fails
        try:
            return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = output("git", "rev-parse", "--short=12", "HEAD").strip()
    changed = output("git", "status", "--porcelain", "--untracked-files=no")
    return {"GPU": f"{torch.cuda.get_device_name(0)} (GPU 0 of {torch.cuda.device_count()}: every part uses it)"
            if torch.cuda.is_available() else "none: torch.cuda.is_available() is False",
            "driver": output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").split("\n")[0]
            or "unknown (nvidia-smi did not say)",
            "PyTorch": f"{torch.__version__}, CUDA {torch.version.cuda or 'none (a CPU build)'}",
            "commit": (commit + (" (tracked files changed since)" if changed else "")) or "unknown (no git checkout)",
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": shlex.join(["python", *argv])}


def report(env: dict, plan: list, results: dict, out_dir: Path) -> str:
    """report.md: the environment, a row per part, then each part that ran with the end of its log."""
    cuda = torch.cuda.is_available()
    lines = [f"# GPU benchmark: {torch.cuda.get_device_name(0) if cuda else 'no GPU'}", ""]
    if not cuda:
        lines += ["**No GPU figure was measured**: this machine has no CUDA GPU, so no part ran.", ""]
    lines += ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in env.items()), "",
              "| part | status | time | command |", "| --- | --- | ---: | --- |"]
    for name, argv, limit in plan:
        r = results.get(name, {"status": "not run"})
        seconds = f"{r['seconds']:.0f} s" if "seconds" in r else ""
        lines.append(f"| {name} | {r['status']} | {seconds} | `python {shlex.join(argv)}` |")
    for name, argv, limit in plan:
        if name in results:
            r, log = results[name], out_dir / f"{name}.log"
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL:] if log.exists() else []
            lines += ["", f"## {name}: {r['status']}", "", f"{r['seconds']:.1f} s (limit {limit} s), exit code "
                      f"{r['code']}; the whole log: [{log.name}]({log.name})", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"


def bench_gpu(argv: list[str], out: str | None = None, quick: bool = False, overrides: list[str] = (),
              say=print) -> int:
    """Run every part, report.md rewritten after each; 0 if all passed, 1 otherwise (or without a GPU)."""
    env, plan, results = environment(argv), parts(quick, list(overrides)), {}
    out_dir = Path(out) if out else ROOT / "out" / "bench_gpu" / (f"{time.strftime('%Y%m%d-%H%M%S')}-"
                                                                 f"{env['commit'].split()[0]}")
    if (out_dir / "report.md").exists():
        raise UserError(f"{out_dir} already holds a report.md; give another --out (or delete it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "report.md", report(env, plan, results, out_dir))
    if not torch.cuda.is_available():
        say(f"# no CUDA GPU here (torch.cuda.is_available() is False): nothing was measured; {out_dir / 'report.md'} "
            f"says what would have run")
        return 1
    with on_stop_signals(unwind_on_stop()):
        for i, (name, args, limit) in enumerate(plan, 1):
            say(f"[{i}/{len(plan)}] {name}: python {shlex.join(args)} (at most {limit} s)")
            r, start = results.setdefault(name, {"code": None}), time.perf_counter()
            try:
                r["status"], r["code"] = run_part(args, limit, out_dir / f"{name}.log", say)
            except BaseException as e:   # a signal, Ctrl-C: the report says so, then it goes on up
                r["status"] = f"interrupted ({e or type(e).__name__})"
                raise
            finally:
                r["seconds"] = time.perf_counter() - start
                atomic_write(out_dir / "report.md", report(env, plan, results, out_dir))
    bad = [name for name, r in results.items() if r["status"] != "ok"]
    say(f"report: {out_dir / 'report.md'}" + (f" ({', '.join(bad)} did not pass)" if bad else ""))
    return 1 if bad else 0
