/*
 * The arithmetic of the rope family (coat/rope.h), shared by the C and CUDA implementations so that both
 * compute the same bits, and the argument checks both run. Internal: not part of the C API.
 *
 * Every expression is evaluated in fp32 with one rounding per operation, in the order written (the C core
 * is compiled as ISO C99, which does not contract a*b - c*d into an FMA; the CUDA core with -fmad=false).
 */
#ifndef COAT_DETAIL_ROPE_MATH_H
#define COAT_DETAIL_ROPE_MATH_H

#include <stddef.h>

#include "coat/detail/norm_act_math.h"
#include "coat/float_bits.h"
#include "coat/rope.h"

/** The forward's rotated pair (y[j], y[j+h]) for j < h, from x1 = x[j], x2 = x[j+h], c1 = c[j], c2 = c[j+h],
 *  s1 = s[j] and s2 = s[j+h]. */
COAT_INLINE void coat_rope_rotate_pair(float x1, float x2, float c1, float c2, float s1, float s2, float* y1,
                                       float* y2) {
  *y1 = x1 * c1 - x2 * s1;
  *y2 = x2 * c2 + x1 * s2;
}

/** The sines (s1, s2) that make coat_rope_rotate_pair compute the inverse: (-s2, -s1). Then
 *  y1 = x1*c1 - x2*(-s2) and y2 = x2*c2 + x1*(-s1) are, bit for bit, the inverse's x1*c1 + x2*s2 and
 *  x2*c2 - x1*s1: negation is exact and commutes with rounding to nearest, and a - (-b) equals a + b in IEEE
 *  arithmetic, signed zeros included. One expression then serves both directions on both devices. */
COAT_INLINE void coat_rope_pair_sines(float sin_first, float sin_second, int inverse, float* s1, float* s2) {
  *s1 = inverse ? -sin_second : sin_first;
  *s2 = inverse ? -sin_first : sin_second;
}

COAT_INLINE int coat_rope_valid_dtype(coat_dtype dtype) {
  return dtype == COAT_FLOAT32 || dtype == COAT_BFLOAT16 || dtype == COAT_FLOAT16;
}

/** The checks both entry points make before reading anything: sizes and strides in range, known dtypes,
 *  and a pointer for every tensor that has elements. */
COAT_INLINE int coat_rope_valid_args(const coat_rope_args* a) {
  if (a == NULL || a->batch < 0 || a->seq < 0 || a->q_heads < 0 || a->k_heads < 0 || a->head_dim < 2 ||
      a->head_dim % 2 != 0 || a->head_dim > COAT_ROPE_MAX_HEAD_DIM || !coat_rope_valid_dtype(a->dtype) ||
      !coat_rope_valid_dtype(a->table_dtype))
    return 0;
  for (int d = 0; d < 3; ++d)
    if (a->q_strides[d] < 0 || a->k_strides[d] < 0) return 0;
  for (int d = 0; d < 2; ++d)
    if (a->cos_strides[d] < 0 || a->sin_strides[d] < 0) return 0;
  const int64_t tokens = a->batch * a->seq;
  if (tokens > 0 && a->q_heads > 0 && (a->q == NULL || a->q_out == NULL)) return 0;
  if (tokens > 0 && a->k_heads > 0 && (a->k == NULL || a->k_out == NULL)) return 0;
  if (tokens > 0 && a->q_heads + a->k_heads > 0 && (a->cos == NULL || a->sin == NULL)) return 0;
  return 1;
}

/* ------------------------------------------------------------------------------------------------ */
/* coat_qk_norm_rope                                                                                 */

/** Lanes of a coat_qk_norm_rope row: chunk k of the row (elements [8k, 8k + 8)) is lane k's, as in
 *  coat_rmsnorm_lanes(head_dim) == 32 for every head_dim <= COAT_QK_NORM_MAX_HEAD_DIM. */
#define COAT_QK_NORM_LANES 32

/** Element j of the RoPE output of a normalized row n (n_j = n[j], n_partner = n[j + h] for j < h, n[j - h]
 *  otherwise), with the tables at j and at its partner: coat_rope_rotate_pair's y1 or y2, the same bits. */
COAT_INLINE float coat_qk_norm_rope_element(int64_t j, int64_t half, float n_j, float n_partner, float cos_j,
                                            float cos_partner, float sin_j, float sin_partner) {
  float s1, s2, y1, y2;
  if (j < half) {
    coat_rope_pair_sines(sin_j, sin_partner, 0, &s1, &s2);
    coat_rope_rotate_pair(n_j, n_partner, cos_j, cos_partner, s1, s2, &y1, &y2);
    return y1;
  }
  coat_rope_pair_sines(sin_partner, sin_j, 0, &s1, &s2);
  coat_rope_rotate_pair(n_partner, n_j, cos_partner, cos_j, s1, s2, &y1, &y2);
  return y2;
}

COAT_INLINE int coat_qk_norm_valid_args(const coat_qk_norm_rope_args* a) {
  if (a == NULL || !coat_rope_valid_args(&a->rope) || a->rope.head_dim > COAT_QK_NORM_MAX_HEAD_DIM ||
      !coat_rope_valid_dtype(a->weight_dtype) || !coat_is_valid_group_size(a->save_group_size) ||
      !(a->eps >= 0.0f) || a->eps > 3.4028234663852886e38f ||
      !(a->weight_offset >= -3.4028234663852886e38f && a->weight_offset <= 3.4028234663852886e38f))
    return 0;
  const int64_t tokens = a->rope.batch * a->rope.seq;
  if (tokens > 0 && a->rope.q_heads > 0 &&
      (a->q_weight == NULL || a->q_saved == NULL || a->q_saved_scales == NULL || a->q_rstd == NULL))
    return 0;
  if (tokens > 0 && a->rope.k_heads > 0 &&
      (a->k_weight == NULL || a->k_saved == NULL || a->k_saved_scales == NULL || a->k_rstd == NULL))
    return 0;
  return 1;
}

#endif /* COAT_DETAIL_ROPE_MATH_H */
