// Shared by the CUDA implementation of coat/adamw.h: adamw_step.cu (fp8_adamw_step), adamw_expanded.cu
// (quantize_expanded, dequantize_expanded) and adamw_moment_stats.cu (moment_counts, moment_stats). A warp takes a
// tile of 512 consecutive columns of one row, 16 consecutive elements per lane (LaneSpan); every block builds the
// C core's tables in shared memory (build_tables); a group's range is a butterfly of shuffles over its lanes
// (merge_from); the host plans a tensor's tiles (make_plan).
//
// Everything here is in an anonymous namespace, as it was in one file: each .cu that includes it has its own
// copy, and nothing of it is visible outside that file.
#pragma once

#include "coat/adamw.h"

#include <cuda_runtime.h>

#include "adamw_fast_math.cuh"  // max_keeping_nan (merge), and the step kernel's hardware arithmetic
#include "coat/detail/adamw_math.h"

namespace {

constexpr int kWarpSize = 32;
constexpr int kValuesPerLane = 16;
constexpr int64_t kTileColumns = kWarpSize * kValuesPerLane;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__constant__ coat_log2_entry kLog2Reduction[32] = COAT_LOG2_REDUCTION_TABLE;
__constant__ float kLog2Bf16[128] = COAT_LOG2_BF16_TABLE;

// Where a tensor's tiles go: rows x tiles_per_row tiles, tile -> row by a multiply-high (the divisor is fixed
// per tensor; Granlund-Montgomery with n < 2^31), and the first tile a warp takes.
struct TensorPlan {
  uint32_t tiles;
  uint32_t tiles_per_row;
  uint32_t magic;  // row = (umulhi(tile, magic) + tile) >> shift
  uint32_t shift;
  uint32_t phase;  // (tiles of the launch's earlier tensors) % (warps of the grid): tile t goes to warp (phase + t) % warps
  uint32_t vector; // 16-byte aligned param, grad and codes, cols % 16 == 0: whole tiles load and store by vectors
  int64_t groups_per_row;  // ceil(cols / G), for the step kernel
};

__device__ __forceinline__ int lane_id() { return threadIdx.x % kWarpSize; }

// Every block builds the C core's tables; the caller may read them after this returns.
__device__ __forceinline__ void build_tables(coat_adamw_tables* t) {
  if (threadIdx.x < 32) t->reduction[threadIdx.x] = kLog2Reduction[threadIdx.x];
  if (threadIdx.x < 128) t->bf16_log2[threadIdx.x] = kLog2Bf16[threadIdx.x];
  __syncthreads();
  for (int i = threadIdx.x; i < 512; i += blockDim.x) coat_adamw_tables_fill_fp8(t, i);
  __syncthreads();
}

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(kFullMask, v, mask); }

// ------------------------------------------------------------------------------------------ lane data

// A lane's 16 elements: row, first column, index of the first element, how many exist (0..16).
struct LaneSpan {
  int64_t row;
  int64_t column;
  int64_t first;  // row * cols + column
  int count;
};

__device__ __forceinline__ LaneSpan lane_span(uint32_t tile, const TensorPlan& plan, int64_t cols) {
  const uint32_t row = (__umulhi(tile, plan.magic) + tile) >> plan.shift;
  LaneSpan span;
  span.row = row;
  span.column = static_cast<int64_t>(tile - row * plan.tiles_per_row) * kTileColumns + lane_id() * kValuesPerLane;
  span.first = span.row * cols + span.column;
  const int64_t left = cols - span.column;
  span.count = left <= 0 ? 0 : (left < kValuesPerLane ? static_cast<int>(left) : kValuesPerLane);
  return span;
}

// ------------------------------------------------------------------------------------------ group ranges

// amax with a NaN kept (a NaN element then shows as a non-finite amax), amin.
__device__ __forceinline__ coat_range merge(coat_range a, coat_range b) {
  a.amax = max_keeping_nan(a.amax, b.amax);
  a.amin = fminf(a.amin, b.amin);
  return a;
}

__device__ __forceinline__ coat_range merge_from(coat_range r, int mask) {
  coat_range other;
  other.amax = shfl_xor(r.amax, mask);
  other.amin = shfl_xor(r.amin, mask);
  return merge(r, other);
}

// ---------------------------------------------------------------------------------------------- host

// The plan of a rows x cols tensor, or false when its tiles do not fit the 32-bit tile arithmetic (2^31
// tiles of 512 columns, 1.1e12 elements: more than any GPU holds).
bool make_plan(int64_t rows, int64_t cols, TensorPlan* plan) {
  const int64_t tiles_per_row = coat_ceil_div(cols, kTileColumns);
  const int64_t tiles = rows * tiles_per_row;
  if (tiles >= (int64_t{1} << 31)) return false;
  plan->tiles = static_cast<uint32_t>(tiles);
  plan->tiles_per_row = static_cast<uint32_t>(tiles_per_row);
  // row = floor(tile / d) = (umulhi(tile, magic) + tile) >> shift for tile < 2^31, with shift = ceil(log2 d)
  // and magic = floor(2^32 * (2^shift - d) / d) + 1 (Granlund and Montgomery, 1994).
  const uint64_t d = tiles_per_row > 0 ? static_cast<uint64_t>(tiles_per_row) : 1u;
  uint32_t shift = 0;
  while ((uint64_t{1} << shift) < d) ++shift;
  plan->shift = shift;
  plan->magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  plan->phase = 0;
  plan->vector = 0;
  plan->groups_per_row = 0;
  return true;
}

// cudaPeekAtLastError leaves the error in place for the caller to report (coat/common.h).
coat_status launch_status() { return cudaPeekAtLastError() == cudaSuccess ? COAT_SUCCESS : COAT_ERROR_CUDA; }

}  // namespace
