"""The hooks of coat.optim.AdamW's fp8_grads: after backward accumulates a parameter's gradient, the optimizer that
hooked the parameter keeps it in FP8 (AdamW._quantize_grad); a parameter has one such optimizer at a time."""
from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

# parameter -> weak reference to the coat.optim.AdamW whose fp8_grads hook keeps its gradients
_FP8_GRAD_OWNERS = WeakIdKeyDictionary()  # by identity: tensors compare element-wise


def hook_fp8_grads(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Makes backward hand ``optimizer`` the gradients of ``params`` (fp8_grads). The hook holds the optimizer
    weakly: once it is gone, its hooks do nothing and another optimizer may keep the gradients."""
    hook = _fp8_grad_hook(weakref.ref(optimizer))
    for param in params:
        if param.requires_grad:
            _FP8_GRAD_OWNERS[param] = weakref.ref(optimizer)
            param.register_post_accumulate_grad_hook(hook)


def _fp8_grad_hook(optimizer_ref: weakref.ref):
    def hook(param: torch.Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._quantize_grad(param)

    return hook


def check_fp8_grad_param(param: torch.Tensor) -> None:
    owner = _FP8_GRAD_OWNERS.get(param)
    if owner is not None and owner() is not None:
        raise ValueError(
            f"the gradients of a parameter of shape {tuple(param.shape)} are already kept in FP8 by another "
            "coat.optim.AdamW, whose hook would take them first; delete that optimizer before building this one"
        )
    if isinstance(param, DTensor):
        raise ValueError(
            "fp8_grads needs unsharded parameters: FSDP2's DTensor gradients are reduce-scattered by FSDP after "
            "backward. Leave fp8_grads=None under FSDP2 (bfloat16 parameters already give 2-byte gradients)."
        )

