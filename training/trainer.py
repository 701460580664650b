"""The training loop. train() runs these steps, top to bottom:

    set_up, restore, build_step, start_writing    a run built and its out dir opened (training/run.py)
    run_steps         the optimizer steps; every log_interval steps a log line; every eval_interval
                      steps (and at the end, or when a signal or a lost stdout asks to stop)
                      evaluate_and_save; every sample_every steps record_sample; then how the run ended

Exact resume: the model, the optimizer, the LR schedule, the data order and every random generator
continue where the checkpoint left them.
"""
import functools
import math
import os
import signal
import sys
import time

import torch

from common import (Interrupted, Printer, RunError, StopRequest, duration, first_line, is_out_of_memory,
                    on_stop_signals, say_now)
from data.cache import bits_per_byte
from training.checkpoint import clean_state_dict, new_checkpoint, save_checkpoint
from training.config import Config
from training.optim import lr_at, set_lr
from training.run import Run, build_step, join_world, note, restore, set_up, start_writing
from training.outdir import read_records
from training.runtime import pick_device, rng_state
from model.sampling import Decoding, generate
from training.step import mean_loss
from viz.curves import draw, run_panels

EVAL_SEED = 4242     # evaluation draws the same batches every time, whatever the training seed
SAMPLE_SEED = 1337   # and samples while training the same draws
SAMPLE_TEMPERATURE = 0.8   # a little below 1: the likelier tokens, without greedy decoding's loops


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
    except Exception as e:
        if (peer := world.peer_failure(e)) is None:
            raise
        # a group that lost a process cannot be left: destroying it may wait for that process for ever, and
        # ending without destroying it may abort in gloo's threads; checkpoints are whole, so end here
        end_after_peer(f"error: {peer}")
    finally:
        world.leave(finished)


def end_after_peer(message: str, wait_s: float = 2.0) -> None:
    """Say message as the last line on stderr, then end with exit 2, after torchrun has had time to see
    that the other process ended first (its report names the first end it sees as the root cause): its
    SIGTERM ends this process in the wait, or the wait runs out."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # until the line is out
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    say_now(message + "\n")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(wait_s)
    os._exit(2)


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
    """Train and val loss on fixed batches, one metrics record, a checkpoint (best.pt if best), then
    curves.png redrawn (log.curves)."""
    run.guard.check()   # never checkpoint weights that a non-finite step touched
    ev = evaluate(run)
    is_best = ev["val"] < run.best_val
    run.best_val = min(run.best_val, ev["val"])
    meta = run.loader.meta
    bpb = {s: bits_per_byte(ev[s], meta["tokens"][s], meta["bytes"][s]) for s in ("train", "val")}
    run.print(f"eval {run.step:6d} | train {ev['train']:.4f} | val {ev['val']:.4f} | val {bpb['val']:.4f} bits/byte"
              f"{' (best)' if is_best else ''}")
    run.metrics.log({"step": run.step, "kind": "eval", "train_loss": ev["train"], "val_loss": ev["val"],
                     "train_bpb": bpb["train"], "val_bpb": bpb["val"], "elapsed_s": run.elapsed()})
    save(run, is_best)
    if run.cfg.log.curves and run.world.is_main:   # (matplotlib is imported on first use, by viz/curves.py)
        records = read_records(run.out.path / "metrics.jsonl", warn=False)
        run.out.write("curves.png", draw(run_panels(records), f"{run.out.path.name}: step {run.step}"))
    return ev


def record_sample(run: Run) -> None:
    """A short sample of the model as it is now, printed and recorded: the same prompt and seed every
    time, so that samples compare across steps. Its own generator and eval mode leave the training's
    random draws and every later loss as they would have been without it."""
    if not run.world.is_main:
        return
    t, tokenizer, device = run.cfg.train, run.tokenizer, run.world.device
    ids = tokenizer.encode(t.sample_prompt) if t.sample_prompt else [tokenizer.start_token]
    generator = torch.Generator(device=device).manual_seed(SAMPLE_SEED)
    was_training = run.model.training
    run.model.eval()
    with run.autocast:
        new = torch.cat(list(generate(run.model, torch.tensor([ids], device=device), t.sample_tokens,
                                      SAMPLE_TEMPERATURE, generator=generator, vocab_limit=tokenizer.vocab_size,
                                      decoding=Decoding(compile=False))), dim=1)[0].tolist()
    run.model.train(was_training)
    text = t.sample_prompt + tokenizer.decode_bytes(new).decode("utf-8", errors="replace")
    run.print(f"sample {run.step:4d} | " + text.replace("\n", "\n" + " " * 14))
    run.metrics.log({"step": run.step, "kind": "sample", "text": text})


def save(run: Run, is_best: bool) -> None:
    model_state, optimizer_state = run.world.full_state(run.model, run.optimizer)   # gathers FSDP shards
    rngs = run.world.gather(rng_state())
    if not run.world.is_main:
        return
    ckpt = new_checkpoint(
        config=run.cfg.to_dict(), tokenizer=run.loader.meta["tokenizer"], model=clean_state_dict(model_state),
        step=run.step, dataset=run.loader.meta, optimizer=optimizer_state,
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
    losses, last_eval, stopping, note_slowdown = {}, None, False, SlowdownNote(run)
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
                record = log_progress(run, loss, grad_norm, lr, interval_steps, time.perf_counter() - interval_start)
                losses[run.step] = record["loss"]
                note_slowdown(record["ms_per_step"])
            if run.step % t.eval_interval == 0 or run.step == end or stopping:   # end: max_steps, stop_at or on_step's
                last_eval = evaluate_and_save(run)
                logged = True
            if t.sample_every and (run.step % t.sample_every == 0 or run.step == t.max_steps):
                record_sample(run)
                logged = True
            if logged:   # evaluations and samples are not billed to steps
                interval_start, interval_steps = time.perf_counter(), 0
            if stopping:
                say_stopped(run, stop.signal or ("the loss of stdout (the end of a pipe's reader?)" if run.print.lost
                                                 else "a signal to another rank"))
                break
    except BaseException as e:
        if run.guard.saved_step is None:   # a run that never got to a checkpoint leaves the out dir as it found it
            run.abandon()
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


class SlowdownNote:
    """Says once, on CPU, that steps have become much slower than the fastest so far (other work took the cores)."""

    def __init__(self, run: Run):
        self.run, self.fastest_ms = run, math.inf
        self.said = run.world.device.type != "cpu"   # off the CPU there is nothing to say

    def __call__(self, ms: float) -> None:
        if not self.said and ms > 4 * self.fastest_ms and ms - self.fastest_ms > 20:
            self.said = True
            note(self.run, f"note: steps have become {ms / self.fastest_ms:.1f}x slower ({self.fastest_ms:.0f} -> "
                           f"{ms:.0f} ms): if other work now uses the CPU cores, OMP_NUM_THREADS=1 (and --resume) "
                           f"lets this run share them")
        self.fastest_ms = min(self.fastest_ms, ms)
