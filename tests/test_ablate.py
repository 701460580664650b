"""ablate.py: a tiny sweep runs, reports one row per variant, skips finished runs and resumes partial ones."""
import csv
import json
import subprocess
import sys

import pytest
import torch

from ablation.sweep import load_sweep
from model.config import ATTENTIONS
from tests.conftest import ROOT
from common import ConfigError
from training.runtime import pick_device, pick_dtype

VARIANTS = """
[[variants]]
name = "sdpa"

[[variants]]
name = "mqa"
model.attention = "gqa"
model.n_kv_head = 1
"""


def write_sweep(tmp_path, text_file, variants=VARIANTS, extra=""):
    path = tmp_path / "tiny_sweep.toml"
    path.write_text(f"""
out_dir = {json.dumps(str(tmp_path / "sweep"))}
seeds = [1, 2]

[overrides]
data.path = {json.dumps(str(text_file))}
data.prepared_dir = {json.dumps(str(tmp_path / "prepared"))}
model.n_layer = 1
model.n_head = 2
model.n_embd = 16
model.block_size = 16
train.batch_size = 4
train.max_steps = 10
train.warmup_steps = 2
train.eval_interval = 5
train.eval_iters = 2
train.log_interval = 5
{extra}
{variants}""")
    return path


def test_a_sweep_runs_reports_skips_finished_runs_and_resumes_partial_ones(tmp_path, text_file, capsys):
    from ablate import main
    from training.trainer import train
    path = write_sweep(tmp_path, text_file)
    sweep = load_sweep(str(path))
    assert [(r.variant, r.seed) for r in sweep.runs] == [("sdpa", 1), ("sdpa", 2), ("mqa", 1), ("mqa", 2)]
    partial = sweep.runs[3]
    train(partial.cfg, quiet=True, stop_at=5)              # as if the sweep had been interrupted there

    assert main([str(path)]) == 0
    out = tmp_path / "sweep"
    assert "resuming" in (partial.dir / "train.log").read_text()
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == ["sdpa", "mqa"]
    assert all(r["seeds_done"] == "2" and float(r["final_val"]) > 0 for r in rows)
    sdpa, mqa = rows
    assert int(mqa["params"]) < int(sdpa["params"])
    t = sweep.runs[0].cfg.train   # the cache is in the run's dtype: fp32 on CPU, bf16 on most GPUs
    itemsize = torch.empty((), dtype=pick_dtype(pick_device(t.device), t.dtype)).element_size()
    assert float(mqa["kv_bytes_per_token"]) * 2 == float(sdpa["kv_bytes_per_token"]) == 1 * 2 * 16 * itemsize
    assert sdpa["beyond_noise"] == "baseline" and mqa["beyond_noise"] in ("yes", "no")
    assert float(mqa["delta"]) == pytest.approx(float(mqa["final_val"]) - float(sdpa["final_val"]), abs=1e-5)
    assert float(sdpa["peak_mem_bytes"]) > 10e6 and float(sdpa["tokens_per_s"]) > 0
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    md = (out / "results.md").read_text()
    assert "| sdpa | (baseline) |" in md and "| mqa | model.attention=gqa model.n_kv_head=1 |" in md
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    logs = {r.dir: (r.dir / "train.log").stat().st_mtime_ns for r in sweep.runs}
    capsys.readouterr()
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.count("done before, skipped") == 4
    assert logs == {r.dir: (r.dir / "train.log").stat().st_mtime_ns for r in sweep.runs}, "nothing re-ran"

    with pytest.raises(ConfigError, match="holds a run with another config .*train.lr"):
        main([str(path), "--train.lr=0.5"])


@pytest.mark.parametrize("variants, message", [
    (VARIANTS + '\n[[variants]]\nname = "long"\ntrain.max_steps = 20\n',
     "variant 'long' changes train.max_steps .* same data and token budget"),
    (VARIANTS + '\n[[variants]]\nname = "sdpa"\n', "two variants are named 'sdpa'"),
    ('[[variants]]\nname = "bad"\nmodel.attention = "gqa"\nmodel.n_kv_head = 3\n',
     "variant 'bad': model.n_head=2 is not a multiple of model.n_kv_head=3"),
    ('[[variants]]\nname = "typo"\nmodel.n_layr = 3\n', "variant 'typo': unknown config key 'model.n_layr'"),
    ("", "needs at least one \\[\\[variants\\]\\] table"),
])
def test_bad_sweeps_are_refused_before_anything_runs(tmp_path, text_file, variants, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(str(write_sweep(tmp_path, text_file, variants)))
    assert not (tmp_path / "sweep").exists()


def test_sweep_errors_are_one_line_from_the_command(tmp_path, text_file):
    path = write_sweep(tmp_path, text_file, extra="learning_rate = 3")
    r = subprocess.run([sys.executable, "ablate.py", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "[overrides]: unknown config key 'learning_rate'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


SHIPPED = sorted((ROOT / "configs" / "ablations").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_sweep_loads_with_its_base_config_as_the_baseline(path, monkeypatch):
    """Its baseline is the base config as it is, and it has seeds enough to judge a difference
    against the seeds' own spread."""
    monkeypatch.chdir(ROOT)
    sweep = load_sweep(str(path.relative_to(ROOT)))
    assert sweep.variants[0][1] == {}, "the baseline overrides nothing"
    assert len(sweep.seeds) >= 2


def test_the_attention_sweeps_cover_every_variant_switch_and_position(monkeypatch):
    monkeypatch.chdir(ROOT)
    cpu = load_sweep("configs/ablations/attention_cpu.toml")
    gpu = load_sweep("configs/ablations/attention.toml")
    assert {"attention_cpu.toml", "attention.toml"} <= {p.name for p in SHIPPED}, "the sweeps above are tested"
    for sweep in (cpu, gpu):
        assert {r.cfg.model.attention for r in sweep.runs} == set(ATTENTIONS)
    assert any(not r.cfg.model.attn_scale for r in cpu.runs) and any(r.cfg.model.qk_norm for r in cpu.runs)
    assert {r.cfg.model.pos for r in gpu.runs} == {"learned", "rope", "alibi", "none"}


def test_fast_recipe_sweep_turns_off_one_lever_per_variant(monkeypatch):
    monkeypatch.chdir(ROOT)
    sweep = load_sweep("configs/ablations/fast_recipe_cpu.toml")
    base = next(r.cfg for r in sweep.runs if r.variant == "fast")
    for run in sweep.runs:
        changed = {(section, key) for section in ("model", "train")
                   for key, value in getattr(run.cfg, section).__dict__.items()
                   if getattr(base, section).__dict__[key] != value and key != "seed"}
        assert len(changed) == (0 if run.variant == "fast" else 1), (run.variant, changed)
