"""Batches of windows of a prepared dataset, drawn where the model runs.

A window is block_size + 1 consecutive tokens: x is its first block_size, y the same shifted by one,
so y[b, t] is the token that follows x[b, :t+1]. Training draws windows at random offsets.

A dataset under a quarter of the device's free memory is copied there, and each step's offsets are
drawn there by the device's own generator: a step needs nothing from the host, and a CUDA graph holds
the draw with the step. A larger one stays memory-mapped: a step reads only its windows.

Many processes (torch.distributed): every rank draws the offsets of the whole global batch from the
same generator and keeps its own B windows per micro-step, so the windows a step trains on depend
only on the global batch size (the tests check that 1 and 2 processes end with the same weights).
"""
import os
import sys
import zlib
from functools import partial
from pathlib import Path

import numpy as np
import torch

from common import UserError
from data.prepare import SPLITS, check_split_sizes, load_meta

EVAL_MAX_WINDOWS = 4096       # an exact evaluation's windows per split at most (bounded cost, any corpus)
# train's windows in an evaluation, per val window: the train column is a check on overfitting,
# which a fixed sample shows as well as the whole split, at a fraction of the cost
EVAL_TRAIN_SHARE = 0.25
EVAL_BATCH_TOKENS = 4096      # an evaluation batch: this many tokens (at least batch_size windows)
COPY_TOKENS = 1 << 26         # tokens copied to the device at a time


def strided_windows(tokens: np.ndarray, block_size: int, stride: int, batch_size: int):
    """(x, y) int64 host tensors of at most batch_size windows each, in which every token after the
    first is a scored target exactly once (y = -1 marks a target that is context only).

    Window k holds tokens[k * stride : k * stride + block_size + 1]. The first window scores all its
    targets, each later one only its last `stride` (those after the previous window's last): so every
    token scored after the first window has at least block_size - stride + 1 tokens of context. The
    last window, the one that reaches the last token, may be shorter and comes in a batch of its own.
    With stride = block_size no target is context only."""
    n, context = len(tokens), block_size - stride   # context: a later window's first targets, not scored
    last = max(0, -(-(n - 1 - block_size) // stride))   # the index of the window that reaches the last token
    starts = np.arange(last + 1) * stride
    full = starts[starts + block_size < n]             # the windows with all block_size + 1 tokens
    for i in range(0, len(full), batch_size):
        begin = full[i:i + batch_size]
        w = torch.from_numpy(tokens[begin[:, None] + np.arange(block_size + 1)].astype(np.int64))
        y = w[:, 1:].clone()
        y[torch.from_numpy(begin > 0), :context] = -1
        yield w[:, :-1], y
    if len(full) < len(starts):                        # the last window, shorter than block_size
        w = torch.from_numpy(tokens[starts[-1]:].astype(np.int64))[None]
        y = w[:, 1:].clone()
        y[:, :context if starts[-1] > 0 else 0] = -1
        yield w[:, :-1], y


def free_memory(device: torch.device) -> int:
    """Bytes free on the device: CUDA's count, the host's available memory for the CPU, else 0."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    names = ("SC_AVPHYS_PAGES", "SC_PAGE_SIZE")   # (POSIX's; Windows and macOS lack the first)
    return os.sysconf(names[0]) * os.sysconf(names[1]) if device.type == "cpu" and \
        set(names) <= set(getattr(os, "sysconf_names", {})) else 0


class BatchLoader:
    def __init__(self, dataset_dir: Path, block_size: int, batch_size: int, seed: int = 0, device="cpu",
                 grad_accum: int = 1, rank: int = 0, world: int = 1):
        meta = load_meta(dataset_dir)   # checked: a damaged dataset is a UserError naming it
        check_split_sizes(meta["tokens"], block_size)
        self.dataset_dir, self.meta, self.vocab_size = Path(dataset_dir), meta, meta["vocab_size"]
        self.block_size, self.batch_size, self.device = block_size, batch_size, torch.device(device)
        self.grad_accum, self.rank, self.world = grad_accum, rank, world
        self.mapped = {split: np.memmap(self.dataset_dir / f"{split}.bin", dtype=meta["dtype"], mode="r",
                                        shape=(meta["tokens"][split],)) for split in SPLITS}
        int32_bytes = 4 * sum(meta["tokens"].values())
        fits = torch.tensor(int(int32_bytes < free_memory(self.device) / 4), device=self.device)
        if world > 1 and torch.distributed.is_initialized():   # every rank alike: one draw, the global batch
            torch.distributed.all_reduce(fits, torch.distributed.ReduceOp.MIN)
        self.resident, self.splits = bool(fits), dict(self.mapped)
        for split, tokens in self.splits.items() if self.resident else ():   # (torch: no uint16 arithmetic)
            self.splits[split] = on_device = torch.empty(len(tokens), dtype=torch.int32, device=self.device)
            for i in range(0, len(tokens), COPY_TOKENS):   # a part at a time: little host memory
                on_device[i:i + COPY_TOKENS] = torch.from_numpy(tokens[i:i + COPY_TOKENS].astype(np.int32))
            self.check_ids(split, int(self.splits[split].max()))   # once
        self.generator = torch.Generator(self.device if self.resident else "cpu").manual_seed(seed)

    def check_ids(self, split: str, top: int) -> None:
        """A token id outside the vocabulary is a UserError before the embedding fails on it: the files
        were damaged after the cache checked them (from meta.json and file sizes)."""
        if top >= self.vocab_size:
            raise UserError(f"the prepared dataset {self.dataset_dir} holds token id {top} in {split}.bin, "
                            f"outside its vocabulary of {self.vocab_size}: it is damaged; delete it and "
                            f"prepare the data again")

    def windows(self, split: str, starts: torch.Tensor) -> torch.Tensor:
        """The windows of block_size + 1 tokens at starts (...,): (..., T + 1) int64 on the device."""
        index = starts[..., None] + torch.arange(self.block_size + 1, device=starts.device)
        if self.resident:
            return self.splits[split][index.to(self.device)].long()
        windows = self.mapped[split][index.numpy()]
        self.check_ids(split, int(windows.max()))
        windows = torch.from_numpy(windows.astype(np.int64))   # (pinned on CUDA: the copy does not wait)
        windows = windows.pin_memory() if self.device.type == "cuda" else windows
        return windows.to(self.device, non_blocking=True)

    def draw(self, split: str, generator: torch.Generator, *lead: int) -> torch.Tensor:
        """This rank's B of (*lead, world, B) windows at offsets drawn from generator: (*lead, B, T + 1)."""
        shape, high = (*lead, self.world, self.batch_size), len(self.mapped[split]) - self.block_size
        return self.windows(split, torch.randint(high, shape, generator=generator, device=generator.device)
                            [..., self.rank, :])

    def step_windows(self) -> torch.Tensor:
        """This rank's windows of the next optimizer step, (grad_accum, B, T + 1) on the device."""
        return self.draw("train", self.generator, self.grad_accum)

    def batch(self, split: str, generator: torch.Generator):
        """(x, y): this rank's B of world x B windows at offsets from generator (a CPU one: any device)."""
        windows = self.draw(split, generator)
        return windows[:, :-1], windows[:, 1:]

    def eval_windows(self, split: str):
        """(x, y) batches that an exact evaluation scores: val's consecutive windows, each token a target
        once (of its first EVAL_MAX_WINDOWS windows); train's, a quarter as many at evenly spaced
        offsets."""
        T, per_batch = self.block_size, max(self.batch_size, EVAL_BATCH_TOKENS // self.block_size)
        val = self.mapped["val"][:EVAL_MAX_WINDOWS * T + 1]
        if split == "val":
            return strided_windows(val, T, T, per_batch)
        # (integers: float32 offsets of a long split could pass its end)
        count = max(1, round(-(-(len(val) - 1) // T) * EVAL_TRAIN_SHARE))
        starts = torch.arange(count) * (len(self.mapped["train"]) - T - 1) // max(count - 1, 1)
        return ((w[:, :-1], w[:, 1:]) for w in map(partial(self.windows, "train"), starts.split(per_batch)))

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "device": self.generator.device.type}

    def load_state_dict(self, state: dict) -> None:
        """The data order where the checkpoint left it; a generator of another kind (the data on the device
        then, memory-mapped now, or the reverse) cannot take its state: a new order, seeded from it."""
        if state.get("device", "cpu") == self.generator.device.type:
            return self.generator.set_state(state["generator"])
        self.generator.manual_seed(zlib.crc32(state["generator"].numpy().tobytes()))
        print(f"notice: the checkpoint drew its batches on {state.get('device', 'cpu')}, this run on "
              f"{self.generator.device.type}: they go on in another order than the uninterrupted run's",
              file=sys.stderr)
