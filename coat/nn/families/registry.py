"""The registry of converted decoder layers: the coat class that each transformers decoder layer class becomes. The
family modules beside this one fill it (importing :mod:`coat.nn.families` imports them all); coat.convert reads it
to find the layers it converts, plans each layer's replacements, then installs them."""
from __future__ import annotations

import inspect

from torch import nn

from coat.compat import TRANSFORMERS_NEWEST, TRANSFORMERS_OLDEST, TRANSFORMERS_REQUIREMENT
from coat.nn.config import FP8Config
from coat.nn.decoder import stock_cache_argument
from coat.nn.modules import Linear, RMSNorm

#: transformers' decoder layer class -> the class a converted layer of it becomes
FP8_DECODER_LAYERS: dict[type[nn.Module], type[nn.Module]] = {}


#: decoder layers of models coat refuses by name, with the reason (class names: nothing of theirs is imported)
UNSUPPORTED_DECODER_LAYERS: dict[str, str] = {
    "GptOssDecoderLayer": "gpt-oss's experts compute a clamped SwiGLU with biases (not SiLU(gate) * up) and its "
                          "attention adds learned sinks to the softmax; coat's fused SiLU*mul and its attention plan "
                          "compute neither",
    "DeepseekV3DecoderLayer": "DeepSeek-V3's multi-head latent attention (low-rank q and kv projections with their own "
                              "norms and a RoPE on a separate part of the head) is not the q/k/v attention coat's "
                              "plan converts",
    "DeepseekV2DecoderLayer": "DeepSeek-V2's multi-head latent attention (low-rank q and kv projections with their own "
                              "norms and a RoPE on a separate part of the head) is not the q/k/v attention coat's "
                              "plan converts",
}


def register_decoder_layer(stock_class: type[nn.Module], fp8_class: type[nn.Module]) -> None:
    """Makes coat.convert turn layers of ``stock_class`` into ``fp8_class``: a subclass of it and of
    :class:`coat.nn.decoder.FP8DecoderLayerMixin`, which gives it the FP8 forward."""
    FP8_DECODER_LAYERS[stock_class] = fp8_class


def plan_decoder_layer(layer: nn.Module, name: str, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
    """The coat modules that replace the layer's children, as (parent, child name, replacement), built
    without touching the layer; raises a ValueError or TypeError that names what does not fit."""
    fp8_class = FP8_DECODER_LAYERS[type(layer)]
    if stock_cache_argument(type(layer).forward, fp8_class.layer_parameters) is None:
        parameters = ", ".join(inspect.signature(type(layer).forward).parameters)
        raise TypeError(
            f"coat.convert: cannot convert {name}: {type(layer).__name__}.forward({parameters}) is not the forward "
            f"of transformers {TRANSFORMERS_OLDEST} to {TRANSFORMERS_NEWEST}, which coat's converted layer mirrors; "
            f"it would drop the arguments it does not know. Install {TRANSFORMERS_REQUIREMENT}"
        )
    attn = getattr(layer, "self_attn", None)
    projections = tuple(name for group in fp8_class.attention_scale_groups for name in group)
    if attn is None or not all(isinstance(getattr(attn, p, None), nn.Linear) for p in projections):
        raise ValueError(f"coat.convert: {name}.self_attn must have nn.Linear children {', '.join(projections)}")
    try:
        return [
            *((attn, p, Linear.from_linear(getattr(attn, p), config)) for p in projections),
            *((layer, n, RMSNorm.from_rmsnorm(getattr(layer, n), config)) for n in fp8_class.norm_names()),
            *fp8_class.plan_mlp(layer, config),
            *fp8_class.plan_family_children(layer, config),
        ]
    except (TypeError, ValueError) as error:
        raise type(error)(f"coat.convert: cannot convert {name}: {error}") from error


def install_decoder_layer(layer: nn.Module, plan: list[tuple[nn.Module, str, nn.Module]], config: FP8Config) -> None:
    """Puts the planned modules in place and gives the layer its FP8 forward. Parameters are shared with
    the replaced modules, not copied, so the state dict and any optimizer keep working."""
    for parent, child_name, replacement in plan:
        setattr(parent, child_name, replacement)
    layer.fp8_config = config
    layer.cache_argument = stock_cache_argument(type(layer).forward, FP8_DECODER_LAYERS[type(layer)].layer_parameters)
    layer.__class__ = FP8_DECODER_LAYERS[type(layer)]
