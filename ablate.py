"""Ablate: train variants of one config, each with several seeds and the same budget, and
compare them.

    python ablate.py SWEEP.toml [--report] [--section.key=value ...]

--report only rewrites the results; a --section.key=value applies to every run. A sweep
file (TOML):

    # every variant is trained with every seed
    seeds = [1337, 1338]
    # optional, as are name (default: the file's) and out_dir
    base = "configs/shakespeare_char_cpu.toml"
    # optional: on top of base, for every run
    [overrides]
    train.max_steps = 600
    # the first is the baseline
    [[variants]]
    name = "sdpa"
    # the others change a few settings, but not the data, the steps, the batch shape or
    # the evaluation: for a given seed every variant sees the same batches
    [[variants]]
    name = "mqa"
    model.attention = "gqa"
    model.n_kv_head = 1

Paths resolve as a config file's. The runs are train(), one after another in this process,
in <out_dir>/<variant>/seed<seed>/ (out_dir: by default out/ablations/<name>). The same
command again skips finished runs and resumes an unfinished one from its last checkpoint;
Ctrl-C stops after the current step, saving it. results.md (with results.csv, runs.csv,
loss_curves.png) calls a variant beyond the noise if its mean final val loss is over 2
standard errors σ·√(1/n + 1/n_baseline) from the baseline's, σ the seed-to-seed standard
deviation pooled over all variants (95% for one comparison; 'no': not resolved).
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
