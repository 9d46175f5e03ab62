"""coat.nn.attention: scaled_dot_product_attention without cuDNN's kernel, which coat.convert puts the vision
towers' attention and masked decoder attention under (tests/test_nn_vlm.py checks where it applies)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from coat.nn.attention import sdpa_without_cudnn

SWITCHES = {
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
}


def enabled() -> set:
    return {kernel for kernel, switch in SWITCHES.items() if switch()}


@pytest.mark.parametrize("outer", [None, [SDPBackend.MATH], [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
                                   [SDPBackend.CUDNN_ATTENTION]])
def test_leaves_out_cudnn_from_the_kernels_enabled_and_restores_them(outer):
    """Inside: the kernels enabled outside (torch's default, or an enclosing sdpa_kernel), cuDNN's left out; where
    cuDNN's is the only one, unchanged (the caller chose it). After: as before."""
    with sdpa_kernel(outer) if outer else torch.enable_grad():
        before = enabled()
        with sdpa_without_cudnn():
            inside = enabled()
        assert enabled() == before
    expected = before - {SDPBackend.CUDNN_ATTENTION} or before
    assert inside == expected


def attention_gradients(device, seq=64, shift=120.0):
    """dq, dk, dv of one non-causal attention of ``seq`` keys, 6 heads of 64, bf16, every logit about -``shift``
    (every row's logsumexp below -ln(FLT_MAX) = -88.7: where cuDNN's backward overflows, coat.nn.attention)."""
    generator = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(1, 6, seq, 64, generator=generator) * 0.1 for _ in range(3))
    q[..., 0], k[..., 0] = 1.0, -shift * math.sqrt(64)
    q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in (q, k, v))
    with sdpa_without_cudnn():
        out = F.scaled_dot_product_attention(q, k, v)
    out.backward(torch.randn(out.shape, generator=generator).to(device, out.dtype) * 1e-5)
    return out.grad_fn, q.grad, k.grad, v.grad


@pytest.mark.parametrize("seq", [64, 192])
def test_gradients_stay_finite_where_every_logit_is_very_negative(device, seq):
    """The case of pytorch#196678 (64 mod 128 keys, logsumexp < -88.7), the shape of Qwen2.5-VL's vision windows:
    on an H100 with torch 2.11, cuDNN's kernel (torch's choice there) gave NaN query gradients
    (benchmarks/results/check-sdpa-backward-*.log); under sdpa_without_cudnn every gradient is finite."""
    grad_fn, *grads = attention_gradients(device, seq)
    assert "Cudnn" not in grad_fn.name()
    for grad in grads:
        assert torch.isfinite(grad).all()


def test_compiles_as_one_graph():
    """Reading the kernel switches would break the graph; they are read once, when the function is traced."""
    def attend(q):
        with sdpa_without_cudnn():
            return F.scaled_dot_product_attention(q, q, q)

    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    explanation = torch._dynamo.explain(attend)(q)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(q)
    assert torch.equal(compiled, attend(q))
