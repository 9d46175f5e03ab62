/* C99 CPU implementation of coat/stats.h: the same leaves and summation tree as csrc/cuda/stats.cu. */
#include "coat/stats.h"

#include <stddef.h>

#include "coat/detail/stats_math.h"

int64_t coat_quantization_sums_workspace(int64_t rows, int64_t cols) {
  return coat_ceil_div(rows * cols, COAT_STATS_TILE) * (COAT_STATS_LEAF + 1);
}

/* The scale of measured element (row, c), where row is the row of q and the scales. */
static float coat_element_scale(const float* scales, int64_t group_size, int64_t row, int64_t c, int64_t cols) {
  return group_size == 0 ? scales[0] : scales[row * coat_ceil_div(cols, group_size) + c / group_size];
}

coat_status coat_quantization_sums_cpu(const void* x, coat_dtype dtype, int64_t x_row_stride, int64_t x_col_stride,
                                       int x_indexed, const uint8_t* q, coat_fp8_format format, int64_t q_row_stride,
                                       int64_t q_col_stride, const float* scales, int64_t group_size,
                                       int64_t nscales, float amax_per_scale, int64_t q_rows,
                                       const int64_t* row_index, int64_t rows, int64_t cols, double* sums) {
  const int64_t n = rows * cols;
  if (rows < 1 || cols < 1 || q_rows < 1 || x == NULL || q == NULL || scales == NULL || sums == NULL ||
      (group_size != 0 && !coat_is_valid_group_size(group_size)) || nscales < 1 || !(amax_per_scale >= 0.0f))
    return COAT_ERROR_INVALID_ARGUMENT;
  /* Tiles in order, each summed by its own tree, their totals pushed into the tree over tiles, which is then
   * padded with zeros to a power of two. */
  const int64_t tiles = coat_ceil_div(n, COAT_STATS_TILE);
  const int64_t padded = (int64_t)1 << coat_ceil_log2(tiles);
  const int tile_levels = coat_ceil_log2(COAT_STATS_TILE);
  double over_tiles[COAT_STATS_LEAF][64];
  float amax = 0.0f, unreadable = 0.0f;
  for (int64_t tile = 0; tile < padded; ++tile) {
    double in_tile[COAT_STATS_LEAF][16] = {{0.0}};  /* a padding tile's total stays at zero */
    for (int64_t leaf_index = 0; tile < tiles && leaf_index < COAT_STATS_TILE; ++leaf_index) {
      const int64_t i = tile * COAT_STATS_TILE + leaf_index;
      double leaf[COAT_STATS_LEAF] = {0.0, 0.0, 0.0, 0.0, 0.0};
      if (i < n) {
        const int64_t r = i / cols, c = i % cols;
        const int64_t row = row_index != NULL ? row_index[r] : r;
        if (row < 0 || row >= q_rows) {
          coat_unreadable_leaf(leaf, &unreadable);
        } else {
          const int64_t x_row = x_indexed ? row : r;
          const float value = coat_load_f32(x, dtype, x_row * x_row_stride + c * x_col_stride);
          const uint8_t code = q[row * q_row_stride + c * q_col_stride];
          coat_quantization_leaf(value, code, coat_element_scale(scales, group_size, row, c, cols), format, leaf,
                                 &amax);
        }
      }
      for (int k = 0; k < COAT_STATS_LEAF; ++k) coat_pairwise_push(in_tile[k], leaf_index, leaf[k]);
    }
    for (int k = 0; k < COAT_STATS_LEAF; ++k) coat_pairwise_push(over_tiles[k], tile, in_tile[k][tile_levels]);
  }
  if (amax_per_scale > 0.0f) {
    float largest = 0.0f;
    for (int64_t j = 0; j < nscales; ++j) largest = coat_max_nan(largest, scales[j]);
    amax = coat_max_nan(0.0f, largest * amax_per_scale);
  }
  amax = coat_max_nan(amax, unreadable);
  const int top = coat_ceil_log2(padded);
  sums[0] += (double)n;
  for (int k = 0; k < COAT_STATS_LEAF; ++k) sums[1 + k] += over_tiles[k][top];
  sums[6] = coat_max_nan((float)sums[6], amax);
  return COAT_SUCCESS;
}
