// ATen bindings of the rope family (coat/rope.h): check, allocate, call the core.
#include "coat/rope.h"

#include <tuple>

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

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin, bool inverse) {
  constexpr const char* op = "coat.rotary_embedding";
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
  TORCH_CHECK(head_dim % 2 == 0 && head_dim >= 2 && head_dim <= COAT_ROPE_MAX_HEAD_DIM, op,
              ": head_dim (the last dimension of q and k) must be even and between 2 and ", COAT_ROPE_MAX_HEAD_DIM,
              ", got ", head_dim);
  TORCH_CHECK(cos.dim() == 3 && (cos.size(0) == batch || cos.size(0) == 1) && cos.size(1) == seq &&
                  cos.size(2) == head_dim,
              op, ": cos must be [", batch, " or 1, ", seq, ", ", head_dim, "] (q's batch, seq and head_dim), got shape ",
              cos.sizes());
  TORCH_CHECK(sin.sizes() == cos.sizes(), op, ": sin must have the shape of cos, ", cos.sizes(), ", got ", sin.sizes());
  check_last_dim_contiguous(q, op, "q");
  check_last_dim_contiguous(k, op, "k");
  check_last_dim_contiguous(cos, op, "cos");
  check_last_dim_contiguous(sin, op, "sin");

  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
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
  COAT_CALL_CORE(q, coat_rotary_embedding, &args, inverse ? 1 : 0);
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) { m.impl("rotary_embedding", &rotary_embedding); }
#endif

}  // namespace coat
