/*
 * CUDA implementation of coat/stats.h: one kernel launch measures up to kMeasuresPerLaunch tensors. The launch
 * numbers the tiles of its measures one after the other, and each block takes tiles (grid-stride): it computes
 * their leaves (coat/detail/stats_math.h) and sums each tile of COAT_STATS_TILE of them by the header's tree:
 * four consecutive leaves per thread, then xor shuffles, whose partner sums are the tree's nodes (left + right
 * and right + left are the same float64), then the eight warps' totals in order; the tile's sums go to the
 * workspace. The block that completes a measure's last tile (it draws the last ticket of the measure's counter)
 * sums the measure's tiles by the same tree; the block that completes the launch's last measure adds the
 * measures' totals into their sums in list order (a thread per sums row: measures may share one). No atomics on
 * the sums, so every run gives the same bits as the C core, whatever the order in which blocks run, and the
 * measures finish in parallel.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "coat/detail/stats_math.h"
#include "coat/stats.h"
#include "launch.cuh"

namespace coat {
namespace device {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kLeavesPerThread = COAT_STATS_TILE / kThreads;
static_assert(kLeavesPerThread == 4, "the tile sums add a thread's leaves as (l0 + l1) + (l2 + l3)");
/** Workspace values per tile, and per measure for its totals: the COAT_STATS_LEAF sums, then the amax. */
constexpr int kTileValues = COAT_STATS_LEAF + 1;
/** rows * cols < 2^63: at most 2^53 tiles, so a thread of a measure's finish sums runs of at most 2^45 tiles. */
constexpr int kRunLevels = 63 - 10 - 8;
static_assert(COAT_STATS_TILE == 1 << 10 && kThreads == 1 << 8, "kRunLevels counts 2^10 leaves and 2^8 threads");

constexpr int kMeasuresPerLaunch = 24;
static_assert(kMeasuresPerLaunch <= kThreads, "add_totals gives each measure of a launch a thread");

/** The measures of one launch. They travel by value in the kernel's parameter space (__grid_constant__: read in
 *  place), so a launch needs no copy of them to the device. The launch's tiles are numbered across its measures:
 *  measure i has tiles first_tile[i] .. first_tile[i + 1] - 1, whose sums go to partials + tile * kTileValues;
 *  its totals go to totals + i * kTileValues, and tiles_done[i] counts its tiles summed. */
struct SumsLaunch {
  coat_quantization_measure measures[kMeasuresPerLaunch];
  int64_t first_tile[kMeasuresPerLaunch + 1];
  double* partials;
  double* totals;
  unsigned long long* tiles_done;  // zeros at the launch's start
  unsigned long long* measures_done;  // the launch's measures with totals; zero at the launch's start
  int count;
};
static_assert(sizeof(SumsLaunch) <= 4096, "launch parameters exceed 4 KiB");

/** Element i of x as raw bits: dtype's 2 or 4 bytes (a load is issued before the value is needed). */
__device__ uint32_t load_bits(const void* x, coat_dtype dtype, int64_t i) {
  return dtype == COAT_FLOAT32 ? static_cast<const uint32_t*>(x)[i] : static_cast<const uint16_t*>(x)[i];
}

__device__ float bits_to_f32(uint32_t bits, coat_dtype dtype) {
  switch (dtype) {
    case COAT_BFLOAT16: return coat_bf16_to_f32(static_cast<uint16_t>(bits));
    case COAT_FLOAT16: return coat_f16_to_f32(static_cast<uint16_t>(bits));
    default: return coat_f32_from_bits(bits);
  }
}

/** Leaves first .. first + kLeavesPerThread - 1 of measure m (consecutive elements in row-major order; zeros past
 *  the end). One division finds the first element's row; the others step along it. Every load of the four leaves
 *  is issued before any value is used: a tile then waits for one chain of dependent loads (row index, then x, code
 *  and scale) instead of four in a row, which is what bounds this latency-bound kernel. */
__device__ void measured_leaves(const coat_quantization_measure& m, int64_t first,
                                double (*leaves)[COAT_STATS_LEAF], float* amax) {
  const int64_t numel = m.rows * m.cols;
  const int group_log2 = m.group_size == 0 ? 0 : __ffsll(m.group_size) - 1;  // G is a power of two
  const int64_t ngroups = m.group_size == 0 ? 0 : coat_ceil_div(m.cols, m.group_size);
  int64_t measured_row[kLeavesPerThread], col[kLeavesPerThread];
  int64_t r = first / m.cols, c = first - r * m.cols;
#pragma unroll
  for (int j = 0; j < kLeavesPerThread; ++j, ++c) {
    if (c == m.cols) {  // a step of one element crosses at most one row's end
      c = 0;
      ++r;
    }
    measured_row[j] = r;
    col[j] = c;
  }
  int64_t row[kLeavesPerThread];
#pragma unroll
  for (int j = 0; j < kLeavesPerThread; ++j)
    row[j] = first + j >= numel ? 0 : m.row_index != nullptr ? m.row_index[measured_row[j]] : measured_row[j];
  bool readable[kLeavesPerThread];
  uint32_t x_bits[kLeavesPerThread];
  uint8_t code[kLeavesPerThread];
  float scale[kLeavesPerThread];
#pragma unroll
  for (int j = 0; j < kLeavesPerThread; ++j) {
    readable[j] = row[j] >= 0 && row[j] < m.q_rows;
    if (first + j >= numel || !readable[j]) continue;
    const int64_t x_row = m.x_indexed ? row[j] : measured_row[j];
    x_bits[j] = load_bits(m.x, m.dtype, x_row * m.x_row_stride + col[j] * m.x_col_stride);
    code[j] = m.q[row[j] * m.q_row_stride + col[j] * m.q_col_stride];
    scale[j] = m.group_size == 0 ? m.scales[0] : m.scales[row[j] * ngroups + (col[j] >> group_log2)];
  }
#pragma unroll
  for (int j = 0; j < kLeavesPerThread; ++j) {
    double* leaf = leaves[j];
    for (int k = 0; k < COAT_STATS_LEAF; ++k) leaf[k] = 0.0;
    if (first + j >= numel) continue;
    if (!readable[j])
      coat_unreadable_leaf(leaf, amax);
    else
      coat_quantization_leaf(bits_to_f32(x_bits[j], m.dtype), code[j], scale[j], m.format, leaf, amax);
  }
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

/** coat_max_nan of amax and scales[begin .. end) over the block (the order does not matter). All scales of a tensor
 *  are read, however few rows are measured: 16-byte loads, unrolled so that several are in flight per thread. */
__device__ float max_of_scales(const float* scales, int64_t begin, int64_t end, float amax) {
  int64_t j = begin;
  if (reinterpret_cast<uintptr_t>(scales) % 16 == 0 && begin % 4 == 0) {
    const float4* runs = reinterpret_cast<const float4*>(scales);
#pragma unroll 4
    for (int64_t k = begin / 4 + threadIdx.x; k < end / 4; k += kThreads) {
      const float4 s = __ldg(runs + k);
      amax = coat_max_nan(amax, coat_max_nan(coat_max_nan(s.x, s.y), coat_max_nan(s.z, s.w)));
    }
    j = end / 4 * 4;
  }
  for (j += threadIdx.x; j < end; j += kThreads) amax = coat_max_nan(amax, scales[j]);
  return amax;
}

/** Tile `tile` (of `tiles`) of measure m into partials[0 .. kTileValues): its sums by the tree and its amax. */
__device__ void tile_sums(const coat_quantization_measure& m, int64_t tile, int64_t tiles, double* partials,
                          double (*warp_nodes)[COAT_STATS_LEAF], float* warp_amax) {
  double leaves[kLeavesPerThread][COAT_STATS_LEAF];
  float amax = 0.0f;
  measured_leaves(m, tile * COAT_STATS_TILE + threadIdx.x * kLeavesPerThread, leaves, &amax);
  double node[COAT_STATS_LEAF];
  for (int k = 0; k < COAT_STATS_LEAF; ++k) node[k] = (leaves[0][k] + leaves[1][k]) + (leaves[2][k] + leaves[3][k]);
  if (m.amax_per_scale > 0.0f) {  // this tile's share of the scales instead, NaN kept for an unreadable row
    amax = amax != amax ? amax : 0.0f;
    const int64_t scales_per_tile = (coat_ceil_div(m.nscales, tiles) + 3) & ~int64_t{3};  // 16-byte runs
    amax = max_of_scales(m.scales, min(m.nscales, tile * scales_per_tile), min(m.nscales, (tile + 1) * scales_per_tile),
                         amax);
  }
  block_tree(node, &amax, warp_nodes, warp_amax);
  if (threadIdx.x == 0) {
    for (int k = 0; k < COAT_STATS_LEAF; ++k) partials[k] = node[k];
    partials[COAT_STATS_LEAF] = amax;
  }
}

/** Whether this block drew the last of `tickets` tickets of *counter, after making its writes visible to the block
 *  that draws it; that block then sees every drawer's writes (read them with __ldcg: L1 may hold stale lines). */
__device__ bool draws_last_ticket(unsigned long long* counter, unsigned long long tickets) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1ull) == tickets - 1;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

/** The sums of a measure's `tiles` tile partials by the tree over tiles, into totals[0 .. kTileValues): each thread
 *  sums a power-of-two run of consecutive tiles (zeros past the last), then the block adds the runs. */
__device__ void finish_measure(const coat_quantization_measure& m, const double* partials, int64_t tiles,
                               double* totals, double (*warp_nodes)[COAT_STATS_LEAF], float* warp_amax) {
  const int64_t padded = int64_t{1} << coat_ceil_log2(tiles);
  const int64_t run = padded > kThreads ? padded / kThreads : 1;
  double stack[COAT_STATS_LEAF][kRunLevels + 1];
  float amax = 0.0f;
  for (int64_t j = 0; j < run; ++j) {
    const int64_t tile = threadIdx.x * run + j;
    const double* values = partials + tile * kTileValues;
    for (int k = 0; k < COAT_STATS_LEAF; ++k) coat_pairwise_push(stack[k], j, tile < tiles ? __ldcg(values + k) : 0.0);
    if (tile < tiles) amax = coat_max_nan(amax, static_cast<float>(__ldcg(values + COAT_STATS_LEAF)));
  }
  double node[COAT_STATS_LEAF];
  for (int k = 0; k < COAT_STATS_LEAF; ++k) node[k] = stack[k][coat_ceil_log2(run)];
  block_tree(node, &amax, warp_nodes, warp_amax);
  if (threadIdx.x == 0) {
    for (int k = 0; k < COAT_STATS_LEAF; ++k) totals[k] = node[k];
    totals[COAT_STATS_LEAF] = m.amax_per_scale > 0.0f ? coat_max_nan(0.0f, amax * m.amax_per_scale) : amax;
  }
}

/** The launch's totals added into the measures' sums in list order, since measures may share their sums: thread i
 *  takes measure i's sums unless an earlier measure has them, and adds every measure of those sums in turn. */
__device__ void add_totals(const SumsLaunch& launch) {
  const int i = threadIdx.x;
  if (i < launch.count) {
    double* const sums = launch.measures[i].sums;
    bool first_of_sums = true;
    for (int e = 0; e < i; ++e) first_of_sums = first_of_sums && launch.measures[e].sums != sums;
    if (first_of_sums) {
      double s[COAT_STATS_SUMS];
      for (int k = 0; k < COAT_STATS_SUMS; ++k) s[k] = __ldcg(sums + k);
      for (int j = i; j < launch.count; ++j) {
        const coat_quantization_measure& m = launch.measures[j];
        if (m.sums != sums) continue;
        const double* totals = launch.totals + j * kTileValues;
        s[0] += static_cast<double>(m.rows * m.cols);
        for (int k = 0; k < COAT_STATS_LEAF; ++k) s[1 + k] += __ldcg(totals + k);
        s[6] = coat_max_nan(static_cast<float>(s[6]), static_cast<float>(__ldcg(totals + COAT_STATS_LEAF)));
      }
      for (int k = 0; k < COAT_STATS_SUMS; ++k) sums[k] = s[k];
    }
  }
  if (i == 0) *launch.measures_done = 0;  // the call's next launch counts from zero
}

__global__ void __launch_bounds__(kThreads) quantization_sums_kernel(const __grid_constant__ SumsLaunch launch) {
  __shared__ double warp_nodes[kWarps][COAT_STATS_LEAF];
  __shared__ float warp_amax[kWarps];
  int i = 0;  // the measure of `tile`, which only grows along the loop
  for (int64_t tile = blockIdx.x; tile < launch.first_tile[launch.count]; tile += gridDim.x) {
    while (tile >= launch.first_tile[i + 1]) ++i;
    const coat_quantization_measure& m = launch.measures[i];
    const int64_t first = launch.first_tile[i], tiles = launch.first_tile[i + 1] - first;
    tile_sums(m, tile - first, tiles, launch.partials + tile * kTileValues, warp_nodes, warp_amax);
    if (!draws_last_ticket(&launch.tiles_done[i], tiles)) continue;
    finish_measure(m, launch.partials + first * kTileValues, tiles, launch.totals + i * kTileValues, warp_nodes,
                   warp_amax);
    if (draws_last_ticket(launch.measures_done, launch.count)) add_totals(launch);
  }
}

}  // namespace
}  // namespace device
}  // namespace coat

using namespace coat::device;

extern "C" coat_status coat_quantization_sums_cuda(const coat_quantization_measure* measures, int64_t count,
                                                   double* workspace, coat_cuda_stream stream) {
  if (count < 0 || (count > 0 && (measures == nullptr || workspace == nullptr))) return COAT_ERROR_INVALID_ARGUMENT;
  for (int64_t i = 0; i < count; ++i)
    if (!coat_quantization_measure_is_valid(&measures[i])) return COAT_ERROR_INVALID_ARGUMENT;
  if (count == 0) return COAT_SUCCESS;
  // The workspace (coat_quantization_sums_workspace) holds every measure's tile partials in list order, the
  // measures' totals, their tile counters and the counter of measures done that the launches share.
  int64_t tiles = 0;
  for (int64_t i = 0; i < count; ++i) tiles += coat_quantization_tiles(&measures[i]);
  double* const totals = workspace + tiles * kTileValues;
  static_assert(sizeof(unsigned long long) == sizeof(double), "a counter takes one workspace value");
  auto* const tiles_done = reinterpret_cast<unsigned long long*>(totals + count * kTileValues);
  unsigned long long* const measures_done = tiles_done + count;
  cudaStream_t s = as_cuda_stream(stream);
  if (cudaMemsetAsync(tiles_done, 0, (count + 1) * sizeof(unsigned long long), s) != cudaSuccess)
    return COAT_ERROR_CUDA;
  double* partials = workspace;
  for (int64_t first = 0; first < count; first += kMeasuresPerLaunch) {
    SumsLaunch launch{};
    launch.count = static_cast<int>(std::min<int64_t>(count - first, kMeasuresPerLaunch));
    launch.partials = partials;
    launch.totals = totals + first * kTileValues;
    launch.tiles_done = tiles_done + first;
    launch.measures_done = measures_done;
    for (int i = 0; i < launch.count; ++i) {
      launch.measures[i] = measures[first + i];
      launch.first_tile[i + 1] = launch.first_tile[i] + coat_quantization_tiles(&measures[first + i]);
    }
    const int64_t launch_tiles = launch.first_tile[launch.count];
    quantization_sums_kernel<<<clamp_grid(launch_tiles, kMaxGridX), kThreads, 0, s>>>(launch);
    partials += launch_tiles * kTileValues;
  }
  return launch_status();
}
