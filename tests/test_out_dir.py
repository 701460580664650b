"""An out dir never loses a run: --overwrite keeps the earlier run until the new one has a checkpoint
(also across a kill -9), a failed run removes only what it created, a full disk at the first metrics
write leaves the out dir as it was and names the file, and a damaged metrics.jsonl is a log to skip
lines of, not a reason to stop."""
import json
import signal

import pytest

import train as train_cli
from tests.conftest import poison, posix_signals, run_tool, tiny_overrides, tree
from tests.test_reliability_kill import Child, step_line
from training.checkpoint import list_checkpoints, load_checkpoint
from common import UserError
from training.outdir import ASIDE, MOVING, OutDir

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def run_files(out):
    """The out dir as a tree, without the lock file (each run writes its PID into it)."""
    return {k: v for k, v in tree(out).items() if k != ".lock"}


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_a_checkpoint(tmp_path, text_file, monkeypatch,
                                                                           capsys):
    out, args = tmp_path / "out", tiny_overrides(tmp_path, text_file)
    assert run_tool(train_cli, args, capsys)[0] == 0
    earlier = run_files(out)
    assert {"best.pt", "ckpt_0000020.pt", "config.toml", "metrics.jsonl"} <= set(earlier)
    poison(monkeypatch, {2})
    rc, _, err = run_tool(train_cli, [*args, "--train.max_steps=30", "--overwrite"], capsys)
    assert rc == 2 and "non-finite loss at step 2" in err, err
    assert run_files(out) == earlier, "the earlier run was lost with the failed one"
    monkeypatch.undo()
    rc, _, err = run_tool(train_cli, [*args, "--train.max_steps=30", "--overwrite"], capsys)
    assert rc == 0, err
    assert [s for s, _ in list_checkpoints(out)] == [20, 30] and not (out / ASIDE).exists()
    assert load_checkpoint(out / "ckpt_0000020.pt")["config"]["train"]["max_steps"] == 30, "the new run's"


@posix_signals
def test_an_overwrite_killed_before_its_first_checkpoint_gives_the_earlier_run_back(tmp_path, text_file, capsys):
    out, args = tmp_path / "out", tiny_overrides(tmp_path, text_file, **{"train.max_steps": 4, "train.eval_interval": 4})
    assert run_tool(train_cli, args, capsys)[0] == 0
    child = Child(tiny_overrides(tmp_path, text_file, **{"train.max_steps": 10_000, "train.eval_interval": 5_000})
                  + ["--overwrite", "--train.grad_clip=0.5"])
    child.wait_for(step_line(2))
    assert child.kill() == -signal.SIGKILL
    assert (out / ASIDE).is_dir() and not list_checkpoints(out), "killed while the earlier run was set aside"
    rc, stdout, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": 6}), "--resume"],
                               capsys)
    assert rc == 0 and "moved back" in err and "# resuming" in stdout, err
    resumed = load_checkpoint(out / "ckpt_0000006.pt")
    assert resumed["step"] == 6 and resumed["config"]["train"]["grad_clip"] == 1.0, "the killed run's settings"
    assert load_checkpoint(out / "ckpt_0000004.pt")["step"] == 4 and not (out / ASIDE).exists()


def test_a_kill_while_an_overwrite_sets_the_earlier_run_aside_gives_all_of_it_back(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    assert run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)[0] == 0
    before = run_files(out)
    (out / MOVING).mkdir()   # killed with best.pt and the older checkpoint moved, the latest not yet
    for name in ("best.pt", "ckpt_0000010.pt"):
        (out / name).rename(out / MOVING / name)
    assert OutDir(out).check(resume=True, overwrite=False) == out / "ckpt_0000020.pt"
    assert run_files(out) == before and "moved back" in capsys.readouterr().err


def test_a_run_that_ends_in_the_out_dir_while_another_starts_there_is_not_replaced(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    starting = OutDir(out)
    assert starting.check(resume=False, overwrite=False) is None   # the out dir is free: this run may start
    assert run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)[0] == 0   # another run, whole, meanwhile
    finished = run_files(out)
    with pytest.raises(UserError, match=f"{out} now holds a run that ended while this one was starting"):
        starting.open()
    starting.abandon()
    assert run_files(out) == finished


def test_a_disk_full_at_the_first_metrics_write_is_one_line_naming_the_file_and_leaves_nothing(
        tmp_path, text_file, small_disk, capsys):
    out = small_disk("8k") / "out"   # room for .lock and config.toml, not for the first metrics record
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file, out_dir=out), capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: No space left on device ({out / 'metrics.jsonl'}): the disk is full"), err
    assert not out.exists(), "the failed run left files behind"


@pytest.mark.parametrize("damage", [b"\xff\xfe not UTF-8\n", b'{"step": "ten", "kind": "train"}\n', b'{"step": 3, "kin'],
                         ids=["bad byte", "a string for a number", "a line cut short"])
def test_a_damaged_metrics_line_is_skipped_with_a_warning_and_the_run_resumes(damage, tmp_path, text_file, capsys):
    out, args = tmp_path / "out", tiny_overrides(tmp_path, text_file, **{"train.max_steps": 10})
    assert run_tool(train_cli, args, capsys)[0] == 0
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (out / "metrics.jsonl").write_bytes(b"".join(lines[:3]) + damage + b"".join(lines[3:]))
    rc, _, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": 12}), "--resume"],
                          capsys)
    assert rc == 0 and f"warning: {out / 'metrics.jsonl'}: skipped 1 damaged line(s)" in err, err
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s <= 12] == steps and steps.count(11) == 1 and steps[-1] == 12


def test_a_folder_holding_the_users_own_files_of_a_runs_names_is_not_trained_into(tmp_path, text_file):
    """An ordinary folder given as --out_dir, holding the user's own config.toml, metrics.jsonl and
    curves.png (no checkpoints): the run is refused, in one line, and every file stays as it was; with
    --overwrite they are set aside, and come back if the run ends before its first checkpoint."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.toml", "metrics.jsonl", "curves.png", "notes.txt"):
        (out / name).write_text(f"the user's own {name}")
    before = tree(out)
    r = subprocess.run([sys.executable, "train.py", *tiny_overrides(tmp_path, text_file)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {out} holds config.toml, curves.png, metrics.jsonl, which a run writes: "
                               f"choose another --out_dir, or --overwrite"), r.stderr
    assert tree(out) == before
