/* Helpers shared by the benches (bench/bench_*.c): sorting and medians of
 * timings, a fast xorshift generator for large random inputs, and (with
 * CUDA) device arrays of random values. */
#ifndef LONGMOE_BENCH_COMMON_H
#define LONGMOE_BENCH_COMMON_H

#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "longmoe/core.h"

/* qsort comparators, ascending */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline int bench_cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* median of n values (sorts t; even n: the mean of the two middle ones) */
static inline double bench_median(double *t, int n) {
    qsort(t, (size_t)n, sizeof(double), bench_cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static inline float bench_median_f(float *t, int n) {
    qsort(t, (size_t)n, sizeof(float), bench_cmp_float);
    return n % 2 ? t[n / 2] : 0.5f * (t[n / 2 - 1] + t[n / 2]);
}

/* xorshift64: cheap random inputs for large benchmark tensors (not lm_rng:
 * only speed is measured on them) */
typedef struct {
    uint64_t state;
} bench_xorshift;

static inline uint32_t bench_next_u32(bench_xorshift *r) {
    r->state ^= r->state << 13;
    r->state ^= r->state >> 7;
    r->state ^= r->state << 17;
    return (uint32_t)(r->state >> 16);
}

/* uniform in [-a, a) */
static inline float bench_uniform(bench_xorshift *r, float a) {
    return a * ((float)(bench_next_u32(r) & 0xffffff) / 8388608.f - 1.f);
}

#ifdef LONGMOE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"

/* a new device array (cudaMalloc) of n bf16 values uniform in [-a, a) */
static inline uint16_t *bench_device_bf16_random(bench_xorshift *r, size_t n, float a) {
    uint16_t *h = mallocCheck(n * 2), *d = NULL;
    for (size_t i = 0; i < n; i++) h[i] = lm_f32_to_bf16(bench_uniform(r, a));
    cudaCheck(cudaMalloc((void **)&d, n * 2));
    cudaCheck(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    free(h);
    return d;
}
#endif

#endif
