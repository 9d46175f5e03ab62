"""Tests of the fused RMSNorm ops: coat.ops.rmsnorm_quantize / rmsnorm_backward (with and without a residual
gradient) / rmsnorm_requantize (csrc/include/coat/norm_act.h), against the references and bounds that
tests/test_norm_act.py's module docstring states; CUDA (skipped without a GPU) against the C core, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

import reference_norm_act as ref
from coat import ops
from norm_act_helpers import (
    BLOCK_FORMATS,
    BLOCK_SAVE_CASES,
    E4M3,
    E5M2,
    EPS,
    REQUANTIZE_SHAPES,
    activations,
    assert_same_bits,
    bits,
    canonical_nan,
    check_near_forward,
    check_requantized,
    check_rmsnorm_backward,
    check_rmsnorm_forward,
    check_tied_to_quantize_group,
    check_tied_to_quantize_tensor,
    fp8_representable,
    on_device,
    rmsnorm_forward,
    rmsnorm_requantize,
    rows_of,
    run,
    several_rounds,
    with_special_values,
)


# ----------------------------------------------------------------------------------------------------
# RMSNorm forward

# H in {64, 128, 2048, 11008} from Llama shapes, 176 and 1000 (H % 128 != 0), 100 and 7 (H % 8 != 0: short
# chunks and the CUDA scalar path); rows 1, 97, 4097.
RMSNORM_SHAPES = [(1, 64), (97, 128), (4097, 176), (97, 2048), (1, 11008), (97, 11008), (97, 1000), (5, 100), (3, 7)]
# (x dtype, weight dtype, save group size, FP8 format of y)
RMSNORM_OPTIONS = [
    (torch.float32, torch.float32, 32, E4M3),
    (torch.float16, torch.bfloat16, 64, E5M2),
    (torch.bfloat16, torch.float32, 128, E5M2),
    (torch.bfloat16, torch.float16, 16, E4M3),
]


@pytest.mark.parametrize("shape", RMSNORM_SHAPES, ids=str)
def test_rmsnorm_forward(device, shape):
    x = activations(shape, torch.bfloat16, seed=shape[0] * shape[1])
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(1))).bfloat16()
    check_rmsnorm_forward(x, weight, rmsnorm_forward(x, weight, device=device))


@pytest.mark.parametrize("x_dtype, weight_dtype, group_size, fp8", RMSNORM_OPTIONS, ids=str)
def test_rmsnorm_forward_dtypes_and_groups(device, x_dtype, weight_dtype, group_size, fp8):
    x = activations((33, 1000), x_dtype, seed=7)
    weight = (1 + 0.2 * torch.randn(1000, generator=torch.Generator().manual_seed(2))).to(weight_dtype)
    outputs = rmsnorm_forward(x, weight, eps=1e-5, group_size=group_size, fp8=fp8, device=device)
    assert outputs[0].dtype == fp8
    check_rmsnorm_forward(x, weight, outputs, eps=1e-5, group_size=group_size)


def test_rmsnorm_forward_nd_and_strided(device):
    base = activations((2, 3, 5, 300), torch.bfloat16, seed=3)
    weight = torch.rand(256).bfloat16() + 0.5
    for x in (base[..., :256], base[..., 5:261]):  # row-strided; the second is not 16-byte aligned
        outputs = rmsnorm_forward(x, weight, device=device)
        y, y_scale, y_t, x_saved, x_saved_scales, rstd = outputs
        assert y.shape == x.shape and y_t.shape == (256, 30) and x_saved.shape == x.shape
        assert x_saved_scales.shape == (2, 3, 5, 16) and rstd.shape == (30,)
        check_rmsnorm_forward(x, weight, outputs)
        flat = rmsnorm_forward(rows_of(x.contiguous()), weight)
        for nd, two_d in zip(outputs, flat):
            assert_same_bits(nd.reshape(two_d.shape), two_d, "N-D strided vs 2-D contiguous")


def test_rmsnorm_forward_without_transpose(device):
    x = activations((97, 128), torch.bfloat16, seed=4)
    weight = torch.ones(128, dtype=torch.bfloat16)
    with_t = rmsnorm_forward(x, weight, device=device)
    without = rmsnorm_forward(x, weight, transpose=False, device=device)
    assert without[2].numel() == 0
    for i in (0, 1, 3, 4, 5):
        assert_same_bits(without[i], with_t[i])
    y, y_scale, y_t, *_ = ops.rmsnorm_quantize(x, weight)
    assert y_t is None


@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rmsnorm_forward_saves_fp4_and_fp6(device, fmt, shape, group_size):
    """save_format 1 (FP4) or 2 (FP6): x kept as quantize_blocks(x, fmt, G) bit for bit, made in the same pass;
    every other output as with E4M3. Specials (NaN, Inf, zeros, tiny values) go through the block rule."""
    x = activations(shape, torch.bfloat16, seed=shape[1])
    x[0, : min(3, shape[1])] = torch.tensor([float("nan"), 0.0, 1e-30][: min(3, shape[1])], dtype=torch.bfloat16)
    if shape[0] > 1:
        x[1, -1] = float("inf")
    weight = (1 + 0.2 * torch.randn(shape[1], generator=torch.Generator().manual_seed(1))).bfloat16()
    packed = rmsnorm_forward(x, weight, group_size=group_size, device=device, save_format=fmt)
    e4m3 = rmsnorm_forward(x, weight, group_size=group_size, device=device)
    codes, scales = ops.quantize_blocks(x, fmt, group_size)
    assert_same_bits(packed[3], codes, f"x_saved vs quantize_blocks {fmt}")
    assert_same_bits(packed[4], scales, f"x_saved_scales vs quantize_blocks {fmt}")
    for i in (0, 1, 2, 5):
        assert_same_bits(packed[i], e4m3[i], "an output other than the saved copy")


def test_rmsnorm_amax_group_size_does_not_change_outputs(device):
    x = activations((33, 176), torch.bfloat16, seed=5)
    weight = torch.ones(176, dtype=torch.bfloat16)
    first = rmsnorm_forward(x, weight, amax_group_size=16, device=device)
    for amax_group_size in (32, 64, 128):
        for a, b in zip(first, rmsnorm_forward(x, weight, amax_group_size=amax_group_size, device=device)):
            assert_same_bits(a, b)


def test_rmsnorm_forward_special_values(device):
    """Zero and constant rows, NaN and +-Inf. Documented behaviour: a zero row gives y = 0 and
    rstd = 1/sqrt(eps); a NaN row gives rstd = NaN and NaN codes in its y row; a row holding +-Inf gets
    rstd = 0, so y is 0 there except NaN (Inf * 0) at the Inf; NaN rows never reach y_scale (NaN is
    ignored by the amax); the saved input follows quantize_group (an Inf makes its group's scale Inf)."""
    x = activations((6, 64), torch.bfloat16, seed=6, outliers=False)
    x[0] = 0
    x[1] = 3.0
    x[2, 5] = math.nan
    x[3, 7] = math.inf
    x[4, 9] = -math.inf
    weight = torch.ones(64, dtype=torch.bfloat16)
    outputs = rmsnorm_forward(x, weight, device=device)
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = outputs
    codes = y.view(torch.uint8)
    assert (codes[0] == 0).all() and rstd[0].item() == pytest.approx(1 / math.sqrt(EPS), rel=1e-6)
    assert rstd[1].item() == pytest.approx(1 / math.sqrt(9 + EPS), rel=1e-6)
    assert torch.isnan(rstd[2]) and (codes[2] == 0x7F).all()
    for row, col in ((3, 7), (4, 9)):
        assert rstd[row].item() == 0.0
        expected = torch.zeros(64, dtype=torch.uint8)
        expected[col] = 0x7F
        assert torch.equal(codes[row] & 0x7F, expected)  # x * 0 keeps the sign of x: codes 0x00 and 0x80
    finite_rows = ref.rmsnorm(x[[0, 1, 5]], weight, EPS)[0]
    assert y_scale.item() == pytest.approx(ref.per_tensor_scale(finite_rows, E4M3), rel=1e-5)
    check_tied_to_quantize_group(x_saved, x_saved_scales, x, 16)
    check_tied_to_quantize_tensor(y, y_scale, ref.rmsnorm_forward_f32(x.float(), rstd, weight.float()), y_t)


# ----------------------------------------------------------------------------------------------------
# RMSNorm backward


def rmsnorm_backward_case(shape, dtype, weight_dtype=torch.bfloat16, group_size=16, seed=0):
    x = activations(shape, torch.bfloat16, seed=seed)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(seed + 1))).to(weight_dtype)
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, group_size=group_size, transpose=False)
    dy = activations(shape, dtype, seed=seed + 2, outliers=False)
    return dy, x_saved, x_saved_scales, rstd, weight


@pytest.mark.parametrize("shape", RMSNORM_SHAPES, ids=str)
def test_rmsnorm_backward(device, shape):
    dy, x_saved, x_saved_scales, rstd, weight = rmsnorm_backward_case(shape, torch.bfloat16, seed=shape[1])
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    assert dx.dtype == dy.dtype and dweight.dtype == torch.float32 and dweight.shape == (shape[-1],)
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, dx, dweight)


@pytest.mark.parametrize("dy_dtype, weight_dtype, group_size", [
    (torch.float32, torch.float32, 32), (torch.float16, torch.bfloat16, 64), (torch.bfloat16, torch.float32, 128),
], ids=str)
def test_rmsnorm_backward_dtypes_and_groups(device, dy_dtype, weight_dtype, group_size):
    case = rmsnorm_backward_case((300, 1000), dy_dtype, weight_dtype, group_size, seed=11)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, *case, group_size, device=device)
    assert dx.dtype == dy_dtype
    check_rmsnorm_backward(*case, group_size, dx, dweight)


def test_rmsnorm_backward_nd_strided_dy(device):
    x = activations((2, 7, 128), torch.bfloat16, seed=12)
    weight = torch.rand(128).bfloat16() + 0.5
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight)
    dy = activations((2, 7, 160), torch.bfloat16, seed=13)[..., 16:144]
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    assert dx.shape == (2, 7, 128) and dx.is_contiguous()
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, dx, dweight)


def test_rmsnorm_backward_many_slices(device):
    """More rows than the maximum number of dweight slices, with a last slice that is short."""
    cols = 64
    rows = 3 * max(128, 65536 // ref.rmsnorm_lanes(cols)) + 5
    assert ref.rmsnorm_backward_rows_per_slice(rows, cols) == 4
    case = rmsnorm_backward_case((rows, cols), torch.bfloat16, seed=14)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, *case, 16, device=device)
    check_rmsnorm_backward(*case, 16, dx, dweight)


@pytest.mark.parametrize("cols", [1032, 4096, 8192, 16384, 20000, 32768])
def test_rmsnorm_every_row_width_class(device, cols):
    """One shape per number of lanes L a row is reduced by (64 ... 1024: the CUDA kernels use 256-, 512- and
    1024-thread blocks, and the widest rows keep part of their state in shared memory)."""
    x = activations((3, cols), torch.bfloat16, seed=cols)
    weight = (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(cols))).bfloat16()
    outputs = rmsnorm_forward(x, weight, device=device)
    check_rmsnorm_forward(x, weight, outputs)
    _, _, _, x_saved, x_saved_scales, rstd = outputs
    dy = activations((3, cols), torch.bfloat16, seed=cols + 1, outliers=False)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, dx, dweight)


def test_rmsnorm_zero_rows(device):
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, device=device)
    assert y.shape == (0, 64) and y_t.shape == (64, 0) and rstd.shape == (0,)
    assert y_scale.item() == 2.0**-126
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, x, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    assert dx.shape == (0, 64) and (dweight == 0).all()
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, x, x_saved, x_saved_scales, rstd, weight, 16, x.float(),
                      device=device)
    assert dx.shape == (0, 64) and dx.dtype == torch.float32 and (dweight == 0).all()


# With a residual gradient: dx = round(residual dtype, float(dx in dy's dtype) + residual), which is torch's
# dx.to(residual.dtype) + residual when dy's dtype converts to residual's exactly; NaN canonical.


def check_rmsnorm_backward_residual(case, residual, device) -> torch.Tensor:
    """dx and dweight with the residual against the op without it; returns dx."""
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, *case, 16, device=device)
    dx_residual, dweight_residual = run(torch.ops.coat.rmsnorm_backward, *case, 16, residual, device=device)
    assert dx_residual.dtype == residual.dtype and dx_residual.shape == dx.shape
    assert_same_bits(dx_residual, canonical_nan(dx.to(residual.dtype) + residual), "dx vs dx + residual in torch")
    assert_same_bits(dweight_residual, dweight, "dweight with a residual vs without")
    return dx_residual


# (97, 1000): the CUDA kernel's 16-byte path; (5, 100): element by element (H % 8 != 0)
@pytest.mark.parametrize("shape", [(97, 1000), (5, 100)], ids=str)
@pytest.mark.parametrize("dy_dtype, residual_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
    (torch.float16, torch.float16),
], ids=str)
def test_rmsnorm_backward_residual(device, shape, dy_dtype, residual_dtype):
    case = rmsnorm_backward_case(shape, dy_dtype, seed=15)
    residual = activations(shape, residual_dtype, seed=16)
    check_rmsnorm_backward_residual(case, residual, device)


def test_rmsnorm_backward_residual_nd_and_wrapper(device):
    """An N-D dy read as row-strided rows with a contiguous residual of its shape, through coat.ops."""
    x = activations((2, 7, 128), torch.bfloat16, seed=17)
    weight = torch.rand(128).bfloat16() + 0.5
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight)
    dy = activations((2, 7, 160), torch.bfloat16, seed=18)[..., 16:144]
    residual = activations((2, 7, 128), torch.float32, seed=19)
    dx = check_rmsnorm_backward_residual((dy, x_saved, x_saved_scales, rstd, weight), residual, device)
    assert dx.shape == (2, 7, 128) and dx.is_contiguous()
    dx_ops, _ = ops.rmsnorm_backward(*(on_device(t, device) for t in (dy, x_saved, x_saved_scales, rstd, weight)),
                                     residual=on_device(residual, device))
    assert_same_bits(dx_ops.cpu(), dx, "coat.ops.rmsnorm_backward(residual=)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rmsnorm_backward_residual_special_values(device, dtype):
    """NaN (of either sign) and +-Inf in the residual, rows of dx that are NaN or +-Inf (from dy), sums past the
    dtype's largest value: each as the formula says, every NaN canonical (positive)."""
    case = rmsnorm_backward_case((8, 512), dtype, seed=20)
    case[0][4, 7], case[0][5, 9] = math.nan, math.inf  # dx: row 4 NaN; row 5 +-Inf, NaN at the Inf
    residual = activations((8, 512), dtype, seed=21, outliers=False)
    residual[0, 1], residual[0, 2], residual[0, 3], residual[4, 7] = math.nan, math.inf, -math.inf, math.inf
    nan_bits = bits(torch.tensor(math.nan, dtype=dtype))
    bits(residual)[1] = nan_bits | torch.iinfo(nan_bits.dtype).min  # a negative NaN: the sign bit set
    largest = torch.finfo(dtype).max
    case[0][2:4] *= largest / 100  # dx of rows 2 and 3 up to 1% of largest, past half the last step below it
    residual[2, :] = largest
    residual[3, :] = -largest
    dx = check_rmsnorm_backward_residual(case, residual, device)
    assert dx[0, 1].isnan() and dx[0, 2] == math.inf and dx[0, 3] == -math.inf
    assert dx[[1, 4]].isnan().all() and (bits(dx[1]) == bits(torch.tensor(math.nan, dtype=dtype))).all()
    assert not dx[5].isfinite().any()
    assert dx[2].isinf().any() and dx[3].isinf().any()  # largest + dx rounds past the largest value


# ----------------------------------------------------------------------------------------------------
# Requantize (the bounds: the comment in tests/norm_act_helpers.py)


@pytest.mark.parametrize("shape", REQUANTIZE_SHAPES, ids=str)
def test_rmsnorm_requantize(device, shape):
    x = activations(shape, torch.bfloat16, seed=70 + shape[-1])
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(71))).bfloat16()
    _, y_scale, y_t, *saved, rstd = rmsnorm_forward(x, weight)
    requantized = rmsnorm_requantize(saved, rstd, weight, y_scale, device=device)
    check_requantized(requantized, ref.rmsnorm_forward_f32(ref.decode_saved(*saved, 16), rstd, weight.float()), y_scale)
    bound = ref.e4m3_half_step(x, saved[1], 16) * (rstd.double().unsqueeze(-1) * weight.double()).abs()
    check_near_forward(requantized, y_t, y_scale, bound)


@pytest.mark.parametrize("weight_dtype, group_size, fp8", [
    (torch.float32, 16, E5M2), (torch.bfloat16, 32, E4M3), (torch.float16, 64, E5M2), (torch.float32, 128, E4M3),
], ids=str)
def test_rmsnorm_requantize_dtypes_and_groups(device, weight_dtype, group_size, fp8):
    x = activations((33, 1000), torch.bfloat16, seed=72)  # 1000 % G != 0: a short last group for every G
    weight = (1 + 0.2 * torch.randn(1000, generator=torch.Generator().manual_seed(73))).to(weight_dtype)
    _, y_scale, y_t, *saved, rstd = rmsnorm_forward(x, weight, group_size=group_size, fp8=fp8)
    requantized = rmsnorm_requantize(saved, rstd, weight, y_scale, group_size, fp8, device=device)
    assert requantized.dtype == fp8
    check_requantized(requantized, ref.rmsnorm_forward_f32(ref.decode_saved(*saved, group_size), rstd, weight.float()),
                      y_scale)
    bound = ref.e4m3_half_step(x, saved[1], group_size) * (rstd.double().unsqueeze(-1) * weight.double()).abs()
    check_near_forward(requantized, y_t, y_scale, bound)


@pytest.mark.parametrize("x_dtype, group_size, fp8", [
    (torch.bfloat16, 16, E4M3), (torch.float32, 32, E5M2), (torch.float16, 64, E4M3), (torch.bfloat16, 128, E5M2),
], ids=str)
def test_rmsnorm_requantize_equals_forward_on_representable_x(device, x_dtype, group_size, fp8):
    x = fp8_representable((37, 300), x_dtype, group_size, seed=74)
    weight = (1 + 0.2 * torch.randn(300, generator=torch.Generator().manual_seed(75))).bfloat16()
    _, y_scale, y_t, *saved, rstd = rmsnorm_forward(x, weight, group_size=group_size, fp8=fp8)
    assert_same_bits(ref.decode_saved(*saved, group_size), x.float(), "x' vs x")
    assert_same_bits(rmsnorm_requantize(saved, rstd, weight, y_scale, group_size, fp8, device=device), y_t,
                     "requantized y_t vs the forward's")


# ----------------------------------------------------------------------------------------------------
# Backward and requantize from an FP4 or FP6 copy (see tests/test_norm_act_silu_mul.py for SiLU*mul's)


@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rmsnorm_ops_read_fp4_and_fp6_as_their_e4m3_expansion(device, fmt, shape, group_size, dy_dtype):
    x = with_special_values(activations(shape, torch.bfloat16, seed=shape[1] + 1))
    weight = (1 + 0.2 * torch.randn(shape[1], generator=torch.Generator().manual_seed(2))).bfloat16()
    _, y_scale, _, codes, scales, rstd = rmsnorm_forward(x, weight, group_size=group_size, save_format=fmt)
    expanded, _ = ops.blocks_to_e4m3(codes, scales, shape[1], fmt, group_size)
    dy = activations(shape, dy_dtype, seed=3, outliers=False)
    for residual in (None, activations(shape, torch.float32, seed=4, outliers=False)):
        from_packed = run(torch.ops.coat.rmsnorm_backward, dy, codes, scales, rstd, weight, group_size, residual, fmt,
                          device=device)
        from_e4m3 = run(torch.ops.coat.rmsnorm_backward, dy, expanded, scales, rstd, weight, group_size, residual,
                        device=device)
        for name, a, b in zip(("dx", "dweight"), from_packed, from_e4m3):
            assert_same_bits(a, b, f"{name} from {fmt} vs from its expansion (residual: {residual is not None})")
    for fp8 in (E4M3, E5M2):
        (from_packed,) = run(lambda *a: (torch.ops.coat.rmsnorm_requantize(*a),), codes, scales, rstd, weight,
                             y_scale, group_size, fp8, fmt, device=device)
        (from_e4m3,) = run(lambda *a: (torch.ops.coat.rmsnorm_requantize(*a),), expanded, scales, rstd, weight,
                           y_scale, group_size, fp8, device=device)
        assert_same_bits(from_packed, from_e4m3, f"{fp8} y_t from {fmt} vs from its expansion")


# ----------------------------------------------------------------------------------------------------
# Kernel paths: several rounds of the persistent kernels (on CUDA)


@pytest.mark.parametrize("cols", [256, 4096])
def test_rmsnorm_several_rounds(cuda_device, cols):
    """Every block of the persistent kernels takes several rounds: the statistics pass reduces at most
    8 blocks x 256 / L rows per SM and round, the second pass 8 blocks x 64 x 64 / cols rows; the backward
    walks several rows per slice."""
    rows = several_rounds(max(8 * 256 // ref.rmsnorm_lanes(cols), 8 * 64 * 64 // cols))
    x = activations((rows, cols), torch.bfloat16, seed=cols)
    weight = (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(60))).float()
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, device=cuda_device)
    assert ref.rmsnorm_backward_rows_per_slice(rows, cols) > 2
    dy = activations((rows, cols), torch.bfloat16, seed=cols + 1, outliers=False)
    run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=cuda_device)


def test_rmsnorm_backward_residual_on_another_device(cuda_device):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    _, _, _, saved, scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False)
    on_gpu = [t.to(cuda_device) for t in (x, saved, scales, rstd, weight)]
    with pytest.raises(RuntimeError, match="residual is on cpu but the input is on cuda"):
        torch.ops.coat.rmsnorm_backward(*on_gpu, 16, x)
