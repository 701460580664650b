"""Where a model computes and in which number format: what train.py, sample.py and eval.py share.

    device   auto = cuda > cpu; mps (Apple's GPU) only when named, with a note: untested there
    dtype    auto = bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 elsewhere (MPS: bf16 when asked
             and supported, never fp16). Lower precision runs under autocast: weights and optimizer
             state stay fp32, matmuls run in the low format
    TF32     on CUDA, fp32 matmuls may use TF32 tensor cores (a 10-bit mantissa: far below what
             training notices, and much faster)
"""
import sys
from contextlib import nullcontext

import torch

from common import ConfigError


def mps_has_bf16() -> bool:
    """Whether MPS computes in bfloat16 (macOS 14 and newer)."""
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps").add_(1)
    except (RuntimeError, TypeError):
        return False
    return True


def pick_device(name: str, setting: str = "train.device") -> torch.device:
    """auto: CUDA where there is a GPU, else the CPU; any other name is checked against this machine."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{setting}={name!r} is not a device (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{setting}={name!r}: this project runs on cpu, cuda or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{setting}={name!r} but CUDA is not available here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"{setting}={name!r} but this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{setting}={name!r} but MPS is not available here")
    if device.type == "mps":
        print("note: MPS (Apple's GPU) runs this project untested and unmeasured: float32 unless bfloat16 is asked "
              "for, no torch.compile, and no test checks that its results match the CPU's", file=sys.stderr)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return device


def pick_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtype = getattr(torch, name)
    if device.type == "mps" and dtype == torch.float16:
        raise ConfigError("train.dtype=float16 is not supported on MPS here: use bfloat16 (macOS 14 or newer) "
                          "or float32")
    if device.type == "mps" and dtype == torch.bfloat16 and not mps_has_bf16():
        raise ConfigError("train.dtype=bfloat16 but this Mac's MPS lacks it (macOS 14 or newer has it): use float32")
    return dtype


def autocast(device: torch.device, dtype: torch.dtype):
    """The context that runs matmuls in dtype (nothing in fp32)."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
