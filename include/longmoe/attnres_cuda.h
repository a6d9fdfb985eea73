/* Block / Full Attention Residuals on the GPU (docs/attnres.md, "AttnRes on
 * the GPU"; SPEC §5): the mirror of longmoe/attnres.h with device tensors.
 *
 * Same modes, same configuration (lm_attnres_config), same call sequence and
 * the same meaning as the CPU state; the order checks (which call is expected
 * next) run on the host, and every call only enqueues kernels on ctx's stream:
 *
 *   forward:   lm_cuda_attnres_begin(ctx, st, embedding)
 *              for l in 0..L-1:
 *                  lm_cuda_attnres_input(ctx, st, l, &params, h)
 *                  y = sublayer_l(h)
 *                  lm_cuda_attnres_add_output(ctx, st, l, y)
 *              lm_cuda_attnres_final(ctx, st, &params, h_final)
 *   backward:  lm_cuda_attnres_final_backward(ctx, st, &params, dh_final, &grads)
 *              for l in L-1..0:
 *                  lm_cuda_attnres_output_backward(ctx, st, l, dy)
 *                  dh = sublayer_l_backward(dy)
 *                  lm_cuda_attnres_input_backward(ctx, st, l, &params, dh, &grads)
 *              lm_cuda_attnres_embedding_backward(ctx, st, dembedding)
 *
 * Device tensors, all fp32, row-major:
 *   embedding, h, y, dh, dy, dembedding   [n, d]
 *   params.query, params.key_norm         [L+1, d]   (unused in STANDARD mode)
 *   grads.query, grads.key_norm           [L+1, d]   (each may be NULL)
 * Backward functions ACCUMULATE (+=) into dy, dembedding and the parameter
 * gradients, as on the CPU. The parameter gradients are reduced over tokens
 * in a fixed order (per-block partial sums over fixed ranges of tokens, then
 * a fixed-order sum): results are bit-identical from run to run on one GPU.
 *
 * Every sublayer's softmax over its sources is computed directly, in one
 * kernel per AttnRes layer (cfg->two_phase is accepted and ignored: both CPU
 * forms give the same result to fp32 rounding; docs/attnres.md says why the
 * GPU does not use the two-phase form). Statistics, scores, softmax and the
 * block history are fp32.
 *
 * Memory: lm_cuda_attnres_memory() plans the device workspace (the CPU plan's
 * buffers without the two-phase accumulators and the query vectors);
 * lm_cuda_attnres_init() carves it out of one device allocation of
 * plan.total bytes that the caller owns. Nothing is allocated afterwards. */
#ifndef LONGMOE_ATTNRES_CUDA_H
#define LONGMOE_ATTNRES_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/attnres.h"
#include "longmoe/core.h"
#include "longmoe/cuda_context.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The fewest tokens per partial sum of the parameter gradients (one thread
 * block of the backward each): qpart has a row for every such block. The
 * backward's blocks take 8 tokens (LONGMOE_ATTNRES_TOKEN_BLOCK=8|16|32|64). */
#define LM_CUDA_ATTNRES_TOKEN_BLOCK 8

/* The state of one sequence batch on the device. Fields are private. */
typedef struct {
    lm_attnres_config cfg;
    int S;               /* effective block size (1 for FULL, L for STANDARD) */
    int n_blocks;        /* N = ceil(L/S) (0 for STANDARD) */
    float *hist;         /* [1+N, n, d]: v_0 then b_1..b_N (STANDARD: the running sum) */
    float *hist_rstd;    /* [1+N, n] */
    float *dhist;        /* [1+N, n, d] gradient accumulators of the sources */
    float *partials;     /* [L-N, n, d] saved partial sums of the mid-block sublayers */
    float *partial_rstd; /* [L, n] */
    float *logits;       /* sum over layers of [n, n_sources_l] */
    float *lse;          /* [L+1, n] */
    float *qpart;        /* [ceil(n / TOKEN_BLOCK), d] parameter-gradient partial sums */
    float *npart;        /* [ceil(n / TOKEN_BLOCK), d] the fused norm weight's gradient partial sums */
    uint16_t *dy_lp;     /* [n, d] bf16: the next output gradient in the product format (block and full) */
    int dy_lp_for;       /* the sublayer whose dLoss/dy dy_lp holds; -1: none */
    int step;            /* position in the call sequence (as in the CPU state) */
    int replaying, replay_last, replay_step; /* a block's replay (cfg.replay), as in the CPU state */
    float *defer_dh;     /* [S-1, n, d] the deferred backward's dh rows; NULL: off (docs/attnres.md) */
    float *defer_coef;   /* [S-1, n, 3 N] their closed sources' coefficients */
    uint64_t defer_mask; /* bit p-1: position p of the block in the backward has deferred its terms */
} lm_cuda_attnres_state;

/* The closed sources' gradients of a block, deferred (docs/attnres.md): each
 * mid-block sublayer's backward keeps its dh row and three numbers a source,
 * and the block's first sublayer adds them all to the closed sources'
 * gradients in one pass (the same terms in the same order: the same bits),
 * instead of every sublayer reading and writing every closed source's
 * gradient. Costs (S-1) [n, d] fp32 rows (plan.deferred). On: 1, off: 0;
 * the default is LONGMOE_ATTNRES_BWD (deferred or direct; unset: deferred).
 * It applies where the sublayers take the input with its norm
 * (lm_cuda_attnres_norm_fusable), Block AttnRes with 2 <= S <= 65 and
 * L >= S + 2 (a mid-block sublayer after the first block); the memory plan and
 * lm_cuda_attnres_init read it, so set it before both. A call without the norm
 * defers nothing and adds what waits before its own terms. */
lm_status lm_cuda_attnres_set_deferred(int on);
int lm_cuda_attnres_deferred(void);

/* Device bytes of every buffer (each rounded up to 64 bytes); phase1 and
 * queries are 0, deferred 0 unless the deferred backward applies. LM_ERR_ARG
 * for a bad config (the same checks as the CPU). */
lm_status lm_cuda_attnres_memory(const lm_attnres_config *cfg, lm_attnres_memory_plan *plan);

/* Carve the buffers out of `device_workspace` (at least plan.total bytes,
 * 64-byte aligned, as cudaMalloc returns). */
lm_status lm_cuda_attnres_init(lm_cuda_attnres_state *st, const lm_attnres_config *cfg,
                               void *device_workspace, size_t workspace_bytes);

/* Number of sources sublayer l reads (l = L: the final AttnRes). */
int lm_cuda_attnres_n_sources(const lm_cuda_attnres_state *st, int l);

/* ---- forward ---- */
lm_status lm_cuda_attnres_begin(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, const float *embedding);
lm_status lm_cuda_attnres_input(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                const lm_attnres_params *p, float *h);
lm_status lm_cuda_attnres_add_output(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                     const float *y);
/* lm_cuda_attnres_add_output, and in the same pass over y the backend's
 * deferred non-finite check of it: *first_nonfinite (device memory) = min(
 * itself, the flat index of y's first non-finite value), untouched when y is
 * all finite. The same state and bits as lm_cuda_attnres_add_output. */
lm_status lm_cuda_attnres_add_output_note(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                          const float *y, unsigned long long *first_nonfinite);
lm_status lm_cuda_attnres_final(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                const lm_attnres_params *p, float *h);
/* h [n,d] = the input of layer l (L: final) again from the saved scores,
 * h = sum_i exp(s_i - lse) v_i, for activation recomputation; available from
 * that layer's forward until its backward, not in STANDARD mode. */
/* lm_attnres_replay_block on the GPU state (cfg.replay: one block's partial sums kept) */
lm_status lm_cuda_attnres_replay_block(lm_cuda_attnres_state *st, int k);
lm_status lm_cuda_attnres_recompute_input(const lm_cuda_context *ctx, const lm_cuda_attnres_state *st, int l,
                                          float *h);

/* ---- a sublayer's input and its RMSNorm in one pass (docs/attnres.md) ----
 * Whether cfg's sublayers can take them (block or full AttnRes, d % 4 == 0,
 * d <= 1024, at most 8 sources a sublayer; LONGMOE_ATTNRES_NORM=separate: no). */
int lm_cuda_attnres_norm_fusable(const lm_attnres_config *cfg);

/* The norm after the input: out = h / rms(h) (.) weight (weight may be NULL:
 * 1), rms = sqrt(mean h^2 + eps), into out [n,d] and/or out_bf16 [n,d] (either
 * may be NULL, not both), 1/rms into rstd [n]. */
typedef struct {
    const float *weight;
    float eps;
    float *out;
    uint16_t *out_bf16;
    float *rstd;
} lm_cuda_attnres_norm;

/* lm_cuda_attnres_input(l) followed by the norm, h itself not written (the
 * same place in the call order). */
lm_status lm_cuda_attnres_input_norm(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                     const lm_attnres_params *p, const lm_cuda_attnres_norm *norm);
/* lm_cuda_attnres_recompute_input(l) followed by the norm (l < L). */
lm_status lm_cuda_attnres_recompute_input_norm(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                               const lm_cuda_attnres_norm *norm);

/* The backward of that pair from dout, the norm's output gradient [n,d]: the
 * norm's backward on h formed again from the saved scores, with the forward's
 * rstd, then lm_cuda_attnres_input_backward(l) (its place in the call order);
 * dweight (may be NULL) [d] += the norm weight's gradient. */
typedef struct {
    const float *weight;
    const float *rstd;
    const float *dout;
    float *dweight;
} lm_cuda_attnres_norm_grad;
lm_status lm_cuda_attnres_input_norm_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                              const lm_attnres_params *p, const lm_cuda_attnres_norm_grad *ng,
                                              lm_attnres_grads *g);

/* ---- backward (after lm_cuda_attnres_final, in reverse order) ---- */
lm_status lm_cuda_attnres_final_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                         const lm_attnres_params *p, const float *dh, lm_attnres_grads *g);
/* dy [n,d] += dLoss/dy_l, complete once every later sublayer's input backward ran. */
lm_status lm_cuda_attnres_output_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                          float *dy);
/* The same gradient without a copy: *dy points at the state's accumulator
 * that holds dLoss/dy_l (n,d); it stays valid and unchanged until the next
 * call on the state (lm_cuda_attnres_input_backward(l) adds to it). Takes
 * the place of lm_cuda_attnres_output_backward(l) in the call order.
 * dy_lp (may be NULL): *dy_lp = the same gradient in bf16 (the bits
 * lm_cuda_f32_to_bf16 gives), which the backward kernel that completed it
 * wrote (block and full AttnRes; l < L - 1 after input_backward(l + 1), l =
 * L - 1 after the final's), else NULL; valid as long as *dy. */
lm_status lm_cuda_attnres_output_grad(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                      const float **dy, const void **dy_lp);
lm_status lm_cuda_attnres_input_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                         const lm_attnres_params *p, const float *dh, lm_attnres_grads *g);
/* dembedding [n,d] += dLoss/dv_0. Ends the backward. */
lm_status lm_cuda_attnres_embedding_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                             float *dembedding);

#ifdef __cplusplus
}
#endif
#endif
