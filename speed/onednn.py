"""Opt-in (train.onednn = true): Linear layers whose CPU matmuls run in oneDNN instead of PyTorch's
default BLAS. Same parameters, same state dict, same outputs and gradients to float rounding.

Whether it pays depends on the processor: where the default BLAS takes a slower code path than the
CPU allows, oneDNN's kernels can be much faster; where the BLAS is already at its best, it is slower.
Measure with `python bench.py train CONFIG --train.onednn=true` (docs/benchmarks/cpu.md has figures).
"""
import torch
import torch.nn as nn


@torch.library.custom_op("gpt::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight (out, in)ᵀ + bias, in oneDNN (strided views are fine: no copies).
    A custom op, so that torch.compile calls it as it is rather than looking inside."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.size(0))


def _save(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """dL/dx = g W, dL/dW = gᵀ x, dL/db = Σ g: two more matmuls, also in oneDNN.

    oneDNN copies its first operand into a contiguous one, and for dL/dW both gᵀ and xᵀ are
    transposed views of (M, ·) activations. Put the narrower one first (a quarter of the copying
    in the MLP), computing (xᵀ g)ᵀ, with a transpose of the small result, when that is xᵀ."""
    x, weight = ctx.saved_tensors
    grad_2d, x_2d = grad.reshape(-1, grad.size(-1)), x.reshape(-1, x.size(-1))   # (M, out), (M, in)
    grad_x = onednn_linear(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
    if grad_2d.size(1) <= x_2d.size(1):
        grad_w = onednn_linear(grad_2d.t(), x_2d.t(), None)                          # (out, in)
    else:
        grad_w = onednn_linear(x_2d.t(), grad_2d.t(), None).t().contiguous()         # (in, out) -> (out, in)
    grad_b = grad_2d.sum(0) if ctx.has_bias else None
    return grad_x, grad_w, grad_b


onednn_linear.register_autograd(_backward, setup_context=_save)


class OneDNNLinear(nn.Linear):
    """nn.Linear (same parameters, same state_dict) whose matmuls run in oneDNN."""

    def forward(self, x):
        return onednn_linear(x, self.weight, self.bias)


def onednn_works() -> bool:
    """oneDNN's fp32 linear is in this build and gives the right answer."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        x, w = torch.randn(4, 8), torch.randn(3, 8)
        return torch.allclose(onednn_linear(x, w, None), x @ w.t(), atol=1e-5)
    except Exception:
        return False


def use_onednn_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """On CPU in fp32, turn every nn.Linear of model into a OneDNNLinear (same parameters, same
    math); return how many (0 elsewhere: bf16 autocast on CPU already goes to oneDNN)."""
    if device.type != "cpu" or dtype != torch.float32 or not onednn_works():
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for m in linears:
        m.__class__ = OneDNNLinear
    return len(linears)
