/*
 * FP8 codecs (OCP E4M3 "fn" and E5M2), usable from C99 and CUDA.
 *
 * Encode: round to nearest even; finite values past the format's max saturate to +-max.
 *   E4M3: +-Inf -> +-448 (the format has no infinity), NaN -> S.1111.111.
 *   E5M2: +-Inf -> +-Inf,                               NaN -> S.11111.11.
 *   The sign of zero and of NaN is kept.
 * For every input that is finite and within the format's range this is bit for bit what PyTorch's
 * tensor.to(torch.float8_e4m3fn / torch.float8_e5m2) gives; past the range PyTorch versions differ
 * (rounding to NaN or Inf), and coat saturates.
 * Decode is exact. NaN decodes to a quiet fp32 NaN with the stored sign.
 */
#ifndef COAT_FP8_H
#define COAT_FP8_H

#include "coat/common.h"
#include "coat/float_bits.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#include <cuda_fp8.h>
#define COAT_HARDWARE_FP8_CONVERT 1
#endif

#define COAT_E4M3_MAX 448.0f
#define COAT_E5M2_MAX 57344.0f

COAT_INLINE float coat_fp8_max(coat_fp8_format format) {
  return format == COAT_E4M3 ? COAT_E4M3_MAX : COAT_E5M2_MAX;
}

/* On GPUs with FP8 conversion instructions (sm_89+) the encoders use them and fix up the two cases where
 * the hardware's saturation differs from these rules (NaN sign, E5M2 Inf); elsewhere (the C core,
 * older GPUs) they compute the subnormal and the normal code and select, instead of branching, in an
 * order that lets the special cases (saturation, Inf, NaN) win. The CUDA tests compare the two paths bit
 * for bit. */
COAT_INLINE uint8_t coat_f32_to_e4m3(float f) {
  const uint32_t bits = coat_f32_to_bits(f) & 0x7FFFFFFFu;
  const uint32_t sign = (coat_f32_to_bits(f) >> 24) & 0x80u;
#ifdef COAT_HARDWARE_FP8_CONVERT
  /* sm_89+: one cvt.rn.satfinite does the rounding and the saturation (Inf included); the NaN code keeps
   * the input's sign, as below. */
  const uint32_t converted = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
  return (uint8_t)(bits > 0x7F800000u ? (sign | 0x7Fu) : converted);
#else
  /* below 2^-6, the smallest normal: subnormal steps of 2^-9. Adding 2^14 (whose ulp is 2^-9) lets the
   * fp32 adder round to nearest even; the low mantissa bits are then the code (8 = 2^-6). */
  const uint32_t subnormal =
      coat_f32_to_bits(coat_fadd_rn(coat_f32_from_bits(bits), coat_f32_from_bits(141u << 23))) - (141u << 23);
  /* normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits, nearest even */
  const uint32_t normal = (bits - (120u << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  uint32_t code = bits < 0x3C800000u ? subnormal : normal;
  code = bits >= 0x43E00000u ? 0x7Eu : code; /* >= 448, Inf included: saturate */
  code = bits > 0x7F800000u ? 0x7Fu : code;  /* NaN */
  return (uint8_t)(sign | code);
#endif
}

COAT_INLINE uint8_t coat_f32_to_e5m2(float f) {
  const uint32_t bits = coat_f32_to_bits(f) & 0x7FFFFFFFu;
  const uint32_t sign = (coat_f32_to_bits(f) >> 24) & 0x80u;
#ifdef COAT_HARDWARE_FP8_CONVERT
  /* sm_89+: cvt.rn.satfinite saturates Inf too; E5M2 keeps it, and the NaN code keeps its sign. */
  const uint32_t converted = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2);
  return (uint8_t)(bits > 0x7F800000u ? (sign | 0x7Fu) : bits == 0x7F800000u ? (sign | 0x7Cu) : converted);
#else
  /* below 2^-14: subnormal steps of 2^-16; 2^7 has ulp 2^-16 */
  const uint32_t subnormal =
      coat_f32_to_bits(coat_fadd_rn(coat_f32_from_bits(bits), coat_f32_from_bits(134u << 23))) - (134u << 23);
  const uint32_t normal = (bits - (112u << 23) + 0xFFFFFu + ((bits >> 21) & 1u)) >> 21;
  uint32_t code = bits < 0x38800000u ? subnormal : normal;
  code = bits >= 0x47600000u ? 0x7Bu : code;  /* >= 57344: saturate */
  code = bits == 0x7F800000u ? 0x7Cu : code;  /* Inf */
  code = bits > 0x7F800000u ? 0x7Fu : code;   /* NaN */
  return (uint8_t)(sign | code);
#endif
}

COAT_INLINE float coat_e4m3_to_f32(uint8_t q) {
  const uint32_t sign = (uint32_t)(q & 0x80u) << 24;
  const uint32_t exponent = (q >> 3) & 0xFu;
  const uint32_t mantissa = q & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return coat_f32_from_bits(sign | 0x7FC00000u);
  if (exponent == 0) return coat_f32_from_bits(sign | coat_f32_to_bits((float)mantissa * 0.001953125f));
  return coat_f32_from_bits(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

COAT_INLINE float coat_e5m2_to_f32(uint8_t q) {
  const uint32_t sign = (uint32_t)(q & 0x80u) << 24;
  const uint32_t exponent = (q >> 2) & 0x1Fu;
  const uint32_t mantissa = q & 0x3u;
  if (exponent == 0x1Fu) return coat_f32_from_bits(sign | (mantissa ? 0x7FC00000u : 0x7F800000u));
  if (exponent == 0) return coat_f32_from_bits(sign | coat_f32_to_bits((float)mantissa * 1.52587890625e-5f));
  return coat_f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 21));
}

COAT_INLINE uint8_t coat_f32_to_fp8(float f, coat_fp8_format format) {
  return format == COAT_E4M3 ? coat_f32_to_e4m3(f) : coat_f32_to_e5m2(f);
}

COAT_INLINE float coat_fp8_to_f32(uint8_t q, coat_fp8_format format) {
  return format == COAT_E4M3 ? coat_e4m3_to_f32(q) : coat_e5m2_to_f32(q);
}

#endif /* COAT_FP8_H */
