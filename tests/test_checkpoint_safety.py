"""Checkpoints against the machine: a disk that fills during a save (the table of damaged files that
end in one line is test_bad_input.py's CASES)."""
import subprocess

import pytest

import train as train_cli
from loading import list_checkpoints, read_checkpoint
from tests.conftest import run_tool, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


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
