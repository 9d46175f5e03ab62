"""The seeds of coat.optim.AdamW's stochastic rounding (param_rounding="stochastic"): one per step from the group's
rounding_seed, one per parameter from that, offset by a shard's place in its whole tensor so that a sharded run
rounds as an unsharded one."""
from __future__ import annotations

import torch

from coat.optim.sharding import global_offset

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_MASK32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def draw_seed() -> int:
    """torch's default generator's seed: torch.manual_seed fixes it, and reading it draws nothing from the
    generator, so building the optimizer leaves the user's random stream as torch.optim.AdamW does."""
    return torch.initial_seed()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def step_seed(base: int, step: float) -> int:
    """The stochastic-rounding seed of one step, from which every parameter's is derived (_param_seed). One
    hash per step: hashing per parameter in Python kept the GPU waiting."""
    return _splitmix64(_splitmix64(base & _MASK64) ^ int(step)) >> 1


def param_seed(step_seed: int, param_index: int, param: torch.Tensor) -> int:
    """The seed of parameter ``param_index`` of the optimizer at one step, in [0, 2**63). A DTensor shard's
    global offset is added to the seed's low word, where the kernel adds the element index (coat/adamw.h):
    every shard then draws the bits of its elements in the whole tensor, and a sharded run rounds exactly as
    an unsharded one."""
    seed = (step_seed + param_index * _GOLDEN) & _MASK63
    offset = global_offset(param)
    return (seed & ~_MASK32) | ((seed + offset) & _MASK32)

