"""Float64 oracles written from the paper, in plain PyTorch, independent of coat's kernels."""
from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_per_tensor_dequantized(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Per-tensor FP8 quantization (paper section 3) and back, in float64:
    scale = max(amax / FP8_MAX, 2^-126) in float32, q = fp8(x / scale), returns q * scale."""
    x32 = x.detach().float()
    scale = torch.clamp(x32.abs().amax() / FP8_MAX[fp8], min=2.0**-126)
    q = (x32 / scale).to(fp8)
    return q.double() * scale.double()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ||actual - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def quantize_group_dequantized(x: torch.Tensor, group_size: int, fp8: torch.dtype = torch.float8_e4m3fn):
    """Per-group FP8 quantization with 1 x G groups along the last dimension (paper section 5.2; the last
    group of a row may be short) and back, in float64."""
    x32 = x.detach().float()
    cols = x32.shape[-1]
    groups = torch.nn.functional.pad(x32, (0, -cols % group_size)).unflatten(-1, (-1, group_size))
    scale = torch.clamp(groups.abs().amax(-1, keepdim=True) / FP8_MAX[fp8], min=2.0**-126)
    q = (groups / scale).to(fp8)
    return (q.double() * scale.double()).flatten(-2)[..., :cols]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm_backward(grad_y, x_saved, rstd, weight):
    """RMSNorm's gradients written out, evaluated at a saved input x_saved (the dequantized FP8 copy) and
    the rstd of the exact input: with xhat = x_saved * rstd and g = grad_y * weight,
    dx = (g - xhat * mean(g * xhat)) * rstd, dweight = sum over rows of grad_y * xhat."""
    xhat = x_saved * rstd
    g = grad_y * weight
    grad_x = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    return grad_x, (grad_y * xhat).reshape(-1, xhat.shape[-1]).sum(0)


def swiglu_mlp(x, gate_weight, up_weight, down_weight):
    """LlamaMLP: down(silu(x gate^T) * (x up^T))."""
    return (torch.nn.functional.silu(x @ gate_weight.t()) * (x @ up_weight.t())) @ down_weight.t()
