/* The KDA layer's short convolution and SiLU + L2 normalisation
 * (include/longmoe/linear.h), fp32, OpenMP. */
#include <math.h>
#include <stddef.h>

#include "longmoe/linear.h"

#define L2_EPS 1e-6f

/* Causal depthwise convolution: out[t,c] = sum_i w[c,i] in[t-(W-1)+i, c]. */
void lm_short_conv_forward(float *out, const float *in, const float *w, int B, int T, int C, int W) {
    // in, out are (B,T,C); w is (C,W)
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            for (int ch = 0; ch < C; ch++) o[ch] = 0.0f;
            for (int i = 0; i < W; i++) {
                int src = t - (W - 1) + i;
                if (src < 0) continue;
                const float *x = in + ((size_t)b * T + src) * C;
                for (int ch = 0; ch < C; ch++) o[ch] += w[(size_t)ch * W + i] * x[ch];
            }
        }
}

/* din[t,c] = sum_i w[c,i] dout[t+(W-1)-i, c] (written, not accumulated);
 * dw[c,i] += sum_t in[t-(W-1)+i, c] dout[t,c]. */
void lm_short_conv_backward(float *din, float *dw, const float *dout, const float *in,
                                const float *w, int B, int T, int C, int W) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *dx = din + ((size_t)b * T + t) * C;
            for (int ch = 0; ch < C; ch++) dx[ch] = 0.0f;
            for (int i = 0; i < W; i++) {
                int dst = t + (W - 1) - i;
                if (dst >= T) continue;
                const float *g = dout + ((size_t)b * T + dst) * C;
                for (int ch = 0; ch < C; ch++) dx[ch] += w[(size_t)ch * W + i] * g[ch];
            }
        }
    /* each thread owns whole channels: a fixed summation order */
#pragma omp parallel for schedule(static)
    for (int ch = 0; ch < C; ch++)
        for (int i = 0; i < W; i++) {
            float s = 0.0f;
            for (int b = 0; b < B; b++)
                for (int t = W - 1 - i; t < T; t++)
                    s += in[((size_t)b * T + t - (W - 1) + i) * C + ch] * dout[((size_t)b * T + t) * C + ch];
            dw[(size_t)ch * W + i] += s;
        }
}

/* SiLU then (optionally) L2 normalisation per head of K channels. */
void lm_silu_l2_forward(float *out, float *rnorm, const float *in, size_t rows, int K) {
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++) {
        const float *x = in + r * K;
        float *y = out + r * K, ss = 0.0f;
        for (int d = 0; d < K; d++) {
            y[d] = lm_siluf(x[d]);
            ss += y[d] * y[d];
        }
        if (rnorm) {
            float s = 1.0f / sqrtf(ss + L2_EPS);
            rnorm[r] = s;
            for (int d = 0; d < K; d++) y[d] *= s;
        }
    }
}

/* Backward of silu_l2_forward: din = dSiLU(in) * (L2 backward of dout). */
void lm_silu_l2_backward(float *din, const float *dout, const float *in, const float *out,
                             const float *rnorm, size_t rows, int K) {
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++) {
        const float *x = in + r * K, *g = dout + r * K, *y = out + r * K;
        float *dx = din + r * K;
        float dot = 0.0f, s = rnorm ? rnorm[r] : 1.0f;
        if (rnorm)
            for (int d = 0; d < K; d++) dot += y[d] * g[d];
        for (int d = 0; d < K; d++) {
            /* y = u s with u = silu(x): du = s (g - y (y.g)) */
            float du = rnorm ? s * (g[d] - y[d] * dot) : g[d];
            float sg = lm_sigmoidf(x[d]);
            dx[d] = du * sg * (1.0f + x[d] * (1.0f - sg));
        }
    }
}

