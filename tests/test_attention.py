"""Plain attention: rows are distributions, naive == sdpa (causality, for every variant and
position encoding: tests/test_variants.py)."""
import pytest
import torch

from model.attention.mha import CausalSelfAttention
from model.config import ModelConfig
from model.gpt import GPT

def make_model(attention="sdpa", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32, attention=attention, **kw)
    return GPT(cfg).eval()


def test_attention_rows_are_distributions_with_zeros_above_the_diagonal():
    torch.manual_seed(0)
    attn = CausalSelfAttention(ModelConfig(n_embd=32, n_head=4, attention="naive")).eval()
    _, weights = attn(torch.randn(3, 10, 32), return_weights=True)          # (B, nh, T, T)
    assert weights.shape == (3, 4, 10, 10)
    above = torch.triu(torch.ones(10, 10, dtype=torch.bool), diagonal=1)
    assert torch.all(weights[..., above] == 0.0)
    assert torch.all(weights[..., ~above] > 0.0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 10), atol=1e-6, rtol=0)


def test_sdpa_asked_for_weights_takes_the_explicit_path():
    torch.manual_seed(0)
    naive = CausalSelfAttention(ModelConfig(n_embd=32, n_head=4, attention="naive")).eval()
    sdpa = CausalSelfAttention(ModelConfig(n_embd=32, n_head=4, attention="sdpa")).eval()
    sdpa.load_state_dict(naive.state_dict())
    x = torch.randn(2, 6, 32)
    out, weights = sdpa(x, return_weights=True)
    torch.testing.assert_close(weights, naive(x, return_weights=True)[1], atol=0, rtol=0)
    torch.testing.assert_close(out, sdpa(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("pos", ["learned", "rope", "alibi", "none"])
def test_naive_and_sdpa_agree_in_outputs_and_gradients(pos):
    naive, sdpa = make_model("naive", pos=pos), make_model("sdpa", pos=pos)
    sdpa.load_state_dict(naive.state_dict())
    idx = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(3))
    out_n, loss_n = naive(idx, targets)
    out_s, loss_s = sdpa(idx, targets)
    torch.testing.assert_close(out_s, out_n, atol=1e-5, rtol=0)
    loss_n.backward()
    loss_s.backward()
    for (name, p_n), p_s in zip(naive.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p_s.grad, p_n.grad, atol=1e-5, rtol=0, msg=f"gradient of {name}")


def test_inference_returns_only_the_last_position():
    model = make_model()
    idx = torch.randint(0, 50, (2, 9))
    last, loss = model(idx)
    full, _ = model(idx, all_logits=True)
    assert loss is None and last.shape == (2, 1, 50)
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_residual_projections_get_the_scaled_init():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50, n_layer=8, n_embd=256, n_head=4))
    std = model.blocks[0].attn.proj.weight.std().item()
    assert abs(std - 0.02 / (2 * 8) ** 0.5) < 0.001
    assert abs(model.blocks[0].attn.query.weight.std().item() - 0.02) < 0.002
    assert model.lm_head.weight is model.tok_emb.weight
