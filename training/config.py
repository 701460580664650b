"""The run's configuration: typed dataclasses, overridden by a TOML file, overridden by the command line.

    python train.py [CONFIG.toml] [--section.key=value ...] [--data FILE] [--out_dir DIR]

Each section is a dataclass that lives with the code it configures (ModelConfig in model/config.py,
DataConfig in data/prepare.py; TrainConfig and LogConfig here) and checks itself in validate().
Values are coerced to each field's type; an unknown key or a bad value is a ConfigError that names
it (and the closest valid key). TOML is read with the standard library: a config is data, never code.

(Over 300 lines on purpose: the train and log sections with the comments --help shows, and every rule
of reading, overriding, resuming and describing a config, kept beside the settings they apply to.)
"""
import dataclasses
import difflib
import glob
import inspect
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from common import ConfigError, check, type_problem
from data.prepare import DataConfig
from model.config import ModelConfig


@dataclass
class TrainConfig:
    batch_size: int = 12          # sequences per micro-step
    grad_accum: int = 1           # micro-steps per optimizer step
    max_steps: int = 2000         # optimizer steps in the whole run (the LR schedule ends here)
    optimizer: str = "adamw"      # adamw | muon (Muon for the hidden matrices, AdamW for the rest)
    lr: float = 1e-3              # AdamW's peak learning rate
    muon_lr: float = 0.02         # Muon's peak learning rate (optimizer = "muon")
    muon_momentum: float = 0.95   # Muon's momentum (Nesterov)
    schedule: str = "cosine"      # cosine (warmup, cosine decay) | wsd (warmup, constant, linear warm-down)
    min_lr: float = 1e-4          # the floor that the decay ends at (Muon's: muon_lr * min_lr / lr)
    warmup_steps: int = 100       # steps of linear LR warmup from 0
    warmdown_frac: float = 0.2    # wsd: the last fraction of max_steps that decays linearly to min_lr
    weight_decay: float = 0.1     # AdamW weight decay, on matrices only (not biases or norm gains)
    beta1: float = 0.9            # AdamW's momentum
    beta2: float = 0.99           # AdamW's second-moment decay
    grad_clip: float = 1.0        # max global gradient norm (0 = off)
    eval_interval: int = 250      # evaluate (and checkpoint) every this many steps
    sample_every: int = 0         # every this many steps (and at the last), print and record a short sample (0 = none)
    sample_prompt: str = ""       # what those samples continue ("" = the tokenizer's start: a newline, end-of-text)
    sample_tokens: int = 200      # new tokens per sample (the same seed every time: samples compare across steps)
    eval_iters: int = 100         # batches per split in each evaluation (the same batches every time; 0 = every
                                  # token of each split, in consecutive windows: exact, slower on a large text)
    log_interval: int = 50        # print and record the training loss every this many steps
    seed: int = 1337              # initial weights, data order and dropout: the same seed, the same run
    device: str = "auto"          # auto (cuda > cpu) | cpu | cuda | cuda:N | mps (untested: only when named)
    dtype: str = "auto"           # auto (bf16 on CUDA, fp16 where bf16 is missing, fp32 elsewhere) | float32 | bfloat16 | float16
    compile: bool = False         # torch.compile the model (fused kernels; compiling takes seconds to minutes)
    cuda_graph: bool = False      # CUDA: record the step as a CUDA graph, replay it (off until timed faster on a GPU)
    keep_checkpoints: int = 2     # ckpt_<step>.pt files kept (the newest); best.pt is kept besides
    on_nonfinite: str = "stop"    # stop | skip: what a NaN/inf loss or gradient does
    fsdp: bool = False            # under torchrun: shard parameters, gradients and optimizer state (FSDP) instead of DDP
    onednn: bool = False          # CPU, fp32: Linear matmuls in oneDNN (faster on some CPUs, slower on others)
    init_from: str = ""           # "" = random init | gpt2, gpt2-medium, ... | a Hugging Face GPT-2 dir
    check_memory: bool = True     # refuse a run whose step is estimated to need more memory than the device has free

    def validate(self) -> None:
        """A ConfigError naming the first training setting that cannot be used."""
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval", "log_interval", "keep_checkpoints"):
            check(f"train.{name}", getattr(self, name), above=0)
        check("train.sample_tokens", self.sample_tokens, above=0)
        for name in ("lr", "min_lr", "muon_lr", "weight_decay", "grad_clip", "warmup_steps", "eval_iters", "sample_every"):
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
            raise ConfigError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}")
        if self.optimizer == "muon" and self.fsdp:
            raise ConfigError("train.optimizer=muon needs whole matrices, train.fsdp shards them: use one of the two")
        if self.sample_every and self.fsdp:
            raise ConfigError("train.sample_every samples on one process, train.fsdp shards the model over all of "
                              "them: use one of the two")


@dataclass
class LogConfig:
    wandb: bool = False           # also log to Weights & Biases (honours WANDB_MODE=offline/disabled)
    wandb_project: str = "gpt"    # the wandb project the runs go to
    wandb_run_name: str = ""      # "" = the out dir's name
    wandb_group: str = ""         # runs with the same group overlay in the wandb UI (ablate.py sets the sweep's name)
    curves: bool = True           # redraw curves.png in the out dir at each evaluation (loss, val bits per byte)


@dataclass
class Config:
    out_dir: str = ""             # "" = named after what it trains: the config file, the data and the
                                  # tokenizer the command line sets (out/notes-bpe4096); a config file's
                                  # out_dir holds while the command line sets neither data.path nor data.tokenizer
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """A ConfigError (or TokenizerError) naming the first setting that cannot be used."""
        self.model.validate()
        self.data.validate()
        self.train.validate()


def flat(values: dict, prefix: str = "") -> dict:
    """{'model': {'n_head': 4}} -> {'model.n_head': 4}"""
    out = {}
    for k, v in values.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def get_key(cfg: "Config", key: str):
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section), name) if section else getattr(cfg, name)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)}


def _closest(key: str, options) -> str:
    match = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def all_keys() -> list[str]:
    return ["out_dir"] + [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def coerce(key: str, value, typ):
    """value (from TOML, or a command-line string) as typ, or a ConfigError naming key."""
    if isinstance(value, str) and typ is not str:   # command-line text
        words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
        text = value.strip().lower()
        try:
            return words[text] if typ is bool else float(text) if typ is float else int(text)
        except (KeyError, ValueError):
            pass
    elif type_problem({key: value}, {key: typ}) is None:   # (an int is never a bool; a float may hold an int)
        return float(value) if typ is float else value
    raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")


def set_key(cfg: Config, key: str, value) -> None:
    """Set a dotted key ('train.lr' or 'out_dir') on cfg, coercing value to the field's type."""
    section, _, name = key.rpartition(".")
    if section and section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} in {key!r}{_closest(key, all_keys())}")
    if key not in all_keys():
        raise ConfigError(f"unknown config key {key!r}{_closest(key, all_keys())}")
    obj = getattr(cfg, section) if section else cfg
    setattr(obj, name, coerce(key, value, {f.name: f.type for f in dataclasses.fields(obj)}[name]))


def apply_dict(cfg: Config, values: dict, where: str = "") -> None:
    """Apply a nested dict such as a parsed TOML file: {'model': {'n_layer': 4}, 'out_dir': ...}."""
    for key, value in values.items():
        if isinstance(value, dict) and key not in SECTIONS:
            raise ConfigError(f"{where}unknown config section [{key}]{_closest(key, SECTIONS)}")
        pairs = {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
        for dotted, v in pairs.items():
            try:
                set_key(cfg, dotted, v)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None


def load_toml(path: Path) -> dict:
    """A TOML file as a dict; a UTF-8 byte order mark (which Windows' Notepad writes) is skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8").removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--train.lr=1e-3', '--data', 'f.txt'] -> [('train.lr', '1e-3'), ('data.path', 'f.txt')]."""
    shorthands = {"data": "data.path"}
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{arg} needs a value: {arg}=VALUE")
            value, i = args[i + 1], i + 1
        pairs.append((shorthands.get(key, key), value))
        i += 1
    return pairs


def build_config(config_file: str | None, overrides: list[str], base: dict | None = None) -> Config:
    """Defaults (or base: a resumed run's stored config), then the TOML file, then the command line;
    validated, with out_dir resolved."""
    cfg = Config()
    apply_dict(cfg, base or {}, where="the run's config.toml: ")
    from_file = load_toml(Path(config_file)) if config_file else {}
    apply_dict(cfg, from_file, where=f"{config_file}: ")
    given = set()   # the keys the command line sets
    for key, value in parse_overrides(overrides):
        set_key(cfg, key, value)
        given.add(key)
    changed = given & {"data.path", "data.tokenizer"}
    if "out_dir" not in given and (changed or not from_file.get("out_dir")) and not base:
        cfg.out_dir = default_out_dir(config_file, cfg.data, changed)
    if cfg.train.init_from and base is None:   # the model section comes from the pretrained checkpoint
        from hf.hub import resolve_init_from   # the optional Hugging Face room
        explicit = given | {f"{s}.{k}" for s, v in from_file.items() if isinstance(v, dict) for k in v}
        resolve_init_from(cfg, explicit)
    cfg.validate()
    return cfg


def default_out_dir(config_file: str | None, data, changed: set[str]) -> str:
    """out/<name>: the config file's name, then the data's (a file's stem, a glob's folder) where the
    command line set it or no config file names it, then the tokenizer's where the command line set it
    or, without a config file, it is not char. Runs on other data or tokens never meet in one out dir
    by surprise."""
    parts = [Path(config_file).stem] if config_file else []
    if "data.path" in changed or not config_file:
        parts.append(Path(data.path).parent.name if glob.has_magic(data.path) else Path(data.path).stem)
    if "data.tokenizer" in changed or (not config_file and data.tokenizer != "char"):
        parts.append(re.sub(r"[^A-Za-z0-9_.]", "", data.tokenizer))
    return (Path("out") / "-".join(parts)).as_posix()   # out/..., as the README writes it, on Windows too


# what is shown or kept of a run, not what it computes or how fast: left out of plot.py's legend
WATCHING_KEYS = {"out_dir", "data.prepared_dir", "train.log_interval", "train.keep_checkpoints",
                 "train.sample_every", "train.sample_prompt", "train.sample_tokens"}
# keys whose change leaves a resumed run computing what it would have computed uninterrupted
SAME_RUN_KEYS = WATCHING_KEYS | {"train.device", "train.compile", "train.cuda_graph", "train.eval_interval",
                                 "train.eval_iters", "train.on_nonfinite"}


def _changed(stored: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(key, value as the run started, value now) of each setting a resumed run changes; stored: the
    run's config.toml, whose run goes on in cfg's out dir."""
    before = build_config(None, [], base={**stored, "out_dir": cfg.out_dir})
    return [(k, get_key(before, k), get_key(cfg, k)) for k in all_keys() if get_key(before, k) != get_key(cfg, k)]


def check_resume_keeps(stored: dict, cfg: Config) -> None:
    """--resume goes on with the run's own model and tokenizer: a change to either is refused here,
    before any text is prepared for it (the checkpoint is checked against the model again on loading)."""
    for key, before, now in _changed(stored, cfg):
        if key.startswith("model.") or key == "data.tokenizer":
            raise ConfigError(f"{key}: {fmt(before)} in the run, {fmt(now)} now: --resume goes on with the "
                              f"run's own model and tokenizer (another --out_dir starts a new run)")


def changes_since(stored: dict, cfg: Config) -> tuple[list[str], bool]:
    """What a resumed run changes of the config it was started with (`stored`): each change as
    'key: old -> new', and whether one breaks exact continuation (anything but SAME_RUN_KEYS and log.*)."""
    changed = _changed(stored, cfg)
    notes = [f"{k}: {fmt(before)} -> {fmt(now)}" for k, before, now in changed]
    return notes, any(k not in SAME_RUN_KEYS and not k.startswith("log.") for k, _, _ in changed)


FIELD_RE = re.compile(r"^    (\w+): [^=]+=.*?(?:#\s*(.*))?$")


def field_docs(cls) -> dict[str, str]:
    """{field name: the comment beside it in cls's source (continued on the comment lines below it)}."""
    docs, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        if m := FIELD_RE.match(line):
            last = m.group(1)
            docs[last] = (m.group(2) or "").strip()
        elif last and line.startswith(" " * 8) and line.strip().startswith("#"):
            docs[last] += " " + line.strip().lstrip("#").strip()
        elif line.strip():
            last = None
    return docs


def reference() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """Every setting as (section, [(key, type, default, what it does)]), from the dataclasses and the
    comment beside each field in their source: each setting is documented once, where it is defined."""
    out = [("(top level)", [("out_dir", "str", fmt(Config().out_dir), field_docs(Config)["out_dir"])])]
    for section, cls in SECTIONS.items():
        docs, defaults = field_docs(cls), cls()
        out.append((section, [(f"{section}.{f.name}", f.type.__name__, fmt(getattr(defaults, f.name)),
                               docs.get(f.name, "")) for f in dataclasses.fields(cls)]))
    return out


def help_text() -> str:
    """The settings for `train.py --help`: grouped by section, each with its type, default and meaning."""
    lines = []
    for section, rows in reference():
        lines.append(f"\n[{section}]")
        width = max(len(f"--{k}={d}") for k, _, d, _ in rows)
        lines += [f"  --{k}={d}".ljust(width + 4) + f"{t:6s} {text}" for k, t, d, text in rows]
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The same reference as a Markdown page (docs/config.md, generated: python -m training.config)."""
    out = ["# Config reference", "",
           "Every setting, its type, its default and what it does: generated from the dataclasses in",
           "`model/config.py`, `data/prepare.py` and `training/config.py` by `python -m training.config > docs/config.md` (a test",
           "checks that this page is up to date). Set any of them in a TOML config file under its section,",
           "or on the command line as `--section.key=value`.", ""]
    for section, rows in reference():
        out += [f"## {section}", "", "| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        out += [f"| `{k}` | {t} | `{d}` | {text.replace('|', '&#124;')} |" for k, t, d, text in rows]
        out.append("")
    return "\n".join(out)


def fmt(v) -> str:
    """A value as TOML writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def changes_from_defaults(cfg: Config) -> list[str]:
    """Every setting of cfg that is not its default, as 'key = value' (TOML); not out_dir or
    model.vocab_size, which follow from the data (the banner names both)."""
    default = Config()
    return [f"{k} = {fmt(get_key(cfg, k))}" for k in all_keys()
            if k not in ("out_dir", "model.vocab_size") and get_key(cfg, k) != get_key(default, k)]


def describe(cfg: Config) -> str:
    """The resolved config as TOML text (printed at start, saved as config.toml in the out dir)."""
    d = cfg.to_dict()
    lines = [f"out_dir = {fmt(d.pop('out_dir'))}"]
    for section, values in d.items():
        lines += ["", f"[{section}]"] + [f"{k} = {fmt(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
