/*
 * FP6 E2M3 codec (OCP MX FP6), usable from C99 and CUDA.
 *
 * A code is 6 bits: bit 5 the sign, bits 4..3 the exponent e (bias 1), bits 2..0 the mantissa m:
 *     e == 0: m * 0.125                (0 and the subnormals 0.125 .. 0.875)
 *     e >= 1: (1 + m / 8) * 2^(e - 1)  (1 .. 7.5)
 * so the magnitudes run from 0 to 7.5 with a step of 0.125 below 2, 0.25 in [2, 4) and 0.5 from 4 on. There is
 * no Inf and no NaN. E2M3 rather than E3M2: within a 1 x G block the values span little range, and the third
 * mantissa bit halves the error of every value above the block's amax / 8.
 *
 * Encode: round to nearest, ties to the even code; magnitudes past 7.5, +-Inf included, saturate to +-7.5; a NaN
 * encodes to a zero of the NaN's sign (a block's NaN travels in its scale, as in FP4). The sign of zero is kept.
 * Decode is exact. Every E2M3 value is an E4M3 value too; coat_e2m3_to_e4m3 gives its code.
 *
 * Packing: four codes in three bytes, element 4i + j in bits 6j .. 6j + 5 of the little-endian 24-bit word of
 * bytes 3i .. 3i + 2; a row of cols codes takes ceil(3 cols / 4) bytes, and the bits past its last code are 0.
 */
#ifndef COAT_FP6_H
#define COAT_FP6_H

#include "coat/common.h"
#include "coat/float_bits.h"
#include "coat/minifloat.h"

#define COAT_E2M3_MAX 7.5f

/* The code of f: the sign bit, and coat_e2m_magnitude_code with three mantissa bits (coat/minifloat.h). */
COAT_INLINE uint8_t coat_f32_to_e2m3(float f) {
  const uint32_t bits = coat_f32_to_bits(f);
  return (uint8_t)(((bits >> 26) & 0x20u) | coat_e2m_magnitude_code(bits & 0x7FFFFFFFu, 3u));
}

COAT_INLINE float coat_e2m3_to_f32(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x20u) << 26;
  const uint32_t exponent = (code >> 3) & 0x3u;
  const uint32_t mantissa = code & 0x7u;
  /* e >= 1: fp32 exponent e - 1 + 127, the mantissa on top; e == 0: m * 2^-3, exact */
  const float magnitude = exponent ? coat_f32_from_bits((exponent + 126u) << 23 | mantissa << 20) : (float)mantissa * 0.125f;
  return coat_f32_from_bits(sign | coat_f32_to_bits(magnitude));
}

/* The E4M3 code of the E2M3 code's value (exact). Normal codes (magnitude >= 8) rebias the exponent from 1 to 7,
 * keeping the three mantissa bits: magnitude + (6 << 3); the subnormals m / 8 are the E4M3 normals 0x20 (1/8),
 * 0x28, 0x2C, 0x30 (1/2), 0x32, 0x34, 0x36 (7/8), byte m of the constant below. */
COAT_INLINE uint8_t coat_e2m3_to_e4m3(uint8_t code) {
  const uint32_t sign = (uint32_t)(code & 0x20u) << 2;
  const uint32_t magnitude = code & 0x1Fu;
  const uint32_t subnormal = (uint32_t)(0x363432302C282000ull >> (8u * (magnitude & 0x7u))) & 0xFFu;
  return (uint8_t)(sign | (magnitude >= 8u ? magnitude + 48u : subnormal));
}

/* Bytes of a packed row of cols codes. */
COAT_INLINE int64_t coat_fp6_row_bytes(int64_t cols) { return (3 * cols + 3) / 4; }

/* Code of element c of a packed row. */
COAT_INLINE uint8_t coat_fp6_code_at(const uint8_t* row_codes, int64_t c) {
  const int64_t bit = 6 * c;
  const uint32_t shift = (uint32_t)(bit & 7);
  uint32_t word = row_codes[bit >> 3];
  if (shift > 2u) word |= (uint32_t)row_codes[(bit >> 3) + 1] << 8; /* the code runs into the next byte */
  return (uint8_t)((word >> shift) & 0x3Fu);
}

/* ORs code into element c of a packed row whose bits there are 0. */
COAT_INLINE void coat_fp6_put_code(uint8_t* row_codes, int64_t c, uint8_t code) {
  const int64_t bit = 6 * c;
  const uint32_t shift = (uint32_t)(bit & 7);
  row_codes[bit >> 3] |= (uint8_t)(code << shift);
  if (shift > 2u) row_codes[(bit >> 3) + 1] |= (uint8_t)(code >> (8u - shift));
}

#endif /* COAT_FP6_H */
