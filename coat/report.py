"""coat.report: what FP8 quantization does to each tensor of a model, measured during real training steps.

    report = coat.report.QuantizationReport(model, optimizer)     # model converted by coat.convert
    with report.capture(step):                                     # every N steps; nothing is recorded outside
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
    logger.log(report.stats(), step=step)                          # {"model.layers.3/down_input/rel_error": ...}
    report.to_csv("report.csv")                                    # appends one row per (step, layer, tensor)
    report.heatmap("report.png", metric="rel_error")               # layers x tensors

A capture records every tensor a coat layer quantizes, beside the value it quantized: the activations saved for
backward in 1 x G groups, the per-tensor FP8 inputs and weights of every GEMM, and the FP8 output gradients
of the backward GEMMs; at its end it reads the optimizer's FP8 moments. Rows are named by module (the
converted decoder layer, ``model.layers.3``, or a coat.nn module outside one, e.g. ``lm_head``) and tensor:

    attn_norm_input       input of the attention RMSNorm, kept in 1 x G groups for its backward (E4M3, or FP4 /
                          FP6 with saved_format="fp4" / "fp6": the format column says which)
    qkv_input             the RMSNorm's output, the FP8 input of the q/k/v GEMMs (per tensor)
    qkv_weight            q, k and v weights, quantized together with one scale
    o_input, o_weight     attention output and o_proj weight
    mlp_norm_input        input of the MLP's RMSNorm (1 x G groups)
    gate_up_input         the RMSNorm's output, FP8 input of the gate/up GEMMs; gate_up_weight
    gate_output, up_output  the gate and up GEMM outputs, saved in 1 x G groups for SiLU*mul's backward
    down_input            SiLU(gate) * up, the FP8 input of the down GEMM; down_weight
    fc1_input, fc1_weight, fc1_output, fc2_input, fc2_weight   the same of a non-gated coat.nn.MLP: fc1's FP8
                          input, its output kept in 1 x G groups for the activation's backward, act(fc1's output)
    *_grad_output         output gradients of the projections, quantized for both backward GEMMs
                          (E5M2 by default; none with gradient_format=None)
    input, weight, grad_output, norm_input, norm_output   of a lone coat.nn.Linear / RMSNorm
    <parameter>.m, .v     the optimizer's FP8 moments of each parameter, e.g. self_attn.q_proj.weight.m

Which elements are measured. By default (``sample_rows=64``) a capture measures 64 evenly spaced rows of
each quantized matrix (all of a matrix with fewer): nonfinite, flushed, saturated and rel_error are those
rows' exactly, estimates of the whole tensor's (a lone NaN or a rare saturated value elsewhere is not
seen), and amax is the whole tensor's, FP8_MAX (6 for FP4 blocks, 7.5 for FP6) times its largest scale (the quantizer
derives the scales from its amax; a non-finite amax shows as a non-finite scale). The moments' k statistics cover every group,
their other metrics the sampled rows. ``sample_rows=None`` measures every element, exactly, at several
times the cost.

Metrics of a quantized tensor x with its FP8 copy Q(x) = coat.ops.dequantize(codes, scale) in float32:

    amax        max |x| over its finite elements
    nonfinite   share of elements where x or Q(x) is NaN or +-Inf; these are left out of every other metric.
                A group (or tensor) holding an Inf dequantizes to NaN as a whole, so it shows here in full.
    flushed     share of the finite elements with x != 0 whose FP8 code is zero (underflow)
    saturated   share of the finite elements whose scaled value |x / scale| (float32 division, as the
                quantizer computes it) is at least FP8_MAX plus half the format's top step (464 for E4M3,
                61440 for E5M2): values that rounding to nearest would carry past the largest FP8 magnitude
                and that the quantizer clips to it instead. With a scale from the tensor's own amax this
                stays 0; it counts where a scale is reused or an amax is stale.
    rel_error   ||Q(x) - x||_2 / ||x||_2 over the finite elements (0 for an all-zero tensor)
    numel       elements measured (CSV only)

Metrics of an optimizer moment (codes and per-group meta (scale, k, C) of coat.optim.AdamW; there is no
unquantized value to compare with):

    amax        max |m| (or |v|) of the dequantized moment, finite elements
    nonfinite   share of NaN or +-Inf elements of the dequantized moment
    zero_codes  share of zero codes: moments too small for their group's range after expansion, and exact zeros
    k_min, k_median, k_max   the dynamic range expansion exponent k over the groups (1: no expansion)
    k_expanded  share of groups with k != 1

A tensor recorded several times in one capture (gradient accumulation, gradient checkpointing's recomputed
forward) is summed over its recordings: amax is the largest, shares and rel_error are over all elements.

Cost: only capture steps pay: the tensors a coat Function quantized are measured when it returns, all of them
by one native call (coat.ops.quantization_sums_: their sampled rows' sums, one kernel launch, accumulated on
the device; the RMSNorm and SiLU*mul outputs recomputed for those rows only), at the end one call for every
optimizer moment (coat.ops.moment_stats) and one device-to-host copy, which the capture's end starts and does
not wait for: the first read of the results (stats(), rows(), worst(), to_csv(), heatmap(), or the next
capture) waits for it, once. Read them after the next step is enqueued (as examples/train_llama.py does) and
a GPU-bound loop never drains for the report. On H200s and an H100 (4 layers at hidden
2048, runs of 40 steps timed whole) a capture costs 1.01-1.03x a plain step at 16 x 2048 tokens read in such a
loop, 1.02-1.04x read at once (every row: 2.0-2.2x); at 4 x 2048 it adds 0.8-0.9 ms of GPU time to a 21-22 ms
step (1.040x H100, 1.038x H200; whole runs 1.08x on the H100, noisier elsewhere) and 3-7 ms of host time, which
the host absorbs while it runs ahead of the GPU. Capturing every 100 steps costs about 0.05% of a run; outside a
capture each coat autograd Function reads one module global in forward and in backward (``benchmarks/report.py``
measures all of these).

Captures run in eager mode: torch.compile'd code runs uncompiled inside a capture and uses its compiled graphs
again after it (no recompilation); without a capture a converted model compiles as before, with no graph
break. Under FSDP each process reports its own batch and its own shards of the optimizer state.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from coat import ops
from coat.nn import _capture
from coat.nn.modules import MLP, Linear, RMSNorm, SwiGLUMLP
from coat.optim.adamw import AdamW

TENSOR_METRICS = ("amax", "nonfinite", "flushed", "saturated", "rel_error")
MOMENT_METRICS = ("amax", "nonfinite", "zero_codes", "k_min", "k_median", "k_max", "k_expanded")
METRICS = tuple(dict.fromkeys(TENSOR_METRICS + MOMENT_METRICS))
CSV_COLUMNS = ("step", "layer", "tensor", "format", "numel", *METRICS)
# The inputs of RMSNorm and SiLU*mul that a layer keeps for backward in its saved_format, and the largest
# relative error at which QuantizationReport.choose_saved_formats keeps a layer's low-bit format by default.
KEPT_INPUTS = ("attn_norm_input", "mlp_norm_input", "gate_output", "up_output", "fc1_output", "norm_input")
MAX_KEPT_REL_ERROR = 0.12
# choose_saved_formats' ladder: a layer whose kept inputs fail at one format goes to the next, wider one.
WIDER_FORMAT = {"fp4": "fp6", "fp6": "e4m3"}
METRIC_DESCRIPTIONS = {
    "amax": "max |x|",
    "nonfinite": "share of NaN / Inf elements",
    "flushed": "share of nonzero values flushed to zero",
    "saturated": "share of values clipped to the FP8 maximum",
    "rel_error": "relative error ||Q(x) - x|| / ||x||",
    "zero_codes": "share of zero FP8 codes",
    "k_min": "smallest expansion exponent k",
    "k_median": "median expansion exponent k",
    "k_max": "largest expansion exponent k",
    "k_expanded": "share of groups with k != 1",
}
# Metrics whose values span decades: the heat map draws them on a log scale.
_LOG_SCALE_METRICS = ("amax", "nonfinite", "flushed", "saturated", "rel_error", "zero_codes")
_FORMAT_NAMES = {dtype: name for name, dtype in ops.FP8_DTYPES.items()}
# The largest magnitude of each block format: a block's amax is that times its scale.
_BLOCK_FORMAT_MAX = {"fp4": 6.0, "fp6": 7.5}
_NO_MODULE = "coat.nn.functional"  # the layer name of a Function called outside any coat module
_ROOT = "(model)"  # the layer name of the model itself, whose module name is empty


# ------------------------------------------------------------------------------------------- one tensor


def _measure_args(sums: torch.Tensor, x, q: torch.Tensor, scale: torch.Tensor, group_size: int | None,
                  rows: torch.Tensor | None, fmt: str) -> tuple:
    """One measured tensor's arguments of coat.ops.quantization_sums_: x against its FP8 codes q, the ``rows`` of
    q (every row when None), amax from the scales when rows are sampled (the quantizer derived them from the whole
    tensor's amax) and from x otherwise. x is a tensor of q's shape, or a function of the row indices (None: every
    row) that recomputes those rows of it."""
    if q.dim() != 2:  # the quantizers' groups run along the last dimension
        q = q.reshape(-1, q.shape[-1])
        if group_size is not None:
            scale = scale.reshape(-1, scale.shape[-1])
        if not callable(x):
            x = x.reshape(q.shape)
    held = callable(x) and rows is not None
    if callable(x):
        x = x(rows)
    amax_per_scale = 0.0 if rows is None else _BLOCK_FORMAT_MAX.get(fmt) or ops.FP8_MAX[q.dtype]
    return sums, x, q, scale, group_size, rows, held, amax_per_scale


def _measure(measures: list[tuple]) -> None:
    """coat.ops.quantization_sums_ of measured tensors (_measure_args), one call per device."""
    devices = dict.fromkeys(m[2].device for m in measures)
    for device in devices:
        on_device = measures if len(devices) == 1 else [m for m in measures if m[2].device == device]
        sums, x, q, scale, group_size, rows, held, amax_per_scale = zip(*on_device)
        ops.quantization_sums_(sums, x, q, scale, group_size, rows, x_holds_measured_rows=held,
                               amax_per_scale=amax_per_scale)


def _tensor_metrics(sums: list[float]) -> dict[str, float]:
    numel, nonfinite, flushed, saturated, error_sq, value_sq, amax = sums
    finite = numel - nonfinite
    if value_sq > 0:
        rel_error = math.sqrt(error_sq / value_sq)
    else:  # all zeros: exact unless something came back nonzero
        rel_error = 0.0 if error_sq == 0 else math.inf
    return {
        "numel": numel,
        "amax": amax,
        "nonfinite": nonfinite / numel,
        "flushed": flushed / finite if finite else math.nan,
        "saturated": saturated / finite if finite else math.nan,
        "rel_error": rel_error if finite else math.nan,
    }


def tensor_stats(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None
) -> dict[str, float]:
    """The report's metrics (amax, nonfinite, flushed, saturated, rel_error, numel; see the module docstring)
    of one tensor ``x`` and its FP8 codes ``q`` with their scales, as a coat quantizer returned them: the
    one-element scale of ``coat.ops.quantize_tensor`` (``group_size`` None), or the per-group scales of
    ``coat.ops.quantize_group`` with its ``group_size``."""
    if q.dtype not in ops.FP8_MAX:
        raise TypeError(
            f"coat.report.tensor_stats: q must hold FP8 codes (float8_e4m3fn or float8_e5m2), got {q.dtype}"
        )
    if x.shape != q.shape:
        raise ValueError(f"coat.report.tensor_stats: x {tuple(x.shape)} and q {tuple(q.shape)} must have one shape")
    if x.numel() == 0:
        raise ValueError("coat.report.tensor_stats: x is empty")
    with torch.no_grad():
        sums = torch.zeros(len(ops.QUANTIZATION_SUMS), dtype=torch.float64, device=q.device)
        _measure([_measure_args(sums, x, q, scale, group_size, None, _FORMAT_NAMES[q.dtype])])
        return _tensor_metrics(sums.tolist())


# Groups of the moments measured in one call at most (their k are sorted together for the medians, as int32 keys):
# bounds the memory a capture's end takes for that sort. One larger moment is measured alone.
_MOMENT_BATCH_GROUPS = 1 << 24
_MOMENTS_PER_CALL = 1 << 15  # coat.ops.moment_stats' limit


def _moments_values(moments: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]]
                    ) -> list[tuple[torch.Tensor, int]]:
    """coat.ops.moment_stats of each FP8 moment of coat.optim.AdamW, given as (codes as rows, meta, group size,
    measured rows): one call per batch of moments of one device and group size. Each moment's values are a row
    of its batch's stats: (stats, row)."""
    results: list[tuple[torch.Tensor, int] | None] = [None] * len(moments)
    batches: dict[tuple[torch.device, int], list[list[int]]] = {}
    last_batch_groups: dict[tuple[torch.device, int], int] = {}
    for i, (codes, _, group_size, _) in enumerate(moments):
        key = (codes.device, group_size)
        runs = batches.setdefault(key, [[]])
        groups = codes.numel() // codes.shape[-1] * -(-codes.shape[-1] // group_size)
        if runs[-1] and (last_batch_groups[key] + groups > _MOMENT_BATCH_GROUPS or len(runs[-1]) == _MOMENTS_PER_CALL):
            runs.append([])
            last_batch_groups[key] = 0
        runs[-1].append(i)
        last_batch_groups[key] = last_batch_groups.get(key, 0) + groups
    for (_, group_size), runs in batches.items():
        for run in runs:
            stats = ops.moment_stats([moments[i][0] for i in run], [moments[i][1] for i in run], group_size,
                                     [moments[i][3] for i in run])
            for row, i in enumerate(run):
                results[i] = (stats, row)
    return results


def _moment_metrics(values: list[float]) -> dict[str, float]:
    numel, nonfinite, zero_codes, amax, k_min, k_median, k_max, k_expanded = values
    return {"numel": numel, "amax": amax, "nonfinite": nonfinite / numel, "zero_codes": zero_codes / numel,
            "k_min": k_min, "k_median": k_median, "k_max": k_max, "k_expanded": k_expanded}


def _copy_to_host(blocks: list[torch.Tensor]):
    """Starts copying 2-D tensors to host memory, one copy per device, without waiting for a GPU; returns the
    function that waits for the copies and returns ``row_of(block, index)``, a row of one of the tensors as a
    list of floats."""
    unique = list({id(block): block for block in blocks}.values())
    copies = []
    for device in dict.fromkeys(block.device for block in unique):
        on_device = [block for block in unique if block.device == device]
        flat = torch.cat([block.flatten() for block in on_device])
        done = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(flat.device))
            flat = host
        copies.append((on_device, flat, done))

    def wait():
        starts: dict[int, tuple[list[float], int, int]] = {}  # id(block) -> (its device's values, offset, width)
        for on_device, flat, done in copies:
            if done is not None:
                done.synchronize()
            values = flat.tolist()
            start = 0
            for block in on_device:
                starts[id(block)] = (values, start, block.shape[1])
                start += block.numel()

        def row_of(block: torch.Tensor, index: int) -> list[float]:
            values, start, width = starts[id(block)]
            return values[start + index * width : start + (index + 1) * width]

        return row_of

    return wait


# ------------------------------------------------------------------------------------------- the report


def _report_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules rows are named after, in model order: converted decoder layers and coat.nn modules
    outside them (the coat modules inside a converted layer are never called; the layer computes them)."""
    decoder = sys.modules.get("coat.nn.decoder")  # imported by coat.convert: absent, nothing was converted
    coat_types = (Linear, RMSNorm, SwiGLUMLP, MLP) + ((decoder.FP8DecoderLayerMixin,) if decoder else ())
    modules: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in modules)
        if isinstance(module, coat_types) and not inside:
            modules[name or _ROOT] = module
    return modules


class _Site:
    """Where one autograd Function call records: the report capturing and the module the call runs in."""

    __slots__ = ("report", "layer")

    def __init__(self, report: "QuantizationReport", layer: str):
        self.report, self.layer = report, layer

    def record(self, tensor: str, x, q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None,
               format: str | None = None) -> None:
        """x was quantized to the FP8 codes q with ``scale`` (per tensor) or per-group scales (group_size).
        x is the tensor, or, for a value the kernel never wrote out, a function of a row index (or None for
        every row) that recomputes those rows of it. ``format``: the stored format when q is an exact E4M3
        expansion of another one ("fp4"); None: q's own. Measured when the recording Function returns."""
        self.report._record(self.layer, tensor, x, q, scale, group_size, format)


class QuantizationReport:
    """Per layer and per quantized tensor health of a model converted by :func:`coat.convert` (or built from
    coat.nn modules), and of the FP8 moments of its :class:`coat.optim.AdamW` when given: see
    :mod:`coat.report` for the tensors and metrics.

    ``sample_rows``: rows measured per quantized matrix, evenly spaced (None: every element; see
    :mod:`coat.report`). ``with report.capture(step):`` records one training step; afterwards :meth:`stats`
    (a flat dict for a logger), :meth:`rows`, :meth:`worst`, :meth:`to_csv` and :meth:`heatmap` describe
    that step. Outside a capture the model runs exactly as without a report.
    """

    def __init__(self, model: nn.Module, optimizer: AdamW | None = None, *, sample_rows: int | None = 64):
        if sample_rows is not None and (isinstance(sample_rows, bool) or not isinstance(sample_rows, int) or sample_rows < 1):
            raise ValueError(f"coat.report: sample_rows must be a positive integer or None (every row), got {sample_rows!r}")
        self._sample_rows = sample_rows
        self._row_samples: dict[tuple[int, torch.device], torch.Tensor] = {}
        if not isinstance(model, nn.Module):
            raise TypeError(f"coat.report.QuantizationReport takes a torch.nn.Module, got {type(model).__name__}")
        self._modules = _report_modules(model)
        if not self._modules:
            raise ValueError(
                f"coat.report: {type(model).__name__} has no coat layers, so nothing in it is quantized: call "
                "coat.convert(model) first (or build it from coat.nn modules)"
            )
        if optimizer is not None and not isinstance(optimizer, AdamW):
            raise TypeError(
                f"coat.report reads the FP8 moments of coat.optim.AdamW, got {type(optimizer).__module__}."
                f"{type(optimizer).__name__}: pass a coat.optim.AdamW, or optimizer=None to report the model only"
            )
        self._optimizer = optimizer
        self._moment_names = self._name_moments(model, optimizer) if optimizer is not None else {}
        self._layer_order = {name or _ROOT: index for index, (name, _) in enumerate(model.named_modules())}
        self._layer_order[_NO_MODULE] = len(self._layer_order)
        self._module_stack: list[str] = []
        # Per (layer, tensor, device): a row of a float64 buffer that the tensor's measurements add into, as
        # (buffer, row), kept from capture to capture: a capture starts with one zero_ per buffer and makes no
        # tensors for its recordings. Per capture: the tensors recorded, in the order first recorded, with their
        # format and row; and the measurements recorded since the last call to the native op.
        self._slots: dict[tuple[str, str, torch.device], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._sum_buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._recorded: dict[tuple[str, str], tuple[str, tuple[torch.Tensor, int, torch.Tensor]]] = {}
        self._pending: list[tuple] = []
        self._captures = 0
        self._rows: list[dict] | Callable[[], list[dict]] | None = None  # a function until the first read
        # The last capture's row layout: its (layer, tensor, format) in recording order, the order that sorts
        # them into model order, and the rows without their metrics; a capture that records the same reuses it.
        self._layout: tuple[tuple, list[int], list[dict]] | None = None

    def _name_moments(self, model: nn.Module, optimizer: AdamW) -> dict[int, tuple[str, str]]:
        """id(parameter) -> (layer, parameter name within it): the report module holding the parameter, or
        else the module that owns it."""
        names = {}
        for name, param in model.named_parameters():
            layer = next((m for m in self._modules if name.startswith(f"{m}.")), name.rpartition(".")[0])
            names[id(param)] = (layer or _ROOT, name[len(layer) + 1 :] if layer else name)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in names:
                    raise ValueError(
                        f"coat.report: the optimizer holds a parameter of shape {tuple(param.shape)} that is not one "
                        "of the model's parameters: build the report from the model the optimizer trains"
                    )
        return names

    # ------------------------------------------------------------------------------------- capturing

    @contextlib.contextmanager
    def capture(self, step: int | None = None):
        """Records the quantization of the forward and backward passes (and the optimizer state) inside the
        ``with`` block as one step, ``step`` (default: the number of this capture, from 1). Put the
        optimizer's step() inside the block to see the moments it writes; the optimizer state is read when
        the block ends; the block ends without waiting for the GPU (the first read of the results waits).
        Only autograd forward passes are recorded (not torch.no_grad() evaluation), and only
        eagerly: torch.compile'd code runs uncompiled inside the block (torch.compiler.set_stance
        "force_eager") and compiled again after it."""
        if _capture.active is not None:
            raise RuntimeError("coat.report: another capture is in progress; captures cannot be nested")
        if torch.compiler.is_compiling():
            raise RuntimeError("coat.report: capture() runs in eager mode; call it outside torch.compile'd code")
        self._last_rows()  # the last capture's copy, before its sums are zeroed (usually done long ago)
        hooks = []
        for name, module in self._modules.items():
            hooks.append(module.register_forward_pre_hook(functools.partial(self._enter_module, name)))
            hooks.append(module.register_forward_hook(self._leave_module))
        self._recorded = {}
        for buffers in self._sum_buffers.values():
            for buffer in buffers:
                buffer.zero_()
        _capture.active = self
        try:
            # Compiled code would trace the recording itself: it runs uncompiled meanwhile, and its compiled
            # graphs, which record nothing, are used again after the capture, without recompiling.
            with torch.compiler.set_stance("force_eager"):
                yield self
            self._flush()
        finally:
            _capture.active = None
            for hook in hooks:
                hook.remove()
            self._module_stack.clear()
            self._pending.clear()
        self._captures += 1
        self._rows = self._finish(self._captures if step is None else step)

    def _enter_module(self, name: str, module: nn.Module, args) -> None:
        self._module_stack.append(name)

    def _leave_module(self, module: nn.Module, args, output) -> None:
        self._module_stack.pop()  # returns None: a forward hook's return value would replace the output

    def _site(self) -> _Site:
        """Called by coat's autograd Functions (through coat.nn._capture) at the start of each forward."""
        return _Site(self, self._module_stack[-1] if self._module_stack else _NO_MODULE)

    def _measured_rows(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """sample_rows evenly spaced row indices of a matrix of ``rows`` rows, or None for all of them."""
        if self._sample_rows is None or rows <= self._sample_rows:
            return None
        key = (rows, device)
        if key not in self._row_samples:
            self._row_samples[key] = torch.linspace(0, rows - 1, self._sample_rows, device=device).round().long()
        return self._row_samples[key]

    def _slot(self, layer: str, tensor: str, device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The float64 sums on ``device`` that (layer, tensor) adds into, made on its first recording: (buffer,
        row, the row as a tensor). Buffers hold 64 rows, then twice the last's."""
        key = (layer, tensor, device)
        if key not in self._slots:
            buffers = self._sum_buffers.setdefault(device, [])
            used = sum(1 for (_, _, slot_device) in self._slots if slot_device == device)
            first_row = sum(buffer.shape[0] for buffer in buffers[:-1])
            if not buffers or used == first_row + buffers[-1].shape[0]:
                capacity = 2 * buffers[-1].shape[0] if buffers else 64
                buffers.append(torch.zeros(capacity, len(ops.QUANTIZATION_SUMS), dtype=torch.float64, device=device))
                first_row = used
            row = used - first_row
            self._slots[key] = (buffers[-1], row, buffers[-1][row])
        return self._slots[key]

    def _record(self, layer: str, tensor: str, x, q: torch.Tensor, scale: torch.Tensor,
                group_size: int | None, format: str | None) -> None:
        """Keeps a quantized tensor for measurement when the Function that quantized it returns (_flush)."""
        if q.numel() == 0:
            return
        key = (layer, tensor)
        recorded = self._recorded.get(key)
        if recorded is None:  # rows come out in the order tensors were first recorded
            recorded = self._recorded[key] = (format or _FORMAT_NAMES[q.dtype], self._slot(layer, tensor, q.device))
        fmt, (_, _, sums) = recorded
        self._pending.append((sums, x, q, scale, group_size, fmt))

    def _flush(self) -> None:
        """Measures the tensors recorded since the last flush, in one native call per device: called when a
        coat Function's forward or backward returns (coat.nn._capture.measures_records), where autograd has
        turned gradients off already, and at the end."""
        if not self._pending:
            return
        if torch.is_grad_enabled():  # the end of a capture, or a backward with create_graph=True
            with torch.no_grad():
                return self._flush()
        measures = []
        for sums, x, q, scale, group_size, fmt in self._pending:
            rows = self._measured_rows(q.shape[0], q.device) if q.dim() == 2 else None
            measures.append(_measure_args(sums, x, q, scale, group_size, rows, fmt))
        self._pending.clear()
        _measure(measures)

    def _finish(self, step: int) -> Callable[[], list[dict]]:
        """Starts the capture's rows: one per (layer, tensor), in model order, tensors in the order first recorded.
        The values are copied to the host without waiting and the rows laid out while the GPU still runs the step;
        returns the function that waits for the copy once and puts the metrics into the rows (_last_rows calls it
        on the first read), so that the capture's end does not stall a GPU-bound training loop."""
        entries = [(layer, tensor, fmt, buffer, row, _tensor_metrics)
                   for (layer, tensor), (fmt, (buffer, row, _)) in self._recorded.items()]
        if self._optimizer is not None:
            named, moments = [], []
            for group in self._optimizer.param_groups:
                for param in group["params"]:
                    layer, name = self._moment_names[id(param)]
                    for moment, (codes, meta) in self._optimizer.fp8_moments(param).items():
                        rows = self._measured_rows(codes.shape[0], codes.device) if codes.dim() == 2 else None
                        named.append((layer, f"{name}.{moment}", _FORMAT_NAMES[codes.dtype]))
                        moments.append((codes, meta, group["group_size"], rows))
            for (layer, tensor, fmt), (block, row) in zip(named, _moments_values(moments)):
                entries.append((layer, tensor, fmt, block, row, _moment_metrics))
        wait_for_host = _copy_to_host([entry[3] for entry in entries])
        names = tuple(entry[:3] for entry in entries)
        if self._layout is None or self._layout[0] != names:
            tensor_order = {}
            for _, tensor, _ in names:
                tensor_order.setdefault(tensor, len(tensor_order))
            order = sorted(range(len(names)),
                           key=lambda i: (self._layer_order.get(names[i][0], -1), tensor_order[names[i][1]]))
            empty = dict.fromkeys(CSV_COLUMNS)
            self._layout = (names, order, [{**empty, "layer": names[i][0], "tensor": names[i][1], "format": names[i][2]}
                                           for i in order])
        _, order, unfilled = self._layout
        entries = [entries[i] for i in order]
        rows = [{**row, "step": step} for row in unfilled]

        def filled_rows() -> list[dict]:
            row_of = wait_for_host()
            for row, (_, _, _, block, index, metrics) in zip(rows, entries):
                row.update(metrics(row_of(block, index)))
                row["numel"] = int(row["numel"])
            return rows

        return filled_rows

    # ------------------------------------------------------------------------------------- results

    def rows(self) -> list[dict]:
        """The last capture as rows: dicts with every CSV column (:data:`CSV_COLUMNS`); the metrics that do
        not apply to a row's tensor are None."""
        return [dict(row) for row in self._read_rows()]

    def _last_rows(self) -> list[dict] | None:
        """The last capture's rows, waiting for its values on the first call after it; None before any capture."""
        if callable(self._rows):
            self._rows = self._rows()
        return self._rows

    def _read_rows(self) -> list[dict]:
        rows = self._last_rows()
        if rows is None:
            raise RuntimeError("coat.report: nothing captured yet; record a step with `with report.capture(step):`")
        return rows

    def stats(self) -> dict[str, float]:
        """The last capture as a flat dict of floats for a logger: ``{"LAYER/TENSOR/METRIC": value}``, e.g.
        ``"model.layers.3/gate_up_input/rel_error"``; every metric that applies, numel left out."""
        return {
            f"{row['layer']}/{row['tensor']}/{metric}": float(row[metric])
            for row in self._read_rows()
            for metric in METRICS
            if row[metric] is not None
        }

    def choose_saved_formats(self, max_rel_error: float = MAX_KEPT_REL_ERROR) -> dict[str, str]:
        """Sets, per converted layer, how the inputs of its RMSNorms and SiLU*mul are kept for backward, from
        the last capture, and returns ``{layer: "fp4", "fp6" or "e4m3"}`` for the layers it decided. The rule:
        a layer whose kept inputs the capture measured in FP4 (4 bits) or FP6 (6 bits) keeps that format if
        every one of them had a relative error of at most ``max_rel_error``, and otherwise goes one step wider,
        FP4 to FP6, FP6 to E4M3 (8 bits). The default, 0.12, is 1.3x FP4's error on Gaussian data at G = 16
        (0.094; FP6's is about 0.02): inputs whose 1 x G blocks hold outliers, where the narrow formats lose the
        small values beside them, get more bits. Layers measured in E4M3 are left as they are (their low-bit
        error is unknown). Start from saved_format="fp4" and capture and choose again until no layer moves: a
        layer settles within two rounds."""
        if not max_rel_error >= 0:
            raise ValueError(f"coat.report: max_rel_error must be >= 0, got {max_rel_error!r}")
        kept: dict[str, list[dict]] = {}
        for row in self.rows():
            if row["tensor"] in KEPT_INPUTS:
                kept.setdefault(row["layer"], []).append(row)
        choice = {}
        for layer, rows in kept.items():
            formats = {row["format"] for row in rows}
            if len(formats) != 1 or not formats <= WIDER_FORMAT.keys():
                continue
            (measured,) = formats
            module = self._modules[layer]
            attribute = "fp8_config" if hasattr(module, "fp8_config") else "config"
            fits = all(row["rel_error"] <= max_rel_error for row in rows)  # NaN fails
            choice[layer] = measured if fits else WIDER_FORMAT[measured]
            setattr(module, attribute, dataclasses.replace(getattr(module, attribute), saved_format=choice[layer]))
        if not choice:
            raise ValueError(
                "coat.report: the last capture measured no kept input in FP4 or FP6; convert with "
                "saved_format=\"fp4\" (or set it on the layers) and capture a step before choosing"
            )
        return choice

    def worst(self, metric: str = "rel_error") -> tuple[str, str, float]:
        """(layer, tensor, value) of the last capture's largest ``metric``; NaN counts as the largest."""
        rows = [row for row in self.rows() if row.get(metric) is not None]
        if not rows:
            raise ValueError(
                f"coat.report: no tensor of the last capture has {metric!r}; metrics: {', '.join(METRICS)}"
            )
        row = max(rows, key=lambda row: math.inf if math.isnan(row[metric]) else row[metric])
        return row["layer"], row["tensor"], row[metric]

    def to_csv(self, path: str | os.PathLike) -> None:
        """Appends the last capture's rows to the CSV file at ``path`` (one per layer and tensor, every
        column of :data:`CSV_COLUMNS`, blank where a metric does not apply), writing the header first when
        the file is new or empty. :func:`read_csv` reads it back."""
        rows = self.rows()
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        if not new:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != CSV_COLUMNS:
                raise ValueError(
                    f"coat.report: {path} is not a report CSV (its header is {header}); write to a new file"
                )
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, CSV_COLUMNS)
            if new:
                writer.writeheader()
            writer.writerows(rows)

    def heatmap(self, path: str | os.PathLike, metric: str = "rel_error") -> None:
        """Draws the last capture's ``metric`` as a heat map of layers x tensors into ``path`` (any format
        matplotlib writes, by its extension): see :func:`heatmap`."""
        heatmap(self.rows(), path, metric)


# ------------------------------------------------------------------------------------------- CSV, heat map


def read_csv(path: str | os.PathLike) -> list[dict]:
    """The rows of a CSV that :meth:`QuantizationReport.to_csv` wrote: step and numel as ints, the metrics
    as floats (None where blank), layer, tensor and format as strings."""
    def parse(column: str, value: str):
        if column in ("layer", "tensor", "format"):
            return value
        if value == "":
            return None
        return int(value) if column in ("step", "numel") else float(value)

    with open(path, newline="") as f:
        return [{column: parse(column, value) for column, value in row.items()} for row in csv.DictReader(f)]


def heatmap(rows: Iterable[dict], path: str | os.PathLike, metric: str = "rel_error") -> None:
    """Draws ``metric`` of report rows (:meth:`QuantizationReport.rows` or :func:`read_csv`; the rows of the
    last step they hold) as a heat map, layers down, tensors across, into ``path``. Metrics that span
    decades (amax, shares, rel_error) use a log colour scale, where zero is light grey. NaN is black, a
    tensor a layer does not have is white. The title names the worst cell. Needs matplotlib."""
    if metric not in METRICS:
        raise ValueError(f"coat.report.heatmap: unknown metric {metric!r}; metrics: {', '.join(METRICS)}")
    try:
        import numpy
        from matplotlib import colormaps, colors
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("coat.report.heatmap draws with matplotlib: pip install matplotlib") from error
    rows = list(rows)
    last_step = max((row["step"] for row in rows), default=None)
    rows = [row for row in rows if row["step"] == last_step and row.get(metric) is not None]
    if not rows:
        raise ValueError(
            f"coat.report.heatmap: no row has {metric!r} (optimizer metrics need a report with an optimizer)"
        )
    layers = list(dict.fromkeys(row["layer"] for row in rows))
    tensors = list(dict.fromkeys(row["tensor"] for row in rows))
    grid = numpy.full((len(layers), len(tensors)), numpy.nan)
    recorded = numpy.zeros(grid.shape, dtype=bool)
    for row in rows:
        cell = layers.index(row["layer"]), tensors.index(row["tensor"])
        grid[cell], recorded[cell] = row[metric], True

    finite = grid[recorded & numpy.isfinite(grid)]
    positive = finite[finite > 0]
    if metric in _LOG_SCALE_METRICS and positive.size and positive.max() >= 10 * positive.min():
        norm = colors.LogNorm(vmin=positive.min(), vmax=positive.max())
    else:
        low, high = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
        norm = colors.Normalize(vmin=low, vmax=high if high > low else low + 1)
    # Stand-ins outside the colour range, drawn in the colour map's extremes: NaN and Inf above (black), zeros
    # below a log scale (grey); cells never recorded stay masked (white).
    above, below = norm.vmax + abs(norm.vmax) + 1, norm.vmin / 10
    shown = numpy.where(numpy.isfinite(grid), grid, above)
    shown = numpy.where(shown < norm.vmin, below, shown)
    cmap = colormaps["YlOrRd"].with_extremes(under="#d9d9d9", over="black", bad="white")

    figure = Figure(figsize=(2.5 + 0.5 * len(tensors), 2.0 + 0.32 * len(layers)), layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(numpy.ma.masked_array(shown, ~recorded), cmap=cmap, norm=norm, aspect="auto",
                      interpolation="nearest")
    if grid.size <= 600:  # values in the cells while they stay legible
        for i, j in zip(*numpy.nonzero(recorded)):
            ax.text(j, i, f"{grid[i, j]:.2g}", ha="center", va="center", fontsize=6,
                    color="white" if norm(shown[i, j]) > 0.6 else "black")
    ax.set_xticks(range(len(tensors)), tensors, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)), layers, fontsize=8)
    figure.colorbar(image, ax=ax, extend="both", label=metric)
    worst = max(rows, key=lambda row: math.inf if math.isnan(row[metric]) else row[metric])
    ax.set_title(f"coat quantization report, step {last_step}: {metric}, {METRIC_DESCRIPTIONS[metric]}\n"
                 f"worst: {worst['layer']} / {worst['tensor']} = {worst[metric]:.3g}", fontsize=10)
    figure.savefig(path, dpi=120)


__all__ = ["QuantizationReport", "tensor_stats", "read_csv", "heatmap", "METRICS", "CSV_COLUMNS", "METRIC_DESCRIPTIONS"]
