"""The training loop: the optimizer and LR schedule of training/optim.py, gradient accumulation and clipping,
evaluation on fixed batches, checkpoints, metrics.jsonl (and wandb if enabled), exact resume."""
import glob
import json
import random
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from data.loader import BatchLoader
from data.prepare import DataError, load_meta, prepare
from data.tokenizers import load_tokenizer
from model.gpt import GPT
from training.checkpoint import (CheckpointError, atomic_write_text, check_resumable, clean_state_dict,
                                 load_checkpoint, repair_best, save_checkpoint)
from training import distributed
from training.config import Config, ConfigError, describe
from training.errors import RunError
from training.guards import NonFiniteGuard, StopSignal, check_out_dir, make_out_dir
from training.optim import build_optimizer, lr_at, set_lr  # noqa: F401 (lr_at: the schedule, importable from here too)
from training.throughput import compile_model, onednn_pays, use_onednn_linears

EVAL_SEED = 4242   # evaluation draws the same batches every time, whatever the training seed


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
    if not source.exists() and not glob.has_magic(cfg.data.path):   # a glob names files that exist
        raise DataError(f"data file not found: {source}")
    return prepare(source, cfg.data.tokenizer, cfg.data.val_fraction, Path(cfg.data.prepared_dir),
                   cfg.data.encoding_errors)


class NoMetrics:
    """What ranks other than 0 log to: nothing."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics:
    """metrics.jsonl (always) and wandb (when enabled): one record per log or eval line."""

    def __init__(self, cfg: Config, out_dir: Path, resume_step: int | None):
        self.path = out_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():   # forget what came after the checkpoint
            atomic_write_text(self.path, "".join(l + "\n" for l in self.path.read_text().splitlines()
                                                 if self.step_of(l) <= resume_step))
        self.file = open(self.path, "a" if resume_step is not None else "w")
        self.wandb = None
        if cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("log.wandb = true but wandb is not installed (pip install wandb)") from None
            self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or out_dir.name,
                                    group=cfg.log.wandb_group or None, config=cfg.to_dict(), dir=str(out_dir),
                                    resume="allow")

    @staticmethod
    def step_of(line: str) -> float:
        """A record's step; inf for a line a kill cut short (so it is dropped)."""
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return float("inf")

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
def evaluate(model, loader: BatchLoader, iters: int, autocast, ctx: distributed.Dist | None = None) -> dict:
    """Mean loss over the same `iters` batches of each split every time (a fixed generator); with
    several ranks each evaluates its slice of every batch and the means are averaged."""
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
        out[split] = (ctx.all_reduce_mean(total / iters) if ctx else total / iters).item()
    model.train()
    return out


def check_same_run(ckpt: dict, cfg: Config, meta: dict, path: Path) -> None:
    """Resuming needs the model and tokenizer the checkpoint was trained with."""
    saved, now = ckpt["config"]["model"], cfg.to_dict()["model"]
    if saved != now:
        diff = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in now.items() if saved.get(k) != v]
        raise CheckpointError(f"{path} was trained with another model config ({'; '.join(diff)})")
    if ckpt["tokenizer"] != meta["tokenizer"]:
        raise CheckpointError(f"{path} was trained with another tokenizer or vocabulary than {cfg.data.path} gives "
                              f"(resume with the same data file and data.tokenizer)")


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          stop_at: int | None = None, on_step=None) -> dict:
    """Run (or continue) the training that cfg describes; return a summary of how it ended.
    stop_at: end this process's part of the run after that step (with an evaluation and a checkpoint),
    as an interruption would; the schedule still runs to train.max_steps on resume.
    Everything a user can get wrong (out dir, checkpoint, data, sizes) is checked before the first
    write to the out dir, so a bad input leaves it as it was.
    on_step: called as on_step(step, model) after every optimizer step (bench.py's race evaluates there)."""
    t, out_dir = cfg.train, Path(cfg.out_dir)
    ctx = distributed.setup(pick_device(t.device))   # one process, or this process's rank under torchrun
    say = print if ctx.is_main and not quiet else (lambda *a, **k: None)
    resume_from = ctx.on_main(lambda: check_out_dir(out_dir, resume, overwrite))
    ckpt = load_checkpoint(resume_from) if resume_from else None
    if ckpt is not None:
        check_resumable(ckpt, resume_from)
    device = ctx.device
    dtype = pick_dtype(device, t.dtype)
    if t.fsdp and ctx.world > 1 and dtype == torch.float16:
        raise ConfigError("train.fsdp with float16 needs a sharded gradient scaler: use --train.dtype=bfloat16")

    dataset = ctx.local_main_first(lambda: prepare_data(cfg))
    meta = load_meta(dataset)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = meta["vocab_size"]
    elif cfg.model.vocab_size < meta["vocab_size"]:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {meta['vocab_size']}")
    if ckpt is not None:
        check_same_run(ckpt, cfg, meta, resume_from)
    loader = BatchLoader(dataset, cfg.model.block_size, t.batch_size, seed=t.seed, device=device,   # checks split sizes
                         grad_accum=t.grad_accum, rank=ctx.rank, world=ctx.world)

    torch.manual_seed(t.seed)
    random.seed(t.seed)
    np.random.seed(t.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = (torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext())
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))

    model = GPT(cfg.model).to(device)   # the same initial weights on every rank
    if ctx.rank:
        torch.manual_seed(t.seed + ctx.rank)   # but each its own dropout masks
    onednn = t.onednn and onednn_pays(device, dtype)
    if onednn:
        use_onednn_linears(model, device, dtype)   # before wrapping: same parameters, faster CPU matmuls
    train_model = distributed.wrap(model, ctx, t.fsdp)   # model, DDP(model), or model sharded in place
    optimizer = build_optimizer(model, t, device)
    guard = NonFiniteGuard(t.on_nonfinite, device, check_grad=not scaler.is_enabled())
    step, best_val, elapsed = 0, float("inf"), 0.0
    if ckpt is not None:
        try:
            distributed.load_full_state(model, optimizer, clean_state_dict(ckpt["model"]), ckpt["optimizer"])
            scaler.load_state_dict(ckpt["scaler"]) if ckpt.get("scaler") else None
            loader.load_state_dict(ckpt["loader"])
            rngs = ckpt.get("rng_ranks") or [ckpt["rng"]]   # one per rank of the run that saved it
            set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world else rngs[0])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"{resume_from} does not fit this run: {str(e).strip().splitlines()[0][:160]}") from None
        if len(rngs) != ctx.world and ctx.rank:   # another world size: new dropout streams per rank
            torch.manual_seed(t.seed + 1000 * ckpt["step"] + ctx.rank)
        step, best_val, elapsed = ckpt["step"], ckpt["best_val_loss"], ckpt["elapsed"]
        guard.skipped = ckpt.get("skipped_steps", 0)
    step_fn = (compile_model(train_model, (t.batch_size, cfg.model.block_size), cfg.model.vocab_size, autocast)
               if t.compile else train_model)

    def first_write() -> None:   # every check above has passed; only rank 0 writes
        make_out_dir(out_dir, overwrite)
        if ckpt is not None:
            repair_best(resume_from, ckpt)
    ctx.on_main(first_write)
    tokens_per_step = t.batch_size * t.grad_accum * ctx.world * cfg.model.block_size
    say(describe(cfg), end="")
    procs = f" x {ctx.world} processes ({'FSDP' if distributed.is_sharded(model) else 'DDP'})" if ctx.world > 1 else ""
    levers = f"{', oneDNN linears' if onednn else ''}{', compiled' if t.compile else ''}"
    say(f"# {model.num_params() / 1e6:.2f}M parameters | device {device}, {str(dtype).removeprefix('torch.')}"
        f"{levers}{procs} | {tokens_per_step:,} tokens/step | data {dataset}")
    if t.fsdp and ctx.world == 1:
        say("# train.fsdp: a single process has nothing to shard it with (start several with torchrun)")
    say(f"# resuming {resume_from} at step {step}" if ckpt else f"# out dir {out_dir}")
    if ctx.is_main:   # only rank 0 writes
        atomic_write_text(out_dir / "config.toml", describe(cfg))
    metrics = Metrics(cfg, out_dir, step if ckpt else None) if ctx.is_main else NoMetrics()

    def checkpoint(is_best: bool) -> None:
        model_state, optimizer_state = distributed.full_state(model, optimizer)   # gathers FSDP shards
        rngs = ctx.gather(rng_state())
        if not ctx.is_main:
            return
        state = {"config": cfg.to_dict(), "tokenizer": meta["tokenizer"], "dataset": meta,
                 "model": clean_state_dict(model_state), "optimizer": optimizer_state,
                 "scaler": scaler.state_dict() if scaler.is_enabled() else None, "step": step,
                 "best_val_loss": best_val, "rng": rngs[0], "rng_ranks": rngs, "loader": loader.state_dict(),
                 "skipped_steps": guard.skipped, "elapsed": elapsed + time.perf_counter() - t_start}
        save_checkpoint(state, out_dir, step, keep=t.keep_checkpoints, is_best=is_best)

    losses, last_eval = {}, None
    t_start = t_interval = time.perf_counter()
    interval_steps, stopping = 0, False
    with StopSignal() as stop:
        try:
            while step < min(t.max_steps, stop_at or t.max_steps):
                lr = set_lr(optimizer, step, t)
                loss_sum = torch.zeros((), device=device)
                for micro, (x, y) in enumerate(loader.step_batches("train")):
                    with distributed.sync_gradients(train_model, sync=micro == t.grad_accum - 1):
                        with autocast:
                            _, loss = step_fn(x, y)
                        loss_sum += loss.detach()
                        scaler.scale(loss / t.grad_accum).backward()   # DDP/FSDP average over the ranks
                ctx.all_reduce_mean(loss_sum)   # the loss of the whole global batch, on every rank
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
                if guard.ok(step + 1, loss_sum, grad_norm):   # every rank sees the same loss and norm: same decision
                    scaler.step(optimizer)
                else:
                    say(f"step {step + 1:6d} | non-finite {guard.last}: update skipped ({guard.skipped} so far)")
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                interval_steps += 1
                if on_step is not None:
                    on_step(step, model)
                stopping = ctx.any(stop.requested is not None)   # all ranks stop at the same step

                if step % t.log_interval == 0 or step == t.max_steps:
                    guard.check()
                    now = time.perf_counter()
                    ms = (now - t_interval) * 1000 / interval_steps
                    record = {"step": step, "kind": "train", "loss": loss_sum.item() / t.grad_accum, "lr": lr,
                              "grad_norm": grad_norm.item(), "ms_per_step": ms, "tokens_per_s": tokens_per_step * 1000 / ms,
                              "skipped_steps": guard.skipped}
                    say(f"step {step:6d} | loss {record['loss']:.4f} | lr {lr:.2e} | {ms:7.1f} ms/step | "
                        f"{record['tokens_per_s']:,.0f} tok/s")
                    metrics.log(record)
                    losses[step] = record["loss"]
                if step % t.eval_interval == 0 or step in (t.max_steps, stop_at) or stopping:
                    guard.check()   # never checkpoint weights that a non-finite step touched
                    ev = evaluate(model, loader, t.eval_iters, autocast, ctx)
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
                if stopping:
                    say(f"stopped by {stop.requested or 'a signal to another rank'} at step {step}, checkpoint saved "
                        f"in {out_dir}; to continue, run the same command with --resume")
                    break
        except torch.OutOfMemoryError:
            raise RunError(f"out of memory on {device} at step {step + 1}: try a smaller --train.batch_size (with a "
                           f"larger --train.grad_accum to keep the tokens per step, and --resume to continue from "
                           f"the last checkpoint in {out_dir}) or a smaller --model.block_size") from None
        finally:
            metrics.close()

    total = elapsed + time.perf_counter() - t_start
    if step >= t.max_steps:
        skipped = f", {guard.skipped} non-finite steps skipped" if guard.skipped else ""
        say(f"# done: step {step}, best val loss {best_val:.4f}, {total:.1f} s{skipped}")
    return {"step": step, "val_loss": last_eval["val"] if last_eval else None, "best_val_loss": best_val,
            "elapsed_s": total, "losses": losses, "skipped_steps": guard.skipped,
            "interrupted": stopping, "exit_code": stop.exit_code or (130 if stopping else 0)}
