"""Ablate: train variants of one config, each with several seeds and the same budget, and
compare them (docs/ablations/README.md).

    python ablate.py SWEEP.toml [--report] [--section.key=value ...]

--report only rewrites the results; a --section.key=value applies to every run. A sweep:

    seeds = [1337, 1338]
    # optional, as are name and out_dir
    base = "configs/shakespeare_char_cpu.toml"
    # optional: for every run
    [overrides]
    train.max_steps = 600
    # the first is the baseline; the others change a few settings, never the batches
    [[variants]]
    name = "sdpa"
    [[variants]]
    name = "mqa"
    model.attention = "gqa"
    model.n_kv_head = 1

The same command again skips finished runs and resumes an unfinished one.
"""
import shlex
import sys

from ablation.report import plural, write_report
from ablation.sweep import load_sweep, run_sweep
from common import UserError, run_cli


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        return print(__doc__) or 0
    if not argv or argv[0].startswith("--"):
        raise UserError("give a sweep file first: "
                        "python ablate.py SWEEP.toml [--report] [--key=value ...]")
    sweep = load_sweep(argv[0], [a for a in argv[1:] if a != "--report"])
    print(f"# sweep {sweep.name}: {plural(len(sweep.variants), 'variant')} x "
          f"{plural(len(sweep.seeds), 'seed')} = {plural(len(sweep.runs), 'run')} "
          f"-> {sweep.out_dir}")
    stopped, failed = (0, []) if "--report" in argv else run_sweep(sweep)
    write_report(sweep, "python ablate.py " + shlex.join(argv))
    results = sweep.out_dir / "results.md"
    print(results.read_text(encoding="utf-8"))
    print(f"# {results} (beside it: results.csv, runs.csv, loss_curves.png)")
    if failed:
        raise UserError(f"{len(failed)} run(s) failed, first {failed[0]}; "
                        f"the same command runs them again")
    # 0, or 128 + the signal that stopped a run
    return stopped


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
