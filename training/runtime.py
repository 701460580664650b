"""Where and how a run computes: the device, the number format, random seeds, and who prints.

    device   auto = cuda > mps > cpu
    dtype    auto = bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 elsewhere. Lower precision runs
             under autocast: weights and optimizer state stay fp32, matmuls run in the low format.
    TF32     on CUDA, fp32 matmuls may use TF32 tensor cores (10-bit mantissa): much faster, and the
             rounding is far below what training notices.
"""
import random
from contextlib import nullcontext

import numpy as np
import torch

from training.config import ConfigError

def pick_device(name: str, setting: str = "train.device") -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{setting}={name!r} is not a device (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{setting}={name!r} but CUDA is not available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{setting}={name!r} but this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"{setting}={name!r} but MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{setting}={name!r}: this project runs on cpu, cuda or mps")
    return device


def pick_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return getattr(torch, name)


def autocast(device: torch.device, dtype: torch.dtype):
    """The context that runs matmuls in dtype (a no-op in fp32)."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def use_fast_matmuls(device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's (every device's) generators from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every generator's state as plain data and tensors (what a checkpoint can hold)."""
    np_state = np.random.get_state()
    return {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
            "numpy": np_state[1].tolist(), "numpy_pos": int(np_state[2]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s: dict) -> None:
    random.setstate((s["python_version"], tuple(s["python"]), None))
    np.random.set_state(("MT19937", np.array(s["numpy"], dtype=np.uint32), s["numpy_pos"], 0, 0.0))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def printer(enabled: bool):
    """print, or a function that prints nothing (ranks other than 0, quiet runs)."""
    return print if enabled else (lambda *args, **kwargs: None)


def sync(device: torch.device) -> None:
    """Wait for the device to finish what was queued (before reading a clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpuinfo(field: str, path: str = "/proc/cpuinfo") -> str:
    """A field of the first processor in /proc/cpuinfo ('model name' -> the processor's name); '' where there is
    no such file (not Linux) or field."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    import platform
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine() -> str:
    """One line naming this machine: what a measurement was taken on."""
    import os
    import platform
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {cpu_name()} x {os.cpu_count()} cores, {gpu}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")
