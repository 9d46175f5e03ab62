"""The model shapes of benchmarks/e2e_shapes.py: each one's transformers class and configuration, at full size and at
--smoke's tiny size, its default micro-batch and sequence, and the inputs of one training step (random tokens, the
labels the loss is computed over; for a vision-language model, an image in every sample)."""
import dataclasses

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

SMOKE_BATCH, SMOKE_SEQ = 2, 32


@dataclasses.dataclass(frozen=True)
class Shape:
    model_class: type
    config_class: type
    config: dict  # the model's configuration
    batch: int
    seq: int
    smoke: dict  # the tiny configuration of --smoke: the same family, embedding tying and head grouping

    def layers(self, smoke: bool) -> int:
        """The (language model's) decoder layers."""
        return self._text_config(smoke)["num_hidden_layers"]

    def _text_config(self, smoke: bool) -> dict:
        return self.smoke if smoke else self.config

    def make_config(self, smoke: bool, layers: int | None = None):
        """The model's configuration; layers: fewer decoder layers than the shape's (the vision tower's stay)."""
        config = dict(self.smoke if smoke else self.config)
        if layers is not None:
            config["num_hidden_layers"] = layers
        return self.config_class(**config, attn_implementation="sdpa", use_cache=False)  # training: no KV cache

    def image_tokens(self, smoke: bool) -> int:
        """The image tokens in each sample, which the language model reads from the vision side."""
        return 0

    def inputs(self, config, batch: int, seq: int, smoke: bool, generator: torch.Generator) -> dict:
        """The model's keyword arguments for one step, on the CPU: random tokens, the loss over all of them."""
        ids = torch.randint(config.vocab_size, (batch, seq), generator=generator)
        return {"input_ids": ids, "labels": ids}


@dataclasses.dataclass(frozen=True)
class VisionLanguageShape(Shape):
    """A Qwen2.5-VL-style model: a sample is one image of image_grid x image_grid patches (the vision tower's
    spatial merger turns each 2 x 2 of them into one token of the language model), then text. config and smoke
    hold text_config and vision_config."""
    image_grid: int
    smoke_image_grid: int

    def _text_config(self, smoke: bool) -> dict:
        return (self.smoke if smoke else self.config)["text_config"]

    def make_config(self, smoke: bool, layers: int | None = None):
        config = self.smoke if smoke else self.config
        text = {**config["text_config"], "use_cache": False}  # training: no KV cache
        if layers is not None:
            text["num_hidden_layers"] = layers
        return self.config_class(**{**config, "text_config": text}, attn_implementation="sdpa")

    def image_grid_side(self, smoke: bool) -> int:
        return self.smoke_image_grid if smoke else self.image_grid

    def image_tokens(self, smoke: bool) -> int:
        merge = (self.smoke if smoke else self.config)["vision_config"]["spatial_merge_size"]
        return (self.image_grid_side(smoke) // merge) ** 2

    def inputs(self, config, batch: int, seq: int, smoke: bool, generator: torch.Generator) -> dict:
        """As Qwen2.5-VL's processor and an SFT collator give them: per sample, the image's placeholder tokens
        between its start and end tokens, then random text tokens up to seq; labels -100 at the image tokens; the
        patches (random pixels) with their grid; mm_token_type_ids (1 at the image tokens), from which the model
        computes the M-RoPE positions (get_rope_index)."""
        vision = config.vision_config
        grid, image = self.image_grid_side(smoke), self.image_tokens(smoke)
        # text token ids lie below the processor's special tokens
        text_vocab = min(config.image_token_id, config.video_token_id, config.vision_start_token_id,
                         config.vision_end_token_id)
        ids = torch.randint(text_vocab, (batch, seq), generator=generator)
        ids[:, 0] = config.vision_start_token_id
        ids[:, 1:1 + image] = config.image_token_id
        ids[:, 1 + image] = config.vision_end_token_id
        is_image = ids == config.image_token_id
        patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return {"input_ids": ids, "labels": ids.masked_fill(is_image, -100), "mm_token_type_ids": is_image.int(),
                "pixel_values": torch.randn(batch * grid * grid, patch_values, generator=generator),
                "image_grid_thw": torch.tensor([[1, grid, grid]] * batch)}


def _tiny(heads: int, kv_heads: int, tied: bool) -> dict:
    # hidden and intermediate multiples of 128, for coat-lowmem's 1 x 128 blocks; a vocabulary 8x the hidden size
    return dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=256, vocab_size=1024, tie_word_embeddings=tied)


# Qwen2.5-VL's vision tower, the same in the 3B and 7B models but for the width it projects to (out_hidden_size):
# SwiGLU MLPs of width 3420 (not a multiple of 16), window attention in 112 x 112-pixel windows (8 x 8 patches)
# but in the blocks of fullatt_block_indexes.
QWEN2_5_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                         temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                         fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
QWEN2_5_VL_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                         vision_end_token_id=151653)


def _qwen2_5_vl_rope(mrope_section: list[int]) -> dict:
    # M-RoPE: the frequencies each of the temporal, height and width positions takes, head_dim / 2 in all
    return dict(rope_type="default", rope_theta=1000000.0, mrope_section=mrope_section)


QWEN2_5_VL_TEXT = dict(rms_norm_eps=1e-6, max_position_embeddings=128000, use_sliding_window=False,
                       rope_parameters=_qwen2_5_vl_rope([16, 24, 24]))


def _tiny_vlm(tied: bool) -> dict:
    """A tiny Qwen2.5-VL: the text model of _tiny (head_dim 32), a vision tower of 2 blocks, one with window
    attention (16 x 16-pixel windows: 4 x 4 patches of 4 x 4 pixels) and one with full attention, whose MLP width is
    not a multiple of 16 either; the special token ids at the top of the tiny vocabulary."""
    text = {**_tiny(4, 2, tied), "rope_parameters": _qwen2_5_vl_rope([4, 6, 6]), "bos_token_id": None,
            "eos_token_id": None}
    vision = dict(depth=2, hidden_size=64, intermediate_size=172, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1], out_hidden_size=128)
    return dict(text_config=text, vision_config=vision, tie_word_embeddings=tied, vision_start_token_id=1020,
                image_token_id=1021, video_token_id=1022, vision_end_token_id=1023)


def _tiny_qwen3_vl() -> dict:
    """A tiny Qwen3-VL: _tiny_vlm's sizes, Qwen3's head_dim and interleaved M-RoPE sections, a vision tower of 2
    blocks with the tanh-GELU MLP (not gated; width not a multiple of 16) and a deepstack feature from its first."""
    config = _tiny_vlm(tied=True)
    config["text_config"] = {**config["text_config"], "head_dim": 32,
                             "rope_parameters": {**_qwen2_5_vl_rope([6, 5, 5]), "mrope_interleaved": True}}
    config["vision_config"] = dict(depth=2, hidden_size=64, intermediate_size=172, num_heads=2, patch_size=4,
                                   temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=128,
                                   num_position_embeddings=64, deepstack_visual_indexes=[0])
    return config


SHAPES = {
    "llama3.2-1b": Shape(LlamaForCausalLM, LlamaConfig, dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
        vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072), batch=8, seq=2048, smoke=_tiny(4, 1, tied=True)),
    "llama3.1-8b": Shape(LlamaForCausalLM, LlamaConfig, dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072), batch=1, seq=8192, smoke=_tiny(4, 1, tied=False)),
    "qwen2.5-7b": Shape(Qwen2ForCausalLM, Qwen2Config, dict(  # Qwen2's q, k and v projections have a bias
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
        vocab_size=152064, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768), batch=1, seq=4096, smoke=_tiny(4, 2, tied=False)),
    # Mixtures of experts: transformers' grouped_mm experts in the BF16 rows, the router's auxiliary loss on.
    "olmoe-1b-7b": Shape(OlmoeForCausalLM, OlmoeConfig, dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024,
        num_experts=64, num_experts_per_tok=8, vocab_size=50304, tie_word_embeddings=False, rms_norm_eps=1e-5,
        max_position_embeddings=4096, output_router_logits=True, router_aux_loss_coef=0.01,
        experts_implementation="grouped_mm"), batch=1, seq=4096,
        smoke=dict(_tiny(4, 4, tied=False), num_experts=8, num_experts_per_tok=2, output_router_logits=True)),
    "qwen2-moe-a2.7b": Shape(Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=8192, output_router_logits=True, router_aux_loss_coef=0.001,
        experts_implementation="grouped_mm"), batch=1, seq=4096,
        smoke=dict(_tiny(4, 4, tied=False), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                   shared_expert_intermediate_size=256, output_router_logits=True)),
    # Vision-language models (Qwen2.5-VL-3B-Instruct's and -7B-Instruct's configurations): an 896 x 896-pixel image,
    # 64 x 64 patches, 1,024 tokens after the merger, and 3,072 text tokens.
    "qwen2.5-vl-3b": VisionLanguageShape(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, dict(
        text_config=dict(QWEN2_5_VL_TEXT, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, intermediate_size=11008, vocab_size=151936),
        vision_config=dict(QWEN2_5_VL_VISION, out_hidden_size=2048), tie_word_embeddings=True, **QWEN2_5_VL_TOKENS),
        batch=1, seq=4096, smoke=_tiny_vlm(tied=True), image_grid=64, smoke_image_grid=8),
    "qwen2.5-vl-7b": VisionLanguageShape(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, dict(
        text_config=dict(QWEN2_5_VL_TEXT, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
        vision_config=dict(QWEN2_5_VL_VISION, out_hidden_size=3584), tie_word_embeddings=False, **QWEN2_5_VL_TOKENS),
        batch=1, seq=4096, smoke=_tiny_vlm(tied=False), image_grid=64, smoke_image_grid=8),
    # Qwen3-VL-4B-Instruct's configuration: a tower of non-gated tanh-GELU MLPs (coat.nn.MLP with vision_linears);
    # a 1,024 x 1,024-pixel image, 64 x 64 patches of 16 x 16 pixels, 1,024 tokens after the merger.
    "qwen3-vl-4b": VisionLanguageShape(Qwen3VLForConditionalGeneration, Qwen3VLConfig, dict(
        text_config=dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=9728, vocab_size=151936, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, tie_word_embeddings=True,
                         rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                           out_hidden_size=2560, deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
        tie_word_embeddings=True, **QWEN2_5_VL_TOKENS),
        batch=1, seq=4096, smoke=_tiny_qwen3_vl(), image_grid=64, smoke_image_grid=8),
}
