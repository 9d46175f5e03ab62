"""coat.nn.Linear against float64 oracles, what it saves for backward, its padding and fallback paths.

Error bounds. An FP8 layer cannot match BF16's error against a float64 reference of the original operands:
E4M3 keeps 3 mantissa bits, BF16 8. So each GEMM is checked twice:
  1. against float64 evaluated at the FP8 operands (dequantized by the oracle in tests/reference_nn.py), where
     the only error left is accumulation and output rounding: no more than 2x the error of the same op in
     BF16 PyTorch against float64 of its own operands;
  2. end to end, against float64 of the unquantized operands. Rounding to a format with unit roundoff u
     leaves a relative error of RMS about u/sqrt(3) per element; for random operands the errors of the
     two operands add in quadrature, so the norm-wise relative error of the product is about
     sqrt(e_a^2 + e_b^2): 0.051 for E4M3 x E4M3 (u = 2^-4), 0.081 for E5M2 x E4M3 (u = 2^-3). The bounds
     below, 0.06 and 0.10, sit above those estimates; a wrong scale, layout or transpose gives errors of
     order 1.
"""
import pytest
import torch
import torch.nn.functional as F

import coat.nn
import coat.nn.gemm
from conftest import requires_cuda
from reference_nn import quantize_per_tensor_dequantized, relative_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORWARD_BOUND = 0.06  # E4M3 x E4M3
BACKWARD_BOUND = 0.10  # E5M2 x E4M3
# (tokens M, in_features K, out_features N): aligned, and a shape with none of M, K, N a multiple of 16,
# which exercises the zero padding of fp8_gemm.
SHAPES = [(64, 96, 80), (13, 40, 24)]


def make_case(shape, device, seed=0, bias=True):
    m, k, n = shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).bfloat16()
    weight = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    grad_y = torch.randn(m, n, generator=generator).bfloat16()
    layer = coat.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(b)
    return x.to(device), weight.to(device), None if b is None else b.to(device), grad_y.to(device), layer.to(device)


def run_layer(layer, x, grad_y):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    return y, x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def bf16_error(op, *operands) -> float:
    """The error of ``op`` in BF16 PyTorch against float64 of the same operands."""
    return relative_error(op(*operands), op(*(t.double() for t in operands)))


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_float64(shape, device):
    x, weight, bias, grad_y, layer = make_case(shape, device)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (shape[0], shape[2])

    at_fp8 = quantize_per_tensor_dequantized(x, E4M3) @ quantize_per_tensor_dequantized(weight, E4M3).t()
    at_fp8 = at_fp8 + bias.double()
    exact = x.double() @ weight.double().t() + bias.double()
    error_at_fp8, error_bf16 = relative_error(y, at_fp8), bf16_error(F.linear, x, weight, bias)
    print(f"forward {shape}: vs float64 at FP8 operands {error_at_fp8:.2e} (BF16 torch {error_bf16:.2e}), "
          f"end to end {relative_error(y, exact):.3f}")
    assert error_at_fp8 <= 2 * error_bf16
    assert relative_error(y, exact) <= FORWARD_BOUND


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_backward_matches_float64(shape, device):
    x, weight, bias, grad_y, layer = make_case(shape, device)
    _, grad_x, grad_w, grad_b = run_layer(layer, x, grad_y)

    g_fp8 = quantize_per_tensor_dequantized(grad_y, E5M2)
    cases = {
        "dgrad": (grad_x, g_fp8 @ quantize_per_tensor_dequantized(weight, E4M3), grad_y.double() @ weight.double(),
                  bf16_error(torch.matmul, grad_y, weight)),
        "wgrad": (grad_w, g_fp8.t() @ quantize_per_tensor_dequantized(x, E4M3), grad_y.double().t() @ x.double(),
                  bf16_error(lambda g, a: g.t() @ a, grad_y, x)),
    }
    for name, (actual, at_fp8, exact, error_bf16) in cases.items():
        print(f"{name} {shape}: vs float64 at FP8 operands {relative_error(actual, at_fp8):.2e} "
              f"(BF16 torch {error_bf16:.2e}), end to end {relative_error(actual, exact):.3f}")
        assert actual.dtype == torch.bfloat16
        assert relative_error(actual, at_fp8) <= 2 * error_bf16
        assert relative_error(actual, exact) <= BACKWARD_BOUND
    # The bias gradient is a plain sum of the unquantized output gradient.
    assert relative_error(grad_b, grad_y.double().sum(0)) <= 2 * bf16_error(lambda g: g.sum(0), grad_y)


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_backward_matches_float64(shape, device):
    x, weight, bias, grad_y, layer = make_case(shape, device)
    layer.config = coat.nn.FP8Config(gradient_format=None)
    _, grad_x, grad_w, _ = run_layer(layer, x, grad_y)

    # dgrad multiplies by the BF16 weight: the BF16 rule applies directly.
    assert relative_error(grad_x, grad_y.double() @ weight.double()) <= 2 * bf16_error(torch.matmul, grad_y, weight)
    # wgrad reads the saved FP8 input, dequantized to BF16.
    x_fp8 = quantize_per_tensor_dequantized(x, E4M3)
    error_bf16 = bf16_error(lambda g, a: g.t() @ a, grad_y, x_fp8.bfloat16())
    assert relative_error(grad_w, grad_y.double().t() @ x_fp8) <= 2 * error_bf16 + 2.0**-8
    assert relative_error(grad_w, grad_y.double().t() @ x.double()) <= FORWARD_BOUND


def saved_tensors(fn):
    """Runs fn() recording every tensor autograd saves; returns them, one per storage."""
    by_storage = {}

    def pack(t):
        by_storage.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return list(by_storage.values())


@pytest.mark.parametrize("shape", [(64, 96, 80), (128, 4096, 64)])
def test_fast_accum_changes_only_the_forward_gemm(shape, device):
    # The tensor cores' fast accumulation (GPU only) keeps the forward within the precise GEMM's bound against
    # float64 at the FP8 operands, also over a long K; backward GEMMs accumulate in fp32 either way, so with the
    # same output gradient every gradient is the precise layer's, bit for bit. On the CPU nothing changes.
    x, weight, bias, grad_y, layer = make_case(shape, device)
    precise = run_layer(layer, x, grad_y)
    layer.config = coat.nn.FP8Config(fast_accum=True)
    layer.zero_grad()
    fast = run_layer(layer, x, grad_y)

    at_fp8 = quantize_per_tensor_dequantized(x, E4M3) @ quantize_per_tensor_dequantized(weight, E4M3).t()
    at_fp8 = at_fp8 + bias.double()
    error_fast, error_bf16 = relative_error(fast[0], at_fp8), bf16_error(F.linear, x, weight, bias)
    print(f"fast accumulation {shape}: vs float64 at FP8 operands {error_fast:.2e} (precise "
          f"{relative_error(precise[0], at_fp8):.2e}, BF16 torch {error_bf16:.2e})")
    assert error_fast <= 2 * error_bf16
    if torch.device(device).type == "cpu":
        assert torch.equal(fast[0], precise[0])
    for fast_grad, precise_grad in zip(fast[1:], precise[1:]):
        assert torch.equal(fast_grad, precise_grad)


def test_saves_only_the_transposed_fp8_input(device):
    x, _, _, _, layer = make_case((64, 96, 80), device)
    x = x.view(4, 16, 96).requires_grad_()
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = [t for t in saved_tensors(lambda: layer(x)) if t.untyped_storage().data_ptr() not in parameters]
    assert {(t.dtype, tuple(t.shape)) for t in saved} == {(E4M3, (96, 64)), (torch.float32, ())}, (
        "expected the FP8 transposed input [K, M], its scale and the weight's amax, nothing else"
    )
    assert len(saved) == 3


def test_frozen_weight_saves_nothing_of_the_input(device):
    x, _, _, grad_y, layer = make_case((64, 96, 80), device)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x = x.clone().requires_grad_()
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = saved_tensors(lambda: layer(x).backward(grad_y))
    # Only the weight's amax (one float: backward quantizes the weight again with the forward's scale).
    assert [(t.dtype, t.numel()) for t in saved if t.untyped_storage().data_ptr() not in parameters] == [(torch.float32, 1)]
    assert x.grad is not None and layer.weight.grad is None


def test_no_input_grad_when_the_input_needs_none(device):
    x, _, _, grad_y, layer = make_case((64, 96, 80), device)
    y, grad_x, grad_w, grad_b = run_layer(layer, x.clone(), grad_y)
    layer.zero_grad()
    layer(x).backward(grad_y)  # x does not require grad: no dgrad GEMM, same weight gradient
    assert torch.equal(layer.weight.grad, grad_w) and torch.equal(layer.bias.grad, grad_b)


def test_inference_matches_training_forward(device):
    x, _, _, _, layer = make_case((64, 96, 80), device)
    with torch.no_grad():
        y_no_grad = layer(x)
    layer.eval()
    assert torch.equal(layer(x.clone().requires_grad_()), y_no_grad)


def test_fallback_without_fp8_gemm_matches_scaled_mm(device, monkeypatch):
    """Where there are no FP8 GEMMs (CPUs, GPUs before compute capability 8.9) coat multiplies the FP8
    values in float32; only the order of the additions differs from torch._scaled_mm (forced here; it has a
    CPU implementation, slow on torch 2.11, which coat does not use), so results agree to BF16 rounding."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs FP8 tensor cores on a GPU")
    assert coat.nn.gemm._device_has_fp8_gemm(torch.device(device)) == (device == "cuda")
    x, _, _, grad_y, layer = make_case((13, 40, 24), device)
    monkeypatch.setattr(coat.nn.gemm, "_device_has_fp8_gemm", lambda device: True)
    with_gemm = run_layer(layer, x, grad_y)
    layer.zero_grad()
    monkeypatch.setattr(coat.nn.gemm, "_device_has_fp8_gemm", lambda device: False)
    without_gemm = run_layer(layer, x, grad_y)
    for a, b in zip(with_gemm, without_gemm):
        # Summation-order differences are relative to the terms' magnitudes, not to a result that cancels.
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-8 * b.abs().max().item())


def test_from_linear_keeps_parameters_and_state_dict():
    torch.manual_seed(0)
    for bias in (True, False):
        original = torch.nn.Linear(32, 48, bias=bias).bfloat16().eval()
        converted = coat.nn.Linear.from_linear(original)
        assert isinstance(converted, torch.nn.Linear) and not converted.training
        assert converted.weight is original.weight and converted.bias is original.bias
        assert list(converted.state_dict()) == list(original.state_dict())
        x = torch.randn(8, 32, dtype=torch.bfloat16)
        assert relative_error(converted(x), original(x)) <= FORWARD_BOUND


def test_autocast_output_dtype():
    layer = coat.nn.Linear(32, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(4, 32))
    assert y.dtype == torch.bfloat16


def test_errors_for_bad_inputs():
    layer = coat.nn.Linear(32, 16)
    with pytest.raises(ValueError, match="32"):
        layer(torch.randn(4, 31))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        layer.double()(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.nn.Linear"):
        coat.nn.Linear.from_linear(torch.nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="group_size"):
        coat.nn.FP8Config(group_size=24)
    with pytest.raises(ValueError, match="unsupported FP8 format"):
        coat.nn.FP8Config(gradient_format="e3m4")
    with pytest.raises(ValueError, match="both be e5m2"):
        coat.nn.FP8Config(forward_format="e5m2", gradient_format="e5m2")
    with pytest.raises(TypeError, match="fast_accum must be True or False"):
        coat.nn.FP8Config(fast_accum="yes")
    with pytest.raises(TypeError, match="experts_fast_accum must be True or False"):
        coat.nn.FP8Config(experts_fast_accum=1)


@requires_cuda
def test_cuda_matches_cpu():
    """Quantization is bit-identical on both devices; the GEMMs differ only in fp32 summation order."""
    x, _, _, grad_y, layer = make_case((64, 96, 80), "cpu")
    on_cpu = run_layer(layer, x, grad_y)
    layer.zero_grad()
    on_cuda = run_layer(layer.cuda(), x.cuda(), grad_y.cuda())
    for a, b in zip(on_cpu, on_cuda):
        torch.testing.assert_close(b.cpu(), a, rtol=2**-7, atol=1e-3)
