"""A training run: what it holds between steps (Run), and how it is built before the first step:

    set_up            check the out dir, the checkpoint to resume and the data; build the data loader,
                      the model and the optimizer. Nothing is written until every check has passed.
    restore           continue a checkpoint: weights, optimizer, data order, random generators.
    build_step        how one optimizer step runs: eager (training/step.py), maybe compiled, or
                      replayed as a CUDA graph (speed/).
    start_writing     lock and create the out dir, write config.toml, open metrics.jsonl, print the banner.
training/trainer.py runs it.
"""
import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from common import CheckpointError, ConfigError, Printer, RunError, TokenizerError, first_line
from data.cache import load_meta
from data.loader import BatchLoader
from data.prepare import prepare
from data.tokenizers import load_tokenizer
from model.gpt import GPT
from training.checkpoint import check_resumable, check_same_run, clean_state_dict, load_checkpoint
from training.config import Config, changes_from_defaults, changes_since, describe
from training.optim import build_optimizer
from training.outdir import Metrics, NoMetrics, OutDir
from training.runtime import (World, autocast, dtype_name, free_memory, pick_dtype, seed_everything, set_rng_state,
                              step_memory, use_fast_matmuls)
from training.step import NonFiniteGuard, Step, graph_blockers

STARTED = time.perf_counter()   # about when this process started (for its share of the load average)


@dataclass
class Run:
    """A training run between steps."""
    cfg: Config
    world: World                    # this process among the run's processes; world.device computes
    print: Printer                  # prints on the main process unless quiet; .lost once stdout is gone
    dtype: torch.dtype              # the number format of the matmuls (under autocast)
    loader: BatchLoader             # the prepared dataset (loader.meta: its meta.json) and its data order
    model: GPT                      # what is saved; its parameters are the optimizer's
    wrapped: torch.nn.Module        # what the step and evaluation call: model, DDP or FSDP, maybe compiled
    optimizer: object
    scaler: torch.amp.GradScaler    # fp16 loss scaling (disabled in bf16 and fp32)
    guard: NonFiniteGuard
    out: OutDir
    memory: str                     # the step's estimated memory, for the banner
    tokenizer: object               # the dataset's (samples while training encode and decode with it)
    train_step: object = None       # the next optimizer step (training/step.py, speed/cuda_graph.py)
    compiled: bool = False          # wrapped is torch.compile'd (train.compile, where compiling worked)
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

    def abandon(self) -> None:   # a run with no checkpoint yet: the out dir goes back to how it was found
        self.metrics.close()
        self.out.forget()


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
    # read whole, not mapped: the optimizer keeps the very tensors it is given (where device and dtype
    # match), and the run replaces best.pt and deletes old checkpoints, which Windows refuses for a mapped file
    ckpt = load_checkpoint(resume_from, mmap=False) if resume_from else None
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
    tokenizer = load_tokenizer(meta["tokenizer"])
    if t.sample_prompt:
        try:   # a character the text never had is refused now, not at the first sample
            tokenizer.encode(t.sample_prompt)
        except TokenizerError as e:
            raise ConfigError(f"train.sample_prompt has {e}") from None
    run = Run(cfg, world, Printer(world.is_main and not quiet), dtype, loader, model, wrapped, optimizer, scaler,
              guard, out, memory, tokenizer)
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
    run.out.resumes_best = ckpt["is_best"]
    was, now = ckpt["dataset"].get("sha256"), run.loader.meta.get("sha256")
    if was and now and was != now:
        run.print(f"warning: the training text changed since this checkpoint (sha256 {was[:12]}... then, "
                  f"{now[:12]}... now); training goes on with the new text")


# ---------------------------------------------------------------- the step

def build_step(run: Run) -> None:
    """torch.compile the model (train.compile), then the step: eager, or recorded as a CUDA graph where
    one can hold it (train.cuda_graph). After restore: a graph holds the addresses of the restored state."""
    t = run.cfg.train
    if t.compile and run.world.device.type == "mps":   # not tried where nothing is tested: said, not attempted
        note(run, "note: train.compile is not tried on MPS: training eagerly")
    elif t.compile:
        from speed.compile import compiled_or_eager   # the optional speed room
        eager = run.wrapped
        run.wrapped = compiled_or_eager(run.wrapped, functools.partial(compile_trial, run), "training")
        run.compiled = run.wrapped is not eager
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
    """One forward and backward of the compiled model on a batch laid out as the step's (inputs and
    targets are views of one (B, T + 1) batch: other strides would make the step compile again),
    leaving no trace: no gradients, the random generators as they were."""
    device, t = run.world.device, run.cfg.train
    w = torch.randint(0, run.cfg.model.vocab_size, (t.batch_size, run.cfg.model.block_size + 1), device=device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), run.autocast:
            compiled(w[:, :-1], w[:, 1:])[1].backward()
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
        run.abandon()
        raise


def open_out_dir(run: Run) -> None:
    run.out.open()
    run.out.write("config.toml", describe(run.cfg))
    run.metrics = Metrics(run.cfg, run.out, run.step if run.out.resume_from else None)


def say_what_runs(run: Run) -> None:
    """Where the run goes, its settings that are not the defaults, then one line: size, device, dtype,
    step kind, processes, tokens per step, data; and the memory a step needs."""
    world, t = run.world, run.cfg.train
    resumed = run.out.resume_from
    run.print(f"# {run.out.path}: " + (f"resuming {resumed} at step {run.step}" if resumed else "a new run")
              + f" (every setting: {run.out.path / 'config.toml'})")
    changes = changes_from_defaults(run.cfg)
    run.print("# not the defaults: " + ("; ".join(changes) if changes else "none"))
    procs = f" x {world.size} processes ({world.kind})" if world.size > 1 else ""
    how = ("CUDA graph" if run.train_step.kind == "graph" else "eager") + (", compiled" if run.compiled else "")
    run.print(f"# {run.model.num_params() / 1e6:.2f}M parameters, vocab {run.cfg.model.vocab_size:,} | {world.device}, "
              f"{dtype_name(run.dtype)}, {how}{procs} | {run.tokens_per_step:,} tokens/step | "
              f"data {run.loader.dataset_dir}")
    run.print(f"# memory: {run.memory}")
    if t.fsdp and world.size == 1:
        run.print("# train.fsdp: a single process has nothing to shard it with (start several with torchrun)")
    warn_if_busy(run)
    if resumed and run.out.stored is not None:
        changes, inexact = changes_since(run.out.stored, run.cfg)
        for change in changes:
            run.print(f"# resuming with {change}")
        if inexact:
            note(run, f"note: {', '.join(c.split(':')[0] for c in changes)} changed since the run began: it goes on "
                      f"from its last checkpoint, but not as it would have gone on uninterrupted")


def warn_if_busy(run: Run) -> None:
    """On CPU, threads that wait for each other at every step need the cores to themselves: when other
    work already uses them (the load average, less this process's own share), say what to do."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if run.world.device.type != "cpu" or threads < 2 or not hasattr(os, "getloadavg"):
        return
    own = sum(os.times()[:2]) / max(1e-9, time.perf_counter() - STARTED)   # this process's cores, on average
    others = os.getloadavg()[0] - min(own, threads)
    if others >= 1 and others + threads > cores:
        note(run, f"note: other work keeps the CPU busy (load {others:.1f} besides this run, {cores} cores) and "
                  f"this run's {threads} threads wait for each other at every step, which can make it many times "
                  f"slower: OMP_NUM_THREADS=1 lets it share the cores")


def note(run: Run, text: str) -> None:
    """A line on stderr from the main process of a run that is not quiet."""
    Printer(run.print.enabled)(text, file=sys.stderr)
