"""coat.report: each metric against a float64 reference computed here from the same tensors, on crafted inputs
(exact zeros, values flushed below the smallest FP8 subnormal, values clipped by a stale scale, NaN and Inf),
the names and values the report gives a converted Llama's tensors and optimizer moments, its dict, CSV and
heat map, that nothing is recorded outside a capture, captures of a compiled model, and errors."""
import copy
import math

import pytest
import torch
from torch import nn

import coat
from coat.nn import _capture
from conftest import requires_cuda
from optim_helpers import tiny_llama

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

E4M3_CLIP, E5M2_CLIP = 464.0, 61440.0  # FP8_MAX + half the top step: rounding to nearest would go past FP8_MAX


def reference_stats(x, q, scale, group_size=None, clip=E4M3_CLIP):
    """The metrics in float64, from the codes' values times their scales: the exact product rounded once to
    float32, the dequantized value the layers compute with (and the report's definition of Q(x))."""
    x = x.double()
    if group_size is not None:
        scale = scale.repeat_interleave(group_size, dim=-1)[..., : x.shape[-1]]
    scale = scale.double()
    dequantized = (q.double() * scale).float().double()
    finite = x.isfinite() & dequantized.isfinite()
    x, dequantized, scale = x[finite], dequantized[finite], scale.expand(finite.shape)[finite]
    if x.numel() == 0:
        rel_error = math.nan
    else:
        rel_error = (dequantized - x).norm().item() / x.norm().item() if x.norm() > 0 else 0.0
    return {
        "numel": finite.numel(),
        "nonfinite": 1 - finite.sum().item() / finite.numel(),
        "amax": x.abs().max().item() if x.numel() else 0.0,
        "flushed": ((x != 0) & (dequantized == 0)).sum().item() / x.numel() if x.numel() else math.nan,
        "saturated": ((x / scale).abs() >= clip).sum().item() / x.numel() if x.numel() else math.nan,
        "rel_error": rel_error,
    }


def assert_stats_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if math.isnan(value):
            assert math.isnan(actual[key]), key
        else:
            # Sums in another order than the report's: the last bits may differ.
            assert actual[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


# ---------------------------------------------------------------------------------------------- metrics


def test_per_tensor_metrics_on_crafted_values():
    # amax 448 gives scale 1: 2^-11 is below E4M3's smallest subnormal 2^-9 (flushed), 2^-9 is kept, 0 is
    # exact and not counted as flushed, 1.0625 rounds to 1 or 1.125.
    x = torch.tensor([[448.0, 2.0**-11, -(2.0**-11), 2.0**-9, 0.0, 1.0625, -3.3, 100.0]])
    q, scale, _ = coat.ops.quantize_tensor(x, "e4m3")
    stats = coat.report.tensor_stats(x, q, scale)
    assert stats["flushed"] == 2 / 8 and stats["saturated"] == 0 and stats["nonfinite"] == 0
    assert stats["amax"] == 448.0
    assert_stats_equal(stats, reference_stats(x, q, scale))


def test_per_tensor_metrics_on_random_values(rng):
    x = torch.randn(64, 96, generator=rng).bfloat16() * torch.logspace(-6, 2, 96).bfloat16()
    for fp8, clip in (("e4m3", E4M3_CLIP), ("e5m2", E5M2_CLIP)):
        q, scale, _ = coat.ops.quantize_tensor(x, fp8)
        stats = coat.report.tensor_stats(x, q, scale)
        assert 0 < stats["flushed"] < 1 and 0 < stats["rel_error"] < 0.2
        assert_stats_equal(stats, reference_stats(x, q, scale, clip=clip))


def test_saturation_counts_values_clipped_by_a_stale_scale(rng):
    """A scale from an amax below the tensor's (as when a scale is reused): values past FP8_MAX + half a
    step are clipped; 460 / 1 rounds to 448 anyway and is not counted."""
    x = torch.tensor([[460.0, 470.0, -1000.0, 10.0, 448.0, 2.0]])
    q, scale, _ = coat.ops.quantize_tensors([x], "e4m3", dim=0, amax=torch.tensor(448.0))
    stats = coat.report.tensor_stats(x, q, scale)
    assert stats["saturated"] == 2 / 6
    assert_stats_equal(stats, reference_stats(x, q, scale))


def test_nan_and_inf_are_counted_apart():
    # A NaN element stays NaN and leaves the rest alone; an Inf makes the scale Inf and the whole tensor NaN.
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5]])
    q, scale, _ = coat.ops.quantize_tensor(x, "e4m3")
    stats = coat.report.tensor_stats(x, q, scale)
    assert stats["nonfinite"] == 0.25 and math.isfinite(stats["rel_error"]) and stats["amax"] == 2.0
    assert_stats_equal(stats, reference_stats(x, q, scale))

    x = torch.tensor([[1.0, float("inf"), -2.0, 0.5]])
    q, scale, _ = coat.ops.quantize_tensor(x, "e4m3")
    stats = coat.report.tensor_stats(x, q, scale)
    assert stats["nonfinite"] == 1.0
    assert math.isnan(stats["flushed"]) and math.isnan(stats["saturated"]) and math.isnan(stats["rel_error"])


def test_group_metrics_on_crafted_groups(rng):
    """1 x 16 groups, as RMSNorm and SiLU*mul save their inputs: an all-zero group (exact, nothing flushed),
    a group whose small values fall below its scale's subnormals, an Inf group (NaN as a whole), random ones."""
    x = torch.randn(4, 64, generator=rng)
    x[0, :16] = 0
    x[1, 16:32] = 1e-6
    x[1, 16] = 1.0  # scale 1/448: 1e-6 * 448 is below E4M3's smallest subnormal
    x[2, 40] = float("inf")
    q, scales, _ = coat.ops.quantize_group(x, 16, "e4m3")
    stats = coat.report.tensor_stats(x, q, scales, group_size=16)
    assert stats["nonfinite"] == 16 / 256
    assert stats["flushed"] == 15 / 240
    assert_stats_equal(stats, reference_stats(x, q, scales, group_size=16))

    zeros = torch.zeros(2, 32)
    q, scales, _ = coat.ops.quantize_group(zeros, 16)
    stats = coat.report.tensor_stats(zeros, q, scales, group_size=16)
    assert stats["rel_error"] == 0 and stats["flushed"] == 0 and stats["amax"] == 0


def test_tensor_stats_explains_bad_input():
    x = torch.randn(4, 16)
    q, scale, _ = coat.ops.quantize_tensor(x)
    with pytest.raises(ValueError, match="one shape"):
        coat.report.tensor_stats(x[:2], q, scale)
    with pytest.raises(TypeError, match="FP8 codes"):
        coat.report.tensor_stats(x, x, scale)


# ---------------------------------------------------------------------------------------------- a model


LAYER_TENSORS = [
    "attn_norm_input", "qkv_input", "qkv_weight", "o_input", "o_weight", "mlp_norm_input", "gate_up_input",
    "gate_up_weight", "gate_output", "up_output", "down_input", "down_weight",
    "down_grad_output", "gate_up_grad_output", "o_grad_output", "qkv_grad_output",
]


def tokens(seed=0, batch=2, length=24):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def train_step(model, optimizer, batch):
    model(batch, labels=batch).loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def model():
    return coat.convert(tiny_llama(seed=0))


def test_capture_names_every_quantized_tensor_of_each_layer(model):
    report = coat.report.QuantizationReport(model)
    with report.capture(step=7):
        train_step(model, None, tokens())
    rows = report.rows()
    assert {row["step"] for row in rows} == {7}
    for layer in ("model.layers.0", "model.layers.1"):
        assert [row["tensor"] for row in rows if row["layer"] == layer] == LAYER_TENSORS
    for row in rows:
        grad = row["tensor"].endswith("grad_output")
        assert row["format"] == ("e5m2" if grad else "e4m3")
        assert row["nonfinite"] == 0 and row["saturated"] == 0  # scales from each tensor's own amax
        assert 0.005 < row["rel_error"] < (0.08 if grad else 0.04)  # E5M2 / E4M3 round to 2 / 3 mantissa bits

    stats = report.stats()
    assert len(stats) == len(rows) * len(coat.report.TENSOR_METRICS)
    assert all(type(value) is float for value in stats.values())
    assert stats["model.layers.1/down_input/rel_error"] == next(
        row["rel_error"] for row in rows if row["layer"] == "model.layers.1" and row["tensor"] == "down_input")
    layer, tensor, value = report.worst("rel_error")
    assert tensor.endswith("grad_output") and value == max(row["rel_error"] for row in rows)


def test_each_capture_reports_its_own_step(model):
    """The sums a capture adds into are kept for the next one and zeroed when it starts: a second capture of the
    same step gives the same rows, and a capture that records fewer tensors (forward only) reports only those, in
the order of that capture's own layout."""
    report = coat.report.QuantizationReport(model)
    with report.capture():
        train_step(model, None, tokens())
    first = report.rows()
    with report.capture():
        model(tokens(), labels=tokens()).loss.detach()
    forward_only = report.rows()
    assert [row["tensor"] for row in forward_only if row["layer"] == "model.layers.0"] == LAYER_TENSORS[:12]
    forward_rows = {(row["layer"], row["tensor"]): row for row in forward_only}
    for row in first:
        if (row["layer"], row["tensor"]) in forward_rows:
            assert forward_rows[(row["layer"], row["tensor"])] == {**row, "step": 2}
    with report.capture():
        train_step(model, None, tokens())
    assert report.rows() == [{**row, "step": 3} for row in first]
    with report.capture():  # the same tensors again: the layout of the last capture, rows of their own
        train_step(model, None, tokens())
    assert report.rows() == [{**row, "step": 4} for row in first]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_backward_that_creates_a_graph_is_measured_alike(model):
    """With create_graph=True gradients stay on inside backward; the measuring turns them off itself and records
    what a plain backward records."""
    report = coat.report.QuantizationReport(model)

    def captured_rows(create_graph: bool) -> list[dict]:
        with report.capture(step=1):
            model(tokens(), labels=tokens()).loss.backward(create_graph=create_graph)
        model.zero_grad(set_to_none=True)
        return report.rows()

    assert captured_rows(create_graph=True) == captured_rows(create_graph=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_results_read_later_are_the_captured_steps(device):
    """The capture's end does not wait for its values: steps run before the first read (which reuse the memory
    the step freed) leave them as they were, and a second capture begun before any read finishes the first's
    copy before zeroing the sums it was copied from."""
    model = coat.convert(tiny_llama(seed=0)).to(device)
    report = coat.report.QuantizationReport(model)
    batch = tokens().to(device)
    with report.capture():
        train_step(model, None, batch)
    for seed in (1, 2):
        train_step(model, None, tokens(seed=seed).to(device))
    read_later = report.rows()
    with report.capture():
        train_step(model, None, batch)
    read_at_once = report.rows()
    # The same weights and batch (no optimizer): the same sums, bit for bit on the CPU, within 1e-6 on a GPU.
    tolerance = {} if device == "cpu" else {"rel": 1e-6}

    def as_step(rows, step):
        return [{**row, "step": step, **{metric: pytest.approx(row[metric], **tolerance)
                                         for metric in coat.report.TENSOR_METRICS}} for row in rows]

    assert read_later == as_step(read_at_once, 1)
    with report.capture():
        train_step(model, None, tokens(seed=3).to(device))
    with report.capture():  # starts before the previous capture was read
        train_step(model, None, batch)
    assert report.rows() == as_step(read_at_once, 4)


@requires_cuda
def test_the_capture_end_does_not_wait_for_the_gpu():
    """A GPU-bound loop keeps the GPU busy through a capture: its end returns while the GPU still runs the
    step (here held back by a sleep kernel of about half a second), and the first read waits for it. The first
    capture is not timed: allocating its buffers (device and pinned host memory) may wait for the GPU. SDPA
    attention: transformers' eager attention mask copies a scalar from host memory, which waits for the GPU."""
    model = coat.convert(tiny_llama(seed=0, attention="sdpa")).cuda()
    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-3)
    report = coat.report.QuantizationReport(model, optimizer)
    batch = tokens().cuda()  # before the sleep: a copy from pageable host memory waits for the GPU
    with report.capture():
        train_step(model, optimizer, batch)
    report.stats()
    torch.cuda.synchronize()
    with report.capture():
        torch.cuda._sleep(1_000_000_000)
        train_step(model, optimizer, batch)
    ended = torch.cuda.Event()
    ended.record()
    assert not ended.query()  # the GPU is still sleeping, and the capture has ended
    stats = report.stats()
    assert stats and all(math.isfinite(value) for value in stats.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_a_capture_inside_a_default_device_context(device):
    """A training loop under torch.set_default_device or `with torch.device(...)`: the capture's own tensors
    (the pinned host copy on a GPU, the optimizer's step counts) go where they belong, not to the default
    device (the meta device here, where nothing could be read)."""
    model = coat.convert(tiny_llama(seed=0)).to(device)
    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-3)
    report = coat.report.QuantizationReport(model, optimizer)
    batch = tokens().to(device)
    with torch.device("meta"):
        with report.capture():
            train_step(model, optimizer, batch)
    assert {row["tensor"] for row in report.rows() if row["layer"] == "model.layers.0"} >= set(LAYER_TENSORS)
    assert all(math.isfinite(value) for value in report.stats().values())


def test_kept_inputs_are_reported_in_their_format_and_each_layer_climbs_4_6_8_bits():
    """With saved_format="fp4" the kept inputs are measured in FP4 (about 0.094 relative error on Gaussian data,
    tests/test_block_formats.py); choose_saved_formats keeps FP4 where every kept input of a layer is within the
    bound and moves the other layer to FP6; the next capture measures that layer in FP6 (about 0.02), and a
    layer that fails there goes to E4M3, where it stays."""
    model = coat.convert(tiny_llama(seed=0), saved_format="fp4")
    layers = model.model.layers
    report = coat.report.QuantizationReport(model)
    with report.capture(step=1):
        train_step(model, None, tokens())
    kept = [row for row in report.rows() if row["tensor"] in coat.report.KEPT_INPUTS]
    assert len(kept) == 8 and {row["format"] for row in kept} == {"fp4"}
    assert all(0.03 < row["rel_error"] < 0.2 for row in kept)
    others = [row for row in report.rows() if row not in kept]
    assert {row["format"] for row in others} == {"e4m3", "e5m2"}

    worst = {layer: max(row["rel_error"] for row in kept if row["layer"] == layer)
             for layer in ("model.layers.0", "model.layers.1")}
    failing = max(worst, key=worst.get)
    passing = min(worst, key=worst.get)
    expected = {failing: "fp6", passing: "fp4"}
    assert report.choose_saved_formats(max_rel_error=sum(worst.values()) / 2) == expected
    assert {f"model.layers.{i}": layer.fp8_config.saved_format for i, layer in enumerate(layers)} == expected

    with report.capture(step=2):
        train_step(model, None, tokens(seed=1))
    kept = [row for row in report.rows() if row["tensor"] in coat.report.KEPT_INPUTS]
    assert {(row["layer"], row["format"]) for row in kept} == set(expected.items())
    fp6_errors = [row["rel_error"] for row in kept if row["format"] == "fp6"]
    fp4_errors = [row["rel_error"] for row in kept if row["format"] == "fp4"]
    assert max(fp6_errors) < 0.05 < min(fp4_errors)  # two more mantissa bits: about a quarter of the error
    # A bound above every error: both layers keep their formats. One between the formats' errors: the FP4 layer
    # goes to FP6, the FP6 layer stays. One below both: each goes one step wider, FP4 to FP6 and FP6 to E4M3.
    assert report.choose_saved_formats(max_rel_error=max(fp4_errors)) == expected
    assert report.choose_saved_formats(max_rel_error=0.05) == {failing: "fp6", passing: "fp6"}
    assert report.choose_saved_formats(max_rel_error=0.0) == {failing: "e4m3", passing: "fp6"}
    assert {layer.fp8_config.saved_format for layer in layers} == {"e4m3", "fp6"}

    with report.capture(step=3):
        train_step(model, None, tokens(seed=2))
    # The E4M3 layer is left as it is; the FP6 one is decided again.
    assert report.choose_saved_formats(max_rel_error=0.0) == {passing: "e4m3"}
    with report.capture(step=4):
        train_step(model, None, tokens(seed=3))
    with pytest.raises(ValueError, match="measured no kept input in FP4 or FP6"):
        report.choose_saved_formats()
    with pytest.raises(ValueError, match="max_rel_error"):
        report.choose_saved_formats(max_rel_error=math.nan)


def test_choose_saved_formats_sets_the_config_of_lone_coat_modules():
    config = coat.nn.FP8Config(saved_format="fp4")
    torch.manual_seed(0)
    model = nn.Sequential(coat.nn.RMSNorm(64, config=config), coat.nn.SwiGLUMLP(64, 96, config=config),
                          coat.nn.MLP(64, 96, config=config, activation="quick_gelu"))
    report = coat.report.QuantizationReport(model)
    with report.capture():
        model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert {row["tensor"] for row in report.rows() if row["layer"] == "2"} == {
        "fc1_input", "fc1_weight", "fc1_output", "fc2_input", "fc2_weight", "fc1_grad_output", "fc2_grad_output"}
    assert report.choose_saved_formats(max_rel_error=1.0) == {"0": "fp4", "1": "fp4", "2": "fp4"}
    assert report.choose_saved_formats(max_rel_error=0.0) == {"0": "fp6", "1": "fp6", "2": "fp6"}
    assert model[0].config.saved_format == model[1].config.saved_format == model[2].config.saved_format == "fp6"


def test_sampled_amax_of_an_fp4_kept_input_is_the_tensors():
    """Sampled rows take amax from the scales: an FP4 block's scale is its amax / 6 (not / FP8_MAX, though the
    recorded codes are the E4M3 expansion)."""
    norm = coat.nn.RMSNorm(64, config=coat.nn.FP8Config(saved_format="fp4"))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 7
    report = coat.report.QuantizationReport(norm, sample_rows=4)
    with report.capture():
        norm(x.requires_grad_()).sum().backward()
    row = {r["tensor"]: r for r in report.rows()}["norm_input"]
    assert row["format"] == "fp4" and row["numel"] == 4 * 64
    assert row["amax"] == pytest.approx(x.abs().max().item(), rel=1e-6)


def test_recorded_values_match_a_reference_from_the_model(model):
    """qkv_weight: the three weights quantized as one tensor; attn_norm_input: the layer's input in 1 x 16
    groups; grad_output rows only with FP8 gradients. Every row measured (sample_rows=None)."""
    report = coat.report.QuantizationReport(model, sample_rows=None)
    inputs = []
    model.model.layers[1].register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
    with report.capture():
        train_step(model, None, tokens())
    rows = {(row["layer"], row["tensor"]): row for row in report.rows()}

    attn = model.model.layers[1].self_attn
    weights = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    q, scale, _ = coat.ops.quantize_tensor(weights, "e4m3")
    expected = reference_stats(weights, q, scale)
    assert_stats_equal({key: rows[("model.layers.1", "qkv_weight")][key] for key in expected}, expected)

    (hidden,) = inputs
    hidden = hidden.reshape(-1, hidden.shape[-1])
    q, scales, _ = coat.ops.quantize_group(hidden, 16, "e4m3")
    expected = reference_stats(hidden, q, scales, group_size=16)
    assert_stats_equal({key: rows[("model.layers.1", "attn_norm_input")][key] for key in expected}, expected)

    bf16_gradients = coat.convert(tiny_llama(seed=0), gradient_format=None)
    report = coat.report.QuantizationReport(bf16_gradients)
    with report.capture():
        train_step(bf16_gradients, None, tokens())
    assert [row["tensor"] for row in report.rows() if row["layer"] == "model.layers.0"] == LAYER_TENSORS[:12]


def test_sampled_rows_are_evenly_spaced_and_amax_is_exact(model):
    """By default a capture measures 64 evenly spaced rows of each quantized matrix (here 8; q, k and v are
    recorded as three blocks of one FP8 tensor): the shares and the relative error are those rows' exactly,
    amax is the whole tensor's."""
    report = coat.report.QuantizationReport(model, sample_rows=8)
    with report.capture():
        train_step(model, None, tokens())
    row = {(r["layer"], r["tensor"]): r for r in report.rows()}[("model.layers.1", "qkv_weight")]
    attn = model.model.layers[1].self_attn
    blocks = [attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()]
    q, scale, _ = coat.ops.quantize_tensor(torch.cat(blocks), "e4m3")
    sampled_x, sampled_q = [], []
    for block, codes in zip(blocks, q.split([b.shape[0] for b in blocks])):
        rows = torch.linspace(0, block.shape[0] - 1, 8).round().long()
        sampled_x.append(block[rows])
        sampled_q.append(codes[rows])
    expected = reference_stats(torch.cat(sampled_x), torch.cat(sampled_q), scale)
    expected["amax"] = max(block.abs().max().item() for block in blocks)
    assert_stats_equal({key: row[key] for key in expected}, expected)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sample_rows must be a positive integer or None"):
            coat.report.QuantizationReport(model, sample_rows=bad)


@pytest.mark.parametrize("sample_rows", [8, None])
def test_a_capture_builds_no_tensor_from_host_data(model, sample_rows):
    """torch.tensor(data, device=...) is a host-to-device copy that synchronizes a GPU's stream: a capture, moments
    included, creates every tensor it needs on the device (sampled rows and every row alike), so a captured step
    builds no more tensors from host data than a plain one (transformers builds a few of its own)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostData(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func is torch.ops.aten.lift_fresh.default  # what torch.tensor(data) dispatches
            return func(*args, **(kwargs or {}))

    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer, tokens())
    report = coat.report.QuantizationReport(model, optimizer, sample_rows=sample_rows)
    with HostData() as plain:
        train_step(model, optimizer, tokens(seed=1))
    with HostData() as captured:
        with report.capture():
            train_step(model, optimizer, tokens(seed=1))
    assert any(row["k_min"] is not None for row in report.rows())  # moments were measured
    assert captured.calls == plain.calls


def test_a_lone_linear_layer_reports_its_input_weight_and_output_gradient(rng):
    """The input needs no gradient, so backward quantizes the output gradient only transposed (for the
    weight gradient): the report reads those codes."""
    model = nn.Sequential(coat.nn.Linear(32, 48))
    report = coat.report.QuantizationReport(model)
    x = torch.randn(4, 8, 32, generator=rng)
    grad = torch.randn(4, 8, 48, generator=rng)
    with report.capture():
        model(x).backward(grad)
    rows = {row["tensor"]: row for row in report.rows()}
    assert list(rows) == ["input", "weight", "grad_output"] and {row["layer"] for row in rows.values()} == {"0"}
    for name, tensor, fmt, clip in (("input", x, "e4m3", E4M3_CLIP), ("grad_output", grad, "e5m2", E5M2_CLIP)):
        matrix = tensor.reshape(-1, tensor.shape[-1])
        q, scale, _ = coat.ops.quantize_tensor(matrix, fmt)
        expected = reference_stats(matrix, q, scale, clip=clip)
        assert_stats_equal({key: rows[name][key] for key in expected}, expected)


def test_nothing_is_recorded_outside_a_capture(model, monkeypatch):
    calls = []
    measure = coat.ops.quantization_sums_
    monkeypatch.setattr(coat.ops, "quantization_sums_", lambda *args, **kwargs: calls.append(1) or measure(*args, **kwargs))
    report = coat.report.QuantizationReport(model)
    with pytest.raises(RuntimeError, match="nothing captured yet"):
        report.stats()
    train_step(model, None, tokens())
    assert calls == []

    # A forward captured, its backward run after the capture: the backward records nothing.
    with report.capture():
        loss = model(tokens(), labels=tokens()).loss
    recorded = len(calls)
    before = report.stats()
    loss.backward()
    train_step(model, None, tokens(seed=1))
    assert len(calls) == recorded and report.stats() == before
    assert not any(row["tensor"].endswith("grad_output") for row in report.rows())

    with pytest.raises(ZeroDivisionError), report.capture():
        1 / 0
    assert _capture.active is None and report.stats() == before  # a failed step leaves the last capture


def test_optimizer_moments_and_expansion_exponents(model):
    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-3)
    report = coat.report.QuantizationReport(model, optimizer, sample_rows=None)
    for step in range(3):
        with report.capture(step):
            train_step(model, optimizer, tokens(seed=step))
    rows = {(row["layer"], row["tensor"]): row for row in report.rows()}
    names = dict(model.named_parameters())
    for name, layer, tensor in (("model.layers.0.self_attn.q_proj.weight", "model.layers.0", "self_attn.q_proj.weight"),
                                ("model.layers.1.post_attention_layernorm.weight", "model.layers.1",
                                 "post_attention_layernorm.weight"),
                                ("lm_head.weight", "lm_head", "weight")):
        state = optimizer.state[names[name]]
        for moment, codes, meta in (("m", state["exp_avg"], state["exp_avg_meta"]),
                                    ("v", state["exp_avg_sq"], state["exp_avg_sq_meta"])):
            row = rows[(layer, f"{tensor}.{moment}")]
            k = meta[..., 1].double().flatten()
            values = coat.ops.dequantize_expanded(codes, meta, 128).double()
            assert row["k_min"] == k.min().item() and row["k_max"] == k.max().item()
            assert row["k_median"] == k.median().item() and row["k_expanded"] == (k != 1).double().mean().item()
            assert row["zero_codes"] == (codes.double() == 0).double().mean().item()
            assert row["amax"] == values.abs().max().item() and row["nonfinite"] == 0
            assert row["numel"] == codes.numel() and row["rel_error"] is None
            assert 0.5 <= row["k_min"] <= row["k_median"] <= row["k_max"] <= 64
    assert rows[("model.layers.0", "self_attn.q_proj.weight.m")]["k_expanded"] > 0
    assert len([key for key in rows if key[1].endswith((".m", ".v"))]) == 2 * len(names)

    plain = coat.optim.AdamW(model.parameters(), lr=1e-3, expand=False)
    report = coat.report.QuantizationReport(model, plain)
    with report.capture():
        train_step(model, plain, tokens())
    moments = [row for row in report.rows() if row["tensor"].endswith((".m", ".v"))]
    assert moments and all(row["k_min"] == row["k_max"] == 1 and row["k_expanded"] == 0 for row in moments)


def test_moment_statistics_reduced_in_batches_match_each_moment_alone(model, monkeypatch):
    # The capture measures the moments of many parameters in one coat.ops.moment_stats call, in batches of at
    # most _MOMENT_BATCH_GROUPS groups; every row must equal that moment's statistics computed alone here: both
    # FP8 formats, two group sizes, sampled rows, a moment holding NaN and Inf, batches of one and of many.
    monkeypatch.setattr(coat.report, "_MOMENT_BATCH_GROUPS", 40)
    params = list(model.parameters())
    optimizer = coat.optim.AdamW([{"params": params[: len(params) // 2], "group_size": 16, "m_format": "e5m2"},
                                  {"params": params[len(params) // 2 :]}], lr=1e-3)
    train_step(model, optimizer, tokens())
    report = coat.report.QuantizationReport(model, optimizer, sample_rows=3)
    poisoned = optimizer.state[params[1]]["exp_avg"]
    poisoned.view(torch.uint8).view(-1)[:2] = torch.tensor([0x7F, 0x7C], dtype=torch.uint8)  # NaN; E5M2 Inf
    with report.capture():
        train_step(model, None, tokens(seed=1))
    rows = {(row["layer"], row["tensor"]): row for row in report.rows()}
    checked = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            layer, name = report._moment_names[id(param)]
            for moment, (codes, meta) in optimizer.fp8_moments(param).items():
                row = rows[(layer, f"{name}.{moment}")]
                k = meta[..., 1].double().flatten()
                sampled = codes.dim() == 2 and codes.shape[0] > 3
                picked = torch.linspace(0, codes.shape[0] - 1, 3).round().long() if sampled else None
                c, m = (codes.index_select(0, picked), meta.index_select(0, picked)) if sampled else (codes, meta)
                values = coat.ops.dequantize_expanded(c, m, group["group_size"])
                finite = values.isfinite()
                assert row["numel"] == c.numel()
                assert row["nonfinite"] == (~finite).sum().item() / c.numel()
                assert row["zero_codes"] == ((c.view(torch.uint8) & 0x7F) == 0).sum().item() / c.numel()
                assert row["amax"] == torch.where(finite, values.abs(), 0.0).amax().item()
                assert (row["k_min"], row["k_median"], row["k_max"]) == (k.min().item(), k.median().item(), k.max().item())
                assert row["k_expanded"] == (k != 1).double().mean().item()
                checked += 1
    assert checked == 2 * len(params)
    assert rows[report._moment_names[id(params[1])][0], report._moment_names[id(params[1])][1] + ".m"]["nonfinite"] > 0


def test_csv_round_trip_and_heatmap(model, tmp_path):
    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-3)
    report = coat.report.QuantizationReport(model, optimizer)
    path = tmp_path / "report.csv"
    written = []
    for step in (10, 20):
        with report.capture(step):
            train_step(model, optimizer, tokens(seed=step))
        report.to_csv(path)
        written += report.rows()
    assert path.read_text().count("step,layer,tensor") == 1
    assert coat.report.read_csv(path) == written

    for metric in ("rel_error", "flushed", "k_median"):
        png = tmp_path / f"{metric}.png"
        report.heatmap(png, metric=metric)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    coat.report.heatmap(coat.report.read_csv(path), tmp_path / "from-csv.png")
    with pytest.raises(ValueError, match="unknown metric 'error'"):
        report.heatmap(tmp_path / "x.png", metric="error")

    foreign = tmp_path / "foreign.csv"
    foreign.write_text("step,loss\n1,2.0\n")
    with pytest.raises(ValueError, match="not a report CSV"):
        report.to_csv(foreign)


def test_capture_of_a_compiled_model_runs_eagerly_and_does_not_recompile(model):
    from torch._dynamo.utils import counters

    eager_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager")
    train_step(compiled, None, tokens())
    graphs = counters["stats"]["unique_graphs"]
    report = coat.report.QuantizationReport(model)
    with report.capture():
        train_step(compiled, None, tokens(seed=1))
    train_step(compiled, None, tokens(seed=2))
    assert counters["stats"]["unique_graphs"] == graphs

    eager_model.zero_grad()
    expected = coat.report.QuantizationReport(eager_model)
    with expected.capture():
        train_step(eager_model, None, tokens(seed=1))
    assert report.stats() == expected.stats()


def test_bad_input_gets_a_clear_error(model):
    with pytest.raises(ValueError, match=r"call coat.convert\(model\) first"):
        coat.report.QuantizationReport(tiny_llama(seed=0))
    with pytest.raises(TypeError, match="coat.optim.AdamW"):
        coat.report.QuantizationReport(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        coat.report.QuantizationReport("model")
    with pytest.raises(ValueError, match="not one of the model's parameters"):
        coat.report.QuantizationReport(model, coat.optim.AdamW([nn.Parameter(torch.zeros(4))]))
    report = coat.report.QuantizationReport(model)
    with report.capture(), pytest.raises(RuntimeError, match="cannot be nested"):
        with coat.report.QuantizationReport(model).capture():
            pass
    with pytest.raises(ValueError, match="no tensor of the last capture has 'k_median'"):
        report.worst("k_median")
