"""Signals: Ctrl-C or SIGTERM finishes the step, saves a checkpoint at once and says how to go on
(exit 130 or 143); before the run begins, Ctrl-C ends the command quietly; a stdout whose reader is
gone stops the printing, not the run; outside the loop (preparing the data) SIGTERM cleans up
and exits 143. (A second signal, and a signal at a random step of a real
process: test_promise_exact_resume.py.)"""
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sample as sample_cli
import train as train_cli
from loading import list_checkpoints, read_checkpoint
from tests.conftest import (ROOT, gpt2_or_skip, interrupt_at, posix_signals, records, run_tool,
                            tiny_overrides)
from common import run_cli
from training.trainer import train
from viz.curves import read_records

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def start(script, args):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, script, *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_until_step(proc, n):
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= n:
            return
    raise AssertionError(f"the run ended first: {proc.stderr.read()}")


def wait_for_record(out, step, timeout=120):
    """Wait until the run in out has logged `step` in its metrics.jsonl: the run goes on."""
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in read_records(out / "metrics.jsonl", warn=False)):
        assert time.monotonic() < deadline, f"step {step} was never logged"
        time.sleep(0.05)


@posix_signals
@pytest.mark.parametrize("gone", ["stdout", "stdout and stderr"])
def test_ctrl_c_with_the_output_gone_saves_and_says_so(gone, tmp_path, text_file):
    """`python train.py | head`, or `2>&1 | tee log` with tee ended by the same Ctrl-C: the reader
    is gone, the run is not: it logs on, and Ctrl-C saves; the word of the stop goes to stderr, as
    the only thing there, where stderr is still read."""
    out = tmp_path / "out"
    endless = {"train.max_steps": 100_000, "train.eval_interval": 100_000}
    proc = start("train.py", tiny_overrides(tmp_path, text_file, **endless))
    read_until_step(proc, 3)
    proc.stdout.close()
    if gone != "stdout":
        proc.stderr.close()
    wait_for_record(out, 6)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read() if gone == "stdout" else ""
    assert proc.wait(timeout=120) == 130
    if gone == "stdout":
        assert err == "\nSIGINT: finishing this step and saving a checkpoint (again to exit at " \
                      "once)\n", err
    assert read_checkpoint(list_checkpoints(out)[-1][1])["step"] >= 6


def before_the_command(err: str, script: str) -> bool:
    """Whether Ctrl-C landed where the command cannot answer it: Python's own start, before the
    command's first line (from common.py's import on, a stop is one line)."""
    lines = err.strip().splitlines()
    first = [f'  File "{ROOT / script}", line 0, in <module>']
    return lines == ["KeyboardInterrupt"] or lines[1:2] == first


@posix_signals
@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_ctrl_c_in_the_first_instants_ends_quietly(script, trained, tmp_path, text_file):
    """While torch imports and the run sets up (the first second or so), Ctrl-C ends the command
    at once. The training run would go on for minutes: even on an idle machine the signal lands
    while it works, not as it exits."""
    # from then on main runs, under run_cli, even on a busy machine
    for delay in (0.6, 1.0, 1.5):
        # each run its own out dir: one that got as far as its first checkpoint holds a run
        endless = {"out_dir": tmp_path / f"out-{delay}", "train.max_steps": 100_000,
                   "train.eval_interval": 100_000}
        args = tiny_overrides(tmp_path, text_file, **endless) if script == "train.py" else \
            [trained, "--max-new-tokens", 5]
        proc = start(script, args)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if before_the_command(err, script):
            continue
        # 0: sample.py done first
        codes = (-signal.SIGINT, 130) + ((0,) if script == "sample.py" else ())
        assert proc.returncode in codes, (delay, proc.returncode, err)
        assert "Traceback" not in err and "what()" not in err, (delay, err)


def ctrl_c_after_its_first_line(code: str) -> tuple[int, str, str, str]:
    """`python -c code` in the repository, given a Ctrl-C once it has printed a line: (its exit
    code, that line, the rest of its stdout, its stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, first, out, err


@posix_signals
def test_ctrl_c_as_a_command_exits_is_its_line_not_a_traceback():
    """A command is done, and Python shuts down (here an exit handler that takes a while): a
    Ctrl-C then says 'interrupted' and exits 130."""
    # a script of the repository, as train.py is
    code = (f"__file__ = {str(ROOT / 'a_command.py')!r}\n"
            "import atexit, sys, time\n"
            "from common import run_cli\n"
            "atexit.register(time.sleep, 30)\n"
            "code = run_cli(lambda argv: 0, [])\n"
            "print('done', flush=True)\n"
            "sys.exit(code)\n")
    rc, first, _, err = ctrl_c_after_its_first_line(code)
    assert first == "done\n"
    assert (rc, err) == (130, "interrupted\n")


@posix_signals
def test_a_program_of_the_user_s_that_imports_the_project_keeps_python_s_ctrl_c():
    """Only the repository's commands take over Ctrl-C: a notebook's or a script's own
    `except KeyboardInterrupt` still runs."""
    code = ("import time\n"
            "import common, data.prepare\n"
            "try:\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(30)\n"
            "except KeyboardInterrupt:\n"
            "    print('caught')\n")
    rc, first, out, err = ctrl_c_after_its_first_line(code)
    assert first == "ready\n"
    assert (rc, out, err) == (0, "caught\n", "")


def test_sigterm_at_an_evaluation_step_still_evaluates_it_and_saves(tiny_cfg, monkeypatch):
    cfg = tiny_cfg()
    # eval_interval 10: the stop lands on an evaluation step
    interrupt_at(monkeypatch, 10, signal.SIGTERM)
    assert train(cfg, quiet=True)["exit_code"] == 128 + signal.SIGTERM
    assert list(records(cfg.out_dir, "eval", "val_loss")) == [10]
    assert [s for s, _ in list_checkpoints(cfg.out_dir)] == [10]


def test_a_stopped_run_names_the_commands_that_continue_and_sample_it_as_the_user_typed_them(
        tmp_path, text_file, monkeypatch, capsys):
    """A stopped run and the refusal of an out dir holding a run name the command that continues
    it: the user's own arguments as typed, quoted for a shell, without --overwrite, with --resume (a
    run resumed from a chosen checkpoint: its folder's latest, not that checkpoint again); the last
    line names the sample.py command, the out dir relative to the working directory. The scripts
    are the repository's, from here."""
    monkeypatch.chdir(tmp_path)
    args = [*tiny_overrides(Path("."), Path(text_file.name), **{"train.max_steps": 8}),
            "--train.sample_prompt=All: We"]
    again = f"python {ROOT / 'train.py'} {shlex.join(args)} --resume"
    interrupt_at(monkeypatch, 3)
    rc, out, _ = run_tool(train_cli, [*args, "--overwrite"], capsys)
    stopped = (f"stopped by SIGINT at step 3: checkpoint saved in {tmp_path / 'out'}; {again} "
               f"continues it\n")
    assert rc == 130 and stopped in out, out
    rc, _, err = run_tool(train_cli, args, capsys)
    assert rc == 2 and err == (f"error: {tmp_path / 'out'} already holds a run: {again} continues "
                               "it, --overwrite starts over (keeping them in out.replaced-<time>), "
                               "or another --out_dir\n"), err
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    # the command as named: the run goes on to its end
    rc, out, err = run_tool(train_cli, shlex.split(again)[2:], capsys)
    assert rc == 0 and "resuming" in out, out
    assert out.endswith(f"; to sample it: python {ROOT / 'sample.py'} out\n"), out
    assert run_tool(sample_cli, ["out", "--max-new-tokens", 5], capsys)[0] == 0
    interrupt_at(monkeypatch, 2)
    rc, out, _ = run_tool(train_cli, [*args, "--train.max_steps=12", "--resume",
                                      "out/ckpt_0000003.pt"], capsys)
    assert rc == 130, out
    assert f"{shlex.join(args)} --train.max_steps=12 --resume out continues it\n" in out, out


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


def processes_of(text: Path) -> list[int]:
    """The pids of the processes whose command line names text (a preparation and the workers
    it forked)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(text).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def wait_for(condition, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def preparing(tmp_path, *args) -> tuple[subprocess.Popen, Path, Path]:
    """python data/prepare.py on 44 MB of text, under way."""
    text = tmp_path / "big.txt"
    text.write_text((ROOT / "data" / "tinyshakespeare.txt").read_text() * 40)
    prepared = tmp_path / "prepared"
    argv = [sys.executable, str(ROOT / "data" / "prepare.py"), str(text), "--root", str(prepared)]
    # a session of its own: a signal reaches its whole group, as a terminal's Ctrl-C does
    proc = subprocess.Popen(argv + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, text, prepared


def assert_nothing_left(prepared: Path, text: Path) -> None:
    assert not list(prepared.glob(".*")), "a temporary folder was left behind"
    assert wait_for(lambda: not processes_of(text), 10), "a worker outlived the command"


GPT2_ON_2 = ("--tokenizer", "gpt2", "--workers", "2")


@posix_signals
@pytest.mark.parametrize("stop, code, line, args", [
    (signal.SIGTERM, 143, "terminated", ()),
    (signal.SIGTERM, 143, "terminated", GPT2_ON_2),
    (signal.SIGINT, 130, "interrupted", GPT2_ON_2)], ids=["char", "gpt2 on 2", "ctrl-c gpt2 on 2"])
def test_a_stopped_preparation_leaves_no_temporary_folder(tmp_path, stop, code, line, args):
    """SIGTERM (kill, timeout, a scheduler) is a Ctrl-C outside the training loop: the command
    cleans up, says so in one line and exits; its worker processes end with it."""
    if args:
        gpt2_or_skip()
    proc, text, prepared = preparing(tmp_path, *args)
    wait_for(lambda: list(prepared.glob(".*.tmp-*")) or proc.poll() is not None)
    if args:
        # the workers are forked once the encoding starts
        wait_for(lambda: len(processes_of(text)) > 1 or proc.poll() is not None)
    os.killpg(proc.pid, stop)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the preparation ended before the signal came")
    assert (proc.returncode, err) == (code, line + "\n")
    assert_nothing_left(prepared, text)


@posix_signals
def test_a_worker_that_dies_ends_the_preparation_in_one_line(tmp_path):
    """The out-of-memory killer takes a worker: the command says so and exits, it never hangs."""
    gpt2_or_skip()
    proc, text, prepared = preparing(tmp_path, *GPT2_ON_2)

    def workers():
        return [pid for pid in processes_of(text) if pid != proc.pid]
    wait_for(lambda: workers() or proc.poll() is not None)
    if proc.poll() is not None:
        pytest.skip("the preparation ended before a worker could be killed")
    os.kill(workers()[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.splitlines()[-1]) == (
        2, "error: an encoding worker process died (out of memory?): --data.workers=1 encodes "
           "in this one")
    assert_nothing_left(prepared, text)


@posix_signals
def test_workers_end_with_a_preparation_killed_by_sigkill(tmp_path):
    """kill -9 leaves the command no time to stop its workers: they notice and end."""
    gpt2_or_skip()
    proc, text, _ = preparing(tmp_path, *GPT2_ON_2)
    wait_for(lambda: len(processes_of(text)) > 1 or proc.poll() is not None)
    proc.kill()
    proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the preparation ended before the signal came")
    assert wait_for(lambda: not processes_of(text), 10), "a worker outlived the command"
