/*
 * CUDA implementation of coat/stats.h. tile_sums_kernel computes the leaves of coat/detail/stats_math.h and
 * sums each tile of COAT_STATS_TILE of them by the header's tree: four consecutive leaves per thread, then
 * xor shuffles, whose partner sums are the tree's nodes (left + right and right + left are the same float64),
 * then the eight warps' totals in order. finish_kernel, one block, sums the tiles' totals by the same tree
 * and adds the result into sums. Neither uses atomics, so every run gives the same bits as the C core.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/detail/stats_math.h"
#include "coat/stats.h"
#include "launch.cuh"

namespace coat {
namespace device {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLeavesPerThread = COAT_STATS_TILE / kThreads;
static_assert(kLeavesPerThread == 4, "tile_sums_kernel adds a thread's leaves as (l0 + l1) + (l2 + l3)");
/** Workspace values per tile: the COAT_STATS_LEAF sums, then the tile's amax. */
constexpr int kTileValues = COAT_STATS_LEAF + 1;

struct Measured {
  const void* x;
  coat_dtype dtype;
  int64_t x_row_stride, x_col_stride;
  int x_indexed;
  const uint8_t* q;
  coat_fp8_format format;
  int64_t q_row_stride, q_col_stride;
  const float* scales;
  int64_t group_size, nscales;
  float amax_per_scale;
  int64_t q_rows;
  const int64_t* row_index;
  int64_t rows, cols;
};

__device__ void measured_leaf(const Measured& m, int64_t i, double* leaf, float* amax) {
  for (int k = 0; k < COAT_STATS_LEAF; ++k) leaf[k] = 0.0;
  if (i >= m.rows * m.cols) return;
  const int64_t r = i / m.cols, c = i % m.cols;
  const int64_t row = m.row_index != nullptr ? m.row_index[r] : r;
  if (row < 0 || row >= m.q_rows) return coat_unreadable_leaf(leaf, amax);
  const float x = coat_load_f32(m.x, m.dtype, (m.x_indexed ? row : r) * m.x_row_stride + c * m.x_col_stride);
  const float scale = m.group_size == 0 ? m.scales[0]
                                        : m.scales[row * coat_ceil_div(m.cols, m.group_size) + c / m.group_size];
  coat_quantization_leaf(x, m.q[row * m.q_row_stride + c * m.q_col_stride], scale, m.format, leaf, amax);
}

/** Sums `node` over the block by the tree (xor shuffles, then the warps' totals pairwise) and the max of amax;
 *  thread 0 returns them. */
__device__ void block_tree(double* node, float* amax, double (*warp_nodes)[COAT_STATS_LEAF], float* warp_amax) {
  for (int offset = 1; offset < 32; offset <<= 1) {
    for (int k = 0; k < COAT_STATS_LEAF; ++k) node[k] = node[k] + __shfl_xor_sync(0xFFFFFFFFu, node[k], offset);
    *amax = coat_max_nan(*amax, __shfl_xor_sync(0xFFFFFFFFu, *amax, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    for (int k = 0; k < COAT_STATS_LEAF; ++k) warp_nodes[warp][k] = node[k];
    warp_amax[warp] = *amax;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    static_assert(kWarps == 8, "the warps' totals are added as a tree of eight");
    for (int k = 0; k < COAT_STATS_LEAF; ++k) {
      const double (*w)[COAT_STATS_LEAF] = warp_nodes;
      node[k] = ((w[0][k] + w[1][k]) + (w[2][k] + w[3][k])) + ((w[4][k] + w[5][k]) + (w[6][k] + w[7][k]));
    }
    for (int w = 0; w < kWarps; ++w) *amax = coat_max_nan(*amax, warp_amax[w]);
  }
  __syncthreads();
}

__global__ void tile_sums_kernel(Measured m, int64_t tiles, double* workspace) {
  __shared__ double warp_nodes[kWarps][COAT_STATS_LEAF];
  __shared__ float warp_amax[kWarps];
  const int64_t scales_per_tile = coat_ceil_div(m.nscales, tiles);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    double leaves[kLeavesPerThread][COAT_STATS_LEAF];
    float amax = 0.0f;
    const int64_t first = tile * COAT_STATS_TILE + threadIdx.x * kLeavesPerThread;
    for (int j = 0; j < kLeavesPerThread; ++j) measured_leaf(m, first + j, leaves[j], &amax);
    double node[COAT_STATS_LEAF];
    for (int k = 0; k < COAT_STATS_LEAF; ++k)
      node[k] = (leaves[0][k] + leaves[1][k]) + (leaves[2][k] + leaves[3][k]);
    if (m.amax_per_scale > 0.0f) {  // this tile's share of the scales instead, NaN kept for an unreadable row
      amax = amax != amax ? amax : 0.0f;
      const int64_t end = min(m.nscales, (tile + 1) * scales_per_tile);
      for (int64_t j = tile * scales_per_tile + threadIdx.x; j < end; j += kThreads)
        amax = coat_max_nan(amax, m.scales[j]);
    }
    block_tree(node, &amax, warp_nodes, warp_amax);
    if (threadIdx.x == 0) {
      for (int k = 0; k < COAT_STATS_LEAF; ++k) workspace[tile * kTileValues + k] = node[k];
      workspace[tile * kTileValues + COAT_STATS_LEAF] = amax;
    }
  }
}

__global__ void finish_kernel(const double* workspace, int64_t tiles, int64_t n, float amax_per_scale, double* sums) {
  __shared__ double warp_nodes[kWarps][COAT_STATS_LEAF];
  __shared__ float warp_amax[kWarps];
  const int64_t padded = int64_t{1} << coat_ceil_log2(tiles);
  double node[COAT_STATS_LEAF] = {0.0, 0.0, 0.0, 0.0, 0.0};
  float amax = 0.0f;
  if (padded <= kThreads) {  // one tile (or padding) per thread: the tree over kThreads adds exact zeros above it
    if (threadIdx.x < tiles) {
      for (int k = 0; k < COAT_STATS_LEAF; ++k) node[k] = workspace[threadIdx.x * kTileValues + k];
      amax = static_cast<float>(workspace[threadIdx.x * kTileValues + COAT_STATS_LEAF]);
    }
  } else {  // a power-of-two run of consecutive tiles per thread, summed by the tree in the thread
    const int64_t run = padded / kThreads;
    const int levels = coat_ceil_log2(run);
    double stack[COAT_STATS_LEAF][40];
    for (int64_t j = 0; j < run; ++j) {
      const int64_t tile = threadIdx.x * run + j;
      for (int k = 0; k < COAT_STATS_LEAF; ++k)
        coat_pairwise_push(stack[k], j, tile < tiles ? workspace[tile * kTileValues + k] : 0.0);
      if (tile < tiles) amax = coat_max_nan(amax, static_cast<float>(workspace[tile * kTileValues + COAT_STATS_LEAF]));
    }
    for (int k = 0; k < COAT_STATS_LEAF; ++k) node[k] = stack[k][levels];
  }
  block_tree(node, &amax, warp_nodes, warp_amax);
  if (threadIdx.x == 0) {
    if (amax_per_scale > 0.0f) amax = coat_max_nan(0.0f, amax * amax_per_scale);
    sums[0] += static_cast<double>(n);
    for (int k = 0; k < COAT_STATS_LEAF; ++k) sums[1 + k] += node[k];
    sums[6] = coat_max_nan(static_cast<float>(sums[6]), amax);
  }
}

}  // namespace
}  // namespace device
}  // namespace coat

using namespace coat::device;

extern "C" coat_status coat_quantization_sums_cuda(const void* x, coat_dtype dtype, int64_t x_row_stride,
                                                   int64_t x_col_stride, int x_indexed, const uint8_t* q,
                                                   coat_fp8_format format, int64_t q_row_stride, int64_t q_col_stride,
                                                   const float* scales, int64_t group_size, int64_t nscales,
                                                   float amax_per_scale, int64_t q_rows, const int64_t* row_index,
                                                   int64_t rows,
                                                   int64_t cols, double* sums, double* workspace,
                                                   coat_cuda_stream stream) {
  if (rows < 1 || cols < 1 || q_rows < 1 || x == nullptr || q == nullptr || scales == nullptr || sums == nullptr ||
      workspace == nullptr || (group_size != 0 && !coat_is_valid_group_size(group_size)) || nscales < 1 ||
      !(amax_per_scale >= 0.0f))
    return COAT_ERROR_INVALID_ARGUMENT;
  const Measured m{x,      dtype,        x_row_stride, x_col_stride, x_indexed, q,         format, q_row_stride,
                   q_col_stride, scales, group_size, nscales,      amax_per_scale, q_rows, row_index, rows, cols};
  const int64_t tiles = coat_ceil_div(rows * cols, COAT_STATS_TILE);
  cudaStream_t s = as_cuda_stream(stream);
  tile_sums_kernel<<<clamp_grid(tiles, kMaxGridX), kThreads, 0, s>>>(m, tiles, workspace);
  finish_kernel<<<1, kThreads, 0, s>>>(workspace, tiles, rows * cols, amax_per_scale, sums);
  return launch_status();
}
