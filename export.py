"""Export a trained GPT as a Hugging Face GPT-2 directory (config.json, model.safetensors, its
tokenizer) for transformers to read offline.
"""
import json
import sys
from pathlib import Path

from common import ArgumentParser, UserError, run_cli
from loading import load_model


def parse_args(argv):
    p = ArgumentParser(description="Export a trained GPT as a Hugging Face GPT-2 directory.")
    p.add_argument("checkpoint", help="a run's out dir, or a checkpoint file")
    p.add_argument("out_dir", help="the directory to write the model and tokenizer files to")
    p.add_argument("--force", action="store_true", help="write into out_dir even if not empty")
    return p.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    if out.is_dir() and any(out.glob("*.pt")):
        raise UserError(f"{out} holds checkpoints of a run: export into a directory of its own")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UserError(f"{out} is not empty; pass --force to write the model and tokenizer "
                        f"files into it")
    # the optional Hugging Face room (safetensors)
    from hf.hub import save_pretrained
    loaded = load_model(args.checkpoint)
    cfg, meta = loaded.model.cfg, loaded.tokenizer.meta()
    written = save_pretrained(out, cfg, loaded.model.state_dict(), meta)
    print(f"# {loaded.path} -> {out} (GPT2LMHeadModel: {cfg.n_layer} layers, "
          f"n_embd {cfg.n_embd}, context {cfg.block_size}, vocab {cfg.vocab_size})")
    print(f"# tokenizer {meta.get('name', meta['kind'])}: {', '.join(written)} (for AutoTokenizer)")
    # past the context transformers' GPT-2 fails with an IndexError
    generation = (out / "generation_config.json").read_text(encoding="utf-8")
    default = json.loads(generation)["max_new_tokens"]
    print(f"# the prompt plus max_new_tokens must fit the context: {cfg.block_size} tokens "
          f"in all (max_new_tokens {default} unless given)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
