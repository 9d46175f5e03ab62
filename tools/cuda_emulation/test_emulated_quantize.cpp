// Runs csrc/cuda/quantize.cu's kernels under the CPU emulation (cuda_runtime.h here) and compares every output with
// the C core's, byte for byte. FP8: quantize_group (with and without the transpose), group_amax, tensor_amax,
// quantize_tensor (with the transpose, and into wider outputs) and dequantize, in both formats. FP4 and FP6:
// quantize_fp4 / fp6, dequantize_fp4 / fp6 and fp4_to_e4m3 / fp6_to_e4m3. Cases: the three input dtypes, every group / block size, rows narrower than a
// group, odd widths and widths that are not multiples of 8 (the element-wise path), padded and misaligned row
// strides, misaligned outputs, several tiles per grid, and groups holding NaN, Inf, zeros, subnormals, huge values
// and values small enough for scales below 2^-80 (the quantizers' slow path). It also checks the FP4 and FP6
// encoders against their definition on every float (on a sample with `quick`). Built and run by run.sh.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <random>
#include <vector>

#include "check.h"
#include "coat/float_bits.h"
#include "coat/fp4.h"
#include "coat/fp6.h"
#include "coat/quantize.h"

static std::mt19937_64 rng(2027);

static size_t element_size(coat_dtype dtype) { return dtype == COAT_FLOAT32 ? 4 : 2; }

static float random_value(bool specials) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  if (specials) {
    const double r = uniform(rng);
    if (r < 0.002) return NAN;
    if (r < 0.003) return INFINITY;
    if (r < 0.004) return -INFINITY;
    if (r < 0.02) return 0.0f;
    if (r < 0.03) return -0.0f;
    if (r < 0.04) return coat_f32_from_bits((uint32_t)(rng() & 0x807FFFFFu));  // fp32 subnormal
    if (r < 0.045) return 3.0e38f;
    if (r < 0.05) return (float)(normal(rng) * 1e-30);  // a group of these has a scale below 2^-80
  }
  return (float)(normal(rng) * exp(4.0 * normal(rng)));
}

// `count` bytes starting `shift` bytes past a 16-byte boundary, plus 16 bytes after them that must stay `fill`.
struct Buffer {
  std::vector<uint8_t> bytes;
  uint8_t* data;
  size_t count;
  Buffer(size_t count, size_t shift, uint8_t fill) : bytes(count + shift + 32, fill), count(count) {
    data = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 15) & ~uintptr_t{15}) + shift;
  }
};

static bool same_bytes(const Buffer& a, const Buffer& b, const char* what, int64_t rows, int64_t cols, int dtype,
                       int64_t block_size, int64_t row_stride, int shift) {
  const bool same = memcmp(a.data, b.data, a.count + 16) == 0;
  CHECK(same, "%s: C core and emulated CUDA differ: rows=%lld cols=%lld dtype=%d B=%lld row_stride=%lld shift=%d", what,
        (long long)rows, (long long)cols, dtype, (long long)block_size, (long long)row_stride, shift);
  return same;
}

static int cases = 0;

// x as `dtype` elements, rows x cols with rows row_stride apart, starting `shift` elements past a 16-byte boundary.
static Buffer random_matrix(int64_t rows, int64_t cols, coat_dtype dtype, int64_t row_stride, int shift, bool specials) {
  const size_t size = element_size(dtype);
  Buffer x(((rows ? rows - 1 : 0) * row_stride + cols) * size, shift * size, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < row_stride; ++c) {
      if (r == rows - 1 && c >= cols) break;
      const float v = random_value(specials);
      uint8_t* target = x.data + (r * row_stride + c) * size;
      if (dtype == COAT_FLOAT32) {
        memcpy(target, &v, 4);
      } else {
        const uint16_t h = dtype == COAT_BFLOAT16 ? coat_f32_to_bf16(v) : coat_f32_to_f16(v);
        memcpy(target, &h, 2);
      }
    }
  return x;
}

// The entry points of one block-scaled format (coat/quantize.h), C core and CUDA.
struct BlockFormat {
  const char* name;
  int64_t (*row_bytes)(int64_t cols);
  coat_status (*quantize_cpu)(const void*, coat_dtype, int64_t, int64_t, int64_t, int64_t, uint8_t*, float*);
  coat_status (*quantize_cuda)(const void*, coat_dtype, int64_t, int64_t, int64_t, int64_t, uint8_t*, float*,
                               coat_cuda_stream);
  coat_status (*dequantize_cpu)(const uint8_t*, int64_t, int64_t, const float*, int64_t, void*, coat_dtype);
  coat_status (*dequantize_cuda)(const uint8_t*, int64_t, int64_t, const float*, int64_t, void*, coat_dtype,
                                 coat_cuda_stream);
  coat_status (*to_e4m3_cpu)(const uint8_t*, int64_t, int64_t, uint8_t*);
  coat_status (*to_e4m3_cuda)(const uint8_t*, int64_t, int64_t, uint8_t*, coat_cuda_stream);
};

static int64_t fp4_row_bytes(int64_t cols) { return (cols + 1) / 2; }

static const BlockFormat kBlockFormats[] = {
    {"fp4", fp4_row_bytes, coat_quantize_fp4_cpu, coat_quantize_fp4_cuda, coat_dequantize_fp4_cpu,
     coat_dequantize_fp4_cuda, coat_fp4_to_e4m3_cpu, coat_fp4_to_e4m3_cuda},
    {"fp6", coat_fp6_row_bytes, coat_quantize_fp6_cpu, coat_quantize_fp6_cuda, coat_dequantize_fp6_cpu,
     coat_dequantize_fp6_cuda, coat_fp6_to_e4m3_cpu, coat_fp6_to_e4m3_cuda},
};

// shift: elements the input starts past a 16-byte boundary, and bytes the decoders' outputs do (0: vector path).
static void run_case(const BlockFormat& f, int64_t rows, int64_t cols, coat_dtype dtype, int64_t block_size,
                     int64_t row_stride, int shift, bool specials) {
  ++cases;
  const Buffer x = random_matrix(rows, cols, dtype, row_stride, shift, specials);
  const int64_t row_bytes = f.row_bytes(cols);
  const int64_t nblocks = (cols + block_size - 1) / block_size;
  Buffer codes[2] = {Buffer(rows * row_bytes, 0, 0xAB), Buffer(rows * row_bytes, 0, 0xAB)};
  Buffer scales[2] = {Buffer(rows * nblocks * 4, 0, 0xAB), Buffer(rows * nblocks * 4, 0, 0xAB)};
  coat_status status[2];
  status[0] = f.quantize_cpu(x.data, dtype, rows, cols, row_stride, block_size, codes[0].data,
                             reinterpret_cast<float*>(scales[0].data));
  status[1] = f.quantize_cuda(x.data, dtype, rows, cols, row_stride, block_size, codes[1].data,
                              reinterpret_cast<float*>(scales[1].data), nullptr);
  CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "%s quantize status %d / %d", f.name, status[0], status[1]);
  same_bytes(codes[0], codes[1], f.name, rows, cols, dtype, block_size, row_stride, shift);
  same_bytes(scales[0], scales[1], "scales", rows, cols, dtype, block_size, row_stride, shift);

  const float* block_scales = reinterpret_cast<const float*>(scales[0].data);
  for (coat_dtype out_dtype : {COAT_FLOAT32, COAT_BFLOAT16}) {
    const size_t out_bytes = rows * cols * element_size(out_dtype);
    Buffer out[2] = {Buffer(out_bytes, shift, 0xAB), Buffer(out_bytes, shift, 0xAB)};
    status[0] = f.dequantize_cpu(codes[0].data, rows, cols, block_scales, block_size, out[0].data, out_dtype);
    status[1] = f.dequantize_cuda(codes[0].data, rows, cols, block_scales, block_size, out[1].data, out_dtype, nullptr);
    CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "%s dequantize status %d / %d", f.name, status[0],
          status[1]);
    same_bytes(out[0], out[1], out_dtype == COAT_FLOAT32 ? "block dequantize fp32" : "block dequantize bf16", rows,
               cols, dtype, block_size, row_stride, shift);
  }
  Buffer q[2] = {Buffer(rows * cols, shift, 0xAB), Buffer(rows * cols, shift, 0xAB)};
  status[0] = f.to_e4m3_cpu(codes[0].data, rows, cols, q[0].data);
  status[1] = f.to_e4m3_cuda(codes[0].data, rows, cols, q[1].data, nullptr);
  CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "%s to_e4m3 status %d / %d", f.name, status[0],
        status[1]);
  same_bytes(q[0], q[1], "to_e4m3", rows, cols, dtype, block_size, row_stride, shift);
}

// The FP8 quantizers of one matrix against the C core: group scaling (codes, scales, transpose), group and tensor
// amax, tensor scaling from that amax (codes and transpose, standalone and inside wider outputs) and dequantization.
static void run_fp8_case(int64_t rows, int64_t cols, coat_dtype dtype, int64_t group_size, coat_fp8_format format,
                         int64_t row_stride, int shift, bool specials) {
  ++cases;
  const Buffer x = random_matrix(rows, cols, dtype, row_stride, shift, specials);
  const int64_t ngroups = (cols + group_size - 1) / group_size;
  Buffer q[2] = {Buffer(rows * cols, 0, 0xAB), Buffer(rows * cols, 0, 0xAB)};
  Buffer q_t[2] = {Buffer(rows * cols, 0, 0xAB), Buffer(rows * cols, 0, 0xAB)};
  Buffer scales[2] = {Buffer(rows * ngroups * 4, 0, 0xAB), Buffer(rows * ngroups * 4, 0, 0xAB)};
  for (int transpose = 0; transpose < 2; ++transpose) {
    coat_status status[2];
    status[0] = coat_quantize_group_cpu(x.data, dtype, rows, cols, row_stride, group_size, format, q[0].data,
                                        reinterpret_cast<float*>(scales[0].data), transpose ? q_t[0].data : nullptr);
    status[1] = coat_quantize_group_cuda(x.data, dtype, rows, cols, row_stride, group_size, format, q[1].data,
                                         reinterpret_cast<float*>(scales[1].data), transpose ? q_t[1].data : nullptr,
                                         nullptr);
    CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "quantize_group status %d / %d", status[0], status[1]);
    same_bytes(q[0], q[1], "quantize_group codes", rows, cols, dtype, group_size, row_stride, shift);
    same_bytes(scales[0], scales[1], "quantize_group scales", rows, cols, dtype, group_size, row_stride, shift);
    if (transpose) same_bytes(q_t[0], q_t[1], "quantize_group transpose", rows, cols, dtype, group_size, row_stride, shift);
  }

  Buffer amax[2] = {Buffer(rows * ngroups * 4, 0, 0xAB), Buffer(rows * ngroups * 4, 0, 0xAB)};
  coat_status status[2];
  status[0] = coat_group_amax_cpu(x.data, dtype, rows, cols, row_stride, group_size, reinterpret_cast<float*>(amax[0].data));
  status[1] = coat_group_amax_cuda(x.data, dtype, rows, cols, row_stride, group_size,
                                   reinterpret_cast<float*>(amax[1].data), nullptr);
  CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "group_amax status %d / %d", status[0], status[1]);
  same_bytes(amax[0], amax[1], "group_amax", rows, cols, dtype, group_size, row_stride, shift);
  float tensor_amax[2] = {0.0f, 0.0f};
  status[0] = coat_tensor_amax_cpu(x.data, dtype, rows, cols, row_stride, &tensor_amax[0]);
  status[1] = coat_tensor_amax_cuda(x.data, dtype, rows, cols, row_stride, &tensor_amax[1], nullptr);
  CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "tensor_amax status %d / %d", status[0], status[1]);
  CHECK(memcmp(&tensor_amax[0], &tensor_amax[1], 4) == 0, "tensor_amax: C core %a, emulated CUDA %a", tensor_amax[0],
        tensor_amax[1]);

  // Standalone outputs, then codes placed inside outputs 3 columns / 5 rows wider.
  for (int64_t pad = 0; pad <= 5; pad += 5) {
    const int64_t q_stride = cols + (pad ? 3 : 0), q_t_stride = rows + pad;
    Buffer tq[2] = {Buffer(rows * q_stride, 0, 0xAB), Buffer(rows * q_stride, 0, 0xAB)};
    Buffer tq_t[2] = {Buffer(cols * q_t_stride, 0, 0xAB), Buffer(cols * q_t_stride, 0, 0xAB)};
    float scale[2];
    status[0] = coat_quantize_tensor_cpu(x.data, dtype, rows, cols, row_stride, &tensor_amax[0], format, tq[0].data,
                                         q_stride, &scale[0], tq_t[0].data, q_t_stride);
    status[1] = coat_quantize_tensor_cuda(x.data, dtype, rows, cols, row_stride, &tensor_amax[0], format, tq[1].data,
                                          q_stride, &scale[1], tq_t[1].data, q_t_stride, nullptr);
    CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "quantize_tensor status %d / %d", status[0], status[1]);
    CHECK(memcmp(&scale[0], &scale[1], 4) == 0, "quantize_tensor scale: C core %a, emulated CUDA %a", scale[0], scale[1]);
    same_bytes(tq[0], tq[1], "quantize_tensor codes", rows, cols, dtype, group_size, row_stride, shift);
    same_bytes(tq_t[0], tq_t[1], "quantize_tensor transpose", rows, cols, dtype, group_size, row_stride, shift);
  }

  const float* group_scales = reinterpret_cast<const float*>(scales[0].data);
  for (coat_dtype out_dtype : {COAT_FLOAT32, COAT_BFLOAT16}) {
    const size_t out_bytes = rows * cols * element_size(out_dtype);
    Buffer out[2] = {Buffer(out_bytes, 0, 0xAB), Buffer(out_bytes, 0, 0xAB)};
    status[0] = coat_dequantize_cpu(q[0].data, format, rows, cols, group_scales, group_size, out[0].data, out_dtype);
    status[1] = coat_dequantize_cuda(q[0].data, format, rows, cols, group_scales, group_size, out[1].data, out_dtype,
                                     nullptr);
    CHECK(status[0] == COAT_SUCCESS && status[1] == COAT_SUCCESS, "dequantize status %d / %d", status[0], status[1]);
    same_bytes(out[0], out[1], out_dtype == COAT_FLOAT32 ? "dequantize fp32" : "dequantize bf16", rows, cols, dtype,
               group_size, row_stride, shift);
  }
}

// The encoders (arithmetic) against their definition, the count of grid midpoints |f| passes with f's sign: a
// midpoint between codes k and k + 1 is passed when |f| is above it, or on it with k odd (ties go to the even
// code); a NaN passes none. On every `step`-th float.
static void check_encoder(const char* name, const float* grid, int grid_size, uint32_t sign_bit,
                          uint8_t (*encode)(float), uint32_t step) {
  long mismatches = 0;
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += step) {
    float f;
    const uint32_t u = static_cast<uint32_t>(bits);
    memcpy(&f, &u, 4);
    const float m = fabsf(f);
    uint32_t code = 0;
    for (int k = 0; k + 1 < grid_size; ++k) {
      const float midpoint = (grid[k] + grid[k + 1]) / 2;  // exact: the grids are short binary fractions
      code += m > midpoint || (m == midpoint && k % 2 == 1);
    }
    if (encode(f) != ((u >> 31) * sign_bit | code)) ++mismatches;
  }
  CHECK(mismatches == 0, "coat_f32_to_%s differs from the midpoint count on %ld floats", name, mismatches);
  printf("coat_f32_to_%s checked on every %u-th float: %ld mismatches\n", name, step, mismatches);
}

static uint8_t encode_e2m1(float f) { return coat_f32_to_e2m1(f); }
static uint8_t encode_e2m3(float f) { return coat_f32_to_e2m3(f); }

static void check_encoders(uint32_t step) {
  const float e2m1[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  check_encoder("e2m1", e2m1, 8, 0x8u, encode_e2m1, step);
  float e2m3[32];
  for (int k = 0; k < 32; ++k) e2m3[k] = coat_e2m3_to_f32(static_cast<uint8_t>(k));
  for (int k = 0; k < 8; ++k) CHECK(e2m3[k] == k * 0.125f, "E2M3 subnormal %d decodes to %a", k, e2m3[k]);
  for (int k = 8; k < 32; ++k)
    CHECK(e2m3[k] == ldexpf(1.0f + (k & 7) / 8.0f, (k >> 3) - 1), "E2M3 code %d decodes to %a", k, e2m3[k]);
  check_encoder("e2m3", e2m3, 32, 0x20u, encode_e2m3, step);
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  check_encoders(quick ? 997u : 1u);
  // (rows, cols): one element, odd widths, rows narrower than the smallest block, widths that are multiples of
  // 8 but not 16 (8-element chunks), exact multiples of every block size (16-element chunks on the row-wise
  // vector path), rows wider than one tile (2048 columns; 4096 with 16-element chunks) and rows whose width
  // narrows the tile to a warp (4608), row counts that are multiples of 8 and of 4 (the transposes' 8- and 4-byte
  // stores), empty matrices.
  const int64_t shapes[][2] = {{1, 1},    {3, 7},    {5, 37},   {33, 16}, {9, 200}, {130, 128}, {72, 136},
                               {100, 48}, {2, 4104}, {2, 8192}, {3, 4608}, {0, 16},  {4, 0}};
  const coat_dtype dtypes[] = {COAT_FLOAT32, COAT_BFLOAT16, COAT_FLOAT16};
  const int64_t block_sizes[] = {16, 32, 64, 128};
  int i = 0;
  for (const auto& shape : shapes)
    for (coat_dtype dtype : dtypes)
      for (int64_t block_size : block_sizes) {
        ++i;
        if (quick && i % 3 != 0) continue;
        const int64_t rows = shape[0], cols = shape[1];
        for (const BlockFormat& f : kBlockFormats) {
          run_case(f, rows, cols, dtype, block_size, cols, 0, i % 2 == 0);            // contiguous
          run_case(f, rows, cols, dtype, block_size, cols + 8 * (i % 3), 0, true);    // padded row stride
          run_case(f, rows, cols, dtype, block_size, cols + 3, 1, i % 2 == 1);        // misaligned rows and outputs
        }
        const coat_fp8_format format = i % 2 ? COAT_E5M2 : COAT_E4M3;
        run_fp8_case(rows, cols, dtype, block_size, format, cols, 0, i % 2 == 0);
        run_fp8_case(rows, cols, dtype, block_size, format, cols + 8 * (i % 3), 0, true);
        run_fp8_case(rows, cols, dtype, block_size, format, cols + 3, 1, i % 2 == 1);
      }
  printf("quantize (FP8, FP4 and FP6): %d cases, %s: %d failures\n", cases, failures ? "FAILED" : "ok", failures);
  return failures != 0;
}
