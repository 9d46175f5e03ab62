"""Test oracles for coat's fused RMSNorm and act*mul (coat.ops.rmsnorm_* / silu_mul_*, act = silu, gelu_tanh or
quick_gelu; the non-gated act is act*mul with up = 1).

Two kinds of reference, kept apart:

1. float64 references written from the formulas (RMSNorm: Zhang & Sennrich 2019; SwiGLU: Shazeer 2020;
   Smooth-SwiGLU: Fishman et al. 2024), independent of the kernels. Accuracy is judged against these.
2. fp32 replays of the arithmetic that csrc/include/coat/detail/norm_act_math.h documents (operation
   order, reduction order, coat's exp), built from torch fp32 elementwise + - * / and floor, each of which
   rounds once (IEEE); the square root goes through float64 (see sqrt_f32). The kernels must match them
   bit for bit; this pins the documented order to what the C core
   does, and the CUDA tests pin CUDA to the C core.
"""
from __future__ import annotations

import math

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# (mantissa bits, smallest normal exponent) of each FP8 format
FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
MIN_SCALE = 2.0**-126


# ----------------------------------------------------------------------------------------------------
# 1. float64 references


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) in float64: rstd = 1 / sqrt(mean(x^2) + eps) per row, y = x * rstd * (weight + weight_offset)
    (weight_offset 1: Gemma's (1 + weight))."""
    x = x.double()
    rstd = 1.0 / torch.sqrt(x.pow(2).mean(dim=-1) + eps)
    return x * rstd.unsqueeze(-1) * (weight.double() + weight_offset), rstd


def rmsnorm_backward(dy, x, rstd, weight, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) in float64 of y = x * rstd * w with w = weight + weight_offset and
    rstd = 1/sqrt(mean(x^2) + eps), at the given x and rstd: with xhat = x * rstd and g = dy * w,
    dx = rstd * (g - xhat * mean(g * xhat)),  dweight = sum over rows of dy * xhat (the offset is constant)."""
    dy, x, weight = dy.double(), x.double(), weight.double() + weight_offset
    rstd = rstd.double().reshape(x.shape[:-1]).unsqueeze(-1)
    xhat = x * rstd
    g = dy * weight
    dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dweight = (dy * xhat).reshape(-1, x.shape[-1]).sum(dim=0)
    return dx, dweight


SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def activation64(gate: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)) in float64, from the formulas: silu(g) = g * sigmoid(g), silu' = s (1 + g (1 - s));
    gelu_tanh(g) = 0.5 g (1 + t), t = tanh(sqrt(2/pi) (g + 0.044715 g^3)) (Hendrycks & Gimpel 2016, PyTorch's
    gelu(approximate="tanh")), gelu_tanh' = 0.5 (1 + t) + 0.5 g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2);
    quick_gelu(g) = g * sigmoid(1.702 g) (CLIP's, Radford et al. 2021), quick_gelu' = s (1 + 1.702 g (1 - s))."""
    g = gate.double()
    if activation in ("silu", "quick_gelu"):
        a = 1.0 if activation == "silu" else 1.702
        s = torch.sigmoid(a * g)
        return g * s, s * (1 + a * g * (1 - s))
    assert activation == "gelu_tanh", activation
    t = torch.tanh(SQRT_2_OVER_PI * (g + 0.044715 * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)


def silu_mul(gate, up, smooth_scale=None, activation="silu") -> torch.Tensor:
    """float64 act(gate) * up [* smooth_scale] (activation64)."""
    y = activation64(gate, activation)[0] * up.double()
    return y if smooth_scale is None else y * smooth_scale.double()


def silu_mul_backward(dy, gate, up, smooth_scale=None, activation="silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in float64: dgate = dy * up * act'(gate), dup = dy * act(gate) (activation64)."""
    dy, up = dy.double(), up.double()
    if smooth_scale is not None:
        dy = dy * smooth_scale.double()
    act, dact = activation64(gate, activation)
    return dy * up * dact, dy * act


def fp8_step(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Spacing of the FP8 grid at |t| (float64): 2^(e - mantissa_bits) for |t| in [2^e, 2^(e+1)), the
    subnormal spacing below the smallest normal."""
    mantissa_bits, min_exponent = FP8_GRID[fp8_dtype]
    exponent = torch.floor(torch.log2(t.abs().clamp_min(2.0**min_exponent)))
    return torch.pow(2.0, exponent - mantissa_bits)


def per_tensor_scale(y64: torch.Tensor, fp8_dtype: torch.dtype) -> float:
    """The per-tensor scale the paper's group scaling gives, in float64: max(amax / FP8_MAX, 2^-126)."""
    finite = y64[~torch.isnan(y64)]
    amax = finite.abs().max().item() if finite.numel() else 0.0
    return max(amax / FP8_MAX[fp8_dtype], MIN_SCALE)


# ----------------------------------------------------------------------------------------------------
# 2. fp32 replays of the documented kernel arithmetic

CHUNK = 8
MAX_CHUNKS_PER_LANE = 4
MAX_LANES = 1024
DWEIGHT_PHASES = 16


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def rmsnorm_lanes(cols: int) -> int:
    chunks = -(-cols // CHUNK)
    lanes = 32
    while lanes < MAX_LANES and lanes * MAX_CHUNKS_PER_LANE < chunks:
        lanes *= 2
    return lanes


def row_sum(terms: torch.Tensor) -> torch.Tensor:
    """Per-row fp32 sum of terms [rows, cols] in the documented order: chunk k of 8 columns goes to lane
    k % L, each lane adds its terms in column order from +0, then the lanes are combined pairwise within
    groups of 32 (offsets 16..1) and across groups (offsets L/64..1)."""
    rows, cols = terms.shape
    lanes = rmsnorm_lanes(cols)
    rounds = -(-cols // (CHUNK * lanes))
    padded = torch.zeros(rows, rounds * lanes * CHUNK, dtype=torch.float32)
    padded[:, :cols] = terms
    padded = padded.view(rows, rounds, lanes, CHUNK)
    # Adding the +0 padding equals skipping it: a lane partial starts at +0 and can never become -0.
    partials = torch.zeros(rows, lanes, dtype=torch.float32)
    for k in range(rounds):
        for e in range(CHUNK):
            partials = partials + padded[:, k, :, e]
    partials = partials.view(rows, lanes // 32, 32)
    for offset in (16, 8, 4, 2, 1):
        partials[..., :offset] = partials[..., :offset] + partials[..., offset : 2 * offset]
    group_sums = partials[..., 0].clone()
    offset = lanes // 64
    while offset:
        group_sums[:, :offset] = group_sums[:, :offset] + group_sums[:, offset : 2 * offset]
        offset //= 2
    return group_sums[:, 0]


def sqrt_f32(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root. torch.sqrt on fp32 CPU tensors may be 1 ulp off (vector math
    library); the float64 root rounded to fp32 is exact, since 53 >= 2 * 24 + 2 bits."""
    return torch.sqrt(t.double()).float()


def rmsnorm_rstd_f32(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd = 1 / sqrt(sum_sq / cols + eps), every step in fp32, sum_sq in the documented order."""
    cols = x32.shape[-1]
    return _f32(1.0) / sqrt_f32(row_sum(x32 * x32) / _f32(cols) + _f32(eps))


def rmsnorm_forward_f32(x32: torch.Tensor, rstd: torch.Tensor, weight32: torch.Tensor) -> torch.Tensor:
    """y = (x * rstd) * weight in fp32, from the kernel's own rstd."""
    return (x32 * rstd.unsqueeze(-1)) * weight32


def rmsnorm_backward_rows_per_slice(rows: int, cols: int) -> int:
    max_slices = max(128, 65536 // rmsnorm_lanes(cols))
    return 1 if rows <= max_slices else -(-rows // max_slices)


def dweight_sum(terms: torch.Tensor) -> torch.Tensor:
    """Column sums of terms [rows, cols] in the documented order: slices of consecutive rows summed row by
    row from +0, slice s added to phase s % 16 in increasing s, phases combined pairwise (offsets 8..1)."""
    rows, cols = terms.shape
    per_slice = rmsnorm_backward_rows_per_slice(rows, cols)
    slices = -(-rows // per_slice)
    padded = torch.zeros(slices * per_slice, cols, dtype=torch.float32)
    padded[:rows] = terms
    padded = padded.view(slices, per_slice, cols)
    slice_sums = torch.zeros(slices, cols, dtype=torch.float32)
    for i in range(per_slice):
        slice_sums = slice_sums + padded[:, i]
    rounds = -(-slices // DWEIGHT_PHASES)
    by_phase = torch.zeros(rounds * DWEIGHT_PHASES, cols, dtype=torch.float32)
    by_phase[:slices] = slice_sums
    by_phase = by_phase.view(rounds, DWEIGHT_PHASES, cols)
    phases = torch.zeros(DWEIGHT_PHASES, cols, dtype=torch.float32)
    for k in range(rounds):
        phases = phases + by_phase[k]
    offset = DWEIGHT_PHASES // 2
    while offset:
        phases[:offset] = phases[:offset] + phases[offset : 2 * offset]
        offset //= 2
    return phases[0]


def rmsnorm_backward_f32(dy32, x_deq32, rstd, weight32) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) in fp32 as the kernels compute them, dx before rounding to dy's dtype."""
    xhat = x_deq32 * rstd.unsqueeze(-1)
    g = dy32 * weight32
    mean_dot = row_sum(g * xhat) / _f32(x_deq32.shape[-1])
    dx = (g - xhat * mean_dot.unsqueeze(-1)) * rstd.unsqueeze(-1)
    return dx, dweight_sum(dy32 * xhat)


def coat_exp(x: torch.Tensor) -> torch.Tensor:
    """coat's fp32 exp (Cephes expf: Cody-Waite reduction, degree-7 polynomial, two exact scalings)."""
    n = torch.floor(x * _f32(1.44269504088896341) + _f32(0.5))
    r = x - n * _f32(0.693359375)
    r = r - n * _f32(-2.12194440e-4)
    r2 = r * r
    p = torch.full_like(x, 1.9875691500e-4)
    for coefficient in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + _f32(coefficient)
    p = p * r2 + r + _f32(1.0)
    exponent = torch.nan_to_num(n, nan=0.0).clamp(-150, 128).to(torch.int32)
    first = torch.div(exponent, 2, rounding_mode="trunc")
    second = exponent - first
    p = p * ((first + 127) << 23).view(torch.float32)
    p = p * ((second + 127) << 23).view(torch.float32)
    p = torch.where(x > _f32(88.72283905206835), torch.full_like(x, math.inf), p)
    p = torch.where(x < _f32(-103.278929903431851103), torch.zeros_like(x), p)
    return torch.where(torch.isnan(x), x, p)


def sigmoid_f32(g: torch.Tensor) -> torch.Tensor:
    return _f32(1.0) / (_f32(1.0) + coat_exp(-g))


def activation_arg_f32(g: torch.Tensor, activation: str) -> torch.Tensor:
    """z(g) of act(g) = g * sigmoid(z(g)): g (silu), 1.5957691 * (g + 0.044715 * ((g * g) * g)) (gelu_tanh),
    1.702f * g (quick_gelu)."""
    if activation == "silu":
        return g
    if activation == "quick_gelu":
        return _f32(1.702) * g
    return _f32(1.59576912160573071) * (g + _f32(0.044715) * ((g * g) * g))


def activation_sigmoid_f32(g: torch.Tensor, activation: str) -> torch.Tensor:
    return sigmoid_f32(activation_arg_f32(g, activation))


def silu_mul_f32(gate32, up32, smooth_scale=None, activation="silu") -> torch.Tensor:
    y = (gate32 * activation_sigmoid_f32(gate32, activation)) * up32
    return y if smooth_scale is None else y * smooth_scale


def requantize_gate_f32(gate32: torch.Tensor) -> torch.Tensor:
    """The gate silu_mul_requantize takes silu of: the decoded gate g' rounded to the nearest bf16, ties to even
    (torch's float -> bfloat16: +-Inf kept, finite values past the largest bf16 to +-Inf, NaN kept)."""
    return gate32.to(torch.bfloat16).float()


def silu_mul_requantize_f32(gate32, up32, smooth_scale=None, activation="silu") -> torch.Tensor:
    """y of silu_mul_requantize from the decoded saved inputs: act(bf16(g')) * u' [* smooth], u' in fp32."""
    return silu_mul_f32(requantize_gate_f32(gate32), up32, smooth_scale, activation)


def activation_slope_f32(gate32: torch.Tensor, s: torch.Tensor, activation: str) -> torch.Tensor:
    """act'(g) in norm_act_math.h's order: s (1 + g (1 - s)) for silu; with c = g clamped to [-64, 64],
    s (1 + (c (1 - s)) * (1.5957691 * (1 + 0.134145 * (c * c)))) for gelu_tanh and s (1 + (c (1 - s)) * 1.702f)
    for quick_gelu."""
    if activation == "silu":
        return s * (_f32(1.0) + gate32 * (_f32(1.0) - s))
    c = torch.where(gate32.isnan(), gate32, gate32.clamp(-64.0, 64.0))
    if activation == "quick_gelu":
        return s * (_f32(1.0) + (c * (_f32(1.0) - s)) * _f32(1.702))
    slope = _f32(1.59576912160573071) * (_f32(1.0) + _f32(0.134145) * (c * c))
    return s * (_f32(1.0) + (c * (_f32(1.0) - s)) * slope)


def silu_mul_backward_f32(dy32, gate32, up32, smooth_scale=None,
                          activation="silu") -> tuple[torch.Tensor, torch.Tensor]:
    s = activation_sigmoid_f32(gate32, activation)
    dy_s = dy32 if smooth_scale is None else dy32 * smooth_scale
    return (dy_s * up32) * activation_slope_f32(gate32, s, activation), dy_s * (gate32 * s)


# ----------------------------------------------------------------------------------------------------
# 3. The requantize ops: saved inputs decoded, y quantized with a given per-tensor scale


def decode_saved(saved: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x' = float(code) * scale of its 1 x G group, one fp32 rounding (FP8 to fp32 is exact), [rows, cols]."""
    codes = saved.reshape(-1, saved.shape[-1])
    group_scales = scales.reshape(-1, scales.shape[-1]).repeat_interleave(group_size, dim=-1)[:, : codes.shape[-1]]
    return codes.float() * group_scales


def quantize_with_scale(y32: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8(y / scale) as coat's encoder rounds it: fp32 division, round to nearest even, finite quotients
    past FP8_MAX saturate to +-FP8_MAX (E4M3 saturates Inf too, E5M2 keeps it), NaN stays NaN."""
    q = y32 / scale.float()
    fp8_max = FP8_MAX[fp8_dtype]
    saturated = torch.where(q.abs() > fp8_max, torch.copysign(torch.full_like(q, fp8_max), q), q)
    if fp8_dtype == torch.float8_e5m2:
        saturated = torch.where(torch.isinf(q), q, saturated)
    return saturated.to(fp8_dtype)


def e4m3_half_step(x: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float64 bound on |x - x'| for x saved as E4M3 with the given group scales: half an E4M3 step at x."""
    rows = x.reshape(-1, x.shape[-1]).double()
    group_scales = scales.reshape(-1, scales.shape[-1]).double().repeat_interleave(group_size, dim=-1)[:, : rows.shape[-1]]
    return 0.5 * fp8_step(rows / group_scales, torch.float8_e4m3fn) * group_scales


# The largest |act'(g)| (silu: about 1.0998, at g near 2.4; quick_gelu, silu of 1.702 g over 1.702: the same, at g
# near 1.4; gelu_tanh: about 1.1289, at g near 1.5), rounded up: act is Lipschitz with this constant.
LIPSCHITZ = {"silu": 1.1, "gelu_tanh": 1.13, "quick_gelu": 1.1}
SILU_LIPSCHITZ = LIPSCHITZ["silu"]
