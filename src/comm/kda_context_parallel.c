/* Context parallelism for KDA across ranks (SPEC §9; docs/scaleout.md):
 * rank r holds segment r of every sequence and its segment's state map
 * (lm_kda_state_map). The maps are gathered and applied in rank order to the
 * initial state, so each rank learns the state entering its segment. Every
 * rank applies the same maps in the same order: the states (and the final
 * state of the whole sequence) are bit-identical on every rank. */
#include <string.h>

#include "check.h"
#include "cp_internal.h"
#include "longmoe/kda_state_map.h"

/* floats of one rank's packed map [P | Q] */
static size_t map_floats(int n_pairs, int K, int V) { return (size_t)n_pairs * K * ((size_t)K + V); }

size_t lm_kda_cp_workspace_bytes(int comm_size, int n_pairs, int K, int V) {
    if (comm_size < 1 || n_pairs < 1 || K < 1 || V < 1) return 0;
    /* own packed map, every rank's packed maps, two states */
    return ((size_t)(comm_size + 1) * map_floats(n_pairs, K, V) + 2 * (size_t)n_pairs * K * V) * sizeof(float);
}

lm_status lm_kda_cp_initial_state(lm_comm *comm, int n_pairs, int K, int V, const float *P, const float *Q,
                                  const float *h0, float *S_in, float *S_final, void *workspace,
                                  size_t workspace_bytes) {
    const char *what = "kda context parallel";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    if (!P || !Q || !S_in) return lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !P ? "P" : !Q ? "Q" : "S_in");
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const size_t need = lm_kda_cp_workspace_bytes(R, n_pairs, K, V);
    if (!need) return lm_error(LM_ERR_ARG, "%s: n_pairs %d, K %d, V %d must be positive", what, n_pairs, K, V);
    if (!workspace || workspace_bytes < need)
        return lm_error(LM_ERR_ARG, "%s: workspace of %zu bytes, %zu needed", what, workspace_bytes, need);
    const size_t nm = map_floats(n_pairs, K, V), nk = (size_t)n_pairs * K * K, ns = (size_t)n_pairs * K * V;
    float *own = workspace, *all = own + nm, *A = all + (size_t)R * nm, *Bst = A + ns;
    memcpy(own, P, nk * sizeof(float));
    memcpy(own + nk, Q, ns * sizeof(float));
    TRY(lm_comm_all_gather(comm, own, all, nm * sizeof(float)));
    /* the initial state: rank 0's h0 (or zero) */
    int32_t has_h0 = h0 != NULL;
    TRY(lm_comm_broadcast(comm, &has_h0, sizeof has_h0, 0));
    if (has_h0) {
        if (me == 0) memcpy(A, h0, ns * sizeof(float));
        TRY(lm_comm_broadcast(comm, A, ns * sizeof(float), 0));
    } else {
        memset(A, 0, ns * sizeof(float));
    }
    /* scan: the state entering segment p is map_{p-1}( ... map_0(h0)) */
    for (int p = 0; p < R; p++) {
        if (p == me) memcpy(S_in, A, ns * sizeof(float));
        const float *mp = all + (size_t)p * nm;
        TRY(lm_kda_state_map_apply(n_pairs, K, V, mp, mp + nk, A, Bst));
        float *t = A;
        A = Bst;
        Bst = t;
    }
    if (S_final) memcpy(S_final, A, ns * sizeof(float));
    return LM_OK;
}

/* ---------------------------------------------------------------- the operator */

#include <stdlib.h>

static lm_status cp_check(lm_comm *comm, const lm_kda_config *cfg, const lm_kda_inputs *in, const char *what) {
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    if (!cfg || !in) return lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !cfg ? "config" : "inputs");
    return LM_OK;
}

/* The state entering this rank's segment (and the whole final state) given
 * scratch of nk + ns floats for the map and `ws` for the scan. */
static lm_status cp_scan_forward(lm_comm *comm, const lm_kda_config *cfg, const lm_kda_inputs *in, float *P,
                                 float *Q, float *S_in, float *ht, void *ws, size_t wb) {
    lm_kda_inputs seg = *in;
    seg.h0 = NULL;
    TRY(lm_kda_state_map(cfg, &seg, P, Q));
    return lm_kda_cp_initial_state(comm, cfg->B * cfg->H, cfg->K, cfg->V, P, Q, in->h0, S_in, ht, ws, wb);
}

lm_status lm_kda_cp_forward(lm_comm *comm, const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                            float *S_in, float *ht) {
    const char *what = "kda context parallel forward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = cp_check(comm, cfg, in, what);
    if (!local && !o) local = lm_error(LM_ERR_ARG, "%s: o is NULL", what);
    if (!local) local = lm_kda_check(cfg, in);
    TRY(lm_cp_agree(comm, local, what)); /* every rank refuses together: none waits in the scan */
    const int np = cfg->B * cfg->H, K = cfg->K, V = cfg->V;
    const size_t nk = (size_t)np * K * K, ns = (size_t)np * K * V;
    const size_t wb = lm_kda_cp_workspace_bytes(lm_comm_size(comm), np, K, V);
    float *buf;
    LM_TRY_ALLOC(buf, (nk + 2 * ns) * sizeof(float) + wb);
    float *P = buf, *Q = P + nk, *S = Q + ns;
    lm_status st = cp_scan_forward(comm, cfg, in, P, Q, S, ht, S + ns, wb);
    if (!st) {
        lm_kda_inputs seg = *in;
        seg.h0 = S;
        st = lm_kda_chunk_forward(cfg, &seg, o, NULL);
    }
    if (!st && S_in) memcpy(S_in, S, ns * sizeof(float));
    free(buf);
    return st;
}

lm_status lm_kda_cp_backward(lm_comm *comm, const lm_kda_config *cfg, const lm_kda_inputs *in, const float *S_in,
                             const float *d_o, const float *dht, lm_kda_grads *grads) {
    const char *what = "kda context parallel backward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = cp_check(comm, cfg, in, what);
    if (!local && (!d_o || !grads)) local = lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !d_o ? "d_o" : "grads");
    if (!local && (!grads->dq || !grads->dk || !grads->dv || !grads->dz || !grads->dbeta || !grads->dA_log ||
                   !grads->ddt_bias))
        local = lm_error(LM_ERR_ARG, "%s: a gradient other than dh0 is NULL", what);
    if (!local) local = lm_kda_check(cfg, in);
    TRY(lm_cp_agree(comm, local, what));
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int np = cfg->B * cfg->H, K = cfg->K, V = cfg->V;
    const size_t nk = (size_t)np * K * K, ns = (size_t)np * K * V, nm = nk + ns;
    const size_t wb = lm_kda_cp_workspace_bytes(R, np, K, V);
    /* map [P | D] own and gathered, Q, S, two gradient states, the forward scan's workspace */
    float *buf;
    LM_TRY_ALLOC(buf, ((size_t)(R + 1) * nm + 4 * ns) * sizeof(float) + (S_in ? 0 : wb));
    float *own = buf, *all = own + nm, *Q = all + (size_t)R * nm, *S = Q + ns, *gA = S + ns, *gB = gA + ns;
    float *ws = gB + ns;
    lm_status st = LM_OK;
    lm_kda_inputs seg = *in;
    seg.h0 = NULL;
    /* this segment's P, and S_in when not given */
    if (S_in) {
        st = lm_kda_state_map(cfg, &seg, own, Q);
        memcpy(S, S_in, ns * sizeof(float));
    } else {
        st = cp_scan_forward(comm, cfg, in, own, Q, S, NULL, ws, wb);
    }
    /* D: the incoming state's gradient from this segment's outputs alone */
    if (!st) st = lm_kda_state_map_dgrad(cfg, &seg, d_o, own + nk);
    if (!st) st = lm_comm_all_gather(comm, own, all, nm * sizeof(float));
    /* dht: rank 0's value (or zero) */
    int32_t has = dht != NULL;
    if (!st) st = lm_comm_broadcast(comm, &has, sizeof has, 0);
    if (!st) {
        if (has) {
            if (me == 0) memcpy(gA, dht, ns * sizeof(float));
            st = lm_comm_broadcast(comm, gA, ns * sizeof(float), 0);
        } else {
            memset(gA, 0, ns * sizeof(float));
        }
    }
    /* the reverse scan, identical on every rank; dS_out of this rank into Q */
    if (!st) {
        float *g = gA, *h = gB;
        for (int p = R - 1; p >= 0; p--) {
            const float *mp = all + (size_t)p * nm;
            if (p == me) memcpy(Q, g, ns * sizeof(float));
            st = lm_kda_state_map_apply_transposed(np, K, V, mp, mp + nk, g, h);
            if (st) break;
            float *t = g;
            g = h;
            h = t;
        }
        if (!st && grads->dh0)
            for (size_t i = 0; i < ns; i++) grads->dh0[i] += g[i];
    }
    /* the segment's backward from its true state and outgoing-state gradient */
    if (!st) {
        lm_kda_grads mine = *grads;
        mine.dh0 = NULL;
        seg.h0 = S;
        st = lm_kda_chunk_backward(cfg, &seg, d_o, Q, &mine);
    }
    free(buf);
    return st;
}
