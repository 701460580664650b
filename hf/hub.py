"""GPT-2 checkpoints as Hugging Face directories and hub names: read, written, trained from
(train.init_from) and sampled. Weights come from model.safetensors (or its shards), never
from pytorch_model.bin: a pickle can run code.
"""
import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save

from common import UserError, atomic_write, first_line
from data.bpe import TiktokenTokenizer
from hf.convert import config_from_hf, state_dict_from_hf, to_hf
from hf.tokenizer import tokenizer_files
from model.config import ModelConfig
from model.gpt import GPT

# tiktoken's gpt2: 50,256 merges and bytes, plus <|endoftext|>
GPT2_VOCAB = 50257
# name -> (hub repo, n_layer, n_head, n_embd): a run's config is known without a download
HUB_MODELS = {"gpt2": ("openai-community/gpt2", 12, 12, 768),
              "gpt2-medium": ("openai-community/gpt2-medium", 24, 16, 1024),
              "gpt2-large": ("openai-community/gpt2-large", 36, 20, 1280),
              "gpt2-xl": ("openai-community/gpt2-xl", 48, 25, 1600),
              "distilgpt2": ("distilbert/distilgpt2", 6, 12, 768)}


def resolve_source(name_or_dir: str, weights: bool = True) -> Path:
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path
    if name_or_dir not in HUB_MODELS and name_or_dir.count("/") != 1:
        raise UserError(f"{name_or_dir} is neither a directory nor a GPT-2 name "
                        f"({', '.join(HUB_MODELS)}, or a hub id owner/name)")
    repo = HUB_MODELS.get(name_or_dir, [name_or_dir])[0]
    files = ["config.json"]
    if weights:
        files += ["model.safetensors", "model-*.safetensors"]
    # huggingface_hub missing, offline, an unknown repo, no access, a full disk
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo, allow_patterns=files))
    except Exception as e:
        offline = type(e).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled")
        detail = ("not in the local cache, and the hub cannot be reached" if offline
                  else first_line(e).split(". ")[0])
        raise UserError(f"could not download {name_or_dir} from the Hugging Face hub "
                        f"({detail}); pass a local directory") from None


def pretrained_config(name_or_dir: str) -> ModelConfig:
    if name_or_dir in HUB_MODELS and not Path(name_or_dir).expanduser().is_dir():
        sizes = dict(zip(("n_layer", "n_head", "n_embd"), HUB_MODELS[name_or_dir][1:]))
        sizes |= {"vocab_size": GPT2_VOCAB, "n_positions": 1024}
        return config_from_hf(sizes, where=name_or_dir)
    path = resolve_source(name_or_dir, weights=False) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path.parent} has no config.json: not a Hugging Face checkpoint "
                        f"directory") from None
    # a UnicodeDecodeError too
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise UserError(f"{path} is not a JSON object")
    return config_from_hf(hf, where=f"{name_or_dir}: config.json")


def load_pretrained(name_or_dir: str) -> tuple[ModelConfig, dict]:
    cfg = pretrained_config(name_or_dir)
    directory = resolve_source(name_or_dir)
    files = [directory / "model.safetensors"]
    if not files[0].is_file():
        files = sorted(directory.glob("model-*.safetensors"))
    if not files:
        found = ", ".join(sorted(p.name for p in directory.iterdir())[:5])
        raise UserError(f"{directory} has no model.safetensors (found: {found}); "
                        f"pickled .bin weights are not loaded, since they can run code")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is not a readable safetensors file "
                            f"({first_line(e, 120)})") from None
    return cfg, state_dict_from_hf(tensors, cfg, where=f"{name_or_dir}: weights")


def save_pretrained(directory, cfg: ModelConfig, state_dict: dict,
                    tokenizer: dict | None = None) -> list[str]:
    """A Hugging Face GPT-2 directory, each file written atomically -> the tokenizer's files."""
    # refuses unmappable settings before any write
    config, tensors = to_hf(cfg, state_dict)
    files, eos = tokenizer_files(tokenizer, cfg.block_size) if tokenizer else ({}, None)
    config |= {"bos_token_id": eos, "eos_token_id": eos}
    # half the context (the pipeline's 256 overrun a small one; a max_length warns)
    generation = {"max_new_tokens": cfg.block_size // 2, "bos_token_id": eos, "eos_token_id": eos}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    jsons = {"config.json": config, "generation_config.json": generation, **files}
    for name, value in jsons.items():
        atomic_write(directory / name, json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    return list(files)


def check_vocab(source: str, cfg: ModelConfig) -> None:
    if cfg.vocab_size < GPT2_VOCAB:
        raise UserError(f"{source} has a vocabulary of {cfg.vocab_size} tokens, fewer than "
                        f"GPT-2's {GPT2_VOCAB}: it was not trained with GPT-2's tokenizer")


def resolve_init_from(cfg, explicit: set[str]) -> None:
    """train.init_from: cfg.model becomes the checkpoint's, with the keys the user set
    (explicit) that leave its weights usable (a shorter block_size crops the position table)."""
    source = cfg.train.init_from
    try:
        pretrained = pretrained_config(source)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    check_vocab(f"train.init_from={source}", pretrained)
    for key in sorted(k.removeprefix("model.") for k in explicit if k.startswith("model.")):
        mine, theirs = getattr(cfg.model, key), getattr(pretrained, key)
        free = (key == "dropout"
                or (key == "attention" and mine in ("naive", "sdpa"))
                or (key == "block_size" and 0 < mine <= theirs))
        if mine != theirs and not free:
            limit = f" (its n_positions: at most {theirs})" if key == "block_size" else ""
            raise UserError(f"model.{key}={mine} conflicts with {source}'s {key}={theirs}"
                            f"{limit} (train.init_from); remove the override")
        setattr(pretrained, key, mine)
    if "data.tokenizer" in explicit and cfg.data.tokenizer != "gpt2":
        raise UserError(f"data.tokenizer={cfg.data.tokenizer} conflicts with train.init_from="
                        f"{source}, whose tokenizer is gpt2; remove the override")
    cfg.model, cfg.data.tokenizer = pretrained, "gpt2"


def load_init_weights(model: GPT, source: str) -> None:
    """Copy source's weights into model (of its resolve_init_from config)."""
    _, state = load_pretrained(source)
    state["pos_emb.weight"] = state["pos_emb.weight"][:model.cfg.block_size]
    try:
        model.load_state_dict(state)
    # a local folder's files changed since its config.json was read
    except RuntimeError as e:
        raise UserError(f"{source} does not fit the model its config.json describes: "
                        f"{first_line(e)}") from None


def load_gpt2(source: str) -> tuple[GPT, TiktokenTokenizer, str]:
    """(GPT in eval mode, tiktoken's gpt2, a one-line description) of a Hugging Face GPT-2."""
    cfg, state = load_pretrained(source)
    check_vocab(source, cfg)
    model = GPT(cfg)
    model.load_state_dict(state)
    size = (f"{model.num_params() / 1e6:.1f}M parameters, {cfg.n_layer} layers, "
            f"context {cfg.block_size}")
    return model.eval(), TiktokenTokenizer.named("gpt2"), f"{source} (Hugging Face GPT-2, {size})"
