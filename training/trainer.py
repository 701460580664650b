"""Training a GPT, top to bottom: `python train.py` calls train(cfg).

    set-up     the device and the processes; every check before the run's first write (the out dir,
               the checkpoint to resume, the data); the data, the model, the optimizer
    the step   train_step: forward and backward over grad_accum micro-batches, gradient clipping, the
               update; on one CUDA GPU recorded once as a CUDA graph and replayed
    the loop   a log line every log_interval steps; an evaluation and a checkpoint every eval_interval
               steps and at the end; a sample every sample_every steps

Choices:
  exact resume  the weights, the optimizer, the LR schedule, the data order and every random generator
                continue where the checkpoint left them: the later losses are the uninterrupted run's
  non-finite    the loss and gradient norm the loop reads anyway (log lines; the eval losses at
                evaluations): one that is not finite stops the run, naming the steps it came between,
                and no checkpoint is written after it
  true speed    ms/step is timed once a log line has read the loss: the device has finished the steps
  one cast      a step's micro-batches run in one autocast region: each weight is cast to bf16 once a step
  signals       SIGINT or SIGTERM: the step finishes (under torchrun: the steps to the next log line), a
                checkpoint is saved (no extra evaluation), and the run exits 128 + the signal (130,
                143); a second one exits at once
"""
import json
import math
import os
import signal
import threading
import time
from contextlib import closing, contextmanager, suppress
from functools import partial
from pathlib import Path

import torch

from common import (UserError, atomic_write, command, cpu_clock, duration, first_line, silence_stdout,
                    typed)
from data.prepare import load_meta
from data.loader import BatchLoader
from data.prepare import prepare
from data.sources import find_sources
from data.tokenizers import load_tokenizer
from model.gpt import GPT, bits_per_byte, score
from model.device import autocast, fit_threads, pick_device, pick_dtype
from loading import FORMAT, VERSION, read_checkpoint
from training.checkpoint import (Saver, check_out_dir, check_resumable, check_same_text, close_out_dir,
                                 open_out_dir, restore, rng_state)
from training.config import Config, build_config, describe, flat, fmt, load_toml
from training.optim import build_optimizer, lr_at, set_lr

EVAL_SEED = 4242             # evaluation draws the same batches every time, whatever the training seed
SAMPLE_SEED = 1337           # and samples while training the same draws
SAMPLE_TEMPERATURE = 0.8     # a little below 1: the likelier tokens, without greedy decoding's loops


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          checkpoint=None, started: float | None = None, again="the same command with --resume") -> dict:
    """Run (or continue: resume, from `checkpoint` or the out dir's latest) the training cfg describes, in a
    process begun at perf_counter() `started`; the command `again` resumes it. Returns its step, losses,
    seconds, how its step ran, each log interval's ms/step (bench.py's), the exit code (0, 128 + signal)."""
    t, out, laps = cfg.train, Path(cfg.out_dir), [("", started), ("imports", time.perf_counter())]
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device, rank, local_rank, world = pick_device(t.device), 0, 0, 1
    if ddp:
        from training import distributed   # only under torchrun
        device, rank, local_rank, world = distributed.join(device)
    say, dtype = printer(rank == 0 and not quiet), pick_dtype(device, t.dtype)

    # ---- every check before the run's first write: the data's files, the out dir, the checkpoint, the data
    find_sources(cfg.data.path)
    resume_from = check_out_dir(out, cfg.data, resume, overwrite, checkpoint, again)
    ckpt = read_checkpoint(resume_from) if resume_from else None
    if ckpt is not None:
        check_resumable(ckpt, resume_from, cfg)
    if ckpt is not None and ckpt["step"] >= t.max_steps:
        say(f"# {out}: the run is at step {ckpt['step']}, train.max_steps = {t.max_steps}: nothing to "
            f"train, nothing changed (a larger --train.max_steps continues it)")
        cfg.model.vocab_size = ckpt["config"]["model"]["vocab_size"]
        if ddp:
            distributed.leave()
        return {"step": ckpt["step"], "best_val_loss": ckpt["best_val_loss"], "elapsed_s": ckpt["elapsed"],
                "how": "", "intervals": [], "exit_code": 0}
    dataset = distributed.leader_first(lambda: prepare(cfg.data, cfg.model.block_size), local_rank == 0) \
        if ddp else prepare(cfg.data, cfg.model.block_size)
    meta = load_meta(dataset)
    tokenizer = load_tokenizer(meta["tokenizer"])
    if ckpt is not None:
        check_same_text(ckpt, resume_from, cfg, meta, say)
    fit_to_data(cfg, meta, tokenizer)
    laps.append(("data", time.perf_counter()))

    # ---- the data, the model (the same initial weights on every rank), the optimizer
    loader = BatchLoader(dataset, cfg.model.block_size, t.batch_size, seed=t.seed, device=device,
                         grad_accum=t.grad_accum, rank=rank, world=world)
    torch.manual_seed(t.seed)
    model = GPT(cfg.model).to(device)
    if t.init_from and ckpt is None:   # pretrained weights (a resumed run restores its own instead)
        from hf.hub import load_init_weights
        load_init_weights(model, t.init_from)
    wrapped = distributed.wrap(model, device, t.fsdp, t.seed) if ddp else model   # (before the optimizer)
    optimizer = build_optimizer(model, t.optimizer, device, lr=t.lr, betas=(t.beta1, t.beta2),
                                weight_decay=t.weight_decay, muon_lr=t.muon_lr, muon_momentum=t.muon_momentum)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    step, best_val, tokens, seconds_before, was = 0, math.inf, 0, 0.0, None
    if ckpt is not None:
        step, best_val, tokens, seconds_before = restore(ckpt, resume_from, model, optimizer, scaler, loader,
                                                         rank, world, t.seed)
        # the global batch so far (sequences per step), and processes: the banner says a change
        before, procs = ckpt["config"]["train"], len(ckpt["rng_ranks"])
        was = (before["batch_size"] * before["grad_accum"] * procs, procs)
    best, ckpt = resume_from if ckpt is not None and ckpt["is_best"] else None, None   # (copied: let it go)
    laps.append(("model", time.perf_counter()))
    run_step, how = build_step(model, wrapped, optimizer, scaler, loader, device, dtype, t, world, say)
    laps.append(("step", time.perf_counter()))

    # ---- the run's first write
    stored = flat(load_toml(out / "config.toml")) if resume_from and (out / "config.toml").is_file() else {}
    metrics = Metrics(cfg if rank == 0 else None, step if resume_from else None)
    if rank == 0:
        made = not out.exists()
        aside = open_out_dir(out, overwrite, best)
        try:
            metrics.open()
        except UserError:
            # wandb that cannot start: the out dir goes back to what it was
            close_out_dir(out, made, aside)
            raise
        atomic_write(out / "config.toml", describe(cfg))
        banner(say, cfg, resume_from, aside, stored, step, model, device, dtype, how, world, loader,
               laps, was)

    # ---- the loop
    tokens_per_step = t.batch_size * t.grad_accum * world * cfg.model.block_size
    saved, checked, first_step, intervals = step if resume_from else None, step, step, []
    start = interval_start = time.perf_counter()
    timed = 0   # the steps since interval_start (evaluations and samples are not timed as steps)
    # the cores other processes keep busy, read again at each log line
    cpu = cpu_clock()
    saver = Saver(out, t.keep_checkpoints)
    with stop_signals(local_rank == 0) as stop, closing(metrics), saver:
        while step < t.max_steps:
            lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                       schedule=t.schedule, warmdown_frac=t.warmdown_frac)
            set_lr(optimizer, lr / t.lr if t.lr > 0 else 0.0)
            loss, grad_norm = run_step()   # train_step (below) on the next windows, or its CUDA graph
            step, tokens, timed = step + 1, tokens + tokens_per_step, timed + 1
            logged = step % t.log_interval == 0 or step == t.max_steps
            evaluated = step % t.eval_interval == 0 or step == t.max_steps
            sampled = t.sample_every and (step % t.sample_every == 0 or step == t.max_steps)
            # the signal a stop was asked by (0: none; at the last step the run ends as it would)
            asked = stop[0] if stop and step < t.max_steps else 0
            stopping = asked if not ddp else logged and distributed.agreed_stop(asked, device)
            if logged or stopping or sampled:   # (a sample of weights a non-finite step touched says nothing)
                loss_value, norm = loss.item(), grad_norm.item()   # waits for the device: the steps have run
                ms = (time.perf_counter() - interval_start) * 1000 / timed
                check_finite({"loss": loss_value} | ({} if scaler.is_enabled() else {"gradient norm": norm}),
                             checked, step, saved)   # (fp16's scaler skips an inf gradient itself)
                intervals.append((timed, ms))
                checked, pace = step, (time.perf_counter() - start) / (step - first_step)   # evaluations too
                say(f"step {step:6d} | loss {loss_value:.4f} | lr {lr:.2e} | {ms:7.1f} ms/step | "
                    f"{tokens_per_step * 1000 / ms:,.0f} tok/s | ETA {duration(pace * (t.max_steps - step))}")
                metrics.log({"step": step, "kind": "train", "loss": loss_value, "lr": lr, "grad_norm": norm,
                             "ms_per_step": ms, "tokens_per_s": tokens_per_step * 1000 / ms})
                if device.type == "cpu":
                    cpu, change = fit_threads(cpu)
                    change and say(change)
                interval_start, timed = time.perf_counter(), 0
            if evaluated or stopping:
                elapsed, is_best = seconds_before + time.perf_counter() - start, False
                if evaluated:   # (a stop alone saves at once: an evaluation can take a minute)
                    losses = evaluate(wrapped, loader, t.eval_iters, dtype, device, ddp)
                    check_finite({f"{s} loss": v for s, v in losses.items()}, checked, step, saved)
                    is_best, best_val = losses["val"] < best_val, min(best_val, losses["val"])
                    log_eval(say, metrics, meta, step, losses, is_best, elapsed)
                state = training_state(cfg, meta, model, optimizer, scaler, loader, ddp)
                if rank == 0:
                    saver.save(state | dict(step=step, tokens=tokens, elapsed=elapsed, is_best=is_best,
                                            best_val_loss=best_val))
                    cfg.log.curves and saver.then(draw_curves, out, step)
                saved, checked, interval_start, timed = step, step, time.perf_counter(), 0
            if sampled and rank == 0:
                text = sample(model, tokenizer, t, device, dtype)
                say(f"sample {step:4d} | " + text.replace("\n", "\n" + " " * 14))
                metrics.log({"step": step, "kind": "sample", "text": text})
                interval_start, timed = time.perf_counter(), 0
            if stopping:
                break
        # the last checkpoint is on disk before the run says it is done
        saver.wait()
    seconds = seconds_before + time.perf_counter() - start
    # the signal that stopped the run: this process's, or under torchrun another one's
    signum = stopping if step < t.max_steps else (stop or [0])[0]
    if step < t.max_steps:
        say(f"stopped by {signal.Signals(signum).name} at step {step}: checkpoint saved in {out}; "
            f"{again} continues it")
    else:
        say(f"# done: step {step}, best val loss {best_val:.4f}, {duration(seconds)} ({seconds:.1f} s), "
            f"{tokens:,} tokens; to sample it: {command('sample.py', typed(out))}")
    if ddp:
        distributed.leave()
    return {"step": step, "best_val_loss": best_val, "elapsed_s": seconds, "how": how,
            "intervals": intervals, "exit_code": 128 + signum if stop or step < t.max_steps else 0}


# ---------------------------------------------------------------- the step

def fit_to_data(cfg: Config, meta: dict, tokenizer) -> None:
    """The model's vocabulary from the data's (model.vocab_size = 0), and the checks that need the
    data's tokenizer: a sample prompt's character the text never had is refused now, not at a sample."""
    cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
    if cfg.model.vocab_size < meta["vocab_size"]:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size} is below the tokenizer's "
                        f"{meta['vocab_size']}")
    try:
        tokenizer.encode(cfg.train.sample_prompt)
    except UserError as e:
        raise UserError(f"train.sample_prompt has {e}") from None


def train_step(model, wrapped, optimizer, scaler, low_precision, grad_clip: float, ddp_module,
               windows: torch.Tensor):
    """One optimizer step on windows (grad_accum, B, T + 1) on the device -> (mean loss over the global
    batch, gradient norm before clipping), both left on the device: nothing here waits for the host, so
    a CUDA graph can hold it. wrapped is the model as the step calls it (DDP's, compiled)."""
    if ddp_module is not None:
        from training import distributed
    accum = windows.size(0)
    loss_sum = torch.zeros((), device=windows.device)
    with low_precision:   # one region: each weight is cast once per step
        for micro in range(accum):
            x, y = windows[micro, :, :-1], windows[micro, :, 1:]   # (B, T) each: y is x shifted by one
            if ddp_module is not None:   # only the last micro-step averages the gradients over the ranks
                distributed.sync_gradients(ddp_module, micro == accum - 1)
            _, loss = wrapped(x, y)
            loss_sum += loss.detach()
            scaler.scale(loss / accum).backward()
    if ddp_module is not None:   # the loss of the whole global batch, on every rank
        distributed.mean(loss_sum)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm   # (FSDP's)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum / accum, grad_norm


def build_step(model, wrapped, optimizer, scaler, loader, device, dtype, t, world: int, say):
    """(the step as the loop calls it: () -> (loss, grad norm), how it runs in words): train_step on the
    loader's next windows, compiled (train.compile) and as a CUDA graph (train.cuda_graph) where possible,
    which draws the windows itself with the data on the device, else reads a buffer refilled each step."""
    how, ddp_module = "eager", wrapped if world > 1 else None
    if t.compile:
        say("# compiling the model: about a minute (train.compile = false skips it)")
        from speed.compile import compiled_or_eager
        trial = partial(compile_trial, model=model, loader=loader, device=device, dtype=dtype)
        compiled = compiled_or_eager(wrapped, trial, "training")
        wrapped, how = compiled, "eager, compiled" if compiled is not wrapped else how
    step = partial(train_step, model, wrapped, optimizer, scaler, autocast(device, dtype), t.grad_clip,
                   ddp_module)
    eager = lambda: step(loader.step_windows())   # noqa: E731
    if not t.cuda_graph or (blocker := graph_blocker(device, world, dtype)):
        if t.cuda_graph and device.type == "cuda":
            say(f"# no CUDA graph: {blocker}")
        return eager, how
    from speed.cuda_graph import graph_step
    buffer = None if loader.resident else \
        torch.zeros(t.grad_accum, t.batch_size, loader.block_size + 1, dtype=torch.long, device=device)
    try:   # (on the CPU the same step runs without recording: the tests')
        replay = graph_step(eager if buffer is None else lambda: step(buffer), optimizer,
                            capture=device.type == "cuda", generators=[loader.generator] * loader.resident)
    except Exception as e:   # what the recording cannot hold: the eager step does the same work
        say(f"warning: the CUDA graph step failed, training eagerly ({type(e).__name__}: {first_line(e)})")
        return eager, how
    how = how.replace("eager", "CUDA graph")

    def refill_and_replay():
        buffer.copy_(loader.step_windows(), non_blocking=True)
        return replay()
    return (replay if buffer is None else refill_and_replay), how


def graph_blocker(device: torch.device, world: int, dtype: torch.dtype) -> str | None:
    """Why the step cannot be recorded as a CUDA graph here (None: it can)."""
    if device.type != "cuda":
        return f"graphs are CUDA's (device {device.type})"
    if world > 1:
        return "several processes synchronize their gradients from the host"
    if dtype == torch.float16:
        return "fp16's loss scaling decides on the host"
    return None


def compile_trial(compiled, model, loader, device, dtype) -> None:
    """One forward and backward of the compiled model on a batch laid out as the step's (views of one
    (B, T + 1) batch: other strides would compile again), leaving no gradients and the generators as
    they were."""
    w = torch.zeros(loader.batch_size, loader.block_size + 1, dtype=torch.long, device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast(device, dtype):
        compiled(w[:, :-1], w[:, 1:])[1].backward()
    model.zero_grad(set_to_none=True)


@contextmanager
def stop_signals(loud: bool = True):
    """While inside, SIGINT and SIGTERM ask the run to stop: the list it yields gets the signal's number,
    the step in progress finishes and the loop saves a checkpoint; a second signal ends the process at
    once. Said on stderr when loud (under torchrun, which passes a signal to every process of its
    machine: local rank 0 alone). (os.write: a print() here could land inside one it cut short.)"""
    asked = []

    def handler(signum, frame):
        again, name = bool(asked), signal.Signals(signum).name
        asked.append(signum)
        said = "again: exiting now" if again else \
            "finishing this step and saving a checkpoint (again to exit at once)"
        with suppress(OSError):   # (a stderr whose reader is gone must not end the run unsaved)
            loud and os.write(2, f"\n{name}: {said}\n".encode())
        if again:
            os._exit(128 + signum)
    main = threading.current_thread() is threading.main_thread()   # (only it can set handlers)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    for s, h in before.items():
        if h is not signal.SIG_IGN:   # (a signal the shell ignores, as for `cmd &`, stays ignored)
            signal.signal(s, handler)
    try:
        yield asked
    finally:
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def check_finite(values: dict, since: int, step: int, saved: int | None) -> None:
    """Stop the run, naming the steps between which it happened, if a value read is not finite."""
    for name, value in values.items():
        if not math.isfinite(value):
            kept = "no checkpoint was written" if saved is None else f"the checkpoint of step {saved} is kept"
            raise UserError(f"the {name} became {value} between steps {since} and {step}; stopped, {kept} "
                            f"(try a lower --train.lr)")


# ---------------------------------------------------------------- evaluation, checkpoints and samples

def evaluate(wrapped, loader: BatchLoader, iters: int, dtype, device, ddp: bool) -> dict:
    """Mean loss of each split: over loader.eval_windows (iters = 0; every rank all of them, as FSDP's
    gathers need), else over the same `iters` random batches every time (each rank its share)."""
    losses = {}
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(EVAL_SEED)
        batches = loader.eval_windows(split) if not iters else \
            (loader.batch(split, generator) for _ in range(iters))
        nats, count = score(wrapped, batches, autocast(device, dtype))
        if ddp and iters:   # every rank's share
            from training import distributed
            both = torch.tensor([nats, count], dtype=torch.float64, device=device)
            nats, count = distributed.mean(both).tolist()
        losses[split] = nats / count
    return losses


def log_eval(say, metrics, meta, step: int, losses: dict, is_best: bool, elapsed: float) -> None:
    """An evaluation's line, and its record (bits per byte besides: comparable across tokenizers)."""
    bpb = {s: bits_per_byte(losses[s], meta["tokens"][s], meta["bytes"][s]) for s in losses}
    say(f"eval {step:6d} | train {losses['train']:.4f} | val {losses['val']:.4f} | val {bpb['val']:.4f} "
        f"bits/byte{' (best)' if is_best else ''}")
    metrics.log({"step": step, "kind": "eval", "train_loss": losses["train"], "val_loss": losses["val"],
                 "train_bpb": bpb["train"], "val_bpb": bpb["val"], "elapsed_s": elapsed, "time": time.time()})


def training_state(cfg, meta, model, optimizer, scaler, loader, ddp: bool) -> dict:
    """What a checkpoint holds of the run besides its progress: the weights, the optimizer, the
    data order and every rank's generators (under FSDP every rank gathers; rank 0 keeps them)."""
    if ddp:
        model_state, optimizer_state = distributed.full_state(model, optimizer)
        rngs = distributed.gather(rng_state())
    else:
        model_state, optimizer_state, rngs = model.state_dict(), optimizer.state_dict(), [rng_state()]
    return {"config": cfg.to_dict(), "tokenizer": meta["tokenizer"], "model": model_state,
            "optimizer": optimizer_state, "loader": loader.state_dict(),
            "dataset": {k: meta[k] for k in ("source", "sha256", "tokens", "bytes")},
            "scaler": scaler.state_dict() if scaler.is_enabled() else None, "rng_ranks": rngs}


def draw_curves(out: Path, step: int) -> None:
    """curves.png: the run's losses so far (matplotlib is imported here, on first use)."""
    from viz.curves import draw, read_records, run_panels
    records = read_records(out / "metrics.jsonl", warn=False)
    atomic_write(out / "curves.png", draw(run_panels(records), f"{out.name}: step {step}"))


def sample(model: GPT, tokenizer, t, device, dtype) -> str:
    """A short sample of the model as it is now: the same prompt and seed every time, so that samples
    compare across steps; its own generator and eval mode leave every later loss as it would have been."""
    from model.sampling import generate   # (only where a run samples: train.sample_every)
    ids = tokenizer.encode(t.sample_prompt) if t.sample_prompt else [tokenizer.start_token]
    generator = torch.Generator(device=device).manual_seed(SAMPLE_SEED)
    was_training = model.training
    model.eval()
    with autocast(device, dtype):
        columns = generate(model, torch.tensor([ids], device=device), t.sample_tokens, SAMPLE_TEMPERATURE,
                           generator=generator, vocab_limit=tokenizer.vocab_size)
        new = torch.cat(list(columns), dim=1)[0].tolist()
    model.train(was_training)
    return t.sample_prompt + tokenizer.decode_bytes(new).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- what a run says and records

def printer(enabled: bool):
    """print(), flushed at once (or nothing: quiet runs, ranks other than 0); a stdout whose reader is
    gone stops the printing, not the run."""
    def say(*args, **kwargs):
        try:
            if enabled:
                print(*args, **kwargs, flush=True)
        except (OSError, ValueError):
            silence_stdout()
    return say


class Metrics:
    """metrics.jsonl (and wandb, when asked for). Resumed at resume_step, the records after it go (a run
    killed after its last checkpoint logs them again). Metrics(None): nothing (ranks other than 0)."""

    def __init__(self, cfg: Config | None, resume_step: int | None = None):
        self.cfg, self.resume_step, self.wandb = cfg, resume_step, None
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if cfg else None

    def open(self) -> None:
        log = self.cfg.log
        try:
            if log.wandb:
                import wandb
                self.wandb = wandb.init(project=log.wandb_project, group=log.wandb_group or None,
                                        name=log.wandb_run_name or self.path.parent.name,
                                        config=self.cfg.to_dict(), dir=str(self.path.parent), resume="allow")
        except Exception as e:   # not installed, no login, no network: wandb's own errors
            raise UserError(f"log.wandb = true but wandb did not start ({type(e).__name__}: "
                            f"{first_line(e, 80)}); pip install wandb, run `wandb login` or set "
                            f"WANDB_MODE=offline") from None
        kept = []
        if self.resume_step is not None:   # (viz/curves.py loaded only here and for curves.png)
            from viz.curves import read_records
            kept = [r for r in read_records(self.path) if r["step"] <= self.resume_step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:   # a line cut by a kill is skipped on reading
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind")},
                           step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def banner(say, cfg, resume_from, aside, stored: dict, step, model, device, dtype, how, world, loader,
           laps, was=None) -> None:
    """Where the run goes and what it is: its settings that are not the defaults (and, resumed, what
    changed since it began: was, the checkpoint's global batch and processes), then its size,
    device, dtype, step, processes, tokens per step, data."""
    out = Path(cfg.out_dir)
    say(f"# {out}: " + (f"resuming {resume_from} at step {step}" if resume_from else "a new run")
        + f" (every setting: {out / 'config.toml'})"
        + (f"; the earlier run is kept in {aside}" if aside else ""))
    now, defaults = flat(cfg.to_dict()), flat(build_config().to_dict())
    differ = [f"{k} = {fmt(v)}" for k, v in now.items()
              if v != defaults[k] and k not in ("out_dir", "model.vocab_size")]
    say("# not the defaults: " + ("; ".join(differ) if differ else "none"))
    if cfg.train.warmup_steps >= cfg.train.max_steps:
        say(f"# note: train.warmup_steps = {cfg.train.warmup_steps} is not below train.max_steps = "
            f"{cfg.train.max_steps}: the learning rate never reaches its peak nor decays (e.g. "
            f"--train.warmup_steps={max(1, cfg.train.max_steps // 10)})")
    for key in [k for k in now if k in stored and stored[k] != now[k]]:
        say(f"# resuming with {key}: {fmt(stored[key])} -> {fmt(now[key])}")
    t = cfg.train
    if was and was[0] != t.batch_size * t.grad_accum * world:
        say(resized(was, t, world, cfg.model.block_size))
    procs = f" x {world} processes ({'FSDP' if t.fsdp else 'DDP'})" if world > 1 else ""
    threads = torch.get_num_threads()
    where = f"cpu x {threads} thread{'s' * (threads > 1)}" if device.type == "cpu" else device
    say(f"# {model.num_params() / 1e6:.2f}M parameters, vocab {cfg.model.vocab_size:,} | {where}, "
        f"{str(dtype).removeprefix('torch.')}, {how}{procs} | "
        f"{t.batch_size * t.grad_accum * world * cfg.model.block_size:,} tokens/step | "
        f"data {loader.dataset_dir} ({'on the device' if loader.resident else 'memory-mapped'})")
    laps = (laps if laps[0][1] is not None else laps[1:]) + [("out dir", time.perf_counter())]
    say(f"# start-up {laps[-1][1] - laps[0][1]:.1f} s: " + ", ".join(
        f"{name} {b - a:.1f}" for (_, a), (name, b) in zip(laps, laps[1:])))


def resized(was: tuple[int, int], t, world: int, block_size: int) -> str:
    """The banner's line for a run resumed at another global batch (was: its sequences per step
    and processes so far): the tokens per step before and now, and the setting that keeps the
    earlier one."""
    (seqs, procs), now = was, t.batch_size * t.grad_accum * world
    if seqs % (t.batch_size * world) == 0:
        keep = f"--train.grad_accum={seqs // (t.batch_size * world)}"
    elif seqs % (t.grad_accum * world) == 0:
        keep = f"--train.batch_size={seqs // (t.grad_accum * world)}"
    else:
        keep = "no whole --train.grad_accum or --train.batch_size"
    processes = f" ({procs} processes -> {world})" if procs != world else ""
    tokens = f"{seqs * block_size:,} -> {now * block_size:,}{processes}"
    return f"# resuming with tokens/step: {tokens}: {keep} keeps it"
