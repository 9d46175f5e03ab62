"""coat.optim.AdamW on a converted mixture of experts: the 3-D expert parameters ([E, 2I, H], [E, H, I]) take FP8
moments in groups along their last dimension as 2-D ones do, in each of the low-memory settings (float32 master
weights; bf16 weights with stochastic rounding; FP8 gradients), and a state_dict round trip in the middle of a run
changes nothing. The model state's bytes per parameter are the README's: 2 (weight) + 2.09 (moments) + 2
(gradient), or 1 with FP8 gradients."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import coat
from test_nn_llama import tiny_model, token_batch

pytestmark = pytest.mark.transformers

SETTINGS = {
    "float32 master weights": (torch.float32, dict()),
    "bf16 weights, stochastic rounding": (torch.bfloat16, dict(param_rounding="stochastic", rounding_seed=1)),
    "bf16 weights, FP8 gradients": (torch.bfloat16, dict(param_rounding="stochastic", rounding_seed=1,
                                                         fp8_grads="e5m2")),
}


def build(dtype, options, **overrides):
    model = coat.convert(tiny_model("qwen3_moe", **overrides).to(dtype))
    return model, coat.optim.AdamW(model.parameters(), lr=3e-3, **options)


def train(model, optimizer, steps):
    """Steps on one batch, so that the loss falls step after step."""
    losses = []
    tokens = token_batch("cpu")
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("setting", SETTINGS)
def test_adamw_trains_expert_tensors_and_resumes_exactly(setting):
    dtype, options = SETTINGS[setting]
    model, optimizer = build(dtype, options)
    experts = model.model.layers[1].mlp.experts
    losses = train(model, optimizer, 3)
    for param in (experts.gate_up_proj, experts.down_proj):
        moments = optimizer.fp8_moments(param)
        codes, meta = moments["m"]
        assert codes.dtype == torch.float8_e4m3fn and codes.numel() == param.numel()
        rows, cols = param.numel() // param.shape[-1], param.shape[-1]
        assert meta.numel() == 3 * rows * -(-cols // 128)  # (scale, k, C) per group of 128 along the last dim

    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    continued = train(model, optimizer, 3)
    resumed_model, resumed_optimizer = build(dtype, options)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    assert train(resumed_model, resumed_optimizer, 3) == continued
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name
    print(f"{setting}: losses {losses + continued}")
    assert continued[-1] < losses[0]


@pytest.mark.parametrize("setting, bytes_per_parameter", [("bf16 weights, stochastic rounding", 6.1),
                                                         ("bf16 weights, FP8 gradients", 5.1)])
def test_model_state_bytes_per_parameter_with_experts(setting, bytes_per_parameter):
    dtype, options = SETTINGS[setting]
    # Rows a multiple of the 128-element groups wide, as in real models (the tiny ones' 64-wide rows would carry
    # a group's 12 bytes of scale, k and C for 64 elements)
    model, optimizer = build(dtype, options, hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    train(model, optimizer, 1)
    tokens = token_batch("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens, labels=tokens).loss.backward()  # the gradients held between backward and step
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(optimizer.grad(p).numel() * (1 if optimizer.fp8_grads else p.grad.element_size()) for p in params)
    moments = sum(t.numel() * t.element_size() for p in params for pair in optimizer.fp8_moments(p).values()
                  for t in pair)
    total = (weights + grads + moments) / sum(p.numel() for p in params)
    print(f"{setting}: {total:.3f} bytes per parameter")
    assert total <= bytes_per_parameter
