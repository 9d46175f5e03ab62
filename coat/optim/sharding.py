"""The DTensor side of coat.optim.AdamW: the local shard a kernel updates, a state tensor placed like its FSDP2-sharded
parameter, the placements whose shards hold whole quantization groups, and a shard's offset in its whole tensor."""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def like_param(local: torch.Tensor, param: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as a DTensor of global ``shape`` on the parameter's mesh and placements, or as is for a plain
    parameter."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_strides(tuple(shape)),
    )


def global_offset(param: torch.Tensor) -> int:
    """The flat index, in the whole tensor, of the first element of this rank's shard (0 for a plain tensor).
    FSDP2 shards dim 0, so the shard is a run of whole rows."""
    if not isinstance(param, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return sum(offset * math.prod(param.shape[dim + 1 :]) for dim, offset in enumerate(offsets))


def check_placements(param: DTensor) -> None:
    for placement in param.placements:
        if placement.is_replicate():
            continue
        dim = getattr(placement, "dim", None)  # Shard and FSDP2+TP's _StridedShard
        if dim is None:
            raise RuntimeError(f"coat.optim.AdamW supports Shard and Replicate placements of parameters, got {placement}")
        if param.dim() >= 2 and dim % param.dim() == param.dim() - 1:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} is sharded on its last dimension ({placement}), which "
                "splits quantization groups; shard it on another dimension (FSDP2 shards dim 0)"
            )

