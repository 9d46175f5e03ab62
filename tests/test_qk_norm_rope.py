"""coat.ops.qk_norm_rope (Qwen3's per-head q/k RMSNorm fused with RoPE, csrc/include/coat/rope.h) and its
autograd Function coat.nn.functional.qk_norm_rotary_embedding.

What is checked, and against what:
- The output against the float64 oracle of tests/reference_rope.py (plain PyTorch from the formulas): at most
  twice the error of the oracle rounded once to the output dtype, plus float32's own error (1e-5 relative to
  the row's largest value: a sum of squares, a square root and three products); rstd likewise.
- The saved input is coat.ops.quantize_group of q and of k, bit for bit (what rmsnorm_backward reads).
- Backward against torch.autograd of the float64 oracle: where every input is E4M3-representable in its
  group, the saved copy is exact and the gradients agree to float32 rounding; on Gaussian inputs within the
  E4M3 rounding of the saved copy.
- Layouts (q/k column slices of one GEMM output read in place, transposes), head_dim 2 to 256 and not a
  multiple of 8, every group size (also G > head_dim), dtypes, errors, the fake (opcheck, torch.compile).
- CUDA (skipped without a GPU): `run` compares every output with the C core's, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import coat
import reference_rope as ref
from coat.nn import functional as coat_functional
from reference import assert_same_bits
from test_rope import qk_views, random_tables, randn, rope_tables

EPS = 1e-6
# (B, S, Hq, Hk, D): GQA; one token; D = 2; D = 6 and 40 (not multiples of 8, partners across chunks); the
# largest D; enough rows for many CUDA blocks.
SHAPES = [(2, 9, 4, 2, 64), (1, 1, 2, 1, 2), (2, 5, 3, 1, 6), (1, 7, 2, 2, 40), (1, 3, 2, 1, 256),
          (2, 70, 8, 2, 128)]
DTYPES = [(torch.bfloat16, torch.float32, torch.float32), (torch.float32, torch.float32, torch.float32),
          (torch.float16, torch.float16, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.bfloat16)]


def weights(head_dim, dtype, rng):
    return tuple((1.0 + 0.5 * randn((head_dim,), torch.float64, rng)).to(dtype) for _ in range(2))


def check_against_oracle(q, k, q_weight, k_weight, cos, sin, outputs, group_size, weight_offset=0.0):
    q_out, k_out, *kept = outputs
    for x, weight, out, (saved, scales, rstd) in ((q, q_weight, q_out, kept[:3]), (k, k_weight, k_out, kept[3:])):
        expected, expected_rstd = ref.qk_norm_rope(x, weight, EPS, cos, sin, weight_offset)
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
        rounding = (expected.to(x.dtype).double() - expected).abs().amax().item()
        tolerance = 2 * rounding + 1e-5 * expected.abs().amax().item()
        assert (out.double() - expected).abs().amax().item() <= tolerance
        assert torch.allclose(rstd.double(), expected_rstd, rtol=1e-6, atol=0)
        codes, expected_scales, _ = coat.ops.quantize_group(x.contiguous(), group_size)
        assert_same_bits(saved, codes, "saved")
        assert_same_bits(scales, expected_scales, "scales")


def shape_cases():
    cases = []
    for i, shape in enumerate(SHAPES):
        for j, dtypes in enumerate(DTYPES):
            cases.append(pytest.param(shape, *dtypes, (i + j) % 2 == 1, id=f"{'x'.join(map(str, shape))}-{j}"))
    return cases


@pytest.mark.parametrize("shape, dtype, weight_dtype, table_dtype, batch_tables", shape_cases())
def test_matches_the_float64_oracle(run, rng, shape, dtype, weight_dtype, table_dtype, batch_tables):
    batch, seq, q_heads, k_heads, head_dim = shape
    q, k = qk_views(batch, seq, q_heads, k_heads, head_dim, dtype, rng, "gemm")
    q_weight, k_weight = weights(head_dim, weight_dtype, rng)
    cos, sin = random_tables(batch if batch_tables else 1, seq, head_dim, table_dtype, rng)
    outputs = run(coat.ops.qk_norm_rope, q, k, q_weight, k_weight, EPS, cos, sin, 16)
    check_against_oracle(q, k, q_weight, k_weight, cos, sin, outputs, 16)


@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "unaligned"])
def test_group_sizes_and_layouts(run, rng, group_size, layout):
    q, k = qk_views(2, 6, 4, 2, 64, torch.bfloat16, rng, layout)
    q_weight, k_weight = weights(64, torch.float32, rng)
    cos, sin = rope_tables(1, 6, 64, torch.float32, rng)
    outputs = run(coat.ops.qk_norm_rope, q, k, q_weight, k_weight, EPS, cos, sin, group_size)
    check_against_oracle(q, k, q_weight, k_weight, cos, sin, outputs, group_size)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("offset", [1.0, -0.5])
def test_weight_offset_is_the_float32_sum(run, rng, weight_dtype, offset):
    """Gemma 3's q_norm / k_norm multiply by (1 + w): the offset is one float32 addition per weight element."""
    q, k = qk_views(2, 5, 4, 2, 40, torch.bfloat16, rng, "gemm")
    q_weight, k_weight = ((0.1 * randn((40,), torch.float64, rng)).to(weight_dtype) for _ in range(2))
    cos, sin = rope_tables(1, 5, 40, torch.float32, rng)
    outputs = run(coat.ops.qk_norm_rope, q, k, q_weight, k_weight, EPS, cos, sin, 16, weight_offset=offset)
    check_against_oracle(q, k, q_weight, k_weight, cos, sin, outputs, 16, offset)
    summed = coat.ops.qk_norm_rope(q, k, q_weight.float() + offset, k_weight.float() + offset, EPS, cos, sin, 16)
    for i, (got, expected) in enumerate(zip(outputs, summed)):
        assert_same_bits(got, expected, f"output {i} vs offset 0 with weight.float() + offset")


def test_empty(run):
    q, k, table, weight = torch.ones(0, 3, 2, 8), torch.ones(0, 3, 1, 8), torch.ones(1, 3, 8), torch.ones(8)
    outputs = run(coat.ops.qk_norm_rope, q, k, weight, weight, EPS, table[:, :3], table[:, :3], 16)
    assert [tuple(t.shape) for t in outputs[:2]] == [(0, 3, 2, 8), (0, 3, 1, 8)]


def e4m3_representable(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x moved to the values its own 1 x G E4M3 copy holds, so that saving it again is exact."""
    codes, scales, _ = coat.ops.quantize_group(x, group_size)
    return coat.ops.dequantize(codes, scales, group_size, torch.float32).to(x.dtype)


def oracle_grads(q, k, q_weight, k_weight, cos, sin, grad_q, grad_k):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, q_weight, k_weight)]
    out_q, _ = ref.qk_norm_rope(leaves[0], leaves[2], EPS, cos, sin)
    out_k, _ = ref.qk_norm_rope(leaves[1], leaves[3], EPS, cos, sin)
    return torch.autograd.grad((out_q * grad_q.double()).sum() + (out_k * grad_k.double()).sum(), leaves)


def forward_backward(q, k, q_weight, k_weight, cos, sin, grad_q, grad_k, group_size=16, function=None):
    """Outputs and the gradients of q, k and the two weights; ``function``: the (compiled) Function's wrapper."""
    q, k, q_weight, k_weight = (t.detach().requires_grad_() for t in (q, k, q_weight, k_weight))
    config = coat.nn.FP8Config(group_size=group_size)
    function = function or coat_functional.qk_norm_rotary_embedding
    out_q, out_k = function(q, k, q_weight, k_weight, EPS, cos, sin, config)
    ((out_q * grad_q).sum() + (out_k * grad_k).sum()).backward()
    return out_q.detach(), out_k.detach(), q.grad, k.grad, q_weight.grad, k_weight.grad


def relative(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("group_size", [16, 64])
def test_backward_is_exact_where_the_saved_copy_is(run, rng, group_size):
    q = e4m3_representable(randn((2, 7, 4, 32), torch.float32, rng), group_size)
    k = e4m3_representable(randn((2, 7, 2, 32), torch.float32, rng), group_size)
    q_weight, k_weight = weights(32, torch.float32, rng)
    cos, sin = random_tables(1, 7, 32, torch.float32, rng)
    grad_q, grad_k = randn(q.shape, torch.float32, rng), randn(k.shape, torch.float32, rng)
    results = run(forward_backward, q, k, q_weight, k_weight, cos, sin, grad_q, grad_k, group_size)
    for actual, expected in zip(results[2:], oracle_grads(q, k, q_weight, k_weight, cos, sin, grad_q, grad_k)):
        assert relative(actual, expected) <= 1e-5


def test_backward_within_the_e4m3_rounding_of_the_saved_input(run, rng):
    """Gaussian bf16 inputs: the gradients read x' (relative RMS error 0.036 per element) instead of x."""
    q, k = qk_views(2, 16, 4, 2, 64, torch.bfloat16, rng, "gemm")
    q_weight, k_weight = weights(64, torch.float32, rng)
    cos, sin = rope_tables(1, 16, 64, torch.float32, rng)
    grad_q, grad_k = randn(q.shape, torch.bfloat16, rng), randn(k.shape, torch.bfloat16, rng)
    results = run(forward_backward, q, k, q_weight, k_weight, cos, sin, grad_q, grad_k)
    grads = results[2:]
    assert grads[0].dtype == torch.bfloat16 and grads[2].dtype == torch.float32
    for actual, expected in zip(grads, oracle_grads(q, k, q_weight, k_weight, cos, sin, grad_q, grad_k)):
        assert relative(actual, expected) <= 0.05


def test_under_torch_compile(rng):
    q, k = qk_views(2, 5, 4, 2, 32, torch.bfloat16, rng, "gemm")
    q_weight, k_weight = weights(32, torch.float32, rng)
    cos, sin = rope_tables(1, 5, 32, torch.float32, rng)
    grad_q, grad_k = randn(q.shape, torch.bfloat16, rng), randn(k.shape, torch.bfloat16, rng)
    args = (q, k, q_weight, k_weight, cos, sin, grad_q, grad_k)
    compiled = torch.compile(coat_functional.qk_norm_rotary_embedding, fullgraph=True, backend="aot_eager")
    assert_same_bits(forward_backward(*args, function=compiled), forward_backward(*args), "compiled")


def test_opcheck(move, rng):
    q, k = qk_views(2, 5, 4, 2, 16, torch.bfloat16, rng, "gemm")
    q_weight, k_weight = weights(16, torch.float32, rng)
    cos, sin = rope_tables(1, 5, 16, torch.float32, rng)
    args = tuple(move(a) if isinstance(a, torch.Tensor) else a for a in (q, k, q_weight, k_weight, EPS, cos, sin, 32))
    torch.library.opcheck(torch.ops.coat.qk_norm_rope.default, args)
    torch.library.opcheck(torch.ops.coat.qk_norm_rope.default, (*args, 1.0))


def _error_cases():
    q, k, table, weight = torch.ones(2, 5, 4, 8), torch.ones(2, 5, 2, 8), torch.ones(2, 5, 8), torch.ones(8)
    op = coat.ops.qk_norm_rope
    prefix = r"coat\.qk_norm_rope: "
    big = torch.ones(1, 1, 1, 258)
    return {
        "head-dim-too-large": (lambda m: op(m(big), m(big), m(torch.ones(258)), m(torch.ones(258)), EPS,
                                            m(torch.ones(1, 1, 258)), m(torch.ones(1, 1, 258)), 16),
                               prefix + r"head_dim .* must be even and between 2 and 256, got 258"),
        "weight-shape": (lambda m: op(m(q), m(k), m(torch.ones(4)), m(weight), EPS, m(table), m(table), 16),
                         prefix + r"q_weight must be a contiguous \[8\] tensor \(head_dim\), got shape \[4\]"),
        "weight-dtypes": (lambda m: op(m(q), m(k), m(weight), m(weight.bfloat16()), EPS, m(table), m(table), 16),
                          prefix + r"q_weight and k_weight must have the same dtype"),
        "group-size": (lambda m: op(m(q), m(k), m(weight), m(weight), EPS, m(table), m(table), 8),
                       prefix + r"save_group_size must be 16, 32, 64 or 128, got 8"),
        "eps": (lambda m: op(m(q), m(k), m(weight), m(weight), -1.0, m(table), m(table), 16),
                prefix + r"eps must be finite and >= 0"),
        "weight-offset": (lambda m: op(m(q), m(k), m(weight), m(weight), EPS, m(table), m(table), 16,
                                       weight_offset=float("inf")),
                          prefix + r"weight_offset must be finite"),
        "k-seq": (lambda m: op(m(q), m(k[:, :3]), m(weight), m(weight), EPS, m(table), m(table), 16),
                  prefix + r"k must be \[2, 5, k_heads, 8\]"),
    }


ERROR_CASES = _error_cases()


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_say_what_is_wrong(move, case):
    call, message = ERROR_CASES[case]
    with pytest.raises(RuntimeError, match=message):
        call(move)


def test_fake_rejects_what_the_kernel_rejects():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        big, table, weight = (mode.from_tensor(torch.ones(shape)) for shape in ((1, 1, 1, 258), (1, 1, 258), (258,)))
        with pytest.raises(RuntimeError, match=r"between 2 and 256, got 258"):
            torch.ops.coat.qk_norm_rope(big, big, weight, weight, EPS, table, table, 16)
        q, table = mode.from_tensor(torch.ones(2, 5, 4, 8)), mode.from_tensor(torch.ones(2, 5, 8))
        with pytest.raises(RuntimeError, match=r"q_weight must be a contiguous \[8\] tensor"):
            torch.ops.coat.qk_norm_rope(q, q, mode.from_tensor(torch.ones(4)), mode.from_tensor(torch.ones(8)), EPS,
                                        table, table, 16)
