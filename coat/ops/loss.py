"""Softmax cross-entropy with its gradient written over the logits, the loss of coat.nn's fused LM head
(csrc/include/coat/cross_entropy.h states the formulas)."""
from __future__ import annotations

import torch

from coat._native import check_device_supported

__all__ = ["CROSS_ENTROPY_MAX_V", "check_labels", "cross_entropy"]

CROSS_ENTROPY_MAX_V = 1073741824


def check_labels(labels: torch.Tensor, vocab: int, ignore_index: int, op: str) -> None:
    """Refuses labels outside [0, vocab) that are not ignore_index, naming the first. It reads the labels (one
    device synchronization on a GPU), so it runs in eager mode only; under torch.compile such a label gives its
    row NaN loss and gradient instead."""
    if torch.compiler.is_compiling():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = labels[bad][0].item()
        raise ValueError(f"{op}: label {first} is outside the vocabulary [0, {vocab}) and is not ignore_index "
                         f"({ignore_index}); fix the labels or pass the ignore_index they use")


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token softmax cross-entropy over the last dimension of ``logits``, and, with ``grad_scale``, its
    gradient written over ``logits`` (which saves a tensor of the logits' size). Per row z with label y::

        z'    = softcap * tanh(z / softcap)         (soft-capping, when softcap is given; else z' = z)
        lse   = log sum_j exp(z'_j)
        loss  = (1 - eps) (lse - z'_y) + eps (lse - mean_j z'_j) + z_loss * lse**2
        dz    = grad_scale * (softmax(z') (1 + 2 z_loss lse) - (1 - eps) onehot(y) - eps / V) * (1 - (z'/softcap)**2)

    eps = label_smoothing; the loss is torch.nn.functional.cross_entropy(..., reduction="none",
    label_smoothing=eps) plus the z-loss. Rows labelled ``ignore_index`` get loss 0 and a zero gradient (their
    lse is still given). Returns float32 ``(loss, lse)`` of labels' shape.

    logits: float32, bfloat16 or float16 [..., V], last dimension contiguous, 1 <= V <= 2**30; labels: int64 of
    logits' shape without V, contiguous. A label outside [0, V) that is not ignore_index raises a ValueError (in
    eager mode; see :func:`check_labels`). grad_scale: None (logits are only read), or float32 holding one scale
    for every row or one per row, e.g. ``grad_output / n_tokens`` for a mean. NaN and Inf logits follow the
    formula (csrc/include/coat/cross_entropy.h). The CPU core reduces each row in double, the CUDA kernel in
    float32; they agree within float32 rounding, not bit for bit.
    """
    check_device_supported(logits, "coat.ops.cross_entropy")
    check_labels(labels, logits.shape[-1], ignore_index, "coat.ops.cross_entropy")
    return torch.ops.coat.cross_entropy(
        logits, labels, grad_scale, ignore_index, label_smoothing, 0.0 if softcap is None else softcap, z_loss
    )


@torch.library.register_fake("coat::cross_entropy")
def _cross_entropy_fake(logits, labels, grad_scale, ignore_index, label_smoothing, softcap, z_loss):
    op = "coat.cross_entropy"
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise RuntimeError(f"{op}: labels must have the shape of logits without its last dimension, "
                           f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    if labels.dtype != torch.long:
        raise RuntimeError(f"{op}: labels must be int64 (torch.long), got {labels.dtype}; convert them with .long()")
    return labels.new_empty(labels.shape, dtype=torch.float32), labels.new_empty(labels.shape, dtype=torch.float32)
