// Device-side FP4 (E2M1) block quantization of chunks of 8 values, shared by quantize_fp4_kernel (quantize.cu) and
// the fused RMSNorm / SiLU*mul kernels that save their inputs in FP4 (norm_act.cu).
//
// coat_quantize_fp4_scaled (coat/detail/quantize_math.h) compiled as written costs about 25 instructions per
// element on sm_90: a per-element branch around the division's slow path, the clamp and NaN tests of the general
// E2M1 encoder, and constants rematerialized per element. In a block-scaled quantizer the quotients |x| / scale
// lie in [0, 6] (scale = amax / 6), so the forms below encode them without those tests, behind one test per chunk
// that sends every other chunk (a NaN or Inf value, an Inf or NaN scale, a scale below 2^-80, a quotient from 7
// on) through coat_quantize_fp4_scaled itself. tools/cuda_emulation checks each against the C core.
#pragma once

#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/fp4.h"
#include "fp8_chunk.cuh"

namespace coat {
namespace device {

/** Values a chunk holds; their 8 codes fill one 4-byte word, element e in nibble e. */
constexpr int kFp4CodeChunk = 8;

/** coat_fp4_scale_from_amax_bits: max(amax / 6, 2^-126), the canonical NaN for a NaN amax, by the Markstein form
 *  of scale_from_amax (equal on every amax bit pattern; tools/cuda_emulation checks them all). */
__device__ __forceinline__ float fp4_scale_from_amax_bits(uint32_t amax_bits) {
  if (amax_bits > 0x7F800000u) return __uint_as_float(0x7FC00000u);
  return scale_by_inverse(__uint_as_float(amax_bits), COAT_E2M1_MAX, 1.0f / COAT_E2M1_MAX);
}

/** coat_e2m1_magnitude_code of a quotient q in [0, 7), plus 2^23, as a float: min(rint(2 q), rint(q) + 2,
 *  rint(q / 2) + 4), rint rounding to nearest even. Each term is the code where the grid's step is 0.5 (q < 2),
 *  1 ([2, 4)) or 2 ([4, 7)), an even integer being an even code, and the other two terms are never below it there.
 *  Each term is one FMA or add into 2^23 (+ 2, + 4), which rounds to an integer; the terms are positive, so their
 *  minimum is that of their bit patterns. Floating-point work, where the integer form kept the ALU pipe busy. */
constexpr uint32_t kE2m1CodeBias = 0x4B000000u;  // the bits of 2^23
__device__ __forceinline__ uint32_t e2m1_magnitude_code_below_7_biased(float q) {
  const uint32_t fine = __float_as_uint(__fmaf_rn(q, 2.0f, 8388608.0f));
  const uint32_t unit = __float_as_uint(__fadd_rn(q, 8388610.0f));
  const uint32_t coarse = __float_as_uint(__fmaf_rn(q, 0.5f, 8388612.0f));
  return min(min(fine, unit), coarse);
}

/** The packed codes of coat_quantize_fp4_scaled(v[e], scale, 1 / scale) for the chunk's 8 values, element e in
 *  nibble e; reciprocal = 1 / scale rounded to nearest (garbage is fine when scale is not finite). A chunk whose
 *  quotients |v| / scale are all below 7 with scale >= 2^-80 takes quotient() and e2m1_magnitude_code_below_7_biased(),
 *  the value's sign bit on top; any other chunk is encoded by coat_quantize_fp4_scaled. */
__device__ __forceinline__ uint32_t encode_fp4_chunk(const float v[kFp4CodeChunk], float scale, float reciprocal) {
  float q[kFp4CodeChunk];
  uint32_t largest = 0;  // the quotients' largest bit pattern: a NaN's (or a -0's) is above 7's
#pragma unroll
  for (int e = 0; e < kFp4CodeChunk; ++e) {
    q[e] = quotient(fabsf(v[e]), scale, reciprocal);
    largest = max(largest, __float_as_uint(q[e]));
  }
  uint32_t word = 0;
  if (scale >= COAT_MIN_FAST_DIVISION_SCALE && largest < 0x40E00000u) {  // 7.0f
#pragma unroll
    for (int e = 0; e < kFp4CodeChunk; ++e)
      word += (e2m1_magnitude_code_below_7_biased(q[e]) + ((__float_as_uint(v[e]) >> 28) & 0x8u)) << (4 * e);
    return word - kE2m1CodeBias * 0x11111111u;  // each nibble's 2^23 bits, shifted out or cancelled mod 2^32
  }
  const float exact_reciprocal = 1.0f / scale;
#pragma unroll
  for (int e = 0; e < kFp4CodeChunk; ++e)
    word |= uint32_t{coat_quantize_fp4_scaled(v[e], scale, exact_reciprocal)} << (4 * e);
  return word;
}

}  // namespace device
}  // namespace coat
