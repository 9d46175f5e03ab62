"""FP8Weight: a weight that arrives already in FP8, as FSDP2 all-gathers it under
:func:`coat.distributed.fp8_all_gather`.

It stands in for the unsharded weight parameter: shape and dtype are the parameter's (the dtype the
gradients take), the data are FP8 codes and the per-tensor scale its layer would have quantized it with.
coat's projections (:class:`coat.nn.functional.Projections`) read the codes directly, forward, and transpose
them for the dgrad GEMM of backward (:func:`transposed_codes`). Any other use of the tensor is refused with a
message: the high-precision values are not on this rank, and a silent dequantized copy would change the
numerics.
"""
from __future__ import annotations

import torch

from coat import ops


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
    """The [K, sum N_i] transpose of the weights' codes stacked by rows: the operand of the dgrad GEMM.

    Made by coat's transposing quantizer rather than a byte copy (torch's transposing copy of a 1-byte
    tensor reached 0.33 TB/s on an H200): the codes are read back at scale 1 into bfloat16, which holds every
    FP8 value exactly, and quantized again at scale 1 (amax = FP8_MAX), which returns each value's own code.
    So every code but NaN is the forward's bit for bit; a NaN stays NaN, its sign and payload bits may not."""
    fp8 = weights[0].codes.dtype
    device = weights[0].codes.device
    one = torch.ones((), dtype=torch.float32, device=device)
    values = [ops.dequantize(weight.codes, one, None, torch.bfloat16) for weight in weights]
    fp8_max = torch.full((), ops.FP8_MAX[fp8], dtype=torch.float32, device=device)
    _, _, codes_t = ops.quantize_tensors(values, fp8, dim=0, amax=fp8_max, rowwise=False, columnwise=True)
    return codes_t
