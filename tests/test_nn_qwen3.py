"""coat.convert on tiny Qwen3 models: what Qwen3 adds to Llama (q_norm / k_norm over each head before RoPE,
per-layer sliding windows, attention biases). The families' shared checks (the layer against float32, loss and
gradients against BF16, the bytes saved for backward, generation, training + resume, torch.compile) run in
tests/test_nn_llama.py, whose FAMILIES include Qwen3; bounds are explained there."""
import copy

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

import coat
from reference_nn import relative_error
from test_nn_llama import FORWARD_BOUND, tiny_model, token_batch

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too


def test_conversion_keeps_parameters_and_keys():
    model = tiny_model("qwen3")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is before[name] for name, p in model.named_parameters())
    assert isinstance(model.model.layers[0].self_attn.q_norm, coat.nn.RMSNorm)


def test_sliding_window_layers_match_the_stock_model():
    overrides = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    model = tiny_model("qwen3", **overrides)
    assert model.model.layers[0].self_attn.sliding_window == 4
    converted = coat.convert(copy.deepcopy(model))
    windowless = coat.convert(tiny_model("qwen3"))  # the same weights, every layer attending to every token
    tokens = token_batch("cpu")
    with torch.no_grad():
        stock, fp8, unwindowed = (m(tokens).logits.float() for m in (model, converted, windowless))
    assert relative_error(fp8, stock) <= FORWARD_BOUND
    assert relative_error(unwindowed, stock) > 2 * relative_error(fp8, stock)


def test_unsupported_configs_are_refused_at_convert():
    wide = tiny_model("qwen3", head_dim=288)
    with pytest.raises(ValueError, match=r"head_dim 288 is above the 256 .*skip_modules"):
        coat.convert(wide)
    assert all(type(layer) is Qwen3DecoderLayer for layer in wide.model.layers)  # left untouched
    uneven = tiny_model("qwen3")
    uneven.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-5
    with pytest.raises(ValueError, match=r"layers.1: q_norm and k_norm must share one eps"):
        coat.convert(uneven)
    with pytest.raises(ValueError, match="SiLU"):
        coat.convert(tiny_model("qwen3", hidden_act="gelu"))


def test_a_replaced_head_norm_is_refused_not_ignored():
    model = coat.convert(tiny_model("qwen3"))
    model.model.layers[0].self_attn.k_norm = torch.nn.RMSNorm(32)
    with pytest.raises(TypeError, match=r"k_norm is now a RMSNorm, not the coat.nn.RMSNorm"):
        model(token_batch("cpu"))
