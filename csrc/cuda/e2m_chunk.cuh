// Device-side block quantization of chunks of 8 values to FP4 (E2M1) and FP6 (E2M3), shared by the block
// quantizers (quantize.cu) and the fused RMSNorm / SiLU*mul kernels that save their inputs in either format
// (rmsnorm.cu, silu_mul.cu). The formats are E2M<M> with M = 1 (FP4) or 3 (FP6) mantissa bits (coat/minifloat.h);
// a chunk's codes pack into 4 bytes (FP4) or 6 (FP6), element e at bit e * (M + 3).
//
// coat_quantize_e2m_scaled (coat/detail/quantize_math.h) encodes the exact product |x| * reciprocal in double; the
// forms below do the same in float: each of its three rounded terms is one FMA of |x| and a power-of-two multiple of
// the reciprocal into 2^23, exact where those multiples are (a scale in [2^-124, 2^124]) and the product below the
// fast limit (always so in a block, whose scale is amax / E_MAX). One test of the scale per chunk sends every other
// chunk (a NaN or Inf value, whose block's scale is NaN or Inf; a scale outside that range) through
// coat_quantize_e2m_scaled itself. tools/cuda_emulation checks each against the C core.
#pragma once

#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/fp4.h"
#include "coat/fp6.h"
#include "fp8_chunk.cuh"

namespace coat {
namespace device {

/** Values a chunk holds. */
constexpr int kE2mCodeChunk = 8;

/** FP4 (kMantissaBits 1) and FP6 (3): the largest magnitude, the quotients the fast encoder takes (below
 *  kFastLimit, where the coarse term's code stays within the format), and the bytes of a chunk's packed codes. */
template <int kMantissaBits>
struct E2m;
template <>
struct E2m<1> {
  static constexpr float kMax = COAT_E2M1_MAX;
  static constexpr uint32_t kFastLimitBits = 0x40E00000u;  // 7.0f
  static constexpr int kChunkBytes = 4;
};
template <>
struct E2m<3> {
  static constexpr float kMax = COAT_E2M3_MAX;
  static constexpr uint32_t kFastLimitBits = 0x40F80000u;  // 7.75f
  static constexpr int kChunkBytes = 6;
};

/** coat_e2m_scale_from_amax_bits: max(amax / E_MAX, 2^-126), the canonical NaN for a NaN amax. For E2M1's 6 by the
 *  Markstein form of scale_from_amax, equal to the division on every amax bit pattern; for E2M3's 7.5 that form
 *  misses the correctly rounded quotient on a few hundred in 10^7 (tools/cuda_emulation checks them), so FP6 divides
 *  (IEEE, -prec-div=true; once per block). */
template <int kMantissaBits>
__device__ __forceinline__ float e2m_scale_from_amax_bits(uint32_t amax_bits) {
  if (amax_bits > 0x7F800000u) return __uint_as_float(0x7FC00000u);
  constexpr float kMax = E2m<kMantissaBits>::kMax;
  if constexpr (kMantissaBits == 1) {
    return scale_by_inverse(__uint_as_float(amax_bits), kMax, 1.0f / kMax);
  } else {
    return fmaxf(__fdiv_rn(__uint_as_float(amax_bits), kMax), COAT_MIN_SCALE);
  }
}

/** The magnitude code of coat_quantize_e2m_scaled plus 2^23, as a float's bits, for a product |x| * reciprocal below
 *  kFastLimit, given steps = reciprocal * (2^M, 2^(M-1), 2^(M-2)), each exact: the least of the three terms, each
 *  one FMA into 2^23 (+ 2^M, + 2^(M+1)), which rounds the exact product to an integer; the terms are positive, so
 *  their minimum is that of their bit patterns. Floating-point work, where an integer form kept the ALU pipe busy. */
constexpr uint32_t kE2mCodeBias = 0x4B000000u;  // the bits of 2^23
struct E2mSteps {
  float fine, unit, coarse;
};

template <int kMantissaBits>
__device__ __forceinline__ E2mSteps e2m_steps(float reciprocal) {
  constexpr float kStep = static_cast<float>(1 << kMantissaBits);
  return {reciprocal * kStep, reciprocal * (kStep / 2.0f), reciprocal * (kStep / 4.0f)};
}

template <int kMantissaBits>
__device__ __forceinline__ uint32_t e2m_magnitude_code_biased(float magnitude, E2mSteps steps) {
  constexpr float kStep = static_cast<float>(1 << kMantissaBits);
  const uint32_t fine = __float_as_uint(__fmaf_rn(magnitude, steps.fine, 8388608.0f));
  const uint32_t unit = __float_as_uint(__fmaf_rn(magnitude, steps.unit, 8388608.0f + kStep));
  const uint32_t coarse = __float_as_uint(__fmaf_rn(magnitude, steps.coarse, 8388608.0f + 2.0f * kStep));
  return min(min(fine, unit), coarse);
}

/** 16^e, the weight of nibble e. Read from the constant bank, where ptxas cannot see the value, so that the packing
 *  of FP4 codes is an IMAD (FMA pipe) with a constant operand rather than a LEA (ALU pipe, the FP4 forward's limit). */
static __constant__ uint32_t kNibbleWeights[kE2mCodeChunk] = {1u, 1u << 4, 1u << 8, 1u << 12,
                                                              1u << 16, 1u << 20, 1u << 24, 1u << 28};

/** The sign bits of a chunk's 8 values at bit 4e + 3, FP4's nibbles: prmt gathers byte 3 of each value (the sign
 *  in its bit 7), the even elements' in one word and the odd ones' in another, so that byte j of the two holds the
 *  signs of nibbles 2j (moved to bit 3) and 2j + 1 (in bit 7). 9 instructions for the 8, where a shift and a mask
 *  per value took 16. */
__device__ __forceinline__ uint32_t e2m1_sign_bits(const float v[kE2mCodeChunk]) {
  uint32_t b[kE2mCodeChunk];
#pragma unroll
  for (int e = 0; e < kE2mCodeChunk; ++e) b[e] = __float_as_uint(v[e]);
  // byte 3 of x and of y (selectors 3 and 7) into bytes 0 and 1; then the two low halves side by side
  const uint32_t even = __byte_perm(__byte_perm(b[0], b[2], 0x73u), __byte_perm(b[4], b[6], 0x73u), 0x5410u);
  const uint32_t odd = __byte_perm(__byte_perm(b[1], b[3], 0x73u), __byte_perm(b[5], b[7], 0x73u), 0x5410u);
  return (((even >> 4) & 0x0F0F0F0Fu) | (odd & 0xF0F0F0F0u)) & 0x88888888u;
}

/** A chunk's packed codes: element e at bit e * (M + 3), in `lo` (FP4, and FP6's elements 0..4 and the low two
 *  bits of element 5) and `hi` (FP6's bits 32..47). */
struct PackedCodes {
  uint32_t lo;
  uint32_t hi;
};

/** Scales from which the fast encoder's steps are exact: reciprocal / 2 stays normal, reciprocal * 8 finite. */
constexpr float kE2mFastScaleMin = 0x1p-124f, kE2mFastScaleMax = 0x1p124f;

/** The packed codes of coat_quantize_e2m_scaled(v[e], reciprocal, M) for the chunk's 8 values, where scale is
 *  e2m_scale_from_amax_bits of an amax at least every |v[e]| (the block's, as the block quantizers take it) and
 *  reciprocal = 1 / scale rounded to nearest (garbage is fine when scale is not finite). A scale in the fast range
 *  then means every v[e] is finite and every product |v| * reciprocal at most E_MAX (1 + 2^-22), below the fast
 *  limit: such a chunk takes e2m_magnitude_code_biased(), the signs on top, with one test of the scale; any other
 *  chunk (a NaN or Inf value, hence scale; a scale outside the range) is encoded by coat_quantize_e2m_scaled. */
template <int kMantissaBits>
__device__ __forceinline__ PackedCodes encode_e2m_chunk(const float v[kE2mCodeChunk], float scale, float reciprocal) {
  constexpr int kCodeBits = kMantissaBits + 3;
  uint32_t codes[kE2mCodeChunk];
  if (scale >= kE2mFastScaleMin && scale <= kE2mFastScaleMax) {
    const E2mSteps steps = e2m_steps<kMantissaBits>(reciprocal);
    if constexpr (kMantissaBits == 1) {  // eight nibbles: the biases cancel mod 2^32 in one subtraction
      uint32_t word = 0;
#pragma unroll
      for (int e = 0; e < kE2mCodeChunk; ++e)
        word += e2m_magnitude_code_biased<1>(fabsf(v[e]), steps) * kNibbleWeights[e];
      return {(word - kE2mCodeBias * 0x11111111u) | e2m1_sign_bits(v), 0u};  // the 2^23 bits shifted out or cancelled
    } else {
#pragma unroll
      for (int e = 0; e < kE2mCodeChunk; ++e)
        codes[e] = e2m_magnitude_code_biased<kMantissaBits>(fabsf(v[e]), steps) - kE2mCodeBias +
                   ((__float_as_uint(v[e]) >> (31 - kMantissaBits - 2)) & (1u << (kMantissaBits + 2)));
    }
  } else {
    const float exact_reciprocal = 1.0f / scale;
#pragma unroll
    for (int e = 0; e < kE2mCodeChunk; ++e) codes[e] = coat_quantize_e2m_scaled(v[e], exact_reciprocal, kMantissaBits);
  }
  PackedCodes packed{0u, 0u};
#pragma unroll
  for (int e = 0; e < kE2mCodeChunk; ++e) {
    const int bit = e * kCodeBits;
    if (bit >= 32) {
      packed.hi |= codes[e] << (bit - 32);
    } else {
      packed.lo |= codes[e] << bit;
      if (bit + kCodeBits > 32) packed.hi |= codes[e] >> (32 - bit);  // FP6's element 5 straddles the words
    }
  }
  return packed;
}

/** Code of element e of a chunk's packed codes. */
template <int kMantissaBits>
__device__ __forceinline__ uint32_t e2m_code_at(PackedCodes packed, int e) {
  constexpr int kCodeBits = kMantissaBits + 3;
  const int bit = e * kCodeBits;
  const uint64_t word = (uint64_t{packed.hi} << 32) | packed.lo;
  return static_cast<uint32_t>(word >> bit) & ((1u << kCodeBits) - 1u);
}

/** Stores the first `count` codes' bytes of a chunk at dst (ceil(count (M + 3) / 8) bytes). vector: count == 8
 *  and dst aligned to 4 (FP4) or 2 (FP6) bytes, for one 4-byte store or three 2-byte ones. */
template <int kMantissaBits>
__device__ __forceinline__ void store_e2m_chunk(uint8_t* dst, PackedCodes packed, int count, bool vector) {
  if (vector) {
    if constexpr (kMantissaBits == 1) {
      *reinterpret_cast<uint32_t*>(dst) = packed.lo;
    } else {
      uint16_t* halves = reinterpret_cast<uint16_t*>(dst);
      halves[0] = static_cast<uint16_t>(packed.lo);
      halves[1] = static_cast<uint16_t>(packed.lo >> 16);
      halves[2] = static_cast<uint16_t>(packed.hi);
    }
    return;
  }
  const int bytes = (count * (kMantissaBits + 3) + 7) / 8;
#pragma unroll
  for (int i = 0; i < E2m<kMantissaBits>::kChunkBytes; ++i)
    if (i < bytes) dst[i] = static_cast<uint8_t>((i < 4 ? packed.lo >> (8 * i) : packed.hi >> (8 * (i - 4))) & 0xFFu);
}

/** Loads the packed codes of the chunk's first `count` elements from src; the layout as in store_e2m_chunk. A row's
 *  bits past its last code are 0, so a short chunk reads 0 codes past count. `vector`: count is 0 (zero codes, src not
 *  read: a select rather than a branch, so that a caller's address arithmetic is not repeated under each chunk's
 *  test) or 8, src aligned as in store_e2m_chunk. */
template <int kMantissaBits>
__device__ __forceinline__ PackedCodes load_e2m_chunk(const uint8_t* src, int count, bool vector) {
  if (vector) {
    if constexpr (kMantissaBits == 1) {
      return {count > 0 ? *reinterpret_cast<const uint32_t*>(src) : 0u, 0u};
    } else {
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(src);
      const uint32_t h0 = count > 0 ? halves[0] : 0u, h1 = count > 0 ? halves[1] : 0u, h2 = count > 0 ? halves[2] : 0u;
      return {h0 | h1 << 16, h2};
    }
  }
  const int bytes = (count * (kMantissaBits + 3) + 7) / 8;
  PackedCodes packed{0u, 0u};
#pragma unroll
  for (int i = 0; i < E2m<kMantissaBits>::kChunkBytes; ++i) {
    if (i >= bytes) break;
    if (i < 4) packed.lo |= uint32_t{src[i]} << (8 * i);
    else packed.hi |= uint32_t{src[i]} << (8 * (i - 4));
  }
  return packed;
}

}  // namespace device
}  // namespace coat
