// Device-side FP8 quantization of chunks of 8 values, and the rounding of results to 16-bit pairs, shared by the
// quantizers (quantize.cu) and the fused RMSNorm / SiLU*mul kernels (rmsnorm.cu, silu_mul.cu).
//
// coat's quantization (coat/detail/quantize_math.h) divides by the scale with IEEE rounding and encodes with
// coat's FP8 rules; compiled as written, that is an IEEE division (with its range check and slow-path branch)
// and a NaN / Inf fix-up per element. The forms below give the same bits on the values that occur in training,
// behind one test per chunk that sends every other chunk (a NaN or Inf value or quotient, an Inf scale, a scale
// below 2^-80) through coat_quantize_value itself. tools/cuda_emulation checks each against the C core.
#pragma once

#include <stdint.h>

#include "coat/detail/quantize_math.h"
#include "coat/fp8.h"

namespace coat {
namespace device {

/** Values a chunk holds: one 16-byte load of bf16 / fp16, two of fp32; 8 codes, one 8-byte store. */
constexpr int kCodeChunk = 8;

/** max(amax, |v|) with a NaN v ignored, as coat_amax_step: on the GPU one FMNMX, which returns the operand
 *  that is not NaN (amax never is). */
__device__ __forceinline__ float amax_step(float amax, float v) {
#ifdef __CUDA_ARCH__
  return fmaxf(amax, fabsf(v));
#else
  return coat_amax_step(amax, v);
#endif
}

/** 1 / d rounded to nearest, for 2^-126 <= d < 2^126 (exponent field 1 ... 252): the sequence ptxas emits for
 *  rcp.rn.f32 on sm_80 ... sm_120 (MUFU.RCP, one Newton step) without its range test and slow-path branch.
 *  Given an Inf d it returns NaN, which every caller sends to a slow path. */
__device__ __forceinline__ float reciprocal_of_normal(float d) {
#ifdef __CUDA_ARCH__
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return __fmaf_rn(y, __fmaf_rn(-d, y, 1.0f), y);
#else
  return 1.0f / d;
#endif
}

/** max(amax / divisor, 2^-126) for an amax >= 0 (not NaN), given inverse = 1 / divisor rounded to nearest, by
 *  their product and one Markstein correction. For the divisors coat uses (FP8_MAX of either format, E2M1's 6) it
 *  equals the IEEE division on every such float (tools/cuda_emulation checks them all). An Inf amax keeps its
 *  product, Inf. */
__device__ __forceinline__ float scale_by_inverse(float amax, float divisor, float inverse) {
  const float q = amax * inverse;
  const float corrected = __fmaf_rn(__fmaf_rn(-q, divisor, amax), inverse, q);
  return fmaxf(amax < INFINITY ? corrected : q, COAT_MIN_SCALE);
}

/** coat_scale_from_amax(amax, kFormat) = max(amax / FP8_MAX, 2^-126) for an amax >= 0 (not NaN). */
template <coat_fp8_format kFormat>
__device__ __forceinline__ float scale_from_amax(float amax) {
  constexpr float kMax = kFormat == COAT_E4M3 ? COAT_E4M3_MAX : COAT_E5M2_MAX;
  return scale_by_inverse(amax, kMax, 1.0f / kMax);
}

/** x / scale rounded to nearest, given reciprocal = 1 / scale rounded to nearest: the Markstein correction of
 *  coat_divide_by_scale, q - (q * scale - x) * reciprocal, in the form whose zero result keeps the sign of x
 *  (x - q * scale turns -0 into +0). For scale >= COAT_MIN_FAST_DIVISION_SCALE its FP8 code is that of
 *  copysign(coat_divide_by_scale(x, scale, reciprocal), x), which coat_quantize_scaled encodes, whenever it
 *  is finite; it is NaN or Inf when x or scale is not finite. */
__device__ __forceinline__ float quotient(float x, float scale, float reciprocal) {
  const float q = x * reciprocal;
  return __fmaf_rn(__fmaf_rn(q, scale, -x), -reciprocal, q);
}

/** Eight FP8 codes, byte e of the chunk in byte e % 4 of word e / 4. */
struct Codes {
  uint32_t lo;
  uint32_t hi;
};

__device__ __forceinline__ uint8_t code_at(Codes codes, int e) {
  return static_cast<uint8_t>((e < 4 ? codes.lo >> (8 * e) : codes.hi >> (8 * (e - 4))) & 0xFFu);
}

/** The codes of eight finite quotients: on sm_89+ converted in pairs by the hardware (which equals coat's
 *  encoder on finite values: the two differ on NaN and, for E5M2, Inf only), elsewhere by coat's encoder. */
template <coat_fp8_format kFormat>
__device__ __forceinline__ Codes codes_of_finite(const float q[kCodeChunk]) {
#ifdef COAT_HARDWARE_FP8_CONVERT
  constexpr __nv_fp8_interpretation_t kKind = kFormat == COAT_E4M3 ? __NV_E4M3 : __NV_E5M2;
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * w], q[4 * w + 1]), __NV_SATFINITE, kKind);
    const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(q[4 * w + 2], q[4 * w + 3]), __NV_SATFINITE, kKind);
    words[w] = low | (high << 16);
  }
  return {words[0], words[1]};
#else
  Codes codes{0u, 0u};
#pragma unroll
  for (int e = 0; e < kCodeChunk; ++e) {
    const uint32_t code = coat_f32_to_fp8(q[e], kFormat);
    if (e < 4) codes.lo |= code << (8 * e);
    else codes.hi |= code << (8 * (e - 4));
  }
  return codes;
#endif
}

/** codes[e] = coat_quantize_value(v[e], scale), reciprocal = 1 / scale (garbage is fine when scale is Inf).
 *  A chunk whose quotients are all finite takes quotient() and codes_of_finite(); any other (a NaN or Inf
 *  value, an Inf scale, a scale below 2^-80) goes through coat_quantize_value itself, with NaN made canonical
 *  first when kCanonicalNan (op results, as the C core does; saved inputs keep their NaN's sign). */
template <coat_fp8_format kFormat, bool kCanonicalNan>
__device__ __forceinline__ Codes encode_chunk(const float v[kCodeChunk], float scale, float reciprocal) {
  float q[kCodeChunk];
  bool finite = scale >= COAT_MIN_FAST_DIVISION_SCALE;
#pragma unroll
  for (int e = 0; e < kCodeChunk; ++e) {
    q[e] = quotient(v[e], scale, reciprocal);
    finite &= fabsf(q[e]) < INFINITY;
  }
  if (finite) return codes_of_finite<kFormat>(q);
  Codes codes{0u, 0u};
#pragma unroll
  for (int e = 0; e < kCodeChunk; ++e) {
    const uint32_t code = coat_quantize_value(kCanonicalNan ? coat_canonical_nan(v[e]) : v[e], scale, kFormat);
    if (e < 4) codes.lo |= code << (8 * e);
    else codes.hi |= code << (8 * (e - 4));
  }
  return codes;
}

/** a and b rounded to bf16 (kDtype COAT_BFLOAT16) or fp16 by coat's conversions, a in the low half. */
template <coat_dtype kDtype>
__device__ __forceinline__ uint32_t pack_16bit(float a, float b) {
  if constexpr (kDtype == COAT_BFLOAT16)
    return static_cast<uint32_t>(coat_f32_to_bf16(a)) | (static_cast<uint32_t>(coat_f32_to_bf16(b)) << 16);
  else
    return static_cast<uint32_t>(coat_f32_to_f16(a)) | (static_cast<uint32_t>(coat_f32_to_f16(b)) << 16);
}

/** pack_16bit for a and b that are not NaN: one cvt.rn instruction on sm_80+, which rounds as coat's
 *  conversions do (to nearest even, overflow to Inf, subnormals kept) and differs on NaN only. */
template <coat_dtype kDtype>
__device__ __forceinline__ uint32_t pack_16bit_not_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t packed;
  if constexpr (kDtype == COAT_BFLOAT16)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(b), "f"(a));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(b), "f"(a));
  return packed;
#else
  return pack_16bit<kDtype>(a, b);
#endif
}

}  // namespace device
}  // namespace coat
