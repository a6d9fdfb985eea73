/* Helpers shared by the GPU test programs (tests/test_cuda_*.c): bf16
 * rounding, random inputs, relative errors, and device buffers filled from
 * and read back to the host. Include after test.h. The device helpers stop the
 * program (dieAt) when the runtime refuses: no case can run after that.
 * lm_cuda_upload / lm_cuda_download synchronise the device, so a kernel on
 * the context's stream always sees what was uploaded and a download sees what
 * the kernels wrote. */
#ifndef LONGMOE_TEST_CUDA_H
#define LONGMOE_TEST_CUDA_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "longmoe/core.h"
#include "longmoe/cuda_context.h"

/* x rounded to the nearest bf16 (ties to even), as a float */
static inline float bf16_round(float x) { return lm_bf16_to_f32(lm_f32_to_bf16(x)); }

/* x[i] = shift + scale * N(0, 1), rounded to bf16 when round_bf16 */
static inline void fill_normal(float *x, size_t n, lm_rng *r, double scale, double shift, int round_bf16) {
    for (size_t i = 0; i < n; i++) {
        float v = (float)(shift + scale * lm_rng_normal(r));
        x[i] = round_bf16 ? bf16_round(v) : v;
    }
}

/* a new host array of n values drawn as fill_normal does */
static inline float *host_normal(size_t n, double scale, double shift, int round_bf16, lm_rng *r) {
    float *a = mallocCheck((n ? n : 1) * sizeof(float));
    fill_normal(a, n, r, scale, shift, round_bf16);
    return a;
}

/* ||a - b|| / ||b||; infinite when a has a NaN or an infinity. */
static inline double rel_err(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ||(got - base) - (want - base)|| / ||want - base|| (base NULL: 0): the error
 * of an accumulated result relative to what was added; infinite on a NaN. */
static inline double rel_err_increment(const float *got, const float *want, const float *base, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double b = base ? base[i] : 0.0, g = (double)got[i] - b, w = (double)want[i] - b;
        if (isnan(got[i])) return INFINITY;
        num += (g - w) * (g - w);
        den += w * w;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* a zeroed device buffer (16 bytes when bytes is 0) */
static inline void *dev_alloc(size_t bytes) {
    void *p = NULL;
    if (lm_cuda_alloc(&p, bytes)) dieAt("device allocation of %zu bytes: %s", bytes, lm_last_error());
    return p;
}

/* a new device array holding the n floats of h */
static inline float *dev_upload_f32(const float *h, size_t n) {
    float *d = (float *)dev_alloc(n * sizeof(float));
    if (lm_cuda_upload(d, h, n * sizeof(float))) dieAt("upload: %s", lm_last_error());
    return d;
}

/* a new device array holding the n floats of h rounded to bf16 */
static inline uint16_t *dev_upload_bf16(const float *h, size_t n) {
    uint16_t *d = (uint16_t *)dev_alloc(n * sizeof(uint16_t));
    if (lm_cuda_upload_bf16(d, h, n)) dieAt("upload bf16: %s", lm_last_error());
    return d;
}

/* a new host array holding the n floats of the device array d */
static inline float *host_download_f32(const void *d, size_t n) {
    float *h = mallocCheck((n ? n : 1) * sizeof(float));
    if (lm_cuda_download(h, d, n * sizeof(float))) dieAt("download: %s", lm_last_error());
    return h;
}

/* A column block [c0, c0 + cols) of a [rows, ld] bf16 operand that a strided call wrote (host copies,
 * bit patterns): *bad counts the block's values that differ from `dense` ([rows, cols]), *touched the
 * values outside the block that differ from `before` ([rows, ld]). */
static inline void block_diffs(const uint16_t *wide, const uint16_t *before, const uint16_t *dense, size_t rows,
                               size_t ld, size_t c0, size_t cols, size_t *bad, size_t *touched) {
    *bad = *touched = 0;
    for (size_t t = 0; t < rows; t++)
        for (size_t j = 0; j < ld; j++) {
            if (j >= c0 && j < c0 + cols) *bad += wide[t * ld + j] != dense[t * cols + j - c0];
            else *touched += wide[t * ld + j] != before[t * ld + j];
        }
}

/* a new host array holding the n bf16 values of the device array d, widened to float */
static inline float *host_download_bf16(const uint16_t *d, size_t n) {
    float *h = mallocCheck((n ? n : 1) * sizeof(float));
    if (lm_cuda_download_bf16(h, d, n)) dieAt("download bf16: %s", lm_last_error());
    return h;
}

#endif
