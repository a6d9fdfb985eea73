/* The small kernels of the CUDA backend (src/cuda/backend/backend_kernels.cu):
 * the elementwise ops the operator library has no kernel for yet, the target
 * logit of the cross-entropy, the router entropy of the balancer's monitoring
 * and the first non-finite index. Device pointers; each call enqueues on
 * ctx->stream and returns without waiting. Included by .cu files only. */
#ifndef LONGMOE_CUDA_BACKEND_INTERNAL_H
#define LONGMOE_CUDA_BACKEND_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/cuda_context.h"

/* h = act(a, u) (moe.h's lm_expert_act_forward), into h (fp32, may be NULL)
 * and h_bf16 (may be NULL). act: LM_EXPERT_SWIGLU or LM_EXPERT_SITU_GLU. */
lm_status lm_cuda_backend_glu_forward(const lm_cuda_context *ctx, int act, float *h, uint16_t *h_bf16,
                                      const float *a, const float *u, size_t n);
/* da = dh * dact/da, du = dh * dact/du (WRITTEN; lm_expert_act_backward) into
 * da, du (fp32) and/or da_bf16, du_bf16 (the same values rounded to nearest
 * even, as lm_cuda_f32_to_bf16): each of the four may be NULL, but not both
 * outputs of da or of du. */
lm_status lm_cuda_backend_glu_backward(const lm_cuda_context *ctx, int act, float *da, float *du, uint16_t *da_bf16,
                                       uint16_t *du_bf16, const float *dh, const float *a, const float *u, size_t n);
/* gated = sigmoid(gp) * fp32(o) into gated (may be NULL) and gated_bf16 (may be NULL). */
lm_status lm_cuda_backend_gate_forward(const lm_cuda_context *ctx, float *gated, uint16_t *gated_bf16,
                                       const float *gp, const uint16_t *o, size_t n);
/* s = sigmoid(gp): d_o = bf16(dgated s), dgp = dgated o s (1 - s) (both
 * WRITTEN); dgp into fp32 (may be NULL) and/or dgp_bf16 (may be NULL: the
 * same value rounded as lm_cuda_f32_to_bf16 rounds), not neither. */
lm_status lm_cuda_backend_gate_backward(const lm_cuda_context *ctx, uint16_t *d_o, float *dgp, uint16_t *dgp_bf16,
                                        const float *dgated, const float *gp, const uint16_t *o, size_t n);
/* target_logit[r] = hn[r,:] . head[targets[r],:] (bf16 operands, fp32 sum
 * in a fixed warp order), r < n. */
lm_status lm_cuda_backend_target_logit(const lm_cuda_context *ctx, float *target_logit, const uint16_t *hn,
                                       const uint16_t *head, const int32_t *targets, int64_t n, int d);
/* ent[i] = log S - sum_j s_ij log s_ij / S with S = sum_j s_ij (0 when S = 0),
 * the router entropy of token i as lm_balance_observe measures it; NaN when a
 * score of the token is outside [0, 1] or not finite. scores [m, n]. */
lm_status lm_cuda_backend_router_entropy(const lm_cuda_context *ctx, float *ent, const float *scores, int64_t m,
                                         int n);
/* The same entropies summed into *sum (ACCUMULATED; int64 in units of 2^-32
 * nats, two's complement in the unsigned word: each token's entropy rounded
 * to that unit, then integer adds, so the sum is the same bits whatever the
 * order). A token i whose scores are not all in [0, 1] adds nothing and sets
 * *bad = min(*bad, key | i) (key: the caller's tag in the high 32 bits; m <
 * 2^32). */
lm_status lm_cuda_backend_router_entropy_sum(const lm_cuda_context *ctx, unsigned long long *sum,
                                             unsigned long long *bad, const float *scores, int64_t m, int n,
                                             unsigned long long key);
/* *first_device (an unsigned long long) = the smallest i < n with x[i] not
 * finite, or n when there is none (integer atomic minimum: order-free). */
lm_status lm_cuda_backend_first_nonfinite(const lm_cuda_context *ctx, unsigned long long *first_device,
                                          const float *x, size_t n);
/* *slot_device = min(*slot_device, base + x's first non-finite index); enqueued only */
lm_status lm_cuda_backend_note_nonfinite(const lm_cuda_context *ctx, unsigned long long *slot_device, const float *x,
                                         size_t n, unsigned long long base);

/* acc[i] += x[i], i < n: x fp32 (lp = 0) or bf16 (lp = 1). */
lm_status lm_cuda_backend_accumulate(const lm_cuda_context *ctx, float *acc, const void *x, size_t n, int lp);

#endif
