"""Independent float64 oracle for coat's FP8 AdamW with dynamic range expansion, in plain PyTorch, written
from the COAT paper (section 4.2, appendices A and G.4) and the numerics stated in csrc/include/coat/adamw.h,
not from the C or CUDA code.

A state tensor is viewed as rows x cols (cols = last dimension) and cut into 1 x G groups along each row,
the last one possibly short. Per group, over its finite elements:

    amax = max |x|,  amin = min |x| over x != 0
    C = sqrt(amin * amax)                   stored rounded to bf16 (nearest even)
    k = log(R_fmt) / log(amax / amin)       clamped to [K_MIN, K_MAX], 1 when amax == amin, stored as bf16
    R_fmt = FP8_MAX / FP8_MIN_SUBNORMAL     E4M3: 448 * 2^9, E5M2: 57344 * 2^16
    y = sign(x) * (|x| / C)^k               with the stored C and k
    scale = max(max|y| / FP8_MAX, 2^-126)   stored rounded up to bf16
    code = fp8(y / scale)                   round to nearest even, saturating; a nonzero x whose code would
                                            be +-0 gets the smallest subnormal code of its sign instead
    x' = sign(code) * C * (|fp8(code)| * scale)^(1/k)

k = 1 and C = 1 (no expansion, y = x) when expansion is off, when the group has no nonzero finite element,
and when C is not a normal bf16 number. Non-finite elements take no part in the statistics and encode as
the positive NaN code. Everything here is float64; the kernels compute in fp32, so results agree to rounding, not bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    dtype: torch.dtype
    max: float
    min_subnormal: float
    mantissa_bits: int
    min_normal_exponent: int

    @property
    def log2_range(self) -> float:
        return math.log2(self.max / self.min_subnormal)


E4M3 = Format(torch.float8_e4m3fn, 448.0, 2.0**-9, 3, -6)
E5M2 = Format(torch.float8_e5m2, 57344.0, 2.0**-16, 2, -14)
FORMATS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}

NAN_CODE = 0x7F  # positive NaN in both formats
K_MIN = 0.5
K_MAX = 64.0
MIN_SCALE = 2.0**-126
BF16_MAX = float.fromhex("0x1.fep127")


def round_bf16(x: torch.Tensor, up: bool = False) -> torch.Tensor:
    """Positive float64 values rounded to the bf16 grid (8 significant bits): nearest even, or up. Valid in
    bf16's normal range, the only one meta values are stored in."""
    mantissa, exponent = torch.frexp(x)
    steps = mantissa * 256.0
    steps = torch.ceil(steps) if up else torch.round(steps)
    return torch.ldexp(steps, exponent - 8)


def round_fp8(v: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float64 -> the nearest value of the FP8 grid (ties to even), saturating at +-FP8_MAX; nonzero values
    that round to 0 go to +-FP8_MIN_SUBNORMAL instead."""
    a = v.abs()
    _, exponent = torch.frexp(a)  # a = m * 2^exponent, m in [0.5, 1): leading bit 2^(exponent - 1)
    quantum_exponent = torch.clamp(exponent - 1, min=fmt.min_normal_exponent) - fmt.mantissa_bits
    quantum = torch.ldexp(torch.ones_like(a), quantum_exponent)
    r = torch.clamp(torch.round(a / quantum) * quantum, max=fmt.max)
    r = torch.where((r == 0) & (a > 0), torch.full_like(r, fmt.min_subnormal), r)
    return torch.copysign(r, v)


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float64, any shape with dim >= 1) as (rows, ngroups, G) zero-padded, and the mask of real elements."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    ngroups = -(-cols // group_size)
    padded = torch.zeros(rows, ngroups * group_size, dtype=torch.float64)
    padded[:, :cols] = x.reshape(rows, cols)
    valid = torch.zeros(rows, ngroups * group_size, dtype=torch.bool)
    valid[:, :cols] = True
    return padded.view(rows, ngroups, group_size), valid.view(rows, ngroups, group_size)


def _ungrouped(g: torch.Tensor, shape) -> torch.Tensor:
    return g.reshape(g.shape[0], -1)[:, : shape[-1]].reshape(shape)


def expansion_meta(x: torch.Tensor, group_size: int, fmt: Format, expand: bool) -> torch.Tensor:
    """Per-group (scale, k, C) of x, float64 values on the bf16 grid, shape (*x.shape[:-1], ngroups, 3)."""
    g, valid = _grouped(x.double(), group_size)
    finite = valid & torch.isfinite(g)
    a = torch.where(finite, g.abs(), torch.zeros_like(g))
    amax = a.amax(dim=-1)
    amin = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin(dim=-1)
    c = round_bf16(torch.sqrt(torch.where(amax > 0, amin * amax, torch.ones_like(amax))))
    expanded = (amax > 0) & (c >= MIN_SCALE) & (c <= BF16_MAX) if expand else torch.zeros_like(amax, dtype=torch.bool)
    log_range = torch.log2(torch.where(expanded, amax / amin, torch.full_like(amax, 2.0)))
    k = torch.where(log_range > 0, fmt.log2_range / log_range.clamp(min=1e-300), torch.ones_like(amax))
    k = round_bf16(torch.clamp(k, K_MIN, K_MAX))
    k = torch.where(expanded, k, torch.ones_like(k))
    c = torch.where(expanded, c, torch.ones_like(c))
    ymax = torch.where(amax > 0, (amax / c) ** k, torch.zeros_like(amax))
    scale = round_bf16(torch.clamp(ymax / fmt.max, min=MIN_SCALE), up=True)
    meta = torch.stack([scale, k, c], dim=-1)
    return meta.reshape(*x.shape[:-1], -1, 3)


def quantize_with_meta(x: torch.Tensor, meta: torch.Tensor, group_size: int, fmt: Format) -> torch.Tensor:
    """FP8 codes (dtype fmt.dtype, x's shape) of x under the given per-group (scale, k, C)."""
    g, _ = _grouped(x.double(), group_size)
    m = meta.double().reshape(g.shape[0], g.shape[1], 1, 3)
    scale, k, c = m[..., 0], m[..., 1], m[..., 2]
    finite = torch.isfinite(g)
    y = torch.copysign((torch.where(finite, g.abs(), torch.zeros_like(g)) / c) ** k, g)
    q = torch.where(finite, round_fp8(y / scale, fmt), torch.zeros_like(y))
    codes = _ungrouped(q, x.shape).to(torch.float32).to(fmt.dtype).view(torch.uint8)
    nan_code = torch.tensor(NAN_CODE, dtype=torch.uint8)
    return torch.where(_ungrouped(finite, x.shape), codes, nan_code).view(fmt.dtype)


def quantize(x: torch.Tensor, group_size: int, fmt: Format, expand: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, meta) with meta as bf16, the layout coat.ops.quantize_expanded returns."""
    meta = expansion_meta(x, group_size, fmt, expand)
    return quantize_with_meta(x, meta, group_size, fmt), meta.to(torch.bfloat16)


def dequantize(codes: torch.Tensor, meta: torch.Tensor, group_size: int) -> torch.Tensor:
    """float64 x' = sign * C * (|fp8(code)| * scale)^(1/k)."""
    q, _ = _grouped(codes.to(torch.float64), group_size)
    m = meta.double().reshape(q.shape[0], q.shape[1], 1, 3)
    scale, k, c = m[..., 0], m[..., 1], m[..., 2]
    x = torch.copysign(c * (q.abs() * scale) ** (1.0 / k), q)
    return _ungrouped(x, codes.shape)


@dataclass(frozen=True)
class Hyper:
    """AdamW hyperparameters of one step, and the host-side scalars derived from them in float64."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def scalars(self, step: int) -> tuple[float, float, float]:
        """(decay_factor, step_size, bias_correction2_sqrt) for step t = step (1-based)."""
        return (
            1.0 - self.lr * self.weight_decay,
            self.lr / (1.0 - self.beta1**step),
            math.sqrt(1.0 - self.beta2**step),
        )


def adamw_update(p, g, m, v, hyper: Hyper, step: int):
    """One AdamW step on float64 tensors (torch.optim.AdamW's formulas, appendix A of the paper):
    returns (p', m', v') before any quantization."""
    decay_factor, step_size, bias_correction2_sqrt = hyper.scalars(step)
    g = g.double()
    m = hyper.beta1 * m + (1.0 - hyper.beta1) * g
    v = hyper.beta2 * v + (1.0 - hyper.beta2) * g * g
    p = p.double() * decay_factor
    denom = v.sqrt() / bias_correction2_sqrt + hyper.eps
    p = p - step_size * m / denom
    return p, m, v


# --- stochastic rounding of bfloat16 parameters ------------------------------------------------------------------

def rounding_bits(seed: int, index: int) -> int:
    """The 16 random bits of element ``index`` (coat/adamw.h): a 32-bit word from the seed's and the index's
    halves, hashed by lowbias32, top 16 bits; Python integers, arithmetic mod 2^32."""
    mask = 0xFFFFFFFF
    word = (((index & mask) + (seed & mask)) & mask) ^ (seed >> 32)
    word ^= ((index >> 32) * 0x9E3779B9) & mask
    word ^= word >> 16
    word = (word * 0x7FEB352D) & mask
    word ^= word >> 15
    word = (word * 0x846CA68B) & mask
    word ^= word >> 16
    return word >> 16


def stochastic_bf16(p: torch.Tensor, seed: int) -> torch.Tensor:
    """float32 ``p`` rounded to bfloat16 stochastically with the bits of ``seed``, element index = position in
    the flattened tensor: the integer sum bits(p) + r, truncated to its top 16 bits. NaN becomes the canonical
    bf16 NaN and +-Inf stays +-Inf."""
    flat = p.detach().float().cpu().reshape(-1)
    words = flat.view(torch.int32).tolist()
    out = []
    for index, (value, word) in enumerate(zip(flat.tolist(), words)):
        if math.isnan(value):
            out.append(0x7FC0)
        elif math.isinf(value):
            out.append(((word & 0xFFFFFFFF) >> 16))
        else:
            out.append((((word & 0xFFFFFFFF) + rounding_bits(seed, index)) >> 16) & 0xFFFF)
    halves = torch.tensor([h - 0x10000 if h >= 0x8000 else h for h in out], dtype=torch.int16)
    return halves.view(torch.bfloat16).reshape(p.shape)
