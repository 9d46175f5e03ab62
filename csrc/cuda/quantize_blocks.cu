/*
 * CUDA implementation of coat/quantize.h's FP4 and FP6 entry points: block quantization (quantize_blocks_kernel)
 * and decoding, to 16-bit or float values or to E4M3 codes (decode_blocks_kernel), one instantiation per format,
 * on the tiles and vector loads of the FP8 quantizers (quantize_tiles.cuh). Element for element they run the
 * steps of coat/detail/quantize_math.h that csrc/cpu/quantize.c runs, so results are bit-identical. Every entry
 * point enqueues on the given stream and returns without synchronising.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/quantize.h"
#include "e2m_chunk.cuh"
#include "group_amax.cuh"
#include "launch.cuh"
#include "quantize_tiles.cuh"

namespace coat {
namespace device {
namespace {

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
