"""Independent oracles for coat's FP8 codecs and quantizers, in plain PyTorch float64, written from the
specification in csrc/include/coat/fp8.h and quantize.h (not from the C code), and the bitwise comparison
the tests use against them.

Why a float64 oracle can be bit-exact. The quantizers compute in fp32:
    amax = max |x| (NaN ignored, 0 when empty)      exact: a max of exactly converted values
    scale = max(fp32(amax / FP8_MAX), 2^-126)        one fp32 division
    q = fp8(fp32(x / scale))                         one fp32 division, then the FP8 rounding
    x' = round_to(dtype, fp32(decode(q) * scale))    one fp32 product
Every fp32, bf16 and fp16 value is exact in float64. Computing a / b in float64 and rounding once to fp32
equals the IEEE fp32 division of fp32 a and b, because 53 >= 2 * 24 + 2 makes the double rounding
innocuous; a product of two fp32 values is exact in float64 (24 + 24 <= 53), so rounding it once to fp32
is the fp32 product. Results are rounded to fp32 with torch's .to(torch.float32) (round to nearest even,
subnormals kept).

The FP8 encoder is torch's own .to(torch.float8_*) after an explicit saturation rule, because PyTorch
versions differ past the format's max (torch 2.13 saturates E4M3 but rounds E5M2 to Inf; older versions
may give NaN); coat saturates finite values to +-max, E4M3 also sends +-Inf to +-448, E5M2 keeps +-Inf.
round_to_fp8_grid is a pure-arithmetic rounding oracle (round to nearest even on the format's grid) that
the codec tests check torch's encoder against, so the suite does not rest on torch alone.

NaN. The sign of an FP8 NaN code is the sign of the quantizer's input element: fp8.h keeps the sign of a
NaN, and scales are positive, so the input's sign is the only one the result can consistently carry (a
bare fp32 division leaves it to the platform: x86 gives Inf / Inf a negative NaN, CUDA a positive one).
The bits of an fp32 or bf16 NaN produced by dequantization are not specified (IEEE 754 leaves the payload
and sign of an arithmetic NaN to the platform), so assert_same_bits compares floats by NaN-ness there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    mantissa_bits: int
    exponent_bias: int
    min_exponent: int  # the smallest normal is 2**min_exponent; subnormals are steps of 2**(min_exponent - mantissa_bits)
    max_code: int  # +max; -max is max_code | 0x80
    nan_code: int  # +NaN; -NaN is nan_code | 0x80
    inf_code: int | None  # +Inf, None when the format has no infinity


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 7, -6, 0x7E, 0x7F, None)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 15, -14, 0x7B, 0x7F, 0x7C)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}

MIN_SCALE = 2.0**-126  # the smallest normal fp32, the floor of every scale


def fp8_format(fmt: str | torch.dtype | Fp8Format) -> Fp8Format:
    if isinstance(fmt, Fp8Format):
        return fmt
    for f in FORMATS.values():
        if fmt in (f.name, f.dtype):
            return f
    raise ValueError(f"not an FP8 format: {fmt!r}")


# ---------------------------------------------------------------------------------------------- bits


_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def sign_bit(x: torch.Tensor) -> torch.Tensor:
    """The stored sign bit of each element (also of -0.0 and of a NaN), read from the raw bits."""
    return x.view(_INT_VIEW[x.dtype]) < 0


def codes(q: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 tensor (uint8 passes through)."""
    return q if q.dtype == torch.uint8 else q.view(torch.uint8)


# --------------------------------------------------------------------------------------------- codec


def code_values(fmt) -> torch.Tensor:
    """The float64 value of each of the 256 codes, from the bit fields (sign, exponent, mantissa)."""
    f = fp8_format(fmt)
    m = f.mantissa_bits
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code & 0x7F) >> m
        mantissa = code & ((1 << m) - 1)
        if (code & 0x7F) == f.nan_code or (f.inf_code is not None and (code & 0x7F) > f.inf_code):
            value = float("nan")
        elif f.inf_code is not None and (code & 0x7F) == f.inf_code:
            value = sign * float("inf")
        elif exponent == 0:
            value = sign * mantissa * 2.0 ** (f.min_exponent - m)
        else:
            value = sign * (1.0 + mantissa / 2.0**m) * 2.0 ** (exponent - f.exponent_bias)
        values.append(value)
    return torch.tensor(values, dtype=torch.float64)


def decode(q: torch.Tensor, fmt) -> torch.Tensor:
    """FP8 codes (an FP8 or uint8 tensor) to float64 values, exactly."""
    return code_values(fmt)[codes(q).long()]


def round_to_fp8_grid(x: torch.Tensor, fmt) -> torch.Tensor:
    """Pure-arithmetic FP8 rounding of finite float64 values with |x| <= FP8 max: round to nearest, ties to
    even, on the format's grid (subnormals included; the sign of zero kept). Returns float64."""
    f = fp8_format(fmt)
    x = x.to(torch.float64)
    assert bool(torch.isfinite(x).all()) and bool((x.abs() <= f.max).all()), "round_to_fp8_grid: in-range values only"
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent with m in [0.5, 1): floor(log2) = exponent - 1
    binade = torch.clamp(exponent.to(torch.int64) - 1, min=f.min_exponent)
    ulp = torch.ldexp(torch.ones_like(magnitude), binade - f.mantissa_bits)
    rounded = torch.round(magnitude / ulp) * ulp  # exact scalings by powers of two; torch.round is half-to-even
    return torch.copysign(rounded, x)


def fp8_half_ulp(y: torch.Tensor, fmt) -> torch.Tensor:
    """Half the spacing of the FP8 grid at |y| (float64): the largest rounding error of an in-range value."""
    f = fp8_format(fmt)
    _, exponent = torch.frexp(y.to(torch.float64).abs())
    binade = torch.clamp(exponent.to(torch.int64) - 1, min=f.min_exponent)
    return torch.ldexp(torch.full(y.shape, 0.5, dtype=torch.float64), binade - f.mantissa_bits)


def encode(y: torch.Tensor, fmt) -> torch.Tensor:
    """fp8.h's encoder on float32 values, as uint8 codes: torch's round-to-nearest-even conversion after
    coat's saturation rule; NaN gives the NaN code with the NaN's own sign."""
    f = fp8_format(fmt)
    assert y.dtype == torch.float32
    nan = torch.isnan(y)
    if f.inf_code is None:
        saturate = ~nan  # E4M3: every value past max, +-Inf included, goes to +-max
    else:
        saturate = torch.isfinite(y)  # E5M2: finite values saturate, +-Inf stays Inf
    top = torch.tensor(f.max, dtype=torch.float32)
    clamped = torch.where(saturate & (y > top), top, y)
    clamped = torch.where(saturate & (y < -top), -top, clamped)
    q = clamped.to(f.dtype).view(torch.uint8)
    nan_codes = torch.where(sign_bit(y), f.nan_code | 0x80, f.nan_code).to(torch.uint8)
    return torch.where(nan, nan_codes, q)


# ----------------------------------------------------------------------------------------- quantizers


def num_groups(cols: int, group_size: int) -> int:
    return -(-cols // group_size)


def group_amax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 max |x| over each 1 x G group of the last dimension (NaN ignored, 0 for an all-NaN group),
    shape x.shape[:-1] + (ceil(cols / G),); the last group of a row is short when G does not divide cols."""
    cols = x.shape[-1]
    ngroups = num_groups(cols, group_size)
    magnitude = torch.nan_to_num(x.to(torch.float64).abs(), nan=0.0, posinf=float("inf"))  # amax >= 0: NaN acts as 0
    padded = torch.nn.functional.pad(magnitude, (0, ngroups * group_size - cols))
    grouped = padded.reshape(*x.shape[:-1], ngroups, group_size)
    return grouped.amax(dim=-1).to(torch.float32)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """0-d float32 max |x| over the whole tensor (NaN ignored, 0 when empty)."""
    magnitude = torch.nan_to_num(x.to(torch.float64).abs(), nan=0.0, posinf=float("inf"))
    return (magnitude.max() if magnitude.numel() else torch.zeros((), dtype=torch.float64)).to(torch.float32)


def scale_from_amax(amax: torch.Tensor, fmt) -> torch.Tensor:
    """max(fp32(amax / FP8_MAX), 2^-126) as float32."""
    f = fp8_format(fmt)
    scale = (amax.to(torch.float64) / f.max).to(torch.float32)
    return torch.maximum(scale, torch.tensor(MIN_SCALE, dtype=torch.float32))


def expand_group_scales(scales: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """Per-group values broadcast to the elements they cover: shape x.shape[:-1] + (cols,)."""
    return scales.repeat_interleave(group_size, dim=-1)[..., :cols]


def quantize_values(x: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """uint8 codes of fp8(fp32(x / scale)), scale broadcasting against x. A NaN quotient (NaN input, or
    +-Inf over an Inf scale) encodes the NaN code with the sign of x (see the module docstring)."""
    f = fp8_format(fmt)
    y = (x.to(torch.float64) / scale.to(torch.float64)).to(torch.float32)
    q = encode(y, f)
    nan_codes = torch.where(sign_bit(x), f.nan_code | 0x80, f.nan_code).to(torch.uint8)
    return torch.where(torch.isnan(y), nan_codes, q)


def quantize_group(x: torch.Tensor, group_size: int, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): uint8 codes shaped like x and float32 scales of shape x.shape[:-1] + (ngroups,)."""
    scales = scale_from_amax(group_amax(x, group_size), fmt)
    return quantize_values(x, expand_group_scales(scales, x.shape[-1], group_size), fmt), scales


def quantize_tensor(x: torch.Tensor, fmt, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) with one 0-d float32 scale from the tensor's amax (or the given one)."""
    scale = scale_from_amax(tensor_amax(x) if amax is None else amax.to(torch.float32).reshape(()), fmt)
    return quantize_values(x, scale, fmt), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt, dtype: torch.dtype) -> torch.Tensor:
    """round_to(dtype, fp32(decode(q) * scale)), scale broadcasting against q (expand per-group scales
    with expand_group_scales first)."""
    product = (decode(q, fmt) * scale.to(torch.float64)).to(torch.float32)
    return product.to(dtype)


# ------------------------------------------------------------------------------------------ comparison


def _mismatch_report(actual, expected, bad, shown=8) -> str:
    index = bad.nonzero()[:shown].tolist()
    lines = [f"{int(bad.sum())} of {bad.numel()} elements differ; first at:"]
    for i in index:
        lines.append(f"  {tuple(i)}: got {_describe(actual, i)}, expected {_describe(expected, i)}")
    return "\n".join(lines)


def _describe(t: torch.Tensor, index) -> str:
    value = t[tuple(index)]
    if t.dtype == torch.uint8:
        return f"0x{int(value):02X}"
    raw = int(value.view(_INT_VIEW[t.dtype]))
    bits = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}[t.dtype]
    return f"{float(value)!r} (0x{raw & ((1 << bits) - 1):0{bits // 4}X})"


def assert_same_bits(actual, expected, what: str = "") -> None:
    """Equality of results bit for bit: FP8 tensors (or uint8 codes) byte for byte, float tensors by their
    bits (so +0 != -0), except that a NaN only has to meet a NaN. Tuples are compared element-wise; shapes
    and dtypes must match too. `expected` may hold uint8 codes where `actual` has an FP8 dtype."""
    prefix = f"{what}: " if what else ""
    if isinstance(actual, (tuple, list)) or isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and isinstance(expected, (tuple, list)), f"{prefix}{actual!r} vs {expected!r}"
        assert len(actual) == len(expected), f"{prefix}{len(actual)} results, expected {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_bits(a, e, f"{what}[{i}]")
        return
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{prefix}{actual!r} vs {expected!r}"
        return
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    assert actual.shape == expected.shape, f"{prefix}shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if expected.dtype == torch.uint8 and actual.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        actual = actual.view(torch.uint8)
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype}, expected {expected.dtype}"
    if actual.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        a, e = codes(actual), codes(expected)
        bad = a != e
        assert not bool(bad.any()), prefix + _mismatch_report(a, e, bad)
        return
    if actual.dtype in _INT_VIEW:
        a_nan, e_nan = torch.isnan(actual), torch.isnan(expected)
        bad = (a_nan != e_nan) | (~a_nan & (actual.view(_INT_VIEW[actual.dtype]) != expected.view(_INT_VIEW[actual.dtype])))
        assert not bool(bad.any()), prefix + _mismatch_report(actual, expected, bad)
        return
    assert torch.equal(actual, expected), f"{prefix}{actual} vs {expected}"
