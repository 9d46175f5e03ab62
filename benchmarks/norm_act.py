"""Bandwidth of coat's fused RMSNorm and SiLU*mul ops against plain PyTorch ops measured in the same run.

GB/s counts the bytes each op must move at the least, by the model in benchmarks/NOTES.md ("Fused RMSNorm
and SiLU*mul"), with N = rows * H elements and bf16 inputs:

    rmsnorm_quantize       6.25 N  (x read twice 4N, x_saved N, its 1x16 scales N/4, y N) + N with y_t
    rmsnorm_backward       5.25 N  (dy 2N, x_saved N + N/4, dx 2N)
      +residual            7.25 N  (and the residual 2N, added to dx in the kernel); the same op followed by
                                   torch's add is timed for context, by the same count
    rmsnorm_requantize     2.25 N  (x_saved N + N/4, y_t N): y_t recomputed in backward instead of kept
    silu_mul_quantize     11.5  N  (gate, up read twice 8N, saved 2N + N/2, y N) + N with y_t
    silu_mul_backward      8.5  N  (dy 2N, saved 2N + N/2, dgate, dup 4N)
    silu_mul_requantize    3.5  N  (saved 2N + N/2, y_t N)
    with FP4-saved inputs (save_format="fp4", G = 16): the saved codes are N/2 instead of N per input, so
      rmsnorm_quantize 5.25 N, rmsnorm_backward 4.75 N, rmsnorm_requantize 1.75 N, silu_mul_quantize 10.5 N,
      silu_mul_backward 7.5 N, silu_mul_requantize 2.5 N; fp4_to_e4m3, the expansion the backward ops ran
      before they read FP4 themselves, 1.5 N (codes N/2, E4M3 N), timed for context
    silu_mul_backward, FP4 saved in groups of 128 (the scales N/32 per input): 7.06 N; its kernel computes the
      gates' sigmoids once per code of a group (16 per 128 gates) instead of once per gate
    F.rms_norm (bf16)      4    N  (x 2N, y 2N): the "plain RMSNorm pass"
    silu(g) * u (bf16)     6    N  (g, u 4N, y 2N) by the same rule, although eager PyTorch runs two kernels
    the non-gated act (--non-gated: up=None, the act of CLIP's, SigLIP's and Qwen3-VL's vision MLPs), at vision
      towers' widths: quantize 6.25 N (gate read twice 4N, saved N + N/4, y N) + N with y_t, backward 5.25 N,
      requantize 2.25 N; FP4 saved 5.75 N, 4.75 N (G=128: 4.53 N), 1.75 N; act(g) (bf16, eager) 4 N

Target (COAT appendix J): rmsnorm_quantize within 5% of a plain RMSNorm pass by bytes, i.e. its GB/s at least
95% of F.rms_norm's. The unfused chain of standalone ops is timed for context. "ms" is the GPU's time (each
call enqueued while the GPU is kept busy, _common.time_cuda_gpu_ms), on which the bandwidths are computed; "ms
with dispatch" adds the host's time to enqueue the call on an idle GPU.

    python benchmarks/norm_act.py            (needs a CUDA GPU)
    python benchmarks/norm_act.py --activation gelu_tanh      (the act*mul rows with GeGLU's activation)
    python benchmarks/norm_act.py --activation quick_gelu --non-gated      (CLIP's MLP activation)
"""
import sys

import torch
import torch.nn.functional as F

import coat
from coat import ops
from coat.nn.layers import ACTIVATION_FUNCTIONS

from _common import parser, print_table, time_cuda_gpu_ms, time_cuda_ms, write_results

RMSNORM_SHAPES = [(4096, 4096), (16384, 4096), (8192, 8192)]
SILU_SHAPES = [(4096, 11008), (16384, 14336)]
# The non-gated act's rows at vision towers' MLPs: 4,096 patches of SigLIP-so400m's / Qwen3-VL's width (4,304, not a
# multiple of 8: the kernels' element-wise path), and 16,384 of CLIP ViT-L's (4,096).
NON_GATED_SHAPES = [(4096, 4304), (16384, 4096)]
# Bytes per element each act*mul row moves at the least (the docstring's counts), gated and non-gated.
SILU_BYTES = {
    True: dict(eager=6, quantize=11.5, backward=8.5, requantize=3.5, fp4_quantize=10.5, fp4_backward=7.5,
               fp4_g128_backward=7.0625, fp4_requantize=2.5),
    False: dict(eager=4, quantize=6.25, backward=5.25, requantize=2.25, fp4_quantize=5.75, fp4_backward=4.75,
                fp4_g128_backward=4.53125, fp4_requantize=1.75),
}
TARGET = 0.95


def rmsnorm_unfused(x, weight):
    """What the fused op replaces: RMSNorm in bf16, then the standalone quantizers."""
    y = F.rms_norm(x, (x.shape[-1],), weight, 1e-6)
    ops.quantize_group(x, 16)
    return ops.quantize_tensor(y, transpose=True)


def rmsnorm_cases(rows, cols):
    n = rows * cols
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    residual = torch.randn_like(x)
    _, y_scale, _, x_saved, x_scales, rstd = ops.rmsnorm_quantize(x, weight)
    _, _, _, x_fp4, x_fp4_scales, _ = ops.rmsnorm_quantize(x, weight, save_format="fp4")
    copy_dst = torch.empty_like(x)
    return {
        "copy (bf16)": (lambda: copy_dst.copy_(x), 4 * n),
        "F.rms_norm (bf16, plain)": (lambda: F.rms_norm(x, (cols,), weight, 1e-6), 4 * n),
        "rmsnorm_quantize": (lambda: ops.rmsnorm_quantize(x, weight), 6.25 * n),
        "rmsnorm_quantize +transpose": (lambda: ops.rmsnorm_quantize(x, weight, transpose=True), 7.25 * n),
        "rmsnorm_backward": (lambda: ops.rmsnorm_backward(dy, x_saved, x_scales, rstd, weight), 5.25 * n),
        "rmsnorm_backward +residual": (
            lambda: ops.rmsnorm_backward(dy, x_saved, x_scales, rstd, weight, residual=residual), 7.25 * n
        ),
        "rmsnorm_backward, + residual (context)": (
            lambda: ops.rmsnorm_backward(dy, x_saved, x_scales, rstd, weight)[0] + residual, 7.25 * n
        ),
        "rmsnorm_requantize": (lambda: ops.rmsnorm_requantize(x_saved, x_scales, rstd, weight, y_scale), 2.25 * n),
        "rmsnorm_quantize, FP4 saved": (lambda: ops.rmsnorm_quantize(x, weight, save_format="fp4"), 5.25 * n),
        "rmsnorm_backward, FP4 saved": (
            lambda: ops.rmsnorm_backward(dy, x_fp4, x_fp4_scales, rstd, weight, saved_format="fp4"), 4.75 * n
        ),
        "rmsnorm_requantize, FP4 saved": (
            lambda: ops.rmsnorm_requantize(x_fp4, x_fp4_scales, rstd, weight, y_scale, saved_format="fp4"), 1.75 * n
        ),
        "fp4_to_e4m3 (context)": (lambda: ops.fp4_to_e4m3(x_fp4, x_fp4_scales, cols), 1.5 * n),
        "unfused chain (context)": (lambda: rmsnorm_unfused(x, weight), 4 * n + 3.25 * n + 2 * n + 4 * n),
    }


def silu_cases(rows, cols, activation="silu", gated=True):
    """The act*mul ops with `activation` (--activation: silu, SwiGLU; gelu_tanh, GeGLU; quick_gelu), or without
    `gated` the non-gated act (up=None); the byte counts depend on gated only (SILU_BYTES)."""
    n = rows * cols
    nbytes = {name: count * n for name, count in SILU_BYTES[gated].items()}
    act = dict(activation=activation)
    fused = torch.randn(rows, 2 * cols, device="cuda", dtype=torch.bfloat16)
    gate, up = fused[:, :cols], fused[:, cols:] if gated else None  # the halves of one GEMM output, read in place
    dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    _, y_scale, _, *saved = ops.silu_mul_quantize(gate, up, **act)
    _, _, _, *saved_fp4 = ops.silu_mul_quantize(gate, up, save_format="fp4", **act)
    _, _, _, *saved_fp4_g128 = ops.silu_mul_quantize(gate, up, save_group_size=128, save_format="fp4", **act)
    copy_dst = torch.empty_like(dy)
    eager = ACTIVATION_FUNCTIONS[activation]
    return {
        "copy (bf16)": (lambda: copy_dst.copy_(dy), 4 * n),
        eager_name(activation, gated): ((lambda: eager(gate) * up) if gated else (lambda: eager(gate)),
                                        nbytes["eager"]),
        "silu_mul_quantize": (lambda: ops.silu_mul_quantize(gate, up, **act), nbytes["quantize"]),
        "silu_mul_quantize +transpose": (lambda: ops.silu_mul_quantize(gate, up, transpose=True, **act),
                                         nbytes["quantize"] + n),
        "silu_mul_backward": (lambda: ops.silu_mul_backward(dy, *saved, **act), nbytes["backward"]),
        "silu_mul_requantize": (lambda: ops.silu_mul_requantize(*saved, None, y_scale, **act), nbytes["requantize"]),
        "silu_mul_quantize, FP4 saved": (lambda: ops.silu_mul_quantize(gate, up, save_format="fp4", **act),
                                         nbytes["fp4_quantize"]),
        "silu_mul_backward, FP4 saved": (
            lambda: ops.silu_mul_backward(dy, *saved_fp4, saved_format="fp4", **act), nbytes["fp4_backward"]
        ),
        "silu_mul_backward, FP4 saved, G=128": (
            lambda: ops.silu_mul_backward(dy, *saved_fp4_g128, save_group_size=128, saved_format="fp4", **act),
            nbytes["fp4_g128_backward"],
        ),
        "silu_mul_requantize, FP4 saved": (
            lambda: ops.silu_mul_requantize(*saved_fp4, None, y_scale, saved_format="fp4", cols=cols, **act),
            nbytes["fp4_requantize"],
        ),
    }


def eager_name(activation, gated=True):
    """The eager PyTorch baseline of the act*mul rows."""
    return f"{activation}(g){' * u' if gated else ''} (bf16, eager)"


def measure(family, shape, cases, warmup, repeat, baseline):
    timed = {
        name: (time_cuda_gpu_ms(fn, warmup, repeat), time_cuda_ms(fn, warmup, repeat), nbytes)
        for name, (fn, nbytes) in cases.items()
    }
    copy_gbs = timed["copy (bf16)"][2] / timed["copy (bf16)"][0] / 1e6
    baseline_gbs = timed[baseline][2] / timed[baseline][0] / 1e6
    rows = []
    for name, (ms, dispatch_ms, nbytes) in timed.items():
        gbs = nbytes / ms / 1e6
        row = {"family": family, "shape": f"{shape[0]}x{shape[1]}", "op": name, "ms": ms,
               "ms with dispatch": dispatch_ms, "GB/s": gbs, "vs copy": gbs / copy_gbs, "vs plain": gbs / baseline_gbs}
        if name.startswith("rmsnorm_quantize"):
            row["meets 95%"] = "yes" if gbs / baseline_gbs >= TARGET else "NO"
        rows.append(row)
    return rows


def main():
    cli = parser(__doc__)
    cli.add_argument("--activation", choices=ops.ACTIVATIONS, default="silu",
                     help="the act*mul ops' activation: silu (SwiGLU, the default), gelu_tanh (GeGLU) or quick_gelu")
    cli.add_argument("--non-gated", action="store_true",
                     help="the non-gated act (up=None) at vision towers' MLP widths, instead of act*mul")
    args = cli.parse_args()
    if not torch.cuda.is_available() or not coat.built_with_cuda():
        sys.exit("benchmarks/norm_act.py needs a CUDA GPU and coat built with CUDA")
    torch.manual_seed(0)
    rows = []
    gated = not args.non_gated
    for shape in RMSNORM_SHAPES if gated else ():  # the RMSNorm rows do not depend on the options
        rows += measure("rmsnorm", shape, rmsnorm_cases(*shape), args.warmup, args.repeat, "F.rms_norm (bf16, plain)")
    family = f"{args.activation}_mul" if gated else args.activation
    for shape in SILU_SHAPES if gated else NON_GATED_SHAPES:
        rows += measure(family, shape, silu_cases(*shape, args.activation, gated), args.warmup, args.repeat,
                        eager_name(args.activation, gated))
    print_table(rows, ["family", "shape", "op", "ms", "ms with dispatch", "GB/s", "vs copy", "vs plain", "meets 95%"])
    name = "norm_act" + ("" if args.activation == "silu" else f"_{args.activation}") + ("" if gated else "_non_gated")
    path = write_results(args.results_dir, name, rows, {"target_fraction_of_plain_rmsnorm": TARGET})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
