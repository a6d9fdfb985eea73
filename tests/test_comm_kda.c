/* KDA context parallelism over ranks (SPEC §9; docs/scaleout.md): each rank
 * holds one segment of the sequences, computes its segment's state map, the
 * maps are scanned through the communication layer, and each rank runs its
 * segment from its true initial state.
 *
 * Under mpirun (`test_comm_kda --mpi N`, ctest's test_comm_kda_mpi2/4): every
 * rank's outputs equal its rows of the whole sequence run on one rank, and
 * the final state equals the whole sequence's, bit-identical on every rank.
 * Alone: the same with the one-rank engine. Built without MPI, `--mpi N`
 * reports every case skipped. */
#include "longmoe/kda_state_map.h"
#include "test_kda_cp.h"

static lm_comm *comm;

static void run_context_parallel(lm_kda_gate gate, int chunk, uint64_t seed) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int B = 2, T = 53 * R + 11, H = 2, K = 32, V = 16;
    cp_problem p;
    cp_problem_make(&p, B, T, H, K, V, seed); /* the same seed: every rank holds the same sequences */
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
    cfg.gate = gate;
    cfg.chunk = chunk;
    const size_t no = (size_t)B * T * H * V, ns = (size_t)B * H * K * V, nk = (size_t)B * H * K * K;
    /* the reference: the whole sequence on this rank alone */
    lm_kda_inputs whole = {p.q, p.k, p.v, p.z, p.beta, p.A_log, p.dt_bias, p.h0};
    float *o_ref = malloc(no * 4), *ht_ref = malloc(ns * 4);
    CHECK(lm_kda_chunk_forward(&cfg, &whole, o_ref, ht_ref) == LM_OK, "%s", lm_last_error());
    /* this rank's segment: uneven cuts, the last rank the longest */
    const int t0 = 53 * me, t1 = me == R - 1 ? T : 53 * (me + 1);
    lm_kda_inputs seg = cp_segment(&p, t0, t1);
    lm_kda_config sc = cfg;
    sc.T = t1 - t0;
    float *P = malloc(nk * 4), *Q = malloc(ns * 4), *S_in = malloc(ns * 4), *S_final = malloc(ns * 4);
    CHECK(lm_kda_state_map(&sc, &seg, P, Q) == LM_OK, "%s", lm_last_error());
    size_t wb = lm_kda_cp_workspace_bytes(R, B * H, K, V);
    void *ws = malloc(wb);
    CHECK(lm_kda_cp_initial_state(comm, B * H, K, V, P, Q, me == 0 ? p.h0 : NULL, S_in, S_final, ws, wb) == LM_OK,
          "%s", lm_last_error());
    seg.h0 = S_in;
    float *o = malloc((size_t)B * sc.T * H * V * 4), *ht = malloc(ns * 4);
    CHECK(lm_kda_chunk_forward(&sc, &seg, o, ht) == LM_OK, "%s", lm_last_error());
    float *o_want = cp_slice(o_ref, B, T, H, V, t0, t1);
    const char *g = gate == LM_KDA_GATE_BOUNDED ? "bounded" : "softplus";
    double eo = cp_max_rel(o, o_want, (size_t)B * sc.T * H * V), ef = cp_max_rel(S_final, ht_ref, ns);
    CHECK(eo < 2e-5, "%s chunk %d rank %d: outputs differ from the whole sequence by %.3g", g, chunk, me, eo);
    CHECK(ef < 2e-5, "%s chunk %d: final state differs by %.3g", g, chunk, ef);
    if (me == R - 1) {
        double el = cp_max_rel(ht, ht_ref, ns);
        CHECK(el < 2e-5, "%s chunk %d: the last segment's state differs by %.3g", g, chunk, el);
    }
    if (me == 0) CHECK(!memcmp(S_in, p.h0, ns * 4), "rank 0 does not start from h0");
    /* the final state's bits agree on every rank */
    float *all = malloc(ns * 4 * (size_t)R);
    CHECK(lm_comm_all_gather(comm, S_final, all, ns * 4) == LM_OK, "%s", lm_last_error());
    for (int r = 1; r < R; r++) CHECK(!memcmp(all, all + (size_t)r * ns, ns * 4), "rank %d's final state differs", r);
    free(all), free(o), free(ht), free(o_want), free(P), free(Q), free(S_in), free(S_final), free(ws);
    cp_segment_free(&seg);
    free(o_ref), free(ht_ref);
    cp_problem_free(&p);
}

static void test_context_parallel_bounded_gate_equals_the_whole_sequence(void) {
    run_context_parallel(LM_KDA_GATE_BOUNDED, 64, 101);
    run_context_parallel(LM_KDA_GATE_BOUNDED, 16, 102);
}

static void test_context_parallel_softplus_gate_equals_the_whole_sequence(void) {
    run_context_parallel(LM_KDA_GATE_SOFTPLUS, 32, 103);
}

static void test_workspace_too_small_is_rejected(void) {
    float x[8] = {0};
    CHECK(lm_kda_cp_initial_state(comm, 1, 1, 1, x, x, NULL, x + 4, NULL, x, 4) == LM_ERR_ARG &&
              strstr(lm_last_error(), "workspace"),
          "%s", lm_last_error());
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    lm_comm_engine engine = want_ranks ? LM_COMM_MPI : LM_COMM_SELF;
    if (!lm_comm_engine_available(engine)) test_skip_all("built without MPI (the MPI engine is not compiled)");
    else if (lm_comm_open(engine, &comm)) {
        fprintf(stderr, "cannot open the %s engine: %s\n", lm_comm_engine_name(engine), lm_last_error());
        return 1;
    } else if (want_ranks && lm_comm_size(comm) != want_ranks) {
        fprintf(stderr, "started on %d ranks, expected %d\n", lm_comm_size(comm), want_ranks);
        lm_comm_close(comm);
        return 1;
    }
    if (comm && lm_comm_rank(comm)) freopen("/dev/null", "w", stdout);
    RUN(test_context_parallel_bounded_gate_equals_the_whole_sequence);
    RUN(test_context_parallel_softplus_gate_equals_the_whole_sequence);
    RUN(test_workspace_too_small_is_rejected);
    if (comm) {
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(comm);
    }
    return test_summary();
}
