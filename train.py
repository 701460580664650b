"""Train a GPT.

    python train.py                                      # the default: char-level tinyshakespeare on CPU
    python train.py --data notes.txt                     # your own text file (out dir: out/notes)
    python train.py configs/shakespeare_char_cpu.toml --model.n_layer=6 --train.lr=1e-3
    python train.py configs/shakespeare_char_cpu.toml --resume
    torchrun --standalone --nproc_per_node=4 train.py CONFIG     # 4 GPUs (or CPU processes), see README

Options: a config file (TOML), --section.key=value overrides (listed below, and in docs/config.md),
--data FILE, --out_dir DIR, --resume (continue the latest checkpoint in the out dir, with the settings
of that run: only what the config file and the command line set changes them, each change named),
--overwrite (start over in an out dir that holds an earlier run's checkpoints).
"""
try:   # from here on Ctrl-C ends the command at once, quietly (see common.run_cli)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
except KeyboardInterrupt:   # Ctrl-C came while signal itself was being imported
    raise SystemExit(130)

import sys

from common import run_cli  # noqa: E402


def main(argv: list[str]) -> int:
    from training.config import build_config, check_resume_keeps, help_text
    from training.outdir import OutDir
    from training.trainer import train

    if "-h" in argv or "--help" in argv:
        print(__doc__ + "\nSettings (--section.key=value; the default shown):" + help_text(), end="")
        return 0
    flags = {a for a in argv if a in ("--resume", "--overwrite")}
    rest = [a for a in argv if a not in flags]
    config_file = rest.pop(0) if rest and not rest[0].startswith("--") else None
    cfg = build_config(config_file, rest)
    if "--resume" in flags and (stored := OutDir(cfg.out_dir).stored_config()) is not None:
        # the run the out dir holds goes on: only what the config file and the command line set changes it
        cfg = build_config(config_file, rest, base={**stored, "out_dir": cfg.out_dir})
        check_resume_keeps(stored, cfg)
    summary = train(cfg, resume="--resume" in flags, overwrite="--overwrite" in flags)
    return summary["exit_code"]   # 0, or 128 + the signal that stopped it (130 for Ctrl-C, 143 for SIGTERM)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
