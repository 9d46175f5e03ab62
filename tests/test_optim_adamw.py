"""coat.optim.AdamW as a drop-in for torch.optim.AdamW: the update, param groups, schedulers, state layout,
errors, the CUDA step. Single process; tests/test_optim_adamw_state_dict.py covers state_dict round trips and the
conversion to and from torch.optim.AdamW state, tests/test_optim_adamw_low_precision.py low-precision parameters
and gradients and non-finite gradients, tests/test_optim_distributed.py FSDP and DCP."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import coat
from coat.optim import AdamW
from coat.optim import adamw as adamw_module
from optim_helpers import (
    MOMENTS,
    SHAPES,
    assert_same_run,
    bits,
    dequantized,
    make_grads,
    make_params,
    one_thread,  # noqa: F401  (the autouse fixture: pytest finds it in this module)
    train,
)


# --- the update ---------------------------------------------------------------------------------------------


def test_first_step_matches_torch_adamw():
    # From zero moments, step 1 updates with the unquantized m and v: the parameters agree with torch's to a
    # few float32 roundings (torch's (1 - beta1) is rounded from float64, coat's computed in float32).
    params, torch_params = make_params(), make_params()
    grads = make_grads(1)
    options = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    train(AdamW(params.values(), **options), params, grads)
    train(torch.optim.AdamW(torch_params.values(), foreach=False, **options), torch_params, grads)
    for name in params:
        torch.testing.assert_close(params[name], torch_params[name], rtol=1e-6, atol=1e-7, msg=name)


def test_step_from_quantized_state_matches_float64_formula():
    # Step t = 6 from the stored FP8 moments, against the paper's formula in float64 with torch's host
    # scalars at t = 6: checks the bias corrections, the decay and the step count kept on the host.
    params, grads = make_params(), make_grads(6)
    lr, (beta1, beta2), eps, weight_decay = 3e-3, (0.85, 0.99), 1e-8, 0.05
    opt = AdamW(params.values(), lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, group_size=16)
    train(opt, params, grads[:5])
    before = {name: p.detach().double().clone() for name, p in params.items()}
    m_before = {name: dequantized(opt, p, *MOMENTS[0]).double() for name, p in params.items()}
    v_before = {name: dequantized(opt, p, *MOMENTS[1]).double() for name, p in params.items()}
    train(opt, params, grads[5:])
    t = 6
    for name, p in params.items():
        g = grads[5][name].double()
        m = beta1 * m_before[name] + (1 - beta1) * g
        v = beta2 * v_before[name] + (1 - beta2) * g * g
        update = lr / (1 - beta1**t) * m / (v.sqrt() / math.sqrt(1 - beta2**t) + eps)
        expected = before[name] * (1 - lr * weight_decay) - update
        # float32 arithmetic: a few ulp of the parameter plus 1e-5 of the update
        tolerance = 4 * 2**-23 * before[name].abs() + 1e-5 * update.abs()
        assert ((p.detach().double() - expected).abs() <= tolerance).all(), name
    assert opt.state[params["matrix"]]["step"].item() == t


def test_tracks_torch_adamw_over_many_steps():
    # Gradients = a steady direction per element (Gaussian, one scale per row, rows spread over two decades)
    # plus 30% Gaussian noise, so that Adam moves every element by about lr per step. coat's step differs from
    # torch's only through the FP8 rounding of m and v: at most 2^-4 (m) + 2^-5 (v, through the square root)
    # relative for an element in E4M3's normal range, unbiased, so 3% of N * lr on average over the elements.
    # The smallest elements of a group land in E4M3's subnormals after expansion, with 1 to 3 significant
    # bits: they may drift up to 15% of N * lr. Both runs move elements by more than 0.5 * N * lr.
    steps, lr = 40, 1e-3
    generator = torch.Generator().manual_seed(5)
    direction = {
        name: torch.randn(shape, generator=generator)
        * 10 ** torch.empty((*shape[:-1], 1) if shape else ()).uniform_(-3, -1, generator=generator)
        for name, shape in SHAPES.items()
    }
    grads = [
        {name: d + 0.3 * d.abs().mean() * torch.randn(d.shape, generator=generator) for name, d in direction.items()}
        for _ in range(steps)
    ]
    params, torch_params = make_params(), make_params()
    train(AdamW(params.values(), lr=lr, weight_decay=0.1), params, grads)
    train(torch.optim.AdamW(torch_params.values(), lr=lr, weight_decay=0.1), torch_params, grads)
    start = make_params()
    for name in params:
        moved = (torch_params[name] - start[name]).abs().max().item()
        difference = (params[name] - torch_params[name]).abs()
        assert moved > 0.5 * steps * lr, (name, moved)
        assert difference.mean().item() <= 0.03 * steps * lr, (name, difference.mean().item())
        assert difference.max().item() <= 0.15 * steps * lr, (name, difference.max().item())


# --- state layout -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [16, 128])
@pytest.mark.parametrize(
    "m_format, v_format, m_dtype, v_dtype",
    [
        ("e4m3", "e4m3", torch.float8_e4m3fn, torch.float8_e4m3fn),
        ("e4m3", "e5m2", torch.float8_e4m3fn, torch.float8_e5m2),
        (torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fn),
    ],
)
def test_state_layout(group_size, m_format, v_format, m_dtype, v_dtype):
    params = make_params()
    opt = AdamW(params.values(), group_size=group_size, m_format=m_format, v_format=v_format)
    train(opt, params, make_grads(2))
    group = opt.param_groups[0]
    names = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    assert (group["m_format"], group["v_format"]) == (names[m_dtype], names[v_dtype])  # stored by name
    for name, p in params.items():
        state = opt.state[p]
        assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32 and state["step"].item() == 2
        shape = p.shape or (1,)
        meta_shape = (*shape[:-1], -(-shape[-1] // group_size), 3)
        for (codes_key, meta_key), dtype in zip(MOMENTS, (m_dtype, v_dtype)):
            assert state[codes_key].dtype == dtype and state[codes_key].shape == p.shape, name
            assert state[meta_key].dtype == torch.bfloat16 and tuple(state[meta_key].shape) == meta_shape, name
        assert (dequantized(opt, p, *MOMENTS[1]) > 0).any(), name


@pytest.mark.parametrize("expand, expected", [(True, (True, True)), (False, (False, False)), ((False, True), (False, True))])
def test_expand_is_set_per_moment(expand, expected):
    params = make_params()
    opt = AdamW(params.values(), expand=expand)
    train(opt, params, make_grads(3))
    assert opt.param_groups[0]["expand"] == expected
    meta = opt.state[params["matrix"]]
    for (_, meta_key), expanded in zip(MOMENTS, expected):
        k, c = meta[meta_key][..., 1], meta[meta_key][..., 2]
        # Without expansion every group has k = C = 1; with it, the gradients' four decades give k != 1.
        assert bool((k != 1).any()) == expanded and bool((c != 1).any()) == expanded, meta_key


def test_state_bytes_per_parameter():
    p = torch.nn.Parameter(torch.randn(256, 1024))
    opt = AdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state_bytes = sum(t.numel() * t.element_size() for t in opt.state[p].values())
    # codes 1 + 1 byte, meta 2 * 3 * 2 bytes per 128 elements, plus the 4-byte step
    assert state_bytes == 2 * p.numel() + 2 * 3 * 2 * p.numel() // 128 + 4
    assert state_bytes / p.numel() <= 2.1


# --- drop-in behaviour --------------------------------------------------------------------------------------


def test_param_groups_use_their_own_options():
    first = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2, group_size=16, m_format="e5m2", expand=False)
    second = dict(lr=3e-3, weight_decay=0.0, v_format="e5m2", expand=(True, False))
    grads = make_grads(5)
    params = make_params()
    names = list(params)
    opt = AdamW(
        [{"params": [params[n] for n in names[:2]], **first}, {"params": [params[n] for n in names[2:]], **second}],
        lr=5e-4,
    )
    train(opt, params, grads)
    separate = make_params()
    first_opt = AdamW([separate[n] for n in names[:2]], **first)
    second_opt = AdamW([separate[n] for n in names[2:]], **second)
    for step_grads in grads:
        for name, p in separate.items():
            p.grad = step_grads[name]
        first_opt.step()
        second_opt.step()
    assert_same_run(params, opt, separate, first_opt, names[:2])
    assert_same_run(params, opt, separate, second_opt, names[2:])


def test_lr_scheduler_drives_the_step():
    grads = make_grads(6)
    params, manual = make_params(), make_params()
    opt = AdamW(params.values(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    manual_opt = AdamW(manual.values(), lr=1e-2)
    for step, step_grads in enumerate(grads):
        for name in params:
            params[name].grad = step_grads[name]
            manual[name].grad = step_grads[name]
        manual_opt.param_groups[0]["lr"] = 1e-2 * 0.5**step
        opt.step()
        scheduler.step()
        manual_opt.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**6)
    assert_same_run(params, opt, manual, manual_opt)


def test_one_cycle_scheduler_cycles_betas():
    # OneCycleLR moves beta1 along with lr: the step must read both from the group each time. A replay that
    # sets the same lr and betas by hand matches exactly; one that follows only the lr does not.
    grads = make_grads(5)
    params, replayed, lr_only = make_params(), make_params(), make_params()
    opt = AdamW(params.values(), lr=1e-3)
    replay_opt, lr_only_opt = AdamW(replayed.values(), lr=1e-3), AdamW(lr_only.values(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    for step_grads in grads:
        replay_opt.param_groups[0]["lr"] = lr_only_opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
        replay_opt.param_groups[0]["betas"] = opt.param_groups[0]["betas"]
        for name in params:
            params[name].grad = replayed[name].grad = lr_only[name].grad = step_grads[name]
        opt.step()
        scheduler.step()
        replay_opt.step()
        lr_only_opt.step()
    assert_same_run(params, opt, replayed, replay_opt)
    assert not torch.equal(params["matrix"], lr_only["matrix"])


def test_add_param_group_later_runs_it_from_step_one():
    grads = make_grads(5)
    params, separate = make_params(), make_params()
    names = list(params)
    opt = AdamW([params[n] for n in names[:3]], lr=1e-2)
    first_opt = AdamW([separate[n] for n in names[:3]], lr=1e-2)
    second_opt = AdamW([separate[n] for n in names[3:]], lr=2e-2, group_size=32)
    for step, step_grads in enumerate(grads):
        if step == 2:
            opt.add_param_group({"params": [params[n] for n in names[3:]], "lr": 2e-2, "group_size": 32})
        for name in names:
            params[name].grad = step_grads[name] if step >= 2 or name in names[:3] else None
            separate[name].grad = step_grads[name]
        opt.step()
        first_opt.step()
        if step >= 2:
            second_opt.step()
    assert_same_run(params, opt, separate, first_opt, names[:3])
    assert_same_run(params, opt, separate, second_opt, names[3:])
    assert opt.state[params[names[3]]]["step"].item() == 3


def test_params_without_grad_keep_their_own_step_count():
    # A parameter skipped on some steps lags in step count inside the same group: it must get its own bias
    # corrections, exactly as if it had an optimizer of its own.
    grads = make_grads(6)
    params, separate = make_params(), make_params()
    opt = AdamW(params.values(), lr=1e-2)
    main_opt = AdamW([p for n, p in separate.items() if n != "vector"], lr=1e-2)
    vector_opt = AdamW([separate["vector"]], lr=1e-2)
    for step, step_grads in enumerate(grads):
        vector_has_grad = step % 2 == 0
        for name in params:
            has_grad = name != "vector" or vector_has_grad
            params[name].grad = step_grads[name] if has_grad else None
            separate[name].grad = step_grads[name] if has_grad else None
        opt.step()
        main_opt.step()
        if vector_has_grad:
            vector_opt.step()
    assert opt.state[params["vector"]]["step"].item() == 3
    assert_same_run(params, opt, separate, main_opt, [n for n in params if n != "vector"])
    assert_same_run(params, opt, separate, vector_opt, ["vector"])


def test_a_default_device_context_leaves_the_step_counts_on_the_cpu():
    """A training loop under torch.set_default_device("cuda") (or `with torch.device(...)`): the step counts
    stay CPU tensors, read every step without synchronizing a GPU, also after a state_dict round trip. The
    meta device stands in for the GPU: a count made there could not be read at all."""
    grads = make_grads(2)
    params, reference = make_params(), make_params()
    opt, reference_opt = AdamW(params.values(), lr=1e-2), AdamW(reference.values(), lr=1e-2)
    for step_grads in grads:
        for name in params:
            params[name].grad, reference[name].grad = step_grads[name], step_grads[name]
        with torch.device("meta"):
            opt.step()
            opt.load_state_dict(opt.state_dict())
        reference_opt.step()
    assert all(state["step"].device.type == "cpu" and state["step"].item() == 2 for state in opt.state.values())
    assert_same_run(params, opt, reference, reference_opt, list(params))
    with torch.device("meta"):
        assert AdamW([torch.zeros(3, requires_grad=True, device="cpu")]).clip_grad_norm_(1.0).device.type == "cpu"


def test_groups_larger_than_one_kernel_call_step_like_separate_optimizers():
    # A group's step enqueues the kernel for 2 parameters, then 32 at a time (the GPU starts while the host
    # prepares the rest). Every parameter must still step as with an optimizer of its own, a lagging step count included, and a
    # bad gradient anywhere must be refused before any parameter changes.
    torch.manual_seed(0)
    count = 2 * adamw_module._PARAMS_PER_CALL + 5
    params = [torch.nn.Parameter(torch.randn(3, 16)) for _ in range(count)]
    alone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = AdamW(params, lr=1e-2)
    alone_opts = [AdamW([p], lr=1e-2) for p in alone]
    lagging = count - 3  # in the last slice; it has no gradient on odd steps
    for step in range(4):
        for i, (p, q) in enumerate(zip(params, alone)):
            grad = None if i == lagging and step % 2 else torch.randn(3, 16)
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        opt.step()
        for q, q_opt in zip(alone, alone_opts):
            if q.grad is not None:
                q_opt.step()
    for p, q in zip(params, alone):
        assert torch.equal(bits(p), bits(q))
    assert opt.state[params[lagging]]["step"].item() == 2

    before = [bits(p).clone() for p in params]
    for p in params:
        p.grad = torch.randn(3, 16)
    params[-1].grad_dtype = None
    params[-1].grad = torch.randn(3, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 gradients"):
        opt.step()
    assert all(torch.equal(bits(p), b) for p, b in zip(params, before))


def test_zero_grad_and_closure():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)), torch.randn(32, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = copy.deepcopy(model.state_dict())
    steps_before = [opt.state[p]["step"].item() for p in model.parameters()]
    opt.step()  # no gradients: nothing moves, no step is counted
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [opt.state[p]["step"].item() for p in model.parameters()] == steps_before


def test_empty_and_zero_dim_parameters():
    empty, scalar = torch.nn.Parameter(torch.empty(0, 7)), torch.nn.Parameter(torch.tensor(1.5))
    opt = AdamW([empty, scalar], lr=0.1, weight_decay=0.0)
    for _ in range(3):
        empty.grad, scalar.grad = torch.empty(0, 7), torch.tensor(2.0)
        opt.step()
    assert opt.state[empty]["exp_avg"].shape == (0, 7) and opt.state[empty]["exp_avg_meta"].shape == (0, 1, 3)
    assert opt.state[scalar]["exp_avg"].shape == () and opt.state[scalar]["exp_avg_meta"].shape == (1, 3)
    # a constant gradient makes m / sqrt(v) = 1 after bias correction: three steps of lr
    assert scalar.item() == pytest.approx(1.5 - 3 * 0.1, abs=1e-3)


def test_fp8_moments_are_the_state_as_rows():
    """What coat.report reads: each moment's codes (a 0-d parameter as one row of one element) and meta."""
    matrix, scalar, empty = (torch.nn.Parameter(t) for t in (torch.randn(4, 300), torch.tensor(1.5), torch.empty(0, 7)))
    opt = AdamW([matrix, scalar, empty], lr=0.1)
    assert opt.fp8_moments(matrix) == {}
    matrix.grad, scalar.grad, empty.grad = torch.randn(4, 300), torch.tensor(2.0), torch.empty(0, 7)
    opt.step()
    moments = opt.fp8_moments(matrix)
    assert list(moments) == ["m", "v"]
    assert moments["m"][0] is opt.state[matrix]["exp_avg"] and moments["v"][1] is opt.state[matrix]["exp_avg_sq_meta"]
    (codes, meta), _ = opt.fp8_moments(scalar).values()
    assert codes.shape == (1,) and codes.data_ptr() == opt.state[scalar]["exp_avg"].data_ptr() and meta.shape == (1, 3)
    assert opt.fp8_moments(empty) == {}


# --- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option",
    [
        {"amsgrad": True},
        {"maximize": True},
        {"foreach": True},
        {"foreach": False},
        {"fused": True},
        {"capturable": True},
        {"differentiable": True},
    ],
)
def test_unsupported_torch_features_raise(option):
    (name, value), = option.items()
    with pytest.raises(ValueError, match=f"does not support {name}={value}.*supports amsgrad=False"):
        AdamW([torch.nn.Parameter(torch.randn(4))], **option)
    opt = AdamW([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(ValueError, match=f"does not support {name}={value}"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], **option})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    "option, message",
    [
        ({"group_size": 8}, "group_size must be one of"),
        ({"m_format": "e3m4"}, "unsupported FP8 format"),
        ({"v_format": torch.float16}, "unsupported FP8 format"),
        ({"expand": "yes"}, "expand must be a bool or a"),
        ({"expand": (True,)}, "expand must be a bool or a"),
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "1-element CPU tensor"),
        ({"betas": (1.0, 0.9)}, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
        ({"eps": -1.0}, "Invalid epsilon"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"param_rounding": "up"}, "param_rounding must be one of"),
        ({"rounding_seed": 1.5}, "rounding_seed must be an integer"),
        ({"fp8_grads": "e3m4"}, "unsupported FP8 format"),
    ],
)
def test_invalid_options_raise(option, message):
    with pytest.raises(ValueError, match=message):
        AdamW([torch.nn.Parameter(torch.randn(4))], **option)


@pytest.mark.parametrize(
    "param, message",
    [
        (torch.nn.Parameter(torch.randn(4, dtype=torch.complex64)), "complex parameters"),
        (torch.nn.Parameter(torch.ones(4, dtype=torch.int64), requires_grad=False), "got a torch.int64 parameter"),
        (torch.nn.Parameter(torch.randn(4, dtype=torch.float16)), r"got a torch.float16 parameter .*model.float\(\)"),
        (torch.nn.Parameter(torch.randn(4, dtype=torch.float64)), "got a torch.float64 parameter"),
    ],
)
def test_unsupported_parameters_raise(param, message):
    with pytest.raises(ValueError, match=message):
        AdamW([param])


def test_unsupported_gradients_and_layouts_raise():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW(embedding.parameters())
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()

    transposed = torch.nn.Parameter(torch.randn(6, 4).t())
    opt = AdamW([transposed])
    transposed.grad = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="updates contiguous parameters"):
        opt.step()

    p = torch.nn.Parameter(torch.randn(4))
    opt = AdamW([p])
    p.grad_dtype = None
    p.grad = torch.randn(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 gradients"):
        opt.step()


# --- CUDA ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and coat.built_with_cuda()), reason="no CUDA"
)


@needs_cuda
def test_cuda_matches_cpu_within_tolerance():
    """The CUDA step uses the GPU's fast arithmetic (csrc/cuda/adamw_step.cu; tests/test_adamw_ops.py checks each step
    against the C core's within its stated tolerance). Over 5 free-running steps the two runs drift apart only
    where an FP8 code or a bf16 meta value landed on the other side of a rounding boundary, which moves that
    element's update by a few %: parameters within 0.1 lr per step of each other, the median within 1e-5 lr per
    step, the median relative difference of the dequantized moments below 1e-4. Two CUDA runs give the same
    bits."""
    steps, lr = 5, 1e-2
    grads = make_grads(steps)
    cpu_params = make_params()
    cpu_opt = AdamW(cpu_params.values(), lr=lr, group_size=32, v_format="e5m2")
    train(cpu_opt, cpu_params, grads)
    runs = []
    for _ in range(2):
        cuda_params = {n: torch.nn.Parameter(p.detach().cuda()) for n, p in make_params().items()}
        cuda_opt = AdamW(cuda_params.values(), lr=lr, group_size=32, v_format="e5m2")
        train(cuda_opt, cuda_params, [{n: g.cuda() for n, g in step.items()} for step in grads])
        runs.append((cuda_params, cuda_opt))
    (first, first_opt), (second, second_opt) = runs
    for name in first:
        assert torch.equal(bits(first[name].detach()), bits(second[name].detach())), f"{name}: two CUDA runs differ"
        for key in ("exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta"):
            assert torch.equal(bits(first_opt.state[first[name]][key]), bits(second_opt.state[second[name]][key]))
    difference = torch.cat([(first[n].detach().cpu() - p.detach()).abs().flatten() for n, p in cpu_params.items()])
    assert difference.max() <= 0.1 * lr * steps and difference.median() <= 1e-5 * lr * steps
    for codes_key, meta_key in MOMENTS:
        cuda_moment = torch.cat([dequantized(first_opt, first[n], codes_key, meta_key).cpu().flatten() for n in first])
        cpu_moment = torch.cat([dequantized(cpu_opt, p, codes_key, meta_key).flatten() for p in cpu_params.values()])
        relative = (cuda_moment - cpu_moment).abs() / cpu_moment.abs().clamp(min=1e-30)
        assert relative.median() <= 1e-4, codes_key


@needs_cuda
def test_cuda_step_never_synchronizes():
    params = {n: torch.nn.Parameter(p.detach().cuda()) for n, p in make_params().items()}
    opt = AdamW(params.values(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    grads = [{n: g.cuda() for n, g in step.items()} for step in make_grads(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step_grads in grads:  # the first step also creates the state
            for name, p in params.items():
                p.grad = step_grads[name]
            opt.step()
            scheduler.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.state[params["matrix"]]["step"].item() == 3
