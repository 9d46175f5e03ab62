// Runs csrc/cuda/rope.cu's kernel under the CPU emulation (cuda_runtime.h here) and compares q_out and k_out with
// the C core's byte for byte: every dtype pair, forward and inverse, contiguous q/k, column slices of one q/k/v
// GEMM output (aligned: the 16-byte path; shifted by one element: the element-wise path), transposed views,
// tables with batch 1 and B and padded rows, head_dim from 2 to 1024, NaN / Inf / zero / subnormal values.
// Built and run by run.sh.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <random>
#include <vector>

#include "coat/float_bits.h"
#include "coat/rope.h"

static std::mt19937_64 rng(2025);
static int failures = 0;
static int cases = 0;

static size_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

static float random_value() {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double r = uniform(rng);
  if (r < 0.003) return NAN;
  if (r < 0.005) return INFINITY;
  if (r < 0.006) return -INFINITY;
  if (r < 0.02) return 0.0f;
  if (r < 0.025) return -0.0f;
  if (r < 0.03) return coat_f32_from_bits((uint32_t)(rng() & 0x807FFFFFu));  // fp32 subnormal
  return (float)(normal(rng) * exp(normal(rng)));
}

// Elements with a 16-byte aligned start `shift` elements in, every element random in `dtype`.
struct Buffer {
  std::vector<uint8_t> bytes;
  uint8_t* data;
  Buffer(int64_t elements, coat_dtype dtype, int shift) : bytes((elements + shift) * element_size(dtype) + 16) {
    data = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 15) & ~uintptr_t{15}) +
           shift * element_size(dtype);
    for (int64_t i = 0; i < elements; ++i) {
      const float v = random_value();
      if (dtype == COAT_FLOAT32) {
        memcpy(data + 4 * i, &v, 4);
      } else {
        const uint16_t h = dtype == COAT_BFLOAT16 ? coat_f32_to_bf16(v) : coat_f32_to_f16(v);
        memcpy(data + 2 * i, &h, 2);
      }
    }
  }
};

enum Layout { kContiguous, kGemm, kGemmUnaligned, kTransposed };

static void run_case(int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t head_dim, coat_dtype dtype,
                     coat_dtype table_dtype, Layout layout, int64_t table_batch, int64_t table_pad, int inverse) {
  ++cases;
  coat_rope_args a{};
  a.batch = batch, a.seq = seq, a.q_heads = q_heads, a.k_heads = k_heads, a.head_dim = head_dim;
  a.dtype = dtype, a.table_dtype = table_dtype;

  const int64_t d = head_dim;
  std::vector<Buffer> storage;
  storage.reserve(4);
  if (layout == kGemm || layout == kGemmUnaligned) {
    const int64_t width = (q_heads + 2 * k_heads) * d;
    storage.emplace_back(batch * seq * width, dtype, layout == kGemmUnaligned ? 1 : 0);
    a.q = storage.back().data;
    a.k = storage.back().data + q_heads * d * element_size(dtype);
    const int64_t strides[3] = {seq * width, width, d};
    memcpy(a.q_strides, strides, sizeof strides);
    memcpy(a.k_strides, strides, sizeof strides);
  } else {
    for (int tensor = 0; tensor < 2; ++tensor) {
      const int64_t heads = tensor == 0 ? q_heads : k_heads;
      storage.emplace_back(batch * seq * heads * d, dtype, 0);
      const int64_t contiguous[3] = {seq * heads * d, heads * d, d};
      const int64_t transposed[3] = {heads * seq * d, d, seq * d};  // [B, H, S, D] storage seen as [B, S, H, D]
      memcpy(tensor == 0 ? a.q_strides : a.k_strides, layout == kTransposed ? transposed : contiguous, sizeof contiguous);
      (tensor == 0 ? a.q : a.k) = storage.back().data;
    }
  }
  const int64_t row = d + table_pad;
  for (int table = 0; table < 2; ++table) {
    storage.emplace_back(table_batch * seq * row, table_dtype, table_pad % 2);
    (table == 0 ? a.cos : a.sin) = storage.back().data;
    int64_t* strides = table == 0 ? a.cos_strides : a.sin_strides;
    strides[0] = table_batch == 1 ? 0 : seq * row;
    strides[1] = row;
  }

  const size_t q_bytes = batch * seq * q_heads * d * element_size(dtype);
  const size_t k_bytes = batch * seq * k_heads * d * element_size(dtype);
  std::vector<uint8_t> outputs[2][2];  // [cpu, emulated][q, k], 16-byte aligned by operator new
  for (auto& pair : outputs) {
    pair[0].assign(q_bytes + 16, 0xAB);
    pair[1].assign(k_bytes + 16, 0xAB);
  }
  coat_status status[2];
  a.q_out = outputs[0][0].data(), a.k_out = outputs[0][1].data();
  status[0] = coat_rotary_embedding_cpu(&a, inverse);
  a.q_out = outputs[1][0].data(), a.k_out = outputs[1][1].data();
  status[1] = coat_rotary_embedding_cuda(&a, inverse, nullptr);

  if (status[0] != COAT_SUCCESS || status[1] != COAT_SUCCESS) {
    ++failures;
    printf("FAIL status %d / %d\n", status[0], status[1]);
    return;
  }
  for (int tensor = 0; tensor < 2; ++tensor) {
    const std::vector<uint8_t>& cpu = outputs[0][tensor];
    const std::vector<uint8_t>& emulated = outputs[1][tensor];
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (cpu[i] != emulated[i]) {
        if (++failures < 20)
          printf("FAIL %c_out byte %zu: %02x (C core) vs %02x (emulated CUDA): B=%lld S=%lld Hq=%lld Hk=%lld D=%lld dtype=%d table=%d layout=%d "
                 "table_batch=%lld pad=%lld inverse=%d\n",
                 tensor ? 'k' : 'q', i, cpu[i], emulated[i], (long long)batch, (long long)seq, (long long)q_heads, (long long)k_heads,
                 (long long)head_dim, dtype, table_dtype, layout, (long long)table_batch, (long long)table_pad, inverse);
        break;
      }
    }
  }
}

int main() {
  // (B, S, Hq, Hk, D): GQA, many heads per token (several head batches per thread), one head, k without heads,
  // the smallest and largest head_dim, head_dim whose half is not a multiple of 8, enough tokens for many blocks.
  const int64_t shapes[][5] = {{2, 5, 4, 2, 64}, {1, 3, 40, 8, 128}, {3, 2, 1, 1, 2}, {2, 3, 3, 0, 16},
                               {1, 2, 2, 1, 1024}, {2, 3, 2, 3, 6}, {1, 4, 5, 2, 1000}, {2, 40, 2, 2, 32},
                               {1, 2, 7, 7, 80}};
  const coat_dtype dtypes[] = {COAT_FLOAT32, COAT_BFLOAT16, COAT_FLOAT16};
  int i = 0;
  for (const auto& s : shapes)
    for (coat_dtype dtype : dtypes)
      for (coat_dtype table_dtype : dtypes)
        for (int layout = kContiguous; layout <= kTransposed; ++layout, ++i)
          run_case(s[0], s[1], s[2], s[3], s[4], dtype, table_dtype, static_cast<Layout>(layout), i % 2 ? s[0] : 1,
                   (i / 2) % 3 == 0 ? 0 : (i / 2) % 3 == 1 ? 8 : 3, (i / 3) % 2);
  printf("rope: %d cases, %s: %d failures\n", cases, failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
