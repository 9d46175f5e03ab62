// Runs csrc/cuda/rope.cu's kernels under the CPU emulation (cuda_runtime.h here) and compares their outputs with
// the C core's byte for byte: every dtype pair, contiguous q/k, column slices of one q/k/v GEMM output (aligned:
// the 16-byte paths; shifted by one element: the element-wise ones), transposed views, tables with batch 1 and B
// and padded rows, NaN / Inf / zero / subnormal values. rotary_embedding: forward and inverse, head_dim from 2 to
// 1024. qk_norm_rope: q_out, k_out, the saved codes, scales and rstd, head_dim from 2 to 256 (one row a warp, or
// 2-16 rows a warp), every save group size, weight offsets 0 and 1, fp32 and bf16 weights. Built and run by run.sh.
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

// q and k (or one q/k/v GEMM output holding both) and the tables of a's shape in `layout`, into storage.
static void fill_inputs(coat_rope_args& a, Layout layout, int64_t table_batch, int64_t table_pad,
                        std::vector<Buffer>& storage) {
  const int64_t batch = a.batch, seq = a.seq, q_heads = a.q_heads, k_heads = a.k_heads;
  const coat_dtype dtype = a.dtype, table_dtype = a.table_dtype;
  const int64_t d = a.head_dim;
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
}

static void run_case(int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t head_dim, coat_dtype dtype,
                     coat_dtype table_dtype, Layout layout, int64_t table_batch, int64_t table_pad, int inverse) {
  ++cases;
  coat_rope_args a{};
  a.batch = batch, a.seq = seq, a.q_heads = q_heads, a.k_heads = k_heads, a.head_dim = head_dim;
  a.dtype = dtype, a.table_dtype = table_dtype;

  std::vector<Buffer> storage;
  fill_inputs(a, layout, table_batch, table_pad, storage);
  const int64_t d = head_dim;
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


// Whether the n bytes at x and y are equal; reports the first difference of `what` otherwise.
static bool same_bytes(const void* x, const void* y, size_t n, const char* what, const char* where) {
  const uint8_t* p = static_cast<const uint8_t*>(x);
  const uint8_t* q = static_cast<const uint8_t*>(y);
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != q[i]) {
      if (++failures < 20) printf("FAIL %s byte %zu: %02x (C core) vs %02x (emulated CUDA): %s\n", what, i, p[i], q[i], where);
      return false;
    }
  }
  return true;
}

static void run_qk_norm_case(int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                             coat_dtype dtype, coat_dtype table_dtype, coat_dtype weight_dtype, Layout layout,
                             int64_t table_batch, int64_t table_pad, int64_t group_size, float weight_offset) {
  ++cases;
  coat_qk_norm_rope_args a{};
  coat_rope_args& r = a.rope;
  r.batch = batch, r.seq = seq, r.q_heads = q_heads, r.k_heads = k_heads, r.head_dim = head_dim;
  r.dtype = dtype, r.table_dtype = table_dtype;
  std::vector<Buffer> storage;
  storage.reserve(8);
  fill_inputs(r, layout, table_batch, table_pad, storage);
  storage.emplace_back(head_dim, weight_dtype, 0);
  a.q_weight = storage.back().data;
  storage.emplace_back(head_dim, weight_dtype, 0);
  a.k_weight = storage.back().data;
  a.weight_dtype = weight_dtype, a.weight_offset = weight_offset, a.eps = 1e-6f, a.save_group_size = group_size;

  const int64_t q_rows = batch * seq * q_heads, k_rows = batch * seq * k_heads;
  const int64_t groups = (head_dim + group_size - 1) / group_size;
  struct Outputs {
    std::vector<uint8_t> q_out, k_out, q_saved, k_saved;
    std::vector<float> q_scales, k_scales, q_rstd, k_rstd;
  } out[2];
  for (Outputs& o : out) {
    o.q_out.assign(q_rows * head_dim * element_size(dtype) + 16, 0xAB);
    o.k_out.assign(k_rows * head_dim * element_size(dtype) + 16, 0xAB);
    o.q_saved.assign(q_rows * head_dim + 16, 0xAB);
    o.k_saved.assign(k_rows * head_dim + 16, 0xAB);
    o.q_scales.assign(q_rows * groups + 1, -1.0f);
    o.k_scales.assign(k_rows * groups + 1, -1.0f);
    o.q_rstd.assign(q_rows + 1, -1.0f);
    o.k_rstd.assign(k_rows + 1, -1.0f);
  }
  coat_status status[2];
  for (int device = 0; device < 2; ++device) {
    Outputs& o = out[device];
    r.q_out = o.q_out.data(), r.k_out = o.k_out.data();
    a.q_saved = o.q_saved.data(), a.k_saved = o.k_saved.data();
    a.q_saved_scales = o.q_scales.data(), a.k_saved_scales = o.k_scales.data();
    a.q_rstd = o.q_rstd.data(), a.k_rstd = o.k_rstd.data();
    status[device] = device == 0 ? coat_qk_norm_rope_cpu(&a) : coat_qk_norm_rope_cuda(&a, nullptr);
  }
  char where[200];
  snprintf(where, sizeof where, "qk_norm B=%lld S=%lld Hq=%lld Hk=%lld D=%lld dtype=%d table=%d weight=%d layout=%d G=%lld offset=%g",
           (long long)batch, (long long)seq, (long long)q_heads, (long long)k_heads, (long long)head_dim, dtype,
           table_dtype, weight_dtype, layout, (long long)group_size, weight_offset);
  if (status[0] != COAT_SUCCESS || status[1] != COAT_SUCCESS) {
    ++failures;
    printf("FAIL status %d / %d: %s\n", status[0], status[1], where);
    return;
  }
  same_bytes(out[0].q_out.data(), out[1].q_out.data(), out[0].q_out.size(), "q_out", where);
  same_bytes(out[0].k_out.data(), out[1].k_out.data(), out[0].k_out.size(), "k_out", where);
  same_bytes(out[0].q_saved.data(), out[1].q_saved.data(), out[0].q_saved.size(), "q_saved", where);
  same_bytes(out[0].k_saved.data(), out[1].k_saved.data(), out[0].k_saved.size(), "k_saved", where);
  same_bytes(out[0].q_scales.data(), out[1].q_scales.data(), 4 * out[0].q_scales.size(), "q_saved_scales", where);
  same_bytes(out[0].k_scales.data(), out[1].k_scales.data(), 4 * out[0].k_scales.size(), "k_saved_scales", where);
  same_bytes(out[0].q_rstd.data(), out[1].q_rstd.data(), 4 * out[0].q_rstd.size(), "q_rstd", where);
  same_bytes(out[0].k_rstd.data(), out[1].k_rstd.data(), 4 * out[0].k_rstd.size(), "k_rstd", where);
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
  // qk_norm_rope (B, S, Hq, Hk, D): Qwen3's GQA and head_dim 128 (two rows a warp), Gemma 3's 256 (one), 64 and
  // 16 (four and eight rows a warp), 96 and 80 (rows of 12 and 10 lanes), heads not a multiple of the four a slot
  // takes, k without heads, and head_dim whose half is not whole chunks (the general kernel only).
  const int64_t qk_shapes[][5] = {{1, 3, 8, 2, 128}, {2, 2, 4, 2, 256}, {2, 5, 3, 2, 64}, {1, 9, 2, 1, 16},
                                  {1, 3, 5, 3, 96},  {2, 2, 3, 0, 80},  {1, 2, 2, 2, 6},  {1, 2, 3, 1, 100},
                                  {1, 1, 1, 1, 2}};
  const coat_dtype qk_dtypes[] = {COAT_BFLOAT16, COAT_FLOAT16, COAT_FLOAT32};
  const int64_t group_sizes[] = {16, 32, 64, 128};
  i = 0;
  for (const auto& s : qk_shapes)
    for (coat_dtype dtype : qk_dtypes)
      for (coat_dtype table_dtype : dtypes)
        for (int layout = kContiguous; layout <= kTransposed; ++layout, ++i)
          run_qk_norm_case(s[0], s[1], s[2], s[3], s[4], dtype, table_dtype, i % 3 ? COAT_BFLOAT16 : COAT_FLOAT32,
                           static_cast<Layout>(layout), i % 2 ? s[0] : 1, (i / 2) % 3 == 0 ? 0 : (i / 2) % 3 == 1 ? 8 : 3,
                           group_sizes[i % 4], (i / 4) % 2 ? 1.0f : 0.0f);
  printf("rope: %d cases, %s: %d failures\n", cases, failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
