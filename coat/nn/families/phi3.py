"""Phi-3's decoder layer in coat's FP8 precision flow: Llama's (coat.nn.decoder), with Phi-3's fused weights.

    q, k, v = before_attention(x)        RMSNorm -> FP8 -> qkv_proj [(Hq + 2 Hkv) D, H]: its row blocks, one GEMM
                                         each, so that q, k and v are tensors of their own
    ...                                  RoPE, attention, o_proj + residual as Llama
    out     = mlp_residual(h)            h + down(SiLU(gate) * up), gate and up the two halves (gate first) of
                                         one gate_up_proj [2I, H] GEMM, read in place by SiLU*mul

Each fused weight is quantized with one per-tensor scale, as Llama's q/k/v and gate/up weights are together, and
gets its gradient from one wgrad GEMM, whose [sum N_i, H] result is the parameter's gradient as it is.
Why q, k and v are three GEMMs and not views of one output: SDPA and FlashAttention keep v (and the rotated q
and k, new tensors) for backward, and a view keeps its whole base alive: the joint output would hold q and k a
second time, (Hq + Hkv) D more 16-bit values per token, 1.25 U (U = 2H bytes per token) at the Phi-3-medium
shape (H 5120, 40 query and 10 KV heads of 128), on top of a layer that saves about 8 U. gate and up die once
SiLU*mul has read them, so their GEMM is one.

The converted forward leaves out Phi-3's residual dropout and rotates the whole head; coat.convert refuses the
configurations where that would differ (resid_pdrop > 0, partial_rotary_factor < 1). longrope and the other
rope_parameters change only the cos / sin tables the model computes, which the layer reads as they come.
"""
from __future__ import annotations

from torch import nn
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer

from coat.nn import functional as coat_functional
from coat.nn.config import FP8Config
from coat.nn.decoder import FP8DecoderLayerMixin, _projection
from coat.nn.families.registry import register_decoder_layer
from coat.nn.modules import Linear, activation_name

_MLP_PROJECTIONS = ("gate_up_proj", "down_proj")


class FP8Phi3DecoderLayer(FP8DecoderLayerMixin, Phi3DecoderLayer):
    """A Phi3DecoderLayer converted by coat.convert."""

    attention_scale_groups = (("qkv_proj",), ("o_proj",))

    def _queries_keys_values(self, hidden_states):
        attn = self.self_attn
        query_width = attn.config.num_attention_heads * attn.head_dim
        kv_width = attn.num_key_value_heads * attn.head_dim
        return coat_functional.before_attention(
            hidden_states, *self._pre_norm(self.input_norm), [_projection(attn, "qkv_proj")], self.fp8_config,
            output_widths=(query_width, kv_width, kv_width),
        )

    def _mlp_residual(self, hidden_states):
        gate_up, down = (_projection(self.mlp, name) for name in _MLP_PROJECTIONS)
        return coat_functional.mlp_residual(hidden_states, *self._pre_norm(self.mlp_norm), gate_up, None, down,
                                            self.fp8_config)

    @classmethod
    def plan_mlp(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        """Phi3MLP stays, its gate_up_proj and down_proj become coat Linears (the converted layer computes the
        MLP from their parameters; called on its own, Phi3MLP runs them as two FP8 linear layers)."""
        mlp = layer.mlp
        linears = [getattr(mlp, name, None) for name in _MLP_PROJECTIONS]
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            raise TypeError(f"the Phi-3 MLP must have nn.Linear children {', '.join(_MLP_PROJECTIONS)}")
        activation = getattr(mlp, "activation_fn", None)
        if not isinstance(activation, nn.Module) or activation_name(activation) != "silu":
            raise ValueError(f"{type(mlp).__name__}.activation_fn must be SiLU (hidden_act='silu'), got "
                             f"{activation!r}; the fused kernel computes SiLU(gate) * up only")
        if linears[0].out_features != 2 * linears[1].in_features:
            raise ValueError(f"gate_up_proj has {linears[0].out_features} outputs, not twice down_proj's "
                             f"{linears[1].in_features} inputs")
        return [(mlp, name, Linear.from_linear(linear, config)) for name, linear in zip(_MLP_PROJECTIONS, linears)]

    @classmethod
    def plan_family_children(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        model_config = layer.self_attn.config
        rotary_factor = (model_config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
        if rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor {rotary_factor}: coat's RoPE kernel rotates the whole head, Phi-3 would "
                "rotate only part of it; leave such models unconverted"
            )
        dropouts = {name: getattr(layer, name).p for name in ("resid_attn_dropout", "resid_mlp_dropout")}
        if any(p > 0 for p in dropouts.values()):
            raise ValueError(
                f"residual dropout {dropouts} (resid_pdrop): coat's fused residual additions apply none, so training "
                "would differ from the model's; set config.resid_pdrop = 0.0 before building the model (it does "
                "nothing in eval mode either way)"
            )
        return []


register_decoder_layer(Phi3DecoderLayer, FP8Phi3DecoderLayer)
