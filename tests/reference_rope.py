"""float64 oracles of coat's rotary position embedding (coat.ops.rotary_embedding), written from the formulas
of RoPE in transformers' rotate_half convention (Su et al. 2021; transformers' apply_rotary_pos_emb), not from
the kernels.

q, k are [B, S, H, D] and the tables [B or 1, S, D]; with h = D / 2 and x1, x2 the halves of a row:

    forward:  (x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2)
    inverse:  (x1 * c1 + x2 * s2,  x2 * c2 - x1 * s1)      the adjoint of the forward, for any tables
"""
from __future__ import annotations

import torch


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of x [B, S, H, D] in float64, tables [B or 1, S, D] broadcast over heads."""
    x1, x2 = _halves(x.double())
    c1, c2 = _halves(cos.double().unsqueeze(2))
    s1, s2 = _halves(sin.double().unsqueeze(2))
    if inverse:
        return torch.cat([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], dim=-1)
    return torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1)."""
    x1, x2 = _halves(x)
    return torch.cat((-x2, x1), dim=-1)


def eager_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' formula, x * cos + rotate_half(x) * sin, in x's dtype (the tables cast to it, as
    transformers' rotary embedding returns them), for x [B, S, H, D]: the computation PyTorch runs today."""
    cos, sin = cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 weight_offset: float = 0.0):
    """Qwen3's (weight_offset 0) or Gemma 3's (1) RoPE(q_norm(x)) in float64, x [B, S, H, D]: RMSNorm over D,
    rstd = 1 / sqrt(mean(x^2) + eps), times weight + weight_offset, then :func:`rotary_embedding`.
    Returns (out, rstd [B * S * H]); differentiable."""
    x = x.double()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return rotary_embedding(x * rstd * (weight.double() + weight_offset), cos, sin), rstd.reshape(-1)
