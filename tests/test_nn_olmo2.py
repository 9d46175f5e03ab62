"""coat.convert on tiny OLMo 2 models: what OLMo 2 changes from Llama (no pre-norms; post-norms on the attention and
MLP outputs before the residual adds; q_norm / k_norm over the whole q and k projections before RoPE). The families'
shared checks (loss and gradients, generation, training + resume, torch.compile) run in tests/test_nn_llama.py, whose FAMILIES include
OLMo 2; bounds are explained there (OLMo 2's model-level gradients against a float32 model with coat's quantization
points, reference_nn.fp8_reference_loss: test_gradients_within_the_fp8_reference)."""
import copy

import pytest
import torch
from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

import coat
from coat.nn.decoder_olmo2 import FP8Olmo2DecoderLayer
from reference_nn import relative_error
from test_nn_llama import FORWARD_BOUND, GRADIENT_BOUND, layer_inputs, layer_step, tiny_model, token_batch

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too



@pytest.mark.parametrize("attention_bias", [False, True])
def test_layer_output_and_gradients_against_the_float32_layer(attention_bias):
    """A converted layer in BF16 against the unconverted one in float32, inputs and weights the same."""
    model = tiny_model("olmo2", attention_bias=attention_bias)
    if attention_bias:  # transformers initializes biases to zero: give them values the test can see
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    hidden, grad, rope = layer_inputs(model)
    stock = copy.deepcopy(model.model.layers[0]).float()
    expected = layer_step(stock, hidden.float(), tuple(t.float() for t in rope), grad.float())
    converted = coat.convert(model).model.layers[0]
    assert isinstance(converted, FP8Olmo2DecoderLayer)
    actual = layer_step(converted, hidden, rope, grad)
    names = ["output", "input grad"] + [name for name, _ in converted.named_parameters()]
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected):
        bound = FORWARD_BOUND if name == "output" else GRADIENT_BOUND["e5m2", "e4m3"]
        assert relative_error(a.float(), e) <= bound, name


def test_conversion_keeps_parameters_and_keys():
    model = tiny_model("olmo2")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is before[name] for name, p in model.named_parameters())
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_norm, coat.nn.RMSNorm) and isinstance(layer.post_feedforward_layernorm,
                                                                              coat.nn.RMSNorm)




def test_unsupported_configs_are_refused_at_convert():
    gelu = tiny_model("olmo2", hidden_act="gelu")
    with pytest.raises(ValueError, match="SiLU"):
        coat.convert(gelu)
    assert all(type(layer) is Olmo2DecoderLayer for layer in gelu.model.layers)  # left untouched
    narrowed = tiny_model("olmo2")
    narrowed.model.layers[1].self_attn.k_norm.weight = torch.nn.Parameter(torch.ones(16))
    with pytest.raises(ValueError, match=r"layers.1: OLMo 2's q_norm and k_norm must span the q and k projections"):
        coat.convert(narrowed)
    assert all(type(layer) is Olmo2DecoderLayer for layer in narrowed.model.layers)


def test_a_replaced_norm_is_refused_not_ignored():
    model = coat.convert(tiny_model("olmo2"))
    model.model.layers[0].post_feedforward_layernorm = torch.nn.RMSNorm(64)
    with pytest.raises(TypeError, match=r"post_feedforward_layernorm is now a RMSNorm, not the coat.nn.RMSNorm"):
        model(token_batch("cpu"))



def test_saves_no_16_bit_activation_beyond_attention():
    """Every norm keeps its input in FP8 1 x G groups: a layer's backward keeps no 16-bit [B, S, hidden] or
    [B, S, heads * D] tensor but what attention keeps (q, k, v and its output) and o_proj's input."""
    model = coat.convert(tiny_model("olmo2"))
    layer = model.model.layers[0]
    hidden, grad, rope = layer_inputs(model)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    hidden.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, position_embeddings=rope)
    attention = 5  # SDPA keeps q, k, v and its output; after_attention the output as o_proj's input (as Llama's)
    wide = [t for t in saved if t.dtype == torch.bfloat16 and t.dim() >= 3 and t.numel() >= hidden.numel() // 2]
    assert len(wide) <= attention, [tuple(t.shape) for t in wide]


def test_report_works_on_it():
    model = coat.convert(tiny_model("olmo2"))
    tokens = token_batch("cpu")
    report = coat.report.QuantizationReport(model)
    with report.capture(step=1):
        model(tokens, labels=tokens).loss.backward()
    rows = report.rows()
    assert {row["layer"] for row in rows} >= {"model.layers.0", "model.layers.1"}
    assert all(row["nonfinite"] == 0 for row in rows)
