"""How fast, and in how much memory, a large text file is prepared: streaming vs reading it whole.

    python bench.py prepare                          # a 1 GB file in /tmp; char and gpt2
    python bench.py prepare --mb 200 --plain-mb 50

Generates a text file of random tinyshakespeare lines (in the temp dir, never in the repo), then
prepares it with each tokenizer in a child process and reports MB/s and the child's peak resident
memory. The plain approach (read the file into one str, encode it to a Python list, convert) needs
~10-50 bytes per character, so it runs on a smaller file (--plain-mb) that fits in memory; streaming
runs on that same file too, for a like-for-like ratio, and on the large one.

Peak memory is the child's VmHWM from /proc (its own high-water mark). ru_maxrss from wait4 is not
used: Linux carries the parent's resident size into it across fork and exec.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Runs `-m MODULE ARGS` or `-c CODE ARGS` and reports the process's peak resident memory on stderr.
_MEASURE = """
import atexit, runpy, sys
def report():
    try:
        kb = next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]
    except (OSError, StopIteration):
        import resource; kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sys.stderr.write(f"\\npeak_kb={kb}\\n")
atexit.register(report)
kind, target, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<code>", "exec"), {"__name__": "__main__"})
"""

# The whole-file approach: read the text into one str, encode it to a list, convert.
_PLAIN = """
import sys, numpy as np
from data.tokenizers import build_tokenizer
path, name, out = sys.argv[1:4]
text = open(path, encoding="utf-8").read()
split = int(len(text) * 0.9)
tok = build_tokenizer(name, text)
for part, piece in (("train", text[:split]), ("val", text[split:])):
    np.array(tok.encode(piece), dtype=np.uint16 if tok.vocab_size <= 65536 else np.uint32).tofile(f"{out}/{part}.bin")
"""


def measure(kind: str, target: str, args: list[str]) -> tuple[float, float]:
    """(seconds, peak resident MB) of `python -m MODULE args` (kind "-m") or `python -c CODE args`."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _MEASURE, kind, target, *args], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"{target[:40]} {' '.join(args)} failed: {r.stderr[-2000:]}")
    peak = [l for l in r.stderr.splitlines() if l.startswith("peak_kb=")]
    return took, int(peak[-1].split("=")[1]) / 1024 if peak else float("nan")


def make_text(path: Path, mb: int, source: Path, seed: int = 0) -> None:
    """mb megabytes of lines drawn at random from source, written 16 MB at a time."""
    lines = [l + "\n" for l in source.read_text(encoding="utf-8").splitlines() if l.strip()]
    rng = np.random.default_rng(seed)
    target, written = mb * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            chunk = "".join(lines[i] for i in rng.integers(0, len(lines), 400_000))[:target - written]
            f.write(chunk)
            written += len(chunk.encode("utf-8"))


def find_source() -> Path:
    for p in (ROOT / "data" / "tinyshakespeare.txt", ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"):
        if p.is_file():
            return p
    sys.exit("no tinyshakespeare.txt found: pass --source FILE (any text file)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1000, help="size of the large file (streaming only)")
    p.add_argument("--plain-mb", type=int, default=64, help="size of the file both approaches prepare")
    p.add_argument("--tokenizers", default="char,gpt2", help="comma-separated: char, gpt2, bpe:4096, ...")
    p.add_argument("--source", type=Path, default=None, help="text to draw lines from (default: tinyshakespeare)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "prepare_bench")
    args = p.parse_args(argv)
    source = args.source or find_source()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"# {os.cpu_count()} CPUs; times are wall clock on a machine that may be shared")
    rows = []
    try:
        for mb in sorted({args.plain_mb, args.mb}):
            path = args.dir / f"text_{mb}mb.txt"
            if not path.exists() or path.stat().st_size < mb * 1_000_000:
                print(f"# writing {path} ({mb} MB) ...", flush=True)
                make_text(path, mb, source)
            size = path.stat().st_size / 1e6
            for tok in args.tokenizers.split(","):
                plain = mb == args.plain_mb and not tok.startswith("bpe:")   # a trained BPE exists only streamed
                approaches = ["stream", "plain"] if plain else ["stream"]
                for approach in approaches:
                    out = args.dir / f"out_{approach}"
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    if approach == "stream":
                        took, peak = measure("-m", "data.prepare", [str(path), "--tokenizer", tok, "--root", str(out)])
                    else:
                        took, peak = measure("-c", _PLAIN, [str(path), tok, str(out)])
                    shutil.rmtree(out, ignore_errors=True)
                    rows.append((size, tok, approach, size / took, peak))
                    print(f"{size:8.0f} MB  {tok:8s}  {approach:6s}  {size / took:7.1f} MB/s  peak {peak:7.0f} MB", flush=True)
    finally:
        for f in args.dir.glob("text_*mb.txt"):
            f.unlink()
    print("\n# streaming / plain on the same file (speed: higher is better; memory: lower is better)")
    for tok in args.tokenizers.split(","):
        got = {r[2]: r for r in rows if r[1] == tok and round(r[0]) == round(args.plain_mb * 1.0)}
        if "plain" in got and "stream" in got:
            s, pl = got["stream"], got["plain"]
            print(f"{tok:8s}: speed x{s[3] / pl[3]:.2f}, peak memory x{s[4] / pl[4]:.2f} "
                  f"({s[4]:.0f} MB vs {pl[4]:.0f} MB at {s[0]:.0f} MB of text)")
    print(f"# the plain approach was not run on the {args.mb} MB file: its memory grows with the file "
          f"(char: a Python list of one int per character), more than this machine should risk")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
