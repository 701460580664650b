"""Throughput levers change the speed, never the math: oneDNN linears give nn.Linear's outputs and
gradients; a torch.compile failure costs a warning line, not the run."""
import pytest
import torch

from model.config import ModelConfig
from model.gpt import GPT
import training.throughput as throughput
from training.throughput import OneDNNLinear, onednn_pays, onednn_works, use_onednn_linears
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
@pytest.mark.parametrize("vendor, capability, device, dtype, pays", [
    ("AuthenticAMD", "AVX512", "cpu", torch.float32, True),     # MKL would run its AVX2 path here
    ("GenuineIntel", "AVX512", "cpu", torch.float32, False),    # MKL runs AVX-512 itself: faster than oneDNN
    ("AuthenticAMD", "AVX2", "cpu", torch.float32, False),      # no AVX-512 for oneDNN to win with
    ("", "AVX512", "cpu", torch.float32, False),                # unknown processor: PyTorch's default
    ("AuthenticAMD", "AVX512", "cpu", torch.bfloat16, False),   # bf16 autocast goes to oneDNN anyway
    ("AuthenticAMD", "AVX512", "meta", torch.float32, False),   # not a CPU
])
def test_onednn_linears_are_used_only_where_they_pay(monkeypatch, vendor, capability, device, dtype, pays):
    monkeypatch.setattr(throughput, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert onednn_pays(torch.device(device), dtype) is pays


def test_cpuinfo_reads_the_first_processors_fields_or_says_unknown(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R45\n\n"
                    "processor\t: 1\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R45\n")
    assert throughput.cpuinfo("vendor_id", str(info)) == "AuthenticAMD"
    assert throughput.cpuinfo("model name", str(info)) == "AMD EPYC 9R45"
    assert throughput.cpuinfo("flags", str(info)) == ""
    assert throughput.cpuinfo("vendor_id", str(tmp_path / "missing")) == ""


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


def test_a_compile_failure_falls_back_to_eager_with_a_one_line_warning(tiny_cfg, monkeypatch, capsys):
    class Broken(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("C++ compiler not found\nlong details")
    monkeypatch.setattr(torch, "compile", lambda model, **kw: Broken())
    summary = train(tiny_cfg(**{"train.compile": True}), quiet=True)
    assert summary["step"] == 20
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: torch.compile failed, training without it (RuntimeError: C++ compiler not found)"]
