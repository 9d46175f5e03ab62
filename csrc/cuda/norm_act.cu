// CUDA implementation of coat/norm_act.h. Element math and reduction orders come from
// coat/detail/norm_act_math.h, so every output equals the C core's (csrc/cpu/norm_act.c) bit for bit.
//
// Work is cut into chunks of 8 consecutive elements of a row (one 16-byte load of bf16/fp16, two of
// fp32). The vectorized path needs cols % 8 == 0 and 16-byte aligned rows; otherwise the same kernels load
// element by element, which changes the speed but not a single result bit.
//
// Kernels:
//   rmsnorm_stats_kernel     L threads per row (L = coat_rmsnorm_lanes(cols)): rstd, the FP8-saved x,
//                            the amax of y (one guarded atomicMax per warp)
//   silu_mul_stats_kernel    one thread per chunk: the FP8-saved gate and up, the amax of y
//   apply_quantize_kernel    64 x 64 tiles: recomputes y from the inputs, writes y in FP8 and, through a
//                            shared-memory tile, its transpose
//   rmsnorm_backward_kernel  L threads per slice of rows: dx, and one partial dweight row per slice
//   dweight_finish_kernel    the slices' partial dweight rows summed in the documented order
//   silu_mul_backward_kernel one thread per chunk: dgate, dup
#include <cuda_runtime.h>

#include <type_traits>

#include "coat/detail/norm_act_math.h"
#include "coat/norm_act.h"
#include "group_amax.cuh"
#include "launch.cuh"

namespace {

using coat::device::group_amax_reduce;
using coat::device::launch_status;

constexpr int kChunk = COAT_NORM_ACT_CHUNK;
constexpr int kChunksPerLane = COAT_RMSNORM_MAX_CHUNKS_PER_LANE;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWarpSize = 32;
// Rows of L <= 256 lanes share 256-thread blocks; wider rows get a block of their own.
constexpr int kRowBlockThreads = 256;
constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kTileThreads = 256;
constexpr int kMaxGridY = 65535;

static_assert(kChunk == 8, "the loads and stores below move 8 elements per chunk");

// ---------------------------------------------------------------------------------------------------
// Loads and stores of one chunk

__device__ __forceinline__ size_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

// Row `row` of a matrix whose rows start row_stride elements apart. Offsets within a row are ints
// (cols <= COAT_NORM_ACT_MAX_COLS); row offsets are 64-bit.
template <class T>
__device__ __forceinline__ T* row_at(T* base, coat_dtype dtype, int64_t row, int64_t row_stride) {
  using Byte = typename std::conditional<std::is_const<T>::value, const char, char>::type;
  const size_t offset = static_cast<size_t>(row) * static_cast<size_t>(row_stride) * element_size(dtype);
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + offset);
}

__device__ __forceinline__ void unpack_16bit(uint32_t pair, coat_dtype dtype, float* out) {
  if (dtype == COAT_BFLOAT16) {
    out[0] = __uint_as_float(pair << 16);
    out[1] = __uint_as_float(pair & 0xFFFF0000u);
  } else {
    out[0] = coat_f16_to_f32(static_cast<uint16_t>(pair & 0xFFFFu));
    out[1] = coat_f16_to_f32(static_cast<uint16_t>(pair >> 16));
  }
}

// The chunk helpers take `vector` when cols % 8 == 0 and rows are 16-byte aligned: then every chunk is
// either whole (count == 8) or past the row (count == 0), and whole chunks move with 16-byte accesses
// (8-byte for FP8 codes). Otherwise they go element by element.

// v[0..8) = elements [offset, offset + count) of `data` as fp32, zeros past count.
__device__ __forceinline__ void load_chunk(const void* data, coat_dtype dtype, int offset, int count, bool vector,
                                           float v[kChunk]) {
  if (vector) {
    if (count == 0) {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[e] = 0.0f;
    } else if (dtype == COAT_FLOAT32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(data) + offset);
      const float4 a = p[0], b = p[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + offset);
      unpack_16bit(raw.x, dtype, v);
      unpack_16bit(raw.y, dtype, v + 2);
      unpack_16bit(raw.z, dtype, v + 4);
      unpack_16bit(raw.w, dtype, v + 6);
    }
    return;
  }
  // One dtype branch per chunk, not per element.
  if (dtype == COAT_FLOAT32) {
    const float* p = static_cast<const float*>(data) + offset;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) v[e] = e < count ? p[e] : 0.0f;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(data) + offset;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const uint16_t h = e < count ? p[e] : 0;
      v[e] = dtype == COAT_BFLOAT16 ? coat_bf16_to_f32(h) : coat_f16_to_f32(h);
    }
  }
}

// Eight FP8 codes, byte e of the chunk in byte e % 4 of word e / 4.
struct Codes {
  uint32_t lo;
  uint32_t hi;
};

__device__ __forceinline__ Codes load_codes(const uint8_t* src, int count, bool vector) {
  if (vector) {
    if (count == 0) return {0u, 0u};
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    return {raw.x, raw.y};
  }
  Codes codes{0u, 0u};
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    if (e < count) {
      if (e < 4) codes.lo |= static_cast<uint32_t>(src[e]) << (8 * e);
      else codes.hi |= static_cast<uint32_t>(src[e]) << (8 * (e - 4));
    }
  }
  return codes;
}

__device__ __forceinline__ uint8_t code_at(Codes codes, int e) {
  return static_cast<uint8_t>((e < 4 ? codes.lo >> (8 * e) : codes.hi >> (8 * (e - 4))) & 0xFFu);
}

__device__ __forceinline__ void store_codes(uint8_t* dst, Codes codes, int count, bool vector) {
  if (vector) {
    if (count > 0) *reinterpret_cast<uint2*>(dst) = make_uint2(codes.lo, codes.hi);
    return;
  }
#pragma unroll
  for (int e = 0; e < kChunk; ++e)
    if (e < count) dst[e] = code_at(codes, e);
}

// Encodes v / scale; elements past count encode 0 (their codes are never stored, but a tile holds them).
__device__ __forceinline__ Codes encode_chunk(const float v[kChunk], int count, float scale, coat_fp8_format format) {
  Codes codes{0u, 0u};
  const float reciprocal = 1.0f / scale;
  // One branch per chunk on the format, so that the per-element encoder is the straight-line one.
  if (format == COAT_E4M3) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const uint32_t code = e < count ? coat_quantize_scaled(v[e], scale, reciprocal, COAT_E4M3) : 0u;
      if (e < 4) codes.lo |= code << (8 * e);
      else codes.hi |= code << (8 * (e - 4));
    }
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const uint32_t code = e < count ? coat_quantize_scaled(v[e], scale, reciprocal, COAT_E5M2) : 0u;
      if (e < 4) codes.lo |= code << (8 * e);
      else codes.hi |= code << (8 * (e - 4));
    }
  }
  return codes;
}

template <coat_dtype kDtype>
__device__ __forceinline__ uint32_t pack_16bit(float a, float b) {
  if constexpr (kDtype == COAT_BFLOAT16)
    return static_cast<uint32_t>(coat_f32_to_bf16(a)) | (static_cast<uint32_t>(coat_f32_to_bf16(b)) << 16);
  else
    return static_cast<uint32_t>(coat_f32_to_f16(a)) | (static_cast<uint32_t>(coat_f32_to_f16(b)) << 16);
}

template <coat_dtype kDtype>
__device__ __forceinline__ uint4 pack_chunk(const float v[kChunk]) {
  return make_uint4(pack_16bit<kDtype>(v[0], v[1]), pack_16bit<kDtype>(v[2], v[3]), pack_16bit<kDtype>(v[4], v[5]),
                    pack_16bit<kDtype>(v[6], v[7]));
}

// Stores v[0..count) as elements [offset, offset + count) of `out` in `dtype` (NaN canonical).
__device__ __forceinline__ void store_chunk(void* out, coat_dtype dtype, int offset, int count, bool vector,
                                            const float v[kChunk]) {
  if (vector) {
    if (count == 0) return;
    if (dtype == COAT_FLOAT32) {
      float4* p = reinterpret_cast<float4*>(static_cast<float*>(out) + offset);
      p[0] = make_float4(coat_canonical_nan(v[0]), coat_canonical_nan(v[1]), coat_canonical_nan(v[2]),
                         coat_canonical_nan(v[3]));
      p[1] = make_float4(coat_canonical_nan(v[4]), coat_canonical_nan(v[5]), coat_canonical_nan(v[6]),
                         coat_canonical_nan(v[7]));
    } else {
      uint4* p = reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + offset);
      *p = dtype == COAT_BFLOAT16 ? pack_chunk<COAT_BFLOAT16>(v) : pack_chunk<COAT_FLOAT16>(v);
    }
    return;
  }
  if (dtype == COAT_FLOAT32) {
    float* p = static_cast<float*>(out) + offset;
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) p[e] = coat_canonical_nan(v[e]);
  } else {
    uint16_t* p = static_cast<uint16_t*>(out) + offset;
    const bool bf16 = dtype == COAT_BFLOAT16;
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) p[e] = bf16 ? coat_f32_to_bf16(v[e]) : coat_f32_to_f16(v[e]);
  }
}

__device__ __forceinline__ int chunk_count(int col, int cols) { return col < cols ? min(cols - col, kChunk) : 0; }

// ---------------------------------------------------------------------------------------------------
// Reductions

__device__ __forceinline__ float warp_max(float v) { return group_amax_reduce(v, kWarpSize); }

// The row's sum of one partial per lane, in the order of coat_combine_lane_partials: xor butterfly in each
// warp (lane l adds lane l + 16, + 8, ..., + 1), then across the row's warps the same way. Every thread of
// the block must call it (it synchronizes when a row spans warps); warp_sums holds one float per warp.
__device__ __forceinline__ float row_sum(float partial, int lanes, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) partial = partial + __shfl_xor_sync(kFullMask, partial, offset);
  if (lanes == kWarpSize) return partial;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warps_per_row = lanes / kWarpSize;
  if (lane == 0) warp_sums[warp] = partial;
  __syncthreads();
  float v = lane < warps_per_row ? warp_sums[warp - warp % warps_per_row + lane] : 0.0f;
  for (int offset = warps_per_row / 2; offset > 0; offset >>= 1) v = v + __shfl_xor_sync(kFullMask, v, offset);
  return __shfl_sync(kFullMask, v, 0);
}

// amax = max(amax, value) for value >= 0 and not NaN: such floats order like their bit patterns. The read
// first skips the atomic whenever it cannot raise the maximum, which after the first few warps is always.
__device__ __forceinline__ void atomic_max_nonnegative(float* amax, float value) {
  if (value > *reinterpret_cast<volatile float*>(amax))
    atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(value));
}

// Saves one chunk of an input as E4M3 with 1 x group_size groups (group_size / 8 consecutive lanes hold a
// group); the group's first lane stores the scale. All lanes of the warp must call it.
__device__ __forceinline__ void save_chunk(const float v[kChunk], int count, int col, int lanes_per_group,
                                           int group_size, uint8_t* saved_row, float* scales_row, bool vector) {
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) amax = coat_amax_step(amax, v[e]);
  amax = group_amax_reduce(amax, lanes_per_group);
  if (count == 0) return;
  const float scale = coat_scale_from_amax(amax, COAT_E4M3);
  store_codes(saved_row + col, encode_chunk(v, count, scale, COAT_E4M3), count, vector);
  if (col % group_size == 0) scales_row[col / group_size] = scale;
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm forward

struct RmsnormStatsArgs {
  const void* x;
  coat_dtype x_dtype;
  int64_t rows;
  int cols;
  int64_t row_stride;
  const void* weight;
  coat_dtype weight_dtype;
  float eps;
  int group_size;
  int lanes;
  bool vector;
  uint8_t* x_saved;
  float* x_saved_scales;
  float* rstd;
  float* y_amax;
};

template <int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, 1) rmsnorm_stats_kernel(RmsnormStatsArgs a) {
  __shared__ float warp_sums[kMaxThreads / kWarpSize];
  const int lane = threadIdx.x % a.lanes;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / a.lanes) + threadIdx.x / a.lanes;
  const bool row_active = row < a.rows;
  const int64_t safe_row = row_active ? row : 0;
  const int chunks = (a.cols + kChunk - 1) / kChunk;
  const int ngroups = (a.cols + a.group_size - 1) / a.group_size;
  const void* x_row = row_at(a.x, a.x_dtype, safe_row, a.row_stride);
  uint8_t* saved_row = a.x_saved + safe_row * a.cols;
  float* scales_row = a.x_saved_scales + safe_row * ngroups;

  // The row stays in registers: x^2 for rstd, and the FP8 copy saved for backward, in one read.
  float x[kChunksPerLane][kChunk];
  float partial = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    if (k * a.lanes >= chunks) break;  // uniform over the block
    const int col = (lane + k * a.lanes) * kChunk;
    const int count = row_active ? chunk_count(col, a.cols) : 0;
    load_chunk(x_row, a.x_dtype, col, count, a.vector, x[k]);
    // Terms past the row are +0; adding them changes nothing, as a partial is never -0.
#pragma unroll
    for (int e = 0; e < kChunk; ++e) partial = partial + x[k][e] * x[k][e];
    save_chunk(x[k], count, col, a.group_size / kChunk, a.group_size, saved_row, scales_row, a.vector);
  }
  const float rstd = coat_rmsnorm_rstd(row_sum(partial, a.lanes, warp_sums), a.cols, a.eps);
  if (row_active && lane == 0) a.rstd[row] = coat_canonical_nan(rstd);

  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    if (k * a.lanes >= chunks) break;
    const int col = (lane + k * a.lanes) * kChunk;
    const int count = row_active ? chunk_count(col, a.cols) : 0;
    if (count == 0) continue;
    float weight[kChunk];
    load_chunk(a.weight, a.weight_dtype, col, count, a.vector, weight);
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) amax = coat_amax_step(amax, coat_rmsnorm_apply(x[k][e], rstd, weight[e]));
  }
  amax = warp_max(amax);
  if (threadIdx.x % kWarpSize == 0) atomic_max_nonnegative(a.y_amax, amax);
}

// y recomputed for the chunk at (row, col): RMSNorm from x, rstd and weight.
struct RmsnormApply {
  const void* x;
  coat_dtype x_dtype;
  int64_t row_stride;
  const float* rstd;
  const void* weight;
  coat_dtype weight_dtype;

  __device__ __forceinline__ void operator()(int64_t row, int col, int count, bool vector, float y[kChunk]) const {
    float x_chunk[kChunk], weight_chunk[kChunk];
    load_chunk(row_at(x, x_dtype, row, row_stride), x_dtype, col, count, vector, x_chunk);
    load_chunk(weight, weight_dtype, col, count, vector, weight_chunk);
    const float row_rstd = rstd[row];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) y[e] = coat_rmsnorm_apply(x_chunk[e], row_rstd, weight_chunk[e]);
  }
};

// y recomputed for the chunk at (row, col): SiLU*mul from gate, up and the optional smooth scale.
struct SiluMulApply {
  const void* gate;
  const void* up;
  coat_dtype dtype;
  int64_t gate_row_stride, up_row_stride;
  const float* smooth_scale;

  __device__ __forceinline__ void operator()(int64_t row, int col, int count, bool vector, float y[kChunk]) const {
    float gate_chunk[kChunk], up_chunk[kChunk], smooth[kChunk];
    load_chunk(row_at(gate, dtype, row, gate_row_stride), dtype, col, count, vector, gate_chunk);
    load_chunk(row_at(up, dtype, row, up_row_stride), dtype, col, count, vector, up_chunk);
    if (smooth_scale != nullptr) {
      load_chunk(smooth_scale, COAT_FLOAT32, col, count, vector, smooth);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) smooth[e] = 1.0f;
    }
#pragma unroll
    for (int e = 0; e < kChunk; ++e) y[e] = coat_silu_mul(gate_chunk[e], up_chunk[e], smooth[e]);
  }
};

// 4 x 4 byte transpose: word i holds row i's 4 bytes (columns 0..3); result word j holds column j's 4 bytes.
__device__ __forceinline__ void transpose_4x4(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, uint32_t out[4]) {
  const uint32_t rows01_low = __byte_perm(w0, w1, 0x5140), rows23_low = __byte_perm(w2, w3, 0x5140);
  const uint32_t rows01_high = __byte_perm(w0, w1, 0x7362), rows23_high = __byte_perm(w2, w3, 0x7362);
  out[0] = __byte_perm(rows01_low, rows23_low, 0x5410);
  out[1] = __byte_perm(rows01_low, rows23_low, 0x7632);
  out[2] = __byte_perm(rows01_high, rows23_high, 0x5410);
  out[3] = __byte_perm(rows01_high, rows23_high, 0x7632);
}

// Second pass of both forward ops: y = op(inputs) for a 64 x 64 tile, quantized with the per-tensor scale
// derived from y_amax, written row-major and, when y_t is set, transposed through shared memory.
template <class Op>
__global__ void __launch_bounds__(kTileThreads)
    apply_quantize_kernel(Op op, int64_t rows, int cols, bool vector, const float* y_amax, coat_fp8_format format,
                          uint8_t* y, float* y_scale, uint8_t* y_t) {
  // 64 rows of 64 codes as 16 words, plus one word of padding so that the transposed reads of a warp
  // (8 row quads x 4 column quads) hit 32 different banks.
  __shared__ uint32_t tile[kTileRows][kTileCols / 4 + 1];
  const float scale = coat_scale_from_amax(*y_amax, format);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *y_scale = scale;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int col_tiles = (cols + kTileCols - 1) / kTileCols;
  const int chunk_in_row = threadIdx.x % (kTileCols / kChunk);

  for (int col_tile = blockIdx.y; col_tile < col_tiles; col_tile += gridDim.y) {
    const int col0 = col_tile * kTileCols;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = threadIdx.x / (kTileCols / kChunk) + half * (kTileThreads * kChunk / kTileCols);
      const int64_t row = row0 + r;
      const int col = col0 + chunk_in_row * kChunk;
      const int count = row < rows ? chunk_count(col, cols) : 0;
      Codes codes{0u, 0u};
      if (count > 0) {
        float values[kChunk];
        op(row, col, count, vector, values);
        codes = encode_chunk(values, count, scale, format);
        store_codes(y + row * cols + col, codes, count, vector);
      }
      tile[r][2 * chunk_in_row] = codes.lo;
      tile[r][2 * chunk_in_row + 1] = codes.hi;
    }
    if (y_t == nullptr) continue;  // uniform over the grid
    __syncthreads();
    // Each thread transposes a 4 x 4 block; a warp covers 8 row quads of 4 column quads, so every column
    // of y_t gets 32 contiguous bytes from 8 lanes.
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int col_quad = (warp % 4) * 4 + lane / 8, row_quad = (warp / 4) * 8 + lane % 8;
    uint32_t columns[4];
    transpose_4x4(tile[4 * row_quad][col_quad], tile[4 * row_quad + 1][col_quad], tile[4 * row_quad + 2][col_quad],
                  tile[4 * row_quad + 3][col_quad], columns);
    const int64_t row = row0 + 4 * row_quad;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = col0 + 4 * col_quad + j;
      if (col >= cols || row >= rows) continue;
      uint8_t* dst = y_t + col * rows + row;
      if (rows % 4 == 0) {  // then row + 3 < rows and dst is 4-byte aligned
        *reinterpret_cast<uint32_t*>(dst) = columns[j];
      } else {
        for (int i = 0; i < 4 && row + i < rows; ++i) dst[i] = static_cast<uint8_t>(columns[j] >> (8 * i));
      }
    }
    __syncthreads();  // the tile is rewritten for the next column tile
  }
}

// ---------------------------------------------------------------------------------------------------
// SiLU*mul forward, first pass

struct SiluMulStatsArgs {
  const void* gate;
  const void* up;
  coat_dtype dtype;
  int64_t rows;
  int cols;
  int64_t gate_row_stride, up_row_stride;
  const float* smooth_scale;
  int group_size;
  bool vector;
  uint8_t* gate_saved;
  float* gate_scales;
  uint8_t* up_saved;
  float* up_scales;
  float* y_amax;
};

// Blocks of 32 chunks x 8 rows; a warp is 32 consecutive chunks of one row, so the group_size / 8 lanes of
// a quantization group are always in one warp. Rows are strided over gridDim.y.
__global__ void __launch_bounds__(256) silu_mul_stats_kernel(SiluMulStatsArgs a) {
  const int col = (blockIdx.x * kWarpSize + threadIdx.x) * kChunk;
  const int count = chunk_count(col, a.cols);
  const int ngroups = (a.cols + a.group_size - 1) / a.group_size;
  float smooth[kChunk];
  if (a.smooth_scale != nullptr) {
    load_chunk(a.smooth_scale, COAT_FLOAT32, col, count, a.vector, smooth);
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) smooth[e] = 1.0f;
  }
  float amax = 0.0f;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < a.rows;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    float gate[kChunk], up[kChunk];
    load_chunk(row_at(a.gate, a.dtype, row, a.gate_row_stride), a.dtype, col, count, a.vector, gate);
    load_chunk(row_at(a.up, a.dtype, row, a.up_row_stride), a.dtype, col, count, a.vector, up);
    save_chunk(gate, count, col, a.group_size / kChunk, a.group_size, a.gate_saved + row * a.cols,
               a.gate_scales + row * ngroups, a.vector);
    save_chunk(up, count, col, a.group_size / kChunk, a.group_size, a.up_saved + row * a.cols,
               a.up_scales + row * ngroups, a.vector);
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      if (e < count) amax = coat_amax_step(amax, coat_silu_mul(gate[e], up[e], smooth[e]));
  }
  amax = warp_max(amax);
  if (threadIdx.x == 0) atomic_max_nonnegative(a.y_amax, amax);
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm backward

struct RmsnormBackwardArgs {
  const void* dy;
  coat_dtype dy_dtype;
  int64_t rows;
  int cols;
  int64_t row_stride;
  const uint8_t* x_saved;
  const float* x_saved_scales;
  int group_size;
  const float* rstd;
  const void* weight;
  coat_dtype weight_dtype;
  int lanes;
  int64_t rows_per_slice, slices;
  void* dx;
  float* workspace;
};

// What a lane keeps of a row between the two sweeps: xhat itself or, where registers are short (1024-thread
// blocks have 64 per thread), the 8-bit codes and the scale, from which the second sweep recomputes it.
template <bool kCompact>
struct RowXhat {
  float xhat[kChunksPerLane][kChunk];
  __device__ __forceinline__ void keep(int k, Codes, float, const float chunk_xhat[kChunk]) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) xhat[k][e] = chunk_xhat[e];
  }
  __device__ __forceinline__ float at(int k, int e, int, float) const { return xhat[k][e]; }
};

template <>
struct RowXhat<true> {
  Codes codes[kChunksPerLane];
  float scales[kChunksPerLane];
  __device__ __forceinline__ void keep(int k, Codes chunk_codes, float scale, const float*) {
    codes[k] = chunk_codes;
    scales[k] = scale;
  }
  __device__ __forceinline__ float at(int k, int e, int count, float rstd) const {
    return e < count ? coat_rmsnorm_xhat(code_at(codes[k], e), scales[k], rstd) : 0.0f;
  }
};

// A lane's dweight partial sums (kChunksPerLane x 8 columns) across the rows of its slice: in registers or,
// again where registers are short, in a thread-private part of dynamic shared memory, laid out so that a
// warp's accesses hit 32 different banks.
template <bool kInShared>
struct DweightPartials {
  float values[kChunksPerLane][kChunk];
  __device__ __forceinline__ float& at(int k, int e) { return values[k][e]; }
};

template <>
struct DweightPartials<true> {
  float* mine;  // element (k, e) at mine[(k * kChunk + e) * blockDim.x]
  __device__ __forceinline__ float& at(int k, int e) { return mine[(k * kChunk + e) * blockDim.x]; }
};

template <int kMaxThreads>
constexpr bool kRegistersShort = kMaxThreads > 512;

template <int kMaxThreads>
constexpr size_t kDweightSharedBytes =
    kRegistersShort<kMaxThreads> ? sizeof(float) * kChunksPerLane * kChunk * kMaxThreads : 0;

// L threads per slice of rows; each lane accumulates the dweight partial sums of its own columns across the
// slice's rows and writes them to the slice's workspace row at the end. kVector: the 16-byte path only
// (cols % 8 == 0, aligned rows), which keeps the hot variant free of the element-wise code and its registers.
template <int kMaxThreads, bool kVector>
__global__ void __launch_bounds__(kMaxThreads, 1) rmsnorm_backward_kernel(RmsnormBackwardArgs a) {
  // Two buffers, alternating by row, so that a row's reads and the next row's writes never race.
  __shared__ float warp_sums[2][kMaxThreads / kWarpSize];
  extern __shared__ float shared_partials[];
  const int lane = threadIdx.x % a.lanes;
  const int64_t slice = static_cast<int64_t>(blockIdx.x) * (blockDim.x / a.lanes) + threadIdx.x / a.lanes;
  const int chunks = (a.cols + kChunk - 1) / kChunk;
  const int ngroups = (a.cols + a.group_size - 1) / a.group_size;
  DweightPartials<kRegistersShort<kMaxThreads>> dweight;
  if constexpr (kRegistersShort<kMaxThreads>) dweight.mine = shared_partials + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k)
#pragma unroll
    for (int e = 0; e < kChunk; ++e) dweight.at(k, e) = 0.0f;

  for (int64_t i = 0; i < a.rows_per_slice; ++i) {  // the same trip count for every thread of the block
    const int64_t row = slice * a.rows_per_slice + i;
    const bool active = slice < a.slices && row < a.rows;
    const int64_t safe_row = active ? row : 0;
    const void* dy_row = row_at(a.dy, a.dy_dtype, safe_row, a.row_stride);
    const uint8_t* codes_row = a.x_saved + safe_row * a.cols;
    const float* scales_row = a.x_saved_scales + safe_row * ngroups;
    void* dx_row = row_at(a.dx, a.dy_dtype, safe_row, a.cols);
    const float rstd = active ? a.rstd[row] : 0.0f;
    // xhat stays in registers between the two sweeps; dy and weight are read again in the second (L1
    // hits), which halves the registers the row needs.
    RowXhat<kRegistersShort<kMaxThreads>> row_xhat;
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;  // uniform over the block
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      float dy[kChunk], weight[kChunk], xhat[kChunk];
      load_chunk(dy_row, a.dy_dtype, col, count, kVector, dy);
      load_chunk(a.weight, a.weight_dtype, col, count, kVector, weight);
      const Codes codes = load_codes(codes_row + col, count, kVector);
      const float scale = count > 0 ? scales_row[col / a.group_size] : 0.0f;
      // Terms past the row are +0 (as in the forward, adding them changes nothing).
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        xhat[e] = e < count ? coat_rmsnorm_xhat(code_at(codes, e), scale, rstd) : 0.0f;
        partial = partial + (dy[e] * weight[e]) * xhat[e];
      }
      row_xhat.keep(k, codes, scale, xhat);
    }
    const float mean_dot = coat_div_rn(row_sum(partial, a.lanes, warp_sums[i % 2]), static_cast<float>(a.cols));
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      if (k * a.lanes >= chunks) break;
      const int col = (lane + k * a.lanes) * kChunk;
      const int count = active ? chunk_count(col, a.cols) : 0;
      if (count == 0) continue;
      float dy[kChunk], weight[kChunk], dx[kChunk];
      load_chunk(dy_row, a.dy_dtype, col, count, kVector, dy);
      load_chunk(a.weight, a.weight_dtype, col, count, kVector, weight);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        const float xhat = row_xhat.at(k, e, count, rstd);
        dx[e] = coat_rmsnorm_dx(dy[e] * weight[e], xhat, mean_dot, rstd);
        dweight.at(k, e) = dweight.at(k, e) + dy[e] * xhat;
      }
      store_chunk(dx_row, a.dy_dtype, col, count, kVector, dx);
    }
  }
  if (slice >= a.slices) return;
  float* workspace_row = a.workspace + slice * a.cols;
#pragma unroll
  for (int k = 0; k < kChunksPerLane; ++k) {
    const int col = (lane + k * a.lanes) * kChunk;
    const int count = chunk_count(col, a.cols);
    if (count == 0) continue;
    float partials[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) partials[e] = dweight.at(k, e);
    store_chunk(workspace_row, COAT_FLOAT32, col, count, kVector, partials);
  }
}

template <int kMaxThreads, bool kVector>
void launch_rmsnorm_backward(const RmsnormBackwardArgs& args, unsigned blocks, cudaStream_t stream) {
  constexpr size_t shared_bytes = kDweightSharedBytes<kMaxThreads>;
  if constexpr (shared_bytes > 0)
    cudaFuncSetAttribute(rmsnorm_backward_kernel<kMaxThreads, kVector>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(shared_bytes));
  rmsnorm_backward_kernel<kMaxThreads, kVector><<<blocks, kMaxThreads, shared_bytes, stream>>>(args);
}

template <int kMaxThreads>
void launch_rmsnorm_backward(const RmsnormBackwardArgs& args, bool vector, unsigned blocks, cudaStream_t stream) {
  if (vector)
    launch_rmsnorm_backward<kMaxThreads, true>(args, blocks, stream);
  else
    launch_rmsnorm_backward<kMaxThreads, false>(args, blocks, stream);
}

// dweight[c] = the slices' partial sums in the documented order: phase p (threadIdx.y) adds slices
// p, p + 16, ... in increasing order, then the 16 phases are combined pairwise.
__global__ void __launch_bounds__(kWarpSize * COAT_DWEIGHT_PHASES)
    dweight_finish_kernel(const float* workspace, int64_t slices, int cols, float* dweight) {
  __shared__ float phase_sums[COAT_DWEIGHT_PHASES][kWarpSize + 1];
  const int col = blockIdx.x * kWarpSize + threadIdx.x;
  float sum = 0.0f;
  if (col < cols) {
#pragma unroll 4
    for (int64_t slice = threadIdx.y; slice < slices; slice += COAT_DWEIGHT_PHASES)
      sum = sum + workspace[slice * cols + col];
  }
  phase_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float phases[COAT_DWEIGHT_PHASES];
#pragma unroll
  for (int p = 0; p < COAT_DWEIGHT_PHASES; ++p) phases[p] = phase_sums[p][threadIdx.x];
  dweight[col] = coat_canonical_nan(coat_combine_dweight_phases(phases));
}

// ---------------------------------------------------------------------------------------------------
// SiLU*mul backward

struct SiluMulBackwardArgs {
  const void* dy;
  coat_dtype dy_dtype;
  int64_t rows;
  int cols;
  int64_t row_stride;
  const uint8_t* gate_saved;
  const float* gate_scales;
  const uint8_t* up_saved;
  const float* up_scales;
  const float* smooth_scale;
  int group_size;
  bool vector;
  void* dgate;
  void* dup;
};

// Blocks of 32 chunks x 8 rows, rows strided over gridDim.y, as silu_mul_stats_kernel.
__global__ void __launch_bounds__(256) silu_mul_backward_kernel(SiluMulBackwardArgs a) {
  const int col = (blockIdx.x * kWarpSize + threadIdx.x) * kChunk;
  const int count = chunk_count(col, a.cols);
  if (count == 0) return;
  const int ngroups = (a.cols + a.group_size - 1) / a.group_size;
  float smooth[kChunk];
  if (a.smooth_scale != nullptr) {
    load_chunk(a.smooth_scale, COAT_FLOAT32, col, count, a.vector, smooth);
  } else {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) smooth[e] = 1.0f;
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < a.rows;
       row += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    float dy[kChunk], dgate[kChunk], dup[kChunk];
    load_chunk(row_at(a.dy, a.dy_dtype, row, a.row_stride), a.dy_dtype, col, count, a.vector, dy);
    const Codes gate_codes = load_codes(a.gate_saved + row * a.cols + col, count, a.vector);
    const Codes up_codes = load_codes(a.up_saved + row * a.cols + col, count, a.vector);
    const float gate_scale = a.gate_scales[row * ngroups + col / a.group_size];
    const float up_scale = a.up_scales[row * ngroups + col / a.group_size];
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      coat_silu_mul_grads(dy[e], coat_e4m3_to_f32(code_at(gate_codes, e)) * gate_scale,
                          coat_e4m3_to_f32(code_at(up_codes, e)) * up_scale, smooth[e], &dgate[e], &dup[e]);
    store_chunk(row_at(a.dgate, a.dy_dtype, row, a.cols), a.dy_dtype, col, count, a.vector, dgate);
    store_chunk(row_at(a.dup, a.dy_dtype, row, a.cols), a.dy_dtype, col, count, a.vector, dup);
  }
}

// ---------------------------------------------------------------------------------------------------
// Launch helpers

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool rows_aligned16(const void* base, coat_dtype dtype, int64_t row_stride) {
  return aligned(base, 16) && (row_stride * (dtype == COAT_FLOAT32 ? 4 : 2)) % 16 == 0;
}

bool valid_matrix(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && cols <= COAT_NORM_ACT_MAX_COLS && row_stride >= cols &&
         (x != nullptr || rows * cols == 0);
}

// Blocks along a grid dimension that is limited to 65535 (kernels stride over the rest).
unsigned limited_blocks(int64_t items, int64_t per_block) {
  const int64_t blocks = coat_ceil_div(items, per_block);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGridY ? kMaxGridY : blocks));
}

// The second pass of both forward ops, on 64 x 64 tiles: row tiles over grid.x, column tiles over grid.y.
template <class Op>
void launch_apply_quantize(const Op& op, int64_t rows, int cols, bool vector, const float* y_amax,
                           coat_fp8_format format, uint8_t* y, float* y_scale, uint8_t* y_t, cudaStream_t stream) {
  const int64_t row_tiles = coat_ceil_div(rows, kTileRows);
  // At least one block, which writes y_scale even for an empty tensor.
  const dim3 grid(static_cast<unsigned>(row_tiles < 1 ? 1 : row_tiles), limited_blocks(cols, kTileCols));
  apply_quantize_kernel<Op><<<grid, kTileThreads, 0, stream>>>(op, rows, cols, vector, y_amax, format, y, y_scale, y_t);
}

template <int kMaxThreads>
void launch_rmsnorm_stats(const RmsnormStatsArgs& args, unsigned blocks, cudaStream_t stream) {
  rmsnorm_stats_kernel<kMaxThreads><<<blocks, kMaxThreads, 0, stream>>>(args);
}

}  // namespace

extern "C" {

coat_status coat_rmsnorm_quantize_cuda(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const void* weight, coat_dtype weight_dtype, float eps,
                                       int64_t save_group_size, coat_fp8_format y_format, uint8_t* y,
                                       float* y_scale, uint8_t* y_t, uint8_t* x_saved, float* x_saved_scales,
                                       float* rstd, float* y_amax, coat_cuda_stream stream) {
  if (!valid_matrix(x, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      !coat_is_valid_group_size(save_group_size) || y_scale == nullptr || y_amax == nullptr)
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(y_amax, 0, sizeof(float), cuda_stream) != cudaSuccess) return COAT_ERROR_CUDA;
  RmsnormStatsArgs args;
  args.x = x;
  args.x_dtype = x_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.weight = weight;
  args.weight_dtype = weight_dtype;
  args.eps = eps;
  args.group_size = static_cast<int>(save_group_size);
  args.lanes = static_cast<int>(coat_rmsnorm_lanes(cols));
  args.vector = cols % kChunk == 0 && rows_aligned16(x, x_dtype, row_stride) && aligned(weight, 16);
  args.x_saved = x_saved;
  args.x_saved_scales = x_saved_scales;
  args.rstd = rstd;
  args.y_amax = y_amax;
  if (rows > 0) {
    const int threads = args.lanes > kRowBlockThreads ? args.lanes : kRowBlockThreads;
    const unsigned blocks = static_cast<unsigned>(coat_ceil_div(rows, threads / args.lanes));
    if (threads == kRowBlockThreads)
      launch_rmsnorm_stats<kRowBlockThreads>(args, blocks, cuda_stream);
    else if (threads == 512)
      launch_rmsnorm_stats<512>(args, blocks, cuda_stream);
    else
      launch_rmsnorm_stats<1024>(args, blocks, cuda_stream);
  }
  const RmsnormApply op{x, x_dtype, row_stride, rstd, weight, weight_dtype};
  launch_apply_quantize(op, rows, args.cols, args.vector, y_amax, y_format, y, y_scale, y_t, cuda_stream);
  return launch_status();
}

coat_status coat_rmsnorm_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const uint8_t* x_saved, const float* x_saved_scales,
                                       int64_t save_group_size, const float* rstd, const void* weight,
                                       coat_dtype weight_dtype, void* dx, float* dweight, float* workspace,
                                       coat_cuda_stream stream) {
  if (!valid_matrix(dy, rows, cols, row_stride) || cols < 1 || cols > COAT_RMSNORM_MAX_COLS || weight == nullptr ||
      dweight == nullptr || !coat_is_valid_group_size(save_group_size) ||
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
  args.x_saved = x_saved;
  args.x_saved_scales = x_saved_scales;
  args.group_size = static_cast<int>(save_group_size);
  args.rstd = rstd;
  args.weight = weight;
  args.weight_dtype = weight_dtype;
  args.lanes = static_cast<int>(coat_rmsnorm_lanes(cols));
  args.rows_per_slice = coat_rmsnorm_backward_rows_per_slice(rows, cols);
  args.slices = rows > 0 ? coat_ceil_div(rows, args.rows_per_slice) : 0;
  args.dx = dx;
  args.workspace = workspace;
  if (rows > 0) {
    // dx and the workspace are contiguous (16-byte aligned rows when cols % 8 == 0); codes move 8 bytes at
    // a time.
    const bool vector = cols % kChunk == 0 && rows_aligned16(dy, dy_dtype, row_stride) && aligned(weight, 16) &&
                        aligned(dx, 16) && aligned(workspace, 16) && aligned(x_saved, 8);
    const int threads = args.lanes > kRowBlockThreads ? args.lanes : kRowBlockThreads;
    const unsigned blocks = static_cast<unsigned>(coat_ceil_div(args.slices, threads / args.lanes));
    if (threads == kRowBlockThreads)
      launch_rmsnorm_backward<kRowBlockThreads>(args, vector, blocks, cuda_stream);
    else if (threads == 512)
      launch_rmsnorm_backward<512>(args, vector, blocks, cuda_stream);
    else
      launch_rmsnorm_backward<1024>(args, vector, blocks, cuda_stream);
  }
  const dim3 finish_block(kWarpSize, COAT_DWEIGHT_PHASES);
  dweight_finish_kernel<<<static_cast<unsigned>(coat_ceil_div(cols, kWarpSize)), finish_block, 0, cuda_stream>>>(
      workspace, args.slices, args.cols, dweight);
  return launch_status();
}

coat_status coat_silu_mul_quantize_cuda(const void* gate, const void* up, coat_dtype dtype, int64_t rows,
                                        int64_t cols, int64_t gate_row_stride, int64_t up_row_stride,
                                        const float* smooth_scale, int64_t save_group_size,
                                        coat_fp8_format y_format, uint8_t* y, float* y_scale, uint8_t* y_t,
                                        uint8_t* gate_saved, float* gate_scales, uint8_t* up_saved,
                                        float* up_scales, float* y_amax, coat_cuda_stream stream) {
  if (!valid_matrix(gate, rows, cols, gate_row_stride) || !valid_matrix(up, rows, cols, up_row_stride) ||
      !coat_is_valid_group_size(save_group_size) || y_scale == nullptr || y_amax == nullptr)
    return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  if (cudaMemsetAsync(y_amax, 0, sizeof(float), cuda_stream) != cudaSuccess) return COAT_ERROR_CUDA;
  SiluMulStatsArgs args;
  args.gate = gate;
  args.up = up;
  args.dtype = dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.gate_row_stride = gate_row_stride;
  args.up_row_stride = up_row_stride;
  args.smooth_scale = smooth_scale;
  args.group_size = static_cast<int>(save_group_size);
  args.vector = cols % kChunk == 0 && rows_aligned16(gate, dtype, gate_row_stride) &&
                rows_aligned16(up, dtype, up_row_stride) && (smooth_scale == nullptr || aligned(smooth_scale, 16));
  args.gate_saved = gate_saved;
  args.gate_scales = gate_scales;
  args.up_saved = up_saved;
  args.up_scales = up_scales;
  args.y_amax = y_amax;
  if (rows > 0 && cols > 0) {
    // Whole quantization groups per row, so that a group never spans two warps.
    const int64_t chunks_per_row = coat_ceil_div(cols, save_group_size) * (save_group_size / kChunk);
    const dim3 grid(static_cast<unsigned>(coat_ceil_div(chunks_per_row, kWarpSize)), limited_blocks(rows, 8));
    silu_mul_stats_kernel<<<grid, dim3(kWarpSize, 8), 0, cuda_stream>>>(args);
  }
  const SiluMulApply op{gate, up, dtype, gate_row_stride, up_row_stride, smooth_scale};
  launch_apply_quantize(op, rows, args.cols, args.vector, y_amax, y_format, y, y_scale, y_t, cuda_stream);
  return launch_status();
}

coat_status coat_silu_mul_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                        int64_t row_stride, const uint8_t* gate_saved, const float* gate_scales,
                                        const uint8_t* up_saved, const float* up_scales,
                                        const float* smooth_scale, int64_t save_group_size, void* dgate,
                                        void* dup, coat_cuda_stream stream) {
  if (!valid_matrix(dy, rows, cols, row_stride) || !coat_is_valid_group_size(save_group_size) ||
      (rows * cols > 0 && (gate_saved == nullptr || gate_scales == nullptr || up_saved == nullptr ||
                           up_scales == nullptr || dgate == nullptr || dup == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows * cols == 0) return COAT_SUCCESS;
  SiluMulBackwardArgs args;
  args.dy = dy;
  args.dy_dtype = dy_dtype;
  args.rows = rows;
  args.cols = static_cast<int>(cols);
  args.row_stride = row_stride;
  args.gate_saved = gate_saved;
  args.gate_scales = gate_scales;
  args.up_saved = up_saved;
  args.up_scales = up_scales;
  args.smooth_scale = smooth_scale;
  args.group_size = static_cast<int>(save_group_size);
  args.vector = cols % kChunk == 0 && rows_aligned16(dy, dy_dtype, row_stride) &&
                (smooth_scale == nullptr || aligned(smooth_scale, 16)) && aligned(dgate, 16) && aligned(dup, 16) &&
                aligned(gate_saved, 8) && aligned(up_saved, 8);
  args.dgate = dgate;
  args.dup = dup;
  const int64_t chunks_per_row = coat_ceil_div(cols, kChunk);
  const dim3 grid(static_cast<unsigned>(coat_ceil_div(chunks_per_row, kWarpSize)), limited_blocks(rows, 8));
  silu_mul_backward_kernel<<<grid, dim3(kWarpSize, 8), 0, reinterpret_cast<cudaStream_t>(stream)>>>(args);
  return launch_status();
}

}  // extern "C"
