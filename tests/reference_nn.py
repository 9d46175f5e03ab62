"""Float64 oracles of the layers (coat.nn), written from the paper in plain PyTorch, independent of coat's kernels;
and a stand-in for the adapters users wrap linear layers in."""
from __future__ import annotations

import dataclasses
import functools

import torch

import reference


def quantize_per_tensor_dequantized(x: torch.Tensor, fp8: torch.dtype, amax=None) -> torch.Tensor:
    """Per-tensor FP8 quantization (paper section 3) and back, in float64, by the bit-exact oracle; with the scale
    of a given amax instead of x's own, values past it saturate."""
    q, scale = reference.quantize_tensor(x.detach().cpu(), fp8, amax)
    return (reference.decode(q, fp8) * scale.double()).to(x.device)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ||actual - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def quantize_group_dequantized(x: torch.Tensor, group_size: int, fp8: torch.dtype = torch.float8_e4m3fn):
    """Per-group FP8 quantization with 1 x G groups along the last dimension (paper section 5.2; the last
    group of a row may be short) and back, in float64, by the bit-exact oracle."""
    q, scales = reference.quantize_group(x.detach().cpu(), group_size, fp8)
    cols = x.shape[-1]
    return (reference.decode(q, fp8) * reference.expand_group_scales(scales, cols, group_size).double()).to(x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rms_norm_backward(grad_y, x_saved, rstd, weight):
    """RMSNorm's gradients written out, evaluated at a saved input x_saved (the dequantized FP8 copy) and
    the rstd of the exact input: with xhat = x_saved * rstd and g = grad_y * weight,
    dx = (g - xhat * mean(g * xhat)) * rstd, dweight = sum over rows of grad_y * xhat."""
    xhat = x_saved * rstd
    g = grad_y * weight
    grad_x = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
    return grad_x, (grad_y * xhat).reshape(-1, xhat.shape[-1]).sum(0)


def act_fn(gate, name: str):
    """silu, gelu(approximate="tanh") (GeGLU, SigLIP) or quick_gelu, g * sigmoid(1.702 g) (CLIP), from the formulas."""
    if name == "quick_gelu":
        return gate * torch.sigmoid(1.702 * gate)
    return torch.nn.functional.silu(gate) if name == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")


def swiglu_mlp(x, gate_weight, up_weight, down_weight, activation="silu"):
    """LlamaMLP: down(act(x gate^T) * (x up^T)) (:func:`act_fn`)."""
    return (act_fn(x @ gate_weight.t(), activation) * (x @ up_weight.t())) @ down_weight.t()


def mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation="gelu_tanh"):
    """CLIPMLP: fc2(act(fc1(x))) (:func:`act_fn`)."""
    hidden = act_fn(x @ fc1_weight.t() + fc1_bias, activation)
    return hidden @ fc2_weight.t() + fc2_bias


class LowRankAdapter(torch.nn.Module):
    """A PEFT-style wrapper of a linear layer (base layer kept, a low-rank update added), exposing the base
    layer's weight as PEFT's LoRA layers do."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Linear(base.in_features, 2, bias=False)
        self.lora_b = torch.nn.Linear(2, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


# ---------------------------------------------------------------------------------------------------------
# OLMo 2 and Gemma 3 with coat's quantization points, in float32 autograd (test_nn_llama.py's gradient bounds for them)

# Where coat rounds: the GEMMs' inputs and weights (E4M3 per tensor), their output gradients (E5M2 per tensor), the
# inputs the norms and the gated activation keep for backward (E4M3 1 x 16 groups).
FP8_POINTS = frozenset({"inputs", "weights", "gradients", "saved"})


@dataclasses.dataclass(frozen=True)
class DecoderLayout:
    """Where a family's decoder layer has its RMSNorms (child names; None: none there), how wide its q/k norms are,
    what its norms add to their weight and which gate activation its MLP has."""

    input_norm: str | None
    mlp_norm: str | None
    attention_post_norm: str
    mlp_post_norm: str
    per_head_qk_norms: bool  # over head_dim (Gemma 3) or over the whole projection (OLMo 2)
    norm_weight_offset: float
    activation: str  # "silu" or "gelu_tanh"


FP8_REFERENCE_LAYOUTS = {
    "olmo2": DecoderLayout(None, None, "post_attention_layernorm", "post_feedforward_layernorm",
                           per_head_qk_norms=False, norm_weight_offset=0.0, activation="silu"),
    "gemma3_text": DecoderLayout("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                                 "post_feedforward_layernorm", per_head_qk_norms=True, norm_weight_offset=1.0,
                                 activation="gelu_tanh"),
}


def _fake_quantized(x: torch.Tensor, fp8: torch.dtype, points, point: str, amax=None) -> torch.Tensor:
    """x through per-tensor FP8 and back (with a given amax: values past it saturate), where ``point`` is one of the
    enabled quantization points; x itself otherwise."""
    return quantize_per_tensor_dequantized(x, fp8, amax).to(x.dtype) if point in points else x


def _group_saved(x: torch.Tensor, points) -> torch.Tensor:
    """The copy of a non-linear op's input that backward reads: E4M3 in 1 x 16 groups (coat's default)."""
    return quantize_group_dequantized(x, 16).to(x.dtype) if "saved" in points else x


class _FP8Linear(torch.autograd.Function):
    """y = Q(x) Q(W)^T with E4M3 per-tensor Q; backward dx = Q5(g) Q(W), dW = Q5(g)^T Q(x) with E5M2 per-tensor
    Q5, where Q(x) is ``wgrad_input`` when given (a norm's output or the gated product, recomputed from the saved
    inputs of the op that produced x, as coat recomputes it)."""

    @staticmethod
    def forward(ctx, x, weight, points, wgrad_input):
        x_q = _fake_quantized(x, torch.float8_e4m3fn, points, "inputs")
        w_q = _fake_quantized(weight, torch.float8_e4m3fn, points, "weights")
        ctx.save_for_backward(x_q if wgrad_input is None else wgrad_input, w_q)
        ctx.points = points
        return x_q @ w_q.t()

    @staticmethod
    def backward(ctx, grad_y):
        x_q, w_q = ctx.saved_tensors
        g = _fake_quantized(grad_y, torch.float8_e5m2, ctx.points, "gradients")
        grad_w = g.reshape(-1, g.shape[-1]).t() @ x_q.reshape(-1, x_q.shape[-1])
        return g @ w_q, grad_w, None, None


class _GroupSavedRMSNorm(torch.autograd.Function):
    """x * rstd * weight, exact forward; backward from the 1 x 16 group copy of x and the exact rstd. With
    ``feeds_gemm`` also returns what the weight gradients of the GEMMs reading the output read (a pre-norm's): the
    output recomputed from that copy and rstd, rounded per tensor with the exact output's amax (no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, eps, points, feeds_gemm):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x_saved = _group_saved(x, points)
        ctx.save_for_backward(x_saved, rstd, weight)
        y = x * rstd * weight
        if not feeds_gemm:
            return y, None
        return y, _fake_quantized(x_saved * rstd * weight, torch.float8_e4m3fn, points, "inputs", y.abs().amax())

    @staticmethod
    def backward(ctx, grad_y, _):
        grad_x, grad_weight = rms_norm_backward(grad_y, *ctx.saved_tensors)
        return grad_x, grad_weight, None, None, None


_GATE_ACTIVATIONS = {"silu": torch.nn.functional.silu,
                     "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh")}


class _GroupSavedGatedProduct(torch.autograd.Function):
    """act(gate) * up, exact forward; backward from the 1 x 16 group copies of gate and up (act's derivative by
    autograd at the copy). Also returns the product recomputed from the copies, as coat recomputes it for the down
    projection's weight gradient."""

    @staticmethod
    def forward(ctx, gate, up, activation, points):
        gate_saved, up_saved = _group_saved(gate, points), _group_saved(up, points)
        ctx.save_for_backward(gate_saved, up_saved)
        ctx.activation = activation
        act = _GATE_ACTIVATIONS[activation]
        return act(gate) * up, act(gate_saved) * up_saved

    @staticmethod
    def backward(ctx, grad_product, _):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            gate = gate.detach().requires_grad_()
            act = _GATE_ACTIVATIONS[ctx.activation](gate)
            (grad_gate,) = torch.autograd.grad(act, gate, grad_product * up)
        return grad_gate, grad_product * act.detach(), None, None


def _attention_mask(length: int, sliding_window: int | None) -> torch.Tensor:
    """Causal, and within the last ``sliding_window`` positions where the layer has one (transformers'
    sliding_window_overlay: kv > q - window)."""
    q, kv = torch.arange(length)[:, None], torch.arange(length)[None]
    allowed = kv <= q
    return allowed if sliding_window is None else allowed & (kv > q - sliding_window)


def fp8_reference_loss(model, tokens: torch.Tensor, points=FP8_POINTS) -> torch.Tensor:
    """The causal-LM loss of a transformers Olmo2ForCausalLM or Gemma3ForCausalLM (text; its float32 parameters,
    any bias-free config; layouts in FP8_REFERENCE_LAYOUTS), written from the family's formula with coat.convert's
    quantization points and nothing else: every decoder-layer GEMM reads its input and weight rounded to E4M3 per
    tensor and, in backward, its output gradient rounded to E5M2 per tensor; every norm (the q/k norms too) and the
    gated activation keep their inputs for backward in E4M3 1 x 16 groups, and the weight gradients of the GEMMs
    after a pre-norm or the gated product read that output recomputed from those copies, quantized with the
    forward's amax. Embedding (Gemma's scaled by sqrt(hidden) in the weight dtype, as its module does), final norm
    and LM head stay exact, as coat.convert leaves them; everything else is float32. ``points``: a subset of
    FP8_POINTS to switch the others off (none: the float32 model)."""
    config, inner = model.config, model.model
    layout = FP8_REFERENCE_LAYOUTS[config.model_type]
    assert getattr(config, "attn_logit_softcapping", None) is None, "fp8_reference_loss: no attention soft-cap"
    length = tokens.shape[1]
    positions = torch.arange(length)[None]
    x = inner.embed_tokens(tokens)
    layer_types = getattr(config, "layer_types", None)
    rope_tables = {}  # layer type -> (cos, sin) [B, 1, S, D]; one table where the family has no layer types

    def tables(layer_type):
        if layer_type not in rope_tables:
            args = (x, positions) if layer_type is None else (x, positions, layer_type)
            rope_tables[layer_type] = tuple(t[:, None] for t in inner.rotary_emb(*args))
        return rope_tables[layer_type]

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def linear(module, t, wgrad_input=None):
        assert module.bias is None, "fp8_reference_loss: bias-free layers only"
        return _FP8Linear.apply(t, module.weight, points, wgrad_input)

    def norm(module, t, feeds_gemm=False):  # -> (output, with feeds_gemm what the GEMMs' weight gradients read)
        weight = module.weight + layout.norm_weight_offset if layout.norm_weight_offset else module.weight
        eps = module.eps if hasattr(module, "eps") else module.variance_epsilon  # Gemma3RMSNorm's, OLMo2RMSNorm's
        return _GroupSavedRMSNorm.apply(t, weight, eps, points, feeds_gemm)

    def pre_norm(layer, name, t):  # -> (the GEMMs' input, what their weight gradients read)
        return (t, None) if name is None else norm(getattr(layer, name), t, feeds_gemm=True)

    def head_norm(module, t):  # t [B, S, heads * D]
        if layout.per_head_qk_norms:
            return norm(module, t.unflatten(-1, (-1, module.weight.shape[0])))[0].flatten(-2)
        return norm(module, t)[0]

    def rope(t, cos, sin):  # [B, heads, S, D], rotate_half
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        cos, sin = tables(None if layer_types is None else layer_types[index])
        n, n_wgrad = pre_norm(layer, layout.input_norm, x)
        q = head_norm(attn.q_norm, linear(attn.q_proj, n, n_wgrad))
        k = head_norm(attn.k_norm, linear(attn.k_proj, n, n_wgrad))
        v = linear(attn.v_proj, n, n_wgrad)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        mask = _attention_mask(length, getattr(attn, "sliding_window", None))
        a = torch.nn.functional.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, attn_mask=mask,
                                                             scale=attn.scaling)
        o = linear(attn.o_proj, a.transpose(1, 2).flatten(-2))
        x = x + norm(getattr(layer, layout.attention_post_norm), o)[0]
        n, n_wgrad = pre_norm(layer, layout.mlp_norm, x)
        product, recomputed = _GroupSavedGatedProduct.apply(linear(mlp.gate_proj, n, n_wgrad),
                                                            linear(mlp.up_proj, n, n_wgrad), layout.activation,
                                                            points)
        wgrad_input = _fake_quantized(recomputed.detach(), torch.float8_e4m3fn, points, "inputs",
                                      amax=product.detach().abs().amax())
        x = x + norm(getattr(layer, layout.mlp_post_norm), linear(mlp.down_proj, product, wgrad_input))[0]
    logits = model.lm_head(inner.norm(x))
    if getattr(config, "final_logit_softcapping", None) is not None:
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def moe_experts(x, top_k_index, top_k_weights, gate_up, down, activation="silu"):
    """transformers' experts: y_t = sum_j w_tj down_e(act(gate_e(x_t)) * up_e(x_t)) with e = top_k_index[t, j],
    gate_up_proj [E, 2I, H] (the gate's rows first) and down_proj [E, H, I]; one expert at a time, as transformers'
    eager loop."""
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for expert in range(gate_up.shape[0]):
        token, choice = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        mlp = swiglu_mlp(x[token], gate_up[expert, :inter], gate_up[expert, inter:], down[expert], activation)
        out = out.index_add(0, token, mlp * top_k_weights[token, choice, None])
    return out
