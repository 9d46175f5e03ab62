/*
 * coat core: softmax cross-entropy over a vocabulary, with its gradient written over the logits (the fused LM
 * head + loss of coat/nn/cross_entropy.py calls it on one chunk of tokens at a time).
 *
 * Per row r of z = logits[r, 0..V) with label y = labels[r]:
 *     z'_j  = cap * tanh(z_j / cap)       with soft-capping (softcap > 0, Gemma style), else z'_j = z_j
 *     lse   = log sum_j exp(z'_j)                                   (computed stably: max first)
 *     loss  = (1 - eps) (lse - z'_y) + eps (lse - mean_j z'_j) + zloss lse^2
 * which is torch.nn.functional.cross_entropy's per-token loss with label_smoothing = eps (the smoothing term
 * is the mean of -log softmax over the vocabulary) plus the z-loss. A row whose label is ignore_index gets
 * loss 0 and, when the gradient is written, a zero gradient; its lse is still written.
 *
 * Gradient (when grad_scale != NULL, written IN PLACE over the row's logits, rounded to their dtype):
 *     p_j        = exp(z'_j - lse)
 *     dloss/dz'_j = p_j (1 + 2 zloss lse) - (1 - eps) [j == y] - eps / V
 *     dloss/dz_j  = dloss/dz'_j (1 - (z'_j / cap)^2)          with soft-capping (the tanh' factor)
 *     logits[r, j] = grad_scale[r * grad_scale_stride] * dloss/dz_j
 * grad_scale_stride 0 gives every row the same scale (a mean or sum reduction), 1 one scale per row.
 *
 * Special values follow the formula in IEEE arithmetic, with torch.logsumexp's convention for an infinite max:
 * the lse of a row whose largest z' is +-Inf is that Inf. So a NaN logit makes its row's lse, loss and gradient
 * NaN; a +Inf logit gives lse +Inf and loss +Inf (NaN when the label is that logit, or with label smoothing or
 * z-loss where Inf - Inf or Inf * 0 arise); a row of -Inf only gives lse -Inf and NaN loss; other -Inf logits
 * have probability 0, and a label at -Inf gets loss +Inf. A label outside [0, V) that is not ignore_index gives
 * its row NaN loss and gradient (the Python wrappers refuse such labels with an error in eager mode).
 *
 * Precision. Both implementations compute z' in float32 (tanhf) and combine a row's reductions into its loss and
 * gradient by the float32 expressions of coat/detail/cross_entropy_math.h. They reduce differently: the CPU core
 * takes the max and the sums of exp(z' - max) and of z' in double (exp and log in double); the CUDA core keeps a
 * float32 online log-sum-exp per thread (the GPU's expf and logf, within 2 ulp), merged over the block. The two
 * agree within float32 rounding (the tolerances in tests/test_cross_entropy.py), not bit for bit; each is
 * deterministic run to run. loss and lse are float32.
 *
 * Layout. logits: `rows` rows of V elements of `dtype`, rows `row_stride` elements apart (row_stride >= V),
 * each row contiguous; labels: `rows` int64; loss, lse: `rows` float32 each. 1 <= V <= COAT_CROSS_ENTROPY_MAX_V.
 * The CUDA entry point enqueues its work on `stream` and returns without synchronising; its pointers are
 * device pointers.
 */
#ifndef COAT_CROSS_ENTROPY_H
#define COAT_CROSS_ENTROPY_H

#include "coat/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The widest vocabulary: offsets within a row are 32-bit on the GPU. */
#define COAT_CROSS_ENTROPY_MAX_V 1073741824

/** Operands of one call. */
typedef struct {
  void* logits;              /**< rows x V, `dtype`; overwritten by the gradient when grad_scale != NULL */
  int64_t rows;
  int64_t vocab;             /**< V */
  int64_t row_stride;        /**< elements between the starts of consecutive rows, >= V */
  coat_dtype dtype;
  const int64_t* labels;     /**< rows */
  int64_t ignore_index;
  float label_smoothing;     /**< eps, in [0, 1] */
  float softcap;             /**< cap; 0 for none */
  float z_loss;              /**< zloss, >= 0 */
  const float* grad_scale;   /**< NULL: no gradient, the logits are only read */
  int64_t grad_scale_stride; /**< 0 (one scale for every row) or 1 (one per row) */
  float* loss;               /**< rows */
  float* lse;                /**< rows */
} coat_cross_entropy_args;

/** loss, lse and (with grad_scale) the gradient of every row, by the formulas at the top of this file. */
coat_status coat_cross_entropy_cpu(const coat_cross_entropy_args* args);
coat_status coat_cross_entropy_cuda(const coat_cross_entropy_args* args, coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_CROSS_ENTROPY_H */
