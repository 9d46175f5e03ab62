"""coat.optim.AdamW's state dicts: round trips that continue bit for bit, vector meta across shardings, refused
checkpoints, and the conversion to and from torch.optim.AdamW state. Single process (tests/test_optim_distributed.py
covers DCP)."""
from __future__ import annotations

import copy

import pytest
import torch

from coat import ops
from coat.optim import AdamW
from optim_helpers import (
    MOMENTS,
    assert_same_run,
    bits,
    clone_params,
    dequantized,
    make_grads,
    make_params,
    one_thread,  # noqa: F401  (the autouse fixture: pytest finds it in this module)
    train,
)


# --- state_dict ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [16, 128])
def test_state_dict_round_trip_continues_bit_for_bit(tmp_path, group_size):
    grads = make_grads(8)
    params = make_params()
    bf16_params = {"bf16_" + n: p for n, p in make_params(seed=3, dtype=torch.bfloat16).items()}
    all_grads = [{**g, **{"bf16_" + n: t for n, t in g.items()}} for g in grads]

    def build(fp32, bf16):
        return AdamW(
            [{"params": list(fp32.values())}, {"params": list(bf16.values()), "m_format": "e5m2", "expand": (False, True)}],
            lr=1e-2,
            group_size=group_size,
        )

    uninterrupted = build(params, bf16_params)
    train(uninterrupted, {**params, **bf16_params}, all_grads[:5])
    torch.save(uninterrupted.state_dict(), tmp_path / "optimizer.pt")
    resumed_params, resumed_bf16 = clone_params(params), clone_params(bf16_params)
    train(uninterrupted, {**params, **bf16_params}, all_grads[5:])

    resumed = build(resumed_params, resumed_bf16)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    state = resumed.state[resumed_bf16["bf16_matrix"]]  # torch's load_state_dict would cast these to bf16
    assert state["exp_avg"].dtype == torch.float8_e5m2 and state["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"
    train(resumed, {**resumed_params, **resumed_bf16}, all_grads[5:])
    assert_same_run({**params, **bf16_params}, uninterrupted, {**resumed_params, **resumed_bf16}, resumed)


def test_state_dict_saves_vector_meta_per_element():
    params = make_params()
    opt = AdamW(params.values(), group_size=16)
    train(opt, params, make_grads(2))
    saved = opt.state_dict()["state"]
    names = list(params)
    for index, name in enumerate(names):
        p, state = params[name], opt.state[params[name]]
        for _, meta_key in MOMENTS:
            if p.dim() <= 1:
                assert saved[index][meta_key].shape == (*p.shape, 3)
                per_group = state[meta_key]
                expected = per_group.repeat_interleave(16, dim=0)[: max(p.numel(), 1)].reshape(*p.shape, 3)
                assert torch.equal(bits(saved[index][meta_key]), bits(expected))
            else:
                assert saved[index][meta_key] is state[meta_key]
    # the optimizer's own state is untouched by state_dict()
    assert opt.state[params["vector"]]["exp_avg_meta"].shape == (4, 3)


def test_load_reforms_vector_groups_of_another_sharding():
    # Two 24-element shards of one 48-element vector, each with its own groups ([0,16) [16,24) | [24,40)
    # [40,48) at G = 16), loaded as one vector whose groups are [0,16) [16,32) [32,48): the first group
    # holds the elements of one saved group and keeps codes and meta; the other two mix saved groups and are
    # re-quantized from the exactly dequantized elements.
    shards = {"left": torch.nn.Parameter(torch.randn(24)), "right": torch.nn.Parameter(torch.randn(24))}
    shard_opt = AdamW(shards.values(), lr=1e-2, group_size=16)
    train(shard_opt, shards, make_grads(3, shapes={"left": (24,), "right": (24,)}))
    saved = shard_opt.state_dict()
    left, right = saved["state"][0], saved["state"][1]
    whole = torch.nn.Parameter(torch.cat([shards["left"].detach(), shards["right"].detach()]))
    checkpoint = {
        "state": {0: {key: (left[key] if key == "step" else torch.cat([left[key], right[key]])) for key in left}},
        "param_groups": [{**saved["param_groups"][0], "params": [0]}],
    }
    opt = AdamW([whole], lr=1e-2, group_size=16)
    opt.load_state_dict(checkpoint)
    state = opt.state[whole]
    for codes_key, meta_key in MOMENTS:
        codes, per_element = checkpoint["state"][0][codes_key], checkpoint["state"][0][meta_key]
        assert torch.equal(bits(state[codes_key][:16]), bits(codes[:16]))
        assert torch.equal(bits(state[meta_key][0]), bits(per_element[0]))
        exact = ops.dequantize_expanded(codes.view(48, 1), per_element.view(48, 1, 3), 16).view(48)
        expand = opt.param_groups[0]["expand"][0 if codes_key == "exp_avg" else 1]
        requantized_codes, requantized_meta = ops.quantize_expanded(exact, 16, codes.dtype, expand=expand)
        assert torch.equal(bits(state[codes_key][16:]), bits(requantized_codes[16:]))
        assert torch.equal(bits(state[meta_key][1:]), bits(requantized_meta[1:]))
        # one more FP8 rounding: within the format's relative half-step (E4M3: 2^-4) of the saved values
        reloaded = dequantized(opt, whole, codes_key, meta_key)
        assert ((reloaded - exact).abs() <= 2**-4 * exact.abs() + 1e-30).all()


def test_load_state_dict_rejects_mismatched_checkpoints():
    params = make_params()
    opt = AdamW(params.values(), group_size=16)
    train(opt, params, make_grads(2))
    saved = opt.state_dict()

    with pytest.raises(ValueError, match="stored with .*'group_size': 16.*this optimizer uses .*'group_size': 32"):
        AdamW(clone_params(params).values(), group_size=32).load_state_dict(copy.deepcopy(saved))
    with pytest.raises(ValueError, match="'v_format': 'e4m3'.*this optimizer uses.*'v_format': 'e5m2'"):
        AdamW(clone_params(params).values(), group_size=16, v_format="e5m2").load_state_dict(copy.deepcopy(saved))

    torch_params = clone_params(params)
    torch_opt = torch.optim.AdamW(torch_params.values())
    train(torch_opt, torch_params, make_grads(1))
    with pytest.raises(ValueError, match="not the state of a coat.optim.AdamW.*load_torch_state_dict"):
        AdamW(clone_params(params).values()).load_state_dict(torch_opt.state_dict())

    reshaped = clone_params(params)
    reshaped["matrix"] = torch.nn.Parameter(torch.randn(40, 24))
    with pytest.raises(ValueError, match=r"'exp_avg'\] has shape \(24, 40\), expected \(40, 24\)"):
        AdamW(reshaped.values(), group_size=16).load_state_dict(copy.deepcopy(saved))

    cast = copy.deepcopy(saved)
    cast["state"][0]["exp_avg"] = cast["state"][0]["exp_avg"].float()
    with pytest.raises(ValueError, match="has dtype torch.float32, expected torch.float8_e4m3fn"):
        AdamW(clone_params(params).values(), group_size=16).load_state_dict(cast)

    with pytest.raises(ValueError, match="2 parameter groups, this optimizer has 1"):
        AdamW(clone_params(params).values(), group_size=16).load_state_dict(
            {"state": {}, "param_groups": [saved["param_groups"][0], saved["param_groups"][0]]}
        )


# --- conversion to and from torch.optim.AdamW ---------------------------------------------------------------


def test_torch_state_dict_switches_to_torch_adamw():
    grads = make_grads(12)
    params = make_params()
    opt = AdamW(params.values(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, group_size=32)
    train(opt, params, grads[:6])

    torch_params = clone_params(params)
    torch_opt = torch.optim.AdamW(torch_params.values())
    torch_opt.load_state_dict(opt.torch_state_dict())
    group = torch_opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.99), 0.1)
    assert "group_size" not in group and group["decoupled_weight_decay"]
    for name, p in params.items():
        torch_state = torch_opt.state[torch_params[name]]
        assert torch_state["step"].item() == 6
        for codes_key, meta_key in MOMENTS:
            assert torch.equal(torch_state[codes_key], dequantized(opt, p, codes_key, meta_key))

    train(opt, params, grads[6:])
    train(torch_opt, torch_params, grads[6:])
    for name in params:  # the bounds of test_tracks_torch_adamw_over_many_steps, over the 6 steps after the switch
        difference = (params[name] - torch_params[name]).abs()
        assert difference.mean().item() <= 0.03 * 6 * 1e-3 and difference.max().item() <= 0.15 * 6 * 1e-3, name


def test_load_torch_state_dict_switches_from_torch_adamw():
    grads = make_grads(12)
    torch_params = make_params()
    torch_opt = torch.optim.AdamW(torch_params.values(), lr=1e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=3, gamma=0.5)
    for step_grads in grads[:6]:
        train(torch_opt, torch_params, [step_grads])
        scheduler.step()

    params = clone_params(torch_params)
    opt = AdamW(params.values(), lr=1.0, group_size=16, v_format="e5m2")
    opt.load_torch_state_dict(torch_opt.state_dict())
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(2.5e-4) and group["initial_lr"] == 1e-3 and group["weight_decay"] == 0.05
    assert (group["group_size"], group["v_format"]) == (16, "e5m2")
    for name, p in params.items():
        torch_state, state = torch_opt.state[torch_params[name]], opt.state[p]
        assert state["step"].item() == 6 and state["step"].device.type == "cpu"
        for (codes_key, meta_key), fmt in zip(MOMENTS, ("e4m3", "e5m2")):
            moment = torch_state[codes_key]
            codes, meta = ops.quantize_expanded(moment.view(1) if moment.dim() == 0 else moment, 16, fmt)
            assert torch.equal(bits(state[codes_key]), bits(codes.view(moment.shape)))
            assert torch.equal(bits(state[meta_key]), bits(meta))

    train(opt, params, grads[6:])
    train(torch_opt, torch_params, grads[6:])
    for name in params:  # the bounds of test_tracks_torch_adamw_over_many_steps, over 6 steps
        difference = (params[name] - torch_params[name]).abs()
        assert difference.mean().item() <= 0.03 * 6 * 2.5e-4 and difference.max().item() <= 0.15 * 6 * 2.5e-4, name


def test_load_torch_state_dict_rejects_what_coat_does_not_implement():
    params = make_params()
    torch_opt = torch.optim.AdamW(params.values(), amsgrad=True)
    train(torch_opt, params, make_grads(1))
    with pytest.raises(ValueError, match="amsgrad=True"):
        AdamW(clone_params(params).values()).load_torch_state_dict(torch_opt.state_dict())
    adam = torch.optim.Adam(params.values(), weight_decay=0.1)
    with pytest.raises(ValueError, match="L2 weight decay"):
        AdamW(clone_params(params).values()).load_torch_state_dict(adam.state_dict())
