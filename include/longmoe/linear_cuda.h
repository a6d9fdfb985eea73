/* Dense operators of the model on the GPU (docs/cuda.md, "Dense operators on
 * the GPU"): matrix products through cuBLASLt, RMSNorm, the embedding, the
 * chunked cross-entropy with the LM head, bf16 conversions and the
 * non-finite check. They mirror the CPU code in longmoe/linear.h and the
 * embedding / cross-entropy steps of src/model/model.c.
 *
 * Conventions (longmoe/cuda_context.h): device pointers only, row-major;
 * bf16 tensors are uint16_t bit patterns; everything else is fp32. Every
 * function enqueues its work on ctx->stream and returns without waiting;
 * none allocates: scratch and workspaces come from the caller, sized by the
 * *_scratch_* / *_workspace_bytes functions. Backward functions ACCUMULATE
 * (+=) into fp32 gradients; sums over tokens (RMSNorm weight, embedding rows,
 * LM head rows, the loss) run in a fixed order, so two runs on the same GPU
 * give the same bits. Bad arguments return LM_ERR_ARG naming the argument;
 * CUDA and cuBLASLt errors LM_ERR_IO. A shape with n = 0 rows is a no-op. */
#ifndef LONGMOE_LINEAR_CUDA_H
#define LONGMOE_LINEAR_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/cuda_context.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- matrix products (cuBLASLt: bf16 operands, fp32 accumulation) ---- */

/* out[n,oc] = inp[n,ic] . weight[oc,ic]^T (fp32 out; accumulate != 0: +=).
 * Weight layout [out, in] as in lm_matmul_forward. */
lm_status lm_cuda_matmul_forward(const lm_cuda_context *ctx, float *out, const uint16_t *inp,
                                 const uint16_t *weight, int64_t n, int ic, int oc, int accumulate);
/* The same product written as bf16 (=), for outputs that only feed other
 * products: fp32 accumulation, one rounding at the end. */
lm_status lm_cuda_matmul_forward_bf16(const lm_cuda_context *ctx, uint16_t *out, const uint16_t *inp,
                                      const uint16_t *weight, int64_t n, int ic, int oc);
/* dinp[n,ic] += dout[n,oc] . weight[oc,ic];  dweight[oc,ic] += dout^T . inp.
 * Either gradient may be NULL (skipped). */
lm_status lm_cuda_matmul_backward(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                  const uint16_t *dout, const uint16_t *inp, const uint16_t *weight,
                                  int64_t n, int ic, int oc);
/* The same with dinp WRITTEN (= dout . weight; beta 0: what was there is not
 * read); dweight still accumulates. */
lm_status lm_cuda_matmul_backward_set(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                      const uint16_t *dout, const uint16_t *inp, const uint16_t *weight,
                                      int64_t n, int ic, int oc);
/* Either of the two (set 1: dinp written, 0: added to) with dout's rows
 * ld_dout (>= oc, a multiple of 8) elements apart: a column block of a wider
 * bf16 matrix, e.g. several products' output gradients side by side, whose
 * input gradient then takes one product against their weights stacked. */
lm_status lm_cuda_matmul_backward_ld(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                     const uint16_t *dout, int64_t ld_dout, const uint16_t *inp,
                                     const uint16_t *weight, int64_t n, int ic, int oc, int set);

/* The products' profile (a benchmark's tool, not for training): while on, every cuBLAS product
 * (the calls above, and the MoE's dense, fp32 router and batched expert products; not the grouped
 * kind's call nor the hand-written wmma and wgmma kernels) is bracketed by two CUDA events on its
 * stream, and its shape noted. print (file: a FILE *) waits for the device, then writes one line a
 * shape (the kind of call, m n k in cuBLAS's column-major terms, the operations, beta and D's type):
 * calls and milliseconds a step over `steps` and TFLOP/s, the slowest first, and frees the records.
 * Returns LM_ERR_IO if an event could not be made or read. */
void lm_cuda_matmul_profile(int on);
lm_status lm_cuda_matmul_profile_print(void *file, int steps);

/* ---- conversions and checks ---- */

/* dst = bf16(src), round to nearest even (NaN stays NaN), as lm_f32_to_bf16. */
lm_status lm_cuda_f32_to_bf16(const lm_cuda_context *ctx, uint16_t *dst, const float *src, size_t n);
/* The same for rows x cols values whose rows are ld_dst (>= cols) elements
 * apart in dst (a column block of a wider bf16 matrix) and dense in src. */
lm_status lm_cuda_f32_to_bf16_rows(const lm_cuda_context *ctx, uint16_t *dst, int64_t ld_dst, const float *src,
                                   int64_t rows, int64_t cols);
/* dst = fp32(src), exact. */
lm_status lm_cuda_bf16_to_f32(const lm_cuda_context *ctx, float *dst, const uint16_t *src, size_t n);
/* *flag_device (a device int) = 1 when every x[i] is finite, else 0. No host
 * synchronisation: read the flag after the stream's later work. */
lm_status lm_cuda_all_finite(const lm_cuda_context *ctx, const float *x, size_t n, int *flag_device);

/* ---- RMSNorm (statistics in fp32) ---- */

/* out[n,d] = x / rms(x) * weight, rms = sqrt(mean(x^2) + eps) (weight may be
 * NULL: no scale). out (fp32) and out_bf16 (the same values rounded) may each
 * be NULL, not both; rstd[n] (may be NULL) receives 1/rms. Any d >= 1. */
lm_status lm_cuda_rmsnorm_forward(const lm_cuda_context *ctx, float *out, uint16_t *out_bf16, float *rstd,
                                  const float *inp, const float *weight, int64_t n, int d, float eps);
/* Floats of scratch lm_cuda_rmsnorm_backward needs for (n, d). */
size_t lm_cuda_rmsnorm_scratch_floats(int64_t n, int d);
/* dinp[n,d] += dL/dx; dweight[d] += sum over rows of dout * x * rstd (may be
 * NULL; summed as per-block partials over fixed row ranges, then a fixed-order
 * sum of the partials). weight may be NULL (no scale); rstd from the forward,
 * or NULL: recomputed into the scratch. dinp may be NULL. */
lm_status lm_cuda_rmsnorm_backward(const lm_cuda_context *ctx, float *dinp, float *dweight, const float *dout,
                                   const float *inp, const float *weight, const float *rstd, int64_t n, int d,
                                   float eps, float *scratch);
/* The same with dinp written (dinp = dL/dx) instead of added to: no zeroing
 * pass before it; dweight still accumulates. */
lm_status lm_cuda_rmsnorm_backward_set(const lm_cuda_context *ctx, float *dinp, float *dweight, const float *dout,
                                       const float *inp, const float *weight, const float *rstd, int64_t n, int d,
                                       float eps, float *scratch);

/* ---- embedding ---- */

/* out[i,:] = table[tokens[i],:] for i < n. Tokens must lie in the table
 * (the caller checks them on the host, as lm_model_forward does). */
lm_status lm_cuda_embedding_forward(const lm_cuda_context *ctx, float *out, const float *table,
                                    const int32_t *tokens, int64_t n, int d);
/* Bytes of scratch lm_cuda_embedding_backward needs. */
size_t lm_cuda_embedding_scratch_bytes(int64_t n, int vocab);
/* dtable[tokens[i],:] += dout[i,:], each row's terms added in position order
 * (i ascending), exactly as the CPU loop of lm_model_backward: a stable radix
 * sort of the positions by token on the device (cub), then one warp per
 * distinct token and slice of 256 columns. No float atomics. Tokens outside
 * [0, vocab) are skipped. */
lm_status lm_cuda_embedding_backward(const lm_cuda_context *ctx, float *dtable, const float *dout,
                                     const int32_t *tokens, int64_t n, int d, int vocab, void *scratch);

/* ---- chunked cross-entropy with the LM head ---- */

/* Bytes of workspace for chunks of rows_per_chunk rows (1..n): the loss of
 * every row, one chunk's fp32 logits and its bf16 dlogits. The ops derive
 * their chunk size from the workspace size they are given; forward and
 * backward with the same workspace size use the same chunks. */
size_t lm_cuda_cross_entropy_workspace_bytes(int64_t n, int d, int vocab, int64_t rows_per_chunk);
/* logits = hn[n,d] . head[V,d]^T, one chunk of rows at a time (never [n,V] at
 * once); lse[r] = log sum_v exp(logits[r,v]) in fp32; *loss_sum_device = sum
 * over rows of lse[r] - logits[r, targets[r]], summed in a fixed order.
 * Targets must lie in [0, vocab). */
lm_status lm_cuda_cross_entropy_forward(const lm_cuda_context *ctx, float *lse, float *loss_sum_device,
                                        const uint16_t *hn, const uint16_t *head, const int32_t *targets,
                                        int64_t n, int d, int vocab, void *workspace, size_t workspace_bytes);
/* With the chunk's logits recomputed: dlogits = (softmax - onehot(target)) *
 * scale * row_scale[r] (row_scale may be NULL: 1), rounded to bf16; then
 * dhn[n,d] += dlogits . head and dhead[V,d] += dlogits^T . hn (either may be
 * NULL). lse from the forward. */
lm_status lm_cuda_cross_entropy_backward(const lm_cuda_context *ctx, float *dhn, float *dhead, const uint16_t *hn,
                                         const uint16_t *head, const int32_t *targets, const float *lse,
                                         const float *row_scale, float scale, int64_t n, int d, int vocab,
                                         void *workspace, size_t workspace_bytes);
/* Both in one pass over the chunks, for a training step whose mean loss
 * scale is known before its forward (row_scale 1): each chunk's logits are
 * computed once, reduced to lse and then turned into dlogits at once instead
 * of being computed again by the backward. The same kernels on the same
 * inputs as the two calls above, so lse, *loss_sum_device, dhn and dhead are
 * their bits. */
lm_status lm_cuda_cross_entropy_forward_backward(const lm_cuda_context *ctx, float *lse, float *loss_sum_device,
                                                 float *dhn, float *dhead, const uint16_t *hn, const uint16_t *head,
                                                 const int32_t *targets, float scale, int64_t n, int d, int vocab,
                                                 void *workspace, size_t workspace_bytes);
/* Evaluation's scores through the same chunks (the same workspace): per row
 * nll[r] = max + log sum_v exp(logits[r,v] - max) - logits[r, targets[r]]
 * (the exponentials and their sum in double, then a fixed tree) and
 * argmax[r], the lowest index among equal maxima; both written, device
 * memory. A non-finite logit gives a non-finite nll. */
lm_status lm_cuda_score_forward(const lm_cuda_context *ctx, double *nll, int32_t *argmax, const uint16_t *hn,
                                const uint16_t *head, const int32_t *targets, int64_t n, int d, int vocab,
                                void *workspace, size_t workspace_bytes);

#ifdef __cplusplus
}
#endif
#endif
