"""coat.ops quantizers (quantize_group, group_amax, quantize_tensor, tensor_amax, quantize_tensors) and
dequantize.

Every result is checked bit for bit against the float64 oracle in reference.py; on CUDA, `run` also checks
it against the C core on the CPU. Inputs are drawn on the CPU from per-test seeded generators.
"""
import itertools
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import coat
import reference
from conftest import requires_cuda
from reference import MIN_SCALE, assert_same_bits

GROUP_SIZES = (16, 32, 64, 128)
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = ("e4m3", "e5m2")
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# Rows 1, 97, 123, 4097 and columns 1, 16, 37, 128, 200, 4096: exact multiples of every group size, short
# last groups, a single partial group, single columns and single rows; rows 100 and 136 (multiples of 4 and 8:
# the CUDA transposes' word and 8-byte stores). Not every pairing, to stay fast.
SHAPES = [(1, 1), (1, 37), (1, 4096), (97, 37), (97, 200), (123, 16), (123, 128), (4097, 1), (4097, 37), (4097, 200),
          (123, 4096), (100, 200), (136, 4096)]


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def random_input(shape, dtype, rng) -> torch.Tensor:
    """Normal values with a per-row magnitude of 2^-8..2^8, a quarter of them shrunk by up to 2^-20, so
    rows get different scales and codes land across the FP8 range, in its subnormals and at zero."""
    x = torch.randn(shape, generator=rng, dtype=torch.float64)
    shrink = torch.pow(2.0, -torch.randint(0, 21, shape, generator=rng).double())
    x = torch.where(torch.rand(shape, generator=rng) < 0.25, x * shrink, x)
    row = torch.pow(2.0, torch.randint(-8, 9, (*shape[:-1], 1), generator=rng).double())
    return (x * row).to(dtype)


def quantizer_cases():
    """Each shape with every (input dtype, format) pair; the group size rotates so that each shape meets
    every group size and each (dtype, format, group size) triple occurs."""
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, (dtype, fmt) in enumerate(itertools.product(INPUT_DTYPES, FORMATS)):
            group_size = GROUP_SIZES[(i + j) % len(GROUP_SIZES)]
            cases.append(pytest.param(shape, dtype, fmt, group_size,
                                      id=f"{shape_id(shape)}-{DTYPE_NAMES[dtype]}-{fmt}-g{group_size}"))
    return cases


def amax_cases():
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, dtype in enumerate(INPUT_DTYPES):
            group_size = GROUP_SIZES[(i + j) % len(GROUP_SIZES)]
            cases.append(pytest.param(shape, dtype, group_size,
                                      id=f"{shape_id(shape)}-{DTYPE_NAMES[dtype]}-g{group_size}"))
    return cases


def transposed_codes(codes: torch.Tensor) -> torch.Tensor:
    """q_t as documented: q viewed as a (rows, cols) matrix, transposed, contiguous."""
    cols = codes.shape[-1]
    return codes.reshape(math.prod(codes.shape[:-1]), cols).T.contiguous()


def check_quantize_group(run, x, group_size, fmt):
    """quantize_group(x) with and without transpose equals the oracle; returns (q, scales)."""
    expected_q, expected_scales = reference.quantize_group(x, group_size, fmt)
    q, scales, q_t = run(coat.ops.quantize_group, x, group_size, fmt, transpose=True)
    assert_same_bits(q, expected_q, "q")
    assert_same_bits(scales, expected_scales, "scales")
    assert_same_bits(q_t, transposed_codes(expected_q), "q_t")
    assert_same_bits(run(coat.ops.quantize_group, x, group_size, fmt), (q, scales, None), "transpose=False")
    return q, scales


def check_quantize_tensor(run, x, fmt, group_size):
    """quantize_tensor(x) with and without transpose equals the oracle; returns (q, scale)."""
    expected_q, expected_scale = reference.quantize_tensor(x, fmt)
    q, scale, q_t = run(coat.ops.quantize_tensor, x, fmt, group_size=group_size, transpose=True)
    assert_same_bits(q, expected_q, "q")
    assert_same_bits(scale, expected_scale, "scale")
    assert_same_bits(q_t, transposed_codes(expected_q), "q_t")
    assert_same_bits(run(coat.ops.quantize_tensor, x, fmt, group_size=group_size), (q, scale, None), "transpose=False")
    return q, scale


# ------------------------------------------------------------------------------------ against the oracle


@pytest.mark.parametrize("shape, dtype, fmt, group_size", quantizer_cases())
def test_quantize_group_matches_reference(run, rng, shape, dtype, fmt, group_size):
    check_quantize_group(run, random_input(shape, dtype, rng), group_size, fmt)


@pytest.mark.parametrize("shape, dtype, group_size", amax_cases())
def test_group_amax_matches_reference(run, rng, shape, dtype, group_size):
    x = random_input(shape, dtype, rng)
    x[torch.rand(shape, generator=rng) < 0.02] = float("nan")  # NaN is ignored
    assert_same_bits(run(coat.ops.group_amax, x, group_size), reference.group_amax(x, group_size))


@pytest.mark.parametrize("shape, dtype, fmt, group_size", quantizer_cases())
def test_quantize_tensor_matches_reference(run, rng, shape, dtype, fmt, group_size):
    x = random_input(shape, dtype, rng)
    q, scale = check_quantize_tensor(run, x, fmt, group_size)
    # A group_amax handed in by a producer gives the same result.
    amax = run(coat.ops.group_amax, x, group_size)
    assert_same_bits(run(coat.ops.quantize_tensor, x, fmt, group_amax=amax), (q, scale, None), "given group_amax")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_tensor_uses_the_given_amax(run, rng, fmt):
    """The scale comes from the group_amax passed in, whatever its shape, even when it is not x's amax:
    larger than x's (codes shrink) or smaller (codes saturate)."""
    x = random_input((33, 70), torch.float32, rng)
    true_amax = float(reference.tensor_amax(x))
    for amax in (torch.tensor(true_amax * 4.0), torch.tensor([[true_amax / 8.0, 0.0], [1e-3, true_amax / 16.0]])):
        expected = reference.quantize_tensor(x, fmt, amax=amax.max())
        q, scale, _ = run(coat.ops.quantize_tensor, x, fmt, group_amax=amax.float())
        assert_same_bits((q, scale), expected)


# Groups of tensors sharing one scale, as coat.nn builds them: the q/k/v weights stacked by rows (GQA: k and v
# smaller), the three output gradients side by side; column slices of a wider matrix are read in place.
STACKED_CASES = {
    "weights-dim0": (0, [(64, 40), (16, 40), (16, 40)]),
    "gradients-dim1": (1, [(97, 37), (97, 16), (97, 5)]),
    "one-tensor-3d-dim1": (1, [(2, 3, 40)]),
    "rows-not-multiple-of-4-dim0": (0, [(3, 24), (5, 24)]),
    "empty-member-dim0": (0, [(0, 40), (7, 40)]),
}


def stacked_inputs(shapes, dtype, rng, strided: bool) -> list[torch.Tensor]:
    """random_input tensors of the given shapes; `strided` makes each a column slice of a wider matrix."""
    tensors = []
    for shape in shapes:
        x = random_input((*shape[:-1], shape[-1] + (8 if strided else 0)), dtype, rng)
        tensors.append(x[..., : shape[-1]])
    return tensors


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=DTYPE_NAMES.get)
def test_tensor_amax_matches_reference(run, rng, dtype):
    tensors = stacked_inputs([(97, 37), (5, 3, 16), (1,)], dtype, rng, strided=False)
    tensors[0][torch.rand((97, 37), generator=rng) < 0.02] = float("nan")  # NaN is ignored
    tensors[2][0] = 2.0**12  # the largest magnitude is in the last, smallest tensor
    expected = torch.stack([reference.tensor_amax(t) for t in tensors]).max()
    assert_same_bits(run(coat.ops.tensor_amax, tensors), expected)
    assert_same_bits(run(coat.ops.tensor_amax, tensors[:1]), reference.tensor_amax(tensors[0]), "one tensor")


def test_tensor_amax_of_zeros_and_empty_tensors_is_zero(run):
    assert_same_bits(run(coat.ops.tensor_amax, [torch.zeros(4, 16), torch.zeros(0, 16)]), torch.tensor(0.0))


@pytest.mark.parametrize("strided", (False, True), ids=("contiguous", "column-slices"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", STACKED_CASES)
def test_quantize_tensors_equals_quantize_tensor_of_the_concatenation(run, rng, case, fmt, strided):
    dim, shapes = STACKED_CASES[case]
    tensors = stacked_inputs(shapes, torch.bfloat16, rng, strided)
    concatenated = torch.cat([as_matrix(t) for t in tensors], dim=dim)
    amax = reference.tensor_amax(concatenated)
    expected_q, expected_scale = reference.quantize_tensor(concatenated, fmt, amax=amax)
    q, scale, q_t = run(coat.ops.quantize_tensors, tensors, fmt, dim=dim, columnwise=True)
    assert_same_bits(q, expected_q, "q")
    assert_same_bits(scale, expected_scale, "scale")
    assert_same_bits(q_t, transposed_codes(expected_q), "q_t")
    only_rows = run(coat.ops.quantize_tensors, tensors, fmt, dim=dim, amax=amax)
    only_columns = run(coat.ops.quantize_tensors, tensors, fmt, dim=dim, amax=amax, rowwise=False, columnwise=True)
    assert_same_bits(only_rows[0], q, "rowwise only")
    assert only_rows[2].numel() == 0 and only_columns[0].numel() == 0
    assert_same_bits(only_columns[2], q_t, "columnwise only")


def dequantize_cases():
    cases = []
    granularities = (*GROUP_SIZES, None)  # None: one per-tensor scale
    for i, shape in enumerate(SHAPES):
        for j, (fmt, dtype) in enumerate(itertools.product(FORMATS, (torch.float32, torch.bfloat16))):
            group_size = granularities[(i + j) % len(granularities)]
            name = f"g{group_size}" if group_size else "tensor"
            cases.append(pytest.param(shape, fmt, dtype, group_size,
                                      id=f"{shape_id(shape)}-{fmt}-{DTYPE_NAMES[dtype]}-{name}"))
    return cases


def random_scales(shape, rng) -> torch.Tensor:
    """Positive float32 scales with random mantissas from 2^-126 (products round into the fp32 subnormals)
    to 2^110 (products overflow to Inf)."""
    exponent = torch.randint(-126, 111, shape, generator=rng).double()
    return ((1 + torch.rand(shape, generator=rng, dtype=torch.float64)) * torch.pow(2.0, exponent)).float()


@pytest.mark.parametrize("shape, fmt, dtype, group_size", dequantize_cases())
def test_dequantize_matches_reference(run, rng, shape, fmt, dtype, group_size):
    f = reference.fp8_format(fmt)
    q = torch.randint(0, 256, shape, generator=rng, dtype=torch.int32).to(torch.uint8).view(f.dtype)  # NaN and Inf codes too
    if group_size is None:
        scale = random_scales((), rng)
        expanded = scale
    else:
        scale = random_scales((*shape[:-1], reference.num_groups(shape[-1], group_size)), rng)
        expanded = reference.expand_group_scales(scale, shape[-1], group_size)
    out = run(coat.ops.dequantize, q, scale, group_size, dtype)
    assert_same_bits(out, reference.dequantize(q, expanded, fmt, dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_accepts_any_one_element_scale(run, rng, fmt):
    x = random_input((5, 40), torch.float32, rng)
    q, scale, _ = coat.ops.quantize_tensor(x, fmt)
    expected = run(coat.ops.dequantize, q, scale, None, torch.float32)
    for shaped in (scale.reshape(1), scale.reshape(1, 1)):
        assert_same_bits(run(coat.ops.dequantize, q, shaped, None, torch.float32), expected)


def test_q_t_dequantizes_with_the_transposed_group_scales(run, rng):
    """The documented reading of q_t: q_t[c, r] goes with scales.view(-1, ngroups)[r, c // group_size]."""
    x = random_input((2, 3, 70), torch.bfloat16, rng)
    q, scales, q_t = run(coat.ops.quantize_group, x, 32, "e5m2", transpose=True)
    ngroups = scales.shape[-1]
    per_element = reference.expand_group_scales(scales.view(-1, ngroups), 70, 32)  # (rows, cols)
    from_q_t = reference.dequantize(q_t, per_element.T, "e5m2", torch.float32)
    assert_same_bits(from_q_t.T, run(coat.ops.dequantize, q, scales, 32, torch.float32).reshape(6, 70))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("granularity", ("group", "tensor"))
def test_round_trip_error_within_half_an_fp8_ulp(run, rng, fmt, dtype, granularity):
    """|dequantize(quantize(x)) - x| is at most half the FP8 spacing at x / scale, times the scale (plus
    the fp32 roundings of the division and of the product); within the format's normal range that is a
    relative error of at most 2^-(mantissa bits + 1)."""
    f = reference.fp8_format(fmt)
    x = random_input((301, 200), dtype, rng)
    if granularity == "group":
        q, scales, _ = run(coat.ops.quantize_group, x, 64, fmt)
        out = run(coat.ops.dequantize, q, scales, 64, torch.float32)
        scale = reference.expand_group_scales(scales, 200, 64).double()
    else:
        q, scales, _ = run(coat.ops.quantize_tensor, x, fmt)
        out = run(coat.ops.dequantize, q, scales, None, torch.float32)
        scale = scales.double()
    x64 = x.double()
    scaled = (x64 / scale).float().double()
    error = (out.double() - x64).abs()
    bound = reference.fp8_half_ulp(scaled, f) * scale * (1 + 2**-20) + x64.abs() * 2**-22
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max())}"
    normal = scaled.abs() >= 2.0**f.min_exponent
    assert int(normal.sum()) > x.numel() // 2
    relative = error[normal] / x64.abs()[normal]
    assert float(relative.max()) <= 2.0 ** -(f.mantissa_bits + 1) * (1 + 2**-18)
    assert float(relative.max()) > 2.0 ** -(f.mantissa_bits + 2), "the data should come near the bound"


# --------------------------------------------------------------------------------- layouts and shapes


@pytest.mark.parametrize("shape", [(2, 3, 40), (37,), (2, 1, 3, 17), (3, 1, 1)], ids=shape_id)
@pytest.mark.parametrize("fmt", FORMATS)
def test_nd_inputs_are_rows_of_the_last_dimension(run, rng, shape, fmt):
    x = random_input(shape, torch.bfloat16, rng)
    q, scales = check_quantize_group(run, x, 16, fmt)
    flat_q, flat_scales, _ = run(coat.ops.quantize_group, x.reshape(-1, shape[-1]), 16, fmt)
    assert_same_bits((q.reshape(-1, shape[-1]), scales.reshape(flat_scales.shape)), (flat_q, flat_scales))
    check_quantize_tensor(run, x, fmt, 32)
    assert_same_bits(run(coat.ops.group_amax, x, 16), reference.group_amax(x, 16))
    assert_same_bits(run(coat.ops.dequantize, q, scales, 16, torch.float32),
                     reference.dequantize(q, reference.expand_group_scales(scales, shape[-1], 16), fmt, torch.float32))


def poisoned(shape, keep: int, dtype, rng) -> torch.Tensor:
    """A random tensor whose last dimension holds, past `keep`, values that would change every result if
    an op read them: NaN, Inf and large numbers."""
    x = random_input(shape, dtype, rng)
    poison = torch.tensor([float("nan"), float("inf"), -60000.0, float("-inf")], dtype=dtype)
    x[..., keep:] = poison.repeat(math.ceil((shape[-1] - keep) / 4))[: shape[-1] - keep]
    return x


STRIDED_VIEWS = {
    "column-slice": lambda dtype, rng: poisoned((50, 300), 200, dtype, rng)[:, :200],
    "short-column-slice": lambda dtype, rng: poisoned((50, 300), 37, dtype, rng)[:, :37],
    "every-other-row": lambda dtype, rng: poisoned((50, 300), 100, dtype, rng)[::2, :100],
    "offset-slice": lambda dtype, rng: poisoned((50, 300), 133, dtype, rng)[3:40, 5:133],
    "3d-slice": lambda dtype, rng: poisoned((2, 3, 300), 77, dtype, rng)[:, :, :77],
    "size-1-middle-dim": lambda dtype, rng: poisoned((50, 300), 64, dtype, rng)[:, None, :64],
    "column-vector-view": lambda dtype, rng: random_input((1, 50), dtype, rng).T,  # shape (50, 1), strides (1, 50)
}


@pytest.mark.parametrize("view", STRIDED_VIEWS)
@pytest.mark.parametrize("dtype", INPUT_DTYPES, ids=DTYPE_NAMES.get)
def test_strided_inputs_equal_their_contiguous_copy(run, rng, view, dtype):
    x = STRIDED_VIEWS[view](dtype, rng)
    assert x.stride() != torch.empty(x.shape).stride()
    dense = x.contiguous()
    for fmt, group_size in (("e4m3", 16), ("e5m2", 128)):
        expected = run(coat.ops.quantize_group, dense, group_size, fmt, transpose=True)
        assert_same_bits(run(coat.ops.quantize_group, x, group_size, fmt, transpose=True), expected, "quantize_group")
        check_quantize_group(run, x, group_size, fmt)
        expected = run(coat.ops.quantize_tensor, dense, fmt, group_size=group_size, transpose=True)
        assert_same_bits(run(coat.ops.quantize_tensor, x, fmt, group_size=group_size, transpose=True), expected, "quantize_tensor")
        check_quantize_tensor(run, x, fmt, group_size)
        assert_same_bits(run(coat.ops.group_amax, x, group_size), run(coat.ops.group_amax, dense, group_size), "group_amax")


@pytest.mark.parametrize("shape", [(97, 37), (2, 3, 40), (37,)], ids=shape_id)
def test_output_shapes_dtypes_devices_and_strides(move, device, shape):
    x = move(torch.randn(shape))
    cols, rows = shape[-1], math.prod(shape[:-1])
    grouped = (*shape[:-1], reference.num_groups(cols, 16))
    for fmt, fp8 in (("e4m3", torch.float8_e4m3fn), ("E5M2", torch.float8_e5m2), (torch.float8_e4m3fn, torch.float8_e4m3fn)):
        q, scales, q_t = coat.ops.quantize_group(x, 16, fmt, transpose=True)
        assert (q.shape, q.dtype, q.device.type, q.is_contiguous()) == (x.shape, fp8, device, True)
        assert (scales.shape, scales.dtype, scales.device.type, scales.is_contiguous()) == (grouped, torch.float32, device, True)
        assert (q_t.shape, q_t.dtype, q_t.device.type, q_t.is_contiguous()) == ((cols, rows), fp8, device, True)
        assert_same_bits(q_t, q.view(rows, cols).T, "q_t is q.view(rows, cols).T")
        assert coat.ops.quantize_group(x, 16, fmt)[2] is None
        assert_same_bits(coat.ops.quantize_group(x), coat.ops.quantize_group(x, 16, "e4m3"), "defaults: G=16, e4m3")

        q, scale, q_t = coat.ops.quantize_tensor(x, fmt, transpose=True)
        assert (q.shape, q.dtype, q.device.type, q.is_contiguous()) == (x.shape, fp8, device, True)
        assert (scale.shape, scale.dtype, scale.device.type) == ((), torch.float32, device)
        assert (q_t.shape, q_t.dtype, q_t.device.type, q_t.is_contiguous()) == ((cols, rows), fp8, device, True)
        assert_same_bits(q_t, q.view(rows, cols).T, "q_t is q.view(rows, cols).T")
        assert coat.ops.quantize_tensor(x, fmt)[2] is None

        for dtype in (torch.float32, torch.bfloat16):
            out = coat.ops.dequantize(q, scale, dtype=dtype)
            assert (out.shape, out.dtype, out.device.type, out.is_contiguous()) == (x.shape, dtype, device, True)
    amax = coat.ops.group_amax(x, 16)
    assert (amax.shape, amax.dtype, amax.device.type, amax.is_contiguous()) == (grouped, torch.float32, device, True)
    assert coat.ops.group_amax(x).shape == (*shape[:-1], reference.num_groups(cols, 128))  # default group size 128


# ---------------------------------------------------------------------------------------- edge values


def per_group(*groups, group_size=16) -> torch.Tensor:
    """A float32 (rows, cols) tensor from rows of groups, each group a list padded with its last value."""
    rows = []
    for row in groups:
        values = []
        for group in row:
            values += list(group) + [group[-1]] * (group_size - len(group))
        rows.append(values)
    return torch.tensor(rows, dtype=torch.float32)


EDGE_DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", EDGE_DTYPES)
def test_zero_groups_dequantize_to_exact_zeros(run, fmt, dtype):
    x = per_group(
        [[0.0], [-0.0], [0.0, -0.0]],
        [[0.0, 5.0, 0.0, -3.0, -0.0], [1.0, 0.0], [0.0]],
    ).to(dtype)
    q, scales = check_quantize_group(run, x, 16, fmt)
    assert_same_bits(scales[0], torch.full((3,), MIN_SCALE), "all-zero groups get the 2^-126 floor")
    assert_same_bits(scales[1, 2], torch.tensor(MIN_SCALE))
    zero_codes = torch.where(reference.sign_bit(x[0]), 0x80, 0x00).to(torch.uint8)
    assert_same_bits(q[0], zero_codes, "signed zeros")
    for out_dtype in (torch.float32, torch.bfloat16):
        out = run(coat.ops.dequantize, q, scales, 16, out_dtype)
        assert_same_bits(out[0], x[0].to(out_dtype), "zeros come back exactly, signs included")
        assert bool((out[x.to(out_dtype) == 0] == 0).all()) and not bool(torch.isnan(out).any())
    # The same for per-tensor scaling of an all-zero tensor.
    q, scale = check_quantize_tensor(run, x[0], fmt, 16)
    assert_same_bits(scale, torch.tensor(MIN_SCALE))
    assert_same_bits(run(coat.ops.dequantize, q, scale, None, torch.float32), x[0].float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", EDGE_DTYPES)
def test_constant_groups_encode_to_the_format_max(run, fmt, dtype):
    f = reference.fp8_format(fmt)
    constants = [1.0, -3.0, 1e-30, 1e30, 3.0e38, -3.3e38]  # up to near the fp32 (and bf16) max
    x = per_group([[c] for c in constants]).to(dtype)
    q, scales = check_quantize_group(run, x, 16, fmt)
    expected = torch.tensor([f.max_code | (0x80 if c < 0 else 0) for c in constants], dtype=torch.uint8)
    assert_same_bits(q, expected.repeat_interleave(16).reshape(1, -1))
    out = run(coat.ops.dequantize, q, scales, 16, torch.float32).double()
    relative = ((out - x.double()) / x.double()).abs()
    assert float(relative.max()) <= 2.0**-23


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", EDGE_DTYPES)
def test_subnormal_inputs(run, rng, fmt, dtype):
    """fp32 (and bf16) subnormals: a group of them gets the 2^-126 scale floor and quantizes to the FP8
    values nearest to x / 2^-126; mixed with normal values they quantize like any other small value."""
    mantissa = torch.randint(1, 0x800000, (3, 16), generator=rng)
    if dtype == torch.bfloat16:
        mantissa = (mantissa >> 16).clamp(min=1) << 16  # the bf16 subnormals: only the top 7 mantissa bits
    subnormals = mantissa.to(torch.int32).view(torch.float32)
    subnormals = subnormals * torch.where(torch.rand(3, 16, generator=rng) < 0.5, -1.0, 1.0)
    normals = random_input((3, 16), torch.float32, rng) * 1e-36
    x = torch.cat([subnormals, torch.where(torch.rand(3, 16, generator=rng) < 0.5, subnormals, normals), normals], dim=1).to(dtype)
    assert bool((x[:, :16].abs() < MIN_SCALE).all()) and bool((x[:, :16] != 0).all())
    q, scales = check_quantize_group(run, x, 16, fmt)
    assert_same_bits(scales[:, 0], torch.full((3,), MIN_SCALE))
    assert bool((q.view(torch.uint8)[:, :16] & 0x7F != 0).any()), "some subnormals must survive as nonzero codes"
    for out_dtype in (torch.float32, torch.bfloat16):
        expected = reference.dequantize(q, reference.expand_group_scales(scales, 48, 16), fmt, out_dtype)
        assert_same_bits(run(coat.ops.dequantize, q, scales, 16, out_dtype), expected)
    check_quantize_tensor(run, x, fmt, 16)


def test_tiny_group_scales(run):
    """Groups with amax a few times 2^-117: scales that are not powers of two, and values below 2^-103, where
    dividing by the rounded reciprocal and one correction is no longer exact. Each (amax, value) pair is
    one where that gave another E4M3 code than the division (found by a CPU replay; CUDA now divides when
    the scale is below 2^-80)."""
    pairs = [("0x1.4bc0c4p-114", "0x1.5799fp-127"), ("0x1.cfaaf6p-117", "0x1.e03a36p-125"),
             ("0x1.701de2p-114", "0x1.d94bp-130")]
    x = torch.zeros(len(pairs), 16)
    for row, (amax, value) in enumerate(pairs):
        x[row, 0], x[row, 1] = float.fromhex(amax), float.fromhex(value)
    check_quantize_group(run, x, 16, "e4m3")



def bf16_amaxes_whose_reciprocal_product_is_not_the_quotient(fmt) -> torch.Tensor:
    """Positive finite bf16 values a with fp32(a * fp32(1 / FP8_MAX)) != fp32(a / FP8_MAX): about half of them for
    E4M3. torch on CUDA computes `amax / 448` (a Python number) as that product, so a reference written that way on
    a GPU gets other scales, and then other codes, than the correctly rounded division the scale is defined by."""
    a = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    fp8_max = reference.fp8_format(fmt).max
    product = a * torch.tensor(1 / fp8_max, dtype=torch.float32)
    return a[product != reference.scale_from_amax(a, fmt)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_are_the_correctly_rounded_quotient_not_the_reciprocal_product(run, rng, fmt):
    """Groups whose amax is one where amax * fp32(1 / FP8_MAX) rounds differently from amax / FP8_MAX: the scale is
    the quotient (as the oracle computes it in float64), and the codes follow from it."""
    amaxes = bf16_amaxes_whose_reciprocal_product_is_not_the_quotient(fmt)
    picked = amaxes[torch.randint(0, amaxes.numel(), (512,), generator=rng)]
    x = torch.rand(512, 16, generator=rng) * 2 - 1
    x = (x * picked[:, None]).to(torch.bfloat16)
    x[:, 0] = picked.to(torch.bfloat16)  # the amax of each row, exactly
    _, scales = check_quantize_group(run, x, 16, fmt)
    reciprocal_product = picked * torch.tensor(1 / reference.fp8_format(fmt).max, dtype=torch.float32)
    assert bool((scales[:, 0] != reciprocal_product).all())


@requires_cuda
def test_a_gpu_drawn_randn_tensor_matches_the_oracle():
    """The case a user reported: torch.randn(8192, 8192, bf16) drawn on a GPU with seed 0. coat's codes disagreed in
    41,993 places with `(x / scale).to(float8_e4m3fn)` where `scale = amax / 448` was computed on the GPU, which
    torch does as amax * fp32(1 / 448). With scales from the correctly rounded division, every code matches,
    on CUDA and on the CPU."""
    torch.manual_seed(0)
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    q, scales, _ = coat.ops.quantize_group(x, group_size=16, format="e4m3")
    expected_q, expected_scales = reference.quantize_group(x.cpu(), 16, "e4m3")
    assert_same_bits(scales.cpu(), expected_scales, "scales")
    assert_same_bits(q.cpu(), expected_q, "codes")
    assert_same_bits(coat.ops.quantize_group(x.cpu(), group_size=16, format="e4m3")[:2], (q.cpu(), scales.cpu()))

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", EDGE_DTYPES)
def test_tiny_and_huge_magnitudes(run, rng, fmt, dtype):
    base = random_input((4, 64), torch.float64, rng)
    x = torch.cat([base * 1e-30, base * 1e30, (base / base.abs().max()) * 3.0e38], dim=1).float().to(dtype)
    assert bool(torch.isfinite(x).all())
    q, scales = check_quantize_group(run, x, 32, fmt)
    assert bool(torch.isfinite(scales).all()) and bool((scales > MIN_SCALE).all())
    expected = reference.dequantize(q, reference.expand_group_scales(scales, x.shape[1], 32), fmt, torch.float32)
    assert_same_bits(run(coat.ops.dequantize, q, scales, 32, torch.float32), expected)
    check_quantize_tensor(run, x, fmt, 64)


def nan_sign_insensitive(codes: torch.Tensor, fmt) -> torch.Tensor:
    """Codes with the sign bit of NaN codes cleared (see test_nan_codes_carry_the_sign_of_the_input)."""
    f = reference.fp8_format(fmt)
    nan = torch.isnan(reference.decode(codes, f))
    raw = reference.codes(codes)
    return torch.where(nan, raw & 0x7F, raw)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", EDGE_DTYPES)
def test_group_with_inf_dequantizes_to_nan(run, rng, fmt, dtype):
    """Documented: a group holding +-Inf gets an Inf scale, its finite elements encode +-0 and the Inf a
    NaN, so the whole group dequantizes to NaN; the other groups are unaffected."""
    x = random_input((2, 48), torch.float32, rng)
    x[0, 3], x[1, 40], x[1, 41] = float("inf"), float("-inf"), float("inf")
    x = x.to(dtype)
    expected_q, expected_scales = reference.quantize_group(x, 16, fmt)
    q, scales, _ = run(coat.ops.quantize_group, x, 16, fmt)
    inf_group = torch.tensor([[True, False, False], [False, False, True]])
    assert_same_bits(scales, expected_scales)
    assert_same_bits(run(coat.ops.group_amax, x, 16), reference.group_amax(x, 16), "group_amax")
    assert bool(torch.isinf(scales[inf_group]).all()) and bool(torch.isfinite(scales[~inf_group]).all())
    assert_same_bits(nan_sign_insensitive(q, fmt), nan_sign_insensitive(expected_q, fmt))
    finite_in_inf_group = reference.expand_group_scales(inf_group, 48, 16) & torch.isfinite(x)
    assert bool((q.view(torch.uint8)[finite_in_inf_group] & 0x7F == 0).all()), "finite elements encode +-0"
    for out_dtype in (torch.float32, torch.bfloat16):
        out = run(coat.ops.dequantize, q, scales, 16, out_dtype)
        in_inf_group = reference.expand_group_scales(inf_group, 48, 16)
        assert bool(torch.isnan(out[in_inf_group]).all())
        expected = reference.dequantize(expected_q, reference.expand_group_scales(expected_scales, 48, 16), fmt, out_dtype)
        assert_same_bits(out[~in_inf_group], expected[~in_inf_group])
    # Per-tensor: one Inf makes the whole tensor dequantize to NaN.
    q, scale, _ = run(coat.ops.quantize_tensor, x, fmt)
    assert bool(torch.isinf(scale))
    assert bool(torch.isnan(run(coat.ops.dequantize, q, scale, None, torch.float32)).all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", EDGE_DTYPES)
def test_group_with_nan_keeps_the_rest_of_the_group(run, rng, fmt, dtype):
    """Documented: a NaN element encodes NaN and leaves the rest of its group (and its scale) unchanged; a
    group of NaNs only gets the 2^-126 floor."""
    x = random_input((3, 48), torch.float32, rng).to(dtype)
    nan = torch.zeros(3, 48, dtype=torch.bool)
    nan[0, 5] = nan[1, 16] = nan[1, 31] = True
    nan[2, 32:] = True
    with_nan = x.masked_fill(nan, float("nan"))
    q, scales = check_quantize_group(run, with_nan, 16, fmt)
    q_zeroed, scales_zeroed, _ = run(coat.ops.quantize_group, x.masked_fill(nan, 0.0), 16, fmt)
    assert_same_bits(scales, scales_zeroed, "NaN is ignored by amax")
    assert scales[2, 2].item() == MIN_SCALE
    assert bool((q.view(torch.uint8)[nan] & 0x7F == 0x7F).all())
    assert_same_bits(q.view(torch.uint8)[~nan], q_zeroed.view(torch.uint8)[~nan])
    out = run(coat.ops.dequantize, q, scales, 16, torch.float32)
    assert bool(torch.isnan(out[nan]).all()) and not bool(torch.isnan(out[~nan]).any())
    assert_same_bits(out[~nan], run(coat.ops.dequantize, q_zeroed, scales_zeroed, 16, torch.float32)[~nan])
    check_quantize_tensor(run, with_nan, fmt, 16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_codes_carry_the_sign_of_the_input(run, fmt):
    """The FP8 code of every element has the sign bit of the input element, NaN codes included: fp8.h keeps
    the sign of a NaN, and the scale is positive. A NaN input keeps its sign; +-Inf over an Inf scale
    (Inf / Inf) gives the NaN code with the Inf's sign. This pins down what a bare fp32 division leaves to
    the platform (x86 makes Inf / Inf a negative NaN, CUDA makes every NaN result 0x7FFFFFFF), which the
    C core and the CUDA kernels must agree on bit for bit."""
    nan = float("nan")
    x = per_group([[nan], [-nan], [1.0, -nan, nan, -2.0], [float("inf"), -1.0], [float("-inf"), 1.0], [float("inf"), float("-inf")]])
    q, _, _ = run(coat.ops.quantize_group, x, 16, fmt)
    assert_same_bits(q.view(torch.uint8) >> 7, reference.sign_bit(x).to(torch.uint8), "sign bit of q vs sign bit of x")
    assert_same_bits(q, reference.quantize_group(x, 16, fmt)[0])


EMPTY_SHAPES = [(0, 37), (5, 0), (0,), (2, 0, 5), (0, 0), (2, 3, 0)]


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=shape_id)
def test_empty_tensors(run, shape):
    """Tensors with no elements give empty outputs of the documented shapes (q_t is (cols, rows) with
    rows = the product of the leading dimensions), and a per-tensor scale of 2^-126 (amax 0)."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    cols, rows = shape[-1], math.prod(shape[:-1])
    grouped = (*shape[:-1], reference.num_groups(cols, 32))
    q, scales, q_t = run(coat.ops.quantize_group, x, 32, "e4m3", transpose=True)
    assert (q.shape, scales.shape, q_t.shape) == (shape, grouped, (cols, rows))
    assert run(coat.ops.group_amax, x, 32).shape == grouped
    q, scale, q_t = run(coat.ops.quantize_tensor, x, "e5m2", transpose=True)
    assert (q.shape, scale.shape, q_t.shape) == (shape, (), (cols, rows))
    assert_same_bits(scale, torch.tensor(MIN_SCALE), "the amax of no elements is 0")
    out = run(coat.ops.dequantize, q, scale, None, torch.bfloat16)
    assert out.shape == shape and out.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=shape_id)
def test_empty_tensors_dequantize_with_group_scales(run, shape):
    """quantize_group's empty outputs dequantize to an empty tensor (the scales are empty as well)."""
    q, scales, _ = run(coat.ops.quantize_group, torch.empty(shape), 32, "e4m3")
    out = run(coat.ops.dequantize, q, scales, 32, torch.float32)
    assert out.shape == shape and out.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ errors

ERRORS = {
    # wrong input dtype
    "int32-input": (lambda m: coat.ops.quantize_group(m(torch.ones(4, 16, dtype=torch.int32))),
                    RuntimeError, r"coat\.quantize_group: x must be float32, bfloat16 or float16, got Int"),
    "float64-input": (lambda m: coat.ops.quantize_group(m(torch.ones(4, 16, dtype=torch.float64))),
                      RuntimeError, r"coat\.quantize_group: x must be float32, bfloat16 or float16, got Double"),
    "float64-group-amax": (lambda m: coat.ops.group_amax(m(torch.ones(4, 16, dtype=torch.float64))),
                           RuntimeError, r"coat\.group_amax: x must be float32, bfloat16 or float16, got Double"),
    "int32-quantize-tensor": (lambda m: coat.ops.quantize_tensor(m(torch.ones(4, 16, dtype=torch.int32)), group_amax=m(torch.ones(1))),
                              RuntimeError, r"coat\.quantize_tensor: x must be float32, bfloat16 or float16, got Int"),
    # unsupported group sizes
    **{
        f"group-size-{g}-{name}": (call, RuntimeError, rf"coat\.{op}: group_size must be 16, 32, 64 or 128, got {g}")
        for g in (8, 48, 256)
        for name, op, call in (
            ("quantize-group", "quantize_group", lambda m, g=g: coat.ops.quantize_group(m(torch.ones(4, 16)), g)),
            ("group-amax", "group_amax", lambda m, g=g: coat.ops.group_amax(m(torch.ones(4, 16)), g)),
            ("quantize-tensor", "group_amax", lambda m, g=g: coat.ops.quantize_tensor(m(torch.ones(4, 16)), group_size=g)),
            ("dequantize", "dequantize", lambda m, g=g: coat.ops.dequantize(
                m(torch.zeros(4, 16, dtype=torch.float8_e4m3fn)), m(torch.ones(4, 1)), g)),
        )
    },
    # unsupported FP8 formats
    "format-e4m3fnuz": (lambda m: coat.ops.quantize_group(m(torch.ones(4, 16)), 16, torch.float8_e4m3fnuz),
                        ValueError, r"unsupported FP8 format torch\.float8_e4m3fnuz: use 'e4m3'"),
    "format-float16": (lambda m: coat.ops.quantize_tensor(m(torch.ones(4, 16)), torch.float16),
                       ValueError, r"unsupported FP8 format torch\.float16"),
    "format-bad-string": (lambda m: coat.ops.quantize_group(m(torch.ones(4, 16)), 16, "e3m4"),
                          ValueError, r"unsupported FP8 format 'e3m4': use 'e4m3' \(torch\.float8_e4m3fn\) or 'e5m2'"),
    "format-e4m3fnuz-op": (lambda m: torch.ops.coat.quantize_group(m(torch.ones(4, 16)), 16, torch.float8_e4m3fnuz, False),
                           RuntimeError, r"coat\.quantize_group: fp8_dtype must be torch\.float8_e4m3fn or torch\.float8_e5m2, got Float8_e4m3fnuz"),
    "format-e5m2fnuz-tensor-op": (lambda m: torch.ops.coat.quantize_tensor(m(torch.ones(4, 16)), m(torch.ones(1)), torch.float8_e5m2fnuz, False),
                                  RuntimeError, r"coat\.quantize_tensor: fp8_dtype must be torch\.float8_e4m3fn or torch\.float8_e5m2"),
    "dequantize-uint8": (lambda m: coat.ops.dequantize(m(torch.zeros(4, 16, dtype=torch.uint8)), m(torch.ones(()))),
                         RuntimeError, r"coat\.dequantize: q must be torch\.float8_e4m3fn or torch\.float8_e5m2, got Byte"),
    "dequantize-e4m3fnuz": (lambda m: coat.ops.dequantize(m(torch.zeros(4, 16, dtype=torch.float8_e4m3fnuz)), m(torch.ones(()))),
                            RuntimeError, r"coat\.dequantize: q must be torch\.float8_e4m3fn or torch\.float8_e5m2"),
    # 0-d tensors
    "0d-quantize-group": (lambda m: coat.ops.quantize_group(m(torch.tensor(1.0))),
                          RuntimeError, r"coat\.quantize_group: x must have at least one dimension, got a 0-d tensor"),
    "0d-group-amax": (lambda m: coat.ops.group_amax(m(torch.tensor(1.0))),
                      RuntimeError, r"coat\.group_amax: x must have at least one dimension, got a 0-d tensor"),
    "0d-quantize-tensor": (lambda m: coat.ops.quantize_tensor(m(torch.tensor(1.0)), group_amax=m(torch.ones(1))),
                           RuntimeError, r"coat\.quantize_tensor: x must have at least one dimension, got a 0-d tensor"),
    "0d-dequantize": (lambda m: coat.ops.dequantize(m(torch.zeros((), dtype=torch.float8_e5m2)), m(torch.ones(()))),
                      RuntimeError, r"coat\.dequantize: q must be a contiguous tensor with at least one dimension"),
    # layouts the row-matrix view cannot express
    **{
        f"{layout}-{name}": (lambda m, make=make, call=call: call(m(make())), RuntimeError,
                             rf"coat\.{op}: x: the last dimension must be contiguous .* Call \.contiguous\(\) first\. Got strides")
        for layout, make in (
            ("transposed", lambda: torch.ones(16, 32).T),
            ("strided-last-dim", lambda: torch.ones(4, 64)[:, ::2]),
            ("uneven-row-strides", lambda: torch.ones(2, 3, 64)[:, 1:, :40]),
            ("overlapping-rows", lambda: torch.ones(64).as_strided((4, 16), (8, 1))),
        )
        for name, op, call in (
            ("quantize-group", "quantize_group", lambda x: coat.ops.quantize_group(x, 16)),
            ("group-amax", "group_amax", lambda x: coat.ops.group_amax(x, 16)),
            ("quantize-tensor", "quantize_tensor", lambda x: torch.ops.coat.quantize_tensor(x, torch.ones(1, device=x.device), torch.float8_e4m3fn, False)),
        )
    },
    "non-contiguous-q": (lambda m: coat.ops.dequantize(m(torch.zeros(16, 32, dtype=torch.float8_e4m3fn)).T, m(torch.ones(()))),
                         RuntimeError, r"coat\.dequantize: q must be a contiguous tensor"),
    # scales
    "scale-shape-mismatch": (lambda m: coat.ops.dequantize(m(torch.zeros(4, 40, dtype=torch.float8_e4m3fn)), m(torch.ones(4, 2)), 16),
                             RuntimeError, r"coat\.dequantize: with group_size=16 and q of shape \[4, 40\] scale must have shape \[4, 3\], got \[4, 2\]"),
    "scale-group-size-mismatch": (lambda m: coat.ops.dequantize(*coat.ops.quantize_group(m(torch.ones(4, 40)), 16)[:2], 32),
                                  RuntimeError, r"coat\.dequantize: with group_size=32 .* scale must have shape \[4, 2\], got \[4, 3\]"),
    "group-scales-without-group-size": (lambda m: coat.ops.dequantize(*coat.ops.quantize_group(m(torch.ones(4, 40)), 16)[:2]),
                                        RuntimeError, r"coat\.dequantize: without group_size, scale must hold one per-tensor value, got shape \[4, 3\]; pass group_size"),
    "float64-scale": (lambda m: coat.ops.dequantize(m(torch.zeros(4, 16, dtype=torch.float8_e4m3fn)), m(torch.ones((), dtype=torch.float64))),
                      RuntimeError, r"coat\.dequantize: scale must be a contiguous float32 tensor"),
    "float64-group-amax-arg": (lambda m: coat.ops.quantize_tensor(m(torch.ones(4, 16)), group_amax=m(torch.ones(4, 1, dtype=torch.float64))),
                               RuntimeError, r"coat\.quantize_tensor: group_amax must be a contiguous float32 tensor .*, got Double"),
    "non-contiguous-group-amax": (lambda m: coat.ops.quantize_tensor(m(torch.ones(4, 16)), group_amax=m(torch.ones(3, 4)).T),
                                  RuntimeError, r"coat\.quantize_tensor: group_amax must be a contiguous float32 tensor .*\(non-contiguous\)"),
    # output dtype
    "dequantize-to-float16": (lambda m: coat.ops.dequantize(m(torch.zeros(4, 16, dtype=torch.float8_e4m3fn)), m(torch.ones(())), dtype=torch.float16),
                              RuntimeError, r"coat\.dequantize: dtype must be torch\.float32 or torch\.bfloat16, got Half"),
    "dequantize-to-float64": (lambda m: coat.ops.dequantize(m(torch.zeros(4, 16, dtype=torch.float8_e4m3fn)), m(torch.ones(())), dtype=torch.float64),
                              RuntimeError, r"coat\.dequantize: dtype must be torch\.float32 or torch\.bfloat16, got Double"),
    # tensor_amax and quantize_tensors
    "tensor-amax-no-tensors": (lambda m: coat.ops.tensor_amax([]),
                               ValueError, r"coat\.ops\.tensor_amax: tensors must hold at least one tensor"),
    "tensor-amax-int32": (lambda m: coat.ops.tensor_amax([m(torch.ones(4, 16)), m(torch.ones(4, 16, dtype=torch.int32))]),
                          RuntimeError, r"coat\.tensor_amax: xs must be float32, bfloat16 or float16, got Int"),
    "tensor-amax-transposed": (lambda m: coat.ops.tensor_amax([m(torch.ones(16, 32)).T]),
                               RuntimeError, r"coat\.tensor_amax: xs: the last dimension must be contiguous .* Call \.contiguous\(\) first"),
    "quantize-tensors-no-tensors": (lambda m: coat.ops.quantize_tensors([], dim=0, amax=m(torch.ones(()))),
                                    ValueError, r"coat\.ops\.quantize_tensors: tensors must hold at least one tensor"),
    "quantize-tensors-dim-2": (lambda m: coat.ops.quantize_tensors([m(torch.ones(4, 16))], dim=2),
                               RuntimeError, r"coat\.quantize_tensors: dim must be 0 \(the matrices' rows are stacked\) or 1"),
    "quantize-tensors-columns-differ": (lambda m: coat.ops.quantize_tensors([m(torch.ones(4, 16)), m(torch.ones(4, 8))], dim=0),
                                        RuntimeError, r"coat\.quantize_tensors: with dim=0 every matrix needs the same number of columns, got 16 and 8"),
    "quantize-tensors-rows-differ": (lambda m: coat.ops.quantize_tensors([m(torch.ones(4, 16)), m(torch.ones(2, 3, 8))], dim=1),
                                     RuntimeError, r"coat\.quantize_tensors: with dim=1 every matrix needs the same number of rows, got 4 and 6"),
    "quantize-tensors-float64-amax": (lambda m: coat.ops.quantize_tensors([m(torch.ones(4, 16))], dim=0, amax=m(torch.ones((), dtype=torch.float64))),
                                      RuntimeError, r"coat\.quantize_tensors: amax must be a one-element float32 tensor \(as coat\.ops\.tensor_amax returns\), got Double"),
    "quantize-tensors-two-amax": (lambda m: coat.ops.quantize_tensors([m(torch.ones(4, 16))], dim=0, amax=m(torch.ones(2))),
                                  RuntimeError, r"coat\.quantize_tensors: amax must be a one-element float32 tensor .* of shape \[2\]"),
    "quantize-tensors-float16-format": (lambda m: coat.ops.quantize_tensors([m(torch.ones(4, 16))], torch.float16, dim=0),
                                        ValueError, r"unsupported FP8 format torch\.float16"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_say_what_is_wrong(move, case):
    call, error, message = ERRORS[case]
    with pytest.raises(error, match=message):
        call(move)


def test_tensors_on_different_devices(cuda_device):
    x = torch.ones(4, 40, device=cuda_device)
    with pytest.raises(RuntimeError, match=r"coat\.quantize_tensor: group_amax is on cpu but the input is on cuda:0; move it with \.to\(cuda:0\)"):
        coat.ops.quantize_tensor(x, group_amax=torch.ones(1))
    q, scales, _ = coat.ops.quantize_group(x, 16)
    with pytest.raises(RuntimeError, match=r"coat\.dequantize: scale is on cpu but the input is on cuda:0"):
        coat.ops.dequantize(q, scales.cpu(), 16)
    with pytest.raises(RuntimeError, match=r"coat\.quantize_tensor: group_amax is on cuda:0 but the input is on cpu"):
        coat.ops.quantize_tensor(x.cpu(), group_amax=torch.ones(1, device=cuda_device))
    with pytest.raises(RuntimeError, match=r"coat\.tensor_amax: an element of xs is on cpu but the input is on cuda:0"):
        coat.ops.tensor_amax([x, x.cpu()])
    with pytest.raises(RuntimeError, match=r"coat\.quantize_tensors: amax is on cpu but the input is on cuda:0"):
        coat.ops.quantize_tensors([x], dim=0, amax=torch.ones(()))


# ------------------------------------------------------------------------------- torch.library integration


def _opcheck_cases():
    x = lambda *shape, dtype=torch.float32: random_input(shape, dtype, torch.Generator().manual_seed(sum(shape)))
    # finite codes only: opcheck compares eager and traced outputs with NaN != NaN
    q = lambda *shape, fp8=torch.float8_e4m3fn: torch.randint(0, 0x7B, shape, generator=torch.Generator().manual_seed(7), dtype=torch.int32).to(torch.uint8).view(fp8)
    return {
        "quantize_group-2d": (torch.ops.coat.quantize_group.default, lambda: (x(97, 37), 16, torch.float8_e4m3fn, False)),
        "quantize_group-3d-transpose": (torch.ops.coat.quantize_group.default, lambda: (x(2, 3, 40, dtype=torch.bfloat16), 32, torch.float8_e5m2, True)),
        "quantize_group-strided-transpose": (torch.ops.coat.quantize_group.default, lambda: (x(20, 300, dtype=torch.float16)[:, :200], 128, torch.float8_e4m3fn, True)),
        "group_amax-2d": (torch.ops.coat.group_amax.default, lambda: (x(97, 37), 16)),
        "group_amax-3d": (torch.ops.coat.group_amax.default, lambda: (x(2, 3, 200, dtype=torch.bfloat16), 64)),
        "quantize_tensor-transpose": (torch.ops.coat.quantize_tensor.default, lambda: (x(33, 70), torch.tensor([3.0, 5.0]), torch.float8_e4m3fn, True)),
        "quantize_tensor-3d": (torch.ops.coat.quantize_tensor.default, lambda: (x(2, 3, 40, dtype=torch.bfloat16), torch.tensor(2.0), torch.float8_e5m2, False)),
        "quantize_tensor-empty-rows": (torch.ops.coat.quantize_tensor.default, lambda: (x(0, 37), torch.zeros(0, 1), torch.float8_e4m3fn, True)),
        "tensor_amax": (torch.ops.coat.tensor_amax.default, lambda: ([x(97, 37), x(2, 3, 40, dtype=torch.bfloat16)],)),
        "quantize_tensors-dim0": (torch.ops.coat.quantize_tensors.default,
                                  lambda: ([x(64, 40), x(16, 40)], 0, torch.tensor(3.0), torch.float8_e4m3fn, True, True)),
        "quantize_tensors-dim1-strided": (torch.ops.coat.quantize_tensors.default,
                                          lambda: ([x(9, 50)[:, :37], x(9, 16)], 1, torch.tensor([2.0]), torch.float8_e5m2, False, True)),
        "dequantize-group": (torch.ops.coat.dequantize.default, lambda: (q(5, 40), torch.rand(5, 3) + 0.5, 16, torch.float32)),
        "dequantize-tensor": (torch.ops.coat.dequantize.default, lambda: (q(2, 3, 40, fp8=torch.float8_e5m2), torch.tensor(0.25), None, torch.bfloat16)),
    }


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(move, case):
    op, make_args = OPCHECK_CASES[case]
    args = tuple(move(a) if isinstance(a, torch.Tensor) else [move(t) for t in a] if isinstance(a, list) else a
                 for a in make_args())
    fp8_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if not fp8_inputs:
        torch.library.opcheck(op, args)
        return
    # test_schema checks that inputs were not mutated with torch.allclose, which torch does not implement
    # for FP8 tensors ("mul_cpu_reduced_float" not implemented for 'Float8_e5m2'): run the other utils and
    # check the no-mutation part of the schema directly, byte for byte.
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    op(*args)
    for old, new in zip(before, [a for a in args if isinstance(a, torch.Tensor)]):
        assert_same_bits(new, old, "an input was modified")


FAKE_CASES = {
    "97x37": ((97, 37), True),
    "2x3x40": ((2, 3, 40), True),
    "37-no-transpose": ((37,), False),
    "0x37": ((0, 37), True),
    "5x0": ((5, 0), True),  # q_t must be (0, 5), the transpose of q.view(5, 0)
}


@pytest.mark.parametrize("case", FAKE_CASES)
def test_fake_outputs_match_real_outputs(case):
    """The register_fake implementations (what torch.compile traces with) describe the real outputs:
    same shapes, dtypes and strides, for every op."""
    shape, transpose = FAKE_CASES[case]
    x = random_input(shape, torch.bfloat16, torch.Generator().manual_seed(0))
    calls = {
        "quantize_group": lambda t: torch.ops.coat.quantize_group(t, 32, torch.float8_e4m3fn, transpose),
        "group_amax": lambda t: torch.ops.coat.group_amax(t, 32),
        "quantize_tensor": lambda t: torch.ops.coat.quantize_tensor(t, torch.ones(1), torch.float8_e5m2, transpose),
        "tensor_amax": lambda t: torch.ops.coat.tensor_amax([t, t]),
        "quantize_tensors": lambda t: torch.ops.coat.quantize_tensors([t, t], 1, torch.ones(()), torch.float8_e4m3fn, True, transpose),
        "dequantize": lambda t: torch.ops.coat.dequantize(t.to(torch.float8_e4m3fn), torch.ones(()), None, torch.float32),
    }
    for name, call in calls.items():
        real = call(x)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = call(mode.from_tensor(x))
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        describe = lambda ts: [(tuple(t.shape), t.dtype, t.stride()) for t in ts]
        assert describe(fake) == describe(real), f"{name}: fake {describe(fake)} vs real {describe(real)}"


def test_torch_compile_fullgraph(run):
    """coat.ops under torch.compile(fullgraph=True), dynamic shapes included, give eager's bits."""

    def quantize_and_back(x):
        q, scales, q_t = coat.ops.quantize_group(x, 32, "e4m3", transpose=True)
        qt, scale, _ = coat.ops.quantize_tensor(x, "e5m2", group_amax=coat.ops.group_amax(x, 64))
        return q, scales, q_t, coat.ops.dequantize(q, scales, 32, torch.float32), qt, coat.ops.dequantize(qt, scale)

    compiled = torch.compile(quantize_and_back, fullgraph=True, backend="aot_eager", dynamic=True)
    rng = torch.Generator().manual_seed(0)
    for shape in ((97, 200), (2, 5, 70)):
        x = random_input(shape, torch.bfloat16, rng)
        assert_same_bits(run(compiled, x), run(quantize_and_back, x))
