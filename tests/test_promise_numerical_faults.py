"""Numerical faults stop the run: the loss (and gradient norm) that the loop reads anyway, at each
log line and evaluation, stops the run when it is not finite, naming the steps it came between; no
checkpoint is written after it. Sampling refuses a model whose outputs are not finite."""
import pytest
import torch

import sample as sample_cli
import train as train_cli
from loading import list_checkpoints, read_checkpoint
from tests.conftest import poison, run_tool, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_a_non_finite_step_stops_the_run_naming_the_steps_it_came_between(kind, tmp_path,
                                                                          text_file, monkeypatch,
                                                                          capsys):
    """Read where the loop reads the loss anyway (a log line every 5 steps here): the run stops
    there, in one line, and no checkpoint is written after the bad step (nor at the evaluation it
    would reach)."""
    poison(monkeypatch, {13}, kind)
    args = tiny_overrides(tmp_path, text_file,
                          **{"train.log_interval": 5, "train.eval_interval": 16})
    rc, out, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "became nan between steps 10 and 15" in err and "no checkpoint was written" in err, err
    assert not list_checkpoints(tmp_path / "out")
    poison(monkeypatch, {23}, kind)
    longer = ["--overwrite", "--train.eval_interval=10", "--train.max_steps=30"]
    rc, out, err = run_tool(train_cli, [*args, *longer], capsys)
    assert rc == 2 and "between steps 20 and 25" in err, err
    assert "the checkpoint of step 20 is kept" in err, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [10, 20]
    weights = read_checkpoint(tmp_path / "out" / "ckpt_0000020.pt")["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_a_checkpoint_with_a_nan_weight_is_named_at_the_first_token_it_spoils(tmp_path, trained,
                                                                             capsys):
    """Loading does not scan the weights; sampling checks the logits, and says so in one error
    line."""
    ckpt = torch.load(trained / "ckpt_0000004.pt", weights_only=True)
    ckpt["model"]["blocks.0.mlp.up.weight"][3, 4] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save(ckpt, path)
    rc, out, err = run_tool(sample_cli, [path, "--prompt", "First", "--max-new-tokens", 5], capsys)
    assert rc == 2 and out == "First\n" and err.startswith(f"# {path} (step 4"), err
    assert err.splitlines()[1:] == [f"error: {path}: the model's logits are not finite at new "
                                    f"token 1: its weights are damaged or the model diverged"], err
