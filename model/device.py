"""Where a model computes: the device, the dtype (a low precision runs under autocast) and on a
CPU how many threads. torch's threads wait for each other after every operation: one that lost
its core to another process holds up the rest. So a CPU run takes the cores others leave
free, unless OMP_NUM_THREADS is set (an exact resume under another load needs it: the thread
count moves the last bits).
"""
import math
import os
from contextlib import nullcontext

import torch

from common import CPU_AT_START, UserError, cpu_clock, usable_cores

# all the threads torch starts with: one per core this process may use
CORES = torch.get_num_threads()


def pick_device(name: str, setting: str = "train.device") -> torch.device:
    """The device of a name, checked against this machine."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
        # the device exists here (a CPU-only build asserts)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError):
        raise UserError(f"{setting}={name!r} is not a device this machine has "
                        f"(cpu, cuda, cuda:N, mps)") from None
    if device.type == "cpu":
        fit_threads(CPU_AT_START)
    elif device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        # the GPU that random generators, graphs and streams act on
        if device.index is not None:
            torch.cuda.set_device(device)
    return device


def fit_threads(since):
    """Threads for the cores others left free since the cpu_clock() reading `since` (under 0.5 s
    ago: at the next call) -> (the next `since`, a line saying a change, or None)."""
    now = cpu_clock()
    if now is None or since is None or "OMP_NUM_THREADS" in os.environ:
        return now, None
    if now[0] - since[0] < 0.5:
        return since, None
    seconds, busy, own = (b - a for a, b in zip(since, now))
    # busy time is counted on logical CPUs (two a core, often), torch's threads one a core
    others = max(0.0, (busy - own) / seconds) * CORES / len(usable_cores())
    # a core counts as taken once another process keeps it a quarter busy
    threads = max(1, CORES - math.floor(others + 0.75))
    before = torch.get_num_threads()
    if threads == before:
        return now, None
    torch.set_num_threads(threads)
    return now, (f"# threads {before} -> {threads}: other processes keep {others:.1f} of "
                 f"{CORES} cores busy")


def pick_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autocast(device: torch.device, dtype: torch.dtype):
    """The context that runs matmuls in dtype (nothing in fp32)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
