"""Float64 oracles of the layers (coat.nn), written from the paper in plain PyTorch, independent of coat's kernels;
and a stand-in for the adapters users wrap linear layers in."""
from __future__ import annotations

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


def swiglu_mlp(x, gate_weight, up_weight, down_weight, activation="silu"):
    """LlamaMLP: down(act(x gate^T) * (x up^T)), act silu or (GeGLU, Gemma's MLP) gelu(approximate="tanh")."""
    gate = x @ gate_weight.t()
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    return (act * (x @ up_weight.t())) @ down_weight.t()


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
# OLMo 2 with coat's quantization points, in float32 autograd (test_nn_llama.py's OLMo 2 gradient bound)

# Where coat rounds: the GEMMs' inputs and weights (E4M3 per tensor), their output gradients (E5M2 per tensor), the
# inputs the norms and SiLU*mul keep for backward (E4M3 1 x 16 groups).
FP8_POINTS = frozenset({"inputs", "weights", "gradients", "saved"})


def _fake_quantized(x: torch.Tensor, fp8: torch.dtype, points, point: str, amax=None) -> torch.Tensor:
    """x through per-tensor FP8 and back (with a given amax: values past it saturate), where ``point`` is one of the
    enabled quantization points; x itself otherwise."""
    return quantize_per_tensor_dequantized(x, fp8, amax).to(x.dtype) if point in points else x


def _group_saved(x: torch.Tensor, points) -> torch.Tensor:
    """The copy of a non-linear op's input that backward reads: E4M3 in 1 x 16 groups (coat's default)."""
    return quantize_group_dequantized(x, 16).to(x.dtype) if "saved" in points else x


class _FP8Linear(torch.autograd.Function):
    """y = Q(x) Q(W)^T with E4M3 per-tensor Q; backward dx = Q5(g) Q(W), dW = Q5(g)^T Q(x) with E5M2 per-tensor
    Q5, where Q(x) is ``wgrad_input`` when given (the down projection's input, recomputed from SiLU*mul's saved
    inputs as coat recomputes it)."""

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
    """x * rstd * weight, exact forward; backward from the 1 x 16 group copy of x and the exact rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps, points):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(_group_saved(x, points), rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad_y):
        grad_x, grad_weight = rms_norm_backward(grad_y, *ctx.saved_tensors)
        return grad_x, grad_weight, None, None


class _GroupSavedSiLUMul(torch.autograd.Function):
    """silu(gate) * up, exact forward; backward from the 1 x 16 group copies of gate and up."""

    @staticmethod
    def forward(ctx, gate, up, points):
        gate_saved, up_saved = _group_saved(gate, points), _group_saved(up, points)
        ctx.save_for_backward(gate_saved, up_saved)
        return torch.nn.functional.silu(gate) * up, torch.nn.functional.silu(gate_saved) * up_saved

    @staticmethod
    def backward(ctx, grad_product, _):
        gate, up = ctx.saved_tensors
        sigmoid = torch.sigmoid(gate)
        return grad_product * up * sigmoid * (1 + gate * (1 - sigmoid)), grad_product * gate * sigmoid, None


def olmo2_fp8_reference_loss(model, tokens: torch.Tensor, points=FP8_POINTS) -> torch.Tensor:
    """The causal-LM loss of a transformers Olmo2ForCausalLM (its float32 parameters, any bias-free config), written
    from OLMo 2's formula with coat.convert's quantization points and nothing else: every decoder-layer GEMM reads
    its input and weight rounded to E4M3 per tensor and, in backward, its output gradient rounded to E5M2 per tensor;
    every norm and SiLU*mul keeps its inputs for backward in E4M3 1 x 16 groups, and the down projection's weight
    gradient reads SiLU*mul recomputed from those, quantized with the forward's amax. Embedding, final norm and LM
    head stay exact, as coat.convert leaves them; everything else is float32. ``points``: a subset of FP8_POINTS
    to switch the others off (none: the float32 model)."""
    config, inner = model.config, model.model
    positions = torch.arange(tokens.shape[1])[None]
    x = inner.embed_tokens(tokens)
    cos, sin = (t[:, None] for t in inner.rotary_emb(x, positions))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def linear(module, t, wgrad_input=None):
        assert module.bias is None, "olmo2_fp8_reference_loss: bias-free layers only"
        return _FP8Linear.apply(t, module.weight, points, wgrad_input)

    def norm(module, t):
        return _GroupSavedRMSNorm.apply(t, module.weight, module.variance_epsilon, points)

    def rope(t):  # [B, heads, S, D], rotate_half
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k = norm(attn.q_norm, linear(attn.q_proj, x)), norm(attn.k_norm, linear(attn.k_proj, x))
        v = linear(attn.v_proj, x)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        a = torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, scale=attn.scaling)
        x = x + norm(layer.post_attention_layernorm, linear(attn.o_proj, a.transpose(1, 2).flatten(-2)))
        product, recomputed = _GroupSavedSiLUMul.apply(linear(mlp.gate_proj, x), linear(mlp.up_proj, x), points)
        wgrad_input = _fake_quantized(recomputed.detach(), torch.float8_e4m3fn, points, "inputs",
                                      amax=product.detach().abs().amax())
        x = x + norm(layer.post_feedforward_layernorm, linear(mlp.down_proj, product, wgrad_input))
    logits = model.lm_head(inner.norm(x))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
