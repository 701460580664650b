"""Train a GPT.

    python train.py                                      # the default: char-level tinyshakespeare on CPU
    python train.py --data notes.txt                     # your own text file (out dir: out/notes)
    python train.py configs/shakespeare_char_cpu.toml --model.n_layer=6 --train.lr=1e-3
    python train.py configs/shakespeare_char_cpu.toml --resume
    python train.py --resume out/notes/ckpt_0001000.pt   # continue from a chosen checkpoint of a run
    torchrun --standalone --nproc_per_node=4 train.py CONFIG     # 4 GPUs (or CPU processes), see README

Options: a config file (TOML), --section.key=value overrides (listed below, and in docs/config.md),
--data FILE, --out_dir DIR, --resume [CHECKPOINT] (continue the latest checkpoint in the out dir, or
the one named, with the settings of that run: only what the config file and the command line set
changes them, each change named), --overwrite (start over in an out dir that holds an earlier run).
Runs go to out/<name> in the repository, and prepared data to data/prepared/, wherever you run from.
"""
try:   # from here on Ctrl-C ends the command at once, quietly (see common.run_cli)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
except KeyboardInterrupt:   # Ctrl-C came while signal itself was being imported
    raise SystemExit(130)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from common import UserError, run_cli  # noqa: E402


def main(argv: list[str]) -> int:
    from training.config import build_config, help_text, load_toml
    from training.outdir import run_config
    from training.trainer import train

    if "-h" in argv or "--help" in argv:
        print(__doc__ + "\nSettings (--section.key=value; the default shown):" + help_text(), end="")
        return 0
    rest, resume, overwrite, checkpoint = [], False, False, None
    for i, a in enumerate(argv):
        if a == "--overwrite":
            overwrite = True
        elif a.partition("=")[0] == "--resume":
            resume, checkpoint = True, a.partition("=")[2] or None
        elif i and argv[i - 1] == "--resume" and a.endswith(".pt"):
            checkpoint = a
        else:
            rest.append(a)
    config_file = rest.pop(0) if rest and not rest[0].startswith("--") else None
    if config_file and not config_file.endswith(".toml") and Path(config_file).is_file():
        raise UserError(f"{config_file} is not a config file (a .toml); to train on it: --data {config_file}")
    if checkpoint is not None:   # that checkpoint's run goes on, in the folder it is in
        if not Path(checkpoint).is_file():
            raise UserError(f"--resume {checkpoint}: no such checkpoint file")
        rest.append(f"--out_dir={Path(checkpoint).resolve().parent}")
    cfg = build_config(config_file, rest, validate=False)   # (validated once a resumed run's own settings are in)
    if resume and (cfg_path := run_config(cfg.out_dir)).is_file():
        # the run the out dir holds goes on: only what the config file and the command line set changes it
        cfg = build_config(config_file, rest, base={**load_toml(cfg_path), "out_dir": cfg.out_dir}, validate=False)
    cfg.validate()
    summary = train(cfg, resume=resume, overwrite=overwrite, checkpoint=checkpoint)
    return summary["exit_code"]   # 0, or 128 + the signal that stopped it (130 for Ctrl-C, 143 for SIGTERM)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
