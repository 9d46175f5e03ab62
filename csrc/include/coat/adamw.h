/*
 * coat core: FP8 AdamW with dynamic range expansion (COAT, section 4 and appendices A, F, G.4).
 *
 * Optimizer state layout. A state tensor (the first moment m = exp_avg, the second moment v = exp_avg_sq)
 * has its parameter's shape, viewed as a row-major rows x cols matrix: leading dimensions collapse into
 * rows, cols is the last dimension, a 1-D tensor of n elements is 1 x n. Each row is cut into 1 x G groups,
 * group j of row r holding columns [j*G, min((j+1)*G, cols)), so a row has ngroups = ceil(cols / G) groups
 * and the last one may be short. G is 16, 32, 64 or 128 (128 by default).
 *   Why rows: FSDP2 shards parameters, and with them the states, along dim 0, so a row never straddles two
 *   ranks. Every group stays local to one shard, the statistics need no communication, and a checkpoint can
 *   be resharded onto any number of ranks with every group intact. (Groups of the flattened tensor would
 *   cross shard boundaries whenever cols is not a multiple of G.)
 * A state is stored as
 *   codes: rows*cols FP8 bytes (E4M3 or E5M2, chosen per state: e.g. E4M3 for m, E5M2 for v);
 *   meta:  rows*ngroups*3 bf16 values, (scale, k, C) of group j of row r at meta[(r*ngroups + j)*3 + 0..2],
 *          i.e. a contiguous (rows, ngroups, 3) tensor,
 * so a state costs 1 + 6/G bytes per parameter and the pair m, v 2 + 12/G (2.094 at G = 128).
 *
 * Quantization of one group x_1..x_n (fp32), format F with FP8_MAX = 448 (E4M3) or 57344 (E5M2):
 *   amax = max |x_i|, amin = min |x_i| over x_i != 0, both over the finite elements only
 *   C    = bf16(sqrt(amin) * sqrt(amax))          geometric mean of the extremes (appendix G.4)
 *   k    = bf16(clamp(log2(R_fmt) / log2(amax / amin), 1/2, 64)), or k = 1 when amax == amin
 *          R_fmt = FP8_MAX / FP8_MIN_SUBNORMAL: E4M3 448 * 2^9, E5M2 57344 * 2^16 (section 4.1), so that
 *          after expansion the group's range (amax/amin)^k spans the format's whole range
 *   y_i  = sign(x_i) * (|x_i| / C)^k              the expand function f of section 4.2, normalised by C
 *   scale = bf16_up(max(max|y| / FP8_MAX, 2^-126)) rounded UP, so max|y| / scale <= FP8_MAX
 *   code_i = fp8(y_i / scale)                     round to nearest even, saturating (coat/fp8.h), except that a
 *            nonzero x_i never gets a zero code: where y_i / scale rounds to +-0 it takes the smallest
 *            subnormal code of its sign (+-FP8_MIN_SUBNORMAL) instead
 * bf16(.) rounds to nearest even. Each of C, k and scale is rounded to bf16 before it is used, so the stored
 * values are exactly the ones quantization used and dequantization inverts:
 *   x'_i = sign(code_i) * C * (|fp8_decode(code_i)| * scale)^(1/k)
 * k = 1 and C = 1 (no expansion: y = x, plain per-group quantization) when expansion is off, when the group
 * has no nonzero finite element (all zero: codes 0, scale 2^-126, exact zeros back), and when C would not be
 * a normal bf16 number (groups whose geometric mean is below 2^-126 or above ~3.39e38). When k == 1 the
 * power is skipped in both directions (y = x / C, x' = C * t), so with C = 1 plain quantization rounds only
 * in y / scale and in the FP8 code, like the quantizers of coat/quantize.h.
 *
 * No flush to zero. The smallest elements of v matter most (the update divides by sqrt(v)). A nonzero v
 * flushed to 0 under a nonzero m turns that element's update into m / eps: with E4M3 v on gradients that
 * span 1e7 within a group, m / sqrt(v) came out 5e4 where its true values are at most ~3. Rounded up to the
 * format's floor instead, v only shrinks that element's step; for m the absolute error stays below the
 * floor, as with flushing.
 *
 * The clamp of k to [1/2, 64]:
 *   - k >= 1/2. Groups wider than the format (amax/amin > R_fmt) get k < 1: they are compressed instead of
 *     having their smallest elements pushed to the format's floor. That matters for v at the first step,
 *     v = (1-beta2)g^2, whose range is the square of the gradient's: on a small transformer, E4M3 v at step
 *     1 gives a mean squared error of m / sqrt(v) of 5.4e-4 with k >= 1/2 against 5.0e-3 with k >= 1 (and
 *     0.55 with k >= 1 and flushing). The price of k < 1 is the precision of the largest elements, whose
 *     relative error grows like delta / k; at k = 1/2 it is at most twice the format's. 1/2 also bounds every
 *     expanded value: |log2 y| <= k * log2(amax / amin) / 2 <= 277 / 4 < 70 (fp32 spans 2^-149..2^128), so
 *     y, scale and y / scale stay finite for all finite inputs, 1e-45 and 3e38 in one group included.
 *   - k <= 64. k grows without bound as amax / amin -> 1 (v late in training), and C's bf16 rounding
 *     (relative error <= 2^-9) shifts log2 |y| by up to k * 0.0028: at 64, by 0.18, so |log2 y| stays below
 *     16.1. Beyond 64 nothing is gained: the dequantization error, ~2^-4 / k relative for E4M3, is already
 *     ~0.1%.
 * How the powers are computed: in the log domain. The C core uses coat's own log2 / exp2 (coat/detail/adamw_math.h:
 * table lookups, integer bit operations, +, * and fmaf, no division; log2 to ~2^-27 absolute, exp2 to 1.3 ulp),
 * never libm's, so that its results do not depend on the platform's math library; CUDA's quantize_expanded and
 * dequantize_expanded use the same functions and equal the C core bit for bit. CUDA's fp8_adamw_step computes
 * the same formulas with the GPU's hardware exp2 / log2 (ex2.approx, lg2.approx: 2 ulp), square root and
 * reciprocal (csrc/cuda/adamw_step.cu) and agrees with the C core within a stated tolerance (tests/test_adamw_ops.py:
 * its errors against a float64 oracle at most twice the C core's; an FP8 code may differ where the value lies
 * within the arithmetic's error of a rounding boundary). With k != 1, per group, from the stored bf16 values:
 *   quantization:   z_i = k * log2(|x_i| / C) - log2(scale)       one log2 per element (log2 C and log2 scale
 *                   code_i = sign(x_i) | fp8(2^z_i)               once per group, integer parts kept exact), one
 *                                                                 exp2, no division: the division by the stored
 *                                                                 scale happens in the log domain; z_i is clamped
 *                                                                 to [log2 FP8_MIN_SUBNORMAL, just below the
 *                                                                 rounding boundary above FP8_MAX], which is the
 *                                                                 saturation and the no-flush rule above
 *                   scale = bf16_up(max(2^(k * log2(amax / C) - log2 FP8_MAX), 2^-126)), the same value as
 *                   max|y| / FP8_MAX in exact arithmetic
 *   dequantization: x'_i = sign(code_i) * 2^(log2 C + (log2|fp8_decode(code_i)| + log2 scale) / k)
 *                                                                 log2 of the 256 FP8 values from a table; one
 *                                                                 exp2 and one fmaf per element
 * These are the formulas above in exact arithmetic; in fp32 they agree with the float64 reference to a few
 * ulp of the codes' arguments (tests/test_adamw_ops.py says how often a code or a bf16 meta value may land on
 * the other side of a rounding boundary).
 *
 * Non-finite values. A NaN or +-Inf element takes no part in amax / amin and encodes as the positive NaN code
 * 0x7F (both formats; no sign, because the sign of an arithmetic NaN differs between CPU and CUDA), so the
 * rest of its group is quantized exactly as if it were absent: a NaN or Inf gradient poisons its own
 * element, never its neighbours with finite wrong values.
 *
 * quantize_expanded and dequantize_expanded compute the same values on the CPU (C) and CUDA, element for element,
 * bit for bit; fp8_adamw_step agrees within the tolerance above and is deterministic on each device (the same
 * inputs give the same bits, whatever the launch's layout). States move between CPU and GPU freely: both read
 * and write the same layout and formulas. CUDA entry points enqueue work on `stream` and return without
 * synchronising.
 */
#ifndef COAT_ADAMW_H
#define COAT_ADAMW_H

#include <stddef.h>

#include "coat/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** One parameter of an fp8_adamw_step call and its two FP8 states, all contiguous, rows x cols elements.
 *  param: COAT_FLOAT32 or COAT_BFLOAT16; grad: COAT_FLOAT32, COAT_BFLOAT16 or COAT_FLOAT16 (same shape);
 *  exp_avg / exp_avg_sq: rows*cols FP8 codes in their own format; exp_avg_meta / exp_avg_sq_meta: bf16 bit
 *  patterns, rows*ceil(cols/G)*3, laid out as described at the top of this file. */
typedef struct {
  void* param;
  const void* grad;
  uint8_t* exp_avg;
  uint16_t* exp_avg_meta;
  uint8_t* exp_avg_sq;
  uint16_t* exp_avg_sq_meta;
  int64_t rows;
  int64_t cols;
  coat_dtype param_dtype;
  coat_dtype grad_dtype;
  coat_fp8_format exp_avg_format;
  coat_fp8_format exp_avg_sq_format;
  uint64_t rounding_seed; /**< stochastic rounding of a bf16 param: this tensor's seed for this step */
} coat_adamw_tensor;

/** Hyperparameters of one step, the same for every tensor of a call. The host computes every value in
 *  float64 and rounds it to float, as torch.optim.AdamW does, from lr, weight_decay and the step number t:
 *    one_minus_beta1 = 1 - beta1, one_minus_beta2 = 1 - beta2   (not 1 - float(beta): 1 - float(0.999) is
 *                                                                 1.3e-5 away from 0.001)
 *    decay_factor = 1 - lr * weight_decay
 *    step_size = lr / (1 - beta1^t)
 *    bias_correction2_sqrt = sqrt(1 - beta2^t) */
typedef struct {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float decay_factor;
  float step_size;
  float bias_correction2_sqrt;
  int64_t group_size;
  int expand_exp_avg;    /**< nonzero: dynamic range expansion for m; zero: plain per-group quantization */
  int expand_exp_avg_sq; /**< the same for v */
  int stochastic_rounding; /**< nonzero: bf16 parameters are rounded stochastically (see below), else to nearest */
} coat_adamw_options;

/** One AdamW step on `count` parameters, fused: per element, in fp32, in torch.optim.AdamW's order
 *  (single-tensor implementation), with the options' floats:
 *    m = dequantize(exp_avg), v = dequantize(exp_avg_sq)      (formula at the top of this file)
 *    m = beta1 * m + one_minus_beta1 * g
 *    v = beta2 * v + one_minus_beta2 * g * g
 *    p = p * decay_factor
 *    denom = sqrt(v) / bias_correction2_sqrt + eps
 *    p = p - step_size * m / denom                             ((step_size * m) / denom)
 *  then m and v are quantized again, each group with fresh (scale, k, C) from its new values, written over
 *  the old codes and meta. A bf16 parameter is widened to fp32, updated and rounded once to bf16: there is
 *  no fp32 master copy. Rounded to nearest (even), updates smaller than half a bf16 ulp of p are lost, as they
 *  are with torch.optim.AdamW on bf16 parameters. With options->stochastic_rounding the fp32 result p rounds
 *  up in magnitude with probability equal to the fraction of a bf16 ulp it lies above the bf16 value below it,
 *  so the stored parameter is p in expectation and small updates accumulate:
 *    w    = (lo(index) + lo(rounding_seed)) ^ hi(rounding_seed) ^ (hi(index) * 0x9E3779B9)   (32-bit words,
 *           index = row*cols + col, lo / hi the low / high 32 bits, arithmetic mod 2^32)
 *    r    = the top 16 bits of lowbias32(w): w ^= w >> 16; w *= 0x7FEB352D; w ^= w >> 15; w *= 0x846CA68B;
 *           w ^= w >> 16
 *    bf16 = (bits(p) + r) >> 16                   (NaN and +-Inf round to nearest; a finite p within a ulp of
 *                                                  the largest bf16 can round to Inf, with that probability)
 *  r depends only on the seed and the element's index, so the C core and CUDA draw the same bits, and a step
 *  repeated with the same seed gives the same parameters. The caller picks a fresh seed per tensor and step;
 *  adding a shard's global offset o to lo(rounding_seed) makes the shard draw the bits of elements o, o+1, ...
 *  of the whole tensor (exactly, for tensors below 2^32 elements). A NaN or +-Inf gradient element makes its parameter NaN, as in
 *  torch (Inf / Inf in the update), and its m and v NaN codes; the rest of its groups is unaffected.
 *  The CUDA entry point launches once per 32 tensors (their pointers and sizes travel by value in the
 *  kernel's arguments: no device allocation, no copy, no synchronisation) and skips empty tensors; it uses the
 *  GPU's fast arithmetic (hardware exp2, log2, sqrt and reciprocal, m / denom corrected to about half an ulp),
 *  within the tolerance stated at the top of this file, with the edge cases above unchanged. */
coat_status coat_fp8_adamw_step_cpu(const coat_adamw_tensor* tensors, int64_t count,
                                    const coat_adamw_options* options);
coat_status coat_fp8_adamw_step_cuda(const coat_adamw_tensor* tensors, int64_t count,
                                     const coat_adamw_options* options, coat_cuda_stream stream);

/** Quantization with dynamic range expansion (formula at the top of this file), e.g. to convert a
 *  torch.optim.AdamW state: x is fp32, rows x cols with rows starting row_stride >= cols elements apart;
 *  codes are rows*cols contiguous bytes in `format`; meta is rows*ceil(cols/G)*3 bf16 bit patterns.
 *  expand == 0 gives plain per-group quantization (k = 1, C = 1). */
coat_status coat_quantize_expanded_cpu(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                                       int64_t group_size, coat_fp8_format format, int expand,
                                       uint8_t* codes, uint16_t* meta);
coat_status coat_quantize_expanded_cuda(const float* x, int64_t rows, int64_t cols, int64_t row_stride,
                                        int64_t group_size, coat_fp8_format format, int expand,
                                        uint8_t* codes, uint16_t* meta, coat_cuda_stream stream);

/** Dequantization: out[r*cols + c] = sign * C * (|fp8_decode(code)| * scale)^(1/k) in fp32, with the
 *  (scale, k, C) of the element's group; codes and out are contiguous rows x cols. Zero codes give +-0,
 *  NaN codes NaN (and E5M2 Inf codes +-Inf). */
coat_status coat_dequantize_expanded_cpu(const uint8_t* codes, coat_fp8_format format, const uint16_t* meta,
                                         int64_t rows, int64_t cols, int64_t group_size, float* out);
coat_status coat_dequantize_expanded_cuda(const uint8_t* codes, coat_fp8_format format, const uint16_t* meta,
                                          int64_t rows, int64_t cols, int64_t group_size, float* out,
                                          coat_cuda_stream stream);

/*
 * Statistics of an FP8 optimizer state (codes and meta as coat_quantize_expanded writes them, codes rows x cols
 * contiguous, meta (scale, k, C) per group, rows * ceil(cols / G) groups), what coat.report shows of a moment.
 * coat_moment_counts takes `count` states (coat_moment_state, with pointers to device memory for CUDA, one
 * launch for up to 32 of them) and adds into each one's counts (COAT_MOMENT_COUNTS uint64, zeros to start):
 *   over the measured rows (row_index[i] for i < measured_rows, every row when row_index is NULL; an index
 *   outside [0, rows) counts its row's elements as nonfinite), with x' = dequantize_expanded of each element:
 *     [0] elements, [1] x' NaN or +-Inf, [2] zero codes (+-0), [3] max over the finite x' of |x'|'s fp32 bits
 *   over every group, k = the group's bf16 k:
 *     [4] groups, [5] k != 1 (NaN included), [6] k NaN, [7] max of 0xFFFF - key(k) and [8] max of key(k) over
 *     the groups whose k is not NaN, where key(k) = COAT_ORDERED_BF16(bits of k) orders like the values
 *   and writes k_keys[g] = (key_prefix << 16) | key(k) for every group g, so that sorting the keys of several
 *   states (each with its own prefix) sorts each state's k in a run of its own: the median is read from there.
 * The counts are integers and maxima, so the CUDA implementation equals the CPU one in any order of its atomics.
 * coat_moment_stats turns the counts of n states (key prefixes 0 .. n-1) and their k_keys, sorted ascending, into
 * n rows of COAT_MOMENT_STATS float64:
 *   numel, nonfinite, zero_codes, amax, k_min, k_median, k_max, k_expanded
 * k_median is the lower median (element (groups - 1) / 2 of the state's sorted k, as torch.median); k_min,
 * k_median and k_max are NaN when any k is NaN; k_expanded = [5] / [4].
 */
#define COAT_MOMENT_COUNTS 9
#define COAT_MOMENT_STATS 8
/** bf16 bits -> a 16-bit key that orders like the values (-0 just below +0, NaNs at the ends). */
#define COAT_ORDERED_BF16(bits) (((bits) & 0x8000u) ? (~(bits) & 0xFFFFu) : ((bits) | 0x8000u))
/** The inverse of COAT_ORDERED_BF16. */
#define COAT_BF16_OF_ORDERED(key) (((key) & 0x8000u) ? ((key) ^ 0x8000u) : (~(key) & 0xFFFFu))

/** One state of coat_moment_counts. */
typedef struct {
  const uint8_t* codes;     /**< rows x cols, contiguous */
  coat_fp8_format format;
  const uint16_t* meta;     /**< (scale, k, C) of each of rows * ceil(cols / G) groups */
  int64_t rows, cols;
  const int64_t* row_index; /**< measured_rows row indices, or NULL: every row (measured_rows == rows) */
  int64_t measured_rows;
  int32_t key_prefix;       /**< 0 .. 0x7FFF */
  uint64_t* counts;         /**< COAT_MOMENT_COUNTS values */
  int32_t* k_keys;          /**< one per group */
} coat_moment_state;

coat_status coat_moment_counts_cpu(const coat_moment_state* states, int64_t count, int64_t group_size);
coat_status coat_moment_counts_cuda(const coat_moment_state* states, int64_t count, int64_t group_size,
                                    coat_cuda_stream stream);
/** The `count` k_keys of n states (key prefixes 0 .. n-1, 1 <= n <= 0x8000) sorted ascending into sorted_keys, for
 *  coat_moment_stats (a radix sort of the low 16 + ceil(log2 n) bits, the only ones a key can have set). workspace:
 *  device memory of coat_moment_keys_sort_workspace(count, n) bytes (both CUDA builds only; on the CPU any sort of
 *  int32 serves, as the binding's at::sort). */
size_t coat_moment_keys_sort_workspace(int64_t count, int64_t n);
coat_status coat_moment_keys_sort_cuda(const int32_t* keys, int32_t* sorted_keys, int64_t count, int64_t n,
                                       void* workspace, size_t workspace_bytes, coat_cuda_stream stream);
coat_status coat_moment_stats_cpu(const uint64_t* counts, const int32_t* sorted_keys, int64_t n, double* stats);
coat_status coat_moment_stats_cuda(const uint64_t* counts, const int32_t* sorted_keys, int64_t n, double* stats,
                                   coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_ADAMW_H */
