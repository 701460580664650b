"""Score a model on any text: loss per token, bits per byte and perplexity.

Each file is its own text (records joined as in training), every token after its first
scored once, in windows of block_size tokens.
"""
import json
import math
import sys

from common import ArgumentParser, Progress, UserError, check, run_cli
from data.loader import strided_windows
from data.cache import find_sources, kind_suffix
from data.sources import iter_documents, iter_text
from loading import load_model
from model.device import autocast, dtype_name, pick_device, pick_dtype
from model.gpt import bits_per_byte, score


def parse_args(argv):
    p = ArgumentParser(description="Loss, bits per byte and perplexity of a model on text.")
    p.add_argument("model", metavar="MODEL",
                   help="a run's out dir, a checkpoint file, or a Hugging Face GPT-2")
    p.add_argument("files", nargs="+", metavar="FILE", help="a file, a directory or a glob")
    p.add_argument("--stride", type=int, metavar="S",
                   help="windows S tokens apart, each scoring its last S "
                        "(1 <= S <= the context; default: the context, no overlap)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows per forward pass (lower it if memory is short)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--max-tokens", type=int, help="score each file's first N tokens only")
    p.add_argument("--skip-unknown", action="store_true",
                   help="leave out the characters a character model never saw")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    args = p.parse_args(argv)
    for name in ("max_tokens", "stride", "batch_size"):
        if (value := getattr(args, name)) is not None:
            check("--" + name.replace("_", "-"), value, at_least=1)
    return args


def main(argv) -> int:
    args = parse_args(argv)
    # each file once, in the order named
    files = dict.fromkeys(path for pattern in args.files for path in find_sources(pattern))
    device = pick_device(args.device, setting="--device")
    loaded = load_model(args.model, device)
    block_size = loaded.model.cfg.block_size
    stride = args.stride or block_size
    if stride > block_size:
        raise UserError(f"--stride must be at most the model's context of {block_size} "
                        f"tokens, got {stride}")
    texts = {path: read_tokens(path, loaded.tokenizer, args.skip_unknown, args.max_tokens)
             for path in files}
    dtype = pick_dtype(device)
    print(f"# {loaded.description}", file=sys.stderr)
    overlap = " (no overlap)" if stride == block_size else ""
    print(f"# windows of {block_size} tokens, stride {stride}{overlap}, batch {args.batch_size}, "
          f"{device} {dtype_name(dtype)}", file=sys.stderr)
    rows, stopped = [], False
    try:
        score_files(loaded, texts, stride, args.batch_size, autocast(device, dtype), rows)
    except KeyboardInterrupt:
        stopped = True
    total = figures("total", *(sum(r[k] for r in rows) for k in ("tokens", "bytes", "nats")))
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


def read_tokens(path, tokenizer, skip_unknown: bool, max_tokens: int | None):
    """A file's token ids, max_tokens + 1 at most (the first is context only)."""
    docs = [iter_text(path, hint=None)] if not kind_suffix(path.name) else iter_documents(path)
    # between documents: a newline (char), or the end-of-text token (None: BPE)
    sep = "\n" if tokenizer.end_token is None else None
    pieces = [piece for doc in docs for piece in (sep, "".join(doc))][1:]
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
    """Append a row per file of texts ({path: ids}) to rows, also of a file cut short."""
    progress = Progress("scoring", sum(len(ids) - 1 for ids in texts.values()), "tokens")
    try:
        for i, (path, ids) in enumerate(texts.items()):
            count = f" ({i + 1}/{len(texts)})" if len(texts) > 1 else ""
            progress.label = f"scoring {path}{count}"
            nats, tokens = 0.0, 0
            windows = strided_windows(ids, loaded.model.cfg.block_size, stride, batch_size)
            try:
                for x, y in windows:
                    n, c = score(loaded.model, [(x, y)], autocast)
                    nats, tokens = nats + n, tokens + c
                    progress.advance(c)
            finally:
                # the scored targets: the tokens after the first, in order
                if tokens:
                    nbytes = len(loaded.tokenizer.decode_bytes(ids[1:tokens + 1].tolist()))
                    rows.append(figures(str(path), tokens, nbytes, nats))
    finally:
        progress.close()


def figures(name: str, tokens: int, nbytes: int, nats: float) -> dict:
    """A result row; a figure that is not a finite number is None."""
    finite = math.isfinite(nats)
    loss = nats / tokens if tokens and finite else None
    known = loss is not None
    return {"file": name, "tokens": tokens, "bytes": nbytes,
            "nats": nats if finite else None, "loss": loss,
            "bits_per_byte": bits_per_byte(loss, tokens, nbytes) if known and nbytes else None,
            "perplexity": math.exp(loss) if known and loss < 700 else None}


def table(rows: list[dict]) -> str:
    width = max(len("file"), *(len(r["file"]) for r in rows))

    def number(value, width, digits):
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"
    lines = [f"{'file':<{width}}  {'tokens':>12}  {'loss':>8}  {'bits/byte':>9}  "
             f"{'perplexity':>11}"]
    lines += [f"{r['file']:<{width}}  {r['tokens']:>12,}  {number(r['loss'], 8, 4)}  "
              f"{number(r['bits_per_byte'], 9, 4)}  {number(r['perplexity'], 11, 3)}" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
