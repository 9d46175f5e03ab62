"""How far cuBLASLt's first heuristic choice is from its fastest algorithm on a decoder layer's FP8 GEMMs.

coat's GEMMs go through torch._scaled_mm, which takes the first algorithm cuBLASLt's heuristic returns. This
script asks the heuristic for every algorithm it would allow for each GEMM of a Llama decoder layer (forward,
dgrad and wgrad, at hidden 2048 and 4096, 8192 tokens, the layouts and FP8 formats coat's layer uses: E4M3
inputs and weights, E5M2 gradients, bf16 output, fp32 accumulation), times each with CUDA events (median
after warm-up) and prints the first choice, the fastest and torch._scaled_mm on the same problem. It calls
cuBLASLt directly through ctypes: a measurement of what autotuning could gain, not a code path of coat. The
candidates of a GEMM are timed in rounds, one call of each per round (the GPU's clocks fall as back-to-back
GEMMs heat it: timed one after the other, the last ones would look slower). Random normal inputs: GEMM time
depends on the data (power), so absolute times are above those of a training step's GEMMs; the ratios are
what this measures.

    python benchmarks/gemm_algos.py             (a CUDA GPU with FP8 tensor cores: H100/H200)
"""
import ctypes
import glob
import os
import statistics
import sys

import torch

from _common import _sleep_cycles, parser, print_table, write_results

# cuBLASLt and CUDA enums (cublasLt.h, cublas_api.h, library_types.h of CUDA 13)
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3, CUDA_R_8F_E5M2 = 0, 14, 28, 29
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID = 1, 2, 6, 8
REQUESTED_ALGOS = 64
TOKENS = 8192


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt():
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")  # loads torch's cuBLAS libraries first
    candidates = []
    for root in {os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(torch.__file__))}:
        candidates += glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublasLt.so*"))
        candidates += glob.glob(os.path.join(root, "nvidia", "cublas", "lib", "libcublasLt.so*"))
    candidates += glob.glob("/usr/local/cuda/lib64/libcublasLt.so*")
    for path in ["libcublasLt.so.13", "libcublasLt.so.12", *candidates]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("libcublasLt not found")


LT = None


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def set_attr(setter, desc, attr: int, value) -> None:
    check(setter(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


class Problem:
    """out[R, C] (bf16, row-major) = P[R, Kd] @ Q[C, Kd]^T, P and Q row-major FP8: cuBLASLt's column-major
    D[C, R] = op_T(Q) x op_N(P), the TN layout Hopper's FP8 kernels take."""

    def __init__(self, name, rows, cols, depth, p_dtype, q_dtype, handle, workspace_bytes):
        self.name, self.shape = name, (rows, cols, depth)
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.p = torch.randn(rows, depth, device="cuda", generator=gen).to(p_dtype)
        self.q = torch.randn(cols, depth, device="cuda", generator=gen).to(q_dtype)
        self.out = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
        self.one = torch.ones((), device="cuda")
        self.workspace = torch.empty(workspace_bytes, device="cuda", dtype=torch.uint8)
        self.handle = handle
        types = {torch.float8_e4m3fn: CUDA_R_8F_E4M3, torch.float8_e5m2: CUDA_R_8F_E5M2}
        self.desc = ctypes.c_void_p()
        check(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        scale = ctypes.c_void_p(self.one.data_ptr())
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_A_SCALE_POINTER, scale)
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_B_SCALE_POINTER, scale)
        set_attr(LT.cublasLtMatmulDescSetAttribute, self.desc, DESC_FAST_ACCUM, ctypes.c_int8(0))
        self.a_layout, self.b_layout, self.d_layout = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.a_layout), types[q_dtype], ctypes.c_uint64(depth),
                                            ctypes.c_uint64(cols), ctypes.c_int64(depth)), "A layout")
        check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.b_layout), types[p_dtype], ctypes.c_uint64(depth),
                                            ctypes.c_uint64(rows), ctypes.c_int64(depth)), "B layout")
        check(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.d_layout), CUDA_R_16BF, ctypes.c_uint64(cols),
                                            ctypes.c_uint64(rows), ctypes.c_int64(cols)), "D layout")
        pref = ctypes.c_void_p()
        check(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        set_attr(LT.cublasLtMatmulPreferenceSetAttribute, pref, PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(workspace_bytes))
        results = (HeuristicResult * REQUESTED_ALGOS)()
        count = ctypes.c_int()
        check(LT.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a_layout, self.b_layout, self.d_layout,
                                                self.d_layout, pref, REQUESTED_ALGOS, results, ctypes.byref(count)),
              "heuristic")
        self.algos = [results[i] for i in range(count.value) if results[i].state == 0]

    def run(self, result: HeuristicResult) -> None:
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(LT.cublasLtMatmul(self.handle, self.desc, ctypes.byref(alpha), ctypes.c_void_p(self.q.data_ptr()),
                                self.a_layout, ctypes.c_void_p(self.p.data_ptr()), self.b_layout, ctypes.byref(beta),
                                ctypes.c_void_p(self.out.data_ptr()), self.d_layout,
                                ctypes.c_void_p(self.out.data_ptr()), self.d_layout, ctypes.byref(result.algo),
                                ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(self.workspace.numel()), stream),
              "matmul")

    def scaled_mm(self) -> None:
        torch._scaled_mm(self.p, self.q.t(), self.one, self.one, out_dtype=torch.bfloat16)


def config(result: HeuristicResult) -> str:
    values = []
    for attr in (CONFIG_TILE_ID, CONFIG_STAGES_ID, CONFIG_CLUSTER_SHAPE_ID, CONFIG_SPLITK_NUM):
        value, written = ctypes.c_uint32(), ctypes.c_size_t()
        status = LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(result.algo), attr, ctypes.byref(value),
                                                         ctypes.sizeof(value), ctypes.byref(written))
        values.append(value.value if status == 0 else "?")
    return "tile {} stages {} cluster {} splitk {}".format(*values)


def kernel_name(fn) -> str:
    """The name of the (last) GPU kernel fn launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernels[-1][:60] if kernels else "?"


def interleaved_medians_us(fns, warmup: int, repeat: int) -> list[float]:
    """Median microseconds of each of fns' GPU work, timed with CUDA events in rounds (one call of each per round),
    so that a GPU whose clocks fall as it heats under back-to-back GEMMs slows every candidate alike. Each call is
    enqueued behind a sleep kernel, so that the host's time to launch it (more through torch's dispatcher than
    through ctypes) is not counted."""
    sleep = _sleep_cycles(0.3)
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, samples in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(sleep)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    return [statistics.median(samples) for samples in times]


def layer_gemms(hidden: int):
    """(name, R, C, Kd, P dtype, Q dtype) of one decoder layer's GEMMs as coat runs them: 7 forward GEMMs
    (q, k, v, o separate; gate and up separate; down), one dgrad and one wgrad per projection group."""
    inter = 11008 * hidden // 4096
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    m = TOKENS
    return [
        ("fwd q/k/v/o", m, hidden, hidden, e4, e4, 4), ("fwd gate/up", m, inter, hidden, e4, e4, 2),
        ("fwd down", m, hidden, inter, e4, e4, 1),
        ("dgrad qkv", m, hidden, 3 * hidden, e5, e4, 1), ("dgrad o", m, hidden, hidden, e5, e4, 1),
        ("dgrad gate_up", m, hidden, 2 * inter, e5, e4, 1), ("dgrad down", m, inter, hidden, e5, e4, 1),
        ("wgrad qkv", 3 * hidden, hidden, m, e5, e4, 1), ("wgrad o", hidden, hidden, m, e5, e4, 1),
        ("wgrad gate_up", 2 * inter, hidden, m, e5, e4, 1), ("wgrad down", hidden, inter, m, e5, e4, 1),
    ]


def main():
    p = parser(__doc__)
    p.add_argument("--workspace-mib", type=int, default=32, help="cuBLASLt workspace the heuristic may use")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("benchmarks/gemm_algos.py needs a CUDA GPU with FP8 tensor cores (H100/H200)")
    global LT
    LT = load_cublaslt()
    handle = ctypes.c_void_p()
    check(LT.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    rows = []
    for hidden in (2048, 4096):
        for name, r, c, kd, p_dtype, q_dtype, count in layer_gemms(hidden):
            problem = Problem(name, r, c, kd, p_dtype, q_dtype, handle, args.workspace_mib << 20)
            torch_us, *times = interleaved_medians_us(
                [problem.scaled_mm, *(lambda a=a: problem.run(a) for a in problem.algos)], args.warmup, args.repeat)
            best = min(range(len(times)), key=times.__getitem__)
            rows.append({"hidden": hidden, "gemm": name, "R x C x K": f"{r}x{c}x{kd}", "per layer": count,
                         "algos": len(times), "torch us": torch_us, "first us": times[0], "best us": times[best],
                         "best / first": times[best] / times[0], "best index": best,
                         "first": config(problem.algos[0]), "best": config(problem.algos[best]),
                         "torch kernel": kernel_name(problem.scaled_mm),
                         "first kernel": kernel_name(lambda: problem.run(problem.algos[0])),
                         "best kernel": kernel_name(lambda: problem.run(problem.algos[best]))})
    print_table(rows, ["hidden", "gemm", "R x C x K", "algos", "torch us", "first us", "best us", "best / first",
                       "torch kernel", "first kernel", "best kernel"])
    summary = {}
    for hidden in (2048, 4096):
        mine = [r for r in rows if r["hidden"] == hidden]
        first = sum(r["first us"] * r["per layer"] for r in mine)
        best = sum(r["best us"] * r["per layer"] for r in mine)
        torch_total = sum(r["torch us"] * r["per layer"] for r in mine)
        summary[f"hidden_{hidden}"] = {"torch_us": torch_total, "first_us": first, "best_us": best,
                                       "best_over_first": best / first}
        print(f"hidden {hidden}: a layer's GEMMs {torch_total:.0f} us through torch._scaled_mm, {first:.0f} with "
              f"cuBLASLt's first algorithm, {best:.0f} with each GEMM's fastest ({best / first:.3f}x)")
    name = "gemm_algos" if args.workspace_mib == 32 else f"gemm_algos-workspace{args.workspace_mib}mib"
    print("wrote", write_results(args.results_dir, name, rows, summary))


if __name__ == "__main__":
    main()
