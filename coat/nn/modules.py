"""coat's FP8 modules: drop-in replacements that keep the parameter names of the modules they replace."""
from __future__ import annotations

import torch
from torch import nn

from coat.nn import functional as coat_functional
from coat.nn.config import FP8Config


class Linear(nn.Linear):
    """``torch.nn.Linear`` with FP8 GEMMs (see :mod:`coat.nn.functional`): same parameters (``weight``,
    ``bias``), same initialization, same state dict. It saves only the FP8 transposed input and its scale
    for backward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: FP8Config = FP8Config(),
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: FP8Config = FP8Config()) -> "Linear":
        """A coat Linear that shares ``linear``'s parameter objects (so optimizers, tied weights and
        state-dict keys are unaffected) and its train/eval mode."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"coat.nn.Linear.from_linear expects a torch.nn.Linear, got {type(linear).__name__}")
        converted = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
            config=config,
        )
        converted.weight = linear.weight
        converted.bias = linear.bias
        return converted.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return coat_functional.linear(x, self.weight, self.bias, self.config)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config}"
