// ATen bindings of the rope family (coat/rope.h): check, allocate, call the core.
#include "coat/rope.h"

#include <cmath>
#include <tuple>
#include <vector>

#include "common.h"

namespace coat {
namespace {

// The stride of dimension d, or 0 when the dimension has size 1: any stride reads the same elements there,
// and 0 does not defeat the 16-byte alignment test of the CUDA kernel.
int64_t stride_or_zero(const at::Tensor& t, int64_t d) { return t.size(d) == 1 ? 0 : t.stride(d); }

// The one layout requirement: every other stride, a column slice or a transposed view included, is read in place.
void check_last_dim_contiguous(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.stride(-1) == 1, op, ": the last dimension of ", arg,
              " must be contiguous (stride 1); call .contiguous() first. Got strides ", t.strides());
}

// Checks q, k, cos and sin as every rope op reads them and describes them, with the outputs q_out and k_out
// (allocated here: contiguous, q's and k's shapes and dtype), in a coat_rope_args.
coat_rope_args rope_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                         const char* op, int64_t max_head_dim, at::Tensor& q_out, at::Tensor& k_out) {
  check_device(q, op, "q");
  check_same_device(q, k, op, "k");
  check_same_device(q, cos, op, "cos");
  check_same_device(q, sin, op, "sin");
  const coat_dtype dtype = input_dtype(q, op, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": q and k must have the same dtype, got ", q.scalar_type(),
              " and ", k.scalar_type());
  const coat_dtype table_dtype = input_dtype(cos, op, "cos");
  TORCH_CHECK(sin.scalar_type() == cos.scalar_type(), op, ": cos and sin must have the same dtype, got ",
              cos.scalar_type(), " and ", sin.scalar_type());

  TORCH_CHECK(q.dim() == 4, op, ": q must be [batch, seq, heads, head_dim], got shape ", q.sizes());
  const int64_t batch = q.size(0), seq = q.size(1), head_dim = q.size(3);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == batch && k.size(1) == seq && k.size(3) == head_dim, op, ": k must be [",
              batch, ", ", seq, ", k_heads, ", head_dim, "] (q's batch, seq and head_dim), got shape ", k.sizes());
  TORCH_CHECK(head_dim % 2 == 0 && head_dim >= 2 && head_dim <= max_head_dim, op,
              ": head_dim (the last dimension of q and k) must be even and between 2 and ", max_head_dim, ", got ",
              head_dim);
  TORCH_CHECK(cos.dim() == 3 && (cos.size(0) == batch || cos.size(0) == 1) && cos.size(1) == seq &&
                  cos.size(2) == head_dim,
              op, ": cos must be [", batch, " or 1, ", seq, ", ", head_dim, "] (q's batch, seq and head_dim), got shape ",
              cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": sin must have the shape of cos, ", cos.sizes(), ", got ", sin.sizes());
  check_last_dim_contiguous(q, op, "q");
  check_last_dim_contiguous(k, op, "k");
  check_last_dim_contiguous(cos, op, "cos");
  check_last_dim_contiguous(sin, op, "sin");

  q_out = at::empty(q.sizes(), q.options());
  k_out = at::empty(k.sizes(), k.options());
  coat_rope_args args{};
  args.q = data_as<const void>(q);
  args.k = data_as<const void>(k);
  args.cos = data_as<const void>(cos);
  args.sin = data_as<const void>(sin);
  args.q_out = data_as<void>(q_out);
  args.k_out = data_as<void>(k_out);
  for (int64_t d = 0; d < 3; ++d) {
    args.q_strides[d] = stride_or_zero(q, d);
    args.k_strides[d] = stride_or_zero(k, d);
  }
  for (int64_t d = 0; d < 2; ++d) {
    args.cos_strides[d] = stride_or_zero(cos, d);
    args.sin_strides[d] = stride_or_zero(sin, d);
  }
  args.batch = batch;
  args.seq = seq;
  args.q_heads = q.size(2);
  args.k_heads = k.size(2);
  args.head_dim = head_dim;
  args.dtype = dtype;
  args.table_dtype = table_dtype;
  return args;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin, bool inverse) {
  at::Tensor q_out, k_out;
  const coat_rope_args args = rope_args(q, k, cos, sin, "coat.rotary_embedding", COAT_ROPE_MAX_HEAD_DIM, q_out, k_out);
  COAT_CALL_CORE(q, coat_rotary_embedding, &args, inverse ? 1 : 0);
  return {q_out, k_out};
}

// A per-head norm weight: [head_dim], contiguous, on q's device, of the other weight's dtype.
void check_head_weight(const at::Tensor& weight, const at::Tensor& q, int64_t head_dim, const char* op,
                       const char* arg) {
  check_same_device(q, weight, op, arg);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == head_dim && weight.is_contiguous(), op, ": ", arg,
              " must be a contiguous [", head_dim, "] tensor (head_dim), got shape ", weight.sizes());
}

// (q_out, k_out, q_saved, q_saved_scales, q_rstd, k_saved, k_saved_scales, k_rstd)
using QkNormRopeOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                     at::Tensor, at::Tensor>;

QkNormRopeOutputs qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                               const at::Tensor& k_weight, double eps, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t save_group_size, double weight_offset) {
  constexpr const char* op = "coat.qk_norm_rope";
  at::Tensor q_out, k_out;
  coat_qk_norm_rope_args args{};
  args.rope = rope_args(q, k, cos, sin, op, COAT_QK_NORM_MAX_HEAD_DIM, q_out, k_out);
  const int64_t head_dim = q.size(3);
  check_head_weight(q_weight, q, head_dim, op, "q_weight");
  check_head_weight(k_weight, q, head_dim, op, "k_weight");
  TORCH_CHECK(k_weight.scalar_type() == q_weight.scalar_type(), op, ": q_weight and k_weight must have the same dtype, ",
              "got ", q_weight.scalar_type(), " and ", k_weight.scalar_type());
  TORCH_CHECK(save_group_size == 16 || save_group_size == 32 || save_group_size == 64 || save_group_size == 128, op,
              ": save_group_size must be 16, 32, 64 or 128, got ", save_group_size);
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), op, ": eps must be finite and >= 0, got ", eps);
  const int64_t groups = (head_dim + save_group_size - 1) / save_group_size;
  const at::TensorOptions float_options = q.options().dtype(at::kFloat);
  const at::TensorOptions code_options = q.options().dtype(at::kFloat8_e4m3fn);
  const auto rows_shape = [](const at::Tensor& x, int64_t last) {
    return std::vector<int64_t>{x.size(0), x.size(1), x.size(2), last};
  };
  at::Tensor q_saved = at::empty(q.sizes(), code_options);
  at::Tensor q_saved_scales = at::empty(rows_shape(q, groups), float_options);
  at::Tensor q_rstd = at::empty({q.size(0) * q.size(1) * q.size(2)}, float_options);
  at::Tensor k_saved = at::empty(k.sizes(), code_options);
  at::Tensor k_saved_scales = at::empty(rows_shape(k, groups), float_options);
  at::Tensor k_rstd = at::empty({k.size(0) * k.size(1) * k.size(2)}, float_options);
  args.q_weight = data_as<const void>(q_weight);
  args.k_weight = data_as<const void>(k_weight);
  args.weight_dtype = input_dtype(q_weight, op, "q_weight");
  args.weight_offset = weight_offset_arg(weight_offset, op);
  args.eps = static_cast<float>(eps);
  args.save_group_size = save_group_size;
  args.q_saved = data_as<uint8_t>(q_saved);
  args.q_saved_scales = data_as<float>(q_saved_scales);
  args.q_rstd = data_as<float>(q_rstd);
  args.k_saved = data_as<uint8_t>(k_saved);
  args.k_saved_scales = data_as<float>(k_saved_scales);
  args.k_rstd = data_as<float>(k_rstd);
  COAT_CALL_CORE(q, coat_qk_norm_rope, &args);
  return {q_out, k_out, q_saved, q_saved_scales, q_rstd, k_saved, k_saved_scales, k_rstd};
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) {
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("qk_norm_rope", &qk_norm_rope);
}

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) {
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("qk_norm_rope", &qk_norm_rope);
}
#endif

}  // namespace coat
