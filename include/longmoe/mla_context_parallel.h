/* The gated attention layer (MLA or GQA) under context parallelism
 * (docs/scaleout.md "MLA context parallelism"; SPEC §9): one sequence split
 * across ranks.
 *
 * Rank r holds tokens [t0_r, t0_r + n_r) of every sequence (x [B,n_r,d]); the
 * segments follow rank order without gaps (t0_0 = 0, t0_{r+1} = t0_r + n_r,
 * every n_r >= 1, the same B on every rank; checked, collectively). The
 * token-local parts of the layer (the query path, the gate and W_o, and what
 * a token contributes to the keys and values) run on the rank's own tokens:
 * MLA's latent c = RMSNorm(W_dkv x) and rotary key RoPE(kr), GQA's RoPE(k) and
 * v, RoPE at the global positions. Each rank receives those of the earlier
 * ranks' tokens (one all-to-all-v: a rank sends to the later ranks only;
 * MLA: kv_lora + rope_dims floats a token, GQA: Hkv (Dk + Dv)), forms k and v
 * over positions 0 .. t0 + n - 1 (MLA expands the latent per head), and
 * attends its queries to them with the causal mask by global position
 * (lm_attention_forward_offset). The backward returns those parts' gradients
 * at the earlier positions to their owners (one all-to-all-v), each owner
 * adding them to its own in rank order (deterministic).
 *
 * Outputs: y and dx of the rank's segment. The parameter gradients in g
 * ACCUMULATE this rank's part: their sum over the ranks is the whole
 * sequence's gradient (the data-parallel reduction sums it). CPU backend.
 * Memory: acts and scratch hold k and v of the whole prefix (MLA: H (Dk + Dv)
 * floats a token of t0 + n), like the whole sequence would. */
#ifndef LONGMOE_MLA_CONTEXT_PARALLEL_H
#define LONGMOE_MLA_CONTEXT_PARALLEL_H

#include <stddef.h>

#include "longmoe/comm.h"
#include "longmoe/mla.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Floats of saved activations and of backward scratch for this rank's
 * segment [t0, t0 + n) (0 for an invalid config). The scratch depends on the
 * number of ranks. */
size_t lm_mla_cp_acts_floats(const lm_mla_config *cfg, int B, int t0, int n);
size_t lm_mla_cp_scratch_floats(const lm_mla_config *cfg, int comm_size, int B, int t0, int n);

/* y [B,n,d] from x [B,n,d], the rank's segment at t0; acts receives what the backward needs. Collective. */
lm_status lm_mla_cp_forward(lm_comm *comm, const lm_mla_config *cfg, const lm_mla_params *p, const float *x,
                            int B, int t0, int n, float *y, float *acts);

/* Given dy [B,n,d]: ACCUMULATES (+=) into dx [B,n,d] (may be NULL) and g
 * (this rank's part of every parameter gradient). x and acts those of the
 * forward; scratch is overwritten. Collective. */
lm_status lm_mla_cp_backward(lm_comm *comm, const lm_mla_config *cfg, const lm_mla_params *p, const float *x,
                             const float *acts, const float *dy, int B, int t0, int n, float *dx,
                             const lm_mla_params *g, float *scratch);

/* smax [H] = each head's largest scaled pre-softmax logit over the whole
 * sequence (every rank's queries; for QK-Clip, include/longmoe/optim.h), from
 * the acts of lm_mla_cp_forward; the same bits on every rank. Collective. */
lm_status lm_mla_cp_max_logits(lm_comm *comm, const lm_mla_config *cfg, const float *acts, int B, int t0, int n,
                               float *smax);

/* ---- any backend: the segment form ----
 * The same layer on the backend of cfg (CPU or CUDA; cfg->backend NULL: the
 * CPU) through its own segment functions (lm_mla_forward_seg, _backward_seg,
 * _seg_store_rows, _seg_stores_backward; include/longmoe/mla.h): x_lp in the
 * product format, p_lp the parameters in it, every buffer in the backend's
 * memory and `comm` an engine working on that memory (MPI for the CPU; NCCL
 * or the staged engine for a GPU, its stream the backend's). Forward: every
 * rank but the last computes its rows of the stores (MLA: the latent c and,
 * with RoPE, the rotary key; GQA: the keys and values) and sends them by one
 * all-to-all-v to the later ranks; each rank puts the earlier rows in its
 * stores of t0 + n rows a sequence and runs the segment over them (MLA: the
 * prefix's keys and values up-projected per sequence). Backward: the
 * segment's backward adds the attention's gradient of every stored row it
 * read into accumulators; one all-to-all-v returns the earlier rows' parts to
 * their owners, which add them in rank order and take them through the
 * key/value side alone (the backward is linear in them). Outputs: y and dx
 * (required) of the segment; g ACCUMULATES this rank's part. acts and scratch
 * hold the floats below (they grow with t0: the prefix's stores, and its keys
 * and values of one sequence for MLA); scratch is free between the calls. */
size_t lm_mla_cp_lp_acts_floats(const lm_mla_config *cfg, int B, int t0, int n);
size_t lm_mla_cp_lp_scratch_floats(const lm_mla_config *cfg, int comm_size, int B, int t0, int n);
lm_status lm_mla_cp_forward_lp(lm_comm *comm, const lm_mla_config *cfg, const lm_mla_params *p,
                               const lm_mla_params *p_lp, const void *x_lp, int B, int t0, int n, float *y,
                               float *acts, float *scratch);
lm_status lm_mla_cp_backward_lp(lm_comm *comm, const lm_mla_config *cfg, const lm_mla_params *p,
                                const lm_mla_params *p_lp, const void *x_lp, const float *acts, const float *dy, int B,
                                int t0, int n, float *dx, const lm_mla_params *g, float *scratch);
/* head_max [H] (host) = each head's largest scaled logit over the whole
 * sequence after lm_mla_cp_forward_lp (each rank's segment maxima,
 * all-gathered over lm_comm_host(comm) and reduced in rank order: the same
 * bits on every rank). Collective. */
lm_status lm_mla_cp_head_max_lp(lm_comm *comm, const lm_mla_config *cfg, float *acts, int B, int t0, int n,
                                float *head_max);

#ifdef __cplusplus
}
#endif
#endif
