"""Ablate: train a few variants of one config, each with several seeds, under the same budget, and
compare them (results.md, results.csv, loss_curves.png in the sweep's out dir).

    python ablate.py configs/ablations/attention_cpu.toml
    python ablate.py configs/ablations/attention.toml --train.device=cuda:1   # applies to every run
    python ablate.py SWEEP.toml --report                                      # only rewrite the results

The sweep file format is described in ablation/sweep.py (each run: ablation/run.py); its paths are
relative to the repository for a sweep file in it (else to the file's folder), wherever the command
runs, and its runs go to out/ablations/<name> in the repository unless it or --out_dir says otherwise.
Running the same command again skips the finished runs and resumes an unfinished one from its last
checkpoint; Ctrl-C stops after the current step of the current run (with a checkpoint).
"""
try:   # from here on Ctrl-C ends the command at once, quietly (see common.run_cli)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
except KeyboardInterrupt:   # Ctrl-C came while signal itself was being imported
    raise SystemExit(130)

import shlex
import sys

from common import UserError, run_cli  # noqa: E402


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not argv or argv[0].startswith("--"):
        raise UserError("give a sweep file first: python ablate.py SWEEP.toml [--report] [--section.key=value ...] "
                          "(see --help)")
    from ablation.report import plural, write_report
    from ablation.sweep import load_sweep, run_sweep

    sweep = load_sweep(argv[0], [a for a in argv[1:] if a != "--report"])
    print(f"# sweep {sweep.name}: {plural(len(sweep.variants), 'variant')} x {plural(len(sweep.seeds), 'seed')} = "
          f"{plural(len(sweep.runs), 'run')} -> {sweep.out_dir}")
    outcome = {"failed": [], "interrupted": False} if "--report" in argv else run_sweep(sweep)
    write_report(sweep, "python ablate.py " + shlex.join(argv))
    print((sweep.out_dir / "results.md").read_text(encoding="utf-8"))
    if outcome["interrupted"]:
        return 130
    if outcome["failed"]:
        run, why = outcome["failed"][0]
        raise UserError(f"{len(outcome['failed'])} of {len(sweep.runs)} runs failed (first: {run.label}: {why}); "
                       f"see their train.log; the command runs them again")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
