// Runs csrc/cuda/stats.cu's kernel under the CPU emulation (cuda_runtime.h here) and compares every measure's sums
// with the C core's bit for bit: one measure per call and many per call (sums shared between measures, more than
// one launch's worth), every dtype and FP8 format, per-tensor and 1 x G scales, every row or sampled rows (x indexed
// or holding them, a row index outside q), amax from x or from the scales, transposed x, rows narrower than a
// thread's four elements, NaN / Inf / zero / subnormal values and scales. Built and run by run.sh.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <random>
#include <vector>

#include "coat/float_bits.h"
#include "coat/stats.h"

static std::mt19937_64 rng(2026);
static int failures = 0;
static int cases = 0;

static float random_value() {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double r = uniform(rng);
  if (r < 0.002) return NAN;
  if (r < 0.004) return INFINITY;
  if (r < 0.02) return 0.0f;
  if (r < 0.025) return coat_f32_from_bits((uint32_t)(rng() & 0x807FFFFFu));  // fp32 subnormal
  return (float)(normal(rng) * exp(2.0 * normal(rng)));
}

static float random_scale() {
  const uint64_t r = rng() % 1000;
  if (r == 0) return NAN;
  if (r == 1) return INFINITY;
  if (r == 2) return 0.0f;
  return (float)exp(std::normal_distribution<double>(-3.0, 3.0)(rng));
}

// One measured tensor and the memory behind it.
struct Tensor {
  std::vector<uint8_t> x;  // dtype elements
  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<int64_t> row_index;
  coat_quantization_measure m{};
};

static Tensor make(int64_t q_rows, int64_t cols, coat_dtype dtype, coat_fp8_format format, int64_t group_size,
                   int64_t sampled, bool x_indexed, bool transposed_x, float amax_per_scale, bool outside) {
  Tensor t;
  const int64_t rows = sampled > 0 ? sampled : q_rows;
  const int64_t x_rows = sampled > 0 && !x_indexed ? rows : q_rows;
  const size_t esize = dtype == COAT_FLOAT32 ? 4 : 2;
  t.x.resize(x_rows * cols * esize);
  for (int64_t i = 0; i < x_rows * cols; ++i) {
    const float v = random_value();
    if (dtype == COAT_FLOAT32) {
      memcpy(&t.x[4 * i], &v, 4);
    } else {
      const uint16_t h = dtype == COAT_BFLOAT16 ? coat_f32_to_bf16(v) : coat_f32_to_f16(v);
      memcpy(&t.x[2 * i], &h, 2);
    }
  }
  t.q.resize(q_rows * cols);
  for (auto& code : t.q) code = (uint8_t)rng();
  const int64_t ngroups = group_size == 0 ? 1 : (cols + group_size - 1) / group_size;
  t.scales.resize(group_size == 0 ? 1 : q_rows * ngroups);
  for (auto& s : t.scales) s = random_scale();
  if (sampled > 0) {
    for (int64_t i = 0; i < rows; ++i) t.row_index.push_back((int64_t)(rng() % q_rows));
    if (outside) t.row_index[rows / 2] = q_rows;
  }
  coat_quantization_measure& m = t.m;
  m.x = t.x.data();
  m.dtype = dtype;
  // A transposed x: element (r, c) at c * x_rows + r, the storage of the transpose read through strides.
  m.x_row_stride = transposed_x ? 1 : cols;
  m.x_col_stride = transposed_x ? x_rows : 1;
  m.x_indexed = x_indexed;
  m.q = t.q.data();
  m.format = format;
  m.q_row_stride = cols;
  m.q_col_stride = 1;
  m.scales = t.scales.data();
  m.group_size = group_size;
  m.nscales = (int64_t)t.scales.size();
  m.amax_per_scale = amax_per_scale;
  m.q_rows = q_rows;
  m.row_index = sampled > 0 ? t.row_index.data() : nullptr;
  m.rows = rows;
  m.cols = cols;
  return t;
}

// The measures of `tensors`, measure i adding into sums slot slots[i]: one call of the C core per measure, and
// one emulated CUDA call for all of them; every sums value compared bit for bit.
static void run_case(std::vector<Tensor>& tensors, const std::vector<int>& slots, const char* what) {
  ++cases;
  int nslots = 0;
  for (int s : slots) nslots = s + 1 > nslots ? s + 1 : nslots;
  std::vector<double> cpu(nslots * COAT_STATS_SUMS, 0.0), emulated(nslots * COAT_STATS_SUMS, 0.0);
  std::vector<coat_quantization_measure> measures;
  for (size_t i = 0; i < tensors.size(); ++i) {
    coat_quantization_measure m = tensors[i].m;
    m.sums = cpu.data() + slots[i] * COAT_STATS_SUMS;
    if (coat_quantization_sums_cpu(&m, 1) != COAT_SUCCESS) {
      ++failures;
      printf("FAIL %s: C core status\n", what);
      return;
    }
    m.sums = emulated.data() + slots[i] * COAT_STATS_SUMS;
    measures.push_back(m);
  }
  std::vector<double> workspace(coat_quantization_sums_workspace(measures.data(), (int64_t)measures.size()));
  if (coat_quantization_sums_cuda(measures.data(), (int64_t)measures.size(), workspace.data(), nullptr) !=
      COAT_SUCCESS) {
    ++failures;
    printf("FAIL %s: emulated CUDA status\n", what);
    return;
  }
  if (memcmp(cpu.data(), emulated.data(), cpu.size() * sizeof(double)) != 0) {
    for (size_t i = 0; i < cpu.size(); ++i)
      if (memcmp(&cpu[i], &emulated[i], sizeof(double)) != 0) {
        printf("FAIL %s: sums slot %zu value %zu: %.17g (C core) vs %.17g (emulated CUDA)\n", what,
               i / COAT_STATS_SUMS, i % COAT_STATS_SUMS, cpu[i], emulated[i]);
        break;
      }
    ++failures;
  }
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  const coat_dtype dtypes[] = {COAT_FLOAT32, COAT_BFLOAT16, COAT_FLOAT16};
  const coat_fp8_format formats[] = {COAT_E4M3, COAT_E5M2};
  const int64_t group_sizes[] = {0, 16, 32, 128};
  // (q_rows, cols, sampled rows): one tile, several tiles, rows narrower than four elements, a row of 1030.
  const int64_t shapes[][3] = {{7, 40, 0}, {37, 300, 16}, {5, 3, 0}, {6, 1, 4}, {12, 1030, 5}, {200, 96, 64}};
  int i = 0;
  for (const auto& s : shapes)
    for (coat_dtype dtype : dtypes)
      for (coat_fp8_format format : formats)
        for (int64_t group_size : group_sizes) {
          if (quick && i % 3 != 0) {
            ++i;
            continue;
          }
          const bool sampled = s[2] > 0;
          std::vector<Tensor> one;
          one.push_back(make(s[0], s[1], dtype, format, group_size, s[2], i % 2 == 0, i % 4 == 1,
                             sampled && i % 3 == 0 ? 448.0f : 0.0f, sampled && i % 7 == 0));
          run_case(one, {0}, "one measure");
          ++i;
        }
  // 30 measures in one call (two launches of at most 24), sums shared within and across the launches.
  std::vector<Tensor> many;
  std::vector<int> slots;
  for (int k = 0; k < 30; ++k) {
    const auto& s = shapes[k % 6];
    many.push_back(make(s[0], s[1], dtypes[k % 3], formats[k % 2], group_sizes[k % 4], s[2], k % 2 == 0, k % 5 == 1,
                        s[2] > 0 && k % 3 == 0 ? 57344.0f : 0.0f, false));
    slots.push_back(k % 7);
  }
  run_case(many, slots, "30 measures in one call");
  printf("stats: %d cases, %s: %d failures\n", cases, failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
