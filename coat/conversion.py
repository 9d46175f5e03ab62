"""coat.convert: turns a transformers Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2 or Gemma 3 model, a mixture of
experts, or a vision-language model built on one (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Mistral 3, InternVL,
Idefics3, SmolVLM, Gemma 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), into an FP8-trained one, in place."""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from coat.compat import check_transformers_version
from coat.nn.config import FP8Config
from coat.nn.modules import Linear


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _refuse_tied_weights(model: nn.Module, linears: Sequence[tuple[str, nn.Linear]]) -> None:
    """An FP8 linear layer whose weight is also another module's (an LM head tied to the input embedding) would
    put that module's training through FP8 GEMMs too: refused, with how to untie it."""
    for name, linear in linears:
        weight_name = f"{name}.weight"
        tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is linear.weight and n != weight_name]
        if tied:
            raise ValueError(
                f"coat.convert: {name}.weight is the same parameter as {tied[0]} (the model ties them, e.g. "
                f"tie_word_embeddings=True), so an FP8 {name} would train {tied[0]} with FP8 gradients too. Leave "
                f"{name} out of modules_to_convert, or untie the weights before converting: "
                f"model.config.tie_word_embeddings = False; "
                f"model.{name}.weight = torch.nn.Parameter(model.{name}.weight.detach().clone())"
            )


def convert(
    model: nn.Module,
    *,
    group_size: int = 16,
    forward_format: str = "e4m3",
    gradient_format: str | None = "e5m2",
    smooth_swiglu: bool = False,
    saved_format: str = "e4m3",
    fast_accum: bool = False,
    experts_fast_accum: bool = True,
    modules_to_convert: Sequence[str] | None = None,
    skip_modules: Sequence[str] = (),
    fused_loss: bool = True,
    vision_linears: bool = False,
) -> nn.Module:
    """Converts ``model`` in place to coat's FP8 precision flow and returns it.

    Every decoder layer (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer,
    Phi3DecoderLayer, Olmo2DecoderLayer, Gemma3DecoderLayer) gets the FP8 forward of :mod:`coat.nn.decoder`:
    RMSNorm, SiLU*mul (GeGLU for Gemma 3) and all the projections in FP8, activations saved in FP8 (Qwen3's
    per-head q/k norms too, fused with RoPE: :mod:`coat.nn.families.qwen3`; Phi-3's fused qkv_proj and gate_up_proj
    weights: :mod:`coat.nn.families.phi3`; OLMo 2's post-norms and full-width q/k norms with 16-bit outputs and
    FP8-saved inputs: :mod:`coat.nn.families.olmo2`; Gemma 3's (1 + w) norms, four a layer:
    :mod:`coat.nn.families.gemma3`).
    The mixtures of experts (Qwen3MoeDecoderLayer, Qwen2MoeDecoderLayer, MixtralDecoderLayer, OlmoeDecoderLayer)
    get their dense family's attention and FP8 experts (:mod:`coat.nn.families.moe`, :mod:`coat.nn.experts`);
    gpt-oss and DeepSeek-V2/V3 are refused by name.
    Parameters are shared, not copied, so ``state_dict()`` keys and values, ``save_pretrained`` /
    ``from_pretrained``, ``eval()`` and ``generate()`` work as before.
    Vision-language models (LlavaForConditionalGeneration, LlavaNextForConditionalGeneration and
    LlavaOnevisionForConditionalGeneration with a Llama, Mistral or Qwen2 language model,
    Mistral3ForConditionalGeneration, InternVLForConditionalGeneration, Idefics3ForConditionalGeneration,
    SmolVLMForConditionalGeneration, Gemma3ForConditionalGeneration, Qwen2VLForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration) get
    their language model's decoder layers converted the same way (the Qwen models', with multimodal rotary positions,
    and Qwen3-VL-MoE's experts: :mod:`coat.nn.families.vlm`); the vision tower and the projector stay as they are
    unless vision_linears is True, except that the tower's attention leaves out cuDNN's SDPA kernel, whose backward can
    turn finite gradients into NaN there (:mod:`coat.nn.attention`; so does a decoder layer's attention given a
    mask tensor).

    group_size, forward_format, gradient_format, smooth_swiglu, saved_format, fast_accum, experts_fast_accum: see
        :class:`coat.nn.FP8Config`.
    modules_to_convert: fnmatch patterns of qualified module names (``"model.layers.*"``, ``"lm_head"``);
        the matching decoder layers are converted, and matching ``nn.Linear`` modules outside them become
        :class:`coat.nn.Linear`. None (the default) converts every decoder layer and nothing else.
    skip_modules: patterns of modules to leave as they are (e.g. ``["model.layers.0", "model.layers.31"]``
        to keep the first and last layers in BF16). A decoder layer is converted whole, so a pattern that
        matches only modules inside decoder layers is refused, as is one that matches no module.
    fused_loss: for the causal LMs of these families (LlamaForCausalLM, ..., Gemma3ForCausalLM with its final
        logit soft-cap) and the vision-language models above, compute the loss fused with the LM head
        (:mod:`coat.nn.causal_lm`) when labels are given in training mode: the [batch, seq, vocab] logits are never
        held, and the output's logits are None then. In eval mode (the Trainer's evaluate()) and without labels
        (generate()) the logits come back as before, with labels the loss too, both as the stock model computes them.
    vision_linears: for the vision-language models above, also put the vision tower and the projector through FP8
        (:mod:`coat.nn.vision`): a gated SiLU MLP (Qwen2.5-VL's and Pixtral's towers) becomes a
        :class:`coat.nn.SwiGLUMLP`, a non-gated MLP with a tanh GELU or quick_gelu (CLIP, SigLIP, Qwen2-VL and
        Qwen3-VL towers) a :class:`coat.nn.MLP`, every other ``torch.nn.Linear`` (attention projections, erf-GELU
        MLPs' projections, the projector's or patch merger's linears) a :class:`coat.nn.Linear`, FP8 GEMMs that keep
        their input in FP8 for backward; skip_modules applies to them by their names (``"model.visual.merger.*"``;
        naming a projection of an MLP leaves that MLP unfused). Off by default: the vision
        side stays as it is, BF16 or frozen as a recipe keeps it. Refused for a model whose vision side coat does
        not know.

    The LM head stays BF16 unless named in modules_to_convert: its logits feed the softmax over the
    vocabulary directly, where FP8 error shows up unfiltered in the loss (FP8 recipes, TransformerEngine's
    and COAT's included, keep the first and last layers in higher precision); it is often tied to the
    embedding; and it runs once per model, so FP8 would save little (one input of 1 unit of memory).

    Refused: a linear layer in modules_to_convert whose weight is tied to another module's (an LM head with
    tie_word_embeddings=True), and a transformers release older than coat supports; one newer than tested
    warns (see :mod:`coat.compat`). Refused with the model untouched, naming the layer: an MLP activation other
    than SiLU, Qwen3 head_dim above 256 or unequal q/k norm eps, Phi-3 partial_rotary_factor < 1 (coat's RoPE
    kernel rotates the whole head) or resid_pdrop > 0 (the fused residual additions apply no dropout).
    """
    check_transformers_version()  # before coat.nn.families imports transformers' decoder layers
    from coat.nn.families import FP8_DECODER_LAYERS, install_decoder_layer, plan_decoder_layer
    from coat.nn.families.registry import UNSUPPORTED_DECODER_LAYERS

    config = FP8Config(
        group_size=group_size,
        forward_format=forward_format,
        gradient_format=gradient_format,
        smooth_swiglu=smooth_swiglu,
        saved_format=saved_format,
        fast_accum=fast_accum,
        experts_fast_accum=experts_fast_accum,
    )
    converted_classes = tuple(FP8_DECODER_LAYERS.values())
    named = list(model.named_modules())
    if any(isinstance(module, converted_classes) for _, module in named):
        raise ValueError(f"coat.convert: {type(model).__name__} is already converted")
    decoder_layers = [(name, module) for name, module in named if type(module) in FP8_DECODER_LAYERS]
    refused = next((type(m).__name__ for _, m in named if type(m).__name__ in UNSUPPORTED_DECODER_LAYERS), None)
    if refused is not None:
        raise ValueError(f"coat.convert: {type(model).__name__} is built from {refused}s, which coat does not convert "
                         f"(the model is left as it is): {UNSUPPORTED_DECODER_LAYERS[refused]}")
    if not decoder_layers:
        supported = ", ".join(cls.__name__ for cls in FP8_DECODER_LAYERS)
        raise ValueError(
            f"coat.convert supports transformers models built from {supported}; "
            f"{type(model).__name__} has none of them"
        )

    inside_layers = tuple(f"{name}." for name, _ in decoder_layers)
    for pattern in skip_modules:  # a pattern that skips nothing is a typo or a misunderstanding, not a no-op
        hits = [name for name, _ in named if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(f"coat.convert: skip_modules pattern {pattern!r} matches no module")
        if all(name.startswith(inside_layers) for name in hits):
            layer = next(layer for layer in inside_layers if hits[0].startswith(layer)).rstrip(".")
            raise ValueError(
                f"coat.convert: skip_modules pattern {pattern!r} matches only modules inside decoder layers "
                f"({hits[0]}), which coat converts whole: name the layer ({layer!r}) to keep it as it is"
            )

    def selected(name: str) -> bool:
        return not _matches(name, skip_modules) and (modules_to_convert is None or _matches(name, modules_to_convert))

    layers = [(name, layer) for name, layer in decoder_layers if selected(name)]
    linears = []
    if modules_to_convert is not None:
        for pattern in modules_to_convert:
            if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in named):
                raise ValueError(f"coat.convert: modules_to_convert pattern {pattern!r} matches no module")
        linears = [
            (name, module)
            for name, module in named
            if isinstance(module, nn.Linear) and not name.startswith(inside_layers) and selected(name)
        ]
    mlps = []
    if vision_linears:
        from coat.nn.vision import vision_linears as find_vision_linears
        from coat.nn.vision import vision_mlps

        # An MLP is fused whole, unless skip_modules names it or one of its children.
        def skipped(name: str, mlp: nn.Module) -> bool:
            return any(_matches(n, skip_modules) for n in (name, *(f"{name}.{c}" for c, _ in mlp.named_children())))

        mlps = [(name, mlp, cls) for name, mlp, cls in vision_mlps(model) if not skipped(name, mlp)]
        converted = {name for name, _ in linears}
        linears += [(name, linear) for name, linear in find_vision_linears(model)
                    if name not in converted and not _matches(name, skip_modules)]
        inside_mlps = tuple(f"{name}." for name, _, _ in mlps)
        linears = [(name, linear) for name, linear in linears if not name.startswith(inside_mlps)]
    _refuse_tied_weights(model, linears)

    # Build every replacement first, so that a layer that does not fit leaves the model untouched.
    plans = [(layer, plan_decoder_layer(layer, name, config)) for name, layer in layers]
    replacements = [(name, Linear.from_linear(linear, config)) for name, linear in linears]
    replacements += [(name, cls.from_mlp(mlp, config)) for name, mlp, cls in mlps]
    for layer, plan in plans:
        install_decoder_layer(layer, plan, config)
    for name, module in replacements:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, module)
    if fused_loss:
        from coat.nn.causal_lm import install_fused_loss

        install_fused_loss(model)
    from coat.nn.vision import convert_vision_attention

    convert_vision_attention(model)
    return model
