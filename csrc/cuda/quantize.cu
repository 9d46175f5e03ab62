/*
 * CUDA implementation of coat/quantize.h's FP8 entry points: group and tensor quantization, group and tensor
 * amax, dequantization. Element for element they run the steps of coat/detail/quantize_math.h that
 * csrc/cpu/quantize.c runs, so results are bit-identical (IEEE division under -prec-div=true, no FMA contraction,
 * no flush to zero; max is exact, so the order of the amax reductions does not matter).
 *
 * The kernels are memory-bound. One template, quantize_kernel, serves group quantization, tensor
 * quantization and group amax, each with or without the transposed output; dequantize_kernel and
 * reduce_amax_kernel complete the family. The FP4 and FP6 entry points are in quantize_blocks.cu, on the same
 * tiles and vector loads (quantize_tiles.cuh). Every entry point enqueues on the given stream and returns without
 * synchronising.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/quantize.h"
#include "fp8_chunk.cuh"
#include "group_amax.cuh"
#include "launch.cuh"
#include "quantize_tiles.cuh"

namespace coat {
namespace device {
namespace {

constexpr int kWarps = kThreads / 32;

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
void dispatch_format(coat_fp8_format format, Body&& body) {
  if (format == COAT_E4M3)
    body(Constant<COAT_E4M3>{});
  else
    body(Constant<COAT_E5M2>{});
}

bool valid_format(coat_fp8_format format) { return format == COAT_E4M3 || format == COAT_E5M2; }

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
