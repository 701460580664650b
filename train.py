"""Train a GPT.

    # the default: char-level tinyshakespeare on CPU
    python train.py
    # your own text file (out dir: out/notes)
    python train.py --data notes.txt
    python train.py configs/shakespeare_char_cpu.toml --model.n_layer=6 --train.lr=1e-3
    python train.py configs/shakespeare_char_cpu.toml --resume
    # continue from a chosen checkpoint of a run
    python train.py --resume out/notes/ckpt_0001000.pt
    # 4 GPUs (or CPU processes), see README
    torchrun --standalone --nproc_per_node=4 train.py CONFIG

Options: a config file (TOML), --section.key=value settings (listed below), --data FILE,
--out_dir DIR, --resume [CHECKPOINT] (continue the out dir's latest checkpoint, or the
one named, with that run's settings: only what the config file and the command line set
changes them), --overwrite (start over in an out dir that holds an earlier run, which is
kept beside it as <out_dir>.replaced-<time>).
Runs go to out/<name> in the repository, and prepared data to data/prepared/, wherever
you run from.
"""
import sys
from contextlib import nullcontext
from pathlib import Path

from common import ArgumentParser, command, run_cli
from training.config import FIELDS, Config, build_config, flat, fmt
from training.trainer import launched, train


def main(argv: list[str]) -> int:
    p = ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--resume", nargs="?", const=True, metavar="CHECKPOINT")
    p.add_argument("--overwrite", action="store_true")
    # the rest: the config file, then the settings
    args, rest = p.parse_known_args(argv)
    if args.help:
        defaults = flat(Config().to_dict())
        rows = [(f"--{k}={fmt(defaults[k])}", f.type.__name__, f.metadata["help"])
                for k, f in FIELDS.items()]
        width = max(len(flag) for flag, _, _ in rows) + 2
        settings = "".join(f"  {flag:{width}}{kind:6s} {text}\n" for flag, kind, text in rows)
        print(__doc__ + "\nSettings (the default shown):\n" + settings, end="")
        return 0
    config_file = rest.pop(0) if rest and not rest[0].startswith("-") else None
    checkpoint = args.resume if isinstance(args.resume, str) else None
    # train.py --resume CONFIG
    if checkpoint and checkpoint.endswith(".toml") and config_file is None:
        config_file, checkpoint = checkpoint, None
    # train.py --resume OUT_DIR: its latest checkpoint
    if checkpoint and Path(checkpoint).is_dir():
        rest.append(f"--out_dir={checkpoint}")
        checkpoint = None
    # that checkpoint's run goes on, in the folder it is in (again: from its latest)
    elif checkpoint:
        rest.append(f"--out_dir={Path(checkpoint).resolve().parent}")
    cfg = build_config(config_file, rest, resume=bool(args.resume))
    words = [str(Path(a).parent) if a == checkpoint else a
             for a in argv if a != "--overwrite"]
    if not args.resume:
        words.append("--resume")
    again = command("train.py", *words)
    lost = nullcontext()
    # under torchrun: torchrun's command, and a lost peer said in one line
    if launched():
        from training import distributed
        again = distributed.relaunch(*words)
        lost = distributed.lost_peer_line(cfg.out_dir, again)
    with lost:
        return train(cfg, bool(args.resume), args.overwrite, checkpoint=checkpoint,
                     again=again)["exit_code"]


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
