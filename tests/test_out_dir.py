"""An out dir never loses a run: a folder holding a run, or files of the names a run writes, is
refused (in one line, writing nothing) unless --resume or --overwrite; --overwrite renames the folder
beside it before the new run's first write, so the earlier run is whole whatever the new one does; a
damaged metrics.jsonl is a log to skip lines of, not a reason to stop."""
import json
import shlex
from pathlib import Path

import pytest

import sample as sample_cli
import train as train_cli
from loading import list_checkpoints, read_checkpoint
from tests.conftest import ROOT, interrupt_at, poison, run_tool, tiny_overrides, tree

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_a_folder_holding_a_run_is_refused_unless_resume_or_overwrite(tmp_path, text_file, capsys):
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 4})
    assert run_tool(train_cli, args, capsys)[0] == 0
    before = tree(tmp_path)
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err.count("\n") == 1 and "--resume continues it, --overwrite starts over" in err, err
    rc, _, err = run_tool(train_cli, [*args, "--resume", "--overwrite"], capsys)
    assert rc == 2 and "--resume and --overwrite contradict each other" in err, err
    assert tree(tmp_path) == before


def test_overwrite_keeps_the_earlier_run_whole_beside_the_new_one(tmp_path, text_file, monkeypatch, capsys):
    """Renamed to <out_dir>.replaced-<time>, before the new run writes anything: a new run that fails at
    its second step (a non-finite loss) leaves the earlier run whole; the next --overwrite another."""
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
    assert read_checkpoint(out / "ckpt_0000020.pt")["config"]["train"]["max_steps"] == 30, "the new run's"
    assert tree(kept[0]) == earlier


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
    --overwrite the folder is kept beside the new run, whole."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.toml", "metrics.jsonl", "curves.png", "notes.txt"):
        (out / name).write_text(f"the user's own {name}")
    before = tree(out)
    argv = [sys.executable, "train.py", *tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {out} holds config.toml, curves.png, metrics.jsonl, which a run writes: "
                               f"--overwrite starts over"), r.stderr
    assert tree(out) == before
    r = subprocess.run([*argv, "--overwrite"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kept = next(p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-"))
    assert tree(kept) == before and (out / "ckpt_0000002.pt").is_file()


def test_a_run_names_the_commands_that_continue_and_sample_it_as_the_user_typed_them(tmp_path, text_file,
                                                                                      monkeypatch, capsys):
    """A stopped run and the refusal of an out dir holding a run name the command that continues it: the
    user's own arguments as typed, quoted for a shell, without --overwrite, with --resume (a run resumed from
    a chosen checkpoint: its folder's latest, not that checkpoint again); the last line names the sample.py
    command, the out dir relative to the working directory. The scripts are the repository's, from here."""
    monkeypatch.chdir(tmp_path)
    args = [*tiny_overrides(Path("."), Path(text_file.name), **{"train.max_steps": 8}), "--train.sample_prompt=All: We"]
    again = f"python {ROOT / 'train.py'} {shlex.join(args)} --resume"
    interrupt_at(monkeypatch, 3)
    rc, out, _ = run_tool(train_cli, [*args, "--overwrite"], capsys)
    stopped = f"stopped by SIGINT at step 3: checkpoint saved in {tmp_path / 'out'}; {again} continues it\n"
    assert rc == 130 and stopped in out, out
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err == f"error: {tmp_path / 'out'} already holds a run: {again} continues it, --overwrite " \
        "starts over (keeping them in out.replaced-<time>), or another --out_dir\n", err
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_tool(train_cli, shlex.split(again)[2:], capsys)   # the command as named: the run goes on to its end
    assert rc == 0 and "resuming" in out and out.endswith(f"; to sample it: python {ROOT / 'sample.py'} out\n"), out
    assert run_tool(sample_cli, ["out", "--max-new-tokens", 5], capsys)[0] == 0
    interrupt_at(monkeypatch, 2)
    rc, out, _ = run_tool(train_cli, [*args, "--train.max_steps=12", "--resume", "out/ckpt_0000003.pt"], capsys)
    assert rc == 130 and f"{shlex.join(args)} --train.max_steps=12 --resume out continues it\n" in out, out


def test_a_refusal_says_when_the_run_in_the_out_dir_was_trained_on_other_data(tmp_path, text_file, capsys):
    """An out dir given twice, or texts of one name in two folders: --resume would continue that run on
    another text, which the refusal says, naming both (the same text: the plain refusal)."""
    a, b = text_file, tmp_path / "b.txt"
    b.write_text(a.read_text().upper())
    assert run_tool(train_cli, tiny_overrides(tmp_path, a, **{"train.max_steps": 2}), capsys)[0] == 0
    before = tree(tmp_path)
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, b, **{"train.max_steps": 2}), capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith(
        f"error: {tmp_path / 'out'} already holds a run trained on {a} (char), not {b} (char): python "), err
    assert "--resume would continue that run on other data; --overwrite starts over" in err, err
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, a, **{"train.max_steps": 2}), capsys)
    assert rc == 2 and "already holds a run: python " in err and "other data" not in err, err
    assert tree(tmp_path) == before
