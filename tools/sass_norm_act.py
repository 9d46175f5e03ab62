"""Instructions per element of the norm_act kernels' hot loops, counted in their SASS (no GPU needed).

Compiles csrc/cuda/rmsnorm.cu and silu_mul.cu with the build's nvcc flags, disassembles them with line information
and, for each kernel below (bf16 inputs, the 16-byte path), walks one iteration of its main loop with the walker of
tools/sass_hot_path.py: every conditional branch goes the way a typical iteration goes (whole chunks, finite values,
gates >= -80, no NaN, the fast paths of the IEEE divisions, G = 16, E4M3 y with its transpose (the requantize ops:
vector codes, y_t only), H = 4096 for RMSNorm: L = 128 lanes, 4 chunks each), inputs saved in E4M3, no Smooth-SwiGLU
scales, rmsnorm_save without a residual; the *_fp4 and *_fp6 rows: the kernels instantiated for inputs saved in FP4
or FP6 (the forward ones on the fast encoder's path); silu_mul_backward_smooth: with Smooth-SwiGLU scales;
silu_mul_backward_fp4_g128: FP4 in groups of 128, the gates' factors shared by shuffle. Counts are dynamic for that
path (each executed SASS instruction once, branches and barriers included), divided by the elements a lane handles
per iteration. Also prints each kernel's registers, and the blocks per SM they allow.

  python tools/sass_norm_act.py [--by-line KERNEL] [--arch sm_90] [--cubins RMSNORM_CUBIN SILU_MUL_CUBIN]

Needs nvcc, nvdisasm and cuobjdump (on the PATH, or in site-packages/nvidia/cu*/bin: pip install
nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump); no GPU. --cubins also takes objects (nvcc -c), whose cubins cuobjdump
extracts.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
import typing

from sass_hot_path import NVCC_FLAGS, ROOT, Source, cubin_of, disassemble, opcode, parse, tool, walk

# The kernels' sources: the two translation units, and the header of what they share.
UNITS = [os.path.join(ROOT, "csrc", "cuda", name) for name in ("rmsnorm.cu", "silu_mul.cu")]
SOURCES = [os.path.join(ROOT, "csrc", "cuda", "norm_act.cuh")] + UNITS
INCLUDE = os.path.join(ROOT, "csrc", "include", "coat")
HEADERS = {name: os.path.join(INCLUDE, *path) for name, path in {
    "norm_act_math.h": ("detail", "norm_act_math.h"),
    "quantize_math.h": ("detail", "quantize_math.h"),
    "fp8.h": ("fp8.h",),
    "float_bits.h": ("float_bits.h",),
}.items()}

BF16 = "VectorIoIL10coat_dtype1E"
# The act*mul kernels are instantiated per activation: walk the SiLU ones (coat_activation 0).
SILU = "L15coat_activation0E"
# Every kernel walked runs blocks of 256 threads.
BLOCK_THREADS = 256


class Loop(typing.NamedTuple):
    fragments: list[str]  # of the instance's mangled name
    definition: str  # the kernel's (or, for the two second passes, the op's) definition, from where to look
    statement: str  # the loop statement
    body: str  # a statement of its body (the prefetch)
    elements: int  # per lane and iteration
    copy: str | None = None  # the statement where the copy walked is inlined, when the kernel holds several


APPLY_LOOP = ("for (int parity = 0; row_tile < row_tiles;",
              "if (row_tile + row_strands < row_tiles) next = load_tile(row_tile + row_strands);", 16)
BACKWARD_LOOP = ("for (int64_t i = 0; i < a.rows_per_slice; ++i)",
                 "if (i + 1 < a.rows_per_slice) next = load_row(i + 1);", 32)
STATS_LOOP = ("for (int64_t group = blockIdx.x; group < a.row_groups;",
              "if (group + gridDim.x < a.row_groups) next = load_row(group + gridDim.x);", 32)
SILU_LOOP = ("for (int64_t row = at.first_row; row < a.rows; row += at.row_step) {",
             "if (row + at.row_step < a.rows) next = load_row(row + at.row_step);", 16)
# silu_mul_backward_kernel's copies of its loop over rows: without Smooth-SwiGLU scales, and with them
NO_SMOOTH, SMOOTH = "if (a.smooth_scale == nullptr) all_rows(std::false_type{});", "else all_rows(std::true_type{});"
KERNELS = {
    # the FP8 forward's first pass (OutIo = void), and rmsnorm_save's one pass (OutIo the same VectorIo: a substitution)
    "rmsnorm_stats": Loop(["rmsnorm_stats_kernelILi256E", BF16 + "EEL17coat_saved_format0EvE"],
                          "rmsnorm_stats_kernel(", *STATS_LOOP),
    "rmsnorm_save": Loop(["rmsnorm_stats_kernelILi256E", BF16 + "EEL17coat_saved_format0ES"], "rmsnorm_stats_kernel(",
                         *STATS_LOOP),
    "rmsnorm_apply": Loop(["apply_quantize_kernelINS_12RmsnormApply", BF16], "apply_quantize_kernel(", *APPLY_LOOP),
    # without a residual (ResidualIo = void), and with a bf16 one (S3_: the same VectorIo again)
    "rmsnorm_backward": Loop(["rmsnorm_backward_kernelILi256E", BF16 + "EEvE"], "rmsnorm_backward_kernel(",
                             *BACKWARD_LOOP),
    "rmsnorm_backward_residual": Loop(["rmsnorm_backward_kernelILi256E", BF16 + "EES3_E"], "rmsnorm_backward_kernel(",
                                      *BACKWARD_LOOP),
    "silu_mul_stats": Loop(["silu_mul_stats_kernel", BF16 + "EEL17coat_saved_format0E", SILU],
                           "silu_mul_stats_kernel(",
                           *SILU_LOOP),
    "silu_mul_apply": Loop(["apply_quantize_kernelINS_12SiluMulApply", BF16, SILU], "apply_quantize_kernel(",
                           *APPLY_LOOP),
    "silu_mul_backward": Loop(["silu_mul_backward_kernel", BF16 + "EEL17coat_saved_format0ELi0E", SILU],
                              "silu_mul_backward_kernel(", *SILU_LOOP, NO_SMOOTH),
    "silu_mul_backward_smooth": Loop(["silu_mul_backward_kernel", BF16 + "EEL17coat_saved_format0ELi0E", SILU],
                                     "silu_mul_backward_kernel(", *SILU_LOOP, SMOOTH),
    # FP4 gates in groups of 128: their factors computed once per code and shuffled (GateFactorsOfCodes)
    "silu_mul_backward_fp4_g128": Loop(["silu_mul_backward_kernel", BF16 + "EEL17coat_saved_format1ELi16E", SILU],
                                       "silu_mul_backward_kernel(", *SILU_LOOP, NO_SMOOTH),
    # the requantize ops: the second pass on the FP8-saved inputs (vector codes), y_t only
    "rmsnorm_requantize": Loop(["apply_quantize_kernelINS_12RmsnormApplyINS_9SavedRowsILb1EL17coat_saved_format0E"],
                               "apply_quantize_kernel(", *APPLY_LOOP),
    "silu_mul_requantize": Loop(["apply_quantize_kernelINS_12SiluMulApplyINS_9SavedRowsILb1EL17coat_saved_format0E",
                                 SILU],
                                "apply_quantize_kernel(", *APPLY_LOOP),
}
# the kernels instantiated for inputs saved in FP4 and FP6 (coat_saved_format 1 and 2)
for _name, _format in (("fp4", 1), ("fp6", 2)):
    KERNELS[f"rmsnorm_stats_{_name}"] = Loop(["rmsnorm_stats_kernelILi256E",
                                              BF16 + f"EEL17coat_saved_format{_format}EvE"],
                                             "rmsnorm_stats_kernel(", *STATS_LOOP)
    KERNELS[f"silu_mul_stats_{_name}"] = Loop(["silu_mul_stats_kernel", BF16 + f"EEL17coat_saved_format{_format}E",
                                               SILU],
                                              "silu_mul_stats_kernel(", *SILU_LOOP)
    KERNELS[f"silu_mul_backward_{_name}"] = Loop(
        ["silu_mul_backward_kernel", BF16 + f"EEL17coat_saved_format{_format}ELi0E", SILU], "silu_mul_backward_kernel(",
        *SILU_LOOP, NO_SMOOTH)
    KERNELS[f"rmsnorm_requantize_{_name}"] = Loop(
        [f"apply_quantize_kernelINS_12RmsnormApplyINS_9SavedRowsILb1EL17coat_saved_format{_format}E"],
        "apply_quantize_kernel(", *APPLY_LOOP)
    KERNELS[f"silu_mul_requantize_{_name}"] = Loop(
        [f"apply_quantize_kernelINS_12SiluMulApplyINS_9SavedRowsILb1EL17coat_saved_format{_format}E", SILU],
        "apply_quantize_kernel(", *APPLY_LOOP)


class Sources(Source):
    """Source files read as one: their lines in a row, numbered from 1 across them, so that a rule finds a statement
    in whichever file it lies. find() gives such a number, key() and key_of() the "file:line" of the file's own."""

    def __init__(self, paths: list[str]):
        files = [Source(path) for path in paths]
        self.names = {source.name for source in files}
        self.name = ", ".join(source.name for source in files)
        self.lines, self.places = [], []
        for source in files:
            self.lines += source.lines
            self.places += [source.key_of(n) for n in range(1, len(source.lines) + 1)]

    def key_of(self, number: int) -> str:
        return self.places[number - 1]


def rules_for(cu: Sources, headers: dict[str, Source], kernel: str):
    """(cold source lines, branch rules) of the typical iteration of `kernel` described in the module
    docstring."""
    cold: set[str] = set()

    def cold_lines(source: Source, first: str, last: str | None = None, after: int = 0):
        a = source.find(first, after)
        b = source.find(last, a - 1) if last else a
        cold.update(source.key_of(n) for n in range(a, b + 1))

    # the slow paths behind each chunk's test, and the element-by-element I/O
    chunk = Source(os.path.join(ROOT, "csrc", "cuda", "fp8_chunk.cuh"))
    cold_lines(chunk, "const uint32_t code = coat_quantize_value(kCanonicalNan")
    cold_lines(cu, "for (int e = 0; e < kChunk; ++e) s[e] = coat_sigmoid(z[e]);")
    cold_lines(cu, "p[0] = make_uint4(pack_16bit<kDtype>(v[0], v[1]), pack_16bit<kDtype>(v[2], v[3]),",
               "pack_16bit<kDtype>(v[4], v[5]), pack_16bit<kDtype>(v[6], v[7]));")
    cold_lines(cu, "for (int e = 0; e < kChunk; ++e) v[e] = e < count ? p[e] : 0.0f;")
    cold_lines(cu, "const uint16_t h = e < count ? p[e] : 0;", "v[e] = dtype == COAT_BFLOAT16 ? coat_bf16_to_f32(h)")
    cold_lines(cu, "if (e < 4) codes.lo |= static_cast<uint32_t>(src[e]) << (8 * e);",
               "else codes.hi |= static_cast<uint32_t>(src[e]) << (8 * (e - 4));")
    cold_lines(cu, "if (e < count) dst[e] = code_at(codes, e);")
    math = headers["norm_act_math.h"]
    cold_lines(math, "COAT_INLINE float coat_exp(float x) {",
               "return (p * coat_f32_from_bits((uint32_t)(first + 127) << 23))")
    cold_lines(math, "COAT_INLINE float coat_sigmoid(float g)")
    quantize = headers["quantize_math.h"]
    cold_lines(quantize, "COAT_INLINE float coat_divide_by_scale(", "return x / scale;")
    cold_lines(quantize, "COAT_INLINE uint8_t coat_quantize_scaled(",
               "return coat_quantize_scaled(x, scale, 1.0f / scale, format);")
    fp8 = headers["fp8.h"]
    cold_lines(fp8, "COAT_INLINE uint8_t coat_f32_to_e4m3(float f) {", "return (uint8_t)(sign | code);")
    bits = headers["float_bits.h"]
    if kernel != "rmsnorm_backward_residual":  # which rounds dx to bf16 by it before adding the residual
        cold_lines(bits, "COAT_INLINE uint16_t coat_f32_to_bf16(float f) {", "return (uint16_t)(u >> 16);")

    def to(source: Source, snippet: str, after: int = 0) -> str:  # toward the first line holding snippet
        return "to:" + source.key(snippet, after)


    def key(line: int) -> str:
        return cu.key_of(line)

    def into(line: int) -> str:
        """The way into what the statement on `line` guards: toward the lines of its block (`{` ... `}`), or,
        for a statement without one (an early `continue`, a guarded statement), toward the rest of the block
        it is in."""
        depth, body = 1, []
        for n in range(line + 1, len(cu.lines) + 1):
            for char in cu.lines[n - 1].split("//")[0]:
                depth += {"{": 1, "}": -1}.get(char, 0)
                if depth == 0:  # the block's closing brace (an `else` after it is not the block)
                    return "into:" + "|".join(key(n) for n in body)
            body.append(n)
        raise ValueError(f"no end to the block after line {line}")

    def every(snippet: str) -> list[int]:
        return [n for n, text in enumerate(cu.lines, 1) if snippet in text]

    rules: dict[str, str] = {}
    fp6 = kernel.endswith("_fp6")
    e4m3_save = cu.find("__device__ __forceinline__ void save_chunks_e4m3(")
    e2m_save = cu.find("__device__ __forceinline__ void save_chunks_e2m(")
    # L = 128: four whole chunks per lane and row in every loop over them; whole chunks of a row inside the
    # matrix everywhere
    for snippet in ("for (int k = 0; k < kChunksPerLane; ++k) {", "if (k * a.lanes >= chunks) break;",
                    "if (count == 0) continue;", "if (count == 0) return {0u, 0u};", "if (count > 0) {",
                    "if (count > 0)", "if (unit_col < a.cols) {", "if (at.warp_chunk_col(c) >= a.cols) continue;"):
        rules.update({key(line): into(line) for line in every(snippet)})
    group_amax = Source(os.path.join(ROOT, "csrc", "cuda", "group_amax.cuh"))
    requantize = "requantize" in kernel
    e2m = Source(os.path.join(ROOT, "csrc", "cuda", "e2m_chunk.cuh"))
    reads_codes = requantize or "backward" in kernel
    if reads_codes and kernel.endswith("_fp4"):
        load = to(e2m, "return {count > 0 ? *reinterpret_cast<const uint32_t*>(src) : 0u, 0u};")
    elif reads_codes and kernel.endswith("_fp6"):
        load = to(e2m, "return {h0 | h1 << 16, h2};")
    elif requantize:
        load = to(cu, "const uint2 raw = *reinterpret_cast<const uint2*>(src);")
    else:
        load = to(cu, "for (int w = 0; w < kWords; ++w) raw.words[w] = count > 0 ? p[w]")
    rules.update({
        # G = 16: a group is two lanes of 8 elements in the RMSNorm kernels (one shuffle: the loop's guard and
        # its back-edge fall through), one lane of 16 in the SiLU*mul kernels (the guard skips the loop)
        group_amax.key("for (int mask = lanes >> 1; mask > 0; mask >>= 1)"):
            "fallthrough" if kernel.startswith("rmsnorm") else "taken",
        # bf16 gates in the silu table's range
        cu.key("if (((d[0] | d[1] | d[2] | d[3]) & 0x70007000u) == 0) {"):
            into(cu.find("if (((d[0] | d[1] | d[2] | d[3]) & 0x70007000u) == 0) {")),
        # no Smooth-SwiGLU scales (silu_mul_stats tests for them per chunk)
        cu.key("if (a.smooth_scale == nullptr) {"):
            to(cu, "for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, silu[e] * up[c][e]);"),
        # a code's (a chunk's) sigmoid argument z(g) >= -80
        cu.key("return z >= -80.0f ? sigmoid_near(z) : coat_sigmoid(z);"):
            to(cu, "const float p = coat_exp_reduced(fmaxf(-g, -80.0f), &n);"),
        cu.key("if (near) {", cu.find("__device__ __forceinline__ void sigmoid_chunk(")):
            into(cu.find("if (near) {", cu.find("__device__ __forceinline__ void sigmoid_chunk("))),
        # E4M3 y
        cu.key("codes = format == COAT_E4M3 ? encode_chunk<COAT_E4M3, true>(values, scale, reciprocal)"):
            to(cu, "codes = format == COAT_E4M3 ? encode_chunk<COAT_E4M3, true>(values, scale, reciprocal)"),
        # the forward ops write y, the requantize ops y_t only
        cu.key("if (y != nullptr) store_codes("):
            ("away:" if requantize else "to:")
            + cu.key("if (count > 0) *reinterpret_cast<uint2*>(dst) = make_uint2(codes.lo, codes.hi);"),
        # with y_t, rows % 4 == 0
        cu.key("if (y_t != nullptr) {"): into(cu.find("if (y_t != nullptr) {")),
        cu.key("if (y_t == nullptr) continue;"): to(cu, "__syncthreads();", cu.find("if (y_t == nullptr) continue;")),
        cu.key("if (out_col >= cols || row >= rows) continue;"): "fallthrough",
        cu.key("if (rows % 4 == 0) {"): into(cu.find("if (rows % 4 == 0) {")),
        # (the compiler makes two versions of the loop over the 4 columns, word and byte stores)
        cu.key("for (int j = 0; j < 4; ++j) {", cu.find("const int64_t row = row0 + 4 * row_quad;")): "text:STG.E desc",
        # finite values: the fast encode
        chunk.key("if (finite) return codes_of_finite<kFormat>(q);"):
            to(chunk, "const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * w + 2], q[4 * w + 3])"),
        # the RMSNorm backward reads E4M3 codes (SavedCodes with the format known at run time)
        cu.key("switch (format) {", cu.find("__device__ __forceinline__ Codes load(int64_t row,")): "text:LDG.E.64",
        cu.key("switch (format) {", cu.find("__device__ __forceinline__ Codes e4m3(Codes loaded) const {")):
            "away:" + "|".join(key(n) for n in range(cu.find("__device__ __forceinline__ Codes e2m1x8_to_e4m3("),
                                                      cu.find("return {e2m3x4_to_e4m3(packed.lo),") + 1)),
        # a row inside the matrix; its save group's scale, stored by every lane (G = 16: one lane per group)
        cu.key("if (col >= valid_cols) return;", e4m3_save):
            to(cu, "const float scale = scale_from_amax<COAT_E4M3>(amax);"),
        cu.key("if ((col & ((1 << group_shift) - 1)) == 0) scales_row[col >> group_shift] = scale;", e4m3_save):
            to(cu, "if ((col & ((1 << group_shift) - 1)) == 0) scales_row[col >> group_shift] = scale;", e4m3_save),
        # G = 16: two lanes a group in the RMSNorm kernels (one shuffle), one in the SiLU*mul kernels (none)
        cu.key("for (int mask = lanes_per_group >> 1; mask > 0; mask >>= 1)", e2m_save):
            "fallthrough" if kernel.startswith("rmsnorm") else "taken",
        cu.key("if (col >= valid_cols) return;", e2m_save):
            to(cu, "const float scale = e2m_scale_from_amax_bits<kMantissaBits>(amax_bits);"),
        cu.key("if ((col & ((1 << group_shift) - 1)) == 0) scales_row[col >> group_shift] = scale;", e2m_save):
            to(cu, "if ((col & ((1 << group_shift) - 1)) == 0) scales_row[col >> group_shift] = scale;", e2m_save),
        # vector codes: one access per chunk (FP4), three 2-byte ones (FP6)
        e2m.key("if (vector) {", e2m.find("__device__ __forceinline__ void store_e2m_chunk(")):
            to(e2m, "halves[0] = static_cast<uint16_t>(packed.lo);" if fp6 else
               "*reinterpret_cast<uint32_t*>(dst) = packed.lo;"),
        e2m.key("if (vector) {", e2m.find("__device__ __forceinline__ PackedCodes load_e2m_chunk(")):
            load,
        # a chunk inside the matrix: its codes are loaded (a select the compiler makes a branch)
        e2m.key("return {count > 0 ? *reinterpret_cast<const uint32_t*>(src) : 0u, 0u};"): "text:LDG",
        e2m.key("const uint32_t h0 = count > 0 ? halves[0] : 0u,"): "text:LDG",
        e2m.key("if (amax_bits > 0x7F800000u) return __uint_as_float(0x7FC00000u);"):
            to(e2m, "return fmaxf(__fdiv_rn(__uint_as_float(amax_bits), kMax), COAT_MIN_SCALE);" if fp6 else
               "return scale_by_inverse(__uint_as_float(amax_bits), kMax, 1.0f / kMax);"),
        e2m.key("if (scale >= kE2mFastScaleMin && scale <= kE2mFastScaleMax) {"):
            to(e2m, "codes[e] = e2m_magnitude_code_biased<kMantissaBits>(fabsf(v[e]), steps) - kE2mCodeBias +" if fp6 else
               "word += e2m_magnitude_code_biased<1>(fabsf(v[e]), steps) * kNibbleWeights[e];"),
        # L = 128: the row spans four warps
        cu.key("if (lanes == kWarpSize) return partial;"): to(cu, "if (lane == 0) warp_sums[warp] = partial;"),
        cu.key("if (lane == 0) warp_sums[warp] = partial;"): to(cu, "if (lane == 0) warp_sums[warp] = partial;"),
        cu.key("float v = lane < warps_per_row ? warp_sums[(warp & -warps_per_row) + lane] : 0.0f;"): "fallthrough",
        # the loop over the 4 warp sums: its guard, then its back-edge once
        cu.key("for (int offset = warps_per_row / 2; offset > 0; offset >>= 1) v = v + __shfl_xor_sync("):
            "seq:fallthrough,taken,fallthrough",
        # per-column vectors (weight, smooth scale) in bf16, or none
        cu.key("if (count == 0) {", cu.find("__device__ __forceinline__ void load_chunk(")):
            to(cu, "const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + offset);"),
        cu.key("} else if (dtype == COAT_FLOAT32) {", cu.find("__device__ __forceinline__ void load_chunk(")):
            to(cu, "const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + offset);"),
        cu.key("if (dtype == COAT_BFLOAT16) {", cu.find("__device__ __forceinline__ void unpack_16bit(")):
            to(cu, "out[0] = __uint_as_float(pair << 16);"),
        # bf16 dy in the sum with the residual (the switch on its dtype, taken once per chunk)
        cu.key("dx[e] = coat_rmsnorm_dx_plus_residual("):
            to(math, "case COAT_BFLOAT16: return coat_bf16_to_f32(coat_f32_to_bf16(dx)) + residual;"),
        cu.key("if (smooth_scale != nullptr) {"):
            "away:" + cu.key("load_chunk(smooth_scale, COAT_FLOAT32, col, count, vector, v);"),
        # rmsnorm_save without a residual (q/k norms; the post-norms add one)
        cu.key("if (a.residual != nullptr) {", cu.find("if constexpr (kOutput) {")):
            "away:" + cu.key("out_io.unpack(out_io.load(row_at(a.residual, out_io.element_size(), row, a.cols)"),
    })
    # the next row or tile is loaded, and the backward's residual
    for snippet in ("next = load_row(", "next = load_tile(", "residual[k] = dx_io.load("):
        rules.update({key(line): load for line in every(snippet)})
    return cold, rules


def registers(cubin: str) -> dict[str, int]:
    listing = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], check=True, capture_output=True,
                             text=True).stdout
    found, name = {}, None
    for line in listing.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        m = re.search(r"REG:(\d+)", line)
        if m and name:
            found[name] = int(m.group(1))
    return found


def blocks_per_sm(regs: int) -> int:
    """Blocks of BLOCK_THREADS that an SM's 64K registers hold (allocated per warp in units of 256)."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * (BLOCK_THREADS // 32)), 2048 // BLOCK_THREADS)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cubins", nargs=2, metavar=("RMSNORM_CUBIN", "SILU_MUL_CUBIN"),
                        help="cubins of csrc/cuda/rmsnorm.cu and silu_mul.cu, or objects compiled from them with "
                        "nvcc -c (default: compile them)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--by-line", choices=sorted(KERNELS), help="instructions per source line of one kernel")
    args = parser.parse_args()

    # nvcc's line table names a header for some lines of a .cu (seen: e2m_chunk.cuh at lines past its end, where
    # the compiler moved the silu table's range test into the code of save_chunks): such a line is the .cu's.
    lengths = {name: len(open(os.path.join(folder, name)).read().split("\n"))
               for folder, _, names in os.walk(os.path.join(ROOT, "csrc")) for name in names}
    functions, regs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for index, unit in enumerate(UNITS):
            if args.cubins:
                extracted = os.path.join(tmp, str(index))
                os.mkdir(extracted)
                cubin = cubin_of(args.cubins[index], args.arch, extracted)
            else:
                cubin = os.path.join(tmp, os.path.basename(unit) + ".cubin")
                subprocess.run([tool("nvcc"), "-cubin", f"-arch={args.arch}", *NVCC_FLAGS,
                                "-I" + os.path.join(ROOT, "csrc", "include"), unit, "-o", cubin], check=True)
            listing = disassemble(cubin)
            regs.update(registers(cubin))
            name = os.path.basename(unit)
            for mangled, function in parse(listing).items():
                for instruction in function:
                    instruction["chain"] = [(name, line) if file != name and line > lengths.get(file, line) else
                                            (file, line) for file, line in instruction["chain"]]
                functions[mangled] = function
    cu = Sources(SOURCES)
    headers = {name: Source(path) for name, path in HEADERS.items()}
    for name, loop in KERNELS.items():
        mangled = next(k for k in functions if all(f in k for f in loop.fragments))
        cold, rules = rules_for(cu, headers, name)
        definition = cu.find(loop.definition)
        within = cu.key(loop.copy, definition) if loop.copy else None
        path = walk(functions[mangled], cold, rules, cu.key(loop.statement, definition), cu.key(loop.body, definition),
                    within)
        ops = collections.Counter(opcode(i["text"]).split(".")[0] for i in path)
        print(f"{name:18s} {len(path) / loop.elements:6.1f} instructions per element ({len(path)} per lane and "
              f"iteration of {loop.elements}), {regs[mangled]} registers: {blocks_per_sm(regs[mangled])} blocks of "
              f"{BLOCK_THREADS} per SM")
        print("    " + " ".join(f"{o}:{n}" for o, n in ops.most_common()))
        if args.by_line == name:
            # an instruction's statement of the kernel: its outermost line of the sources, the copy's call aside
            by_line = collections.Counter(next((f"{f}:{l}" for f, l in reversed(i["chain"]) if f in cu.names and
                                                f"{f}:{l}" != within), "") for i in path)
            text = dict(zip(cu.places, cu.lines))
            for place, n in sorted(by_line.items(), key=lambda item: (cu.places.index(item[0]) if item[0] else -1)):
                print(f"{n:6d}  {place:18s}  {text[place].strip()[:90] if place else ''}")


if __name__ == "__main__":
    main()
