"""GPT-2 weights in Hugging Face's layout, in and out. GPT2LMHeadModel is model/gpt.py's
network with GPT-2's settings (learned positions, LayerNorm, biases, tied head, tanh GELU).
Only the names differ (tensor_names), and two layouts: c_attn fuses q | k | v, and GPT-2's
"Conv1D" stores a weight as (in, out), nn.Linear's transposed. A setting either side cannot
express is a UserError.
"""
import itertools
import json
import math

import torch

from common import UserError
from model.config import ModelConfig

# GPT-2's activation names (transformers' ACT2FN) -> model.mlp
ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "relu2": "relu2"} | dict.fromkeys(
    ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh"), "gelu_tanh")
EXPORT_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu2": "relu2"}
# GPT-2's defaults for the keys read that a config.json may leave out
HF_DEFAULTS = {"activation_function": "gelu_new", "n_inner": None, "resid_pdrop": 0.1,
               "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
               "tie_word_embeddings": True, "scale_attn_by_inverse_layer_idx": False,
               "add_cross_attention": False}
SIZES = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
# a block's tensors: (ours, stacked along dim 0; theirs; our weight's (out, in) in units of C,
# or None for a norm's (C,))
BLOCK_TENSORS = [
    (["norm1"], "ln_1", None),
    (["attn.query", "attn.key", "attn.value"], "attn.c_attn", (1, 1)),
    (["attn.proj"], "attn.c_proj", (1, 1)),
    (["norm2"], "ln_2", None),
    (["mlp.up"], "mlp.c_fc", (4, 1)),
    (["mlp.proj"], "mlp.c_proj", (1, 4)),
]


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    def refuse(key: str, what: str):
        raise UserError(f"{where}: {key}={json.dumps(hf.get(key))} is not {what}")

    # before the keys: a Llama's config.json has no n_layer
    if hf.get("model_type", "gpt2") != "gpt2":
        refuse("model_type", "supported (only GPT-2 maps onto this GPT)")
    hf = {**HF_DEFAULTS, "n_positions": hf.get("n_ctx"), **hf}
    # JSON's numbers have no declared type
    for key in SIZES + ("resid_pdrop", "layer_norm_epsilon"):
        integer = key in SIZES
        if type(hf.get(key)) not in ((int,) if integer else (int, float)):
            refuse(key, "an integer" if integer else "a number")
    C, activation = hf["n_embd"], hf["activation_function"]
    unknown_activation = not isinstance(activation, str) or activation not in ACTIVATIONS
    # reorder_and_upcast_attn is precision, not math: accepted
    for refused, key, why in [
            (unknown_activation, "activation_function",
             f"this GPT has {', '.join(sorted(ACTIVATIONS))}"),
            (hf["n_inner"] not in (None, 4 * C), "n_inner",
             f"this GPT's MLP is 4 x n_embd = {4 * C} wide"),
            (hf["scale_attn_by_inverse_layer_idx"], "scale_attn_by_inverse_layer_idx",
             "this GPT scales every layer's scores alike"),
            (hf["add_cross_attention"], "add_cross_attention", "this GPT is decoder-only"),
            (not math.isclose(hf["layer_norm_epsilon"], 1e-5, rel_tol=1e-3),
             "layer_norm_epsilon", "this GPT's LayerNorm uses 1e-5")]:
        if refused:
            refuse(key, f"supported ({why})")
    cfg = ModelConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"],
                      n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=C,
                      dropout=float(hf["resid_pdrop"]), bias=True, attention="sdpa",
                      pos="learned", norm="layernorm", mlp=ACTIVATIONS[activation],
                      attn_scale=bool(hf["scale_attn_weights"]),
                      tie_embeddings=bool(hf["tie_word_embeddings"]))
    try:
        cfg.validate()
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return cfg


def tensor_names(cfg: ModelConfig):
    """(our names, GPT-2's name, each of ours' shape, whether a Conv1D weight) per tensor."""
    C, V = cfg.n_embd, cfg.vocab_size
    yield ["tok_emb.weight"], "transformer.wte.weight", (V, C), False
    yield ["pos_emb.weight"], "transformer.wpe.weight", (cfg.block_size, C), False
    blocks = itertools.product(range(cfg.n_layer), BLOCK_TENSORS, ("weight", "bias"))
    for i, (ours, theirs, size), kind in blocks:
        conv = size is not None and kind == "weight"
        shape = (size[0] * C, size[1] * C) if conv else (size[0] * C,) if size else (C,)
        names = [f"blocks.{i}.{o}.{kind}" for o in ours]
        yield names, f"transformer.h.{i}.{theirs}.{kind}", shape, conv
    for kind in ("weight", "bias"):
        yield [f"norm_f.{kind}"], f"transformer.ln_f.{kind}", (C,), False
    if not cfg.tie_embeddings:
        yield ["lm_head.weight"], "lm_head.weight", (V, C), False


def state_dict_from_hf(sd: dict, cfg: ModelConfig, where: str) -> dict:
    """Hugging Face GPT-2 tensors -> this GPT's state dict (fp32), each checked."""
    # OpenAI's first checkpoints lack the "transformer." prefix; causal-mask buffers go
    sd = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
          for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    out = {}
    for ours, theirs, shape, conv in tensor_names(cfg):
        short = theirs.removeprefix("transformer.")
        if theirs not in sd:
            raise UserError(f"{where} lacks the tensor {short}")
        t = sd.pop(theirs)
        # q | k | v: three of ours
        stacked = (len(ours) * shape[0], *shape[1:])
        stacked = stacked[::-1] if conv else stacked
        if tuple(t.shape) != stacked:
            raise UserError(f"{where}: {short} has shape {tuple(t.shape)}, "
                            f"the config says {stacked}")
        t = t.float().t() if conv else t.float()
        out.update((o, part.contiguous()) for o, part in zip(ours, t.split(shape[0])))
    # the head is wte, whatever else was stored
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["tok_emb.weight"]
    if sd:
        names = sorted(k.removeprefix("transformer.") for k in sd)
        more = " ..." if len(names) > 3 else ""
        raise UserError(f"{where} holds tensors a GPT-2 of this config does not have: "
                        f"{', '.join(names[:3])}{more}")
    return out


def to_hf(cfg: ModelConfig, state_dict: dict) -> tuple[dict, dict]:
    """(GPT-2's config.json dict, its tensors) of this GPT's."""
    for key, allowed, why in [
            ("pos", ["learned"], "GPT-2 has learned absolute positions"),
            ("norm", ["layernorm"], "GPT-2 has LayerNorm"),
            ("qk_norm", [False], "GPT-2 does not normalize queries and keys"),
            ("attention", ["naive", "sdpa"],
             "GPT-2 has plain multi-head attention: naive or sdpa")]:
        if getattr(cfg, key) not in allowed:
            raise UserError(f"model.{key}={getattr(cfg, key)!r} does not map onto GPT-2 ({why})")
    sd = {k: v.detach().cpu() for k, v in state_dict.items()}
    dtype, tensors = sd["tok_emb.weight"].dtype, {}
    # model.bias = false: zero biases, the same function
    for ours, theirs, shape, conv in tensor_names(cfg):
        parts = [torch.zeros(shape, dtype=dtype) if o.endswith("bias") and o not in sd
                 else sd[o] for o in ours]
        t = torch.cat(parts)
        # new and contiguous, as safetensors needs
        tensors[theirs] = t.t().contiguous() if conv else t
    # the rest: GPT2Config's defaults
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size,
              "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
              "activation_function": EXPORT_ACTIVATION[cfg.mlp], "resid_pdrop": cfg.dropout,
              "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "layer_norm_epsilon": 1e-5,
              "scale_attn_weights": cfg.attn_scale, "tie_word_embeddings": cfg.tie_embeddings}
    return config, tensors
