// The hardware approximations and conversions of the FP8 AdamW step kernel (csrc/cuda/adamw_step.cu), in one
// header so that tools/cuda_emulation can put a CPU model with the same error bounds in its place (it shadows
// this file by name). Error bounds are the PTX ISA's; "ftz" variants flush subnormal inputs and results to
// zero, the others handle them (at a few instructions more).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "coat/fp8.h"

// 2^x within 2 ulp (MUFU.EX2); results below 2^-126 are 0. Exact for integer x.
__device__ __forceinline__ float approx_exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2 x (MUFU.LG2): absolute error <= 2^-22 for x in [0.5, 2], else 2 ulp; subnormal x gives -Inf.
__device__ __forceinline__ float approx_log2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x within 1 ulp (MUFU.RCP). approx_reciprocal handles subnormal x and results; the ftz variant equals it for
// x in [2^-126, 2^126].
__device__ __forceinline__ float approx_reciprocal_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float approx_reciprocal(float x) {
  float y;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// sqrt x within 1 ulp (MUFU.SQRT). approx_sqrt handles subnormal x; the ftz variant equals it for normal x and
// returns 0 for subnormal x.
__device__ __forceinline__ float approx_sqrt_ftz(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float approx_sqrt(float x) {
  float y;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// max(a, b) and min(a, b), NaN if either is NaN (fmaxf and fminf ignore a NaN operand).
__device__ __forceinline__ float max_keeping_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ float min_keeping_nan(float a, float b) {
  float y;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// The FP8 codes of four finite floats as one word (a in bits 0-7, ..., d in bits 24-31): round to nearest even,
// finite values past the format's max saturate (coat/fp8.h's encoders for every finite input).
template <coat_fp8_format kFormat>
__device__ __forceinline__ uint32_t fp8x4_of_finite(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 890
  uint32_t codes;
  if (kFormat == COAT_E4M3)
    asm("{ .reg .b16 low, high;\n"
        "  cvt.rn.satfinite.e4m3x2.f32 low, %2, %1;\n"
        "  cvt.rn.satfinite.e4m3x2.f32 high, %4, %3;\n"
        "  mov.b32 %0, {low, high}; }"
        : "=r"(codes) : "f"(a), "f"(b), "f"(c), "f"(d));
  else
    asm("{ .reg .b16 low, high;\n"
        "  cvt.rn.satfinite.e5m2x2.f32 low, %2, %1;\n"
        "  cvt.rn.satfinite.e5m2x2.f32 high, %4, %3;\n"
        "  mov.b32 %0, {low, high}; }"
        : "=r"(codes) : "f"(a), "f"(b), "f"(c), "f"(d));
  return codes;
#else
  return coat_f32_to_fp8(a, kFormat) | (static_cast<uint32_t>(coat_f32_to_fp8(b, kFormat)) << 8) |
         (static_cast<uint32_t>(coat_f32_to_fp8(c, kFormat)) << 16) |
         (static_cast<uint32_t>(coat_f32_to_fp8(d, kFormat)) << 24);
#endif
}

// x rounded to the nearest bf16 (ties to even), as a float; x finite.
__device__ __forceinline__ float round_to_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// The 32-bit shared-memory address of p, a pointer into a __shared__ variable; load_shared_float2 reads from
// such an address.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ float2 load_shared_float2(uint32_t address) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(address));
  return v;
}

// Two floats as bf16 bit patterns, round to nearest even (lo in bits 0-15, hi in bits 16-31); NaN becomes a
// NaN whose payload is the hardware's.
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// IEEE binary16 bits -> fp32, exact.
__device__ __forceinline__ float f16_bits_to_f32(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
