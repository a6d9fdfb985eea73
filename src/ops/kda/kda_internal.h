/* Internals of the KDA operator (docs/kda.md; SPEC §2): the scalar gate, the
 * per-chunk workspace shared by the chunked forward and backward, and small
 * vector helpers whose inner loops run over a contiguous K or V axis. */
#ifndef LONGMOE_KDA_INTERNAL_H
#define LONGMOE_KDA_INTERNAL_H

#include <math.h>
#include <stddef.h>

#include "longmoe/kda.h"

/* The softplus gate is clamped below at this value. e^{-1e4} underflows to 0
 * in fp32, so every product that contains such a step is already exactly 0 and
 * the clamp changes no output; it keeps cumulative sums finite (docs/kda.md). */
#define KDA_SOFTPLUS_G_FLOOR (-1.0e4f)

/* Largest accepted dims (absurd sizes are rejected with a message). */
#define KDA_MAX_BH (1 << 20)
#define KDA_MAX_T (1 << 28)
#define KDA_MAX_KV 4096

/* Shape and parameter checks; need_chunk=0 skips the chunk size (recurrent). */
lm_status kda_check_config(const lm_kda_config *cfg, int need_chunk);
lm_status kda_check_inputs(const lm_kda_config *cfg, const lm_kda_inputs *in, int need_chunk);
float kda_scale(const lm_kda_config *cfg);

/* ---- the gate, per channel: u = z + dt_bias, eA = e^{A_log[h]} ---- */

/* expf without glibc's underflow slow path: e^x < 7e-46 (half the smallest
 * subnormal) for x < -104, so expf returns exactly 0 there too. */
static inline float kda_expf(float x) { return x < -104.0f ? 0.0f : expf(x); }

/* Stable logistic function split into s = sigmoid(x) and 1 - s, both accurate. */
static inline void kda_sigmoid2(float x, float *s, float *one_minus_s) {
    if (x >= 0.0f) {
        float e = kda_expf(-x); /* in [0, 1] */
        *s = 1.0f / (1.0f + e);
        *one_minus_s = e / (1.0f + e);
    } else {
        float e = kda_expf(x);
        *s = e / (1.0f + e);
        *one_minus_s = 1.0f / (1.0f + e);
    }
}

/* eA * u with 0 * inf defined as 0 (extreme A_log with u = 0). */
static inline float kda_gate_arg(float eA, float u) {
    return (u == 0.0f || eA == 0.0f) ? 0.0f : eA * u;
}

/* softplus(u) = log(1 + e^u), without overflow for large |u|. */
static inline float kda_softplus(float u) {
    return u > 0.0f ? u + log1pf(kda_expf(-u)) : log1pf(kda_expf(u));
}

/* g for one channel. Bounded: g_min * sigmoid(eA * u), in [g_min, 0] (0 only
 * when the sigmoid underflows, eA*u < about -104). Softplus: -eA * softplus(u),
 * clamped below at KDA_SOFTPLUS_G_FLOOR. */
static inline float kda_gate_value(lm_kda_gate gate, float g_min, float eA, float u) {
    if (gate == LM_KDA_GATE_BOUNDED) {
        float s, oms;
        kda_sigmoid2(kda_gate_arg(eA, u), &s, &oms);
        return g_min * s;
    }
    float sp = kda_softplus(u);
    float g = sp == 0.0f ? 0.0f : -(eA * sp);
    return g < KDA_SOFTPLUS_G_FLOOR ? KDA_SOFTPLUS_G_FLOOR : g;
}

/* dg/du and dg/dA_log for one channel (0 where the function is flat in fp32). */
static inline void kda_gate_grad(lm_kda_gate gate, float g_min, float eA, float u, float *dg_du,
                                 float *dg_dA) {
    if (gate == LM_KDA_GATE_BOUNDED) {
        float x = kda_gate_arg(eA, u), s, oms;
        kda_sigmoid2(x, &s, &oms);
        float ds = s * oms; /* sigmoid'(x) */
        if (ds == 0.0f) {
            *dg_du = 0.0f;
            *dg_dA = 0.0f;
        } else {
            *dg_du = g_min * ds * eA;
            *dg_dA = g_min * ds * x;
        }
        return;
    }
    float sp = kda_softplus(u);
    float g = sp == 0.0f ? 0.0f : -(eA * sp);
    if (g < KDA_SOFTPLUS_G_FLOOR || sp == 0.0f) {
        *dg_du = 0.0f;
        *dg_dA = 0.0f;
        return;
    }
    float s, oms;
    kda_sigmoid2(u, &s, &oms);
    *dg_du = s == 0.0f ? 0.0f : -(eA * s);
    *dg_dA = g;
}

/* ---- vector helpers (contiguous, vectorisable, fixed summation order) ---- */

static inline float kda_dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += a * x */
static inline void kda_axpy(float *restrict y, float a, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* y += alpha * sum_{r < m} a[r * astride] * X[r * ldx + 0 .. n): a chain of
 * axpys that reads and writes y once per four rows. The grouping depends only
 * on m, never on the data, so results stay deterministic and causal. */
static inline void kda_axpy_rows(float *restrict y, float alpha, const float *a, size_t astride,
                                 const float *restrict X, size_t ldx, int m, int n) {
    int r = 0;
    for (; r + 4 <= m; r += 4) {
        const float a0 = alpha * a[(size_t)r * astride], a1 = alpha * a[(size_t)(r + 1) * astride];
        const float a2 = alpha * a[(size_t)(r + 2) * astride], a3 = alpha * a[(size_t)(r + 3) * astride];
        const float *x0 = X + (size_t)r * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
#pragma omp simd
        for (int i = 0; i < n; i++) y[i] += (a0 * x0[i] + a1 * x1[i]) + (a2 * x2[i] + a3 * x3[i]);
    }
    for (; r < m; r++) kda_axpy(y, alpha * a[(size_t)r * astride], X + (size_t)r * ldx, n);
}

/* ---- per-chunk workspace (one per thread) ----
 * Rows are chunk positions i < L <= C; K-rows and V-rows are contiguous. */
typedef struct {
    int C, K, V;
    float *q, *k, *u;    /* [C][K] inputs; u = z + dt_bias (for the gate backward) */
    float *v;            /* [C][V] */
    float *beta;         /* [C] */
    float *G, *eG;       /* [C][K] inclusive cumsum of g within the chunk, e^{G} */
    float *Er;           /* [C][K] e^{G_i - G_n}, n = first row of i's sub-chunk */
    float *Kr, *Qr;      /* [C][K] k_i, q_i times Er (row operands, exponents <= 0) */
    float *Kc, *Ec;      /* [C][K] column operand k_j e^{G_n - G_j} for the current row block */
    float *Kd;           /* [C][K] k_i e^{G_L - G_i} (state update) */
    float *Bkk, *Akk;    /* [C][C] strictly lower: sum_d k_i k_j e^{G_i-G_j}; Akk = beta_i Bkk */
    float *Aqk;          /* [C][C] lower incl. diagonal: sum_d q_i k_j e^{G_i-G_j} */
    float *W;            /* [C][K] M (K o e^G) */
    float *U, *Vp;       /* [C][V] M V and V' = U - W S */
    float *S;            /* [K][V] state entering the chunk */
    float *tmp;          /* [max(C,K)] row of coefficients */
    /* backward only */
    float *dO, *dVp, *Ru, *dv;          /* [C][V] */
    float *dq, *dk, *dG, *Rw, *dKc;     /* [C][K] */
    float *dB, *dAqk;                   /* [C][C] */
    float *dbeta;                       /* [C] */
    float *dS, *dSn;                    /* [K][V] */
    float *ST, *dST;                    /* [V][K] transposes of S and dS */
    float *gtmp, *dKr, *dQr;            /* [K] */
} kda_chunk_ws;

/* Floats the backward keeps per chunk from its forward pass: Bkk, Aqk [C][C],
 * W [C][K], U and V' [C][V] (the state entering the chunk comes on top). */
static inline size_t kda_chunk_cache_floats(int C, int K, int V) {
    return 2 * (size_t)C * C + (size_t)C * K + 2 * (size_t)C * V;
}

/* Floats needed by one thread's workspace. */
size_t kda_ws_floats(int C, int K, int V, int backward);
/* Point the workspace's arrays into base (kda_ws_floats(...) floats). */
void kda_ws_carve(kda_chunk_ws *w, float *base, int C, int K, int V, int backward);

/* Load rows t0 .. t0+L-1 of the pair (b, h): q, k, v, beta, u, and G. */
void kda_chunk_load(const lm_kda_config *cfg, const lm_kda_inputs *in, int b, int h, int t0,
                    int L, float eA, kda_chunk_ws *w);
/* The exponent operands of a loaded chunk: eG, Kd and the anchored row operands Er, Kr, Qr. */
void kda_chunk_operands(kda_chunk_ws *w, int L);
/* Operands, intra-chunk scores and the WY/UT transform: also Bkk, Akk, Aqk, W, U. */
void kda_chunk_prepare(kda_chunk_ws *w, int L, int factored);
/* V' = U - W S; if o != NULL: o rows (stride ostride) = scale (Qg S + Aqk V');
 * then, if update_state, S <- Diag(e^{G_L}) S + Kd^T V'. */
void kda_chunk_apply(kda_chunk_ws *w, int L, float scale, float *o, size_t ostride,
                     int update_state);
/* The column operand of row block a0: Ec_j = e^{G_n - G_j}, Kc_j = k_j Ec_j for j < jend. */
void kda_chunk_columns(kda_chunk_ws *w, int a0, int jend);

#endif
