"""coat.convert on tiny Gemma 3 text models: what Gemma 3 changes from Llama ((1 + w) norms in float32; four norms
a layer, two of them on the blocks' outputs before the residual adds; per-head q_norm / k_norm before RoPE; GeGLU
with tanh-approximate GELU; sliding-window and global layers with their own RoPE tables; query_pre_attn_scalar; the
embeddings scaled by sqrt(hidden); the final logit soft-cap). The families' shared checks (loss and gradients
against BF16, generation, training + resume, torch.compile, what is saved, CUDA against the CPU) run in
tests/test_nn_llama.py, whose FAMILIES include Gemma 3; the fused loss with the soft-cap in tests/test_causal_lm.py;
bounds are explained there (Gemma 3's model-level gradients against a float32 model with coat's quantization points,
reference_nn.fp8_reference_loss: test_gradients_within_the_fp8_reference)."""
import copy

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

import coat
from coat.nn.families.gemma3 import FP8Gemma3DecoderLayer
from reference_nn import relative_error
from test_nn_llama import FORWARD_BOUND, gradient_bound, layer_inputs, layer_step, tiny_model

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too


def perturbed_norm_weights(model):
    """Gemma's norm weights start at 0 (the norms multiply by 1 + w): values the (1 + w) path can get wrong."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("layer_index", [0, 1], ids=["sliding", "global"])
def test_layer_output_and_gradients_against_the_float32_layer(layer_index):
    """A converted layer in BF16 against the unconverted one in float32, inputs and weights the same."""
    model = perturbed_norm_weights(tiny_model("gemma3"))
    hidden, grad, rope = layer_inputs(model, layer_index)
    stock = copy.deepcopy(model.model.layers[layer_index]).float()
    expected = layer_step(stock, hidden.float(), tuple(t.float() for t in rope), grad.float())
    converted = coat.convert(model).model.layers[layer_index]
    assert isinstance(converted, FP8Gemma3DecoderLayer)
    actual = layer_step(converted, hidden, rope, grad)
    names = ["output", "input grad"] + [name for name, _ in converted.named_parameters()]
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected):
        bound = FORWARD_BOUND if name == "output" else gradient_bound(name, "e5m2", "e4m3")
        assert relative_error(a.float(), e) <= bound, name


def test_norms_multiply_by_one_plus_weight():
    """With every norm weight -1 the (1 + w) norms output zeros: a layer is then the identity on its input (both
    blocks end in a zeroed post-norm), which a norm without the offset would not give."""
    model = coat.convert(tiny_model("gemma3"))
    layer = model.model.layers[0]
    with torch.no_grad():
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            getattr(layer, name).weight.fill_(-1.0)
    hidden, _, rope = layer_inputs(model, 0)
    with torch.no_grad():
        assert torch.equal(layer(hidden, attention_mask=None, position_embeddings=rope), hidden)


def test_conversion_keeps_parameters_and_keys():
    model = tiny_model("gemma3")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is before[name] for name, p in model.named_parameters())
    layer = model.model.layers[0]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    assert all(isinstance(getattr(layer, name), coat.nn.RMSNorm) for name in norms)
    assert isinstance(layer.self_attn.q_norm, coat.nn.RMSNorm) and layer.mlp.activation == "gelu_tanh"


def test_unsupported_configs_are_refused_at_convert():
    erf_gelu = tiny_model("gemma3", hidden_activation="gelu")
    with pytest.raises(ValueError, match="the tanh GELU"):
        coat.convert(erf_gelu)
    assert all(type(layer) is Gemma3DecoderLayer for layer in erf_gelu.model.layers)  # left untouched
    wide_heads = tiny_model("gemma3", head_dim=512, query_pre_attn_scalar=512)
    with pytest.raises(ValueError, match="head_dim 512 is above the 256"):
        coat.convert(wide_heads)
    assert all(type(layer) is Gemma3DecoderLayer for layer in wide_heads.model.layers)
