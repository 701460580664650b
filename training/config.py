"""The run's settings: typed dataclasses, overridden by a TOML file, overridden by the command line.

    python train.py [CONFIG.toml] [--section.key=value ...] [--data FILE] [--out_dir DIR]

Choices:
  sections   one dataclass per section, beside the code it configures (ModelConfig in model/config.py,
             DataConfig in data/prepare.py; TrainConfig and LogConfig here); each checks itself in
             validate(), and each field says what it does (common.setting), which --help and
             docs/config.md print (python -m training.config > docs/config.md)
  values     coerced to the field's type; an unknown key or a bad value is a UserError naming it
             (and the closest valid key). TOML is read with the standard library: a config is data
  paths      a relative path resolves against where it was written: the command line's against the
             working directory, a config file's against the repository when the file is in it (the
             shipped configs) and else against the file's own folder, the defaults against the
             repository; so out/ and data/prepared/ are the repository's wherever a command runs
"""
import dataclasses
import difflib
import glob
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from common import UserError, check, setting
from data.prepare import DataConfig
from model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]   # the repository: where the defaults' paths point


@dataclass
class TrainConfig:
    batch_size: int = setting(12, "sequences per micro-step")
    grad_accum: int = setting(1, "micro-steps per optimizer step")
    max_steps: int = setting(2000, "optimizer steps in the whole run (the LR schedule ends here)")
    optimizer: str = setting("adamw", "adamw | muon (Muon for the hidden matrices, AdamW for the rest)")
    lr: float = setting(1e-3, "AdamW's peak learning rate")
    muon_lr: float = setting(0.02, "Muon's peak learning rate (optimizer = \"muon\")")
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov)")
    schedule: str = setting("cosine", "cosine (warmup, cosine decay) | wsd (warmup, constant, linear warm-down)")
    min_lr: float = setting(1e-4, "the floor that the decay ends at (Muon's: muon_lr * min_lr / lr)")
    warmup_steps: int = setting(100, "steps of linear LR warmup from 0 (fewer than max_steps)")
    warmdown_frac: float = setting(0.2, "wsd: the last fraction of max_steps that decays linearly to min_lr")
    weight_decay: float = setting(0.1, "AdamW weight decay, on matrices only (not biases or norm gains)")
    beta1: float = setting(0.9, "AdamW's momentum")
    beta2: float = setting(0.99, "AdamW's second-moment decay")
    grad_clip: float = setting(1.0, "max global gradient norm (0 = off)")
    eval_interval: int = setting(250, "evaluate (and checkpoint) every this many steps")
    eval_iters: int = setting(100, "batches per split in each evaluation (the same batches every time; 0 = every "
                                   "token of each split, in consecutive windows: exact, slower on a large text)")
    log_interval: int = setting(50, "print and record the training loss every this many steps")
    sample_every: int = setting(0, "every this many steps (and at the last), print and record a short sample "
                                   "(0 = none)")
    sample_prompt: str = setting("", "what those samples continue (\"\" = the tokenizer's start: a newline, "
                                     "end-of-text)")
    sample_tokens: int = setting(200, "new tokens per sample (the same seed every time: samples compare across "
                                      "steps)")
    seed: int = setting(1337, "initial weights, data order and dropout: the same seed, the same run")
    device: str = setting("auto", "auto (cuda > cpu) | cpu | cuda | cuda:N | mps (untested: only when named)")
    dtype: str = setting("auto", "auto (bf16 on CUDA, fp16 where bf16 is missing, fp32 elsewhere) | float32 | "
                                 "bfloat16 | float16")
    compile: bool = setting(False, "torch.compile the model (fused kernels; compiling takes half a minute or "
                                   "more, which a short run does not win back)")
    cuda_graph: bool = setting(True, "one CUDA GPU: record the step as a CUDA graph and replay it (where the "
                                     "graph can hold it; false = launch each kernel from Python)")
    keep_checkpoints: int = setting(2, "ckpt_<step>.pt files kept (the newest); best.pt is kept besides")
    on_nonfinite: str = setting("stop", "stop | skip: what a NaN/inf loss or gradient does")
    fsdp: bool = setting(False, "under torchrun: shard parameters, gradients and optimizer state (FSDP) "
                                "instead of DDP")
    onednn: bool = setting(False, "CPU, fp32: Linear matmuls in oneDNN (faster on some CPUs, slower on others)")
    init_from: str = setting("", "\"\" = random init | gpt2, gpt2-medium, ... | a Hugging Face GPT-2 dir")
    check_memory: bool = setting(True, "refuse a run whose step is estimated to need more memory than the "
                                       "device has free")

    def validate(self) -> None:
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval", "log_interval", "keep_checkpoints",
                     "sample_tokens"):
            check(f"train.{name}", getattr(self, name), above=0)
        for name in ("lr", "min_lr", "muon_lr", "weight_decay", "grad_clip", "warmup_steps", "eval_iters",
                     "sample_every"):
            check(f"train.{name}", getattr(self, name), at_least=0)
        for name in ("beta1", "beta2", "muon_momentum"):
            check(f"train.{name}", getattr(self, name), at_least=0, below=1)
        check("train.warmdown_frac", self.warmdown_frac, above=0, at_most=1)
        check("train.seed", self.seed, at_least=0, at_most=2**32 - 1)   # what numpy's generator accepts
        choices = {"optimizer": ("adamw", "muon"), "schedule": ("cosine", "wsd"),
                   "dtype": ("auto", "float32", "bfloat16", "float16"), "on_nonfinite": ("stop", "skip")}
        for name, allowed in choices.items():
            check(f"train.{name}", getattr(self, name), one_of=allowed)
        if self.min_lr > self.lr:
            raise UserError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}")
        if self.warmup_steps >= self.max_steps > 1:
            raise UserError(f"train.warmup_steps={self.warmup_steps} is not below train.max_steps={self.max_steps}: "
                              f"the whole run would be warm-up, with no decay; lower --train.warmup_steps")
        if self.optimizer == "muon" and self.fsdp:
            raise UserError("train.optimizer=muon needs whole matrices, train.fsdp shards them: use one of the two")
        if self.sample_every and self.fsdp:
            raise UserError("train.sample_every samples on one process, train.fsdp shards the model over all of "
                              "them: use one of the two")


@dataclass
class LogConfig:
    wandb: bool = setting(False, "also log to Weights & Biases (honours WANDB_MODE=offline/disabled)")
    wandb_project: str = setting("gpt", "the wandb project the runs go to")
    wandb_run_name: str = setting("", "\"\" = the out dir's name")
    wandb_group: str = setting("", "runs with the same group overlay in the wandb UI (ablate.py sets the "
                                   "sweep's name)")
    curves: bool = setting(True, "redraw curves.png in the out dir at each evaluation (loss, val bits per byte)")


@dataclass
class Config:
    out_dir: str = setting("", "\"\" = out/<name> in the repository, named after what it trains: the config "
                               "file, and the data and tokenizer the command line sets (out/notes-bpe4096)")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        self.model.validate()
        self.data.validate()
        self.train.validate()


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)}
KEYS = {"out_dir": str, **{f"{s}.{f.name}": f.type for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}}
PATHS = ("out_dir", "data.path", "data.prepared_dir")   # resolved against where they were written
# what is shown or kept of a run, not what it computes or how fast: left out of plot.py's legend
WATCHING_KEYS = {"out_dir", "data.prepared_dir", "train.log_interval", "train.keep_checkpoints",
                 "train.sample_every", "train.sample_prompt", "train.sample_tokens"}
# keys whose change leaves a resumed run computing what it would have computed uninterrupted
SAME_RUN_KEYS = WATCHING_KEYS | {"train.device", "train.compile", "train.cuda_graph", "train.eval_interval",
                                 "train.eval_iters", "train.on_nonfinite"}


def flat(values: dict, prefix: str = "") -> dict:
    """{'model': {'n_head': 4}} -> {'model.n_head': 4}"""
    out = {}
    for k, v in values.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def get_key(cfg: Config, key: str):
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def set_key(cfg: Config, key: str, value) -> None:
    """Set a dotted key ('train.lr' or 'out_dir'), coercing value (TOML's, or command-line text) to its type."""
    if key not in KEYS:
        section = key.rpartition(".")[0]
        what = f"section {section!r} in {key!r}" if section and section not in SECTIONS else f"key {key!r}"
        match = difflib.get_close_matches(key, list(KEYS), n=1, cutoff=0.5)
        raise UserError(f"unknown config {what}" + (f" (did you mean {match[0]!r}?)" if match else ""))
    typ, text = KEYS[key], str(value).strip().lower()
    words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
    try:
        if isinstance(value, str) and typ is not str:   # command-line text
            value = words[text] if typ is bool else typ(text)
        elif not (isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)
                  or typ is float and type(value) is int):
            raise ValueError
    except (KeyError, ValueError):
        raise UserError(f"{key}: expected {typ.__name__}, got {value!r}") from None
    section, _, name = key.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, name, float(value) if typ is float else value)


def load_toml(path) -> dict:
    """A TOML file as a dict; a UTF-8 byte order mark (which Windows' Notepad writes) is skipped."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory: give a config file, such as {path / 'shakespeare_char_cpu.toml'}")
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8").removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError as e:
        hint = f" (did you mean --data {path}?)" if path.suffix != ".toml" else ""
        raise UserError(f"{path}: TOML syntax error: {e}{hint}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file" + (f" (did you mean --data {path}?)"
                                                               if path.suffix != ".toml" else "")) from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--train.lr=1e-3', '--data', 'f.txt'] -> [('train.lr', '1e-3'), ('data.path', 'f.txt')]."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise UserError(f"{arg} needs a value: {arg}=VALUE")
            value, i = args[i + 1], i + 1
        pairs.append(({"data": "data.path"}.get(key, key), value))
        i += 1
    return pairs


def folder_of(path) -> Path:
    """What a relative path written in the file at `path` is relative to (see the top)."""
    return ROOT if Path(path).resolve().is_relative_to(ROOT) else Path(path).resolve().parent


def build_config(config_file: str | None, overrides: list[str], base: dict | None = None,
                 validate: bool = True, layers: list = ()) -> Config:
    """Defaults (or base: a resumed run's stored config), then the TOML file, then `layers` ([(values
    as a dict, the folder its paths are relative to, a label for its errors)]: a sweep's), then the
    command line; paths resolved (see the top), validated."""
    cfg, origin = Config(), dict.fromkeys(PATHS, ROOT)   # where each path was written
    from_file = load_toml(config_file) if config_file else {}
    layers = [(base or {}, ROOT, "the run's config.toml: ")] + \
        ([(from_file, folder_of(config_file), f"{config_file}: ")] if config_file else []) + list(layers)
    for values, where, label in layers:
        for key, value in flat(values).items():
            try:
                set_key(cfg, key, value)
            except UserError as e:
                raise UserError(f"{label}{e}") from None
            origin[key] = where
    given = set()   # the keys the command line sets
    for key, value in parse_overrides(overrides):
        set_key(cfg, key, value)
        given.add(key)
        origin[key] = Path.cwd()
    changed = given & {"data.path", "data.tokenizer"}
    if "out_dir" not in given and (changed or not from_file.get("out_dir")) and not base:
        cfg.out_dir = default_out_dir(config_file, cfg.data, changed)
        origin["out_dir"] = ROOT
    for key in PATHS:
        if not get_key(cfg, key).strip():
            raise UserError(f"{key} is empty" + (": leave it out for out/<name>" if key == "out_dir" else ""))
        set_key(cfg, key, os.path.abspath(os.path.join(origin[key], os.path.expanduser(get_key(cfg, key)))))
    if cfg.train.init_from and base is None:   # the model section comes from the pretrained checkpoint
        from hf.hub import resolve_init_from   # the optional Hugging Face room
        resolve_init_from(cfg, given | set(flat(from_file)))
    if validate:
        cfg.validate()
    return cfg


def default_out_dir(config_file: str | None, data, changed: set[str]) -> str:
    """out/<name>: the config file's name, then the data's (a file's stem, a glob's folder) where the
    command line set it or no config file names it, then the tokenizer's where the command line set it
    or, without a config file, it is not char. Runs on other data or tokens never meet in one out dir."""
    parts = [Path(config_file).stem] if config_file else []
    if "data.path" in changed or not config_file:
        parts.append(Path(data.path).parent.name if glob.has_magic(data.path) else Path(data.path).stem)
    if "data.tokenizer" in changed or (not config_file and data.tokenizer != "char"):
        parts.append(re.sub(r"[^A-Za-z0-9_.]", "", data.tokenizer))
    return "out/" + "-".join(parts)


def changes(before: Config, now: Config) -> list[tuple[str, object, object]]:
    """(key, value before, value now) of every setting that differs."""
    return [(k, get_key(before, k), get_key(now, k)) for k in KEYS if get_key(before, k) != get_key(now, k)]


def fmt(v) -> str:
    """A value as TOML writes it (JSON's escapes of a string are TOML's too)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f") if isinstance(v, str) else repr(v)


def describe(cfg: Config) -> str:
    """The resolved config as TOML text (saved as config.toml in the out dir)."""
    d = cfg.to_dict()
    lines = [f"out_dir = {fmt(d.pop('out_dir'))}"]
    for section, values in d.items():
        lines += ["", f"[{section}]"] + [f"{k} = {fmt(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def reference() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """Every setting as (section, [(key, type, default, what it does)])."""
    fields = [("(top level)", [f for f in dataclasses.fields(Config) if f.name == "out_dir"], Config())]
    fields += [(s, dataclasses.fields(cls), cls()) for s, cls in SECTIONS.items()]
    return [(s, [(f.name if s == "(top level)" else f"{s}.{f.name}", f.type.__name__, fmt(getattr(d, f.name)),
                  f.metadata["help"]) for f in fs]) for s, fs, d in fields]


def help_text() -> str:
    """The settings for `train.py --help`: grouped by section, each with its type, default and meaning."""
    lines = []
    for section, rows in reference():
        width = max(len(f"--{k}={d}") for k, _, d, _ in rows)
        lines += [f"\n[{section}]"] + [f"  --{k}={d}".ljust(width + 4) + f"{t:6s} {text}" for k, t, d, text in rows]
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The same reference as a Markdown page (docs/config.md, generated: python -m training.config)."""
    out = ["# Config reference", "",
           "Every setting, its type, its default and what it does: generated from the dataclasses in",
           "`model/config.py`, `data/prepare.py` and `training/config.py` by `python -m training.config > "
           "docs/config.md` (a test", "checks that this page is up to date). Set any of them in a TOML config "
           "file under its section,", "or on the command line as `--section.key=value`. A relative path "
           "resolves against where it is written:", "the command line's against the working directory, a "
           "config file's against the repository", "(or the file's folder outside it).", ""]
    for section, rows in reference():
        out += [f"## {section}", "", "| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        out += [f"| `{k}` | {t} | `{d}` | {text.replace('|', '&#124;')} |" for k, t, d, text in rows] + [""]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
