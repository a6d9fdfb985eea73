/* The KDA layer's elementwise pieces (src/model/kda_layer.c), visible inside
 * the library and to the tests that check the CUDA versions against them
 * (tests/test_cuda_kda_layer.c). Not part of the public API. */
#ifndef LONGMOE_KDA_LAYER_INTERNAL_H
#define LONGMOE_KDA_LAYER_INTERNAL_H

#include <stddef.h>

/* Causal depthwise convolution: out[t,c] = sum_i w[c,i] in[t-(W-1)+i, c];
 * in, out (B,T,C), w (C,W). */
void lm_kda_short_conv_forward(float *out, const float *in, const float *w, int B, int T, int C,
                               int W);
/* din[t,c] = sum_i w[c,i] dout[t+(W-1)-i, c] (written); dw[c,i] += sum_t
 * in[t-(W-1)+i, c] dout[t,c]. */
void lm_kda_short_conv_backward(float *din, float *dw, const float *dout, const float *in,
                                const float *w, int B, int T, int C, int W);
/* out = SiLU(in), then per row of K: out /= sqrt(||out||^2 + 1e-6) and
 * rnorm[r] = that factor, when rnorm is given. */
void lm_kda_silu_l2_forward(float *out, float *rnorm, const float *in, size_t rows, int K);
/* din = dSiLU(in) * (L2 backward of dout), given the forward's out and rnorm
 * (rnorm NULL: no norm). din is written. */
void lm_kda_silu_l2_backward(float *din, const float *dout, const float *in, const float *out,
                             const float *rnorm, size_t rows, int K);

#endif
