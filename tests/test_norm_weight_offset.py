"""weight_offset of the RMSNorm ops (coat/norm_act.h): the norm multiplies by weight + weight_offset, the sum in
float32 (Gemma's norms, stored as w - 1, take 1).

What is checked, and against what:
- Every output of rmsnorm_quantize, rmsnorm_backward and rmsnorm_requantize with (weight, offset) equals, bit for
  bit, the same op with offset 0 and the float32 weight weight.float() + offset: the offset is one float32
  addition per weight element, nothing else (dweight, whose formula does not read the weight, included).
- The outputs against the float64 oracle of tests/reference_norm_act.py with the offset (the checks of
  tests/test_norm_act.py, their bounds unchanged).
- The Python wrappers pass it, a non-finite offset is refused, the fakes accept it (opcheck).
- CUDA (skipped without a GPU): `run` compares every output with the C core's, bit for bit.
qk_norm_rope's offset is tested in tests/test_qk_norm_rope.py.
"""
from __future__ import annotations

import pytest
import torch

import reference_norm_act as ref
from coat import ops
from norm_act_helpers import (
    E4M3,
    E5M2,
    EPS,
    activations,
    assert_same_bits,
    check_fp8_output,
    check_rmsnorm_backward,
    check_rmsnorm_forward,
    on_device,
    rmsnorm_forward,
    run,
)

# (shape, x dtype, weight dtype, save group size, FP8 format of y); every lane-count class of the kernels
CASES = [
    ((97, 128), torch.bfloat16, torch.bfloat16, 16, E4M3),
    ((33, 1000), torch.float16, torch.float32, 32, E5M2),
    ((5, 100), torch.float32, torch.float16, 64, E4M3),
    ((9, 2048), torch.bfloat16, torch.float32, 128, E4M3),
    ((2, 20000), torch.bfloat16, torch.bfloat16, 16, E4M3),
    ((3, 7), torch.float32, torch.float32, 16, E5M2),
]
OFFSETS = [1.0, -0.5]


def gemma_weight(cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A stored Gemma-style weight: small values around 0, the norm's factor being 1 + weight."""
    return (0.1 * torch.randn(cols, generator=torch.Generator().manual_seed(seed))).to(dtype)


def offset_forward(x, weight, offset, *, group_size=16, fp8=E4M3, device="cpu"):
    return run(torch.ops.coat.rmsnorm_quantize, x, weight, EPS, group_size, 128, fp8, True, "e4m3", offset,
               device=device)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("shape, x_dtype, weight_dtype, group_size, fp8", CASES, ids=str)
def test_forward_is_the_float32_sum(device, shape, x_dtype, weight_dtype, group_size, fp8, offset):
    x = activations(shape, x_dtype, seed=shape[-1])
    weight = gemma_weight(shape[-1], weight_dtype, seed=3)
    outputs = offset_forward(x, weight, offset, group_size=group_size, fp8=fp8, device=device)
    summed = weight.float() + offset
    for i, (got, expected) in enumerate(zip(outputs, rmsnorm_forward(x, summed, group_size=group_size, fp8=fp8))):
        assert_same_bits(got, expected, f"output {i} vs offset 0 with weight.float() + offset")
    check_rmsnorm_forward(x, summed, outputs, group_size=group_size)
    y64 = ref.rmsnorm(x.reshape(-1, shape[-1]), weight, EPS, offset)[0].reshape(shape)
    check_fp8_output(outputs[0], outputs[1], y64)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("shape, x_dtype, weight_dtype, group_size, fp8", CASES, ids=str)
def test_backward_is_the_float32_sum(device, shape, x_dtype, weight_dtype, group_size, fp8, offset):
    x = activations(shape, torch.bfloat16, seed=shape[0])
    weight = gemma_weight(shape[-1], weight_dtype, seed=5)
    *_, x_saved, x_saved_scales, rstd = offset_forward(x, weight, offset, group_size=group_size)
    dy = activations(shape, x_dtype, seed=shape[0] + 1, outliers=False)
    residual = activations(shape, torch.float32, seed=9, outliers=False)
    summed = weight.float() + offset
    for res in (None, residual):
        dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, group_size,
                          res, "e4m3", offset, device=device)
        expected = torch.ops.coat.rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, summed, group_size, res)
        assert_same_bits(dx, expected[0], "dx vs offset 0 with weight.float() + offset")
        assert_same_bits(dweight, expected[1], "dweight vs offset 0 with weight.float() + offset")
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, group_size, None,
                      "e4m3", offset, device=device)
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, summed, group_size, dx, dweight)
    # the oracle's own sum (float64) agrees with the float32 one to float32 rounding of w + offset
    x_deq = ops.dequantize(x_saved, x_saved_scales, group_size, torch.float32).reshape(-1, shape[-1])
    dx64, _ = ref.rmsnorm_backward(dy.reshape(-1, shape[-1]), x_deq, rstd, weight, offset)
    dx64_summed, _ = ref.rmsnorm_backward(dy.reshape(-1, shape[-1]), x_deq, rstd, summed)
    assert (dx64 - dx64_summed).abs().max().item() <= 2.0**-23 * dx64.abs().max().item() * 4


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("shape, x_dtype, weight_dtype, group_size, fp8", CASES, ids=str)
def test_requantize_is_the_float32_sum(device, shape, x_dtype, weight_dtype, group_size, fp8, offset):
    x = activations(shape, x_dtype, seed=shape[-1] + 2)
    weight = gemma_weight(shape[-1], weight_dtype, seed=7)
    _, y_scale, _, x_saved, x_saved_scales, rstd = offset_forward(x, weight, offset, group_size=group_size, fp8=fp8)
    y_t = run(lambda *a: (torch.ops.coat.rmsnorm_requantize(*a),), x_saved, x_saved_scales, rstd, weight, y_scale,
              group_size, fp8, "e4m3", offset, device=device)[0]
    expected = torch.ops.coat.rmsnorm_requantize(x_saved, x_saved_scales, rstd, weight.float() + offset, y_scale,
                                                 group_size, fp8)
    assert_same_bits(y_t, expected, "y_t vs offset 0 with weight.float() + offset")


def test_python_wrappers_pass_the_offset():
    x = activations((6, 64), torch.bfloat16, seed=1)
    weight = gemma_weight(64, torch.bfloat16, seed=2)
    y, y_scale, _, x_saved, x_saved_scales, rstd = ops.rmsnorm_quantize(x, weight, EPS, transpose=True,
                                                                          weight_offset=1.0)
    assert_same_bits(y, offset_forward(x, weight, 1.0)[0], "rmsnorm_quantize")
    dy = activations((6, 64), torch.bfloat16, seed=3, outliers=False)
    dx, dweight = ops.rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, weight_offset=1.0)
    expected = torch.ops.coat.rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, None, "e4m3", 1.0)
    assert_same_bits(dx, expected[0], "rmsnorm_backward")
    assert_same_bits(ops.rmsnorm_requantize(x_saved, x_saved_scales, rstd, weight, y_scale, weight_offset=1.0),
                     torch.ops.coat.rmsnorm_requantize(x_saved, x_saved_scales, rstd, weight, y_scale, 16, E4M3,
                                                       "e4m3", 1.0), "rmsnorm_requantize")


@pytest.mark.parametrize("offset", [float("inf"), float("nan"), 1e39])
def test_non_finite_offset_is_refused(offset):
    x = activations((2, 64), torch.bfloat16, seed=1)
    weight = gemma_weight(64, torch.bfloat16, seed=2)
    with pytest.raises(RuntimeError, match="weight_offset must be finite"):
        ops.rmsnorm_quantize(x, weight, EPS, weight_offset=offset)
    *_, x_saved, x_saved_scales, rstd = ops.rmsnorm_quantize(x, weight, EPS)
    with pytest.raises(RuntimeError, match="weight_offset must be finite"):
        ops.rmsnorm_backward(x, x_saved, x_saved_scales, rstd, weight, weight_offset=offset)
    with pytest.raises(RuntimeError, match="weight_offset must be finite"):
        ops.rmsnorm_requantize(x_saved, x_saved_scales, rstd, weight, torch.tensor(0.01), weight_offset=offset)


def test_opcheck_with_offset(device):
    x = on_device(activations((3, 5, 64), torch.bfloat16, seed=41), device)
    weight = on_device(gemma_weight(64, torch.bfloat16, seed=4), device)
    torch.library.opcheck(torch.ops.coat.rmsnorm_quantize.default, (x, weight, EPS, 16, 128, E4M3, True, "e4m3", 1.0))
    fp8_input_checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    _, _, _, x_saved, x_saved_scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False)
    torch.library.opcheck(torch.ops.coat.rmsnorm_backward.default,
                          (x, x_saved, x_saved_scales, rstd, weight, 16, None, "e4m3", 1.0),
                          test_utils=fp8_input_checks)
    y_scale = on_device(torch.tensor(0.01), device)
    torch.library.opcheck(torch.ops.coat.rmsnorm_requantize.default,
                          (x_saved, x_saved_scales, rstd, weight, y_scale, 16, E4M3, "e4m3", 1.0),
                          test_utils=fp8_input_checks)
