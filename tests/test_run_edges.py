"""What a user meets at the edges of a run: a stop at an unlucky instant or by SIGTERM, a warm-up
longer than the run, a finished run resumed, a branch abandoned by resuming an earlier checkpoint,
a run stopped before its first checkpoint, memory that runs out while the model is built, and
wandb that cannot start."""
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import train as train_cli
from common import run_cli
from loading import read_checkpoint
from tests.conftest import ROOT, posix_signals, records, run_limited, run_tool, tiny_overrides, tree
from training.trainer import train


def test_an_error_raised_by_a_ctrl_c_is_a_ctrl_c(capsys):
    """A SIGINT that lands while Python builds a dataclass comes out as a RuntimeError raised while
    handling the KeyboardInterrupt: it is said as a Ctrl-C, not as a traceback."""
    def main(argv):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Error calling __set_name__ on '_HAS_DEFAULT_FACTORY_CLASS'")
    assert run_cli(main, []) == 130
    assert capsys.readouterr().err == "interrupted\n"


@posix_signals
def test_sigterm_during_preparation_leaves_no_temporary_folder(tmp_path):
    """SIGTERM (kill, timeout, a scheduler) is a Ctrl-C outside the training loop: the command
    cleans up, says so in one line and exits 143."""
    text = tmp_path / "big.txt"
    text.write_text((ROOT / "data" / "tinyshakespeare.txt").read_text() * 40)
    prepared = tmp_path / "prepared"
    argv = [sys.executable, str(ROOT / "data" / "prepare.py"), str(text), "--root", str(prepared)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(prepared.glob(".*.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the preparation ended before the signal came")
    assert (proc.returncode, err) == (143, "terminated\n")
    assert not list(prepared.glob(".*")), "a temporary folder was left behind"


def test_a_warm_up_longer_than_the_run_is_said_in_the_banner(tiny_cfg, capsys):
    train(tiny_cfg(**{"train.max_steps": 4, "train.warmup_steps": 10, "train.eval_interval": 4}))
    out = capsys.readouterr().out
    assert "train.warmup_steps = 10 is not below train.max_steps = 4" in out, out
    assert "--train.warmup_steps=1" in out


def test_a_finished_run_resumed_with_fewer_steps_trains_and_changes_nothing(tiny_cfg, capsys):
    cfg = tiny_cfg(**{"train.max_steps": 6, "train.eval_interval": 3})
    train(cfg)
    before = tree(Path(cfg.out_dir))
    capsys.readouterr()
    result = train(tiny_cfg(**{"train.max_steps": 3, "train.eval_interval": 3}), resume=True)
    out = capsys.readouterr().out
    assert result["exit_code"] == 0 and result["step"] == 6
    assert "the run is at step 6, train.max_steps = 3: nothing to train, nothing changed" in out, out
    assert tree(Path(cfg.out_dir)) == before


def test_resuming_an_earlier_checkpoint_abandons_the_best_pt_of_the_later_ones(tiny_cfg, tmp_path):
    """best.pt of the abandoned later steps must not outlive them: every command that loads the
    run's best would use a model of a branch that no longer exists."""
    cfg = tiny_cfg(**{"train.max_steps": 20, "train.eval_interval": 10, "train.lr": 3e-3})
    train(cfg)
    out = tmp_path / "out"
    assert os.path.samefile(out / "best.pt", out / "ckpt_0000020.pt")
    at_10 = read_checkpoint(out / "ckpt_0000010.pt")["model"]
    argv = tiny_overrides(tmp_path, tmp_path / "tiny.txt", **{"train.max_steps": 20,
                          "train.eval_interval": 10, "train.lr": 3.0})
    assert run_cli(train_cli.main, [*argv, "--resume", str(out / "ckpt_0000010.pt")]) == 0
    best = read_checkpoint(out / "best.pt")
    # lr 3.0 ruins the model: the best of the branch that goes on is its step 10
    assert best["step"] == 10 and all(torch.equal(best["model"][k], v) for k, v in at_10.items())


def test_a_run_stopped_before_its_first_checkpoint_is_started_by_the_same_command(tmp_path, text_file,
                                                                                   capsys):
    """kill -9 (or an OOM kill) between the out dir's first write and the first checkpoint leaves
    config.toml and an empty metrics.jsonl: that folder holds no run."""
    argv = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 4, "train.eval_interval": 4})
    assert run_tool(train_cli, argv, capsys)[0] == 0
    out = tmp_path / "out"
    for path in out.glob("*.pt"):
        path.unlink()
    (out / "metrics.jsonl").write_text("")
    rc, stdout, err = run_tool(train_cli, argv, capsys)
    assert rc == 0 and "a new run" in stdout, err
    assert list(records(out)) == [1, 2, 3, 4]


def test_running_out_of_memory_while_the_model_is_built_is_one_line(tmp_path, text_file):
    """A model of 300,000 layers, built with memory for far less: whichever allocation fails first,
    Python's (a MemoryError, or a SystemError where a C function could not make one), C++'s
    (std::bad_alloc) or torch's, it is the one out-of-memory line, exit 3."""
    argv = [str(ROOT / "train.py"), *tiny_overrides(tmp_path, text_file, **{"model.n_layer": 300_000,
            "model.n_embd": 8, "model.n_head": 1})]
    rc, _, err, _ = run_limited(argv, memory=300 << 20)
    assert rc == 3 and err.startswith("error: out of memory") and err.count("\n") == 1, err


def test_wandb_that_cannot_start_leaves_the_out_dir_as_it_was(tmp_path, text_file, monkeypatch, capsys):
    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    argv = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2, "train.eval_interval": 2})
    assert run_tool(train_cli, [*argv, "--log.wandb=true"], capsys)[0] == 2
    assert not (tmp_path / "out").exists(), "a new out dir was left behind"
    assert run_tool(train_cli, argv, capsys)[0] == 0
    before = tree(tmp_path / "out")
    assert run_tool(train_cli, [*argv, "--log.wandb=true", "--overwrite"], capsys)[0] == 2
    assert tree(tmp_path / "out") == before
    assert not list(tmp_path.glob("out.replaced-*")), "the earlier run was left aside"
