"""coat's FP8 layers as autograd Functions: what each computes in FP8 and what it saves for backward. This
module is their public surface; they live in the modules below it, each importing only those under it:
:mod:`coat.nn.gemm` (the FP8 GEMM, per-tensor quantization, :class:`Projections`), :mod:`coat.nn.layers` (linear,
RMSNorm, the gated and non-gated MLPs), :mod:`coat.nn.blocks` (the decoder blocks) and :mod:`coat.nn.cross_entropy` (the fused LM
head and loss).

Every linear layer quantizes its input and its weight per tensor to FP8 (E4M3 by default) with group scaling
and multiplies them with an FP8 GEMM (torch._scaled_mm: fp32 accumulation, output in the input's dtype).
For backward it saves the transposed FP8 copy of its input, the operand the weight-gradient GEMM reads, and
that copy's scale; never the BF16 input, and never an FP8 copy of the weight, which backward quantizes again
from the parameter (paper appendix G.5). See :class:`coat.nn.FP8Config` for the gradient options.
Where a fused RMSNorm or act*mul (or a non-gated MLP's act) produced that input, the block Functions save only the op's own inputs
(E4M3, 1 x G groups) and recompute the transposed operand from them in backward, with the forward's scale:
one saved copy per op instead of two (AGoQ, section 4). The weight gradient then reads the op's output
recomputed from its FP8-rounded inputs; the README states the cost in precision.

:func:`fp8_gemm` takes any shape: it zero-pads the dimensions torch._scaled_mm needs in multiples of 16, and
multiplies the FP8 values in float32 where there are no FP8 GEMMs (CPUs, GPUs before compute capability 8.9);
:mod:`coat.nn.gemm` says how.

The decoder blocks (:func:`before_attention`, :func:`after_attention`, :func:`mlp_residual`,
:func:`rotary_embedding`, :func:`qk_norm_rotary_embedding`) implement the paper's FP8 precision flow for a
Llama-style decoder layer (appendix G.1). Their docstrings say what each saves.

Every quantization a Function makes is also handed, with the tensor it quantized, to a *site* of
:mod:`coat.report` while a report captures the step (``site`` arguments; None otherwise, and then
nothing is recorded): the names it records under are the tensor names of the report.
"""
from coat.nn.blocks import after_attention, before_attention, mlp_residual, qk_norm_rotary_embedding, rotary_embedding
from coat.nn.cross_entropy import linear_cross_entropy
from coat.nn.gemm import Projections, fp8_gemm, output_dtype, quantize_per_tensor
from coat.nn.layers import linear, mlp, rms_norm, rms_norm_save, smooth_swiglu_scale, swiglu_mlp

__all__ = [
    "fp8_gemm", "quantize_per_tensor", "Projections", "output_dtype",
    "linear", "rms_norm", "rms_norm_save", "smooth_swiglu_scale", "swiglu_mlp", "mlp",
    "before_attention", "after_attention", "mlp_residual", "rotary_embedding", "qk_norm_rotary_embedding",
    "linear_cross_entropy",
]
