"""bench.py measures what it says: train reports the ms/step the trainer measured over its own log
intervals (and plain PyTorch's per step), with the model's FLOP count in its MFU; sample times decodes
with and without the cache at batch 1 and 16; the race runs train.py as a user does, times each
evaluation from the launch and finds the fast run's first evaluation at or below the classic's best.
As a command: every bad argument is one line and exit 2, before any work."""
import functools
import os
import re
import tempfile
import time
import types

import pytest
import torch

import bench
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import assert_refused, interrupt_at, mkdir, run_tool, tiny_overrides, write
from training.config import build_config

PEAK = 1e9   # the matmul peak the train tests divide by (measuring it takes seconds of its own)


@pytest.fixture
def temp(tmp_path, monkeypatch):
    """A folder of the test's own for bench.py's temporary directories, to see what it leaves.
    Only bench's: torch keeps its compile caches in the process's temporary folder, which the
    tests that compile share."""
    made_in = functools.partial(tempfile.TemporaryDirectory, dir=mkdir(tmp_path / "temp"))
    monkeypatch.setattr(bench, "tempfile", types.SimpleNamespace(TemporaryDirectory=made_in))
    return tmp_path / "temp"


def bench_dirs(temp) -> list:
    """What bench.py left in the temporary directory."""
    return [p for p in temp.iterdir() if p.name.startswith("bench_")]


def bench_train_argv(tmp_path, text_file, *extra) -> list:
    return ["train", write(tmp_path / "empty.toml", ""), *tiny_overrides(tmp_path, text_file), *extra]


def test_bench_train_reports_the_median_of_the_trainer_s_own_log_intervals(
        tmp_path, text_file, temp, monkeypatch, capsys):
    """One train() run: a warm-up interval, then --rounds intervals of --steps steps, each timed by the
    trainer itself; the row is their median, its tokens/s and MFU follow from it and the model's FLOPs."""
    from training import trainer
    monkeypatch.setattr(bench, "matmul_peak", lambda device, dtype: PEAK)
    calls, real_train = [], trainer.train

    def train(cfg, **kw):
        summary = real_train(cfg, **kw)
        calls.append((cfg, kw, summary["intervals"], os.path.isdir(cfg.out_dir)))
        return {**summary, "intervals": [(3, 500.0), (3, 30.0), (3, 10.0), (3, 20.0)]}   # the trainer's figures
    monkeypatch.setattr(trainer, "train", train)
    rc, out, err = run_tool(bench, bench_train_argv(tmp_path, text_file, "--steps", "3", "--rounds", "3"), capsys)
    assert rc == 0, (out, err)
    (cfg, kw, intervals, had_out_dir), = calls
    assert kw == {"quiet": True}, "no hook, no stopping: the trainer runs to its end"
    assert intervals == [(3, pytest.approx(ms)) for _, ms in intervals] and len(intervals) == 4, intervals
    assert cfg.train.log_interval == 3 and cfg.train.max_steps == 12 and cfg.train.eval_interval >= 12
    assert had_out_dir and bench_dirs(temp) == [], "its out dir was a temporary one, removed afterwards"
    assert re.match(r"# .+ x \d+ cores, .+ \| torch .+ threads .+ \| load average [\d.]+\n", out), out
    tokens_per_s = 8 * 32 * 1000 / 20.0                       # batch x block at the median, 20 ms
    dense, attn = bench.flops_per_token(GPT(cfg.model))
    mfu = (dense + attn) * tokens_per_s / PEAK
    row = re.search(r"^trainer +20\.00 +([\d,]+) +([\d.]+)%  eager, float32; warm-up 500\.0 ms/step$", out, re.M)
    assert row and row[1] == f"{tokens_per_s:,.0f}" and row[2] == f"{mfu * 100:.1f}", out
    plain = re.search(r"^plain +([\d.]+) +[\d,]+ +[\d.]+%  eager, float32, torch.optim.AdamW$", out, re.M)
    assert plain, out
    assert f"trainer: {float(plain[1]) / 20:.2f}x plain PyTorch's speed (median of 3 intervals of 3 steps" in out


def test_bench_train_stopped_by_ctrl_c_exits_130_and_leaves_nothing(tmp_path, text_file, temp,
                                                                     monkeypatch, capsys):
    """Ctrl-C reaches the trainer, which finishes its step and returns; bench prints no figures."""
    monkeypatch.setattr(bench, "matmul_peak", lambda device, dtype: PEAK)
    interrupt_at(monkeypatch, 2)
    rc, out, err = run_tool(bench, bench_train_argv(tmp_path, text_file, "--steps", "2"), capsys)
    assert rc == 130 and "ms/step" not in out, (rc, out, err)   # (the trainer's note goes to fd 2 itself)
    assert bench_dirs(temp) == []


def test_plain_pytorch_s_step_runs_every_micro_batch_and_is_timed_per_step(monkeypatch):
    """An optimizer step of half a second: a step's time is that and the tiny model's work, not
    two steps' (a round's), however busy the machine."""
    cfg = build_config(None, ["--model.vocab_size=50", "--model.n_layer=1", "--model.n_embd=16",
                              "--model.n_head=1", "--model.block_size=8", "--train.batch_size=2",
                              "--train.grad_accum=3"])
    forwards, real_forward, real_step = [], GPT.forward, torch.optim.AdamW.step
    monkeypatch.setattr(GPT, "forward",
                        lambda self, x, y: forwards.append(x.shape) or real_forward(self, x, y))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self: time.sleep(0.5) or real_step(self))
    ms = bench.plain_ms_per_step(cfg, torch.device("cpu"), steps=2, rounds=2)
    three = "3 micro-batches a step, 2 steps a round, 3 rounds"
    assert forwards == [torch.Size([2, 8])] * 3 * 2 * 3, three
    assert 500 <= ms < 1000, ms


def test_flops_per_token_counts_every_matmul_weight_and_causal_attention():
    model = GPT(ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    dense, attn = bench.flops_per_token(model)
    per_layer = 4 * 32 * 32 + 2 * 32 * 128          # q, k, v, proj; MLP up and down
    assert dense == 6 * (2 * per_layer + 50 * 32)    # + the LM head (tied: a matmul all the same)
    assert attn == 6 * 2 * 16 * 32


def test_bench_sample_times_decodes_with_and_without_the_cache_at_batch_1_and_16(monkeypatch, capsys):
    import model.sampling
    monkeypatch.setattr(bench, "SAMPLE_SHAPE", dict(vocab_size=20, block_size=16, n_layer=1, n_head=1, n_embd=16))
    calls, real = [], model.sampling.generate

    def generate(model, idx, new_tokens, **kw):
        calls.append((idx.size(0), kw["decoding"].use_cache, new_tokens))
        return real(model, idx, new_tokens, **kw)
    monkeypatch.setattr(model.sampling, "generate", generate)
    import speed.decoding
    compiled = []   # (compiling on a CPU takes tens of seconds: the hook itself is sample.py's tests')
    monkeypatch.setattr(speed.decoding, "compiled", lambda step, args: compiled.append(1) or step)
    rc, out, err = run_tool(bench, ["sample", "--device", "cpu", "--new-tokens", "12"], capsys)
    assert rc == 0, (out, err)
    assert sorted({c for c in calls if c[2] == 12}) == [(1, False, 12), (1, True, 12), (16, False, 12), (16, True, 12)]
    assert compiled, "the compiled decode is timed too"
    for batch in (1, 16):
        row = re.search(rf"^ +{batch} +([\d,.]+) +([\d,.]+) +([\d,.]+)  cached [\d.]+x recomputed, compiled "
                        rf"[\d.]+x cached$", out, re.M)
        assert row, out


def test_the_race_times_train_py_from_launch_and_finds_the_first_evaluation_at_the_classic_s_best(
        tmp_path, text_file, temp, capsys):
    slow = write(tmp_path / "slow.toml", "[train]\nlr = 1e-4\nmin_lr = 1e-5\n")
    fast = write(tmp_path / "fast.toml", "[train]\nlr = 1e-2\nmin_lr = 1e-3\n")
    overrides = tiny_overrides(tmp_path, text_file, **{"train.max_steps": 24, "train.eval_interval": 6,
                                                       "train.eval_iters": 0})
    result = bench.race(str(slow), str(fast), overrides)
    out = capsys.readouterr().out
    classic, fast_curve = result["curves"]["classic"], result["curves"]["fast"]
    assert [p["step"] for p in classic] == [6, 12, 18, 24], "every evaluation, as the run made it"
    assert all(0 < a["seconds"] < b["seconds"] for a, b in zip(classic, classic[1:])), "timed from launch"
    assert classic[0]["seconds"] > 0.5, "the process's start counts"
    assert result["target"] == min(p["val"] for p in classic)
    hit = result["hit"]
    assert hit is not None, "a 100x higher lr learns faster"
    assert all(p["val"] > result["target"] for p in fast_curve if p["step"] < hit["step"]) and \
        hit["val"] <= result["target"], "the first evaluation at or below the target"
    assert result["ratio"] == hit["seconds"] / min(classic, key=lambda p: p["val"])["seconds"]
    words = f"{1 / result['ratio']:.2f}x faster" if result["ratio"] < 1 else f"{result['ratio']:.2f}x slower"
    assert f"{result['ratio']:.3f} ({words})" in out, out
    assert bench_dirs(temp) == [], "the runs' out dirs go with the race"


def test_the_race_finds_its_default_configs_from_any_directory(tmp_path, monkeypatch, capsys):
    """And its first line says the load where the system can tell it (Windows has no load average)."""
    raced = []
    monkeypatch.setattr(bench, "race", lambda classic, fast, overrides: raced.append((classic, fast)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delattr(os, "getloadavg", raising=False)
    rc, out, err = run_tool(bench, ["race"], capsys)
    assert rc == 0 and all(os.path.isfile(path) for path in raced[0]), (out, err)
    assert out.splitlines()[0].endswith("load average unknown"), out


def test_the_fast_recipe_is_judged_on_the_classic_context_length():
    for classic, fast in bench.PAIRS.values():
        classic, fast = (build_config(str(bench.ROOT / path), []) for path in (classic, fast))
        assert fast.model.block_size == classic.model.block_size, "a longer context would lower val loss by itself"
        assert fast.data.tokenizer == classic.data.tokenizer


# (id, argv given the test's environment, what the line names)
REFUSALS = [
    ("no command", lambda e: [], "command"),
    ("unknown command", lambda e: ["fly"], "fly"),
    ("removed command", lambda e: ["tokenizers"], "tokenizers"),
    ("sample on no device", lambda e: ["sample", "--device", "garbage"], "--device"),
    ("sample 0 new tokens", lambda e: ["sample", "--new-tokens", "0"], "--new-tokens"),
    ("sample new tokens not a number", lambda e: ["sample", "--new-tokens", "many"], "--new-tokens"),
    ("sample unknown option", lambda e: ["sample", "--tokens", "5"], "--tokens"),
    ("sample override", lambda e: ["sample", "--train.lr=1"], "--train.lr"),
    ("train 0 steps", lambda e: bench_train_argv(e["tmp"], e["text"], "--steps", "0"), "--steps"),
    ("train 0 rounds", lambda e: bench_train_argv(e["tmp"], e["text"], "--rounds", "0"), "--rounds"),
    ("train no config file", lambda e: ["train", e["tmp"] / "absent.toml"], "absent.toml"),
    ("train bad override", lambda e: bench_train_argv(e["tmp"], e["text"], "--model.n_layer=0"), "model.n_layer"),
    ("train unknown option", lambda e: bench_train_argv(e["tmp"], e["text"], "--warmup", "3"), "warmup"),
    ("race no classic config", lambda e: ["race", "--classic", e["tmp"] / "absent.toml"], "absent.toml"),
    ("race bad override", lambda e: ["race", "--train.lr=-1"], "train.lr"),
]


@pytest.mark.parametrize("make_argv, named", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_every_bad_argument_of_bench_is_one_line_and_exit_2(make_argv, named, tmp_path, text_file, capsys):
    """As train.py's refusals: exit 2, one `error:` line naming what is wrong, before any work."""
    assert_refused(bench, make_argv({"tmp": tmp_path, "text": text_file}), capsys, tmp_path, named)
