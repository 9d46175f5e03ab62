/*
 * Element-level steps shared by the C and CUDA quantizers, so both compute the same values by
 * construction. Internal: not part of the C API.
 */
#ifndef COAT_DETAIL_QUANTIZE_MATH_H
#define COAT_DETAIL_QUANTIZE_MATH_H

#include <math.h>

#include "coat/fp4.h"
#include "coat/fp6.h"
#include "coat/fp8.h"
#include "coat/quantize.h"

/* Load element i of a high-precision array as fp32 (exact). */
COAT_INLINE float coat_load_f32(const void* data, coat_dtype dtype, int64_t i) {
  switch (dtype) {
    case COAT_BFLOAT16: return coat_bf16_to_f32(((const uint16_t*)data)[i]);
    case COAT_FLOAT16: return coat_f16_to_f32(((const uint16_t*)data)[i]);
    default: return ((const float*)data)[i];
  }
}

/** Stores v as element i of `out` in `dtype`; NaN is stored canonically (0x7FC00000, 0x7FC0, 0x7E00). */
COAT_INLINE void coat_store_as(void* out, coat_dtype dtype, int64_t i, float v) {
  switch (dtype) {
    case COAT_BFLOAT16: ((uint16_t*)out)[i] = coat_f32_to_bf16(v); break;
    case COAT_FLOAT16: ((uint16_t*)out)[i] = coat_f32_to_f16(v); break;
    default: ((float*)out)[i] = coat_canonical_nan(v); break;
  }
}

/* v rounded to `dtype` and read back: what coat_store_as then coat_load_f32 give (NaN canonical). Rounding to
 * nearest is monotonic and symmetric, so the largest |v| of a set, rounded, is the largest rounded |v|. */
COAT_INLINE float coat_round_as(coat_dtype dtype, float v) {
  switch (dtype) {
    case COAT_BFLOAT16: return coat_bf16_to_f32(coat_f32_to_bf16(v));
    case COAT_FLOAT16: return coat_f16_to_f32(coat_f32_to_f16(v));
    default: return coat_canonical_nan(v);
  }
}

/* max(a, |x|) with NaN x ignored. Not fmaxf: glibc's returns NaN for a signalling NaN operand. */
COAT_INLINE float coat_amax_step(float a, float x) {
  const float magnitude = fabsf(x);
  return magnitude > a ? magnitude : a;
}

/* scale = max(amax / FP8_MAX, 2^-126): the value quantization divides by and dequantization multiplies by. */
COAT_INLINE float coat_scale_from_amax(float amax, coat_fp8_format format) {
  return fmaxf(amax / coat_fp8_max(format), COAT_MIN_SCALE);
}

/* Scales from which coat_divide_by_scale's CUDA fast path gives every FP8 code right (see there). */
#define COAT_MIN_FAST_DIVISION_SCALE 0x1p-80f

/* x / scale rounded to nearest even, given reciprocal = 1 / scale (rounded to nearest, once per group).
 * C divides. CUDA runs the fast path of its own IEEE division without the slow-path check and branch:
 * q = RN(x * reciprocal) corrected once with the residual x - q * scale (one FMA), which is the correctly
 * rounded quotient whenever the residual is exact (Markstein), i.e. for |x| >= 2^-103. Smaller x are
 * quotients below 2^-20, which encode to FP8 zero however they round, as long as scale >= 2^-80; smaller
 * scales (groups whose amax is below about 2^-71) divide. Where x or scale is not finite the residual is
 * NaN and the product is what the division gives (+-Inf, +-0, or NaN). */
COAT_INLINE float coat_divide_by_scale(float x, float scale, float reciprocal) {
#ifdef __CUDA_ARCH__
  if (scale < COAT_MIN_FAST_DIVISION_SCALE) return __fdiv_rn(x, scale);
  const float q = __fmul_rn(x, reciprocal);
  const float corrected = __fmaf_rn(__fmaf_rn(-q, scale, x), reciprocal, q);
  return isfinite(corrected) ? corrected : q;
#else
  (void)reciprocal;
  return x / scale;
#endif
}

/* The code of x / scale. The sign of a NaN quotient (NaN / s, Inf / Inf) is platform-defined (x86 makes
 * Inf / Inf negative, CUDA makes every NaN positive), so it is taken from x: CPU and CUDA then agree on the
 * code's sign bit. For every other quotient the sign is already x's, the scale being positive. */
COAT_INLINE uint8_t coat_quantize_scaled(float x, float scale, float reciprocal, coat_fp8_format format) {
  return coat_f32_to_fp8(copysignf(coat_divide_by_scale(x, scale, reciprocal), x), format);
}

COAT_INLINE uint8_t coat_quantize_value(float x, float scale, coat_fp8_format format) {
  return coat_quantize_scaled(x, scale, 1.0f / scale, format);
}

/* decode(q) * scale; a NaN result (a NaN code, or 0 * Inf) is the canonical NaN. */
COAT_INLINE float coat_dequantize_value(float decoded, float scale) {
  return coat_canonical_nan(decoded * scale);
}

/* Block scaling of FP4 (E2M1) and FP6 (E2M3), quantize.h: the two formats differ in their mantissa bits M only
 * (coat/minifloat.h). A block's amax is taken on the bits of |x|: as unsigned integers they order like the
 * magnitudes, with every NaN above Inf, so the max of the bits is the amax of a block without NaN and a NaN
 * otherwise, in any order of reduction. */
COAT_INLINE uint32_t coat_magnitude_bits(float x) { return coat_f32_to_bits(x) & 0x7FFFFFFFu; }

COAT_INLINE uint32_t coat_max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* The largest magnitude of E2M<M>: 6 for FP4, 7.5 for FP6. */
COAT_INLINE float coat_e2m_max(uint32_t mantissa_bits) { return mantissa_bits == 1u ? COAT_E2M1_MAX : COAT_E2M3_MAX; }

/* The block scale from the max of coat_magnitude_bits: the canonical NaN for a block holding a NaN, else
 * max(amax / coat_e2m_max, 2^-126), Inf for an Inf. */
COAT_INLINE float coat_e2m_scale_from_amax_bits(uint32_t amax_bits, uint32_t mantissa_bits) {
  if (amax_bits > 0x7F800000u) return coat_f32_from_bits(0x7FC00000u);
  const float scale = coat_f32_from_bits(amax_bits) / coat_e2m_max(mantissa_bits);
  return scale < COAT_MIN_SCALE ? COAT_MIN_SCALE : scale;
}

/* The E2M<M> code of x * reciprocal, reciprocal = 1 / scale rounded to nearest (once per block): x's sign bit (bit
 * M + 2) and the code of the exact product |x| * reciprocal (two 24-bit significands, exact in double), rounded to
 * nearest even on the format's grid. The grid's step is 2^-M below 2, 2^(1-M) in [2, 4) and 2^(2-M) from 4 on, so
 * the code is the least of rint(p 2^M), rint(p 2^(M-1)) + 2^M and rint(p 2^(M-2)) + 2^(M+1) (each term is the code
 * where its step is the grid's, an even integer an even code, and the other two are never below it there),
 * saturating at the largest code from p = 8 on. A NaN product (a NaN x or scale; Inf x * 0, the reciprocal of an
 * Inf scale) encodes to 0. A product rather than the rounded quotient x / scale: one rounding instead of two, and
 * the GPU's encoder is then three FMAs a value (csrc/cuda/e2m_chunk.cuh). */
COAT_INLINE uint8_t coat_quantize_e2m_scaled(float x, float reciprocal, uint32_t mantissa_bits) {
  const double product = (double)fabsf(x) * (double)reciprocal;
  const uint32_t sign = (coat_f32_to_bits(x) >> 31) << (mantissa_bits + 2u);
  if (product != product) return (uint8_t)sign;
  const double p = product < 8.0 ? product : 8.0;
  const double step = (double)(1u << mantissa_bits);
  const double fine = rint(p * step), unit = rint(p * (step / 2.0)) + step, coarse = rint(p * (step / 4.0)) + 2.0 * step;
  const double least = fine < unit ? (fine < coarse ? fine : coarse) : (unit < coarse ? unit : coarse);
  const uint32_t largest = (4u << mantissa_bits) - 1u;
  const uint32_t code = (uint32_t)least;
  return (uint8_t)(sign | (code < largest ? code : largest));
}

COAT_INLINE int coat_is_valid_group_size(int64_t group_size) {
  return group_size == 16 || group_size == 32 || group_size == 64 || group_size == 128;
}

COAT_INLINE int64_t coat_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#endif /* COAT_DETAIL_QUANTIZE_MATH_H */
