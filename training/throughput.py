"""Throughput levers of the training step that need more than a line: torch.compile with a fallback,
and Linear layers whose matmuls run in oneDNN on CPUs where that is faster than the BLAS default."""
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn


def compile_model(model: nn.Module, batch_shape: tuple[int, int], vocab_size: int,
                  autocast=nullcontext(), warn=lambda msg: print(msg, file=sys.stderr, flush=True)):
    """torch.compile(model), tried at once on one forward and backward of a batch of batch_shape.

    Compiling is lazy: without the trial, a missing C++ compiler or an unsupported op would surface
    as a long traceback in the middle of the first step. Here it is a one-line warning and the eager
    model. The trial compiles the graphs the training step reuses (same shapes, same autocast) and
    leaves no trace: no gradients, and the RNG states (dropout draws) are restored afterwards.
    """
    compiled = torch.compile(model)
    device = next(model.parameters()).device
    x = torch.randint(0, vocab_size, batch_shape, device=device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
            _, loss = compiled(x, x)
            loss.backward()
    except Exception as e:   # any failure in dynamo, inductor or the C++/Triton toolchain
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        warn(f"warning: torch.compile failed, training without it ({type(e).__name__}: {reason})")
        return model
    finally:
        model.zero_grad(set_to_none=True)
    return compiled


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


def cpuinfo(field: str, path: str = "/proc/cpuinfo") -> str:
    """A field of the first processor in /proc/cpuinfo ('vendor_id' -> 'GenuineIntel', 'model name'
    -> 'Intel(R) Xeon(R) ...'); '' where there is no such file (not Linux) or field."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """'GenuineIntel', 'AuthenticAMD', ...; '' where unknown."""
    return cpuinfo("vendor_id")


def onednn_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN linears beat PyTorch's own CPU matmul here: on CPU, in fp32, on a processor with
    AVX-512 that is not Intel's.

    PyTorch's fp32 CPU matmul calls MKL, which runs its AVX-512 kernels only on Intel processors and
    an AVX2 path elsewhere; oneDNN uses AVX-512 wherever the CPU has it. Measured with bench.py train:
    on a 2-core AMD EPYC (Zen 5) oneDNN made the training step 1.3-1.7x faster; on a 2-core Intel Xeon
    (AVX-512, AMX) it made it 16-18% slower, since MKL is already at its best there.
    """
    return (device.type == "cpu" and dtype == torch.float32 and cpu_vendor() not in ("", "GenuineIntel")
            and torch.backends.cpu.get_cpu_capability().startswith("AVX512") and onednn_works())


def use_onednn_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """On CPU in fp32, turn every nn.Linear of model into a OneDNNLinear (same parameters, same
    math); return how many. Whether that is faster is onednn_pays' question, not this function's.
    bf16 autocast on CPU already goes to oneDNN."""
    if device.type != "cpu" or dtype != torch.float32 or not onednn_works():
        return 0
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for m in linears:
        m.__class__ = OneDNNLinear
    return len(linears)
