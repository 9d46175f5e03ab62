"""coat's operators: torch.library custom ops (namespace ``coat``) backed by the C core on CPU and the CUDA
kernels on GPU, which give bit-identical results. Schemas are in csrc/bindings/library.cpp; the fake
(meta) implementations below let torch.compile and FakeTensor trace them.

Numerics, shared by every quantizer (see csrc/include/coat/quantize.h for the full statement):

    amax  = max |x| over a 1 x G group of the last dimension (or the whole tensor), NaN ignored
    scale = max(amax / FP8_MAX, 2**-126)            stored as float32
    q     = fp8(x / scale)                           round to nearest even, saturating to +-FP8_MAX
    x'    = float(q) * scale                         what dequantize returns

FP8_MAX is 448 for torch.float8_e4m3fn and 57344 for torch.float8_e5m2. All-zero groups give zeros back,
never NaN. A group holding +-Inf gets an Inf scale and dequantizes to NaN as a whole, so an overflow is
never silently clipped; a NaN element stays NaN and leaves its group unchanged.

Inputs are float32, bfloat16 or float16 tensors of any shape with a contiguous last dimension whose leading
dimensions collapse into evenly strided rows (contiguous tensors and slices like ``x[..., :k]``). A last
dimension that is not a multiple of G ends in a short group. Outputs are contiguous.
"""
from __future__ import annotations

import math

import torch

from coat._native import check_device_supported

GROUP_SIZES = (16, 32, 64, 128)
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_dtype(format: torch.dtype | str) -> torch.dtype:
    """torch.float8_e4m3fn / torch.float8_e5m2 from a dtype or from "e4m3" / "e5m2"."""
    if isinstance(format, str) and format.lower() in FP8_DTYPES:
        return FP8_DTYPES[format.lower()]
    if format in FP8_MAX:
        return format
    raise ValueError(f"unsupported FP8 format {format!r}: use 'e4m3' (torch.float8_e4m3fn) or 'e5m2' (torch.float8_e5m2)")


def quantize_group(
    x: torch.Tensor, group_size: int = 16, format: torch.dtype | str = "e4m3", *, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantizes ``x`` to FP8 with one scale per 1 x ``group_size`` group of its last dimension.

    Returns ``(q, scales, q_t)``: ``q`` has x's shape and the FP8 dtype; ``scales`` is float32 of shape
    ``x.shape[:-1] + (ceil(x.shape[-1] / group_size),)``; ``q_t`` is, when ``transpose`` is set, the
    transpose of q viewed as a (rows, cols) matrix, i.e. shape ``(x.shape[-1], prod(x.shape[:-1]))``,
    the column-major operand a weight-gradient GEMM reads (``q_t[c, r]`` dequantizes with
    ``scales.view(-1, ngroups)[r, c // group_size]``), else None.
    """
    check_device_supported(x, "coat.ops.quantize_group")
    q, scales, q_t = torch.ops.coat.quantize_group(x, group_size, fp8_dtype(format), transpose)
    return q, scales, q_t if transpose else None


def group_amax(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Stage 1 of group scaling: float32 max |x| of each 1 x ``group_size`` group of the last dimension
    (NaN ignored), shape ``x.shape[:-1] + (ceil(x.shape[-1] / group_size),)``. A kernel that produces a
    tensor can emit this alongside it and hand it to :func:`quantize_tensor`."""
    check_device_supported(x, "coat.ops.group_amax")
    return torch.ops.coat.group_amax(x, group_size)


def quantize_tensor(
    x: torch.Tensor,
    format: torch.dtype | str = "e4m3",
    *,
    group_size: int = 128,
    group_amax: torch.Tensor | None = None,
    transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantizes ``x`` to FP8 with one per-tensor scale, computed by group scaling: per-group amax
    (``group_amax``, computed here with ``group_size`` when not given), a reduction to the tensor's amax,
    then ``scale = max(amax / FP8_MAX, 2**-126)``.

    Returns ``(q, scale, q_t)``: q with x's shape, a 0-d float32 scale, and the transposed q as in
    :func:`quantize_group` when ``transpose`` is set, else None.
    """
    check_device_supported(x, "coat.ops.quantize_tensor")
    if group_amax is None:
        group_amax = torch.ops.coat.group_amax(x, group_size)
    q, scale, q_t = torch.ops.coat.quantize_tensor(x, group_amax, fp8_dtype(format), transpose)
    return q, scale, q_t if transpose else None


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of the quantizers: ``float(q) * scale`` rounded to ``dtype`` (torch.bfloat16 or
    torch.float32). Pass ``group_size`` with the per-group scales of :func:`quantize_group`; leave it None
    with the one-element scale of :func:`quantize_tensor`."""
    check_device_supported(q, "coat.ops.dequantize")
    return torch.ops.coat.dequantize(q, scale, group_size, dtype)


def _check_group_size(group_size: int, op: str) -> None:
    if group_size not in GROUP_SIZES:
        raise RuntimeError(f"{op}: group_size must be 16, 32, 64 or 128, got {group_size}")


def _transposed(x: torch.Tensor, fp8: torch.dtype, transpose: bool) -> torch.Tensor:
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    return x.new_empty((cols, rows) if transpose else (0,), dtype=fp8)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    ngroups = -(-x.shape[-1] // group_size)
    return x.new_empty((*x.shape[:-1], ngroups), dtype=torch.float32)


@torch.library.register_fake("coat::quantize_group")
def _quantize_group_fake(x, group_size, fp8_dtype, transpose=False):
    _check_group_size(group_size, "coat.quantize_group")
    return x.new_empty(x.shape, dtype=fp8_dtype), _grouped(x, group_size), _transposed(x, fp8_dtype, transpose)


@torch.library.register_fake("coat::group_amax")
def _group_amax_fake(x, group_size):
    _check_group_size(group_size, "coat.group_amax")
    return _grouped(x, group_size)


@torch.library.register_fake("coat::quantize_tensor")
def _quantize_tensor_fake(x, group_amax, fp8_dtype, transpose=False):
    return (
        x.new_empty(x.shape, dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
        _transposed(x, fp8_dtype, transpose),
    )


@torch.library.register_fake("coat::dequantize")
def _dequantize_fake(q, scale, group_size, dtype):
    return q.new_empty(q.shape, dtype=dtype)
