/*
 * coat core: fused non-linear layers with FP8 outputs and FP8-saved inputs (COAT section 5, appendix G.3).
 *
 * Two layers of a Llama-style block, each as a forward/backward pair (and RMSNorm with a high-precision output,
 * coat_rmsnorm_save_*, for norms whose output is no GEMM input):
 *   RMSNorm:  y = x * rstd * (weight + weight_offset),  rstd = 1 / sqrt(mean(x^2) + eps)   (per row)
 *   act*mul:  y = act(gate) * up [* smooth_scale[c]]   act = silu (SwiGLU), gelu_tanh (GeGLU) or quick_gelu;
 *                                                       Smooth-SwiGLU when smooth_scale is given (any activation)
 *   act:      y = act(gate) [* smooth_scale[c]]        the same entry points with up = NULL: the activation of a
 *                                                       non-gated MLP (CLIP's, SigLIP's, Qwen3-VL's vision towers)
 * The act*mul entry points keep their coat_silu_mul_* names; `activation` picks act, and up = NULL (with
 * up_saved, up_scales and dup NULL) makes the op non-gated: every formula below then reads up as exactly 1.
 *
 * The forward writes y in FP8 with ONE per-tensor scale ("group scaling", COAT 5.2): the first pass
 * computes the op and the amax of y inside the same kernel, a second pass recomputes the op from the
 * inputs and quantizes it, so y never exists in memory in high precision. The forward also saves the
 * op's INPUTS for backward as FP8 E4M3 with 1 x G groups (G = save_group_size), which is all the backward
 * reads (plus rstd for RMSNorm). Backward gradients stay in the high-precision dtype (appendix G.5).
 * The requantize entry points recompute the forward's transposed FP8 output y_t from those saved inputs
 * and the forward's y_scale, so that a layer can drop y_t between forward and backward.
 *
 * Layout. High-precision tensors are row-major matrices of `rows` x `cols` whose rows start `row_stride`
 * elements apart (row_stride >= cols, last dimension contiguous), as in coat/quantize.h, so the two
 * halves of one [.., 2I] GEMM output can be passed as gate and up without a copy. Every output is
 * contiguous. Groups, scales and FP8 encodings follow coat/quantize.h exactly:
 *     scale = max(amax / FP8_MAX, 2^-126),  code = fp8_encode(v / scale)
 * with one exception made for CPU/GPU bit equality: every NaN code is the positive NaN 0x7F (x86 and
 * CUDA give NaNs of different signs, e.g. for Inf / Inf), so the sign of a NaN carries no information.
 *
 * Per-tensor FP8 output (y, y_scale, y_t). With y_f32 the fp32 op result defined in
 * coat/detail/norm_act_math.h:
 *     y_amax     = max |y_f32| over the tensor, NaN ignored (written to the one-float `y_amax` scratch)
 *     y_scale[0] = max(y_amax / FP8_MAX, 2^-126)
 *     y[r*cols + c] = fp8_encode(y_f32[r, c] / y_scale[0])       and, when y_t != NULL,
 *     y_t[c*rows + r] = y[r*cols + c]                              (the operand of the weight-gradient GEMM)
 * which is bit for bit coat_quantize_tensor applied to y_f32 (max is exact, so the result does not depend
 * on how the amax is grouped).
 *
 * Saved inputs (1 x G groups along a row, G in {16, 32, 64, 128}, the last group of a row may be short), in the
 * forward ops' save_format:
 *   COAT_SAVED_E4M3: saved (rows*cols bytes) and scales (rows*ceil(cols/G) fp32) are bit for bit
 *                    coat_quantize_group(input, G, E4M3); the backward and requantize entry points read this.
 *   COAT_SAVED_FP4:  saved (rows*ceil(cols/2) bytes) and scales (rows*ceil(cols/G) fp32) are bit for bit
 *                    coat_quantize_fp4(input, G) (coat/quantize.h): the copy a layer keeps at about 4 bits,
 *                    made while the input is read anyway.
 *   COAT_SAVED_FP6:  saved (rows*ceil(3 cols/4) bytes) and scales (rows*ceil(cols/G) fp32) are bit for bit
 *                    coat_quantize_fp6(input, G): the copy at about 6 bits.
 * The backward and requantize entry points read any of them (their `saved_format`). An FP4 or FP6 code is read
 * as its E4M3 expansion coat_e2m1_to_e4m3 / coat_e2m3_to_e4m3 (the same value, with the same block scale), so
 * their results from such a copy equal, bit for bit, their results from coat_fp4_to_e4m3's / coat_fp6_to_e4m3's
 * expansion of it, without that expansion being written: below, "decoded" means this decoding in every format.
 *
 * Determinism. Every sum (the per-row sum of squares and dot product of RMSNorm, the column sums of
 * dweight) has a fixed reduction order, defined in coat/detail/norm_act_math.h and shared by the C and
 * CUDA implementations, which therefore agree bit for bit. NaN outputs in fp32 are the canonical 0x7FC00000.
 *
 * The CPU (C) and CUDA implementations compute the same values element for element, bit for bit.
 * CUDA entry points enqueue work on `stream` and return without synchronising; their pointers are device
 * pointers (the `y_amax` and `workspace` scratch included).
 */
#ifndef COAT_NORM_ACT_H
#define COAT_NORM_ACT_H

#include "coat/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** How a forward op saves its inputs for backward (see "Saved inputs" above). */
typedef enum {
  COAT_SAVED_E4M3 = 0,
  COAT_SAVED_FP4 = 1,
  COAT_SAVED_FP6 = 2,
} coat_saved_format;

/** The activation of the entry points coat_silu_mul_*: y = act(gate) [* up] with
 *    COAT_ACT_SILU:       act(g) = silu(g) = g * sigmoid(g)                                    (SwiGLU: Llama, Qwen)
 *    COAT_ACT_GELU_TANH:  act(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))         (GeGLU: Gemma; SigLIP's
 *                         and Qwen3-VL's vision MLPs; PyTorch's gelu(approximate="tanh"), transformers'
 *                         "gelu_pytorch_tanh")
 *    COAT_ACT_QUICK_GELU: act(g) = g * sigmoid(1.702 g)                (CLIP's and Qwen2-VL's vision MLPs:
 *                         transformers' "quick_gelu")
 *  All are computed as g * sigmoid(z(g)) in fp32 with coat's own exp (coat/detail/norm_act_math.h), z = g for
 *  silu, z = 2 sqrt(2/pi) (g + 0.044715 g^3) for gelu_tanh (0.5 (1 + tanh(u)) = sigmoid(2u)) and z = 1.702 g for
 *  quick_gelu, and their derivatives
 *    silu'(g)       = s (1 + g (1 - s)),                  s = sigmoid(g)
 *    gelu_tanh'(g)  = 0.5 (1 + t) + 0.5 g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2)
 *                   = s (1 + g (1 - s) z'(g)),            s = sigmoid(z(g)) = (1 + t) / 2, t = tanh(z / 2)
 *    quick_gelu'(g) = s (1 + 1.702 g (1 - s)),            s = sigmoid(1.702 g)
 *  Special values, all: act(+Inf) = +Inf, act(-Inf) = -Inf * 0 = NaN (as PyTorch), act(NaN) = NaN; a finite
 *  gate never gives NaN. The derivative: silu'(+-Inf) = NaN (Inf * 0); gelu_tanh' and quick_gelu' take the gate
 *  clamped to [-64, 64], where sigmoid(z) is already exactly 1 or 0, so they are finite for every finite gate
 *  (PyTorch's fp32 gelu backward gives NaN from |g| ~ 1.8e19 on) and the limits 1 and 0 at +Inf and -Inf. */
typedef enum {
  COAT_ACT_SILU = 0,
  COAT_ACT_GELU_TANH = 1,
  COAT_ACT_QUICK_GELU = 2,
} coat_activation;

/** The widest row RMSNorm accepts: a row is reduced by at most 1024 threads holding 32 elements each. */
#define COAT_RMSNORM_MAX_COLS 32768
/** The widest row any norm_act entry point accepts (2^30; offsets within a row are 32-bit on the GPU). */
#define COAT_NORM_ACT_MAX_COLS 1073741824

/** RMSNorm forward with FP8 output and FP8-saved input.
 *    rstd[r]  = 1 / sqrt(sum_c x[r,c]^2 / cols + eps)     (fp32, fixed reduction order, from the exact x)
 *    w[c]     = weight[c] + weight_offset                  (fp32, one rounding: coat_rmsnorm_weight)
 *    y_f32    = (x[r,c] * rstd[r]) * w[c]                (fp32, two roundings, in this order)
 *  weight_offset is 0 for Llama-style norms and 1 for Gemma's, whose weight is stored as w - 1; it must be finite.
 *  Every RMSNorm entry point below (and coat_qk_norm_rope_* in coat/rope.h) uses this w wherever it says weight;
 *  w = weight + 0 turns a -0 weight into +0, as torch's weight.float() + 0.0 does.
 *  y, y_scale, y_t: the per-tensor FP8 output of y_f32 in `y_format` (see above); y_t may be NULL.
 *  x_saved, x_saved_scales: x saved in save_format with G = save_group_size (see "Saved inputs").
 *  x: `x_dtype`, rows x cols with row_stride; weight: `cols` contiguous elements of `weight_dtype`;
 *  rstd: `rows` fp32; y_amax: one fp32 of scratch (receives the amax of y_f32).
 *  1 <= cols <= COAT_RMSNORM_MAX_COLS; eps is added in fp32. */
coat_status coat_rmsnorm_quantize_cpu(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                      const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                                      int64_t save_group_size, coat_saved_format save_format, coat_fp8_format y_format,
                                      uint8_t* y, float* y_scale, uint8_t* y_t, uint8_t* x_saved, float* x_saved_scales,
                                      float* rstd, float* y_amax);
coat_status coat_rmsnorm_quantize_cuda(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const void* weight, coat_dtype weight_dtype,
                                       float weight_offset, float eps, int64_t save_group_size,
                                       coat_saved_format save_format, coat_fp8_format y_format, uint8_t* y,
                                       float* y_scale, uint8_t* y_t, uint8_t* x_saved, float* x_saved_scales,
                                       float* rstd, float* y_amax, coat_cuda_stream stream);

/** RMSNorm forward with its output in high precision and its input saved for backward: for norms whose output is
 *  no GEMM input (OLMo 2's and Gemma 3's post-norms on the attention and MLP outputs, OLMo 2's q/k norms over the
 *  whole projection width). rstd, w and y_f32 as in coat_rmsnorm_quantize_*; then, in one pass over x,
 *    out[r,c] = round_to(x_dtype, y_f32[r,c])                                                  without a residual
 *    out[r,c] = round_to(residual_dtype, float(round_to(x_dtype, y_f32[r,c])) + float(residual[r,c]))  with one
 *  (float32 throughout, y_f32 rounded once: OLMo2RMSNorm's and Gemma3RMSNorm's (w * x_f32 * rstd).to(x.dtype); with
 *  a residual, torch's residual + norm(x), which adds 16-bit tensors in fp32 and rounds once). A NaN is stored
 *  canonically (0x7FC00000, bf16 0x7FC0, fp16 0x7E00). A row holding +-Inf has rstd 0 and gives NaN at the Inf and
 *  0 elsewhere (Inf * 0), as torch's formula does; a NaN row gives NaN.
 *  x_saved, x_saved_scales and rstd are bit for bit those coat_rmsnorm_quantize_* writes (same arguments), so
 *  coat_rmsnorm_backward_* (with the same weight_offset) is this op's backward; the residual's gradient is the
 *  output's.
 *  x: `x_dtype`, rows x cols with row_stride; weight: `cols` contiguous elements of `weight_dtype`; residual: NULL, or
 *  rows*cols contiguous elements of `residual_dtype` (ignored without one); out: rows*cols contiguous elements of
 *  `residual_dtype` with a residual, of `x_dtype` without; rstd: `rows` fp32. 1 <= cols <= COAT_RMSNORM_MAX_COLS. */
coat_status coat_rmsnorm_save_cpu(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                                  int64_t save_group_size, coat_saved_format save_format, const void* residual,
                                  coat_dtype residual_dtype, void* out, uint8_t* x_saved, float* x_saved_scales,
                                  float* rstd);
coat_status coat_rmsnorm_save_cuda(const void* x, coat_dtype x_dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   const void* weight, coat_dtype weight_dtype, float weight_offset, float eps,
                                   int64_t save_group_size, coat_saved_format save_format, const void* residual,
                                   coat_dtype residual_dtype, void* out, uint8_t* x_saved, float* x_saved_scales,
                                   float* rstd, coat_cuda_stream stream);

/** Number of fp32 elements of scratch coat_rmsnorm_backward_* needs: one partial dweight row per slice
 *  of rows (see coat_rmsnorm_backward_rows_per_slice in coat/detail/norm_act_math.h). */
int64_t coat_rmsnorm_backward_workspace_size(int64_t rows, int64_t cols);

/** RMSNorm backward from the saved input. With x' = decoded x_saved * scale (fp32, as coat_dequantize and
 *  coat_dequantize_fp4 give), and per row r:
 *    xhat[c] = x'[r,c] * rstd[r],   g[c] = dy[r,c] * w[c]     (w = weight[c] + weight_offset, as the forward)
 *    dot     = sum_c g[c] * xhat[c]                         (fixed reduction order, as the forward's sum)
 *    dx[r,c] = (g[c] - xhat[c] * (dot / cols)) * rstd[r]    rounded to dy's dtype
 *    dweight[c] = sum_r dy[r,c] * xhat[c]                   (fp32, fixed order over rows; the offset is constant)
 *  With a residual (the gradient that reaches the norm's input around it, as in x + f(norm(x))), dx is
 *  written in `residual_dtype` instead, that dx plus the residual in one fp32 addition:
 *    dx[r,c] = round_to(residual_dtype, float(round_to(dy_dtype, dx_f32[r,c])) + float(residual[r,c]))
 *  which is torch's dx.to(residual.dtype) + residual whenever dy's dtype converts to residual's exactly (the
 *  same dtype, or an fp32 residual): torch adds 16-bit tensors in fp32 and rounds once. A NaN dx is stored
 *  canonically in every dtype (0x7FC00000, bf16 0x7FC0, fp16 0x7E00), whichever operand it came from.
 *  dy: `dy_dtype`, rows x cols with row_stride; x_saved, x_saved_scales: as coat_rmsnorm_quantize_* saved them
 *  in saved_format with save_group_size G; rstd: `rows` fp32; weight: `cols` elements of `weight_dtype`;
 *  residual: NULL, or rows*cols contiguous elements of `residual_dtype` (ignored without one); dx: rows*cols
 *  contiguous elements of `residual_dtype` with a residual, of `dy_dtype` without; dweight: `cols` fp32; workspace:
 *  coat_rmsnorm_backward_workspace_size fp32 of scratch. 1 <= cols <= COAT_RMSNORM_MAX_COLS. */
coat_status coat_rmsnorm_backward_cpu(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                      int64_t row_stride, const uint8_t* x_saved, const float* x_saved_scales,
                                      int64_t save_group_size, coat_saved_format saved_format, const float* rstd,
                                      const void* weight, coat_dtype weight_dtype, float weight_offset,
                                      const void* residual, coat_dtype residual_dtype, void* dx, float* dweight,
                                      float* workspace);
coat_status coat_rmsnorm_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const uint8_t* x_saved, const float* x_saved_scales,
                                       int64_t save_group_size, coat_saved_format saved_format, const float* rstd,
                                       const void* weight, coat_dtype weight_dtype, float weight_offset,
                                       const void* residual, coat_dtype residual_dtype, void* dx, float* dweight,
                                       float* workspace, coat_cuda_stream stream);

/** act*mul forward (SwiGLU's, GeGLU's or a non-gated MLP's activation) with FP8 output and FP8-saved inputs.
 *    y_f32 = (act(gate[r,c]) * up[r,c]) * smooth_scale[c]      (a factor of 1, which is exact, when
 *            smooth_scale is NULL, and up[r,c] = 1 when up is NULL; act = `activation`, g * sigmoid(z(g)) as
 *            defined in coat/detail/norm_act_math.h)
 *  y, y_scale, y_t: the per-tensor FP8 output of y_f32 in `y_format`; y_t may be NULL.
 *  gate_saved / up_saved, gate_scales / up_scales: gate / up saved in save_format (see "Saved inputs"); up_saved
 *  and up_scales are not written (may be NULL) when up is NULL.
 *  gate, up: `dtype`, rows x cols, with their own row strides (up may be NULL); smooth_scale: `cols` fp32 or NULL;
 *  y_amax: one fp32 of scratch; activation: a coat_activation (another value is COAT_ERROR_INVALID_ARGUMENT, in
 *  every coat_silu_mul_* entry point). Smooth-SwiGLU (Fishman et al., 2024): the caller folds 1/smooth_scale
 *  into the next linear layer, so that the FP8 input of that layer has no per-channel outliers. */
coat_status coat_silu_mul_quantize_cpu(const void* gate, const void* up, coat_dtype dtype, int64_t rows,
                                       int64_t cols, int64_t gate_row_stride, int64_t up_row_stride,
                                       const float* smooth_scale, coat_activation activation,
                                       int64_t save_group_size, coat_saved_format save_format,
                                       coat_fp8_format y_format, uint8_t* y,
                                       float* y_scale, uint8_t* y_t, uint8_t* gate_saved, float* gate_scales,
                                       uint8_t* up_saved, float* up_scales, float* y_amax);
coat_status coat_silu_mul_quantize_cuda(const void* gate, const void* up, coat_dtype dtype, int64_t rows,
                                        int64_t cols, int64_t gate_row_stride, int64_t up_row_stride,
                                        const float* smooth_scale, coat_activation activation,
                                        int64_t save_group_size, coat_saved_format save_format,
                                        coat_fp8_format y_format, uint8_t* y,
                                        float* y_scale, uint8_t* y_t, uint8_t* gate_saved, float* gate_scales,
                                        uint8_t* up_saved, float* up_scales, float* y_amax, coat_cuda_stream stream);

/** act*mul backward from the saved inputs g' and u' (decoded as coat_dequantize and coat_dequantize_fp4 do, in
 *  saved_format), elementwise, for the forward's `activation`:
 *    s        = 1 / (1 + exp(-z(g')))                       (sigmoid, as in the forward)
 *    dy_s     = dy * smooth_scale[c]                        (dy * 1 without smooth_scale)
 *    dup      = dy_s * (g' * s)                             (act(g'))
 *    dgate    = (dy_s * u') * act'(g')                      (coat_silu_grad_factors' rounding order)
 *  both rounded to dy's dtype. dy: `dy_dtype`, rows x cols with row_stride; gate_saved, up_saved and their scales:
 *  as coat_silu_mul_quantize_* saved them in saved_format; dgate, dup: rows*cols contiguous elements of
 *  `dy_dtype`. Non-gated (up_saved NULL, the forward's up was): u' = 1, and up_scales and dup are NULL.
 *  d_amax: NULL, or one fp32 accumulated as coat_tensor_amax_* accumulates (it must hold a value >= 0 and not
 *  NaN, 0 to start):
 *    d_amax[0] = max(d_amax[0], max |dgate|, max |dup|)       over the stored (rounded) values, NaN ignored
 *                                                              (max |dgate| alone when non-gated)
 *  which is what the per-tensor quantization of the two gradients with one shared scale needs, without
 *  another pass over them (coat_tensor_amax_* of dgate then dup gives the same value). */
coat_status coat_silu_mul_backward_cpu(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                       int64_t row_stride, const uint8_t* gate_saved, const float* gate_scales,
                                       const uint8_t* up_saved, const float* up_scales,
                                       const float* smooth_scale, coat_activation activation,
                                       int64_t save_group_size, coat_saved_format saved_format, void* dgate,
                                       void* dup, float* d_amax);
coat_status coat_silu_mul_backward_cuda(const void* dy, coat_dtype dy_dtype, int64_t rows, int64_t cols,
                                        int64_t row_stride, const uint8_t* gate_saved, const float* gate_scales,
                                        const uint8_t* up_saved, const float* up_scales,
                                        const float* smooth_scale, coat_activation activation,
                                        int64_t save_group_size, coat_saved_format saved_format, void* dgate,
                                        void* dup, float* d_amax,
                                        coat_cuda_stream stream);

/** RMSNorm's FP8 transposed output recomputed from what the forward saved, so that a layer need not keep y_t
 *  for backward. With x' = decoded x_saved * scale of its group (fp32, as coat_rmsnorm_backward_* decode it):
 *    y_f32 = (x'[r,c] * rstd[r]) * w[c]                      (coat_rmsnorm_apply, w = weight[c] + weight_offset)
 *    y_t[c*rows + r] = fp8_encode(y_f32 / y_scale[0])        in `y_format`, NaN canonical (0x7F)
 *  y_scale is an INPUT: the one fp32 the forward wrote. y_t equals the forward's y_t bit for bit when x equals
 *  x' (x was representable in its group); otherwise a code differs from the forward's by at most what x' - x
 *  (half an E4M3 step at most, half an E2M1 step from FP4) changes y, plus half an FP8 step of each code
 *  (tests/test_norm_act.py states the bound). Values past the forward's amax, which x' may give, saturate to
 *  +-FP8_MAX like any finite quotient (only a quotient that overflows fp32, from a y_scale far below the
 *  forward's, gives the E5M2 Inf code). NaN follows the formula: a NaN code decodes to NaN, and a group saved
 *  with an Inf scale (its input held +-Inf, so the forward's rstd of that row is 0) to +-Inf and NaN, which
 *  give NaN codes over that group (the forward, from the exact x, has NaN at the Inf only).
 *  No row-major y is written. x_saved, x_saved_scales, rstd (`rows` fp32): as coat_rmsnorm_quantize_* returned
 *  them in saved_format with save_group_size G; weight: `cols` contiguous elements of `weight_dtype`; y_t:
 *  cols*rows bytes. 1 <= cols <= COAT_RMSNORM_MAX_COLS; rows may be 0. */
coat_status coat_rmsnorm_requantize_cpu(const uint8_t* x_saved, const float* x_saved_scales, int64_t save_group_size,
                                        coat_saved_format saved_format, const float* rstd, int64_t rows, int64_t cols,
                                        const void* weight, coat_dtype weight_dtype, float weight_offset,
                                        const float* y_scale, coat_fp8_format y_format, uint8_t* y_t);
coat_status coat_rmsnorm_requantize_cuda(const uint8_t* x_saved, const float* x_saved_scales, int64_t save_group_size,
                                         coat_saved_format saved_format, const float* rstd, int64_t rows, int64_t cols,
                                         const void* weight, coat_dtype weight_dtype, float weight_offset,
                                         const float* y_scale, coat_fp8_format y_format, uint8_t* y_t,
                                         coat_cuda_stream stream);

/** act*mul's FP8 transposed output recomputed from the saved inputs g' and u' (decoded as
 *  coat_silu_mul_backward_* decode them; u' = 1 when up_saved is NULL, the non-gated op, up_scales NULL too), act
 *  (the forward's `activation`) taken of g' ROUNDED TO BF16 (nearest, ties to even):
 *    y_f32 = (act(bf16(g'[r,c])) * u'[r,c]) * smooth_scale[c]    (coat_silu_mul with the forward's act; u' fp32)
 *    y_t[c*rows + r] = fp8_encode(y_f32 / y_scale[0])            in `y_format`, NaN canonical (0x7F)
 *  Why bf16: the CUDA kernel then reads silu from the same table of silu over bf16 gates as the forward, instead
 *  of evaluating coat's exp per element; the rounding moves g' by at most half a bf16 ulp (under 2^-8 |g'|),
 *  1/16 of the relative error (up to 2^-4) the E4M3 copy g' already carries (coat_requantize_gate).
 *  bf16(g') keeps +-Inf and NaN, and a finite g' past the largest bf16 becomes +-Inf; silu then behaves as the
 *  forward's on such bf16 gates: act(+Inf) = +Inf, act(-Inf) = -Inf * 0 = NaN, act(NaN) = NaN.
 *  y_scale, saturation and the tie to the forward's y_t are as in coat_rmsnorm_requantize_* (for bf16 gates
 *  bf16(g') = g' whenever g' = g), and NaN comes from the formula (a NaN code, or a zero code in a group saved
 *  with an Inf scale, decodes to NaN).
 *  gate_saved / up_saved, gate_scales / up_scales: as coat_silu_mul_quantize_* returned them in saved_format;
 *  smooth_scale: `cols` fp32 or NULL; y_t: cols*rows bytes. */
coat_status coat_silu_mul_requantize_cpu(const uint8_t* gate_saved, const float* gate_scales, const uint8_t* up_saved,
                                         const float* up_scales, int64_t save_group_size,
                                         coat_saved_format saved_format, int64_t rows, int64_t cols,
                                         const float* smooth_scale, coat_activation activation, const float* y_scale,
                                         coat_fp8_format y_format, uint8_t* y_t);
coat_status coat_silu_mul_requantize_cuda(const uint8_t* gate_saved, const float* gate_scales,
                                          const uint8_t* up_saved, const float* up_scales, int64_t save_group_size,
                                          coat_saved_format saved_format, int64_t rows, int64_t cols,
                                          const float* smooth_scale, coat_activation activation,
                                          const float* y_scale, coat_fp8_format y_format, uint8_t* y_t,
                                          coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_NORM_ACT_H */
