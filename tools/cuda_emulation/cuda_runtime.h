// CPU emulation of the CUDA features that csrc/cuda's kernels (adamw_*.cu, rmsnorm.cu, silu_mul.cu, rope.cu,
// quantize.cu and stats.cu) use, for tools/cuda_emulation/run.sh: one std::thread per CUDA thread, blocks one after
// another (2-D grids too), barriers for __syncthreads, __syncwarp, warp shuffles and votes (which abort when the warp
// has diverged), __shared__ as a static shared by the block's threads, dynamic shared memory as a per-block buffer
// filled with 0xFF bytes (NaN as floats, so that a read before a write shows) and followed by a 64 KB guard of the
// same bytes (reads past the end give NaN; writes there abort). The AdamW kernels' inline assembly lives in
// adamw_fast_math.cuh, which this directory replaces by a CPU model; the norm_act kernels (rmsnorm.cu, silu_mul.cu,
// norm_act.cuh) guard their asm by __CUDA_ARCH__ or use it only as an optimisation barrier (a no-op here). emu_sms
// and emu_blocks_per_sm set what the occupancy queries answer, and so the persistent grids' sizes.
#pragma once
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <atomic>
#include <barrier>
#include <thread>
#include <vector>
#include <memory>

struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
typedef struct CUstream_st* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;
#define __global__
#define __device__
#define __host__
#define __constant__
#define __grid_constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __restrict__
#define asm(...) ((void)0)

inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }

struct EmuBlock {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  uint32_t slots[64][32];
  int masks[64][32];
};
inline EmuBlock* emu_block = nullptr;
inline std::vector<float4> emu_dynamic_shared_memory;
constexpr size_t kEmuSharedGuard = 65536;
inline void* emu_dynamic_shared() { return emu_dynamic_shared_memory.data(); }
inline cudaError_t emu_error = cudaSuccess;
inline long emu_launches = 0;
int emu_sms = 2, emu_blocks_per_sm = 1;  // one translation unit includes this header
inline long emu_shuffles = 0;

inline void __syncthreads() { emu_block->block->arrive_and_wait(); }
inline void __syncwarp() { emu_block->warps[threadIdx.x >> 5]->arrive_and_wait(); }
inline uint32_t emu_shfl(uint32_t v, int lane_mask) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  emu_block->slots[w][lane] = v;
  emu_block->masks[w][lane] = lane_mask;
  emu_block->warps[w]->arrive_and_wait();
  for (int l = 0; l < 32; ++l) if (emu_block->masks[w][l] != lane_mask) { fprintf(stderr, "divergent shuffle\n"); abort(); }
  const uint32_t r = emu_block->slots[w][lane ^ lane_mask];
  emu_block->warps[w]->arrive_and_wait();
  return r;
}
inline uint32_t emu_shfl_idx(uint32_t v, int src) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  emu_block->slots[w][lane] = v;
  emu_block->masks[w][lane] = -1000;  // idx mode marker
  emu_block->warps[w]->arrive_and_wait();
  for (int l = 0; l < 32; ++l) if (emu_block->masks[w][l] != -1000) { fprintf(stderr, "divergent shuffle\n"); abort(); }
  const uint32_t r = emu_block->slots[w][src & 31];
  emu_block->warps[w]->arrive_and_wait();
  return r;
}
// __any_sync: every lane of the warp must take part (a vote, like a shuffle, aborts when the warp has diverged).
inline bool __any_sync(unsigned mask, bool predicate) {
  assert(mask == 0xFFFFFFFFu);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  emu_block->slots[w][lane] = predicate;
  emu_block->masks[w][lane] = -2000;  // vote marker
  emu_block->warps[w]->arrive_and_wait();
  bool any = false;
  for (int l = 0; l < 32; ++l) {
    if (emu_block->masks[w][l] != -2000) { fprintf(stderr, "divergent vote\n"); abort(); }
    any = any || emu_block->slots[w][l] != 0;
  }
  emu_block->warps[w]->arrive_and_wait();
  return any;
}
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) { assert(mask == 0xFFFFFFFFu); return __uint_as_float(emu_shfl(__float_as_uint(v), lane_mask)); }
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask) { assert(mask == 0xFFFFFFFFu); return (int)emu_shfl((uint32_t)v, lane_mask); }
inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int lane_mask) { assert(mask == 0xFFFFFFFFu); return emu_shfl(v, lane_mask); }
inline unsigned long long __shfl_xor_sync(unsigned mask, unsigned long long v, int lane_mask) {
  assert(mask == 0xFFFFFFFFu);
  const uint64_t low = emu_shfl((uint32_t)v, lane_mask), high = emu_shfl((uint32_t)(v >> 32), lane_mask);
  return high << 32 | low;
}
inline float __shfl_sync(unsigned mask, float v, int src) { assert(mask == 0xFFFFFFFFu); return __uint_as_float(emu_shfl_idx(__float_as_uint(v), src)); }
// With width (a power of two), lanes read within their own `width` lanes: src's low bits pick the lane there.
inline float __shfl_sync(unsigned mask, float v, int src, int width) {
  assert(mask == 0xFFFFFFFFu && width > 0 && width <= 32 && (width & (width - 1)) == 0);
  const int lane = threadIdx.x & 31;
  return __uint_as_float(emu_shfl_idx(__float_as_uint(v), (lane & ~(width - 1)) | (src & (width - 1))));
}
inline int __shfl_sync(unsigned mask, int v, int src) { assert(mask == 0xFFFFFFFFu); return (int)emu_shfl_idx((uint32_t)v, src); }
inline double __shfl_xor_sync(unsigned mask, double v, int lane_mask) {
  uint64_t bits;
  memcpy(&bits, &v, 8);
  bits = __shfl_xor_sync(mask, (unsigned long long)bits, lane_mask);
  memcpy(&v, &bits, 8);
  return v;
}
// Loads through the read-only or L2-only paths are plain loads here; __threadfence orders this thread's memory
// operations (blocks run one after another, so a later block sees every write of an earlier one anyway).
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned sel) {
  const uint64_t v = (uint64_t)y << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
// max(min(a + b, c), 0) of each 16-bit half, signed, the sum wrapping (VIADDMNMX.S16x2 on sm_90)
inline unsigned __viaddmin_s16x2_relu(unsigned a, unsigned b, unsigned c) {
  unsigned r = 0;
  for (int half = 0; half < 2; ++half) {
    const unsigned shift = 16 * half;
    const int16_t sum = (int16_t)(uint16_t)(((a >> shift) + (b >> shift)) & 0xFFFFu);
    const int16_t bound = (int16_t)(uint16_t)(c >> shift);
    const int16_t v = sum < bound ? sum : bound;
    r |= (unsigned)(uint16_t)(v > 0 ? v : 0) << shift;
  }
  return r;
}
// max(a, b, c) of each 16-bit half, unsigned (VIMNMX3.U16x2 on sm_90)
inline unsigned __vimax3_u16x2(unsigned a, unsigned b, unsigned c) {
  unsigned r = 0;
  for (int half = 0; half < 2; ++half) {
    const unsigned shift = 16 * half, x = (a >> shift) & 0xFFFFu, y = (b >> shift) & 0xFFFFu, z = (c >> shift) & 0xFFFFu;
    r |= (x > y ? (x > z ? x : z) : (y > z ? y : z)) << shift;
  }
  return r;
}
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline unsigned atomicMax(unsigned* address, unsigned value) {
  std::atomic_ref<unsigned> target(*address);
  unsigned old = target.load();
  while (old < value && !target.compare_exchange_weak(old, value)) {}
  return old;
}
inline unsigned long long atomicMax(unsigned long long* address, unsigned long long value) {
  std::atomic_ref<unsigned long long> target(*address);
  unsigned long long old = target.load();
  while (old < value && !target.compare_exchange_weak(old, value)) {}
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return std::atomic_ref<unsigned long long>(*address).fetch_add(value);
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) { memset(p, value, bytes); return cudaSuccess; }
template <class K> cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int) { return cudaSuccess; }
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
};
template <class K> cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, K) {
  attributes->sharedSizeBytes = 0;  // static shared memory lives in the emulated block's statics
  return cudaSuccess;
}
inline cudaError_t cudaPeekAtLastError() { return emu_error; }
inline cudaError_t cudaGetDevice(int* d) { *d = emu_sms; return cudaSuccess; }  // a "device" per SM count: the launcher caches per device
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = emu_sms; return cudaSuccess; }
template <class K> cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, K, int, size_t) { *n = emu_blocks_per_sm; return cudaSuccess; }

template <class F>
void emu_launch(dim3 grid, dim3 block, size_t dynamic_shared_bytes, F&& body) {
  ++emu_launches;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || block.x > 1024) {
    fprintf(stderr, "bad launch config %u %u %u\n", grid.x, grid.y, grid.z);
    emu_error = cudaErrorInvalidConfiguration;
    return;
  }
  gridDim = grid; blockDim = block;
  for (unsigned by = 0; by < grid.y; ++by)
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    const size_t requested = (dynamic_shared_bytes + sizeof(float4) - 1) / sizeof(float4);
    emu_dynamic_shared_memory.assign(requested + kEmuSharedGuard / sizeof(float4), float4{});
    memset(emu_dynamic_shared_memory.data(), 0xFF, emu_dynamic_shared_memory.size() * sizeof(float4));
    EmuBlock ctx;
    ctx.block = std::make_unique<std::barrier<>>(block.x);
    for (unsigned w = 0; w < (block.x + 31) / 32; ++w) ctx.warps.push_back(std::make_unique<std::barrier<>>(32));
    emu_block = &ctx;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block.x; ++t)
      threads.emplace_back([&, t, bx, by] { threadIdx = dim3(t, 0, 0); blockIdx = dim3(bx, by, 0); body(); });
    for (auto& th : threads) th.join();
    emu_block = nullptr;
    const unsigned char* guard = reinterpret_cast<const unsigned char*>(emu_dynamic_shared_memory.data() + requested);
    for (size_t i = 0; i < kEmuSharedGuard; ++i)
      if (guard[i] != 0xFF) { fprintf(stderr, "dynamic shared memory written past its size\n"); abort(); }
  }
}
