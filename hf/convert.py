"""GPT-2 weights in Hugging Face's layout: read them into this repo's GPT, write ours out.

Hugging Face's GPT2LMHeadModel is the network of model/gpt.py with GPT-2's settings (learned
positions, LayerNorm, biases, tied head, GELU in its tanh form); only the names and two layouts differ.
Per block i, with C = n_embd, V = vocab_size, T = block_size (GPT-2's n_positions):

    ours (model/gpt.py)                 shape     Hugging Face ("transformer." prefix)   shape
    tok_emb.weight                      (V, C)    wte.weight                             (V, C)
    pos_emb.weight                      (T, C)    wpe.weight                             (T, C)
    blocks.i.norm1.{weight,bias}        (C,)      h.i.ln_1.{weight,bias}                 (C,)
    blocks.i.attn.{query,key,value}     (C, C)    h.i.attn.c_attn.weight                 (C, 3C)  q | k | v
    blocks.i.attn.proj.weight           (C, C)    h.i.attn.c_proj.weight                 (C, C)
    blocks.i.norm2.{weight,bias}        (C,)      h.i.ln_2.{weight,bias}                 (C,)
    blocks.i.mlp.up.weight              (4C, C)   h.i.mlp.c_fc.weight                    (C, 4C)
    blocks.i.mlp.proj.weight            (C, 4C)   h.i.mlp.c_proj.weight                  (4C, C)
    norm_f.{weight,bias}                (C,)      ln_f.{weight,bias}                     (C,)
    lm_head.weight                      (V, C)    lm_head.weight (only when untied; tied, it is wte)

GPT-2's linear layers are "Conv1D" modules that store their weight as (in, out), the transpose of
nn.Linear's (out, in); the query, key and value projections are one fused matrix `c_attn`, whose
output columns are q, then k, then v. Biases keep their shape (c_attn's is split into three).

Choices:
  - files: config.json and model.safetensors (or the shards that model.safetensors.index.json names);
    never pytorch_model.bin, a pickle that can run code when loaded
  - import: the "transformer." prefix is optional (the original OpenAI checkpoints lack it); the
    attn.bias / attn.masked_bias buffers of old checkpoints (the causal mask) are ignored; weights
    stored as fp16/bf16 become fp32; activations map as ACTIVATIONS and EXPORT_ACTIVATION say
  - export: model.bias = false -> zero biases (GPT-2 always has them: the same function); vocab_size
    as it is, also when padded (e.g. 50304 = 50257 rounded up): the extra rows are tokens the
    tokenizer never produces, never targets, so training has pushed their logits down
  - a setting GPT-2 cannot express (rotary positions, RMSNorm, another attention, ...) is a
    CheckpointError that names it; so is an HF config that this GPT cannot express

Files, hub names and downloads: hf/hub.py.
"""
import math

import torch

from common import CheckpointError, ConfigError, type_problem
from model.config import ModelConfig

# GPT-2's activation names (transformers' ACT2FN) -> model.mlp
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu_python_tanh": "gelu_tanh", "gelu": "gelu", "gelu_python": "gelu", "relu2": "relu2"}
EXPORT_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu2": "relu2"}
# The config.json keys read, their types, and GPT-2's defaults for those a config may leave out
HF_TYPES = {"vocab_size": int, "n_positions": int, "n_layer": int, "n_head": int, "n_embd": int,
            "resid_pdrop": float, "layer_norm_epsilon": float, "scale_attn_weights": bool,
            "tie_word_embeddings": bool, "scale_attn_by_inverse_layer_idx": bool, "add_cross_attention": bool}
HF_DEFAULTS = {"activation_function": "gelu_new", "n_inner": None, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
               "scale_attn_weights": True, "tie_word_embeddings": True, "scale_attn_by_inverse_layer_idx": False,
               "add_cross_attention": False}
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")   # old checkpoints' causal-mask buffers
# A block's tensors besides q, k, v: (ours, theirs, a Conv1D weight's (in, out) in units of C; None: a norm's (C,))
BLOCK_TENSORS = [("norm1", "ln_1", None), ("attn.proj", "attn.c_proj", (1, 1)), ("norm2", "ln_2", None),
                 ("mlp.up", "mlp.c_fc", (1, 4)), ("mlp.proj", "mlp.c_proj", (4, 1))]


# ----------------------------------------------------------------------------- configs

def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A GPT-2 config.json (as a dict) -> ModelConfig; a CheckpointError names what does not map."""
    def refuse(setting: str, why: str):
        raise CheckpointError(f"{where}: {setting} is not supported ({why})")

    if hf.get("model_type", "gpt2") != "gpt2":
        refuse(f"model_type={hf['model_type']!r}", "only GPT-2 checkpoints map onto this repo's GPT")
    hf = {**HF_DEFAULTS, "n_positions": hf.get("n_ctx"), **hf}
    problem = type_problem(hf, HF_TYPES)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    n_embd, activation, eps = hf["n_embd"], hf["activation_function"], hf["layer_norm_epsilon"]
    if activation not in ACTIVATIONS:
        refuse(f"activation_function={activation!r}", f"this GPT has {', '.join(sorted(ACTIVATIONS))}")
    if hf["n_inner"] not in (None, 4 * n_embd):
        refuse(f"n_inner={hf['n_inner']}", f"this GPT's MLP is 4 x n_embd = {4 * n_embd} wide")
    if hf["scale_attn_by_inverse_layer_idx"]:
        refuse("scale_attn_by_inverse_layer_idx=true", "this GPT scales every layer's scores alike")
    if hf["add_cross_attention"]:
        refuse("add_cross_attention=true", "this GPT is decoder-only")
    if not math.isclose(eps, 1e-5, rel_tol=1e-3):
        refuse(f"layer_norm_epsilon={eps}", "this GPT's LayerNorm uses 1e-5")
    # reorder_and_upcast_attn only changes the precision of the scores under autocast, not the math: accepted
    cfg = ModelConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                      n_head=hf["n_head"], n_embd=n_embd, dropout=float(hf["resid_pdrop"]), bias=True,
                      attention="sdpa", pos="learned", norm="layernorm", mlp=ACTIVATIONS[activation],
                      attn_scale=hf["scale_attn_weights"], tie_embeddings=hf["tie_word_embeddings"])
    try:
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return cfg


def check_exportable(cfg: ModelConfig) -> None:
    """A CheckpointError naming the first setting that GPT-2's architecture cannot express."""
    unmappable = [("pos", "learned", "GPT-2 has learned absolute positions"),
                  ("norm", "layernorm", "GPT-2 has LayerNorm"),
                  ("qk_norm", False, "GPT-2 does not normalize queries and keys")]
    for name, wanted, why in unmappable:
        if getattr(cfg, name) != wanted:
            raise CheckpointError(f"model.{name}={getattr(cfg, name)!r} does not map onto GPT-2 ({why})")
    if cfg.attention not in ("naive", "sdpa"):
        raise CheckpointError(f"model.attention={cfg.attention!r} does not map onto GPT-2 "
                              f"(GPT-2 has plain multi-head attention: naive or sdpa)")


def hf_config(cfg: ModelConfig, eos_token_id: int | None = None) -> dict:
    """ModelConfig -> a GPT-2 config.json dict (check_exportable first)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size,
            "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
            "activation_function": EXPORT_ACTIVATION[cfg.mlp],
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "scale_attn_weights": cfg.attn_scale, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": eos_token_id, "eos_token_id": eos_token_id}


# ----------------------------------------------------------------------------- weights

def state_dict_from_hf(sd: dict, cfg: ModelConfig, where: str = "model.safetensors") -> dict:
    """Hugging Face GPT-2 tensors -> this GPT's state dict (fp32); a missing, misshapen or
    unexpected tensor is a CheckpointError naming it."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items() if not k.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)   # tied: the head is wte, whatever else was stored
    C = cfg.n_embd

    def take(key: str, shape: tuple) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"{where} lacks the tensor {key}")
        t = sd.pop(key)
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: {key} has shape {tuple(t.shape)}, the config says {shape}")
        return t.float()

    out = {"tok_emb.weight": take("wte.weight", (cfg.vocab_size, C)),
           "pos_emb.weight": take("wpe.weight", (cfg.block_size, C))}
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        qkv_w = take(h + "attn.c_attn.weight", (C, 3 * C)).t()                 # (3C, C): rows q | k | v
        qkv_b = take(h + "attn.c_attn.bias", (3 * C,))
        for name, w, bias in zip(("query", "key", "value"), qkv_w.split(C), qkv_b.split(C)):
            out[f"{b}attn.{name}.weight"], out[f"{b}attn.{name}.bias"] = w.contiguous(), bias.clone()
        for ours, theirs, conv in BLOCK_TENSORS:
            shape = (conv[0] * C, conv[1] * C) if conv else (C,)
            weight = take(h + theirs + ".weight", shape)
            out[b + ours + ".weight"] = weight.t().contiguous() if conv else weight
            out[b + ours + ".bias"] = take(h + theirs + ".bias", shape[-1:])
    out["norm_f.weight"], out["norm_f.bias"] = take("ln_f.weight", (C,)), take("ln_f.bias", (C,))
    out["lm_head.weight"] = (out["tok_emb.weight"] if cfg.tie_embeddings
                             else take("lm_head.weight", (cfg.vocab_size, C)))
    if sd:
        names = sorted(sd)
        raise CheckpointError(f"{where} holds tensors a GPT-2 of this config does not have: "
                              f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
    return out


def to_hf(cfg: ModelConfig, state_dict: dict, eos_token_id: int | None = None) -> tuple[dict, dict]:
    """This GPT's config and state dict -> (GPT-2 config.json dict, GPT-2 tensors, "transformer."
    names as transformers writes them). Tensors are new and contiguous (safetensors needs both)."""
    check_exportable(cfg)
    C = cfg.n_embd
    sd = {k: v.detach().cpu() for k, v in state_dict.items()}

    def bias(key: str, size: int) -> torch.Tensor:   # model.bias = false: zeros compute the same function
        return sd[key].clone() if key in sd else torch.zeros(size, dtype=sd["tok_emb.weight"].dtype)

    out = {"wte.weight": sd["tok_emb.weight"].clone(), "wpe.weight": sd["pos_emb.weight"].clone()}
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        qkv = [sd[f"{b}attn.{name}.weight"] for name in ("query", "key", "value")]   # 3 x (C, C)
        out[h + "attn.c_attn.weight"] = torch.cat(qkv).t().contiguous()               # (C, 3C)
        out[h + "attn.c_attn.bias"] = torch.cat([bias(f"{b}attn.{n}.bias", C) for n in ("query", "key", "value")])
        for ours, theirs, conv in BLOCK_TENSORS:
            weight = sd[b + ours + ".weight"]
            out[h + theirs + ".weight"] = weight.t().contiguous() if conv else weight.clone()
            out[h + theirs + ".bias"] = bias(b + ours + ".bias", weight.size(0))
    out["ln_f.weight"], out["ln_f.bias"] = sd["norm_f.weight"].clone(), bias("norm_f.bias", C)
    out = {"transformer." + k: v for k, v in out.items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"].clone()
    return hf_config(cfg, eos_token_id), out
