"""Resuming: exactly from any step, after a kill's leftovers, only with the whole training state
and the same tokenizer, and from an out dir that holds only best.pt."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import train as train_cli
from tests.conftest import TEXT, tiny_overrides
from tests.conftest import mkdir, run_tool, write
from common import UserError
from training.checkpoint import load_checkpoint
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_resume_is_exact_from_any_step_twice_over(tmp_path, tiny_cfg):
    extra = {"model.dropout": 0.1, "train.grad_accum": 2, "train.eval_interval": 4, "train.max_steps": 12}
    train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    split = tiny_cfg(**extra, out_dir=tmp_path / "split")
    train(split, quiet=True, stop_at=5)   # not an eval step: the stop saves its own checkpoint
    train(split, quiet=True, resume=True, stop_at=9)
    rest = train(split, quiet=True, resume=True)
    assert sorted(rest["losses"]) == list(range(10, 13))
    records = {}
    for name in ("whole", "split"):
        lines = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        records[name] = [(r["step"], r["loss"], r["lr"]) for r in lines if r["kind"] == "train"]
    assert [r[0] for r in records["split"]] == list(range(1, 13)), "every step logged once"
    for (step, loss, lr), (_, loss_w, lr_w) in zip(records["split"], records["whole"], strict=True):
        assert loss == pytest.approx(loss_w, abs=1e-6) and lr == lr_w, step
    a = load_checkpoint(tmp_path / "whole" / "ckpt_0000012.pt")["model"]
    b = load_checkpoint(tmp_path / "split" / "ckpt_0000012.pt")["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_resume_cleans_up_after_a_kill(tiny_cfg):
    """What a kill -9 can leave: a half-written temp file, a torn metrics line, best.pt not yet linked."""
    cfg = tiny_cfg()
    train(cfg, quiet=True, stop_at=10)
    out_path = Path(cfg.out_dir)
    (out_path / ".ckpt_0000015.pt.tmp").write_bytes(b"PK half")
    with open(out_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "kind": "tra')
    (out_path / "best.pt").unlink()
    assert load_checkpoint(out_path / "ckpt_0000010.pt")["is_best"]
    train(cfg, quiet=True, resume=True, stop_at=10)   # no step: what resuming alone repairs
    assert os.path.samefile(out_path / "best.pt", out_path / "ckpt_0000010.pt"), "best.pt is the best again"
    summary = train(cfg, quiet=True, resume=True)
    assert summary["step"] == 20 and not list(out_path.glob(".*.tmp"))
    steps = [json.loads(l)["step"] for l in (out_path / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(11) == 1 and steps[-1] == 20
    assert (out_path / "best.pt").exists()


def test_resume_needs_the_whole_training_state_and_the_same_tokenizer(tmp_path, tiny_cfg, text_file):
    cfg = tiny_cfg(**{"model.vocab_size": 80, "train.max_steps": 2})
    train(cfg, quiet=True)
    weights_only = tmp_path / "w"
    weights_only.mkdir()
    ckpt = torch.load(f"{cfg.out_dir}/ckpt_0000002.pt", weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("optimizer", "rng_ranks")}, weights_only / "ckpt_0000002.pt")
    with pytest.raises(UserError, match="cannot be resumed from: it lacks optimizer, rng_ranks"):
        train(tiny_cfg(**{"model.vocab_size": 80}, out_dir=weights_only), resume=True, quiet=True)
    text_file.write_text(TEXT.upper())   # the same model, another vocabulary
    with pytest.raises(UserError, match="the text changed, and --resume needs the one it was trained on"):
        train(tiny_cfg(**{"model.vocab_size": 80, "train.max_steps": 4}), resume=True, quiet=True)


def test_resuming_after_the_text_gained_characters_says_the_text_changed(tmp_path, text_file, capsys):
    """Not that model.vocab_size is smaller than the tokenizer's: the user changed the text, not the model."""
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    text_file.write_text(TEXT + "Ω ☃ é\n")
    rc, _, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": 4}), "--resume"],
                          capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"was trained on a text of {len(set(TEXT))} characters" in err and "the text changed" in err, err
    assert "vocab_size" not in err, err


def test_a_new_run_removes_only_its_own_temporary_files(tiny_cfg):
    """A kill can leave this project's .<name>.tmp files; the user's own hidden files are not ours to delete."""
    cfg = tiny_cfg(**{"train.max_steps": 2, "train.eval_interval": 2})
    out = mkdir(Path(cfg.out_dir))
    ours = [write(out / f".{name}.tmp", "stale") for name in ("ckpt_0000010.pt", "best.pt", "metrics.jsonl", "config.toml")]
    theirs = [write(out / name, "mine") for name in (".notes.tmp", ".ckpt_latest.pt.tmp", "draft.tmp")]
    train(cfg, quiet=True)
    assert not any(p.exists() for p in ours)
    assert all(p.read_text() == "mine" for p in theirs)


def test_an_out_dir_holding_only_best_pt_is_resumed_as_the_refusal_says(tmp_path, text_file, trained, capsys):
    out = mkdir(tmp_path / "out")
    shutil.copy(trained / "best.pt", out / "best.pt")
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and "already holds best.pt of a run: continue it with --resume" in err, err
    rc, stdout, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": 6}), "--resume"], capsys)
    assert rc == 0 and f"resuming {out / 'best.pt'} at step 4" in stdout, err
    assert load_checkpoint(out / "ckpt_0000006.pt")["step"] == 6


def test_resume_continues_the_run_s_own_settings_naming_each_change(tmp_path, text_file, capsys):
    """A bare --resume is the run that was started (not the defaults); a changed setting is named, and
    one that changes what is computed says the run will not go on as it would have."""
    first = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 12, "train.lr": 3e-3, "train.min_lr": 3e-4})
    rc, _, err = run_tool(train_cli, [*first, "--train.eval_interval=6"], capsys)
    assert rc == 0, err
    bare = [f"--data={text_file}", f"--out_dir={tmp_path / 'out'}", f"--data.prepared_dir={tmp_path / 'prepared'}"]
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume"], capsys)   # max_steps would be 2000 by default
    assert rc == 0 and "# done: step 12" in stdout and "# resuming with" not in stdout and "note:" not in err, stdout
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume", "--train.max_steps=16", "--train.log_interval=4"], capsys)
    assert rc == 0 and "# resuming with train.max_steps: 12 -> 16" in stdout and "train.log_interval: 1 -> 4" in stdout
    assert err.startswith("note: train.max_steps, train.log_interval changed since the run began"), err
    ckpt = load_checkpoint(tmp_path / "out" / "ckpt_0000016.pt")
    assert ckpt["config"]["train"]["lr"] == 3e-3 and ckpt["config"]["model"]["n_embd"] == 32, "not the defaults"
    assert ckpt["tokens"] == 16 * 8 * 32
    rc, _, err = run_tool(train_cli, [*bare, "--resume", "--train.max_steps=18", "--train.batch_size=4"], capsys)
    assert rc == 0 and load_checkpoint(tmp_path / "out" / "ckpt_0000018.pt")["tokens"] == 16 * 8 * 32 + 2 * 4 * 32


@pytest.mark.parametrize("change, message", [
    ("--data.tokenizer=bpe:300", 'data.tokenizer: "char" in the run, "bpe:300" now'),
    ("--model.n_layer=3", "model.n_layer: 2 in the run, 3 now"),
], ids=["tokenizer", "model"])
def test_resume_with_another_tokenizer_or_model_is_refused_before_any_text_is_prepared(change, message, tmp_path,
                                                                                       text_file, capsys):
    """A mistake that --resume can tell from the run's config.toml is one line, and writes nothing: not
    even the preparation of the text for the changed setting."""
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    from tests.conftest import tree
    before = tree(tmp_path)
    rc, _, err = run_tool(train_cli, [*args, "--data.prepared_dir=" + str(tmp_path / "fresh"), change, "--resume"],
                          capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: " + message), err
    assert tree(tmp_path) == before


def test_resume_from_a_chosen_checkpoint_continues_exactly_from_it(tmp_path, text_file, capsys):
    """The refusal of a damaged latest checkpoint names the earlier one; --resume PATH continues from it,
    as the run went on from there, and the checkpoints after it go when it writes its own."""
    from training.checkpoint import list_checkpoints
    args = tiny_overrides(tmp_path, text_file, **{"train.eval_interval": 5, "train.keep_checkpoints": 4})
    assert run_tool(train_cli, args, capsys)[0] == 0
    whole = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "out" / "ckpt_0000020.pt").write_bytes(b"")   # the latest is damaged
    rc, _, err = run_tool(train_cli, [*args, "--resume"], capsys)
    assert rc == 2 and "the earlier checkpoint ckpt_0000015.pt in the same directory may be intact" in err, err
    rc, out, err = run_tool(train_cli, ["--resume", tmp_path / "out" / "ckpt_0000010.pt"], capsys)
    assert rc == 0 and "resuming" in out and "at step 10" in out, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [5, 10, 15, 20], "rewritten, from step 10 on"
    resumed = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for before, after in zip(whole, resumed, strict=True):
        assert before["step"] == after["step"] and before.get("loss") == pytest.approx(after.get("loss"), abs=1e-6)


def test_best_pt_is_never_a_checkpoint_that_a_resumed_run_replaces(tmp_path, tiny_cfg):
    """Resumed from an earlier checkpoint, best.pt stays the run's best until the resumed run writes a
    checkpoint of its own (also when it ends before that); then the later checkpoints go, and a best.pt
    that was one of them goes with them."""
    from training.checkpoint import list_checkpoints
    extra = {"train.eval_interval": 5, "train.keep_checkpoints": 4}
    train(tiny_cfg(**extra), quiet=True)
    out = tmp_path / "out"
    best, first = out / "best.pt", out / "ckpt_0000005.pt"
    later = next(p for _, p in list_checkpoints(out) if os.path.samefile(best, p))
    assert later != first, "the val loss fell after step 5"

    def ended(step, model):
        raise RuntimeError("ended before its first checkpoint")
    with pytest.raises(RuntimeError, match="ended before"):
        train(tiny_cfg(**extra), quiet=True, resume=True, checkpoint=first, on_step=ended)
    assert os.path.samefile(best, later), "best.pt was relinked to the checkpoint resumed from"
    frozen = tiny_cfg(**extra, **{"train.lr": 0, "train.min_lr": 0})   # no update: step 10 is not a new best
    train(frozen, quiet=True, resume=True, checkpoint=first, stop_at=10)
    kept = [p for _, p in list_checkpoints(out)]
    assert [p.name for p in kept] == ["ckpt_0000005.pt", "ckpt_0000010.pt"]
    assert not best.exists() or any(os.path.samefile(best, p) for p in kept), "best.pt of a replaced checkpoint"


def test_a_checkpoint_holds_the_random_state_of_the_gpu_the_run_trains_on(monkeypatch):
    """--train.device=cuda:1 in one process: the CUDA generator saved (and restored) is GPU 1's, whose
    dropout masks the run draws (torch's CUDA random state is the current GPU's). Two fake GPUs."""
    from training.checkpoint import rng_state
    from training.device import pick_device
    states, current = {0: torch.tensor([0]), 1: torch.tensor([1])}, [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(0, torch.device(d).index))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[current[0]])
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        assert pick_device("cuda:1") == torch.device("cuda:1")
    finally:   # (pick_device allows TF32 matmuls, a setting of the whole process)
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
    assert rng_state()["cuda"][0] is states[1]
