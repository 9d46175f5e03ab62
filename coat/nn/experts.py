"""FP8 mixture-of-experts MLPs: transformers' experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], the
layout of its experts interface) computed in COAT's precision flow, with FP8 grouped GEMMs.

For tokens x [T, H] routed to experts ``top_k_index`` [T, k] with weights ``top_k_weights`` [T, k]:

    y_t = sum_j w_tj * down_e(SiLU(gate_e(x_t)) * up_e(x_t)),   e = top_k_index[t, j]

    x_q          = FP8(x), one per-tensor scale (group scaling, as coat's linear layers): quantized once,
                   before the permutation, so the routed copies are bytes moved, not quantized again
    rows         = x_q permuted by expert, each expert's rows padded with zeros to a multiple of 16
                   (ROW_ALIGNMENT: the FP8 grouped GEMM's offsets must be), the last expert's group running to
                   a row count fixed by T, k and E alone (no host sync: the padded size is static)
    gate, up     = grouped GEMM of rows with FP8(gate_up_proj) (one per-tensor scale over all experts)
    act          = SiLU(gate) * up in FP8, coat.ops.silu_mul_quantize: gate and up saved in 1 x G groups
    o            = grouped GEMM of act with FP8(down_proj)
    y            = the k rows of each token gathered back and weighted: one batched [1, k] x [k, H] product

The grouped GEMMs are torch._scaled_grouped_mm on GPUs with FP8 grouped GEMMs (sm90), in the tensor cores' fast
accumulation unless ``config.experts_fast_accum`` is False (then with fp32 promotion, which ran slower than BF16 at
small experts); on CPUs and other GPUs the FP8 values are multiplied in float32 with torch._grouped_mm and both
scales applied after, the same products (the CPU path of coat.nn.functional.fp8_gemm). No Python loop runs over
the experts. Transposed operands (each expert's weight, the routed input for the weight gradient) come from the
quantizer's transposed output, never from a byte transpose.

Saved for backward: x itself (the router reads the same tensor and keeps it: saving it costs nothing more)
with its amax, so that backward re-creates the forward's FP8 copy bit for bit; gate and up in 1 x G groups
(``config.saved_format``) and the product's scale; the routing (padded row of each choice, offsets) and weights;
the weights' amaxes. Backward:

    g_r     = dy_t for each row r of token t (unweighted), E4M3 (GRADIENT_DTYPE)
    dact'   = grouped GEMM of g with down_proj (transposed per expert)   the unweighted gradient of act
    dw_tj   = <dact'_r, act_r>  = <dy_t, o_r>, the routing weight's gradient (act recomputed in FP8)
    ddown_e = sum_r (w_r g_r)^T act_r                                    2-D x 2-D grouped GEMM over row groups
    dact    = w_r dact'_r  -> SiLU*mul backward kernel -> dgate, dup
    dx_rows = grouped GEMM of [dgate, dup] with gate_up_proj; dgate_up_e = sum_r [dgate, dup]_r^T x_r
    dx_t    = sum_j dx_rows[r(t, j)]
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from coat import ops
from coat.nn.config import AMAX_GROUP_SIZE, FP8Config
from coat.nn.gemm import _device_has_fp8_gemm, _no_autocast, output_dtype, quantize_per_tensor
from coat.nn.layers import _save, _saved
from coat.ops.norm_act import _checked_activation

# The FP8 grouped GEMM reads each group's rows from an offset that must be a multiple of 16 (16 bytes of FP8).
ROW_ALIGNMENT = 16
# torch's FP8 grouped GEMM multiplies E4M3 operands only, so the experts' output gradients are E4M3 (per tensor,
# as torchao's MoE recipe has them, row-wise there) whatever the layer's gradient_format; on every device, so that
# the CPU computes what the GPU does.
GRADIENT_DTYPE = torch.float8_e4m3fn
# ... and writes bfloat16 only: a float32 result (a float32 master weight's gradient) is that, widened.
GEMM_OUT_DTYPE = torch.bfloat16


class Routing(NamedTuple):
    """Where each (token, choice) goes among the padded, expert-sorted rows of the grouped GEMMs."""

    rows: int  # padded row count, static: round_up(T * k + (ROW_ALIGNMENT - 1) * E, ROW_ALIGNMENT)
    offsets: torch.Tensor  # int32 [E], the end of each expert's rows; the last is ``rows``
    dest: torch.Tensor  # int64 [T * k], the row of choice j of token t at t * k + j
    row_token: torch.Tensor  # int64 [rows], the token of each row; T for a padding row
    padding: torch.Tensor  # int64 [rows - T * k], the padding rows


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """The padded row layout of :class:`Routing` for ``top_k_index`` [T, k] (expert ids in [0, num_experts)).
    Rows of one expert keep the tokens' order (a stable sort), so the layout is deterministic."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))  # static shape, unlike bincount
    aligned = (counts + ROW_ALIGNMENT - 1) // ROW_ALIGNMENT * ROW_ALIGNMENT
    aligned_starts = aligned.cumsum(0) - aligned
    starts = counts.cumsum(0) - counts
    experts_sorted, order = torch.sort(flat, stable=True)
    position = torch.arange(flat.numel(), device=flat.device)
    dest = torch.empty_like(order)
    dest[order] = aligned_starts[experts_sorted] + position - starts[experts_sorted]
    rows = -(-(flat.numel() + (ROW_ALIGNMENT - 1) * num_experts) // ROW_ALIGNMENT) * ROW_ALIGNMENT
    row_token = torch.full((rows,), tokens, dtype=torch.int64, device=flat.device)
    row_token[dest] = position // k
    offsets = (aligned_starts + aligned).to(torch.int32)
    offsets[-1] = rows  # the padding at the end belongs to the last expert: zero rows, zero products
    # The rows - T * k padding rows (a count fixed by T, k and E): the stable sort puts them first.
    padding = torch.sort((row_token != tokens).to(torch.uint8), stable=True).indices[:rows - flat.numel()]
    return Routing(rows, offsets, dest, row_token, padding)


def permute_rows(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """x [T, C] (any dtype, FP8 included) -> [rows, C], row r = x[row_token[r]], zeros for padding rows."""
    data = x.view(torch.uint8) if x.element_size() == 1 else x  # FP8 rows move as bytes
    out = data.index_select(0, routing.row_token.clamp(max=x.shape[0] - 1))
    # Only the few padding rows are written again (a mask over every row would cost a pass over all of them).
    return out.index_fill_(0, routing.padding, 0).view(x.dtype)


@torch.library.custom_op("coat::grouped_mm_float32", mutates_args=())
def grouped_mm_float32(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm of float32 operands, where no FP8 grouped GEMM exists: a custom op, because torch's meta
    implementation (what torch.compile traces with) admits bfloat16 only, while the CPU kernel computes float32."""
    return torch._grouped_mm(a, b, offs=offsets)


@grouped_mm_float32.register_fake
def _grouped_mm_float32_fake(a, b, offsets):
    if b.dim() == 3:  # [M, K] x [E, K, N]
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1])  # [N, M] x [M, K], groups along M


def grouped_fp8_gemm(a, a_scale, b, b_scale, offsets, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    """``out[r] = (a[r] * a_scale) @ (b[e] * b_scale)^T`` for each row r of group e (rows offsets[e-1] to
    offsets[e]); a [M, K] FP8 row-major, b [E, N, K] FP8 contiguous, scales 0-d float32. Returns [M, N]."""
    if not _device_has_fp8_gemm(a.device):
        # FP8 products are exact in float32; the scales are applied after, as the GEMM applies them.
        with _no_autocast(a.device):
            out = grouped_mm_float32(a.float(), b.float().transpose(-2, -1), offsets)
            return (out * (a_scale * b_scale)).to(out_dtype)
    _check_gemm_shape(a.shape[1], b.shape[1])
    scale_a = a_scale.reshape(1).expand(a.shape[0]).contiguous()
    scale_b = b_scale.reshape(1, 1).expand(b.shape[0], b.shape[1]).contiguous()
    out = torch._scaled_grouped_mm(a, b.transpose(-2, -1), scale_a, scale_b, offs=offsets, out_dtype=GEMM_OUT_DTYPE,
                                   use_fast_accum=fast_accum)
    return out.to(out_dtype)


def grouped_fp8_gemm_wgrad(g_t, g_scale, x_t, x_scale, offsets, out_dtype, fast_accum: bool = False) -> torch.Tensor:
    """``out[e] = (g_t[:, group e] * g_scale) @ (x_t[:, group e] * x_scale)^T``, the weight gradients of every
    expert: g_t [N, M] and x_t [K, M] FP8 row-major (the transposed gradient and input), groups along M.
    Returns [E, N, K]; an expert without rows gets zeros."""
    if not _device_has_fp8_gemm(g_t.device):
        with _no_autocast(g_t.device):
            out = grouped_mm_float32(g_t.float(), x_t.float().t(), offsets)
            return (out * (g_scale * x_scale)).to(out_dtype)
    _check_gemm_shape(g_t.shape[0], x_t.shape[0])
    experts = offsets.shape[0]
    scale_a = g_scale.reshape(1).expand(experts * g_t.shape[0]).contiguous()
    scale_b = x_scale.reshape(1).expand(experts * x_t.shape[0]).contiguous()
    out = torch._scaled_grouped_mm(g_t, x_t.t(), scale_a, scale_b, offs=offsets, out_dtype=GEMM_OUT_DTYPE,
                                   use_fast_accum=fast_accum).to(out_dtype)
    # An empty group is a zero-length contraction, which the GEMM may leave unwritten.
    group_rows = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return torch.where(group_rows.view(-1, 1, 1) > 0, out, 0)


def _check_gemm_shape(*sizes: int) -> None:
    if any(size % 16 for size in sizes):
        raise ValueError(f"coat experts: the FP8 grouped GEMM needs the hidden and intermediate sizes to be "
                         f"multiples of 16, got {sizes}; leave such layers unconverted (skip_modules)")


def combine(o: torch.Tensor, routing: Routing, weights: torch.Tensor, out_dtype) -> torch.Tensor:
    """y_t = sum_j w_tj o[row(t, j)]: one batched [1, k] x [k, H] product, fp32 accumulation."""
    tokens, k = weights.shape
    gathered = o.index_select(0, routing.dest).view(tokens, k, o.shape[1])
    with _no_autocast(o.device):
        return torch.bmm(weights.to(o.dtype).unsqueeze(1), gathered).squeeze(1).to(out_dtype)


def _rows_weights(weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The routing weight of each padded row (0 for padding), float32 [rows]."""
    out = weights.new_zeros(routing.rows, dtype=torch.float32)
    out[routing.dest] = weights.reshape(-1).float()
    return out


def _quantized_experts(weight: torch.Tensor, fp8, amax, transposed: bool = False):
    """[E, N, K] -> FP8 codes with one per-tensor scale over all experts, and that scale: [E, N, K], or with
    ``transposed`` each expert's transpose, [E, K, N] (the experts side by side as one [N, E * K] matrix, whose
    transposed codes the quantizer writes: no byte transpose after it)."""
    if transposed:
        _, scale, q_t = ops.quantize_tensors(list(weight.unbind(0)), fp8, dim=1, amax=amax, rowwise=False,
                                             columnwise=True)
        return q_t.view(weight.shape[0], weight.shape[2], weight.shape[1]), scale
    q, scale, _ = ops.quantize_tensors([weight.reshape(-1, weight.shape[-1])], fp8, dim=0, amax=amax)
    return q.view(weight.shape), scale


class _ExpertsFunction(torch.autograd.Function):
    """See the module docstring."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up, down, config: FP8Config, out_dtype, activation: str):
        experts, inter = gate_up.shape[0], down.shape[2]
        routing = route(top_k_index, experts)
        fp8 = config.forward_dtype
        x_amax = ops.tensor_amax([x])
        x_q, x_scale, _ = quantize_per_tensor(x, fp8, amax=x_amax)
        gate_up_amax, down_amax = ops.tensor_amax([gate_up.reshape(-1, gate_up.shape[-1])]), ops.tensor_amax(
            [down.reshape(-1, down.shape[-1])])
        w_q, w_scale = _quantized_experts(gate_up, fp8, gate_up_amax)
        h = grouped_fp8_gemm(permute_rows(x_q, routing), x_scale, w_q, w_scale, routing.offsets, out_dtype,
                             config.experts_fast_accum)
        act_q, act_scale, _, gate_saved, gate_scales, up_saved, up_scales = ops.silu_mul_quantize(
            h[:, :inter], h[:, inter:], None, save_group_size=config.group_size, amax_group_size=AMAX_GROUP_SIZE,
            format=fp8, save_format=config.saved_format, activation=activation,
        )
        del h
        w_q, w_scale = _quantized_experts(down, fp8, down_amax)
        o = grouped_fp8_gemm(act_q, act_scale, w_q, w_scale, routing.offsets, out_dtype, config.experts_fast_accum)
        y = combine(o, routing, top_k_weights, out_dtype)
        _save(ctx, x=x, x_amax=x_amax, weights=top_k_weights, offsets=routing.offsets, dest=routing.dest,
              row_token=routing.row_token, padding=routing.padding, gate_saved=gate_saved, gate_scales=gate_scales,
              up_saved=up_saved, up_scales=up_scales, act_scale=act_scale, gate_up_amax=gate_up_amax,
              down_amax=down_amax, gate_up=gate_up, down=down)
        ctx.config, ctx.rows, ctx.out_dtype, ctx.activation = config, routing.rows, out_dtype, activation
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved = _saved(ctx)
        config, out_dtype = ctx.config, ctx.out_dtype
        routing = Routing(ctx.rows, saved["offsets"], saved["dest"], saved["row_token"], saved["padding"])
        fast_accum = config.experts_fast_accum
        x, gate_up, down, weights = saved["x"], saved["gate_up"], saved["down"], saved["weights"]
        hidden, inter = down.shape[1:]
        need_x, _, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:5]
        fp8, grad_fp8 = config.forward_dtype, GRADIENT_DTYPE
        grad_y = grad_y.contiguous()
        rows_weights = _rows_weights(weights, routing)

        act_q_t = ops.silu_mul_requantize(
            saved["gate_saved"], saved["gate_scales"], saved["up_saved"], saved["up_scales"], None,
            saved["act_scale"], config.group_size, fp8, saved_format=config.saved_format, cols=inter,
            activation=ctx.activation,
        )
        # The down projection: the unweighted output gradient of each row, its dgrad, the routing weights'
        # gradient, the weighted rows' wgrad.
        g_q, g_scale, _ = quantize_per_tensor(grad_y, grad_fp8)
        down_t_q, down_scale = _quantized_experts(down, fp8, saved["down_amax"], transposed=True)
        grad_act = grouped_fp8_gemm(permute_rows(g_q, routing), g_scale, down_t_q, down_scale, routing.offsets,
                                    out_dtype, fast_accum)
        grad_weights = None
        if need_weights:
            act = ops.dequantize(act_q_t, saved["act_scale"], None, grad_act.dtype).t()
            with _no_autocast(grad_act.device):
                grad_rows_weights = torch.linalg.vecdot(grad_act, act, dim=1).float()
            del act
            grad_weights = grad_rows_weights.index_select(0, routing.dest).view_as(weights).to(weights.dtype)
        grad_down = None
        if need_down:
            weighted = permute_rows(grad_y, routing) * rows_weights.to(grad_y.dtype).unsqueeze(1)
            _, gw_scale, gw_q_t = quantize_per_tensor(weighted, grad_fp8, rowwise=False, columnwise=True)
            del weighted
            grad_down = grouped_fp8_gemm_wgrad(gw_q_t, gw_scale, act_q_t, saved["act_scale"], routing.offsets,
                                               down.dtype, fast_accum)
        del act_q_t
        grad_act.mul_(rows_weights.to(grad_act.dtype).unsqueeze(1))

        grad_gate, grad_up, grad_amax = ops.silu_mul_backward(
            grad_act, saved["gate_saved"], saved["gate_scales"], saved["up_saved"], saved["up_scales"], None,
            config.group_size, saved_format=config.saved_format, activation=ctx.activation,
        )
        del grad_act
        g2_q, g2_scale, g2_q_t = ops.quantize_tensors([grad_gate, grad_up], grad_fp8, dim=1, amax=grad_amax,
                                                      rowwise=need_x, columnwise=need_gate_up)
        del grad_gate, grad_up
        grad_x = grad_gate_up = None
        if need_gate_up:
            # The forward's FP8 rows, transposed by the quantizer (the same codes: the same values and amax).
            _, x_scale, x_rows_t = quantize_per_tensor(permute_rows(x, routing), fp8, rowwise=False, columnwise=True,
                                                       amax=saved["x_amax"])
            grad_gate_up = grouped_fp8_gemm_wgrad(g2_q_t, g2_scale, x_rows_t, x_scale, routing.offsets,
                                                  gate_up.dtype, fast_accum)
        if need_x:
            gate_up_t_q, gate_up_scale = _quantized_experts(gate_up, fp8, saved["gate_up_amax"], transposed=True)
            grad_rows = grouped_fp8_gemm(g2_q, g2_scale, gate_up_t_q, gate_up_scale, routing.offsets, out_dtype,
                                         fast_accum)
            tokens, k = weights.shape
            grad_x = grad_rows.index_select(0, routing.dest).view(tokens, k, hidden).sum(1, dtype=torch.float32)
            grad_x = grad_x.to(x.dtype)
        return grad_x, None, grad_weights, grad_gate_up, grad_down, None, None, None


def fp8_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, config: FP8Config = FP8Config(), *, activation: str = "silu") -> torch.Tensor:
    """transformers' experts forward (``gate_up_proj`` [E, 2I, H] with the gate's rows first, ``down_proj``
    [E, H, I], ``act_fn`` SiLU or gelu_tanh) in FP8, see the module docstring: x [T, H], top_k_index [T, k]
    (int), top_k_weights [T, k] -> [T, H]. Differentiable in x, the routing weights and both weights."""
    if x.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"coat fp8_experts: expects x [T, H], top_k_index and top_k_weights [T, k], got "
                         f"{tuple(x.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
    experts, hidden = gate_up.shape[0], x.shape[1]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] != hidden or down.shape[:2] != (experts, hidden) \
            or gate_up.shape[1] != 2 * down.shape[2]:
        raise ValueError(f"coat fp8_experts: expects gate_up [E, 2I, {hidden}] and down [E, {hidden}, I], got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if config.gradient_dtype is None:
        raise ValueError("coat fp8_experts: gradient_format=None (BF16 backward GEMMs) is not supported for experts; "
                         "use 'e5m2' or 'e4m3'")
    if config.smooth_swiglu:
        raise ValueError("coat fp8_experts: smooth_swiglu is not supported for experts (its per-channel scale "
                         "would be per expert)")
    _checked_activation(activation, "coat.nn.experts.fp8_experts")
    x = x if x.stride(-1) == 1 and x.is_contiguous() else x.contiguous()
    return _ExpertsFunction.apply(x, top_k_index, top_k_weights, gate_up, down, config, output_dtype(x), activation)
