"""The model's one config dataclass: every architectural choice is a field here."""
from dataclasses import dataclass


@dataclass
class ModelConfig:
    vocab_size: int = 0          # 0 = taken from the prepared dataset
    block_size: int = 64         # longest context the model sees (T)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True            # biases in Linear layers and LayerNorms
    attention: str = "sdpa"      # naive | sdpa
    pos: str = "learned"         # learned | rope | none
    qk_norm: bool = False        # normalize q and k per head before the scores
    attn_scale: bool = True      # scale scores by 1/sqrt(head_dim)
    norm: str = "layernorm"      # layernorm | rmsnorm
    mlp: str = "gelu"            # gelu | relu2
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    zero_init_proj: bool = False  # residual output projections start at zero
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self) -> None:
        """Raise ValueError naming the setting(s) that make this config impossible."""
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size must be >= 0, got {self.vocab_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        choices = {"attention": ("naive", "sdpa"), "pos": ("learned", "rope", "none"),
                   "norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "relu2")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"model.pos='rope' needs an even head dim, but model.n_embd/model.n_head = {self.head_dim}")
