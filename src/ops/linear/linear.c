/* Matrix products and RMSNorm (include/longmoe/linear.h). */
#include "longmoe/linear.h"

#include <math.h>
#include <stddef.h>

/* 8 floats in one vector register (GCC/Clang vector extension; plain SSE
 * pairs without AVX). The dot products below keep 8 partial sums per output
 * and add them in a fixed order: the same result for any thread count. */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* y[r][o] = x[r] . w[o] for R <= 4 rows and 2 outputs, length n. */
static inline void dot_block(float y[4][2], const float *x, int64_t xs, const float *w, int64_t ws, int R, int n) {
    v8f acc[4][2] = {{{0}}};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f w0 = load8(w + i), w1 = load8(w + ws + i);
        for (int r = 0; r < R; r++) {
            v8f xv = load8(x + r * xs + i);
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < R; r++) {
        float s0 = hsum8(acc[r][0]), s1 = hsum8(acc[r][1]);
        for (int j = i; j < n; j++) {
            s0 += x[r * xs + j] * w[j];
            s1 += x[r * xs + j] * w[ws + j];
        }
        y[r][0] = s0;
        y[r][1] = s1;
    }
}

void lm_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                       int64_t n, int ic, int oc) {
    // inp is (n,ic), weight is (oc,ic), bias is (oc), out is (n,oc)
    int64_t row_blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t rb = 0; rb < row_blocks; rb++) {
        int64_t r0 = rb * 4;
        int R = (int)(n - r0 < 4 ? n - r0 : 4);
        const float *x = inp + r0 * ic;
        float y[4][2];
        int o = 0;
        for (; o + 2 <= oc; o += 2) {
            dot_block(y, x, ic, weight + (size_t)o * ic, ic, R, ic);
            for (int r = 0; r < R; r++) {
                out[(r0 + r) * oc + o] = y[r][0] + (bias ? bias[o] : 0.0f);
                out[(r0 + r) * oc + o + 1] = y[r][1] + (bias ? bias[o + 1] : 0.0f);
            }
        }
        for (; o < oc; o++) {
            const float *w = weight + (size_t)o * ic;
            for (int r = 0; r < R; r++) {
                float s = 0.0f;
                for (int i = 0; i < ic; i++) s += x[r * ic + i] * w[i];
                out[(r0 + r) * oc + o] = s + (bias ? bias[o] : 0.0f);
            }
        }
    }
}

static inline void store8(float *p, v8f v) { __builtin_memcpy(p, &v, sizeof v); }

/* C[r][i..i+32) += sum over k of a[r][k] * B[k][i..i+32), for 4 rows r and k
 * ascending (a[r][k] = A[r * as + k * ak]; B rows at stride bs). The 16 vector
 * sums stay in registers across k: each B vector loaded once serves 4 rows.
 * Every element is updated in the same order as the one-row loop
 * c[i] += a * b[i] over k, so the result is the same bit for bit. */
static inline void axpy_block4x32(float *C, int64_t cs, const float *A, int64_t as, int64_t ak,
                                  const float *B, int64_t bs, int64_t nk) {
    v8f acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = load8(C + r * cs + 8 * v);
    for (int64_t k = 0; k < nk; k++) {
        const float *b = B + k * bs;
        v8f b0 = load8(b), b1 = load8(b + 8), b2 = load8(b + 16), b3 = load8(b + 24);
        for (int r = 0; r < 4; r++) {
            float a = A[r * as + k * ak];
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
            acc[r][2] += a * b2;
            acc[r][3] += a * b3;
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < 4; v++) store8(C + r * cs + 8 * v, acc[r][v]);
}

/* The same for one row and columns [i0, i1) (the remainders). */
static inline void axpy_row(float *c, const float *A, int64_t ak, const float *B, int64_t bs,
                            int64_t nk, int64_t i0, int64_t i1) {
    for (int64_t k = 0; k < nk; k++) {
        float a = A[k * ak];
        const float *b = B + k * bs;
        for (int64_t i = i0; i < i1; i++) c[i] += a * b[i];
    }
}

void lm_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, int64_t n, int ic, int oc) {
    // dout is (n,oc); dinp (n,ic) += dout . weight; dweight (oc,ic) += dout^T . inp.
    // Each element of dinp sums over o ascending, each of dweight over r ascending
    // (register blocks of 4 rows x 32 columns; the remainders one row at a time).
    const int64_t ic32 = (int64_t)ic / 32 * 32;
    if (dinp) {
        int64_t row_blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            int64_t r0 = rb * 4, R = n - r0 < 4 ? n - r0 : 4;
            const float *g = dout + r0 * oc;
            float *dx = dinp + r0 * ic;
            if (R == 4)
                for (int64_t i = 0; i < ic32; i += 32)
                    axpy_block4x32(dx + i, ic, g, oc, 1, weight + i, ic, oc);
            for (int64_t r = 0; r < R; r++)
                axpy_row(dx + r * ic, g + r * oc, 1, weight, ic, oc, R == 4 ? ic32 : 0, ic);
        }
    }
    if (dweight || dbias) {
        /* parallel over output rows: each thread owns whole rows of dweight */
        int64_t o_blocks = ((int64_t)oc + 3) / 4;
#pragma omp parallel for schedule(static)
        for (int64_t ob = 0; ob < o_blocks; ob++) {
            int64_t o0 = ob * 4, O = oc - o0 < 4 ? oc - o0 : 4;
            if (dbias)
                for (int64_t o = o0; o < o0 + O; o++) {
                    float db = 0.0f;
                    for (int64_t r = 0; r < n; r++) db += dout[r * oc + o];
                    dbias[o] += db;
                }
            if (!dweight) continue;
            float *dw = dweight + o0 * ic;
            if (O == 4)
                for (int64_t i = 0; i < ic32; i += 32)
                    axpy_block4x32(dw + i, ic, dout + o0, 1, oc, inp + i, ic, n);
            for (int64_t o = 0; o < O; o++)
                axpy_row(dw + o * ic, dout + o0 + o, oc, inp, ic, n, O == 4 ? ic32 : 0, ic);
        }
    }
}

void lm_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                        int64_t n, int d, float eps) {
    // inp, out are (n,d); weight (d); rstd (n)
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *x = inp + r * d;
        float *y = out + r * d;
        float ss = 0.0f;
        for (int i = 0; i < d; i++) ss += x[i] * x[i];
        float s = 1.0f / sqrtf(ss / (float)d + eps);
        if (rstd) rstd[r] = s;
        for (int i = 0; i < d; i++) y[i] = x[i] * s * (weight ? weight[i] : 1.0f);
    }
}

void lm_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                         const float *weight, const float *rstd, int64_t n, int d, float eps) {
    // y_i = x_i s w_i with s = (mean(x^2)+eps)^-1/2:
    // dx_i = s (w_i dy_i) - x_i s^3 / d * sum_j (w_j dy_j x_j);  dw_i = sum_r dy_i x_i s
    if (dinp) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const float *x = inp + r * d, *g = dout + r * d;
            float s;
            if (rstd) {
                s = rstd[r];
            } else {
                float ss = 0.0f;
                for (int i = 0; i < d; i++) ss += x[i] * x[i];
                s = 1.0f / sqrtf(ss / (float)d + eps);
            }
            float dot = 0.0f;
            for (int i = 0; i < d; i++) dot += g[i] * (weight ? weight[i] : 1.0f) * x[i];
            float c = dot * s * s * s / (float)d;
            float *dx = dinp + r * d;
            for (int i = 0; i < d; i++) dx[i] += s * g[i] * (weight ? weight[i] : 1.0f) - c * x[i];
        }
    }
    if (dweight) {
        for (int64_t r = 0; r < n; r++) {
            const float *x = inp + r * d, *g = dout + r * d;
            float s;
            if (rstd) {
                s = rstd[r];
            } else {
                float ss = 0.0f;
                for (int i = 0; i < d; i++) ss += x[i] * x[i];
                s = 1.0f / sqrtf(ss / (float)d + eps);
            }
            for (int i = 0; i < d; i++) dweight[i] += g[i] * x[i] * s;
        }
    }
}

void lm_score_row(const float *z, int V, int y, double *nll, int32_t *argmax) {
    float mx = z[0];
    int arg = 0;
    for (int v = 1; v < V; v++)
        if (z[v] > mx) {
            mx = z[v];
            arg = v;
        }
    /* cross-entropy by log-sum-exp around the maximum */
    double s = 0;
    for (int v = 0; v < V; v++) s += exp((double)z[v] - mx);
    *nll = (double)mx + log(s) - z[y];
    *argmax = arg;
}
