"""The benchmarks measure what they say: the race's val set is the whole val split, the race finds
the first evaluation at the classic's loss, the FLOP count is the model's. bench.py as a command:
every bad argument is one line before any work, it starts where the system lacks what Linux has,
prepare says what it writes and leaves nothing behind, tokenizers keeps to its time budget."""
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import bench
from benchmarks.race import first_reaching, race, val_loss, val_windows
from benchmarks.step import flops_per_token, plain_step
from common import RunError, on_stop_signals
from data.cache import load_meta
from data.prepare import prepare
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import ROOT, assert_refused, mkdir, run_tool, tiny_overrides, write
from training.config import build_config


def test_race_windows_are_the_whole_val_split_in_order(tiny_cfg):
    cfg = tiny_cfg(**{"model.block_size": 8})
    dataset = prepare(cfg.data)
    meta = load_meta(dataset)
    val = np.fromfile(dataset / "val.bin", dtype=meta["dtype"])
    w = val_windows(dataset, 8)
    assert w.shape == ((len(val) - 1) // 8, 9)
    assert torch.equal(w[:, :-1].flatten(), torch.from_numpy(val[:w.size(0) * 8].astype(np.int64)))
    assert torch.equal(w[:-1, -1], w[1:, 0]), "each window's last target is the next window's first input"


def test_first_reaching_takes_the_first_evaluation_at_or_below_the_target():
    curve = [{"step": s, "val": v} for s, v in [(10, 2.5), (20, 1.9), (30, 1.8), (40, 1.7)]]
    assert first_reaching(curve, 1.8)["step"] == 30
    assert first_reaching(curve, 1.0) is None


def test_race_runs_both_configs_and_reports_the_ratio(tmp_path, text_file):
    slow = tmp_path / "slow.toml"
    slow.write_text("[train]\nlr = 1e-4\nmin_lr = 1e-5\n")
    fast = tmp_path / "fast.toml"
    fast.write_text("[train]\nlr = 1e-2\nmin_lr = 1e-3\n")
    lines = []
    result = race(str(slow), str(fast), tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30}),
                  evals=10, say=lines.append)
    assert [p["step"] for p in result["curves"]["classic"]] == list(range(3, 31, 3))
    assert result["curves"]["fast"][-1]["val"] < result["target"], "a 100x higher lr learns faster"
    assert 0 < result["ratio"] < 1.5 and any(l.startswith("ratio") for l in lines)


def test_flops_per_token_counts_every_matmul_weight_and_causal_attention():
    model = GPT(ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    dense, attn = flops_per_token(model)
    per_layer = 4 * 32 * 32 + 2 * 32 * 128          # q, k, v, proj; MLP up and down
    assert dense == 6 * (2 * per_layer + 50 * 32)    # + the LM head (tied: it is a matmul all the same)
    assert attn == 6 * 2 * 16 * 32


def test_the_plain_step_handles_every_micro_batch_of_a_step():
    """bench_train counts batch x grad_accum x block tokens per step for every row, plain PyTorch's too."""
    cfg = build_config(None, ["--model.vocab_size=50", "--model.n_layer=1", "--model.n_embd=16", "--model.n_head=1",
                              "--model.block_size=8", "--train.batch_size=2", "--train.grad_accum=3"])
    model, step = plain_step(cfg, torch.device("cpu"))
    forwards = []
    model.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
    step()
    assert forwards == [torch.Size([2, 8])] * 3

def test_the_fast_recipe_is_judged_on_the_classic_context_length():
    classic = build_config("configs/shakespeare_char_cpu.toml", [])
    fast = build_config("configs/shakespeare_char_cpu_fast.toml", [])
    assert fast.model.block_size == classic.model.block_size, "a longer context would lower val loss by itself"
    assert fast.data.tokenizer == classic.data.tokenizer


def test_eval_iters_0_scores_every_token_of_the_split_as_the_race_does(tiny_cfg):
    """The trainer's exact evaluation (every window of the split) is the race's val loss, batched otherwise."""
    from training.checkpoint import load_model
    from training.trainer import train
    cfg = tiny_cfg(**{"train.eval_iters": 0, "train.max_steps": 4, "train.eval_interval": 4})
    summary = train(cfg, quiet=True)
    windows = val_windows(prepare(cfg.data), cfg.model.block_size)
    assert summary["val_loss"] == pytest.approx(val_loss(load_model(cfg.out_dir).model, windows, chunk=3), abs=1e-6)


# ---------------------------------------------------------------- bench.py as a command

def tiny_config(e) -> list[str]:
    """An empty config file (the defaults) and the overrides that make its run tiny, on the test's text."""
    return [write(e["tmp"] / "empty.toml", ""), *e["tiny"]]


# (id, argv given the test's environment, what the line names: the option, or the file)
REFUSALS = [
    ("no command", lambda e: [], "command"),
    ("unknown command", lambda e: ["fly"], "fly"),
    ("sample on CUDA without CUDA", lambda e: ["sample", "--device", "cuda"], "--device"),
    ("sample on no device", lambda e: ["sample", "--device", "garbage"], "--device"),
    ("sample 0 new tokens", lambda e: ["sample", "--new-tokens", "0"], "--new-tokens"),
    ("sample new tokens not a number", lambda e: ["sample", "--new-tokens", "many"], "--new-tokens"),
    ("sample unknown option", lambda e: ["sample", "--tokens", "5"], "--tokens"),
    ("scaling unknown option", lambda e: ["scaling", "--fast"], "--fast"),
    ("train 0 steps", lambda e: ["train", *tiny_config(e), "--steps", "0"], "--steps"),
    ("train 0 rounds", lambda e: ["train", *tiny_config(e), "--rounds", "0"], "--rounds"),
    ("train no config file", lambda e: ["train", e["tmp"] / "absent.toml"], "absent.toml"),
    ("train bad override", lambda e: ["train", *tiny_config(e), "--model.n_layer=0"], "model.n_layer"),
    ("race 0 evals", lambda e: ["race", "--evals", "0", *e["tiny"]], "--evals"),
    ("race no classic config", lambda e: ["race", "--classic", e["tmp"] / "absent.toml"], "--classic"),
    ("tokenizers 0 seconds", lambda e: ["tokenizers", "--config", *tiny_config(e), "--seconds", "0"], "--seconds"),
    ("tokenizers nan seconds", lambda e: ["tokenizers", "--config", *tiny_config(e), "--seconds", "nan"],
     "--seconds"),
    ("tokenizers no config file", lambda e: ["tokenizers", "--config", e["tmp"] / "absent.toml"], "--config"),
    ("prepare 0 MB", lambda e: ["prepare", "--mb", "0", "--plain-mb", "1", "--dir", e["work"]], "--mb"),
    ("prepare plain file larger", lambda e: ["prepare", "--mb", "1", "--plain-mb", "2", "--dir", e["work"]],
     "--plain-mb"),
    ("prepare unknown tokenizer", lambda e: ["prepare", "--mb", "1", "--plain-mb", "1", "--tokenizers", "char,nope",
                                             "--dir", e["work"]], "--tokenizers"),
    ("prepare no source", lambda e: ["prepare", "--mb", "1", "--plain-mb", "1", "--source", e["tmp"] / "absent.txt",
                                     "--dir", e["work"]], "--source"),
    ("prepare no dir", lambda e: ["prepare", "--mb", "1", "--plain-mb", "1", "--dir", e["tmp"] / "absent"], "--dir"),
    ("prepare unknown option", lambda e: ["prepare", "--mbs", "1", "--dir", e["work"]], "--mbs"),
    ("gpu 0 micro-batches", lambda e: ["gpu", "--grad-accum-124m", "0", "--out", e["tmp"] / "report"],
     "--grad-accum-124m"),
]


@pytest.mark.parametrize("make_argv, named", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_every_bad_argument_of_bench_is_one_line_and_exit_2(make_argv, named, tmp_path, text_file, capsys):
    """As train.py's refusals: exit 2, one `error:` line naming the option, before any work (nothing written)."""
    env = {"tmp": tmp_path, "work": mkdir(tmp_path / "work"), "tiny": tiny_overrides(tmp_path, text_file)}
    assert_refused(bench, make_argv(env), capsys, tmp_path, named)


def test_bench_starts_where_the_system_has_no_load_average(monkeypatch, capsys):
    """os.getloadavg is missing on Windows: the header says the load where it can, and the command runs."""
    from benchmarks import sampling, step
    monkeypatch.setattr(step, "bench_scaling", lambda: print("scaling ran"))
    monkeypatch.setattr(sampling, "bench_samples_scaling", lambda: None)
    if hasattr(os, "getloadavg"):
        rc, out, err = run_tool(bench, ["scaling"], capsys)
        assert rc == 0 and re.search(r"load average \d+\.\d\d", out) and "scaling ran" in out, (out, err)
    monkeypatch.delattr(os, "getloadavg", raising=False)
    rc, out, err = run_tool(bench, ["scaling"], capsys)
    assert rc == 0 and not err and "scaling ran" in out, (out, err)
    assert "load average unknown" in out.splitlines()[0], out


# The start of prepare's measuring child on a system without /proc and without the resource module (Windows).
NO_PROC_NO_RESOURCE = """
import builtins, sys
sys.modules["resource"] = None                     # `import resource` raises ImportError
real_open = builtins.open
def no_proc(path, *args, **kwargs):
    if str(path).startswith("/proc"):
        raise FileNotFoundError(path)
    return real_open(path, *args, **kwargs)
builtins.open = no_proc
print("measured")
"""


def test_prepare_measures_where_the_system_has_neither_proc_nor_resource():
    """Peak memory comes from /proc, else from the resource module; with neither it is unknown, not an error."""
    from benchmarks import prepare as bench_prepare
    done = subprocess.run([sys.executable, "-c", bench_prepare._MEASURE, "-c", NO_PROC_NO_RESOURCE], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "measured\n", done
    assert "Error" not in done.stderr and "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr
    took, peak = bench_prepare.measure("-c", NO_PROC_NO_RESOURCE, [])
    assert took > 0 and math.isnan(peak)
    assert bench_prepare.peak_text(peak) == "peak unknown"


def small_prepare(source) -> list:
    return ["prepare", "--mb", "1", "--plain-mb", "1", "--tokenizers", "char", "--source", source]


def test_prepare_says_what_it_writes_and_leaves_nothing_behind(tmp_path, text_file, monkeypatch, capsys):
    temp = mkdir(tmp_path / "temp")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))        # the system's temporary directory, for this test
    rc, out, err = run_tool(bench, small_prepare(text_file), capsys)
    assert rc == 0, (out, err)
    said = next(line for line in out.splitlines() if "writes" in line)
    assert str(temp) in said and "1 MB" in said and "removed afterwards" in said, said
    assert out.index(said) < out.index(" MB/s"), "said before it writes"
    assert re.search(r"^ +1 MB +char +stream +[\d.]+ MB/s", out, re.M) and " plain " in out, out
    assert list(temp.iterdir()) == [], "no file and no directory is left behind"


def test_prepare_removes_what_it_wrote_when_a_measurement_fails(tmp_path, text_file, monkeypatch, capsys):
    from benchmarks import prepare as bench_prepare
    work = mkdir(tmp_path / "work")

    def fail(*args):
        assert list(work.glob("*/text_1mb.txt")), "the text is written before it is measured"
        raise RunError("data.prepare failed")
    monkeypatch.setattr(bench_prepare, "measure", fail)
    rc, out, err = run_tool(bench, [*small_prepare(text_file), "--dir", work], capsys)
    assert rc == 2 and err == "error: data.prepare failed\n", err
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_prepare_removes_what_it_wrote_when_stopped_by_a_signal(signum, tmp_path, text_file, monkeypatch, capsys):
    from benchmarks import prepare as bench_prepare
    work = mkdir(tmp_path / "work")
    # (raise_signal, not os.kill: on Windows os.kill ends the process)
    monkeypatch.setattr(bench_prepare, "measure", lambda *args: signal.raise_signal(signum) or time.sleep(5))
    with on_stop_signals(lambda got: pytest.fail(f"{signal.Signals(got).name} reached the test: prepare left it")):
        rc, out, err = run_tool(bench, [*small_prepare(text_file), "--dir", work], capsys)
    assert rc == 128 + signum and err == f"interrupted: stopped by {signal.Signals(signum).name}\n", (rc, err)
    assert list(work.iterdir()) == []


def test_prepare_refuses_a_dir_without_the_space_it_would_write(tmp_path, text_file, monkeypatch, capsys):
    from benchmarks import prepare as bench_prepare
    monkeypatch.setattr(bench_prepare.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 5e6}))
    rc, out, err = run_tool(bench, ["prepare", "--mb", "2", "--plain-mb", "1", "--source", text_file,
                                    "--dir", tmp_path], capsys)
    assert rc == 2 and err.startswith(f"error: --dir {tmp_path} has 5 MB free; this run writes up to about 7 MB"), err
    assert sorted(tmp_path.iterdir()) == [text_file]

# ---------------------------------------------------------------- bench.py tokenizers: the time budget

def test_on_step_can_end_a_run_as_stop_at_does(tiny_cfg):
    """What the tokenizers' time budget relies on: on_step returning True ends the run after that step,
    with its evaluation and checkpoint, not as an interruption."""
    from training.checkpoint import load_model
    from training.trainer import train
    cfg = tiny_cfg(**{"train.max_steps": 20, "train.eval_interval": 20})
    summary = train(cfg, quiet=True, on_step=lambda step, model: step == 3)
    assert summary["step"] == 3 and not summary["interrupted"] and summary["exit_code"] == 0
    assert summary["val_loss"] is not None and load_model(cfg.out_dir).step == 3


def test_each_tokenizer_trains_within_its_budget_when_steps_slow_down_after_the_probe(tmp_path, text_file,
                                                                                     monkeypatch):
    """The probe plans the steps; a machine that slows down after it (here 50 ms more per step) must not
    stretch the run: it ends near the budget, and the table says how many steps it trained."""
    from benchmarks import tokenizers
    real_train = tokenizers.train

    def slower_after_the_probe(cfg, on_step=None, **kw):
        if Path(cfg.out_dir).name == "probe":
            return real_train(cfg, on_step=on_step, **kw)

        def slow(step, model):
            time.sleep(0.05)
            return on_step(step, model) if on_step else None
        return real_train(cfg, on_step=slow, **kw)
    monkeypatch.setattr(tokenizers, "train", slower_after_the_probe)
    lines, seconds = [], 1.0
    rows = tokenizers.bench_tokenizers(None, tiny_overrides(tmp_path, text_file), seconds=seconds,
                                       tokenizers=("char",), say=lines.append)
    row = rows["char"]
    assert row["seconds"] < 1.25 * seconds + 0.5, row                  # the margin, one step, the final evaluation
    assert row["planned"] * 0.05 > 2 * seconds, "the slowed run would have taken far longer than its budget"
    assert 0 < row["steps"] < row["planned"], row
    assert f"{row['steps']} of {row['planned']} steps" in lines[0], lines
