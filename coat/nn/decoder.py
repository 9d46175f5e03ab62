"""The FP8 forward of transformers' Llama-style decoder layers, the base of every family that coat.convert converts
(:mod:`coat.nn.families`: Llama, Mistral and Qwen2 use it as it is, Qwen3, Phi-3, OLMo 2 and Gemma 3 change parts).

A converted layer runs the precision flow of the paper (appendix G.1) as three blocks from
:mod:`coat.nn.functional`, with coat's fused RoPE kernel, around transformers' own KV cache and attention
implementation (SDPA, FlashAttention, eager, ...), which are left as they are:

    q, k, v = before_attention(x)          RMSNorm -> FP8 -> q/k/v GEMMs
    a       = attention(RoPE(q), RoPE(k), v)   RoPE: coat.ops.rotary_embedding, one kernel each way
    h       = after_attention(a, x)        x + o_proj(a)
    out     = mlp_residual(h)              h + down(SiLU(gate(n)) * up(n)), n = RMSNorm(h)

The layer keeps its class's identity (it becomes an instance of a subclass, e.g. FP8LlamaDecoderLayer of
LlamaDecoderLayer) and its children's names, with coat modules in place of the norms, projections and MLP,
so the state dict, gradient checkpointing and transformers' hooks keep working.

This module imports transformers (the releases of coat.compat); coat.convert imports it on use.
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from coat.nn import functional as coat_functional
from coat.nn.attention import sdpa_without_cudnn
from coat.nn.config import FP8Config
from coat.nn.modules import Linear, RMSNorm, SwiGLUMLP, converted_child
from coat.ops import QK_NORM_MAX_HEAD_DIM


def _projection(parent: nn.Module, name: str):
    linear = converted_child(parent, name, Linear)
    return linear.weight, linear.bias


# The named parameters of a stock decoder layer's forward that the converted forward takes over, besides the KV
# cache. transformers up to 5.23 names the cache past_key_values; 5.24 renamed it cache (past_key_values stays a
# deprecated alias until 5.40). Up to 5.23 a `cache` in **kwargs is continuous batching's paged cache, which goes
# through to the attention function, and that updates it.
LAYER_PARAMETERS = frozenset({"hidden_states", "attention_mask", "position_ids", "use_cache", "position_embeddings"})
CACHE_ARGUMENTS = ("past_key_values", "cache")
# A keyword coat's causal-LM forward (coat.nn.causal_lm) passes down to the decoder layers while torch.compile
# traces a call without an attention mask, positions or cache: the causal mask is then the plain one. transformers
# materializes it anyway while tracing (masking_utils._ignore_causal_mask_sdpa), which costs SDPA its flash kernel
# (2.6x the attention time of eager at the Llama-3.2-1B shape); a layer told so gives SDPA is_causal=True instead.
UNPADDED_CAUSAL = "coat_unpadded_causal"


def stock_cache_argument(stock_forward, layer_parameters=LAYER_PARAMETERS) -> str | None:
    """The name a stock decoder layer's forward gives the KV cache it updates (one of CACHE_ARGUMENTS), or None
    where its named parameters are not ``layer_parameters`` (those coat's converted forward takes over) and it."""
    parameters = set(inspect.signature(stock_forward).parameters) - {"self", "kwargs"}
    return next((name for name in CACHE_ARGUMENTS if parameters == layer_parameters | {name}), None)


class FP8DecoderLayerMixin:
    """forward() of a converted decoder layer; the rest is the transformers class it is mixed into."""

    fp8_config: FP8Config
    cache_argument: str  # what the stock forward calls the KV cache (see stock_cache_argument)
    # The stock forward's named parameters besides the cache (Gemma 3's has no use_cache: it goes in **kwargs).
    layer_parameters: frozenset = LAYER_PARAMETERS
    # The layer's RMSNorm children around its two blocks (None: the family has none there): Llama's pre-norms, or
    # norms on the blocks' outputs before the residual add (OLMo 2's post-norms, coat.nn.families.olmo2).
    input_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    attention_post_norm: str | None = None
    mlp_post_norm: str | None = None
    norm_weight_offset: float = 0.0  # added to every norm weight (1 for Gemma's (1 + w) norms)

    @classmethod
    def norm_names(cls) -> list[str]:
        return [n for n in (cls.input_norm, cls.mlp_norm, cls.attention_post_norm, cls.mlp_post_norm) if n]

    def _pre_norm(self, name: str | None) -> tuple:
        """(weight, eps) of a pre-norm for before_attention / mlp_residual; (None, 0.0) where there is none."""
        if name is None:
            return None, 0.0
        norm = converted_child(self, name, RMSNorm)
        return norm.weight, norm.eps

    def _post_norm(self, name: str | None):
        """(weight, eps, weight offset) of a post-norm, or None."""
        if name is None:
            return None
        norm = converted_child(self, name, RMSNorm)
        return norm.weight, norm.eps, self.norm_weight_offset

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # From transformers 5.24 the cache comes as `cache` (or the deprecated past_key_values); before, a `cache`
        # in kwargs is the paged one of continuous batching, which stays in kwargs for the attention function.
        cache = kwargs.pop("cache", None) if self.cache_argument == "cache" else None
        cache = past_key_values if cache is None else cache
        unpadded_causal = kwargs.pop(UNPADDED_CAUSAL, False)
        attn = self.self_attn
        modeling = sys.modules[type(attn).__module__]  # the model family's eager attention
        config = self.fp8_config
        input_shape = hidden_states.shape[:-1]
        heads_shape = (*input_shape, -1, attn.head_dim)

        query, key, value = self._queries_keys_values(hidden_states)
        cos, sin = position_embeddings
        query, key = self._position_queries_keys(query.view(heads_shape), key.view(heads_shape), cos, sin)
        query, key, value = (t.view(heads_shape).transpose(1, 2) for t in (query, key, value))
        # What the stock decoder layer hands its attention module in **kwargs, and that module the attention function.
        attention_kwargs = dict(position_ids=position_ids, use_cache=use_cache, **kwargs)
        if cache is not None:
            # From 5.24 the cache may fill in what the attention function reads (a paged cache's indices), in place.
            update_kwargs = {"kwargs": attention_kwargs} if self.cache_argument == "cache" else {}
            key, value = cache.update(key, value, attn.layer_idx, **update_kwargs)

        implementation = attn.config._attn_implementation
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, modeling.eager_attention_forward)
        # Qwen2 keeps a per-layer window, Mistral one in its config; Llama has none.
        sliding_window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        if sliding_window is not None:
            attention_kwargs["sliding_window"] = sliding_window
        # Queries as long as the keys: the cache held nothing before; a window that long masks nothing more.
        if (unpadded_causal and implementation == "sdpa" and query.shape[-2] == key.shape[-2]
                and (sliding_window is None or key.shape[-2] <= sliding_window)):
            attention_mask = None  # SDPA then takes is_causal=True, the same mask
        # A mask tensor keeps SDPA off cuDNN's kernel, whose backward overflows with one (coat.nn.attention).
        masked_sdpa = implementation == "sdpa" and isinstance(attention_mask, torch.Tensor)
        with sdpa_without_cudnn() if masked_sdpa else contextlib.nullcontext():
            attn_output, _ = attention_interface(
                attn,
                query,
                key,
                value,
                attention_mask,
                dropout=0.0 if not attn.training else attn.attention_dropout,
                scaling=attn.scaling,
                **attention_kwargs,
            )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()

        hidden_states = coat_functional.after_attention(
            attn_output,
            hidden_states,
            *_projection(attn, "o_proj"),
            config,
            # SDPA, FlashAttention and flex attention keep their output for backward; eager attention does not.
            attention_keeps_output=implementation != "eager",
            post_norm=self._post_norm(self.attention_post_norm),
        )
        return self._mlp_residual(hidden_states)

    # What a family changes, overridden by its subclass: the q/k/v projections, q and k before attention, the MLP
    # (the names of the linear layers that share a weight scale, as coat.distributed groups them), its children.
    attention_scale_groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",))

    def _queries_keys_values(self, hidden_states):
        """q, k, v [B, S, heads * head_dim] = the projections of the input norm's output (of hidden_states itself
        where the family has no input norm)."""
        attn = self.self_attn
        projections = [_projection(attn, name) for name in ("q_proj", "k_proj", "v_proj")]
        return coat_functional.before_attention(hidden_states, *self._pre_norm(self.input_norm), projections,
                                                self.fp8_config, norm_weight_offset=self.norm_weight_offset)

    def _mlp_residual(self, hidden_states):
        """hidden_states + the MLP block, with the family's pre- and post-norms."""
        mlp = converted_child(self, "mlp", SwiGLUMLP)
        gate, up, down = (_projection(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
        return coat_functional.mlp_residual(
            hidden_states, *self._pre_norm(self.mlp_norm), gate, up, down, self.fp8_config,
            activation=mlp.activation, norm_weight_offset=self.norm_weight_offset,
            post_norm=self._post_norm(self.mlp_post_norm),
        )

    def _position_queries_keys(self, query, key, cos, sin):
        """RoPE of q and k [B, S, heads, head_dim] as the projections wrote them: one coat kernel each way. The
        families rotate the whole head (rotate_half), which is what it computes. Qwen3 normalizes them first."""
        return coat_functional.rotary_embedding(query, key, cos, sin)

    @classmethod
    def plan_mlp(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        """The replacements of the MLP or its children, as plan_decoder_layer lists them."""
        return [(layer, "mlp", SwiGLUMLP.from_mlp(layer.mlp, config))]

    @classmethod
    def plan_family_children(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        """The replacements of the children only this family has, as plan_decoder_layer lists them; raises a
        ValueError for a configuration the converted forward would compute wrong."""
        return []


HEAD_NORMS = ("q_norm", "k_norm")  # the per-head q/k norms of Qwen3 and Gemma 3


class HeadNormsMixin:
    """Per-head q_norm / k_norm (weight [head_dim]) before RoPE, fused with it (coat.ops.qk_norm_rope); the norm
    weights offset by the layer's norm_weight_offset (Gemma 3's (1 + w))."""

    def _position_queries_keys(self, query, key, cos, sin):
        q_norm, k_norm = (converted_child(self.self_attn, name, RMSNorm) for name in HEAD_NORMS)
        return coat_functional.qk_norm_rotary_embedding(query, key, q_norm.weight, k_norm.weight, q_norm.eps, cos,
                                                        sin, self.fp8_config, weight_offset=self.norm_weight_offset)

    @classmethod
    def plan_family_children(cls, layer: nn.Module, config: FP8Config) -> list[tuple[nn.Module, str, nn.Module]]:
        attn = layer.self_attn
        if attn.head_dim > QK_NORM_MAX_HEAD_DIM:
            raise ValueError(f"head_dim {attn.head_dim} is above the {QK_NORM_MAX_HEAD_DIM} that coat's fused q/k "
                             "norm kernel takes; leave such layers unconverted (skip_modules)")
        norms = [RMSNorm.from_rmsnorm(getattr(attn, name), config) for name in HEAD_NORMS]
        if norms[0].eps != norms[1].eps:  # one kernel normalizes both
            raise ValueError(f"q_norm and k_norm must share one eps, got {norms[0].eps} and {norms[1].eps}")
        return [(attn, name, norm) for name, norm in zip(HEAD_NORMS, norms)]
