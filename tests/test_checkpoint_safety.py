"""Checkpoints against the machine and the file: a disk that fills during a save, and a small file
whose config claims a model far larger than its weights (the table of damaged files that end in one
line is test_bad_input.py's CASES)."""
import subprocess

import pytest

import train as train_cli
from tests.conftest import tiny_overrides
from tests.test_bad_input import damaged
from tests.conftest import run_limited, run_tool
from common import UserError
from training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_a_small_file_claiming_a_huge_model_is_refused_before_memory_is_spent_on_it(tmp_path, trained):
    """Its config says 8 layers of width 4096 (~6 GB of weights); its weights are the tiny model's."""
    huge = damaged(trained, tmp_path, "huge")
    rc, out, err, peak = run_limited(["sample.py", huge, "--max-new-tokens", 5, "--device", "cpu"])
    assert rc == 2 and err.startswith(f"error: {huge}: its weights do not match its config: ") and err.count("\n") == 1, err
    assert "Missing key(s) in state_dict" in err or "size mismatch" in err, err
    assert peak < 1 << 30, f"peak memory {peak / 2**30:.1f} GB"


def test_a_disk_that_really_fills_during_a_save_is_one_line_and_the_run_resumes_once_there_is_room(
        small_disk, tmp_path, text_file, capsys):
    disk = small_disk("600k")   # room for the tiny model's first checkpoint (~400 KB), not for a second
    out = disk / "out"
    args = tiny_overrides(tmp_path, text_file, out_dir=out)
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: could not write the checkpoint {out / 'ckpt_0000020.pt'}: ") and "the disk is full" in err, err
    assert sorted(p.name for p in out.iterdir()) == [".lock", "best.pt", "ckpt_0000010.pt", "config.toml", "metrics.jsonl"]
    assert load_checkpoint(out / "ckpt_0000010.pt")["step"] == 10
    subprocess.run(["mount", "-o", "remount,size=2m", str(disk)], check=True)   # the user makes room
    rc, _, err = run_tool(train_cli, [*args, "--resume"], capsys)
    assert rc == 0, err
    assert [s for s, _ in list_checkpoints(out)] == [10, 20]


def test_a_damaged_latest_checkpoint_names_the_one_before_it_by_step(tmp_path):
    (tmp_path / "ckpt_9999999.pt").write_bytes(b"PK an older checkpoint")
    (tmp_path / "ckpt_10000000.pt").write_bytes(b"")   # 8 digits: after ckpt_9999999.pt, though not by name
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "ckpt_10000000.pt"
    with pytest.raises(UserError, match=r"the earlier checkpoint ckpt_9999999.pt in the same directory may be intact"):
        load_checkpoint(latest)
