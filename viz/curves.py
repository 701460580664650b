"""Loss curves, drawn one way for every use: a run's own curves.png (train.py, at each
evaluation), several runs overlaid (plot.py), a sweep's variants over their seeds (ablate.py's
loss_curves.png).

A figure is a row of panels; a panel holds lines; a line is (label, x, y) with an optional
band (low, high) around it, e.g. the spread of several seeds. Every point is drawn: the y
axis is never cut, so the first evaluations stay in the picture however far above the rest
they lie. matplotlib is loaded only to draw.
"""
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Line:
    label: str
    x: list
    y: list
    # a band around y (e.g. the lowest and highest seed)
    low: list | None = None
    high: list | None = None
    # drawn thicker and in black (a sweep's baseline)
    emphasis: bool = False


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)


def draw(panels: list[Panel], title: str, legend_below: bool = False,
         format: str = "png") -> bytes:
    """The panels side by side as one picture's bytes (png, svg or pdf); legend_below: one
    legend under them (the first panel's lines, for panels that draw the same lines), instead
    of one in each panel."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    below = len(panels[0].lines) if legend_below else 0
    fig = Figure(figsize=(6.5 * len(panels), 5 + 0.25 * below))
    axes = fig.subplots(1, len(panels), squeeze=False)
    most = max(len(panel.lines) for panel in panels)
    colors = colormaps["tab10" if most <= 10 else "tab20"].colors
    for ax, panel in zip(axes[0], panels):
        for i, line in enumerate(panel.lines):
            style = ({"color": "black", "lw": 2.2} if line.emphasis
                     else {"color": colors[i % len(colors)], "lw": 1.4})
            marker = "o" if len(line.x) < 3 else None
            ax.plot(line.x, line.y, label=line.label, marker=marker, **style)
            if line.low is not None:
                ax.fill_between(line.x, line.low, line.high, color=style["color"],
                                alpha=0.15, lw=0)
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.grid(alpha=0.3)
        if not legend_below and any(len(line.y) for line in panel.lines):
            ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.25 * below / (5 + 0.25 * below), 1, 1))
    if below:
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower left", fontsize=8, frameon=False)
    out = io.BytesIO()
    fig.savefig(out, format=format, dpi=110)
    return out.getvalue()


def points(records: list[dict], x: str, y: str) -> tuple[list, list]:
    """(x values, y values) of the records where both are finite numbers: a log may hold a
    damaged or missing value, or a diverged run's NaN, none of which can be drawn."""
    def finite(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    kept = [r for r in records if finite(r.get(x)) and finite(r.get(y))]
    return [r[x] for r in kept], [r[y] for r in kept]


def run_panels(records: list[dict]) -> list[Panel]:
    """One run's metrics records -> its train and val loss by step, and its val bits per
    byte."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    loss = Panel("loss by step", "step", "loss (nats per token)", [
        Line("train (logged steps)", *points(train, "step", "loss")),
        Line("train (evaluation)", *points(evals, "step", "train_loss")),
        Line("val", *points(evals, "step", "val_loss"))])
    bpb = Panel("val bits per byte by step", "step", "bits per byte",
                [Line("val", *points(evals, "step", "val_bpb"))])
    return [loss, bpb]


def read_records(path, warn=True) -> list[dict]:
    """The records of a metrics.jsonl. It is a log: a damaged line (cut by a kill, a bad
    byte, a value of the wrong kind) is skipped, with one warning on stderr naming the file
    and how many."""
    records, damaged = [], 0
    file = Path(path)
    text = file.read_bytes().decode("utf-8", errors="replace") if file.exists() else ""
    for line in text.splitlines():
        try:
            record = json.loads(line)
            ok = (isinstance(record, dict) and type(record.get("step")) is int
                  and isinstance(record.get("kind"), str))
        except ValueError:
            ok = False
        if ok:
            records.append(record)
        elif line.strip():
            damaged += 1
    if damaged and warn:
        print(f"warning: {path}: skipped {damaged} damaged line(s)", file=sys.stderr)
    return records
