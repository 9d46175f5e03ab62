// ATen binding of coat/cross_entropy.h: check, allocate, call the core.
#include "coat/cross_entropy.h"

#include <tuple>

#include "common.h"

namespace coat {
namespace {

// loss and lse per row; with grad_scale, logits are overwritten by the gradient (the schema declares it).
std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                                 const c10::optional<at::Tensor>& grad_scale, int64_t ignore_index,
                                                 double label_smoothing, double softcap, double z_loss) {
  constexpr const char* op = "coat.cross_entropy";
  check_device(logits, op, "logits");
  check_same_device(logits, labels, op, "labels");
  const coat_dtype dtype = input_dtype(logits, op, "logits");
  const RowMatrix m = as_row_matrix(logits, op, "logits");
  TORCH_CHECK(m.cols >= 1 && m.cols <= COAT_CROSS_ENTROPY_MAX_V, op,
              ": the vocabulary (the last dimension of logits) must hold between 1 and ", COAT_CROSS_ENTROPY_MAX_V,
              " classes, got ", m.cols);
  TORCH_CHECK(labels.scalar_type() == at::kLong, op, ": labels must be int64 (torch.long), got ",
              labels.scalar_type(), "; convert them with .long()");
  TORCH_CHECK(labels.sizes() == logits.sizes().slice(0, logits.dim() - 1), op,
              ": labels must have the shape of logits without its last dimension, ",
              logits.sizes().slice(0, logits.dim() - 1), ", got ", labels.sizes());
  TORCH_CHECK(labels.is_contiguous(), op, ": labels must be contiguous; call .contiguous() first");
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
              label_smoothing);
  TORCH_CHECK(softcap >= 0.0, op, ": softcap must be > 0, or 0 for none, got ", softcap);
  TORCH_CHECK(z_loss >= 0.0, op, ": z_loss must be >= 0, got ", z_loss);

  int64_t grad_scale_stride = 0;
  if (grad_scale.has_value()) {
    check_same_device(logits, *grad_scale, op, "grad_scale");
    TORCH_CHECK(grad_scale->scalar_type() == at::kFloat, op, ": grad_scale must be float32, got ",
                grad_scale->scalar_type());
    TORCH_CHECK(grad_scale->is_contiguous() && (grad_scale->numel() == 1 || grad_scale->numel() == m.rows), op,
                ": grad_scale must be one contiguous float32 for every row or one per row (", m.rows,
                "), got shape ", grad_scale->sizes());
    grad_scale_stride = grad_scale->numel() == 1 ? 0 : 1;
  }

  at::Tensor loss = at::empty(labels.sizes(), labels.options().dtype(at::kFloat));
  at::Tensor lse = at::empty(labels.sizes(), labels.options().dtype(at::kFloat));
  coat_cross_entropy_args args{};
  args.logits = data_as<void>(logits);
  args.rows = m.rows;
  args.vocab = m.cols;
  args.row_stride = m.row_stride;
  args.dtype = dtype;
  args.labels = data_as<const int64_t>(labels);
  args.ignore_index = ignore_index;
  args.label_smoothing = static_cast<float>(label_smoothing);
  args.softcap = static_cast<float>(softcap);
  args.z_loss = static_cast<float>(z_loss);
  args.grad_scale = grad_scale.has_value() ? data_as<const float>(*grad_scale) : nullptr;
  args.grad_scale_stride = grad_scale_stride;
  args.loss = data_as<float>(loss);
  args.lse = data_as<float>(lse);
  if (m.rows > 0) COAT_CALL_CORE(logits, coat_cross_entropy, &args);
  return {loss, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(coat, CPU, m) { m.impl("cross_entropy", &cross_entropy); }

#ifdef COAT_WITH_CUDA
TORCH_LIBRARY_IMPL(coat, CUDA, m) { m.impl("cross_entropy", &cross_entropy); }
#endif

}  // namespace coat
