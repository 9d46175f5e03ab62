"""float64 oracle of coat's softmax cross-entropy (coat.ops.cross_entropy, csrc/include/coat/cross_entropy.h),
written from the formulas, not from the kernels. Per row z of V logits with label y:

    z'   = cap * tanh(z / cap)   (soft-capping; z' = z without a cap)
    lse  = log sum_j exp(z'_j)
    loss = (1 - eps) (lse - z'_y) + eps (lse - mean_j z'_j) + zloss lse^2
    dz   = scale * (softmax(z') (1 + 2 zloss lse) - (1 - eps) onehot(y) - eps / V) * (1 - (z' / cap)^2)

Rows labelled ignore_index: loss 0, gradient 0, lse as any row's. The smoothing and z-loss terms are left out
when eps or zloss is 0 (so they never make 0 * Inf = NaN).
"""
from __future__ import annotations

import torch


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0, grad_scale=1.0):
    """(loss, lse, gradient) in float64 for logits [N, V] and labels [N]; grad_scale a number or [N]."""
    z = logits.double()
    capped = z if softcap is None else softcap * torch.tanh(z / softcap)
    vocab = z.shape[-1]
    lse = torch.logsumexp(capped, dim=-1)
    ignored = labels == ignore_index
    safe_labels = torch.where(ignored, 0, labels)
    label_logit = capped.gather(-1, safe_labels[:, None])[:, 0]
    eps = label_smoothing
    loss = (1 - eps) * (lse - label_logit)
    if eps:  # a term that is off adds nothing, not 0 * Inf
        loss = loss + eps * (lse - capped.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse**2
    loss = torch.where(ignored, 0.0, loss)

    probability = torch.exp(capped - lse[:, None])
    onehot = torch.nn.functional.one_hot(safe_labels, vocab).double()
    grad = probability * (1 + 2 * z_loss * lse[:, None]) - (1 - eps) * onehot - eps / vocab
    if softcap is not None:
        grad = grad * (1 - (capped / softcap) ** 2)
    scale = torch.as_tensor(grad_scale, dtype=torch.float64).reshape(-1, 1)
    grad = torch.where(ignored[:, None], 0.0, grad * scale)
    return loss, lse, grad


def linear_cross_entropy(hidden, weight, labels, *, bias=None, reduction="mean", num_items_in_batch=None, **options):
    """The unfused reference in float64: logits = hidden @ weight.T + bias, the oracle's token losses, reduced
    (mean over the tokens not ignored, or over num_items_in_batch; divisor at least 1)."""
    logits = hidden.double().reshape(-1, hidden.shape[-1]) @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    loss, _, _ = cross_entropy(logits, labels.reshape(-1), **options)
    if reduction == "sum":
        return loss.sum()
    ignore_index = options.get("ignore_index", -100)
    count = (labels != ignore_index).sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return loss.sum() / count.double().clamp_min(1)
