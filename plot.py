"""Overlay the val loss curves of several runs, by step and by wall-clock time, each run
named by the settings in which their configs differ.
"""
import hashlib
import os
import sys
from pathlib import Path

from common import ROOT, ArgumentParser, UserError, atomic_write, flat, load_toml, run_cli
from viz import curves

# a default picture's folder, and the bytes of its name (file systems allow 255)
DEFAULT_DIR = ROOT / "out"
LONGEST_NAME = 120
# what is shown or kept of a run, not what it computes: never in the legend (keys, prefixes)
SHOWN = ("out_dir", "data.prepared_dir", "log.", "train.log_interval",
         "train.keep_checkpoints", "train.sample_")


def parse_args(argv):
    p = ArgumentParser(description="Overlay the loss curves of several runs.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's out dir")
    p.add_argument("--out", type=Path, help="the picture's path, .png, .svg or .pdf "
                   "(default: out/runs-<the runs' names>.png)")
    p.add_argument("--bpb", action="store_true",
                   help="val bits per byte (fair across tokenizers), not val loss")
    args = p.parse_args(argv)
    if args.out is not None and args.out.suffix.lower() not in (".png", ".svg", ".pdf"):
        p.error(f"--out {args.out}: the picture is written as .png, .svg or .pdf, "
                f"named by its ending")
    return args


def default_out(paths: list[Path], bpb: bool) -> Path:
    """out/runs-<names>.png, each run named by its path below the runs' common folder: the
    same runs redraw their picture, others never replace it."""
    resolved = [p.resolve() for p in paths]
    common = Path(os.path.commonpath(resolved))
    names = [r.relative_to(common).as_posix().replace("/", "_") if r != common else r.name
             for r in resolved]
    name = "runs-" + "+".join(names) + ("-bpb" if bpb else "")
    if len(whole := os.fsencode(name)) > LONGEST_NAME:
        # too long for a file: its start, in whole characters, and a hash of the whole
        start = whole[:LONGEST_NAME - 9].decode("utf-8", errors="ignore")
        name = f"{start}-{hashlib.sha256(whole).hexdigest()[:8]}"
    return DEFAULT_DIR / f"{name}.png"


def differences(configs: list[dict], most: int = 4) -> list[str]:
    """Per flattened config, 'key=value, ...' of the settings not all share."""
    keys = sorted({k for c in configs for k in c if not k.startswith(SHOWN)})
    differing = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
    more = f" and {len(differing) - most} more" if len(differing) > most else ""
    return [", ".join(f"{k}={c.get(k)}" for k in differing[:most]) + more for c in configs]


def read_run(path: Path) -> tuple[list[dict], dict]:
    if not (path / "metrics.jsonl").is_file() or not (path / "config.toml").is_file():
        raise UserError(f"{path} holds no run (no metrics.jsonl and config.toml)")
    evals = [r for r in curves.read_records(path / "metrics.jsonl") if r["kind"] == "eval"]
    if not evals:
        raise UserError(f"{path} has no evaluation yet to draw")
    return evals, flat(load_toml(path / "config.toml", "readable TOML"))


def main(argv) -> int:
    args = parse_args(argv)
    paths = [Path(p) for p in args.runs]
    if len({p.resolve() for p in paths}) != len(paths):
        raise UserError("a run is named twice")
    runs = [read_run(p) for p in paths]
    metric, name = ("val_bpb", "val bits per byte") if args.bpb else ("val_loss", "val loss")
    by_time = "wall-clock seconds (training + evals)"
    panels = [curves.Panel(f"{name} by step", "step", name),
              curves.Panel(f"{name} by wall-clock time", by_time, name)]
    diffs = differences([config for _, config in runs])
    for path, (evals, _), diff in zip(paths, runs, diffs):
        label = f"{path}: {diff}" if diff else str(path)
        for panel, x in zip(panels, ("step", "elapsed_s")):
            panel.lines.append(curves.Line(label, *curves.points(evals, x, metric)))
    out = args.out or default_out(paths, args.bpb)
    picture = curves.draw(panels, f"{len(runs)} runs", legend_below=True,
                          format=out.suffix[1:].lower())
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, picture)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
