// CUDA implementation of coat/adamw.h's quantize_expanded and dequantize_expanded: the conversions between fp32 and
// an FP8 optimizer state. They run the C core's element functions (coat/detail/adamw_math.h) and agree with it bit
// for bit. adamw.cuh holds what they share with adamw_step.cu and adamw_moment_stats.cu.
#include "adamw.cuh"

namespace {

// ------------------------------------------------------------------------------ quantize, dequantize

// One warp per 512-column tile, each lane deriving its own group's quantities (conversion kernels, not the
// optimizer's hot path), with the C core's general element functions.
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_expanded_kernel(const float* x, int64_t cols, int64_t row_stride, TensorPlan plan, int group_shift,
                             coat_fp8_format format, int expand, uint8_t* codes, uint16_t* meta) {
  __shared__ coat_adamw_tables tables;
  build_tables(&tables);
  const uint32_t tile = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= plan.tiles) return;
  const LaneSpan span = lane_span(tile, plan, cols);
  float values[kValuesPerLane];
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) values[i] = i < span.count ? x[span.row * row_stride + span.column + i] : 0.0f;
  coat_range range = coat_range_empty();
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) range = coat_range_add(range, values[i]);
#pragma unroll
  for (int offset = 1; offset < 128 / kValuesPerLane; offset *= 2)
    if (offset < (1 << group_shift) / kValuesPerLane) range = merge_from(range, offset);
  if (span.count == 0) return;
  coat_meta m;
  const coat_encoder e = coat_encoder_of_range(range, format, expand, &tables, &m);
  const int64_t groups_per_row = (cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  if ((lane_id() & ((1 << group_shift) / kValuesPerLane - 1)) == 0)
    coat_meta_store(m, meta + (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES);
  const coat_fp8_log_format f = coat_fp8_log_format_of(format);
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) codes[span.first + i] = coat_encode(values[i], &e, &f, format, &tables);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_expanded_kernel(const uint8_t* codes, coat_fp8_format format, const uint16_t* meta, int64_t cols,
                               TensorPlan plan, int group_shift, float* out) {
  __shared__ coat_adamw_tables tables;
  build_tables(&tables);
  const uint32_t tile = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= plan.tiles) return;
  const LaneSpan span = lane_span(tile, plan, cols);
  if (span.count == 0) return;
  const int64_t groups_per_row = (cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  const coat_decoder d = coat_decoder_make(
      coat_meta_load(meta + (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES), format,
      &tables);
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) out[span.first + i] = coat_decode(codes[span.first + i], &d, format, &tables);
}

// ---------------------------------------------------------------------------------------------- host

// Blocks for `tiles` warps, or 0 when the grid would exceed CUDA's limit.
unsigned blocks_for(int64_t tiles) {
  const int64_t blocks = coat_ceil_div(tiles, kWarpsPerBlock);
  return blocks <= 0x7FFFFFFF ? static_cast<unsigned>(blocks) : 0u;
}

}  // namespace

extern "C" coat_status coat_quantize_expanded_cuda(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                                                   int64_t group_size, coat_fp8_format format, int expand,
                                                   uint8_t* codes, uint16_t* meta, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || row_stride < cols || !coat_is_valid_group_size(group_size) ||
      !coat_is_valid_format(format) || (rows * cols > 0 && (x == nullptr || codes == nullptr || meta == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  TensorPlan plan;
  if (!make_plan(rows, cols, &plan)) return COAT_ERROR_INVALID_ARGUMENT;
  if (plan.tiles == 0) return COAT_SUCCESS;
  const unsigned blocks = blocks_for(plan.tiles);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  quantize_expanded_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(x, cols, row_stride, plan, __builtin_ctzll(group_size),
                                                                      format, expand, codes, meta);
  return launch_status();
}

extern "C" coat_status coat_dequantize_expanded_cuda(const uint8_t* codes, coat_fp8_format format,
                                                     const uint16_t* meta, int64_t rows, int64_t cols,
                                                     int64_t group_size, float* out, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || !coat_is_valid_group_size(group_size) || !coat_is_valid_format(format) ||
      (rows * cols > 0 && (codes == nullptr || meta == nullptr || out == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  TensorPlan plan;
  if (!make_plan(rows, cols, &plan)) return COAT_ERROR_INVALID_ARGUMENT;
  if (plan.tiles == 0) return COAT_SUCCESS;
  const unsigned blocks = blocks_for(plan.tiles);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  dequantize_expanded_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(codes, format, meta, cols, plan,
                                                                        __builtin_ctzll(group_size), out);
  return launch_status();
}
