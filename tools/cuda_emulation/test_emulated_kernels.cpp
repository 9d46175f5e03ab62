// Runs csrc/cuda/adamw_*.cu's kernels under the CPU emulation (cuda_runtime.h and adamw_fast_math.cuh here) and
// checks them. Built and run by run.sh.
//
// quantize_expanded and dequantize_expanded: equal to the C core bit for bit.
// moment_counts and moment_stats (coat.report's statistics of the moments): equal to the C core bit for bit.
// fp8_adamw_step, teacher-forced (every step starts both from the C core's previous state): against the C core and
// a float64 oracle (the exact dequantization of the old state, AdamW in double), with the tolerance of
// tests/test_adamw_ops.py:
//   parameter   e = |p - p*| / (|p * decay| + step_size * (|beta1 m_old| + |(1 - beta1) g| + 2^-126) / denom*) in
//               units of 2^-24 (the size of what the kernels round: the terms of m, which may cancel, and at least
//               the smallest normal number): root mean square CUDA <= 2 * C core + 1 (the 1: tensors so small that
//               the C core is exact by chance), and max CUDA <= 8 * C core + 8 (a check for a single wrong element)
//   m and v     dequantized new state against m*, v*: mean relative error (capped at 1: a value below the
//               format's floor is rounded up to it), CUDA <= 2 * C core
//   meta        relative error of scale, k and C against their exact values (k and C from the group's exact
//               range, scale from the kernel's own k and C): CUDA's max <= max(2 * C core's, 2^-7, one bf16 ulp)
//   codes       every code is the FP8 rounding of a value within the kernels' error bound of the exact moment
//               (|m - m*| <= 2^-17 * (|beta1 m_old| + |(1 - beta1) g|) + 2^-147, and the log-domain encoding's
//               2^-18 k relative): usually one code, two near a rounding boundary; CUDA differs from the C core in at most
//               0.2% of the codes of groups whose meta agree
//   specials    NaN parameters where the C core's are NaN (also where a huge finite gradient overflows v to Inf);
//               moments that are zero or not finite get the C core's codes (signed zero, NaN code 0x7F)
// The cases cover eps = 0 as well (the update's general variant, denominators of 0 and subnormal ones). And in
// addition: the CUDA step is deterministic and independent of layout (a misaligned copy of the tensors,
// which takes the element-by-element path, and a tensor stepped alone or among 70 others give the same bits).
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "coat/adamw.h"
#include "coat/float_bits.h"
#include "coat/fp8.h"
#include "check.h"

extern int emu_sms;  // cuda_runtime.h: the emulated GPU's SM count
static std::mt19937_64 rng(2024);

static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static float value(int specials, double row_scale) {
  std::normal_distribution<double> n(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double r = u(rng);
  if (specials && r < 0.0015) return (float)(n(rng) * 1e25);  // finite, but v = (1 - beta2) g^2 overflows
  if (specials && r < 0.003) return NAN;
  if (specials && r < 0.005) return INFINITY;
  if (specials && r < 0.006) return -INFINITY;
  if (r < 0.04) return 0.0f;
  if (r < 0.045) return -0.0f;
  if (specials && r < 0.05) return u2f((uint32_t)(rng() & 0x807FFFFF));  // subnormal
  return (float)(n(rng) * exp(2.0 * n(rng)) * row_scale);
}

struct Case {
  int64_t rows, cols;
  coat_dtype pd, gd;
  coat_fp8_format mf, vf;
  int64_t G;
  int em, ev;
  int specials;
  int tiny = 0;
  int eps_zero = 0;  // eps = 0: the update's general variant (square root and reciprocal of subnormals)
  int stochastic = 0;  // stochastic rounding of bf16 parameters
};

// One tensor's arrays, each with 16 spare bytes in front so that a copy can start misaligned.
struct State {
  std::vector<uint8_t> param, grad, m, v;
  std::vector<uint16_t> mm, vm;
};

static coat_adamw_tensor tensor_of(State& s, const Case& c, int offset) {
  coat_adamw_tensor t;
  const int ps = c.pd == COAT_FLOAT32 ? 4 : 2, gs = c.gd == COAT_FLOAT32 ? 4 : 2;
  t.param = s.param.data() + 16 + offset * ps;
  t.grad = s.grad.data() + 16 + offset * gs;
  t.exp_avg = s.m.data() + 16 + offset;
  t.exp_avg_sq = s.v.data() + 16 + offset;
  t.exp_avg_meta = s.mm.data();
  t.exp_avg_sq_meta = s.vm.data();
  t.rows = c.rows;
  t.cols = c.cols;
  t.param_dtype = c.pd;
  t.grad_dtype = c.gd;
  t.exp_avg_format = c.mf;
  t.exp_avg_sq_format = c.vf;
  t.rounding_seed = 0x5EEDull + (uint64_t)c.rows * 1000003u + (uint64_t)c.cols;
  return t;
}

// The same tensor's contents `offset` elements further on (the misaligned copy).
static State shifted(const State& s, const Case& c, int offset) {
  State r = s;
  const int ps = c.pd == COAT_FLOAT32 ? 4 : 2, gs = c.gd == COAT_FLOAT32 ? 4 : 2;
  const int64_t n = c.rows * c.cols;
  std::fill(r.param.begin(), r.param.end(), 0);
  std::fill(r.grad.begin(), r.grad.end(), 0);
  std::fill(r.m.begin(), r.m.end(), 0);
  std::fill(r.v.begin(), r.v.end(), 0);
  memcpy(r.param.data() + 16 + offset * ps, s.param.data() + 16, n * ps);
  memcpy(r.grad.data() + 16 + offset * gs, s.grad.data() + 16, n * gs);
  memcpy(r.m.data() + 16 + offset, s.m.data() + 16, n);
  memcpy(r.v.data() + 16 + offset, s.v.data() + 16, n);
  return r;
}

static double load_element(const uint8_t* data, coat_dtype d, int64_t i) {
  if (d == COAT_FLOAT32) { float x; memcpy(&x, data + 4 * i, 4); return x; }
  uint16_t h; memcpy(&h, data + 2 * i, 2);
  return d == COAT_BFLOAT16 ? coat_bf16_to_f32(h) : coat_f16_to_f32(h);
}

// Codes and meta bit for bit; parameters bit for bit but for NaN, which may differ in sign and payload: here a NaN
// result takes the x86 rules (which NaN operand propagates, the default NaN's sign), which depend on how the host
// compiler schedules one instantiation of the kernel against another; the GPU's arithmetic gives one canonical NaN.
static bool same_results(const State& a, const State& b, const Case& c, int offset_b) {
  const int ps = c.pd == COAT_FLOAT32 ? 4 : 2;
  const int64_t n = c.rows * c.cols;
  if (memcmp(a.m.data() + 16, b.m.data() + 16 + offset_b, n) || memcmp(a.v.data() + 16, b.v.data() + 16 + offset_b, n) ||
      a.mm != b.mm || a.vm != b.vm)
    return false;
  for (int64_t e = 0; e < n; ++e) {
    const uint8_t* pa = a.param.data() + 16 + e * ps;
    const uint8_t* pb = b.param.data() + 16 + (offset_b + e) * ps;
    if (memcmp(pa, pb, ps) == 0) continue;
    uint32_t bits_a = 0, bits_b = 0;
    memcpy(&bits_a, pa, ps);
    memcpy(&bits_b, pb, ps);
    const uint32_t magnitude = ps == 4 ? 0x7FFFFFFFu : 0x7FFFu, infinity = ps == 4 ? 0x7F800000u : 0x7F80u;
    if ((bits_a & magnitude) <= infinity || (bits_b & magnitude) <= infinity) return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------ the oracle

static double meta_value(uint16_t bits) { return coat_bf16_to_f32(bits); }
static double fp8_max(coat_fp8_format f) { return f == COAT_E4M3 ? 448.0 : 57344.0; }
static double log2_range(coat_fp8_format f) { return log2(fp8_max(f) / (f == COAT_E4M3 ? 0x1p-9 : 0x1p-16)); }

// sign * C * (|decode(code)| * scale)^(1/k), in double.
static double dequantize(uint8_t code, coat_fp8_format f, const uint16_t* meta) {
  const double t = coat_fp8_to_f32(code, f), s = meta_value(meta[0]), k = meta_value(meta[1]), c = meta_value(meta[2]);
  if (t == 0.0 || !isfinite(t)) return t;
  return copysign(c * pow(fabs(t) * s, 1.0 / k), t);
}

// FP8 codes ordered like their values, +-0 both 0.
static int ordinal(uint8_t code) { return code >= 128 ? 128 - (int)code : (int)code; }

// The ordinal of the FP8 rounding of r >= 0 (nearest even, saturating; a positive r never rounds to 0).
static int quantized_ordinal(double r, coat_fp8_format f) {
  if (r <= 0.0) return 0;
  const int mantissa = f == COAT_E4M3 ? 3 : 2, min_exponent = f == COAT_E4M3 ? -6 : -14;
  int e;
  frexp(r, &e);
  const double quantum = ldexp(1.0, std::max(e - 1, min_exponent) - mantissa);
  double q = std::min(nearbyint(r / quantum) * quantum, fp8_max(f));
  if (q == 0.0) q = ldexp(1.0, min_exponent - mantissa);
  return ordinal(coat_f32_to_fp8((float)q, f));
}

struct StepErrors {
  double param = 0;                     // max, units of 2^-24
  double param_squares = 0;             // sum of squares, units of 2^-24
  long param_count = 0;
  double state_sum[2] = {0, 0};  // relative errors of the dequantized new states, capped at 1
  long state_count[2] = {0, 0};
  double meta[2][3] = {{0, 0, 0}, {0, 0, 0}};  // [state][scale, k, C], max relative error
  long bad_codes = 0, bad_specials = 0;
  void merge(const StepErrors& o) {
    param = std::max(param, o.param);
    param_squares += o.param_squares;
    param_count += o.param_count;
    for (int s = 0; s < 2; ++s) {
      state_sum[s] += o.state_sum[s];
      state_count[s] += o.state_count[s];
      for (int q = 0; q < 3; ++q) meta[s][q] = std::max(meta[s][q], o.meta[s][q]);
    }
    bad_codes += o.bad_codes;
    bad_specials += o.bad_specials;
  }
};

// Errors of one kernel's step (`after`, from `before`) against the oracle.
static StepErrors measure(const Case& c, const State& before, const State& after, const coat_adamw_options& o) {
  StepErrors e;
  const int64_t n = c.rows * c.cols, ng = (c.cols + c.G - 1) / c.G;
  std::vector<double> moment[2] = {std::vector<double>(n), std::vector<double>(n)};
  std::vector<double> bound[2] = {std::vector<double>(n), std::vector<double>(n)};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t meta_index = (i / c.cols * ng + i % c.cols / c.G) * 3;
    const double m_old = dequantize(before.m[16 + i], c.mf, &before.mm[meta_index]);
    const double v_old = dequantize(before.v[16 + i], c.vf, &before.vm[meta_index]);
    const double g = load_element(before.grad.data() + 16, c.gd, i), p = load_element(before.param.data() + 16, c.pd, i);
    // what fp32 cannot hold is Inf for the kernels (and its code the NaN code)
    const double m_exact = (double)o.beta1 * m_old + (double)o.one_minus_beta1 * g;
    const double v_exact = (double)o.beta2 * v_old + (double)o.one_minus_beta2 * g * g;
    const double m = fabs(m_exact) > FLT_MAX ? copysign(INFINITY, m_exact) : m_exact;
    const double v = v_exact > FLT_MAX ? INFINITY : v_exact;
    moment[0][i] = m;
    moment[1][i] = v;
    bound[0][i] = 0x1p-17 * (fabs(o.beta1 * m_old) + fabs(o.one_minus_beta1 * g)) + 0x1p-147;
    bound[1][i] = 0x1p-17 * (fabs(o.beta2 * v_old) + fabs(o.one_minus_beta2 * g * g)) + 0x1p-147;
    const double denom = sqrt(v) / (double)o.bias_correction2_sqrt + (double)o.eps;
    const double expected = p * (double)o.decay_factor - (double)o.step_size * m / denom;
    const double got = load_element(after.param.data() + 16, c.pd, i);
    if (!isfinite(expected) || !isfinite(got)) continue;
    // the size of what the kernels round: p * decay and the update with m's terms instead of m, whose sum may
    // cancel (beta1 m_old + (1 - beta1) g), and at least the smallest normal (below it m is a subnormal)
    const double terms = fabs(o.beta1 * m_old) + fabs(o.one_minus_beta1 * g) + 0x1p-126;
    const double scale = fabs(p * (double)o.decay_factor) + (double)o.step_size * terms / denom;
    if (scale > 0) {
      const double error = fabs(got - expected) / scale * 0x1p24;
      e.param = std::max(e.param, error);
      e.param_squares += error * error;
      ++e.param_count;
    }
  }
  for (int s = 0; s < 2; ++s) {
    const coat_fp8_format f = s ? c.vf : c.mf;
    const std::vector<uint8_t>& codes = s ? after.v : after.m;
    const std::vector<uint16_t>& meta = s ? after.vm : after.mm;
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = 0; j < ng; ++j) {
        const uint16_t* mt = &meta[(r * ng + j) * 3];
        const double scale = meta_value(mt[0]), k = meta_value(mt[1]), cc = meta_value(mt[2]);
        double amax = 0, amin = INFINITY;
        for (int64_t col = j * c.G; col < std::min((j + 1) * c.G, c.cols); ++col) {
          const int64_t i = r * c.cols + col;
          const double x = moment[s][i];
          const uint8_t code = codes[16 + i];
          if (!isfinite(x) || x == 0.0) {  // the C core's codes: NaN code, or the zero of the moment's sign
            const uint8_t expected = x == 0.0 ? (signbit(x) ? 0x80 : 0x00) : 0x7F;
            if (code != expected && !(x == 0.0 && (code & 0x7F) == 0)) ++e.bad_specials;
            continue;
          }
          amax = std::max(amax, fabs(x));
          amin = std::min(amin, fabs(x));
          // relative, capped at 1: a value below the format's floor is rounded up to it (no flush), by any factor
          const double error = std::min(fabs(dequantize(code, f, mt) - x) / fabs(x), 1.0);
          e.state_sum[s] += error;
          ++e.state_count[s];
          // the codes of the values within the error bound of x
          const double slack = k * 0x1p-18 + 0x1p-20;
          auto scaled = [&](double a) { return k == 1.0 ? a / cc / scale : pow(a / cc, k) / scale; };
          const double low = std::max(fabs(x) - bound[s][i], 0.0), high = fabs(x) + bound[s][i];
          const int lo = low == 0.0 ? 0 : std::max(quantized_ordinal(scaled(low) * (1 - slack), f), 1);
          const int hi = quantized_ordinal(scaled(high) * (1 + slack), f);
          const int got = ordinal(code);
          const bool sign_ok = low == 0.0 || (code >= 128) == (x < 0);
          if (abs(got) < lo || abs(got) > hi || !sign_ok) ++e.bad_codes;
        }
        if (amax == 0.0) continue;
        // meta against exact values: C and k from the exact range, scale from the stored k and C
        const double scale_exact = std::max((k == 1.0 ? amax / cc : pow(amax / cc, k)) / fp8_max(f), 0x1p-126);
        e.meta[s][0] = std::max(e.meta[s][0], fabs(scale - scale_exact) / scale_exact);
        if (cc != 1.0 || k != 1.0) {
          const double c_exact = sqrt(amin * amax);
          e.meta[s][2] = std::max(e.meta[s][2], fabs(cc - c_exact) / c_exact);
        }
        if (k != 1.0) {
          const double k_exact = std::min(std::max(log2_range(f) / log2(amax / amin), 0.5), 64.0);
          e.meta[s][1] = std::max(e.meta[s][1], fabs(k - k_exact) / k_exact);
        }
      }
  }
  return e;
}

static const char* kStateName[2] = {"m", "v"};
static const char* kMetaName[3] = {"scale", "k", "C"};

static double rms(double squares, long count) { return sqrt(squares / std::max(count, 1L)); }

// CUDA's errors against the C core's, over a whole case: the tolerance stated at the top of this file.
static void check_tolerance(const StepErrors& cpu, const StepErrors& cuda, long code_diffs, long codes, const char* what) {
  const double cpu_rms = rms(cpu.param_squares, cpu.param_count), cuda_rms = rms(cuda.param_squares, cuda.param_count);
  CHECK(cuda_rms <= 2 * cpu_rms + 1, "%s: parameter rms error %.3g vs C core %.3g (units of 2^-24)", what, cuda_rms, cpu_rms);
  CHECK(cuda.param <= 8 * cpu.param + 8, "%s: parameter max error %.3g vs C core %.3g (units of 2^-24)", what,
        cuda.param, cpu.param);
  for (int s = 0; s < 2; ++s) {
    CHECK(cuda.state_sum[s] * cpu.state_count[s] <= 2 * cpu.state_sum[s] * cuda.state_count[s],
          "%s: %s mean relative error %.3g vs C core %.3g", what, kStateName[s],
          cuda.state_sum[s] / std::max(cuda.state_count[s], 1L), cpu.state_sum[s] / std::max(cpu.state_count[s], 1L));
    for (int q = 0; q < 3; ++q)
      CHECK(cuda.meta[s][q] <= std::max(2 * cpu.meta[s][q], 0x1p-7), "%s: %s meta %s relative error %.3g vs C core %.3g",
            what, kStateName[s], kMetaName[q], cuda.meta[s][q], cpu.meta[s][q]);
  }
  CHECK(cpu.bad_codes == 0 && cuda.bad_codes == 0, "%s: codes outside the error bound: C core %ld, CUDA %ld", what,
        cpu.bad_codes, cuda.bad_codes);
  CHECK(cpu.bad_specials == 0 && cuda.bad_specials == 0, "%s: codes of zero / non-finite moments: C core %ld, CUDA %ld",
        what, cpu.bad_specials, cuda.bad_specials);
  CHECK(code_diffs <= 2 + codes / 500, "%s: %ld of %ld codes differ from the C core's in groups of equal meta", what,
        code_diffs, codes);
}

// Codes that differ between two results in groups whose meta agree; the parameters' NaN positions must agree.
static long code_differences(const Case& c, const State& a, const State& b, long* codes, bool* nan_positions_agree) {
  const int64_t n = c.rows * c.cols, ng = (c.cols + c.G - 1) / c.G;
  long diffs = 0;
  *nan_positions_agree = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = (i / c.cols * ng + i % c.cols / c.G) * 3;
    if (memcmp(&a.mm[g], &b.mm[g], 6) == 0) diffs += a.m[16 + i] != b.m[16 + i], ++*codes;
    if (memcmp(&a.vm[g], &b.vm[g], 6) == 0) diffs += a.v[16 + i] != b.v[16 + i], ++*codes;
    if (isnan(load_element(a.param.data() + 16, c.pd, i)) != isnan(load_element(b.param.data() + 16, c.pd, i)))
      *nan_positions_agree = false;
  }
  return diffs;
}

static coat_adamw_options options_for(const Case& c, int step) {
  coat_adamw_options o;
  o.beta1 = 0.9f; o.one_minus_beta1 = 0.1f; o.beta2 = 0.999f; o.one_minus_beta2 = 0.001f; o.eps = c.eps_zero ? 0.0f : 1e-8f;
  o.decay_factor = 0.999f; o.step_size = (float)(1e-2 / (1 - pow(0.9, step)));
  o.bias_correction2_sqrt = (float)sqrt(1 - pow(0.999, step));
  o.group_size = c.G; o.expand_exp_avg = c.em; o.expand_exp_avg_sq = c.ev;
  o.stochastic_rounding = c.stochastic;
  return o;
}

static void run_case(const Case& c, int steps) {
  const int64_t n = c.rows * c.cols, ng = (c.cols + c.G - 1) / c.G;
  const int ps = c.pd == COAT_FLOAT32 ? 4 : 2, gs = c.gd == COAT_FLOAT32 ? 4 : 2;
  State s;
  s.param.assign(n * ps + 32, 0); s.grad.assign(n * gs + 32, 0);
  s.m.assign(n + 32, 0); s.v.assign(n + 32, 0); s.mm.assign(ng * c.rows * 3, 0); s.vm.assign(ng * c.rows * 3, 0);
  // initial state: random moments quantized by the C core
  std::vector<float> m0(n), v0(n);
  for (int64_t r = 0; r < c.rows; ++r) {
    const double sc = ldexp(1.0, -(int)(rng() % 21) - (c.tiny ? 85 + (int)(rng() % 20) : 0));
    for (int64_t i = 0; i < c.cols; ++i) { m0[r * c.cols + i] = value(c.tiny, sc) * 1e-2f; float g = value(0, sc); v0[r * c.cols + i] = g * g * 1e-3f; }
  }
  coat_quantize_expanded_cpu(m0.data(), c.rows, c.cols, c.cols, c.G, c.mf, c.em, s.m.data() + 16, s.mm.data());
  coat_quantize_expanded_cpu(v0.data(), c.rows, c.cols, c.cols, c.G, c.vf, c.ev, s.v.data() + 16, s.vm.data());
  for (int64_t i = 0; i < n; ++i) {
    const float p = value(0, 1.0);
    if (c.pd == COAT_FLOAT32) memcpy(&s.param[16 + 4 * i], &p, 4); else { uint16_t h = coat_f32_to_bf16(p); memcpy(&s.param[16 + 2 * i], &h, 2); }
  }
  StepErrors cpu_total, cuda_total;
  long code_diffs = 0, codes = 0;
  for (int step = 1; step <= steps; ++step) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const double sc = ldexp(1.0, -(int)(rng() % 21) - (c.tiny ? 85 + (int)(rng() % 20) : 0));
      for (int64_t i = 0; i < c.cols; ++i) {
        const float g = value(c.specials && step == 1, sc);
        const int64_t e = r * c.cols + i;
        if (c.gd == COAT_FLOAT32) memcpy(&s.grad[16 + 4 * e], &g, 4);
        else if (c.gd == COAT_BFLOAT16) { uint16_t h = coat_f32_to_bf16(g); memcpy(&s.grad[16 + 2 * e], &h, 2); }
        else { uint16_t h = (uint16_t)(rng() % 8 == 0 ? rng() : (rng() & 0x3FFF) | (rng() & 0x8000)); if (!c.specials && ((h >> 10) & 0x1F) == 0x1F) h = 0x3C00; memcpy(&s.grad[16 + 2 * e], &h, 2); }
      }
    }
    const coat_adamw_options o = options_for(c, step);
    State cpu = s, cuda = s, again = s, misaligned = shifted(s, c, 1);
    coat_adamw_tensor t_cpu = tensor_of(cpu, c, 0), t_cuda = tensor_of(cuda, c, 0), t_again = tensor_of(again, c, 0),
                      t_misaligned = tensor_of(misaligned, c, 1);
    CHECK(coat_fp8_adamw_step_cpu(&t_cpu, 1, &o) == COAT_SUCCESS, "cpu status");
    CHECK(coat_fp8_adamw_step_cuda(&t_cuda, 1, &o, nullptr) == COAT_SUCCESS, "cuda status");
    CHECK(coat_fp8_adamw_step_cuda(&t_again, 1, &o, nullptr) == COAT_SUCCESS, "cuda status");
    CHECK(coat_fp8_adamw_step_cuda(&t_misaligned, 1, &o, nullptr) == COAT_SUCCESS, "cuda status");
    CHECK(same_results(cuda, again, c, 0), "%lld x %lld G%lld step %d: two CUDA runs differ", (long long)c.rows, (long long)c.cols, (long long)c.G, step);
    CHECK(same_results(cuda, misaligned, c, 1), "%lld x %lld G%lld step %d: the misaligned copy differs", (long long)c.rows, (long long)c.cols, (long long)c.G, step);
    cpu_total.merge(measure(c, s, cpu, o));
    cuda_total.merge(measure(c, s, cuda, o));
    bool nans_agree;
    code_diffs += code_differences(c, cpu, cuda, &codes, &nans_agree);
    CHECK(nans_agree, "%lld x %lld G%lld step %d: NaN parameters differ", (long long)c.rows, (long long)c.cols, (long long)c.G, step);
    s = cpu;  // teacher forcing: the next step starts from the C core's state
  }
  char what[160];
  snprintf(what, sizeof what, "%lld x %lld G%lld p%d g%d m%d v%d expand %d%d%s%s%s%s", (long long)c.rows,
           (long long)c.cols, (long long)c.G, c.pd, c.gd, c.mf, c.vf, c.em, c.ev, c.specials ? " specials" : "",
           c.tiny ? " tiny" : "", c.eps_zero ? " eps 0" : "", c.stochastic ? " stochastic" : "");
  check_tolerance(cpu_total, cuda_total, code_diffs, codes, what);
  if (getenv("EMU_VERBOSE"))
    printf("%s: param rms %.2f / %.2f, max %.2f / %.2f; m %.3g / %.3g, v %.3g / %.3g; code diffs %ld of %ld\n", what,
           rms(cpu_total.param_squares, cpu_total.param_count), rms(cuda_total.param_squares, cuda_total.param_count),
           cpu_total.param, cuda_total.param, cpu_total.state_sum[0] / std::max(cpu_total.state_count[0], 1L),
           cuda_total.state_sum[0] / std::max(cuda_total.state_count[0], 1L),
           cpu_total.state_sum[1] / std::max(cpu_total.state_count[1], 1L),
           cuda_total.state_sum[1] / std::max(cuda_total.state_count[1], 1L), code_diffs, codes);
}

static void quantize_case(int64_t rows, int64_t cols, int64_t stride, int64_t G, coat_fp8_format f, int expand) {
  const int64_t ng = (cols + G - 1) / G;
  std::vector<float> x(rows * stride);
  for (int64_t r = 0; r < rows; ++r) { const double sc = ldexp(1.0, -(int)(rng() % 21)); for (int64_t i = 0; i < stride; ++i) x[r * stride + i] = value(1, sc); }
  std::vector<uint8_t> c0(rows * cols), c1(rows * cols);
  std::vector<uint16_t> m0(rows * ng * 3), m1(rows * ng * 3);
  coat_quantize_expanded_cpu(x.data(), rows, cols, stride, G, f, expand, c0.data(), m0.data());
  coat_quantize_expanded_cuda(x.data(), rows, cols, stride, G, f, expand, c1.data(), m1.data(), nullptr);
  CHECK(c0 == c1 && m0 == m1, "quantize differs %lld x %lld G%lld f%d e%d", (long long)rows, (long long)cols, (long long)G, (int)f, expand);
  std::vector<float> o0(rows * cols), o1(rows * cols);
  coat_dequantize_expanded_cpu(c0.data(), f, m0.data(), rows, cols, G, o0.data());
  coat_dequantize_expanded_cuda(c0.data(), f, m0.data(), rows, cols, G, o1.data(), nullptr);
  bool same = true;
  for (size_t i = 0; i < o0.size(); ++i) if (!(isnan(o0[i]) && isnan(o1[i])) && f2u(o0[i]) != f2u(o1[i])) same = false;
  CHECK(same, "dequantize differs %lld x %lld G%lld f%d e%d", (long long)rows, (long long)cols, (long long)G, (int)f, expand);
}

// The moments' statistics of `count` states (coat_moment_counts, then coat_moment_stats on the keys sorted by
// std::sort): counts, keys and stats equal to the C core's bit for bit. Some states sampled (a row outside the state
// among them), a NaN k in one; more than 32 states take several counting launches, more than 256 several chunks of
// the stats kernel's scan.
static void moment_stats_case(int count, int64_t G) {
  struct Moment { int64_t rows, cols; std::vector<uint8_t> codes; std::vector<uint16_t> meta; std::vector<int64_t> index; };
  std::vector<Moment> moments(count);
  int64_t groups = 0;
  for (int i = 0; i < count; ++i) {
    Moment& m = moments[i];
    m.rows = 1 + (int64_t)(rng() % 5);
    m.cols = 1 + (int64_t)(rng() % (3 * G));
    std::vector<float> x(m.rows * m.cols);
    for (float& v : x) v = value(i % 5 == 0, ldexp(1.0, -(int)(rng() % 21)));
    m.codes.resize(x.size());
    m.meta.resize(m.rows * ((m.cols + G - 1) / G) * 3);
    coat_quantize_expanded_cpu(x.data(), m.rows, m.cols, m.cols, G, i % 2 ? COAT_E5M2 : COAT_E4M3, i % 3 != 0,
                               m.codes.data(), m.meta.data());
    if (i == 7) m.meta[1] = 0x7FC0;  // a NaN k
    if (i % 4 == 1) m.index = {m.rows - 1, 0, i % 8 == 1 ? m.rows : 0};
    groups += m.rows * ((m.cols + G - 1) / G);
  }
  std::vector<uint64_t> counts[2];
  std::vector<int32_t> keys[2];
  std::vector<double> stats[2];
  for (int side = 0; side < 2; ++side) {
    counts[side].assign(count * COAT_MOMENT_COUNTS, 0);
    keys[side].assign(groups, -1);
    std::vector<coat_moment_state> states(count);
    int64_t offset = 0;
    for (int i = 0; i < count; ++i) {
      const Moment& m = moments[i];
      states[i] = {m.codes.data(), i % 2 ? COAT_E5M2 : COAT_E4M3, m.meta.data(), m.rows, m.cols,
                   m.index.empty() ? nullptr : m.index.data(), m.index.empty() ? m.rows : (int64_t)m.index.size(), i,
                   counts[side].data() + i * COAT_MOMENT_COUNTS, keys[side].data() + offset};
      offset += m.rows * ((m.cols + G - 1) / G);
    }
    const coat_status counted = side == 0 ? coat_moment_counts_cpu(states.data(), count, G)
                                          : coat_moment_counts_cuda(states.data(), count, G, nullptr);
    CHECK(counted == COAT_SUCCESS, "moment counts status %d (side %d)", (int)counted, side);
    std::sort(keys[side].begin(), keys[side].end());
    stats[side].assign(count * COAT_MOMENT_STATS, 0.0);
    const coat_status summed = side == 0 ? coat_moment_stats_cpu(counts[side].data(), keys[side].data(), count, stats[side].data())
                                         : coat_moment_stats_cuda(counts[side].data(), keys[side].data(), count,
                                                                  stats[side].data(), nullptr);
    CHECK(summed == COAT_SUCCESS, "moment stats status %d (side %d)", (int)summed, side);
  }
  CHECK(counts[0] == counts[1], "moment counts differ, %d states G%lld", count, (long long)G);
  CHECK(keys[0] == keys[1], "moment keys differ, %d states G%lld", count, (long long)G);
  CHECK(memcmp(stats[0].data(), stats[1].data(), stats[0].size() * sizeof(double)) == 0,
        "moment stats differ, %d states G%lld", count, (long long)G);
}

// Many tensors in one call (launches of up to 32): each tensor's CUDA result equals its CUDA result when stepped
// alone, bit for bit, and the C core's within the tolerance.
static void many_case(int count, int64_t G) {
  std::vector<Case> cases(count);
  std::vector<State> states(count);
  for (int j = 0; j < count; ++j) {
    Case& c = cases[j];
    c = Case{(int64_t)(1 + rng() % 5), (int64_t)(1 + rng() % 300), COAT_FLOAT32, COAT_FLOAT32, COAT_E4M3, COAT_E5M2, G, 1, 1, 0};
    const int64_t n = c.rows * c.cols, ng = (c.cols + G - 1) / G;
    State& a = states[j];
    a.param.assign(4 * n + 32, 0); a.grad.assign(4 * n + 32, 0); a.m.assign(n + 32, 0); a.v.assign(n + 32, 0);
    a.mm.assign(c.rows * ng * 3, 0); a.vm.assign(c.rows * ng * 3, 0);
    std::vector<float> z(n, 0.0f);
    coat_quantize_expanded_cpu(z.data(), c.rows, c.cols, c.cols, G, COAT_E4M3, 1, a.m.data() + 16, a.mm.data());
    coat_quantize_expanded_cpu(z.data(), c.rows, c.cols, c.cols, G, COAT_E5M2, 1, a.v.data() + 16, a.vm.data());
    for (int64_t i = 0; i < n; ++i) { float p = value(0, 1.0), g = value(0, 1.0); memcpy(&a.param[16 + 4 * i], &p, 4); memcpy(&a.grad[16 + 4 * i], &g, 4); }
  }
  coat_adamw_options o = options_for(cases[0], 1);
  o.decay_factor = 1.0f; o.step_size = 0.1f; o.bias_correction2_sqrt = 0.0316f;
  for (int step = 0; step < 2; ++step) {
    std::vector<State> cpu = states, together = states;
    std::vector<coat_adamw_tensor> t_cpu(count), t_together(count);
    for (int j = 0; j < count; ++j) t_cpu[j] = tensor_of(cpu[j], cases[j], 0), t_together[j] = tensor_of(together[j], cases[j], 0);
    coat_fp8_adamw_step_cpu(t_cpu.data(), count, &o);
    coat_fp8_adamw_step_cuda(t_together.data(), count, &o, nullptr);
    for (int j = 0; j < count; ++j) {
      State alone = states[j];
      coat_adamw_tensor t = tensor_of(alone, cases[j], 0);
      coat_fp8_adamw_step_cuda(&t, 1, &o, nullptr);
      CHECK(same_results(alone, together[j], cases[j], 0), "many tensors: tensor %d differs from its step alone", j);
      long codes = 0;
      bool nans_agree;
      const long diffs = code_differences(cases[j], cpu[j], together[j], &codes, &nans_agree);
      char what[64];
      snprintf(what, sizeof what, "many tensors: tensor %d", j);
      check_tolerance(measure(cases[j], states[j], cpu[j], o), measure(cases[j], states[j], together[j], o), diffs, codes, what);
    }
    states = cpu;
  }
}

int main(int argc, char** argv) {
  const int quick = argc > 1;
  const int64_t shapes[][2] = {{1, 1}, {1, 127}, {1, 129}, {1, 1000}, {3, 200}, {5, 7}, {6, 130}, {4, 256}, {3, 512}, {2, 264}, {7, 300}, {33, 64}, {2, 1024}, {8, 2048}, {40, 512}, {3, 4096}};
  const int64_t groups[] = {16, 32, 64, 128};
  int i = 0;
  for (auto& sh : shapes) {
    for (int variant = 0; variant < (quick ? 2 : 5); ++variant, ++i) {
      Case c;
      c.rows = sh[0]; c.cols = sh[1];
      c.G = groups[(i + variant) % 4];
      c.pd = (i % 3 == 0) ? COAT_BFLOAT16 : COAT_FLOAT32;
      c.gd = (coat_dtype)((i / 2) % 3);
      c.mf = (i % 4 == 1) ? COAT_E5M2 : COAT_E4M3;
      c.vf = (i % 4 == 2) ? COAT_E4M3 : COAT_E5M2;
      c.em = variant != 3; c.ev = variant != 4;
      c.specials = variant == 2;
      c.stochastic = c.pd == COAT_BFLOAT16 && variant % 2 == 1;
      run_case(c, 3);
    }
  }
  for (auto& sh : shapes)
    for (int64_t G : groups) {
      quantize_case(sh[0], sh[1], sh[1] + (G == 32 ? 3 : 0), G, COAT_E4M3, 1);
      quantize_case(sh[0], sh[1], sh[1], G, COAT_E5M2, G != 64);
    }
  for (int64_t G : groups) {  // gradients near the bottom of fp32: groups mixing subnormal and normal m, v
    Case c{4, 1024, COAT_FLOAT32, COAT_FLOAT32, COAT_E4M3, COAT_E5M2, G, 1, 1, 1, 1};
    run_case(c, 3);
    c.mf = COAT_E5M2; c.vf = COAT_E4M3; c.gd = COAT_BFLOAT16;
    run_case(c, 3);
    c.eps_zero = 1;
    run_case(c, 3);
  }
  moment_stats_case(5, 32);
  moment_stats_case(300, 16);
  many_case(45, 128);
  many_case(40, 16);
  emu_sms = 1;
  many_case(33, 32);
  emu_sms = 3;
  many_case(20, 64);
  printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
