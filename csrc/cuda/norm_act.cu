// CUDA implementation of coat/norm_act.h. Element math and reduction orders come from
// coat/detail/norm_act_math.h, so every output equals the C core's (csrc/cpu/norm_act.c) bit for bit.
//
// Work is cut into chunks of 8 consecutive elements of a row (one 16-byte access of bf16/fp16, two of fp32).
// Every kernel is instantiated for an Io, the way it reads and writes the high-precision tensors:
// VectorIo<dtype> (16-byte accesses; cols % 8 == 0 and 16-byte aligned rows) or ElementIo (any dtype,
// element by element: odd widths, misaligned views), which changes the speed but not a single result bit.
//
// Kernels:
//   rmsnorm_stats_kernel     persistent; L threads per row (L = coat_rmsnorm_lanes(cols)): rstd, the saved x
//                            (E4M3, FP4 or FP6, an instantiation each), the amax of y (one guarded atomicMax per
//                            warp); the next rows' x is loaded while these are reduced
//   silu_mul_stats_kernel    persistent; 16 consecutive elements per lane, a warp per 512 columns of a row:
//                            the saved gate and up (an instantiation per format), the amax of y; the warp's next
//                            row in flight
//   apply_quantize_kernel    persistent over 64 x 64 tiles, the next tile in flight: recomputes y from the
//                            inputs, writes it in FP8 and, through a shared-memory tile, its transpose; the
//                            requantize ops run it on the saved inputs (E4M3, FP4 or FP6, an instantiation each)
//                            with the forward's scale, y_t only
//   rmsnorm_backward_kernel  L threads per slice of rows, the next row in flight: dx (plus the residual
//                            gradient when there is one), and one partial dweight row per slice
//   dweight_finish_kernel    the slices' partial dweight rows summed in the documented order
//   silu_mul_backward_kernel persistent, on silu_mul_stats_kernel's segments with each lane's two chunks 256
//                            columns apart: dgate, dup and their joint amax; with FP4 gates in groups of 64 or
//                            128, each gate's sigmoid is computed once per code of its group and shuffled
// The kernels that read saved inputs take them in any saved format (SavedCodes): FP4 and FP6 codes are loaded
// packed and expanded to their E4M3 codes where they are decoded, so that the next row or tile stays in flight.
//
// Fast paths. The arithmetic that used to dominate (IEEE divisions, coat's exp with its range checks, FP8,
// bf16 and fp16 conversions with their special cases) runs in forms that give the same bits on the values
// that occur in training, behind one test per chunk that sends every other chunk (NaN, Inf, scales below
// 2^-80, gates below -80) through the plain formulas: see fp8_chunk.cuh (scale_from_amax, quotient,
// reciprocal_of_normal, encode_chunk), e2m_chunk.cuh (encode_e2m_chunk), decode_e4m3, sigmoid_near, SiluOfGates (a table of silu for bf16 gates) and the Io stores.
// tools/cuda_emulation runs these kernels on the CPU against the C core.
#include <cuda_runtime.h>

#include <type_traits>

#include "coat/detail/norm_act_math.h"
#include "coat/norm_act.h"
#include "e2m_chunk.cuh"
#include "fp8_chunk.cuh"
#include "group_amax.cuh"
#include "launch.cuh"

namespace {

using coat::device::amax_step;
using coat::device::Codes;
using coat::device::code_at;
using coat::device::encode_chunk;
using coat::device::e2m_scale_from_amax_bits;
using coat::device::encode_e2m_chunk;
using coat::device::load_e2m_chunk;
using coat::device::PackedCodes;
using coat::device::store_e2m_chunk;
using coat::device::group_amax_reduce;
using coat::device::pack_16bit;
using coat::device::pack_16bit_not_nan;
using coat::device::reciprocal_of_normal;
using coat::device::scale_from_amax;
using coat::device::launch_status;

constexpr int kChunk = COAT_NORM_ACT_CHUNK;
constexpr int kChunksPerLane = COAT_RMSNORM_MAX_CHUNKS_PER_LANE;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWarpSize = 32;
// Rows of L <= 256 lanes share 256-thread blocks; wider rows get a block of their own.
constexpr int kRowBlockThreads = 256;
// The second pass: 64 x 64 tiles, each thread two chunks of one chunk column, 32 rows apart.
constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kTileThreads = 256;
constexpr int kTileChunksPerRow = kTileCols / kChunk;
constexpr int kTileRowsApart = kTileThreads / kTileChunksPerRow;
// The SiLU*mul kernels: a lane holds 16 consecutive elements (one save group when G = 16), a warp 512
// columns of one row, a block 8 rows.
constexpr int kUnitChunks = 2;
constexpr int kUnit = kUnitChunks * kChunk;
constexpr int kSegmentCols = kWarpSize * kUnit;
constexpr int kElementwiseThreads = 256;
constexpr int kElementwiseWarps = kElementwiseThreads / kWarpSize;

static_assert(kChunk == coat::device::kCodeChunk, "the loads and stores below move 8 elements per chunk");

__device__ __forceinline__ int chunk_count(int col, int cols) { return col < cols ? min(cols - col, kChunk) : 0; }

// Row `row` of a matrix whose rows start row_stride elements apart. Offsets within a row are ints
// (cols <= COAT_NORM_ACT_MAX_COLS); row offsets are 64-bit.
template <class T>
__device__ __forceinline__ T* row_at(T* base, size_t element_size, int64_t row, int64_t row_stride) {
  using Byte = typename std::conditional<std::is_const<T>::value, const char, char>::type;
  const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(row_stride) * element_size;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + offset);
}

__device__ __forceinline__ size_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

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

// s[e] = coat_sigmoid(g[e]): sigmoid_near when every gate of the chunk is >= -80 (NaN is not), the plain
// formula otherwise.
__device__ __forceinline__ void sigmoid_chunk(const float g[kChunk], float s[kChunk]) {
  bool near = true;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) near &= g[e] >= -80.0f;
  if (near) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) s[e] = sigmoid_near(g[e]);
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) s[e] = coat_sigmoid(g[e]);
  }
}

// ---------------------------------------------------------------------------------------------------
// FP8 codes of a chunk

// `vector`: count is 0 or 8 and the codes are 8-byte aligned; otherwise byte by byte.
__device__ __forceinline__ Codes load_codes(const uint8_t* src, int count, bool vector) {
  if (vector) {
    if (count == 0) return {0u, 0u};
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    return {raw.x, raw.y};
  }
  Codes codes{0u, 0u};
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    if (e < count) {
      if (e < 4) codes.lo |= static_cast<uint32_t>(src[e]) << (8 * e);
      else codes.hi |= static_cast<uint32_t>(src[e]) << (8 * (e - 4));
    }
  }
  return codes;
}

// The E4M3 codes of the eight E2M1 codes packed in `word` (element e in nibble e), coat_e2m1_to_e4m3 of each: the
// magnitudes looked up in a byte table by prmt, the signs by two more: nibble 2k's sign (bit 8k + 3) is bit 8k + 7
// of word << 4 and nibble 2k + 1's is bit 8k + 7 of word, so bytes taken alternately from the two carry each
// nibble's sign in their bit 7 (3 instructions for 8 signs where shifts and masks took 12).
__device__ __forceinline__ Codes e2m1x8_to_e4m3(uint32_t word) {
  // coat_e2m1_to_e4m3 of the magnitudes 0..7: 0x00 0x30 0x38 0x3C and 0x40 0x44 0x48 0x4C
  constexpr uint32_t kMagnitudes0To3 = 0x3C383000u, kMagnitudes4To7 = 0x4C484440u;
  constexpr uint32_t kSignBits = 0x80808080u;
  const uint32_t magnitudes = word & 0x77777777u;  // prmt reads the low 4 selector nibbles, bit 3 of each clear
  const uint32_t shifted = word << 4;
  return {__byte_perm(kMagnitudes0To3, kMagnitudes4To7, magnitudes) | (__byte_perm(word, shifted, 0x1504u) & kSignBits),
          __byte_perm(kMagnitudes0To3, kMagnitudes4To7, magnitudes >> 16) |
              (__byte_perm(word, shifted, 0x3726u) & kSignBits)};
}

// The E4M3 codes of the eight E2M3 codes packed in `codes` (element e at bit 6e of the 48 bits lo, hi),
// coat_e2m3_to_e4m3 of each, four at a time in the bytes of a word: the magnitudes from 8 on add 48, those below
// are looked up in a byte table by prmt, and each code's sign (bit 5) moves to bit 7.
__device__ __forceinline__ uint32_t e2m3x4_to_e4m3(uint32_t four) {
  // the four 6-bit codes of `four` (bits 0..23), one per byte
  const uint32_t bytes = (four & 0x3Fu) | ((four << 2) & 0x3F00u) | ((four << 4) & 0x3F0000u) | ((four << 6) & 0x3F000000u);
  const uint32_t magnitudes = bytes & 0x1F1F1F1Fu;
  // coat_e2m3_to_e4m3 of the subnormal magnitudes 0..7: 0x00 0x20 0x28 0x2C and 0x30 0x32 0x34 0x36
  constexpr uint32_t kSubnormals0To3 = 0x2C282000u, kSubnormals4To7 = 0x36343230u;
  const uint32_t low3 = bytes & 0x07070707u;
  const uint32_t nibbles = low3 | (low3 >> 4);  // bytes 0 and 2: two selector nibbles each
  const uint32_t selector = (nibbles & 0xFFu) | ((nibbles >> 8) & 0xFF00u);
  const uint32_t subnormal = __byte_perm(kSubnormals0To3, kSubnormals4To7, selector);
  const uint32_t normal_mask = (((magnitudes + 0x78787878u) & 0x80808080u) >> 7) * 0xFFu;  // magnitude >= 8
  return (((magnitudes + 0x30303030u) & normal_mask) | (subnormal & ~normal_mask)) | ((bytes & 0x20202020u) << 2);
}

__device__ __forceinline__ Codes e2m3x8_to_e4m3(Codes packed) {
  return {e2m3x4_to_e4m3(packed.lo), e2m3x4_to_e4m3((packed.lo >> 24) | (packed.hi << 8))};
}

// The codes an input was saved in for backward (coat/norm_act.h, "Saved inputs"): E4M3, or FP4 or FP6 read as
// their exact E4M3 expansion, so that the kernels reading them decode every format alike. The *_as<kFormat>
// forms take the format as a compile-time constant, for kernels instantiated per format; the others read it from
// `format`.
struct SavedCodes {
  const uint8_t* data;
  int64_t row_bytes;  // cols, or the packed bytes of a row in FP4 and FP6
  coat_saved_format format;

  // The codes of elements [col, col + count) of `row` as stored, zeros past count: 8 bytes of E4M3, or the packed
  // FP4 or FP6 codes (element e at bit 4e or 6e of lo, hi). `vector`: count is 0 or 8 and the codes are aligned
  // for one access per chunk (8 bytes of E4M3, 4 of FP4) or three (FP6's 2-byte halves).
  template <coat_saved_format kFormat>
  __device__ __forceinline__ Codes load_as(int64_t row, int col, int count, bool vector) const {
    const uint8_t* row_codes = data + row * row_bytes;
    if constexpr (kFormat == COAT_SAVED_E4M3) {
      return load_codes(row_codes + col, count, vector);
    } else {
      constexpr int kMantissaBits = kFormat == COAT_SAVED_FP4 ? 1 : 3;
      const PackedCodes packed = load_e2m_chunk<kMantissaBits>(
          row_codes + col / kChunk * coat::device::E2m<kMantissaBits>::kChunkBytes, count, vector);
      return {packed.lo, packed.hi};
    }
  }

  // Loaded codes as E4M3 codes: FP4 and FP6 codes expand exactly. Apart from load(), so that a kernel prefetching
  // the next row or tile waits for its data where it decodes it, not where it issues the load.
  template <coat_saved_format kFormat>
  __device__ __forceinline__ static Codes e4m3_as(Codes loaded) {
    if constexpr (kFormat == COAT_SAVED_FP4) {
      return e2m1x8_to_e4m3(loaded.lo);
    } else if constexpr (kFormat == COAT_SAVED_FP6) {
      return e2m3x8_to_e4m3(loaded);
    } else {
      return loaded;
    }
  }

  __device__ __forceinline__ Codes load(int64_t row, int col, int count, bool vector) const {
    switch (format) {
      case COAT_SAVED_FP4: return load_as<COAT_SAVED_FP4>(row, col, count, vector);
      case COAT_SAVED_FP6: return load_as<COAT_SAVED_FP6>(row, col, count, vector);
      default: return load_as<COAT_SAVED_E4M3>(row, col, count, vector);
    }
  }
  __device__ __forceinline__ Codes e4m3(Codes loaded) const {
    switch (format) {
      case COAT_SAVED_FP4: return e4m3_as<COAT_SAVED_FP4>(loaded);
      case COAT_SAVED_FP6: return e4m3_as<COAT_SAVED_FP6>(loaded);
      default: return e4m3_as<COAT_SAVED_E4M3>(loaded);
    }
  }
};

__device__ __forceinline__ void store_codes(uint8_t* dst, Codes codes, int count, bool vector) {
  if (vector) {
    if (count > 0) *reinterpret_cast<uint2*>(dst) = make_uint2(codes.lo, codes.hi);
    return;
  }
#pragma unroll
  for (int e = 0; e < kChunk; ++e)
    if (e < count) dst[e] = code_at(codes, e);
}

// v[e] = coat_e4m3_to_f32(code e): on sm_89+ converted in pairs to fp16 by the hardware (exact) and widened.
// The two agree on every code but NaN, where both give a NaN of another payload; every output a NaN reaches
// is stored canonically.
__device__ __forceinline__ void decode_e4m3(Codes codes, float v[kChunk]) {
#ifdef COAT_HARDWARE_FP8_CONVERT
#pragma unroll
  for (int pair = 0; pair < 4; ++pair) {
    const uint32_t word = pair < 2 ? codes.lo : codes.hi;
    const __half2_raw halves = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(word >> (16 * (pair % 2))), __NV_E4M3);
    const float2 widened = __half22float2(__half2(halves));
    v[2 * pair] = widened.x;
    v[2 * pair + 1] = widened.y;
  }
#else
#pragma unroll
  for (int e = 0; e < kChunk; ++e) v[e] = coat_e4m3_to_f32(code_at(codes, e));
#endif
}

// v[e] = coat_saved_value(code e, scale): a chunk of an FP8-saved input (a chunk lies within one group).
__device__ __forceinline__ void decode_saved(Codes codes, float scale, float v[kChunk]) {
  decode_e4m3(codes, v);
#pragma unroll
  for (int e = 0; e < kChunk; ++e) v[e] = v[e] * scale;
}

// ---------------------------------------------------------------------------------------------------
// High-precision chunks: the Io types, and loads of per-column vectors (weight, smooth scale)

__device__ __forceinline__ void unpack_16bit(uint32_t pair, coat_dtype dtype, float* out) {
  if (dtype == COAT_BFLOAT16) {
    out[0] = __uint_as_float(pair << 16);
    out[1] = __uint_as_float(pair & 0xFFFF0000u);
  } else {
    out[0] = coat_f16_to_f32(static_cast<uint16_t>(pair & 0xFFFFu));
    out[1] = coat_f16_to_f32(static_cast<uint16_t>(pair >> 16));
  }
}

// v[0..8) = elements [offset, offset + count) of `data` as fp32, zeros past count; `vector`: count is 0 or 8
// and the chunk is 16-byte aligned. For the per-column vectors, whose dtype is only known at run time.
__device__ __forceinline__ void load_chunk(const void* data, coat_dtype dtype, int offset, int count, bool vector,
                                           float v[kChunk]) {
  if (vector) {
    if (count == 0) {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[e] = 0.0f;
    } else if (dtype == COAT_FLOAT32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(data) + offset);
      const float4 a = p[0], b = p[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + offset);
      unpack_16bit(raw.x, dtype, v);
      unpack_16bit(raw.y, dtype, v + 2);
      unpack_16bit(raw.z, dtype, v + 4);
      unpack_16bit(raw.w, dtype, v + 6);
    }
    return;
  }
  if (dtype == COAT_FLOAT32) {
    const float* p = static_cast<const float*>(data) + offset;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = e < count ? p[e] : 0.0f;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(data) + offset;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const uint16_t h = e < count ? p[e] : 0;
      v[e] = dtype == COAT_BFLOAT16 ? coat_bf16_to_f32(h) : coat_f16_to_f32(h);
    }
  }
}

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

// The RMSNorm weight as fp32 in shared memory, staged once per block: two planes of float4, the first and the
// second half of each chunk, so that lanes reading consecutive chunks hit consecutive banks.
struct WeightPlanes {
  float4* planes;
  int chunks;

  __host__ __device__ static size_t bytes(int cols) { return sizeof(float4) * 2 * ((cols + kChunk - 1) / kChunk); }

  // All threads of the block must call it (it synchronizes). Columns past cols hold 0.
  __device__ __forceinline__ void stage(const void* weight, coat_dtype dtype, int cols, bool vector) const {
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float w[kChunk];
      load_chunk(weight, dtype, c * kChunk, chunk_count(c * kChunk, cols), vector, w);
      planes[c] = make_float4(w[0], w[1], w[2], w[3]);
      planes[chunks + c] = make_float4(w[4], w[5], w[6], w[7]);
    }
    __syncthreads();
  }

  // The weight of the chunk from col (< cols).
  __device__ __forceinline__ void chunk(int col, float w[kChunk]) const {
    const float4 low = planes[col / kChunk], high = planes[chunks + col / kChunk];
    w[0] = low.x, w[1] = low.y, w[2] = low.z, w[3] = low.w, w[4] = high.x, w[5] = high.y, w[6] = high.z, w[7] = high.w;
  }
};

// The 16-byte path for one dtype. A chunk is loaded as Raw (16-bit values stay packed, so that a prefetched
// row costs half the registers) and unpacked where it is used; count is 0 (past the row: zeros, no access)
// or 8. Stores round with pack_16bit_not_nan unless the chunk holds a NaN.
template <coat_dtype kDtype>
struct VectorIo {
  static constexpr bool kVector = true;
  static constexpr int kWords = kDtype == COAT_FLOAT32 ? 2 : 1;
  struct Raw {
    uint4 words[kWords];
  };
  // Indexing with the element type and an int column keeps the address one multiply-add.
  using Element = typename std::conditional<kDtype == COAT_FLOAT32, float, uint16_t>::type;
  coat_dtype dtype;

  __device__ __forceinline__ size_t element_size() const { return sizeof(Element); }

  __device__ __forceinline__ Raw load(const void* row, int col, int count) const {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const Element*>(row) + col);
    Raw raw;
#pragma unroll
    for (int w = 0; w < kWords; ++w) raw.words[w] = count > 0 ? p[w] : make_uint4(0u, 0u, 0u, 0u);
    return raw;
  }

  __device__ __forceinline__ void unpack(const Raw& raw, float v[kChunk]) const {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      const uint32_t word[4] = {raw.words[w].x, raw.words[w].y, raw.words[w].z, raw.words[w].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (kDtype == COAT_FLOAT32) v[4 * w + i] = __uint_as_float(word[i]);
        else unpack_16bit(word[i], kDtype, v + 2 * i);
      }
    }
  }

  __device__ __forceinline__ void store(void* row, int col, int count, const float v[kChunk]) const {
    if (count == 0) return;
    bool nan = false;
#pragma unroll
    for (int e = 0; e < kChunk; e += 2) nan |= (v[e] != v[e]) | (v[e + 1] != v[e + 1]);
    uint4* p = reinterpret_cast<uint4*>(static_cast<Element*>(row) + col);
    if constexpr (kDtype == COAT_FLOAT32) {
      float out[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) out[e] = nan ? coat_canonical_nan(v[e]) : v[e];
      p[0] = make_uint4(__float_as_uint(out[0]), __float_as_uint(out[1]), __float_as_uint(out[2]),
                        __float_as_uint(out[3]));
      p[1] = make_uint4(__float_as_uint(out[4]), __float_as_uint(out[5]), __float_as_uint(out[6]),
                        __float_as_uint(out[7]));
    } else if (nan) {
      p[0] = make_uint4(pack_16bit<kDtype>(v[0], v[1]), pack_16bit<kDtype>(v[2], v[3]),
                        pack_16bit<kDtype>(v[4], v[5]), pack_16bit<kDtype>(v[6], v[7]));
    } else {
      p[0] = make_uint4(pack_16bit_not_nan<kDtype>(v[0], v[1]), pack_16bit_not_nan<kDtype>(v[2], v[3]),
                        pack_16bit_not_nan<kDtype>(v[4], v[5]), pack_16bit_not_nan<kDtype>(v[6], v[7]));
    }
  }
};

// Element by element, any dtype: chunks may be short (count < 8), rows need no alignment.
struct ElementIo {
  static constexpr bool kVector = false;
  struct Raw {
    float v[kChunk];
  };
  coat_dtype dtype;

  __device__ __forceinline__ size_t element_size() const { return ::element_size(dtype); }

  __device__ __forceinline__ Raw load(const void* row, int col, int count) const {
    Raw raw;
    load_chunk(static_cast<const char*>(row) + col * element_size(), dtype, 0, count, false, raw.v);
    return raw;
  }

  __device__ __forceinline__ void unpack(const Raw& raw, float v[kChunk]) const {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = raw.v[e];
  }

  __device__ __forceinline__ void store(void* row, int col, int count, const float v[kChunk]) const {
    char* p = static_cast<char*>(row) + col * element_size();
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) coat_store_as(p, dtype, e, v[e]);
  }
};

// ---------------------------------------------------------------------------------------------------
// silu(g) of a chunk of gates

// The table of silu(g) for bf16 g with 2^-24 <= |g| < 2^8: entry (sign << 12) | (bits - 0x3380), bits the
// 15 low bits of g's, in [0x3380, 0x4380): 32 binades of 128 values in one 4096-entry plane per sign.
constexpr uint32_t kSiluTableFirst = 0x3380;  // the bf16 bits of 2^-24
constexpr int kSiluTablePlane = 4096;

// The gate of table entry i.
__device__ __forceinline__ float silu_table_gate(int i) {
  const uint32_t sign = static_cast<uint32_t>(i / kSiluTablePlane) << 15;
  return coat_bf16_to_f32(static_cast<uint16_t>(sign | (kSiluTableFirst + i % kSiluTablePlane)));
}

// silu[e] = coat_silu(g[e], coat_sigmoid(g[e])), computed.
__device__ __forceinline__ void silu_chunk(const float g[kChunk], float silu[kChunk]) {
  float s[kChunk];
  sigmoid_chunk(g, s);
#pragma unroll
  for (int e = 0; e < kChunk; ++e) silu[e] = coat_silu(g[e], s[e]);
}

// silu_chunk for gates of any dtype (Table is empty, fill does nothing). chunk() takes the gates as loaded (raw)
// and as fp32 (g).
template <class Io>
struct SiluOfGates {
  struct Table {};
  __device__ __forceinline__ static void fill(Table&) {}
  __device__ __forceinline__ static void chunk(const Table&, const typename Io::Raw&, const float g[kChunk],
                                               float silu[kChunk]) {
    silu_chunk(g, silu);
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
template <>
struct SiluOfGates<VectorIo<COAT_BFLOAT16>> {
  struct Table {
    float silu[2 * kSiluTablePlane];
  };

  // All threads of the block must call it (it synchronizes). Eight consecutive entries at a time, by
  // silu_chunk.
  __device__ __forceinline__ static void fill(Table& table) {
    for (int first = threadIdx.x * kChunk; first < 2 * kSiluTablePlane; first += blockDim.x * kChunk) {
      float g[kChunk], silu[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) g[e] = silu_table_gate(first + e);
      silu_chunk(g, silu);
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
    constexpr uint32_t kFirstPair = kSiluTableFirst * 0x10001u;
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
      silu_chunk(g, silu);
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// Reductions

__device__ __forceinline__ float warp_max(float v) { return group_amax_reduce(v, kWarpSize); }

// The row's sum of one partial per lane, in the order of coat_combine_lane_partials: xor butterfly in each
// warp (lane l adds lane l + 16, + 8, ..., + 1), then across the row's warps the same way. Every thread of
// the block must call it (it synchronizes when a row spans warps); warp_sums holds one float per warp, and
// must not be the buffer of the previous call (whose readers may still be at it).
__device__ __forceinline__ float row_sum(float partial, int lanes, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) partial = partial + __shfl_xor_sync(kFullMask, partial, offset);
  if (lanes == kWarpSize) return partial;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warps_per_row = lanes / kWarpSize;
  if (lane == 0) warp_sums[warp] = partial;
  __syncthreads();
  float v = lane < warps_per_row ? warp_sums[(warp & -warps_per_row) + lane] : 0.0f;  // the row's first warp + lane
  for (int offset = warps_per_row / 2; offset > 0; offset >>= 1) v = v + __shfl_xor_sync(kFullMask, v, offset);
  return __shfl_sync(kFullMask, v, 0);
}

// amax = max(amax, value) for value >= 0 and not NaN: such floats order like their bit patterns. The read
// first skips the atomic whenever it cannot raise the maximum, which after the first few warps is always.
__device__ __forceinline__ void atomic_max_nonnegative(float* amax, float value) {
  if (value > *reinterpret_cast<volatile float*>(amax))
    atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(value));
}

// The largest coat_magnitude_bits of the values of kChunks chunks, given as loaded (raw) and as fp32 (v). bf16
// chunks are reduced as loaded, two values a word: a bf16 magnitude's bits are the upper half of its fp32
// magnitude's, so the largest 16-bit magnitude (VIMNMX3.U16x2, two words an instruction) shifted up is the fp32 one,
// in 7 ALU instructions for 8 values where the fp32 form took 16 (unpacking the low halves, masking, maxima).
template <class Io, int kChunks>
__device__ __forceinline__ uint32_t magnitude_bits_max(const typename Io::Raw* raw,
                                                       const float (&v)[kChunks][kChunk]) {
  if constexpr (std::is_same<Io, VectorIo<COAT_BFLOAT16>>::value) {
    constexpr uint32_t kMagnitudes = 0x7FFF7FFFu;
    uint32_t halves = 0u;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 w = raw[c].words[0];
      halves = __vimax3_u16x2(halves, w.x & kMagnitudes, w.y & kMagnitudes);
      halves = __vimax3_u16x2(halves, w.z & kMagnitudes, w.w & kMagnitudes);
    }
    return max(halves & 0xFFFF0000u, halves << 16);
  } else {
    uint32_t bits = 0u;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int e = 0; e < kChunk; ++e) bits = coat_max_bits(bits, coat_magnitude_bits(v[c][e]));
    return bits;
  }
}

// save_chunks in COAT_SAVED_FP4 (kMantissaBits 1) and COAT_SAVED_FP6 (3): coat_quantize_fp4's and
// coat_quantize_fp6's blocks (coat/quantize.h), the amax taken on the bits of |x| (a NaN makes its block's scale
// NaN), the chunk's 8 codes packed into 4 bytes at col / 2 (FP4) or 6 at col * 3 / 4 (FP6).
template <int kMantissaBits, class Io, int kChunks>
__device__ __forceinline__ void save_chunks_e2m(const typename Io::Raw* raw, const float (&v)[kChunks][kChunk],
                                                int col, int valid_cols, int lanes_per_group, int group_shift,
                                                bool vector, uint8_t* saved_row, float* scales_row) {
  static_assert(kChunk == coat::device::kE2mCodeChunk, "a chunk's codes are one packed chunk");
  uint32_t amax_bits = magnitude_bits_max<Io>(raw, v);
  for (int mask = lanes_per_group >> 1; mask > 0; mask >>= 1)
    amax_bits =
        coat_max_bits(amax_bits, static_cast<uint32_t>(__shfl_xor_sync(kFullMask, static_cast<int>(amax_bits), mask)));
  if (col >= valid_cols) return;
  const float scale = e2m_scale_from_amax_bits<kMantissaBits>(amax_bits);
  const float reciprocal = reciprocal_of_normal(scale);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int first = col + c * kChunk, count = chunk_count(first, valid_cols);
    // past the row x is +0, whose code is 0: the padding bits of the row's last byte
    if (count > 0)
      store_e2m_chunk<kMantissaBits>(saved_row + first / kChunk * coat::device::E2m<kMantissaBits>::kChunkBytes,
                                     encode_e2m_chunk<kMantissaBits>(v[c], scale, reciprocal), count,
                                     vector && count == kChunk);
  }
  if ((col & ((1 << group_shift) - 1)) == 0) scales_row[col >> group_shift] = scale;
}

// save_chunks in COAT_SAVED_E4M3: coat_quantize_group's 1 x G groups.
template <int kChunks>
__device__ __forceinline__ void save_chunks_e4m3(const float (&v)[kChunks][kChunk], int col, int valid_cols,
                                                 int lanes_per_group, int group_shift, bool vector, uint8_t* saved_row,
                                                 float* scales_row) {
  float amax = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c)
#pragma unroll
    for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, v[c][e]);
  amax = group_amax_reduce(amax, lanes_per_group);
  if (col >= valid_cols) return;
  const float scale = scale_from_amax<COAT_E4M3>(amax);
  const float reciprocal = reciprocal_of_normal(scale);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int count = chunk_count(col + c * kChunk, valid_cols);
    if (count > 0)
      store_codes(saved_row + col + c * kChunk, encode_chunk<COAT_E4M3, false>(v[c], scale, reciprocal), count,
                  vector);
  }
  if ((col & ((1 << group_shift) - 1)) == 0) scales_row[col >> group_shift] = scale;
}

// Saves kChunks consecutive chunks of an input (columns [col, col + 8 kChunks) of the row), given as loaded by Io
// (raw) and as fp32 (v), in kFormat with 1 x G groups, G = 2^group_shift, held by lanes_per_group consecutive
// lanes: the codes, and from the group's first lane the scale. valid_cols is the row's width, or 0 for a row past
// the matrix (nothing is stored). All lanes of the warp must call it. The format is a compile-time constant so that each kernel holds one encoder: with the three
// in one kernel, bf16 silu_mul_stats took 108 registers (98 for E4M3 alone, 99 for FP4) and rmsnorm_stats at 80
// spilled 56 bytes (4 for E4M3 alone), which cost the E4M3 forward 1-19% (benchmarks/NOTES.md).
template <coat_saved_format kFormat, class Io, int kChunks>
__device__ __forceinline__ void save_chunks(const typename Io::Raw* raw, const float (&v)[kChunks][kChunk], int col,
                                            int valid_cols, int lanes_per_group, int group_shift, bool vector,
                                            uint8_t* saved_row, float* scales_row) {
  if constexpr (kFormat == COAT_SAVED_FP4)
    save_chunks_e2m<1, Io>(raw, v, col, valid_cols, lanes_per_group, group_shift, vector, saved_row, scales_row);
  else if constexpr (kFormat == COAT_SAVED_FP6)
    save_chunks_e2m<3, Io>(raw, v, col, valid_cols, lanes_per_group, group_shift, vector, saved_row, scales_row);
  else
    save_chunks_e4m3(v, col, valid_cols, lanes_per_group, group_shift, vector, saved_row, scales_row);
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm forward, first pass

struct RmsnormStatsArgs {
  const void* x;
  coat_dtype x_dtype;
  int64_t rows;
  int cols;
  int64_t row_stride;
  const void* weight;
  coat_dtype weight_dtype;
  float eps;
  int group_shift;  // log2 of the save group size
  int lanes;
  int64_t row_groups;  // groups of kMaxThreads / lanes rows, one per block and iteration
  int saved_row_bytes;
  uint8_t* x_saved;
  float* x_saved_scales;
  float* rstd;
  float* y_amax;
};

// A lane's chunks of one row (lane + k L for k < kChunksPerLane), as loaded.
template <class Io>
struct LaneChunks {
  typename Io::Raw chunk[kChunksPerLane];
};

template <class Io>
__device__ __forceinline__ LaneChunks<Io> load_lane_chunks(const Io& io, const void* row, int lane, int lanes,
                                                           int valid_cols) {
  LaneChunks<Io> chunks;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int col = (lane + k * lanes) * kChunk;
    chunks.chunk[k] = io.load(row, col, chunk_count(col, valid_cols));
  }
  return chunks;
}

// Blocks of rmsnorm_stats_kernel per SM to hold registers for: 256-thread blocks of bf16 fit 3 at 80 registers,
// spilling 4 bytes (E4M3), 16 (FP4) or 20 (FP6): one reload per row group.
template <int kMaxThreads, class Io>
constexpr int kStatsMinBlocks = kMaxThreads == 256 && std::is_same<Io, VectorIo<COAT_BFLOAT16>>::value ? 3 : 1;

// Block b reduces row groups b, b + gridDim.x, ... (kMaxThreads / L rows each, L lanes per row); with
// kPrefetch the next group's x is in flight while this group is reduced. x is saved in kFormat.
template <int kMaxThreads, class Io, coat_saved_format kFormat>
__global__ void __launch_bounds__(kMaxThreads, (kStatsMinBlocks<kMaxThreads, Io>))
    rmsnorm_stats_kernel(RmsnormStatsArgs a) {
  // 1024-thread blocks have 64 registers per thread: no room for a second row.
  constexpr bool kPrefetch = kMaxThreads <= 512;
  __shared__ float warp_sums[2][kMaxThreads / kWarpSize];
  extern __shared__ float4 weight_planes[];  // WeightPlanes::bytes(cols)
  const WeightPlanes weights{weight_planes, (a.cols + kChunk - 1) / kChunk};
  const Io io{a.x_dtype};
  const int lane = threadIdx.x % a.lanes, row_in_group = threadIdx.x / a.lanes;
  const int rows_per_group = kMaxThreads / a.lanes;
  const int chunks = (a.cols + kChunk - 1) / kChunk;
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const auto row_of = [&](int64_t group) { return group * rows_per_group + row_in_group; };
  const auto load_row = [&](int64_t group) {
    const int64_t row = row_of(group);
    const bool active = row < a.rows;
    return load_lane_chunks(io, row_at(a.x, io.element_size(), active ? row : 0, a.row_stride), lane, a.lanes,
                            active ? a.cols : 0);
  };

  // The first rows are in flight while the weight is staged.
  LaneChunks<Io> next;
  if constexpr (kPrefetch) next = load_row(blockIdx.x);
  weights.stage(a.weight, a.weight_dtype, a.cols, Io::kVector);
  float amax = 0.0f;
  int parity = 0;
  for (int64_t group = blockIdx.x; group < a.row_groups; group += gridDim.x, parity ^= 1) {
    LaneChunks<Io> x_row;
    if constexpr (kPrefetch) {
      x_row = next;
      if (group + gridDim.x < a.row_groups) next = load_row(group + gridDim.x);
    } else {
      x_row = load_row(group);
    }
    const int64_t row = row_of(group);
    const bool active = row < a.rows;
    const int valid_cols = active ? a.cols : 0;
    uint8_t* saved_row = a.x_saved + (active ? row : 0) * a.saved_row_bytes;
    float* scales_row = a.x_saved_scales + (active ? row : 0) * ngroups;

    // x^2 for rstd and the FP8 copy saved for backward. Terms past the row are +0; adding them changes
    // nothing, as a partial is never -0.
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;  // uniform over the block
      float x[1][kChunk];
      io.unpack(x_row.chunk[k], x[0]);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) partial = partial + x[0][e] * x[0][e];
      save_chunks<kFormat, Io>(&x_row.chunk[k], x, (lane + k * a.lanes) * kChunk, valid_cols,
                               (1 << a.group_shift) / kChunk, a.group_shift, Io::kVector, saved_row, scales_row);
    }
    const float rstd = coat_rmsnorm_rstd(row_sum(partial, a.lanes, warp_sums[parity]), a.cols, a.eps);
    if (active && lane == 0) a.rstd[row] = coat_canonical_nan(rstd);

    // The amax of y. Past a short chunk x and the weight are 0, so y is 0 or NaN there, which changes no amax.
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = chunk_count(col, valid_cols);
      if (count == 0) continue;
      float x[kChunk], weight[kChunk];
      io.unpack(x_row.chunk[k], x);
      weights.chunk(col, weight);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, coat_rmsnorm_apply(x[e], rstd, weight[e]));
    }
  }
  amax = warp_max(amax);
  if (threadIdx.x % kWarpSize == 0) atomic_max_nonnegative(a.y_amax, amax);
}

// ---------------------------------------------------------------------------------------------------
// Second pass of both forward ops, and the requantize ops: y computed from the inputs and quantized with the
// per-tensor scale

// Where an apply op reads one of its inputs: rows of the high-precision tensor (the forward ops) or the FP8
// copy the forward saved (the requantize ops). load() fetches a chunk (count 0: zeros, no access), values()
// turns it into fp32; Gates is how silu is taken of gates read this way, silu() takes it of a chunk of them (loaded,
// and their values).
template <class Io>
struct HighPrecisionRows {
  static constexpr bool kVector = Io::kVector;
  using Chunk = typename Io::Raw;
  using Gates = SiluOfGates<Io>;
  Io io;
  const void* data;
  int64_t row_stride;

  __device__ __forceinline__ Chunk load(int64_t row, int col, int count) const {
    return io.load(row_at(data, io.element_size(), row, row_stride), col, count);
  }
  __device__ __forceinline__ void values(const Chunk& chunk, float v[kChunk]) const { io.unpack(chunk, v); }
  __device__ __forceinline__ static void silu(const typename Gates::Table& table, const Chunk& chunk,
                                              const float g[kChunk], float s[kChunk]) {
    Gates::chunk(table, chunk, g, s);
  }
};

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
template <bool kZeroGates>
struct SiluOfDecodedGates {
  using Bf16 = SiluOfGates<VectorIo<COAT_BFLOAT16>>;
  using Table = Bf16::Table;
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
// table of sigmoid instead, over the same bf16 gates, and take silu = g * sigmoid(g) as coat_silu does: every gate
// outside the range is looked up at the nearer end of its sign's plane, which holds its sigmoid too (0.5 below
// 2^-24, zeros included; 1 or 0 from |g| = 256 on, Inf and NaN included; tools/cuda_emulation checks every bf16
// gate), so no gate needs a test.
template <>
struct SiluOfDecodedGates<true> {
  struct Table {
    float sigmoid[2 * kSiluTablePlane];
  };
  __device__ __forceinline__ static void fill(Table& table) {
    for (int first = threadIdx.x * kChunk; first < 2 * kSiluTablePlane; first += blockDim.x * kChunk) {
      float g[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) g[e] = silu_table_gate(first + e);
      sigmoid_chunk(g, &table.sigmoid[first]);
    }
    __syncthreads();
  }
  // Two gates a word, each half its own: the offset in the plane, max(min(|bits| - kSiluTableFirst, 4095), 0), in
  // one VIADDMNMX.S16x2, and the entry's byte, offset * 4 with the sign (bit 15) in bit 14, in one LOP3 (2 + 12 bits
  // fit a half). The FP4 requantize kernel, bound by instruction issue, took 673 instructions a lane and row taking
  // the gates one by one, 633 so.
  __device__ __forceinline__ static void chunk(const Table& table, const float g[kChunk], float silu[kChunk]) {
    constexpr uint32_t kMagnitudes = 0x7FFF7FFFu, kSignsInBit14 = 0x40004000u;
    constexpr uint32_t kMinusFirst = (0x10000u - kSiluTableFirst) * 0x10001u;  // -kSiluTableFirst in each half
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

// A saved input: codes of rows x cols in kFormat, and one scale per 1 x 2^group_shift group.
// kVectorCodes: cols % 8 == 0 and codes aligned for SavedCodes' vector loads. As a gate, the decoded value is
// rounded to bf16 before silu (coat_requantize_gate).
template <bool kVectorCodes, coat_saved_format kFormat>
struct SavedRows {
  static constexpr bool kVector = kVectorCodes;
  struct Chunk {
    Codes codes;
    float scale;
  };
  using Gates = SiluOfDecodedGates<kFormat != COAT_SAVED_E4M3>;
  SavedCodes codes;
  const float* scales;
  int ngroups;      // scales per row, ceil(cols / 2^group_shift)
  int group_shift;  // log2 of the save group size

  __device__ __forceinline__ Chunk load(int64_t row, int col, int count) const {
    return {codes.load_as<kFormat>(row, col, count, kVector),
            count > 0 ? scales[row * ngroups + (col >> group_shift)] : 0.0f};
  }
  __device__ __forceinline__ void values(const Chunk& chunk, float v[kChunk]) const {
    decode_saved(SavedCodes::e4m3_as<kFormat>(chunk.codes), chunk.scale, v);
  }
  __device__ __forceinline__ static void silu(const typename Gates::Table& table, const Chunk&, const float g[kChunk],
                                              float s[kChunk]) {
    Gates::chunk(table, g, s);
  }
};

// An op of the second pass loads a chunk's Inputs (prefetched a tile ahead), the per-column data of its
// chunk column once (Column), and computes y from them and a Table in shared memory that it fills once per
// block (empty but for SiLU*mul of bf16 rows and of saved gates). kVector: y's codes and the per-column data
// move 8 and 16 bytes at a time.
template <class Source>
struct RmsnormApply {
  using Rows = Source;
  static constexpr bool kVector = Source::kVector;
  struct Table {};
  Source x;
  const float* rstd;
  const void* weight;
  coat_dtype weight_dtype;

  struct Inputs {
    typename Source::Chunk x;
    float rstd;
  };
  struct Column {
    float weight[kChunk];
  };

  __device__ __forceinline__ Inputs load(int64_t row, int col, int count) const {
    return {x.load(row, col, count), count > 0 ? rstd[row] : 0.0f};
  }
  __device__ __forceinline__ Column column(int col, int count) const {
    Column c;
    load_chunk(weight, weight_dtype, col, count, kVector, c.weight);
    return c;
  }
  __device__ __forceinline__ static void fill(Table&) {}
  __device__ __forceinline__ void compute(const Table&, const Inputs& in, const Column& c, float y[kChunk]) const {
    float x_chunk[kChunk];
    x.values(in.x, x_chunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) y[e] = coat_rmsnorm_apply(x_chunk[e], in.rstd, c.weight[e]);
  }
};

template <class Source>
struct SiluMulApply {
  using Rows = Source;
  static constexpr bool kVector = Source::kVector;
  using Gates = typename Source::Gates;
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
    return {gate.load(row, col, count), up.load(row, col, count)};
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
    up.values(in.up, u);
    Source::silu(table, in.gate, g, silu);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) y[e] = coat_silu_mul(silu[e], u[e], c.smooth[e]);
  }
};

// The per-tensor scale of the second pass: derived from the amax of y and written to *derived (the forward
// ops), or given (the requantize ops reuse the forward's).
struct OutputScale {
  const float* amax;   // nullptr when the scale is given
  const float* given;  // read when amax is nullptr
  float* derived;      // receives the derived scale

  static OutputScale from_amax(const float* amax, float* y_scale) { return {amax, nullptr, y_scale}; }
  static OutputScale of(const float* y_scale) { return {nullptr, y_scale, nullptr}; }

  // The scale; block 0 writes a derived one out.
  __device__ __forceinline__ float read(coat_fp8_format format) const {
    if (amax == nullptr) return *given;
    const float scale = coat_scale_from_amax(*amax, format);
    if (blockIdx.x == 0 && threadIdx.x == 0) *derived = scale;
    return scale;
  }
};

// 4 x 4 byte transpose: word i holds row i's 4 bytes (columns 0..3); result word j holds column j's 4 bytes.
__device__ __forceinline__ void transpose_4x4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t out[4]) {
  const uint32_t rows01_low = __byte_perm(w0, w1, 0x5140), rows23_low = __byte_perm(w2, w3, 0x5140);
  const uint32_t rows01_high = __byte_perm(w0, w1, 0x7362), rows23_high = __byte_perm(w2, w3, 0x7362);
  out[0] = __byte_perm(rows01_low, rows23_low, 0x5410);
  out[1] = __byte_perm(rows01_low, rows23_low, 0x7632);
  out[2] = __byte_perm(rows01_high, rows23_high, 0x5410);
  out[3] = __byte_perm(rows01_high, rows23_high, 0x7632);
}

// Blocks of apply_quantize_kernel per SM to hold registers for: three 256-thread blocks (80 registers) when a
// chunk's inputs stay packed in 16 bytes (16-bit rows, vector saved codes), which they fit without spilling;
// ptxas's own choice gave SiLU*mul of bf16 rows 92 registers and of FP4 codes 89, two blocks. Wider inputs
// (fp32, element-wise) would spill at 80.
template <class Op>
constexpr int kApplyMinBlocks = Op::kVector && sizeof(typename Op::Rows::Chunk) <= 16 ? 3 : 1;

// Block b takes column tile b % col_tiles and row tiles b / col_tiles, + row_strands, ...; each thread two
// chunks of one chunk column (rows r and r + 32 of the tile), the next tile's inputs in flight. y, when set,
// is written row-major from registers and y_t, when set, transposed through shared memory (two tile
// buffers, alternating, so that one barrier per tile suffices).
template <class Op>
__global__ void __launch_bounds__(kTileThreads, kApplyMinBlocks<Op>)
    apply_quantize_kernel(Op op, int64_t rows, int cols, int col_tiles, int64_t row_strands, OutputScale y_scale,
                          coat_fp8_format format, uint8_t* y, uint8_t* y_t) {
  // 64 rows of 64 codes as 16 words, plus one word of padding so that the transposed reads of a warp
  // (8 row quads x 4 column quads) hit 32 different banks.
  __shared__ uint32_t tile[2][kTileRows][kTileCols / 4 + 1];
  __shared__ typename Op::Table table;
  const float scale = y_scale.read(format);
  const float reciprocal = reciprocal_of_normal(scale);
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int col0 = static_cast<int>(blockIdx.x % col_tiles) * kTileCols;
  const int chunk_in_row = threadIdx.x % kTileChunksPerRow;
  const int first_row = threadIdx.x / kTileChunksPerRow;
  const int col = col0 + chunk_in_row * kChunk;
  const typename Op::Column column = op.column(col, chunk_count(col, cols));

  struct TileInputs {
    typename Op::Inputs half[2];
  };
  const auto load_tile = [&](int64_t row_tile) {
    TileInputs in;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row_tile * kTileRows + first_row + h * kTileRowsApart;
      in.half[h] = op.load(row, col, row < rows ? chunk_count(col, cols) : 0);
    }
    return in;
  };

  // The first tile is in flight while the table is filled.
  int64_t row_tile = blockIdx.x / col_tiles;
  TileInputs next;
  if (row_tile < row_tiles) next = load_tile(row_tile);
  Op::fill(table);
  for (int parity = 0; row_tile < row_tiles; row_tile += row_strands, parity ^= 1) {
    const TileInputs current = next;
    if (row_tile + row_strands < row_tiles) next = load_tile(row_tile + row_strands);
    const int64_t row0 = row_tile * kTileRows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = first_row + h * kTileRowsApart;
      const int64_t row = row0 + r;
      const int count = row < rows ? chunk_count(col, cols) : 0;
      Codes codes{0u, 0u};
      if (count > 0) {
        float values[kChunk];
        op.compute(table, current.half[h], column, values);
        codes = format == COAT_E4M3 ? encode_chunk<COAT_E4M3, true>(values, scale, reciprocal)
                                    : encode_chunk<COAT_E5M2, true>(values, scale, reciprocal);
        if (y != nullptr) store_codes(y + row * cols + col, codes, count, Op::kVector);
      }
      if (y_t != nullptr) {
        tile[parity][r][2 * chunk_in_row] = codes.lo;
        tile[parity][r][2 * chunk_in_row + 1] = codes.hi;
      }
    }
    if (y_t == nullptr) continue;  // uniform over the grid
    __syncthreads();
    // Each thread transposes a 4 x 4 block; a warp covers 8 row quads of 4 column quads, so every column
    // of y_t gets 32 contiguous bytes from 8 lanes.
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int col_quad = (warp % 4) * 4 + lane / 8, row_quad = (warp / 4) * 8 + lane % 8;
    uint32_t columns[4];
    transpose_4x4(tile[parity][4 * row_quad][col_quad], tile[parity][4 * row_quad + 1][col_quad],
                  tile[parity][4 * row_quad + 2][col_quad], tile[parity][4 * row_quad + 3][col_quad], columns);
    const int64_t row = row0 + 4 * row_quad;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int out_col = col0 + 4 * col_quad + j;
      if (out_col >= cols || row >= rows) continue;
      uint8_t* dst = y_t + out_col * rows + row;
      if (rows % 4 == 0) {  // then row + 3 < rows and dst is 4-byte aligned
        *reinterpret_cast<uint32_t*>(dst) = columns[j];
      } else {
        for (int i = 0; i < 4 && row + i < rows; ++i) dst[i] = static_cast<uint8_t>(columns[j] >> (8 * i));
      }
    }
  }
}

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
// columns, 16 per lane) never spans two warps. gate and up are saved in kFormat.
template <class Io, coat_saved_format kFormat>
__global__ void __launch_bounds__(kElementwiseThreads, (kSiluStatsMinBlocks<Io, kFormat>))
    silu_mul_stats_kernel(SiluMulStatsArgs a) {
  __shared__ typename SiluOfGates<Io>::Table silu_table;
  const Io io{a.dtype};
  const SegmentLane at = segment_lane(a.segments, a.strands);
  const int unit_col = at.unit_col();
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const int lanes_per_group = (1 << a.group_shift) / kUnit;
  const auto load_row = [&](int64_t row) {
    SiluMulStatsInputs<Io> in;
    const void* gate_row = row_at(a.gate, io.element_size(), row, a.gate_row_stride);
    const void* up_row = row_at(a.up, io.element_size(), row, a.up_row_stride);
#pragma unroll
    for (int c = 0; c < kUnitChunks; ++c) {
      const int col = unit_col + c * kChunk, count = chunk_count(col, a.cols);
      in.gate[c] = io.load(gate_row, col, count);
      in.up[c] = io.load(up_row, col, count);
    }
    return in;
  };

  // The first row is in flight while the table is filled.
  float amax = 0.0f;
  SiluMulStatsInputs<Io> next;
  if (at.first_row < a.rows) next = load_row(at.first_row);
  SiluOfGates<Io>::fill(silu_table);
  for (int64_t row = at.first_row; row < a.rows; row += at.row_step) {
    const SiluMulStatsInputs<Io> current = next;
    if (row + at.row_step < a.rows) next = load_row(row + at.row_step);
    float gate[kUnitChunks][kChunk], up[kUnitChunks][kChunk];
#pragma unroll
    for (int c = 0; c < kUnitChunks; ++c) {
      io.unpack(current.gate[c], gate[c]);
      io.unpack(current.up[c], up[c]);
    }
    save_chunks<kFormat, Io>(current.gate, gate, unit_col, a.cols, lanes_per_group, a.group_shift, Io::kVector,
                             a.gate_saved + row * a.saved_row_bytes, a.gate_scales + row * ngroups);
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
        SiluOfGates<Io>::chunk(silu_table, current.gate[c], gate[c], silu);
        if (a.smooth_scale == nullptr) {
#pragma unroll
          for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, silu[e] * up[c][e]);
        } else {
          float smooth[kChunk];
          load_smooth(a.smooth_scale, unit_col + c * kChunk, chunk_count(unit_col + c * kChunk, a.cols),
                      Io::kVector, smooth);
#pragma unroll
          for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, coat_silu_mul(silu[e], up[c][e], smooth[e]));
        }
      }
    }
  }
  amax = warp_max(amax);
  if (threadIdx.x % kWarpSize == 0) atomic_max_nonnegative(a.y_amax, amax);
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm backward

struct RmsnormBackwardArgs {
  const void* dy;
  coat_dtype dy_dtype;
  coat_dtype dx_dtype;  // the residual's, or dy's without one
  int64_t rows;
  int cols;
  int64_t row_stride;
  SavedCodes x_saved;
  const float* x_saved_scales;
  int group_shift;  // log2 of the save group size
  const float* rstd;
  const void* weight;
  coat_dtype weight_dtype;
  int lanes;
  int64_t rows_per_slice, slices;
  const void* residual;  // or nullptr
  void* dx;
  float* workspace;
};

// What a lane reads of one row: its chunks of dy and of the saved codes, their scales, and rstd.
template <class Io>
struct BackwardRow {
  typename Io::Raw dy[kChunksPerLane];
  Codes codes[kChunksPerLane];
  float scales[kChunksPerLane];
  float rstd;
};

// Bytes of shared memory per thread for its dweight partial sums (kChunksPerLane x 8 floats).
constexpr size_t kDweightBytesPerThread = sizeof(float) * kChunksPerLane * kChunk;

// Whether rmsnorm_backward_kernel stages the weight in shared memory: not beside the 128 KB of dweight
// partials of 1024-thread blocks.
template <int kMaxThreads>
constexpr bool kBackwardWeightShared = kMaxThreads <= 512;

template <int kMaxThreads>
size_t backward_shared_bytes(int cols) {
  return kDweightBytesPerThread * kMaxThreads + (kBackwardWeightShared<kMaxThreads> ? WeightPlanes::bytes(cols) : 0);
}

// L threads per slice of rows; each lane accumulates the dweight partial sums of its own columns across the
// slice's rows, in shared memory (float4 (k, half) of thread t at [(2 k + half) * blockDim.x + t], so that
// a warp's accesses are conflict-free), and writes them to the slice's workspace row at the end. Rows are
// walked with the next one in flight, except in 1024-thread blocks (64 registers per thread).
// Blocks of rmsnorm_backward_kernel per SM to hold registers for: two 256-thread blocks (the slices' one wave)
// when a row's inputs stay packed (16-bit dy), else one, which fp32 or element-wise dy needs to hold two rows
// in registers without spilling (the slices then take two waves).
template <int kMaxThreads, class Io>
constexpr int kBackwardMinBlocks = kMaxThreads == 256 && sizeof(typename Io::Raw) == 16 ? 2 : 1;

// Io reads dy. ResidualIo is void without a residual (dx in dy's dtype, written by Io), else the Io that reads
// the residual and writes dx, in the residual's dtype.
template <int kMaxThreads, class Io, class ResidualIo>
__global__ void __launch_bounds__(kMaxThreads, (kBackwardMinBlocks<kMaxThreads, Io>))
    rmsnorm_backward_kernel(RmsnormBackwardArgs a) {
  constexpr bool kPrefetch = kMaxThreads <= 512;
  constexpr bool kResidual = !std::is_void<ResidualIo>::value;
  using DxIo = typename std::conditional<kResidual, ResidualIo, Io>::type;
  __shared__ float warp_sums[2][kMaxThreads / kWarpSize];
  extern __shared__ float4 dweight_partials[];  // backward_shared_bytes(cols): the partials, then the weight
  const WeightPlanes weights{dweight_partials + kChunksPerLane * 2 * kMaxThreads, (a.cols + kChunk - 1) / kChunk};
  // The weight of a chunk of the row.
  const auto weight_of = [&](int col, int count, float w[kChunk]) {
    if constexpr (kBackwardWeightShared<kMaxThreads>) weights.chunk(col, w);
    else load_chunk(a.weight, a.weight_dtype, col, count, Io::kVector, w);
  };
  const Io io{a.dy_dtype};
  const DxIo dx_io{a.dx_dtype};
  const int lane = threadIdx.x % a.lanes;
  const int64_t slice = static_cast<int64_t>(blockIdx.x) * (kMaxThreads / a.lanes) + threadIdx.x / a.lanes;
  const int chunks = (a.cols + kChunk - 1) / kChunk;
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const auto partials_at = [&](int k, int half) -> float4& {
    return dweight_partials[(2 * k + half) * kMaxThreads + threadIdx.x];
  };
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) partials_at(k, 0) = partials_at(k, 1) = make_float4(0.f, 0.f, 0.f, 0.f);

  const auto load_row = [&](int64_t i) {
    const int64_t row = slice * a.rows_per_slice + i;
    const bool active = slice < a.slices && row < a.rows;
    const int64_t safe_row = active ? row : 0;
    const void* dy_row = row_at(a.dy, io.element_size(), safe_row, a.row_stride);
    const float* scales_row = a.x_saved_scales + safe_row * ngroups;
    BackwardRow<Io> in;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      in.dy[k] = io.load(dy_row, col, count);
      in.codes[k] = a.x_saved.load(safe_row, col, count, Io::kVector);
      in.scales[k] = count > 0 ? scales_row[col >> a.group_shift] : 0.0f;
    }
    in.rstd = active ? a.rstd[row] : 0.0f;
    return in;
  };
  // xhat of chunk k, as coat_rmsnorm_xhat gives it (codes past the row are 0: xhat is 0 there).
  const auto xhat_of = [&](const BackwardRow<Io>& in, int k, float xhat[kChunk]) {
    decode_saved(a.x_saved.e4m3(in.codes[k]), in.scales[k], xhat);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) xhat[e] = xhat[e] * in.rstd;
  };

  // The first row is in flight while the weight is staged.
  BackwardRow<Io> next;
  if constexpr (kPrefetch) next = load_row(0);
  if constexpr (kBackwardWeightShared<kMaxThreads>) weights.stage(a.weight, a.weight_dtype, a.cols, Io::kVector);
  for (int64_t i = 0; i < a.rows_per_slice; ++i) {  // the same trip count for every thread of the block
    BackwardRow<Io> current;
    if constexpr (kPrefetch) {
      current = next;
      if (i + 1 < a.rows_per_slice) next = load_row(i + 1);
    } else {
      current = load_row(i);
    }
    const int64_t row = slice * a.rows_per_slice + i;
    const bool active = slice < a.slices && row < a.rows;
    void* dx_row = row_at(a.dx, dx_io.element_size(), active ? row : 0, a.cols);
    // Chunks past the row add nothing; in a short chunk the terms past the row are +0 (as in the forward,
    // adding them changes nothing).
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;  // uniform over the block
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      if (count == 0) continue;
      float dy[kChunk], weight[kChunk], xhat[kChunk];
      io.unpack(current.dy[k], dy);
      weight_of(col, count, weight);
      xhat_of(current, k, xhat);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) partial = partial + (dy[e] * weight[e]) * xhat[e];
    }
    // The row's residual is loaded while its dot product is reduced (with the next row's inputs it would not fit
    // in registers).
    typename DxIo::Raw residual[kChunksPerLane];
    if constexpr (kResidual) {
      const void* residual_row = row_at(a.residual, dx_io.element_size(), active ? row : 0, a.cols);
#pragma unroll
      for (int k = 0; k < kChunksPerLane; ++k) {
        const int col = (lane + k * a.lanes) * kChunk;
        residual[k] = dx_io.load(residual_row, col, active ? chunk_count(col, a.cols) : 0);
      }
    }
    const float mean_dot = coat_div_rn(row_sum(partial, a.lanes, warp_sums[i % 2]), static_cast<float>(a.cols));
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      if (count == 0) continue;
      float dy[kChunk], weight[kChunk], xhat[kChunk], dx[kChunk];
      io.unpack(current.dy[k], dy);
      weight_of(col, count, weight);
      xhat_of(current, k, xhat);
      float4& low = partials_at(k, 0);
      float4& high = partials_at(k, 1);
      float sums[kChunk] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        dx[e] = coat_rmsnorm_dx(dy[e] * weight[e], xhat[e], mean_dot, current.rstd);
        sums[e] = sums[e] + dy[e] * xhat[e];
      }
      low = make_float4(sums[0], sums[1], sums[2], sums[3]);
      high = make_float4(sums[4], sums[5], sums[6], sums[7]);
      if constexpr (kResidual) {
        float residual_chunk[kChunk];
        dx_io.unpack(residual[k], residual_chunk);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dx[e] = coat_rmsnorm_dx_plus_residual(dx[e], a.dy_dtype, residual_chunk[e]);
      }
      dx_io.store(dx_row, col, count, dx);
    }
  }
  if (slice >= a.slices) return;
  float* workspace_row = a.workspace + slice * a.cols;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int col = (lane + k * a.lanes) * kChunk;
    const int count = chunk_count(col, a.cols);
    if (count == 0) continue;
    const float4 low = partials_at(k, 0), high = partials_at(k, 1);
    const float sums[kChunk] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) workspace_row[col + e] = sums[e];
  }
}

// dweight[c] = the slices' partial sums in the documented order: phase p (warp p of the block) adds slices
// p, p + 16, ... in increasing order, 16 loads at a time in flight, then the 16 phases are combined pairwise.
constexpr int kFinishLoads = 16;

__global__ void __launch_bounds__(kWarpSize * COAT_DWEIGHT_PHASES)
    dweight_finish_kernel(const float* workspace, int64_t slices, int cols, float* dweight) {
  __shared__ float phase_sums[COAT_DWEIGHT_PHASES][kWarpSize + 1];
  const int lane = threadIdx.x % kWarpSize, phase = threadIdx.x / kWarpSize;
  const int col = blockIdx.x * kWarpSize + lane;
  float sum = 0.0f;
  if (col < cols) {
    for (int64_t first = phase; first < slices; first += kFinishLoads * COAT_DWEIGHT_PHASES) {
      float terms[kFinishLoads];
#pragma unroll
      for (int j = 0; j < kFinishLoads; ++j) {
        const int64_t slice = first + j * COAT_DWEIGHT_PHASES;
        terms[j] = slice < slices ? workspace[slice * cols + col] : 0.0f;
      }
      // A phase sum starts at +0 and is never -0, so adding the +0 of a slice past the end changes nothing.
#pragma unroll
      for (int j = 0; j < kFinishLoads; ++j) sum = sum + terms[j];
    }
  }
  phase_sums[phase][lane] = sum;
  __syncthreads();
  if (phase != 0 || col >= cols) return;
  float phases[COAT_DWEIGHT_PHASES];
#pragma unroll
  for (int p = 0; p < COAT_DWEIGHT_PHASES; ++p) phases[p] = phase_sums[p][lane];
  dweight[col] = coat_canonical_nan(coat_combine_dweight_phases(phases));
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
template <coat_saved_format kFormat>
struct GateFactorsOfElements {
  __device__ __forceinline__ static void chunk(Codes codes, float scale, float silu[kChunk], float dsilu[kChunk]) {
    float gate[kChunk], s[kChunk];
    decode_saved(SavedCodes::e4m3_as<kFormat>(codes), scale, gate);
    sigmoid_chunk(gate, s);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) coat_silu_grad_factors(gate[e], s[e], &silu[e], &dsilu[e]);
  }
};

// The same for FP4 gates saved in groups of G >= 64 columns, which kGroupLanes = G / 8 consecutive lanes of a warp's
// chunk share: a group's gates take only its 16 codes' values, so each lane computes the factors of
// 16 / kGroupLanes of them (code (lane % kGroupLanes) + kGroupLanes * i as entry i) and every element reads its
// code's from the lane holding them, by shuffle: one sigmoid a lane where there were eight. The same arithmetic
// on the same gate values, so the same bits. Every lane of the warp takes part, those past the row too.
template <int kGroupLanes>
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
      const float s = gate >= -80.0f ? sigmoid_near(gate) : coat_sigmoid(gate);
      coat_silu_grad_factors(gate, s, &own_silu[i], &own_dsilu[i]);
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
template <class Io, coat_saved_format kFormat, int kGroupLanes>
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
      in.up[c] = a.up_saved.load_as<kFormat>(row, col, count, Io::kVector);
      in.gate_scale[c] = group < ngroups ? a.gate_scales[row * ngroups + group] : 0.0f;
      in.up_scale[c] = count > 0 ? a.up_scales[row * ngroups + group] : 0.0f;
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
          GateFactorsOfCodes<kGroupLanes>::chunk(current.gate[c].lo, current.gate_scale[c], silu, dsilu);
        if (count == 0) continue;
        if constexpr (kGroupLanes == 0)
          GateFactorsOfElements<kFormat>::chunk(current.gate[c], current.gate_scale[c], silu, dsilu);
        float dy[kChunk], up[kChunk], smooth[kChunk], dgate[kChunk], dup[kChunk];
        io.unpack(current.dy[c], dy);
        decode_saved(SavedCodes::e4m3_as<kFormat>(current.up[c]), current.up_scale[c], up);
        if constexpr (kSmooth) load_chunk(a.smooth_scale, COAT_FLOAT32, col, count, Io::kVector, smooth);
#pragma unroll
        for (int e = 0; e < kChunk; ++e)
          coat_silu_mul_grads_of_factors(dy[e], up[e], kSmooth ? smooth[e] : 1.0f, silu[e], dsilu[e], &dgate[e],
                                         &dup[e]);
        io.store(row_at(a.dgate, io.element_size(), row, a.cols), col, count, dgate);
        io.store(row_at(a.dup, io.element_size(), row, a.cols), col, count, dup);
#pragma unroll
        for (int e = 0; e < kChunk; ++e)
          if (e < count) amax = amax_step(amax_step(amax, dgate[e]), dup[e]);
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

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool valid_saved_format(coat_saved_format format) {
  return format == COAT_SAVED_E4M3 || format == COAT_SAVED_FP4 || format == COAT_SAVED_FP6;
}

// Bytes of a saved row of cols elements.
int64_t saved_row_bytes(int64_t cols, coat_saved_format format) {
  return format == COAT_SAVED_FP4 ? (cols + 1) / 2 : format == COAT_SAVED_FP6 ? coat_fp6_row_bytes(cols) : cols;
}

SavedCodes saved_codes(const uint8_t* data, int64_t cols, coat_saved_format format) {
  return {data, saved_row_bytes(cols, format), format};
}

// Whether saved codes of rows of cols % 8 == 0 elements take SavedCodes' vector loads.
bool vector_aligned(const SavedCodes& codes) {
  return aligned(codes.data, codes.format == COAT_SAVED_FP4 ? 4 : codes.format == COAT_SAVED_FP6 ? 2 : 8);
}

bool rows_aligned16(const void* base, coat_dtype dtype, int64_t row_stride) {
  return aligned(base, 16) && (row_stride * (dtype == COAT_FLOAT32 ? 4 : 2)) % 16 == 0;
}

bool valid_matrix(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && cols <= COAT_NORM_ACT_MAX_COLS && row_stride >= cols &&
         (x != nullptr || rows * cols == 0);
}

// Calls launch(format) with the saved format as a std::integral_constant.
template <class Launch>
auto with_saved_format(coat_saved_format format, Launch&& launch) {
  switch (format) {
    case COAT_SAVED_FP4: return launch(std::integral_constant<coat_saved_format, COAT_SAVED_FP4>{});
    case COAT_SAVED_FP6: return launch(std::integral_constant<coat_saved_format, COAT_SAVED_FP6>{});
    default: return launch(std::integral_constant<coat_saved_format, COAT_SAVED_E4M3>{});
  }
}

// Calls launch(vector, format), std::bool_constant and std::integral_constant: the SavedRows of the requantize
// ops, which read saved inputs only (no Io).
template <class Launch>
coat_status with_saved_rows(bool vector, coat_saved_format format, Launch&& launch) {
  return with_saved_format(format, [&](auto saved) {
    return vector ? launch(std::true_type{}, saved) : launch(std::false_type{}, saved);
  });
}

// Calls launch(io) with VectorIo<dtype> when `vector`, else with ElementIo.
template <class Launch>
void with_io(coat_dtype dtype, bool vector, Launch&& launch) {
  if (!vector) launch(ElementIo{dtype});
  else if (dtype == COAT_FLOAT32) launch(VectorIo<COAT_FLOAT32>{dtype});
  else if (dtype == COAT_BFLOAT16) launch(VectorIo<COAT_BFLOAT16>{dtype});
  else launch(VectorIo<COAT_FLOAT16>{dtype});
}

// Lets kKernel launch with dynamic_bytes of dynamic shared memory: past the 48 KB a block gets by default, which
// its static shared memory counts against, a launch needs the kernel's opt-in. False if a query fails.
template <auto kKernel>
bool allow_dynamic_shared(size_t dynamic_bytes) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kKernel) != cudaSuccess) return false;
  if (attributes.sharedSizeBytes + dynamic_bytes <= 48 * 1024) return true;
  return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(dynamic_bytes)) == cudaSuccess;
}

// Blocks of kKernel, with shared_bytes of dynamic shared memory, resident at once on the current device (SMs x
// blocks per SM; host queries only, no synchronisation; cached per device for the last shared size asked), or 0
// if the queries fail. The persistent kernels launch no more than this.
template <auto kKernel>
int64_t resident_blocks(int threads, size_t shared_bytes) {
  constexpr int kMaxDevices = 64;
  struct Entry {
    size_t shared_bytes;
    int blocks;
  };
  static Entry cached[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return 0;
  if (device < kMaxDevices && cached[device].blocks > 0 && cached[device].shared_bytes == shared_bytes)
    return cached[device].blocks;
  if (!allow_dynamic_shared<kKernel>(shared_bytes)) return 0;
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, shared_bytes) != cudaSuccess)
    return 0;
  const int blocks = sms * (per_sm > 0 ? per_sm : 1);
  if (device < kMaxDevices) cached[device] = {shared_bytes, blocks};
  return blocks;
}

// Blocks per column of work (segment or tile column) for a persistent grid of at most `resident` blocks
// over `columns` columns of `row_items` items each: at least 1, at most row_items.
int64_t strands_for(int64_t resident, int64_t columns, int64_t row_items) {
  int64_t strands = resident / columns;
  if (strands > row_items) strands = row_items;
  return strands < 1 ? 1 : strands;
}

// The second pass (at least one block, which writes a derived y_scale even for an empty tensor).
template <class Op>
coat_status launch_apply_quantize(const Op& op, int64_t rows, int cols, OutputScale y_scale, coat_fp8_format format,
                                  uint8_t* y, uint8_t* y_t, cudaStream_t stream) {
  const int64_t resident = resident_blocks<apply_quantize_kernel<Op>>(kTileThreads, 0);
  if (resident <= 0) return COAT_ERROR_CUDA;
  const int64_t col_tiles = cols > 0 ? coat_ceil_div(cols, kTileCols) : 1;
  const int64_t strands = strands_for(resident, col_tiles, coat_ceil_div(rows, kTileRows));
  const unsigned blocks = static_cast<unsigned>(col_tiles * strands);
  apply_quantize_kernel<Op><<<blocks, kTileThreads, 0, stream>>>(op, rows, cols, static_cast<int>(col_tiles), strands,
                                                                  y_scale, format, y, y_t);
  return launch_status();
}

template <int kMaxThreads, class Io, coat_saved_format kFormat>
coat_status launch_rmsnorm_stats(RmsnormStatsArgs args, cudaStream_t stream) {
  constexpr auto kKernel = rmsnorm_stats_kernel<kMaxThreads, Io, kFormat>;
  const size_t shared_bytes = WeightPlanes::bytes(args.cols);
  const int64_t resident = resident_blocks<kKernel>(kMaxThreads, shared_bytes);
  if (resident <= 0) return COAT_ERROR_CUDA;
  args.row_groups = coat_ceil_div(args.rows, kMaxThreads / args.lanes);
  const unsigned blocks = static_cast<unsigned>(args.row_groups < resident ? args.row_groups : resident);
  kKernel<<<blocks, kMaxThreads, shared_bytes, stream>>>(args);
  return launch_status();
}

template <int kMaxThreads, class Io, class ResidualIo>
coat_status launch_rmsnorm_backward(const RmsnormBackwardArgs& args, cudaStream_t stream) {
  const size_t shared_bytes = backward_shared_bytes<kMaxThreads>(args.cols);
  if (!allow_dynamic_shared<rmsnorm_backward_kernel<kMaxThreads, Io, ResidualIo>>(shared_bytes))
    return COAT_ERROR_CUDA;
  const unsigned blocks = static_cast<unsigned>(coat_ceil_div(args.slices, kMaxThreads / args.lanes));
  rmsnorm_backward_kernel<kMaxThreads, Io, ResidualIo><<<blocks, kMaxThreads, shared_bytes, stream>>>(args);
  return launch_status();
}

// launch_rmsnorm_backward with the block size for the row's L lanes.
template <class Io, class ResidualIo>
coat_status launch_rmsnorm_backward(const RmsnormBackwardArgs& args, cudaStream_t stream) {
  if (args.lanes <= kRowBlockThreads) return launch_rmsnorm_backward<kRowBlockThreads, Io, ResidualIo>(args, stream);
  if (args.lanes == 512) return launch_rmsnorm_backward<512, Io, ResidualIo>(args, stream);
  return launch_rmsnorm_backward<1024, Io, ResidualIo>(args, stream);
}

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

template <auto kKernel>
coat_status launch_silu_mul_backward(SiluMulBackwardArgs args, cudaStream_t stream) {
  unsigned blocks = 0;
  if (!silu_mul_grid<kKernel>(args.rows, args.cols, &args.segments, &args.strands, &blocks)) return COAT_ERROR_CUDA;
  kKernel<<<blocks, kElementwiseThreads, 0, stream>>>(args);
  return launch_status();
}

}  // namespace

extern "C" {

coat_status coat_rmsnorm_quantize_cuda(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const void* weight, coat_dtype weight_dtype, float eps,
                                       int64_t save_group_size, coat_saved_format save_format,
                                       coat_fp8_format y_format, uint8_t* y, float* y_scale, uint8_t* y_t,
                                       uint8_t* x_saved, float* x_saved_scales, float* rstd, float* y_amax,
                                       coat_cuda_stream stream) {
  if (!valid_matrix(x, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      !coat_is_valid_group_size(save_group_size) || y_scale == nullptr || y_amax == nullptr ||
      !valid_saved_format(save_format))
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(y_amax, 0, sizeof(float), cuda_stream) != cudaSuccess) return COAT_ERROR_CUDA;
  RmsnormStatsArgs args;
  args.x = x;
  args.x_dtype = x_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.weight = weight;
  args.weight_dtype = weight_dtype;
  args.eps = eps;
  args.group_shift = coat::device::ceil_log2(save_group_size);
  args.lanes = static_cast<int>(coat_rmsnorm_lanes(cols));
  args.row_groups = 0;
  args.saved_row_bytes = static_cast<int>(saved_row_bytes(cols, save_format));
  args.x_saved = x_saved;
  args.x_saved_scales = x_saved_scales;
  args.rstd = rstd;
  args.y_amax = y_amax;
  const bool vector = cols % kChunk == 0 && rows_aligned16(x, x_dtype, row_stride) && aligned(weight, 16);
  coat_status status = COAT_SUCCESS;
  with_io(x_dtype, vector, [&](auto io) {
    using Io = decltype(io);
    if (rows > 0) {
      status = with_saved_format(save_format, [&](auto format) {
        constexpr coat_saved_format kFormat = decltype(format)::value;
        if (args.lanes <= kRowBlockThreads)
          return launch_rmsnorm_stats<kRowBlockThreads, Io, kFormat>(args, cuda_stream);
        if (args.lanes == 512) return launch_rmsnorm_stats<512, Io, kFormat>(args, cuda_stream);
        return launch_rmsnorm_stats<1024, Io, kFormat>(args, cuda_stream);
      });
    }
    if (status != COAT_SUCCESS) return;
    const RmsnormApply<HighPrecisionRows<Io>> op{{io, x, row_stride}, rstd, weight, weight_dtype};
    status = launch_apply_quantize(op, rows, args.cols, OutputScale::from_amax(y_amax, y_scale), y_format, y, y_t,
                                   cuda_stream);
  });
  return status;
}

coat_status coat_rmsnorm_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const uint8_t* x_saved, const float* x_saved_scales,
                                       int64_t save_group_size, coat_saved_format saved_format, const float* rstd,
                                       const void* weight, coat_dtype weight_dtype, const void* residual,
                                       coat_dtype residual_dtype, void* dx, float* dweight, float* workspace,
                                       coat_cuda_stream stream) {
  if (!valid_matrix(dy, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      dweight == nullptr || !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      (rows > 0 && (x_saved == nullptr || x_saved_scales == nullptr || rstd == nullptr || dx == nullptr ||
                    workspace == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  RmsnormBackwardArgs args;
  args.dy = dy;
  args.dy_dtype = dy_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.x_saved = saved_codes(x_saved, cols, saved_format);
  args.x_saved_scales = x_saved_scales;
  args.group_shift = coat::device::ceil_log2(save_group_size);
  args.rstd = rstd;
  args.weight = weight;
  args.weight_dtype = weight_dtype;
  args.lanes = static_cast<int>(coat_rmsnorm_lanes(cols));
  args.rows_per_slice = coat_rmsnorm_backward_rows_per_slice(rows, cols);
  args.slices = rows > 0 ? coat_ceil_div(rows, args.rows_per_slice) : 0;
  args.residual = residual;
  args.dx_dtype = residual != nullptr ? residual_dtype : dy_dtype;
  args.dx = dx;
  args.workspace = workspace;
  if (rows > 0) {
    // dx and the residual are contiguous (16-byte aligned rows when cols % 8 == 0); codes move a chunk at a time.
    // A residual takes the 16-byte path in dy's dtype or in fp32 (an fp32 residual stream); other dtype pairs,
    // which no layer makes, go element by element.
    const bool vector_residual = residual == nullptr || (aligned(residual, 16) && (residual_dtype == dy_dtype ||
                                                                                   residual_dtype == COAT_FLOAT32));
    const bool vector = cols % kChunk == 0 && rows_aligned16(dy, dy_dtype, row_stride) && aligned(weight, 16) &&
                        aligned(dx, 16) && vector_aligned(args.x_saved) && vector_residual;
    coat_status status = COAT_SUCCESS;
    with_io(dy_dtype, vector, [&](auto io) {
      using Io = decltype(io);
      if (residual == nullptr) {
        status = launch_rmsnorm_backward<Io, void>(args, cuda_stream);
      } else if constexpr (Io::kVector) {
        if (residual_dtype == dy_dtype) status = launch_rmsnorm_backward<Io, Io>(args, cuda_stream);
        else status = launch_rmsnorm_backward<Io, VectorIo<COAT_FLOAT32>>(args, cuda_stream);
      } else {
        status = launch_rmsnorm_backward<Io, ElementIo>(args, cuda_stream);
      }
    });
    if (status != COAT_SUCCESS) return status;
  }
  const unsigned finish_blocks = static_cast<unsigned>(coat_ceil_div(cols, kWarpSize));
  dweight_finish_kernel<<<finish_blocks, kWarpSize * COAT_DWEIGHT_PHASES, 0, cuda_stream>>>(workspace, args.slices,
                                                                                            args.cols, dweight);
  return launch_status();
}

coat_status coat_silu_mul_quantize_cuda(const void* gate, const void* up, coat_dtype dtype, int64_t rows,
                                        int64_t cols, int64_t gate_row_stride, int64_t up_row_stride,
                                        const float* smooth_scale, int64_t save_group_size,
                                        coat_saved_format save_format, coat_fp8_format y_format, uint8_t* y,
                                        float* y_scale, uint8_t* y_t, uint8_t* gate_saved, float* gate_scales,
                                        uint8_t* up_saved, float* up_scales, float* y_amax, coat_cuda_stream stream) {
  if (!valid_matrix(gate, rows, cols, gate_row_stride) || !valid_matrix(up, rows, cols, up_row_stride) ||
      !coat_is_valid_group_size(save_group_size) || y_scale == nullptr || y_amax == nullptr ||
      !valid_saved_format(save_format))
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
  const bool vector = cols % kChunk == 0 && rows_aligned16(gate, dtype, gate_row_stride) &&
                      rows_aligned16(up, dtype, up_row_stride) &&
                      (smooth_scale == nullptr || aligned(smooth_scale, 16)) && aligned(gate_saved, 8) &&
                      aligned(up_saved, 8);
  coat_status status = COAT_SUCCESS;
  with_io(dtype, vector, [&](auto io) {
    using Io = decltype(io);
    if (rows > 0 && cols > 0) {
      status = with_saved_format(save_format, [&](auto format) {
        constexpr auto kKernel = silu_mul_stats_kernel<Io, decltype(format)::value>;
        unsigned blocks = 0;
        if (!silu_mul_grid<kKernel>(rows, args.cols, &args.segments, &args.strands, &blocks)) return COAT_ERROR_CUDA;
        kKernel<<<blocks, kElementwiseThreads, 0, cuda_stream>>>(args);
        return COAT_SUCCESS;
      });
      if (status != COAT_SUCCESS) return;
    }
    const SiluMulApply<HighPrecisionRows<Io>> op{{io, gate, gate_row_stride}, {io, up, up_row_stride}, smooth_scale};
    status = launch_apply_quantize(op, rows, args.cols, OutputScale::from_amax(y_amax, y_scale), y_format, y, y_t,
                                   cuda_stream);
  });
  return status;
}

coat_status coat_rmsnorm_requantize_cuda(const uint8_t* x_saved, const float* x_saved_scales, int64_t save_group_size,
                                         coat_saved_format saved_format, const float* rstd, int64_t rows,
                                         int64_t cols, const void* weight, coat_dtype weight_dtype,
                                         const float* y_scale, coat_fp8_format y_format, uint8_t* y_t,
                                         coat_cuda_stream stream) {
  if (rows < 0 || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr || y_scale == nullptr ||
      !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      (rows > 0 && (x_saved == nullptr || x_saved_scales == nullptr || rstd == nullptr || y_t == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0) return COAT_SUCCESS;
  const int group_shift = coat::device::ceil_log2(save_group_size);
  const int ngroups = static_cast<int>(coat_ceil_div(cols, save_group_size));
  const SavedCodes codes = saved_codes(x_saved, cols, saved_format);
  const bool vector = cols % kChunk == 0 && vector_aligned(codes) && aligned(weight, 16);
  return with_saved_rows(vector, codes.format, [&](auto vector_codes, auto format) {
    using Saved = SavedRows<decltype(vector_codes)::value, decltype(format)::value>;
    const RmsnormApply<Saved> op{Saved{codes, x_saved_scales, ngroups, group_shift}, rstd, weight, weight_dtype};
    return launch_apply_quantize(op, rows, static_cast<int>(cols), OutputScale::of(y_scale), y_format, nullptr, y_t,
                                 reinterpret_cast<cudaStream_t>(stream));
  });
}

coat_status coat_silu_mul_requantize_cuda(const uint8_t* gate_saved, const float* gate_scales,
                                          const uint8_t* up_saved, const float* up_scales, int64_t save_group_size,
                                          coat_saved_format saved_format, int64_t rows, int64_t cols,
                                          const float* smooth_scale, const float* y_scale, coat_fp8_format y_format,
                                          uint8_t* y_t, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || cols > COAT_NORM_ACT_MAX_COLS || y_scale == nullptr ||
      !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      (rows * cols > 0 && (gate_saved == nullptr || gate_scales == nullptr || up_saved == nullptr ||
                           up_scales == nullptr || y_t == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows * cols == 0) return COAT_SUCCESS;
  const int group_shift = coat::device::ceil_log2(save_group_size);
  const int ngroups = static_cast<int>(coat_ceil_div(cols, save_group_size));
  const SavedCodes gate_codes = saved_codes(gate_saved, cols, saved_format);
  const SavedCodes up_codes = saved_codes(up_saved, cols, saved_format);
  const bool vector = cols % kChunk == 0 && vector_aligned(gate_codes) && vector_aligned(up_codes) &&
                      (smooth_scale == nullptr || aligned(smooth_scale, 16));
  return with_saved_rows(vector, gate_codes.format, [&](auto vector_codes, auto format) {
    using Saved = SavedRows<decltype(vector_codes)::value, decltype(format)::value>;
    const Saved gate{gate_codes, gate_scales, ngroups, group_shift};
    const Saved up{up_codes, up_scales, ngroups, group_shift};
    const SiluMulApply<Saved> op{gate, up, smooth_scale};
    return launch_apply_quantize(op, rows, static_cast<int>(cols), OutputScale::of(y_scale), y_format, nullptr, y_t,
                                 reinterpret_cast<cudaStream_t>(stream));
  });
}

coat_status coat_silu_mul_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                        int64_t row_stride, const uint8_t* gate_saved, const float* gate_scales,
                                        const uint8_t* up_saved, const float* up_scales,
                                        const float* smooth_scale, int64_t save_group_size,
                                        coat_saved_format saved_format, void* dgate, void* dup, float* d_amax,
                                        coat_cuda_stream stream) {
  if (!valid_matrix(dy, rows, cols, row_stride) || !coat_is_valid_group_size(save_group_size) ||
      !valid_saved_format(saved_format) ||
      (rows * cols > 0 && (gate_saved == nullptr || gate_scales == nullptr || up_saved == nullptr ||
                           up_scales == nullptr || dgate == nullptr || dup == nullptr)))
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
  const bool vector = cols % kChunk == 0 && rows_aligned16(dy, dy_dtype, row_stride) &&
                      (smooth_scale == nullptr || aligned(smooth_scale, 16)) && aligned(dgate, 16) &&
                      aligned(dup, 16) && vector_aligned(args.gate_saved) && vector_aligned(args.up_saved);
  coat_status status = COAT_SUCCESS;
  with_io(dy_dtype, vector, [&](auto io) {
    with_saved_format(saved_format, [&](auto format) {
      using Io = decltype(io);
      constexpr coat_saved_format kFormat = decltype(format)::value;
      const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
      if constexpr (kFormat == COAT_SAVED_FP4) {
        if (save_group_size == 128) {
          status = launch_silu_mul_backward<silu_mul_backward_kernel<Io, kFormat, 16>>(args, cuda_stream);
          return;
        }
        if (save_group_size == 64) {
          status = launch_silu_mul_backward<silu_mul_backward_kernel<Io, kFormat, 8>>(args, cuda_stream);
          return;
        }
      }
      status = launch_silu_mul_backward<silu_mul_backward_kernel<Io, kFormat, 0>>(args, cuda_stream);
    });
  });
  return status;
}

}  // extern "C"
