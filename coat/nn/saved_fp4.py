"""Every 16-bit activation autograd saves, kept in FP4: the uniform-4-bit ablation.

coat's ``saved_format="fp4"`` keeps only the inputs of RMSNorm and SiLU*mul at 4 bits and leaves attention's
saved tensors alone, as AGoQ does; AGoQ reports that 4 bits for every activation does not converge.
:func:`saved_in_fp4` is the other arm of that comparison: inside it, every bfloat16 or float16 tensor that
autograd saves for backward (attention's q, k, v and output included) is kept as FP4 E2M1 with one float32
scale per 1 x ``block_size`` block of its last dimension (:func:`coat.ops.quantize_fp4`), and backward reads
the dequantized copy. Not kept in FP4: parameters and tensors derived from them by casts and views alone
(the weight a layer multiplies by is not an activation), float32 tensors (softmax statistics, the loss's
log-probabilities, coat's own scales) and FP8 or integer tensors (coat's saved codes, indices).

It saves memory (4.5 bits per element instead of 16) but is meant for measuring what 4-bit storage does
to convergence; the README's convergence table has the run.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from coat import ops

_KEPT_DTYPES = (torch.bfloat16, torch.float16)
# Nodes that turn a parameter into the tensor a layer saves without computing anything new.
_CAST_AND_VIEW_NODES = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                        "ViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "UnsafeViewBackward0"}


def _derived_from_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a leaf that requires grad (a parameter), or one reached from it through casts and
    views alone (autocast's bfloat16 copy of a float32 weight, its transpose)."""
    if t.is_leaf:
        return t.requires_grad
    node = t.grad_fn
    while node is not None and node.name() in _CAST_AND_VIEW_NODES:
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return node is not None and node.name() == "torch::autograd::AccumulateGrad"


def _memory_order(t: torch.Tensor) -> list[int]:
    """The permutation that lists ``t``'s dimensions from the largest stride to the smallest: for a permuted
    view of a contiguous tensor (attention's [B, H, S, D] of a [B, S, H, D] buffer), ``t.permute(order)`` is
    contiguous and quantizing it copies nothing."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))


class _Packed:
    __slots__ = ("codes", "scales", "shape", "order", "dtype", "block_size")

    def __init__(self, t: torch.Tensor, block_size: int):
        self.order = _memory_order(t)
        dense = t.permute(self.order).contiguous()
        self.shape = dense.shape
        self.dtype = t.dtype
        self.block_size = block_size
        self.codes, self.scales = ops.quantize_fp4(dense.reshape(-1, dense.shape[-1]), block_size)

    def unpack(self) -> torch.Tensor:
        out_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        dense = ops.dequantize_fp4(self.codes, self.scales, self.shape[-1], self.block_size, out_dtype)
        dense = dense.to(self.dtype).reshape(self.shape)
        inverse = sorted(range(len(self.order)), key=lambda d: self.order[d])
        return dense.permute(inverse)


@contextlib.contextmanager
def saved_in_fp4(block_size: int = 16) -> Iterator[None]:
    """Inside it, autograd keeps every bfloat16 / float16 activation it saves as FP4 E2M1 with a float32
    scale per 1 x ``block_size`` block (16, 32, 64 or 128) of the tensor's innermost dimension in memory;
    see the module docstring for what is left alone. Backward gets a tensor of the saved one's shape, dtype
    and strides holding ``dequantize_fp4(quantize_fp4(t))``; a block holding NaN or Inf comes back as NaN.
    Run the forward inside it; backward may run outside."""
    if block_size not in (16, 32, 64, 128):
        raise ValueError(f"block_size must be 16, 32, 64 or 128, got {block_size!r}")

    def pack(t: torch.Tensor):
        if t.dtype not in _KEPT_DTYPES or t.dim() == 0 or t.numel() == 0 or _derived_from_parameter(t):
            return t
        return _Packed(t.detach(), block_size)

    def unpack(saved):
        return saved.unpack() if isinstance(saved, _Packed) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
