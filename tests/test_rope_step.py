"""The fast recipe's rotary positions and QK-norm: the rotation is RoFormer's, pair by pair, and a
low-precision step keeps its queries and keys in its own dtype, reading rotary tables cast once."""
import math

import torch
from torch.profiler import ProfilerActivity, profile

import model.attention.mha as mha
from model.config import ModelConfig
from model.gpt import GPT
from model.positions import apply_rotary_emb, rope_tables


def test_the_rotation_turns_each_pair_of_channels_by_its_angle():
    """Channel i and channel i + hs/2 turn as one complex number by t / base^(2i / hs) at
    position t: the rotation that the models trained before were trained with."""
    T, hs, base = 7, 8, 100.0
    x = torch.randn(2, 3, T, hs, dtype=torch.float64)
    got = apply_rotary_emb(x, *(table.double() for table in rope_tables(hs, T, base)))
    for t in range(T):
        for i in range(hs // 2):
            angle = t / base ** (2 * i / hs)
            turned = torch.complex(x[..., t, i], x[..., t, i + hs // 2]) * complex(math.cos(angle),
                                                                                   math.sin(angle))
            torch.testing.assert_close(got[..., t, i], turned.real, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[..., t, i + hs // 2], turned.imag, rtol=1e-6, atol=1e-6)


def test_a_bf16_step_keeps_queries_and_keys_in_bf16_and_casts_no_rotary_table(monkeypatch):
    """Under bf16 autocast the queries and keys reach the attention in bf16 (QK-norm and rotation
    run in it), and no rotary table is cast: each dtype's tables were cast once, with the model."""
    T, hs = 16, 16
    model = GPT(ModelConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32, block_size=T, pos="rope",
                            qk_norm=True))
    seen, real = [], mha.sdpa_attention
    monkeypatch.setattr(mha, "sdpa_attention", lambda q, k, v, *a: seen.append((q.dtype, k.dtype))
                        or real(q, k, v, *a))
    idx = torch.randint(0, 50, (2, T))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, idx)[1].backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    casts = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy"]
    assert [T, hs] not in casts and [T, hs // 2] not in casts, "a table's rows cast in the step"
