"""Batches of windows from memory-mapped token files.

A window is block_size + 1 consecutive tokens: x is its first block_size, y the same shifted by one,
so y[b, t] is the token that follows x[b, :t+1]. Training draws windows at random offsets; memory and
time per batch are O(B * block_size) whatever the dataset's size, since only the windows are read
from disk. On CUDA a step's windows are copied through pinned memory, asynchronously.

Many processes (torch.distributed): every rank holds the same generator and, each optimizer step,
draws the offsets of the whole global batch, world x grad_accum x B windows (a few KB of integers),
then keeps only its own B windows per micro-step. So which windows a step trains on depends only on
the global batch size: 1 process with batch 2B, 1 process with batch B and 2 accumulation steps, and
2 processes with batch B each see exactly the same data (the tests check that they end with the same
weights), and rank 0's generator state in a checkpoint resumes any world size. Seeding each rank
differently would give each its windows too, but runs could then not be compared across world sizes.
"""
from pathlib import Path

import numpy as np
import torch

from common import UserError
from data.prepare import SPLITS, check_split_sizes, load_meta


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


class BatchLoader:
    def __init__(self, dataset_dir: Path, block_size: int, batch_size: int, seed: int = 0, device="cpu",
                 grad_accum: int = 1, rank: int = 0, world: int = 1):
        meta = load_meta(dataset_dir)   # checked: a damaged dataset is a UserError naming it
        check_split_sizes(meta["tokens"], block_size)
        self.dataset_dir, self.meta, self.vocab_size = Path(dataset_dir), meta, meta["vocab_size"]
        self.block_size, self.batch_size, self.device = block_size, batch_size, torch.device(device)
        self.grad_accum, self.rank, self.world = grad_accum, rank, world
        self.splits = {split: np.memmap(self.dataset_dir / f"{split}.bin", dtype=meta["dtype"], mode="r",
                                        shape=(meta["tokens"][split],)) for split in SPLITS}
        self.offsets = np.arange(block_size + 1)
        self.generator = torch.Generator().manual_seed(seed)   # the training data order

    def _draw(self, split: str, generator: torch.Generator, *lead: int) -> torch.Tensor:
        """This rank's B of (*lead, world, B) windows of block_size + 1 tokens at offsets drawn from
        generator: a host tensor (*lead, B, T + 1). A token id outside the vocabulary is a UserError
        before the embedding fails on it: the files were damaged after the cache checked them (from
        meta.json and file sizes)."""
        shape = (*lead, self.world, self.batch_size)
        starts = torch.randint(len(self.splits[split]) - self.block_size, shape, generator=generator).numpy()
        tokens = self.splits[split][starts[..., self.rank, :, None] + self.offsets]
        if (top := int(tokens.max())) >= self.vocab_size:
            raise UserError(f"the prepared dataset {self.dataset_dir} holds token id {top} in {split}.bin, "
                            f"outside its vocabulary of {self.vocab_size}: it is damaged; delete it and "
                            f"prepare the data again")
        return torch.from_numpy(tokens.astype(np.int64))

    def step_windows(self) -> torch.Tensor:
        """This rank's training windows of the next optimizer step, (grad_accum, B, T + 1) on the host,
        pinned on CUDA so that copying them to the device does not wait."""
        windows = self._draw("train", self.generator, self.grad_accum)
        return windows.pin_memory() if self.device.type == "cuda" else windows

    def batch(self, split: str, generator: torch.Generator):
        """(x, y) on the device: this rank's B of world x B windows drawn from generator."""
        windows = self._draw(split, generator)   # (pinned on CUDA: the copy does not wait for queued work)
        windows = windows.pin_memory() if self.device.type == "cuda" else windows
        windows = windows.to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
