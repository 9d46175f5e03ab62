// CUDA implementation of coat/adamw.h. Every value comes from the element-level steps of
// coat/detail/adamw_math.h, as in the C core, so both agree bit for bit.
//
// Work split: one warp per tile of 128 consecutive columns of one row, 4 consecutive elements per lane.
// Since 128 is a multiple of every group size, a group of G columns is G/4 adjacent lanes of one warp, and
// its statistics (amax, amin) are a butterfly of __shfl_xor_sync over log2(G/4) steps: no shared memory, no
// __syncthreads, the same code for G = 16..128. Appendix G.4 instead gives each group a 128-thread block
// with one element per thread; a warp per 128 columns keeps 4 independent elements per thread in flight
// (memory-level parallelism), reduces in at most 5 shuffles instead of shuffles plus a shared-memory stage
// and a barrier, and leaves no block idle on short rows (cols < 128) beyond the unused lanes of one warp.
#include "coat/adamw.h"

#include <cuda_runtime.h>

#include "coat/detail/adamw_math.h"

namespace {

constexpr int kWarpSize = 32;
constexpr int kValuesPerLane = 4;
constexpr int64_t kTileColumns = kWarpSize * kValuesPerLane;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
constexpr int kTensorsPerLaunch = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// The tensors of one step launch. They travel by value in the kernel's parameter space (__grid_constant__:
// read in place), so a launch needs no device allocation, no copy and no synchronisation.
struct StepLaunch {
  coat_adamw_options options;
  coat_adamw_tensor tensors[kTensorsPerLaunch];
  int64_t first_tile[kTensorsPerLaunch + 1];  // running sum of the tensors' tiles; [count] is the total
  int count;
};
// 4 KiB is the parameter limit of every CUDA version and architecture.
static_assert(sizeof(StepLaunch) <= 4096, "step launch parameters exceed 4 KiB");

// Where a lane's (up to) 4 elements lie in a rows x cols matrix cut into 128-column tiles.
struct LaneSpan {
  int64_t row;
  int64_t column;  // of the lane's first element
  int count;       // 0 when the lane is past the end of its row
};

__device__ __forceinline__ int lane_id() { return threadIdx.x % kWarpSize; }

__device__ __forceinline__ int64_t warp_tile() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
}

// a / b for a >= 0, b > 0: a 32-bit division when both fit (the 64-bit one is a ~70-instruction subroutine).
__device__ __forceinline__ int64_t quotient(int64_t a, int64_t b) {
  return ((a | b) >> 32) == 0 ? static_cast<int64_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b)) : a / b;
}

__device__ __forceinline__ LaneSpan lane_span(int64_t tile, int64_t cols) {
  const int64_t tiles_per_row = coat_ceil_div(cols, kTileColumns);
  LaneSpan span;
  span.row = quotient(tile, tiles_per_row);
  span.column = (tile - span.row * tiles_per_row) * kTileColumns + lane_id() * kValuesPerLane;
  const int64_t left = cols - span.column;
  span.count = left <= 0 ? 0 : (left < kValuesPerLane ? static_cast<int>(left) : kValuesPerLane);
  return span;
}

// G is a power of two: log2(G), so that group arithmetic is shifts.
__device__ __forceinline__ int group_shift(int64_t group_size) { return __ffsll(group_size) - 1; }

__device__ __forceinline__ int64_t meta_offset(const LaneSpan& span, int64_t cols, int shift) {
  const int64_t groups_per_row = (cols + (int64_t{1} << shift) - 1) >> shift;
  return (span.row * groups_per_row + (span.column >> shift)) * COAT_META_VALUES;
}

// The range merged over the G/4 lanes of each group (aligned runs of lanes); every lane gets its group's.
__device__ __forceinline__ coat_range group_range(coat_range range, int shift) {
  for (int offset = (1 << shift) / kValuesPerLane / 2; offset > 0; offset /= 2) {
    coat_range other;
    other.amax = __shfl_xor_sync(kFullMask, range.amax, offset);
    other.amin = __shfl_xor_sync(kFullMask, range.amin, offset);
    range = coat_range_merge(range, other);
  }
  return range;
}

// Quantizes the lane's values with their group's fresh meta, which the group's first lane stores. Every lane
// of the warp must call it (the shuffles), also those with no values.
__device__ __forceinline__ void encode_lane(const float (&values)[kValuesPerLane], const LaneSpan& span,
                                            int64_t cols, int shift, coat_fp8_format format, int expand,
                                            uint8_t* codes, uint16_t* meta) {
  coat_range range = coat_range_empty();
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) range = coat_range_add(range, values[i]);
  const coat_expansion e = coat_expansion_of_range(group_range(range, shift), format, expand);
  if (span.count == 0) return;
  if (lane_id() % ((1 << shift) / kValuesPerLane) == 0) coat_expansion_store(&e, meta + meta_offset(span, cols, shift));
  uint8_t* out = codes + span.row * cols + span.column;
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) out[i] = coat_expanded_encode(values[i], &e, format);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    fp8_adamw_step_kernel(const __grid_constant__ StepLaunch launch) {
  const coat_adamw_options& options = launch.options;
  const int64_t tile = warp_tile();
  if (tile >= launch.first_tile[launch.count]) return;  // the whole warp leaves together
  int index = 0;  // the last tensor whose first tile is <= tile
  for (int step = kTensorsPerLaunch / 2; step > 0; step /= 2)
    if (index + step < launch.count && launch.first_tile[index + step] <= tile) index += step;
  const coat_adamw_tensor& t = launch.tensors[index];
  const LaneSpan span = lane_span(tile - launch.first_tile[index], t.cols);
  const int shift = group_shift(options.group_size);

  float m[kValuesPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
  float v[kValuesPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (span.count > 0) {
    const int64_t offset = meta_offset(span, t.cols, shift);
    const coat_expansion m_old = coat_expansion_load(t.exp_avg_meta + offset);
    const coat_expansion v_old = coat_expansion_load(t.exp_avg_sq_meta + offset);
    const int64_t first = span.row * t.cols + span.column;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) {
      if (i < span.count) {
        const int64_t element = first + i;
        m[i] = coat_expanded_decode(t.exp_avg[element], &m_old, t.exp_avg_format);
        v[i] = coat_expanded_decode(t.exp_avg_sq[element], &v_old, t.exp_avg_sq_format);
        const float p = coat_adamw_update(coat_load_f32(t.param, t.param_dtype, element),
                                          coat_load_f32(t.grad, t.grad_dtype, element), &m[i], &v[i], &options);
        coat_store_param(t.param, t.param_dtype, element, p);
      }
    }
  }
  // Each lane used its group's old meta before the shuffles inside encode_lane, so the new meta is stored
  // only after every lane of the group has read the old one.
  encode_lane(m, span, t.cols, shift, t.exp_avg_format, options.expand_exp_avg, t.exp_avg, t.exp_avg_meta);
  encode_lane(v, span, t.cols, shift, t.exp_avg_sq_format, options.expand_exp_avg_sq, t.exp_avg_sq,
              t.exp_avg_sq_meta);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_expanded_kernel(const float* x, int64_t cols, int64_t row_stride, int64_t tiles, int64_t group_size,
                             coat_fp8_format format, int expand, uint8_t* codes, uint16_t* meta) {
  const int64_t tile = warp_tile();
  if (tile >= tiles) return;
  const LaneSpan span = lane_span(tile, cols);
  float values[kValuesPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) values[i] = x[span.row * row_stride + span.column + i];
  encode_lane(values, span, cols, group_shift(group_size), format, expand, codes, meta);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_expanded_kernel(const uint8_t* codes, coat_fp8_format format, const uint16_t* meta, int64_t cols,
                               int64_t tiles, int64_t group_size, float* out) {
  const int64_t tile = warp_tile();
  if (tile >= tiles) return;
  const LaneSpan span = lane_span(tile, cols);
  if (span.count == 0) return;
  const coat_expansion e = coat_expansion_load(meta + meta_offset(span, cols, group_shift(group_size)));
  const int64_t first = span.row * cols + span.column;
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) out[first + i] = coat_expanded_decode(codes[first + i], &e, format);
}

// Blocks for `tiles` warps, or 0 when the grid would exceed CUDA's limit.
unsigned blocks_for(int64_t tiles) {
  const int64_t blocks = coat_ceil_div(tiles, kWarpsPerBlock);
  return blocks <= 0x7FFFFFFF ? static_cast<unsigned>(blocks) : 0u;
}

// cudaPeekAtLastError leaves the error in place for the caller to report (coat/common.h).
coat_status launch_status() { return cudaPeekAtLastError() == cudaSuccess ? COAT_SUCCESS : COAT_ERROR_CUDA; }

coat_status launch_step(const StepLaunch& launch, cudaStream_t stream) {
  const unsigned blocks = blocks_for(launch.first_tile[launch.count]);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  fp8_adamw_step_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(launch);
  return launch_status();
}

}  // namespace

extern "C" coat_status coat_fp8_adamw_step_cuda(const coat_adamw_tensor* tensors, int64_t count,
                                                const coat_adamw_options* options, coat_cuda_stream stream) {
  if (!coat_adamw_call_is_valid(tensors, count, options)) return COAT_ERROR_INVALID_ARGUMENT;
  StepLaunch launch;
  launch.options = *options;
  launch.count = 0;
  launch.first_tile[0] = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tiles = tensors[i].rows * coat_ceil_div(tensors[i].cols, kTileColumns);
    if (tiles == 0) continue;
    launch.tensors[launch.count] = tensors[i];
    launch.first_tile[launch.count + 1] = launch.first_tile[launch.count] + tiles;
    if (++launch.count == kTensorsPerLaunch) {
      const coat_status status = launch_step(launch, stream);
      if (status != COAT_SUCCESS) return status;
      launch.count = 0;
    }
  }
  return launch.count > 0 ? launch_step(launch, stream) : COAT_SUCCESS;
}

extern "C" coat_status coat_quantize_expanded_cuda(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                                                   int64_t group_size, coat_fp8_format format, int expand,
                                                   uint8_t* codes, uint16_t* meta, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || row_stride < cols || !coat_is_valid_group_size(group_size) ||
      !coat_is_valid_format(format) || (rows * cols > 0 && (x == nullptr || codes == nullptr || meta == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t tiles = rows * coat_ceil_div(cols, kTileColumns);
  if (tiles == 0) return COAT_SUCCESS;
  const unsigned blocks = blocks_for(tiles);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  quantize_expanded_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(x, cols, row_stride, tiles, group_size, format,
                                                                      expand, codes, meta);
  return launch_status();
}

extern "C" coat_status coat_dequantize_expanded_cuda(const uint8_t* codes, coat_fp8_format format,
                                                     const uint16_t* meta, int64_t rows, int64_t cols,
                                                     int64_t group_size, float* out, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || !coat_is_valid_group_size(group_size) || !coat_is_valid_format(format) ||
      (rows * cols > 0 && (codes == nullptr || meta == nullptr || out == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const int64_t tiles = rows * coat_ceil_div(cols, kTileColumns);
  if (tiles == 0) return COAT_SUCCESS;
  const unsigned blocks = blocks_for(tiles);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  dequantize_expanded_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(codes, format, meta, cols, tiles, group_size,
                                                                        out);
  return launch_status();
}
