/* Causal softmax attention, tiled with an online softmax (docs/attention.md; SPEC §3).
 *
 * Shapes (row-major, fp32): B sequences, T tokens, H query heads, Hkv key/value
 * heads (H a multiple of Hkv: grouped-query attention, query head h reads
 * key/value head h / (H / Hkv)), key dim Dk, value dim Dv.
 *   q    [B,T,H,Dk]    queries
 *   k    [B,T,Hkv,Dk]  keys
 *   v    [B,T,Hkv,Dv]  values
 *   o    [B,T,H,Dv]    output
 *   lse  [B,H,T]       log-sum-exp of each query's scaled scores (saved for the backward)
 *
 *   s_ij = scale * q_i . k_j  for j <= i (causal, no position encoding);
 *   lse_i = log sum_{j<=i} exp(s_ij);  o_i = sum_{j<=i} exp(s_ij - lse_i) v_j.
 *
 * The tiled form never builds a T x T matrix: each (batch, head, query tile)
 * walks the key tiles left of the diagonal keeping a running max m and sum l
 * per query (the online softmax), all in fp32. Its workspace is a few tiles per
 * thread, independent of T (forward) or O(B*H*T) (backward: D_i = rowsum(dO*O)),
 * allocated inside the call with one malloc of exactly
 * lm_attention_{forward,backward}_workspace_bytes(). The backward recomputes
 * the probabilities tile by tile from lse (flash-attention style). */
#ifndef LONGMOE_ATTENTION_H
#define LONGMOE_ATTENTION_H

#include <stddef.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Query and key tile sizes of the tiled form (tokens). */
#define LM_ATTN_TILE_Q 64
#define LM_ATTN_TILE_K 64

typedef struct {
    int B, T, H, Hkv, Dk, Dv;
    float scale; /* score scale; 0 means Dk^-1/2 */
    /* Caller-planned scratch (NULL: allocated per call), used when large enough
     * for the call (lm_attention_{forward,backward}_workspace_bytes). */
    void *workspace;
    size_t workspace_bytes;
} lm_attention_config;

/* A config with scale 0 (= Dk^-1/2). */
lm_attention_config lm_attention_config_default(int B, int T, int H, int Hkv, int Dk, int Dv);

/* Validate the dims (all >= 1, H a multiple of Hkv) and the scale (finite, >= 0). */
lm_status lm_attention_check(const lm_attention_config *cfg);

/* The scale actually used: cfg->scale, or Dk^-1/2 when it is 0. */
float lm_attention_scale(const lm_attention_config *cfg);

/* Bytes the tiled forward / backward allocate for their workspace when run
 * with `nthreads` OpenMP threads (<= 0: omp_get_max_threads()). The forward's
 * does not depend on T; the backward's grows as B*H*T (one float per query). */
size_t lm_attention_forward_workspace_bytes(const lm_attention_config *cfg, int nthreads);
size_t lm_attention_backward_workspace_bytes(const lm_attention_config *cfg, int nthreads);

/* Tiled forward: o [B,T,H,Dv] and lse [B,H,T] (lse may be NULL). */
lm_status lm_attention_forward(const lm_attention_config *cfg, const float *q, const float *k,
                               const float *v, float *o, float *lse);

/* The same, also writing rowmax [B,H,T] (may be NULL): each query's largest
 * scaled score, the per-head maximum logit that QK-Clip watches. */
lm_status lm_attention_forward_rowmax(const lm_attention_config *cfg, const float *q, const float *k,
                                      const float *v, float *o, float *lse, float *rowmax);

/* Tiled backward given d_o [B,T,H,Dv] and the forward's o and lse. ACCUMULATES
 * (+=) into dq [B,T,H,Dk], dk [B,T,Hkv,Dk], dv [B,T,Hkv,Dv]; any may be NULL. */
lm_status lm_attention_backward(const lm_attention_config *cfg, const float *q, const float *k,
                                const float *v, const float *o, const float *lse,
                                const float *d_o, float *dq, float *dk, float *dv);

/* Queries of a later part of the sequences (context parallelism): the T
 * queries sit at positions q_offset .. q_offset+T-1 of sequences whose keys
 * and values are positions 0 .. q_offset+T-1, so k [B,q_offset+T,Hkv,Dk] and
 * v [B,q_offset+T,Hkv,Dv]; query i attends keys j <= q_offset + i. q, o, d_o,
 * dq, lse and rowmax (may be NULL) have the T queries' shapes, dk and dv the
 * keys'. q_offset 0 is lm_attention_forward_rowmax / _backward, bit for bit.
 * Same workspace sizes. */
lm_status lm_attention_forward_offset(const lm_attention_config *cfg, int q_offset, const float *q,
                                      const float *k, const float *v, float *o, float *lse, float *rowmax);
lm_status lm_attention_backward_offset(const lm_attention_config *cfg, int q_offset, const float *q,
                                       const float *k, const float *v, const float *o, const float *lse,
                                       const float *d_o, float *dq, float *dk, float *dv);

/* ---- naive O(T^2) reference: for tests and benchmarks only ----
 * Materialises the full [T,T] score matrix per (batch, head) (T*T floats,
 * malloc'd inside), fp32. Same contract as the tiled functions. */
lm_status lm_attention_naive_forward(const lm_attention_config *cfg, const float *q,
                                     const float *k, const float *v, float *o, float *lse);
lm_status lm_attention_naive_backward(const lm_attention_config *cfg, const float *q,
                                      const float *k, const float *v, const float *o,
                                      const float *lse, const float *d_o, float *dq, float *dk,
                                      float *dv);

#ifdef __cplusplus
}
#endif
#endif
