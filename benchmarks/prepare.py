"""How fast, and in how much memory, a large text is prepared: streaming (data/prepare.py) against
reading it whole (the text as one str, encoded to one Python list, converted to an array).

    python bench.py prepare                          # a 1 GB and a 64 MB file; char and gpt2
    python bench.py prepare --mb 200 --plain-mb 50 --tokenizers char,gpt2,bpe:4096

Text files of random lines of tinyshakespeare (or --source) are written in a new directory under
--dir (the system's temp dir by default; never in the repository), said before it is written and
removed when the command ends, fails or is stopped by a signal. Each preparation runs in a child
process, which reports its own peak resident memory (benchmarks.machine.peak_memory; unknown on
Windows). Reading whole needs some tens of bytes per character, so it runs on the smaller file
(--plain-mb) only; streaming runs on both, for a like-for-like ratio.
"""
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import UserError, check, on_stop_signals, unwind_on_stop
from data.tokenizers import check_tokenizer_spec

ROOT = Path(__file__).resolve().parents[1]
TOKEN_BYTES = 2   # at most about this many bytes of prepared tokens per byte of text (char ids are uint16)
# Prepared in a child process, with the same arguments (TEXT --tokenizer T --root OUT): streaming (python -m
# data.prepare), or reading whole (one str, one list of ids, one array).
STREAM = """import runpy
runpy.run_module("data.prepare", run_name="__main__", alter_sys=True)
"""
WHOLE = """import sys, numpy as np
from data.tokenizers import build_tokenizer
path, _, tokenizer, _, out = sys.argv[1:]
text = open(path, encoding="utf-8").read()
np.array(build_tokenizer(tokenizer, text).encode(text), dtype=np.uint32).tofile(out + "/tokens.bin")
"""
# Runs first in the child: at its exit, whatever the way, it says its own peak memory.
PEAK = """import atexit, sys
from benchmarks.machine import peak_memory
atexit.register(lambda: print(f"\\npeak={peak_memory()}", file=sys.stderr))
"""


def add_options(p) -> None:
    p.add_argument("--mb", type=int, default=1000, help="MB of the large text file, prepared by streaming only "
                   "(default 1000: a 1 GB file, written to --dir and removed afterwards)")
    p.add_argument("--plain-mb", type=int, default=64, help="MB of the smaller file, prepared both ways (default 64; "
                   "at most --mb)")
    p.add_argument("--tokenizers", default="char,gpt2", help="comma-separated: char, gpt2, bpe:4096, ...")
    p.add_argument("--source", type=Path, default=None, help="text to draw lines from (default: tinyshakespeare)")
    p.add_argument("--dir", type=Path, default=None, help="where the files go, in a temporary directory removed "
                   f"afterwards (default: {tempfile.gettempdir()}); it needs about 3x --mb MB free")


def checked(args) -> dict:
    """bench_prepare's arguments; a UserError naming the option, or a UserError where --dir lacks the
    space, before anything is written."""
    check("--mb", args.mb, at_least=1)
    check("--plain-mb", args.plain_mb, at_least=1)
    if args.plain_mb > args.mb:
        raise UserError(f"--plain-mb={args.plain_mb} must be at most --mb={args.mb} (reading whole runs on the "
                          f"smaller file)")
    for name in args.tokenizers.split(","):
        try:
            check_tokenizer_spec(name)
        except UserError as e:
            raise UserError(f"--tokenizers: {e}") from None
    path = args.source or ROOT / "data" / "tinyshakespeare.txt"   # (which ships with the repository)
    try:
        lines = [line + "\n" for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--source {path}: {getattr(e, 'strerror', None) or 'not UTF-8 text'}") from None
    if not lines:
        raise UserError(f"--source {path} has no text")
    parent = args.dir or Path(tempfile.gettempdir())
    if not parent.is_dir():
        raise UserError(f"--dir {parent} is not a directory")
    need, free = sum({args.plain_mb, args.mb}) + TOKEN_BYTES * args.mb, shutil.disk_usage(parent).free / 1e6
    if free < need:
        raise UserError(f"--dir {parent} has {free:,.0f} MB free; this run writes up to about {need:,} MB "
                       f"(make --mb smaller, or give another --dir)")
    return {"mb": args.mb, "plain_mb": args.plain_mb, "tokenizers": args.tokenizers.split(","), "lines": lines,
            "parent": parent, "need": need}


def measure(code: str, args: list[str]) -> tuple[float, float]:
    """(seconds, peak resident MB; nan where unknown) of `python -c CODE ARGS` run in the repository; a
    UserError with the child's last line if it fails."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK + code, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("peak=")]
    if done.returncode != 0:
        raise UserError(f"measuring {' '.join(args)} failed (exit code {done.returncode}): "
                       f"{said[-1].removeprefix('error: ')[:200] if said else 'no message'}")
    peak = re.search(r"^peak=(\d+)$", done.stderr, re.M)   # (peak=None where unknown)
    return took, int(peak[1]) / 2**20 if peak else math.nan


def bench_prepare(mb: int, plain_mb: int, tokenizers: list[str], lines: list[str], parent: Path, need: int,
                  say=print) -> None:
    """Write the text files in a new directory under parent, time each preparation of them, say how they
    compare, and remove it all: when done, on an error, or at a signal (raised as Interrupted once removed)."""
    rows, sizes = {}, sorted({plain_mb, mb})
    with on_stop_signals(unwind_on_stop()), \
            tempfile.TemporaryDirectory(prefix="bench_prepare_", dir=parent, ignore_cleanup_errors=True) as work:
        work = Path(work)
        say(f"# writes text files of {' and '.join(f'{n:,} MB' for n in sizes)} in {work}, then each preparation's "
            f"tokens beside them, one at a time: about {need:,} MB at most; all of it is removed afterwards. Times "
            f"are wall clock, on a machine that may be shared")
        for size in sizes:
            text, rng, left = work / f"text_{size}mb.txt", np.random.default_rng(0), size * 1_000_000
            with open(text, "w", encoding="utf-8") as f:
                while left > 0:   # (a character is a byte or more: the last chunk may go a few bytes over)
                    chunk = "".join(lines[i] for i in rng.integers(0, len(lines), 100_000))[:left]
                    left -= len(chunk.encode())
                    f.write(chunk)
            for tok in tokenizers:   # (a trained BPE exists only streamed)
                for how in ["stream", "plain"] if size == plain_mb and not tok.startswith("bpe:") else ["stream"]:
                    (work / "out").mkdir()
                    args = [str(text), "--tokenizer", tok, "--root", str(work / "out")]
                    took, peak = rows[size, tok, how] = measure(STREAM if how == "stream" else WHOLE, args)
                    shutil.rmtree(work / "out")
                    say(f"{size:8,} MB  {tok:8s}  {how:6s}  {size / took:7.1f} MB/s  "
                        + ("peak unknown" if math.isnan(peak) else f"peak {peak:7.0f} MB"))
    say("# streaming / reading whole on the same file (speed: higher is better; memory: lower is better)")
    for tok in [tok for tok in tokenizers if (plain_mb, tok, "plain") in rows]:
        (s_took, s_peak), (p_took, p_peak) = rows[plain_mb, tok, "stream"], rows[plain_mb, tok, "plain"]
        say(f"{tok:8s}: speed x{p_took / s_took:.2f}, " + ("peak memory unknown here" if math.isnan(s_peak + p_peak)
            else f"peak memory x{s_peak / p_peak:.2f} ({s_peak:.0f} MB vs {p_peak:.0f} MB at {plain_mb:,} MB of text)"))
    if mb > plain_mb:
        say(f"# reading whole ran on the {plain_mb:,} MB file only, as --plain-mb {plain_mb} says, not on the "
            f"{mb:,} MB one")
