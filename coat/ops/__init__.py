"""coat's operators: torch.library custom ops (namespace ``coat``) backed by the C core on CPU and the CUDA
kernels on GPU, which give bit-identical results, except fp8_adamw_step, whose CUDA kernel uses the GPU's fast
arithmetic and agrees with the C core within a stated tolerance (see its docstring), and cross_entropy, which
agrees within float32 rounding. Schemas are in csrc/bindings/library.cpp; each family's module holds the fake
(meta) implementations of its ops, which let torch.compile and FakeTensor trace them.

This package is their public surface: call them as ``coat.ops.NAME``. One module per kernel family, each over
the shared format and group-size checks of ``coat.ops._checks``:

    coat.ops.quantize   FP8 quantization with group and per-tensor scales, dequantization, block-scaled FP4 / FP6
    coat.ops.norm_act   RMSNorm and SiLU*mul with FP8 outputs and FP8-saved inputs, RMSNorm with a 16-bit output
    coat.ops.rope       rotary position embedding, and the per-head q/k RMSNorm fused with it
    coat.ops.adamw      the fused FP8 AdamW step and the FP8 optimizer states
    coat.ops.loss       softmax cross-entropy with its gradient in place
    coat.ops.stats      the quantization statistics of coat.report

The numerics of each family are in its module's docstring and, in full, in its header in csrc/include/coat/.
"""
from coat.ops._checks import FP8_DTYPES, FP8_MAX, GROUP_SIZES, fp8_dtype
from coat.ops.adamw import (
    MOMENT_STATS,
    adamw_scalars,
    dequantize_expanded,
    fp8_adamw_step,
    moment_stats,
    quantize_expanded,
)
from coat.ops.loss import CROSS_ENTROPY_MAX_V, check_labels, cross_entropy
from coat.ops.norm_act import (
    ACTIVATIONS,
    RMSNORM_MAX_COLS,
    SAVED_FORMATS,
    rmsnorm_backward,
    rmsnorm_quantize,
    rmsnorm_requantize,
    rmsnorm_save,
    silu_mul_backward,
    silu_mul_quantize,
    silu_mul_requantize,
)
from coat.ops.quantize import (
    BLOCK_FORMATS,
    blocks_to_e4m3,
    dequantize,
    dequantize_blocks,
    dequantize_fp4,
    fp4_to_e4m3,
    group_amax,
    quantize_blocks,
    quantize_fp4,
    quantize_group,
    quantize_tensor,
    quantize_tensors,
    tensor_amax,
)
from coat.ops.rope import QK_NORM_MAX_HEAD_DIM, ROPE_MAX_HEAD_DIM, qk_norm_rope, rotary_embedding
from coat.ops.stats import QUANTIZATION_SUMS, quantization_sums_

__all__ = [
    # formats and group sizes
    "GROUP_SIZES", "FP8_DTYPES", "FP8_MAX", "fp8_dtype",
    # quantize
    "quantize_group", "group_amax", "quantize_tensor", "tensor_amax", "quantize_tensors", "dequantize",
    "BLOCK_FORMATS", "quantize_blocks", "dequantize_blocks", "blocks_to_e4m3", "quantize_fp4", "dequantize_fp4",
    "fp4_to_e4m3",
    # norm_act
    "RMSNORM_MAX_COLS", "SAVED_FORMATS", "ACTIVATIONS", "rmsnorm_quantize", "rmsnorm_backward", "silu_mul_quantize",
    "silu_mul_backward", "rmsnorm_requantize", "silu_mul_requantize", "rmsnorm_save",
    # rope
    "ROPE_MAX_HEAD_DIM", "rotary_embedding", "QK_NORM_MAX_HEAD_DIM", "qk_norm_rope",
    # adamw
    "adamw_scalars", "fp8_adamw_step", "quantize_expanded", "dequantize_expanded", "MOMENT_STATS", "moment_stats",
    # loss
    "CROSS_ENTROPY_MAX_V", "check_labels", "cross_entropy",
    # stats
    "QUANTIZATION_SUMS", "quantization_sums_",
]
