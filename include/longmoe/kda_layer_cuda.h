/* The KDA token mixer's non-product pieces on the GPU (docs/cuda.md, "KDA
 * layer on the GPU"; the CPU layer is src/model/kda_layer.c): the short
 * causal convolution with SiLU and the per-head L2 norm in front of the
 * operator, the sigmoid of beta, and the output stage (head RMSNorm of the
 * operator's output o, then the gate sigmoid(W_g x)).
 *
 * Conventions of longmoe/cuda_context.h: device pointers, fp32 unless named
 * bf16 (uint16_t bit patterns); kernels are enqueued on ctx->stream; nothing
 * is allocated: backward functions take planned scratch (the *_scratch_bytes
 * functions give its size). Weight gradients (dw, do_norm) ACCUMULATE (+=)
 * and are reduced over tokens in a fixed order (per-block partials, then one
 * ordered sum in double), so they are bit-identical from run to run; the
 * per-token gradients are WRITTEN (=).
 *
 * bf16 appears exactly where the KDA operator (longmoe/kda_cuda.h) wants it:
 * the operator's inputs q, k, v, its output o, and the gradients it gives
 * (dq, dk, dv) and takes (d_o). The gated output feeding W_o is bf16 because
 * W_o's product takes bf16 operands; so, on request, are the gradients that
 * feed products: the gate logits' (W_g's) and din (W_q, W_k, W_v's).
 * Statistics (1/||.||, 1/rms), the gate and every accumulator are fp32.
 *
 * Limits: head_dim (and K) a multiple of 32, at most 256; C a multiple of
 * head_dim; W >= 1. Bad arguments return LM_ERR_ARG naming the argument;
 * a launch error LM_ERR_IO. */
#ifndef LONGMOE_KDA_LAYER_CUDA_H
#define LONGMOE_KDA_LAYER_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/cuda_context.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest head_dim / K the per-head kernels take (one warp per head row). */
#define LM_KDA_LAYER_CUDA_MAX_HEAD_DIM 256

/* c = ShortConv(in) (causal, depthwise, width W), y = SiLU(c), then per head
 * of head_dim channels y /= sqrt(||y||^2 + 1e-6) when rnorm is given (q, k);
 * rnorm NULL: no norm (v).
 *   in [B,T,C] (the projection), w [C,W]: c[t,ch] = sum_i w[ch,i] in[t-(W-1)+i, ch]
 *   conv_out [B,T,C] fp32: c, saved for the backward (NULL: not saved)
 *   out_bf16 [B,T,C] bf16: y, the KDA operator's input (required)
 *   rnorm [B*T*C/head_dim]: 1/sqrt(||SiLU(c)||^2 + 1e-6) per token and head */
lm_status lm_cuda_short_conv_silu_forward(const lm_cuda_context *ctx, float *conv_out,
                                          uint16_t *out_bf16, float *rnorm, const float *in,
                                          const float *w, int B, int T, int C, int W,
                                          int head_dim);

/* Bytes of scratch lm_cuda_short_conv_silu_backward needs. */
size_t lm_cuda_short_conv_silu_backward_scratch_bytes(int B, int T, int C, int W);

/* Backward of lm_cuda_short_conv_silu_forward given dout_bf16 [B,T,C] (the
 * KDA operator's dq, dk or dv):
 *   din [B,T,C] WRITTEN: the projection's gradient
 *   dw [C,W] ACCUMULATED (+=), fixed-order sum over tokens
 *   conv_out: as saved by the forward, or NULL: recomputed from in and w with
 *             the forward's sum (the same bits, so the same gradients)
 *   rnorm: as saved by the forward (q, k), or NULL for the unnormalised v;
 *          SiLU(c) * rnorm is recomputed here, as the forward computed it
 *   scratch: lm_cuda_short_conv_silu_backward_scratch_bytes(B,T,C,W) bytes,
 *            4-byte aligned. */
lm_status lm_cuda_short_conv_silu_backward(const lm_cuda_context *ctx, float *din, float *dw,
                                           const uint16_t *dout_bf16, const float *conv_out,
                                           const float *rnorm, const float *in, const float *w,
                                           int B, int T, int C, int W, int head_dim,
                                           void *scratch);

/* The same with din WRITTEN in bf16 (rounded to nearest even) for the product
 * that takes it next: no fp32 din and no conversion pass. din's rows are
 * ld_din >= C elements apart (C: dense; more: din is a column block of a
 * wider operand, as the KDA layer's q, k, v gradients side by side; the
 * columns past C are not written). Only the one-pass
 * kernels write bf16: W <= 4, head_dim <= 128, conv_out saved or NULL
 * (lm_cuda_short_conv_silu_backward_bf16_takes); otherwise LM_ERR_ARG. dw
 * has the bits of lm_cuda_short_conv_silu_backward. */
int lm_cuda_short_conv_silu_backward_bf16_takes(int W, int head_dim);
lm_status lm_cuda_short_conv_silu_backward_bf16(const lm_cuda_context *ctx, uint16_t *din_bf16, float *dw,
                                                const uint16_t *dout_bf16, const float *conv_out,
                                                const float *rnorm, const float *in, const float *w, int B, int T,
                                                int C, int W, int head_dim, int ld_din, void *scratch);

/* out[i] = 1 / (1 + exp(-in[i])) (beta = sigmoid(W_beta x)); out may be in. */
lm_status lm_cuda_sigmoid_forward(const lm_cuda_context *ctx, float *out, const float *in,
                                  size_t n);
/* din[i] = dout[i] out[i] (1 - out[i]) WRITTEN, with out the forward's
 * sigmoid (beta): the gradient of beta's logit; din may be dout. */
lm_status lm_cuda_sigmoid_backward(const lm_cuda_context *ctx, float *din, const float *dout,
                                   const float *out, size_t n);

/* The output stage, per token and head (rows N*H of K values):
 *   n = RMSNorm(o) * o_norm (rms = sqrt(mean(o^2) + eps)), gate = sigmoid(gate_logits),
 *   gated = gate * n.
 *   gated_bf16 [N,H*K] bf16: the input of W_o
 *   o_rstd [N*H]: 1/rms, saved;  gate [N,H*K]: saved (may be gate_logits: in place)
 *   o [N,H*K] bf16: the operator's output;  o_norm [K] */
lm_status lm_cuda_kda_output_forward(const lm_cuda_context *ctx, uint16_t *gated_bf16,
                                     float *o_rstd, float *gate, const uint16_t *o,
                                     const float *gate_logits, const float *o_norm, int64_t N,
                                     int H, int K, float eps);

/* Bytes of scratch lm_cuda_kda_output_backward needs. */
size_t lm_cuda_kda_output_backward_scratch_bytes(int64_t N, int H, int K);

/* Backward of the output stage given d_gated [N,H*K] (from W_o's backward):
 *   d_o_bf16 [N,H*K] bf16 WRITTEN: the KDA operator's d_o (NULL: not written)
 *   d_o_f32  [N,H*K] fp32 WRITTEN: the same in fp32 (NULL: not written);
 *            at least one of the two is required
 *   dgate_logits [N,H*K] fp32 WRITTEN: d_gated n gate (1 - gate), for W_g's
 *            backward (NULL: not written)
 *   dgate_bf16 [N,H*K] bf16 WRITTEN: the same rounded to nearest even (the
 *            bits of lm_cuda_f32_to_bf16 on dgate_logits), the operand of
 *            W_g's backward products (NULL: not written); at least one of
 *            the two is required; its rows ld_dgate_bf16 (>= H*K; 0: H*K)
 *            elements apart (a column block of a wider operand: its other
 *            columns are not written)
 *   do_norm [K] ACCUMULATED (+=), fixed-order sum over tokens and heads
 *   o, gate: as in (and from) the forward; o_rstd: from the forward, or
 *            NULL: recomputed from o with eps
 *   scratch: lm_cuda_kda_output_backward_scratch_bytes(N,H,K) bytes, 4-byte aligned. */
lm_status lm_cuda_kda_output_backward(const lm_cuda_context *ctx, uint16_t *d_o_bf16,
                                      float *d_o_f32, float *dgate_logits, uint16_t *dgate_bf16,
                                      int64_t ld_dgate_bf16, float *do_norm,
                                      const float *d_gated, const uint16_t *o,
                                      const float *o_rstd, const float *gate,
                                      const float *o_norm, int64_t N, int H, int K, float eps,
                                      void *scratch);

#ifdef __cplusplus
}
#endif
#endif
