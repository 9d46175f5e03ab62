// CUDA implementation of coat/adamw.h. Every value comes from the element-level steps of
// coat/detail/adamw_math.h, as in the C core, so both agree bit for bit.
//
// Work split: a warp takes a tile of 256 consecutive columns of one row, 8 consecutive elements per lane (one
// 16-byte load per 4 fp32 values, one 8-byte load per 8 codes). 256 is a multiple of every group size, so a
// group of G columns is G/8 (2 to 16) adjacent lanes of one warp, and its statistics (amax, amin) are a
// butterfly of __shfl_xor_sync over log2(G/8) steps: no shared memory for them, no barrier.
//
// Per-group work is split between the two states: the even lane of each lane pair derives m's quantities
// from m's meta, the odd lane v's, and they swap them with one __shfl_xor_sync per value. A lane pair lies in
// one group (G >= 16), so every lane ends up with both states' quantities for its group at half the cost.
//
// The step kernel is persistent: a grid of about as many blocks as fit on the GPU, each warp walking every
// tensor of the launch by a stride of the grid's warps. Each block first builds coat_adamw_tables (the log2
// reduction table and the per-code FP8 tables) in shared memory with the same arithmetic as the C core.
//
// Fast paths (the same values as the C core's general code, which the comments justify):
//   decode: when every finite nonzero code of the group gives 2^n * 2^f with n in [-125, 127]
//           (coat_decoder.fast_scaling), 2^n is built from the bits of the rounding sum, one multiply;
//   encode: when the group holds no subnormal (amin >= 2^-126), zero and non-finite elements are replaced
//           by selects instead of branches.
#include "coat/adamw.h"

#include <cuda_runtime.h>

#include "coat/detail/adamw_math.h"

namespace {

constexpr int kWarpSize = 32;
constexpr int kValuesPerLane = 8;
constexpr int64_t kTileColumns = kWarpSize * kValuesPerLane;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
constexpr int kTensorsPerLaunch = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__constant__ coat_log2_entry kLog2Reduction[32] = COAT_LOG2_REDUCTION_TABLE;

// Where a tensor's tiles go: rows x tiles_per_row tiles, tile -> row by a multiply-high (the divisor is fixed
// per tensor; Granlund-Montgomery with n < 2^31), and the first tile a warp takes.
struct TensorPlan {
  uint32_t tiles;
  uint32_t tiles_per_row;
  uint32_t magic;  // row = (umulhi(tile, magic) + tile) >> shift
  uint32_t shift;
  uint32_t phase;  // (tiles of the launch's earlier tensors) % (warps of the grid): tile t goes to warp (phase + t) % warps
  uint32_t vector; // 16-byte aligned param and grad, 8-byte aligned codes, cols % 8 == 0: whole lanes load by vectors
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
  __syncthreads();
  for (int i = threadIdx.x; i < 256; i += blockDim.x) coat_adamw_tables_fill_fp8(t, i);
  __syncthreads();
}

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(kFullMask, v, mask); }
__device__ __forceinline__ int shfl_xor(int v, int mask) { return __shfl_xor_sync(kFullMask, v, mask); }

// ------------------------------------------------------------------------------------------ lane data

// A lane's 8 elements: row, first column, how many exist (0..8), and whether they load by vectors.
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

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t h) { return __uint_as_float(h << 16); }

// 8 consecutive values of a float32 / bfloat16 / float16 array as fp32: vector loads when whole, else scalar.
__device__ __forceinline__ void load_values(const void* data, coat_dtype dtype, int64_t first, int count, bool vector,
                                            float (&out)[kValuesPerLane]) {
  if (vector && count == kValuesPerLane) {
    if (dtype == COAT_FLOAT32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(data) + first);
      const float4 a = p[0], b = p[1];
      out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
      out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    } else {
      const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + first);
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (dtype == COAT_BFLOAT16) {
          out[2 * i] = bf16_bits_to_f32(w[i] & 0xFFFFu);
          out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        } else {
          out[2 * i] = coat_f16_to_f32(static_cast<uint16_t>(w[i] & 0xFFFFu));
          out[2 * i + 1] = coat_f16_to_f32(static_cast<uint16_t>(w[i] >> 16));
        }
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) out[i] = i < count ? coat_load_f32(data, dtype, first + i) : 0.0f;
}

__device__ __forceinline__ void store_params(void* data, coat_dtype dtype, int64_t first, int count, bool vector,
                                             const float (&p)[kValuesPerLane]) {
  if (vector && count == kValuesPerLane) {
    if (dtype == COAT_FLOAT32) {
      float4* out = reinterpret_cast<float4*>(static_cast<float*>(data) + first);
      out[0] = make_float4(p[0], p[1], p[2], p[3]);
      out[1] = make_float4(p[4], p[5], p[6], p[7]);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = static_cast<uint32_t>(coat_f32_to_bf16(p[2 * i])) | (static_cast<uint32_t>(coat_f32_to_bf16(p[2 * i + 1])) << 16);
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(data) + first) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < count) coat_store_param(data, dtype, first + i, p[i]);
}

// 8 codes as two words (code i in byte i % 4 of word i / 4); missing codes are 0.
__device__ __forceinline__ uint2 load_codes(const uint8_t* codes, int64_t first, int count, bool vector) {
  if (vector && count == kValuesPerLane) return *reinterpret_cast<const uint2*>(codes + first);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < count) w[i / 4] |= static_cast<uint32_t>(codes[first + i]) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

__device__ __forceinline__ void store_codes(uint8_t* codes, int64_t first, int count, bool vector, uint2 c) {
  if (vector && count == kValuesPerLane) {
    *reinterpret_cast<uint2*>(codes + first) = c;
    return;
  }
  const uint32_t w[2] = {c.x, c.y};
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i)
    if (i < count) codes[first + i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
}

__device__ __forceinline__ uint32_t code_at(uint2 c, int i) { return ((i < 4 ? c.x : c.y) >> (8 * (i % 4))) & 0xFFu; }

// ------------------------------------------------------------------------------------- decode, encode

// coat_decode for a lane's 8 codes, with coat_decoder.fast_scaling's shortcut.
__device__ __forceinline__ void decode_lane(uint2 codes, const coat_decoder& d, coat_fp8_format format,
                                            const coat_adamw_tables* t, float (&out)[kValuesPerLane]) {
  if (d.linear) {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) {
      const uint32_t code = code_at(codes, i);
      out[i] = __uint_as_float(__float_as_uint(d.c * (t->fp8_magnitude[format][code & 0x7Fu] * d.scale)) |
                               ((code & 0x80u) << 24));
    }
  } else if (d.fast_scaling) {
    // n = exponent + rint(w) is in [-125, 127], so 2^n is a normal number whose bits are (n + 127) << 23, and
    // (bits(w + 1.5 * 2^23) << 23) is rint(w) << 23: coat_scale_by_power_of_2's single multiply, bit for bit.
    const uint32_t exponent_bits = static_cast<uint32_t>(d.exponent + 127) << 23;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) {
      const uint32_t code = code_at(codes, i);
      const float l = t->fp8_log2[format][code & 0x7Fu];
      const float w = fmaf(l, d.inverse_k, d.fraction);
      const float shifted = w + COAT_ROUND_MAGIC;
      const float rounded = shifted - COAT_ROUND_MAGIC;
      float x = coat_exp2_reduced(w - rounded) * __uint_as_float((__float_as_uint(shifted) << 23) + exponent_bits);
      // zero and Inf codes (l = -Inf, +Inf): 0 and Inf; NaN codes stay NaN through the arithmetic
      x = fabsf(l) != coat_positive_infinity() ? x : fmaxf(l, 0.0f);
      out[i] = __uint_as_float(__float_as_uint(x) | ((code & 0x80u) << 24));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) out[i] = coat_decode(static_cast<uint8_t>(code_at(codes, i)), &d, format, t);
  }
}

// coat_encode for a lane's 8 values; `subnormals`: the group may hold subnormal values (amin < 2^-126).
__device__ __forceinline__ uint2 encode_lane(const float (&x)[kValuesPerLane], const coat_encoder& e,
                                             const coat_fp8_log_format& f, coat_fp8_format format, bool subnormals,
                                             const coat_adamw_tables* t) {
  uint32_t w[2] = {0u, 0u};
  if (e.linear || subnormals) {
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i)
      w[i / 4] |= static_cast<uint32_t>(coat_encode(x[i], &e, &f, format, t)) << (8 * (i % 4));
  } else {
    // No subnormals: coat_encode's log-domain path for every finite nonzero element; zero and non-finite
    // elements take the results of its early returns by selects.
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i) {
      const uint32_t bits = __float_as_uint(x[i]);
      const uint32_t a = bits & 0x7FFFFFFFu;
      const uint32_t sign = (bits >> 24) & 0x80u;
      const float z = fmaf(e.k, coat_log2_ratio(a, e.exponent_bias, e.fraction_c, t), e.minus_log2_scale);
      uint32_t code = sign | coat_fp8_magnitude_of_log2(fminf(fmaxf(z, f.z_min), f.z_max), &f);
      if (a - 1u >= 0x7F7FFFFFu) code = a == 0u ? sign : 0x7Fu;  // zero (a - 1 wraps) or non-finite
      w[i / 4] |= code << (8 * (i % 4));
    }
  }
  return make_uint2(w[0], w[1]);
}

// ------------------------------------------------------------------------------ per-group quantities

// The lane pair's exchange: each lane computed its state's (even: m, odd: v) struct, and gets the other's.
__device__ __forceinline__ coat_decoder swap_decoder(const coat_decoder& d) {
  coat_decoder o;
  o.linear = shfl_xor(d.linear, 1);
  o.scale = shfl_xor(d.scale, 1);
  o.c = shfl_xor(d.c, 1);
  o.inverse_k = shfl_xor(d.inverse_k, 1);
  o.fraction = shfl_xor(d.fraction, 1);
  o.exponent = shfl_xor(d.exponent, 1);
  o.fast_scaling = shfl_xor(d.fast_scaling, 1);
  return o;
}

__device__ __forceinline__ coat_decoder select_decoder(bool first, const coat_decoder& a, const coat_decoder& b) {
  coat_decoder d;
  d.linear = first ? a.linear : b.linear;
  d.scale = first ? a.scale : b.scale;
  d.c = first ? a.c : b.c;
  d.inverse_k = first ? a.inverse_k : b.inverse_k;
  d.fraction = first ? a.fraction : b.fraction;
  d.exponent = first ? a.exponent : b.exponent;
  d.fast_scaling = first ? a.fast_scaling : b.fast_scaling;
  return d;
}

__device__ __forceinline__ coat_encoder select_encoder(bool first, const coat_encoder& a, const coat_encoder& b) {
  coat_encoder e;
  e.linear = first ? a.linear : b.linear;
  e.scale = first ? a.scale : b.scale;
  e.k = first ? a.k : b.k;
  e.c = first ? a.c : b.c;
  e.exponent_bias = first ? a.exponent_bias : b.exponent_bias;
  e.fraction_c = first ? a.fraction_c : b.fraction_c;
  e.minus_log2_scale = first ? a.minus_log2_scale : b.minus_log2_scale;
  return e;
}

__device__ __forceinline__ coat_encoder swap_encoder(const coat_encoder& e) {
  coat_encoder o;
  o.linear = shfl_xor(e.linear, 1);
  o.scale = shfl_xor(e.scale, 1);
  o.k = shfl_xor(e.k, 1);
  o.c = shfl_xor(e.c, 1);
  o.exponent_bias = shfl_xor(e.exponent_bias, 1);
  o.fraction_c = shfl_xor(e.fraction_c, 1);
  o.minus_log2_scale = shfl_xor(e.minus_log2_scale, 1);
  return o;
}

// A lane's part of its group's range: amax over finite |x|, amin over finite nonzero |x| (+Inf if none),
// the same values as coat_range_add over the elements in any order.
__device__ __forceinline__ coat_range lane_range(const float (&x)[kValuesPerLane]) {
  float amax = 0.0f;
  uint32_t amin_minus_1 = 0xFFFFFFFFu;
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) {
    amax = fmaxf(amax, fabsf(x[i]));  // ignores NaN, takes Inf: fixed below
    amin_minus_1 = min(amin_minus_1, (__float_as_uint(x[i]) & 0x7FFFFFFFu) - 1u);  // 0 wraps; Inf, NaN are larger than finite
  }
  if (amax == coat_positive_infinity()) {
    amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i)
      if (coat_is_finite(x[i])) amax = fmaxf(amax, fabsf(x[i]));
  }
  coat_range r;
  r.amax = amax;
  r.amin = amin_minus_1 < 0x7F7FFFFFu ? __uint_as_float(amin_minus_1 + 1u) : coat_positive_infinity();
  return r;
}

// The range merged over the G/8 lanes of each group (aligned runs of lanes); every lane gets its group's.
__device__ __forceinline__ coat_range group_range(coat_range r, int lanes_per_group) {
  for (int offset = lanes_per_group / 2; offset > 0; offset /= 2) {
    coat_range other;
    other.amax = shfl_xor(r.amax, offset);
    other.amin = shfl_xor(r.amin, offset);
    r = coat_range_merge(r, other);
  }
  return r;
}

// ------------------------------------------------------------------------------------------ the step

__device__ __forceinline__ void step_tile(const coat_adamw_tensor& t, const TensorPlan& plan,
                                          const coat_adamw_options& o, uint32_t tile, int group_shift,
                                          const coat_adamw_tables* tables) {
  const LaneSpan span = lane_span(tile, plan, t.cols);
  const bool vector = plan.vector != 0;
  const bool odd = lane_id() & 1;
  const int lanes_per_group = (1 << group_shift) / kValuesPerLane;
  // The lane pair's group exists when the even lane has elements (the pair lies in one group).
  const bool pair_valid = span.column - (odd ? kValuesPerLane : 0) < t.cols;
  const int64_t groups_per_row = (t.cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  const int64_t meta_offset = (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES;
  const coat_fp8_format my_format = odd ? t.exp_avg_sq_format : t.exp_avg_format;
  uint16_t* const my_meta = (odd ? t.exp_avg_sq_meta : t.exp_avg_meta) + meta_offset;

  // Loads first, so that they are in flight while the old meta is decoded.
  float p[kValuesPerLane], g[kValuesPerLane];
  load_values(t.param, t.param_dtype, span.first, span.count, vector, p);
  load_values(t.grad, t.grad_dtype, span.first, span.count, vector, g);
  const uint2 m_codes = load_codes(t.exp_avg, span.first, span.count, vector);
  const uint2 v_codes = load_codes(t.exp_avg_sq, span.first, span.count, vector);

  coat_meta old_meta;
  old_meta.scale = old_meta.k = old_meta.c = 1.0f;
  if (pair_valid) old_meta = coat_meta_load(my_meta);
  const coat_decoder mine = coat_decoder_make(old_meta, my_format, tables);
  const coat_decoder other = swap_decoder(mine);
  const coat_decoder m_dec = select_decoder(odd, other, mine);
  const coat_decoder v_dec = select_decoder(odd, mine, other);

  float m[kValuesPerLane], v[kValuesPerLane];
  decode_lane(m_codes, m_dec, t.exp_avg_format, tables, m);
  decode_lane(v_codes, v_dec, t.exp_avg_sq_format, tables, v);
#pragma unroll
  for (int i = 0; i < kValuesPerLane; ++i) p[i] = coat_adamw_update(p[i], g[i], &m[i], &v[i], &o);
  store_params(t.param, t.param_dtype, span.first, span.count, vector, p);
  // Elements past the end of the row computed from zeros: m = v = 0, outside every range.

  const coat_range m_range = group_range(lane_range(m), lanes_per_group);
  const coat_range v_range = group_range(lane_range(v), lanes_per_group);
  const coat_meta new_meta = coat_meta_of_range(odd ? v_range : m_range, my_format,
                                                odd ? o.expand_exp_avg_sq : o.expand_exp_avg, tables);
  // The old meta was read by this same lane (above), the only one that reads it.
  if (pair_valid && lane_id() % lanes_per_group < 2) coat_meta_store(new_meta, my_meta);
  const coat_encoder mine_e = coat_encoder_make(new_meta, tables);
  const coat_encoder other_e = swap_encoder(mine_e);
  const coat_encoder m_enc = select_encoder(odd, other_e, mine_e);
  const coat_encoder v_enc = select_encoder(odd, mine_e, other_e);

  const uint2 m_out = encode_lane(m, m_enc, coat_fp8_log_format_of(t.exp_avg_format), t.exp_avg_format,
                                  m_range.amin < COAT_MIN_SCALE, tables);
  const uint2 v_out = encode_lane(v, v_enc, coat_fp8_log_format_of(t.exp_avg_sq_format), t.exp_avg_sq_format,
                                  v_range.amin < COAT_MIN_SCALE, tables);
  store_codes(t.exp_avg, span.first, span.count, vector, m_out);
  store_codes(t.exp_avg_sq, span.first, span.count, vector, v_out);
}

__global__ void __launch_bounds__(kThreadsPerBlock)
    fp8_adamw_step_kernel(const __grid_constant__ StepLaunch launch) {
  __shared__ coat_adamw_tables tables;
  build_tables(&tables);
  const uint32_t warps = gridDim.x * kWarpsPerBlock;
  const uint32_t warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int group_shift = __ffsll(launch.options.group_size) - 1;
  for (int i = 0; i < launch.count; ++i) {
    const TensorPlan& plan = launch.plans[i];
    uint32_t tile = warp >= plan.phase ? warp - plan.phase : warp + warps - plan.phase;
    for (; tile < plan.tiles; tile += warps) step_tile(launch.tensors[i], plan, launch.options, tile, group_shift, &tables);
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
  const coat_range range = group_range(lane_range(values), (1 << group_shift) / kValuesPerLane);
  if (span.count == 0) return;
  const coat_meta m = coat_meta_of_range(range, format, expand, &tables);
  const int64_t groups_per_row = (cols + (int64_t{1} << group_shift) - 1) >> group_shift;
  if (lane_id() % ((1 << group_shift) / kValuesPerLane) == 0)
    coat_meta_store(m, meta + (span.row * groups_per_row + (span.column >> group_shift)) * COAT_META_VALUES);
  const coat_encoder e = coat_encoder_make(m, &tables);
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
// tiles of 256 columns: more elements than any GPU holds).
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
                  aligned(t.exp_avg, 8) && aligned(t.exp_avg_sq, 8);
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
