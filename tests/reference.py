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
