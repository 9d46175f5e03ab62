"""The text decoder layers of transformers' Qwen vision-language models in coat's FP8 precision flow. LLaVA's
language model is a Llama, Mistral or Qwen2 model and Gemma 3's a Gemma 3 text model: their layers are those
families' (coat.nn.families.llama, coat.nn.families.gemma3). The Qwen models' have classes of their own:

    Qwen2VLDecoderLayer, Qwen2_5_VLDecoderLayer   Qwen2's layer: q/k/v biases, per-layer sliding windows
    Qwen3VLTextDecoderLayer                       Qwen3's layer: per-head q_norm / k_norm before RoPE, fused with it
    Qwen3VLMoeTextDecoderLayer                    Qwen3-MoE's layer: Qwen3's attention, the sparse MLP of
                                                  coat.nn.families.moe (dense in mlp_only_layers)

Their rotary positions are multimodal (M-RoPE): each token has three positions, temporal, height and width (text
tokens the same one three times). The text model's rotary module (Qwen2VLRotaryEmbedding, Qwen2_5_VLRotaryEmbedding,
Qwen3VLTextRotaryEmbedding, Qwen3VLMoeTextRotaryEmbedding) merges them into one [B, S, head_dim] cos / sin table
once per forward, taking each frequency's angle from the stream ``mrope_section`` assigns it (contiguous sections in
Qwen2-VL and Qwen2.5-VL, interleaved in Qwen3-VL), and the layers rotate q and k by that table with the ordinary
rotate_half formula. coat's RoPE kernel computes that formula, so it applies unchanged: the converted layers take the
tables as Llama's do. The layers' position_ids are the text positions [B, S] (or None), which only the attention
function reads (packed sequences). Qwen3-VL's DeepStack adds vision features to the first layers' outputs in the
text model, outside the layers.
"""
from __future__ import annotations

from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextDecoderLayer

from coat.nn.decoder import FP8DecoderLayerMixin, HeadNormsMixin
from coat.nn.families.moe import SparseMoEMixin
from coat.nn.families.registry import register_decoder_layer


class FP8Qwen2VLDecoderLayer(FP8DecoderLayerMixin, Qwen2VLDecoderLayer):
    """A Qwen2VLDecoderLayer converted by coat.convert."""


class FP8Qwen2_5_VLDecoderLayer(FP8DecoderLayerMixin, Qwen2_5_VLDecoderLayer):
    """A Qwen2_5_VLDecoderLayer converted by coat.convert."""


class FP8Qwen3VLTextDecoderLayer(HeadNormsMixin, FP8DecoderLayerMixin, Qwen3VLTextDecoderLayer):
    """A Qwen3VLTextDecoderLayer converted by coat.convert."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, **kwargs):
        # The stock layer takes position_embeddings second: the same arguments, in its order when positional.
        return super().forward(hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                               position_embeddings, **kwargs)


class FP8Qwen3VLMoeTextDecoderLayer(SparseMoEMixin, HeadNormsMixin, FP8DecoderLayerMixin, Qwen3VLMoeTextDecoderLayer):
    """A Qwen3VLMoeTextDecoderLayer converted by coat.convert."""


register_decoder_layer(Qwen2VLDecoderLayer, FP8Qwen2VLDecoderLayer)
register_decoder_layer(Qwen2_5_VLDecoderLayer, FP8Qwen2_5_VLDecoderLayer)
register_decoder_layer(Qwen3VLTextDecoderLayer, FP8Qwen3VLTextDecoderLayer)
register_decoder_layer(Qwen3VLMoeTextDecoderLayer, FP8Qwen3VLMoeTextDecoderLayer)
