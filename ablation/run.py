"""One run of a sweep, in its own process: `python -m ablation.run RUN_DIR`.

Trains (or resumes) the run whose config the sweep wrote to RUN_DIR/sweep_run.toml, then writes
RUN_DIR/result.json: whether it finished, its parameter count, the bytes its KV cache holds per
token, and its peak memory (resident, and on CUDA the GPU's allocated; a resumed run's, the largest
of its processes that ended as they should). Its losses are in its metrics.jsonl. If the sweep that started it dies (a
kill -9 that its own signal handling cannot see), the run stops as for SIGTERM: it saves and ends
rather than running on unseen with its out dir locked.
"""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from common import atomic_write, run_cli


def stop_when_orphaned(every: float = 0.5) -> None:
    """Send this process SIGTERM once its parent is gone (the system then gives it another parent).
    Windows gives orphans no new parent: there a sweep killed outright leaves its run to finish."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(every)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ablation.run RUN_DIR (a run directory that ablate.py prepared)", file=sys.stderr)
        return 2
    import torch

    from ablation.sweep import read_json
    from benchmarks.machine import peak_memory
    from training.checkpoint import latest_checkpoint, load_model
    from training.config import build_config
    from model.loading import pick_device, pick_dtype
    from training.trainer import train
    run_dir = Path(argv[0])
    stop_when_orphaned()
    cfg = build_config(str(run_dir / "sweep_run.toml"), [])
    resume = latest_checkpoint(run_dir) is not None
    summary = train(cfg, resume=resume, overwrite=not resume)
    device = pick_device(cfg.train.device)
    model, block = load_model(run_dir).model, cfg.model.block_size
    atomic_write(run_dir / "result.json", json.dumps({
        "done": summary["step"] >= cfg.train.max_steps and not summary["interrupted"], "step": summary["step"],
        "params": model.num_params(),
        "kv_cache_bytes_per_token": model.kv_cache_bytes(block, pick_dtype(device, cfg.train.dtype)) / block,
        "peak_rss_bytes": max(filter(None, [peak_memory(), read_json(run_dir / "result.json").get("peak_rss_bytes")]),
                              default=None),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}, indent=1))
    return summary["exit_code"]


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
