"""Attention variants x position encodings: causal, equal to plain attention where they should be
(naive and sdpa in gradients too), the same logits with or without the cache, and the configs that
cannot work are refused; the residual projections' scaled init; the rotation is RoFormer's, pair
by pair, and a low-precision step keeps its queries and keys in its own dtype, reading rotary
tables cast once."""
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import model.attention.mha as mha
from common import UserError
from loading import load_model
from model.attention.linear import causal_linear_attention
from model.attention.mha import Settings, naive_attention, sdpa_attention
from model.config import ModelConfig
from model.gpt import GPT, InferenceCache
from model.positions import alibi_slopes, apply_rotary_emb, rope_tables
from model.sampling import Choice, Decoding, generate, sample_next
from tests.conftest import OWN, records
from training.config import build_config

POSITIONS = ["learned", "rope", "alibi", "none"]
COMBOS = [(a, p) for a in OWN for p in POSITIONS if (a, p) != ("linear", "alibi")]


def make_model(attention="sdpa", pos="learned", **kw):
    torch.manual_seed(0)
    settings = {"vocab_size": 40, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32,
                "attention": attention, "pos": pos, **OWN[attention], **kw}
    model = GPT(ModelConfig(**settings)).eval()
    for block in model.blocks:
        if attention == "linear":
            block.attn.chunk = 4   # several chunks in a block of 16: the state carried between them
    return model


def tokens(b=2, t=16, seed=1):
    return torch.randint(0, 40, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention, pos", COMBOS)
def test_changing_a_token_never_changes_earlier_outputs(attention, pos):
    model = make_model(attention, pos, qk_norm=(pos == "none"))
    idx = tokens()
    base, _ = model(idx, all_logits=True)
    for j in (0, 7, 15):
        changed = idx.clone()
        changed[:, j] = (changed[:, j] + 1) % 40
        out, _ = model(changed, all_logits=True)
        if attention == "linear":   # batched chunk matmuls round differently (1e-8); a leak is ~1e-3
            torch.testing.assert_close(out[:, :j], base[:, :j], atol=1e-6, rtol=0,
                                       msg=f"position < {j} saw token {j}")
        else:
            assert torch.equal(out[:, :j], base[:, :j]), f"position < {j} saw token {j}"
        assert not torch.allclose(out[:, j], base[:, j]), "the changed token itself must matter"


def test_sliding_window_sees_only_its_window_per_layer():
    model = make_model("sliding_window", window=3)            # 2 layers: position i sees i-4 .. i
    idx = tokens()
    changed = idx.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 40
    a, _ = model(idx, all_logits=True)
    b, _ = model(changed, all_logits=True)
    assert not torch.allclose(a[:, 6], b[:, 6]), "token 2 is 4 positions back: reached in two layers"
    assert torch.equal(a[:, 7:], b[:, 7:]), "token 2 is out of reach from position 7 on"


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("t_query", [8, 3, 1])
def test_naive_and_sdpa_math_agree_with_windows_alibi_and_cached_keys(window, alibi, t_query):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, t_query, 8, generator=g)
    k, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    slopes = alibi_slopes(4) if alibi else None
    settings = Settings(scale=0.3, window=window, slopes=slopes)
    expected, weights = naive_attention(q, k, v, settings)
    fused = sdpa_attention(q, k, v, settings)
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=0)
    visible = (weights > 0).sum(-1)
    assert visible.max() <= (window or 8) and visible[..., -1].min() == min(8, window or 8)


@pytest.mark.parametrize("pos", POSITIONS)
def test_naive_and_sdpa_agree_in_outputs_and_gradients(pos):
    naive, sdpa = make_model("naive", pos), make_model("sdpa", pos)
    sdpa.load_state_dict(naive.state_dict())
    idx, targets = tokens(b=4, seed=2), tokens(b=4, seed=3)
    out_n, loss_n = naive(idx, targets)
    out_s, loss_s = sdpa(idx, targets)
    torch.testing.assert_close(out_s, out_n, atol=1e-5, rtol=0)
    loss_n.backward()
    loss_s.backward()
    for (name, p_n), p_s in zip(naive.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p_s.grad, p_n.grad, atol=1e-5, rtol=0, msg=f"gradient of {name}")


def test_residual_projections_get_the_scaled_init():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50, n_layer=8, n_embd=256, n_head=4))
    std = model.blocks[0].attn.proj.weight.std().item()
    assert abs(std - 0.02 / (2 * 8) ** 0.5) < 0.001
    assert abs(model.blocks[0].attn.query.weight.std().item() - 0.02) < 0.002
    assert model.lm_head.weight is model.tok_emb.weight


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


def test_alibi_slopes_are_the_papers():
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0 ** -i for i in (2, 4, 6, 8)] + [2.0 ** -1, 2.0 ** -3]


@pytest.mark.parametrize("pos", ["learned", "rope", "alibi"])
@pytest.mark.parametrize("variant, settings", [("gqa", {"n_kv_head": 4}),   # as many kv heads as heads
                                               ("sliding_window", {"window": 16})])   # as long as the block
def test_a_variant_at_its_limit_is_plain_multi_head_attention(pos, variant, settings):
    plain = make_model("sdpa", pos)
    other = make_model(variant, pos, **settings)
    other.load_state_dict(plain.state_dict())
    idx = tokens()
    torch.testing.assert_close(other(idx, all_logits=True)[0], plain(idx, all_logits=True)[0],
                               atol=1e-6, rtol=0)


def test_gqa_is_multi_head_with_each_kv_head_shared_by_its_group():
    gqa = make_model("gqa", n_kv_head=2)                       # heads 0, 1 share kv head 0; 2, 3 kv head 1
    plain = make_model("sdpa")
    state = gqa.state_dict()
    for name, p in list(state.items()):
        if ".attn.key." in name or ".attn.value." in name:    # (2 hs, ...) -> (4 hs, ...), each head twice
            state[name] = p.view(2, 8, *p.shape[1:]).repeat_interleave(2, dim=0).reshape(32, *p.shape[1:])
    plain.load_state_dict(state)
    idx = tokens()
    torch.testing.assert_close(gqa(idx, all_logits=True)[0], plain(idx, all_logits=True)[0],
                               atol=1e-6, rtol=0)


def recurrent_linear_attention(q, k, v, state=None):
    """The same sums one token at a time, as an RNN: S += k_t v_tᵀ; out_t = q_t S."""
    B, nh, T, dk = q.shape
    S = state if state is not None else q.new_zeros(B, nh, dk, v.size(-1))
    outs = []
    for t in range(T):
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]     # (B, nh, dk, dv)
        outs.append((q[:, :, t, None, :] @ S).squeeze(2))     # (B, nh, dv)
    return torch.stack(outs, dim=2), S


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_linear_attention_chunked_form_equals_its_recurrent_form(chunk):
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(2, 3, 10, 4, generator=g), torch.rand(2, 3, 10, 4, generator=g)
    v, state = torch.randn(2, 3, 10, 5, generator=g), torch.randn(2, 3, 4, 5, generator=g)
    for start in (None, state):
        out_c, state_c = causal_linear_attention(q, k, v, start, chunk=chunk)
        out_r, state_r = recurrent_linear_attention(q, k, v, start)
        torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=0)
        torch.testing.assert_close(state_c, state_r, atol=1e-5, rtol=0)
    explicit = torch.stack([sum((q[:, :, i] * k[:, :, j]).sum(-1, keepdim=True) * v[:, :, j]
                                for j in range(i + 1)) for i in range(10)], dim=2)
    torch.testing.assert_close(recurrent_linear_attention(q, k, v)[0], explicit, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention, pos", COMBOS)
def test_incremental_decoding_matches_recomputing_the_prefix(attention, pos):
    model = make_model(attention, pos, qk_norm=(pos == "none"))
    idx = tokens(b=3)
    full, _ = model(idx, all_logits=True)
    cache = InferenceCache(model, 3, "cpu", torch.float32)
    parts = [model(idx[:, :7], cache=cache, all_logits=True)[0],      # prefill longer than the window
             model(idx[:, 7:9], cache=cache, all_logits=True, pos=torch.arange(7, 9))[0]]   # a chunk after it
    parts += [model(idx[:, t:t + 1], cache=cache, pos=torch.tensor([t]))[0] for t in range(9, 16)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def recomputed_logits(model, seq, prompt_len):
    """(n, B, V): for each new token of seq (B, prompt_len + n), the logits recomputed from scratch
    on the context the cache holds when generate() chooses it: the prompt's last block_size tokens,
    then one more per token; when the cache is full, the last half block (positions from 0 again)."""
    block, filled, out = model.cfg.block_size, 0, []
    for end in range(prompt_len, seq.size(1)):
        filled = min(end, block if filled == 0 else block // 2) if filled in (0, block) else filled + 1
        out.append(model(seq[:, end - filled:end])[0][:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("attention, pos, window",
                         [(a, p, {}) for a, p in COMBOS] + [("sliding_window", "rope", {"window": 12})])
def test_decoding_with_the_cache_is_recomputation_across_slides(attention, pos, window, monkeypatch):
    # block 16: the cache is full and restarts from 8 tokens twice; a window of 12 > 8 also checks
    # that a restart forgets the ring's stale slots
    model = make_model(attention, pos, **window)
    seen = []

    def recording(logits, *args, **kw):    # the logits the sampler is given, token by token
        seen.append(logits.clone())
        return sample_next(logits, *args, **kw)
    monkeypatch.setattr("model.sampling.sample_next", recording)
    prompt = tokens(b=2, t=3)
    new = torch.cat(list(generate(model, prompt, 30, generator=torch.Generator().manual_seed(0))), dim=1)
    expected = recomputed_logits(model, torch.cat([prompt, new], dim=1), prompt.size(1))
    torch.testing.assert_close(torch.stack(seen), expected, atol=1e-5, rtol=0)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the step replays a CUDA graph")


@CUDA
@pytest.mark.parametrize("attention, pos", [("sdpa", "learned"), ("gqa", "rope"),
                                            ("sliding_window", "alibi"), ("linear", "rope"),
                                            ("mla", "rope"), ("naive", "none")])
def test_the_compiled_decoding_step_chooses_what_recomputation_does(attention, pos, capsys):
    """generate() with speed/decoding.py's compiled step replayed as a CUDA graph, greedy through
    slides of the cache: each token is the best by recomputing its context (up to rounding). (On a
    CPU, compiled decoding gives the eager code's tokens: tests/test_decoding.py.)"""
    from speed.decoding import compiled
    torch._dynamo.reset()   # each variant compiles its own graphs: forget the others' (8 at most)
    model = make_model(attention, pos).cuda()
    prompt = tokens(b=2, t=3).cuda()
    new = torch.cat(list(generate(model, prompt, 30, Choice(temperature=0),
                                  decoding=Decoding(speed_up=compiled))), dim=1)   # (B, n)
    assert "warning" not in capsys.readouterr().err, "compiling or recording the CUDA graph failed"
    expected = recomputed_logits(model, torch.cat([prompt, new], dim=1), 3)                  # (n, B, V)
    chosen = expected.gather(-1, new.T.unsqueeze(-1)).squeeze(-1)
    assert (chosen >= expected.max(dim=-1).values - 1e-4).all()


@pytest.mark.parametrize("attention", list(OWN))
def test_cache_size_is_what_the_cache_holds(attention):
    model = make_model(attention, "rope")
    cache = InferenceCache(model, 1, "cpu", torch.float32)
    model(tokens(b=1), cache=cache)
    for block, layer_cache in zip(model.blocks, cache.layers):
        # keys, values, latents, states: not positions
        held = sum(t.numel() for t in vars(layer_cache).values()
                   if isinstance(t, torch.Tensor) and t.is_floating_point())
        assert held == block.attn.cache_size(16)
    per_layer = {"naive": 2 * 32 * 16, "sdpa": 2 * 32 * 16, "gqa": 2 * 16 * 16, "sliding_window": 2 * 32 * 5,
                 "linear": 4 * (8 * 8 + 8), "mla": (12 + 8) * 16}[attention]
    assert model.kv_cache_bytes(16) == 2 * per_layer * 4
    assert model.kv_cache_bytes(16, torch.bfloat16) == 2 * per_layer * 2


@pytest.mark.parametrize("overrides, message", [
    ({"model.attention": "gqa", "model.n_kv_head": 3},
     "model.n_head=4 is not a multiple of model.n_kv_head=3"),
    ({"model.attention": "gqa"}, "model.attention='gqa' needs model.n_kv_head > 0"),
    ({"model.n_kv_head": 2},
     "model.n_kv_head=2 only applies to model.attention='gqa', not model.attention='sdpa'"),
    ({"model.attention": "sliding_window", "model.window": 65},
     "model.window=65 is larger than model.block_size=64"),
    ({"model.attention": "sliding_window"}, "model.attention='sliding_window' needs model.window > 0"),
    ({"model.attention": "mla"}, "model.attention='mla' needs model.kv_latent_dim > 0"),
    ({"model.attention": "mla", "model.kv_latent_dim": 8, "model.window": 8},
     "model.window=8 only applies to model.attention='sliding_window', not model.attention='mla'"),
    ({"model.attention": "linear", "model.pos": "alibi"}, "model.pos='alibi' .* model.attention='linear'"),
    ({"model.attention": "flash"}, "model.attention='flash' is not one of naive, sdpa, gqa"),
    ({"model.pos": "sinusoidal"}, "model.pos='sinusoidal' is not one of learned, rope, alibi, none"),
    ({"model.attention": "gqa", "model.n_kv_head": -1}, "model.n_kv_head must be >= 0"),
])
def test_impossible_combinations_are_config_errors_naming_both_settings(overrides, message):
    with pytest.raises(UserError, match=message):
        build_config(None, [f"--{k}={v}" for k, v in overrides.items()])


@pytest.mark.parametrize("attention, pos", [("naive", "alibi"), ("gqa", "rope"), ("sliding_window", "alibi"),
                                            ("linear", "rope"), ("mla", "rope"), ("mla", "learned")])
def test_every_variant_trains_and_samples(tiny_cfg, attention, pos):
    from training.trainer import train
    own = {f"model.{k}": v for k, v in OWN[attention].items()}
    cfg = tiny_cfg(**{"model.attention": attention, "model.pos": pos, "model.block_size": 16, **own,
                      "train.max_steps": 12, "train.eval_interval": 12, "train.lr": 1e-2,
                      "train.log_interval": 1})
    train(cfg, quiet=True)
    losses = records(cfg.out_dir)
    assert losses[12] < losses[1] - 0.5, losses
    model = load_model(cfg.out_dir).model
    prompt = tokens(b=2, t=3) % cfg.model.vocab_size
    cached = torch.cat(list(generate(model, prompt, 40, Choice(temperature=0))), dim=1)   # slides past the block
    fresh = torch.cat(list(generate(model, prompt, 13, Choice(temperature=0),
                                    decoding=Decoding(use_cache=False))), dim=1)
    assert cached.shape == (2, 40) and torch.equal(cached[:, :13], fresh)


@pytest.mark.parametrize("attention", list(OWN))
def test_qk_norm_and_no_scale_reach_every_variant_and_keep_it_causal_and_cacheable(attention):
    default = make_model(attention, "rope")
    switched = make_model(attention, "rope", qk_norm=True, attn_scale=False)
    switched.load_state_dict(default.state_dict())          # the switches add no parameters
    idx = tokens(b=2)
    out, _ = switched(idx, all_logits=True)
    assert not torch.allclose(out, default(idx, all_logits=True)[0], atol=1e-4), "the switches did nothing"
    for scale_only in (True, False):                        # each switch on its own changes the output too
        one = make_model(attention, "rope", qk_norm=not scale_only, attn_scale=not scale_only)
        one.load_state_dict(default.state_dict())
        assert not torch.allclose(one(idx, all_logits=True)[0], default(idx, all_logits=True)[0], atol=1e-4)
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 40
    torch.testing.assert_close(switched(changed, all_logits=True)[0][:, :9], out[:, :9], atol=1e-6, rtol=0)
    cache = InferenceCache(switched, 2, "cpu", torch.float32)
    parts = [switched(idx[:, :6], cache=cache, all_logits=True)[0]]
    parts += [switched(idx[:, t:t + 1], cache=cache, pos=torch.tensor([t]))[0] for t in range(6, 16)]
    torch.testing.assert_close(torch.cat(parts, dim=1), out, atol=1e-5, rtol=0)
