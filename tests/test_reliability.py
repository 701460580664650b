"""Checkpoints that cannot be lost or abused, failures in the middle of a run, numerical faults that
stop it cleanly, and resuming after any of them (the bad-input table: tests/test_bad_input.py)."""
import errno
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import sample as sample_cli
import train as train_cli
from common import UserError
from loading import FORMAT, VERSION, list_checkpoints, read_checkpoint
from tests.conftest import TEXT, Evil, poison, prepare_text, run_limited, run_tool, tiny_overrides, tree, write
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_holds_everything_a_resume_needs(trained):
    ckpt = read_checkpoint(trained / "ckpt_0000004.pt")
    assert ckpt["format"] == FORMAT and ckpt["version"] == VERSION and ckpt["step"] == 4 and ckpt["tokens"] == 4 * 8 * 32
    assert ckpt["config"]["model"]["vocab_size"] == len(set(TEXT)), "the resolved config, not the requested one"
    assert ckpt["tokenizer"] == {"kind": "char", "chars": "".join(sorted(set(TEXT)))}
    assert set(ckpt["rng_ranks"][0]) >= {"torch", "cuda"} and "generator" in ckpt["loader"]
    assert ckpt["optimizer"]["state"] and "scaler" in ckpt and ckpt["elapsed"] > 0
    assert ckpt["best_val_loss"] < 10


def test_the_last_k_checkpoints_and_the_true_best_are_kept(tiny_cfg, monkeypatch):
    vals = iter([3.0, 2.0, 2.5, 2.7, 2.9])   # the best (step 8) is not the last, and rotates out of ckpt_*
    monkeypatch.setattr("training.trainer.evaluate", lambda *a: {"train": 1.0, "val": next(vals)})
    cfg = tiny_cfg(**{"train.eval_interval": 4, "train.keep_checkpoints": 3})
    train(cfg, quiet=True)
    assert [s for s, _ in list_checkpoints(cfg.out_dir)] == [12, 16, 20]
    best = read_checkpoint(f"{cfg.out_dir}/best.pt")
    assert best["step"] == 8 and best["best_val_loss"] == 2.0
    assert read_checkpoint(f"{cfg.out_dir}/ckpt_0000020.pt")["best_val_loss"] == 2.0


def test_best_is_a_copy_where_hard_links_fail(tiny_cfg, monkeypatch):
    def no_links(*a):
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    cfg = tiny_cfg(**{"train.max_steps": 4, "train.eval_interval": 2, "train.keep_checkpoints": 1})
    train(cfg, quiet=True)
    best, last = read_checkpoint(f"{cfg.out_dir}/best.pt"), read_checkpoint(f"{cfg.out_dir}/ckpt_0000004.pt")
    assert best["step"] == 4 and all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])


def test_a_checkpoint_that_would_run_code_is_refused_and_does_not(tmp_path, trained, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    good = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    torch.save({**good, "config": Evil(marker)}, evil)   # a checkpoint of ours in every other way
    with pytest.raises(UserError, match=r"refused: it holds objects that could run code when loaded"):
        read_checkpoint(evil)
    rc, _, err = run_tool(sample_cli, [evil, "--max-new-tokens", "5"], capsys)
    assert rc == 2 and "refused" in err
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(evil, out / "ckpt_0000004.pt")
    text = write(tmp_path / "tiny.txt", TEXT)
    rc, _, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text, out_dir=out), "--resume"], capsys)
    assert rc == 2 and "refused" in err
    assert not marker.exists(), "the pickled payload ran"
    torch.load(evil, weights_only=False)   # the control: an unrestricted load does run it
    assert marker.exists()


# ---------------------------------------------------------------- failures in the middle of a run

@pytest.mark.parametrize("failure, message", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "error: could not write "),
    # what torch.save's zip writer raises when the disk fills (a RuntimeError, not an OSError)
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048"), "error: could not write "),
], ids=["OSError", "RuntimeError"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(failure, message, tmp_path, text_file, monkeypatch,
                                                                 capsys):
    real_save, calls = torch.save, []

    def save_until_the_disk_fills(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise failure
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and err.startswith(message) and len(err.splitlines()) == 1, err
    assert "ckpt_0000020.pt" in err, err
    out_dir = tmp_path / "out"
    assert sorted(p.name for p in out_dir.iterdir()) == ["best.pt", "ckpt_0000010.pt", "config.toml", "metrics.jsonl"]
    assert read_checkpoint(out_dir / "ckpt_0000010.pt")["step"] == 10


def test_out_of_memory_names_the_fix_and_keeps_the_checkpoint(tmp_path, text_file, monkeypatch, capsys):
    real_clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip_until_memory_runs_out(*a, **k):
        calls.append(1)
        if len(calls) == 13:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real_clip(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_until_memory_runs_out)
    rc, out, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 3 and err.startswith("error: out of memory (CUDA out of memory") and len(err.splitlines()) == 1, err
    assert "try a smaller batch, block size or model" in err, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10]
    assert read_checkpoint(tmp_path / "out" / "ckpt_0000010.pt")["step"] == 10


@pytest.mark.parametrize("tool, argv, code, message", [
    ("train.py", lambda tmp, text, ckpt: tiny_overrides(tmp, text, **{"train.batch_size": 300_000_000,
                                                                      "train.device": "cpu"}), 3,
     "error: out of memory ("),
    ("sample.py", lambda tmp, text, ckpt: [ckpt, "--num-samples", 100_000_000, "--max-new-tokens", 5, "--device", "cpu"], 3,
     "error: out of memory ("),
], ids=["train batch", "sample batch"])
def test_memory_that_runs_out_for_real_is_one_line(tool, argv, code, message, tmp_path, trained):
    """Allocations that really fail (a process limited to 2 GB of address space): a batch of 300 million
    sequences to train, 10 million samples to generate."""
    text = write(tmp_path / "tiny.txt", TEXT)
    prepare_text(text, "char", 0.1, tmp_path / "prepared")
    before = tree(tmp_path)
    rc, out, err, _ = run_limited([tool, *argv(tmp_path, text, trained / "ckpt_0000004.pt")])
    lines = [l for l in err.splitlines() if not l.startswith("# ")]   # sample.py names the checkpoint first
    assert rc == code and len(lines) == 1 and lines[0].startswith(message), err[-2000:]
    assert "smaller" in lines[0] and tree(tmp_path) == before or tool == "train.py"


# ---------------------------------------------------------------- non-finite loss or gradient

@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_a_non_finite_step_stops_the_run_naming_the_steps_it_came_between(kind, tmp_path, text_file,
                                                                          monkeypatch, capsys):
    """Read where the loop reads the loss anyway (a log line every 5 steps here): the run stops there, in
    one line, and no checkpoint is written after the bad step (nor at the evaluation it would reach)."""
    poison(monkeypatch, {13}, kind)
    args = tiny_overrides(tmp_path, text_file, **{"train.log_interval": 5, "train.eval_interval": 16})
    rc, out, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.count("\n") == 1 and "became nan between steps 10 and 15" in err, err
    assert "no checkpoint was written" in err
    assert not list_checkpoints(tmp_path / "out")
    poison(monkeypatch, {23}, kind)
    rc, out, err = run_tool(train_cli, [*args, "--overwrite", "--train.eval_interval=10", "--train.max_steps=30"],
                            capsys)
    assert rc == 2 and "between steps 20 and 25" in err and "the checkpoint of step 20 is kept" in err, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10, 20]
    weights = read_checkpoint(tmp_path / "out" / "ckpt_0000020.pt")["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_without_wandb_installed_log_wandb_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` fails
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file, **{"log.wandb": "true"}), capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: log.wandb = true but wandb did not start"), err


def test_best_pt_relinked_to_itself_leaves_no_temporary_link_and_the_checkpoint_whole(tiny_cfg):
    from training.checkpoint import link_best
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.eval_interval": 2})
    train(cfg, quiet=True)
    ckpt = Path(cfg.out_dir) / "ckpt_0000002.pt"
    size = ckpt.stat().st_size
    link_best(ckpt)   # as a resume from the best checkpoint does
    link_best(ckpt)
    assert os.path.samefile(Path(cfg.out_dir) / "best.pt", ckpt) and ckpt.stat().st_size == size
    assert not (Path(cfg.out_dir) / ".best.pt.tmp").exists()
