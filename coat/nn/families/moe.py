"""The decoder layers of transformers' mixture-of-experts causal LMs in coat's FP8 precision flow: Qwen3-MoE,
Qwen2-MoE, Mixtral and OLMoE. Attention is their dense family's (Qwen3's per-head q/k norms, Qwen2's biases and
windows, Mistral's window, OLMo 2's whole-projection q/k norms); the sparse MLP block is

    n        = RMSNorm(h)                           coat.ops.rmsnorm_save: 16-bit n, h kept in FP8 1 x G groups
    w, e     = router(n)                            the model's own router module, in high precision (its logits
                                                    are what transformers records for the auxiliary loss)
    out      = h + experts(n, e, w)                 coat.nn.experts.fp8_experts: FP8 grouped GEMMs
                 [+ sigmoid(shared_gate(n)) * shared_expert(n)]    Qwen2-MoE: the shared expert as coat's SwiGLUMLP

n is kept once, by the router and the experts together. Layers whose MLP is dense (Qwen3-MoE's and Qwen2-MoE's
mlp_only_layers, decoder_sparse_step) are converted as the dense families'.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

from coat.nn import functional as coat_functional
from coat.nn.config import FP8Config
from coat.nn.decoder import LAYER_PARAMETERS, FP8DecoderLayerMixin, HeadNormsMixin
from coat.nn.families.olmo2 import ProjectionNormsMixin
from coat.nn.families.registry import register_decoder_layer
from coat.nn.experts import fp8_experts
from coat.nn.modules import RMSNorm, SwiGLUMLP, activation_name, converted_child


def is_sparse_block(mlp: nn.Module) -> bool:
    """Whether an MLP is transformers' sparse MoE block: a router ``gate`` and 3-D ``experts``."""
    return hasattr(mlp, "gate") and isinstance(getattr(getattr(mlp, "experts", None), "gate_up_proj", None),
                                               nn.Parameter)


def _check_sparse_block(mlp: nn.Module) -> str:
    """The experts' activation; raises a ValueError naming what coat's experts do not compute."""
    experts = mlp.experts
    gate_up, down = experts.gate_up_proj, getattr(experts, "down_proj", None)
    layout = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True)
    differing = {name: getattr(experts, name) for name, value in layout.items() if getattr(experts, name, value) != value}
    if differing or not isinstance(down, nn.Parameter) or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"coat's experts compute gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases "
                         f"({type(experts).__name__} has {differing or 'other parameters'})")
    if gate_up.shape[2] % 16 or down.shape[2] % 16:
        raise ValueError(f"the FP8 grouped GEMM needs hidden and expert intermediate sizes that are multiples of 16, "
                         f"got {gate_up.shape[2]} and {down.shape[2]}")
    if getattr(mlp, "jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise={mlp.jitter_noise} multiplies the block's input by noise in place, "
                         "which coat's MoE block does not; set it to 0")
    activation = activation_name(experts.act_fn)
    if activation is None:
        raise ValueError(f"the experts' act_fn must be SiLU or the tanh GELU, got {experts.act_fn!r}")
    return activation


class SparseMoEMixin:
    """The sparse MLP block of a converted MoE decoder layer (see the module docstring)."""

    experts_activation: str  # the experts' act_fn as the fused kernel names it, set by the plan

    def _mlp_residual(self, hidden_states):
        mlp = self.mlp
        if not is_sparse_block(mlp):
            return super()._mlp_residual(hidden_states)
        norm = converted_child(self, self.mlp_norm, RMSNorm)
        normed = coat_functional.rms_norm_save(hidden_states, norm.weight, norm.eps, self.fp8_config)
        # The router and the experts read the same 16-bit tensor, so autograd keeps one copy for both.
        flat = normed.to(coat_functional.output_dtype(normed)).reshape(-1, normed.shape[-1])
        _, weights, index = mlp.gate(flat)
        out = fp8_experts(flat, index, weights, mlp.experts.gate_up_proj, mlp.experts.down_proj, self.fp8_config,
                          activation=self.experts_activation)
        if getattr(mlp, "shared_expert", None) is not None:
            shared = converted_child(mlp, "shared_expert", SwiGLUMLP)
            out = out + torch.sigmoid(mlp.shared_expert_gate(flat)) * shared(flat)
        return hidden_states + out.view(hidden_states.shape)

    @classmethod
    def plan_mlp(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        mlp = layer.mlp
        if not is_sparse_block(mlp):
            return super().plan_mlp(layer, config)
        activation = _check_sparse_block(mlp)
        if config.smooth_swiglu:
            raise ValueError("smooth_swiglu is not supported in MoE layers (its per-channel scale would be per expert)")
        if config.gradient_dtype is None:
            raise ValueError("gradient_format=None is not supported in MoE layers; use 'e5m2' or 'e4m3'")
        plan = [(layer, "experts_activation", activation)]  # probed once here, not at every forward
        shared = getattr(mlp, "shared_expert", None)
        return plan if shared is None else [*plan, (mlp, "shared_expert", SwiGLUMLP.from_mlp(shared, config))]


class FP8Qwen3MoeDecoderLayer(SparseMoEMixin, HeadNormsMixin, FP8DecoderLayerMixin, Qwen3MoeDecoderLayer):
    """A Qwen3MoeDecoderLayer converted by coat.convert."""


class FP8Qwen2MoeDecoderLayer(SparseMoEMixin, FP8DecoderLayerMixin, Qwen2MoeDecoderLayer):
    """A Qwen2MoeDecoderLayer converted by coat.convert."""


class FP8MixtralDecoderLayer(SparseMoEMixin, FP8DecoderLayerMixin, MixtralDecoderLayer):
    """A MixtralDecoderLayer converted by coat.convert."""

    layer_parameters = LAYER_PARAMETERS - {"use_cache"}


class FP8OlmoeDecoderLayer(SparseMoEMixin, ProjectionNormsMixin, FP8DecoderLayerMixin, OlmoeDecoderLayer):
    """An OlmoeDecoderLayer converted by coat.convert."""

    @classmethod
    def plan_family_children(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        clip = layer.self_attn.config.clip_qkv
        if clip is not None:
            raise ValueError(f"clip_qkv={clip} clamps q, k and v in place, which coat's attention does not; set it to "
                             "None")
        return super().plan_family_children(layer, config)


register_decoder_layer(Qwen3MoeDecoderLayer, FP8Qwen3MoeDecoderLayer)
register_decoder_layer(Qwen2MoeDecoderLayer, FP8Qwen2MoeDecoderLayer)
register_decoder_layer(MixtralDecoderLayer, FP8MixtralDecoderLayer)
register_decoder_layer(OlmoeDecoderLayer, FP8OlmoeDecoderLayer)
