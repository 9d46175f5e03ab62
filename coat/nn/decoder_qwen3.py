"""Qwen3's decoder layer in coat's FP8 precision flow: Llama's (coat.nn.decoder), with the per-head RMSNorm
of q and of k (q_norm, k_norm, weight [head_dim]) that Qwen3 applies to the projections' outputs before RoPE.

    q, k, v = before_attention(x)                       as Llama: RMSNorm -> FP8 -> q/k/v GEMMs
    q, k    = RoPE(q_norm(q)), RoPE(k_norm(k))          coat.ops.qk_norm_rope: one kernel forward, which keeps
                                                        q and k (the norms' inputs) in E4M3 1 x G groups
    ...                                                 attention, o_proj + residual, MLP as Llama

Per-layer sliding windows (layer_types) and attention biases work as in Qwen2: the attention reads the
layer's window, the projections add their biases.
"""
from __future__ import annotations

from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from coat.nn import functional as coat_functional
from coat.nn.config import FP8Config
from coat.nn.decoder import FP8_DECODER_LAYERS, FP8DecoderLayerMixin
from coat.nn.modules import RMSNorm, converted_child
from coat.ops import QK_NORM_MAX_HEAD_DIM

_HEAD_NORMS = ("q_norm", "k_norm")


class HeadNormsMixin:
    """Per-head q_norm / k_norm (weight [head_dim]) before RoPE, fused with it (coat.ops.qk_norm_rope); the norm
    weights offset by the layer's norm_weight_offset (Gemma 3's (1 + w))."""

    def _position_queries_keys(self, query, key, cos, sin):
        q_norm, k_norm = (converted_child(self.self_attn, name, RMSNorm) for name in _HEAD_NORMS)
        return coat_functional.qk_norm_rotary_embedding(query, key, q_norm.weight, k_norm.weight, q_norm.eps, cos,
                                                        sin, self.fp8_config, weight_offset=self.norm_weight_offset)

    @classmethod
    def plan_family_children(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        attn = layer.self_attn
        if attn.head_dim > QK_NORM_MAX_HEAD_DIM:
            raise ValueError(f"head_dim {attn.head_dim} is above the {QK_NORM_MAX_HEAD_DIM} that coat's fused q/k "
                             "norm kernel takes; leave such layers unconverted (skip_modules)")
        norms = [RMSNorm.from_rmsnorm(getattr(attn, name), config) for name in _HEAD_NORMS]
        if norms[0].eps != norms[1].eps:  # one kernel normalizes both
            raise ValueError(f"q_norm and k_norm must share one eps, got {norms[0].eps} and {norms[1].eps}")
        return [(attn, name, norm) for name, norm in zip(_HEAD_NORMS, norms)]


class FP8Qwen3DecoderLayer(HeadNormsMixin, FP8DecoderLayerMixin, Qwen3DecoderLayer):
    """A Qwen3DecoderLayer converted by coat.convert."""


FP8_DECODER_LAYERS[Qwen3DecoderLayer] = FP8Qwen3DecoderLayer
