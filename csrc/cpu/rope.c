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
