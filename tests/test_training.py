"""The loop learns, checkpoints round-trip, and a resumed run is the run it would have been."""
import json
from pathlib import Path

import pytest
import torch

from model.gpt import GPT
from common import UserError
from loading import list_checkpoints, load_model, read_checkpoint
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


def test_a_checkpoint_is_written_while_the_steps_go_on_and_is_on_disk_when_the_run_returns(tiny_cfg,
                                                                                          monkeypatch):
    """The state is copied to host memory at the checkpoint's step, then written by another thread: a slow
    disk holds up no step, what is written is the state of that step, and train() returns once it is on
    disk. A write that fails ends the run with its error."""
    import threading
    import time
    import training.checkpoint as trainer
    real, writers, steps_meanwhile = trainer.save_checkpoint, [], []

    def slow(ckpt, out, keep):
        writers.append(threading.current_thread() is not threading.main_thread())
        before = len(records(out))
        time.sleep(0.5)
        steps_meanwhile.append(len(records(out)) - before)
        return real(ckpt, out, keep)
    monkeypatch.setattr(trainer, "save_checkpoint", slow)
    cfg = tiny_cfg(**{"train.max_steps": 20, "train.eval_interval": 5})
    train(cfg, quiet=True)
    assert writers == [True] * 4 and max(steps_meanwhile) > 0, "steps ran while a checkpoint was written"
    assert [s for s, _ in list_checkpoints(cfg.out_dir)] == [15, 20]
    assert read_checkpoint(f"{cfg.out_dir}/ckpt_0000015.pt")["step"] == 15
    resumed = resumed_copy(cfg, 15, Path(cfg.out_dir).parent / "resumed")
    assert records(resumed) == pytest.approx(records(cfg.out_dir), abs=1e-6), "the state of its own step"

    def failing(ckpt, out, keep):
        raise UserError("could not write the checkpoint: is the disk full?")
    monkeypatch.setattr(trainer, "save_checkpoint", failing)
    with pytest.raises(UserError, match="is the disk full"):
        train(tiny_cfg(out_dir=Path(cfg.out_dir).parent / "failing"), quiet=True)
