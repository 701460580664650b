"""Resuming: exactly from any step, after a kill's leftovers, only with the whole training state
and the same tokenizer, and from an out dir that holds only best.pt."""
import json
import os
import shutil

import pytest
import torch

import train as train_cli
from common import UserError
from loading import list_checkpoints, read_checkpoint
from tests.conftest import TEXT, interrupt_at, mkdir, records, run_tool, tiny_overrides, tree
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_resume_is_exact_from_any_step_twice_over(tmp_path, tiny_cfg, monkeypatch):
    """Ctrl-C at step 5 and again at step 9 (not evaluation steps: each stop saves its own checkpoint);
    every later loss, learning rate and the final weights are the uninterrupted run's."""
    extra = {"model.dropout": 0.1, "train.grad_accum": 2, "train.eval_interval": 4, "train.max_steps": 12}
    train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    split = tiny_cfg(**extra, out_dir=tmp_path / "split")
    interrupt_at(monkeypatch, 5)
    assert train(split, quiet=True)["exit_code"] == 130
    interrupt_at(monkeypatch, 4)   # the resumed run's 4th step: step 9
    assert train(split, quiet=True, resume=True)["step"] == 9
    monkeypatch.undo()
    assert train(split, quiet=True, resume=True)["step"] == 12
    assert list(records(tmp_path / "split")) == list(range(1, 13)), "every step logged once"
    assert records(tmp_path / "split") == pytest.approx(records(tmp_path / "whole"), abs=1e-6)
    assert records(tmp_path / "split", key="lr") == records(tmp_path / "whole", key="lr")
    a = read_checkpoint(tmp_path / "whole" / "ckpt_0000012.pt")["model"]
    b = read_checkpoint(tmp_path / "split" / "ckpt_0000012.pt")["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_resume_repairs_what_a_kill_leaves(tiny_cfg):
    """What a kill -9 can leave: a torn metrics line, best.pt not yet linked to the latest checkpoint."""
    cfg = tiny_cfg(**{"train.max_steps": 10})
    train(cfg, quiet=True)
    out = tmp = cfg.out_dir
    with open(f"{out}/metrics.jsonl", "a") as f:
        f.write('{"step": 11, "kind": "tra')
    os.unlink(f"{tmp}/best.pt")
    assert read_checkpoint(f"{out}/ckpt_0000010.pt")["is_best"]
    cfg.train.max_steps = 20
    assert train(cfg, quiet=True, resume=True)["step"] == 20
    steps = [json.loads(line)["step"] for line in open(f"{out}/metrics.jsonl")]
    assert steps.count(11) == 1 and steps[-1] == 20
    assert os.path.exists(f"{out}/best.pt")


def test_resume_needs_the_whole_training_state_and_the_same_text(tmp_path, tiny_cfg, text_file):
    cfg = tiny_cfg(**{"model.vocab_size": 80, "train.max_steps": 2})
    train(cfg, quiet=True)
    weights_only = mkdir(tmp_path / "w")
    ckpt = torch.load(f"{cfg.out_dir}/ckpt_0000002.pt", weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("optimizer", "rng_ranks")}, weights_only / "ckpt_0000002.pt")
    with pytest.raises(UserError, match="cannot be resumed from: it lacks optimizer, rng_ranks"):
        train(tiny_cfg(**{"model.vocab_size": 80}, out_dir=weights_only), resume=True, quiet=True)
    text_file.write_text(TEXT.upper())   # the same model, another vocabulary
    with pytest.raises(UserError, match="the text changed, and --resume needs the one it was trained on"):
        train(tiny_cfg(**{"model.vocab_size": 80, "train.max_steps": 4}), resume=True, quiet=True)


def test_an_out_dir_holding_only_best_pt_is_resumed_as_the_refusal_says(tmp_path, text_file, trained, capsys):
    out = mkdir(tmp_path / "out")
    shutil.copy(trained / "best.pt", out / "best.pt")
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and "already holds a run: python " in err and " --resume continues it" in err, err
    rc, stdout, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": 6}), "--resume"],
                               capsys)
    assert rc == 0 and f"resuming {out / 'best.pt'} at step 4" in stdout, err
    assert read_checkpoint(out / "ckpt_0000006.pt")["step"] == 6


def test_resume_continues_the_run_s_own_settings_naming_each_change(tmp_path, text_file, capsys):
    """A bare --resume is the run that was started (not the defaults); a changed setting is named."""
    first = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 12, "train.lr": 3e-3, "train.min_lr": 3e-4})
    rc, _, err = run_tool(train_cli, [*first, "--train.eval_interval=6"], capsys)
    assert rc == 0, err
    bare = [f"--data={text_file}", f"--out_dir={tmp_path / 'out'}", f"--data.prepared_dir={tmp_path / 'prepared'}"]
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume"], capsys)   # max_steps would be 2000 by default
    assert rc == 0 and "at step 12, train.max_steps = 12: nothing to train" in stdout, stdout
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume", "--train.max_steps=16", "--train.log_interval=4"], capsys)
    assert rc == 0 and "# resuming with train.max_steps: 12 -> 16" in stdout and "train.log_interval: 1 -> 4" in stdout
    ckpt = read_checkpoint(tmp_path / "out" / "ckpt_0000016.pt")
    assert ckpt["config"]["train"]["lr"] == 3e-3 and ckpt["config"]["model"]["n_embd"] == 32, "not the defaults"
    assert ckpt["tokens"] == 16 * 8 * 32
    rc, _, err = run_tool(train_cli, [*bare, "--resume", "--train.max_steps=18", "--train.batch_size=4"], capsys)
    assert rc == 0 and read_checkpoint(tmp_path / "out" / "ckpt_0000018.pt")["tokens"] == 16 * 8 * 32 + 2 * 4 * 32


@pytest.mark.parametrize("change, message", [
    ("--data.tokenizer=bpe:300", 'data.tokenizer: "char" in the run, "bpe:300" now'),
    ("--model.n_layer=3", "model.n_layer: 2 in the run, 3 now"),
], ids=["tokenizer", "model"])
def test_resume_with_another_tokenizer_or_model_is_refused_before_any_text_is_prepared(change, message, tmp_path,
                                                                                       text_file, capsys):
    """A mistake that --resume can tell from the run's checkpoint is one line, and writes nothing: not
    even the preparation of the text for the changed setting."""
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    before = tree(tmp_path)
    rc, _, err = run_tool(train_cli, [*args, "--data.prepared_dir=" + str(tmp_path / "fresh"), change, "--resume"],
                          capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: " + message), err
    assert tree(tmp_path) == before


def test_resume_from_a_chosen_checkpoint_continues_exactly_from_it(tmp_path, text_file, capsys):
    """A damaged latest checkpoint is named in one line; --resume PATH continues from an earlier one, as
    the run went on from there, and the checkpoints after it go when it writes its own."""
    args = tiny_overrides(tmp_path, text_file, **{"train.eval_interval": 5, "train.keep_checkpoints": 4})
    assert run_tool(train_cli, args, capsys)[0] == 0
    whole = records(tmp_path / "out")
    (tmp_path / "out" / "ckpt_0000020.pt").write_bytes(b"")   # the latest is damaged
    rc, _, err = run_tool(train_cli, [*args, "--resume"], capsys)
    assert rc == 2 and "ckpt_0000020.pt is not a readable checkpoint" in err and err.count("\n") == 1, err
    rc, out, err = run_tool(train_cli, ["--resume", tmp_path / "out" / "ckpt_0000010.pt"], capsys)
    assert rc == 0 and "resuming" in out and "at step 10" in out, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [5, 10, 15, 20], "rewritten, from step 10 on"
    assert records(tmp_path / "out") == pytest.approx(whole, abs=1e-6)


def test_best_pt_is_never_a_checkpoint_that_a_resumed_run_replaces(tmp_path, tiny_cfg, monkeypatch):
    """Resumed from an earlier checkpoint, best.pt stays the run's best until the resumed run writes a
    checkpoint of its own; then the later checkpoints go, and a best.pt that was one of them goes too."""
    extra = {"train.eval_interval": 5, "train.keep_checkpoints": 4}
    train(tiny_cfg(**extra), quiet=True)
    out = tmp_path / "out"
    best, first = out / "best.pt", out / "ckpt_0000005.pt"
    later = next(p for _, p in list_checkpoints(out) if os.path.samefile(best, p))
    assert later != first, "the val loss fell after step 5"
    interrupt_at(monkeypatch, 5)   # stopped at step 10, before an evaluation of its own
    assert train(tiny_cfg(**extra), quiet=True, resume=True, checkpoint=first)["step"] == 10
    kept = [p for _, p in list_checkpoints(out)]
    assert [p.name for p in kept] == ["ckpt_0000005.pt", "ckpt_0000010.pt"]
    assert not best.exists() or any(os.path.samefile(best, p) for p in kept), "best.pt of a replaced checkpoint"


def test_a_setting_changed_on_resume_is_the_one_that_trains(tmp_path, text_file, capsys):
    """--train.lr changed on --resume is named, and is the learning rate the optimizer uses from then on
    (the checkpoint's optimizer state does not bring the old one back)."""
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 10, "train.min_lr": 1e-5})
    assert run_tool(train_cli, args, capsys)[0] == 0
    rc, out, _ = run_tool(train_cli, [*args, "--train.max_steps=12", "--train.lr=1e-4", "--resume"], capsys)
    assert rc == 0 and "# resuming with train.lr: 0.001 -> 0.0001" in out
    ckpt = read_checkpoint(tmp_path / "out" / "ckpt_0000012.pt")
    lrs = [g["lr"] for g in ckpt["optimizer"]["param_groups"]]
    assert lrs and all(lr == pytest.approx(records(tmp_path / "out", key="lr")[12]) for lr in lrs)
    assert all(lr <= 1e-4 for lr in lrs), lrs


def test_a_stop_at_an_evaluation_step_still_evaluates_it(tmp_path, tiny_cfg, monkeypatch):
    cfg = tiny_cfg()
    interrupt_at(monkeypatch, 10)   # eval_interval 10: the stop lands on an evaluation step
    assert train(cfg, quiet=True)["exit_code"] == 130
    assert list(records(cfg.out_dir, "eval", "val_loss")) == [10]


def test_resume_takes_a_run_s_folder_too(tmp_path, text_file, capsys):
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 4})
    assert run_tool(train_cli, args, capsys)[0] == 0
    rc, out, err = run_tool(train_cli, ["--resume", tmp_path / "out", "--train.max_steps=6"], capsys)
    assert rc == 0 and "resuming" in out and "at step 4" in out, err
