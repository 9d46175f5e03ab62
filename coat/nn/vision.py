"""The vision side of transformers' vision-language models, which ``coat.convert(model, vision_linears=True)``
puts through FP8 GEMMs: every ``torch.nn.Linear`` of the vision tower and of the projector becomes a
:class:`coat.nn.Linear` (attention's q/k/v and output projections, the MLP's, the projector's or patch merger's),
sharing its parameters. Subclasses of nn.Linear are left out: nn.MultiheadAttention's output projection (in
SigLIP's pooling head) is read by its weight, not called. Everything else there stays as transformers computes
it: the patch embedding (a convolution), LayerNorms, activations (GELU, Qwen2.5-VL's gated SiLU), attention,
Gemma 3's projector (a matrix product with a plain parameter, not a linear layer).

This module imports transformers (the releases of coat.compat); coat.convert imports it on use.
"""
from __future__ import annotations

from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

# The vision side of each model: its vision tower and projector (the Qwen models' patch merger is in "visual").
VISION_MODULES = {
    LlavaForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    Gemma3ForConditionalGeneration: ("model.vision_tower", "model.multi_modal_projector"),
    Qwen2_5_VLForConditionalGeneration: ("model.visual",),
    Qwen3VLForConditionalGeneration: ("model.visual",),
}


def vision_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The qualified names and modules of the ``nn.Linear`` layers on the vision side of ``model``; raises a
    ValueError for a model whose vision side coat does not know."""
    prefixes = next((names for cls, names in VISION_MODULES.items() if isinstance(model, cls)), None)
    if prefixes is None:
        known = ", ".join(cls.__name__ for cls in VISION_MODULES)
        raise ValueError(
            f"coat.convert: vision_linears=True converts the vision side of {known}; {type(model).__name__} is "
            "none of them. Name its vision modules' linear layers in modules_to_convert instead (with the "
            "decoder layers', e.g. ['model.language_model.layers.*', 'model.vision_tower.*'])"
        )
    prefixes = tuple(f"{name}." for name in prefixes)
    return [(name, module) for name, module in model.named_modules()
            if type(module) is nn.Linear and name.startswith(prefixes)]
