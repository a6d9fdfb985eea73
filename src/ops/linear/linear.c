/* Matrix products and RMSNorm (include/longmoe/linear.h). */
#include "longmoe/linear.h"

#include <math.h>
#include <stddef.h>

void lm_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                       int64_t n, int ic, int oc) {
    // inp is (n,ic), weight is (oc,ic), bias is (oc), out is (n,oc)
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const float *x = inp + r * ic;
        float *y = out + r * oc;
        for (int o = 0; o < oc; o++) {
            const float *w = weight + (size_t)o * ic;
            float s = bias ? bias[o] : 0.0f;
            for (int i = 0; i < ic; i++) s += x[i] * w[i];
            y[o] = s;
        }
    }
}

void lm_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, int64_t n, int ic, int oc) {
    // dout is (n,oc); dinp (n,ic) += dout . weight; dweight (oc,ic) += dout^T . inp
    if (dinp) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const float *g = dout + r * oc;
            float *dx = dinp + r * ic;
            for (int o = 0; o < oc; o++) {
                const float *w = weight + (size_t)o * ic;
                float go = g[o];
                for (int i = 0; i < ic; i++) dx[i] += go * w[i];
            }
        }
    }
    if (dweight || dbias) {
        /* parallel over output rows: each thread owns whole rows of dweight */
#pragma omp parallel for schedule(static)
        for (int o = 0; o < oc; o++) {
            float *dw = dweight ? dweight + (size_t)o * ic : NULL;
            float db = 0.0f;
            for (int64_t r = 0; r < n; r++) {
                float go = dout[r * oc + o];
                db += go;
                if (dw) {
                    const float *x = inp + r * ic;
                    for (int i = 0; i < ic; i++) dw[i] += go * x[i];
                }
            }
            if (dbias) dbias[o] += db;
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
