"""Score a model on any text: loss per token, bits per byte and perplexity, over every token.

    python eval.py out/tinyshakespeare data/tinyshakespeare.txt
    python eval.py gpt2 'books/*.txt' --stride 512 --json
    python eval.py out/run/ckpt_0002000.pt notes.txt --device cpu --batch-size 2

MODEL is a run's out dir (its best.pt, else its latest checkpoint), a checkpoint file, or a
Hugging Face GPT-2 (a directory with config.json, or a name such as gpt2). Each FILE is a
file, a directory or a glob; every file is its own text, tokenized whole and scored with no
context from any other. A JSONL or Parquet file's records (their "text" field) are its
documents, with the end-of-text token (BPE) or a newline (char) between them, as in training:
a run's --data.val_path file scores as its val split.

Every token of a text after the first is scored once, predicted from the tokens before it in
its window of B = block_size tokens. By default the windows do not overlap: window k feeds
tokens kB .. kB+B-1, and the tokens after the last whole window form one shorter window.
With --stride S the windows start S tokens apart and each after the first scores only its
last S targets, so every token after the first window sees at least B - S + 1 tokens; S = 1
gives each its full B, for B times the compute. (data/loader.py's strided_windows makes the
windows; model/gpt.py's score, which the trainer's evaluations share, scores them.)

The figures, per file and in total (token-weighted):
  loss        the mean cross-entropy, nats per scored token
  bits/byte   the total loss in bits over the UTF-8 bytes of the scored tokens (the first
              token is context only): comparable across tokenizers
  perplexity  exp(loss)

On CUDA the model runs under bf16 autocast (fp16 where the GPU lacks it), as in training;
on the CPU in fp32. Every file is read before any is scored, so a bad file stops the command
at once. Progress goes to stderr, the results to stdout (a table, or --json); Ctrl-C prints
the figures of the tokens scored so far, then exits 130.
"""
import json
import math
import sys

from common import ArgumentParser, Progress, UserError, run_cli
from data.loader import strided_windows
from data.cache import find_sources, kind_suffix
from data.sources import iter_documents, iter_text
from loading import load_model
from model.device import autocast, pick_device, pick_dtype
from model.gpt import bits_per_byte, score


def parse_args(argv):
    p = ArgumentParser(description="Loss, bits per byte and perplexity of a model on text "
                       "files, over every token.")
    p.add_argument("model", metavar="MODEL", help="a run's out dir, a checkpoint file, or a "
                   "Hugging Face GPT-2 (directory or name)")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a text file, a directory or a glob (quote it)")
    p.add_argument("--stride", type=int, default=None, metavar="S",
                   help="start a window every S tokens and score only its last S "
                        "(1 <= S <= the model's context; default: the context, i.e. windows "
                        "that do not overlap)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="windows per forward pass (lower it if memory is short)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="score each file's first N tokens only")
    p.add_argument("--skip-unknown", action="store_true",
                   help="leave out the characters a character model never saw "
                        "(default: refuse such a file)")
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.stride is not None and args.stride < 1:
        p.error(f"--stride must be >= 1, got {args.stride}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    return args


def main(argv) -> int:
    args = parse_args(argv)
    paths = (path for pattern in args.files for path in find_sources(pattern))
    files = list(dict.fromkeys(paths))
    device = pick_device(args.device, setting="--device")
    loaded = load_model(args.model, device)
    block_size = loaded.model.cfg.block_size
    stride = args.stride or block_size
    if stride > block_size:
        raise UserError(f"--stride must be at most the model's context of {block_size} "
                        f"tokens, got {stride}")
    # every file is read before any is scored: a bad one stops the command at once
    texts = {path: read_tokens(path, loaded.tokenizer, args.skip_unknown, args.max_tokens)
             for path in files}
    dtype = pick_dtype(device)
    print(f"# {loaded.description}", file=sys.stderr)
    overlap = " (no overlap)" if stride == block_size else ""
    print(f"# windows of {block_size} tokens, stride {stride}{overlap}, "
          f"batch {args.batch_size}, {device} {str(dtype).removeprefix('torch.')}",
          file=sys.stderr)
    rows, stopped = [], False
    try:
        score_files(loaded, texts, stride, args.batch_size, autocast(device, dtype), rows)
    # Ctrl-C: the figures of what was scored
    except KeyboardInterrupt:
        stopped = True
    sums = (sum(r[k] for r in rows) for k in ("tokens", "bytes", "nats"))
    total = figures("total", *sums)
    if args.json:
        result = {"model": str(loaded.path), "block_size": block_size, "stride": stride,
                  "files": rows, "total": total, "interrupted": stopped}
        print(json.dumps(result, indent=1, allow_nan=False))
    elif rows:
        print(table(rows + [total] if len(rows) > 1 else rows))
    if not stopped:
        return 0
    print(f"interrupted: the figures are those of the {total['tokens']:,} tokens scored "
          f"before it", file=sys.stderr)
    return 130


def read_tokens(path, tokenizer, skip_unknown: bool = False, max_tokens: int | None = None):
    """A text file's token ids (max_tokens + 1 at most: the first is context only); a file
    that cannot be scored is one line."""
    docs = [iter_text(path, hint=None)] if not kind_suffix(path.name) else iter_documents(path)
    # between documents: a newline (char), or the end-of-text token (None: BPE)
    sep = "\n" if tokenizer.end_token is None else None
    pieces = [piece for doc in docs for piece in (sep, "".join(doc))][1:]
    # a character model: leave out what it never saw
    if skip_unknown and hasattr(tokenizer, "chars"):
        text = "".join(pieces)
        pieces = ["".join(c for c in text if c in tokenizer.stoi)]
        if left_out := len(text) - len(pieces[0]):
            print(f"# {path}: left out {left_out:,} characters the model never saw",
                  file=sys.stderr)
    end = None if max_tokens is None else max_tokens + 1
    try:
        ids = tokenizer.encode_pieces(pieces)[:end]
    except UserError as e:
        raise UserError(f"{path} has {e} (--skip-unknown leaves them out)") from None
    if len(ids) < 2:
        raise UserError(f"{path} has {len(ids)} token(s): scoring needs at least 2 "
                        f"(one to predict from, one to predict)")
    return ids


def score_files(loaded, texts: dict, stride, batch_size, autocast, rows: list) -> None:
    """A row of figures per file of texts ({path: token ids}) appended to rows, so that a
    stopped scoring keeps what it scored."""
    model = loaded.model
    progress = Progress("scoring", sum(len(ids) - 1 for ids in texts.values()), "tokens")
    try:
        for i, (path, ids) in enumerate(texts.items()):
            count = f" ({i + 1}/{len(texts)})" if len(texts) > 1 else ""
            progress.label = f"scoring {path}{count}"
            nats, tokens = 0.0, 0
            try:
                for x, y in strided_windows(ids, model.cfg.block_size, stride, batch_size):
                    n, c = score(model, [(x, y)], autocast)
                    nats, tokens = nats + n, tokens + c
                    progress.advance(c)
            # the scored targets are the tokens after the first, in order; their bytes give
            # bits per byte
            finally:
                if tokens:
                    scored = ids[1:tokens + 1].tolist()
                    nbytes = len(loaded.tokenizer.decode_bytes(scored))
                    rows.append(figures(str(path), tokens, nbytes, nats))
    finally:
        progress.close()


def figures(name: str, tokens: int, nbytes: int, nats: float) -> dict:
    """A result row; a figure that is not a finite number (no bytes, a diverged model's
    loss, an exp that overflows) is None."""
    finite = math.isfinite(nats)
    loss = nats / tokens if tokens and finite else None
    known = loss is not None
    return {"file": name, "tokens": tokens, "bytes": nbytes,
            "nats": nats if finite else None,
            "loss": loss,
            "bits_per_byte": bits_per_byte(loss, tokens, nbytes) if known and nbytes else None,
            "perplexity": math.exp(loss) if known and loss < 700 else None}


def table(rows: list[dict]) -> str:
    """The rows as aligned columns under a header."""
    width = max(len("file"), *(len(r["file"]) for r in rows))
    header = (f"{'file':<{width}}  {'tokens':>12}  {'loss':>8}  {'bits/byte':>9}  "
              f"{'perplexity':>11}")

    def number(value, width, digits):
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"
    lines = [header]
    lines += [f"{r['file']:<{width}}  {r['tokens']:>12,}  {number(r['loss'], 8, 4)}  "
              f"{number(r['bits_per_byte'], 9, 4)}  {number(r['perplexity'], 11, 3)}"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
