"""Kernels per transformer block of a config's training step on a CPU (torch.profiler): a
2-block model's forward and backward minus a 1-block model's (docs/benchmarks/cpu.md). A
kernel: an aten op that does work of its own (no view, and no op under it that does).
"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model.device import dtype_name  # noqa: E402
from model.gpt import GPT  # noqa: E402
from training.config import build_config  # noqa: E402

VIEWS = {"aten::" + name for name in """view _unsafe_view reshape _reshape_alias transpose t
    permute expand as_strided unsqueeze squeeze slice select narrow split split_with_sizes chunk
    unbind alias detach view_as contiguous to type_as lift_fresh resolve_conj resolve_neg
    result_type empty empty_like empty_strided dropout""".split()}


def works(event) -> bool:
    children = (c for c in event.cpu_children if c.name.startswith("aten::"))
    return event.name not in VIEWS and not any(works(c) for c in children)


def kernels(cfg, n_layer: int, dtype) -> int:
    cfg.model.n_layer, cfg.model.dropout = n_layer, 0.0
    cfg.model.vocab_size = cfg.model.vocab_size or 65
    torch.manual_seed(0)
    model = GPT(cfg.model)
    idx = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.block_size))

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            model(idx, idx)[1].backward()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.name.startswith("aten::") and works(e) for e in prof.events())


def main(argv: list[str]) -> None:
    cfg = build_config(argv[0], argv[1:])
    print(f"# {argv[0]}: {cfg.model.n_embd} wide, block {cfg.model.block_size}, batch "
          f"{cfg.train.batch_size} | torch {torch.__version__}")
    for dtype in (torch.float32, torch.bfloat16):
        for levers in ("as set", "learned positions, no QK-norm"):
            cfg = build_config(argv[0], argv[1:])
            if levers != "as set":
                cfg.model.pos, cfg.model.qk_norm = "learned", False
            count = kernels(cfg, 2, dtype) - kernels(cfg, 1, dtype)
            print(f"{dtype_name(dtype):9s} {levers:30s} {count:4d} kernels a block")


if __name__ == "__main__":
    main(sys.argv[1:])
