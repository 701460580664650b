"""One prompt's attention as a single self-contained HTML page: hover or click a token to see where it
looks, per layer and head; an overview of every head; the per-head summary of attention.py's PNGs.

    html = attention_page(texts, weights, scores, title)     # texts: the tokens, weights: per layer

The page needs nothing but itself: the data is inlined as JSON in attention_page.html (the template
beside this file, vanilla JS), and its Content-Security-Policy forbids every network request.

How the weights are stored. A query i sees keys j <= i only, so each head keeps its lower triangle,
row by row (T(T+1)/2 numbers), in one byte each on a square-root scale: per layer,
    w = ±scale · ((code - zero) / levels)²
    softmax layers   zero = 0, levels = 255, scale = max(1, the layer's largest weight): in practice 1
    signed layers    zero = 128, levels = 127, scale = the layer's largest |weight| (linear attention
                     with rope: rows need not sum to 1, and weights can be negative)
Rounding the root to 1/(2·levels) puts every weight the page shows within
    scale · (√(|w| / scale) / levels + 1 / (4·levels²))      (error_bound)
of the model's: for softmax layers 0.0039 at w = 1, 0.0020 at 0.25, 0.0004 at 0.01, 0.000004 at 0.
(A byte on a linear scale would be off by up to 0.002 everywhere: all of a weight of 1/500, common
with a long prompt.) Zero stays exactly zero, and the page's shade, on a square-root scale as the
PNGs' for softmax layers (signed ones too), is linear in the code. The bytes of all layers are
zlib-compressed and base64-encoded; the page inflates them with the browser's DecompressionStream.
decode_weights() reads them back as the page does.
"""
import base64
import json
import math
import zlib
from pathlib import Path

import numpy as np

from viz.attention_maps import SCORE_NAMES as SHARE_NAMES

TEMPLATE = Path(__file__).with_name("attention_page.html")
PLACEHOLDER = "/*ATTENTION_DATA*/"
SCORE_NAMES = {**{name: title.replace("\n", " ") for name, title in SHARE_NAMES.items()},
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
    """Per-layer (nh, T, T) arrays -> {"signed", "zero", "levels", "scale": one per layer, "weights":
    base64 of the zlib-compressed codes (layer, head, row i, key j <= i), one byte each}."""
    T = weights[0].shape[-1]
    rows, cols = np.tril_indices(T)                                  # row-major: (0,0), (1,0), (1,1), ...
    coded = [quantize(w[:, rows, cols].astype(np.float64)) for w in weights]
    codes = np.stack([c for c, _ in coded])                          # (layers, heads, T(T+1)/2) uint8
    data = {key: [q[key] for _, q in coded] for key in ("signed", "zero", "levels", "scale")}
    return {**data, "weights": base64.b64encode(zlib.compress(codes.tobytes(), 9)).decode("ascii")}


def quantize(values: np.ndarray) -> tuple[np.ndarray, dict]:
    """One layer's stored weights -> (uint8 codes, {"signed", "zero", "levels", "scale"}), the codes the
    rounded square roots (see the top)."""
    signed = bool((values < 0).any())
    zero, levels = (128, 127) if signed else (0, 255)
    scale = float(np.abs(values).max()) if signed else max(1.0, float(values.max()))
    root = np.sign(values) * np.sqrt(np.abs(values) / scale)          # in [-1, 1]
    codes = np.clip(np.rint(root * levels) + zero, 0, 255).astype(np.uint8)
    return codes, {"signed": signed, "zero": zero, "levels": levels, "scale": scale}


def decode_weights(data: dict, n_heads: int, T: int) -> list[np.ndarray]:
    """The inverse of encode_weights, as the page computes it: per layer (n_heads, T, T), zero above
    the diagonal."""
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
    """How far a stored weight can be from w (a number or an array) in a layer of this scale and levels."""
    return scale * (np.sqrt(np.abs(w) / scale) / levels + 1 / (4 * levels ** 2))


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
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
    return TEMPLATE.read_text(encoding="utf-8").replace(PLACEHOLDER, text)
