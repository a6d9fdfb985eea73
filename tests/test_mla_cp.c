/* The MLA layer under context parallelism (src/comm/mla_context_parallel.c;
 * docs/scaleout.md) and the attention core's offset queries it runs on.
 *
 * Under mpirun (`test_mla_cp --mpi N`, ctest's test_mla_cp_mpi2/4): a
 * sequence of odd length cut unevenly over the ranks; every rank's outputs
 * and input gradients equal its rows of the whole sequence run on one rank,
 * and the parameter gradients summed over the ranks equal the whole
 * sequence's (fp32, 1e-5 relative to the largest value). Alone: the same with
 * the one-rank engine. Built without MPI, `--mpi N` reports every case
 * skipped. */
#include <string.h>

#include "longmoe/attention.h"
#include "longmoe/comm.h"
#include "longmoe/mla_context_parallel.h"
#include "test.h"

static lm_comm *comm;
static double worst;

static float *rand_floats(lm_rng *r, size_t n, double sd) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)(sd * lm_rng_normal(r));
    return x;
}

/* rows [t0, t0+n) of x [B,T,X] into a new [B,n,X] */
static float *slice(const float *x, int B, int T, size_t X, int t0, int n) {
    float *y = malloc((size_t)B * n * X * sizeof(float) + 4);
    for (int b = 0; b < B; b++) memcpy(y + (size_t)b * n * X, x + ((size_t)b * T + t0) * X, (size_t)n * X * 4);
    return y;
}

/* max |a - b| / max(1e-30, max |b|) */
static double max_rel(const float *a, const float *b, size_t n) {
    double m = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        double d = fabs((double)a[i] - b[i]);
        if (d > m) m = d;
        if (fabs(b[i]) > s) s = fabs(b[i]);
    }
    return m / (s > 1e-30 ? s : 1e-30);
}

static void note(double e) {
    if (e > worst) worst = e;
}

/* ---- the attention core with offset queries (no ranks needed) ---- */

static void run_offset_core(int T, int off, int H, int Hkv, uint64_t seed) {
    lm_rng r;
    lm_rng_seed(&r, seed);
    const int B = 2, Dk = 12, Dv = 10, n = T - off;
    float *q = rand_floats(&r, (size_t)B * T * H * Dk, 1.0), *k = rand_floats(&r, (size_t)B * T * Hkv * Dk, 1.0);
    float *v = rand_floats(&r, (size_t)B * T * Hkv * Dv, 1.0), *d_o = rand_floats(&r, (size_t)B * T * H * Dv, 1.0);
    /* the whole: only the last n queries carry an output gradient */
    for (int b = 0; b < B; b++) memset(d_o + (size_t)b * T * H * Dv, 0, (size_t)off * H * Dv * 4);
    lm_attention_config wc = lm_attention_config_default(B, T, H, Hkv, Dk, Dv);
    float *o = malloc((size_t)B * T * H * Dv * 4), *lse = malloc((size_t)B * H * T * 4);
    float *dq = calloc((size_t)B * T * H * Dk, 4), *dk = calloc((size_t)B * T * Hkv * Dk, 4);
    float *dv = calloc((size_t)B * T * Hkv * Dv, 4);
    CHECK(lm_attention_forward(&wc, q, k, v, o, lse) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attention_backward(&wc, q, k, v, o, lse, d_o, dq, dk, dv) == LM_OK, "%s", lm_last_error());
    /* the offset: queries [off, T) against every key */
    lm_attention_config oc = lm_attention_config_default(B, n, H, Hkv, Dk, Dv);
    float *qs = slice(q, B, T, (size_t)H * Dk, off, n), *dos = slice(d_o, B, T, (size_t)H * Dv, off, n);
    float *os = malloc((size_t)B * n * H * Dv * 4), *lses = malloc((size_t)B * H * n * 4);
    float *dqs = calloc((size_t)B * n * H * Dk, 4), *dks = calloc((size_t)B * T * Hkv * Dk, 4);
    float *dvs = calloc((size_t)B * T * Hkv * Dv, 4);
    float *rms = malloc((size_t)B * H * n * 4), *rmw = malloc((size_t)B * H * T * 4);
    CHECK(lm_attention_forward_rowmax(&wc, q, k, v, o, lse, rmw) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attention_forward_offset(&oc, off, qs, k, v, os, lses, rms) == LM_OK, "%s", lm_last_error());
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            CHECK(!memcmp(rms + ((size_t)b * H + h) * n, rmw + ((size_t)b * H + h) * T + off, (size_t)n * 4),
                  "T %d offset %d: rowmax differs", T, off);
    free(rms), free(rmw);
    CHECK(lm_attention_backward_offset(&oc, off, qs, k, v, os, lses, dos, dqs, dks, dvs) == LM_OK, "%s",
          lm_last_error());
    float *ow = slice(o, B, T, (size_t)H * Dv, off, n), *dqw = slice(dq, B, T, (size_t)H * Dk, off, n);
    /* o and dq of a query row see the same tiles in the same order: the same bits */
    CHECK(!memcmp(os, ow, (size_t)B * n * H * Dv * 4), "T %d offset %d: o differs from the whole's rows", T, off);
    CHECK(!memcmp(dqs, dqw, (size_t)B * n * H * Dk * 4), "T %d offset %d: dq differs", T, off);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            CHECK(!memcmp(lses + ((size_t)b * H + h) * n, lse + ((size_t)b * H + h) * T + off, (size_t)n * 4),
                  "T %d offset %d: lse differs", T, off);
    double ek = max_rel(dks, dk, (size_t)B * T * Hkv * Dk), ev = max_rel(dvs, dv, (size_t)B * T * Hkv * Dv);
    CHECK(ek < 1e-5 && ev < 1e-5, "T %d offset %d: dk differs by %.3g, dv by %.3g", T, off, ek, ev);
    note(ek), note(ev);
    free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv), free(qs), free(dos);
    free(os), free(lses), free(dqs), free(dks), free(dvs), free(ow), free(dqw);
}

static void test_attention_offset_queries_equal_the_whole_rows(void) {
    run_offset_core(150, 70, 2, 2, 11);  /* neither end on a tile boundary */
    run_offset_core(150, 3, 4, 2, 12);   /* grouped heads */
    run_offset_core(131, 128, 2, 1, 13); /* three queries, keys over three tiles */
    run_offset_core(70, 0, 2, 2, 14);    /* no offset: the plain call */
    lm_attention_config oc = lm_attention_config_default(1, 4, 1, 1, 2, 2);
    float x[64] = {0};
    CHECK(lm_attention_forward_offset(&oc, -1, x, x, x, x, x, NULL) == LM_ERR_ARG && strstr(lm_last_error(), "q_offset"),
          "%s", lm_last_error());
}

/* ---- the MLA layer over the ranks ---- */

/* lm_mla_cp_forward_lp / _backward_lp on the CPU backend */
static void run_layer(lm_mla_config c, const char *name, uint64_t seed) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    /* rank r holds 29 r + 37 tokens: odd totals, later ranks crossing attention tiles */
    int T = 0, t0 = 0;
    for (int s = 0; s < R; s++) {
        if (s == me) t0 = T;
        T += 29 * s + 37;
    }
    const int n = 29 * me + 37, B = 2, d = c.d_model;
    lm_rng r;
    lm_rng_seed(&r, seed); /* the same seed: every rank holds the same sequences and weights */
    const size_t np = lm_mla_param_count(&c);
    float *pmem = malloc(np * 4);
    lm_mla_params p, g, gw;
    CHECK(lm_mla_params_map(&c, pmem, &p) == LM_OK, "%s", lm_last_error());
    lm_mla_params_init(&c, &p, &r);
    for (int i = 0; i < c.q_lora; i++) p.q_norm[i] = (float)(1 + 0.3 * lm_rng_normal(&r));
    for (int i = 0; i < c.kv_lora; i++) p.kv_norm[i] = (float)(1 + 0.3 * lm_rng_normal(&r));
    float *x = rand_floats(&r, (size_t)B * T * d, 1.0), *dy = rand_floats(&r, (size_t)B * T * d, 1.0);
    /* the whole sequence here */
    float *y = malloc((size_t)B * T * d * 4), *acts = malloc(lm_mla_acts_floats(&c, B, T) * 4);
    float *scr = malloc(lm_mla_scratch_floats(&c, B, T) * 4), *dx = calloc((size_t)B * T * d, 4);
    float *gwmem = calloc(np, 4);
    CHECK(lm_mla_params_map(&c, gwmem, &gw) == LM_OK, "%s", lm_last_error());
    CHECK(lm_mla_forward(&c, &p, x, B, T, y, acts) == LM_OK, "%s", lm_last_error());
    CHECK(lm_mla_backward(&c, &p, x, acts, dy, B, T, dx, &gw, scr) == LM_OK, "%s", lm_last_error());
    /* this rank's segment */
    float *xs = slice(x, B, T, d, t0, n), *dys = slice(dy, B, T, d, t0, n);
    float *ys = malloc((size_t)B * n * d * 4), *dxs = calloc((size_t)B * n * d, 4);
    const size_t na = lm_mla_cp_lp_acts_floats(&c, B, t0, n), ns = lm_mla_cp_lp_scratch_floats(&c, R, B, t0, n);
    CHECK(na && ns, "%s: zero sizes", name);
    float *cacts = malloc(na * 4), *cscr = malloc(ns * 4), *gmem = calloc(np, 4), *gsum = malloc(np * 4);
    CHECK(lm_mla_params_map(&c, gmem, &g) == LM_OK, "%s", lm_last_error());
    CHECK(lm_mla_cp_forward_lp(comm, &c, &p, &p, xs, B, t0, n, ys, cacts, cscr) == LM_OK, "%s", lm_last_error());
    CHECK(lm_mla_cp_backward_lp(comm, &c, &p, &p, xs, cacts, dys, B, t0, n, dxs, &g, cscr) == LM_OK, "%s",
          lm_last_error());
    float *yw = slice(y, B, T, d, t0, n), *dxw = slice(dx, B, T, d, t0, n);
    double ey = max_rel(ys, yw, (size_t)B * n * d), ex = max_rel(dxs, dxw, (size_t)B * n * d);
    CHECK(ey < 1e-5, "%s rank %d: y differs from the whole sequence's by %.3g", name, me, ey);
    CHECK(ex < 1e-5, "%s rank %d: dx differs from the whole sequence's by %.3g", name, me, ex);
    note(ey), note(ex);
    /* the QK-Clip maxima over the whole sequence */
    float smax_w[16], smax[16], smax_all[64];
    CHECK(c.n_heads <= 16 && R <= 4, "test sizes");
    CHECK(lm_mla_max_logits(&c, acts, B, T, smax_w) == LM_OK, "%s", lm_last_error());
    CHECK(lm_mla_cp_head_max_lp(comm, &c, cacts, B, t0, n, smax) == LM_OK, "%s", lm_last_error());
    double em = max_rel(smax, smax_w, (size_t)c.n_heads);
    CHECK(em < 1e-5, "%s: the max logits differ from the whole sequence's by %.3g", name, em);
    note(em);
    CHECK(lm_comm_all_gather(comm, smax, smax_all, (size_t)c.n_heads * 4) == LM_OK, "%s", lm_last_error());
    for (int s = 1; s < R; s++)
        CHECK(!memcmp(smax_all, smax_all + (size_t)s * c.n_heads, (size_t)c.n_heads * 4),
              "rank %d's max logits differ", s);
    /* every parameter's gradient, summed over the ranks */
    CHECK(lm_comm_all_reduce_sum(comm, gmem, gsum, np, LM_DTYPE_F32) == LM_OK, "%s", lm_last_error());
    /* in the order lm_mla_params_map lays them out */
    const struct { const char *n; const float *got, *want; } prm[] = {
        {"W_dq", g.W_dq, gw.W_dq}, {"q_norm", g.q_norm, gw.q_norm}, {"W_uq", g.W_uq, gw.W_uq},
        {"W_dkv", g.W_dkv, gw.W_dkv}, {"kv_norm", g.kv_norm, gw.kv_norm}, {"W_uk", g.W_uk, gw.W_uk},
        {"W_uv", g.W_uv, gw.W_uv}, {"W_kr", g.W_kr, gw.W_kr}, {"W_q", g.W_q, gw.W_q}, {"W_k", g.W_k, gw.W_k},
        {"W_v", g.W_v, gw.W_v}, {"W_g", g.W_g, gw.W_g}, {"W_o", g.W_o, gw.W_o}};
    const int NP = (int)(sizeof prm / sizeof prm[0]);
    const float *ends[16];
    int np_ = 0;
    for (int i = 0; i < NP; i++)
        if (prm[i].got) ends[np_++] = prm[i].got;
    ends[np_] = gmem + np;
    for (int i = 0, j = 0; i < NP; i++) {
        if (!prm[i].got) continue;
        const size_t o = (size_t)(prm[i].got - gmem), len = (size_t)(ends[j + 1] - prm[i].got);
        double e = max_rel(gsum + o, prm[i].want, len);
        CHECK(e < 1e-5, "%s: d%s summed over %d ranks differs from the whole sequence's by %.3g", name, prm[i].n, R,
              e);
        note(e);
        j++;
    }
    /* the summed gradients are the same bits on every rank */
    float *all = malloc(np * 4 * (size_t)R);
    CHECK(lm_comm_all_gather(comm, gsum, all, np * 4) == LM_OK, "%s", lm_last_error());
    for (int s = 1; s < R; s++) CHECK(!memcmp(all, all + (size_t)s * np, np * 4), "rank %d's sum differs", s);
    free(all), free(yw), free(dxw), free(cacts), free(cscr), free(gmem), free(gsum), free(xs), free(dys), free(ys);
    free(dxs), free(y), free(acts), free(scr), free(dx), free(gwmem), free(x), free(dy), free(pmem);
}

static void test_mla_layer_nope_equals_the_whole_sequence(void) {
    run_layer(lm_mla_config_mla(24, 3, 16, 12, 20, 14), "MLA NoPE", 301);
}

static void test_mla_layer_rope_equals_the_whole_sequence(void) {
    lm_mla_config c = lm_mla_config_mla(20, 2, 12, 10, 16, 9);
    c.rope_dims = 4;
    c.scale = 0.4f;
    run_layer(c, "MLA RoPE(4) scale 0.4", 302);
}

static void test_gqa_layer_equals_the_whole_sequence(void) {
    run_layer(lm_mla_config_gqa(24, 4, 2, 10, 8), "GQA NoPE", 303);
    lm_mla_config c = lm_mla_config_gqa(20, 3, 1, 12, 6);
    c.rope_dims = 6;
    run_layer(c, "GQA RoPE(6)", 304);
}

static void test_bad_segments_are_rejected(void) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    lm_mla_config c = lm_mla_config_mla(8, 1, 4, 4, 4, 4);
    const size_t np = lm_mla_param_count(&c);
    float *pmem = calloc(np, 4);
    lm_mla_params p;
    CHECK(lm_mla_params_map(&c, pmem, &p) == LM_OK, "%s", lm_last_error());
    float x[64] = {0}, y[64];
    const size_t na = lm_mla_cp_lp_acts_floats(&c, 1, 2 * R, 2), ns = lm_mla_cp_lp_scratch_floats(&c, R, 1, 2 * R, 2);
    float *acts = malloc(na * 4), *scr = malloc(ns * 4);
    /* a gap before the first segment: every rank holds [2 me + 1, 2 me + 3) */
    lm_status st = lm_mla_cp_forward_lp(comm, &c, &p, &p, x, 1, 2 * me + 1, 2, y, acts, scr);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), "rank order"), "%s", lm_last_error());
    /* one rank refuses (no output): every rank returns */
    st = lm_mla_cp_forward_lp(comm, &c, &p, &p, x, 1, 2 * me, 2, me == R - 1 ? NULL : y, acts, scr);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), me == R - 1 ? "y is NULL" : "refused"), "rank %d: %s", me,
          lm_last_error());
    /* GQA parameters missing (an MLA block mapped) */
    lm_mla_config gqa = lm_mla_config_gqa(8, 2, 1, 4, 4);
    st = lm_mla_cp_forward_lp(comm, &gqa, &p, &p, x, 1, 2 * me, 2, y, acts, scr);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), "parameter"), "%s", lm_last_error());
    free(scr);
    free(acts), free(pmem);
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
    RUN(test_attention_offset_queries_equal_the_whole_rows);
    RUN(test_mla_layer_nope_equals_the_whole_sequence);
    RUN(test_mla_layer_rope_equals_the_whole_sequence);
    RUN(test_gqa_layer_equals_the_whole_sequence);
    RUN(test_bad_segments_are_rejected);
    if (comm) {
        printf("  worst difference from the whole sequence (relative to the largest): %.3g\n", worst);
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(comm);
    }
    return test_summary();
}
