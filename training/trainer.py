"""Training a GPT: train(cfg) checks everything before the run's first write, then loops:
train_step (on one CUDA GPU, a CUDA graph), logs, evaluations, checkpoints and samples.

  exact resume  weights, optimizer, schedule, data order and generators go on where the
                checkpoint left them (on a CPU: with as many threads)
  non-finite    a non-finite loss or gradient norm stops the run; no checkpoint follows it
  signals       SIGINT or SIGTERM: the step finishes (under torchrun: the steps to the next
                log line), a checkpoint is saved, the run exits 128 + the signal
"""
import json
import math
import os
import signal
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from common import (UserError, atomic_write, command, cpu_clock, duration, first_line, printer,
                    stop_after_step, typed)
from data.loader import BatchLoader, Share
from data.cache import find_sources, prepare
from data.tokenizers import load_tokenizer
from loading import read_checkpoint
from model.device import autocast, dtype_name, fit_threads, pick_device, pick_dtype
from model.gpt import GPT, bits_per_byte, score
from model.sampling import Choice, generate, prompt_ids
from training.checkpoint import (Progress, Saver, check_out_dir, check_resumable,
                                 check_same_text, link_best, open_out_dir, restore, run_config,
                                 training_state)
from training.config import Config, build_config, describe, flat, fmt
from training.optim import build_optimizer, lr_at, set_lr

# evaluations and samples draw the same every time, whatever train.seed
EVAL_SEED = 4242
SAMPLE_SEED = 1337
# a little below 1: the likelier tokens, without greedy decoding's loops
SAMPLE_TEMPERATURE = 0.8


@dataclass
class Place:
    """Where the run computes; under torchrun its ranks and training/distributed.py."""
    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    dist: object = None

    @property
    def ddp(self) -> bool:
        return self.world > 1


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def place(t) -> Place:
    """The device and dtype t asks for; under torchrun, joined to the other processes."""
    device = pick_device(t.device)
    if not launched():
        return Place(device, pick_dtype(device, t.dtype))
    from training import distributed
    device, *ranks = distributed.join(device)
    return Place(device, pick_dtype(device, t.dtype), *ranks, distributed)


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          checkpoint=None, again="the same command with --resume") -> dict:
    """Run, or resume (from `checkpoint` or the out dir's latest), the training cfg describes;
    `again` is the command that resumes it. Returns a summary and the exit code."""
    t, out = cfg.train, Path(cfg.out_dir)
    at = place(t)
    say = printer(at.rank == 0 and not quiet)

    # ---- every check before the first write (a mistyped --data is no out dir of other data)
    find_sources(cfg.data.path)
    stored = run_config(out)
    resume_from = check_out_dir(out, stored, cfg.data, resume, overwrite, checkpoint, again)
    ckpt = read_checkpoint(resume_from) if resume_from else None
    if ckpt is not None:
        check_resumable(ckpt, resume_from, cfg)
        if ckpt["step"] >= t.max_steps:
            return finished(cfg, ckpt, say, at)
    loader = data_loader(cfg, at)
    if ckpt is not None:
        check_same_text(ckpt, resume_from, cfg, loader.meta, say)
    tokenizer = fit_to_data(cfg, loader.meta)

    # ---- the model, the optimizer, the step
    model = build_model(cfg, at, resumed=ckpt is not None)
    # DDP and FSDP wrap the model before the optimizer is built over its parameters
    wrapped = at.dist.wrap(model, at.device, t.fsdp, t.seed) if at.ddp else model
    optimizer = build_optimizer(model, t, at.device)
    scaler = torch.amp.GradScaler(at.device.type, enabled=at.dtype == torch.float16)
    run = restore(ckpt, resume_from, model, optimizer, scaler, loader, at) if ckpt else Progress()
    best = resume_from if ckpt is not None and ckpt["is_best"] else None
    was = ckpt and earlier_batch(ckpt)
    # copied into the model and optimizer: let it go
    del ckpt
    run_step, how = build_step(wrapped, optimizer, scaler, loader, at, t, say)

    # ---- the run's first write
    metrics = Metrics(cfg if at.rank == 0 else None, run.step if resume_from else None)
    if at.rank == 0:
        aside = open_out_dir(out, overwrite, metrics.open)
        if best is not None:
            link_best(best)
        atomic_write(out / "config.toml", describe(cfg))
        what = f"resuming {resume_from} at step {run.step}" if resume_from else "a new run"
        kept = f"; the earlier run is kept in {aside}" if aside else ""
        say(f"# {out}: {what} (every setting: {out / 'config.toml'}){kept}")
        for line in banner(cfg, stored if resume_from else {}, was, at, model, loader, how):
            say(line)

    # ---- the loop
    tokens_per_step = t.global_batch(at.world) * cfg.model.block_size
    # the last checkpoint's step
    saved = run.step if resume_from else None
    clock = Clock(run)
    # the cores other processes keep busy, read again at each log line
    cpu = cpu_clock()
    saver = Saver(out if at.rank == 0 else None, t.keep_checkpoints)
    with stop_after_step(at.local_rank == 0) as stop, closing(metrics), saver:
        while run.step < t.max_steps:
            lr = lr_at(run.step, t)
            set_lr(optimizer, lr)
            loss, grad_norm = run_step()
            run.step += 1
            run.tokens += tokens_per_step
            step = run.step
            logged = step % t.log_interval == 0 or step == t.max_steps
            evaluated = step % t.eval_interval == 0 or step == t.max_steps
            sampled = t.sample_every and (step % t.sample_every == 0 or step == t.max_steps)
            # the signal that asked for a stop (0: none; the last step ends the run anyway)
            asked = stop[0] if stop and step < t.max_steps else 0
            stopping = asked if not at.ddp else logged and at.dist.agreed_stop(asked, at.device)
            # a sample of weights that a non-finite step touched would say nothing
            if logged or stopping or sampled:
                # the loss of the whole global batch, the same on every rank
                loss = at.dist.mean(loss) if at.ddp else loss
                # .item() waits for the device: the timing is true
                loss_value, norm = loss.item(), grad_norm.item()
                # fp16's scaler skips an inf gradient itself
                norms = {} if scaler.is_enabled() else {"gradient norm": norm}
                check_finite({"loss": loss_value} | norms, clock.since, step, saved)
                ms = clock.interval()
                rate = tokens_per_step * 1000 / ms
                say(f"step {step:6d} | loss {loss_value:.4f} | lr {t.lr * lr:.2e} | "
                    f"{ms:7.1f} ms/step | {rate:,.0f} tok/s | ETA {clock.left(t.max_steps)}")
                metrics.log({"step": step, "kind": "train", "loss": loss_value, "lr": t.lr * lr,
                             "grad_norm": norm, "ms_per_step": ms, "tokens_per_s": rate})
                if at.device.type == "cpu":
                    cpu, change = fit_threads(cpu)
                    change and say(change)
            if evaluated or stopping:
                run.elapsed = clock.elapsed()
                run.is_best = False
                # a stop alone saves at once: an evaluation can take a minute
                if evaluated:
                    losses = evaluate(wrapped, loader, t.eval_iters, at)
                    check_finite({f"{s} loss": v for s, v in losses.items()}, clock.since, step,
                                 saved)
                    log_eval(say, metrics, loader.meta, run, losses)
                state = training_state(cfg, model, optimizer, scaler, loader, at)
                saver.save(state | asdict(run))
                cfg.log.curves and saver.then(draw_curves, out, step)
                saved = step
                clock.pause()
            if sampled and at.rank == 0:
                text = sample(model, tokenizer, t, at)
                say(f"sample {step:4d} | " + text.replace("\n", "\n" + " " * 14))
                metrics.log({"step": step, "kind": "sample", "text": text})
                clock.pause()
            if stopping:
                break
        # the last checkpoint is on disk before the run says it is done
        saver.wait()
    run.elapsed = clock.elapsed()
    # the signal that stopped the run (under torchrun maybe another process's)
    signum = stopping if run.step < t.max_steps else (stop or [0])[0]
    say(last_line(run, t, signum, out, again))
    if at.ddp:
        at.dist.leave()
    code = 128 + signum if signum else 0
    return {"step": run.step, "best_val_loss": run.best_val_loss, "elapsed_s": run.elapsed,
            "how": how, "intervals": clock.intervals, "exit_code": code}


def data_loader(cfg: Config, at: Place) -> BatchLoader:
    """The run's batches; under torchrun each machine's first process prepares them."""
    t, block_size = cfg.train, cfg.model.block_size
    make = partial(prepare, cfg.data, block_size)
    dataset = at.dist.leader_first(make, at.local_rank == 0) if at.ddp else make()
    return BatchLoader(dataset, block_size, t.batch_size, seed=t.seed, device=at.device,
                       share=Share(t.grad_accum, at.rank, at.world))


def build_model(cfg: Config, at: Place, resumed: bool) -> GPT:
    """The model with train.seed's initial weights (every rank's), or train.init_from's."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(at.device)
    if cfg.train.init_from and not resumed:
        from hf.hub import load_init_weights
        load_init_weights(model, cfg.train.init_from)
    return model


class Clock:
    """ms/step over each log interval (evaluations, saves and samples pause it), and seconds.
    since: the interval's first step, the last whose loss was checked."""

    def __init__(self, run: Progress):
        self.run, self.first_step, self.before = run, run.step, run.elapsed
        self.start = time.perf_counter()
        # each log interval's (steps, ms/step)
        self.intervals = []
        self.pause()

    def interval(self) -> float:
        steps = self.run.step - self.since
        ms = (time.perf_counter() - self.interval_start) * 1000 / steps
        self.intervals.append((steps, ms))
        self.pause()
        return ms

    def pause(self) -> None:
        self.interval_start, self.since = time.perf_counter(), self.run.step

    def left(self, max_steps: int) -> str:
        pace = (time.perf_counter() - self.start) / (self.run.step - self.first_step)
        return duration(pace * (max_steps - self.run.step))

    def elapsed(self) -> float:
        return self.before + time.perf_counter() - self.start


def last_line(run: Progress, t, signum: int, out: Path, again: str) -> str:
    if run.step < t.max_steps:
        name = signal.Signals(signum).name
        return (f"stopped by {name} at step {run.step}: checkpoint saved in {out}; "
                f"{again} continues it")
    return (f"# done: step {run.step}, best val loss {run.best_val_loss:.4f}, "
            f"{duration(run.elapsed)} ({run.elapsed:.1f} s), {run.tokens:,} tokens; "
            f"to sample it: {command('sample.py', typed(out))}")


def finished(cfg: Config, ckpt: dict, say, at: Place) -> dict:
    """A run resumed at or past its train.max_steps: nothing trains, nothing is written."""
    t = cfg.train
    say(f"# {cfg.out_dir}: the run is at step {ckpt['step']}, train.max_steps = {t.max_steps}: "
        f"nothing to train, nothing changed (a larger --train.max_steps continues it)")
    # the config handed back is the run's (a sweep sizes the model from it)
    cfg.model.vocab_size = ckpt["config"]["model"]["vocab_size"]
    if at.ddp:
        at.dist.leave()
    return {"step": ckpt["step"], "best_val_loss": ckpt["best_val_loss"],
            "elapsed_s": ckpt["elapsed"], "how": "", "intervals": [], "exit_code": 0}


def fit_to_data(cfg: Config, meta: dict):
    """The data's tokenizer; model.vocab_size = 0 becomes its vocabulary's size."""
    cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
    if cfg.model.vocab_size < meta["vocab_size"]:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size} is below the tokenizer's "
                        f"{meta['vocab_size']}")
    tokenizer = load_tokenizer(meta["tokenizer"])
    try:
        tokenizer.encode(cfg.train.sample_prompt)
    except UserError as e:
        raise UserError(f"train.sample_prompt has {e}") from None
    return tokenizer


def earlier_batch(ckpt: dict) -> tuple[int, int]:
    """A checkpoint's global batch (sequences per step) and processes."""
    procs = len(ckpt["rng_ranks"])
    t = ckpt["config"]["train"]
    return t["batch_size"] * t["grad_accum"] * procs, procs


# --- the step

def train_step(wrapped, optimizer, scaler, low_precision, grad_clip: float, ddp,
               windows: torch.Tensor):
    """One optimizer step on windows (grad_accum, B, T + 1) -> (this rank's mean loss, gradient
    norm), on the device. wrapped: the model as called; ddp: the DDP or FSDP module, or None."""
    accum = windows.size(0)
    loss_sum = torch.zeros((), device=windows.device)
    # one autocast region: each weight is cast once per step
    with low_precision:
        for micro in range(accum):
            x, y = windows[micro, :, :-1], windows[micro, :, 1:]
            # only the last micro-step averages the gradients over the ranks
            if ddp is not None:
                sync_gradients(ddp, micro == accum - 1)
            _, loss = wrapped(x, y)
            loss_sum += loss.detach()
            scaler.scale(loss / accum).backward()
    scaler.unscale_(optimizer)
    clip = grad_clip if grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
    # FSDP's norm is a sharded tensor
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum, grad_norm


def sync_gradients(module: torch.nn.Module, sync: bool) -> None:
    # FSDP's setter; DDP has none, only its attribute
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(sync)
    else:
        module.require_backward_grad_sync = sync


def build_step(wrapped, optimizer, scaler, loader, at: Place, t, say):
    """(train_step on the next windows, compiled and a CUDA graph where it can be; how it
    runs, in words)."""
    # DDP's (or FSDP's) module before compiling: where gradient syncs are set
    how, ddp = "eager", wrapped if at.ddp else None
    if t.compile:
        say("# compiling the model: about a minute (train.compile = false skips it)")
        from speed.compile import compiled_or_eager
        trial = partial(compile_trial, loader=loader, at=at)
        compiled = compiled_or_eager(wrapped, trial, "training")
        wrapped, how = compiled, "eager, compiled" if compiled is not wrapped else how
    low_precision = autocast(at.device, at.dtype)
    step = partial(train_step, wrapped, optimizer, scaler, low_precision, t.grad_clip, ddp)

    def eager():
        return step(loader.step_windows())

    if not t.cuda_graph or (blocker := graph_blocker(at)):
        if t.cuda_graph and at.device.type == "cuda":
            say(f"# no CUDA graph: {blocker}")
        return eager, how
    from speed.cuda_graph import graph_step
    # the graph reads a buffer, refilled before each replay (on a CPU: not recorded, for tests)
    shape = (t.grad_accum, t.batch_size, loader.block_size + 1)
    buffer = torch.zeros(shape, dtype=torch.long, device=at.device)
    try:
        replay = graph_step(lambda: step(buffer), optimizer, capture=at.device.type == "cuda")
    except Exception as e:
        say(f"warning: the CUDA graph step failed, training eagerly ({type(e).__name__}: "
            f"{first_line(e)})")
        return eager, how

    def refill_and_replay():
        buffer.copy_(loader.step_windows(), non_blocking=True)
        return replay()
    return refill_and_replay, how.replace("eager", "CUDA graph")


def graph_blocker(at: Place) -> str | None:
    """Why the step cannot be a CUDA graph here (None: it can)."""
    if at.device.type != "cuda":
        return f"graphs are CUDA's (device {at.device.type})"
    if at.ddp:
        return "several processes synchronize their gradients from the host"
    if at.dtype == torch.float16:
        return "fp16's loss scaling decides on the host"
    return None


def compile_trial(compiled, loader, at: Place) -> None:
    """A forward and backward on a batch shaped as the step's (other strides compile again),
    leaving no gradients and the generators untouched."""
    w = torch.zeros(loader.batch_size, loader.block_size + 1, dtype=torch.long, device=at.device)
    devices = [at.device] if at.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), autocast(at.device, at.dtype):
        compiled(w[:, :-1], w[:, 1:])[1].backward()
    compiled.zero_grad(set_to_none=True)


def check_finite(values: dict, since: int, step: int, saved: int | None) -> None:
    for name, value in values.items():
        if not math.isfinite(value):
            kept = (f"the checkpoint of step {saved} is kept" if saved is not None
                    else "no checkpoint was written")
            raise UserError(f"the {name} became {value} between steps {since} and {step}; "
                            f"stopped, {kept} (try a lower --train.lr)")


# --- evaluations and samples

def evaluate(wrapped, loader: BatchLoader, iters: int, at: Place) -> dict:
    """Each split's mean loss: over loader.eval_windows (iters = 0: on every rank, as FSDP
    needs), else over the same `iters` random batches."""
    losses = {}
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(EVAL_SEED)
        batches = loader.eval_windows(split) if not iters else \
            (loader.batch(split, generator) for _ in range(iters))
        nats, count = score(wrapped, batches, autocast(at.device, at.dtype))
        if at.ddp and iters:
            both = torch.tensor([nats, count], dtype=torch.float64, device=at.device)
            nats, count = at.dist.mean(both).tolist()
        losses[split] = nats / count
    return losses


def log_eval(say, metrics, meta, run: Progress, losses: dict) -> None:
    """An evaluation's line and record (bits per byte: comparable across tokenizers)."""
    run.is_best = losses["val"] < run.best_val_loss
    run.best_val_loss = min(run.best_val_loss, losses["val"])
    bpb = {s: bits_per_byte(losses[s], meta["tokens"][s], meta["bytes"][s]) for s in losses}
    say(f"eval {run.step:6d} | train {losses['train']:.4f} | val {losses['val']:.4f} | "
        f"val {bpb['val']:.4f} bits/byte{' (best)' if run.is_best else ''}")
    metrics.log({"step": run.step, "kind": "eval", "train_loss": losses["train"],
                 "val_loss": losses["val"], "train_bpb": bpb["train"], "val_bpb": bpb["val"],
                 "elapsed_s": run.elapsed, "time": time.time()})


def draw_curves(out: Path, step: int) -> None:
    """curves.png: the run's losses so far."""
    from viz.curves import draw, read_records, run_panels
    records = read_records(out / "metrics.jsonl", warn=False)
    atomic_write(out / "curves.png", draw(run_panels(records), f"{out.name}: step {step}"))


def sample(model: GPT, tokenizer, t, at: Place) -> str:
    """The same prompt and draws every time, on a generator of its own: samples compare."""
    ids = prompt_ids(tokenizer, t.sample_prompt, model.cfg.block_size, "sampling")
    generator = torch.Generator(device=at.device).manual_seed(SAMPLE_SEED)
    model.eval()
    with autocast(at.device, at.dtype):
        prompt = torch.tensor([ids], device=at.device)
        columns = generate(model, prompt, t.sample_tokens, Choice(SAMPLE_TEMPERATURE),
                           generator, vocab_limit=tokenizer.vocab_size)
        new = torch.cat(list(columns), dim=1)[0].tolist()
    model.train()
    return t.sample_prompt + tokenizer.decode_bytes(new).decode("utf-8", errors="replace")


# --- what a run says and records

class Metrics:
    """metrics.jsonl and wandb (cfg None: nothing). Resumed at resume_step, later records go:
    the resumed run logs them again."""

    def __init__(self, cfg: Config | None, resume_step: int | None):
        self.cfg, self.resume_step, self.wandb = cfg, resume_step, None
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if cfg else None

    def open(self) -> None:
        log, folder = self.cfg.log, self.path.parent
        try:
            if log.wandb:
                import wandb
                self.wandb = wandb.init(project=log.wandb_project, group=log.wandb_group or None,
                                        name=log.wandb_run_name or folder.name,
                                        config=self.cfg.to_dict(), dir=str(folder), resume="allow")
        # not installed, no login, no network: wandb's own errors
        except Exception as e:
            raise UserError(f"log.wandb = true but wandb did not start ({type(e).__name__}: "
                            f"{first_line(e, 80)}); pip install wandb, run `wandb login` or set "
                            f"WANDB_MODE=offline") from None
        kept = []
        if self.resume_step is not None:
            from viz.curves import read_records
            kept = [r for r in read_records(self.path) if r["step"] <= self.resume_step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict) -> None:
        if self.path is None:
            return
        # a line cut by a kill is skipped on reading
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind")},
                           step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def banner(cfg, stored: dict, was, at: Place, model, loader, how: str):
    """The run's opening lines; stored: a resumed run's settings, from its config.toml."""
    t, now, defaults = cfg.train, flat(cfg.to_dict()), flat(build_config().to_dict())
    differ = [f"{k} = {fmt(v)}" for k, v in now.items()
              if v != defaults[k] and k not in ("out_dir", "model.vocab_size")]
    yield "# not the defaults: " + ("; ".join(differ) if differ else "none")
    for key in [k for k in now if k in stored and stored[k] != now[k]]:
        yield f"# resuming with {key}: {fmt(stored[key])} -> {fmt(now[key])}"
    if was and was[0] != t.global_batch(at.world):
        yield resized(was, t, at.world, cfg.model.block_size)
    if t.warmup_steps >= t.max_steps:
        yield (f"# note: train.warmup_steps = {t.warmup_steps} is not below train.max_steps = "
               f"{t.max_steps}: the learning rate never reaches its peak nor decays (e.g. "
               f"--train.warmup_steps={max(1, t.max_steps // 10)})")
    procs = f" x {at.world} processes ({'FSDP' if t.fsdp else 'DDP'})" if at.ddp else ""
    threads = torch.get_num_threads()
    where = f"cpu x {threads} thread{'s' * (threads > 1)}" if at.device.type == "cpu" else at.device
    tokens = t.global_batch(at.world) * cfg.model.block_size
    data = f"{loader.dataset_dir} ({'on the device' if loader.resident else 'memory-mapped'})"
    yield (f"# {model.num_params() / 1e6:.2f}M parameters, vocab {cfg.model.vocab_size:,} | "
           f"{where}, {dtype_name(at.dtype)}, {how}{procs} | {tokens:,} tokens/step | data {data}")


def resized(was: tuple[int, int], t, world: int, block_size: int) -> str:
    """A run resumed at another global batch: the setting that keeps it."""
    (seqs, procs), now = was, t.global_batch(world)
    if seqs % (t.batch_size * world) == 0:
        keep = f"--train.grad_accum={seqs // (t.batch_size * world)}"
    elif seqs % (t.grad_accum * world) == 0:
        keep = f"--train.batch_size={seqs // (t.grad_accum * world)}"
    else:
        keep = "no whole --train.grad_accum or --train.batch_size"
    processes = f" ({procs} processes -> {world})" if procs != world else ""
    tokens = f"{seqs * block_size:,} -> {now * block_size:,}{processes}"
    return f"# resuming with tokens/step: {tokens}: {keep} keeps it"
