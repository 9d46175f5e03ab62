/*
 * Element-level steps of the FP8 AdamW optimizer and of dynamic range expansion, shared by the C and CUDA
 * implementations so that both compute the same values by construction (formulas in coat/adamw.h).
 * Internal: not part of the C API.
 *
 * Only IEEE-exact operations are used: integer bit operations, +, -, *, /, sqrtf, fmaf, fminf / fmaxf and
 * copysignf, which C99 (not contracted into FMA) and CUDA (-fmad=false -prec-div=true -prec-sqrt=true
 * -ftz=false) round identically. log2 and exp2 are therefore written here rather than taken from libm.
 */
#ifndef COAT_DETAIL_ADAMW_MATH_H
#define COAT_DETAIL_ADAMW_MATH_H

#include <math.h>
#include <stddef.h>

#include "coat/adamw.h"
#include "coat/detail/quantize_math.h"

/* The clamp of k; coat/adamw.h says why these bounds. */
#define COAT_EXPANSION_K_MIN 0.5f
#define COAT_EXPANSION_K_MAX 64.0f
/* log2(FP8_MAX / FP8_MIN_SUBNORMAL): log2(448 * 2^9) and log2(57344 * 2^16) */
#define COAT_E4M3_LOG2_RANGE 17.807354f
#define COAT_E5M2_LOG2_RANGE 31.807354f

/* bf16 values of meta per group: scale, k, C. */
#define COAT_META_VALUES 3

COAT_INLINE float coat_positive_infinity(void) { return coat_f32_from_bits(0x7F800000u); }

/* The largest finite bf16, 0x7F7F: about 3.39e38. */
COAT_INLINE float coat_bf16_max(void) { return coat_f32_from_bits(0x7F7F0000u); }

COAT_INLINE int coat_is_finite(float x) { return (coat_f32_to_bits(x) & 0x7F800000u) != 0x7F800000u; }

/* x rounded to the nearest bf16 (ties to even), as a float. */
COAT_INLINE float coat_round_bf16(float x) { return coat_bf16_to_f32(coat_f32_to_bf16(x)); }

/* Finite x >= 0 rounded up to a bf16, as a float. */
COAT_INLINE float coat_round_bf16_up(float x) {
  uint32_t u = coat_f32_to_bits(x);
  if (u & 0xFFFFu) u = (u | 0xFFFFu) + 1u;
  return coat_f32_from_bits(u);
}

/* ------------------------------------------------------------------------------------------ log2, exp2 */

/* log2 x = exponent + fraction with an integer exponent and fraction in [-1/2, 1/2]. Keeping the integer part
 * apart lets callers subtract two logarithms without the cancellation of subtracting two large floats. */
typedef struct {
  int exponent;
  float fraction;
} coat_log2_parts;

/* log2 of a finite x > 0, subnormals included, to ~2 ulp of the fraction. x = 2^e * m with m in
 * [sqrt(1/2), sqrt(2)], and log2 m = (2 / ln 2) * atanh(s) = (2 / ln 2) * (s + s^3/3 + ... + s^9/9) with
 * s = (m - 1) / (m + 1), |s| <= 0.1716: the first omitted term is below 2^-27 relative. m - 1 is exact, so
 * the fraction is accurate relative to itself even next to m = 1 (and exactly 0 there). */
COAT_INLINE coat_log2_parts coat_log2_split(float x) {
  coat_log2_parts result;
  uint32_t u = coat_f32_to_bits(x);
  result.exponent = -127;
  if (u < 0x00800000u) { /* subnormal: scale by 2^24, exact */
    u = coat_f32_to_bits(x * 16777216.0f);
    result.exponent -= 24;
  }
  result.exponent += (int)(u >> 23);
  u = (u & 0x007FFFFFu) | 0x3F800000u; /* m in [1, 2) */
  if (u > 0x3FB504F3u) {               /* m > sqrt(2): use m / 2 */
    u -= 0x00800000u;
    result.exponent += 1;
  }
  const float m = coat_f32_from_bits(u);
  const float s = (m - 1.0f) / (m + 1.0f);
  const float z = s * s;
  const float series = fmaf(fmaf(fmaf(fmaf(0.3205989f, z, 0.412198573f), z, 0.577078044f), z, 0.961796701f), z,
                            2.88539004f);
  result.fraction = s * series;
  return result;
}

COAT_INLINE float coat_log2(float x) {
  const coat_log2_parts l = coat_log2_split(x);
  return (float)l.exponent + l.fraction;
}

/* x * 2^n for a normal x, rounded once (musl's scalbnf steps: an intermediate never leaves the normal range
 * before the last product). */
COAT_INLINE float coat_scale_by_power_of_2(float x, int n) {
  const float two_127 = coat_f32_from_bits(0x7F000000u);
  const float two_minus_102 = coat_f32_from_bits(0x0C800000u); /* 2^-126 * 2^24 */
  if (n > 127) {
    x *= two_127;
    n -= 127;
    if (n > 127) {
      x *= two_127;
      n -= 127;
      if (n > 127) n = 127;
    }
  } else if (n < -126) {
    x *= two_minus_102;
    n += 102;
    if (n < -126) {
      x *= two_minus_102;
      n += 102;
      if (n < -126) n = -126;
    }
  }
  return x * coat_f32_from_bits((uint32_t)(127 + n) << 23);
}

/* 2^(exponent + w) to ~2 ulp, overflowing to Inf and underflowing through the subnormals to 0 only where
 * the exact value does. w = r + f with r the nearest integer and |f| <= 1/2, and 2^f = e^(f ln 2) by its
 * Taylor series to degree 7 (the first omitted term is below 2^-27). */
COAT_INLINE float coat_exp2_split(int exponent, float w) {
  if (!(w > -1024.0f)) return w != w ? w : 0.0f; /* NaN stays NaN; everything past -1024 is 0 */
  if (w > 1024.0f) return coat_positive_infinity();
  const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, ties to even */
  const float r = (w + round_magic) - round_magic;
  const float f = w - r; /* exact */
  const float series =
      fmaf(fmaf(fmaf(fmaf(fmaf(fmaf(1.52527336e-05f, f, 0.000154035297f), f, 0.00133335579f), f, 0.00961812865f),
                     f, 0.0555041097f),
                f, 0.240226507f),
           f, 0.693147182f);
  return coat_scale_by_power_of_2(fmaf(series, f, 1.0f), exponent + (int)r);
}

/* ------------------------------------------------------------------------------- group range, expansion */

/* The statistics expansion needs: amax over finite elements, amin over finite nonzero ones (+Inf if none). */
typedef struct {
  float amax;
  float amin;
} coat_range;

COAT_INLINE coat_range coat_range_empty(void) {
  coat_range r;
  r.amax = 0.0f;
  r.amin = coat_positive_infinity();
  return r;
}

COAT_INLINE coat_range coat_range_add(coat_range r, float x) {
  if (coat_is_finite(x)) {
    const float a = fabsf(x);
    r.amax = fmaxf(r.amax, a);
    if (a > 0.0f) r.amin = fminf(r.amin, a);
  }
  return r;
}

COAT_INLINE coat_range coat_range_merge(coat_range a, coat_range b) {
  a.amax = fmaxf(a.amax, b.amax);
  a.amin = fminf(a.amin, b.amin);
  return a;
}

/* A group's stored meta (values on the bf16 grid), plus what its codec derives from it once per group. */
typedef struct {
  float scale;
  float k;
  float c;
  float inverse_k;
  coat_log2_parts log2_c;
} coat_expansion;

COAT_INLINE coat_expansion coat_expansion_make(float scale, float k, float c) {
  coat_expansion e;
  e.scale = scale;
  e.k = k;
  e.c = c;
  e.inverse_k = 1.0f / k;
  e.log2_c = coat_log2_split(c);
  return e;
}

COAT_INLINE coat_expansion coat_expansion_load(const uint16_t* meta) {
  return coat_expansion_make(coat_bf16_to_f32(meta[0]), coat_bf16_to_f32(meta[1]), coat_bf16_to_f32(meta[2]));
}

COAT_INLINE void coat_expansion_store(const coat_expansion* e, uint16_t* meta) {
  meta[0] = coat_f32_to_bf16(e->scale);
  meta[1] = coat_f32_to_bf16(e->k);
  meta[2] = coat_f32_to_bf16(e->c);
}

/* |y| = (a / C)^k for a finite a > 0, as exp2(k * log2(a / C)) with log2(a / C) taken from the split
 * logarithms: exact integer difference plus a difference of two fractions in [-1/2, 1/2]. */
COAT_INLINE float coat_expanded_magnitude(float a, const coat_expansion* e) {
  if (e->k == 1.0f) return a / e->c;
  const coat_log2_parts l = coat_log2_split(a);
  const float log2_ratio = (float)(l.exponent - e->log2_c.exponent) + (l.fraction - e->log2_c.fraction);
  return coat_exp2_split(0, e->k * log2_ratio);
}

COAT_INLINE float coat_log2_range(coat_fp8_format format) {
  return format == COAT_E4M3 ? COAT_E4M3_LOG2_RANGE : COAT_E5M2_LOG2_RANGE;
}

/* (scale, k, C) of a group with the given range, each rounded to bf16 before the next is derived from it. */
COAT_INLINE coat_expansion coat_expansion_of_range(coat_range r, coat_fp8_format format, int expand) {
  float k = 1.0f;
  float c = 1.0f;
  if (expand && r.amax > 0.0f) {
    const float mean = coat_round_bf16(sqrtf(r.amin) * sqrtf(r.amax));
    if (mean >= COAT_MIN_SCALE && mean <= coat_bf16_max()) {
      const coat_log2_parts high = coat_log2_split(r.amax);
      const coat_log2_parts low = coat_log2_split(r.amin);
      const float log2_range = (float)(high.exponent - low.exponent) + (high.fraction - low.fraction);
      c = mean;
      if (log2_range > 0.0f)
        k = coat_round_bf16(
            fminf(fmaxf(coat_log2_range(format) / log2_range, COAT_EXPANSION_K_MIN), COAT_EXPANSION_K_MAX));
    }
  }
  coat_expansion e = coat_expansion_make(1.0f, k, c);
  const float ymax = r.amax > 0.0f ? coat_expanded_magnitude(r.amax, &e) : 0.0f;
  e.scale = coat_round_bf16_up(fmaxf(ymax / coat_fp8_max(format), COAT_MIN_SCALE));
  return e;
}

/* code = fp8(sign(x) * (|x| / C)^k / scale), where a nonzero x that rounds to +-0 gets the smallest subnormal
 * code of its sign instead (adamw.h says why). Non-finite x gives the positive NaN code 0x7F whatever its sign:
 * the sign of a NaN that arithmetic produces is the platform's (x86 keeps or sets it, CUDA clears it), and a
 * signed NaN code would let CPU and CUDA drift apart one step later. */
COAT_INLINE uint8_t coat_expanded_encode(float x, const coat_expansion* e, coat_fp8_format format) {
  if (!coat_is_finite(x)) return 0x7Fu;
  const float a = fabsf(x);
  if (!(a > 0.0f)) return coat_f32_to_fp8(x, format);
  const uint8_t code = coat_f32_to_fp8(copysignf(coat_expanded_magnitude(a, e), x) / e->scale, format);
  return (code & 0x7Fu) ? code : (uint8_t)(code | 1u);
}

/* x' = sign * C * (|decode(code)| * scale)^(1/k), the power as exp2(log2(C) + log2(t) / k) with log2(C)'s
 * integer part kept exact. Zero, NaN and Inf codes decode to themselves. */
COAT_INLINE float coat_expanded_decode(uint8_t code, const coat_expansion* e, coat_fp8_format format) {
  const float d = coat_fp8_to_f32(code, format);
  const float t = fabsf(d) * e->scale;
  if (!(t > 0.0f) || !coat_is_finite(d)) return d;
  if (e->k == 1.0f) return copysignf(e->c * t, d);
  const float w = e->log2_c.fraction + coat_log2(t) * e->inverse_k;
  return copysignf(coat_exp2_split(e->log2_c.exponent, w), d);
}

/* ------------------------------------------------------------------------------------------- the step */

/* One element of the step, in torch.optim.AdamW's order of operations; m and v are the dequantized states. */
COAT_INLINE float coat_adamw_update(float p, float g, float* m, float* v, const coat_adamw_options* o) {
  *m = o->beta1 * *m + o->one_minus_beta1 * g;
  *v = o->beta2 * *v + o->one_minus_beta2 * g * g;
  p = p * o->decay_factor;
  const float denom = sqrtf(*v) / o->bias_correction2_sqrt + o->eps;
  return p - o->step_size * *m / denom;
}

/* A parameter is float32 or bfloat16; bf16 rounds to nearest even. */
COAT_INLINE void coat_store_param(void* param, coat_dtype dtype, int64_t i, float value) {
  if (dtype == COAT_BFLOAT16)
    ((uint16_t*)param)[i] = coat_f32_to_bf16(value);
  else
    ((float*)param)[i] = value;
}

COAT_INLINE int coat_is_valid_format(coat_fp8_format format) { return format == COAT_E4M3 || format == COAT_E5M2; }

/* The cheap invariants of one tensor of a step call (sizes, pointers, dtypes). */
COAT_INLINE int coat_adamw_tensor_is_valid(const coat_adamw_tensor* t) {
  if (t->rows < 0 || t->cols < 0) return 0;
  if (t->rows * t->cols == 0) return 1;
  return t->param != NULL && t->grad != NULL && t->exp_avg != NULL && t->exp_avg_meta != NULL &&
         t->exp_avg_sq != NULL && t->exp_avg_sq_meta != NULL &&
         (t->param_dtype == COAT_FLOAT32 || t->param_dtype == COAT_BFLOAT16) &&
         (t->grad_dtype == COAT_FLOAT32 || t->grad_dtype == COAT_BFLOAT16 || t->grad_dtype == COAT_FLOAT16) &&
         coat_is_valid_format(t->exp_avg_format) && coat_is_valid_format(t->exp_avg_sq_format);
}

COAT_INLINE int coat_adamw_call_is_valid(const coat_adamw_tensor* tensors, int64_t count,
                                         const coat_adamw_options* options) {
  if (count < 0 || options == NULL || (tensors == NULL && count > 0) ||
      !coat_is_valid_group_size(options->group_size))
    return 0;
  for (int64_t i = 0; i < count; ++i)
    if (!coat_adamw_tensor_is_valid(&tensors[i])) return 0;
  return 1;
}

#endif /* COAT_DETAIL_ADAMW_MATH_H */
