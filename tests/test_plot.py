"""plot.py and the loss curves (viz/curves.py) on runs written by hand (metrics.jsonl and config.toml,
as a run leaves them): every evaluation in view."""
import json

import pytest

import plot as plot_cli
from tests.conftest import run_tool
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


def assert_every_point_in_view(fig):
    for ax in fig.axes:
        low, high = ax.get_ylim()
        for line in (line for line in ax.get_lines() if len(line.get_ydata())):
            assert low <= min(line.get_ydata()) and max(line.get_ydata()) <= high, (ax.get_title(), line.get_label())
        for band in ax.collections:
            ys = band.get_paths()[0].vertices[:, 1]
            assert low <= ys.min() and ys.max() <= high, ax.get_title()


def test_plot_py_shows_every_evaluation(runs, tmp_path, capsys, figures):
    """The first evaluation (4.2, far above the rest) is in the picture, not cut off above it."""
    rc, _, err = run_tool(plot_cli, [*runs, "--out", tmp_path / "p.png"], capsys)
    (fig,) = figures
    assert rc == 0 and len(fig.axes) == 2, err
    assert_every_point_in_view(fig)


def test_ablate_s_curves_show_every_evaluation_and_every_seed(tmp_path, figures):
    import numpy as np

    from ablation.report import plot
    from ablation.sweep import Sweep
    sweep = Sweep("lr", tmp_path, [1, 2], [("baseline", {}), ("higher", {"train": {"lr": 0.01}})], [])
    runs = [{"variant": v, "done": True, "steps": [0, 10, 20, 30], "val": list(val), "elapsed": [0, 1, 2, 3]}
            for v, base in (("baseline", 2.5), ("higher", 2.3)) for val in (np.array([9.0, 3, 2.6, base]),
                                                                              np.array([8.0, 3.1, 2.7, base + 0.1]))]
    plot(sweep, runs, tmp_path)
    (fig,) = figures
    assert (tmp_path / "loss_curves.png").read_bytes().startswith(PNG)
    assert [len(ax.collections) for ax in fig.axes] == [2, 2], "a band over the seeds per variant"
    assert_every_point_in_view(fig)


def test_curves_draw_every_point_of_every_panel(figures):
    panels = [Panel("loss", "step", "loss", [Line("a", [0, 1, 2, 3], [11.0, 2.0, 1.9, 1.85]),
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
