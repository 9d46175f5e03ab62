// CUDA implementation of coat/norm_act.h's RMSNorm: forward (quantize), backward and requantize. What it shares with
// silu_mul.cu (chunks, I/O, saving inputs, the second pass of the forward and the requantize op) is in norm_act.cuh,
// which says how the work is cut and where the fast paths are.
//
// Kernels:
//   rmsnorm_stats_kernel     persistent; L threads per row (L = coat_rmsnorm_lanes(cols)): rstd, the saved x
//                            (E4M3, FP4 or FP6, an instantiation each), the amax of y (one guarded atomicMax per
//                            warp); the next rows' x is loaded while these are reduced. Its OutIo instantiations
//                            are coat_rmsnorm_save_cuda: y (plus the residual) written in high precision instead
//                            of the amax, from the x still in registers (one pass)
//   apply_quantize_kernel    (norm_act.cuh) of RmsnormApply: y from x (the forward), y_t from the saved x (requantize)
//   rmsnorm_backward_kernel  L threads per slice of rows, the next row in flight: dx (plus the residual
//                            gradient when there is one), and one partial dweight row per slice
//   dweight_finish_kernel    the slices' partial dweight rows summed in the documented order
// tools/cuda_emulation runs these kernels on the CPU against the C core.
#include "norm_act.cuh"

namespace {

constexpr int kChunksPerLane = COAT_RMSNORM_MAX_CHUNKS_PER_LANE;
// Rows of L <= 256 lanes share 256-thread blocks; wider rows get a block of their own.
constexpr int kRowBlockThreads = 256;

// ---------------------------------------------------------------------------------------------------
// The weight in shared memory, the row's sum

// The weight (plus the offset, coat_rmsnorm_weight) of the chunk from col, `count` elements of it; past them 0.
__device__ __forceinline__ void load_weight_chunk(const void* weight, coat_dtype dtype, float offset, int col,
                                                  int count, bool vector, float w[kChunk]) {
  load_chunk(weight, dtype, col, count, vector, w);
#pragma unroll
  for (int e = 0; e < kChunk; ++e)
    if (e < count) w[e] = coat_rmsnorm_weight(w[e], offset);
}

// The RMSNorm weight as fp32 in shared memory, staged once per block: two planes of float4, the first and the
// second half of each chunk, so that lanes reading consecutive chunks hit consecutive banks.
struct WeightPlanes {
  float4* planes;
  int chunks;

  __host__ __device__ static size_t bytes(int cols) { return sizeof(float4) * 2 * ((cols + kChunk - 1) / kChunk); }

  // All threads of the block must call it (it synchronizes). Columns past cols hold 0.
  __device__ __forceinline__ void stage(const void* weight, coat_dtype dtype, float offset, int cols,
                                        bool vector) const {
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float w[kChunk];
      load_weight_chunk(weight, dtype, offset, c * kChunk, chunk_count(c * kChunk, cols), vector, w);
      planes[c] = make_float4(w[0], w[1], w[2], w[3]);
      planes[chunks + c] = make_float4(w[4], w[5], w[6], w[7]);
    }
    __syncthreads();
  }

  // The weight of the chunk from col (< cols).
  __device__ __forceinline__ void chunk(int col, float w[kChunk]) const {
    const float4 low = planes[col / kChunk], high = planes[chunks + col / kChunk];
    w[0] = low.x, w[1] = low.y, w[2] = low.z, w[3] = low.w, w[4] = high.x, w[5] = high.y, w[6] = high.z, w[7] = high.w;
  }
};

// The row's sum of one partial per lane, in the order of coat_combine_lane_partials: xor butterfly in each
// warp (lane l adds lane l + 16, + 8, ..., + 1), then across the row's warps the same way. Every thread of
// the block must call it (it synchronizes when a row spans warps); warp_sums holds one float per warp, and
// must not be the buffer of the previous call (whose readers may still be at it).
__device__ __forceinline__ float row_sum(float partial, int lanes, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) partial = partial + __shfl_xor_sync(kFullMask, partial, offset);
  if (lanes == kWarpSize) return partial;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warps_per_row = lanes / kWarpSize;
  if (lane == 0) warp_sums[warp] = partial;
  __syncthreads();
  float v = lane < warps_per_row ? warp_sums[(warp & -warps_per_row) + lane] : 0.0f;  // the row's first warp + lane
  for (int offset = warps_per_row / 2; offset > 0; offset >>= 1) v = v + __shfl_xor_sync(kFullMask, v, offset);
  return __shfl_sync(kFullMask, v, 0);
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm forward, first pass

struct RmsnormStatsArgs {
  const void* x;
  coat_dtype x_dtype;
  int64_t rows;
  int cols;
  int64_t row_stride;
  const void* weight;
  coat_dtype weight_dtype;
  float weight_offset;
  float eps;
  int group_shift;  // log2 of the save group size
  int lanes;
  int64_t row_groups;  // groups of kMaxThreads / lanes rows, one per block and iteration
  int saved_row_bytes;
  uint8_t* x_saved;
  float* x_saved_scales;
  float* rstd;
  float* y_amax;         // the FP8 forward's (OutIo void)
  void* out;             // coat_rmsnorm_save's: rows x cols contiguous, in out_dtype (OutIo's)
  coat_dtype out_dtype;  // the residual's, or x's without one
  const void* residual;  // or nullptr; rows x cols contiguous, in OutIo's dtype
};

// A lane's chunks of one row (lane + k L for k < kChunksPerLane), as loaded.
template <class Io>
struct LaneChunks {
  typename Io::Raw chunk[kChunksPerLane];
};

template <class Io>
__device__ __forceinline__ LaneChunks<Io> load_lane_chunks(const Io& io, const void* row, int lane, int lanes,
                                                           int valid_cols) {
  LaneChunks<Io> chunks;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int col = (lane + k * lanes) * kChunk;
    chunks.chunk[k] = io.load(row, col, chunk_count(col, valid_cols));
  }
  return chunks;
}

// Blocks of rmsnorm_stats_kernel per SM to hold registers for: 256-thread blocks of bf16 fit 3 at 80 registers,
// spilling 4 bytes (E4M3), 16 (FP4) or 20 (FP6): one reload per row group.
template <int kMaxThreads, class Io>
constexpr int kStatsMinBlocks = kMaxThreads == 256 && std::is_same<Io, VectorIo<COAT_BFLOAT16>>::value ? 3 : 1;

// Block b reduces row groups b, b + gridDim.x, ... (kMaxThreads / L rows each, L lanes per row); with
// kPrefetch the next group's x is in flight while this group is reduced. x is saved in kFormat. OutIo is void for
// the FP8 forward (the amax of y), else the Io that writes y (coat_rmsnorm_save) and reads the residual.
template <int kMaxThreads, class Io, coat_saved_format kFormat, class OutIo = void>
__global__ void __launch_bounds__(kMaxThreads, (kStatsMinBlocks<kMaxThreads, Io>))
    rmsnorm_stats_kernel(RmsnormStatsArgs a) {
  constexpr bool kOutput = !std::is_void<OutIo>::value;
  // 1024-thread blocks have 64 registers per thread: no room for a second row.
  constexpr bool kPrefetch = kMaxThreads <= 512;
  __shared__ float warp_sums[2][kMaxThreads / kWarpSize];
  extern __shared__ float4 weight_planes[];  // WeightPlanes::bytes(cols)
  const WeightPlanes weights{weight_planes, (a.cols + kChunk - 1) / kChunk};
  const Io io{a.x_dtype};
  const int lane = threadIdx.x % a.lanes, row_in_group = threadIdx.x / a.lanes;
  const int rows_per_group = kMaxThreads / a.lanes;
  const int chunks = (a.cols + kChunk - 1) / kChunk;
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const auto row_of = [&](int64_t group) { return group * rows_per_group + row_in_group; };
  const auto load_row = [&](int64_t group) {
    const int64_t row = row_of(group);
    const bool active = row < a.rows;
    return load_lane_chunks(io, row_at(a.x, io.element_size(), active ? row : 0, a.row_stride), lane, a.lanes,
                            active ? a.cols : 0);
  };

  // The first rows are in flight while the weight is staged.
  LaneChunks<Io> next;
  if constexpr (kPrefetch) next = load_row(blockIdx.x);
  weights.stage(a.weight, a.weight_dtype, a.weight_offset, a.cols, Io::kVector);
  float amax = 0.0f;
  int parity = 0;
  for (int64_t group = blockIdx.x; group < a.row_groups; group += gridDim.x, parity ^= 1) {
    LaneChunks<Io> x_row;
    if constexpr (kPrefetch) {
      x_row = next;
      if (group + gridDim.x < a.row_groups) next = load_row(group + gridDim.x);
    } else {
      x_row = load_row(group);
    }
    const int64_t row = row_of(group);
    const bool active = row < a.rows;
    const int valid_cols = active ? a.cols : 0;
    uint8_t* saved_row = a.x_saved + (active ? row : 0) * a.saved_row_bytes;
    float* scales_row = a.x_saved_scales + (active ? row : 0) * ngroups;

    // x^2 for rstd and the FP8 copy saved for backward. Terms past the row are +0; adding them changes
    // nothing, as a partial is never -0.
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;  // uniform over the block
      float x[1][kChunk];
      io.unpack(x_row.chunk[k], x[0]);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) partial = partial + x[0][e] * x[0][e];
      save_chunks<kFormat, Io>(&x_row.chunk[k], x, (lane + k * a.lanes) * kChunk, valid_cols,
                               (1 << a.group_shift) / kChunk, a.group_shift, Io::kVector, saved_row, scales_row);
    }
    const float rstd = coat_rmsnorm_rstd(row_sum(partial, a.lanes, warp_sums[parity]), a.cols, a.eps);
    if (active && lane == 0) a.rstd[row] = coat_canonical_nan(rstd);

    // The amax of y, or y itself in high precision (kOutput), plus the residual, y rounded to x's dtype first (as
    // coat/norm_act.h says). Past a short chunk x and the weight are 0, so y is 0 or NaN there, which changes no amax.
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = chunk_count(col, valid_cols);
      if (count == 0) continue;
      float x[kChunk], weight[kChunk];
      io.unpack(x_row.chunk[k], x);
      weights.chunk(col, weight);
      if constexpr (kOutput) {
        const OutIo out_io{a.out_dtype};
        float y[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; ++e) y[e] = coat_rmsnorm_apply(x[e], rstd, weight[e]);
        if (a.residual != nullptr) {
          float residual[kChunk];
          out_io.unpack(out_io.load(row_at(a.residual, out_io.element_size(), row, a.cols), col, count), residual);
#pragma unroll
          for (int e = 0; e < kChunk; ++e) y[e] = coat_round_as(a.x_dtype, y[e]) + residual[e];
        }
        out_io.store(row_at(a.out, out_io.element_size(), row, a.cols), col, count, y);
      } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) amax = amax_step(amax, coat_rmsnorm_apply(x[e], rstd, weight[e]));
      }
    }
  }
  if constexpr (!kOutput) {
    amax = warp_max(amax);
    if (threadIdx.x % kWarpSize == 0) atomic_max_nonnegative(a.y_amax, amax);
  }
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm's op of the second pass (norm_act.cuh's apply_quantize_kernel)

template <class Source>
struct RmsnormApply {
  using Rows = Source;
  static constexpr bool kVector = Source::kVector;
  struct Table {};
  Source x;
  const float* rstd;
  const void* weight;
  coat_dtype weight_dtype;
  float weight_offset;

  struct Inputs {
    typename Source::Chunk x;
    float rstd;
  };
  struct Column {
    float weight[kChunk];
  };

  __device__ __forceinline__ Inputs load(int64_t row, int col, int count) const {
    return {x.load(row, col, count), count > 0 ? rstd[row] : 0.0f};
  }
  __device__ __forceinline__ Column column(int col, int count) const {
    Column c;
    load_weight_chunk(weight, weight_dtype, weight_offset, col, count, kVector, c.weight);
    return c;
  }
  __device__ __forceinline__ static void fill(Table&) {}
  __device__ __forceinline__ void compute(const Table&, const Inputs& in, const Column& c, float y[kChunk]) const {
    float x_chunk[kChunk];
    x.values(in.x, x_chunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) y[e] = coat_rmsnorm_apply(x_chunk[e], in.rstd, c.weight[e]);
  }
};

// ---------------------------------------------------------------------------------------------------
// RMSNorm backward

struct RmsnormBackwardArgs {
  const void* dy;
  coat_dtype dy_dtype;
  coat_dtype dx_dtype;  // the residual's, or dy's without one
  int64_t rows;
  int cols;
  int64_t row_stride;
  SavedCodes x_saved;
  const float* x_saved_scales;
  int group_shift;  // log2 of the save group size
  const float* rstd;
  const void* weight;
  coat_dtype weight_dtype;
  float weight_offset;
  int lanes;
  int64_t rows_per_slice, slices;
  const void* residual;  // or nullptr
  void* dx;
  float* workspace;
};

// What a lane reads of one row: its chunks of dy and of the saved codes, their scales, and rstd.
template <class Io>
struct BackwardRow {
  typename Io::Raw dy[kChunksPerLane];
  Codes codes[kChunksPerLane];
  float scales[kChunksPerLane];
  float rstd;
};

// Bytes of shared memory per thread for its dweight partial sums (kChunksPerLane x 8 floats).
constexpr size_t kDweightBytesPerThread = sizeof(float) * kChunksPerLane * kChunk;

// Whether rmsnorm_backward_kernel stages the weight in shared memory: not beside the 128 KB of dweight
// partials of 1024-thread blocks.
template <int kMaxThreads>
constexpr bool kBackwardWeightShared = kMaxThreads <= 512;

template <int kMaxThreads>
size_t backward_shared_bytes(int cols) {
  return kDweightBytesPerThread * kMaxThreads + (kBackwardWeightShared<kMaxThreads> ? WeightPlanes::bytes(cols) : 0);
}

// L threads per slice of rows; each lane accumulates the dweight partial sums of its own columns across the
// slice's rows, in shared memory (float4 (k, half) of thread t at [(2 k + half) * blockDim.x + t], so that
// a warp's accesses are conflict-free), and writes them to the slice's workspace row at the end. Rows are
// walked with the next one in flight, except in 1024-thread blocks (64 registers per thread).
// Blocks of rmsnorm_backward_kernel per SM to hold registers for: two 256-thread blocks (the slices' one wave)
// when a row's inputs stay packed (16-bit dy), else one, which fp32 or element-wise dy needs to hold two rows
// in registers without spilling (the slices then take two waves).
template <int kMaxThreads, class Io>
constexpr int kBackwardMinBlocks = kMaxThreads == 256 && sizeof(typename Io::Raw) == 16 ? 2 : 1;

// Io reads dy. ResidualIo is void without a residual (dx in dy's dtype, written by Io), else the Io that reads
// the residual and writes dx, in the residual's dtype.
template <int kMaxThreads, class Io, class ResidualIo>
__global__ void __launch_bounds__(kMaxThreads, (kBackwardMinBlocks<kMaxThreads, Io>))
    rmsnorm_backward_kernel(RmsnormBackwardArgs a) {
  constexpr bool kPrefetch = kMaxThreads <= 512;
  constexpr bool kResidual = !std::is_void<ResidualIo>::value;
  using DxIo = typename std::conditional<kResidual, ResidualIo, Io>::type;
  __shared__ float warp_sums[2][kMaxThreads / kWarpSize];
  extern __shared__ float4 dweight_partials[];  // backward_shared_bytes(cols): the partials, then the weight
  const WeightPlanes weights{dweight_partials + kChunksPerLane * 2 * kMaxThreads, (a.cols + kChunk - 1) / kChunk};
  // The weight of a chunk of the row.
  const auto weight_of = [&](int col, int count, float w[kChunk]) {
    if constexpr (kBackwardWeightShared<kMaxThreads>) weights.chunk(col, w);
    else load_weight_chunk(a.weight, a.weight_dtype, a.weight_offset, col, count, Io::kVector, w);
  };
  const Io io{a.dy_dtype};
  const DxIo dx_io{a.dx_dtype};
  const int lane = threadIdx.x % a.lanes;
  const int64_t slice = static_cast<int64_t>(blockIdx.x) * (kMaxThreads / a.lanes) + threadIdx.x / a.lanes;
  const int chunks = (a.cols + kChunk - 1) / kChunk;
  const int ngroups = ((a.cols - 1) >> a.group_shift) + 1;
  const auto partials_at = [&](int k, int half) -> float4& {
    return dweight_partials[(2 * k + half) * kMaxThreads + threadIdx.x];
  };
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) partials_at(k, 0) = partials_at(k, 1) = make_float4(0.f, 0.f, 0.f, 0.f);

  const auto load_row = [&](int64_t i) {
    const int64_t row = slice * a.rows_per_slice + i;
    const bool active = slice < a.slices && row < a.rows;
    const int64_t safe_row = active ? row : 0;
    const void* dy_row = row_at(a.dy, io.element_size(), safe_row, a.row_stride);
    const float* scales_row = a.x_saved_scales + safe_row * ngroups;
    BackwardRow<Io> in;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      in.dy[k] = io.load(dy_row, col, count);
      in.codes[k] = a.x_saved.load(safe_row, col, count, Io::kVector);
      in.scales[k] = count > 0 ? scales_row[col >> a.group_shift] : 0.0f;
    }
    in.rstd = active ? a.rstd[row] : 0.0f;
    return in;
  };
  // xhat of chunk k, as coat_rmsnorm_xhat gives it (codes past the row are 0: xhat is 0 there).
  const auto xhat_of = [&](const BackwardRow<Io>& in, int k, float xhat[kChunk]) {
    decode_saved(a.x_saved.e4m3(in.codes[k]), in.scales[k], xhat);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) xhat[e] = xhat[e] * in.rstd;
  };

  // The first row is in flight while the weight is staged.
  BackwardRow<Io> next;
  if constexpr (kPrefetch) next = load_row(0);
  if constexpr (kBackwardWeightShared<kMaxThreads>)
    weights.stage(a.weight, a.weight_dtype, a.weight_offset, a.cols, Io::kVector);
  for (int64_t i = 0; i < a.rows_per_slice; ++i) {  // the same trip count for every thread of the block
    BackwardRow<Io> current;
    if constexpr (kPrefetch) {
      current = next;
      if (i + 1 < a.rows_per_slice) next = load_row(i + 1);
    } else {
      current = load_row(i);
    }
    const int64_t row = slice * a.rows_per_slice + i;
    const bool active = slice < a.slices && row < a.rows;
    void* dx_row = row_at(a.dx, dx_io.element_size(), active ? row : 0, a.cols);
    // Chunks past the row add nothing; in a short chunk the terms past the row are +0 (as in the forward,
    // adding them changes nothing).
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;  // uniform over the block
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      if (count == 0) continue;
      float dy[kChunk], weight[kChunk], xhat[kChunk];
      io.unpack(current.dy[k], dy);
      weight_of(col, count, weight);
      xhat_of(current, k, xhat);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) partial = partial + (dy[e] * weight[e]) * xhat[e];
    }
    // The row's residual is loaded while its dot product is reduced (with the next row's inputs it would not fit
    // in registers).
    typename DxIo::Raw residual[kChunksPerLane];
    if constexpr (kResidual) {
      const void* residual_row = row_at(a.residual, dx_io.element_size(), active ? row : 0, a.cols);
#pragma unroll
      for (int k = 0; k < kChunksPerLane; ++k) {
        const int col = (lane + k * a.lanes) * kChunk;
        residual[k] = dx_io.load(residual_row, col, active ? chunk_count(col, a.cols) : 0);
      }
    }
    const float mean_dot = coat_div_rn(row_sum(partial, a.lanes, warp_sums[i % 2]), static_cast<float>(a.cols));
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      if (count == 0) continue;
      float dy[kChunk], weight[kChunk], xhat[kChunk], dx[kChunk];
      io.unpack(current.dy[k], dy);
      weight_of(col, count, weight);
      xhat_of(current, k, xhat);
      float4& low = partials_at(k, 0);
      float4& high = partials_at(k, 1);
      float sums[kChunk] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        dx[e] = coat_rmsnorm_dx(dy[e] * weight[e], xhat[e], mean_dot, current.rstd);
        sums[e] = sums[e] + dy[e] * xhat[e];
      }
      low = make_float4(sums[0], sums[1], sums[2], sums[3]);
      high = make_float4(sums[4], sums[5], sums[6], sums[7]);
      if constexpr (kResidual) {
        float residual_chunk[kChunk];
        dx_io.unpack(residual[k], residual_chunk);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dx[e] = coat_rmsnorm_dx_plus_residual(dx[e], a.dy_dtype, residual_chunk[e]);
      }
      dx_io.store(dx_row, col, count, dx);
    }
  }
  if (slice >= a.slices) return;
  float* workspace_row = a.workspace + slice * a.cols;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int col = (lane + k * a.lanes) * kChunk;
    const int count = chunk_count(col, a.cols);
    if (count == 0) continue;
    const float4 low = partials_at(k, 0), high = partials_at(k, 1);
    const float sums[kChunk] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) workspace_row[col + e] = sums[e];
  }
}

// dweight[c] = the slices' partial sums in the documented order: phase p (warp p of the block) adds slices
// p, p + 16, ... in increasing order, 16 loads at a time in flight, then the 16 phases are combined pairwise.
constexpr int kFinishLoads = 16;

__global__ void __launch_bounds__(kWarpSize * COAT_DWEIGHT_PHASES)
    dweight_finish_kernel(const float* workspace, int64_t slices, int cols, float* dweight) {
  __shared__ float phase_sums[COAT_DWEIGHT_PHASES][kWarpSize + 1];
  const int lane = threadIdx.x % kWarpSize, phase = threadIdx.x / kWarpSize;
  const int col = blockIdx.x * kWarpSize + lane;
  float sum = 0.0f;
  if (col < cols) {
    for (int64_t first = phase; first < slices; first += kFinishLoads * COAT_DWEIGHT_PHASES) {
      float terms[kFinishLoads];
#pragma unroll
      for (int j = 0; j < kFinishLoads; ++j) {
        const int64_t slice = first + j * COAT_DWEIGHT_PHASES;
        terms[j] = slice < slices ? workspace[slice * cols + col] : 0.0f;
      }
      // A phase sum starts at +0 and is never -0, so adding the +0 of a slice past the end changes nothing.
#pragma unroll
      for (int j = 0; j < kFinishLoads; ++j) sum = sum + terms[j];
    }
  }
  phase_sums[phase][lane] = sum;
  __syncthreads();
  if (phase != 0 || col >= cols) return;
  float phases[COAT_DWEIGHT_PHASES];
#pragma unroll
  for (int p = 0; p < COAT_DWEIGHT_PHASES; ++p) phases[p] = phase_sums[p][lane];
  dweight[col] = coat_canonical_nan(coat_combine_dweight_phases(phases));
}

// ---------------------------------------------------------------------------------------------------
// Launch helpers

template <int kMaxThreads, class Io, coat_saved_format kFormat, class OutIo>
coat_status launch_rmsnorm_stats(RmsnormStatsArgs args, cudaStream_t stream) {
  constexpr auto kKernel = rmsnorm_stats_kernel<kMaxThreads, Io, kFormat, OutIo>;
  const size_t shared_bytes = WeightPlanes::bytes(args.cols);
  const int64_t resident = resident_blocks<kKernel>(kMaxThreads, shared_bytes);
  if (resident <= 0) return COAT_ERROR_CUDA;
  args.row_groups = coat_ceil_div(args.rows, kMaxThreads / args.lanes);
  const unsigned blocks = static_cast<unsigned>(args.row_groups < resident ? args.row_groups : resident);
  kKernel<<<blocks, kMaxThreads, shared_bytes, stream>>>(args);
  return launch_status();
}

// launch_rmsnorm_stats with the block size for the row's L lanes, x saved in save_format.
template <class Io, class OutIo>
coat_status launch_rmsnorm_stats(const RmsnormStatsArgs& args, coat_saved_format save_format, cudaStream_t stream) {
  return with_saved_format(save_format, [&](auto format) {
    constexpr coat_saved_format kFormat = decltype(format)::value;
    if (args.lanes <= kRowBlockThreads)
      return launch_rmsnorm_stats<kRowBlockThreads, Io, kFormat, OutIo>(args, stream);
    if (args.lanes == 512) return launch_rmsnorm_stats<512, Io, kFormat, OutIo>(args, stream);
    return launch_rmsnorm_stats<1024, Io, kFormat, OutIo>(args, stream);
  });
}

// The arguments of rmsnorm_stats_kernel shared by both forwards (y_amax, out and residual are the caller's).
RmsnormStatsArgs stats_args(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                            const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                            int64_t save_group_size, coat_saved_format save_format, uint8_t* x_saved,
                            float* x_saved_scales, float* rstd) {
  RmsnormStatsArgs args{};
  args.x = x;
  args.x_dtype = x_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.weight = weight;
  args.weight_dtype = weight_dtype;
  args.weight_offset = weight_offset;
  args.eps = eps;
  args.group_shift = coat::device::ceil_log2(save_group_size);
  args.lanes = static_cast<int>(coat_rmsnorm_lanes(cols));
  args.saved_row_bytes = static_cast<int>(saved_row_bytes(cols, save_format));
  args.x_saved = x_saved;
  args.x_saved_scales = x_saved_scales;
  args.rstd = rstd;
  return args;
}

template <int kMaxThreads, class Io, class ResidualIo>
coat_status launch_rmsnorm_backward(const RmsnormBackwardArgs& args, cudaStream_t stream) {
  const size_t shared_bytes = backward_shared_bytes<kMaxThreads>(args.cols);
  if (!allow_dynamic_shared<rmsnorm_backward_kernel<kMaxThreads, Io, ResidualIo>>(shared_bytes))
    return COAT_ERROR_CUDA;
  const unsigned blocks = static_cast<unsigned>(coat_ceil_div(args.slices, kMaxThreads / args.lanes));
  rmsnorm_backward_kernel<kMaxThreads, Io, ResidualIo><<<blocks, kMaxThreads, shared_bytes, stream>>>(args);
  return launch_status();
}

// launch_rmsnorm_backward with the block size for the row's L lanes.
template <class Io, class ResidualIo>
coat_status launch_rmsnorm_backward(const RmsnormBackwardArgs& args, cudaStream_t stream) {
  if (args.lanes <= kRowBlockThreads) return launch_rmsnorm_backward<kRowBlockThreads, Io, ResidualIo>(args, stream);
  if (args.lanes == 512) return launch_rmsnorm_backward<512, Io, ResidualIo>(args, stream);
  return launch_rmsnorm_backward<1024, Io, ResidualIo>(args, stream);
}

}  // namespace

extern "C" {

coat_status coat_rmsnorm_quantize_cuda(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const void* weight, coat_dtype weight_dtype,
                                       float weight_offset, float eps, int64_t save_group_size,
                                       coat_saved_format save_format, coat_fp8_format y_format, uint8_t* y,
                                       float* y_scale, uint8_t* y_t, uint8_t* x_saved, float* x_saved_scales,
                                       float* rstd, float* y_amax, coat_cuda_stream stream) {
  if (!valid_matrix(x, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      !isfinite(weight_offset) || !coat_is_valid_group_size(save_group_size) || y_scale == nullptr ||
      y_amax == nullptr || !valid_saved_format(save_format))
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(y_amax, 0, sizeof(float), cuda_stream) != cudaSuccess) return COAT_ERROR_CUDA;
  RmsnormStatsArgs args = stats_args(x, x_dtype, rows, cols, row_stride, weight, weight_dtype, weight_offset, eps,
                                     save_group_size, save_format, x_saved, x_saved_scales, rstd);
  args.y_amax = y_amax;
  const bool vector = cols % kChunk == 0 && rows_aligned16(x, x_dtype, row_stride) && aligned(weight, 16);
  coat_status status = COAT_SUCCESS;
  with_io(x_dtype, vector, [&](auto io) {
    using Io = decltype(io);
    if (rows > 0) status = launch_rmsnorm_stats<Io, void>(args, save_format, cuda_stream);
    if (status != COAT_SUCCESS) return;
    const RmsnormApply<HighPrecisionRows<Io>> op{{io, x, row_stride}, rstd, weight, weight_dtype,
                                                  weight_offset};
    status = launch_apply_quantize(op, rows, args.cols, OutputScale::from_amax(y_amax, y_scale), y_format, y, y_t,
                                   cuda_stream);
  });
  return status;
}

coat_status coat_rmsnorm_save_cuda(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                                   int64_t save_group_size, coat_saved_format save_format, const void* residual,
                                   coat_dtype residual_dtype, void* out, uint8_t* x_saved, float* x_saved_scales,
                                   float* rstd, coat_cuda_stream stream) {
  if (!valid_matrix(x, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      !isfinite(weight_offset) || !coat_is_valid_group_size(save_group_size) || !valid_saved_format(save_format) ||
      (rows > 0 && (out == nullptr || x_saved == nullptr || x_saved_scales == nullptr || rstd == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0) return COAT_SUCCESS;
  RmsnormStatsArgs args = stats_args(x, x_dtype, rows, cols, row_stride, weight, weight_dtype, weight_offset, eps,
                                     save_group_size, save_format, x_saved, x_saved_scales, rstd);
  args.out = out;
  args.residual = residual;
  args.out_dtype = residual != nullptr ? residual_dtype : x_dtype;
  // As in the backward: the output and a residual take the 16-byte path in x's dtype or in fp32 (an fp32 residual
  // stream); other pairs, which no layer makes, go element by element.
  const bool vector_residual = residual == nullptr || (aligned(residual, 16) && (residual_dtype == x_dtype ||
                                                                                 residual_dtype == COAT_FLOAT32));
  const bool vector = cols % kChunk == 0 && rows_aligned16(x, x_dtype, row_stride) && aligned(weight, 16) &&
                      aligned(out, 16) && vector_residual;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  coat_status status = COAT_SUCCESS;
  with_io(x_dtype, vector, [&](auto io) {
    using Io = decltype(io);
    if constexpr (Io::kVector) {
      if (args.out_dtype == x_dtype) status = launch_rmsnorm_stats<Io, Io>(args, save_format, cuda_stream);
      else status = launch_rmsnorm_stats<Io, VectorIo<COAT_FLOAT32>>(args, save_format, cuda_stream);
    } else {
      status = launch_rmsnorm_stats<Io, ElementIo>(args, save_format, cuda_stream);
    }
  });
  return status;
}

coat_status coat_rmsnorm_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const uint8_t* x_saved, const float* x_saved_scales,
                                       int64_t save_group_size, coat_saved_format saved_format, const float* rstd,
                                       const void* weight, coat_dtype weight_dtype, float weight_offset,
                                       const void* residual, coat_dtype residual_dtype, void* dx, float* dweight,
                                       float* workspace, coat_cuda_stream stream) {
  if (!valid_matrix(dy, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      !isfinite(weight_offset) || dweight == nullptr || !coat_is_valid_group_size(save_group_size) ||
      !valid_saved_format(saved_format) ||
      (rows > 0 && (x_saved == nullptr || x_saved_scales == nullptr || rstd == nullptr || dx == nullptr ||
                    workspace == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  RmsnormBackwardArgs args;
  args.dy = dy;
  args.dy_dtype = dy_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.x_saved = saved_codes(x_saved, cols, saved_format);
  args.x_saved_scales = x_saved_scales;
  args.group_shift = coat::device::ceil_log2(save_group_size);
  args.rstd = rstd;
  args.weight = weight;
  args.weight_dtype = weight_dtype;
  args.weight_offset = weight_offset;
  args.lanes = static_cast<int>(coat_rmsnorm_lanes(cols));
  args.rows_per_slice = coat_rmsnorm_backward_rows_per_slice(rows, cols);
  args.slices = rows > 0 ? coat_ceil_div(rows, args.rows_per_slice) : 0;
  args.residual = residual;
  args.dx_dtype = residual != nullptr ? residual_dtype : dy_dtype;
  args.dx = dx;
  args.workspace = workspace;
  if (rows > 0) {
    // dx and the residual are contiguous (16-byte aligned rows when cols % 8 == 0); codes move a chunk at a time.
    // A residual takes the 16-byte path in dy's dtype or in fp32 (an fp32 residual stream); other dtype pairs,
    // which no layer makes, go element by element.
    const bool vector_residual = residual == nullptr || (aligned(residual, 16) && (residual_dtype == dy_dtype ||
                                                                                   residual_dtype == COAT_FLOAT32));
    const bool vector = cols % kChunk == 0 && rows_aligned16(dy, dy_dtype, row_stride) && aligned(weight, 16) &&
                        aligned(dx, 16) && vector_aligned(args.x_saved) && vector_residual;
    coat_status status = COAT_SUCCESS;
    with_io(dy_dtype, vector, [&](auto io) {
      using Io = decltype(io);
      if (residual == nullptr) {
        status = launch_rmsnorm_backward<Io, void>(args, cuda_stream);
      } else if constexpr (Io::kVector) {
        if (residual_dtype == dy_dtype) status = launch_rmsnorm_backward<Io, Io>(args, cuda_stream);
        else status = launch_rmsnorm_backward<Io, VectorIo<COAT_FLOAT32>>(args, cuda_stream);
      } else {
        status = launch_rmsnorm_backward<Io, ElementIo>(args, cuda_stream);
      }
    });
    if (status != COAT_SUCCESS) return status;
  }
  const unsigned finish_blocks = static_cast<unsigned>(coat_ceil_div(cols, kWarpSize));
  dweight_finish_kernel<<<finish_blocks, kWarpSize * COAT_DWEIGHT_PHASES, 0, cuda_stream>>>(workspace, args.slices,
                                                                                            args.cols, dweight);
  return launch_status();
}

coat_status coat_rmsnorm_requantize_cuda(const uint8_t* x_saved, const float* x_saved_scales, int64_t save_group_size,
                                         coat_saved_format saved_format, const float* rstd, int64_t rows, int64_t cols,
                                         const void* weight, coat_dtype weight_dtype, float weight_offset,
                                         const float* y_scale, coat_fp8_format y_format, uint8_t* y_t,
                                         coat_cuda_stream stream) {
  if (rows < 0 || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr || !isfinite(weight_offset) ||
      y_scale == nullptr ||
      !coat_is_valid_group_size(save_group_size) || !valid_saved_format(saved_format) ||
      (rows > 0 && (x_saved == nullptr || x_saved_scales == nullptr || rstd == nullptr || y_t == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0) return COAT_SUCCESS;
  const int group_shift = coat::device::ceil_log2(save_group_size);
  const int ngroups = static_cast<int>(coat_ceil_div(cols, save_group_size));
  const SavedCodes codes = saved_codes(x_saved, cols, saved_format);
  const bool vector = cols % kChunk == 0 && vector_aligned(codes) && aligned(weight, 16);
  return with_saved_rows(vector, codes.format, [&](auto vector_codes, auto format) {
    using Saved = SavedRows<decltype(vector_codes)::value, decltype(format)::value>;
    const RmsnormApply<Saved> op{Saved{codes, x_saved_scales, ngroups, group_shift}, rstd, weight, weight_dtype,
                         weight_offset};
    return launch_apply_quantize(op, rows, static_cast<int>(cols), OutputScale::of(y_scale), y_format, nullptr, y_t,
                                 reinterpret_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
