"""The block options of coat.nn.functional for OLMo 2 and Gemma 3 against float64 of the unquantized formulas:
rms_norm_save (a norm with a high-precision output, optionally adding the residual), before_attention without a
norm and with a weight offset, after_attention and mlp_residual with a post-norm (and mlp_residual without a
pre-norm), qk_norm_rotary_embedding with a weight offset.

Bounds are those of tests/test_nn_modules.py (its docstring derives them): one E4M3 rounding 0.06, a forward chain
of FP8 operands 0.12, a backward with E5M2 gradients 0.2. rms_norm_save's forward has no FP8 rounding (its output
is 16-bit), so it is held to bf16's. Saved tensors are checked with saved-tensor hooks: what should be FP8 is, and
no 16-bit activation of the block's size is kept.
"""
import pytest
import torch
import torch.nn.functional as F

import coat.nn
import coat.nn.functional as coat_functional
import reference_rope
from reference_nn import relative_error
from test_nn_modules import BACKWARD_CHAIN_BOUND, FORWARD_CHAIN_BOUND, ONE_ROUNDING_BOUND, randn, run_saving

EPS = 1e-6
TOKENS, HIDDEN, INTERMEDIATE = (2, 24), 64, 96
ROWS = TOKENS[0] * TOKENS[1]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def rms_norm64(x, weight, eps=EPS, offset=0.0):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + offset)


def swiglu64(x, gate, up, down):
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def check_against_float64(fn64, outputs, leaves, grads, forward_bound, backward_bound):
    """outputs: what coat computed from leaves (autograd leaves); grads: the outputs' gradients."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    expected = fn64(*leaves64)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for out, out64 in zip(outputs, expected):
        assert relative_error(out, out64) <= forward_bound
    torch.autograd.backward(outputs, grads)
    torch.autograd.backward(expected, [g.double() for g in grads])
    for leaf, leaf64 in zip(leaves, leaves64):
        assert relative_error(leaf.grad, leaf64.grad) <= backward_bound


def activation_sized(saved, cols):
    """The saved 16-bit tensors of an activation's size ([.., ROWS * cols] elements)."""
    return [t for t in saved if t.dtype in (torch.bfloat16, torch.float16) and t.numel() == ROWS * cols]


def leaves_of(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_save(device, offset):
    x = randn(*TOKENS, HIDDEN, seed=1, device=device)
    weight = randn(HIDDEN, scale=0.1, seed=2, device=device) + (1 - offset)
    residual = randn(*TOKENS, HIDDEN, seed=3, device=device)
    leaves = leaves_of(x, weight, residual)
    out, saved = run_saving(lambda: coat_functional.rms_norm_save(leaves[0], leaves[1], EPS, weight_offset=offset,
                                                                  residual=leaves[2]))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert [tuple(t.shape) for t in saved if t.dtype in FP8] == [(ROWS, HIDDEN)]
    assert activation_sized(saved, HIDDEN) == []
    grad = randn(*TOKENS, HIDDEN, seed=4, device=device)
    # forward: 16-bit rounding only (twice: the norm's output, then the sum)
    check_against_float64(lambda x, w, r: r + rms_norm64(x, w, EPS, offset), out, leaves, [grad], 2**-7,
                          ONE_ROUNDING_BOUND)


def test_before_attention_without_a_norm(device):
    """OLMo 2: the projections read the residual stream; x is quantized per tensor once and saved once, in FP8."""
    x = randn(*TOKENS, HIDDEN, seed=5, device=device)
    weights = [randn(n, HIDDEN, scale=HIDDEN**-0.5, seed=6 + i, device=device) for i, n in enumerate((64, 32, 32))]
    leaves = leaves_of(x, *weights)
    outputs, saved = run_saving(
        lambda: coat_functional.before_attention(leaves[0], None, EPS, [(w, None) for w in leaves[1:]])
    )
    assert [tuple(t.shape) for t in saved if t.dtype in FP8] == [(HIDDEN, ROWS)]  # the wgrads' operand
    assert activation_sized(saved, HIDDEN) == []
    grads = [randn(*o.shape, seed=10 + i, device=device) for i, o in enumerate(outputs)]
    check_against_float64(lambda x, *ws: tuple(x @ w.t() for w in ws), outputs, leaves, grads, FORWARD_CHAIN_BOUND,
                          BACKWARD_CHAIN_BOUND)


def test_before_attention_with_a_weight_offset(device):
    """Gemma 3's input norm multiplies by (1 + w)."""
    x = randn(*TOKENS, HIDDEN, seed=13, device=device)
    norm_weight = randn(HIDDEN, scale=0.1, seed=14, device=device)
    weights = [randn(n, HIDDEN, scale=HIDDEN**-0.5, seed=15 + i, device=device) for i, n in enumerate((64, 32, 32))]
    leaves = leaves_of(x, norm_weight, *weights)
    outputs = coat_functional.before_attention(leaves[0], leaves[1], EPS, [(w, None) for w in leaves[2:]],
                                               norm_weight_offset=1.0)
    grads = [randn(*o.shape, seed=20 + i, device=device) for i, o in enumerate(outputs)]
    check_against_float64(lambda x, nw, *ws: tuple(rms_norm64(x, nw, EPS, 1.0) @ w.t() for w in ws), outputs,
                          leaves, grads, FORWARD_CHAIN_BOUND, BACKWARD_CHAIN_BOUND)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_after_attention_with_a_post_norm(device, offset):
    a = randn(*TOKENS, HIDDEN, seed=23, device=device)
    residual = randn(*TOKENS, HIDDEN, seed=24, device=device)
    o_weight = randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5, seed=25, device=device)
    post_weight = randn(HIDDEN, scale=0.1, seed=26, device=device) + (1 - offset)
    leaves = leaves_of(a, residual, o_weight, post_weight)
    out, saved = run_saving(lambda: coat_functional.after_attention(
        leaves[0], leaves[1], leaves[2], None, attention_keeps_output=False, post_norm=(leaves[3], EPS, offset)))
    # the o_proj input transposed for its wgrad, the post-norm's input in 1 x G groups; no 16-bit o_proj output
    assert sorted(tuple(t.shape) for t in saved if t.dtype in FP8) == sorted([(HIDDEN, ROWS), (ROWS, HIDDEN)])
    assert activation_sized(saved, HIDDEN) == []
    grad = randn(*TOKENS, HIDDEN, seed=27, device=device)
    check_against_float64(lambda a, r, w, pw: r + rms_norm64(a @ w.t(), pw, EPS, offset), out, leaves, [grad],
                          FORWARD_CHAIN_BOUND, BACKWARD_CHAIN_BOUND)


@pytest.mark.parametrize("family", ["olmo2", "gemma3"])
def test_mlp_residual_with_a_post_norm(device, family):
    """OLMo 2: x + post_norm(MLP(x)); Gemma 3: x + post_norm(MLP(pre_norm(x))), both norms (1 + w)."""
    offset = 1.0 if family == "gemma3" else 0.0
    x = randn(*TOKENS, HIDDEN, seed=30, device=device)
    pre_weight = randn(HIDDEN, scale=0.1, seed=31, device=device) + (1 - offset)
    post_weight = randn(HIDDEN, scale=0.1, seed=32, device=device) + (1 - offset)
    gate, up = (randn(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5, seed=33 + i, device=device) for i in range(2))
    down = randn(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5, seed=35, device=device)
    with_pre_norm = family == "gemma3"
    leaves = leaves_of(x, post_weight, gate, up, down, *((pre_weight,) if with_pre_norm else ()))

    def coat_block():
        pre = leaves[5] if with_pre_norm else None
        return coat_functional.mlp_residual(leaves[0], pre, EPS, (leaves[2], None), (leaves[3], None),
                                            (leaves[4], None), norm_weight_offset=offset,
                                            post_norm=(leaves[1], EPS, offset))

    def block64(x, pw, g, u, d, *pre):
        n = rms_norm64(x, pre[0], EPS, offset) if pre else x
        return x + rms_norm64(swiglu64(n, g, u, d), pw, EPS, offset)

    out, saved = run_saving(coat_block)
    assert activation_sized(saved, HIDDEN) == [] and activation_sized(saved, INTERMEDIATE) == []
    grad = randn(*TOKENS, HIDDEN, seed=36, device=device)
    check_against_float64(block64, out, leaves, [grad], FORWARD_CHAIN_BOUND, BACKWARD_CHAIN_BOUND)


def test_blocks_without_autograd_match(device):
    """The no-grad paths compute what the autograd Functions do."""
    x = randn(*TOKENS, HIDDEN, seed=40, device=device)
    weights = [randn(32, HIDDEN, scale=HIDDEN**-0.5, seed=41 + i, device=device) for i in range(2)]
    post = (randn(HIDDEN, seed=43, device=device), EPS, 0.0)
    gate, up = (randn(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5, seed=44 + i, device=device) for i in range(2))
    down = randn(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5, seed=46, device=device)
    o_weight = randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5, seed=47, device=device)
    calls = [
        lambda x: coat_functional.before_attention(x, None, EPS, [(w, None) for w in weights]),
        lambda x: coat_functional.after_attention(x, x, o_weight, None, post_norm=post),
        lambda x: coat_functional.mlp_residual(x, None, EPS, (gate, None), (up, None), (down, None), post_norm=post),
        lambda x: coat_functional.mlp_residual(x, post[0], EPS, (gate, None), (up, None), (down, None),
                                               norm_weight_offset=1.0, post_norm=post),
    ]
    for call in calls:
        with torch.no_grad():
            plain = call(x)
        tracked = call(x.clone().requires_grad_())
        plain, tracked = (t if isinstance(t, tuple) else (t,) for t in (plain, tracked))
        for p, t in zip(plain, tracked):
            assert torch.equal(p, t.detach())


def test_qk_norm_rotary_embedding_weight_offset(device):
    """Gemma 3's per-head q/k norms (1 + w): gradients against float64 autograd of the oracle."""
    g = torch.Generator().manual_seed(50)
    q, k = (torch.randn(2, 5, h, 32, generator=g).bfloat16().to(device) for h in (4, 2))
    q_weight, k_weight = ((0.1 * torch.randn(32, generator=g)).to(device) for _ in range(2))
    cos, sin = (t.to(device) for t in reference_rope_tables(5, 32))
    leaves = leaves_of(q, k, q_weight, k_weight)
    outputs = coat_functional.qk_norm_rotary_embedding(*leaves, EPS, cos, sin, coat.nn.FP8Config(),
                                                       weight_offset=1.0)
    grads = [torch.randn(o.shape, generator=g).bfloat16().to(device) for o in outputs]

    def oracle(q, k, qw, kw):
        return tuple(reference_rope.qk_norm_rope(x, w, EPS, cos.to(x.device), sin.to(x.device), 1.0)[0]
                     for x, w in ((q, qw), (k, kw)))

    check_against_float64(oracle, outputs, leaves, grads, 2**-7, ONE_ROUNDING_BOUND)


def reference_rope_tables(seq, head_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)[None]
    return emb.cos().float(), emb.sin().float()
