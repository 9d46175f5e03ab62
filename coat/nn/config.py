"""The options every coat layer takes: group size, FP8 formats, gradient handling, Smooth-SwiGLU, the format
of saved activations."""
from __future__ import annotations

import dataclasses

import torch

from coat.ops import GROUP_SIZES, fp8_dtype

# Stage-1 group of "group scaling" (per-tensor amax computed as a max over per-group maxima). It changes
# only how the reduction is split, never a value: 128 keeps the intermediate small.
AMAX_GROUP_SIZE = 128
SAVED_FORMATS = ("e4m3", "fp4", "fp6")


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """How a coat layer quantizes.

    group_size:      1 x G groups along the hidden dimension for the activations that non-linear layers
                     (RMSNorm, SiLU*mul) save for backward (paper section 5.2; G = 16 per appendix H).
    forward_format:  FP8 format of the activations and weights that enter the forward GEMMs, quantized
                     per tensor with group scaling. E4M3, as in the paper.
    gradient_format: FP8 format the output gradient of a linear layer is quantized to (per tensor) for the
                     two backward GEMMs, dgrad dY x W and wgrad dY^T x X, both FP8 with fp32 accumulation.
                     E5M2 by default, as in COAT's released FP8 linear layer and TransformerEngine's hybrid
                     recipe: FP8 backward GEMMs are what makes a layer's backward faster than BF16. None keeps
                     gradients unquantized: dgrad multiplies by the BF16 weight and wgrad by the dequantized
                     FP8 input, in the gradient's dtype (paper appendix G.5).
    smooth_swiglu:   scale each channel of SiLU(gate)*up by a power of two before it is quantized for the
                     down projection, and fold the inverse into the down projection's weight (Smooth-SwiGLU,
                     Fishman et al. 2024), so that channels with outliers do not crush the per-tensor scale.
    saved_format:    how the inputs of RMSNorm and SiLU*mul are kept for backward, in 1 x group_size groups:
                     "e4m3" (8 bits + a float32 scale per group, the paper's), "fp6" (FP6 E2M3, 6 bits + a
                     float32 scale per group) or "fp4" (FP4 E2M1, 4 bits + a float32 scale per group; AGoQ's
                     low-bit storage), FP6 and FP4 quantized from the op's input itself. Backward expands an FP6
                     or FP4 copy exactly into the E4M3 layout and recomputes from it.
    fast_accum:      the forward GEMMs accumulate in the tensor cores' own FP8 accumulator, which Hopper
                     promotes to fp32 less often (torch._scaled_mm's use_fast_accum): faster, and less precise
                     over long K. torchao's float8 training and TransformerEngine accumulate the forward GEMM
                     this way by default; coat does not (the paper's GEMMs accumulate in fp32). The backward
                     GEMMs accumulate in fp32 either way. No effect on the CPU, whose path is exact in fp32.
    experts_fast_accum: the mixture-of-experts grouped GEMMs (:mod:`coat.nn.experts`: forward, dgrad and wgrad)
                     accumulate in the fast FP8 accumulator, as torchao's FP8 MoE recipe does. On by default:
                     torch's FP8 grouped GEMM with fp32 promotion ran 2.4x slower than its BF16 grouped GEMM at
                     Qwen3-30B-A3B's experts on an H100, with fast accumulation 1.3x faster (benchmarks/NOTES.md).
                     No effect on the CPU.
    """

    group_size: int = 16
    forward_format: str = "e4m3"
    gradient_format: str | None = "e5m2"
    smooth_swiglu: bool = False
    saved_format: str = "e4m3"
    fast_accum: bool = False
    experts_fast_accum: bool = True

    def __post_init__(self):
        for name in ("fast_accum", "experts_fast_accum"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.saved_format not in SAVED_FORMATS:
            raise ValueError(f"saved_format must be one of {SAVED_FORMATS}, got {self.saved_format!r}")
        forward = fp8_dtype(self.forward_format)
        if self.gradient_format is not None and forward == fp8_dtype(self.gradient_format) == torch.float8_e5m2:
            raise ValueError(
                "forward_format and gradient_format cannot both be e5m2: the weight-gradient GEMM would "
                "multiply E5M2 by E5M2, which FP8 tensor cores (cuBLASLt) do not support"
            )

    @property
    def forward_dtype(self) -> torch.dtype:
        return fp8_dtype(self.forward_format)

    @property
    def gradient_dtype(self) -> torch.dtype | None:
        return None if self.gradient_format is None else fp8_dtype(self.gradient_format)
