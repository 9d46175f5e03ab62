"""Shared by the optimizer tests: batches of text, a tiny Llama from transformers, and for the coat.optim.AdamW tests
(tests/test_optim_adamw*.py) their parameters and gradients, a training loop, bit-exact run comparisons and the
one-thread fixture (autouse where a test module imports it)."""
from __future__ import annotations

import pytest
import torch

from coat import ops
from coat.optim import AdamW


def text_batches(tokens: torch.Tensor, steps: int, batch: int, context: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` random windows of ``context`` tokens, the same for every seed-equal call."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - context, (steps, batch), generator=generator)
    return [torch.stack([tokens[s : s + context] for s in row.tolist()]) for row in starts]


def tiny_llama(seed: int, hidden: int = 64, layers: int = 2, intermediate: int = 128, heads: int = 4,
               attention: str = "eager"):
    """A LlamaForCausalLM with a byte vocabulary, initialised from ``seed``. Eager attention by default: the
    same kernels forward and backward on every run, so two runs on the same data agree bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# Shapes with short last groups at G = 16 and 128, a 3-D tensor, a vector and a scalar.
SHAPES = {"matrix": (24, 40), "wide": (3, 300), "cube": (2, 3, 20), "vector": (50,), "scalar": ()}
MOMENTS = (("exp_avg", "exp_avg_meta"), ("exp_avg_sq", "exp_avg_sq_meta"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster than two, and keeps the run time steady on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for name, shape in SHAPES.items()
    }


def make_grads(steps: int, seed: int = 1, shapes: dict = SHAPES) -> list[dict[str, torch.Tensor]]:
    """Gaussian gradients times magnitudes spread over two decades within each group, as real ones are."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            name: torch.randn(shape, generator=generator) * 10 ** torch.empty(shape).uniform_(-2, 0, generator=generator)
            for name, shape in shapes.items()
        }
        for _ in range(steps)
    ]


def clone_params(params: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    return {name: torch.nn.Parameter(p.detach().clone()) for name, p in params.items()}


def train(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]],
          grad_dtype: torch.dtype | None = None) -> None:
    for step_grads in grads:
        for name, p in params.items():
            grad = step_grads[name].to(grad_dtype or p.dtype)
            if grad.dtype != p.dtype:
                p.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept it
            p.grad = grad
        opt.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so that comparisons are exact and NaN equals NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_run(params_a, opt_a, params_b, opt_b, names=None) -> None:
    for name in names or params_a:
        pa, pb = params_a[name], params_b[name]
        assert torch.equal(bits(pa.detach()), bits(pb.detach())), f"parameter {name} differs"
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa["step"].item() == sb["step"].item(), name
        for key in ("exp_avg", "exp_avg_meta", "exp_avg_sq", "exp_avg_sq_meta"):
            assert torch.equal(bits(sa[key]), bits(sb[key])), f"state {key} of {name} differs"


def dequantized(opt: AdamW, p: torch.Tensor, codes_key: str, meta_key: str) -> torch.Tensor:
    state = opt.state[p]
    codes = state[codes_key]
    rows = codes.view(1) if codes.dim() == 0 else codes
    group_size = opt.param_groups[0]["group_size"]
    return ops.dequantize_expanded(rows, state[meta_key], group_size).view(codes.shape)

