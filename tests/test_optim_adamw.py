"""coat.optim.AdamW as a drop-in for torch.optim.AdamW: the update, param groups, schedulers, state layout,
errors, state_dict round trips, conversion to and from torch.optim.AdamW state, low-precision parameters and
gradients, non-finite gradients. Single process; tests/test_optim_distributed.py covers FSDP and DCP."""
from __future__ import annotations

import copy
import gc
import math

import pytest
import torch

import coat
from coat import ops
from coat.optim import AdamW
from coat.optim import adamw as adamw_module

# Shapes with short last groups at G = 16 and 128, a 3-D tensor, a vector and a scalar.
SHAPES = {"matrix": (24, 40), "wide": (3, 300), "cube": (2, 3, 20), "vector": (50,), "scalar": ()}
MOMENTS = (("exp_avg", "exp_avg_meta"), ("exp_avg_sq", "exp_avg_sq_meta"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two, and keeps the run time steady on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for name, shape in SHAPES.items()
    }


def make_grads(steps: int, seed: int = 1, shapes: dict = SHAPES) -> list[dict[str, torch.Tensor]]:
    """Gaussian gradients times magnitudes spread over two decades within each group, as real ones are."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            name: torch.randn(shape, generator=generator) * 10 ** torch.empty(shape).uniform_(-2, 0, generator=generator)
            for name, shape in shapes.items()
        }
        for _ in range(steps)
    ]


def clone_params(params: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    return {name: torch.nn.Parameter(p.detach().clone()) for name, p in params.items()}


def train(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]],
          grad_dtype: torch.dtype | None = None) -> None:
    for step_grads in grads:
        for name, p in params.items():
            grad = step_grads[name].to(grad_dtype or p.dtype)
            if grad.dtype != p.dtype:
                p.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept it
            p.grad = grad
        opt.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so that comparisons are exact and NaN equals NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_run(params_a, opt_a, params_b, opt_b, names=None) -> None:
    for name in names or params_a:
        pa, pb = params_a[name], params_b[name]
        assert torch.equal(bits(pa.detach()), bits(pb.detach())), f"parameter {name} differs"
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa["step"].item() == sb["step"].item(), name
        for key in ("exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta"):
            assert torch.equal(bits(sa[key]), bits(sb[key])), f"state {key} of {name} differs"


def dequantized(opt: AdamW, p: torch.Tensor, codes_key: str, meta_key: str) -> torch.Tensor:
    state = opt.state[p]
    codes = state[codes_key]
    rows = codes.view(1) if codes.dim() == 0 else codes
    group_size = opt.param_groups[0]["group_size"]
    return ops.dequantize_expanded(rows, state[meta_key], group_size).view(codes.shape)


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
