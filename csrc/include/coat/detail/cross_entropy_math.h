/*
 * What the C and CUDA implementations of coat/cross_entropy.h share: the argument checks, soft-capping and the
 * float32 combination of a row's reductions into its loss and gradient. The implementations differ only in how
 * they reduce a row (double on the CPU, float32 on the GPU). Internal: not part of the C API.
 */
#ifndef COAT_DETAIL_CROSS_ENTROPY_MATH_H
#define COAT_DETAIL_CROSS_ENTROPY_MATH_H

#include <math.h>
#include <stddef.h>

#include "coat/cross_entropy.h"
#include "coat/float_bits.h"

/** The checks both entry points make before reading anything. */
COAT_INLINE int coat_cross_entropy_valid_args(const coat_cross_entropy_args* a) {
  if (a == NULL || a->rows < 0 || a->vocab < 1 || a->vocab > COAT_CROSS_ENTROPY_MAX_V || a->row_stride < a->vocab)
    return 0;
  if (a->dtype != COAT_FLOAT32 && a->dtype != COAT_BFLOAT16 && a->dtype != COAT_FLOAT16) return 0;
  if (!(a->label_smoothing >= 0.0f && a->label_smoothing <= 1.0f) || !(a->softcap >= 0.0f) || !(a->z_loss >= 0.0f))
    return 0;
  if (a->grad_scale_stride != 0 && a->grad_scale_stride != 1) return 0;
  return a->rows == 0 || (a->logits != NULL && a->labels != NULL && a->loss != NULL && a->lse != NULL);
}

/** The row's label is a class of the vocabulary (ignore_index rows are handled before this is asked). */
COAT_INLINE int coat_cross_entropy_label_in_range(int64_t label, int64_t vocab) { return label >= 0 && label < vocab; }

/** Soft-capping: z' = cap * tanh(z / cap), or z itself without a cap (cap == 0). */
COAT_INLINE float coat_ce_capped(float z, float cap) { return cap > 0.0f ? cap * tanhf(z / cap) : z; }

/** loss = (1 - eps) (lse - z'_y) + eps (lse - sum_z' / V) + zloss lse^2, in float32 from the row's lse, z'_y and
 *  sum of z' (each rounded to float32 from the implementation's accumulator). */
COAT_INLINE float coat_ce_loss(float lse, float label_logit, float sum_logits, int64_t vocab, float eps,
                               float z_loss) {
  float loss = (1.0f - eps) * (lse - label_logit);
  if (eps != 0.0f) loss += eps * (lse - sum_logits / (float)vocab);
  if (z_loss != 0.0f) loss += z_loss * lse * lse;
  return loss;
}

/** dloss/dz_j = p_j (1 + 2 zloss lse) - eps / V - (1 - eps) [j == y], times tanh' = 1 - (z'_j / cap)^2 with
 *  soft-capping; `capped` is z'_j, `probability` p_j = exp(z'_j - lse). */
COAT_INLINE float coat_ce_dlogit(float capped, float probability, int is_label, float lse, int64_t vocab, float eps,
                                 float z_loss, float cap) {
  float d = probability * (1.0f + 2.0f * z_loss * lse) - eps / (float)vocab;
  if (is_label) d -= 1.0f - eps;
  if (cap > 0.0f) {
    const float t = capped / cap;
    d *= 1.0f - t * t;
  }
  return d;
}

#endif /* COAT_DETAIL_CROSS_ENTROPY_MATH_H */
