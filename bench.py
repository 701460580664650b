"""Benchmarks: each prints its figures, measured in one run on this machine (ratios travel, absolute
times drift on a shared machine).

    python bench.py race                           classic config vs fast recipe: time from launch to the classic's
                                                   best val loss (the CPU pair, or on a GPU the GPU pair)
    python bench.py train CONFIG [--key=value ...] matmul peak, ms/step, tokens/s, MFU of the trainer's own loop
                                                   (on CUDA: eager, compiled, CUDA graph, both), against plain PyTorch
    python bench.py sample [--device cuda]         tokens/s with and without the KV cache, ms/token by position
                                                   (CUDA: batch 1 and 16, with and without the compiled step)
    python bench.py scaling                        step time vs block size and width; sampling time vs samples
    python bench.py tokenizers [--seconds 120]     char vs gpt2 vs bpe:4096 in bits per byte at equal training time
    python bench.py prepare [--mb 1000]            data preparation speed and memory; writes a 1 GB text file (--mb)
                                                   in the temp dir and removes it afterwards (benchmarks/prepare.py)
    python bench.py gpu [--out DIR] [--quick]      on a GPU: the CUDA-only tests, train (classic config, 124M shape),
                                                   sample and race, in one report with raw logs (benchmarks/gpu.py)

Every bad argument is refused before any work, in one line (exit 2); race, train, tokenizers and gpu
also take config overrides (--section.key=value), which are checked as train.py checks them.
"""
try:   # from here on Ctrl-C ends the command at once, quietly (see common.run_cli)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
except KeyboardInterrupt:   # Ctrl-C came while signal itself was being imported
    raise SystemExit(130)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from common import ArgumentParser, check, run_cli  # noqa: E402

TAKE_OVERRIDES = ("race", "train", "tokenizers", "gpu")   # the rest refuse what they do not know


def config_file(path: str) -> str:
    """An argparse type: path, if it is a file (argparse's refusal names the option)."""
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no config file {path}")
    return path


def parser() -> ArgumentParser:
    """The command's parser (its subcommands' errors are common.ArgumentParser's one line too)."""
    from benchmarks.prepare import add_options
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("race", help="classic vs fast recipe: time from launch to the classic's best val loss")
    r.add_argument("--classic", type=config_file, help="default: the classic config of this machine's kind (CPU, GPU)")
    r.add_argument("--fast", type=config_file, help="default: the fast recipe of this machine's kind")
    r.add_argument("--evals", type=int, default=20, help="evaluations per run (the race's resolution)")
    t = sub.add_parser("train", help="matmul peak, the trainer's ms/step, tokens/s and MFU for a config")
    t.add_argument("config", type=config_file)
    t.add_argument("--steps", type=int, default=10, help="steps per round")
    t.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round (the median counts)")
    s = sub.add_parser("sample", help="sampling with and without the KV cache")
    s.add_argument("--new-tokens", type=int, default=500)
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    sub.add_parser("scaling", help="how step and sampling time grow with block size, width and samples")
    k = sub.add_parser("tokenizers", help="bits per byte of char, gpt2 and bpe:4096 at equal training time")
    k.add_argument("--config", type=config_file, help="default: configs/shakespeare_char_cpu.toml")
    k.add_argument("--seconds", type=float, default=120.0, help="training time per tokenizer (a run ends by 1.25x it)")
    add_options(sub.add_parser("prepare", help="data preparation speed and peak memory, streaming vs reading whole"))
    g = sub.add_parser("gpu", help="the CUDA tests, train, sample and race on a GPU: one report, raw logs")
    g.add_argument("--out", help="report directory (default out/bench_gpu/<date>-<time>-<commit>)")
    g.add_argument("--quick", action="store_true", help="few steps and tokens, no race: checks the command")
    return p


def check_args(p: ArgumentParser, args, overrides: list[str]) -> None:
    """Refuse, before any work, what the command cannot use, in one line naming the option; settle the
    defaults that depend on the machine (race's configs, sample's device)."""
    from training.config import ROOT, build_config
    if overrides and args.command not in TAKE_OVERRIDES:
        p.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.command == "race":
        import torch
        from benchmarks.race import PAIRS
        check("--evals", args.evals, at_least=1)
        classic, fast = (str(ROOT / p) for p in PAIRS["cuda" if torch.cuda.is_available() else "cpu"])
        args.classic, args.fast = args.classic or classic, args.fast or fast
        for path in (args.classic, args.fast):
            build_config(path, overrides)
    elif args.command == "train":
        check("--steps", args.steps, at_least=1)
        check("--rounds", args.rounds, at_least=1)
        build_config(args.config, overrides)
    elif args.command == "sample":
        from model.loading import pick_device
        check("--new-tokens", args.new_tokens, at_least=1)
        args.device = pick_device(args.device, setting="--device")
    elif args.command == "tokenizers":
        check("--seconds", args.seconds, above=0)
        args.config = args.config or str(ROOT / "configs" / "shakespeare_char_cpu.toml")
        build_config(args.config, overrides)
    elif args.command == "prepare":
        from benchmarks.prepare import checked
        args.prepare = checked(args)
    elif args.command == "gpu":   # (the overrides go to every part: checked against the GPU pair's classic)
        build_config(str(ROOT / "configs" / "shakespeare_char.toml"), overrides)


def main(argv: list[str]) -> int:
    p = parser()
    args, overrides = p.parse_known_args(argv)
    check_args(p, args, overrides)
    from benchmarks import gpu, machine, prepare, race, sampling, step, tokenizers
    print(machine.header(), flush=True)
    code = {"race": lambda: race.race(args.classic, args.fast, overrides, evals=args.evals),
            "train": lambda: step.bench_train(args.config, overrides, steps=args.steps, rounds=args.rounds),
            "sample": lambda: sampling.bench_sample(args.new_tokens, args.device),
            "scaling": lambda: step.bench_scaling() or sampling.bench_samples_scaling(),
            "tokenizers": lambda: tokenizers.bench_tokenizers(args.config, overrides, seconds=args.seconds),
            "prepare": lambda: prepare.bench_prepare(**args.prepare),
            "gpu": lambda: gpu.bench_gpu(["bench.py", *argv], args.out, args.quick, overrides)}[args.command]()
    return code if args.command == "gpu" else 0   # (the others return their figures)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
