/* C99 CPU implementation of coat/quantize.h (FP8, FP4 and FP6): the same element-level steps as csrc/cuda/quantize.cu. */
#include "coat/quantize.h"

#include <stddef.h>
#include <string.h>

#include "coat/detail/quantize_math.h"

static int coat_valid_matrix(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && row_stride >= cols && (x != NULL || rows * cols == 0);
}

static const void* coat_row(const void* x, coat_dtype dtype, int64_t row, int64_t row_stride) {
  const size_t element_size = dtype == COAT_FLOAT32 ? 4 : 2;
  return (const char*)x + (size_t)row * (size_t)row_stride * element_size;
}

static float coat_row_amax(const void* row, coat_dtype dtype, int64_t begin, int64_t end) {
  float amax = 0.0f;
  for (int64_t c = begin; c < end; ++c) amax = coat_amax_step(amax, coat_load_f32(row, dtype, c));
  return amax;
}

/* Codes of row r, columns [begin, end), to q[r * q_stride + c] and q_t[c * q_t_stride + r] (either may be
 * NULL). */
static void coat_quantize_run(const void* row, coat_dtype dtype, int64_t r, int64_t begin, int64_t end, float scale,
                              coat_fp8_format format, uint8_t* q, int64_t q_stride, uint8_t* q_t,
                              int64_t q_t_stride) {
  for (int64_t c = begin; c < end; ++c) {
    const uint8_t code = coat_quantize_value(coat_load_f32(row, dtype, c), scale, format);
    if (q != NULL) q[r * q_stride + c] = code;
    if (q_t != NULL) q_t[c * q_t_stride + r] = code;
  }
}

coat_status coat_quantize_group_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t group_size, coat_fp8_format format,
                                    uint8_t* q, float* scales, uint8_t* q_t) {
  if (!coat_valid_matrix(x, rows, cols, row_stride) || !coat_is_valid_group_size(group_size))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t ngroups = coat_ceil_div(cols, group_size);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = coat_row(x, dtype, r, row_stride);
    for (int64_t g = 0; g < ngroups; ++g) {
      const int64_t begin = g * group_size;
      const int64_t end = begin + group_size < cols ? begin + group_size : cols;
      const float scale = coat_scale_from_amax(coat_row_amax(row, dtype, begin, end), format);
      scales[r * ngroups + g] = scale;
      coat_quantize_run(row, dtype, r, begin, end, scale, format, q, cols, q_t, rows);
    }
  }
  return COAT_SUCCESS;
}

coat_status coat_group_amax_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                int64_t row_stride, int64_t group_size, float* group_amax) {
  if (!coat_valid_matrix(x, rows, cols, row_stride) || !coat_is_valid_group_size(group_size))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t ngroups = coat_ceil_div(cols, group_size);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = coat_row(x, dtype, r, row_stride);
    for (int64_t g = 0; g < ngroups; ++g) {
      const int64_t begin = g * group_size;
      const int64_t end = begin + group_size < cols ? begin + group_size : cols;
      group_amax[r * ngroups + g] = coat_row_amax(row, dtype, begin, end);
    }
  }
  return COAT_SUCCESS;
}

coat_status coat_reduce_amax_cpu(const float* group_amax, int64_t count, float* amax) {
  if (count < 0 || amax == NULL || (group_amax == NULL && count > 0)) return COAT_ERROR_INVALID_ARGUMENT;
  float result = 0.0f;
  for (int64_t i = 0; i < count; ++i) result = fmaxf(result, group_amax[i]);
  *amax = result;
  return COAT_SUCCESS;
}

coat_status coat_tensor_amax_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                 int64_t row_stride, float* amax) {
  if (!coat_valid_matrix(x, rows, cols, row_stride) || amax == NULL) return COAT_ERROR_INVALID_ARGUMENT;
  float result = *amax;
#pragma omp parallel for schedule(static) reduction(max : result)
  for (int64_t r = 0; r < rows; ++r) result = fmaxf(result, coat_row_amax(coat_row(x, dtype, r, row_stride), dtype, 0, cols));
  *amax = result;
  return COAT_SUCCESS;
}

coat_status coat_quantize_tensor_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                     int64_t row_stride, const float* amax, coat_fp8_format format,
                                     uint8_t* q, int64_t q_stride, float* scale, uint8_t* q_t,
                                     int64_t q_t_stride) {
  if (!coat_valid_matrix(x, rows, cols, row_stride) || amax == NULL || scale == NULL ||
      (q != NULL && q_stride < cols) || (q_t != NULL && q_t_stride < rows))
    return COAT_ERROR_INVALID_ARGUMENT;
  const float tensor_scale = coat_scale_from_amax(*amax, format);
  *scale = tensor_scale;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    coat_quantize_run(coat_row(x, dtype, r, row_stride), dtype, r, 0, cols, tensor_scale, format, q, q_stride, q_t,
                      q_t_stride);
  return COAT_SUCCESS;
}

coat_status coat_dequantize_cpu(const uint8_t* q, coat_fp8_format format, int64_t rows, int64_t cols,
                                const float* scales, int64_t group_size, void* out, coat_dtype out_dtype) {
  if (!coat_valid_matrix(q, rows, cols, cols) || (scales == NULL && rows * cols > 0) ||
      (group_size != 0 && !coat_is_valid_group_size(group_size)) ||
      (out_dtype != COAT_FLOAT32 && out_dtype != COAT_BFLOAT16))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t ngroups = group_size ? coat_ceil_div(cols, group_size) : 0;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = group_size ? scales[r * ngroups + c / group_size] : scales[0];
      coat_store_as(out, out_dtype, r * cols + c, coat_dequantize_value(coat_fp8_to_f32(q[r * cols + c], format), scale));
    }
  }
  return COAT_SUCCESS;
}

/* The two block-scaled minifloat formats of quantize.h, FP4 (E2M1) and FP6 (E2M3): their mantissa bits and how
 * their codes pack into a row. */
static int64_t coat_e2m_row_bytes(uint32_t mantissa_bits, int64_t cols) {
  return mantissa_bits == 1u ? coat_ceil_div(cols, 2) : coat_fp6_row_bytes(cols);
}

static uint8_t coat_e2m_code_at(uint32_t mantissa_bits, const uint8_t* row_codes, int64_t c) {
  return mantissa_bits == 1u ? coat_fp4_code_at(row_codes, c) : coat_fp6_code_at(row_codes, c);
}

static uint8_t coat_e2m_to_e4m3(uint32_t mantissa_bits, uint8_t code) {
  return mantissa_bits == 1u ? coat_e2m1_to_e4m3(code) : coat_e2m3_to_e4m3(code);
}

static float coat_e2m_to_f32(uint32_t mantissa_bits, uint8_t code) {
  return mantissa_bits == 1u ? coat_e2m1_to_f32(code) : coat_e2m3_to_f32(code);
}

static coat_status coat_quantize_e2m_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                         int64_t row_stride, int64_t block_size, uint32_t mantissa_bits,
                                         uint8_t* codes, float* scales) {
  if (!coat_valid_matrix(x, rows, cols, row_stride) || !coat_is_valid_group_size(block_size))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t nblocks = coat_ceil_div(cols, block_size);
  const int64_t row_bytes = coat_e2m_row_bytes(mantissa_bits, cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = coat_row(x, dtype, r, row_stride);
    uint8_t* row_codes = codes + r * row_bytes;
    memset(row_codes, 0, (size_t)row_bytes); /* the codes are ORed in; the bits past the last stay 0 */
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t begin = b * block_size;
      const int64_t end = begin + block_size < cols ? begin + block_size : cols;
      uint32_t amax_bits = 0;
      for (int64_t c = begin; c < end; ++c) amax_bits = coat_max_bits(amax_bits, coat_magnitude_bits(coat_load_f32(row, dtype, c)));
      const float scale = coat_e2m_scale_from_amax_bits(amax_bits, mantissa_bits);
      const float reciprocal = 1.0f / scale;
      scales[r * nblocks + b] = scale;
      for (int64_t c = begin; c < end; ++c) {
        const uint8_t code = coat_quantize_e2m_scaled(coat_load_f32(row, dtype, c), reciprocal, mantissa_bits);
        if (mantissa_bits == 1u) {
          row_codes[c >> 1] |= (uint8_t)(code << (4 * (c & 1)));
        } else {
          coat_fp6_put_code(row_codes, c, code);
        }
      }
    }
  }
  return COAT_SUCCESS;
}

static int coat_valid_codes(const uint8_t* codes, int64_t rows, int64_t cols) {
  return rows >= 0 && cols >= 0 && (codes != NULL || rows * cols == 0);
}

static coat_status coat_dequantize_e2m_cpu(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                           int64_t block_size, uint32_t mantissa_bits, void* out,
                                           coat_dtype out_dtype) {
  if (!coat_valid_codes(codes, rows, cols) || (scales == NULL && rows * cols > 0) ||
      !coat_is_valid_group_size(block_size) || (out_dtype != COAT_FLOAT32 && out_dtype != COAT_BFLOAT16))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t nblocks = coat_ceil_div(cols, block_size);
  const int64_t row_bytes = coat_e2m_row_bytes(mantissa_bits, cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float value = coat_e2m_to_f32(mantissa_bits, coat_e2m_code_at(mantissa_bits, codes + r * row_bytes, c));
      coat_store_as(out, out_dtype, r * cols + c, coat_dequantize_value(value, scales[r * nblocks + c / block_size]));
    }
  }
  return COAT_SUCCESS;
}

static coat_status coat_e2m_to_e4m3_cpu(const uint8_t* codes, int64_t rows, int64_t cols, uint32_t mantissa_bits,
                                        uint8_t* q) {
  if (!coat_valid_codes(codes, rows, cols) || (q == NULL && rows * cols > 0)) return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t row_bytes = coat_e2m_row_bytes(mantissa_bits, cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] = coat_e2m_to_e4m3(mantissa_bits, coat_e2m_code_at(mantissa_bits, codes + r * row_bytes, c));
  return COAT_SUCCESS;
}

coat_status coat_quantize_fp4_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  int64_t block_size, uint8_t* codes, float* scales) {
  return coat_quantize_e2m_cpu(x, dtype, rows, cols, row_stride, block_size, 1u, codes, scales);
}

coat_status coat_quantize_fp6_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  int64_t block_size, uint8_t* codes, float* scales) {
  return coat_quantize_e2m_cpu(x, dtype, rows, cols, row_stride, block_size, 3u, codes, scales);
}

coat_status coat_dequantize_fp4_cpu(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                    int64_t block_size, void* out, coat_dtype out_dtype) {
  return coat_dequantize_e2m_cpu(codes, rows, cols, scales, block_size, 1u, out, out_dtype);
}

coat_status coat_dequantize_fp6_cpu(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                    int64_t block_size, void* out, coat_dtype out_dtype) {
  return coat_dequantize_e2m_cpu(codes, rows, cols, scales, block_size, 3u, out, out_dtype);
}

coat_status coat_fp4_to_e4m3_cpu(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q) {
  return coat_e2m_to_e4m3_cpu(codes, rows, cols, 1u, q);
}

coat_status coat_fp6_to_e4m3_cpu(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q) {
  return coat_e2m_to_e4m3_cpu(codes, rows, cols, 3u, q);
}
