/* KDA state maps: the core of context parallelism (docs/scaleout.md; SPEC §9).
 *
 * A chunk of the KDA recurrence maps its incoming state affinely,
 *   S_out = P S_in + Q,   P = Diag(e^{G_C}) - (K o e^{G_C - G})^T W   [K,K]
 *                         Q = (K o e^{G_C - G})^T U                   [K,V]
 * with G, W, U the chunked form's cumulative gate and WY/UT products (SPEC
 * §2). The map of a segment of several chunks is the composition of its
 * chunks' maps, so a sequence split into segments (one per rank) runs as:
 * every segment computes its map from its own tokens (no state needed), the
 * maps are applied in segment order to the initial state (a scan), and each
 * segment runs the chunked forward from its true initial state.
 *
 * Shapes (row-major, fp32; n_pairs = B * H, one map per sequence and head):
 *   P [B,H,K,K], Q [B,H,K,V], states [B,H,K,V]. All fp32, like the state. */
#ifndef LONGMOE_KDA_STATE_MAP_H
#define LONGMOE_KDA_STATE_MAP_H

#include "longmoe/comm.h"
#include "longmoe/kda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of scratch lm_kda_state_map uses for this config (0 if invalid); it
 * takes cfg->workspace when at least this large, else allocates per call. */
size_t lm_kda_state_map_workspace_bytes(const lm_kda_config *cfg);

/* The map of the whole segment in `in` (cfg->T tokens; in->h0 is ignored):
 * the final state of lm_kda_chunk_forward from any initial state S equals
 * P S + Q, to rounding. */
lm_status lm_kda_state_map(const lm_kda_config *cfg, const lm_kda_inputs *in, float *P, float *Q);

/* D [B,H,K,V]: the gradient of the segment's incoming state given only its
 * outputs' gradient d_o [B,T,H,V] (the outgoing state's gradient zero). With
 * the map, the incoming state's gradient for any outgoing one is
 * dS_in = P^T dS_out + D. Equals lm_kda_chunk_backward's dh0 with dht NULL
 * (the same steps), independent of in->h0; costs about the map's pass.
 * Allocates its per-thread scratch. */
lm_status lm_kda_state_map_dgrad(const lm_kda_config *cfg, const lm_kda_inputs *in, const float *d_o, float *D);

/* The map of `first` followed by `second`: P = P2 P1, Q = P2 Q1 + Q2.
 * The outputs must not overlap the inputs. */
lm_status lm_kda_state_map_compose(int n_pairs, int K, int V, const float *P1, const float *Q1, const float *P2,
                                   const float *Q2, float *P, float *Q);

/* S_out = P S_in + Q (S_in NULL: zero, so S_out = Q). S_out must not overlap S_in. */
lm_status lm_kda_state_map_apply(int n_pairs, int K, int V, const float *P, const float *Q, const float *S_in,
                                 float *S_out);

/* The backward's step: dS_in = P^T dS_out + D (dS_out NULL: zero, so dS_in =
 * D), with P [K,K] and D, dS_out, dS_in [K,V] per pair. dS_in must not
 * overlap dS_out. */
lm_status lm_kda_state_map_apply_transposed(int n_pairs, int K, int V, const float *P, const float *D,
                                            const float *dS_out, float *dS_in);

/* ---- across ranks: rank r holds segment r of every sequence ----
 * Given this rank's segment map (P, Q), gathers every rank's map and applies
 * them in rank order to h0 (the whole sequence's initial state; NULL: zero;
 * rank 0's value is used): S_in [B,H,K,V] receives this rank's true initial
 * state and S_final (may be NULL) the final state of the whole sequence,
 * bit-identical on every rank. Collective. `workspace` holds at least
 * lm_kda_cp_workspace_bytes(size, n_pairs, K, V) bytes. */
size_t lm_kda_cp_workspace_bytes(int comm_size, int n_pairs, int K, int V);
lm_status lm_kda_cp_initial_state(lm_comm *comm, int n_pairs, int K, int V, const float *P, const float *Q,
                                  const float *h0, float *S_in, float *S_final, void *workspace,
                                  size_t workspace_bytes);

/* ---- the KDA operator under context parallelism ----
 * Rank r holds tokens [t0_r, t0_r + cfg->T) of every sequence, the ranks'
 * segments in rank order (any lengths >= 1; not multiples of the chunk).
 * `in` is this rank's segment; in->h0 is the whole sequence's initial state
 * (rank 0's value is used; NULL: zero).
 *
 * Forward: o [B,T,H,V] of the segment; S_in (may be NULL) receives the state
 * entering the segment (keep it for the backward); ht (may be NULL) the final
 * state of the whole sequence, bit-identical on every rank. Collective.
 *
 * Backward given d_o of the segment and dht (the gradient of the whole
 * sequence's final state; rank 0's value is used; NULL: zero): the reverse
 * scan of the state gradient. Each rank computes its segment's map P and D,
 * the gradient of its incoming state that its own outputs give; the ranks'
 * (P, D) are all-gathered and every rank runs, last segment first,
 *   dS_out(R-1) = dht,  dS_in(p) = P_p^T dS_out(p) + D_p,  dS_out(p-1) = dS_in(p),
 * then the chunked backward of its segment from S_in with final-state
 * gradient dS_out(me). ACCUMULATES (+=) into grads like lm_kda_chunk_backward:
 * dq, dk, dv, dz, dbeta of the segment; dA_log, ddt_bias this rank's part
 * (their sum over the ranks is the whole sequence's gradient); dh0 (may be
 * NULL) the whole gradient of h0, bit-identical on every rank. S_in is the
 * forward's (NULL: recomputed, which costs the forward's scan). Cost: the
 * map, D (lm_kda_state_map_dgrad) and one backward of the segment. */
lm_status lm_kda_cp_forward(lm_comm *comm, const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                            float *S_in, float *ht);
lm_status lm_kda_cp_backward(lm_comm *comm, const lm_kda_config *cfg, const lm_kda_inputs *in, const float *S_in,
                             const float *d_o, const float *dht, lm_kda_grads *grads);

#ifdef __cplusplus
}
#endif
#endif
