"""OLMo 2's decoder layer in coat's FP8 precision flow. Olmo2DecoderLayer has no pre-norms: its norms act on the
blocks' outputs, before the residual adds, and on the whole q and k projections (q_norm [Hq * D], k_norm [Hk * D])
before RoPE:

    q, k, v = before_attention(x)                  no norm: x quantized per tensor once, for the three GEMMs
    q, k    = RoPE(q_norm(q)), RoPE(k_norm(k))     rms_norm_save: 16-bit outputs, inputs kept in FP8 1 x G groups
    h       = x + post_attention_layernorm(o_proj(a))        after_attention(post_norm=...): add in the norm's kernel
    out     = h + post_feedforward_layernorm(MLP(h))         mlp_residual(None, post_norm=...): MLP reads h itself

Every norm is OLMo2RMSNorm's (w * x_f32 * rstd).to(x.dtype), in one float32 pass (coat.ops.rmsnorm_save).
"""
from __future__ import annotations

from torch import nn
from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

from coat.nn import functional as coat_functional
from coat.nn.config import FP8Config
from coat.nn.decoder import FP8DecoderLayerMixin
from coat.nn.families.registry import register_decoder_layer
from coat.nn.modules import RMSNorm, converted_child
from coat.ops import RMSNORM_MAX_COLS

_PROJECTION_NORMS = ("q_norm", "k_norm")


class ProjectionNormsMixin:
    """RMSNorms over the whole q and k projections (q_norm [Hq * D], k_norm [Hk * D]) before RoPE, with 16-bit
    outputs and FP8-saved inputs: OLMo 2's, and OLMoE's (coat.nn.families.moe)."""

    def _position_queries_keys(self, query, key, cos, sin):
        q_norm, k_norm = (converted_child(self.self_attn, name, RMSNorm) for name in _PROJECTION_NORMS)
        # The norms span every head of the projection: [B, S, heads, D] is read as [B, S, heads * D].
        query, key = (
            coat_functional.rms_norm_save(t.flatten(-2), norm.weight, norm.eps, self.fp8_config).view_as(t)
            for t, norm in ((query, q_norm), (key, k_norm))
        )
        return coat_functional.rotary_embedding(query, key, cos, sin)

    @classmethod
    def plan_family_children(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        attn = layer.self_attn
        norms = [RMSNorm.from_rmsnorm(getattr(attn, name), config) for name in _PROJECTION_NORMS]
        widths = [attn.q_proj.out_features, attn.k_proj.out_features]
        if any(norm.weight.shape[0] != width for norm, width in zip(norms, widths)):
            raise ValueError(f"q_norm and k_norm must span the q and k projections ({widths}), got "
                             f"{[tuple(norm.weight.shape) for norm in norms]}")
        if max(widths) > RMSNORM_MAX_COLS:
            raise ValueError(f"the q/k projections are {max(widths)} wide, above the {RMSNORM_MAX_COLS} that "
                             "coat's RMSNorm kernels take; leave such layers unconverted (skip_modules)")
        return [(attn, name, norm) for name, norm in zip(_PROJECTION_NORMS, norms)]


class FP8Olmo2DecoderLayer(ProjectionNormsMixin, FP8DecoderLayerMixin, Olmo2DecoderLayer):
    """An Olmo2DecoderLayer converted by coat.convert."""

    input_norm = None
    mlp_norm = None
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"


register_decoder_layer(Olmo2DecoderLayer, FP8Olmo2DecoderLayer)
