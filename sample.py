"""Sample text from a trained GPT, streaming it to stdout as it is produced.

The samples are one batch: the first is streamed, the others printed when done.
"""
import codecs
import math
import sys

# common first: a Ctrl-C while torch loads is then one quiet line
from common import ArgumentParser, UserError, run_cli

import torch

from data.sources import read_prompt
from loading import load_model
from model.device import autocast, pick_device, pick_dtype
from model.sampling import Choice, Decoding, generate, prompt_ids

NOTE_CPU_COMPILE = ("note: on a CPU, compiling the decoding step takes tens of seconds, more than "
                    "it saves on a sample (bench.py sample measures both): leave out --compile")


def parse_args(argv):
    p = ArgumentParser(description="Sample from a trained GPT checkpoint.")
    p.add_argument("checkpoint", help="a run's out dir, or a checkpoint file")
    p.add_argument("--prompt", default="", help="text to continue, or @FILE")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="only the k most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="only the most likely tokens "
                   "that hold this much probability")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sample just before this text (repeatable)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token (slow)")
    p.add_argument("--compile", action="store_true", help="compile the decoding step (on "
                   "CUDA a CUDA graph): faster on a GPU once compiled, which takes a while")
    args = p.parse_args(argv)
    checks = [(args.num_samples >= 1, "--num-samples must be >= 1"),
              (args.max_new_tokens >= 0, "--max-new-tokens must be >= 0"),
              (0 <= args.temperature < math.inf, "--temperature must be a finite number >= 0"),
              (args.top_k >= 0, "--top-k must be >= 0"),
              (0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
              (0 <= args.seed < 2**63, "--seed must be in [0, 2^63)"),
              (all(args.stop), "--stop needs a non-empty text")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


def extend(text: str, decoder, piece: bytes, stops: list[str]) -> tuple[str, bool]:
    """(text and a token's decoded bytes, cut just before a stop string, whether it was)."""
    before, text = len(text), text + decoder.decode(piece)
    found = (text.find(s, max(0, before - len(s) + 1)) for s in stops)
    cuts = [c for c in found if c >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def main(argv) -> int:
    args = parse_args(argv)
    # `python sample.py ... >&-`: Python found no stdout at its start
    if sys.stdout is None:
        raise UserError("stdout is closed: there is nowhere to write the samples to")
    device = pick_device(args.device, setting="--device")
    loaded = load_model(args.checkpoint, device)
    tokenizer, dtype = loaded.tokenizer, pick_dtype(device)
    text = read_prompt(args.prompt)
    ids = prompt_ids(tokenizer, text, loaded.model.cfg.block_size, "continuing")
    print(f"# {loaded.description}", file=sys.stderr)
    if args.compile and device.type == "cpu":
        print(NOTE_CPU_COMPILE, file=sys.stderr)

    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device).repeat(args.num_samples, 1)
    # what could still become a stop string is not shown yet
    hold = max(map(len, args.stop), default=1) - 1
    # each sample's text, whether it ended, its UTF-8 decoder
    new, done, streams, shown = [], [], [], 0
    print(("" if args.num_samples == 1 else "--- sample 1 ---\n") + text, end="", flush=True)
    speed_up = None
    if args.compile:
        from speed.decoding import compiled as speed_up
    choice = Choice(args.temperature, args.top_k, args.top_p)
    decoding = Decoding(use_cache=not args.no_cache, cache_dtype=dtype, check_every=1,
                        speed_up=speed_up)
    columns = generate(loaded.model, idx, args.max_new_tokens, choice, generator,
                       vocab_limit=tokenizer.vocab_size, decoding=decoding)
    try:
        with autocast(device, dtype):
            for col in columns:
                # once the model ran: a batch too large for memory is refused first
                if not new:
                    new, done = [""] * args.num_samples, [False] * args.num_samples
                    streams = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in new]
                for i, token in enumerate(col[:, 0].tolist()):
                    if done[i] or token == tokenizer.end_token:
                        done[i] = True
                    else:
                        piece = tokenizer.decode_bytes([token])
                        new[i], done[i] = extend(new[i], streams[i], piece, args.stop)
                show = len(new[0]) if done[0] else max(shown, len(new[0]) - hold)
                print(new[0][shown:show], end="", flush=True)
                shown = show
                if all(done):
                    break
    except UserError as e:
        print()
        raise UserError(f"{loaded.path}: {e}") from None
    # a character cut by the end of a sample comes out as �
    new = [t + ("" if d else s.decode(b"", final=True)) for t, d, s in zip(new, done, streams)]
    print(new[0][shown:] if new else "", flush=True)
    for i in range(1, args.num_samples):
        print(f"--- sample {i + 1} ---\n{text}{new[i] if new else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
