"""Attention weights as matplotlib Figures: a heatmap per head of one layer (plot_layer),
head_scores' summary as two annotated heatmaps (plot_summary).
"""
import functools
import math

import numpy as np
from matplotlib import font_manager, rcParams
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ft2font import FT2Font
from matplotlib.textpath import TextToPath

VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥"}
BOX = "□"
# head_scores' shares, as column titles
SCORE_NAMES = {"previous": "previous\ntoken", "first": "first\ntoken", "self": "itself",
               "newline": "newline that\nbegan its line", "line_up": "same column\none line up"}


def visible(text: str) -> str:
    """A label that shows whitespace: 'to be' -> 'to␣be', '\\n' -> '⏎'."""
    return "".join(VISIBLE.get(ch, ch) for ch in text)


def lacks(family, chars: set) -> set:
    """The characters of chars that matplotlib's font for family lacks."""
    path = font_manager.findfont(FontProperties(family=family))
    charmap = FT2Font(path).get_charmap()
    return {c for c in chars if ord(c) not in charmap}


@functools.cache
def label_fonts(text: str) -> tuple[tuple[str, ...], str]:
    """(font families to take glyphs from: matplotlib's, then installed ones with characters
    it lacks; the characters of text no font has, drawn as BOX)."""
    families = tuple(rcParams["font.family"])
    missing = lacks(families, set(text))
    # a family's regular face, as matplotlib picks it
    fonts = font_manager.fontManager.ttflist
    regular = (f.name for f in fonts if f.style == "normal" and f.weight in (400, "normal"))
    # Last Resort has placeholders, not characters
    for name in dict.fromkeys(regular):
        if missing and "Last Resort" not in name and (left := lacks([name], missing)) != missing:
            families, missing = (*families, name), left
    return families, "".join(sorted(missing))


def plot_layer(weights, labels: list[str], heads: list[int], title: str, dpi: int = 100):
    """weights (len(heads), T, T) -> a heatmap per head: softmax weights on a square-root
    scale (0.05 still shows), signed ones (linear with rope) around 0."""
    n, T = len(heads), weights.shape[-1]
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    # inches per heatmap
    size = min(8.0, max(2.5, 0.13 * T))
    # points: a label per token must fit
    font = min(9.0, max(3.0, 0.7 * size * 72 / T))
    families, missing = label_fonts("".join(labels))
    labels = [label.translate({ord(c): BOX for c in missing}) for label in labels]
    prop = FontProperties(family=families, size=font)
    measure = TextToPath().get_text_width_height_descent
    widest = max(measure(label, prop, False)[0] for label in labels)
    # inches left of and below a heatmap, for its labels
    room = widest / 72 + 0.35
    figsize = (cols * (size + room) + 1.2, rows * (size + room + 0.3) + 0.6)
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    signed, m = bool((weights < 0).any()), float(abs(weights).max())
    if signed:
        norm, cmap = Normalize(-m, m), "RdBu_r"
    else:
        norm, cmap = PowerNorm(0.5, vmin=0.0, vmax=max(1.0, m)), "Blues"
    ticks = dict(fontsize=font, fontfamily=families, parse_math=False)
    for ax, h, w in zip(axes.flat, heads, weights):
        image = ax.imshow(w, cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=10)
        ax.set_xticks(range(T), labels, rotation=90, **ticks)
        ax.set_yticks(range(T), labels, **ticks)
        ax.tick_params(length=0, pad=1)
        ax.set_xlabel("key: the token attended to", fontsize=8)
        ax.set_ylabel("query: the token attending", fontsize=8)
    for ax in axes.flat[n:]:
        fig.delaxes(ax)
    label = "weight (signed: not a distribution)" if signed else "weight (square-root scale)"
    fig.colorbar(image, ax=axes.flat[:n], shrink=0.6, label=label)
    fig.suptitle(title, fontsize=11, wrap=True)
    return fig


def plot_summary(rows: list[str], scores: dict, dpi: int):
    """rows: a name per head ('layer 0 head 1'); scores: head_scores' {name: (len(rows),)}."""
    names = [s for s in SCORE_NAMES if not np.isnan(scores[s]).all()]
    # (heads, patterns)
    shares = np.stack([scores[s] for s in names], axis=1)
    # (heads, 1)
    distance = scores["distance"][:, None]
    figsize = (3.8 + 1.0 * len(names), 1.2 + 0.28 * len(rows))
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[len(names), 1.3])
    farthest = max(1.0, float(np.nanmax(distance)))
    panels = ((left, shares, [SCORE_NAMES[s] for s in names], "Blues", (0.0, 1.0), "{:.2f}"),
              (right, distance, ["mean\ndistance"], "Oranges", (0.0, farthest), "{:.1f}"))
    for ax, values, columns, cmap, (lo, hi), fmt in panels:
        ax.imshow(values, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(columns)), columns, fontsize=8)
        ax.xaxis.tick_top()
        ax.set_yticks(range(len(rows)), rows if ax is left else [], fontsize=8)
        ax.tick_params(length=0)
        for (r, c), v in np.ndenumerate(values):
            dark = (v - lo) / (hi - lo) > 0.6
            ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    left.set_title("share of each head's attention on ...", fontsize=9)
    right.set_title("tokens back", fontsize=9)
    return fig
