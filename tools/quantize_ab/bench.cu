// A/B timer for versions of csrc/cuda/quantize.cu without torch (build.sh links one binary per version): the
// group and per-tensor quantizers, with and without the transpose, on bf16 matrices, each against a device copy
// of the same matrix. CUDA events around each of 200 calls enqueued back to back after 20 warm-up calls; the
// median. "of copy" = (bytes the op must move / its time) / (bytes of the copy / its time). The checksum of
// each op's last output (q_t where it transposes) lets versions be compared for equal results.
//   usage: bench_NAME [tag]
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <random>
#include <vector>
#include <functional>
#include "coat/quantize.h"

static void check(coat_status status, const char* what) {
  if (status == COAT_SUCCESS) return;
  fprintf(stderr, "%s failed: coat_status %d\n", what, static_cast<int>(status));
  exit(1);
}

static float median_ms(const std::function<void()>& f, int iters = 200) {
  for (int i = 0; i < 20; ++i) f();
  std::vector<cudaEvent_t> a(iters), b(iters);
  for (int i = 0; i < iters; ++i) { cudaEventCreate(&a[i]); cudaEventCreate(&b[i]); }
  for (int i = 0; i < iters; ++i) { cudaEventRecord(a[i]); f(); cudaEventRecord(b[i]); }
  cudaDeviceSynchronize();
  std::vector<float> t(iters);
  for (int i = 0; i < iters; ++i) {
    cudaEventElapsedTime(&t[i], a[i], b[i]);
    cudaEventDestroy(a[i]);
    cudaEventDestroy(b[i]);
  }
  std::sort(t.begin(), t.end());
  return t[iters / 2];
}

static uint64_t checksum(const void* d, size_t n) {
  std::vector<uint8_t> h(n);
  cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost);
  uint64_t s = 1469598103934665603ull;
  for (uint8_t v : h) s = (s ^ v) * 1099511628211ull;
  return s;
}

int main(int argc, char** argv) {
  const char* tag = argc > 1 ? argv[1] : "?";
  const int64_t shapes[][2] = {{8192, 8192}, {4096, 14336}, {16384, 4096}};
  for (auto& sh : shapes) {
    const int64_t rows = sh[0], cols = sh[1], n = rows * cols;
    std::vector<__nv_bfloat16> hx(n);
    std::mt19937 rng(0);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) hx[i] = __float2bfloat16(nd(rng) * (1 + (i % 977) * 0.01f));
    void *x, *y; uint8_t *q, *qt; float *s, *amax;
    cudaMalloc(&x, 2 * n); cudaMalloc(&y, 2 * n); cudaMalloc(&q, n); cudaMalloc(&qt, n);
    cudaMalloc(&s, n / 16 * 4); cudaMalloc(&amax, 4);
    cudaMemcpy(x, hx.data(), 2 * n, cudaMemcpyHostToDevice);
    const float copy = median_ms([&] { cudaMemcpyAsync(y, x, 2 * n, cudaMemcpyDeviceToDevice); });
    const double copy_bw = 4.0 * n / copy;
    auto report = [&](const char* name, float ms, double bytes, const void* out, size_t out_bytes) {
      printf("%s %lldx%lld %-28s %8.4f ms  %.3f of copy  checksum %016llx\n", tag, (long long)rows, (long long)cols, name,
             ms, bytes / ms / copy_bw, (unsigned long long)checksum(out, out_bytes));
    };
    printf("%s %lldx%lld copy %.4f ms\n", tag, (long long)rows, (long long)cols, copy);
    for (int g : {128, 16}) {
      float ms = median_ms([&] {
        check(coat_quantize_group_cuda(x, COAT_BFLOAT16, rows, cols, cols, g, COAT_E4M3, q, s, qt, nullptr), "quantize_group");
      });
      report(g == 128 ? "group128+T q_t" : "group16+T q_t", ms, 2.0 * n + 2.0 * n + 4.0 * n / g, qt, n);
      ms = median_ms([&] {
        check(coat_quantize_group_cuda(x, COAT_BFLOAT16, rows, cols, cols, g, COAT_E4M3, q, s, nullptr, nullptr), "quantize_group");
      });
      report(g == 128 ? "group128 q" : "group16 q", ms, 2.0 * n + n + 4.0 * n / g, q, n);
    }
    check(coat_tensor_amax_cuda(x, COAT_BFLOAT16, rows, cols, cols, amax, nullptr), "tensor_amax");
    const float ms = median_ms([&] {
      check(coat_quantize_tensor_cuda(x, COAT_BFLOAT16, rows, cols, cols, amax, COAT_E4M3, q, cols, s, qt, rows, nullptr),
            "quantize_tensor");
    });
    report("tensor+T q_t", ms, 2.0 * n + 2.0 * n, qt, n);
    cudaFree(x); cudaFree(y); cudaFree(q); cudaFree(qt); cudaFree(s); cudaFree(amax);
  }
  cudaError_t e = cudaGetLastError();
  printf("%s cuda status: %s\n", tag, cudaGetErrorString(e));
  return e != cudaSuccess;
}
