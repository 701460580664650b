"""The loop learns, checkpoints round-trip, and a resumed run is the run it would have been."""
import json

import pytest
import torch

from model.gpt import GPT
from common import UserError
from model.loading import list_checkpoints, load_model, read_checkpoint
from tests.conftest import TEXT, records, resumed_copy
from training.trainer import train


def test_a_tiny_model_overfits_a_short_text(tiny_cfg, text_file):
    text_file.write_text(TEXT[:400])
    cfg = tiny_cfg(**{"model.n_embd": 64, "train.max_steps": 300, "train.lr": 1e-2, "train.min_lr": 1e-3,
                      "train.batch_size": 16, "train.eval_interval": 300, "train.log_interval": 50,
                      "train.weight_decay": 0.0, "train.warmup_steps": 5})
    train(cfg, quiet=True)
    assert records(cfg.out_dir)[300] < 0.2   # from ln(42) = 3.7; ~0.1 give or take rounding


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
    assert loaded.tokenizer.vocab_size == cfg.model.vocab_size and "(step 20, val loss " in loaded.description


def test_resume_is_exact(tmp_path, tiny_cfg):
    extra = {"model.dropout": 0.1}   # dropout too: the RNG state must resume as well
    cfg = tiny_cfg(**extra, out_dir=tmp_path / "whole")
    train(cfg, quiet=True)
    whole = records(tmp_path / "whole")
    resumed = resumed_copy(cfg, 10, tmp_path / "split")
    assert list(records(resumed)) == list(range(1, 21)), "the records after the checkpoint are logged again"
    assert records(resumed) == pytest.approx(whole, abs=1e-6)
    assert records(resumed, "eval", "val_loss") == pytest.approx(records(tmp_path / "whole", "eval", "val_loss"))


def test_out_dir_protection(tiny_cfg):
    cfg = tiny_cfg()
    with pytest.raises(UserError, match="no checkpoint"):
        train(cfg, resume=True, quiet=True)
    train(cfg, quiet=True)
    with pytest.raises(UserError, match="already holds a run"):
        train(cfg, quiet=True)
    assert train(cfg, overwrite=True, quiet=True)["step"] == 20


def test_resume_with_another_model_is_refused(tiny_cfg):
    train(tiny_cfg(), quiet=True)
    with pytest.raises(UserError, match=r"model.n_layer: 2 in the run, 3 now"):
        train(tiny_cfg(**{"model.n_layer": 3}), resume=True, quiet=True)


def test_a_run_writes_its_config_and_metrics_as_it_ran(trained):
    """config.toml loads back as the run's resolved config; every log and eval line is a metrics record."""
    from training.config import build_config
    ckpt = read_checkpoint(trained / "best.pt")
    assert build_config(str(trained / "config.toml"), []).to_dict() == ckpt["config"]
    records = [json.loads(l) for l in open(trained / "metrics.jsonl")]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert steps == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records if r["kind"] == "train")
    assert ckpt["best_val_loss"] == min(r["val_loss"] for r in evals), "best.pt is the lowest val loss recorded"
