// CUDA implementation of coat/adamw.h's moment_counts and moment_stats: the statistics of an FP8 optimizer state that
// coat.report shows (moment_keys_sort.cu sorts the keys between the two). adamw.cuh holds what they share with
// adamw_step.cu and adamw_expanded.cu.
#include <algorithm>

#include "adamw.cuh"

namespace {

// ---------------------------------------------------------------------------------------------- state statistics

// moment_counts_kernel: items per thread before another block is added, and blocks at most (grid-stride beyond).
// An item is a run of kMomentRun measured elements of one row and group (one meta load and decoder, one 16-byte
// load of codes where aligned) and one group's k. One element per item, with a 64-bit division and a decoder
// each, counted 27 M sampled codes at about 50 GB/s on an H100 (0.56 ms for a capture's 78 moments).
constexpr int kMomentItemsPerThread = 4;
constexpr int kMomentStatsBlocks = 1024;
constexpr int kMomentRun = 16;  // the smallest group size: a run never crosses a group
static_assert(kMomentRun == sizeof(uint4), "a run of codes is one 16-byte load");

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

constexpr int kMomentStatesPerLaunch = 32;

struct MomentLaunch {
  coat_moment_state states[kMomentStatesPerLaunch];
  int group_shift;
};

// coat_moment_counts (coat/adamw.h): block (x, y) counts items of state y (grid-stride in x), each thread its
// measured elements and groups, each warp adding its counts into the state's with one atomic each. Integer sums
// and maxima: the same in any order.
__global__ void __launch_bounds__(kThreadsPerBlock) moment_counts_kernel(const MomentLaunch launch) {
  const coat_moment_state& s = launch.states[blockIdx.y];
  const int group_shift = launch.group_shift;
  const int64_t ngroups = (s.cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  const int64_t runs_per_row = (s.cols + kMomentRun - 1) / kMomentRun;
  const int64_t measured = s.measured_rows * runs_per_row, groups = s.rows * ngroups;
  const int64_t work = max(measured, groups);
  if (int64_t{blockIdx.x} * blockDim.x >= work) return;  // uniform over the block, before it builds the tables
  __shared__ coat_adamw_tables tables;
  build_tables(&tables);
  uint64_t nonfinite = 0, zero_codes = 0, not_one = 0, nan = 0;
  uint32_t amax_bits = 0, min_key_inverse = 0, max_key = 0;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < work; i += stride) {
    if (i < measured) {
      const int64_t r = i / runs_per_row, first = (i - r * runs_per_row) * kMomentRun;
      const int count = static_cast<int>(min(int64_t{kMomentRun}, s.cols - first));
      const int64_t row = s.row_index != nullptr ? s.row_index[r] : r;
      if (row < 0 || row >= s.rows) {
        nonfinite += count;
      } else {
        const uint8_t* run = s.codes + row * s.cols + first;
        uint8_t codes[kMomentRun];
        if (count == kMomentRun && (reinterpret_cast<uintptr_t>(run) & (sizeof(uint4) - 1)) == 0) {
          *reinterpret_cast<uint4*>(codes) = *reinterpret_cast<const uint4*>(run);
        } else {
          for (int j = 0; j < count; ++j) codes[j] = run[j];
        }
        const int64_t g = row * ngroups + (first >> group_shift);
        const coat_decoder d = coat_decoder_make(coat_meta_load(s.meta + g * COAT_META_VALUES), s.format, &tables);
#pragma unroll
        for (int j = 0; j < kMomentRun; ++j)
          if (j < count)
            coat_moment_count_element(codes[j], &d, s.format, &tables, &nonfinite, &zero_codes, &amax_bits);
      }
    }
    if (i < groups) {
      const uint32_t key =
          coat_moment_count_group(s.meta[i * COAT_META_VALUES + 1], &not_one, &nan, &min_key_inverse, &max_key);
      s.k_keys[i] = static_cast<int32_t>((static_cast<uint32_t>(s.key_prefix) << 16) | key);
    }
  }
  const unsigned long long sums[4] = {warp_sum<unsigned long long>(nonfinite), warp_sum<unsigned long long>(zero_codes),
                                      warp_sum<unsigned long long>(not_one), warp_sum<unsigned long long>(nan)};
  const uint32_t maxima[3] = {warp_max(amax_bits), warp_max(min_key_inverse), warp_max(max_key)};
  auto* counts = reinterpret_cast<unsigned long long*>(s.counts);
  if (lane_id() == 0) {
    atomicAdd(&counts[1], sums[0]);
    atomicAdd(&counts[2], sums[1]);
    atomicAdd(&counts[5], sums[2]);
    atomicAdd(&counts[6], sums[3]);
    atomicMax(&counts[3], static_cast<unsigned long long>(maxima[0]));
    atomicMax(&counts[7], static_cast<unsigned long long>(maxima[1]));
    atomicMax(&counts[8], static_cast<unsigned long long>(maxima[2]));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    atomicAdd(&counts[0], static_cast<unsigned long long>(s.measured_rows * s.cols));
    atomicAdd(&counts[4], static_cast<unsigned long long>(groups));
  }
}

constexpr int kMomentStatsThreads = 256;

// One block. State i's run of sorted keys starts after the runs of states 0 .. i-1: a scan of their group counts
// in shared memory, kMomentStatsThreads states at a time, so that the states' loads are in flight together.
__global__ void __launch_bounds__(kMomentStatsThreads)
    moment_stats_kernel(const uint64_t* counts, const int32_t* sorted_keys, int64_t n, double* stats) {
  __shared__ uint64_t runs_end[kMomentStatsThreads];  // the chunk's inclusive sums of group counts
  const int t = threadIdx.x;
  uint64_t chunk_first = 0;  // the first key of the chunk's first state
  for (int64_t chunk = 0; chunk < n; chunk += kMomentStatsThreads) {
    const int64_t i = chunk + t;
    const uint64_t* state = counts + i * COAT_MOMENT_COUNTS;
    const uint64_t groups = i < n ? state[4] : 0;
    runs_end[t] = groups;
    __syncthreads();
    for (int offset = 1; offset < kMomentStatsThreads; offset <<= 1) {
      const uint64_t before = t >= offset ? runs_end[t - offset] : 0;
      __syncthreads();
      runs_end[t] += before;
      __syncthreads();
    }
    if (i < n) {
      const uint64_t first = chunk_first + runs_end[t] - groups;
      coat_moment_stats_row(state, sorted_keys[first + (groups - 1) / 2], stats + i * COAT_MOMENT_STATS);
    }
    chunk_first += runs_end[kMomentStatsThreads - 1];
    __syncthreads();  // runs_end is rewritten by the next chunk
  }
}

}  // namespace

extern "C" coat_status coat_moment_counts_cuda(const coat_moment_state* states, int64_t count, int64_t group_size,
                                               coat_cuda_stream stream) {
  if (count < 0 || (count > 0 && states == nullptr) || !coat_is_valid_group_size(group_size))
    return COAT_ERROR_INVALID_ARGUMENT;
  for (int64_t i = 0; i < count; ++i)
    if (!coat_moment_state_is_valid(&states[i])) return COAT_ERROR_INVALID_ARGUMENT;
  for (int64_t first = 0; first < count; first += kMomentStatesPerLaunch) {
    MomentLaunch launch{};
    launch.group_shift = __builtin_ctzll(group_size);
    const int n = static_cast<int>(std::min<int64_t>(count - first, kMomentStatesPerLaunch));
    int64_t blocks = 1;
    for (int i = 0; i < n; ++i) {
      const coat_moment_state& s = states[first + i];
      launch.states[i] = s;
      const int64_t work = std::max(s.measured_rows * coat_ceil_div(s.cols, int64_t{kMomentRun}),
                                    s.rows * coat_ceil_div(s.cols, group_size));
      blocks = std::max(blocks, coat_ceil_div(work, int64_t{kThreadsPerBlock} * kMomentItemsPerThread));
    }
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks, kMomentStatsBlocks)), static_cast<unsigned>(n));
    moment_counts_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(launch);
  }
  return launch_status();
}

extern "C" coat_status coat_moment_stats_cuda(const uint64_t* counts, const int32_t* sorted_keys, int64_t n,
                                              double* stats, coat_cuda_stream stream) {
  if (n < 0 || (n > 0 && (counts == nullptr || sorted_keys == nullptr || stats == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (n == 0) return COAT_SUCCESS;
  moment_stats_kernel<<<1, kMomentStatsThreads, 0, stream>>>(counts, sorted_keys, n, stats);
  return launch_status();
}
