"""The options of coat.optim.AdamW's parameter groups, checked and put in canonical form, and the checks of the
parameters and gradients a step updates."""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from coat import ops
from coat.optim.sharding import check_placements, local_shard

# Options that fix how the states are stored: a checkpoint must have been saved with the same ones.
STORAGE_OPTIONS = ("group_size", "m_format", "v_format")
COAT_OPTIONS = (*STORAGE_OPTIONS, "expand", "param_rounding", "rounding_seed")
_PARAM_ROUNDINGS = ("nearest", "stochastic")
# torch.optim.AdamW features coat does not implement, with the only value accepted for each.
UNSUPPORTED_FEATURES = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "fused": None,
    "capturable": False,
    "differentiable": False,
}
_SUPPORTED_FEATURES_TEXT = ", ".join(f"{name}={value}" for name, value in UNSUPPORTED_FEATURES.items())
_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FORMAT_NAMES = {dtype: name for name, dtype in ops.FP8_DTYPES.items()}


def normalize_options(group: dict[str, Any]) -> None:
    """Checks a param group's options and stores them in canonical form: formats as "e4m3"/"e5m2", expand as
    an (m, v) pair, betas as floats. Raises ValueError with what is supported."""
    for feature, supported in UNSUPPORTED_FEATURES.items():
        if group.get(feature, supported) != supported:
            raise ValueError(
                f"coat.optim.AdamW does not support {feature}={group[feature]!r}. It runs one fused FP8 kernel per "
                f"parameter group and supports {_SUPPORTED_FEATURES_TEXT}."
            )
        group[feature] = supported
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.device.type != "cpu":
            raise ValueError(
                "a Tensor lr must be a 1-element CPU tensor: step() reads it on the host, and reading a GPU "
                "tensor there would synchronize"
            )
        lr = lr.item()
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"Invalid epsilon value: {group['eps']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    beta1, beta2 = (float(beta) for beta in betas)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    group["betas"] = (beta1, beta2)
    if group["group_size"] not in ops.GROUP_SIZES:
        raise ValueError(f"group_size must be one of {ops.GROUP_SIZES}, got {group['group_size']!r}")
    group["m_format"] = format_name(group["m_format"])
    group["v_format"] = format_name(group["v_format"])
    group["expand"] = expand_pair(group["expand"])
    if group["param_rounding"] not in _PARAM_ROUNDINGS:
        raise ValueError(f"param_rounding must be one of {_PARAM_ROUNDINGS}, got {group['param_rounding']!r}")
    seed = group["rounding_seed"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"rounding_seed must be an integer, got {seed!r}")


def format_name(format: str | torch.dtype) -> str:
    return _FORMAT_NAMES[ops.fp8_dtype(format)]


def expand_pair(expand: Any) -> tuple[bool, bool]:
    if isinstance(expand, bool):
        return expand, expand
    if isinstance(expand, (tuple, list)) and len(expand) == 2 and all(isinstance(e, bool) for e in expand):
        return expand[0], expand[1]
    raise ValueError(f"expand must be a bool or a (m, v) pair of bools, got {expand!r}")


def check_param_dtype(param: torch.Tensor) -> None:
    if param.is_complex():
        raise ValueError("coat.optim.AdamW does not support complex parameters (view them as real with torch.view_as_real)")
    if param.dtype not in _PARAM_DTYPES:
        raise ValueError(
            f"coat.optim.AdamW updates float32 parameters (master weights) and bfloat16 parameters, got a "
            f"{param.dtype} parameter of shape {tuple(param.shape)}: keep float32 weights (model.float()) and "
            "train under torch.autocast(dtype=torch.float16), or convert the model to bfloat16"
        )


def check_for_step(param: torch.Tensor, fp8_grad: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Refuses what the kernel cannot update in place: the parameter's dtype may have changed since it was
    added, and gradients come from outside."""
    check_param_dtype(param)
    grad = param.grad
    if fp8_grad is not None:
        if grad is not None:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} has both an FP8 gradient (fp8_grads) and a param.grad "
                "set after backward; assign gradients before backward runs, or call zero_grad() first"
            )
        if not local_shard(param).is_contiguous():
            raise RuntimeError(
                f"coat.optim.AdamW updates contiguous parameters in place; a parameter of shape "
                f"{tuple(param.shape)} is not contiguous"
            )
        return
    if grad.is_sparse:
        raise RuntimeError("coat.optim.AdamW does not support sparse gradients; use torch.optim.SparseAdam for those")
    if grad.dtype not in _GRAD_DTYPES:
        raise RuntimeError(f"coat.optim.AdamW takes float32, bfloat16 or float16 gradients, got {grad.dtype}")
    if grad.shape != param.shape:
        raise RuntimeError(f"gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(param.shape)}")
    if isinstance(param, DTensor):
        check_placements(param)
        if not isinstance(grad, DTensor) or grad.placements != param.placements:
            raise RuntimeError(
                f"the gradient of a DTensor parameter placed as {param.placements} must be a DTensor placed the "
                f"same way, got {grad.placements if isinstance(grad, DTensor) else 'a plain tensor'}"
            )
    if not local_shard(param).is_contiguous():
        raise RuntimeError(
            f"coat.optim.AdamW updates contiguous parameters in place; a parameter of shape {tuple(param.shape)} "
            "is not contiguous"
        )


def host_lr(lr: float | torch.Tensor) -> float:
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        raise RuntimeError("coat.optim.AdamW: a Tensor lr must stay on the CPU; reading a GPU lr would synchronize")
    return float(lr)

