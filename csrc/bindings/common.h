// Shared helpers of the ATen binding layer: argument checks with messages that say what to do,
// conversion to the core's C types, and the call into the CPU or CUDA entry point of the core.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "coat/common.h"

#ifdef COAT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace coat {

// A tensor seen as a row-major matrix: leading dimensions collapse into rows, the last is columns.
struct RowMatrix {
  int64_t rows;
  int64_t cols;
  int64_t row_stride;  // in elements
};

// Rows may be strided (e.g. a column slice of a wider tensor); anything else is refused.
RowMatrix as_row_matrix(const at::Tensor& t, const char* op, const char* arg);

// float32 / bfloat16 / float16, or a TORCH_CHECK failure naming the op and argument.
coat_dtype input_dtype(const at::Tensor& t, const char* op, const char* arg);

// torch.float8_e4m3fn or torch.float8_e5m2, or a TORCH_CHECK failure.
coat_fp8_format fp8_format(at::ScalarType dtype, const char* op, const char* arg);

void check_device(const at::Tensor& t, const char* op, const char* arg);
void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg);
void check_group_size(int64_t group_size, const char* op);

// An RMSNorm weight offset (added to the weight in fp32: 0, or 1 for Gemma), checked finite as a float32.
float weight_offset_arg(double weight_offset, const char* op);

// x's shape with the last dimension replaced by its number of 1 x group_size groups, ceil(cols / G).
std::vector<int64_t> grouped_shape(const at::Tensor& x, int64_t group_size);

// A 0-d float32 zero on like's device, the start of an accumulated amax: on CUDA a memset on the current stream
// (cheaper on the host than at::zeros, which dispatches a fill kernel).
at::Tensor zero_amax(const at::Tensor& like);

// Turns a core status into an exception; for COAT_ERROR_CUDA it reports cudaGetLastError().
void check_status(coat_status status, const char* function);

template <typename T>
T* data_as(const at::Tensor& t) {
  return t.numel() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

}  // namespace coat

// Calls name##_cpu(args...) or, for a CUDA tensor, name##_cuda(args..., current stream) on its device.
#ifdef COAT_WITH_CUDA
#define COAT_CALL_CORE(device_tensor, name, ...)                                                     \
  do {                                                                                               \
    if ((device_tensor).is_cuda()) {                                                                 \
      const c10::cuda::CUDAGuard coat_device_guard((device_tensor).device());                        \
      ::coat::check_status(                                                                          \
          name##_cuda(__VA_ARGS__,                                                                   \
                      reinterpret_cast<coat_cuda_stream>(at::cuda::getCurrentCUDAStream().stream())), \
          #name "_cuda");                                                                            \
    } else {                                                                                         \
      ::coat::check_status(name##_cpu(__VA_ARGS__), #name "_cpu");                                   \
    }                                                                                                \
  } while (0)
#else
#define COAT_CALL_CORE(device_tensor, name, ...)                                \
  do {                                                                          \
    TORCH_CHECK(!(device_tensor).is_cuda(), "coat was built without CUDA");    \
    ::coat::check_status(name##_cpu(__VA_ARGS__), #name "_cpu");              \
  } while (0)
#endif
