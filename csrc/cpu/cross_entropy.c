/* C99 CPU implementation of coat/cross_entropy.h: each row in three passes (max, sums, gradient), the reductions
 * in double, rows spread over OpenMP threads. */
#include "coat/cross_entropy.h"

#include <math.h>
#include <stddef.h>

#include "coat/detail/cross_entropy_math.h"
#include "coat/detail/quantize_math.h"

/* max that keeps a NaN once seen, so that a NaN logit makes the row's lse NaN. */
static double coat_ce_max_keeping_nan(double m, double x) { return (x > m || x != x) ? x : m; }

static void coat_ce_row(const coat_cross_entropy_args* a, int64_t r) {
  void* row = (char*)a->logits + (size_t)(r * a->row_stride) * (a->dtype == COAT_FLOAT32 ? 4 : 2);
  const int64_t label = a->labels[r];
  const int64_t vocab = a->vocab;
  const float cap = a->softcap;

  double max = -INFINITY, sum_logits = 0.0;
  for (int64_t j = 0; j < vocab; ++j) {
    const double z = coat_ce_capped(coat_load_f32(row, a->dtype, j), cap);
    max = coat_ce_max_keeping_nan(max, z);
    sum_logits += z;
  }
  double sum_exp = 0.0;
  for (int64_t j = 0; j < vocab; ++j) sum_exp += exp(coat_ce_capped(coat_load_f32(row, a->dtype, j), cap) - max);
  /* An infinite max is the lse itself (torch.logsumexp's convention), whatever Inf - Inf gave the sum. */
  const double lse_double = isinf(max) ? max : max + log(sum_exp);
  const float lse = (float)lse_double;
  a->lse[r] = lse;

  const int ignored = label == a->ignore_index;
  const int valid = coat_cross_entropy_label_in_range(label, vocab);
  if (ignored) {
    a->loss[r] = 0.0f;
  } else if (!valid) {
    a->loss[r] = NAN;
  } else {
    const float label_logit = coat_ce_capped(coat_load_f32(row, a->dtype, label), cap);
    a->loss[r] = coat_ce_loss(lse, label_logit, (float)sum_logits, vocab, a->label_smoothing, a->z_loss);
  }
  if (a->grad_scale == NULL) return;

  const float scale = a->grad_scale[r * a->grad_scale_stride];
  for (int64_t j = 0; j < vocab; ++j) {
    float d = 0.0f;
    if (!ignored) {
      const float capped = coat_ce_capped(coat_load_f32(row, a->dtype, j), cap);
      const float probability = (float)exp((double)capped - lse_double);
      d = valid ? scale * coat_ce_dlogit(capped, probability, j == label, lse, vocab, a->label_smoothing, a->z_loss,
                                         cap)
                : NAN;
    }
    coat_store_as(row, a->dtype, j, d);
  }
}

/* Below this many logits a call runs on one thread: starting the team would cost more than the work. */
#define COAT_CE_PARALLEL_MIN_ELEMENTS 65536

coat_status coat_cross_entropy_cpu(const coat_cross_entropy_args* args) {
  if (!coat_cross_entropy_valid_args(args)) return COAT_ERROR_INVALID_ARGUMENT;
#pragma omp parallel for schedule(static) if (args->rows * args->vocab >= COAT_CE_PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < args->rows; ++r) coat_ce_row(args, r);
  return COAT_SUCCESS;
}
