// CUDA implementation of coat/adamw.h. Every value comes from the element-level steps of
// coat/detail/adamw_math.h, as in the C core, so both agree bit for bit.
//
// Work split: a warp takes a tile of 512 consecutive columns of one row, 16 consecutive elements per lane:
// 16-byte loads and stores throughout (4 per fp32 array, 2 per 16-bit array, 1 per FP8 state) when the tensor
// allows them (cols % 16 == 0 and aligned pointers), element by element otherwise. 512 is a multiple of every
// group size, so a group of G columns is G/16 (1 to 8) adjacent lanes of one warp, and its statistics (amax,
// amin) are a butterfly of __shfl_xor_sync: no shared memory for them, no barrier.
//
// Per-group work (the quantities decode and encode derive from a group's meta, and the new meta) is split
// between the two states when a group spans two lanes or more (G >= 32): the even lane of each lane pair does
// m's, the odd lane v's, and every lane reads both from the pair with __shfl_sync. With G = 16 each lane is a
// group and does both. Amortised over 16 elements per lane, this keeps the per-group work (per state two IEEE
// divisions, two square roots, two log2 and an exp2) at about a tenth of the per-element cost.
//
// The step kernel is persistent: a grid of about as many blocks as fit on the GPU, each warp walking every
// tensor of the launch by a stride of the grid's warps. Each block first builds coat_adamw_tables (log2
// tables and the per-code FP8 tables) in shared memory with the same arithmetic as the C core.
//
// Fast paths (the same values as the C core's general code; the comments say why):
//   decode: when every finite nonzero code of the group gives 2^n * 2^f with n in [-125, 127]
//           (coat_decoder.fast_scaling), 2^n is built from the bits of the rounding sum (one multiply) and the
//           code's table factor gives the sign and the results of zero / Inf / NaN codes (another);
//   encode: when the group holds no subnormal (amin >= 2^-126), the log-domain path without the subnormal
//           rescaling, and the lane's zero and non-finite elements (if any) patched afterwards.
#include "coat/adamw.h"

#include <cuda_runtime.h>

#include "coat/detail/adamw_math.h"

namespace {

constexpr int kWarpSize = 32;
constexpr int kValuesPerLane = 16;
constexpr int64_t kTileColumns = kWarpSize * kValuesPerLane;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
constexpr int kTensorsPerLaunch = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__constant__ coat_log2_entry kLog2Reduction[32] = COAT_LOG2_REDUCTION_TABLE;
__constant__ float kLog2Bf16[128] = COAT_LOG2_BF16_TABLE;

// The step kernel's tables. The hot loops read them by name, not through a pointer, so that their shared-memory
// address is an immediate of the load instruction and an index needs no add.
__shared__ coat_adamw_tables step_tables;

// Where a tensor's tiles go: rows x tiles_per_row tiles, tile -> row by a multiply-high (the divisor is fixed
// per tensor; Granlund-Montgomery with n < 2^31), and the first tile a warp takes.
struct TensorPlan {
  uint32_t tiles;
  uint32_t tiles_per_row;
  uint32_t magic;  // row = (umulhi(tile, magic) + tile) >> shift
  uint32_t shift;
  uint32_t phase;  // (tiles of the launch's earlier tensors) % (warps of the grid): tile t goes to warp (phase + t) % warps
  uint32_t vector; // 16-byte aligned param, grad and codes, cols % 16 == 0: whole lanes load and store by vectors
};

// The tensors of one step launch. They travel by value in the kernel's parameter space (__grid_constant__:
// read in place), so a launch needs no device allocation, no copy and no synchronisation.
struct StepLaunch {
  coat_adamw_options options;
  coat_adamw_tensor tensors[kTensorsPerLaunch];
  TensorPlan plans[kTensorsPerLaunch];
  int count;
};
// 4 KiB is the parameter limit of every CUDA version and architecture.
static_assert(sizeof(StepLaunch) <= 4096, "step launch parameters exceed 4 KiB");

__device__ __forceinline__ int lane_id() { return threadIdx.x % kWarpSize; }

// Every block builds the tables; the caller may read them after this returns.
__device__ __forceinline__ void build_tables(coat_adamw_tables* t) {
  if (threadIdx.x < 32) t->reduction[threadIdx.x] = kLog2Reduction[threadIdx.x];
  if (threadIdx.x < 128) t->bf16_log2[threadIdx.x] = kLog2Bf16[threadIdx.x];
  __syncthreads();
  for (int i = threadIdx.x; i < 512; i += blockDim.x) coat_adamw_tables_fill_fp8(t, i);
  __syncthreads();
}

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(kFullMask, v, mask); }
__device__ __forceinline__ float shfl(float v, int lane) { return __shfl_sync(kFullMask, v, lane); }
__device__ __forceinline__ int shfl(int v, int lane) { return __shfl_sync(kFullMask, v, lane); }

// ------------------------------------------------------------------------------------------ lane data

// A lane's 16 elements: row, first column, index of the first element, how many exist (0..16).
struct LaneSpan {
  int64_t row;
  int64_t column;
  int64_t first;  // row * cols + column
  int count;
};

__device__ __forceinline__ LaneSpan lane_span(uint32_t tile, const TensorPlan& plan, int64_t cols) {
  const uint32_t row = (__umulhi(tile, plan.magic) + tile) >> plan.shift;
  LaneSpan span;
  span.row = row;
  span.column = static_cast<int64_t>(tile - row * plan.tiles_per_row) * kTileColumns + lane_id() * kValuesPerLane;
  span.first = span.row * cols + span.column;
  const int64_t left = cols - span.column;
  span.count = left <= 0 ? 0 : (left < kValuesPerLane ? static_cast<int>(left) : kValuesPerLane);
  return span;
}

// A lane's 16 consecutive values of a float32 / bfloat16 / float16 array as fp32, by 16-byte loads (the lane is
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
      if (dtype == COAT_BFLOAT16) {
        out[8 * q + 2 * i] = __uint_as_float(w[i] << 16);
        out[8 * q + 2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      } else {
        out[8 * q + 2 * i] = coat_f16_to_f32(static_cast<uint16_t>(w[i] & 0xFFFFu));
        out[8 * q + 2 * i + 1] = coat_f16_to_f32(static_cast<uint16_t>(w[i] >> 16));
      }
    }
  }
}

// The same element by element, for lanes that are not whole or tensors that are not aligned; missing
// elements are 0.
__device__ __forceinline__ void load_values_scalar(const void* data, coat_dtype dtype, int64_t first, int count,
                                                   float (&out)[kValuesPerLane]) {
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) out[i] = i < count ? coat_load_f32(data, dtype, first + i) : 0.0f;
}

__device__ __forceinline__ void store_params_vector(void* data, coat_dtype dtype, int64_t first,
                                                    const float (&p)[kValuesPerLane]) {
  if (dtype == COAT_FLOAT32) {
    float4* out = reinterpret_cast<float4*>(static_cast<float*>(data) + first);
#pragma unroll
    for (int q = 0; q < kValuesPerLane / 4; ++q) out[q] = make_float4(p[4 * q], p[4 * q + 1], p[4 * q + 2], p[4 * q + 3]);
    return;
  }
  uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(data) + first);
#pragma unroll
  for (int q = 0; q < kValuesPerLane / 8; ++q) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = static_cast<uint32_t>(coat_f32_to_bf16(p[8 * q + 2 * i])) |
             (static_cast<uint32_t>(coat_f32_to_bf16(p[8 * q + 2 * i + 1])) << 16);
    out[q] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ void store_params_scalar(void* data, coat_dtype dtype, int64_t first, int count,
                                                    const float (&p)[kValuesPerLane]) {
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < count) coat_store_as(data, dtype, first + i, p[i]);
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

__device__ __forceinline__ uint32_t code_at(const Codes& c, int i) { return (c.w[i / 4] >> (8 * (i % 4))) & 0xFFu; }

// ------------------------------------------------------------------------------------- decode, encode

// x, which the compiler then holds in a register instead of folding it into the instructions that use it
// (so that (bits & 0x7FFFFF) | 0x3F800000 is one LOP3 with a register operand, not two with immediates).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm("" : "+r"(x));
  return x;
}

// coat_decode for a lane's 16 codes, with coat_decoder.fast_scaling's shortcut.
__device__ __forceinline__ void decode_lane(const Codes& codes, const coat_decoder& d, coat_fp8_format format,
                                            const coat_adamw_tables* t, float (&out)[kValuesPerLane]) {
  if (d.linear) {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) out[i] = d.c * (t->fp8_value[format][code_at(codes, i)] * d.scale);
  } else if (d.fast_scaling) {
    // n = exponent + rint(w) is in [-125, 127], so 2^n is a normal number whose bits are (n + 127) << 23, and
    // (bits(w + 1.5 * 2^23) << 23) is rint(w) << 23: coat_scale_by_power_of_2's single multiply, bit for bit.
    // The entry's factor then gives the sign, and the results of zero, Inf and NaN codes (their log2 is 0,
    // and 2^n is finite).
    const uint32_t exponent_bits = opaque(static_cast<uint32_t>(d.exponent + 127) << 23);  // one LEA below
    const uint32_t format_bits = static_cast<uint32_t>(format) << 8;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) {
      const coat_fp8_entry e = (&step_tables.fp8[0][0])[code_at(codes, i) | format_bits];  // fp8[format][code]
      const float w = fmaf(e.log2, d.inverse_k, d.fraction);
      const float shifted = w + COAT_ROUND_MAGIC;
      const float rounded = shifted - COAT_ROUND_MAGIC;
      out[i] = coat_exp2_reduced(w - rounded) * __uint_as_float((__float_as_uint(shifted) << 23) + exponent_bits) *
               e.factor;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) out[i] = coat_decode(static_cast<uint8_t>(code_at(codes, i)), &d, format, t);
  }
}

// A state's encoder as a lane holds it: coat_encoder plus what selects the path.
struct LaneEncoder {
  coat_encoder e;
  int subnormals;  // the group may hold subnormal values (amin < 2^-126): coat_encode's general path
};

// Four bytes, each the low byte of a word, as one word (byte i from word i).
__device__ __forceinline__ uint32_t pack_bytes(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
  return __byte_perm(__byte_perm(b0, b1, 0x0040u), __byte_perm(b2, b3, 0x0040u), 0x5410u);
}

// The sign bytes (byte 3) of four words as one word.
__device__ __forceinline__ uint32_t pack_top_bytes(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  return __byte_perm(__byte_perm(w0, w1, 0x0073u), __byte_perm(w2, w3, 0x0073u), 0x5410u);
}

// coat_encode for a lane's 16 values; `specials`: some of them are zero or non-finite.
__device__ __forceinline__ Codes encode_lane(const float (&x)[kValuesPerLane], const LaneEncoder& le,
                                             const coat_fp8_log_format& f, coat_fp8_format format, bool specials,
                                             const coat_adamw_tables* t) {
  const coat_encoder& e = le.e;
  Codes c;
  if (e.linear || le.subnormals) {
#pragma unroll
    for (int i = 0; i < kValuesPerLane / 4; ++i) c.w[i] = 0u;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i)
      c.w[i / 4] |= static_cast<uint32_t>(coat_encode(x[i], &e, &f, format, t)) << (8 * (i % 4));
    return c;
  }
  // No subnormal: coat_encode's log-domain path for every finite nonzero element, its coat_log2_ratio spelt
  // out with the same operations in the same order.
  const uint32_t one = __float_as_uint(step_tables.reduction[0].inverse);  // 1.0f from memory: a register operand
  uint32_t magnitude[kValuesPerLane];
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    const uint32_t bits = __float_as_uint(x[i]);
    const float exponent = __uint_as_float(0x4B000000u | ((bits & 0x7FFFFFFFu) >> 23)) - e.exponent_bias;
    const coat_log2_entry entry = step_tables.reduction[(bits >> 18) & 31u];
    const float r = fmaf(__uint_as_float((bits & 0x007FFFFFu) | one), entry.inverse, -1.0f);
    const float d = fmaf(r, coat_log2_q(r), exponent + (entry.log2 - e.fraction_c));
    const float z = fmaf(e.k, d, e.minus_log2_scale);
    magnitude[i] = coat_fp8_magnitude_of_log2(fminf(fmaxf(z, f.z_min), f.z_max), &f);
  }
  // sign | magnitude, four codes to a word
#pragma unroll
  for (int q = 0; q < kValuesPerLane / 4; ++q)
    c.w[q] = pack_bytes(magnitude[4 * q], magnitude[4 * q + 1], magnitude[4 * q + 2], magnitude[4 * q + 3]) |
             (pack_top_bytes(__float_as_uint(x[4 * q]), __float_as_uint(x[4 * q + 1]), __float_as_uint(x[4 * q + 2]),
                             __float_as_uint(x[4 * q + 3])) &
              0x80808080u);
  if (specials) {  // coat_encode's early returns: zero keeps its sign, non-finite is 0x7F
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) {
      const uint32_t bits = __float_as_uint(x[i]);
      const uint32_t a = bits & 0x7FFFFFFFu;
      if (a - 1u >= 0x7F7FFFFFu) {
        const uint32_t code = a == 0u ? (bits >> 24) & 0x80u : 0x7Fu;
        c.w[i / 4] = (c.w[i / 4] & ~(0xFFu << (8 * (i % 4)))) | (code << (8 * (i % 4)));
      }
    }
  }
  return c;
}

// ------------------------------------------------------------------------------ per-group quantities

// A lane's part of its group's range: amax over finite |x|, amin over finite nonzero |x| (+Inf if none), the
// same values as coat_range_add over the elements in any order; and whether some element is zero or
// non-finite. Keys 2 * bits(x) - 2 (unsigned): zero wraps to the top, Inf and NaN lie above every finite
// value, the sign drops out.
struct LaneRange {
  coat_range range;
  bool specials;
};

__device__ __forceinline__ LaneRange lane_range(const float (&x)[kValuesPerLane]) {
  uint32_t low_key = 0xFFFFFFFFu, high_key = 0u;
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    const uint32_t key = __float_as_uint(x[i]) * 2u - 2u;
    low_key = min(low_key, key);
    high_key = max(high_key, key);
  }
  LaneRange r;
  r.specials = high_key >= 0xFEFFFFFEu;
  r.range.amin = low_key < 0xFEFFFFFEu ? __uint_as_float((low_key + 2u) >> 1) : coat_positive_infinity();
  if (!r.specials) {
    r.range.amax = __uint_as_float((high_key + 2u) >> 1);  // every element finite and nonzero
  } else {
    r.range.amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i)
      if (coat_is_finite(x[i])) r.range.amax = fmaxf(r.range.amax, fabsf(x[i]));
  }
  return r;
}

__device__ __forceinline__ coat_range merge_from(coat_range r, int mask) {
  coat_range other;
  other.amax = shfl_xor(r.amax, mask);
  other.amin = shfl_xor(r.amin, mask);
  return coat_range_merge(r, other);
}

// The group's range of one state: from lanes_per_group (2..8) lanes, where the even lane of each pair reduces
// m and the odd lane v. First each lane takes its partner's part of its own state, then a butterfly over the
// lanes of the same parity.
__device__ __forceinline__ coat_range group_range_split(const coat_range& m, const coat_range& v, bool odd,
                                                         int lanes_per_group) {
  coat_range mine = odd ? v : m;
  coat_range theirs;  // what the partner reduces: it sends us our state's part
  const coat_range give = odd ? m : v;
  theirs.amax = shfl_xor(give.amax, 1);
  theirs.amin = shfl_xor(give.amin, 1);
  mine = coat_range_merge(mine, theirs);
#pragma unroll
  for (int offset = 2; offset < 128 / kValuesPerLane; offset *= 2)
    if (offset < lanes_per_group) mine = merge_from(mine, offset);
  return mine;
}

__device__ __forceinline__ coat_decoder decoder_from_lane(const coat_decoder& d, int lane) {
  coat_decoder o;
  o.linear = shfl(d.linear, lane);
  o.scale = shfl(d.scale, lane);
  o.c = shfl(d.c, lane);
  o.inverse_k = shfl(d.inverse_k, lane);
  o.fraction = shfl(d.fraction, lane);
  o.exponent = shfl(d.exponent, lane);
  o.fast_scaling = shfl(d.fast_scaling, lane);
  return o;
}

__device__ __forceinline__ LaneEncoder encoder_from_lane(const LaneEncoder& le, int lane) {
  LaneEncoder o;
  o.e.linear = shfl(le.e.linear, lane);
  o.e.scale = shfl(le.e.scale, lane);
  o.e.k = shfl(le.e.k, lane);
  o.e.c = shfl(le.e.c, lane);
  o.e.exponent_bias = shfl(le.e.exponent_bias, lane);
  o.e.fraction_c = shfl(le.e.fraction_c, lane);
  o.e.minus_log2_scale = shfl(le.e.minus_log2_scale, lane);
  o.subnormals = shfl(le.subnormals, lane);
  return o;
}

__device__ __forceinline__ coat_meta load_meta(const uint16_t* meta, bool valid) {
  coat_meta m;
  m.scale = m.k = m.c = 1.0f;
  if (valid) m = coat_meta_load(meta);
  return m;
}

// A group's new meta: stored by the lane that made it, returned as the lane's encoder.
__device__ __forceinline__ LaneEncoder new_encoder(coat_range r, coat_fp8_format format, int expand, uint16_t* meta,
                                                   bool store, const coat_adamw_tables* t) {
  coat_meta m;
  const coat_encoder e = coat_encoder_of_range(r, format, expand, t, &m);
  if (store) coat_meta_store(m, meta);
  LaneEncoder le;
  le.e = e;
  le.subnormals = r.amin < COAT_MIN_SCALE;
  return le;
}

// ------------------------------------------------------------------------------------------ the step

__device__ __forceinline__ void step_tile(const coat_adamw_tensor& t, const TensorPlan& plan,
                                          const coat_adamw_options& o, const coat_divisor& divisor, uint32_t tile,
                                          int group_shift, const coat_adamw_tables* tables) {
  const LaneSpan span = lane_span(tile, plan, t.cols);
  // Whole lanes of aligned tensors move their 16 elements by 16-byte accesses.
  const bool whole = plan.vector != 0 && span.count == kValuesPerLane;
  const int lane = lane_id();
  const bool odd = lane & 1;
  const int lanes_per_group = (1 << group_shift) / kValuesPerLane;  // 1 (G = 16) to 8
  const bool split = lanes_per_group >= 2;
  // With split, the lane pair lies in one group, which exists when the even lane has elements.
  const bool group_valid = split ? span.column - (odd ? kValuesPerLane : 0) < t.cols : span.count > 0;
  const int64_t groups_per_row = (t.cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  const int64_t meta_offset = (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES;

  // Loads first, so that they are in flight while the old meta is decoded.
  float p[kValuesPerLane], g[kValuesPerLane];
  Codes m_codes, v_codes;
  if (whole) {
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

  // The group's old meta, as decoders: each lane reads its state's (split) or both. The group's first lane pair
  // stores the new meta below, after warp-wide shuffles that every lane reaches only with its reads consumed.
  coat_decoder m_dec, v_dec;
  if (split) {
    const coat_decoder mine =
        coat_decoder_make(load_meta((odd ? t.exp_avg_sq_meta : t.exp_avg_meta) + meta_offset, group_valid),
                          odd ? t.exp_avg_sq_format : t.exp_avg_format, tables);
    m_dec = decoder_from_lane(mine, lane & ~1);
    v_dec = decoder_from_lane(mine, lane | 1);
  } else {
    m_dec = coat_decoder_make(load_meta(t.exp_avg_meta + meta_offset, group_valid), t.exp_avg_format, tables);
    v_dec = coat_decoder_make(load_meta(t.exp_avg_sq_meta + meta_offset, group_valid), t.exp_avg_sq_format, tables);
  }

  float m[kValuesPerLane], v[kValuesPerLane];
  decode_lane(m_codes, m_dec, t.exp_avg_format, tables, m);
  decode_lane(v_codes, v_dec, t.exp_avg_sq_format, tables, v);
  if (divisor.exact_by_inverse) {  // always, in practice: bias_correction2_sqrt is in (0, 1]
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) p[i] = coat_adamw_update_by_inverse(p[i], g[i], &m[i], &v[i], &o, &divisor);
  } else {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) p[i] = coat_adamw_update(p[i], g[i], &m[i], &v[i], &o, &divisor);
  }
  if (whole)
    store_params_vector(t.param, t.param_dtype, span.first, p);
  else
    store_params_scalar(t.param, t.param_dtype, span.first, span.count, p);
  // Elements past the end of the row were computed from zeros: m = v = 0, outside every range.

  const LaneRange m_lane = lane_range(m), v_lane = lane_range(v);
  LaneEncoder m_enc, v_enc;
  if (split) {
    const coat_range r = group_range_split(m_lane.range, v_lane.range, odd, lanes_per_group);
    const LaneEncoder mine =
        new_encoder(r, odd ? t.exp_avg_sq_format : t.exp_avg_format, odd ? o.expand_exp_avg_sq : o.expand_exp_avg,
                    (odd ? t.exp_avg_sq_meta : t.exp_avg_meta) + meta_offset,
                    group_valid && (lane & (lanes_per_group - 1)) < 2, tables);
    m_enc = encoder_from_lane(mine, lane & ~1);
    v_enc = encoder_from_lane(mine, lane | 1);
  } else {
    m_enc = new_encoder(m_lane.range, t.exp_avg_format, o.expand_exp_avg, t.exp_avg_meta + meta_offset, group_valid,
                        tables);
    v_enc = new_encoder(v_lane.range, t.exp_avg_sq_format, o.expand_exp_avg_sq, t.exp_avg_sq_meta + meta_offset,
                        group_valid, tables);
  }

  const Codes m_out = encode_lane(m, m_enc, coat_fp8_log_format_of(t.exp_avg_format), t.exp_avg_format,
                                  m_lane.specials, tables);
  const Codes v_out = encode_lane(v, v_enc, coat_fp8_log_format_of(t.exp_avg_sq_format), t.exp_avg_sq_format,
                                  v_lane.specials, tables);
  if (whole) {
    store_codes_vector(t.exp_avg, span.first, m_out);
    store_codes_vector(t.exp_avg_sq, span.first, v_out);
  } else {
    store_codes_scalar(t.exp_avg, span.first, span.count, m_out);
    store_codes_scalar(t.exp_avg_sq, span.first, span.count, v_out);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    fp8_adamw_step_kernel(const __grid_constant__ StepLaunch launch) {
  coat_adamw_tables& tables = step_tables;
  build_tables(&tables);
  const uint32_t warps = gridDim.x * kWarpsPerBlock;
  const uint32_t warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int group_shift = __ffsll(launch.options.group_size) - 1;
  const coat_divisor divisor = coat_divisor_make(launch.options.bias_correction2_sqrt);
  for (int i = 0; i < launch.count; ++i) {
    const TensorPlan& plan = launch.plans[i];
    uint32_t tile = warp >= plan.phase ? warp - plan.phase : warp + warps - plan.phase;
    for (; tile < plan.tiles; tile += warps)
      step_tile(launch.tensors[i], plan, launch.options, divisor, tile, group_shift, &tables);
  }
}

// ------------------------------------------------------------------------------ quantize, dequantize

// One warp per 256-column tile, each lane deriving its own group's quantities (conversion kernels, not the
// optimizer's hot path), with the C core's general element functions.
__global__ void __launch_bounds__(kThreadsPerBlock)
    quantize_expanded_kernel(const float* x, int64_t cols, int64_t row_stride, TensorPlan plan, int group_shift,
                             coat_fp8_format format, int expand, uint8_t* codes, uint16_t* meta) {
  __shared__ coat_adamw_tables tables;
  build_tables(&tables);
  const uint32_t tile = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= plan.tiles) return;
  const LaneSpan span = lane_span(tile, plan, cols);
  float values[kValuesPerLane];
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) values[i] = i < span.count ? x[span.row * row_stride + span.column + i] : 0.0f;
  coat_range range = lane_range(values).range;
#pragma unroll
  for (int offset = 1; offset < 128 / kValuesPerLane; offset *= 2)
    if (offset < (1 << group_shift) / kValuesPerLane) range = merge_from(range, offset);
  if (span.count == 0) return;
  coat_meta m;
  const coat_encoder e = coat_encoder_of_range(range, format, expand, &tables, &m);
  const int64_t groups_per_row = (cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  if ((lane_id() & ((1 << group_shift) / kValuesPerLane - 1)) == 0)
    coat_meta_store(m, meta + (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES);
  const coat_fp8_log_format f = coat_fp8_log_format_of(format);
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) codes[span.first + i] = coat_encode(values[i], &e, &f, format, &tables);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    dequantize_expanded_kernel(const uint8_t* codes, coat_fp8_format format, const uint16_t* meta, int64_t cols,
                               TensorPlan plan, int group_shift, float* out) {
  __shared__ coat_adamw_tables tables;
  build_tables(&tables);
  const uint32_t tile = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (tile >= plan.tiles) return;
  const LaneSpan span = lane_span(tile, plan, cols);
  if (span.count == 0) return;
  const int64_t groups_per_row = (cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  const coat_decoder d = coat_decoder_make(
      coat_meta_load(meta + (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES), format,
      &tables);
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < span.count) out[span.first + i] = coat_decode(codes[span.first + i], &d, format, &tables);
}

// ---------------------------------------------------------------------------------------------- host

// The plan of a rows x cols tensor, or false when its tiles do not fit the 32-bit tile arithmetic (2^31
// tiles of 512 columns, 1.1e12 elements: more than any GPU holds).
bool make_plan(int64_t rows, int64_t cols, TensorPlan* plan) {
  const int64_t tiles_per_row = coat_ceil_div(cols, kTileColumns);
  const int64_t tiles = rows * tiles_per_row;
  if (tiles >= (int64_t{1} << 31)) return false;
  plan->tiles = static_cast<uint32_t>(tiles);
  plan->tiles_per_row = static_cast<uint32_t>(tiles_per_row);
  // row = floor(tile / d) = (umulhi(tile, magic) + tile) >> shift for tile < 2^31, with shift = ceil(log2 d)
  // and magic = floor(2^32 * (2^shift - d) / d) + 1 (Granlund and Montgomery, 1994).
  const uint64_t d = tiles_per_row > 0 ? static_cast<uint64_t>(tiles_per_row) : 1u;
  uint32_t shift = 0;
  while ((uint64_t{1} << shift) < d) ++shift;
  plan->shift = shift;
  plan->magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1);
  plan->phase = 0;
  plan->vector = 0;
  return true;
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

// Blocks for `tiles` warps, or 0 when the grid would exceed CUDA's limit.
unsigned blocks_for(int64_t tiles) {
  const int64_t blocks = coat_ceil_div(tiles, kWarpsPerBlock);
  return blocks <= 0x7FFFFFFF ? static_cast<unsigned>(blocks) : 0u;
}

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

// cudaPeekAtLastError leaves the error in place for the caller to report (coat/common.h).
coat_status launch_status() { return cudaPeekAtLastError() == cudaSuccess ? COAT_SUCCESS : COAT_ERROR_CUDA; }

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
  launch.count = 0;
  int64_t total_tiles = 0;
  for (int64_t i = 0; i < count; ++i) {
    const coat_adamw_tensor& t = tensors[i];
    TensorPlan plan;
    if (!make_plan(t.rows, t.cols, &plan)) return COAT_ERROR_INVALID_ARGUMENT;
    if (plan.tiles == 0) continue;
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

extern "C" coat_status coat_quantize_expanded_cuda(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                                                   int64_t group_size, coat_fp8_format format, int expand,
                                                   uint8_t* codes, uint16_t* meta, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || row_stride < cols || !coat_is_valid_group_size(group_size) ||
      !coat_is_valid_format(format) || (rows * cols > 0 && (x == nullptr || codes == nullptr || meta == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  TensorPlan plan;
  if (!make_plan(rows, cols, &plan)) return COAT_ERROR_INVALID_ARGUMENT;
  if (plan.tiles == 0) return COAT_SUCCESS;
  const unsigned blocks = blocks_for(plan.tiles);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  quantize_expanded_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(x, cols, row_stride, plan, __builtin_ctzll(group_size),
                                                                      format, expand, codes, meta);
  return launch_status();
}

extern "C" coat_status coat_dequantize_expanded_cuda(const uint8_t* codes, coat_fp8_format format,
                                                     const uint16_t* meta, int64_t rows, int64_t cols,
                                                     int64_t group_size, float* out, coat_cuda_stream stream) {
  if (rows < 0 || cols < 0 || !coat_is_valid_group_size(group_size) || !coat_is_valid_format(format) ||
      (rows * cols > 0 && (codes == nullptr || meta == nullptr || out == nullptr)))
    return COAT_ERROR_INVALID_ARGUMENT;
  TensorPlan plan;
  if (!make_plan(rows, cols, &plan)) return COAT_ERROR_INVALID_ARGUMENT;
  if (plan.tiles == 0) return COAT_SUCCESS;
  const unsigned blocks = blocks_for(plan.tiles);
  if (blocks == 0) return COAT_ERROR_INVALID_ARGUMENT;
  dequantize_expanded_kernel<<<blocks, kThreadsPerBlock, 0, stream>>>(codes, format, meta, cols, plan,
                                                                        __builtin_ctzll(group_size), out);
  return launch_status();
}
