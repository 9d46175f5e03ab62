"""Tests of the fused SiLU*mul ops: coat.ops.silu_mul_quantize / silu_mul_backward / silu_mul_requantize
(csrc/include/coat/norm_act.h) with every activation (silu: SwiGLU; gelu_tanh: GeGLU; quick_gelu: CLIP's), each test
taking all where it has `activation`, the non-gated op (up=None), and the activations' own fp32 arithmetic (coat_exp,
gelu_tanh, quick_gelu), against the references and
bounds that tests/test_norm_act.py's module docstring states; CUDA (skipped without a GPU) against the C core, bit
for bit.
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
    BLOCK_SAVE_CASES,
    E4M3,
    E5M2,
    REQUANTIZE_SHAPES,
    activations,
    assert_same_bits,
    canonical_nan,
    check_fp8_output,
    check_near_forward,
    check_requantized,
    check_tied_to_quantize_group,
    check_tied_to_quantize_tensor,
    fp8_representable,
    gate_up,
    max_error,
    rows_of,
    run,
    several_rounds,
    silu_mul_forward,
    silu_mul_requantize,
    with_special_values,
)


# ----------------------------------------------------------------------------------------------------
# SiLU * mul forward

SILU_SHAPES = [(1, 64), (97, 128), (4097, 176), (97, 2048), (1, 11008), (33, 11008), (97, 1000), (5, 100), (3, 7)]


def check_silu_mul_forward(gate, up, smooth, outputs, group_size=16, activation="silu") -> None:
    y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales = outputs
    y32 = ref.silu_mul_f32(gate.float(), up.float(), smooth, activation)
    check_tied_to_quantize_tensor(y, y_scale, y32, y_t)
    check_fp8_output(y, y_scale, ref.silu_mul(gate, up, smooth, activation))
    check_tied_to_quantize_group(gate_saved, gate_scales, gate, group_size)
    check_tied_to_quantize_group(up_saved, up_scales, up, group_size)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_mul_forward(device, shape, activation):
    gate, up = gate_up(shape, torch.bfloat16, seed=shape[1])
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    check_silu_mul_forward(gate, up, None, outputs, activation=activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype, group_size, fp8", [
    (torch.float32, 32, E4M3), (torch.float16, 64, E5M2), (torch.bfloat16, 128, E5M2),
], ids=str)
def test_silu_mul_forward_smooth_dtypes_and_groups(device, dtype, group_size, fp8, activation):
    gate, up = activations((33, 1000), dtype, seed=21), activations((33, 1000), dtype, seed=22)
    smooth = torch.exp(torch.randn(1000, generator=torch.Generator().manual_seed(23)))
    outputs = silu_mul_forward(gate, up, smooth, group_size=group_size, fp8=fp8, device=device, activation=activation)
    assert outputs[0].dtype == fp8
    check_silu_mul_forward(gate, up, smooth, outputs, group_size, activation)


def test_silu_mul_forward_nd_and_views(device):
    gate, up = gate_up((2, 3, 5, 100), torch.bfloat16, seed=24)  # up starts 200 bytes in: not 16-byte aligned
    outputs = silu_mul_forward(gate, up, device=device)
    assert outputs[0].shape == (2, 3, 5, 100) and outputs[2].shape == (100, 30)
    assert outputs[4].shape == (2, 3, 5, 7)
    check_silu_mul_forward(gate, up, None, outputs)
    flat = silu_mul_forward(rows_of(gate.contiguous()), rows_of(up.contiguous()))
    for nd, two_d in zip(outputs, flat):
        assert_same_bits(nd.reshape(two_d.shape), two_d, "N-D strided vs 2-D contiguous")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_silu_mul_forward_saves_fp4_and_fp6(device, fmt, shape, group_size, activation):
    """gate and up kept as quantize_blocks(., fmt, G) bit for bit; y, y_scale and y_t as with E4M3."""
    gate, up = gate_up(shape, torch.bfloat16, seed=shape[1] + 1)
    gate[0, 0], up[-1, -1] = float("nan"), float("-inf")
    packed = silu_mul_forward(gate, up, group_size=group_size, device=device, save_format=fmt, activation=activation)
    e4m3 = silu_mul_forward(gate, up, group_size=group_size, device=device, activation=activation)
    for saved, source, name in ((packed[3:5], gate, "gate"), (packed[5:7], up, "up")):
        codes, scales = ops.quantize_blocks(source, fmt, group_size)
        assert_same_bits(saved[0], codes, f"{name}_saved vs quantize_blocks {fmt}")
        assert_same_bits(saved[1], scales, f"{name}_scales vs quantize_blocks {fmt}")
    for i in (0, 1, 2):
        assert_same_bits(packed[i], e4m3[i], "an output other than the saved copies")
    wrapped = ops.silu_mul_quantize(gate, up, save_group_size=group_size, save_format=fmt, activation=activation)
    for i in (3, 4, 5, 6):
        assert_same_bits(wrapped[i], packed[i], f"coat.ops.silu_mul_quantize(save_format={fmt!r}) output {i}")
    with pytest.raises(ValueError, match="save_format must be 'e4m3', 'fp4' or 'fp6', got 'fp8'"):
        ops.silu_mul_quantize(gate, up, save_format="fp8")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_silu_mul_forward_special_values(device, activation):
    """NaN gate or up gives a NaN code at that element only; act(-Inf) is NaN, as in PyTorch; a +Inf
    product makes y_scale Inf, so that y dequantizes to NaN/0 instead of silently clipping the overflow
    (the rule of quantize_tensor). Zero inputs give zero codes and the smallest scale."""
    gate, up = activations((4, 64), torch.bfloat16, seed=25), activations((4, 64), torch.bfloat16, seed=26)
    gate[0, 3], up[1, 4], gate[2, 5] = math.nan, math.nan, -math.inf
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    codes = outputs[0].view(torch.uint8)
    assert codes[0, 3] == 0x7F and codes[1, 4] == 0x7F and codes[2, 5] == 0x7F
    assert int(((codes & 0x7F) == 0x7F).sum()) == 3 and torch.isfinite(outputs[1])
    check_silu_mul_forward(gate, up, None, outputs, activation=activation)

    gate[3, 6], up[3, 6] = math.inf, 2.0
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    assert outputs[1].item() == math.inf
    codes = outputs[0].view(torch.uint8)
    nan = (codes & 0x7F) == 0x7F
    assert codes[3, 6] == 0x7F and ((codes[~nan] & 0x7F) == 0).all()  # finite / Inf is +-0
    check_tied_to_quantize_group(outputs[3], outputs[4], gate, 16)

    zeros = torch.zeros(3, 32, dtype=torch.bfloat16)
    y, y_scale, *_ = silu_mul_forward(zeros, zeros, device=device, activation=activation)
    assert (y.view(torch.uint8) == 0).all() and y_scale.item() == 2.0**-126


# ----------------------------------------------------------------------------------------------------
# SiLU * mul backward


def check_silu_mul_backward(dy, saved, smooth, group_size, dgate, dup, d_amax, activation="silu") -> None:
    """dgate and dup against the documented fp32 arithmetic (bit for bit) and the float64 formula (the bf16
    tolerance rule); d_amax against the largest magnitude of the two outputs, NaN ignored (bit for bit)."""
    magnitudes = torch.cat([dgate.float().abs().flatten(), dup.float().abs().flatten()])
    expected_amax = torch.nan_to_num(magnitudes, nan=0.0).max() if magnitudes.numel() else torch.tensor(0.0)
    assert d_amax.dtype == torch.float32 and d_amax.shape == ()
    assert_same_bits(d_amax.cpu(), expected_amax, "d_amax vs max(|dgate|, |dup|)")
    gate_saved, gate_scales, up_saved, up_scales = saved
    g = ops.dequantize(gate_saved, gate_scales, group_size, torch.float32)
    u = ops.dequantize(up_saved, up_scales, group_size, torch.float32)
    dgate32, dup32 = ref.silu_mul_backward_f32(dy.float(), g, u, smooth, activation)
    assert_same_bits(dgate, dgate32.to(dy.dtype), "dgate vs the documented arithmetic")
    assert_same_bits(dup, dup32.to(dy.dtype), "dup vs the documented arithmetic")

    dgate64, dup64 = ref.silu_mul_backward(dy, g, u, smooth, activation)
    # the same formula, computed by PyTorch in bf16 (gelu_tanh: torch's own gelu and gelu_backward)
    dy_b = dy.bfloat16() if smooth is None else dy.bfloat16() * smooth.bfloat16()
    g_b, u_b = g.bfloat16(), u.bfloat16()
    if activation in ("silu", "quick_gelu"):
        a = 1.0 if activation == "silu" else 1.702
        s = torch.sigmoid(a * g_b)
        dgate_bf16, dup_bf16 = dy_b * u_b * s * (1 + a * g_b * (1 - s)), dy_b * g_b * s
    else:
        dgate_bf16 = torch.ops.aten.gelu_backward(dy_b * u_b, g_b, approximate="tanh")
        dup_bf16 = dy_b * torch.nn.functional.gelu(g_b, approximate="tanh")
    assert max_error(dgate, dgate64) <= 2 * max_error(dgate_bf16, dgate64)
    assert max_error(dup, dup64) <= 2 * max_error(dup_bf16, dup64)


def silu_mul_backward_case(shape, dtype, smooth=None, group_size=16, seed=0):
    gate, up = gate_up(shape, torch.bfloat16, seed=seed)
    outputs = silu_mul_forward(gate, up, smooth, group_size=group_size, transpose=False)
    return activations(shape, dtype, seed=seed + 1, outliers=False), outputs[3:]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_mul_backward(device, shape, activation):
    dy, saved = silu_mul_backward_case(shape, torch.bfloat16, seed=shape[1])
    dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, *saved, None, 16, "e4m3", activation, device=device)
    check_silu_mul_backward(dy, saved, None, 16, dgate, dup, d_amax, activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype, group_size", [(torch.float32, 32), (torch.float16, 64), (torch.bfloat16, 128)], ids=str)
def test_silu_mul_backward_smooth_dtypes_and_groups(device, dtype, group_size, activation):
    smooth = torch.exp(torch.randn(1000, generator=torch.Generator().manual_seed(31)))
    dy, saved = silu_mul_backward_case((33, 1000), dtype, smooth, group_size, seed=32)
    dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, *saved, smooth, group_size, "e4m3", activation,
                             device=device)
    assert dgate.dtype == dtype and dup.dtype == dtype
    check_silu_mul_backward(dy, saved, smooth, group_size, dgate, dup, d_amax, activation)


def test_silu_mul_backward_strided_dy(device):
    dy_wide, saved = silu_mul_backward_case((2, 9, 176), torch.bfloat16, seed=33)
    dy = torch.cat([dy_wide, dy_wide], dim=-1)[..., 3:179]
    dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, *saved, None, 16, device=device)
    assert dgate.shape == (2, 9, 176) and dgate.is_contiguous()
    check_silu_mul_backward(dy, saved, None, 16, dgate, dup, d_amax)


def test_coat_exp_accuracy():
    """The exp that SiLU uses (replayed in fp32; the backward tests tie the kernels to the replay bit for
    bit): below 1 ulp over its whole normal range, exact at the special values."""
    x = torch.cat([torch.linspace(-87.3, 88.72, 2_000_001), 30 * torch.randn(200_000, generator=torch.Generator().manual_seed(0))])
    x = x[(x > -87.3) & (x < 88.72)]
    e = ref.coat_exp(x).double()
    exact = torch.exp(x.double())
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact)) - 23)
    assert ((e - exact).abs() / ulp).max().item() < 1.0
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 89.0, -104.0])
    e = ref.coat_exp(special)
    assert e[:4].tolist() == [1.0, 1.0, math.inf, 0.0] and math.isnan(e[4]) and e[5] == math.inf and e[6] == 0


# ----------------------------------------------------------------------------------------------------
# GeGLU's gelu_tanh and CLIP's quick_gelu: accuracy of the documented fp32 arithmetic, which the kernels equal bit for
# bit (above)

GELU_GATES = torch.cat([torch.linspace(-12.0, 12.0, 480_001),
                        3 * torch.randn(200_000, generator=torch.Generator().manual_seed(9))])


@pytest.mark.parametrize("activation", ["gelu_tanh", "quick_gelu"])
def test_gelu_accuracy(activation):
    """act and act' of gelu_tanh and quick_gelu in fp32 (coat's g * sigmoid(z), replayed) against the float64
    formula: max error at most 2x that of torch's own float32 function (gelu(approximate="tanh"); transformers'
    QuickGELUActivation, g * sigmoid(1.702 g)) and its autograd, the bf16 rule at fp32."""
    g = GELU_GATES
    act64, dact64 = ref.activation64(g, activation)
    act32 = g * ref.activation_sigmoid_f32(g, activation)
    dact32 = ref.activation_slope_f32(g, ref.activation_sigmoid_f32(g, activation), activation)
    g_torch = g.clone().requires_grad_()
    act_torch = (torch.nn.functional.gelu(g_torch, approximate="tanh") if activation == "gelu_tanh"
                 else g_torch * torch.sigmoid(1.702 * g_torch))
    act_torch.sum().backward()
    assert max_error(act32, act64) <= 2 * max_error(act_torch.detach(), act64)
    assert max_error(dact32, dact64) <= 2 * max_error(g_torch.grad, dact64)


def unit_saved(gates: torch.Tensor, group_size=16):
    """A saved copy whose decoded values are exactly `gates` (each an E4M3 value times its scale): code 1.0
    (0x38) and the gate as the scale, one group per gate, for gates special or out of E4M3's range."""
    rows = gates.numel()
    codes = torch.full((rows, group_size), 0x38, dtype=torch.uint8).view(E4M3)
    return codes, gates.float().reshape(rows, 1)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_special_gates(device, activation):
    """act and act' at +-Inf, NaN, huge, tiny, zero and very negative gates, through the backward with dy = 1 and
    up = 1 (dup = act(g), dgate = act'(g), exactly): act as torch's float32 (silu, gelu(approximate="tanh"),
    g * sigmoid(1.702 g)) at every such gate; gelu_tanh' and quick_gelu' finite for every finite gate, their limits
    1 and 0 at +-Inf (torch's gelu: NaN from |g| ~ 1.8e19 on), silu' NaN at +-Inf (Inf * 0)."""
    gates = torch.tensor([math.inf, -math.inf, math.nan, 1e30, -1e30, 3e38, -3e38, 2e19, -2e19, 1e-30, 1e-39,
                          0.0, -0.0, -10.0, -20.0, -88.0, 10.0, 0.5, -0.5])
    gate_saved, gate_scales = unit_saved(gates)
    up_saved, up_scales = unit_saved(torch.ones_like(gates))
    dy = torch.ones(gates.numel(), 16)
    dgate, dup, _ = run(torch.ops.coat.silu_mul_backward, dy, gate_saved, gate_scales, up_saved, up_scales, None, 16,
                        "e4m3", activation, device=device)
    act, dact = dup[:, 0], dgate[:, 0]
    torch_act = {"silu": lambda g: g * torch.sigmoid(g), "quick_gelu": lambda g: g * torch.sigmoid(1.702 * g),
                 "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}[activation](gates)
    assert_same_bits(act.isnan(), torch_act.isnan(), "act's NaNs vs torch's")
    assert act[0] == math.inf and act[1].isnan() and act[2].isnan()
    # act within float32's reach of float64's: g * sigmoid(z), which 0.5 g (1 + tanh(z / 2)) equals but computes without
    # cancelling to 0 below about -9 (torch's float32 and the float64 formula's float64 do)
    finite = gates.isfinite()
    g64 = gates[finite].double()
    z64 = {"silu": g64, "quick_gelu": 1.702 * g64,
           "gelu_tanh": 2 * ref.SQRT_2_OVER_PI * (g64 + 0.044715 * g64**3)}[activation]
    act64 = g64 * torch.sigmoid(z64)
    assert torch.allclose(act[finite].double(), act64, rtol=1e-4, atol=1e-44)
    assert (act[finite].signbit() == gates[finite].signbit()).all()
    if activation in ("gelu_tanh", "quick_gelu"):
        assert dact[2].isnan() and not dact[torch.arange(gates.numel()) != 2].isnan().any()
        assert dact[0] == 1.0 and dact[1] == 0.0 and dact[3] == 1.0 and dact[4] == 0.0 and dact[7] == 1.0
        assert dact[9] == 0.5 and dact[11] == 0.5
        if activation == "gelu_tanh":  # z(-10) is -87: sigmoid is below 2^-125
            assert abs(dact[13]) < 1e-30 and dact[14] == 0.0
    else:
        assert dact[:3].isnan().all() and not dact[3:].isnan().any()
    g, u = ref.decode_saved(gate_saved, gate_scales, 16), ref.decode_saved(up_saved, up_scales, 16)
    assert_same_bits(canonical_nan(dgate), canonical_nan(ref.silu_mul_backward_f32(dy, g, u, activation=activation)[0]),
                     "dgate vs the replay")


def test_activation_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    _, y_scale, _, *saved = ops.silu_mul_quantize(x, x)
    message = "activation must be 'silu' \\(SwiGLU\\), 'gelu_tanh' \\(GeGLU.*or 'quick_gelu'"
    for call in (lambda: ops.silu_mul_quantize(x, x, activation="gelu"),
                 lambda: ops.silu_mul_backward(x, *saved, activation="relu"),
                 lambda: ops.silu_mul_requantize(*saved, None, y_scale, activation="swish")):
        with pytest.raises(ValueError, match=message):
            call()
    for call in (lambda: torch.ops.coat.silu_mul_quantize(x, x, None, 16, 128, E4M3, False, "e4m3", "gelu"),
                 lambda: torch.ops.coat.silu_mul_backward(x, *saved, None, 16, "e4m3", "GELU_TANH"),
                 lambda: torch.ops.coat.silu_mul_requantize(*saved, None, y_scale, 16, E4M3, "e4m3", None, "tanh")):
        with pytest.raises(RuntimeError, match=message):
            call()
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.coat.silu_mul_quantize(fake, fake, None, 16, 128, E4M3, False, "e4m3", "gelu")


# ----------------------------------------------------------------------------------------------------
# Requantize (the bounds: the comment in tests/norm_act_helpers.py)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_silu_mul_requantize_equals_forward_on_representable_inputs(device, activation):
    for group_size, fp8, smooth in ((16, E4M3, None), (128, E5M2, torch.rand(300) + 0.5)):
        gate = fp8_representable((37, 300), torch.bfloat16, group_size, seed=76)
        up = fp8_representable((37, 300), torch.bfloat16, group_size, seed=77)
        _, y_scale, y_t, *saved = silu_mul_forward(gate, up, smooth, group_size=group_size, fp8=fp8,
                                                   activation=activation)
        requantized = silu_mul_requantize(saved, smooth, y_scale, group_size, fp8, device=device, activation=activation)
        assert_same_bits(requantized, y_t, "requantized y_t vs the forward's")


def silu_mul_bound(gate, up, saved, smooth, group_size, activation="silu"):
    g, u = rows_of(gate).double(), rows_of(up).double()
    e_g = ref.e4m3_half_step(gate, saved[1], group_size)
    e_g = e_g + 2.0**-8 * (g.abs() + e_g)  # bf16(g') is within half a bf16 ulp, under 2^-8 |g'|, of g'
    e_u = ref.e4m3_half_step(up, saved[3], group_size)
    bound = ref.LIPSCHITZ[activation] * e_g * (u.abs() + e_u) + ref.activation64(g, activation)[0].abs() * e_u
    return bound if smooth is None else bound * smooth.double()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", REQUANTIZE_SHAPES, ids=str)
def test_silu_mul_requantize(device, shape, activation):
    gate, up = gate_up(shape, torch.bfloat16, seed=78 + shape[-1])
    _, y_scale, y_t, *saved = silu_mul_forward(gate, up, activation=activation)
    requantized = silu_mul_requantize(saved, None, y_scale, device=device, activation=activation)
    y32 = ref.silu_mul_requantize_f32(ref.decode_saved(*saved[:2], 16), ref.decode_saved(*saved[2:], 16),
                                      activation=activation)
    check_requantized(requantized, y32, y_scale)
    check_near_forward(requantized, y_t, y_scale, silu_mul_bound(gate, up, saved, None, 16, activation))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype, group_size, fp8, smooth", [
    (torch.float32, 32, E4M3, True), (torch.float16, 64, E5M2, False), (torch.bfloat16, 128, E5M2, True),
    (torch.bfloat16, 16, E4M3, True),
], ids=str)
def test_silu_mul_requantize_smooth_dtypes_and_groups(device, dtype, group_size, fp8, smooth, activation):
    gate, up = activations((33, 1000), dtype, seed=79), activations((33, 1000), dtype, seed=80)
    smooth = torch.exp(torch.randn(1000, generator=torch.Generator().manual_seed(81))) if smooth else None
    _, y_scale, y_t, *saved = silu_mul_forward(gate, up, smooth, group_size=group_size, fp8=fp8, activation=activation)
    requantized = silu_mul_requantize(saved, smooth, y_scale, group_size, fp8, device=device, activation=activation)
    assert requantized.dtype == fp8
    y32 = ref.silu_mul_requantize_f32(ref.decode_saved(*saved[:2], group_size), ref.decode_saved(*saved[2:], group_size),
                                      smooth, activation)
    check_requantized(requantized, y32, y_scale)
    check_near_forward(requantized, y_t, y_scale, silu_mul_bound(gate, up, saved, smooth, group_size, activation))


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=str)
def test_silu_mul_requantize_special_gates(device, fp8):
    """The decoded gate is rounded to bf16 before silu, and its +-Inf and NaN behave as the forward's bf16 +-Inf
    and NaN gates: silu(+Inf) = +Inf (so y = +-Inf, saturated by E4M3, Inf in E5M2), silu(-Inf) = -Inf * 0 = NaN,
    silu(NaN) = NaN. Gates get there from a group saved with an Inf scale (nonzero codes: +-Inf; zero: NaN),
    from a finite g' past the largest bf16 (448 * 7.59e35 = 3.4003e38, finite in fp32, rounds to +-Inf), and from
    NaN codes. Every other element of those groups is still the bit-exact replay."""
    gate, up = gate_up((4, 64), torch.bfloat16, seed=88)
    _, y_scale, _, gate_saved, gate_scales, up_saved, up_scales = silu_mul_forward(gate, up, fp8=fp8)
    codes = gate_saved.view(torch.uint8).clone()
    scales = gate_scales.clone()
    scales[0, 0] = math.inf
    codes[0, :16] = torch.tensor([0x38, 0xB8, 0x00, 0x80, 0x7F, 0x7E, 0xFE, 0x01] * 2, dtype=torch.uint8)
    scales[1, 1] = 7.59e35
    codes[1, 16:32] = torch.tensor([0x7E, 0xFE, 0x7F, 0x38] * 4, dtype=torch.uint8)
    saved = (codes.view(E4M3), scales, up_saved, up_scales)
    requantized = silu_mul_requantize(saved, None, y_scale, fp8=fp8, device=device)
    g_decoded, u_decoded = ref.decode_saved(*saved[:2], 16), ref.decode_saved(*saved[2:], 16)
    g = ref.requantize_gate_f32(g_decoded)
    assert g_decoded[1, 16].item() < 3.4028e38 and g[1, 16].item() == math.inf and g[1, 17].item() == -math.inf
    y32 = ref.silu_mul_requantize_f32(g_decoded, u_decoded)
    check_requantized(requantized, y32, y_scale)
    # the forward's silu on the same bf16 gates
    forward_y32 = ref.silu_mul_f32(g.bfloat16().float(), u_decoded)
    assert_same_bits(torch.nan_to_num(y32, nan=0.0), torch.nan_to_num(forward_y32, nan=0.0), "y vs forward formula")
    assert y32.isnan().equal(forward_y32.isnan())
    out = requantized.view(torch.uint8).T
    special = g.isinf() | g.isnan()
    nonzero_up = u_decoded != 0
    positive_inf = (g == math.inf) & nonzero_up
    assert positive_inf.sum() >= 4 and ((g == -math.inf) | g.isnan()).sum() >= 8
    assert (out[(g == -math.inf) | g.isnan()] == 0x7F).all()
    top = 0x7E if fp8 == E4M3 else 0x7C  # +-448 saturated / +-Inf
    expected_top = torch.where(u_decoded[positive_inf] > 0, top, top | 0x80).to(torch.uint8)
    assert out[positive_inf].equal(expected_top)
    assert not (out[~special] == 0x7F).any()


# ----------------------------------------------------------------------------------------------------
# Backward and requantize from an FP4 or FP6 copy (saved_format 'fp4' or 'fp6'): each op reads a packed code as its exact
# E4M3 expansion, so its outputs equal, bit for bit, the same op's on ops.blocks_to_e4m3 of the copy, which the
# tests above hold to the float64 references. On CUDA run() also ties every output to the C core's.


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_silu_mul_ops_read_fp4_and_fp6_as_their_e4m3_expansion(device, fmt, shape, group_size, dy_dtype, activation):
    gate, up = gate_up(shape, torch.bfloat16, seed=shape[1] + 5)
    gate = with_special_values(gate)
    smooth = torch.exp(torch.randn(shape[1], generator=torch.Generator().manual_seed(6)))
    _, y_scale, _, gate_codes, gate_scales, up_codes, up_scales = silu_mul_forward(
        gate, up, smooth, group_size=group_size, save_format=fmt, activation=activation
    )
    gate_expanded, _ = ops.blocks_to_e4m3(gate_codes, gate_scales, shape[1], fmt, group_size)
    up_expanded, _ = ops.blocks_to_e4m3(up_codes, up_scales, shape[1], fmt, group_size)
    dy = activations(shape, dy_dtype, seed=7, outliers=False)
    for s in (None, smooth):
        from_packed = run(torch.ops.coat.silu_mul_backward, dy, gate_codes, gate_scales, up_codes, up_scales, s,
                          group_size, fmt, activation, device=device)
        from_e4m3 = run(torch.ops.coat.silu_mul_backward, dy, gate_expanded, gate_scales, up_expanded, up_scales, s,
                        group_size, "e4m3", activation, device=device)
        for name, a, b in zip(("dgate", "dup", "d_amax"), from_packed, from_e4m3):
            assert_same_bits(a, b, f"{name} from {fmt} vs from the expansion (smooth: {s is not None})")
        for fp8 in (E4M3, E5M2):
            (from_packed,) = run(lambda *a: (torch.ops.coat.silu_mul_requantize(*a),), gate_codes, gate_scales,
                                 up_codes, up_scales, s, y_scale, group_size, fp8, fmt, shape[1], activation,
                                 device=device)
            (from_e4m3,) = run(lambda *a: (torch.ops.coat.silu_mul_requantize(*a),), gate_expanded, gate_scales,
                               up_expanded, up_scales, s, y_scale, group_size, fp8, "e4m3", None, activation,
                               device=device)
            assert_same_bits(from_packed, from_e4m3,
                             f"{fp8} y_t from {fmt} vs from the expansion (smooth: {s is not None})")


# ----------------------------------------------------------------------------------------------------
# Kernel paths: values and shapes that send the CUDA kernels down their other paths (the chunk-wise fast
# paths' fallbacks, the bf16 silu table's edges, several rounds of the persistent kernels); on CUDA every
# output is compared with the C core's bit for bit (run).

# Gates around the edges of the kernels' fast paths: the bf16 table holds 2^-24 <= |g| < 2^8 for silu, 2^-25 <= |g| <
# 2^7 for gelu_tanh and quick_gelu; the computed sigmoid takes z(g) >= -80 and sends smaller ones through coat_exp's
# full range (-88.7, -103.3); gelu_tanh's z(g) reaches -80 near g = -9.67, quick_gelu's near g = -47.0.
EDGE_GATES = [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-24 * (1 - 2.0**-8), 1e-30, 1e-39, 255.0, -255.0, 256.0,
              -256.0, 300.0, -80.0, -80.5, -81.0, -87.5, -88.5, -89.0, -103.0, -104.0, -200.0, 80.5, 88.5, 100.0,
              2.0**-25, -(2.0**-25), 127.5, 128.0, -128.0, -9.625, -9.6875, -9.75, -10.0, -46.75, -47.0, -47.25,
              -52.0, -61.0]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_silu_mul_gate_edges(device, dtype, activation):
    gate, up = gate_up((16, 256), dtype, seed=51)
    edges = torch.tensor(EDGE_GATES, dtype=torch.float64).to(dtype)
    positions = torch.randperm(gate.numel(), generator=torch.Generator().manual_seed(52))[: 8 * edges.numel()]
    flat = gate.reshape(-1).clone()
    flat[positions] = edges.repeat(8)
    gate.copy_(flat.view(gate.shape))
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    check_silu_mul_forward(gate, up, None, outputs, activation=activation)
    dy = activations((16, 256), dtype, seed=53, outliers=False)
    run(torch.ops.coat.silu_mul_backward, dy, *outputs[3:], None, 16, "e4m3", activation, device=device)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_silu_mul_several_rounds(cuda_device, activation):
    """Blocks of 8 rows over 2 segments of 512 columns, at most 8 blocks per SM: 32 rows per SM and round."""
    gate, up = gate_up((several_rounds(32), 1000), torch.bfloat16, seed=61)
    outputs = silu_mul_forward(gate, up, device=cuda_device, activation=activation)
    dy = activations(tuple(gate.shape), torch.bfloat16, seed=62, outliers=False)
    run(torch.ops.coat.silu_mul_backward, dy, *outputs[3:], None, 16, "e4m3", activation, device=cuda_device)


# ----------------------------------------------------------------------------------------------------
# The non-gated act (up=None): a non-gated MLP's activation, fc2(act(fc1(x))) (CLIP's quick_gelu, SigLIP's and
# Qwen3-VL's gelu_tanh). Every op reads up as exactly 1, so each output equals, bit for bit, the gated op's with up a
# tensor of ones (whose saved copy decodes to exactly 1, and whose product with act is exact), which the tests above
# hold to the references; it writes no copy of up and no dup, and its d_amax is dgate's alone.


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["e4m3", *BLOCK_FORMATS])
@pytest.mark.parametrize("shape, group_size", [((37, 176), 16), ((9, 1000), 64), ((3, 7), 32)], ids=str)
def test_non_gated_act_is_act_mul_by_ones(device, activation, fmt, shape, group_size):
    wide = with_special_values(activations((shape[0], shape[1] + 8), torch.bfloat16, seed=shape[1] + 60))
    gate = wide[:, 3 : 3 + shape[1]]  # a row-strided view
    ones = torch.ones(shape, dtype=torch.bfloat16)
    smooth = torch.exp(torch.randn(shape[1], generator=torch.Generator().manual_seed(61)))
    dy = activations(shape, torch.bfloat16, seed=62, outliers=False)
    cols = shape[1] if fmt != "e4m3" else None
    for s in (None, smooth):
        y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales = run(
            torch.ops.coat.silu_mul_quantize, gate, None, s, group_size, 128, E4M3, True, fmt, activation,
            device=device)
        assert up_saved.numel() == 0 and up_scales.numel() == 0
        gated = run(torch.ops.coat.silu_mul_quantize, gate, ones, s, group_size, 128, E4M3, True, fmt, activation,
                    device=device)
        for name, a, b in zip(("y", "y_scale", "y_t", "gate_saved", "gate_scales"), (y, y_scale, y_t, gate_saved,
                                                                                        gate_scales), gated):
            assert_same_bits(a, b, f"{name} without up vs with up = 1")
        if fmt == "e4m3":
            check_fp8_output(y, y_scale, ref.silu_mul(gate, ones, s, activation))
        dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, gate_saved, gate_scales, None, None, s,
                                 group_size, fmt, activation, device=device)
        gated_dgate, _, _ = run(torch.ops.coat.silu_mul_backward, dy, *gated[3:], s, group_size, fmt, activation,
                                device=device)
        assert dup.numel() == 0
        assert_same_bits(dgate, gated_dgate, "dgate without up vs with up = 1")
        expected_amax = torch.nan_to_num(dgate.float().abs(), nan=0.0).max()
        assert_same_bits(d_amax, expected_amax, "d_amax vs max |dgate|")
        (requantized,) = run(lambda *a: (torch.ops.coat.silu_mul_requantize(*a),), gate_saved, gate_scales, None,
                             None, s, y_scale, group_size, E4M3, fmt, cols, activation, device=device)
        (gated_requantized,) = run(lambda *a: (torch.ops.coat.silu_mul_requantize(*a),), *gated[3:], s, y_scale,
                                   group_size, E4M3, fmt, cols, activation, device=device)
        assert_same_bits(requantized, gated_requantized, "requantized y_t without up vs with up = 1")


def test_non_gated_wrappers_return_none_for_up():
    gate = activations((5, 64), torch.bfloat16, seed=63)
    y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales = ops.silu_mul_quantize(gate, None,
                                                                                           activation="quick_gelu")
    assert up_saved is None and up_scales is None and y_t is None
    dgate, dup, _ = ops.silu_mul_backward(gate, gate_saved, gate_scales, None, None, activation="quick_gelu")
    assert dup is None and dgate.shape == gate.shape
    y_t = ops.silu_mul_requantize(gate_saved, gate_scales, None, None, None, y_scale, activation="quick_gelu")
    assert y_t.shape == (64, 5)
    for call in (lambda: ops.silu_mul_backward(gate, gate_saved, gate_scales, gate_saved, None),
                 lambda: ops.silu_mul_requantize(gate_saved, gate_scales, None, gate_scales, None, y_scale)):
        with pytest.raises(RuntimeError, match="pass both up_saved and up_scales .* or neither"):
            call()
    with torch._subclasses.FakeTensorMode() as mode:
        fake_saved, fake_scales = mode.from_tensor(gate_saved), mode.from_tensor(gate_scales)
        with pytest.raises(RuntimeError, match="pass both up_saved and up_scales .* or neither"):
            torch.ops.coat.silu_mul_backward(mode.from_tensor(gate), fake_saved, fake_scales, fake_saved, None,
                                             None, 16)
