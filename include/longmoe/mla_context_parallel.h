/* The gated attention layer (MLA or GQA) under context parallelism
 * (docs/scaleout.md "MLA context parallelism"; SPEC §9): one sequence split
 * across ranks.
 *
 * Rank r holds tokens [t0_r, t0_r + n_r) of every sequence (x [B,n_r,d]); the
 * segments follow rank order without gaps (t0_0 = 0, t0_{r+1} = t0_r + n_r,
 * every n_r >= 1, the same B on every rank; checked, collectively). The
 * token-local parts of the layer run on the rank's own tokens; each rank
 * receives what the earlier ranks' tokens contribute to the keys and values
 * (MLA: the latent c and, with RoPE, the rotary key; GQA: the keys and
 * values, RoPE at the global positions) and attends its queries to positions
 * 0 .. t0 + n - 1 with the causal mask by global position
 * (attention_forward_offset). The backward returns those rows' gradients to
 * their owners, each owner adding them in rank order (deterministic).
 *
 * Outputs: y and dx of the rank's segment. The parameter gradients in g
 * ACCUMULATE this rank's part: their sum over the ranks is the whole
 * sequence's gradient (the data-parallel reduction sums it). */
#ifndef LONGMOE_MLA_CONTEXT_PARALLEL_H
#define LONGMOE_MLA_CONTEXT_PARALLEL_H

#include <stddef.h>

#include "longmoe/comm.h"
#include "longmoe/mla.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The layer on the backend of cfg (CPU or CUDA; cfg->backend NULL: the CPU)
 * through its own segment functions (lm_mla_forward_seg, _backward_seg,
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
