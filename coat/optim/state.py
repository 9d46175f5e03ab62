"""The layout of a parameter's state in coat.optim.AdamW (the module docstring of coat.optim.adamw states it): the FP8
codes of m and v with their per-group meta, how a fresh state is allocated, and how parameters are numbered in
state dicts."""
from __future__ import annotations

from typing import Any

import torch

from coat import ops
from coat.optim.sharding import like_param, local_shard

# (codes key, meta key, format option, index of its flag in the expand pair)
MOMENTS = (("exp_avg", "exp_avg_meta", "m_format", 0), ("exp_avg_sq", "exp_avg_sq_meta", "v_format", 1))


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The kernel views tensors as rows x cols; a 0-d parameter is one row of one element."""
    return tensor.view(1) if tensor.dim() == 0 else tensor


def meta_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    if len(shape) == 0:
        return (1, 3)
    return (*shape[:-1], -(-shape[-1] // group_size), 3)


def meta_state(param: torch.Tensor, local_meta: torch.Tensor, group_size: int) -> torch.Tensor:
    """How the meta is held in memory: a plain tensor of the local shard's groups for a 1-D (or 0-d) parameter,
    whose groups sharding forms per shard, else placed like the parameter."""
    if param.dim() <= 1:
        return local_meta
    return like_param(local_meta, param, meta_shape(tuple(param.shape), group_size))


def init_state(param: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
    """Zero moments: FP8 zeros and the meta that coat.ops.quantize_expanded gives all-zero groups."""
    local = local_shard(param)
    group_size = group["group_size"]
    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # read every step: never on a GPU
    for codes_key, meta_key, format_key, expand_index in MOMENTS:
        fp8_dtype = ops.fp8_dtype(group[format_key])
        if local.numel() == 0:
            codes = torch.empty(local.shape, dtype=fp8_dtype, device=local.device)
            meta = torch.empty(meta_shape(tuple(local.shape), group_size), dtype=torch.bfloat16, device=local.device)
        else:
            # Every row of zeros quantizes alike: quantize one and repeat it, so that the first step does not
            # hold a float32 copy of the parameter (its peak memory would include it).
            rows = as_rows(local)
            zero_row = torch.zeros(rows.shape[-1], dtype=torch.float32, device=local.device)
            row_codes, row_meta = ops.quantize_expanded(zero_row, group_size, fp8_dtype, expand=group["expand"][expand_index])
            codes = row_codes.expand(rows.shape).contiguous().view(local.shape)
            meta = row_meta.expand(*rows.shape[:-1], *row_meta.shape).contiguous()
        state[codes_key] = like_param(codes, param, tuple(param.shape))
        state[meta_key] = meta_state(param, meta, group_size)


def param_indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """id(param) -> its index in state dicts, numbered as torch.optim.Optimizer.state_dict numbers them."""
    index_of: dict[int, int] = {}
    start = 0
    for group in param_groups:
        for index, param in enumerate(group["params"], start):
            index_of.setdefault(id(param), index)
        start += len(group["params"])
    return index_of

