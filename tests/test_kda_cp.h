/* Shared by the KDA context-parallel tests: random KDA inputs and the slicing
 * of a sequence into segments (tests/test_kda_state_map.c, tests/test_comm_kda.c). */
#ifndef LONGMOE_TEST_KDA_CP_H
#define LONGMOE_TEST_KDA_CP_H

#include "longmoe/kda.h"
#include "test.h"

typedef struct {
    int B, T, H, K, V;
    float *q, *k, *v, *z, *beta, *A_log, *dt_bias, *h0;
} cp_problem;

static void cp_fill_normal(lm_rng *r, float *x, size_t n, double s) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(s * lm_rng_normal(r));
}

/* Random inputs: unit-norm keys, slow gates, small betas, beta in (0, 1), a random initial state. */
static void cp_problem_make(cp_problem *p, int B, int T, int H, int K, int V, uint64_t seed) {
    p->B = B, p->T = T, p->H = H, p->K = K, p->V = V;
    size_t nk = (size_t)B * T * H * K, nv = (size_t)B * T * H * V, nb = (size_t)B * T * H;
    lm_rng r;
    lm_rng_seed(&r, seed);
    p->q = malloc(nk * 4), p->k = malloc(nk * 4), p->z = malloc(nk * 4), p->v = malloc(nv * 4);
    p->beta = malloc(nb * 4), p->A_log = malloc((size_t)H * 4), p->dt_bias = malloc((size_t)H * K * 4);
    p->h0 = malloc((size_t)B * H * K * V * 4);
    cp_fill_normal(&r, p->q, nk, 1.0);
    cp_fill_normal(&r, p->k, nk, 1.0);
    for (size_t i = 0; i < nk / K; i++) {
        double s = 0;
        for (int d = 0; d < K; d++) s += (double)p->k[i * K + d] * p->k[i * K + d];
        for (int d = 0; d < K; d++) p->k[i * K + d] = (float)(p->k[i * K + d] / sqrt(s + 1e-12));
    }
    /* gate inputs around -8 and small betas: most channels decay slowly and
     * the delta rule erases little, so the initial state carries across
     * segments; the spread adds fast channels */
    cp_fill_normal(&r, p->z, nk, 2.0);
    for (size_t i = 0; i < nk; i++) p->z[i] -= 8.0f;
    cp_fill_normal(&r, p->v, nv, 1.0);
    for (size_t i = 0; i < nb; i++) p->beta[i] = (float)(1.0 / (1.0 + exp(2.0 - lm_rng_normal(&r))));
    cp_fill_normal(&r, p->A_log, (size_t)H, 0.3);
    cp_fill_normal(&r, p->dt_bias, (size_t)H * K, 0.5);
    cp_fill_normal(&r, p->h0, (size_t)B * H * K * V, 0.5);
}

static void cp_problem_free(cp_problem *p) {
    free(p->q), free(p->k), free(p->z), free(p->v), free(p->beta), free(p->A_log), free(p->dt_bias), free(p->h0);
}

/* rows [t0, t1) of x [B,T,H,X] into a new [B,t1-t0,H,X] */
static float *cp_slice(const float *x, int B, int T, int H, int X, int t0, int t1) {
    size_t row = (size_t)H * X, n = (size_t)(t1 - t0);
    float *y = malloc((size_t)B * n * row * 4 + 4);
    for (int b = 0; b < B; b++)
        memcpy(y + (size_t)b * n * row, x + ((size_t)b * T + t0) * row, n * row * 4);
    return y;
}

/* The segment [t0, t1) of p as inputs (h0 NULL); free with cp_segment_free. */
static lm_kda_inputs cp_segment(const cp_problem *p, int t0, int t1) {
    lm_kda_inputs in = {0};
    in.q = cp_slice(p->q, p->B, p->T, p->H, p->K, t0, t1);
    in.k = cp_slice(p->k, p->B, p->T, p->H, p->K, t0, t1);
    in.z = cp_slice(p->z, p->B, p->T, p->H, p->K, t0, t1);
    in.v = cp_slice(p->v, p->B, p->T, p->H, p->V, t0, t1);
    in.beta = cp_slice(p->beta, p->B, p->T, p->H, 1, t0, t1);
    in.A_log = p->A_log;
    in.dt_bias = p->dt_bias;
    return in;
}

static void cp_segment_free(lm_kda_inputs *in) {
    free((void *)in->q), free((void *)in->k), free((void *)in->z), free((void *)in->v), free((void *)in->beta);
}

/* max |a - b| / (1 + max |b|) */
static double cp_max_rel(const float *a, const float *b, size_t n) {
    double m = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (isnan(a[i])) return INFINITY;
        if (d > m) m = d;
        if (fabs(b[i]) > s) s = fabs(b[i]);
    }
    return m / (1 + s);
}

#endif
