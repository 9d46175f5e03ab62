"""coat.optim.AdamW's state dicts: its own, with the meta of 1-D and 0-d parameters saved per element and re-formed
into the loading layout's groups, and torch.optim.AdamW's, with float32 moments, both ways (the module docstring of
coat.optim.adamw states what each holds)."""
from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from coat import ops
from coat.optim.options import (
    COAT_OPTIONS,
    STORAGE_OPTIONS,
    UNSUPPORTED_FEATURES,
    expand_pair,
    format_name,
    normalize_options,
)
from coat.optim.sharding import like_param, local_shard
from coat.optim.state import MOMENTS, as_rows, meta_shape, meta_state, param_indices


def with_per_element_meta(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """torch.optim.Optimizer.state_dict's ``state_dict`` with the meta of 1-D and 0-d parameters saved per
    element, in place."""
    params = _params_by_index(param_groups)
    for index, state in list(state_dict["state"].items()):
        param, group = params[index]
        if param.dim() <= 1 and state:
            state = dict(state)
            for _, meta_key, _, _ in MOMENTS:
                state[meta_key] = _per_element_meta(param, state[meta_key], group["group_size"])
            state_dict["state"][index] = state
    return state_dict


def loaded_state(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state and param groups (for Optimizer.__setstate__) that a coat.optim.AdamW with param groups ``groups``
    loads from ``state_dict``, its :meth:`~coat.optim.AdamW.state_dict`: codes and meta in the loading layout's
    groups, the options of the checkpoint."""
    saved_groups = deepcopy(state_dict["param_groups"])
    _check_group_counts(groups, saved_groups)
    for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        _check_storage_options(index, group, saved_group)

    id_map = {}
    saved_group_of = {}
    for group, saved_group in zip(groups, saved_groups):
        for key, param in zip(saved_group["params"], group["params"]):
            id_map[key] = param
            saved_group_of[key] = saved_group
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for key, value in state_dict["state"].items():
        if key in id_map:
            param = id_map[key]
            # a parameter never stepped has an empty state, kept empty as in torch
            state[param] = _state_from_checkpoint(param, value, saved_group_of[key], key) if value else {}
        else:
            state[key] = value  # state not tied to a parameter is kept as is, as torch does

    param_groups = []
    for group, saved_group in zip(groups, saved_groups):
        saved_group["params"] = group["params"]
        for key in ("param_rounding", "rounding_seed"):  # checkpoints saved before these options existed
            saved_group.setdefault(key, group[key])
        if "param_names" in group and "param_names" not in saved_group:
            saved_group["param_names"] = group["param_names"]
        normalize_options(saved_group)
        param_groups.append(saved_group)
    return {"state": state, "param_groups": param_groups}


def torch_state_dict(groups: list[dict[str, Any]], state: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """The state dict of torch.optim.AdamW for a coat.optim.AdamW's param groups ``groups`` and ``state``."""
    torch_state = {}
    torch_groups = []
    index_of = param_indices(groups)
    for group in groups:
        packed = {key: value for key, value in group.items() if key not in ("params", *COAT_OPTIONS)}
        packed["params"] = [index_of[id(p)] for p in group["params"]]
        torch_groups.append(packed)
        for param in group["params"]:
            param_state = state.get(param)
            if param_state:
                torch_state[index_of[id(param)]] = {
                    "step": param_state["step"].clone(),
                    "exp_avg": _dequantized(param, param_state["exp_avg"], param_state["exp_avg_meta"], group),
                    "exp_avg_sq": _dequantized(
                        param, param_state["exp_avg_sq"], param_state["exp_avg_sq_meta"], group
                    ),
                }
    return {"state": torch_state, "param_groups": torch_groups}


def loaded_torch_state(groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state and param groups (for Optimizer.__setstate__) that a coat.optim.AdamW with param groups ``groups``
    loads from ``state_dict``, torch.optim.AdamW's: the moments quantized with this optimizer's storage options."""
    saved_groups = state_dict["param_groups"]
    _check_group_counts(groups, saved_groups)
    param_groups = []
    id_map = {}
    for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        for feature in ("amsgrad", "maximize"):
            if saved_group.get(feature, False):
                raise ValueError(
                    f"param group {index} of the torch state dict uses {feature}=True, which coat.optim.AdamW "
                    "does not implement"
                )
        if not saved_group.get("decoupled_weight_decay", True) and saved_group.get("weight_decay", 0) != 0:
            raise ValueError(
                f"param group {index} of the torch state dict comes from torch.optim.Adam with L2 weight decay "
                "(decoupled_weight_decay=False); coat.optim.AdamW decays weights like torch.optim.AdamW"
            )
        new_group = {
            key: value
            for key, value in saved_group.items()
            if key not in ("params", "param_names", "decoupled_weight_decay", *COAT_OPTIONS, *UNSUPPORTED_FEATURES)
        }
        new_group.update({key: group[key] for key in (*COAT_OPTIONS, *UNSUPPORTED_FEATURES)})
        new_group["params"] = group["params"]
        if "param_names" in group:
            new_group["param_names"] = group["param_names"]
        normalize_options(new_group)
        param_groups.append(new_group)
        for key, param in zip(saved_group["params"], group["params"]):
            id_map[key] = (param, new_group)

    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for key, value in state_dict["state"].items():
        if key not in id_map:
            raise ValueError(f"the torch state dict has state for {key!r}, which is no parameter of its groups")
        param, group = id_map[key]
        missing = [name for name in ("step", "exp_avg", "exp_avg_sq") if name not in value]
        if missing:
            raise ValueError(f"the torch state of parameter {key!r} lacks {missing}")
        param_state = {"step": _host_step(value["step"])}
        for codes_key, meta_key, format_key, expand_index in MOMENTS:
            codes, meta = _quantized(param, value[codes_key], group, format_key, expand_index, key)
            param_state[codes_key] = codes
            param_state[meta_key] = meta
        state[param] = param_state
    return {"state": state, "param_groups": param_groups}


def _params_by_index(param_groups: list[dict[str, Any]]) -> dict[int, tuple[torch.Tensor, dict[str, Any]]]:
    index_of = param_indices(param_groups)
    return {index_of[id(p)]: (p, group) for group in param_groups for p in group["params"]}


def _per_element_meta(param: torch.Tensor, meta: torch.Tensor, group_size: int) -> torch.Tensor:
    """The (scale, k, C) of each element's group, shape (*param.shape, 3), placed like the parameter."""
    local_param = local_shard(param)
    per_element = meta.repeat_interleave(group_size, dim=0)[: local_param.numel()]
    return like_param(per_element.reshape(*local_param.shape, 3), param, (*param.shape, 3))


def _check_group_counts(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has {len(groups)}"
        )
    for index, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved_group["params"]):
            raise ValueError(
                f"parameter group {index} of the loaded state dict has {len(saved_group['params'])} parameters, "
                f"this optimizer's has {len(group['params'])}"
            )


def _check_storage_options(index: int, group: dict[str, Any], saved_group: dict[str, Any]) -> None:
    missing = [key for key in STORAGE_OPTIONS if key not in saved_group]
    if missing:
        raise ValueError(
            f"parameter group {index} of the loaded state dict has no {', '.join(missing)}: it is not the state of a "
            "coat.optim.AdamW. Load a torch.optim.AdamW state dict with load_torch_state_dict()."
        )
    saved = {
        "group_size": saved_group["group_size"],
        "m_format": format_name(saved_group["m_format"]),
        "v_format": format_name(saved_group["v_format"]),
    }
    current = {key: group[key] for key in STORAGE_OPTIONS}
    if saved != current:
        raise ValueError(
            f"parameter group {index}: the loaded states are stored with {saved}, this optimizer uses {current}. "
            "Build coat.optim.AdamW with the checkpoint's options, or convert the state through "
            "torch_state_dict() and load_torch_state_dict(), which quantizes again."
        )


def _host_step(step: torch.Tensor | float) -> torch.Tensor:
    return torch.tensor(float(step), dtype=torch.float32, device="cpu")


def _checked_state_tensor(
    param: torch.Tensor, value: Any, dtype: torch.dtype, shape: tuple[int, ...], where: str
) -> torch.Tensor:
    """``value`` checked against what the optimizer expects, moved to the parameter's device."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(
            f"{where} has dtype {value.dtype}, expected {dtype}; a state dict of torch.optim.AdamW loads with "
            "load_torch_state_dict()"
        )
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    device = local_shard(param).device
    if isinstance(param, DTensor):
        if not isinstance(value, DTensor) or value.placements != param.placements or value.device_mesh != param.device_mesh:
            raise ValueError(
                f"{where} must be a DTensor placed like its parameter ({param.placements}); load FSDP2 checkpoints "
                "with torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict)"
            )
        return value if value.to_local().device == device else like_param(value.to_local().to(device), param, shape)
    if isinstance(value, DTensor):
        raise ValueError(f"{where} is a DTensor but its parameter is not")
    return value.to(device)


def _state_from_checkpoint(param: torch.Tensor, saved: dict[str, Any], group: dict[str, Any], key: Any) -> dict[str, Any]:
    where = f"the state of parameter {key!r}"
    missing = [name for name in ("step", "exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta") if name not in saved]
    if missing:
        raise ValueError(f"{where} lacks {missing}; a torch.optim.AdamW state dict loads with load_torch_state_dict()")
    group_size = group["group_size"]
    expand = expand_pair(group["expand"])
    state = {"step": _host_step(saved["step"])}
    for codes_key, meta_key, format_key, expand_index in MOMENTS:
        fp8_dtype = ops.fp8_dtype(group[format_key])
        codes = _checked_state_tensor(param, saved[codes_key], fp8_dtype, tuple(param.shape), f"{where}['{codes_key}']")
        if param.dim() <= 1:
            saved_meta_shape = (*param.shape, 3)
        else:
            saved_meta_shape = meta_shape(tuple(param.shape), group_size)
        meta = _checked_state_tensor(param, saved[meta_key], torch.bfloat16, saved_meta_shape, f"{where}['{meta_key}']")
        if param.dim() <= 1:
            local_codes, meta = _regroup_vector(
                local_shard(codes), local_shard(meta), group_size, fp8_dtype, expand[expand_index]
            )
            codes = like_param(local_codes, param, tuple(param.shape))
        state[codes_key] = codes
        state[meta_key] = meta
    return state


def _regroup_vector(
    codes: torch.Tensor, per_element_meta: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, expand: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and per-group meta of a 1-D (or 0-d) parameter's local shard from its per-element checkpoint form.

    A group of this layout whose elements all carry the same saved meta keeps it (exact). The others mix
    elements of different saved groups: every element is dequantized with its own meta (as a one-element
    group) and the groups are quantized again."""
    count = codes.numel()
    per_element_meta = per_element_meta.reshape(count, 3)
    ngroups = -(-count // group_size)
    if count == 0:
        return codes, per_element_meta.new_empty((0, 3))
    first_meta = per_element_meta[::group_size]
    # Compare bit patterns so that a NaN meta matches itself.
    bits = per_element_meta.view(torch.int16)
    same_as_first = (bits == first_meta.view(torch.int16).repeat_interleave(group_size, dim=0)[:count]).all(dim=1)
    padded = torch.ones(ngroups * group_size, dtype=torch.bool, device=codes.device)
    padded[:count] = same_as_first
    uniform = padded.view(ngroups, group_size).all(dim=1)
    if bool(uniform.all()):
        return codes, first_meta.contiguous()
    values = ops.dequantize_expanded(as_rows(codes).reshape(count, 1), per_element_meta.reshape(count, 1, 3), group_size)
    new_codes, new_meta = ops.quantize_expanded(values.reshape(count), group_size, fp8_dtype, expand=expand)
    keep = uniform.repeat_interleave(group_size)[:count]
    merged_codes = torch.where(keep, as_rows(codes).view(torch.uint8), new_codes.view(torch.uint8))
    merged_meta = torch.where(uniform[:, None], first_meta, new_meta)
    return merged_codes.view(fp8_dtype).view(codes.shape), merged_meta


def _dequantized(param: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    local_codes = local_shard(codes)
    if local_codes.numel() == 0:
        local = torch.zeros(local_codes.shape, dtype=torch.float32, device=local_codes.device)
    else:
        local = ops.dequantize_expanded(as_rows(local_codes), local_shard(meta), group["group_size"]).view(local_codes.shape)
    return like_param(local, param, tuple(param.shape))


def _quantized(
    param: torch.Tensor, moment: Any, group: dict[str, Any], format_key: str, expand_index: int, key: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"the torch state of parameter {key!r}"
    if not isinstance(moment, torch.Tensor) or moment.shape != param.shape:
        shape = tuple(moment.shape) if isinstance(moment, torch.Tensor) else type(moment).__name__
        raise ValueError(f"{where}: a moment must be a tensor of the parameter's shape {tuple(param.shape)}, got {shape}")
    if isinstance(moment, DTensor) != isinstance(param, DTensor):
        raise ValueError(f"{where}: a moment must be a DTensor exactly when its parameter is one")
    local_param = local_shard(param)
    local = local_shard(moment).to(device=local_param.device, dtype=torch.float32).contiguous()
    fp8_dtype = ops.fp8_dtype(group[format_key])
    group_size = group["group_size"]
    if local.numel() == 0:
        codes = torch.empty(local.shape, dtype=fp8_dtype, device=local.device)
        meta = torch.empty(meta_shape(tuple(local.shape), group_size), dtype=torch.bfloat16, device=local.device)
    else:
        codes, meta = ops.quantize_expanded(as_rows(local), group_size, fp8_dtype, expand=group["expand"][expand_index])
        codes = codes.view(local.shape)
    return like_param(codes, param, tuple(param.shape)), meta_state(param, meta, group_size)
