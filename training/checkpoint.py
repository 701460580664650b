"""Checkpoints: what they hold, writing them atomically, and reading them without running their code.

An out dir holds ckpt_<step>.pt (the last `keep` of them) and best.pt (lowest val loss so far).
A checkpoint is a dict of tensors and plain values; SCHEMA below is the one place that says which.

Saving is atomic (common.atomic_write): a reader, or a run killed mid-save, sees the old checkpoint
or the new one, never half of one; old checkpoints are deleted only after the new one is complete.
Loading checks the zip archive (every member's CRC, no compressed members), then uses
torch.load(weights_only=True): unpickling is restricted to tensors and plain containers, so a
malicious file cannot execute code.

(Over 300 lines on purpose: the file a user's hours of training live in; what it holds, how it is
written and every check of reading it stay together.)
"""
import dataclasses
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

from common import CheckpointError, ConfigError, TokenizerError, atomic_write, first_line, type_problem
from data.tokenizers import load_tokenizer
from model.config import ModelConfig
from model.gpt import GPT
from training.config import coerce

FORMAT, VERSION = "gpt-checkpoint", 2   # version 1 lacked "tokens"
CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")
WRAPPERS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}   # torch.compile, FSDP, checkpointing

# What a checkpoint holds, with each entry's type. Sampling needs the first group, resuming all of them.
FOR_SAMPLING = {
    "config": dict,                 # the run's resolved config (training.config.Config.to_dict())
    "tokenizer": dict,              # the tokenizer's meta: a model always comes with its tokenizer
    "model": dict,                  # parameter name -> tensor, without wrapper prefixes
    "step": int,                    # optimizer steps taken
}
FOR_RESUMING = {
    "dataset": dict,                # the prepared data's meta.json (source sha256, split, counts)
    "optimizer": dict,              # optimizer state, keyed by parameter index
    "scaler": (dict, type(None)),   # fp16 loss scaler, None when not used
    "loader": dict,                 # the data order's generator
    "rng_ranks": list,              # every rank's random generators (dropout draws)
    "best_val_loss": float,
    "elapsed": float,               # seconds of training before this checkpoint
    "tokens": int,                  # tokens trained on before this checkpoint (batch shapes may change on resume)
    "skipped_steps": int,           # updates dropped for a non-finite loss or gradient
    "is_best": bool,                # best.pt should be this file
}
SCHEMA = {**FOR_SAMPLING, **FOR_RESUMING}


def clean_key(name: str) -> str:
    """'module._orig_mod.blocks.0.attn.weight' -> 'blocks.0.attn.weight': drop the names that
    torch.compile, FSDP and activation checkpointing insert anywhere, and DDP's leading 'module.'."""
    parts = [p for p in name.split(".") if p not in WRAPPERS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def clean_state_dict(state: dict) -> dict:
    return {clean_key(k): v for k, v in state.items()}


# ---------------------------------------------------------------- writing

def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step checkpoints in out_dir, oldest first."""
    out_dir = Path(out_dir)
    names = os.listdir(out_dir) if out_dir.is_dir() else []
    return sorted((int(m.group(1)), out_dir / name) for name in names if (m := CKPT_RE.match(name)))


def latest_checkpoint(out_dir: Path) -> Path | None:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1][1] if ckpts else None


def link_best(path: Path) -> None:
    """Make best.pt the checkpoint at path: a hard link (no space, no time; it keeps the data when
    ckpt_* is rotated out), or a copy where the file system has no hard links."""
    best, tmp = path.parent / "best.pt", path.parent / ".best.pt.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        with open(path, "rb") as src:
            atomic_write(best, lambda f: shutil.copyfileobj(src, f))
        return
    os.replace(tmp, best)


def new_checkpoint(**entries) -> dict:
    """The dict a checkpoint file holds: exactly SCHEMA's entries, plus the format tag and version.
    Learning rates are plain floats (a CUDA graph step holds them in device tensors), so that a
    checkpoint loads anywhere and resumes with either kind of step."""
    if set(entries) != set(SCHEMA):
        raise ValueError(f"a checkpoint holds {sorted(SCHEMA)}; got {sorted(entries)}")
    return {"format": FORMAT, "version": VERSION, **entries, "optimizer": float_lrs(entries["optimizer"])}


def float_lrs(optimizer_state: dict) -> dict:
    """An optimizer state dict (or training/optim.py's Optimizers' list of them) with every lr a float."""
    if "optimizers" in optimizer_state:
        return {**optimizer_state, "optimizers": [float_lrs(s) for s in optimizer_state["optimizers"]]}
    groups = [{**g, "lr": float(g["lr"])} for g in optimizer_state.get("param_groups", [])]
    return {**optimizer_state, "param_groups": groups}


def save_failure(path: Path, error: BaseException) -> CheckpointError:
    """Any failure to write a checkpoint, said in one line: torch.save reports a full disk as a
    RuntimeError from its zip writer, os calls as an OSError."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error, 120)
    try:
        free = shutil.disk_usage(path.parent).free
        if free < 64 << 20:
            reason += f"; {free / 2**20:.0f} MB left on the device (is the disk full?)"
    except OSError:
        pass
    return CheckpointError(f"could not write the checkpoint {path}: {reason}; the checkpoints written before are kept")


def save_checkpoint(ckpt: dict, out_dir: Path, keep: int) -> Path:
    """Write ckpt_<step>.pt, point best.pt at it if it is the best, then delete all but the last
    `keep`. Any failure is a CheckpointError and leaves the earlier checkpoints as they were."""
    out_dir = Path(out_dir)
    path = out_dir / f"ckpt_{ckpt['step']:07d}.pt"
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
        if ckpt["is_best"]:
            link_best(path)
    except Exception as e:
        raise save_failure(path, e) from None
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def repair_best(path: Path) -> None:
    """A run killed between writing its best checkpoint (path) and linking best.pt to it left best.pt
    stale: resuming from that checkpoint links it now."""
    best = Path(path).parent / "best.pt"
    if not (best.exists() and os.path.samefile(best, path)):
        link_best(Path(path))


# ---------------------------------------------------------------- reading

def resolve_path(path: Path) -> Path:
    """A checkpoint file, or a run dir -> its best.pt, else its latest ckpt_*.pt."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_dir():
        return path
    found = path / "best.pt" if (path / "best.pt").is_file() else latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no checkpoint (best.pt or ckpt_*.pt) in {path}")
    return found


def refused_global(error: Exception) -> str:
    """The line of torch's weights_only error that names what was refused (e.g. 'GLOBAL posix.system')."""
    named = [l.strip() for l in str(error).splitlines() if "GLOBAL" in l or "Unsupported" in l]
    return named[0][:160] if named else first_line(error)


def _earlier_hint(path: Path) -> str:
    """', the earlier ckpt_... is intact' where a damaged file has an older neighbour to resume from."""
    here = CKPT_RE.match(path.name)   # by step, not by name: ckpt_10000000.pt comes after ckpt_9999999.pt
    older = [p for s, p in list_checkpoints(path.parent) if here and s < int(here.group(1))]
    return f"; the earlier checkpoint {older[-1].name} in the same directory may be intact" if older else ""


def check_archive(path: Path) -> None:
    """torch.save writes an uncompressed zip: its members' sizes must fit in the file (a compressed
    member could expand to any size when loaded), and every member's CRC must match its bytes."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if any(m.compress_type != zipfile.ZIP_STORED for m in members) or \
                    sum(m.file_size for m in members) > path.stat().st_size:
                raise CheckpointError(f"{path} is not a checkpoint written by this project (compressed members)")
            bad = archive.testzip()
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a readable checkpoint (damaged: {first_line(e, 100)})"
                              f"{_earlier_hint(path)}") from None
    if bad is not None:
        raise CheckpointError(f"{path} is damaged: {bad} does not match its checksum{_earlier_hint(path)}")


def load_checkpoint(path: Path, mmap: bool = True) -> dict:
    """Load and check a checkpoint file (the entries sampling needs); any problem is a CheckpointError
    naming the file. mmap: tensors are memory-mapped, not read, until they are used; the file then stays
    mapped as long as one of them lives (Windows can neither replace nor delete a mapped file)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint is not a file: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint is empty: {path}{_earlier_hint(path)}")
    if not zipfile.is_zipfile(path):   # torch.save writes a zip archive; its index is at the very end
        raise CheckpointError(f"{path} is not a readable checkpoint: truncated, or not a checkpoint file at all"
                              f"{_earlier_hint(path)}")
    check_archive(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} was refused: it holds objects other than tensors and plain data, "
                              f"which could run code when loaded ({refused_global(e)})") from None
    except Exception as e:   # a damaged archive can fail in many ways; none of them may escape as a traceback
        raise CheckpointError(f"{path} is not a readable checkpoint (damaged or truncated: {first_line(e, 120)})"
                              f"{_earlier_hint(path)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this project")
    if ckpt.get("version") not in (1, VERSION):
        raise CheckpointError(f"{path} has checkpoint format version {ckpt.get('version')!r}, "
                              f"this code reads versions 1 and {VERSION}")
    if ckpt["version"] == 1 and "rng_ranks" in ckpt:   # every step had the batch shape of its config
        t, processes = ckpt["config"].get("train", {}), len(ckpt["rng_ranks"])
        ckpt["tokens"] = ckpt["step"] * t.get("batch_size", 0) * t.get("grad_accum", 0) * processes * \
            ckpt["config"]["model"].get("block_size", 0)
    if problem := type_problem(ckpt, {**FOR_SAMPLING, "config": {"model": dict}}):
        raise CheckpointError(f"{path} is damaged: {problem}")
    return ckpt


def check_resumable(ckpt: dict, path: Path) -> None:
    """A checkpoint to resume from must hold the whole training state, not only the weights."""
    if missing := [k for k in FOR_RESUMING if k not in ckpt]:
        raise CheckpointError(f"{path} cannot be resumed from: it lacks {', '.join(missing)}")
    if problem := type_problem(ckpt, FOR_RESUMING):
        raise CheckpointError(f"{path} is damaged: {problem}")


def check_same_run(ckpt: dict, path: Path, model: dict, tokenizer: dict, data_path: str) -> None:
    """Resuming needs the model settings and the tokenizer the checkpoint was trained with."""
    saved = ckpt["config"]["model"]
    if saved != model:
        diff = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in model.items() if saved.get(k) != v]
        raise CheckpointError(f"{path} was trained with another model config ({'; '.join(diff)})")
    if ckpt["tokenizer"] != tokenizer:
        raise CheckpointError(f"{path} was trained with another tokenizer or vocabulary than {data_path} gives "
                              f"(resume with the same data file and data.tokenizer)")


# ---------------------------------------------------------------- a model to use

@dataclasses.dataclass
class LoadedModel:
    """A model read from a checkpoint, ready to use (eval mode), with what came with it."""
    model: GPT
    tokenizer: object
    path: str | Path
    description: str          # one line: where it came from, its step and val loss
    step: int | None = None


def model_config(stored: dict, path: Path) -> ModelConfig:
    """The stored model section as a ModelConfig, each value checked for its type and range."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    values = {}
    try:
        for key, value in stored.items():
            if key not in fields:
                raise ConfigError(f"unknown setting model.{key}")
            if isinstance(value, str) and fields[key] is not str:   # a checkpoint stores typed values, never text
                raise ConfigError(f"model.{key}: expected {fields[key].__name__}, got {value!r}")
            values[key] = coerce(f"model.{key}", value, fields[key])
        cfg = ModelConfig(**values)
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{path} does not hold a usable model: {first_line(e)}") from None
    return cfg


def check_weights(state: dict, cfg, path: Path) -> None:
    """The stored tensors must be exactly the ones the config's model has, shape for shape: checked
    on shapes alone (a model on the meta device), before any memory is allocated for the model."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
    stored = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    # a wrong shape first: it says most about how the config and the weights disagree
    problems = [f"{k} is {stored[k]}, the config needs {shape}" for k, shape in expected.items()
                if stored.get(k) is not None and stored[k] != shape]
    problems += [f"{k} is not a tensor" for k, shape in stored.items() if shape is None]
    problems += [f"{k} is missing" for k in expected if k not in stored]
    problems += [f"{k} is not part of the model" for k in stored if k not in expected]
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise CheckpointError(f"{path}: its weights do not match its config: {'; '.join(problems[:2])}{more}")


def load_model(path, device: torch.device = torch.device("cpu")) -> LoadedModel:
    """The model of a checkpoint (a file, or a run dir: its best.pt, else its latest checkpoint), or
    of a Hugging Face GPT-2 (a name such as gpt2, or a directory with config.json), with its
    tokenizer. Everything is checked before the model is built: the archive, the config, the
    tokenizer, each weight's shape, and that no weight is NaN or infinite."""
    source, path = str(path), Path(path)
    is_run = path.is_dir() and (latest_checkpoint(path) is not None or (path / "best.pt").is_file())
    if (path / "config.json").is_file() and not is_run or (not path.exists() and "/" not in source and os.sep not in source):
        from hf.hub import load_gpt2   # a Hugging Face directory or hub name: the optional hf/ room
        model, tokenizer, description = load_gpt2(source)
        return LoadedModel(model.to(device), tokenizer, source, description)
    path = resolve_path(path)
    ckpt = load_checkpoint(path)
    cfg = model_config(ckpt["config"]["model"], path)
    try:
        tokenizer = load_tokenizer(ckpt["tokenizer"])
    except TokenizerError as e:
        if ckpt["tokenizer"].get("kind") == "tiktoken":   # a named encoding whose files are missing: not the file's fault
            raise
        raise CheckpointError(f"{path} does not hold a usable tokenizer: {first_line(e)}") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path} is damaged: its tokenizer has {tokenizer.vocab_size} tokens, "
                              f"its model only model.vocab_size={cfg.vocab_size}")
    state = clean_state_dict(ckpt["model"])
    check_weights(state, cfg, path)
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{path} holds non-finite weights (NaN or inf in {bad[0]}"
                              f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}): the run diverged "
                              f"or the file is damaged; try an earlier checkpoint")
    model = GPT(cfg)
    model.load_state_dict(state)
    best = ckpt.get("best_val_loss")
    val = f", val loss {best:.4f}" if isinstance(best, float) else ""
    return LoadedModel(model.to(device).eval(), tokenizer, path, f"{path} (step {ckpt['step']}{val})", ckpt["step"])
