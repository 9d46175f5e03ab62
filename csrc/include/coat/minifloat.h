/*
 * The encoder shared by coat's block-scaled saved formats, FP4 E2M1 (coat/fp4.h) and FP6 E2M3 (coat/fp6.h):
 * minifloats with two exponent bits (bias 1) and M mantissa bits, a subnormal step of 2^-M, a largest
 * magnitude of (2 - 2^-M) * 4, no Inf and no NaN. Usable from C99 and CUDA.
 */
#ifndef COAT_MINIFLOAT_H
#define COAT_MINIFLOAT_H

#include "coat/common.h"
#include "coat/float_bits.h"

/* The magnitude bits (M + 2 of them) of the E2M<M> code of a magnitude given by its bits (m >= 0, or a NaN of
 * either sign), by arithmetic rather than comparisons with the grid's midpoints: the grid's step is 2^-M below
 * 2, 2^(1-M) in [2, 4) and 2^(2-M) from 4 on, so with e = 0, 1, 2 for m in those ranges the code is
 * m * 2^(M - e) rounded to an integer, ties to even (the even integer is the even code, as e << M is even),
 * plus e << M; the rounding is the float addition of 2^23 (the scaled value is below 16, the product exact).
 * Magnitudes from 8 on, Inf included, are clamped to 8, whose code 4 << M saturates to the largest,
 * (4 << M) - 1; a NaN encodes to 0. tests/test_block_formats.py holds both formats to a float64 oracle. */
COAT_INLINE uint32_t coat_e2m_magnitude_code(uint32_t magnitude, uint32_t mantissa_bits) {
  const uint32_t clamped = magnitude < 0x41000000u ? magnitude : 0x41000000u; /* min(m, 8); a NaN too */
  const uint32_t biased = clamped >> 23;
  const uint32_t e = biased > 127u ? biased - 127u : 0u; /* 3 for 8 itself */
  const float scaled = coat_f32_from_bits(clamped) * coat_f32_from_bits((127u + mantissa_bits - e) << 23);
  const uint32_t code = coat_f32_to_bits(scaled + 8388608.0f) - 0x4B000000u + (e << mantissa_bits);
  const uint32_t largest = (4u << mantissa_bits) - 1u;
  return magnitude > 0x7F800000u ? 0u : code < largest ? code : largest;
}

#endif /* COAT_MINIFLOAT_H */
