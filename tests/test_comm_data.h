/* Data of the communication tests (tests/test_comm.c on host engines,
 * tests/test_cuda_comm.c on the NCCL engine): values every rank can
 * regenerate for any rank, and the serial rank-order reference sum. */
#ifndef LONGMOE_TEST_COMM_DATA_H
#define LONGMOE_TEST_COMM_DATA_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "longmoe/core.h"

/* ---- data every rank can regenerate: rank p's values of trial `trial` ---- */

static inline uint64_t stream_seed(int p, int trial, int salt) {
    return lm_mix64(0x5eed5eedULL ^ ((uint64_t)p << 40) ^ ((uint64_t)trial << 20) ^ (uint64_t)salt);
}

/* Values of mixed magnitude (2^-12 .. 2^12 times a normal), so a sum's
 * rounding depends on the order of its terms. */
static inline void fill_f32(float *x, size_t n, int p, int trial) {
    lm_rng r;
    lm_rng_seed(&r, stream_seed(p, trial, 1));
    for (size_t i = 0; i < n; i++)
        x[i] = (float)ldexp(lm_rng_normal(&r) + 0.1, (int)(lm_rng_u64(&r) % 25) - 12);
}
static inline void fill_f64(double *x, size_t n, int p, int trial) {
    lm_rng r;
    lm_rng_seed(&r, stream_seed(p, trial, 2));
    for (size_t i = 0; i < n; i++) x[i] = ldexp(lm_rng_normal(&r) + 0.1, (int)(lm_rng_u64(&r) % 81) - 40);
}
static inline void fill_i32(int32_t *x, size_t n, int p, int trial) {
    lm_rng r;
    lm_rng_seed(&r, stream_seed(p, trial, 3));
    for (size_t i = 0; i < n; i++) x[i] = (int32_t)(uint32_t)lm_rng_u64(&r); /* sums wrap */
}
static inline void fill_bytes(unsigned char *x, size_t n, int p, int q, int trial) {
    lm_rng r;
    lm_rng_seed(&r, stream_seed(p * 4099 + q, trial, 4));
    for (size_t i = 0; i < n; i++) x[i] = (unsigned char)lm_rng_u64(&r);
}

/* rank p's data for a trial, in dtype */
static inline void fill(void *x, size_t n, lm_dtype dt, int p, int trial) {
    if (dt == LM_DTYPE_F32) fill_f32(x, n, p, trial);
    else if (dt == LM_DTYPE_F64) fill_f64(x, n, p, trial);
    else fill_i32(x, n, p, trial);
}

/* The serial reference over R ranks: acc = x_0; acc += x_1; ... in the
 * element type, for elements [offset_elems, offset_elems + n) of each rank's data. */
static inline void serial_sum(void *acc, size_t n, lm_dtype dt, int R, int trial, size_t offset_elems) {
    size_t es = lm_dtype_size(dt), total = offset_elems + n;
    unsigned char *x = malloc(total * es + 1);
    for (int p = 0; p < R; p++) {
        fill(x, total, dt, p, trial);
        for (size_t i = 0; i < n; i++) {
            size_t j = offset_elems + i;
            if (dt == LM_DTYPE_F32) {
                float *a = acc;
                a[i] = p ? a[i] + ((float *)x)[j] : ((float *)x)[j];
            } else if (dt == LM_DTYPE_F64) {
                double *a = acc;
                a[i] = p ? a[i] + ((double *)x)[j] : ((double *)x)[j];
            } else {
                uint32_t *a = acc;
                a[i] = p ? a[i] + ((uint32_t *)x)[j] : ((uint32_t *)x)[j];
            }
        }
    }
    free(x);
}

static const lm_dtype sum_types[3] = {LM_DTYPE_F32, LM_DTYPE_F64, LM_DTYPE_I32};
static const size_t sum_counts[6] = {1, 3, 64, 1000, 4097, 0};

/* Bytes rank p sends rank q in trial `trial`: random, a third of them zero. */
static inline size_t a2a_count(int p, int q, int trial) {
    uint64_t h = lm_mix64(stream_seed(p, trial, 7) ^ (uint64_t)q * 0x9E3779B97F4A7C15ULL);
    return h % 3 == 0 ? 0 : (size_t)(h >> 8) % 3000 + 1;
}

#endif
