"""coat's FP8 layers as autograd Functions: what each computes in FP8 and what it saves for backward.

Every linear layer quantizes its input and its weight per tensor to FP8 (E4M3 by default) with group scaling
and multiplies them with an FP8 GEMM (torch._scaled_mm: fp32 accumulation, output in the input's dtype).
For backward it saves the transposed FP8 copy of its input, the operand the weight-gradient GEMM reads, and
that copy's scale; never the BF16 input, and never an FP8 copy of the weight, which backward quantizes again
from the parameter (paper appendix G.5). See :class:`coat.nn.FP8Config` for the gradient options.

The shapes torch._scaled_mm accepts on GPUs are: A row-major, B column-major, the contraction dimension K
and the output width N multiples of 16. :func:`fp8_gemm` zero-pads K and N to the next multiple of 16
(zeros add nothing to a dot product, and the padded output columns are dropped), so any shape works and the
padding costs one copy of the operands only for shapes that need it. On devices without FP8 GEMMs (CUDA
GPUs before compute capability 8.9) it multiplies the FP8 values in float32 instead and applies both
scales after, which computes the same products; CPUs run torch._scaled_mm's CPU implementation.

The block Functions at the end implement the paper's FP8 precision flow for a Llama-style decoder layer
(appendix G.1). Their docstrings say what each saves.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from coat import ops
from coat.nn.config import AMAX_GROUP_SIZE, FP8Config

_GEMM_ALIGNMENT = 16


# ---------------------------------------------------------------------------------------------------------
# FP8 GEMM


@functools.lru_cache(maxsize=None)
def _device_has_fp8_gemm(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def _pad_last_dim(q: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pads the last dimension of a contiguous FP8 matrix to a multiple of ``multiple``. Byte 0 is +0.0
    in both FP8 formats; padding runs on the uint8 view because constant padding of FP8 dtypes is not
    implemented everywhere."""
    pad = -q.shape[-1] % multiple
    if pad == 0:
        return q
    return F.pad(q.view(torch.uint8), (0, pad)).view(q.dtype)


def _pad_rows(q: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -q.shape[0] % multiple
    if pad == 0:
        return q
    return F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(q.dtype)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a * a_scale) @ (b_t * b_scale).T + bias`` with fp32 accumulation, rounded once to ``out_dtype``.

    a: [M, K] FP8, contiguous (row-major). b_t: [N, K] FP8, contiguous, i.e. B = b_t.T is the column-major
    [K, N] operand. Scales are one-element float32 tensors (the dequantization scales of
    :func:`coat.ops.quantize_tensor`). bias: [N] or None. Returns a contiguous [M, N] tensor.
    """
    n = b_t.shape[0]
    if not _device_has_fp8_gemm(a.device):
        # Products of FP8 values are exact in float32, so this differs from the FP8 GEMM only in the order of
        # the fp32 additions; the scales are applied after the product, as the GEMM applies them.
        out = (a.float() @ b_t.float().t()) * (a_scale * b_scale)
        return (out if bias is None else out + bias).to(out_dtype)
    a = _pad_last_dim(a, _GEMM_ALIGNMENT)
    b_t = _pad_rows(_pad_last_dim(b_t, _GEMM_ALIGNMENT), _GEMM_ALIGNMENT)
    # The GEMM epilogue adds a BF16/FP16 bias before its single rounding; cuBLASLt takes no float32 bias,
    # so a float32 output gets its bias added afterwards, where that costs no precision.
    epilogue_bias = None
    if bias is not None and out_dtype != torch.float32:
        epilogue_bias = F.pad(bias.to(out_dtype), (0, b_t.shape[0] - n))
    out = torch._scaled_mm(a, b_t.t(), a_scale, b_scale, bias=epilogue_bias, out_dtype=out_dtype)
    if out.shape[1] != n:
        out = out[:, :n].contiguous()
    if bias is not None and epilogue_bias is None:
        out.add_(bias)
    return out


# ---------------------------------------------------------------------------------------------------------
# Linear building blocks, shared by coat.nn.Linear and the decoder blocks


def quantize_per_tensor(x2d: torch.Tensor, fp8: torch.dtype, transpose: bool):
    """Per-tensor FP8 with group scaling: ``(q, scale, q_t)``, q_t None unless ``transpose``."""
    return ops.quantize_tensor(x2d, fp8, group_size=AMAX_GROUP_SIZE, transpose=transpose)


def linear_forward_fp8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: FP8Config,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y = x @ W^T + b for an input already quantized per tensor ([M, K] FP8); W is quantized here."""
    w_q, w_scale, _ = quantize_per_tensor(weight.contiguous(), config.forward_dtype, transpose=False)
    return fp8_gemm(x_q, x_scale, w_q, w_scale, out_dtype, bias)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = ops.dequantize(q, scale, None, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    return out.to(dtype)


class QuantizedGradient:
    """An output gradient [M, N] prepared once for every backward GEMM that reads it: quantized per tensor
    to ``config.gradient_format`` (with its transpose when a weight gradient is needed), or kept as is when
    gradients stay unquantized."""

    def __init__(self, grad2d: torch.Tensor, config: FP8Config, need_transpose: bool):
        self.grad = grad2d
        self.config = config
        if config.gradient_dtype is not None:
            self.q, self.scale, self.q_t = quantize_per_tensor(grad2d, config.gradient_dtype, need_transpose)

    def input_grad(self, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """dgrad: dY @ W, [M, K]."""
        if self.config.gradient_dtype is None:
            return (self.grad @ weight.to(self.grad.dtype)).to(out_dtype)
        _, w_scale, w_q_t = quantize_per_tensor(weight.contiguous(), self.config.forward_dtype, transpose=True)
        return fp8_gemm(self.q, self.scale, w_q_t, w_scale, out_dtype)

    def weight_grad(self, x_q_t: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """wgrad: dY^T @ X, [N, K], from the transposed FP8 input [K, M] saved in forward."""
        if self.config.gradient_dtype is None:
            x_t = _dequantized(x_q_t, x_scale, self.grad.dtype)
            return (self.grad.t() @ x_t.t()).to(out_dtype)
        # The contraction dimension here is the token count M, which fp8_gemm pads to a multiple of 16.
        return fp8_gemm(self.q_t, self.scale, x_q_t, x_scale, out_dtype)

    def bias_grad(self, bias: torch.Tensor) -> torch.Tensor:
        return self.grad.sum(0, dtype=torch.float32).to(bias.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous [rows, last-dim] matrix (a no-op for contiguous tensors)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer returns: the autocast dtype inside autocast, the input's dtype otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# coat.nn.Linear


class _LinearFunction(torch.autograd.Function):
    """y = x W^T + b with FP8 operands. Saves the transposed FP8 input and its scale when the weight needs a
    gradient (nothing of the input otherwise), and the weight parameter itself."""

    @staticmethod
    def forward(ctx, x, weight, bias, config: FP8Config, out_dtype: torch.dtype):
        x2d = _rows(x)
        need_weight_grad = ctx.needs_input_grad[1]
        x_q, x_scale, x_q_t = quantize_per_tensor(x2d, config.forward_dtype, transpose=need_weight_grad)
        y = linear_forward_fp8(x_q, x_scale, weight, bias, config, out_dtype)
        ctx.save_for_backward(x_q_t, x_scale if need_weight_grad else None, weight, bias)
        ctx.config, ctx.x_shape, ctx.x_dtype = config, x.shape, x.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_q_t, x_scale, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad = QuantizedGradient(_rows(grad_y), ctx.config, need_transpose=need_w)
        grad_x = grad.input_grad(weight, ctx.x_dtype).view(ctx.x_shape) if need_x else None
        grad_w = grad.weight_grad(x_q_t, x_scale, weight.dtype) if need_w else None
        grad_b = grad.bias_grad(bias) if need_b else None
        return grad_x, grad_w, grad_b, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: FP8Config = FP8Config()
) -> torch.Tensor:
    """FP8 ``torch.nn.functional.linear``: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"coat linear: input has {x.shape[-1]} features in its last dimension but the weight expects "
            f"{weight.shape[1]} (weight shape {tuple(weight.shape)})"
        )
    out_dtype = output_dtype(x)
    if _needs_autograd(x, weight, bias):
        return _LinearFunction.apply(x, weight, bias, config, out_dtype)
    x_q, x_scale, _ = quantize_per_tensor(_rows(x), config.forward_dtype, transpose=False)
    y = linear_forward_fp8(x_q, x_scale, weight, bias, config, out_dtype)
    return y.view(*x.shape[:-1], weight.shape[0])
