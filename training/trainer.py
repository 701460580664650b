"""The training loop. train() runs these steps, top to bottom:

    set_up            check the out dir, the checkpoint to resume and the data; build the data loader,
                      the model and the optimizer. Nothing is written until every check has passed.
    restore           continue a checkpoint: weights, optimizer, data order, random generators.
    build_step        how one optimizer step runs: eager, or a replayed CUDA graph (training/step.py).
    start_writing     lock and create the out dir, print the banner, open metrics.jsonl.
    then, every step  the optimizer step; every log_interval steps a log line; every eval_interval
                      steps (and at the end, or when a signal asks to stop) evaluate_and_save.

Everything a run holds between steps is one Run. Exact resume: the model, the optimizer, the LR
schedule, the data order and every random generator continue where the checkpoint left them.
"""
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.cache import bits_per_byte, load_meta
from data.loader import BatchLoader
from model.gpt import GPT
from training import distributed
from training.checkpoint import (CheckpointError, atomic_write_text, check_resumable, clean_state_dict,
                                 load_checkpoint, new_checkpoint, repair_best, save_checkpoint)
from training.compile import compile_model
from training.config import Config, ConfigError, describe
from training.errors import RunError, first_line, is_out_of_memory, memory_detail
from training.guards import NonFiniteGuard, StopSignal, check_out_dir, make_out_dir
from training.metrics import Metrics, NoMetrics, duration
from training.optim import build_optimizer, lr_as_float, set_lr
from training.runtime import (autocast, dtype_name, pick_device, pick_dtype, printer, rng_state, seed_everything,
                              set_rng_state, use_fast_matmuls)
from training.step import EagerStep, GraphStep, graph_blockers

EVAL_SEED = 4242   # evaluation draws the same batches every time, whatever the training seed


@dataclass
class Run:
    """A training run between steps."""
    cfg: Config
    dist: distributed.Dist
    say: object                     # print on rank 0 (unless quiet), nothing elsewhere
    dtype: torch.dtype
    autocast: object                # the mixed-precision context of every forward
    dataset: Path                   # the prepared dataset's directory
    meta: dict                      # its meta.json
    loader: BatchLoader
    model: GPT                      # what is saved; its parameters are the optimizer's
    trained: torch.nn.Module        # what the step and evaluation call: model, DDP or FSDP, maybe compiled
    optimizer: object
    scaler: torch.amp.GradScaler    # fp16 loss scaling (disabled in bf16 and fp32)
    guard: NonFiniteGuard
    resume_from: Path | None = None
    resume_is_best: bool = False    # the checkpoint resumed from should be best.pt
    step_fn: object = None          # one optimizer step (training/step.py)
    step: int = 0
    best_val: float = math.inf
    elapsed_before: float = 0.0     # training seconds of the runs this one continues
    started: float = 0.0            # perf_counter at the first step of this process
    metrics: object = field(default_factory=NoMetrics)
    lock: object = None             # the out dir's lock (rank 0)
    made_out_dir: bool = False      # this run created the out dir

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return t.batch_size * t.grad_accum * self.dist.world * self.cfg.model.block_size

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started


# ---------------------------------------------------------------- set up

def set_up(cfg: Config, resume: bool, overwrite: bool, quiet: bool) -> tuple[Run, dict | None]:
    """Check everything a user can get wrong, then build the run; returns it and the checkpoint to
    restore (None for a new run). Writes nothing (but the prepared-data cache)."""
    t, out_dir = cfg.train, Path(cfg.out_dir)
    ctx = distributed.setup(pick_device(t.device))   # one process, or this process's rank under torchrun
    resume_from = ctx.on_main(lambda: check_out_dir(out_dir, resume, overwrite))
    ckpt = load_checkpoint(resume_from) if resume_from else None
    if ckpt is not None:
        check_resumable(ckpt, resume_from)
    dtype = pick_dtype(ctx.device, t.dtype)
    if t.fsdp and ctx.world > 1 and dtype == torch.float16:
        raise ConfigError("train.fsdp with float16 needs a sharded gradient scaler: use --train.dtype=bfloat16")

    dataset = ctx.local_main_first(lambda: cfg.data.prepare(cfg.model.block_size))
    meta = load_meta(dataset)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = meta["vocab_size"]
    elif cfg.model.vocab_size < meta["vocab_size"]:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {meta['vocab_size']}")
    if ckpt is not None:
        check_same_model(ckpt, cfg, meta, resume_from)
    loader = BatchLoader(dataset, cfg.model.block_size, t.batch_size, seed=t.seed, device=ctx.device,
                         grad_accum=t.grad_accum, rank=ctx.rank, world=ctx.world)   # checks the split sizes

    seed_everything(t.seed)
    use_fast_matmuls(ctx.device)
    model = GPT(cfg.model).to(ctx.device)   # the same initial weights on every rank
    if t.init_from and ckpt is None:   # pretrained weights (a resumed run restores its checkpoint instead)
        from training.pretrained import load_init_weights
        load_init_weights(model, t.init_from)
    if t.onednn:   # opt-in, CPU only (training/onednn.py)
        from training.onednn import use_onednn_linears
        use_onednn_linears(model, ctx.device, dtype)
    if ctx.rank:
        torch.manual_seed(t.seed + ctx.rank)   # each rank its own dropout masks (the weights above are alike)
    trained = distributed.wrap(model, ctx, t.fsdp)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    run = Run(cfg, ctx, printer(ctx.is_main and not quiet), dtype, autocast(ctx.device, dtype), dataset, meta, loader,
              model, trained, build_optimizer(model, t, ctx.device), scaler,
              NonFiniteGuard(t.on_nonfinite, ctx.device, check_grad=not scaler.is_enabled()), resume_from)
    return run, ckpt


def check_same_model(ckpt: dict, cfg: Config, meta: dict, path: Path) -> None:
    """Resuming needs the model and tokenizer the checkpoint was trained with."""
    saved, now = ckpt["config"]["model"], cfg.to_dict()["model"]
    if saved != now:
        diff = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in now.items() if saved.get(k) != v]
        raise CheckpointError(f"{path} was trained with another model config ({'; '.join(diff)})")
    if ckpt["tokenizer"] != meta["tokenizer"]:
        raise CheckpointError(f"{path} was trained with another tokenizer or vocabulary than {cfg.data.path} gives "
                              f"(resume with the same data file and data.tokenizer)")


# ---------------------------------------------------------------- restore

def restore(run: Run, ckpt: dict) -> None:
    """Continue the checkpoint: weights, optimizer and scaler, data order, every rank's generators."""
    ctx = run.dist
    try:
        distributed.load_full_state(run.model, run.optimizer, clean_state_dict(ckpt["model"]), ckpt["optimizer"])
        if ckpt["scaler"]:
            run.scaler.load_state_dict(ckpt["scaler"])
        run.loader.load_state_dict(ckpt["loader"])
        rngs = ckpt["rng_ranks"]   # one per rank of the run that saved it
        set_rng_state(rngs[ctx.rank] if len(rngs) == ctx.world else rngs[0])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{run.resume_from} does not fit this run: {first_line(e)}") from None
    if len(rngs) != ctx.world and ctx.rank:   # another world size: new dropout streams per rank
        torch.manual_seed(run.cfg.train.seed + 1000 * ckpt["step"] + ctx.rank)
    run.step, run.best_val, run.elapsed_before = ckpt["step"], ckpt["best_val_loss"], ckpt["elapsed"]
    run.guard.skipped = ckpt["skipped_steps"]
    run.guard.start_at(run.step)
    run.guard.saved_step = run.step
    run.resume_is_best = ckpt["is_best"]
    was, now = ckpt["dataset"].get("sha256"), run.meta.get("sha256")
    if was and now and was != now:
        run.say(f"warning: the training text changed since this checkpoint (sha256 {was[:12]}... then, "
                f"{now[:12]}... now); training goes on with the new text")


# ---------------------------------------------------------------- the step

def build_step(run: Run) -> None:
    """torch.compile the model (train.compile), then the step: a CUDA graph where one can hold it
    (train.cuda_graph), else eager. After restore: a graph holds the addresses of the restored state."""
    t = run.cfg.train
    shape = (t.batch_size, run.cfg.model.block_size)
    if t.compile:
        run.trained = compile_model(run.trained, shape, run.cfg.model.vocab_size, run.autocast)
    blockers = graph_blockers(t, run.device, run.dist.world, run.dtype)
    if t.cuda_graph and not blockers:
        try:
            run.step_fn = GraphStep(run.trained, run.model, run.optimizer, run.autocast, run.guard, run.loader, t)
            return
        except Exception as e:   # anything the capture cannot hold: the eager step does the same work
            run.say(f"warning: the CUDA graph step failed, training eagerly ({type(e).__name__}: {first_line(e)})")
    elif t.cuda_graph and run.device.type == "cuda":
        run.say(f"# no CUDA graph: {'; '.join(blockers)}")
    run.step_fn = EagerStep(run.trained, run.model, run.optimizer, run.scaler, run.autocast, run.guard,
                            run.loader, t, run.dist)


# ---------------------------------------------------------------- writing starts

def start_writing(run: Run, overwrite: bool) -> None:
    """Every check has passed: lock and create the out dir (rank 0 alone writes), say what runs.
    If any of it fails (e.g. wandb missing or failing to start), the out dir is left as it was found."""
    try:
        run.dist.on_main(lambda: open_out_dir(run, overwrite))
        say_what_runs(run)
    except BaseException:
        forget_out_dir(run)
        if run.lock is not None:
            run.lock.release()
        raise


def open_out_dir(run: Run, overwrite: bool) -> None:
    run.made_out_dir = not run.out_dir.exists()
    run.lock = make_out_dir(run.out_dir, overwrite)
    if run.resume_from is not None:
        repair_best(run.resume_from, run.resume_is_best)
    atomic_write_text(run.out_dir / "config.toml", describe(run.cfg))
    run.metrics = Metrics(run.cfg, run.out_dir, run.step if run.resume_from else None)


def say_what_runs(run: Run) -> None:
    """The config, then one line: size, device, dtype, step kind, processes, tokens per step, data."""
    ctx, t = run.dist, run.cfg.train
    run.say(describe(run.cfg), end="")
    procs = f" x {ctx.world} processes ({'FSDP' if distributed.is_sharded(run.model) else 'DDP'})" if ctx.world > 1 else ""
    how = ("CUDA graph" if run.step_fn.kind == "graph" else "eager") + (", compiled" if t.compile else "")
    run.say(f"# {run.model.num_params() / 1e6:.2f}M parameters | {run.device}, {dtype_name(run.dtype)}, {how}{procs} "
            f"| {run.tokens_per_step:,} tokens/step | data {run.dataset}")
    if t.fsdp and ctx.world == 1:
        run.say("# train.fsdp: a single process has nothing to shard it with (start several with torchrun)")
    run.say(f"# resuming {run.resume_from} at step {run.step}" if run.resume_from else f"# out dir {run.out_dir}")


def forget_out_dir(run: Run) -> None:
    """Remove what start_writing wrote for a new run (config.toml, metrics.jsonl, the lock, and the
    directory if it made it): called when the run fails before its first checkpoint."""
    if not run.dist.is_main or run.resume_from is not None or run.lock is None:
        return
    run.metrics.close()
    run.lock.release()
    for name in ("config.toml", "metrics.jsonl", ".lock"):
        (run.out_dir / name).unlink(missing_ok=True)
    if run.made_out_dir and not any(run.out_dir.iterdir()):
        run.out_dir.rmdir()


# ---------------------------------------------------------------- evaluate and save

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


def evaluate_and_save(run: Run) -> dict:
    """Train and val loss on fixed batches, one metrics record, a checkpoint (best.pt if best)."""
    run.guard.check()   # never checkpoint weights that a non-finite step touched
    ev = evaluate(run.trained, run.loader, run.cfg.train.eval_iters, run.autocast, run.dist)
    is_best = ev["val"] < run.best_val
    run.best_val = min(run.best_val, ev["val"])
    bpb = {s: bits_per_byte(ev[s], run.meta["tokens"][s], run.meta["bytes"][s]) for s in ("train", "val")}
    run.say(f"eval {run.step:6d} | train {ev['train']:.4f} | val {ev['val']:.4f} | val {bpb['val']:.4f} bits/byte"
            f"{' (best)' if is_best else ''}")
    run.metrics.log({"step": run.step, "kind": "eval", "train_loss": ev["train"], "val_loss": ev["val"],
                     "train_bpb": bpb["train"], "val_bpb": bpb["val"], "elapsed_s": run.elapsed()})
    save(run, is_best)
    return ev


def save(run: Run, is_best: bool) -> None:
    model_state, optimizer_state = distributed.full_state(run.model, run.optimizer)   # gathers FSDP shards
    rngs = run.dist.gather(rng_state())
    if not run.dist.is_main:
        return
    ckpt = new_checkpoint(
        config=run.cfg.to_dict(), tokenizer=run.meta["tokenizer"], model=clean_state_dict(model_state),
        step=run.step, dataset=run.meta, optimizer=lr_as_float(optimizer_state),
        scaler=run.scaler.state_dict() if run.scaler.is_enabled() else None, loader=run.loader.state_dict(),
        rng_ranks=rngs, best_val_loss=run.best_val, elapsed=run.elapsed(), skipped_steps=run.guard.skipped,
        is_best=is_best)
    save_checkpoint(ckpt, run.out_dir, keep=run.cfg.train.keep_checkpoints)
    run.guard.saved_step = run.step


# ---------------------------------------------------------------- the loop

def log_progress(run: Run, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, steps: int, seconds: float) -> dict:
    """One log line and metrics record for the last `steps` steps (this reads the loss: a sync)."""
    run.guard.check()
    t = run.cfg.train
    ms = seconds * 1000 / steps
    record = {"step": run.step, "kind": "train", "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
              "ms_per_step": ms, "tokens_per_s": run.tokens_per_step * 1000 / ms, "skipped_steps": run.guard.skipped}
    eta = duration((t.max_steps - run.step) * ms / 1000)
    run.say(f"step {run.step:6d} | loss {record['loss']:.4f} | lr {lr:.2e} | {ms:7.1f} ms/step | "
            f"{record['tokens_per_s']:,.0f} tok/s | ETA {eta}")
    run.metrics.log(record)
    return record


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          stop_at: int | None = None, on_step=None) -> dict:
    """Run (or continue) the training that cfg describes; return a summary of how it ended.
    stop_at: end this process's part of the run after that step (with an evaluation and a checkpoint),
    as an interruption would; the schedule still runs to train.max_steps on resume.
    on_step: called as on_step(step, model) after every optimizer step (bench.py's race evaluates there)."""
    run, ckpt = set_up(cfg, resume, overwrite, quiet)
    if ckpt is not None:
        restore(run, ckpt)
    del ckpt   # its tensors now live in the model and optimizer
    build_step(run)
    start_writing(run, overwrite)
    t, end = cfg.train, min(cfg.train.max_steps, stop_at or cfg.train.max_steps)
    losses, last_eval, stopping = {}, None, False
    vote = distributed.StopVote(run.dist)
    run.started = t_interval = time.perf_counter()
    interval_steps = 0
    try:
        with StopSignal() as stop:
            while run.step < end:
                lr = set_lr(run.optimizer, run.step, t)
                loss, grad_norm, applied = run.step_fn()
                run.step += 1
                interval_steps += 1
                if not applied:
                    run.say(f"step {run.step:6d} | non-finite {run.guard.last}: update skipped "
                            f"({run.guard.skipped} so far)")
                if on_step is not None:
                    on_step(run.step, run.model)
                stopping = vote(stop.requested is not None)   # all ranks stop at the same step

                logged = run.step % t.log_interval == 0 or run.step == t.max_steps
                if logged:
                    record = log_progress(run, loss, grad_norm, lr, interval_steps, time.perf_counter() - t_interval)
                    losses[run.step] = record["loss"]
                evaluated = run.step % t.eval_interval == 0 or run.step in (t.max_steps, stop_at) or stopping
                if evaluated:
                    last_eval = evaluate_and_save(run)
                if logged or evaluated:
                    t_interval, interval_steps = time.perf_counter(), 0   # evaluations are not billed to steps
                if stopping:
                    run.say(f"stopped by {stop.requested or 'a signal to another rank'} at step {run.step}, "
                            f"checkpoint saved in {run.out_dir}; to continue, run the same command with --resume")
                    break
            vote.finish()
    except Exception as e:
        if run.guard.saved_step is None:
            forget_out_dir(run)   # a run that never got to a checkpoint leaves the out dir as it found it
        if not is_out_of_memory(e):
            raise
        raise out_of_memory(run, e) from None
    finally:
        run.metrics.close()
        if run.lock is not None:
            run.lock.release()
    return finish(run, losses, last_eval, stopping, stop.exit_code or (130 if stopping else 0))


def out_of_memory(run: Run, error: BaseException) -> RunError:
    """An allocation failure in the loop, in one line: what to make smaller, and what is kept."""
    kept = f"and --resume to continue from the last checkpoint in {run.out_dir}" if run.guard.saved_step \
        else "no checkpoint had been written yet"
    return RunError(f"out of memory on {run.device} at step {run.step + 1} ({memory_detail(error, 80)}): try a "
                    f"smaller --train.batch_size (with a larger --train.grad_accum to keep the tokens per step; "
                    f"{kept}) or a smaller --model.block_size")


def finish(run: Run, losses: dict, last_eval: dict | None, stopping: bool, exit_code: int) -> dict:
    """Say how a run that reached max_steps went; return train()'s summary."""
    total = run.elapsed()
    if run.step >= run.cfg.train.max_steps:
        skipped = f", {run.guard.skipped} non-finite steps skipped" if run.guard.skipped else ""
        run.say(f"# done: step {run.step}, best val loss {run.best_val:.4f}, {duration(total)} "
                f"({total:.1f} s), {run.step * run.tokens_per_step:,} tokens{skipped}")
    return {"step": run.step, "val_loss": last_eval["val"] if last_eval else None, "best_val_loss": run.best_val,
            "elapsed_s": total, "losses": losses, "skipped_steps": run.guard.skipped,
            "interrupted": stopping, "exit_code": exit_code}
