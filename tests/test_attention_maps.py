"""Attention maps: every variant's weights are the ones it uses (weights @ V gives its output), rows
are distributions over the visible past, and attention.py draws them and fails on bad input in one line."""
import subprocess
import sys

import pytest
import torch

from model.attention import build_attention
from model.attention.mha import causal_mask, consecutive_positions, merge_heads, split_heads
from model.attention.mla import MultiHeadLatentAttention
from model.config import ModelConfig
from model.gpt import GPT
from model.attention_maps import attention_maps, head_scores, line_up_positions, newline_positions
from model.positions import rope_tables

from tests.conftest import CHARS, ROOT, save_char_model

OWN = {"naive": {}, "sdpa": {}, "gqa": {"n_kv_head": 2}, "sliding_window": {"window": 5},
       "linear": {}, "mla": {"kv_latent_dim": 12}}
COMBOS = [(a, p) for a in OWN for p in ("learned", "rope", "alibi") if (a, p) != ("linear", "alibi")]
T = 12


def layer_and_input(attention, pos, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(n_embd=32, n_head=4, block_size=16, attention=attention, pos=pos, **OWN[attention],
                      **kw)
    attn = build_attention(cfg).eval()
    if attention == "linear":
        attn.chunk = 5        # several chunks: the weights must match the chunked output across them
    rope = rope_tables(cfg.head_dim, T, cfg.rope_base) if pos == "rope" else None
    return attn, torch.randn(2, T, 32), rope


def values(attn, x):
    """Each query head's values (B, nh, T, hs), rebuilt here from the layer's own parameters."""
    if isinstance(attn, MultiHeadLatentAttention):
        return split_heads(attn.value_up(attn.kv_norm(attn.kv_down(x))), attn.n_head)
    n_kv = getattr(attn, "n_kv_head", attn.n_head)
    return split_heads(attn.value(x), n_kv).repeat_interleave(attn.n_head // n_kv, dim=1)


@pytest.mark.parametrize("attention, pos", COMBOS)
def test_the_drawn_weights_reproduce_the_layers_output(attention, pos):
    attn, x, rope = layer_and_input(attention, pos)
    with torch.no_grad():
        expected = attn(x, rope)                                      # the training path (sdpa, chunked, ...)
        out, weights = attn(x, rope, return_weights=True)
        rebuilt = attn.proj(merge_heads(weights @ values(attn, x)))    # concatenate heads, project
    assert weights.shape == (2, 4, T, T)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rebuilt, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention, pos", COMBOS)
def test_weights_are_exactly_zero_outside_the_visible_past(attention, pos):
    attn, x, rope = layer_and_input(attention, pos)
    with torch.no_grad():
        _, weights = attn(x, rope, return_weights=True)
    visible = causal_mask(*consecutive_positions(T, T, "cpu"), window=OWN[attention].get("window", 0))
    assert torch.all(weights[..., ~visible] == 0.0)
    if attention == "sliding_window":
        assert (~visible).sum() > T * (T - 1) // 2, "the window hides more than the future"
    if (attention, pos) != ("linear", "rope"):
        assert torch.all(weights[..., visible] > 0.0)


@pytest.mark.parametrize("attention, pos", [c for c in COMBOS if c != ("linear", "rope")])
def test_rows_are_distributions(attention, pos):
    attn, x, rope = layer_and_input(attention, pos, qk_norm=True)
    with torch.no_grad():
        _, weights = attn(x, rope, return_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, T), atol=1e-5, rtol=0)


def test_linear_attention_with_rope_is_not_a_distribution_and_is_drawn_as_such():
    attn, x, rope = layer_and_input("linear", "rope")
    with torch.no_grad():
        _, weights = attn(x, rope, return_weights=True)
    assert (weights.sum(-1) - 1).abs().max() > 1e-2, "the rotated numerator and plain denominator differ"


def test_a_linear_layer_refuses_weights_with_a_cache():
    attn, x, _ = layer_and_input("linear", "learned")
    with pytest.raises(ValueError, match="whole sequence"):
        attn(x, cache=attn.new_cache(2, 16, "cpu", torch.float32), return_weights=True)


@pytest.mark.parametrize("attention, pos", [("sdpa", "learned"), ("gqa", "alibi"), ("linear", "rope"),
                                            ("mla", "rope")])
def test_attention_maps_collects_every_layer_and_leaves_the_model_as_it_was(attention, pos):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=40, block_size=16, n_layer=3, n_head=4, n_embd=32, attention=attention,
                            pos=pos, **OWN[attention])).eval()
    idx = torch.randint(0, 40, (2, T), generator=torch.Generator().manual_seed(1))
    logits, layers = attention_maps(model, idx)
    assert len(layers) == 3 and all(w.shape == (2, 4, T, T) for w in layers)
    plain, _ = model(idx, all_logits=True)                              # hooks removed: a plain tensor again
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=0)
    assert not torch.equal(layers[0], layers[1]), "each layer's own weights"
    with pytest.raises(ValueError, match="eval"):
        attention_maps(model.train(), idx)


def test_head_scores_name_the_patterns():
    n = 6
    eye = torch.eye(n)
    previous = torch.diag(torch.ones(n - 1), -1)
    previous[0, 0] = 1.0
    first = torch.zeros(n, n)
    first[:, 0] = 1.0
    scores = head_scores(torch.stack([previous, first, eye]))
    torch.testing.assert_close(scores["previous"], torch.tensor([1.0, 0.2, 0.0]))
    torch.testing.assert_close(scores["first"], torch.tensor([0.2, 1.0, 0.0]))
    torch.testing.assert_close(scores["self"], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(scores["distance"], torch.tensor([1.0, 3.0, 0.0]))   # (1+2+3+4+5) / 5
    assert scores["line_up"].isnan().all() and scores["newline"].isnan().all(), "no texts: no lines"


def test_the_newline_score_is_the_attention_on_the_newline_that_began_the_line():
    texts = ["To", " be", "\n", "or", " not", ".\n", "That"]
    assert newline_positions(texts).tolist() == [-1, -1, -1, 2, 2, 2, 5]
    weights = torch.eye(7)[None].clone()
    weights[0, 4] = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    assert head_scores(weights, texts)["newline"].item() == pytest.approx(0.5 / 4)


def test_one_line_up_is_the_same_column_of_the_line_above():
    texts = list("ab\ncde\nfghij")
    assert line_up_positions(texts).tolist() == [-1, -1, -1, 0, 1, -1, -1, 3, 4, 5, -1, -1]
    up = line_up_positions(texts)
    weights = torch.zeros(1, 12, 12)
    rows = (up >= 0).nonzero().squeeze(1)
    weights[0, rows, up[rows]] = 1.0
    assert head_scores(weights, texts)["line_up"].item() == 1.0
    assert head_scores(weights, ["ab"] * 12)["line_up"].isnan().all(), "only for one character per token"


# --- attention.py ---

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A random tiny character model saved as a checkpoint (training is not what is tested here)."""
    return save_char_model(tmp_path_factory.mktemp("run"), block_size=24, n_layer=2, n_head=3, n_embd=24)


def image_panels(fig):
    return [ax for ax in fig.axes if ax.images]


def test_a_layer_figure_has_a_labelled_panel_per_head():
    import matplotlib
    matplotlib.use("Agg")
    from viz.attention_plots import plot_layer, visible
    labels = [visible(c) for c in "To be\nor"]
    fig = plot_layer(torch.rand(3, 8, 8).numpy(), labels, heads=[0, 2, 3], title="layer 0")
    panels = image_panels(fig)
    assert [ax.get_title() for ax in panels] == ["head 0", "head 2", "head 3"]
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["T", "o", "␣", "b", "e", "⏎", "o", "r"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == labels


def test_bpe_tokens_are_labelled_with_their_text_and_visible_whitespace():
    from attention import token_texts
    from viz.attention_plots import visible
    from common import UserError
    from data.tokenizers import build_tokenizer
    try:
        tokenizer = build_tokenizer("gpt2")
    except UserError as e:
        pytest.skip(f"gpt2 BPE files unavailable (set TIKTOKEN_CACHE_DIR): {e}")
    texts = token_texts(tokenizer, tokenizer.encode("To be\nor not"))
    assert [visible(t) for t in texts] == ["To", "␣be", "⏎", "or", "␣not"]


TITLE = "layer 0 (sliding_window, pos=learned): row = query token, column = the token it attends to"
WORDS = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. Resolved."


def bpe_labels(T):
    """T labels as a BPE model's tokens are: words and pieces of words, with their spaces and newlines."""
    from viz.attention_plots import visible
    pieces = [w for word in WORDS.split(" ") for w in (" " + word, "\n")[: 1 + (word[-1] in ":.")]]
    return [visible(pieces[i % len(pieces)]) for i in range(T)]


def rendered(fig):
    """fig laid out and drawn as savefig draws a PNG (with Agg): its texts' window extents are final."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def within(box, outer, slack=1.0):
    return box.x0 >= outer.x0 - slack and box.x1 <= outer.x1 + slack and box.y0 >= outer.y0 - slack \
        and box.y1 <= outer.y1 + slack


@pytest.mark.parametrize("T, n_heads", [(2, 1), (3, 2), (6, 4), (40, 1)])
def test_the_title_and_every_label_lie_within_the_figure(T, n_heads):
    """A short prompt's figure is narrower than the title: the title is wrapped, not cut at both ends."""
    from matplotlib.text import Text

    from viz.attention_plots import plot_layer
    fig = plot_layer(torch.rand(n_heads, T, T).numpy(), bpe_labels(T), list(range(n_heads)), TITLE)
    renderer = rendered(fig)
    title = fig.get_suptitle()
    assert title.replace("\n", " ") == TITLE and within(fig._suptitle.get_window_extent(renderer), fig.bbox)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    outside = [t.get_text() for t in texts if not within(t.get_window_extent(renderer), fig.bbox)]
    assert outside == [] and len(texts) > 2 * T


@pytest.mark.parametrize("T, n_heads", [(4, 1), (12, 4), (20, 4), (60, 2), (120, 1)])
def test_bpe_labels_overlap_neither_each_other_nor_the_other_axis(T, n_heads):
    """Multi-character tokens: the rotated x labels, the y labels beside them (the last one too) and the
    axis titles each have their own room, whatever the length of the longest token."""
    from viz.attention_plots import plot_layer
    fig = plot_layer(torch.rand(n_heads, T, T).numpy(), bpe_labels(T), list(range(n_heads)), TITLE)
    renderer = rendered(fig)
    for ax in image_panels(fig):
        xs, ys = ([t.get_window_extent(renderer) for t in labels] for labels in (ax.get_xticklabels(),
                                                                               ax.get_yticklabels()))
        assert not [(i, j) for i, x in enumerate(xs) for j, y in enumerate(ys) if x.overlaps(y)]
        assert not any(a.overlaps(b) for boxes in (xs, ys) for a, b in zip(boxes, boxes[1:])), "neighbours"
        axis_titles = [ax.xaxis.label.get_window_extent(renderer), ax.yaxis.label.get_window_extent(renderer)]
        assert not any(box.overlaps(title) for box in xs + ys for title in axis_titles)


def test_labels_are_text_as_it_is_not_math():
    """GPT-2 has the tokens '$$' and ' $$', which matplotlib would parse as (empty, failing) math."""
    from viz.attention_plots import plot_layer
    labels = ["$$", "␣$$", "$x^2$", "a_b"]
    fig = plot_layer(torch.rand(1, 4, 4).numpy(), labels, [0], "layer 0")
    rendered(fig)
    assert [t.get_text() for t in image_panels(fig)[0].get_xticklabels()] == labels


@pytest.fixture
def fonts(monkeypatch):
    """Set the installed fonts to those of the given family names (None: as they are), with
    label_fonts' memory of earlier answers cleared before and after."""
    from matplotlib import font_manager

    from viz.attention_plots import label_fonts
    installed = font_manager.fontManager.ttflist

    def only(*names):
        label_fonts.cache_clear()
        if names:
            kept = [f for f in installed if f.name in names]
            monkeypatch.setattr(font_manager.fontManager, "ttflist", kept)
    yield only
    label_fonts.cache_clear()


def glyph_warnings(caught):
    return [str(w.message) for w in caught
            if "Glyph" in str(w.message) or "missing from font" in str(w.message)]


@pytest.mark.parametrize("names", [(), ("DejaVu Sans", "STIXGeneral")])
def test_a_character_the_default_font_lacks_is_drawn_in_an_installed_font_that_has_it(fonts, names):
    """Ⓐ is in none of matplotlib's DejaVu fonts, and in its STIX ones (which matplotlib brings along)."""
    import warnings

    from viz.attention_plots import label_fonts, plot_layer
    fonts(*names)
    families, missing = label_fonts("ab␣Ⓐ⏎")
    assert missing == "" and families[0] == "sans-serif" and len(families) > 1, families
    if names:
        assert families == ("sans-serif", "STIXGeneral")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plot_layer(torch.rand(1, 4, 4).numpy(), ["a", "b␣", "Ⓐ", "⏎"], [0], "layer 0")
        rendered(fig)
    assert glyph_warnings(caught) == []
    assert [t.get_text() for t in image_panels(fig)[0].get_yticklabels()] == ["a", "b␣", "Ⓐ", "⏎"]


def test_a_character_no_installed_font_has_is_drawn_as_a_box_without_a_warning_per_glyph(fonts):
    import warnings

    from viz.attention_plots import label_fonts, plot_layer
    fonts("DejaVu Sans")
    assert label_fonts("to 日本語 be") == (("sans-serif",), "日本語")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plot_layer(torch.rand(2, 4, 4).numpy(), ["日本", "語", "␣to", "be"], [0, 1], "layer 0")
        rendered(fig)
    assert glyph_warnings(caught) == []
    assert [t.get_text() for t in image_panels(fig)[1].get_xticklabels()] == ["□□", "□", "␣to", "be"]


def test_the_command_names_the_characters_it_cannot_draw_once(fonts, tmp_path, capsys):
    import warnings

    import attention
    fonts("DejaVu Sans")
    run = save_char_model(tmp_path / "run", chars=CHARS + "日本語", block_size=24, n_layer=2, n_head=2,
                          n_embd=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = attention.main([str(run), "--prompt", "日本 to be, 語", "--out", str(tmp_path / "maps")])
    assert rc == 0
    err = capsys.readouterr().err
    assert glyph_warnings(caught) == [] and "Glyph" not in err
    notes = [line for line in err.splitlines() if "font" in line]
    assert notes == ["note: no installed font has the characters '日本語': drawn as □"], err


def test_the_command_writes_a_png_per_layer_and_a_summary(run_dir, tmp_path):
    import matplotlib.image
    out = tmp_path / "maps"
    result = subprocess.run([sys.executable, "attention.py", str(run_dir), "--prompt",
                             "ROMEO:\nTo be, or not?", "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names = ["attention_layer0.png", "attention_layer1.png", "attention_summary.png"]
    assert result.stdout.split() == [str(out / n) for n in names]
    for name in names:
        assert matplotlib.image.imread(out / name).shape[0] > 100


def test_the_command_draws_the_chosen_heads_and_cuts_a_long_prompt(run_dir, capsys, monkeypatch):
    import attention
    import viz.attention_plots
    drawn, draw = [], viz.attention_plots.plot_layer

    def spy(weights, labels, heads, *rest):
        drawn.append((weights.shape, len(labels), heads, draw(weights, labels, heads, *rest)))
        return drawn[-1][-1]
    monkeypatch.setattr(viz.attention_plots, "plot_layer", spy)
    assert attention.main([str(run_dir), "--prompt", "a" * 30, "--layers", "1", "--heads", "0,2"]) == 0
    (shape, n_labels, heads, fig), = drawn
    assert shape == (2, 24, 24) and n_labels == 24 and heads == [0, 2] and len(image_panels(fig)) == 2
    printed = capsys.readouterr()
    assert "drawing the last 24" in printed.err
    names = ("attention_layer1.png", "attention_summary.png")
    assert printed.out.split() == [str(run_dir / "attention" / n) for n in names]
