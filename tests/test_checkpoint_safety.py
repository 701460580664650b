"""Checkpoints against the machine and the file: a disk that fills during a save, and a small file
whose config claims a model far larger than its weights (the table of damaged files that end in one
line is test_bad_input.py's CASES)."""
import subprocess

import pytest

import train as train_cli
from model.loading import list_checkpoints, read_checkpoint
from tests.conftest import run_limited, run_tool, tiny_overrides
from tests.test_bad_input import damaged

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_a_small_file_claiming_a_huge_model_is_one_line(tmp_path, trained):
    """Its config says 8 layers of width 4096 (~6 GB of weights); its weights are the tiny model's. In a
    process of 2 GB, building that model runs out of memory; with more, its weights do not fit it."""
    huge = damaged(trained, tmp_path, "huge")
    rc, out, err, peak = run_limited(["sample.py", huge, "--max-new-tokens", 5, "--device", "cpu"])
    assert rc in (2, 3) and err.startswith("error: ") and err.count("\n") == 1, err


def test_a_disk_that_really_fills_during_a_save_is_one_line_and_the_run_resumes_once_there_is_room(
        small_disk, tmp_path, text_file, capsys):
    disk = small_disk("600k")   # room for the tiny model's first checkpoint (~400 KB), not for a second
    out = disk / "out"
    args = tiny_overrides(tmp_path, text_file, out_dir=out)
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.count("\n") == 1 and str(out / "ckpt_0000020.pt") in err, err
    assert "No space left on device" in err or "is the disk full?" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "ckpt_0000010.pt", "config.toml", "metrics.jsonl"]
    assert read_checkpoint(out / "ckpt_0000010.pt")["step"] == 10
    subprocess.run(["mount", "-o", "remount,size=2m", str(disk)], check=True)   # the user makes room
    rc, _, err = run_tool(train_cli, [*args, "--resume"], capsys)
    assert rc == 0, err
    assert [s for s, _ in list_checkpoints(out)] == [10, 20]
