"""Looking inside a trained GPT: each layer's attention weights for a prompt, and a few numbers per
head that name the patterns one looks for in them.

attention_maps(model, idx) runs the model once, exactly as GPT.forward does, while every attention
layer is asked for its weights (forward(..., return_weights=True), see model/attention/). They are
the weights the model uses, by each variant's own math:

    naive, sdpa      softmax(QKᵀ/√hs + ALiBi bias, future masked); sdpa through the explicit path
    gqa              each query head's weights (its group's shared keys)
    sliding_window   the same, exactly zero outside the window
    mla              softmax over the up-projected keys (+ the decoupled rope part)
    linear           φ(q_i)·φ(k_j) / Σ_{j'≤i} φ(q_i)·φ(k_j'); with rope the numerator is rotated and
                     the denominator is not, so rows need not sum to 1 and weights can be negative

head_scores(weights, texts) summarizes each head by the share of its attention that goes to
    previous   the token just before it (i - 1)
    first      the first token of the prompt
    self       itself (the diagonal)
    line_up    the character in the same column one line up (character models only; NaN otherwise)
and by its mean distance Σ_j a_ij (i - j) in tokens: small for local heads, large for far-looking ones.
Each is averaged over the queries from the second token on (the first can only look at itself).
"""
import torch

SCORES = ("previous", "first", "self", "line_up")   # shares of attention, in [0, 1] for softmax heads


@torch.no_grad()
def attention_maps(model, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """idx (B, T) -> the logits (B, T, V) and each layer's attention weights (B, nh, T, T).

    Forward hooks pass return_weights=True to every attention layer and keep the weights it
    returns, handing the usual output on; the model itself runs unchanged. Call model.eval() first."""
    if model.training:
        raise ValueError("attention_maps needs model.eval(): dropout would change what is drawn")
    layers = []

    def ask_for_weights(module, args, kwargs):
        return args, {**kwargs, "return_weights": True}

    def keep_weights(module, args, kwargs, output):
        out, weights = output
        layers.append(weights)
        return out

    hooks = []
    for block in model.blocks:
        hooks.append(block.attn.register_forward_pre_hook(ask_for_weights, with_kwargs=True))
        hooks.append(block.attn.register_forward_hook(keep_weights, with_kwargs=True))
    try:
        logits, _ = model(idx, all_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, layers


def line_up_positions(texts: list[str]) -> torch.Tensor:
    """(T,) for each position, the position of the character in the same column on the line above,
    or -1 where there is none (the first line, a shorter line above). texts: one character each."""
    up, line_start, above_start = [], 0, -1
    for i, ch in enumerate(texts):
        j = above_start + (i - line_start)
        up.append(j if above_start >= 0 and j < line_start - 1 else -1)   # line_start - 1: the newline
        if ch == "\n":
            above_start, line_start = line_start, i + 1
    return torch.tensor(up, dtype=torch.long)


def head_scores(weights: torch.Tensor, texts: list[str] | None = None) -> dict[str, torch.Tensor]:
    """weights (nh, T, T) of one layer -> {score name: (nh,)}: SCORES and "distance" (see the top).
    line_up is computed when texts are given and every token is one character, else NaN."""
    nh, T, _ = weights.shape
    w = weights.float()
    i = torch.arange(1, T)                                                # the queries that have a past
    scores = {"previous": w[:, i, i - 1].mean(-1), "first": w[:, i, 0].mean(-1), "self": w[:, i, i].mean(-1)}
    scores["line_up"] = torch.full((nh,), float("nan"))
    if texts is not None and all(len(t) == 1 for t in texts):
        up = line_up_positions(texts)
        rows = (up >= 0).nonzero().squeeze(1)
        if len(rows):
            scores["line_up"] = w[:, rows, up[rows]].mean(-1)
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp_min(0).float()   # (T, T) i - j
    scores["distance"] = (w * distance).sum(-1)[:, 1:].mean(-1)
    return scores
