"""coat.convert's fused LM head + loss (coat/nn/causal_lm.py) on tiny transformers causal LMs: with labels in
training mode, the loss and every gradient against the same converted model with fused_loss=False (transformers'
own loss on its logits); the logits None then, and as before without labels or in eval mode; transformers' loss
keywords (num_items_in_batch as the Trainer passes it, shift_labels, ignore_index); tied and untied embeddings;
generate(); torch.compile. The Trainer's evaluate() on a converted model: tests/test_optim_trainer.py."""
import copy
import functools
import inspect

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, LlamaModel,
                          MistralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config)

import coat
from coat.nn.causal_lm import FusedLossLMHead
from reference_nn import relative_error

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

TINY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=300,
    max_position_embeddings=128,
    attn_implementation="sdpa",
)
# Phi-3's default pad token (32000) lies outside the tiny vocabulary.
FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "phi3": functools.partial(Phi3Config, pad_token_id=0, eos_token_id=2), "olmo2": Olmo2Config,
            "gemma3": functools.partial(Gemma3TextConfig, head_dim=16)}


def fused_and_unfused(family="llama", **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](**{**TINY, **overrides}), dtype=torch.bfloat16)
    unfused = coat.convert(copy.deepcopy(model), fused_loss=False)
    return coat.convert(model), unfused


def batch(length=24, padded=5):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (2, length), generator=generator)
    labels = tokens.clone()
    labels[1, -padded:] = -100  # padding
    return tokens, labels


def loss_and_grads(model, tokens, **kwargs):
    model.zero_grad()
    outputs = model(tokens, **kwargs)
    outputs.loss.backward()
    return outputs, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(fused, unfused, tokens, **kwargs):
    out, grads = loss_and_grads(fused, tokens, **kwargs)
    want, want_grads = loss_and_grads(unfused, tokens, **kwargs)
    assert out.logits is None and want.logits is not None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-4, atol=1e-4)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        # The same bf16 GEMMs; the head's weight gradient is a float32 sum rounded once here, a bf16 GEMM output
        # there, then added to the embedding's in bf16 when tied: a few bf16 roundings apart (2^-9 each).
        assert relative_error(grads[name], want_grads[name]) <= 1e-2, name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_loss_matches_transformers_loss(family, tied):
    fused, unfused = fused_and_unfused(family, tie_word_embeddings=tied)
    assert type(fused).__name__ == f"FusedLoss{type(unfused).__name__}" and isinstance(fused, type(unfused))
    assert type(fused.lm_head) is FusedLossLMHead and type(unfused.lm_head) is torch.nn.Linear
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tied
    tokens, labels = batch()
    assert_same_training_step(fused, unfused, tokens, labels=labels)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_final_logit_softcap(tied):
    """Gemma's final_logit_softcapping, cap * tanh(logits / cap), goes into the fused loss (and is not applied to
    the loss). In float32: transformers caps bf16 logits in bf16, a few roundings from the float32 cap."""
    fused, unfused = (m.float() for m in fused_and_unfused("gemma3", final_logit_softcapping=2.0,
                                                           tie_word_embeddings=tied))
    tokens, labels = batch()
    assert_same_training_step(fused, unfused, tokens, labels=labels)
    assert fused.config.final_logit_softcapping == 2.0  # set back after the forward
    with torch.no_grad():
        logits = fused(tokens).logits
    assert torch.equal(logits, unfused(tokens).logits) and logits.abs().max() <= 2.0


def test_loss_keywords_of_transformers():
    """num_items_in_batch (the Trainer's, for gradient accumulation), shift_labels and ignore_index reach the
    fused loss as they reach transformers' ForCausalLMLoss."""
    fused, unfused = fused_and_unfused()
    tokens, labels = batch()
    assert_same_training_step(fused, unfused, tokens, labels=labels, num_items_in_batch=torch.tensor(100))
    assert_same_training_step(fused, unfused, tokens, labels=labels, num_items_in_batch=37)
    shifted = torch.roll(labels, -2, dims=1)
    assert_same_training_step(fused, unfused, tokens, labels=labels, shift_labels=shifted)
    assert_same_training_step(fused, unfused, tokens, labels=labels.where(labels != -100, 7), ignore_index=7)


def test_without_labels_logits_come_back_as_before():
    fused, unfused = fused_and_unfused()
    tokens, labels = batch()
    with torch.no_grad():
        assert torch.equal(fused(tokens).logits, unfused(tokens).logits)
        as_tuple = fused(tokens, labels=labels, return_dict=False)
        want = unfused(tokens, labels=labels, return_dict=False)
    assert len(as_tuple) == len(want) - 1  # the tuple leaves the None logits out
    torch.testing.assert_close(as_tuple[0], want[0], rtol=1e-4, atol=1e-4)
    assert fused.lm_head.pending_loss is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eval_mode_returns_the_logits_and_loss_of_the_stock_head(family):
    """In eval mode (the Trainer's evaluate()) labels leave the logits in the output, with transformers' loss on
    them: bit for bit those of the same converted model with fused_loss=False (the stock head and loss); Gemma 3's
    logits soft-capped as its stock forward caps them. Back in training mode the logits are dropped again."""
    softcap = {"final_logit_softcapping": 2.0} if family == "gemma3" else {}
    fused, unfused = fused_and_unfused(family, **softcap)
    tokens, labels = batch()
    fused.eval(), unfused.eval()
    with torch.no_grad():
        out, want = fused(tokens, labels=labels), unfused(tokens, labels=labels)
        as_tuple = fused(tokens, labels=labels, return_dict=False)
    assert out.logits.shape == (2, 24, TINY["vocab_size"])
    assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
    assert len(as_tuple) == len(want.to_tuple()) and torch.equal(as_tuple[1], want.logits)
    if softcap:
        assert out.logits.abs().max() <= 2.0
    fused.train()
    assert fused(tokens, labels=labels).logits is None


def test_generate_is_unaffected():
    fused, unfused = fused_and_unfused()
    prompt = batch()[0][:1, :8]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.eval().generate(prompt, **settings), unfused.eval().generate(prompt, **settings))


def test_model_keeps_its_signature_and_state_dict():
    """The Trainer keeps the dataset columns that forward's signature names; checkpoints keep their keys."""
    fused, unfused = fused_and_unfused()
    assert inspect.signature(fused.forward) == inspect.signature(unfused.forward)
    assert fused.state_dict().keys() == unfused.state_dict().keys()


def test_labels_must_match_the_kept_positions():
    fused, _ = fused_and_unfused()
    tokens, labels = batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        fused(tokens, labels=labels, logits_to_keep=4)
    assert fused.lm_head.pending_loss is None, "a failed call leaves the head computing logits"
    assert fused(tokens).logits.shape == (2, 24, TINY["vocab_size"])


def test_not_installed_where_it_does_not_apply():
    torch.manual_seed(0)
    assert type(coat.convert(AutoModelForCausalLM.from_config(LlamaConfig(**TINY)), fused_loss=False)) is LlamaForCausalLM
    assert type(coat.convert(LlamaModel(LlamaConfig(**TINY)))) is LlamaModel  # no head
    fp8_head = coat.convert(AutoModelForCausalLM.from_config(LlamaConfig(**TINY)),
                            modules_to_convert=["model.layers.*", "lm_head"])
    assert type(fp8_head) is LlamaForCausalLM and isinstance(fp8_head.lm_head, coat.nn.Linear)


def test_compiles_without_graph_break():
    fused, unfused = fused_and_unfused()
    tokens, labels = batch()
    explanation = torch._dynamo.explain(lambda t, y: fused(t, labels=y).loss)(tokens, labels)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    compiled = torch.compile(lambda t, y: fused(t, labels=y).loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(tokens, labels), fused(tokens, labels=labels).loss, rtol=0, atol=0)
