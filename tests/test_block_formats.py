"""coat.ops.quantize_blocks, dequantize_blocks and blocks_to_e4m3: block-scaled FP4 (E2M1) and FP6 (E2M3) storage,
and the FP4 names quantize_fp4 / dequantize_fp4 / fp4_to_e4m3.

Every test that is not about one format runs for both, through the `fmt` fixture ("fp4", "fp6"); what differs
between them (the largest value E_MAX, 6 or 7.5, the grid and its midpoints, the packing, the error table) comes
with the parameter, from reference_blocks.BlockFormat or from per-format tables here. Every result is checked bit
for bit against the float64 oracle in reference_blocks.py; on CUDA, `run` also checks it against the C core on the
CPU. The encoders are reached through quantize_blocks with blocks whose amax is E_MAX (scale exactly 1.0), so the
codes are encode(x) itself.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coat
import reference_blocks as ref
from reference import MIN_SCALE, assert_same_bits
from test_quantize import DTYPE_NAMES, INPUT_DTYPES, poisoned, random_input, shape_id

FORMATS = ("fp4", "fp6")
BLOCK_SIZES = (16, 32, 64, 128)
OUT_DTYPES = (torch.float32, torch.bfloat16)

# Odd and even widths, every width modulo 4 (FP6 packs four codes in three bytes: 1, 37 and 41 leave one code in
# the last word, 2 and 50 two, 3 and 7 three), rows narrower than a block, exact multiples of every block size, empty
# matrices, and widths that are not multiples of 8 (the CUDA kernels' element-wise path).
SHAPES = [(1, 1), (3, 7), (1, 37), (97, 37), (0, 37), (5, 0), (123, 16), (97, 200), (123, 128), (4097, 3),
          (33, 4096), (2, 3, 40), (6, 2), (13, 50), (2, 3, 41)]

# Bytes of a packed row, written out from each format's packing rule: ceil(cols / 2) and ceil(3 cols / 4).
ROW_BYTES = {"fp4": lambda cols: (cols + 1) // 2, "fp6": lambda cols: (3 * cols + 3) // 4}


@pytest.fixture(params=FORMATS)
def fmt(request) -> str:
    """Every test that takes `fmt` runs once per block-scaled format."""
    return request.param


def block_cases():
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, dtype in enumerate(INPUT_DTYPES):
            block_size = BLOCK_SIZES[(i + j) % len(BLOCK_SIZES)]
            cases.append(pytest.param(shape, dtype, block_size,
                                      id=f"{shape_id(shape)}-{DTYPE_NAMES[dtype]}-b{block_size}"))
    return cases


def check_blocks(run, x, fmt, block_size):
    """quantize_blocks, dequantize_blocks (both dtypes) and blocks_to_e4m3 of x equal the oracle, and the E4M3
    expansion dequantizes to dequantize_blocks' bits. Returns (codes, scales)."""
    cols = x.shape[-1]
    expected_codes, expected_scales = ref.quantize(x, fmt, block_size)
    codes, scales = run(coat.ops.quantize_blocks, x, fmt, block_size)
    assert_same_bits(codes, expected_codes, f"{fmt} codes")
    assert_same_bits(scales, expected_scales, f"{fmt} scales")
    q, passed_scales = run(coat.ops.blocks_to_e4m3, codes, scales, cols, fmt, block_size)
    assert_same_bits(q, ref.to_e4m3(codes, cols, fmt), f"{fmt} to E4M3")
    assert_same_bits(passed_scales, scales, f"{fmt} to E4M3 scales")
    for dtype in OUT_DTYPES:
        out = run(coat.ops.dequantize_blocks, codes, scales, cols, fmt, block_size, dtype)
        expected = ref.dequantize(codes, scales, cols, fmt, block_size, dtype)
        assert_same_bits(out, expected, f"dequantize {fmt} {dtype}")
        if x.numel():
            assert_same_bits(run(coat.ops.dequantize, q, scales, block_size, dtype), out, f"E4M3 round trip {dtype}")
    return codes, scales


def with_unit_scale(values: torch.Tensor, fmt: str, block_size: int = 16) -> torch.Tensor:
    """values (|v| <= E_MAX) laid out in blocks that each start with E_MAX, so that every block's scale is 1.0."""
    per_block = block_size - 1
    padded = torch.nn.functional.pad(values, (0, -values.numel() % per_block)).reshape(-1, per_block)
    anchors = torch.full((padded.shape[0], 1), ref.FORMATS[fmt].max, dtype=values.dtype)
    return torch.cat([anchors, padded], dim=1)


def encode_with_unit_scale(run, values: torch.Tensor, fmt: str) -> torch.Tensor:
    """coat's codes of values (|v| <= E_MAX), unpacked, through quantize_blocks with scale 1.0."""
    x = with_unit_scale(values, fmt)
    codes, scales = run(coat.ops.quantize_blocks, x, fmt, 16)
    assert_same_bits(scales, torch.ones(x.shape[0], 1), "unit scales")
    return ref.unpack(codes, 16, fmt)[:, 1:].flatten()[: values.numel()]


# ------------------------------------------------------------------------------------------- the oracle


def test_oracle_grids_are_the_formats_bit_fields():
    """The oracle lists each grid as the spec's table; the codes' bit fields (sign, two exponent bits of bias 1,
    M mantissa bits: m * 2^-M when e == 0, else (1 + m * 2^-M) * 2^(e - 1)) give the same values in code order."""
    for fmt, mantissa_bits in (("fp4", 1), ("fp6", 3)):
        f = ref.FORMATS[fmt]
        values = []
        for code in range(2 * f.sign):
            e, m = (code >> mantissa_bits) & 3, code & ((1 << mantissa_bits) - 1)
            magnitude = m * 2.0**-mantissa_bits if e == 0 else (1 + m * 2.0**-mantissa_bits) * 2.0 ** (e - 1)
            values.append(-magnitude if code & f.sign else magnitude)
        assert_same_bits(ref.decode(torch.arange(2 * f.sign), fmt), torch.tensor(values, dtype=torch.float64), fmt)
    assert ref.FP4.max == 6.0 and ref.FP6.max == 7.5 and ref.FP4.sign == 0x8 and ref.FP6.sign == 0x20


def test_oracle_packing_layout():
    """Hand-packed rows: FP4 low nibble first; FP6 element 4i+j in bits 6j..6j+5 of bytes 3i..3i+2, little-endian,
    0 bits after the last code; and unpack inverts pack for every width modulo the word."""
    assert_same_bits(ref.pack(torch.tensor([[0x1, 0x2, 0xF]]), "fp4"), torch.tensor([[0x21, 0x0F]], dtype=torch.uint8))
    # 0x01 | 0x02 << 6 | 0x03 << 12 | 0x3F << 18 = 0xFC3081; then 0x2A | 0x15 << 6 = 0x56A
    row = torch.tensor([[0x01, 0x02, 0x03, 0x3F, 0x2A, 0x15]])
    assert_same_bits(ref.pack(row, "fp6"), torch.tensor([[0x81, 0x30, 0xFC, 0x6A, 0x05]], dtype=torch.uint8))
    assert_same_bits(ref.pack(row[:, :5], "fp6"), torch.tensor([[0x81, 0x30, 0xFC, 0x2A]], dtype=torch.uint8))
    assert_same_bits(ref.pack(row[:, :1], "fp6"), torch.tensor([[0x01]], dtype=torch.uint8))
    for fmt in FORMATS:
        f = ref.FORMATS[fmt]
        for cols in range(0, 13):
            codes = torch.randint(0, 2 * f.sign, (3, cols), generator=torch.Generator().manual_seed(cols))
            packed = ref.pack(codes, fmt)
            assert packed.shape == (3, ROW_BYTES[fmt](cols))
            assert_same_bits(ref.unpack(packed, cols, fmt), codes.to(torch.uint8), f"{fmt} cols={cols}")


# ------------------------------------------------------------------------------------ against the oracle


@pytest.mark.parametrize("shape, dtype, block_size", block_cases())
def test_matches_reference(run, rng, fmt, shape, dtype, block_size):
    check_blocks(run, random_input(shape, dtype, rng), fmt, block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=DTYPE_NAMES.get)
def test_every_block_size_and_dtype(run, rng, fmt, dtype, block_size):
    check_blocks(run, random_input((41, 300), dtype, rng), fmt, block_size)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=DTYPE_NAMES.get)
def test_encoder_on_every_16_bit_value_up_to_e_max(run, fmt, dtype):
    """Exhaustive: every bf16 / fp16 bit pattern with |v| <= E_MAX (6 or 7.5; zeros, subnormals, every tie)
    encodes as the nearest-even oracle says."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = every[every.float().abs() <= ref.FORMATS[fmt].max]
    assert_same_bits(encode_with_unit_scale(run, values, fmt), ref.encode(values.float(), fmt))


def e2m3_midpoints() -> dict[float, tuple[int, int, int]]:
    """E2M3's midpoints from its bit fields: between code c (e = c >> 3, m = c & 7) and c + 1, with the codes of
    (just below, the midpoint, just above): c, the even one of c and c + 1, c + 1."""
    value = lambda c: (c & 7) / 8 if c < 8 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 1)
    return {(value(c) + value(c + 1)) / 2: (c, c + (c & 1), c + 1) for c in range(31)}


# Each format's midpoints between neighbouring magnitudes, each with the codes of the fp32 value one ulp below, the
# midpoint itself and one ulp above.
MIDPOINTS = {
    "fp4": {0.25: (0, 0, 1), 0.75: (1, 2, 2), 1.25: (2, 2, 3), 1.75: (3, 4, 4), 2.5: (4, 4, 5), 3.5: (5, 6, 6),
            5.0: (6, 6, 7)},
    "fp6": e2m3_midpoints(),
}


def test_e2m3_midpoint_table():
    """Spot checks of the generated E2M3 table against the step sizes 1/8 below 2, 1/4 in [2, 4), 1/2 from 4."""
    table = MIDPOINTS["fp6"]
    assert len(table) == 31
    assert table[0.0625] == (0, 0, 1) and table[0.1875] == (1, 2, 2) and table[0.9375] == (7, 8, 8)
    assert table[1.9375] == (15, 16, 16) and table[2.125] == (16, 16, 17) and table[3.875] == (23, 24, 24)
    assert table[4.25] == (24, 24, 25) and table[6.75] == (29, 30, 30) and table[7.25] == (30, 30, 31)


def test_encoder_at_and_around_every_midpoint(run, fmt):
    """Each grid midpoint rounds to the even code; one fp32 ulp either side goes to its side."""
    sign = ref.FORMATS[fmt].sign
    values, expected = [], []
    for midpoint, codes in MIDPOINTS[fmt].items():
        m = torch.tensor(midpoint)
        below, above = torch.nextafter(m, torch.tensor(0.0)), torch.nextafter(m, torch.tensor(float("inf")))
        for value, code in zip((below, m, above), codes):
            values += [float(value), -float(value)]
            expected += [code, code | sign]
    values = torch.tensor(values, dtype=torch.float32)
    expected = torch.tensor(expected, dtype=torch.uint8)
    assert_same_bits(ref.encode(values, fmt), expected, "oracle")
    assert_same_bits(encode_with_unit_scale(run, values, fmt), expected, "coat")


def test_every_code_decodes_and_expands_exactly(run, fmt):
    """Every code (both zeros, every magnitude of both signs) under scales 1, 2^-130 (a subnormal product), 3 and
    2^100: dequantize_blocks and blocks_to_e4m3 agree with the oracle, and the E4M3 expansion reads back the same."""
    f = ref.FORMATS[fmt]
    every = torch.arange(2 * f.sign)
    codes = ref.pack(every.repeat(4, 128 // every.numel()), fmt)  # 4 rows of 128 codes, one block of 128 each
    scales = torch.tensor([[1.0], [2.0**-130], [3.0], [2.0**100]])
    for dtype in OUT_DTYPES:
        out = run(coat.ops.dequantize_blocks, codes, scales, 128, fmt, 128, dtype)
        assert_same_bits(out, ref.dequantize(codes, scales, 128, fmt, 128, dtype), f"{dtype}")
        q, _ = run(coat.ops.blocks_to_e4m3, codes, scales, 128, fmt, 128)
        assert_same_bits(run(coat.ops.dequantize, q, scales, 128, dtype), out, f"E4M3 round trip {dtype}")
    assert_same_bits(out[0, : every.numel()].float(), ref.decode(every, fmt).float(), "unit scale: the grid itself")
    assert_same_bits(q[0, : every.numel()], ref.to_e4m3(ref.pack(every[None], fmt), every.numel(), fmt)[0], "E4M3 codes")


@pytest.mark.parametrize("cols", [1, 2, 3, 4, 5, 6, 7, 37, 50, 131, 300])
def test_random_code_bytes(run, rng, fmt, cols):
    """Arbitrary bytes as codes, the bits past the last code included (those must be ignored): dequantize_blocks
    and blocks_to_e4m3 read exactly what the oracle unpacks."""
    f = ref.FORMATS[fmt]
    codes = torch.randint(0, 256, (9, f.row_bytes(cols)), generator=rng, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(9, -(-cols // 16), generator=rng) * 4
    for dtype in OUT_DTYPES:
        out = run(coat.ops.dequantize_blocks, codes, scales, cols, fmt, 16, dtype)
        assert_same_bits(out, ref.dequantize(codes, scales, cols, fmt, 16, dtype), f"{dtype}")
    q, _ = run(coat.ops.blocks_to_e4m3, codes, scales, cols, fmt, 16)
    assert_same_bits(q, ref.to_e4m3(codes, cols, fmt))


def test_every_bfloat16_pattern_as_input(run, rng, fmt):
    """All 65536 bf16 patterns, shuffled into blocks: NaN, Inf, huge, tiny and subnormal inputs together."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[torch.randperm(every.numel(), generator=rng)].reshape(512, 128)
    for block_size in BLOCK_SIZES:
        check_blocks(run, x, fmt, block_size)


def test_random_float32_bit_patterns(run, rng, fmt):
    bits = torch.randint(-(2**31), 2**31, (1 << 16,), generator=rng, dtype=torch.int64).to(torch.int32)
    check_blocks(run, bits.view(torch.float32).reshape(256, 256), fmt, 32)


# --------------------------------------------------------------------------------- layouts and shapes


STRIDED_VIEWS = {
    "column-slice": lambda dtype, rng: poisoned((50, 300), 200, dtype, rng)[:, :200],
    "odd-column-slice": lambda dtype, rng: poisoned((50, 300), 37, dtype, rng)[:, :37],
    "2-mod-4-column-slice": lambda dtype, rng: poisoned((50, 300), 142, dtype, rng)[:, :142],
    "3-mod-4-column-slice": lambda dtype, rng: poisoned((50, 300), 75, dtype, rng)[:, :75],
    "unaligned-offset-slice": lambda dtype, rng: poisoned((50, 300), 133, dtype, rng)[3:40, 5:133],
    "unaligned-row-stride": lambda dtype, rng: poisoned((40, 131), 128, dtype, rng)[:, :128],
    "3d-slice": lambda dtype, rng: poisoned((2, 3, 300), 77, dtype, rng)[:, :, :77],
}


@pytest.mark.parametrize("view", STRIDED_VIEWS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=DTYPE_NAMES.get)
def test_strided_inputs_equal_their_contiguous_copy(run, rng, fmt, view, dtype):
    x = STRIDED_VIEWS[view](dtype, rng)
    assert not x.is_contiguous()
    for block_size in (16, 128):
        assert_same_bits(run(coat.ops.quantize_blocks, x, fmt, block_size),
                         run(coat.ops.quantize_blocks, x.contiguous(), fmt, block_size))
        check_blocks(run, x, fmt, block_size)


@pytest.mark.parametrize("shape", [(97, 37), (2, 3, 40), (37,), (4, 0), (5, 6), (3, 2, 3)], ids=shape_id)
def test_output_shapes_dtypes_devices_and_strides(move, device, fmt, shape):
    x = move(torch.randn(shape))
    cols = shape[-1]
    codes, scales = coat.ops.quantize_blocks(x, fmt, 32)
    packed = (*shape[:-1], ROW_BYTES[fmt](cols))
    assert (codes.shape, codes.dtype, codes.device.type, codes.is_contiguous()) == (packed, torch.uint8, device, True)
    assert (scales.shape, scales.dtype, scales.device.type, scales.is_contiguous()) == ((*shape[:-1], -(-cols // 32)), torch.float32, device, True)
    assert_same_bits(coat.ops.quantize_blocks(x, fmt), coat.ops.quantize_blocks(x, fmt, 16), "default block_size=16")
    for dtype in OUT_DTYPES:
        out = coat.ops.dequantize_blocks(codes, scales, cols, fmt, 32, dtype)
        assert (out.shape, out.dtype, out.device.type, out.is_contiguous()) == (x.shape, dtype, device, True)
    assert coat.ops.dequantize_blocks(*coat.ops.quantize_blocks(x, fmt), cols, fmt).dtype == torch.bfloat16
    q, passed = coat.ops.blocks_to_e4m3(codes, scales, cols, fmt, 32)
    assert (q.shape, q.dtype, q.device.type, q.is_contiguous()) == (x.shape, torch.float8_e4m3fn, device, True)
    assert passed is scales


def test_fp4_names_are_the_fp4_format(run, rng):
    """quantize_fp4, dequantize_fp4 and fp4_to_e4m3 are quantize_blocks & co. with format="fp4", defaults included;
    the native ops behind "fp4" and "fp6" are torch.ops.coat.*_fp4 and *_fp6."""
    x = random_input((7, 75), torch.bfloat16, rng)
    codes, scales = run(coat.ops.quantize_fp4, x)
    assert_same_bits((codes, scales), run(coat.ops.quantize_blocks, x, "fp4", 16))
    assert_same_bits(run(coat.ops.dequantize_fp4, codes, scales, 75),
                     run(coat.ops.dequantize_blocks, codes, scales, 75, "fp4", 16, torch.bfloat16))
    assert_same_bits(run(coat.ops.fp4_to_e4m3, codes, scales, 75, 16),
                     run(coat.ops.blocks_to_e4m3, codes, scales, 75, "fp4"))
    for fmt in FORMATS:
        codes, scales = run(coat.ops.quantize_blocks, x, fmt, 32)
        native = lambda name: getattr(torch.ops.coat, name.format(fmt))
        assert_same_bits(run(native("quantize_{}"), x, 32), (codes, scales), f"{fmt} quantize")
        assert_same_bits(run(native("dequantize_{}"), codes, scales, 75, 32, torch.float32),
                         run(coat.ops.dequantize_blocks, codes, scales, 75, fmt, 32, torch.float32), f"{fmt} dequantize")
        assert_same_bits(run(native("{}_to_e4m3"), codes, scales, 75, 32),
                         run(coat.ops.blocks_to_e4m3, codes, scales, 75, fmt, 32)[0], f"{fmt} to E4M3")


# ---------------------------------------------------------------------------------------- edge values


def blocks(*values_per_block, block_size=16) -> torch.Tensor:
    """One float32 row of blocks, each given as a list padded with its last value."""
    row = []
    for values in values_per_block:
        row += list(values) + [values[-1]] * (block_size - len(values))
    return torch.tensor([row], dtype=torch.float32)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_representable_values_are_lossless(run, rng, fmt, block_size):
    """Blocks of grid values times a power of two, each holding +-E_MAX * 2^k: scale 2^k, so the codes are the
    values and dequantization gives them back exactly."""
    f = ref.FORMATS[fmt]
    rows, cols = 64, 4 * block_size
    codes = torch.randint(0, 2 * f.sign, (rows, cols), generator=rng)
    codes[:, ::block_size] = torch.where(torch.rand(rows, cols // block_size, generator=rng) < 0.5, f.max_code,
                                         f.max_code | f.sign)
    powers = torch.pow(2.0, torch.randint(-120, 120, (rows, cols // block_size), generator=rng).double())
    x = (ref.decode(codes, fmt) * ref.expand_blocks(powers, cols, block_size)).float()
    packed, scales = check_blocks(run, x, fmt, block_size)
    assert_same_bits(ref.unpack(packed, cols, fmt), codes.to(torch.uint8), "codes are the values")
    assert_same_bits(run(coat.ops.dequantize_blocks, packed, scales, cols, fmt, block_size, torch.float32), x, "lossless")
    bf16 = x.to(torch.bfloat16)
    assert_same_bits(run(coat.ops.dequantize_blocks, *run(coat.ops.quantize_blocks, bf16, fmt, block_size), cols, fmt,
                         block_size), bf16)


def test_zeros(run, fmt):
    """All-zero blocks get the 2^-126 floor and come back as exact zeros, signs included, never NaN."""
    e_max = ref.FORMATS[fmt].max
    x = blocks([0.0], [-0.0], [0.0, -0.0, 0.0], [0.0, e_max, -0.0, -e_max / 2])
    codes, scales = check_blocks(run, x, fmt, 16)
    assert_same_bits(scales[0], torch.tensor([MIN_SCALE] * 3 + [1.0]), "floor")
    for dtype in OUT_DTYPES:
        out = run(coat.ops.dequantize_blocks, codes, scales, 64, fmt, 16, dtype)
        assert_same_bits(out, x.to(dtype), "exact")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=DTYPE_NAMES.get)
def test_constant_blocks_encode_to_e_max(run, fmt, dtype):
    """A constant block has amax * fp32(1 / scale) = E_MAX (6 or 7.5) up to two fp32 roundings: every element
    encodes to the largest code of its sign and comes back within 2^-23."""
    f = ref.FORMATS[fmt]
    constants = [1.0, -3.0, 1e-30, 1e30, 3.0e38, -3.3e38]  # up to near the fp32 (and bf16) max
    x = blocks(*[[c] for c in constants]).to(dtype)
    codes, scales = check_blocks(run, x, fmt, 16)
    expected = torch.tensor([f.max_code | f.sign if c < 0 else f.max_code for c in constants], dtype=torch.uint8)
    assert_same_bits(ref.unpack(codes, x.shape[-1], fmt)[0], expected.repeat_interleave(16))
    out = run(coat.ops.dequantize_blocks, codes, scales, x.shape[-1], fmt, 16, torch.float32).double()
    assert float(((out - x.double()) / x.double()).abs().max()) <= 2.0**-23


def test_amax_over_e_max_rounding_down_saturates(run, rng, fmt):
    """fp32(amax / E_MAX) and its fp32 reciprocal may round so that amax times the reciprocal is a hair above
    E_MAX: it saturates to the code of E_MAX."""
    f = ref.FORMATS[fmt]
    amax = (torch.rand(4096, generator=rng, dtype=torch.float64) * 100 + 1).float()
    reciprocal = (1.0 / (amax.double() / f.max).float().double()).float()
    above = (amax.double() * reciprocal.double()) > f.max
    assert int(above.sum()) > 100
    x = torch.cat([amax[:, None], torch.zeros(4096, 15)], dim=1)
    codes, _ = check_blocks(run, x, fmt, 16)
    assert bool((ref.unpack(codes, 16, fmt)[:, 0] == f.max_code).all())


def test_nan_makes_its_whole_block_nan(run, fmt):
    """A NaN sets its block's scale to NaN: every element of that block dequantizes to NaN, in the block format
    and after the E4M3 expansion; the other blocks of the row are untouched."""
    nan, e_max = float("nan"), ref.FORMATS[fmt].max
    x = blocks([1.0, nan, 2.0], [e_max / 4, -e_max / 2], [nan], [-nan, 3.0], [0.0, nan])
    codes, scales = check_blocks(run, x, fmt, 16)
    nan_blocks = torch.tensor([True, False, True, True, True])
    assert_same_bits(torch.isnan(scales[0]), nan_blocks, "NaN scales")
    for dtype in OUT_DTYPES:
        out = run(coat.ops.dequantize_blocks, codes, scales, 80, fmt, 16, dtype)
        assert_same_bits(torch.isnan(out[0]), nan_blocks.repeat_interleave(16), "NaN blocks")
        assert_same_bits(out[0, 16:32], x[0, 16:32].to(dtype), "a clean block is exact")


def test_inf_makes_its_whole_block_nan(run, fmt):
    """+-Inf gives its block an Inf scale; every code of the block is a zero (finite / Inf is 0, Inf / Inf is
    NaN, which encodes to zero), signed like x, so the block dequantizes to 0 * Inf = NaN."""
    inf, f = float("inf"), ref.FORMATS[fmt]
    x = blocks([1.0, inf, -2.0, -inf], [-inf], [f.max / 2, f.max])
    codes, scales = check_blocks(run, x, fmt, 16)
    assert_same_bits(scales[0], torch.tensor([inf, inf, 1.0]), "Inf scales")
    signs = torch.where(x[0, :32] < 0, f.sign, 0).to(torch.uint8)
    assert_same_bits(ref.unpack(codes, 48, fmt)[0, :32], signs, "signed zero codes")
    for dtype in OUT_DTYPES:
        out = run(coat.ops.dequantize_blocks, codes, scales, 48, fmt, 16, dtype)
        assert bool(torch.isnan(out[0, :32]).all()) and not bool(torch.isnan(out[0, 32:]).any())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=DTYPE_NAMES.get)
def test_tiny_and_subnormal_values(run, rng, fmt, dtype):
    """Blocks of fp32 (bf16) subnormals and tiny normals get the 2^-126 floor and encode x * 2^126: those
    below half the smallest nonzero grid value (2^-128 for FP4, 2^-130 for FP6) become zeros, the rest keep their
    nearest grid values."""
    f = ref.FORMATS[fmt]
    mantissa = torch.randint(1, 0x800000, (8, 16), generator=rng)
    if dtype == torch.bfloat16:
        mantissa = (mantissa >> 16).clamp(min=1) << 16
    subnormals = mantissa.to(torch.int32).view(torch.float32) * torch.where(torch.rand(8, 16, generator=rng) < 0.5, -1.0, 1.0)
    tiny = (torch.rand(8, 16, generator=rng) * f.max * MIN_SCALE).float()  # normals up to E_MAX * 2^-126: still the floor
    x = torch.cat([subnormals, tiny], dim=1).to(dtype)
    codes, scales = check_blocks(run, x, fmt, 16)
    assert_same_bits(scales, torch.full((8, 2), MIN_SCALE))
    assert bool((ref.unpack(codes, 32, fmt) & (f.sign - 1) != 0).any()), "some tiny values must survive as nonzero codes"


def test_huge_values(run, fmt):
    """Values up to the fp32 max: the scale stays finite (amax / E_MAX) and the block max comes back within an
    fp32 rounding."""
    big = torch.finfo(torch.float32).max
    x = blocks([big, -big / 3, big / 1e3], [-big, 1.0])
    codes, scales = check_blocks(run, x, fmt, 16)
    assert bool(torch.isfinite(scales).all())
    out = run(coat.ops.dequantize_blocks, codes, scales, 32, fmt, 16, torch.float32)
    assert float(((out[0, [0, 16]].double() - x[0, [0, 16]].double()) / big).abs().max()) <= 2**-23


# ------------------------------------------------------------------------------------------ error stats


def outlier_input(shape, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian data with 0.1% of the elements 100x larger, as activation outlier channels look; returns
    the data and the mask of the outliers."""
    x = torch.randn(shape, generator=rng, dtype=torch.float64)
    outliers = torch.rand(shape, generator=rng) < 1e-3
    return torch.where(outliers, x * 100, x).float(), outliers


# Relative RMS error ||x' - x|| / ||x|| per format and block size, bounded 10% above the values measured on
# 1024 x 4096 seeded inputs: the table the choice of format and B is read from (pytest -s prints it). On outlier
# data the whole-tensor figure is dominated by the outliers themselves, which every B keeps well; the "bulk" row
# takes the same ratio over the other 99.9% of the elements, whose blocks an outlier coarsens.
ERROR_BOUNDS = {
    "fp4": {
        "gaussian": {16: 0.104, 32: 0.112, 64: 0.117, 128: 0.12},
        "outliers": {16: 0.048, 32: 0.061, 64: 0.081, 128: 0.108},
        "outliers (bulk)": {16: 0.156, 32: 0.2, 64: 0.263, 128: 0.352},
    },
    "fp6": {
        "gaussian": {16: 0.0247, 32: 0.0267, 64: 0.0282, 128: 0.0292},
        "outliers": {16: 0.0197, 32: 0.0274, 64: 0.0382, 128: 0.0531},
        "outliers (bulk)": {16: 0.0642, 32: 0.0893, 64: 0.125, 128: 0.173},
    },
}
FORMAT_TITLES = {"fp4": "FP4 E2M1", "fp6": "FP6 E2M3"}


def relative_rms_error(out: torch.Tensor, x: torch.Tensor, where: torch.Tensor) -> float:
    return float((out.double() - x.double())[where].norm() / x.double()[where].norm())


def test_relative_rms_error_by_block_size(rng, fmt):
    gaussian = torch.randn((1024, 4096), generator=rng)
    with_outliers, outliers = outlier_input((1024, 4096), rng)
    cases = {"gaussian": (gaussian, torch.ones_like(outliers)), "outliers": (with_outliers, torch.ones_like(outliers)),
             "outliers (bulk)": (with_outliers, ~outliers)}
    lines = [f"{FORMAT_TITLES[fmt]} relative RMS error ||x' - x|| / ||x|| (1024 x 4096, float32 in, float32 out)",
             f"{'data':<16}" + "".join(f"{'B=' + str(b):>9}" for b in BLOCK_SIZES) + f"{'E4M3 G=16':>11}"]
    for name, (x, where) in cases.items():
        row = {}
        for block_size in BLOCK_SIZES:
            codes, scales = coat.ops.quantize_blocks(x, fmt, block_size)
            out = coat.ops.dequantize_blocks(codes, scales, x.shape[-1], fmt, block_size, torch.float32)
            row[block_size] = relative_rms_error(out, x, where)
        q, scales, _ = coat.ops.quantize_group(x, 16)
        fp8 = relative_rms_error(coat.ops.dequantize(q, scales, 16, torch.float32), x, where)
        lines.append(f"{name:<16}" + "".join(f"{row[b]:>9.4f}" for b in BLOCK_SIZES) + f"{fp8:>11.4f}")
        for block_size, error in row.items():
            assert error <= ERROR_BOUNDS[fmt][name][block_size], f"{fmt} {name} B={block_size}: {error:.4f}"
        assert row[16] < row[32] < row[64] < row[128], f"{name}: smaller blocks must track the data more closely"
    print("\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------- errors


# How each format's packing is named in the "cols=... needs ..." message.
PACKING = {"fp4": r"ceil\(cols / 2\)", "fp6": r"ceil\(3 cols / 4\)"}


def error_cases(fmt: str) -> dict:
    """name: (call(move), the RuntimeError's message) for one format; the byte counts come from ROW_BYTES."""
    quantize = lambda x, *args: coat.ops.quantize_blocks(x, fmt, *args)
    dequantize = lambda codes, scales, cols, *args, **kwargs: coat.ops.dequantize_blocks(codes, scales, cols, fmt, *args, **kwargs)
    to_e4m3 = lambda codes, scales, cols, *args: coat.ops.blocks_to_e4m3(codes, scales, cols, fmt, *args)
    nbytes = ROW_BYTES[fmt]
    zero_codes = lambda m, rows, cols: m(torch.zeros(rows, nbytes(cols), dtype=torch.uint8))
    q, dq, e4m3 = rf"coat\.quantize_{fmt}", rf"coat\.dequantize_{fmt}", rf"coat\.{fmt}_to_e4m3"
    python_q = r"coat\.ops\.quantize_fp4" if fmt == "fp4" else r"coat\.ops\.quantize_blocks\(x, 'fp6'\)"
    return {
        "quantize-int32": (lambda m: quantize(m(torch.ones(4, 16, dtype=torch.int32))),
                           rf"{q}: x must be float32, bfloat16 or float16, got Int"),
        "quantize-block-8": (lambda m: quantize(m(torch.ones(4, 16)), 8),
                             rf"{q}: block_size must be 16, 32, 64 or 128, got 8"),
        "quantize-0d": (lambda m: quantize(m(torch.tensor(1.0))),
                        rf"{q}: x must have at least one dimension, got a 0-d tensor"),
        "quantize-transposed": (lambda m: quantize(m(torch.ones(16, 32)).T),
                                rf"{q}: x: the last dimension must be contiguous .* Call \.contiguous\(\) first"),
        "dequantize-block-24": (lambda m: dequantize(*quantize(m(torch.ones(4, 48))), 48, 24),
                                rf"{dq}: block_size must be 16, 32, 64 or 128, got 24"),
        "dequantize-float-codes": (lambda m: dequantize(m(torch.zeros(4, nbytes(16))), m(torch.ones(4, 1)), 16),
                                   rf"{dq}: codes must be torch\.uint8 \(packed codes, as {python_q} returns\), got Float"),
        "dequantize-wrong-cols": (lambda m: dequantize(*quantize(m(torch.ones(4, 37))), 40),
                                  rf"{dq}: cols=40 needs {PACKING[fmt]} = {nbytes(40)} bytes of codes per row, but codes "
                                  rf"has shape \[4, {nbytes(37)}\]"),
        "dequantize-fewer-cols": (lambda m: dequantize(*quantize(m(torch.ones(4, 42))), 37),
                                  rf"{dq}: cols=37 needs {PACKING[fmt]} = {nbytes(37)} bytes of codes per row, but codes "
                                  rf"has shape \[4, {nbytes(42)}\]"),
        "dequantize-negative-cols": (lambda m: dequantize(m(torch.zeros(4, 0, dtype=torch.uint8)), m(torch.ones(4, 0)), -1),
                                     rf"{dq}: cols=-1 needs"),
        "dequantize-scales-shape": (lambda m: dequantize(zero_codes(m, 4, 40), m(torch.ones(4, 2)), 40),
                                    rf"{dq}: with block_size=16 and cols=40 scales must have shape \[4, 3\], got \[4, 2\]"),
        "dequantize-block-size-mismatch": (lambda m: dequantize(*quantize(m(torch.ones(4, 40)), 16), 40, 32),
                                           rf"{dq}: with block_size=32 and cols=40 scales must have shape \[4, 2\], got \[4, 3\]"),
        "dequantize-float64-scales": (lambda m: dequantize(zero_codes(m, 4, 16), m(torch.ones(4, 1, dtype=torch.float64)), 16),
                                      rf"{dq}: scales must be a contiguous float32 tensor, as {python_q} returns, got Double"),
        "dequantize-non-contiguous-scales": (lambda m: dequantize(zero_codes(m, 4, 128), m(torch.ones(8, 4)).T, 128),
                                             rf"{dq}: scales must be a contiguous float32 tensor.*\(non-contiguous\)"),
        "dequantize-non-contiguous-codes": (lambda m: dequantize(m(torch.zeros(nbytes(32), 4, dtype=torch.uint8)).T, m(torch.ones(4, 1)), 32),
                                            rf"{dq}: codes must be a contiguous tensor"),
        "dequantize-to-float16": (lambda m: dequantize(*quantize(m(torch.ones(4, 16))), 16, dtype=torch.float16),
                                  rf"{dq}: dtype must be torch\.float32 or torch\.bfloat16, got Half"),
        "e4m3-wrong-cols": (lambda m: to_e4m3(*quantize(m(torch.ones(4, 16))), 18),
                            rf"{e4m3}: cols=18 needs {PACKING[fmt]} = {nbytes(18)} bytes of codes per row, but codes has "
                            rf"shape \[4, {nbytes(16)}\]"),
        "e4m3-block-size-mismatch": (lambda m: to_e4m3(*quantize(m(torch.ones(4, 40)), 32), 40, 16),
                                     rf"{e4m3}: with block_size=16 and cols=40 scales must have shape \[4, 3\], got \[4, 2\]"),
        "e4m3-block-7": (lambda m: to_e4m3(*quantize(m(torch.ones(4, 16))), 16, 7),
                         rf"{e4m3}: block_size must be 16, 32, 64 or 128, got 7"),
    }


ERRORS = {fmt: error_cases(fmt) for fmt in FORMATS}


@pytest.mark.parametrize("fmt, case", [pytest.param(f, c, id=f"{f}-{c}") for f in FORMATS for c in ERRORS[f]])
def test_errors_say_what_is_wrong(move, fmt, case):
    call, message = ERRORS[fmt][case]
    with pytest.raises(RuntimeError, match=message):
        call(move)


def test_the_packed_widths_in_the_messages():
    """The byte counts the error cases expect, written out: FP4 37 -> 19, 40 -> 20; FP6 37 -> 28, 40 -> 30,
    16 -> 12, 18 -> 14, 42 -> 32."""
    assert [ROW_BYTES["fp4"](c) for c in (37, 40, 16, 18, 42)] == [19, 20, 8, 9, 21]
    assert [ROW_BYTES["fp6"](c) for c in (37, 40, 16, 18, 42)] == [28, 30, 12, 14, 32]
    for fmt in FORMATS:
        assert all(ROW_BYTES[fmt](c) == ref.FORMATS[fmt].row_bytes(c) for c in range(200))


@pytest.mark.parametrize("call", [
    pytest.param(lambda: coat.ops.quantize_blocks(torch.ones(4, 16), "e4m3"), id="quantize_blocks"),
    pytest.param(lambda: coat.ops.dequantize_blocks(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), 16, "FP4"),
                 id="dequantize_blocks"),
    pytest.param(lambda: coat.ops.blocks_to_e4m3(torch.zeros(4, 12, dtype=torch.uint8), torch.ones(4, 1), 16, "fp8"),
                 id="blocks_to_e4m3"),
])
def test_unknown_format_names(call):
    with pytest.raises(ValueError, match=r"coat\.ops\.\w+_(blocks|to_e4m3): format must be 'fp4' or 'fp6', got '"):
        call()


def test_fake_checks_the_block_size(fmt):
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=rf"coat\.quantize_{fmt}: block_size must be"):
        getattr(torch.ops.coat, f"quantize_{fmt}")(mode.from_tensor(torch.ones(4, 16)), 48)


def test_tensors_on_different_devices(cuda_device, fmt):
    codes, scales = coat.ops.quantize_blocks(torch.ones(4, 40, device=cuda_device), fmt)
    for op, call in ((f"dequantize_{fmt}", coat.ops.dequantize_blocks), (f"{fmt}_to_e4m3", coat.ops.blocks_to_e4m3)):
        with pytest.raises(RuntimeError, match=rf"coat\.{op}: scales is on cpu but the input is on cuda:0"):
            call(codes, scales.cpu(), 40, fmt)


# ------------------------------------------------------------------------------- torch.library integration


def _opcheck_cases():
    x = lambda *shape, dtype=torch.float32: random_input(shape, dtype, torch.Generator().manual_seed(sum(shape)))
    codes = lambda *shape: torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(3), dtype=torch.int32).to(torch.uint8)
    scales = lambda *shape: torch.rand(shape, generator=torch.Generator().manual_seed(5)) + 0.5
    cases = {}
    for fmt in FORMATS:
        quantize, dequantize = getattr(torch.ops.coat, f"quantize_{fmt}"), getattr(torch.ops.coat, f"dequantize_{fmt}")
        to_e4m3, nbytes = getattr(torch.ops.coat, f"{fmt}_to_e4m3"), ROW_BYTES[fmt]
        cases.update({
            f"quantize_{fmt}-2d-odd": (quantize.default, lambda: (x(97, 37), 16)),
            f"quantize_{fmt}-2d-2-mod-4": (quantize.default, lambda: (x(9, 50), 32)),
            f"quantize_{fmt}-3d": (quantize.default, lambda: (x(2, 3, 40, dtype=torch.bfloat16), 32)),
            f"quantize_{fmt}-strided": (quantize.default, lambda: (x(20, 300, dtype=torch.float16)[:, :203], 128)),
            f"quantize_{fmt}-empty": (quantize.default, lambda: (x(0, 37), 64)),
            f"dequantize_{fmt}": (dequantize.default,
                                  lambda nbytes=nbytes: (codes(5, nbytes(39)), scales(5, 3), 39, 16, torch.float32)),
            f"dequantize_{fmt}-3d-bf16": (dequantize.default, lambda nbytes=nbytes: (codes(2, 3, nbytes(42)), scales(2, 3, 1),
                                                                                     42, 64, torch.bfloat16)),
            f"{fmt}_to_e4m3": (to_e4m3.default, lambda nbytes=nbytes: (codes(5, nbytes(41)), scales(5, 2), 41, 32)),
        })
    return cases


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(move, case):
    op, make_args = OPCHECK_CASES[case]
    args = tuple(move(a) if isinstance(a, torch.Tensor) else a for a in make_args())
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("shape", [(97, 37), (2, 3, 40), (37,), (0, 37), (5, 0), (5, 6), (3, 2, 3)], ids=shape_id)
def test_fake_outputs_match_real_outputs(fmt, shape):
    x = random_input(shape, torch.bfloat16, torch.Generator().manual_seed(0))
    cols = shape[-1]
    quantize, dequantize = getattr(torch.ops.coat, f"quantize_{fmt}"), getattr(torch.ops.coat, f"dequantize_{fmt}")
    to_e4m3 = getattr(torch.ops.coat, f"{fmt}_to_e4m3")
    calls = {
        "quantize": lambda t: quantize(t, 32),
        "dequantize": lambda t: dequantize(*quantize(t, 32), cols, 32, torch.float32),
        "to_e4m3": lambda t: to_e4m3(*quantize(t, 32), cols, 32),
    }
    describe = lambda ts: [(tuple(t.shape), t.dtype, t.stride()) for t in (ts if isinstance(ts, tuple) else (ts,))]
    for name, call in calls.items():
        real = call(x)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = call(mode.from_tensor(x))
        assert describe(fake) == describe(real), f"{fmt} {name}: fake {describe(fake)} vs real {describe(real)}"


def test_torch_compile_fullgraph(run, fmt):
    def save_and_expand(x):
        cols = x.shape[-1]
        codes, scales = coat.ops.quantize_blocks(x, fmt, 32)
        q, scales = coat.ops.blocks_to_e4m3(codes, scales, cols, fmt, 32)
        return codes, scales, q, coat.ops.dequantize_blocks(codes, scales, cols, fmt, 32), coat.ops.dequantize(q, scales, 32)

    # One code object across the format and device parameters: each run starts without the others' graphs, which
    # would otherwise add up to dynamo's recompile limit.
    torch._dynamo.reset()
    compiled = torch.compile(save_and_expand, fullgraph=True, backend="aot_eager", dynamic=True)
    rng = torch.Generator().manual_seed(0)
    for shape in ((97, 200), (2, 5, 71), (3, 50)):
        x = random_input(shape, torch.bfloat16, rng)
        assert_same_bits(run(compiled, x), run(save_and_expand, x))
