/*
 * Element-level steps and the summation tree of coat/stats.h, shared by the C and CUDA implementations.
 * Internal: not part of the C API.
 */
#ifndef COAT_DETAIL_STATS_MATH_H
#define COAT_DETAIL_STATS_MATH_H

#include <stddef.h>

#include "coat/detail/quantize_math.h"
#include "coat/stats.h"

/** The five summed values of one element (coat/stats.h), in this order. */
#define COAT_STATS_LEAF 5

/** Whether a measure of coat/stats.h can be read: the checks both entry points make before any launch or sum. */
COAT_INLINE int coat_quantization_measure_is_valid(const coat_quantization_measure* m) {
  return m->rows >= 1 && m->cols >= 1 && m->q_rows >= 1 && m->x != NULL && m->q != NULL && m->scales != NULL &&
         m->sums != NULL && (m->group_size == 0 || coat_is_valid_group_size(m->group_size)) && m->nscales >= 1 &&
         m->amax_per_scale >= 0.0f;
}

/** Tiles of COAT_STATS_TILE leaves that a measure's elements fill. */
COAT_INLINE int64_t coat_quantization_tiles(const coat_quantization_measure* m) {
  return coat_ceil_div(m->rows * m->cols, COAT_STATS_TILE);
}

/** Scaled magnitude from which round to nearest would pass FP8_MAX: FP8_MAX plus half its step. */
COAT_INLINE float coat_clip_threshold(coat_fp8_format format) {
  return format == COAT_E4M3 ? 464.0f : 61440.0f;
}

/** leaf[0..5) of element x quantized to `code` with `scale`; *amax = max(*amax, |x|) when x's copy is finite. */
COAT_INLINE void coat_quantization_leaf(float x, uint8_t code, float scale, coat_fp8_format format, double* leaf,
                                        float* amax) {
  const float dequantized = coat_dequantize_value(coat_fp8_to_f32(code, format), scale);
  const float error = dequantized - x;
  const int finite = isfinite(error);
  leaf[0] = finite ? 0.0 : 1.0;
  leaf[1] = finite && dequantized == 0.0f && x != 0.0f ? 1.0 : 0.0;
  leaf[2] = finite && fabsf(x / scale) >= coat_clip_threshold(format) ? 1.0 : 0.0;
  leaf[3] = finite ? (double)error * (double)error : 0.0;
  leaf[4] = finite ? (double)x * (double)x : 0.0;
  if (finite) *amax = coat_amax_step(*amax, x);
}

/** The leaves of an element that cannot be read (a row index out of range): NaN, so that every sum shows it. */
COAT_INLINE void coat_unreadable_leaf(double* leaf, float* amax) {
  const float nan = coat_f32_from_bits(0x7FC00000u);
  for (int k = 0; k < COAT_STATS_LEAF; ++k) leaf[k] = (double)nan;
  *amax = nan;
}

/** max(a, b) that is NaN when either is (canonical NaN): the same in any order of reduction. */
COAT_INLINE float coat_max_nan(float a, float b) {
  if (a != a || b != b) return coat_f32_from_bits(0x7FC00000u);
  return a > b ? a : b;
}

/** Pairwise summation fed one leaf at a time: after pushing leaves 0 .. 2^k - 1 in order, stack[k] holds the sum
 *  over the complete binary tree whose nodes add left + right. stack has room for k + 1 values. */
COAT_INLINE void coat_pairwise_push(double* stack, int64_t index, double value) {
  int level = 0;
  while ((index >> level) & 1) {
    value = stack[level] + value;
    ++level;
  }
  stack[level] = value;
}

/** Smallest k with 2^k >= n (n >= 1). */
COAT_INLINE int coat_ceil_log2(int64_t n) {
  int k = 0;
  while (((int64_t)1 << k) < n) ++k;
  return k;
}

#endif /* COAT_DETAIL_STATS_MATH_H */
