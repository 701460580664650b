"""How fast, and in how much memory, a large text file is prepared: streaming vs reading it whole.

    python bench.py prepare                          # a 1 GB and a 64 MB file; char and gpt2
    python bench.py prepare --mb 200 --plain-mb 50

Generates text files of random tinyshakespeare lines in a new temporary directory (under --dir, by
default the system's temp dir; never in the repo), prepares them with each tokenizer in a child
process and reports MB/s and the child's peak resident memory. It says what it writes before writing
it, and removes all of it (the directory too) when it ends, fails or is stopped by a signal. The
plain approach (read the file into one str, encode it to a Python list, convert) needs ~10-50 bytes
per character, so it runs on a smaller file (--plain-mb) that fits in memory; streaming runs on that
same file too, for a like-for-like ratio, and on the large one.

Peak memory is the child's VmHWM from /proc (its own high-water mark); where there is no /proc, its
getrusage ru_maxrss; where neither exists (Windows), it is unknown. ru_maxrss from wait4 is not used:
Linux carries the parent's resident size into it across fork and exec.
"""
import math
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from common import ConfigError, Printer, RunError, TokenizerError, check, on_stop_signals, unwind_on_stop
from data.tokenizers import check_tokenizer_spec

ROOT = Path(__file__).resolve().parents[1]
TOKEN_BYTES = 2   # at most about this many bytes of prepared tokens per byte of text (char ids are uint16)

# Runs `-m MODULE ARGS` or `-c CODE ARGS` and reports the process's peak resident memory on stderr
# (nothing where the system cannot tell it).
_MEASURE = """
import atexit, runpy, sys
def peak_kb():
    try:
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith("VmHWM")).split()[1])
    except (OSError, StopIteration):
        pass
    try:
        import resource   # Unix only
    except ImportError:
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb // 1024 if sys.platform == "darwin" else kb   # macOS counts bytes, Linux kilobytes
def report():
    kb = peak_kb()
    if kb is not None:
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


def add_options(p) -> None:
    p.add_argument("--mb", type=int, default=1000, help="MB of the large text file, prepared by streaming only "
                   "(default 1000: a 1 GB file, written to --dir and removed afterwards)")
    p.add_argument("--plain-mb", type=int, default=64, help="MB of the smaller file, prepared both ways (default 64; "
                   "at most --mb)")
    p.add_argument("--tokenizers", default="char,gpt2", help="comma-separated: char, gpt2, bpe:4096, ...")
    p.add_argument("--source", type=Path, default=None, help="text to draw lines from (default: tinyshakespeare)")
    p.add_argument("--dir", type=Path, default=None, help="where to make the temporary directory the files go in, "
                   f"removed afterwards (default: {tempfile.gettempdir()}); it needs about 3x --mb MB free")


def checked(args) -> dict:
    """bench_prepare's arguments from the command line's; a ConfigError naming the option, or a RunError
    where --dir lacks the space, before anything is written."""
    check("--mb", args.mb, at_least=1)
    check("--plain-mb", args.plain_mb, at_least=1)
    if args.plain_mb > args.mb:
        raise ConfigError(f"--plain-mb={args.plain_mb} must be at most --mb={args.mb} (the plain approach runs on "
                          f"the smaller file)")
    tokenizers = args.tokenizers.split(",")
    for name in tokenizers:
        try:
            check_tokenizer_spec(name)
        except TokenizerError as e:
            raise ConfigError(f"--tokenizers: {e}") from None
    parent = args.dir or Path(tempfile.gettempdir())
    if not parent.is_dir():
        raise ConfigError(f"--dir {parent} is not a directory")
    need, free = most_written(sorted({args.plain_mb, args.mb})), shutil.disk_usage(parent).free / 1e6
    if free < need:
        raise RunError(f"--dir {parent} has {free:,.0f} MB free; this run writes up to about {need:,} MB "
                       f"(make --mb smaller, or give another --dir)")
    return {"mb": args.mb, "plain_mb": args.plain_mb, "tokenizers": tokenizers, "lines": source_lines(args.source),
            "parent": parent}


def source_lines(path: Path | None) -> list[str]:
    """The non-blank lines of the text to draw from, each with its newline; a ConfigError naming --source."""
    if path is None:
        found = [p for p in (ROOT / "data" / "tinyshakespeare.txt",
                             ROOT.parent / "shared" / "data" / "tinyshakespeare.txt") if p.is_file()]
        if not found:
            raise ConfigError("no tinyshakespeare.txt found: give --source FILE (any text file)")
        path = found[0]
    try:
        lines = [line + "\n" for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as e:
        raise ConfigError(f"--source {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--source {path} is not UTF-8 text") from None
    if not lines:
        raise ConfigError(f"--source {path} has no text")
    return lines


def most_written(sizes: list[int]) -> int:
    """MB on disk at the most: every text file, and the prepared tokens of the largest."""
    return sum(sizes) + TOKEN_BYTES * max(sizes)


def measure(kind: str, target: str, args: list[str]) -> tuple[float, float]:
    """(seconds, peak resident MB; nan where unknown) of `python -m MODULE args` (kind "-m") or
    `python -c CODE args`; a RunError with the child's last line if it fails."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _MEASURE, kind, target, *args], cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    said = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("peak_kb=")]
    if r.returncode != 0:
        what = target if kind == "-m" else target.strip().splitlines()[0][:40]
        raise RunError(f"{what} {' '.join(args)} failed (exit code {r.returncode}): "
                       f"{said[-1].removeprefix('error: ')[:200] if said else 'no message'}")
    peak = [line for line in r.stderr.splitlines() if line.startswith("peak_kb=")]
    return took, int(peak[-1].split("=")[1]) / 1024 if peak else float("nan")


def peak_text(mb: float) -> str:
    return "peak unknown" if math.isnan(mb) else f"peak {mb:7.0f} MB"   # nan: the system could not tell


def make_text(path: Path, mb: int, lines: list[str], seed: int = 0) -> None:
    """mb megabytes of lines drawn at random from lines, written 16 MB at a time."""
    rng = np.random.default_rng(seed)
    target, written = mb * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            chunk = "".join(lines[i] for i in rng.integers(0, len(lines), 400_000))[:target - written]
            f.write(chunk)
            written += len(chunk.encode("utf-8"))


def bench_prepare(mb: int, plain_mb: int, tokenizers: list[str], lines: list[str], parent: Path,
                  say=None) -> None:
    """Write the text files in a new directory under parent, time each preparation of them, and remove
    it all: when done, on an error, or at SIGINT, SIGTERM or SIGHUP (raised as Interrupted once it is
    removed). Print the rows (MB, tokenizer, approach, MB/s, peak MB) and the comparison."""
    say = say or Printer()
    stop = unwind_on_stop()   # the work is removed as the first signal unwinds it
    sizes = sorted({plain_mb, mb})
    work = parent / f"bench_prepare_{uuid.uuid4().hex[:12]}"   # named first: removed whatever point a signal stops
    with on_stop_signals(stop):
        try:
            say(f"# writes text files of {' and '.join(f'{n:,} MB' for n in sizes)} in {work}, then each "
                f"preparation's tokens beside them (one at a time, up to {TOKEN_BYTES} bytes per byte of text): "
                f"about {most_written(sizes):,} MB at most; all of it is removed afterwards")
            work.mkdir()
            rows = measure_all(work, sizes, plain_mb, tokenizers, lines, say)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    compare(rows, plain_mb, mb, tokenizers, say)


def measure_all(work: Path, sizes: list[int], plain_mb: int, tokenizers: list[str], lines: list[str],
                say) -> list[tuple]:
    """Each file written, then prepared by each tokenizer by streaming (and whole, the plain-mb one)."""
    say(f"# {len(sizes)} file(s) x {len(tokenizers)} tokenizer(s); times are wall clock on a machine that may be "
        f"shared")
    rows = []
    for mb in sizes:
        path = work / f"text_{mb}mb.txt"
        make_text(path, mb, lines)
        size = path.stat().st_size / 1e6
        for tok in tokenizers:
            plain = mb == plain_mb and not tok.startswith("bpe:")   # a trained BPE exists only streamed
            for approach in ["stream", "plain"] if plain else ["stream"]:
                out = work / f"out_{approach}"
                out.mkdir()
                if approach == "stream":
                    took, peak = measure("-m", "data.prepare", [str(path), "--tokenizer", tok, "--root", str(out)])
                else:
                    took, peak = measure("-c", _PLAIN, [str(path), tok, str(out)])
                shutil.rmtree(out)                                # one preparation's tokens on disk at a time
                rows.append((size, tok, approach, size / took, peak))
                say(f"{size:8.0f} MB  {tok:8s}  {approach:6s}  {size / took:7.1f} MB/s  {peak_text(peak)}")
    return rows


def compare(rows: list[tuple], plain_mb: int, mb: int, tokenizers: list[str], say) -> None:
    """Streaming against plain on the same file, per tokenizer."""
    say("\n# streaming / plain on the same file (speed: higher is better; memory: lower is better)")
    for tok in tokenizers:
        got = {r[2]: r for r in rows if r[1] == tok and round(r[0]) == plain_mb}
        if "plain" in got and "stream" in got:
            s, pl = got["stream"], got["plain"]
            memory = (f"peak memory x{s[4] / pl[4]:.2f} ({s[4]:.0f} MB vs {pl[4]:.0f} MB at {s[0]:.0f} MB of text)"
                      if not math.isnan(s[4] + pl[4]) else "peak memory unknown here")
            say(f"{tok:8s}: speed x{s[3] / pl[3]:.2f}, {memory}")
    if mb > plain_mb:
        say(f"# the plain approach was not run on the {mb} MB file: its memory grows with the file "
            f"(char: a Python list of one int per character), more than this machine should risk")
