"""Bandwidth of coat's FP8 quantizers against a device-to-device copy measured in the same run.

GB/s counts the bytes each op must move at the least (inputs read once, outputs written once); the
copy reads and writes bf16. Target on H100/H200: every quantizer at >= 85% of the copy's GB/s.
Per-tensor quantization without a precomputed amax needs two passes over x by construction (amax, then
quantize); its bytes count both reads. A plain-PyTorch per-group quantizer is timed for context.
"ms" is the GPU's time (each call enqueued while the GPU is kept busy, _common.time_cuda_gpu_ms), on which the
bandwidths are computed; "ms with dispatch" adds the host's time to enqueue the call on an idle GPU (Python, the
op's checks and allocations), what a caller that waits for one small call sees.

    python benchmarks/quantize.py            (needs a CUDA GPU)
"""
import sys

import torch

import coat
from coat import ops

from _common import parser, print_table, time_cuda_gpu_ms, time_cuda_ms, write_results

SHAPES = [(8192, 8192), (4096, 14336)]
TARGET = 0.85


def torch_quantize_group(x, group_size):
    """The same per-group quantization in eager PyTorch, for context."""
    groups = x.float().view(-1, group_size)
    scale = (groups.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(2.0**-126)
    return (groups / scale).to(torch.float8_e4m3fn), scale


def cases(x):
    n = x.numel()
    rows, cols = x.shape
    group_amax_128 = ops.group_amax(x, 128)
    q16, s16, _ = ops.quantize_group(x, 16)
    copy_dst = torch.empty_like(x)
    # name -> (callable, bytes moved)
    return {
        "copy (bf16)": (lambda: copy_dst.copy_(x), 4 * n),
        "quantize_group G=16": (lambda: ops.quantize_group(x, 16), 2 * n + n + 4 * n // 16),
        "quantize_group G=128": (lambda: ops.quantize_group(x, 128), 2 * n + n + 4 * n // 128),
        "quantize_group G=128 +transpose": (
            lambda: ops.quantize_group(x, 128, transpose=True),
            2 * n + 2 * n + 4 * n // 128,
        ),
        "group_amax G=128 (stage 1)": (lambda: ops.group_amax(x, 128), 2 * n + 4 * n // 128),
        "quantize_tensor, amax given (stages 2+3)": (
            lambda: ops.quantize_tensor(x, group_amax=group_amax_128),
            4 * n // 128 + 2 * n + n,
        ),
        "quantize_tensor +transpose, amax given": (
            lambda: ops.quantize_tensor(x, group_amax=group_amax_128, transpose=True),
            4 * n // 128 + 2 * n + 2 * n,
        ),
        "quantize_tensor (stages 1+2+3, two passes)": (
            lambda: ops.quantize_tensor(x, group_size=128),
            (2 * n + 4 * n // 128) * 2 + 2 * n + n,
        ),
        "dequantize G=16 -> bf16": (lambda: ops.dequantize(q16, s16, 16), n + 4 * n // 16 + 2 * n),
        "torch eager per-group G=128 (context)": (lambda: torch_quantize_group(x, 128), 2 * n + n + 4 * n // 128),
    }


def main():
    args = parser(__doc__).parse_args()
    if not torch.cuda.is_available() or not coat.built_with_cuda():
        sys.exit("benchmarks/quantize.py needs a CUDA GPU and coat built with CUDA")
    rows = []
    torch.manual_seed(0)
    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        timed = {
            name: (time_cuda_gpu_ms(fn, args.warmup, args.repeat), time_cuda_ms(fn, args.warmup, args.repeat), nbytes)
            for name, (fn, nbytes) in cases(x).items()
        }
        copy_gbs = timed["copy (bf16)"][2] / timed["copy (bf16)"][0] / 1e6
        for name, (ms, dispatch_ms, nbytes) in timed.items():
            gbs = nbytes / ms / 1e6
            rows.append(
                {
                    "shape": f"{shape[0]}x{shape[1]}",
                    "op": name,
                    "ms": ms,
                    "ms with dispatch": dispatch_ms,
                    "GB/s": gbs,
                    "vs copy": gbs / copy_gbs,
                    "meets 85%": "" if name.startswith(("copy", "torch")) else ("yes" if gbs / copy_gbs >= TARGET else "NO"),
                }
            )
    print_table(rows, ["shape", "op", "ms", "ms with dispatch", "GB/s", "vs copy", "meets 85%"])
    path = write_results(args.results_dir, "quantize", rows, {"target_fraction_of_copy": TARGET})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
