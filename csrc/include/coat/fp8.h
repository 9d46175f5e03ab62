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

#define COAT_E4M3_MAX 448.0f
#define COAT_E5M2_MAX 57344.0f

COAT_INLINE float coat_fp8_max(coat_fp8_format format) {
  return format == COAT_E4M3 ? COAT_E4M3_MAX : COAT_E5M2_MAX;
}

COAT_INLINE uint8_t coat_f32_to_e4m3(float f) {
  uint32_t bits = coat_f32_to_bits(f);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);  /* NaN */
  if (bits >= 0x43E00000u) return (uint8_t)(sign | 0x7Eu); /* >= 448, Inf included: saturate */
  if (bits < 0x3C800000u) {
    /* below 2^-6, the smallest normal: subnormal steps of 2^-9. Adding 2^14 (whose ulp is 2^-9) lets
     * the fp32 adder round to nearest even; the low mantissa bits are then the code (8 = 2^-6). */
    const float magic = coat_f32_from_bits(141u << 23);
    return (uint8_t)(sign | (coat_f32_to_bits(coat_fadd_rn(coat_f32_from_bits(bits), magic)) -
                             (141u << 23)));
  }
  /* normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits, nearest even */
  bits = bits - (120u << 23) + 0x7FFFFu + ((bits >> 20) & 1u);
  return (uint8_t)(sign | (bits >> 20));
}

COAT_INLINE uint8_t coat_f32_to_e5m2(float f) {
  uint32_t bits = coat_f32_to_bits(f);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return (uint8_t)(sign | 0x7Fu);  /* NaN */
  if (bits == 0x7F800000u) return (uint8_t)(sign | 0x7Cu); /* Inf */
  if (bits >= 0x47600000u) return (uint8_t)(sign | 0x7Bu); /* >= 57344: saturate */
  if (bits < 0x38800000u) {
    /* below 2^-14: subnormal steps of 2^-16; 2^7 has ulp 2^-16 */
    const float magic = coat_f32_from_bits(134u << 23);
    return (uint8_t)(sign | (coat_f32_to_bits(coat_fadd_rn(coat_f32_from_bits(bits), magic)) -
                             (134u << 23)));
  }
  bits = bits - (112u << 23) + 0xFFFFFu + ((bits >> 21) & 1u);
  return (uint8_t)(sign | (bits >> 21));
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
