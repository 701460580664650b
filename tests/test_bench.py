"""The benchmarks measure what they say: bench.py train times the trainer's own loop, the race runs
train.py as a user does and finds the first evaluation at the classic's loss, the FLOP count is the
model's. bench.py as a command: every bad argument is one line before any work, it starts where the
system lacks what Linux has, prepare says what it writes (and what its flags caused) and leaves
nothing behind, tokenizers keeps to its time budget."""
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

import bench
from benchmarks import step
from benchmarks.race import faster_or_slower, first_reaching, race
from benchmarks.step import flops_per_token, plain_step
from common import UserError, on_stop_signals
from model.config import ModelConfig
from model.gpt import GPT
from tests.conftest import assert_refused, mkdir, run_tool, tiny_overrides, write
from training.config import build_config


def test_bench_train_times_the_trainer_s_own_loop_in_rounds(tmp_path, text_file, monkeypatch, capsys):
    """One warm-up round, then --rounds rounds of --steps steps of train() itself, nothing else inside
    them: a row per step kind, plain PyTorch's too, with the columns a log line's ms/step compares with."""
    from training import trainer
    monkeypatch.setattr(step, "matmul_peak", lambda device, dtype: {"torch.mm": 1e12})   # (seconds of its own)
    calls, real_train = [], trainer.train

    def train(cfg, **kw):
        calls.append(cfg)
        return real_train(cfg, **kw)
    monkeypatch.setattr(step, "train", train)
    real_plain = step.plain_step

    def plain_of_20_ms(cfg, device):   # plain PyTorch's step, 20 ms slower: its row must say so, per step
        model, plain = real_plain(cfg, device)
        return model, lambda: plain() or time.sleep(0.02)
    monkeypatch.setattr(step, "plain_step", plain_of_20_ms)
    rc, out, err = run_tool(bench, ["train", write(tmp_path / "empty.toml", ""), *tiny_overrides(tmp_path, text_file),
                                    "--steps", "3", "--rounds", "2"], capsys)
    assert rc == 0, (out, err)
    cfg, = calls
    assert cfg.train.log_interval > 9 and cfg.train.eval_interval > 9, "no log line or evaluation inside the rounds"
    assert re.search(r"^step +ms/step +tokens/s +MFU  how$", out, re.M), out
    assert re.search(r"^trainer +[\d.]+ +[\d,]+ +[\d.]+%  cpu, float32, eager; set-up and warm-up round [\d.]+ s$",
                     out, re.M), out
    plain = re.search(r"^plain +([\d.]+) +[\d,]+ +[\d.]+%  eager, fp32, default AdamW$", out, re.M)
    assert plain and 20 < float(plain[1]) < 60, out
    assert "(median of 2 rounds of 3 steps)" in out
    assert not any((tmp_path / "out").glob("*.pt")), "the timed run leaves no checkpoint"


def test_time_trainer_rounds_are_the_steps_between_round_boundaries(tiny_cfg, tmp_path, monkeypatch):
    """Each round's time is its own steps', and what runs between rounds (plain PyTorch's round) is not in it."""
    seen = []
    real = step.train

    def slow_steps(cfg, on_step=None, **kw):
        def on(s, model):
            seen.append(s)
            time.sleep(0.05)
            return on_step(s, model)
        return real(cfg, on_step=on, **kw)
    monkeypatch.setattr(step, "train", slow_steps)
    times, setup, how = step.time_trainer(tiny_cfg(), tmp_path / "run", 2, 3, between=lambda: time.sleep(0.6))
    assert seen == list(range(1, 9)), "a warm-up round and 3 rounds of 2 steps, then the run ends"
    assert len(times) == 3 and all(0.1 <= t < 0.5 for t in times), times
    assert setup > 0 and how == "cpu, float32, eager"


def test_race_runs_train_py_and_reports_time_from_launch_to_the_classic_s_best(tmp_path, text_file):
    slow = write(tmp_path / "slow.toml", "[train]\nlr = 1e-4\nmin_lr = 1e-5\n")
    fast = write(tmp_path / "fast.toml", "[train]\nlr = 1e-2\nmin_lr = 1e-3\n")
    lines = []
    result = race(str(slow), str(fast), tiny_overrides(tmp_path, text_file, **{"train.max_steps": 30}),
                  evals=10, say=lines.append)
    classic = result["curves"]["classic"]
    assert [p["step"] for p in classic] == list(range(3, 31, 3))
    assert all(0 < a["seconds"] < b["seconds"] for a, b in zip(classic, classic[1:])), "timed from launch"
    assert classic[0]["seconds"] > 0.5, "the process's start counts"
    assert result["curves"]["fast"][-1]["val"] < result["target"], "a 100x higher lr learns faster"
    assert result["target"] == min(p["val"] for p in classic)
    ratio = next(line for line in lines if line.startswith("ratio"))
    assert f"{result['ratio']:.3f} ({faster_or_slower(result['ratio'])})" in ratio, ratio


def test_the_race_scores_a_checkpoint_as_the_trainer_s_exact_evaluation_does(tiny_cfg):
    """The race's val loss of a checkpoint is what train.eval_iters = 0 reports: every token of the val split."""
    from benchmarks.race import exact_val_loss
    from training.checkpoint import latest_checkpoint
    from training.trainer import train
    cfg = tiny_cfg(**{"train.eval_iters": 0, "train.max_steps": 4, "train.eval_interval": 4})
    summary = train(cfg, quiet=True)
    assert exact_val_loss(cfg, latest_checkpoint(cfg.out_dir)) == pytest.approx(summary["val_loss"], abs=1e-6)


@pytest.mark.parametrize("ratio, words", [(2.037, "2.04x slower"), (0.49, "2.04x faster"), (1.0, "as fast")])
def test_a_ratio_of_times_says_slower_above_1_and_faster_below(ratio, words):
    """Issue 30: '2.037 (0.49x faster)' said of a run twice as slow."""
    assert faster_or_slower(ratio) == words


def test_first_reaching_takes_the_first_evaluation_at_or_below_the_target():
    curve = [{"step": s, "val": v} for s, v in [(10, 2.5), (20, 1.9), (30, 1.8), (40, 1.7)]]
    assert first_reaching(curve, 1.8)["step"] == 30
    assert first_reaching(curve, 1.0) is None


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
    model, plain = plain_step(cfg, torch.device("cpu"))
    forwards = []
    model.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
    plain()
    assert forwards == [torch.Size([2, 8])] * 3


def test_race_and_tokenizers_find_their_default_configs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = bench.parser()
    for argv, option in ((["race"], "classic"), (["race"], "fast"), (["tokenizers"], "config")):
        args, overrides = p.parse_known_args(argv)
        bench.check_args(p, args, overrides)
        assert Path(getattr(args, option)).is_file()


def test_the_fast_recipe_is_judged_on_the_classic_context_length():
    for kind in ("cpu", "cuda"):
        from benchmarks.race import PAIRS
        classic, fast = (build_config(path, []) for path in PAIRS[kind])
        assert fast.model.block_size == classic.model.block_size, "a longer context would lower val loss by itself"
        assert fast.data.tokenizer == classic.data.tokenizer


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
    ("gpu bad override", lambda e: ["gpu", "--train.lr=-1", "--out", e["tmp"] / "report"], "train.lr"),
    ("gpu unknown option", lambda e: ["gpu", "--grad-accum-124m", "4", "--out", e["tmp"] / "report"],
     "grad-accum-124m"),
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


def small_prepare(source) -> list:
    return ["prepare", "--mb", "2", "--plain-mb", "1", "--tokenizers", "char", "--source", source]


def test_prepare_says_what_it_writes_what_its_flags_caused_and_leaves_nothing_behind(tmp_path, text_file,
                                                                                     monkeypatch, capsys):
    temp = mkdir(tmp_path / "temp")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))        # the system's temporary directory, for this test
    rc, out, err = run_tool(bench, small_prepare(text_file), capsys)
    assert rc == 0, (out, err)
    said = next(line for line in out.splitlines() if "writes" in line)
    assert str(temp) in said and "1 MB and 2 MB" in said and "removed afterwards" in said, said
    assert out.index(said) < out.index(" MB/s"), "said before it writes"
    assert re.search(r"^ +1 MB +char +stream +[\d.]+ MB/s +peak +\d+ MB$", out, re.M), out
    assert re.search(r"^ +1 MB +char +plain +[\d.]+ MB/s", out, re.M), out
    assert re.search(r"^ +2 MB +char +stream +[\d.]+ MB/s", out, re.M) and not re.search(r"2 MB +char +plain", out)
    assert re.search(r"^char +: speed x[\d.]+, peak memory x[\d.]+ \(\d+ MB vs \d+ MB at 1 MB of text\)$", out, re.M)
    # issue 30: the flag, not the machine's memory, kept reading whole off the larger file
    assert "reading whole ran on the 1 MB file only, as --plain-mb 1 says, not on the 2 MB one" in out, out
    assert "risk" not in out and "memory grows" not in out
    assert list(temp.iterdir()) == [], "no file and no directory is left behind"


# What prepare's measuring child meets on Windows: no /proc and no resource module.
NO_PROC_NO_RESOURCE = """
import builtins, sys
sys.modules["resource"] = None                     # `import resource` raises ImportError
real_open = builtins.open
def no_proc(path, *args, **kwargs):
    if str(path).startswith("/proc"):
        raise FileNotFoundError(path)
    return real_open(path, *args, **kwargs)
builtins.open = no_proc
"""


def test_prepare_says_peak_memory_is_unknown_where_the_system_cannot_tell_it(tmp_path, text_file, monkeypatch,
                                                                            capsys):
    """Peak memory comes from /proc, else from the resource module; with neither it is unknown, not an error."""
    from benchmarks import prepare as bench_prepare
    monkeypatch.setattr(bench_prepare, "PEAK", NO_PROC_NO_RESOURCE + bench_prepare.PEAK)
    rc, out, err = run_tool(bench, ["prepare", "--mb", "1", "--plain-mb", "1", "--tokenizers", "char", "--source",
                                    text_file, "--dir", mkdir(tmp_path / "work")], capsys)
    assert rc == 0 and not err, (out, err)
    assert re.search(r"^ +1 MB +char +stream +[\d.]+ MB/s +peak unknown$", out, re.M), out
    assert "char    : speed x" in out and "peak memory unknown here" in out, out


def test_prepare_removes_what_it_wrote_when_a_measurement_fails(tmp_path, text_file, monkeypatch, capsys):
    from benchmarks import prepare as bench_prepare
    work = mkdir(tmp_path / "work")

    def fail(*args):
        assert list(work.glob("*/text_1mb.txt")), "the text is written before it is measured"
        raise UserError("data.prepare failed")
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

    def slower_after_the_probe(cfg, on_step=None, **kw):   # (the probe runs through benchmarks.step's train)
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
