"""The report of `python bench.py gpu` (benchmarks/gpu.py): what it ran on, then one section per part
with its command, time, status and key figures, then the parts skipped and why.

The figures are read from each part's log by patterns of the lines bench.py prints (the rows of its
tables, the race's ratio line); where a pattern finds nothing, the section points to the log instead
of guessing.
"""
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine import machine

HEADER = ("GPU", "driver", "PyTorch", "CUDA", "commit", "machine", "Python", "date", "command")
TAIL_LINES = 20   # of a failed part's log, in the report


def driver_version() -> str:
    """The NVIDIA driver's version from nvidia-smi; where it cannot say, what PyTorch was built for."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return f"{done.stdout.split()[0]} (nvidia-smi)"
        why = f"nvidia-smi exited with {done.returncode}"
    except FileNotFoundError:
        why = "no nvidia-smi"
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"nvidia-smi failed: {type(e).__name__}"
    return f"driver unknown ({why}); PyTorch's CUDA: {torch.version.cuda or 'none (a CPU build)'}"


def environment(commit: str, dirty: bool, argv: list[str]) -> dict:
    """What the measurements were taken on and with: the report's first table."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else ""
    gpu = (f"{name} (GPU 0 of {torch.cuda.device_count()}: every part uses it)"
           if cuda else "none: torch.cuda.is_available() is False")
    return {"cuda": cuda, "name": name, "GPU": gpu, "driver": driver_version(), "PyTorch": torch.__version__,
            "CUDA": torch.version.cuda or "none (a CPU build of PyTorch)",
            "commit": (f"{commit} ({'dirty: tracked files differ from it' if dirty else 'clean tree'})"
                       if commit else "unknown (not a git checkout)"),
            "machine": machine(), "Python": f"{platform.python_version()} ({sys.executable})",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(["python", *argv])}


TRAIN_ROW = re.compile(r"^(eager|compiled|graph|compiled\+graph|trainer|plain) +([\d.]+) +([\d,]+) +([\d.]+)% +(.*)$",
                       re.M)
SAMPLE_CUDA_ROW = re.compile(r"^ *(\d+) +(\d+) +(\d+) +(\d+) +([\d.]+)x +([\d.]+)x +([\d.]+)$", re.M)
SAMPLE_CPU_ROW = re.compile(r"^ *(\d+) +([\d.]+) +([\d.]+) +([\d.]+)x$", re.M)
RACE_RATIO = re.compile(r"^ratio +fast / classic wall time to val ([\d.]+): ([\d.]+) \(([\d.]+)x faster; "
                        r"tokens ([\d.]+)x\)", re.M)
RACE_LINE = re.compile(r"^(classic|fast) +\S.*?: (best val|val|never reached).*$", re.M)
PYTEST_SUMMARY = re.compile(r"(\b\d+ (passed|failed|skipped|errors?|deselected)\b.*|no tests ran.*) in [\d.]+s")


def table(head: list[str], rows, align: str = "") -> list[str]:
    """Markdown table lines (a | in a cell escaped); align: a letter per column, l(eft) or r(ight);
    by default the first l, the rest r."""
    align = align or "l" + "r" * (len(head) - 1)
    return [f"| {' | '.join(head)} |", "|" + "".join(" ---: |" if a == "r" else " --- |" for a in align),
            *("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows), ""]


def train_figures(text: str) -> list[str]:
    """bench.py train: the matmul peak, the shape, one row per variant, the fastest."""
    rows = TRAIN_ROW.findall(text)
    if not rows:
        return []
    said = [line[2:] for line in text.splitlines() if line.startswith("# ") and ("matmul peak" in line
                                                                                 or "tokens/step" in line)]
    said += [line for line in text.splitlines() if line.startswith("fastest:")]
    return [*(f"- {line}" for line in said), "",
            *table(["step", "ms/step", "tokens/s", "MFU", "how"],
                   [(n, ms, tok, f"{mfu}%", how) for n, ms, tok, mfu, how in rows], align="lrrrl")]


def sample_figures(text: str) -> list[str]:
    """bench.py sample: tokens/s per batch on CUDA, per thread count on CPU."""
    if rows := SAMPLE_CUDA_ROW.findall(text):
        return table(["batch", "compiled + CUDA graph tok/s", "eager tok/s", "recomputed tok/s", "compiled / eager",
                      "compiled / recomputed", "compile s"], [(*r[:4], f"{r[4]}x", f"{r[5]}x", r[6]) for r in rows])
    if rows := SAMPLE_CPU_ROW.findall(text):
        compiled = [f"- {line}" for line in text.splitlines() if line.startswith("compiled decoding step:")]
        return [*compiled, "", *table(["threads", "cached tok/s", "recomputed tok/s", "cached / recomputed"],
                                      [(*r[:3], f"{r[3]}x") for r in rows])]
    return []


def race_figures(text: str) -> list[str]:
    """bench.py race: the ratio of wall times to the classic's best val loss, and both runs' lines."""
    lines = [m.group(0) for m in RACE_LINE.finditer(text)]
    if m := RACE_RATIO.search(text):
        target, ratio, faster, tokens = m.groups()
        head = (f"- fast / classic wall time to the classic's best val loss ({target}): **{ratio}** "
                f"({faster}x faster; {tokens}x the tokens)")
    elif any("never reached" in line for line in lines):
        head = "- the fast recipe **never reached** the classic's best val loss (ratio: infinite)"
    else:
        return []
    return [head, "", "```", *lines, "```", ""]


def tests_figures(text: str) -> list[str]:
    """pytest: its summary line, and its lines on each skipped, failed or erring test."""
    lines = text.splitlines()
    summary = [m.group(0) for line in lines if (m := PYTEST_SUMMARY.search(line))]
    if not summary:
        return []
    said = [line for line in lines if re.match(r"(SKIPPED|FAILED|ERROR) ", line)]
    return [f"- pytest: **{summary[-1]}**", *(["", "```", *said[:30], "```"] if said else []), ""]


def section(part, result: dict, out_dir: Path) -> list[str]:
    """One part's section: what, command, time, status, figures (or where to look), a failure's tail."""
    log = out_dir / f"{part.name}.log"
    text = log.read_text(errors="replace") if log.exists() else None
    figures = part.figures(text) if part.figures and text is not None else []
    code = "" if result["exit_code"] is None else f", exit code {result['exit_code']}"
    lines = [f"## {part.name}: {result['status']}", "", f"{part.what[:1].upper()}{part.what[1:]}.", "",
             f"- command: `{part.command()}`",
             f"- time: {result['seconds']:.1f} s (limit {part.limit_s:.0f} s){code}; log: [{log.name}]({log.name})",
             *(f"- {note}" for note in part.notes), ""]
    lines += figures or [f"No figures recognized in its log: see {log.name}.", ""]
    if result["status"] != "ok":
        tail = text.splitlines()[-TAIL_LINES:] if text is not None else ["(no log)"]
        lines += [f"**{result['status']}**{code}; the last lines of {log.name}:", "", "```", *tail, "```", ""]
    return lines


def overview(parts, results: dict, stopped: str) -> list[str]:
    """Every part that runs here, its status and time; then whether the run is complete."""
    todo = [p for p in parts if not p.skip]
    rows = [(p.name, results[p.name]["status"] if p.name in results else "not run",
             f"{results[p.name]['seconds']:.1f} s" if p.name in results else "",
             f"[{p.name}.log]({p.name}.log)" if p.name in results else "") for p in todo]
    lines = ["## Parts", "", *table(["part", "status", "time", "log"], rows, align="llrl")]
    not_run = [p.name for p in todo if p.name not in results]
    bad = [name for name, r in results.items() if r["status"] != "ok"]
    if stopped:
        lines.append(f"**Incomplete**: {stopped}; not run: {', '.join(not_run) or 'none'}.")
    elif not_run:
        lines.append(f"**Incomplete**: still running, or stopped without notice, before {', '.join(not_run)}.")
    else:
        lines.append(f"{len(todo) - len(bad)} of {len(todo)} parts passed"
                     + (f"; {', '.join(bad)} did not (see below)." if bad else "."))
    return lines + [f"{len(parts) - len(todo)} parts skipped (last section).", ""]


def render(env: dict, parts, results: dict, out_dir: Path, quick: bool, stopped: str = "") -> str:
    """report.md: the environment, the parts' overview, one section per part that ran, the skipped."""
    lines = [f"# GPU benchmark: {env['name'] or 'no GPU'}", ""]
    if not env["cuda"]:
        lines += ["**No GPU figure was measured**: this machine has no CUDA GPU, so every GPU part was skipped "
                  "(last section). What ran checks the command's plumbing on tiny CPU settings; its figures say "
                  "nothing about a GPU.", ""]
    if quick:
        lines += ["**--quick**: small settings, for checking the command; the figures are not for comparison.", ""]
    lines += table(["", ""], [(key, env[key]) for key in HEADER], align="ll")
    lines += overview(parts, results, stopped)
    for part in parts:
        if part.name in results:
            lines += section(part, results[part.name], out_dir)
    skipped = [p for p in parts if p.skip]
    if skipped:
        lines += ["## Skipped", "", *(f"- **{p.name}** (`{p.command()}`): {p.skip}" for p in skipped), ""]
    return "\n".join(lines)
