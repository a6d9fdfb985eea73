/* Launchers of the AttnRes kernels (attnres_kernels.cu), called by the state
 * functions of attnres_api.cu. Every launcher enqueues on `stream` and returns
 * the launch error as an lm_status. Shapes in the comments; all fp32. */
#ifndef LONGMOE_CUDA_ATTNRES_INTERNAL_CUH
#define LONGMOE_CUDA_ATTNRES_INTERNAL_CUH

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "longmoe/core.h"

/* One AttnRes layer's sources: closed sources hist[0..C-1] (each [n,d], with
 * 1/rms hist_rstd[i*n + t]) and, when has_partial, the partial sum P. */
struct attnres_sources {
    const float *hist;      /* [>=C, n, d] */
    const float *hist_rstd; /* [>=C, n] */
    int C;
    int has_partial;
    const float *P;         /* [n, d] (forward: the open block's sum; recompute/backward: the saved copy) */
    float *P_rstd;          /* [n] 1/rms of P (written by the forward, read otherwise) */
};

/* The deferred backward of a block's closed sources (docs/attnres.md, "The
 * closed sources' gradients, deferred"). A mid-block sublayer at position p
 * (slot = p - 1 >= 0) writes its dh row into dh + slot n d and, for each
 * closed source i < C, the coefficients a_i, k1_i, k2_i of its term
 * a_i dh + k1_i u - k2_i v_i into coef[(slot n + t) 3 cmax + 3 i ...],
 * instead of adding the term into dhist[i]. A call that does not defer
 * (slot = -1: the block's first sublayer, or one without the norm) adds the
 * terms of every position p whose bit p - 1 is set in apply (highest position
 * first: the order the sublayers would have added them) before its own, then
 * writes dhist[i] once. w, g: the queries and key
 * norms of the block's sublayers, position p's at + p d. */
struct attnres_deferred {
    float *dh;          /* [S-1, n, d] */
    float *coef;        /* [S-1, n, 3 cmax] */
    int cmax;           /* the most closed sources a sublayer reads */
    int slot;           /* >= 0: this call defers into that slot */
    uint64_t apply;     /* bit p-1: add position p's deferred terms (slot -1 only) */
    const float *w, *g; /* [S, d] from the block's first sublayer */
};

/* rows [n,d]: dst = src (assign) or dst += src; rstd [n] (may be NULL) = 1/rms of the new rows;
 * first_nonfinite (may be NULL) = min(itself, the flat index of src's first non-finite value). */
lm_status attnres_launch_accumulate_rows(cudaStream_t stream, float *dst, const float *src, float *rstd,
                                         int assign, int64_t n, int d, float eps, unsigned long long *first_nonfinite);

/* dst[i] += src[i] for i < count. */
lm_status attnres_launch_add(cudaStream_t stream, float *dst, const float *src, size_t count);

/* Forward of one AttnRes layer with query row w, key-norm row g (d each):
 * scores, softmax, h = sum_i a_i v_i; writes logits [n, Ns], lse [n], h [n,d],
 * and (has_partial) P_rstd and the copy P_save [n,d] of P (may be NULL).
 * from_saved = 1: recomputation; the scores are read from logits and lse
 * instead (w, g, P_save unused) and only h is written. */
lm_status attnres_launch_forward(cudaStream_t stream, const attnres_sources *src, float *P_save, const float *w,
                                 const float *g, float *logits, float *lse, float *h, int from_saved, int64_t n,
                                 int d, float eps);

/* Backward of one AttnRes layer: dv of every source into dhist[i] (i < C)
 * and dP (has_partial); assign = 1 writes dhist[0..C-1] instead of adding
 * (the final layer, which reads every source, initialises the accumulators).
 * Parameter gradients: dw += g (.) q, dg += w (.) q with q = sum over tokens
 * and sources of ds_i r_i v_i, reduced through qpart [ceil(n/TOKEN_BLOCK), d];
 * dw, dg may be NULL. lp_out (may be NULL): [n,d] bf16, source lp_src's
 * updated dv (dhist[lp_src], or dP when lp_src == C) rounded as the model's
 * to_lp rounds: the next sublayer's output gradient in the product format,
 * written while the row is in registers. df (may be NULL): the deferred
 * terms to add (df->apply; this kernel does not defer its own). */
lm_status attnres_launch_backward(cudaStream_t stream, const attnres_sources *src, float *dhist, float *dP,
                                  int assign, const float *w, const float *g, const float *logits,
                                  const float *lse, const float *dh, float *qpart, float *dw, float *dg,
                                  uint16_t *lp_out, int lp_src, const attnres_deferred *df, int64_t n, int d);

/* Whether a sublayer's input and its RMSNorm run as one kernel each way
 * (forward_norm_kernel, backward_norm_kernel): d % 4 == 0, d <= 1024, at
 * most max_sources <= 8 sources a sublayer (the rows are held in registers). */
int attnres_norm_fusable(int d, int max_sources);

/* The forward of one AttnRes layer (attnres_launch_forward's arguments but h)
 * with the RMSNorm of its h: xn = h / rms(h) (.) nw (nw may be NULL: 1) into
 * xn [n,d] (may be NULL) and xn_bf16 [n,d] (may be NULL), 1/rms(h) into
 * nrstd [n]; h is not written. */
lm_status attnres_launch_forward_norm(cudaStream_t stream, const attnres_sources *src, float *P_save, const float *w,
                                      const float *g, float *logits, float *lse, int from_saved, const float *nw,
                                      float *xn, uint16_t *xn_bf16, float *nrstd, int64_t n, int d, float eps,
                                      float neps);

/* The backward of that pair (attnres_launch_backward's arguments, assign 0)
 * from dxn [n,d], the norm's output gradient, its weight nw and the forward's
 * nrstd; h is formed again from the saved scores. dnw (may be NULL) [d] +=
 * the norm weight's gradient, reduced through npart [ceil(n/TOKEN_BLOCK), d].
 * df (may be NULL): defer this sublayer's closed sources' terms (df->slot >=
 * 0) or add the deferred ones (df->apply). */
lm_status attnres_launch_backward_norm(cudaStream_t stream, const attnres_sources *src, float *dhist, float *dP,
                                       const float *w, const float *g, const float *logits, const float *lse,
                                       const float *dxn, const float *nw, const float *nrstd, float *qpart,
                                       float *npart, float *dw, float *dg, float *dnw, uint16_t *lp_out, int lp_src,
                                       const attnres_deferred *df, int64_t n, int d);

#endif
