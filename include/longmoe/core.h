/* longmoe core: status codes, error messages, dtypes, random numbers, timing.
 *
 * Every library function that can fail returns an lm_status. On failure it
 * records a one-line message (what was wrong, with the offending value) that
 * lm_last_error() returns; the CLI prints it and exits non-zero. The message
 * buffer is per thread, like errno. */
#ifndef LONGMOE_CORE_H
#define LONGMOE_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    LM_OK = 0,
    LM_ERR_ARG = 1,     /* bad argument: shape, dim, flag, value out of range */
    LM_ERR_IO = 2,      /* file could not be opened, read or written */
    LM_ERR_FORMAT = 3,  /* a file's content is malformed */
    LM_ERR_NUMERIC = 4, /* a non-finite value where a finite one is required */
    LM_ERR_MEMORY = 5   /* allocation failed */
} lm_status;

/* Record an error message (printf format) and return `code`. */
lm_status lm_error(lm_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
const char *lm_last_error(void);
void lm_clear_error(void);

/* ---- element types (names as in the safetensors format) ---- */
typedef enum {
    LM_DTYPE_F32 = 0,
    LM_DTYPE_BF16,
    LM_DTYPE_F16,
    LM_DTYPE_F64,
    LM_DTYPE_I32,
    LM_DTYPE_I64,
    LM_DTYPE_U8,
    LM_DTYPE_COUNT
} lm_dtype;

const char *lm_dtype_name(lm_dtype t);             /* "F32", "BF16", ... */
int lm_dtype_from_name(const char *name, lm_dtype *out); /* 0 on success */
size_t lm_dtype_size(lm_dtype t);

float lm_bf16_to_f32(uint16_t h);
uint16_t lm_f32_to_bf16(float f);   /* round to nearest even; NaN stays NaN */
float lm_f16_to_f32(uint16_t h);
uint16_t lm_f32_to_f16(float f);    /* round to nearest even, overflow to inf */

/* ---- deterministic random numbers (xoshiro256**, seeded by splitmix64) ---- */
typedef struct { uint64_t s[4]; } lm_rng;
void lm_rng_seed(lm_rng *r, uint64_t seed);
uint64_t lm_rng_u64(lm_rng *r);
double lm_rng_uniform(lm_rng *r);          /* [0, 1) */
double lm_rng_normal(lm_rng *r);           /* standard normal (Box-Muller) */
/* The normal that lm_rng_normal makes of its two draws a, b (lm_rng_u64, in that order):
 * lm_rng_normal(r) == lm_rng_normal_of(lm_rng_u64(r), lm_rng_u64(r)) bit for bit, so a
 * caller may draw the stream first and transform it in parallel. */
double lm_rng_normal_of(uint64_t a, uint64_t b);
uint64_t lm_mix64(uint64_t x);             /* a bijective 64-bit mixer (murmur3 finaliser) */

/* ---- wall clock in seconds (monotonic) ---- */
double lm_time_seconds(void);
/* How the C code of this build targets the processor: "native (-march=native)"
 * (CMake -DLONGMOE_NATIVE=ON; may not run on another machine) or "portable". */
const char *lm_build_cpu_target(void);

#ifdef __cplusplus
}
#endif
#endif
