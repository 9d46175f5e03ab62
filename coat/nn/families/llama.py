"""Llama's, Mistral's and Qwen2's decoder layers in coat's FP8 precision flow: coat.nn.decoder's forward as it is.
Mistral's sliding window (in its config) and Qwen2's per-layer windows (on each attention module) reach the attention
function as transformers passes them; Qwen2's q/k/v biases are the projections' own."""
from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from coat.nn.decoder import FP8DecoderLayerMixin
from coat.nn.families.registry import register_decoder_layer


class FP8LlamaDecoderLayer(FP8DecoderLayerMixin, LlamaDecoderLayer):
    """A LlamaDecoderLayer converted by coat.convert."""


class FP8MistralDecoderLayer(FP8DecoderLayerMixin, MistralDecoderLayer):
    """A MistralDecoderLayer converted by coat.convert."""


class FP8Qwen2DecoderLayer(FP8DecoderLayerMixin, Qwen2DecoderLayer):
    """A Qwen2DecoderLayer converted by coat.convert."""


register_decoder_layer(LlamaDecoderLayer, FP8LlamaDecoderLayer)
register_decoder_layer(MistralDecoderLayer, FP8MistralDecoderLayer)
register_decoder_layer(Qwen2DecoderLayer, FP8Qwen2DecoderLayer)
