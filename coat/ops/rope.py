"""Norm ops beside coat.ops (which re-exports them): RMSNorm with a high-precision output (post-norms, OLMo 2's q/k
norms) and the per-head q/k RMSNorm fused with RoPE.

They take ``weight_offset`` as the RMSNorm ops of coat.ops do: the norm multiplies by ``weight + weight_offset``
(float32), 0 for Llama-style norms and 1 for Gemma's ``(1 + weight)``.
"""

from __future__ import annotations

import math

import torch

from coat._native import check_device_supported
from coat.ops import (
    _check_named_group_size,
    _check_rmsnorm_cols,
    _checked_saved_format,
    _grouped,
    _rotary_embedding_fake,
    _saved_codes,
    _saved_format_name,
)


# RMSNorm with its output in high precision (csrc/include/coat/norm_act.h's coat_rmsnorm_save).


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


@torch.library.register_fake("coat::rmsnorm_save")
def _rmsnorm_save_fake(x, weight, eps, save_group_size, residual=None, save_format="e4m3", weight_offset=0.0):
    op = "coat.rmsnorm_save"
    saved = _saved_format_name(save_format, "save_format", op)
    _check_named_group_size(save_group_size, "save_group_size", op)
    _check_rmsnorm_cols(x, "x", op)
    if residual is not None and residual.shape != x.shape:
        raise RuntimeError(f"{op}: residual has shape {tuple(residual.shape)} but x has shape {tuple(x.shape)}; "
                           "it must have x's shape")
    return (
        x.new_empty(x.shape, dtype=x.dtype if residual is None else residual.dtype),
        _saved_codes(x, saved),
        _grouped(x, save_group_size),
        x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32),
    )


# Per-head RMSNorm of q and k fused with RoPE (Qwen3's and Gemma 3's q_norm / k_norm; csrc/include/coat/rope.h).

QK_NORM_MAX_HEAD_DIM = 256


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, save_group_size: int = 16, *, weight_offset: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """RMSNorm of every head row of q and k over head_dim (weights ``q_weight`` / ``k_weight`` [D]), then RoPE as
    :func:`rotary_embedding` computes it, in one kernel, with the norm's input saved for backward. Per row x::

        rstd = 1 / sqrt(mean(x^2) + eps)                 float32, the sum in coat's RMSNorm reduction order
        n    = (x * rstd) * (weight + weight_offset)     float32 (weight_offset: 1 for Gemma 3, else 0)
        out  = RoPE(n)                                   float32, rounded once to q's dtype

    q, k, cos, sin: as for :func:`rotary_embedding` (any row strides, D even, at most 256). Returns
    ``(q_out, k_out, q_saved, q_saved_scales, q_rstd, k_saved, k_saved_scales, k_rstd)``: the contiguous outputs
    in q's dtype; the inputs as E4M3 codes of their shapes with one float32 scale per 1 x ``save_group_size``
    group ([B, S, H, ceil(D / G)]), bit for bit :func:`quantize_group` of each; and rstd per (b, s, head) row
    ([B * S * H] float32). The saved tensors are what :func:`rmsnorm_backward` reads for the gradient of the norm:
    the backward is ``rotary_embedding(..., inverse=True)`` then ``rmsnorm_backward`` with the same
    ``weight_offset``."""
    check_device_supported(q, "coat.ops.qk_norm_rope")
    return torch.ops.coat.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin, save_group_size, weight_offset)


@torch.library.register_fake("coat::qk_norm_rope")
def _qk_norm_rope_fake(q, k, q_weight, k_weight, eps, cos, sin, save_group_size, weight_offset=0.0):
    op = "coat.qk_norm_rope"
    _rotary_embedding_fake(q, k, cos, sin)
    _check_named_group_size(save_group_size, "save_group_size", op)
    if q.shape[3] > QK_NORM_MAX_HEAD_DIM:
        raise RuntimeError(f"{op}: head_dim (the last dimension of q and k) must be even and between 2 and "
                           f"{QK_NORM_MAX_HEAD_DIM}, got {q.shape[3]}")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.shape != (q.shape[3],):
            raise RuntimeError(f"{op}: {name} must be a contiguous [{q.shape[3]}] tensor (head_dim), got shape "
                               f"{tuple(weight.shape)}")
    outputs = []
    for x in (q, k):
        outputs.append((x.new_empty(x.shape, dtype=torch.float8_e4m3fn), _grouped(x, save_group_size),
                        x.new_empty((math.prod(x.shape[:3]),), dtype=torch.float32)))
    return (q.new_empty(q.shape), k.new_empty(k.shape), *outputs[0], *outputs[1])
