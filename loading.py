"""A trained model from a checkpoint file, a run's out dir (its best.pt, else its latest
ckpt_*.pt) or a Hugging Face GPT-2 (the hf/ room), for the commands and a resumed run.

A checkpoint is read safely: every member's checksum (torch.save writes a zip), then
torch.load(weights_only=True) (no code runs), its format and version, and the weights strictly
into the model of its config. Any failure is one line.
"""
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from common import ROOT, UserError, first_line
from data.tokenizers import load_tokenizer
from model.config import ModelConfig
from model.gpt import GPT

FORMAT, VERSION = "gpt-checkpoint", 2
CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")


def list_checkpoints(out_dir) -> list[tuple[int, Path]]:
    """(step, path) of the step checkpoints in out_dir, oldest first."""
    names = os.listdir(out_dir) if Path(out_dir).is_dir() else []
    return sorted((int(m[1]), Path(out_dir) / n) for n in names if (m := CKPT_RE.match(n)))


def read_checkpoint(path) -> dict:
    """A checkpoint file's dict, read as the top says."""
    # a run's path typed from another folder names the repository's
    if not Path(path).is_file():
        near = f"; did you mean {ROOT / path}?" if (ROOT / path).exists() else ""
        raise UserError(f"checkpoint not found: {path}{near}")
    try:
        # torch.load itself reads a flipped bit in a tensor without a word
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        ckpt = None if damaged else torch.load(path, map_location="cpu", weights_only=True)
    # more than tensors and plain data
    except pickle.UnpicklingError:
        raise UserError(f"{path} was refused: it holds objects that could run code "
                        f"when loaded") from None
    # truncated, not a zip
    except Exception as e:
        raise UserError(f"{path} is not a readable checkpoint ({first_line(e, 100)})") from None
    if damaged:
        raise UserError(f"{path} is damaged: {damaged} does not match its checksum")
    version = ckpt.get("version") if isinstance(ckpt, dict) else None
    if type(version) is not int or ckpt.get("format") != FORMAT:
        raise UserError(f"{path} is not a checkpoint of this project "
                        f"(format {FORMAT} version {VERSION})")
    if version != VERSION:
        reads = "an earlier" if version < VERSION else "a later"
        raise UserError(f"{path} is a checkpoint of format version {version}, this code reads "
                        f"version {VERSION}: {reads} commit of this repository reads it")
    return ckpt


@dataclass
class LoadedModel:
    """A model read from a file, in eval mode, and what came with it."""
    model: GPT
    tokenizer: object
    path: Path | str
    description: str


def load_model(source, device=torch.device("cpu")) -> LoadedModel:
    """A directory with config.json, or a hub name such as gpt2, is a Hugging Face GPT-2."""
    text, path = str(source), Path(source)
    hugging_face = (path / "config.json").is_file() and not list(path.glob("*.pt"))
    if hugging_face or not path.exists() and "/" not in text:
        from hf.hub import load_gpt2
        model, tokenizer, description = load_gpt2(text)
        return LoadedModel(model.to(device), tokenizer, text, description)
    if path.is_dir():
        best = path / "best.pt"
        found = [(0, best)] if best.is_file() else list_checkpoints(path)
        if not found:
            raise UserError(f"no checkpoint (best.pt or ckpt_*.pt) in {path}")
        path = found[-1][1]
    ckpt = read_checkpoint(path)
    # a tiktoken name whose files are missing is said as such
    tokenizer = load_tokenizer(ckpt["tokenizer"])
    try:
        model = GPT(ModelConfig(**ckpt["config"]["model"]))
        model.load_state_dict(ckpt["model"])
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"its tokenizer has {tokenizer.vocab_size} tokens, its model "
                             f"{model.cfg.vocab_size}")
    # torch says which weight in the lines after its first
    except Exception as e:
        why = " ".join(str(e).split())[:200]
        raise UserError(f"{path} does not hold a usable model ({why})") from None
    best = ckpt.get("best_val_loss")
    val = f", val loss {best:.4f}" if isinstance(best, float) else ""
    description = f"{path} (step {ckpt['step']}{val})"
    return LoadedModel(model.to(device).eval(), tokenizer, path, description)
