"""Stopping a run as users do, with real processes: Ctrl-C while the output goes through a pipe, a pipe
whose reader ends, and Ctrl-C at any moment: the run saves and says so, or (before it began) ends
quietly, never with a traceback."""
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from loading import list_checkpoints, read_checkpoint
from tests.conftest import ROOT, posix_signals, tiny_overrides

pytestmark = posix_signals


def start(script, args, **kw):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, script, *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def latest_checkpoint(out):
    return (list_checkpoints(out) or [(0, None)])[-1][1]


def read_until_step(proc, n):
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= n:
            return
    raise AssertionError(f"the run ended first: {proc.stderr.read()}")


@pytest.fixture
def endless(tmp_path, text_file):
    """A run that would go on for a long time, logging every step, with no checkpoint before it stops."""
    return tiny_overrides(tmp_path, text_file, **{"train.max_steps": 100_000, "train.eval_interval": 100_000})


def test_ctrl_c_with_the_output_piped_and_gone_saves_and_says_so(endless, tmp_path):
    """`python train.py | head`, or tee killed by the same Ctrl-C: the reader is gone, the run is not."""
    proc = start("train.py", endless)
    read_until_step(proc, 3)
    proc.stdout.close()
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 130 and "Traceback" not in err, err
    assert "SIGINT: finishing this step and saving a checkpoint" in err, err
    ckpt = latest_checkpoint(tmp_path / "out")
    assert ckpt is not None and read_checkpoint(ckpt)["step"] >= 3, "the stop saved no checkpoint"


def test_a_closed_stdout_stops_the_printing_not_the_run(tmp_path, text_file):
    proc = start("train.py", tiny_overrides(tmp_path, text_file, **{"train.max_steps": 40}))
    read_until_step(proc, 3)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and not err, err
    assert read_checkpoint(latest_checkpoint(tmp_path / "out"))["step"] == 40


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_ctrl_c_in_the_first_instants_ends_quietly(script, trained, tmp_path, text_file):
    """While torch imports and the run sets up (the first second or so), Ctrl-C ends the command at once
    (Python's own start, before the command's first line, is nothing a command can change)."""
    args = tiny_overrides(tmp_path, text_file) if script == "train.py" else [trained, "--max-new-tokens", 5]
    for delay in (0.6, 1.0, 1.5):   # (from then on: main runs, under run_cli, even on a busy machine)
        proc = start(script, args)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if err.strip() == "KeyboardInterrupt" or err.splitlines()[1:2] == [f'  File "{ROOT / script}", line 0, in '
                                                                           f'<module>']:
            continue   # Python's own start, before the command's first line: nothing a command can change
        assert proc.returncode in (-signal.SIGINT, 130, 0), (delay, proc.returncode, err)   # (0: done first)
        assert "Traceback" not in err and "what()" not in err, (delay, err)


def test_ctrl_c_at_random_moments_of_a_run_then_resume_never_a_traceback(tmp_path, text_file):
    rng = random.Random()
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 60, "train.eval_interval": 7})
    for attempt in range(4):
        proc = start("train.py", args + (["--resume"] if latest_checkpoint(tmp_path / "out") else []))
        time.sleep(rng.uniform(0.5, 4.0))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, 130, -signal.SIGINT), (attempt, proc.returncode, err)
        assert "Traceback" not in err, err
    proc = start("train.py", args + (["--resume"] if latest_checkpoint(tmp_path / "out") else []))
    out, err = proc.communicate(timeout=180)
    # (a run that an earlier attempt finished says so, and trains nothing)
    finished = "# done: step 60" in out or "at step 60, train.max_steps = 60: nothing to train" in out
    assert proc.returncode == 0 and finished, (out, err)


def test_ctrl_c_with_both_outputs_gone_still_saves(endless, tmp_path):
    """`python train.py 2>&1 | tee log`, and the same Ctrl-C ends tee first: the run's word of the stop
    goes nowhere, and the run saves all the same."""
    proc = start("train.py", endless)
    read_until_step(proc, 3)
    proc.stdout.close()
    proc.stderr.close()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert read_checkpoint(latest_checkpoint(tmp_path / "out"))["step"] >= 3
