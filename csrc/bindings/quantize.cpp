// ATen bindings of the quantize family (coat/quantize.h): check, allocate, call the core.
#include "coat/quantize.h"

#include <vector>

#include "common.h"

namespace coat {
namespace {

at::Tensor transposed_output(const at::Tensor& x, const RowMatrix& m, at::ScalarType fp8_dtype, bool transpose) {
  return transpose ? at::empty({m.cols, m.rows}, x.options().dtype(fp8_dtype))
                   : at::empty({0}, x.options().dtype(fp8_dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_group(const at::Tensor& x, int64_t group_size,
                                                              at::ScalarType fp8_dtype, bool transpose) {
  constexpr const char* op = "coat.quantize_group";
  check_device(x, op, "x");
  const coat_dtype dtype = input_dtype(x, op, "x");
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");
  check_group_size(group_size, op);
  const RowMatrix m = as_row_matrix(x, op, "x");

  at::Tensor q = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  at::Tensor scales = at::empty(grouped_shape(x, group_size), x.options().dtype(at::kFloat));
  at::Tensor q_t = transposed_output(x, m, fp8_dtype, transpose);
  COAT_CALL_CORE(x, coat_quantize_group, x.data_ptr(), dtype, m.rows, m.cols, m.row_stride, group_size,
                 format, data_as<uint8_t>(q), data_as<float>(scales), transpose ? data_as<uint8_t>(q_t) : nullptr);
  return {q, scales, q_t};
}

at::Tensor group_amax(const at::Tensor& x, int64_t group_size) {
  constexpr const char* op = "coat.group_amax";
  check_device(x, op, "x");
  const coat_dtype dtype = input_dtype(x, op, "x");
  check_group_size(group_size, op);
  const RowMatrix m = as_row_matrix(x, op, "x");

  at::Tensor amax = at::empty(grouped_shape(x, group_size), x.options().dtype(at::kFloat));
  COAT_CALL_CORE(x, coat_group_amax, x.data_ptr(), dtype, m.rows, m.cols, m.row_stride, group_size,
                 data_as<float>(amax));
  return amax;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_tensor(const at::Tensor& x, const at::Tensor& group_amax,
                                                               at::ScalarType fp8_dtype, bool transpose) {
  constexpr const char* op = "coat.quantize_tensor";
  check_device(x, op, "x");
  const coat_dtype dtype = input_dtype(x, op, "x");
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");
  const RowMatrix m = as_row_matrix(x, op, "x");
  check_same_device(x, group_amax, op, "group_amax");
  TORCH_CHECK(group_amax.scalar_type() == at::kFloat && group_amax.is_contiguous(), op,
              ": group_amax must be a contiguous float32 tensor (as coat.ops.group_amax returns), got ",
              group_amax.scalar_type(), group_amax.is_contiguous() ? "" : " (non-contiguous)");

  at::Tensor amax = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  at::Tensor scale = at::empty({}, x.options().dtype(at::kFloat));
  at::Tensor q_t = transposed_output(x, m, fp8_dtype, transpose);
  COAT_CALL_CORE(x, coat_reduce_amax, data_as<const float>(group_amax), group_amax.numel(), data_as<float>(amax));
  COAT_CALL_CORE(x, coat_quantize_tensor, x.data_ptr(), dtype, m.rows, m.cols, m.row_stride,
                 data_as<const float>(amax), format, data_as<uint8_t>(q), data_as<float>(scale),
                 transpose ? data_as<uint8_t>(q_t) : nullptr);
  return {q, scale, q_t};
}

at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scale, std::optional<int64_t> group_size,
                      at::ScalarType dtype) {
  constexpr const char* op = "coat.dequantize";
  check_device(q, op, "q");
  const coat_fp8_format format = fp8_format(q.scalar_type(), op, "q");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": dtype must be torch.float32 or torch.bfloat16, got ", dtype);
  TORCH_CHECK(q.dim() >= 1 && q.is_contiguous(), op, ": q must be a contiguous tensor with at least one dimension, as the quantizers return");
  check_same_device(q, scale, op, "scale");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), op,
              ": scale must be a contiguous float32 tensor, as the quantizers return");
  const RowMatrix m = as_row_matrix(q, op, "q");
  if (group_size) {
    check_group_size(*group_size, op);
    const std::vector<int64_t> expected = grouped_shape(q, *group_size);
    TORCH_CHECK(scale.sizes() == at::IntArrayRef(expected), op, ": with group_size=", *group_size,
                " and q of shape ", q.sizes(), " scale must have shape ", at::IntArrayRef(expected), ", got ", scale.sizes());
  } else {
    TORCH_CHECK(scale.numel() == 1, op, ": without group_size, scale must hold one per-tensor value, got shape ",
                scale.sizes(), "; pass group_size for per-group scales");
  }

  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  COAT_CALL_CORE(q, coat_dequantize, data_as<const uint8_t>(q), format, m.rows, m.cols, data_as<const float>(scale),
                 group_size.value_or(0), out.data_ptr(), input_dtype(out, op, "out"));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) {
  m.impl("quantize_group", &quantize_group);
  m.impl("group_amax", &group_amax);
  m.impl("quantize_tensor", &quantize_tensor);
  m.impl("dequantize", &dequantize);
}

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) {
  m.impl("quantize_group", &quantize_group);
  m.impl("group_amax", &group_amax);
  m.impl("quantize_tensor", &quantize_tensor);
  m.impl("dequantize", &dequantize);
}
#endif

}  // namespace coat
