"""How the model knows where a token is (`model.pos`).

Attention by itself is blind to order: permute the keys and values together and every
output stays the same. Four ways to give it order:

  learned  a trained vector per absolute position added to the token embedding (GPT-2).
           Costs block_size x C parameters and cannot go past block_size.
  rope     rotary embedding (Su et al., 2021, "RoFormer"): rotate pairs of channels of q
           and k by an angle proportional to the position, so q·k depends only on the
           distance i - j.
  alibi    attention with linear biases (Press et al., 2022, "Train Short, Test Long"):
           no embedding at all; each head adds -slope * (i - j) to its scores, a penalty
           growing with distance.
  none     nothing: a causal decoder can still infer positions from the mask (Haviv et
           al., 2022).

`learned` lives in model/gpt.py (an nn.Embedding); the functions here implement rope and
alibi.
"""
import math

import torch


def rope_tables(head_dim: int, max_len: int, base: float):
    """The cos and sin tables (max_len, head_dim) that apply_rotary_emb reads: channel i
    and channel i + head_dim/2 turn together by the angle t / base^(2i / head_dim) at
    position t. Each table holds its values for both channels of a pair, the sin's negated
    for the first, so that a rotation is two products and a sum."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return angles.cos().repeat(1, 2), torch.cat([-angles.sin(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels (i in the first half, i + hs/2 in the second) of
    x (B, nh, T, hs) by position-dependent angles (cos, sin: (T, hs), rope_tables' rows,
    in x's dtype; for x laid out (B, T, nh, hs), (T, 1, hs)), so that q·k depends only on
    the distance between the positions:

        (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
                  = x cos + (x with its halves swapped) sin

    three kernels: the swap, a product, a product added."""
    return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """(n_head,) the geometric sequence of ALiBi slopes: 2^(-8/n), 2^(-16/n), ..., 2^(-8)
    for n a power of two. Otherwise the paper's recipe: the slopes of the power of two just
    below n, then every other slope of the next power of two. Steep heads look locally,
    shallow ones far."""
    def powers(n):
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    below = 2 ** math.floor(math.log2(n_head))
    slopes = powers(below) + powers(2 * below)[0::2][:n_head - below]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """(nh, Tq, Tk) additive score bias -slope * (i - j) for queries at positions
    q_pos (Tq,) and keys at k_pos (Tk,); entries where the key is in the future are masked
    out anyway."""
    # (Tq, Tk), >= 0 where visible
    distance = (q_pos[:, None] - k_pos[None, :]).to(slopes.dtype)
    return -slopes[:, None, None] * distance
