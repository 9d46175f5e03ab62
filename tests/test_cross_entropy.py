"""coat.ops.cross_entropy (csrc/include/coat/cross_entropy.h) and the fused LM head + loss
coat.nn.functional.linear_cross_entropy (coat/nn/cross_entropy.py).

What is checked, and against what:
- The op against the float64 oracle of tests/reference_cross_entropy.py (written from the formulas), for float32,
  bfloat16 and float16 logits and every option: the error of loss and gradient is at most 2x that of PyTorch's
  eager computation on the same logits in their dtype (F.cross_entropy and autograd, with soft-capping and z-loss
  written out), plus a floor of float32 rounding where PyTorch happens to be exact.
- Special values against the oracle (NaN where it is NaN, Inf where it is Inf), ignored rows, invalid labels,
  vocabularies not a multiple of the vector width, V = 1; errors; opcheck.
- The fused function against the unfused computation (F.linear, then F.cross_entropy in float32, or the float64
  oracle through autograd for soft-capping and z-loss): loss and the gradients of hidden, weight and bias, for
  both strategies, chunk sizes that do not divide the tokens, tied weights, num_items_in_batch, autocast with
  float32 master weights, all-ignored batches, torch.compile(fullgraph=True).
- CUDA (skipped without a GPU): the kernel against the C core within float32 rounding (the GPU's expf/logf are not
  the CPU's exp/log, so not bit for bit: loss and lse within 1e-5 relative + 1e-5 absolute; 16-bit gradients
  within one unit in the last place plus 1e-7, float32 ones within 2e-5 relative plus four units in the last place
  of the row's scale, where the label's p - 1 cancels), both load paths (aligned rows
  and rows an odd number of elements apart), a 128256 vocabulary, and identical bits run to run.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coat
import reference_cross_entropy as ref
from coat.nn.cross_entropy import default_chunk_size
from coat.nn.functional import linear_cross_entropy

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 3.0},
    "z_loss": {"z_loss": 1e-2},
    "all": {"label_smoothing": 0.2, "softcap": 5.0, "z_loss": 1e-3},
}


def random_problem(rows, vocab, dtype, rng, scale=3.0, ignored_every=4):
    logits = (torch.randn(rows, vocab, generator=rng, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=rng)
    labels[::ignored_every] = -100
    return logits, labels


def strided_copy(t, device="cpu"):
    """A copy of t on device with t's strides (clone and .to make a strided view contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


def coat_op(logits, labels, grad_scale=None, **options):
    """(loss, lse, gradient) from coat's op; the gradient is what it wrote over a copy of the logits (same strides)."""
    buffer = strided_copy(logits)
    loss, lse = coat.ops.cross_entropy(buffer, labels, grad_scale=grad_scale, **options)
    return loss, lse, buffer


def torch_eager(logits, labels, ignore_index=-100, label_smoothing=0.0, softcap=None, z_loss=0.0):
    """PyTorch's computation in the logits' dtype: (per-token loss, gradient of the summed loss)."""
    z = logits.clone().requires_grad_()
    capped = z if softcap is None else softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(capped, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    if z_loss:
        loss = loss + torch.where(labels == ignore_index, 0.0, z_loss * torch.logsumexp(capped, -1) ** 2)
    loss.sum().backward()
    return loss.detach(), z.grad


def max_error(actual, expected):
    return (actual.double() - expected.double()).abs().max().item()


# ----------------------------------------------------------------------------------------------------
# the op


@pytest.mark.parametrize("vocab", [1, 7, 129, 1000, 4099])
@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_op_within_twice_torchs_error(dtype, options, vocab, rng):
    """loss and gradient: error vs the float64 oracle at most 2x PyTorch's on the same logits (CPU core)."""
    kw = OPTIONS[options]
    logits, labels = random_problem(33, vocab, dtype, rng)
    loss, lse, grad = coat_op(logits, labels, grad_scale=torch.ones(1), **kw)
    want_loss, want_lse, want_grad = ref.cross_entropy(logits, labels, **kw)
    torch_loss, torch_grad = torch_eager(logits, labels, **kw)
    assert loss.dtype == lse.dtype == torch.float32 and grad.dtype == dtype
    assert max_error(loss, want_loss) <= 2 * max_error(torch_loss, want_loss) + 2e-6 * (1 + want_loss.abs().max())
    assert max_error(grad, want_grad) <= 2 * max_error(torch_grad, want_grad) + 1e-7
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    ignored = labels == -100
    assert (loss[ignored] == 0).all() and (grad[ignored] == 0).all()


def test_op_grad_scale_per_row_and_global(rng):
    logits, labels = random_problem(9, 50, torch.float32, rng)
    per_row = torch.rand(9, generator=rng) + 0.5
    for scale in (per_row, torch.tensor([0.25])):
        _, _, grad = coat_op(logits, labels, grad_scale=scale)
        _, _, want = ref.cross_entropy(logits, labels, grad_scale=scale)
        torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-7)


def test_op_reads_logits_only_without_grad_scale(rng):
    logits, labels = random_problem(5, 20, torch.bfloat16, rng)
    buffer = logits.clone()
    coat.ops.cross_entropy(buffer, labels)
    assert torch.equal(buffer, logits)


def test_op_leading_dims_and_strided_rows(rng):
    """[B, S, V] logits, and rows that are a column slice of a wider buffer (row stride > V)."""
    wide, labels = random_problem(12, 40, torch.bfloat16, rng)
    logits = wide[:, :33]
    labels = labels.clamp(max=32).where(labels >= 0, -100)
    loss, lse, _ = coat_op(logits.reshape(3, 4, 33), labels.reshape(3, 4))
    want_loss, want_lse, _ = ref.cross_entropy(logits, labels)
    assert loss.shape == (3, 4)
    torch.testing.assert_close(loss.reshape(-1).double(), want_loss, rtol=1e-6, atol=1e-6)
    buffer = wide.clone()
    coat.ops.cross_entropy(buffer[:, :33], labels, grad_scale=torch.ones(1))
    assert torch.equal(buffer[:, 33:], wide[:, 33:]), "the gradient was written past the row"


SPECIAL = {
    "huge": lambda z: z * 1e4,
    "tiny": lambda z: z * 1e-30,
    "plus_inf": lambda z: z.index_fill(1, torch.tensor([3]), float("inf")),
    "minus_inf": lambda z: z.index_fill(1, torch.tensor([0, 3]), float("-inf")),
    "all_minus_inf": lambda z: torch.full_like(z, float("-inf")),
    "nan": lambda z: z.index_fill(1, torch.tensor([5]), float("nan")),
}


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("case", list(SPECIAL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_op_special_values_follow_the_formula(dtype, case, options, rng):
    """NaN, Inf and extreme logits give what the oracle's float64 formula gives (torch.logsumexp's convention for
    an infinite max): NaN where it is NaN, the same Inf, close finite values."""
    kw = OPTIONS[options]
    logits, labels = random_problem(8, 37, torch.float64, rng, ignored_every=5)
    logits = SPECIAL[case](logits).to(dtype)
    labels[1] = 3  # on the +-Inf column
    loss, lse, grad = coat_op(logits, labels, grad_scale=torch.ones(1), **kw)
    want_loss, want_lse, want_grad = ref.cross_entropy(logits, labels, **kw)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5, equal_nan=True)
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(grad.double(), want_grad, rtol=tolerance, atol=1e-7, equal_nan=True)
    assert (loss[labels == -100] == 0).all() and (grad[labels == -100] == 0).all(), "ignored rows stay zero"


def test_op_invalid_label_raises_eagerly_and_gives_nan_in_the_raw_op(rng):
    logits, labels = random_problem(4, 10, torch.float32, rng)
    labels[2] = 10
    with pytest.raises(ValueError, match="label 10 is outside the vocabulary"):
        coat.ops.cross_entropy(logits, labels)
    loss, _ = torch.ops.coat.cross_entropy(logits.clone(), labels, None, -100, 0.0, 0.0, 0.0)
    assert loss[2].isnan() and not loss[[0, 1, 3]].isnan().any()
    buffer = logits.clone()
    torch.ops.coat.cross_entropy(buffer, labels, torch.ones(1), -100, 0.0, 0.0, 0.0)
    assert buffer[2].isnan().all() and not buffer[[0, 1, 3]].isnan().any()
    labels[2] = -1
    with pytest.raises(ValueError, match="label -1"):
        coat.ops.cross_entropy(logits, labels)
    labels[labels == -100] = 0
    coat.ops.cross_entropy(logits, labels, ignore_index=-1)  # -1 is fine when it is the ignore_index


@pytest.mark.parametrize(
    "case, match",
    [
        (lambda z, y: (z.long(), y, {}), "float32, bfloat16 or float16"),
        (lambda z, y: (z, y.int(), {}), "int64"),
        (lambda z, y: (z, y[:-1], {}), "shape of logits"),
        (lambda z, y: (z.T.contiguous().T, y, {}), "contiguous"),
        (lambda z, y: (z, y.repeat_interleave(2)[::2], {}), "labels must be contiguous"),
        (lambda z, y: (z, y, {"grad_scale": torch.ones(3)}), "grad_scale must be"),
        (lambda z, y: (z, y, {"grad_scale": torch.ones(1, dtype=torch.float64)}), "grad_scale must be float32"),
        (lambda z, y: (z, y, {"label_smoothing": 1.5}), "label_smoothing"),
        (lambda z, y: (z, y, {"softcap": -1.0}), "softcap"),
        (lambda z, y: (z, y, {"z_loss": -1.0}), "z_loss"),
    ],
)
def test_op_refuses_bad_input(case, match, rng):
    logits, labels = random_problem(6, 10, torch.float32, rng)
    logits, labels, kw = case(logits, labels)
    with pytest.raises((RuntimeError, ValueError), match=match):
        coat.ops.cross_entropy(logits, labels, **kw)


@pytest.mark.parametrize("with_grads", [False, True])
def test_chunk_loop_op_opcheck(device, with_grads, rng):
    """The chunk loop op (coat::linear_cross_entropy_chunks) and its fake agree, with and without gradients."""
    from coat.nn.cross_entropy import _linear_cross_entropy_chunks

    hidden, weight = (torch.randn(n, 8, generator=rng).to(device) for n in (11, 30))
    bias = torch.randn(30, generator=rng).to(device)
    labels = torch.randint(0, 30, (11,), generator=rng).to(device)
    grad_scale = torch.full((1,), 0.1, device=device) if with_grads else None
    torch.library.opcheck(_linear_cross_entropy_chunks, (hidden, weight, bias, labels, grad_scale, -100, 0.0, 0.0,
                                                         0.0, 4, torch.float32, True, True, True))


def test_op_opcheck(rng):
    logits, labels = random_problem(6, 21, torch.bfloat16, rng)
    for grad_scale in (None, torch.ones(1), torch.rand(6, generator=rng)):
        torch.library.opcheck(torch.ops.coat.cross_entropy, (logits.clone(), labels, grad_scale, -100, 0.1, 4.0, 1e-3))


# ----------------------------------------------------------------------------------------------------
# the op on CUDA against the C core


@pytest.mark.parametrize("layout", ["contiguous", "odd_row_stride"])
@pytest.mark.parametrize("vocab", [1, 5, 1000, 128256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_cuda_matches_cpu_core(cuda_device, dtype, vocab, layout, rng):
    """Both load paths: 16-byte words where rows are aligned (contiguous, V a multiple of 8), elements otherwise
    (V = 1, 5, or rows 2 * vocab + 1 elements apart, the gradient written in place there)."""
    rows = 64 if vocab < 100000 else 8
    wide, labels = random_problem(rows, 2 * vocab + 1, dtype, rng)
    logits = wide[:, :vocab] if layout == "odd_row_stride" else wide[:, :vocab].contiguous()
    labels = torch.where(labels >= vocab, labels % vocab, labels)
    scale = torch.rand(rows, generator=rng) + 0.5
    # float32: the lse's float32 error (about 1e-6) carried into every probability; 16-bit: one unit in the last
    # place of the stored gradient, where the two round from slightly different float32 values.
    rtol = {torch.float32: 2e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    # The label's element p - (1 - eps) cancels: its absolute error is a few units in the last place of 1, times
    # the row's scale, however small the result.
    atol = 4 * torch.finfo(torch.float32).eps * float(scale.max()) if dtype == torch.float32 else 1e-7
    for kw in OPTIONS.values():
        cpu = coat_op(logits, labels, grad_scale=scale, **kw)
        runs = []
        for _ in range(2):
            buffer = strided_copy(logits, "cuda")
            loss, lse = coat.ops.cross_entropy(buffer, labels.cuda(), grad_scale=scale.cuda(), **kw)
            runs.append((loss.cpu(), lse.cpu(), buffer.cpu()))
        for a, b in zip(*runs):
            assert torch.equal(a, b), "two runs on one GPU differ"
        loss, lse, grad = runs[0]
        torch.testing.assert_close(loss, cpu[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, cpu[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, cpu[2], rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", list(SPECIAL))
def test_cuda_special_values_match_cpu_core(cuda_device, case, rng):
    logits, labels = random_problem(8, 1037, torch.float64, rng, ignored_every=5)
    logits = SPECIAL[case](logits).to(torch.bfloat16)
    labels[1] = 3
    for kw in OPTIONS.values():
        cpu = coat_op(logits, labels, grad_scale=torch.ones(1), **kw)
        buffer = logits.cuda()
        gpu = (*coat.ops.cross_entropy(buffer, labels.cuda(), grad_scale=torch.ones(1, device="cuda"), **kw), buffer)
        for a, b in zip(gpu, cpu):
            torch.testing.assert_close(a.cpu(), b, rtol=2**-7, atol=1e-5, equal_nan=True)


# ----------------------------------------------------------------------------------------------------
# the fused function


def fused_and_unfused(device, hidden, weight, labels, bias=None, loss_scale=1.0, **kw):
    """((loss, grads), (loss, grads)) of linear_cross_entropy and of F.linear + F.cross_entropy in float32."""
    leaves = [t.to(device).requires_grad_() for t in (hidden, weight) + (() if bias is None else (bias,))]
    labels = labels.to(device)

    def grads(loss):
        return loss.detach().cpu(), [g.cpu() for g in torch.autograd.grad(loss * loss_scale, leaves)]

    fused = grads(linear_cross_entropy(leaves[0], leaves[1], labels, bias=None if bias is None else leaves[2], **kw))
    reduction = kw.get("reduction", "mean")
    num_items = kw.get("num_items_in_batch")
    logits = F.linear(*leaves).float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           label_smoothing=kw.get("label_smoothing", 0.0),
                           reduction="sum" if num_items is not None else reduction)
    return fused, grads(loss if num_items is None else loss / num_items)


def assert_close_results(fused, unfused, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(fused[0], unfused[0], rtol=rtol, atol=atol)
    for got, want in zip(fused[1], unfused[1]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64, 1000])
def test_fused_matches_unfused(device, strategy, chunk_size, rng):
    hidden = torch.randn(2, 19, 16, generator=rng)
    weight = torch.randn(97, 16, generator=rng) * 0.3
    bias = torch.randn(97, generator=rng)
    labels = torch.randint(0, 97, (2, 19), generator=rng)
    labels[:, -3:] = -100
    for kw in ({}, {"reduction": "sum"}, {"label_smoothing": 0.1}):
        fused, unfused = fused_and_unfused(device, hidden, weight, labels, bias, loss_scale=2.5, chunk_size=chunk_size,
                                           strategy=strategy, **kw)
        assert_close_results(fused, unfused)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_fused_num_items_in_batch(device, strategy, rng):
    """transformers' gradient accumulation: the summed loss over num_items_in_batch (int or tensor)."""
    hidden, weight = torch.randn(30, 8, generator=rng), torch.randn(40, 8, generator=rng)
    labels = torch.randint(0, 40, (30,), generator=rng)
    labels[:10] = -100
    for num_items in (57, torch.tensor(57)):
        fused, unfused = fused_and_unfused(device, hidden, weight, labels, num_items_in_batch=num_items,
                                           strategy=strategy, chunk_size=8)
        assert_close_results(fused, unfused)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_fused_softcap_and_z_loss_against_oracle(device, strategy, rng):
    hidden, weight = torch.randn(25, 12, generator=rng, dtype=torch.float64), torch.randn(33, 12, generator=rng,
                                                                                          dtype=torch.float64)
    labels = torch.randint(0, 33, (25,), generator=rng)
    labels[3] = -100
    kw = {"softcap": 4.0, "z_loss": 1e-2, "label_smoothing": 0.05}
    leaves = [t.float().to(device).requires_grad_() for t in (hidden, weight)]
    loss = linear_cross_entropy(*leaves, labels.to(device), chunk_size=6, strategy=strategy, **kw)
    grads = torch.autograd.grad(loss, leaves)
    exact = [t.clone().requires_grad_() for t in (hidden, weight)]
    want = ref.linear_cross_entropy(*exact, labels, **kw)
    want_grads = torch.autograd.grad(want, exact)
    torch.testing.assert_close(loss.cpu().double(), want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_fused_tied_embedding(device, strategy, rng):
    """The head's weight is the embedding's Parameter: its gradient is the sum of both uses, through autograd."""
    embedding = torch.nn.Embedding(50, 16).to(device)
    tokens = torch.randint(0, 50, (3, 11), generator=rng).to(device)
    labels = torch.randint(0, 50, (3, 11), generator=rng).to(device)

    def gradient(fused):
        embedding.zero_grad()
        hidden = torch.tanh(embedding(tokens))
        if fused:
            loss = linear_cross_entropy(hidden, embedding.weight, labels, chunk_size=5, strategy=strategy)
        else:
            loss = F.cross_entropy(F.linear(hidden, embedding.weight).reshape(-1, 50).float(), labels.reshape(-1))
        loss.backward()
        return loss.detach(), embedding.weight.grad.clone()

    (loss, grad), (want_loss, want_grad) = gradient(True), gradient(False)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_fused_autocast_bf16_with_float32_master_weights(device, strategy, rng):
    """Under autocast the logits GEMM runs in bf16, as nn.Linear's would; gradients come back in float32."""
    hidden, weight = torch.randn(40, 32, generator=rng), torch.randn(300, 32, generator=rng) * 0.2
    labels = torch.randint(0, 300, (40,), generator=rng)
    with torch.autocast(device, dtype=torch.bfloat16):
        fused, unfused = fused_and_unfused(device, hidden, weight, labels, chunk_size=16, strategy=strategy)
    assert all(g.dtype == torch.float32 for g in fused[1])
    # bf16 logits and bf16 gradient GEMMs on both sides, rounded in different places: bf16 tolerance.
    assert_close_results(fused, unfused, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_fused_bf16_weights(device, strategy, rng):
    hidden = torch.randn(40, 32, generator=rng).bfloat16()
    weight = (torch.randn(300, 32, generator=rng) * 0.2).bfloat16()
    labels = torch.randint(0, 300, (40,), generator=rng)
    fused, unfused = fused_and_unfused(device, hidden, weight, labels, chunk_size=16, strategy=strategy)
    assert all(g.dtype == torch.bfloat16 for g in fused[1])
    assert_close_results(fused, unfused, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("num_items", [None, 0, 5])
@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_fused_all_ignored_gives_zero(device, strategy, num_items, rng):
    """A batch of padding only: loss 0 and zero gradients (the divisor is at least 1), not torch's NaN."""
    hidden = torch.randn(6, 8, generator=rng).to(device).requires_grad_()
    weight = torch.randn(20, 8, generator=rng).to(device).requires_grad_()
    labels = torch.full((6,), -100, device=device)
    loss = linear_cross_entropy(hidden, weight, labels, strategy=strategy, num_items_in_batch=num_items)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_fused_compiles_fullgraph(device, strategy, autocast, rng):
    """No graph break, and the compiled loss and gradients equal eager's. Under bf16 autocast on a GPU the weight
    gradient accumulates in place through addmm(out_dtype=float32, out=), which dynamo cannot trace: the chunk
    loop is one opaque op (coat::linear_cross_entropy_chunks)."""
    hidden = torch.randn(21, 16, generator=rng).to(device).requires_grad_()
    weight = torch.randn(45, 16, generator=rng).to(device).requires_grad_()
    labels = torch.randint(0, 45, (21,), generator=rng).to(device)
    labels[::4] = -100

    def step(h, w, y):
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            return linear_cross_entropy(h, w, y, chunk_size=8, strategy=strategy, label_smoothing=0.1, softcap=5.0,
                                        z_loss=1e-3)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss, want = compiled(hidden, weight, labels), step(hidden, weight, labels)
    assert torch.equal(loss, want)
    for got, expected in zip(torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(want, (hidden, weight))):
        assert torch.equal(got, expected)


def test_fused_hidden_without_grad(rng):
    """A frozen trunk: only the weight asks for a gradient."""
    hidden, weight = torch.randn(9, 8, generator=rng), torch.randn(20, 8, generator=rng, requires_grad=True)
    labels = torch.randint(0, 20, (9,), generator=rng)
    (grad,) = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels), (weight,))
    w = weight.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(F.cross_entropy(hidden @ w.T, labels), (w,))
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"reduction": "none"}, "reduction must be one of"),
        ({"strategy": "lazy"}, "strategy must be one of"),
        ({"reduction": "sum", "num_items_in_batch": 3}, "needs reduction='mean'"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"softcap": 0.0}, "softcap"),
        ({"label_smoothing": -0.1}, "label_smoothing"),
        ({"z_loss": -1.0}, "z_loss"),
    ],
)
def test_fused_refuses_bad_options(kw, match, rng):
    hidden, weight = torch.randn(4, 8, generator=rng), torch.randn(10, 8, generator=rng)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(hidden, weight, torch.zeros(4, dtype=torch.long), **kw)


def test_fused_refuses_bad_shapes_dtypes_and_labels(rng):
    hidden, weight = torch.randn(4, 8, generator=rng), torch.randn(10, 8, generator=rng)
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="labels must have hidden's shape"):
        linear_cross_entropy(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match=r"hidden must be \[..., H\]"):
        linear_cross_entropy(hidden, weight[:, :7], labels)
    with pytest.raises(ValueError, match="run under torch.autocast"):
        linear_cross_entropy(hidden.bfloat16(), weight, labels)
    with pytest.raises(ValueError, match="label 10 is outside"):
        linear_cross_entropy(hidden, weight, labels + 10)


def test_default_chunk_size():
    """At most 2^28 logits a chunk, in a power of two of tokens: 2048 tokens at a 128256 vocabulary, 8192 at 32000,
    never more tokens than there are, and at least one token at vocabularies beyond 2^28."""
    assert default_chunk_size(16384, 128256) == 2048
    assert default_chunk_size(16384, 152064) == 1024
    assert default_chunk_size(16384, 32000) == 8192
    assert default_chunk_size(3, 10) == 3
    assert default_chunk_size(5, 2**29) == 1


def test_forward_strategy_refuses_a_second_backward(rng):
    """strategy='forward' scales its kept gradients in place, so a second backward through the same forward
    (retain_graph) is refused rather than given scaled-twice gradients; 'recompute' gives the same ones again."""
    hidden = torch.randn(6, 8, generator=rng, requires_grad=True)
    weight = torch.randn(20, 8, generator=rng, requires_grad=True)
    labels = torch.randint(0, 20, (6,), generator=rng)
    loss = linear_cross_entropy(hidden, weight, labels, strategy="forward")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    loss = linear_cross_entropy(hidden, weight, labels, strategy="recompute")
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(loss, (hidden, weight))))
