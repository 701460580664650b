"""A GPT: a decoder-only transformer that predicts the next token.

Architecture (the defaults are GPT-2's; each switch is a field of ModelConfig):
  - token embedding + learned absolute position embedding (or rotary, ALiBi, none: `pos`)
  - n_layer pre-norm blocks: x + attn(norm(x)), then x + mlp(norm(x))
  - masked multi-head self-attention, naive or fused, or a variant (`attention`,
    model/attention/)
  - MLP 4x wide with GELU (exact, or GPT-2's tanh approximation; or ReLU²: `mlp`)
  - LayerNorm (or RMSNorm: `norm`)
  - final norm, LM head tied to the token embedding (`tie_embeddings`)
  - GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 n_layer)
    (or zero: `zero_init_proj`), so the residual stream's variance does not grow with
    depth
"""
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import UserError
from model.attention import build_attention
from model.attention.mha import autocast_on
from model.config import ModelConfig
from model.positions import rope_tables

# the dtypes a step runs in, each with its own copy of the rotary tables (by this name)
ROPE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}


class RMSNorm(nn.Module):
    """x / rms(x) * gain: a LayerNorm that does not subtract the mean and has no bias."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd)
    return nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> nonlinearity -> C."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.relu2 = cfg.mlp == "relu2"
        # GPT-2 was trained with tanh
        self.gelu_approx = "tanh" if cfg.mlp == "gelu_tanh" else "none"

    def forward(self, x):
        h = self.up(x)
        if self.relu2:
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate=self.gelu_approx)
        return self.dropout(self.proj(h))


class Block(nn.Module):
    """One pre-norm transformer block: tokens talk (attention), then think (MLP)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = build_attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope=None, cache=None, pos=None, explicit_attention=False):
        x = x + self.attn(self.norm1(x), rope, cache, pos, explicit=explicit_attention)
        x = x + self.mlp(self.norm2(x))
        return x


class InferenceCache:
    """Per-layer attention caches for decoding `batch` sequences of up to block_size
    positions, of fixed shapes: the tokens' positions say where each new key and value
    goes."""

    def __init__(self, model: "GPT", batch: int, device, dtype):
        max_len = model.cfg.block_size
        self.layers = [b.attn.new_cache(batch, max_len, device, dtype)
                       for b in model.blocks]

    def reset(self) -> None:
        """Make the cache hold no position, in place (its tensors keep their
        addresses)."""
        for layer in self.layers:
            layer.reset()


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise UserError("model.vocab_size must be set "
                            "(it is taken from the prepared dataset)")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = None
        if cfg.pos == "learned":
            self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # the rotary tables, cast once to each dtype a step may run in, not at each step
        if cfg.pos == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_base)
            for dtype, name in ROPE_DTYPES.items():
                self.register_buffer(f"rope_cos_{name}", cos.to(dtype), persistent=False)
                self.register_buffer(f"rope_sin_{name}", sin.to(dtype), persistent=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            # the projections that write into the residual stream
            if name.endswith("proj.weight"):
                if cfg.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def rope_rows(self, at, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that `at` picks of the rotary tables (cos, sin), in the dtype of the
        attention's queries and keys: autocast's where it is on, else that of the
        activations (dtype)."""
        device = self.tok_emb.weight.device.type
        if autocast_on(device):
            dtype = torch.get_autocast_dtype(device)
        name = ROPE_DTYPES.get(dtype, "float32")
        tables = (getattr(self, f"rope_{part}_{name}") for part in ("cos", "sin"))
        return tuple(at(table).to(dtype) for table in tables)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embedding (the token
        embedding is counted because, tied, it is also the output layer's weight)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def kv_cache_bytes(self, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the inference cache (all layers) for one sequence of seq_len
        tokens."""
        numbers = sum(block.attn.cache_size(seq_len) for block in self.blocks)
        return numbers * torch.empty((), dtype=dtype).element_size()

    def forward(self, idx, targets=None, cache: InferenceCache | None = None,
                all_logits=False, pos=None, explicit_attention=False):
        """idx (B, T) token ids -> (logits, loss).

        With targets (B, T): logits for every position and the mean cross-entropy (targets
        of -1 are ignored). Without: logits (B, 1, V) of the last position only, which is
        all that sampling needs, unless all_logits. pos (T,): the tokens' positions, a
        tensor (default 0..T-1). With a cache, the tokens' keys and values are stored in it
        at those positions, and each token attends to every cached position up to its own:
        decoding feeds the next token at the next position. explicit_attention: softmax
        attention by its explicit steps, not the fused kernel (the same numbers; what a
        compiled decoding step of one token is faster with).
        """
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than "
                             f"block_size={self.cfg.block_size}")
        if cache is not None and pos is None:
            pos = torch.arange(T, device=idx.device)
        # the rows of a table for these positions
        at = (lambda table: table[:T]) if pos is None else (lambda table: table[pos])
        # (B, T, C)
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + at(self.pos_emb.weight)
        x = self.dropout(x)
        rope = self.rope_rows(at, x.dtype) if self.cfg.pos == "rope" else None
        layers = cache.layers if cache is not None else [None] * len(self.blocks)
        for block, layer_cache in zip(self.blocks, layers):
            x = block(x, rope, layer_cache, pos, explicit_attention)
        x = self.norm_f(x)

        if targets is None:
            return self.lm_head(x if all_logits else x[:, -1:, :]), None
        # (B, T, V)
        logits = self.lm_head(x)
        flat = logits.float().view(-1, logits.size(-1))
        loss = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)
        return logits, loss


@torch.inference_mode()
def score(model, batches, autocast=nullcontext()) -> tuple[float, int]:
    """(total next-token loss in nats, targets scored) of model (a GPT, or one wrapped or
    compiled) over (x, y) batches (moved to its device), targets of -1 being context
    only: the one loss over a text that the trainer's evaluations and eval.py share. In
    eval mode (the model's mode is restored after). The totals stay on the device until
    the end (no wait between batches), then are summed in float64."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    totals, counts = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast:
            # the mean over the scored targets
            _, loss = model(x, y)
        counts.append((y >= 0).sum())
        totals.append(loss.float() * counts[-1])
    model.train(was_training)
    if not totals:
        return 0.0, 0
    total = torch.stack(totals).cpu().double().sum().item()
    return total, int(torch.stack(counts).sum())


def bits_per_byte(loss_nats_per_token: float, tokens: int, nbytes: int) -> float:
    """A mean cross-entropy (nats per token) over `tokens` tokens as bits per byte of the
    `nbytes` bytes of text they encode: comparable across tokenizers, unlike a loss per
    token."""
    if nbytes <= 0:
        raise ValueError(f"bits per byte needs a positive byte count, got {nbytes}")
    return loss_nats_per_token * tokens / nbytes / math.log(2)
