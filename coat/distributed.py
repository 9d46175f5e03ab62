"""FP8 gradient communication for FSDP2 (fully_shard).

FSDP2 reduce-scatters the gradients of each sharded module once per backward, in the reduce dtype (bf16 or
float32). :func:`fp8_reduce_scatter` replaces that collective with AGoQ's (section 5): an FP8 sum on the wire
would overflow and lose precision, so nothing is summed in FP8.

    every rank:   its flat gradient buffer, world_size chunks (chunk j is what rank j keeps), each quantized to
                  FP8 in 1 x G blocks with one float32 scale per block   (coat.ops.quantize_group)
    all-to-all:   chunk j's codes and scales go to rank j                 (1 + 4/G bytes per element)
    every rank:   dequantizes the world_size chunks it received to float32 and sums them; with FSDP2's
                  ReduceOp.AVG the sum is divided by world_size; the result lands in the reduce dtype

Bytes sent per element of the buffer: 1 + 4/G (1.03 at G = 128) against 4 for a float32 reduce-scatter and 2
for bf16. Each rank's contribution is rounded once, to its block's FP8 grid (E4M3: 2^-4 of the block's
largest magnitude at most; E5M2: 2^-3); the sum itself is exact in float32 up to its own rounding. A block
holding NaN or Inf gives NaN for that block on every rank: a non-finite gradient is never silently dropped.

FSDP2's gradient divide factor (``set_gradient_divide_factor``, premultiplied sums) is not supported: the
reduce-scatter is then refused with a message. Every rank must install the same collective.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from coat import ops


@dataclass
class CommunicationLog:
    """What the collectives of one :class:`FP8ReduceScatter` sent: one (dtype, elements) entry per tensor
    handed to an all-to-all, and the elements of the gradient buffers they carried."""

    sent: list[tuple[torch.dtype, int]] = field(default_factory=list)
    buffer_elements: int = 0

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to all-to-alls (each rank receives as many)."""
        return sum(count * dtype.itemsize for dtype, count in self.sent)


class FP8ReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter as an all-to-all of block-scaled FP8 chunks, summed in float32 by the receiver
    (module docstring). Install it with :func:`fp8_reduce_scatter`."""

    def __init__(self, format: str | torch.dtype = "e4m3", block_size: int = 128) -> None:
        if block_size not in ops.GROUP_SIZES:
            raise ValueError(f"block_size must be one of {ops.GROUP_SIZES}, got {block_size!r}")
        self.fp8_dtype = ops.fp8_dtype(format)
        self.block_size = block_size
        self.log = CommunicationLog()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(
                f"coat's FP8 reduce-scatter sums or averages; FSDP2 asked for {op}. A gradient divide factor set with "
                "set_gradient_divide_factor makes FSDP2 ask for a premultiplied sum: leave it at its default."
            )
        world_size = group.size()
        chunks = input_tensor.view(world_size, -1)
        codes, scales, _ = ops.quantize_group(chunks, self.block_size, self.fp8_dtype)
        received_codes = torch.empty_like(codes)
        received_scales = torch.empty_like(scales)
        # uint8: not every backend takes float8 dtypes
        dist.all_to_all_single(received_codes.view(torch.uint8), codes.view(torch.uint8), group=group)
        dist.all_to_all_single(received_scales, scales, group=group)
        self.log.sent += [(torch.uint8, codes.numel()), (scales.dtype, scales.numel())]
        self.log.buffer_elements += input_tensor.numel()
        total = ops.dequantize(received_codes, received_scales, self.block_size, torch.float32).sum(dim=0)
        if op == dist.ReduceOp.AVG:
            total /= world_size
        output_tensor.copy_(total)
        return None


def fp8_reduce_scatter(model: torch.nn.Module, format: str | torch.dtype = "e4m3", block_size: int = 128) -> FP8ReduceScatter:
    """Makes every FSDP2 module in ``model`` (the modules ``fully_shard`` was applied to) reduce-scatter its
    gradients with one shared :class:`FP8ReduceScatter`, and returns it (its ``log`` counts what was sent).
    Call it after ``fully_shard``, on every rank."""
    comm = FP8ReduceScatter(format, block_size)
    sharded = [module for module in model.modules() if isinstance(module, FSDPModule)]
    if not sharded:
        raise ValueError("fp8_reduce_scatter needs a model sharded with fully_shard (FSDP2); call it after fully_shard")
    for module in sharded:
        module.set_custom_reduce_scatter(comm)
    return comm
