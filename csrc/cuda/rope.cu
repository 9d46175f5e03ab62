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

#include "coat/detail/quantize_math.h"
#include "coat/detail/rope_math.h"
#include "coat/rope.h"
#include "fp8_chunk.cuh"
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

// ---------------------------------------------------------------------------------------------------
// coat_qk_norm_rope, general path (any dtype, head_dim and alignment): one warp per (token, head) row, lane l
// holding the row's chunk l (elements [8l, 8l + 8),
// the chunk of lane l in coat/detail/rope_math.h's reduction order). The row's sum of squares is the xor
// butterfly of coat_combine_lane_partials; each lane writes its normalized fp32 values to the warp's row of
// shared memory, from which every lane reads its elements' RoPE partners (j + h or j - h, in any lane); the
// saved group's amax is a max over the group's G / 8 lanes. Elements move one by one with the C core's
// coat_load_f32 / coat_store_as: the kernel reads and writes each byte once, and its speed is the DRAM's
// for the head_dim of 64-256 it serves.

constexpr int kQkNormWarps = kThreads / 32;
constexpr unsigned int kQkFullMask = 0xffffffffu;

__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(const coat_qk_norm_rope_args a) {
  __shared__ float normed[kQkNormWarps][COAT_QK_NORM_MAX_HEAD_DIM];
  const coat_rope_args& r = a.rope;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t dim = r.head_dim, half = dim / 2, col = int64_t{lane} * COAT_NORM_ACT_CHUNK;
  const int count = col >= dim ? 0 : (dim - col < COAT_NORM_ACT_CHUNK ? static_cast<int>(dim - col) : COAT_NORM_ACT_CHUNK);
  const int64_t heads = r.q_heads + r.k_heads, rows = r.batch * r.seq * heads;
  const int64_t ngroups = coat_ceil_div(dim, a.save_group_size);
  const int group_lanes = static_cast<int>(a.save_group_size / COAT_NORM_ACT_CHUNK);
  for (int64_t row = int64_t{blockIdx.x} * kQkNormWarps + warp; row < rows; row += int64_t{gridDim.x} * kQkNormWarps) {
    const int64_t token = row / heads, head_index = row - token * heads;
    const int64_t b = token / r.seq, s = token - b * r.seq;
    const bool is_q = head_index < r.q_heads;
    const int64_t head = is_q ? head_index : head_index - r.q_heads, local_heads = is_q ? r.q_heads : r.k_heads;
    const int64_t* strides = is_q ? r.q_strides : r.k_strides;
    const void* x = is_q ? r.q : r.k;
    const void* weight = is_q ? a.q_weight : a.k_weight;
    const int64_t out_row = token * local_heads + head;
    const int64_t x_offset = b * strides[0] + s * strides[1] + head * strides[2] + col;

    float values[COAT_NORM_ACT_CHUNK];
    float partial = 0.0f, amax = 0.0f;
#pragma unroll
    for (int i = 0; i < COAT_NORM_ACT_CHUNK; ++i) {
      values[i] = i < count ? coat_load_f32(x, r.dtype, x_offset + i) : 0.0f;
      if (i < count) {
        partial = partial + values[i] * values[i];
        amax = coat_amax_step(amax, values[i]);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) partial = partial + __shfl_xor_sync(kQkFullMask, partial, offset);
    const float rstd = coat_canonical_nan(coat_rmsnorm_rstd(partial, dim, a.eps));
    if (lane == 0) (is_q ? a.q_rstd : a.k_rstd)[out_row] = rstd;
#pragma unroll
    for (int i = 0; i < COAT_NORM_ACT_CHUNK; ++i)
      if (i < count)
        normed[warp][col + i] = coat_rmsnorm_apply(
            values[i], rstd, coat_rmsnorm_weight(coat_load_f32(weight, a.weight_dtype, col + i), a.weight_offset));
    __syncwarp();

    const int64_t cos_offset = b * r.cos_strides[0] + s * r.cos_strides[1];
    const int64_t sin_offset = b * r.sin_strides[0] + s * r.sin_strides[1];
    void* out = is_q ? r.q_out : r.k_out;
#pragma unroll
    for (int i = 0; i < COAT_NORM_ACT_CHUNK; ++i) {
      if (i >= count) break;
      const int64_t j = col + i, partner = j < half ? j + half : j - half;
      const float y = coat_qk_norm_rope_element(
          j, half, normed[warp][j], normed[warp][partner], coat_load_f32(r.cos, r.table_dtype, cos_offset + j),
          coat_load_f32(r.cos, r.table_dtype, cos_offset + partner), coat_load_f32(r.sin, r.table_dtype, sin_offset + j),
          coat_load_f32(r.sin, r.table_dtype, sin_offset + partner));
      coat_store_as(out, r.dtype, out_row * dim + j, y);
    }

    for (int mask = group_lanes >> 1; mask > 0; mask >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kQkFullMask, amax, mask));
    const float scale = coat_scale_from_amax(amax, COAT_E4M3);
    uint8_t* saved = is_q ? a.q_saved : a.k_saved;
#pragma unroll
    for (int i = 0; i < COAT_NORM_ACT_CHUNK; ++i)
      if (i < count) saved[out_row * dim + col + i] = coat_quantize_value(values[i], scale, COAT_E4M3);
    if (count > 0 && col % a.save_group_size == 0)
      (is_q ? a.q_saved_scales : a.k_saved_scales)[out_row * ngroups + col / a.save_group_size] = scale;
    __syncwarp();  // the next row overwrites this warp's shared row
  }
}


// coat_qk_norm_rope, 16-byte path (qk_norm_vector_path: 16-bit q and k, head_dim a multiple of 16, aligned rows
// and tables). A row takes P lanes, the power of two >= head_dim / 8, so 32 / P rows share a warp; lane l of a
// row holds its chunk l as in the general kernel. The xor butterfly over the P lanes then adds the same partials
// in the same order (the general kernel's wider offsets only add the +0 of lanes past the row), so every output
// bit is the general kernel's. A slot of P lanes takes a token and kQkHeadsPerItem of its heads: it loads their
// rows with 16-byte loads before it normalizes the first, and the token's table chunks once; the RoPE partner
// of chunk l (head_dim / 2 columns away) comes from lane l +- head_dim / 16 by a shuffle. Loops and shuffles
// are uniform over the warp; rows past the tensor compute on zeros and store nothing.

constexpr int kQkHeadsPerItem = 4;

/** A whole chunk by 16-byte loads where `load`, else zeros without an access. */
template <typename S>
__device__ __forceinline__ void load_whole_chunk(Chunk<S>& chunk, const S* __restrict__ source, bool load) {
  if (load) load_chunk<true>(chunk, source, kChunk);
  else load_chunk<false>(chunk, source, 0);
}

/** A chunk of outputs rounded to kDtype as coat_store_as rounds them: by cvt.rn pairs, or by coat's conversions
 *  (NaN canonical) when the chunk holds a NaN. */
template <coat_dtype kDtype>
__device__ __forceinline__ uint4 pack_row_chunk(const float y[kChunk]) {
  bool nan = false;
#pragma unroll
  for (int e = 0; e < kChunk; ++e) nan |= y[e] != y[e];
  uint32_t words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w)
    words[w] = nan ? pack_16bit<kDtype>(y[2 * w], y[2 * w + 1]) : pack_16bit_not_nan<kDtype>(y[2 * w], y[2 * w + 1]);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

template <coat_dtype kDtype, coat_dtype kTableDtype>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_vector_kernel(const coat_qk_norm_rope_args a, int row_lanes) {
  using T = typename Element<kDtype>::Storage;
  using U = typename Element<kTableDtype>::Storage;
  const coat_rope_args& r = a.rope;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot_lane = lane & (row_lanes - 1), slots_per_warp = 32 / row_lanes;
  const int dim = static_cast<int>(r.head_dim), half = dim / 2, chunks = dim / kChunk;
  const bool in_row = slot_lane < chunks;
  const int col = slot_lane * kChunk, partner_col = col < half ? col + half : col - half;
  const int partner_lane = in_row ? lane - slot_lane + partner_col / kChunk : lane;
  const int group_lanes = min(static_cast<int>(a.save_group_size) / kChunk, row_lanes);
  const int64_t ngroups = coat_ceil_div(dim, a.save_group_size);
  const int64_t heads = r.q_heads + r.k_heads, head_items = coat_ceil_div(heads, kQkHeadsPerItem);
  const int64_t items = r.batch * r.seq * head_items;

  float q_weight[kChunk], k_weight[kChunk];
#pragma unroll
  for (int e = 0; e < kChunk; ++e) {
    q_weight[e] = in_row && r.q_heads > 0
                      ? coat_rmsnorm_weight(coat_load_f32(a.q_weight, a.weight_dtype, col + e), a.weight_offset) : 0.0f;
    k_weight[e] = in_row && r.k_heads > 0
                      ? coat_rmsnorm_weight(coat_load_f32(a.k_weight, a.weight_dtype, col + e), a.weight_offset) : 0.0f;
  }

  const int64_t items_per_sweep = int64_t{gridDim.x} * kQkNormWarps * slots_per_warp;
  for (int64_t warp_item = (int64_t{blockIdx.x} * kQkNormWarps + warp) * slots_per_warp; warp_item < items;
       warp_item += items_per_sweep) {
    const int64_t item = warp_item + lane / row_lanes;
    const bool item_valid = item < items;
    const int64_t token = item_valid ? item / head_items : 0;
    const int64_t first_head = item_valid ? (item - token * head_items) * kQkHeadsPerItem : heads;
    const int64_t b = token / r.seq, s = token - b * r.seq;

    Chunk<T> x[kQkHeadsPerItem];
#pragma unroll
    for (int i = 0; i < kQkHeadsPerItem; ++i) {
      const int64_t head = first_head + i;
      const bool is_q = head < r.q_heads;
      const int64_t local = is_q ? head : head - r.q_heads;
      const int64_t* strides = is_q ? r.q_strides : r.k_strides;
      const T* row = static_cast<const T*>(is_q ? r.q : r.k) + b * strides[0] + s * strides[1] + local * strides[2];
      load_whole_chunk(x[i], row + col, in_row && head < heads);
    }
    Chunk<U> cos_own, cos_partner, sin_own, sin_partner;
    const U* cos_row = static_cast<const U*>(r.cos) + b * r.cos_strides[0] + s * r.cos_strides[1];
    const U* sin_row = static_cast<const U*>(r.sin) + b * r.sin_strides[0] + s * r.sin_strides[1];
    const bool any_row = in_row && first_head < heads;
    load_whole_chunk(cos_own, cos_row + col, any_row);
    load_whole_chunk(cos_partner, cos_row + partner_col, any_row);
    load_whole_chunk(sin_own, sin_row + col, any_row);
    load_whole_chunk(sin_partner, sin_row + partner_col, any_row);

#pragma unroll
    for (int i = 0; i < kQkHeadsPerItem; ++i) {
      const int64_t head = first_head + i;
      const bool valid = in_row && head < heads, is_q = head < r.q_heads;
      const int64_t local_heads = is_q ? r.q_heads : r.k_heads;
      const int64_t out_row = token * local_heads + (is_q ? head : head - r.q_heads);
      float values[kChunk], partial = 0.0f, amax = 0.0f;
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        values[e] = Element<kDtype>::to_f32(x[i].e[e]);
        partial = partial + values[e] * values[e];
        amax = amax_step(amax, values[e]);
      }
      for (int offset = row_lanes / 2; offset > 0; offset >>= 1)
        partial = partial + __shfl_xor_sync(kQkFullMask, partial, offset);
      const float rstd = coat_canonical_nan(coat_rmsnorm_rstd(partial, dim, a.eps));
      if (valid && slot_lane == 0) (is_q ? a.q_rstd : a.k_rstd)[out_row] = rstd;

      float normed[kChunk], partner[kChunk], y[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) normed[e] = coat_rmsnorm_apply(values[e], rstd, is_q ? q_weight[e] : k_weight[e]);
#pragma unroll
      for (int e = 0; e < kChunk; ++e) partner[e] = __shfl_sync(kQkFullMask, normed[e], partner_lane);
#pragma unroll
      for (int e = 0; e < kChunk; ++e)
        y[e] = coat_qk_norm_rope_element(
            col + e, half, normed[e], partner[e], Element<kTableDtype>::to_f32(cos_own.e[e]),
            Element<kTableDtype>::to_f32(cos_partner.e[e]), Element<kTableDtype>::to_f32(sin_own.e[e]),
            Element<kTableDtype>::to_f32(sin_partner.e[e]));
      if (valid)
        *reinterpret_cast<uint4*>(static_cast<T*>(is_q ? r.q_out : r.k_out) + out_row * dim + col) =
            pack_row_chunk<kDtype>(y);

      for (int mask = group_lanes >> 1; mask > 0; mask >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(kQkFullMask, amax, mask));
      const float scale = scale_from_amax<COAT_E4M3>(amax);
      const Codes codes = encode_chunk<COAT_E4M3, false>(values, scale, reciprocal_of_normal(scale));
      if (valid) {
        *reinterpret_cast<uint2*>((is_q ? a.q_saved : a.k_saved) + out_row * dim + col) = make_uint2(codes.lo, codes.hi);
        if (col % a.save_group_size == 0)
          (is_q ? a.q_saved_scales : a.k_saved_scales)[out_row * ngroups + col / a.save_group_size] = scale;
      }
    }
  }
}

/** Whether coat_qk_norm_rope can take the 16-byte path: 16-bit q and k, whole chunks in each half of a row, and
 *  every row and table chunk 16-byte aligned (the codes 8-byte aligned). */
bool qk_norm_vector_path(const coat_qk_norm_rope_args& a) {
  const coat_rope_args& r = a.rope;
  if (r.dtype == COAT_FLOAT32 || r.head_dim % (2 * kChunk) != 0) return false;
  if (!vector_path(r)) return false;
  for (const void* pointer : {static_cast<const void*>(a.q_saved), static_cast<const void*>(a.k_saved)})
    if (!is_aligned(pointer, 8)) return false;
  return true;
}

template <coat_dtype kDtype>
void launch_qk_norm_vector(const coat_qk_norm_rope_args& a, dim3 grid, int row_lanes, cudaStream_t stream) {
  if (a.rope.table_dtype == COAT_BFLOAT16) {
    qk_norm_rope_vector_kernel<kDtype, COAT_BFLOAT16><<<grid, kThreads, 0, stream>>>(a, row_lanes);
  } else if (a.rope.table_dtype == COAT_FLOAT16) {
    qk_norm_rope_vector_kernel<kDtype, COAT_FLOAT16><<<grid, kThreads, 0, stream>>>(a, row_lanes);
  } else {
    qk_norm_rope_vector_kernel<kDtype, COAT_FLOAT32><<<grid, kThreads, 0, stream>>>(a, row_lanes);
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

coat_status coat_qk_norm_rope_cuda(const coat_qk_norm_rope_args* args, coat_cuda_stream stream) {
  using namespace coat::device;
  if (!coat_qk_norm_valid_args(args)) return COAT_ERROR_INVALID_ARGUMENT;
  const coat_rope_args& r = args->rope;
  const int64_t heads = r.q_heads + r.k_heads, rows = r.batch * r.seq * heads;
  if (rows == 0) return COAT_SUCCESS;
  const cudaStream_t cuda_stream = as_cuda_stream(stream);
  if (qk_norm_vector_path(*args)) {
    int row_lanes = 1;
    while (row_lanes < r.head_dim / kChunk) row_lanes *= 2;
    const int64_t items = r.batch * r.seq * ceil_div(heads, kQkHeadsPerItem);
    const dim3 grid(clamp_grid(ceil_div(items, kThreads / row_lanes), kMaxGridX));
    if (r.dtype == COAT_BFLOAT16) launch_qk_norm_vector<COAT_BFLOAT16>(*args, grid, row_lanes, cuda_stream);
    else launch_qk_norm_vector<COAT_FLOAT16>(*args, grid, row_lanes, cuda_stream);
    return launch_status();
  }
  const dim3 grid(clamp_grid(ceil_div(rows, kQkNormWarps), kMaxGridX));
  qk_norm_rope_kernel<<<grid, kThreads, 0, cuda_stream>>>(*args);
  return launch_status();
}
