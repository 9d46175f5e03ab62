"""coat.convert on tiny transformers models (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Gemma 3): numerics against
the BF16 model, the bytes saved for backward against appendix D / Table 2, checkpoints, generation and errors.

Gradient bounds: a parameter's gradient in a converted model passes through the FP8 roundings of the
chain that produced it: E5M2 output gradients (u = 2^-3, relative RMS error 0.072 each) at every linear
layer, E4M3 weights, activations and saved inputs (0.036 each). For the two-layer models here the
estimate of test_nn_modules.py applies, sqrt(2 * 0.072^2 + 5 * 0.036^2) = 0.13, bound 0.2; with BF16
backward GEMMs (gradient_format=None) only the E4M3 terms remain, sqrt(5) * 0.036 = 0.08, bound 0.12.
With the inputs of RMSNorm and SiLU*mul kept in FP4 (saved_format="fp4", relative RMS error 0.094 on
Gaussian data at G = 16, tests/test_block_formats.py), two of the E4M3 terms become FP4 ones:
sqrt(2 * 0.072^2 + 3 * 0.036^2 + 2 * 0.094^2) = 0.18, bound 0.3.
The loss averages over every token and class, so its FP8 noise averages out: bound 1% relative.
Qwen3's q_norm / k_norm weights get a gradient summed over every token and head of dq * xhat, downstream of
attention's softmax, where the FP8 forward errors of q and k enter twice (forward and backward): 0.13-0.22
measured here for the second layer against BF16 (0.20 with BF16 backward GEMMs too, so the FP8 forward
dominates; BF16 itself is 0.017 off float32); their bounds are 1.5x the others.
OLMo 2's and Gemma 3's gradients are further off, from their structure, not from coat: they are checked against a
float32 model with coat's quantization points (test_gradients_within_the_fp8_reference below).
"""
import contextlib
import copy
import functools
import inspect
import logging
import math
import pathlib
import re
import sys
import tomllib
import warnings

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    DynamicCache,
    Gemma3TextConfig,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.utils import logging as transformers_logging

import coat
import coat.nn.gemm
from coat.compat import TRANSFORMERS_NEWEST, TRANSFORMERS_OLDEST, TRANSFORMERS_REQUIREMENT
from coat.nn.families.llama import FP8LlamaDecoderLayer
from conftest import requires_cuda
from reference_nn import LowRankAdapter, fp8_reference_loss, relative_error

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

TINY = dict(
    hidden_size=64,
    intermediate_size=176,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=128,
    attn_implementation="sdpa",
)
# The mixtures of experts (coat.nn.families.moe): 8 experts of width 32, top 2, the router's auxiliary loss on;
# Qwen3-MoE's first layer dense (mlp_only_layers), Qwen2-MoE with its shared expert.
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
MOE_FAMILIES = {
    "qwen3_moe": functools.partial(Qwen3MoeConfig, head_dim=32, num_experts=8, moe_intermediate_size=32,
                                   mlp_only_layers=[0], **MOE),
    "qwen2_moe": functools.partial(Qwen2MoeConfig, num_experts=8, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64, **MOE),
    "mixtral": functools.partial(MixtralConfig, num_local_experts=8, intermediate_size=32, **MOE),
    "olmoe": functools.partial(OlmoeConfig, num_experts=8, intermediate_size=32, **MOE),
}
# Qwen3's head_dim defaults to 128 whatever the hidden size (Gemma 3's to 256): 32 here, two 16-element groups per
# head. Phi-3's default pad and end-of-sequence tokens (32000) lie outside the tiny vocabulary. Gemma 3: one
# sliding-window layer and one global one, as its 5:1 pattern has both.
FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
            "qwen3": functools.partial(Qwen3Config, head_dim=32),
            "phi3": functools.partial(Phi3Config, pad_token_id=0, eos_token_id=2), "olmo2": Olmo2Config,
            "gemma3": functools.partial(Gemma3TextConfig, head_dim=32, query_pre_attn_scalar=32,
                                        layer_types=["sliding_attention", "full_attention"], sliding_window=16),
            **MOE_FAMILIES}
GRADIENT_BOUND = {("e5m2", "e4m3"): 0.2, (None, "e4m3"): 0.12, ("e5m2", "fp4"): 0.3}
LOSS_BOUND = 0.01
HEAD_NORM_BOUND_FACTOR = 1.5


def gradient_bound(name, gradient_format, saved_format):
    factor = HEAD_NORM_BOUND_FACTOR if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
    return factor * GRADIENT_BOUND[gradient_format, saved_format]
FORWARD_BOUND = 0.12  # a chain of E4M3 roundings, as in test_nn_modules.py


def tiny_model(family="llama", device="cpu", seed=0, **overrides):
    """A randomly initialized BF16 model, built as from_pretrained builds one (RoPE buffers in float32)."""
    torch.manual_seed(seed)
    config = FAMILIES[family](**{**TINY, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)


def token_batch(device, batch=2, length=32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=generator).to(device)


def loss_and_grads(model, tokens):
    model.zero_grad()
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def moe_layers(model) -> list:
    """The decoder layers with a sparse MLP (of a causal LM or of a vision-language model's language model)."""
    return [module for module in model.modules() if hasattr(getattr(module, "mlp", None), "experts")]


@contextlib.contextmanager
def pinned_routing(follower, leader):
    """MoE models: the follower's routers choose the experts the leader's chose in its last forward (each token's
    weights recomputed from the follower's own probabilities). FP8 noise moves router logits, and a token whose
    k-th and (k+1)-th experts nearly tie (3 of 64 here) then goes to another expert: a whole token's contribution
    moves between experts with a few rows each, a difference of order 1 in their gradients that no precision
    removes. Pinned, the two models differ by their arithmetic alone. Dense models: nothing changes."""
    routers = [(layer.mlp.gate, leading.mlp.gate) for layer, leading in zip(moe_layers(follower), moe_layers(leader),
                                                                            strict=True)]
    chosen, hooks = {}, []
    for router, leading in routers:
        hooks.append(leading.register_forward_hook(lambda _, __, out, key=router: chosen.__setitem__(key, out[2])))

        def follow(module, _, out):
            logits, scores, _ = out
            index = chosen[module]
            top = logits.float().softmax(-1).gather(-1, index)
            if getattr(module, "norm_topk_prob", True):  # Mixtral's router has no switch: it always normalizes
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(scores.dtype), index

        hooks.append(router.register_forward_hook(follow))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


# BF16 backward GEMMs (gradient_format=None) and FP4-kept inputs on Llama only: the other families share the
# decoder code. OLMo 2 and Gemma 3 have their own test, test_gradients_within_the_fp8_reference.
FP8_REFERENCE_FAMILIES = ("olmo2", "gemma3")


@pytest.mark.parametrize(
    "family, gradient_format, saved_format",
    [(family, "e5m2", "e4m3") for family in FAMILIES if family not in FP8_REFERENCE_FAMILIES]
    + [("llama", None, "e4m3"), ("llama", "e5m2", "fp4")],
)
def test_loss_and_gradients_close_to_bf16(family, gradient_format, saved_format, device):
    model = tiny_model(family, device)
    converted = coat.convert(copy.deepcopy(model), gradient_format=gradient_format, saved_format=saved_format)
    tokens = token_batch(device)
    with pinned_routing(follower=model, leader=converted):
        fp8_loss, fp8_grads = loss_and_grads(converted, tokens)
        bf16_loss, bf16_grads = loss_and_grads(model, tokens)

    gradients = gradient_format or "bf16"
    print(f"\n{family}, gradients {gradients}, saved {saved_format}: loss {fp8_loss.item():.4f} "
          f"vs BF16 {bf16_loss.item():.4f}")
    assert abs(fp8_loss - bf16_loss) <= LOSS_BOUND * abs(bf16_loss)
    assert fp8_grads.keys() == bf16_grads.keys()
    for name, bf16_grad in bf16_grads.items():
        error = relative_error(fp8_grads[name], bf16_grad)
        print(f"  {name:48s} {error:.3f}")
        assert error <= gradient_bound(name, gradient_format, saved_format), name


def fp8_reference_grads(model, tokens) -> dict:
    """The gradients of a float32 copy of an OLMo 2 or Gemma 3 model that rounds where coat does and nowhere else
    (reference_nn.fp8_reference_loss), on the CPU."""
    reference = copy.deepcopy(model).float().cpu()
    fp8_reference_loss(reference, tokens.cpu()).backward()
    return {name: p.grad for name, p in reference.named_parameters()}


# OLMo 2's FP8 gradients are 0.09-0.18 off BF16 on these models (mean over 8 seeds; single draws up to 0.26), where
# Llama's are at most 0.12. The reason is the structure of these random models: without pre-norms the projections
# read the residual stream as it is (the embedding, RMS 0.02, in the first layer), so with N(0, 0.02) weights the
# blocks' outputs have a mean square of 1e-9 to 3e-6, below the norms' eps (1e-5); the post-norms then act as gains of
# w / sqrt(eps) = 316 and put each block's FP8-rounded output into the stream at 3x the embedding (the stream's RMS
# after the first layer is 0.065, the embedding's 0.020; Llama's 0.022, where the exact embedding dominates). The
# next layer's projections read that stream, FP8 error and all: 0.062 relative after the first layer, Llama's
# 0.026. With the post-norm weights scaled by 0.1 the stream's error is 0.019 and the gradients' 0.09 (mean) and
# 0.12 (max), Llama's. A float32 model with coat's quantization points and nothing else has OLMo 2's errors: coat's
# mean error is 0.90-1.13x the reference's per parameter over 8 seeds (a single draw 0.7-1.6x, which is why the
# check averages seeds). The reference's error splits into its FP8 forward (E4M3 inputs and weights: 0.09-0.15
# without the E5M2 gradients) and the E5M2 gradients (0.05-0.11 alone); BF16 is 0.013 off float32. A coat bug adds
# to the reference's error: 1.25x is the bound.
# Gemma 3's are 0.12-0.26 off BF16 (mean over 8 seeds; single draws up to 0.33, the second layer's q/k projections
# and norms the furthest), by the same mechanism: its post-norms ((1 + w), w = 0 here, eps 1e-6 below the blocks' mean squares) scale
# each block's FP8-rounded output to RMS 1 and add it to a stream that starts at the embedding's RMS 0.16 (N(0,
# 0.02) times sqrt(64)): after the first layer the stream's RMS is 1.4, almost all of it rounded block outputs,
# which the second layer's projections read. The reference has these errors: coat's mean is 0.88-1.05x the
# reference's per parameter (max 1.05x, q_norm of the second layer; a single draw 0.7-1.5x, the reference's own up
# to 0.30); the reference's FP8 forward alone (E4M3 inputs and weights) gives 0.13-0.24, its E5M2 gradients alone
# 0.01-0.12, the 1 x 16 saved copies alone 0.01-0.04.
REFERENCE_SEEDS = 8
REFERENCE_FACTOR = 1.25


@pytest.mark.parametrize("family", FP8_REFERENCE_FAMILIES)
def test_fp8_reference_without_its_roundings_is_the_float32_model(family):
    """The reference these families' gradients are bounded by, with every quantization point off, computes what the
    stock float32 model computes: it is the family written from its formula, not a different model."""
    model = tiny_model(family).float()
    tokens = token_batch("cpu")
    loss, grads = loss_and_grads(model, tokens)
    model.zero_grad()
    reference_loss = fp8_reference_loss(model, tokens, points=frozenset())
    reference_loss.backward()
    assert abs(reference_loss.item() - loss.item()) <= 1e-6 * loss.item()
    for name, p in model.named_parameters():
        assert relative_error(p.grad, grads[name]) <= 1e-5, name


@pytest.mark.parametrize("family", FP8_REFERENCE_FAMILIES)
def test_gradients_within_the_fp8_reference(family, device):
    errors = {}  # parameter name -> [(coat's error, the reference's error) per seed], both against BF16
    for seed in range(REFERENCE_SEEDS):
        model = tiny_model(family, device, seed=seed)
        tokens = token_batch(device, seed=seed + 1)
        converted = coat.convert(copy.deepcopy(model))
        bf16_loss, bf16_grads = loss_and_grads(model, tokens)
        fp8_loss, fp8_grads = loss_and_grads(converted, tokens)
        assert abs(fp8_loss - bf16_loss) <= LOSS_BOUND * abs(bf16_loss)
        reference_grads = fp8_reference_grads(model, tokens)
        assert fp8_grads.keys() == bf16_grads.keys() == reference_grads.keys()
        for name, bf16_grad in bf16_grads.items():
            errors.setdefault(name, []).append((relative_error(fp8_grads[name], bf16_grad),
                                                relative_error(reference_grads[name], bf16_grad.cpu())))
    print(f"\n{family}: {'mean error against BF16 over seeds':40s}   coat reference")
    for name, pairs in errors.items():
        coat_error, reference_error = (sum(column) / REFERENCE_SEEDS for column in zip(*pairs))
        print(f"  {name:48s} {coat_error:.3f} {reference_error:.3f}")
        assert coat_error <= REFERENCE_FACTOR * reference_error, name


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gradient_format", ["e5m2", None])
def test_float32_weights_under_autocast_match_the_stock_model(autocast_dtype, gradient_format, device):
    """Mixed precision as most scripts run it: float32 weights, forward and backward inside torch.autocast.
    The FP8 GEMMs' fallback where a device has none (the CPU here, GPUs before sm_89) and the BF16 backward
    GEMMs compute in coat's dtypes: under float16 autocast the unscaled FP8 sums overflowed to Inf."""
    model = tiny_model("llama", device).float()
    converted = coat.convert(copy.deepcopy(model), gradient_format=gradient_format)
    tokens = token_batch(device)
    results = []
    for m in (model, converted):
        with torch.autocast(torch.device(device).type, dtype=autocast_dtype):
            results.append(loss_and_grads(m, tokens))  # backward inside the region too
    (stock_loss, stock_grads), (loss, grads) = results
    assert abs(loss - stock_loss) <= LOSS_BOUND * abs(stock_loss)
    for name, stock_grad in stock_grads.items():
        assert relative_error(grads[name], stock_grad) <= GRADIENT_BOUND[gradient_format, "e4m3"], name


def saved_activation_bytes(layer, hidden_states, position_embeddings, parameters) -> int:
    """Bytes of the distinct storages autograd saves in one decoder layer's forward, parameters excluded."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden_states, attention_mask=None, position_embeddings=position_embeddings)
    return sum(storages.values())


def expected_saved_bytes(config, batch, length, group_size=16, saved_format="e4m3") -> tuple[int, int]:
    """Activation bytes one decoder layer saves, per appendix D / Table 2, for the stock BF16 layer and the
    converted one. Per token, with H hidden, I intermediate, nq / nkv heads of size d:

      stock BF16 (transformers 5.17 with SDPA)      converted
      RMSNorm x2: fp32 input 4H, bf16 normalized    x2: E4M3 input H + fp32 1x16 scales 4H/16
                  2H, rstd 4                            + rstd 4
      q/k/v input: 2H                               (nothing: recomputed from the norm's saved input)
      attention: q, k, v, output 2(2 nq d + 2 nkv d),  the same (kept by the attention kernel; o_proj
                 logsumexp 4 nq                        shares its output and saves one amax)
      o_proj input: shared with attention's output  (nothing)
      gate/up input: 2H                             (nothing: recomputed from the norm's saved input)
      SiLU*mul: gate, silu(gate), up 3 x 2I         gate, up as E4M3 in 1x16 groups 2(I + 4I/16)
      down input: 2I                                (nothing: recomputed from the saved gate and up)
    Qwen3 adds its per-head q/k norms, on nq + nkv rows of d per token:
      q_norm, k_norm: fp32 input 4d, bf16           E4M3 input d + fp32 1x16 scales 4d/16 + rstd 4, E4M3
                      normalized 2d, rstd 4             whatever saved_format (coat.ops.qk_norm_rope)
    plus RoPE's cos and sin, [length, d] bf16 each, shared by the batch, and a few fp32 scalars (ignored).
    With saved_format="fp4" the E4M3 copies of n columns (n bytes + 4n/16 of scales) become FP4 in 1 x G
    blocks: ceil(n/2) bytes + 4 ceil(n/G) of scales; with "fp6", FP6: ceil(3n/4) bytes + 4 ceil(n/G).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    head, nq, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    attention = 2 * (2 * nq * head + 2 * nkv * head) + 4 * nq
    rope = 2 * length * head * 2
    stock = 2 * (4 * hidden + 2 * hidden + 4) + 2 * hidden + attention + 2 * hidden + 4 * 2 * inter
    def kept(columns):
        scales = 4 * -(-columns // group_size)
        codes = {"e4m3": columns, "fp4": -(-columns // 2), "fp6": -(-3 * columns // 4)}[saved_format]
        return codes + scales

    fp8 = 2 * (kept(hidden) + 4) + attention + 2 * kept(inter)
    if config.model_type == "qwen3":
        stock += (nq + nkv) * (4 * head + 2 * head + 4)
        fp8 += (nq + nkv) * (head + 4 * -(-head // group_size) + 4)
    tokens = batch * length
    return stock * tokens + rope, fp8 * tokens + rope


@pytest.mark.parametrize("family, saved_format, group_size",
                         [("llama", *case) for case in [("e4m3", 16), ("fp4", 16), ("fp4", 64), ("fp4", 128),
                                                        ("fp6", 16), ("fp6", 128)]]
                         + [("qwen3", "e4m3", 16), ("qwen3", "fp4", 128)])
def test_saved_activation_bytes_match_table_2(device, family, saved_format, group_size):
    """The converted layer saves what appendix D says, and about half of what the stock layer saves.

    For this configuration (I/H = 2.75, 4 query and 2 key/value heads) the accounting above gives 22.2 U /
    7.9 U = 2.82 (plus RoPE's tables); for Llama-2-7B (H 4096, I 11008, 32 heads) it gives 22.8 U / 8.6 U =
    2.64 (U = 2H bytes per token). Table 2 of the paper has 22.66 U / 13.33 U = 1.69: its BF16 column is the
    same total, but it counts 2 U for RoPE, which in transformers saves only cos and sin; its COAT column
    also keeps the FP8 inputs of the linear layers that follow RMSNorm and SiLU*mul, which coat recomputes,
    and leaves out the group scales (fp32 in coat). With FP4-kept inputs (saved_format="fp4") a Llama-2-7B
    layer saves 6.8 U at G = 16, 6.1 U at G = 64 and 6.0 U at G = 128: attention's 4 U is the floor; with
    FP6-kept inputs 7.7 U at G = 16 and 6.9 U at G = 128. A Qwen3 layer saves no 16-bit tensor a Llama layer
    does not: its q/k norms keep their inputs in E4M3 too.
    """
    batch, length = 2, 32
    model = tiny_model(family, device)
    hidden = torch.randn(batch, length, TINY["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(length, device=device)[None]
    rope = model.model.rotary_emb(hidden, positions)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stock = saved_activation_bytes(model.model.layers[0], hidden, rope, parameters)
    coat.convert(model, saved_format=saved_format, group_size=group_size)
    converted = saved_activation_bytes(model.model.layers[0], hidden, rope, parameters)
    expected_stock, expected_converted = expected_saved_bytes(model.config, batch, length, group_size, saved_format)
    unit = batch * length * TINY["hidden_size"] * 2
    print(f"\nsaved per layer: stock {stock / unit:.2f} U (expected {expected_stock / unit:.2f}), "
          f"converted {converted / unit:.2f} U (expected {expected_converted / unit:.2f}), "
          f"ratio {stock / converted:.2f} (expected {expected_stock / expected_converted:.2f})")
    # Attention saves the same tensors in both layers, so the difference does not depend on the backend.
    expected_saving = expected_stock - expected_converted
    assert abs((stock - converted) - expected_saving) <= 0.01 * expected_saving
    if device == "cpu":  # where the SDPA kernel's saved tensors are the ones listed above
        assert abs(stock - expected_stock) <= 0.01 * expected_stock
        assert abs(converted - expected_converted) <= 0.01 * expected_converted
        expected_ratio = expected_stock / expected_converted  # 2.76 with RoPE's tables and E4M3 at G = 16
        assert abs(stock / converted - expected_ratio) <= 0.02 * expected_ratio
    assert stock / converted >= 2.5
    if family == "qwen3":  # the q/k norms' inputs are kept in FP8: no bf16 [B, S, H, D] tensor beyond attention's
        sixteen_bit = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sixteen_bit.append(t) if t.dtype == torch.bfloat16 and t.dim() == 4 else None, lambda t: t):
            model.model.layers[0](hidden, attention_mask=None, position_embeddings=rope)
        heads_shaped = [t for t in sixteen_bit if t.shape[-1] == model.config.head_dim]
        assert len(heads_shaped) == 4, [tuple(t.shape) for t in heads_shaped]  # SDPA's q, k, v and output


# U per decoder layer of the Llama-2-7B shape (README, Results: "Saved activations"), RoPE's tables left out as
# benchmarks/layer.py's "tensors U" leaves them out: (saved_format, group_size) -> converted layer; BF16 22.77.
LLAMA_2_7B_SAVED_U = {("e4m3", 16): 8.63, ("fp4", 16): 6.78, ("fp4", 64): 6.09, ("fp4", 128): 5.98,
                      ("fp6", 16): 7.70, ("fp6", 128): 6.90}


@pytest.mark.parametrize("saved_format, group_size", list(LLAMA_2_7B_SAVED_U))
def test_llama_2_7b_accounting_gives_the_readme_figures(saved_format, group_size):
    """The accounting that test_saved_activation_bytes_match_table_2 checks against the bytes autograd keeps,
    at the Llama-2-7B shape and layer.py's (4096, 2048) setting, is what the README quotes and what layer.py
    measured (8.626, 6.782 and 5.976 U of tensors on an H200)."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32)
    batch, length = 4, 2048
    rope = 2 * length * config.head_dim * 2
    stock, converted = expected_saved_bytes(config, batch, length, group_size, saved_format)
    unit = 2 * batch * length * config.hidden_size
    assert round((stock - rope) / unit, 2) == 22.77
    assert round((converted - rope) / unit, 2) == LLAMA_2_7B_SAVED_U[saved_format, group_size]


def test_state_dict_checkpoints_round_trip(tmp_path):
    stock = tiny_model("llama")
    stock_keys = list(stock.state_dict())
    converted = coat.convert(copy.deepcopy(stock))
    assert list(converted.state_dict()) == stock_keys
    for name, value in converted.state_dict().items():
        assert torch.equal(value, stock.state_dict()[name])

    converted.save_pretrained(tmp_path)
    reloaded_stock = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)  # a checkpoint like any other
    assert all(torch.equal(v, stock.state_dict()[k]) for k, v in reloaded_stock.state_dict().items())
    reloaded = coat.convert(reloaded_stock)
    tokens = token_batch("cpu")
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, converted(tokens).logits)


def test_eval_and_generate_after_convert():
    model = coat.convert(tiny_model("llama")).eval()
    tokens = token_batch("cpu", batch=1, length=8)
    with torch.no_grad():
        logits = model(tokens).logits
    assert torch.equal(model(tokens).logits.detach(), logits)  # eval forward is the training forward

    generated = model.generate(tokens, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 14) and torch.equal(generated[:, :8], tokens)


def cache_keyword(model) -> str:
    """The keyword the installed transformers' forward takes the KV cache by: cache from 5.24, else past_key_values."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# Mistral, Phi-3, Qwen2 and Qwen3 (their second layer) with a window shorter than the sequences, so that the
# sliding-window cache layers and masks run; no end-of-sequence token, so that generate() runs every step.
GENERATION = {
    "llama": dict(eos_token_id=None),
    "mistral": dict(eos_token_id=None, sliding_window=4),
    "qwen2": dict(eos_token_id=None, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(eos_token_id=None, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "phi3": dict(eos_token_id=None, sliding_window=4),
    "olmo2": dict(eos_token_id=None),
    "gemma3": dict(eos_token_id=None, sliding_window=4),
    # Without the routers' logits: transformers 5.17 computes the auxiliary loss in generate() against the whole
    # attention mask and fails at the first cached step, the stock model as well (5.24 does not).
    "qwen3_moe": dict(eos_token_id=None, output_router_logits=False),
    "qwen2_moe": dict(eos_token_id=None, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                      output_router_logits=False),
    "mixtral": dict(eos_token_id=None, sliding_window=4, output_router_logits=False),
    "olmoe": dict(eos_token_id=None, output_router_logits=False),
}
PROMPT, NEW_TOKENS = 8, 8
# A forward through the KV cache quantizes each step's activations with per-tensor scales over that step's tokens,
# the full forward with scales over the whole sequence: both are within FORWARD_BOUND of the exact computation, and
# their roundings are independent, so they differ by up to sqrt(2) * FORWARD_BOUND = 0.17 (0.02 to 0.05 measured).
# A cache that is never filled, each step seeing only its own token, gives 0.7 to 1.
CACHED_BOUND = math.sqrt(2) * FORWARD_BOUND


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_through_the_kv_cache_match_the_full_forward(family):
    stock = tiny_model(family, **GENERATION[family]).eval()
    model = coat.convert(copy.deepcopy(stock))
    tokens = token_batch("cpu", length=PROMPT + NEW_TOKENS)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(tokens[:, :PROMPT], use_cache=True, **{cache_keyword(model): cache}).logits]
        assert cache.get_seq_length() == PROMPT
        for position in range(PROMPT, tokens.shape[1]):
            step = model(tokens[:, position:position + 1], use_cache=True, **{cache_keyword(model): cache})
            logits.append(step.logits)
        full, stock_full = model(tokens).logits, stock(tokens).logits
    cached = torch.cat(logits, dim=1)
    assert cache.get_seq_length() == tokens.shape[1]
    assert relative_error(cached, full) <= CACHED_BOUND
    assert relative_error(cached, stock_full) <= FORWARD_BOUND  # as close to the BF16 model as the full forward


def cache_notices(model, tokens, keyword) -> tuple[list[str], torch.Tensor]:
    """The deprecation notices of a prefill and a step through the KV cache passed as ``keyword`` (FutureWarning
    and DeprecationWarning messages, transformers' logged warnings), the class name written as the stock
    model's; and the step's logits."""
    transformers_logging.warning_once.cache_clear()  # each model logs its notices afresh
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers_logging.get_logger()  # transformers' root logger, which does not propagate
    logger.addHandler(handler)
    cache = DynamicCache(config=model.config)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            model(tokens[:, :-1], use_cache=True, **{keyword: cache})
            logits = model(tokens[:, -1:], use_cache=True, **{keyword: cache}).logits
    finally:
        logger.removeHandler(handler)
    notices = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    notices += [record.getMessage() for record in records if record.levelno >= logging.WARNING]
    stock_name = type(model).__mro__[1].__name__ if type(model).__name__.startswith("FusedLoss") else None
    return [n.replace(type(model).__name__, stock_name) if stock_name else n for n in notices], logits


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kv_cache_by_either_name_with_no_notice_of_coats_own(family):
    """From transformers 5.24 the KV cache is ``cache``, and ``past_key_values`` a deprecated alias (a FutureWarning
    from the forwards that take it, a logged notice from the outputs). A converted model takes the cache by every
    name the installed release's forward takes, with the same logits, and gives the stock model's notices: none
    by the release's own name, transformers' own for the deprecated one (coat passes neither name on itself)."""
    stock = tiny_model(family, **GENERATION[family]).eval()
    model = coat.convert(copy.deepcopy(stock))
    tokens = token_batch("cpu", length=PROMPT + 1)
    keywords = ["cache", "past_key_values"] if cache_keyword(model) == "cache" else ["past_key_values"]
    step_logits = []
    for keyword in keywords:
        notices, logits = cache_notices(model, tokens, keyword)
        assert notices == cache_notices(stock, tokens, keyword)[0], keyword
        step_logits.append(logits)
    assert cache_notices(model, tokens, cache_keyword(model))[0] == []
    assert all(torch.equal(logits, step_logits[0]) for logits in step_logits)


def prompt_batch(batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(1, TINY["vocab_size"], (batch, PROMPT), generator=generator)  # no pad token (0)


def greedy_agreement(model, sequences: torch.Tensor) -> float:
    """The share of the greedily generated tokens of ``sequences`` (after the prompt) that are the argmax of the
    converted model's full forward over them. Greedy decoding through the KV cache picks that argmax except where
    the FP8 difference between the two (relative RMS r <= CACHED_BOUND) swaps the two best logits: for V Gaussian
    logits the gap between the two best is about exponential with mean sigma / sqrt(2 ln V) (sigma / 3.1 at V = 128),
    which a difference of RMS sqrt(2) r sigma closes, in the right direction, at about 1.75 r of the positions: at
    most 30%, 3 to 4% measured (r = 0.02 to 0.05). A generate() that drops the cache agrees at 27 to 33% (the first
    token, from the prefill, included)."""
    with torch.no_grad():
        full = model(sequences[:, :-1]).logits[:, PROMPT - 1:]
    agreement = (sequences[:, PROMPT:] == full.argmax(-1)).double().mean().item()
    print(f"\n{type(model).__name__}: greedy tokens equal to the full forward's argmax: {agreement:.1%}")
    return agreement


GREEDY_AGREEMENT = 1 - 1.75 * CACHED_BOUND


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_keeps_the_context(family):
    model = coat.convert(tiny_model(family, **GENERATION[family])).eval()
    prompts = prompt_batch(32)
    generated = model.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
    assert torch.equal(generated.sequences[:, :PROMPT], prompts)
    with torch.no_grad():
        full = model(generated.sequences[:, :-1]).logits[:, PROMPT - 1:]
    assert relative_error(torch.stack(generated.logits, dim=1), full) <= CACHED_BOUND
    assert greedy_agreement(model, generated.sequences) >= GREEDY_AGREEMENT


def test_continuous_batching_keeps_the_context():
    """generate_batch() hands the layers a paged cache: up to transformers 5.23 in **kwargs, for the attention
    function to update; from 5.24 as the layer's cache, whose update fills in the attention function's arguments."""
    model = coat.convert(tiny_model("llama", **GENERATION["llama"])).eval()
    prompts = prompt_batch(8)
    outputs = model.generate_batch(
        inputs=prompts.tolist(),
        generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0),
        # A small paged cache (by default it takes most of the free memory) and no CUDA graphs to capture.
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64),
        warmup=False,
    )
    assert all(output.error is None for output in outputs.values())
    sequences = torch.tensor([output.prompt_ids + output.generated_tokens for output in outputs.values()])
    assert sorted(sequences[:, :PROMPT].tolist()) == sorted(prompts.tolist())
    assert sequences.shape == (len(prompts), PROMPT + NEW_TOKENS)
    assert greedy_agreement(model, sequences) >= GREEDY_AGREEMENT


def test_gradient_checkpointing_gives_the_same_gradients():
    model = coat.convert(tiny_model("llama"))
    tokens = token_batch("cpu")
    _, plain = loss_and_grads(model, tokens)
    # transformers 5.25 renamed gradient_checkpointing_enable, now a deprecated alias, activation_checkpointing_enable.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    _, checkpointed = loss_and_grads(model, tokens)
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)


def test_output_hidden_states():
    model = coat.convert(tiny_model("llama"))
    outputs = model(token_batch("cpu"), output_hidden_states=True)
    assert len(outputs.hidden_states) == TINY["num_hidden_layers"] + 1


def test_which_modules_are_converted():
    model = coat.convert(tiny_model("llama"))
    assert all(isinstance(layer, FP8LlamaDecoderLayer) for layer in model.model.layers)
    assert not isinstance(model.lm_head, coat.nn.Linear)  # stays BF16 by default

    model = coat.convert(tiny_model("llama"), skip_modules=["model.layers.0"])
    assert type(model.model.layers[0]) is LlamaDecoderLayer
    assert isinstance(model.model.layers[1], FP8LlamaDecoderLayer)
    # A pattern that would skip nothing is refused before anything is converted: one that matches no module, and
    # one that matches only a part of a decoder layer, which is converted whole.
    for pattern, error in (("model.layer.0", "'model.layer.0' matches no module"),
                           ("model.layers.*.self_attn", r"inside decoder layers \(model.layers.0.self_attn\), which "
                                                        r"coat converts whole: name the layer \('model.layers.0'\)")):
        model = tiny_model("llama")
        with pytest.raises(ValueError, match=error):
            coat.convert(model, skip_modules=[pattern])
        assert not any(isinstance(layer, FP8LlamaDecoderLayer) for layer in model.model.layers)

    model = coat.convert(tiny_model("llama"), modules_to_convert=["model.layers.1", "lm_head"], group_size=32,
                         fast_accum=True, experts_fast_accum=False)
    assert type(model.model.layers[0]) is LlamaDecoderLayer
    assert model.model.layers[1].fp8_config.group_size == 32
    assert model.model.layers[1].fp8_config.fast_accum and model.lm_head.config.fast_accum
    assert not model.model.layers[1].fp8_config.experts_fast_accum
    assert isinstance(model.lm_head, coat.nn.Linear)
    loss_and_grads(model, token_batch("cpu"))


def test_convert_inside_a_meta_device_context():
    """A large model is built without memory, `with torch.device("meta")`, and converted there before FSDP
    shards it: the conversion's check of the MLP's activation must not compute on the meta device."""
    with torch.device("meta"):
        model = coat.convert(AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="SiLU"):
            coat.convert(AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "hidden_act": "gelu"})))
    assert all(isinstance(layer, FP8LlamaDecoderLayer) for layer in model.model.layers)
    assert all(p.is_meta for p in model.parameters())
    expected = coat.convert(tiny_model("llama")).state_dict()
    assert {name: (t.shape, t.dtype) for name, t in model.state_dict().items()} == {
        name: (t.shape, t.dtype) for name, t in expected.items()}
    # Shapes without values, as memory and FLOP estimators run a model: forward and backward on the meta device.
    tokens = token_batch("cpu").to("meta")
    logits = model(tokens).logits
    assert logits.is_meta and logits.shape == (*tokens.shape, TINY["vocab_size"])
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.model.layers.parameters())


@pytest.mark.parametrize("child", ["self_attn.q_proj", "mlp.down_proj", "mlp", "post_attention_layernorm"])
def test_a_child_replaced_after_conversion_is_refused_not_ignored(child):
    """A converted layer computes its norms, projections and MLP itself from their parameters: a module put in
    their place afterwards (PEFT's LoRA wrappers, say) would be skipped without a word, so the forward refuses it."""
    model = coat.convert(tiny_model("llama"))
    parent_name, _, name = ("model.layers.1." + child).rpartition(".")
    parent = model.get_submodule(parent_name)
    replaced = getattr(parent, name)
    setattr(parent, name, LowRankAdapter(replaced) if isinstance(replaced, torch.nn.Linear) else copy.deepcopy(
        LlamaDecoderLayer(model.config, 0).get_submodule(child)))
    with pytest.raises(TypeError, match=f"{name} is now a .*not the coat.nn.*skip_modules"):
        model(token_batch("cpu"))


def test_hooks_on_a_converted_layers_children_are_reported_as_never_running():
    """Hooks on a converted layer's projections would silently never fire (torch.nn.utils.prune keeps a pruned
    weight up to date in one): the forward warns. Hooks on the layer itself run as usual."""
    model = coat.convert(tiny_model("llama"))
    layer = model.model.layers[0]
    calls = []
    layer.register_forward_hook(lambda module, args, output: calls.append("layer"))
    model(token_batch("cpu"))
    assert calls == ["layer"]
    layer.self_attn.k_proj.register_forward_pre_hook(lambda module, args: calls.append("k_proj"))
    with pytest.warns(UserWarning, match=r"forward hooks of LlamaAttention.k_proj never run"):
        model(token_batch("cpu"))
    assert calls == ["layer", "layer"]


def test_errors_for_unsupported_models_and_options():
    with pytest.raises(ValueError, match="LlamaDecoderLayer"):
        coat.convert(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    with pytest.raises(ValueError, match="group_size"):
        coat.convert(tiny_model("llama"), group_size=12)
    with pytest.raises(ValueError, match="unsupported FP8 format"):
        coat.convert(tiny_model("llama"), gradient_format="fp8")
    with pytest.raises(ValueError, match="saved_format must be one of"):
        coat.convert(tiny_model("llama"), saved_format="int4")
    with pytest.raises(ValueError, match="matches no module"):
        coat.convert(tiny_model("llama"), modules_to_convert=["model.layer.*"])
    converted = coat.convert(tiny_model("llama"))
    with pytest.raises(ValueError, match="already converted"):
        coat.convert(converted)

    gelu = tiny_model("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="SiLU"):
        coat.convert(gelu)
    assert all(type(layer) is LlamaDecoderLayer for layer in gelu.model.layers)  # left untouched


def test_a_tied_lm_head_is_refused_with_how_to_untie_it():
    model = tiny_model("llama", tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"lm_head.weight is the same parameter as model.embed_tokens.weight.*"
                                         r"tie_word_embeddings = False; model.lm_head.weight = torch.nn.Parameter"):
        coat.convert(model, modules_to_convert=["model.layers.*", "lm_head"])
    assert all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)  # left untouched
    assert type(model.lm_head) is torch.nn.Linear

    coat.convert(copy.deepcopy(model))  # the LM head stays BF16 by default, tied or not
    # Untied as the message says, it converts, and the embedding keeps its own BF16 weight.
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    coat.convert(model, modules_to_convert=["model.layers.*", "lm_head"])
    assert isinstance(model.lm_head, coat.nn.Linear) and model.lm_head.weight is not model.model.embed_tokens.weight
    loss_and_grads(model, token_batch("cpu"))


def test_pyproject_and_docs_state_the_supported_transformers_releases():
    """coat.compat's range, as pyproject.toml's extras require it and the README and the guide state it (the
    files that moving the newest end changes, docs/design.md)."""
    root = pathlib.Path(__file__).parents[1]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    supported = Requirement(TRANSFORMERS_REQUIREMENT)
    for extra in ("examples", "test", "bench"):
        requirements = [Requirement(r) for r in pyproject["project"]["optional-dependencies"][extra]]
        assert [r.specifier for r in requirements if r.name == "transformers"] == [supported.specifier], extra
    supported_row = f"| transformers | {TRANSFORMERS_OLDEST} to {TRANSFORMERS_NEWEST} for `coat.convert` "
    for page in ("README.md", "docs/guide/install.md"):
        assert supported_row in (root / page).read_text(), page
    checked = f"older than {TRANSFORMERS_OLDEST} is refused, newer than {TRANSFORMERS_NEWEST} converts with a warning"
    assert checked in " ".join((root / "docs/guide/convert.md").read_text().split())


@pytest.fixture
def installed_transformers(monkeypatch):
    """installed_transformers(version) makes coat.convert see that transformers release. (Importing transformers'
    model modules replaces the transformers module in sys.modules: one imported earlier may not be coat's.)"""
    return lambda version: monkeypatch.setattr(sys.modules["transformers"], "__version__", version)


def test_convert_refuses_an_older_transformers_and_warns_for_a_newer_one(installed_transformers):
    for version in (TRANSFORMERS_OLDEST, "5.20.2", TRANSFORMERS_NEWEST):  # the supported ones, silently
        installed_transformers(version)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            coat.convert(tiny_model("llama"))
        assert not [w for w in caught if "coat" in str(w.message)], version

    model = tiny_model("llama")
    installed_transformers("5.16.1")
    with pytest.raises(ImportError, match=re.escape(f"needs transformers {TRANSFORMERS_OLDEST} or newer, and 5.16.1 is "
                                                    f"installed: pip install '{TRANSFORMERS_REQUIREMENT}'")):
        coat.convert(model)
    assert all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)
    newer = Version(TRANSFORMERS_NEWEST)
    newer = f"{newer.major}.{newer.minor + 1}.0"
    installed_transformers(newer)
    with pytest.warns(UserWarning, match=re.escape(f"tested with transformers {TRANSFORMERS_OLDEST} to "
                                                   f"{TRANSFORMERS_NEWEST}, and {newer} is installed")):
        coat.convert(model)
    assert all(isinstance(layer, FP8LlamaDecoderLayer) for layer in model.model.layers)


def test_a_decoder_layer_forward_coat_does_not_mirror_is_refused(monkeypatch):
    """A release whose decoder layer forward takes a named argument coat's converted forward does not know (as
    5.24 renamed past_key_values to cache) is refused at conversion, instead of the argument being dropped."""
    stock_forward = LlamaDecoderLayer.forward

    def forward_with_a_new_argument(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                                    use_cache=False, position_embeddings=None, cache_position=None, **kwargs):
        return stock_forward(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", forward_with_a_new_argument)
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=r"LlamaDecoderLayer.forward\(.*cache_position, kwargs\) is not the forward "
                                        rf"of transformers {re.escape(TRANSFORMERS_OLDEST)} to "
                                        rf"{re.escape(TRANSFORMERS_NEWEST)}.*Install transformers>="):
        coat.convert(model)
    assert all(type(layer) is LlamaDecoderLayer for layer in model.model.layers)


@requires_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", *FP8_REFERENCE_FAMILIES])
def test_cuda_matches_cpu(family):
    results = []
    for device in ("cpu", "cuda"):
        model = tiny_model(family, device)
        results.append(loss_and_grads(coat.convert(copy.deepcopy(model)), token_batch(device)))
    (cpu_loss, cpu_grads), (cuda_loss, cuda_grads) = results
    assert abs(cuda_loss.cpu() - cpu_loss) <= 1e-3 * abs(cpu_loss)
    # The devices accumulate GEMMs in different orders; a last-bit difference flips the FP8 rounding of an
    # intermediate activation or gradient (an E5M2 step is 12.5-25%), so the two FP8 pipelines differ by
    # FP8 noise (0.06 to 0.11 seen on an H200), bounded like FP8 against BF16. A wrong kernel gives ~1.
    # OLMo 2's and Gemma 3's FP8 noise is their reference's (test_gradients_within_the_fp8_reference): two draws of
    # it, each within 1.25x of the reference's error against BF16, differ by up to sqrt(2) times that.
    with_reference = family in FP8_REFERENCE_FAMILIES
    if with_reference:
        _, bf16_grads = loss_and_grads(model, token_batch("cuda"))
        reference_grads = fp8_reference_grads(model, token_batch("cuda"))
    for name, grad in cpu_grads.items():
        bound = gradient_bound(name, "e5m2", "e4m3")
        if with_reference:
            reference_error = relative_error(reference_grads[name], bf16_grads[name].cpu())
            bound = max(bound, math.sqrt(2) * REFERENCE_FACTOR * reference_error)
        assert relative_error(cuda_grads[name].cpu(), grad) <= bound, name


def layer_step(layer, hidden, position_embeddings, grad):
    """Forward and backward of one decoder layer: its output, the input's gradient and every parameter's."""
    hidden = hidden.detach().requires_grad_()
    layer.zero_grad()
    out = layer(hidden, attention_mask=None, position_embeddings=position_embeddings)
    out.backward(grad)
    return [out.detach(), hidden.grad] + [p.grad for p in layer.parameters()]


def test_torch_compile_does_not_trace_the_autocast_query(monkeypatch):
    """torch 2.11's dynamo cannot trace torch.amp.is_autocast_available (a C builtin it does not know), and
    every converted layer asks it: the query is answered once per device type outside the graph. Here it is
    replaced by a function dynamo must not trace, as 2.11 sees the builtin; the model still compiles whole."""
    query = torch.amp.is_autocast_available
    monkeypatch.setattr(torch.amp, "is_autocast_available", torch._dynamo.disable(lambda device_type: query(device_type)))
    monkeypatch.setattr(coat.nn.gemm, "_AUTOCAST_AVAILABLE", {})
    torch._dynamo.reset()
    model = coat.convert(tiny_model("llama"))
    tokens = token_batch("cpu")
    explanation = torch._dynamo.explain(lambda t: model(t, labels=t).loss)(tokens)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]


def layer_inputs(model, layer_index=0, batch=2, length=32, seed=3):
    """A decoder layer's input, its output's gradient and its RoPE tables (Gemma 3's layer types have their own)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, model.config.hidden_size, generator=generator).bfloat16()
    grad = torch.randn(hidden.shape, generator=generator).bfloat16()
    positions = torch.arange(length)[None]
    rotary = model.model.rotary_emb
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return hidden, grad, rotary(hidden, positions, model.config.layer_types[layer_index])
    return hidden, grad, rotary(hidden, positions)


@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_layer_with_q_k_norms_against_the_float32_layer(family, attention_bias):
    """A converted Qwen3 or OLMo 2 layer (q/k norms, per head or over the whole projection) in BF16 against the
    unconverted one in float32, inputs and weights the same, with and without attention biases."""
    model = tiny_model(family, attention_bias=attention_bias)
    if attention_bias:  # transformers initializes biases to zero: give them values the test can see
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    hidden, grad, rope = layer_inputs(model)
    stock = copy.deepcopy(model.model.layers[0]).float()
    expected = layer_step(stock, hidden.float(), tuple(t.float() for t in rope), grad.float())
    converted = coat.convert(model).model.layers[0]
    assert type(converted).__name__ == f"FP8{type(stock).__name__}"
    actual = layer_step(converted, hidden, rope, grad)
    names = ["output", "input grad"] + [name for name, _ in converted.named_parameters()]
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected):
        bound = FORWARD_BOUND if name == "output" else GRADIENT_BOUND["e5m2", "e4m3"]
        assert relative_error(a.float(), e) <= bound, name


@pytest.mark.parametrize("family", ["olmo2", "gemma3"])
def test_post_norm_layers_save_no_16_bit_activation_beyond_attention(family):
    """Every norm of the post-norm families keeps its input in FP8 1 x G groups: a layer's backward keeps no
    16-bit [B, S, hidden] or [B, S, heads * D] tensor but what attention keeps (q, k, v and its output) and
    o_proj's input."""
    model = coat.convert(tiny_model(family))
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


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_traces_the_model_whole_with_eager_numerics(family):
    """A converted model is one graph for torch.compile: no graph break anywhere in the forward and loss
    (coat's ops are custom ops with fake implementations, its blocks autograd Functions that dynamo traces).
    A decoder layer compiled with fullgraph=True computes what eager mode does: bit for bit with AOTAutograd
    alone; with inductor (Llama's layer), which fuses the elementwise ops around coat's kernels (RoPE, residual
    adds) and rounds their intermediates once instead of after every op, the inputs of the FP8 quantizers move by
    a bf16 ulp here and there, which flips some FP8 codes: the results then differ by less than one E5M2 rounding
    (relative RMS 0.072, see the module docstring)."""
    # transformers records the MoE routers' logits for the auxiliary loss under a lock, where dynamo breaks the graph
    # whatever the model (transformers.utils.output_capturing): the MoE families run without it here.
    overrides = dict(output_router_logits=False) if family in MOE_FAMILIES else {}
    model = coat.convert(tiny_model(family, **overrides))
    tokens = token_batch("cpu")
    explanation = torch._dynamo.explain(lambda t: model(t, labels=t).loss)(tokens)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert explanation.graph_count == 1

    layer_index = len(model.model.layers) - 1  # Gemma 3's global layer; the others' layers are alike
    layer = model.model.layers[layer_index]
    hidden, grad, position_embeddings = layer_inputs(model, layer_index)
    eager = layer_step(layer, hidden, position_embeddings, grad)
    traced = layer_step(torch.compile(layer, fullgraph=True, backend="aot_eager"), hidden, position_embeddings, grad)
    for expected, actual in zip(eager, traced):
        assert torch.equal(actual, expected)
    if family == "llama":
        fused = layer_step(torch.compile(layer, fullgraph=True, backend="inductor"), hidden, position_embeddings,
                           grad)
        for expected, actual in zip(eager, fused):
            assert relative_error(actual, expected) <= 0.072


def traced_sdpa_masks(model, tokens, **kwargs) -> list[bool]:
    """Whether each SDPA call of the graph torch.compile traces for model(tokens, labels=tokens, **kwargs) gets a
    materialized mask (True) or is_causal=True (False); checks the compiled loss against eager's."""
    masks = []

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.target is torch._C._nn.scaled_dot_product_attention:
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                assert (mask is None) == bool(node.kwargs.get("is_causal")), node.format_node()
                masks.append(mask is not None)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)(tokens, labels=tokens, **kwargs).loss
    assert torch.equal(compiled, model(tokens, labels=tokens, **kwargs).loss)
    return masks


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_torch_compile_gives_sdpa_no_mask_when_the_batch_has_no_padding(family):
    """transformers materializes the causal mask while tracing even where eager mode skips it, which keeps SDPA
    from its flash kernel. A converted model traced without attention_mask, positions or cache gives SDPA
    is_causal=True instead, except in a sliding-window layer whose window is shorter than the sequence (Gemma 3's
    first tiny layer: window 16, 32 tokens); with an attention_mask every layer keeps transformers' mask."""
    model = coat.convert(tiny_model(family))
    tokens = token_batch("cpu")
    assert traced_sdpa_masks(model, tokens) == ([True, False] if family == "gemma3" else [False, False])
    assert traced_sdpa_masks(model, tokens, attention_mask=torch.ones_like(tokens)) == [True, True]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_save_and_resume(family, tmp_path):
    """A few steps with coat.optim.AdamW, a checkpoint, and a resumed run that continues exactly as the
    uninterrupted one."""
    model = coat.convert(tiny_model(family).float())
    optimizer = coat.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = token_batch("cpu")

    def step(m, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = [step(model, optimizer) for _ in range(3)]
    assert losses[-1] < losses[0]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    continued = step(model, optimizer)

    resumed = coat.convert(tiny_model(family).float())
    resumed_optimizer = coat.optim.AdamW(resumed.parameters(), lr=1e-2)
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    assert step(resumed, resumed_optimizer) == continued
