"""coat's operators: torch.library custom ops (namespace ``coat``) backed by the C core on CPU and the CUDA
kernels on GPU, which give bit-identical results, except fp8_adamw_step, whose CUDA kernel uses the GPU's fast
arithmetic and agrees with the C core within a stated tolerance (see its docstring). Schemas are in
csrc/bindings/library.cpp; the fake (meta) implementations below let torch.compile and FakeTensor trace them.

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

FP8 optimizer states (csrc/include/coat/adamw.h has the full statement): a state is FP8 codes of its
parameter's shape plus bf16 meta of shape ``(*shape[:-1], ceil(shape[-1] / G), 3)``, one (scale, k, C) per
1 x G group of the last dimension (G = 128 by default: 2 + 12/G bytes per parameter for m and v). Dynamic
range expansion quantizes ``y = sign(x) * (|x| / C)**k`` with C the geometric mean of the group's smallest
and largest nonzero magnitudes and k, clamped to [1/2, 64], chosen so that the group's range fills the
format's; :func:`fp8_adamw_step` dequantizes, runs one AdamW step and re-quantizes, fused, over a list of
parameters; :func:`quantize_expanded` / :func:`dequantize_expanded` convert states to and from float32.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

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


def _check_block_size(block_size: int, op: str) -> None:
    if block_size not in GROUP_SIZES:
        raise RuntimeError(f"{op}: block_size must be 16, 32, 64 or 128, got {block_size}")


def _packed_row_bytes(cols: int, format: str) -> int:
    """Bytes of a row of ``cols`` codes saved in ``format``: FP4 two codes per byte, FP6 four per three bytes."""
    return {"e4m3": cols, "fp4": -(-cols // 2), "fp6": -(-3 * cols // 4)}[format]


def _register_block_fakes(format: str) -> None:
    @torch.library.register_fake(f"coat::quantize_{format}")
    def _quantize_fake(x, block_size):
        _check_block_size(block_size, f"coat.quantize_{format}")
        codes = x.new_empty((*x.shape[:-1], _packed_row_bytes(x.shape[-1], format)), dtype=torch.uint8)
        return codes, _grouped(x, block_size)

    def decoded(codes, cols, block_size, op, dtype):
        _check_block_size(block_size, op)
        return codes.new_empty((*codes.shape[:-1], cols), dtype=dtype)

    @torch.library.register_fake(f"coat::dequantize_{format}")
    def _dequantize_fake(codes, scales, cols, block_size, dtype):
        return decoded(codes, cols, block_size, f"coat.dequantize_{format}", dtype)

    @torch.library.register_fake(f"coat::{format}_to_e4m3")
    def _to_e4m3_fake(codes, scales, cols, block_size):
        return decoded(codes, cols, block_size, f"coat.{format}_to_e4m3", torch.float8_e4m3fn)


for _format in BLOCK_FORMATS:
    _register_block_fakes(_format)


# ------------------------------------------------------------------------------------------------------
# Fused non-linear layers: RMSNorm and SiLU*mul with FP8 outputs and FP8-saved inputs
# (csrc/include/coat/norm_act.h states every formula, layout and reduction order).
#
# Forward: y is written in FP8 with one per-tensor scale, computed by group scaling inside the kernel that
# computes y; y_scale = max(amax(y) / FP8_MAX, 2**-126) and y is bit for bit quantize_tensor of the fp32
# result. The op's inputs are saved for backward as FP8 E4M3 with 1 x save_group_size groups, bit for bit
# quantize_group of the inputs. Every NaN code the fused ops write is the positive NaN (0x7F).
# Backward: reads only what the forward saved (plus dy) and returns gradients in dy's dtype (rmsnorm_backward's
# dx in the residual's dtype when it adds one).
# Requantize: recomputes the forward's y_t in backward from what the forward saved and its y_scale, so that a
# layer need not keep y_t between forward and backward.
# CPU and CUDA give the same bits: every sum has a fixed reduction order.

RMSNORM_MAX_COLS = 32768


def _check_named_group_size(group_size: int, name: str, op: str) -> None:
    if group_size not in GROUP_SIZES:
        raise RuntimeError(f"{op}: {name} must be 16, 32, 64 or 128, got {group_size}")


SAVED_FORMATS = ("e4m3", "fp4", "fp6")
#: The gated-MLP activations of silu_mul_quantize / _backward / _requantize: SwiGLU's and GeGLU's.
ACTIVATIONS = ("silu", "gelu_tanh")


def _checked_saved_format(format: str, name: str, op: str) -> str:
    """A forward op's ``save_format`` (or the ``saved_format`` a backward op reads), checked before the native op."""
    if format not in SAVED_FORMATS:
        raise ValueError(f"coat.ops.{op}: {name} must be 'e4m3', 'fp4' or 'fp6', got {format!r}")
    return format


def _checked_activation(activation: str, op: str, error: type[Exception] = ValueError) -> str:
    """The ``activation`` of the gated-MLP ops (ValueError before the native op, RuntimeError in the fakes)."""
    if activation not in ACTIVATIONS:
        raise error(f"{op}: activation must be 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU, gelu(approximate='tanh')), "
                    f"got {activation!r}")
    return activation


def _saved_format_name(format: str, name: str, op: str) -> str:
    """The fake ops' check of the native ops' format argument, with their message."""
    if format not in SAVED_FORMATS:
        raise RuntimeError(f"{op}: {name} must be 'e4m3', 'fp4' or 'fp6', got '{format}'")
    return format


def _saved_codes(x: torch.Tensor, format: str) -> torch.Tensor:
    if format == "e4m3":
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return x.new_empty((*x.shape[:-1], _packed_row_bytes(x.shape[-1], format)), dtype=torch.uint8)


def rmsnorm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    save_group_size: int = 16,
    amax_group_size: int = 128,
    format: torch.dtype | str = "e4m3",
    transpose: bool = False,
    save_format: str = "e4m3",
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm with its output quantized to FP8 per tensor and its input saved in FP8 (or FP4) for backward.

    With rows the leading dimensions of ``x`` flattened and H = ``x.shape[-1]`` (1 <= H <= 32768)::

        rstd[r] = 1 / sqrt(sum_c x[r, c]**2 / H + eps)      float32, fixed reduction order
        y       = (x * rstd) * (weight + weight_offset)     float32, then quantized per tensor

    ``weight_offset``: 0, or 1 for Gemma's ``(1 + weight)`` norms; added to the weight in float32 (every norm op
    takes it, and the backward and requantize ops need the forward's).
    ``x``: float32 / bfloat16 / float16 with a contiguous last dimension (row-strided views are read in
    place); ``weight``: [H], float32 / bfloat16 / float16. ``amax_group_size`` is the 1 x G granularity of
    the first stage of group scaling; since max is exact, the outputs do not depend on it.

    Returns ``(y, y_scale, y_t, x_saved, x_saved_scales, rstd)``: y (x's shape, FP8 ``format``), its 0-d
    float32 scale, its (H, rows) transpose when ``transpose`` is set (else None), x as E4M3 with
    per-``save_group_size`` scales (``quantize_group(x, save_group_size)``), and rstd, float32 [rows].
    With ``save_format="fp4"`` or ``"fp6"`` x is saved as ``quantize_blocks(x, save_format, save_group_size)``
    instead (packed codes and block scales, bit for bit), made in the same pass over x; the backward ops read it
    with the same ``saved_format``.
    A row holding +-Inf normalizes to 0 with NaN at the Inf (Inf * 0), as PyTorch's formula does.
    """
    check_device_supported(x, "coat.ops.rmsnorm_quantize")
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = torch.ops.coat.rmsnorm_quantize(
        x, weight, eps, save_group_size, amax_group_size, fp8_dtype(format), transpose,
        _checked_saved_format(save_format, "save_format", "rmsnorm_quantize"), weight_offset,
    )
    return y, y_scale, y_t if transpose else None, x_saved, x_saved_scales, rstd


def rmsnorm_backward(
    dy: torch.Tensor,
    x_saved: torch.Tensor,
    x_saved_scales: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    save_group_size: int = 16,
    *,
    residual: torch.Tensor | None = None,
    saved_format: str = "e4m3",
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rmsnorm_quantize` from what it saved (in its ``save_format``, given here as
    ``saved_format``). With x' the dequantized ``x_saved``,
    xhat = x' * rstd and g = dy * (weight + weight_offset), per row::

        dx      = (g - xhat * sum_c(g * xhat) / H) * rstd          in dy's dtype
        dweight = sum over rows of dy * xhat                        float32 [H] (cast it to weight's dtype)

    ``residual``: a gradient to add to dx in the same kernel, such as the one that reaches the input of a
    residual block ``x + f(rmsnorm(x))`` around the norm (float32 / bfloat16 / float16, dy's shape,
    contiguous). dx is then in residual's dtype: dx (rounded to dy's dtype as above) + residual, added in
    float32 and rounded once, which is ``dx.to(residual.dtype) + residual`` bit for bit when residual has dy's
    dtype or is float32. A NaN in dx is the canonical quiet NaN.

    Both sums have a fixed reduction order, so results are reproducible and the same on CPU and CUDA. An FP4 or
    FP6 copy is read as its exact E4M3 expansion (:func:`blocks_to_e4m3`) would be, without writing it: the
    results equal those from the expansion bit for bit.
    """
    check_device_supported(dy, "coat.ops.rmsnorm_backward")
    return torch.ops.coat.rmsnorm_backward(
        dy, x_saved, x_saved_scales, rstd, weight, save_group_size, residual,
        _checked_saved_format(saved_format, "saved_format", "rmsnorm_backward"), weight_offset,
    )


def silu_mul_quantize(
    gate: torch.Tensor,
    up: torch.Tensor,
    smooth_scale: torch.Tensor | None = None,
    *,
    save_group_size: int = 16,
    amax_group_size: int = 128,
    format: torch.dtype | str = "e4m3",
    transpose: bool = False,
    save_format: str = "e4m3",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gated MLP's activation, ``y = act(gate) * up [* smooth_scale]``, quantized to FP8 per tensor, with
    gate and up saved in FP8 for backward: SwiGLU with ``activation="silu"``, GeGLU with ``"gelu_tanh"``.

    ``gate``, ``up``: same shape [..., I] and dtype (float32 / bfloat16 / float16), contiguous last
    dimension; row-strided views such as the two halves of one [..., 2I] GEMM output are read in place.
    ``smooth_scale``: optional float32 [I], the Smooth-SwiGLU per-channel scale (Fishman et al., 2024):
    y is multiplied by it before quantization and the caller folds 1 / smooth_scale into the next layer.
    ``activation``: ``"silu"``, silu(g) = g * sigmoid(g), or ``"gelu_tanh"``, 0.5 g (1 + tanh(sqrt(2/pi)
    (g + 0.044715 g^3))) (torch's ``gelu(approximate="tanh")``, transformers' ``gelu_pytorch_tanh``), computed as
    g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) in float32 with coat's own exp (identical on CPU and CUDA).
    Both give +inf at +inf, NaN at -inf (-inf * 0, as torch) and NaN at NaN; never NaN for a finite gate.

    Returns ``(y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales)`` as in
    :func:`rmsnorm_quantize`, gate and up saved in ``save_format`` ("e4m3", "fp4" or "fp6") likewise.
    """
    check_device_supported(gate, "coat.ops.silu_mul_quantize")
    y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales = torch.ops.coat.silu_mul_quantize(
        gate, up, smooth_scale, save_group_size, amax_group_size, fp8_dtype(format), transpose,
        _checked_saved_format(save_format, "save_format", "silu_mul_quantize"),
        _checked_activation(activation, "coat.ops.silu_mul_quantize"),
    )
    return y, y_scale, y_t if transpose else None, gate_saved, gate_scales, up_saved, up_scales


def silu_mul_backward(
    dy: torch.Tensor,
    gate_saved: torch.Tensor,
    gate_scales: torch.Tensor,
    up_saved: torch.Tensor,
    up_scales: torch.Tensor,
    smooth_scale: torch.Tensor | None = None,
    save_group_size: int = 16,
    *,
    saved_format: str = "e4m3",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dgate, dup, d_amax)`` of :func:`silu_mul_quantize`, dgate and dup in dy's dtype, from the
    dequantized saved inputs g and u, for the forward's ``activation``: with dy_s = dy * smooth_scale (or dy)::

        dup   = dy_s * act(g)
        dgate = dy_s * u * act'(g)
        silu'(g)      = s * (1 + g * (1 - s)),                         s = sigmoid(g)
        gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2),
                        t = tanh(sqrt(2/pi) (g + 0.044715 g^3))

    gelu_tanh' is finite for every finite g (torch's float32 one is NaN from |g| ~ 1.8e19 on) and is 1 at +inf,
    0 at -inf; silu' is NaN at +-inf.

    ``d_amax`` (0-d float32) is the largest |dgate| and |dup|, NaN ignored: :func:`tensor_amax` of the two,
    computed in the same pass, which :func:`quantize_tensors` takes as ``amax`` to quantize both gradients with
    one scale. ``saved_format``: the forward's ``save_format``, read as in :func:`rmsnorm_backward`."""
    check_device_supported(dy, "coat.ops.silu_mul_backward")
    return torch.ops.coat.silu_mul_backward(
        dy, gate_saved, gate_scales, up_saved, up_scales, smooth_scale, save_group_size,
        _checked_saved_format(saved_format, "saved_format", "silu_mul_backward"),
        _checked_activation(activation, "coat.ops.silu_mul_backward"),
    )


def rmsnorm_requantize(
    x_saved: torch.Tensor,
    x_saved_scales: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    y_scale: torch.Tensor,
    save_group_size: int = 16,
    format: torch.dtype | str = "e4m3",
    *,
    saved_format: str = "e4m3",
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """The transposed FP8 output ``y_t`` [H, rows] of :func:`rmsnorm_quantize`, recomputed from what it saved
    (``x_saved``, ``x_saved_scales``, ``rstd``) and the ``y_scale`` it returned. With x' the dequantized
    ``x_saved`` (float32, as :func:`rmsnorm_backward` reads it)::

        y   = (x' * rstd) * (weight + weight_offset)   float32, the forward's formula and rounding order
        y_t = fp8(y / y_scale).T                       FP8 ``format``, NaN codes positive

    Equal to the forward's y_t bit for bit where x was FP8-representable in its group (x == x'); otherwise
    within one rounding of x to the saved format (E4M3, E2M1 or E2M3), carried through the op. Values past the
    forward's amax saturate to +-FP8_MAX. Pass ``save_group_size``, ``format`` and, as ``saved_format``, the
    ``save_format`` given to the forward.
    """
    check_device_supported(x_saved, "coat.ops.rmsnorm_requantize")
    return torch.ops.coat.rmsnorm_requantize(
        x_saved, x_saved_scales, rstd, weight, y_scale, save_group_size, fp8_dtype(format),
        _checked_saved_format(saved_format, "saved_format", "rmsnorm_requantize"), weight_offset,
    )


def silu_mul_requantize(
    gate_saved: torch.Tensor,
    gate_scales: torch.Tensor,
    up_saved: torch.Tensor,
    up_scales: torch.Tensor,
    smooth_scale: torch.Tensor | None,
    y_scale: torch.Tensor,
    save_group_size: int = 16,
    format: torch.dtype | str = "e4m3",
    *,
    saved_format: str = "e4m3",
    cols: int | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The transposed FP8 output ``y_t`` [I, rows] of :func:`silu_mul_quantize`, recomputed from the saved
    gate and up (dequantized as :func:`silu_mul_backward` reads them, g' and u') and the forward's
    ``y_scale``: ``y = act(bf16(g')) * u' [* smooth_scale]`` with the forward's act (its ``activation``) of g'
    rounded to bf16 (nearest even; under 2^-8 relative, so that the GPU reads act from the forward's bf16
    table), then as :func:`rmsnorm_requantize` (saturation, NaN, the tie to the forward's y_t for bf16 gates, and
    ``saved_format``). With ``saved_format="fp4"`` or ``"fp6"`` pass ``cols``, the width I of gate and up: packed
    rows do not tell every width from the next."""
    check_device_supported(gate_saved, "coat.ops.silu_mul_requantize")
    return torch.ops.coat.silu_mul_requantize(
        gate_saved, gate_scales, up_saved, up_scales, smooth_scale, y_scale, save_group_size, fp8_dtype(format),
        _checked_saved_format(saved_format, "saved_format", "silu_mul_requantize"), cols,
        _checked_activation(activation, "coat.ops.silu_mul_requantize"),
    )


def _check_rmsnorm_cols(x: torch.Tensor, name: str, op: str) -> None:
    if not 1 <= x.shape[-1] <= RMSNORM_MAX_COLS:
        raise RuntimeError(
            f"{op}: the last dimension of {name} (the normalized size) must be between 1 and {RMSNORM_MAX_COLS}, "
            f"got {x.shape[-1]}"
        )


@torch.library.register_fake("coat::rmsnorm_quantize")
def _rmsnorm_quantize_fake(x, weight, eps, save_group_size, amax_group_size, fp8_dtype, transpose, save_format="e4m3",
                           weight_offset=0.0):
    op = "coat.rmsnorm_quantize"
    saved = _saved_format_name(save_format, "save_format", op)
    _check_named_group_size(save_group_size, "save_group_size", op)
    _check_named_group_size(amax_group_size, "amax_group_size", op)
    _check_rmsnorm_cols(x, "x", op)
    return (
        x.new_empty(x.shape, dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
        _transposed(x, fp8_dtype, transpose),
        _saved_codes(x, saved),
        _grouped(x, save_group_size),
        x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32),
    )


@torch.library.register_fake("coat::rmsnorm_backward")
def _rmsnorm_backward_fake(dy, x_saved, x_saved_scales, rstd, weight, save_group_size, residual=None,
                           saved_format="e4m3", weight_offset=0.0):
    op = "coat.rmsnorm_backward"
    _saved_format_name(saved_format, "saved_format", op)
    _check_named_group_size(save_group_size, "save_group_size", op)
    _check_rmsnorm_cols(dy, "dy", op)
    if residual is not None and residual.shape != dy.shape:
        raise RuntimeError(
            f"{op}: residual has shape {tuple(residual.shape)} but dy has shape {tuple(dy.shape)}; "
            "it must have dy's shape"
        )
    dx_dtype = dy.dtype if residual is None else residual.dtype
    return dy.new_empty(dy.shape, dtype=dx_dtype), dy.new_empty((dy.shape[-1],), dtype=torch.float32)


@torch.library.register_fake("coat::silu_mul_quantize")
def _silu_mul_quantize_fake(gate, up, smooth_scale, save_group_size, amax_group_size, fp8_dtype, transpose,
                            save_format="e4m3", activation="silu"):
    op = "coat.silu_mul_quantize"
    saved = _saved_format_name(save_format, "save_format", op)
    _checked_activation(activation, op, RuntimeError)
    _check_named_group_size(save_group_size, "save_group_size", op)
    _check_named_group_size(amax_group_size, "amax_group_size", op)
    if gate.shape != up.shape:
        raise RuntimeError(f"{op}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return (
        gate.new_empty(gate.shape, dtype=fp8_dtype),
        gate.new_empty((), dtype=torch.float32),
        _transposed(gate, fp8_dtype, transpose),
        _saved_codes(gate, saved),
        _grouped(gate, save_group_size),
        _saved_codes(gate, saved),
        _grouped(gate, save_group_size),
    )


@torch.library.register_fake("coat::silu_mul_backward")
def _silu_mul_backward_fake(dy, gate_saved, gate_scales, up_saved, up_scales, smooth_scale, save_group_size,
                            saved_format="e4m3", activation="silu"):
    _saved_format_name(saved_format, "saved_format", "coat.silu_mul_backward")
    _checked_activation(activation, "coat.silu_mul_backward", RuntimeError)
    _check_named_group_size(save_group_size, "save_group_size", "coat.silu_mul_backward")
    return dy.new_empty(dy.shape), dy.new_empty(dy.shape), dy.new_empty((), dtype=torch.float32)


@torch.library.register_fake("coat::rmsnorm_requantize")
def _rmsnorm_requantize_fake(x_saved, x_saved_scales, rstd, weight, y_scale, save_group_size, fp8_dtype,
                             saved_format="e4m3", weight_offset=0.0):
    op = "coat.rmsnorm_requantize"
    _saved_format_name(saved_format, "saved_format", op)
    _check_named_group_size(save_group_size, "save_group_size", op)
    _check_rmsnorm_cols(weight, "weight", op)
    return x_saved.new_empty((weight.shape[0], math.prod(x_saved.shape[:-1])), dtype=fp8_dtype)


@torch.library.register_fake("coat::silu_mul_requantize")
def _silu_mul_requantize_fake(gate_saved, gate_scales, up_saved, up_scales, smooth_scale, y_scale, save_group_size,
                              fp8_dtype, saved_format="e4m3", cols=None, activation="silu"):
    op = "coat.silu_mul_requantize"
    _checked_activation(activation, op, RuntimeError)
    _check_named_group_size(save_group_size, "save_group_size", op)
    if up_saved.shape != gate_saved.shape:
        raise RuntimeError(f"{op}: up_saved has shape {tuple(up_saved.shape)} but gate_saved has shape "
                           f"{tuple(gate_saved.shape)}; pass the tensors the forward op returned")
    saved = _saved_format_name(saved_format, "saved_format", op)
    packed = saved != "e4m3"
    if packed and cols is None:
        raise RuntimeError(f"{op}: with saved_format='{saved}' pass cols, the width of gate and up")
    width = cols if packed else gate_saved.shape[-1]
    return gate_saved.new_empty((width, math.prod(gate_saved.shape[:-1])), dtype=fp8_dtype)


# ------------------------------------------------------------------------------------------------------
# Rotary position embedding (csrc/include/coat/rope.h states the formulas, layouts and limits).

ROPE_MAX_HEAD_DIM = 1024


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k in one kernel, in transformers' rotate_half convention. With h = D / 2, per row x of
    q or k and the tables c = cos[b, s], s = sin[b, s] of its position::

        forward:  out[j] = x[j]*c[j] - x[j+h]*s[j]   (j < h),   x[j]*c[j] + x[j-h]*s[j]   (j >= h)
        inverse:  out[j] = x[j]*c[j] + x[j+h]*s[j+h] (j < h),   x[j]*c[j] - x[j-h]*s[j-h] (j >= h)

    The forward is ``x * cos + rotate_half(x) * sin`` (transformers' ``apply_rotary_pos_emb`` with q, k laid
    out [B, S, H, D]); ``inverse=True`` is its adjoint for any tables, i.e. the backward: given the gradients
    of the outputs it returns those of q and k. Computed in float32 (each product, then the sum, rounded to
    float32, no FMA) and rounded once to the output dtype: on float32 inputs the bits of PyTorch's eager
    formula. NaN and Inf propagate as the formula says (Inf * 0 and Inf - Inf give NaN).

    q: [B, S, Hq, D], k: [B, S, Hk, D] (Hq may differ from Hk), both float32, bfloat16 or float16 of one
    dtype, D even and at most 1024. cos, sin: [B or 1, S, D] (what transformers' rotary embedding returns;
    batch 1 broadcasts), float32 / bfloat16 / float16, possibly another dtype than q's. Every tensor needs a
    contiguous last dimension; any other strides are read in place, e.g. q and k as column slices of one
    [B*S, (Hq + 2 Hk) * D] GEMM output viewed as [B, S, H, D]. Returns contiguous (q_out, k_out) of q's and
    k's shapes in q's dtype.
    """
    check_device_supported(q, "coat.ops.rotary_embedding")
    return torch.ops.coat.rotary_embedding(q, k, cos, sin, inverse)


@torch.library.register_fake("coat::rotary_embedding")
def _rotary_embedding_fake(q, k, cos, sin, inverse=False):
    op = "coat.rotary_embedding"
    if q.dim() != 4 or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise RuntimeError(f"{op}: q and k must be [batch, seq, heads, head_dim] with the same batch, seq and "
                           f"head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    head_dim = q.shape[3]
    if head_dim % 2 != 0 or not 2 <= head_dim <= ROPE_MAX_HEAD_DIM:
        raise RuntimeError(f"{op}: head_dim (the last dimension of q and k) must be even and between 2 and "
                           f"{ROPE_MAX_HEAD_DIM}, got {head_dim}")
    return q.new_empty(q.shape), k.new_empty(k.shape)


# ------------------------------------------------------------------------------------------------------
# Quantization statistics, what coat.report measures (csrc/include/coat/stats.h states the sums and their order).

QUANTIZATION_SUMS = ("numel", "nonfinite", "flushed", "saturated", "error_sq", "value_sq", "amax")


def quantization_sums_(
    sums: Sequence[torch.Tensor],
    x: Sequence[torch.Tensor],
    q: Sequence[torch.Tensor],
    scale: Sequence[torch.Tensor],
    group_size: Sequence[int | None],
    rows: Sequence[torch.Tensor | None],
    *,
    x_holds_measured_rows: Sequence[bool],
    amax_per_scale: Sequence[float],
) -> None:
    """Adds what quantizing each ``x[i]`` to the FP8 codes ``q[i]`` did into ``sums[i]``, a float64 tensor of 7
    (zeros to start; one per tensor, so that several recordings add up), in the order of
    :data:`QUANTIZATION_SUMS`. Every argument holds one entry per measured tensor. ``scale[i]`` is the
    quantizer's: one per-tensor scale (``group_size[i]`` None), or one per 1 x ``group_size[i]`` group of q.
    Measured are the ``rows[i]`` of q (int64 row indices; every row when None) and of x, or, with
    ``x_holds_measured_rows[i]``, x is those rows alone. Per measured element, with Q(x) = fp8_decode(q) * scale
    in float32:

        nonfinite   Q(x) - x is NaN or +-Inf; such elements count in no other sum
        flushed     Q(x) == 0 and x != 0
        saturated   |x / scale| >= FP8_MAX + half its top step (464 E4M3, 61440 E5M2)
        error_sq    (Q(x) - x)^2 and value_sq x^2, in float64

    summed by one fixed pairwise tree, so CPU and CUDA give the same bits. numel adds the measured elements;
    amax becomes the max of itself and max |x| over the measured finite elements, or, with
    ``amax_per_scale[i]`` > 0, ``amax_per_scale[i] * max(scale[i])`` (FP8_MAX for FP8 scales: the whole
    tensor's amax from its scales). A NaN or Inf scale makes its elements nonfinite (and amax NaN or Inf when
    taken from the scales); a row index outside q makes every sum but numel NaN. x and q are 2-D, any strides.

    The tensors are measured in list order, with the same bits as one call per tensor; several may add into
    the same ``sums`` tensor (e.g. the q, k and v projections into one row). All on one device; on a GPU a call
    is one memset and one kernel launch (one per 24 tensors for more), with no synchronization. Empty lists do
    nothing."""
    if q:
        check_device_supported(q[0], "coat.ops.quantization_sums_")
    torch.ops.coat.quantization_sums_(
        list(sums), list(x), list(q), list(scale), [0 if g is None else g for g in group_size], list(rows),
        list(x_holds_measured_rows), list(amax_per_scale),
    )


@torch.library.register_fake("coat::quantization_sums_")
def _quantization_sums_fake(sums, x, q, scale, group_size, rows, x_holds_measured_rows, amax_per_scale):
    op = "coat.quantization_sums_"
    lists = dict(sums=sums, x=x, q=q, scale=scale, group_size=group_size, rows=rows,
                 x_holds_measured_rows=x_holds_measured_rows, amax_per_scale=amax_per_scale)
    if len({len(values) for values in lists.values()}) > 1:
        counts = ", ".join(f"{len(values)} {name}" for name, values in lists.items())
        raise RuntimeError(f"{op}: every list needs one entry per measured tensor, got {counts}")
    for i, g in enumerate(group_size):
        if g != 0:
            _check_group_size(g, op if len(q) == 1 else f"{op}: measure {i}")


# ------------------------------------------------------------------------------------------------------
# Softmax cross-entropy with its gradient in place (csrc/include/coat/cross_entropy.h states the formulas).

CROSS_ENTROPY_MAX_V = 1073741824


def check_labels(labels: torch.Tensor, vocab: int, ignore_index: int, op: str) -> None:
    """Refuses labels outside [0, vocab) that are not ignore_index, naming the first. It reads the labels (one
    device synchronization on a GPU), so it runs in eager mode only; under torch.compile such a label gives its
    row NaN loss and gradient instead."""
    if torch.compiler.is_compiling():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise ValueError(f"{op}: label {first} is outside the vocabulary [0, {vocab}) and is not ignore_index "
                         f"({ignore_index}); fix the labels or pass the ignore_index they use")


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token softmax cross-entropy over the last dimension of ``logits``, and, with ``grad_scale``, its
    gradient written over ``logits`` (which saves a tensor of the logits' size). Per row z with label y::

        z'    = softcap * tanh(z / softcap)         (soft-capping, when softcap is given; else z' = z)
        lse   = log sum_j exp(z'_j)
        loss  = (1 - eps) (lse - z'_y) + eps (lse - mean_j z'_j) + z_loss * lse**2
        dz    = grad_scale * (softmax(z') (1 + 2 z_loss lse) - (1 - eps) onehot(y) - eps / V) * (1 - (z'/softcap)**2)

    eps = label_smoothing; the loss is torch.nn.functional.cross_entropy(..., reduction="none",
    label_smoothing=eps) plus the z-loss. Rows labelled ``ignore_index`` get loss 0 and a zero gradient (their
    lse is still given). Returns float32 ``(loss, lse)`` of labels' shape.

    logits: float32, bfloat16 or float16 [..., V], last dimension contiguous, 1 <= V <= 2**30; labels: int64 of
    logits' shape without V, contiguous. A label outside [0, V) that is not ignore_index raises a ValueError (in
    eager mode; see :func:`check_labels`). grad_scale: None (logits are only read), or float32 holding one scale
    for every row or one per row, e.g. ``grad_output / n_tokens`` for a mean. NaN and Inf logits follow the
    formula (csrc/include/coat/cross_entropy.h). The CPU core reduces each row in double, the CUDA kernel in
    float32; they agree within float32 rounding, not bit for bit.
    """
    check_device_supported(logits, "coat.ops.cross_entropy")
    check_labels(labels, logits.shape[-1], ignore_index, "coat.ops.cross_entropy")
    return torch.ops.coat.cross_entropy(
        logits, labels, grad_scale, ignore_index, label_smoothing, 0.0 if softcap is None else softcap, z_loss
    )


@torch.library.register_fake("coat::cross_entropy")
def _cross_entropy_fake(logits, labels, grad_scale, ignore_index, label_smoothing, softcap, z_loss):
    op = "coat.cross_entropy"
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise RuntimeError(f"{op}: labels must have the shape of logits without its last dimension, "
                           f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    if labels.dtype != torch.long:
        raise RuntimeError(f"{op}: labels must be int64 (torch.long), got {labels.dtype}; convert them with .long()")
    return labels.new_empty(labels.shape, dtype=torch.float32), labels.new_empty(labels.shape, dtype=torch.float32)


# The ops of coat/norm_ops.py and coat/adamw_ops.py, re-exported here.
from coat.adamw_ops import (  # noqa: E402,F401
    MOMENT_STATS, adamw_scalars, dequantize_expanded, fp8_adamw_step, moment_stats, quantize_expanded,
)
from coat.norm_ops import QK_NORM_MAX_HEAD_DIM, qk_norm_rope, rmsnorm_save  # noqa: E402,F401
