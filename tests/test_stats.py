"""coat.ops.quantization_sums_ and coat.ops.moment_stats, the kernels behind coat.report: against float64
references written here from the definitions in coat/stats.h and coat/adamw.h, the summation tree's order bit
for bit (what makes a CUDA sum equal the CPU's), CUDA against the C core bit for bit (the `run` fixture) and from
run to run, opcheck on every device, numerically hard inputs and errors."""
import math

import pytest
import torch

import coat
from conftest import to_device
from reference import assert_same_bits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CLIP = {E4M3: 464.0, E5M2: 61440.0}
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
TILE = 1024  # COAT_STATS_TILE
# opcheck's schema test compares arguments with torch.allclose, which FP8 tensors do not support (see
# tests/test_adamw_ops.py): FP8 ops run the other utils.
OPCHECK_UTILS_FP8 = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def tree_sum(leaves: torch.Tensor) -> float:
    """The tree of coat/stats.h: leaves padded with zeros to a power of two of at least TILE, node = left + right."""
    padded = max(TILE, 1 << max(leaves.numel() - 1, 0).bit_length())
    level = torch.cat([leaves, leaves.new_zeros(padded - leaves.numel())])
    while level.numel() > 1:
        level = level[0::2] + level[1::2]
    return level.item()


def element_scales(scale, group_size, rows, cols):
    if group_size is None:
        return scale.reshape(1, 1).expand(rows, cols)
    return scale.repeat_interleave(group_size, dim=1)[:, :cols]


def reference_sums(x, q, scale, group_size=None, rows=None, amax_per_scale=0.0, tree=tree_sum):
    """[numel, nonfinite, flushed, saturated, error_sq, value_sq, amax] from the definitions, on the CPU: Q(x) is
    the codes' values times their scales, exact in float64 and rounded once to float32 (the float32 product)."""
    x, q, scale = x.cpu(), q.cpu(), scale.cpu()
    scales = element_scales(scale, group_size, q.shape[0], q.shape[1])
    if rows is not None:
        q, scales = q[rows.cpu()], scales[rows.cpu()]
        x = x[rows.cpu()] if x.shape[0] != rows.numel() else x
    x, scales = x.float(), scales.float()
    dequantized = (q.double() * scales.double()).float()
    error = dequantized - x
    finite = error.isfinite()
    leaves = [
        (~finite).double(),
        (finite & (dequantized == 0) & (x != 0)).double(),
        (finite & ((x / scales).abs() >= CLIP[q.dtype])).double(),
        torch.where(finite, error.double().square(), 0.0),
        torch.where(finite, x.double().square(), 0.0),
    ]
    if amax_per_scale > 0:
        amax = (scale.float().max() * torch.tensor(amax_per_scale, dtype=torch.float32)).item()
    else:
        amax = torch.where(finite, x.abs(), 0.0).max().item()
    return torch.tensor([float(q.numel()), *(tree(leaf.flatten()) for leaf in leaves), amax], dtype=torch.float64)


def measure(x, q, scale, group_size=None, rows=None, held=False, amax_per_scale=0.0, sums=None):
    """One tensor measured by a call of its own."""
    sums = torch.zeros(7, dtype=torch.float64, device=q.device) if sums is None else sums
    coat.ops.quantization_sums_([sums], [x], [q], [scale], [group_size], [rows], x_holds_measured_rows=[held],
                                amax_per_scale=[amax_per_scale])
    return sums


def hard_values(shape, rng, dtype=torch.bfloat16):
    """Gaussian values over six decades along rows, exact zeros, a NaN, and beside a 1.0 values 1e-6 of it, which
    E4M3 flushes to zero in any scaling (its smallest subnormal is 2^-9 / 448 = 4.4e-6 of its maximum)."""
    x = torch.randn(shape, generator=rng) * torch.logspace(-4, 2, shape[1])
    x[torch.rand(shape, generator=rng) < 0.05] = 0
    x[1, 0], x[1, 1:7] = 1.0, 1e-6
    x[2, 3] = float("nan")
    return x.to(dtype)


def measure_together_and_alone(measures, slots):
    """The sums of `measures` (argument tuples of `measure`, without sums), measure i adding into sums slots[i]:
    (from one call, from one call per measure in list order), each stacked by slot."""
    device = measures[0][1].device
    together = [torch.zeros(7, dtype=torch.float64, device=device) for _ in range(max(slots) + 1)]
    alone = [torch.zeros(7, dtype=torch.float64, device=device) for _ in range(max(slots) + 1)]
    x, q, scale, group_size, rows, held, amax_per_scale = zip(*measures)
    coat.ops.quantization_sums_([together[slot] for slot in slots], x, q, scale, group_size, rows,
                                x_holds_measured_rows=held, amax_per_scale=amax_per_scale)
    for slot, args in zip(slots, measures):
        measure(*args, sums=alone[slot])
    return torch.stack(together), torch.stack(alone)


def mixed_measures(rng):
    """Argument tuples of `measure`: per-tensor and grouped scales, E4M3 and E5M2, every row and sampled rows
    (x indexed and x holding them), amax from x and from the scales, one tile to 752 tiles, strided operands
    and a row index outside q."""
    measures = []
    x = hard_values((37, 300), rng)  # 11 tiles
    q, scale, _ = coat.ops.quantize_tensor(x, E4M3)
    measures.append((x, q, scale, None, None, False, 0.0))
    x = hard_values((200, 96), rng, torch.float16)
    q, scales, _ = coat.ops.quantize_group(x, 32, E5M2)
    rows = torch.linspace(0, 199, 64).round().long()
    measures.append((x, q, scales, 32, rows, False, FP8_MAX[E5M2]))
    measures.append((x[rows], q, scales, 32, rows, True, 0.0))
    x = torch.randn(3, 5, generator=rng)  # one tile, 15 elements
    q, scales, _ = coat.ops.quantize_group(x, 16, E5M2)
    measures.append((x, q, scales, 16, None, False, 0.0))
    x = (torch.randn(1100, 700, generator=rng) * 3).t()  # 752 tiles; x a transposed view
    q, scale, _ = coat.ops.quantize_tensor(x.contiguous(), E4M3)
    measures.append((x, q, scale, None, None, False, FP8_MAX[E4M3]))
    x = hard_values((40, 1030), rng, torch.float32)  # 4 rows measured, 5 tiles; codes a column slice of wider ones
    q, scales, _ = coat.ops.quantize_group(x, 128, E4M3)
    wide = torch.zeros(40, 1100, dtype=torch.uint8).view(E4M3)
    wide[:, 7:1037] = q
    measures.append((x, wide[:, 7:1037], scales, 128, torch.tensor([39, 0, 0, 17]), False, FP8_MAX[E4M3]))
    x = torch.randn(4, 16, generator=rng)
    q, scale, _ = coat.ops.quantize_tensor(x, E5M2)
    measures.append((x, q, scale, None, torch.tensor([0, 4]), False, 0.0))
    return measures


# ---------------------------------------------------------------------------------------------- quantization_sums_


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("group_size", [None, 16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantization_sums_equal_the_reference_tree(fp8, group_size, dtype, rng, run):
    x = hard_values((37, 300), rng, dtype)
    if group_size is None:
        q, scale, _ = coat.ops.quantize_tensor(x, fp8)
    else:
        q, scale, _ = coat.ops.quantize_group(x, group_size, fp8)
    sums = run(measure, x, q, scale, group_size)
    assert_same_bits(sums, reference_sums(x, q, scale, group_size))
    assert sums[1] == 1  # the NaN
    assert sums[2] >= 6 or fp8 == E5M2  # the values 1e-6 of their neighbour
    exact = reference_sums(x, q, scale, group_size, tree=lambda leaf: math.fsum(leaf.tolist()))
    torch.testing.assert_close(sums, exact, rtol=1e-13, atol=0)


def test_many_tiles_and_strided_operands(rng, run):
    """700 x 1100 elements (752 tiles: the CUDA kernel's finishing warp sums runs of tiles per lane); x as a
    transposed view and q as a column slice of wider codes, read in place."""
    x = (torch.randn(1100, 700, generator=rng) * 3).t()
    q, scale, _ = coat.ops.quantize_tensor(x.contiguous(), E4M3)
    wide = torch.zeros(700, 1300, dtype=torch.uint8).view(E4M3)
    wide[:, 100:1200] = q
    codes = wide[:, 100:1200]
    sums = run(measure, x, codes, scale)
    assert_same_bits(sums, reference_sums(x, q, scale))
    assert sums[0] == 700 * 1100 and sums[4] > 0


@pytest.mark.parametrize("cols", [1, 3, 5])
def test_rows_narrower_than_a_threads_elements(cols, rng, run):
    """The CUDA kernel takes 4 consecutive elements per thread and steps from row to row between them."""
    x = (torch.randn(1500, cols, generator=rng) * torch.logspace(-6, 2, 1500)[:, None]).bfloat16()
    x[3, 0] = float("nan")
    q, scales, _ = coat.ops.quantize_group(x, 16, E4M3)
    rows = torch.tensor([1499, 0, 7, 7, 800])
    assert_same_bits(run(measure, x, q, scales, 16), reference_sums(x, q, scales, 16))
    assert_same_bits(run(measure, x, q, scales, 16, rows), reference_sums(x, q, scales, 16, rows))


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("sampled", [False, True])
def test_amax_from_the_scales_reads_every_scale(offset, sampled, rng, run):
    """2103 scales, the largest last: split over 23 tiles (every row measured) or read by one (two rows sampled);
    the CUDA kernel reads them 4 at a time where they are 16-byte aligned (offset 0), one at a time otherwise."""
    x = torch.randn(701, 33, generator=rng)
    x[700, 32] = 1000.0
    q, scales, _ = coat.ops.quantize_group(x, 16, E4M3)
    rows = torch.tensor([0, 350]) if sampled else None

    def measured(x, q, scales, rows):
        shifted = torch.empty(scales.numel() + offset, device=scales.device)[offset:].view(scales.shape)
        shifted.copy_(scales)
        return measure(x, q, shifted, 16, rows, False, 448.0)

    sums = run(measured, x, q, scales, rows)
    assert_same_bits(sums, reference_sums(x, q, scales, 16, rows, amax_per_scale=448.0))
    assert sums[6] == pytest.approx(1000.0, rel=2**-7)


def test_sampled_rows_with_x_indexed_or_holding_the_rows(rng, run):
    x = hard_values((200, 96), rng)
    q, scales, _ = coat.ops.quantize_group(x, 16, E4M3)
    rows = torch.linspace(0, 199, 64).round().long()
    indexed = run(measure, x, q, scales, 16, rows, False, 448.0)
    held = run(measure, x[rows], q, scales, 16, rows, True, 448.0)
    assert_same_bits(indexed, held)
    assert_same_bits(indexed, reference_sums(x, q, scales, 16, rows, amax_per_scale=448.0))
    assert indexed[0] == 64 * 96
    # amax from the scales is the whole tensor's (up to the scale's rounding), not the sampled rows'
    assert indexed[6] == pytest.approx(x.float().nan_to_num(0).abs().max().item(), rel=1e-6)


def test_recordings_accumulate_and_amax_is_the_largest(rng, run):
    a, b = torch.randn(8, 64, generator=rng), torch.randn(8, 64, generator=rng) * 5

    def twice(a, qa, sa, b, qb, sb):
        return measure(b, qb, sb, sums=measure(a, qa, sa))

    qa, sa, _ = coat.ops.quantize_tensor(a)
    qb, sb, _ = coat.ops.quantize_tensor(b)
    sums = run(twice, a, qa, sa, b, qb, sb)
    first, second = reference_sums(a, qa, sa), reference_sums(b, qb, sb)
    assert_same_bits(sums[:6], first[:6] + second[:6])
    assert sums[6] == max(first[6], second[6])


def test_zeros_inf_and_nan_scales(run):
    zeros = torch.zeros(4, 32)
    q, scales, _ = coat.ops.quantize_group(zeros, 16)
    assert run(measure, zeros, q, scales, 16).tolist() == [128, 0, 0, 0, 0, 0, 0]
    # An Inf makes its group's scale Inf: the whole group is nonfinite, and so is amax taken from the scales.
    x = torch.ones(2, 32)
    x[0, 3] = float("inf")
    q, scales, _ = coat.ops.quantize_group(x, 16)
    sums = run(measure, x, q, scales, 16, None, False, 448.0)
    assert sums[1] == 16 and sums[6] == math.inf
    assert_same_bits(sums, reference_sums(x, q, scales, 16, amax_per_scale=448.0))
    nan_scale = scales.clone()
    nan_scale[1, 0] = float("nan")
    sums = run(measure, x, q, nan_scale, 16, None, False, 448.0)
    assert sums[1] == 32 and math.isnan(sums[6])
    # Huge values: squares far past float32's range stay finite in float64.
    big = torch.full((1, 16), 3e38)
    q, scale, _ = coat.ops.quantize_tensor(big)
    sums = run(measure, big, q, scale)
    assert sums[1] == 0 and sums[5] == pytest.approx(16 * 9e76, rel=1e-6)


def test_a_row_index_outside_q_makes_the_sums_nan(run):
    x = torch.randn(4, 16)
    q, scale, _ = coat.ops.quantize_tensor(x)
    sums = run(measure, x, q, scale, None, torch.tensor([0, 4]))
    assert sums[0] == 32 and all(math.isnan(v) for v in sums[1:].tolist())


def test_several_measures_in_one_call_equal_one_call_each(rng, run):
    measures = mixed_measures(rng)
    slots = [0, 1, 2, 3, 0, 4, 5]  # the first and the 752-tile measure add into the same sums
    together, alone = run(measure_together_and_alone, measures, slots)
    assert_same_bits(together, alone)
    x, q, scales, group_size, rows, _, amax_per_scale = measures[1]
    assert_same_bits(together[1], reference_sums(x, q, scales, group_size, rows, amax_per_scale))
    first, big = reference_sums(*measures[0][:3]), reference_sums(*measures[4][:3], amax_per_scale=FP8_MAX[E4M3])
    assert together[0][0] == first[0] + big[0] and together[0][6] == max(first[6], big[6])
    assert all(math.isnan(v) for v in together[5][1:].tolist())  # only the sums of the row outside q


def test_more_measures_than_one_launch_holds(rng, run):
    """40 measures: CUDA launches them 24 and 16, in order; sums shared within and across the two launches."""
    measures = (mixed_measures(rng)[:6] * 7)[:40]
    slots = [i % 13 for i in range(40)]
    together, alone = run(measure_together_and_alone, measures, slots)
    assert_same_bits(together, alone)
    assert together[:, 0].sum() == sum(m[1].shape[1] * (m[1].shape[0] if m[4] is None else m[4].numel())
                                       for m in measures)


def test_quantization_sums_identical_from_run_to_run(cuda_device, rng):
    measures = [tuple(to_device(a, cuda_device) if isinstance(a, torch.Tensor) else a for a in args)
                for args in mixed_measures(rng)]
    x = torch.randn(3000, 777, generator=rng).to(cuda_device)
    q, scale, _ = coat.ops.quantize_tensor(x)
    measures.append((x, q, scale, None, None, False, 0.0))
    slots = [0, 1, 2, 0, 3, 4, 5, 3]
    first = measure_together_and_alone(measures, slots)
    for _ in range(3):
        assert_same_bits(measure_together_and_alone(measures, slots), first)


def test_opcheck_quantization_sums(device, rng):
    x = torch.randn(70, 48, generator=rng).to(device)
    q, scales, _ = coat.ops.quantize_group(x, 16)
    q_tensor, scale, _ = coat.ops.quantize_tensor(x, E5M2)
    rows = torch.tensor([0, 33, 69], device=device)
    calls = (
        ([x], [q], [scales], [16], [None], [False], [0.0]),
        ([x, x[rows], x], [q, q, q_tensor], [scales, scales, scale], [16, 16, 0], [None, rows, rows],
         [False, True, False], [0.0, 448.0, 57344.0]),
    )
    for args in calls:
        sums = [torch.zeros(7, dtype=torch.float64, device=device) for _ in args[0]]
        torch.library.opcheck(torch.ops.coat.quantization_sums_.default, (sums, *args), test_utils=OPCHECK_UTILS_FP8)
    torch.library.opcheck(torch.ops.coat.quantization_sums_.default, ([],) * 8, test_utils=OPCHECK_UTILS_FP8)


def call_quantization_sums(sums, x, q, scale, group_size, rows, held, amax_per_scale):
    coat.ops.quantization_sums_(sums, x, q, scale, group_size, rows, x_holds_measured_rows=held,
                                amax_per_scale=amax_per_scale)


def test_quantization_sums_explain_bad_input():
    x = torch.randn(4, 32)
    q, scales, _ = coat.ops.quantize_group(x, 16)
    q_tensor, scale, _ = coat.ops.quantize_tensor(x)
    sums = torch.zeros(7, dtype=torch.float64)
    cases = [
        (dict(sums=torch.zeros(7)), "sums must be a contiguous float64 tensor of 7"),
        (dict(q=x), "q must be torch.float8_e4m3fn or torch.float8_e5m2"),
        (dict(x=x.double()), "x must be float32, bfloat16 or float16"),
        (dict(x=x[:2]), r"x must have shape \(4, 32\)"),
        (dict(x=x.reshape(-1)), "x must be a non-empty 2-D tensor"),
        (dict(group_size=7), "group_size must be 16, 32, 64 or 128"),
        (dict(scale=scales[:, :1].contiguous()), "one scale per 1 x 16 group"),
        (dict(group_size=None), "one per-tensor scale"),
        (dict(rows=torch.tensor([0.0])), "rows must be a non-empty contiguous 1-D int64 tensor"),
        (dict(held=True), "x_holds_measured_rows needs rows"),
        (dict(amax_per_scale=-1.0), "amax_per_scale must be >= 0"),
    ]
    good = dict(sums=sums, x=x, q=q, scale=scales, group_size=16, rows=None, held=False, amax_per_scale=0.0)
    for change, message in cases:
        args = good | change
        with pytest.raises(RuntimeError, match=rf"^coat\.quantization_sums_: (?!measure).*{message}"):
            call_quantization_sums(*([value] for value in args.values()))
        # in the middle of three measures: named by its index, and no sums change
        first, last = torch.zeros(7, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
        three = [[first if name == "sums" else value, args[name], last if name == "sums" else value]
                 for name, value in good.items()]
        with pytest.raises(RuntimeError, match=rf"^coat\.quantization_sums_: measure 1: .*{message}"):
            call_quantization_sums(*three)
        assert not first.any() and not last.any()
    assert measure(x, q_tensor, scale)[0] == 128
    lists = [[value, value] for value in good.values()]
    lists[3] = [scales]
    with pytest.raises(RuntimeError, match="every list needs one entry per measured tensor, got 2 sums, 2 x, 2 q, "
                                           "1 scale, 2 group_size"):
        call_quantization_sums(*lists)
    with pytest.raises(RuntimeError, match="every list needs one entry per measured tensor"):
        torch.ops.coat.quantization_sums_([sums], [x], [q], [scales], [16], [None], [False], [])
    call_quantization_sums(*([] for _ in good))  # nothing to measure


def test_quantization_sums_refuse_another_device(cuda_device):
    x = torch.randn(4, 32)
    q, scale, _ = coat.ops.quantize_tensor(x)
    on_gpu = [t.to(cuda_device) for t in (torch.zeros(7, dtype=torch.float64), x, q, scale)]
    on_cpu = [torch.zeros(7, dtype=torch.float64), x, q, scale]
    for name, i in (("sums", 0), ("x", 1), ("q", 2), ("scale", 3)):
        second = list(on_gpu)
        second[i] = on_cpu[i]
        lists = [[a, b] for a, b in zip(on_gpu, second)]
        with pytest.raises(RuntimeError, match=f"measure 1: {name} is on cpu but the input is on cuda"):
            call_quantization_sums(*lists, [None, None], [None, None], [False, False], [0.0, 0.0])
    with pytest.raises(RuntimeError, match="measure 1: rows is on cpu"):
        call_quantization_sums(*[[a, a] for a in on_gpu], [None, None], [None, torch.tensor([0])], [False, False],
                               [0.0, 0.0])


# ---------------------------------------------------------------------------------------------- moment_stats


def reference_moment_stats(codes, meta, group_size, rows):
    """One row of coat.ops.MOMENT_STATS from the definitions: dequantize_expanded (the C core) of the measured rows,
    torch.median of k."""
    codes, meta = codes.cpu(), meta.cpu()
    matrix = codes.reshape(-1, codes.shape[-1])
    k = meta.reshape(-1, 3)[:, 1].double()
    values = coat.ops.dequantize_expanded(codes, meta, group_size).reshape(matrix.shape)
    measured_codes = matrix if rows is None else matrix[rows.cpu()]
    measured = values if rows is None else values[rows.cpu()]
    finite = measured.isfinite()
    k_stats = [k.min().item(), k.median().item(), k.max().item()] if not k.isnan().any() else [math.nan] * 3
    return [float(measured.numel()), float((~finite).sum()), float(((measured_codes.view(torch.uint8) & 0x7F) == 0).sum()),
            torch.where(finite, measured.abs(), 0.0).max().item(), *k_stats, (k != 1).double().mean().item()]


def moment_states(rng):
    """States of several shapes, group size 32: heavy-tailed rows, E4M3 and E5M2, expanded and plain."""
    from test_adamw_ops import heavy_tailed

    states = []
    for shape, fp8, expand in (((5, 300), E4M3, True), ((129,), E5M2, True), ((2, 3, 100), E4M3, False),
                               ((40, 64), E5M2, True)):
        states.append(coat.ops.quantize_expanded(heavy_tailed(shape, rng), 32, fp8, expand=expand))
    return states


def test_moment_stats_equal_the_reference(rng, run):
    states = moment_states(rng)
    codes, metas = [c for c, _ in states], [m for _, m in states]
    codes[3].view(torch.uint8)[0, :2] = torch.tensor([0x7F, 0x7C], dtype=torch.uint8)  # NaN; E5M2 Inf
    rows = [None, None, None, torch.tensor([0, 13, 39])]
    stats = run(coat.ops.moment_stats, codes, metas, 32, rows)
    for i, (c, m) in enumerate(zip(codes, metas)):
        expected = reference_moment_stats(c, m, 32, rows[i])
        assert_same_bits(stats[i], torch.tensor(expected, dtype=torch.float64), f"state {i}")
    assert stats[3, 1] == 2 and stats[2, 4] == stats[2, 6] == 1 and stats[0, 7] > 0
    # 40 states: CUDA counts them in two launches of at most 32, the keys of all sorted together
    many = run(coat.ops.moment_stats, codes * 10, metas * 10, 32, rows * 10)
    assert_same_bits(many, stats.repeat(10, 1), "40 states vs 4")
    # 300 states: CUDA finds the states' runs of sorted keys 256 states at a time
    many = run(coat.ops.moment_stats, codes * 75, metas * 75, 32, rows * 75)
    assert_same_bits(many, stats.repeat(75, 1), "300 states vs 4")


def test_moment_stats_nan_k_and_rows_outside_the_state(rng, run):
    (codes, meta), (other, other_meta) = moment_states(rng)[:2]
    meta = meta.clone()
    meta[1, 2, 1] = float("nan")
    stats = run(coat.ops.moment_stats, [codes, other], [meta, other_meta], 32, [torch.tensor([4, 5]), None])
    assert stats[0, 0] == 600 and stats[0, 1] == 300  # row 5 is outside the 5 rows
    assert all(math.isnan(v) for v in stats[0, 4:7].tolist()) and stats[0, 7] == 1.0
    assert_same_bits(stats[1], torch.tensor(reference_moment_stats(other, other_meta, 32, None), dtype=torch.float64))


def test_opcheck_moment_stats(device, rng):
    states = moment_states(rng)
    codes, metas = [c.to(device) for c, _ in states], [m.to(device) for _, m in states]
    rows = [None, None, None, torch.tensor([1, 2], device=device)]
    torch.library.opcheck(torch.ops.coat.moment_stats.default, (codes, metas, 32, rows), test_utils=OPCHECK_UTILS_FP8)


def test_moment_stats_explain_bad_input(rng):
    (codes, meta), _, _, _ = moment_states(rng)
    with pytest.raises(ValueError, match="codes holds no state"):
        coat.ops.moment_stats([], [], 32)
    with pytest.raises(RuntimeError, match="one entry per state"):
        coat.ops.moment_stats([codes], [], 32)
    with pytest.raises(RuntimeError, match=r"metas\[0\] must be the contiguous bfloat16"):
        coat.ops.moment_stats([codes], [meta], 128)
    with pytest.raises(RuntimeError, match=r"codes\[0\] must be torch.float8"):
        coat.ops.moment_stats([codes.view(torch.uint8)], [meta], 32)
    with pytest.raises(RuntimeError, match="non-empty contiguous tensor"):
        coat.ops.moment_stats([codes.t()], [meta], 32)
    with pytest.raises(RuntimeError, match=r"rows\[0\] must be a non-empty contiguous 1-D int64"):
        coat.ops.moment_stats([codes], [meta], 32, [torch.tensor([0], dtype=torch.int32)])
