"""coat's FP8 layers as autograd Functions: what each computes in FP8 and what it saves for backward.

Every linear layer quantizes its input and its weight per tensor to FP8 (E4M3 by default) with group scaling
and multiplies them with an FP8 GEMM (torch._scaled_mm: fp32 accumulation, output in the input's dtype).
For backward it saves the transposed FP8 copy of its input, the operand the weight-gradient GEMM reads, and
that copy's scale; never the BF16 input, and never an FP8 copy of the weight, which backward quantizes again
from the parameter (paper appendix G.5). See :class:`coat.nn.FP8Config` for the gradient options.

The shapes torch._scaled_mm accepts on GPUs are: A row-major, B column-major, the contraction dimension K
and the output width N multiples of 16. :func:`fp8_gemm` zero-pads K and N to the next multiple of 16
(zeros add nothing to a dot product, and the padded output columns are dropped), so any shape works and the
padding costs one copy of the operands only for shapes that need it. On devices without FP8 GEMMs (CUDA
GPUs before compute capability 8.9) it multiplies the FP8 values in float32 instead and applies both
scales after, which computes the same products; CPUs run torch._scaled_mm's CPU implementation.

The block Functions at the end implement the paper's FP8 precision flow for a Llama-style decoder layer
(appendix G.1). Their docstrings say what each saves.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from coat import ops
from coat.nn.config import AMAX_GROUP_SIZE, FP8Config

_GEMM_ALIGNMENT = 16


# ---------------------------------------------------------------------------------------------------------
# FP8 GEMM


@functools.lru_cache(maxsize=None)
def _device_has_fp8_gemm(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def _pad_last_dim(q: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pads the last dimension of a contiguous FP8 matrix to a multiple of ``multiple``. Byte 0 is +0.0
    in both FP8 formats; padding runs on the uint8 view because constant padding of FP8 dtypes is not
    implemented everywhere."""
    pad = -q.shape[-1] % multiple
    if pad == 0:
        return q
    return F.pad(q.view(torch.uint8), (0, pad)).view(q.dtype)


def _pad_rows(q: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -q.shape[0] % multiple
    if pad == 0:
        return q
    return F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(q.dtype)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b_t: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a * a_scale) @ (b_t * b_scale).T + bias`` with fp32 accumulation, rounded once to ``out_dtype``.

    a: [M, K] FP8, contiguous (row-major). b_t: [N, K] FP8, contiguous, i.e. B = b_t.T is the column-major
    [K, N] operand. Scales are one-element float32 tensors (the dequantization scales of
    :func:`coat.ops.quantize_tensor`). bias: [N] or None. Returns a contiguous [M, N] tensor.

    This calls torch._scaled_mm, whose schema is the same on every supported torch (2.11 and 2.13) and which
    has a CPU implementation; torch.nn.functional.scaled_mm, its public successor, describes scaling with
    recipe enums that are still being extended, and gains nothing for per-tensor scales.
    """
    n = b_t.shape[0]
    if not _device_has_fp8_gemm(a.device):
        # Products of FP8 values are exact in float32, so this differs from the FP8 GEMM only in the order of
        # the fp32 additions; the scales are applied after the product, as the GEMM applies them.
        out = (a.float() @ b_t.float().t()) * (a_scale * b_scale)
        return (out if bias is None else out + bias).to(out_dtype)
    a = _pad_last_dim(a, _GEMM_ALIGNMENT)
    b_t = _pad_rows(_pad_last_dim(b_t, _GEMM_ALIGNMENT), _GEMM_ALIGNMENT)
    # The GEMM epilogue adds a BF16/FP16 bias before its single rounding; cuBLASLt takes no float32 bias,
    # so a float32 output gets its bias added afterwards, where that costs no precision.
    epilogue_bias = None
    if bias is not None and out_dtype != torch.float32:
        epilogue_bias = F.pad(bias.to(out_dtype), (0, b_t.shape[0] - n))
    out = torch._scaled_mm(a, b_t.t(), a_scale, b_scale, bias=epilogue_bias, out_dtype=out_dtype)
    if out.shape[1] != n:
        out = out[:, :n].contiguous()
    if bias is not None and epilogue_bias is None:
        out.add_(bias)
    return out


# ---------------------------------------------------------------------------------------------------------
# Linear building blocks, shared by coat.nn.Linear and the decoder blocks


def quantize_per_tensor(x2d: torch.Tensor, fp8: torch.dtype, transpose: bool):
    """Per-tensor FP8 with group scaling: ``(q, scale, q_t)``, q_t None unless ``transpose``."""
    return ops.quantize_tensor(x2d, fp8, group_size=AMAX_GROUP_SIZE, transpose=transpose)


def linear_forward_fp8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: FP8Config,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y = x @ W^T + b for an input already quantized per tensor ([M, K] FP8); W is quantized here."""
    w_q, w_scale, _ = quantize_per_tensor(weight.contiguous(), config.forward_dtype, transpose=False)
    return fp8_gemm(x_q, x_scale, w_q, w_scale, out_dtype, bias)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = ops.dequantize(q, scale, None, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    return out.to(dtype)


class QuantizedGradient:
    """An output gradient [M, N] prepared once for every backward GEMM that reads it: quantized per tensor
    to ``config.gradient_format`` (with its transpose when a weight gradient is needed), or kept as is when
    gradients stay unquantized."""

    def __init__(self, grad2d: torch.Tensor, config: FP8Config, need_transpose: bool):
        self.grad = grad2d
        self.config = config
        if config.gradient_dtype is not None:
            self.q, self.scale, self.q_t = quantize_per_tensor(grad2d, config.gradient_dtype, need_transpose)

    def input_grad(self, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """dgrad: dY @ W, [M, K]."""
        if self.config.gradient_dtype is None:
            return (self.grad @ weight.to(self.grad.dtype)).to(out_dtype)
        _, w_scale, w_q_t = quantize_per_tensor(weight.contiguous(), self.config.forward_dtype, transpose=True)
        return fp8_gemm(self.q, self.scale, w_q_t, w_scale, out_dtype)

    def weight_grad(self, x_q_t: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """wgrad: dY^T @ X, [N, K], from the transposed FP8 input [K, M] saved in forward."""
        if self.config.gradient_dtype is None:
            x_t = _dequantized(x_q_t, x_scale, self.grad.dtype)
            return (self.grad.t() @ x_t.t()).to(out_dtype)
        # The contraction dimension here is the token count M, which fp8_gemm pads to a multiple of 16.
        return fp8_gemm(self.q_t, self.scale, x_q_t, x_scale, out_dtype)

    def bias_grad(self, bias: torch.Tensor) -> torch.Tensor:
        return self.grad.sum(0, dtype=torch.float32).to(bias.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous [rows, last-dim] matrix (a no-op for contiguous tensors)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer returns: the autocast dtype inside autocast, the input's dtype otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# coat.nn.Linear


class _LinearFunction(torch.autograd.Function):
    """y = x W^T + b with FP8 operands. Saves the transposed FP8 input and its scale when the weight needs a
    gradient (nothing of the input otherwise), and the weight parameter itself."""

    @staticmethod
    def forward(ctx, x, weight, bias, config: FP8Config, out_dtype: torch.dtype):
        x2d = _rows(x)
        need_weight_grad = ctx.needs_input_grad[1]
        x_q, x_scale, x_q_t = quantize_per_tensor(x2d, config.forward_dtype, transpose=need_weight_grad)
        y = linear_forward_fp8(x_q, x_scale, weight, bias, config, out_dtype)
        ctx.save_for_backward(x_q_t, x_scale if need_weight_grad else None, weight, bias)
        ctx.config, ctx.x_shape, ctx.x_dtype = config, x.shape, x.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_q_t, x_scale, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad = QuantizedGradient(_rows(grad_y), ctx.config, need_transpose=need_w)
        grad_x = grad.input_grad(weight, ctx.x_dtype).view(ctx.x_shape) if need_x else None
        grad_w = grad.weight_grad(x_q_t, x_scale, weight.dtype) if need_w else None
        grad_b = grad.bias_grad(bias) if need_b else None
        return grad_x, grad_w, grad_b, None, None


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
    x_q, x_scale, _ = quantize_per_tensor(_rows(x), config.forward_dtype, transpose=False)
    y = linear_forward_fp8(x_q, x_scale, weight, bias, config, out_dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------------------
# Layers that share one FP8 input, and the saved-tensor plumbing of the block Functions


def projections_forward(x_q, x_scale, params, config: FP8Config, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """The linear layers that read one quantized input (q, k and v after the input norm; gate and up after
    the post-attention norm): that input is quantized once and saved once. params: [(weight, bias), ...]."""
    return [linear_forward_fp8(x_q, x_scale, weight, bias, config, out_dtype) for weight, bias in params]


def projections_backward(grads, x_q_t, x_scale, params, needs, config: FP8Config, input_grad_dtype):
    """Backward of :func:`projections_forward`. needs: (need_input_grad, [(need_weight_grad, need_bias_grad)
    per projection]). Returns the input's gradient (None when not needed), summed over the projections in
    float32 and rounded once, and the flat list [grad_weight_0, grad_bias_0, grad_weight_1, ...]."""
    need_input_grad, need_param_grads = needs
    accumulate_dtype = torch.float32 if len(params) > 1 else input_grad_dtype
    grad_input, param_grads = None, []
    for grad_out, (weight, bias), (need_weight, need_bias) in zip(grads, params, need_param_grads):
        grad = QuantizedGradient(_rows(grad_out), config, need_transpose=need_weight)
        if need_input_grad:
            part = grad.input_grad(weight, accumulate_dtype)
            grad_input = part if grad_input is None else grad_input.add_(part)
        param_grads.append(grad.weight_grad(x_q_t, x_scale, weight.dtype) if need_weight else None)
        param_grads.append(grad.bias_grad(bias) if need_bias else None)
    return None if grad_input is None else grad_input.to(input_grad_dtype), param_grads


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


def _rmsnorm_quantize(x2d, weight, eps: float, config: FP8Config, transpose: bool):
    """-> (y, y_scale, y_t, x_saved, x_saved_scales, rstd): y = RMSNorm(x) * weight quantized per tensor
    (its transpose y_t when ``transpose``, else None), x as E4M3 in 1 x group_size groups, rstd per row."""
    return ops.rmsnorm_quantize(
        x2d,
        weight,
        eps,
        save_group_size=config.group_size,
        amax_group_size=AMAX_GROUP_SIZE,
        format=config.forward_dtype,
        transpose=transpose,
    )


def _rmsnorm_backward(grad_y2d, saved: dict, weight, config: FP8Config, x_dtype):
    grad_x, grad_weight = ops.rmsnorm_backward(
        grad_y2d, saved["x_saved"], saved["x_saved_scales"], saved["rstd"], weight, config.group_size
    )
    return grad_x.to(x_dtype), grad_weight.to(weight.dtype)


def smooth_swiglu_scale(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Smooth-SwiGLU's per-channel scale s (Fishman et al. 2024, section 4.4), from each channel's max
    |SiLU(gate) * up| over the tokens: s_i = 2^-ceil(log2 amax_i), so every channel's amax lands in
    (1/2, 1] and the per-tensor scale of the product no longer follows the channel with the largest
    outliers. Powers of two make s and its inverse, folded into the down projection, exact; the exponent
    is clamped to [-126, 126] so that both stay normal float32 numbers. Channels that are all zero (or not
    finite) get s = 1. float32 [channels]."""
    with torch.no_grad():
        amax = (F.silu(gate) * up).abs().amax(dim=0).float()
        exponent = torch.clamp(torch.ceil(torch.log2(amax)), -126, 126)
        usable = torch.isfinite(amax) & (amax > 0)
        return torch.where(usable, torch.exp2(-exponent), torch.ones_like(amax))


def _smoothed_down_weight(weight: torch.Tensor, smooth_scale: torch.Tensor | None) -> torch.Tensor:
    """W_down with 1/s folded into its input channels: down(s * z) uses W diag(1/s), so the product equals
    W z while the quantized activation is s * z. Exact, since s is a power of two."""
    return weight if smooth_scale is None else weight * smooth_scale.reciprocal().to(weight.dtype)


def _swiglu_forward(x_q, x_scale, params, config: FP8Config, out_dtype, keep_for_backward: bool):
    """down(SiLU(gate(x)) * up(x)) from an input already in FP8. params: [(w, b)] for gate, up, down.
    Returns the output and the tensors backward needs: SiLU*mul's inputs in 1 x G FP8 groups, the
    transposed FP8 product that feeds the down projection (its wgrad operand) and its scale. gate and up
    themselves live only until the fused op has read them."""
    gate, up = projections_forward(x_q, x_scale, params[:2], config, out_dtype)
    smooth_scale = smooth_swiglu_scale(gate, up) if config.smooth_swiglu else None
    act_q, act_scale, act_q_t, gate_saved, gate_scales, up_saved, up_scales = ops.silu_mul_quantize(
        gate,
        up,
        smooth_scale,
        save_group_size=config.group_size,
        amax_group_size=AMAX_GROUP_SIZE,
        format=config.forward_dtype,
        transpose=keep_for_backward,
    )
    del gate, up
    down_weight, down_bias = params[2]
    out = linear_forward_fp8(
        act_q, act_scale, _smoothed_down_weight(down_weight, smooth_scale), down_bias, config, out_dtype
    )
    saved = dict(
        gate_saved=gate_saved,
        gate_scales=gate_scales,
        up_saved=up_saved,
        up_scales=up_scales,
        act_q_t=act_q_t,
        act_scale=act_scale,
        smooth_scale=smooth_scale,
    )
    return out, saved


def _swiglu_backward(grad_out2d, saved: dict, x_q_t, x_scale, params, needs, config: FP8Config, x_dtype):
    """Backward of :func:`_swiglu_forward`. needs: (need_input_grad, [(need_w, need_b)] for gate, up, down).
    Returns the input's gradient and [grad_w, grad_b] for gate, up, down."""
    need_input_grad, need_param_grads = needs
    down_weight, down_bias = params[2]
    smooth_scale = saved["smooth_scale"]
    need_down_weight, need_down_bias = need_param_grads[2]

    grad = QuantizedGradient(grad_out2d, config, need_transpose=need_down_weight)
    grad_act = grad.input_grad(_smoothed_down_weight(down_weight, smooth_scale), grad_out2d.dtype)
    grad_down_weight = None
    if need_down_weight:
        grad_down_weight = grad.weight_grad(saved["act_q_t"], saved["act_scale"], down_weight.dtype)
        if smooth_scale is not None:
            grad_down_weight = grad_down_weight * smooth_scale.reciprocal().to(grad_down_weight.dtype)
    grad_down_bias = grad.bias_grad(down_bias) if need_down_bias else None
    del grad

    grad_gate, grad_up = ops.silu_mul_backward(
        grad_act,
        saved["gate_saved"],
        saved["gate_scales"],
        saved["up_saved"],
        saved["up_scales"],
        smooth_scale,
        config.group_size,
    )
    del grad_act
    grad_input, gate_up_grads = projections_backward(
        [grad_gate, grad_up], x_q_t, x_scale, params[:2], (need_input_grad, need_param_grads[:2]), config, x_dtype
    )
    return grad_input, gate_up_grads + [grad_down_weight, grad_down_bias]


def _param_needs(needs_input_grad, first_param_index: int, count: int):
    """[(need_weight, need_bias)] for ``count`` (weight, bias) pairs starting at ``first_param_index``."""
    flags = needs_input_grad[first_param_index : first_param_index + 2 * count]
    return list(zip(flags[0::2], flags[1::2]))


def _params_need_grad(param_needs) -> bool:
    return any(need_weight for need_weight, _ in param_needs)


# ---------------------------------------------------------------------------------------------------------
# coat.nn.RMSNorm and coat.nn.SwiGLUMLP on their own


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm(x) * weight through the fused op, returned dequantized from its per-tensor FP8 output.
    Saves x as E4M3 in 1 x G groups, its scales, rstd, and the weight parameter."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, config: FP8Config, out_dtype):
        y, y_scale, _, x_saved, x_saved_scales, rstd = _rmsnorm_quantize(_rows(x), weight, eps, config, False)
        _save(ctx, x_saved=x_saved, x_saved_scales=x_saved_scales, rstd=rstd, weight=weight)
        ctx.config, ctx.x_dtype = config, x.dtype
        return _dequantized(y, y_scale, out_dtype).view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        saved = _saved(ctx)
        grad_x, grad_weight = _rmsnorm_backward(_rows(grad_y), saved, saved["weight"], ctx.config, ctx.x_dtype)
        return grad_x.view(grad_y.shape), grad_weight, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, config: FP8Config = FP8Config()) -> torch.Tensor:
    """RMSNorm through the fused FP8 kernel; the output is the FP8 tensor an FP8 GEMM would read, dequantized."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"coat rms_norm: input has {x.shape[-1]} features but the weight has {weight.shape[0]}")
    out_dtype = output_dtype(x)
    if _needs_autograd(x, weight):
        return _RMSNormFunction.apply(x, weight, eps, config, out_dtype)
    y, y_scale, *_ = _rmsnorm_quantize(_rows(x), weight, eps, config, False)
    return _dequantized(y, y_scale, out_dtype).view(x.shape)


class _SwiGLUMLPFunction(torch.autograd.Function):
    """down(SiLU(gate(x)) * up(x)), LlamaMLP's computation, in FP8. Saves the transposed FP8 input (read by
    both the gate and up wgrads) and its scale, plus what :func:`_swiglu_forward` lists."""

    @staticmethod
    def forward(ctx, x, config: FP8Config, out_dtype, *flat_params):
        params = _pairs(flat_params)
        param_needs = _param_needs(ctx.needs_input_grad, 3, 3)
        x_q, x_scale, x_q_t = quantize_per_tensor(
            _rows(x), config.forward_dtype, transpose=_params_need_grad(param_needs[:2])
        )
        out, saved = _swiglu_forward(x_q, x_scale, params, config, out_dtype, keep_for_backward=True)
        _save(ctx, x_q_t=x_q_t, x_scale=x_scale, **saved, **_named_params(flat_params))
        ctx.config, ctx.x_shape, ctx.x_dtype = config, x.shape, x.dtype
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        needs = (ctx.needs_input_grad[0], _param_needs(ctx.needs_input_grad, 3, 3))
        grad_x, param_grads = _swiglu_backward(
            _rows(grad_out), saved, saved["x_q_t"], saved["x_scale"], params, needs, ctx.config, ctx.x_dtype
        )
        return (None if grad_x is None else grad_x.view(ctx.x_shape), None, None, *param_grads)


def _named_params(flat_params) -> dict:
    return {f"param_{i}": p for i, p in enumerate(flat_params)}


def _params_from(saved: dict) -> list:
    return [saved[f"param_{i}"] for i in range(sum(name.startswith("param_") for name in saved))]


def swiglu_mlp(x: torch.Tensor, gate, up, down, config: FP8Config = FP8Config()) -> torch.Tensor:
    """FP8 LlamaMLP: gate, up, down are (weight, bias) pairs (bias may be None)."""
    flat_params = (*gate, *up, *down)
    out_dtype = output_dtype(x)
    if _needs_autograd(x, *flat_params):
        return _SwiGLUMLPFunction.apply(x, config, out_dtype, *flat_params)
    x_q, x_scale, _ = quantize_per_tensor(_rows(x), config.forward_dtype, transpose=False)
    out, _ = _swiglu_forward(x_q, x_scale, _pairs(flat_params), config, out_dtype, keep_for_backward=False)
    return out.view(*x.shape[:-1], out.shape[-1])


# ---------------------------------------------------------------------------------------------------------
# The decoder blocks of the FP8 precision flow (paper appendix G.1)


class _BeforeAttentionFunction(torch.autograd.Function):
    """RMSNorm then the q, k, v projections. The fused norm writes its output directly in FP8 (with the
    transpose the wgrads read), which feeds all three GEMMs: no BF16 round trip, one saved copy.
    Saves: x as E4M3 in 1 x G groups + scales + rstd (the norm's backward), the transposed FP8 normed
    output + its scale (the three wgrads), and the parameters."""

    @staticmethod
    def forward(ctx, x, norm_weight, eps: float, config: FP8Config, out_dtype, *flat_params):
        params = _pairs(flat_params)
        param_needs = _param_needs(ctx.needs_input_grad, 5, len(params))
        y, y_scale, y_t, x_saved, x_saved_scales, rstd = _rmsnorm_quantize(
            _rows(x), norm_weight, eps, config, transpose=_params_need_grad(param_needs)
        )
        outputs = projections_forward(y, y_scale, params, config, out_dtype)
        _save(
            ctx,
            x_saved=x_saved,
            x_saved_scales=x_saved_scales,
            rstd=rstd,
            norm_weight=norm_weight,
            y_t=y_t,
            y_scale=y_scale,
            **_named_params(flat_params),
        )
        ctx.config, ctx.x_shape, ctx.x_dtype = config, x.shape, x.dtype
        return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        param_needs = _param_needs(ctx.needs_input_grad, 5, len(params))
        need_x, need_norm_weight = ctx.needs_input_grad[:2]
        grad_y, param_grads = projections_backward(
            grads, saved["y_t"], saved["y_scale"], params, (need_x or need_norm_weight, param_needs), ctx.config,
            ctx.x_dtype,
        )
        grad_x, grad_norm_weight = None, None
        if grad_y is not None:
            grad_x, grad_norm_weight = _rmsnorm_backward(grad_y, saved, saved["norm_weight"], ctx.config, ctx.x_dtype)
        return (
            grad_x.view(ctx.x_shape) if need_x else None,
            grad_norm_weight if need_norm_weight else None,
            None,
            None,
            None,
            *param_grads,
        )


def before_attention(x, norm_weight, eps: float, projections, config: FP8Config = FP8Config()):
    """(q, k, v) = [proj(RMSNorm(x)) for proj in projections], with projections [(weight, bias), ...]."""
    flat_params = tuple(t for pair in projections for t in pair)
    out_dtype = output_dtype(x)
    if _needs_autograd(x, norm_weight, *flat_params):
        return _BeforeAttentionFunction.apply(x, norm_weight, eps, config, out_dtype, *flat_params)
    y, y_scale, *_ = _rmsnorm_quantize(_rows(x), norm_weight, eps, config, transpose=False)
    outputs = projections_forward(y, y_scale, _pairs(flat_params), config, out_dtype)
    return tuple(out.view(*x.shape[:-1], out.shape[-1]) for out in outputs)


class _AfterAttentionFunction(torch.autograd.Function):
    """residual + o_proj(attention output). The attention output is quantized per tensor for the GEMM.
    When the attention kernel keeps its own output for backward (SDPA, FlashAttention), this Function saves
    that same tensor, which costs no memory, plus the amax that fixed its scale: backward quantizes it again
    with that amax and gets the forward's FP8 values back bit for bit (paper appendix D). An FP8 copy would
    add 0.5 units instead. When it does not (eager attention), the transposed FP8 input is saved instead, as
    in coat.nn.Linear."""

    @staticmethod
    def forward(ctx, attn_output, residual, weight, bias, config: FP8Config, out_dtype, attention_keeps_output):
        a2d = _rows(attn_output)
        need_weight_grad = ctx.needs_input_grad[2]
        amax = ops.group_amax(a2d, AMAX_GROUP_SIZE).amax().reshape(1)
        a_q, a_scale, a_q_t = ops.quantize_tensor(
            a2d, config.forward_dtype, group_amax=amax, transpose=need_weight_grad and not attention_keeps_output
        )
        out = linear_forward_fp8(a_q, a_scale, weight, bias, config, out_dtype)
        out = residual + out.view(residual.shape)
        if attention_keeps_output:
            _save(ctx, attn_output=attn_output, amax=amax, a_q_t=None, a_scale=None, weight=weight, bias=bias)
        else:
            _save(ctx, attn_output=None, amax=None, a_q_t=a_q_t, a_scale=a_scale, weight=weight, bias=bias)
        ctx.config, ctx.a_shape, ctx.a_dtype = config, attn_output.shape, attn_output.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        need_attn, need_residual, need_weight, need_bias = ctx.needs_input_grad[:4]
        a_q_t, a_scale = saved["a_q_t"], saved["a_scale"]
        if need_weight and a_q_t is None:
            _, a_scale, a_q_t = ops.quantize_tensor(
                _rows(saved["attn_output"]), ctx.config.forward_dtype, group_amax=saved["amax"], transpose=True
            )
        grad = QuantizedGradient(_rows(grad_out), ctx.config, need_transpose=need_weight)
        grad_attn = grad.input_grad(saved["weight"], ctx.a_dtype).view(ctx.a_shape) if need_attn else None
        grad_weight = grad.weight_grad(a_q_t, a_scale, saved["weight"].dtype) if need_weight else None
        grad_bias = grad.bias_grad(saved["bias"]) if need_bias else None
        return grad_attn, grad_out if need_residual else None, grad_weight, grad_bias, None, None, None


def after_attention(
    attn_output, residual, weight, bias, config: FP8Config = FP8Config(), *, attention_keeps_output: bool = True
):
    """residual + attn_output @ weight^T + bias, see :class:`_AfterAttentionFunction`."""
    out_dtype = output_dtype(attn_output)
    if _needs_autograd(attn_output, residual, weight, bias):
        return _AfterAttentionFunction.apply(
            attn_output, residual, weight, bias, config, out_dtype, attention_keeps_output
        )
    a_q, a_scale, _ = quantize_per_tensor(_rows(attn_output), config.forward_dtype, transpose=False)
    return residual + linear_forward_fp8(a_q, a_scale, weight, bias, config, out_dtype).view(residual.shape)


class _MLPResidualFunction(torch.autograd.Function):
    """x + down(SiLU(gate(n)) * up(n)) with n = RMSNorm(x): the post-attention norm writes n in FP8 for the
    gate and up GEMMs, SiLU*mul writes its product in FP8 for the down GEMM. Saves: x as E4M3 1 x G groups
    + scales + rstd, the transposed FP8 n + its scale, gate and up as E4M3 1 x G groups + scales, the
    transposed FP8 product + its scale (and Smooth-SwiGLU's per-channel scale), and the parameters."""

    @staticmethod
    def forward(ctx, x, norm_weight, eps: float, config: FP8Config, out_dtype, *flat_params):
        params = _pairs(flat_params)
        param_needs = _param_needs(ctx.needs_input_grad, 5, 3)
        n_q, n_scale, n_q_t, x_saved, x_saved_scales, rstd = _rmsnorm_quantize(
            _rows(x), norm_weight, eps, config, transpose=_params_need_grad(param_needs[:2])
        )
        mlp_out, mlp_saved = _swiglu_forward(n_q, n_scale, params, config, out_dtype, keep_for_backward=True)
        _save(
            ctx,
            x_saved=x_saved,
            x_saved_scales=x_saved_scales,
            rstd=rstd,
            norm_weight=norm_weight,
            n_q_t=n_q_t,
            n_scale=n_scale,
            **mlp_saved,
            **_named_params(flat_params),
        )
        ctx.config, ctx.x_shape, ctx.x_dtype = config, x.shape, x.dtype
        return x + mlp_out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        need_x, need_norm_weight = ctx.needs_input_grad[:2]
        needs = (need_x or need_norm_weight, _param_needs(ctx.needs_input_grad, 5, 3))
        grad_n, param_grads = _swiglu_backward(
            _rows(grad_out), saved, saved["n_q_t"], saved["n_scale"], params, needs, ctx.config, ctx.x_dtype
        )
        grad_x, grad_norm_weight = None, None
        if grad_n is not None:
            grad_x, grad_norm_weight = _rmsnorm_backward(grad_n, saved, saved["norm_weight"], ctx.config, ctx.x_dtype)
        return (
            grad_x.view(ctx.x_shape) + grad_out if need_x else None,
            grad_norm_weight if need_norm_weight else None,
            None,
            None,
            None,
            *param_grads,
        )


def mlp_residual(x, norm_weight, eps: float, gate, up, down, config: FP8Config = FP8Config()):
    """x + LlamaMLP(RMSNorm(x)) in FP8; gate, up, down are (weight, bias) pairs."""
    flat_params = (*gate, *up, *down)
    out_dtype = output_dtype(x)
    if _needs_autograd(x, norm_weight, *flat_params):
        return _MLPResidualFunction.apply(x, norm_weight, eps, config, out_dtype, *flat_params)
    n_q, n_scale, *_ = _rmsnorm_quantize(_rows(x), norm_weight, eps, config, transpose=False)
    mlp_out, _ = _swiglu_forward(n_q, n_scale, _pairs(flat_params), config, out_dtype, keep_for_backward=False)
    return x + mlp_out.view(x.shape)


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
