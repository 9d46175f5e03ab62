"""coat.convert on tiny mixtures of experts: what the MoE families add to the dense ones (coat.nn.families.moe). The
shared checks (loss and gradients against BF16 with the routing pinned, the KV cache, generate(), torch.compile,
FSDP2) run for them in tests/test_nn_llama.py and tests/test_fsdp_families.py, whose FAMILIES include them."""
import copy

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM

import coat
from coat.nn.families.moe import FP8Qwen2MoeDecoderLayer
from test_nn_llama import TINY, tiny_model, token_batch

pytestmark = pytest.mark.transformers

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_conversion_keeps_parameters_keys_and_the_router():
    model = tiny_model("qwen2_moe")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is before[name] for name, p in model.named_parameters())
    layer = model.model.layers[0]
    assert isinstance(layer, FP8Qwen2MoeDecoderLayer)
    assert isinstance(layer.mlp.shared_expert, coat.nn.SwiGLUMLP)
    assert type(layer.mlp.gate).__name__ == "Qwen2MoeTopKRouter"  # the model's own router, unchanged


def test_the_fused_loss_adds_the_auxiliary_loss_as_transformers_does():
    model = coat.convert(tiny_model("mixtral"))
    unfused = coat.convert(tiny_model("mixtral"), fused_loss=False)
    tokens = token_batch("cpu")
    fused_out, unfused_out = model(tokens, labels=tokens), unfused(tokens, labels=tokens)
    assert fused_out.logits is None and fused_out.aux_loss is not None
    assert torch.equal(fused_out.aux_loss, unfused_out.aux_loss)
    # The same hidden states; the head's loss differs only by the fused kernel's float32 sums.
    assert abs(fused_out.loss - unfused_out.loss) <= 1e-3 * abs(unfused_out.loss)
    without_aux = model(tokens, labels=tokens, output_router_logits=False)
    coefficient = model.config.router_aux_loss_coef
    assert abs(fused_out.loss - without_aux.loss - coefficient * fused_out.aux_loss) <= 1e-5


@pytest.mark.parametrize("family, overrides, message", [
    ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1 multiplies"),
    ("olmoe", dict(clip_qkv=8.0), r"clip_qkv=8.0 clamps"),
    ("qwen3_moe", dict(moe_intermediate_size=40), r"multiples of 16, got 64 and 40"),
])
def test_configurations_the_plan_does_not_cover_are_refused_untouched(family, overrides, message):
    model = tiny_model(family, **overrides)
    stock = [type(layer) for layer in model.model.layers]
    with pytest.raises(ValueError, match=message):
        coat.convert(model)
    assert [type(layer) for layer in model.model.layers] == stock


def test_moe_options_the_experts_do_not_compute_are_refused():
    with pytest.raises(ValueError, match="smooth_swiglu is not supported in MoE layers"):
        coat.convert(tiny_model("olmoe"), smooth_swiglu=True)
    with pytest.raises(ValueError, match="gradient_format=None is not supported in MoE layers"):
        coat.convert(tiny_model("olmoe"), gradient_format=None)


@pytest.mark.parametrize("model_class, config, reason", [
    (GptOssForCausalLM, GptOssConfig(**SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                     head_dim=16), "clamped SwiGLU with biases"),
    (DeepseekV3ForCausalLM, DeepseekV3Config(**SMALL, intermediate_size=64, moe_intermediate_size=32,
                                             n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32,
                                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=16, first_k_dense_replace=1), "latent attention"),
])
def test_unsupported_moe_architectures_are_refused_by_name(model_class, config, reason):
    model = model_class(config)
    parameters = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=rf"built from \w+DecoderLayers, which coat does not convert .*{reason}"):
        coat.convert(model)
    assert all(torch.equal(parameters[key], value) for key, value in model.state_dict().items())


def test_eval_mode_returns_logits_and_the_loss_with_its_auxiliary_term():
    model = coat.convert(tiny_model("qwen3_moe")).eval()
    tokens = token_batch("cpu")
    with torch.no_grad():
        out = model(tokens, labels=tokens)
    assert out.logits.shape == (*tokens.shape, TINY["vocab_size"]) and out.aux_loss is not None
