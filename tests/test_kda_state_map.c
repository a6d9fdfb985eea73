/* KDA state maps (include/longmoe/kda_state_map.h; SPEC §9): the core of
 * context parallelism, proved on one process. */
#include "longmoe/kda_state_map.h"
#include "test_kda_cp.h"

/* Split [0, T) at `cuts` (n_seg - 1 increasing cut points), compute each
 * segment's map from its own tokens, scan the maps from h0, run every
 * segment from its scanned initial state: outputs and final state must equal
 * the whole sequence's. Also the composition of all maps applied to h0. */
static void check_split(lm_kda_gate gate, int chunk, const int *cuts, int n_seg, uint64_t seed) {
    const int B = 2, T = 229, H = 2, K = 32, V = 24;
    cp_problem p;
    cp_problem_make(&p, B, T, H, K, V, seed);
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
    cfg.gate = gate;
    cfg.chunk = chunk;
    lm_kda_inputs whole = {p.q, p.k, p.v, p.z, p.beta, p.A_log, p.dt_bias, p.h0};
    const size_t no = (size_t)B * T * H * V, ns = (size_t)B * H * K * V, nk = (size_t)B * H * K * K;
    float *o_ref = malloc(no * 4), *ht_ref = malloc(ns * 4);
    CHECK(lm_kda_chunk_forward(&cfg, &whole, o_ref, ht_ref) == LM_OK, "%s", lm_last_error());
    float *S = malloc(ns * 4), *S2 = malloc(ns * 4), *Pm = malloc(nk * 4), *Qm = malloc(ns * 4);
    float *Pacc = malloc(nk * 4), *Qacc = malloc(ns * 4), *Pt = malloc(nk * 4), *Qt = malloc(ns * 4);
    memcpy(S, p.h0, ns * 4);
    double worst_o = 0, worst_s = 0;
    for (int s = 0; s < n_seg; s++) {
        int t0 = s ? cuts[s - 1] : 0, t1 = s < n_seg - 1 ? cuts[s] : T;
        lm_kda_inputs seg = cp_segment(&p, t0, t1);
        lm_kda_config sc = cfg;
        sc.T = t1 - t0;
        CHECK(lm_kda_state_map(&sc, &seg, Pm, Qm) == LM_OK, "%s", lm_last_error());
        /* this segment from its true initial state */
        seg.h0 = S;
        float *o = malloc((size_t)B * sc.T * H * V * 4), *ht = malloc(ns * 4);
        CHECK(lm_kda_chunk_forward(&sc, &seg, o, ht) == LM_OK, "%s", lm_last_error());
        float *o_want = cp_slice(o_ref, B, T, H, V, t0, t1);
        double eo = cp_max_rel(o, o_want, (size_t)B * sc.T * H * V);
        if (eo > worst_o) worst_o = eo;
        /* the map carries the state across the segment as the forward does */
        CHECK(lm_kda_state_map_apply(B * H, K, V, Pm, Qm, S, S2) == LM_OK, "%s", lm_last_error());
        double es = cp_max_rel(S2, ht, ns);
        if (es > worst_s) worst_s = es;
        memcpy(S, S2, ns * 4);
        /* running composition of the maps: acc = map_s o acc */
        if (!s) {
            memcpy(Pacc, Pm, nk * 4);
            memcpy(Qacc, Qm, ns * 4);
        } else {
            CHECK(lm_kda_state_map_compose(B * H, K, V, Pacc, Qacc, Pm, Qm, Pt, Qt) == LM_OK, "%s", lm_last_error());
            memcpy(Pacc, Pt, nk * 4);
            memcpy(Qacc, Qt, ns * 4);
        }
        free(o);
        free(ht);
        free(o_want);
        cp_segment_free(&seg);
    }
    double e_final = cp_max_rel(S, ht_ref, ns);
    CHECK(lm_kda_state_map_apply(B * H, K, V, Pacc, Qacc, p.h0, S2) == LM_OK, "%s", lm_last_error());
    double e_comp = cp_max_rel(S2, ht_ref, ns);
    const char *g = gate == LM_KDA_GATE_BOUNDED ? "bounded" : "softplus";
    /* the initial state must matter, or the test proves nothing: the whole
     * sequence's map keeps a part of h0 a thousand times the tolerance */
    double pmax = 0;
    for (size_t i = 0; i < nk; i++) pmax = fabs(Pacc[i]) > pmax ? fabs(Pacc[i]) : pmax;
    CHECK(pmax > 0.02, "%s: the initial state is forgotten (max |P| = %.3g)", g, pmax);
    CHECK(worst_o < 2e-5, "%s chunk %d, %d segments: outputs differ by %.3g", g, chunk, n_seg, worst_o);
    CHECK(worst_s < 2e-5, "%s chunk %d: a segment's map differs from its forward by %.3g", g, chunk, worst_s);
    CHECK(e_final < 2e-5, "%s chunk %d, %d segments: scanned final state differs by %.3g", g, chunk, n_seg, e_final);
    CHECK(e_comp < 2e-5, "%s chunk %d, %d segments: composed map differs by %.3g", g, chunk, n_seg, e_comp);
    free(o_ref), free(ht_ref), free(S), free(S2), free(Pm), free(Qm), free(Pacc), free(Qacc), free(Pt), free(Qt);
    cp_problem_free(&p);
}

static void test_segments_from_scanned_states_equal_the_whole_sequence_bounded_gate(void) {
    const int two[] = {128}, three[] = {64, 100}, four[] = {5, 64, 150};
    check_split(LM_KDA_GATE_BOUNDED, 64, two, 2, 11);
    check_split(LM_KDA_GATE_BOUNDED, 64, three, 3, 12);
    check_split(LM_KDA_GATE_BOUNDED, 32, four, 4, 13);
    check_split(LM_KDA_GATE_BOUNDED, 16, three, 3, 14);
}

static void test_segments_from_scanned_states_equal_the_whole_sequence_softplus_gate(void) {
    const int two[] = {117}, three[] = {64, 100}, four[] = {1, 64, 228};
    check_split(LM_KDA_GATE_SOFTPLUS, 64, two, 2, 21);
    check_split(LM_KDA_GATE_SOFTPLUS, 64, three, 3, 22);
    check_split(LM_KDA_GATE_SOFTPLUS, 32, four, 4, 23);
}

static void test_the_map_is_affine_in_the_initial_state(void) {
    /* two random initial states and their mean: P (a+b)/2 + Q is the mean of
     * the forward's final states, so the map's linear part is P, not a fit */
    const int B = 1, T = 70, H = 3, K = 16, V = 16;
    cp_problem p;
    cp_problem_make(&p, B, T, H, K, V, 31);
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
    const size_t ns = (size_t)B * H * K * V, nk = (size_t)B * H * K * K;
    float *P = malloc(nk * 4), *Q = malloc(ns * 4), *S = malloc(ns * 4), *ht = malloc(ns * 4), *o = malloc((size_t)B * T * H * V * 4);
    lm_kda_inputs in = {p.q, p.k, p.v, p.z, p.beta, p.A_log, p.dt_bias, NULL};
    CHECK(lm_kda_state_map(&cfg, &in, P, Q) == LM_OK, "%s", lm_last_error());
    /* zero initial state: the final state is Q */
    CHECK(lm_kda_chunk_forward(&cfg, &in, o, ht) == LM_OK, "%s", lm_last_error());
    CHECK(cp_max_rel(Q, ht, ns) < 1e-5, "zero state: Q differs from the final state by %.3g", cp_max_rel(Q, ht, ns));
    /* the identity's columns: state e_d e_c^T gives P[:, d] e_c^T + Q */
    lm_rng r;
    lm_rng_seed(&r, 32);
    for (int trial = 0; trial < 3; trial++) {
        int d = (int)(lm_rng_u64(&r) % K);
        float *h0 = calloc(ns, 4);
        for (int pr = 0; pr < B * H; pr++)
            for (int c = 0; c < V; c++) h0[(size_t)pr * K * V + (size_t)d * V + c] = 1.0f;
        in.h0 = h0;
        CHECK(lm_kda_chunk_forward(&cfg, &in, o, ht) == LM_OK, "%s", lm_last_error());
        CHECK(lm_kda_state_map_apply(B * H, K, V, P, Q, h0, S) == LM_OK, "%s", lm_last_error());
        CHECK(cp_max_rel(S, ht, ns) < 1e-5, "state row %d: %.3g", d, cp_max_rel(S, ht, ns));
        free(h0);
    }
    free(P), free(Q), free(S), free(ht), free(o);
    cp_problem_free(&p);
}

/* D, the incoming state's gradient from the outputs alone, is the chunked
 * backward's dh0 with no final-state gradient, whatever the initial state;
 * and with the map it gives dh0 for any final-state gradient: P^T dht + D. */
static void check_dgrad(lm_kda_gate gate, int chunk, int T, uint64_t seed) {
    const int B = 2, H = 2, K = 16, V = 24;
    cp_problem p;
    cp_problem_make(&p, B, T, H, K, V, seed);
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
    cfg.gate = gate;
    cfg.chunk = chunk;
    const size_t nq = (size_t)B * T * H, ns = (size_t)B * H * K * V, nk = (size_t)B * H * K * K;
    lm_rng r;
    lm_rng_seed(&r, seed + 7);
    float *d_o = malloc(nq * V * 4), *dht = malloc(ns * 4);
    cp_fill_normal(&r, d_o, nq * V, 1.0);
    cp_fill_normal(&r, dht, ns, 1.0);
    lm_kda_inputs in = {p.q, p.k, p.v, p.z, p.beta, p.A_log, p.dt_bias, p.h0};
    float *g = calloc(3 * nq * K + nq * V + nq + (size_t)H * (K + 1), 4), *dh0 = calloc(ns, 4);
    lm_kda_grads G = {g, g + nq * K, g + 2 * nq * K, g + 2 * nq * K + nq * V, g + 3 * nq * K + nq * V,
                      g + 3 * nq * K + nq * V + nq, g + 3 * nq * K + nq * V + nq + H, dh0};
    CHECK(lm_kda_chunk_backward(&cfg, &in, d_o, NULL, &G) == LM_OK, "%s", lm_last_error());
    float *D = malloc(ns * 4), *P = malloc(nk * 4), *Q = malloc(ns * 4), *want = calloc(ns, 4);
    in.h0 = NULL; /* D does not read the initial state */
    CHECK(lm_kda_state_map_dgrad(&cfg, &in, d_o, D) == LM_OK, "%s", lm_last_error());
    const char *gn = gate == LM_KDA_GATE_BOUNDED ? "bounded" : "softplus";
    CHECK(!memcmp(D, dh0, ns * 4), "%s chunk %d T %d: D differs from the backward's dh0 by %.3g", gn, chunk, T,
          cp_max_rel(D, dh0, ns));
    /* dh0 with a final-state gradient: P^T dht + D */
    memset(g, 0, (3 * nq * K + nq * V + nq + (size_t)H * (K + 1)) * 4);
    memset(dh0, 0, ns * 4);
    in.h0 = p.h0;
    CHECK(lm_kda_chunk_backward(&cfg, &in, d_o, dht, &G) == LM_OK, "%s", lm_last_error());
    CHECK(lm_kda_state_map(&cfg, &in, P, Q) == LM_OK, "%s", lm_last_error());
    for (int pr = 0; pr < B * H; pr++)
        for (int i = 0; i < K; i++)
            for (int j = 0; j < K; j++)
                for (int c = 0; c < V; c++)
                    want[((size_t)pr * K + j) * V + c] += P[((size_t)pr * K + i) * K + j] * dht[((size_t)pr * K + i) * V + c];
    for (size_t i = 0; i < ns; i++) want[i] += D[i];
    double e = cp_max_rel(want, dh0, ns);
    CHECK(e < 1e-5, "%s chunk %d T %d: P^T dht + D differs from dh0 by %.3g", gn, chunk, T, e);
    free(d_o), free(dht), free(g), free(dh0), free(D), free(P), free(Q), free(want);
    cp_problem_free(&p);
}

static void test_dgrad_is_the_backward_initial_state_gradient(void) {
    check_dgrad(LM_KDA_GATE_BOUNDED, 16, 53, 51);
    check_dgrad(LM_KDA_GATE_BOUNDED, 64, 129, 52);
    check_dgrad(LM_KDA_GATE_SOFTPLUS, 32, 77, 53);
    check_dgrad(LM_KDA_GATE_SOFTPLUS, 16, 1, 54);
}

static void test_bad_arguments_are_rejected(void) {
    float x[16] = {0}, y[16];
    CHECK(lm_kda_state_map_compose(1, 2, 2, x, x, x, x, x, y) == LM_ERR_ARG, "aliased output accepted");
    CHECK(lm_kda_state_map_apply(1, 0, 2, x, x, NULL, y) == LM_ERR_ARG && strstr(lm_last_error(), "K"), "%s",
          lm_last_error());
    CHECK(lm_kda_state_map_apply(1, 2, 2, x, x, y, y) == LM_ERR_ARG, "S_out == S_in accepted");
    lm_kda_config cfg = lm_kda_config_default(1, 4, 1, 2, 2);
    lm_kda_inputs in = {0};
    CHECK(lm_kda_state_map(&cfg, &in, x, y) == LM_ERR_ARG, "NULL inputs accepted");
}

int main(void) {
    RUN(test_segments_from_scanned_states_equal_the_whole_sequence_bounded_gate);
    RUN(test_segments_from_scanned_states_equal_the_whole_sequence_softplus_gate);
    RUN(test_the_map_is_affine_in_the_initial_state);
    RUN(test_dgrad_is_the_backward_initial_state_gradient);
    RUN(test_bad_arguments_are_rejected);
    return test_summary();
}
