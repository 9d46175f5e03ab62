/* C99 CPU implementation of coat/adamw.h: the same element-level steps as csrc/cuda/adamw_*.cu. */
#include "coat/adamw.h"

#include "coat/detail/adamw_math.h"

/* The largest group: a group's new m and v wait here between the update and their quantization. */
#define COAT_MAX_GROUP_SIZE 128

/* Below this many elements (a few ms of work on one core) a loop runs on one thread: waking the OpenMP team
 * would cost more than it saves, and an optimizer step meets many small tensors (biases, norms). */
#define COAT_PARALLEL_MIN_ELEMENTS 16384

/* Elements of the group that starts at column `begin`: G, or fewer for the last group of a row. */
static int64_t coat_group_length(int64_t begin, int64_t group_size, int64_t cols) {
  return cols - begin < group_size ? cols - begin : group_size;
}

static void coat_tables_init(coat_adamw_tables* t) {
  static const coat_log2_entry reduction[32] = COAT_LOG2_REDUCTION_TABLE;
  static const float bf16_log2[128] = COAT_LOG2_BF16_TABLE;
  for (int i = 0; i < 32; ++i) t->reduction[i] = reduction[i];
  for (int i = 0; i < 128; ++i) t->bf16_log2[i] = bf16_log2[i];
  for (int i = 0; i < 512; ++i) coat_adamw_tables_fill_fp8(t, i);
}

static void coat_encode_group(const float* values, int64_t count, coat_range range, coat_fp8_format format,
                              int expand, uint8_t* codes, uint16_t* meta, const coat_adamw_tables* t) {
  coat_meta m;
  const coat_encoder e = coat_encoder_of_range(range, format, expand, t, &m);
  coat_meta_store(m, meta);
  const coat_fp8_log_format f = coat_fp8_log_format_of(format);
  for (int64_t i = 0; i < count; ++i) codes[i] = coat_encode(values[i], &e, &f, format, t);
}

/* One group of one tensor: dequantize m and v, update p, m and v, quantize m and v with fresh meta. */
static void coat_adamw_group(const coat_adamw_tensor* t, int64_t row, int64_t group,
                             const coat_adamw_options* options, const coat_adamw_tables* tables) {
  const int64_t group_size = options->group_size;
  const int64_t ngroups = coat_ceil_div(t->cols, group_size);
  const int64_t begin = group * group_size;
  const int64_t count = coat_group_length(begin, group_size, t->cols);
  const int64_t first = row * t->cols + begin;
  uint16_t* m_meta = t->exp_avg_meta + (row * ngroups + group) * COAT_META_VALUES;
  uint16_t* v_meta = t->exp_avg_sq_meta + (row * ngroups + group) * COAT_META_VALUES;
  const coat_divisor divisor = coat_divisor_make(options->bias_correction2_sqrt);
  const coat_decoder m_old = coat_decoder_make(coat_meta_load(m_meta), t->exp_avg_format, tables);
  const coat_decoder v_old = coat_decoder_make(coat_meta_load(v_meta), t->exp_avg_sq_format, tables);

  float m[COAT_MAX_GROUP_SIZE];
  float v[COAT_MAX_GROUP_SIZE];
  coat_range m_range = coat_range_empty();
  coat_range v_range = coat_range_empty();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = first + i;
    m[i] = coat_decode(t->exp_avg[index], &m_old, t->exp_avg_format, tables);
    v[i] = coat_decode(t->exp_avg_sq[index], &v_old, t->exp_avg_sq_format, tables);
    const float p = coat_adamw_update(coat_load_f32(t->param, t->param_dtype, index),
                                      coat_load_f32(t->grad, t->grad_dtype, index), &m[i], &v[i], options, &divisor);
    if (options->stochastic_rounding && t->param_dtype == COAT_BFLOAT16)
      ((uint16_t*)t->param)[index] = coat_f32_to_bf16_stochastic(p, coat_rounding_bits(t->rounding_seed, index));
    else
      coat_store_as(t->param, t->param_dtype, index, p);
    m_range = coat_range_add(m_range, m[i]);
    v_range = coat_range_add(v_range, v[i]);
  }
  coat_encode_group(m, count, m_range, t->exp_avg_format, options->expand_exp_avg, t->exp_avg + first, m_meta,
                    tables);
  coat_encode_group(v, count, v_range, t->exp_avg_sq_format, options->expand_exp_avg_sq, t->exp_avg_sq + first,
                    v_meta, tables);
}

coat_status coat_fp8_adamw_step_cpu(const coat_adamw_tensor* tensors, int64_t count,
                                    const coat_adamw_options* options) {
  if (!coat_adamw_call_is_valid(tensors, count, options)) return COAT_ERROR_INVALID_ARGUMENT;
  coat_adamw_tables tables;
  coat_tables_init(&tables);
  for (int64_t i = 0; i < count; ++i) {
    const coat_adamw_tensor* t = &tensors[i];
    const int64_t ngroups = coat_ceil_div(t->cols, options->group_size);
    const int64_t total = t->rows * ngroups;
    /* groups, not rows: a 1-D parameter is a single row */
#pragma omp parallel for schedule(static) if (t->rows * t->cols >= COAT_PARALLEL_MIN_ELEMENTS)
    for (int64_t g = 0; g < total; ++g) coat_adamw_group(t, g / ngroups, g % ngroups, options, &tables);
  }
  return COAT_SUCCESS;
}

coat_status coat_quantize_expanded_cpu(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                                       int64_t group_size, coat_fp8_format format, int expand, uint8_t* codes,
                                       uint16_t* meta) {
  if (rows < 0 || cols < 0 || row_stride < cols || !coat_is_valid_group_size(group_size) ||
      !coat_is_valid_format(format) || (rows * cols > 0 && (x == NULL || codes == NULL || meta == NULL)))
    return COAT_ERROR_INVALID_ARGUMENT;
  coat_adamw_tables tables;
  coat_tables_init(&tables);
  const int64_t ngroups = coat_ceil_div(cols, group_size);
  const int64_t total = rows * ngroups;
#pragma omp parallel for schedule(static) if (rows * cols >= COAT_PARALLEL_MIN_ELEMENTS)
  for (int64_t g = 0; g < total; ++g) {
    const int64_t row = g / ngroups;
    const int64_t begin = (g % ngroups) * group_size;
    const int64_t count = coat_group_length(begin, group_size, cols);
    const float* values = x + row * row_stride + begin;
    coat_range range = coat_range_empty();
    for (int64_t i = 0; i < count; ++i) range = coat_range_add(range, values[i]);
    coat_encode_group(values, count, range, format, expand, codes + row * cols + begin, meta + g * COAT_META_VALUES,
                      &tables);
  }
  return COAT_SUCCESS;
}

coat_status coat_dequantize_expanded_cpu(const uint8_t* codes, coat_fp8_format format, const uint16_t* meta,
                                         int64_t rows, int64_t cols, int64_t group_size, float* out) {
  if (rows < 0 || cols < 0 || !coat_is_valid_group_size(group_size) || !coat_is_valid_format(format) ||
      (rows * cols > 0 && (codes == NULL || meta == NULL || out == NULL)))
    return COAT_ERROR_INVALID_ARGUMENT;
  coat_adamw_tables tables;
  coat_tables_init(&tables);
  const int64_t ngroups = coat_ceil_div(cols, group_size);
  const int64_t total = rows * ngroups;
#pragma omp parallel for schedule(static) if (rows * cols >= COAT_PARALLEL_MIN_ELEMENTS)
  for (int64_t g = 0; g < total; ++g) {
    const int64_t begin = (g % ngroups) * group_size;
    const int64_t first = (g / ngroups) * cols + begin;
    const int64_t count = coat_group_length(begin, group_size, cols);
    const coat_decoder d = coat_decoder_make(coat_meta_load(meta + g * COAT_META_VALUES), format, &tables);
    for (int64_t i = 0; i < count; ++i) out[first + i] = coat_decode(codes[first + i], &d, format, &tables);
  }
  return COAT_SUCCESS;
}

coat_status coat_moment_counts_cpu(const coat_moment_state* states, int64_t count, int64_t group_size) {
  if (count < 0 || (count > 0 && states == NULL) || !coat_is_valid_group_size(group_size))
    return COAT_ERROR_INVALID_ARGUMENT;
  for (int64_t i = 0; i < count; ++i)
    if (!coat_moment_state_is_valid(&states[i])) return COAT_ERROR_INVALID_ARGUMENT;
  coat_adamw_tables tables;
  coat_tables_init(&tables);
  for (int64_t i = 0; i < count; ++i) {
    const coat_moment_state* s = &states[i];
    uint64_t* counts = s->counts;
    const int64_t ngroups = coat_ceil_div(s->cols, group_size);
    uint32_t amax_bits = (uint32_t)counts[3], min_key_inverse = (uint32_t)counts[7], max_key = (uint32_t)counts[8];
    for (int64_t m = 0; m < s->measured_rows; ++m) {
      const int64_t row = s->row_index != NULL ? s->row_index[m] : m;
      counts[0] += (uint64_t)s->cols;
      if (row < 0 || row >= s->rows) {
        counts[1] += (uint64_t)s->cols;
        continue;
      }
      for (int64_t g = row * ngroups; g < (row + 1) * ngroups; ++g) {
        const int64_t begin = (g % ngroups) * group_size;
        const int64_t first = row * s->cols + begin;
        const coat_decoder d = coat_decoder_make(coat_meta_load(s->meta + g * COAT_META_VALUES), s->format, &tables);
        for (int64_t c = 0; c < coat_group_length(begin, group_size, s->cols); ++c)
          coat_moment_count_element(s->codes[first + c], &d, s->format, &tables, &counts[1], &counts[2], &amax_bits);
      }
    }
    for (int64_t g = 0; g < s->rows * ngroups; ++g) {
      const uint32_t key = coat_moment_count_group(s->meta[g * COAT_META_VALUES + 1], &counts[5], &counts[6],
                                                   &min_key_inverse, &max_key);
      s->k_keys[g] = (int32_t)(((uint32_t)s->key_prefix << 16) | key);
    }
    counts[4] += (uint64_t)(s->rows * ngroups);
    counts[3] = amax_bits;
    counts[7] = min_key_inverse;
    counts[8] = max_key;
  }
  return COAT_SUCCESS;
}

coat_status coat_moment_stats_cpu(const uint64_t* counts, const int32_t* sorted_keys, int64_t n, double* stats) {
  if (n < 0 || (n > 0 && (counts == NULL || sorted_keys == NULL || stats == NULL))) return COAT_ERROR_INVALID_ARGUMENT;
  uint64_t first = 0;  /* of the state's run of keys */
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t* state = counts + i * COAT_MOMENT_COUNTS;
    coat_moment_stats_row(state, sorted_keys[first + (state[4] - 1) / 2], stats + i * COAT_MOMENT_STATS);
    first += state[4];
  }
  return COAT_SUCCESS;
}
