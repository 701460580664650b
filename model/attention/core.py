"""What the softmax attention variants share: the causal mask, the math (explicit and fused), the cache.

Positions: the t_query queries are always the LAST t_query of the t_key positions (they follow any
cached keys), so query i sits at absolute position t_key - t_query + i.
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


def causal_mask(t_query: int, t_key: int, device, window: int = 0) -> torch.Tensor:
    """(t_query, t_key) bool, True where attending is allowed: key j <= query position i, and with a
    window also i - j < window (the query and the window - 1 keys before it)."""
    offset = t_key - t_query
    allowed = torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(diagonal=offset)
    if window:
        allowed = allowed.triu(diagonal=offset - window + 1)
    return allowed


def naive_attention(q, k, v, scale: float, dropout_p: float = 0.0, window: int = 0, slopes=None):
    """The explicit math. q (B, nh, Tq, hs), k (B, nh, Tk, hs), v (B, nh, Tk, hv)
    -> out (B, nh, Tq, hv) and the weights (B, nh, Tq, Tk). slopes: ALiBi's per-head slopes, or None."""
    scores = (q @ k.transpose(-2, -1)) * scale                         # (B, nh, Tq, Tk)
    if slopes is not None:
        scores = scores + alibi_bias(slopes, q.size(2), k.size(2))
    future = ~causal_mask(q.size(2), k.size(2), q.device, window)
    scores = scores.masked_fill(future, float("-inf"))
    weights = F.softmax(scores, dim=-1)                                # rows sum to 1, zero above the diagonal
    out = F.dropout(weights, dropout_p) @ v                            # (B, nh, Tq, hv)
    return out, weights


def sdpa_attention(q, k, v, scale: float, dropout_p: float = 0.0, window: int = 0, slopes=None):
    """The same math through torch's fused kernel; the (T, T) weights are never materialized.
    The plain causal case takes the flash path (is_causal); a window or ALiBi needs an explicit mask."""
    t_query, t_key = q.size(2), k.size(2)
    mask, is_causal = None, False
    if window or slopes is not None:
        allowed = causal_mask(t_query, t_key, q.device, window)
        if slopes is None:
            mask = allowed
        else:   # a float mask is added to the scores: the ALiBi bias, -inf where not allowed
            mask = alibi_bias(slopes, t_query, t_key).to(q.dtype).masked_fill(~allowed, float("-inf"))
    elif t_query == t_key:
        is_causal = True
    elif t_query > 1:   # (a single new token after the cache may see every key: no mask)
        mask = causal_mask(t_query, t_key, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


class KVCache:
    """One layer's keys and values of the positions seen so far, preallocated for max_len of them."""

    def __init__(self, batch: int, n_head: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.len = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the cached ones; return all keys and values so far."""
        end = self.len + k.size(2)
        self.k[:, :, self.len:end] = k
        self.v[:, :, self.len:end] = v
        self.len = end
        return self.k[:, :, :end], self.v[:, :, :end]
