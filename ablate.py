"""Ablate: train variants of one config, each with several seeds and the same budget, and
compare them. The sweep file and the report: docs/ablations/README.md; examples:
configs/ablations/.

    python ablate.py SWEEP.toml [--report] [--section.key=value ...]

--report only rewrites the results; a --section.key=value applies to every run. The same
command again skips finished runs and resumes an unfinished one.
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
