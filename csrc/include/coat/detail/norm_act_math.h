/*
 * The arithmetic of the norm_act family (coat/norm_act.h), shared by the C and CUDA implementations so
 * that both compute the same bits: the element formulas, the exp used by SiLU, and the reduction orders.
 * Internal: not part of the C API.
 *
 * Every expression here is evaluated in fp32 with one rounding per operation, in the order written:
 * the C core is compiled as C99 (no FMA contraction) and the CUDA core with -fmad=false, and division and
 * square root go through coat_div_rn / coat_sqrt_rn (correctly rounded on both).
 *
 * Reduction order of a row sum (RMSNorm's sum of squares and backward dot product):
 *   A row of `cols` elements is cut into chunks of COAT_NORM_ACT_CHUNK = 8 consecutive elements (the last
 *   may be short), and the chunks are dealt to L = coat_rmsnorm_lanes(cols) lanes: chunk k belongs to lane
 *   k % L. Each lane starts from +0 and adds its terms one at a time, chunk by chunk in increasing k,
 *   element by element in increasing column. The L lane partials are then combined by
 *   coat_combine_lane_partials: pairwise within each group of 32 lanes (lane l += lane l + 16, + 8, + 4,
 *   + 2, + 1: a warp's xor butterfly), then pairwise across the L/32 group sums the same way.
 *   The CUDA kernel runs exactly L threads per row, one per lane; the C code replays the same order.
 *
 * Reduction order of RMSNorm's dweight (a sum over rows, per column):
 *   Rows are cut into slices of coat_rmsnorm_backward_rows_per_slice(rows, cols) consecutive rows. Within a
 *   slice, per column, terms are added one row at a time in increasing row order, starting from +0 (one
 *   row of the workspace per slice). Slice s then goes to phase s % 16; each phase adds its slices in
 *   increasing s from +0; the 16 phase sums are combined pairwise (phase p += phase p + 8, + 4, + 2, + 1).
 */
#ifndef COAT_DETAIL_NORM_ACT_MATH_H
#define COAT_DETAIL_NORM_ACT_MATH_H

#include <math.h>

#include "coat/detail/quantize_math.h"
#include "coat/norm_act.h"

/** Elements a thread loads at once: 16 bytes of bf16 / fp16 (two 16-byte loads of fp32). Every group size
 *  is a multiple of it, so a chunk never straddles two quantization groups. */
#define COAT_NORM_ACT_CHUNK 8
/** A lane of an RMSNorm row holds at most this many chunks, in registers. */
#define COAT_RMSNORM_MAX_CHUNKS_PER_LANE 4
#define COAT_RMSNORM_MAX_LANES 1024
/** Phases of the final dweight sum over slices (see above). */
#define COAT_DWEIGHT_PHASES 16


COAT_INLINE float coat_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

COAT_INLINE float coat_sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}

/* ------------------------------------------------------------------------------------------------ */
/* Reduction shapes                                                                                   */

/** L, the number of lanes (CUDA threads) that reduce one RMSNorm row: the smallest power of two >= 32
 *  that leaves each lane at most COAT_RMSNORM_MAX_CHUNKS_PER_LANE chunks, capped at 1024. It depends on
 *  cols only, so that the reduction order does too. */
COAT_INLINE int64_t coat_rmsnorm_lanes(int64_t cols) {
  const int64_t chunks = coat_ceil_div(cols, COAT_NORM_ACT_CHUNK);
  int64_t lanes = 32;
  while (lanes < COAT_RMSNORM_MAX_LANES && lanes * COAT_RMSNORM_MAX_CHUNKS_PER_LANE < chunks) lanes *= 2;
  return lanes;
}

/** Rows per dweight slice: enough slices that the backward kernel has ~64K threads (2048 warps) at work
 *  (L threads per slice, at least 128 slices), so it streams at full bandwidth, and no more, since each
 *  slice costs one fp32 row of workspace. */
COAT_INLINE int64_t coat_rmsnorm_backward_rows_per_slice(int64_t rows, int64_t cols) {
  int64_t max_slices = 65536 / coat_rmsnorm_lanes(cols);
  if (max_slices < 128) max_slices = 128;
  return rows <= max_slices ? 1 : coat_ceil_div(rows, max_slices);
}

COAT_INLINE int64_t coat_rmsnorm_backward_slices(int64_t rows, int64_t cols) {
  return coat_ceil_div(rows, coat_rmsnorm_backward_rows_per_slice(rows, cols));
}

/** Combines the per-lane partial sums of a row in the order of the file comment (overwrites `partials`).
 *  lanes = 32 * 2^k. This is what the CUDA kernels compute with warp butterflies. */
COAT_INLINE float coat_combine_lane_partials(float* partials, int64_t lanes) {
  for (int64_t base = 0; base < lanes; base += 32)
    for (int offset = 16; offset > 0; offset >>= 1)
      for (int lane = 0; lane < offset; ++lane)
        partials[base + lane] = partials[base + lane] + partials[base + lane + offset];
  for (int64_t offset = lanes / 64; offset > 0; offset >>= 1)
    for (int64_t group = 0; group < offset; ++group)
      partials[32 * group] = partials[32 * group] + partials[32 * (group + offset)];
  return partials[0];
}

/** Combines the COAT_DWEIGHT_PHASES phase sums of a dweight column (overwrites `phases`). */
COAT_INLINE float coat_combine_dweight_phases(float* phases) {
  for (int offset = COAT_DWEIGHT_PHASES / 2; offset > 0; offset >>= 1)
    for (int phase = 0; phase < offset; ++phase) phases[phase] = phases[phase] + phases[phase + offset];
  return phases[0];
}

/* ------------------------------------------------------------------------------------------------ */
/* RMSNorm                                                                                            */

/** rstd = 1 / sqrt(sum_sq / cols + eps). A row holding +-Inf (or squares that overflow) gets rstd = 0,
 *  as PyTorch's x * rsqrt(mean(x^2) + eps) does, and a NaN row gets NaN. */
COAT_INLINE float coat_rmsnorm_rstd(float sum_sq, int64_t cols, float eps) {
  return coat_div_rn(1.0f, coat_sqrt_rn(coat_div_rn(sum_sq, (float)cols) + eps));
}

/** The weight a norm multiplies by: the stored weight plus the offset (0, or 1 for Gemma's norms), in fp32. */
COAT_INLINE float coat_rmsnorm_weight(float weight, float weight_offset) { return weight + weight_offset; }

/** y = (x * rstd) * weight. A NaN result is made canonical (coat_canonical_nan) where it is quantized, the
 *  one place its sign would show; the amax ignores it. */
COAT_INLINE float coat_rmsnorm_apply(float x, float rstd, float weight) { return (x * rstd) * weight; }

/** An element of an FP8-saved input, decoded as coat_dequantize does (its NaN not yet canonical), as the
 *  backward and requantize entry points read it. */
COAT_INLINE float coat_saved_value(uint8_t code, float scale) { return coat_e4m3_to_f32(code) * scale; }

/** Backward of RMSNorm, per element: the normalized saved input. */
COAT_INLINE float coat_rmsnorm_xhat(uint8_t code, float scale, float rstd) {
  return coat_saved_value(code, scale) * rstd;
}

/** dx = (g - xhat * mean_dot) * rstd with g = dy * weight and mean_dot = (sum_c g * xhat) / cols. */
COAT_INLINE float coat_rmsnorm_dx(float g, float xhat, float mean_dot, float rstd) {
  return (g - xhat * mean_dot) * rstd;
}

/** dx plus the residual gradient, before the rounding to the residual's dtype: dx as it would be stored in
 *  dy's dtype (read back exactly), plus the residual, in one fp32 addition. */
COAT_INLINE float coat_rmsnorm_dx_plus_residual(float dx, coat_dtype dy_dtype, float residual) {
  switch (dy_dtype) {
    case COAT_BFLOAT16: return coat_bf16_to_f32(coat_f32_to_bf16(dx)) + residual;
    case COAT_FLOAT16: return coat_f16_to_f32(coat_f32_to_f16(dx)) + residual;
    default: return dx + residual;
  }
}

/* ------------------------------------------------------------------------------------------------ */
/* SiLU                                                                                               */

/** The core of coat_exp for a finite x: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two so that n * ln2_hi
 *  is exact), and p = e^r from a degree-7 polynomial; e^x = p * 2^n. Returns p, and n in *n. */
COAT_INLINE float coat_exp_reduced(float x, float* n) {
  *n = floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - *n * 0.693359375f;
  r = r - *n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r2 + r + 1.0f;
}

/** e^x from + - * and exact scalings only, so that the C and CUDA results are the same bits (libm expf
 *  and CUDA's expf differ in the last place). Cephes' expf: coat_exp_reduced, then two exact power-of-two
 *  scalings (2^n is split so that subnormal results are rounded once). Error below 1 ulp for normal results
 *  (tests/test_norm_act.py measures it); +Inf above 88.72, +0 below -103.28, NaN for NaN. */
COAT_INLINE float coat_exp(float x) {
  if (x != x) return x;
  if (x > 88.72283905206835f) return coat_f32_from_bits(0x7F800000u);
  if (x < -103.278929903431851103f) return 0.0f;
  float n;
  const float p = coat_exp_reduced(x, &n);
  const int exponent = (int)n;                 /* in [-150, 128] */
  const int first = exponent / 2, second = exponent - first; /* each in [-75, 64]: 2^k is a normal float */
  return (p * coat_f32_from_bits((uint32_t)(first + 127) << 23)) * coat_f32_from_bits((uint32_t)(second + 127) << 23);
}

/** sigmoid(g) = 1 / (1 + e^-g): 0 for g < -88.7 (and -Inf), 1 for g > 16.6. */
COAT_INLINE float coat_sigmoid(float g) { return coat_div_rn(1.0f, 1.0f + coat_exp(-g)); }

/* The activations act(g) = g * sigmoid(z(g)) (coat_activation in coat/norm_act.h):
 *   silu:       z = g
 *   gelu_tanh:  z = 2 sqrt(2/pi) (g + 0.044715 g^3), since 0.5 (1 + tanh(u)) = sigmoid(2u) exactly, so that
 *               0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) = g * sigmoid(z): tanh is coat_sigmoid's (built
 *               from coat_exp, the same bits in C and CUDA), and 1 + tanh(u) never cancels for negative g.
 *   quick_gelu: z = 1.702 g (1.702f, as transformers' QuickGELUActivation multiplies a float32 input). */

/** Whether `activation` is one of coat_activation's. */
COAT_INLINE int coat_is_valid_activation(coat_activation activation) {
  return activation == COAT_ACT_SILU || activation == COAT_ACT_GELU_TANH || activation == COAT_ACT_QUICK_GELU;
}

/** quick_gelu's factor: z(g) = 1.702f * g, and z'(g). */
#define COAT_QUICK_GELU_FACTOR 1.702f

/** gelu_tanh's z(g) = 1.5957691 * (g + 0.044715 * ((g * g) * g)) in fp32, in this order. g^3 overflowing gives
 *  z = +-Inf, sigmoid 1 or 0: the limits. */
COAT_INLINE float coat_gelu_tanh_arg(float g) { return 1.59576912160573071f * (g + 0.044715f * ((g * g) * g)); }

/** z(g) of the activation (above). */
COAT_INLINE float coat_activation_arg(coat_activation activation, float g) {
  if (activation == COAT_ACT_GELU_TANH) return coat_gelu_tanh_arg(g);
  return activation == COAT_ACT_QUICK_GELU ? COAT_QUICK_GELU_FACTOR * g : g;
}

/** sigmoid(z(g)), the factor act(g) = g * sigmoid(z(g)) applies to the gate. */
COAT_INLINE float coat_activation_sigmoid(coat_activation activation, float g) {
  return coat_sigmoid(coat_activation_arg(activation, g));
}

/** act(g) = g * sigmoid_gate, given sigmoid_gate = coat_activation_sigmoid(activation, gate); act(-Inf) =
 *  -Inf * 0 = NaN as in PyTorch (silu and gelu_tanh alike), act(+Inf) = +Inf, act(NaN) = NaN. */
COAT_INLINE float coat_silu(float gate, float sigmoid_gate) { return gate * sigmoid_gate; }

/** y = (act * up) * smooth, act = coat_silu(gate, ...). smooth is the Smooth-SwiGLU channel scale, 1
 *  without one (multiplying by 1 is exact). A NaN result is made canonical where it is quantized. */
COAT_INLINE float coat_silu_mul(float silu, float up, float smooth) { return (silu * up) * smooth; }

/** The gate the requantize op takes the activation of: the saved gate g' (coat_saved_value) rounded to the
 *  nearest bf16, ties to even (coat_f32_to_bf16: +-Inf stays +-Inf, a finite g' past the largest bf16 rounds to
 *  +-Inf, NaN stays NaN), so that the CUDA kernel reads act from the forward's table of act over bf16 gates. The
 *  rounding moves a finite g' (below the bf16 overflow) by at most half a bf16 ulp, under 2^-8 |g'|: 1/16 of
 *  the relative error, up to 2^-4, that saving the gate as E4M3 already allows (more for E4M3 subnormals). */
COAT_INLINE float coat_requantize_gate(uint8_t code, float scale) {
  return coat_bf16_to_f32(coat_f32_to_bf16(coat_saved_value(code, scale)));
}

/** The gate gelu_tanh's and quick_gelu's derivatives take, clamped to [-64, 64]: from |g| = 64 on, sigmoid(z(g))
 *  is exactly 1 (g > 0) or 0 (g < 0), and so is the derivative below, clamped or not, where the unclamped one does
 *  not overflow (g^2 past 2^128, or its product with g, gave Inf * 0 = NaN for large finite gates). +-Inf gates so
 *  get the limits 1 and 0; a NaN gate gives NaN through sigmoid(z(g)). */
COAT_INLINE float coat_activation_slope_gate(float g) { return fminf(fmaxf(g, -64.0f), 64.0f); }

/** The factors of coat_silu_mul_grads that depend on the gate alone: act = coat_silu(gate, s) and its
 *  derivative dact, with s = coat_activation_sigmoid(activation, gate):
 *    silu:       dact = s * (1 + gate * (1 - s))
 *    gelu_tanh:  dact = s * (1 + (c * (1 - s)) * z'(c)),  z'(c) = 1.5957691 * (1 + 0.134145 * (c * c)),
 *    quick_gelu: dact = s * (1 + (c * (1 - s)) * 1.702),  c = coat_activation_slope_gate(gate) in both
 *  which is d/dg [g * sigmoid(z(g))] = s + g s (1 - s) z'(g), for gelu_tanh 0.5 (1 + t) + 0.5 g (1 - t^2)
 *  sqrt(2/pi) (1 + 3 * 0.044715 g^2) with t = tanh(z / 2) = 2 s - 1. */
COAT_INLINE void coat_silu_grad_factors(coat_activation activation, float gate, float s, float* silu,
                                        float* dsilu) {
  *silu = coat_silu(gate, s);
  if (activation == COAT_ACT_GELU_TANH) {
    const float c = coat_activation_slope_gate(gate);
    *dsilu = s * (1.0f + (c * (1.0f - s)) * (1.59576912160573071f * (1.0f + 0.134145f * (c * c))));
  } else if (activation == COAT_ACT_QUICK_GELU) {
    *dsilu = s * (1.0f + (coat_activation_slope_gate(gate) * (1.0f - s)) * COAT_QUICK_GELU_FACTOR);
  } else {
    *dsilu = s * (1.0f + gate * (1.0f - s));
  }
}

/** coat_silu_mul_grads given the gate's factors (coat_silu_grad_factors):
 *  dup = (dy * smooth) * act, dgate = ((dy * smooth) * up) * dact. */
COAT_INLINE void coat_silu_mul_grads_of_factors(float dy, float up, float smooth, float silu, float dsilu,
                                                float* dgate, float* dup) {
  const float dy_s = dy * smooth;
  *dup = dy_s * silu;
  *dgate = (dy_s * up) * dsilu;
}

/** Gradients of coat_silu_mul at (gate, up) for the output gradient dy (see coat_silu_mul_backward_cpu);
 *  s = coat_activation_sigmoid(activation, gate). */
COAT_INLINE void coat_silu_mul_grads(coat_activation activation, float dy, float gate, float s, float up,
                                     float smooth, float* dgate, float* dup) {
  float silu, dsilu;
  coat_silu_grad_factors(activation, gate, s, &silu, &dsilu);
  coat_silu_mul_grads_of_factors(dy, up, smooth, silu, dsilu, dgate, dup);
}

#endif /* COAT_DETAIL_NORM_ACT_MATH_H */
