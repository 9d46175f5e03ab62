/*
 * Element-level steps of the FP8 AdamW optimizer and of dynamic range expansion: the C core's, also run by CUDA's
 * quantize_expanded and dequantize_expanded, which therefore compute the same values by construction, and by
 * CUDA's fp8_adamw_step for its per-group decoder (its element steps use hardware approximations instead; formulas
 * and tolerance in coat/adamw.h). Internal: not part of the C API.
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

/* --------------------------------------------------------------------------------- log2, exp2, tables */

/* log2 and exp2 are built from integer bit operations, +, -, * and fmaf on fp32 (no division), so that C and
 * CUDA evaluate them identically:
 *   log2 x = e + log2 m, x = 2^e * m with m in [1, 2). The top 5 bits of m's fraction pick c = 1 + i/32 from
 *     a 32-entry table holding 1/c rounded to fp32 (call it inv) and -log2(inv) correctly rounded; then
 *     r = m * inv - 1 is in [0, 1/32] (one rounding: fmaf) and log2 m = -log2(inv) + r * q(r), q a degree-2
 *     minimax fit of log2(1 + r) / r on [0, 1/32]: absolute error below 2^-27 (2^-28 fit).
 *   2^w = 2^n * 2^f with n = rint(w) (by adding and subtracting 1.5 * 2^23, which also leaves n in the low bits
 *     of the sum) and f = w - n in [-1/2, 1/2] (exact); 2^f = 1 + f * p(f), p a degree-4 minimax fit:
 *     relative error below 1.5e-7 (1.3 ulp) evaluated in fp32. */

/* c = 1 + i/32, i = 0..31: {1/c rounded to fp32, -log2 of that fp32 value rounded to fp32} */
#define COAT_LOG2_REDUCTION_TABLE \
  { \
    {0x1p+0f, 0x0p+0f}, {0x1.f07c2p-1f, 0x1.6bad2p-5f}, \
    {0x1.e1e1e2p-1f, 0x1.663f6ep-4f}, {0x1.d41d42p-1f, 0x1.08c588p-3f}, \
    {0x1.c71c72p-1f, 0x1.5c01a2p-3f}, {0x1.bacf92p-1f, 0x1.acf5dep-3f}, \
    {0x1.af286cp-1f, 0x1.fbc16ap-3f}, {0x1.a41a42p-1f, 0x1.24407ap-2f}, \
    {0x1.99999ap-1f, 0x1.49a784p-2f}, {0x1.8f9c18p-1f, 0x1.6e222p-2f}, \
    {0x1.861862p-1f, 0x1.91bba6p-2f}, {0x1.7d05f4p-1f, 0x1.b47ecp-2f}, \
    {0x1.745d18p-1f, 0x1.d6753cp-2f}, {0x1.6c16c2p-1f, 0x1.f7a854p-2f}, \
    {0x1.642c86p-1f, 0x1.0c105p-1f}, {0x1.5c9882p-1f, 0x1.1bf314p-1f}, \
    {0x1.555556p-1f, 0x1.2b8034p-1f}, {0x1.4e5e0ap-1f, 0x1.3abb4p-1f}, \
    {0x1.47ae14p-1f, 0x1.49a786p-1f}, {0x1.414142p-1f, 0x1.58482p-1f}, \
    {0x1.3b13b2p-1f, 0x1.66a008p-1f}, {0x1.3521dp-1f, 0x1.74b1fcp-1f}, \
    {0x1.2f684cp-1f, 0x1.82809cp-1f}, {0x1.29e412p-1f, 0x1.900e62p-1f}, \
    {0x1.24924ap-1f, 0x1.9d5d9ep-1f}, {0x1.1f7048p-1f, 0x1.aa708ep-1f}, \
    {0x1.1a7b96p-1f, 0x1.b7494ap-1f}, {0x1.15b1e6p-1f, 0x1.c3e9cap-1f}, \
    {0x1.111112p-1f, 0x1.d053f4p-1f}, {0x1.0c9714p-1f, 0x1.dc899ep-1f}, \
    {0x1.08421p-1f, 0x1.e88c6cp-1f}, {0x1.041042p-1f, 0x1.f45e06p-1f} \
  }

/* log2(1 + i/128), i = 0..127, correctly rounded to fp32: the fraction of log2 of a bf16 value. */
#define COAT_LOG2_BF16_TABLE \
  { \
    0x0p+0f, 0x1.6fe50cp-7f, 0x1.6e7968p-6f, 0x1.11cd1ep-5f, 0x1.6bad38p-5f, 0x1.c4dfacp-5f, \
    0x1.0eb38ap-4f, 0x1.3aa2fep-4f, 0x1.663f7p-4f, 0x1.918a16p-4f, 0x1.bc8424p-4f, 0x1.e72ec2p-4f, \
    0x1.08c588p-3f, 0x1.1dcd1ap-3f, 0x1.32ae9ep-3f, 0x1.476aap-3f, 0x1.5c01a4p-3f, 0x1.70742ep-3f, \
    0x1.84c2bep-3f, 0x1.98eddp-3f, 0x1.acf5e2p-3f, 0x1.c0db6cp-3f, 0x1.d49ee4p-3f, 0x1.e840bep-3f, \
    0x1.fbc16cp-3f, 0x1.0790aep-2f, 0x1.11307ep-2f, 0x1.1ac05cp-2f, 0x1.24407ap-2f, 0x1.2db11p-2f, \
    0x1.37124cp-2f, 0x1.406464p-2f, 0x1.49a784p-2f, 0x1.52dbep-2f, 0x1.5c01a4p-2f, 0x1.6518fep-2f, \
    0x1.6e221cp-2f, 0x1.771d2cp-2f, 0x1.800a56p-2f, 0x1.88e9c8p-2f, 0x1.91bba8p-2f, 0x1.9a8024p-2f, \
    0x1.a3376p-2f, 0x1.abe188p-2f, 0x1.b47ecp-2f, 0x1.bd0f2ep-2f, 0x1.c592fap-2f, 0x1.ce0a4ap-2f, \
    0x1.d6753ep-2f, 0x1.ded3fep-2f, 0x1.e726aap-2f, 0x1.ef6d68p-2f, 0x1.f7a856p-2f, 0x1.ffd79ap-2f, \
    0x1.03fda8p-1f, 0x1.0809dp-1f, 0x1.0c105p-1f, 0x1.10113cp-1f, 0x1.140cap-1f, 0x1.18028cp-1f, \
    0x1.1bf312p-1f, 0x1.1fde3ep-1f, 0x1.23c41ep-1f, 0x1.27a4cp-1f, 0x1.2b8034p-1f, 0x1.2f5688p-1f, \
    0x1.3327c6p-1f, 0x1.36f4p-1f, 0x1.3abb4p-1f, 0x1.3e7d94p-1f, 0x1.423b08p-1f, 0x1.45f3aap-1f, \
    0x1.49a784p-1f, 0x1.4d56a6p-1f, 0x1.510118p-1f, 0x1.54a6e8p-1f, 0x1.584822p-1f, 0x1.5be4dp-1f, \
    0x1.5f7dp-1f, 0x1.6310b8p-1f, 0x1.66a008p-1f, 0x1.6a2afap-1f, 0x1.6db196p-1f, 0x1.7133eap-1f, \
    0x1.74b1fep-1f, 0x1.782bdcp-1f, 0x1.7ba19p-1f, 0x1.7f1322p-1f, 0x1.82809ep-1f, 0x1.85ea0cp-1f, \
    0x1.894f74p-1f, 0x1.8cb0e4p-1f, 0x1.900e62p-1f, 0x1.9367f6p-1f, 0x1.96bdaep-1f, 0x1.9a0f8ep-1f, \
    0x1.9d5dap-1f, 0x1.a0a7eep-1f, 0x1.a3ee8p-1f, 0x1.a7315ep-1f, 0x1.aa709p-1f, 0x1.adac1ep-1f, \
    0x1.b0e412p-1f, 0x1.b41874p-1f, 0x1.b74948p-1f, 0x1.ba769cp-1f, 0x1.bda072p-1f, 0x1.c0c6d4p-1f, \
    0x1.c3e9cap-1f, 0x1.c7095ap-1f, 0x1.ca258ep-1f, 0x1.cd3e6ap-1f, 0x1.d053f6p-1f, 0x1.d3663cp-1f, \
    0x1.d6753ep-1f, 0x1.d98106p-1f, 0x1.dc899ap-1f, 0x1.df8f02p-1f, 0x1.e29142p-1f, 0x1.e59064p-1f, \
    0x1.e88c6cp-1f, 0x1.eb856p-1f, 0x1.ee7b48p-1f, 0x1.f16e28p-1f, 0x1.f45e08p-1f, 0x1.f74afp-1f, \
    0x1.fa34e2p-1f, 0x1.fd1be4p-1f \
  }

#define COAT_LOG2_Q0 0x1.715456p+0f
#define COAT_LOG2_Q1 -0x1.71236ap-1f
#define COAT_LOG2_Q2 0x1.d705aep-2f

#define COAT_EXP2_P0 0x1.62e42ap-1f
#define COAT_EXP2_P1 0x1.ebf9bcp-3f
#define COAT_EXP2_P2 0x1.c6b752p-5f
#define COAT_EXP2_P3 0x1.3cea88p-7f
#define COAT_EXP2_P4 0x1.5bba14p-10f

/* 1.5 * 2^23: w + it - it rounds w to an integer (ties to even) for |w| < 2^22, and the low 23 bits of w + it
 * are 2^22 + rint(w), so (bits(w + it) << 23) is rint(w) << 23 modulo 2^32. */
#define COAT_ROUND_MAGIC 12582912.0f

typedef struct {
  float inverse; /* 1/c rounded */
  float log2;    /* -log2(inverse) */
} coat_log2_entry;

/* What the element functions look up. The CPU builds it per call, each CUDA block in shared memory; both with
 * coat_adamw_tables_fill_fp8's arithmetic, so the entries are the same bits. */
/* An FP8 code for dequantization: decode(code) = factor * 2^log2 for finite nonzero codes (factor = +-1, the
 * code's sign); log2 = 0 and factor = decode(code) itself (+-0, +-Inf, NaN) for the others, so that
 * factor * 2^(anything finite) is decode(code)'s result in every case. */
typedef struct {
  float log2;
  float factor;
} coat_fp8_entry;

typedef struct {
  coat_fp8_entry fp8[2][256]; /* [format][code] */
  float fp8_value[2][256];    /* [format][code]: decode(code) */
  coat_log2_entry reduction[32];
  float bf16_log2[128]; /* log2(1 + i/128) */
} coat_adamw_tables;

COAT_INLINE float coat_log2_q(float r) { return fmaf(fmaf(COAT_LOG2_Q2, r, COAT_LOG2_Q1), r, COAT_LOG2_Q0); }

/* 2^f for f in [-1/2, 1/2]. */
COAT_INLINE float coat_exp2_reduced(float f) {
  const float p =
      fmaf(fmaf(fmaf(fmaf(COAT_EXP2_P4, f, COAT_EXP2_P3), f, COAT_EXP2_P2), f, COAT_EXP2_P1), f, COAT_EXP2_P0);
  return fmaf(f, p, 1.0f);
}

/* log2 x = exponent + fraction, fraction in [0, 1) up to ~2^-27, for a finite x > 0 (subnormals included). The
 * integer part is kept apart so that callers can subtract two logarithms without cancellation. */
typedef struct {
  int exponent;
  float fraction;
} coat_log2_parts;

COAT_INLINE coat_log2_parts coat_log2_split(float x, const coat_adamw_tables* t) {
  coat_log2_parts result;
  uint32_t a = coat_f32_to_bits(x) & 0x7FFFFFFFu;
  const int subnormal = a < 0x00800000u; /* then scale by 2^24, exact */
  a = subnormal ? coat_f32_to_bits(coat_f32_from_bits(a) * 16777216.0f) : a;
  result.exponent = (int)(a >> 23) - (subnormal ? 127 + 24 : 127);
  const coat_log2_entry e = t->reduction[(a >> 18) & 31u];
  const float r = fmaf(coat_f32_from_bits((a & 0x007FFFFFu) | 0x3F800000u), e.inverse, -1.0f);
  result.fraction = fmaf(r, coat_log2_q(r), e.log2);
  return result;
}

/* log2 of a positive normal bf16 value v (on the bf16 grid), split: its exponent and log2(1 + m/128) from the
 * table, correctly rounded. */
COAT_INLINE coat_log2_parts coat_log2_bf16(float v, const coat_adamw_tables* t) {
  const uint32_t bits = coat_f32_to_bits(v);
  coat_log2_parts result;
  result.exponent = (int)(bits >> 23) - 127;
  result.fraction = t->bf16_log2[(bits >> 16) & 127u];
  return result;
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

/* 2^(exponent + w) for a finite |w| < 2^22, rounded once from 2^exponent * 2^f * 2^rint(w). */
COAT_INLINE float coat_exp2_split(int exponent, float w) {
  const float rounded = (w + COAT_ROUND_MAGIC) - COAT_ROUND_MAGIC;
  return coat_scale_by_power_of_2(coat_exp2_reduced(w - rounded), exponent + (int)rounded);
}

/* 2^w for |w| <= 125: 2^f * 2^rint(w) with 2^rint(w) put in the exponent field (the result is normal), the same
 * value as coat_exp2_split(0, w). */
COAT_INLINE float coat_exp2_normal(float w) {
  const float shifted = w + COAT_ROUND_MAGIC;
  const float rounded = shifted - COAT_ROUND_MAGIC;
  return coat_f32_from_bits(coat_f32_to_bits(coat_exp2_reduced(w - rounded)) + (coat_f32_to_bits(shifted) << 23));
}

/* Entry i of the FP8 tables, i in [0, 512): format i / 256, code i % 256 (needs t->reduction). */
COAT_INLINE void coat_adamw_tables_fill_fp8(coat_adamw_tables* t, int i) {
  const coat_fp8_format format = (coat_fp8_format)(i >> 8);
  const uint8_t code = (uint8_t)(i & 255);
  const float d = coat_fp8_to_f32(code, format);
  coat_fp8_entry e;
  e.log2 = 0.0f;
  e.factor = d;
  if (d == d && d != 0.0f && fabsf(d) < coat_positive_infinity()) {
    const coat_log2_parts l = coat_log2_split(d, t);
    e.log2 = (float)l.exponent + l.fraction;
    e.factor = copysignf(1.0f, d);
  }
  t->fp8[format][code] = e;
  t->fp8_value[format][code] = d;
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

/* A group's stored meta, values on the bf16 grid. */
typedef struct {
  float scale;
  float k;
  float c;
} coat_meta;

COAT_INLINE coat_meta coat_meta_load(const uint16_t* meta) {
  coat_meta m;
  m.scale = coat_bf16_to_f32(meta[0]);
  m.k = coat_bf16_to_f32(meta[1]);
  m.c = coat_bf16_to_f32(meta[2]);
  return m;
}

/* The values are on the bf16 grid (finite, rounded before use): their bf16 bits are their top 16 bits. */
COAT_INLINE void coat_meta_store(coat_meta m, uint16_t* meta) {
  meta[0] = (uint16_t)(coat_f32_to_bits(m.scale) >> 16);
  meta[1] = (uint16_t)(coat_f32_to_bits(m.k) >> 16);
  meta[2] = (uint16_t)(coat_f32_to_bits(m.c) >> 16);
}

COAT_INLINE float coat_log2_range(coat_fp8_format format) {
  return format == COAT_E4M3 ? COAT_E4M3_LOG2_RANGE : COAT_E5M2_LOG2_RANGE;
}

/* log2 FP8_MAX: log2(448) and log2(57344), rounded to fp32 */
COAT_INLINE float coat_log2_fp8_max(coat_fp8_format format) {
  return format == COAT_E4M3 ? 8.80735492f : 15.8073549f;
}

/* What quantization derives from a group's meta, once per group. With k != 1, an element x is encoded from
 *   z = k * log2(|x| / C) - log2(scale) = fmaf(k, d, -log2(scale)),
 *   d = (e - e_C) + (log2(m) - frac_C)     (log2 |x| = e + log2 m, log2 C = e_C + frac_C)
 * so that the integer parts cancel exactly before the fractions are rounded. */
typedef struct {
  int linear;          /* k == 1: y = x / C and code = fp8(y / scale), in the linear domain */
  float scale;
  float k;
  float c;
  float exponent_bias; /* 2^23 + 127 + e_C: bits 0x4B000000 | biased exponent of x, as a float, minus this is e - e_C */
  float fraction_c;    /* frac_C */
  float minus_log2_scale;
} coat_encoder;

/* The encoder of meta m, given log2 C (split, coat_log2_bf16(m.c)). */
COAT_INLINE coat_encoder coat_encoder_of(coat_meta m, coat_log2_parts lc, const coat_adamw_tables* t) {
  coat_encoder e;
  e.linear = m.k == 1.0f;
  e.scale = m.scale;
  e.k = m.k;
  e.c = m.c;
  const coat_log2_parts ls = coat_log2_bf16(m.scale, t);
  e.exponent_bias = 8388608.0f + (float)(127 + lc.exponent);
  e.fraction_c = lc.fraction;
  e.minus_log2_scale = -((float)ls.exponent + ls.fraction);
  return e;
}

/* d = log2(|x| / C) (see coat_encoder) from a = |x|'s bits, a normal number; exponent_bias as in coat_encoder
 * (plus 24 when a was scaled up from a subnormal by 2^24). */
COAT_INLINE float coat_log2_ratio(uint32_t a, float exponent_bias, float fraction_c, const coat_adamw_tables* t) {
  const float e = coat_f32_from_bits(0x4B000000u | (a >> 23)) - exponent_bias; /* exact */
  const coat_log2_entry entry = t->reduction[(a >> 18) & 31u];
  const float r = fmaf(coat_f32_from_bits((a & 0x007FFFFFu) | 0x3F800000u), entry.inverse, -1.0f);
  return fmaf(r, coat_log2_q(r), e + (entry.log2 - fraction_c));
}

/* coat_log2_ratio for any finite nonzero a (subnormals scaled up by 2^24 first, exactly). */
COAT_INLINE float coat_log2_ratio_any(uint32_t a, float exponent_bias, float fraction_c, const coat_adamw_tables* t) {
  if (a < 0x00800000u) {
    a = coat_f32_to_bits(coat_f32_from_bits(a) * 16777216.0f);
    exponent_bias += 24.0f;
  }
  return coat_log2_ratio(a, exponent_bias, fraction_c, t);
}

/* The FP8 code magnitude of 2^z, z in [z_min, z_max] (coat_fp8_log_format), by round to nearest even:
 * y = 2^z is built as an fp32 (2^f * 2^rint(z), normal), then rounded to the FP8 quantum of its binade by
 * adding 1.5 * 2^23 quanta (the sum's ulp is the quantum), which counts quanta exactly. */
typedef struct {
  float z_min;              /* log2 FP8_MIN_SUBNORMAL: smaller values get the smallest code (no flush to zero) */
  float z_max;              /* below log2 of the midpoint between FP8_MAX and the next code: larger values saturate */
  uint32_t min_exponent;    /* biased fp32 exponent of FP8_MIN_NORMAL */
  uint32_t magic_offset;    /* (23 - mantissa_bits) << 23 */
  uint32_t code_multiplier; /* 2^mantissa_bits - 2^23 (mod 2^32) */
  uint32_t code_offset;     /* -((23 - mantissa_bits) << 23) - (min_exponent << mantissa_bits) (mod 2^32) */
} coat_fp8_log_format;

COAT_INLINE coat_fp8_log_format coat_fp8_log_format_of(coat_fp8_format format) {
  coat_fp8_log_format f;
  uint32_t mantissa_bits;
  if (format == COAT_E4M3) {
    f.z_min = -9.0f;
    f.z_max = 8.85f; /* 2^8.85 = 461.4: 448 is the nearest code up to 464 */
    f.min_exponent = 127u - 6u;
    mantissa_bits = 3u;
  } else {
    f.z_min = -16.0f;
    f.z_max = 15.85f; /* 2^15.85 = 59222: 57344 is the nearest code up to 59392 */
    f.min_exponent = 127u - 14u;
    mantissa_bits = 2u;
  }
  f.magic_offset = (23u - mantissa_bits) << 23;
  f.code_multiplier = (1u << mantissa_bits) - (1u << 23);
  f.code_offset = 0u - f.magic_offset - (f.min_exponent << mantissa_bits);
  return f;
}

COAT_INLINE uint32_t coat_fp8_magnitude_of_log2(float z, const coat_fp8_log_format* f) {
  const float shifted = z + COAT_ROUND_MAGIC;
  const float rounded = shifted - COAT_ROUND_MAGIC;
  const uint32_t y = coat_f32_to_bits(coat_exp2_reduced(z - rounded)) + (coat_f32_to_bits(shifted) << 23);
  const uint32_t exponent = y >> 23;
  const uint32_t binade = exponent > f->min_exponent ? exponent : f->min_exponent;
  /* magic = 2^(binade - 127 + 23 - mantissa_bits): its ulp is the FP8 quantum of y's binade */
  const uint32_t magic = (binade << 23) + f->magic_offset;
  const uint32_t sum = coat_f32_to_bits(coat_f32_from_bits(y) + coat_f32_from_bits(magic));
  /* code = (sum - magic) + ((binade - min_exponent) << mantissa_bits), as one multiply-add */
  return binade * f->code_multiplier + f->code_offset + sum;
}

/* The fresh meta of a group with the given range (coat/adamw.h), each value rounded to bf16 before the next
 * is derived from it, and its encoder. */
COAT_INLINE coat_encoder coat_encoder_of_range(coat_range r, coat_fp8_format format, int expand,
                                               const coat_adamw_tables* t, coat_meta* meta) {
  coat_meta m;
  m.k = 1.0f;
  m.c = 1.0f;
  coat_log2_parts high;
  high.exponent = 0;
  high.fraction = 0.0f;
  if (expand && r.amax > 0.0f) {
    const float mean = coat_round_bf16(sqrtf(r.amin) * sqrtf(r.amax));
    if (mean >= COAT_MIN_SCALE && mean <= coat_bf16_max()) {
      const coat_log2_parts low = coat_log2_split(r.amin, t);
      high = coat_log2_split(r.amax, t);
      const float log2_range = (float)(high.exponent - low.exponent) + (high.fraction - low.fraction);
      m.c = mean;
      if (log2_range > 0.0f)
        m.k = coat_round_bf16(
            fminf(fmaxf(coat_log2_range(format) / log2_range, COAT_EXPANSION_K_MIN), COAT_EXPANSION_K_MAX));
    }
  }
  const coat_log2_parts lc = coat_log2_bf16(m.c, t);
  float scale;
  if (m.k == 1.0f) {
    scale = r.amax / m.c / coat_fp8_max(format);
  } else {
    /* max|y| / FP8_MAX = 2^(k * log2(amax / C) - log2 FP8_MAX), the exponent rounded once (fmaf);
     * |k * log2(amax / C)| < 70 (coat/adamw.h, the clamp of k) */
    const float log2_ratio = (float)(high.exponent - lc.exponent) + (high.fraction - lc.fraction);
    scale = coat_exp2_normal(fmaf(m.k, log2_ratio, -coat_log2_fp8_max(format)));
  }
  m.scale = coat_round_bf16_up(fmaxf(scale, COAT_MIN_SCALE));
  *meta = m;
  return coat_encoder_of(m, lc, t);
}

/* code = fp8(sign(x) * (|x| / C)^k / scale), where a nonzero x that rounds to +-0 gets the smallest subnormal
 * code of its sign instead (adamw.h says why). Non-finite x gives the positive NaN code 0x7F whatever its sign:
 * the sign of a NaN that arithmetic produces is the platform's (x86 keeps or sets it, CUDA clears it), and a
 * signed NaN code would let CPU and CUDA drift apart one step later.
 * k != 1: z = fmaf(k, d, -log2 scale) clamped to [z_min, z_max], then coat_fp8_magnitude_of_log2: the division
 * by the stored scale happens in the log domain. k == 1: fp8((x / C) / scale) in the linear domain. */
COAT_INLINE uint8_t coat_encode_linear(float x, const coat_encoder* e, coat_fp8_format format) {
  const uint8_t code = coat_f32_to_fp8(copysignf(fabsf(x) / e->c, x) / e->scale, format);
  return (code & 0x7Fu) ? code : (uint8_t)(code | 1u);
}

COAT_INLINE uint8_t coat_encode(float x, const coat_encoder* e, const coat_fp8_log_format* f, coat_fp8_format format,
                                const coat_adamw_tables* t) {
  const uint32_t bits = coat_f32_to_bits(x);
  uint32_t a = bits & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return 0x7Fu;
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
  if (a == 0u) return sign;
  if (e->linear) return coat_encode_linear(x, e, format);
  const float z = fmaf(e->k, coat_log2_ratio_any(a, e->exponent_bias, e->fraction_c, t), e->minus_log2_scale);
  return (uint8_t)(sign | coat_fp8_magnitude_of_log2(fminf(fmaxf(z, f->z_min), f->z_max), f));
}

/* What dequantization derives from a group's meta, once per group. With k != 1,
 *   x' = sign * C * (|decode(code)| * scale)^(1/k) = sign * 2^(exponent + fmaf(L, inverse_k, fraction))
 * with L = log2 |decode(code)| from the table, inverse_k = 1/k, and exponent + fraction = log2 C +
 * log2(scale) / k split so that the fraction stays small (|fraction| < 4) and the sum is rounded only once
 * per element, in fmaf. */
typedef struct {
  int linear; /* k == 1: x' = C * (|decode(code)| * scale) */
  float scale;
  float c;
  float inverse_k;
  float fraction;
  int exponent;
  int fast_scaling; /* every finite nonzero code's result 2^n * 2^f has n in [-125, 127] (CUDA's fast path) */
} coat_decoder;

COAT_INLINE coat_decoder coat_decoder_make(coat_meta m, coat_fp8_format format, const coat_adamw_tables* t) {
  coat_decoder d;
  d.linear = m.k == 1.0f;
  d.scale = m.scale;
  d.c = m.c;
  d.inverse_k = 1.0f / m.k;
  const coat_log2_parts lc = coat_log2_bf16(m.c, t);
  const coat_log2_parts ls = coat_log2_bf16(m.scale, t);
  /* log2(scale) / k = (e_s + f_s) * inverse_k: e_s * inverse_k exactly as hi + lo (fmaf), its integer part
   * moved to the exponent */
  const float es = (float)ls.exponent;
  const float hi = es * d.inverse_k;
  const float lo = fmaf(es, d.inverse_k, -hi);
  const float hi_int = (hi + COAT_ROUND_MAGIC) - COAT_ROUND_MAGIC;
  d.fraction = (hi - hi_int) + (lo + fmaf(ls.fraction, d.inverse_k, lc.fraction));
  const float exponent = (float)lc.exponent + hi_int; /* exact */
  d.exponent = (int)exponent;
  /* n = exponent + rint(w) for w = fmaf(log2, inverse_k, fraction), monotone in log2: the smallest and largest
   * finite nonzero codes bound it (the other codes have log2 = 0, in between), and rint(w) >= m for w >= m */
  const uint8_t largest = format == COAT_E4M3 ? 0x7Eu : 0x7Bu;
  const float w_low = fmaf(t->fp8[format][1].log2, d.inverse_k, d.fraction);
  const float w_high = fmaf(t->fp8[format][largest].log2, d.inverse_k, d.fraction);
  d.fast_scaling = !d.linear && w_low >= -125.0f - exponent && w_high <= 127.0f - exponent;
  return d;
}

/* x' = sign * C * (|decode(code)| * scale)^(1/k) (see coat_decoder), as factor * 2^(exponent + fmaf(log2,
 * inverse_k, fraction)) with the code's coat_fp8_entry. Zero codes decode to +-0, NaN codes to NaN, Inf codes
 * (E5M2) to +-Inf. */
COAT_INLINE float coat_decode(uint8_t code, const coat_decoder* d, coat_fp8_format format,
                              const coat_adamw_tables* t) {
  if (d->linear) return d->c * (t->fp8_value[format][code] * d->scale); /* the sign of the product is the code's */
  const coat_fp8_entry e = t->fp8[format][code];
  if (fabsf(e.factor) != 1.0f) return e.factor; /* zero, Inf, NaN */
  return coat_exp2_split(d->exponent, fmaf(e.log2, d->inverse_k, d->fraction)) * e.factor;
}

/* ------------------------------------------------------------------------------------------- the step */

/* a / b for a fixed divisor b (bias_correction2_sqrt), rounded as IEEE division rounds it, without a division
 * per element when b is in [2^-60, 1]: with y = 1/b correctly rounded, q0 = a * y is within an ulp of a / b,
 * r = a - q0 * b is exact (fmaf), and q0 + r * y (fmaf) is the correctly rounded quotient (Markstein's
 * theorem; there the quotient of a >= 0 by b neither overflows nor, with a = sqrt(v) >= 2^-75 or 0, leaves the
 * normal range; checked exhaustively on the CPU for every fp32 a in [2^-75, 2^66) and 11 divisors). +Inf
 * gives +Inf, NaN gives NaN, like the division; -0 gives +0, which the caller's + eps cannot tell apart. */
typedef struct {
  float b;
  float inverse;
  int exact_by_inverse; /* b in [2^-60, 1] */
} coat_divisor;

COAT_INLINE coat_divisor coat_divisor_make(float b) {
  coat_divisor d;
  d.b = b;
  d.inverse = 1.0f / b;
  d.exact_by_inverse = b >= 0x1p-60f && b <= 1.0f;
  return d;
}

/* coat_divide when d->exact_by_inverse. */
COAT_INLINE float coat_divide_by_inverse(float a, const coat_divisor* d) {
  const float q0 = a * d->inverse;
  const float q = fmaf(fmaf(-q0, d->b, a), d->inverse, q0);
  return a == coat_positive_infinity() ? a : q;
}

COAT_INLINE float coat_divide(float a, const coat_divisor* d) {
  return d->exact_by_inverse ? coat_divide_by_inverse(a, d) : a / d->b;
}

/* One element of the step, in torch.optim.AdamW's order of operations; m and v are the dequantized states.
 * sqrt(v) / bias_correction2_sqrt by coat_divide: the same value as the division. */
COAT_INLINE float coat_adamw_update(float p, float g, float* m, float* v, const coat_adamw_options* o,
                                    const coat_divisor* bias_correction2_sqrt) {
  *m = o->beta1 * *m + o->one_minus_beta1 * g;
  *v = o->beta2 * *v + o->one_minus_beta2 * g * g;
  p = p * o->decay_factor;
  const float denom = coat_divide(sqrtf(*v), bias_correction2_sqrt) + o->eps;
  return p - o->step_size * *m / denom;
}

/* coat_adamw_update when bias_correction2_sqrt->exact_by_inverse (the same value). */
COAT_INLINE float coat_adamw_update_by_inverse(float p, float g, float* m, float* v, const coat_adamw_options* o,
                                               const coat_divisor* bias_correction2_sqrt) {
  *m = o->beta1 * *m + o->one_minus_beta1 * g;
  *v = o->beta2 * *v + o->one_minus_beta2 * g * g;
  p = p * o->decay_factor;
  const float denom = coat_divide_by_inverse(sqrtf(*v), bias_correction2_sqrt) + o->eps;
  return p - o->step_size * *m / denom;
}

/* A parameter is float32 or bfloat16; bf16 rounds to nearest even. */
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

/* The 16 random bits of element `index` under stochastic rounding (coat/adamw.h): Wellons' lowbias32 hash of a
 * 32-bit word mixed from the seed and the index. 32-bit integer operations only (a 64-bit hash per element cost
 * the GPU step a quarter of its time). The index enters by addition to the seed's low word, so a shard whose
 * first element has global index o draws the unsharded tensor's bits when its seed's low word is raised by o. */
COAT_INLINE uint32_t coat_rounding_bits(uint64_t seed, int64_t index) {
  const uint64_t i = (uint64_t)index;
  uint32_t x = ((uint32_t)i + (uint32_t)seed) ^ (uint32_t)(seed >> 32) ^ ((uint32_t)(i >> 32) * 0x9E3779B9u);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x >> 16;
}

/* x rounded to a bf16 stochastically with the 16 random bits r: the dropped fraction plus r carries into the
 * kept bits with probability fraction / 2^16. NaN and +-Inf go through coat_f32_to_bf16 (canonical NaN). */
COAT_INLINE uint16_t coat_f32_to_bf16_stochastic(float x, uint32_t r) {
  const uint32_t u = coat_f32_to_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return coat_f32_to_bf16(x);
  return (uint16_t)((u + r) >> 16);
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

/* coat_moment_counts (coat/adamw.h): the checks of one state. */
COAT_INLINE int coat_moment_state_is_valid(const coat_moment_state* s) {
  return s->rows >= 1 && s->cols >= 1 && s->measured_rows >= 1 && coat_is_valid_format(s->format) &&
         s->codes != NULL && s->meta != NULL && s->counts != NULL && s->k_keys != NULL && s->key_prefix >= 0 &&
         s->key_prefix <= 0x7FFF && (s->row_index != NULL || s->measured_rows == s->rows);
}

/* coat_moment_counts (coat/adamw.h): one measured element's counts, with the decoder of its group. */
COAT_INLINE void coat_moment_count_element(uint8_t code, const coat_decoder* d, coat_fp8_format format,
                                           const coat_adamw_tables* t, uint64_t* nonfinite, uint64_t* zero_codes,
                                           uint32_t* amax_bits) {
  const float x = coat_decode(code, d, format, t);
  if (coat_is_finite(x)) {
    const uint32_t magnitude = coat_f32_to_bits(x) & 0x7FFFFFFFu;
    *amax_bits = magnitude > *amax_bits ? magnitude : *amax_bits;
  } else {
    ++*nonfinite;
  }
  *zero_codes += (code & 0x7Fu) == 0;
}

/* coat_moment_counts: the k key of a group (coat/adamw.h), and its counts [5..8]. */
COAT_INLINE uint32_t coat_moment_count_group(uint16_t k_bits, uint64_t* not_one, uint64_t* nan,
                                             uint32_t* min_key_inverse, uint32_t* max_key) {
  const uint32_t key = COAT_ORDERED_BF16((uint32_t)k_bits);
  const int is_nan = (k_bits & 0x7FFFu) > 0x7F80u;
  *not_one += k_bits != 0x3F80u; /* bf16 1.0 */
  *nan += is_nan;
  if (!is_nan) {
    *min_key_inverse = 0xFFFFu - key > *min_key_inverse ? 0xFFFFu - key : *min_key_inverse;
    *max_key = key > *max_key ? key : *max_key;
  }
  return key;
}

/* coat_moment_stats: one state's row of stats from its counts and the key of its median k. */
COAT_INLINE void coat_moment_stats_row(const uint64_t* counts, int32_t median_key, double* stats) {
  const double nan = (double)coat_f32_from_bits(0x7FC00000u);
  const int any_nan = counts[6] > 0;
  stats[0] = (double)counts[0];
  stats[1] = (double)counts[1];
  stats[2] = (double)counts[2];
  stats[3] = (double)coat_f32_from_bits((uint32_t)counts[3]);
  stats[4] = any_nan ? nan : (double)coat_bf16_to_f32((uint16_t)COAT_BF16_OF_ORDERED(0xFFFFu - (uint32_t)counts[7]));
  stats[5] = any_nan ? nan : (double)coat_bf16_to_f32((uint16_t)COAT_BF16_OF_ORDERED((uint32_t)median_key & 0xFFFFu));
  stats[6] = any_nan ? nan : (double)coat_bf16_to_f32((uint16_t)COAT_BF16_OF_ORDERED((uint32_t)counts[8]));
  stats[7] = (double)counts[5] / (double)counts[4];
}

#endif /* COAT_DETAIL_ADAMW_MATH_H */
