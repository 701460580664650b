"""attention.py --html: the page's stored weights round-trip within their stated precision, the page
inlines everything and loads nothing, and in a real headless browser (Debian's chromium driven by
playwright) it loads without errors, a chosen token changes what is highlighted, and the weights and
scores it shows are the model's. The browser tests skip, saying why, where chromium or playwright is
missing; with REQUIRE_BROWSER=1 (CI) they fail instead."""
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

from tests.conftest import save_char_model
from viz.attention_page import PLACEHOLDER, TEMPLATE, attention_page, encode_weights, error_bound

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
    return attention_maps(loaded.model, torch.tensor([loaded.tokenizer.encode(prompt)]))[1]


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
