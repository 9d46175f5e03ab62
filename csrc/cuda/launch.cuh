// Host-side launch helpers shared by coat's CUDA entry points: stream conversion, grid sizing within the
// gridDim limits, alignment tests and the status to return after enqueueing work.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/common.h"

namespace coat {
namespace device {

/** gridDim.x may reach 2^31 - 1, gridDim.y 65535. Kernels whose grid was clamped to these cover the
 *  remaining tiles with grid-stride loops, so any int64 extent is served. */
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

/** The public headers spell the stream as struct CUstream_st*, which is what cudaStream_t is. */
inline cudaStream_t as_cuda_stream(coat_cuda_stream stream) { return static_cast<cudaStream_t>(stream); }

/** min(blocks, limit) as a grid dimension; blocks >= 1. */
inline unsigned int clamp_grid(int64_t blocks, int64_t limit) {
  return static_cast<unsigned int>(blocks < limit ? blocks : limit);
}

/** Smallest k with 2^k >= n, for n >= 1. */
inline int ceil_log2(int64_t n) {
  int log2 = 0;
  while ((int64_t{1} << log2) < n) ++log2;
  return log2;
}

inline bool is_aligned(const void* pointer, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

/** Status after enqueueing kernels. Peek leaves the error in place for the caller, which reads it with
 *  cudaGetLastError to report it (see coat_status's COAT_ERROR_CUDA). */
inline coat_status launch_status() {
  return cudaPeekAtLastError() == cudaSuccess ? COAT_SUCCESS : COAT_ERROR_CUDA;
}

}  // namespace device
}  // namespace coat
