"""coat: memory-efficient FP8 training for PyTorch (COAT, ICLR 2025).

coat.ops holds the FP8 operators: group and per-tensor quantization, dequantization, and the fused FP8
AdamW step with dynamic range expansion.
"""
from coat import ops
from coat._native import native as _native

__version__ = "0.1.0"


def built_with_cuda() -> bool:
    """Whether the installed extension contains the CUDA kernels."""
    return _native.built_with_cuda()


__all__ = ["ops", "built_with_cuda", "__version__"]
