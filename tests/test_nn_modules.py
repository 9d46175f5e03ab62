"""coat.nn.RMSNorm, coat.nn.SwiGLUMLP, coat.nn.MLP and the decoder blocks of coat.nn.functional against float64 oracles.

Bounds, as in test_nn_linear.py: where an op's own arithmetic can be isolated, it is compared with float64
evaluated at the FP8 operands it read (from the oracles in tests/reference_nn.py, or captured from the FP8
GEMM calls), with at most 2x the error of the same op in BF16 PyTorch. End to end, against
float64 of the unquantized computation, every FP8 rounding adds a relative error of RMS about u/sqrt(3)
(E4M3: 0.036, E5M2: 0.072) and independent roundings add in quadrature:
  - one E4M3 rounding (RMSNorm forward / backward):                    bound 0.06
  - a chain of E4M3 GEMM operands and activations (forward of an MLP): sqrt(5) * 0.036 = 0.08, bound 0.12
  - backward with E5M2 gradients on top (two E5M2 + five E4M3):       sqrt(2*0.072^2 + 5*0.036^2) = 0.13,
    bound 0.2
  - a wgrad operand that backward recomputes from the E4M3-saved inputs of RMSNorm or SiLU*mul, against
    the forward's FP8 output: the saved inputs' roundings plus the two outputs' own (four E4M3 roundings,
    0.072), bound 0.12
A wiring mistake (a wrong scale, operand, transpose or missing term) gives errors of order 1.
"""
import pytest
import torch
import torch.nn.functional as F

import coat.nn
import coat.nn.functional as coat_functional
import coat.nn.gemm
import reference_nn as reference
from conftest import requires_cuda
from reference_nn import LowRankAdapter, quantize_per_tensor_dequantized, relative_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE_ROUNDING_BOUND = 0.06
FORWARD_CHAIN_BOUND = 0.12
BACKWARD_CHAIN_BOUND = 0.20
FP4_BACKWARD_CHAIN_BOUND = 0.30
EPS = 1e-5
TOKENS, HIDDEN, INTERMEDIATE = (2, 24), 64, 96


def randn(*shape, scale=1.0, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).bfloat16().to(device)


def run_saving(fn):
    """Runs fn() and returns its result and the tensors autograd saved, in the order they were saved."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, saved


@pytest.fixture
def gemm_calls(monkeypatch):
    """The FP8 GEMMs the layers run, in call order, as (a, a_scale, b_t, b_scale, out)."""
    calls = []
    gemm = coat_functional.fp8_gemm

    def recording_gemm(a, a_scale, b_t, b_scale, out_dtype, bias=None, fast_accum=False):
        out = gemm(a, a_scale, b_t, b_scale, out_dtype, bias, fast_accum)
        calls.append((a, a_scale, b_t, b_scale, out))
        return out

    monkeypatch.setattr(coat.nn.gemm, "fp8_gemm", recording_gemm)  # what Projections calls
    return calls


def dequantized(q, scale):
    return q.double() * scale.double()


def bf16_error(op, *operands) -> float:
    return relative_error(op(*operands), op(*(t.double() for t in operands)))


# ---------------------------------------------------------------------------------------------------------
# RMSNorm


def make_norm(device, seed=0):
    x = randn(*TOKENS, HIDDEN, scale=2.0, seed=seed, device=device)
    weight = (1 + randn(HIDDEN, scale=0.1, seed=seed + 1)).to(device)
    norm = coat.nn.RMSNorm(HIDDEN, EPS, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return x, weight, norm


def test_rmsnorm_forward(device):
    x, weight, norm = make_norm(device)
    y = norm(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    exact = reference.rms_norm(x.double(), weight.double(), EPS)
    # The output is the per-tensor FP8 tensor the next GEMM reads: compare with float64 quantized likewise.
    at_fp8 = quantize_per_tensor_dequantized(exact, E4M3)
    error_bf16 = bf16_error(lambda a, w: F.rms_norm(a, (HIDDEN,), w, EPS), x, weight)
    print(f"rmsnorm forward: at FP8 {relative_error(y, at_fp8):.2e} (BF16 torch {error_bf16:.2e}), "
          f"end to end {relative_error(y, exact):.3f}")
    assert relative_error(y, at_fp8) <= 2 * error_bf16
    assert relative_error(y, exact) <= ONE_ROUNDING_BOUND


def test_rmsnorm_backward(device):
    x, weight, norm = make_norm(device)
    grad_y = randn(*TOKENS, HIDDEN, seed=7, device=device)
    x_leaf = x.clone().requires_grad_()
    norm(x_leaf).backward(grad_y)

    x64, w64, g64 = x.double(), weight.double(), grad_y.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    x_fp8 = reference.quantize_group_dequantized(x, 16)
    at_fp8 = reference.rms_norm_backward(g64, x_fp8, rstd, w64)
    exact = reference.rms_norm_backward(g64, x64, rstd, w64)

    def bf16_backward(a, w, g):
        a, w = a.detach().requires_grad_(), w.detach().requires_grad_()
        F.rms_norm(a, (HIDDEN,), w, EPS).backward(g)
        return a.grad, w.grad

    bf16 = bf16_backward(x, weight, grad_y)
    float64 = bf16_backward(x64, w64, g64)
    for name, actual, fp8_ref, exact_ref, bf16_value, float64_value in zip(
        ("dx", "dweight"), (x_leaf.grad, norm.weight.grad), at_fp8, exact, bf16, float64
    ):
        error_bf16 = relative_error(bf16_value, float64_value)
        print(f"rmsnorm {name}: at FP8 {relative_error(actual, fp8_ref):.2e} (BF16 torch {error_bf16:.2e}), "
              f"end to end {relative_error(actual, exact_ref):.3f}")
        assert relative_error(actual, fp8_ref) <= 2 * error_bf16
        assert relative_error(actual, exact_ref) <= ONE_ROUNDING_BOUND


def test_rmsnorm_saves_fp8_groups(device):
    x, _, norm = make_norm(device)
    _, saved = run_saving(lambda: norm(x.clone().requires_grad_()))
    rows = TOKENS[0] * TOKENS[1]
    shapes = {(t.dtype, tuple(t.shape)) for t in saved if t is not norm.weight}
    assert shapes == {(E4M3, (rows, HIDDEN)), (torch.float32, (rows, HIDDEN // 16)), (torch.float32, (rows,))}


def test_rmsnorm_from_rmsnorm():
    hf_like = torch.nn.RMSNorm(HIDDEN, eps=1e-6)
    converted = coat.nn.RMSNorm.from_rmsnorm(hf_like)
    assert converted.weight is hf_like.weight and converted.eps == 1e-6
    with pytest.raises(TypeError, match="float eps"):
        coat.nn.RMSNorm.from_rmsnorm(torch.nn.RMSNorm(HIDDEN))  # eps=None: not a fixed value
    with pytest.raises(ValueError, match="features"):
        converted(torch.randn(3, HIDDEN + 1))


# ---------------------------------------------------------------------------------------------------------
# SwiGLUMLP


ACTIVATIONS = ("silu", "gelu_tanh", "quick_gelu")  # SwiGLU (Llama), GeGLU (Gemma), CLIP's quick_gelu


def make_mlp(device, config=coat.nn.FP8Config(), seed=0, activation="silu"):
    x = randn(*TOKENS, HIDDEN, seed=seed, device=device)
    weights = [
        randn(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5, seed=seed + 1),
        randn(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5, seed=seed + 2),
        randn(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5, seed=seed + 3),
    ]
    mlp = coat.nn.SwiGLUMLP(HIDDEN, INTERMEDIATE, dtype=torch.bfloat16, config=config, activation=activation)
    with torch.no_grad():
        for linear, weight in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), weights):
            linear.weight.copy_(weight)
    return x, [w.to(device) for w in weights], mlp.to(device)


def float64_mlp_grads(x, weights, grad_out, activation="silu"):
    leaves = [t.double().requires_grad_() for t in (x, *weights)]
    out = reference.swiglu_mlp(*leaves, activation=activation)
    out.backward(grad_out.double())
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gradient_format", ["e5m2", None])
def test_swiglu_mlp_forward_and_backward(device, gradient_format, gemm_calls, activation):
    x, weights, mlp = make_mlp(device, coat.nn.FP8Config(gradient_format=gradient_format), activation=activation)
    grad_out = randn(*TOKENS, HIDDEN, seed=9, device=device)
    x_leaf = x.clone().requires_grad_()
    out = mlp(x_leaf)

    # The down GEMM (the third) at the FP8 operands it read: the product SiLU*mul wrote and W_down.
    act_q, act_scale = gemm_calls[2][:2]
    act = dequantized(act_q, act_scale)
    down_at_fp8 = act @ quantize_per_tensor_dequantized(weights[2], E4M3).t()
    error_bf16 = bf16_error(lambda a, w: a @ w.t(), act.bfloat16(), weights[2])
    assert relative_error(out.reshape(-1, HIDDEN), down_at_fp8) <= 2 * error_bf16

    out.backward(grad_out)
    if gradient_format is not None:
        # The down wgrad reads the product recomputed from the saved gate and up, with the forward's scale.
        rows = x[..., 0].numel()
        act_q_t, recomputed_scale = next(call[2:4] for call in gemm_calls[3:] if call[2].shape == (INTERMEDIATE, rows))
        assert torch.equal(recomputed_scale, act_scale)
        recompute_error = relative_error(dequantized(act_q_t, act_scale).t(), act)
        print(f"swiglu product recomputed for the down wgrad {recompute_error:.3f}")
        assert 0 < recompute_error <= FORWARD_CHAIN_BOUND

    exact, exact_grads = float64_mlp_grads(x, weights, grad_out, activation)
    print(f"swiglu forward end to end {relative_error(out, exact):.3f}")
    assert relative_error(out, exact) <= FORWARD_CHAIN_BOUND
    actual_grads = [x_leaf.grad, mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad, mlp.down_proj.weight.grad]
    for name, actual, expected in zip(("dx", "dgate", "dup", "ddown"), actual_grads, exact_grads):
        print(f"swiglu {name} end to end {relative_error(actual, expected):.3f}")
        assert actual.dtype == torch.bfloat16
        assert relative_error(actual, expected) <= BACKWARD_CHAIN_BOUND


def test_swiglu_mlp_saves_fp8_only(device):
    x, _, mlp = make_mlp(device)
    _, saved = run_saving(lambda: mlp(x.clone().requires_grad_()))
    parameters = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    activations = [t for t in saved if t.untyped_storage().data_ptr() not in parameters]
    rows = x[..., 0].numel()
    expected = {
        (E4M3, (HIDDEN, rows)),  # input, transposed, for the gate and up wgrads
        (E4M3, (rows, INTERMEDIATE)),  # gate and up, 1 x 16 groups: SiLU*mul's backward and the down wgrad
        (torch.float32, (rows, INTERMEDIATE // 16)),  # their scales
        (torch.float32, ()),  # per-tensor scales, and the weights' amax that backward quantizes them with
    }
    assert {(t.dtype, tuple(t.shape)) for t in activations} == expected
    # input + scale, gate + scales, up + scales, the product's scale, amax of the gate/up and down weights
    assert len(activations) == 9
    assert all(t.dtype != torch.bfloat16 for t in activations)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_smooth_swiglu_scale(activation):
    gate = torch.tensor([[1.0, 0.0, -2.0, 30.0, 1.0], [2.0, 0.0, 1.0, -1.0, 1.0]])
    up = torch.tensor([[1.0, 5.0, 0.25, 100.0, 1e-40], [-3.0, 1.0, 1.0, 1.0, 0.0]])
    scale = coat_functional.smooth_swiglu_scale(gate, up, activation)
    amax = (reference.act_fn(gate, activation) * up).abs().amax(0)
    assert torch.equal(scale[1], torch.tensor(1.0))  # an all-zero channel is left alone
    assert torch.equal(scale[4], torch.tensor(2.0**126))  # a subnormal channel: the largest normal scale
    for channel in (0, 2, 3):
        scaled = amax[channel] * scale[channel]
        assert 0.5 < scaled <= 1.0 and torch.log2(scale[channel]) == torch.round(torch.log2(scale[channel]))


def test_smooth_swiglu_protects_small_channels_from_an_outlier_channel(device):
    """Aligned, large gate and up weights of one channel (the outlier mechanism Fishman et al. describe)
    make that channel of SiLU*mul ~1e5 times the others; down_proj scales it back, so the function is the
    same. Without smoothing, the per-tensor FP8 scale follows the outlier and the other channels fall below
    E4M3's normal range (448 / 1e5 < 2^-6), losing most of their precision; Smooth-SwiGLU's per-channel
    scale removes that."""
    errors = {}
    for smooth in (False, True):
        x, weights, mlp = make_mlp(device, coat.nn.FP8Config(smooth_swiglu=smooth))
        with torch.no_grad():
            mlp.gate_proj.weight[0] = mlp.gate_proj.weight[0].abs() * 100
            mlp.up_proj.weight[0] = mlp.up_proj.weight[0].abs() * 1000
            mlp.down_proj.weight[:, 0] /= 1e5
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        exact = reference.swiglu_mlp(*(t.detach().double() for t in (x, *weights)))
        errors[smooth] = relative_error(mlp(x), exact)
    print(f"outlier channel: error {errors[False]:.3f} without, {errors[True]:.3f} with Smooth-SwiGLU")
    assert errors[True] <= FORWARD_CHAIN_BOUND < errors[False]


def test_swiglu_mlp_from_mlp_errors():
    class GeluMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
            self.down_proj, self.act_fn = torch.nn.Linear(16, 8), torch.nn.GELU()

    for act_fn in (torch.nn.GELU(), torch.nn.ReLU(), torch.nn.Tanh()):  # erf GELU is not the tanh one
        mlp = GeluMLP()
        mlp.act_fn = act_fn
        with pytest.raises(ValueError, match="must be SiLU .*, the tanh GELU .* or quick_gelu"):
            coat.nn.SwiGLUMLP.from_mlp(mlp)
    with pytest.raises(TypeError, match="gate_proj"):
        coat.nn.SwiGLUMLP.from_mlp(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="activation must be one of"):
        coat.nn.SwiGLUMLP(8, 16, activation="gelu")
    with pytest.raises(ValueError, match="activation must be 'silu'"):
        coat_functional.swiglu_mlp(torch.randn(2, 8), (torch.randn(16, 8), None), (torch.randn(16, 8), None),
                                   (torch.randn(8, 16), None), activation="relu")


def transformers_activations():
    activations = pytest.importorskip("transformers.activations")
    return [(torch.nn.SiLU(), "silu"), (activations.SiLUActivation(), "silu"), (activations.ACT2FN["silu"], "silu"),
            (activations.ACT2FN["swish"], "silu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
            (activations.GELUTanh(), "gelu_tanh"), (activations.PytorchGELUTanh(), "gelu_tanh"),
            (activations.ACT2FN["gelu_pytorch_tanh"], "gelu_tanh"), (activations.QuickGELUActivation(), "quick_gelu"),
            (activations.ACT2FN["quick_gelu"], "quick_gelu")]


def test_swiglu_mlp_from_mlp_detects_the_activation(device):
    """from_mlp takes SiLU and the tanh GELU in their torch and transformers forms, and the converted MLP computes
    with that activation (its output equals SwiGLUMLP(activation=...)'s with the same weights)."""
    x, weights, _ = make_mlp(device)
    for act_fn, expected in transformers_activations():
        source = torch.nn.Module()
        source.gate_proj, source.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False), torch.nn.Linear(
            HIDDEN, INTERMEDIATE, bias=False)
        source.down_proj, source.act_fn = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False), act_fn
        with torch.no_grad():
            for linear, weight in zip((source.gate_proj, source.up_proj, source.down_proj), weights):
                linear.weight.copy_(weight.cpu())
        converted = coat.nn.SwiGLUMLP.from_mlp(source.bfloat16()).to(device)
        assert converted.activation == expected, act_fn
        assert f"activation={expected!r}" in repr(converted)
        _, _, direct = make_mlp(device, activation=expected)
        with torch.no_grad():
            assert torch.equal(converted(x), direct(x))


def test_gemma3_mlp_converts_to_geglu():
    """transformers' Gemma3MLP (hidden_activation "gelu_pytorch_tanh") becomes a GeGLU SwiGLUMLP."""
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    config = pytest.importorskip("transformers").Gemma3TextConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    assert coat.nn.SwiGLUMLP.from_mlp(gemma3.Gemma3MLP(config)).activation == "gelu_tanh"


def test_a_wrapped_projection_is_refused_not_ignored():
    """SwiGLUMLP computes its projections itself from their parameters: a wrapper put in place of one would be
    skipped without a word, so the forward refuses it."""
    mlp = coat.nn.SwiGLUMLP(16, 32)
    mlp.up_proj = LowRankAdapter(mlp.up_proj)
    with pytest.raises(TypeError, match=r"SwiGLUMLP.up_proj is now a LowRankAdapter.*PEFT.*skip_modules"):
        mlp(torch.randn(4, 16))


# ---------------------------------------------------------------------------------------------------------
# MLP: the non-gated MLP of vision towers, fc2(act(fc1(x)))


def make_non_gated_mlp(device, activation="gelu_tanh", seed=0, names=("fc1", "fc2")):
    x = randn(*TOKENS, HIDDEN, seed=seed, device=device)
    params = [randn(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5, seed=seed + 1), randn(INTERMEDIATE, scale=0.1, seed=seed + 2),
              randn(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5, seed=seed + 3), randn(HIDDEN, scale=0.1, seed=seed + 4)]
    mlp = coat.nn.MLP(HIDDEN, INTERMEDIATE, dtype=torch.bfloat16, activation=activation, names=names)
    with torch.no_grad():
        for name, (weight, bias) in zip(names, (params[:2], params[2:])):
            getattr(mlp, name).weight.copy_(weight)
            getattr(mlp, name).bias.copy_(bias)
    return x, [p.to(device) for p in params], mlp.to(device)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_forward_and_backward(device, gemm_calls, activation):
    """fc2's GEMM at the FP8 operands it read within 2x BF16's error; end to end, output and every gradient (biases
    included) within the chain bounds of float64 CLIPMLP."""
    x, params, mlp = make_non_gated_mlp(device, activation)
    grad_out = randn(*TOKENS, HIDDEN, seed=9, device=device)
    x_leaf = x.clone().requires_grad_()
    out = mlp(x_leaf)
    assert len(gemm_calls) == 2
    act_q, act_scale = gemm_calls[1][:2]
    act = dequantized(act_q, act_scale)
    fc2_at_fp8 = act @ quantize_per_tensor_dequantized(params[2], E4M3).t() + params[3].double()
    error_bf16 = bf16_error(lambda a, w: a @ w.t(), act.bfloat16(), params[2])
    assert relative_error(out.reshape(-1, HIDDEN), fc2_at_fp8) <= 2 * error_bf16
    out.backward(grad_out)
    leaves = [t.double().requires_grad_() for t in (x, *params)]
    exact = reference.mlp(*leaves, activation=activation)
    exact.backward(grad_out.double())
    print(f"mlp ({activation}) forward end to end {relative_error(out, exact):.3f}")
    assert relative_error(out, exact.detach()) <= FORWARD_CHAIN_BOUND
    actual = [x_leaf.grad, mlp.fc1.weight.grad, mlp.fc1.bias.grad, mlp.fc2.weight.grad, mlp.fc2.bias.grad]
    for name, grad, leaf in zip(("dx", "dfc1", "dfc1_bias", "dfc2", "dfc2_bias"), actual, leaves):
        print(f"mlp ({activation}) {name} end to end {relative_error(grad, leaf.grad):.3f}")
        assert grad.dtype == torch.bfloat16 and relative_error(grad, leaf.grad) <= BACKWARD_CHAIN_BOUND


def test_mlp_saves_fp8_only(device):
    """The input transposed in E4M3 for fc1's wgrad, fc1's output in E4M3 1 x 16 groups (the act's backward and fc2's
    wgrad operand), scales: no 16-bit activation, and no copy of the act's output."""
    x, _, mlp = make_non_gated_mlp(device)
    _, saved = run_saving(lambda: mlp(x.clone().requires_grad_()))
    parameters = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    activations = [t for t in saved if t is not None and t.untyped_storage().data_ptr() not in parameters]
    rows = x[..., 0].numel()
    assert {(t.dtype, tuple(t.shape)) for t in activations} == {
        (E4M3, (HIDDEN, rows)), (E4M3, (rows, INTERMEDIATE)), (torch.float32, (rows, INTERMEDIATE // 16)),
        (torch.float32, ())}
    # input + scale, fc1's output + scales, the act's scale, amax of fc1's and fc2's weights
    assert len(activations) == 7


def transformers_mlps():
    """transformers' non-gated MLPs of vision towers: (module, its activation's kernel name, its linear children)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.clip.modeling_clip import CLIPMLP
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionMLP
    from transformers.models.siglip.modeling_siglip import SiglipMLP

    sizes = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=2)
    return [
        (CLIPMLP(transformers.CLIPVisionConfig(**sizes)), "quick_gelu", ("fc1", "fc2")),
        (SiglipMLP(transformers.SiglipVisionConfig(**sizes)), "gelu_tanh", ("fc1", "fc2")),
        (VisionMlp(HIDDEN, INTERMEDIATE, "quick_gelu"), "quick_gelu", ("fc1", "fc2")),
        (Qwen3VLVisionMLP(transformers.models.qwen3_vl.Qwen3VLVisionConfig(**sizes)), "gelu_tanh",
         ("linear_fc1", "linear_fc2")),
    ]


def test_mlp_from_transformers_mlps(device):
    """from_mlp keeps the module's children names, parameters and state-dict keys, takes its activation, and computes
    what coat.nn.MLP built directly with the same weights computes."""
    for source, activation, names in transformers_mlps():
        source = source.bfloat16()
        keys, before = list(source.state_dict()), dict(source.named_parameters())
        converted = coat.nn.MLP.from_mlp(source)
        assert converted.activation == activation and converted.names == names, type(source).__name__
        assert list(converted.state_dict()) == keys
        assert all(p is before[n] for n, p in converted.named_parameters())
        assert all(type(getattr(converted, n)) is coat.nn.Linear for n in names)
        x, _, direct = make_non_gated_mlp(device, activation, names=names)
        direct.load_state_dict(converted.state_dict())
        with torch.no_grad():
            assert torch.equal(converted.to(device)(x), direct(x))


def test_mlp_compiles_without_graph_breaks_and_as_eager():
    """coat.nn.MLP is one graph for torch.compile (the non-gated ops' fakes return no up copy), and its compiled
    forward and backward (AOTAutograd) equal eager's bit for bit."""
    x, _, mlp = make_non_gated_mlp("cpu", "quick_gelu")
    explanation = torch._dynamo.explain(lambda t: mlp(t).sum())(x.clone().requires_grad_())
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    torch._dynamo.reset()
    results = []
    for fn in (mlp, torch.compile(mlp, backend="aot_eager")):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.float().square().sum().backward()
        results.append([out.detach(), leaf.grad, *(p.grad for p in mlp.parameters())])
        mlp.zero_grad(set_to_none=True)
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_mlp_errors():
    clip = transformers_mlps()[0][0]
    clip.activation_fn = torch.nn.GELU()  # the erf GELU: no fused kernel
    with pytest.raises(ValueError, match=r"MLP.from_mlp expects .*gelu_pytorch_tanh, quick_gelu or SiLU, got CLIPMLP"):
        coat.nn.MLP.from_mlp(clip)
    with pytest.raises(ValueError, match="activation must be one of"):
        coat.nn.MLP(8, 16, activation="gelu")
    with pytest.raises(ValueError, match="activation must be 'silu'.*'quick_gelu'"):
        coat_functional.mlp(torch.randn(2, 8), (torch.randn(16, 8), None), (torch.randn(8, 16), None), activation="relu")
    with pytest.raises(ValueError, match=r"coat.nn.functional.mlp: input has 4 features .* expects 8"):
        coat_functional.mlp(torch.randn(2, 4), (torch.randn(16, 8), None), (torch.randn(8, 16), None))
    mlp = coat.nn.MLP(16, 32)
    mlp.fc2 = LowRankAdapter(mlp.fc2)
    with pytest.raises(TypeError, match=r"MLP.fc2 is now a LowRankAdapter"):
        mlp(torch.randn(4, 16))


# ---------------------------------------------------------------------------------------------------------
# Decoder blocks


def float64_grads(fn, leaves, grad_out):
    leaves = [t.detach().double().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(grad_out.double())
    return out.detach(), [leaf.grad for leaf in leaves]


def test_before_attention(device, gemm_calls):
    x, norm_weight, _ = make_norm(device)
    weights = [randn(n, HIDDEN, scale=HIDDEN**-0.5, seed=20 + i, device=device) for i, n in enumerate((64, 32, 32))]
    leaves = [t.clone().requires_grad_() for t in (x, norm_weight, *weights)]
    outputs, saved = run_saving(
        lambda: coat_functional.before_attention(leaves[0], leaves[1], EPS, [(w, None) for w in leaves[2:]])
    )
    # Only the norm's input is saved in FP8 (1 x 16 groups), not the normalized output.
    rows = x[..., 0].numel()
    assert [tuple(t.shape) for t in saved if t.dtype == E4M3] == [(rows, HIDDEN)]
    # The three GEMMs read the normalized input in FP8 and the three weights quantized with one shared
    # per-tensor scale (one GEMM over the stacked weights).
    assert len(gemm_calls) == 3 and all(call[0] is gemm_calls[0][0] for call in gemm_calls)
    normed_q, normed_scale = gemm_calls[0][:2]
    normed = dequantized(normed_q, normed_scale)
    stacked = quantize_per_tensor_dequantized(torch.cat(weights), E4M3)
    for out, weight in zip(outputs, stacked.split([w.shape[0] for w in weights])):
        at_fp8 = normed @ weight.t()
        error_bf16 = bf16_error(lambda a, w: a @ w.t(), normed.bfloat16(), weight.bfloat16())
        assert relative_error(out.reshape(at_fp8.shape), at_fp8) <= 2 * error_bf16

    grads = [randn(*o.shape, seed=30 + i, device=device) for i, o in enumerate(outputs)]
    torch.autograd.backward(outputs, grads)
    # The wgrad reads the normalized input recomputed from the saved x, with the forward's scale.
    (normed_q_t, recomputed_scale), = [call[2:4] for call in gemm_calls[3:] if call[2].shape == (HIDDEN, rows)]
    assert torch.equal(recomputed_scale, normed_scale)
    recompute_error = relative_error(dequantized(normed_q_t, normed_scale).t(), normed)
    print(f"before_attention normed input recomputed for the wgrads {recompute_error:.3f}")
    assert 0 < recompute_error <= FORWARD_CHAIN_BOUND

    def exact_fn(x, norm_weight, *weights):
        normed = reference.rms_norm(x, norm_weight, EPS)
        return torch.cat([normed @ w.t() for w in weights], -1)

    exact, exact_grads = float64_grads(exact_fn, (x, norm_weight, *weights), torch.cat(grads, -1))
    assert relative_error(torch.cat(outputs, -1), exact) <= FORWARD_CHAIN_BOUND
    for name, leaf, expected in zip(("x", "norm", "q", "k", "v"), leaves, exact_grads):
        print(f"before_attention d{name} end to end {relative_error(leaf.grad, expected):.3f}")
        assert relative_error(leaf.grad, expected) <= BACKWARD_CHAIN_BOUND


@pytest.mark.parametrize("attention_keeps_output", [True, False])
def test_after_attention(device, attention_keeps_output):
    attn, residual = randn(*TOKENS, HIDDEN, seed=40, device=device), randn(*TOKENS, HIDDEN, seed=41, device=device)
    weight = randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5, seed=42, device=device)
    leaves = [t.clone().requires_grad_() for t in (attn, residual, weight)]
    out, saved = run_saving(
        lambda: coat_functional.after_attention(
            leaves[0], leaves[1], leaves[2], None, attention_keeps_output=attention_keeps_output
        )
    )
    at_fp8 = residual.double() + quantize_per_tensor_dequantized(attn, E4M3) @ quantize_per_tensor_dequantized(
        weight, E4M3
    ).t()
    error_bf16 = bf16_error(lambda a, r, w: r + a @ w.t(), attn, residual, weight)
    assert relative_error(out, at_fp8) <= 2 * error_bf16

    weight_storage = leaves[2].untyped_storage().data_ptr()
    kept = [t for t in saved if t.dtype in (torch.bfloat16, E4M3) and t.untyped_storage().data_ptr() != weight_storage]
    if attention_keeps_output:
        # Only the attention output itself (which the attention kernel keeps anyway) and one amax.
        assert [t.untyped_storage().data_ptr() for t in kept] == [leaves[0].untyped_storage().data_ptr()]
    else:
        assert [(t.dtype, tuple(t.shape)) for t in kept] == [(E4M3, (HIDDEN, attn[..., 0].numel()))]

    grad_out = randn(*TOKENS, HIDDEN, seed=43, device=device)
    out.backward(grad_out)
    exact, exact_grads = float64_grads(lambda a, r, w: r + a @ w.t(), (attn, residual, weight), grad_out)
    assert torch.equal(leaves[1].grad, grad_out)
    for name, leaf, expected in zip(("attn", "residual", "weight"), leaves, exact_grads):
        print(f"after_attention d{name} end to end {relative_error(leaf.grad, expected):.3f}")
        assert relative_error(leaf.grad, expected) <= BACKWARD_CHAIN_BOUND


@pytest.mark.parametrize("smooth_swiglu, saved_format, activation", [
    (False, "e4m3", "silu"), (True, "e4m3", "silu"), (False, "fp4", "silu"), (False, "e4m3", "gelu_tanh"),
    (True, "e4m3", "gelu_tanh"), (False, "fp4", "gelu_tanh"),
])
def test_mlp_residual(device, smooth_swiglu, saved_format, activation):
    """With saved_format="fp4" the norm's input and gate and up are kept as FP4 (relative RMS error 0.094
    each, tests/test_block_formats.py): three of the chain's E4M3 terms become FP4 ones, sqrt(2 * 0.072^2 + 2 * 0.036^2
    + 3 * 0.094^2) = 0.19, bound 0.3."""
    x, norm_weight, _ = make_norm(device)
    _, weights, _ = make_mlp(device)
    leaves = [t.clone().requires_grad_() for t in (x, norm_weight, *weights)]
    config = coat.nn.FP8Config(smooth_swiglu=smooth_swiglu, saved_format=saved_format)
    out = coat_functional.mlp_residual(leaves[0], leaves[1], EPS, *((w, None) for w in leaves[2:]), config,
                                       activation=activation)
    grad_out = randn(*TOKENS, HIDDEN, seed=50, device=device)
    out.backward(grad_out)

    def exact_fn(x, norm_weight, *weights):
        return x + reference.swiglu_mlp(reference.rms_norm(x, norm_weight, EPS), *weights, activation=activation)

    exact, exact_grads = float64_grads(exact_fn, (x, norm_weight, *weights), grad_out)
    assert relative_error(out - x, exact - x.double()) <= FORWARD_CHAIN_BOUND
    bound = BACKWARD_CHAIN_BOUND if saved_format == "e4m3" else FP4_BACKWARD_CHAIN_BOUND
    for name, leaf, expected in zip(("x", "norm", "gate", "up", "down"), leaves, exact_grads):
        print(f"mlp_residual {saved_format} d{name} end to end {relative_error(leaf.grad, expected):.3f}")
        assert relative_error(leaf.grad, expected) <= bound


@pytest.mark.parametrize("saved_format", ["e4m3", "fp4"])
def test_blocks_without_autograd_match_training_forward(device, saved_format):
    """Inference saves nothing, but computes the same values, whatever the format training keeps."""
    x, norm_weight, _ = make_norm(device)
    _, weights, _ = make_mlp(device)
    params = [(w, None) for w in weights]
    config = coat.nn.FP8Config(saved_format=saved_format)
    trained = coat_functional.mlp_residual(x.clone().requires_grad_(), norm_weight, EPS, *params, config)
    with torch.no_grad():
        inferred = coat_functional.mlp_residual(x, norm_weight, EPS, *params)
    assert torch.equal(trained.detach(), inferred)


def test_layers_take_any_layout_like_torch_layers(device):
    """Transposed inputs and the expanded gradient of a .sum() (stride 0) are read as their values: the
    results equal those of contiguous copies, bit for bit."""
    _, _, mlp = make_mlp(device)
    _, _, norm = make_norm(device)
    for module in (norm, mlp, mlp.gate_proj):
        x = randn(HIDDEN, 24, device=device).t()  # [24, HIDDEN], column-major
        results = []
        for layout in (x, x.contiguous()):
            leaf = layout.detach().requires_grad_()
            module.zero_grad()
            out = module(leaf)
            out.sum().backward()
            results.append([out.detach(), leaf.grad] + [p.grad for p in module.parameters()])
        for transposed, contiguous in zip(*results):
            assert torch.equal(transposed, contiguous)


@requires_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_residual_cuda_matches_cpu(activation):
    """The fused kernels and quantizers agree bit for bit; GEMMs differ only in fp32 summation order."""
    results = []
    for device in ("cpu", "cuda"):
        x, norm_weight, _ = make_norm(device)
        _, weights, _ = make_mlp(device)
        leaves = [t.clone().requires_grad_() for t in (x, norm_weight, *weights)]
        out = coat_functional.mlp_residual(leaves[0], leaves[1], EPS, *((w, None) for w in leaves[2:]),
                                           activation=activation)
        out.backward(randn(*TOKENS, HIDDEN, seed=50, device=device))
        results.append([out.detach().cpu()] + [leaf.grad.cpu() for leaf in leaves])
    for on_cpu, on_cuda in zip(*results):
        assert relative_error(on_cuda, on_cpu) <= 0.02


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transposed_codes_of_fp8_gathered_weights_are_the_byte_transpose(device, fp8):
    """Backward's dgrad operand of weights all-gathered in FP8: every one of the 256 codes, in weights of
    uneven widths stacked by rows, lands transposed with its own bits; NaN codes stay NaN."""
    from coat.nn.fp8_weight import FP8Weight, transposed_codes

    generator = torch.Generator().manual_seed(3)
    widths, k = (48, 80, 17), 64
    codes = [torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8) for n in widths]
    codes[0].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    weights = [FP8Weight(c.to(device).view(fp8), torch.tensor(0.5, device=device), torch.tensor(1.0, device=device),
                         torch.bfloat16) for c in codes]
    got = transposed_codes(weights)
    assert got.dtype == fp8 and got.shape == (k, sum(widths)) and got.is_contiguous()
    expected = torch.cat(codes).t()
    nan = expected.view(fp8).float().isnan()
    assert torch.equal(got.cpu().view(torch.uint8)[~nan], expected[~nan])
    assert got.cpu().float()[nan].isnan().all()
