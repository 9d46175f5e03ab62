// CUDA implementation of coat/norm_act.h's act*mul (SiLU*mul, GeGLU's gelu_tanh*mul, quick_gelu*mul, each kernel
// templated on the coat_activation kAct) and of the non-gated act (up NULL: each kernel templated on kGated, whose
// false drops up's loads, saves and stores): forward (quantize), backward and requantize. What it shares with
// rmsnorm.cu (chunks, I/O, saving inputs, the second pass of the forward and the requantize op) is in norm_act.cuh,
// which says how the work is cut and where the fast paths are; this file's are sigmoid_near and SiluOfGates (a table
// of act for bf16 gates). "silu" in names below stands for the activation: both are g * sigmoid(z(g))
// (coat/detail/norm_act_math.h), so a kernel differs by activation only in z(g) and the derivative's factor.
//
// Kernels:
//   silu_mul_stats_kernel    persistent; 16 consecutive elements per lane, a warp per 512 columns of a row:
//                            the saved gate and up (an instantiation per format), the amax of y; the warp's next
//                            row in flight
//   apply_quantize_kernel    (norm_act.cuh) of SiluMulApply: y from gate and up (the forward), y_t from the saved
//                            ones (requantize)
//   silu_mul_backward_kernel persistent, on silu_mul_stats_kernel's segments with each lane's two chunks 256
//                            columns apart: dgate, dup and their joint amax; with FP4 gates in groups of 64 or
//                            128, each gate's sigmoid is computed once per code of its group and shuffled
// tools/cuda_emulation runs these kernels on the CPU against the C core.
#include "norm_act.cuh"

namespace {

// The SiLU*mul kernels: a lane holds 16 consecutive elements (one save group when G = 16), a warp 512
// columns of one row, a block 8 rows.
constexpr int kUnitChunks = 2;
constexpr int kUnit = kUnitChunks * kChunk;
constexpr int kSegmentCols = kWarpSize * kUnit;
constexpr int kElementwiseThreads = 256;
constexpr int kElementwiseWarps = kElementwiseThreads / kWarpSize;

// ---------------------------------------------------------------------------------------------------
// Arithmetic: cheaper forms of coat/detail steps, each equal bit for bit to the step it replaces

// coat_sigmoid(g) for g >= -80, bit for bit (tools/cuda_emulation checks every such float). e^-g as
// coat_exp computes it, but with 2^n added to the exponent field: for -g in [-80, 80], n is in [-115, 115]
// and p * 2^n is normal, so coat_exp's two scalings are exact and give the same. -g below -80 is raised to
// -80: e^-80 < 2^-115, and 1 + e = 1 for it as for coat_exp's smaller (or zero) result. 1 / (1 + e), with
// 1 + e in [1, 2^117), by reciprocal_of_normal.
__device__ __forceinline__ float sigmoid_near(float g) {
  float n;
  const float p = coat_exp_reduced(fmaxf(-g, -80.0f), &n);
  // n + 1.5 * 2^23 holds n in its low mantissa bits; shifted left by 23 they add n to p's exponent field.
  const uint32_t exponent_shift = coat_f32_to_bits(n + 12582912.0f) << 23;
  return reciprocal_of_normal(1.0f + coat_f32_from_bits(coat_f32_to_bits(p) + exponent_shift));
}

// coat_activation_sigmoid(kAct, g): sigmoid_near of z(g) when z >= -80 (NaN is not), the plain formula otherwise.
template <coat_activation kAct>
__device__ __forceinline__ float activation_sigmoid(float g) {
  const float z = coat_activation_arg(kAct, g);
  return z >= -80.0f ? sigmoid_near(z) : coat_sigmoid(z);
}

// s[e] = coat_activation_sigmoid(kAct, g[e]): sigmoid_near when every z of the chunk is >= -80 (NaN is not), the
// plain formula otherwise.
template <coat_activation kAct>
__device__ __forceinline__ void sigmoid_chunk(const float g[kChunk], float s[kChunk]) {
  float z[kChunk];
  bool near = true;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    z[e] = coat_activation_arg(kAct, g[e]);
    near &= z[e] >= -80.0f;
  }
  if (near) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) s[e] = sigmoid_near(z[e]);
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) s[e] = coat_sigmoid(z[e]);
  }
}

// ---------------------------------------------------------------------------------------------------
// Smooth-SwiGLU scales

// The Smooth-SwiGLU scales of a chunk, or ones (multiplying by 1 is exact) without them.
__device__ __forceinline__ void load_smooth(const float* smooth_scale, int col, int count, bool vector,
                                            float v[kChunk]) {
  if (smooth_scale != nullptr) {
    load_chunk(smooth_scale, COAT_FLOAT32, col, count, vector, v);
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = 1.0f;
  }
}

// ---------------------------------------------------------------------------------------------------
// silu(g) of a chunk of gates

// The table of act(g) for bf16 g with first <= |g| < 2^32 * first: entry (sign << 12) | (bits - first), bits the
// 15 low bits of g's, in [first, first + 0x1000): 32 binades of 128 values in one 4096-entry plane per sign.
// first = 2^-24 for silu, 2^-25 for gelu_tanh and quick_gelu, so that sigmoid(z(g)) is exactly 0.5 at and below the
// first entry (SiluOfDecodedGates<true> relies on it): gelu_tanh's z = 1.6 g makes sigmoid(z(2^-24)) 0.5 + 2^-25.
template <coat_activation kAct>
constexpr uint32_t kSiluTableFirst = kAct == COAT_ACT_SILU ? 0x3380 : 0x3300;  // the bf16 bits of first
constexpr int kSiluTablePlane = 4096;

// The gate of table entry i.
template <coat_activation kAct>
__device__ __forceinline__ float silu_table_gate(int i) {
  const uint32_t sign = static_cast<uint32_t>(i / kSiluTablePlane) << 15;
  return coat_bf16_to_f32(static_cast<uint16_t>(sign | (kSiluTableFirst<kAct> + i % kSiluTablePlane)));
}

// silu[e] = coat_silu(g[e], coat_activation_sigmoid(kAct, g[e])), computed.
template <coat_activation kAct>
__device__ __forceinline__ void silu_chunk(const float g[kChunk], float silu[kChunk]) {
  float s[kChunk];
  sigmoid_chunk<kAct>(g, s);
#pragma unroll
  for (int e = 0; e < kChunk; ++e) silu[e] = coat_silu(g[e], s[e]);
}

// silu_chunk for gates of any dtype (Table is empty, fill does nothing). chunk() takes the gates as loaded (raw)
// and as fp32 (g).
template <class Io, coat_activation kAct>
struct SiluOfGates {
  struct Table {};
  __device__ __forceinline__ static void fill(Table&) {}
  __device__ __forceinline__ static void chunk(const Table&, const typename Io::Raw&, const float g[kChunk],
                                               float silu[kChunk]) {
    silu_chunk<kAct>(g, silu);
  }
};

// Byte offsets in the bf16 silu table of the two gates of a word of bf16 gates, given d = word - kSiluTableFirst
// in both halves, each half's offset in range (bits 12 ... 14 of the half clear): entry (sign << 12) | offset is
// byte (offset << 2) with the sign (the half's bit 15) in bit 14. Each is one LOP3 taking bits 0 ... 13 from
// offset * 4 and the rest from the sign moved to bit 14 with nothing above it (the offset's own bits 12 ... 14 are
// clear). The shifts are multiplications by factors read from the constant bank, where ptxas cannot see them as
// shifts: IMADs, in the FMA pipe, where SHFs would load the ALU pipe that bounds silu_mul_stats saving FP4; the
// LOP3 is written in PTX, where the compiler masks each operand apart (two LOP3s).
static __constant__ uint32_t kSiluTableFactors[3] = {4u, 1u << 15, 1u << 16};

__device__ __forceinline__ uint32_t silu_table_byte(uint32_t times4, uint32_t sign) {
#ifdef __CUDA_ARCH__
  uint32_t byte;
  asm("lop3.b32 %0, %1, %2, 0x3FFF, 0xE4;" : "=r"(byte) : "r"(times4), "r"(sign));  // a & c | b & ~c
  return byte;
#else
  return (times4 & 0x3FFFu) | (sign & ~0x3FFFu);
#endif
}
__device__ __forceinline__ uint32_t silu_table_byte_low(uint32_t d) {
  const uint32_t shifted = d * kSiluTableFactors[2];  // the low half in the high one
  return silu_table_byte(d * kSiluTableFactors[0], __umulhi(shifted, kSiluTableFactors[1]));  // shifted >> 17
}
__device__ __forceinline__ uint32_t silu_table_byte_high(uint32_t d) {
  const uint32_t offset = __umulhi(d, kSiluTableFactors[2]);  // d >> 16
  return silu_table_byte(offset * kSiluTableFactors[0], __umulhi(d, kSiluTableFactors[1]));  // d >> 17
}

// bf16 gates: read from the table (32 KB of shared memory) that each block fills once with the exact
// formula, for a chunk whose gates are all in its range; computed otherwise.
template <coat_activation kAct>
struct SiluOfGates<VectorIo<COAT_BFLOAT16>, kAct> {
  struct Table {
    float silu[2 * kSiluTablePlane];
  };

  // All threads of the block must call it (it synchronizes). Eight consecutive entries at a time, by
  // silu_chunk.
  __device__ __forceinline__ static void fill(Table& table) {
    for (int first = threadIdx.x * kChunk; first < 2 * kSiluTablePlane; first += blockDim.x * kChunk) {
      float g[kChunk], silu[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) g[e] = silu_table_gate<kAct>(first + e);
      silu_chunk<kAct>(g, silu);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) table.silu[first + e] = silu[e];
    }
    __syncthreads();
  }

  // The gates' offsets are taken from the words as loaded, two at a time: each word less kSiluTableFirst in both
  // halves, mod 2^16 in each, gives a half the sign in bit 15 and below it the offset in the plane, in range when
  // bits 12 ... 14 are 0. The low half borrows from the high one only when the low one is below kSiluTableFirst,
  // out of range, which sends the chunk to silu_chunk anyway.
  __device__ __forceinline__ static void chunk(const Table& table, const VectorIo<COAT_BFLOAT16>::Raw& raw,
                                               const float g[kChunk], float silu[kChunk]) {
    constexpr uint32_t kFirstPair = kSiluTableFirst<kAct> * 0x10001u;
    const uint4 w = raw.words[0];
    const uint32_t d[kChunk / 2] = {w.x - kFirstPair, w.y - kFirstPair, w.z - kFirstPair, w.w - kFirstPair};
    if (((d[0] | d[1] | d[2] | d[3]) & 0x70007000u) == 0) {
      const char* bytes = reinterpret_cast<const char*>(table.silu);
#pragma unroll
      for (int i = 0; i < kChunk / 2; ++i) {
        silu[2 * i] = *reinterpret_cast<const float*>(bytes + silu_table_byte_low(d[i]));
        silu[2 * i + 1] = *reinterpret_cast<const float*>(bytes + silu_table_byte_high(d[i]));
      }
    } else {
      silu_chunk<kAct>(g, silu);
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// SiLU*mul's op of the second pass (norm_act.cuh's apply_quantize_kernel) and the requantize op's gates

// The bits of two gates rounded to the nearest bf16, ties to even, low's in bits 0 ... 15 and high's above:
// coat_f32_to_bf16 of each for every value but NaN, which gives a NaN (of another payload; silu keeps it NaN and the
// encoder makes it canonical). On the GPU one cvt.rn.bf16x2.f32 (sm_80+): no flush of subnormals, overflow to +-Inf,
// NaN to 0x7FFF.
__device__ __forceinline__ uint32_t round_to_bf16x2_bits(float low, float high) {
#ifdef __CUDA_ARCH__
  uint32_t word;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(high), "f"(low));  // the first operand goes high
  return word;
#else
  return coat_f32_to_bf16(low) | static_cast<uint32_t>(coat_f32_to_bf16(high)) << 16;
#endif
}

// The gates of the SiLU*mul requantize op: silu of the decoded gate rounded to bf16 (coat_requantize_gate).
// E4M3 copies: from the forward's bf16 table (and its computed fallback).
template <bool kZeroGates, coat_activation kAct>
struct SiluOfDecodedGates {
  using Bf16 = SiluOfGates<VectorIo<COAT_BFLOAT16>, kAct>;
  using Table = typename Bf16::Table;
  __device__ __forceinline__ static void fill(Table& table) { Bf16::fill(table); }
  __device__ __forceinline__ static void chunk(const Table& table, const float g[kChunk], float silu[kChunk]) {
    uint32_t words[kChunk / 2];
    float rounded[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i) {
      words[i] = round_to_bf16x2_bits(g[2 * i], g[2 * i + 1]);
      rounded[2 * i] = __uint_as_float(words[i] << 16);
      rounded[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
    const VectorIo<COAT_BFLOAT16>::Raw raw{{make_uint4(words[0], words[1], words[2], words[3])}};
    Bf16::chunk(table, raw, rounded, silu);
  }
};

// FP4 and FP6 copies flush the values below their block's amax / 12 (FP4) or / 120 (FP6) to code 0, and a zero
// gate lies below the silu table's range (a chunk holding one would compute every silu of the chunk). They read a
// table of sigmoid(z(g)) instead, over the same bf16 gates, and take act = g * sigmoid(z(g)) as coat_silu does: every
// gate outside the range is looked up at the nearer end of its sign's plane, which holds its sigmoid too (0.5 below
// the first entry, zeros included; 1 or 0 from the last binade's end on, Inf and NaN included; tools/cuda_emulation
// checks every bf16 gate), so no gate needs a test.
template <coat_activation kAct>
struct SiluOfDecodedGates<true, kAct> {
  struct Table {
    float sigmoid[2 * kSiluTablePlane];
  };
  __device__ __forceinline__ static void fill(Table& table) {
    for (int first = threadIdx.x * kChunk; first < 2 * kSiluTablePlane; first += blockDim.x * kChunk) {
      float g[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) g[e] = silu_table_gate<kAct>(first + e);
      sigmoid_chunk<kAct>(g, &table.sigmoid[first]);
    }
    __syncthreads();
  }
  // Two gates a word, each half its own: the offset in the plane, max(min(|bits| - kSiluTableFirst, 4095), 0), in
  // one VIADDMNMX.S16x2, and the entry's byte, offset * 4 with the sign (bit 15) in bit 14, in one LOP3 (2 + 12 bits
  // fit a half). The FP4 requantize kernel, bound by instruction issue, took 673 instructions a lane and row taking
  // the gates one by one, 633 so.
  __device__ __forceinline__ static void chunk(const Table& table, const float g[kChunk], float silu[kChunk]) {
    constexpr uint32_t kMagnitudes = 0x7FFF7FFFu, kSignsInBit14 = 0x40004000u;
    constexpr uint32_t kMinusFirst = (0x10000u - kSiluTableFirst<kAct>) * 0x10001u;  // -first in each half
    constexpr uint32_t kLast = (kSiluTablePlane - 1) * 0x10001u;
    const char* bytes = reinterpret_cast<const char*>(table.sigmoid);
#pragma unroll
    for (int i = 0; i < kChunk / 2; ++i) {
      const uint32_t word = round_to_bf16x2_bits(g[2 * i], g[2 * i + 1]);
      const uint32_t offsets = __viaddmin_s16x2_relu(word & kMagnitudes, kMinusFirst, kLast);
      const uint32_t entry_bytes = offsets * 4u | ((word >> 1) & kSignsInBit14);
      silu[2 * i] = coat_silu(__uint_as_float(word << 16),
                              *reinterpret_cast<const float*>(bytes + (entry_bytes & 0xFFFFu)));
      silu[2 * i + 1] = coat_silu(__uint_as_float(word & 0xFFFF0000u),
                                  *reinterpret_cast<const float*>(bytes + (entry_bytes >> 16)));
    }
  }
};

// How SiluMulApply takes silu of the gates a Source reads (Gates, whose Table the block fills once), and silu() of a
// chunk of them (loaded, and their values): rows in high precision by SiluOfGates, saved copies by
// SiluOfDecodedGates (the decoded value is rounded to bf16 before silu: coat_requantize_gate).
template <class Source, coat_activation kAct>
struct SourceGates;

template <class Io, coat_activation kAct>
struct SourceGates<HighPrecisionRows<Io>, kAct> {
  using Gates = SiluOfGates<Io, kAct>;
  __device__ __forceinline__ static void silu(const typename Gates::Table& table,
                                              const typename HighPrecisionRows<Io>::Chunk& chunk,
                                              const float g[kChunk], float s[kChunk]) {
    Gates::chunk(table, chunk, g, s);
  }
};

template <bool kVectorCodes, coat_saved_format kFormat, coat_activation kAct>
struct SourceGates<SavedRows<kVectorCodes, kFormat>, kAct> {
  using Gates = SiluOfDecodedGates<kFormat != COAT_SAVED_E4M3, kAct>;
  __device__ __forceinline__ static void silu(const typename Gates::Table& table,
                                              const typename SavedRows<kVectorCodes, kFormat>::Chunk&,
                                              const float g[kChunk], float s[kChunk]) {
    Gates::chunk(table, g, s);
  }
};

// kGated false: the non-gated act, y = act(gate) [* smooth]; up is not read.
template <class Source, coat_activation kAct, bool kGated>
struct SiluMulApply {
  using Rows = Source;
  static constexpr bool kVector = Source::kVector;
  using Gates = typename SourceGates<Source, kAct>::Gates;
  using Table = typename Gates::Table;
  Source gate, up;
  const float* smooth_scale;

  struct Inputs {
    typename Source::Chunk gate, up;
  };
  struct Column {
    float smooth[kChunk];
  };

  __device__ __forceinline__ Inputs load(int64_t row, int col, int count) const {
    Inputs in;
    in.gate = gate.load(row, col, count);
    if constexpr (kGated) in.up = up.load(row, col, count);
    return in;
  }
  __device__ __forceinline__ Column column(int col, int count) const {
    Column c;
    load_smooth(smooth_scale, col, count, kVector, c.smooth);
    return c;
  }
  __device__ __forceinline__ static void fill(Table& table) { Gates::fill(table); }
  __device__ __forceinline__ void compute(const Table& table, const Inputs& in, const Column& c,
                                          float y[kChunk]) const {
    float g[kChunk], u[kChunk], silu[kChunk];
    gate.values(in.gate, g);
    if constexpr (kGated) up.values(in.up, u);
    SourceGates<Source, kAct>::silu(table, in.gate, g, silu);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) y[e] = coat_silu_mul(silu[e], kGated ? u[e] : 1.0f, c.smooth[e]);
  }
};

// ---------------------------------------------------------------------------------------------------
// SiLU*mul: the lanes' layout, and the forward's first pass

// Where a lane of silu_mul_stats_kernel / silu_mul_backward_kernel works: block b covers the 512-column
// segment b % segments of rows (b / segments) * 8 + warp, then + row_step, ...
struct SegmentLane {
  int segment_col;
  int lane;
  int64_t first_row;
  int64_t row_step;

  // silu_mul_stats_kernel: the lane's 16 consecutive columns start here (one save group when G = 16).
  __device__ int unit_col() const { return segment_col + lane * kUnit; }
  // silu_mul_backward_kernel: the first of chunk c's 8 columns. A warp's chunk c covers 256 contiguous columns,
  // so that each store of dgate or dup (16 bytes a lane in bf16) writes 512 contiguous bytes, whole sectors;
  // with 16 consecutive columns a lane, each store instruction wrote alternate 16-byte runs.
  __device__ int chunk_col(int c) const { return warp_chunk_col(c) + lane * kChunk; }
  __device__ int warp_chunk_col(int c) const { return segment_col + c * (kSegmentCols / kUnitChunks); }
};

__device__ __forceinline__ SegmentLane segment_lane(int segments, int strands) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  return {static_cast<int>(blockIdx.x % segments) * kSegmentCols, lane,
          static_cast<int64_t>(blockIdx.x / segments) * kElementwiseWarps + warp, strands * kElementwiseWarps};
}

struct SiluMulStatsArgs {
  const void* gate;
  const void* up;
  coat_dtype dtype;
  int64_t rows;
  int cols;
  int64_t gate_row_stride, up_row_stride;
  const float* smooth_scale;
  int group_shift;  // log2 of the save group size
  int segments;     // ceil(cols / 512)
  int strands;  // blocks per segment
  int saved_row_bytes;
  uint8_t* gate_saved;
  float* gate_scales;
  uint8_t* up_saved;
  float* up_scales;
  float* y_amax;
};

template <class Io>
struct SiluMulStatsInputs {
  typename Io::Raw gate[kUnitChunks], up[kUnitChunks];
};

// Blocks of silu_mul_stats_kernel per SM to hold registers for. Saving FP4 from bf16, 3 fit at 80 registers
// without spilling, and the arithmetic-bound kernel ran 2-4% faster for it (H200); E4M3 spilled 80 bytes at 80 and
// ran 1-8% slower, so it keeps ptxas's choice (98 registers, 2 blocks), as does fp16 (which spills 108 bytes at 80).
// FP6, also spill-free at 80, was not measured.
template <class Io, coat_saved_format kFormat>
constexpr int kSiluStatsMinBlocks =
    kFormat == COAT_SAVED_FP4 && std::is_same<Io, VectorIo<COAT_BFLOAT16>>::value ? 3 : 1;

// Each warp walks its rows with the next row's gate and up in flight; a quantization group (G <= 128
// columns, 16 per lane) never spans two warps. gate and up are saved in kFormat; up neither read nor saved
// without kGated.
template <class Io, coat_saved_format kFormat, coat_activation kAct, bool kGated>
__global__ void __launch_bounds__(kElementwiseThreads, (kSiluStatsMinBlocks<Io, kFormat>))
    silu_mul_stats_kernel(SiluMulStatsArgs a) {
  using Gates = SiluOfGates<Io, kAct>;
  __shared__ typename Gates::Table silu_table;
  const Io io{a.dtype};
  const SegmentLane at = segment_lane(a.segments, a.strands);
  const int unit_col = at.unit_col();
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const int lanes_per_group = (1 << a.group_shift) / kUnit;
  const auto load_row = [&](int64_t row) {
    SiluMulStatsInputs<Io> in;
    const void* gate_row = row_at(a.gate, io.element_size(), row, a.gate_row_stride);
#pragma unroll
    for (int c = 0; c < kUnitChunks; ++c) {
      const int col = unit_col + c * kChunk, count = chunk_count(col, a.cols);
      in.gate[c] = io.load(gate_row, col, count);
      if constexpr (kGated) in.up[c] = io.load(row_at(a.up, io.element_size(), row, a.up_row_stride), col, count);
    }
    return in;
  };

  // The first row is in flight while the table is filled.
  float amax = 0.0f;
  SiluMulStatsInputs<Io> next;
  if (at.first_row < a.rows) next = load_row(at.first_row);
  Gates::fill(silu_table);
  for (int64_t row = at.first_row; row < a.rows; row += at.row_step) {
    const SiluMulStatsInputs<Io> current = next;
    if (row + at.row_step < a.rows) next = load_row(row + at.row_step);
    float gate[kUnitChunks][kChunk], up[kUnitChunks][kChunk];
#pragma unroll
    for (int c = 0; c < kUnitChunks; ++c) {
      io.unpack(current.gate[c], gate[c]);
      if constexpr (kGated) io.unpack(current.up[c], up[c]);
    }
    save_chunks<kFormat, Io>(current.gate, gate, unit_col, a.cols, lanes_per_group, a.group_shift, Io::kVector,
                             a.gate_saved + row * a.saved_row_bytes, a.gate_scales + row * ngroups);
    if constexpr (kGated)
      save_chunks<kFormat, Io>(current.up, up, unit_col, a.cols, lanes_per_group, a.group_shift, Io::kVector,
                               a.up_saved + row * a.saved_row_bytes, a.up_scales + row * ngroups);
    // Past the row gate and up are 0, and so is y: a lane wholly past it skips y (a zero gate lies below the silu
    // table, and computing silu there kept the lanes of a warp past the row's end diverged behind the others).
    // Without Smooth-SwiGLU scales (the usual case) y is silu * up, the bits of silu * up * 1, with no ones to set and
    // multiply by (48 of the 713 instructions a lane and row saving FP4 from bf16, 70 of 602 saving E4M3).
    if (unit_col < a.cols) {
#pragma unroll
      for (int c = 0; c < kUnitChunks; ++c) {
        float silu[kChunk];
        Gates::chunk(silu_table, current.gate[c], gate[c], silu);
        if (a.smooth_scale == nullptr) {
#pragma unroll
          for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, kGated ? silu[e] * up[c][e] : silu[e]);
        } else {
          float smooth[kChunk];
          load_smooth(a.smooth_scale, unit_col + c * kChunk, chunk_count(unit_col + c * kChunk, a.cols),
                      Io::kVector, smooth);
#pragma unroll
          for (int e = 0; e < kChunk; ++e)
            amax = amax_step(amax, coat_silu_mul(silu[e], kGated ? up[c][e] : 1.0f, smooth[e]));
        }
      }
    }
  }
  amax = warp_max(amax);
  if (threadIdx.x % kWarpSize == 0) atomic_max_nonnegative(a.y_amax, amax);
}

// ---------------------------------------------------------------------------------------------------
// SiLU*mul backward

struct SiluMulBackwardArgs {
  const void* dy;
  coat_dtype dy_dtype;
  int64_t rows;
  int cols;
  int64_t row_stride;
  SavedCodes gate_saved;
  const float* gate_scales;
  SavedCodes up_saved;
  const float* up_scales;
  const float* smooth_scale;
  int group_shift;  // log2 of the save group size
  int segments;
  int strands;
  void* dgate;
  void* dup;
  float* d_amax;  // null: not wanted
};

// A lane's chunks of one row (SegmentLane::chunk_col): dy, the saved codes and their scales (a chunk's 8 columns
// start at a multiple of 8 and G >= 16, so they share one group).
template <class Io>
struct SiluMulBackwardInputs {
  typename Io::Raw dy[kUnitChunks];
  Codes gate[kUnitChunks], up[kUnitChunks];
  float gate_scale[kUnitChunks], up_scale[kUnitChunks];
};

// silu and dsilu (coat_silu_grad_factors) of a chunk's saved gates, each gate decoded and its sigmoid computed
// (about 28 instructions, the larger part of the kernel's work).
template <coat_saved_format kFormat, coat_activation kAct>
struct GateFactorsOfElements {
  __device__ __forceinline__ static void chunk(Codes codes, float scale, float silu[kChunk], float dsilu[kChunk]) {
    float gate[kChunk], s[kChunk];
    decode_saved(SavedCodes::e4m3_as<kFormat>(codes), scale, gate);
    sigmoid_chunk<kAct>(gate, s);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) coat_silu_grad_factors(kAct, gate[e], s[e], &silu[e], &dsilu[e]);
  }
};

// The same for FP4 gates saved in groups of G >= 64 columns, which kGroupLanes = G / 8 consecutive lanes of a warp's
// chunk share: a group's gates take only its 16 codes' values, so each lane computes the factors of
// 16 / kGroupLanes of them (code (lane % kGroupLanes) + kGroupLanes * i as entry i) and every element reads its
// code's from the lane holding them, by shuffle: one sigmoid a lane where there were eight. The same arithmetic
// on the same gate values, so the same bits. Every lane of the warp takes part, those past the row too.
template <int kGroupLanes, coat_activation kAct>
struct GateFactorsOfCodes {
  static_assert(kGroupLanes == 8 || kGroupLanes == 16, "a group of 64 or 128 columns");
  static constexpr int kCodesPerLane = 16 / kGroupLanes;

  // codes: the chunk's FP4 codes as loaded (element e in nibble e); scale: the lane's group's.
  __device__ __forceinline__ static void chunk(uint32_t codes, float scale, float silu[kChunk], float dsilu[kChunk]) {
    const int lane = threadIdx.x % kWarpSize;
    float own_silu[kCodesPerLane], own_dsilu[kCodesPerLane];
#pragma unroll
    for (int i = 0; i < kCodesPerLane; ++i) {
      const float gate = coat_e2m1_to_f32(static_cast<uint8_t>(lane % kGroupLanes + kGroupLanes * i)) * scale;
      coat_silu_grad_factors(kAct, gate, activation_sigmoid<kAct>(gate), &own_silu[i], &own_dsilu[i]);
    }
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      // The shuffle reads the lane within the group from the low log2(kGroupLanes) bits of its source operand.
      const int code = static_cast<int>(codes >> (4 * e));
      float from_silu[kCodesPerLane], from_dsilu[kCodesPerLane];
#pragma unroll
      for (int i = 0; i < kCodesPerLane; ++i) {
        from_silu[i] = __shfl_sync(kFullMask, own_silu[i], code, kGroupLanes);
        from_dsilu[i] = __shfl_sync(kFullMask, own_dsilu[i], code, kGroupLanes);
      }
      const bool second_entry = kCodesPerLane == 2 && (code & 0x8) != 0;  // G = 64: the negative codes
      silu[e] = second_entry ? from_silu[kCodesPerLane - 1] : from_silu[0];
      dsilu[e] = second_entry ? from_dsilu[kCodesPerLane - 1] : from_dsilu[0];
    }
  }
};

// kFormat: the saved format, a compile-time constant so that each format's kernel holds only its own decoding.
// kGroupLanes: 0, or the lanes of a save group when the gate's factors come from GateFactorsOfCodes.
// kGated false: the non-gated act's backward, up = 1, no dup.
template <class Io, coat_saved_format kFormat, int kGroupLanes, coat_activation kAct, bool kGated>
__global__ void __launch_bounds__(kElementwiseThreads) silu_mul_backward_kernel(SiluMulBackwardArgs a) {
  static_assert(kGroupLanes == 0 || kFormat == COAT_SAVED_FP4, "the codes' factors are shared in FP4 only");
  const Io io{a.dy_dtype};
  const SegmentLane at = segment_lane(a.segments, a.strands);
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const auto load_row = [&](int64_t row) {
    SiluMulBackwardInputs<Io> in;
    const void* dy_row = row_at(a.dy, io.element_size(), row, a.row_stride);
#pragma unroll
    for (int c = 0; c < kUnitChunks; ++c) {
      const int col = at.chunk_col(c), count = chunk_count(col, a.cols);
      const int group = col >> a.group_shift;  // a lane past the row may share a group with lanes in it
      in.dy[c] = io.load(dy_row, col, count);
      in.gate[c] = a.gate_saved.load_as<kFormat>(row, col, count, Io::kVector);
      in.gate_scale[c] = group < ngroups ? a.gate_scales[row * ngroups + group] : 0.0f;
      if constexpr (kGated) {
        in.up[c] = a.up_saved.load_as<kFormat>(row, col, count, Io::kVector);
        in.up_scale[c] = count > 0 ? a.up_scales[row * ngroups + group] : 0.0f;
      }
    }
    return in;
  };

  float amax = 0.0f;  // of the unrounded gradients: rounded once, after the warp's reduction
  // The loop over rows with and without Smooth-SwiGLU scales (without them smooth = 1, and the exact product by it
  // is left out): a test inside the loop was predication, which issues both sides. Both in one kernel: as kernels
  // of their own (fewer registers without the scales), the default one measured up to 10% slower on an H200.
  const auto all_rows = [&](auto smooth_scales) {
    constexpr bool kSmooth = decltype(smooth_scales)::value;
    SiluMulBackwardInputs<Io> next;
    if (at.first_row < a.rows) next = load_row(at.first_row);
    for (int64_t row = at.first_row; row < a.rows; row += at.row_step) {
      const SiluMulBackwardInputs<Io> current = next;
      if (row + at.row_step < a.rows) next = load_row(row + at.row_step);
#pragma unroll
      for (int c = 0; c < kUnitChunks; ++c) {
        if (at.warp_chunk_col(c) >= a.cols) continue;  // the whole warp's chunk is past the row
        const int col = at.chunk_col(c), count = chunk_count(col, a.cols);
        float silu[kChunk], dsilu[kChunk];
        if constexpr (kGroupLanes > 0)
          GateFactorsOfCodes<kGroupLanes, kAct>::chunk(current.gate[c].lo, current.gate_scale[c], silu, dsilu);
        if (count == 0) continue;
        if constexpr (kGroupLanes == 0)
          GateFactorsOfElements<kFormat, kAct>::chunk(current.gate[c], current.gate_scale[c], silu, dsilu);
        float dy[kChunk], up[kChunk], smooth[kChunk], dgate[kChunk], dup[kChunk];
        io.unpack(current.dy[c], dy);
        if constexpr (kGated) {
          decode_saved(SavedCodes::e4m3_as<kFormat>(current.up[c]), current.up_scale[c], up);
        } else {
#pragma unroll
          for (int e = 0; e < kChunk; ++e) up[e] = 1.0f;
        }
        if constexpr (kSmooth) load_chunk(a.smooth_scale, COAT_FLOAT32, col, count, Io::kVector, smooth);
#pragma unroll
        for (int e = 0; e < kChunk; ++e)
          coat_silu_mul_grads_of_factors(dy[e], up[e], kSmooth ? smooth[e] : 1.0f, silu[e], dsilu[e], &dgate[e],
                                         &dup[e]);
        io.store(row_at(a.dgate, io.element_size(), row, a.cols), col, count, dgate);
        if constexpr (kGated) io.store(row_at(a.dup, io.element_size(), row, a.cols), col, count, dup);
#pragma unroll
        for (int e = 0; e < kChunk; ++e)
          if (e < count) amax = kGated ? amax_step(amax_step(amax, dgate[e]), dup[e]) : amax_step(amax, dgate[e]);
      }
    }
  };
  if (a.smooth_scale == nullptr) all_rows(std::false_type{});
  else all_rows(std::true_type{});
  if (a.d_amax == nullptr) return;
  amax = warp_max(amax);
  if (threadIdx.x % kWarpSize == 0) atomic_max_nonnegative(a.d_amax, coat_round_as(a.dy_dtype, amax));
}

// ---------------------------------------------------------------------------------------------------
// Launch helpers

// The SiLU*mul kernels' grid: segments of 512 columns times strands of 8-row blocks.
template <auto kKernel>
bool silu_mul_grid(int64_t rows, int cols, int* segments, int* strands, unsigned* blocks) {
  const int64_t resident = resident_blocks<kKernel>(kElementwiseThreads, 0);
  if (resident <= 0) return false;
  *segments = static_cast<int>(coat_ceil_div(cols, kSegmentCols));
  *strands = static_cast<int>(strands_for(resident, *segments, coat_ceil_div(rows, kElementwiseWarps)));
  *blocks = static_cast<unsigned>(*segments * *strands);
  return true;
}

// Calls launch(activation, gated): the activation as a std::integral_constant, and whether the op has an up input
// (false: the non-gated act) as a std::bool_constant.
template <class Launch>
auto with_activation(coat_activation activation, bool gated, Launch&& launch) {
  const auto with_gating = [&](auto act) {
    return gated ? launch(act, std::true_type{}) : launch(act, std::false_type{});
  };
  if (activation == COAT_ACT_GELU_TANH)
    return with_gating(std::integral_constant<coat_activation, COAT_ACT_GELU_TANH>{});
  if (activation == COAT_ACT_QUICK_GELU)
    return with_gating(std::integral_constant<coat_activation, COAT_ACT_QUICK_GELU>{});
  return with_gating(std::integral_constant<coat_activation, COAT_ACT_SILU>{});
}

template <auto kKernel>
coat_status launch_silu_mul_backward(SiluMulBackwardArgs args, cudaStream_t stream) {
  unsigned blocks = 0;
  if (!silu_mul_grid<kKernel>(args.rows, args.cols, &args.segments, &args.strands, &blocks)) return COAT_ERROR_CUDA;
  kKernel<<<blocks, kElementwiseThreads, 0, stream>>>(args);
  return launch_status();
}

}  // namespace

extern "C" {

coat_status coat_silu_mul_quantize_cuda(const void* gate, const void* up, coat_dtype dtype, int64_t rows,
                                        int64_t cols, int64_t gate_row_stride, int64_t up_row_stride,
                                        const float* smooth_scale, coat_activation activation, int64_t save_group_size,
                                        coat_saved_format save_format, coat_fp8_format y_format, uint8_t* y,
                                        float* y_scale, uint8_t* y_t, uint8_t* gate_saved, float* gate_scales,
                                        uint8_t* up_saved, float* up_scales, float* y_amax, coat_cuda_stream stream) {
  if (!valid_matrix(gate, rows, cols, gate_row_stride) ||
      (up != nullptr && !valid_matrix(up, rows, cols, up_row_stride)) ||
      !coat_is_valid_group_size(save_group_size) || y_scale == nullptr || y_amax == nullptr ||
      !valid_saved_format(save_format) || !coat_is_valid_activation(activation))
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(y_amax, 0, sizeof(float), cuda_stream) != cudaSuccess) return COAT_ERROR_CUDA;
  SiluMulStatsArgs args;
  args.gate = gate;
  args.up = up;
  args.dtype = dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.gate_row_stride = gate_row_stride;
  args.up_row_stride = up_row_stride;
  args.smooth_scale = smooth_scale;
  args.group_shift = coat::device::ceil_log2(save_group_size);
  args.saved_row_bytes = static_cast<int>(saved_row_bytes(cols, save_format));
  args.gate_saved = gate_saved;
  args.gate_scales = gate_scales;
  args.up_saved = up_saved;
  args.up_scales = up_scales;
  args.y_amax = y_amax;
  // The saved codes move 8 bytes (E4M3), 4 (FP4) or 2 (FP6) at a time: rows of cols % 8 == 0 codes keep them
  // aligned.
  const bool gated = up != nullptr;
  const bool vector = cols % kChunk == 0 && rows_aligned16(gate, dtype, gate_row_stride) &&
                      (!gated || rows_aligned16(up, dtype, up_row_stride)) &&
                      (smooth_scale == nullptr || aligned(smooth_scale, 16)) && aligned(gate_saved, 8) &&
                      (!gated || aligned(up_saved, 8));
  coat_status status = COAT_SUCCESS;
  with_io(dtype, vector, [&](auto io) {
    status = with_activation(activation, gated, [&](auto act, auto gating) {
      using Io = decltype(io);
      constexpr coat_activation kAct = decltype(act)::value;
      constexpr bool kGated = decltype(gating)::value;
      if (rows > 0 && cols > 0) {
        const coat_status stats = with_saved_format(save_format, [&](auto format) {
          constexpr auto kKernel = silu_mul_stats_kernel<Io, decltype(format)::value, kAct, kGated>;
          unsigned blocks = 0;
          if (!silu_mul_grid<kKernel>(rows, args.cols, &args.segments, &args.strands, &blocks))
            return COAT_ERROR_CUDA;
          kKernel<<<blocks, kElementwiseThreads, 0, cuda_stream>>>(args);
          return COAT_SUCCESS;
        });
        if (stats != COAT_SUCCESS) return stats;
      }
      const SiluMulApply<HighPrecisionRows<Io>, kAct, kGated> op{
          {io, gate, gate_row_stride}, {io, up, up_row_stride}, smooth_scale};
      return launch_apply_quantize(op, rows, args.cols, OutputScale::from_amax(y_amax, y_scale), y_format, y, y_t,
                                   cuda_stream);
    });
  });
  return status;
}

coat_status coat_silu_mul_requantize_cuda(const uint8_t* gate_saved, const float* gate_scales,
                                          const uint8_t* up_saved, const float* up_scales, int64_t save_group_size,
                                          coat_saved_format saved_format, int64_t rows, int64_t cols,
                                          const float* smooth_scale, coat_activation activation,
                                          const float* y_scale, coat_fp8_format y_format,
                                          uint8_t* y_t, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || cols > COAT_NORM_ACT_MAX_COLS || y_scale == nullptr ||
      !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      !coat_is_valid_activation(activation) ||
      (rows * cols > 0 && (gate_saved == nullptr || gate_scales == nullptr ||
                           (up_saved != nullptr && up_scales == nullptr) || y_t == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows * cols == 0) return COAT_SUCCESS;
  const int group_shift = coat::device::ceil_log2(save_group_size);
  const int ngroups = static_cast<int>(coat_ceil_div(cols, save_group_size));
  const SavedCodes gate_codes = saved_codes(gate_saved, cols, saved_format);
  const SavedCodes up_codes = saved_codes(up_saved, cols, saved_format);
  const bool gated = up_saved != nullptr;
  const bool vector = cols % kChunk == 0 && vector_aligned(gate_codes) && (!gated || vector_aligned(up_codes)) &&
                      (smooth_scale == nullptr || aligned(smooth_scale, 16));
  return with_saved_rows(vector, gate_codes.format, [&](auto vector_codes, auto format) {
    return with_activation(activation, gated, [&](auto act, auto gating) {
      using Saved = SavedRows<decltype(vector_codes)::value, decltype(format)::value>;
      const Saved gate{gate_codes, gate_scales, ngroups, group_shift};
      const Saved up{up_codes, up_scales, ngroups, group_shift};
      const SiluMulApply<Saved, decltype(act)::value, decltype(gating)::value> op{gate, up, smooth_scale};
      return launch_apply_quantize(op, rows, static_cast<int>(cols), OutputScale::of(y_scale), y_format, nullptr,
                                   y_t, reinterpret_cast<cudaStream_t>(stream));
    });
  });
}

coat_status coat_silu_mul_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                        int64_t row_stride, const uint8_t* gate_saved, const float* gate_scales,
                                        const uint8_t* up_saved, const float* up_scales,
                                        const float* smooth_scale, coat_activation activation, int64_t save_group_size,
                                        coat_saved_format saved_format, void* dgate, void* dup, float* d_amax,
                                        coat_cuda_stream stream) {
  if (!valid_matrix(dy, rows, cols, row_stride) || !coat_is_valid_group_size(save_group_size) ||
      !valid_saved_format(saved_format) || !coat_is_valid_activation(activation) ||
      (rows * cols > 0 && (gate_saved == nullptr || gate_scales == nullptr || dgate == nullptr ||
                           (up_saved != nullptr && (up_scales == nullptr || dup == nullptr)))))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows * cols == 0) return COAT_SUCCESS;
  SiluMulBackwardArgs args;
  args.dy = dy;
  args.dy_dtype = dy_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.gate_saved = saved_codes(gate_saved, cols, saved_format);
  args.gate_scales = gate_scales;
  args.up_saved = saved_codes(up_saved, cols, saved_format);
  args.up_scales = up_scales;
  args.smooth_scale = smooth_scale;
  args.group_shift = coat::device::ceil_log2(save_group_size);
  args.dgate = dgate;
  args.dup = dup;
  args.d_amax = d_amax;
  const bool gated = up_saved != nullptr;
  const bool vector = cols % kChunk == 0 && rows_aligned16(dy, dy_dtype, row_stride) &&
                      (smooth_scale == nullptr || aligned(smooth_scale, 16)) && aligned(dgate, 16) &&
                      (!gated || aligned(dup, 16)) && vector_aligned(args.gate_saved) &&
                      (!gated || vector_aligned(args.up_saved));
  coat_status status = COAT_SUCCESS;
  with_io(dy_dtype, vector, [&](auto io) {
    with_saved_format(saved_format, [&](auto format) {
      status = with_activation(activation, gated, [&](auto act, auto gating) {
        using Io = decltype(io);
        constexpr coat_saved_format kFormat = decltype(format)::value;
        constexpr coat_activation kAct = decltype(act)::value;
        constexpr bool kGated = decltype(gating)::value;
        const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
        if constexpr (kFormat == COAT_SAVED_FP4) {
          if (save_group_size == 128)
            return launch_silu_mul_backward<silu_mul_backward_kernel<Io, kFormat, 16, kAct, kGated>>(args,
                                                                                                    cuda_stream);
          if (save_group_size == 64)
            return launch_silu_mul_backward<silu_mul_backward_kernel<Io, kFormat, 8, kAct, kGated>>(args,
                                                                                                   cuda_stream);
        }
        return launch_silu_mul_backward<silu_mul_backward_kernel<Io, kFormat, 0, kAct, kGated>>(args, cuda_stream);
      });
    });
  });
  return status;
}

}  // extern "C"
