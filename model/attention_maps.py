"""Looking inside a trained GPT: each layer's attention weights for a prompt (attention_maps,
by each variant's own math), and a few numbers per head that name their patterns.

head_scores(weights, texts) gives each head's share of attention on
    previous   the token just before it      first     the prompt's first token
    self       itself                        newline   the newline that began its line
    line_up    the character in the same column one line up (character models only)
and its mean distance Σ_j a_ij (i - j) in tokens, each averaged over the queries from the
second token on.
"""
import torch


@torch.no_grad()
def attention_maps(model, idx: torch.Tensor) -> list[torch.Tensor]:
    """idx (B, T) -> each layer's weights (B, nh, T, T), through forward hooks: the model
    itself runs unchanged."""
    if model.training:
        raise ValueError("attention_maps needs model.eval(): dropout would change what is drawn")
    layers = []

    def ask_for_weights(module, args, kwargs):
        return args, {**kwargs, "return_weights": True}

    def keep_weights(module, args, kwargs, output):
        out, weights = output
        layers.append(weights)
        return out

    attns = [block.attn for block in model.blocks]
    hooks = [a.register_forward_pre_hook(ask_for_weights, with_kwargs=True) for a in attns]
    hooks += [a.register_forward_hook(keep_weights, with_kwargs=True) for a in attns]
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return layers


def newline_positions(texts: list[str]) -> torch.Tensor:
    """(T,) per position, the last earlier one whose token holds a newline, or -1."""
    found, last = [], -1
    for i, text in enumerate(texts):
        found.append(last)
        if "\n" in text:
            last = i
    return torch.tensor(found, dtype=torch.long)


def share_on(w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """w (nh, T, T), targets (T,) a key per query or -1 -> (nh,) the mean weight on the
    targets (the mean of none: NaN)."""
    rows = (targets >= 0).nonzero().squeeze(1)
    return w[:, rows, targets[rows]].mean(-1)


def line_up_positions(texts: list[str]) -> torch.Tensor:
    """(T,) per character, the one in the same column on the line above, or -1."""
    up, line_start, above_start = [], 0, -1
    for i, ch in enumerate(texts):
        j = above_start + (i - line_start)
        # line_start - 1 is the newline
        up.append(j if above_start >= 0 and j < line_start - 1 else -1)
        if ch == "\n":
            above_start, line_start = line_start, i + 1
    return torch.tensor(up, dtype=torch.long)


def head_scores(weights: torch.Tensor, texts: list[str]) -> dict[str, torch.Tensor]:
    """weights (nh, T, T) of one layer -> {score name: (nh,)}, NaN where texts cannot tell."""
    T, w = weights.size(-1), weights.float()
    one_char = all(len(t) == 1 for t in texts)
    up = line_up_positions(texts) if one_char else torch.full((T,), -1)
    # the queries that have a past
    i = torch.arange(1, T)
    scores = {"previous": w[:, i, i - 1].mean(-1), "first": w[:, i, 0].mean(-1),
              "self": w[:, i, i].mean(-1), "newline": share_on(w, newline_positions(texts)),
              "line_up": share_on(w, up)}
    # (T, T) i - j
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp_min(0).float()
    scores["distance"] = (w * distance).sum(-1)[:, 1:].mean(-1)
    return scores
