// CPU model of csrc/cuda/adamw_fast_math.cuh for tools/cuda_emulation (run.sh puts this directory first on the
// include path, so this file takes the real one's place). Each hardware approximation returns the exact value
// (computed in double) rounded to float and then moved by a pseudo-random number of ulps, a function of the input
// bits only (the same input always gives the same output, as on the GPU), within the error bound the PTX ISA states:
//   ex2.approx   2 ulp            lg2.approx   2^-22 absolute for x in [0.5, 2], else 2 ulp
//   rcp.approx   1 ulp            sqrt.approx  1 ulp
// Exact results stay exact (2^n for integer n, log2 of a power of 2, 1 / 2^n, sqrt of a square), as the hardware's
// table-based units give them.
// The flush-to-zero variants flush subnormal inputs and results the way the hardware does. The model is there to
// test the kernel's logic and its tolerance against the C core with errors at the documented bounds, not to
// reproduce the GPU's bits.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "coat/fp8.h"

inline uint32_t emu_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
inline float emu_float(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

// A pseudo-random integer in [-bound, bound] from the input's bits and the operation.
inline int emu_wobble(float x, uint32_t salt, int bound) {
  uint64_t h = (static_cast<uint64_t>(emu_bits(x)) << 32 | salt) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<int>(h % static_cast<uint64_t>(2 * bound + 1)) - bound;
}

// exact rounded to a float that is less than `bound` ulps away from it: the float below or above exact (chosen by
// the input's bits) moved by up to bound - 1 ulps further in the same direction.
inline float emu_within_ulps(double exact, float x, uint32_t salt, int bound) {
  const float nearest = static_cast<float>(exact);
  if (!isfinite(nearest) || nearest == 0.0f || static_cast<double>(nearest) == exact) return nearest;
  const bool up = emu_wobble(x, salt, 1) > 0;
  float y = static_cast<double>(nearest) < exact ? nearest : nextafterf(nearest, -INFINITY);  // below exact
  if (up) y = nextafterf(y, INFINITY);
  const int further = abs(emu_wobble(x, salt + 7, bound - 1));
  for (int i = 0; i < further; ++i) y = nextafterf(y, up ? INFINITY : -INFINITY);
  return y;
}

inline bool emu_subnormal(float x) { return x != 0.0f && fabsf(x) < 1.17549435e-38f; }
inline float emu_flush(float x) { return emu_subnormal(x) ? copysignf(0.0f, x) : x; }

inline float approx_exp2_ftz(float x) {
  x = emu_flush(x);
  return emu_flush(emu_within_ulps(exp2(static_cast<double>(x)), x, 1, 2));
}

inline float approx_log2_ftz(float x) {
  x = emu_flush(x);
  if (!(x > 0.0f) || isinf(x)) return static_cast<float>(log2(static_cast<double>(x)));
  const double exact = log2(static_cast<double>(x));
  if (exact == rint(exact)) return static_cast<float>(exact);
  if (x >= 0.5f && x <= 2.0f) return static_cast<float>(exact + ldexp(emu_wobble(x, 2, 64) / 64.0, -22));
  return emu_within_ulps(exact, x, 2, 2);
}

inline float approx_reciprocal(float x) { return emu_within_ulps(1.0 / static_cast<double>(x), x, 3, 1); }

inline float approx_reciprocal_ftz(float x) { return emu_flush(approx_reciprocal(emu_flush(x))); }

inline float approx_sqrt(float x) { return emu_within_ulps(sqrt(static_cast<double>(x)), x, 4, 1); }

inline float approx_sqrt_ftz(float x) { return approx_sqrt(emu_flush(x)); }

inline float max_keeping_nan(float a, float b) { return isnan(a) || isnan(b) ? NAN : fmaxf(a, b); }
inline float min_keeping_nan(float a, float b) { return isnan(a) || isnan(b) ? NAN : fminf(a, b); }

template <coat_fp8_format kFormat>
inline uint32_t fp8x4_of_finite(float a, float b, float c, float d) {
  return coat_f32_to_fp8(a, kFormat) | (static_cast<uint32_t>(coat_f32_to_fp8(b, kFormat)) << 8) |
         (static_cast<uint32_t>(coat_f32_to_fp8(c, kFormat)) << 16) |
         (static_cast<uint32_t>(coat_f32_to_fp8(d, kFormat)) << 24);
}

inline float round_to_bf16(float x) { return coat_bf16_to_f32(coat_f32_to_bf16(x)); }

inline uint32_t bf16x2_bits(float lo, float hi) {
  return coat_f32_to_bf16(lo) | (static_cast<uint32_t>(coat_f32_to_bf16(hi)) << 16);
}

inline float f16_bits_to_f32(uint16_t bits) { return coat_f16_to_f32(bits); }

// Shared-memory addresses: the low 32 bits of the pointer; the high 32 bits, the same for every static variable
// of this small program, are kept aside (and checked).
inline uint64_t emu_shared_high = 0;

inline uint32_t shared_address(const void* p) {
  const uint64_t address = reinterpret_cast<uintptr_t>(p);
  if (emu_shared_high == 0) emu_shared_high = address >> 32;
  if (emu_shared_high != address >> 32) abort();
  return static_cast<uint32_t>(address);
}

inline float2 load_shared_float2(uint32_t address) {
  return *reinterpret_cast<const float2*>(static_cast<uintptr_t>(emu_shared_high << 32 | address));
}
