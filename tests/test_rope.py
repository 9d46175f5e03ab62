"""coat.ops.rotary_embedding and its autograd wrapper coat.nn.functional.rotary_embedding
(csrc/include/coat/rope.h).

What is checked, and against what:
- The documented arithmetic, bit for bit: every product, then the sum, rounded to float32, then one rounding
  to the output dtype, replayed by PyTorch in float32 (each elementwise op rounds once, none is fused). On
  float32 inputs the forward is therefore transformers' eager formula itself, bit for bit.
- Accuracy against the float64 oracle of tests/reference_rope.py, written from the formulas: the max error is
  at most 2x that of transformers' formula computed by PyTorch in the input dtype (the flash-attention rule);
  and on inputs whose products and sums are exact in float32, the result is the float64 result rounded once.
- The inverse is the adjoint of the forward, on the oracle in float64 with arbitrary tables; the op's inverse
  and the autograd Function agree with torch.autograd of the eager formula (float64 reference, and float32
  bit for bit up to the sign of zero).
- Layouts: grouped-query attention, tables with batch 1 and batch B, q and k as column slices of one
  [B*S, (Hq + 2 Hk) * D] GEMM output read in place, transposed and unaligned views (the CUDA element-wise
  path), odd sizes; NaN and Inf; errors; opcheck and torch.compile.
- CUDA (skipped without a GPU): `run` compares every output with the C core's, bit for bit.

Most cases use random tables rather than RoPE's, where cos[j] == cos[j + h] and sin[j] == sin[j + h]: a
formula that used the wrong half of a table would pass with RoPE's tables and fails with random ones.
"""
from __future__ import annotations

import math

import pytest
import torch

import coat
import reference_rope as ref
from coat.nn import functional as coat_functional
from reference import assert_same_bits

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


# ----------------------------------------------------------------------------------------------------
# helpers


def rope_tables(batch, seq, head_dim, dtype, rng, base=10000.0):
    """RoPE's tables as transformers builds them (cat(freqs, freqs)), at random positions below 8192."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    positions = torch.randint(0, 8192, (batch, seq), generator=rng).double()
    angles = positions[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def random_tables(batch, seq, head_dim, dtype, rng):
    """Arbitrary tables: different values in the two halves, negative values, magnitudes above 1."""
    cos = torch.randn(batch, seq, head_dim, generator=rng, dtype=torch.float64)
    sin = torch.randn(batch, seq, head_dim, generator=rng, dtype=torch.float64)
    return cos.to(dtype), sin.to(dtype)


def randn(shape, dtype, rng):
    return torch.randn(shape, generator=rng, dtype=torch.float64).to(dtype)


def qk_views(batch, seq, q_heads, k_heads, head_dim, dtype, rng, layout="contiguous"):
    """q [B, S, Hq, D] and k [B, S, Hk, D] in one of the layouts the op reads in place:
    contiguous; "gemm": column slices of one [B*S, (Hq + 2 Hk) * D] q/k/v GEMM output (coat's layout);
    "unaligned": the same, shifted by one element (no 16-byte alignment); "transposed": transposes of
    contiguous [B, H, S, D] tensors."""
    if layout == "contiguous":
        return randn((batch, seq, q_heads, head_dim), dtype, rng), randn((batch, seq, k_heads, head_dim), dtype, rng)
    if layout == "transposed":
        q = randn((batch, q_heads, seq, head_dim), dtype, rng).transpose(1, 2)
        return q, randn((batch, k_heads, seq, head_dim), dtype, rng).transpose(1, 2)
    shift = {"gemm": 0, "unaligned": 1}[layout]
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = randn((batch * seq, width + shift), dtype, rng)[:, shift:]
    q = qkv[:, : q_heads * head_dim].view(batch, seq, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(batch, seq, k_heads, head_dim)
    return q, k


def replay_f32(x, cos, sin, inverse=False):
    """The documented arithmetic in float32, rounded once to x's dtype (see the module docstring)."""
    half = x.shape[-1] // 2
    x32, c, s = x.float(), cos.float().unsqueeze(2), sin.float().unsqueeze(2)
    x1, x2, c1, c2, s1, s2 = x32[..., :half], x32[..., half:], c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if inverse:
        y = torch.cat([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], dim=-1)
    else:
        y = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)
    return y.to(x.dtype)


def check_bits(q, k, cos, sin, outputs, inverse=False):
    q_out, k_out = outputs
    for x, out, name in ((q, q_out, "q_out"), (k, k_out, "k_out")):
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous(), name
        assert_same_bits(out, replay_f32(x, cos, sin, inverse), name)


def max_error(actual: torch.Tensor, expected64: torch.Tensor) -> float:
    return (actual.double() - expected64).abs().max().item() if actual.numel() else 0.0


def eager_input_grad(x, cos, sin, grad_out):
    """torch.autograd's gradient of transformers' eager formula at x, in x's dtype."""
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(ref.eager_rotary_embedding(x, cos, sin), x, grad_out)
    return grad


# ----------------------------------------------------------------------------------------------------
# the documented arithmetic, bit for bit

# (B, S, Hq, Hk, D): grouped-query attention, B = 3, S = 1, D = 2, D = 6 (not a multiple of 8), D = 1000
# (h = 500: no 16-byte chunks), the largest D, Hk > Hq, and enough tokens for many CUDA blocks.
SHAPES = [(2, 33, 4, 2, 64), (3, 7, 5, 5, 128), (1, 1, 2, 1, 2), (2, 5, 3, 1, 6), (2, 9, 2, 2, 1000),
          (1, 17, 1, 3, 1024), (2, 300, 16, 4, 128)]
# (dtype of q and k, dtype of the tables)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)]


def shape_cases():
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, (dtype, table_dtype) in enumerate(DTYPE_PAIRS):
            table_batch = shape[0] if (i + j) % 2 else 1
            cases.append(pytest.param(shape, dtype, table_dtype, table_batch,
                                      id=f"{'x'.join(map(str, shape))}-{NAMES[dtype]}-{NAMES[table_dtype]}-cb{table_batch}"))
    return cases


@pytest.mark.parametrize("shape, dtype, table_dtype, table_batch", shape_cases())
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_matches_documented_arithmetic(run, rng, shape, dtype, table_dtype, table_batch, inverse):
    batch, seq, q_heads, k_heads, head_dim = shape
    q, k = qk_views(batch, seq, q_heads, k_heads, head_dim, dtype, rng)
    cos, sin = random_tables(table_batch, seq, head_dim, table_dtype, rng)
    outputs = run(coat.ops.rotary_embedding, q, k, cos, sin, inverse=inverse)
    check_bits(q, k, cos, sin, outputs, inverse)


@pytest.mark.parametrize("layout", ["gemm", "unaligned", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_strided_layouts_read_in_place(run, rng, layout, dtype):
    """q and k as views: the same bits as from contiguous copies."""
    q, k = qk_views(2, 19, 8, 2, 128, dtype, rng, layout)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = rope_tables(2, 19, 128, dtype, rng)
    for inverse in (False, True):
        outputs = run(coat.ops.rotary_embedding, q, k, cos, sin, inverse=inverse)
        check_bits(q, k, cos, sin, outputs, inverse)
        assert_same_bits(outputs, coat.ops.rotary_embedding(q.contiguous(), k.contiguous(), cos, sin, inverse=inverse))


def test_table_views(run, rng):
    """Tables as views: batch broadcast by expand (stride 0), a slice of wider rows, unaligned."""
    q, k = qk_views(3, 11, 4, 2, 64, torch.bfloat16, rng)
    wide = randn((3, 11, 130), torch.float32, rng)
    cases = [
        tuple(t[:1].expand(3, 11, 64) for t in random_tables(1, 11, 64, torch.float32, rng)),
        (wide[..., :64], wide[..., 64:128]),
        (wide[..., 1:65], wide[..., 65:129]),
    ]
    for cos, sin in cases:
        check_bits(q, k, cos, sin, run(coat.ops.rotary_embedding, q, k, cos, sin))


@pytest.mark.transformers
def test_float32_equals_transformers_eager(run, rng):
    """On float32 inputs the op is transformers' apply_rotary_pos_emb, bit for bit."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = qk_views(2, 13, 4, 2, 64, torch.float32, rng, "gemm")
    cos, sin = rope_tables(2, 13, 64, torch.float32, rng)
    q_out, k_out = run(coat.ops.rotary_embedding, q, k, cos, sin)
    q_expected, k_expected = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert_same_bits((q_out, k_out), (q_expected.transpose(1, 2).contiguous(), k_expected.transpose(1, 2).contiguous()))


def test_empty(run):
    for q_shape, k_shape in (((0, 4, 2, 8), (0, 4, 1, 8)), ((2, 0, 2, 8), (2, 0, 1, 8)), ((2, 3, 0, 8), (2, 3, 0, 8))):
        q, k = torch.zeros(q_shape), torch.zeros(k_shape)
        table = torch.zeros(1, q_shape[1], 8)
        q_out, k_out = run(coat.ops.rotary_embedding, q, k, table, table)
        assert q_out.shape == q_shape and k_out.shape == k_shape


# ----------------------------------------------------------------------------------------------------
# accuracy against the float64 oracle


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("table_dtype", [None, torch.float32], ids=["tables-in-dtype", "f32-tables"])
def test_accuracy_flash_attention_rule(run, rng, dtype, table_dtype):
    """Max error against float64 at most 2x that of transformers' formula run by PyTorch in the input dtype,
    forward and backward."""
    q, k = qk_views(2, 64, 8, 2, 128, dtype, rng, "gemm")
    cos, sin = rope_tables(2, 64, 128, table_dtype or dtype, rng)
    for inverse in (False, True):
        outputs = run(coat.ops.rotary_embedding, q, k, cos, sin, inverse=inverse)
        for x, out in zip((q, k), outputs):
            exact = ref.rotary_embedding(x, cos, sin, inverse)
            if inverse:  # the gradient PyTorch computes for this output gradient
                pytorch = eager_input_grad(torch.zeros_like(x), cos, sin, x)
            else:
                pytorch = ref.eager_rotary_embedding(x, cos, sin)
            assert max_error(out, exact) <= 2 * max_error(pytorch, exact)


def exact_grid(shape, rng) -> torch.Tensor:
    """Integers in [-15, 15] times powers of two in [2^-3, 2^3]: exact in bf16 and fp16, and products and sums
    of two products stay exact in float32 (multiples of 2^-6 below 2^21)."""
    mantissa = torch.randint(-15, 16, shape, generator=rng).double()
    return mantissa * torch.pow(2.0, torch.randint(-3, 4, shape, generator=rng).double())


@pytest.mark.parametrize("dtype, table_dtype", DTYPE_PAIRS, ids=[f"{NAMES[a]}-{NAMES[b]}" for a, b in DTYPE_PAIRS])
def test_rounds_once(run, rng, dtype, table_dtype):
    """Where float32 arithmetic is exact, the result is the float64 one rounded once to the output dtype (the
    output rounding is real: the exact values need up to 21 significant bits)."""
    q, k = exact_grid((2, 9, 4, 64), rng).to(dtype), exact_grid((2, 9, 2, 64), rng).to(dtype)
    cos, sin = exact_grid((1, 9, 64), rng).to(table_dtype), exact_grid((1, 9, 64), rng).to(table_dtype)
    for inverse in (False, True):
        outputs = run(coat.ops.rotary_embedding, q, k, cos, sin, inverse=inverse)
        for x, out in zip((q, k), outputs):
            assert_same_bits(out, ref.rotary_embedding(x, cos, sin, inverse).to(dtype))


# ----------------------------------------------------------------------------------------------------
# the inverse is the backward


def test_oracle_inverse_is_adjoint(rng):
    """<forward(x), y> == <x, inverse(y)> in float64, for arbitrary tables, batch B and batch 1."""
    x, y = randn((3, 6, 2, 10), torch.float64, rng), randn((3, 6, 2, 10), torch.float64, rng)
    for batch in (3, 1):
        cos, sin = random_tables(batch, 6, 10, torch.float64, rng)
        left = (ref.rotary_embedding(x, cos, sin) * y).sum()
        right = (x * ref.rotary_embedding(y, cos, sin, inverse=True)).sum()
        assert abs(left - right) <= 1e-12 * (ref.rotary_embedding(x, cos, sin).abs() * y.abs()).sum()
        # the oracle's inverse is also torch.autograd's gradient of transformers' formula
        assert torch.allclose(ref.rotary_embedding(y, cos, sin, inverse=True), eager_input_grad(x, cos, sin, y),
                              rtol=1e-14, atol=0)


def test_inverse_matches_autograd(run, rng):
    """The op's inverse against torch.autograd of the eager formula: in float32 the same values (autograd adds
    the same two rounded products; it may turn a -0 into +0 by adding zeros, hence torch.equal), in bf16 the
    flash-attention rule against the float64 gradient."""
    cos, sin = random_tables(2, 21, 64, torch.float32, rng)
    dq, dk = qk_views(2, 21, 4, 2, 64, torch.float32, rng)
    grads = run(coat.ops.rotary_embedding, dq, dk, cos, sin, inverse=True)
    for grad_out, grad in zip((dq, dk), grads):
        assert torch.equal(grad, eager_input_grad(torch.zeros_like(grad_out), cos, sin, grad_out))

    dq16, dk16 = dq.bfloat16(), dk.bfloat16()
    grads = run(coat.ops.rotary_embedding, dq16, dk16, cos, sin, inverse=True)
    for grad_out, grad in zip((dq16, dk16), grads):
        exact = eager_input_grad(torch.zeros_like(grad_out, dtype=torch.float64), cos.double(), sin.double(), grad_out.double())
        pytorch = eager_input_grad(torch.zeros_like(grad_out), cos, sin, grad_out)
        assert max_error(grad, exact) <= 2 * max_error(pytorch, exact)


# ----------------------------------------------------------------------------------------------------
# special values


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_nan_and_inf_follow_the_formula(run, rng, dtype):
    """NaN in x poisons the two outputs it enters; Inf * finite nonzero is +-Inf, Inf * 0 and Inf - Inf are
    NaN; a NaN table entry poisons its outputs in every head. Compared with the float64 oracle for NaN-ness and
    infinities, and with the replay bit for bit."""
    head_dim, half = 16, 8
    q, k = qk_views(1, 6, 2, 1, head_dim, dtype, rng)
    cos, sin = rope_tables(1, 6, head_dim, torch.float32, rng)
    q[0, 0, 0, 0] = math.nan                                    # y[0] and y[h] of that row
    q[0, 1, 0, 1] = math.inf                                    # y[1] = +-Inf, y[1 + h] = +-Inf
    cos[0, 1, [1, 1 + half]], sin[0, 1, [1, 1 + half]] = 0.5, -0.75
    q[0, 2, 1, 2], cos[0, 2, 2] = math.inf, 0.0                 # Inf * 0 in y[2]
    q[0, 3, 0, 3], q[0, 3, 0, 3 + half] = math.inf, math.inf    # Inf - Inf in y[3] when cos, sin > 0
    cos[0, 3, 3], sin[0, 3, 3], cos[0, 3, 3 + half], sin[0, 3, 3 + half] = 1.0, 1.0, 1.0, 1.0
    k[0, 4, 0, 5] = -math.inf
    sin[0, 5, 6] = math.nan                                     # y[6] of every head at position 5
    for inverse in (False, True):
        outputs = run(coat.ops.rotary_embedding, q, k, cos, sin, inverse=inverse)
        check_bits(q, k, cos, sin, outputs, inverse)
        for x, out in zip((q, k), outputs):
            exact = ref.rotary_embedding(x, cos, sin, inverse)
            assert torch.equal(torch.isnan(out), torch.isnan(exact))
            assert torch.equal(out.double()[torch.isinf(exact)], exact[torch.isinf(exact)])
        q_out = outputs[0]
        assert torch.isnan(q_out[0, 0, 0, [0, half]]).all() and torch.isnan(q_out[0, 5, :, 6 if not inverse else 6 + half]).all()
        assert torch.isinf(q_out[0, 1, 0, [1, 1 + half]]).all()
        assert torch.isnan(q_out[0, 2, 1, 2]) and torch.isnan(q_out[0, 3, 0, 3 if not inverse else 3 + half])


def test_overflow_to_inf(run):
    """A finite float32 result beyond the output dtype's range rounds to +-Inf."""
    q = torch.full((1, 1, 1, 2), 60000.0, dtype=torch.float16)
    table = torch.full((1, 1, 2), 2.0)
    q_out, _ = run(coat.ops.rotary_embedding, q, q, table, table)
    assert q_out.tolist() == [[[[0.0, math.inf]]]]  # 60000 * 2 - 60000 * 2, 60000 * 2 + 60000 * 2


# ----------------------------------------------------------------------------------------------------
# the autograd Function


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
def test_autograd_function(run, rng, dtype):
    """coat.nn.functional.rotary_embedding's gradients against torch.autograd on the eager formula: float32 the
    same values, bf16 the flash-attention rule against float64. cos and sin get no gradient."""
    q, k = qk_views(2, 17, 4, 2, 64, dtype, rng, "gemm")
    cos, sin = rope_tables(2, 17, 64, dtype, rng)
    grad_q_out, grad_k_out = randn(q.shape, dtype, rng), randn(k.shape, dtype, rng)

    def forward_backward(q, k, cos, sin, grad_q_out, grad_k_out):
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        cos = cos.detach().requires_grad_(True)
        q_out, k_out = coat_functional.rotary_embedding(q, k, cos, sin)
        torch.autograd.backward((q_out, k_out), (grad_q_out, grad_k_out))
        assert cos.grad is None
        return q_out.detach(), k_out.detach(), q.grad, k.grad

    q_out, k_out, grad_q, grad_k = run(forward_backward, q, k, cos, sin, grad_q_out, grad_k_out)
    assert_same_bits((q_out, k_out), coat.ops.rotary_embedding(q, k, cos, sin))
    for x, grad_out, grad in ((q, grad_q_out, grad_q), (k, grad_k_out, grad_k)):
        pytorch = eager_input_grad(x, cos, sin, grad_out)
        if dtype == torch.float32:
            assert torch.equal(grad, pytorch)
        else:
            exact = eager_input_grad(x.double(), cos.double(), sin.double(), grad_out.double())
            assert max_error(grad, exact) <= 2 * max_error(pytorch, exact)


def test_autograd_function_one_output_used(run, rng):
    """Only q_out reaches the loss: k's gradient is zero (autograd hands backward a zero gradient)."""
    q, k = qk_views(1, 5, 2, 1, 8, torch.float32, rng)
    cos, sin = rope_tables(1, 5, 8, torch.float32, rng)

    def q_only(q, k, cos, sin):
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        coat_functional.rotary_embedding(q, k, cos, sin)[0].sum().backward()
        return q.grad, k.grad

    grad_q, grad_k = run(q_only, q, k, cos, sin)
    assert torch.equal(grad_q, eager_input_grad(q, cos, sin, torch.ones_like(q)))
    assert (grad_k == 0).all()


def test_autograd_function_under_torch_compile(run, rng):
    """fullgraph torch.compile (aot_eager, dynamic shapes) traces the Function, and its backward runs: eager's
    bits."""
    compiled = torch.compile(coat_functional.rotary_embedding, fullgraph=True, backend="aot_eager", dynamic=True)

    def forward_backward(rope, q, k, cos, sin):
        q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        q_out, k_out = rope(q, k, cos, sin)
        (q_out.float().square().sum() + k_out.float().sum()).backward()
        return q_out.detach(), k_out.detach(), q.grad, k.grad

    for seq in (7, 12):
        q, k = qk_views(2, seq, 4, 2, 32, torch.bfloat16, rng, "gemm")
        cos, sin = rope_tables(1, seq, 32, torch.bfloat16, rng)
        eager = run(forward_backward, coat_functional.rotary_embedding, q, k, cos, sin)
        assert_same_bits(run(forward_backward, compiled, q, k, cos, sin), eager)


# ----------------------------------------------------------------------------------------------------
# torch.library integration and errors


def _opcheck_cases():
    g = lambda: torch.Generator().manual_seed(5)
    return {
        "bf16-f32-tables": lambda: (*qk_views(2, 5, 4, 2, 16, torch.bfloat16, g()), *rope_tables(2, 5, 16, torch.float32, g()), False),
        "gemm-views-inverse": lambda: (*qk_views(2, 5, 4, 2, 16, torch.float32, g(), "gemm"), *rope_tables(1, 5, 16, torch.float32, g()), True),
        "f16-odd-head-dim": lambda: (*qk_views(3, 2, 1, 1, 6, torch.float16, g(), "transposed"), *random_tables(3, 2, 6, torch.float16, g()), False),
    }


OPCHECK_CASES = _opcheck_cases()


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(move, case):
    args = tuple(move(a) if isinstance(a, torch.Tensor) else a for a in OPCHECK_CASES[case]())
    torch.library.opcheck(torch.ops.coat.rotary_embedding.default, args)


def _error_cases():
    q, k, table = torch.ones(2, 5, 4, 8), torch.ones(2, 5, 2, 8), torch.ones(2, 5, 8)
    op = coat.ops.rotary_embedding
    prefix = r"coat\.rotary_embedding: "
    return {
        "float64-q": (lambda m: op(m(q.double()), m(k.double()), m(table), m(table)),
                      prefix + r"q must be float32, bfloat16 or float16, got Double"),
        "k-dtype": (lambda m: op(m(q), m(k.bfloat16()), m(table), m(table)),
                    prefix + r"q and k must have the same dtype, got Float and BFloat16"),
        "int-tables": (lambda m: op(m(q), m(k), m(table.int()), m(table.int())),
                       prefix + r"cos must be float32, bfloat16 or float16, got Int"),
        "sin-dtype": (lambda m: op(m(q), m(k), m(table), m(table.half())),
                      prefix + r"cos and sin must have the same dtype, got Float and Half"),
        "3d-q": (lambda m: op(m(q[0]), m(k), m(table), m(table)),
                 prefix + r"q must be \[batch, seq, heads, head_dim\], got shape \[5, 4, 8\]"),
        "k-seq": (lambda m: op(m(q), m(k[:, :3]), m(table), m(table)),
                  prefix + r"k must be \[2, 5, k_heads, 8\] \(q's batch, seq and head_dim\), got shape \[2, 3, 2, 8\]"),
        "k-head-dim": (lambda m: op(m(q), m(k[..., :4]), m(table), m(table)),
                       prefix + r"k must be \[2, 5, k_heads, 8\]"),
        "odd-head-dim": (lambda m: op(m(q[..., :7]), m(k[..., :7]), m(table[..., :7]), m(table[..., :7])),
                         prefix + r"head_dim \(the last dimension of q and k\) must be even and between 2 and 1024, got 7"),
        "head-dim-too-large": (lambda m: op(m(torch.ones(1, 1, 1, 1026)), m(torch.ones(1, 1, 1, 1026)),
                                            m(torch.ones(1, 1, 1026)), m(torch.ones(1, 1, 1026))),
                               prefix + r"head_dim .* must be even and between 2 and 1024, got 1026"),
        "table-seq": (lambda m: op(m(q), m(k), m(table[:, :4]), m(table[:, :4])),
                      prefix + r"cos must be \[2 or 1, 5, 8\] \(q's batch, seq and head_dim\), got shape \[2, 4, 8\]"),
        "table-batch": (lambda m: op(m(q), m(k), m(torch.ones(3, 5, 8)), m(torch.ones(3, 5, 8))),
                        prefix + r"cos must be \[2 or 1, 5, 8\]"),
        "table-unsqueezed": (lambda m: op(m(q), m(k), m(table[:, :, None]), m(table[:, :, None])),
                             prefix + r"cos must be \[2 or 1, 5, 8\] .*, got shape \[2, 5, 1, 8\]"),
        "sin-shape": (lambda m: op(m(q), m(k), m(table), m(table[:1])),
                      prefix + r"sin must have the shape of cos, \[2, 5, 8\], got \[1, 5, 8\]"),
        "q-last-dim-strided": (lambda m: op(m(torch.ones(2, 5, 4, 16)[..., ::2]), m(k), m(table), m(table)),
                               prefix + r"the last dimension of q must be contiguous \(stride 1\); call \.contiguous\(\) first\. Got strides \[320, 64, 16, 2\]"),
        "k-last-dim-transposed": (lambda m: op(m(q), m(torch.ones(2, 5, 8, 2).transpose(2, 3)), m(table), m(table)),
                                  prefix + r"the last dimension of k must be contiguous"),
        "cos-last-dim-strided": (lambda m: op(m(q), m(k), m(torch.ones(2, 5, 16)[..., ::2]), m(table)),
                                 prefix + r"the last dimension of cos must be contiguous"),
    }


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_say_what_is_wrong(move, case):
    call, message = ERROR_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        call(move)


def test_fake_rejects_what_the_kernel_rejects():
    """torch.compile traces with the fake implementation: shape errors surface there too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q = mode.from_tensor(torch.ones(2, 5, 4, 7))
        with pytest.raises(RuntimeError, match=r"head_dim .* must be even and between 2 and 1024, got 7"):
            torch.ops.coat.rotary_embedding(q, q, mode.from_tensor(torch.ones(2, 5, 7)), mode.from_tensor(torch.ones(2, 5, 7)))
        q = mode.from_tensor(torch.ones(2, 5, 4, 8))
        with pytest.raises(RuntimeError, match=r"q and k must be \[batch, seq, heads, head_dim\]"):
            torch.ops.coat.rotary_embedding(q, q[:, :3], mode.from_tensor(torch.ones(2, 5, 8)), mode.from_tensor(torch.ones(2, 5, 8)))


def test_tensors_on_different_devices(cuda_device):
    q, k, table = torch.ones(2, 5, 4, 8), torch.ones(2, 5, 2, 8), torch.ones(2, 5, 8)
    with pytest.raises(RuntimeError, match=r"coat\.rotary_embedding: cos is on cpu but the input is on cuda:0; move it"):
        coat.ops.rotary_embedding(q.to(cuda_device), k.to(cuda_device), table, table.to(cuda_device))
    with pytest.raises(RuntimeError, match=r"coat\.rotary_embedding: k is on cuda:0 but the input is on cpu"):
        coat.ops.rotary_embedding(q, k.to(cuda_device), table, table)
    with pytest.raises(RuntimeError, match=r"coat\.rotary_embedding: sin is on cpu but the input is on cuda:0"):
        coat.ops.rotary_embedding(q.to(cuda_device), k.to(cuda_device), table.to(cuda_device), table)
