/*
 * CUDA implementation of coat/cross_entropy.h: one 512-thread block per row (grid-stride over rows).
 *
 * Pass 1 reads the row once: each thread keeps a float32 online log-sum-exp (its running max m and
 * s = sum exp(z' - m)) and the sum of z' over the elements it visits; the block merges the threads' states by warp
 * shuffles, then through shared memory. Thread 0 reads the label's logit and writes loss and lse. Pass 2, only
 * with a gradient, reads the row again (mostly from L2) and writes the gradient over it.
 *
 * Vector path: the row start and row stride are 16-byte aligned. Threads then read 16-byte words (8 bf16 / fp16,
 * 4 fp32) and the last V % 8 (or 4) elements one by one; otherwise every element is read one by one, which
 * changes the speed, not the result's formula. The reduction order depends only on V, so a run repeats bit for
 * bit on one GPU.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "coat/cross_entropy.h"
#include "coat/detail/cross_entropy_math.h"
#include "coat/detail/quantize_math.h"
#include "launch.cuh"

namespace coat {
namespace device {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

/** A partial log-sum-exp: max m and s = sum exp(z' - m) over the elements seen, and their sum of z'. m keeps
 *  a NaN once seen; while m is -Inf (nothing finite seen yet) s is 0 whatever Inf - Inf gave. */
struct RowState {
  float max;
  float sum_exp;
  float sum_logits;
};

__device__ __forceinline__ bool replaces_max(float x, float m) { return x > m || x != x; }

__device__ __forceinline__ void add_element(RowState& state, float x) {
  if (replaces_max(x, state.max)) {
    state.sum_exp = (state.max == -INFINITY ? 0.0f : state.sum_exp * expf(state.max - x)) + 1.0f;
    state.max = x;
  } else if (state.max != -INFINITY) {
    state.sum_exp += expf(x - state.max);
  }
  state.sum_logits += x;
}

__device__ __forceinline__ RowState merge(RowState a, RowState b) {
  if (replaces_max(b.max, a.max)) {
    const RowState t = a;
    a = b;
    b = t;
  }
  // a.max >= b.max (or a.max is NaN).
  RowState out;
  out.max = a.max;
  out.sum_exp = (a.max == -INFINITY ? 0.0f : a.sum_exp) + (b.max == -INFINITY ? 0.0f : b.sum_exp * expf(b.max - a.max));
  out.sum_logits = a.sum_logits + b.sum_logits;
  return out;
}

/** The block's merged state, in every thread. */
__device__ RowState block_reduce(RowState state) {
  __shared__ RowState warp_states[kWarps];
  __shared__ RowState block_state;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    RowState other;
    other.max = __shfl_xor_sync(0xFFFFFFFFu, state.max, offset);
    other.sum_exp = __shfl_xor_sync(0xFFFFFFFFu, state.sum_exp, offset);
    other.sum_logits = __shfl_xor_sync(0xFFFFFFFFu, state.sum_logits, offset);
    state = merge(state, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = state;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowState total = warp_states[0];
    for (int w = 1; w < kWarps; ++w) total = merge(total, warp_states[w]);
    block_state = total;
  }
  __syncthreads();
  const RowState result = block_state;
  __syncthreads();  // block_state and warp_states are reused by the next row
  return result;
}

template <coat_dtype kDtype>
__host__ __device__ constexpr int element_bytes() {
  return kDtype == COAT_FLOAT32 ? 4 : 2;
}

/** Calls visit(j, value) for the elements j of the row that this thread owns (every one exactly once over the
 *  block), value = logits[j] as float32. With kWrite, visit returns the element's new value, stored in place. */
template <coat_dtype kDtype, bool kVector, bool kWrite, typename Visit>
__device__ __forceinline__ void for_each_element(void* row, int vocab, Visit visit) {
  constexpr int kVec = 16 / element_bytes<kDtype>();
  int tail_start = 0;
  if constexpr (kVector) {
    const int words = vocab / kVec;
    uint4* row_words = static_cast<uint4*>(row);
    for (int w = threadIdx.x; w < words; w += kThreads) {
      uint4 word = row_words[w];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float value = coat_load_f32(&word, kDtype, e);
        if constexpr (kWrite) {
          coat_store_as(&word, kDtype, e, visit(w * kVec + e, value));
        } else {
          visit(w * kVec + e, value);
        }
      }
      if constexpr (kWrite) row_words[w] = word;
    }
    tail_start = words * kVec;
  }
  for (int j = tail_start + threadIdx.x; j < vocab; j += kThreads) {
    const float value = coat_load_f32(row, kDtype, j);
    if constexpr (kWrite) {
      coat_store_as(row, kDtype, j, visit(j, value));
    } else {
      visit(j, value);
    }
  }
}

template <coat_dtype kDtype, bool kVector>
__global__ void __launch_bounds__(kThreads) cross_entropy_kernel(const coat_cross_entropy_args a) {
  const int vocab = static_cast<int>(a.vocab);
  const float cap = a.softcap;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    void* row = static_cast<char*>(a.logits) + r * a.row_stride * element_bytes<kDtype>();
    const int64_t label = a.labels[r];
    const bool ignored = label == a.ignore_index;
    const bool valid = coat_cross_entropy_label_in_range(label, a.vocab);

    RowState state{-INFINITY, 0.0f, 0.0f};
    for_each_element<kDtype, kVector, false>(row, vocab, [&](int, float z) { add_element(state, coat_ce_capped(z, cap)); });
    state = block_reduce(state);
    const float lse = isinf(state.max) ? state.max : state.max + logf(state.sum_exp);

    if (threadIdx.x == 0) {
      a.lse[r] = lse;
      if (ignored) {
        a.loss[r] = 0.0f;
      } else if (!valid) {
        a.loss[r] = coat_f32_from_bits(0x7FC00000u);
      } else {
        const float label_logit = coat_ce_capped(coat_load_f32(row, kDtype, label), cap);
        a.loss[r] = coat_ce_loss(lse, label_logit, state.sum_logits, a.vocab, a.label_smoothing, a.z_loss);
      }
    }
    if (a.grad_scale == nullptr) continue;

    // Thread 0's read of the label's logit is ordered before every thread's overwrite of it.
    __syncthreads();
    const float scale = a.grad_scale[r * a.grad_scale_stride];
    for_each_element<kDtype, kVector, true>(row, vocab, [&](int j, float z) {
      if (ignored) return 0.0f;
      if (!valid) return coat_f32_from_bits(0x7FC00000u);
      const float capped = coat_ce_capped(z, cap);
      return scale * coat_ce_dlogit(capped, expf(capped - lse), j == label, lse, a.vocab, a.label_smoothing, a.z_loss,
                                    cap);
    });
  }
}

template <coat_dtype kDtype>
void launch(const coat_cross_entropy_args& a, cudaStream_t stream) {
  const unsigned int blocks = clamp_grid(a.rows, kMaxGridX);
  const bool vector = is_aligned(a.logits, 16) && (a.row_stride * element_bytes<kDtype>()) % 16 == 0;
  if (vector) {
    cross_entropy_kernel<kDtype, true><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    cross_entropy_kernel<kDtype, false><<<blocks, kThreads, 0, stream>>>(a);
  }
}

}  // namespace
}  // namespace device
}  // namespace coat

extern "C" coat_status coat_cross_entropy_cuda(const coat_cross_entropy_args* args, coat_cuda_stream stream) {
  using namespace coat::device;
  if (!coat_cross_entropy_valid_args(args)) return COAT_ERROR_INVALID_ARGUMENT;
  if (args->rows == 0) return COAT_SUCCESS;
  const cudaStream_t s = as_cuda_stream(stream);
  switch (args->dtype) {
    case COAT_BFLOAT16: launch<COAT_BFLOAT16>(*args, s); break;
    case COAT_FLOAT16: launch<COAT_FLOAT16>(*args, s); break;
    default: launch<COAT_FLOAT32>(*args, s); break;
  }
  return launch_status();
}
