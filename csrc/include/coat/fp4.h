/*
 * FP4 E2M1 codec (OCP MX FP4), usable from C99 and CUDA.
 *
 * A code is a nibble: bit 3 the sign, bits 2..1 the exponent e (bias 1), bit 0 the mantissa m:
 *     e == 0: m * 0.5                 (0 and the subnormal 0.5)
 *     e >= 1: (1 + m / 2) * 2^(e - 1) (1, 1.5, 2, 3, 4, 6)
 * so the magnitudes of codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. There is no Inf and no NaN.
 *
 * Encode: round to nearest, ties to the even code; magnitudes past 6, +-Inf included, saturate to +-6;
 * a NaN encodes to a zero of the NaN's sign (the quantizers of quantize.h meet a NaN product only in
 * blocks whose scale is NaN or Inf, which decode to NaN whatever the code). The sign of zero is kept.
 * Decode is exact. Every E2M1 value is an E4M3 value too; coat_e2m1_to_e4m3 gives its code.
 *
 * Packing: two codes per byte, element 2i in the low nibble and element 2i+1 in the high nibble (the
 * order of NVIDIA's and PyTorch's float4_e2m1fn_x2 data).
 *
 * No GPU coat targets (sm_80, sm_90) converts FP4 in hardware; the integer codec below runs on both the
 * C core and CUDA, so their codes agree by construction.
 */
#ifndef COAT_FP4_H
#define COAT_FP4_H

#include "coat/common.h"
#include "coat/float_bits.h"
#include "coat/minifloat.h"

#define COAT_E2M1_MAX 6.0f

/* The three magnitude bits of coat_f32_to_e2m1's code, from the bits of a magnitude m >= 0 or of a NaN of either
 * sign: coat_e2m_magnitude_code with one mantissa bit (coat/minifloat.h says how). Equal to counting the
 * midpoints that m passes (> at 0.25, 1.25, 2.5 and 5, >= at 0.75, 1.75 and 3.5) on every float
 * (tools/cuda_emulation checks them all). */
COAT_INLINE uint32_t coat_e2m1_magnitude_code(uint32_t magnitude) { return coat_e2m_magnitude_code(magnitude, 1u); }

/* The code of f, by arithmetic rather than seven comparisons with the grid's midpoints (the quantizers encode
 * every element, and the comparisons made FP4 encoding compute-bound on the GPU); tests/test_block_formats.py holds it
 * to a float64 oracle. */
COAT_INLINE uint8_t coat_f32_to_e2m1(float f) {
  const uint32_t bits = coat_f32_to_bits(f);
  return (uint8_t)(((bits >> 28) & 0x8u) | coat_e2m1_magnitude_code(bits & 0x7FFFFFFFu));
}

COAT_INLINE float coat_e2m1_to_f32(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x8u) << 28;
  const uint32_t exponent = (code >> 1) & 0x3u;
  const uint32_t mantissa = code & 0x1u;
  /* e >= 1: fp32 exponent e - 1 + 127, the mantissa bit on top; e == 0: 0, or 0.5 = 2^-1 */
  const uint32_t magnitude = exponent ? ((exponent + 126u) << 23 | mantissa << 22) : mantissa ? 126u << 23 : 0u;
  return coat_f32_from_bits(sign | magnitude);
}

/* The E4M3 code of the E2M1 code's value (exact). Normal codes (>= 2) rebias the exponent from 1 to 7 and
 * move the mantissa bit to the top of E4M3's three: ((e + 6) << 3) | (m << 2) = 4 * code + 48; the
 * subnormal 0.5 = 2^-1 is the E4M3 normal 0x30. */
COAT_INLINE uint8_t coat_e2m1_to_e4m3(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x8u) << 4;
  const uint32_t magnitude = code & 0x7u;
  return (uint8_t)(sign | (magnitude >= 2u ? 4u * magnitude + 48u : magnitude ? 0x30u : 0u));
}

/* Code of element c of a packed row (the low nibble holds the even elements). */
COAT_INLINE uint8_t coat_fp4_code_at(const uint8_t* row_codes, int64_t c) {
  return (uint8_t)((row_codes[c >> 1] >> ((c & 1) * 4)) & 0xFu);
}

/* The byte holding codes of elements 2i (low) and 2i + 1 (high). */
COAT_INLINE uint8_t coat_fp4_pack(uint8_t even, uint8_t odd) { return (uint8_t)(even | odd << 4); }

#endif /* COAT_FP4_H */
