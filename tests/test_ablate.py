"""ablate.py: a tiny sweep runs in-process, reports one row per variant, skips finished runs and
resumes one that Ctrl-C stopped; a failed run is one line naming it; a sweep file's paths resolve where
it was written, wherever the command runs."""
import csv
import json
import os

import pytest
import torch

from ablation.sweep import load_sweep
from common import UserError
from model.config import ATTENTIONS
from model.device import pick_device, pick_dtype
from loading import list_checkpoints
from tests.conftest import ROOT, assert_refused, interrupt_at, mkdir, poison, records, run_tool

VARIANTS = """
[[variants]]
name = "sdpa"

[[variants]]
name = "mqa"
model.attention = "gqa"
model.n_kv_head = 1
"""

# the last line of ablate.py's output, after the path of results.md
BESIDE = "(beside it: results.csv, runs.csv, loss_curves.png)"


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
log.curves = false
train.device = "cpu"   # (what these tests check is the same on a GPU; the failed run's poison is eager's)
{extra}
{variants}""")
    return path


def test_ctrl_c_stops_a_sweep_with_a_checkpoint_and_the_same_command_resumes_it(tmp_path, text_file, capsys,
                                                                                monkeypatch):
    import ablate
    from training.trainer import train
    path = write_sweep(tmp_path, text_file)
    sweep = load_sweep(str(path))
    assert [(r.variant, r.seed) for r in sweep.runs] == [("sdpa", 1), ("sdpa", 2), ("mqa", 1), ("mqa", 2)]
    stopped = sweep.runs[1]
    with monkeypatch.context() as patch:
        interrupt_at(patch, 13)   # Ctrl-C in the 3rd step of the 2nd run (10 steps each)
        rc, out, _ = run_tool(ablate, [path], capsys)
    assert rc == 130
    assert f"# sweep tiny_sweep: 2 variants x 2 seeds = 4 runs -> {tmp_path / 'sweep'}" in out
    assert "[1/4] sdpa seed 1: training" in out and "stopped during sdpa seed 2" in out
    assert [step for step, _ in list_checkpoints(stopped.dir)] == [3], "it saved the step it was in"
    assert not sweep.runs[2].dir.exists(), "no later run started"

    rc, out, _ = run_tool(ablate, [path], capsys)
    assert rc == 0 and out.splitlines()[-1] == f"# {tmp_path / 'sweep' / 'results.md'} {BESIDE}", \
        "it ends with where the results are"
    assert "[1/4] sdpa seed 1: done before, skipped" in out and "[2/4] sdpa seed 2: resuming" in out
    assert f"resuming {stopped.dir / 'ckpt_0000003.pt'} at step 3" in out, "train()'s own words"
    alone = stopped.cfg
    alone.out_dir = str(tmp_path / "alone")
    train(alone, quiet=True)
    assert records(stopped.dir, "eval", "val_loss") == records(tmp_path / "alone", "eval", "val_loss"), \
        "resumed in a process that trained other runs before, it is the run trained alone"

    out = tmp_path / "sweep"
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
    assert float(sdpa["tokens_per_s"]) > 0
    on_cuda = pick_device(t.device).type == "cuda"   # a run's own peak memory: the GPU's (one process)
    assert (sdpa["peak_gpu_bytes"] != "nan") == on_cuda and (not on_cuda or float(sdpa["peak_gpu_bytes"]) > 0)
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    md = (out / "results.md").read_text()
    assert "| sdpa | (baseline) |" in md and "| mqa | model.attention=gqa model.n_kv_head=1 |" in md
    assert "among 1 comparison about 0.1 may say yes" in md, "issue 30: not '1 comparisons'"
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    logs = {r.dir: (r.dir / "metrics.jsonl").stat().st_mtime_ns for r in sweep.runs}
    rc, out, _ = run_tool(ablate, [path], capsys)
    assert rc == 0 and out.count("done before, skipped") == 4
    assert logs == {r.dir: (r.dir / "metrics.jsonl").stat().st_mtime_ns for r in sweep.runs}, "nothing re-ran"


def test_a_failed_run_is_one_line_naming_it_and_the_same_command_runs_it_again(tmp_path, text_file, capsys,
                                                                              monkeypatch):
    import ablate
    path = write_sweep(tmp_path, text_file)
    path.write_text(path.read_text().replace("seeds = [1, 2]", "seeds = [1]").replace("max_steps = 10",
                                                                                     "max_steps = 4"))
    with monkeypatch.context() as patch:
        poison(patch, {2})   # the first run's loss becomes inf at its 2nd step; the second run goes on
        rc, out, err = run_tool(ablate, [path], capsys)
    assert rc == 2 and err.startswith("error: 1 run(s) failed, first sdpa seed 1: the loss became "), err
    assert len(err.strip().splitlines()) == 1 and "[2/2] mqa seed 1: training" in out
    assert "| mqa | model.attention=gqa model.n_kv_head=1 | " in out, "the report has the runs that finished"
    assert out.splitlines()[-1] == f"# {tmp_path / 'sweep' / 'results.md'} {BESIDE}"
    rc, out, _ = run_tool(ablate, [path], capsys)
    assert rc == 0 and "[1/2] sdpa seed 1: training" in out and "[2/2] mqa seed 1: done before, skipped" in out
    assert len(list((tmp_path / "sweep" / "sdpa").glob("seed1.replaced-*"))) == 1, "what it left is set aside"


@pytest.mark.parametrize("variants, message", [
    (VARIANTS + '\n[[variants]]\nname = "long"\ntrain.max_steps = 20\n',
     "variant 'long' changes train.max_steps, which every variant shares"),
    (VARIANTS + '\n[[variants]]\nname = "sdpa"\n', "variant 3 needs a name of its own"),
    ('[[variants]]\nname = "../up"\n', "variant 1 needs a name of its own, of letters, digits and _.+-"),
    ('[[variants]]\nname = "bad"\nmodel.attention = "gqa"\nmodel.n_kv_head = 3\n',
     "variant 'bad': model.n_head=2 is not a multiple of model.n_kv_head=3"),
    ('[[variants]]\nname = "typo"\nmodel.n_layr = 3\n', "variant 'typo': unknown config key 'model.n_layr'"),
    ("", "needs at least one \\[\\[variants\\]\\] table"),
    # under [overrides]
    ("learning_rate = 3\n" + VARIANTS, "\\[overrides\\]: unknown config key 'learning_rate'"),
])
def test_bad_sweeps_are_refused_before_anything_runs(tmp_path, text_file, variants, message):
    with pytest.raises(UserError, match=message):
        load_sweep(str(write_sweep(tmp_path, text_file, variants)))
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("argv, named", [([], "give a sweep file first"), (["--report"], "give a sweep file first"),
                                         (["absent.toml"], "absent.toml")])
def test_ablate_without_a_sweep_file_is_one_line(argv, named, tmp_path, capsys):
    import ablate
    assert_refused(ablate, [tmp_path / a if a.endswith(".toml") else a for a in argv], capsys, tmp_path, named)


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


ONE_RUN = '[[variants]]\nname = "sdpa"\n'


def test_cut_or_damaged_records_of_a_sweep_are_done_again_not_a_traceback(tmp_path, text_file, capsys):
    from ablate import main
    path = write_sweep(tmp_path, text_file, ONE_RUN)
    path.write_text(path.read_text().replace("seeds = [1, 2]", "seeds = [1]").replace("max_steps = 10",
                                                                                     "max_steps = 4"))
    assert main([str(path)]) == 0
    run_dir = tmp_path / "sweep" / "sdpa" / "seed1"
    (run_dir / "result.json").write_text((run_dir / "result.json").read_text()[:9])   # cut by a kill, or a full disk
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "kind": "ev')
    capsys.readouterr()
    assert main([str(path)]) == 0
    assert "done before, skipped" not in capsys.readouterr().out, "a cut result.json is not a finished run"
    assert json.loads((run_dir / "result.json").read_text())["done"] is True


@pytest.mark.parametrize("field, value, message", [
    ("overrides", "3", "overrides is not a table"), ("name", "5", "name is not a string"),
    ("variants", '"sdpa"', "variants is not a list"), ("base", "7", "base is not a string"),
    ("seeds", "4", "seeds is not a list"),
])
def test_a_sweep_field_of_the_wrong_kind_is_one_line(tmp_path, field, value, message, capsys):
    import ablate
    path = tmp_path / "sweep.toml"
    path.write_text(f"{field} = {value}\n" + ("" if field == "variants" else ONE_RUN))
    assert_refused(ablate, [path], capsys, tmp_path, message)


def test_a_sweep_copied_under_another_name_or_moved_continues_its_runs(tmp_path, text_file, capsys):
    """Only labels and what is watched change (the wandb group is the sweep's name, the out dir, the log
    interval): what the runs compute is the same."""
    from ablate import main
    path = write_sweep(tmp_path, text_file, ONE_RUN)
    path.write_text(path.read_text().replace("max_steps = 10", "max_steps = 3"))
    assert main([str(path)]) == 0
    copy = tmp_path / "another_name.toml"
    copy.write_text(path.read_text())
    capsys.readouterr()
    assert main([str(copy)]) == 0 and capsys.readouterr().out.count("done before, skipped") == 2, "both seeds"
    os.rename(tmp_path / "sweep", tmp_path / "moved")
    copy.write_text(path.read_text().replace('sweep"', 'moved"').replace("log_interval = 5", "log_interval = 1"))
    assert main([str(copy)]) == 0 and capsys.readouterr().out.count("done before, skipped") == 2, "moved"


def test_a_sweep_s_paths_resolve_where_it_was_written_wherever_the_command_runs(tmp_path, text_file, monkeypatch):
    """A sweep file outside the repository: its base and out_dir against its own folder; a shipped one:
    against the repository, and by default the runs go to the repository's out/ablations/<name>."""
    monkeypatch.chdir(mkdir(tmp_path / "elsewhere"))
    folder = mkdir(tmp_path / "sweeps")
    (folder / "base.toml").write_text(f"[data]\npath = {json.dumps(str(text_file))}\n[model]\nn_layer = 3\n")
    (folder / "mine.toml").write_text(f'base = "base.toml"\nout_dir = "runs"\n{ONE_RUN}')
    sweep = load_sweep(str(folder / "mine.toml"))
    assert sweep.out_dir == folder / "runs" and sweep.runs[0].cfg.model.n_layer == 3
    (folder / "mine.toml").write_text(f'base = "base.toml"\n{ONE_RUN}')
    assert load_sweep(str(folder / "mine.toml")).out_dir == ROOT / "out" / "ablations" / "mine"
    shipped = load_sweep(str(ROOT / "configs" / "ablations" / "attention_cpu.toml"))
    assert shipped.out_dir == ROOT / "out" / "ablations" / "attention_cpu"
    assert shipped.runs[0].cfg.data.path == str(ROOT / "data" / "tinyshakespeare.txt")
    assert load_sweep(str(folder / "mine.toml"), ["--out_dir", "here"]).out_dir == tmp_path / "elsewhere" / "here"


def test_ablate_runs_from_another_directory_with_an_absolute_sweep_path(tmp_path, monkeypatch,
                                                                         capsys):
    """A shipped sweep given by its absolute path from another directory finds its base config;
    --report reports a sweep with no finished run, into a relative --out_dir of that directory."""
    import ablate
    monkeypatch.chdir(tmp_path)
    sweep = ROOT / "configs" / "ablations" / "attention_cpu.toml"
    rc, out, err = run_tool(ablate, [sweep, "--report", "--out_dir", "report"], capsys)
    assert rc == 0, err
    report = tmp_path / "report"
    assert f"# sweep attention_cpu: 9 variants x 2 seeds = 18 runs -> {report}" in out
    assert "| sdpa | (baseline) | no finished run |" in (report / "results.md").read_text()
    assert out.splitlines()[-1] == f"# {report / 'results.md'} {BESIDE}"


def test_a_command_line_setting_applies_to_every_run_last(tmp_path, text_file):
    sweep = load_sweep(str(write_sweep(tmp_path, text_file)), ["--train.lr=0.005", "--train.weight_decay=0"])
    assert {(r.cfg.train.lr, r.cfg.train.weight_decay) for r in sweep.runs} == {(0.005, 0.0)}
