"""What a run promises its user besides a trained model: one run per out dir, a warning when a resume
trains on another text, a --help that documents every setting, and log lines that say how long is left."""
import dataclasses
import errno
import hashlib
import json
import os
import re
import signal
import time

import pytest

import train as train_cli
from common import UserError
from tests.conftest import ROOT, TEXT, num_threads, posix_signals, run_tool, tiny_overrides, tree
from tests.test_reliability_kill import Child, step_line
from training.checkpoint import latest_checkpoint, load_checkpoint
from training import outdir as lock
from training.config import Config, build_config
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread

# ---------------------------------------------------------------- one run per out dir


@posix_signals
def test_a_second_run_into_a_busy_out_dir_is_refused_and_writes_nothing(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    first = Child(tiny_overrides(tmp_path, text_file, **{"train.max_steps": 100_000, "train.eval_interval": 5}))
    try:
        first.wait_for(step_line(6))   # past its first checkpoint (step 5), still running
        first.proc.send_signal(signal.SIGSTOP)   # it holds its lock, but writes nothing while the others try
        before = tree(out)
        second = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2})   # were it let in, it would end soon
        for flags in (["--overwrite"], [], ["--resume"]):   # --overwrite would delete the first run's checkpoints
            rc, stdout, err = run_tool(train_cli, second + flags, capsys)
            assert rc == 2 and err.count("\n") == 1 and not stdout, (flags, rc, err)
            assert err.startswith(f"error: {out} is in use by another run (PID {first.proc.pid})"), (flags, err)
            assert tree(out) == before, f"a refused run ({flags}) changed the out dir"
    finally:
        killed = first.kill()   # kill -9: the lock goes with the process, its file stays
    assert killed == -signal.SIGKILL, first.seen[-5:]
    assert (out / ".lock").read_text().strip() == str(first.proc.pid)
    resumed_at = load_checkpoint(latest_checkpoint(out))["step"]
    cfg = build_config(None, tiny_overrides(tmp_path, text_file, **{"train.max_steps": resumed_at + 2}))
    assert train(cfg, resume=True, quiet=True)["step"] == resumed_at + 2, "a killed run's lock went stale"


@pytest.mark.skipif(lock.fcntl is None, reason="flock's errors (POSIX); Windows' lock: tests/test_windows.py")
@pytest.mark.parametrize("code, busy", [(errno.EWOULDBLOCK, True), (errno.ENOLCK, False)], ids=["held", "no locks"])
def test_only_a_held_lock_makes_an_out_dir_busy(code, busy, tiny_cfg, monkeypatch):
    """A file system that cannot lock at all (NFS without its lock daemon) runs unguarded, as it would
    without the lock, instead of being 'in use by another run' forever."""
    cfg = tiny_cfg(**{"train.max_steps": 2})
    train(cfg, quiet=True)   # the out dir has its .lock file now

    def flock(fd, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(lock.fcntl, "flock", flock)
    if busy:
        with pytest.raises(UserError, match="is in use by another run"):
            train(cfg, quiet=True, overwrite=True)
    else:
        assert train(cfg, quiet=True, overwrite=True)["step"] == 2


# ---------------------------------------------------------------- resume on a changed text

def test_a_resume_on_a_changed_text_says_so(tmp_path, text_file, capsys):
    def resume_to(steps):
        rc, out, err = run_tool(train_cli, [*tiny_overrides(tmp_path, text_file, **{"train.max_steps": steps}),
                                            "--resume"], capsys)
        assert rc == 0, err
        return [line for line in (out + err).splitlines() if "warning" in line]

    rc, _, err = run_tool(train_cli, tiny_overrides(tmp_path, text_file, **{"train.max_steps": 2}), capsys)
    assert rc == 0, err
    assert resume_to(4) == [], "the same text: nothing to say"
    changed = "\n".join(reversed(TEXT.splitlines())) + "\n"   # the same characters (tokenizer), another text
    text_file.write_text(changed)
    was, now = (hashlib.sha256(t.encode()).hexdigest()[:12] for t in (TEXT, changed))
    assert resume_to(6) == [f"warning: the training text changed since this checkpoint (sha256 {was}... then, "
                            f"{now}... now); training goes on with the new text"]


# ---------------------------------------------------------------- --help and docs/config.md

def settings():
    """(section, key, type name, default as written on the command line) of every setting, from the dataclasses."""
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(f.type):
            for sub in dataclasses.fields(f.type):
                yield f.name, f"{f.name}.{sub.name}", sub.type.__name__, json.dumps(getattr(f.type(), sub.name))
        else:
            yield "(top level)", f.name, f.type.__name__, json.dumps(getattr(Config(), f.name))


def test_help_documents_every_setting_by_section_with_type_default_and_meaning(capsys):
    rc, out, err = run_tool(train_cli, ["--help"], capsys)
    assert rc == 0 and not err
    section, found = None, {}
    for line in out.splitlines():
        if m := re.fullmatch(r"\[(.+)\]", line):
            section = m.group(1)
        elif m := re.fullmatch(r"  --([\w.]+)=(\S*) +(\w+) +(.*)", line):
            found[m.group(1)] = (section, m.group(3), m.group(2), m.group(4).strip())
    expected = list(settings())
    assert len(expected) > 50
    for section, key, typ, default in expected:
        assert key in found, f"--help does not list {key}"
        assert found[key][:3] == (section, typ, default), (key, found[key])
        assert found[key][3], f"--help does not say what {key} does"
    assert found["train.lr"][3] == "AdamW's peak learning rate"


def test_docs_config_md_is_the_generated_reference():
    from training.config import reference_markdown
    docs = (ROOT / "docs" / "config.md").read_text()
    assert docs == reference_markdown(), \
        "docs/config.md is out of date: regenerate it with `python -m training.config > docs/config.md`"
    for section, key, typ, default in settings():
        assert f"| `{key}` | {typ} | `{default}` |" in docs, key


# ---------------------------------------------------------------- progress

LOG_LINE = re.compile(r"step +(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| +(\d+\.\d) ms/step \| "
                      r"[\d,]+ tok/s \| ETA ((?:\d+:)?\d?\d:\d\d)")


def seconds(duration: str) -> int:
    """'1:02:05' -> 3725, '8:20' -> 500."""
    return sum(int(part) * 60**i for i, part in enumerate(reversed(duration.split(":"))))


def test_each_log_line_shows_the_time_left_to_max_steps(tiny_cfg, capsys):
    max_steps = 100_000
    train(tiny_cfg(**{"train.max_steps": max_steps}), stop_at=6)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 6
    for line in lines:
        m = LOG_LINE.fullmatch(line)
        assert m, line
        step, ms, eta = int(m.group(1)), float(m.group(2)), seconds(m.group(3))
        left = max_steps - step
        assert abs(eta - left * ms / 1000) <= 1 + left * 0.05 / 1000, line   # ms/step is shown to 0.05 ms


def test_the_final_line_gives_the_whole_run_s_time_and_tokens(tiny_cfg, capsys):
    cfg = tiny_cfg(**{"train.grad_accum": 2})
    first = train(cfg, stop_at=10)
    assert "# done" not in capsys.readouterr().out, "a run stopped early is not done"
    rest = train(cfg, resume=True)
    done = capsys.readouterr().out.splitlines()[-1]
    m = re.fullmatch(r"# done: step 20, best val loss (\d+\.\d{4}), ((?:\d+:)?\d?\d:\d\d) \((\d+\.\d) s\), ([\d,]+) tokens",
                     done)
    assert m, done
    assert float(m.group(1)) == pytest.approx(rest["best_val_loss"], abs=5e-5)
    assert float(m.group(3)) == pytest.approx(rest["elapsed_s"], abs=0.05) and rest["elapsed_s"] > first["elapsed_s"]
    assert abs(seconds(m.group(2)) - rest["elapsed_s"]) <= 0.5
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
    assert int(m.group(4).replace(",", "")) == 20 * tokens_per_step, "every step's tokens, the resumed ones too"


# ---------------------------------------------------------------- a busy CPU

@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the note reads what other processes use from /proc/stat")
def test_a_cpu_busy_with_other_work_from_the_start_is_said(tiny_cfg, capsys):
    """Another process keeps a core busy before the run starts, on a machine of 2 cores (as the run sees
    it): the run's 2 threads wait for each other at every step, and the run says so, once."""
    import subprocess
    import sys
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        with num_threads(2), pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "cpu_count", lambda: 2)
            train(tiny_cfg(**{"train.max_steps": 20, "train.log_interval": 10}))
    finally:
        busy.kill()
        busy.wait()
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: other work keeps")]
    assert len(notes) == 1 and "OMP_NUM_THREADS=1" in notes[0], notes
