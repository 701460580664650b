"""Batches of windows (block_size + 1 tokens: x, and y shifted by one) of a prepared dataset,
on the device if it takes under a quarter of its free memory, else memory-mapped. Every rank
draws the global batch from one generator and keeps its own windows.
"""
import itertools
import os
import sys
import zlib
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from common import UserError
from data.cache import SPLITS, check_split_sizes, load_meta

# an exact evaluation's windows per split at most
EVAL_MAX_WINDOWS = 4096
# train's windows per val window in an evaluation: a sample shows overfitting
EVAL_TRAIN_SHARE = 0.125
# an evaluation batch's tokens (batch_size windows at least)
EVAL_BATCH_TOKENS = 4096
# tokens copied to the device at a time
COPY_TOKENS = 1 << 26


def strided_windows(tokens: np.ndarray, block_size: int, stride: int, batch_size: int):
    """(x, y) int64 host batches scoring every token after the first once (y = -1: context
    only): window k starts at k * stride and scores its last `stride` targets (the first: all)."""
    n = len(tokens)
    last = max(0, -(-(n - 1 - block_size) // stride))
    starts = np.arange(last + 1) * stride
    full = starts[starts + block_size < n]
    batches = (full[i:i + batch_size] for i in range(0, len(full), batch_size))
    windows = ((b, tokens[b[:, None] + np.arange(block_size + 1)]) for b in batches)
    # the last window, shorter: the text's end
    short = [(starts[-1:], tokens[starts[-1]:][None])] if len(full) < len(starts) else []
    for begin, w in itertools.chain(windows, short):
        w = torch.from_numpy(w.astype(np.int64))
        y = w[:, 1:].clone()
        # a later window's first targets, not scored
        y[torch.from_numpy(begin > 0), :block_size - stride] = -1
        yield w[:, :-1], y


def free_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device or the host (cpu), else 0."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    # Windows and macOS lack SC_AVPHYS_PAGES
    if device.type != "cpu" or "SC_AVPHYS_PAGES" not in getattr(os, "sysconf_names", {}):
        return 0
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Share(NamedTuple):
    """A step's global batch: grad_accum micro-steps of world x B windows; rank keeps B."""
    grad_accum: int = 1
    rank: int = 0
    world: int = 1


class BatchLoader:
    def __init__(self, dataset_dir: Path, block_size: int, batch_size: int, seed: int = 0,
                 device="cpu", share: Share = Share()):
        self.meta = meta = load_meta(dataset_dir)
        check_split_sizes(meta["tokens"], block_size)
        self.dataset_dir = Path(dataset_dir)
        self.vocab_size = meta["vocab_size"]
        self.block_size = block_size
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.grad_accum, self.rank, self.world = share
        self.mapped = {s: np.memmap(self.dataset_dir / f"{s}.bin", dtype=meta["dtype"],
                                    mode="r", shape=(meta["tokens"][s],)) for s in SPLITS}
        # as int32 (4 bytes a token)
        fits = 4 * sum(meta["tokens"].values()) < free_memory(self.device) / 4
        fits = torch.tensor(int(fits), device=self.device)
        # every rank alike (see the top)
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(fits, torch.distributed.ReduceOp.MIN)
        self.resident = bool(fits)
        self.splits = {s: self.copy_to_device(s) for s in SPLITS} if self.resident else self.mapped
        self.generator = torch.Generator(self.device if self.resident else "cpu").manual_seed(seed)

    def copy_to_device(self, split: str) -> torch.Tensor:
        """The split as int32 on the device (no uint16 arithmetic in torch), ids checked."""
        tokens = self.mapped[split]
        on_device = torch.empty(len(tokens), dtype=torch.int32, device=self.device)
        for i in range(0, len(tokens), COPY_TOKENS):
            part = tokens[i:i + COPY_TOKENS].astype(np.int32)
            on_device[i:i + COPY_TOKENS] = torch.from_numpy(part)
        self.check_ids(split, int(on_device.max()))
        return on_device

    def check_ids(self, split: str, top: int) -> None:
        """An id outside the vocabulary (damaged files) is a UserError, not a crash."""
        if top >= self.vocab_size:
            raise UserError(f"the prepared dataset {self.dataset_dir} holds token id {top} "
                            f"in {split}.bin, outside its vocabulary of {self.vocab_size}: "
                            f"it is damaged; delete it and prepare the data again")

    def windows(self, split: str, starts: torch.Tensor) -> torch.Tensor:
        """The windows at starts (...,): (..., T + 1) int64 on the device."""
        index = starts[..., None] + torch.arange(self.block_size + 1, device=starts.device)
        if self.resident:
            return self.splits[split][index.to(self.device)].long()
        windows = self.mapped[split][index.numpy()]
        self.check_ids(split, int(windows.max()))
        windows = torch.from_numpy(windows.astype(np.int64))
        # pinned on CUDA: the copy does not wait
        if self.device.type == "cuda":
            windows = windows.pin_memory()
        return windows.to(self.device, non_blocking=True)

    def draw(self, split: str, generator: torch.Generator, *lead: int) -> torch.Tensor:
        """This rank's B of (*lead, world, B) windows drawn from generator."""
        shape = (*lead, self.world, self.batch_size)
        high = len(self.mapped[split]) - self.block_size
        starts = torch.randint(high, shape, generator=generator, device=generator.device)
        return self.windows(split, starts[..., self.rank, :])

    def step_windows(self) -> torch.Tensor:
        """(grad_accum, B, T + 1): this rank's windows of the next step."""
        return self.draw("train", self.generator, self.grad_accum)

    def batch(self, split: str, generator: torch.Generator):
        windows = self.draw(split, generator)
        return windows[:, :-1], windows[:, 1:]

    def eval_windows(self, split: str):
        """(x, y) batches of an exact evaluation: val's first windows, train's evenly spaced."""
        T = self.block_size
        per_batch = max(self.batch_size, EVAL_BATCH_TOKENS // T)
        val = self.mapped["val"][:EVAL_MAX_WINDOWS * T + 1]
        if split == "val":
            return strided_windows(val, T, T, per_batch)
        # integers: float32 offsets of a long split could pass its end
        count = max(2, round(-(-(len(val) - 1) // T) * EVAL_TRAIN_SHARE))
        span = len(self.mapped["train"]) - T - 1
        starts = torch.arange(count) * span // (count - 1)
        windows = map(partial(self.windows, "train"), starts.split(per_batch))
        return ((w[:, :-1], w[:, 1:]) for w in windows)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "device": self.generator.device.type}

    def load_state_dict(self, state: dict) -> None:
        """The data order where the checkpoint left it (from another device: a new one)."""
        was, now = state.get("device", "cpu"), self.generator.device.type
        if was == now:
            return self.generator.set_state(state["generator"])
        self.generator.manual_seed(zlib.crc32(state["generator"].numpy().tobytes()))
        print(f"notice: the checkpoint drew its batches on {was}, this run on {now}: "
              f"they go on in another order than the uninterrupted run's", file=sys.stderr)
