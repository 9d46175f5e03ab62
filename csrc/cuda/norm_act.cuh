// Shared by the CUDA implementation of coat/norm_act.h, rmsnorm.cu (RMSNorm) and silu_mul.cu (SiLU*mul): the chunks,
// the I/O of high-precision rows and of saved codes, the saving of an input for backward, and the second pass of
// both forward ops and of the requantize ops (apply_quantize_kernel), with the host's launch helpers. Element math
// and reduction orders come from coat/detail/norm_act_math.h, so every output equals the C core's
// (csrc/cpu/norm_act.c) bit for bit.
//
// Work is cut into chunks of 8 consecutive elements of a row (one 16-byte access of bf16/fp16, two of fp32).
// Every kernel is instantiated for an Io, the way it reads and writes the high-precision tensors:
// VectorIo<dtype> (16-byte accesses; cols % 8 == 0 and 16-byte aligned rows) or ElementIo (any dtype,
// element by element: odd widths, misaligned views), which changes the speed but not a single result bit.
//
// Kernel:
//   apply_quantize_kernel    persistent over 64 x 64 tiles, the next tile in flight: recomputes y from the
//                            inputs, writes it in FP8 and, through a shared-memory tile, its transpose; the
//                            requantize ops run it on the saved inputs (E4M3, FP4 or FP6, an instantiation each)
//                            with the forward's scale, y_t only
// The kernels that read saved inputs take them in any saved format (SavedCodes): FP4 and FP6 codes are loaded
// packed and expanded to their E4M3 codes where they are decoded, so that the next row or tile stays in flight.
//
// Fast paths. The arithmetic that used to dominate (IEEE divisions, coat's exp with its range checks, FP8,
// bf16 and fp16 conversions with their special cases) runs in forms that give the same bits on the values
// that occur in training, behind one test per chunk that sends every other chunk (NaN, Inf, scales below
// 2^-80, gates below -80) through the plain formulas: see fp8_chunk.cuh (scale_from_amax, quotient,
// reciprocal_of_normal, encode_chunk), e2m_chunk.cuh (encode_e2m_chunk), decode_e4m3 and the Io stores here, and
// silu_mul.cu's sigmoid_near and SiluOfGates (a table of silu for bf16 gates).
// tools/cuda_emulation runs these kernels on the CPU against the C core.
//
// Everything here is in an anonymous namespace, as it was in one file: each .cu that includes it has its own
// copy (its own instantiations of the kernel templates), and nothing of it is visible outside that file.
#pragma once

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
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWarpSize = 32;
// The second pass: 64 x 64 tiles, each thread two chunks of one chunk column, 32 rows apart.
constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kTileThreads = 256;
constexpr int kTileChunksPerRow = kTileCols / kChunk;
constexpr int kTileRowsApart = kTileThreads / kTileChunksPerRow;

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
// Reductions

__device__ __forceinline__ float warp_max(float v) { return group_amax_reduce(v, kWarpSize); }

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
// Second pass of both forward ops, and the requantize ops: y computed from the inputs and quantized with the
// per-tensor scale

// Where an apply op reads one of its inputs: rows of the high-precision tensor (the forward ops) or the FP8
// copy the forward saved (the requantize ops). load() fetches a chunk (count 0: zeros, no access), values()
// turns it into fp32 (silu_mul.cu's SourceGates says how silu is taken of gates read this way).
template <class Io>
struct HighPrecisionRows {
  static constexpr bool kVector = Io::kVector;
  using Chunk = typename Io::Raw;
  Io io;
  const void* data;
  int64_t row_stride;

  __device__ __forceinline__ Chunk load(int64_t row, int col, int count) const {
    return io.load(row_at(data, io.element_size(), row, row_stride), col, count);
  }
  __device__ __forceinline__ void values(const Chunk& chunk, float v[kChunk]) const { io.unpack(chunk, v); }
};

// A saved input: codes of rows x cols in kFormat, and one scale per 1 x 2^group_shift group.
// kVectorCodes: cols % 8 == 0 and codes aligned for SavedCodes' vector loads.
template <bool kVectorCodes, coat_saved_format kFormat>
struct SavedRows {
  static constexpr bool kVector = kVectorCodes;
  struct Chunk {
    Codes codes;
    float scale;
  };
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
};

// An op of the second pass loads a chunk's Inputs (prefetched a tile ahead), the per-column data of its
// chunk column once (Column), and computes y from them and a Table in shared memory that it fills once per
// block (empty but for SiLU*mul of bf16 rows and of saved gates). kVector: y's codes and the per-column data
// move 8 and 16 bytes at a time. The ops are rmsnorm.cu's RmsnormApply and silu_mul.cu's SiluMulApply; Op::Rows is
// the Source they read.

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

}  // namespace
