"""The loop learns, checkpoints round-trip, and a resumed run is the run it would have been."""
import json

import pytest
import torch

from model.gpt import GPT
from tests.conftest import TEXT
from common import CheckpointError, RunError
from training.checkpoint import list_checkpoints, load_checkpoint, load_model
from training.trainer import train


def test_a_tiny_model_overfits_a_short_text(tiny_cfg, text_file):
    text_file.write_text(TEXT[:400])
    cfg = tiny_cfg(**{"model.n_embd": 64, "train.max_steps": 300, "train.lr": 1e-2, "train.min_lr": 1e-3,
                      "train.batch_size": 16, "train.eval_interval": 300, "train.log_interval": 50,
                      "train.weight_decay": 0.0})
    summary = train(cfg, quiet=True)
    assert summary["losses"][300] < 0.2, summary["losses"]   # from ln(42) = 3.7; ~0.1 give or take rounding


def test_save_then_load_gives_identical_logits(tiny_cfg):
    cfg = tiny_cfg()
    train(cfg, quiet=True)
    path = list_checkpoints(cfg.out_dir)[-1][1]
    loaded = load_model(path)   # as sample.py and export.py read it
    live = GPT(cfg.model).eval()
    live.load_state_dict(torch.load(path, weights_only=True)["model"])
    idx = torch.randint(0, cfg.model.vocab_size, (2, 32))
    a, _ = loaded.model(idx, all_logits=True)
    b, _ = live(idx, all_logits=True)
    assert torch.equal(a, b)
    assert loaded.tokenizer.vocab_size == cfg.model.vocab_size and loaded.step == 20


def test_resume_is_exact(tmp_path, tiny_cfg):
    extra = {"model.dropout": 0.1}   # dropout too: the RNG state must resume as well
    whole = train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    first = train(tiny_cfg(**extra, out_dir=tmp_path / "split"), quiet=True, stop_at=10)
    assert first["step"] == 10 and sorted(first["losses"]) == list(range(1, 11))
    rest = train(tiny_cfg(**extra, out_dir=tmp_path / "split"), quiet=True, resume=True)
    assert sorted(rest["losses"]) == list(range(11, 21))
    for step in range(11, 21):
        assert rest["losses"][step] == pytest.approx(whole["losses"][step], abs=1e-6), step
    assert rest["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-6)
    lines = [json.loads(l) for l in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, 21))


def test_out_dir_protection(tiny_cfg):
    cfg = tiny_cfg()
    with pytest.raises(RunError, match="no checkpoint"):
        train(cfg, resume=True, quiet=True)
    train(cfg, quiet=True)
    with pytest.raises(RunError, match="already holds checkpoints"):
        train(cfg, quiet=True)
    assert train(cfg, overwrite=True, quiet=True)["step"] == 20


def test_resume_with_another_model_is_refused(tiny_cfg):
    train(tiny_cfg(), quiet=True)
    with pytest.raises(CheckpointError, match=r"model.n_layer: 2 in the checkpoint, 3 now"):
        train(tiny_cfg(**{"model.n_layer": 3}), resume=True, quiet=True)


def test_metrics_and_config_are_written(tiny_cfg):
    cfg = tiny_cfg()
    train(cfg, quiet=True)
    out = cfg.out_dir
    records = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    assert {"step", "loss", "lr", "ms_per_step", "tokens_per_s"} <= set(records[0])
    assert any(r["kind"] == "eval" and "val_loss" in r for r in records)
    assert "n_layer = 2" in open(f"{out}/config.toml").read()
    ckpt = load_checkpoint(f"{out}/best.pt")
    assert ckpt["config"]["model"]["n_layer"] == 2 and ckpt["best_val_loss"] < 10
