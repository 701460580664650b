"""Starting from GPT-2's weights: train.init_from, and sampling a GPT-2 directly.

    python train.py configs/finetune_gpt2.toml --data my.txt          # train.init_from = "gpt2"
    python train.py --train.init_from=path/to/hf_dir --data my.txt    # config.json + model.safetensors
    python sample.py gpt2 --prompt "Hello"

The pretrained checkpoint fixes the architecture: the model section is taken from its config.json,
and a model.* key the user set (config file or command line) to another value is a ConfigError that
names it. Three settings stay free, as choices of the fine-tuning rather than of the weights:
model.dropout (unset: the checkpoint's, 0.1 for GPT-2), model.attention (naive or sdpa: the same
math) and model.block_size up to the checkpoint's n_positions (the position table is cropped:
fine-tuning on short contexts is cheaper).
The tokenizer is tiktoken's gpt2, which GPT-2's vocabulary is.

init_from is a train.* key, not a model.* one: ModelConfig describes an architecture, and where the
first weights come from is a choice of the run, like its seed. A resumed run loads its own
checkpoint, never the pretrained weights again.
"""
from pathlib import Path

from training.checkpoint import CheckpointError
from training.config import Config, ConfigError
from training.errors import first_line

GPT2_VOCAB = 50257   # tiktoken's gpt2: 50,256 merges and bytes, plus <|endoftext|>


def resolve_init_from(cfg: Config, explicit: set[str]) -> None:
    """Replace cfg.model by the pretrained checkpoint's, keeping the free keys the user set; set
    data.tokenizer to gpt2. explicit: the dotted keys the config file and command line set."""
    source = cfg.train.init_from
    from training.gpt2_hf import pretrained_config
    try:
        pretrained = pretrained_config(source)
    except CheckpointError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    if pretrained.vocab_size < GPT2_VOCAB:
        raise ConfigError(f"train.init_from={source} has a vocabulary of {pretrained.vocab_size} tokens, fewer than "
                          f"GPT-2's {GPT2_VOCAB}: its tokenizer is not GPT-2's, which fine-tuning uses")
    user = cfg.model
    for key in sorted(k.removeprefix("model.") for k in explicit if k.startswith("model.")):
        mine, theirs = getattr(user, key), getattr(pretrained, key)
        free = (key == "dropout" or (key == "attention" and mine in ("naive", "sdpa"))
                or (key == "block_size" and 0 < mine <= theirs))
        if mine != theirs and not free:
            limit = f" (its n_positions: at most {theirs})" if key == "block_size" else ""
            raise ConfigError(f"model.{key}={mine} conflicts with {source}'s {key}={theirs}{limit} "
                              f"(train.init_from); remove the override")
        if free:
            setattr(pretrained, key, mine)
    if "data.tokenizer" in explicit and cfg.data.tokenizer != "gpt2":
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} conflicts with train.init_from={source}, "
                          f"whose tokenizer is gpt2; remove the override")
    cfg.model, cfg.data.tokenizer = pretrained, "gpt2"


def load_init_weights(model, source: str) -> None:
    """Copy the pretrained weights of source into model (built from the resolved config), cropping
    the position table to model.cfg.block_size rows."""
    from training.gpt2_hf import load_pretrained
    _, state = load_pretrained(source)
    state["pos_emb.weight"] = state["pos_emb.weight"][:model.cfg.block_size]   # (n_positions, C) -> (T, C)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:   # the checkpoint changed since the config was read
        raise CheckpointError(f"{source} does not fit the model: {first_line(e)}") from None


def is_pretrained_source(arg: str) -> bool:
    """Whether sample.py's argument names a Hugging Face GPT-2: a directory with a config.json
    (this repo's run dirs hold config.toml), or a GPT-2 name that is not a local path."""
    from training.gpt2_hf import HUB_MODELS
    path = Path(arg)
    return (path / "config.json").is_file() or (arg in HUB_MODELS and not path.exists())


def load_pretrained_model(source: str):
    """(GPT in eval mode, tiktoken gpt2 tokenizer, a one-line description) for a Hugging Face GPT-2."""
    from data.tokenizers import TiktokenTokenizer
    from model.gpt import GPT
    from training.gpt2_hf import load_pretrained
    cfg, state = load_pretrained(source)
    if cfg.vocab_size < GPT2_VOCAB:
        raise CheckpointError(f"{source} has a vocabulary of {cfg.vocab_size} tokens, fewer than GPT-2's "
                              f"{GPT2_VOCAB}: it was not trained with GPT-2's tokenizer")
    model = GPT(cfg)
    model.load_state_dict(state)
    size = f"{model.num_params() / 1e6:.1f}M parameters, {cfg.n_layer} layers, context {cfg.block_size}"
    return model.eval(), TiktokenTokenizer.named("gpt2"), f"{source} (Hugging Face GPT-2, {size})"
