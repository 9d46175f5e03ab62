// CUDA implementation of coat/adamw.h's fp8_adamw_step (adamw.cuh holds what it shares with adamw_expanded.cu, the
// quantize_expanded and dequantize_expanded kernels, and adamw_moment_stats.cu).
//
// fp8_adamw_step computes the C core's formulas (coat/detail/adamw_math.h) with the GPU's fast arithmetic
// (adamw_fast_math.cuh: hardware exp2, log2, square root and reciprocal, FP8 and bf16 conversion instructions)
// and agrees with the C core within the tolerance that tests/test_adamw_ops.py states and checks. Its results
// are a function of each group's inputs only: the same on every run, whatever the launch's grid, the tensor's
// alignment or the group's neighbours.
//
// Step kernel. A warp takes a tile of 512 consecutive columns of one row, 16 consecutive elements per lane:
// 16-byte loads and stores throughout (4 per fp32 array, 2 per 16-bit array, 1 per FP8 state) when the tensor is
// aligned (cols % 16 == 0 and aligned pointers) and the tile whole, element by element otherwise (a variant of
// the tile chosen per warp); a whole tile's new fp32 parameters go out through shared memory as 512-byte warp
// stores (step_param_stage). 512 is a multiple of every group size, so a group of G columns is G/16 (1 to 8)
// adjacent lanes, and its range (amax, amin) is a butterfly of shuffles. Per element and state:
//   decode  beta * x' = (entry.factor * head) * approx_exp2(fmaf(entry.log2, inverse_k, fraction))
//           one shared-memory lookup of the code's {log2 |decode(code)|, sign} (k == 1: {0, decode(code)}), one
//           fmaf, one MUFU.EX2, two multiplies; inverse_k, fraction and the exponent in head are the C core's
//           values (coat_decoder_make), so the argument of exp2 is the C core's bit for bit;
//   update  m = fmaf(1 - beta1, g, beta1 * m), v = fmaf((1 - beta2) * g, g, beta2 * v),
//           denom = approx_sqrt(v) * (1 / bias_correction2_sqrt, as two floats) + eps,
//           q = m * approx_reciprocal(denom) corrected once by the residual (m / denom to about half an ulp),
//           p = fmaf(-step_size, q, p * decay_factor);
//   encode  code = fp8(sign(x) * approx_exp2(max(fmaf(k, approx_log2(|x| * head), bias), log2 FP8_MIN_SUBNORMAL)))
//           head a power of 2 and bias from the group's meta (LaneEncoder), one cvt.rn.satfinite per two codes.
// Per group and state: the decoder of the old meta (coat_decoder_make), computed for a batch of the warp's tiles
// at once with one job per lane and kept in shared memory (DecoderBatch: G = 128 computes it once per 4 tiles),
// and the new meta (encoder_of_range: hardware square roots, log2 and exp2 before each value's bf16 rounding),
// once per tile, by the even lane of each lane pair for m and the odd lane for v, which read each other's
// results by shuffles (G = 16: each lane does both).
//
// Rare cases take a general variant of a phase, chosen per warp (__any_sync), whose results equal the fast
// variant's wherever both apply (they compute the same formula with an extra exact factor or fix-up):
//   decode: a group whose values come near the ends of the fp32 range (head * tail, tail = 2^shift != 1), or an
//           eps too small to absorb sqrt of a subnormal v (the fast variant's sqrt and reciprocal flush
//           subnormals; the general one also divides by a denominator below 2^-126, eps = 0 included, as the
//           division does);
//   range:  zero, Inf or NaN elements (or a negative v, from a foreign state) in a group: amax and amin
//           recomputed over the finite nonzero elements only;
//   encode: such elements (zero keeps its sign, non-finite gives the NaN code 0x7F), or a group near the ends
//           of the fp32 range.
// The step kernel is persistent: a grid of as many blocks as fit on the GPU (5 per SM: 96 registers, 20 warps),
// each warp walking every tensor of the launch by a stride of the grid's warps. Each block first builds its
// tables in shared memory with the C core's arithmetic.
#include <algorithm>
#include <cmath>

#include "adamw.cuh"

namespace {

constexpr int kMaxLanesPerGroup = 128 / kValuesPerLane;
// Step kernel blocks per SM (__launch_bounds__): 5, at most 96 registers and 20 warps. GPUs without FP8 conversion
// instructions (before sm_89) convert in software, which needs more registers: 4.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr int kStepBlocksPerSM = 4;
#else
constexpr int kStepBlocksPerSM = 5;
#endif
constexpr int kTensorsPerLaunch = 32;
// A power of 2 that a decoder's or encoder's head carries: within it, beta * 2^n and |x| * 2^-n stay exact.
constexpr int kHeadExponentLimit = 100;

// The step kernel's decode tables (see LaneDecoder): table f is the log domain of format f, {log2 |decode(code)|,
// factor} as the C core's coat_fp8_entry, table 2 + f the linear domain of k == 1 groups, {0, decode(code)}.
// Aligned so that a code's byte offset (< 2048) is ORed into a table's address.
constexpr int kDecodeTables = 4;
__shared__ __align__(2048) float2 step_decode_tables[kDecodeTables][256];
// The C core's tables: log2 of bf16 values for the per-group quantities, the FP8 entries the decode tables copy.
__shared__ coat_adamw_tables step_tables;

// How the groups lie on the lanes: lanes_per_group = G / 16 lanes each; with two or more, the even lane of each
// pair does m's per-group work, the odd lane v's.
struct GroupLayout {
  int lanes_per_group;
  int group_shift;  // log2 G
  bool split;
};

// The decoder batches of the launch (see compute_decoder_batch).
struct DecoderBatch {
  int job_shift;      // log2 of the jobs per tile, 2 * 512 / G (m and v of each group)
  int tiles;          // 32 / jobs per tile, at least 1
  int jobs_per_lane;  // jobs per tile / 32, at least 1
};

// The tensors of one step launch. They travel by value in the kernel's parameter space (__grid_constant__:
// read in place), so a launch needs no device allocation, no copy and no synchronisation.
struct StepLaunch {
  coat_adamw_options options;
  float minus_step_size;
  float inverse_bias_correction2_sqrt;      // 1 / bias_correction2_sqrt rounded to float on the host,
  float inverse_bias_correction2_sqrt_low;  // and the rest of its float64 value
  int subnormal_v_matters;  // eps may not absorb sqrt of a subnormal v: the update's general variant runs
  GroupLayout layout;
  DecoderBatch batch;
  int count;
  coat_adamw_tensor tensors[kTensorsPerLaunch];
  TensorPlan plans[kTensorsPerLaunch];
};
// 4 KiB is the parameter limit of every CUDA version and architecture.
static_assert(sizeof(StepLaunch) <= 4096, "step launch parameters exceed 4 KiB");

__device__ __forceinline__ void build_step_tables() {
  build_tables(&step_tables);
  for (int i = threadIdx.x; i < kDecodeTables * 256; i += blockDim.x) {
    const int table = i >> 8, format = table & 1, code = i & 255;
    const coat_fp8_entry e = step_tables.fp8[format][code];
    step_decode_tables[table][code] =
        table < 2 ? make_float2(e.log2, e.factor) : make_float2(0.0f, step_tables.fp8_value[format][code]);
  }
  __syncthreads();
}

__device__ __forceinline__ float shfl(float v, int lane) { return __shfl_sync(kFullMask, v, lane); }

// 2^n as a float, n in [-126, 127].
__device__ __forceinline__ float power_of_2(int n) { return __uint_as_float(static_cast<uint32_t>(127 + n) << 23); }

// n split as head + shift with head in [-kHeadExponentLimit, kHeadExponentLimit] and shift clamped to [-126, 127]
// (where the clamp bites, the values the power scales are 0 or Inf either way).
__device__ __forceinline__ int head_exponent(int n) { return min(max(n, -kHeadExponentLimit), kHeadExponentLimit); }
__device__ __forceinline__ int shift_exponent(int n) { return min(max(n - head_exponent(n), -126), 127); }

// ------------------------------------------------------------------------------------------ lane data

// A 16-bit element (bf16 or fp16 bits) as fp32, exactly.
__device__ __forceinline__ float widen(uint16_t bits, coat_dtype dtype) {
  return dtype == COAT_BFLOAT16 ? coat_bf16_to_f32(bits) : f16_bits_to_f32(bits);
}

// A lane's 16 consecutive values of a float32 / bfloat16 / float16 array as fp32, by 16-byte loads (the tile is
// whole and the tensor aligned: TensorPlan.vector).
__device__ __forceinline__ void load_values_vector(const void* data, coat_dtype dtype, int64_t first,
                                                   float (&out)[kValuesPerLane]) {
  if (dtype == COAT_FLOAT32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(data) + first);
#pragma unroll
    for (int q = 0; q < kValuesPerLane / 4; ++q) {
      const float4 a = p[q];
      out[4 * q] = a.x; out[4 * q + 1] = a.y; out[4 * q + 2] = a.z; out[4 * q + 3] = a.w;
    }
    return;
  }
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + first);
#pragma unroll
  for (int q = 0; q < kValuesPerLane / 8; ++q) {
    const uint4 a = p[q];
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[8 * q + 2 * i] = widen(static_cast<uint16_t>(w[i] & 0xFFFFu), dtype);
      out[8 * q + 2 * i + 1] = widen(static_cast<uint16_t>(w[i] >> 16), dtype);
    }
  }
}

// The same element by element, for tiles that are not whole or tensors that are not aligned; missing
// elements are 0.
__device__ __forceinline__ void load_values_scalar(const void* data, coat_dtype dtype, int64_t first, int count,
                                                   float (&out)[kValuesPerLane]) {
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    if (i >= count)
      out[i] = 0.0f;
    else
      out[i] = dtype == COAT_FLOAT32 ? static_cast<const float*>(data)[first + i]
                                     : widen(static_cast<const uint16_t*>(data)[first + i], dtype);
  }
}

// Elements [first_index, first_index + kStoreChunk) of a lane's 16, stored as the parameter's dtype: by vector
// stores in the tiles that allow them (kVector), else element by element (the same bf16 rounding either way, so a
// NaN gets the same bits too). A bf16 parameter rounds to nearest even, or stochastically with the C core's bits
// (coat/adamw.h) when `stochastic`.
constexpr int kStoreChunk = 4;

__device__ __forceinline__ uint32_t param_bf16_bits(float p, bool stochastic, uint64_t seed, int64_t index) {
  return stochastic ? coat_f32_to_bf16_stochastic(p, coat_rounding_bits(seed, index)) : bf16x2_bits(p, 0.0f) & 0xFFFFu;
}

template <bool kVector>
__device__ __forceinline__ void store_params_chunk(const coat_adamw_tensor& t, bool stochastic, int64_t first,
                                                   int first_index, int count, const float (&p)[kStoreChunk]) {
  const int64_t base = first + first_index;
  if (kVector && t.param_dtype == COAT_FLOAT32) {
    float4* out = reinterpret_cast<float4*>(static_cast<float*>(t.param) + base);
#pragma unroll
    for (int q = 0; q < kStoreChunk / 4; ++q) out[q] = make_float4(p[4 * q], p[4 * q + 1], p[4 * q + 2], p[4 * q + 3]);
  } else if (kVector) {
    uint32_t bits[kStoreChunk];
#pragma unroll
    for (int i = 0; i < kStoreChunk; i += 2)
      bits[i / 2] = stochastic ? param_bf16_bits(p[i], true, t.rounding_seed, base + i) |
                                     param_bf16_bits(p[i + 1], true, t.rounding_seed, base + i + 1) << 16
                               : bf16x2_bits(p[i], p[i + 1]);
    uint2* out = reinterpret_cast<uint2*>(static_cast<uint16_t*>(t.param) + base);
#pragma unroll
    for (int q = 0; q < kStoreChunk / 4; ++q) out[q] = make_uint2(bits[2 * q], bits[2 * q + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < kStoreChunk; ++i) {
      if (first_index + i >= count) continue;
      if (t.param_dtype == COAT_FLOAT32)
        static_cast<float*>(t.param)[base + i] = p[i];
      else
        static_cast<uint16_t*>(t.param)[base + i] =
            static_cast<uint16_t>(param_bf16_bits(p[i], stochastic, t.rounding_seed, base + i));
    }
  }
}

// The new fp32 parameters of a warp's whole tile on their way to memory (the vector path): lane l's chunk c (4
// floats) at float4 stage_slot(l, c) of its warp's 128. A lane's own 16 consecutive elements, stored by it, would
// make every store instruction of the warp write 32 half sectors (16 bytes every 64); staged, the warp writes the
// tile as 4 instructions of 512 contiguous bytes, half the L2 write requests.
__shared__ float4 step_param_stage[kWarpsPerBlock][kWarpSize * kValuesPerLane / kStoreChunk];

// Chunk c of lane l goes to float4 4 l + (c + l / 2) % 4: the 8 lanes of each quarter warp then cover 32 distinct
// banks with their chunk stores, and 8 consecutive float4 (read by consecutive lanes) are always 128 contiguous
// bytes.
__device__ __forceinline__ int stage_slot(int lane, int chunk) { return 4 * lane + ((chunk + (lane >> 1)) & 3); }

__device__ __forceinline__ void stage_params_chunk(int chunk, const float (&p)[kStoreChunk]) {
  step_param_stage[threadIdx.x / kWarpSize][stage_slot(lane_id(), chunk)] = make_float4(p[0], p[1], p[2], p[3]);
}

// Writes the warp's staged tile to tile_params (its first element): float4 j = 32 q + lane by lane `lane`.
__device__ __forceinline__ void store_staged_params(float* tile_params) {
  const int warp = threadIdx.x / kWarpSize;
  __syncwarp();
#pragma unroll
  for (int q = 0; q < kValuesPerLane / kStoreChunk; ++q) {
    const int j = q * kWarpSize + lane_id();
    reinterpret_cast<float4*>(tile_params)[j] = step_param_stage[warp][stage_slot(j / 4, j % 4)];
  }
  __syncwarp();  // read before the next tile stages
}

// 16 codes as four words (code i in byte i % 4 of word i / 4); missing codes are 0.
struct Codes {
  uint32_t w[kValuesPerLane / 4];
};

__device__ __forceinline__ Codes load_codes_vector(const uint8_t* codes, int64_t first) {
  const uint4 q = *reinterpret_cast<const uint4*>(codes + first);
  Codes c;
  c.w[0] = q.x; c.w[1] = q.y; c.w[2] = q.z; c.w[3] = q.w;
  return c;
}

__device__ __forceinline__ Codes load_codes_scalar(const uint8_t* codes, int64_t first, int count) {
  Codes c;
#pragma unroll
  for (int i = 0; i < kValuesPerLane / 4; ++i) c.w[i] = 0u;
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < count) c.w[i / 4] |= static_cast<uint32_t>(codes[first + i]) << (8 * (i % 4));
  return c;
}

__device__ __forceinline__ void store_codes_vector(uint8_t* codes, int64_t first, const Codes& c) {
  *reinterpret_cast<uint4*>(codes + first) = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
}

__device__ __forceinline__ void store_codes_scalar(uint8_t* codes, int64_t first, int count, const Codes& c) {
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < count) codes[first + i] = static_cast<uint8_t>(c.w[i / 4] >> (8 * (i % 4)));
}

__device__ __forceinline__ coat_meta load_meta(const uint16_t* meta, bool valid) {
  coat_meta m;
  m.scale = m.k = m.c = 1.0f;
  if (valid) m = coat_meta_load(meta);
  return m;
}

// ----------------------------------------------------------------------- per-group quantities: decode

// What a lane needs to decode one state of its group, scaled by the moment's beta (the update's first product):
//   beta * x' = (entry.factor * head) * (approx_exp2(fmaf(entry.log2, inverse_k, fraction)) * tail)
// k != 1: the log-domain table; inverse_k, fraction and exponent are coat_decoder_make's (the C core's bits),
//   head = beta * 2^head_exponent(exponent), tail = 2^shift_exponent(exponent) (1 but near the ends of the fp32
//   range), so that both products are exact and the result is rounded once;
// k == 1: the linear table (log2 0, factor decode(code)), inverse_k = fraction = 0 (exp2 gives exactly 1),
//   head = beta * (C * scale), tail = 1.
struct LaneDecoder {
  float head;
  float tail;
  float inverse_k;
  float fraction;
  uint32_t table;  // shared-memory address of the group's table in step_decode_tables
};

__device__ __forceinline__ LaneDecoder decoder_of(coat_meta meta, coat_fp8_format format, float beta) {
  const coat_decoder d = coat_decoder_make(meta, format, &step_tables);
  LaneDecoder r;
  if (d.linear) {
    r.head = beta * (d.c * d.scale);
    r.tail = 1.0f;
    r.inverse_k = 0.0f;
    r.fraction = 0.0f;
    r.table = shared_address(step_decode_tables[2 + format]);
  } else {
    r.head = beta * power_of_2(head_exponent(d.exponent));
    r.tail = power_of_2(shift_exponent(d.exponent));
    r.inverse_k = d.inverse_k;
    r.fraction = d.fraction;
    r.table = shared_address(step_decode_tables[format]);
  }
  return r;
}

// The decoders of a batch of tiles. A warp takes the tiles tile, tile + warps, tile + 2 warps, ... of a tensor; at
// the first tile of each batch it computes the decoders of the batch's tiles at once, one job (a group and a state
// of one tile) per lane, so that G = 128 spends one decoder computation on 4 tiles (G = 64: 2, G = 32: 1, G = 16:
// two per lane and tile), and keeps them in shared memory, where each lane reads its group's two.
constexpr int kMaxJobsPerWarp = 2 * kWarpSize;
__shared__ float4 step_decoders[kWarpsPerBlock][kMaxJobsPerWarp];  // head, inverse_k, fraction, table (bits)
__shared__ float step_decoder_tails[kWarpsPerBlock][kMaxJobsPerWarp];

__device__ __forceinline__ void store_decoder(int job, const LaneDecoder& d) {
  const int warp = threadIdx.x / kWarpSize;
  step_decoders[warp][job] = make_float4(d.head, d.inverse_k, d.fraction, __uint_as_float(d.table));
  step_decoder_tails[warp][job] = d.tail;
}

__device__ __forceinline__ LaneDecoder load_decoder(int job) {
  const int warp = threadIdx.x / kWarpSize;
  const float4 q = step_decoders[warp][job];
  LaneDecoder d;
  d.head = q.x;
  d.inverse_k = q.y;
  d.fraction = q.z;
  d.table = __float_as_uint(q.w);
  d.tail = step_decoder_tails[warp][job];
  return d;
}

// ----------------------------------------------------------------------- per-group quantities: encode

// log2 x = exponent + fraction for a finite x > 0, subnormals included: the exponent exact, the fraction
// approx_log2 of the significand in [1, 2) (absolute error <= 2^-22).
__device__ __forceinline__ coat_log2_parts approx_log2_split(float x) {
  uint32_t a = __float_as_uint(x);
  const bool subnormal = a < 0x00800000u;
  if (subnormal) a = __float_as_uint(x * 16777216.0f);
  coat_log2_parts r;
  r.exponent = static_cast<int>(a >> 23) - (subnormal ? 127 + 24 : 127);
  r.fraction = approx_log2_ftz(__uint_as_float((a & 0x007FFFFFu) | 0x3F800000u));
  return r;
}

// What a lane needs to encode one state of its group (meta scale, k, C; log2 C = e_C + f_C and log2 scale =
// e_s + f_s exactly, from the C core's bf16 table):
//   code = fp8(sign(x) * approx_exp2(max(fmaf(k, approx_log2(|x| * head * tail), bias), log2 FP8_MIN_SUBNORMAL)))
//   k != 1: head * tail = 2^-e_C,         bias = -(k * f_C + e_s + f_s)  =>  the exponent is k log2(|x| / C) - log2 scale
//   k == 1: head * tail = 2^-(e_C + e_s), bias = -(f_C + f_s)            =>  the exponent is log2(|x| / (C * scale))
// so that approx_log2 sees |x| / C up to a factor in [1, 2), where its error is smallest. head and tail are
// powers of 2 (tail = 1 but near the ends of the fp32 range): the products are exact.
struct LaneEncoder {
  float head;
  float tail;
  float k;
  float bias;
};

// A group's new meta, stored in *meta, and its encoder: coat_encoder_of_range's formulas and order, with hardware
// square roots, log2, reciprocal and exp2. Each of C, k and scale is rounded to bf16 (scale upwards) before the
// next is derived from it, so the approximations change a stored value only where it lies within a few fp32 ulp
// of a bf16 rounding boundary. k == 1 keeps the C core's two correctly rounded divisions for the scale
// (coat_divide_by_scale: IEEE's value wherever the scale is not clamped to 2^-126), so plain quantization has the
// C core's meta.
__device__ __forceinline__ LaneEncoder encoder_of_range(coat_range r, coat_fp8_format format, int expand,
                                                        coat_meta* meta) {
  coat_meta m;
  m.k = 1.0f;
  m.c = 1.0f;
  coat_log2_parts high;
  high.exponent = 0;
  high.fraction = 0.0f;
  if (expand && r.amax > 0.0f) {
    // a subnormal amax makes the mean subnormal (not expanded) whether its square root flushes or not
    const float mean = round_to_bf16(approx_sqrt(r.amin) * approx_sqrt_ftz(r.amax));
    if (mean >= COAT_MIN_SCALE && mean <= coat_bf16_max()) {
      const coat_log2_parts low = approx_log2_split(r.amin);
      high = approx_log2_split(r.amax);
      const float log2_range = static_cast<float>(high.exponent - low.exponent) + (high.fraction - low.fraction);
      m.c = mean;
      if (log2_range > 0.0f)
        m.k = round_to_bf16(fminf(fmaxf(coat_log2_range(format) * approx_reciprocal_ftz(log2_range),
                                        COAT_EXPANSION_K_MIN),
                                  COAT_EXPANSION_K_MAX));
    }
  }
  const coat_log2_parts lc = coat_log2_bf16(m.c, &step_tables);
  float scale;
  if (m.k == 1.0f) {
    const float inverse_fp8_max = format == COAT_E4M3 ? 1.0f / COAT_E4M3_MAX : 1.0f / COAT_E5M2_MAX;
    scale = coat_divide_by_scale(coat_divide_by_scale(r.amax, m.c, __frcp_rn(m.c)), coat_fp8_max(format),
                                 inverse_fp8_max);
  } else {
    const float log2_ratio = static_cast<float>(high.exponent - lc.exponent) + (high.fraction - lc.fraction);
    scale = approx_exp2_ftz(fmaf(m.k, log2_ratio, -coat_log2_fp8_max(format)));
  }
  m.scale = coat_round_bf16_up(fmaxf(scale, COAT_MIN_SCALE));
  *meta = m;

  const coat_log2_parts ls = coat_log2_bf16(m.scale, &step_tables);
  LaneEncoder e;
  e.k = m.k;
  int exponent;
  if (m.k == 1.0f) {
    exponent = lc.exponent + ls.exponent;
    e.bias = -(lc.fraction + ls.fraction);
  } else {
    exponent = lc.exponent;
    e.bias = -fmaf(m.k, lc.fraction, static_cast<float>(ls.exponent) + ls.fraction);
  }
  e.head = power_of_2(-head_exponent(exponent));
  e.tail = power_of_2(-shift_exponent(exponent));
  return e;
}

__device__ __forceinline__ LaneEncoder encoder_from_lane(const LaneEncoder& e, int lane) {
  LaneEncoder o;
  o.head = shfl(e.head, lane);
  o.tail = shfl(e.tail, lane);
  o.k = shfl(e.k, lane);
  o.bias = shfl(e.bias, lane);
  return o;
}

// ------------------------------------------------------------------------------------------ group ranges

// The ranges of a lane's m and v. Fast: amax = max |m| and max v with NaN kept, amin = min |m| and min v with
// zeros (and a negative v) included, so that every element is finite, nonzero (and v positive) exactly where
// amin > 0 and amax < Inf hold for the group, and then the ranges are coat/adamw.h's. Exact: coat_range_add
// over the finite nonzero elements.
struct LaneRanges {
  coat_range m;
  coat_range v;
};

__device__ __forceinline__ LaneRanges lane_ranges_fast(const float (&m)[kValuesPerLane],
                                                       const float (&v)[kValuesPerLane]) {
  LaneRanges r;
  r.m = r.v = coat_range_empty();
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    r.m.amax = max_keeping_nan(r.m.amax, fabsf(m[i]));
    r.m.amin = fminf(r.m.amin, fabsf(m[i]));
    r.v.amax = max_keeping_nan(r.v.amax, v[i]);
    r.v.amin = fminf(r.v.amin, v[i]);
  }
  return r;
}

__device__ __forceinline__ LaneRanges lane_ranges_exact(const float (&m)[kValuesPerLane],
                                                        const float (&v)[kValuesPerLane]) {
  LaneRanges r;
  r.m = r.v = coat_range_empty();
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    r.m = coat_range_add(r.m, m[i]);
    r.v = coat_range_add(r.v, v[i]);
  }
  return r;
}

__device__ __forceinline__ bool is_plain(coat_range r) { return r.amin > 0.0f && r.amax < coat_positive_infinity(); }

// The group ranges the lane's per-group work needs: with split, its own state's (first its partner's part of
// that state, then a butterfly over the group's lanes of the same parity); else both, from the lane alone.
__device__ __forceinline__ LaneRanges group_ranges(LaneRanges lane, const GroupLayout& layout, bool odd) {
  if (!layout.split) return lane;
  coat_range mine = odd ? lane.v : lane.m;
  coat_range theirs;  // the partner sends this lane's state
  const coat_range give = odd ? lane.m : lane.v;
  theirs.amax = shfl_xor(give.amax, 1);
  theirs.amin = shfl_xor(give.amin, 1);
  mine = merge(mine, theirs);
#pragma unroll
  for (int offset = 2; offset < kMaxLanesPerGroup; offset *= 2)
    if (offset < layout.lanes_per_group) mine = merge_from(mine, offset);
  lane.m = lane.v = mine;
  return lane;
}

// ------------------------------------------------------------------------------------- element loops

// The decode formula of LaneDecoder for code i of a lane.
template <bool kGeneral>
__device__ __forceinline__ float decode_scaled(const Codes& codes, int i, const LaneDecoder& d) {
  // the entry's address: the table's address plus the code's byte offset, code * sizeof(float2). Added, not ORed
  // in: the OR assumed a 2 KB-aligned shared address, which the declared alignment does not guarantee for the
  // address in the shared window (sm_90 reserves the window's first 1 KB); with the OR, an H100 run gave
  // parameters off by ~1e6 ulps from the second step on.
  const uint32_t word = codes.w[i / 4];
  const float2 entry =
      load_shared_float2(((i % 4 == 0 ? word << 3 : word >> (8 * (i % 4) - 3)) & 0x7F8u) + d.table);
  float power = approx_exp2_ftz(fmaf(entry.x, d.inverse_k, d.fraction));
  if (kGeneral) power *= d.tail;
  return (entry.y * d.head) * power;
}

// m / denom for a denominator below 2^-126, which only eps < 2^-37 / bias_correction2_sqrt allows (the general
// variant): m / 0 is +-Inf or NaN, as the division gives it; a subnormal denom, whose reciprocal overflows, is
// scaled by 2^64 first and the quotient back.
__device__ __forceinline__ float quotient_by_small(float m, float denom) {
  if (denom == 0.0f) return m * approx_reciprocal(denom);
  const float scaled = denom * 0x1p64f;
  const float reciprocal = approx_reciprocal(scaled);
  const float ratio = m * reciprocal;
  return fmaf(fmaf(-ratio, scaled, m), reciprocal, ratio) * 0x1p64f;
}

// Decode, then the AdamW update of every element of the lane (the formulas at the top of this file); each chunk of
// new parameters is stored as soon as it is complete, which keeps fewer of them in registers. The general variant
// adds the decoders' tails and takes square root and reciprocal with subnormals; the fast one's flushing versions
// give the same results where they are used (StepLaunch.subnormal_v_matters).
template <bool kGeneral, bool kVector>
__device__ __forceinline__ void decode_and_update(const Codes& m_codes, const Codes& v_codes, const LaneDecoder& m_dec,
                                                  const LaneDecoder& v_dec, const StepLaunch& s,
                                                  const coat_adamw_tensor& t, const LaneSpan& span,
                                                  const float (&g)[kValuesPerLane], const float (&p)[kValuesPerLane],
                                                  float (&m)[kValuesPerLane], float (&v)[kValuesPerLane]) {
#pragma unroll
  for (int chunk = 0; chunk < kValuesPerLane; chunk += kStoreChunk) {
    float updated[kStoreChunk];
#pragma unroll
    for (int j = 0; j < kStoreChunk; ++j) {
      const int i = chunk + j;
      m[i] = fmaf(s.options.one_minus_beta1, g[i], decode_scaled<kGeneral>(m_codes, i, m_dec));
      v[i] = fmaf(s.options.one_minus_beta2 * g[i], g[i], decode_scaled<kGeneral>(v_codes, i, v_dec));
      const float root = kGeneral ? approx_sqrt(v[i]) : approx_sqrt_ftz(v[i]);
      // root / bias_correction2_sqrt + eps with 1 / bias_correction2_sqrt as an unevaluated sum of two floats, which
      // keeps its rounding (the same for every element) out of the result; at most 2^126 (NaN stays NaN), so that
      // the quotient's correction below never meets 0 * Inf: a v that overflowed to Inf (|g| above ~5.8e20) gives
      // a quotient of m * 2^-126, almost the C core's m / Inf = 0, not NaN
      const float denom = min_keeping_nan(fmaf(root, s.inverse_bias_correction2_sqrt,
                                               fmaf(root, s.inverse_bias_correction2_sqrt_low, s.options.eps)),
                                          0x1p126f);
      const float reciprocal = kGeneral ? approx_reciprocal(denom) : approx_reciprocal_ftz(denom);
      const float ratio = m[i] * reciprocal;
      // m / denom to about half an ulp, as the division: one correction by the exact residual
      float quotient = fmaf(fmaf(-ratio, denom, m[i]), reciprocal, ratio);
      if (kGeneral && denom < 0x1p-126f) quotient = quotient_by_small(m[i], denom);
      updated[j] = fmaf(s.minus_step_size, quotient, p[i] * s.options.decay_factor);
    }
    if (kVector && t.param_dtype == COAT_FLOAT32)
      stage_params_chunk(chunk / kStoreChunk, updated);
    else
      store_params_chunk<kVector>(t, s.options.stochastic_rounding != 0, span.first, chunk, span.count, updated);
  }
}

// The codes of a lane's values of one state (LaneEncoder's formula). kSigned: copy each value's sign to its
// code (the fast variant of v skips it: every v is positive there). The general variant adds the encoder's tail
// and gives zero its signed zero code and a non-finite value the NaN code 0x7F.
template <coat_fp8_format kFormat, bool kGeneral, bool kSigned>
__device__ __forceinline__ Codes encode_state(const float (&x)[kValuesPerLane], const LaneEncoder& e) {
  constexpr float kLog2MinSubnormal = kFormat == COAT_E4M3 ? -9.0f : -16.0f;
  float y[kValuesPerLane];
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    float scaled = fabsf(x[i]) * e.head;
    if (kGeneral) scaled *= e.tail;
    y[i] = approx_exp2_ftz(fmaxf(fmaf(e.k, approx_log2_ftz(scaled), e.bias), kLog2MinSubnormal));
    if (kSigned) y[i] = copysignf(y[i], x[i]);
    if (kGeneral && x[i] == 0.0f) y[i] = x[i];
  }
  Codes c;
#pragma unroll
  for (int q = 0; q < kValuesPerLane / 4; ++q)
    c.w[q] = fp8x4_of_finite<kFormat>(y[4 * q], y[4 * q + 1], y[4 * q + 2], y[4 * q + 3]);
  if (kGeneral) {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i)
      if (!coat_is_finite(x[i])) c.w[i / 4] = (c.w[i / 4] & ~(0xFFu << (8 * (i % 4)))) | (0x7Fu << (8 * (i % 4)));
  }
  return c;
}

template <bool kGeneral, bool kSigned>
__device__ __forceinline__ Codes encode(const float (&x)[kValuesPerLane], const LaneEncoder& e,
                                        coat_fp8_format format) {
  return format == COAT_E4M3 ? encode_state<COAT_E4M3, kGeneral, kSigned>(x, e)
                             : encode_state<COAT_E5M2, kGeneral, kSigned>(x, e);
}

// ------------------------------------------------------------------------------------------ the step

// Computes the decoders of the batch that starts at `tile` (DecoderBatch) and stores them for the warp.
__device__ __forceinline__ void compute_decoder_batch(const StepLaunch& launch, int index, uint32_t tile,
                                                      uint32_t warps) {
  const GroupLayout& layout = launch.layout;
  const DecoderBatch& batch = launch.batch;
  const coat_adamw_tensor& t = launch.tensors[index];
  const TensorPlan& plan = launch.plans[index];
  __syncwarp();  // every lane has read the previous batch's decoders
  for (int round = 0; round < batch.jobs_per_lane; ++round) {
    const int job = lane_id() + kWarpSize * round;
    const int group = (job & ((1 << batch.job_shift) - 1)) >> 1;
    const bool is_v = job & 1;
    const uint32_t job_tile = tile + static_cast<uint32_t>(job >> batch.job_shift) * warps;
    const uint32_t row = (__umulhi(job_tile, plan.magic) + job_tile) >> plan.shift;
    const int64_t column = static_cast<int64_t>(job_tile - row * plan.tiles_per_row) * kTileColumns +
                           (static_cast<int64_t>(group) << layout.group_shift);
    const bool valid = job_tile < plan.tiles && column < t.cols;
    const int64_t meta_offset = (row * plan.groups_per_row + (column >> layout.group_shift)) * COAT_META_VALUES;
    const uint16_t* meta = (is_v ? t.exp_avg_sq_meta : t.exp_avg_meta) + (valid ? meta_offset : 0);
    store_decoder(job, decoder_of(load_meta(meta, valid), is_v ? t.exp_avg_sq_format : t.exp_avg_format,
                                  is_v ? launch.options.beta2 : launch.options.beta1));
  }
  __syncwarp();
}

// One tile; `slot` is its place in its decoder batch. kVector: the tensor is aligned and every lane of the tile
// whole, so that all move their 16 elements by 16-byte accesses.
template <bool kVector>
__device__ __forceinline__ void step_tile(const StepLaunch& launch, int index, uint32_t tile, uint32_t warps,
                                          int slot) {
  const GroupLayout& layout = launch.layout;
  const DecoderBatch& batch = launch.batch;
  const coat_adamw_tensor& t = launch.tensors[index];
  const TensorPlan& plan = launch.plans[index];
  const coat_adamw_options& o = launch.options;
  const LaneSpan span = lane_span(tile, plan, t.cols);
  const int lane = lane_id();
  const bool odd = lane & 1;
  // The lane's group exists when its first column is in the row; with split, when the even lane's is.
  const bool group_valid = span.column - (layout.split && odd ? kValuesPerLane : 0) < t.cols;
  const int64_t meta_offset =
      (span.row * plan.groups_per_row + (span.column >> layout.group_shift)) * COAT_META_VALUES;
  // The lane's own state, with split: m for even lanes, v for odd ones.
  uint16_t* own_meta = (odd ? t.exp_avg_sq_meta : t.exp_avg_meta) + meta_offset;
  const coat_fp8_format own_format = odd ? t.exp_avg_sq_format : t.exp_avg_format;

  // Loads first, so that they are in flight while the batch's decoders are computed.
  float p[kValuesPerLane], g[kValuesPerLane];
  Codes m_codes, v_codes;
  if (kVector) {
    load_values_vector(t.param, t.param_dtype, span.first, p);
    load_values_vector(t.grad, t.grad_dtype, span.first, g);
    m_codes = load_codes_vector(t.exp_avg, span.first);
    v_codes = load_codes_vector(t.exp_avg_sq, span.first);
  } else {
    load_values_scalar(t.param, t.param_dtype, span.first, span.count, p);
    load_values_scalar(t.grad, t.grad_dtype, span.first, span.count, g);
    m_codes = load_codes_scalar(t.exp_avg, span.first, span.count);
    v_codes = load_codes_scalar(t.exp_avg_sq, span.first, span.count);
  }

  // The group's old meta, as decoders (the lane's group is lane / lanes_per_group of the tile). The batch's
  // lanes read the old meta of its tiles before the __syncwarp that ends compute_decoder_batch; the group's first
  // lane pair stores the new meta below, after it.
  if (slot == 0) compute_decoder_batch(launch, index, tile, warps);
  const int m_job = (slot << batch.job_shift) + 2 * (lane >> (layout.group_shift - 4));  // lane / (G / 16)
  const LaneDecoder m_dec = load_decoder(m_job), v_dec = load_decoder(m_job + 1);

  float m[kValuesPerLane], v[kValuesPerLane];
  if (launch.subnormal_v_matters || __any_sync(kFullMask, m_dec.tail != 1.0f || v_dec.tail != 1.0f))
    decode_and_update<true, kVector>(m_codes, v_codes, m_dec, v_dec, launch, t, span, g, p, m, v);
  else
    decode_and_update<false, kVector>(m_codes, v_codes, m_dec, v_dec, launch, t, span, g, p, m, v);
  // Elements past the end of the row were computed from zeros: m = v = 0, outside every exact range.

  LaneRanges ranges = group_ranges(lane_ranges_fast(m, v), layout, odd);
  const bool specials = __any_sync(kFullMask, !is_plain(ranges.m) || !is_plain(ranges.v));
  if (specials) ranges = group_ranges(lane_ranges_exact(m, v), layout, odd);

  LaneEncoder m_enc, v_enc;
  if (layout.split) {
    coat_meta meta;
    const LaneEncoder mine = encoder_of_range(odd ? ranges.v : ranges.m, own_format,
                                              odd ? o.expand_exp_avg_sq : o.expand_exp_avg, &meta);
    if (group_valid && (lane & (layout.lanes_per_group - 1)) < 2) coat_meta_store(meta, own_meta);
    m_enc = encoder_from_lane(mine, lane & ~1);
    v_enc = encoder_from_lane(mine, lane | 1);
  } else {
    coat_meta m_meta, v_meta;
    m_enc = encoder_of_range(ranges.m, t.exp_avg_format, o.expand_exp_avg, &m_meta);
    v_enc = encoder_of_range(ranges.v, t.exp_avg_sq_format, o.expand_exp_avg_sq, &v_meta);
    if (group_valid) {
      coat_meta_store(m_meta, t.exp_avg_meta + meta_offset);
      coat_meta_store(v_meta, t.exp_avg_sq_meta + meta_offset);
    }
  }

  Codes m_out, v_out;
  if (specials || __any_sync(kFullMask, m_enc.tail != 1.0f || v_enc.tail != 1.0f)) {
    m_out = encode<true, true>(m, m_enc, t.exp_avg_format);
    v_out = encode<true, true>(v, v_enc, t.exp_avg_sq_format);
  } else {
    m_out = encode<false, true>(m, m_enc, t.exp_avg_format);
    v_out = encode<false, false>(v, v_enc, t.exp_avg_sq_format);
  }
  if (kVector) {
    store_codes_vector(t.exp_avg, span.first, m_out);
    store_codes_vector(t.exp_avg_sq, span.first, v_out);
    if (t.param_dtype == COAT_FLOAT32) store_staged_params(static_cast<float*>(t.param) + span.first - lane * kValuesPerLane);
  } else {
    store_codes_scalar(t.exp_avg, span.first, span.count, m_out);
    store_codes_scalar(t.exp_avg_sq, span.first, span.count, v_out);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock, kStepBlocksPerSM)
    fp8_adamw_step_kernel(const __grid_constant__ StepLaunch launch) {
  build_step_tables();
  const uint32_t warps = gridDim.x * kWarpsPerBlock;
  const uint32_t warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int i = 0; i < launch.count; ++i) {
    const TensorPlan& plan = launch.plans[i];
    uint32_t tile = warp >= plan.phase ? warp - plan.phase : warp + warps - plan.phase;
    for (int slot = 0; tile < plan.tiles; tile += warps, slot = slot + 1 == launch.batch.tiles ? 0 : slot + 1) {
      const uint32_t row = (__umulhi(tile, plan.magic) + tile) >> plan.shift;
      const bool full = static_cast<int64_t>(tile - row * plan.tiles_per_row + 1) * kTileColumns <= launch.tensors[i].cols;
      if (plan.vector && full)
        step_tile<true>(launch, i, tile, warps, slot);
      else
        step_tile<false>(launch, i, tile, warps, slot);
    }
  }
}

// ---------------------------------------------------------------------------------------------- host

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

// The most step-kernel blocks resident at once on the current device (cached per device; host queries only,
// no synchronisation), or 0 if the queries fail.
int resident_step_blocks() {
  static int cached[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return 0;
  if (device < 64 && cached[device] > 0) return cached[device];
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fp8_adamw_step_kernel, kThreadsPerBlock, 0) !=
          cudaSuccess)
    return 0;
  const int blocks = sms * (per_sm > 0 ? per_sm : 1);
  if (device < 64) cached[device] = blocks;
  return blocks;
}

coat_status launch_step(StepLaunch& launch, int64_t total_tiles, cudaStream_t stream) {
  const int resident = resident_step_blocks();
  if (resident <= 0) return COAT_ERROR_CUDA;
  const int64_t wanted = coat_ceil_div(total_tiles, kWarpsPerBlock);
  const unsigned blocks = static_cast<unsigned>(wanted < resident ? wanted : resident);
  const int64_t warps = static_cast<int64_t>(blocks) * kWarpsPerBlock;
  int64_t first = 0;
  for (int i = 0; i < launch.count; ++i) {
    launch.plans[i].phase = static_cast<uint32_t>(first % warps);
    first += launch.plans[i].tiles;
  }
  fp8_adamw_step_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(launch);
  return launch_status();
}

}  // namespace

extern "C" coat_status coat_fp8_adamw_step_cuda(const coat_adamw_tensor* tensors, int64_t count,
                                                const coat_adamw_options* options, coat_cuda_stream stream) {
  if (!coat_adamw_call_is_valid(tensors, count, options)) return COAT_ERROR_INVALID_ARGUMENT;
  StepLaunch launch;
  launch.options = *options;
  launch.minus_step_size = -options->step_size;
  const double inverse_bias_correction2_sqrt = 1.0 / options->bias_correction2_sqrt;
  launch.inverse_bias_correction2_sqrt = static_cast<float>(inverse_bias_correction2_sqrt);
  launch.inverse_bias_correction2_sqrt_low =
      static_cast<float>(inverse_bias_correction2_sqrt - launch.inverse_bias_correction2_sqrt);
  // sqrt of a subnormal v is below 2^-63: where eps exceeds 2^-37 times what it is multiplied by, fmaf(sqrt(v),
  // 1 / bias_correction2_sqrt, eps) rounds to eps whether sqrt flushes it or not (half an ulp of eps is >=
  // eps * 2^-25), and the fast update's flushing square root and reciprocal give the general update's values.
  launch.subnormal_v_matters = !(options->eps >= std::ldexp(inverse_bias_correction2_sqrt, -37));
  const int group_shift = __builtin_ctzll(options->group_size);
  launch.layout.group_shift = group_shift;
  launch.layout.lanes_per_group = static_cast<int>(options->group_size / kValuesPerLane);
  launch.layout.split = launch.layout.lanes_per_group >= 2;
  launch.batch.job_shift = 10 - group_shift;  // 2 * 512 = 2^10
  launch.batch.tiles = std::max(kWarpSize >> launch.batch.job_shift, 1);
  launch.batch.jobs_per_lane = std::max((1 << launch.batch.job_shift) / kWarpSize, 1);
  launch.count = 0;
  int64_t total_tiles = 0;
  for (int64_t i = 0; i < count; ++i) {
    const coat_adamw_tensor& t = tensors[i];
    TensorPlan plan;
    if (!make_plan(t.rows, t.cols, &plan)) return COAT_ERROR_INVALID_ARGUMENT;
    if (plan.tiles == 0) continue;
    plan.groups_per_row = coat_ceil_div(t.cols, options->group_size);
    plan.vector = t.cols % kValuesPerLane == 0 && aligned(t.param, 16) && aligned(t.grad, 16) &&
                  aligned(t.exp_avg, 16) && aligned(t.exp_avg_sq, 16);
    launch.tensors[launch.count] = t;
    launch.plans[launch.count] = plan;
    total_tiles += plan.tiles;
    if (++launch.count == kTensorsPerLaunch) {
      const coat_status status = launch_step(launch, total_tiles, stream);
      if (status != COAT_SUCCESS) return status;
      launch.count = 0;
      total_tiles = 0;
    }
  }
  return launch.count > 0 ? launch_step(launch, total_tiles, stream) : COAT_SUCCESS;
}
