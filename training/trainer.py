"""Training a GPT, top to bottom: `python train.py` calls train(cfg).

    set-up     the device and the processes; every check before the run's first write (the data, the
               out dir, the checkpoint to resume, the memory a step needs); the data, the model, the
               optimizer
    the step   forward and backward over grad_accum micro-batches, gradient clipping, the non-finite
               record, the update; on one CUDA GPU recorded once as a CUDA graph and replayed
    the loop   a log line every log_interval steps; an evaluation and a checkpoint every eval_interval
               steps, at the end, and when a signal or a lost stdout stops the run; a sample every
               sample_every steps

Choices:
  exact resume  the weights, the optimizer, the LR schedule, the data order and every random generator
                continue where the checkpoint left them (on CPU each later loss equals the uninterrupted
                run's to 1e-6)
  non-finite    the step records the first step whose loss or gradient norm is not finite on the device
                (a CUDA graph can hold that); the loop reads it where it waits for the device anyway (log
                lines, evaluations, checkpoints, the last step) and stops, naming the step: no checkpoint
                is ever written after it. on_nonfinite = skip reads it every step and skips the update
  true speed    ms/step is timed after the log line has read the loss: the device has finished the steps
  one cast      a step's micro-batches run in one autocast region, so each weight is cast to bf16 once a
                step, not once a micro-step
  signals       SIGINT, SIGTERM, SIGHUP: the step finishes, a checkpoint is saved, exit 128 + signal
"""
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch

from common import Interrupted, Printer, StopRequest, UserError, atomic_write, duration, first_line, is_out_of_memory, on_stop_signals
from data.cache import load_meta
from model.gpt import bits_per_byte
from data.loader import BatchLoader, strided_windows
from data.prepare import prepare
from data.sources import find_sources
from data.tokenizers import load_tokenizer
from model.gpt import GPT, score
from training.checkpoint import (FORMAT, VERSION, check_resumable, check_same_text, latest_checkpoint, link_best,
                                 read_checkpoint, restore, rng_state, save_checkpoint)
from training.config import SAME_RUN_KEYS, Config, build_config, changes, describe, fmt, load_toml
from training.device import autocast, busy_cpu_note, check_memory, cpu_times, pick_device, pick_dtype
from training.optim import build_optimizer, lr_at, set_lr
from training.outdir import OutDir
from viz.curves import draw, read_records, run_panels

EVAL_SEED = 4242             # evaluation draws the same batches every time, whatever the training seed
SAMPLE_SEED = 1337           # and samples while training the same draws
SAMPLE_TEMPERATURE = 0.8     # a little below 1: the likelier tokens, without greedy decoding's loops
MAX_SKIPS_IN_A_ROW = 10      # on_nonfinite = skip still stops a run that has plainly diverged


def train(cfg: Config, resume: bool = False, overwrite: bool = False, quiet: bool = False,
          stop_at: int | None = None, on_step=None, checkpoint=None) -> dict:
    """Run (or continue) the training cfg describes; return a summary of how it ended.
    checkpoint: with resume, the checkpoint to continue (default: the out dir's latest).
    stop_at: end after that step, with an evaluation and a checkpoint, as a signal would.
    on_step(step, model): called after every step (bench.py times rounds there); True ends the run there."""
    t, ddp, started = cfg.train, int(os.environ.get("WORLD_SIZE", "1")) > 1, cpu_times()
    device, rank, local_rank, world = pick_device(t.device), 0, 0, 1
    if ddp:
        from training import distributed   # only under torchrun
        device, rank, local_rank, world = distributed.join(device)
    say, out, finished = Printer(rank == 0 and not quiet), OutDir(cfg.out_dir), False
    try:
        # ---- every check before the run's first write: the data's files, the out dir, the checkpoint, the memory
        dtype = pick_dtype(device, t.dtype)
        if t.fsdp and ddp and dtype == torch.float16:
            raise UserError("train.fsdp with float16 needs a sharded gradient scaler: use --train.dtype=bfloat16")
        find_sources(cfg.data.path)
        resume_from = distributed.leader_first(lambda: out.check(resume, overwrite, checkpoint), rank == 0,
                                               others=False) if ddp else out.check(resume, overwrite, checkpoint)
        stored = load_toml(out.path / "config.toml") if resume_from and (out.path / "config.toml").is_file() else None
        ckpt = read_checkpoint(resume_from) if resume_from else None   # read whole: the file may go
        if ckpt is not None:
            check_resumable(ckpt, resume_from, cfg)
        dataset = distributed.leader_first(lambda: prepare(cfg.data, cfg.model.block_size), local_rank == 0) \
            if ddp else prepare(cfg.data, cfg.model.block_size)
        meta = load_meta(dataset)
        tokenizer = load_tokenizer(meta["tokenizer"])
        if ckpt is not None:
            check_same_text(ckpt, resume_from, meta, cfg.data.path, say)
        cfg.model.vocab_size = cfg.model.vocab_size or meta["vocab_size"]
        if cfg.model.vocab_size < meta["vocab_size"]:
            raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                              f"{meta['vocab_size']}")
        if t.sample_prompt:
            try:   # a character the text never had is refused now, not at the first sample
                tokenizer.encode(t.sample_prompt)
            except UserError as e:
                raise UserError(f"train.sample_prompt has {e}") from None
        memory = check_memory(cfg, device, dtype, world)

        # ---- the data, the model (the same initial weights on every rank), the optimizer
        loader = BatchLoader(dataset, cfg.model.block_size, t.batch_size, seed=t.seed, device=device,
                             grad_accum=t.grad_accum, rank=rank, world=world)
        np.random.seed(t.seed)
        torch.manual_seed(t.seed)
        model = GPT(cfg.model).to(device)
        if t.init_from and ckpt is None:   # pretrained weights (a resumed run restores its own instead)
            from hf.hub import load_init_weights
            load_init_weights(model, t.init_from)
        if t.onednn:
            from speed.onednn import use_onednn_linears
            use_onednn_linears(model, device, dtype)
        if rank:
            torch.manual_seed(t.seed + rank)   # each rank its own dropout masks
        wrapped = distributed.wrap(model, device, t.fsdp) if ddp else model   # (FSDP shards before the optimizer)
        optimizer = build_optimizer(model, t.optimizer, device, lr=t.lr, betas=(t.beta1, t.beta2),
                                    weight_decay=t.weight_decay, muon_lr=t.muon_lr, muon_momentum=t.muon_momentum)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        nonfinite = NonFinite(device, stop=t.on_nonfinite == "stop", check_grad=not scaler.is_enabled())
        step, best_val, tokens, seconds_before, skipped, relink = 0, math.inf, 0, 0.0, 0, False
        if ckpt is not None:
            step, best_val, tokens, seconds_before, skipped = restore(ckpt, resume_from, model, optimizer, scaler,
                                                                    loader, rank, world, t.seed)
            nonfinite.steps.fill_(step)
            latest = latest_checkpoint(out.path) or resume_from
            relink = ckpt["is_best"] and latest.name == resume_from.name   # a kill may have cut best.pt's linking
        del ckpt   # its tensors live in the model and optimizer now

        stop = StopRequest("finishing this step and saving a checkpoint")
        with on_stop_signals(stop):
            # ---- the step: compiled, and recorded as a CUDA graph, where asked for and possible
            run_step, how, wrapped = build_step(model, wrapped, optimizer, scaler, nonfinite, loader, device, dtype,
                                                t, world, say)

            # ---- from the first write on, a run that ends without a checkpoint of its own leaves the out dir
            # as it found it
            metrics, saved_step, stopping = Metrics(None), step if resume_from else None, False
            try:
                if rank == 0:
                    out.open()
                    if relink:
                        link_best(resume_from)
                    atomic_write(out.path / "config.toml", describe(cfg))
                    metrics = Metrics(cfg, out.path, saved_step)
                tokens_per_step = t.batch_size * t.grad_accum * world * cfg.model.block_size
                banner(say, cfg, out.path, resume_from, stored, step, model, device, dtype, how, world,
                       tokens_per_step, dataset, memory)

                # ---- the loop
                schedule = dict(lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                schedule=t.schedule, warmdown_frac=t.warmdown_frac)
                end, losses, last_eval, in_a_row = min(t.max_steps, stop_at or t.max_steps), {}, None, 0
                loop_start = interval_start = time.perf_counter()
                interval_steps = 0
                if stop.signal:   # before the first step: nothing of this run is worth a checkpoint
                    raise Interrupted(signal.Signals[stop.signal], f"stopped by {stop.signal} before its first step")
                while step < end:
                    lr = lr_at(step, **schedule)
                    set_lr(optimizer, lr / t.lr if t.lr > 0 else 0.0)
                    loss, grad_norm, bad = run_step()
                    step, tokens, interval_steps = step + 1, tokens + tokens_per_step, interval_steps + 1
                    if t.on_nonfinite == "skip":   # the update was dropped; count it, and stop a diverged run
                        in_a_row = in_a_row + 1 if (what := nonfinite.said(bad)) else 0
                        skipped += bool(what)
                        if what:
                            say(f"step {step:6d} | non-finite {what}: update skipped ({skipped} so far)")
                        if in_a_row >= MAX_SKIPS_IN_A_ROW:
                            raise UserError(f"non-finite {what} at {in_a_row} steps in a row (up to step {step}); "
                                           f"stopped, {kept(saved_step)} (try a lower --train.lr)")
                    if on_step is not None and on_step(step, model):
                        end = step   # asked to end here, as stop_at would
                    logged = step % t.log_interval == 0 or step == t.max_steps
                    asked = stop.signal is not None or say.lost
                    stopping = asked if not ddp else \
                        distributed.any_rank(asked, device) if logged or step == end else False
                    if logged:
                        loss_value = loss.item()   # waits for the device: the interval's steps have all run
                        ms = (time.perf_counter() - interval_start) * 1000 / interval_steps
                        nonfinite.check(saved_step)
                        record = {"step": step, "kind": "train", "loss": loss_value, "lr": lr,
                                  "grad_norm": grad_norm.item(), "ms_per_step": ms,
                                  "tokens_per_s": tokens_per_step * 1000 / ms, "skipped_steps": skipped}
                        say(f"step {step:6d} | loss {loss_value:.4f} | lr {lr:.2e} | {ms:7.1f} ms/step | "
                            f"{record['tokens_per_s']:,.0f} tok/s | ETA {duration((t.max_steps - step) * ms / 1000)}")
                        metrics.log(record)
                        losses[step] = loss_value
                        if started is not None:   # once, early: other work on the CPU makes this run wait
                            busy_cpu_note(started, device, Printer(say.enabled))
                            started = None
                    if step % t.eval_interval == 0 or step == end or stopping:
                        nonfinite.check(saved_step)   # never a checkpoint of weights a non-finite step touched
                        last_eval = evaluate(wrapped, loader, t.eval_iters, dtype, device, ddp)
                        is_best, best_val = last_eval["val"] < best_val, min(best_val, last_eval["val"])
                        bpb = {s: bits_per_byte(last_eval[s], meta["tokens"][s], meta["bytes"][s]) for s in last_eval}
                        say(f"eval {step:6d} | train {last_eval['train']:.4f} | val {last_eval['val']:.4f} | val "
                            f"{bpb['val']:.4f} bits/byte{' (best)' if is_best else ''}")
                        elapsed = seconds_before + time.perf_counter() - loop_start
                        metrics.log({"step": step, "kind": "eval", "train_loss": last_eval["train"],
                                     "val_loss": last_eval["val"], "train_bpb": bpb["train"], "val_bpb": bpb["val"],
                                     "elapsed_s": elapsed})
                        model_state, optimizer_state = distributed.full_state(model, optimizer) if ddp else \
                            (model.state_dict(), optimizer.state_dict())   # (FSDP gathers its shards on every rank)
                        rngs = distributed.gather(rng_state()) if ddp else [rng_state()]
                        if rank == 0:
                            save_checkpoint({
                                "format": FORMAT, "version": VERSION, "config": cfg.to_dict(), "step": step,
                                "tokenizer": meta["tokenizer"], "model": model_state,
                                "dataset": {k: meta[k] for k in ("source", "sha256", "tokens", "bytes")},
                                "optimizer": float_lrs(optimizer_state), "loader": loader.state_dict(),
                                "scaler": scaler.state_dict() if scaler.is_enabled() else None, "rng_ranks": rngs,
                                "best_val_loss": best_val, "elapsed": elapsed, "tokens": tokens,
                                "skipped_steps": skipped, "is_best": is_best}, out.path, keep=t.keep_checkpoints)
                            out.committed()   # the run has a checkpoint: what it replaced can go
                            if cfg.log.curves:   # (matplotlib is imported on first use)
                                atomic_write(out.path / "curves.png", draw(run_panels(read_records(
                                    out.path / "metrics.jsonl", warn=False)), f"{out.path.name}: step {step}"))
                        saved_step, logged = step, True
                    if t.sample_every and (step % t.sample_every == 0 or step == t.max_steps) and rank == 0:
                        nonfinite.check(saved_step)   # (a sample of weights a non-finite step touched says nothing)
                        text = sample(model, tokenizer, t, device, dtype)
                        say(f"sample {step:4d} | " + text.replace("\n", "\n" + " " * 14))
                        metrics.log({"step": step, "kind": "sample", "text": text})
                        logged = True
                    if logged:   # evaluations and samples are not billed to the steps
                        interval_start, interval_steps = time.perf_counter(), 0
                    if stopping:
                        why = stop.signal or ("the loss of stdout (the end of a pipe's reader?)" if say.lost
                                              else "a signal to another rank")
                        text = (f"stopped by {why} at step {step}, checkpoint saved in {out.path}; to continue, run "
                                f"the same command with --resume")
                        say(text)
                        if say.lost:
                            Printer(rank == 0)(text, file=sys.stderr)
                        break
            except BaseException as e:
                out.abandon()   # (a resumed run, or one with a checkpoint of its own, keeps everything)
                if is_out_of_memory(e):
                    raise UserError(f"out of memory on {device} at step {step + 1} ({first_line(e, 80)}): try a "
                                   f"smaller --train.batch_size (with a larger --train.grad_accum to keep the tokens "
                                   f"per step; {kept(saved_step, resume=True)}) or a smaller --model.block_size") \
                        from None
                raise
            finally:
                metrics.close()
        total = seconds_before + time.perf_counter() - loop_start
        if step >= t.max_steps:
            say(f"# done: step {step}, best val loss {best_val:.4f}, {duration(total)} ({total:.1f} s), {tokens:,} "
                f"tokens" + (f", {skipped} non-finite steps skipped" if skipped else ""))
        finished = True
        return {"step": step, "val_loss": last_eval["val"] if last_eval else None, "best_val_loss": best_val,
                "elapsed_s": total, "losses": losses, "skipped_steps": skipped, "interrupted": stopping,
                "exit_code": 128 + signal.Signals[stop.signal] if stop.signal else 141 if say.lost else
                130 if stopping else 0}
    finally:
        out.close()
        if ddp:
            distributed.leave(finished)


# ---------------------------------------------------------------- the step

class NonFinite:
    """Non-finite losses and gradient norms, recorded on the device by the step itself (a CUDA graph
    holds that): `first` is the first such step, +step for its loss, -step for its gradient, 0 for none.
    With fp16's loss scaler an inf gradient is routine (the scaler skips it): then only the loss counts."""

    def __init__(self, device: torch.device, stop: bool, check_grad: bool):
        self.stop, self.check_grad = stop, check_grad
        self.steps = torch.zeros((), dtype=torch.long, device=device)   # steps recorded
        self.first = torch.zeros((), dtype=torch.long, device=device)

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """This step's record: +1 a non-finite loss, -1 a non-finite gradient, 0 neither."""
        self.steps.add_(1)
        loss_ok = torch.isfinite(loss)
        bad = ~(loss_ok & torch.isfinite(grad_norm)) if self.check_grad else ~loss_ok
        this = torch.where(bad, torch.where(loss_ok, -1, 1), 0)
        self.first.copy_(torch.where((self.first == 0) & bad, this * self.steps, self.first))
        return this

    @staticmethod
    def said(record: torch.Tensor | int) -> str:
        """What a record says was not finite ('' for nothing); reading it waits for the device."""
        r = int(record)
        return "loss" if r > 0 else "gradient" if r < 0 else ""

    def check(self, saved_step: int | None) -> None:
        """Stop mode: raise, naming the first non-finite step, if there was one."""
        if self.stop and (first := int(self.first)):
            raise UserError(f"non-finite {self.said(first)} at step {abs(first)}; stopped, {kept(saved_step)} (try a "
                           f"lower --train.lr, or --train.on_nonfinite=skip to skip such steps)")


def make_step(model, wrapped, optimizer, scaler, nonfinite: NonFinite, device, dtype, t, ddp_module=None):
    """One optimizer step on windows (grad_accum, B, T + 1) on the device -> (mean loss over the global
    batch, gradient norm before clipping, its non-finite record); no host sync, so that a CUDA graph
    can hold it (but skip mode's decision, which keeps the step eager)."""
    skip, ddp, low_precision = t.on_nonfinite == "skip", ddp_module is not None, autocast(device, dtype)
    if ddp:
        from training import distributed

    def step(windows: torch.Tensor):
        accum = windows.size(0)
        loss_sum = torch.zeros((), device=device)
        with low_precision:   # one region: each weight is cast once per step
            for micro in range(accum):
                x, y = windows[micro, :, :-1], windows[micro, :, 1:]   # (B, T) each: y is x shifted by one
                if ddp:
                    distributed.sync_gradients(ddp_module, micro == accum - 1)   # (DDP's, not its compiled wrapper)
                _, loss = wrapped(x, y)
                loss_sum += loss.detach()
                scaler.scale(loss / accum).backward()
        if ddp:
            distributed.mean(loss_sum)   # the loss of the whole global batch, on every rank
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm   # (FSDP's DTensor)
        bad = nonfinite.record(loss_sum, grad_norm)   # every rank sees the same loss and norm: the same decision
        if not (skip and int(bad)):
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum / accum, grad_norm, bad
    return step


def build_step(model, wrapped, optimizer, scaler, nonfinite, loader, device, dtype, t, world: int, say):
    """(the next optimizer step as a function of nothing, how it runs in words, the model as the step
    calls it): compiled (train.compile) and recorded as a CUDA graph (train.cuda_graph) where asked for
    and possible."""
    uncompiled = wrapped
    if t.compile and device.type == "mps":   # not tried where nothing is tested: said, not attempted
        Printer(say.enabled)("note: train.compile is not tried on MPS: training eagerly", file=sys.stderr)
    elif t.compile:
        say("# compiling the model: about half a minute (train.compile = false skips it)")
        from speed.compile import compiled_or_eager
        wrapped = compiled_or_eager(wrapped, lambda fn: compile_trial(fn, model, loader, device, dtype), "training")
    one_step = make_step(model, wrapped, optimizer, scaler, nonfinite, device, dtype, t,
                         uncompiled if world > 1 else None)
    run_step, how = lambda: one_step(loader.step_windows().to(device, non_blocking=True)), "eager"
    blockers = graph_blockers(t, device, world, dtype)
    if t.cuda_graph and not blockers:
        from speed.cuda_graph import graph_step
        order = loader.state_dict()   # the warm-up's data, drawn without moving the data order on
        warmup_windows = loader.step_windows().to(device)
        loader.load_state_dict(order)
        try:
            replay = graph_step(one_step, warmup_windows, optimizer, [nonfinite.steps, nonfinite.first],
                                capture=device.type == "cuda")
            run_step, how = lambda: replay(loader.step_windows()), "CUDA graph"   # (copied into its buffer)
        except Exception as e:   # what the recording cannot hold: the eager step does the same work
            say(f"warning: the CUDA graph step failed, training eagerly ({type(e).__name__}: {first_line(e)})")
    elif t.cuda_graph and device.type == "cuda":
        say(f"# no CUDA graph: {'; '.join(blockers)}")
    return run_step, how + (", compiled" if wrapped is not uncompiled else ""), wrapped


def graph_blockers(t, device: torch.device, world: int, dtype: torch.dtype) -> list[str]:
    """Why the step cannot be recorded as a CUDA graph here ([] = it can)."""
    reasons = [f"graphs are CUDA only (device {device.type})"] if device.type != "cuda" else []
    reasons += ["several processes (DDP/FSDP synchronize from the host)"] if world > 1 else []
    reasons += ["fp16 loss scaling decides on the host"] if dtype == torch.float16 else []
    return reasons + (["on_nonfinite = skip decides on the host"] if t.on_nonfinite == "skip" else [])


def compile_trial(compiled, model, loader, device, dtype) -> None:
    """One forward and backward of the compiled model on a batch laid out as the step's (views of one
    (B, T + 1) batch: other strides would compile again), leaving no gradients and the generators as they were."""
    w = torch.zeros(loader.batch_size, loader.block_size + 1, dtype=torch.long, device=device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast(device, dtype):
            compiled(w[:, :-1], w[:, 1:])[1].backward()
    finally:
        model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- evaluation and samples

def evaluate(wrapped, loader: BatchLoader, iters: int, dtype, device, ddp: bool) -> dict:
    """Mean loss of each split over the same `iters` batches every time (a fixed generator; each rank
    scores its share of every batch), or with iters = 0 over every token of the split in consecutive
    windows (every rank all of them: as many forwards on every rank, which FSDP's gathers need)."""
    losses = {}
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(EVAL_SEED)
        batches = (loader.batch(split, generator) for _ in range(iters)) if iters else \
            strided_windows(loader.splits[split], loader.block_size, loader.block_size, loader.batch_size)
        nats, count = score(wrapped, batches, autocast(device, dtype))
        if ddp and iters:   # every rank's share
            from training import distributed
            nats, count = distributed.mean(torch.tensor([nats, count], dtype=torch.float64, device=device)).tolist()
        losses[split] = nats / count
    return losses


def sample(model: GPT, tokenizer, t, device, dtype) -> str:
    """A short sample of the model as it is now: the same prompt and seed every time, so that samples
    compare across steps; its own generator and eval mode leave every later loss as it would have been."""
    from model.sampling import Decoding, generate   # (only where a run samples: train.sample_every)
    ids = tokenizer.encode(t.sample_prompt) if t.sample_prompt else [tokenizer.start_token]
    generator = torch.Generator(device=device).manual_seed(SAMPLE_SEED)
    was_training = model.training
    model.eval()
    with autocast(device, dtype):
        new = torch.cat(list(generate(model, torch.tensor([ids], device=device), t.sample_tokens, SAMPLE_TEMPERATURE,
                                      generator=generator, vocab_limit=tokenizer.vocab_size,
                                      decoding=Decoding(compile=False))), dim=1)[0].tolist()
    model.train(was_training)
    return t.sample_prompt + tokenizer.decode_bytes(new).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- set-up, resume, record

def kept(saved_step: int | None, resume: bool = False) -> str:
    if saved_step is None:
        return "no checkpoint had been written yet"
    return f"--resume continues from the last checkpoint (step {saved_step})" if resume else \
        f"the last good checkpoint (step {saved_step}) is kept"


def float_lrs(state: dict) -> dict:
    """An optimizer state dict (or Muon + AdamW's list of them) with every lr a float: a CUDA graph
    holds them in tensors, a checkpoint must load anywhere and resume with either kind of step."""
    if "optimizers" in state:
        return {**state, "optimizers": [float_lrs(s) for s in state["optimizers"]]}
    return {**state, "param_groups": [{**g, "lr": float(g["lr"])} for g in state["param_groups"]]}


class Metrics:
    """metrics.jsonl (and wandb, when asked for). resume_step: keep the records up to it, drop the rest
    (what a run killed after its last checkpoint logged is logged again when it resumes). Metrics(None):
    what ranks other than 0 record, nothing."""

    def __init__(self, cfg: Config | None, out_dir=None, resume_step: int | None = None):
        self.path = self.wandb = None
        if cfg is None:
            return
        if cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                raise UserError("log.wandb = true but wandb is not installed (pip install wandb)") from None
            try:
                self.wandb = wandb.init(project=cfg.log.wandb_project, name=cfg.log.wandb_run_name or out_dir.name,
                                        group=cfg.log.wandb_group or None, config=cfg.to_dict(), dir=str(out_dir),
                                        resume="allow")
            except Exception as e:   # no login, no network, a bad project: wandb's own errors
                raise UserError(f"log.wandb = true but wandb did not start ({type(e).__name__}: "
                                  f"{first_line(e, 100)}); run `wandb login`, set WANDB_MODE=offline, or leave "
                                  f"log.wandb off") from None
        self.path = out_dir / "metrics.jsonl"
        kept_records = [r for r in read_records(self.path) if r["step"] <= resume_step] if resume_step is not None \
            else []
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept_records))

    def log(self, record: dict) -> None:
        if self.path is None:
            return
        try:   # opened for each record: a line is written whole or, when a kill cuts it, skipped on reading
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            e.filename = str(self.path)
            raise
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind")}, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        self.wandb = None


def banner(say, cfg, out_dir, resume_from, stored, step, model, device, dtype, how, world, tokens_per_step,
           dataset, memory) -> None:
    """Where the run goes and what it is: its settings that are not the defaults (and, resumed, what
    changed since it began), then its size, device, dtype, step, processes, tokens per step, data."""
    note = Printer(say.enabled)
    say(f"# {out_dir}: " + (f"resuming {resume_from} at step {step}" if resume_from else "a new run")
        + f" (every setting: {out_dir / 'config.toml'})")
    differ = [f"{k} = {fmt(now)}" for k, _, now in changes(build_config(None, []), cfg)
              if k not in ("out_dir", "model.vocab_size")]
    say("# not the defaults: " + ("; ".join(differ) if differ else "none"))
    procs = f" x {world} processes ({'FSDP' if cfg.train.fsdp else 'DDP'})" if world > 1 else ""
    say(f"# {model.num_params() / 1e6:.2f}M parameters, vocab {cfg.model.vocab_size:,} | {device}, "
        f"{str(dtype).removeprefix('torch.')}, {how}{procs} | {tokens_per_step:,} tokens/step | data {dataset}")
    say(f"# memory: {memory}")
    if cfg.train.fsdp and world == 1:
        say("# train.fsdp: a single process has nothing to shard it with (start several with torchrun)")
    if stored is not None:
        changed = changes(build_config(None, [], base={**stored, "out_dir": cfg.out_dir}), cfg)
        for key, before, now in changed:
            say(f"# resuming with {key}: {fmt(before)} -> {fmt(now)}")
        if any(k not in SAME_RUN_KEYS and not k.startswith("log.") for k, _, _ in changed):
            note(f"note: {', '.join(k for k, _, _ in changed)} changed since the run began: it goes on from its last "
                 f"checkpoint, but not as it would have gone on uninterrupted", file=sys.stderr)
