/* C99 CPU implementation of coat/rope.h: the element arithmetic of coat/detail/rope_math.h, which
 * csrc/cuda/rope.cu runs too. */
#include "coat/rope.h"

#include <stddef.h>

#include "coat/detail/quantize_math.h"
#include "coat/detail/rope_math.h"

static const void* coat_rope_offset(const void* data, coat_dtype dtype, int64_t elements) {
  const size_t element_size = dtype == COAT_FLOAT32 ? 4 : 2;
  return (const char*)data + (size_t)elements * element_size;
}

/* Rotates the `heads` rows of one token of x (strides: batch, seq, head) into out, which holds
 * [tokens, heads, head_dim] contiguously. */
static void coat_rope_token(const coat_rope_args* a, int inverse, int64_t token, const void* x,
                            const int64_t* strides, int64_t heads, void* out) {
  if (heads == 0) return;
  const int64_t b = token / a->seq, s = token % a->seq;
  const int64_t half = a->head_dim / 2;
  const void* cos_row = coat_rope_offset(a->cos, a->table_dtype, b * a->cos_strides[0] + s * a->cos_strides[1]);
  const void* sin_row = coat_rope_offset(a->sin, a->table_dtype, b * a->sin_strides[0] + s * a->sin_strides[1]);
  for (int64_t head = 0; head < heads; ++head) {
    const void* row = coat_rope_offset(x, a->dtype, b * strides[0] + s * strides[1] + head * strides[2]);
    const int64_t out_row = (token * heads + head) * a->head_dim;
    for (int64_t j = 0; j < half; ++j) {
      float s1, s2, y1, y2;
      coat_rope_pair_sines(coat_load_f32(sin_row, a->table_dtype, j), coat_load_f32(sin_row, a->table_dtype, j + half),
                           inverse, &s1, &s2);
      coat_rope_rotate_pair(coat_load_f32(row, a->dtype, j), coat_load_f32(row, a->dtype, j + half),
                            coat_load_f32(cos_row, a->table_dtype, j), coat_load_f32(cos_row, a->table_dtype, j + half),
                            s1, s2, &y1, &y2);
      coat_store_as(out, a->dtype, out_row + j, y1);
      coat_store_as(out, a->dtype, out_row + j + half, y2);
    }
  }
}

coat_status coat_rotary_embedding_cpu(const coat_rope_args* args, int inverse) {
  if (!coat_rope_valid_args(args)) return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t tokens = args->batch * args->seq;
#pragma omp parallel for schedule(static)
  for (int64_t token = 0; token < tokens; ++token) {
    coat_rope_token(args, inverse, token, args->q, args->q_strides, args->q_heads, args->q_out);
    coat_rope_token(args, inverse, token, args->k, args->k_strides, args->k_heads, args->k_out);
  }
  return COAT_SUCCESS;
}

/* The `heads` rows of one token of x (strides: batch, seq, head): RMSNorm with `weight`, RoPE, and the saved
 * input, in the order of coat/detail/rope_math.h's coat_qk_norm_rope section. */
static void coat_qk_norm_token(const coat_qk_norm_rope_args* a, int64_t token, const void* x, const int64_t* strides,
                               int64_t heads, const void* weight, void* out, uint8_t* saved, float* saved_scales,
                               float* rstd) {
  const coat_rope_args* r = &a->rope;
  if (heads == 0) return;
  const int64_t b = token / r->seq, s = token % r->seq;
  const int64_t dim = r->head_dim, half = dim / 2, group_size = a->save_group_size;
  const int64_t ngroups = coat_ceil_div(dim, group_size);
  const void* cos_row = coat_rope_offset(r->cos, r->table_dtype, b * r->cos_strides[0] + s * r->cos_strides[1]);
  const void* sin_row = coat_rope_offset(r->sin, r->table_dtype, b * r->sin_strides[0] + s * r->sin_strides[1]);
  for (int64_t head = 0; head < heads; ++head) {
    const void* row = coat_rope_offset(x, r->dtype, b * strides[0] + s * strides[1] + head * strides[2]);
    const int64_t out_row = token * heads + head;
    float values[COAT_QK_NORM_MAX_HEAD_DIM], normed[COAT_QK_NORM_MAX_HEAD_DIM];
    float partials[COAT_QK_NORM_LANES] = {0.0f};
    for (int64_t c = 0; c < dim; ++c) {
      values[c] = coat_load_f32(row, r->dtype, c);
      const int64_t lane = c / COAT_NORM_ACT_CHUNK;
      partials[lane] = partials[lane] + values[c] * values[c];
    }
    const float row_rstd = coat_canonical_nan(
        coat_rmsnorm_rstd(coat_combine_lane_partials(partials, COAT_QK_NORM_LANES), dim, a->eps));
    rstd[out_row] = row_rstd;
    for (int64_t c = 0; c < dim; ++c)
      normed[c] = coat_rmsnorm_apply(
          values[c], row_rstd, coat_rmsnorm_weight(coat_load_f32(weight, a->weight_dtype, c), a->weight_offset));
    for (int64_t j = 0; j < dim; ++j) {
      const int64_t partner = j < half ? j + half : j - half;
      const float y = coat_qk_norm_rope_element(
          j, half, normed[j], normed[partner], coat_load_f32(cos_row, r->table_dtype, j),
          coat_load_f32(cos_row, r->table_dtype, partner), coat_load_f32(sin_row, r->table_dtype, j),
          coat_load_f32(sin_row, r->table_dtype, partner));
      coat_store_as(out, r->dtype, out_row * dim + j, y);
    }
    for (int64_t group = 0; group < ngroups; ++group) {
      const int64_t begin = group * group_size, end = begin + group_size < dim ? begin + group_size : dim;
      float amax = 0.0f;
      for (int64_t c = begin; c < end; ++c) amax = coat_amax_step(amax, values[c]);
      const float scale = coat_scale_from_amax(amax, COAT_E4M3);
      saved_scales[out_row * ngroups + group] = scale;
      for (int64_t c = begin; c < end; ++c) saved[out_row * dim + c] = coat_quantize_value(values[c], scale, COAT_E4M3);
    }
  }
}

coat_status coat_qk_norm_rope_cpu(const coat_qk_norm_rope_args* args) {
  if (!coat_qk_norm_valid_args(args)) return COAT_ERROR_INVALID_ARGUMENT;
  const coat_rope_args* r = &args->rope;
  const int64_t tokens = r->batch * r->seq;
#pragma omp parallel for schedule(static)
  for (int64_t token = 0; token < tokens; ++token) {
    coat_qk_norm_token(args, token, r->q, r->q_strides, r->q_heads, args->q_weight, r->q_out, args->q_saved,
                       args->q_saved_scales, args->q_rstd);
    coat_qk_norm_token(args, token, r->k, r->k_strides, r->k_heads, args->k_weight, r->k_out, args->k_saved,
                       args->k_saved_scales, args->k_rstd);
  }
  return COAT_SUCCESS;
}
