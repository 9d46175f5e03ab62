"""Bandwidth of coat's block-scaled FP4 and FP6 kernels (quantize_blocks, dequantize_blocks, blocks_to_e4m3 with
format "fp4" and "fp6") against a device-to-device copy measured in the same run.

GB/s counts the bytes each op must move at the least (inputs read once, outputs written once: bf16 x, half a
byte per FP4 code and three quarters per FP6 code, 4 bytes per block scale, one byte per E4M3 code); the copy
reads and writes bf16. Target on
H100/H200: every op at >= 85% of the copy's GB/s. Shapes are activations of a 7B / 8B model's RMSNorm input
(hidden 4096) and SiLU*mul inputs (intermediate 14336) at 8192 tokens; an odd width times the element-wise path.

    python benchmarks/fp4.py            (needs a CUDA GPU)
    python benchmarks/fp4.py --smoke    (tiny shapes on the CPU: checks that the script runs)
"""
import sys

import torch

import coat
from coat import ops

from _common import parser, print_table, time_ms, write_results

SHAPES = [(8192, 4096), (8192, 14336), (8192, 4095)]
SMOKE_SHAPES = [(64, 256), (33, 37)]
BLOCK_SIZES = (16, 128)
TARGET = 0.85


def cases(x, fmt, block_size):
    """name -> (callable, bytes moved)."""
    n, cols = x.numel(), x.shape[-1]
    code_bytes = x.shape[0] * (-(-cols // 2) if fmt == "fp4" else -(-3 * cols // 4))
    scale_bytes = 4 * x.shape[0] * -(-cols // block_size)
    codes, scales = ops.quantize_blocks(x, fmt, block_size)
    return {
        f"quantize_{fmt} B={block_size}": (lambda: ops.quantize_blocks(x, fmt, block_size),
                                           2 * n + code_bytes + scale_bytes),
        f"dequantize_{fmt} B={block_size} -> bf16": (
            lambda: ops.dequantize_blocks(codes, scales, cols, fmt, block_size), code_bytes + scale_bytes + 2 * n),
        f"{fmt}_to_e4m3 B={block_size}": (lambda: ops.blocks_to_e4m3(codes, scales, cols, fmt, block_size),
                                          code_bytes + n),
    }


def measure(shape, device, warmup, repeat):
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    copy_destination = torch.empty_like(x)
    timed = {"copy (bf16)": (time_ms(lambda: copy_destination.copy_(x), warmup, repeat, device), 4 * x.numel())}
    for fmt in ops.BLOCK_FORMATS:
        for block_size in BLOCK_SIZES:
            timed.update({name: (time_ms(fn, warmup, repeat, device), nbytes)
                          for name, (fn, nbytes) in cases(x, fmt, block_size).items()})
    copy_gbs = timed["copy (bf16)"][1] / timed["copy (bf16)"][0] / 1e6
    rows = []
    for name, (ms, nbytes) in timed.items():
        gbs = nbytes / ms / 1e6
        rows.append({"shape": f"{shape[0]}x{shape[1]}", "op": name, "ms": ms, "GB/s": gbs, "vs copy": gbs / copy_gbs,
                     "meets 85%": "" if name.startswith("copy") else ("yes" if gbs / copy_gbs >= TARGET else "NO")})
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, one run each")
    args = p.parse_args()
    if args.smoke:
        device, shapes, args.warmup, args.repeat = "cpu", SMOKE_SHAPES, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/fp4.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, shapes = "cuda", SHAPES
    torch.manual_seed(0)
    rows = [row for shape in shapes for row in measure(shape, device, args.warmup, args.repeat)]
    print_table(rows, ["shape", "op", "ms", "GB/s", "vs copy", "meets 85%"])
    summary = {"smoke": args.smoke, "target_fraction_of_copy": TARGET}
    path = write_results(args.results_dir, "fp4-smoke" if args.smoke else "fp4", rows, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
