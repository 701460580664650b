"""The run's settings: defaults < a resumed run's config.toml < a TOML file < the command line.
A path is made absolute against where it is written: a config file's folder (the repository
for one inside it), the working directory, the repository.
"""
import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, UserError, check_fields, flat, load_toml, setting
from data.cache import DataConfig, data_name
from model.config import ModelConfig


@dataclass
class TrainConfig:
    batch_size: int = setting(12, "sequences per micro-step", above=0)
    grad_accum: int = setting(1, "micro-steps per optimizer step", above=0)
    max_steps: int = setting(2000, "optimizer steps in the run (the LR schedule's end)", above=0)
    optimizer: str = setting(
        "adamw", "adamw | muon (on the hidden matrices)", one_of=("adamw", "muon"))
    lr: float = setting(1e-3, "AdamW's peak learning rate", at_least=0)
    muon_lr: float = setting(0.02, "Muon's peak learning rate", at_least=0)
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov)", at_least=0, below=1)
    schedule: str = setting(
        "cosine", "cosine | wsd (warmup, flat, linear decay)", one_of=("cosine", "wsd"))
    min_lr: float = setting(
        1e-4, "the floor the decay ends at (Muon's: muon_lr * min_lr / lr)", at_least=0)
    warmup_steps: int = setting(100, "steps of linear LR warmup from 0", at_least=0)
    warmdown_frac: float = setting(
        0.2, "wsd: the fraction of steps that decays", above=0, at_most=1)
    weight_decay: float = setting(0.1, "AdamW weight decay, on matrices only", at_least=0)
    beta1: float = setting(0.9, "AdamW's momentum", at_least=0, below=1)
    beta2: float = setting(0.99, "AdamW's second-moment decay", at_least=0, below=1)
    grad_clip: float = setting(1.0, "max global gradient norm (0 = off)", at_least=0)
    eval_interval: int = setting(500, "steps between evaluations (and checkpoints)", above=0)
    eval_iters: int = setting(
        0, "0 = every val window (4,096 at most), 1/8 as many train ones; "
           "N = N fixed random batches a split", at_least=0)
    log_interval: int = setting(50, "steps between training loss lines", above=0)
    sample_every: int = setting(0, "steps between samples (0 = none)", at_least=0)
    sample_prompt: str = setting("", "the samples' prompt (\"\" = a newline, or end-of-text)")
    sample_tokens: int = setting(200, "new tokens per sample (the same seed every time)", above=0)
    seed: int = setting(
        1337, "initial weights, data order and dropout", at_least=0, at_most=2**32 - 1)
    device: str = setting(
        "auto", "auto (cuda > cpu) | cpu | cuda | cuda:N | any device torch knows")
    dtype: str = setting(
        "auto", "auto = bf16 on CUDA", one_of=("auto", "float32", "bfloat16", "float16"))
    compile: bool = setting(False, "torch.compile the model (a minute to compile: long runs win)")
    cuda_graph: bool = setting(True, "on one CUDA GPU: the step as a CUDA graph, replayed")
    keep_checkpoints: int = setting(
        2, "ckpt_<step>.pt files kept (the newest); best.pt besides", above=0)
    fsdp: bool = setting(False, "under torchrun: FSDP (model and optimizer sharded), not DDP")
    init_from: str = setting(
        "", "\"\" = random init | gpt2, gpt2-medium, ... | a Hugging Face GPT-2 dir")

    def global_batch(self, world: int) -> int:
        return self.batch_size * self.grad_accum * world

    def validate(self) -> None:
        check_fields(self, "train")
        if self.min_lr > self.lr:
            raise UserError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}")
        if self.fsdp and (self.optimizer == "muon" or self.sample_every):
            raise UserError("train.fsdp shards what train.optimizer=muon and "
                            "train.sample_every need whole")


@dataclass
class LogConfig:
    wandb: bool = setting(
        False, "also log to Weights & Biases (honours WANDB_MODE=offline/disabled)")
    wandb_project: str = setting("gpt", "the runs' wandb project")
    wandb_run_name: str = setting("", "\"\" = the out dir's name")
    wandb_group: str = setting(
        "", "runs of one group overlay in wandb's charts (ablate.py: the sweep's)")
    curves: bool = setting(True, "redraw curves.png at each evaluation")


@dataclass
class Config:
    out_dir: str = setting(
        "", "\"\" = out/<name> in the repository: the config's, data's, tokenizer's")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        for section in (self.model, self.data, self.train):
            section.validate()


# every key: its dataclass field
FIELDS = {"out_dir": dataclasses.fields(Config)[0]} | {
    f"{s.name}.{f.name}": f
    for s in dataclasses.fields(Config)[1:] for f in dataclasses.fields(s.type)}
PATHS = ("out_dir", "data.path", "data.prepared_dir", "data.val_path")
BOOLS = (dict.fromkeys(("true", "1", "yes", "on"), True)
         | dict.fromkeys(("false", "0", "no", "off"), False))


def set_key(cfg: Config, key: str, value) -> None:
    """Set a dotted key ('train.lr') to value (TOML's, or command-line text) as its type."""
    if key not in FIELDS:
        match = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.5)
        hint = f" (did you mean {match[0]!r}?)" if match else ""
        raise UserError(f"unknown config key {key!r}{hint}")
    kind = FIELDS[key].type
    try:
        # command-line text
        if isinstance(value, str) and kind is not str:
            value = BOOLS[value.strip().lower()] if kind is bool else kind(value)
        elif not (type(value) is kind or kind is float and type(value) is int):
            raise ValueError
    except (KeyError, ValueError):
        raise UserError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    section, _, name = key.rpartition(".")
    value = float(value) if kind is float else value
    setattr(getattr(cfg, section) if section else cfg, name, value)


def parse_overrides(args) -> list[tuple[str, str]]:
    """['--train.lr=1e-3', '--data', 'f.txt'] -> [('train.lr', '1e-3'), ('data.path', 'f.txt')]."""
    pairs, args = [], list(args)
    while args:
        key, eq, value = args.pop(0).partition("=")
        if not key.startswith("--") or not (eq or args):
            raise UserError(f"unexpected argument {key!r}: settings look like --section.key=value")
        name = {"data": "data.path"}.get(key[2:], key[2:])
        pairs.append((name, value if eq else args.pop(0)))
    return pairs


def absolute(key: str, path, folder: Path):
    """path made absolute against folder ('~' is home); an empty data.val_path means none."""
    if not isinstance(path, str) or key == "data.val_path" and path == "":
        return path
    if not path.strip():
        raise UserError(f"{key} is empty")
    return os.path.abspath(folder / os.path.expanduser(path))


def build_config(config_file: str | None = None, overrides=(), resume: bool = False) -> Config:
    """The run's config, validated (see the top); overrides: ['--train.lr=1e-3', ...]."""
    in_file = flat(load_toml(config_file)) if config_file else {}
    # out_dir = "": out/<name>, the default
    in_file = {k: v for k, v in in_file.items() if (k, v) != ("out_dir", "")}
    shipped = Path(config_file or ROOT).resolve().is_relative_to(ROOT)
    folder = ROOT if shipped else Path(config_file).parent
    in_file |= {k: absolute(k, v, folder) for k, v in in_file.items() if k in PATHS}
    given = {k: absolute(k, v, Path.cwd()) if k in PATHS else v
             for k, v in parse_overrides(overrides)}
    values = in_file | given
    new_data = {"data.path", "data.tokenizer"} & set(given)
    if "out_dir" not in given and (new_data or "out_dir" not in values):
        values["out_dir"] = str(ROOT / default_out_dir(config_file, values, set(given)))
    stored = Path(values["out_dir"]) / "config.toml"
    # the run goes on: only the file and the command line change it
    resumed = resume and stored.is_file()
    if resumed:
        values = {k: v for k, v in flat(load_toml(stored)).items() if k in FIELDS} | values
    for key in PATHS[1:]:
        values.setdefault(key, absolute(key, getattr(DataConfig, key[5:]), ROOT))
    cfg = Config()
    # the file's values first: a wrong one is refused even where the command line sets it again
    for layer, file_only in ((in_file, True), (values, False)):
        for key, value in layer.items():
            try:
                set_key(cfg, key, value)
            except UserError as e:
                named = config_file and (file_only or key not in given)
                raise UserError(f"{config_file}: {e}" if named else str(e)) from None
    # the model section is the pretrained checkpoint's (the optional Hugging Face room)
    if cfg.train.init_from and not resumed:
        from hf.hub import resolve_init_from
        resolve_init_from(cfg, set(values))
    cfg.validate()
    return cfg


def default_out_dir(config_file: str | None, values: dict, given: set[str]) -> str:
    """out/<name>: the config file's name, then the data's and the tokenizer's (but char)
    where the command line set them or no file is given: other data or tokens, another dir."""
    tokenizer = values.get("data.tokenizer", "char")
    parts = [Path(config_file).stem] if config_file else []
    if "data.path" in given or not config_file:
        parts.append(data_name(values.get("data.path", DataConfig.path)))
    if "data.tokenizer" in given or not config_file and tokenizer != "char":
        parts.append(re.sub(r"[^A-Za-z0-9_.]", "", tokenizer))
    return "out/" + "-".join(parts)


def fmt(v) -> str:
    """A value as TOML writes it (JSON's numbers, booleans and escapes are TOML's too)."""
    return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")


def describe(cfg: Config) -> str:
    """The config as TOML, a dotted key a line (the out dir's config.toml)."""
    return "".join(f"{k} = {fmt(v)}\n" for k, v in flat(cfg.to_dict()).items())

