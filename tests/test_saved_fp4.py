"""coat.nn.saved_in_fp4: what it keeps in FP4, what it leaves alone, and that backward reads exactly the
FP4 round trip (the float64 oracle of tests/reference_blocks.py) of each saved activation, in its layout."""
import contextlib

import pytest
import torch

import coat
import reference_blocks
from conftest import to_device


def fp4_round_trip(t: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """The oracle's quantize and dequantize, in blocks along ``t``'s last dimension."""
    rows = t.detach().cpu().reshape(-1, t.shape[-1])
    codes, scales = reference_blocks.quantize(rows, "fp4", block_size)
    out_dtype = torch.bfloat16 if t.dtype == torch.bfloat16 else torch.float32
    back = reference_blocks.dequantize(codes, scales, t.shape[-1], "fp4", block_size, out_dtype)
    return back.to(t.dtype).reshape(t.shape).to(t.device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_reads_the_fp4_round_trip_of_each_activation(device, rng, dtype):
    x = to_device(torch.randn(6, 40, generator=rng).to(dtype), device).requires_grad_()
    y, z = torch.tanh(x), torch.cos(x)
    with coat.nn.saved_in_fp4():
        out = y * z
    saved_self, saved_other = out.grad_fn._saved_self, out.grad_fn._saved_other
    torch.testing.assert_close(saved_self, fp4_round_trip(y), rtol=0, atol=0)
    torch.testing.assert_close(saved_other, fp4_round_trip(z), rtol=0, atol=0)
    assert saved_self.dtype == dtype and saved_self.shape == y.shape
    assert not torch.equal(saved_self, y)


def test_blocks_run_along_the_innermost_dimension_in_memory_and_the_layout_comes_back(device, rng):
    """Attention saves [B, H, S, D] views of [B, S, H, D] buffers: quantizing them copies nothing, and
    backward gets the strides forward saved."""
    base = to_device(torch.randn(2, 8, 3, 32, generator=rng).to(torch.bfloat16), device).requires_grad_()
    with coat.nn.saved_in_fp4():
        out = torch.sigmoid(base.transpose(1, 2))  # [2, 3, 8, 32] with the input's strides
    saved = out.grad_fn._saved_result
    assert saved.stride() == out.stride() and not out.is_contiguous()
    torch.testing.assert_close(saved, fp4_round_trip(out), rtol=0, atol=0)

    columns = to_device(torch.randn(4, 32, generator=rng).to(torch.bfloat16), device).requires_grad_()
    with coat.nn.saved_in_fp4():
        out = torch.sigmoid(columns.t())  # [32, 4], innermost in memory: the dimension of 32
    saved = out.grad_fn._saved_result
    assert saved.stride() == out.stride() == (1, 32)
    torch.testing.assert_close(saved, fp4_round_trip(out.t()).t(), rtol=0, atol=0)


def test_parameters_their_casts_and_float32_tensors_are_left_alone(device, rng):
    """A linear layer under autocast saves its input (an activation: FP4) and the bfloat16 copy of its float32
    weight (not an activation: exact); relu's float32 result stays exact too."""
    layer = torch.nn.Linear(32, 48, bias=False).to(device)
    x = to_device(torch.randn(5, 32, generator=rng), device).requires_grad_()
    g = to_device(torch.randn(5, 48, generator=rng).to(torch.bfloat16), device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    with autocast:
        reference = layer(torch.relu(x))
    with autocast, coat.nn.saved_in_fp4():
        out = layer(torch.relu(x))
    dx_ref, dw_ref = torch.autograd.grad(reference, (x, layer.weight), g)
    dx, dw = torch.autograd.grad(out, (x, layer.weight), g)
    # dgrad reads the exact weight copy and relu's float32 result: unchanged bit for bit
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    # wgrad reads the FP4 copy of the bfloat16 input
    kept_input = fp4_round_trip(torch.relu(x).detach().to(torch.bfloat16))
    expected_dw = (g.float().t() @ kept_input.float()).to(torch.bfloat16).float()
    torch.testing.assert_close(dw, expected_dw, rtol=2**-7, atol=1e-6)
    assert not torch.equal(dw, dw_ref)


def test_a_block_with_nan_or_inf_comes_back_as_nan(device):
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, 3] = float("inf")
    x[1, 20] = float("nan")
    x = to_device(x, device).requires_grad_()
    with coat.nn.saved_in_fp4():
        out = torch.exp(x * 1)
    saved = out.grad_fn._saved_result
    assert torch.isnan(saved[0, :16]).all() and torch.isnan(saved[1, 16:]).all()
    assert not torch.isnan(saved[0, 16:]).any() and not torch.isnan(saved[1, :16]).any()


@pytest.mark.transformers
def test_a_converted_llama_trains_through_it(device):
    """A coat-converted Llama with FP4-kept norm and MLP inputs, under bf16 autocast: saved_in_fp4 also keeps
    attention's q, k, v and probabilities in FP4, and every gradient stays finite and near, not equal to,
    the one without it."""
    from optim_helpers import tiny_llama

    def gradients(uniform: bool) -> list[torch.Tensor]:
        model = tiny_llama(seed=0).to(device)
        coat.convert(model, saved_format="fp4")
        batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16), \
                coat.nn.saved_in_fp4() if uniform else contextlib.nullcontext():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    exact, uniform = gradients(False), gradients(True)
    assert len(exact) == len(uniform) and all(torch.isfinite(g).all() for g in uniform)
    assert any(not torch.equal(a, b) for a, b in zip(exact, uniform))
    difference = torch.cat([(a - b).flatten() for a, b in zip(exact, uniform)]).norm()
    assert difference < 0.5 * torch.cat([a.flatten() for a in exact]).norm()


def test_refuses_a_block_size_it_has_no_codec_for():
    with pytest.raises(ValueError, match="block_size must be 16, 32, 64 or 128"):
        with coat.nn.saved_in_fp4(block_size=8):
            pass
