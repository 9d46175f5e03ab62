/* C99 CPU implementation of coat/stats.h: the same leaves and summation tree as csrc/cuda/stats.cu. */
#include "coat/stats.h"

#include <stddef.h>

#include "coat/detail/stats_math.h"

int64_t coat_quantization_sums_workspace(const coat_quantization_measure* measures, int64_t count) {
  if (count == 0) return 0;
  int64_t tiles = 0;
  for (int64_t i = 0; i < count; ++i) tiles += coat_quantization_tiles(&measures[i]);
  return (tiles + count) * (COAT_STATS_LEAF + 1) + count + 1;
}

/* The scale of measured element (row, c), where row is the row of q and the scales. */
static float coat_element_scale(const float* scales, int64_t group_size, int64_t row, int64_t c, int64_t cols) {
  return group_size == 0 ? scales[0] : scales[row * coat_ceil_div(cols, group_size) + c / group_size];
}

/* One measure's sums, added into m->sums. */
static void coat_measure_sums(const coat_quantization_measure* m) {
  const int64_t cols = m->cols, n = m->rows * cols;
  /* Tiles in order, each summed by its own tree, their totals pushed into the tree over tiles, which is then
   * padded with zeros to a power of two. */
  const int64_t tiles = coat_quantization_tiles(m);
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
        const int64_t row = m->row_index != NULL ? m->row_index[r] : r;
        if (row < 0 || row >= m->q_rows) {
          coat_unreadable_leaf(leaf, &unreadable);
        } else {
          const int64_t x_row = m->x_indexed ? row : r;
          const float value = coat_load_f32(m->x, m->dtype, x_row * m->x_row_stride + c * m->x_col_stride);
          const uint8_t code = m->q[row * m->q_row_stride + c * m->q_col_stride];
          coat_quantization_leaf(value, code, coat_element_scale(m->scales, m->group_size, row, c, cols), m->format,
                                 leaf, &amax);
        }
      }
      for (int k = 0; k < COAT_STATS_LEAF; ++k) coat_pairwise_push(in_tile[k], leaf_index, leaf[k]);
    }
    for (int k = 0; k < COAT_STATS_LEAF; ++k) coat_pairwise_push(over_tiles[k], tile, in_tile[k][tile_levels]);
  }
  if (m->amax_per_scale > 0.0f) {
    float largest = 0.0f;
    for (int64_t j = 0; j < m->nscales; ++j) largest = coat_max_nan(largest, m->scales[j]);
    amax = coat_max_nan(0.0f, largest * m->amax_per_scale);
  }
  amax = coat_max_nan(amax, unreadable);
  const int top = coat_ceil_log2(padded);
  double* sums = m->sums;
  sums[0] += (double)n;
  for (int k = 0; k < COAT_STATS_LEAF; ++k) sums[1 + k] += over_tiles[k][top];
  sums[6] = coat_max_nan((float)sums[6], amax);
}

coat_status coat_quantization_sums_cpu(const coat_quantization_measure* measures, int64_t count) {
  if (count < 0 || (count > 0 && measures == NULL)) return COAT_ERROR_INVALID_ARGUMENT;
  for (int64_t i = 0; i < count; ++i)
    if (!coat_quantization_measure_is_valid(&measures[i])) return COAT_ERROR_INVALID_ARGUMENT;
  for (int64_t i = 0; i < count; ++i) coat_measure_sums(&measures[i]);
  return COAT_SUCCESS;
}
