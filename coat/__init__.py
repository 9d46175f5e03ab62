"""coat: memory-efficient FP8 training for PyTorch (COAT, ICLR 2025).

coat.ops holds the FP8 operators: group and per-tensor quantization, dequantization, the fused RMSNorm
and SiLU*mul layers with FP8 outputs and FP8-saved inputs, and the fused FP8 AdamW step with dynamic range
expansion.
coat.nn holds the FP8 layers (coat.nn.Linear, a drop-in for torch.nn.Linear, RMSNorm, SwiGLUMLP, MLP), and
coat.convert(model) converts a transformers Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 or Gemma 3 model, a mixture
of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: FP8 experts in coat.nn.experts), or a vision-language model built
on one of them (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Mistral 3, InternVL, Idefics3, SmolVLM, Gemma 3, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), to the FP8 precision flow.
coat.optim.AdamW is a drop-in for torch.optim.AdamW that keeps both moments in FP8.
coat.report.QuantizationReport measures what quantization does to each tensor of a converted model during
training: amax, flushed and saturated shares, relative error, the optimizer's expansion exponents.
coat.distributed.fp8_reduce_scatter(model) makes FSDP2 reduce-scatter gradients in block-scaled FP8 (AGoQ), and
coat.distributed.fp8_all_gather(model) makes it all-gather the projection weights as FP8 codes.
"""
from coat import distributed, nn, ops, optim, report
from coat._native import BUILT_WITH_CUDA
from coat.conversion import convert

__version__ = "0.1.0"


def built_with_cuda() -> bool:
    """Whether the installed extension contains the CUDA kernels."""
    return BUILT_WITH_CUDA


__all__ = ["convert", "distributed", "nn", "ops", "optim", "report", "built_with_cuda", "__version__"]
