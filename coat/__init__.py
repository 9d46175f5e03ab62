"""coat: memory-efficient FP8 training for PyTorch (COAT, ICLR 2025).

coat.ops holds the FP8 operators: group and per-tensor quantization, dequantization, and the fused FP8
AdamW step with dynamic range expansion. coat.optim.AdamW is a drop-in for torch.optim.AdamW with FP8 moments.
"""
from coat import ops, optim
from coat._native import native as _native

__version__ = "0.1.0"


def built_with_cuda() -> bool:
    """Whether the installed extension contains the CUDA kernels."""
    return _native.built_with_cuda()


__all__ = ["ops", "optim", "built_with_cuda", "__version__"]
