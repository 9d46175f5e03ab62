"""Copies of coat.optim.AdamW and of its state dict: copy.deepcopy and pickle of the optimizer give a working
optimizer that steps bit for bit like the original, in every storage mode; the state dict travels through
torch.save, not through plain pickle (torch cannot unpickle float8 tensors)."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from coat.optim import AdamW
from optim_helpers import one_thread  # noqa: F401 (an autouse fixture)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.SiLU(), torch.nn.Linear(40, 8)).to(dtype)


def backward(model: torch.nn.Module, seed: int) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(seed)).to(dtype)
    model(x).float().square().mean().backward()


def assert_same(model_a, opt_a, model_b, opt_b) -> None:
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert pa is not pb
        assert torch.equal(bits(pa), bits(pb))
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(bits(sa[key]), bits(sb[key])), key
        grad_a, grad_b = opt_a.grad(pa), opt_b.grad(pb)
        assert (grad_a is None) == (grad_b is None)
        if grad_a is not None:
            assert torch.equal(bits(grad_a), bits(grad_b))


def deepcopied(pair):
    return copy.deepcopy(pair)


def pickled(pair):
    return pickle.loads(pickle.dumps(pair))


MODES = {
    "float32": (torch.float32, {}),
    "bf16-nearest": (torch.bfloat16, {}),
    "bf16-stochastic": (torch.bfloat16, {"param_rounding": "stochastic", "rounding_seed": 7}),
    "bf16-fp8-grads-e5m2": (torch.bfloat16, {"fp8_grads": "e5m2", "param_rounding": "stochastic"}),
    "float32-fp8-grads-e4m3": (torch.float32, {"fp8_grads": "e4m3", "m_format": "e5m2", "expand": (False, True)}),
}


@pytest.mark.parametrize("make_copy", [deepcopied, pickled], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("mode", MODES)
def test_a_copied_optimizer_steps_bit_for_bit_like_the_original(mode, make_copy):
    # Copied after a step and a backward (the gradients pending, FP8 ones in the optimizer), as torch's
    # optimizers are copied: together with their model, whose parameters the copy then updates.
    dtype, options = MODES[mode]
    model = mlp(dtype)
    opt = AdamW(model.parameters(), lr=1e-2, group_size=16, **options)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    copy_model, copy_opt = make_copy((model, opt))
    assert copy_opt.fp8_grads == opt.fp8_grads
    for p, q in zip(model.parameters(), copy_model.parameters()):
        if p.grad is not None:  # copies of an nn.Parameter drop its .grad, in torch; FP8 gradients are copied
            assert q.grad is None
            q.grad = p.grad.clone()
    assert_same(model, opt, copy_model, copy_opt)
    for m, o in ((model, opt), (copy_model, copy_opt)):
        for seed in (2, 3):
            if o.fp8_grads is not None:
                o.clip_grad_norm_(0.05)
            o.step()
            o.zero_grad()
            backward(m, seed)  # under fp8_grads, the copy's own hooks keep its gradients
    assert_same(model, opt, copy_model, copy_opt)


def test_a_copy_sharing_the_parameters_cannot_also_keep_their_fp8_gradients():
    # Two live optimizers keeping one parameter's FP8 gradients would race for them, as on construction.
    model = mlp(torch.bfloat16)
    opt = AdamW(model.parameters(), fp8_grads="e5m2")
    shared = {id(p): p for p in model.parameters()}
    with pytest.raises(ValueError, match="already kept in FP8 by another coat.optim.AdamW"):
        copy.deepcopy(opt, shared)


def test_the_state_dict_travels_through_torch_save_not_plain_pickle():
    model = mlp(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, group_size=16)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    state_dict = opt.state_dict()
    # torch's limitation, for any float8 tensor: pickle writes it, and cannot load it back.
    for value in (state_dict, torch.zeros(3, dtype=torch.float8_e4m3fn)):
        with pytest.raises(AttributeError, match="UntypedStorage' has no attribute 'dtype'"):
            pickle.loads(pickle.dumps(value))
    # The workaround: torch.save's bytes (which pickle carries as any bytes), loaded into a fresh optimizer.
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    loaded = torch.load(io.BytesIO(pickle.loads(pickle.dumps(buffer.getvalue()))), weights_only=True)
    fresh_model = mlp(torch.bfloat16)
    fresh_model.load_state_dict(model.state_dict())
    fresh = AdamW(fresh_model.parameters(), group_size=16)
    fresh.load_state_dict(loaded)
    for m, o in ((model, opt), (fresh_model, fresh)):
        backward(m, 1)
        o.step()
    assert_same(model, opt, fresh_model, fresh)
