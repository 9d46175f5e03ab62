"""FP8 GEMMs and coat.nn.Linear against BF16 at Llama-7B shapes.

1. GEMM throughput: y = x W^T with x [M, K], W [N, K], M = 8192 tokens, (K, N) the projections of
   Llama-2-7B. BF16 torch.mm against coat's FP8 GEMM (torch._scaled_mm, per-tensor scales, fp32
   accumulation, BF16 output) on operands already in FP8, and with the quantization of both operands.
   "ms" is a call timed from an idle GPU, "GPU ms" the GPU work alone (_common.time_cuda_gpu_ms), "host us"
   the host's time per call with the GPU kept busy (_common.host_us_per_call). TFLOP/s = 2 M N K / GPU ms.
2. Layers, forward and forward+backward (input and weight gradients): torch.nn.Linear in BF16 (the
   baseline), torchao's float8 Linear (convert_to_float8_training, tensorwise scaling) under torch.compile
   (the peer a user would pick instead; the row says so when torchao is not installed: pip install
   --no-build-isolation -e ".[bench]"), and coat.nn.Linear with E5M2 gradients and FP8 backward GEMMs (coat's default) and with BF16
   backward GEMMs.

    python benchmarks/linear.py            (a CUDA GPU with FP8 tensor cores: H100/H200)
    python benchmarks/linear.py --smoke    (tiny shapes on the CPU: checks that the script runs)
"""
import copy
import statistics
import sys

import torch

import coat
from coat.nn import functional as coat_functional

from _common import compile_for_fixed_shapes, host_us_per_call, parser, print_table, time_cuda_gpu_ms, time_ms, write_results

TOKENS = 8192
PROJECTIONS = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 12288)]  # (K, N): o/q, gate/up, down, qkv
SMOKE_TOKENS, SMOKE_PROJECTIONS = 64, [(64, 48), (40, 24)]
HOST_CALLS = 100  # calls per host-time measurement


def gemm_rows(tokens, k, n, device, warmup, repeat):
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    x_q, x_scale, _ = coat_functional.quantize_per_tensor(x, torch.float8_e4m3fn)
    w_q, w_scale, _ = coat_functional.quantize_per_tensor(w, torch.float8_e4m3fn)
    cases = {
        "bf16 torch.mm": lambda: torch.mm(x, w.t()),
        "fp8 GEMM": lambda: coat_functional.fp8_gemm(x_q, x_scale, w_q, w_scale, torch.bfloat16),
        "fp8 GEMM + quantize x, W": lambda: coat_functional.linear(x, w),
    }
    flops = 2 * tokens * k * n
    rows = []
    for name, fn in cases.items():
        ms = time_ms(fn, warmup, repeat, device)
        gpu_ms = time_cuda_gpu_ms(fn, warmup, repeat) if device == "cuda" else ms
        rows.append({"M": tokens, "K": k, "N": n, "op": name, "ms": ms, "GPU ms": gpu_ms,
                     "host us": host_us_per_call(fn, HOST_CALLS, repeat, device), "TFLOP/s": flops / gpu_ms / 1e9})
    for row in rows:
        row["vs bf16"] = rows[0]["GPU ms"] / row["GPU ms"]
    return rows


def torchao_float8_linear(reference: torch.nn.Linear, device):
    """torchao's float8 training Linear (tensorwise) compiled, or why it cannot be built."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as error:
        return f"torchao is not installed ({error.name}): pip install --no-build-isolation -e '.[bench]'"
    if torch.device(device).type != "cuda":
        return "torchao float8 needs a CUDA GPU"
    return compile_for_fixed_shapes(convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(reference))))


def layer_rows(tokens, k, n, device, warmup, repeat):
    reference = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    layers = {
        "torch.nn.Linear (bf16)": reference,
        "torchao float8 compiled": torchao_float8_linear(reference, device),
        "coat.nn.Linear (e5m2 grads)": coat.nn.Linear.from_linear(reference),
        "coat.nn.Linear (bf16 grads)": coat.nn.Linear.from_linear(
            reference, coat.nn.FP8Config(gradient_format=None)
        ),
    }
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

    def forward_backward(layer):
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        layer(x).backward(grad)

    rows = []
    for name, layer in layers.items():
        if isinstance(layer, str):
            rows.append({"M": tokens, "K": k, "N": n, "layer": name, "missing": layer})
            continue
        forward = time_ms(lambda: layer(x), warmup, repeat, device)
        total = time_ms(lambda: forward_backward(layer), warmup, repeat, device)
        rows.append({"M": tokens, "K": k, "N": n, "layer": name, "fwd ms": forward, "fwd+bwd ms": total})
    for row in rows:
        if "missing" not in row:
            row["fwd vs bf16"] = rows[0]["fwd ms"] / row["fwd ms"]
            row["fwd+bwd vs bf16"] = rows[0]["fwd+bwd ms"] / row["fwd+bwd ms"]
    return rows


def main():
    p = parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, one run each")
    p.add_argument("--projections", nargs="+", metavar="KxN", help="e.g. 4096x11008 (default: Llama-7B's four)")
    args = p.parse_args()
    if args.smoke:
        device, tokens, projections, args.warmup, args.repeat = "cpu", SMOKE_TOKENS, SMOKE_PROJECTIONS, 1, 1
    else:
        if not torch.cuda.is_available() or not coat.built_with_cuda():
            sys.exit("benchmarks/linear.py needs a CUDA GPU and coat built with CUDA (or --smoke)")
        device, tokens, projections = "cuda", TOKENS, PROJECTIONS
    if args.projections:
        projections = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.projections]
    torch.manual_seed(0)

    gemms = [row for k, n in projections for row in gemm_rows(tokens, k, n, device, args.warmup, args.repeat)]
    print_table(gemms, ["M", "K", "N", "op", "ms", "GPU ms", "host us", "TFLOP/s", "vs bf16"])
    print()
    layers = [row for k, n in projections for row in layer_rows(tokens, k, n, device, args.warmup, args.repeat)]
    print_table(layers, ["M", "K", "N", "layer", "fwd ms", "fwd+bwd ms", "fwd vs bf16", "fwd+bwd vs bf16", "missing"])

    fp8_speedups = [row["vs bf16"] for row in gemms if row["op"] == "fp8 GEMM"]

    def host_us(op):
        return statistics.median(row["host us"] for row in gemms if row["op"] == op)

    summary = {"smoke": args.smoke, "fp8_gemm_speedup_min": min(fp8_speedups), "fp8_gemm_speedup_max": max(fp8_speedups),
               "host_us_bf16_mm": host_us("bf16 torch.mm"), "host_us_fp8_gemm": host_us("fp8 GEMM")}
    path = write_results(args.results_dir, "linear-smoke" if args.smoke else "linear", gemms + layers, summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
