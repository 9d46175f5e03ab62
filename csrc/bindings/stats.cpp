// ATen binding of the stats family (coat/stats.h): what coat.report measures of quantized tensors.
#include "coat/stats.h"

#include <optional>
#include <string>
#include <vector>

#include "common.h"

namespace coat {
namespace {

constexpr const char* kOp = "coat.quantization_sums_";

void check_matrix(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.dim() == 2 && t.numel() > 0, op, ": ", arg, " must be a non-empty 2-D tensor (reshape it to "
              "(rows, columns) first), got shape ", t.sizes());
}

// One measured tensor's arguments, checked (errors name the op as `op`), as the core's descriptor.
coat_quantization_measure measure(const at::Tensor& device_tensor, const char* op, const at::Tensor& sums,
                                  const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                  int64_t group_size, const std::optional<at::Tensor>& rows,
                                  bool x_holds_measured_rows, double amax_per_scale) {
  check_matrix(q, op, "q");
  check_matrix(x, op, "x");
  const coat_fp8_format format = fp8_format(q.scalar_type(), op, "q");
  const coat_dtype dtype = input_dtype(x, op, "x");
  for (const auto& [tensor, arg] : {std::pair{q, "q"}, {x, "x"}, {scale, "scale"}, {sums, "sums"}})
    check_same_device(device_tensor, tensor, op, arg);
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.numel() == COAT_STATS_SUMS && sums.is_contiguous(), op,
              ": sums must be a contiguous float64 tensor of ", COAT_STATS_SUMS, " elements (zeros to start), got ",
              sums.scalar_type(), " of shape ", sums.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), op,
              ": scale must be the contiguous float32 scale(s) the quantizer returned, got ", scale.scalar_type());
  const int64_t cols = q.size(1);
  if (group_size != 0) {
    check_group_size(group_size, op);
    const int64_t groups = (cols + group_size - 1) / group_size;
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) == groups, op,
                ": with group_size ", group_size, " scale must hold one scale per 1 x ", group_size,
                " group of q, shape (", q.size(0), ", ", groups, "), got ", scale.sizes());
  } else {
    TORCH_CHECK(scale.numel() == 1, op, ": without group_size scale must be q's one per-tensor scale, got shape ",
                scale.sizes(), "; pass group_size for per-group scales");
  }
  int64_t measured_rows = q.size(0);
  const int64_t* row_index = nullptr;
  if (rows.has_value()) {
    check_same_device(device_tensor, *rows, op, "rows");
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->numel() > 0 && rows->is_contiguous(),
                op, ": rows must be a non-empty contiguous 1-D int64 tensor of row indices of q, got ",
                rows->scalar_type(), " of shape ", rows->sizes());
    measured_rows = rows->numel();
    row_index = rows->data_ptr<int64_t>();
  }
  TORCH_CHECK(!x_holds_measured_rows || rows.has_value(), op, ": x_holds_measured_rows needs rows");
  const int64_t x_rows = x_holds_measured_rows ? measured_rows : q.size(0);
  TORCH_CHECK(x.size(0) == x_rows && x.size(1) == cols, op, ": x must have shape (", x_rows, ", ", cols, ") (",
              x_holds_measured_rows ? "the measured rows" : "q's shape", "), got ", x.sizes());
  TORCH_CHECK(amax_per_scale >= 0.0, op, ": amax_per_scale must be >= 0 (0: amax from x), got ", amax_per_scale);
  coat_quantization_measure m{};
  m.x = x.data_ptr();
  m.dtype = dtype;
  m.x_row_stride = x.stride(0);
  m.x_col_stride = x.stride(1);
  m.x_indexed = !x_holds_measured_rows;
  m.q = data_as<uint8_t>(q);
  m.format = format;
  m.q_row_stride = q.stride(0);
  m.q_col_stride = q.stride(1);
  m.scales = data_as<float>(scale);
  m.group_size = group_size;
  m.nscales = scale.numel();
  m.amax_per_scale = static_cast<float>(amax_per_scale);
  m.q_rows = q.size(0);
  m.row_index = row_index;
  m.rows = measured_rows;
  m.cols = cols;
  m.sums = data_as<double>(sums);
  return m;
}

// Registered for every backend: with empty lists there is no tensor to dispatch on (a no-op then); the
// measures' device picks the CPU or CUDA core.
void quantization_sums_(at::TensorList sums, at::TensorList x, at::TensorList q, at::TensorList scale,
                        at::IntArrayRef group_size, const c10::List<std::optional<at::Tensor>>& rows,
                        const c10::List<bool>& x_holds_measured_rows, at::ArrayRef<double> amax_per_scale) {
  const size_t count = q.size();
  TORCH_CHECK(sums.size() == count && x.size() == count && scale.size() == count && group_size.size() == count &&
                  rows.size() == count && x_holds_measured_rows.size() == count && amax_per_scale.size() == count,
              kOp, ": every list needs one entry per measured tensor, got ", sums.size(), " sums, ", x.size(),
              " x, ", q.size(), " q, ", scale.size(), " scale, ", group_size.size(), " group_size, ", rows.size(),
              " rows, ", x_holds_measured_rows.size(), " x_holds_measured_rows and ", amax_per_scale.size(),
              " amax_per_scale");
  if (count == 0) return;
  check_device(q[0], kOp, "q");
  std::vector<coat_quantization_measure> measures(count);
  for (size_t i = 0; i < count; ++i) {
    const std::string op = count == 1 ? std::string(kOp) : std::string(kOp) + ": measure " + std::to_string(i);
    measures[i] = measure(q[0], op.c_str(), sums[i], x[i], q[i], scale[i], group_size[i], rows.get(i),
                          x_holds_measured_rows.get(i), amax_per_scale[i]);
  }
  const int64_t n = static_cast<int64_t>(count);
#ifdef COAT_WITH_CUDA
  if (q[0].is_cuda()) {
    const c10::cuda::CUDAGuard guard(q[0].device());
    at::Tensor workspace =
        at::empty({coat_quantization_sums_workspace(measures.data(), n)}, q[0].options().dtype(at::kDouble));
    const auto stream = reinterpret_cast<coat_cuda_stream>(at::cuda::getCurrentCUDAStream().stream());
    check_status(coat_quantization_sums_cuda(measures.data(), n, data_as<double>(workspace), stream),
                 "coat_quantization_sums_cuda");
    return;
  }
#endif
  TORCH_CHECK(!q[0].is_cuda(), "coat was built without CUDA");
  check_status(coat_quantization_sums_cpu(measures.data(), n), "coat_quantization_sums_cpu");
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CompositeExplicitAutograd, m) { m.impl("quantization_sums_", &quantization_sums_); }

}  // namespace coat
