"""Export a trained GPT as a Hugging Face GPT-2 directory (config.json + model.safetensors).

    python export.py out/run hf_model              # the run's best.pt (else its latest checkpoint)
    python export.py out/run/ckpt_0002000.pt hf_model --force

    >>> from transformers import GPT2LMHeadModel
    >>> model = GPT2LMHeadModel.from_pretrained("hf_model")

Only models whose architecture GPT-2 has can be exported (learned positions, LayerNorm, plain
multi-head attention, no qk_norm); any other setting is an error that names it (hf/convert.py).
A run trained with the gpt2 tokenizer pairs with transformers' "gpt2" tokenizer; any other
tokenizer (char, cl100k_base, ...) is not written: the directory then holds the weights only.
"""
try:   # from here on Ctrl-C ends the command at once, quietly (see common.run_cli)
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
except KeyboardInterrupt:   # Ctrl-C came while signal itself was being imported
    raise SystemExit(130)

import sys
from pathlib import Path

from common import ArgumentParser, RunError, run_cli  # noqa: E402


def parse_args(argv):
    p = ArgumentParser(description="Export a trained GPT as a Hugging Face GPT-2 directory.")
    p.add_argument("checkpoint", help="a run's out dir, or a checkpoint file")
    p.add_argument("out_dir", help="the directory to write config.json and model.safetensors to")
    p.add_argument("--force", action="store_true", help="write into out_dir even if it is not empty")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    from hf.hub import GPT2_VOCAB, save_pretrained
    from training.checkpoint import load_model

    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise RunError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.glob("*.pt")):
        raise RunError(f"{out} holds checkpoints of a run: export into a directory of its own")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise RunError(f"{out} is not empty; pass --force to write config.json and model.safetensors into it")
    loaded = load_model(args.checkpoint)
    cfg, tokenizer = loaded.model.cfg, loaded.tokenizer.meta()
    gpt2_tokens = tokenizer.get("kind") == "tiktoken" and tokenizer.get("name") == "gpt2"
    save_pretrained(out, cfg, loaded.model.state_dict(), eos_token_id=GPT2_VOCAB - 1 if gpt2_tokens else None)
    print(f"# {loaded.path} -> {out} (GPT2LMHeadModel: {cfg.n_layer} layers, n_embd {cfg.n_embd}, "
          f"context {cfg.block_size}, vocab {cfg.vocab_size})")
    if gpt2_tokens:
        padded = f"; rows {GPT2_VOCAB}..{cfg.vocab_size - 1} are padding it never produces" \
            if cfg.vocab_size > GPT2_VOCAB else ""
        print(f"# tokenizer: gpt2, the same as transformers' AutoTokenizer.from_pretrained('gpt2'){padded}")
    else:
        name = tokenizer.get("name", tokenizer.get("kind"))
        print(f"# tokenizer: {name}, which transformers does not have: the directory holds the weights only")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
