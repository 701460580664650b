"""Attention maps: every variant's weights are the ones it uses (weights @ V gives its output), rows
are distributions over the visible past, and attention.py draws them. attention.py --html: the
page's stored weights round-trip within their stated precision, the page inlines everything and
loads nothing, and in a real headless browser (Debian's chromium driven by playwright) it loads
without errors, a chosen token changes what is highlighted, and the weights and scores it shows
are the model's. The browser tests skip, saying why, where chromium or playwright is missing; with
REQUIRE_BROWSER=1 (CI) they fail instead."""
import base64
import importlib.util
import json
import os
import re
import shutil
import zlib
from functools import partial

import numpy as np
import pytest
import torch

from model.attention import build_attention
from model.attention.mha import causal_mask, consecutive_positions, merge_heads, split_heads
from model.attention.mla import MultiHeadLatentAttention
from model.attention_maps import attention_maps, head_scores, line_up_positions, newline_positions
from model.config import ModelConfig
from model.gpt import GPT
from model.positions import rope_tables
from tests.conftest import CHARS, OWN, run_tool, save_char_model
from viz.attention_page import PLACEHOLDER, TEMPLATE, attention_page, encode_weights

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
def test_rows_are_distributions_over_the_visible_past(attention, pos):
    """Exactly zero outside it; positive inside and summing to 1, but for linear attention
    with rope, whose rotated numerator and plain denominator differ: not a distribution, drawn
    as such."""
    attn, x, rope = layer_and_input(attention, pos, qk_norm=True)
    with torch.no_grad():
        _, weights = attn(x, rope, return_weights=True)
    visible = causal_mask(*consecutive_positions(T, T, "cpu"), window=OWN[attention].get("window", 0))
    assert torch.all(weights[..., ~visible] == 0.0)
    if attention == "sliding_window":
        assert (~visible).sum() > T * (T - 1) // 2, "the window hides more than the future"
    if (attention, pos) == ("linear", "rope"):
        assert (weights.sum(-1) - 1).abs().max() > 1e-2
        return
    assert torch.all(weights[..., visible] > 0.0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, T), atol=1e-5, rtol=0)


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
    before, _ = model(idx, all_logits=True)
    layers = attention_maps(model, idx)
    assert len(layers) == 3 and all(w.shape == (2, 4, T, T) for w in layers)
    after, _ = model(idx, all_logits=True)                              # hooks removed: a plain tensor again
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
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
    scores = head_scores(torch.stack([previous, first, eye]), ["ab"] * n)
    torch.testing.assert_close(scores["previous"], torch.tensor([1.0, 0.2, 0.0]))
    torch.testing.assert_close(scores["first"], torch.tensor([0.2, 1.0, 0.0]))
    torch.testing.assert_close(scores["self"], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(scores["distance"], torch.tensor([1.0, 3.0, 0.0]))   # (1+2+3+4+5) / 5
    assert scores["line_up"].isnan().all() and scores["newline"].isnan().all(), "no newline, no lines"


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


@pytest.mark.parametrize("T, n_heads", [(2, 1), (3, 2), (4, 1), (6, 4), (12, 4), (20, 4), (40, 1),
                                        (60, 2), (120, 1)])
def test_the_title_and_every_label_lie_within_the_figure_and_overlap_nothing(T, n_heads):
    """A short prompt's figure is narrower than the title: the title is wrapped, not cut at both
    ends. Multi-character tokens: the rotated x labels, the y labels beside them (the last one too)
    and the axis titles each have their own room, whatever the length of the longest token."""
    from matplotlib.text import Text

    from viz.attention_plots import plot_layer
    fig = plot_layer(torch.rand(n_heads, T, T).numpy(), bpe_labels(T), list(range(n_heads)), TITLE)
    renderer = rendered(fig)
    title = fig.get_suptitle()
    assert title.replace("\n", " ") == TITLE
    assert within(fig._suptitle.get_window_extent(renderer), fig.bbox)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    outside = [t.get_text() for t in texts if not within(t.get_window_extent(renderer), fig.bbox)]
    assert outside == [] and len(texts) > 2 * T
    for ax in image_panels(fig):
        xs, ys = ([t.get_window_extent(renderer) for t in labels]
                  for labels in (ax.get_xticklabels(), ax.get_yticklabels()))
        assert not [(i, j) for i, x in enumerate(xs) for j, y in enumerate(ys) if x.overlaps(y)]
        neighbours = (a.overlaps(b) for boxes in (xs, ys) for a, b in zip(boxes, boxes[1:]))
        assert not any(neighbours), "neighbours"
        axis_titles = [ax.xaxis.label.get_window_extent(renderer),
                       ax.yaxis.label.get_window_extent(renderer)]
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


def test_the_command_writes_a_png_per_layer_and_a_summary(run_dir, tmp_path, capsys):
    """(As a process of its own: the README's commands, tests/test_readme.py.)"""
    import matplotlib.image

    import attention
    out = tmp_path / "maps"
    argv = [run_dir, "--prompt", "ROMEO:\nTo be, or not?", "--out", out]
    rc, said, err = run_tool(attention, argv, capsys)
    assert rc == 0, err
    names = ["attention_layer0.png", "attention_layer1.png", "attention_summary.png"]
    assert said.split() == [str(out / n) for n in names]
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


PROMPT = "ROMEO:\nTo be, or not?\nJULIET:\nAy, me."
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def softmax_rows(n_heads, T, window=0, seed=0):
    """Random causal attention (n_heads, T, T) with exact zeros above the diagonal (and outside a window)."""
    scores = torch.randn(n_heads, T, T, generator=torch.Generator().manual_seed(seed)) * 3
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    hidden = (j > i) | ((i - j >= window) if window else torch.zeros(T, T, dtype=torch.bool))
    return scores.masked_fill(hidden, float("-inf")).softmax(-1).numpy()


def decode_weights(data: dict, n_heads: int, T: int) -> list[np.ndarray]:
    """The stored weights read back as the page reads them: per layer (n_heads, T, T), zero above the
    diagonal."""
    codes = np.frombuffer(zlib.decompress(base64.b64decode(data["weights"])), dtype=np.uint8)
    codes = codes.reshape(len(data["scale"]), n_heads, T * (T + 1) // 2)
    rows, cols = np.tril_indices(T)
    layers = []
    for layer_codes, zero, levels, scale in zip(codes, data["zero"], data["levels"], data["scale"]):
        root = (layer_codes.astype(np.float64) - zero) / levels
        w = np.zeros((n_heads, T, T))
        w[:, rows, cols] = np.sign(root) * root ** 2 * scale
        layers.append(w)
    return layers


def error_bound(w, scale: float, levels: int):
    """How far a stored weight can be from w in a layer of this scale and levels."""
    return scale * (np.sqrt(np.abs(w) / scale) / levels + 1 / (4 * levels ** 2))


@pytest.mark.parametrize("signed", [False, True])
def test_the_stored_weights_round_trip_within_the_bound(signed):
    layers = [softmax_rows(3, 17, window=4, seed=0), softmax_rows(3, 17, seed=1)]
    if signed:                        # as linear attention with rope: any sign, rows not summing to 1
        layers[1] = layers[1] * np.random.default_rng(0).uniform(-2, 2, size=layers[1].shape)
    encoded = encode_weights(layers)
    back = decode_weights(encoded, n_heads=3, T=17)
    assert encoded["signed"] == [False, signed] and encoded["scale"][0] == 1.0
    for original, decoded, scale, levels in zip(layers, back, encoded["scale"], encoded["levels"]):
        error, bound = np.abs(decoded - original), error_bound(original, scale, levels)
        assert np.all(error <= bound + 1e-12)
        assert error.max() > bound.max() / 4, "one byte each, not lossless: the bound is the claim"
        assert np.all(decoded[original == 0] == 0), "zeros (the future, outside a window) stay exactly zero"
    small = (layers[0] > 0) & (layers[0] < 0.01)
    assert small.any(), "the test needs small weights"
    assert np.all(np.abs(back[0] - layers[0])[small] <= 0.0004 + 4e-6), "small weights keep digits"


def inlined_data(html: str) -> dict:
    found = re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def test_the_page_inlines_its_data_and_refers_to_nothing_outside():
    texts = ["</script><script>alert(1)</script>", " a", "\n", "b"]
    scores = {"previous": np.array([0.5, 0.25]), "first": np.array([0.1, np.nan]), "self": np.zeros(2),
              "newline": np.full(2, np.nan), "line_up": np.full(2, np.nan), "distance": np.array([1.0, 2.0])}
    html = attention_page(texts, [softmax_rows(2, 4)], scores, "a <b>title</b>", layers=[3], heads=[0, 5])
    assert PLACEHOLDER not in html and html.count("</script>") == 2, "the token's text cannot end the data"
    assert not re.search(r"https?:|//[a-z]|\b(src|href)=|<link|@import|url\(", html), "nothing to fetch"
    assert "default-src 'none'" in html, "the browser refuses any request the page might make"
    data = inlined_data(html)
    assert data["tokens"] == texts and data["title"] == "a <b>title</b>" and data["layers"] == [3]
    assert list(data["summary"]["values"]) == ["previous", "first", "self", "distance"], \
        "all-NaN scores left out"
    assert data["summary"]["values"]["first"] == [0.1, None], "one NaN: null, shown blank"
    assert TEMPLATE.read_text().count(PLACEHOLDER) == 1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two random character models with sharp, distinct heads: softmax weights, and signed ones."""
    root = tmp_path_factory.mktemp("runs")
    model = dict(block_size=48, n_layer=2, n_head=3, n_embd=24, sharpen=10.0)
    return {"sdpa": save_char_model(root / "sdpa", **model),
            "linear": save_char_model(root / "linear", attention="linear", pos="rope", **model)}


def write_page(run_dir, path, *options):
    from attention import main
    assert main([str(run_dir), "--prompt", PROMPT, "--html", str(path), *options]) == 0
    return path


def test_the_command_writes_the_page_instead_of_the_pngs_or_both_with_out(checkpoints, tmp_path, capsys):
    page = write_page(checkpoints["sdpa"], tmp_path / "deep" / "page.html")
    assert capsys.readouterr().out.split() == [str(page)]
    assert not (checkpoints["sdpa"] / "attention").exists(), "no PNGs unless --out asks for them"
    data = inlined_data(page.read_text(encoding="utf-8"))
    assert "".join(data["tokens"]) == PROMPT and data["layers"] == [0, 1] and data["heads"] == [0, 1, 2]
    write_page(checkpoints["sdpa"], tmp_path / "page.html", "--out", str(tmp_path / "maps"), "--layers", "1")
    pngs = [tmp_path / "maps" / n for n in ("attention_layer1.png", "attention_summary.png")]
    assert capsys.readouterr().out.split() == [str(p) for p in (*pngs, tmp_path / "page.html")]


@pytest.mark.parametrize("where, message", [
    ("folder", "error: --html {tmp}/folder is a folder: give a file name"),
    ("file/page.html", "error: --html {tmp}/file/page.html: {tmp}/file is a file, not a folder"),
])
def test_a_bad_html_path_is_one_line_and_exit_2(checkpoints, tmp_path, capsys, where, message):
    from attention import main
    from common import run_cli
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    assert run_cli(main, [str(checkpoints["sdpa"]), "--prompt", PROMPT, "--html", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err


def test_a_page_that_cannot_be_written_is_one_line_and_exit_2(checkpoints, tmp_path, capsys, monkeypatch):
    import attention
    import common
    from common import run_cli

    def full_disk(f):   # (the page's bytes, written to the temporary file atomic_write renames)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(attention, "atomic_write", lambda path, data: common.atomic_write(path, full_disk))
    path = tmp_path / "page.html"
    assert run_cli(attention.main, [str(checkpoints["sdpa"]), "--prompt", PROMPT, "--html", str(path)]) == 2
    assert capsys.readouterr().err == f"error: No space left on device: {path}\n"
    assert not path.exists() and not list(tmp_path.glob(".page.html*")), "nothing half written"


# --- in a browser ---

def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install -r requirements-dev.txt)"
    if not shutil.which("chromium"):
        return "no chromium (Debian: apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = missing_browser()
    if missing:                       # skip, or fail where CI asks for a browser
        refuse = pytest.fail if os.environ.get("REQUIRE_BROWSER") == "1" else pytest.skip
        refuse(f"no browser test: {missing}")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=shutil.which("chromium"), headless=True,
                                     args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser):
    """open_page(path) -> a playwright Page with the file loaded (its data decoded and drawn) and
    .problems, a list of every console error, page error and request for anything but the file."""
    pages = []

    def open_(path):
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.problems = []
        url = path.resolve().as_uri()
        page.on("console", lambda m: m.type == "error" and page.problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
        page.on("request", lambda r: r.url != url and page.problems.append(f"request: {r.url}"))
        page.goto(url)
        page.wait_for_selector("body[data-ready]", state="attached", timeout=10_000)
        pages.append(page)
        return page
    yield open_
    for page in pages:
        page.close()


def shown(page) -> list:
    """Per token: (the weight the page shows for it or None, its background, whether it is the query)."""
    return page.eval_on_selector_all("#strip .tok", "spans => spans.map(s => [s.dataset.weight ?? null, "
                                     "s.style.background, s.classList.contains('query')])")


def test_the_page_loads_without_errors_and_a_chosen_token_changes_the_highlight(checkpoints, tmp_path,
                                                                                open_page):
    page = open_page(write_page(checkpoints["sdpa"], tmp_path / "page.html"))
    assert page.problems == []
    T = len(PROMPT)
    assert page.locator("#strip .tok").count() == T and page.locator("#overview canvas").count() == 6
    page.hover("#strip .tok >> nth=10")
    at_10 = shown(page)
    assert [q for _, _, q in at_10].index(True) == 10
    assert [w is not None for w, _, _ in at_10] == [j <= 10 for j in range(T)], "only the past is weighted"
    page.click("#strip .tok >> nth=25")                  # kept: hovering elsewhere no longer moves it
    page.hover("#strip .tok >> nth=3")
    at_25 = shown(page)
    assert [q for _, _, q in at_25].index(True) == 25 and at_25 != at_10
    assert {bg for _, bg, _ in at_25[:26]} != {bg for _, bg, _ in at_10[:11]}, "the shading itself changes"
    page.click("#overview .cell[data-layer='1'][data-head='2']")
    assert (page.input_value("#layer"), page.input_value("#head")) == ("1", "2") and shown(page) != at_25
    page.check("#relative")                               # darkest: this token's largest weight
    weights = [float(w) for w, _, _ in shown(page)[:26]]
    top = max(range(26), key=lambda j: weights[j])
    assert shown(page)[top][1] == "rgb(8, 81, 156)" and max(weights) < 0.99, "full colour at less than 1"
    assert page.problems == []


def model_maps(run_dir, prompt=PROMPT):
    """The model's own weights for prompt: per layer (1, nh, T, T)."""
    from model.attention_maps import attention_maps
    from loading import load_model
    loaded = load_model(run_dir)
    return attention_maps(loaded.model, torch.tensor([loaded.tokenizer.encode(prompt)]))


def assert_shows_the_models_row(page, data, maps, layer, head, query):
    """Pick layer and head (the model's numbers) and click token `query`: the weights the page shows
    are the model's within error_bound, and another head's would not be."""
    page.select_option("#layer", value=str(layer))
    page.select_option("#head", value=str(head))
    page.click(f"#strip .tok >> nth={query}")
    weights = np.array([float(w) for w, _, _ in shown(page)[:query + 1]])
    k = data["layers"].index(layer)
    bound = partial(error_bound, scale=data["scale"][k], levels=data["levels"][k])
    rows = maps[layer][0, :, query, :query + 1].double().numpy()      # every head's, this query's
    assert np.all(np.abs(weights - rows[head]) <= bound(rows[head]) + 1e-9)
    for other in [h for h in range(len(rows)) if h != head]:          # so that showing the wrong head fails
        assert np.any(np.abs(weights - rows[other]) > bound(rows[other]))


@pytest.mark.parametrize("kind", ["sdpa", "linear"])
def test_the_weights_and_scores_shown_are_the_models(checkpoints, tmp_path, open_page, kind):
    from model.attention_maps import head_scores
    maps = model_maps(checkpoints[kind])
    assert (min(float(w.min()) for w in maps) < 0) == (kind == "linear"), "signed weights are what is tested"
    page_file = write_page(checkpoints[kind], tmp_path / "page.html")
    page = open_page(page_file)
    data = inlined_data(page_file.read_text(encoding="utf-8"))
    cases = [(1, 2, len(PROMPT) - 1), (0, 1, 17)]
    if kind == "linear":                                   # and the row of the most negative weight
        stacked = torch.stack([w[0] for w in maps])         # (layers, heads, T, T)
        cases.append(tuple(int(n) for n in np.unravel_index(int(stacked.argmin()), stacked.shape)[:3]))
        assert stacked.min() < -0.01, "a negative weight ten times the bound there: a lost sign would show"
    for layer, head, query in cases:
        assert_shows_the_models_row(page, data, maps, layer, head, query)
    table = page.eval_on_selector_all("#summary tbody tr",
                                      "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    scores = head_scores(maps[1][0], list(PROMPT))
    row = table[3 + 2]                                      # layer 1, head 2
    names = list(data["summary"]["values"])                 # the columns after layer and head, in order
    assert {"previous", "first", "newline", "distance"} <= set(names), "previous, start of line, distance"
    assert row[:2] == ["1", "2"] and len(row) == 2 + len(names)
    for name, cell in zip(names, row[2:]):                  # shown to 2 decimals (distance: 1)
        tolerance = 0.05 if name == "distance" else 0.005
        assert float(cell) == pytest.approx(scores[name][2].item(), abs=tolerance), name
    assert page.problems == []


def test_a_page_of_some_layers_and_heads_shows_them_by_the_models_numbers(checkpoints, tmp_path, open_page):
    page_file = write_page(checkpoints["sdpa"], tmp_path / "page.html", "--layers", "1", "--heads", "0,2")
    page = open_page(page_file)
    heads = page.eval_on_selector_all("#head option", "options => options.map(o => o.textContent)")
    assert heads == ["0", "2"]
    assert_shows_the_models_row(page, inlined_data(page_file.read_text(encoding="utf-8")),
                                model_maps(checkpoints["sdpa"]), layer=1, head=2, query=30)
    assert page.problems == []


def test_a_500_token_prompt_loads_quickly_and_shows_the_models_weights(tmp_path, open_page):
    import time
    from attention import main
    run_dir = save_char_model(tmp_path / "long", block_size=512, n_layer=2, n_head=3, n_embd=24, sharpen=10.0)
    prompt = ((PROMPT + "\n") * 14)[:500]
    page_file = tmp_path / "page.html"
    assert main([str(run_dir), "--prompt", prompt, "--html", str(page_file)]) == 0
    start = time.perf_counter()
    page = open_page(page_file)                             # decoded and drawn
    seconds = time.perf_counter() - start
    assert page.locator("#strip .tok").count() == 500 and page.locator("#overview canvas").count() == 6
    assert seconds < 5, f"the page took {seconds:.1f} s to load and draw"
    maps, data = model_maps(run_dir, prompt), inlined_data(page_file.read_text(encoding="utf-8"))
    for layer, head, query in [(1, 2, 499), (0, 0, 250)]:
        assert_shows_the_models_row(page, data, maps, layer, head, query)
    assert page.problems == []
