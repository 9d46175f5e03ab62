"""FP8Weight: a weight that arrives already in FP8, as FSDP2 all-gathers it under
:func:`coat.distributed.fp8_all_gather`.

It stands in for the unsharded weight parameter: shape and dtype are the parameter's (the dtype the
gradients take), the data are FP8 codes and the per-tensor scale its layer would have quantized it with.
coat's projections (:class:`coat.nn.functional.Projections`) read the codes directly, forward, and transpose
them byte by byte for the dgrad GEMM of backward. Any other use of the tensor is refused with a message: the
high-precision values are not on this rank, and a silent dequantized copy would change the numerics.
"""
from __future__ import annotations

import torch


class FP8Weight(torch.Tensor):
    """codes: [N, K] FP8 (torch.float8_e4m3fn / e5m2), scale: 0-d float32 (``amax / FP8_MAX``, floored as
    coat.ops quantizers do), amax: 0-d float32, the amax the scale derives from (shared by the projections
    quantized together), dtype: the dtype the weight's gradients take."""

    codes: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        self.codes, self.scale, self.amax = codes, scale, amax

    def __repr__(self) -> str:
        return f"FP8Weight(shape={tuple(self.shape)}, codes={self.codes.dtype}, scale={self.scale.item()}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func is torch.ops.aten.detach.default:  # nn.Parameter(weight)
            return FP8Weight(weight.codes, weight.scale, weight.amax, weight.dtype)
        if func in (torch.ops.aten.as_strided.default, torch.ops.aten.view.default) and (
            list(args[1]) == list(weight.shape)
        ):  # FSDP2 views the gathered weight as the parameter's shape, which it already is
            return FP8Weight(weight.codes, weight.scale, weight.amax, weight.dtype)
        if func in (torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default):
            # a new plain tensor that only borrows the weight's dtype and device
            return func(torch.empty((), dtype=weight.dtype, device=weight.device), *args[1:], **kwargs)
        if func is torch.ops.aten.is_same_size.default:
            return args[0].shape == args[1].shape
        raise NotImplementedError(
            f"coat: {func} on a weight all-gathered in FP8 (coat.distributed.fp8_all_gather). Only coat's FP8 "
            "projections read it, through FP8 GEMMs; its high-precision values are not on this rank"
        )


def transposed_codes(weights: list[FP8Weight]) -> torch.Tensor:
    """The [K, sum N_i] transpose of the weights' codes stacked by rows: the operand of the dgrad GEMM, made
    by moving bytes, so its codes are exactly the forward's."""
    rows = torch.cat([weight.codes.view(torch.uint8) for weight in weights])
    return rows.t().contiguous().view(weights[0].codes.dtype)
