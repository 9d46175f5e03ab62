// ATen bindings of the norm_act family (coat/norm_act.h): check, allocate, call the core.
#include "coat/norm_act.h"

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace coat {
namespace {

// (y, y_scale, y_t, x_saved, x_saved_scales, rstd)
using RmsnormForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// (y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales)
using SiluMulForwardOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void check_named_group_size(int64_t group_size, const char* op, const char* arg) {
  TORCH_CHECK(group_size == 16 || group_size == 32 || group_size == 64 || group_size == 128, op, ": ", arg,
              " must be 16, 32, 64 or 128, got ", group_size);
}

// A [cols] vector read in place by the kernels: weight or smooth_scale.
void check_channel_vector(const at::Tensor& v, const at::Tensor& input, int64_t cols, const char* op,
                          const char* arg) {
  check_same_device(input, v, op, arg);
  TORCH_CHECK(v.dim() == 1 && v.size(0) == cols, op, ": ", arg, " must have shape [", cols,
              "] (the input's last dimension), got ", v.sizes());
  TORCH_CHECK(v.is_contiguous(), op, ": ", arg, " must be contiguous; call .contiguous() first");
}

// The saved format an op's string argument names ("e4m3", "fp4" or "fp6"), checked.
coat_saved_format saved_format(c10::string_view format, const char* op, const char* arg) {
  if (format == "e4m3") return COAT_SAVED_E4M3;
  if (format == "fp4") return COAT_SAVED_FP4;
  if (format == "fp6") return COAT_SAVED_FP6;
  TORCH_CHECK(false, op, ": ", arg, " must be 'e4m3', 'fp4' or 'fp6', got '", format, "'");
}

coat_activation activation_of(c10::string_view activation, const char* op) {
  if (activation == "silu") return COAT_ACT_SILU;
  if (activation == "gelu_tanh") return COAT_ACT_GELU_TANH;
  if (activation == "quick_gelu") return COAT_ACT_QUICK_GELU;
  TORCH_CHECK(false, op, ": activation must be 'silu' (SwiGLU), 'gelu_tanh' (GeGLU, gelu(approximate='tanh')) or "
              "'quick_gelu' (x * sigmoid(1.702 x)), got '", activation, "'");
}

// What the non-gated forward (no up) returns in place of up's saved copy and its scales: an empty float32 tensor.
at::Tensor absent(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kFloat)); }

// The saved up of the backward and requantize ops: both tensors, or neither (the non-gated op).
bool has_saved_up(const std::optional<at::Tensor>& up_saved, const std::optional<at::Tensor>& up_scales,
                  const char* op) {
  TORCH_CHECK(up_saved.has_value() == up_scales.has_value(), op, ": pass both up_saved and up_scales (the gated "
              "op's) or neither (the non-gated op's, whose forward had no up)");
  return up_saved.has_value();
}

// FP4 and FP6 codes are packed into bytes; an E4M3 copy holds one code per element.
bool is_packed(coat_saved_format format) { return format != COAT_SAVED_E4M3; }

const char* format_name(coat_saved_format format) {
  return format == COAT_SAVED_FP4 ? "fp4" : format == COAT_SAVED_FP6 ? "fp6" : "e4m3";
}

// The shape of the codes a forward op saves of an input of shape `input`: the input's (E4M3), or with the last
// dimension packed (FP4: two codes per byte, FP6: four per three bytes, rounded up).
std::vector<int64_t> saved_codes_shape(at::IntArrayRef input, coat_saved_format format) {
  std::vector<int64_t> shape(input.begin(), input.end());
  if (!shape.empty()) {
    if (format == COAT_SAVED_FP4) shape.back() = (shape.back() + 1) / 2;
    if (format == COAT_SAVED_FP6) shape.back() = (3 * shape.back() + 3) / 4;
  }
  return shape;
}

// A copy of an input of shape `input` saved by a forward op: E4M3 codes of that shape (torch.float8_e4m3fn), or
// packed FP4 or FP6 codes (torch.uint8); contiguous, on `like`'s device. like_arg names where `input` comes from.
void check_saved(const at::Tensor& saved, const at::Tensor& like, at::IntArrayRef input, coat_saved_format format,
                 const char* op, const char* arg, const char* like_arg = "dy") {
  check_same_device(like, saved, op, arg);
  if (is_packed(format)) {
    TORCH_CHECK(saved.scalar_type() == at::kByte, op, ": with saved_format='", format_name(format), "' ", arg,
                " must be torch.uint8 (packed codes, as the forward op saves them with save_format='",
                format_name(format), "'), got ", saved.scalar_type());
  } else {
    TORCH_CHECK(saved.scalar_type() == at::kFloat8_e4m3fn, op, ": ", arg,
                " must be torch.float8_e4m3fn, as the forward op saves it, got ", saved.scalar_type(),
                saved.scalar_type() == at::kByte
                    ? "; for packed FP4 or FP6 codes pass the saved_format the forward op saved them in"
                    : "");
  }
  const std::vector<int64_t> expected = saved_codes_shape(input, format);
  if (is_packed(format)) {
    TORCH_CHECK(saved.sizes() == at::IntArrayRef(expected), op, ": ", arg, " has shape ", saved.sizes(), " but the ",
                format_name(format), " codes of an input of shape ", input, " (from ", like_arg, ") have shape ",
                at::IntArrayRef(expected), "; pass the tensors the forward op returned");
  } else {
    TORCH_CHECK(saved.sizes() == input, op, ": ", arg, " has shape ", saved.sizes(), " but ", like_arg,
                " has shape ", input, "; pass the tensors the forward op returned for this ", like_arg);
  }
  TORCH_CHECK(saved.is_contiguous(), op, ": ", arg, " must be contiguous, as the forward op returns it");
}

// The shape of the input the first saved copy of a requantize op was made of: the copy's own (E4M3), or its leading
// dimensions and `cols` (FP4 and FP6, whose packed rows cannot tell every width from the next). cols_arg names
// where `cols` comes from.
std::vector<int64_t> saved_input_shape(const at::Tensor& saved, coat_saved_format format, int64_t cols, const char* op,
                                       const char* arg, const char* cols_arg) {
  check_device(saved, op, arg);
  TORCH_CHECK(saved.dim() >= 1, op, ": ", arg, " must have at least one dimension, as the forward op returns it");
  std::vector<int64_t> shape(saved.sizes().begin(), saved.sizes().end());
  if (is_packed(format)) shape.back() = cols;
  check_saved(saved, saved, shape, format, op, arg, is_packed(format) ? cols_arg : arg);
  return shape;
}

// A contiguous input of shape `shape` as a matrix.
RowMatrix contiguous_matrix(const std::vector<int64_t>& shape) {
  const int64_t cols = shape.back();
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
  return {rows, cols, cols};
}

// The forward's per-tensor scale, an input of the requantize ops.
void check_given_scale(const at::Tensor& y_scale, const at::Tensor& input, const char* op) {
  check_same_device(input, y_scale, op, "y_scale");
  TORCH_CHECK(y_scale.scalar_type() == at::kFloat && y_scale.numel() == 1, op,
              ": y_scale must be a float32 tensor with one element (the y_scale the forward op returned), got ",
              y_scale.scalar_type(), " of shape ", y_scale.sizes());
}

// The scales saved with the codes of an input of shape `input`: one float32 per 1 x group_size group.
void check_saved_scales(const at::Tensor& scales, const at::Tensor& like, at::IntArrayRef input, int64_t group_size,
                        const char* op, const char* arg) {
  check_same_device(like, scales, op, arg);
  std::vector<int64_t> expected(input.begin(), input.end());
  expected.back() = (expected.back() + group_size - 1) / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), op, ": ", arg,
              " must be a contiguous float32 tensor, as the forward op returns it, got ", scales.scalar_type());
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(expected), op, ": with save_group_size=", group_size, " ", arg,
              " must have shape ", at::IntArrayRef(expected), ", got ", scales.sizes(),
              "; pass the save_group_size the forward op used");
}

void check_max_cols(int64_t cols, const char* op, const char* arg) {
  TORCH_CHECK(cols <= COAT_NORM_ACT_MAX_COLS, op, ": the last dimension of ", arg, " must be at most 2^30, got ", cols);
}

void check_rmsnorm_cols(int64_t cols, const char* op, const char* arg) {
  TORCH_CHECK(cols >= 1 && cols <= COAT_RMSNORM_MAX_COLS, op, ": the last dimension of ", arg,
              " (the normalized size) must be between 1 and ", COAT_RMSNORM_MAX_COLS, ", got ", cols);
}

at::Tensor transposed_output(const at::Tensor& x, const RowMatrix& m, at::ScalarType fp8_dtype, bool transpose) {
  return transpose ? at::empty({m.cols, m.rows}, x.options().dtype(fp8_dtype))
                   : at::empty({0}, x.options().dtype(fp8_dtype));
}

// The copy of an input a forward op saves for backward: E4M3 codes of its shape, or packed FP4 or FP6 codes, as
// coat.quantize_fp4 and coat.quantize_fp6 return them.
at::Tensor saved_codes(const at::Tensor& input, coat_saved_format format) {
  return at::empty(saved_codes_shape(input.sizes(), format),
                   input.options().dtype(is_packed(format) ? at::kByte : at::kFloat8_e4m3fn));
}

RmsnormForwardOutputs rmsnorm_quantize(const at::Tensor& x, const at::Tensor& weight, double eps,
                                       int64_t save_group_size, int64_t amax_group_size, at::ScalarType fp8_dtype,
                                       bool transpose, c10::string_view save_format, double weight_offset) {
  constexpr const char* op = "coat.rmsnorm_quantize";
  const float offset = weight_offset_arg(weight_offset, op);
  const coat_saved_format saved = saved_format(save_format, op, "save_format");
  check_device(x, op, "x");
  const coat_dtype x_dtype = input_dtype(x, op, "x");
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");
  check_named_group_size(save_group_size, op, "save_group_size");
  check_named_group_size(amax_group_size, op, "amax_group_size");
  const RowMatrix m = as_row_matrix(x, op, "x");
  check_rmsnorm_cols(m.cols, op, "x");
  check_channel_vector(weight, x, m.cols, op, "weight");
  const coat_dtype weight_dtype = input_dtype(weight, op, "weight");
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), op, ": eps must be finite and >= 0, got ", eps);

  const at::TensorOptions float_options = x.options().dtype(at::kFloat);
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  at::Tensor y_scale = at::empty({}, float_options);
  at::Tensor y_t = transposed_output(x, m, fp8_dtype, transpose);
  at::Tensor x_saved = saved_codes(x, saved);
  at::Tensor x_saved_scales = at::empty(grouped_shape(x, save_group_size), float_options);
  at::Tensor rstd = at::empty({m.rows}, float_options);
  at::Tensor y_amax = at::empty({1}, float_options);
  COAT_CALL_CORE(x, coat_rmsnorm_quantize, x.data_ptr(), x_dtype, m.rows, m.cols, m.row_stride, weight.data_ptr(),
                 weight_dtype, offset, static_cast<float>(eps), save_group_size, saved,
                 format, data_as<uint8_t>(y),
                 data_as<float>(y_scale), transpose ? data_as<uint8_t>(y_t) : nullptr, data_as<uint8_t>(x_saved),
                 data_as<float>(x_saved_scales), data_as<float>(rstd), data_as<float>(y_amax));
  return {y, y_scale, y_t, x_saved, x_saved_scales, rstd};
}

void check_rstd(const at::Tensor& rstd, const at::Tensor& input, int64_t rows, const char* op) {
  check_same_device(input, rstd, op, "rstd");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous() && rstd.numel() == rows, op,
              ": rstd must be a contiguous float32 tensor with one value per row (", rows,
              "), as rmsnorm_quantize returns it, got ", rstd.scalar_type(), " of shape ", rstd.sizes());
}

// What an op adds to its output (rmsnorm_backward: the gradient around the norm, to dx; rmsnorm_save: the residual
// stream, to y), read in place as `like`'s rows x cols: like's shape, contiguous.
coat_dtype check_residual(const at::Tensor& residual, const at::Tensor& like, const char* op, const char* like_arg) {
  check_same_device(like, residual, op, "residual");
  const coat_dtype dtype = input_dtype(residual, op, "residual");
  TORCH_CHECK(residual.sizes() == like.sizes(), op, ": residual has shape ", residual.sizes(), " but ", like_arg,
              " has shape ", like.sizes(), "; it must have ", like_arg, "'s shape");
  TORCH_CHECK(residual.is_contiguous(), op, ": residual must be contiguous; call .contiguous() first");
  return dtype;
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_backward(const at::Tensor& dy, const at::Tensor& x_saved,
                                                    const at::Tensor& x_saved_scales, const at::Tensor& rstd,
                                                    const at::Tensor& weight, int64_t save_group_size,
                                                    const std::optional<at::Tensor>& residual,
                                                    c10::string_view saved_format_arg, double weight_offset) {
  constexpr const char* op = "coat.rmsnorm_backward";
  const float offset = weight_offset_arg(weight_offset, op);
  const coat_saved_format format = saved_format(saved_format_arg, op, "saved_format");
  check_device(dy, op, "dy");
  const coat_dtype dy_dtype = input_dtype(dy, op, "dy");
  check_named_group_size(save_group_size, op, "save_group_size");
  const RowMatrix m = as_row_matrix(dy, op, "dy");
  check_rmsnorm_cols(m.cols, op, "dy");
  check_saved(x_saved, dy, dy.sizes(), format, op, "x_saved");
  check_saved_scales(x_saved_scales, dy, dy.sizes(), save_group_size, op, "x_saved_scales");
  check_rstd(rstd, dy, m.rows, op);
  check_channel_vector(weight, dy, m.cols, op, "weight");
  const coat_dtype weight_dtype = input_dtype(weight, op, "weight");
  const coat_dtype residual_dtype = residual ? check_residual(*residual, dy, op, "dy") : dy_dtype;

  at::Tensor dx = at::empty(dy.sizes(), dy.options().dtype(residual ? residual->scalar_type() : dy.scalar_type()));
  at::Tensor dweight = at::empty({m.cols}, dy.options().dtype(at::kFloat));
  at::Tensor workspace = at::empty({coat_rmsnorm_backward_workspace_size(m.rows, m.cols)}, dy.options().dtype(at::kFloat));
  COAT_CALL_CORE(dy, coat_rmsnorm_backward, dy.data_ptr(), dy_dtype, m.rows, m.cols, m.row_stride,
                 data_as<const uint8_t>(x_saved), data_as<const float>(x_saved_scales), save_group_size,
                 format, data_as<const float>(rstd), weight.data_ptr(), weight_dtype, offset,
                 residual ? residual->data_ptr() : nullptr, residual_dtype, dx.data_ptr(), data_as<float>(dweight),
                 data_as<float>(workspace));
  return {dx, dweight};
}

// (out, x_saved, x_saved_scales, rstd)
using RmsnormSaveOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

RmsnormSaveOutputs rmsnorm_save(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t save_group_size,
                                const std::optional<at::Tensor>& residual, c10::string_view save_format,
                                double weight_offset) {
  constexpr const char* op = "coat.rmsnorm_save";
  const coat_saved_format saved = saved_format(save_format, op, "save_format");
  const float offset = weight_offset_arg(weight_offset, op);
  check_device(x, op, "x");
  const coat_dtype x_dtype = input_dtype(x, op, "x");
  check_named_group_size(save_group_size, op, "save_group_size");
  const RowMatrix m = as_row_matrix(x, op, "x");
  check_rmsnorm_cols(m.cols, op, "x");
  check_channel_vector(weight, x, m.cols, op, "weight");
  const coat_dtype weight_dtype = input_dtype(weight, op, "weight");
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), op, ": eps must be finite and >= 0, got ", eps);
  const coat_dtype residual_dtype = residual ? check_residual(*residual, x, op, "x") : x_dtype;

  const at::TensorOptions float_options = x.options().dtype(at::kFloat);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(residual ? residual->scalar_type() : x.scalar_type()));
  at::Tensor x_saved = saved_codes(x, saved);
  at::Tensor x_saved_scales = at::empty(grouped_shape(x, save_group_size), float_options);
  at::Tensor rstd = at::empty({m.rows}, float_options);
  COAT_CALL_CORE(x, coat_rmsnorm_save, x.data_ptr(), x_dtype, m.rows, m.cols, m.row_stride, weight.data_ptr(),
                 weight_dtype, offset, static_cast<float>(eps), save_group_size, saved,
                 residual ? residual->data_ptr() : nullptr, residual_dtype, out.data_ptr(), data_as<uint8_t>(x_saved),
                 data_as<float>(x_saved_scales), data_as<float>(rstd));
  return {out, x_saved, x_saved_scales, rstd};
}

at::Tensor rmsnorm_requantize(const at::Tensor& x_saved, const at::Tensor& x_saved_scales, const at::Tensor& rstd,
                              const at::Tensor& weight, const at::Tensor& y_scale, int64_t save_group_size,
                              at::ScalarType fp8_dtype, c10::string_view saved_format_arg,
                              double weight_offset) {
  constexpr const char* op = "coat.rmsnorm_requantize";
  const float offset = weight_offset_arg(weight_offset, op);
  const coat_saved_format saved = saved_format(saved_format_arg, op, "saved_format");
  TORCH_CHECK(weight.dim() == 1, op, ": weight must have shape [H] (H the normalized size), got ", weight.sizes());
  const std::vector<int64_t> shape = saved_input_shape(x_saved, saved, weight.size(0), op, "x_saved", "weight");
  const RowMatrix m = contiguous_matrix(shape);
  check_rmsnorm_cols(m.cols, op, "x_saved");
  check_named_group_size(save_group_size, op, "save_group_size");
  check_saved_scales(x_saved_scales, x_saved, shape, save_group_size, op, "x_saved_scales");
  check_rstd(rstd, x_saved, m.rows, op);
  check_channel_vector(weight, x_saved, m.cols, op, "weight");
  const coat_dtype weight_dtype = input_dtype(weight, op, "weight");
  check_given_scale(y_scale, x_saved, op);
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");

  at::Tensor y_t = at::empty({m.cols, m.rows}, x_saved.options().dtype(fp8_dtype));
  COAT_CALL_CORE(x_saved, coat_rmsnorm_requantize, data_as<const uint8_t>(x_saved),
                 data_as<const float>(x_saved_scales), save_group_size, saved, data_as<const float>(rstd), m.rows,
                 m.cols,
                 weight.data_ptr(), weight_dtype, offset, data_as<const float>(y_scale), format,
                 data_as<uint8_t>(y_t));
  return y_t;
}

const float* smooth_scale_data(const std::optional<at::Tensor>& smooth_scale, const at::Tensor& input, int64_t cols,
                               const char* op) {
  if (!smooth_scale) return nullptr;
  check_channel_vector(*smooth_scale, input, cols, op, "smooth_scale");
  TORCH_CHECK(smooth_scale->scalar_type() == at::kFloat, op, ": smooth_scale must be float32, got ",
              smooth_scale->scalar_type());
  return data_as<const float>(*smooth_scale);
}

SiluMulForwardOutputs silu_mul_quantize(const at::Tensor& gate, const std::optional<at::Tensor>& up,
                                        const std::optional<at::Tensor>& smooth_scale, int64_t save_group_size,
                                        int64_t amax_group_size, at::ScalarType fp8_dtype, bool transpose,
                                        c10::string_view save_format, c10::string_view activation_arg) {
  constexpr const char* op = "coat.silu_mul_quantize";
  const coat_saved_format saved = saved_format(save_format, op, "save_format");
  const coat_activation activation = activation_of(activation_arg, op);
  check_device(gate, op, "gate");
  const coat_dtype dtype = input_dtype(gate, op, "gate");
  if (up) {
    check_same_device(gate, *up, op, "up");
    TORCH_CHECK(up->scalar_type() == gate.scalar_type(), op, ": gate and up must have the same dtype, got ",
                gate.scalar_type(), " and ", up->scalar_type());
    TORCH_CHECK(up->sizes() == gate.sizes(), op, ": gate and up must have the same shape, got ", gate.sizes(),
                " and ", up->sizes());
  }
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");
  check_named_group_size(save_group_size, op, "save_group_size");
  check_named_group_size(amax_group_size, op, "amax_group_size");
  const RowMatrix gate_m = as_row_matrix(gate, op, "gate");
  const int64_t up_row_stride = up ? as_row_matrix(*up, op, "up").row_stride : gate_m.cols;  // read only with up
  check_max_cols(gate_m.cols, op, "gate");
  const float* smooth = smooth_scale_data(smooth_scale, gate, gate_m.cols, op);

  const at::TensorOptions float_options = gate.options().dtype(at::kFloat);
  at::Tensor y = at::empty(gate.sizes(), gate.options().dtype(fp8_dtype));
  at::Tensor y_scale = at::empty({}, float_options);
  at::Tensor y_t = transposed_output(gate, gate_m, fp8_dtype, transpose);
  at::Tensor gate_saved = saved_codes(gate, saved);
  at::Tensor gate_scales = at::empty(grouped_shape(gate, save_group_size), float_options);
  at::Tensor up_saved = up ? saved_codes(gate, saved) : absent(gate);
  at::Tensor up_scales = up ? at::empty(grouped_shape(gate, save_group_size), float_options) : absent(gate);
  at::Tensor y_amax = at::empty({1}, float_options);
  COAT_CALL_CORE(gate, coat_silu_mul_quantize, gate.data_ptr(), up ? up->data_ptr() : nullptr, dtype, gate_m.rows,
                 gate_m.cols, gate_m.row_stride, up_row_stride, smooth, activation,
                 save_group_size, saved, format, data_as<uint8_t>(y),
                 data_as<float>(y_scale), transpose ? data_as<uint8_t>(y_t) : nullptr, data_as<uint8_t>(gate_saved),
                 data_as<float>(gate_scales), up ? data_as<uint8_t>(up_saved) : nullptr,
                 up ? data_as<float>(up_scales) : nullptr, data_as<float>(y_amax));
  return {y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& dy, const at::Tensor& gate_saved,
                                                     const at::Tensor& gate_scales,
                                                     const std::optional<at::Tensor>& up_saved,
                                                     const std::optional<at::Tensor>& up_scales,
                                                     const std::optional<at::Tensor>& smooth_scale,
                                                     int64_t save_group_size, c10::string_view saved_format_arg,
                                                     c10::string_view activation_arg) {
  constexpr const char* op = "coat.silu_mul_backward";
  const coat_saved_format format = saved_format(saved_format_arg, op, "saved_format");
  const coat_activation activation = activation_of(activation_arg, op);
  check_device(dy, op, "dy");
  const coat_dtype dy_dtype = input_dtype(dy, op, "dy");
  check_named_group_size(save_group_size, op, "save_group_size");
  const RowMatrix m = as_row_matrix(dy, op, "dy");
  check_max_cols(m.cols, op, "dy");
  const bool gated = has_saved_up(up_saved, up_scales, op);
  check_saved(gate_saved, dy, dy.sizes(), format, op, "gate_saved");
  check_saved_scales(gate_scales, dy, dy.sizes(), save_group_size, op, "gate_scales");
  if (gated) {
    check_saved(*up_saved, dy, dy.sizes(), format, op, "up_saved");
    check_saved_scales(*up_scales, dy, dy.sizes(), save_group_size, op, "up_scales");
  }
  const float* smooth = smooth_scale_data(smooth_scale, dy, m.cols, op);

  at::Tensor dgate = at::empty(dy.sizes(), dy.options());
  at::Tensor dup = gated ? at::empty(dy.sizes(), dy.options()) : at::empty({0}, dy.options());
  at::Tensor d_amax = zero_amax(dy);
  COAT_CALL_CORE(dy, coat_silu_mul_backward, dy.data_ptr(), dy_dtype, m.rows, m.cols, m.row_stride,
                 data_as<const uint8_t>(gate_saved), data_as<const float>(gate_scales),
                 gated ? data_as<const uint8_t>(*up_saved) : nullptr,
                 gated ? data_as<const float>(*up_scales) : nullptr, smooth, activation, save_group_size, format,
                 dgate.data_ptr(), gated ? dup.data_ptr() : nullptr, data_as<float>(d_amax));
  return {dgate, dup, d_amax};
}

at::Tensor silu_mul_requantize(const at::Tensor& gate_saved, const at::Tensor& gate_scales,
                               const std::optional<at::Tensor>& up_saved, const std::optional<at::Tensor>& up_scales,
                               const std::optional<at::Tensor>& smooth_scale,
                               const at::Tensor& y_scale, int64_t save_group_size, at::ScalarType fp8_dtype,
                               c10::string_view saved_format_arg, std::optional<int64_t> cols,
                               c10::string_view activation_arg) {
  constexpr const char* op = "coat.silu_mul_requantize";
  const coat_saved_format saved = saved_format(saved_format_arg, op, "saved_format");
  const coat_activation activation = activation_of(activation_arg, op);
  TORCH_CHECK(cols || !is_packed(saved), op, ": with saved_format='", format_name(saved), "' pass cols, the width of "
              "gate and up: packed codes do not tell every width from the next");
  const std::vector<int64_t> shape =
      saved_input_shape(gate_saved, saved, cols.value_or(0), op, "gate_saved", "cols");
  TORCH_CHECK(!cols || *cols == shape.back(), op, ": cols=", cols.value_or(0), " but gate_saved has ", shape.back(),
              " columns");
  const RowMatrix m = contiguous_matrix(shape);
  check_max_cols(m.cols, op, "gate_saved");
  const bool gated = has_saved_up(up_saved, up_scales, op);
  if (gated) check_saved(*up_saved, gate_saved, shape, saved, op, "up_saved", "gate_saved");
  check_named_group_size(save_group_size, op, "save_group_size");
  check_saved_scales(gate_scales, gate_saved, shape, save_group_size, op, "gate_scales");
  if (gated) check_saved_scales(*up_scales, gate_saved, shape, save_group_size, op, "up_scales");
  const float* smooth = smooth_scale_data(smooth_scale, gate_saved, m.cols, op);
  check_given_scale(y_scale, gate_saved, op);
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");

  at::Tensor y_t = at::empty({m.cols, m.rows}, gate_saved.options().dtype(fp8_dtype));
  COAT_CALL_CORE(gate_saved, coat_silu_mul_requantize, data_as<const uint8_t>(gate_saved),
                 data_as<const float>(gate_scales), gated ? data_as<const uint8_t>(*up_saved) : nullptr,
                 gated ? data_as<const float>(*up_scales) : nullptr,
                 save_group_size, saved, m.rows, m.cols, smooth, activation, data_as<const float>(y_scale), format,
                 data_as<uint8_t>(y_t));
  return y_t;
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) {
  m.impl("rmsnorm_quantize", &rmsnorm_quantize);
  m.impl("rmsnorm_backward", &rmsnorm_backward);
  m.impl("rmsnorm_save", &rmsnorm_save);
  m.impl("silu_mul_quantize", &silu_mul_quantize);
  m.impl("silu_mul_backward", &silu_mul_backward);
  m.impl("rmsnorm_requantize", &rmsnorm_requantize);
  m.impl("silu_mul_requantize", &silu_mul_requantize);
}

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) {
  m.impl("rmsnorm_quantize", &rmsnorm_quantize);
  m.impl("rmsnorm_backward", &rmsnorm_backward);
  m.impl("rmsnorm_save", &rmsnorm_save);
  m.impl("silu_mul_quantize", &silu_mul_quantize);
  m.impl("silu_mul_backward", &silu_mul_backward);
  m.impl("rmsnorm_requantize", &rmsnorm_requantize);
  m.impl("silu_mul_requantize", &silu_mul_requantize);
}
#endif

}  // namespace coat
