"""Float64 oracles of the layers (coat.nn), written from the paper in plain PyTorch, independent of coat's kernels;
and a stand-in for the adapters users wrap linear layers in."""
from __future__ import annotations

import torch

import reference


def quantize_per_tensor_dequantized(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Per-tensor FP8 quantization (paper section 3) and back, in float64, by the bit-exact oracle."""
    q, scale = reference.quantize_tensor(x.detach().cpu(), fp8)
    return (reference.decode(q, fp8) * scale.double()).to(x.device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ||actual - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def quantize_group_dequantized(x: torch.Tensor, group_size: int, fp8: torch.dtype = torch.float8_e4m3fn):
    """Per-group FP8 quantization with 1 x G groups along the last dimension (paper section 5.2; the last
    group of a row may be short) and back, in float64, by the bit-exact oracle."""
    q, scales = reference.quantize_group(x.detach().cpu(), group_size, fp8)
    cols = x.shape[-1]
    return (reference.decode(q, fp8) * reference.expand_group_scales(scales, cols, group_size).double()).to(x.device)


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


def swiglu_mlp(x, gate_weight, up_weight, down_weight, activation="silu"):
    """LlamaMLP: down(act(x gate^T) * (x up^T)), act silu or (GeGLU, Gemma's MLP) gelu(approximate="tanh")."""
    gate = x @ gate_weight.t()
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    return (act * (x @ up_weight.t())) @ down_weight.t()


class LowRankAdapter(torch.nn.Module):
    """A PEFT-style wrapper of a linear layer (base layer kept, a low-rank update added), exposing the base
    layer's weight as PEFT's LoRA layers do."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Linear(base.in_features, 2, bias=False)
        self.lora_b = torch.nn.Linear(2, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))
