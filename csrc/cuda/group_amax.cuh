// Device-side building blocks for per-1xG amax (coat/quantize.h, "stage 1 of group scaling").
//
// coat's quantize kernels use them, and so can a fused producer kernel (an RMSNorm, an activation, a
// GEMM epilogue) that writes its output together with the per-group amax, sparing coat_group_amax_cuda a
// second pass over the output. The layout they assume:
//
//   * Each lane owns E consecutive elements of one row, E a power of two dividing G (coat's quantizers
//     use E = 8 or 16). The lanes of a row are consecutive threads, lane k of the row owning columns
//     [k*E, (k+1)*E), and a row's first lane is a multiple of the row's lane count L (a power of two).
//     A 1xG group is then group_lanes(G, E, L) consecutive, aligned lanes of one warp.
//   * Columns >= cols (a short last group, padding lanes) are given to lane_amax as 0, which leaves
//     every amax unchanged since amax >= 0.
//   * All 32 lanes of the warp call group_amax_reduce, also those whose row or columns are out of range.
//
// A producer then emits the same values coat_group_amax_cuda would compute from its stored output:
//
//   float y[E];                                   // outputs as STORED: round to the output dtype and
//   ...                                           // back to fp32 first (e.g. bf16), 0 past `cols`
//   float amax = lane_amax(y);
//   amax = group_amax_reduce(amax, group_lanes(G, E, L));
//   if (row < rows && col < cols && starts_group(col, G))
//     group_amax[row * ceil(cols / G) + col / G] = amax;        // col = this lane's first column
//
// Stage 2 (coat_reduce_amax_cuda) and stage 3 (coat_quantize_tensor_cuda) take it from there.
#pragma once

#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "fp8_chunk.cuh"

namespace coat {
namespace device {

constexpr unsigned int kFullWarpMask = 0xffffffffu;

/** Lanes holding one 1xG group when each lane owns `elements_per_lane` elements and a row spans
 *  `lanes_per_row` lanes (all powers of two). A row narrower than a group (cols <= L*E < G) has a single
 *  group, held by the row's L lanes. */
__host__ __device__ constexpr int group_lanes(int group_size, int elements_per_lane, int lanes_per_row) {
  return group_size / elements_per_lane < lanes_per_row ? group_size / elements_per_lane : lanes_per_row;
}

/** max |v| over one lane's elements, NaN ignored (coat_amax_step), 0 for all zeros. */
template <int kCount>
__device__ __forceinline__ float lane_amax(const float (&values)[kCount]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kCount; ++i) amax = amax_step(amax, values[i]);
  return amax;
}

/** Max of `value` over aligned sets of `lanes` consecutive lanes (a power of two, 1..32); every lane of a
 *  set gets the set's max. Exact and order-independent for amax values (>= 0, no NaN). All 32 lanes of
 *  the warp must call it. */
__device__ __forceinline__ float group_amax_reduce(float value, int lanes) {
  for (int mask = lanes >> 1; mask > 0; mask >>= 1)
    value = fmaxf(value, __shfl_xor_sync(kFullWarpMask, value, mask));
  return value;
}

/** Whether the lane whose first column is `col` holds the first columns of its group, i.e. is the one
 *  lane that writes the group's amax (or scale). */
__device__ __forceinline__ bool starts_group(int64_t col, int group_size) {
  return (col & (group_size - 1)) == 0;
}

}  // namespace device
}  // namespace coat
