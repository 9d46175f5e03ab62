"""The FP8 AdamW ops: the fused AdamW step over FP8 optimizer states, the conversion of states to and from
float32, and their statistics (csrc/include/coat/adamw.h states every formula).

A state is FP8 codes of its parameter's shape plus bf16 meta of shape ``(*shape[:-1], ceil(shape[-1] / G), 3)``,
one (scale, k, C) per 1 x G group of the last dimension (G = 128 by default: 2 + 12/G bytes per parameter for m
and v). Dynamic range expansion quantizes ``y = sign(x) * (|x| / C)**k`` with C the geometric mean of the group's
smallest and largest nonzero magnitudes and k, clamped to [1/2, 64], chosen so that the group's range fills the
format's; :func:`fp8_adamw_step` dequantizes, runs one AdamW step and re-quantizes, fused, over a list of
parameters; :func:`quantize_expanded` / :func:`dequantize_expanded` convert states to and from float32.
"""

from __future__ import annotations

import torch

from coat._native import check_device_supported
from coat.ops._checks import check_group_size, fp8_dtype

__all__ = [
    "adamw_scalars", "fp8_adamw_step", "quantize_expanded", "dequantize_expanded", "MOMENT_STATS", "moment_stats",
]


def adamw_scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """``(decay_factor, step_size, bias_correction2_sqrt)`` of AdamW step ``step`` (1-based), computed in
    float64 as torch.optim.AdamW does: ``1 - lr * weight_decay``, ``lr / (1 - beta1**step)`` and
    ``sqrt(1 - beta2**step)``; :func:`fp8_adamw_step` takes them."""
    return 1.0 - lr * weight_decay, lr / (1.0 - beta1**step), (1.0 - beta2**step) ** 0.5


def fp8_adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_metas: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    exp_avg_sq_metas: list[torch.Tensor],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    decay_factor: float,
    step_size: float,
    bias_correction2_sqrt: float,
    group_size: int = 128,
    expand_exp_avg: bool = True,
    expand_exp_avg_sq: bool = True,
    rounding_seeds: list[int] | None = None,
) -> None:
    """One fused AdamW step, in place, on every parameter of the lists (one kernel launch per 32 tensors on
    CUDA). Per element, in fp32, in torch.optim.AdamW's order::

        m, v = dequantize(exp_avg), dequantize(exp_avg_sq)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        p = p * decay_factor
        p = p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps)

    then m and v are quantized again with fresh per-group meta (with expansion unless ``expand_exp_avg`` /
    ``expand_exp_avg_sq`` is False). Take the three scalars from :func:`adamw_scalars`.

    rounding_seeds: None (bf16 parameters round to nearest even), or one integer in [0, 2**63) per parameter:
    bf16 parameters then round stochastically, up with probability equal to the fraction of a bf16 ulp the
    fp32 result lies above the bf16 value below it, with random bits drawn from the seed and the element's
    index (csrc/include/coat/adamw.h), the same bits on CPU and CUDA. Pass fresh seeds every step; float32
    parameters ignore them.

    params: contiguous float32 or bfloat16 tensors with at least one dimension (a bf16 parameter is updated
    in fp32 and rounded once: no master weights). grads: float32, bfloat16 or float16, each of its parameter's
    shape. exp_avgs / exp_avg_sqs: FP8 codes of the parameter's shape, torch.float8_e4m3fn or
    torch.float8_e5m2 (the dtype picks the format, e.g. E4M3 m and E5M2 v); exp_avg_metas / exp_avg_sq_metas:
    their bf16 meta as :func:`quantize_expanded` makes it. A NaN or Inf gradient makes its parameter NaN, as in
    torch.optim.AdamW, and never changes the rest of its group.

    CPU and CUDA: the CPU runs the C core; the CUDA kernel computes the same formulas with the GPU's fast
    arithmetic (hardware exp2, log2, square root and reciprocal) and is deterministic (the same inputs give the
    same bits on every run and in any grouping of the tensors into calls), but not bit-equal to the CPU: its
    errors against a float64 reference are at most twice the C core's (tests/test_adamw_ops.py states the
    tolerance), and an FP8 code may differ where its value lies within that error of a rounding boundary. The
    state layout is the same on both, so states and checkpoints move freely between them.
    """
    if params:
        check_device_supported(params[0], "coat.ops.fp8_adamw_step")
    torch.ops.coat.fp8_adamw_step(
        params, grads, exp_avgs, exp_avg_metas, exp_avg_sqs, exp_avg_sq_metas, beta1, beta2, eps,
        decay_factor, step_size, bias_correction2_sqrt, group_size, expand_exp_avg, expand_exp_avg_sq,
        rounding_seeds,
    )


def quantize_expanded(
    x: torch.Tensor, group_size: int = 128, format: torch.dtype | str = "e4m3", *, expand: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes float32 ``x`` to an FP8 optimizer state: returns ``(codes, meta)``, codes of x's shape in the
    FP8 dtype, meta bf16 of shape ``(*x.shape[:-1], ceil(x.shape[-1] / group_size), 3)`` holding each
    group's (scale, k, C). With ``expand=False``, k = C = 1: plain per-group quantization. Use it to turn a
    torch.optim.AdamW state (``exp_avg.float()``) into the state :func:`fp8_adamw_step` takes; zeros give a
    fresh state."""
    check_device_supported(x, "coat.ops.quantize_expanded")
    return torch.ops.coat.quantize_expanded(x, group_size, fp8_dtype(format), expand)


def dequantize_expanded(codes: torch.Tensor, meta: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Inverse of :func:`quantize_expanded`: float32 ``sign * C * (|float(code)| * scale)**(1/k)`` of codes'
    shape."""
    check_device_supported(codes, "coat.ops.dequantize_expanded")
    return torch.ops.coat.dequantize_expanded(codes, meta, group_size)


MOMENT_STATS = ("numel", "nonfinite", "zero_codes", "amax", "k_min", "k_median", "k_max", "k_expanded")


def moment_stats(
    codes: list[torch.Tensor], metas: list[torch.Tensor], group_size: int = 128,
    rows: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Statistics of FP8 optimizer states, each a contiguous ``codes`` tensor (rows along its last dimension)
    with its ``meta``, as :func:`quantize_expanded` and ``coat.optim.AdamW.fp8_moments`` give them: one float64
    row per state in the order of :data:`MOMENT_STATS`. Over the state's ``rows`` (int64 row indices; every row
    when None), with x' the dequantized value: numel (elements measured), nonfinite (x' NaN or +-Inf),
    zero_codes (+-0 codes), amax (max |x'| over the finite ones); over every group, its expansion exponent k:
    k_min, k_median (the lower median, as torch.median), k_max (all three NaN when any k is NaN) and
    k_expanded (share of k != 1). Counts and maxima, so CPU and CUDA agree exactly; a row index outside the
    state counts that row as nonfinite. Up to 32768 states per call, all on one device."""
    if not codes:
        raise ValueError("coat.ops.moment_stats: codes holds no state")
    check_device_supported(codes[0], "coat.ops.moment_stats")
    rows = [None] * len(codes) if rows is None else list(rows)
    return torch.ops.coat.moment_stats(list(codes), list(metas), group_size, rows)


def _expanded_meta(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], -(-x.shape[-1] // group_size), 3), dtype=torch.bfloat16)


@torch.library.register_fake("coat::fp8_adamw_step")
def _fp8_adamw_step_fake(params, grads, exp_avgs, exp_avg_metas, exp_avg_sqs, exp_avg_sq_metas, beta1, beta2,
                         eps, decay_factor, step_size, bias_correction2_sqrt, group_size, expand_m, expand_v,
                         rounding_seeds=None):
    check_group_size(group_size, "coat.fp8_adamw_step")


@torch.library.register_fake("coat::quantize_expanded")
def _quantize_expanded_fake(x, group_size, fp8_dtype, expand):
    check_group_size(group_size, "coat.quantize_expanded")
    return x.new_empty(x.shape, dtype=fp8_dtype), _expanded_meta(x, group_size)


@torch.library.register_fake("coat::moment_stats")
def _moment_stats_fake(codes, metas, group_size, rows):
    check_group_size(group_size, "coat.moment_stats")
    return codes[0].new_empty((len(codes), len(MOMENT_STATS)), dtype=torch.float64)


@torch.library.register_fake("coat::dequantize_expanded")
def _dequantize_expanded_fake(codes, meta, group_size):
    check_group_size(group_size, "coat.dequantize_expanded")
    return codes.new_empty(codes.shape, dtype=torch.float32)
