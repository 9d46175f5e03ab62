"""Which of scaled_dot_product_attention's kernels give finite gradients where every attention row's logsumexp is
very negative (all its logits near -SHIFT), at the shapes of a Qwen2.5-VL vision tower's attention (one picture or
window of 64 patches, non-causal, no mask, bf16, head_dim 64) and around them (64 mod 128 and multiples of 128,
with and without a mask). examples/train_vlm.py's gpu preset went NaN in that attention's backward on an H100
(benchmarks/NOTES.md); pytorch#196678 reports cuDNN's backward overflowing at such rows and lengths. Prints, for
each case, the kernel torch picks by default and the non-finite counts of dq, dk and dv under each kernel; exits 1
if the default kernel gives non-finite gradients anywhere.

    python scripts/check_sdpa_backward.py            (a CUDA GPU; on a CPU, its flash and math kernels)
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH)
CPU_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)


def nonfinite_gradients(seq: int, shift: float, masked: bool, device: str, backend=None) -> tuple | str:
    """(non-finite counts of dq, dk, dv, the backward's autograd function) for one picture of ``seq`` patches,
    6 heads of 64, whose logits are all about -``shift``; ``backend`` None lets torch choose."""
    generator = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(1, 6, seq, 64, generator=generator) * 0.1 for _ in range(3))
    q[..., 0], k[..., 0] = 1.0, -shift * math.sqrt(64)  # q . k / sqrt(64) ~ -shift for every pair
    q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in (q, k, v))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device) if masked else None
    try:
        with sdpa_kernel([backend]) if backend is not None else torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(torch.randn(out.shape, generator=generator).to(device, out.dtype) * 1e-5)
    except RuntimeError as error:  # the kernel does not take this case
        return str(error).splitlines()[0][:60]
    return (*(int((~torch.isfinite(t.grad)).sum()) for t in (q, k, v)), out.grad_fn.name())


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = CUDA_BACKENDS if device == "cuda" else CPU_BACKENDS
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    failed = False
    for seq in (64, 128, 192, 256):
        for masked in (False, True):
            for shift in (0.0, 120.0):
                default = nonfinite_gradients(seq, shift, masked, device)
                failed |= isinstance(default, tuple) and any(default[:3])
                each = ", ".join(f"{b.name.lower()} {nonfinite_gradients(seq, shift, masked, device, b)}"
                                 for b in backends)
                print(f"seq {seq:3d} {'mask   ' if masked else 'no mask'} logits ~{-shift:6.1f}: "
                      f"default {default}; {each}")
    print("the default kernel gave non-finite gradients" if failed else "every default gradient was finite")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
