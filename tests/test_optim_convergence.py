"""Convergence: a tiny Llama trained on real text (the standard library's sources, byte tokens) with
coat.optim.AdamW ends where torch.optim.AdamW ends, from the same initialisation and the same batches."""
from __future__ import annotations

import math

import pytest
import torch

from coat.data import stdlib_tokens
from coat.optim import AdamW
from optim_helpers import one_thread, text_batches, tiny_llama  # noqa: F401 (one_thread: an autouse fixture)

pytestmark = pytest.mark.transformers  # .ci/run runs these against the newest supported release too

STEPS, BATCH, CONTEXT = 200, 16, 64


def train_and_evaluate(make_optimizer) -> float:
    """Held-out loss after STEPS steps of warm-up then cosine decay."""
    tokens = stdlib_tokens(1_000_000)
    train_batches = text_batches(tokens[:900_000], STEPS, BATCH, CONTEXT, seed=1)
    held_out = text_batches(tokens[900_000:], 8, BATCH, CONTEXT, seed=99)
    model = tiny_llama(seed=0, hidden=96, intermediate=192)
    opt = make_optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / STEPS))
    )
    for batch in train_batches:
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
    with torch.no_grad():
        return sum(model(input_ids=batch, labels=batch).loss.item() for batch in held_out) / len(held_out)


def test_coat_adamw_converges_like_torch_adamw():
    options = dict(lr=3e-3, weight_decay=0.1)
    torch_loss = train_and_evaluate(lambda params: torch.optim.AdamW(params, **options))
    coat_loss = train_and_evaluate(lambda params: AdamW(params, **options))
    print(f"held-out loss after {STEPS} steps: torch.optim.AdamW {torch_loss:.4f}, coat.optim.AdamW {coat_loss:.4f}")
    # Both learn (a uniform guess over bytes scores ln 256 = 5.55).
    assert torch_loss < 2.6 and coat_loss < 2.6
    # The bound is the noise of this small run, measured: the order of the batches alone moves torch's final
    # loss by 0.7%, and the valid FP8 variants of coat (E5M2 moments, G = 32, no expansion) land 0.0% to
    # 1.3% from torch (the default: 0.04%). The paper's largest gap to BF16, at scale, is 0.7% (OLMo-1B).
    # 2% fails an optimizer that does not track AdamW; the exact update rule is pinned by test_optim_adamw.
    assert abs(coat_loss - torch_loss) / torch_loss < 0.02
