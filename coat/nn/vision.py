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

:func:`convert_vision_attention`, which coat.convert applies to every vision-language model with or without
vision_linears, keeps the vision tower's attention off cuDNN's SDPA kernel, whose backward can make NaN there
(:func:`avoid_cudnn_attention`, :mod:`coat.nn.attention`), and has the Qwen towers attend within equal-length
windows or pictures in one call rather than one call each (:func:`batch_equal_chunks`).

This module imports transformers (the releases of coat.compat); coat.convert imports it on use.
"""
from __future__ import annotations

import functools
import importlib

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForConditionalGeneration
from transformers.models.idefics3.modeling_idefics3 import Idefics3ForConditionalGeneration
from transformers.models.internvl.modeling_internvl import InternVLForConditionalGeneration
from transformers.models.llava.modeling_llava import LlavaForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import LlavaNextForConditionalGeneration
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionForConditionalGeneration
from transformers.models.mistral3.modeling_mistral3 import Mistral3ForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VLForConditionalGeneration,
                                                                Qwen2_5_VLVisionAttention)
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention as Qwen2VLVisionAttention
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLVisionAttention
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (Qwen3VLMoeForConditionalGeneration,
                                                                  Qwen3VLMoeVisionAttention)
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMForConditionalGeneration
from transformers.utils.generic import is_flash_attention_requested

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


class _Subclasses:
    """The subclasses that one of this module's functions gives transformers' modules in place (``module.__class__
    = ...``): ``namespace(base)`` is that subclass of ``base``, made once, with ``attributes(base)`` (its forward).
    Each keeps its base's name, by which transformers and the Trainer find modules (_no_split_modules, FSDP
    wrapping, the outputs a model records), and is ``<namespace>.<module path, ':' for '.'>:<class>`` in this
    module: where pickle (torch.save of a whole model) finds it again, in any process."""

    def __init__(self, name: str, attributes):
        self._name, self._attributes = name, attributes
        self._made: dict[type, type] = {}

    def __call__(self, base: type) -> type:
        if base not in self._made:
            module_path = base.__module__.replace(".", ":")
            self._made[base] = type(base.__name__, (base,), {
                **self._attributes(base), "__module__": __name__,
                "__qualname__": f"{self._name}.{module_path}:{base.__qualname__}"})
        return self._made[base]

    def __reduce__(self) -> str:
        # By name: pickle protocols below 4 store a class of a dotted qualified name as getattr(this, rest)
        return self._name

    def __getattr__(self, name: str) -> type:
        if name.startswith("_"):  # not a class path; an instance being built has no attributes yet
            raise AttributeError(name)
        module_path, _, class_name = name.rpartition(":")
        try:
            base = getattr(importlib.import_module(module_path.replace(":", ".")), class_name)
        except (ImportError, ValueError, AttributeError) as error:
            raise AttributeError(name) from error
        return self(base)


def _without_cudnn_attributes(base: type) -> dict:
    @functools.wraps(base.forward)  # the signature, which transformers and the Trainer read
    def forward(self, *args, **kwargs):
        with sdpa_without_cudnn():
            return base.forward(self, *args, **kwargs)

    return {"forward": forward, "avoids_cudnn_attention": True,
            "__doc__": f"A {base.__name__} whose attention avoids cuDNN's SDPA kernel (coat.nn.attention)."}


WithoutCudnnAttention = _Subclasses("WithoutCudnnAttention", _without_cudnn_attributes)


def avoid_cudnn_attention(model: nn.Module) -> bool:
    """Runs the layers of the vision tower of ``model`` (one of VISION_MODULES' classes), where all of its attention
    is, under :func:`coat.nn.attention.sdpa_without_cudnn`, in place: each becomes an instance of a subclass of its
    class with that forward, which gradient checkpointing's recomputation runs too; modules, parameters and state
    dict stay. (The tower itself keeps its class: transformers finds what its outputs record by it.) Returns False,
    changing nothing, for a model whose vision side coat does not know. coat.convert calls it
    (:func:`convert_vision_attention`)."""
    names = vision_modules(model)
    if names is None:
        return False
    for module in model.get_submodule(names[0]).modules():
        if isinstance(module, GradientCheckpointingLayer) and not getattr(module, "avoids_cudnn_attention", False):
            module.__class__ = WithoutCudnnAttention(type(module))
    return True


# The Qwen towers' attention modules, whose forward without FlashAttention runs one attention call per chunk of
# cu_seqlens: per window of 8 x 8 patches in Qwen2.5-VL's windowed blocks (64 for an 896-pixel picture, in 28 of
# its 32 blocks), per picture in its other blocks and in Qwen2-VL's and Qwen3-VL's.
CHUNKED_VISION_ATTENTION = (Qwen2VLVisionAttention, Qwen2_5_VLVisionAttention, Qwen3VLVisionAttention,
                            Qwen3VLMoeVisionAttention)


def equal_length_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """(count, length) of each run of consecutive chunks of one length, in order; chunks of length 0 left out."""
    runs: list[list[int]] = []
    for length in lengths:
        if length == 0:
            continue
        if runs and runs[-1][1] == length:
            runs[-1][0] += 1
        else:
            runs.append([1, length])
    return [(count, length) for count, length in runs]


def _chunks_batched_attributes(base: type) -> dict:
    stock = importlib.import_module(base.__module__)  # its rotary and eager attention, as its forward takes them

    @functools.wraps(base.forward)
    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        if is_flash_attention_requested(self.config):  # one variable-length call already
            return base.forward(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        seq_length = hidden_states.shape[0]
        query, key, value = (self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1)
                             .permute(1, 0, 2, 3).unbind(0))  # each [S, heads, head_dim]
        cos, sin = position_embeddings
        query, key = stock.apply_rotary_pos_emb_vision(query, key, cos, sin)  # copies
        # A copy, kept for backward in place of the whole qkv output a view would keep alive (2/3 of it q and k)
        value = value.contiguous()
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          stock.eager_attention_forward)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # the stock forward's host sync, once
        if sum(lengths) != seq_length:
            raise ValueError(f"{base.__name__}: cu_seqlens covers {sum(lengths)} patches of {seq_length}")
        outputs, start = [], 0
        for count, length in equal_length_runs(lengths):
            end = start + count * length

            def chunks(tensor, start=start, end=end, count=count, length=length):  # [count, heads, length, head_dim]
                return tensor[start:end].view(count, length, self.num_heads, -1).transpose(1, 2)

            output = attention(self, chunks(query), chunks(key), chunks(value), attention_mask=None,
                               scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout,
                               is_causal=False, **kwargs)[0]  # [count, length, heads, head_dim]
            outputs.append(output.reshape(end - start, -1))
            start = end
        return self.proj(torch.cat(outputs) if len(outputs) > 1 else outputs[0])

    return {"forward": forward, "batches_equal_chunks": True,
            "__doc__": f"A {base.__name__} that attends within each run of equal-length chunks of cu_seqlens in one "
                       "call (coat.nn.vision.batch_equal_chunks)."}


ChunksBatched = _Subclasses("ChunksBatched", _chunks_batched_attributes)


def batch_equal_chunks(model: nn.Module) -> bool:
    """Gives the Qwen vision towers' attention modules of ``model`` (CHUNKED_VISION_ATTENTION) a forward that, where
    FlashAttention is not requested, attends within each run of consecutive equal-length chunks of cu_seqlens (the
    windows of one row of Qwen2.5-VL's window grid, the pictures of one size) in one batched call, a batch entry per
    chunk, instead of one call per chunk: the same attention, whose host work (~1,800 calls a step each way at
    Qwen2.5-VL-3B's 896-pixel picture) left the GPU idle. It keeps a copy of the values for backward rather than a
    view, which would keep the whole qkv output (0.6 GiB at that picture over Qwen2.5-VL-3B's 32 blocks). In place:
    modules, parameters and state dict stay; the interface of ``config._attn_implementation`` (sdpa, eager) still
    computes it. Returns whether ``model`` had such modules. coat.convert calls it
    (:func:`convert_vision_attention`)."""
    found = False
    for module in model.modules():
        if isinstance(module, CHUNKED_VISION_ATTENTION):
            found = True
            if not getattr(module, "batches_equal_chunks", False):
                module.__class__ = ChunksBatched(type(module))
    return found


def convert_vision_attention(model: nn.Module) -> bool:
    """The vision attention of ``model`` as coat.convert runs it, in place: :func:`avoid_cudnn_attention` and
    :func:`batch_equal_chunks`. Returns False, changing nothing, for a model whose vision side coat does not know.
    A BF16 run compared with a coat one calls it, so that only the precision differs."""
    if not avoid_cudnn_attention(model):
        return False
    batch_equal_chunks(model)
    return True
