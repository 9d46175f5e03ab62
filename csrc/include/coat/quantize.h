/*
 * coat core: FP8 quantizers.
 *
 * Layout. A high-precision input is a row-major matrix of `rows` x `cols` elements whose rows start
 * `row_stride` elements apart (row_stride >= cols; the last dimension is contiguous). Groups are 1 x G
 * runs along a row: group j of row r holds columns [j*G, min((j+1)*G, cols)), so a row has
 * ngroups = ceil(cols / G) groups and the last one may be short. G is 16, 32, 64 or 128.
 * FP8 outputs are contiguous: q is rows x cols, the optional transpose q_t is cols x rows with
 * q_t[c*rows + r] == q[r*cols + c].
 *
 * Scales are fp32 and quantization divides by exactly the stored scale:
 *     amax  = max |x| over the group (or tensor), NaN elements ignored, 0 for an empty set
 *     scale = max(amax / FP8_MAX, 2^-126)
 *     q     = fp8_encode(x / scale)            (fp32 division, then coat_f32_to_fp8)
 *     x'    = fp8_decode(q) * scale            (fp32 product, then rounded to the output dtype)
 * The 2^-126 floor keeps all-zero and tiny groups finite: they quantize to zeros (or to their exact
 * subnormal multiples) and dequantize with no NaN. An Inf in a group makes its scale Inf: its finite
 * elements encode 0 and the Inf encodes NaN, so the whole group dequantizes to NaN (0 * Inf) instead of
 * silently losing the overflow. A NaN element encodes NaN and leaves the rest of its group unchanged.
 *
 * The CPU (C) and CUDA implementations compute the same values element for element, bit for bit.
 * CUDA entry points enqueue work on `stream` and return without synchronising.
 */
#ifndef COAT_QUANTIZE_H
#define COAT_QUANTIZE_H

#include "coat/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The smallest scale a quantizer stores: 2^-126, the smallest normal fp32. */
#define COAT_MIN_SCALE 1.17549435e-38f

/** Per-group quantization along rows:
 *    scales[r*ngroups + j] = max(amax(x[r, group j]) / FP8_MAX, 2^-126)
 *    q[r*cols + c]         = fp8_encode(x[r, c] / scales[r*ngroups + c/G])
 *  x: `dtype` elements; scales: rows*ngroups fp32; q: rows*cols bytes; q_t: cols*rows bytes or NULL. */
coat_status coat_quantize_group_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t group_size, coat_fp8_format format,
                                    uint8_t* q, float* scales, uint8_t* q_t);
coat_status coat_quantize_group_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                     int64_t row_stride, int64_t group_size, coat_fp8_format format,
                                     uint8_t* q, float* scales, uint8_t* q_t, coat_cuda_stream stream);

/** Stage 1 of group scaling: group_amax[r*ngroups + j] = max |x| over group j of row r (NaN ignored).
 *  This is the statistic a producer kernel can emit alongside its output; stage 2 reduces it. */
coat_status coat_group_amax_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                int64_t row_stride, int64_t group_size, float* group_amax);
coat_status coat_group_amax_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                 int64_t row_stride, int64_t group_size, float* group_amax,
                                 coat_cuda_stream stream);

/** Stage 2 of group scaling: amax[0] = max(group_amax[0..count)), 0 when count == 0.
 *  Inputs must be >= 0 and not NaN, as stage 1 produces. */
coat_status coat_reduce_amax_cpu(const float* group_amax, int64_t count, float* amax);
coat_status coat_reduce_amax_cuda(const float* group_amax, int64_t count, float* amax,
                                  coat_cuda_stream stream);

/** Per-tensor amax, accumulated into one value: amax[0] = max(amax[0], max |x| over the matrix), NaN
 *  ignored. amax[0] must hold a value >= 0 and not NaN (0 to start a reduction), so that several tensors
 *  sharing one scale reduce into one amax with one call each. amax is a device pointer for CUDA. */
coat_status coat_tensor_amax_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                 int64_t row_stride, float* amax);
coat_status coat_tensor_amax_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                  int64_t row_stride, float* amax, coat_cuda_stream stream);

/** Stage 3 of group scaling, per-tensor quantization with a precomputed amax (one fp32 value):
 *    scale[0] = max(amax[0] / FP8_MAX, 2^-126)
 *    q[r*q_stride + c] = q_t[c*q_t_stride + r] = fp8_encode(x[r, c] / scale[0])
 *  Either output may be NULL (not written). The output strides place the codes inside larger matrices, so
 *  that several tensors sharing one scale quantize into one operand: q_stride >= cols, q_t_stride >= rows
 *  (cols and rows for standalone outputs). amax and scale are device pointers for the CUDA entry point. */
coat_status coat_quantize_tensor_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                     int64_t row_stride, const float* amax, coat_fp8_format format,
                                     uint8_t* q, int64_t q_stride, float* scale, uint8_t* q_t,
                                     int64_t q_t_stride);
coat_status coat_quantize_tensor_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols,
                                      int64_t row_stride, const float* amax, coat_fp8_format format,
                                      uint8_t* q, int64_t q_stride, float* scale, uint8_t* q_t,
                                      int64_t q_t_stride, coat_cuda_stream stream);

/** Dequantization: out[r*cols + c] = round_to(out_dtype, fp8_decode(q[r*cols + c]) * s) with
 *  s = scales[r*ceil(cols/G) + c/G] when group_size = G > 0, and s = scales[0] when group_size == 0
 *  (per-tensor). q and out are contiguous; out_dtype is COAT_FLOAT32 or COAT_BFLOAT16. */
coat_status coat_dequantize_cpu(const uint8_t* q, coat_fp8_format format, int64_t rows, int64_t cols,
                                const float* scales, int64_t group_size, void* out, coat_dtype out_dtype);
coat_status coat_dequantize_cuda(const uint8_t* q, coat_fp8_format format, int64_t rows, int64_t cols,
                                 const float* scales, int64_t group_size, void* out, coat_dtype out_dtype,
                                 coat_cuda_stream stream);

/*
 * Block-scaled FP4 (E2M1, coat/fp4.h) and FP6 (E2M3, coat/fp6.h), the storage formats of activations saved for
 * backward at about 4 and 6 bits. The two follow one set of rules and differ in the code width, the packing and
 * the largest magnitude, E_MAX = 6 (E2M1) or 7.5 (E2M3).
 *
 * Layout. The input is the row-major matrix of the FP8 quantizers above. Blocks are 1 x B runs along a
 * row, like the FP8 groups: block j of row r holds columns [j*B, min((j+1)*B, cols)), B is 16, 32, 64 or
 * 128, and a row has nblocks = ceil(cols / B) blocks, the last one possibly short. FP4 codes are packed two per
 * byte, element 2i of a row in the low nibble of byte i and element 2i+1 in the high nibble; each row takes
 * ceil(cols / 2) bytes, so with odd cols its last byte holds one code and a high nibble of 0. FP6 codes are
 * packed four per three bytes (coat/fp6.h); each row takes ceil(3 cols / 4) bytes. As B is a multiple of 4, the
 * codes of a byte (or of a three-byte word) always share a block. codes is rows x row_bytes bytes, scales rows x
 * nblocks fp32, both contiguous.
 *
 * Scales are fp32; quantization multiplies by the scale's fp32 reciprocal and rounds the exact product once:
 *     amax  = max |x| over the block
 *     scale = NaN                            if the block holds a NaN
 *             max(amax / E_MAX, 2^-126)      otherwise (Inf when the block holds +-Inf)
 *     code  = encode(x * r), r = 1 / scale   (r in fp32; x * r exact, rounded once to the grid:
 *                                            coat_quantize_e2m_scaled, the rules of coat_f32_to_e2m1 / _e2m3)
 *     x'    = decode(code) * scale           (fp32 product, then rounded to the output dtype)
 * All-zero and tiny blocks: the 2^-126 floor keeps them finite; they quantize to (signed) zeros, or to the
 * values nearest x * 2^126, and dequantize without NaN.
 * NaN: neither format has a NaN, so a NaN makes its whole block's scale NaN and every element of that block
 * dequantizes to NaN; a NaN is never silently lost (the FP8 rule keeps the rest of the group, these cannot).
 * Inf: the block's scale is Inf, as in the FP8 rule, and r = 0. Its finite elements encode +-0 (x * 0) and its
 * infinities +-0 too (Inf * 0 is NaN, which encodes to zero), so every element dequantizes to
 * 0 * Inf = NaN: the whole block reads NaN instead of silently clipping the overflow.
 * The code of a NaN product takes the sign of x, so that CPU and CUDA agree.
 *
 * Expansion to E4M3 for the FP8 backward kernels: every E2M1 and E2M3 value is exactly an E4M3 value, so
 *     q[r*cols + c] = e4m3_encode(decode(code[r, c])) = coat_e2m1_to_e4m3 / coat_e2m3_to_e4m3 (code[r, c])
 * with the block scales passed on unchanged makes the 1xG layout of coat_quantize_group with G = B, and
 * coat_dequantize of (q, scales) computes the same fp32 product decode(code) * scale as the dequantizers
 * below: equal bit for bit, NaN and Inf blocks included (their scale is the same NaN or Inf).
 */

/** codes and scales of x (`dtype` elements, rows x cols, rows row_stride elements apart), as above. */
coat_status coat_quantize_fp4_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  int64_t block_size, uint8_t* codes, float* scales);
coat_status coat_quantize_fp4_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   int64_t block_size, uint8_t* codes, float* scales, coat_cuda_stream stream);
coat_status coat_quantize_fp6_cpu(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                  int64_t block_size, uint8_t* codes, float* scales);
coat_status coat_quantize_fp6_cuda(const void* x, coat_dtype dtype, int64_t rows, int64_t cols, int64_t row_stride,
                                   int64_t block_size, uint8_t* codes, float* scales, coat_cuda_stream stream);

/** out[r*cols + c] = round_to(out_dtype, decode(code[r, c]) * scales[r*nblocks + c/B]); out is contiguous,
 *  out_dtype COAT_FLOAT32 or COAT_BFLOAT16. */
coat_status coat_dequantize_fp4_cpu(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                    int64_t block_size, void* out, coat_dtype out_dtype);
coat_status coat_dequantize_fp4_cuda(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                     int64_t block_size, void* out, coat_dtype out_dtype, coat_cuda_stream stream);
coat_status coat_dequantize_fp6_cpu(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                    int64_t block_size, void* out, coat_dtype out_dtype);
coat_status coat_dequantize_fp6_cuda(const uint8_t* codes, int64_t rows, int64_t cols, const float* scales,
                                     int64_t block_size, void* out, coat_dtype out_dtype, coat_cuda_stream stream);

/** q[r*cols + c] = the E4M3 code of code[r, c]'s value: the E4M3 codes that, with the unchanged block scales, are
 *  the 1xB group layout of the same values. q is rows x cols bytes. */
coat_status coat_fp4_to_e4m3_cpu(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q);
coat_status coat_fp4_to_e4m3_cuda(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q,
                                  coat_cuda_stream stream);
coat_status coat_fp6_to_e4m3_cpu(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q);
coat_status coat_fp6_to_e4m3_cuda(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* q,
                                  coat_cuda_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* COAT_QUANTIZE_H */
