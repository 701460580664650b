"""Draw what a trained GPT attends to for a prompt: a PNG of every head per layer and a
summary of which heads do what, or one interactive page (--html).
"""
import sys
from pathlib import Path

# common first: a Ctrl-C while torch loads is then one quiet line
from common import ROOT, ArgumentParser, UserError, atomic_write, run_cli

import numpy as np
import torch

from data.sources import read_prompt
from loading import load_model
from model.attention_maps import attention_maps, head_scores
from model.sampling import prompt_ids


def parse_args(argv):
    p = ArgumentParser(description="Draw a trained GPT's attention weights for a prompt.")
    p.add_argument("checkpoint", help="a run's out dir, or a checkpoint file")
    p.add_argument("--prompt", required=True, help="the text to look at, or @FILE")
    p.add_argument("--out", help="folder for the PNGs (default: "
                   "<run dir>/attention/, or out/attention/<name>/)")
    p.add_argument("--layers", help="comma-separated layers from 0 (default: all)")
    p.add_argument("--heads", help="comma-separated heads from 0 (default: all)")
    p.add_argument("--html", metavar="FILE", help="the interactive page, instead of the PNGs")
    p.add_argument("--no-summary", action="store_true", help="skip attention_summary.png")
    p.add_argument("--dpi", type=int, default=100, help="pixels per inch of the PNGs")
    args = p.parse_args(argv)
    if not 1 <= args.dpi <= 1000:
        p.error(f"--dpi must be in [1, 1000], got {args.dpi}")
    return args


def pick(spec: str | None, n: int, option: str) -> list[int]:
    """'0,2' -> [0, 2], each in range(n); None -> all."""
    try:
        chosen = [int(s) for s in spec.split(",")] if spec else list(range(n))
    except ValueError:
        raise UserError(f"{option} takes comma-separated numbers, got {spec!r}") from None
    if bad := [i for i in chosen if not 0 <= i < n]:
        raise UserError(f"{option}: {bad[0]} is out of range, the model has {n} (0 to {n - 1})")
    return chosen


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text (a BPE token that is part of a character shows as �)."""
    return [tokenizer.decode_bytes([i]).decode("utf-8", errors="replace") for i in ids]


def page_path(spec: str) -> Path:
    """--html's file, checked before the model runs."""
    path = Path(spec)
    if path.is_dir():
        raise UserError(f"--html {path} is a folder: give a file name, "
                        f"such as {path / 'attention.html'}")
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise UserError(f"--html {path}: {parent} is a file, not a folder")
    return path


def main(argv) -> int:
    args = parse_args(argv)
    html = page_path(args.html) if args.html else None
    # the pictures load matplotlib: only once the arguments are good
    from viz.attention_page import SCORE_NAMES, attention_page
    from viz.attention_plots import BOX, label_fonts, plot_layer, plot_summary, visible

    loaded = load_model(args.checkpoint)
    cfg = loaded.model.cfg
    text = read_prompt(args.prompt)
    ids = prompt_ids(loaded.tokenizer, text, cfg.block_size, "drawing")[-cfg.block_size:]
    if len(ids) < 2:
        raise UserError(f"the prompt has {len(ids)} token(s): "
                        f"attention needs at least 2 to show anything")
    layers = pick(args.layers, cfg.n_layer, "--layers")
    heads = pick(args.heads, cfg.n_head, "--heads")
    maps = attention_maps(loaded.model, torch.tensor([ids]))
    texts = token_texts(loaded.tokenizer, ids)
    # each (heads, T, T)
    weights = [maps[layer][0, heads] for layer in layers]
    # one row per head
    scores = {name: s.numpy() for name, s in head_scores(torch.cat(weights), texts).items()}
    weights = [w.numpy() for w in weights]
    rows = [f"layer {layer} head {h}" for layer in layers for h in heads]
    kind = f"{cfg.attention}, pos={cfg.pos}"
    written = []
    # the PNGs, a figure at a time (a large model's would not all fit in memory)
    if html is None or args.out:
        # beside a checkpoint file; GPT-2's in out/attention/
        path = Path(loaded.path)
        beside = path.parent / "attention" if path.is_file() else None
        out_dir = Path(args.out or beside or ROOT / "out" / "attention" / path.name)
        out_dir.mkdir(parents=True, exist_ok=True)
        labels = [visible(t) for t in texts]
        if missing := label_fonts("".join(labels))[1]:
            print(f"note: no installed font has the characters {missing!r}: drawn as {BOX}",
                  file=sys.stderr)
        for layer, w in zip(layers, weights):
            written.append(out_dir / f"attention_layer{layer}.png")
            title = f"layer {layer} ({kind}): row = query token, column = the token it attends to"
            plot_layer(w, labels, heads, title, args.dpi).savefig(written[-1])
        if not args.no_summary:
            written.append(out_dir / "attention_summary.png")
            plot_summary(rows, scores, args.dpi).savefig(written[-1])
    if html is not None:
        page = attention_page(texts, weights, scores, f"{loaded.description}: {kind}",
                              layers, heads)
        html.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(html, page)
        written.append(html)
    # on stderr, the head that does most of each
    shares = [n for n in SCORE_NAMES if n != "distance" and not np.isnan(scores[n]).all()]
    for name in [] if args.no_summary else shares:
        best = int(np.nanargmax(scores[name]))
        print(f"# most on {SCORE_NAMES[name]}: {rows[best]} ({scores[name][best]:.2f})",
              file=sys.stderr)
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
