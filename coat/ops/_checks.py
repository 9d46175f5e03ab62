"""What the op families of coat.ops share, below all of them: the FP8 formats, the group sizes, their checks, and
the output shapes their fake (meta) implementations build. Imports no op module."""
from __future__ import annotations

import math

import torch

GROUP_SIZES = (16, 32, 64, 128)
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_dtype(format: torch.dtype | str) -> torch.dtype:
    """torch.float8_e4m3fn / torch.float8_e5m2 from a dtype or from "e4m3" / "e5m2"."""
    if isinstance(format, str) and format.lower() in FP8_DTYPES:
        return FP8_DTYPES[format.lower()]
    if format in FP8_MAX:
        return format
    raise ValueError(f"unsupported FP8 format {format!r}: use 'e4m3' (torch.float8_e4m3fn) or 'e5m2' (torch.float8_e5m2)")


def check_group_size(group_size: int, op: str, name: str = "group_size") -> None:
    """The fake ops' check of a group (or block) size argument, with the native ops' message."""
    if group_size not in GROUP_SIZES:
        raise RuntimeError(f"{op}: {name} must be 16, 32, 64 or 128, got {group_size}")


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """A fake float32 tensor of one value per 1 x ``group_size`` group of x's last dimension (scales, amaxes)."""
    ngroups = -(-x.shape[-1] // group_size)
    return x.new_empty((*x.shape[:-1], ngroups), dtype=torch.float32)


def transposed(x: torch.Tensor, fp8: torch.dtype, transpose: bool) -> torch.Tensor:
    """The fake transposed FP8 codes of x seen as (rows, cols): (cols, rows) when ``transpose``, else empty."""
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    return x.new_empty((cols, rows) if transpose else (0,), dtype=fp8)


def packed_row_bytes(cols: int, format: str) -> int:
    """Bytes of a row of ``cols`` codes saved in ``format``: FP4 two codes per byte, FP6 four per three bytes."""
    return {"e4m3": cols, "fp4": -(-cols // 2), "fp6": -(-3 * cols // 4)}[format]
