#include "common.h"

#include <cmath>

namespace coat {

RowMatrix as_row_matrix(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.dim() >= 1, op, ": ", arg, " must have at least one dimension, got a 0-d tensor");
  const int64_t last = t.dim() - 1;
  RowMatrix m{1, t.size(last), t.size(last)};
  for (int64_t d = 0; d < last; ++d) m.rows *= t.size(d);
  if (t.numel() == 0) return m;
  const char* hint =
      ": the last dimension must be contiguous and the leading dimensions must collapse into evenly "
      "strided rows (slices like x[..., :k] are fine). Call .contiguous() first. Got strides ";
  TORCH_CHECK(t.size(last) == 1 || t.stride(last) == 1, op, ": ", arg, hint, t.strides());
  // Leading dimensions must be contiguous among themselves; the innermost one gives the row stride.
  int64_t expected = -1;
  for (int64_t d = last - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (expected < 0) {
      m.row_stride = t.stride(d);
    } else {
      TORCH_CHECK(t.stride(d) == expected, op, ": ", arg, hint, t.strides());
    }
    expected = t.stride(d) * t.size(d);
  }
  TORCH_CHECK(m.row_stride >= m.cols, op, ": ", arg, hint, t.strides());
  return m;
}

coat_dtype input_dtype(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return COAT_FLOAT32;
    case at::kBFloat16: return COAT_BFLOAT16;
    case at::kHalf: return COAT_FLOAT16;
    default:
      TORCH_CHECK(false, op, ": ", arg, " must be float32, bfloat16 or float16, got ", t.scalar_type(),
                  "; convert it with .to(torch.bfloat16) or .float()");
  }
}

coat_fp8_format fp8_format(at::ScalarType dtype, const char* op, const char* arg) {
  switch (dtype) {
    case at::kFloat8_e4m3fn: return COAT_E4M3;
    case at::kFloat8_e5m2: return COAT_E5M2;
    default:
      TORCH_CHECK(false, op, ": ", arg, " must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype);
  }
}

void check_device(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", arg,
              " must be on a CPU or CUDA device, got ", t.device());
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", arg, " is on ", b.device(), " but the input is on ",
              a.device(), "; move it with .to(", a.device(), ")");
}

void check_group_size(int64_t group_size, const char* op) {
  TORCH_CHECK(group_size == 16 || group_size == 32 || group_size == 64 || group_size == 128, op,
              ": group_size must be 16, 32, 64 or 128, got ", group_size);
}

float weight_offset_arg(double weight_offset, const char* op) {
  const float offset = static_cast<float>(weight_offset);
  TORCH_CHECK(std::isfinite(offset), op, ": weight_offset must be finite (in float32), got ", weight_offset,
              "; it is added to the norm weight (0, or 1 for Gemma's (1 + weight) norms)");
  return offset;
}

std::vector<int64_t> grouped_shape(const at::Tensor& x, int64_t group_size) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = (shape.back() + group_size - 1) / group_size;
  return shape;
}

at::Tensor zero_amax(const at::Tensor& like) {
  at::Tensor amax = at::empty({}, like.options().dtype(at::kFloat));
#ifdef COAT_WITH_CUDA
  if (like.is_cuda()) {
    const c10::cuda::CUDAGuard guard(like.device());
    C10_CUDA_CHECK(cudaMemsetAsync(amax.data_ptr(), 0, sizeof(float), at::cuda::getCurrentCUDAStream()));
    return amax;
  }
#endif
  return amax.zero_();
}

void check_status(coat_status status, const char* function) {
#ifdef COAT_WITH_CUDA
  if (status == COAT_ERROR_CUDA) C10_CUDA_CHECK(cudaGetLastError());
#endif
  TORCH_CHECK(status == COAT_SUCCESS, "coat core call ", function, " failed: ", coat_status_string(status));
}

}  // namespace coat
