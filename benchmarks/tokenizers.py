"""Which tokenizer learns the text best in the same time? Bits per byte at equal training time.

A loss per token cannot be compared across tokenizers (a GPT-2 token carries about four characters,
a char token one), so each run is scored in bits per byte of the whole val split: its mean loss
over every val token, times the split's tokens per UTF-8 byte, over ln 2. Every tokenizer trains the
same model shape (a config's) for the same wall-clock budget: a short timed run (the probe) measures
its step time, which plans the run's step count (so its LR schedule ends with it); a run that the
machine slows down after the probe still ends once BUDGET_MARGIN times its budget has gone by, and
the table gives the steps it trained.
"""
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.race import exact_val_loss
from benchmarks.step import time_trainer
from data.cache import load_meta
from model.gpt import bits_per_byte
from data.prepare import prepare
from model.loading import load_model
from training.config import build_config
from training.trainer import train

TOKENIZERS = ("char", "gpt2", "bpe:4096")
BUDGET_MARGIN = 1.25   # a run ends after this many times its budget of wall time, whatever the probe planned


def train_within(cfg, seconds: float, per_step: float) -> tuple[int, int, float]:
    """Train cfg for about `seconds` of wall time: its steps planned from the probe's per_step, its run
    ended (as stop_at ends one) once BUDGET_MARGIN x seconds have gone by; (steps trained, steps planned,
    seconds it took)."""
    planned = max(10, int(seconds / per_step))
    cfg.train.max_steps = planned
    cfg.train.warmup_steps = min(cfg.train.warmup_steps, planned // 10)
    cfg.train.eval_interval, cfg.train.eval_iters = planned, 1   # scored on the whole val split afterwards
    t0 = time.perf_counter()
    deadline = t0 + BUDGET_MARGIN * seconds
    summary = train(cfg, quiet=True, on_step=lambda step, model: time.perf_counter() > deadline)
    return summary["step"], planned, time.perf_counter() - t0


def figures(cfg, steps: int) -> dict:
    """A trained run's size, the text it saw, its loss and bits per byte over every token of the val split."""
    meta = load_meta(prepare(cfg.data, cfg.model.block_size))
    loss = exact_val_loss(cfg, cfg.out_dir)
    tokens_seen = steps * cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
    return {"vocab": meta["vocab_size"], "params": load_model(cfg.out_dir).model.num_params(), "loss": loss,
            "bpb": bits_per_byte(loss, meta["tokens"]["val"], meta["bytes"]["val"]),
            "bytes_seen": tokens_seen * meta["bytes"]["train"] / meta["tokens"]["train"]}


def bench_tokenizers(config: str, overrides: list[str], seconds: float = 120.0, tokenizers=TOKENIZERS,
                     say=print) -> dict:
    """Each tokenizer in turn: the probe (3 timed rounds of 10 steps, the median), its run, its figures."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_tokenizers_", ignore_cleanup_errors=True) as tmp:
        for tok in tokenizers:
            out_dir = Path(tmp) / tok.replace(":", "_")
            cfg = build_config(config, overrides + [f"--data.tokenizer={tok}", f"--out_dir={out_dir}"])
            per_step = statistics.median(time_trainer(cfg, f"{out_dir}-probe", 10, 3)[0]) / 10
            steps, planned, took = train_within(cfg, seconds, per_step)
            r = rows[tok] = {"steps": steps, "planned": planned, "seconds": took, **figures(cfg, steps)}
            cut = " (the budget ran out)" if steps < planned else ""
            say(f"{tok:9s} vocab {r['vocab']:6,} | {r['params'] / 1e6:5.2f}M params | {steps} of {planned} steps in "
                f"{took:5.1f} s{cut} | {r['bytes_seen'] / 1e6:5.2f} MB of text seen | val {r['loss']:.4f} "
                f"nats/token | {r['bpb']:.4f} bits/byte")
    say(f"(each trained for about {seconds:g} s of steps, at most {BUDGET_MARGIN:g}x that, on {config}; val scored "
        f"on every token of the val split)")
    return rows
