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
#include "longmoe/kda_layer_context_parallel.h"
#include "longmoe/kda_state_map.h"
#include "test_kda_cp.h"

static lm_comm *comm;
static double test_worst_cp;

/* max |a - b| / max |b|: relative to the largest value (cp_max_rel adds 1 to the denominator) */
static double rel_to_max(const float *a, const float *b, size_t n) {
    double m = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        double d = fabs((double)a[i] - b[i]);
        if (d > m) m = d;
        if (fabs(b[i]) > s) s = fabs(b[i]);
    }
    return m / (s > 1e-30 ? s : 1e-30);
}

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

/* The operator under context parallelism, forward and backward: a sequence
 * of odd length cut unevenly (rank r holds 37 r + 5 tokens, more than one
 * chunk for the later ranks, a partial chunk for every rank); outputs, the
 * final state and every gradient equal the whole sequence on this rank alone. */
static void run_cp_operator(lm_kda_gate gate, int chunk, uint64_t seed) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    int T = 0, t0 = 0;
    for (int r = 0; r < R; r++) {
        if (r == me) t0 = T;
        T += 37 * r + 5;
    }
    const int n = 37 * me + 5, B = 2, H = 2, K = 16, V = 24;
    const char *gname = gate == LM_KDA_GATE_BOUNDED ? "bounded" : "softplus";
    cp_problem p;
    cp_problem_make(&p, B, T, H, K, V, seed);
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
    cfg.gate = gate;
    cfg.chunk = chunk;
    const size_t nq = (size_t)B * T * H, ns = (size_t)B * H * K * V;
    lm_rng rng;
    lm_rng_seed(&rng, seed + 1000);
    float *d_o = malloc(nq * V * 4), *dht = malloc(ns * 4);
    cp_fill_normal(&rng, d_o, nq * V, 1.0);
    cp_fill_normal(&rng, dht, ns, 1.0);
    /* the reference: the whole sequence here */
    lm_kda_inputs whole = {p.q, p.k, p.v, p.z, p.beta, p.A_log, p.dt_bias, p.h0};
    float *o_ref = malloc(nq * V * 4), *ht_ref = malloc(ns * 4);
    CHECK(lm_kda_chunk_forward(&cfg, &whole, o_ref, ht_ref) == LM_OK, "%s", lm_last_error());
    float *gref = calloc(3 * nq * K + nq * V + nq + (size_t)H * (K + 1) + ns, 4);
    lm_kda_grads G = {gref, gref + nq * K, gref + 2 * nq * K, gref + 2 * nq * K + nq * V,
                      gref + 3 * nq * K + nq * V, gref + 3 * nq * K + nq * V + nq,
                      gref + 3 * nq * K + nq * V + nq + H, gref + 3 * nq * K + nq * V + nq + H + (size_t)H * K};
    CHECK(lm_kda_chunk_backward(&cfg, &whole, d_o, dht, &G) == LM_OK, "%s", lm_last_error());
    /* this rank's segment */
    lm_kda_inputs seg = cp_segment(&p, t0, t0 + n);
    seg.h0 = me == 0 ? p.h0 : NULL; /* only rank 0's h0 is read */
    lm_kda_config sc = cfg;
    sc.T = n;
    const size_t mq = (size_t)B * n * H;
    float *o = malloc(mq * V * 4), *S_in = malloc(ns * 4), *ht = malloc(ns * 4);
    CHECK(lm_kda_cp_forward(comm, &sc, &seg, o, S_in, ht) == LM_OK, "%s", lm_last_error());
    float *o_want = cp_slice(o_ref, B, T, H, V, t0, t0 + n);
    double eo = rel_to_max(o, o_want, mq * V), eh = rel_to_max(ht, ht_ref, ns);
    CHECK(eo < 1e-5 && eh < 1e-5, "%s chunk %d rank %d: outputs differ by %.3g, final state by %.3g", gname, chunk,
          me, eo, eh);
    float *d_o_seg = cp_slice(d_o, B, T, H, V, t0, t0 + n);
    float *g = calloc(3 * mq * K + mq * V + mq + (size_t)H * (K + 1) + ns, 4);
    lm_kda_grads S = {g, g + mq * K, g + 2 * mq * K, g + 2 * mq * K + mq * V, g + 3 * mq * K + mq * V,
                      g + 3 * mq * K + mq * V + mq, g + 3 * mq * K + mq * V + mq + H,
                      g + 3 * mq * K + mq * V + mq + H + (size_t)H * K};
    /* with the saved S_in, and once more recomputing it: the same bits */
    CHECK(lm_kda_cp_backward(comm, &sc, &seg, S_in, d_o_seg, me == 0 ? dht : NULL, &S) == LM_OK, "%s",
          lm_last_error());
    const size_t ng = 3 * mq * K + mq * V + mq + (size_t)H * (K + 1) + ns;
    float *g2 = calloc(ng, 4);
    lm_kda_grads S2 = {g2, g2 + mq * K, g2 + 2 * mq * K, g2 + 2 * mq * K + mq * V, g2 + 3 * mq * K + mq * V,
                       g2 + 3 * mq * K + mq * V + mq, g2 + 3 * mq * K + mq * V + mq + H,
                       g2 + 3 * mq * K + mq * V + mq + H + (size_t)H * K};
    CHECK(lm_kda_cp_backward(comm, &sc, &seg, NULL, d_o_seg, me == 0 ? dht : NULL, &S2) == LM_OK, "%s",
          lm_last_error());
    CHECK(!memcmp(g, g2, ng * 4), "%s rank %d: the backward with S_in recomputed differs", gname, me);
    /* token gradients: this rank's rows of the whole sequence's */
    struct { const char *name; const float *got, *whole; int X; } rows[] = {
        {"dq", S.dq, G.dq, K}, {"dk", S.dk, G.dk, K}, {"dv", S.dv, G.dv, V}, {"dz", S.dz, G.dz, K},
        {"dbeta", S.dbeta, G.dbeta, 1}};
    for (int i = 0; i < 5; i++) {
        float *want = cp_slice(rows[i].whole, B, T, H, rows[i].X, t0, t0 + n);
        double e = rel_to_max(rows[i].got, want, mq * rows[i].X);
        CHECK(e < 1e-5, "%s chunk %d rank %d: %s differs from the whole sequence's by %.3g", gname, chunk, me,
              rows[i].name, e);
        if (e > test_worst_cp) test_worst_cp = e;
        free(want);
    }
    /* dh0: the whole value, bit-identical on every rank */
    double e0 = rel_to_max(S.dh0, G.dh0, ns);
    CHECK(e0 < 1e-5, "%s chunk %d rank %d: dh0 differs by %.3g", gname, chunk, me, e0);
    float *all = malloc(ns * 4 * (size_t)R);
    CHECK(lm_comm_all_gather(comm, S.dh0, all, ns * 4) == LM_OK, "%s", lm_last_error());
    for (int r = 1; r < R; r++) CHECK(!memcmp(all, all + (size_t)r * ns, ns * 4), "rank %d's dh0 differs", r);
    /* the parameters: the ranks' parts sum to the whole sequence's */
    const size_t npar = (size_t)H * (K + 1);
    float *sum = malloc(npar * 4);
    CHECK(lm_comm_all_reduce_sum(comm, S.dA_log, sum, npar, LM_DTYPE_F32) == LM_OK, "%s", lm_last_error());
    double ea = rel_to_max(sum, G.dA_log, (size_t)H), et = rel_to_max(sum + H, G.ddt_bias, (size_t)H * K);
    double ep = ea > et ? ea : et;
    CHECK(ea < 1e-5 && et < 1e-5, "%s chunk %d: summed over ranks, dA_log differs by %.3g, ddt_bias by %.3g", gname,
          chunk, ea, et);
    if (ep > test_worst_cp) test_worst_cp = ep;
    if (e0 > test_worst_cp) test_worst_cp = e0;
    /* the gradient reaches the earlier ranks through the scan: the segment's
     * outputs alone do not give its gradient (dht or later outputs matter) */
    if (me < R - 1) {
        float *solo = calloc(ng, 4);
        lm_kda_grads L = {solo, solo + mq * K, solo + 2 * mq * K, solo + 2 * mq * K + mq * V,
                          solo + 3 * mq * K + mq * V, solo + 3 * mq * K + mq * V + mq,
                          solo + 3 * mq * K + mq * V + mq + H, NULL};
        lm_kda_inputs s0 = seg;
        s0.h0 = S_in;
        CHECK(lm_kda_chunk_backward(&sc, &s0, d_o_seg, NULL, &L) == LM_OK, "%s", lm_last_error());
        double ed = rel_to_max(solo + mq * K, S.dk, mq * K);
        CHECK(ed > 1e-3, "rank %d: dk without the later segments differs only by %.3g", me, ed);
        free(solo);
    }
    free(sum), free(all), free(g), free(g2), free(d_o_seg), free(o_want), free(o), free(S_in), free(ht);
    cp_segment_free(&seg);
    free(gref), free(o_ref), free(ht_ref), free(d_o), free(dht);
    cp_problem_free(&p);
}

static void test_cp_operator_forward_and_backward_equal_the_whole_sequence(void) {
    test_worst_cp = 0;
    run_cp_operator(LM_KDA_GATE_BOUNDED, 16, 201);
    run_cp_operator(LM_KDA_GATE_BOUNDED, 64, 202);
    run_cp_operator(LM_KDA_GATE_SOFTPLUS, 32, 203);
    printf("  worst gradient difference (relative to the largest): %.3g\n", test_worst_cp);
}

/* The layer: rank r holds 23 r + 2 tokens (the first segment shorter than
 * the convolution's halo, so rank 1's halo spans rank 0 and the sequence
 * start); y, dx against the whole sequence's rows, every parameter gradient
 * summed over the ranks against the whole sequence's. */
/* lm_kda_layer_cp_forward_lp / _backward_lp on the CPU backend */
static void run_cp_layer(lm_kda_gate gate, uint64_t seed) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    int T = 0, t0 = 0;
    for (int r = 0; r < R; r++) {
        if (r == me) t0 = T;
        T += 23 * r + 2;
    }
    const int n = 23 * me + 2, B = 2, D = 20;
    const char *gname = gate == LM_KDA_GATE_BOUNDED ? "bounded" : "softplus";
    lm_kda_layer_config c = {D, 2, 8, 4, 16, gate, -5.0f, 1e-6f, NULL, 0, NULL};
    lm_tensor_spec specs[LM_KDA_LAYER_NPARAMS];
    const size_t np = lm_kda_layer_specs(&c, specs);
    float *params = malloc(np * 4), *gw = calloc(np, 4), *gc = calloc(np, 4), *gsum = malloc(np * 4);
    lm_rng rng;
    lm_rng_seed(&rng, seed);
    size_t off = 0;
    for (int s = 0; s < LM_KDA_LAYER_NPARAMS; s++) {
        size_t m = (size_t)(specs[s].rows * specs[s].cols);
        for (size_t i = 0; i < m; i++)
            params[off + i] = specs[s].init_value +
                              (specs[s].role == LM_ROLE_MATRIX ? 0.3f : 0.3f) * (float)lm_rng_normal(&rng);
        off += m;
    }
    lm_kda_layer_params p, g, G;
    lm_kda_layer_params_map(&c, params, &p);
    lm_kda_layer_params_map(&c, gc, &g);
    lm_kda_layer_params_map(&c, gw, &G);
    const size_t nx = (size_t)B * T * D;
    float *x = malloc(nx * 4), *dy = malloc(nx * 4), *y = malloc(nx * 4), *dx = calloc(nx, 4);
    cp_fill_normal(&rng, x, nx, 1.0);
    cp_fill_normal(&rng, dy, nx, 1.0);
    /* the whole sequence here */
    float *acts = malloc(lm_kda_layer_act_floats(&c, B, T) * 4), *scr = malloc(lm_kda_layer_scratch_floats(&c, B, T) * 4);
    lm_kda_layer_acts a;
    lm_kda_layer_acts_map(&c, B, T, acts, &a);
    CHECK(lm_kda_layer_forward(&c, &p, &a, x, B, T, y) == LM_OK, "%s", lm_last_error());
    CHECK(lm_kda_layer_backward(&c, &p, &G, &a, x, dy, B, T, dx, scr) == LM_OK, "%s", lm_last_error());
    /* this rank's segment */
    float *xs = cp_slice(x, B, T, 1, D, t0, t0 + n), *dys = cp_slice(dy, B, T, 1, D, t0, t0 + n);
    float *ys = malloc((size_t)B * n * D * 4), *dxs = calloc((size_t)B * n * D, 4);
    const size_t na = lm_kda_layer_cp_lp_act_floats(&c, B, n), ns = lm_kda_layer_cp_lp_scratch_floats(&c, R, B, n);
    float *cacts = malloc(na * 4), *cscr = malloc(ns * 4);
    CHECK(lm_kda_layer_cp_lp_acts_init(&c, B, n, cacts) == LM_OK, "%s", lm_last_error());
    CHECK(lm_kda_layer_cp_forward_lp(comm, &c, &p, &p, xs, B, t0, n, ys, cacts, cscr) == LM_OK, "%s", lm_last_error());
    CHECK(lm_kda_layer_cp_backward_lp(comm, &c, &p, &p, &g, xs, cacts, dys, B, t0, n, dxs, cscr) == LM_OK, "%s",
          lm_last_error());
    float *yw = cp_slice(y, B, T, 1, D, t0, t0 + n), *dxw = cp_slice(dx, B, T, 1, D, t0, t0 + n);
    double ey = rel_to_max(ys, yw, (size_t)B * n * D), ex = rel_to_max(dxs, dxw, (size_t)B * n * D);
    CHECK(ey < 1e-5 && ex < 1e-5, "%s layer rank %d: y differs by %.3g, dx by %.3g", gname, me, ey, ex);
    if (ey > test_worst_cp) test_worst_cp = ey;
    if (ex > test_worst_cp) test_worst_cp = ex;
    CHECK(lm_comm_all_reduce_sum(comm, gc, gsum, np, LM_DTYPE_F32) == LM_OK, "%s", lm_last_error());
    off = 0;
    for (int s = 0; s < LM_KDA_LAYER_NPARAMS; s++) {
        size_t m = (size_t)(specs[s].rows * specs[s].cols);
        double e = rel_to_max(gsum + off, gw + off, m);
        CHECK(e < 1e-5, "%s layer: d%s summed over %d ranks differs by %.3g", gname, specs[s].name, R, e);
        if (e > test_worst_cp) test_worst_cp = e;
        off += m;
    }
    free(params), free(gw), free(gc), free(gsum), free(x), free(dy), free(y), free(dx), free(acts), free(scr);
    free(xs), free(dys), free(ys), free(dxs), free(cacts), free(cscr), free(yw), free(dxw);
}

static void test_cp_layer_equals_the_whole_sequence(void) {
    test_worst_cp = 0;
    run_cp_layer(LM_KDA_GATE_BOUNDED, 401);
    run_cp_layer(LM_KDA_GATE_SOFTPLUS, 402);
    printf("  worst difference (relative to the largest): %.3g\n", test_worst_cp);
}

static void test_context_parallel_bounded_gate_equals_the_whole_sequence(void) {
    run_context_parallel(LM_KDA_GATE_BOUNDED, 64, 101);
    run_context_parallel(LM_KDA_GATE_BOUNDED, 16, 102);
}

static void test_context_parallel_softplus_gate_equals_the_whole_sequence(void) {
    run_context_parallel(LM_KDA_GATE_SOFTPLUS, 32, 103);
}

static void test_bad_arguments_are_rejected(void) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    cp_problem p;
    cp_problem_make(&p, 1, 4, 1, 4, 4, 77);
    lm_kda_config cfg = lm_kda_config_default(1, 4, 1, 4, 4);
    cfg.chunk = 16;
    lm_kda_inputs in = {p.q, p.k, p.v, p.z, p.beta, p.A_log, p.dt_bias, NULL};
    float o[64], g[64] = {0};
    lm_kda_grads G = {g, g, g, g, g, g, g, NULL};
    CHECK(lm_kda_cp_forward(NULL, &cfg, &in, o, NULL, NULL) == LM_ERR_ARG && strstr(lm_last_error(), "comm"), "%s",
          lm_last_error());
    CHECK(lm_kda_cp_forward(comm, &cfg, &in, NULL, NULL, NULL) == LM_ERR_ARG && strstr(lm_last_error(), "o is NULL"),
          "%s", lm_last_error());
    CHECK(lm_kda_cp_backward(comm, &cfg, &in, NULL, NULL, NULL, &G) == LM_ERR_ARG && strstr(lm_last_error(), "d_o"),
          "%s", lm_last_error());
    p.beta[1] = 1.5f; /* out of [0, 1]: the operator's own check, before any collective */
    CHECK(lm_kda_cp_forward(comm, &cfg, &in, o, NULL, NULL) == LM_ERR_ARG, "beta 1.5 accepted");
    /* one rank refuses: every rank returns, none waits in the scan */
    p.beta[1] = me == R - 1 ? 1.5f : 0.5f;
    lm_status st0 = lm_kda_cp_forward(comm, &cfg, &in, o, NULL, NULL);
    CHECK(st0 == LM_ERR_ARG && (me == R - 1 || strstr(lm_last_error(), "refused")), "rank %d: %s", me,
          lm_last_error());
    p.beta[1] = 0.5f;
    st0 = lm_kda_cp_backward(comm, &cfg, &in, NULL, o, NULL, me == 0 ? NULL : &G);
    CHECK(st0 == LM_ERR_ARG && (me == 0 || strstr(lm_last_error(), "rank 0 refused")), "rank %d: %s", me,
          lm_last_error());
    cp_problem_free(&p);
    /* the layer: a gap before the first segment, refused on every rank */
    lm_kda_layer_config c = {8, 1, 4, 4, 16, LM_KDA_GATE_BOUNDED, -5.0f, 1e-6f, NULL, 0, NULL};
    size_t np = lm_kda_layer_specs(&c, NULL);
    float *params = calloc(np, 4), x[64] = {0}, y[64];
    lm_kda_layer_params lp;
    lm_kda_layer_params_map(&c, params, &lp);
    float *acts = malloc(lm_kda_layer_cp_lp_act_floats(&c, 1, 2) * 4);
    float *scr = malloc(lm_kda_layer_cp_lp_scratch_floats(&c, R, 1, 2) * 4);
    lm_status st = lm_kda_layer_cp_forward_lp(comm, &c, &lp, &lp, x, 1, 2 * me + 1, 2, y, acts, scr);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), "rank order"), "%s", lm_last_error());
    /* one rank without its outputs: every rank returns */
    st = lm_kda_layer_cp_forward_lp(comm, &c, &lp, &lp, x, 1, 2 * me, 2, me == R - 1 ? NULL : y, acts, scr);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), me == R - 1 ? "y is NULL" : "refused"), "rank %d: %s", me,
          lm_last_error());
    c.conv_width = 0;
    CHECK(lm_kda_layer_cp_forward_lp(comm, &c, &lp, &lp, x, 1, 2 * me, 2, y, acts, scr) == LM_ERR_ARG,
          "conv_width 0 accepted");
    free(params), free(acts), free(scr);
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
    RUN(test_cp_operator_forward_and_backward_equal_the_whole_sequence);
    RUN(test_cp_layer_equals_the_whole_sequence);
    RUN(test_bad_arguments_are_rejected);
    RUN(test_workspace_too_small_is_rejected);
    if (comm) {
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(comm);
    }
    return test_summary();
}
