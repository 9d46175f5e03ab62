"""The LM head and its cross-entropy fused: ``linear_cross_entropy(hidden, weight, labels)`` is
``F.cross_entropy(hidden @ weight.T, labels)`` without ever holding the [tokens, vocab] logits.

Tokens are processed in chunks. Per chunk: the logits ``hidden_chunk @ weight.T`` (one GEMM in the compute dtype,
as nn.Linear under the same autocast would), then coat.ops.cross_entropy, which gives each token's loss and writes
the logits' gradient over them, then ``grad_hidden_chunk = dlogits @ weight`` and ``grad_weight += dlogits.T @
hidden_chunk`` (float32 accumulation). Only one chunk's logits exist at a time: at a Llama-3 vocabulary (128256)
they are the largest tensors of a step otherwise (bf16 logits, their float32 copy in the loss, the softmax and its
gradient: about 26 GiB for 16k tokens).

Two strategies (``strategy``), to be chosen by measurement:
  "forward"   (default) the gradients are computed in the forward and kept until backward, which scales them by
              the incoming grad_output: one logits GEMM per chunk, plus a float32 [V, H] weight gradient and a
              hidden gradient held from forward to backward (Liger-Kernel's choice).
  "recompute" the forward computes only the loss; backward computes each chunk's logits again: two logits GEMMs
              per chunk, nothing but the inputs held between forward and backward.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from coat import ops
from coat._native import check_device_supported
from coat.nn.gemm import _autocast_available

REDUCTIONS = ("mean", "sum")
STRATEGIES = ("forward", "recompute")


class _Options(NamedTuple):
    ignore_index: int
    label_smoothing: float
    softcap: float  # 0.0: none
    z_loss: float
    chunk_size: int
    compute_dtype: torch.dtype


# Logits per chunk: 2^28 (512 MiB in bf16, 2048 tokens at a 128256 vocabulary). Each chunk reads and writes the
# float32 [V, H] weight gradient once more, so fewer, larger chunks move fewer bytes: at 16k tokens x 128256 x 2048,
# 512-token chunks spent about as long on that as on the GEMMs (H200).
CHUNK_LOGITS = 2**28


def default_chunk_size(tokens: int, vocab: int) -> int:
    """Tokens per chunk: the largest power of two whose logits fit in CHUNK_LOGITS (at least 1), or all tokens."""
    per_chunk = 2 ** max(0, math.floor(math.log2(max(1, CHUNK_LOGITS // vocab))))
    return max(1, min(tokens, per_chunk))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits GEMM: the autocast dtype under autocast (as nn.Linear), else the operands'."""
    device_type = hidden.device.type
    if _autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one to "
                         f"the other, or run under torch.autocast, as nn.Linear needs")
    return weight.dtype


def _add_weight_gradient(grad_weight: torch.Tensor | None, dlogits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """grad_weight + dlogits.T @ hidden in float32. On GPUs one GEMM accumulates into the float32 sum in place
    (addmm with out_dtype); elsewhere the chunk's product in the compute dtype is added into it."""
    if dlogits.dtype == torch.float32:
        return dlogits.T @ hidden if grad_weight is None else grad_weight.addmm_(dlogits.T, hidden)
    if dlogits.is_cuda:
        if grad_weight is None:
            return torch.mm(dlogits.T, hidden, out_dtype=torch.float32)
        return torch.addmm(grad_weight, dlogits.T, hidden, out_dtype=torch.float32, out=grad_weight)
    partial = (dlogits.T @ hidden).float()
    return partial if grad_weight is None else grad_weight.add_(partial)


@torch.library.custom_op("coat::linear_cross_entropy_chunks", mutates_args=())
def _linear_cross_entropy_chunks(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    grad_scale: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float, z_loss: float,
    chunk_size: int, compute_dtype: torch.dtype, want_hidden: bool, want_weight: bool, want_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk loop as one op, so that torch.compile does not trace into it: dynamo cannot trace the in-place
    float32 accumulation (addmm with out_dtype and out=, torch 2.11: "unsupported operand type(s) for *:
    'torch.dtype' and 'FakeTensor'"), Liger-Kernel's compile failure. Returns the loss sum and the gradients,
    each an empty tensor where not wanted (an op's outputs are tensors); without grad_scale none is."""
    want_hidden, want_weight, want_bias = (grad_scale is not None and want for want in (want_hidden, want_weight,
                                                                                         want_bias))
    weight_c = weight.to(compute_dtype)
    bias_c = None if bias is None else bias.to(compute_dtype)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if want_hidden else hidden.new_empty(0)
    grad_weight = None
    grad_bias = hidden.new_zeros(weight.shape[0], dtype=torch.float32) if want_bias else hidden.new_empty(0)
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        hidden_c = hidden[start:end].to(compute_dtype)
        logits = F.linear(hidden_c, weight_c, bias_c)
        loss, _ = torch.ops.coat.cross_entropy(
            logits, labels[start:end], grad_scale, ignore_index, label_smoothing, softcap, z_loss
        )
        loss_sum += loss.sum()
        if grad_scale is None:
            continue
        dlogits = logits  # the kernel wrote the gradient over the logits
        if want_hidden:
            grad_hidden[start:end] = dlogits @ weight_c
        if want_weight:
            grad_weight = _add_weight_gradient(grad_weight, dlogits, hidden_c)
        if want_bias:
            grad_bias += dlogits.sum(0, dtype=torch.float32)
    if grad_weight is None:  # not wanted, or no tokens
        grad_weight = hidden.new_zeros(weight.shape, dtype=torch.float32) if want_weight else hidden.new_empty(0)
    return loss_sum, grad_hidden, grad_weight, grad_bias


@_linear_cross_entropy_chunks.register_fake
def _(hidden, weight, bias, labels, grad_scale, ignore_index, label_smoothing, softcap, z_loss, chunk_size,
      compute_dtype, want_hidden, want_weight, want_bias):
    want_hidden, want_weight, want_bias = (grad_scale is not None and want for want in (want_hidden, want_weight,
                                                                                         want_bias))
    return (
        hidden.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden) if want_hidden else hidden.new_empty(0),
        hidden.new_empty(weight.shape, dtype=torch.float32) if want_weight else hidden.new_empty(0),
        hidden.new_empty(weight.shape[0], dtype=torch.float32) if want_bias else hidden.new_empty(0),
    )


def _chunked_loss(hidden, weight, bias, labels, grad_scale, o: _Options, needs_grad):
    """Sum of the token losses over every chunk and, when grad_scale is given (the gradient's scale per token),
    the gradients (hidden [N, H] in hidden's dtype, weight and bias in float32) for the inputs needs_grad names,
    None for the others."""
    wanted = [grad_scale is not None and need for need in needs_grad]
    loss_sum, *grads = _linear_cross_entropy_chunks(
        hidden, weight, bias, labels, grad_scale, o.ignore_index, o.label_smoothing, o.softcap, o.z_loss,
        o.chunk_size, o.compute_dtype, *wanted,
    )
    return loss_sum, *(grad if want else None for grad, want in zip(grads, wanted))


def _scaled(grad: torch.Tensor | None, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """grad * scale in dtype, scaled in place: grad is this function's own buffer, and a float32 [V, H] copy would
    add to the step's peak, which falls at the start of backward."""
    return None if grad is None else grad.mul_(scale).to(dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """loss = sum of the chunks' token losses / denominator; see the module docstring for the two strategies."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denominator, recompute, ignore_index, label_smoothing, softcap,
                z_loss, chunk_size, compute_dtype):
        o = _Options(ignore_index, label_smoothing, softcap, z_loss, chunk_size, compute_dtype)
        needs_grad = ctx.needs_input_grad[:3]
        ctx.recompute, ctx.options, ctx.needs_grad, ctx.backward_done = recompute, o, needs_grad, False
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        if recompute:
            loss_sum, *_ = _chunked_loss(hidden, weight, bias, labels, None, o, needs_grad)
            ctx.save_for_backward(hidden, weight, bias, labels, denominator)
        else:
            grad_scale = denominator.reciprocal().reshape(1)
            loss_sum, *grads = _chunked_loss(hidden, weight, bias, labels, grad_scale, o, needs_grad)
            ctx.save_for_backward(*grads)
        return loss_sum / denominator

    @staticmethod
    def backward(ctx, grad_output):
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        if ctx.recompute:
            hidden, weight, bias, labels, denominator = ctx.saved_tensors
            grad_scale = (grad_output.float() / denominator).reshape(1)
            _, grad_hidden, grad_weight, grad_bias = _chunked_loss(
                hidden, weight, bias, labels, grad_scale, ctx.options, ctx.needs_grad
            )
            scale = grad_output.new_ones((), dtype=torch.float32)
        else:
            if ctx.backward_done:
                raise RuntimeError(
                    "coat.nn.functional.linear_cross_entropy: backward ran twice through one forward (retain_graph); "
                    "strategy='forward' hands its gradients out once, use strategy='recompute' for that"
                )
            ctx.backward_done = True
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            scale = grad_output.float()
        return (
            _scaled(grad_hidden, scale, hidden_dtype),
            _scaled(grad_weight, scale, weight_dtype),
            _scaled(grad_bias, scale, bias_dtype),
            *(None,) * 9,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    strategy: str = "forward",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ...)`` plus the optional soft-capping and
    z-loss, computed in chunks of tokens so that the [tokens, vocab] logits never exist (see the module docstring).
    Returns a 0-d float32 loss; gradients flow to hidden, weight (a tied embedding included) and bias.

    hidden: [..., H]; weight: [V, H] (an nn.Linear's, or the embedding's when tied); labels: int64 of hidden's
    shape without H, already aligned with hidden (shift them first for a causal LM). The logits GEMM runs in the
    autocast dtype under torch.autocast, else in the operands' dtype (which must then agree); the weight gradient
    is accumulated over chunks in float32 and returned in weight's dtype.

    Per token (formulas in :func:`coat.ops.cross_entropy`): z' = softcap * tanh(z / softcap) when softcap is given,
    loss = (1 - eps) (lse - z'_y) + eps (lse - mean z') + z_loss * lse**2 with eps = label_smoothing (torch's
    definition). Tokens labelled ignore_index contribute nothing.

    reduction: "sum" of the token losses, or "mean": the sum divided by the number of tokens not ignored, or by
    num_items_in_batch when given (transformers' gradient accumulation: the tokens of every micro-batch of the
    step). The divisor is at least 1, so a batch whose tokens are all ignored gives loss 0 and zero gradients
    (torch's mean gives NaN there; transformers with num_items_in_batch gives 0).
    chunk_size: tokens per chunk (default :func:`default_chunk_size`). strategy: "forward" or "recompute".
    A label outside [0, V) that is not ignore_index raises a ValueError in eager mode (one device synchronization);
    under torch.compile it makes the loss NaN.
    """
    op = "coat.nn.functional.linear_cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r} (for per-token losses use "
                         f"coat.ops.cross_entropy on the logits)")
    if strategy not in STRATEGIES:
        raise ValueError(f"{op}: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"{op}: num_items_in_batch divides the summed loss, so it needs reduction='mean'")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden must be [..., H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{op}: labels must have hidden's shape without its last dimension, {tuple(hidden.shape[:-1])},"
                         f" got {tuple(labels.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive number of tokens, got {chunk_size}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be > 0 (or None for none), got {softcap}")
    if z_loss < 0:
        raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss}")
    check_device_supported(hidden, op)
    labels = labels.reshape(-1).to(hidden.device)
    ops.check_labels(labels, weight.shape[0], ignore_index, op)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    tokens = hidden.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(tokens, weight.shape[0])

    if reduction == "sum":
        denominator = hidden.new_ones((), dtype=torch.float32)
    elif num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).float().clamp_min(1.0)
    else:
        denominator = (labels != ignore_index).sum().float().clamp_min(1.0)
    return _LinearCrossEntropy.apply(
        hidden, weight, bias, labels.contiguous(), denominator, strategy == "recompute", ignore_index,
        float(label_smoothing), 0.0 if softcap is None else float(softcap), float(z_loss), chunk_size,
        _compute_dtype(hidden, weight),
    )
