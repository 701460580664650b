"""Where a model computes and in which number format: what train.py, sample.py and eval.py share.

    device   auto = cuda > cpu; mps (Apple's GPU) only when named, with a note: untested there
    dtype    auto = bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 elsewhere (MPS: bf16 when asked
             and supported, never fp16). Lower precision runs under autocast: weights and optimizer
             state stay fp32, matmuls run in the low format
    TF32     on CUDA, fp32 matmuls may use TF32 tensor cores (a 10-bit mantissa: far below what
             training notices, and much faster)
    memory   a training step that would not fit in what the device has free is refused before anything
             is allocated (check_memory)
    a busy CPU   other work that keeps the cores busy makes PyTorch's threads wait for each other at every
             step: a run says so (busy_cpu_note)
"""
import os
import sys
import time

import torch

from common import UserError
from model.gpt import GPT
from model.loading import autocast, pick_device, pick_dtype  # noqa: F401


def step_memory(cfg, params: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the training state, bytes of one micro-batch's activations), roughly, at a step's peak.

    state        fp32 weights, their gradients and AdamW's two moments: 16 bytes a parameter
    activations  what backward keeps, about 22 numbers of n_embd per token per layer (measured on CPU,
                 fp32, fused attention), fewer bytes in bf16; the (B, nh, T, T) scores where attention
                 materializes them (naive); the logits, their fp32 copy and its gradient"""
    m, t = cfg.model, cfg.train
    low, batch_tokens = dtype != torch.float32, t.batch_size * m.block_size
    scores = m.n_layer * t.batch_size * m.n_head * m.block_size ** 2 * 9 if m.attention == "naive" else 0
    return params * 16, m.n_layer * batch_tokens * m.n_embd * (56 if low else 88) + scores + \
        batch_tokens * m.vocab_size * (8 if low else 12)


def check_memory(cfg, device: torch.device, dtype: torch.dtype, world: int = 1) -> str:
    """Refuse, before anything is allocated, a step that would need more memory than the device has free
    (train.check_memory = false tries anyway); the estimate in words, for the banner. Under FSDP each of
    the `world` processes holds its share of the training state."""
    with torch.device("meta"):
        state, activations = step_memory(cfg, sum(p.numel() for p in GPT(cfg.model).parameters()), dtype)
    state //= world if cfg.train.fsdp else 1
    free = free_memory(device)
    size = lambda n: f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"   # noqa: E731
    words = f"about {size(state + activations)} (activations {size(activations)}, weights and optimizer {size(state)})"
    if cfg.train.check_memory and free is not None and state + activations > free:
        m, t = cfg.model, cfg.train
        raise UserError(f"one training step needs {words} for batch {t.batch_size} x block {m.block_size} x "
                       f"{m.n_layer} layers, more than the {size(free)} free on {device}: make --train.batch_size (with"
                       f" a larger --train.grad_accum to keep the tokens per step), --model.block_size or the model "
                       f"smaller, or set --train.check_memory=false to try anyway")
    return f"a step needs {words}" + (f", {size(free)} free" if free is not None else "")


def free_memory(device: torch.device) -> int | None:
    """Bytes a run can still allocate: the GPU's free memory, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:   # MemAvailable counts the page cache a run can take back
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):   # macOS and Windows cannot say
        return None


def cpu_times() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds of every process on this machine, CPU seconds of this one); None
    where the system does not say (Linux's /proc/stat does)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return time.perf_counter(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), \
        sum(os.times()[:2])


def busy_cpu_note(started, device: torch.device, note) -> None:
    """Say so when other work kept the cores busy since the run started: PyTorch's threads wait for each
    other at every step, so a run whose threads share the cores with it can be many times slower."""
    now, threads, cores = cpu_times(), torch.get_num_threads(), os.cpu_count() or 1
    if device.type != "cpu" or threads < 2 or now is None or now[0] - started[0] < 0.1:
        return
    others = ((now[1] - started[1]) - (now[2] - started[2])) / (now[0] - started[0])   # cores busy with others
    if others >= 0.5 and others + threads > cores:
        note(f"note: other work keeps {others:.1f} of the {cores} CPU cores busy and this run's {threads} threads wait "
             f"for each other at every step, which can make it many times slower: OMP_NUM_THREADS=1 lets it share "
             f"the cores", file=sys.stderr)
