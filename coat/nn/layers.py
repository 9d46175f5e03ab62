"""The autograd Functions of coat's single FP8 layers, :func:`linear`, :func:`rms_norm`, :func:`rms_norm_save`,
:func:`swiglu_mlp` and :func:`mlp`, and the pieces of them that the decoder blocks (:mod:`coat.nn.blocks`) reuse:
the fused RMSNorm and act*mul steps with their report records, and the saved-tensor plumbing. The public names are
re-exported by :mod:`coat.nn.functional`, whose docstring says what the layers save for backward.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from coat import ops
from coat.nn import _capture
from coat.nn.config import AMAX_GROUP_SIZE, FP8Config
from coat.nn.gemm import Projections, _dequantized, _matrix, output_dtype, quantize_per_tensor
from coat.ops.norm_act import _checked_activation


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The given rows of t (all when None): what coat.report measures of a tensor."""
    return t if rows is None else t.index_select(0, rows)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # transformers' QuickGELUActivation


#: torch's function for each activation of coat.ops.silu_mul_quantize (the ``activation`` of coat's MLPs).
ACTIVATION_FUNCTIONS = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": _quick_gelu,
}


def _silu_mul_rows(gate, up, smooth_scale, activation, rows):
    """act(gate) [* up] (times the Smooth-SwiGLU scale) in float32, for the given rows (all when None); up None:
    the non-gated MLP's act(gate)."""
    product = ACTIVATION_FUNCTIONS[activation](_rows(gate, rows).float())
    if up is not None:
        product = product * _rows(up, rows)  # up is promoted exactly
    return product if smooth_scale is None else product * smooth_scale



def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# coat.nn.Linear


class _LinearFunction(torch.autograd.Function):
    """y = x W^T + b with FP8 operands. Saves the transposed FP8 input and its scale when the weight needs a
    gradient (nothing of the input otherwise), the weight parameter and the weight's amax (backward
    quantizes the weight again, transposed, with the same scale)."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, x, weight, bias, config: FP8Config, out_dtype: torch.dtype):
        site = ctx.report_site = _capture.forward_site()
        need_weight_grad = ctx.needs_input_grad[1]
        x2d = _matrix(x)
        x_q, x_scale, x_q_t = quantize_per_tensor(x2d, config.forward_dtype, columnwise=need_weight_grad)
        if site is not None:
            site.record("input", x2d, x_q, x_scale)
        projection = Projections([(weight, bias)])
        weight_amax = projection.weight_amax()
        (y,) = projection.forward(x_q, x_scale, config, out_dtype, weight_amax, site)
        _save(ctx, x_q_t=x_q_t, x_scale=x_scale if need_weight_grad else None, weight=weight, bias=bias,
              weight_amax=weight_amax)
        ctx.config, ctx.x_shape, ctx.x_dtype = config, x.shape, x.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @_capture.measures_records
    def backward(ctx, grad_y):
        saved = _saved(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, (grad_w, grad_b) = Projections([(saved["weight"], saved["bias"])]).backward(
            [grad_y], saved["x_q_t"], saved["x_scale"], saved["weight_amax"], (need_x, [(need_w, need_b)]),
            ctx.config, ctx.x_dtype, _capture.backward_site(ctx),
        )
        return None if grad_x is None else grad_x.view(ctx.x_shape), grad_w, grad_b, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: FP8Config = FP8Config()
) -> torch.Tensor:
    """FP8 ``torch.nn.functional.linear``: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"coat linear: input has {x.shape[-1]} features in its last dimension but the weight expects "
            f"{weight.shape[1]} (weight shape {tuple(weight.shape)})"
        )
    out_dtype = output_dtype(x)
    if _needs_autograd(x, weight, bias):
        return _LinearFunction.apply(x, weight, bias, config, out_dtype)
    x_q, x_scale, _ = quantize_per_tensor(_matrix(x), config.forward_dtype)
    projection = Projections([(weight, bias)])
    (y,) = projection.forward(x_q, x_scale, config, out_dtype, projection.weight_amax())
    return y.view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------------------
# Saved-tensor plumbing of the block Functions


def _pairs(flat):
    """[w0, b0, w1, b1, ...] -> [(w0, b0), (w1, b1), ...]"""
    return list(zip(flat[0::2], flat[1::2]))


def _save(ctx, **tensors):
    """save_for_backward with names, so that saved_tensors_hooks see every tensor and backward reads them
    back by name with :func:`_saved`."""
    ctx.save_for_backward(*tensors.values())
    ctx.saved_names = tuple(tensors)


def _saved(ctx) -> dict:
    return dict(zip(ctx.saved_names, ctx.saved_tensors))


# ---------------------------------------------------------------------------------------------------------
# Fused non-linear ops (coat.ops.rmsnorm_quantize, silu_mul_quantize and their backwards)


def _as_e4m3(codes, scales, cols: int, config: FP8Config):
    """A kept input in the E4M3 1 x G layout the report's statistics read: an FP6 or FP4 copy expands exactly."""
    if config.saved_format in ops.BLOCK_FORMATS:
        return ops.blocks_to_e4m3(codes, scales, cols, config.saved_format, config.group_size)
    return codes, scales


def _rmsnorm_quantize(x2d, weight, eps: float, config: FP8Config, for_backward: bool = False, weight_offset=0.0):
    """-> (y, y_scale, None, x_saved, x_saved_scales, rstd): y = RMSNorm(x) * (weight + weight_offset) quantized
    per tensor, x in 1 x group_size groups (in ``config.saved_format`` when ``for_backward``, else E4M3), rstd per
    row."""
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = ops.rmsnorm_quantize(
        x2d,
        weight,
        eps,
        save_group_size=config.group_size,
        amax_group_size=AMAX_GROUP_SIZE,
        format=config.forward_dtype,
        save_format=config.saved_format if for_backward else "e4m3",
        weight_offset=weight_offset,
    )
    return y, y_scale, y_t, x_saved, x_saved_scales, rstd


def _record_rmsnorm(site, input_name: str, output_name: str, x2d, weight, quantized, config: FP8Config,
                    weight_offset=0.0) -> None:
    """Records what :func:`_rmsnorm_quantize` quantized: its input, kept in 1 x G groups, and its output,
    recomputed in float32 in the kernel's order, (x * rstd) * (weight + weight_offset), with the kernel's rstd."""
    y, y_scale, _, x_saved, x_saved_scales, rstd = quantized
    if weight_offset:
        weight = weight.float() + weight_offset
    site.record(input_name, x2d, *_as_e4m3(x_saved, x_saved_scales, x2d.shape[1], config), config.group_size,
                config.saved_format)
    # float32 products (x2d and a 16-bit weight are promoted exactly), without a converted copy of either
    site.record(output_name, lambda rows: _rows(x2d, rows) * _rows(rstd, rows)[:, None] * weight, y, y_scale)


def _rmsnorm_output_t(saved: dict, weight, y_scale, config: FP8Config, weight_offset=0.0) -> torch.Tensor:
    """The transposed FP8 norm output the wgrads read, recomputed from the saved input and rstd with the
    forward's scale (values the saved copy rounds past the forward's amax saturate)."""
    return ops.rmsnorm_requantize(
        saved["x_saved"], saved["x_saved_scales"], saved["rstd"], weight, y_scale, config.group_size,
        config.forward_dtype, saved_format=config.saved_format, weight_offset=weight_offset,
    )


def _rmsnorm_backward(grad_y2d, saved: dict, weight, config: FP8Config, x_dtype, residual=None, weight_offset=0.0):
    """The norm's input and weight gradients; ``residual``, a contiguous gradient of grad_y2d's shape, is added to
    the input's in the kernel (see ops.rmsnorm_backward)."""
    grad_x, grad_weight = ops.rmsnorm_backward(
        grad_y2d, saved["x_saved"], saved["x_saved_scales"], saved["rstd"], weight, config.group_size,
        residual=residual, saved_format=config.saved_format, weight_offset=weight_offset,
    )
    return grad_x.to(x_dtype), grad_weight.to(weight.dtype)


def smooth_swiglu_scale(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Smooth-SwiGLU's per-channel scale s (Fishman et al. 2024, section 4.4), from each channel's max
    |act(gate) * up| over the tokens (act: SiLU, or GeGLU's gelu_tanh, the kernel's ``activation``):
    s_i = 2^-ceil(log2 amax_i), so every channel's amax lands in (1/2, 1] and the per-tensor scale of the
    product no longer follows the channel with the largest outliers. Powers of two make s and its inverse,
    folded into the down projection, exact; the exponent is clamped to [-126, 126] so that both stay normal
    float32 numbers. Channels that are all zero (or not finite) get s = 1. float32 [channels]."""
    with torch.no_grad():
        amax = (ACTIVATION_FUNCTIONS[activation](gate) * up).abs().amax(dim=0).float()
        exponent = torch.clamp(torch.ceil(torch.log2(amax)), -126, 126)
        usable = torch.isfinite(amax) & (amax > 0)
        return torch.where(usable, torch.exp2(-exponent), torch.ones_like(amax))


def _smoothed_down_weight(weight: torch.Tensor, smooth_scale: torch.Tensor | None) -> torch.Tensor:
    """W_down with 1/s folded into its input channels: down(s * z) uses W diag(1/s), so the product equals
    W z while the quantized activation is s * z. Exact, since s is a power of two."""
    return weight if smooth_scale is None else weight * smooth_scale.reciprocal().to(weight.dtype)


def _gate_up_projections(params) -> Projections:
    """gate and up of ``params`` ([(w, b)] for gate, up, down, or for Phi-3's fused gate_up, gate rows first,
    and down), which share one weight scale (:class:`Projections`)."""
    gate_up = params[:-1]
    if len(gate_up) == 1:
        return Projections(gate_up, "gate_up", [gate_up[0][0].shape[0] // 2] * 2)
    return Projections(gate_up, "gate_up")


def _input_projections(params, gated: bool) -> Projections:
    """The projections that read an MLP's input: gate and up of a gated MLP (:func:`_gate_up_projections`), fc1 of
    a non-gated one."""
    return _gate_up_projections(params) if gated else Projections(params[:1], "fc1")


def _output_projection(params, smooth_scale, gated: bool) -> Projections:
    """The MLP's last projection, down (1 / smooth_scale folded in) or fc2."""
    return Projections([_smoothed_down(params[-1], smooth_scale)], "down" if gated else "fc2")


def _mlp_forward(x_q, x_scale, params, config: FP8Config, out_dtype, keep_for_backward: bool, site=None,
                 activation: str = "silu", gated: bool = True):
    """down(act(gate(x)) * up(x)) from an input already in FP8, act = ``activation`` ("silu": SwiGLU,
    "gelu_tanh": GeGLU). params: [(w, b)] for gate, up, down, or for a fused gate_up and down
    (:func:`_gate_up_projections`): then one GEMM writes gate and up side by side, and the fused op reads the two
    halves in place. Without ``gated``, a non-gated MLP, fc2(act(fc1(x))): params [(w, b)] for fc1 and fc2, and the
    same op without up (no Smooth-SwiGLU scale: config.smooth_swiglu is for gated MLPs).
    Returns the output and the tensors backward needs: the weights' amax, act*mul's inputs in 1 x G groups
    (in ``config.saved_format`` when ``keep_for_backward``) and the scale of the FP8 product that feeds the
    down projection. The product itself is not saved: backward recomputes its transpose (the down wgrad's
    operand) from the saved inputs.
    gate and up themselves live only until the fused op has read them."""
    first = _input_projections(params, gated)
    in_proj_amax = first.weight_amax()
    outputs = (first.forward_joint if first.fused else first.forward)(x_q, x_scale, config, out_dtype, in_proj_amax,
                                                                      site)
    gate, up = outputs if gated else (outputs[0], None)
    smooth_scale = smooth_swiglu_scale(gate, up, activation) if config.smooth_swiglu and gated else None
    act_q, act_scale, _, gate_saved, gate_scales, up_saved, up_scales = ops.silu_mul_quantize(
        gate,
        up,
        smooth_scale,
        save_group_size=config.group_size,
        amax_group_size=AMAX_GROUP_SIZE,
        format=config.forward_dtype,
        save_format=config.saved_format if keep_for_backward else "e4m3",
        activation=activation,
    )
    if site is not None:
        cols = gate.shape[1]
        site.record("gate_output" if gated else "fc1_output", gate, *_as_e4m3(gate_saved, gate_scales, cols, config),
                    config.group_size, config.saved_format)
        if gated:
            site.record("up_output", up, *_as_e4m3(up_saved, up_scales, cols, config), config.group_size,
                        config.saved_format)
        # The kernel's fp32 product before quantization, recomputed with torch's SiLU (the kernel has its own
        # exp, so a value may differ in its last float32 bit). A partial, not a closure: closing over gate and
        # up would make the `del` below a bytecode torch.compile cannot trace.
        site.record("down_input" if gated else "fc2_input",
                    functools.partial(_silu_mul_rows, gate, up, smooth_scale, activation), act_q, act_scale)
    del gate, up, outputs
    down = _output_projection(params, smooth_scale, gated)
    down_amax = down.weight_amax()
    (out,) = down.forward(_matrix(act_q), act_scale, config, out_dtype, down_amax, site)
    saved = dict(
        in_proj_amax=in_proj_amax,
        down_amax=down_amax,
        gate_saved=gate_saved,
        gate_scales=gate_scales,
        up_saved=up_saved,
        up_scales=up_scales,
        act_scale=act_scale,
        smooth_scale=smooth_scale,
    )
    return out, saved


def _smoothed_down(down, smooth_scale):
    weight, bias = down
    return _smoothed_down_weight(weight, smooth_scale), bias


def _mlp_backward(grad_out2d, saved: dict, x_q_t, x_scale, params, needs, config: FP8Config, x_dtype, act_dtype,
                  site=None, activation: str = "silu", gated: bool = True):
    """Backward of :func:`_mlp_forward`. needs: (need_input_grad, [(need_w, need_b)] for each of params).
    The gradients of the product and of gate and up are in act_dtype, the dtype the forward computed them
    in (autocast's); the input's gradient is in x_dtype. Returns the input's gradient and [grad_w, grad_b]
    for each of params."""
    need_input_grad, need_param_grads = needs
    smooth_scale = saved["smooth_scale"]
    first = _input_projections(params, gated)
    act_q_t = None
    if _params_need_grad(need_param_grads[-1:]):
        act_q_t = ops.silu_mul_requantize(
            saved["gate_saved"], saved["gate_scales"], saved["up_saved"], saved["up_scales"], smooth_scale,
            saved["act_scale"], config.group_size, config.forward_dtype, saved_format=config.saved_format,
            cols=first.output_widths[0], activation=activation,
        )
    grad_act, down_grads = _output_projection(params, smooth_scale, gated).backward(
        [grad_out2d], act_q_t, saved["act_scale"], saved["down_amax"], (True, need_param_grads[-1:]),
        config, act_dtype, site,
    )
    del act_q_t
    if down_grads[0] is not None and smooth_scale is not None:
        down_grads[0] = down_grads[0] * smooth_scale.reciprocal().to(down_grads[0].dtype)

    grad_gate, grad_up, grad_amax = ops.silu_mul_backward(
        grad_act,
        saved["gate_saved"],
        saved["gate_scales"],
        saved["up_saved"],
        saved["up_scales"],
        smooth_scale,
        config.group_size,
        saved_format=config.saved_format,
        activation=activation,
    )
    del grad_act
    grad_input, first_grads = first.backward(
        [grad_gate, grad_up] if gated else [grad_gate], x_q_t, x_scale, saved["in_proj_amax"],
        (need_input_grad, need_param_grads[:-1]), config, x_dtype, site, grad_amax,
    )
    return grad_input, first_grads + down_grads


def _param_needs(needs_input_grad, first_param_index: int, count: int):
    """[(need_weight, need_bias)] for ``count`` (weight, bias) pairs starting at ``first_param_index``."""
    flags = needs_input_grad[first_param_index : first_param_index + 2 * count]
    return list(zip(flags[0::2], flags[1::2]))


def _params_need_grad(param_needs) -> bool:
    return any(need_weight for need_weight, _ in param_needs)


# ---------------------------------------------------------------------------------------------------------
# coat.nn.RMSNorm, coat.nn.SwiGLUMLP and coat.nn.MLP on their own


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm(x) * weight through the fused op, returned dequantized from its per-tensor FP8 output.
    Saves x in 1 x G groups (E4M3, or FP6 / FP4 as saved_format says), its scales, rstd, and the weight parameter."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, x, weight, eps: float, config: FP8Config, out_dtype):
        site = _capture.forward_site()
        x2d = _matrix(x)
        quantized = _rmsnorm_quantize(x2d, weight, eps, config, for_backward=True)
        if site is not None:
            _record_rmsnorm(site, "norm_input", "norm_output", x2d, weight, quantized, config)
        y, y_scale, _, x_saved, x_saved_scales, rstd = quantized
        _save(ctx, x_saved=x_saved, x_saved_scales=x_saved_scales, rstd=rstd, weight=weight)
        ctx.config, ctx.x_dtype = config, x.dtype
        return _dequantized(y, y_scale, out_dtype).view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        saved = _saved(ctx)
        grad_x, grad_weight = _rmsnorm_backward(_matrix(grad_y), saved, saved["weight"], ctx.config, ctx.x_dtype)
        return grad_x.view(grad_y.shape), grad_weight, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, config: FP8Config = FP8Config()) -> torch.Tensor:
    """RMSNorm through the fused FP8 kernel; the output is the FP8 tensor an FP8 GEMM would read, dequantized."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"coat rms_norm: input has {x.shape[-1]} features but the weight has {weight.shape[0]}")
    out_dtype = output_dtype(x)
    if _needs_autograd(x, weight):
        return _RMSNormFunction.apply(x, weight, eps, config, out_dtype)
    y, y_scale, *_ = _rmsnorm_quantize(_matrix(x), weight, eps, config)
    return _dequantized(y, y_scale, out_dtype).view(x.shape)


class _RMSNormSaveFunction(torch.autograd.Function):
    """[residual +] RMSNorm(x) * (weight + weight_offset) in x's dtype (the residual's with one), through
    :func:`coat.ops.rmsnorm_save`: for norms whose output is no GEMM input (post-norms, OLMo 2's q/k norms).
    Saves x in 1 x G groups (``config.saved_format``), its scales, rstd and the weight parameter: never x or the
    output in 16 bits. The residual's gradient is the output's."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, weight_offset: float, residual, config: FP8Config):
        out, x_saved, x_saved_scales, rstd = ops.rmsnorm_save(
            _matrix(x), weight, eps, residual=None if residual is None else _matrix(residual).contiguous(),
            save_group_size=config.group_size, save_format=config.saved_format, weight_offset=weight_offset,
        )
        _save(ctx, x_saved=x_saved, x_saved_scales=x_saved_scales, rstd=rstd, weight=weight)
        ctx.config, ctx.x_dtype, ctx.weight_offset = config, x.dtype, weight_offset
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        grad_x, grad_weight = _rmsnorm_backward(_matrix(grad_out), saved, saved["weight"], ctx.config, ctx.x_dtype,
                                                weight_offset=ctx.weight_offset)
        need_residual = ctx.needs_input_grad[4]
        return grad_x.view(grad_out.shape), grad_weight, None, None, grad_out if need_residual else None, None


def rms_norm_save(x, weight, eps: float, config: FP8Config = FP8Config(), *, weight_offset: float = 0.0,
                  residual=None) -> torch.Tensor:
    """``[residual +] RMSNorm(x) * (weight + weight_offset)`` with a high-precision output (OLMo2RMSNorm, and
    Gemma3RMSNorm with weight_offset=1), its input saved in FP8 groups for backward: see
    :class:`_RMSNormSaveFunction` and :func:`coat.ops.rmsnorm_save`. The residual add is fused into the kernel."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"coat rms_norm_save: input has {x.shape[-1]} features but the weight has {weight.shape[0]}")
    return _RMSNormSaveFunction.apply(x, weight, eps, weight_offset, residual, config)


class _MLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)), LlamaMLP's computation (GemmaMLP's with act gelu_tanh), in FP8; without
    ``gated``, fc2(act(fc1(x))), CLIPMLP's. Saves the transposed FP8 input (read by the gate and up wgrads, or
    fc1's) and its scale, plus what :func:`_mlp_forward` lists."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, x, config: FP8Config, out_dtype, activation: str, gated: bool, *flat_params):
        params = _pairs(flat_params)
        param_needs = _param_needs(ctx.needs_input_grad, 5, len(params))
        site = ctx.report_site = _capture.forward_site()
        x2d = _matrix(x)
        x_q, x_scale, x_q_t = quantize_per_tensor(
            x2d, config.forward_dtype, columnwise=_params_need_grad(param_needs[:-1])
        )
        if site is not None:
            site.record("gate_up_input" if gated else "fc1_input", x2d, x_q, x_scale)
        out, saved = _mlp_forward(x_q, x_scale, params, config, out_dtype, keep_for_backward=True, site=site,
                                  activation=activation, gated=gated)
        _save(ctx, x_q_t=x_q_t, x_scale=x_scale, **saved, **_named_params(flat_params))
        ctx.config, ctx.x_shape, ctx.x_dtype, ctx.out_dtype = config, x.shape, x.dtype, out_dtype
        ctx.activation, ctx.gated = activation, gated
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @_capture.measures_records
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        needs = (ctx.needs_input_grad[0], _param_needs(ctx.needs_input_grad, 5, len(params)))
        grad_x, param_grads = _mlp_backward(
            _matrix(grad_out), saved, saved["x_q_t"], saved["x_scale"], params, needs, ctx.config, ctx.x_dtype,
            ctx.out_dtype, _capture.backward_site(ctx), ctx.activation, ctx.gated,
        )
        return (None if grad_x is None else grad_x.view(ctx.x_shape), None, None, None, None, *param_grads)


def _named_params(flat_params) -> dict:
    return {f"param_{i}": p for i, p in enumerate(flat_params)}


def _params_from(saved: dict) -> list:
    return [saved[f"param_{i}"] for i in range(sum(name.startswith("param_") for name in saved))]


def _mlp(x: torch.Tensor, params, config: FP8Config, activation: str, gated: bool, op: str) -> torch.Tensor:
    flat_params = tuple(t for pair in params for t in pair)
    if x.shape[-1] != params[0][0].shape[1]:
        raise ValueError(f"{op}: input has {x.shape[-1]} features in its last dimension but the first projection "
                         f"expects {params[0][0].shape[1]} (weight shape {tuple(params[0][0].shape)})")
    out_dtype = output_dtype(x)
    _checked_activation(activation, op)
    if _needs_autograd(x, *flat_params):
        return _MLPFunction.apply(x, config, out_dtype, activation, gated, *flat_params)
    x_q, x_scale, _ = quantize_per_tensor(_matrix(x), config.forward_dtype)
    out, _ = _mlp_forward(x_q, x_scale, list(params), config, out_dtype, keep_for_backward=False,
                          activation=activation, gated=gated)
    return out.view(*x.shape[:-1], out.shape[-1])


def swiglu_mlp(x: torch.Tensor, gate, up, down, config: FP8Config = FP8Config(), *,
               activation: str = "silu") -> torch.Tensor:
    """FP8 LlamaMLP, down(act(gate(x)) * up(x)): gate, up, down are (weight, bias) pairs (bias may be None);
    ``activation`` "silu" (SwiGLU), "gelu_tanh" (GeGLU, as Gemma's MLP) or "quick_gelu"."""
    return _mlp(x, (gate, up, down), config, activation, True, "coat.nn.functional.swiglu_mlp")


def mlp(x: torch.Tensor, fc1, fc2, config: FP8Config = FP8Config(), *, activation: str = "gelu_tanh") -> torch.Tensor:
    """FP8 non-gated MLP, fc2(act(fc1(x))) (CLIPMLP, SiglipMLP, the Qwen-VL vision MLPs): fc1, fc2 are (weight,
    bias) pairs (bias may be None); ``activation`` "gelu_tanh" (gelu_pytorch_tanh: SigLIP, Qwen3-VL), "quick_gelu"
    (CLIP, Qwen2-VL) or "silu". fc1's output is saved in 1 x G groups and act is one fused kernel whose FP8
    output is fc2's input, as in :func:`swiglu_mlp` without up."""
    return _mlp(x, (fc1, fc2), config, activation, False, "coat.nn.functional.mlp")
