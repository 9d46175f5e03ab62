"""The FP8 GEMM and what every coat layer builds on it: per-tensor FP8 of a matrix, :class:`Projections` (the
linear layers that read one FP8 input, with their backward), the dtype a layer returns, and the queries that keep
torch's autocast out of coat's own arithmetic. The public names are re-exported by :mod:`coat.nn.functional`.

The shapes torch._scaled_mm accepts on GPUs are: A row-major, B column-major, the contraction dimension K
and the output width N multiples of 16. :func:`fp8_gemm` zero-pads K and N to the next multiple of 16
(zeros add nothing to a dot product, and the padded output columns are dropped), so any shape works and the
padding costs one copy of the operands only for shapes that need it. Where there are no FP8 GEMMs (CUDA
GPUs before compute capability 8.9, and CPUs) it multiplies the FP8 values in float32 instead and applies
both scales after, which computes the same products. torch's CPU torch._scaled_mm is not used: on torch
2.11 it took 603 ms for one 512 x 512 x 512 product on 16 threads (7 s on one), against 11 ms on torch 2.13
and 5-9 ms for the float32 matmul.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from coat import ops
from coat.nn.config import FP8Config
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
    has a CPU implementation (not used, see :mod:`coat.nn.gemm`); torch.nn.functional.scaled_mm, its public
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

