"""The FP8 codecs of csrc/include/coat/fp8.h, bit for bit.

The codec is reached through the ops: quantize_tensor with group_amax = [FP8_MAX] has scale exactly 1.0,
so q == encode(x); dequantize with scale 1.0 to float32 is decode(q). Expected codes come from the oracle
(torch's conversion after coat's saturation rule), from the arithmetic rounding oracle, and, for the
special values, from hand-written tables.
"""
import pytest
import torch

import coat
import reference
from reference import E4M3, E5M2

FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]


def encode_with_unit_scale(run, x: torch.Tensor, fmt: reference.Fp8Format) -> torch.Tensor:
    """coat's encoding of x as uint8 codes, through quantize_tensor with a scale of exactly 1.0."""
    amax = torch.tensor([fmt.max], dtype=torch.float32)
    q, scale, _ = run(coat.ops.quantize_tensor, x, fmt.name, group_amax=amax)
    assert q.dtype == fmt.dtype and q.shape == x.shape
    reference.assert_same_bits(scale, torch.tensor(1.0), "scale")
    return q.view(torch.uint8)


def check_encoding(x: torch.Tensor, got: torch.Tensor, fmt: reference.Fp8Format) -> None:
    """got == the oracle's codes for x, and, for in-range values, decode(got) == the arithmetic rounding."""
    reference.assert_same_bits(got, reference.encode(x.float(), fmt), f"encode {fmt.name}")
    x64 = x.double()
    in_range = torch.isfinite(x64) & (x64.abs() <= fmt.max)
    decoded = reference.decode(got[in_range], fmt)
    reference.assert_same_bits(decoded, reference.round_to_fp8_grid(x64[in_range], fmt), f"arithmetic {fmt.name}")


def every_16_bit_pattern(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_bfloat16_value(run, fmt):
    x = every_16_bit_pattern(torch.bfloat16)
    check_encoding(x, encode_with_unit_scale(run, x, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_float16_value(run, fmt):
    x = every_16_bit_pattern(torch.float16)
    check_encoding(x, encode_with_unit_scale(run, x, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_float32_values_across_all_binades(run, rng, fmt):
    # Uniform bit patterns: every exponent (subnormals, Inf and NaN included) is equally likely.
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=rng, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    check_encoding(x, encode_with_unit_scale(run, x, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_float32_values_in_range(run, rng, fmt):
    # Dense coverage of the FP8 range itself, where every rounding decision happens.
    exponent = torch.randint(fmt.min_exponent - fmt.mantissa_bits - 2, 16, (1 << 18,), generator=rng)
    magnitude = (1 + torch.rand(exponent.shape, generator=rng, dtype=torch.float64)) * torch.pow(2.0, exponent.double())
    sign = torch.where(torch.rand(exponent.shape, generator=rng) < 0.5, -1.0, 1.0).double()
    x = (sign * magnitude.clamp(max=fmt.max)).float()
    check_encoding(x, encode_with_unit_scale(run, x, fmt), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_float32_subnormals_encode_to_signed_zero(run, rng, fmt):
    # The largest fp32 subnormal is far below half the smallest FP8 subnormal.
    mantissas = torch.cat([torch.tensor([1, 2, 3, 0x400000, 0x7FFFFE, 0x7FFFFF]), torch.randint(1, 0x800000, (4096,), generator=rng)])
    positive = mantissas.to(torch.int32).view(torch.float32)
    x = torch.cat([positive, -positive])
    got = encode_with_unit_scale(run, x, fmt)
    expected = torch.where(reference.sign_bit(x), 0x80, 0x00).to(torch.uint8)
    reference.assert_same_bits(got, expected)
    check_encoding(x, got, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_ties_round_to_even(run, fmt):
    # Midpoints between neighbouring finite codes are exact in fp32; they go to the code with an even
    # mantissa, and one fp32 ulp either side of a midpoint goes to the nearer code. The expectation comes
    # from the code table only, not from any encoder.
    positive_codes = torch.arange(0, fmt.max_code + 1)
    values = reference.code_values(fmt)[positive_codes]
    low, high = values[:-1], values[1:]
    midpoint = ((low + high) / 2).float()
    assert torch.equal(midpoint.double(), (low + high) / 2), "midpoints must be exact in fp32"
    even = torch.where(positive_codes[:-1] % 2 == 0, positive_codes[:-1], positive_codes[1:])
    below = torch.nextafter(midpoint, torch.tensor(0.0))
    above = torch.nextafter(midpoint, torch.tensor(float("inf")))
    x = torch.cat([midpoint, below, above])
    expected = torch.cat([even, positive_codes[:-1], positive_codes[1:]]).to(torch.uint8)
    x, expected = torch.cat([x, -x]), torch.cat([expected, expected | 0x80])
    got = encode_with_unit_scale(run, x, fmt)
    reference.assert_same_bits(got, expected)
    check_encoding(x, got, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_at_and_past_the_max_saturate(run, fmt):
    top = fmt.max
    ulp_at_max = 2.0 ** (int(torch.tensor(top).log2().floor()) - fmt.mantissa_bits)
    halfway_past_max = top + ulp_at_max / 2  # 464 for E4M3, 61440 for E5M2
    f32 = lambda v: torch.tensor([v], dtype=torch.float32)
    x = torch.cat([
        torch.nextafter(f32(top), f32(0.0)),
        f32(top),
        torch.nextafter(f32(top), f32(float("inf"))),
        torch.nextafter(f32(halfway_past_max), f32(0.0)),
        f32(halfway_past_max),
        torch.nextafter(f32(halfway_past_max), f32(float("inf"))),
        f32(2 * top),
        f32(1e30),
        f32(torch.finfo(torch.float32).max),
    ])
    x = torch.cat([x, -x])
    got = encode_with_unit_scale(run, x, fmt)
    expected = torch.tensor([fmt.max_code] * 9 + [fmt.max_code | 0x80] * 9, dtype=torch.uint8)
    reference.assert_same_bits(got, expected)
    check_encoding(x, got, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_infinity_and_nan(run, fmt):
    nan = torch.tensor([float("nan")])
    x = torch.cat([torch.tensor([0.0, -0.0, float("inf"), float("-inf")]), nan, -nan])
    assert reference.sign_bit(x).tolist() == [False, True, False, True, False, True]
    # E4M3 has no Inf: it saturates to 448. NaN is S.1111.111 (E4M3) / S.11111.11 (E5M2), its sign kept.
    inf = fmt.inf_code if fmt.inf_code is not None else fmt.max_code
    expected = torch.tensor([0x00, 0x80, inf, inf | 0x80, 0x7F, 0xFF], dtype=torch.uint8)
    reference.assert_same_bits(encode_with_unit_scale(run, x, fmt), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_every_code(run, fmt):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype)
    decoded = run(coat.ops.dequantize, q, torch.tensor(1.0), None, torch.float32)
    reference.assert_same_bits(decoded, q.to(torch.float32), "vs torch's decoder")
    reference.assert_same_bits(decoded, reference.code_values(fmt).float(), "vs the code table")
    # Every FP8 value is exact in bfloat16 too.
    decoded_bf16 = run(coat.ops.dequantize, q, torch.tensor(1.0), None, torch.bfloat16)
    reference.assert_same_bits(decoded_bf16, q.to(torch.bfloat16), "bfloat16 vs torch's decoder")
    # The NaN codes, and for E5M2 the Inf codes, are exactly the documented ones.
    nan_codes = torch.isnan(decoded).nonzero().flatten().tolist()
    assert nan_codes == ([0x7F, 0xFF] if fmt is E4M3 else [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF])
    assert torch.isinf(decoded).nonzero().flatten().tolist() == ([] if fmt is E4M3 else [0x7C, 0xFC])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_rounding_agrees_with_torch(rng, fmt):
    """The arithmetic oracle and torch's converter agree on in-range values, and the code table agrees with
    torch's decoder: the two halves of the oracle check each other."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype)
    reference.assert_same_bits(reference.code_values(fmt), q.to(torch.float64))

    bf16 = every_16_bit_pattern(torch.bfloat16).float()
    random = (torch.rand(1 << 18, generator=rng, dtype=torch.float64) * 2 - 1) * fmt.max
    scaled = random * torch.pow(2.0, -torch.randint(0, 30, random.shape, generator=rng).double())
    x = torch.cat([bf16, random.float(), scaled.float()])
    x = x[torch.isfinite(x) & (x.abs() <= fmt.max)]
    assert x.numel() > 300_000
    by_torch = x.to(fmt.dtype).to(torch.float64)
    reference.assert_same_bits(by_torch, reference.round_to_fp8_grid(x.double(), fmt))
