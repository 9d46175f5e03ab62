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

from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from coat.nn.decoder import FP8DecoderLayerMixin, HeadNormsMixin
from coat.nn.families.registry import register_decoder_layer


class FP8Qwen3DecoderLayer(HeadNormsMixin, FP8DecoderLayerMixin, Qwen3DecoderLayer):
    """A Qwen3DecoderLayer converted by coat.convert."""


register_decoder_layer(Qwen3DecoderLayer, FP8Qwen3DecoderLayer)
