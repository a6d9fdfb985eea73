/* Helpers shared by the benches (bench/bench_*.c): sorting and medians of
 * timings, a fast xorshift generator for large random inputs, and (with
 * CUDA) device arrays of random values. */
#ifndef LONGMOE_BENCH_COMMON_H
#define LONGMOE_BENCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
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

/* Median milliseconds of `reps` calls of fn(arg) on stream s, after 3
 * warm-ups (CUDA events around each call; a failing call ends the program). */
typedef lm_status (*bench_fn)(void *arg);

static inline float bench_time_ms(cudaStream_t s, bench_fn fn, void *arg, int reps) {
    cudaEvent_t a, b;
    cudaCheck(cudaEventCreate(&a));
    cudaCheck(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++)
        if (fn(arg)) dieAt("%s", lm_last_error());
    float *ms = mallocCheck((size_t)(reps > 0 ? reps : 1) * sizeof(float));
    for (int r = 0; r < reps; r++) {
        cudaCheck(cudaEventRecord(a, s));
        if (fn(arg)) dieAt("%s", lm_last_error());
        cudaCheck(cudaEventRecord(b, s));
        cudaCheck(cudaEventSynchronize(b));
        cudaCheck(cudaEventElapsedTime(&ms[r], a, b));
    }
    float med = bench_median_f(ms, reps);
    free(ms);
    cudaCheck(cudaEventDestroy(a));
    cudaCheck(cudaEventDestroy(b));
    return med;
}

/* Bandwidth of a memory-bound kernel against the copy engine's reference:
 * `bytes` is the least traffic the kernel can have (every input read once,
 * every output written once), gbs = bytes / time, copy_gbs the bandwidth
 * (2 x size: read + write) of cudaMemcpyAsync device to device of bytes / 2
 * (at most 1 GiB: the copy's speed is flat beyond) timed in the same run
 * (median of reps after 3 warm-ups), pct = 100 gbs / copy_gbs. */
typedef struct {
    const char *name;
    double bytes, ms, gbs, copy_gbs, pct;
} bench_bw;

static inline double bench_copy_gbs(double bytes, int reps, cudaStream_t s) {
    size_t half = (size_t)(bytes / 2);
    half = (half + 255) & ~(size_t)255;
    if (half < 256) half = 256;
    if (half > ((size_t)1 << 30)) half = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    cudaCheck(cudaMalloc(&a, half));
    cudaCheck(cudaMalloc(&b, half));
    cudaCheck(cudaMemset(a, 1, half));
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) cudaCheck(cudaMemcpyAsync(b, a, half, cudaMemcpyDeviceToDevice, s));
    float *ms = mallocCheck((size_t)(reps > 0 ? reps : 1) * sizeof(float));
    for (int r = 0; r < reps; r++) {
        cudaCheck(cudaEventRecord(e0, s));
        cudaCheck(cudaMemcpyAsync(b, a, half, cudaMemcpyDeviceToDevice, s));
        cudaCheck(cudaEventRecord(e1, s));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    float med = bench_median_f(ms, reps);
    free(ms);
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    return 2.0 * (double)half / ((double)med * 1e6);
}

static inline bench_bw bench_bw_measure(const char *name, double bytes, double ms, int reps, cudaStream_t s) {
    bench_bw b;
    b.name = name;
    b.bytes = bytes;
    b.ms = ms;
    b.gbs = bytes / (ms * 1e6);
    b.copy_gbs = bench_copy_gbs(bytes, reps, s);
    b.pct = 100.0 * b.gbs / b.copy_gbs;
    return b;
}

static inline void bench_bw_header(void) {
    printf("%-34s %10s %10s %10s %10s %8s\n", "memory-bound kernel", "MB moved", "ms", "GB/s", "copy GB/s",
           "% copy");
}

static inline void bench_bw_print(const bench_bw *b) {
    printf("%-34s %10.1f %10.4f %10.1f %10.1f %7.1f%%\n", b->name, b->bytes / 1e6, b->ms, b->gbs, b->copy_gbs,
           b->pct);
}

/* one JSON object (no trailing separator) */
static inline void bench_bw_json(FILE *js, const bench_bw *b) {
    fprintf(js, "{\"name\": \"%s\", \"bytes\": %.0f, \"ms\": %.5f, \"gbs\": %.1f, \"copy_gbs\": %.1f, "
                "\"pct_of_copy\": %.1f}",
            b->name, b->bytes, b->ms, b->gbs, b->copy_gbs, b->pct);
}
#endif

#endif
