/*
 * coat core: quantization statistics, what coat.report measures of a quantized tensor.
 *
 * One call takes a list of measures (coat_quantization_measure), one per measured tensor, and applies them in
 * list order: the result is that of `count` calls of one measure each, float64 additions in that order, also
 * where several measures add into the same sums (e.g. the q, k and v weights of one attention into one row).
 *
 * A measure: a tensor x (`dtype` elements) was quantized to FP8 codes q with fp32 scales, by a quantizer of
 * coat/quantize.h: per tensor (group_size 0, scales[0]) or in 1 x G groups along rows (scales[r*ngroups + c/G],
 * ngroups = ceil(cols / G)). The measured elements are `rows` x `cols`: measured row i is row
 * row_index[i] of q and of the scales (row i when row_index is NULL), and of x when x_indexed, else x holds
 * the measured rows themselves (row i of x). q and the scales have q_rows rows; a row_index entry outside
 * [0, q_rows) makes sums[1..6] NaN (that row is not read). x and q are strided matrices, element (r, c) at
 * r*row_stride + c*col_stride; the scales are contiguous. rows and cols are at least 1.
 *
 * Per measured element, with d = fp8_decode(q) * s (fp32 product, as coat_dequantize) and e = d - x (fp32):
 *     nonfinite   e is NaN or +-Inf (x or its FP8 copy is); such elements count in no other sum
 *     flushed     d == 0 and x != 0
 *     saturated   |x / s| >= FP8_MAX + half the format's top step (464 E4M3, 61440 E5M2; fp32 division)
 *     error_sq    (double)e * e
 *     value_sq    (double)x * x
 * The five are summed over a measure's elements by one fixed tree: leaves in measured order (row-major),
 * padded with zeros to a power of two of at least COAT_STATS_TILE, node = left + right in float64. Every
 * addend is >= 0 and the padding adds exact zeros, so the CPU and CUDA sums are equal bit for bit, and a
 * run gives the same bits every time.
 *
 * A measure's sums (7 float64, a device pointer for CUDA) accumulate, so that several recordings of one tensor
 * add up:
 *     sums[0] += rows * cols                          measured elements
 *     sums[1..5] += nonfinite, flushed, saturated, error_sq, value_sq
 *     sums[6] = max(sums[6], amax), NaN if either is NaN, where
 *        amax = amax_per_scale * max(scales[0 .. nscales))   when amax_per_scale > 0 (fp32 product: the whole
 *               tensor's amax from the scales its quantizer derived from it; NaN if a scale is NaN)
 *        amax = max |x| over the measured finite elements   when amax_per_scale == 0
 * Start sums at zeros. A call with an invalid measure changes no sums.
 */
#ifndef COAT_STATS_H
#define COAT_STATS_H

#include "coat/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Leaves per tile of the summation tree (see above); the CUDA entry point reduces one tile per block. */
#define COAT_STATS_TILE 1024
/** Values in sums. */
#define COAT_STATS_SUMS 7

/** One measured tensor of coat_quantization_sums_* (see above); pointers to device memory for CUDA. */
typedef struct {
  const void* x;
  coat_dtype dtype;
  int64_t x_row_stride, x_col_stride;
  int x_indexed;             /**< x has q's rows (measured row i is read where q's is); 0: x holds the measured rows */
  const uint8_t* q;
  coat_fp8_format format;
  int64_t q_row_stride, q_col_stride;
  const float* scales;       /**< nscales values, contiguous */
  int64_t group_size;        /**< 16, 32, 64 or 128; 0: one per-tensor scale, scales[0] */
  int64_t nscales;
  float amax_per_scale;      /**< >= 0; 0: amax from x */
  int64_t q_rows;
  const int64_t* row_index;  /**< `rows` row indices of q, or NULL: q's rows 0 .. rows - 1 */
  int64_t rows, cols;        /**< measured */
  double* sums;              /**< COAT_STATS_SUMS float64, accumulated into */
} coat_quantization_measure;

/** Workspace of coat_quantization_sums_cuda for these (valid) measures, in float64 values: 6 per tile of each
 *  measure's elements, 6 per measure (its totals), and count + 1 counters. 0 when count is 0. */
int64_t coat_quantization_sums_workspace(const coat_quantization_measure* measures, int64_t count);

coat_status coat_quantization_sums_cpu(const coat_quantization_measure* measures, int64_t count);
/** As the CPU entry point; the measures array is host memory, the memory they point to device memory. workspace
 *  holds coat_quantization_sums_workspace(measures, count) float64 values of device memory (its contents on
 *  entry do not matter). Enqueues one cudaMemsetAsync and one kernel launch for up to 24 measures, more launches
 *  in list order for more, and never synchronizes. */
coat_status coat_quantization_sums_cuda(const coat_quantization_measure* measures, int64_t count,
                                        double* workspace, coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_STATS_H */
