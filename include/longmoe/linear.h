/* Dense building blocks shared by the layers: matrix products, RMSNorm,
 * activations. fp32, row-major, OpenMP over rows. Backward functions
 * ACCUMULATE (+=) into every gradient they write (llm.c style); any gradient
 * pointer may be NULL to skip it. */
#ifndef LONGMOE_LINEAR_H
#define LONGMOE_LINEAR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out[n,oc] = inp[n,ic] . weight[oc,ic]^T (+ bias[oc] if bias != NULL).
 * Weight layout is [out, in] like a PyTorch Linear. */
void lm_matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                       int64_t n, int ic, int oc);
/* dinp[n,ic] += dout . weight;  dweight[oc,ic] += dout^T . inp;  dbias[oc] += sum dout. */
void lm_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, int64_t n, int ic, int oc);

/* out[n,d] = x / rms(x) * weight (weight may be NULL: no scale);
 * rstd[n] (may be NULL) receives 1/rms for the backward. rms = sqrt(mean(x^2) + eps). */
void lm_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight,
                        int64_t n, int d, float eps);
/* dinp += ..., dweight += ...; rstd from the forward (recomputed if NULL). */
void lm_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
                         const float *weight, const float *rstd, int64_t n, int d, float eps);

/* The KDA layer's causal depthwise convolution (src/ops/linear/short_conv.c):
 * out[t,c] = sum_i w[c,i] in[t-(W-1)+i, c], zero history at each sequence
 * start; in, out [B,T,C], w [C,W]. */
void lm_short_conv_forward(float *out, const float *in, const float *w, int B, int T, int C, int W);
/* din[t,c] = sum_i w[c,i] dout[t+(W-1)-i, c] (WRITTEN);
 * dw[c,i] += sum_t in[t-(W-1)+i, c] dout[t,c] (fixed order per channel). */
void lm_short_conv_backward(float *din, float *dw, const float *dout, const float *in, const float *w, int B,
                            int T, int C, int W);
/* out = SiLU(in), then per row of K channels L2-normalised when rnorm != NULL
 * (rnorm[r] = 1/sqrt(||SiLU(in_r)||^2 + 1e-6)); rows of K floats. */
void lm_silu_l2_forward(float *out, float *rnorm, const float *in, size_t rows, int K);
/* din (WRITTEN) = dSiLU(in) * (the L2 normalisation's backward of dout); out
 * is the forward's output. */
void lm_silu_l2_backward(float *din, const float *dout, const float *in, const float *out, const float *rnorm,
                         size_t rows, int K);

/* One row of logits z[V] scored against target y (evaluation, docs/eval.md):
 * *nll = max z + log(sum_v exp(z_v - max z)) - z[y], the sum in double in
 * vocabulary order; *argmax the lowest index among equal maxima. A non-finite
 * logit gives a non-finite *nll. The one definition of evaluation's
 * arithmetic: lm_eval_score and the CPU backend's score_forward call it. */
void lm_score_row(const float *z, int V, int y, double *nll, int32_t *argmax);

static inline float lm_sigmoidf(float x) {
    /* stable for any finite x */
    if (x >= 0) {
        float e = __builtin_expf(-x);
        return 1.0f / (1.0f + e);
    }
    float e = __builtin_expf(x);
    return e / (1.0f + e);
}

static inline float lm_siluf(float x) { return x * lm_sigmoidf(x); }

#ifdef __cplusplus
}
#endif
#endif
