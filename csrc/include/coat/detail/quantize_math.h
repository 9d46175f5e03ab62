/*
 * Element-level steps shared by the C and CUDA quantizers, so both compute the same values by
 * construction. Internal: not part of the C API.
 */
#ifndef COAT_DETAIL_QUANTIZE_MATH_H
#define COAT_DETAIL_QUANTIZE_MATH_H

#include <math.h>

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

/* max(a, |x|) with NaN x ignored. Not fmaxf: glibc's returns NaN for a signalling NaN operand. */
COAT_INLINE float coat_amax_step(float a, float x) {
  const float magnitude = fabsf(x);
  return magnitude > a ? magnitude : a;
}

/* scale = max(amax / FP8_MAX, 2^-126): the value quantization divides by and dequantization multiplies by. */
COAT_INLINE float coat_scale_from_amax(float amax, coat_fp8_format format) {
  return fmaxf(amax / coat_fp8_max(format), COAT_MIN_SCALE);
}

/* The sign of a NaN quotient (NaN / s, Inf / Inf) is platform-defined (x86 makes Inf / Inf negative, CUDA
 * makes every NaN positive), so it is taken from x: CPU and CUDA then agree on the code's sign bit. For
 * every other quotient the sign is already x's, the scale being positive. */
COAT_INLINE uint8_t coat_quantize_value(float x, float scale, coat_fp8_format format) {
  return coat_f32_to_fp8(copysignf(x / scale, x), format);
}

/* decode(q) * scale; a NaN result (a NaN code, or 0 * Inf) is the canonical NaN. */
COAT_INLINE float coat_dequantize_value(float decoded, float scale) {
  return coat_canonical_nan(decoded * scale);
}

COAT_INLINE int coat_is_valid_group_size(int64_t group_size) {
  return group_size == 16 || group_size == 32 || group_size == 64 || group_size == 128;
}

COAT_INLINE int64_t coat_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#endif /* COAT_DETAIL_QUANTIZE_MATH_H */
