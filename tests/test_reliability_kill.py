"""Pull the plug: kill -9 and SIGTERM a training process at random moments (mid-step, mid-save,
mid-eval), resume it each time, and end with exactly the run that was never interrupted."""
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from loading import list_checkpoints, read_checkpoint
from tests.conftest import ROOT, num_threads, posix_signals, records, tiny_overrides
from training.config import build_config
from training.trainer import train

# train.py, with every checkpoint write and evaluation announced on stdout ("@save", "@eval") and,
# when PAUSE_AT names it, held there: half a checkpoint written, or an evaluation begun, for a
# signal to land in. Nothing else differs from `python train.py ARGS`.
CHILD = r"""
import io, os, sys, time
import torch
torch.set_num_threads(int(os.environ["THREADS"]))
import training.trainer as trainer
real_save, real_evaluate, pause_at = torch.save, trainer.evaluate, os.environ["PAUSE_AT"]

def announced_save(obj, f, *a, **k):
    buf = io.BytesIO()
    real_save(obj, buf, *a, **k)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    print("@save", flush=True)
    time.sleep(30 if pause_at == "save" else 0)
    f.write(data[len(data) // 2:])

def announced_evaluate(*a, **k):
    print("@eval", flush=True)
    time.sleep(30 if pause_at == "eval" else 0)
    return real_evaluate(*a, **k)

torch.save, trainer.evaluate = announced_save, announced_evaluate
import train
from common import run_cli
sys.exit(run_cli(train.main, sys.argv[1:]))
"""

STEPS, EVERY = 30, 5
THREADS = 1   # in the test process and its children alike, so that their float sums agree


@pytest.fixture(autouse=True, scope="module")
def same_threads():
    with num_threads(THREADS):
        yield


class Child:
    """A training process whose output lines can be waited for."""

    def __init__(self, args, pause_at=""):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "PAUSE_AT": pause_at,
               "THREADS": str(THREADS), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines, self.seen = queue.Queue(), []
        threading.Thread(target=lambda: [self.lines.put(l) for l in self.proc.stdout] + [self.lines.put(None)],
                         daemon=True).start()

    def wait_for(self, wanted, timeout=120):
        """Read output until a line for which wanted(line) is true; return that line."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError("the run ended first:\n" + "".join(self.seen[-15:]))
            self.seen.append(line)
            if wanted(line):
                return line

    def end(self, timeout=120) -> int:
        rc = self.proc.wait(timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen.append(line)
        return rc

    def kill(self, sig=None) -> int:
        """Send sig (default: kill -9, or TerminateProcess on Windows) and wait for the end; the exit code."""
        self.proc.kill() if sig is None else self.proc.send_signal(sig)
        return self.end()


def step_line(n):
    return lambda line: line.startswith("step ") and int(line.split()[1]) >= n


def latest_step(out):
    ckpts = list_checkpoints(out)
    for _, path in ckpts:
        read_checkpoint(path)   # every checkpoint on disk is complete
    return ckpts[-1][0]


@pytest.fixture
def args(tmp_path, text_file):
    return tiny_overrides(tmp_path, text_file, **{"train.max_steps": STEPS, "train.eval_interval": EVERY,
                                                  "out_dir": tmp_path / "run"})


@posix_signals
def test_kill_9_and_sigterm_at_random_moments_then_resume_is_the_uninterrupted_run(tmp_path, args):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    out = tmp_path / "run"
    train(build_config(None, [*args, f"--out_dir={tmp_path / 'whole'}"]), quiet=True)

    # 1. kill -9 at two random moments (after the first checkpoint), then resume
    history = [0]
    for resume in ([], ["--resume"]):
        run = Child(args + resume)
        run.wait_for(step_line(max(history[-1], EVERY) + rng.randint(1, 4)))
        time.sleep(rng.uniform(0, 0.03))
        assert run.kill() == -signal.SIGKILL
        history.append(latest_step(out))

    # 2. kill -9 with a checkpoint half written: the one before it is what resumes
    run = Child([*args, "--resume"], pause_at="save")
    run.wait_for(lambda line: line.startswith("@save"))
    assert run.kill() == -signal.SIGKILL
    assert list(out.glob(".ckpt_*.pt.tmp")), "the kill landed mid-save"
    assert latest_step(out) == history[-1]

    # 3. kill -9 mid-evaluation
    run = Child([*args, "--resume"], pause_at="eval")
    run.wait_for(lambda line: line.startswith("@eval"))
    assert run.kill() == -signal.SIGKILL
    history.append(latest_step(out))

    # 4. SIGTERM at a random step: it finishes the step, saves, says how to resume, exits 128 + 15
    run = Child([*args, "--resume"])
    run.wait_for(step_line(history[-1] + rng.randint(1, 4)))
    assert run.kill(signal.SIGTERM) == 128 + signal.SIGTERM, run.seen[-5:]
    stopped = [l for l in run.seen if l.startswith("stopped by SIGTERM")]
    assert stopped and "--resume" in stopped[0], run.seen[-5:]
    history.append(latest_step(out))
    assert f"at step {history[-1]}:" in stopped[0]

    # 5. SIGTERM twice, the second during the save that the first asked for: it exits at once
    run = Child([*args, "--resume"], pause_at="save")
    run.wait_for(step_line(history[-1] + 1))
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(lambda line: line.startswith("@save"))
    assert run.kill(signal.SIGTERM) == 128 + signal.SIGTERM
    assert any("again: exiting now" in l for l in run.seen), run.seen[-5:]
    assert latest_step(out) == history[-1], "a save cut short by the second signal replaced nothing"

    # 6. resume to the end: every step's loss and LR are the uninterrupted run's
    run = Child([*args, "--resume"])
    assert run.end() == 0, "".join(run.seen[-10:])
    assert list(records(out)) == list(range(1, STEPS + 1)), f"seed {seed}, resumed at {history}"
    assert records(out) == pytest.approx(records(tmp_path / "whole"), abs=1e-6), (seed, history)
    assert records(out, key="lr") == records(tmp_path / "whole", key="lr")
