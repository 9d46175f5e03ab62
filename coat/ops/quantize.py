"""FP8 quantization with group and per-tensor scales, and the block-scaled FP4 / FP6 storage of saved
activations (csrc/include/coat/quantize.h, fp8.h, fp4.h and fp6.h state every rule).

Numerics, shared by every quantizer:

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
from coat.ops._checks import check_group_size, fp8_dtype, grouped, packed_row_bytes, transposed

__all__ = [
    "quantize_group", "group_amax", "quantize_tensor", "tensor_amax", "quantize_tensors", "dequantize",
    "BLOCK_FORMATS", "quantize_blocks", "dequantize_blocks", "blocks_to_e4m3", "quantize_fp4", "dequantize_fp4",
    "fp4_to_e4m3",
]


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


def _check_not_empty(tensors: list[torch.Tensor], op: str) -> None:
    # The dispatcher finds no device to dispatch an empty list to, so the check lives here.
    if len(tensors) == 0:
        raise ValueError(f"{op}: tensors must hold at least one tensor")
    check_device_supported(tensors[0], op)


def tensor_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |x| over every element of every tensor in ``tensors`` (NaN ignored), as a 0-d float32 tensor: the
    amax that one per-tensor scale shared by several tensors derives from (see :func:`quantize_tensors`).
    The tensors are float32, bfloat16 or float16 with a contiguous last dimension, on one device."""
    _check_not_empty(tensors, "coat.ops.tensor_amax")
    return torch.ops.coat.tensor_amax(list(tensors))


def quantize_tensors(
    tensors: list[torch.Tensor],
    format: torch.dtype | str = "e4m3",
    *,
    dim: int,
    amax: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes several tensors with one per-tensor scale into one FP8 matrix, as if they had been
    concatenated first (without the copy): each tensor is seen as a (rows, cols) matrix (leading dimensions
    collapsed), and the matrices are stacked along ``dim``: 0 stacks rows (the weights of q, k and v
    projections, [N_i, K] -> [sum N_i, K]), 1 places columns side by side (their output gradients,
    [M, N_i] -> [M, sum N_i]).

    ``scale = max(amax / FP8_MAX, 2**-126)`` with ``amax`` from :func:`tensor_amax` (computed here when
    None). Returns ``(q, scale, q_t)``: q the [R, C] codes when ``rowwise`` (else an empty tensor), scale 0-d
    float32, q_t the [C, R] transposed codes when ``columnwise`` (else empty). The codes equal
    :func:`quantize_tensor`'s of the concatenated matrix with that amax, bit for bit.
    """
    _check_not_empty(tensors, "coat.ops.quantize_tensors")
    if amax is None:
        amax = torch.ops.coat.tensor_amax(list(tensors))
    return torch.ops.coat.quantize_tensors(list(tensors), dim, amax, fp8_dtype(format), rowwise, columnwise)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of the quantizers: ``float(q) * scale`` rounded to ``dtype`` (torch.bfloat16 or
    torch.float32). Pass ``group_size`` with the per-group scales of :func:`quantize_group`; leave it None
    with the one-element scale of :func:`quantize_tensor`."""
    check_device_supported(q, "coat.ops.dequantize")
    return torch.ops.coat.dequantize(q, scale, group_size, dtype)


@torch.library.register_fake("coat::quantize_group")
def _quantize_group_fake(x, group_size, fp8_dtype, transpose=False):
    check_group_size(group_size, "coat.quantize_group")
    return x.new_empty(x.shape, dtype=fp8_dtype), grouped(x, group_size), transposed(x, fp8_dtype, transpose)


@torch.library.register_fake("coat::group_amax")
def _group_amax_fake(x, group_size):
    check_group_size(group_size, "coat.group_amax")
    return grouped(x, group_size)


@torch.library.register_fake("coat::quantize_tensor")
def _quantize_tensor_fake(x, group_amax, fp8_dtype, transpose=False):
    return (
        x.new_empty(x.shape, dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
        transposed(x, fp8_dtype, transpose),
    )


@torch.library.register_fake("coat::tensor_amax")
def _tensor_amax_fake(xs):
    if not xs:
        raise RuntimeError("coat.tensor_amax: xs must hold at least one tensor")
    return xs[0].new_empty((), dtype=torch.float32)


@torch.library.register_fake("coat::quantize_tensors")
def _quantize_tensors_fake(xs, dim, amax, fp8_dtype, rowwise, columnwise):
    op = "coat.quantize_tensors"
    if not xs:
        raise RuntimeError(f"{op}: xs must hold at least one tensor")
    if dim not in (0, 1):
        raise RuntimeError(f"{op}: dim must be 0 (the matrices' rows are stacked) or 1 (their columns are placed side by side), got {dim}")
    matrices = [(math.prod(x.shape[:-1]), x.shape[-1]) for x in xs]
    if dim == 0:
        rows, cols = sum(r for r, _ in matrices), matrices[0][1]
    else:
        rows, cols = matrices[0][0], sum(c for _, c in matrices)
    x = xs[0]
    return (
        x.new_empty((rows, cols) if rowwise else (0,), dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((cols, rows) if columnwise else (0,), dtype=fp8_dtype),
    )


@torch.library.register_fake("coat::dequantize")
def _dequantize_fake(q, scale, group_size, dtype):
    return q.new_empty(q.shape, dtype=dtype)


# ------------------------------------------------------------------------------------------------------
# Block-scaled FP4 (E2M1) and FP6 (E2M3) storage of activations saved for backward (csrc/include/coat/quantize.h,
# fp4.h and fp6.h state every rule). One float32 scale per 1 x block_size block of the last dimension:
#
#     scale = max(amax / E_MAX, 2**-126)   NaN if the block holds a NaN, Inf if it holds +-Inf
#     code  = encode(x * r)                r = fp32(1 / scale), the product exact: rounded once, to nearest even,
#                                          saturating to +-E_MAX
#     x'    = value(code) * scale
#
# FP4 E2M1: values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, E_MAX = 6; codes packed two per byte, element 2i of a row in
# the low nibble and 2i+1 in the high one, a row of `cols` elements in ceil(cols / 2) bytes (an odd row ends in a
# high nibble of 0).
# FP6 E2M3: values +-{0, 0.125, ..., 1.875 in steps of 0.125, 2, ..., 3.75 in 0.25, 4, ..., 7.5 in 0.5}, E_MAX = 7.5;
# codes packed four per three bytes (element 4i+j in bits 6j..6j+5 of the little-endian 24-bit word of bytes 3i
# to 3i+2), a row in ceil(3 cols / 4) bytes.
# A block holding a NaN or an Inf dequantizes to NaN as a whole (neither format has a NaN: the block scale
# carries it). *_to_e4m3 turns codes and scales into the E4M3 1 x block_size layout of quantize_group, which
# dequantize reads back to the same bits as the format's dequantizer, so the FP8 backward kernels consume
# FP4- and FP6-saved activations unchanged.

BLOCK_FORMATS = ("fp4", "fp6")  # the block-scaled saved formats, by their save_format names


def _block_op(name: str, format: str, tensor: torch.Tensor, caller: str):
    """The native op ``name`` ("quantize_blocks", ...) of ``format``, after the checks every op makes first;
    ``caller`` names the public function in their errors."""
    if format not in BLOCK_FORMATS:
        raise ValueError(f"coat.ops.{caller}: format must be 'fp4' or 'fp6', got {format!r}")
    check_device_supported(tensor, f"coat.ops.{caller}")
    return getattr(torch.ops.coat, name.replace("blocks", format))


def quantize_blocks(x: torch.Tensor, format: str, block_size: int = 16, *, _caller: str = "quantize_blocks"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` (float32 / bfloat16 / float16, contiguous last dimension, row-strided views read in
    place) to packed FP4 E2M1 (``format="fp4"``) or FP6 E2M3 (``"fp6"``) with one float32 scale per 1 x
    ``block_size`` block (16, 32, 64 or 128) of its last dimension. Returns ``(codes, scales)``: codes torch.uint8
    of shape ``x.shape[:-1] + (ceil(x.shape[-1] / 2),)`` (FP4) or ``(ceil(3 * x.shape[-1] / 4),)`` (FP6), scales
    float32 of shape ``x.shape[:-1] + (ceil(x.shape[-1] / block_size),)``."""
    return _block_op("quantize_blocks", format, x, _caller)(x, block_size)


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, cols: int, format: str, block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16, *, _caller: str = "dequantize_blocks",
) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: ``value(code) * scale`` rounded to ``dtype`` (torch.bfloat16 or
    torch.float32), of shape ``codes.shape[:-1] + (cols,)``. ``cols`` is the original last dimension (packed
    codes cannot tell every width from the next)."""
    return _block_op("dequantize_blocks", format, codes, _caller)(codes, scales, cols, block_size, dtype)


def blocks_to_e4m3(
    codes: torch.Tensor, scales: torch.Tensor, cols: int, format: str, block_size: int = 16, *,
    _caller: str = "blocks_to_e4m3",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expands :func:`quantize_blocks`'s output, exactly, into the FP8 layout of :func:`quantize_group` with
    ``group_size = block_size``: returns ``(q, scales)``, q torch.float8_e4m3fn of shape ``codes.shape[:-1] +
    (cols,)`` and ``scales`` itself (the same tensor, not a copy: every E2M1 and E2M3 value is an E4M3 value, so
    the block scales carry over). ``dequantize(q, scales, block_size, dtype)`` equals
    ``dequantize_blocks(codes, scales, cols, format, block_size, dtype)`` bit for bit, NaN and Inf blocks
    included."""
    return _block_op("blocks_to_e4m3", format, codes, _caller)(codes, scales, cols, block_size), scales


def quantize_fp4(x: torch.Tensor, block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blocks` with ``format="fp4"``."""
    return quantize_blocks(x, "fp4", block_size, _caller="quantize_fp4")


def dequantize_fp4(
    codes: torch.Tensor, scales: torch.Tensor, cols: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """:func:`dequantize_blocks` with ``format="fp4"``."""
    return dequantize_blocks(codes, scales, cols, "fp4", block_size, dtype, _caller="dequantize_fp4")


def fp4_to_e4m3(
    codes: torch.Tensor, scales: torch.Tensor, cols: int, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blocks_to_e4m3` with ``format="fp4"``."""
    return blocks_to_e4m3(codes, scales, cols, "fp4", block_size, _caller="fp4_to_e4m3")


def _register_block_fakes(format: str) -> None:
    @torch.library.register_fake(f"coat::quantize_{format}")
    def _quantize_fake(x, block_size):
        check_group_size(block_size, f"coat.quantize_{format}", "block_size")
        codes = x.new_empty((*x.shape[:-1], packed_row_bytes(x.shape[-1], format)), dtype=torch.uint8)
        return codes, grouped(x, block_size)

    def decoded(codes, cols, block_size, op, dtype):
        check_group_size(block_size, op, "block_size")
        return codes.new_empty((*codes.shape[:-1], cols), dtype=dtype)

    @torch.library.register_fake(f"coat::dequantize_{format}")
    def _dequantize_fake(codes, scales, cols, block_size, dtype):
        return decoded(codes, cols, block_size, f"coat.dequantize_{format}", dtype)

    @torch.library.register_fake(f"coat::{format}_to_e4m3")
    def _to_e4m3_fake(codes, scales, cols, block_size):
        return decoded(codes, cols, block_size, f"coat.{format}_to_e4m3", torch.float8_e4m3fn)


for _format in BLOCK_FORMATS:
    _register_block_fakes(_format)
