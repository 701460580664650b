"""Nothing is lost: checkpoints are written whole or not at all, so a full disk keeps the ones
written before, and a file-size limit is named as one, not as a full disk; the last
train.keep_checkpoints and the true best stay; an out dir holding a run, or files of the names a
run writes, is refused unless --resume or --overwrite, and --overwrite keeps the earlier run whole
beside the new one (a folder a run left before its first checkpoint holds no run); a damaged
metrics.jsonl is a log to skip lines of, not a reason to stop."""
import errno
import json
import os
import subprocess
import sys

import pytest
import torch

import train as train_cli
from loading import list_checkpoints, read_checkpoint
from tests.conftest import (ROOT, assert_refused, poison, records, run_tool, tiny_overrides,
                            tree)
from training.checkpoint import link_best, why_unwritten
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


# ---------------------------------------------------------------- checkpoints

def test_the_last_k_checkpoints_and_the_true_best_are_kept(tiny_cfg, monkeypatch):
    # the best (step 8) is not the last, and rotates out of ckpt_*
    vals = iter([3.0, 2.0, 2.5, 2.7, 2.9])
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
    best = read_checkpoint(f"{cfg.out_dir}/best.pt")
    last = read_checkpoint(f"{cfg.out_dir}/ckpt_0000004.pt")
    assert best["step"] == 4
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])


def test_best_pt_linked_again_to_its_own_checkpoint_leaves_it_whole(tmp_path):
    """As a resume from the best checkpoint does: no temporary link is left behind."""
    ckpt = tmp_path / "ckpt_0000004.pt"
    size = ckpt.write_bytes(b"a checkpoint's bytes")
    link_best(ckpt)
    link_best(ckpt)
    assert os.path.samefile(tmp_path / "best.pt", ckpt) and ckpt.stat().st_size == size
    assert not (tmp_path / ".best.pt.tmp").exists()


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    # what torch.save's zip writer raises when the disk fills (a RuntimeError, not an OSError)
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048"),
], ids=["OSError", "RuntimeError"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(failure, tmp_path, text_file,
                                                                 monkeypatch, capsys):
    real_save, calls = torch.save, []

    def save_until_the_disk_fills(obj, f, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise failure
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    out = tmp_path / "out"
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and err.startswith(f"error: could not write {out / 'ckpt_0000020.pt'}: "), err
    assert len(err.splitlines()) == 1, err
    names = ["best.pt", "ckpt_0000010.pt", "config.toml", "metrics.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == names
    assert read_checkpoint(out / "ckpt_0000010.pt")["step"] == 10


def test_a_disk_that_really_fills_is_said_and_the_run_resumes_once_there_is_room(
        small_disk, tmp_path, text_file, capsys):
    # room for the tiny model's first checkpoint (~400 KB), not for a second
    disk = small_disk("600k")
    out = disk / "out"
    args = tiny_overrides(tmp_path, text_file, out_dir=out)
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.count("\n") == 1 and str(out / "ckpt_0000020.pt") in err, err
    assert "No space left on device" in err or "is the disk full?" in err, err
    # the user makes room
    subprocess.run(["mount", "-o", "remount,size=2m", str(disk)], check=True)
    rc, _, err = run_tool(train_cli, [*args, "--resume"], capsys)
    assert rc == 0, err
    assert [s for s, _ in list_checkpoints(out)] == [10, 20]


# bytes: room for the prepared tiny text and the logs, not for a checkpoint
LIMIT = 100_000
UNIX = pytest.mark.skipif(os.name != "posix", reason="a file-size limit (RLIMIT_FSIZE) is Unix's")


def limit_file_size():
    """In the child: files may grow to LIMIT bytes (as after `ulimit -f`)."""
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


@UNIX
def test_a_file_size_limit_while_saving_a_checkpoint_is_said_as_that_limit(tmp_path, text_file):
    out = tmp_path / "out"
    args = tiny_overrides(tmp_path, text_file, out_dir=out)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True,
                       text=True, preexec_fn=limit_file_size, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr == (f"error: could not write {out / 'ckpt_0000010.pt'}: it is larger than "
                        f"this process's file-size limit of {LIMIT:,} bytes (ulimit -f; "
                        f"`ulimit -f unlimited` lifts it)\n")
    assert not list(out.glob("*.pt")) and not list(out.glob(".*.tmp")), "no part of a checkpoint"


def raised(error: OSError, wrapped: bool) -> Exception:
    """error as torch.save lets it out: itself, or (wrapped) the RuntimeError of torch's zip
    writer, raised while the file's error was handled."""
    try:
        try:
            raise error
        except OSError:
            if wrapped:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
            raise
    except Exception as e:
        return e


@UNIX
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_full_disk_and_a_file_system_s_size_limit_are_told_apart(wrapped):
    import resource
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        pytest.skip("this test process has a file-size limit of its own")
    full = raised(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), wrapped)
    assert why_unwritten(full) == "No space left on device"
    too_large = raised(OSError(errno.EFBIG, os.strerror(errno.EFBIG)), wrapped)
    assert why_unwritten(too_large) == ("it is larger than its file system allows (FAT32: 4 GiB): "
                                        "write it to another one")
    unknown = RuntimeError("unexpected pos 704 vs 598")
    assert why_unwritten(unknown) == "unexpected pos 704 vs 598: is the disk full?"


# ---------------------------------------------------------------- the out dir

def test_overwrite_keeps_the_earlier_run_whole_beside_the_new_one(tmp_path, text_file, monkeypatch,
                                                                  capsys):
    """Renamed to <out_dir>.replaced-<time>, before the new run writes anything: a new run that
    fails at its second step (a non-finite loss) leaves the earlier run whole; the next --overwrite
    another."""
    out, args = tmp_path / "out", tiny_overrides(tmp_path, text_file)
    assert run_tool(train_cli, args, capsys)[0] == 0
    earlier = tree(out)
    poison(monkeypatch, {2})
    rc, stdout, err = run_tool(train_cli, [*args, "--train.max_steps=30", "--overwrite"], capsys)
    assert rc == 2 and "the loss became inf between steps 1 and 2" in err, err
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert len(kept) == 1 and f"the earlier run is kept in {kept[0]}" in stdout
    assert tree(kept[0]) == earlier, "the earlier run was lost with the failed one"
    monkeypatch.undo()
    rc, _, err = run_tool(train_cli, [*args, "--train.max_steps=30", "--overwrite"], capsys)
    assert rc == 0, err
    assert [s for s, _ in list_checkpoints(out)] == [20, 30]
    max_steps = read_checkpoint(out / "ckpt_0000020.pt")["config"]["train"]["max_steps"]
    assert max_steps == 30, "the new run's"
    assert tree(kept[0]) == earlier


def test_a_folder_holding_the_users_own_files_of_a_runs_names_is_not_trained_into(
        tmp_path, text_file, capsys):
    """An ordinary folder given as --out_dir, holding the user's own config.toml, metrics.jsonl and
    curves.png (no checkpoints): the run is refused, in one line, and every file stays as it was;
    with --overwrite the folder is kept beside the new run, whole."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.toml", "metrics.jsonl", "curves.png", "notes.txt"):
        (out / name).write_text(f"the user's own {name}")
    before = tree(out)
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert_refused(train_cli, args, capsys, out, f"error: {out} holds config.toml, curves.png, "
                   f"metrics.jsonl, which a run writes: --overwrite starts over")
    rc, _, err = run_tool(train_cli, [*args, "--overwrite"], capsys)
    assert rc == 0, err
    kept = next(p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-"))
    assert tree(kept) == before and (out / "ckpt_0000002.pt").is_file()


def test_a_refusal_says_when_the_run_in_the_out_dir_was_trained_on_other_data(tmp_path, text_file,
                                                                              capsys):
    """An out dir given twice, or texts of one name in two folders: --resume would continue that
    run on another text, which the refusal says, naming both (the same text: the plain
    refusal)."""
    def on(text):
        return run_tool(train_cli, tiny_overrides(tmp_path, text, **{"train.max_steps": 2}), capsys)

    a, b = text_file, tmp_path / "b.txt"
    b.write_text(a.read_text().upper())
    assert on(a)[0] == 0
    before = tree(tmp_path)
    rc, _, err = on(b)
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {tmp_path / 'out'} already holds a run trained on {a} (char), "
                          f"not {b} (char): python "), err
    assert "--resume would continue that run on other data; --overwrite starts over" in err, err
    rc, _, err = on(a)
    assert rc == 2 and "already holds a run: python " in err and "other data" not in err, err
    assert tree(tmp_path) == before


def test_a_run_stopped_before_its_first_checkpoint_is_started_by_the_same_command(
        tmp_path, text_file, capsys):
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


def test_a_damaged_metrics_line_is_skipped_with_a_warning_and_the_run_resumes(tmp_path, text_file,
                                                                              capsys):
    """A line cut short at the end is what a kill leaves: the resumed run writes after it.
    (Which lines are damaged: test_read_records_skips_damaged_lines_with_one_warning, in
    tests/test_plot.py.)"""
    out, args = tmp_path / "out", tiny_overrides(tmp_path, text_file, **{"train.max_steps": 10})
    assert run_tool(train_cli, args, capsys)[0] == 0
    with open(out / "metrics.jsonl", "ab") as log:
        log.write(b'{"step": 11, "kind": "tra')
    longer = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 12})
    rc, _, err = run_tool(train_cli, [*longer, "--resume"], capsys)
    assert rc == 0 and f"warning: {out / 'metrics.jsonl'}: skipped 1 damaged line(s)" in err, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s <= 12] == steps and steps.count(11) == 1 and steps[-1] == 12
