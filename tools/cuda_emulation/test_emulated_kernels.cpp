// Runs csrc/cuda/adamw.cu's kernels under the CPU emulation (cuda_runtime.h here) and compares every result with
// the C core, bit for bit. Built and run by run.sh.
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <stdlib.h>
#include <random>
#include "coat/adamw.h"
#include "coat/float_bits.h"

extern int emu_sms;  // cuda_runtime.h: the emulated GPU's SM count
static std::mt19937_64 rng(2024);
static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { ++failures; if (failures < 40) { printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } } while (0)

static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static float value(int specials, double row_scale) {
  std::normal_distribution<double> n(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double r = u(rng);
  if (specials && r < 0.003) return NAN;
  if (specials && r < 0.005) return INFINITY;
  if (specials && r < 0.006) return -INFINITY;
  if (r < 0.04) return 0.0f;
  if (r < 0.045) return -0.0f;
  if (specials && r < 0.05) return u2f((uint32_t)(rng() & 0x807FFFFF));  // subnormal
  return (float)(n(rng) * exp(2.0 * n(rng)) * row_scale);
}

struct Case { int64_t rows, cols; coat_dtype pd, gd; coat_fp8_format mf, vf; int64_t G; int em, ev; int offset; int specials; int tiny = 0; };

static uint16_t bf16(float f) { return coat_f32_to_bf16(f); }

static bool same_param(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, coat_dtype d, int64_t n, int64_t* bad) {
  for (int64_t i = 0; i < n; ++i) {
    if (d == COAT_FLOAT32) {
      float x, y; memcpy(&x, &a[4 * i], 4); memcpy(&y, &b[4 * i], 4);
      if (isnan(x) && isnan(y)) continue;
      if (f2u(x) != f2u(y)) { *bad = i; return false; }
    } else {
      uint16_t x, y; memcpy(&x, &a[2 * i], 2); memcpy(&y, &b[2 * i], 2);
      const bool nx = (x & 0x7FFF) > 0x7F80, ny = (y & 0x7FFF) > 0x7F80;
      if (nx && ny) continue;
      if (x != y) { *bad = i; return false; }
    }
  }
  return true;
}

struct State {
  std::vector<uint8_t> param, grad, m, v;
  std::vector<uint16_t> mm, vm;
};

static void run_case(const Case& c, int steps) {
  const int64_t n = c.rows * c.cols, ng = (c.cols + c.G - 1) / c.G;
  const int ps = c.pd == COAT_FLOAT32 ? 4 : 2, gs = c.gd == COAT_FLOAT32 ? 4 : 2;
  State s[2];
  // initial state: quantize random moments on the CPU
  std::vector<float> m0(n), v0(n);
  for (int64_t r = 0; r < c.rows; ++r) {
    const double sc = ldexp(1.0, -(int)(rng() % 21) - (c.tiny ? 85 + (int)(rng() % 20) : 0));
    for (int64_t i = 0; i < c.cols; ++i) { m0[r * c.cols + i] = value(c.tiny, sc) * 1e-2f; float g = value(0, sc); v0[r * c.cols + i] = g * g * 1e-3f; }
  }
  for (int k = 0; k < 2; ++k) {
    s[k].param.assign(n * ps + c.offset * 16 + 16, 0); s[k].grad.assign(n * gs + c.offset * 16 + 16, 0);
    s[k].m.assign(n + 16, 0); s[k].v.assign(n + 16, 0); s[k].mm.assign(ng * c.rows * 3 + 1, 0); s[k].vm.assign(ng * c.rows * 3 + 1, 0);
  }
  uint8_t* mcodes = s[0].m.data() + c.offset; uint8_t* vcodes = s[0].v.data() + c.offset;
  coat_quantize_expanded_cpu(m0.data(), c.rows, c.cols, c.cols, c.G, c.mf, c.em, mcodes, s[0].mm.data());
  coat_quantize_expanded_cpu(v0.data(), c.rows, c.cols, c.cols, c.G, c.vf, c.ev, vcodes, s[0].vm.data());
  const int pofs = c.offset ? 4 : 0;  // misaligned by one element when offset
  for (int64_t i = 0; i < n; ++i) {
    const float p = value(0, 1.0);
    if (c.pd == COAT_FLOAT32) memcpy(&s[0].param[pofs + 4 * i], &p, 4); else { uint16_t h = bf16(p); memcpy(&s[0].param[pofs / 2 + 2 * i], &h, 2); }
  }
  s[1] = s[0];
  for (int step = 1; step <= steps; ++step) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const double sc = ldexp(1.0, -(int)(rng() % 21) - (c.tiny ? 85 + (int)(rng() % 20) : 0));
      for (int64_t i = 0; i < c.cols; ++i) {
        const float g = value(c.specials && step == 1, sc);
        const int64_t e = r * c.cols + i;
        if (c.gd == COAT_FLOAT32) memcpy(&s[0].grad[pofs + 4 * e], &g, 4);
        else if (c.gd == COAT_BFLOAT16) { uint16_t h = bf16(g); memcpy(&s[0].grad[pofs / 2 + 2 * e], &h, 2); }
        else { uint16_t h = (uint16_t)(rng() % 8 == 0 ? rng() : (rng() & 0x3FFF) | (rng() & 0x8000)); if (!c.specials && ((h >> 10) & 0x1F) == 0x1F) h = 0x3C00; memcpy(&s[0].grad[pofs / 2 + 2 * e], &h, 2); }
      }
    }
    s[1].grad = s[0].grad;
    coat_adamw_options o;
    o.beta1 = 0.9f; o.one_minus_beta1 = 0.1f; o.beta2 = 0.999f; o.one_minus_beta2 = 0.001f; o.eps = 1e-8f;
    o.decay_factor = 0.999f; o.step_size = (float)(1e-2 / (1 - pow(0.9, step))); o.bias_correction2_sqrt = (float)sqrt(1 - pow(0.999, step));
    o.group_size = c.G; o.expand_exp_avg = c.em; o.expand_exp_avg_sq = c.ev;
    coat_adamw_tensor t[2];
    for (int k = 0; k < 2; ++k) {
      const int pofs_b = c.pd == COAT_FLOAT32 ? pofs : pofs / 2, gofs_b = c.gd == COAT_FLOAT32 ? pofs : pofs / 2;
      t[k].param = s[k].param.data() + pofs_b; t[k].grad = s[k].grad.data() + gofs_b;
      t[k].exp_avg = s[k].m.data() + c.offset; t[k].exp_avg_sq = s[k].v.data() + c.offset;
      t[k].exp_avg_meta = s[k].mm.data(); t[k].exp_avg_sq_meta = s[k].vm.data();
      t[k].rows = c.rows; t[k].cols = c.cols; t[k].param_dtype = c.pd; t[k].grad_dtype = c.gd;
      t[k].exp_avg_format = c.mf; t[k].exp_avg_sq_format = c.vf;
    }
    CHECK(coat_fp8_adamw_step_cpu(&t[0], 1, &o) == COAT_SUCCESS, "cpu status");
    CHECK(coat_fp8_adamw_step_cuda(&t[1], 1, &o, nullptr) == COAT_SUCCESS, "cuda status");
    int64_t bad = -1;
    CHECK(same_param(s[0].param, s[1].param, c.pd, n + (pofs ? 1 : 0), &bad), "params differ (%lld x %lld G%lld) step %d at %lld", (long long)c.rows, (long long)c.cols, (long long)c.G, step, (long long)bad);
    CHECK(s[0].m == s[1].m, "m codes differ (%lld x %lld G%lld) step %d", (long long)c.rows, (long long)c.cols, (long long)c.G, step);
    CHECK(s[0].v == s[1].v, "v codes differ (%lld x %lld G%lld) step %d", (long long)c.rows, (long long)c.cols, (long long)c.G, step);
    CHECK(s[0].mm == s[1].mm, "m meta differ step %d", step);
    CHECK(s[0].vm == s[1].vm, "v meta differ step %d", step);
    if (c.tiny && getenv("EMU_DEBUG")) {  // coverage: groups with subnormal m that the log path encodes
      std::vector<float> md(n);
      coat_dequantize_expanded_cpu(s[0].m.data() + c.offset, c.mf, s[0].mm.data(), c.rows, c.cols, c.G, md.data());
      long groups = 0, hits = 0, sub = 0;
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t g0 = 0; g0 < c.cols; g0 += c.G) {
          float amin = INFINITY; int has_sub = 0;
          for (int64_t i = g0; i < g0 + c.G && i < c.cols; ++i) { float a = fabsf(md[r * c.cols + i]); if (a > 0 && a < amin) amin = a; if (a > 0 && a < 1.17549435e-38f) has_sub = 1; }
          const float k = u2f((uint32_t)s[0].mm[(r * ng + g0 / c.G) * 3 + 1] << 16);
          groups++; sub += has_sub; hits += has_sub && k != 1.0f;
        }
      printf("tiny G%lld step %d: %ld groups, %ld with subnormal m, %ld of them expanded\n", (long long)c.G, step, groups, sub, hits);
    }
    if (failures) {
      for (int64_t i = 0; i < n; ++i) if (s[0].m[c.offset+i] != s[1].m[c.offset+i] || s[0].v[c.offset+i] != s[1].v[c.offset+i]) {
        printf("  first code diff at %lld: m %02x %02x v %02x %02x\n", (long long)i, s[0].m[c.offset+i], s[1].m[c.offset+i], s[0].v[c.offset+i], s[1].v[c.offset+i]); break; }
      for (size_t i = 0; i < s[0].mm.size(); ++i) if (s[0].mm[i] != s[1].mm[i] || s[0].vm[i] != s[1].vm[i]) {
        printf("  first meta diff at %zu: m %04x %04x v %04x %04x\n", i, s[0].mm[i], s[1].mm[i], s[0].vm[i], s[1].vm[i]); break; }
      return;
    }
  }
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

// Many tensors in one call (two launches of up to 32): each warp's phase decides which tiles it takes.
static void many_case(int count, int64_t G) {
  std::vector<State> s(2 * count);
  std::vector<coat_adamw_tensor> t[2];
  for (int k = 0; k < 2; ++k) t[k].resize(count);
  for (int j = 0; j < count; ++j) {
    const int64_t rows = 1 + rng() % 5, cols = 1 + rng() % 300, n = rows * cols, ng = (cols + G - 1) / G;
    State& a = s[2 * j];
    a.param.resize(4 * n); a.grad.resize(4 * n); a.m.assign(n, 0); a.v.assign(n, 0); a.mm.assign(rows * ng * 3, 0); a.vm.assign(rows * ng * 3, 0);
    std::vector<float> z(n, 0.0f);
    coat_quantize_expanded_cpu(z.data(), rows, cols, cols, G, COAT_E4M3, 1, a.m.data(), a.mm.data());
    coat_quantize_expanded_cpu(z.data(), rows, cols, cols, G, COAT_E5M2, 1, a.v.data(), a.vm.data());
    for (int64_t i = 0; i < n; ++i) { float p = value(0, 1.0), g = value(0, 1.0); memcpy(&a.param[4 * i], &p, 4); memcpy(&a.grad[4 * i], &g, 4); }
    s[2 * j + 1] = a;
    for (int k = 0; k < 2; ++k) {
      State& b = s[2 * j + k];
      coat_adamw_tensor& x = t[k][j];
      x.param = b.param.data(); x.grad = b.grad.data(); x.exp_avg = b.m.data(); x.exp_avg_sq = b.v.data();
      x.exp_avg_meta = b.mm.data(); x.exp_avg_sq_meta = b.vm.data(); x.rows = rows; x.cols = cols;
      x.param_dtype = COAT_FLOAT32; x.grad_dtype = COAT_FLOAT32; x.exp_avg_format = COAT_E4M3; x.exp_avg_sq_format = COAT_E5M2;
    }
  }
  coat_adamw_options o;
  o.beta1 = 0.9f; o.one_minus_beta1 = 0.1f; o.beta2 = 0.999f; o.one_minus_beta2 = 0.001f; o.eps = 1e-8f;
  o.decay_factor = 1.0f; o.step_size = 0.1f; o.bias_correction2_sqrt = 0.0316f; o.group_size = G; o.expand_exp_avg = 1; o.expand_exp_avg_sq = 1;
  for (int step = 0; step < 2; ++step) {
    coat_fp8_adamw_step_cpu(t[0].data(), count, &o);
    coat_fp8_adamw_step_cuda(t[1].data(), count, &o, nullptr);
  }
  for (int j = 0; j < count; ++j) {
    const State &a = s[2 * j], &b = s[2 * j + 1];
    CHECK(a.param == b.param && a.m == b.m && a.v == b.v && a.mm == b.mm && a.vm == b.vm, "many tensors: tensor %d differs", j);
  }
}

int main(int argc, char** argv) {
  const int quick = argc > 1;
  const int64_t shapes[][2] = {{1, 1}, {1, 127}, {1, 129}, {1, 1000}, {3, 200}, {5, 7}, {6, 130}, {4, 256}, {3, 512}, {2, 264}, {7, 300}, {33, 64}, {2, 1024}, {8, 2048}, {40, 512}, {3, 4096}};
  const int64_t groups[] = {16, 32, 64, 128};
  int i = 0;
  for (auto& sh : shapes) {
    for (int variant = 0; variant < (quick ? 2 : 6); ++variant, ++i) {
      Case c;
      c.rows = sh[0]; c.cols = sh[1];
      c.G = groups[(i + variant) % 4];
      c.pd = (i % 3 == 0) ? COAT_BFLOAT16 : COAT_FLOAT32;
      c.gd = (coat_dtype)((i / 2) % 3);
      c.mf = (i % 4 == 1) ? COAT_E5M2 : COAT_E4M3;
      c.vf = (i % 4 == 2) ? COAT_E4M3 : COAT_E5M2;
      c.em = variant != 3; c.ev = variant != 4;
      c.offset = variant == 5 ? 1 : 0;
      c.specials = variant == 2;
      run_case(c, 3);
    }
  }
  for (auto& sh : shapes)
    for (int64_t G : groups) {
      quantize_case(sh[0], sh[1], sh[1] + (G == 32 ? 3 : 0), G, COAT_E4M3, 1);
      quantize_case(sh[0], sh[1], sh[1], G, COAT_E5M2, G != 64);
    }
  for (int64_t G : groups) {  // gradients near the bottom of fp32: groups mixing subnormal and normal m, v
    Case c{4, 1024, COAT_FLOAT32, COAT_FLOAT32, COAT_E4M3, COAT_E5M2, G, 1, 1, 0, 1, 1};
    run_case(c, 3);
    c.mf = COAT_E5M2; c.vf = COAT_E4M3; c.gd = COAT_BFLOAT16;
    run_case(c, 3);
  }
  many_case(45, 128);
  many_case(40, 16);
  emu_sms = 1;
  many_case(33, 32);
  emu_sms = 3;
  many_case(20, 64);
  printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
