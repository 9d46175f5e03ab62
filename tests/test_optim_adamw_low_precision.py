"""coat.optim.AdamW with low-precision parameters and gradients: bf16 parameters rounded once per update (to
nearest or stochastically), bf16 / fp16 gradients, FP8 gradients (fp8_grads), and non-finite gradients, which
poison only their element."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from coat import ops
from coat.optim import AdamW
from optim_helpers import (
    assert_same_run,
    bits,
    clone_params,
    make_grads,
    make_params,
    one_thread,  # noqa: F401  (the autouse fixture: pytest finds it in this module)
    train,
)


# --- low-precision parameters and gradients, non-finite gradients -------------------------------------------


def test_bfloat16_parameters_round_each_update_once():
    # A bf16 parameter is widened, updated in float32 and rounded once: one step equals the float32
    # parameter's step rounded to bf16. The moments depend only on the gradients, so they match at every step.
    grads = make_grads(4)
    bf16 = make_params(dtype=torch.bfloat16)
    widened = {n: torch.nn.Parameter(p.detach().float()) for n, p in bf16.items()}
    bf16_opt, fp32_opt = AdamW(bf16.values(), lr=1e-2), AdamW(widened.values(), lr=1e-2)
    train(bf16_opt, bf16, grads[:1], grad_dtype=torch.bfloat16)
    train(fp32_opt, widened, grads[:1], grad_dtype=torch.bfloat16)
    for name in bf16:
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bits(bf16[name].detach()), bits(widened[name].detach().bfloat16())), name
    train(bf16_opt, bf16, grads[1:], grad_dtype=torch.bfloat16)
    train(fp32_opt, widened, grads[1:], grad_dtype=torch.bfloat16)
    for name in bf16:
        for key in ("exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta"):
            assert torch.equal(bits(bf16_opt.state[bf16[name]][key]), bits(fp32_opt.state[widened[name]][key]))


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_act_as_their_float32_values(grad_dtype):
    grads = [{n: g.to(grad_dtype) for n, g in step.items()} for step in make_grads(4)]
    params, widened = make_params(), make_params()
    low_opt, fp32_opt = AdamW(params.values(), lr=1e-2), AdamW(widened.values(), lr=1e-2)
    train(low_opt, params, grads, grad_dtype=grad_dtype)
    train(fp32_opt, widened, grads, grad_dtype=torch.float32)
    assert all(p.grad.dtype == grad_dtype for p in params.values())
    assert_same_run(params, low_opt, widened, fp32_opt)


def test_stochastic_rounding_keeps_updates_below_half_an_ulp():
    # 200 steps of lr 1e-4 on bf16 ones (an ulp is 2^-7 above 1 and 2^-8 below): rounded to nearest, every
    # update is lost; rounded stochastically, the mean parameter follows the float32 run (which moves by about
    # 200 * lr, within the FP8 moments' rounding).
    runs = {}
    for rounding in ("nearest", "stochastic", None):
        p = torch.nn.Parameter(torch.ones(8192, dtype=torch.float32 if rounding is None else torch.bfloat16))
        opt = AdamW([p], lr=1e-4, weight_decay=0.0, param_rounding=rounding or "nearest", rounding_seed=7)
        for _ in range(200):
            p.grad = torch.ones_like(p)
            opt.step()
        runs[rounding] = p.detach().float()
    assert torch.all(runs["nearest"] == 1.0)
    exact = runs[None].mean().item()
    assert abs(exact - 0.98) < 2e-3
    assert abs(runs["stochastic"].mean().item() - exact) < 2e-4


def test_stochastic_rounding_resumes_bit_for_bit():
    # The seed is part of the param groups: a run restored from a state dict draws the bits the uninterrupted
    # run draws. Another seed draws other bits; torch.manual_seed fixes the default seed.
    grads = make_grads(6)
    params = make_params(dtype=torch.bfloat16)
    opt = AdamW(params.values(), lr=1e-2, param_rounding="stochastic", rounding_seed=1234)
    train(opt, params, grads[:3], grad_dtype=torch.bfloat16)
    resumed = clone_params(params)
    resumed_opt = AdamW(resumed.values(), lr=1e-2, param_rounding="stochastic", rounding_seed=99)
    resumed_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed_opt.param_groups[0]["rounding_seed"] == 1234
    train(opt, params, grads[3:], grad_dtype=torch.bfloat16)
    train(resumed_opt, resumed, grads[3:], grad_dtype=torch.bfloat16)
    assert_same_run(params, opt, resumed, resumed_opt)

    other = make_params(dtype=torch.bfloat16)
    train(AdamW(other.values(), lr=1e-2, param_rounding="stochastic", rounding_seed=99), other, grads,
          grad_dtype=torch.bfloat16)
    assert not torch.equal(bits(other["matrix"].detach()), bits(params["matrix"].detach()))
    torch.manual_seed(3)
    first = AdamW([torch.nn.Parameter(torch.ones(2))]).param_groups[0]["rounding_seed"]
    torch.manual_seed(3)
    assert AdamW([torch.nn.Parameter(torch.ones(2))]).param_groups[0]["rounding_seed"] == first


def test_checkpoint_without_rounding_options_loads():
    # State dicts saved before param_rounding existed keep this optimizer's rounding options.
    params = make_params()
    opt = AdamW(params.values(), param_rounding="stochastic", rounding_seed=5)
    train(opt, params, make_grads(1))
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        del group["param_rounding"], group["rounding_seed"]
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["param_rounding"] == "stochastic" and opt.param_groups[0]["rounding_seed"] == 5


def fp8_grad_models(fp8_grads="e5m2"):
    """Two copies of a small bf16 MLP and their optimizers, the first with fp8_grads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.SiLU(), torch.nn.Linear(96, 40)).bfloat16()
    twin = copy.deepcopy(model)
    return model, AdamW(model.parameters(), lr=1e-2, fp8_grads=fp8_grads), twin, AdamW(twin.parameters(), lr=1e-2)


def mlp_loss(model, seed):
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return model(x).float().square().mean()


def fp8_round_trip(grad, fmt):
    codes, scale, _ = ops.quantize_tensors([grad.reshape(-1, grad.shape[-1])], fmt, dim=0)
    return ops.dequantize(codes, scale, None, torch.float32).view(grad.shape)


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_fp8_gradients_are_the_quantized_gradients(fmt):
    # After backward, param.grad is freed and the optimizer holds the gradient quantized per tensor, as
    # coat.ops.quantize_tensors quantizes it; the step equals a step on those values given as bf16 gradients.
    model, opt, twin, twin_opt = fp8_grad_models(fmt)
    mlp_loss(model, 0).backward()
    mlp_loss(twin, 0).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.grad is None
        expected = fp8_round_trip(q.grad, fmt)
        assert torch.equal(opt.grad(p), expected)
        relative = (expected - q.grad.float()).norm() / q.grad.float().norm()
        assert relative < (0.2 if fmt == "e5m2" else 0.1)
        q.grad = expected.bfloat16()
    opt.step()
    twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(bits(p.detach()), bits(q.detach()))
    opt.zero_grad()
    assert all(opt.grad(p) is None for p in model.parameters())


def test_fp8_gradients_accumulate_over_micro_batches():
    # Each micro-batch's gradient is added to the dequantized stored one and the sum is quantized again.
    model, opt, twin, _ = fp8_grad_models()
    mlp_loss(model, 0).backward()
    mlp_loss(model, 1).backward()
    grads = []
    for seed in (0, 1):
        twin.zero_grad()
        mlp_loss(twin, seed).backward()
        grads.append([q.grad.clone() for q in twin.parameters()])
    for p, first, second in zip(model.parameters(), *grads):
        expected = fp8_round_trip(fp8_round_trip(first, "e5m2") + second.float(), "e5m2")
        assert torch.equal(opt.grad(p), expected)


def test_fp8_gradients_clip_by_the_true_norm():
    # clip_grad_norm_ sees the FP8 gradients: the same norm as torch's clip_grad_norm_ over their values, and
    # the same clipped values.
    model, opt, _, _ = fp8_grad_models()
    mlp_loss(model, 0).backward()
    values = [opt.grad(p).clone().requires_grad_() for p in model.parameters()]
    for v in values:
        v.grad = v.detach().clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(values, 0.01)
    norm = opt.clip_grad_norm_(0.01)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    for p, v in zip(model.parameters(), values):
        torch.testing.assert_close(opt.grad(p), v.grad, rtol=1e-6, atol=0)
    assert opt.clip_grad_norm_(1e9).item() == pytest.approx(0.01, rel=1e-4)  # no clipping above the norm


def test_fp8_gradient_errors_and_non_finite_values():
    model, opt, _, _ = fp8_grad_models()
    mlp_loss(model, 0).backward()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(RuntimeError, match="both an FP8 gradient"):
        opt.step()


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
def test_fp8_gradients_keep_a_nan_element_and_turn_an_inf_tensor_nan(fmt):
    # The quantizers' rule (the amax ignores NaN): a NaN element stays NaN alone, the rest quantizes as if it
    # were 0, and, as in torch.optim.AdamW, only its parameter element turns NaN. An Inf makes the per-tensor
    # scale Inf and the whole gradient, then the whole parameter, NaN. The norm reports both.
    grad = make_grads(1, shapes={"matrix": (24, 40)})[0]["matrix"]
    mask = torch.zeros(grad.shape, dtype=torch.bool)
    mask[5, 17] = True
    runs = {}
    for value in (float("nan"), float("inf"), 0.0):
        param = torch.nn.Parameter(torch.ones(grad.shape))
        opt = AdamW([param], lr=1e-2, fp8_grads=fmt)
        (param * grad.masked_fill(mask, value)).sum().backward()
        runs[value] = (param, opt.grad(param))
        if value != 0.0:
            with pytest.raises(RuntimeError, match="non-finite"):
                opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
        opt.step()
    (nan_param, nan_grad), (inf_param, inf_grad), (clean_param, clean_grad) = runs.values()
    assert torch.equal(nan_grad.isnan(), mask) and torch.equal(nan_grad[~mask], clean_grad[~mask])
    assert torch.equal(nan_param.isnan(), mask) and torch.equal(nan_param[~mask], clean_param[~mask])
    torch_param = torch.nn.Parameter(torch.ones(grad.shape))
    torch_param.grad = grad.masked_fill(mask, float("nan"))
    torch.optim.AdamW([torch_param], lr=1e-2).step()
    assert torch.equal(torch_param.isnan(), mask)
    assert inf_grad.isnan().all() and inf_param.isnan().all()


def test_fp8_gradients_belong_to_one_live_optimizer():
    # Two optimizers keeping one parameter's gradients would race for them (the first hook frees param.grad):
    # refused while the first lives; once it is gone its hook does nothing and a new one takes over.
    model, opt, _, _ = fp8_grad_models()
    with pytest.raises(ValueError, match="already kept in FP8 by another coat.optim.AdamW"):
        AdamW(model.parameters(), fp8_grads="e5m2")
    del opt
    gc.collect()
    replacement = AdamW(model.parameters(), fp8_grads="e5m2")
    mlp_loss(model, 0).backward()
    assert all(p.grad is None and replacement.grad(p) is not None for p in model.parameters())


def test_model_state_bytes_per_parameter():
    # Weights + gradients + optimizer state, per parameter, after backward (large matrices, G = 128):
    # float32 master weights and gradients 10.09 bytes; bf16 weights and gradients 6.09; bf16 weights and FP8
    # gradients 5.09.
    def state_bytes(fp8_grads, dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False))
        model.to(dtype)
        opt = AdamW(model.parameters(), fp8_grads=fp8_grads)
        model(torch.randn(4, 1024, dtype=dtype)).float().sum().backward()
        opt.step()
        model(torch.randn(4, 1024, dtype=dtype)).float().sum().backward()
        total = 0
        for p in model.parameters():
            total += p.numel() * p.element_size()
            total += sum(t.numel() * t.element_size() for t in opt.state[p].values())
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
            else:
                codes, scale = opt._fp8_grads[p]
                total += codes.numel() * codes.element_size() + scale.numel() * scale.element_size()
        return total / sum(p.numel() for p in model.parameters())

    assert state_bytes(None, torch.float32) == pytest.approx(10.094, abs=1e-3)
    assert state_bytes(None, torch.bfloat16) == pytest.approx(6.094, abs=1e-3)
    assert state_bytes("e5m2", torch.bfloat16) == pytest.approx(5.094, abs=1e-3)


def test_non_finite_gradients_poison_only_their_element():
    # Like torch.optim.AdamW, a NaN or Inf gradient makes its parameter NaN. Its group's statistics skip it,
    # as they skip zeros, so the rest of the group equals a run in which that gradient was 0.
    grads = make_grads(3)
    bad = {"matrix": [(0, 3), (5, 17)], "vector": [(7,), (40,)]}
    poisoned, zeroed = copy.deepcopy(grads), copy.deepcopy(grads)
    for name, positions in bad.items():
        for position, value in zip(positions, (float("nan"), float("inf"))):
            poisoned[0][name][position] = value
            for step in range(3):
                zeroed[step][name][position] = 0.0
    params, clean, torch_params = make_params(), make_params(), make_params()
    train(AdamW(params.values(), lr=1e-2, group_size=16), params, poisoned)
    train(AdamW(clean.values(), lr=1e-2, group_size=16), clean, zeroed)
    train(torch.optim.AdamW(torch_params.values(), lr=1e-2), torch_params, poisoned)
    for name, p in params.items():
        mask = torch.zeros(p.shape, dtype=torch.bool)
        for position in bad.get(name, []):
            mask[position] = True
        assert torch.equal(p.isnan(), mask) and torch.equal(torch_params[name].isnan(), mask), name
        assert torch.equal(p.detach()[~mask], clean[name].detach()[~mask]), name
