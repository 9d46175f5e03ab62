"""Gemma 3's text decoder layer in coat's FP8 precision flow. What differs from Llama (coat.nn.decoder):

    every RMSNorm multiplies by (1 + weight), in float32         norm_weight_offset = 1 on every norm op
    q, k, v = before_attention(x)                                 input_layernorm -> FP8 -> q/k/v GEMMs
    q, k    = RoPE(q_norm(q)), RoPE(k_norm(k))                    per head, fused (coat.ops.qk_norm_rope), as Qwen3
    h       = x + post_attention_layernorm(o_proj(a))             after_attention(post_norm=...): the add in the
                                                                  norm's kernel, its input kept in FP8 groups
    out     = h + post_feedforward_layernorm(GeGLU(pre_feedforward_layernorm(h)))
                                                                  mlp_residual(activation="gelu_tanh", post_norm=...)

The rest is the model's and works as transformers runs it: sliding-window and global layers (each attention module
holds its window; the model hands each layer its RoPE tables), query_pre_attn_scalar (the attention's scaling),
the embeddings scaled by sqrt(hidden) (Gemma3TextScaledWordEmbedding, outside the layers), and the final logit
soft-cap, which the fused LM head + loss applies (coat.nn.causal_lm).
"""
from __future__ import annotations

from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

from coat.nn.decoder import LAYER_PARAMETERS, FP8DecoderLayerMixin, HeadNormsMixin
from coat.nn.families.registry import register_decoder_layer


class FP8Gemma3DecoderLayer(HeadNormsMixin, FP8DecoderLayerMixin, Gemma3DecoderLayer):
    """A Gemma3DecoderLayer converted by coat.convert."""

    layer_parameters = LAYER_PARAMETERS - {"use_cache"}
    input_norm = "input_layernorm"
    mlp_norm = "pre_feedforward_layernorm"
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    norm_weight_offset = 1.0


register_decoder_layer(Gemma3DecoderLayer, FP8Gemma3DecoderLayer)
