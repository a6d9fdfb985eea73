/* Context parallelism for KDA across ranks (SPEC §9; docs/scaleout.md):
 * rank r holds segment r of every sequence and its segment's state map
 * (lm_kda_state_map). The maps are gathered and applied in rank order to the
 * initial state, so each rank learns the state entering its segment. Every
 * rank applies the same maps in the same order: the states (and the final
 * state of the whole sequence) are bit-identical on every rank. */
#include <string.h>

#include "check.h"
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
