"""Exact resume: a run stopped any way (Ctrl-C, SIGTERM, kill -9 at a random moment, mid-save,
mid-evaluation) and resumed is the run that was never stopped, loss for loss. A checkpoint holds
the whole training state; --resume goes on with the run's own settings, model, tokenizer and text
(from the out dir's latest checkpoint, a chosen one, or best.pt alone), or says in one line why
it cannot."""
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import train as train_cli
from common import UserError
from loading import list_checkpoints, read_checkpoint
from tests.conftest import (ROOT, TEXT, interrupt_at, mkdir, posix_signals, records, run_tool,
                            tiny_overrides, tree)
from training.config import build_config
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


@pytest.mark.parametrize("extra", [
    {"model.dropout": 0.1, "train.grad_accum": 2},
    {"train.optimizer": "muon", "train.schedule": "wsd", "model.tie_embeddings": False},
], ids=["adamw-dropout-accum", "muon-wsd"])
def test_resume_is_exact_from_any_step_twice_over(extra, tmp_path, tiny_cfg, monkeypatch):
    """Ctrl-C at step 5 and again at step 9 (not evaluation steps: each stop saves its own
    checkpoint); every later loss, val loss, learning rate and the final weights are the
    uninterrupted run's (dropout: the RNG state resumes as well)."""
    extra = {**extra, "train.eval_interval": 4, "train.max_steps": 12}
    train(tiny_cfg(**extra, out_dir=tmp_path / "whole"), quiet=True)
    split = tiny_cfg(**extra, out_dir=tmp_path / "split")
    interrupt_at(monkeypatch, 5)
    assert train(split, quiet=True)["exit_code"] == 130
    interrupt_at(monkeypatch, 4)   # the resumed run's 4th step: step 9
    assert train(split, quiet=True, resume=True)["step"] == 9
    monkeypatch.undo()
    assert train(split, quiet=True, resume=True)["step"] == 12
    assert list(records(tmp_path / "split")) == list(range(1, 13)), "every step logged once"
    assert records(tmp_path / "split") == pytest.approx(records(tmp_path / "whole"), abs=1e-6)
    assert records(tmp_path / "split", key="lr") == records(tmp_path / "whole", key="lr")
    val = records(tmp_path / "whole", "eval", "val_loss")
    assert records(tmp_path / "split", "eval", "val_loss") == pytest.approx(val, abs=1e-6)
    a = read_checkpoint(tmp_path / "whole" / "ckpt_0000012.pt")["model"]
    b = read_checkpoint(tmp_path / "split" / "ckpt_0000012.pt")["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


# ---------------------------------------------------------------- kill -9 and signals, for real

# train.py, with each checkpoint write and evaluation announced on stdout ("@save <bytes written>
# <temporary file>", "@eval") and, where PAUSE_AT names it, held there for 30 s: half a checkpoint
# written, or an evaluation begun, for a signal to land in. An announcement is one os.write of a
# whole line, which a pipe keeps whole: print() writes its text and its newline apart, so that the
# writer thread's line could land inside one of the main thread's, and be missed.
CHILD = r"""
import io, os, sys, time
import torch
# one thread, as the test's own run: their float sums agree
torch.set_num_threads(1)
import training.trainer as trainer
real_save, real_evaluate, pause_at = torch.save, trainer.evaluate, os.environ["PAUSE_AT"]

def announce(line, pause):
    os.write(1, (line + "\n").encode())
    time.sleep(30 if pause_at == pause else 0)

def announced_save(obj, f, *a, **k):
    buf = io.BytesIO()
    real_save(obj, buf, *a, **k)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    announce(f"@save {len(data) // 2} {f.name}", "save")
    f.write(data[len(data) // 2:])

def announced_evaluate(*a, **k):
    announce("@eval", "eval")
    return real_evaluate(*a, **k)

torch.save, trainer.evaluate = announced_save, announced_evaluate
import train
from common import run_cli
sys.exit(run_cli(train.main, sys.argv[1:]))
"""

STEPS, EVERY = 30, 5


class Child:
    """A training process whose output lines can be waited for."""

    def __init__(self, args, pause_at=""):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
               "PAUSE_AT": pause_at, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], cwd=ROOT,
                                     env=env, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.lines, self.seen = queue.Queue(), []
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

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

    def said(self, text: str) -> bool:
        return any(text in line for line in self.seen)

    def end(self, timeout=120) -> int:
        rc = self.proc.wait(timeout)
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen.append(line)
        assert not self.said("Traceback"), "".join(self.seen[-15:])
        return rc

    def kill(self, sig=signal.SIGKILL) -> int:
        """Send sig and wait for the end; the exit code."""
        self.proc.send_signal(sig)
        return self.end()


def step_line(n):
    return lambda line: line.startswith("step ") and int(line.split()[1]) >= n


def held(line: str) -> tuple[Path, int]:
    """The temporary file of the write that an "@save" line announced, and its size: the half
    announced, so that the write is held half done."""
    size, name = line.split("@save ")[1].split(maxsplit=1)
    path = Path(name.strip())
    assert path.stat().st_size == int(size), "the write is held where it was announced"
    return path, int(size)


def latest_step(out):
    ckpts = list_checkpoints(out)
    for _, path in ckpts:
        read_checkpoint(path)   # every checkpoint on disk is complete
    return ckpts[-1][0]


@posix_signals
def test_kill_9_sigint_and_sigterm_at_random_moments_then_resume_is_the_uninterrupted_run(
        tmp_path, text_file):
    """What each phase waits for is what the child says it is doing (a step logged, a checkpoint on
    disk, a write held half done, a signal heard), never a guess of how long it takes."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    out = tmp_path / "run"
    args = tiny_overrides(tmp_path, text_file, out_dir=out,
                          **{"train.max_steps": STEPS, "train.eval_interval": EVERY})
    train(build_config(None, [*args, f"--out_dir={tmp_path / 'whole'}"]), quiet=True)
    resume = [*args, "--resume"]

    # 1. kill -9 at a random step, once the first checkpoint is on disk
    run, at = Child(args), step_line(EVERY + rng.randint(1, 4))
    run.wait_for(lambda line: at(line) and list_checkpoints(out))
    time.sleep(rng.uniform(0, 0.03))
    assert run.kill() == -signal.SIGKILL
    history = [latest_step(out)]

    # 2. kill -9 with a checkpoint half written: the one before it is what resumes
    run = Child(resume, pause_at="save")
    tmp, size = held(run.wait_for(lambda line: "@save " in line))
    assert run.kill() == -signal.SIGKILL
    assert tmp.stat().st_size == size, "the kill landed mid-save"
    assert latest_step(out) == history[-1]

    # 3. kill -9 mid-evaluation
    run = Child(resume, pause_at="eval")
    run.wait_for(lambda line: "@eval" in line)
    assert run.kill() == -signal.SIGKILL
    history.append(latest_step(out))

    # 4. Ctrl-C at a random step: it finishes the step, saves, says how to resume, exits 128 + 2
    run = Child(resume)
    run.wait_for(step_line(history[-1] + rng.randint(1, 4)))
    assert run.kill(signal.SIGINT) == 128 + signal.SIGINT, run.seen[-5:]
    stopped = [line for line in run.seen if line.startswith("stopped by SIGINT")]
    assert stopped and "--resume" in stopped[0], run.seen[-5:]
    history.append(latest_step(out))
    assert f"at step {history[-1]}:" in stopped[0]

    # 5. SIGTERM at a random step, and again while a save waits on a write held half done
    run = Child(resume, pause_at="save")
    run.wait_for(step_line(history[-1] + rng.randint(1, 4)))
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(lambda _: run.said("SIGTERM: finishing this step") and run.said("@save "))
    tmp, size = held(next(line for line in run.seen if "@save " in line))
    assert run.kill(signal.SIGTERM) == 128 + signal.SIGTERM
    assert run.said("SIGTERM: again: exiting now"), run.seen[-5:]
    assert tmp.stat().st_size == size, "the second signal landed mid-save"
    assert latest_step(out) == history[-1], "a save cut short by the second signal replaced nothing"

    # 6. resume to the end (here, as the run it is compared with): every step's loss and LR are
    # the uninterrupted run's
    assert train(build_config(None, args), resume=True, quiet=True)["step"] == STEPS
    assert list(records(out)) == list(range(1, STEPS + 1)), f"seed {seed}, resumed at {history}"
    assert records(out) == pytest.approx(records(tmp_path / "whole"), abs=1e-6), (seed, history)
    assert records(out, key="lr") == records(tmp_path / "whole", key="lr")


# ---------------------------------------------------------------- which checkpoint, which run

def test_resume_from_a_chosen_checkpoint_continues_exactly_from_it(tmp_path, text_file, capsys):
    """The latest checkpoint damaged (its refusal: test_promise_safe_checkpoints.py), --resume PATH
    continues from an earlier one as the run went on from there, and the checkpoints after it go
    when it writes its own."""
    args = tiny_overrides(tmp_path, text_file,
                          **{"train.eval_interval": 5, "train.keep_checkpoints": 4})
    assert run_tool(train_cli, args, capsys)[0] == 0
    whole = records(tmp_path / "out")
    (tmp_path / "out" / "ckpt_0000020.pt").write_bytes(b"")
    rc, out, err = run_tool(train_cli, ["--resume", tmp_path / "out" / "ckpt_0000010.pt"], capsys)
    assert rc == 0 and "resuming" in out and "at step 10" in out, err
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [5, 10, 15, 20], "from step 10 on"
    assert records(tmp_path / "out") == pytest.approx(whole, abs=1e-6)


def test_best_pt_is_never_a_checkpoint_that_a_resumed_run_replaces(tmp_path, tiny_cfg, monkeypatch):
    """Resumed from an earlier checkpoint, best.pt stays the run's best until the resumed run
    writes a checkpoint of its own; then the later checkpoints go, and a best.pt that was one of
    them too: a command that loads the run's best would use a model of a branch that no longer
    exists. Where the branch that goes on does worse (lr 3.0 ruins it), its best is the checkpoint
    it resumed from."""
    extra = {"train.eval_interval": 5, "train.keep_checkpoints": 4}
    train(tiny_cfg(**extra), quiet=True)
    out = tmp_path / "out"
    best, first = out / "best.pt", out / "ckpt_0000005.pt"
    at_5 = read_checkpoint(first)["model"]
    later = next(p for _, p in list_checkpoints(out) if os.path.samefile(best, p))
    assert later != first, "the val loss fell after step 5"
    ruin = {**extra, "train.lr": 3.0}
    interrupt_at(monkeypatch, 5)   # stopped at step 10, before an evaluation of its own
    assert train(tiny_cfg(**ruin), quiet=True, resume=True, checkpoint=first)["step"] == 10
    kept = [p for _, p in list_checkpoints(out)]
    assert [p.name for p in kept] == ["ckpt_0000005.pt", "ckpt_0000010.pt"]
    assert not best.exists() or any(os.path.samefile(best, p) for p in kept), "a replaced best.pt"
    monkeypatch.undo()
    assert train(tiny_cfg(**ruin), quiet=True, resume=True)["step"] == 20
    best = read_checkpoint(best)
    assert best["step"] == 5 and all(torch.equal(best["model"][k], v) for k, v in at_5.items())


def test_resume_links_best_pt_again_where_a_kill_cut_its_linking_short(tiny_cfg):
    cfg = tiny_cfg(**{"train.max_steps": 10})
    train(cfg, quiet=True)
    os.unlink(f"{cfg.out_dir}/best.pt")
    assert read_checkpoint(f"{cfg.out_dir}/ckpt_0000010.pt")["is_best"]
    cfg.train.max_steps = 12
    assert train(cfg, quiet=True, resume=True)["step"] == 12
    assert os.path.exists(f"{cfg.out_dir}/best.pt")


def test_an_out_dir_holding_only_best_pt_is_resumed_as_the_refusal_says(tmp_path, text_file,
                                                                        trained, capsys):
    out = mkdir(tmp_path / "out")
    shutil.copy(trained / "best.pt", out / "best.pt")
    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file), capsys)
    assert rc == 2 and "already holds a run: python " in err, err
    assert " --resume continues it" in err, err
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 6})
    rc, stdout, err = run_tool(train_cli, [*args, "--resume"], capsys)
    assert rc == 0 and f"resuming {out / 'best.pt'} at step 4" in stdout, err
    assert read_checkpoint(out / "ckpt_0000006.pt")["step"] == 6


# ---------------------------------------------------------------- the run's own settings and text

def test_resume_continues_the_run_s_own_settings_naming_each_change(tmp_path, text_file, capsys):
    """A bare --resume (or --resume with the run's folder) is the run that was started, not the
    defaults; a changed setting is named, and is the one that trains; a finished run resumed with
    fewer steps changes nothing."""
    first = tiny_overrides(tmp_path, text_file,
                           **{"train.max_steps": 12, "train.lr": 3e-3, "train.min_lr": 3e-4})
    rc, _, err = run_tool(train_cli, [*first, "--train.eval_interval=6"], capsys)
    assert rc == 0, err
    out = tmp_path / "out"
    bare = [f"--data={text_file}", f"--out_dir={out}",
            f"--data.prepared_dir={tmp_path / 'prepared'}"]
    # max_steps would be 2000 by default
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume"], capsys)
    assert rc == 0 and "at step 12, train.max_steps = 12: nothing to train" in stdout, stdout
    before = tree(out)
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume", "--train.max_steps=6"], capsys)
    said = "at step 12, train.max_steps = 6: nothing to train, nothing changed"
    assert rc == 0 and said in stdout, stdout
    assert tree(out) == before
    rc, stdout, err = run_tool(train_cli, [*bare, "--resume", "--train.max_steps=16",
                                           "--train.log_interval=4"], capsys)
    assert rc == 0 and "# resuming with train.max_steps: 12 -> 16" in stdout, stdout
    assert "train.log_interval: 1 -> 4" in stdout, stdout
    ckpt = read_checkpoint(out / "ckpt_0000016.pt")
    assert ckpt["config"]["train"]["lr"] == 3e-3 and ckpt["config"]["model"]["n_embd"] == 32
    assert ckpt["tokens"] == 16 * 8 * 32
    # a changed lr is the one the optimizer uses: the checkpoint's state does not bring 3e-3 back
    lower = ["--train.lr=1e-4", "--train.min_lr=1e-5"]
    rc, stdout, err = run_tool(train_cli, ["--resume", out, "--train.max_steps=18",
                                           "--train.batch_size=4", *lower], capsys)
    assert rc == 0 and "train.lr: 0.003 -> 0.0001" in stdout, err
    ckpt = read_checkpoint(out / "ckpt_0000018.pt")
    assert ckpt["tokens"] == 16 * 8 * 32 + 2 * 4 * 32
    lrs = [g["lr"] for g in ckpt["optimizer"]["param_groups"]]
    assert lrs and all(lr == pytest.approx(records(out, key="lr")[18]) for lr in lrs)
    assert all(lr <= 1e-4 for lr in lrs), lrs


@pytest.mark.parametrize("change, message", [
    ("--data.tokenizer=bpe:300", 'data.tokenizer: "char" in the run, "bpe:300" now'),
    ("--model.n_layer=3", "model.n_layer: 2 in the run, 3 now"),
], ids=["tokenizer", "model"])
def test_resume_with_another_tokenizer_or_model_is_refused_before_any_text_is_prepared(
        change, message, tmp_path, text_file, capsys):
    """A mistake that --resume can tell from the run's checkpoint is one line, and writes nothing:
    not even the preparation of the text for the changed setting."""
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    before = tree(tmp_path)
    fresh = f"--data.prepared_dir={tmp_path / 'fresh'}"
    rc, _, err = run_tool(train_cli, [*args, fresh, change, "--resume"], capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: " + message), err
    assert tree(tmp_path) == before


def test_resume_needs_the_whole_training_state(tmp_path, tiny_cfg):
    cfg = tiny_cfg(**{"train.max_steps": 2})
    train(cfg, quiet=True)
    weights_only = mkdir(tmp_path / "w")
    ckpt = torch.load(f"{cfg.out_dir}/ckpt_0000002.pt", weights_only=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("optimizer", "rng_ranks")},
               weights_only / "ckpt_0000002.pt")
    with pytest.raises(UserError, match="cannot be resumed from: it lacks optimizer, rng_ranks"):
        train(tiny_cfg(out_dir=weights_only), resume=True, quiet=True)


def test_resume_on_another_text_goes_on_where_it_gives_the_same_tokens_and_says_so(
        tmp_path, text_file, capsys):
    """The same text: nothing to say. Another text of the same characters: a warning, and the run
    goes on. A text of other characters: refused, in one line."""
    def resume_to(steps):
        args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": steps})
        return run_tool(train_cli, [*args, "--resume"], capsys)

    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})
    assert run_tool(train_cli, args, capsys)[0] == 0
    rc, out, err = resume_to(4)
    assert rc == 0 and "warning" not in out + err, out + err
    text_file.write_text("\n".join(reversed(TEXT.splitlines())) + "\n")
    rc, out, err = resume_to(6)
    saved = tmp_path / "out" / "ckpt_0000004.pt"
    warning = (f"warning: the training text changed since {saved} was saved; training goes on "
               f"with the new text\n")
    assert rc == 0 and warning in out + err, out + err
    text_file.write_text(TEXT.upper())
    rc, _, err = resume_to(8)
    assert rc == 2 and err.count("\n") == 1, err
    assert "the text changed, and --resume needs the one it was trained on" in err, err
