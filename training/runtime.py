"""Where and how a run computes: the device, the number format, random seeds, and its processes.

    device   auto = cuda > cpu; mps (Apple's GPU) only when named, with a note: untested there
    dtype    auto = bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 elsewhere (MPS: bf16 when asked
             and supported, never fp16). Lower precision runs under autocast: weights and optimizer
             state stay fp32, matmuls run in the low format.
    TF32     on CUDA, fp32 matmuls may use TF32 tensor cores (10-bit mantissa): much faster, and the
             rounding is far below what training notices.
    world    the run's processes: one (World), or under torchrun one per device (training/distributed.py)
"""
import os
import random
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from common import ConfigError


def mps_available() -> bool:
    """Whether this machine has Apple's GPU (MPS) for torch."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def mps_has_bf16() -> bool:
    """Whether MPS computes in bfloat16 (macOS 14 and newer)."""
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps").add_(1)
    except (RuntimeError, TypeError):
        return False
    return True


_noted = set()


def note_once(text: str) -> None:
    """A note on stderr, said once per process however often the choice it explains is made."""
    if text not in _noted:
        _noted.add(text)
        print(f"note: {text}", file=sys.stderr, flush=True)


def pick_device(name: str, setting: str = "train.device") -> torch.device:
    """auto: CUDA where there is a GPU, else the CPU. MPS (Apple's GPU) only when named: nothing of this
    project is tested or measured there, and it says so."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{setting}={name!r} is not a device (auto, cpu, cuda, cuda:N, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{setting}={name!r} but CUDA is not available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{setting}={name!r} but this machine has {torch.cuda.device_count()} GPU(s)")
    if device.type == "mps" and not mps_available():
        raise ConfigError(f"{setting}={name!r} but MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{setting}={name!r}: this project runs on cpu, cuda or mps")
    if device.type == "mps":
        note_once("MPS (Apple's GPU) runs this project untested and unmeasured: float32 unless bfloat16 is "
                  "asked for, no torch.compile, and no test checks that its results match the CPU's")
    return device


def pick_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """auto: bf16 on CUDA (fp16 where the GPU lacks bf16), fp32 elsewhere, MPS included. On MPS bf16
    only where it is supported, and no fp16 (its loss scaling is not tried there)."""
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
    """The context that runs matmuls in dtype (a no-op in fp32)."""
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def use_fast_matmuls(device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def step_memory(cfg, params: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the training state, bytes of one micro-batch's activations), roughly, at a step's peak.

    state        fp32 weights, their gradients and AdamW's two moments: 16 bytes a parameter
    activations  what backward keeps, about 22 numbers of n_embd per token per layer (measured on CPU
                 in fp32 with the fused attention: 76-88 bytes x n_embd), fewer bytes in bf16/fp16;
                 the (B, nh, T, T) scores and weights where attention materializes them (naive); the
                 logits, their fp32 copy for the loss and its gradient
    Gradient accumulation frees each micro-batch's activations, so they count once."""
    m, t = cfg.model, cfg.train
    tokens, low = t.batch_size * m.block_size, dtype != torch.float32
    layers = m.n_layer * tokens * m.n_embd * (56 if low else 88)
    scores = m.n_layer * t.batch_size * m.n_head * m.block_size ** 2 * 9 if m.attention == "naive" else 0
    logits = tokens * m.vocab_size * (8 if low else 12)
    return params * 16, layers + scores + logits


def free_memory(device: torch.device) -> int | None:
    """Bytes a run can still allocate on device: the GPU's free memory, or the machine's available
    memory for the CPU; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):   # not on macOS or Windows
        return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sync(device: torch.device) -> None:
    """Wait for the device to finish what was queued (before reading a clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's (every device's) generators from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every generator's state as plain data and tensors (what a checkpoint can hold): Python's, numpy's,
    torch's CPU one, every GPU's, and MPS's (dropout on MPS draws from it)."""
    np_state = np.random.get_state()
    return {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
            "numpy": np_state[1].tolist(), "numpy_pos": int(np_state[2]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "mps": torch.mps.get_rng_state() if mps_available() else None}


def set_rng_state(s: dict) -> None:
    """Put back what rng_state() returned (a checkpoint may lack the 'mps' entry)."""
    random.setstate((s["python_version"], tuple(s["python"]), None))
    np.random.set_state(("MT19937", np.array(s["numpy"], dtype=np.uint32), s["numpy_pos"], 0, 0.0))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    if s.get("mps") is not None and mps_available():
        torch.mps.set_rng_state(s["mps"])


@dataclass
class World:
    """The run's processes as this one sees them. This class is a single process, for which every
    method is trivial; training/distributed.py's ProcessGroup is the same interface for many."""
    device: torch.device
    rank: int = 0          # 0 .. size-1 over all machines
    local_rank: int = 0    # which device on this machine
    size: int = 1
    kind: str = ""        # how the model is shared between processes ("DDP" or "FSDP"; "" alone)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints, writes metrics and saves checkpoints."""
        return self.rank == 0

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of tensor over the ranks, in place on every rank."""
        return tensor

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        return [obj]

    def on_main(self, fn):
        """fn() run on rank 0 only; every rank returns its result, or raises its error."""
        return fn()

    def local_main_first(self, fn):
        """fn() on each machine's first process, then on the others (which find its work done)."""
        return fn()

    def wrap(self, model: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
        """The module the step calls: model itself, or DDP(model) / model sharded by FSDP."""
        return model

    def no_sync(self, module: torch.nn.Module, last: bool):
        """Context of one micro-step: only the last of a step averages the gradients over the ranks."""
        return nullcontext()

    def full_state(self, model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
        """(model, optimizer) state dicts as one process holds them (FSDP gathers them on rank 0)."""
        return model.state_dict(), optimizer.state_dict()

    def load_full_state(self, model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)

    def agree_to_stop(self, requested: bool) -> bool:
        """Whether the run stops after this step: on every rank at the same step."""
        return requested

    def peer_failure(self, error: BaseException) -> str | None:
        """Whether error is the death of another process of the run, said in one line (None: it is not)."""
        return None

    def leave(self, finished: bool) -> None:
        """Leave the process group before the process ends."""

