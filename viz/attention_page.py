"""One prompt's attention as a single self-contained HTML page: hover or click a token to see where it
looks, per layer and head; an overview of every head; the per-head summary of attention.py's PNGs.

    html = attention_page(texts, weights, scores, title)     # texts: the tokens, weights: per layer

The page needs nothing but itself: the data is inlined as JSON in attention_page.html (the template
beside this file, vanilla JS), and its Content-Security-Policy forbids every network request.

How the weights are stored. A query i sees keys j <= i only, so each head keeps its lower triangle,
row by row (T(T+1)/2 numbers), quantized to one byte: w = (code - zero) * step, per layer.
    softmax layers   zero = 0, step = max(1, the layer's largest weight) / 255: in practice 1/255
    signed layers    zero = 128, step = m / 127, m the layer's largest |weight| (linear attention
                     with rope: rows need not sum to 1 and weights can be negative)
so every weight the page shows is within step / 2 of the model's (0.002 for softmax layers), and a
weight of exactly 0 stays exactly 0. The bytes of all layers are zlib-compressed and base64-encoded;
the page inflates them with the browser's own DecompressionStream. decode_weights() reads them back.
"""
import base64
import json
import math
import zlib
from pathlib import Path

import numpy as np

TEMPLATE = Path(__file__).with_name("attention_page.html")
PLACEHOLDER = "/*ATTENTION_DATA*/"
SCORE_NAMES = {"previous": "previous token", "first": "first token", "self": "itself",
               "newline": "newline that began its line", "line_up": "same column one line up",
               "distance": "mean distance (tokens back)"}


def attention_page(texts: list[str], weights: list[np.ndarray], scores: list[dict], title: str,
                   layers: list[int] | None = None, heads: list[int] | None = None) -> str:
    """The page's HTML.

    texts    each token's text, T of them
    weights  per layer shown, its attention weights (nh, T, T): row i is query i, column j key j
    scores   per layer shown, model.inspect.head_scores as numpy: {name: (nh,)}, NaN where undefined
    title    a line naming the model and prompt
    layers, heads  the model's numbers for the layers and heads given (default 0, 1, ...)"""
    T = len(texts)
    if not weights or any(w.ndim != 3 or w.shape[1:] != (T, T) or w.shape[0] != weights[0].shape[0] for w in weights):
        raise ValueError(f"weights must be one (nh, {T}, {T}) array per layer, the same nh for each")
    layers = list(range(len(weights))) if layers is None else layers
    heads = list(range(weights[0].shape[0])) if heads is None else heads
    data = {"title": title, "tokens": texts, "layers": layers, "heads": heads,
            **encode_weights(weights), "summary": summary(scores)}
    return render(data)


def encode_weights(weights: list[np.ndarray]) -> dict:
    """Per-layer (nh, T, T) arrays -> {"signed", "zero", "step", "scale": one per layer, "weights":
    base64 of the zlib-compressed codes (layer, head, row i, key j <= i), one byte each}."""
    T = weights[0].shape[-1]
    rows, cols = np.tril_indices(T)                                  # row-major: (0,0), (1,0), (1,1), ...
    coded = [quantize(w[:, rows, cols].astype(np.float64)) for w in weights]
    codes = np.stack([c for c, _, _, _ in coded])                    # (layers, heads, T(T+1)/2) uint8
    return {"signed": [s for _, s, _, _ in coded], "zero": [z for _, _, z, _ in coded],
            "step": [st for _, _, _, st in coded],
            "scale": [st * (127 if s else 255) for _, s, _, st in coded],   # the largest |weight| codes reach
            "weights": base64.b64encode(zlib.compress(codes.tobytes(), 9)).decode("ascii")}


def quantize(values: np.ndarray) -> tuple[np.ndarray, bool, int, float]:
    """One layer's stored weights -> (uint8 codes, signed, zero, step) with values ≈ (codes - zero) * step
    to within step / 2 (see the top)."""
    signed = bool((values < 0).any())
    if signed:
        zero, step = 128, float(np.abs(values).max()) / 127
    else:
        zero, step = 0, max(1.0, float(values.max())) / 255
    codes = np.clip(np.rint(values / step) + zero, 0, 255).astype(np.uint8)
    return codes, signed, zero, step


def decode_weights(data: dict, n_heads: int, T: int) -> list[np.ndarray]:
    """The inverse of encode_weights, as the page computes it: per layer (n_heads, T, T), zero above
    the diagonal."""
    codes = np.frombuffer(zlib.decompress(base64.b64decode(data["weights"])), dtype=np.uint8)
    codes = codes.reshape(len(data["step"]), n_heads, T * (T + 1) // 2)
    rows, cols = np.tril_indices(T)
    layers = []
    for layer_codes, zero, step in zip(codes, data["zero"], data["step"]):
        w = np.zeros((n_heads, T, T))
        w[:, rows, cols] = (layer_codes.astype(np.float64) - zero) * step
        layers.append(w)
    return layers


def summary(scores: list[dict]) -> dict:
    """Per-layer head_scores -> {"names": {key: column title}, "values": {key: one number per head,
    layer by layer}}; NaN becomes null (JSON has no NaN), and a score NaN for every head is left out."""
    values = {}
    for name in SCORE_NAMES:
        column = [float(v) for layer in scores for v in np.asarray(layer[name]).ravel()]
        if not all(math.isnan(v) for v in column):
            values[name] = [None if math.isnan(v) else v for v in column]
    return {"names": {name: SCORE_NAMES[name] for name in values}, "values": values}


def render(data: dict) -> str:
    """The template with data inlined. '<' is written as \\u003c, the same string to JSON, so no token
    text can close the <script> element that holds it."""
    template = TEMPLATE.read_text(encoding="utf-8")
    if template.count(PLACEHOLDER) != 1:
        raise RuntimeError(f"{TEMPLATE} must hold {PLACEHOLDER} exactly once")
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    return template.replace(PLACEHOLDER, text)
