"""The decoder-layer families coat.convert converts, one module each, and the registry they fill
(:mod:`coat.nn.families.registry`):

    llama    Llama, Mistral, Qwen2: the forward of :mod:`coat.nn.decoder` as it is
    qwen3    Qwen3: per-head q/k norms fused with RoPE
    phi3     Phi-3: fused qkv_proj and gate_up_proj weights
    olmo2    OLMo 2: post-norms, full-width q/k norms with 16-bit outputs
    gemma3   Gemma 3: (1 + w) norms, four a layer, and GeGLU
    moe      Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: their dense family's attention, the sparse MLP in coat.nn.experts
    vlm      the Qwen VLMs' text layers, Qwen3-VL-MoE's with moe's experts (LLaVA's and Gemma 3's are llama's and
             gemma3's)

Importing this package imports every family, so that the registry is complete: coat.convert does so after it has
checked the transformers release (coat.compat), since the family modules import transformers' decoder layers. A new
family is a module here that subclasses FP8DecoderLayerMixin, calls register_decoder_layer, and is imported below.
"""
# Each registers its layers; in this order, the order in which coat.convert's messages name them.
from coat.nn.families import llama, qwen3, phi3, olmo2, gemma3, moe, vlm  # noqa: F401
from coat.nn.families.registry import (
    FP8_DECODER_LAYERS,
    install_decoder_layer,
    plan_decoder_layer,
    register_decoder_layer,
)

__all__ = ["FP8_DECODER_LAYERS", "install_decoder_layer", "plan_decoder_layer", "register_decoder_layer"]
