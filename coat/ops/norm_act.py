"""The fused non-linear layers: RMSNorm and SiLU*mul (or GeGLU's gelu_tanh*mul, or a non-gated MLP's activation)
with FP8 outputs and FP8-saved inputs, and RMSNorm with a high-precision output (csrc/include/coat/norm_act.h states
every formula, layout and reduction order).

Forward: y is written in FP8 with one per-tensor scale, computed by group scaling inside the kernel that
computes y; y_scale = max(amax(y) / FP8_MAX, 2**-126) and y is bit for bit quantize_tensor of the fp32
result. The op's inputs are saved for backward as FP8 E4M3 with 1 x save_group_size groups, bit for bit
quantize_group of the inputs (or as FP4 / FP6 blocks, ``save_format``). Every NaN code the fused ops write is the
positive NaN (0x7F).
Backward: reads only what the forward saved (plus dy) and returns gradients in dy's dtype (rmsnorm_backward's
dx in the residual's dtype when it adds one).
Requantize: recomputes the forward's y_t in backward from what the forward saved and its y_scale, so that a
layer need not keep y_t between forward and backward.
CPU and CUDA give the same bits: every sum has a fixed reduction order.

Every norm op takes ``weight_offset``: the norm multiplies by ``weight + weight_offset`` (float32), 0 for
Llama-style norms and 1 for Gemma's ``(1 + weight)``.
"""
from __future__ import annotations

import math

import torch

from coat._native import check_device_supported
from coat.ops._checks import check_group_size, fp8_dtype, grouped, packed_row_bytes, transposed

__all__ = [
    "RMSNORM_MAX_COLS", "SAVED_FORMATS", "ACTIVATIONS", "rmsnorm_quantize", "rmsnorm_backward", "silu_mul_quantize",
    "silu_mul_backward", "rmsnorm_requantize", "silu_mul_requantize", "rmsnorm_save",
]

RMSNORM_MAX_COLS = 32768

SAVED_FORMATS = ("e4m3", "fp4", "fp6")
#: The activations of silu_mul_quantize / _backward / _requantize: SwiGLU's, GeGLU's and CLIP's quick_gelu.
ACTIVATIONS = ("silu", "gelu_tanh", "quick_gelu")


def _checked_saved_format(format: str, name: str, op: str) -> str:
    """A forward op's ``save_format`` (or the ``saved_format`` a backward op reads), checked before the native op."""
    if format not in SAVED_FORMATS:
        raise ValueError(f"coat.ops.{op}: {name} must be 'e4m3', 'fp4' or 'fp6', got {format!r}")
    return format


def _checked_activation(activation: str, op: str, error: type[Exception] = ValueError) -> str:
    """The ``activation`` of the act*mul ops (ValueError before the native op, RuntimeError in the fakes)."""
    if activation not in ACTIVATIONS:
        raise error(f"{op}: activation must be 'silu' (SwiGLU), 'gelu_tanh' (GeGLU, gelu(approximate='tanh')) or "
                    f"'quick_gelu' (x * sigmoid(1.702 x)), got {activation!r}")
    return activation


def _given_or_none(t: torch.Tensor, given) -> torch.Tensor | None:
    """An output of a non-gated op (no up) that only the gated op has: the native op's empty tensor, as None."""
    return t if given is not None else None


def _saved_format_name(format: str, name: str, op: str) -> str:
    """The fake ops' check of the native ops' format argument, with their message."""
    if format not in SAVED_FORMATS:
        raise RuntimeError(f"{op}: {name} must be 'e4m3', 'fp4' or 'fp6', got '{format}'")
    return format


def _saved_codes(x: torch.Tensor, format: str) -> torch.Tensor:
    if format == "e4m3":
        return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return x.new_empty((*x.shape[:-1], packed_row_bytes(x.shape[-1], format)), dtype=torch.uint8)


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
    up: torch.Tensor | None,
    smooth_scale: torch.Tensor | None = None,
    *,
    save_group_size: int = 16,
    amax_group_size: int = 128,
    format: torch.dtype | str = "e4m3",
    transpose: bool = False,
    save_format: str = "e4m3",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None,
           torch.Tensor | None]:
    """A gated MLP's activation, ``y = act(gate) * up [* smooth_scale]``, quantized to FP8 per tensor, with
    gate and up saved in FP8 for backward: SwiGLU with ``activation="silu"``, GeGLU with ``"gelu_tanh"``.
    With ``up=None``, a non-gated MLP's activation ``y = act(gate) [* smooth_scale]`` (CLIP's quick_gelu,
    SigLIP's and Qwen3-VL's gelu_tanh), every formula here and in the backward and requantize ops reading up as 1.

    ``gate``, ``up``: same shape [..., I] and dtype (float32 / bfloat16 / float16), contiguous last
    dimension; row-strided views such as the two halves of one [..., 2I] GEMM output are read in place.
    ``smooth_scale``: optional float32 [I], the Smooth-SwiGLU per-channel scale (Fishman et al., 2024):
    y is multiplied by it before quantization and the caller folds 1 / smooth_scale into the next layer.
    ``activation``: ``"silu"``, silu(g) = g * sigmoid(g), or ``"gelu_tanh"``, 0.5 g (1 + tanh(sqrt(2/pi)
    (g + 0.044715 g^3))) (torch's ``gelu(approximate="tanh")``, transformers' ``gelu_pytorch_tanh``), computed as
    g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), or ``"quick_gelu"``, g * sigmoid(1.702 g) (transformers'
    ``quick_gelu``), all in float32 with coat's own exp (identical on CPU and CUDA).
    All give +inf at +inf, NaN at -inf (-inf * 0, as torch) and NaN at NaN; never NaN for a finite gate.

    Returns ``(y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales)`` as in
    :func:`rmsnorm_quantize`, gate and up saved in ``save_format`` ("e4m3", "fp4" or "fp6") likewise; up_saved
    and up_scales are None without up.
    """
    check_device_supported(gate, "coat.ops.silu_mul_quantize")
    y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales = torch.ops.coat.silu_mul_quantize(
        gate, up, smooth_scale, save_group_size, amax_group_size, fp8_dtype(format), transpose,
        _checked_saved_format(save_format, "save_format", "silu_mul_quantize"),
        _checked_activation(activation, "coat.ops.silu_mul_quantize"),
    )
    return (y, y_scale, y_t if transpose else None, gate_saved, gate_scales, _given_or_none(up_saved, up),
            _given_or_none(up_scales, up))


def silu_mul_backward(
    dy: torch.Tensor,
    gate_saved: torch.Tensor,
    gate_scales: torch.Tensor,
    up_saved: torch.Tensor | None,
    up_scales: torch.Tensor | None,
    smooth_scale: torch.Tensor | None = None,
    save_group_size: int = 16,
    *,
    saved_format: str = "e4m3",
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Gradients ``(dgate, dup, d_amax)`` of :func:`silu_mul_quantize`, dgate and dup in dy's dtype, from the
    dequantized saved inputs g and u, for the forward's ``activation``: with dy_s = dy * smooth_scale (or dy)::

        dup   = dy_s * act(g)
        dgate = dy_s * u * act'(g)
        silu'(g)       = s * (1 + g * (1 - s)),                         s = sigmoid(g)
        gelu_tanh'(g)  = 0.5 (1 + t) + 0.5 g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2),
                         t = tanh(sqrt(2/pi) (g + 0.044715 g^3))
        quick_gelu'(g) = s * (1 + 1.702 g (1 - s)),                     s = sigmoid(1.702 g)

    gelu_tanh' and quick_gelu' are finite for every finite g (torch's float32 gelu backward is NaN from |g| ~
    1.8e19 on) and are 1 at +inf, 0 at -inf; silu' is NaN at +-inf. For the non-gated op (its forward had no up)
    pass ``up_saved=None, up_scales=None``: u = 1, and dup is None.

    ``d_amax`` (0-d float32) is the largest |dgate| and |dup|, NaN ignored: :func:`tensor_amax` of the two,
    computed in the same pass, which :func:`quantize_tensors` takes as ``amax`` to quantize both gradients with
    one scale. ``saved_format``: the forward's ``save_format``, read as in :func:`rmsnorm_backward`."""
    check_device_supported(dy, "coat.ops.silu_mul_backward")
    dgate, dup, d_amax = torch.ops.coat.silu_mul_backward(
        dy, gate_saved, gate_scales, up_saved, up_scales, smooth_scale, save_group_size,
        _checked_saved_format(saved_format, "saved_format", "silu_mul_backward"),
        _checked_activation(activation, "coat.ops.silu_mul_backward"),
    )
    return dgate, _given_or_none(dup, up_saved), d_amax


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
    up_saved: torch.Tensor | None,
    up_scales: torch.Tensor | None,
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
    rows do not tell every width from the next. The non-gated op's: ``up_saved=None, up_scales=None`` (u' = 1)."""
    check_device_supported(gate_saved, "coat.ops.silu_mul_requantize")
    return torch.ops.coat.silu_mul_requantize(
        gate_saved, gate_scales, up_saved, up_scales, smooth_scale, y_scale, save_group_size, fp8_dtype(format),
        _checked_saved_format(saved_format, "saved_format", "silu_mul_requantize"), cols,
        _checked_activation(activation, "coat.ops.silu_mul_requantize"),
    )


def rmsnorm_save(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    save_group_size: int = 16,
    save_format: str = "e4m3",
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm whose output stays in high precision while its input is saved in FP8 for backward: for norms whose
    output is no GEMM input (OLMo 2's and Gemma 3's post-norms, OLMo 2's q/k norms). One pass over x::

        rstd = 1 / sqrt(mean(x^2) + eps)                  float32, as rmsnorm_quantize
        out  = ((x * rstd) * (weight + weight_offset)).to(x.dtype)              float32, rounded once
        out  = residual + that                            with ``residual``: added in float32, rounded once to its dtype

    which is OLMo2RMSNorm / Gemma3RMSNorm (``weight_offset=1``), and with a residual torch's ``residual + norm(x)``.
    ``residual``: x's shape, contiguous (float32 / bfloat16 / float16); the output then has its dtype.
    Returns ``(out, x_saved, x_saved_scales, rstd)``; the last three are bit for bit what :func:`rmsnorm_quantize`
    saves (``save_format`` as there), so :func:`rmsnorm_backward` with the same ``weight_offset`` is the backward.
    A row holding +-Inf gives NaN at the Inf and 0 elsewhere; NaN is stored canonically.
    """
    check_device_supported(x, "coat.ops.rmsnorm_save")
    return torch.ops.coat.rmsnorm_save(
        x, weight, eps, save_group_size, residual, _checked_saved_format(save_format, "save_format", "rmsnorm_save"),
        weight_offset,
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
    check_group_size(save_group_size, op, "save_group_size")
    check_group_size(amax_group_size, op, "amax_group_size")
    _check_rmsnorm_cols(x, "x", op)
    return (
        x.new_empty(x.shape, dtype=fp8_dtype),
        x.new_empty((), dtype=torch.float32),
        transposed(x, fp8_dtype, transpose),
        _saved_codes(x, saved),
        grouped(x, save_group_size),
        x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32),
    )


@torch.library.register_fake("coat::rmsnorm_backward")
def _rmsnorm_backward_fake(dy, x_saved, x_saved_scales, rstd, weight, save_group_size, residual=None,
                           saved_format="e4m3", weight_offset=0.0):
    op = "coat.rmsnorm_backward"
    _saved_format_name(saved_format, "saved_format", op)
    check_group_size(save_group_size, op, "save_group_size")
    _check_rmsnorm_cols(dy, "dy", op)
    if residual is not None and residual.shape != dy.shape:
        raise RuntimeError(
            f"{op}: residual has shape {tuple(residual.shape)} but dy has shape {tuple(dy.shape)}; "
            "it must have dy's shape"
        )
    dx_dtype = dy.dtype if residual is None else residual.dtype
    return dy.new_empty(dy.shape, dtype=dx_dtype), dy.new_empty((dy.shape[-1],), dtype=torch.float32)


def _absent(like: torch.Tensor) -> torch.Tensor:
    """The native non-gated forward's up_saved and up_scales: an empty float32 tensor."""
    return like.new_empty((0,), dtype=torch.float32)


def _check_saved_up_pair(up_saved, up_scales, op: str) -> bool:
    if (up_saved is None) != (up_scales is None):
        raise RuntimeError(f"{op}: pass both up_saved and up_scales (the gated op's) or neither (the non-gated op's, "
                           "whose forward had no up)")
    return up_saved is not None


@torch.library.register_fake("coat::silu_mul_quantize")
def _silu_mul_quantize_fake(gate, up, smooth_scale, save_group_size, amax_group_size, fp8_dtype, transpose,
                            save_format="e4m3", activation="silu"):
    op = "coat.silu_mul_quantize"
    saved = _saved_format_name(save_format, "save_format", op)
    _checked_activation(activation, op, RuntimeError)
    check_group_size(save_group_size, op, "save_group_size")
    check_group_size(amax_group_size, op, "amax_group_size")
    if up is not None and gate.shape != up.shape:
        raise RuntimeError(f"{op}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return (
        gate.new_empty(gate.shape, dtype=fp8_dtype),
        gate.new_empty((), dtype=torch.float32),
        transposed(gate, fp8_dtype, transpose),
        _saved_codes(gate, saved),
        grouped(gate, save_group_size),
        _saved_codes(gate, saved) if up is not None else _absent(gate),
        grouped(gate, save_group_size) if up is not None else _absent(gate),
    )


@torch.library.register_fake("coat::silu_mul_backward")
def _silu_mul_backward_fake(dy, gate_saved, gate_scales, up_saved, up_scales, smooth_scale, save_group_size,
                            saved_format="e4m3", activation="silu"):
    _saved_format_name(saved_format, "saved_format", "coat.silu_mul_backward")
    _checked_activation(activation, "coat.silu_mul_backward", RuntimeError)
    check_group_size(save_group_size, "coat.silu_mul_backward", "save_group_size")
    gated = _check_saved_up_pair(up_saved, up_scales, "coat.silu_mul_backward")
    return (dy.new_empty(dy.shape), dy.new_empty(dy.shape if gated else (0,)),
            dy.new_empty((), dtype=torch.float32))


@torch.library.register_fake("coat::rmsnorm_requantize")
def _rmsnorm_requantize_fake(x_saved, x_saved_scales, rstd, weight, y_scale, save_group_size, fp8_dtype,
                             saved_format="e4m3", weight_offset=0.0):
    op = "coat.rmsnorm_requantize"
    _saved_format_name(saved_format, "saved_format", op)
    check_group_size(save_group_size, op, "save_group_size")
    _check_rmsnorm_cols(weight, "weight", op)
    return x_saved.new_empty((weight.shape[0], math.prod(x_saved.shape[:-1])), dtype=fp8_dtype)


@torch.library.register_fake("coat::silu_mul_requantize")
def _silu_mul_requantize_fake(gate_saved, gate_scales, up_saved, up_scales, smooth_scale, y_scale, save_group_size,
                              fp8_dtype, saved_format="e4m3", cols=None, activation="silu"):
    op = "coat.silu_mul_requantize"
    _checked_activation(activation, op, RuntimeError)
    check_group_size(save_group_size, op, "save_group_size")
    if _check_saved_up_pair(up_saved, up_scales, op) and up_saved.shape != gate_saved.shape:
        raise RuntimeError(f"{op}: up_saved has shape {tuple(up_saved.shape)} but gate_saved has shape "
                           f"{tuple(gate_saved.shape)}; pass the tensors the forward op returned")
    saved = _saved_format_name(saved_format, "saved_format", op)
    packed = saved != "e4m3"
    if packed and cols is None:
        raise RuntimeError(f"{op}: with saved_format='{saved}' pass cols, the width of gate and up")
    width = cols if packed else gate_saved.shape[-1]
    return gate_saved.new_empty((width, math.prod(gate_saved.shape[:-1])), dtype=fp8_dtype)


@torch.library.register_fake("coat::rmsnorm_save")
def _rmsnorm_save_fake(x, weight, eps, save_group_size, residual=None, save_format="e4m3", weight_offset=0.0):
    op = "coat.rmsnorm_save"
    saved = _saved_format_name(save_format, "save_format", op)
    check_group_size(save_group_size, op, "save_group_size")
    _check_rmsnorm_cols(x, "x", op)
    if residual is not None and residual.shape != x.shape:
        raise RuntimeError(f"{op}: residual has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}; "
                           "it must have x's shape")
    return (
        x.new_empty(x.shape, dtype=x.dtype if residual is None else residual.dtype),
        _saved_codes(x, saved),
        grouped(x, save_group_size),
        x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32),
    )
