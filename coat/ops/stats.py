"""Quantization statistics, what coat.report measures (csrc/include/coat/stats.h states the sums and their order)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from coat._native import check_device_supported
from coat.ops._checks import check_group_size

__all__ = ["QUANTIZATION_SUMS", "quantization_sums_"]

QUANTIZATION_SUMS = ("numel", "nonfinite", "flushed", "saturated", "error_sq", "value_sq", "amax")


def quantization_sums_(
    sums: Sequence[torch.Tensor],
    x: Sequence[torch.Tensor],
    q: Sequence[torch.Tensor],
    scale: Sequence[torch.Tensor],
    group_size: Sequence[int | None],
    rows: Sequence[torch.Tensor | None],
    *,
    x_holds_measured_rows: Sequence[bool],
    amax_per_scale: Sequence[float],
) -> None:
    """Adds what quantizing each ``x[i]`` to the FP8 codes ``q[i]`` did into ``sums[i]``, a float64 tensor of 7
    (zeros to start; one per tensor, so that several recordings add up), in the order of
    :data:`QUANTIZATION_SUMS`. Every argument holds one entry per measured tensor. ``scale[i]`` is the
    quantizer's: one per-tensor scale (``group_size[i]`` None), or one per 1 x ``group_size[i]`` group of q.
    Measured are the ``rows[i]`` of q (int64 row indices; every row when None) and of x, or, with
    ``x_holds_measured_rows[i]``, x is those rows alone. Per measured element, with Q(x) = fp8_decode(q) * scale
    in float32:

        nonfinite   Q(x) - x is NaN or +-Inf; such elements count in no other sum
        flushed     Q(x) == 0 and x != 0
        saturated   |x / scale| >= FP8_MAX + half its top step (464 E4M3, 61440 E5M2)
        error_sq    (Q(x) - x)^2 and value_sq x^2, in float64

    summed by one fixed pairwise tree, so CPU and CUDA give the same bits. numel adds the measured elements;
    amax becomes the max of itself and max |x| over the measured finite elements, or, with
    ``amax_per_scale[i]`` > 0, ``amax_per_scale[i] * max(scale[i])`` (FP8_MAX for FP8 scales: the whole
    tensor's amax from its scales). A NaN or Inf scale makes its elements nonfinite (and amax NaN or Inf when
    taken from the scales); a row index outside q makes every sum but numel NaN. x and q are 2-D, any strides.

    The tensors are measured in list order, with the same bits as one call per tensor; several may add into
    the same ``sums`` tensor (e.g. the q, k and v projections into one row). All on one device; on a GPU a call
    is one memset and one kernel launch (one per 24 tensors for more), with no synchronization. Empty lists do
    nothing."""
    if q:
        check_device_supported(q[0], "coat.ops.quantization_sums_")
    torch.ops.coat.quantization_sums_(
        list(sums), list(x), list(q), list(scale), [0 if g is None else g for g in group_size], list(rows),
        list(x_holds_measured_rows), list(amax_per_scale),
    )


@torch.library.register_fake("coat::quantization_sums_")
def _quantization_sums_fake(sums, x, q, scale, group_size, rows, x_holds_measured_rows, amax_per_scale):
    op = "coat.quantization_sums_"
    lists = dict(sums=sums, x=x, q=q, scale=scale, group_size=group_size, rows=rows,
                 x_holds_measured_rows=x_holds_measured_rows, amax_per_scale=amax_per_scale)
    if len({len(values) for values in lists.values()}) > 1:
        counts = ", ".join(f"{len(values)} {name}" for name, values in lists.items())
        raise RuntimeError(f"{op}: every list needs one entry per measured tensor, got {counts}")
    for i, g in enumerate(group_size):
        if g != 0:
            check_group_size(g, op if len(q) == 1 else f"{op}: measure {i}")
