"""What the softmax attention variants share: the causal mask, the math (explicit and fused), the cache.

Positions: without a cache, the t_query queries are the LAST t_query of t_key consecutive
positions, so query i sits at position t_key - t_query + i. With a cache, the caller passes the
positions of the queries and of the cache's slots (q_pos, k_pos): a slot not yet written holds a
position in the future and is masked like one.
"""
import torch
import torch.nn.functional as F

from model.positions import alibi_bias


def split_heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, n_head * hs) -> (B, n_head, T, hs): each head attends on its own slice of the features."""
    B, T, C = t.shape
    return t.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hs) -> (B, T, nh * hs): the heads' outputs side by side (concatenated)."""
    B, nh, T, hs = t.shape
    return t.transpose(1, 2).contiguous().view(B, T, nh * hs)


def consecutive_positions(t_query: int, t_key: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of t_query queries that follow t_key - t_query earlier keys, and of the t_key keys."""
    return torch.arange(t_key - t_query, t_key, device=device), torch.arange(t_key, device=device)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """(Tq, Tk) bool, True where attending is allowed: the key's position <= the query's, and with a
    window also query - key < window (the query and the window - 1 positions before it)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    return allowed


def naive_attention(q, k, v, scale: float, dropout_p: float = 0.0, window: int = 0, slopes=None,
                    q_pos=None, k_pos=None):
    """The explicit math. q (B, nh, Tq, hs), k (B, nh, Tk, hs), v (B, nh, Tk, hv)
    -> out (B, nh, Tq, hv) and the weights (B, nh, Tq, Tk). slopes: ALiBi's per-head slopes, or None.
    q_pos (Tq,), k_pos (Tk,): the positions of queries and keys (default: consecutive)."""
    if q_pos is None:
        q_pos, k_pos = consecutive_positions(q.size(2), k.size(2), q.device)
    scores = (q @ k.transpose(-2, -1)) * scale                         # (B, nh, Tq, Tk)
    if slopes is not None:
        scores = scores + alibi_bias(slopes, q_pos, k_pos)
    future = ~causal_mask(q_pos, k_pos, window)
    scores = scores.masked_fill(future, float("-inf"))
    weights = F.softmax(scores, dim=-1)                                # rows sum to 1, zero above the diagonal
    out = F.dropout(weights, dropout_p) @ v                            # (B, nh, Tq, hv)
    return out, weights


def sdpa_attention(q, k, v, scale: float, dropout_p: float = 0.0, window: int = 0, slopes=None,
                   q_pos=None, k_pos=None):
    """The same math through torch's fused kernel; the (T, T) weights are never materialized.
    The plain causal case takes the flash path (is_causal); a window, ALiBi or a cache's positions
    need an explicit mask."""
    t_query, t_key = q.size(2), k.size(2)
    if t_query == 1 and q_pos is not None and torch.compiler.is_compiling():
        # a compiled decoding step: the fused kernels are made for many queries, while a compiler
        # fuses the explicit math for one query into a few kernels of its own
        return naive_attention(q, k, v, scale, dropout_p, window, slopes, q_pos, k_pos)[0]
    mask, is_causal = None, False
    if q_pos is None and not window and slopes is None and t_query == t_key:
        is_causal = True
    else:
        if q_pos is None:
            q_pos, k_pos = consecutive_positions(t_query, t_key, q.device)
        allowed = causal_mask(q_pos, k_pos, window)
        if slopes is None:
            mask = allowed
        else:   # a float mask is added to the scores: the ALiBi bias, -inf where not allowed
            mask = alibi_bias(slopes, q_pos, k_pos).to(q.dtype).masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


class KVCache:
    """One layer's keys and values, preallocated for max_len positions: slot j holds position j.

    Its shapes never change, so one compiled decoding step serves every position; the slots not yet
    written hold positions after the query's and are masked like any future key."""

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.k_pos = torch.arange(max_len, device=device)              # the position in each slot

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, nh, T, hs) of the positions pos (T,) into their slots; return every slot's
        keys and values (B, nh, max_len, hs) and positions (max_len,)."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))
        return self.k, self.v, self.k_pos

    def reset(self) -> None:
        """Start again from position 0. Nothing to clear: a stale slot holds a position after the new
        tokens' and is overwritten before any query reaches it."""
