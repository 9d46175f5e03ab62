/*
 * CUDA implementation of coat/rope.h. Element for element it evaluates the expressions of
 * coat/detail/rope_math.h, as csrc/cpu/rope.c does, with coat/float_bits.h's conversions, so q_out and k_out
 * equal the C core's bit for bit (-fmad=false keeps a*b - c*d from becoming an FMA).
 *
 * The kernel is memory-bound: it reads q, k and the tables once and writes q_out and k_out once, in one
 * launch for q and k. The work of a token (b, s) is its q_heads + k_heads rows. A row is cut into
 * L = ceil(h / 8) lanes (h = head_dim / 2): lane l owns the chunks [8l, 8l + 8) and [h + 8l, h + 8l + 8),
 * whose elements are each other's rotation partners, so it reads every element of its rows once. A token's
 * heads are dealt to G head groups of about kHeadsPerThread heads: thread (group g, lane l) loads its lane's
 * chunks of cos and sin once per token and rotates heads g, g + G, g + 2G, ... with them, issuing the loads
 * of kBytesInFlight bytes of heads before it rotates the first. A warp's load then covers 16 bytes per lane of
 * several consecutive heads. Blocks hold 256 / (L * G) tokens and loop over tokens grid-stride; indices are int64.
 *
 * Vector path: h % 8 == 0 and every pointer and stride 16-byte aligned. Each chunk then moves with 16-byte
 * loads and stores (two for fp32). Otherwise the same kernel moves element by element with bounds, which
 * changes the speed, not a bit of the result.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/detail/rope_math.h"
#include "coat/rope.h"
#include "launch.cuh"

namespace coat {
namespace device {
namespace {

constexpr int kThreads = 256;
/** Elements of each half that a lane rotates per row: one 16-byte word of bf16 / fp16, two of fp32. */
constexpr int kChunk = 8;
/** Heads a thread rotates per token with one load of its table chunks. */
constexpr int kHeadsPerThread = 8;
/** Bytes of q or k a thread loads before it rotates the first of them: 4 heads of bf16 / fp16, 2 of fp32. */
constexpr int kBytesInFlight = 128;

/** Storage, exact widening and rounding (coat_load_f32 / coat_store_as of the C core) of a dtype. */
template <coat_dtype kDtype>
struct Element {
  using Storage = float;
  __device__ static float to_f32(float v) { return v; }
  __device__ static float from_f32(float v) { return coat_canonical_nan(v); }
};
template <>
struct Element<COAT_BFLOAT16> {
  using Storage = uint16_t;
  __device__ static float to_f32(uint16_t v) { return coat_bf16_to_f32(v); }
  __device__ static uint16_t from_f32(float v) { return coat_f32_to_bf16(v); }
};
template <>
struct Element<COAT_FLOAT16> {
  using Storage = uint16_t;
  __device__ static float to_f32(uint16_t v) { return coat_f16_to_f32(v); }
  __device__ static uint16_t from_f32(float v) { return coat_f32_to_f16(v); }
};

template <typename S>
struct alignas(16) Chunk {
  S e[kChunk];
};

/** Elements [0, count) of a chunk from `source`, zeros past count. kVector: count == kChunk and source is
 *  16-byte aligned. */
template <bool kVector, typename S>
__device__ __forceinline__ void load_chunk(Chunk<S>& chunk, const S* __restrict__ source, int count) {
  if constexpr (kVector) {
    const uint4* words = reinterpret_cast<const uint4*>(source);
    uint4* target = reinterpret_cast<uint4*>(chunk.e);
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(Chunk<S>) / sizeof(uint4)); ++w) target[w] = words[w];
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) chunk.e[i] = i < count ? source[i] : S(0);
  }
}

template <bool kVector, typename S>
__device__ __forceinline__ void store_chunk(const Chunk<S>& chunk, S* __restrict__ target, int count) {
  if constexpr (kVector) {
    const uint4* words = reinterpret_cast<const uint4*>(chunk.e);
    uint4* destination = reinterpret_cast<uint4*>(target);
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(Chunk<S>) / sizeof(uint4)); ++w) destination[w] = words[w];
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      if (i < count) target[i] = chunk.e[i];
  }
}

struct RopeParams {
  const void* q;
  const void* k;
  const void* cos;
  const void* sin;
  void* q_out;
  void* k_out;
  int64_t q_strides[3];
  int64_t k_strides[3];
  int64_t cos_strides[2];
  int64_t sin_strides[2];
  int64_t tokens;  ///< batch * seq
  int64_t seq;
  int64_t q_heads;
  int64_t k_heads;
  int half;              ///< head_dim / 2
  int lanes;             ///< L: lanes per row
  int head_groups;       ///< G: threads with the same lane that share a token's heads
  int tokens_per_block;  ///< blockDim.x == tokens_per_block * L * G
  int inverse;
};

/** Where a lane reads its chunks of row (b, s, head) of q, or of k for head >= q_heads, and where it writes their
 *  rotation: column `col` of the row. q_token and k_token point at column col of the token's head 0. */
template <typename T>
struct RowAddress {
  const T* source;
  T* target;
};

template <typename T>
__device__ __forceinline__ RowAddress<T> row_address(const RopeParams& p, const T* q_token, const T* k_token,
                                                     int64_t token, int64_t head, int col) {
  const bool is_q = head < p.q_heads;
  const int64_t local = is_q ? head : head - p.q_heads;
  const int64_t heads = is_q ? p.q_heads : p.k_heads;
  const T* source = is_q ? q_token + local * p.q_strides[2] : k_token + local * p.k_strides[2];
  T* target = static_cast<T*>(is_q ? p.q_out : p.k_out) + (token * heads + local) * (2 * int64_t{p.half}) + col;
  return {source, target};
}

/** See the top of this file. kDtype: q, k and the outputs; kTableDtype: cos and sin. */
template <coat_dtype kDtype, coat_dtype kTableDtype, bool kVector>
__global__ void __launch_bounds__(kThreads) rotary_embedding_kernel(const RopeParams p) {
  using T = typename Element<kDtype>::Storage;
  using U = typename Element<kTableDtype>::Storage;
  const int threads_per_token = p.lanes * p.head_groups;
  const int token_in_block = threadIdx.x / threads_per_token;
  const int thread_in_token = threadIdx.x - token_in_block * threads_per_token;
  const int head_group = thread_in_token / p.lanes;
  const int col = (thread_in_token - head_group * p.lanes) * kChunk;
  const int count = kVector ? kChunk : min(kChunk, p.half - col);
  constexpr int kHeadBatch = kBytesInFlight / static_cast<int>(2 * sizeof(Chunk<T>));
  const int64_t heads = p.q_heads + p.k_heads;
  const int64_t head_step = int64_t{kHeadBatch} * p.head_groups;

  for (int64_t token = int64_t{blockIdx.x} * p.tokens_per_block + token_in_block; token < p.tokens;
       token += int64_t{gridDim.x} * p.tokens_per_block) {
    const int64_t b = token / p.seq;
    const int64_t s = token - b * p.seq;

    // This lane's table chunks, once per token for all the heads the thread rotates.
    const U* cos_row = static_cast<const U*>(p.cos) + b * p.cos_strides[0] + s * p.cos_strides[1] + col;
    const U* sin_row = static_cast<const U*>(p.sin) + b * p.sin_strides[0] + s * p.sin_strides[1] + col;
    Chunk<U> cos_first, cos_second, sin_first, sin_second;
    load_chunk<kVector>(cos_first, cos_row, count);
    load_chunk<kVector>(cos_second, cos_row + p.half, count);
    load_chunk<kVector>(sin_first, sin_row, count);
    load_chunk<kVector>(sin_second, sin_row + p.half, count);
    float c1[kChunk], c2[kChunk], s1[kChunk], s2[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      c1[i] = Element<kTableDtype>::to_f32(cos_first.e[i]);
      c2[i] = Element<kTableDtype>::to_f32(cos_second.e[i]);
      coat_rope_pair_sines(Element<kTableDtype>::to_f32(sin_first.e[i]), Element<kTableDtype>::to_f32(sin_second.e[i]),
                           p.inverse, &s1[i], &s2[i]);
    }

    const T* q_token = static_cast<const T*>(p.q) + b * p.q_strides[0] + s * p.q_strides[1] + col;
    const T* k_token = static_cast<const T*>(p.k) + b * p.k_strides[0] + s * p.k_strides[1] + col;
    for (int64_t first = head_group; first < heads; first += head_step) {
      Chunk<T> x1[kHeadBatch], x2[kHeadBatch];
      RowAddress<T> rows[kHeadBatch];
#pragma unroll
      for (int i = 0; i < kHeadBatch; ++i) {
        const int64_t head = first + int64_t{i} * p.head_groups;
        if (head < heads) {
          rows[i] = row_address(p, q_token, k_token, token, head, col);
          load_chunk<kVector>(x1[i], rows[i].source, count);
          load_chunk<kVector>(x2[i], rows[i].source + p.half, count);
        }
      }
#pragma unroll
      for (int i = 0; i < kHeadBatch; ++i) {
        if (first + int64_t{i} * p.head_groups >= heads) break;
        Chunk<T> y1, y2;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          float first_half, second_half;
          coat_rope_rotate_pair(Element<kDtype>::to_f32(x1[i].e[e]), Element<kDtype>::to_f32(x2[i].e[e]), c1[e], c2[e],
                                s1[e], s2[e], &first_half, &second_half);
          y1.e[e] = Element<kDtype>::from_f32(first_half);
          y2.e[e] = Element<kDtype>::from_f32(second_half);
        }
        store_chunk<kVector>(y1, rows[i].target, count);
        store_chunk<kVector>(y2, rows[i].target + p.half, count);
      }
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

/** Whether every chunk can move as 16-byte words: whole chunks, aligned pointers, strides that keep them so. */
bool vector_path(const coat_rope_args& a) {
  if ((a.head_dim / 2) % kChunk != 0) return false;
  for (const void* pointer : {a.q, a.k, a.cos, a.sin, static_cast<const void*>(a.q_out), static_cast<const void*>(a.k_out)})
    if (!is_aligned(pointer, 16)) return false;
  for (int d = 0; d < 3; ++d)
    if ((a.q_strides[d] * element_size(a.dtype)) % 16 != 0 || (a.k_strides[d] * element_size(a.dtype)) % 16 != 0)
      return false;
  for (int d = 0; d < 2; ++d)
    if ((a.cos_strides[d] * element_size(a.table_dtype)) % 16 != 0 ||
        (a.sin_strides[d] * element_size(a.table_dtype)) % 16 != 0)
      return false;
  return true;
}

struct LaunchShape {
  dim3 grid;
  dim3 block;
  bool vector;
};

template <coat_dtype kDtype, coat_dtype kTableDtype>
void launch(const RopeParams& p, const LaunchShape& shape, cudaStream_t stream) {
  if (shape.vector) {
    rotary_embedding_kernel<kDtype, kTableDtype, true><<<shape.grid, shape.block, 0, stream>>>(p);
  } else {
    rotary_embedding_kernel<kDtype, kTableDtype, false><<<shape.grid, shape.block, 0, stream>>>(p);
  }
}

template <coat_dtype kDtype>
void launch_for_table_dtype(coat_dtype table_dtype, const RopeParams& p, const LaunchShape& shape,
                            cudaStream_t stream) {
  switch (table_dtype) {
    case COAT_BFLOAT16: launch<kDtype, COAT_BFLOAT16>(p, shape, stream); break;
    case COAT_FLOAT16: launch<kDtype, COAT_FLOAT16>(p, shape, stream); break;
    default: launch<kDtype, COAT_FLOAT32>(p, shape, stream); break;
  }
}

}  // namespace
}  // namespace device
}  // namespace coat

coat_status coat_rotary_embedding_cuda(const coat_rope_args* args, int inverse, coat_cuda_stream stream) {
  using namespace coat::device;
  if (!coat_rope_valid_args(args)) return COAT_ERROR_INVALID_ARGUMENT;
  const coat_rope_args& a = *args;
  const int64_t tokens = a.batch * a.seq;
  const int64_t heads = a.q_heads + a.k_heads;
  if (tokens == 0 || heads == 0) return COAT_SUCCESS;

  RopeParams p{};
  p.q = a.q;
  p.k = a.k;
  p.cos = a.cos;
  p.sin = a.sin;
  p.q_out = a.q_out;
  p.k_out = a.k_out;
  for (int d = 0; d < 3; ++d) {
    p.q_strides[d] = a.q_strides[d];
    p.k_strides[d] = a.k_strides[d];
  }
  for (int d = 0; d < 2; ++d) {
    p.cos_strides[d] = a.cos_strides[d];
    p.sin_strides[d] = a.sin_strides[d];
  }
  p.tokens = tokens;
  p.seq = a.seq;
  p.q_heads = a.q_heads;
  p.k_heads = a.k_heads;
  p.half = static_cast<int>(a.head_dim / 2);
  p.lanes = static_cast<int>(ceil_div(p.half, kChunk));
  // About kHeadsPerThread heads per thread, as many groups as fit in a block beside the token's lanes.
  const int64_t max_groups = kThreads / p.lanes;
  const int64_t groups = ceil_div(heads, kHeadsPerThread);
  p.head_groups = static_cast<int>(groups < max_groups ? groups : max_groups);
  p.tokens_per_block = kThreads / (p.lanes * p.head_groups);
  p.inverse = inverse != 0;

  LaunchShape shape;
  shape.grid = dim3(clamp_grid(ceil_div(tokens, p.tokens_per_block), kMaxGridX));
  shape.block = dim3(p.tokens_per_block * p.lanes * p.head_groups);
  shape.vector = vector_path(a);
  const cudaStream_t cuda_stream = as_cuda_stream(stream);
  switch (a.dtype) {
    case COAT_BFLOAT16: launch_for_table_dtype<COAT_BFLOAT16>(a.table_dtype, p, shape, cuda_stream); break;
    case COAT_FLOAT16: launch_for_table_dtype<COAT_FLOAT16>(a.table_dtype, p, shape, cuda_stream); break;
    default: launch_for_table_dtype<COAT_FLOAT32>(a.table_dtype, p, shape, cuda_stream); break;
  }
  return launch_status();
}
