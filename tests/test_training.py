"""The loop learns, checkpoints are written while the steps go on; a run writes
its config and metrics; --help documents every setting; the log lines say how long is left, the
final line the whole run's time and tokens, the banner a warm-up longer than the run. train.py then
sample.py (exit codes, what they print), and the first command, as a process, with no network."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sample as sample_cli
import train as train_cli
from common import UserError
from loading import list_checkpoints, read_checkpoint
from tests.conftest import ROOT, TEXT, interrupt_at, records, resumed_copy, run_tool, tiny_overrides
from training.config import Config, FIELDS, flat, fmt
from training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")   # tiny models: one intra-op thread


def test_a_tiny_model_overfits_a_short_text(tiny_cfg, text_file):
    text_file.write_text(TEXT[:400])
    cfg = tiny_cfg(**{"model.n_embd": 64, "train.max_steps": 300, "train.lr": 1e-2, "train.min_lr": 1e-3,
                      "train.batch_size": 16, "train.eval_interval": 300, "train.log_interval": 50,
                      "train.weight_decay": 0.0, "train.warmup_steps": 5})
    train(cfg, quiet=True)
    assert records(cfg.out_dir)[300] < 0.2   # from ln(42) = 3.7; ~0.1 give or take rounding


def test_a_run_writes_its_config_and_metrics_as_it_ran(trained):
    """config.toml loads back as the run's resolved config; every log and eval line is a metrics record."""
    from training.config import build_config
    ckpt = read_checkpoint(trained / "best.pt")
    assert build_config(str(trained / "config.toml"), []).to_dict() == ckpt["config"]
    records = [json.loads(l) for l in open(trained / "metrics.jsonl")]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert steps == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records if r["kind"] == "train")
    assert ckpt["best_val_loss"] == min(r["val_loss"] for r in evals), "best.pt is the lowest val loss recorded"


def test_a_checkpoint_is_written_while_the_steps_go_on_and_is_on_disk_when_the_run_returns(tiny_cfg,
                                                                                          monkeypatch):
    """The state is copied to host memory at the checkpoint's step, then written by another thread: a slow
    disk holds up no step, what is written is the state of that step, and train() returns once it is on
    disk. A write that fails ends the run with its error."""
    import threading
    import time
    import training.checkpoint as trainer
    real, writers, steps_meanwhile = trainer.save_checkpoint, [], []

    def slow(ckpt, out, keep):
        writers.append(threading.current_thread() is not threading.main_thread())
        before = len(records(out))
        time.sleep(0.5)
        steps_meanwhile.append(len(records(out)) - before)
        return real(ckpt, out, keep)
    monkeypatch.setattr(trainer, "save_checkpoint", slow)
    cfg = tiny_cfg(**{"train.max_steps": 20, "train.eval_interval": 5})
    train(cfg, quiet=True)
    assert writers == [True] * 4 and max(steps_meanwhile) > 0, "steps ran while a checkpoint was written"
    assert [s for s, _ in list_checkpoints(cfg.out_dir)] == [15, 20]
    assert read_checkpoint(f"{cfg.out_dir}/ckpt_0000015.pt")["step"] == 15
    resumed = resumed_copy(cfg, 15, Path(cfg.out_dir).parent / "resumed")
    assert records(resumed) == pytest.approx(records(cfg.out_dir), abs=1e-6), "the state of its own step"

    def failing(ckpt, out, keep):
        raise UserError("could not write the checkpoint: is the disk full?")
    monkeypatch.setattr(trainer, "save_checkpoint", failing)
    with pytest.raises(UserError, match="is the disk full"):
        train(tiny_cfg(out_dir=Path(cfg.out_dir).parent / "failing"), quiet=True)


def test_help_documents_every_setting_with_type_default_and_meaning(capsys):
    rc, out, err = run_tool(train_cli, ["--help"], capsys)
    assert rc == 0 and not err
    found = {m[1]: (m[2], m[3], m[4]) for line in out.splitlines()
             if (m := re.fullmatch(r"  --([\w.]+)=(\S*) +(\w+) +(.*)", line))}
    defaults = flat(Config().to_dict())
    assert len(FIELDS) > 50 and set(found) == set(FIELDS)
    for key, field in FIELDS.items():
        assert found[key] == (fmt(defaults[key]), field.type.__name__, field.metadata["help"]), key
    assert found["train.lr"][2] == "AdamW's peak learning rate"


def test_docs_config_md_shows_the_help_of_today(capsys):
    rc, out, _ = run_tool(train_cli, ["--help"], capsys)
    assert rc == 0 and out[out.index("Settings"):] in (ROOT / "docs" / "config.md").read_text(), \
        "docs/config.md is out of date: paste the settings of `python train.py --help` into it"


LOG_LINE = re.compile(r"step +(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| "
                      r"+(\d+\.\d) ms/step \| [\d,]+ tok/s \| ETA ((?:\d+:)?\d?\d:\d\d)")


def seconds(duration: str) -> int:
    """'1:02:05' -> 3725, '8:20' -> 500."""
    return sum(int(part) * 60**i for i, part in enumerate(reversed(duration.split(":"))))


def test_each_log_line_shows_the_time_left_at_the_whole_run_s_pace(tiny_cfg, capsys, monkeypatch):
    """The time left is the steps left at the pace of the whole run so far (its evaluations too),
    not of the last log interval alone: here each step's time, and the ETA, within a factor of
    two."""
    max_steps = 100_000
    interrupt_at(monkeypatch, 8)
    train(tiny_cfg(**{"train.max_steps": max_steps, "train.eval_interval": 3}))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 8
    ms = []
    for line in lines:
        m = LOG_LINE.fullmatch(line)
        assert m, line
        step, eta = int(m[1]), seconds(m[3])
        ms.append(float(m[2]))
        pace = sum(ms) / len(ms) / 1000
        assert 0.5 * pace * (max_steps - step) <= eta, line


def test_the_final_line_gives_the_whole_run_s_time_and_tokens(tiny_cfg, capsys, monkeypatch):
    cfg = tiny_cfg(**{"train.grad_accum": 2})
    interrupt_at(monkeypatch, 10)
    first = train(cfg)
    assert "# done" not in capsys.readouterr().out, "a run stopped early is not done"
    monkeypatch.undo()
    rest = train(cfg, resume=True)
    done = capsys.readouterr().out.splitlines()[-1]
    m = re.fullmatch(r"# done: step 20, best val loss (\d+\.\d{4}), ((?:\d+:)?\d?\d:\d\d) "
                     r"\((\d+\.\d) s\), ([\d,]+) tokens; to sample it: python (\S+) (\S+)", done)
    assert m and Path(m[5]).absolute() == ROOT / "sample.py", done
    assert Path(m[6]).absolute() == Path(cfg.out_dir), "the sample command of this run, from here"
    assert float(m.group(1)) == pytest.approx(rest["best_val_loss"], abs=5e-5)
    assert float(m.group(3)) == pytest.approx(rest["elapsed_s"], abs=0.05)
    assert rest["elapsed_s"] > first["elapsed_s"]
    assert abs(seconds(m.group(2)) - rest["elapsed_s"]) <= 0.5
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.block_size
    tokens = int(m.group(4).replace(",", ""))
    assert tokens == 20 * tokens_per_step, "every step's tokens, the resumed ones too"


def test_a_warm_up_longer_than_the_run_is_said_in_the_banner(tiny_cfg, capsys):
    train(tiny_cfg(**{"train.max_steps": 4, "train.warmup_steps": 10, "train.eval_interval": 4}))
    out = capsys.readouterr().out
    assert "train.warmup_steps = 10 is not below train.max_steps = 4" in out, out
    assert "--train.warmup_steps=1" in out


def run(*args, cwd=ROOT, env=None):
    env = env or {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_train_then_sample(tmp_path, text_file, capsys):
    """As the commands' __main__ runs them (as real processes: tests/test_readme.py)."""
    out = tmp_path / "out"
    args = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30, "train.log_interval": 10})
    rc, stdout, err = run_tool(train_cli, args, capsys)
    assert rc == 0, err
    assert f"\n# {out}: a new run" in stdout and "step     30 | loss" in stdout
    changed = next(l for l in stdout.splitlines() if l.startswith("# not the defaults: "))
    set_here = ("n_layer = 2", "n_head = 2", "n_embd = 32", "block_size = 32")
    assert all(f"model.{k}" in changed for k in set_here), changed
    assert "model.dropout" not in changed and "train.lr" not in changed, "a default is not a change"
    assert "model.vocab_size" not in changed, "the data's vocabulary is no change"
    assert "parameters, vocab 48 |" in stdout, "the data's vocabulary is said"
    assert all((out / name).exists() for name in ("best.pt", "metrics.jsonl", "config.toml"))
    assert "(on the device)" in stdout, "a small dataset is copied to the device"

    sample = [out, "--prompt", "First", "--num-samples", 2, "--max-new-tokens", 40, "--seed", 3]
    rc, stdout, err = run_tool(sample_cli, sample, capsys)
    assert rc == 0, err
    samples = stdout.split("--- sample ")[1:]
    assert len(samples) == 2
    for s in samples:
        body = s.split("\n", 1)[1].rstrip("\n")
        assert body.startswith("First") and len(body) == len("First") + 40
    assert run_tool(sample_cli, sample, capsys)[1] == stdout, "a seed fixes the samples"

    greedy = [out, "--prompt", "", "--max-new-tokens", 10, "--temperature", 0]
    rc, stdout, err = run_tool(sample_cli, greedy, capsys)
    # 10 characters and the final newline
    assert rc == 0 and len(stdout) == 11, err


def test_the_first_command_works_without_a_network_from_any_directory(tmp_path):
    """python /path/to/repo/train.py on a fresh machine with no network, from another directory:
    the default data ships with the repository and is the repository's, and a relative --out_dir
    is the working directory's. The child process can neither resolve a name nor connect anywhere
    (sitecustomize, run at start)."""
    blocker = tmp_path / "offline"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import socket\n"
        "def refuse(*a, **k):\n"
        "    raise OSError('no network in this test')\n"
        "socket.socket.connect = socket.socket.connect_ex = refuse\n"
        "socket.create_connection = socket.getaddrinfo = refuse\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}"}
    args = [ROOT / "train.py", "--out_dir=run", "--data.prepared_dir=prep", "--train.max_steps=3",
            "--train.warmup_steps=1", "--train.eval_interval=3", "--train.eval_iters=1",
            "--train.log_interval=1", "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=1",
            "--model.block_size=16"]
    r = run(*args, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "data/tinyshakespeare.txt" in r.stdout and "# done: step 3" in r.stdout
    assert (tmp_path / "run" / "ckpt_0000003.pt").is_file() and any((tmp_path / "prep").iterdir())
    default_text = str(ROOT / "data" / "tinyshakespeare.txt")
    assert default_text in (tmp_path / "run" / "config.toml").read_text()
    probe = run("-c", "import socket; socket.socket().connect(('127.0.0.1', 9))", env=env)
    assert probe.returncode != 0 and "no network" in probe.stderr, "the child really had no network"
