/*
 * Bit-level float helpers usable from C99 and CUDA: fp32 bit casts and the bf16 / fp16 conversions the
 * quantizers need. Conversions match PyTorch's: round to nearest even, NaN to the canonical quiet NaN.
 */
#ifndef COAT_FLOAT_BITS_H
#define COAT_FLOAT_BITS_H

#include <stdint.h>

#ifdef __CUDACC__
#define COAT_INLINE __host__ __device__ __forceinline__
#else
#define COAT_INLINE static inline
#endif

COAT_INLINE uint32_t coat_f32_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  union { float f; uint32_t u; } v;
  v.f = f;
  return v.u;
#endif
}

COAT_INLINE float coat_f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  union { float f; uint32_t u; } v;
  v.u = u;
  return v.f;
#endif
}

/* a + b rounded to nearest even, never contracted with a neighbouring multiply. */
COAT_INLINE float coat_fadd_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

/* v, with any NaN replaced by the canonical quiet NaN 0x7FC00000: the sign and payload of a NaN that
 * arithmetic produces differ between x86 and CUDA, and CPU and CUDA results must agree bit for bit. */
COAT_INLINE float coat_canonical_nan(float v) { return v == v ? v : coat_f32_from_bits(0x7FC00000u); }

COAT_INLINE float coat_bf16_to_f32(uint16_t h) { return coat_f32_from_bits((uint32_t)h << 16); }

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (PyTorch's choice). */
COAT_INLINE uint16_t coat_f32_to_bf16(float f) {
  uint32_t u = coat_f32_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)0x7FC0u;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* IEEE binary16 -> fp32 (exact). */
COAT_INLINE float coat_f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return coat_f32_from_bits(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return coat_f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
  return coat_f32_from_bits(sign | coat_f32_to_bits((float)mantissa * 5.9604644775390625e-8f));
}

/** fp32 -> IEEE binary16, round to nearest even, overflow to +-Inf, NaN -> 0x7E00 (F. Giesen's
 *  float_to_half_fast3_rtne; the subnormal case rounds in the fp32 adder). */
COAT_INLINE uint16_t coat_f32_to_f16(float f) {
  uint32_t bits = coat_f32_to_bits(f);
  const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  bits &= 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return (uint16_t)0x7E00u;
  if (bits >= 0x47800000u) return (uint16_t)(sign | 0x7C00u); /* >= 2^16: Inf */
  if (bits < 0x38800000u) {                                   /* below 2^-14: subnormal steps of 2^-24 */
    const float magic = coat_f32_from_bits(126u << 23);      /* 0.5, whose ulp is 2^-24 */
    return (uint16_t)(sign | (coat_f32_to_bits(coat_fadd_rn(coat_f32_from_bits(bits), magic)) - (126u << 23)));
  }
  bits = bits - (112u << 23) + 0xFFFu + ((bits >> 13) & 1u);
  return (uint16_t)(sign | (bits >> 13));
}

#endif /* COAT_FLOAT_BITS_H */
