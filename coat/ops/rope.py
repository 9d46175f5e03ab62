"""Rotary position embedding, alone or fused with the per-head RMSNorm of q and k (Qwen3's and Gemma 3's q_norm /
k_norm); csrc/include/coat/rope.h states the formulas, layouts and limits."""
from __future__ import annotations

import math

import torch

from coat._native import check_device_supported
from coat.ops._checks import check_group_size, grouped

__all__ = ["ROPE_MAX_HEAD_DIM", "rotary_embedding", "QK_NORM_MAX_HEAD_DIM", "qk_norm_rope"]

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
    check_group_size(save_group_size, op, "save_group_size")
    if q.shape[3] > QK_NORM_MAX_HEAD_DIM:
        raise RuntimeError(f"{op}: head_dim (the last dimension of q and k) must be even and between 2 and "
                           f"{QK_NORM_MAX_HEAD_DIM}, got {q.shape[3]}")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight.shape != (q.shape[3],):
            raise RuntimeError(f"{op}: {name} must be a contiguous [{q.shape[3]}] tensor (head_dim), got shape "
                               f"{tuple(weight.shape)}")
    outputs = []
    for x in (q, k):
        outputs.append((x.new_empty(x.shape, dtype=torch.float8_e4m3fn), grouped(x, save_group_size),
                        x.new_empty((math.prod(x.shape[:3]),), dtype=torch.float32)))
    return (q.new_empty(q.shape), k.new_empty(k.shape), *outputs[0], *outputs[1])
