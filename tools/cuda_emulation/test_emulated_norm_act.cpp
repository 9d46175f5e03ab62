// Runs the kernels of csrc/cuda/rmsnorm.cu and silu_mul.cu under the CPU emulation (cuda_runtime.h here) and compares
// every output with the C core (csrc/cpu/norm_act.c), bit for bit: RMSNorm and act*mul (silu, gelu_tanh and
// quick_gelu, gated and non-gated), forward (saving E4M3, FP4 and FP6),
// requantize (with the forward's y_scale and with one that saturates, from aligned and misaligned codes) and
// backward (without a residual gradient, and with one of dy's dtype or another), both from every saved format, the
// high-precision forward rmsnorm_save (without and with a residual stream), weight offsets 0 and 1 (Gemma), over
// row widths of every lane count, odd widths
// and misaligned views (the element-wise path), row strides, the three dtypes, every save group size, both FP8
// formats, with and without the transpose, NaN / Inf / zero / subnormal / huge inputs and gates past the fast
// sigmoid's range, on 1 to 3 emulated SMs (so that the persistent kernels walk several rows or tiles per block
// and their prefetch paths run). It also checks the fast sigmoid against coat_sigmoid and the save scale against
// coat_scale_from_amax on every float they take (`full`) or on a sample, and the fast quotient's codes on random
// values. Built and run by run.sh, which generates norm_act_emulated.cpp from the .cu files.
#include "norm_act_emulated.cpp"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <thread>
#include <vector>

#include "coat/norm_act.h"
#include "check.h"

extern int emu_sms;  // cuda_runtime.h: the emulated GPU's SM count

namespace {

std::mt19937_64 rng(2026);

float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }
double normal() { return std::normal_distribution<double>(0.0, 1.0)(rng); }

// Which special values a generated tensor holds.
enum Specials { kPlain = 0, kSpecial = 1, kFarGates = 2 };

float value(int specials, double scale) {
  const double r = uniform();
  if (specials & kSpecial) {
    if (r < 0.002) return NAN;
    if (r < 0.004) return INFINITY;
    if (r < 0.005) return -INFINITY;
    if (r < 0.015) return u2f(static_cast<uint32_t>(rng() & 0x807FFFFFu));  // subnormal
    if (r < 0.02) return (r < 0.0175 ? 1 : -1) * 3.0e38f;
  }
  if (specials & kFarGates) {  // around the fast sigmoid's bound, coat_exp's range ends, the bf16 table's edges
    static const float edges[] = {0x1p-24f, 0x1.fep-25f, 255.0f, 256.0f, 1e-30f, 1e-39f};
    if (r < 0.01) return static_cast<float>(-80.0 + 2 * uniform() - 1);
    if (r < 0.02) return static_cast<float>(-88.0 - 16 * uniform());
    if (r < 0.025) return static_cast<float>(80.0 + 30 * uniform());
    if (r < 0.03) return (rng() & 1 ? -1 : 1) * edges[rng() % (sizeof edges / sizeof edges[0])];
  }
  if (r < 0.03) return 0.0f;
  if (r < 0.035) return -0.0f;
  return static_cast<float>(normal() * exp(normal()) * scale);
}

size_t bytes_of(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

void put(void* data, coat_dtype dtype, int64_t i, float v) {
  if (dtype == COAT_FLOAT32) {
    memcpy(static_cast<char*>(data) + 4 * i, &v, 4);
  } else {
    uint16_t h = dtype == COAT_BFLOAT16 ? coat_f32_to_bf16(v) : coat_f32_to_f16(v);
    if (v != v && (rng() & 1)) h |= 0x8000;  // negative NaNs too: saved inputs keep the sign
    memcpy(static_cast<char*>(data) + 2 * i, &h, 2);
  }
}

// A rows x cols matrix with rows row_stride elements apart, starting offset elements into its buffer
// (offset 1 misaligns it), values of per-row magnitudes.
struct Matrix {
  std::vector<uint8_t> buffer;
  void* data;
  int64_t rows, cols, row_stride;
  coat_dtype dtype;
};

Matrix make_matrix(int64_t rows, int64_t cols, int64_t row_stride, int offset, coat_dtype dtype, int specials) {
  Matrix m;
  m.buffer.assign((rows * row_stride + offset + 16) * bytes_of(dtype) + 16, 0);
  const uintptr_t base = reinterpret_cast<uintptr_t>(m.buffer.data());
  m.data = reinterpret_cast<void*>(((base + 15) & ~uintptr_t{15}) + offset * bytes_of(dtype));
  m.rows = rows, m.cols = cols, m.row_stride = row_stride, m.dtype = dtype;
  for (int64_t r = 0; r < rows; ++r) {
    // With specials, one row in 8 is tiny: its groups' scales are below 2^-80, where encodes divide.
    const double scale = ldexp(1.0, (specials & kSpecial) && rng() % 8 == 0 ? -118 : static_cast<int>(rng() % 13) - 6);
    for (int64_t c = 0; c < row_stride; ++c) put(m.data, dtype, r * row_stride + c, value(specials, scale));
  }
  return m;
}

// A copy of `codes` starting `offset` bytes past a 16-byte boundary (offset 1: the element-wise path).
struct PlacedCodes {
  std::vector<uint8_t> buffer;
  uint8_t* data;
};

PlacedCodes codes_at(const std::vector<uint8_t>& codes, int offset) {
  PlacedCodes c;
  c.buffer.assign(codes.size() + 32, 0);
  const uintptr_t base = reinterpret_cast<uintptr_t>(c.buffer.data());
  c.data = reinterpret_cast<uint8_t*>(((base + 15) & ~uintptr_t{15}) + offset);
  if (!codes.empty()) memcpy(c.data, codes.data(), codes.size());
  return c;
}

// The bytes of `rows` saved rows of `cols` elements in `format`.
int64_t saved_bytes(coat_saved_format format, int64_t rows, int64_t cols) {
  return rows * (format == COAT_SAVED_FP4 ? (cols + 1) / 2 : format == COAT_SAVED_FP6 ? coat_fp6_row_bytes(cols) : cols);
}

const char* format_name(coat_saved_format format) {
  return format == COAT_SAVED_FP4 ? "fp4" : format == COAT_SAVED_FP6 ? "fp6" : "e4m3";
}

// An input a forward saved for backward: its format, codes and scales.
struct SavedInput {
  coat_saved_format format;
  const std::vector<uint8_t>* codes;
  const std::vector<float>* scales;
};

// SiLU*mul's two saved inputs.
struct SavedPair {
  coat_saved_format format;
  const std::vector<uint8_t>* gate;
  const std::vector<float>* gate_scales;
  const std::vector<uint8_t>* up;
  const std::vector<float>* up_scales;
};

// The y_scales a requantize case runs with: the forward's, and an eighth of it, which sends the largest values
// past FP8_MAX (saturation).
std::vector<float> requantize_scales(float forward_scale) { return {forward_scale, forward_scale / 8}; }

// Bytes compared exactly (fp32 NaNs included: every NaN output is canonical).
template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b, const char* what, const char* name) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      CHECK(false, "%s: %s differs at %zu of %zu", name, what, i, a.size());
      return false;
    }
  }
  return true;
}

const char* dtype_name(coat_dtype d) { return d == COAT_FLOAT32 ? "f32" : d == COAT_BFLOAT16 ? "bf16" : "f16"; }

// RMSNorm forward and backward, C core against the emulated kernels.
void rmsnorm_case(int64_t rows, int64_t cols, int64_t row_stride, int offset, coat_dtype x_dtype, coat_dtype w_dtype,
                  int64_t group, coat_fp8_format format, bool transpose, int specials, float eps,
                  const std::vector<coat_dtype>& residual_dtypes, float weight_offset = 0.0f) {
  char name[180];
  snprintf(name, sizeof name, "rmsnorm %lldx%lld stride %lld +%d %s/%s G%lld %s%s%s eps %g weight_offset %g sms %d",
           (long long)rows, (long long)cols, (long long)row_stride, offset, dtype_name(x_dtype), dtype_name(w_dtype),
           (long long)group, format == COAT_E4M3 ? "e4m3" : "e5m2", transpose ? " T" : "", specials ? " specials" : "",
           eps, weight_offset, emu_sms);
  const Matrix x = make_matrix(rows, cols, row_stride, offset, x_dtype, specials);
  const Matrix weight = make_matrix(1, cols, cols, 0, w_dtype, specials & kSpecial ? kSpecial : kPlain);
  const int64_t n = rows * cols, ngroups = (cols + group - 1) / group;
  struct Out {
    std::vector<uint8_t> y, y_t, saved;
    std::vector<float> y_scale, scales, rstd, y_amax;
  } out[2];
  for (Out& o : out) {
    o.y.assign(n, 0xAB), o.y_t.assign(transpose ? n : 0, 0xAB), o.saved.assign(n, 0xAB);
    o.y_scale.assign(1, -1.0f), o.scales.assign(rows * ngroups, -1.0f), o.rstd.assign(rows, -1.0f), o.y_amax.assign(1, -1.0f);
  }
  // First with x kept in FP4 and FP6 (coat_quantize_fp4's and coat_quantize_fp6's packed layouts), then in E4M3;
  // requantize and backward read every one.
  std::vector<uint8_t> packed_saved[2];
  std::vector<float> packed_scales[2];
  for (const coat_saved_format save : {COAT_SAVED_FP4, COAT_SAVED_FP6, COAT_SAVED_E4M3}) {
    for (Out& o : out) o.saved.assign(saved_bytes(save, rows, cols), 0xAB);
    const coat_status cpu = coat_rmsnorm_quantize_cpu(
        x.data, x_dtype, rows, cols, row_stride, weight.data, w_dtype, weight_offset, eps, group, save, format,
        out[0].y.data(), out[0].y_scale.data(), transpose ? out[0].y_t.data() : nullptr, out[0].saved.data(),
        out[0].scales.data(), out[0].rstd.data(), out[0].y_amax.data());
    const coat_status gpu = coat_rmsnorm_quantize_cuda(
        x.data, x_dtype, rows, cols, row_stride, weight.data, w_dtype, weight_offset, eps, group, save, format,
        out[1].y.data(), out[1].y_scale.data(), transpose ? out[1].y_t.data() : nullptr, out[1].saved.data(),
        out[1].scales.data(), out[1].rstd.data(), out[1].y_amax.data(), nullptr);
    CHECK(cpu == COAT_SUCCESS && gpu == COAT_SUCCESS, "%s: status %d %d", name, cpu, gpu);
    if (save != COAT_SAVED_E4M3) {
      const int k = save == COAT_SAVED_FP4 ? 0 : 1;
      same(out[0].saved, out[1].saved, k ? "x_saved fp6" : "x_saved fp4", name);
      same(out[0].scales, out[1].scales, k ? "x_saved_scales fp6" : "x_saved_scales fp4", name);
      packed_saved[k] = out[0].saved, packed_scales[k] = out[0].scales;
    }
  }
  same(out[0].y, out[1].y, "y", name);
  same(out[0].y_t, out[1].y_t, "y_t", name);
  same(out[0].saved, out[1].saved, "x_saved", name);
  same(out[0].y_scale, out[1].y_scale, "y_scale", name);
  same(out[0].scales, out[1].scales, "x_saved_scales", name);
  same(out[0].rstd, out[1].rstd, "rstd", name);
  same(out[0].y_amax, out[1].y_amax, "y_amax", name);

  const SavedInput saved_inputs[] = {{COAT_SAVED_E4M3, &out[0].saved, &out[0].scales},
                                     {COAT_SAVED_FP4, &packed_saved[0], &packed_scales[0]},
                                     {COAT_SAVED_FP6, &packed_saved[1], &packed_scales[1]}};

  // y_t recomputed from the saved input (misaligned with `offset`).
  for (const SavedInput& saved : saved_inputs) {
    const PlacedCodes x_saved = codes_at(*saved.codes, offset);
    for (const float y_scale : requantize_scales(out[0].y_scale[0])) {
      std::vector<uint8_t> y_t[2] = {std::vector<uint8_t>(n, 0xAB), std::vector<uint8_t>(n, 0xCD)};
      const coat_status cpu_r = coat_rmsnorm_requantize_cpu(x_saved.data, saved.scales->data(), group, saved.format,
                                                            out[0].rstd.data(), rows, cols, weight.data, w_dtype,
                                                            weight_offset, &y_scale, format, y_t[0].data());
      const coat_status gpu_r = coat_rmsnorm_requantize_cuda(x_saved.data, saved.scales->data(), group, saved.format,
                                                             out[0].rstd.data(), rows, cols, weight.data, w_dtype,
                                                             weight_offset, &y_scale, format, y_t[1].data(), nullptr);
      CHECK(cpu_r == COAT_SUCCESS && gpu_r == COAT_SUCCESS, "%s requantize: status %d %d", name, cpu_r, gpu_r);
      char what[64];
      snprintf(what, sizeof what, "requantized y_t from %s", format_name(saved.format));
      same(y_t[0], y_t[1], what, name);
    }
  }

  // Backward from the saved input, with a dy of the same layout: without a residual, then with one of each of
  // `residual_dtypes` (contiguous, `offset` elements into its buffer like dy).
  const int dy_specials = specials & kSpecial ? kSpecial : kPlain;
  const Matrix dy = make_matrix(rows, cols, row_stride, offset, x_dtype, dy_specials);
  std::vector<Matrix> residuals;
  for (const coat_dtype dtype : residual_dtypes)
    residuals.push_back(make_matrix(rows, cols, cols, offset, dtype, dy_specials));
  for (const SavedInput& saved : saved_inputs)
  for (size_t k = 0; k <= residuals.size(); ++k) {
    const Matrix* residual = k > 0 ? &residuals[k - 1] : nullptr;
    const coat_dtype dx_dtype = residual ? residual->dtype : x_dtype;
    char backward_name[220];
    snprintf(backward_name, sizeof backward_name, "%s backward from %s, residual %s", name,
             format_name(saved.format), residual ? dtype_name(dx_dtype) : "none");
    struct Grads {
      std::vector<uint8_t> dx;
      std::vector<float> dweight, workspace;
    } grads[2];
    for (Grads& g : grads) {
      g.dx.assign(n * bytes_of(dx_dtype), 0xAB);
      g.dweight.assign(cols, -1.0f);
      g.workspace.assign(coat_rmsnorm_backward_workspace_size(rows, cols) + 1, -1.0f);
    }
    const void* residual_data = residual ? residual->data : nullptr;
    const coat_status cpu_b = coat_rmsnorm_backward_cpu(
        dy.data, x_dtype, rows, cols, row_stride, saved.codes->data(), saved.scales->data(), group, saved.format,
        out[0].rstd.data(), weight.data, w_dtype, weight_offset, residual_data, dx_dtype, grads[0].dx.data(),
        grads[0].dweight.data(), grads[0].workspace.data());
    const coat_status gpu_b = coat_rmsnorm_backward_cuda(
        dy.data, x_dtype, rows, cols, row_stride, saved.codes->data(), saved.scales->data(), group, saved.format,
        out[0].rstd.data(), weight.data, w_dtype, weight_offset, residual_data, dx_dtype, grads[1].dx.data(),
        grads[1].dweight.data(), grads[1].workspace.data(), nullptr);
    CHECK(cpu_b == COAT_SUCCESS && gpu_b == COAT_SUCCESS, "%s: status %d %d", backward_name, cpu_b, gpu_b);
    same(grads[0].dx, grads[1].dx, "dx", backward_name);
    same(grads[0].dweight, grads[1].dweight, "dweight", backward_name);
  }

  // The high-precision forward (coat_rmsnorm_save_*), without a residual and with each of `residuals` (as the
  // residual stream): out bit for bit, and what it saves equal to the FP8 forward's (E4M3, its last save above).
  for (size_t k = 0; k <= residuals.size(); ++k) {
    const Matrix* residual = k > 0 ? &residuals[k - 1] : nullptr;
    const coat_dtype out_dtype = residual ? residual->dtype : x_dtype;
    char save_name[220];
    snprintf(save_name, sizeof save_name, "%s save, residual %s", name, residual ? dtype_name(out_dtype) : "none");
    struct Saved {
      std::vector<uint8_t> out, saved;
      std::vector<float> scales, rstd;
    } kept[2];
    for (Saved& o : kept) {
      o.out.assign(n * bytes_of(out_dtype), 0xAB), o.saved.assign(n, 0xAB);
      o.scales.assign(rows * ngroups, -1.0f), o.rstd.assign(rows, -1.0f);
    }
    const void* residual_data = residual ? residual->data : nullptr;
    const coat_status cpu_s = coat_rmsnorm_save_cpu(
        x.data, x_dtype, rows, cols, row_stride, weight.data, w_dtype, weight_offset, eps, group, COAT_SAVED_E4M3,
        residual_data, out_dtype, kept[0].out.data(), kept[0].saved.data(), kept[0].scales.data(),
        kept[0].rstd.data());
    const coat_status gpu_s = coat_rmsnorm_save_cuda(
        x.data, x_dtype, rows, cols, row_stride, weight.data, w_dtype, weight_offset, eps, group, COAT_SAVED_E4M3,
        residual_data, out_dtype, kept[1].out.data(), kept[1].saved.data(), kept[1].scales.data(),
        kept[1].rstd.data(), nullptr);
    CHECK(cpu_s == COAT_SUCCESS && gpu_s == COAT_SUCCESS, "%s: status %d %d", save_name, cpu_s, gpu_s);
    same(kept[0].out, kept[1].out, "out", save_name);
    same(kept[1].saved, out[0].saved, "x_saved vs the FP8 forward's", save_name);
    same(kept[1].scales, out[0].scales, "x_saved_scales vs the FP8 forward's", save_name);
    same(kept[1].rstd, out[0].rstd, "rstd vs the FP8 forward's", save_name);
  }
}

const char* activation_name(coat_activation act) {
  return act == COAT_ACT_GELU_TANH ? "gelu_tanh" : act == COAT_ACT_QUICK_GELU ? "quick_gelu" : "silu";
}

// act*mul forward and backward. gate and up are the two halves of one [rows, 2 cols + pad] matrix (row-strided
// views, as from one GEMM), or separate matrices when `fused` is false. Without `gated`, the non-gated act: up,
// its saved copy and dup are NULL (gate is still read from the same place).
void silu_case(int64_t rows, int64_t cols, int pad, int offset, coat_dtype dtype, bool fused, bool smooth, int64_t group,
               coat_fp8_format format, bool transpose, int specials, coat_activation act, bool gated = true) {
  char name[160];
  snprintf(name, sizeof name, "%s%s %lldx%lld pad %d +%d %s %s%s G%lld %s%s%s sms %d", activation_name(act),
           gated ? "" : " non-gated", (long long)rows,
           (long long)cols, pad, offset, dtype_name(dtype), fused ? "fused" : "separate", smooth ? " smooth" : "",
           (long long)group, format == COAT_E4M3 ? "e4m3" : "e5m2", transpose ? " T" : "", specials ? " specials" : "",
           emu_sms);
  const int64_t stride = fused ? 2 * cols + pad : cols + pad;
  const Matrix first = make_matrix(rows, fused ? 2 * cols + pad : cols, stride, offset, dtype, specials | kFarGates);
  const Matrix second = make_matrix(rows, cols, stride, offset, dtype, specials);
  const void* gate = first.data;
  const void* up = !gated ? nullptr : fused ? static_cast<const char*>(first.data) + cols * bytes_of(dtype) : second.data;
  std::vector<float> smooth_scale(cols);
  for (float& s : smooth_scale) s = static_cast<float>(exp(normal()));
  const float* smooth_ptr = smooth ? smooth_scale.data() : nullptr;
  const int64_t n = rows * cols, ngroups = (cols + group - 1) / group;
  struct Out {
    std::vector<uint8_t> y, y_t, gate_saved, up_saved;
    std::vector<float> y_scale, gate_scales, up_scales, y_amax;
  } out[2];
  for (Out& o : out) {
    o.y.assign(n, 0xAB), o.y_t.assign(transpose ? n : 0, 0xAB), o.gate_saved.assign(n, 0xAB), o.up_saved.assign(n, 0xAB);
    o.y_scale.assign(1, -1.0f), o.gate_scales.assign(rows * ngroups, -1.0f), o.up_scales.assign(rows * ngroups, -1.0f);
    o.y_amax.assign(1, -1.0f);
  }
  // First with gate and up kept in FP4 and FP6 (the packed layouts of coat_quantize_fp4 and coat_quantize_fp6),
  // then in E4M3; requantize and backward read every one.
  std::vector<uint8_t> packed_gate[2], packed_up[2];
  std::vector<float> packed_gate_scales[2], packed_up_scales[2];
  for (const coat_saved_format save : {COAT_SAVED_FP4, COAT_SAVED_FP6, COAT_SAVED_E4M3}) {
    const int64_t bytes = saved_bytes(save, rows, cols);
    for (Out& o : out) o.gate_saved.assign(bytes, 0xAB), o.up_saved.assign(bytes, 0xAB);
    const coat_status cpu = coat_silu_mul_quantize_cpu(
        gate, up, dtype, rows, cols, stride, stride, smooth_ptr, act, group, save, format, out[0].y.data(),
        out[0].y_scale.data(), transpose ? out[0].y_t.data() : nullptr, out[0].gate_saved.data(),
        out[0].gate_scales.data(), gated ? out[0].up_saved.data() : nullptr,
        gated ? out[0].up_scales.data() : nullptr, out[0].y_amax.data());
    const coat_status gpu = coat_silu_mul_quantize_cuda(
        gate, up, dtype, rows, cols, stride, stride, smooth_ptr, act, group, save, format, out[1].y.data(),
        out[1].y_scale.data(), transpose ? out[1].y_t.data() : nullptr, out[1].gate_saved.data(),
        out[1].gate_scales.data(), gated ? out[1].up_saved.data() : nullptr,
        gated ? out[1].up_scales.data() : nullptr, out[1].y_amax.data(), nullptr);
    CHECK(cpu == COAT_SUCCESS && gpu == COAT_SUCCESS, "%s: status %d %d", name, cpu, gpu);
    if (save != COAT_SAVED_E4M3) {
      const int k = save == COAT_SAVED_FP4 ? 0 : 1;
      same(out[0].gate_saved, out[1].gate_saved, k ? "gate_saved fp6" : "gate_saved fp4", name);
      same(out[0].up_saved, out[1].up_saved, k ? "up_saved fp6" : "up_saved fp4", name);
      same(out[0].gate_scales, out[1].gate_scales, k ? "gate_scales fp6" : "gate_scales fp4", name);
      same(out[0].up_scales, out[1].up_scales, k ? "up_scales fp6" : "up_scales fp4", name);
      packed_gate[k] = out[0].gate_saved, packed_up[k] = out[0].up_saved;
      packed_gate_scales[k] = out[0].gate_scales, packed_up_scales[k] = out[0].up_scales;
    }
  }
  same(out[0].y, out[1].y, "y", name);
  same(out[0].y_t, out[1].y_t, "y_t", name);
  same(out[0].gate_saved, out[1].gate_saved, "gate_saved", name);
  same(out[0].up_saved, out[1].up_saved, "up_saved", name);
  same(out[0].y_scale, out[1].y_scale, "y_scale", name);
  same(out[0].gate_scales, out[1].gate_scales, "gate_scales", name);
  same(out[0].up_scales, out[1].up_scales, "up_scales", name);
  same(out[0].y_amax, out[1].y_amax, "y_amax", name);

  const Matrix dy = make_matrix(rows, cols, stride, offset, dtype, specials);
  const SavedPair saved_pairs[] = {
      {COAT_SAVED_E4M3, &out[0].gate_saved, &out[0].gate_scales, &out[0].up_saved, &out[0].up_scales},
      {COAT_SAVED_FP4, &packed_gate[0], &packed_gate_scales[0], &packed_up[0], &packed_up_scales[0]},
      {COAT_SAVED_FP6, &packed_gate[1], &packed_gate_scales[1], &packed_up[1], &packed_up_scales[1]}};
  for (const SavedPair& saved : saved_pairs) {
    char saved_name[200];
    snprintf(saved_name, sizeof saved_name, "%s from %s", name, format_name(saved.format));
    const PlacedCodes gate_saved = codes_at(*saved.gate, offset), up_saved = codes_at(*saved.up, 0);
    const uint8_t* up_codes = gated ? up_saved.data : nullptr;
    const float* up_scales = gated ? saved.up_scales->data() : nullptr;
    // The forward's gate scales, and a copy in which some groups have an Inf scale (decoded gates +-Inf, NaN) or
    // one that takes the largest codes past the largest bf16 (448 * 7.59e35 is finite in fp32, Inf in bf16).
    std::vector<float> far_gate_scales = *saved.gate_scales;
    for (size_t i = 0; i < far_gate_scales.size(); ++i)
      if (i % 5 == 2) far_gate_scales[i] = INFINITY;
      else if (i % 7 == 3) far_gate_scales[i] = 7.59e35f;
    const std::vector<float>* gate_scale_choices[] = {saved.gate_scales, &far_gate_scales};
    for (const std::vector<float>* gate_scales : gate_scale_choices)
    for (const float y_scale : requantize_scales(out[0].y_scale[0])) {
      std::vector<uint8_t> y_t[2] = {std::vector<uint8_t>(n, 0xAB), std::vector<uint8_t>(n, 0xCD)};
      const coat_status cpu_r = coat_silu_mul_requantize_cpu(
          gate_saved.data, gate_scales->data(), up_codes, up_scales, group, saved.format, rows,
          cols, smooth_ptr, act, &y_scale, format, y_t[0].data());
      const coat_status gpu_r = coat_silu_mul_requantize_cuda(
          gate_saved.data, gate_scales->data(), up_codes, up_scales, group, saved.format, rows,
          cols, smooth_ptr, act, &y_scale, format, y_t[1].data(), nullptr);
      CHECK(cpu_r == COAT_SUCCESS && gpu_r == COAT_SUCCESS, "%s requantize: status %d %d", saved_name, cpu_r, gpu_r);
      same(y_t[0], y_t[1], gate_scales == &far_gate_scales ? "requantized y_t, far gate scales" : "requantized y_t",
           saved_name);
    }

    for (const std::vector<float>* gate_scales : gate_scale_choices) {
      const char* what = gate_scales == &far_gate_scales ? ", far gate scales" : "";
      std::vector<uint8_t> dgate[2], dup[2];
      for (int k = 0; k < 2; ++k) dgate[k].assign(n * bytes_of(dtype), 0xAB), dup[k].assign(n * bytes_of(dtype), 0xAB);
      // a nonzero start: the amax accumulates into what the buffer holds
      float d_amax[2] = {0.125f, 0.125f};
      const coat_status cpu_b = coat_silu_mul_backward_cpu(
          dy.data, dtype, rows, cols, stride, saved.gate->data(), gate_scales->data(),
          gated ? saved.up->data() : nullptr, up_scales, smooth_ptr, act, group, saved.format, dgate[0].data(),
          gated ? dup[0].data() : nullptr, &d_amax[0]);
      const coat_status gpu_b = coat_silu_mul_backward_cuda(
          dy.data, dtype, rows, cols, stride, saved.gate->data(), gate_scales->data(),
          gated ? saved.up->data() : nullptr, up_scales, smooth_ptr, act, group, saved.format, dgate[1].data(),
          gated ? dup[1].data() : nullptr, &d_amax[1], nullptr);
      CHECK(cpu_b == COAT_SUCCESS && gpu_b == COAT_SUCCESS, "%s backward%s: status %d %d", saved_name, what, cpu_b,
            gpu_b);
      same(dgate[0], dgate[1], gate_scales == &far_gate_scales ? "dgate, far gate scales" : "dgate", saved_name);
      same(dup[0], dup[1], gate_scales == &far_gate_scales ? "dup, far gate scales" : "dup", saved_name);
      float stored_amax = 0.125f;
      for (int64_t i = 0; i < n; ++i) {
        stored_amax = coat_amax_step(stored_amax, coat_load_f32(dgate[0].data(), dtype, i));
        if (gated) stored_amax = coat_amax_step(stored_amax, coat_load_f32(dup[0].data(), dtype, i));
      }
      CHECK(f2u(d_amax[0]) == f2u(stored_amax) && f2u(d_amax[1]) == f2u(stored_amax),
            "%s backward%s: d_amax %a (CPU) %a (CUDA), stored values' amax %a", saved_name, what, d_amax[0],
            d_amax[1], stored_amax);
    }
  }
}

// sigmoid_near(g) == coat_sigmoid(g) for every float g >= -80 (every `step`-th bit pattern), on all cores.
void check_sigmoid_near(uint32_t step) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<long> mismatches(threads, 0);
  std::vector<uint32_t> first(threads, 0);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint64_t bits = uint64_t{t} * step; bits <= 0xFFFFFFFFu; bits += uint64_t{threads} * step) {
        const float g = u2f(static_cast<uint32_t>(bits));
        if (!(g >= -80.0f)) continue;
        if (f2u(sigmoid_near(g)) != f2u(coat_sigmoid(g)) && mismatches[t]++ == 0) first[t] = static_cast<uint32_t>(bits);
      }
    });
  }
  for (std::thread& th : pool) th.join();
  long total = 0;
  for (unsigned t = 0; t < threads; ++t) {
    total += mismatches[t];
    if (mismatches[t]) printf("  sigmoid_near differs at g = %a\n", u2f(first[t]));
  }
  CHECK(total == 0, "sigmoid_near != coat_sigmoid on %ld floats", total);
  printf("sigmoid_near checked on every %u-th float >= -80: %ld mismatches\n", step, total);
}

// The sum of a check's per-thread mismatch counts over bf16 gates; prints each thread's first mismatching gate.
long gate_mismatches(const std::vector<long>& mismatches, const std::vector<uint32_t>& first_mismatch, const char* what) {
  long total = 0;
  for (size_t t = 0; t < mismatches.size(); ++t) {
    total += mismatches[t];
    if (mismatches[t]) printf("  %s differs at bf16 0x%04x\n", what, first_mismatch[t]);
  }
  return total;
}

// The act the FP4 and FP6 requantize ops take of every bf16 gate (SiluOfDecodedGates<true, kAct>: its sigmoid table
// filled by a block, every gate looked up with the range clamped) == coat_silu(g, coat_activation_sigmoid(kAct, g)),
// NaN as NaN.
template <coat_activation kAct>
void check_decoded_gate_silu() {
  using Gates = SiluOfDecodedGates<true, kAct>;
  static typename Gates::Table table;
  constexpr unsigned kThreads = 256;
  std::vector<long> mismatches(kThreads, 0);
  std::vector<uint32_t> first_mismatch(kThreads, 0);
  emu_launch(dim3(1), dim3(kThreads), 0, [&] {
    Gates::fill(table);
    const unsigned t = threadIdx.x;
    for (uint32_t first = t * kChunk; first < 0x10000u; first += kThreads * kChunk) {
      float g[kChunk], silu[kChunk];
      for (int e = 0; e < kChunk; ++e) g[e] = coat_bf16_to_f32(static_cast<uint16_t>(first + e));
      Gates::chunk(table, g, silu);
      for (int e = 0; e < kChunk; ++e) {
        const float want = coat_silu(g[e], coat_activation_sigmoid(kAct, g[e]));
        if (f2u(silu[e]) != f2u(want) && !(silu[e] != silu[e] && want != want) && mismatches[t]++ == 0)
          first_mismatch[t] = first + e;
      }
    }
  });
  const long total = gate_mismatches(mismatches, first_mismatch, "decoded-gate act");
  CHECK(total == 0, "SiluOfDecodedGates<true> (%s) != coat_silu on %ld bf16 gates", activation_name(kAct), total);
  printf("decoded-gate %s checked on every bf16 gate: %ld mismatches\n", activation_name(kAct), total);
}

// The act of bf16 gates read from the forward's table (SiluOfGates<VectorIo<bf16>, kAct>, offsets taken two gates a
// word) == coat_silu(g, coat_activation_sigmoid(kAct, g)), NaN as NaN, for every bf16 gate: in chunks of 8 alike, and
// beside a gate in the table's range and one below it in either half of a word (a low half below the range borrows
// from the high one).
template <coat_activation kAct>
void check_bf16_gate_silu() {
  using Gates = SiluOfGates<VectorIo<COAT_BFLOAT16>, kAct>;
  static typename Gates::Table table;
  constexpr unsigned kThreads = 256;
  constexpr uint16_t kFirst = kSiluTableFirst<kAct>;
  constexpr uint16_t kPartners[] = {0x3F80u, 0xC0A0u, 0x0001u, kFirst,  // 1, -5, below, the two ends
                                    static_cast<uint16_t>(kFirst + kSiluTablePlane - 1)};
  std::vector<long> mismatches(kThreads, 0);
  std::vector<uint32_t> first_mismatch(kThreads, 0);
  emu_launch(dim3(1), dim3(kThreads), 0, [&] {
    Gates::fill(table);
    const unsigned t = threadIdx.x;
    for (uint32_t v = t; v < 0x10000u; v += kThreads) {
      for (int layout = 0; layout < 1 + 2 * static_cast<int>(sizeof(kPartners) / sizeof(kPartners[0])); ++layout) {
        uint16_t bits[kChunk];
        for (int e = 0; e < kChunk; ++e) {
          const uint16_t partner = layout == 0 ? static_cast<uint16_t>(v) : kPartners[(layout - 1) / 2];
          bits[e] = e % 2 == (layout + 1) % 2 ? static_cast<uint16_t>(v) : partner;
        }
        VectorIo<COAT_BFLOAT16>::Raw raw{};
        float g[kChunk], silu[kChunk];
        uint32_t words[kChunk / 2];
        for (int i = 0; i < kChunk / 2; ++i) words[i] = bits[2 * i] | static_cast<uint32_t>(bits[2 * i + 1]) << 16;
        raw.words[0] = make_uint4(words[0], words[1], words[2], words[3]);
        for (int e = 0; e < kChunk; ++e) g[e] = coat_bf16_to_f32(bits[e]);
        Gates::chunk(table, raw, g, silu);
        for (int e = 0; e < kChunk; ++e) {
          const float want = coat_silu(g[e], coat_activation_sigmoid(kAct, g[e]));
          if (f2u(silu[e]) != f2u(want) && !(silu[e] != silu[e] && want != want) && mismatches[t]++ == 0)
            first_mismatch[t] = bits[e];
        }
      }
    }
  });
  const long total = gate_mismatches(mismatches, first_mismatch, "bf16-gate act");
  CHECK(total == 0, "SiluOfGates<VectorIo<bf16>> (%s) != coat_silu on %ld gates", activation_name(kAct), total);
  printf("bf16-gate %s (table by words) checked on every bf16 gate: %ld mismatches\n", activation_name(kAct), total);
}

// scale_from_amax<format>(amax) == coat_scale_from_amax(amax, format) for every float amax in [0, Inf] (every
// `step`-th), in both formats.
void check_scale_from_amax(uint32_t step) {
  long mismatches = 0;
  for (uint64_t bits = 0; bits <= 0x7F800000u; bits += step) {
    const float amax = u2f(static_cast<uint32_t>(bits));
    if (f2u(scale_from_amax<COAT_E4M3>(amax)) != f2u(coat_scale_from_amax(amax, COAT_E4M3))) ++mismatches;
    if (f2u(scale_from_amax<COAT_E5M2>(amax)) != f2u(coat_scale_from_amax(amax, COAT_E5M2))) ++mismatches;
  }
  CHECK(mismatches == 0, "scale_from_amax != coat_scale_from_amax on %ld floats", mismatches);
  printf("scale_from_amax checked on every %u-th amax in [0, Inf], both formats: %ld mismatches\n", step, mismatches);
}

// The codes of quotient() against coat_quantize_value (the IEEE division) in both formats, for scales from
// amax over the whole range down to COAT_MIN_FAST_DIVISION_SCALE and values whose quotients cover the FP8
// range and below: the fast path of encode_chunk.
void check_quotient(long samples) {
  long mismatches = 0, checked = 0;
  for (long i = 0; i < samples; ++i) {
    const coat_fp8_format format = (i & 1) ? COAT_E5M2 : COAT_E4M3;
    const float scale = coat_scale_from_amax(u2f(static_cast<uint32_t>(rng() % 0x7F000000u)), format);
    if (scale < COAT_MIN_FAST_DIVISION_SCALE) continue;
    const double m = ldexp(1.0 + uniform(), static_cast<int>(rng() % 60) - 44);
    const float x = static_cast<float>((rng() & 1 ? -1 : 1) * scale * m);
    if (!isfinite(x)) continue;
    ++checked;
    if (coat_f32_to_fp8(coat::device::quotient(x, scale, 1.0f / scale), format) != coat_quantize_value(x, scale, format)) ++mismatches;
  }
  CHECK(mismatches == 0, "quotient's code != coat_quantize_value's on %ld of %ld samples", mismatches, checked);
}

// e2m_scale_from_amax_bits == coat_e2m_scale_from_amax_bits on every `step`-th amax bit pattern in [0, Inf] and on
// the NaNs' first and last.
template <int kMantissaBits>
void check_e2m_scale_from_amax(uint32_t step) {
  long mismatches = 0;
  for (uint64_t bits = 0; bits <= 0x7F800000u; bits += step)
    if (f2u(coat::device::e2m_scale_from_amax_bits<kMantissaBits>(static_cast<uint32_t>(bits))) !=
        f2u(coat_e2m_scale_from_amax_bits(static_cast<uint32_t>(bits), kMantissaBits)))
      ++mismatches;
  for (uint32_t nan : {0x7F800001u, 0x7FFFFFFFu})
    if (f2u(coat::device::e2m_scale_from_amax_bits<kMantissaBits>(nan)) !=
        f2u(coat_e2m_scale_from_amax_bits(nan, kMantissaBits)))
      ++mismatches;
  CHECK(mismatches == 0, "e2m_scale_from_amax_bits<%d> != coat_e2m_scale_from_amax_bits on %ld floats", kMantissaBits,
        mismatches);
  printf("e2m_scale_from_amax_bits<%d> checked on every %u-th amax in [0, Inf]: %ld mismatches\n", kMantissaBits, step,
         mismatches);
}

// e2m_magnitude_code_biased(m, e2m_steps(r)) - its bias == the magnitude code of coat_quantize_e2m_scaled(m, r) for
// every `step`-th float m whose product m * r is below the fast limit, r being the reciprocal of scales at both ends
// of the fast range, of 1, 6 and 7.5, and of random scales in between.
template <int kMantissaBits>
void check_e2m_fast_code(uint32_t step) {
  std::vector<float> scales = {0x1p-124f, 0x1p124f, 1.0f, 6.0f, 7.5f, 0x1.fffffep-3f, 0x1.000002p+40f};
  for (int i = 0; i < 4; ++i) scales.push_back(ldexpf(static_cast<float>(1.0 + uniform()), static_cast<int>(rng() % 240) - 120));
  const float limit = u2f(coat::device::E2m<kMantissaBits>::kFastLimitBits);
  long mismatches = 0, checked = 0;
  for (const float scale : scales) {
    const float r = 1.0f / scale;
    const coat::device::E2mSteps steps = coat::device::e2m_steps<kMantissaBits>(r);
    for (uint64_t bits = 0; bits < 0x7F800000u; bits += step) {
      const float m = u2f(static_cast<uint32_t>(bits));
      if (static_cast<double>(m) * r >= limit) break;
      ++checked;
      if (coat::device::e2m_magnitude_code_biased<kMantissaBits>(m, steps) - coat::device::kE2mCodeBias !=
          coat_quantize_e2m_scaled(m, r, kMantissaBits))
        ++mismatches;
    }
  }
  CHECK(mismatches == 0, "e2m_magnitude_code_biased<%d> != coat_quantize_e2m_scaled on %ld of %ld products", kMantissaBits,
        mismatches, checked);
  printf("e2m_magnitude_code_biased<%d> checked on every %u-th magnitude below the limit, %zu reciprocals (%ld "
         "products): %ld mismatches\n", kMantissaBits, step, scales.size(), checked, mismatches);
}

// encode_e2m_chunk against coat_quantize_e2m_scaled on random blocks: scales from amax over the whole range (down
// to 2^-126, below the fast path's 2^-124), values of either sign whose products with the reciprocal cover [0, E_MAX]
// and below, grid midpoints and their neighbours, and chunks holding a NaN, an Inf or a -0. The packed codes also go through
// store_e2m_chunk and load_e2m_chunk (vector and element by element) and back.
template <int kMantissaBits>
void check_e2m_chunk(long samples) {
  std::vector<float> midpoints;
  for (uint8_t k = 0; k + 1 < (4 << kMantissaBits); ++k) {
    const float a = kMantissaBits == 1 ? coat_e2m1_to_f32(k) : coat_e2m3_to_f32(k);
    const float b = kMantissaBits == 1 ? coat_e2m1_to_f32(k + 1) : coat_e2m3_to_f32(k + 1);
    midpoints.push_back((a + b) / 2);
  }
  midpoints.push_back(coat::device::E2m<kMantissaBits>::kMax);
  long mismatches = 0;
  for (long i = 0; i < samples; ++i) {
    const float amax = u2f(static_cast<uint32_t>(rng() % 0x7F000000u));
    const float scale = coat_e2m_scale_from_amax_bits(f2u(amax), kMantissaBits);  // of the midpoints' values
    float v[8];
    for (int e = 0; e < 8; ++e) {
      const uint64_t r = rng();
      const float sign = r & 1 ? -1.0f : 1.0f;
      float x;
      switch ((r >> 1) % 4) {
        case 0: x = static_cast<float>(amax * uniform()); break;
        case 1: x = static_cast<float>(amax * ldexp(uniform(), -static_cast<int>((r >> 8) % 40))); break;
        default: {  // a midpoint's value, moved by up to 2 ulps
          const float q = nextafterf(midpoints[(r >> 8) % midpoints.size()], (r >> 16) & 1 ? INFINITY : 0.0f);
          x = fminf(q * scale, amax);
          if ((r >> 17) & 1) x = nextafterf(x, 0.0f);
        }
      }
      v[e] = sign * x;
    }
    if (i % 7 == 0) v[rng() % 8] = (i / 7) % 3 == 0 ? NAN : (i / 7) % 3 == 1 ? -INFINITY : -0.0f;
    // the block's scale, as the kernels take it: its amax may be another chunk's (amax), a NaN or an Inf here
    uint32_t amax_bits = f2u(amax);
    for (int e = 0; e < 8; ++e) amax_bits = coat_max_bits(amax_bits, coat_magnitude_bits(v[e]));
    const float s = coat_e2m_scale_from_amax_bits(amax_bits, kMantissaBits);
    const coat::device::PackedCodes packed = coat::device::encode_e2m_chunk<kMantissaBits>(v, s, 1.0f / s);
    for (int e = 0; e < 8; ++e)
      if (coat::device::e2m_code_at<kMantissaBits>(packed, e) != coat_quantize_e2m_scaled(v[e], 1.0f / s, kMantissaBits))
        ++mismatches;
    // a chunk of `count` codes stores its bytes and loads its codes back, vector-wise when whole
    const int count = 1 + static_cast<int>(rng() % 8);
    alignas(8) uint8_t bytes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    coat::device::store_e2m_chunk<kMantissaBits>(bytes, packed, count, count == 8);
    const coat::device::PackedCodes loaded = coat::device::load_e2m_chunk<kMantissaBits>(bytes, count, count == 8);
    for (int e = 0; e < count; ++e)
      if (coat::device::e2m_code_at<kMantissaBits>(loaded, e) != coat::device::e2m_code_at<kMantissaBits>(packed, e))
        ++mismatches;
  }
  CHECK(mismatches == 0, "encode_e2m_chunk<%d> != coat_quantize_e2m_scaled on %ld of %ld codes", kMantissaBits,
        mismatches, samples * 8);
  printf("encode_e2m_chunk<%d> checked on %ld random chunks: %ld mismatches\n", kMantissaBits, samples, mismatches);
}

// e2m3x8_to_e4m3 (the SWAR expansion of eight packed FP6 codes) against coat_e2m3_to_e4m3 of each code, for every
// code in every position.
void check_e2m3_expansion() {
  long mismatches = 0;
  for (uint32_t code = 0; code < 64; ++code)
    for (int e = 0; e < 8; ++e) {
      const uint64_t word = (uint64_t{code} << (6 * e)) | (uint64_t{(code * 37u + 11u) & 63u} << (6 * ((e + 3) % 8)));
      const coat::device::Codes packed{static_cast<uint32_t>(word), static_cast<uint32_t>(word >> 32)};
      const coat::device::Codes expanded = e2m3x8_to_e4m3(packed);
      for (int k = 0; k < 8; ++k) {
        const uint8_t expected = coat_e2m3_to_e4m3(static_cast<uint8_t>((word >> (6 * k)) & 63u));
        const uint8_t got = static_cast<uint8_t>((k < 4 ? expanded.lo >> (8 * k) : expanded.hi >> (8 * (k - 4))) & 0xFFu);
        if (got != expected) ++mismatches;
      }
    }
  CHECK(mismatches == 0, "e2m3x8_to_e4m3 != coat_e2m3_to_e4m3 on %ld codes", mismatches);
  printf("e2m3x8_to_e4m3 checked on every code in every position: %ld mismatches\n", mismatches);
}

}  // namespace

int main(int argc, char** argv) {
  const bool full = argc > 1 && strcmp(argv[1], "full") == 0;
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  check_sigmoid_near(full ? 1u : 4099u);
  check_decoded_gate_silu<COAT_ACT_SILU>();
  check_decoded_gate_silu<COAT_ACT_GELU_TANH>();
  check_decoded_gate_silu<COAT_ACT_QUICK_GELU>();
  check_bf16_gate_silu<COAT_ACT_SILU>();
  check_bf16_gate_silu<COAT_ACT_GELU_TANH>();
  check_bf16_gate_silu<COAT_ACT_QUICK_GELU>();
  check_quotient(full ? 100000000L : 2000000L);
  check_scale_from_amax(full ? 1u : 997u);
  check_e2m_scale_from_amax<1>(full ? 1u : 997u);
  check_e2m_scale_from_amax<3>(full ? 1u : 997u);
  check_e2m_fast_code<1>(full ? 1u : 97u);
  check_e2m_fast_code<3>(full ? 1u : 97u);
  check_e2m_chunk<1>(full ? 20000000L : 500000L);
  check_e2m_chunk<3>(full ? 20000000L : 500000L);
  check_e2m3_expansion();

  const coat_dtype dtypes[] = {COAT_BFLOAT16, COAT_FLOAT32, COAT_FLOAT16};
  const int64_t groups[] = {16, 32, 64, 128};
  // (rows, cols): every lane count L = 32 ... 1024, odd widths, widths of a partial group, one row.
  const int64_t rmsnorm_shapes[][2] = {{5, 64},   {67, 176}, {9, 1000}, {3, 7},     {4, 100},  {33, 1032},
                                       {2, 4096}, {3, 8200}, {2, 16384}, {1, 20000}, {2, 32768}, {1, 8}};
  int i = 0;
  for (const auto& shape : rmsnorm_shapes) {
    for (int variant = 0; variant < (quick ? 1 : 3); ++variant, ++i) {
      emu_sms = 1 + i % 3;
      const coat_dtype x_dtype = dtypes[(i + variant) % 3], w_dtype = dtypes[(i + 2 * variant + 1) % 3];
      const int64_t stride = shape[1] + (variant == 1 ? 8 : 0);
      const int offset = variant == 2 && shape[1] <= 4096 ? 1 : 0;
      // A residual of dy's dtype or, every other case, of another: fp32 for 16-bit dy (the 16-byte path's mixed
      // pair), bf16 for fp32 dy (element by element). Not beside the widest rows, slow to emulate (see below).
      const coat_dtype other = x_dtype == COAT_FLOAT32 ? COAT_BFLOAT16 : COAT_FLOAT32;
      std::vector<coat_dtype> residual_dtypes;
      if (shape[1] <= 4096) residual_dtypes.push_back(i % 2 ? other : x_dtype);
      rmsnorm_case(shape[0], shape[1], stride, offset, x_dtype, w_dtype, groups[(i + variant) % 4],
                   (i + variant) % 2 ? COAT_E5M2 : COAT_E4M3, variant != 1, variant == 0 ? kSpecial : kPlain,
                   variant == 2 ? 0.0f : 1e-6f, residual_dtypes, i % 3 == 1 ? 1.0f : 0.0f);  // 1: Gemma's norms
    }
  }
  // Slices of several rows in the backward: 4 rows of one warp (L = 32), 2 rows of two warps (L = 64).
  emu_sms = 1;
  rmsnorm_case(3 * 2048 + 5, 64, 64, 0, COAT_BFLOAT16, COAT_BFLOAT16, 16, COAT_E4M3, true, kPlain, 1e-6f,
               {COAT_BFLOAT16});
  emu_sms = 2;
  rmsnorm_case(1029, 2048, 2048, 0, COAT_BFLOAT16, COAT_FLOAT32, 32, COAT_E4M3, true, kSpecial, 1e-6f,
               {COAT_FLOAT32});
  // Residuals beside finite rows (with special values most rows above are NaN or Inf, which hides the sum): each
  // residual Io of the 256-thread kernel (dy's dtype, fp32 beside 16-bit dy, element by element for another
  // pair or a misaligned residual), and the 1024-thread kernel, which loads rows without prefetching.
  emu_sms = 1;
  rmsnorm_case(67, 176, 176, 0, COAT_BFLOAT16, COAT_BFLOAT16, 16, COAT_E4M3, true, kPlain, 1e-6f, {COAT_FLOAT32});
  rmsnorm_case(9, 1000, 1000, 0, COAT_FLOAT16, COAT_FLOAT32, 32, COAT_E4M3, true, kPlain, 1e-6f, {COAT_FLOAT16});
  rmsnorm_case(33, 1032, 1040, 0, COAT_FLOAT32, COAT_BFLOAT16, 64, COAT_E5M2, false, kPlain, 1e-6f, {COAT_FLOAT32});
  rmsnorm_case(4, 100, 100, 0, COAT_FLOAT32, COAT_FLOAT16, 128, COAT_E4M3, true, kPlain, 1e-6f, {COAT_BFLOAT16});
  rmsnorm_case(5, 64, 64, 1, COAT_BFLOAT16, COAT_FLOAT32, 16, COAT_E4M3, true, kPlain, 1e-6f, {COAT_BFLOAT16});
  emu_sms = 2;
  rmsnorm_case(2, 16392, 16392, 0, COAT_FLOAT16, COAT_BFLOAT16, 16, COAT_E4M3, false, kPlain, 1e-6f, {COAT_FLOAT32},
               1.0f);

  const int64_t silu_shapes[][2] = {{5, 64},   {37, 176}, {9, 1000}, {3, 7}, {4, 100},
                                    {6, 1032}, {3, 2048}, {70, 16},  {1, 8}};
  const coat_activation acts[] = {COAT_ACT_SILU, COAT_ACT_GELU_TANH, COAT_ACT_QUICK_GELU};
  i = 0;
  for (const auto& shape : silu_shapes) {
    for (int variant = 0; variant < (quick ? 1 : 4); ++variant, ++i) {
      emu_sms = 1 + i % 3;
      silu_case(shape[0], shape[1], variant == 2 ? 8 : 0, variant == 3 ? 1 : 0, dtypes[(i + variant) % 3],
                variant != 1, variant % 2 == 1, groups[(i + variant) % 4], (i + variant) % 2 ? COAT_E5M2 : COAT_E4M3,
                variant != 2, variant == 0 ? kSpecial : kPlain, acts[(i / 2) % 3], i % 3 != 2);
    }
  }
  // Groups of 64 and 128, where the backward shares FP4 gates' factors by shuffle: groups cut by a row's end,
  // lanes past the end in a group with lanes inside it, a group wholly past it in the warp's chunk.
  const int64_t wide_group_shapes[][2] = {{37, 176}, {9, 1000}, {4, 100}, {3, 300}};
  i = 0;
  for (const auto& shape : wide_group_shapes) {
    for (const int64_t group : {64, 128}) {
      emu_sms = 1 + i % 2;
      silu_case(shape[0], shape[1], 0, 0, dtypes[i % 3], true, i % 2 == 1, group, COAT_E4M3, true,
                i % 2 == 0 ? kSpecial : kPlain, acts[(i / 2) % 3], i % 3 != 1);
      ++i;
    }
  }
  printf("%s: %d failures\n", failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
