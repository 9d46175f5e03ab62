/*
 * coat core: types shared by every family of entry points.
 *
 * The core is plain C99 (CPU) and CUDA C (GPU). It never includes torch headers and never reads the
 * environment. Every entry point returns a coat_status; CUDA entry points take the stream to launch on.
 */
#ifndef COAT_COMMON_H
#define COAT_COMMON_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Result of a core call. Arguments are validated by the caller (the bindings); the core re-checks the
 *  cheap invariants and answers COAT_ERROR_INVALID_ARGUMENT rather than reading out of bounds. */
typedef enum {
  COAT_SUCCESS = 0,
  COAT_ERROR_INVALID_ARGUMENT = 1,
  /** A CUDA launch failed; cudaGetLastError() still holds the CUDA error for the caller to report. */
  COAT_ERROR_CUDA = 2,
} coat_status;

/** Element type of a high-precision tensor (input of a quantizer, output of a dequantizer). */
typedef enum {
  COAT_FLOAT32 = 0,
  COAT_BFLOAT16 = 1,
  COAT_FLOAT16 = 2,
} coat_dtype;

/** FP8 encodings (OCP 8-bit floating point, 2023). E4M3 is the "fn" variant: no infinities, one NaN
 *  pattern per sign (S.1111.111), finite max 448. E5M2 has infinities, finite max 57344. */
typedef enum {
  COAT_E4M3 = 0,
  COAT_E5M2 = 1,
} coat_fp8_format;

/** cudaStream_t without including the CUDA headers, so CPU-only builds can include this file. */
typedef struct CUstream_st* coat_cuda_stream;

/** A static string naming the status, for error messages. */
const char* coat_status_string(coat_status status);

#ifdef __cplusplus
}
#endif

#endif /* COAT_COMMON_H */
