"""The training loop: the optimizer and LR schedule of training/optim.py, gradient accumulation and clipping,
evaluation on fixed batches, checkpoints, metrics.jsonl (and wandb if enabled), exact resume."""
import json
import os
import random
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from data.loader import BatchLoader
from data.prepare import DataError, download, load_meta, prepare
from data.tokenizers import load_tokenizer
from model.gpt import GPT
from training.checkpoint import (CheckpointError, clean_state_dict, latest_checkpoint, list_checkpoints,
                                 load_checkpoint, save_checkpoint)
from training.config import Config, ConfigError, describe
from training.optim import build_optimizer, lr_at, set_lr  # noqa: F401 (lr_at: the schedule, importable from here too)
from training.throughput import compile_model, use_onednn_linears

EVAL_SEED = 4242   # evaluation draws the same batches every time, whatever the training seed


class RunError(RuntimeError):
    """A run that cannot start or go on (out dir, resume, numerical fault); the message says why."""


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device={name!r} is not a device (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here")
    return device


def pick_dtype(device: torch.device, name: str) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return getattr(torch, name)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
            "numpy": np_state[1].tolist(), "numpy_pos": int(np_state[2]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s: dict) -> None:
    random.setstate((s["python_version"], tuple(s["python"]), None))
    np.random.set_state(("MT19937", np.array(s["numpy"], dtype=np.uint32), s["numpy_pos"], 0, 0.0))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def prepare_data(cfg: Config) -> Path:
    source = Path(cfg.data.path)
    if not source.exists():
        if not cfg.data.url:
            raise DataError(f"data file not found: {source}")
        download(cfg.data.url, source)
    return prepare(source, cfg.data.tokenizer, cfg.data.val_fraction, Path(cfg.data.prepared_dir),
                   cfg.data.encoding_errors)


def check_out_dir(out_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """Make sure out_dir is usable; return the checkpoint to resume from (if resuming)."""
    latest = latest_checkpoint(out_dir)
    if resume:
        if latest is None:
            raise RunError(f"--resume: no checkpoint (ckpt_*.pt) in {out_dir} to resume from")
        return latest
    if (latest is not None or (out_dir / "best.pt").exists()) and not overwrite:
        raise RunError(f"{out_dir} already holds checkpoints of a run: continue it with --resume, "
                       f"start over with --overwrite, or choose another --out_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunError(f"cannot write to the out dir {out_dir}: {e.strerror or e}") from None
    if overwrite:
        for _, p in list_checkpoints(out_dir):
            p.unlink()
        for name in ("best.pt", "metrics.jsonl"):
            (out_dir / name).unlink(missing_ok=True)
    return None


class StopSignal:
    """SIGINT/SIGTERM: the first asks the loop to stop after the current step (and save);
    a second one exits at once (checkpoints are written atomically, so nothing is corrupted)."""

    def __init__(self):
        self.requested = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        if self.requested is not None:
            print(f"\n{signal.Signals(signum).name} again: exiting now", flush=True)
            os._exit(128 + signum)
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: finishing this step and saving a checkpoint (again to exit at once)", flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Metrics:
    """metrics.jsonl (always) and wandb (when enabled): one record per log or eval line."""

    def __init__(self, cfg: Config, out_dir: Path, resume_step: int | None):
        self.path = out_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():   # forget what came after the checkpoint
            kept = [l for l in self.path.read_text().splitlines() if l and json.loads(l)["step"] <= resume_step]
            self.path.write_text("".join(l + "\n" for l in kept))
        self.file = open(self.path, "a")
        self.wandb = None
        if cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("log.wandb = true but wandb is not installed (pip install wandb)") from None
            self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or out_dir.name,
                                    config=cfg.to_dict(), dir=str(out_dir), resume="allow")

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind")}, step=record["step"])

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


@torch.no_grad()
def evaluate(model, loader: BatchLoader, iters: int, autocast) -> dict:
    """Mean loss over the same `iters` batches of each split every time (a fixed generator)."""
    model.eval()
    out = {}
    for split in ("train", "val"):
        gen = torch.Generator().manual_seed(EVAL_SEED)
        total = torch.zeros((), device=loader.device)
        for _ in range(iters):
            x, y = loader.batch(split, gen)
            with autocast:
                _, loss = model(x, y)
            total += loss.float()
        out[split] = (total / iters).item()
    model.train()
    return out


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          stop_at: int | None = None, on_step=None) -> dict:
    """Run (or continue) the training that cfg describes; return a summary of how it ended.
    stop_at: end this process's part of the run after that step (with an evaluation and a checkpoint),
    as an interruption would; the schedule still runs to train.max_steps on resume.
    on_step: called as on_step(step, model) after every optimizer step (bench.py's race evaluates there)."""
    say = (lambda *a, **k: None) if quiet else print
    t, out_dir = cfg.train, Path(cfg.out_dir)
    resume_from = check_out_dir(out_dir, resume, overwrite)
    ckpt = load_checkpoint(resume_from) if resume_from else None

    dataset = prepare_data(cfg)
    meta = load_meta(dataset)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = meta["vocab_size"]
    elif cfg.model.vocab_size < meta["vocab_size"]:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {meta['vocab_size']}")
    if ckpt is not None and ckpt["config"]["model"] != cfg.to_dict()["model"]:
        saved = ckpt["config"]["model"]
        diff = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now"
                for k, v in cfg.to_dict()["model"].items() if saved.get(k) != v]
        raise CheckpointError(f"{resume_from} was trained with another model config ({'; '.join(diff)})")

    device = pick_device(t.device)
    dtype = pick_dtype(device, t.dtype)
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    np.random.seed(t.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = (torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext())
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))

    model = GPT(cfg.model).to(device)
    if t.onednn:
        use_onednn_linears(model, device, dtype)
    optimizer = build_optimizer(model, t, device)
    loader = BatchLoader(dataset, cfg.model.block_size, t.batch_size, seed=t.seed, device=device)
    step, best_val, elapsed = 0, float("inf"), 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"]) if ckpt.get("scaler") else None
        loader.load_state_dict(ckpt["loader"])
        set_rng_state(ckpt["rng"])
        step, best_val, elapsed = ckpt["step"], ckpt["best_val_loss"], ckpt["elapsed"]
    step_fn = compile_model(model, (t.batch_size, cfg.model.block_size), cfg.model.vocab_size, autocast) if t.compile else model

    tokens_per_step = t.batch_size * t.grad_accum * cfg.model.block_size
    say(describe(cfg), end="")
    say(f"# {model.num_params() / 1e6:.2f}M parameters | device {device}, {str(dtype).removeprefix('torch.')}"
        f"{', compiled' if t.compile else ''} | {tokens_per_step:,} tokens/step | data {dataset}")
    say(f"# resuming {resume_from} at step {step}" if ckpt else f"# out dir {out_dir}")
    (out_dir / "config.toml").write_text(describe(cfg))
    metrics = Metrics(cfg, out_dir, step if ckpt else None)

    def checkpoint(is_best: bool) -> None:
        state = {"config": cfg.to_dict(), "tokenizer": meta["tokenizer"], "dataset": meta,
                 "model": clean_state_dict(model.state_dict()), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict() if scaler.is_enabled() else None, "step": step,
                 "best_val_loss": best_val, "rng": rng_state(), "loader": loader.state_dict(),
                 "elapsed": elapsed + time.perf_counter() - t_start}
        save_checkpoint(state, out_dir, step, keep=2, is_best=is_best)

    losses, last_eval = {}, None
    t_start = t_interval = time.perf_counter()
    interval_steps = 0
    with StopSignal() as stop:
        while step < min(t.max_steps, stop_at or t.max_steps):
            lr = set_lr(optimizer, step, t)
            loss_sum = torch.zeros((), device=device)
            for _ in range(t.grad_accum):
                x, y = loader.batch("train")
                with autocast:
                    _, loss = step_fn(x, y)
                loss_sum += loss.detach()
                scaler.scale(loss / t.grad_accum).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
            if not torch.isfinite(loss_sum) or not torch.isfinite(grad_norm):
                raise RunError(f"non-finite {'loss' if not torch.isfinite(loss_sum) else 'gradient'} at step {step + 1}; "
                               f"stopped, the last good checkpoint is kept (try a lower --train.lr)")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            interval_steps += 1
            if on_step is not None:
                on_step(step, model)

            if step % t.log_interval == 0 or step == t.max_steps:
                now = time.perf_counter()
                ms = (now - t_interval) * 1000 / interval_steps
                record = {"step": step, "kind": "train", "loss": loss_sum.item() / t.grad_accum, "lr": lr,
                          "grad_norm": grad_norm.item(), "ms_per_step": ms, "tokens_per_s": tokens_per_step * 1000 / ms}
                say(f"step {step:6d} | loss {record['loss']:.4f} | lr {lr:.2e} | {ms:7.1f} ms/step | "
                    f"{record['tokens_per_s']:,.0f} tok/s")
                metrics.log(record)
                losses[step] = record["loss"]
            if step % t.eval_interval == 0 or step in (t.max_steps, stop_at) or stop.requested:
                ev = evaluate(model, loader, t.eval_iters, autocast)
                is_best = ev["val"] < best_val
                best_val = min(best_val, ev["val"])
                say(f"eval {step:6d} | train {ev['train']:.4f} | val {ev['val']:.4f}{' (best)' if is_best else ''}")
                metrics.log({"step": step, "kind": "eval", "train_loss": ev["train"], "val_loss": ev["val"],
                             "elapsed_s": elapsed + time.perf_counter() - t_start})
                checkpoint(is_best)
                last_eval = ev
                t_interval = time.perf_counter()   # do not bill evaluation and saving to the step time
                interval_steps = 0
            elif step % t.log_interval == 0:
                t_interval, interval_steps = time.perf_counter(), 0
            if stop.requested:
                say(f"stopped by {stop.requested} at step {step}; continue with the same command and --resume")
                break

    metrics.close()
    total = elapsed + time.perf_counter() - t_start
    if step >= t.max_steps:
        say(f"# done: step {step}, best val loss {best_val:.4f}, {total:.1f} s")
    return {"step": step, "val_loss": last_eval["val"] if last_eval else None, "best_val_loss": best_val,
            "elapsed_s": total, "losses": losses, "interrupted": stop.requested is not None}
