/*
 * CUDA implementation of coat/quantize.h: the *_cuda entry points. Element for element they run the
 * steps of coat/detail/quantize_math.h that csrc/cpu/quantize.c runs, so results are bit-identical
 * (IEEE division under -prec-div=true, no FMA contraction, no flush to zero; max is exact, so the order
 * of the amax reductions does not matter).
 *
 * The kernels are memory-bound. One template, quantize_kernel, serves group quantization, tensor
 * quantization and group amax, each with or without the transposed output; dequantize_kernel and
 * reduce_amax_kernel complete the family. The FP4 and FP6 entry points run quantize_blocks_kernel and
 * decode_blocks_kernel (dequantization and expansion to E4M3), one instantiation per format, on the same tiles
 * and vector loads. Every entry point enqueues on the given stream and returns without synchronising.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/quantize.h"
#include "e2m_chunk.cuh"
#include "fp8_chunk.cuh"
#include "group_amax.cuh"
#include "launch.cuh"

namespace coat {
namespace device {
namespace {

constexpr int kThreads = 256;
constexpr int kThreadsLog2 = 8;
constexpr int kWarps = kThreads / 32;

/** Passes of a tile: each thread handles one chunk of a different row in each pass. */
constexpr int kPasses = 4;

/** Quantizers: elements of one row per lane and pass. 16 on the vector path, where the group reductions and
 *  scales then cost half as much per element as with 8 (G = 128 from 0.80 to 0.94 of copy on an H200,
 *  benchmarks/NOTES.md); 8 (one 16-byte load of bf16 / fp16, two of fp32) where rows are not multiples of
 *  16 elements, and on the element-wise path. */
constexpr int kQuantizeChunk = 8;
constexpr int kWideQuantizeChunk = 16;
/** Dequantizer: FP8 codes of one row per lane and pass, in pieces of 16 bytes of output (dequantize_kernel). */
constexpr int kDequantizeChunk = 16;
/** Amax reduction: floats per lane and pass (one 16-byte load). */
constexpr int kReduceChunk = 4;

/** Transposing quantizers stage tiles of 64 rows x 128 columns of codes in shared memory: 8 lanes per row
 *  and 32 rows per pass with 16-element chunks, 16 and 16 with 8-element ones. */
constexpr int kTransposeTileCols = 128;
constexpr int kTransposeTileRows = 64;
/** Lanes per row of a transposing kernel with chunks of `chunk` elements. */
__host__ __device__ constexpr int transpose_lanes_log2(int chunk) { return chunk == kWideQuantizeChunk ? 3 : 4; }
/** Row pitch of a staged tile in 32-bit words. Odd, so that the column reads of the transpose phase hit
 *  32 distinct banks (see write_transposed_tile); the row-wise staging stores are conflict-free too. */
constexpr int kTilePitchWords = kTransposeTileCols / 4 + 1;

/** Chunks of N elements of T a thread loads before it processes the first: 64 bytes of independent loads
 *  in flight per thread on the vector path, which saturates HBM at the occupancy these kernels reach.
 *  The element-wise path holds one register per element, so it keeps 16 elements in flight. */
template <bool kVector, typename T, int N>
__host__ __device__ constexpr int batch_chunks() {
  constexpr int kChunks = kVector ? 64 / static_cast<int>(sizeof(T) * N) : 16 / N;
  return kChunks < 1 ? 1 : kChunks > kPasses ? kPasses : kChunks;
}

/** N elements that one lane loads or stores together, aligned for vector access. */
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) Chunk {
  T e[N];
};

/** The widest access for a chunk of kBytes: 16-byte words, or one word for 8 or 4 FP8 codes. */
template <int kBytes>
struct VectorWord {
  using type = uint4;
};
template <>
struct VectorWord<8> {
  using type = uint2;
};
template <>
struct VectorWord<4> {
  using type = uint32_t;
};

/** Loads columns [col, col + N) of the row at base + row_offset. Columns >= cols, and all of them when
 *  !row_valid, read as 0 (which no amax notices). kVector: col and cols are multiples of N, so a chunk
 *  is wholly inside or outside the row, and the chunk's address is aligned to its vector word. */
template <bool kVector, typename T, int N>
__device__ __forceinline__ void load_chunk(Chunk<T, N>& chunk, const T* __restrict__ base, int64_t row_offset,
                                           int64_t col, int64_t cols, bool row_valid) {
  if constexpr (kVector) {
    using Word = typename VectorWord<sizeof(T) * N>::type;
    constexpr int kWords = sizeof(T) * N / sizeof(Word);
    Word* words = reinterpret_cast<Word*>(chunk.e);
    if (row_valid && col < cols) {
      const Word* source = reinterpret_cast<const Word*>(base + row_offset + col);
#pragma unroll
      for (int w = 0; w < kWords; ++w) words[w] = source[w];
    } else {
#pragma unroll
      for (int w = 0; w < kWords; ++w) words[w] = Word{};
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) chunk.e[i] = row_valid && col + i < cols ? base[row_offset + col + i] : T(0);
  }
}

/** Stores the in-range columns of a chunk to columns [col, col + N) of the row at base + row_offset,
 *  nothing when !row_valid. kVector: as for load_chunk. */
template <bool kVector, typename T, int N>
__device__ __forceinline__ void store_chunk(const Chunk<T, N>& chunk, T* __restrict__ base, int64_t row_offset,
                                            int64_t col, int64_t cols, bool row_valid) {
  if constexpr (kVector) {
    using Word = typename VectorWord<sizeof(T) * N>::type;
    constexpr int kWords = sizeof(T) * N / sizeof(Word);
    if (row_valid && col < cols) {
      const Word* words = reinterpret_cast<const Word*>(chunk.e);
      Word* target = reinterpret_cast<Word*>(base + row_offset + col);
#pragma unroll
      for (int w = 0; w < kWords; ++w) target[w] = words[w];
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (row_valid && col + i < cols) base[row_offset + col + i] = chunk.e[i];
  }
}

/** Storage and exact fp32 conversion of a high-precision input dtype (coat_load_f32's cases). */
template <coat_dtype kDtype>
struct Input {
  using Storage = float;
  __device__ static float to_f32(float value) { return value; }
};
template <>
struct Input<COAT_BFLOAT16> {
  using Storage = uint16_t;
  __device__ static float to_f32(uint16_t bits) { return coat_bf16_to_f32(bits); }
};
template <>
struct Input<COAT_FLOAT16> {
  using Storage = uint16_t;
  __device__ static float to_f32(uint16_t bits) { return coat_f16_to_f32(bits); }
};

/** Storage and rounding of a dequantizer output dtype (coat_store_as's cases). */
template <coat_dtype kDtype>
struct Output {
  using Storage = float;
  __device__ static float from_f32(float value) { return value; }
};
template <>
struct Output<COAT_BFLOAT16> {
  using Storage = uint16_t;
  __device__ static uint16_t from_f32(float value) { return coat_f32_to_bf16(value); }
};

enum class QuantizeMode {
  kGroupScale,   ///< coat_quantize_group: one scale per 1xG group, and the codes
  kTensorScale,  ///< coat_quantize_tensor: one scale from a precomputed amax, and the codes
  kAmaxOnly,     ///< coat_group_amax: per-group amax only
  kTensorAmax,   ///< coat_tensor_amax: the amax of the whole matrix, accumulated into one value
};

struct QuantizeParams {
  const void* x;
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int group_log2;            ///< log2 G (kGroupScale, kAmaxOnly)
  int lanes_per_row_log2;    ///< lanes sharing a row in a pass (non-transposing kernels)
  const float* tensor_amax;  ///< kTensorScale: the amax the scale derives from
  float* stats;              ///< scales (kGroupScale), group amax (kAmaxOnly), scale[0] (kTensorScale), the
                             ///< accumulated amax (kTensorAmax)
  uint8_t* q;                ///< codes, row r at q + r * q_stride; null: not written (kTensorScale only)
  int64_t q_stride;
  uint8_t* q_t;              ///< transposed codes, column c at q_t + c * q_t_stride (transposing kernels)
  int64_t q_t_stride;
  int q_t_store_bytes;       ///< 8 (or 4) where rows and q_t_stride are multiples of it and q_t aligned to it, else 1
};

/** The shared tile of a transposing kernel. A function-local static, so that only the kernels that
 *  call this allocate it. */
__device__ __forceinline__ uint32_t* transpose_tile() {
  __shared__ uint32_t tile[kTransposeTileRows * kTilePitchWords];
  return tile;
}

/** in[i] holds bytes (i, 0..3) of a 4x4 byte block; out[k] receives bytes (0..3, k). */
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&in)[4], uint32_t (&out)[4]) {
  const uint32_t rows01_cols01 = __byte_perm(in[0], in[1], 0x5140);  // (0,0) (1,0) (0,1) (1,1)
  const uint32_t rows01_cols23 = __byte_perm(in[0], in[1], 0x7362);  // (0,2) (1,2) (0,3) (1,3)
  const uint32_t rows23_cols01 = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t rows23_cols23 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(rows01_cols01, rows23_cols01, 0x5410);
  out[1] = __byte_perm(rows01_cols01, rows23_cols01, 0x7632);
  out[2] = __byte_perm(rows01_cols23, rows23_cols23, 0x5410);
  out[3] = __byte_perm(rows01_cols23, rows23_cols23, 0x7632);
}

/** Word index of staged word `word` of tile row `row`: rows 32-63 swap quad-column groups 4 apart, so that
 *  the 8-row reads of write_transposed_tile fall in distinct banks (see there). Even words stay even. */
__device__ __forceinline__ int staged_word(int row, int word) { return word ^ (((row >> 5) & 1) << 2); }

/**
 * Writes a staged tile (matrix rows row0.., columns col0..) to q_t[c * q_t_stride + r].
 *
 * Each thread transposes 8 rows x 4 columns: 8 word reads from shared memory, two 4x4 byte transposes in
 * registers, then 8 bytes into each of 4 rows of q_t. Warp w takes quad columns 4w..4w+3 of all 64 rows (lane
 * = 8-row block + 8 x quad column), so one store instruction writes 4 runs of 64 contiguous bytes: 2 sectors a
 * request (4-byte stores gave 1 and made the L2 the limit on an H200, benchmarks/NOTES.md). Its shared reads
 * (word (8 * block + i) * 33 + staged_word) fall in banks 8 * block + i + (quad column ^ 4 * (block >= 4))
 * mod 32: all distinct across the warp. Without 8-byte stores (rows % 8 != 0, q_t_stride % 8 != 0, unaligned
 * q_t) the 8 bytes go as two words, or byte by byte.
 */
__device__ __forceinline__ void write_transposed_tile(const uint32_t* tile, uint8_t* __restrict__ q_t,
                                                      int64_t q_t_stride, int64_t rows, int64_t cols, int64_t row0,
                                                      int64_t col0, int store_bytes) {
  static_assert(kTransposeTileRows == 64 && kTransposeTileCols / 4 == 4 * kWarps, "one 8 x 4 block per thread");
  const int lane = threadIdx.x & 31;
  const int block_row = 8 * (lane & 7);
  const int quad_col = 4 * (threadIdx.x >> 5) + (lane >> 3);
  uint32_t halves[2][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint32_t tile_rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = block_row + 4 * half + i;
      tile_rows[i] = tile[row * kTilePitchWords + staged_word(row, quad_col)];
    }
    transpose_4x4_bytes(tile_rows, halves[half]);
  }

  const int64_t row = row0 + block_row;
  if (row >= rows) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t col = col0 + 4 * quad_col + k;
    if (col >= cols) continue;
    uint8_t* target = q_t + col * q_t_stride + row;
    if (store_bytes == 8) {
      *reinterpret_cast<uint2*>(target) = make_uint2(halves[0][k], halves[1][k]);
      continue;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (row + 4 * half >= rows) break;
      if (store_bytes == 4) {
        *reinterpret_cast<uint32_t*>(target + 4 * half) = halves[half][k];
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (row + 4 * half + i < rows) target[4 * half + i] = static_cast<uint8_t>(halves[half][k] >> (8 * i));
      }
    }
  }
}

/**
 * Quantizes, or takes the group or tensor amax of, a rows x cols matrix, in tiles of kPasses * (256 / L) rows by
 * E * L columns, with L = 2^lanes_per_row_log2 lanes per row and E = kChunk elements per lane (8 or 16, see
 * kQuantizeChunk); when transposing, 64 x 128 tiles (E * L = 128) in as many passes as that takes.
 *
 * In each pass a thread owns the E elements [col, col + E) of one row, col = tile column +
 * E * (its lane in the row). It loads the chunks of a batch of passes (batch_chunks), then per pass:
 *   - converts them to fp32;
 *   - group modes: reduces the amax over the group_lanes(G, E, L) lanes of its group (out-of-range
 *     columns count as 0); the lane holding the group's first columns writes the amax (kAmaxOnly) or
 *     the scale (kGroupScale);
 *   - kTensorAmax: keeps a running max, reduced per warp at the end into one atomicMax;
 *   - quantizing modes: encode E codes with the group's (or the tensor's) scale, store them to q (unless
 *     q is null) and, when kTranspose, to the block's shared tile, which the block then writes to q_t.
 * Blocks loop over tiles, grid-stride in both dimensions; row tiles vary fastest across blockIdx.x, so
 * that blocks running together complete each other's q_t lines.
 *
 * kVector: x's chunks are 16-byte aligned and cols % E == 0 (16-byte loads, one E-byte store of codes per
 * chunk). Otherwise every element is loaded and stored on its own, with column bounds.
 * The transposing kernels are held to 64 registers (4 blocks per SM): with 16-element chunks ptxas gave them
 * up to 80 and 3 blocks, which made them 3% slower than with 8-element chunks, and 4% slower than held
 * (benchmarks/NOTES.md).
 */
template <QuantizeMode kMode, coat_dtype kDtype, coat_fp8_format kFormat, bool kTranspose, bool kVector, int kChunk>
__global__ void __launch_bounds__(kThreads, kTranspose ? 4 : 2) quantize_kernel(const QuantizeParams p) {
  static_assert(kChunk % kCodeChunk == 0);
  using T = typename Input<kDtype>::Storage;
  const T* __restrict__ x = static_cast<const T*>(p.x);

  const int lanes_log2 = kTranspose ? transpose_lanes_log2(kChunk) : p.lanes_per_row_log2;
  const int lane_in_row = threadIdx.x & ((1 << lanes_log2) - 1);
  const int row_in_pass = threadIdx.x >> lanes_log2;
  const int rows_per_pass = kThreads >> lanes_log2;
  constexpr int kTilePasses = kTranspose ? kTransposeTileRows / (kThreads >> transpose_lanes_log2(kChunk)) : kPasses;
  const int64_t tile_rows = int64_t{rows_per_pass} * kTilePasses;
  const int64_t tile_cols = int64_t{kChunk} << lanes_log2;
  const int group_size = 1 << p.group_log2;
  const int64_t ngroups = (p.cols + group_size - 1) >> p.group_log2;
  const int reduce_lanes = group_lanes(group_size, kChunk, 1 << lanes_log2);

  constexpr bool kQuantizes = kMode == QuantizeMode::kGroupScale || kMode == QuantizeMode::kTensorScale;
  float tensor_scale = 0.0f;
  float tensor_reciprocal = 0.0f;
  if constexpr (kMode == QuantizeMode::kTensorScale) {
    tensor_scale = coat_scale_from_amax(*p.tensor_amax, kFormat);
    tensor_reciprocal = 1.0f / tensor_scale;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) p.stats[0] = tensor_scale;
  }
  float running_amax = 0.0f;

  constexpr int kBatch = batch_chunks<kVector, T, kChunk>();
  for (int64_t col0 = blockIdx.y * tile_cols; col0 < p.cols; col0 += gridDim.y * tile_cols) {
    const int64_t col = col0 + lane_in_row * kChunk;
    for (int64_t row0 = blockIdx.x * tile_rows; row0 < p.rows; row0 += gridDim.x * tile_rows) {
#pragma unroll
      for (int first_pass = 0; first_pass < kTilePasses; first_pass += kBatch) {
        Chunk<T, kChunk> chunks[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t row = row0 + (first_pass + b) * rows_per_pass + row_in_pass;
          load_chunk<kVector>(chunks[b], x, row * p.row_stride, col, p.cols, row < p.rows);
        }

#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int tile_row = (first_pass + b) * rows_per_pass + row_in_pass;
          const int64_t row = row0 + tile_row;
          const bool row_valid = row < p.rows;
          float values[kChunk];
#pragma unroll
          for (int i = 0; i < kChunk; ++i) values[i] = Input<kDtype>::to_f32(chunks[b].e[i]);

          float scale = tensor_scale;
          float reciprocal = tensor_reciprocal;
          if constexpr (kMode == QuantizeMode::kTensorAmax) {
            running_amax = fmaxf(running_amax, lane_amax(values));
          } else if constexpr (kMode != QuantizeMode::kTensorScale) {
            const float amax = group_amax_reduce(lane_amax(values), reduce_lanes);
            if constexpr (kMode == QuantizeMode::kGroupScale) {
              scale = scale_from_amax<kFormat>(amax);
              reciprocal = reciprocal_of_normal(scale);
            }
            if (row_valid && col < p.cols && starts_group(col, group_size))
              p.stats[row * ngroups + (col >> p.group_log2)] = kMode == QuantizeMode::kAmaxOnly ? amax : scale;
          }

          if constexpr (kQuantizes) {
            Chunk<uint8_t, kChunk> codes;
            uint32_t* words = reinterpret_cast<uint32_t*>(codes.e);
#pragma unroll
            for (int part = 0; part < kChunk / kCodeChunk; ++part) {
              const Codes encoded = encode_chunk<kFormat, false>(values + part * kCodeChunk, scale, reciprocal);
              words[2 * part] = encoded.lo;
              words[2 * part + 1] = encoded.hi;
            }
            if (p.q != nullptr) store_chunk<kVector>(codes, p.q, row * p.q_stride, col, p.cols, row_valid);
            if constexpr (kTranspose) {
              // Staged unconditionally: the transpose phase skips rows and columns out of range.
              uint32_t* staged = transpose_tile() + tile_row * kTilePitchWords;
#pragma unroll
              for (int w = 0; w < kChunk / 4; ++w) staged[staged_word(tile_row, kChunk / 4 * lane_in_row + w)] = words[w];
            }
          }
        }
      }

      if constexpr (kTranspose) {
        __syncthreads();
        write_transposed_tile(transpose_tile(), p.q_t, p.q_t_stride, p.rows, p.cols, row0, col0, p.q_t_store_bytes);
        __syncthreads();  // the next tile's staging overwrites the tile
      }
    }
  }

  if constexpr (kMode == QuantizeMode::kTensorAmax) {
    running_amax = group_amax_reduce(running_amax, 32);
    // amax >= 0 and never NaN, so its bits order like its value; the plain read skips the atomic whenever it
    // cannot raise the maximum, which after the first warps is nearly always.
    if ((threadIdx.x & 31) == 0 && running_amax > *reinterpret_cast<volatile float*>(p.stats))
      atomicMax(reinterpret_cast<unsigned int*>(p.stats), __float_as_uint(running_amax));
  }
}

/** scale[0] = max(amax[0] / FP8_MAX, 2^-126), for tensor quantization of an empty matrix (the C core
 *  writes the scale whatever the size). One thread. */
__global__ void tensor_scale_kernel(const float* __restrict__ amax, coat_fp8_format format, float* __restrict__ scale) {
  scale[0] = coat_scale_from_amax(amax[0], format);
}

/** Floats a block of reduce_amax_kernel reads per grid-stride step. */
template <bool kVector>
__host__ __device__ constexpr int64_t reduce_block_span() {
  return int64_t{kThreads} * batch_chunks<kVector, float, kReduceChunk>() * kReduceChunk;
}

/**
 * atomicMax of max(values[0..count)) into *amax_bits, which the caller zeroed: the bits of a float >= 0
 * order like the float.
 *
 * Each thread reads, per grid-stride step, 4 chunks of 4 floats (16-byte loads when kVector: values
 * 16-byte aligned and count % 4 == 0) and keeps a running fmaxf from 0, as the C core does; the block
 * reduces through shuffles and shared memory and issues one atomic.
 */
template <bool kVector>
__global__ void __launch_bounds__(kThreads, 2)
    reduce_amax_kernel(const float* __restrict__ values, int64_t count, unsigned int* __restrict__ amax_bits) {
  constexpr int kBatch = batch_chunks<kVector, float, kReduceChunk>();
  constexpr int64_t kBlockSpan = reduce_block_span<kVector>();
  float amax = 0.0f;
  for (int64_t base = blockIdx.x * kBlockSpan; base < count; base += gridDim.x * kBlockSpan) {
    Chunk<float, kReduceChunk> chunks[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      load_chunk<kVector>(chunks[b], values, 0, base + (b * kThreads + threadIdx.x) * kReduceChunk, count, true);
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int i = 0; i < kReduceChunk; ++i) amax = fmaxf(amax, chunks[b].e[i]);
  }

  __shared__ float warp_amax[kWarps];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  amax = group_amax_reduce(amax, 32);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  if (warp == 0) {
    amax = group_amax_reduce(lane < kWarps ? warp_amax[lane] : 0.0f, 32);
    // The sign bit is cleared because fmaxf may keep a -0 input, whose bits would beat any positive value.
    if (lane == 0) atomicMax(amax_bits, __float_as_uint(amax) & 0x7FFFFFFFu);
  }
}

struct DequantizeParams {
  const uint8_t* q;
  int64_t rows;
  int64_t cols;
  const float* scales;
  int group_log2;          ///< log2 G, or -1: one per-tensor scale, scales[0]
  int lanes_per_row_log2;  ///< lanes sharing a row in a pass
  void* out;
};

/**
 * out[r * cols + c] = round_to(kOutDtype, fp8_decode(q[r * cols + c]) * scale), in tiles of
 * kPasses * (256 / L) rows by 16 * L columns, L = 2^lanes_per_row_log2.
 *
 * The block first decodes all 256 codes into a shared table (one coat_fp8_to_f32 per thread), so that
 * decoding an element costs one shared load instead of the codec's bit manipulation. In each of kPasses
 * passes a thread owns 16 codes of one row, as pieces of P codes whose outputs take 16 bytes (P = 8 to bf16,
 * 4 to fp32): piece k covers columns [col0 + k * P * L + P * lane, + P), so that each store instruction of a
 * warp writes 512 contiguous bytes, whole sectors. (With 16 adjacent codes per lane, every store instruction
 * wrote alternate 16-byte runs, two half-written sectors where one whole would do.) A piece lies in one group
 * (P <= 16 <= G). The thread loads codes and scales a batch of passes ahead, then looks up, scales, rounds
 * and stores each piece. kVector: cols % 16 == 0 and q, out 16-byte aligned.
 */
template <coat_fp8_format kFormat, coat_dtype kOutDtype, bool kVector>
__global__ void __launch_bounds__(kThreads, 2) dequantize_kernel(const DequantizeParams p) {
  static_assert(kThreads == 256, "one thread per FP8 code fills the decode table");
  using T = typename Output<kOutDtype>::Storage;
  constexpr int kPiece = 16 / static_cast<int>(sizeof(T));
  constexpr int kPieces = kDequantizeChunk / kPiece;
  T* __restrict__ out = static_cast<T*>(p.out);

  __shared__ float decoded[256];
  decoded[threadIdx.x] = coat_fp8_to_f32(static_cast<uint8_t>(threadIdx.x), kFormat);
  __syncthreads();

  const int lanes_log2 = p.lanes_per_row_log2;
  const int lane_in_row = threadIdx.x & ((1 << lanes_log2) - 1);
  const int row_in_pass = threadIdx.x >> lanes_log2;
  const int rows_per_pass = kThreads >> lanes_log2;
  const int64_t tile_rows = int64_t{rows_per_pass} * kPasses;
  const int64_t tile_cols = int64_t{kDequantizeChunk} << lanes_log2;
  const int64_t piece_span = int64_t{kPiece} << lanes_log2;
  const bool per_group = p.group_log2 >= 0;
  const int64_t ngroups = per_group ? (p.cols + (int64_t{1} << p.group_log2) - 1) >> p.group_log2 : 0;

  constexpr int kBatch = batch_chunks<kVector, uint8_t, kDequantizeChunk>();
  for (int64_t col0 = blockIdx.y * tile_cols; col0 < p.cols; col0 += gridDim.y * tile_cols) {
    const int64_t col = col0 + lane_in_row * kPiece;  // of piece 0; piece k at col + k * piece_span
    for (int64_t row0 = blockIdx.x * tile_rows; row0 < p.rows; row0 += gridDim.x * tile_rows) {
#pragma unroll
      for (int first_pass = 0; first_pass < kPasses; first_pass += kBatch) {
        Chunk<uint8_t, kPiece> codes[kBatch][kPieces];
        float scales[kBatch][kPieces];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t row = row0 + (first_pass + b) * rows_per_pass + row_in_pass;
#pragma unroll
          for (int k = 0; k < kPieces; ++k) {
            const int64_t piece_col = col + k * piece_span;
            load_chunk<kVector>(codes[b][k], p.q, row * p.cols, piece_col, p.cols, row < p.rows);
            scales[b][k] = row < p.rows && piece_col < p.cols
                               ? p.scales[per_group ? row * ngroups + (piece_col >> p.group_log2) : 0]
                               : 0.0f;
          }
        }

#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t row = row0 + (first_pass + b) * rows_per_pass + row_in_pass;
#pragma unroll
          for (int k = 0; k < kPieces; ++k) {
            // coat_dequantize_value: the product, canonical when NaN (a NaN code, or 0 * Inf). A piece without
            // NaN rounds to bf16 by pairs in hardware (pack_16bit_not_nan); one with NaN by coat's rounding.
            float v[kPiece];
            bool nan = false;
#pragma unroll
            for (int i = 0; i < kPiece; ++i) {
              v[i] = decoded[codes[b][k].e[i]] * scales[b][k];
              nan |= v[i] != v[i];
            }
            Chunk<T, kPiece> values;
            if (kOutDtype == COAT_BFLOAT16 && !nan) {
              uint32_t* pairs = reinterpret_cast<uint32_t*>(values.e);
#pragma unroll
              for (int i = 0; i < kPiece; i += 2) pairs[i / 2] = pack_16bit_not_nan<COAT_BFLOAT16>(v[i], v[i + 1]);
            } else {
#pragma unroll
              for (int i = 0; i < kPiece; ++i)
                values.e[i] = Output<kOutDtype>::from_f32(nan ? coat_canonical_nan(v[i]) : v[i]);
            }
            store_chunk<kVector>(values, out, row * p.cols, col + k * piece_span, p.cols, row < p.rows);
          }
        }
      }
    }
  }
}

/** FP4 and FP6 kernels: elements of one row per lane and pass, i.e. 4 bytes of packed FP4 codes or 6 of FP6. */
constexpr int kBlockChunk = kE2mCodeChunk;

struct BlockParams {
  int64_t rows;
  int64_t cols;
  int64_t row_bytes;       ///< packed bytes per row: ceil(cols / 2) (FP4) or ceil(3 cols / 4) (FP6)
  int block_log2;          ///< log2 B
  int lanes_per_row_log2;  ///< lanes sharing a row in a pass
  const void* x;           ///< quantize_blocks_kernel: the input, rows row_stride elements apart
  int64_t row_stride;
  uint8_t* codes;          ///< quantize_blocks_kernel: the packed codes it writes
  const uint8_t* codes_in; ///< decode_blocks_kernel: the packed codes it reads
  float* scales;           ///< quantize_blocks_kernel: the block scales it writes
  const float* scales_in;  ///< decode_blocks_kernel: the block scales it reads (when the decoder needs them)
  void* out;               ///< decode_blocks_kernel: rows x cols outputs, contiguous
};

/** The positions a lane owns in the block kernels' tiles of kPasses * (256 / L) rows by 8 * L columns,
 *  L = 2^lanes_per_row_log2: in each pass, columns [col, col + 8) of one row. */
struct BlockLane {
  int lane_in_row;
  int row_in_pass;
  int rows_per_pass;
  int64_t tile_rows;
  int64_t tile_cols;

  __device__ explicit BlockLane(const BlockParams& p)
      : lane_in_row(threadIdx.x & ((1 << p.lanes_per_row_log2) - 1)),
        row_in_pass(threadIdx.x >> p.lanes_per_row_log2),
        rows_per_pass(kThreads >> p.lanes_per_row_log2),
        tile_rows(int64_t{kThreads >> p.lanes_per_row_log2} * kPasses),
        tile_cols(int64_t{kBlockChunk} << p.lanes_per_row_log2) {}

  __device__ int64_t row(int64_t row0, int pass) const { return row0 + pass * rows_per_pass + row_in_pass; }
};

/** The columns of a chunk starting at column col that lie in a row of cols columns (0 past the row). */
__device__ __forceinline__ int chunk_columns(int64_t col, int64_t cols) {
  return col >= cols ? 0 : cols - col < kBlockChunk ? static_cast<int>(cols - col) : kBlockChunk;
}

/** The byte of a packed row where the chunk starting at column col (a multiple of 8) starts. */
template <int kMantissaBits>
__device__ __forceinline__ int64_t chunk_byte(int64_t col) {
  return col / 8 * E2m<kMantissaBits>::kChunkBytes;
}

/** Max of coat_magnitude_bits over aligned sets of `lanes` consecutive lanes (a power of two, 1..32), every
 *  lane of a set getting the set's max: the block amax, NaN included. All 32 lanes must call it. */
__device__ __forceinline__ uint32_t block_amax_bits_reduce(uint32_t bits, int lanes) {
  for (int mask = lanes >> 1; mask > 0; mask >>= 1)
    bits = coat_max_bits(bits, static_cast<uint32_t>(__shfl_xor_sync(kFullWarpMask, static_cast<int>(bits), mask)));
  return bits;
}

/**
 * coat_quantize_fp4 / coat_quantize_fp6 (kMantissaBits 1 / 3): in each of kPasses passes a thread owns the 8
 * elements [col, col + 8) of one row. It loads the chunks of all passes first (64 or 128 bytes in flight), then
 * per pass reduces the block's amax bits over the group_lanes(B, 8, L) lanes of its block (columns past cols load
 * as 0, which no amax notices), the lane holding the block's first columns writes the scale, and every lane packs
 * its 8 codes into 4 (FP4) or 6 (FP6) bytes. A column past cols (the padding bits of the row's last byte) loads
 * as +0, whose code is 0 for every scale. kVector: x's chunks 16-byte aligned and cols % 8 == 0, so one or two
 * 16-byte loads and one 4-byte store (FP4) or three 2-byte ones (FP6) per chunk; otherwise element by element
 * with column bounds.
 */
template <int kMantissaBits, coat_dtype kDtype, bool kVector>
__global__ void __launch_bounds__(kThreads, 2) quantize_blocks_kernel(const BlockParams p) {
  using T = typename Input<kDtype>::Storage;
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const BlockLane lane(p);
  const int block_size = 1 << p.block_log2;
  const int64_t nblocks = (p.cols + block_size - 1) >> p.block_log2;
  const int reduce_lanes = group_lanes(block_size, kBlockChunk, 1 << p.lanes_per_row_log2);

  for (int64_t col0 = blockIdx.y * lane.tile_cols; col0 < p.cols; col0 += gridDim.y * lane.tile_cols) {
    const int64_t col = col0 + lane.lane_in_row * kBlockChunk;
    for (int64_t row0 = blockIdx.x * lane.tile_rows; row0 < p.rows; row0 += gridDim.x * lane.tile_rows) {
      Chunk<T, kBlockChunk> chunks[kPasses];
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int64_t row = lane.row(row0, pass);
        load_chunk<kVector>(chunks[pass], x, row * p.row_stride, col, p.cols, row < p.rows);
      }
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int64_t row = lane.row(row0, pass);
        const bool row_valid = row < p.rows;
        float values[kBlockChunk];
        uint32_t amax_bits = 0;
#pragma unroll
        for (int i = 0; i < kBlockChunk; ++i) {
          values[i] = Input<kDtype>::to_f32(chunks[pass].e[i]);
          amax_bits = coat_max_bits(amax_bits, coat_magnitude_bits(values[i]));
        }
        amax_bits = block_amax_bits_reduce(amax_bits, reduce_lanes);
        const float scale = e2m_scale_from_amax_bits<kMantissaBits>(amax_bits);
        if (row_valid && col < p.cols && starts_group(col, block_size))
          p.scales[row * nblocks + (col >> p.block_log2)] = scale;

        const PackedCodes codes = encode_e2m_chunk<kMantissaBits>(values, scale, reciprocal_of_normal(scale));
        if (row_valid && col < p.cols)
          store_e2m_chunk<kMantissaBits>(p.codes + row * p.row_bytes + chunk_byte<kMantissaBits>(col), codes,
                                         chunk_columns(col, p.cols), kVector);
      }
    }
  }
}

/** decode_blocks_kernel's decoders: the value of a code times its block scale, rounded to kOutDtype
 *  (coat_dequantize_fp4 / fp6), or the E4M3 code of the same value (coat_fp4_to_e4m3 / fp6_to_e4m3, no scale). */
template <int kMantissaBits>
__device__ __forceinline__ float e2m_to_f32(uint8_t code) {
  return kMantissaBits == 1 ? coat_e2m1_to_f32(code) : coat_e2m3_to_f32(code);
}

template <int kMantissaBits, coat_dtype kOutDtype>
struct BlocksToValues {
  using Storage = typename Output<kOutDtype>::Storage;
  static constexpr int kMantissa = kMantissaBits;
  static constexpr bool kReadsScales = true;
  __device__ static Storage decode(uint8_t code, float scale) {
    return Output<kOutDtype>::from_f32(coat_dequantize_value(e2m_to_f32<kMantissaBits>(code), scale));
  }
};
template <int kMantissaBits>
struct BlocksToE4m3 {
  using Storage = uint8_t;
  static constexpr int kMantissa = kMantissaBits;
  static constexpr bool kReadsScales = false;
  __device__ static uint8_t decode(uint8_t code, float) {
    return kMantissaBits == 1 ? coat_e2m1_to_e4m3(code) : coat_e2m3_to_e4m3(code);
  }
};

/**
 * coat_dequantize_fp4 / fp6 and coat_fp4_to_e4m3 / fp6_to_e4m3: in each of kPasses passes a thread owns the 8
 * codes [col, col + 8) of one row (4 or 6 packed bytes; B is a multiple of 8, so they share one scale). It loads
 * the codes and scales of all passes first, then decodes and stores each chunk. kVector: cols % 8 == 0, codes
 * aligned to 4 (FP4) or 2 (FP6) bytes and out aligned to its chunk (16 or 32 bytes of values, 8 bytes of E4M3
 * codes).
 */
template <typename Decoder, bool kVector>
__global__ void __launch_bounds__(kThreads, 2) decode_blocks_kernel(const BlockParams p) {
  constexpr int kMantissaBits = Decoder::kMantissa;
  using T = typename Decoder::Storage;
  T* __restrict__ out = static_cast<T*>(p.out);
  const BlockLane lane(p);
  const int64_t nblocks = (p.cols + (int64_t{1} << p.block_log2) - 1) >> p.block_log2;

  for (int64_t col0 = blockIdx.y * lane.tile_cols; col0 < p.cols; col0 += gridDim.y * lane.tile_cols) {
    const int64_t col = col0 + lane.lane_in_row * kBlockChunk;
    const int count = chunk_columns(col, p.cols);
    for (int64_t row0 = blockIdx.x * lane.tile_rows; row0 < p.rows; row0 += gridDim.x * lane.tile_rows) {
      PackedCodes codes[kPasses];
      float scales[kPasses];
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int64_t row = lane.row(row0, pass);
        const bool valid = row < p.rows && count > 0;
        codes[pass] = valid ? load_e2m_chunk<kMantissaBits>(p.codes_in + row * p.row_bytes + chunk_byte<kMantissaBits>(col),
                                                            count, kVector)
                            : PackedCodes{0u, 0u};
        if constexpr (Decoder::kReadsScales)
          scales[pass] = valid ? p.scales_in[row * nblocks + (col >> p.block_log2)] : 0.0f;
        else
          scales[pass] = 0.0f;
      }
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        Chunk<T, kBlockChunk> values;
#pragma unroll
        for (int i = 0; i < kBlockChunk; ++i)
          values.e[i] = Decoder::decode(static_cast<uint8_t>(e2m_code_at<kMantissaBits>(codes[pass], i)), scales[pass]);
        store_chunk<kVector>(values, out, lane.row(row0, pass) * p.cols, col, p.cols, lane.row(row0, pass) < p.rows);
      }
    }
  }
}

/** A compile-time value carried by a type: turns a runtime choice into a template argument. */
template <auto kValue>
struct Constant {
  static constexpr auto value = kValue;
};

template <typename Body>
void dispatch_bool(bool flag, Body&& body) {
  if (flag)
    body(Constant<true>{});
  else
    body(Constant<false>{});
}

/** The three layouts of quantize_kernel's chunks: wide vectors, vectors, or element by element. */
template <typename Body>
void dispatch_chunks(bool vector, bool wide, Body&& body) {
  if (wide)
    body(Constant<true>{}, Constant<kWideQuantizeChunk>{});
  else if (vector)
    body(Constant<true>{}, Constant<kQuantizeChunk>{});
  else
    body(Constant<false>{}, Constant<kQuantizeChunk>{});
}

template <typename Body>
void dispatch_input_dtype(coat_dtype dtype, Body&& body) {
  switch (dtype) {
    case COAT_BFLOAT16: body(Constant<COAT_BFLOAT16>{}); break;
    case COAT_FLOAT16: body(Constant<COAT_FLOAT16>{}); break;
    default: body(Constant<COAT_FLOAT32>{}); break;
  }
}

template <typename Body>
void dispatch_format(coat_fp8_format format, Body&& body) {
  if (format == COAT_E4M3)
    body(Constant<COAT_E4M3>{});
  else
    body(Constant<COAT_E5M2>{});
}

/** coat_valid_matrix of the C core. */
bool valid_matrix(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && row_stride >= cols && (x != nullptr || rows * cols == 0);
}

/** The enums select template instantiations, so values outside them are refused rather than guessed. */
bool valid_input_dtype(coat_dtype dtype) {
  return dtype == COAT_FLOAT32 || dtype == COAT_BFLOAT16 || dtype == COAT_FLOAT16;
}

bool valid_format(coat_fp8_format format) { return format == COAT_E4M3 || format == COAT_E5M2; }

int64_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

/** Parameters with the input matrix set and every output unset. */
QuantizeParams matrix_params(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  QuantizeParams p{};
  p.x = x;
  p.rows = rows;
  p.cols = cols;
  p.row_stride = row_stride;
  return p;
}

/** Whether quantize_kernel can load and store chunks of `chunk` elements as vectors. */
bool vector_chunks(const QuantizeParams& p, coat_dtype dtype, int chunk) {
  return p.cols % chunk == 0 && is_aligned(p.x, 16) && (p.rows == 1 || p.row_stride * element_size(dtype) % 16 == 0) &&
         (p.q == nullptr || (is_aligned(p.q, chunk) && p.q_stride % chunk == 0));
}

/** Launches quantize_kernel for a non-empty matrix: picks the chunk and tile width, the vector path and the
 *  instantiation. p.q_t selects the transposing kernel. */
template <QuantizeMode kMode>
coat_status launch_quantize(QuantizeParams p, coat_dtype dtype, coat_fp8_format format, cudaStream_t stream) {
  const bool transpose = p.q_t != nullptr;
  const bool wide = vector_chunks(p, dtype, kWideQuantizeChunk);
  const bool vector = wide || vector_chunks(p, dtype, kQuantizeChunk);
  const int chunk = wide ? kWideQuantizeChunk : kQuantizeChunk;
  // Rows as wide as the data allows (up to a whole block per row), for long contiguous runs; narrower (down to
  // a warp) where that makes the tile width divide the row, so that the last tile of a row has no idle lanes.
  p.lanes_per_row_log2 = transpose ? transpose_lanes_log2(chunk) : min(ceil_log2(coat_ceil_div(p.cols, chunk)), kThreadsLog2);
  while (!transpose && p.lanes_per_row_log2 > 5 && p.cols % (int64_t{chunk} << p.lanes_per_row_log2) != 0)
    --p.lanes_per_row_log2;
  const auto q_t_stores_of = [&](int bytes) {
    return p.rows % bytes == 0 && p.q_t_stride % bytes == 0 && is_aligned(p.q_t, bytes);
  };
  p.q_t_store_bytes = !transpose ? 1 : q_t_stores_of(8) ? 8 : q_t_stores_of(4) ? 4 : 1;
  const int64_t tile_rows = transpose ? kTransposeTileRows : int64_t{kThreads >> p.lanes_per_row_log2} * kPasses;
  const int64_t tile_cols = int64_t{chunk} << p.lanes_per_row_log2;
  const dim3 grid(clamp_grid(coat_ceil_div(p.rows, tile_rows), kMaxGridX),
                  clamp_grid(coat_ceil_div(p.cols, tile_cols), kMaxGridY));

  dispatch_input_dtype(dtype, [&](auto input) {
    constexpr coat_dtype kDtype = decltype(input)::value;
    dispatch_chunks(vector, wide, [&](auto vectorized, auto chunk_size) {
      constexpr bool kVector = decltype(vectorized)::value;
      constexpr int kChunk = decltype(chunk_size)::value;
      if constexpr (kMode == QuantizeMode::kAmaxOnly || kMode == QuantizeMode::kTensorAmax) {
        quantize_kernel<kMode, kDtype, COAT_E4M3, false, kVector, kChunk><<<grid, kThreads, 0, stream>>>(p);
      } else {
        dispatch_format(format, [&](auto fp8) {
          constexpr coat_fp8_format kFormat = decltype(fp8)::value;
          dispatch_bool(transpose, [&](auto transposed) {
            constexpr bool kTranspose = decltype(transposed)::value;
            quantize_kernel<kMode, kDtype, kFormat, kTranspose, kVector, kChunk><<<grid, kThreads, 0, stream>>>(p);
          });
        });
      }
    });
  });
  return launch_status();
}

/** Parameters of an FP4 or FP6 kernel over a non-empty rows x cols matrix, with the tile width set. */
template <int kMantissaBits>
BlockParams block_params(int64_t rows, int64_t cols, int64_t block_size) {
  BlockParams p{};
  p.rows = rows;
  p.cols = cols;
  p.row_bytes = kMantissaBits == 1 ? coat_ceil_div(cols, 2) : coat_fp6_row_bytes(cols);
  p.block_log2 = ceil_log2(block_size);
  p.lanes_per_row_log2 = min(ceil_log2(coat_ceil_div(cols, kBlockChunk)), kThreadsLog2);
  return p;
}

/** The grid of a block kernel: one tile per block, up to the grid limits (the kernels loop past them). */
dim3 block_grid(const BlockParams& p) {
  const int64_t tile_rows = int64_t{kThreads >> p.lanes_per_row_log2} * kPasses;
  const int64_t tile_cols = int64_t{kBlockChunk} << p.lanes_per_row_log2;
  return dim3(clamp_grid(coat_ceil_div(p.rows, tile_rows), kMaxGridX), clamp_grid(coat_ceil_div(p.cols, tile_cols), kMaxGridY));
}

/** The alignment of a chunk's packed codes on the vector path: one 4-byte word (FP4) or three 2-byte halves (FP6). */
template <int kMantissaBits>
constexpr int kCodesAlignment = kMantissaBits == 1 ? 4 : 2;

template <int kMantissaBits>
coat_status launch_quantize_blocks(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   int64_t block_size, uint8_t* codes, float* scales, cudaStream_t stream) {
  if (!valid_matrix(x, rows, cols, row_stride) || !coat_is_valid_group_size(block_size) || !valid_input_dtype(dtype))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  BlockParams p = block_params<kMantissaBits>(rows, cols, block_size);
  p.x = x;
  p.row_stride = row_stride;
  p.codes = codes;
  p.scales = scales;
  const bool vector = cols % kBlockChunk == 0 && is_aligned(x, 16) && is_aligned(codes, kCodesAlignment<kMantissaBits>) &&
                      (rows == 1 || row_stride * element_size(dtype) % 16 == 0);
  dispatch_input_dtype(dtype, [&](auto input) {
    dispatch_bool(vector, [&](auto vectorized) {
      quantize_blocks_kernel<kMantissaBits, decltype(input)::value, decltype(vectorized)::value>
          <<<block_grid(p), kThreads, 0, stream>>>(p);
    });
  });
  return launch_status();
}

/** Launches decode_blocks_kernel for a non-empty matrix, on the vector path where the layout allows it. */
template <typename Decoder>
coat_status launch_decode_blocks(const BlockParams& p, cudaStream_t stream) {
  const bool vector = p.cols % kBlockChunk == 0 && is_aligned(p.codes_in, kCodesAlignment<Decoder::kMantissa>) &&
                      is_aligned(p.out, alignof(Chunk<typename Decoder::Storage, kBlockChunk>));
  dispatch_bool(vector, [&](auto vectorized) {
    decode_blocks_kernel<Decoder, decltype(vectorized)::value><<<block_grid(p), kThreads, 0, stream>>>(p);
  });
  return launch_status();
}

template <int kMantissaBits>
coat_status launch_dequantize_blocks(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                     int64_t block_size, void* out, coat_dtype out_dtype, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || ((codes == nullptr || scales == nullptr) && rows * cols > 0) ||
      !coat_is_valid_group_size(block_size) || (out_dtype != COAT_FLOAT32 && out_dtype != COAT_BFLOAT16))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  BlockParams p = block_params<kMantissaBits>(rows, cols, block_size);
  p.codes_in = codes;
  p.scales_in = scales;
  p.out = out;
  return out_dtype == COAT_BFLOAT16 ? launch_decode_blocks<BlocksToValues<kMantissaBits, COAT_BFLOAT16>>(p, stream)
                                    : launch_decode_blocks<BlocksToValues<kMantissaBits, COAT_FLOAT32>>(p, stream);
}

template <int kMantissaBits>
coat_status launch_blocks_to_e4m3(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || ((codes == nullptr || q == nullptr) && rows * cols > 0)) return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  // The block size only places scales, which this conversion does not read.
  BlockParams p = block_params<kMantissaBits>(rows, cols, 16);
  p.codes_in = codes;
  p.out = q;
  return launch_decode_blocks<BlocksToE4m3<kMantissaBits>>(p, stream);
}

}  // namespace
}  // namespace device
}  // namespace coat

coat_status coat_quantize_group_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                     int64_t row_stride, int64_t group_size, coat_fp8_format format,
                                     uint8_t* q, float* scales, uint8_t* q_t, coat_cuda_stream stream) {
  using namespace coat::device;
  if (!valid_matrix(x, rows, cols, row_stride) || !coat_is_valid_group_size(group_size) ||
      !valid_input_dtype(dtype) || !valid_format(format))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  QuantizeParams p = matrix_params(x, rows, cols, row_stride);
  p.group_log2 = ceil_log2(group_size);
  p.stats = scales;
  p.q = q;
  p.q_stride = cols;
  p.q_t = q_t;
  p.q_t_stride = rows;
  return launch_quantize<QuantizeMode::kGroupScale>(p, dtype, format, coat::device::as_cuda_stream(stream));
}

coat_status coat_group_amax_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                 int64_t row_stride, int64_t group_size, float* group_amax,
                                 coat_cuda_stream stream) {
  using namespace coat::device;
  if (!valid_matrix(x, rows, cols, row_stride) || !coat_is_valid_group_size(group_size) ||
      !valid_input_dtype(dtype))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  QuantizeParams p = matrix_params(x, rows, cols, row_stride);
  p.group_log2 = ceil_log2(group_size);
  p.stats = group_amax;
  return launch_quantize<QuantizeMode::kAmaxOnly>(p, dtype, COAT_E4M3, coat::device::as_cuda_stream(stream));
}

coat_status coat_reduce_amax_cuda(const float* group_amax, int64_t count, float* amax, coat_cuda_stream stream) {
  using namespace coat::device;
  if (count < 0 || amax == nullptr || (group_amax == nullptr && count > 0)) return COAT_ERROR_INVALID_ARGUMENT;
  const cudaStream_t cuda_stream = as_cuda_stream(stream);
  // atomicMax on the bits needs a zero start; it is also the result for count == 0.
  if (cudaMemsetAsync(amax, 0, sizeof(float), cuda_stream) != cudaSuccess) return COAT_ERROR_CUDA;
  if (count == 0) return COAT_SUCCESS;
  // Enough blocks for one grid-stride step, up to a cap past which the blocks loop; the cap bounds the
  // atomics on the single result word.
  constexpr int64_t kMaxBlocks = 1024;
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(amax);
  if (is_aligned(group_amax, 16) && count % kReduceChunk == 0) {
    const unsigned int blocks = clamp_grid(coat_ceil_div(count, reduce_block_span<true>()), kMaxBlocks);
    reduce_amax_kernel<true><<<blocks, kThreads, 0, cuda_stream>>>(group_amax, count, amax_bits);
  } else {
    const unsigned int blocks = clamp_grid(coat_ceil_div(count, reduce_block_span<false>()), kMaxBlocks);
    reduce_amax_kernel<false><<<blocks, kThreads, 0, cuda_stream>>>(group_amax, count, amax_bits);
  }
  return launch_status();
}

coat_status coat_tensor_amax_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                  int64_t row_stride, float* amax, coat_cuda_stream stream) {
  using namespace coat::device;
  if (!valid_matrix(x, rows, cols, row_stride) || amax == nullptr || !valid_input_dtype(dtype))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  QuantizeParams p = matrix_params(x, rows, cols, row_stride);
  p.stats = amax;
  return launch_quantize<QuantizeMode::kTensorAmax>(p, dtype, COAT_E4M3, coat::device::as_cuda_stream(stream));
}

coat_status coat_quantize_tensor_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                      int64_t row_stride, const float* amax, coat_fp8_format format,
                                      uint8_t* q, int64_t q_stride, float* scale, uint8_t* q_t,
                                      int64_t q_t_stride, coat_cuda_stream stream) {
  using namespace coat::device;
  if (!valid_matrix(x, rows, cols, row_stride) || amax == nullptr || scale == nullptr ||
      !valid_input_dtype(dtype) || !valid_format(format) || (q != nullptr && q_stride < cols) ||
      (q_t != nullptr && q_t_stride < rows))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) {
    tensor_scale_kernel<<<1, 1, 0, as_cuda_stream(stream)>>>(amax, format, scale);
    return launch_status();
  }
  QuantizeParams p = matrix_params(x, rows, cols, row_stride);
  p.tensor_amax = amax;
  p.stats = scale;
  p.q = q;
  p.q_stride = q_stride;
  p.q_t = q_t;
  p.q_t_stride = q_t_stride;
  return launch_quantize<QuantizeMode::kTensorScale>(p, dtype, format, coat::device::as_cuda_stream(stream));
}

coat_status coat_dequantize_cuda(const uint8_t* q, coat_fp8_format format, int64_t rows, int64_t cols,
                                 const float* scales, int64_t group_size, void* out, coat_dtype out_dtype,
                                 coat_cuda_stream stream) {
  using namespace coat::device;
  if (!valid_matrix(q, rows, cols, cols) || (scales == nullptr && rows * cols > 0) ||
      (group_size != 0 && !coat_is_valid_group_size(group_size)) ||
      (out_dtype != COAT_FLOAT32 && out_dtype != COAT_BFLOAT16) || !valid_format(format))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (rows == 0 || cols == 0) return COAT_SUCCESS;
  DequantizeParams p{};
  p.q = q;
  p.rows = rows;
  p.cols = cols;
  p.scales = scales;
  p.group_log2 = group_size ? ceil_log2(group_size) : -1;
  // As in launch_quantize: narrower rows (down to a warp) where that makes the tile width divide the row.
  p.lanes_per_row_log2 = min(ceil_log2(coat_ceil_div(cols, kDequantizeChunk)), kThreadsLog2);
  while (p.lanes_per_row_log2 > 5 && cols % (int64_t{kDequantizeChunk} << p.lanes_per_row_log2) != 0)
    --p.lanes_per_row_log2;
  p.out = out;
  const bool vector = cols % kDequantizeChunk == 0 && is_aligned(q, 16) && is_aligned(out, 16);
  const int64_t tile_rows = int64_t{kThreads >> p.lanes_per_row_log2} * kPasses;
  const int64_t tile_cols = int64_t{kDequantizeChunk} << p.lanes_per_row_log2;
  const dim3 grid(clamp_grid(coat_ceil_div(rows, tile_rows), kMaxGridX),
                  clamp_grid(coat_ceil_div(cols, tile_cols), kMaxGridY));
  const cudaStream_t cuda_stream = as_cuda_stream(stream);

  dispatch_format(format, [&](auto fp8) {
    dispatch_bool(out_dtype == COAT_BFLOAT16, [&](auto bf16) {
      dispatch_bool(vector, [&](auto vectorized) {
        dequantize_kernel<decltype(fp8)::value, decltype(bf16)::value ? COAT_BFLOAT16 : COAT_FLOAT32,
                          decltype(vectorized)::value><<<grid, kThreads, 0, cuda_stream>>>(p);
      });
    });
  });
  return launch_status();
}

coat_status coat_quantize_fp4_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   int64_t block_size, uint8_t* codes, float* scales, coat_cuda_stream stream) {
  return coat::device::launch_quantize_blocks<1>(x, dtype, rows, cols, row_stride, block_size, codes, scales,
                                                 coat::device::as_cuda_stream(stream));
}

coat_status coat_quantize_fp6_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   int64_t block_size, uint8_t* codes, float* scales, coat_cuda_stream stream) {
  return coat::device::launch_quantize_blocks<3>(x, dtype, rows, cols, row_stride, block_size, codes, scales,
                                                 coat::device::as_cuda_stream(stream));
}

coat_status coat_dequantize_fp4_cuda(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                     int64_t block_size, void* out, coat_dtype out_dtype, coat_cuda_stream stream) {
  return coat::device::launch_dequantize_blocks<1>(codes, rows, cols, scales, block_size, out, out_dtype,
                                                   coat::device::as_cuda_stream(stream));
}

coat_status coat_dequantize_fp6_cuda(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                     int64_t block_size, void* out, coat_dtype out_dtype, coat_cuda_stream stream) {
  return coat::device::launch_dequantize_blocks<3>(codes, rows, cols, scales, block_size, out, out_dtype,
                                                   coat::device::as_cuda_stream(stream));
}

coat_status coat_fp4_to_e4m3_cuda(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q,
                                  coat_cuda_stream stream) {
  return coat::device::launch_blocks_to_e4m3<1>(codes, rows, cols, q, coat::device::as_cuda_stream(stream));
}

coat_status coat_fp6_to_e4m3_cuda(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q,
                                  coat_cuda_stream stream) {
  return coat::device::launch_blocks_to_e4m3<3>(codes, rows, cols, q, coat::device::as_cuda_stream(stream));
}
