"""The benchmarks measure what they say: the race's val set is the whole val split, the race finds
the first evaluation at the classic's loss, the FLOP count is the model's."""
import numpy as np
import pytest
import torch

from benchmarks.race import first_reaching, race, val_loss, val_windows
from benchmarks.step import flops_per_token, plain_step
from data.cache import load_meta
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import tiny_overrides
from training.config import build_config
from data.prepare import prepare


def test_race_windows_are_the_whole_val_split_in_order(tiny_cfg):
    cfg = tiny_cfg(**{"model.block_size": 8})
    dataset = prepare(cfg.data)
    meta = load_meta(dataset)
    val = np.fromfile(dataset / "val.bin", dtype=meta["dtype"])
    w = val_windows(dataset, 8)
    assert w.shape == ((len(val) - 1) // 8, 9)
    assert torch.equal(w[:, :-1].flatten(), torch.from_numpy(val[:w.size(0) * 8].astype(np.int64)))
    assert torch.equal(w[:-1, -1], w[1:, 0]), "each window's last target is the next window's first input"


def test_first_reaching_takes_the_first_evaluation_at_or_below_the_target():
    curve = [{"step": s, "val": v} for s, v in [(10, 2.5), (20, 1.9), (30, 1.8), (40, 1.7)]]
    assert first_reaching(curve, 1.8)["step"] == 30
    assert first_reaching(curve, 1.0) is None


def test_race_runs_both_configs_and_reports_the_ratio(tmp_path, text_file):
    slow = tmp_path / "slow.toml"
    slow.write_text("[train]\nlr = 1e-4\nmin_lr = 1e-5\n")
    fast = tmp_path / "fast.toml"
    fast.write_text("[train]\nlr = 1e-2\nmin_lr = 1e-3\n")
    lines = []
    result = race(str(slow), str(fast), tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30}),
                  evals=10, say=lines.append)
    assert [p["step"] for p in result["curves"]["classic"]] == list(range(3, 31, 3))
    assert result["curves"]["fast"][-1]["val"] < result["target"], "a 100x higher lr learns faster"
    assert 0 < result["ratio"] < 1.5 and any(l.startswith("ratio") for l in lines)


def test_flops_per_token_counts_every_matmul_weight_and_causal_attention():
    model = GPT(ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    dense, attn = flops_per_token(model)
    per_layer = 4 * 32 * 32 + 2 * 32 * 128          # q, k, v, proj; MLP up and down
    assert dense == 6 * (2 * per_layer + 50 * 32)    # + the LM head (tied: it is a matmul all the same)
    assert attn == 6 * 2 * 16 * 32


def test_the_plain_step_handles_every_micro_batch_of_a_step():
    """bench_train counts batch x grad_accum x block tokens per step for every row, plain PyTorch's too."""
    cfg = build_config(None, ["--model.vocab_size=50", "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=1",
                              "--model.block_size=8", "--train.batch_size=2", "--train.grad_accum=3"])
    model, step = plain_step(cfg, torch.device("cpu"))
    forwards = []
    model.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
    step()
    assert forwards == [torch.Size([2, 8])] * 3

def test_the_fast_recipe_is_judged_on_the_classic_context_length():
    classic = build_config("configs/shakespeare_char_cpu.toml", [])
    fast = build_config("configs/shakespeare_char_cpu_fast.toml", [])
    assert fast.model.block_size == classic.model.block_size, "a longer context would lower val loss by itself"
    assert fast.data.tokenizer == classic.data.tokenizer


def test_eval_iters_0_scores_every_token_of_the_split_as_the_race_does(tiny_cfg):
    """The trainer's exact evaluation (every window of the split) is the race's val loss, batched otherwise."""
    from training.checkpoint import load_model
    from training.trainer import train
    cfg = tiny_cfg(**{"train.eval_iters": 0, "train.max_steps": 4, "train.eval_interval": 4})
    summary = train(cfg, quiet=True)
    windows = val_windows(prepare(cfg.data), cfg.model.block_size)
    assert summary["val_loss"] == pytest.approx(val_loss(load_model(cfg.out_dir).model, windows, chunk=3), abs=1e-6)
