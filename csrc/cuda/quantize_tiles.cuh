// Shared by the CUDA quantizers: quantize.cu (FP8 group and tensor quantization, amax, dequantization) and
// quantize_blocks.cu (FP4 and FP6 block quantization and decoding). Both tile a matrix the same way: blocks of
// kThreads threads, each thread owning a chunk of one row in each of kPasses passes, loaded and stored as vectors
// where the layout allows (load_chunk, store_chunk), the input and output dtypes converted as the C core does
// (Input, Output); the host code turns runtime choices into template arguments (dispatch_*) and checks arguments as
// the C core does (valid_*).
//
// Everything here is in an anonymous namespace, as it was in one file: each .cu that includes it has its own
// copy, and nothing of it is visible outside that file.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/quantize.h"

namespace coat {
namespace device {
namespace {

constexpr int kThreads = 256;
constexpr int kThreadsLog2 = 8;

/** Passes of a tile: each thread handles one chunk of a different row in each pass. */
constexpr int kPasses = 4;

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

template <typename Body>
void dispatch_input_dtype(coat_dtype dtype, Body&& body) {
  switch (dtype) {
    case COAT_BFLOAT16: body(Constant<COAT_BFLOAT16>{}); break;
    case COAT_FLOAT16: body(Constant<COAT_FLOAT16>{}); break;
    default: body(Constant<COAT_FLOAT32>{}); break;
  }
}

/** coat_valid_matrix of the C core. */
inline bool valid_matrix(const void* x, int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && row_stride >= cols && (x != nullptr || rows * cols == 0);
}

/** The enums select template instantiations, so values outside them are refused rather than guessed. */
inline bool valid_input_dtype(coat_dtype dtype) {
  return dtype == COAT_FLOAT32 || dtype == COAT_BFLOAT16 || dtype == COAT_FLOAT16;
}

inline int64_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

}  // namespace
}  // namespace device
}  // namespace coat
