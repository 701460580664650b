"""The model's one config dataclass: every architectural choice is a field here."""
from dataclasses import dataclass

from common import UserError, check_fields, setting

# model/attention/__init__.py maps each name to its module
ATTENTIONS = ("naive", "sdpa", "gqa", "sliding_window", "linear", "mla")
POSITIONS, NORMS = ("learned", "rope", "alibi", "none"), ("layernorm", "rmsnorm")
MLPS = ("gelu", "gelu_tanh", "relu2")


@dataclass
class ModelConfig:
    vocab_size: int = setting(0, "0 = the prepared data's", at_least=0)
    block_size: int = setting(64, "longest context the model sees (T)", above=0)
    n_layer: int = setting(4, "transformer blocks", above=0)
    n_head: int = setting(4, "attention heads (head size = n_embd / n_head)", above=0)
    n_embd: int = setting(128, "width of the residual stream (C)", above=0)
    dropout: float = setting(
        0.0, "dropout on embeddings, attention weights and residual branches",
        at_least=0.0, below=1.0)
    bias: bool = setting(True, "biases in Linear layers and LayerNorms")
    attention: str = setting(
        "sdpa", "naive | sdpa | gqa | sliding_window | linear | mla (model/attention/)",
        one_of=ATTENTIONS)
    n_kv_head: int = setting(
        0, "gqa: key/value heads, a divisor of n_head (1 = multi-query)", at_least=0)
    window: int = setting(0, "sliding_window: tokens each token sees, itself included", at_least=0)
    kv_latent_dim: int = setting(
        0, "mla: size of the cached key/value latent per token", at_least=0)
    pos: str = setting(
        "learned", "learned | rope | alibi | none (model/positions.py)", one_of=POSITIONS)
    qk_norm: bool = setting(False, "normalize q and k per head before the scores")
    attn_scale: bool = setting(True, "scale scores by 1/sqrt(head_dim)")
    norm: str = setting("layernorm", "layernorm | rmsnorm", one_of=NORMS)
    mlp: str = setting("gelu", "gelu | gelu_tanh (GPT-2's tanh approximation) | relu2", one_of=MLPS)
    tie_embeddings: bool = setting(True, "LM head shares the token embedding matrix")
    zero_init_proj: bool = setting(False, "residual output projections start at zero")
    rope_base: float = setting(
        10000.0, "rope: the base of its wavelengths (longest ~ 2π·base positions)", above=0.0)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self) -> None:
        """A UserError naming the setting(s) that make this model impossible."""
        check_fields(self, "model")
        if self.n_embd % self.n_head:
            raise UserError(f"model.n_embd={self.n_embd} is not divisible by "
                            f"model.n_head={self.n_head}")
        if self.pos == "rope" and self.head_dim % 2:
            raise UserError(f"model.pos='rope' needs an even head dim, "
                            f"but model.n_embd/model.n_head = {self.head_dim}")
        # each variant's own setting is given for it, and only for it
        own = {"n_kv_head": ("gqa", "1 = multi-query, model.n_head = plain multi-head"),
               "window": ("sliding_window", f"at most model.block_size={self.block_size}"),
               "kv_latent_dim": ("mla", "e.g. model.n_embd / 4")}
        for name, (variant, hint) in own.items():
            value = getattr(self, name)
            if self.attention == variant and value == 0:
                raise UserError(f"model.attention='{variant}' needs model.{name} > 0 ({hint})")
            if self.attention != variant and value != 0:
                raise UserError(f"model.{name}={value} only applies to "
                                f"model.attention='{variant}', "
                                f"not model.attention='{self.attention}'")
        if self.attention == "gqa" and self.n_head % self.n_kv_head:
            raise UserError(f"model.n_head={self.n_head} is not a multiple of "
                            f"model.n_kv_head={self.n_kv_head}")
        if self.attention == "sliding_window" and self.window > self.block_size:
            raise UserError(f"model.window={self.window} is larger than "
                            f"model.block_size={self.block_size}")
        if self.attention == "linear" and self.pos == "alibi":
            raise UserError("model.pos='alibi' biases attention scores, which "
                            "model.attention='linear' never forms (use rope, learned or none)")
