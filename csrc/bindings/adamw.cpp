// ATen bindings of the FP8 AdamW family (coat/adamw.h): check, allocate, call the core.
#include "coat/adamw.h"

#include <string>
#include <vector>

#include "common.h"

namespace coat {
namespace {

// (*shape[:-1], ceil(shape[-1] / G), 3): one (scale, k, C) triple per group.
std::vector<int64_t> meta_shape(at::IntArrayRef shape, int64_t group_size) {
  std::vector<int64_t> meta(shape.begin(), shape.end());
  meta.back() = (meta.back() + group_size - 1) / group_size;
  meta.push_back(3);
  return meta;
}

// "exp_avgs[3]": the argument an error message names.
std::string item(const char* list, size_t index) { return std::string(list) + "[" + std::to_string(index) + "]"; }

void check_contiguous(const at::Tensor& t, const char* op, const std::string& arg) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got strides ", t.strides(),
              "; call .contiguous() first");
}

void check_meta(const at::Tensor& codes, const at::Tensor& meta, int64_t group_size, const char* op,
                const std::string& arg) {
  check_same_device(codes, meta, op, arg.c_str());
  const std::vector<int64_t> expected = meta_shape(codes.sizes(), group_size);
  TORCH_CHECK(meta.scalar_type() == at::kBFloat16 && meta.sizes() == at::IntArrayRef(expected), op, ": ", arg,
              " must be bfloat16 of shape ", at::IntArrayRef(expected), " (a (scale, k, C) triple per group of ",
              group_size, " along the last dimension), got ", meta.scalar_type(), " of shape ", meta.sizes());
  check_contiguous(meta, op, arg);
}

// An FP8 state of `param`: codes of its shape in an FP8 dtype, and their meta.
void check_state(const at::Tensor& param, const at::Tensor& codes, const at::Tensor& meta, int64_t group_size,
                 const char* op, const std::string& codes_arg, const std::string& meta_arg) {
  check_same_device(param, codes, op, codes_arg.c_str());
  fp8_format(codes.scalar_type(), op, codes_arg.c_str());
  TORCH_CHECK(codes.sizes() == param.sizes(), op, ": ", codes_arg, " must have its parameter's shape ",
              param.sizes(), ", got ", codes.sizes());
  check_contiguous(codes, op, codes_arg);
  check_meta(codes, meta, group_size, op, meta_arg);
}

void fp8_adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_metas, at::TensorList exp_avg_sqs, at::TensorList exp_avg_sq_metas,
                    double beta1, double beta2, double eps, double decay_factor, double step_size,
                    double bias_correction2_sqrt, int64_t group_size, bool expand_m, bool expand_v,
                    at::OptionalIntArrayRef rounding_seeds) {
  constexpr const char* op = "coat.fp8_adamw_step";
  const size_t count = params.size();
  TORCH_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_metas.size() == count &&
                  exp_avg_sqs.size() == count && exp_avg_sq_metas.size() == count,
              op, ": every list needs one entry per parameter, got ", count, " params, ", grads.size(), " grads, ",
              exp_avgs.size(), " exp_avgs, ", exp_avg_metas.size(), " exp_avg_metas, ", exp_avg_sqs.size(),
              " exp_avg_sqs and ", exp_avg_sq_metas.size(), " exp_avg_sq_metas");
  check_group_size(group_size, op);
  TORCH_CHECK(!rounding_seeds.has_value() || rounding_seeds->size() == count, op,
              ": rounding_seeds needs one seed per parameter, got ", rounding_seeds.has_value() ? rounding_seeds->size() : 0,
              " for ", count, " params");
  if (count == 0) return;

  std::vector<coat_adamw_tensor> tensors(count);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    const at::Tensor& grad = grads[i];
    const std::string param_arg = item("params", i);
    const std::string grad_arg = item("grads", i);
    check_device(param, op, param_arg.c_str());
    check_same_device(params[0], param, op, param_arg.c_str());
    TORCH_CHECK(param.dim() >= 1, op, ": ", param_arg,
                " is 0-d; view 0-d parameters and their gradients as 1-element tensors (.view(1))");
    TORCH_CHECK(param.scalar_type() == at::kFloat || param.scalar_type() == at::kBFloat16, op, ": ", param_arg,
                " must be float32 or bfloat16, got ", param.scalar_type());
    check_contiguous(param, op, param_arg);
    check_same_device(param, grad, op, grad_arg.c_str());
    TORCH_CHECK(grad.sizes() == param.sizes(), op, ": ", grad_arg, " must have its parameter's shape ",
                param.sizes(), ", got ", grad.sizes());
    check_contiguous(grad, op, grad_arg);
    check_state(param, exp_avgs[i], exp_avg_metas[i], group_size, op, item("exp_avgs", i), item("exp_avg_metas", i));
    check_state(param, exp_avg_sqs[i], exp_avg_sq_metas[i], group_size, op, item("exp_avg_sqs", i),
                item("exp_avg_sq_metas", i));
    const RowMatrix m = as_row_matrix(param, op, param_arg.c_str());
    tensors[i] = coat_adamw_tensor{param.data_ptr(),
                                   grad.data_ptr(),
                                   data_as<uint8_t>(exp_avgs[i]),
                                   data_as<uint16_t>(exp_avg_metas[i]),
                                   data_as<uint8_t>(exp_avg_sqs[i]),
                                   data_as<uint16_t>(exp_avg_sq_metas[i]),
                                   m.rows,
                                   m.cols,
                                   input_dtype(param, op, param_arg.c_str()),
                                   input_dtype(grad, op, grad_arg.c_str()),
                                   fp8_format(exp_avgs[i].scalar_type(), op, "exp_avgs"),
                                   fp8_format(exp_avg_sqs[i].scalar_type(), op, "exp_avg_sqs"),
                                   rounding_seeds.has_value() ? static_cast<uint64_t>((*rounding_seeds)[i]) : 0};
  }
  const coat_adamw_options options{static_cast<float>(beta1),
                                   static_cast<float>(1.0 - beta1),
                                   static_cast<float>(beta2),
                                   static_cast<float>(1.0 - beta2),
                                   static_cast<float>(eps),
                                   static_cast<float>(decay_factor),
                                   static_cast<float>(step_size),
                                   static_cast<float>(bias_correction2_sqrt),
                                   group_size,
                                   expand_m,
                                   expand_v,
                                   rounding_seeds.has_value()};
  COAT_CALL_CORE(params[0], coat_fp8_adamw_step, tensors.data(), static_cast<int64_t>(count), &options);
}

std::tuple<at::Tensor, at::Tensor> quantize_expanded(const at::Tensor& x, int64_t group_size,
                                                     at::ScalarType fp8_dtype, bool expand) {
  constexpr const char* op = "coat.quantize_expanded";
  check_device(x, op, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type(),
              "; convert it with .float()");
  const coat_fp8_format format = fp8_format(fp8_dtype, op, "fp8_dtype");
  check_group_size(group_size, op);
  const RowMatrix m = as_row_matrix(x, op, "x");

  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(fp8_dtype));
  at::Tensor meta = at::empty(meta_shape(x.sizes(), group_size), x.options().dtype(at::kBFloat16));
  COAT_CALL_CORE(x, coat_quantize_expanded, data_as<const float>(x), m.rows, m.cols, m.row_stride, group_size,
                 format, expand, data_as<uint8_t>(codes), data_as<uint16_t>(meta));
  return {codes, meta};
}

at::Tensor dequantize_expanded(const at::Tensor& codes, const at::Tensor& meta, int64_t group_size) {
  constexpr const char* op = "coat.dequantize_expanded";
  check_device(codes, op, "codes");
  const coat_fp8_format format = fp8_format(codes.scalar_type(), op, "codes");
  TORCH_CHECK(codes.dim() >= 1, op, ": codes must have at least one dimension, got a 0-d tensor");
  check_contiguous(codes, op, "codes");
  check_group_size(group_size, op);
  check_meta(codes, meta, group_size, op, "meta");
  const RowMatrix m = as_row_matrix(codes, op, "codes");

  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  COAT_CALL_CORE(codes, coat_dequantize_expanded, data_as<const uint8_t>(codes), format,
                 data_as<const uint16_t>(meta), m.rows, m.cols, group_size, data_as<float>(out));
  return out;
}


// coat_moment_counts' keys of n states, ascending: on CUDA the core's radix sort of the bits a key can have set.
at::Tensor sort_moment_keys(const at::Tensor& keys, int64_t n) {
#ifdef COAT_WITH_CUDA
  if (keys.is_cuda()) {
    const c10::cuda::CUDAGuard guard(keys.device());
    at::Tensor sorted_keys = at::empty_like(keys);
    const size_t bytes = coat_moment_keys_sort_workspace(keys.numel(), n);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, keys.options().dtype(at::kByte));
    const auto stream = reinterpret_cast<coat_cuda_stream>(at::cuda::getCurrentCUDAStream().stream());
    check_status(coat_moment_keys_sort_cuda(keys.data_ptr<int32_t>(), sorted_keys.data_ptr<int32_t>(), keys.numel(),
                                            n, workspace.data_ptr(), bytes, stream),
                 "coat_moment_keys_sort_cuda");
    return sorted_keys;
  }
#endif
  return std::get<0>(at::sort(keys));
}

at::Tensor moment_stats(at::TensorList codes, at::TensorList metas, int64_t group_size,
                        const c10::List<std::optional<at::Tensor>>& rows) {
  constexpr const char* op = "coat.moment_stats";
  const int64_t n = static_cast<int64_t>(codes.size());
  TORCH_CHECK(n >= 1 && n <= 0x8000, op, ": codes must hold 1 to 32768 states, got ", n, "; split larger sets");
  TORCH_CHECK(static_cast<int64_t>(metas.size()) == n && static_cast<int64_t>(rows.size()) == n, op,
              ": codes, metas and rows must have one entry per state, got ", n, ", ", metas.size(), " and ",
              rows.size());
  check_group_size(group_size, op);
  const at::Tensor& first = codes[0];
  check_device(first, op, "codes");
  int64_t groups = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::string arg = "codes[" + std::to_string(i) + "]";
    check_same_device(first, codes[i], op, arg.c_str());
    check_same_device(first, metas[i], op, "metas");
    fp8_format(codes[i].scalar_type(), op, arg.c_str());
    TORCH_CHECK(codes[i].dim() >= 1 && codes[i].numel() > 0 && codes[i].is_contiguous(), op, ": ", arg,
                " must be a non-empty contiguous tensor of at least one dimension, got shape ", codes[i].sizes());
    const int64_t cols = codes[i].size(-1);
    const int64_t state_groups = codes[i].numel() / cols * ((cols + group_size - 1) / group_size);
    TORCH_CHECK(metas[i].scalar_type() == at::kBFloat16 && metas[i].is_contiguous() &&
                    metas[i].numel() == state_groups * 3, op, ": metas[", i, "] must be the contiguous bfloat16 "
                "(scale, k, C) of each of the state's ", state_groups, " groups of ", group_size, ", got ",
                metas[i].scalar_type(), " of shape ", metas[i].sizes());
    const std::optional<at::Tensor> index = rows.get(i);
    if (index.has_value()) {
      check_same_device(first, *index, op, "rows");
      TORCH_CHECK(index->scalar_type() == at::kLong && index->dim() == 1 && index->numel() > 0 &&
                      index->is_contiguous(), op, ": rows[", i, "] must be a non-empty contiguous 1-D int64 tensor "
                  "of row indices (or None for every row), got ", index->scalar_type(), " of shape ", index->sizes());
    }
    groups += state_groups;
  }

  // uint64 counts, held in an int64 tensor (the same bytes)
  at::Tensor counts = at::zeros({n, COAT_MOMENT_COUNTS}, first.options().dtype(at::kLong));
  at::Tensor k_keys = at::empty({groups}, first.options().dtype(at::kInt));
  std::vector<coat_moment_state> states(n);
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::optional<at::Tensor> index = rows.get(i);
    const int64_t cols = codes[i].size(-1), state_rows = codes[i].numel() / cols;
    states[i] = {data_as<const uint8_t>(codes[i]), fp8_format(codes[i].scalar_type(), op, "codes"),
                 data_as<const uint16_t>(metas[i]), state_rows, cols,
                 index.has_value() ? index->data_ptr<int64_t>() : nullptr,
                 index.has_value() ? index->numel() : state_rows, static_cast<int32_t>(i),
                 reinterpret_cast<uint64_t*>(counts.data_ptr<int64_t>()) + i * COAT_MOMENT_COUNTS,
                 k_keys.data_ptr<int32_t>() + offset};
    offset += state_rows * ((cols + group_size - 1) / group_size);
  }
  COAT_CALL_CORE(first, coat_moment_counts, states.data(), n, group_size);
  const at::Tensor sorted_keys = sort_moment_keys(k_keys, n);
  at::Tensor stats = at::empty({n, COAT_MOMENT_STATS}, first.options().dtype(at::kDouble));
  COAT_CALL_CORE(first, coat_moment_stats, reinterpret_cast<const uint64_t*>(counts.data_ptr<int64_t>()),
                 sorted_keys.data_ptr<int32_t>(), n, stats.data_ptr<double>());
  return stats;
}

}  // namespace

// The step is registered for every backend at once: with an empty parameter list there is no tensor to
// dispatch on, and the kernel chooses the CPU or CUDA core from its tensors' device anyway.
TORCH_LIBRARY_IMPL(coat, CompositeExplicitAutograd, m) { m.impl("fp8_adamw_step", &fp8_adamw_step); }

TORCH_LIBRARY_IMPL(coat, CPU, m) {
  m.impl("quantize_expanded", &quantize_expanded);
  m.impl("dequantize_expanded", &dequantize_expanded);
  m.impl("moment_stats", &moment_stats);
}

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) {
  m.impl("quantize_expanded", &quantize_expanded);
  m.impl("dequantize_expanded", &dequantize_expanded);
  m.impl("moment_stats", &moment_stats);
}
#endif

}  // namespace coat
