"""GPU check of coat.ops.qk_norm_rope (Qwen3's fused per-head q/k RMSNorm + RoPE): the CUDA kernel against the C
core, bit for bit, at tiny to Qwen3-8B shapes, every group size, strided GEMM-output views, and a converted tiny
Qwen3 model's loss on CUDA against the CPU's. Needs a CUDA GPU and coat built with CUDA.

    python scripts/check_qk_norm_rope_gpu.py
"""
import sys

import torch

import coat


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point and a.element_size() in (1, 2, 4):
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        return a.shape == b.shape and torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def check(batch, seq, q_heads, k_heads, head_dim, group_size, dtype=torch.bfloat16) -> bool:
    generator = torch.Generator().manual_seed(head_dim * 131 + seq)
    width = (q_heads + 2 * k_heads) * head_dim
    qkv = torch.randn(batch * seq, width, generator=generator).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(batch, seq, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(batch, seq, k_heads, head_dim)
    q_weight, k_weight = (1 + 0.3 * torch.randn(head_dim, generator=generator) for _ in range(2))
    cos, sin = (torch.randn(1, seq, head_dim, generator=generator) for _ in range(2))
    args = (q, k, q_weight, k_weight, 1e-6, cos, sin, group_size)
    expected = coat.ops.qk_norm_rope(*args)
    actual = coat.ops.qk_norm_rope(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    ok = all(same_bits(x, y) for x, y in zip(actual, expected))
    print(f"{'ok  ' if ok else 'FAIL'} B={batch} S={seq} Hq={q_heads} Hk={k_heads} D={head_dim} G={group_size} {dtype}")
    return ok


def main():
    if not torch.cuda.is_available() or not coat.built_with_cuda():
        sys.exit("needs a CUDA GPU and coat built with CUDA")
    cases = [(2, 9, 4, 2, 64, 16), (1, 1, 2, 1, 2, 16), (2, 5, 3, 1, 6, 16), (1, 7, 2, 2, 40, 32),
             (1, 3, 2, 1, 256, 128), (2, 70, 8, 2, 128, 64), (4, 2048, 32, 8, 128, 16)]
    ok = all([check(*case) for case in cases] + [check(2, 33, 4, 2, 64, 16, torch.float32),
                                                 check(2, 33, 4, 2, 64, 16, torch.float16)])
    sys.path.insert(0, "tests")
    from test_nn_llama import loss_and_grads, tiny_model, token_batch  # noqa: E402
    from reference_nn import relative_error  # noqa: E402

    losses = []
    for device in ("cpu", "cuda"):
        model = coat.convert(tiny_model("qwen3", device))
        losses.append(loss_and_grads(model, token_batch(device)))
    (cpu_loss, cpu_grads), (cuda_loss, cuda_grads) = losses
    worst = max(relative_error(cuda_grads[n].cpu(), g) for n, g in cpu_grads.items())
    model_ok = abs(cuda_loss.cpu() - cpu_loss) <= 1e-3 * abs(cpu_loss) and worst <= 0.2 * 1.5
    print(f"{'ok  ' if model_ok else 'FAIL'} tiny Qwen3: loss cpu {cpu_loss.item():.4f} cuda {cuda_loss.item():.4f}, "
          f"worst gradient difference {worst:.3f} (FP8 noise, bound 0.3)")
    sys.exit(0 if ok and model_ok else 1)


if __name__ == "__main__":
    main()
