/* C99 CPU implementation of coat/norm_act.h. The element math and the reduction orders are those of
 * coat/detail/norm_act_math.h, replayed in the order csrc/cuda/rmsnorm.cu and silu_mul.cu compute them. */
#include "coat/norm_act.h"

#include <math.h>
#include <stddef.h>

#include "coat/detail/norm_act_math.h"
#include "coat/fp4.h"
#include "coat/fp6.h"
#include "coat/quantize.h"

static int valid_matrix(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && cols <= COAT_NORM_ACT_MAX_COLS && row_stride >= cols &&
         (x != NULL || rows * cols == 0);
}

static const void* row_at(const void* x, coat_dtype dtype, int64_t row, int64_t row_stride) {
  const size_t element_size = dtype == COAT_FLOAT32 ? 4 : 2;
  return (const char*)x + (size_t)row * (size_t)row_stride * element_size;
}

static int64_t lane_of_column(int64_t col, int64_t lanes) { return (col / COAT_NORM_ACT_CHUNK) % lanes; }

static int valid_saved_format(coat_saved_format format) {
  return format == COAT_SAVED_E4M3 || format == COAT_SAVED_FP4 || format == COAT_SAVED_FP6;
}

/* Bytes of one saved row. */
static int64_t saved_row_bytes(int64_t cols, coat_saved_format format) {
  switch (format) {
    case COAT_SAVED_FP4: return coat_ceil_div(cols, 2);
    case COAT_SAVED_FP6: return coat_fp6_row_bytes(cols);
    default: return cols;
  }
}

/* Element c of saved row r as an E4M3 code: an FP4 or FP6 code is read as its exact E4M3 expansion. */
static uint8_t saved_code(const uint8_t* saved, coat_saved_format format, int64_t r, int64_t c, int64_t cols) {
  const uint8_t* row = saved + r * saved_row_bytes(cols, format);
  switch (format) {
    case COAT_SAVED_FP4: return coat_e2m1_to_e4m3(coat_fp4_code_at(row, c));
    case COAT_SAVED_FP6: return coat_e2m3_to_e4m3(coat_fp6_code_at(row, c));
    default: return row[c];
  }
}

/* One row of an input saved for backward: coat_quantize_group(x, group_size, E4M3), coat_quantize_fp4(x,
 * group_size) or coat_quantize_fp6(x, group_size). */
static void save_row(const void* row, coat_dtype dtype, int64_t cols, int64_t group_size, coat_saved_format format,
                     uint8_t* codes, float* scales) {
  if (format == COAT_SAVED_FP4) {
    coat_quantize_fp4_cpu(row, dtype, 1, cols, cols, group_size, codes, scales);
    return;
  }
  if (format == COAT_SAVED_FP6) {
    coat_quantize_fp6_cpu(row, dtype, 1, cols, cols, group_size, codes, scales);
    return;
  }
  for (int64_t begin = 0, group = 0; begin < cols; begin += group_size, ++group) {
    const int64_t end = begin + group_size < cols ? begin + group_size : cols;
    float amax = 0.0f;
    for (int64_t c = begin; c < end; ++c) amax = coat_amax_step(amax, coat_load_f32(row, dtype, c));
    const float scale = coat_scale_from_amax(amax, COAT_E4M3);
    scales[group] = scale;
    for (int64_t c = begin; c < end; ++c) codes[c] = coat_quantize_value(coat_load_f32(row, dtype, c), scale, COAT_E4M3);
  }
}

/* Element c of the norm weight plus the offset (coat_rmsnorm_weight). */
static float weight_at(const void* weight, coat_dtype dtype, float offset, int64_t c) {
  return coat_rmsnorm_weight(coat_load_f32(weight, dtype, c), offset);
}

/* Writes code for element (r, c) of y and, when there is one, of its transpose. */
static void put_code(uint8_t code, int64_t r, int64_t c, int64_t rows, int64_t cols, uint8_t* y, uint8_t* y_t) {
  y[r * cols + c] = code;
  if (y_t != NULL) y_t[c * rows + r] = code;
}

/* rstd of row r of x (stored in rstd[r]) and the row saved in save_format: pass 1 of the RMSNorm forwards. */
static float rmsnorm_row_stats(const void* row, coat_dtype x_dtype, int64_t r, int64_t cols, float eps,
                               int64_t save_group_size, coat_saved_format save_format, uint8_t* x_saved,
                               float* x_saved_scales, float* rstd) {
  const int64_t lanes = coat_rmsnorm_lanes(cols);
  float partials[COAT_RMSNORM_MAX_LANES] = {0.0f};
  for (int64_t c = 0; c < cols; ++c) {
    const float v = coat_load_f32(row, x_dtype, c);
    const int64_t lane = lane_of_column(c, lanes);
    partials[lane] = partials[lane] + v * v;
  }
  const float row_rstd = coat_canonical_nan(coat_rmsnorm_rstd(coat_combine_lane_partials(partials, lanes), cols, eps));
  rstd[r] = row_rstd;
  save_row(row, x_dtype, cols, save_group_size, save_format, x_saved + r * saved_row_bytes(cols, save_format),
           x_saved_scales + r * coat_ceil_div(cols, save_group_size));
  return row_rstd;
}

coat_status coat_rmsnorm_quantize_cpu(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                      const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                                      int64_t save_group_size, coat_saved_format save_format, coat_fp8_format y_format,
                                      uint8_t* y, float* y_scale, uint8_t* y_t, uint8_t* x_saved, float* x_saved_scales,
                                      float* rstd, float* y_amax) {
  if (!valid_matrix(x, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == NULL ||
      !isfinite(weight_offset) || !coat_is_valid_group_size(save_group_size) || y_scale == NULL ||
      y_amax == NULL || !valid_saved_format(save_format))
    return COAT_ERROR_INVALID_ARGUMENT;
  float amax = 0.0f;
  /* pass 1: rstd, the saved input and the amax of y */
#pragma omp parallel for schedule(static) reduction(max : amax)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = row_at(x, x_dtype, r, row_stride);
    const float row_rstd = rmsnorm_row_stats(row, x_dtype, r, cols, eps, save_group_size, save_format, x_saved,
                                             x_saved_scales, rstd);
    for (int64_t c = 0; c < cols; ++c)
      amax = coat_amax_step(amax, coat_rmsnorm_apply(coat_load_f32(row, x_dtype, c), row_rstd,
                                                     weight_at(weight, weight_dtype, weight_offset, c)));
  }
  *y_amax = amax;
  const float scale = coat_scale_from_amax(amax, y_format);
  *y_scale = scale;
  /* pass 2: y recomputed from x and quantized with the per-tensor scale */
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = row_at(x, x_dtype, r, row_stride);
    for (int64_t c = 0; c < cols; ++c) {
      const float w = weight_at(weight, weight_dtype, weight_offset, c);
      const float value = coat_canonical_nan(coat_rmsnorm_apply(coat_load_f32(row, x_dtype, c), rstd[r], w));
      put_code(coat_quantize_value(value, scale, y_format), r, c, rows, cols, y, y_t);
    }
  }
  return COAT_SUCCESS;
}

coat_status coat_rmsnorm_save_cpu(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                                  int64_t save_group_size, coat_saved_format save_format, const void* residual,
                                  coat_dtype residual_dtype, void* out, uint8_t* x_saved, float* x_saved_scales,
                                  float* rstd) {
  if (!valid_matrix(x, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == NULL ||
      !isfinite(weight_offset) || !coat_is_valid_group_size(save_group_size) || !valid_saved_format(save_format) ||
      (rows > 0 && (out == NULL || x_saved == NULL || x_saved_scales == NULL || rstd == NULL)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const coat_dtype out_dtype = residual != NULL ? residual_dtype : x_dtype;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = row_at(x, x_dtype, r, row_stride);
    const float row_rstd = rmsnorm_row_stats(row, x_dtype, r, cols, eps, save_group_size, save_format, x_saved,
                                             x_saved_scales, rstd);
    for (int64_t c = 0; c < cols; ++c) {
      float value = coat_rmsnorm_apply(coat_load_f32(row, x_dtype, c), row_rstd,
                                       weight_at(weight, weight_dtype, weight_offset, c));
      if (residual != NULL)
        value = coat_round_as(x_dtype, value) + coat_load_f32(residual, residual_dtype, r * cols + c);
      coat_store_as(out, out_dtype, r * cols + c, value);
    }
  }
  return COAT_SUCCESS;
}

int64_t coat_rmsnorm_backward_workspace_size(int64_t rows, int64_t cols) {
  return rows > 0 && cols > 0 ? coat_rmsnorm_backward_slices(rows, cols) * cols : 0;
}

coat_status coat_rmsnorm_backward_cpu(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                      int64_t row_stride, const uint8_t* x_saved, const float* x_saved_scales,
                                      int64_t save_group_size, coat_saved_format saved_format, const float* rstd,
                                      const void* weight, coat_dtype weight_dtype, float weight_offset,
                                      const void* residual, coat_dtype residual_dtype, void* dx, float* dweight,
                                      float* workspace) {
  if (!valid_matrix(dy, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == NULL ||
      !isfinite(weight_offset) || dweight == NULL || !coat_is_valid_group_size(save_group_size) ||
      !valid_saved_format(saved_format) ||
      (rows > 0 && (x_saved == NULL || x_saved_scales == NULL || rstd == NULL || dx == NULL || workspace == NULL)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t lanes = coat_rmsnorm_lanes(cols);
  const int64_t ngroups = coat_ceil_div(cols, save_group_size);
  const int64_t rows_per_slice = coat_rmsnorm_backward_rows_per_slice(rows, cols);
  const int64_t slices = rows > 0 ? coat_ceil_div(rows, rows_per_slice) : 0;
  const coat_dtype dx_dtype = residual != NULL ? residual_dtype : dy_dtype;
#pragma omp parallel for schedule(static)
  for (int64_t slice = 0; slice < slices; ++slice) {
    float* slice_dweight = workspace + slice * cols;
    for (int64_t c = 0; c < cols; ++c) slice_dweight[c] = 0.0f;
    const int64_t end = (slice + 1) * rows_per_slice < rows ? (slice + 1) * rows_per_slice : rows;
    for (int64_t r = slice * rows_per_slice; r < end; ++r) {
      const void* dy_row = row_at(dy, dy_dtype, r, row_stride);
      const float* scales = x_saved_scales + r * ngroups;
      const float row_rstd = rstd[r];
      float partials[COAT_RMSNORM_MAX_LANES] = {0.0f};
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat =
            coat_rmsnorm_xhat(saved_code(x_saved, saved_format, r, c, cols), scales[c / save_group_size], row_rstd);
        const float g = coat_load_f32(dy_row, dy_dtype, c) * weight_at(weight, weight_dtype, weight_offset, c);
        const int64_t lane = lane_of_column(c, lanes);
        partials[lane] = partials[lane] + g * xhat;
      }
      const float mean_dot = coat_div_rn(coat_combine_lane_partials(partials, lanes), (float)cols);
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat =
            coat_rmsnorm_xhat(saved_code(x_saved, saved_format, r, c, cols), scales[c / save_group_size], row_rstd);
        const float dy_value = coat_load_f32(dy_row, dy_dtype, c);
        const float g = dy_value * weight_at(weight, weight_dtype, weight_offset, c);
        float dx_value = coat_rmsnorm_dx(g, xhat, mean_dot, row_rstd);
        if (residual != NULL)
          dx_value = coat_rmsnorm_dx_plus_residual(dx_value, dy_dtype,
                                                   coat_load_f32(residual, residual_dtype, r * cols + c));
        coat_store_as(dx, dx_dtype, r * cols + c, dx_value);
        slice_dweight[c] = slice_dweight[c] + dy_value * xhat;
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < cols; ++c) {
    float phases[COAT_DWEIGHT_PHASES] = {0.0f};
    for (int64_t slice = 0; slice < slices; ++slice)
      phases[slice % COAT_DWEIGHT_PHASES] = phases[slice % COAT_DWEIGHT_PHASES] + workspace[slice * cols + c];
    dweight[c] = coat_canonical_nan(coat_combine_dweight_phases(phases));
  }
  return COAT_SUCCESS;
}

coat_status coat_silu_mul_quantize_cpu(const void* gate, const void* up, coat_dtype dtype, int64_t rows,
                                       int64_t cols, int64_t gate_row_stride, int64_t up_row_stride,
                                       const float* smooth_scale, coat_activation activation, int64_t save_group_size,
                                       coat_saved_format save_format, coat_fp8_format y_format, uint8_t* y,
                                       float* y_scale, uint8_t* y_t, uint8_t* gate_saved, float* gate_scales,
                                       uint8_t* up_saved, float* up_scales, float* y_amax) {
  if (!valid_matrix(gate, rows, cols, gate_row_stride) ||
      (up != NULL && !valid_matrix(up, rows, cols, up_row_stride)) ||
      !coat_is_valid_group_size(save_group_size) || y_scale == NULL || y_amax == NULL ||
      !valid_saved_format(save_format) || !coat_is_valid_activation(activation))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t ngroups = coat_ceil_div(cols, save_group_size);
  float amax = 0.0f;
  /* pass 1: the saved inputs and the amax of y */
#pragma omp parallel for schedule(static) reduction(max : amax)
  for (int64_t r = 0; r < rows; ++r) {
    const void* gate_row = row_at(gate, dtype, r, gate_row_stride);
    const void* up_row = up != NULL ? row_at(up, dtype, r, up_row_stride) : NULL;
    const int64_t saved_offset = r * saved_row_bytes(cols, save_format);
    save_row(gate_row, dtype, cols, save_group_size, save_format, gate_saved + saved_offset, gate_scales + r * ngroups);
    if (up_row != NULL)
      save_row(up_row, dtype, cols, save_group_size, save_format, up_saved + saved_offset, up_scales + r * ngroups);
    for (int64_t c = 0; c < cols; ++c) {
      const float g = coat_load_f32(gate_row, dtype, c);
      amax = coat_amax_step(amax, coat_silu_mul(coat_silu(g, coat_activation_sigmoid(activation, g)),
                                                up_row != NULL ? coat_load_f32(up_row, dtype, c) : 1.0f,
                                                smooth_scale ? smooth_scale[c] : 1.0f));
    }
  }
  *y_amax = amax;
  const float scale = coat_scale_from_amax(amax, y_format);
  *y_scale = scale;
  /* pass 2: y recomputed from gate and up and quantized with the per-tensor scale */
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const void* gate_row = row_at(gate, dtype, r, gate_row_stride);
    const void* up_row = up != NULL ? row_at(up, dtype, r, up_row_stride) : NULL;
    for (int64_t c = 0; c < cols; ++c) {
      const float g = coat_load_f32(gate_row, dtype, c);
      const float value = coat_canonical_nan(coat_silu_mul(coat_silu(g, coat_activation_sigmoid(activation, g)),
                                                           up_row != NULL ? coat_load_f32(up_row, dtype, c) : 1.0f,
                                                           smooth_scale ? smooth_scale[c] : 1.0f));
      put_code(coat_quantize_value(value, scale, y_format), r, c, rows, cols, y, y_t);
    }
  }
  return COAT_SUCCESS;
}

coat_status coat_silu_mul_backward_cpu(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const uint8_t* gate_saved, const float* gate_scales,
                                       const uint8_t* up_saved, const float* up_scales,
                                       const float* smooth_scale, coat_activation activation, int64_t save_group_size,
                                       coat_saved_format saved_format, void* dgate, void* dup, float* d_amax) {
  if (!valid_matrix(dy, rows, cols, row_stride) || !coat_is_valid_group_size(save_group_size) ||
      !valid_saved_format(saved_format) || !coat_is_valid_activation(activation) ||
      (rows * cols > 0 && (gate_saved == NULL || gate_scales == NULL || dgate == NULL ||
                           (up_saved != NULL && (up_scales == NULL || dup == NULL)))))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int gated = up_saved != NULL;
  const int64_t ngroups = coat_ceil_div(cols, save_group_size);
  float amax = 0.0f; /* of the unrounded values: rounded once at the end (coat_round_as) */
#pragma omp parallel for schedule(static) reduction(max : amax)
  for (int64_t r = 0; r < rows; ++r) {
    const void* dy_row = row_at(dy, dy_dtype, r, row_stride);
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t scale_index = r * ngroups + c / save_group_size;
      const float gate_value =
          coat_saved_value(saved_code(gate_saved, saved_format, r, c, cols), gate_scales[scale_index]);
      const float up_value =
          gated ? coat_saved_value(saved_code(up_saved, saved_format, r, c, cols), up_scales[scale_index]) : 1.0f;
      float dgate_value, dup_value;
      coat_silu_mul_grads(activation, coat_load_f32(dy_row, dy_dtype, c), gate_value,
                          coat_activation_sigmoid(activation, gate_value), up_value,
                          smooth_scale ? smooth_scale[c] : 1.0f, &dgate_value, &dup_value);
      coat_store_as(dgate, dy_dtype, r * cols + c, dgate_value);
      amax = coat_amax_step(amax, dgate_value);
      if (gated) {
        coat_store_as(dup, dy_dtype, r * cols + c, dup_value);
        amax = coat_amax_step(amax, dup_value);
      }
    }
  }
  if (d_amax != NULL) d_amax[0] = coat_amax_step(d_amax[0], coat_round_as(dy_dtype, amax));
  return COAT_SUCCESS;
}

coat_status coat_rmsnorm_requantize_cpu(const uint8_t* x_saved, const float* x_saved_scales, int64_t save_group_size,
                                        coat_saved_format saved_format, const float* rstd, int64_t rows, int64_t cols,
                                        const void* weight, coat_dtype weight_dtype, float weight_offset,
                                        const float* y_scale, coat_fp8_format y_format, uint8_t* y_t) {
  if (rows < 0 || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == NULL || !isfinite(weight_offset) ||
      y_scale == NULL ||
      !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      (rows > 0 && (x_saved == NULL || x_saved_scales == NULL || rstd == NULL || y_t == NULL)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t ngroups = coat_ceil_div(cols, save_group_size);
  const float scale = *y_scale;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* scales = x_saved_scales + r * ngroups;
    for (int64_t c = 0; c < cols; ++c) {
      const float x = coat_saved_value(saved_code(x_saved, saved_format, r, c, cols), scales[c / save_group_size]);
      const float w = weight_at(weight, weight_dtype, weight_offset, c);
      const float value = coat_canonical_nan(coat_rmsnorm_apply(x, rstd[r], w));
      y_t[c * rows + r] = coat_quantize_value(value, scale, y_format);
    }
  }
  return COAT_SUCCESS;
}

coat_status coat_silu_mul_requantize_cpu(const uint8_t* gate_saved, const float* gate_scales, const uint8_t* up_saved,
                                         const float* up_scales, int64_t save_group_size,
                                         coat_saved_format saved_format, int64_t rows, int64_t cols,
                                         const float* smooth_scale, coat_activation activation,
                                         const float* y_scale, coat_fp8_format y_format,
                                         uint8_t* y_t) {
  if (rows < 0 || cols < 0 || cols > COAT_NORM_ACT_MAX_COLS || y_scale == NULL ||
      !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      !coat_is_valid_activation(activation) ||
      (rows * cols > 0 && (gate_saved == NULL || gate_scales == NULL || (up_saved != NULL && up_scales == NULL) ||
                           y_t == NULL)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t ngroups = coat_ceil_div(cols, save_group_size);
  const float scale = *y_scale;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t scale_index = r * ngroups + c / save_group_size;
      const float gate =
          coat_requantize_gate(saved_code(gate_saved, saved_format, r, c, cols), gate_scales[scale_index]);
      const float up = up_saved != NULL
                           ? coat_saved_value(saved_code(up_saved, saved_format, r, c, cols), up_scales[scale_index])
                           : 1.0f;
      const float value = coat_canonical_nan(
          coat_silu_mul(coat_silu(gate, coat_activation_sigmoid(activation, gate)), up,
                        smooth_scale ? smooth_scale[c] : 1.0f));
      y_t[c * rows + r] = coat_quantize_value(value, scale, y_format);
    }
  }
  return COAT_SUCCESS;
}
