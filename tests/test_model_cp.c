/* The whole model under context parallelism (lm_model_set_context_parallel;
 * docs/scaleout.md "Context parallelism in the model").
 *
 * A 4-layer model with KDA and attention (MLA with RoPE, or GQA) token
 * mixers, a dense FFN and MoE layers, Block AttnRes; B = 2 rows of an odd
 * number of tokens, each row cut the same uneven way over the ranks (on 4
 * ranks one segment is shorter than the short convolution's halo). The loss
 * summed over the ranks' tokens and every parameter gradient summed over the
 * ranks (each rank's backward scaled by its share of the tokens) equal the
 * whole sequence's on one process within 1e-5 relative to the largest value,
 * with and without recompute (plus 3e-6 of the model's largest gradient, for
 * a per-head sum with heavy cancellation: check_tensors); so do the QK-Clip
 * maxima. The same model
 * without context parallelism gives other gradients (the check can fail); a
 * bad token, or a NaN router score inside the forward, on one rank fails the
 * forward on every rank, none waiting.
 *
 * Under mpirun (`test_model_cp --mpi N`, ctest's test_model_cp_mpi2/4) one
 * segment a rank; alone, the one-rank engine. Built without MPI, `--mpi N`
 * reports every case skipped. */
#include <string.h>

#include "longmoe/comm.h"
#include "longmoe/model.h"
#include "test.h"

static lm_comm *comm;
static double worst;

enum { B = 2, T_TOTAL = 41 };

/* this rank's segment of every row: uneven, one shorter than the halo on 4 ranks */
static void segment(int R, int me, int *t0, int *n) {
    static const int one[] = {41}, two[] = {17, 24}, four[] = {7, 2, 19, 13};
    const int *len = R == 1 ? one : R == 2 ? two : four;
    *t0 = 0;
    for (int r = 0; r < me; r++) *t0 += len[r];
    *n = len[me];
}

static lm_config cp_config(lm_attn_kind attn, int recompute) {
    lm_config c;
    lm_config_defaults(&c);
    c.vocab_size = 23;
    c.d_model = 16;
    c.n_layers = 4;
    strcpy(c.layout, "kmkm");
    c.first_k_dense = 1;
    c.dense_ffn = 20;
    c.kda_heads = 2;
    c.kda_head_dim = 8;
    c.kda_chunk = 16;
    c.kda_conv_width = 4;
    c.attn_kind = attn;
    c.attn_heads = 4;
    c.attn_kv_heads = 2;
    c.q_lora_rank = 12;
    c.kv_lora_rank = 10;
    c.qk_head_dim = 8;
    c.v_head_dim = 6;
    c.rope_dims = 4;
    c.n_routed_experts = 4;
    c.top_k = 2;
    c.n_shared_experts = 1;
    c.expert_ffn = 8;
    c.shared_ffn = 8;
    c.latent_dim = 0;
    c.balance = LM_BALANCE_NONE;
    c.residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c.attnres_block = 2;
    c.recompute = recompute;
    return c;
}

/* the same data on every rank: tokens and targets [B, T_TOTAL], the parameters perturbed from the init */
static void make_data(lm_model *m, int V, int32_t *tok, int32_t *tgt) {
    lm_rng r;
    lm_rng_seed(&r, 4242);
    float *w = lm_model_params(m);
    /* zero-initialised tensors (AttnRes queries) get gradients of every kind */
    for (size_t i = 0; i < lm_model_num_params(m); i++) w[i] += 0.1f * (float)lm_rng_normal(&r);
    for (int i = 0; i < B * T_TOTAL; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)V);
    for (int i = 0; i < B * T_TOTAL; i++) tgt[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)V);
}

/* rows [t0, t0 + n) of x [B, T_TOTAL] */
static void slice_rows(const int32_t *x, int t0, int n, int32_t *y) {
    for (int b = 0; b < B; b++) memcpy(y + (size_t)b * n, x + (size_t)b * T_TOTAL + t0, (size_t)n * sizeof *x);
}

/* the model on this rank's segment, with the whole model's parameters; cp: context-parallel */
static lm_model *segment_model(const lm_config *c, const lm_model *whole, int n, int cp) {
    lm_model *m = NULL;
    CHECK(!lm_model_create(c, B, n, &m), "%s", lm_last_error());
    if (!m) return NULL;
    lm_model_init(m, 1);
    CHECK(!lm_model_copy_state(m, whole), "%s", lm_last_error());
    if (cp) CHECK(!lm_model_set_context_parallel(m, comm), "%s", lm_last_error());
    return m;
}

/* the segment model's loss summed over the ranks' tokens (F64) and its gradients summed over the ranks */
static void run_segments(lm_model *m, const int32_t *tok, const int32_t *tgt, int n, double *loss_sum,
                         float *g_sum) {
    float loss = NAN;
    lm_model_zero_grads(m);
    CHECK(!lm_model_forward(m, tok, tgt, 1, &loss), "%s", lm_last_error());
    CHECK(!lm_model_backward(m, (float)n / (float)T_TOTAL), "%s", lm_last_error());
    double mine = (double)loss * B * n;
    CHECK(!lm_comm_all_reduce_sum(comm, &mine, loss_sum, 1, LM_DTYPE_F64), "%s", lm_last_error());
    CHECK(!lm_comm_all_reduce_sum(comm, lm_model_grads(m), g_sum, lm_model_num_params(m), LM_DTYPE_F32), "%s",
          lm_last_error());
}

/* tensor i's max |a - b| / max |b| */
static double tensor_rel(const lm_model *m, int i, const float *a, const float *b) {
    const lm_model_tensor *t = lm_model_tensor_at(m, i);
    double d = 0, s = 1e-30;
    for (size_t j = t->offset; j < t->offset + t->numel; j++) {
        double e = fabs((double)a[j] - b[j]);
        if (!isfinite(a[j])) e = INFINITY;
        d = e > d ? e : d;
        s = fabs(b[j]) > s ? fabs(b[j]) : s;
    }
    return d / s;
}

/* the largest over tensors of tensor_rel */
static double worst_tensor(const lm_model *m, const float *a, const float *b, const char **name) {
    double w = 0;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const double r = tensor_rel(m, i, a, b);
        if (r > w || r != r) {
            w = r;
            *name = lm_model_tensor_at(m, i)->name;
        }
    }
    return w;
}

/* Every tensor of a (the ranks' sum) against b (the whole sequence's):
 * |a - b| <= 1e-5 max |b_tensor| + 3e-6 max |b_all|. The absolute term covers
 * a gradient that is a sum with heavy cancellation (layer 2's A_log here: a
 * per-head sum over every token, 10x smaller than layer 0's, whose fp32
 * spread under another summation order of the whole sequence alone, KDA
 * chunks of 32 for 16, reaches 2.2e-5 of its largest value). */
static void check_tensors(const lm_model *m, const float *a, const float *b, int R) {
    double gmax = 1e-30;
    for (size_t j = 0; j < lm_model_num_params(m); j++) gmax = fabs(b[j]) > gmax ? fabs(b[j]) : gmax;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        double d = 0, s = 0;
        for (size_t j = t->offset; j < t->offset + t->numel; j++) {
            double e = fabs((double)a[j] - b[j]);
            if (!isfinite(a[j])) e = INFINITY;
            d = e > d ? e : d;
            s = fabs(b[j]) > s ? fabs(b[j]) : s;
        }
        CHECK(d <= 1e-5 * s + 3e-6 * gmax, "%d ranks: gradient of %s off by %.3g (its largest %.3g, the model's %.3g)",
              R, t->name, d, s, gmax);
        if (d > 1e-5 * s)
            printf("    %s: %.3g relative to its largest value %.3g; %.3g of the model's largest gradient %.3g\n",
                   t->name, d / s, s, d / gmax, gmax);
    }
}

static void check_model(lm_attn_kind attn, int recompute) {
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    lm_config c = cp_config(attn, recompute);
    int t0, n;
    segment(R, me, &t0, &n);
    lm_model *whole = NULL;
    CHECK(!lm_model_create(&c, B, T_TOTAL, &whole), "%s", lm_last_error());
    if (!whole) return;
    lm_model_init(whole, 11);
    int32_t tok[B * T_TOTAL], tgt[B * T_TOTAL], stok[B * T_TOTAL], stgt[B * T_TOTAL];
    make_data(whole, c.vocab_size, tok, tgt);
    /* the whole sequence on this process */
    float loss_w = NAN;
    lm_model_zero_grads(whole);
    CHECK(!lm_model_forward(whole, tok, tgt, 1, &loss_w), "%s", lm_last_error());
    CHECK(!lm_model_backward(whole, 1.0f), "%s", lm_last_error());
    const size_t np = lm_model_num_params(whole);
    const int nq = lm_model_qk_max_count(whole);
    float *gw = malloc(np * sizeof(float)), *gs = malloc(np * sizeof(float)), *qw = malloc((size_t)nq * 4),
          *qs = malloc((size_t)nq * 4);
    memcpy(gw, lm_model_grads(whole), np * sizeof(float));
    lm_model_qk_max_get(whole, qw);
    slice_rows(tok, t0, n, stok);
    slice_rows(tgt, t0, n, stgt);
    /* context parallelism: this rank's segment */
    lm_model *m = segment_model(&c, whole, n, 1);
    double loss_sum = NAN;
    if (m) {
        run_segments(m, stok, stgt, n, &loss_sum, gs);
        const double want = (double)loss_w * B * T_TOTAL, dl = fabs(loss_sum - want) / fabs(want);
        const char *name = "";
        const double dg = worst_tensor(whole, gs, gw, &name);
        lm_model_qk_max_get(m, qs);
        double dq = 0, sq = 1e-30;
        for (int h = 0; h < nq; h++) {
            dq = fabs((double)qs[h] - qw[h]) > dq ? fabs((double)qs[h] - qw[h]) : dq;
            sq = fabs(qw[h]) > sq ? fabs(qw[h]) : sq;
        }
        printf("    %s%s%s, %d ranks: loss %.3g, gradients %.3g (worst %s), QK maxima %.3g relative\n",
               attn == LM_ATTN_MLA ? "MLA" : "GQA", recompute ? ", recompute " : "",
               recompute ? lm_recompute_name(recompute) : "", R, dl, dg, name, dq / sq);
        CHECK(dl <= 1e-5, "loss summed over the ranks %.9g, whole %.9g", loss_sum, want);
        check_tensors(whole, gs, gw, R);
        CHECK(dq <= 1e-5 * sq, "QK-Clip maxima off by %.3g", dq);
        worst = dl > worst ? dl : worst;
        worst = dg > worst ? dg : worst;
        /* a bad token on the last rank fails every rank's forward (none waits), and the next one runs */
        int32_t bad[B * T_TOTAL];
        memcpy(bad, stok, sizeof(int32_t) * B * n);
        if (me == R - 1) bad[B * n - 1] = c.vocab_size;
        float l2 = NAN;
        lm_status st = lm_model_forward(m, bad, stgt, 1, &l2);
        CHECK(st == LM_ERR_ARG, "a bad token on rank %d: status %d on rank %d", R - 1, (int)st, me);
        CHECK(me == R - 1 || strstr(lm_last_error(), "another rank"), "rank %d: %s", me, lm_last_error());
        /* a NaN router score on the last rank (the MoE after the first attention layer) fails every
         * rank there: none waits in the next token mixer */
        if (me == R - 1) lm_model_inject_fault(m, LM_FAULT_ROUTER);
        st = lm_model_forward(m, stok, stgt, 1, &l2);
        CHECK(st == LM_ERR_NUMERIC, "a NaN router score on rank %d: status %d on rank %d", R - 1, (int)st, me);
        CHECK(me == R - 1 ? strstr(lm_last_error(), "router") != NULL : strstr(lm_last_error(), "another rank") != NULL,
              "rank %d: %s", me, lm_last_error());
        run_segments(m, stok, stgt, n, &loss_sum, gs);
        CHECK(fabs(loss_sum - want) <= 1e-5 * fabs(want), "after the refused forwards: loss %.9g, whole %.9g",
              loss_sum, want);
        lm_model_free(m);
    }
    /* without context parallelism the segments' gradients are another model's */
    if (R > 1) {
        lm_model *plain = segment_model(&c, whole, n, 0);
        if (plain) {
            run_segments(plain, stok, stgt, n, &loss_sum, gs);
            const char *name = "";
            const double dg = worst_tensor(whole, gs, gw, &name);
            CHECK(dg > 1e-3, "the gradients without context parallelism match too (%.3g): the check is blind", dg);
            lm_model_free(plain);
        }
    }
    free(gw);
    free(gs);
    free(qw);
    free(qs);
    lm_model_free(whole);
}

static void test_mla_model_equals_the_whole_sequence(void) { check_model(LM_ATTN_MLA, 0); }
static void test_mla_model_with_recompute_equals_the_whole_sequence(void) { check_model(LM_ATTN_MLA, 1); }
static void test_gqa_model_equals_the_whole_sequence(void) { check_model(LM_ATTN_GQA, 0); }
/* one kind recomputed: the token mixers' segment activations one shared set, the MoE's per layer, and back */
static void test_selective_recompute_equals_the_whole_sequence(void) {
    check_model(LM_ATTN_GQA, LM_RECOMPUTE_TOKEN);
    check_model(LM_ATTN_MLA, LM_RECOMPUTE_CHANNEL);
}

static void test_unfit_models_are_refused(void) {
    /* different row counts on the ranks: refused on every rank (alone: one model, nothing to disagree) */
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    lm_config c = cp_config(LM_ATTN_MLA, 0);
    int t0, n;
    segment(R, me, &t0, &n);
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, R > 1 && me == R - 1 ? 1 : B, n, &m), "%s", lm_last_error());
    if (!m) return;
    lm_status st = lm_model_set_context_parallel(m, comm);
    if (R > 1) CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), "rows"), "rank %d: status %d: %s", me, (int)st,
                     lm_last_error());
    else CHECK(st == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_set_context_parallel(m, NULL) == LM_ERR_ARG, "a NULL communicator was accepted");
    lm_model_free(m);
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    lm_comm_engine engine = want_ranks ? LM_COMM_MPI : LM_COMM_SELF;
    if (want_ranks && want_ranks != 2 && want_ranks != 4) {
        fprintf(stderr, "test_model_cp runs alone or on 2 or 4 ranks\n");
        return 1;
    }
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
    RUN(test_mla_model_equals_the_whole_sequence);
    RUN(test_mla_model_with_recompute_equals_the_whole_sequence);
    RUN(test_gqa_model_equals_the_whole_sequence);
    RUN(test_selective_recompute_equals_the_whole_sequence);
    RUN(test_unfit_models_are_refused);
    if (comm) {
        printf("  worst difference from the whole sequence (relative to the largest): %.3g\n", worst);
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(comm);
    }
    return test_summary();
}
