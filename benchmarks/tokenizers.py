"""Which tokenizer learns the text best in the same time? Bits per byte at equal training time.

A loss per token cannot be compared across tokenizers (a GPT-2 token carries about four characters,
a char token one), so each run is scored in bits per byte of the whole val split: its mean loss
over every val token, times the split's tokens per UTF-8 byte, over ln 2. Every tokenizer trains the
same model shape (a config's) for the same wall-clock budget: a short timed run measures its step
time, the budget sets its step count, then it trains that many steps with its own LR schedule.
"""
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.race import val_loss, val_windows
from data.cache import bits_per_byte, load_meta
from data.prepare import prepare
from training.checkpoint import load_model
from training.config import build_config
from training.trainer import train

TOKENIZERS = ("char", "gpt2", "bpe:4096")


def step_seconds(cfg, out: Path, steps: int = 30) -> float:
    """Seconds per optimizer step of cfg, over `steps` steps after 5 of warm-up."""
    times = []
    cfg.train.max_steps, cfg.train.eval_interval, cfg.train.eval_iters = steps + 5, steps + 5, 1
    cfg.out_dir = str(out)

    def on_step(step, model):
        times.append(time.perf_counter())
    train(cfg, overwrite=True, quiet=True, on_step=on_step)
    return (times[-1] - times[4]) / (len(times) - 5)


def bench_tokenizers(config: str, overrides: list[str], seconds: float = 120.0, tokenizers=TOKENIZERS,
                     say=print) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench_tokenizers_"))
    rows = {}
    try:
        for tok in tokenizers:
            def make(name):
                return build_config(config, overrides + [f"--data.tokenizer={tok}", f"--out_dir={out / name}"])
            cfg = make("probe")
            per_step = step_seconds(cfg, out / "probe")
            cfg = make(tok.replace(":", "_"))
            steps = max(10, int(seconds / per_step))
            cfg.train.max_steps = steps
            cfg.train.warmup_steps = min(cfg.train.warmup_steps, steps // 10)
            cfg.train.eval_interval, cfg.train.eval_iters = steps, 1   # scored below on the whole val split
            t0 = time.perf_counter()
            train(cfg, overwrite=True, quiet=True)
            took = time.perf_counter() - t0
            dataset = prepare(cfg.data, cfg.model.block_size)
            meta = load_meta(dataset)
            model = load_model(out / tok.replace(":", "_")).model
            windows = val_windows(dataset, cfg.model.block_size)
            loss = val_loss(model, windows)
            scored = windows.numel() - len(windows)                      # the val tokens the windows predict
            scored_bytes = meta["bytes"]["val"] * scored / meta["tokens"]["val"]
            rows[tok] = {"vocab": meta["vocab_size"], "params": model.num_params(), "steps": steps,
                         "seconds": took, "loss": loss, "bpb": bits_per_byte(loss, scored, scored_bytes),
                         "tokens_per_byte": meta["tokens"]["val"] / meta["bytes"]["val"],
                         "bytes_seen": steps * cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
                         * meta["bytes"]["train"] / meta["tokens"]["train"]}
            r = rows[tok]
            say(f"{tok:9s} vocab {r['vocab']:6,} | {r['params'] / 1e6:5.2f}M params | {steps:5d} steps in "
                f"{took:5.1f} s | {r['bytes_seen'] / 1e6:5.2f} MB of text seen | val {loss:.4f} nats/token "
                f"| {r['bpb']:.4f} bits/byte")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    say(f"(each trained for about {seconds:.0f} s of steps on {config}; val scored on every token of the val split)")
    return rows

