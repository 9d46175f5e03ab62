"""The decoder blocks of coat's FP8 precision flow (paper appendix G.1), from the building blocks of
:mod:`coat.nn.gemm` and :mod:`coat.nn.layers` (:mod:`coat.nn.functional` re-exports them all): RMSNorm and the
q/k/v projections, the attention output's projection and residual, the MLP and its residual, each optionally
with the post-norms and (1 + w) norms of OLMo 2 and Gemma 3; RoPE, alone or fused with per-head q/k norms.
Their docstrings say what each saves."""
from __future__ import annotations

import torch

from coat import ops
from coat.nn import _capture
from coat.nn.config import FP8Config
from coat.nn.gemm import Projections, _matrix, output_dtype, quantize_per_tensor
from coat.nn.layers import (
    _named_params,
    _needs_autograd,
    _pairs,
    _param_needs,
    _params_from,
    _params_need_grad,
    _record_rmsnorm,
    _rmsnorm_backward,
    _rmsnorm_output_t,
    _rmsnorm_quantize,
    _save,
    _saved,
    _mlp_backward,
    _mlp_forward,
    rms_norm_save,
    swiglu_mlp,
)
from coat.ops.norm_act import _checked_activation


class _BeforeAttentionFunction(torch.autograd.Function):
    """RMSNorm then the q, k, v projections. The fused norm writes its output directly in FP8, which feeds
    the three GEMMs (:class:`Projections`): no BF16 round trip.
    Saves one copy of the input: x in 1 x G groups (``config.saved_format``) + scales + rstd, which the
    norm's backward reads and from which backward recomputes the transposed FP8 normed output the wgrads
    read (with the forward's scale, saved); plus the weights' amax and the parameters.
    Without a norm (norm_weight None: OLMo 2) the projections read x itself, quantized per tensor once, and the
    transposed FP8 x the wgrads read is what is saved of it (as in coat.nn.Linear)."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, x, norm_weight, eps: float, config: FP8Config, out_dtype, norm_weight_offset, output_widths,
                *flat_params):
        params = _pairs(flat_params)
        param_needs = _param_needs(ctx.needs_input_grad, 7, len(params))
        site = ctx.report_site = _capture.forward_site()
        x2d = _matrix(x)
        if norm_weight is None:
            y, y_scale, y_t = quantize_per_tensor(x2d, config.forward_dtype,
                                                  columnwise=_params_need_grad(param_needs))
            if site is not None:
                site.record("qkv_input", x2d, y, y_scale)
            kept = dict(y_t=y_t)
        else:
            quantized = _rmsnorm_quantize(x2d, norm_weight, eps, config, True, norm_weight_offset)
            if site is not None:
                _record_rmsnorm(site, "attn_norm_input", "qkv_input", x2d, norm_weight, quantized, config,
                                norm_weight_offset)
            y, y_scale, _, x_saved, x_saved_scales, rstd = quantized
            kept = dict(x_saved=x_saved, x_saved_scales=x_saved_scales, rstd=rstd, norm_weight=norm_weight)
        projections = Projections(params, "qkv", output_widths)
        weight_amax = projections.weight_amax()
        outputs = projections.forward(y, y_scale, config, out_dtype, weight_amax, site)
        _save(ctx, **kept, y_scale=y_scale, weight_amax=weight_amax, **_named_params(flat_params))
        ctx.config, ctx.x_shape, ctx.x_dtype, ctx.output_widths = config, x.shape, x.dtype, output_widths
        ctx.norm_weight_offset = norm_weight_offset
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs)

    @staticmethod
    @_capture.measures_records
    def backward(ctx, *grads):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        param_needs = _param_needs(ctx.needs_input_grad, 7, len(params))
        need_x, need_norm_weight = ctx.needs_input_grad[:2]
        normed = "norm_weight" in saved
        offset = ctx.norm_weight_offset
        y_t = saved.get("y_t")
        if normed and _params_need_grad(param_needs):
            y_t = _rmsnorm_output_t(saved, saved["norm_weight"], saved["y_scale"], ctx.config, offset)
        grad_y, param_grads = Projections(params, "qkv", ctx.output_widths).backward(
            grads, y_t, saved["y_scale"], saved["weight_amax"], (need_x or need_norm_weight, param_needs),
            ctx.config, ctx.x_dtype, _capture.backward_site(ctx),
        )
        grad_x, grad_norm_weight = grad_y, None
        if grad_y is not None and normed:
            grad_x, grad_norm_weight = _rmsnorm_backward(grad_y, saved, saved["norm_weight"], ctx.config, ctx.x_dtype,
                                                         weight_offset=offset)
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_norm_weight if need_norm_weight else None,
            *(None,) * 5,  # eps, config, out_dtype, norm_weight_offset, output_widths
            *param_grads,
        )


def before_attention(x, norm_weight, eps: float, projections, config: FP8Config = FP8Config(), *,
                     norm_weight_offset: float = 0.0, output_widths=None):
    """(q, k, v) = [proj(RMSNorm(x)) for proj in projections], with projections [(weight, bias), ...]; the norm
    multiplies by norm_weight + norm_weight_offset (1 for Gemma). norm_weight None: no norm, [proj(x) ...].
    With ``output_widths`` (e.g. [Hq D, Hkv D, Hkv D]), the outputs of one fused (weight, bias) split into
    blocks of these widths, each computed by a GEMM of its own (see :class:`Projections`)."""
    flat_params = tuple(t for pair in projections for t in pair)
    out_dtype = output_dtype(x)
    output_widths = None if output_widths is None else tuple(output_widths)
    if _needs_autograd(x, norm_weight, *flat_params):
        return _BeforeAttentionFunction.apply(x, norm_weight, eps, config, out_dtype, norm_weight_offset,
                                              output_widths, *flat_params)
    if norm_weight is None:
        y, y_scale, _ = quantize_per_tensor(_matrix(x), config.forward_dtype)
    else:
        y, y_scale, *_ = _rmsnorm_quantize(_matrix(x), norm_weight, eps, config, weight_offset=norm_weight_offset)
    fused = Projections(_pairs(flat_params), output_widths=output_widths)
    outputs = fused.forward(y, y_scale, config, out_dtype, fused.weight_amax())
    return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs)


class _AfterAttentionFunction(torch.autograd.Function):
    """residual + o_proj(attention output). The attention output is quantized per tensor for the GEMM.
    When the attention kernel keeps its own output for backward (SDPA, FlashAttention), this Function saves
    that same tensor, which costs no memory, plus the amax that fixed its scale: backward quantizes it again
    with that amax and gets the forward's FP8 values back bit for bit (paper appendix D). An FP8 copy would
    add 0.5 units instead. When it does not (eager attention), the transposed FP8 input is saved instead, as
    in coat.nn.Linear."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, attn_output, residual, weight, bias, config: FP8Config, out_dtype, attention_keeps_output):
        site = ctx.report_site = _capture.forward_site()
        a2d = _matrix(attn_output)
        need_weight_grad = ctx.needs_input_grad[2]
        amax = ops.tensor_amax([a2d])
        a_q, a_scale, a_q_t = quantize_per_tensor(
            a2d, config.forward_dtype, amax=amax, columnwise=need_weight_grad and not attention_keeps_output
        )
        if site is not None:
            site.record("o_input", a2d, a_q, a_scale)
        projection = Projections([(weight, bias)], "o")
        weight_amax = projection.weight_amax()
        (out,) = projection.forward(a_q, a_scale, config, out_dtype, weight_amax, site)
        out = out.view(*attn_output.shape[:-1], out.shape[-1]) if residual is None else residual + out.view(
            residual.shape)
        if attention_keeps_output:
            _save(ctx, attn_output=attn_output, amax=amax, a_q_t=None, a_scale=None, weight=weight, bias=bias,
                  weight_amax=weight_amax)
        else:
            _save(ctx, attn_output=None, amax=None, a_q_t=a_q_t, a_scale=a_scale, weight=weight, bias=bias,
                  weight_amax=weight_amax)
        ctx.config, ctx.a_shape, ctx.a_dtype = config, attn_output.shape, attn_output.dtype
        return out

    @staticmethod
    @_capture.measures_records
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        need_attn, need_residual, need_weight, need_bias = ctx.needs_input_grad[:4]
        a_q_t, a_scale = saved["a_q_t"], saved["a_scale"]
        if need_weight and a_q_t is None:
            _, a_scale, a_q_t = quantize_per_tensor(
                _matrix(saved["attn_output"]), ctx.config.forward_dtype, amax=saved["amax"], rowwise=False,
                columnwise=True,
            )
        grad_attn, (grad_weight, grad_bias) = Projections([(saved["weight"], saved["bias"])], "o").backward(
            [grad_out], a_q_t, a_scale, saved["weight_amax"], (need_attn, [(need_weight, need_bias)]), ctx.config,
            ctx.a_dtype, _capture.backward_site(ctx),
        )
        grad_attn = None if grad_attn is None else grad_attn.view(ctx.a_shape)
        return grad_attn, grad_out if need_residual else None, grad_weight, grad_bias, None, None, None


def after_attention(
    attn_output, residual, weight, bias, config: FP8Config = FP8Config(), *, attention_keeps_output: bool = True,
    post_norm=None,
):
    """residual + attn_output @ weight^T + bias, see :class:`_AfterAttentionFunction`. ``post_norm``: (weight, eps,
    weight_offset) of a norm on the projection's output (OLMo 2, Gemma 3): residual + RMSNorm(o_proj(a)), the norm's
    output in high precision and the residual added in its kernel (:func:`rms_norm_save`), its input saved in FP8
    groups; the 16-bit o_proj output is not kept."""
    if post_norm is not None:
        out = after_attention(attn_output, None, weight, bias, config, attention_keeps_output=attention_keeps_output)
        norm_weight, eps, weight_offset = post_norm
        return rms_norm_save(out, norm_weight, eps, config, weight_offset=weight_offset, residual=residual)
    out_dtype = output_dtype(attn_output)
    if _needs_autograd(attn_output, residual, weight, bias):
        return _AfterAttentionFunction.apply(
            attn_output, residual, weight, bias, config, out_dtype, attention_keeps_output
        )
    a_q, a_scale, _ = quantize_per_tensor(_matrix(attn_output), config.forward_dtype)
    projection = Projections([(weight, bias)])
    (out,) = projection.forward(a_q, a_scale, config, out_dtype, projection.weight_amax())
    out = out.view(*attn_output.shape[:-1], out.shape[-1])
    return out if residual is None else residual + out.view(residual.shape)


class _MLPResidualFunction(torch.autograd.Function):
    """x + down(act(gate(n)) * up(n)) with n = RMSNorm(x): the post-attention norm writes n in FP8 for the
    gate/up GEMM, SiLU*mul writes its product in FP8 for the down GEMM. Saves one copy of each non-linear
    op's inputs in 1 x G groups (``config.saved_format``): x + scales + rstd, gate and up + scales (and
    Smooth-SwiGLU's per-channel scale); backward recomputes from them the transposed FP8 n and product
    that the wgrads read, with the forward's scales (saved). Plus the weights' amax and the parameters.
    Without add_residual it returns the MLP's output alone (for a post-norm to add x to, Gemma 3)."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, x, norm_weight, eps: float, config: FP8Config, out_dtype, norm_weight_offset, add_residual,
                activation: str, *flat_params):
        params = _pairs(flat_params)
        site = ctx.report_site = _capture.forward_site()
        x2d = _matrix(x)
        quantized = _rmsnorm_quantize(x2d, norm_weight, eps, config, True, norm_weight_offset)
        if site is not None:
            _record_rmsnorm(site, "mlp_norm_input", "gate_up_input", x2d, norm_weight, quantized, config,
                            norm_weight_offset)
        n_q, n_scale, _, x_saved, x_saved_scales, rstd = quantized
        mlp_out, mlp_saved = _mlp_forward(n_q, n_scale, params, config, out_dtype, keep_for_backward=True,
                                             site=site, activation=activation)
        _save(
            ctx,
            x_saved=x_saved,
            x_saved_scales=x_saved_scales,
            rstd=rstd,
            norm_weight=norm_weight,
            n_scale=n_scale,
            **mlp_saved,
            **_named_params(flat_params),
        )
        ctx.config, ctx.x_shape, ctx.x_dtype, ctx.out_dtype = config, x.shape, x.dtype, out_dtype
        ctx.norm_weight_offset, ctx.add_residual, ctx.activation = norm_weight_offset, add_residual, activation
        return x + mlp_out.view(x.shape) if add_residual else mlp_out.view(*x.shape[:-1], mlp_out.shape[-1])

    @staticmethod
    @_capture.measures_records
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        need_x, need_norm_weight = ctx.needs_input_grad[:2]
        needs = (need_x or need_norm_weight, _param_needs(ctx.needs_input_grad, 8, len(params)))
        offset = ctx.norm_weight_offset
        n_q_t = None
        if _params_need_grad(needs[1][:-1]):
            n_q_t = _rmsnorm_output_t(saved, saved["norm_weight"], saved["n_scale"], ctx.config, offset)
        grad_out2d = _matrix(grad_out)
        grad_n, param_grads = _mlp_backward(
            grad_out2d, saved, n_q_t, saved["n_scale"], params, needs, ctx.config, ctx.x_dtype, ctx.out_dtype,
            _capture.backward_site(ctx), ctx.activation,
        )
        grad_x, grad_norm_weight = grad_out if ctx.add_residual else None, None
        if grad_n is not None:
            # x's gradient through the residual connection, grad_out, is added inside the norm's backward kernel.
            residual = grad_out2d.contiguous() if need_x and ctx.add_residual else None
            grad_x, grad_norm_weight = _rmsnorm_backward(
                grad_n, saved, saved["norm_weight"], ctx.config, ctx.x_dtype, residual, offset
            )
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_norm_weight if need_norm_weight else None,
            *(None,) * 6,  # eps, config, out_dtype, norm_weight_offset, add_residual, activation
            *param_grads,
        )


def mlp_residual(x, norm_weight, eps: float, gate, up, down, config: FP8Config = FP8Config(), *,
                 activation: str = "silu", norm_weight_offset: float = 0.0, post_norm=None):
    """x + LlamaMLP(RMSNorm(x)) in FP8; gate, up, down are (weight, bias) pairs; ``activation`` as
    :func:`swiglu_mlp`'s; the norm multiplies by norm_weight + norm_weight_offset. up None: gate is Phi-3's fused
    gate_up_proj, [2I, H] with the gate's rows first (Phi3MLP's ``chunk(2)``). norm_weight None: no pre-norm
    (OLMo 2), the MLP reads x (:func:`swiglu_mlp`). ``post_norm``: (weight, eps, weight_offset) of a norm on the
    MLP's output, x + RMSNorm(MLP(..)) with the add in the norm's kernel and its input saved in FP8 groups
    (:func:`rms_norm_save`; OLMo 2, Gemma 3)."""
    _checked_activation(activation, "coat.nn.functional.mlp_residual")
    add_residual = post_norm is None  # else the post-norm's kernel adds x
    if norm_weight is None:
        out = swiglu_mlp(x, gate, up, down, config, activation=activation)
        out = x + out if add_residual else out
    else:
        flat_params = (*gate, *(up or ()), *down)
        out_dtype = output_dtype(x)
        if _needs_autograd(x, norm_weight, *flat_params):
            out = _MLPResidualFunction.apply(x, norm_weight, eps, config, out_dtype, norm_weight_offset, add_residual,
                                             activation, *flat_params)
        else:
            n_q, n_scale, *_ = _rmsnorm_quantize(_matrix(x), norm_weight, eps, config, weight_offset=norm_weight_offset)
            out, _ = _mlp_forward(n_q, n_scale, _pairs(flat_params), config, out_dtype, keep_for_backward=False,
                                     activation=activation)
            out = out.view(*x.shape[:-1], out.shape[-1])
            out = x + out if add_residual else out
    if add_residual:
        return out
    weight, post_eps, weight_offset = post_norm
    return rms_norm_save(out, weight, post_eps, config, weight_offset=weight_offset, residual=x)


# ---------------------------------------------------------------------------------------------------------
# Rotary position embedding (coat.ops.rotary_embedding)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _RotaryEmbeddingFunction(torch.autograd.Function):
    """RoPE of q and k; backward is the op's inverse (its adjoint) applied to the output gradients. Saves
    cos and sin only, which the caller keeps alive anyway (one table per step, shared by every layer)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return ops.rotary_embedding(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q_out, grad_k_out):
        cos, sin = ctx.saved_tensors
        # Gradients arrive in any layout; the op needs a contiguous last dimension only.
        grad_q, grad_k = ops.rotary_embedding(
            _last_dim_contiguous(grad_q_out), _last_dim_contiguous(grad_k_out), cos, sin, inverse=True
        )
        return grad_q, grad_k, None, None


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` for q [B, S, Hq, D] and k [B, S, Hk, D] (heads before the
    head dimension, not transposed), in one kernel forward and one backward: see
    :func:`coat.ops.rotary_embedding` for the formula, layouts and dtypes. Differentiable in q and k;
    cos and sin get no gradient (None): they are the rotary tables, which transformers computes without
    autograd."""
    return _RotaryEmbeddingFunction.apply(q, k, cos, sin)


class _QKNormRotaryFunction(torch.autograd.Function):
    """Qwen3's per-head RMSNorm of q and k (q_norm, k_norm over head_dim) then RoPE, in one kernel forward
    (:func:`coat.ops.qk_norm_rope`). Saves each norm's input, the q/k projection output, as E4M3 in 1 x G groups
    with its scales and rstd (never the 16-bit projection output; ``config.saved_format`` FP4 / FP6 applies to
    the layer's other norms and SiLU*mul, these stay E4M3), the norm weights, cos and sin. Backward is RoPE's
    adjoint (:func:`coat.ops.rotary_embedding`, inverse) then the RMSNorm backward kernel over head_dim."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps: float, cos, sin, config: FP8Config, weight_offset: float):
        q_out, k_out, *kept = ops.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin, config.group_size,
                                               weight_offset=weight_offset)
        names = ("q_saved", "q_saved_scales", "q_rstd", "k_saved", "k_saved_scales", "k_rstd")
        _save(ctx, **dict(zip(names, kept)), q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin)
        ctx.group_size, ctx.weight_offset = config.group_size, weight_offset
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q_out, grad_k_out):
        saved = _saved(ctx)
        grads = ops.rotary_embedding(_last_dim_contiguous(grad_q_out), _last_dim_contiguous(grad_k_out),
                                     saved["cos"], saved["sin"], inverse=True)
        results = []
        for name, grad in zip("qk", grads):
            weight = saved[f"{name}_weight"]
            grad_x, grad_weight = ops.rmsnorm_backward(grad, saved[f"{name}_saved"], saved[f"{name}_saved_scales"],
                                                       saved[f"{name}_rstd"], weight, ctx.group_size,
                                                       weight_offset=ctx.weight_offset)
            results.append((grad_x, grad_weight.to(weight.dtype)))
        (grad_q, grad_q_weight), (grad_k, grad_k_weight) = results
        return grad_q, grad_k, grad_q_weight, grad_k_weight, None, None, None, None, None


def qk_norm_rotary_embedding(q, k, q_weight, k_weight, eps: float, cos, sin, config: FP8Config = FP8Config(), *,
                             weight_offset: float = 0.0):
    """Qwen3's ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)`` for q [B, S, Hq, D], k [B, S, Hk, D]
    (heads before head_dim, not transposed), see :class:`_QKNormRotaryFunction`; differentiable in q, k and
    the two norm weights. weight_offset=1: Gemma 3's (1 + w) norms."""
    return _QKNormRotaryFunction.apply(q, k, q_weight, k_weight, eps, cos, sin, config, weight_offset)
