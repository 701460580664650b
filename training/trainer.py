"""The training loop. train() runs these steps, top to bottom:

    set_up            check the out dir, the checkpoint to resume and the data; build the data loader,
                      the model and the optimizer. Nothing is written until every check has passed.
    restore           continue a checkpoint: weights, optimizer, data order, random generators.
    build_step        how one optimizer step runs: eager (training/step.py), maybe compiled, or
                      replayed as a CUDA graph (speed/).
    start_writing     lock and create the out dir, write config.toml, open metrics.jsonl, print the banner.
    run_steps         the optimizer steps; every log_interval steps a log line; every eval_interval
                      steps (and at the end, or when a signal asks to stop) evaluate_and_save.

Everything a run holds between steps is one Run. Exact resume: the model, the optimizer, the LR
schedule, the data order and every random generator continue where the checkpoint left them.

(Over 300 lines on purpose: a run's whole life, in the order train() lives it, in one file to read
from top to bottom.)
"""
import functools
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import (CheckpointError, ConfigError, Interrupted, Printer, RunError, StopRequest, duration, first_line,
                    is_out_of_memory, on_stop_signals)
from data.cache import bits_per_byte, load_meta
from data.loader import BatchLoader
from data.prepare import prepare
from model.gpt import GPT
from training.checkpoint import (check_resumable, check_same_run, clean_state_dict, load_checkpoint, new_checkpoint,
                                 repair_best, save_checkpoint)
from training.config import Config, changes_since, describe
from training.optim import build_optimizer, lr_at, set_lr
from training.outdir import Metrics, NoMetrics, OutDir
from training.runtime import (World, autocast, dtype_name, free_memory, pick_device, pick_dtype, rng_state,
                              seed_everything, set_rng_state, step_memory, use_fast_matmuls)
from training.step import NonFiniteGuard, Step, graph_blockers, mean_loss

EVAL_SEED = 4242   # evaluation draws the same batches every time, whatever the training seed


@dataclass
class Run:
    """A training run between steps."""
    cfg: Config
    world: World                    # this process among the run's processes; world.device computes
    print: Printer                  # prints on the main process unless quiet; .lost once stdout is gone
    dtype: torch.dtype              # the number format of the matmuls (under autocast)
    dataset: Path                   # the prepared dataset's directory
    meta: dict                      # its meta.json
    loader: BatchLoader
    model: GPT                      # what is saved; its parameters are the optimizer's
    wrapped: torch.nn.Module        # what the step and evaluation call: model, DDP or FSDP, maybe compiled
    optimizer: object
    scaler: torch.amp.GradScaler    # fp16 loss scaling (disabled in bf16 and fp32)
    guard: NonFiniteGuard
    out: OutDir
    memory: str                     # the step's estimated memory, for the banner
    relink_best: bool = False       # the resumed checkpoint is the best: best.pt must be it
    train_step: object = None       # the next optimizer step (training/step.py, speed/cuda_graph.py)
    step: int = 0                   # optimizer steps done
    best_val: float = math.inf
    tokens: int = 0                 # tokens trained on, the runs this one continues included
    seconds_before: float = 0.0     # training time of the runs this one continues
    started: float = 0.0            # perf_counter at this process's first step
    metrics: object = field(default_factory=NoMetrics)

    @property
    def autocast(self):
        return autocast(self.world.device, self.dtype)

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return t.batch_size * t.grad_accum * self.world.size * self.cfg.model.block_size

    def elapsed(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          stop_at: int | None = None, on_step=None) -> dict:
    """Run (or continue) the training that cfg describes; return a summary of how it ended.
    stop_at: end this process's part of the run after that step (with an evaluation and a checkpoint),
    as an interruption would; the schedule still runs to train.max_steps on resume.
    on_step: called as on_step(step, model) after every optimizer step (bench.py's race evaluates there); when
    it returns True the run ends after that step as with stop_at (bench.py tokenizers: a time budget; under
    torchrun every rank must answer alike)."""
    world = join_world(pick_device(cfg.train.device))   # one process, or this process's rank under torchrun
    # SIGINT, SIGTERM, SIGHUP: finish the step, save, stop (a second one exits at once; checkpoints are
    # written atomically, so a save cut short leaves only a temporary file, which the next run removes)
    stop = StopRequest("finishing this step and saving a checkpoint")
    finished = False
    try:
        run, ckpt = set_up(cfg, world, resume, overwrite, quiet)
        with on_stop_signals(stop):
            if ckpt is not None:
                restore(run, ckpt)
            del ckpt   # its tensors now live in the model and optimizer
            build_step(run)
            start_writing(run)
            summary = run_steps(run, stop, stop_at, on_step)
        finished = True
        return summary
    finally:
        world.leave(finished)


# ---------------------------------------------------------------- set up

def join_world(device: torch.device) -> World:
    """This process's World: alone, or under torchrun (WORLD_SIZE > 1) its place in the process group."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return World(device)
    from training.distributed import ProcessGroup   # only under torchrun
    return ProcessGroup.join(device)


def set_up(cfg: Config, world: World, resume: bool, overwrite: bool, quiet: bool) -> tuple[Run, dict | None]:
    """Check everything a user can get wrong, then build the run; returns it and the checkpoint to
    restore (None for a new run). Writes nothing (but the prepared-data cache)."""
    t, device = cfg.train, world.device
    out = OutDir(cfg.out_dir)
    out.resume_from = resume_from = world.on_main(lambda: out.check(resume, overwrite))
    ckpt = load_checkpoint(resume_from) if resume_from else None
    if ckpt is not None:
        check_resumable(ckpt, resume_from)
    dtype = pick_dtype(device, t.dtype)
    if t.fsdp and world.size > 1 and dtype == torch.float16:
        raise ConfigError("train.fsdp with float16 needs a sharded gradient scaler: use --train.dtype=bfloat16")

    dataset = world.local_main_first(lambda: prepare(cfg.data, cfg.model.block_size))
    meta = load_meta(dataset)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = meta["vocab_size"]
    elif cfg.model.vocab_size < meta["vocab_size"]:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {meta['vocab_size']}")
    if ckpt is not None:
        check_same_run(ckpt, resume_from, cfg.to_dict()["model"], meta["tokenizer"], cfg.data.path)
    memory = check_memory(cfg, device, dtype)
    loader = BatchLoader(dataset, cfg.model.block_size, t.batch_size, seed=t.seed, device=device,
                         grad_accum=t.grad_accum, rank=world.rank, world=world.size)   # checks the split sizes

    seed_everything(t.seed)
    use_fast_matmuls(device)
    model = GPT(cfg.model).to(device)   # the same initial weights on every rank
    if t.init_from and ckpt is None:   # pretrained weights (a resumed run restores its checkpoint instead)
        from hf.hub import load_init_weights   # the optional Hugging Face room
        load_init_weights(model, t.init_from)
    if t.onednn:
        from speed.onednn import use_onednn_linears   # the optional speed room
        use_onednn_linears(model, device, dtype)
    if world.rank:
        torch.manual_seed(t.seed + world.rank)   # each rank its own dropout masks (the weights above are alike)
    wrapped = world.wrap(model, t.fsdp)        # before the optimizer: FSDP replaces the parameters by shards
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    optimizer = build_optimizer(model, t.optimizer, device, lr=t.lr, betas=(t.beta1, t.beta2),
                                weight_decay=t.weight_decay, muon_lr=t.muon_lr, muon_momentum=t.muon_momentum)
    guard = NonFiniteGuard(t.on_nonfinite, device, check_grad=not scaler.is_enabled())
    run = Run(cfg, world, Printer(world.is_main and not quiet), dtype, dataset, meta, loader, model, wrapped, optimizer,
              scaler, guard, out, memory)
    return run, ckpt


def check_memory(cfg: Config, device: torch.device, dtype: torch.dtype) -> str:
    """Refuse, before anything is allocated, a run whose step would need more memory than the device has
    free (train.check_memory = false tries anyway); return the estimate in words, for the banner."""
    with torch.device("meta"):   # shapes only: no memory
        params = sum(p.numel() for p in GPT(cfg.model).parameters())
    state, activations = step_memory(cfg, params, dtype)
    free = free_memory(device)
    size = lambda n: f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"   # noqa: E731
    need = f"about {size(state + activations)} (activations {size(activations)}, weights and optimizer {size(state)})"
    if cfg.train.check_memory and free is not None and state + activations > free:
        m, t = cfg.model, cfg.train
        raise RunError(f"one training step needs {need} for batch {t.batch_size} x block {m.block_size} x {m.n_layer} "
                       f"layers, more than the {size(free)} free on {device}: make --train.batch_size (with a larger "
                       f"--train.grad_accum to keep the tokens per step), --model.block_size or the model smaller, or "
                       f"set --train.check_memory=false to try anyway")
    return f"a step needs {need}" + (f", {size(free)} free" if free is not None else "")


# ---------------------------------------------------------------- restore

def restore(run: Run, ckpt: dict) -> None:
    """Continue the checkpoint: weights, optimizer and scaler, data order, every rank's generators."""
    world = run.world
    try:
        world.load_full_state(run.model, run.optimizer, clean_state_dict(ckpt["model"]), ckpt["optimizer"])
        if ckpt["scaler"]:
            run.scaler.load_state_dict(ckpt["scaler"])
        run.loader.load_state_dict(ckpt["loader"])
        rngs = ckpt["rng_ranks"]   # one per rank of the run that saved it
        set_rng_state(rngs[world.rank] if len(rngs) == world.size else rngs[0])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"{run.out.resume_from} does not fit this run: {first_line(e)}") from None
    if len(rngs) != world.size and world.rank:   # another world size: new dropout streams per rank
        torch.manual_seed(run.cfg.train.seed + 1000 * ckpt["step"] + world.rank)
    run.step, run.best_val, run.seconds_before = ckpt["step"], ckpt["best_val_loss"], ckpt["elapsed"]
    run.tokens = ckpt["tokens"]
    run.guard.start_at(run.step, ckpt["skipped_steps"])
    run.guard.saved_step = run.step
    run.relink_best = ckpt["is_best"]
    was, now = ckpt["dataset"].get("sha256"), run.meta.get("sha256")
    if was and now and was != now:
        run.print(f"warning: the training text changed since this checkpoint (sha256 {was[:12]}... then, "
                  f"{now[:12]}... now); training goes on with the new text")


# ---------------------------------------------------------------- the step

def build_step(run: Run) -> None:
    """torch.compile the model (train.compile), then the step: eager, or recorded as a CUDA graph where
    one can hold it (train.cuda_graph). After restore: a graph holds the addresses of the restored state."""
    t = run.cfg.train
    if t.compile:
        from speed.compile import compiled_or_eager   # the optional speed room
        run.wrapped = compiled_or_eager(run.wrapped, functools.partial(compile_trial, run), "training")
    step = Step(run.wrapped, run.model, run.optimizer, run.scaler, run.autocast, run.guard, run.world, run.loader,
                t.grad_clip)
    run.train_step = step
    if not t.cuda_graph:
        return
    blockers = graph_blockers(t.on_nonfinite, run.world.device, run.world.size, run.dtype)
    if blockers:
        if run.world.device.type == "cuda":
            run.print(f"# no CUDA graph: {'; '.join(blockers)}")
        return
    from speed.cuda_graph import GraphStep   # the optional speed room
    try:
        run.train_step = GraphStep(step, run.loader)
    except Exception as e:   # anything the recording cannot hold: the eager step does the same work
        run.print(f"warning: the CUDA graph step failed, training eagerly ({type(e).__name__}: {first_line(e)})")


def compile_trial(run: Run, compiled) -> None:
    """One forward and backward of the compiled model on a batch of the training shape (compiling
    the graphs the step reuses), leaving no trace: no gradients, the random generators as they were."""
    device, t = run.world.device, run.cfg.train
    x = torch.randint(0, run.cfg.model.vocab_size, (t.batch_size, run.cfg.model.block_size), device=device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), run.autocast:
            compiled(x, x)[1].backward()
    finally:
        run.model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- writing starts

def start_writing(run: Run) -> None:
    """Every check has passed: lock and create the out dir (rank 0 alone writes), say what runs.
    If any of it fails (e.g. wandb missing or failing to start), the out dir is left as it was found."""
    try:
        run.world.on_main(lambda: open_out_dir(run))
        say_what_runs(run)
    except BaseException:
        run.metrics.close()
        run.out.forget()
        raise


def open_out_dir(run: Run) -> None:
    run.out.open()
    if run.relink_best:
        repair_best(run.out.resume_from)
    run.out.write("config.toml", describe(run.cfg))
    run.metrics = Metrics(run.cfg, run.out, run.step if run.out.resume_from else None)


def say_what_runs(run: Run) -> None:
    """The config, then one line: size, device, dtype, step kind, processes, tokens per step, data."""
    world, t = run.world, run.cfg.train
    run.print(describe(run.cfg), end="")
    procs = f" x {world.size} processes ({world.kind})" if world.size > 1 else ""
    how = ("CUDA graph" if run.train_step.kind == "graph" else "eager") + (", compiled" if t.compile else "")
    run.print(f"# {run.model.num_params() / 1e6:.2f}M parameters | {world.device}, {dtype_name(run.dtype)}, {how}"
              f"{procs} | {run.tokens_per_step:,} tokens/step | data {run.dataset}")
    run.print(f"# memory: {run.memory}")
    if t.fsdp and world.size == 1:
        run.print("# train.fsdp: a single process has nothing to shard it with (start several with torchrun)")
    resumed = run.out.resume_from
    run.print(f"# resuming {resumed} at step {run.step}" if resumed else f"# out dir {run.out.path}")
    if resumed and run.out.stored is not None:
        changes, inexact = changes_since(run.out.stored, run.cfg)
        for change in changes:
            run.print(f"# resuming with {change}")
        if inexact:
            Printer(world.is_main)(f"note: {', '.join(c.split(':')[0] for c in changes)} changed since the run began: "
                                   f"it goes on from its last checkpoint, but not as it would have gone on "
                                   f"uninterrupted", file=sys.stderr)


# ---------------------------------------------------------------- evaluate and save

def evaluate(run: Run) -> dict:
    """Mean loss over the same eval_iters batches of each split every time (a fixed generator), or
    with eval_iters = 0 over every token of each split; with several ranks each evaluates its share
    and the means are averaged."""
    losses, iters = {}, run.cfg.train.eval_iters
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(EVAL_SEED)
        batches = (run.loader.batch(split, generator) for _ in range(iters)) if iters else run.loader.every_window(split)
        losses[split] = run.world.all_reduce_mean(mean_loss(run.wrapped, batches, run.autocast)).item()
    return losses


def evaluate_and_save(run: Run) -> dict:
    """Train and val loss on fixed batches, one metrics record, a checkpoint (best.pt if best)."""
    run.guard.check()   # never checkpoint weights that a non-finite step touched
    ev = evaluate(run)
    is_best = ev["val"] < run.best_val
    run.best_val = min(run.best_val, ev["val"])
    bpb = {s: bits_per_byte(ev[s], run.meta["tokens"][s], run.meta["bytes"][s]) for s in ("train", "val")}
    run.print(f"eval {run.step:6d} | train {ev['train']:.4f} | val {ev['val']:.4f} | val {bpb['val']:.4f} bits/byte"
              f"{' (best)' if is_best else ''}")
    run.metrics.log({"step": run.step, "kind": "eval", "train_loss": ev["train"], "val_loss": ev["val"],
                     "train_bpb": bpb["train"], "val_bpb": bpb["val"], "elapsed_s": run.elapsed()})
    save(run, is_best)
    return ev


def save(run: Run, is_best: bool) -> None:
    model_state, optimizer_state = run.world.full_state(run.model, run.optimizer)   # gathers FSDP shards
    rngs = run.world.gather(rng_state())
    if not run.world.is_main:
        return
    ckpt = new_checkpoint(
        config=run.cfg.to_dict(), tokenizer=run.meta["tokenizer"], model=clean_state_dict(model_state),
        step=run.step, dataset=run.meta, optimizer=optimizer_state,
        scaler=run.scaler.state_dict() if run.scaler.is_enabled() else None, loader=run.loader.state_dict(),
        rng_ranks=rngs, best_val_loss=run.best_val, elapsed=run.elapsed(), tokens=run.tokens,
        skipped_steps=run.guard.skipped, is_best=is_best)
    save_checkpoint(ckpt, run.out.path, keep=run.cfg.train.keep_checkpoints)
    run.out.committed()   # the run has a checkpoint: what it replaced in the out dir can go
    run.guard.saved_step = run.step


# ---------------------------------------------------------------- the loop

def log_progress(run: Run, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, steps: int, seconds: float) -> dict:
    """One log line and metrics record for the last `steps` steps (this reads the loss: a sync)."""
    run.guard.check()
    ms = seconds * 1000 / steps
    record = {"step": run.step, "kind": "train", "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
              "ms_per_step": ms, "tokens_per_s": run.tokens_per_step * 1000 / ms, "skipped_steps": run.guard.skipped}
    eta = duration((run.cfg.train.max_steps - run.step) * ms / 1000)
    run.print(f"step {run.step:6d} | loss {record['loss']:.4f} | lr {lr:.2e} | {ms:7.1f} ms/step | "
              f"{record['tokens_per_s']:,.0f} tok/s | ETA {eta}")
    run.metrics.log(record)
    return record


def run_steps(run: Run, stop: StopRequest, stop_at: int | None, on_step) -> dict:
    """The optimizer steps up to train.max_steps (or stop_at), with their log lines and evaluations,
    until a signal (stop) or the loss of stdout asks the run to stop."""
    t = run.cfg.train
    end = min(t.max_steps, stop_at or t.max_steps)
    schedule = functools.partial(lr_at, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                                 max_steps=t.max_steps, schedule=t.schedule, warmdown_frac=t.warmdown_frac)
    losses, last_eval, stopping = {}, None, False
    run.started = interval_start = time.perf_counter()
    interval_steps = 0
    try:
        if stop.signal:   # before the first step: nothing of this run is worth a checkpoint
            raise Interrupted(signal.Signals[stop.signal], f"stopped by {stop.signal} before its first step")
        while run.step < end:
            lr = schedule(run.step)
            set_lr(run.optimizer, lr / t.lr if t.lr > 0 else 0.0)
            loss, grad_norm, applied = run.train_step()
            run.step += 1
            run.tokens += run.tokens_per_step
            interval_steps += 1
            if not applied:
                run.print(f"step {run.step:6d} | non-finite {run.guard.last}: update skipped "
                          f"({run.guard.skipped} so far)")
            if on_step is not None and on_step(run.step, run.model):
                end = run.step   # asked to end here: the last step, as stop_at's would be
            stopping = run.world.agree_to_stop(stop.signal is not None or run.print.lost)   # all ranks alike
            logged = run.step % t.log_interval == 0 or run.step == t.max_steps
            if logged:
                losses[run.step] = log_progress(run, loss, grad_norm, lr, interval_steps,
                                                time.perf_counter() - interval_start)["loss"]
            if run.step % t.eval_interval == 0 or run.step == end or stopping:   # end: max_steps, stop_at or on_step's
                last_eval = evaluate_and_save(run)
                logged = True
            if logged:
                interval_start, interval_steps = time.perf_counter(), 0   # evaluations are not billed to steps
            if stopping:
                say_stopped(run, stop.signal or ("the loss of stdout (the end of a pipe's reader?)" if run.print.lost
                                                 else "a signal to another rank"))
                break
    except BaseException as e:
        if run.guard.saved_step is None:   # a run that never got to a checkpoint leaves the out dir as it found it
            run.metrics.close()
            run.out.forget()
        if not is_out_of_memory(e):
            raise
        raise out_of_memory(run, e) from None
    finally:
        run.metrics.close()
        run.out.close()
    return finish(run, losses, last_eval, stopping, exit_code(stop.signal, run.print.lost, stopping))


def say_stopped(run: Run, why: str) -> None:
    """How a stopped run ends: where its checkpoint is and how to continue (on stderr too when stdout is gone)."""
    text = (f"stopped by {why} at step {run.step}, checkpoint saved in {run.out.path}; to continue, run the same "
            f"command with --resume")
    run.print(text)
    if run.print.lost:
        Printer()(text, file=sys.stderr)


def exit_code(signal_name: str | None, output_lost: bool, stopped: bool) -> int:
    """The shell's code of how the run ended: 128 + the signal that stopped it, 141 (128 + SIGPIPE) when
    it stopped because its stdout went away, 130 when another rank's signal stopped it, else 0."""
    if signal_name:
        return 128 + signal.Signals[signal_name]
    return 141 if output_lost else 130 if stopped else 0


def out_of_memory(run: Run, error: BaseException) -> RunError:
    """An allocation failure in the loop, in one line: what to make smaller, and what is kept."""
    kept = f"and --resume to continue from the last checkpoint in {run.out.path}" if run.guard.saved_step \
        else "no checkpoint had been written yet"
    return RunError(f"out of memory on {run.world.device} at step {run.step + 1} ({first_line(error, 80)}): try a "
                    f"smaller --train.batch_size (with a larger --train.grad_accum to keep the tokens per step; "
                    f"{kept}) or a smaller --model.block_size")


def finish(run: Run, losses: dict, last_eval: dict | None, stopping: bool, exit_code: int) -> dict:
    """Say how a run that reached max_steps went; return train()'s summary."""
    total = run.elapsed()
    if run.step >= run.cfg.train.max_steps:
        skipped = f", {run.guard.skipped} non-finite steps skipped" if run.guard.skipped else ""
        run.print(f"# done: step {run.step}, best val loss {run.best_val:.4f}, {duration(total)} "
                  f"({total:.1f} s), {run.tokens:,} tokens{skipped}")
    return {"step": run.step, "val_loss": last_eval["val"] if last_eval else None, "best_val_loss": run.best_val,
            "elapsed_s": total, "losses": losses, "skipped_steps": run.guard.skipped,
            "interrupted": stopping, "exit_code": exit_code}
