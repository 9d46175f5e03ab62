"""coat's FP8 modules: drop-in replacements that keep the parameter names of the modules they replace."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from coat.nn import functional as coat_functional
from coat.nn.config import FP8Config
from coat.nn.layers import ACTIVATION_FUNCTIONS


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


class RMSNorm(nn.Module):
    """RMSNorm (``weight * x / sqrt(mean(x^2) + eps)``, as LlamaRMSNorm) through coat's fused kernel, which
    saves its input as E4M3 in 1 x G groups (a quarter of the float32 input LlamaRMSNorm keeps, plus 1/8
    for the scales) and writes its output in FP8 per tensor. Inside a converted decoder layer that FP8
    output feeds the next GEMMs directly; called on its own, the module returns it dequantized, i.e. the
    values an FP8 linear layer after it would read."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, *, config: FP8Config = FP8Config()
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.config = config

    @classmethod
    def from_rmsnorm(cls, norm: nn.Module, config: FP8Config = FP8Config()) -> "RMSNorm":
        """From a transformers Llama/Mistral/Qwen2 RMSNorm (``weight``, ``variance_epsilon``) or a
        ``torch.nn.RMSNorm`` with a weight and an explicit eps; shares the weight parameter."""
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
            raise TypeError(
                f"coat.nn.RMSNorm.from_rmsnorm expects an RMSNorm with a 1-d weight and a float eps "
                f"(variance_epsilon or eps), got {type(norm).__name__}"
            )
        converted = cls(weight.shape[0], eps, device="meta", dtype=weight.dtype, config=config)
        converted.weight = weight
        return converted.train(norm.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return coat_functional.rms_norm(x, self.weight, self.eps, self.config)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, config={self.config}"


def activation_name(activation: nn.Module) -> str | None:
    """The fused kernel's name of a parameterless activation module: "silu" for nn.SiLU and transformers'
    SiLUActivation (hidden_act "silu" / "swish"), "gelu_tanh" for nn.GELU(approximate="tanh") and transformers'
    GELUTanh (PytorchGELUTanh, hidden_act "gelu_pytorch_tanh"; also the same formula as NewGELU / FastGELU),
    "quick_gelu" for transformers' QuickGELUActivation (hidden_act "quick_gelu"), None for any other (the erf GELU,
    hidden_act "gelu", among them). Modules other than torch's are probed on the CPU (whatever the default device: a
    model built and converted inside ``with torch.device("meta")`` has no values to probe there)."""
    if isinstance(activation, nn.SiLU):
        return "silu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else None
    if any(True for _ in activation.parameters()) or any(True for _ in activation.buffers()):
        return None
    probe = torch.tensor([-3.0, -0.5, 0.0, 0.75, 4.0], device="cpu")
    output = activation(probe)
    return next((name for name, f in ACTIVATION_FUNCTIONS.items() if torch.allclose(output, f(probe))), None)


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # a gated MLP's children, SwiGLUMLP's names


def converted_child(parent: nn.Module, name: str, expected: type) -> nn.Module:
    """``parent``'s child ``name``, checked to still be the coat module put there (by coat.convert or a coat
    module's constructor): coat's fused blocks read its parameters and compute it themselves, so a replacement
    (an adapter wrapping it, such as PEFT's LoRA layers) would be ignored without a word."""
    module = getattr(parent, name)
    if not isinstance(module, expected):
        raise TypeError(
            f"coat: {type(parent).__name__}.{name} is now a {type(module).__name__}, not the coat.nn."
            f"{expected.__name__} coat put there, and coat's fused code, which reads its parameters and computes "
            "it itself, would ignore it. Wrappers and adapters (e.g. PEFT's LoRA) are not supported inside "
            "converted layers: leave such layers unconverted (coat.convert(model, skip_modules=[...]))"
        )
    if module._forward_pre_hooks or module._forward_hooks:
        warnings.warn(
            f"coat: the forward hooks of {type(parent).__name__}.{name} never run: coat's fused code computes it "
            "without calling it (hooks on the converted layer itself do run)",
            stacklevel=3,
        )
    return module


class SwiGLUMLP(nn.Module):
    """LlamaMLP, ``down_proj(act(gate_proj(x)) * up_proj(x))``, in FP8: the input is quantized once for
    both gate and up GEMMs, act*mul runs as one fused kernel that saves gate and up as E4M3 in 1 x G
    groups and writes its product in FP8 for the down GEMM (optionally with Smooth-SwiGLU, see
    :class:`coat.nn.FP8Config`). ``activation``: "silu" (SwiGLU: Llama, Mistral, Qwen), "gelu_tanh"
    (GeGLU: Gemma's gelu_pytorch_tanh) or "quick_gelu". Children and parameter names are LlamaMLP's."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        config: FP8Config = FP8Config(),
        activation: str = "silu",
    ):
        super().__init__()
        if activation not in ACTIVATION_FUNCTIONS:
            raise ValueError(f"coat.nn.SwiGLUMLP: activation must be one of {tuple(ACTIVATION_FUNCTIONS)}, "
                             f"got {activation!r}")
        self.activation = activation
        factory = dict(device=device, dtype=dtype, config=config)
        self.gate_proj = Linear(hidden_size, intermediate_size, bias, **factory)
        self.up_proj = Linear(hidden_size, intermediate_size, bias, **factory)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, **factory)
        self.config = config

    @classmethod
    def from_mlp(cls, mlp: nn.Module, config: FP8Config = FP8Config()) -> "SwiGLUMLP":
        """From a module with ``gate_proj``, ``up_proj``, ``down_proj`` (nn.Linear) and an ``act_fn`` that
        :func:`activation_name` knows, as transformers' LlamaMLP, MistralMLP and Qwen2MLP (SiLU) and Gemma3MLP
        (gelu_pytorch_tanh); shares their parameters. An activation :func:`activation_name` does not know is refused
        (ValueError)."""
        projections = [getattr(mlp, name, None) for name in MLP_PROJECTIONS]
        if not all(isinstance(p, nn.Linear) for p in projections):
            raise TypeError(
                f"coat.nn.SwiGLUMLP.from_mlp expects gate_proj, up_proj and down_proj nn.Linear children, "
                f"got {type(mlp).__name__}"
            )
        act_fn = getattr(mlp, "act_fn", None)
        activation = activation_name(act_fn) if isinstance(act_fn, nn.Module) else None
        if activation is None:
            raise ValueError(
                f"coat.nn.SwiGLUMLP.from_mlp: {type(mlp).__name__}.act_fn must be SiLU (hidden_act='silu'), "
                f"the tanh GELU (hidden_act='gelu_pytorch_tanh') or quick_gelu, got {act_fn!r}; the fused kernel "
                "computes act(gate) * up for these only"
            )
        gate, up, down = projections
        converted = cls(
            gate.in_features, gate.out_features, device="meta", dtype=gate.weight.dtype, config=config,
            activation=activation,
        )
        converted.gate_proj, converted.up_proj, converted.down_proj = (
            Linear.from_linear(p, config) for p in projections
        )
        return converted.train(mlp.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (converted_child(self, name, Linear) for name in MLP_PROJECTIONS)
        return coat_functional.swiglu_mlp(
            x, (gate.weight, gate.bias), (up.weight, up.bias), (down.weight, down.bias), self.config,
            activation=self.activation,
        )

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, config={self.config}"


# A non-gated MLP's children, as transformers names them: (first, second projection) and the activation.
_MLP_LINEAR_NAMES = (("fc1", "fc2"), ("linear_fc1", "linear_fc2"))
_MLP_ACTIVATION_NAMES = ("activation_fn", "act_fn", "act")


def non_gated_mlp_layout(mlp: nn.Module) -> tuple[tuple[str, str], str] | None:
    """((fc1's name, fc2's name), the activation's name) of a non-gated MLP whose two projections are nn.Linear
    and whose activation :func:`activation_name` knows, as CLIPMLP, SiglipMLP, Idefics3VisionMLP, Qwen2-VL's
    VisionMlp and Qwen3VLVisionMLP; None for any other module."""
    for names in _MLP_LINEAR_NAMES:
        if all(type(getattr(mlp, name, None)) is nn.Linear for name in names):
            for act_name in _MLP_ACTIVATION_NAMES:
                act = getattr(mlp, act_name, None)
                if isinstance(act, nn.Module) and activation_name(act) is not None:
                    return names, act_name
    return None


class MLP(nn.Module):
    """A non-gated MLP, ``fc2(act(fc1(x)))``, in FP8: fc1's input is quantized per tensor, act runs as one fused
    kernel that saves fc1's output as E4M3 in 1 x G groups (the paper's mixed granularity) and writes its result in
    FP8 for fc2. It is :class:`SwiGLUMLP` without up (:func:`coat.nn.functional.mlp`). ``activation``: "gelu_tanh"
    (gelu_pytorch_tanh: SigLIP, Qwen3-VL), "quick_gelu" (CLIP, Qwen2-VL) or "silu". ``names``: the two linear
    children's names, those of the module it replaces (fc1 and fc2, or Qwen3-VL's linear_fc1 and linear_fc2), so
    that parameter names and state-dict keys stay."""

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        config: FP8Config = FP8Config(),
        activation: str = "gelu_tanh",
        names: tuple[str, str] = ("fc1", "fc2"),
    ):
        super().__init__()
        if activation not in ACTIVATION_FUNCTIONS:
            raise ValueError(f"coat.nn.MLP: activation must be one of {tuple(ACTIVATION_FUNCTIONS)}, "
                             f"got {activation!r}")
        self.activation, self.names, self.config = activation, tuple(names), config
        factory = dict(device=device, dtype=dtype, config=config)
        setattr(self, self.names[0], Linear(in_features, hidden_features, bias, **factory))
        setattr(self, self.names[1], Linear(hidden_features, in_features, bias, **factory))

    @classmethod
    def from_mlp(cls, mlp: nn.Module, config: FP8Config = FP8Config()) -> "MLP":
        """From a non-gated MLP that :func:`non_gated_mlp_layout` reads (transformers' CLIPMLP, SiglipMLP,
        Idefics3VisionMLP, Qwen2-VL's VisionMlp, Qwen3VLVisionMLP); shares its parameters. Raises a ValueError for
        any other, naming what it lacks (an erf GELU, hidden_act='gelu', has no fused kernel)."""
        layout = non_gated_mlp_layout(mlp)
        if layout is None:
            raise ValueError(
                f"coat.nn.MLP.from_mlp expects two nn.Linear children named fc1 and fc2 (or linear_fc1 and linear_fc2) "
                f"and an activation (activation_fn, act_fn or act) that is gelu_pytorch_tanh, quick_gelu or SiLU, got "
                f"{type(mlp).__name__}: {mlp!r}"
            )
        names, act_name = layout
        fc1, fc2 = (getattr(mlp, name) for name in names)
        converted = cls(fc1.in_features, fc1.out_features, device="meta", dtype=fc1.weight.dtype, config=config,
                        activation=activation_name(getattr(mlp, act_name)), names=names)
        for name, linear in zip(names, (fc1, fc2)):
            setattr(converted, name, Linear.from_linear(linear, config))
        return converted.train(mlp.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = (converted_child(self, name, Linear) for name in self.names)
        return coat_functional.mlp(x, (fc1.weight, fc1.bias), (fc2.weight, fc2.bias), self.config,
                                   activation=self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, config={self.config}"
