"""coat.ops.rmsnorm_save: RMSNorm with its output in high precision (x's dtype, or the residual's) and its input
saved in FP8 for backward (csrc/include/coat/norm_act.h's coat_rmsnorm_save), for post-norms and OLMo 2's q/k norms.

What is checked, and against what:
- out bit for bit against its documented float32 formula (tests/reference_norm_act.py's rmsnorm_forward_f32 with the
  kernel's rstd, rounded once to x's dtype; with a residual, that rounded value plus the residual in float32,
  rounded once: torch's residual + norm(x)), and against the float64 oracle within one rounding to the output dtype
  plus float32's own error.
- x_saved, x_saved_scales and rstd bit for bit what rmsnorm_quantize saves for the same arguments (every save
  format), so that rmsnorm_backward is the backward; OLMo2RMSNorm's gradients from it within the E4M3 bound of
  tests/test_norm_act.py.
- weight_offset, strided x, zero rows, NaN / Inf rows, errors, the fake (opcheck).
- CUDA (skipped without a GPU): `run` compares every output with the C core's, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

import reference_norm_act as ref
from coat import ops
from norm_act_helpers import EPS, activations, assert_same_bits, max_error, on_device, rows_of, run

SHAPES = [(1, 64), (97, 128), (67, 176), (9, 1000), (5, 100), (3, 7), (2, 20000), (2, 3, 2048)]
# (x dtype, weight dtype, residual dtype or None, save group size)
OPTIONS = [
    (torch.bfloat16, torch.float32, None, 16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 32),
    (torch.float16, torch.float32, torch.float32, 64),
    (torch.float32, torch.bfloat16, torch.float32, 128),
    (torch.float32, torch.float32, torch.bfloat16, 16),
]


def norm_weight(cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(seed))).to(dtype)


def rmsnorm_save(x, weight, residual=None, *, group_size=16, save_format="e4m3", weight_offset=0.0, device="cpu"):
    return run(torch.ops.coat.rmsnorm_save, x, weight, EPS, group_size, residual, save_format, weight_offset,
               device=device)


def expected_out(x, weight, rstd, residual, weight_offset=0.0) -> torch.Tensor:
    """The documented float32 formula: y rounded once to x's dtype, then plus the residual in float32."""
    y32 = ref.rmsnorm_forward_f32(rows_of(x).float(), rstd, weight.float() + weight_offset).reshape(x.shape)
    y = y32.to(x.dtype)
    out = y if residual is None else (y.float() + residual.float()).to(residual.dtype)
    return torch.where(torch.isnan(out), torch.full_like(out, math.nan), out)  # NaN canonical (positive)


def check_out(x, weight, residual, outputs, *, group_size=16, weight_offset=0.0, save_format="e4m3") -> None:
    out, x_saved, x_saved_scales, rstd = outputs
    assert out.shape == x.shape and out.is_contiguous()
    assert out.dtype == (x.dtype if residual is None else residual.dtype)
    assert_same_bits(out, expected_out(x, weight, rstd, residual, weight_offset), "out vs the documented formula")
    # the float64 oracle where it is finite (NaN follows the formula, checked above): one rounding to the output
    # dtype (two with a residual) plus float32's own error
    y64 = ref.rmsnorm(rows_of(x), weight, EPS, weight_offset)[0].reshape(x.shape)
    expected64 = y64 if residual is None else y64 + residual.double()
    finite = torch.isfinite(expected64)
    out, y64, expected64 = out[finite], y64[finite], expected64[finite]
    rounding = max_error(expected64.to(out.dtype), expected64)
    if residual is not None:
        rounding += max_error(y64.to(x.dtype), y64)
    assert max_error(out, expected64) <= 2 * rounding + 1e-5 * max_error(expected64, 0 * expected64)
    # what it saves is what rmsnorm_quantize saves
    *_, q_saved, q_scales, q_rstd = ops.rmsnorm_quantize(x, weight, EPS, save_group_size=group_size,
                                                         save_format=save_format, weight_offset=weight_offset)
    assert_same_bits(x_saved, q_saved, "x_saved vs rmsnorm_quantize's")
    assert_same_bits(x_saved_scales, q_scales, "x_saved_scales vs rmsnorm_quantize's")
    assert_same_bits(rstd, q_rstd, "rstd vs rmsnorm_quantize's")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("x_dtype, weight_dtype, residual_dtype, group_size", OPTIONS, ids=str)
def test_matches_the_formula_and_the_oracle(device, shape, x_dtype, weight_dtype, residual_dtype, group_size):
    x = activations(shape, x_dtype, seed=shape[-1])
    weight = norm_weight(shape[-1], weight_dtype, seed=1)
    residual = None if residual_dtype is None else activations(shape, residual_dtype, seed=2, outliers=False)
    outputs = rmsnorm_save(x, weight, residual, group_size=group_size, device=device)
    check_out(x, weight, residual, outputs, group_size=group_size)


@pytest.mark.parametrize("offset", [1.0, -0.5])
def test_weight_offset(device, offset):
    """Gemma 3's post-norms: (1 + w) with w stored near 0."""
    x = activations((33, 1000), torch.bfloat16, seed=3)
    weight = (0.1 * torch.randn(1000, generator=torch.Generator().manual_seed(4))).bfloat16()
    residual = activations((33, 1000), torch.bfloat16, seed=5, outliers=False)
    for res in (None, residual):
        outputs = rmsnorm_save(x, weight, res, weight_offset=offset, device=device)
        check_out(x, weight, res, outputs, weight_offset=offset)


@pytest.mark.parametrize("save_format", ["fp4", "fp6"])
def test_fp4_and_fp6_copies(device, save_format):
    x = activations((9, 1000), torch.bfloat16, seed=6)
    weight = norm_weight(1000, torch.float32, seed=7)
    check_out(x, weight, None, rmsnorm_save(x, weight, save_format=save_format, device=device),
              save_format=save_format)


def test_strided_x_and_zero_rows(device):
    wide = activations((5, 3 * 128), torch.bfloat16, seed=8)
    x = wide[:, 128:256]  # a column slice of one GEMM output, read in place
    weight = norm_weight(128, torch.bfloat16, seed=9)
    residual = activations((5, 128), torch.bfloat16, seed=10)
    check_out(x, weight, residual, rmsnorm_save(x, weight, residual, device=device))
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    out, x_saved, scales, rstd = rmsnorm_save(empty, norm_weight(64, torch.bfloat16, 1), device=device)
    assert out.shape == (0, 64) and x_saved.shape == (0, 64) and scales.shape == (0, 4) and rstd.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_special_values(device, dtype):
    """A zero row gives 0; a NaN row gives NaN, stored canonically; a row holding +-Inf has rstd 0: NaN at the Inf,
    0 elsewhere (Inf * 0), as torch's formula does; a residual is added to each of these."""
    x = activations((5, 64), dtype, seed=11, outliers=False)
    x[0] = 0
    x[1, 5] = math.nan
    x[2, 7] = math.inf
    x[3, 9] = -math.inf
    weight = torch.ones(64, dtype=dtype)
    residual = activations((5, 64), dtype, seed=12, outliers=False)
    for res in (None, residual):
        outputs = rmsnorm_save(x, weight, res, device=device)
        check_out(x, weight, res, outputs)  # bit for bit, NaN canonical
        y = outputs[0] if res is None else outputs[0] - res  # exact: the residual was added to a 0 or a NaN
        assert (y[0] == 0).all() and torch.isnan(y[1]).all()
        for row, col in ((2, 7), (3, 9)):
            assert torch.isnan(y[row, col]) and (y[row][torch.arange(64) != col] == 0).all()


def test_backward_is_rmsnorm_backward(device):
    """OLMo2RMSNorm's gradients in float64 at the saved input, from rmsnorm_backward on what this op saved."""
    x = activations((67, 176), torch.bfloat16, seed=13)
    weight = norm_weight(176, torch.float32, seed=14)
    _, x_saved, x_saved_scales, rstd = rmsnorm_save(x, weight, device=device)
    dy = activations((67, 176), torch.bfloat16, seed=15, outliers=False)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    x_deq = ops.dequantize(x_saved, x_saved_scales, 16, torch.float32)
    dx64, dweight64 = ref.rmsnorm_backward(dy, x_deq, rstd, weight)
    assert max_error(dx, dx64) <= 2 * max_error(dx64.to(torch.bfloat16), dx64) + 1e-5 * dx64.abs().max().item()
    assert max_error(dweight, dweight64) <= 1e-5 * dweight64.abs().max().item()


def test_python_wrapper():
    x = activations((6, 64), torch.bfloat16, seed=16)
    weight = norm_weight(64, torch.bfloat16, seed=17)
    residual = activations((6, 64), torch.float32, seed=18)
    got = ops.rmsnorm_save(x, weight, EPS, residual=residual, save_group_size=32, weight_offset=0.5)
    for i, (a, e) in enumerate(zip(got, torch.ops.coat.rmsnorm_save(x, weight, EPS, 32, residual, "e4m3", 0.5))):
        assert_same_bits(a, e, f"wrapper output {i}")


def _error_cases():
    x, weight = torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    op = torch.ops.coat.rmsnorm_save
    prefix = r"coat\.rmsnorm_save: "
    return {
        "residual-shape": (lambda m: op(m(x), m(weight), EPS, 16, m(torch.ones(4, 32)), "e4m3", 0.0),
                           prefix + r"residual has shape \[4, 32\] but x has shape \[4, 64\]"),
        "weight-shape": (lambda m: op(m(x), m(torch.ones(32)), EPS, 16, None, "e4m3", 0.0),
                         prefix + r"weight must have shape \[64\]"),
        "group-size": (lambda m: op(m(x), m(weight), EPS, 8, None, "e4m3", 0.0),
                       prefix + r"save_group_size must be 16, 32, 64 or 128, got 8"),
        "offset": (lambda m: op(m(x), m(weight), EPS, 16, None, "e4m3", math.inf),
                   prefix + r"weight_offset must be finite"),
        "eps": (lambda m: op(m(x), m(weight), -1.0, 16, None, "e4m3", 0.0), prefix + r"eps must be finite and >= 0"),
        "cols": (lambda m: op(m(torch.ones(2, 40000)), m(torch.ones(40000)), EPS, 16, None, "e4m3", 0.0),
                 prefix + r"the last dimension of x \(the normalized size\) must be between 1 and 32768"),
    }


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_say_what_is_wrong(device, case):
    call, message = ERROR_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        call(lambda t: on_device(t, device))


def test_opcheck(device):
    x = on_device(activations((3, 5, 64), torch.bfloat16, seed=41), device)
    weight = on_device(norm_weight(64, torch.bfloat16, seed=42), device)
    for residual in (None, x.float()):
        torch.library.opcheck(torch.ops.coat.rmsnorm_save.default, (x, weight, EPS, 16, residual, "e4m3", 1.0))
    torch.library.opcheck(torch.ops.coat.rmsnorm_save.default, (x, weight, EPS, 32, None, "fp4", 0.0))
