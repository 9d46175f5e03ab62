"""The vision side of transformers' vision-language models, which ``coat.convert(model, vision_linears=True)``
puts through FP8 GEMMs. A gated MLP there (Qwen2.5-VL's tower and Pixtral's, Mistral 3's: ``down_proj(silu(
gate_proj(x)) * up_proj(x))``) becomes a :class:`coat.nn.SwiGLUMLP`, as a decoder layer's MLP does: its input
quantized once for gate and up, the fused SiLU*mul kernel saving gate and up in FP8 and writing the down GEMM's
FP8 input. A non-gated MLP with a tanh GELU or quick_gelu (``fc2(act(fc1(x)))``: CLIP's in LLaVA, SigLIP's in
Gemma 3, LLaVA-OneVision and SmolVLM, Qwen2-VL's and Qwen3-VL's) becomes a :class:`coat.nn.MLP`, the same without
up: fc1's output saved in FP8 groups, the activation's output written in FP8 for fc2. Every other
``torch.nn.Linear`` of the vision tower and of the projector becomes a :class:`coat.nn.Linear` (attention's q/k/v
and output projections, fc1 / fc2 of MLPs with the erf GELU, which has no fused kernel (InternVL's), the
projector's or patch merger's), sharing its parameters. Subclasses of nn.Linear are left out:
nn.MultiheadAttention's output projection (in SigLIP's pooling head) is read by its weight, not called.
Everything else there stays as transformers computes it: the patch embedding (a convolution), the norms, the erf
GELU activations, attention, Gemma 3's projector (a matrix product with a plain parameter, not a linear layer).

:func:`avoid_cudnn_attention`, which coat.convert applies to every vision-language model with or without
vision_linears, keeps the vision tower's attention off cuDNN's SDPA kernel, whose backward can make NaN there
(:mod:`coat.nn.attention`).

This module imports transformers (the releases of coat.compat); coat.convert imports it on use.
"""
from __future__ import annotations

import functools
import importlib

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForConditionalGeneration
from transformers.models.idefics3.modeling_idefics3 import Idefics3ForConditionalGeneration
from transformers.models.internvl.modeling_internvl import InternVLForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import LlavaNextForConditionalGeneration
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionForConditionalGeneration
from transformers.models.mistral3.modeling_mistral3 import Mistral3ForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMForConditionalGeneration

from coat.nn.attention import sdpa_without_cudnn
from coat.nn.modules import MLP, MLP_PROJECTIONS, SwiGLUMLP, activation_name, non_gated_mlp_layout

# The vision side of each model: its vision tower and projector (the Qwen models' patch merger is in "visual").
VISION_MODULES = {
    LlavaForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    LlavaNextForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    LlavaOnevisionForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    Mistral3ForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    InternVLForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    Idefics3ForConditionalGeneration: ("model.vision_model", "model.connector"),
    SmolVLMForConditionalGeneration: ("model.vision_model", "model.connector"),
    Gemma3ForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    Qwen2VLForConditionalGeneration: ("model.visual",),
    Qwen2_5_VLForConditionalGeneration: ("model.visual",),
    Qwen3VLForConditionalGeneration: ("model.visual",),
    Qwen3VLMoeForConditionalGeneration: ("model.visual",),
}


def vision_modules(model: nn.Module) -> tuple[str, ...] | None:
    """The qualified names of the vision tower and projector of ``model``, the tower first; None for a model
    whose vision side coat does not know."""
    return next((names for cls, names in VISION_MODULES.items() if isinstance(model, cls)), None)


def _vision_side(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The qualified names and modules inside the vision side of ``model``; raises a ValueError for a model whose
    vision side coat does not know."""
    prefixes = vision_modules(model)
    if prefixes is None:
        known = ", ".join(cls.__name__ for cls in VISION_MODULES)
        raise ValueError(
            f"coat.convert: vision_linears=True converts the vision side of {known}; {type(model).__name__} is "
            "none of them. Name its vision modules' linear layers in modules_to_convert instead (with the "
            "decoder layers', e.g. ['model.language_model.layers.*', 'model.vision_tower.*'])"
        )
    prefixes = tuple(f"{name}." for name in prefixes)
    return [(name, module) for name, module in model.named_modules() if name.startswith(prefixes)]


def vision_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The qualified names and modules of the ``nn.Linear`` layers on the vision side of ``model``; raises a
    ValueError for a model whose vision side coat does not know."""
    return [(name, module) for name, module in _vision_side(model) if type(module) is nn.Linear]


def vision_mlps(model: nn.Module) -> list[tuple[str, nn.Module, type]]:
    """The qualified names and modules of the MLPs on the vision side of ``model`` that a fused coat MLP takes, each
    with that class: :class:`coat.nn.SwiGLUMLP` for a gated one (``gate_proj``, ``up_proj`` and ``down_proj``
    ``nn.Linear`` children and an ``act_fn`` that :func:`coat.nn.modules.activation_name` knows), :class:`coat.nn.MLP`
    for a non-gated one (:func:`coat.nn.modules.non_gated_mlp_layout`). Raises as :func:`vision_linears`."""
    def gated(module: nn.Module) -> bool:
        projections = [getattr(module, name, None) for name in MLP_PROJECTIONS]
        act_fn = getattr(module, "act_fn", None)
        return (all(type(p) is nn.Linear for p in projections) and isinstance(act_fn, nn.Module)
                and activation_name(act_fn) is not None)

    found = []
    for name, module in _vision_side(model):
        if gated(module):
            found.append((name, module, SwiGLUMLP))
        elif non_gated_mlp_layout(module) is not None:
            found.append((name, module, MLP))
    return found


def _forward_without_cudnn(base_forward):
    @functools.wraps(base_forward)  # the signature, which transformers and the Trainer read
    def forward(self, *args, **kwargs):
        with sdpa_without_cudnn():
            return base_forward(self, *args, **kwargs)

    return forward


@functools.cache
def _without_cudnn_class(base: type) -> type:
    # The class keeps its name: transformers and the Trainer find layers by it (_no_split_modules, FSDP wrapping).
    # Its qualified name leads pickle to it through WithoutCudnnAttention, in any process.
    module_path = base.__module__.replace(".", ":")
    return type(base.__name__, (base,), {
        "forward": _forward_without_cudnn(base.forward),
        "avoids_cudnn_attention": True,
        "__doc__": f"A {base.__name__} whose attention avoids cuDNN's SDPA kernel (coat.nn.attention).",
        "__module__": __name__,
        "__qualname__": f"WithoutCudnnAttention.{module_path}:{base.__qualname__}",
    })


class _ClassesWithoutCudnn:
    """``WithoutCudnnAttention.<module path, ':' for '.'>:<class>`` is the subclass of that class that
    avoid_cudnn_attention gives a layer: where pickle (torch.save of a whole model) finds it again."""

    def __getattr__(self, name: str) -> type:
        module_path, _, class_name = name.rpartition(":")
        try:
            base = getattr(importlib.import_module(module_path.replace(":", ".")), class_name)
        except (ImportError, ValueError, AttributeError) as error:
            raise AttributeError(name) from error
        return _without_cudnn_class(base)


WithoutCudnnAttention = _ClassesWithoutCudnn()


def avoid_cudnn_attention(model: nn.Module) -> bool:
    """Runs the layers of the vision tower of ``model`` (one of VISION_MODULES' classes), where all of its attention
    is, under :func:`coat.nn.attention.sdpa_without_cudnn`, in place: each becomes an instance of a subclass of its
    class with that forward, which gradient checkpointing's recomputation runs too; modules, parameters and state
    dict stay. (The tower itself keeps its class: transformers finds what its outputs record by it.) Returns False,
    changing nothing, for a model whose vision side coat does not know. coat.convert calls it; a BF16 run compared
    with a coat one calls it too, so that both take the same attention kernels."""
    names = vision_modules(model)
    if names is None:
        return False
    for module in model.get_submodule(names[0]).modules():
        if isinstance(module, GradientCheckpointingLayer) and not getattr(module, "avoids_cudnn_attention", False):
            module.__class__ = _without_cudnn_class(type(module))
    return True
