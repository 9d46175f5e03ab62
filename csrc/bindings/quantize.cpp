// ATen bindings of the quantize family (coat/quantize.h, FP8, FP4 and FP6): check, allocate, call the core.
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
                 data_as<const float>(amax), format, data_as<uint8_t>(q), m.cols, data_as<float>(scale),
                 transpose ? data_as<uint8_t>(q_t) : nullptr, m.rows);
  return {q, scale, q_t};
}

void check_tensor_list(at::TensorList xs, const char* op) {
  TORCH_CHECK(!xs.empty(), op, ": xs must hold at least one tensor");
  for (const at::Tensor& x : xs) {
    check_device(x, op, "xs");
    check_same_device(xs[0], x, op, "an element of xs");
  }
}

at::Tensor tensor_amax(at::TensorList xs) {
  constexpr const char* op = "coat.tensor_amax";
  check_tensor_list(xs, op);
  at::Tensor amax = zero_amax(xs[0]);
  for (const at::Tensor& x : xs) {
    const RowMatrix m = as_row_matrix(x, op, "xs");
    COAT_CALL_CORE(x, coat_tensor_amax, x.data_ptr(), input_dtype(x, op, "xs"), m.rows, m.cols, m.row_stride,
                   data_as<float>(amax));
  }
  return amax;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_tensors(at::TensorList xs, int64_t dim, const at::Tensor& amax,
                                                                at::ScalarType fp8_dtype, bool rowwise,
                                                                bool columnwise) {
  constexpr const char* op = "coat.quantize_tensors";
  check_tensor_list(xs, op);
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");
  TORCH_CHECK(dim == 0 || dim == 1, op, ": dim must be 0 (the matrices' rows are stacked) or 1 (their columns are "
              "placed side by side), got ", dim);
  check_same_device(xs[0], amax, op, "amax");
  TORCH_CHECK(amax.scalar_type() == at::kFloat && amax.numel() == 1, op,
              ": amax must be a one-element float32 tensor (as coat.ops.tensor_amax returns), got ",
              amax.scalar_type(), " of shape ", amax.sizes());
  std::vector<RowMatrix> parts;
  int64_t rows = 0, cols = 0;
  for (const at::Tensor& x : xs) {
    input_dtype(x, op, "xs");
    parts.push_back(as_row_matrix(x, op, "xs"));
    const RowMatrix& m = parts.back();
    const RowMatrix& first = parts.front();
    TORCH_CHECK(dim == 0 ? m.cols == first.cols : m.rows == first.rows, op, ": with dim=", dim,
                " every matrix needs the same number of ", dim == 0 ? "columns" : "rows", ", got ",
                dim == 0 ? first.cols : first.rows, " and ", dim == 0 ? m.cols : m.rows);
    rows = dim == 0 ? rows + m.rows : m.rows;
    cols = dim == 0 ? m.cols : cols + m.cols;
  }

  const at::TensorOptions codes = xs[0].options().dtype(fp8_dtype);
  at::Tensor q = rowwise ? at::empty({rows, cols}, codes) : at::empty({0}, codes);
  at::Tensor q_t = columnwise ? at::empty({cols, rows}, codes) : at::empty({0}, codes);
  at::Tensor scale = at::empty({}, xs[0].options().dtype(at::kFloat));
  int64_t offset = 0;  // first row (dim 0) or column (dim 1) of the matrix being quantized
  for (size_t i = 0; i < xs.size(); ++i) {
    const RowMatrix& m = parts[i];
    uint8_t* q_part = rowwise ? data_as<uint8_t>(q) + (dim == 0 ? offset * cols : offset) : nullptr;
    uint8_t* q_t_part = columnwise ? data_as<uint8_t>(q_t) + (dim == 0 ? offset : offset * rows) : nullptr;
    COAT_CALL_CORE(xs[i], coat_quantize_tensor, xs[i].data_ptr(), input_dtype(xs[i], op, "xs"), m.rows, m.cols,
                   m.row_stride, data_as<const float>(amax), format, q_part, cols, data_as<float>(scale), q_t_part,
                   rows);
    offset += dim == 0 ? m.rows : m.cols;
  }
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

void check_block_size(int64_t block_size, const char* op) {
  TORCH_CHECK(block_size == 16 || block_size == 32 || block_size == 64 || block_size == 128, op,
              ": block_size must be 16, 32, 64 or 128, got ", block_size);
}

// The block-scaled formats of coat/quantize.h: how their codes pack into a row, and their core entry points.
struct Fp4 {
  static constexpr const char* kQuantize = "coat.quantize_fp4";
  static constexpr const char* kPythonQuantize = "quantize_fp4";
  static constexpr const char* kDequantize = "coat.dequantize_fp4";
  static constexpr const char* kToE4m3 = "coat.fp4_to_e4m3";
  static constexpr const char* kPacking = "ceil(cols / 2)";
  static int64_t row_bytes(int64_t cols) { return (cols + 1) / 2; }
  template <typename... Args>
  static void quantize(const at::Tensor& on, Args... args) { COAT_CALL_CORE(on, coat_quantize_fp4, args...); }
  template <typename... Args>
  static void dequantize(const at::Tensor& on, Args... args) { COAT_CALL_CORE(on, coat_dequantize_fp4, args...); }
  template <typename... Args>
  static void to_e4m3(const at::Tensor& on, Args... args) { COAT_CALL_CORE(on, coat_fp4_to_e4m3, args...); }
};

struct Fp6 {
  static constexpr const char* kQuantize = "coat.quantize_fp6";
  static constexpr const char* kPythonQuantize = "quantize_blocks(x, 'fp6')";
  static constexpr const char* kDequantize = "coat.dequantize_fp6";
  static constexpr const char* kToE4m3 = "coat.fp6_to_e4m3";
  static constexpr const char* kPacking = "ceil(3 cols / 4)";
  static int64_t row_bytes(int64_t cols) { return (3 * cols + 3) / 4; }
  template <typename... Args>
  static void quantize(const at::Tensor& on, Args... args) { COAT_CALL_CORE(on, coat_quantize_fp6, args...); }
  template <typename... Args>
  static void dequantize(const at::Tensor& on, Args... args) { COAT_CALL_CORE(on, coat_dequantize_fp6, args...); }
  template <typename... Args>
  static void to_e4m3(const at::Tensor& on, Args... args) { COAT_CALL_CORE(on, coat_fp6_to_e4m3, args...); }
};

template <class Format>
std::tuple<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& x, int64_t block_size) {
  const char* op = Format::kQuantize;
  check_device(x, op, "x");
  const coat_dtype dtype = input_dtype(x, op, "x");
  check_block_size(block_size, op);
  const RowMatrix m = as_row_matrix(x, op, "x");

  std::vector<int64_t> packed(x.sizes().begin(), x.sizes().end());
  packed.back() = Format::row_bytes(m.cols);
  at::Tensor codes = at::empty(packed, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty(grouped_shape(x, block_size), x.options().dtype(at::kFloat));
  Format::quantize(x, x.data_ptr(), dtype, m.rows, m.cols, m.row_stride, block_size, data_as<uint8_t>(codes),
                   data_as<float>(scales));
  return {codes, scales};
}

// Checks packed codes and their block scales for a last dimension of `cols` elements; returns the decoded shape,
// codes.shape[:-1] + (cols,).
template <class Format>
std::vector<int64_t> check_block_operands(const at::Tensor& codes, const at::Tensor& scales, int64_t cols,
                                          int64_t block_size, const char* op) {
  check_device(codes, op, "codes");
  check_block_size(block_size, op);
  TORCH_CHECK(codes.scalar_type() == at::kByte, op, ": codes must be torch.uint8 (packed codes, as coat.ops.",
              Format::kPythonQuantize, " returns), got ", codes.scalar_type());
  TORCH_CHECK(codes.dim() >= 1 && codes.is_contiguous(), op,
              ": codes must be a contiguous tensor with at least one dimension, as coat.ops.", Format::kPythonQuantize,
              " returns");
  TORCH_CHECK(cols >= 0 && codes.size(-1) == Format::row_bytes(cols), op, ": cols=", cols, " needs ", Format::kPacking,
              " = ", Format::row_bytes(cols), " bytes of codes per row, but codes has shape ", codes.sizes());
  check_same_device(codes, scales, op, "scales");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), op,
              ": scales must be a contiguous float32 tensor, as coat.ops.", Format::kPythonQuantize, " returns, got ",
              scales.scalar_type(), scales.is_contiguous() ? "" : " (non-contiguous)");
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end() - 1);  // dim() >= 1, checked above
  shape.push_back(cols);
  std::vector<int64_t> expected = shape;
  expected.back() = (cols + block_size - 1) / block_size;
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(expected), op, ": with block_size=", block_size, " and cols=", cols,
              " scales must have shape ", at::IntArrayRef(expected), ", got ", scales.sizes());
  return shape;
}

template <class Format>
at::Tensor dequantize_blocks(const at::Tensor& codes, const at::Tensor& scales, int64_t cols, int64_t block_size,
                             at::ScalarType dtype) {
  const char* op = Format::kDequantize;
  const std::vector<int64_t> shape = check_block_operands<Format>(codes, scales, cols, block_size, op);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": dtype must be torch.float32 or torch.bfloat16, got ", dtype);
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  Format::dequantize(codes, data_as<const uint8_t>(codes), as_row_matrix(codes, op, "codes").rows, cols,
                     data_as<const float>(scales), block_size, out.data_ptr(), input_dtype(out, op, "out"));
  return out;
}

template <class Format>
at::Tensor blocks_to_e4m3(const at::Tensor& codes, const at::Tensor& scales, int64_t cols, int64_t block_size) {
  const char* op = Format::kToE4m3;
  const std::vector<int64_t> shape = check_block_operands<Format>(codes, scales, cols, block_size, op);
  at::Tensor q = at::empty(shape, codes.options().dtype(at::kFloat8_e4m3fn));
  Format::to_e4m3(codes, data_as<const uint8_t>(codes), as_row_matrix(codes, op, "codes").rows, cols,
                  data_as<uint8_t>(q));
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) {
  m.impl("quantize_group", &quantize_group);
  m.impl("group_amax", &group_amax);
  m.impl("quantize_tensor", &quantize_tensor);
  m.impl("tensor_amax", &tensor_amax);
  m.impl("quantize_tensors", &quantize_tensors);
  m.impl("dequantize", &dequantize);
  m.impl("quantize_fp4", &quantize_blocks<Fp4>);
  m.impl("dequantize_fp4", &dequantize_blocks<Fp4>);
  m.impl("fp4_to_e4m3", &blocks_to_e4m3<Fp4>);
  m.impl("quantize_fp6", &quantize_blocks<Fp6>);
  m.impl("dequantize_fp6", &dequantize_blocks<Fp6>);
  m.impl("fp6_to_e4m3", &blocks_to_e4m3<Fp6>);
}

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) {
  m.impl("quantize_group", &quantize_group);
  m.impl("group_amax", &group_amax);
  m.impl("quantize_tensor", &quantize_tensor);
  m.impl("tensor_amax", &tensor_amax);
  m.impl("quantize_tensors", &quantize_tensors);
  m.impl("dequantize", &dequantize);
  m.impl("quantize_fp4", &quantize_blocks<Fp4>);
  m.impl("dequantize_fp4", &dequantize_blocks<Fp4>);
  m.impl("fp4_to_e4m3", &blocks_to_e4m3<Fp4>);
  m.impl("quantize_fp6", &quantize_blocks<Fp6>);
  m.impl("dequantize_fp6", &dequantize_blocks<Fp6>);
  m.impl("fp6_to_e4m3", &blocks_to_e4m3<Fp6>);
}
#endif

}  // namespace coat
