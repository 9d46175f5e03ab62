"""coat.convert on tiny vision-language models: LLaVA (with a Llama, Mistral or Qwen2 language model), LLaVA-NeXT,
LLaVA-OneVision, Mistral 3, InternVL, Idefics3, SmolVLM, Gemma 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE
(coat/nn/families/vlm.py). The language model's decoder layers convert as their dense families' do, the vision tower
and projector stay as they are (their attention off cuDNN's kernel), and the fused LM head + loss is installed on
the top model. Inputs are built as the processors build them: each image's placeholder tokens in the text, pixel values
of the vision tower's shape, Gemma 3's token_type_ids and the Qwen models' mm_token_type_ids and image_grid_thw.
Bounds are those of tests/test_nn_llama.py, which explains them."""
import contextlib
import copy
import functools
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import (
    CLIPVisionConfig,
    DynamicCache,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    InternVLConfig,
    InternVLForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import AttentionInterface
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen3_vl import modeling_qwen3_vl
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

import coat
from coat.nn import functional as coat_functional
from coat.nn.causal_lm import FusedLossLMHead
from coat.nn.families import FP8_DECODER_LAYERS
from coat.nn.vision import (
    VISION_MODULES,
    avoid_cudnn_attention,
    batch_equal_chunks,
    convert_vision_attention,
    equal_length_runs,
)
from reference_nn import relative_error
from test_causal_lm import assert_same_training_step
from test_nn_llama import (CACHED_BOUND, FORWARD_BOUND, GRADIENT_BOUND, LOSS_BOUND, TINY, cache_keyword,
                           gradient_bound, pinned_routing, tiny_model)

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

TEXT = {name: value for name, value in TINY.items() if name != "attn_implementation"}
# Token ids of the tiny vocabulary (128): text tokens from 1 to 95 (0 is generate()'s pad token here), the
# processors' special tokens above.
IMAGE, IMAGE_START, IMAGE_END, VIDEO = 100, 101, 102, 103
TEXT_TOKENS = 96
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
# LLaVA and Gemma 3: 32 x 32 images in 8 x 8 patches, 16 of them; LLaVA gives the language model every patch but
# CLIP's class token, Gemma 3 pools them 2 x 2 into mm_tokens_per_image = 4. Mistral 3: the same image, Pixtral's
# patches merged 2 x 2 into 4 tokens, as InternVL's (pixel shuffle, downsample_ratio 0.5), Idefics3's and SmolVLM's
# (scale_factor 2), whose processors send each image as a list of tiles, one here. LLaVA-NeXT and LLaVA-OneVision
# ("any resolution"): a 16 x 16 image as the processor sends it, the image resized to the tower's 16 x 16 and one
# 16 x 16 tile of it, 2 x 2 patches each: 4 tokens of the resized image, then the tile's 4 with a newline token after
# each of its 2 rows, 10 in all.
IMAGE_SIZE, PATCH = 32, 8
ANY_RESOLUTION, ANY_RESOLUTION_TOKENS = 16, 10
# Qwen: a 16 x 16 image in 4 x 4 patches (a 4 x 4 grid, the frame repeated to temporal_patch_size = 2, as the
# processor does), merged 2 x 2 into 4 tokens; M-RoPE sections of 2 + 3 + 3 = head_dim / 2 (head_dim 16), Qwen3-VL's
# interleaved over head_dim 32. Qwen3-VL-MoE: 4 experts, 2 a token.
QWEN_GRID, QWEN_PATCH, QWEN_TEMPORAL = 4, 4, 2
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                   patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=QWEN_TEMPORAL)
QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=IMAGE_START,
                   vision_end_token_id=IMAGE_END)
QWEN_TEXT = dict(TEXT, bos_token_id=None, eos_token_id=None)  # the defaults lie outside the tiny vocabulary


def llava_config(text_config):
    vision = CLIPVisionConfig(**VISION, image_size=IMAGE_SIZE, patch_size=PATCH)
    return LlavaConfig(vision_config=vision, text_config=text_config(**TEXT), image_token_id=IMAGE,
                       vision_feature_layer=-1)


def llava_next_config(config_class, vision_config, text_config):
    vision = vision_config(**VISION, image_size=ANY_RESOLUTION, patch_size=PATCH)
    return config_class(vision_config=vision, text_config=text_config(**TEXT), image_token_id=IMAGE,
                        vision_feature_layer=-1, image_grid_pinpoints=[[ANY_RESOLUTION, ANY_RESOLUTION]])


def mistral3_config(**text):
    # hidden_act: the released Pixtral towers' gated SiLU MLP (the config's default is GELU)
    vision = PixtralVisionConfig(**VISION, image_size=IMAGE_SIZE, patch_size=PATCH, head_dim=16, hidden_act="silu")
    return Mistral3Config(vision_config=vision, text_config=MistralConfig(**{**TEXT, **text}), image_token_id=IMAGE,
                          vision_feature_layer=-1, spatial_merge_size=2)


def internvl_config(**text):
    vision = dict(VISION, image_size=[IMAGE_SIZE] * 2, patch_size=[PATCH] * 2)
    return InternVLConfig(vision_config=vision, text_config=Qwen2Config(**{**TEXT, **text}), image_token_id=IMAGE,
                          downsample_ratio=0.5, vision_feature_layer=-1)


def idefics3_config(config_class, **text):
    return config_class(vision_config=dict(VISION, image_size=IMAGE_SIZE, patch_size=PATCH),
                        text_config=LlamaConfig(**{**TEXT, **text}), image_token_id=IMAGE, scale_factor=2)


def gemma3_config(**text):
    vision = SiglipVisionConfig(**VISION, image_size=IMAGE_SIZE, patch_size=PATCH)
    text = Gemma3TextConfig(**{**TEXT, **text}, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"])
    return Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4, image_token_id=IMAGE,
                        boi_token_id=IMAGE_START, eoi_token_id=IMAGE_END)


def qwen2_vl_config(**text):
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=TEXT["hidden_size"],
                  patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=QWEN_TEMPORAL)
    text = {**QWEN_TEXT, "rope_parameters": rope, **text}
    return Qwen2VLConfig(vision_config=vision, text_config=text, **QWEN_TOKENS)


def qwen2_5_vl_config(**text):
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    vision = dict(QWEN_VISION, window_size=16, fullatt_block_indexes=[1])
    text = {**QWEN_TEXT, "rope_parameters": rope, **text}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, **QWEN_TOKENS)


def qwen3_vl_config(config_class=Qwen3VLConfig, **text):
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5], mrope_interleaved=True)
    vision = dict(QWEN_VISION, num_position_embeddings=QWEN_GRID ** 2, deepstack_visual_indexes=[0])
    text = {**QWEN_TEXT, "head_dim": 32, "rope_parameters": rope, **text}
    return config_class(vision_config=vision, text_config=text, **QWEN_TOKENS)


VLMS = {
    "llava_llama": (LlavaForConditionalGeneration, functools.partial(llava_config, LlamaConfig)),
    "llava_mistral": (LlavaForConditionalGeneration, functools.partial(llava_config, MistralConfig)),
    "llava_qwen2": (LlavaForConditionalGeneration, functools.partial(llava_config, Qwen2Config)),
    "llava_next": (LlavaNextForConditionalGeneration,
                   functools.partial(llava_next_config, LlavaNextConfig, CLIPVisionConfig, LlamaConfig)),
    "llava_onevision": (LlavaOnevisionForConditionalGeneration,
                        functools.partial(llava_next_config, LlavaOnevisionConfig, SiglipVisionConfig, Qwen2Config)),
    "mistral3": (Mistral3ForConditionalGeneration, mistral3_config),
    "internvl": (InternVLForConditionalGeneration, internvl_config),
    "idefics3": (Idefics3ForConditionalGeneration, functools.partial(idefics3_config, Idefics3Config)),
    "smolvlm": (SmolVLMForConditionalGeneration, functools.partial(idefics3_config, SmolVLMConfig)),
    "gemma3": (Gemma3ForConditionalGeneration, gemma3_config),
    "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_config),
    "qwen2_vl": (Qwen2VLForConditionalGeneration, qwen2_vl_config),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, qwen3_vl_config),
    "qwen3_vl_moe": (Qwen3VLMoeForConditionalGeneration,
                     functools.partial(qwen3_vl_config, Qwen3VLMoeConfig, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32)),
}
# One LLaVA stands for the three where what is checked does not depend on the language model's family; Qwen2-VL
# (Qwen2.5-VL's layers and rotary module, another vision tower) is in VLMS and QWEN_VLMS.
MAIN_VLMS = ["llava_llama", "llava_next", "llava_onevision", "mistral3", "internvl", "idefics3", "smolvlm", "gemma3",
             "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
# Where the check does not depend on the vision side's layout (the KV cache, checkpoints, gradient checkpointing's
# recomputation), one model per kind of language-model forward: LLaVA's stands for the LLaVA-style classes.
CORE_VLMS = ["llava_llama", "gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
TILED_VLMS = ("idefics3", "smolvlm")  # pixel values [batch, tiles, channels, height, width]
ANY_RESOLUTION_VLMS = ("llava_next", "llava_onevision")
QWEN_VLMS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"]
INTERLEAVED_MROPE = {"qwen3_vl": modeling_qwen3_vl, "qwen3_vl_moe": modeling_qwen3_vl_moe}


def tiny_vlm(name, seed=0, **text):
    """A randomly initialized BF16 model. Gemma 3's projector starts at zero (transformers' initialization), which
    would hide the images from the language model: drawn at random here. Its post-norm gains (1 + w) are set to
    0.1: test_nn_llama.py explains how gains of 1 on these random models amplify the FP8-rounded block outputs
    beyond the bounds (it checks Gemma 3's layers against an FP8 reference instead); at 0.1 the bounds apply."""
    model_class, config = VLMS[name]
    torch.manual_seed(seed)
    model = model_class._from_config(config(**text), attn_implementation="sdpa", dtype=torch.bfloat16)
    if name == "gemma3":
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
            for layer in model.model.language_model.layers:
                layer.post_attention_layernorm.weight.fill_(-0.9)
                layer.post_feedforward_layernorm.weight.fill_(-0.9)
    return model


def image_tokens(name) -> int:
    if name in ANY_RESOLUTION_VLMS:
        return ANY_RESOLUTION_TOKENS
    if name.startswith("llava"):
        return (IMAGE_SIZE // PATCH) ** 2
    return 4


def image_batch(name, batch=2, length=32, prompt=3, seed=1):
    """(input_ids, labels, image inputs): random text with one image per sample after ``prompt`` text tokens, its
    placeholder tokens (between start and end tokens where the processor puts them), labels -100 there."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, TEXT_TOKENS, (batch, length), generator=generator)
    count = image_tokens(name)
    if name in QWEN_VLMS or name == "gemma3":
        tokens[:, prompt] = IMAGE_START
        tokens[:, prompt + 1:prompt + 1 + count] = IMAGE
        tokens[:, prompt + 1 + count] = IMAGE_END
    else:
        tokens[:, prompt:prompt + count] = IMAGE
    is_image = tokens == IMAGE
    if name in QWEN_VLMS:
        patches = torch.randn(batch * QWEN_GRID ** 2, 3 * QWEN_TEMPORAL * QWEN_PATCH ** 2, generator=generator)
        grids = torch.tensor([[1, QWEN_GRID, QWEN_GRID]] * batch)
        images = dict(pixel_values=patches.to(torch.bfloat16), image_grid_thw=grids, mm_token_type_ids=is_image.int())
    elif name in ANY_RESOLUTION_VLMS:  # the resized image and its tile
        pixels = torch.randn(batch, 2, 3, ANY_RESOLUTION, ANY_RESOLUTION, generator=generator)
        images = dict(pixel_values=pixels.to(torch.bfloat16), image_sizes=torch.tensor([[ANY_RESOLUTION] * 2] * batch))
    else:
        tiles = (1,) if name in TILED_VLMS else ()
        pixels = torch.randn(batch, *tiles, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
        images = dict(pixel_values=pixels.to(torch.bfloat16))
        if name == "mistral3":
            images["image_sizes"] = torch.tensor([[IMAGE_SIZE] * 2] * batch)
        if name == "gemma3":
            images["token_type_ids"] = is_image.long()
    return tokens, tokens.masked_fill(is_image, -100), images


def on_device(device, tokens, labels, images):
    """The inputs of image_batch moved to ``device``."""
    return tokens.to(device), labels.to(device), {key: value.to(device) for key, value in images.items()}


def loss_and_grads(model, tokens, labels, images):
    model.zero_grad()
    loss = model(tokens, labels=labels, **images).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def language_model(model):
    return getattr(model.model, "language_model", None) or model.model.text_model  # Idefics3's and SmolVLM's


def vision_side(model):
    """The vision tower and the projector: every child of the multimodal model but the language model."""
    return [child for child in model.model.children() if child is not language_model(model)]


@pytest.mark.parametrize("name", VLMS)
def test_conversion_keeps_parameters_and_keys(name):
    model = tiny_vlm(name)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    vision_modules = [(n, type(m)) for part in vision_side(model) for n, m in part.named_modules()]
    coat.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is before[n] for n, p in model.named_parameters())
    layers = language_model(model).layers
    assert all(type(layer) in FP8_DECODER_LAYERS.values() for layer in layers)
    # Left as they are, but for the tower's layers, which take their attention off cuDNN's kernel, and the Qwen
    # towers' attention modules, which batch equal chunks: instances of a subclass of the same name.
    after = [(n, type(m)) for part in vision_side(model) for n, m in part.named_modules()]
    assert [n for n, _ in after] == [n for n, _ in vision_modules]
    for (n, new), (_, old) in zip(after, vision_modules, strict=True):
        changed = getattr(new, "avoids_cudnn_attention", False) or getattr(new, "batches_equal_chunks", False)
        assert new is old or (issubclass(new, old) and new.__name__ == old.__name__ and changed), n
    batched = [n for n, m in model.named_modules() if getattr(m, "batches_equal_chunks", False)]
    assert batched == ([f"model.visual.blocks.{i}.attn" for i in range(len(model.model.visual.blocks))]
                       if name in QWEN_VLMS else [])
    assert type(model.lm_head) is FusedLossLMHead
    assert type(model).__name__ == f"FusedLoss{VLMS[name][0].__name__}"


def image_feature_modules(model):
    """The modules whose outputs the language model reads from the vision side: the projector (Qwen: the merger;
    Qwen3-VL's DeepStack mergers too, whose outputs are added to the first layers' outputs)."""
    projector = getattr(model.model, "multi_modal_projector", None) or getattr(model.model, "connector", None)
    if projector is not None:
        return [projector]
    visual = model.model.visual
    return [visual.merger, *getattr(visual, "deepstack_merger_list", [])]


@contextlib.contextmanager
def image_feature_gradients(model, received: dict, replacements: dict | None = None):
    """Records in ``received`` the gradients that reach the image features in backward, by module index; with
    ``replacements``, the vision side backpropagates those instead."""
    def record(index):
        def on_gradient(grad):
            received[index] = grad
            return None if replacements is None else replacements[index]
        return lambda module, args, output: output.register_hook(on_gradient) and None

    hooks = [m.register_forward_hook(record(i)) for i, m in enumerate(image_feature_modules(model))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def is_vision_side(name: str) -> bool:
    return name.startswith(tuple(f"{module}." for modules in VISION_MODULES.values() for module in modules))


@contextlib.contextmanager
def deterministic_algorithms():
    """torch's deterministic kernels inside the block (cuDNN's convolution backward, which the vision towers' patch
    embeddings run on a GPU, may otherwise sum in a different order from one call to the next); warn_only: ops with no
    deterministic kernel warn instead of raising. New tensors are not filled with NaN, as the mode would otherwise do:
    this is about summation order only."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("name", VLMS)
def test_loss_and_gradients_close_to_bf16(name, device):
    """Labels -100 at the image tokens, as SFT data sets them. The language model's gradients and the gradient it
    sends the image features within the bounds of the text models. The vision side (BF16, as it was) computes the
    stock backward of the gradient it receives, bit for bit: the stock model's vision side, given the converted
    language model's gradient at the image features, gives the converted model's vision-side gradients (under the
    attention kernels coat.convert leaves the tower, and torch's deterministic kernels). (Those are
    further from BF16 than the text's, 0.1-0.4 on these models: they sum the errors of 4 to 16 image tokens' rows
    through the vision tower's norms and attention; BF16's own are 0.01-0.02 from float32.)"""
    model = tiny_vlm(name).to(device)
    converted = coat.convert(copy.deepcopy(model))
    convert_vision_attention(model)  # the vision attention coat.convert installs, so that the replay runs it
    tokens, labels, images = on_device(device, *image_batch(name))
    fp8_features, bf16_features, replayed = {}, {}, {}
    # pinned_routing: Qwen3-VL-MoE's stock model takes the experts coat's forward chose
    with pinned_routing(follower=model, leader=converted), deterministic_algorithms():
        with image_feature_gradients(converted, fp8_features):
            fp8_loss, fp8_grads = loss_and_grads(converted, tokens, labels, images)
        with image_feature_gradients(model, bf16_features):
            bf16_loss, bf16_grads = loss_and_grads(model, tokens, labels, images)
        with image_feature_gradients(model, replayed, replacements=fp8_features):
            _, replayed_grads = loss_and_grads(model, tokens, labels, images)
    print(f"\n{name}: loss {fp8_loss.item():.4f} vs BF16 {bf16_loss.item():.4f}")
    assert abs(fp8_loss - bf16_loss) <= LOSS_BOUND * abs(bf16_loss)
    assert fp8_grads.keys() == bf16_grads.keys()
    assert fp8_features.keys() == bf16_features.keys() == set(range(len(image_feature_modules(model))))
    for index, bf16_grad in bf16_features.items():
        error = relative_error(fp8_features[index], bf16_grad)
        print(f"  {'image features ' + str(index):64s} {error:.3f}")
        assert error <= GRADIENT_BOUND["e5m2", "e4m3"]
    vision = [n for n in bf16_grads if is_vision_side(n)]
    assert vision
    for n in vision:
        assert torch.equal(fp8_grads[n], replayed_grads[n]), \
            f"{n}: replayed gradient differs by up to {(fp8_grads[n] - replayed_grads[n]).abs().max().item():.3g}"
    for n, bf16_grad in bf16_grads.items():
        if not is_vision_side(n):
            error = relative_error(fp8_grads[n], bf16_grad)
            print(f"  {n:64s} {error:.3f}")
            assert error <= gradient_bound(n, "e5m2", "e4m3"), n


def mrope_tables(positions, inv_freq, sections, interleaved):
    """M-RoPE's cos and sin [B, S, D] in float64, from its definition: frequency j takes the angle of the position
    stream (temporal 0, height 1, width 2) that mrope_section assigns it, contiguous sections (Qwen2.5-VL) or
    every third frequency (Qwen3-VL: j % 3 = 1 height, 2 width, up to 3 x their section; the rest temporal)."""
    half = inv_freq.shape[0]
    if interleaved:
        streams = [j % 3 if j % 3 and j < 3 * sections[j % 3] else 0 for j in range(half)]
    else:
        streams = [stream for stream, size in enumerate(sections) for _ in range(size)]
    angles = torch.stack([positions[s].double() * inv_freq[j].double() for j, s in enumerate(streams)], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("name", QWEN_VLMS)
def test_mrope_rotation_matches_transformers(name):
    """The three position streams of an image differ; the text model's rotary module merges them into the table of
    M-RoPE's definition; coat's RoPE kernel rotates by that table what transformers' attention computes, bit for bit
    in float32 (tests/test_rope.py: one rounding per product and sum, as the eager formula)."""
    model = tiny_vlm(name).float()
    tokens, _, images = image_batch(name)
    positions, _ = model.model.get_rope_index(tokens, mm_token_type_ids=images["mm_token_type_ids"],
                                              image_grid_thw=images["image_grid_thw"])
    assert positions.shape == (3, *tokens.shape)
    assert not torch.equal(positions[1], positions[2]) and not torch.equal(positions[0], positions[1])
    rotary = language_model(model).rotary_emb
    hidden = torch.zeros(*tokens.shape, TEXT["hidden_size"])
    cos, sin = rotary(hidden, positions)
    sections = model.config.text_config.rope_parameters["mrope_section"]
    want_cos, want_sin = mrope_tables(positions, rotary.inv_freq, sections, interleaved=name in INTERLEAVED_MROPE)
    torch.testing.assert_close(cos.double(), want_cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin.double(), want_sin, rtol=0, atol=2e-6)

    attn = language_model(model).layers[0].self_attn
    generator = torch.Generator().manual_seed(3)
    heads = (*tokens.shape, -1, attn.head_dim)
    query = torch.randn(*tokens.shape, attn.q_proj.out_features, generator=generator).view(heads)
    key = torch.randn(*tokens.shape, attn.k_proj.out_features, generator=generator).view(heads)
    modeling = {"qwen2_vl": modeling_qwen2_vl, "qwen2_5_vl": modeling_qwen2_5_vl, **INTERLEAVED_MROPE}[name]
    want_query, want_key = modeling.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    rotated_query, rotated_key = coat_functional.rotary_embedding(query, key, cos, sin)
    assert torch.equal(rotated_query, want_query.transpose(1, 2))
    assert torch.equal(rotated_key, want_key.transpose(1, 2))


@pytest.mark.parametrize("name", QWEN_VLMS)
def test_position_ids_of_three_and_four_streams(name):
    """Positions passed in as the Qwen models take them: [3, B, S] (temporal, height, width), or [4, B, S] with the
    text positions first (packed sequences); the layers see the text positions, the rotary tables all three."""
    stock = tiny_vlm(name)
    converted = coat.convert(copy.deepcopy(stock))
    tokens, _, images = image_batch(name)
    positions, _ = stock.model.get_rope_index(tokens, mm_token_type_ids=images["mm_token_type_ids"],
                                              image_grid_thw=images["image_grid_thw"])
    text_positions = torch.arange(tokens.shape[1]).expand(1, *tokens.shape)
    with torch.no_grad():
        for position_ids in (positions, torch.cat([text_positions, positions])):
            fp8, bf16 = (m(tokens, position_ids=position_ids, **images).logits.float() for m in (converted, stock))
            assert relative_error(fp8, bf16) <= FORWARD_BOUND


@pytest.mark.parametrize("name", MAIN_VLMS)
def test_fused_loss_with_image_tokens_matches_transformers_loss(name):
    """The fused LM head + loss against transformers' loss on the same converted model's logits: the image tokens'
    labels -100, so they are ignored as transformers ignores them; the same shift by one."""
    model = tiny_vlm(name)
    unfused = coat.convert(copy.deepcopy(model), fused_loss=False)
    fused = coat.convert(model)
    assert type(unfused.lm_head) is torch.nn.Linear
    tokens, labels, images = image_batch(name)
    assert_same_training_step(fused, unfused, tokens, labels=labels, **images)
    with torch.no_grad():  # without labels, the logits as before
        assert torch.equal(fused(tokens, **images).logits, unfused(tokens, **images).logits)


def test_compiled_gemma3_keeps_its_image_tokens_attending_both_ways():
    """Under torch.compile a converted causal LM called without a mask, positions or cache gives SDPA is_causal
    instead of the mask transformers builds (coat.nn.causal_lm); Gemma 3's image tokens attend to each other both
    ways, which the mask it builds from token_type_ids says, so with token_type_ids the mask is kept."""
    model = coat.convert(tiny_vlm("gemma3"))
    tokens, _, images = image_batch("gemma3")
    with torch.no_grad():
        compiled = torch.compile(lambda: model(tokens, **images).logits, backend="aot_eager")()
        assert torch.equal(compiled, model(tokens, **images).logits)


PROMPT, NEW_TOKENS = 24, 6  # the prompt holds the image (LLaVA's 16 tokens from the fourth) and text after it


def prompt_images(name, images, length):
    """The image inputs for a sequence of ``length`` tokens that starts with the prompt of image_batch: the
    token-type rows padded with text (0) past the prompt."""
    return {key: torch.nn.functional.pad(value, (0, length - value.shape[1])) if key.endswith("token_type_ids")
            else value for key, value in images.items()}


@pytest.mark.parametrize("name", CORE_VLMS)
def test_logits_through_the_kv_cache_match_the_full_forward(name):
    """The image in the prefill, then one text token at a time through the cache (the Qwen models continue the
    image's positions by the rope deltas of the prefill)."""
    stock = tiny_vlm(name).eval()
    model = coat.convert(copy.deepcopy(stock))
    tokens, _, images = image_batch(name, length=PROMPT + NEW_TOKENS)
    prefill = {key: value[:, :PROMPT] if key.endswith("token_type_ids") else value for key, value in images.items()}
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(tokens[:, :PROMPT], use_cache=True, **{cache_keyword(model): cache}, **prefill).logits]
        for position in range(PROMPT, tokens.shape[1]):
            step = model(tokens[:, position:position + 1], use_cache=True, **{cache_keyword(model): cache})
            logits.append(step.logits)
        full, stock_full = (m(tokens, **images).logits for m in (model, stock))
    cached = torch.cat(logits, dim=1)
    assert cache.get_seq_length() == tokens.shape[1]
    assert relative_error(cached, full) <= CACHED_BOUND
    assert relative_error(cached, stock_full) <= FORWARD_BOUND


@pytest.mark.parametrize("name", MAIN_VLMS)
def test_greedy_generate_with_an_image(name, device):
    """generate() with an image: the new tokens' logits (through the KV cache) are those of the full forward over
    the generated sequence, image included, within the bound of the text models."""
    model = coat.convert(tiny_vlm(name).to(device)).eval()
    tokens, _, images = on_device(device, *image_batch(name, length=PROMPT))
    # Text tokens only: a random model may pick an image token, which the full forward would then count as one more
    # image token than it has features for (transformers refuses that).
    special = list(range(TEXT_TOKENS, model.config.get_text_config().vocab_size))
    generated = model.generate(tokens, **images, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                               eos_token_id=None, suppress_tokens=special, output_logits=True,
                               return_dict_in_generate=True)
    sequences = generated.sequences
    assert sequences.shape == (2, PROMPT + NEW_TOKENS) and torch.equal(sequences[:, :PROMPT], tokens)
    assert (sequences[:, PROMPT:] < TEXT_TOKENS).all()
    context = sequences[:, :-1]
    with torch.no_grad():
        full = model(context, **prompt_images(name, images, context.shape[1])).logits[:, PROMPT - 1:]
    assert relative_error(torch.stack(generated.logits, dim=1), full) <= CACHED_BOUND


@pytest.mark.parametrize("name", CORE_VLMS)
def test_save_pretrained_round_trip(name, tmp_path):
    """A converted model's checkpoint is the stock model's: loaded by the stock class and converted again, it
    computes the same logits."""
    converted = coat.convert(tiny_vlm(name))
    converted.save_pretrained(tmp_path)
    reloaded = coat.convert(VLMS[name][0].from_pretrained(tmp_path, dtype=torch.bfloat16))
    assert reloaded.state_dict().keys() == converted.state_dict().keys()
    assert all(torch.equal(v, converted.state_dict()[k]) for k, v in reloaded.state_dict().items())
    tokens, _, images = image_batch(name)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens, **images).logits, converted(tokens, **images).logits)


@pytest.mark.parametrize("fused_loss", [True, False])
def test_whole_model_pickles_into_a_fresh_process(fused_loss, tmp_path):
    """torch.save of the whole converted model (the fused-loss class, the vision layers' subclasses) loads in
    another process, which finds the classes by their names, and gives the same loss bit for bit."""
    model = coat.convert(tiny_vlm("qwen2_5_vl"), fused_loss=fused_loss)
    tokens, labels, images = image_batch("qwen2_5_vl")
    torch.save({"model": model, "inputs": (tokens, labels, images)}, tmp_path / "model.pt")
    loaded = subprocess.run([sys.executable, "-c", (
        "import sys, torch\n"
        "saved = torch.load(sys.argv[1], weights_only=False)\n"
        "tokens, labels, images = saved['inputs']\n"
        "torch.save(saved['model'](tokens, labels=labels, **images).loss, sys.argv[2])\n"
        "block = saved['model'].model.visual.blocks[0]\n"
        "print(type(saved['model']).__name__, type(block).avoids_cudnn_attention, type(block.attn).batches_equal_chunks)"),
        str(tmp_path / "model.pt"), str(tmp_path / "loss.pt")], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == [type(model).__name__, "True", "True"]
    assert torch.equal(torch.load(tmp_path / "loss.pt"), model(tokens, labels=labels, **images).loss)


def test_qwen3_vl_layer_keeps_the_stock_order_of_arguments():
    """Qwen3-VL's text decoder layer takes position_embeddings second: a positional call means the same to the
    converted layer."""
    model = tiny_vlm("qwen3_vl")
    hidden = torch.randn(2, 8, TEXT["hidden_size"], dtype=torch.bfloat16)
    rope = language_model(model).rotary_emb(hidden, torch.arange(8).expand(3, 2, 8))
    layer = language_model(model).layers[0]
    with torch.no_grad():
        stock = layer(hidden, rope, None)
        coat.convert(model)
        assert relative_error(layer(hidden, rope, None).float(), stock.float()) <= FORWARD_BOUND


def test_configurations_the_plan_does_not_cover_are_refused():
    """Refused with the model untouched: the families' own limits, named by the layer (an MLP activation other than
    SiLU, head_dim above the fused q/k norm kernel's 256, expert widths the FP8 grouped GEMM cannot take)."""
    gelu = tiny_vlm("qwen2_5_vl", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"cannot convert model\.language_model\.layers\.0: .*SiLU"):
        coat.convert(gelu)
    assert not any(type(layer) in FP8_DECODER_LAYERS.values() for layer in language_model(gelu).layers)
    wide = tiny_vlm("qwen3_vl", head_dim=288)
    with pytest.raises(ValueError, match=r"layers\.0: head_dim 288 is above the 256 .*skip_modules"):
        coat.convert(wide)
    odd_experts = tiny_vlm("qwen3_vl_moe", moe_intermediate_size=40)
    with pytest.raises(ValueError, match=r"layers\.0: the FP8 grouped GEMM needs .* got 64 and 40"):
        coat.convert(odd_experts)
    assert not any(type(layer) in FP8_DECODER_LAYERS.values() for layer in language_model(odd_experts).layers)


def test_qwen3_vl_moe_fused_loss_adds_the_routers_loss():
    """Qwen3-VL-MoE's forward adds its router's load-balancing loss, weighted by the text config's
    router_aux_loss_coef, when output_router_logits is passed: the fused loss adds the same."""
    model = tiny_vlm("qwen3_vl_moe", router_aux_loss_coef=0.5)
    unfused = coat.convert(copy.deepcopy(model), fused_loss=False)
    fused = coat.convert(model)
    tokens, labels, images = image_batch("qwen3_vl_moe")
    assert_same_training_step(fused, unfused, tokens, labels=labels, output_router_logits=True, **images)
    with torch.no_grad():
        routed = fused(tokens, labels=labels, output_router_logits=True, **images)
        plain = fused(tokens, labels=labels, **images)
    assert routed.aux_loss is not None and plain.aux_loss is None
    torch.testing.assert_close(routed.loss, plain.loss + 0.5 * routed.aux_loss, rtol=0, atol=1e-5)


def vision_side_linears(model) -> dict:
    """The qualified names and types of the linear layers (nn.Linear and its subclasses) on the vision side."""
    return {f"model.{part}.{name}": type(module) for part, child in model.model.named_children()
            if child is not language_model(model) for name, module in child.named_modules()
            if isinstance(module, torch.nn.Linear)}


# The vision towers' MLPs, fused by vision_linears: the coat class and its activation. Gated: Qwen2.5-VL's (SiLU, with
# biases) and Pixtral's (Mistral 3: SiLU). Non-gated: CLIP's (quick_gelu), SigLIP's, Idefics3's and Qwen3-VL's
# (gelu_pytorch_tanh). InternVL's tower has the erf GELU, which no kernel fuses: its fc1 and fc2 are coat.nn.Linears.
VISION_MLPS = {"llava_llama": ("MLP", "quick_gelu"), "llava_next": ("MLP", "quick_gelu"),
               "llava_onevision": ("MLP", "gelu_tanh"), "mistral3": ("SwiGLUMLP", "silu"), "internvl": None,
               "idefics3": ("MLP", "gelu_tanh"), "smolvlm": ("MLP", "gelu_tanh"), "gemma3": ("MLP", "gelu_tanh"),
               "qwen2_5_vl": ("SwiGLUMLP", "silu"), "qwen2_vl": ("MLP", "quick_gelu"),
               "qwen3_vl": ("MLP", "gelu_tanh"), "qwen3_vl_moe": ("MLP", "gelu_tanh")}


@pytest.mark.parametrize("name", [*MAIN_VLMS, "qwen2_vl"])
def test_vision_linears_converts_the_vision_towers_and_projectors_linear_layers(name):
    """Every nn.Linear of the vision side becomes a coat.nn.Linear; each block's MLP becomes the fused coat MLP of its
    kind (VISION_MLPS), its linear layers inside it, with the tower's activation."""
    model = tiny_vlm(name)
    stock = vision_side_linears(model)
    # each block's MLP: "...blocks.0.mlp", "...layers.0.mlp" (Pixtral's: "feed_forward")
    mlps = [n for n, m in model.named_modules() if is_vision_side(n)
            and re.search(r"\.\d+\.(mlp|feed_forward)$", n)]
    assert mlps
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat.convert(model, vision_linears=True)
    fused = {n: model.get_submodule(n) for n in mlps}
    if VISION_MLPS[name] is None:
        assert not any(isinstance(m, (coat.nn.MLP, coat.nn.SwiGLUMLP)) for m in fused.values())
    else:
        cls, activation = VISION_MLPS[name]
        assert {(type(m).__name__, m.activation) for m in fused.values()} == {(cls, activation)}
    converted = vision_side_linears(model)
    assert converted.keys() == stock.keys()
    plain = [n for n, cls in stock.items() if cls is torch.nn.Linear]
    assert plain and all(converted[n] is coat.nn.Linear for n in plain)
    # nn.MultiheadAttention's output projection (SigLIP's pooling head) is read by its weight: left as it is.
    assert all(converted[n] is cls for n, cls in stock.items() if cls is not torch.nn.Linear)
    assert list(model.state_dict()) == keys and all(p is before[n] for n, p in model.named_parameters())
    assert all(type(layer) in FP8_DECODER_LAYERS.values() for layer in language_model(model).layers)
    assert type(model.lm_head) is FusedLossLMHead


def vision_side_step(model, images, upstream=None):
    """The image features (the outputs of image_feature_modules) and the vision side's gradients for the loss
    sum(features * upstream), upstream random unless given: the vision side on its own, the same gradient
    arriving in both models."""
    features = []
    hooks = [m.register_forward_hook(lambda module, args, output: features.append(output))
             for m in image_feature_modules(model)]
    model.zero_grad()
    layout = {key: images[key] for key in ("image_grid_thw", "image_sizes") if key in images}
    try:
        model.model.get_image_features(images["pixel_values"], **layout)
    finally:
        for hook in hooks:
            hook.remove()
    if upstream is None:
        generator = torch.Generator().manual_seed(5)
        upstream = [torch.randn(f.shape, generator=generator).to(f.device, f.dtype) for f in features]
    sum((f * u).float().sum() for f, u in zip(features, upstream)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [f.detach() for f in features], upstream, grads


# The key projection's bias of CLIP's and SigLIP's attention adds the same amount to every logit of a query, which
# the softmax ignores: its gradient is zero in exact arithmetic, and in both models rounding noise.
NO_GRADIENT = ".self_attn.k_proj.bias"
# The text models' gradient bound (0.2) with room for the vision towers' LayerNorm biases, whose gradients sum the
# upstream gradient over every patch with cancellation: up to 0.17 on the CPU, and 0.214 on an H100 for Qwen3-VL's
# last block's norm2.bias (0.078 on the CPU).
VISION_GRADIENT_BOUND = 0.25


@pytest.mark.parametrize("name", MAIN_VLMS)
def test_fp8_vision_side_close_to_bf16(name, device):
    """With vision_linears, the vision side's image features within the forward bound of the BF16 ones and its
    gradients (the same gradient arriving at the features) within VISION_GRADIENT_BOUND: the towers here are two
    layers deep, as the text models; the whole model's loss within the text models' bound too."""
    model = tiny_vlm(name).to(device)
    converted = coat.convert(copy.deepcopy(model), vision_linears=True)
    tokens, labels, images = on_device(device, *image_batch(name))
    bf16_features, upstream, bf16_grads = vision_side_step(model, images)
    fp8_features, _, fp8_grads = vision_side_step(converted, images, upstream)
    for fp8, bf16 in zip(fp8_features, bf16_features, strict=True):
        assert relative_error(fp8, bf16) <= FORWARD_BOUND
    assert fp8_grads.keys() == bf16_grads.keys()
    for n, bf16_grad in bf16_grads.items():
        if not n.endswith(NO_GRADIENT):
            error = relative_error(fp8_grads[n], bf16_grad)
            print(f"  {n:64s} {error:.3f}")
            assert error <= VISION_GRADIENT_BOUND, n
    fp8_loss, _ = loss_and_grads(converted, tokens, labels, images)
    bf16_loss, _ = loss_and_grads(model, tokens, labels, images)
    assert abs(fp8_loss - bf16_loss) <= LOSS_BOUND * abs(bf16_loss)


def test_vision_linears_follow_skip_modules_and_need_a_known_vision_side():
    model = coat.convert(tiny_vlm("qwen2_5_vl"), vision_linears=True, skip_modules=["model.visual.merger.*"])
    linears = vision_side_linears(model)
    assert {cls for n, cls in linears.items() if n.startswith("model.visual.merger.")} == {torch.nn.Linear}
    assert {cls for n, cls in linears.items() if n.startswith("model.visual.blocks.")} == {coat.nn.Linear}

    # A gated MLP one of whose projections is skipped stays the stock module, its other projections FP8 one by one.
    model = coat.convert(tiny_vlm("qwen2_5_vl"), vision_linears=True, skip_modules=["model.visual.blocks.0.mlp.up_proj"])
    kept, fused = model.model.visual.blocks[0].mlp, model.model.visual.blocks[1].mlp
    assert type(kept).__name__ == "Qwen2_5_VLMLP" and type(fused) is coat.nn.SwiGLUMLP
    assert [type(getattr(kept, n)) for n in ("gate_proj", "up_proj", "down_proj")] == [
        coat.nn.Linear, torch.nn.Linear, coat.nn.Linear]

    text_only = tiny_model("llama")
    with pytest.raises(ValueError, match=r"vision_linears=True converts the vision side of .*LlamaForCausalLM is "
                                         r"none of them.*modules_to_convert"):
        coat.convert(text_only, vision_linears=True)
    assert all(type(layer) is LlamaDecoderLayer for layer in text_only.model.layers)  # left untouched


def test_torch_compile_of_a_converted_vision_language_model():
    """Qwen2.5-VL's language model, converted, is one graph for torch.compile (no break in coat's layers, the
    three M-RoPE streams given); the whole model, whose vision side computes its attention windows from host-side
    lists (graph breaks there, as in the stock model), compiled with AOTAutograd gives eager's loss bit for bit and
    its gradients within less than one E5M2 rounding (0.072, as an inductor-compiled layer in test_nn_llama.py):
    the stock model's compiled backward already differs from its eager one by bf16 roundings (up to 0.008 here),
    which flip a few FP8 codes downstream in the converted one (up to 0.065)."""
    model = coat.convert(tiny_vlm("qwen2_5_vl"))
    tokens, labels, images = image_batch("qwen2_5_vl")
    embeds = model.model.get_input_embeddings()(tokens).detach()
    positions = torch.arange(tokens.shape[1]).expand(3, *tokens.shape)
    explanation = torch._dynamo.explain(
        lambda e, p: model.model.language_model(inputs_embeds=e, position_ids=p).last_hidden_state)(embeds, positions)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    torch._dynamo.reset()
    eager_loss, eager_grads = loss_and_grads(model, tokens, labels, images)
    model.zero_grad()
    compiled_loss = torch.compile(model, backend="aot_eager")(tokens, labels=labels, **images).loss
    compiled_loss.backward()
    compiled_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert torch.equal(compiled_loss.detach(), eager_loss)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        assert relative_error(compiled_grads[name], grad) <= 0.072, name


@pytest.fixture
def attention_calls(monkeypatch):
    """Each call of transformers' SDPA attention function (coat's decoder layers call it too): the module, whether
    it got a mask tensor, and the SDPA kernels enabled for it."""
    calls = []
    sdpa = AttentionInterface._global_mapping["sdpa"]

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        kernels = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
                   "math": torch.backends.cuda.math_sdp_enabled()}
        calls.append((module, isinstance(attention_mask, torch.Tensor), kernels))
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy)
    return calls


@pytest.mark.parametrize("name, checkpointing", [(name, False) for name in MAIN_VLMS]
                         + [(name, True) for name in CORE_VLMS])
def test_vision_attention_and_masked_attention_leave_out_cudnn(name, checkpointing, attention_calls):
    """After coat.convert, the vision tower's attention runs without cuDNN's SDPA kernel (coat.nn.attention),
    in the forward and, with gradient checkpointing, in the backward's recomputation (which runs each layer's
    forward again, outside the tower's); the other kernels stay as enabled (an enclosing sdpa_kernel([MATH]) keeps
    FlashAttention's off). The language model's attention keeps cuDNN's unless given a mask tensor (Gemma 3's
    image tokens attend both ways). The loss is the same as without the change, bit for bit (on a CPU the
    kernels are the same)."""
    model = tiny_vlm(name)
    expected = loss_and_grads(coat.convert(tiny_vlm(name)), *image_batch(name))[0] if not checkpointing else None
    coat.convert(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tower = model.get_submodule(VISION_MODULES[VLMS[name][0]][0])
    in_tower = {id(m) for m in tower.modules()}
    tokens, labels, images = image_batch(name)
    for outer, flash in ((None, True), ([SDPBackend.MATH], False)):
        attention_calls.clear()
        with sdpa_kernel(outer) if outer else contextlib.nullcontext():
            loss = loss_and_grads(model, tokens, labels, images)[0]
        vision = [kernels for module, _, kernels in attention_calls if id(module) in in_tower]
        text = [(masked, kernels) for module, masked, kernels in attention_calls if id(module) not in in_tower]
        # one attention a layer (the Qwen towers' two pictures of one size: one batched call, coat's chunks)
        forward_calls = sum(isinstance(m, GradientCheckpointingLayer) for m in tower.modules())
        assert len(vision) == forward_calls * (2 if checkpointing else 1)
        assert vision == [{"cudnn": False, "flash": flash, "math": True}] * len(vision)
        assert text and all(kernels["cudnn"] == (outer is None and not masked) for masked, kernels in text)
        assert any(masked for masked, _ in text) == (name == "gemma3")
        if expected is not None and outer is None:
            assert torch.equal(loss, expected)


# Pictures of 4 x 4, 6 x 10 and 8 x 8 patches: Qwen2.5-VL's windows of 4 x 4 patches at most, in its windowed block,
# are 16, 8 and 4 patches long, in runs of one length, and the pictures are three chunks of the other blocks.
CHUNK_GRIDS = [[1, 4, 4], [1, 6, 10], [1, 8, 8]]


def vision_tower_run(model, device, generator):
    """The vision tower's output tensors on pictures of CHUNK_GRIDS, and its parameters' gradients of a random
    weighting of them."""
    visual = model.model.visual
    patches = sum(t * h * w for t, h, w in CHUNK_GRIDS)
    pixels = torch.randn(patches, 3 * QWEN_TEMPORAL * QWEN_PATCH ** 2, generator=generator).to(device, torch.bfloat16)
    visual.zero_grad()
    output = visual(pixels, grid_thw=torch.tensor(CHUNK_GRIDS, device=device))
    tensors = [t for t in output.to_tuple() for t in (t if isinstance(t, (list, tuple)) else [t])]
    weights = [torch.randn(t.shape, generator=generator).to(device) for t in tensors]
    sum((t.float() * w).sum() for t, w in zip(tensors, weights)).backward()
    return [t.detach() for t in tensors], {n: p.grad for n, p in visual.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("name", QWEN_VLMS)
def test_vision_attention_batches_equal_chunks_bit_for_bit(name, implementation, device, monkeypatch):
    """batch_equal_chunks: the Qwen towers attend within each run of equal-length chunks of cu_seqlens (Qwen2.5-VL's
    windows, the pictures of the other blocks) in one call. On pictures whose windows have four lengths, the tower's
    outputs and its parameters' gradients equal the stock tower's bit for bit (both off cuDNN's kernel, torch's
    deterministic kernels), under SDPA and eager attention, with fewer SDPA calls."""
    stock = tiny_vlm(name).to(device)
    stock.set_attn_implementation(implementation)
    batched = copy.deepcopy(stock)
    avoid_cudnn_attention(stock)
    assert convert_vision_attention(batched)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(args[0].shape[0]) or sdpa(*args, **kwargs))
    counts = []
    with deterministic_algorithms():
        for model in (stock, batched):
            calls.clear()
            outputs, grads = vision_tower_run(model, device, torch.Generator().manual_seed(3))
            counts.append(len(calls))
            if model is stock:
                expected = outputs, grads
    for got, want in zip(outputs, expected[0], strict=True):
        assert torch.equal(got, want)
    assert grads.keys() == expected[1].keys() and grads
    for n, grad in grads.items():
        assert torch.equal(grad, expected[1][n]), n
    if implementation == "sdpa":
        # Qwen2.5-VL's windowed block: windows of 16 | 16, 16, 8, 8, 8, 4 | 16, 16, 16, 16 patches, 11 calls against
        # the runs' 4; its other block 3 pictures of 3 sizes, 3 calls either way. The others' two blocks: 3 and 3.
        assert counts == ([14, 7] if name == "qwen2_5_vl" else [6, 6])


def test_batched_vision_attention_keeps_no_qkv_output():
    """For backward the batched attention keeps a copy of the values, not a view of the qkv output, which would keep
    all of it (q and k too, which the rotary copies anyway): every storage it keeps is one token-width wide at most."""
    model = tiny_vlm("qwen2_5_vl")
    batch_equal_chunks(model)
    attention = model.model.visual.blocks[0].attn
    width, patches = QWEN_VISION["hidden_size"], 16
    hidden = torch.randn(patches, width, dtype=torch.bfloat16, requires_grad=True)
    rotary = (torch.ones(patches, width // 2), torch.zeros(patches, width // 2))  # head_dim 16: no rotation
    parameters = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    kept = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attention(hidden, torch.tensor([0, 8, 16], dtype=torch.int32), rotary)
    assert kept and max(kept.values()) == patches * width * 2  # BF16


def test_equal_length_runs():
    assert equal_length_runs([]) == []
    assert equal_length_runs([16, 16, 8, 0, 8, 4, 16]) == [(2, 16), (2, 8), (1, 4), (1, 16)]
    assert equal_length_runs([0, 0]) == []


def test_batched_vision_attention_checks_its_chunks_and_defers_to_flash_attention(monkeypatch):
    """cu_seqlens that do not cover the patches is an error, as in the stock forward; where FlashAttention is
    requested, the stock forward runs (one variable-length call already)."""
    model = tiny_vlm("qwen2_5_vl")
    batch_equal_chunks(model)
    attention = model.model.visual.blocks[0].attn
    hidden = torch.randn(16, QWEN_VISION["hidden_size"], dtype=torch.bfloat16)
    rotary = (torch.ones(16, 16), torch.zeros(16, 16))  # head_dim 16: no rotation
    with pytest.raises(ValueError, match="cu_seqlens covers 12 patches of 16"):
        attention(hidden, torch.tensor([0, 12], dtype=torch.int32), rotary)
    stock_forward = type(attention).__mro__[1].forward
    monkeypatch.setattr(type(attention).__mro__[1], "forward", lambda self, *args, **kwargs: "stock")
    monkeypatch.setattr(attention.config, "_attn_implementation", "flash_attention_2")
    assert attention(hidden, torch.tensor([0, 16], dtype=torch.int32), rotary) == "stock"
    assert stock_forward is not type(attention).forward


def test_a_bf16_model_avoids_cudnn_attention_as_converted_ones_do():
    """The example's BF16 runs take the vision attention's kernels as coat.convert does: avoid_cudnn_attention on
    a stock model changes the classes of the tower's layers only (same names, parameters, state dict and loss); a
    second call changes nothing; a model without a known vision side is left as it is."""
    model = tiny_vlm("qwen2_5_vl")
    tokens, labels, images = image_batch("qwen2_5_vl")
    loss = loss_and_grads(model, tokens, labels, images)[0]
    keys, parameters = list(model.state_dict()), dict(model.named_parameters())
    assert avoid_cudnn_attention(model)
    classes = [type(m) for m in model.modules()]
    assert avoid_cudnn_attention(model)
    assert [type(m) for m in model.modules()] == classes
    changed = [n for n, m in model.named_modules() if hasattr(m, "avoids_cudnn_attention")]
    assert changed == [f"model.visual.blocks.{i}" for i in range(len(model.model.visual.blocks))]
    assert type(model.model.visual.blocks[0]).__name__ == "Qwen2_5_VLVisionBlock"
    assert list(model.state_dict()) == keys and dict(model.named_parameters()) == parameters
    assert torch.equal(loss_and_grads(model, tokens, labels, images)[0], loss)
    text_only = LlamaForCausalLM(LlamaConfig(**TEXT))
    assert not avoid_cudnn_attention(text_only)
    assert not any(hasattr(m, "avoids_cudnn_attention") for m in text_only.modules())
