"""The opt-in oneDNN linears change the speed, never the math: nn.Linear's outputs and gradients."""
import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
from speed.onednn import OneDNNLinear, onednn_works, use_onednn_linears
from training.trainer import train

needs_onednn = pytest.mark.skipif(not onednn_works(), reason="this PyTorch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_in, n_out", [(24, 40), (40, 24)])   # both orders of dL/dW's operands
def test_onednn_linear_matches_nn_linear_in_outputs_and_gradients(bias, n_in, n_out):
    torch.manual_seed(0)
    ref = torch.nn.Linear(n_in, n_out, bias=bias)
    fast = torch.nn.Linear(n_in, n_out, bias=bias)
    fast.load_state_dict(ref.state_dict())
    fast.__class__ = OneDNNLinear
    x = torch.randn(3, 7, n_in)
    x_ref, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_fast = ref(x_ref), fast(x_fast)
    torch.testing.assert_close(out_fast, out_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out_ref)
    out_ref.backward(g)
    out_fast.backward(g)
    torch.testing.assert_close(x_fast.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(p_fast.grad, p_ref.grad, atol=1e-4, rtol=1e-5, msg=name)


@needs_onednn
def test_a_gpt_with_onednn_linears_is_the_same_gpt():
    cfg = ModelConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    ref, fast = GPT(cfg), GPT(cfg)
    fast.load_state_dict(ref.state_dict())
    assert use_onednn_linears(fast, torch.device("cpu"), torch.float32) == 2 * 6 + 1
    assert use_onednn_linears(GPT(cfg), torch.device("cpu"), torch.bfloat16) == 0, "bf16 goes to oneDNN anyway"
    assert fast.lm_head.weight is fast.tok_emb.weight and set(fast.state_dict()) == set(ref.state_dict())
    idx = torch.randint(0, 50, (4, 16))
    _, loss_ref = ref(idx, idx)
    _, loss_fast = fast(idx, idx)
    loss_ref.backward()
    loss_fast.backward()
    torch.testing.assert_close(loss_fast, loss_ref, atol=1e-5, rtol=0)
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(p_fast.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


@needs_onednn
def test_train_onednn_runs_the_same_training(tiny_cfg, tmp_path):
    plain = train(tiny_cfg(out_dir=tmp_path / "plain"), quiet=True)
    fast = train(tiny_cfg(**{"train.onednn": True}, out_dir=tmp_path / "onednn"), quiet=True)
    assert sorted(fast["losses"]) == sorted(plain["losses"]) == list(range(1, 21))
    for step, loss in plain["losses"].items():
        assert fast["losses"][step] == pytest.approx(loss, abs=1e-4), step
