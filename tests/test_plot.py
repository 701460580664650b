"""plot.py and the loss curves (viz/curves.py) on runs written by hand (metrics.jsonl and config.toml,
as a run leaves them): each run's val curve by step and by wall-clock time, named by what its config
changes; where the picture goes (by default out/runs-<the runs>.png, else --out: .png, .svg or
.pdf); every evaluation in view. Watching a run as it learns: samples while training (which change
no loss) and every run's curves at each evaluation."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import plot as plot_cli
from tests.conftest import ROOT, assert_refused, run_tool, write
from training.trainer import train
from viz.curves import Line, Panel, draw, read_records

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path, lr, evals, seconds=2.0):
    """A run's out dir: config.toml with train.lr (and min_lr a tenth of it), and metrics.jsonl with a
    train record per step and an eval record for each val loss in evals (one every 10 steps, the first at
    step 0), its bits per byte 1.4 times its loss."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(f"[train]\nlr = {lr}\nmin_lr = {lr / 10}\n")
    records = [{"step": s, "kind": "train", "loss": 3.0} for s in range(0, 10 * len(evals))]
    records += [{"step": 10 * i, "kind": "eval", "train_loss": v, "val_loss": v, "val_bpb": 1.4 * v,
                 "elapsed_s": seconds * i} for i, v in enumerate(evals)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def runs(tmp_path):
    """Two runs that differ in their learning rate: 'slow' ends higher, and took longer."""
    return [write_run(tmp_path / "slow", 1e-4, [4.2, 2.6, 2.4, 2.3], seconds=3.0),
            write_run(tmp_path / "quick", 1e-2, [4.2, 2.1, 1.9, 1.8])]


@pytest.fixture
def figures(monkeypatch):
    """Every matplotlib Figure saved meanwhile, for a test to look at what was drawn."""
    from matplotlib.figure import Figure
    saved, save = [], Figure.savefig

    def spy(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", spy)
    return saved


def test_plot_py_overlays_runs_named_by_what_differs(runs, tmp_path, capsys):
    out = tmp_path / "both.png"
    rc, stdout, err = run_tool(plot_cli, [*runs, "--out", out], capsys)
    assert rc == 0 and stdout.strip() == str(out) and out.read_bytes().startswith(PNG), err
    rc, _, err = run_tool(plot_cli, [*runs, "--out", out, "--bpb"], capsys)
    assert rc == 0 and out.read_bytes().startswith(PNG), err
    labels = plot_cli.differences([plot_cli.read_run(run)[1] for run in runs])
    assert labels == ["train.lr=0.0001, train.min_lr=1e-05", "train.lr=0.01, train.min_lr=0.001"], labels
    watched = plot_cli.differences([{"train.lr": 0.1, "train.sample_every": 5, "log.curves": False},
                                    {"train.lr": 0.2}])
    assert watched == ["train.lr=0.1", "train.lr=0.2"], "watching a run does not name it"
    with open(runs[0] / "metrics.jsonl", "a") as f:   # a diverged evaluation, one without bits per byte
        f.write('{"step": 30, "kind": "eval", "val_loss": NaN, "val_bpb": NaN, "elapsed_s": 9}\n'
                '{"step": 40, "kind": "eval", "val_loss": 2.5, "elapsed_s": 10}\n')
    for order in (runs, runs[::-1]):
        for bpb in ([], ["--bpb"]):
            rc, _, err = run_tool(plot_cli, [*order, "--out", out, *bpb], capsys)
            assert rc == 0 and "Traceback" not in err, err


def test_plot_py_draws_each_run_s_val_curve_by_step_and_by_wall_time(runs, tmp_path, capsys, monkeypatch):
    import viz.curves
    drawn = []
    monkeypatch.setattr(viz.curves, "draw", lambda panels, title, **kw: drawn.append(panels) or PNG)
    for flag, key in (([], "val_loss"), (["--bpb"], "val_bpb")):
        rc, _, err = run_tool(plot_cli, [*runs, "--out", tmp_path / "p.png", *flag], capsys)
        by_step, by_time = drawn.pop()
        assert rc == 0, err
        for run, step_line, time_line in zip(runs, by_step.lines, by_time.lines):
            evals = [r for r in read_records(run / "metrics.jsonl") if r["kind"] == "eval"]
            assert step_line.label.startswith(str(run)) and time_line.label == step_line.label
            assert (step_line.x, step_line.y) == ([r["step"] for r in evals], [r[key] for r in evals])
            assert (time_line.x, time_line.y) == ([r["elapsed_s"] for r in evals], [r[key] for r in evals])


def test_plot_py_writes_into_out_by_default_which_git_ignores(runs, tmp_path, capsys, monkeypatch):
    assert plot_cli.DEFAULT_DIR == ROOT / "out"
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "out/runs-a+b.png"], cwd=ROOT)
        assert ignored.returncode == 0, "out/ is git-ignored: the picture is not left for a commit to pick up"
    default = tmp_path / "repo" / "out"   # not this checkout's out/, which is the user's
    monkeypatch.setattr(plot_cli, "DEFAULT_DIR", default)
    monkeypatch.chdir(tmp_path)
    rc, stdout, err = run_tool(plot_cli, runs, capsys)
    picture = default / "runs-slow+quick.png"
    assert rc == 0 and stdout == f"{picture}\n" and picture.read_bytes().startswith(PNG), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quick", "repo", "slow"], "nothing in the cwd"


def test_plot_py_never_replaces_the_picture_of_other_runs_by_default(runs, tmp_path, capsys,
                                                                     monkeypatch):
    """Each set of runs has a picture of its own (one name for all would lose the earlier picture
    without a word); the same runs again redraw theirs."""
    monkeypatch.setattr(plot_cli, "DEFAULT_DIR", tmp_path / "out")
    third = write_run(tmp_path / "third", 1e-3, [4.2, 2.0])
    said = {}
    for argv in ([*runs], [runs[0], third], [*runs, "--bpb"], [*runs], [third]):
        rc, stdout, err = run_tool(plot_cli, argv, capsys)
        assert rc == 0, err
        said.setdefault(stdout.strip(), []).append(argv)
    out = tmp_path / "out"
    assert list(said) == [str(out / name) for name in (
        "runs-slow+quick.png", "runs-slow+third.png", "runs-slow+quick-bpb.png", "runs-third.png")]
    assert len(said[str(out / "runs-slow+quick.png")]) == 2, "the same runs again: their picture"
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(name).name for name in said)
    rc, stdout, err = run_tool(plot_cli, [*runs, "--out", tmp_path / "mine.svg"], capsys)
    assert rc == 0 and stdout == f"{tmp_path / 'mine.svg'}\n", "--out still chooses"


def test_a_default_picture_s_name_names_runs_below_the_folder_they_share(tmp_path, monkeypatch):
    """A sweep's runs (variant/seed) are named by both parts; a name too long for a file ends in a
    hash of the whole, so that two long sets of runs still get two pictures."""
    monkeypatch.setattr(plot_cli, "DEFAULT_DIR", tmp_path / "out")
    sweep = [tmp_path / "sweep" / v / "seed1" for v in ("sdpa", "mqa")]
    assert plot_cli.default_out(sweep, False).name == "runs-sdpa_seed1+mqa_seed1.png"
    many = [tmp_path / f"a_rather_long_run_name_{i}_é" for i in range(12)]
    names = {plot_cli.default_out(many[:n], False).name for n in (11, 12)}
    assert len(names) == 2 and all(len(os.fsencode(n)) <= plot_cli.LONGEST_NAME + 4 for n in names)
    assert all(n.startswith("runs-a_rather_long_run_name_0_é+") for n in names), names


@pytest.mark.parametrize("name, start", [("p.svg", b"<?xml"), ("p.pdf", b"%PDF"), ("P.PNG", PNG)])
def test_plot_py_writes_the_format_its_out_names(runs, tmp_path, capsys, name, start):
    rc, stdout, err = run_tool(plot_cli, [*runs, "--out", tmp_path / "new" / name], capsys)
    assert rc == 0 and (tmp_path / "new" / name).read_bytes().startswith(start), err


@pytest.mark.parametrize("name", ["x.txt", "x", "x.jpg.gz"])
def test_plot_py_refuses_an_out_it_cannot_write_as_a_picture(runs, tmp_path, capsys, name):
    assert_refused(plot_cli, [*runs, "--out", tmp_path / name], capsys, tmp_path, f"--out {tmp_path / name}: "
                   "the picture is written as .png, .svg or .pdf")


@pytest.mark.parametrize("make, message", [
    (lambda tmp: [tmp / "nothing"], "holds no run (no metrics.jsonl and config.toml)"),
    (lambda tmp: [tmp, "--bpb", "--bpb", "--nope"], "unrecognized arguments: --nope"),
    (lambda tmp: [write(write_run(tmp / "run", 0.1, [4.0]) / "config.toml", "[train\n").parent],
     "config.toml is not readable TOML"),
])
def test_plot_py_mistakes_are_one_line(make, message, tmp_path, capsys):
    rc, _, err = run_tool(plot_cli, make(tmp_path), capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err


def assert_every_point_in_view(fig):
    for ax in fig.axes:
        low, high = ax.get_ylim()
        for line in (line for line in ax.get_lines() if len(line.get_ydata())):
            ys = line.get_ydata()
            assert low <= min(ys) and max(ys) <= high, (ax.get_title(), line.get_label())
        for band in ax.collections:
            ys = band.get_paths()[0].vertices[:, 1]
            assert low <= ys.min() and ys.max() <= high, ax.get_title()


def test_ablate_s_curves_show_every_evaluation_and_every_seed(tmp_path, figures):
    import numpy as np

    from ablation.report import plot
    from ablation.sweep import Sweep
    sweep = Sweep("lr", tmp_path, [1, 2], [("baseline", {}), ("higher", {"train": {"lr": 0.01}})], [])
    runs = [{"variant": v, "done": True, "steps": [0, 10, 20, 30], "val": list(val), "elapsed": [0, 1, 2, 3]}
            for v, base in (("baseline", 2.5), ("higher", 2.3))
            for val in (np.array([9.0, 3, 2.6, base]), np.array([8.0, 3.1, 2.7, base + 0.1]))]
    plot(sweep, runs)
    (fig,) = figures
    assert (tmp_path / "loss_curves.png").read_bytes().startswith(PNG)
    assert [len(ax.collections) for ax in fig.axes] == [2, 2], "a band over the seeds per variant"
    assert_every_point_in_view(fig)


def test_curves_draw_every_point_of_every_panel(figures):
    """The drawing of every picture (curves.png, plot.py's, a sweep's): a first evaluation far
    above the rest is in view, not cut off above it."""
    panels = [Panel("loss", "step", "loss", [
                  Line("a", [0, 1, 2, 3], [11.0, 2.0, 1.9, 1.85]),
                  Line("b", [0, 1], [10.5, 1.7], low=[10.0, 1.6], high=[12.0, 1.8])]),
              Panel("empty", "step", "loss", [Line("nothing yet", [], [])])]
    assert draw(panels, "two").startswith(PNG)
    assert_every_point_in_view(figures[0])


def test_read_records_skips_damaged_lines_with_one_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "kind": "eval", "val_loss": 2.0}\n{"step": 1, "kin\n\xff\xfe\n'
                     b'{"step": "2", "kind": "eval"}\n[1, 2]\n\n{"step": 3, "kind": "train", "loss": 1.5}\n')
    assert [r["step"] for r in read_records(path)] == [0, 3]
    assert capsys.readouterr().err == f"warning: {path}: skipped 4 damaged line(s)\n"
    assert len(read_records(path, warn=False)) == 2 and capsys.readouterr().err == ""
    assert read_records(tmp_path / "none.jsonl") == [], "no log yet: no records"




def records(out_dir, kind):
    return [r for r in map(json.loads, open(f"{out_dir}/metrics.jsonl")) if r["kind"] == kind]


def test_samples_while_training_change_no_loss_bit_for_bit(tiny_cfg, tmp_path):
    extra = {"model.dropout": 0.1, "train.eval_interval": 5}   # dropout: the random draws are untouched too
    train(tiny_cfg(**extra, out_dir=tmp_path / "plain"), quiet=True)
    train(tiny_cfg(**extra, out_dir=tmp_path / "sampled", **{"train.sample_every": 5, "train.sample_prompt": "First",
                                                            "train.sample_tokens": 30}), quiet=True)
    for kind, key in (("train", "loss"), ("eval", "val_loss")):
        assert [r[key] for r in records(tmp_path / "sampled", kind)] == [r[key] for r in records(tmp_path / "plain", kind)]
    samples = records(tmp_path / "sampled", "sample")
    assert [s["step"] for s in samples] == [5, 10, 15, 20]
    assert all(s["text"].startswith("First") and len(s["text"]) == len("First") + 30 for s in samples)


def test_sampling_from_a_resumed_run_is_named_but_not_called_a_different_run(tiny_cfg, capsys):
    train(tiny_cfg(**{"train.max_steps": 10}), quiet=True)
    train(tiny_cfg(**{"train.sample_every": 5, "train.sample_tokens": 5, "train.max_steps": 12}), resume=True)
    out, err = capsys.readouterr()
    assert "# resuming with train.sample_every: 0 -> 5" in out and not err, err


def test_sampling_time_is_not_billed_to_the_steps(tiny_cfg, monkeypatch):
    """A sample that takes a second, drawn in each log interval of two steps, would add 500 ms to
    each step's time: the steps' own time is far less, however busy the machine."""
    import time
    import training.trainer
    real, calls = training.trainer.generate, []

    def slow_generate(*args, **kwargs):
        # as a long sample would take
        calls.append(time.sleep(1.0))
        yield from real(*args, **kwargs)
    monkeypatch.setattr(training.trainer, "generate", slow_generate)
    cfg = tiny_cfg(**{"train.sample_every": 2, "train.log_interval": 2, "train.max_steps": 4})
    train(cfg, quiet=True)
    assert len(calls) == 2, "the samples were drawn"
    steps = records(cfg.out_dir, "train")
    assert all(r["ms_per_step"] < 400 for r in steps), steps


def test_a_sample_prompt_the_text_cannot_encode_is_refused_at_once(tiny_cfg):
    from common import UserError
    with pytest.raises(UserError, match="train.sample_prompt has 1 character"):
        train(tiny_cfg(**{"train.sample_every": 5, "train.sample_prompt": "☃"}), quiet=True)


def test_every_run_draws_its_curves_at_each_evaluation(tiny_cfg, monkeypatch):
    """At each evaluation, its resumed part too, curves.png is drawn again: the losses it logged,
    the train and val losses of its evaluations, and its val bits per byte."""
    import viz.curves
    drawn, draw = [], viz.curves.draw

    def counted(panels, title, **kw):
        drawn.append((title, panels))
        return draw(panels, title, **kw)
    monkeypatch.setattr(viz.curves, "draw", counted)
    # evaluations at steps 10 and 20
    cfg = tiny_cfg(**{"log.curves": "true", "train.max_steps": 10, "train.log_interval": 5})
    train(cfg, quiet=True)
    first = open(f"{cfg.out_dir}/curves.png", "rb").read()
    cfg.train.max_steps = 20
    train(cfg, quiet=True, resume=True)
    second = open(f"{cfg.out_dir}/curves.png", "rb").read()
    assert [title.split(": ")[1] for title, _ in drawn] == ["step 10", "step 20"], drawn
    assert first.startswith(PNG) and second.startswith(PNG), "a PNG at each evaluation"
    assert first != second, "redrawn at the second evaluation"
    logged, evals = records(cfg.out_dir, "train"), records(cfg.out_dir, "eval")
    loss, bpb = drawn[-1][1]
    lines = {line.label: (line.x, line.y) for line in loss.lines}
    assert lines["train (logged steps)"] == ([r["step"] for r in logged], [r["loss"] for r in logged])
    steps = [r["step"] for r in evals]
    assert lines["train (evaluation)"] == (steps, [r["train_loss"] for r in evals])
    assert lines["val"] == (steps, [r["val_loss"] for r in evals])
    assert [(line.x, line.y) for line in bpb.lines] == [(steps, [r["val_bpb"] for r in evals])]
    monkeypatch.setattr(viz.curves, "draw", lambda *a, **kw: pytest.fail("log.curves=false draws"))
    off = tiny_cfg(**{"log.curves": "false", "train.max_steps": 10}, out_dir=f"{cfg.out_dir}-off")
    train(off, quiet=True)


def test_every_sample_draws_with_the_same_seed_and_is_printed(tiny_cfg, capsys):
    """Weights that do not move (lr 0) sample the same text at every step: the generator is seeded
    anew for each sample, not once per run. Each sample is printed with its step."""
    cfg = tiny_cfg(**{"train.lr": 0.0, "train.min_lr": 0.0, "train.sample_every": 5, "train.sample_tokens": 20,
                      "train.sample_prompt": "First"})
    train(cfg)
    texts = [s["text"] for s in records(cfg.out_dir, "sample")]
    assert len(texts) == 4 and len(set(texts)) == 1, texts
    out = capsys.readouterr().out
    for step in (5, 10, 15, 20):
        assert f"sample {step:4d} | {texts[0].splitlines()[0]}" in out, out


def test_samples_curves_and_the_page_on_a_text_that_is_not_shakespeare(tiny_cfg, tmp_path, capsys):
    """Watching a run end to end on Python source (argparse.py): samples of its characters, its
    curves and its attention page."""
    import argparse

    import attention as attention_cli
    source = open(argparse.__file__, encoding="utf-8").read()[:30_000]
    text_file = tmp_path / "argparse.txt"
    text_file.write_bytes(source.encode("utf-8"))
    cfg = tiny_cfg(**{"data.path": text_file, "train.sample_every": 10, "train.sample_prompt": "def ",
                      "train.sample_tokens": 40, "log.curves": "true", "model.block_size": 16})
    train(cfg, quiet=True)
    samples = records(cfg.out_dir, "sample")
    assert [s["step"] for s in samples] == [10, 20]
    assert all(set(s["text"]) <= set(source) for s in samples)
    assert open(f"{cfg.out_dir}/curves.png", "rb").read().startswith(PNG)
    page, prompt = tmp_path / "page.html", source[:16]
    rc, _, err = run_tool(attention_cli, [cfg.out_dir, "--prompt", prompt, "--html", page], capsys)
    data = r'<script id="data" type="application/json">(.*?)</script>'
    inlined = re.search(data, page.read_text("utf-8"), re.S)
    assert rc == 0 and "".join(json.loads(inlined[1])["tokens"]) == prompt, err
