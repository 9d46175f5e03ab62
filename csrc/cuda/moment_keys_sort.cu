/*
 * coat_moment_keys_sort_cuda (coat/adamw.h): the k keys of coat_moment_counts sorted for coat_moment_stats by
 * cub's radix sort, keys only and on the bits a key can have set, which takes a capture of coat.report about a
 * third of the time of a sort of every bit with an index beside each key (at::sort).
 */
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>
#include <stdint.h>

#include "coat/adamw.h"
#include "launch.cuh"

namespace {

/** One past the highest bit that the keys of n states can have set: 16 bits of k, then the state's prefix. */
int key_end_bit(int64_t n) { return 16 + coat::device::ceil_log2(n); }

cudaError_t sort_keys(void* workspace, size_t& workspace_bytes, const int32_t* keys, int32_t* sorted_keys,
                      int64_t count, int64_t n, cudaStream_t stream) {
  // Every key is >= 0 (prefix <= 0x7FFF): as unsigned integers they order as they do as int32.
  return cub::DeviceRadixSort::SortKeys(workspace, workspace_bytes, reinterpret_cast<const uint32_t*>(keys),
                                        reinterpret_cast<uint32_t*>(sorted_keys), count, 0, key_end_bit(n), stream);
}

}  // namespace

extern "C" size_t coat_moment_keys_sort_workspace(int64_t count, int64_t n) {
  if (count < 1 || n < 1 || n > 0x8000) return 0;
  size_t bytes = 0;
  return sort_keys(nullptr, bytes, nullptr, nullptr, count, n, nullptr) == cudaSuccess ? bytes : 0;
}

extern "C" coat_status coat_moment_keys_sort_cuda(const int32_t* keys, int32_t* sorted_keys, int64_t count, int64_t n,
                                                  void* workspace, size_t workspace_bytes, coat_cuda_stream stream) {
  if (count < 0 || n < 1 || n > 0x8000 || (count > 0 && (keys == nullptr || sorted_keys == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  if (count == 0) return COAT_SUCCESS;
  if (workspace == nullptr || workspace_bytes < coat_moment_keys_sort_workspace(count, n))
    return COAT_ERROR_INVALID_ARGUMENT;
  size_t bytes = workspace_bytes;
  if (sort_keys(workspace, bytes, keys, sorted_keys, count, n, coat::device::as_cuda_stream(stream)) != cudaSuccess)
    return COAT_ERROR_CUDA;
  return coat::device::launch_status();
}
