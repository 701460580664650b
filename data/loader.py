"""Batches of random windows from memory-mapped token files.

A batch is B windows of block_size + 1 consecutive tokens at random offsets: x is the first
block_size of each, y the same shifted by one, so y[b, t] is the token that follows x[b, :t+1].
Memory and time per batch are O(B * block_size) whatever the dataset's size: only the windows
are read from disk.
"""
from pathlib import Path

import numpy as np
import torch

from data.prepare import DataError, load_meta


class BatchLoader:
    def __init__(self, dataset_dir: Path, block_size: int, batch_size: int, seed: int = 0, device="cpu"):
        meta = load_meta(dataset_dir)
        self.block_size, self.batch_size, self.device = block_size, batch_size, torch.device(device)
        self.splits = {}
        for split in ("train", "val"):
            n = meta["tokens"][split]
            if n < block_size + 1:
                raise DataError(f"the {split} split has {n} tokens, fewer than block_size + 1 = {block_size + 1}; "
                                f"use a longer text or a smaller --model.block_size")
            self.splits[split] = np.memmap(Path(dataset_dir) / f"{split}.bin", dtype=meta["dtype"], mode="r", shape=(n,))
        self.offsets = np.arange(block_size + 1)
        self.generator = torch.Generator().manual_seed(seed)   # the training data order

    def batch(self, split: str, generator: torch.Generator | None = None):
        """(x, y), each (B, T) int64 on the device; offsets drawn from generator (default: the loader's)."""
        data = self.splits[split]
        starts = torch.randint(len(data) - self.block_size, (self.batch_size,),
                               generator=generator or self.generator).numpy()
        windows = torch.from_numpy(data[starts[:, None] + self.offsets].astype(np.int64))   # (B, T+1)
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        else:
            windows = windows.to(self.device)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
