"""coat.nn.experts (FP8 mixture-of-experts MLPs) against the float64 oracle of transformers' experts.

Bounds as in test_nn_modules.py: forward a chain of E4M3 roundings (0.12), backward with E5M2 gradients on top
(0.2). The routing itself is exact: the padded layout is checked element by element.
"""
import pytest
import torch

import coat.nn.experts as experts
import reference_nn as reference
from coat.nn import FP8Config
from reference_nn import relative_error

FORWARD_CHAIN_BOUND = 0.12
BACKWARD_CHAIN_BOUND = 0.20
TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 40, 64, 48, 6, 2


def make_inputs(device, seed=0, empty_expert=None, tokens=TOKENS):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).bfloat16().to(device)

    x = randn(tokens, HIDDEN)
    logits = torch.randn(tokens, EXPERTS, generator=generator)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    weights, index = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    gate_up = randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5)
    down = randn(EXPERTS, HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5)
    return x, index.to(device), weights.bfloat16().to(device), gate_up, down


def test_route_layout():
    index = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 1], [2, 0]])
    routing = experts.route(index, 4)
    tokens, k = index.shape
    assert routing.rows == -(-(tokens * k + 15 * 4) // 16) * 16
    ends = routing.offsets.tolist()
    assert ends[-1] == routing.rows and all(end % 16 == 0 for end in ends)
    starts = [0] + ends[:-1]
    for flat, row in enumerate(routing.dest.tolist()):
        expert = index.view(-1)[flat].item()
        assert starts[expert] <= row < ends[expert], (flat, row, expert)
        assert routing.row_token[row] == flat // k
    # The rows of one expert keep the tokens' order and come first in its group; the rest is padding.
    for expert in range(4):
        tokens_of_expert = (index == expert).nonzero()[:, 0].tolist()
        group = routing.row_token[starts[expert]:ends[expert]].tolist()
        assert group[:len(tokens_of_expert)] == tokens_of_expert
        assert all(token == tokens for token in group[len(tokens_of_expert):])
    assert routing.padding.tolist() == (routing.row_token == tokens).nonzero()[:, 0].tolist()


def test_permute_rows_moves_fp8_bytes_and_zeroes_padding():
    index = torch.tensor([[1, 0], [0, 1], [1, 0]])
    routing = experts.route(index, 2)
    x = torch.randn(3, 32).to(torch.float8_e4m3fn)
    rows = experts.permute_rows(x, routing)
    assert rows.dtype == x.dtype and rows.shape == (routing.rows, 32)
    padding = routing.row_token == 3
    assert torch.equal(rows.view(torch.uint8)[padding], torch.zeros_like(rows.view(torch.uint8)[padding]))
    assert torch.equal(rows.view(torch.uint8)[~padding], x.view(torch.uint8)[routing.row_token[~padding]])


@pytest.mark.parametrize("empty_expert", [None, 3])
def test_experts_forward_and_backward(device, empty_expert):
    x, index, weights, gate_up, down = make_inputs(device, empty_expert=empty_expert)
    leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    out = experts.fp8_experts(leaves[0], index, leaves[1], leaves[2], leaves[3])
    grad_out = make_inputs(device, seed=1)[0]
    out.backward(grad_out)

    exact_leaves = [t.detach().double().cpu().requires_grad_() for t in (x, weights, gate_up, down)]
    exact = reference.moe_experts(exact_leaves[0], index.cpu(), exact_leaves[1], exact_leaves[2], exact_leaves[3])
    exact.backward(grad_out.double().cpu())
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    print(f"experts forward {relative_error(out.cpu(), exact):.3f}")
    assert relative_error(out.cpu(), exact) <= FORWARD_CHAIN_BOUND
    for name, leaf, exact_leaf in zip(("dx", "dweights", "dgate_up", "ddown"), leaves, exact_leaves):
        assert leaf.grad.dtype == leaf.dtype
        if empty_expert is not None and name in ("dgate_up", "ddown"):
            assert torch.equal(leaf.grad[empty_expert].cpu(), torch.zeros_like(leaf.grad[empty_expert].cpu()))
            keep = [e for e in range(EXPERTS) if e != empty_expert]
            actual, expected = leaf.grad[keep].cpu(), exact_leaf.grad[keep]
        else:
            actual, expected = leaf.grad.cpu(), exact_leaf.grad
        print(f"experts {name} {relative_error(actual, expected):.3f}")
        assert relative_error(actual, expected) <= BACKWARD_CHAIN_BOUND


def test_experts_saves_fp8_and_the_shared_input(device):
    x, index, weights, gate_up, down = make_inputs(device)
    x = x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        experts.fp8_experts(x, index, weights.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_())
    large = [t for t in saved if t.numel() >= TOKENS * HIDDEN // 2 and t.data_ptr() not in
             (gate_up.data_ptr(), down.data_ptr())]
    # x (the router keeps it too) and gate and up in 1 x G FP8 groups; nothing else of activation size.
    assert [t.data_ptr() for t in large if t.dtype == torch.bfloat16] == [x.data_ptr()]
    assert sorted((t.dtype, tuple(t.shape)) for t in large if t.dtype != torch.bfloat16) == [
        (torch.float8_e4m3fn, (experts.route(index, EXPERTS).rows, INTERMEDIATE))] * 2


def test_experts_refuse_what_they_do_not_compute():
    x, index, weights, gate_up, down = make_inputs("cpu")
    with pytest.raises(ValueError, match="gate_up"):
        experts.fp8_experts(x, index, weights, gate_up[:, :-1], down)
    with pytest.raises(ValueError, match="top_k_index"):
        experts.fp8_experts(x, index[:-1], weights, gate_up, down)
    with pytest.raises(ValueError, match="gradient_format=None"):
        experts.fp8_experts(x, index, weights, gate_up, down, FP8Config(gradient_format=None))
    with pytest.raises(ValueError, match="smooth_swiglu"):
        experts.fp8_experts(x, index, weights, gate_up, down, FP8Config(smooth_swiglu=True))


@pytest.mark.parametrize("fast_accum", [True, False])
def test_experts_fast_accum_reaches_every_grouped_gemm(monkeypatch, fast_accum):
    """FP8Config.experts_fast_accum is what the six grouped GEMMs (two forward, two dgrad, two wgrad) ask torch's
    FP8 grouped GEMM for. Its GPU path runs here against a stand-in of torch._scaled_grouped_mm that records the
    flag and multiplies as the CPU path does, so the results are the CPU path's."""
    asked = []

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
        asked.append(use_fast_accum)
        assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        out = experts.grouped_mm_float32(a.float(), b.float(), offs)
        return (out * (scale_a[0] * scale_b[0])).to(out_dtype)

    x, index, weights, gate_up, down = make_inputs("cpu")
    config = FP8Config(experts_fast_accum=fast_accum)

    def step():
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        out = experts.fp8_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], config)
        out.backward(make_inputs("cpu", seed=1)[0])
        return [out, *(leaf.grad for leaf in leaves)]

    cpu = step()
    monkeypatch.setattr(experts, "_device_has_fp8_gemm", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    gpu_path = step()
    assert asked == [fast_accum] * 6
    for expected, actual in zip(cpu, gpu_path):
        assert torch.equal(actual, expected)
