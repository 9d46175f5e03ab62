"""Tests of the fused non-linear layers: coat.ops.rmsnorm_quantize / rmsnorm_backward / rmsnorm_requantize
and silu_mul_quantize / silu_mul_backward / silu_mul_requantize (csrc/include/coat/norm_act.h), the latter with
either activation (silu: SwiGLU; gelu_tanh: GeGLU), each SiLU*mul test taking both where it has `activation`.

What is checked, and against what:
- Ties to the standalone quantizers, bit for bit: y == quantize_tensor(the fp32 op result), and the saved
  inputs == quantize_group(input). A NaN that the op's arithmetic produces is made canonical (positive)
  before it is quantized, since its sign is platform-defined; the fp32 replay of the op does not know
  that, so y's NaN codes are compared without their sign. Saved inputs come from memory and keep it.
- The documented arithmetic, bit for bit: rstd, dx, dweight, dgate and dup equal an fp32 replay
  (tests/reference_norm_act.py) of the operation and reduction order norm_act_math.h documents.
- Accuracy against float64 references written from the formulas:
  * y is FP8, so the bf16 rule cannot apply to it. Bound: y / y_scale lies within half an FP8 step of the
    exact value (round to nearest) plus a relative slack of 1e-5 for the fp32 arithmetic before rounding
    (the fp32 error of the op is below 3e-6), so a code may differ from the exact rounding only where the
    exact value is that close to a rounding boundary; y_scale is within 1e-5 of amax(y64) / FP8_MAX.
  * The backward reads FP8-saved inputs, so against the float64 gradient at the exact input its error is
    FP8 noise, not arithmetic. Bound: the reference is the float64 backward evaluated at the dequantized
    saved inputs (and the kernel's rstd), and the flash-attention rule applies there: max error at most
    2x that of the same formula computed by PyTorch in bf16.
  * rstd: the flash-attention rule against float64, and the tighter fp32 bound derived in
    test_rmsnorm_forward.
- Requantize: bit for bit against an fp32 replay, and against the forward's y_t (the bound: tests/norm_act_helpers.py).
- rmsnorm_backward with a residual gradient: dx equals the op's dx without one, .to(residual.dtype) + residual
  (torch's add), bit for bit, with every NaN canonical.
- CUDA (skipped without a GPU): every output equal to the C core's, bit for bit.

The tests are split by op: tests/test_norm_act_rmsnorm.py (the RMSNorm ops), tests/test_norm_act_silu_mul.py (the
SiLU*mul ops and their activations); this file holds the tests that take both ops (requantize's saturation and NaN
codes, the FP4 / FP6 wrappers, tiny groups and special values in backward, opcheck, errors). Their shared helpers
and checks are in tests/norm_act_helpers.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import reference_norm_act as ref
from coat import ops
from norm_act_helpers import (
    ACTIVATIONS,
    BLOCK_FORMATS,
    E4M3,
    E5M2,
    EPS,
    activations,
    assert_same_bits,
    check_requantized,
    check_tied_to_quantize_group,
    check_tied_to_quantize_tensor,
    gate_up,
    on_device,
    rmsnorm_forward,
    rmsnorm_requantize,
    run,
    silu_mul_forward,
    silu_mul_requantize,
)


# ----------------------------------------------------------------------------------------------------
# Requantize, both ops (the bounds: the comment in tests/norm_act_helpers.py)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=str)
def test_requantize_saturates(device, fp8):
    """A y_scale below the one the values need saturates them to +-FP8_MAX, never NaN: a quarter of the
    forward's, and 2^-126, whose quotients overflow fp32 for the largest values (E4M3 saturates those too;
    E5M2 encodes them as Inf, as its encoder does any infinite quotient)."""
    x = activations((9, 256), torch.bfloat16, seed=82)
    weight = torch.full((256,), 1e4, dtype=torch.bfloat16)
    _, y_scale, _, *saved, rstd = rmsnorm_forward(x, weight, fp8=fp8)
    rmsnorm_y32 = ref.rmsnorm_forward_f32(ref.decode_saved(*saved, 16), rstd, weight.float())
    gate, up = gate_up((9, 256), torch.bfloat16, seed=83)
    _, silu_scale, _, *silu_saved = silu_mul_forward(gate, up, fp8=fp8)
    silu_y32 = ref.silu_mul_requantize_f32(ref.decode_saved(*silu_saved[:2], 16),
                                           ref.decode_saved(*silu_saved[2:], 16))
    fp8_max = ref.FP8_MAX[fp8]
    tiny = torch.tensor(2.0**-126)
    cases = []
    for scale in (y_scale / 4, tiny):
        cases.append((rmsnorm_requantize(saved, rstd, weight, scale, fp8=fp8, device=device), rmsnorm_y32, scale))
    for scale in (silu_scale / 4, tiny):
        cases.append((silu_mul_requantize(silu_saved, None, scale, fp8=fp8, device=device), silu_y32, scale))
    for y_t, y32, scale in cases:
        check_requantized(y_t, y32, scale)
        values = y_t.float()
        overflow = (y32 / scale).isinf().T
        assert not values.isnan().any() and (values.abs() == fp8_max).any()
        assert (values[~overflow].abs() <= fp8_max).all()
        assert (values[overflow].abs() == (fp8_max if fp8 == E4M3 else math.inf)).all()
    assert (rmsnorm_y32 / tiny).isinf().any() and (silu_y32 / tiny).isinf().any()  # overflows are exercised


def test_requantize_python_wrappers():
    """coat.ops's wrappers: the defaults (G = 16, E4M3) and a format given by name."""
    x = activations((5, 48), torch.bfloat16, seed=86)
    weight = torch.ones(48, dtype=torch.bfloat16)
    _, y_scale, _, *saved, rstd = ops.rmsnorm_quantize(x, weight)
    assert_same_bits(ops.rmsnorm_requantize(*saved, rstd, weight, y_scale),
                     torch.ops.coat.rmsnorm_requantize(*saved, rstd, weight, y_scale, 16, E4M3))
    _, y_scale, _, *saved = ops.silu_mul_quantize(x, x, save_group_size=32, format="e5m2")
    requantized = ops.silu_mul_requantize(*saved, None, y_scale, 32, "e5m2")
    assert requantized.dtype == E5M2 and requantized.shape == (48, 5)
    assert_same_bits(requantized, torch.ops.coat.silu_mul_requantize(*saved, None, y_scale, 32, E5M2))


def test_requantize_nan_in_saved_inputs(device):
    """A NaN code in a saved input (positive or negative) gives the positive NaN code at that element only; a
    group saved with an Inf scale (its input held +-Inf) decodes to +-Inf and NaN (0 * Inf): with the
    forward's rstd = 0 for that row, RMSNorm's y_t is NaN over the group (the forward, from the exact x, had
    NaN at the Inf only)."""
    x = activations((6, 64), torch.bfloat16, seed=84)
    x[3, 40] = math.inf
    weight = torch.ones(64, dtype=torch.bfloat16)
    _, y_scale, y_t, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight)
    assert rstd[3].item() == 0 and x_saved_scales[3, 2].item() == math.inf
    codes = x_saved.view(torch.uint8).clone()
    codes[1, 5], codes[2, 9] = 0x7F, 0xFF
    requantized = rmsnorm_requantize((codes.view(E4M3), x_saved_scales), rstd, weight, y_scale, device=device)
    nan = torch.zeros(64, 6, dtype=torch.bool)
    nan[5, 1] = nan[9, 2] = True
    nan[32:48, 3] = True
    out = requantized.view(torch.uint8)
    assert ((out & 0x7F) == 0x7F).equal(nan) and (out[nan] == 0x7F).all()
    assert out[:, 3][~nan[:, 3]].bitwise_and(0x7F).eq(0).all()  # the rest of the Inf row: x' * 0

    gate, up = gate_up((6, 64), torch.bfloat16, seed=85)
    _, silu_scale, _, gate_saved, gate_scales, up_saved, up_scales = silu_mul_forward(gate, up)
    gate_codes = gate_saved.view(torch.uint8).clone()
    gate_codes[4, 7] = 0xFF
    requantized = silu_mul_requantize((gate_codes.view(E4M3), gate_scales, up_saved, up_scales), None, silu_scale,
                                      device=device)
    out = requantized.view(torch.uint8)
    assert out[7, 4] == 0x7F and int(((out & 0x7F) == 0x7F).sum()) == 1


# ----------------------------------------------------------------------------------------------------
# FP4 / FP6 copies through coat.ops's wrappers


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_fp4_and_fp6_python_wrappers(fmt):
    """coat.ops passes save_format and saved_format through; its FP4 and FP6 results equal the ops' own on the
    E4M3 expansion."""
    x = activations((5, 102), torch.bfloat16, seed=8)  # 102 codes: FP4 rows of 51 bytes, FP6 rows of 77
    weight = torch.ones(102, dtype=torch.bfloat16)
    _, y_scale, _, codes, scales, rstd = ops.rmsnorm_quantize(x, weight, save_format=fmt)
    assert codes.shape == (5, {"fp4": 51, "fp6": 77}[fmt]) and codes.dtype == torch.uint8
    expanded, _ = ops.blocks_to_e4m3(codes, scales, 102, fmt)
    assert_same_bits(ops.rmsnorm_backward(x, codes, scales, rstd, weight, saved_format=fmt)[0],
                     ops.rmsnorm_backward(x, expanded, scales, rstd, weight)[0], "wrapper dx")
    assert_same_bits(ops.rmsnorm_requantize(codes, scales, rstd, weight, y_scale, saved_format=fmt),
                     ops.rmsnorm_requantize(expanded, scales, rstd, weight, y_scale), "wrapper y_t")
    assert_same_bits(ops.silu_mul_backward(x, codes, scales, codes, scales, saved_format=fmt)[0],
                     ops.silu_mul_backward(x, expanded, scales, expanded, scales)[0], "wrapper dgate")
    assert_same_bits(
        ops.silu_mul_requantize(codes, scales, codes, scales, None, y_scale, saved_format=fmt, cols=102),
        ops.silu_mul_requantize(expanded, scales, expanded, scales, None, y_scale), "wrapper silu y_t",
    )
    for call in (lambda: ops.rmsnorm_backward(x, codes, scales, rstd, weight, saved_format="fp8"),
                 lambda: ops.silu_mul_requantize(codes, scales, codes, scales, None, y_scale, saved_format="int4")):
        with pytest.raises(ValueError, match="saved_format must be 'e4m3', 'fp4' or 'fp6', got '(fp8|int4)'"):
            call()


# ----------------------------------------------------------------------------------------------------
# Kernel paths of both ops (on CUDA every output is compared with the C core's bit for bit: run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tiny_groups(device, dtype):
    """Groups whose scales are under 2^-80 (values below about 1e-22), where the kernels divide instead of
    taking their fast quotient: half the rows of an RMSNorm input, and a SiLU*mul gate (and so y and its
    per-tensor scale)."""
    x = activations((9, 256), dtype, seed=54)
    x[::2] *= 1e-30
    weight = torch.ones(256, dtype=torch.bfloat16)
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, device=device)
    check_tied_to_quantize_group(x_saved, x_saved_scales, x, 16)
    gate, up = gate_up((9, 256), dtype, seed=55)
    gate *= 1e-23
    outputs = silu_mul_forward(gate, up, device=device)
    check_tied_to_quantize_tensor(outputs[0], outputs[1], ref.silu_mul_f32(gate.float(), up.float()), outputs[2])
    check_tied_to_quantize_group(outputs[3], outputs[4], gate, 16)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_backward_special_values(device, dtype, activation):
    """NaN / Inf in the saved inputs (NaN codes) and in dy, and dy so small that the gradients are subnormal
    in dy's dtype (the kernels' 16-bit stores round them in hardware)."""
    x = activations((8, 512), torch.bfloat16, seed=56)
    x[1, 3], x[2, 40], x[3, 100] = math.nan, math.inf, -math.inf
    weight = (1 + 0.2 * torch.randn(512, generator=torch.Generator().manual_seed(57))).bfloat16()
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, transpose=False)
    dy = activations((8, 512), dtype, seed=58, outliers=False)
    dy[4, 7], dy[5, 9] = math.nan, math.inf
    dy[6] *= 1e-38 if dtype != torch.float16 else 1e-6
    run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)

    gate, up = gate_up((8, 512), torch.bfloat16, seed=59)
    gate[1, 3], up[2, 40], gate[3, 100] = math.nan, math.inf, -math.inf
    saved = silu_mul_forward(gate, up, transpose=False)[3:]
    run(torch.ops.coat.silu_mul_backward, dy, *saved, None, 16, "e4m3", activation, device=device)


# ----------------------------------------------------------------------------------------------------
# opcheck and errors


def test_opcheck(device):
    x = on_device(activations((3, 5, 64), torch.bfloat16, seed=41), device)
    weight = on_device(torch.ones(64, dtype=torch.bfloat16), device)
    smooth = on_device(torch.rand(64) + 0.5, device)
    torch.library.opcheck(torch.ops.coat.rmsnorm_quantize.default, (x, weight, EPS, 16, 128, E4M3, True))
    for s, transpose in ((None, False), (smooth, True)):
        torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default, (x, x * 2, s, 32, 64, E5M2, transpose))
        torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default,
                              (x, x * 2, s, 32, 64, E5M2, transpose, "e4m3", "gelu_tanh"))
        torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default,
                              (x, None, s, 32, 64, E5M2, transpose, "e4m3", "quick_gelu"))
    # test_schema compares the inputs before and after the call with torch.allclose, which torch does not
    # implement for FP8 tensors, and the backward ops take FP8 inputs; the other checks all run.
    fp8_input_checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    _, _, _, x_saved, x_saved_scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False)
    for residual in (None, x.float()):
        torch.library.opcheck(
            torch.ops.coat.rmsnorm_backward.default, (x, x_saved, x_saved_scales, rstd, weight, 16, residual),
            test_utils=fp8_input_checks,
        )
    for s, activation in ((None, "silu"), (smooth, "silu"), (smooth, "gelu_tanh"), (None, "quick_gelu")):
        torch.library.opcheck(
            torch.ops.coat.silu_mul_backward.default,
            (x, x_saved, x_saved_scales, x_saved, x_saved_scales, s, 16, "e4m3", activation),
            test_utils=fp8_input_checks,
        )
    torch.library.opcheck(torch.ops.coat.silu_mul_backward.default,
                          (x, x_saved, x_saved_scales, None, None, smooth, 16, "e4m3", "gelu_tanh"),
                          test_utils=fp8_input_checks)
    y_scale = on_device(torch.tensor(0.01), device)
    torch.library.opcheck(
        torch.ops.coat.rmsnorm_requantize.default, (x_saved, x_saved_scales, rstd, weight, y_scale, 16, E4M3),
        test_utils=fp8_input_checks,
    )
    for s, fp8, activation in ((None, E4M3, "silu"), (smooth, E5M2, "silu"), (smooth, E4M3, "gelu_tanh")):
        torch.library.opcheck(
            torch.ops.coat.silu_mul_requantize.default,
            (x_saved, x_saved_scales, x_saved, x_saved_scales, s, y_scale, 16, fp8, "e4m3", None, activation),
            test_utils=fp8_input_checks,
        )
    torch.library.opcheck(
        torch.ops.coat.silu_mul_requantize.default,
        (x_saved, x_saved_scales, None, None, None, y_scale, 16, E4M3, "e4m3", None, "quick_gelu"),
        test_utils=fp8_input_checks,
    )



@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_opcheck_fp4_and_fp6_copies(device, fmt):
    """The forward ops saving FP4 or FP6, and the backward and requantize ops reading them (the packed copies are
    uint8, which every check can compare). H = 66 is not a multiple of 4 or 8: FP6 rows end with two codes in their
    last three-byte word."""
    x = on_device(activations((3, 5, 66), torch.bfloat16, seed=42), device)
    weight = on_device(torch.ones(66, dtype=torch.bfloat16), device)
    smooth = on_device(torch.rand(66) + 0.5, device)
    torch.library.opcheck(torch.ops.coat.rmsnorm_quantize.default, (x, weight, EPS, 16, 128, E4M3, True, fmt))
    torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default, (x, x * 2, smooth, 32, 64, E5M2, False, fmt))
    torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default,
                          (x, None, None, 32, 64, E5M2, False, fmt, "quick_gelu"))
    _, _, _, packed, packed_scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, {"fp4": 33, "fp6": 50}[fmt])
    y_scale = on_device(torch.tensor(0.01), device)
    for residual in (None, x.float()):
        torch.library.opcheck(torch.ops.coat.rmsnorm_backward.default,
                              (x, packed, packed_scales, rstd, weight, 16, residual, fmt))
    for activation in ACTIVATIONS:
        torch.library.opcheck(torch.ops.coat.silu_mul_backward.default,
                              (x, packed, packed_scales, packed, packed_scales, smooth, 16, fmt, activation))
    torch.library.opcheck(torch.ops.coat.rmsnorm_requantize.default,
                          (packed, packed_scales, rstd, weight, y_scale, 16, E4M3, fmt))
    for s, fp8, activation in ((None, E5M2, "silu"), (smooth, E4M3, "silu"), (smooth, E5M2, "gelu_tanh")):
        torch.library.opcheck(torch.ops.coat.silu_mul_requantize.default,
                              (packed, packed_scales, packed, packed_scales, s, y_scale, 16, fp8, fmt, 66, activation))
    torch.library.opcheck(torch.ops.coat.silu_mul_backward.default,
                          (x, packed, packed_scales, None, None, None, 16, fmt, "quick_gelu"))
    torch.library.opcheck(torch.ops.coat.silu_mul_requantize.default,
                          (packed, packed_scales, None, None, None, y_scale, 16, E4M3, fmt, 66, "gelu_tanh"))


def test_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    rmsnorm = torch.ops.coat.rmsnorm_quantize
    silu_mul = torch.ops.coat.silu_mul_quantize
    cases = [
        (lambda: rmsnorm(x.int(), w, EPS, 16, 128, E4M3, False), "x must be float32, bfloat16 or float16"),
        (lambda: rmsnorm(x.T, w, EPS, 16, 128, E4M3, False), "last dimension must be contiguous"),
        (lambda: rmsnorm(x, w, EPS, 8, 128, E4M3, False), "save_group_size must be 16, 32, 64 or 128, got 8"),
        (lambda: rmsnorm(x, w, EPS, 16, 256, E4M3, False), "amax_group_size must be 16, 32, 64 or 128, got 256"),
        (lambda: rmsnorm(x, w, EPS, 16, 128, torch.float16, False), "fp8_dtype must be torch.float8_e4m3fn"),
        (lambda: rmsnorm(x, w[:32], EPS, 16, 128, E4M3, False), r"weight must have shape \[64\]"),
        (lambda: rmsnorm(x, w, -1.0, 16, 128, E4M3, False), "eps must be finite and >= 0"),
        (lambda: rmsnorm(torch.ones(2, 40000), torch.ones(40000), EPS, 16, 128, E4M3, False), "between 1 and 32768"),
        (lambda: silu_mul(x, x[:, :32], None, 16, 128, E4M3, False), "gate and up must have the same shape"),
        (lambda: silu_mul(x, x.float(), None, 16, 128, E4M3, False), "gate and up must have the same dtype"),
        (lambda: silu_mul(x, x, torch.ones(64, dtype=torch.bfloat16), 16, 128, E4M3, False), "smooth_scale must be float32"),
        (lambda: silu_mul(x, x, torch.ones(32), 16, 128, E4M3, False), r"smooth_scale must have shape \[64\]"),
    ]
    _, _, _, saved, scales, rstd = rmsnorm(x, w, EPS, 16, 128, E4M3, False)
    backward = torch.ops.coat.rmsnorm_backward
    cases += [
        (lambda: backward(x[:2], saved, scales, rstd, w, 16), "x_saved has shape"),
        (lambda: backward(x, saved.view(torch.uint8), scales, rstd, w, 16), "x_saved must be torch.float8_e4m3fn"),
        (lambda: backward(x, saved, scales, rstd, w, 32), r"x_saved_scales must have shape \[4, 2\]"),
        (lambda: backward(x, saved, scales, rstd[:2], w, 16), "one value per row"),
        (lambda: backward(x, saved, scales, rstd, w, 16, x[:2]), "residual has shape .* but dy has shape"),
        (lambda: backward(x, saved, scales, rstd, w, 16, x.T.contiguous().T),
         r"residual must be contiguous; call .contiguous\(\)"),
        (lambda: backward(x, saved, scales, rstd, w, 16, x.int()), "residual must be float32, bfloat16 or float16"),
        (lambda: torch.ops.coat.silu_mul_backward(x, saved, scales, saved.T, scales, None, 16), "up_saved has shape"),
    ]
    format_choice = r"must be 'e4m3', 'fp4' or 'fp6', got"
    cases += [
        (lambda: rmsnorm(x, w, EPS, 16, 128, E4M3, False, "fp8"), rf"coat\.rmsnorm_quantize: save_format {format_choice} 'fp8'"),
        (lambda: silu_mul(x, x, None, 16, 128, E4M3, False, "FP4"), rf"coat\.silu_mul_quantize: save_format {format_choice} 'FP4'"),
        (lambda: backward(x, saved, scales, rstd, w, 16, None, "int4"), rf"coat\.rmsnorm_backward: saved_format {format_choice} 'int4'"),
        (lambda: torch.ops.coat.silu_mul_backward(x, saved, scales, saved, scales, None, 16, ""),
         rf"coat\.silu_mul_backward: saved_format {format_choice} ''"),
    ]
    y_scale = torch.tensor(0.01)
    requantize = torch.ops.coat.rmsnorm_requantize
    silu_requantize = torch.ops.coat.silu_mul_requantize
    cases += [
        (lambda: requantize(saved.view(torch.uint8), scales, rstd, w, y_scale, 16, E4M3),
         "x_saved must be torch.float8_e4m3fn"),
        (lambda: requantize(saved.T, scales, rstd, w, y_scale, 16, E4M3), "x_saved must be contiguous"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 32, E4M3), r"x_saved_scales must have shape \[4, 2\]"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 8, E4M3), "save_group_size must be 16, 32, 64 or 128"),
        (lambda: requantize(saved, scales, rstd[:2], w, y_scale, 16, E4M3), "one value per row"),
        (lambda: requantize(saved, scales, rstd, w[:32], y_scale, 16, E4M3), r"weight must have shape \[64\]"),
        (lambda: requantize(saved, scales, rstd, w.int(), y_scale, 16, E4M3), "weight must be float32, bfloat16"),
        (lambda: requantize(saved, scales, rstd, w, torch.ones(2), 16, E4M3), "y_scale must be a float32 tensor with one"),
        (lambda: requantize(saved, scales, rstd, w, y_scale.double(), 16, E4M3), "y_scale must be a float32 tensor"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 16, torch.bfloat16), "fp8_dtype must be torch.float8_e4m3fn"),
        (lambda: silu_requantize(saved, scales, saved[:2], scales, None, y_scale, 16, E4M3),
         "up_saved has shape .* but gate_saved has shape"),
        (lambda: silu_requantize(saved, scales, saved, scales[:2], None, y_scale, 16, E4M3),
         r"up_scales must have shape \[4, 4\]"),
        (lambda: silu_requantize(saved, scales, saved, scales, torch.ones(32), y_scale, 16, E4M3),
         r"smooth_scale must have shape \[64\]"),
        (lambda: silu_requantize(saved, scales, saved, scales, None, torch.empty(0), 16, E4M3),
         "y_scale must be a float32 tensor with one element"),
        (lambda: silu_requantize(saved, scales, saved, scales, None, y_scale, 16, E4M3, "e4m3", 63),
         "cols=63 but gate_saved has 64 columns"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 16, E4M3, "fp8"),
         rf"coat\.rmsnorm_requantize: saved_format {format_choice} 'fp8'"),
        (lambda: silu_requantize(saved, scales, saved, scales, None, y_scale, 16, E4M3, "fp5", 64),
         rf"coat\.silu_mul_requantize: saved_format {format_choice} 'fp5'"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


# Bytes of a packed row of 64, 32, 16 and 66 codes: FP4 ceil(cols / 2), FP6 ceil(3 cols / 4).
PACKED_BYTES = {"fp4": {64: 32, 32: 16, 16: 8, 66: 33}, "fp6": {64: 48, 32: 24, 16: 12, 66: 50}}


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_errors_with_fp4_and_fp6_copies(fmt):
    """Each packed format's checks: an E4M3 reading of packed codes, a packed reading of E4M3 codes, packed shapes
    (the message names the format), a copy of the other packed format, and silu_mul_requantize's cols."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    y_scale = torch.tensor(0.01)
    other = {"fp4": "fp6", "fp6": "fp4"}[fmt]
    nbytes = PACKED_BYTES[fmt]
    rmsnorm, backward = torch.ops.coat.rmsnorm_quantize, torch.ops.coat.rmsnorm_backward
    requantize, silu_requantize = torch.ops.coat.rmsnorm_requantize, torch.ops.coat.silu_mul_requantize
    _, _, _, saved, scales, rstd = rmsnorm(x, w, EPS, 16, 128, E4M3, False)
    _, _, _, packed, packed_scales, _ = rmsnorm(x, w, EPS, 16, 128, E4M3, False, fmt)
    _, _, _, other_packed, _, _ = rmsnorm(x, w, EPS, 16, 128, E4M3, False, other)
    assert packed.shape == (4, nbytes[64])
    cases = [
        (lambda: backward(x, packed, packed_scales, rstd, w, 16),
         "x_saved must be torch.float8_e4m3fn, as the forward op saves it, got Byte; for packed FP4 or FP6 codes pass "
         "the saved_format the forward op saved them in"),
        (lambda: backward(x, saved, scales, rstd, w, 16, None, fmt),
         rf"with saved_format='{fmt}' x_saved must be torch\.uint8 \(packed codes, as the forward op saves them with "
         rf"save_format='{fmt}'\), got Float8_e4m3fn"),
        (lambda: backward(x, packed[:, :16], packed_scales, rstd, w, 16, None, fmt),
         rf"x_saved has shape \[4, 16\] but the {fmt} codes of an input of shape \[4, 64\] \(from dy\) have shape "
         rf"\[4, {nbytes[64]}\]"),
        (lambda: backward(x, other_packed, packed_scales, rstd, w, 16, None, fmt),
         rf"x_saved has shape \[4, {PACKED_BYTES[other][64]}\] but the {fmt} codes of an input of shape \[4, 64\]"),
        (lambda: torch.ops.coat.silu_mul_backward(x, packed, packed_scales, saved, scales, None, 16, fmt),
         rf"with saved_format='{fmt}' up_saved must be torch\.uint8"),
        (lambda: requantize(packed, packed_scales, rstd, w[:32], y_scale, 16, E4M3, fmt),
         rf"x_saved has shape \[4, {nbytes[64]}\] but the {fmt} codes of an input of shape \[4, 32\] \(from weight\) "
         rf"have shape \[4, {nbytes[32]}\]"),
        (lambda: requantize(packed, packed_scales, rstd, w[None], y_scale, 16, E4M3, fmt), r"weight must have shape \[H\]"),
        (lambda: silu_requantize(packed, packed_scales, packed, packed_scales, None, y_scale, 16, E4M3, fmt),
         rf"with saved_format='{fmt}' pass cols, the width of gate and up"),
        (lambda: silu_requantize(packed, packed_scales, packed, packed_scales, None, y_scale, 16, E4M3, fmt, 66),
         rf"the {fmt} codes of an input of shape \[4, 66\] \(from cols\) have shape \[4, {nbytes[66]}\]"),
        (lambda: silu_requantize(packed, packed_scales, packed[:, :nbytes[16]], packed_scales, None, y_scale, 16, E4M3,
                                 fmt, 64),
         rf"up_saved has shape \[4, {nbytes[16]}\] but the {fmt} codes of an input of shape \[4, 64\] \(from gate_saved\)"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
