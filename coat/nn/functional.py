"""coat's FP8 layers as autograd Functions: what each computes in FP8 and what it saves for backward.

Every linear layer quantizes its input and its weight per tensor to FP8 (E4M3 by default) with group scaling
and multiplies them with an FP8 GEMM (torch._scaled_mm: fp32 accumulation, output in the input's dtype).
For backward it saves the transposed FP8 copy of its input, the operand the weight-gradient GEMM reads, and
that copy's scale; never the BF16 input, and never an FP8 copy of the weight, which backward quantizes again
from the parameter (paper appendix G.5). See :class:`coat.nn.FP8Config` for the gradient options.
Where a fused RMSNorm or SiLU*mul produced that input, the block Functions save only the op's own inputs
(E4M3, 1 x G groups) and recompute the transposed operand from them in backward, with the forward's scale:
one saved copy per op instead of two (AGoQ, section 4). The weight gradient then reads the op's output
recomputed from its FP8-rounded inputs; the README states the cost in precision.

The shapes torch._scaled_mm accepts on GPUs are: A row-major, B column-major, the contraction dimension K
and the output width N multiples of 16. :func:`fp8_gemm` zero-pads K and N to the next multiple of 16
(zeros add nothing to a dot product, and the padded output columns are dropped), so any shape works and the
padding costs one copy of the operands only for shapes that need it. Where there are no FP8 GEMMs (CUDA
GPUs before compute capability 8.9, and CPUs) it multiplies the FP8 values in float32 instead and applies
both scales after, which computes the same products. torch's CPU torch._scaled_mm is not used: on torch
2.11 it took 603 ms for one 512 x 512 x 512 product on 16 threads (7 s on one), against 11 ms on torch 2.13
and 5-9 ms for the float32 matmul.

The decoder blocks built from these (:mod:`coat.nn.blocks`, re-exported here) implement the paper's FP8
precision flow for a Llama-style decoder layer (appendix G.1). Their docstrings say what each saves.

Every quantization a Function makes is also handed, with the tensor it quantized, to a *site* of
:mod:`coat.report` while a report captures the step (``site`` arguments below; None otherwise, and then
nothing is recorded): the names it records under are the tensor names of the report.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from coat import ops
from coat.ops.norm_act import _checked_activation
from coat.nn import _capture
from coat.nn.config import AMAX_GROUP_SIZE, FP8Config
from coat.nn.fp8_weight import FP8Weight, transposed_codes

_GEMM_ALIGNMENT = 16


# ---------------------------------------------------------------------------------------------------------
# FP8 GEMM


_HAS_FP8_GEMM: dict[torch.device, bool] = {}


@torch.compiler.assume_constant_result  # torch.compile bakes the answer in instead of tracing the query
def _device_has_fp8_gemm(device: torch.device) -> bool:
    if device not in _HAS_FP8_GEMM:
        _HAS_FP8_GEMM[device] = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return _HAS_FP8_GEMM[device]


_AUTOCAST_AVAILABLE: dict[str, bool] = {}


@torch.compiler.assume_constant_result  # torch 2.11's dynamo cannot trace the query: it broke every layer's graph
def _autocast_available(device_type: str) -> bool:
    """Whether torch has an autocast for this device type (the meta device has none)."""
    if device_type not in _AUTOCAST_AVAILABLE:
        _AUTOCAST_AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return _AUTOCAST_AVAILABLE[device_type]


def _no_autocast(device: torch.device):
    """Where coat computes in the dtypes it chose itself: torch's autocast, if the caller runs one, would
    recast the operands of a matmul."""
    if not _autocast_available(device.type):  # the meta device: nothing to switch off
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


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
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * a_scale) @ (b_t * b_scale).T + bias`` with fp32 accumulation, rounded once to ``out_dtype``;
    ``fast_accum``: the tensor cores' faster accumulation on GPUs (:class:`coat.nn.FP8Config`).

    a: [M, K] FP8, contiguous (row-major). b_t: [N, K] FP8, contiguous, i.e. B = b_t.T is the column-major
    [K, N] operand. Scales are one-element float32 tensors (the dequantization scales of
    :func:`coat.ops.quantize_tensor`). bias: [N] or None. Returns a contiguous [M, N] tensor.

    This calls torch._scaled_mm, whose schema is the same on every supported torch (2.11 and 2.13) and which
    has a CPU implementation (not used, see the module docstring); torch.nn.functional.scaled_mm, its public
    successor, describes scaling with
    recipe enums that are still being extended, and gains nothing for per-tensor scales.
    """
    n = b_t.shape[0]
    if not _device_has_fp8_gemm(a.device):
        # Products of FP8 values are exact in float32, so this differs from the FP8 GEMM only in the order of
        # the fp32 additions; the scales are applied after the product, as the GEMM applies them. Autocast
        # would run the matmul in float16 (where the unscaled sums overflow) or bfloat16.
        with _no_autocast(a.device):
            out = (a.float() @ b_t.float().t()) * (a_scale * b_scale)
        return (out if bias is None else out + bias).to(out_dtype)
    a = _pad_last_dim(a, _GEMM_ALIGNMENT)
    b_t = _pad_rows(_pad_last_dim(b_t, _GEMM_ALIGNMENT), _GEMM_ALIGNMENT)
    # The GEMM epilogue adds a BF16/FP16 bias before its single rounding; cuBLASLt takes no float32 bias,
    # so a float32 output gets its bias added afterwards, where that costs no precision.
    epilogue_bias = None
    if bias is not None and out_dtype != torch.float32:
        epilogue_bias = F.pad(bias.to(out_dtype), (0, b_t.shape[0] - n))
    out = torch._scaled_mm(a, b_t.t(), a_scale, b_scale, bias=epilogue_bias, out_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    if out.shape[1] != n:
        out = out[:, :n].contiguous()
    if bias is not None and epilogue_bias is None:
        out.add_(bias)
    return out


# ---------------------------------------------------------------------------------------------------------
# Linear building blocks, shared by coat.nn.Linear and the decoder blocks


def quantize_per_tensor(x2d: torch.Tensor, fp8: torch.dtype, *, rowwise: bool = True, columnwise: bool = False,
                        amax: torch.Tensor | None = None):
    """Per-tensor FP8 of one [M, K] matrix: ``(q, scale, q_t)``, q None unless ``rowwise``, q_t (the [K, M]
    transpose a weight-gradient GEMM reads) None unless ``columnwise``. amax: reuse one computed before."""
    q, scale, q_t = ops.quantize_tensors([x2d], fp8, dim=0, amax=amax, rowwise=rowwise, columnwise=columnwise)
    return q if rowwise else None, scale, q_t if columnwise else None


class Projections:
    """The linear layers that read one FP8 input: q, k and v after the input norm, gate and up after the
    post-attention norm, or a single layer. Their weights are quantized together, with one per-tensor scale,
    into one [sum N_i, K] FP8 matrix. Forward multiplies the input by each projection's row block of it
    (one GEMM each, so that every output is a tensor of its own: attention keeps v for backward, and a view
    of a joint output would keep q and k alive with it). Backward is one dgrad GEMM over the gradients side by
    side (the sum over projections happens in its fp32 accumulator) and one wgrad GEMM whose row blocks are
    the weights' gradients. Sharing the scale is what a fused QKV weight does in other FP8 recipes; it costs
    precision only to a weight whose amax is far below its siblings' (E4M3 spans 2^17 below its max).
    ``name`` ("qkv", "o", "gate_up", "down"; empty for a lone linear layer) prefixes the names its weights
    and output gradients are reported under. Weights all-gathered in FP8 (:class:`coat.nn.FP8Weight`) bring
    their codes and the group's scale: forward reads the codes, backward transposes them.
    ``output_widths``: one fused weight whose row blocks are several projections (Phi-3's qkv_proj and
    gate_up_proj), split into outputs of these widths; the wgrad GEMM's [sum N_i, K] result is then that
    parameter's gradient as it is, and the output gradients' column sums its bias's."""

    def __init__(self, params, name: str = "", output_widths=None):
        self.name = name
        self.weights = [weight for weight, _ in params]
        self.biases = [bias for _, bias in params]
        self.widths = [weight.shape[0] for weight in self.weights]
        self.fused = output_widths is not None
        if self.fused and (len(params) != 1 or sum(output_widths) != self.widths[0]):
            raise ValueError(f"coat: a fused projection is one weight whose rows are outputs of widths "
                             f"{list(output_widths)}, got weights {[tuple(w.shape) for w in self.weights]}")
        self.output_widths = list(output_widths) if self.fused else self.widths
        self.output_biases = self.biases
        if self.fused:
            bias = self.biases[0]
            self.output_biases = [None] * len(output_widths) if bias is None else list(bias.split(output_widths))
        if len({weight.dtype for weight in self.weights}) != 1 or len({w.shape[1] for w in self.weights}) != 1:
            raise ValueError(
                "coat: projections that read one input need weights of one dtype and one input size, got "
                + ", ".join(f"{tuple(w.shape)} {w.dtype}" for w in self.weights)
            )
        # Weights all-gathered in FP8 (coat.distributed.fp8_all_gather) come with their codes and the scale
        # agreed for the whole group; quantizing a group partly here would give it two scales.
        gathered = {isinstance(weight, FP8Weight) for weight in self.weights}
        if len(gathered) != 1:
            raise ValueError("coat: projections that share a weight scale must all be gathered in FP8 or none")
        self.gathered_in_fp8 = gathered == {True}

    def weight_amax(self) -> torch.Tensor:
        return self.weights[0].amax if self.gathered_in_fp8 else ops.tensor_amax(self.weights)

    def report_name(self, tensor: str) -> str:
        return f"{self.name}_{tensor}" if self.name else tensor

    def forward(self, x_q, x_scale, config: FP8Config, out_dtype, weight_amax, site=None) -> list[torch.Tensor]:
        """[x @ W_i^T + b_i for each projection]."""
        w_blocks, w_scale = self._fp8_weights(config.forward_dtype, weight_amax, site)
        return [fp8_gemm(x_q, x_scale, w_i, w_scale, out_dtype, bias, config.fast_accum)
                for w_i, bias in zip(w_blocks, self.output_biases)]

    def forward_joint(self, x_q, x_scale, config: FP8Config, out_dtype, weight_amax, site=None) -> list[torch.Tensor]:
        """:meth:`forward` as one GEMM of a fused weight, its outputs column views of one [M, sum N_i] tensor: for
        outputs that live only until one op has read them (gate and up, read in place by silu_mul_quantize)."""
        if not self.fused:
            raise ValueError("coat: Projections.forward_joint multiplies one fused weight; pass output_widths")
        (w_q,), w_scale = self._fp8_weight_matrices(config.forward_dtype, weight_amax, site)
        out = fp8_gemm(x_q, x_scale, w_q, w_scale, out_dtype, self.biases[0], config.fast_accum)
        return list(out.split(self.output_widths, dim=1))

    def _fp8_weight_matrices(self, fp8, weight_amax, site):
        """Each weight parameter's FP8 matrix and their shared scale: the gathered codes, or the weights
        quantized together here."""
        if self.gathered_in_fp8:  # the high-precision weights are not on this rank: no report of their error
            return [weight.codes for weight in self.weights], self.weights[0].scale
        w_q, w_scale, _ = ops.quantize_tensors(self.weights, fp8, dim=0, amax=weight_amax)
        if site is not None:
            _record_joint(site, self.report_name("weight"), self.weights, w_q, w_scale, None, dim=0)
        return w_q.split(self.widths), w_scale

    def _fp8_weights(self, fp8, weight_amax, site):
        """Each output's [N_i, K] FP8 weight block and their shared scale."""
        matrices, w_scale = self._fp8_weight_matrices(fp8, weight_amax, site)
        return (matrices[0].split(self.output_widths) if self.fused else matrices), w_scale

    def _fp8_weights_transposed(self, fp8, weight_amax):
        """The [K, sum N_i] transposed FP8 weights of the dgrad GEMM and their scale: the gathered codes
        transposed byte by byte, or the weights quantized again, transposed, with the forward's amax."""
        if self.gathered_in_fp8:
            return transposed_codes(self.weights), self.weights[0].scale
        _, w_scale, w_q_t = ops.quantize_tensors(self.weights, fp8, dim=0, amax=weight_amax, rowwise=False,
                                                 columnwise=True)
        return w_q_t, w_scale

    def backward(self, grads, x_q_t, x_scale, weight_amax, needs, config: FP8Config, input_grad_dtype, site=None,
                 grad_amax=None):
        """grads: the [M, N_i] gradients of the outputs (None for an unused output). x_q_t: the transposed FP8
        input the wgrad reads (None when no weight needs a gradient). needs:
        (need_input_grad, [(need_weight_grad, need_bias_grad) per projection]). grad_amax: the gradients'
        joint amax when the op that produced them computed it (else a pass over them computes it). Returns
        the input's gradient ([M, K] in input_grad_dtype, None when not needed) and [grad_w_0, grad_b_0, ...]."""
        need_input_grad, need_param_grads = needs
        rows = _matrix(next(g for g in grads if g is not None)).shape[0]
        grads = [_matrix(g) if g is not None else self.weights[0].new_zeros(rows, width, dtype=input_grad_dtype)
                 for g, width in zip(grads, self.output_widths)]
        need_weight_grads = any(need_weight for need_weight, _ in need_param_grads)
        if config.gradient_dtype is None:
            grad_input, weight_grads = self._backward_unquantized(grads, x_q_t, x_scale, need_input_grad,
                                                                  need_weight_grads, input_grad_dtype)
        else:
            g_q, g_scale, g_q_t = ops.quantize_tensors(grads, config.gradient_dtype, dim=1, amax=grad_amax,
                                                       rowwise=need_input_grad, columnwise=need_weight_grads)
            if site is not None:
                _record_joint(site, self.report_name("grad_output"), grads, g_q, g_scale, g_q_t, dim=1)
            grad_input = weight_grads = None
            if need_input_grad:
                w_q_t, w_scale = self._fp8_weights_transposed(config.forward_dtype, weight_amax)
                grad_input = fp8_gemm(g_q, g_scale, w_q_t, w_scale, input_grad_dtype)
            if need_weight_grads:
                # The contraction dimension is the token count M, which fp8_gemm pads to a multiple of 16.
                weight_grads = fp8_gemm(g_q_t, g_scale, x_q_t, x_scale, self.weights[0].dtype).split(self.widths)
        # Per output, then joined for a fused weight: its bias's gradient, as its weight's, is the joint block.
        bias_grads = [grad.sum(0, dtype=torch.float32) for grad in grads] if any(n for _, n in need_param_grads) else []
        if self.fused and bias_grads:
            bias_grads = [torch.cat(bias_grads)]
        param_grads = []
        for i, (need_weight, need_bias) in enumerate(need_param_grads):
            param_grads.append(weight_grads[i] if need_weight else None)
            param_grads.append(bias_grads[i].to(self.biases[i].dtype) if need_bias else None)
        return grad_input, param_grads

    def _backward_unquantized(self, grads, x_q_t, x_scale, need_input_grad, need_weight_grads, input_grad_dtype):
        """gradient_format=None: dgrad with the BF16 weights, summed in float32 and rounded once; wgrad with
        the dequantized FP8 input (paper appendix G.5)."""
        grad_input = weight_grads = None
        with _no_autocast(grads[0].device):  # a backward() called inside the caller's autocast region
            if need_input_grad:
                blocks = self.weights[0].split(self.output_widths) if self.fused else self.weights
                grad_input = sum(((g @ w.to(g.dtype)).float() for g, w in zip(grads, blocks)))
                grad_input = grad_input.to(input_grad_dtype)
            if need_weight_grads:
                x_t = _dequantized(x_q_t, x_scale, grads[0].dtype)
                dtype = self.weights[0].dtype
                if self.fused:  # one GEMM over the outputs' gradients side by side gives the joint block
                    weight_grads = [(torch.cat(grads, dim=1).t() @ x_t.t()).to(dtype)]
                else:
                    weight_grads = [(g.t() @ x_t.t()).to(dtype) for g in grads]
        return grad_input, weight_grads


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The given rows of t (all when None): what coat.report measures of a tensor."""
    return t if rows is None else t.index_select(0, rows)


def _gated_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) with torch's function for coat.ops.silu_mul_quantize's ``activation``."""
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


def _silu_mul_rows(gate, up, smooth_scale, activation, rows):
    """act(gate) * up (times the Smooth-SwiGLU scale) in float32, for the given rows (all when None)."""
    product = _gated_activation(_rows(gate, rows).float(), activation) * _rows(up, rows)  # up is promoted exactly
    return product if smooth_scale is None else product * smooth_scale


def _record_joint(site, name: str, matrices, q, scale, q_t, dim: int) -> None:
    """Records matrices that :func:`coat.ops.quantize_tensors` quantized together along ``dim``: each
    against its block of the row-wise codes q, or, when only the transposed codes q_t were made, its
    transpose against its block of those."""
    widths = [matrix.shape[dim] for matrix in matrices]
    if q.numel() > 0:
        for matrix, block in zip(matrices, q.split_with_sizes(widths, dim)):
            site.record(name, matrix, block, scale)
    elif q_t is not None and q_t.numel() > 0:
        for matrix, block in zip(matrices, q_t.split_with_sizes(widths, 1 - dim)):
            site.record(name, matrix.t(), block, scale)


def _dequantized(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = ops.dequantize(q, scale, None, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    return out.to(dtype)


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """t as a [rows, last-dim] matrix that coat's ops can read: a view whenever the layout allows (they
    read row-strided matrices in place), a copy otherwise, as for the expanded gradient of a .sum() or a
    transposed input, which torch's own layers accept too."""
    matrix = t.reshape(-1, t.shape[-1])
    if matrix.stride(-1) == 1 and (matrix.shape[0] <= 1 or matrix.stride(0) >= matrix.shape[1]):
        return matrix
    return matrix.contiguous()


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer returns: the autocast dtype inside autocast, the input's dtype otherwise."""
    if _autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


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
        amax = (_gated_activation(gate, activation) * up).abs().amax(dim=0).float()
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


def _swiglu_forward(x_q, x_scale, params, config: FP8Config, out_dtype, keep_for_backward: bool, site=None,
                    activation: str = "silu"):
    """down(act(gate(x)) * up(x)) from an input already in FP8, act = ``activation`` ("silu": SwiGLU,
    "gelu_tanh": GeGLU). params: [(w, b)] for gate, up, down, or for a fused gate_up and down
    (:func:`_gate_up_projections`): then one GEMM writes gate and up side by side, and the fused op reads the two
    halves in place.
    Returns the output and the tensors backward needs: the weights' amax, SiLU*mul's inputs in 1 x G groups
    (in ``config.saved_format`` when ``keep_for_backward``) and the scale of the FP8 product that feeds the
    down projection. The product itself is not saved: backward recomputes its transpose (the down wgrad's
    operand) from the saved inputs.
    gate and up themselves live only until the fused op has read them."""
    gate_up = _gate_up_projections(params)
    gate_up_amax = gate_up.weight_amax()
    gate, up = (gate_up.forward_joint if gate_up.fused else gate_up.forward)(x_q, x_scale, config, out_dtype,
                                                                            gate_up_amax, site)
    smooth_scale = smooth_swiglu_scale(gate, up, activation) if config.smooth_swiglu else None
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
        site.record("gate_output", gate, *_as_e4m3(gate_saved, gate_scales, cols, config), config.group_size,
                    config.saved_format)
        site.record("up_output", up, *_as_e4m3(up_saved, up_scales, cols, config), config.group_size,
                    config.saved_format)
        # The kernel's fp32 product before quantization, recomputed with torch's SiLU (the kernel has its own
        # exp, so a value may differ in its last float32 bit). A partial, not a closure: closing over gate and
        # up would make the `del` below a bytecode torch.compile cannot trace.
        site.record("down_input", functools.partial(_silu_mul_rows, gate, up, smooth_scale, activation), act_q,
                    act_scale)
    del gate, up
    down = Projections([_smoothed_down(params[-1], smooth_scale)], "down")
    down_amax = down.weight_amax()
    (out,) = down.forward(_matrix(act_q), act_scale, config, out_dtype, down_amax, site)
    saved = dict(
        gate_up_amax=gate_up_amax,
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


def _swiglu_backward(grad_out2d, saved: dict, x_q_t, x_scale, params, needs, config: FP8Config, x_dtype, act_dtype,
                     site=None, activation: str = "silu"):
    """Backward of :func:`_swiglu_forward`. needs: (need_input_grad, [(need_w, need_b)] for gate, up, down).
    The gradients of the product and of gate and up are in act_dtype, the dtype the forward computed them
    in (autocast's); the input's gradient is in x_dtype. Returns the input's gradient and [grad_w, grad_b]
    for each of params."""
    need_input_grad, need_param_grads = needs
    smooth_scale = saved["smooth_scale"]
    gate_up = _gate_up_projections(params)
    act_q_t = None
    if _params_need_grad(need_param_grads[-1:]):
        act_q_t = ops.silu_mul_requantize(
            saved["gate_saved"], saved["gate_scales"], saved["up_saved"], saved["up_scales"], smooth_scale,
            saved["act_scale"], config.group_size, config.forward_dtype, saved_format=config.saved_format,
            cols=gate_up.output_widths[0], activation=activation,
        )
    grad_act, down_grads = Projections([_smoothed_down(params[-1], smooth_scale)], "down").backward(
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
    grad_input, gate_up_grads = gate_up.backward(
        [grad_gate, grad_up], x_q_t, x_scale, saved["gate_up_amax"], (need_input_grad, need_param_grads[:-1]), config,
        x_dtype, site, grad_amax,
    )
    return grad_input, gate_up_grads + down_grads


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


class _SwiGLUMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)), LlamaMLP's computation (GemmaMLP's with act gelu_tanh), in FP8. Saves the
    transposed FP8 input (read by both the gate and up wgrads) and its scale, plus what :func:`_swiglu_forward`
    lists."""

    @staticmethod
    @_capture.measures_records
    def forward(ctx, x, config: FP8Config, out_dtype, activation: str, *flat_params):
        params = _pairs(flat_params)
        param_needs = _param_needs(ctx.needs_input_grad, 4, 3)
        site = ctx.report_site = _capture.forward_site()
        x2d = _matrix(x)
        x_q, x_scale, x_q_t = quantize_per_tensor(
            x2d, config.forward_dtype, columnwise=_params_need_grad(param_needs[:2])
        )
        if site is not None:
            site.record("gate_up_input", x2d, x_q, x_scale)
        out, saved = _swiglu_forward(x_q, x_scale, params, config, out_dtype, keep_for_backward=True, site=site,
                                     activation=activation)
        _save(ctx, x_q_t=x_q_t, x_scale=x_scale, **saved, **_named_params(flat_params))
        ctx.config, ctx.x_shape, ctx.x_dtype, ctx.out_dtype = config, x.shape, x.dtype, out_dtype
        ctx.activation = activation
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @_capture.measures_records
    def backward(ctx, grad_out):
        saved = _saved(ctx)
        params = _pairs(_params_from(saved))
        needs = (ctx.needs_input_grad[0], _param_needs(ctx.needs_input_grad, 4, 3))
        grad_x, param_grads = _swiglu_backward(
            _matrix(grad_out), saved, saved["x_q_t"], saved["x_scale"], params, needs, ctx.config, ctx.x_dtype,
            ctx.out_dtype, _capture.backward_site(ctx), ctx.activation,
        )
        return (None if grad_x is None else grad_x.view(ctx.x_shape), None, None, None, *param_grads)


def _named_params(flat_params) -> dict:
    return {f"param_{i}": p for i, p in enumerate(flat_params)}


def _params_from(saved: dict) -> list:
    return [saved[f"param_{i}"] for i in range(sum(name.startswith("param_") for name in saved))]


def swiglu_mlp(x: torch.Tensor, gate, up, down, config: FP8Config = FP8Config(), *,
               activation: str = "silu") -> torch.Tensor:
    """FP8 LlamaMLP, down(act(gate(x)) * up(x)): gate, up, down are (weight, bias) pairs (bias may be None);
    ``activation`` "silu" (SwiGLU) or "gelu_tanh" (GeGLU, as Gemma's MLP)."""
    flat_params = (*gate, *up, *down)
    out_dtype = output_dtype(x)
    _checked_activation(activation, "coat.nn.functional.swiglu_mlp")
    if _needs_autograd(x, *flat_params):
        return _SwiGLUMLPFunction.apply(x, config, out_dtype, activation, *flat_params)
    x_q, x_scale, _ = quantize_per_tensor(_matrix(x), config.forward_dtype)
    out, _ = _swiglu_forward(x_q, x_scale, _pairs(flat_params), config, out_dtype, keep_for_backward=False,
                             activation=activation)
    return out.view(*x.shape[:-1], out.shape[-1])


# The decoder blocks live in coat.nn.blocks, on top of the above; they are part of this module's API.
from coat.nn.blocks import (  # noqa: E402, F401
    after_attention,
    before_attention,
    mlp_residual,
    qk_norm_rotary_embedding,
    rotary_embedding,
)
# The fused LM head + loss, re-exported here with the other functional ops; imported last because it uses this
# module's autocast query.
from coat.nn.cross_entropy import linear_cross_entropy  # noqa: E402, F401
