"""One prompt's attention as a self-contained HTML page: JSON inlined in the template
attention_page.html, whose Content-Security-Policy forbids every network request.

Each head's lower triangle (query i sees keys j <= i) is stored row by row, one byte a
weight on a square-root scale: w = ±scale · ((code - zero) / levels)², per layer
    softmax   zero = 0, levels = 255, scale = max(1, the largest weight)
    signed    zero = 128, levels = 127, scale = the largest |weight| (linear with rope)
A shown softmax weight is within 0.0039 of the model's at 1, 0.0004 at 0.01 (a linear byte:
0.002 everywhere); zero stays zero. The bytes are zlib-compressed and base64-encoded.
"""
import base64
import json
import math
import zlib
from pathlib import Path

import numpy as np

from viz.attention_plots import SCORE_NAMES as SHARE_NAMES

TEMPLATE = Path(__file__).with_name("attention_page.html")
PLACEHOLDER = "/*ATTENTION_DATA*/"
SCORE_NAMES = {**{name: title.replace("\n", " ") for name, title in SHARE_NAMES.items()},
               "distance": "mean distance (tokens back)"}


def attention_page(texts: list[str], weights: list[np.ndarray], scores: dict, title: str,
                   layers: list[int], heads: list[int]) -> str:
    """The page's HTML; weights: (heads, T, T) per layer shown, scores: head_scores' as numpy."""
    data = {"title": title, "tokens": texts, "layers": layers, "heads": heads,
            **encode_weights(weights)}
    # JSON has no NaN: null; a score NaN for every head is left out
    values = {name: [None if math.isnan(v) else float(v) for v in scores[name]]
              for name in SCORE_NAMES if not np.isnan(scores[name]).all()}
    data["summary"] = {"names": {name: SCORE_NAMES[name] for name in values}, "values": values}
    # '<' as \u003c, the same to JSON: no token's text can close the <script> holding it
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c")
    return TEMPLATE.read_text(encoding="utf-8").replace(PLACEHOLDER, text)


def encode_weights(weights: list[np.ndarray]) -> dict:
    """Per-layer (heads, T, T) arrays -> each layer's code (see the top) and all the bytes."""
    # row-major: (0,0), (1,0), (1,1), ...
    rows, cols = np.tril_indices(weights[0].shape[-1])
    data, codes = {"signed": [], "zero": [], "levels": [], "scale": []}, []
    for w in weights:
        values = w[:, rows, cols].astype(np.float64)
        signed = bool((values < 0).any())
        zero, levels = (128, 127) if signed else (0, 255)
        scale = float(np.abs(values).max()) if signed else max(1.0, float(values.max()))
        # in [-1, 1]
        root = np.sign(values) * np.sqrt(np.abs(values) / scale)
        codes.append(np.clip(np.rint(root * levels) + zero, 0, 255).astype(np.uint8))
        for key, value in zip(data, (signed, zero, levels, scale)):
            data[key].append(value)
    packed = zlib.compress(np.stack(codes).tobytes(), 9)
    return {**data, "weights": base64.b64encode(packed).decode("ascii")}
