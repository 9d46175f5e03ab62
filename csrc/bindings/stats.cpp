// ATen binding of the stats family (coat/stats.h): what coat.report measures of a quantized tensor.
#include "coat/stats.h"

#include <optional>

#include "common.h"

namespace coat {
namespace {

constexpr const char* kOp = "coat.quantization_sums_";

void check_matrix(const at::Tensor& t, const char* arg) {
  TORCH_CHECK(t.dim() == 2 && t.numel() > 0, kOp, ": ", arg, " must be a non-empty 2-D tensor (reshape it to "
              "(rows, columns) first), got shape ", t.sizes());
}

void quantization_sums_(const at::Tensor& sums, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        std::optional<int64_t> group_size, const std::optional<at::Tensor>& rows,
                        bool x_holds_measured_rows, double amax_per_scale) {
  check_matrix(q, "q");
  check_matrix(x, "x");
  check_device(q, kOp, "q");
  const coat_fp8_format format = fp8_format(q.scalar_type(), kOp, "q");
  const coat_dtype dtype = input_dtype(x, kOp, "x");
  for (const auto& [tensor, arg] : {std::pair{x, "x"}, {scale, "scale"}, {sums, "sums"}})
    check_same_device(q, tensor, kOp, arg);
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.numel() == COAT_STATS_SUMS && sums.is_contiguous(), kOp,
              ": sums must be a contiguous float64 tensor of ", COAT_STATS_SUMS, " elements (zeros to start), got ",
              sums.scalar_type(), " of shape ", sums.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), kOp,
              ": scale must be the contiguous float32 scale(s) the quantizer returned, got ", scale.scalar_type());
  const int64_t cols = q.size(1);
  const int64_t g = group_size.value_or(0);
  if (group_size.has_value()) {
    check_group_size(g, kOp);
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) == (cols + g - 1) / g, kOp,
                ": with group_size ", g, " scale must hold one scale per 1 x ", g, " group of q, shape (",
                q.size(0), ", ", (cols + g - 1) / g, "), got ", scale.sizes());
  } else {
    TORCH_CHECK(scale.numel() == 1, kOp, ": without group_size scale must be q's one per-tensor scale, got shape ",
                scale.sizes(), "; pass group_size for per-group scales");
  }
  int64_t measured_rows = q.size(0);
  const int64_t* row_index = nullptr;
  if (rows.has_value()) {
    check_same_device(q, *rows, kOp, "rows");
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->numel() > 0 && rows->is_contiguous(),
                kOp, ": rows must be a non-empty contiguous 1-D int64 tensor of row indices of q, got ",
                rows->scalar_type(), " of shape ", rows->sizes());
    measured_rows = rows->numel();
    row_index = rows->data_ptr<int64_t>();
  }
  TORCH_CHECK(!x_holds_measured_rows || rows.has_value(), kOp, ": x_holds_measured_rows needs rows");
  const int64_t x_rows = x_holds_measured_rows ? measured_rows : q.size(0);
  TORCH_CHECK(x.size(0) == x_rows && x.size(1) == cols, kOp, ": x must have shape (", x_rows, ", ", cols, ") (",
              x_holds_measured_rows ? "the measured rows" : "q's shape", "), got ", x.sizes());
  TORCH_CHECK(amax_per_scale >= 0.0, kOp, ": amax_per_scale must be >= 0 (0: amax from x), got ", amax_per_scale);

  const float per_scale = static_cast<float>(amax_per_scale);
#ifdef COAT_WITH_CUDA
  if (q.is_cuda()) {
    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor workspace = at::empty({coat_quantization_sums_workspace(measured_rows, cols)}, sums.options());
    const auto stream = reinterpret_cast<coat_cuda_stream>(at::cuda::getCurrentCUDAStream().stream());
    check_status(coat_quantization_sums_cuda(x.data_ptr(), dtype, x.stride(0), x.stride(1), !x_holds_measured_rows,
                                             data_as<uint8_t>(q), format, q.stride(0), q.stride(1),
                                             data_as<float>(scale), g, scale.numel(), per_scale, q.size(0),
                                             row_index, measured_rows, cols, data_as<double>(sums),
                                             data_as<double>(workspace), stream),
                 "coat_quantization_sums_cuda");
    return;
  }
#endif
  TORCH_CHECK(!q.is_cuda(), "coat was built without CUDA");
  check_status(coat_quantization_sums_cpu(x.data_ptr(), dtype, x.stride(0), x.stride(1), !x_holds_measured_rows,
                                          data_as<uint8_t>(q), format, q.stride(0), q.stride(1), data_as<float>(scale),
                                          g, scale.numel(), per_scale, q.size(0), row_index, measured_rows, cols,
                                          data_as<double>(sums)),
               "coat_quantization_sums_cpu");
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) { m.impl("quantization_sums_", &quantization_sums_); }

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) { m.impl("quantization_sums_", &quantization_sums_); }
#endif

}  // namespace coat
