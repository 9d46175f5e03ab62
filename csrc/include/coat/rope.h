/*
 * coat core: rotary position embedding (RoPE, Su et al. 2021) in transformers' rotate_half convention,
 * applied to q and k together, forward and backward.
 *
 * Layout. q is [batch, seq, q_heads, head_dim] and k is [batch, seq, k_heads, head_dim] (q_heads may differ
 * from k_heads: grouped-query attention). Each is addressed through its own element strides for the batch,
 * seq and head indices, and its last dimension is contiguous, so column slices of one
 * [batch*seq, (q_heads + 2*k_heads)*head_dim] q/k/v GEMM output are read in place. cos and sin are
 * [batch or 1, seq, head_dim] tables (what transformers' rotary embedding returns) with their own batch and
 * seq strides and a contiguous last dimension, shared by every head; a batch stride of 0 uses one table for
 * every batch entry. q_out and k_out are contiguous [batch, seq, heads, head_dim] in q's dtype.
 * head_dim is even, 2 <= head_dim <= COAT_ROPE_MAX_HEAD_DIM.
 *
 * Arithmetic. With h = head_dim / 2, for every (b, s, head) row x of q or k and the table rows
 * c = cos[b, s, :], s = sin[b, s, :]:
 *   forward (inverse == 0):   y[j] = x[j]*c[j] - x[j+h]*s[j]        for j <  h
 *                             y[j] = x[j]*c[j] + x[j-h]*s[j]        for j >= h
 *   inverse (inverse != 0):   y[j] = x[j]*c[j] + x[j+h]*s[j+h]      for j <  h
 *                             y[j] = x[j]*c[j] - x[j-h]*s[j-h]      for j >= h
 * The forward is transformers' x*cos + rotate_half(x)*sin. The inverse is its adjoint for any c and s: given
 * the gradient of y it returns the gradient of x, which is RoPE's backward (with RoPE's tables, where
 * c[j] = c[j+h] = cos(theta_j) and s[j] = s[j+h] = sin(theta_j), it is the rotation by -theta).
 * Every input is converted exactly to fp32; each product is rounded to fp32, then the sum or difference,
 * then the result is rounded once to the output dtype (nearest even). No FMA contraction: the C core is
 * compiled as ISO C99 and the CUDA core with -fmad=false, and both evaluate the expressions of
 * coat/detail/rope_math.h. The fp32 result is therefore exactly what PyTorch computes for
 * (x*c + rotate_half(x)*s) on fp32 tensors.
 *
 * Special values follow the formula: a NaN in x[j], its partner or the table entries it meets makes y[j]
 * NaN; Inf * 0 and Inf - Inf give NaN, Inf times a finite nonzero value gives +-Inf, and an fp32 result
 * past the output dtype's range becomes +-Inf. NaN outputs are stored canonically (0x7FC00000, bf16
 * 0x7FC0, fp16 0x7E00), as arithmetic NaNs differ between x86 and CUDA.
 *
 * The CPU (C) and CUDA implementations compute the same values element for element, bit for bit.
 * The CUDA entry point enqueues its work on `stream` and returns without synchronising; its pointers are
 * device pointers (the argument struct itself is host memory).
 */
#ifndef COAT_ROPE_H
#define COAT_ROPE_H

#include "coat/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The largest head_dim: a token's row of head_dim / 16 lanes and their heads share one 256-thread block on
 *  the GPU; every model in use has head_dim <= 256. */
#define COAT_ROPE_MAX_HEAD_DIM 1024

/** Operands of one call. Strides are in elements and >= 0; a size-1 dimension may have any stride. */
typedef struct {
  const void* q;          /**< [batch, seq, q_heads, head_dim], `dtype` */
  const void* k;          /**< [batch, seq, k_heads, head_dim], `dtype` */
  int64_t q_strides[3];   /**< between consecutive batch, seq and head indices of q */
  int64_t k_strides[3];   /**< the same for k */
  const void* cos;        /**< [batch or 1, seq, head_dim], `table_dtype` */
  const void* sin;        /**< [batch or 1, seq, head_dim], `table_dtype` */
  int64_t cos_strides[2]; /**< batch (0: one table for the whole batch) and seq strides of cos */
  int64_t sin_strides[2]; /**< the same for sin */
  void* q_out;            /**< contiguous [batch, seq, q_heads, head_dim], `dtype` */
  void* k_out;            /**< contiguous [batch, seq, k_heads, head_dim], `dtype` */
  int64_t batch;
  int64_t seq;
  int64_t q_heads;
  int64_t k_heads;
  int64_t head_dim;       /**< even, 2 <= head_dim <= COAT_ROPE_MAX_HEAD_DIM */
  coat_dtype dtype;       /**< of q, k, q_out and k_out */
  coat_dtype table_dtype; /**< of cos and sin; may differ from dtype */
} coat_rope_args;

/** q_out, k_out = RoPE of q and k (inverse == 0) or its adjoint, the backward (inverse != 0), by the
 *  formulas at the top of this file. */
coat_status coat_rotary_embedding_cpu(const coat_rope_args* args, int inverse);
coat_status coat_rotary_embedding_cuda(const coat_rope_args* args, int inverse, coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_ROPE_H */
