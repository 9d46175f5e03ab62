"""coat.convert on tiny OLMo 2 models: what OLMo 2 changes from Llama (no pre-norms; post-norms on the attention and
MLP outputs before the residual adds; q_norm / k_norm over the whole q and k projections before RoPE). The families'
shared checks (the layer against float32, loss and gradients, generation, training + resume, torch.compile, what is
saved) run in tests/test_nn_llama.py, whose FAMILIES include OLMo 2; bounds are explained there (OLMo 2's model-level
gradients against a float32 model with coat's quantization points, reference_nn.fp8_reference_loss:
test_gradients_within_the_fp8_reference)."""
import pytest
import torch
from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer

import coat
from test_nn_llama import tiny_model, token_batch

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too


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
    with pytest.raises(ValueError, match=r"layers.1: q_norm and k_norm must span the q and k projections"):
        coat.convert(narrowed)
    assert all(type(layer) is Olmo2DecoderLayer for layer in narrowed.model.layers)


def test_a_replaced_norm_is_refused_not_ignored():
    model = coat.convert(tiny_model("olmo2"))
    model.model.layers[0].post_feedforward_layernorm = torch.nn.RMSNorm(64)
    with pytest.raises(TypeError, match=r"post_feedforward_layernorm is now a RMSNorm, not the coat.nn.RMSNorm"):
        model(token_batch("cpu"))


def test_report_works_on_it():
    model = coat.convert(tiny_model("olmo2"))
    tokens = token_batch("cpu")
    report = coat.report.QuantizationReport(model)
    with report.capture(step=1):
        model(tokens, labels=tokens).loss.backward()
    rows = report.rows()
    assert {row["layer"] for row in rows} >= {"model.layers.0", "model.layers.1"}
    assert all(row["nonfinite"] == 0 for row in rows)
