"""coat.convert on tiny Phi-3 models: what Phi-3 changes from Llama (one fused qkv_proj weight, one fused
gate_up_proj, gate first; residual dropout; longrope), and what it refuses. The families' shared checks (loss and
gradients against BF16, KV cache, greedy generate(), training + resume, torch.compile, CUDA against CPU) run in
tests/test_nn_llama.py, whose FAMILIES include Phi-3; bounds are explained there."""
import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer

import coat
import coat.nn.gemm
from coat.nn import functional as coat_functional
from coat.nn.causal_lm import FusedLossLMHead
from coat.nn.families.phi3 import FP8Phi3DecoderLayer
from reference_nn import relative_error
from test_nn_llama import (
    FORWARD_BOUND,
    GRADIENT_BOUND,
    TINY,
    expected_saved_bytes,
    layer_inputs,
    layer_step,
    saved_activation_bytes,
    tiny_model,
    token_batch,
)
from test_report import LAYER_TENSORS

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

# longrope: a short_factor up to original_max_position_embeddings tokens, a long_factor past them (the model
# recomputes its tables per forward), one factor per frequency (head_dim / 2 = 8 here).
LONGROPE = dict(original_max_position_embeddings=16, rope_parameters=dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 8 for i in range(8)],
    long_factor=[2.0 + i for i in range(8)]))


@pytest.mark.parametrize("options", [{}, {"gradient_format": None}, {"smooth_swiglu": True}, {"saved_format": "fp4"}],
                         ids=["defaults", "bf16-backward", "smooth-swiglu", "fp4-saved"])
def test_layer_output_and_gradients_against_the_float32_layer(options):
    """A converted layer in BF16 against the unconverted one in float32, inputs and weights the same: the fused
    weights' gradients come whole from one wgrad GEMM each (a BF16 one with gradient_format=None)."""
    model = tiny_model("phi3")
    hidden, grad, rope = layer_inputs(model)
    stock = copy.deepcopy(model.model.layers[0]).float()
    expected = layer_step(stock, hidden.float(), tuple(t.float() for t in rope), grad.float())
    converted = coat.convert(model, **options).model.layers[0]
    formats = (options.get("gradient_format", "e5m2"), options.get("saved_format", "e4m3"))
    assert isinstance(converted, FP8Phi3DecoderLayer)
    actual = layer_step(converted, hidden, rope, grad)
    names = ["output", "input grad"] + [name for name, _ in converted.named_parameters()]
    assert "self_attn.qkv_proj.weight" in names and "mlp.gate_up_proj.weight" in names
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected):
        bound = FORWARD_BOUND if name == "output" else GRADIENT_BOUND[formats]
        assert relative_error(a.float(), e) <= bound, name


def test_fused_weights_get_their_gradient_in_one_piece(monkeypatch):
    """The fused parameters' gradients are the wgrad GEMM's blocks as they come, not views scattered into zeros:
    one GEMM per fused weight (and per o_proj / down_proj) in the converted layer's backward, three + one forward."""
    model = coat.convert(tiny_model("phi3"))
    layer = model.model.layers[0]
    hidden, grad, rope = layer_inputs(model, length=24)  # 48 tokens: no weight has 48 rows
    shapes = []
    gemm = coat_functional.fp8_gemm

    def counted(a, a_scale, b_t, *args, **kwargs):
        shapes.append((a.shape[0], b_t.shape[0]))
        return gemm(a, a_scale, b_t, *args, **kwargs)

    monkeypatch.setattr(coat.nn.gemm, "fp8_gemm", counted)  # what Projections calls
    layer_step(layer, hidden, rope, grad)
    config, tokens = model.config, hidden.shape[0] * hidden.shape[1]
    head, hidden_size, inter = 16, config.hidden_size, config.intermediate_size
    q_width, kv_width = config.num_attention_heads * head, config.num_key_value_heads * head
    forward = [(tokens, q_width), (tokens, kv_width), (tokens, kv_width), (tokens, hidden_size),
               (tokens, 2 * inter), (tokens, hidden_size)]
    assert shapes[:6] == forward
    wgrads = [s for s in shapes[6:] if s[0] != tokens]
    assert sorted(wgrads) == sorted([(q_width + 2 * kv_width, hidden_size), (hidden_size, q_width),
                                     (2 * inter, hidden_size), (hidden_size, inter)])
    assert len(shapes) == 6 + 8  # a dgrad and a wgrad GEMM per weight


def test_conversion_keeps_parameters_and_keys():
    model = tiny_model("phi3")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    coat.convert(model)
    assert list(model.state_dict()) == keys
    assert all(p is before[name] for name, p in model.named_parameters())
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, coat.nn.Linear) and isinstance(layer.mlp.gate_up_proj, coat.nn.Linear)
    assert isinstance(model.lm_head, FusedLossLMHead)  # the fused LM head + loss


def test_saved_activations_are_llamas():
    """q, k and v are tensors of their own (three GEMMs on the fused weight's row blocks), so the converted layer
    saves what a Llama layer of the same shape saves: a view of one joint qkv output kept by attention would keep
    q and k a second time (see coat.nn.families.phi3)."""
    batch, length = 2, 32
    model = tiny_model("phi3")
    hidden = torch.randn(batch, length, TINY["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
    rope = model.model.rotary_emb(hidden, torch.arange(length)[None])
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    coat.convert(model)
    converted = saved_activation_bytes(model.model.layers[0], hidden, rope, parameters)
    _, expected = expected_saved_bytes(LlamaConfig(**TINY), batch, length)  # the same shape
    assert abs(converted - expected) <= 0.01 * expected



def test_report_names_the_tensors_as_for_llama():
    """coat.report records the fused weights under the names of Llama's groups (qkv_weight, gate_up_weight)."""
    model = coat.convert(tiny_model("phi3"))
    report = coat.report.QuantizationReport(model)
    tokens = token_batch("cpu")
    with report.capture(step=1):
        model(tokens, labels=tokens).loss.backward()
    rows = report.rows()
    for layer in ("model.layers.0", "model.layers.1"):
        assert [row["tensor"] for row in rows if row["layer"] == layer] == LAYER_TENSORS
    assert all(row["nonfinite"] == 0 and row["rel_error"] < 0.08 for row in rows)



def test_longrope_matches_the_stock_model():
    """longrope changes only the cos / sin tables the model computes (short factors up to 16 tokens here, long
    ones past them), which the converted layers read as they come."""
    model = tiny_model("phi3", **LONGROPE)
    assert model.config.rope_parameters["rope_type"] == "longrope"
    converted = coat.convert(copy.deepcopy(model))
    plain = tiny_model("phi3")  # plain RoPE
    for length in (12, 32):  # within and past original_max_position_embeddings
        tokens = token_batch("cpu", length=length)
        hidden = model.model.embed_tokens(tokens)
        positions = torch.arange(length)[None]
        longrope_cos, _ = model.model.rotary_emb(hidden, positions)
        assert relative_error(longrope_cos.float(), plain.model.rotary_emb(hidden, positions)[0].float()) > 0.1
        with torch.no_grad():
            stock, fp8 = (m(tokens).logits.float() for m in (model, converted))
        assert relative_error(fp8, stock) <= FORWARD_BOUND
    hidden, grad, _ = layer_inputs(model)
    rope = model.model.rotary_emb(hidden, torch.arange(hidden.shape[1])[None])  # the long factors' tables
    expected = layer_step(copy.deepcopy(model.model.layers[0]).float(), hidden.float(),
                          tuple(t.float() for t in rope), grad.float())
    actual = layer_step(converted.model.layers[0], hidden, rope, grad)
    assert relative_error(actual[0].float(), expected[0]) <= FORWARD_BOUND
    assert relative_error(actual[1].float(), expected[1]) <= GRADIENT_BOUND["e5m2", "e4m3"]



@pytest.mark.parametrize("overrides, message", [
    (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
     r"layers.0: partial_rotary_factor 0.5: coat's RoPE kernel rotates the whole head"),
    (dict(resid_pdrop=0.1), r"layers.0: residual dropout .*resid_pdrop.*set config.resid_pdrop = 0.0"),
    (dict(hidden_act="gelu"), r"layers.0: Phi3MLP.activation_fn must be SiLU"),
])
def test_unsupported_configs_are_refused_at_convert(overrides, message):
    model = tiny_model("phi3", **overrides)
    with pytest.raises(ValueError, match=message):
        coat.convert(model)
    assert all(type(layer) is Phi3DecoderLayer for layer in model.model.layers)  # left untouched
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_attention_dropout_is_the_stock_layers():
    """Attention dropout runs inside transformers' attention function, which the converted layer calls as the stock
    one does (dropout in training mode only): in eval mode the output is the dropout-free one."""
    model = tiny_model("phi3", attention_dropout=0.5)
    plain = coat.convert(tiny_model("phi3")).eval()
    converted = coat.convert(model)
    tokens = token_batch("cpu")
    with torch.no_grad():
        assert torch.equal(converted.eval()(tokens).logits, plain(tokens).logits)
        torch.manual_seed(0)
        dropped = converted.train()(tokens).logits
    assert relative_error(dropped.float(), plain(tokens).logits.float()) > FORWARD_BOUND


def test_a_replaced_fused_projection_is_refused_not_ignored():
    model = coat.convert(tiny_model("phi3"))
    model.model.layers[0].mlp.gate_up_proj = torch.nn.Linear(64, 352, bias=False).bfloat16()
    with pytest.raises(TypeError, match=r"gate_up_proj is now a Linear, not the coat.nn.Linear"):
        model(token_batch("cpu"))


def test_fp8_all_gather_groups_the_fused_weights_alone():
    """coat.distributed.fp8_all_gather gives each fused weight a scale of its own (qkv_proj, o_proj; gate_up_proj,
    down_proj), as Llama's q/k/v and gate/up groups share one; before fully_shard the model trains as it did."""
    tokens = token_batch("cpu")
    reference = coat.convert(tiny_model("phi3").float())
    model = coat.convert(tiny_model("phi3").float())
    coat.distributed.fp8_all_gather(model)
    layer = model.model.layers[0]
    for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                         (layer.mlp, "down_proj")):
        assert [module() for module in getattr(parent, name).weight.group.modules] == [getattr(parent, name)]
    losses = []
    for net in (reference, model):
        optimizer = coat.optim.AdamW(net.parameters(), lr=1e-2)
        for _ in range(2):
            loss = net(tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == losses[1]
