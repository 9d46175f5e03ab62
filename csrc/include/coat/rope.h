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

/*
 * Per-head RMSNorm of q and k fused with RoPE (Qwen3's and Gemma 3's q_norm / k_norm before apply_rotary_pos_emb),
 * forward.
 *
 * q, k, cos, sin and their layouts are those of coat_rotary_embedding_* above; head_dim is even and
 * 2 <= head_dim <= COAT_QK_NORM_MAX_HEAD_DIM. q_weight and k_weight are `head_dim` contiguous elements of
 * `weight_dtype`. For every (b, s, head) row x of q (weight w = q_weight) or of k (w = k_weight):
 *   rstd   = coat_rmsnorm_rstd(sum_sq, head_dim, eps)    sum_sq in the reduction order of coat/norm_act.h's
 *                                                        RMSNorm for cols = head_dim (32 lanes of 8-element
 *                                                        chunks, coat_combine_lane_partials)
 *   n[j]   = (x[j] * rstd) * (w[j] + weight_offset)      (coat_rmsnorm_apply of coat_rmsnorm_weight, fp32)
 *   out    = RoPE of n by the forward formula above, rounded once to `dtype` (NaN canonical)
 * The row's rstd (NaN canonical) goes to q_rstd / k_rstd[row] and x itself, the norm's input, is saved as E4M3
 * in 1 x save_group_size groups along the row, bit for bit coat_quantize_group of q (or k) seen as a contiguous
 * [rows, head_dim] matrix: q_saved [rows * head_dim] codes, q_saved_scales [rows * ceil(head_dim / G)] fp32,
 * rows = batch * seq * heads in (b, s, head) order; likewise for k. These are exactly the x_saved,
 * x_saved_scales and rstd that coat_rmsnorm_backward_* reads with cols = head_dim, so the backward is
 * coat_rotary_embedding_* (inverse) followed by coat_rmsnorm_backward_* (with the same weight_offset).
 * The output is never held in between in any dtype but fp32: one rounding, at the end.
 */

/** The largest head_dim of coat_qk_norm_rope_*: a row is one warp of 32 lanes holding one 8-element chunk each. */
#define COAT_QK_NORM_MAX_HEAD_DIM 256

typedef struct {
  coat_rope_args rope;      /**< q, k, tables, q_out, k_out, sizes and dtypes, as for coat_rotary_embedding_* */
  const void* q_weight;     /**< [head_dim], `weight_dtype` */
  const void* k_weight;     /**< [head_dim], `weight_dtype` */
  coat_dtype weight_dtype;
  float weight_offset;      /**< added to each weight element in fp32 (coat_rmsnorm_weight): 0, 1 for Gemma; finite */
  float eps;                /**< added in fp32, finite and >= 0 */
  int64_t save_group_size;  /**< 16, 32, 64 or 128 */
  uint8_t* q_saved;         /**< [batch * seq * q_heads * head_dim] E4M3 codes */
  float* q_saved_scales;    /**< [batch * seq * q_heads * ceil(head_dim / save_group_size)] */
  float* q_rstd;            /**< [batch * seq * q_heads] */
  uint8_t* k_saved;         /**< the same for k */
  float* k_saved_scales;
  float* k_rstd;
} coat_qk_norm_rope_args;

coat_status coat_qk_norm_rope_cpu(const coat_qk_norm_rope_args* args);
coat_status coat_qk_norm_rope_cuda(const coat_qk_norm_rope_args* args, coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_ROPE_H */
