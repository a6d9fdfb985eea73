/* The KDA token mixer under context parallelism (docs/scaleout.md "The KDA
 * layer"; SPEC §9): one sequence split across ranks.
 *
 * Rank r holds tokens [t0_r, t0_r + n_r) of every sequence (x [B,n_r,d]); the
 * segments follow rank order without gaps (checked, collectively). The layer
 * is include/longmoe/kda_layer.h's: the projections, gates and output are
 * token-local; the short convolution reads the W-1 projections before the
 * segment (its halo, all-gathered from the earlier ranks; zero before the
 * sequence start, so a halo may span several short segments), and its gradient
 * goes back to their owners, each adding the later ranks' parts in rank order;
 * the operator's state crosses the ranks as the segments' affine maps (the
 * algorithm of lm_kda_cp_forward / lm_kda_cp_backward, kda_state_map.h).
 *
 * Outputs: y and dx of the segment; the parameter gradients in g ACCUMULATE
 * this rank's part (their sum over the ranks is the whole sequence's). */
#ifndef LONGMOE_KDA_LAYER_CONTEXT_PARALLEL_H
#define LONGMOE_KDA_LAYER_CONTEXT_PARALLEL_H

#include <stddef.h>

#include "longmoe/comm.h"
#include "longmoe/kda_layer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The layer on the backend of c (CPU or CUDA; c->backend NULL: the CPU),
 * through its own segment functions (lm_kda_layer_forward_seg /
 * _backward_seg, include/longmoe/kda_layer.h): x_lp in the product format,
 * p_lp the parameters in it, every buffer (y, dy, dx, g, acts, scratch) in
 * the backend's memory, and `comm` an engine working on that memory (MPI for
 * the CPU; NCCL or the staged engine for a GPU, its stream the backend's).
 * Forward: each rank's last W-1 projections are all-gathered for the later
 * ranks' halos; each rank but the last runs its segment from a zero state
 * (the outputs of rank 0; the map's Q of the others) and the operator once
 * more from the identity with zero values (the map's P); the maps are
 * all-gathered and applied in rank order; ranks after the first run the
 * segment again from their incoming state. Backward: each rank after the
 * first takes its dy back as far as the operator for D, the gradient of its
 * incoming state from its own outputs; the maps [P | D] are all-gathered and
 * scanned last first for the gradient of the outgoing state; one backward of
 * the segment with dy and that gradient; the halo's gradient all-gathered,
 * each owner adding the later ranks' parts of its last rows in rank order and
 * taking them through the q, k, v projections. Costs against the one-rank
 * layer: up to two forwards of the segment, one backward and a partial one
 * (the output's and the operator's). Outputs: y and dx (required) of the
 * segment; g ACCUMULATES this rank's part. acts and scratch hold the floats
 * below (acts initialised once by lm_kda_layer_cp_lp_acts_init); scratch is
 * free between the calls. */
size_t lm_kda_layer_cp_lp_act_floats(const lm_kda_layer_config *c, int B, int n);
/* Writes the constant part of acts (the identity the map's run starts from):
 * once, before the first forward on these acts (not collective). */
lm_status lm_kda_layer_cp_lp_acts_init(const lm_kda_layer_config *c, int B, int n, float *acts);
size_t lm_kda_layer_cp_lp_scratch_floats(const lm_kda_layer_config *c, int comm_size, int B, int n);
lm_status lm_kda_layer_cp_forward_lp(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                     const lm_kda_layer_params *p_lp, const void *x_lp, int B, int t0, int n, float *y,
                                     float *acts, float *scratch);
lm_status lm_kda_layer_cp_backward_lp(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                      const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g, const void *x_lp,
                                      const float *acts, const float *dy, int B, int t0, int n, float *dx,
                                      float *scratch);

#ifdef __cplusplus
}
#endif
#endif
