/* Expert parallelism of the CPU MoE layer (include/longmoe/moe_ep.h,
 * docs/scaleout.md): on R ranks, each routing its block of the global tokens
 * and owning n/R experts, the layer's outputs, input gradients and every
 * parameter gradient equal the one-process layer on all the tokens. Then the
 * whole model with owner-only expert gradients (lm_model_keep_expert_grads):
 * each rank's gradient block holds the replicated tensors and its own
 * experts' slices only, and equals one process's gradient there; the memory
 * plan's gradient bytes of a rank of EP 1, 2 and 4; a model created in that
 * layout (lm_model_create_expert_owned) allocating only its share and giving
 * the cut model's bits.
 *
 * `test_moe_ep` alone runs the same cases on the one-rank engine (the
 * exchange with itself); `mpirun -np N test_moe_ep --mpi N` (ctest's
 * test_moe_ep_mpi2 and test_moe_ep_mpi4) on N ranks. Built without MPI,
 * `--mpi N` reports every case skipped. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/comm.h"
#include "longmoe/model.h"
#include "longmoe/moe.h"
#include "longmoe/moe_ep.h"
#include "test.h"
#include "test_models.h"

static lm_comm *comm;
static int R = 1, me = 0;

static void fill_normal(float *v, size_t len, double scale, lm_rng *r) {
    for (size_t i = 0; i < len; i++) v[i] = (float)(scale * lm_rng_normal(r));
}

/* max |got - want| over max |want| of one tensor */
static double rel_diff(const float *got, const float *want, size_t len) {
    double dmax = 0, wmax = 0;
    for (size_t i = 0; i < len; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        if (!(d <= dmax)) dmax = d; /* NaN propagates */
        if (fabs((double)want[i]) > wmax) wmax = fabs((double)want[i]);
    }
    return wmax > 0 ? dmax / wmax : dmax;
}

/* The first of the experts that the skewed bias leaves without rows. */
static int empty_from(int n) { return R > 1 ? n - n / R : n - 1; }

typedef enum { BIAS_RANDOM, BIAS_SKEWED } bias_mode;

/* The layer on M global tokens split over the ranks in consecutive blocks
 * (rank r: tokens [M r / R, M (r+1) / R)), against the one-process layer
 * that every rank also computes. */
static void check_case(const lm_moe_config *cfg, int64_t M, bias_mode mode, int with_extra, uint64_t seed) {
    int n = cfg->n_experts, d = cfg->d, f = cfg->d_ff, de = cfg->d_latent ? cfg->d_latent : d;
    size_t np = lm_moe_param_count(cfg);
    lm_rng rng;
    lm_rng_seed(&rng, seed); /* the same draws on every rank */
    float *P = malloc(np * sizeof(float)), *x = malloc((size_t)M * d * sizeof(float));
    float *dy = malloc((size_t)M * d * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
    float *ex = malloc((size_t)M * n * sizeof(float));
    fill_normal(P, np, 0.4 / sqrt((double)d), &rng);
    fill_normal(x, (size_t)M * d, 1.0, &rng);
    fill_normal(dy, (size_t)M * d, 1.0, &rng);
    fill_normal(ex, (size_t)M * n, 0.3, &rng);
    fill_normal(b, (size_t)n, 0.05, &rng);
    lm_moe_params p;
    lm_moe_params_carve(cfg, P, &p);
    if (cfg->d_latent) for (int e = 0; e < cfg->d_latent; e++) p.lat_norm[e] = 1.0f + 0.1f * p.lat_norm[e];
    if (mode == BIAS_SKEWED) {
        /* expert 1 is chosen by every token; the last rank's experts (one
         * process: the last expert) by none */
        for (int j = empty_from(n); j < n; j++) b[j] = -20.0f;
        b[1] = 20.0f;
    }

    /* one process, all tokens */
    float *y1 = malloc((size_t)M * d * sizeof(float)), *dx1 = malloc((size_t)M * d * sizeof(float));
    fill_normal(dx1, (size_t)M * d, 5.0, &rng); /* dx is written: what it held must not matter */
    float *G1 = calloc(np, sizeof(float));
    lm_moe_params g1;
    lm_moe_params_carve(cfg, G1, &g1);
    lm_moe_acts a1;
    CHECK(lm_moe_acts_alloc(&a1, cfg, M) == LM_OK, "%s", lm_last_error());
    CHECK(lm_moe_forward(y1, x, b, cfg, &p, &a1, M) == LM_OK, "%s", lm_last_error());
    CHECK(lm_moe_backward(dx1, &g1, dy, x, with_extra ? ex : NULL, cfg, &p, &a1) == LM_OK, "%s", lm_last_error());

    /* this rank's tokens and experts */
    int64_t lo = M * me / R, hi = M * (me + 1) / R, m = hi - lo;
    lm_moe_ep *ep = NULL;
    CHECK(lm_moe_ep_create(comm, cfg, &ep) == LM_OK, "%s", lm_last_error());
    if (!ep) return;
    int first = lm_moe_ep_first_expert(ep), nl = lm_moe_ep_local_experts(ep);
    CHECK(first == me * n / R && nl == n / R, "rank %d owns [%d, %d)", me, first, first + nl);
    size_t wo = (size_t)first * f * de;
    lm_moe_params pl = p;
    pl.gate = p.gate + wo;
    pl.up = p.up + wo;
    pl.down = p.down + wo;
    float *GR = calloc(np, sizeof(float)), *Gsum = calloc(np, sizeof(float));
    lm_moe_params gr, gl;
    lm_moe_params_carve(cfg, GR, &gr);
    gl = gr;
    gl.gate = gr.gate + wo;
    gl.up = gr.up + wo;
    gl.down = gr.down + wo;
    float *y = malloc(((size_t)m * d + 1) * sizeof(float)), *dx = malloc(((size_t)m * d + 1) * sizeof(float));
    fill_normal(dx, (size_t)m * d + 1, 3.0, &rng);
    lm_moe_acts a;
    CHECK(lm_moe_acts_alloc(&a, cfg, m > 0 ? m : 1) == LM_OK, "%s", lm_last_error());
    CHECK(lm_moe_forward_ep(y, x + lo * d, b, cfg, &pl, &a, m, ep) == LM_OK, "%s", lm_last_error());
    CHECK(lm_moe_backward_ep(dx, &gl, dy + lo * d, x + lo * d, with_extra ? ex + lo * n : NULL, cfg, &pl, &a, ep) ==
              LM_OK,
          "%s", lm_last_error());

    /* outputs and input gradients of this rank's tokens */
    if (m > 0) {
        double ry = rel_diff(y, y1 + lo * d, (size_t)m * d), rdx = rel_diff(dx, dx1 + lo * d, (size_t)m * d);
        CHECK(ry <= 1e-6, "rank %d: y differs by %.3g relative", me, ry);
        CHECK(rdx <= 1e-6, "rank %d: dx differs by %.3g relative", me, rdx);
    }
    /* the owned experts' gradients are complete on their owner */
    size_t es = (size_t)nl * f * de;
    double rg = rel_diff(gl.gate, g1.gate + wo, es), ru = rel_diff(gl.up, g1.up + wo, es);
    double rd = rel_diff(gl.down, g1.down + wo, es);
    CHECK(rg <= 1e-6 && ru <= 1e-6 && rd <= 1e-6, "rank %d: expert gradients differ: gate %.3g up %.3g down %.3g",
          me, rg, ru, rd);
    /* and nothing was written outside them */
    size_t all = (size_t)n * f * de, nz = 0;
    for (size_t i = 0; i < all; i++)
        if ((i < wo || i >= wo + es) && (gr.gate[i] != 0 || gr.up[i] != 0 || gr.down[i] != 0)) nz++;
    CHECK(nz == 0, "rank %d: %zu gradients of experts it does not own were written", me, nz);
    /* the replicated parts: this rank's contribution; their sum over ranks is the whole batch's */
    CHECK(lm_comm_all_reduce_sum(comm, GR, Gsum, np, LM_DTYPE_F32) == LM_OK, "%s", lm_last_error());
    lm_moe_params gs;
    lm_moe_params_carve(cfg, Gsum, &gs);
    struct { const char *name; const float *got, *want; size_t len; } t[] = {
        {"router", gs.router, g1.router, (size_t)n * d},
        {"gate", gs.gate, g1.gate, all},
        {"up", gs.up, g1.up, all},
        {"down", gs.down, g1.down, all},
        {"lat_down", gs.lat_down, g1.lat_down, (size_t)cfg->d_latent * d},
        {"lat_norm", gs.lat_norm, g1.lat_norm, (size_t)cfg->d_latent},
        {"lat_up", gs.lat_up, g1.lat_up, (size_t)cfg->d_latent * d},
        {"shared_gate", gs.shared_gate, g1.shared_gate, (size_t)cfg->n_shared * cfg->d_ff_shared * d},
        {"shared_up", gs.shared_up, g1.shared_up, (size_t)cfg->n_shared * cfg->d_ff_shared * d},
        {"shared_down", gs.shared_down, g1.shared_down, (size_t)cfg->n_shared * cfg->d_ff_shared * d},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (!t[i].len) continue;
        double r = rel_diff(t[i].got, t[i].want, t[i].len);
        CHECK(r <= 1e-6, "rank %d: gradient of %s differs by %.3g relative", me, t[i].name, r);
    }
    /* the gradients are not all zero (the comparison can fail) */
    double gmax = 0;
    for (size_t i = 0; i < np; i++) gmax = fmax(gmax, fabs(G1[i]));
    CHECK(gmax > 1e-3, "the reference gradients are negligible (%g)", gmax);

    /* the rows the owners received are the one-process expert counts */
    int64_t got = lm_moe_ep_rows_received(ep), want = a1.offsets[first + nl] - a1.offsets[first];
    CHECK(got == want, "rank %d received %lld rows, the experts it owns have %lld", me, (long long)got,
          (long long)want);
    if (mode == BIAS_SKEWED) {
        int64_t most = a1.offsets[2] - a1.offsets[1];
        CHECK(most == M, "expert 1 got %lld of %lld tokens", (long long)most, (long long)M);
        CHECK(a1.offsets[n] - a1.offsets[empty_from(n)] == 0, "the last rank's experts got rows");
        if (me == R - 1 && R > 1) CHECK(got == 0, "the last rank received %lld rows", (long long)got);
    }

    lm_moe_acts_free(&a);
    lm_moe_acts_free(&a1);
    lm_moe_ep_free(ep);
    free(P), free(x), free(dy), free(b), free(ex), free(y1), free(dx1), free(G1), free(GR), free(Gsum), free(y), free(dx);
}

static lm_moe_config base_config(void) {
    lm_moe_config c = lm_moe_config_default(16, 8, 2, 12);
    return c;
}

static void test_plain_layer_equals_one_process(void) {
    lm_moe_config c = base_config();
    check_case(&c, 24, BIAS_RANDOM, 0, 11);
    c.top_k = 3;
    c.act = LM_EXPERT_SITU_GLU;
    c.route_scale = 2.5f;
    check_case(&c, 40, BIAS_RANDOM, 1, 12);
}

static void test_latent_and_shared_experts_equal_one_process(void) {
    lm_moe_config c = base_config();
    c.d_latent = 8;
    c.n_shared = 1;
    c.d_ff_shared = 10;
    check_case(&c, 32, BIAS_RANDOM, 1, 21);
    c.n_experts = 16;
    c.top_k = 4;
    check_case(&c, 28, BIAS_RANDOM, 0, 22);
}

static void test_empty_experts_and_one_expert_taking_most_rows(void) {
    lm_moe_config c = base_config();
    check_case(&c, 24, BIAS_SKEWED, 0, 31);
    c.d_latent = 8;
    c.n_shared = 2;
    c.d_ff_shared = 6;
    check_case(&c, 20, BIAS_SKEWED, 1, 32);
}

static void test_ranks_without_tokens(void) {
    /* fewer tokens than ranks: some ranks route nothing but still own experts */
    lm_moe_config c = base_config();
    check_case(&c, R > 1 ? R - 1 : 1, BIAS_RANDOM, 0, 41);
    check_case(&c, 5, BIAS_RANDOM, 1, 42);
}

static void test_indivisible_experts_are_refused(void) {
    if (R == 1) SKIP("every expert count divides over one rank");
    lm_moe_config c = base_config();
    c.n_experts = 5;
    c.top_k = 2;
    lm_moe_ep *ep = (lm_moe_ep *)1;
    lm_status s = lm_moe_ep_create(comm, &c, &ep);
    CHECK(s == LM_ERR_ARG && ep == NULL && strstr(lm_last_error(), "divisible"), "status %d: %s", (int)s,
          lm_last_error());
}

/* The routed experts' weights of a model (layers.L.moe.gate, .up, .down). */
static size_t routed_expert_floats(const lm_model *m) {
    size_t n = 0;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        const char *d = strstr(t->name, ".moe.");
        if (d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down"))) n += t->numel;
    }
    return n;
}

/* The bytes of the memory plan's gradient entry. */
static size_t plan_gradient_bytes(const lm_model *m) {
    for (int i = 0; i < lm_model_num_buffers(m); i++)
        if (!strncmp(lm_model_buffer_at(m, i)->name, "gradients", 9)) return lm_model_buffer_at(m, i)->bytes;
    return 0;
}

/* test_dp's model (4 rows of 32 tokens, MoE layers of 8 experts and a shared
 * one) under expert parallelism on the R ranks, each holding B/R rows of the
 * global batch and keeping only its experts' gradients: the block is the
 * replicated tensors plus 1/R of the experts; every owned slice equals one
 * process's gradient of the whole batch, and the replicated tensors' summed
 * over the ranks too (1e-5 of each tensor's largest value). A backward after
 * an evaluation forward (which runs every expert locally) is refused. */
static void test_model_keeps_only_its_own_experts_gradients(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    const int B = c.batch_size, T = c.seq_len, Bm = B / R;
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    lm_rng rng;
    lm_rng_seed(&rng, 7);
    for (int i = 0; tok && tgt && i < B * T; i++) {
        tok[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
        tgt[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
    }
    lm_model *one = NULL, *m = NULL;
    CHECK(tok && tgt, "out of memory");
    CHECK(!lm_model_create(&c, B, T, &one) && !lm_model_create(&c, Bm, T, &m), "%s", lm_last_error());
    float loss;
    if (!one || !m || !tok || !tgt) goto out;
    lm_model_init(one, 11);
    lm_model_init(m, 11);
    CHECK(!lm_model_forward(one, tok, tgt, 1, &loss) && !lm_model_backward(one, 1.0f), "%s", lm_last_error());
    CHECK(lm_model_keep_expert_grads(m, R, me) == LM_ERR_ARG && strstr(lm_last_error(), "lm_model_set_expert_parallel"),
          "cutting the gradients without expert parallelism: %s", lm_last_error());
    CHECK(!lm_model_set_expert_parallel(m, comm) && !lm_model_keep_expert_grads(m, R, me), "%s", lm_last_error());
    CHECK(lm_model_keep_expert_grads(m, R, me) == LM_ERR_ARG, "cut twice");
    const size_t np = lm_model_num_params(m), ex = routed_expert_floats(m);
    CHECK(lm_model_num_grads(m) == np - ex + ex / (size_t)R, "rank %d keeps %zu gradients, expected %zu", me,
          lm_model_num_grads(m), np - ex + ex / (size_t)R);
    const size_t off = (size_t)me * Bm * T;
    lm_status st = lm_model_forward(m, tok + off, tgt + off, 1, &loss);
    if (!st) st = lm_model_backward(m, 1.0f / (float)R);
    CHECK(!st, "rank %d: %s", me, lm_last_error());
    if (st) goto out;
    const float *gw = lm_model_grads(one);
    size_t held = 0, cut = 0;
    double worst = 0;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        size_t first, count;
        float *g = lm_model_grad_part(m, i, &first, &count);
        held += count;
        const char *d = strstr(t->name, ".moe.");
        const int expert = d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down"));
        const size_t want_first = expert ? (size_t)me * (t->numel / (size_t)R) : 0,
                     want_count = expert ? t->numel / (size_t)R : t->numel;
        CHECK(first == want_first && count == want_count, "%s: rank %d keeps [%zu, %zu), expected [%zu, %zu)", t->name,
              me, first, first + count, want_first, want_first + want_count);
        if (first != want_first || count != want_count) continue;
        cut += expert;
        float *sum = malloc(count * sizeof *sum);
        CHECK(sum, "out of memory");
        if (!sum) break;
        /* an owner's slice is complete; a replicated tensor's gradient is the ranks' sum */
        if (expert) memcpy(sum, g, count * sizeof *sum);
        else CHECK(!lm_comm_all_reduce_sum(comm, g, sum, count, LM_DTYPE_F32), "%s", lm_last_error());
        const double r = rel_diff(sum, gw + t->offset + first, count);
        CHECK(r <= 1e-5, "%s: rank %d's gradient differs from one process's by %.3g of its largest value", t->name, me,
              r);
        worst = r > worst ? r : worst;
        free(sum);
    }
    CHECK(held == lm_model_num_grads(m), "the parts hold %zu gradients, the block %zu", held, lm_model_num_grads(m));
    CHECK(cut == 9, "%zu expert tensors cut, expected 9 (3 MoE layers)", cut);
    /* an evaluation forward runs every expert locally: its backward would need every expert's gradient */
    CHECK(!lm_model_forward(m, tok + off, tgt + off, 0, &loss), "%s", lm_last_error());
    CHECK(lm_model_backward(m, 1.0f) == LM_ERR_ARG && strstr(lm_last_error(), "own experts' gradients"),
          "a backward after an evaluation forward: %s", lm_last_error());
    printf("     rank %d of %d keeps %zu of %zu gradients (the experts' %zu / %d); within %.2e of one process\n", me, R,
           lm_model_num_grads(m), np, ex, R, worst);
out:
    lm_model_free(one);
    lm_model_free(m);
    free(tok);
    free(tgt);
}

/* Owner-only expert weights on the same model: a rank that also cuts its
 * parameter block (lm_model_keep_expert_weights, after the gradients) holds
 * the replicated tensors and its experts' slices (lm_model_num_kept_params:
 * 1/R of the experts'); initialised after the cut, every kept weight has one
 * process's bits; its training forward and backward give the loss and
 * gradients of a rank whose weights stay whole bit for bit; an evaluation
 * forward is refused until the experts are gathered (lm_model_gather_experts),
 * then equals the whole rank's bits, and is refused again after
 * lm_model_release_experts; the gathered tensors are one process's;
 * lm_model_copy_state copies a cut model into another and a whole one into a
 * cut one, not a cut one into a whole one. Misuse is refused. */
static void test_model_keeps_only_its_own_experts_weights(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    const int B = c.batch_size, T = c.seq_len, Bm = B / R;
    const size_t off = (size_t)me * Bm * T;
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    lm_rng rng;
    lm_rng_seed(&rng, 9);
    for (int i = 0; tok && tgt && i < B * T; i++) {
        tok[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
        tgt[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
    }
    lm_model *one = NULL, *w = NULL, *m = NULL, *m2 = NULL;
    CHECK(tok && tgt, "out of memory");
    CHECK(!lm_model_create(&c, B, T, &one) && !lm_model_create(&c, Bm, T, &w) && !lm_model_create(&c, Bm, T, &m) &&
          !lm_model_create(&c, Bm, 2 * T, &m2), "%s", lm_last_error());
    if (!one || !w || !m || !m2 || !tok || !tgt) goto out;
    lm_model_init(one, 11);
    lm_model_init(w, 11);
    CHECK(!lm_model_set_expert_parallel(w, comm) && !lm_model_keep_expert_grads(w, R, me), "%s", lm_last_error());
    CHECK(!lm_model_set_expert_parallel(m, comm), "%s", lm_last_error());
    CHECK(lm_model_keep_expert_weights(m) == LM_ERR_ARG && strstr(lm_last_error(), "lm_model_keep_expert_grads"),
          "weights cut before the gradients: %s", lm_last_error());
    CHECK(!lm_model_keep_expert_grads(m, R, me) && !lm_model_keep_expert_weights(m), "%s", lm_last_error());
    CHECK(lm_model_keep_expert_weights(m) == LM_ERR_ARG, "weights cut twice");
    lm_model_init(m, 11);
    const size_t np = lm_model_num_params(m), ex = routed_expert_floats(m), want = np - ex + ex / (size_t)R;
    CHECK(lm_model_num_kept_params(w) == np, "a rank with whole weights keeps %zu of %zu", lm_model_num_kept_params(w),
          np);
    CHECK(lm_model_num_kept_params(m) == want && lm_model_buffer_at(m, 0)->bytes == want * sizeof(float),
          "rank %d keeps %zu parameters (its plan %zu bytes), expected %zu", me, lm_model_num_kept_params(m),
          lm_model_buffer_at(m, 0)->bytes, want);
    /* every kept weight has one process's bits; the cut tensors have no whole data until gathered */
    const float *ow = lm_model_params(one);
    size_t held = 0;
    int cut = 0;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        size_t first, count;
        const float *p = lm_model_param_part(m, i, &first, &count);
        held += count;
        cut += count < t->numel;
        CHECK(!memcmp(p, ow + t->offset + first, count * sizeof *p), "%s: rank %d's kept weights differ from one "
              "process's", t->name, me);
        CHECK((lm_model_tensor_data(m, i) != NULL) == (count == t->numel || R == 1), "%s: whole data of a cut tensor",
              t->name);
    }
    CHECK(held == lm_model_num_kept_params(m), "the parts hold %zu weights, the block %zu", held,
          lm_model_num_kept_params(m));
    CHECK(cut == (R > 1 ? 9 : 0), "%d tensors cut", cut);
    /* training: the same loss and gradient bits as the rank whose weights stay whole */
    float lw = 0, lm = 0;
    lm_status st = lm_model_forward(w, tok + off, tgt + off, 1, &lw);
    if (!st) st = lm_model_backward(w, 1.0f / (float)R);
    if (!st) st = lm_model_forward(m, tok + off, tgt + off, 1, &lm);
    if (!st) st = lm_model_backward(m, 1.0f / (float)R);
    CHECK(!st, "rank %d: %s", me, lm_last_error());
    if (st) goto out;
    CHECK(!memcmp(&lw, &lm, sizeof lw), "loss %.9g with cut weights, %.9g whole", lm, lw);
    CHECK(lm_model_num_grads(m) == lm_model_num_grads(w) &&
          !memcmp(lm_model_grads(m), lm_model_grads(w), lm_model_num_grads(m) * sizeof(float)),
          "rank %d's gradients differ from the whole-weight rank's", me);
    /* evaluation: refused while cut, the whole rank's bits once gathered */
    if (R > 1)
        CHECK(lm_model_forward(m, tok + off, tgt + off, 0, &lm) == LM_ERR_ARG &&
              strstr(lm_last_error(), "lm_model_gather_experts"), "an evaluation forward with cut weights: %s",
              lm_last_error());
    CHECK(!lm_model_gather_experts(m) && lm_model_experts_gathered(m), "%s", lm_last_error());
    CHECK(!lm_model_forward(w, tok + off, tgt + off, 0, &lw) && !lm_model_forward(m, tok + off, tgt + off, 0, &lm),
          "%s", lm_last_error());
    CHECK(!memcmp(&lw, &lm, sizeof lw), "evaluation loss %.9g gathered, %.9g whole", lm, lw);
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        const float *d = lm_model_tensor_data(m, i);
        CHECK(d && !memcmp(d, ow + t->offset, t->numel * sizeof *d), "%s: gathered weights differ from one process's",
              t->name);
    }
    lm_model_release_experts(m);
    if (R > 1)
        CHECK(!lm_model_experts_gathered(m) && lm_model_forward(m, tok + off, tgt + off, 0, &lm) == LM_ERR_ARG,
              "an evaluation forward after the release accepted");
    /* a new stage's model: from the cut one, and from a whole one; not a cut one into a whole one */
    CHECK(!lm_model_set_expert_parallel(m2, comm) && !lm_model_keep_expert_grads(m2, R, me) &&
          !lm_model_keep_expert_weights(m2), "%s", lm_last_error());
    CHECK(!lm_model_copy_state(m2, m), "%s", lm_last_error());
    CHECK(!memcmp(lm_model_params(m2), lm_model_params(m), want * sizeof(float)), "the copied weights differ");
    lm_model_init(m2, 12);
    CHECK(!lm_model_copy_state(m2, one), "%s", lm_last_error());
    CHECK(!memcmp(lm_model_params(m2), lm_model_params(m), want * sizeof(float)), "the weights copied from a whole "
          "model differ");
    if (R > 1)
        CHECK(lm_model_copy_state(w, m) == LM_ERR_ARG && strstr(lm_last_error(), "owner-only"),
              "a cut model copied into a whole one: %s", lm_last_error());
    printf("     rank %d of %d keeps %zu of %zu weights (the experts' %zu / %d); training bits as with whole weights\n",
           me, R, lm_model_num_kept_params(m), np, ex, R);
out:
    lm_model_free(one);
    lm_model_free(w);
    lm_model_free(m);
    lm_model_free(m2);
    free(tok);
    free(tgt);
}

/* Evaluation layer by layer (lm_model_gather_experts_by_layer) on a model
 * that keeps only its own experts' weights: lm_model_forward (training 0),
 * lm_model_score and lm_model_logits give the bits of a rank whose weights
 * stay whole, the most gathered bytes held at once are one MoE layer's routed
 * experts (lm_model_expert_layer_bytes; the whole gather holds every layer's),
 * nothing stays gathered after, a plan reports the same layer bytes, and a
 * rank that fails before the first MoE layer (a token outside the vocabulary)
 * makes every rank of the group fail there, none waiting in a gather. */
static void test_evaluation_gathers_one_layer_at_a_time(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    const int B = c.batch_size, T = c.seq_len, Bm = B / R;
    const size_t off = (size_t)me * Bm * T, N = (size_t)Bm * T;
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    int32_t *aw = malloc(N * sizeof *aw), *am = malloc(N * sizeof *am);
    double *nw = malloc(N * sizeof *nw), *nm = malloc(N * sizeof *nm);
    float *gw = malloc(N * (size_t)c.vocab_size * sizeof *gw), *gm = malloc(N * (size_t)c.vocab_size * sizeof *gm);
    lm_rng rng;
    lm_rng_seed(&rng, 19);
    for (int i = 0; tok && tgt && i < B * T; i++) {
        tok[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
        tgt[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
    }
    lm_model *w = NULL, *m = NULL, *p = NULL;
    CHECK(tok && tgt && aw && am && nw && nm && gw && gm, "out of memory");
    CHECK(!lm_model_create(&c, Bm, T, &w) && !lm_model_create(&c, Bm, T, &m), "%s", lm_last_error());
    if (!w || !m || !tok || !tgt || !aw || !am || !nw || !nm || !gw || !gm) goto out;
    lm_model_init(w, 21);
    CHECK(lm_model_gather_experts_by_layer(m, 1) == LM_ERR_ARG && strstr(lm_last_error(), "lm_model_keep_expert"),
          "layer by layer on a whole model: %s", lm_last_error());
    CHECK(!lm_model_set_expert_parallel(m, comm) && !lm_model_keep_expert_grads(m, R, me) &&
          !lm_model_keep_expert_weights(m) && !lm_model_gather_experts_by_layer(m, 1), "%s", lm_last_error());
    lm_model_init(m, 21);
    const size_t ex = routed_expert_floats(m), nmoe = (size_t)lm_model_num_moe_layers(m);
    const size_t layer = R > 1 ? ex / nmoe * sizeof(float) : 0;
    CHECK(lm_model_expert_layer_bytes(m) == layer, "one layer's experts: %zu bytes, expected %zu",
          lm_model_expert_layer_bytes(m), layer);
    CHECK(nmoe > 1, "the test model has %zu MoE layers (one layer's experts would be all of them)", nmoe);
    (void)lm_model_gathered_peak_bytes(m, 1);
    float lw = 0, lm = 0;
    lm_status st = lm_model_forward(w, tok + off, tgt + off, 0, &lw);
    if (!st) st = lm_model_forward(m, tok + off, tgt + off, 0, &lm);
    CHECK(!st, "rank %d: %s", me, lm_last_error());
    CHECK(!memcmp(&lw, &lm, sizeof lw), "evaluation loss %.9g layer by layer, %.9g whole", lm, lw);
    st = lm_model_score(w, tok + off, tgt + off, nw, aw);
    if (!st) st = lm_model_score(m, tok + off, tgt + off, nm, am);
    CHECK(!st, "rank %d: %s", me, lm_last_error());
    CHECK(!st && !memcmp(nw, nm, N * sizeof *nw) && !memcmp(aw, am, N * sizeof *aw),
          "rank %d: the scores layer by layer differ from the whole weights'", me);
    st = lm_model_logits(w, tok + off, gw);
    if (!st) st = lm_model_logits(m, tok + off, gm);
    CHECK(!st && !memcmp(gw, gm, N * (size_t)c.vocab_size * sizeof *gw),
          "rank %d: the logits layer by layer differ from the whole weights': %s", me, st ? lm_last_error() : "");
    const size_t peak = lm_model_gathered_peak_bytes(m, 1);
    CHECK(peak == layer, "rank %d held %zu gathered bytes at most, one layer's experts are %zu", me, peak, layer);
    /* through the exchange instead (lm_model_evaluate_by_exchange, a GPU's way): a model created cut, no
     * weights gathered, the whole weights' numbers to the exchange's rounding */
    {
        lm_model *x = NULL;
        CHECK(!lm_model_create_expert_owned(&c, Bm, T, NULL, R, me, &x), "%s", lm_last_error());
        if (x) {
            CHECK(lm_model_evaluate_by_exchange(x, 1) == LM_ERR_ARG && strstr(lm_last_error(), "expert parallelism"),
                  "through the exchange before lm_model_set_expert_parallel: %s", lm_last_error());
            CHECK(!lm_model_set_expert_parallel(x, comm) && !lm_model_evaluate_by_exchange(x, 1), "%s",
                  lm_last_error());
            lm_model_init(x, 21);
            float lx = 0;
            double worst = 0;
            st = lm_model_forward(x, tok + off, tgt + off, 0, &lx);
            CHECK(!st, "rank %d, through the exchange: %s", me, st ? lm_last_error() : "");
            CHECK_CLOSE(lx, lw, 0, 1e-6, "evaluation loss through the exchange");
            st = lm_model_score(x, tok + off, tgt + off, nm, am);
            CHECK(!st, "rank %d, score through the exchange: %s", me, st ? lm_last_error() : "");
            for (size_t i = 0; !st && i < N; i++) worst = fmax(worst, fabs(nm[i] - nw[i]) / fmax(fabs(nw[i]), 1e-3));
            CHECK(!st && worst <= 1e-5, "rank %d: the scores through the exchange within %.2e of the whole weights'",
                  me, worst);
            st = lm_model_logits(x, tok + off, gm);
            worst = 0;
            for (size_t i = 0; !st && i < N * (size_t)c.vocab_size; i++)
                worst = fmax(worst, fabs((double)gm[i] - gw[i]));
            CHECK(!st && worst <= 1e-4, "rank %d: the logits through the exchange within %.2e: %s", me, worst,
                  st ? lm_last_error() : "");
            CHECK(!lm_model_gathered_peak_bytes(x, 0), "rank %d gathered expert weights through the exchange", me);
            if (me == 0)
                printf("     evaluation through the exchange: loss %.9g (whole weights %.9g), nothing gathered\n",
                       (double)lx, (double)lw);
            lm_model_free(x);
        }
    }
    CHECK(!lm_model_gathered_peak_bytes(m, 0), "gathered bytes left after the evaluation");
    /* the whole gather (checkpoints) holds every layer's */
    CHECK(!lm_model_gather_experts(m), "%s", lm_last_error());
    CHECK(!lm_model_forward(m, tok + off, tgt + off, 0, &lm) && !memcmp(&lw, &lm, sizeof lw), "gathered whole: %s",
          lm_last_error());
    lm_model_release_experts(m);
    CHECK(lm_model_gathered_peak_bytes(m, 1) == ex * sizeof(float), "the whole gather's bytes");
    /* a rank failing before the first MoE layer: every rank fails, naming the cause where it lies */
    if (R > 1) {
        const int32_t keep = tok[off];
        if (me == R - 1) tok[off] = c.vocab_size;
        st = lm_model_forward(m, tok + off, tgt + off, 0, &lm);
        CHECK(st != LM_OK && strstr(lm_last_error(), me == R - 1 ? "outside the vocabulary" : "another rank"),
              "rank %d: %s", me, st ? lm_last_error() : "the forward passed");
        st = lm_model_score(m, tok + off, tgt + off, nm, am);
        CHECK(st != LM_OK && strstr(lm_last_error(), me == R - 1 ? "outside the vocabulary" : "another rank"),
              "rank %d, score: %s", me, st ? lm_last_error() : "the forward passed");
        tok[off] = keep;
        CHECK(!lm_model_forward(m, tok + off, tgt + off, 0, &lm) && !memcmp(&lw, &lm, sizeof lw),
              "after the failure: %s", lm_last_error());
        CHECK(!lm_model_gathered_peak_bytes(m, 0) || lm_model_gathered_peak_bytes(m, 1) == layer,
              "after the failures");
        CHECK(!lm_model_gather_experts_by_layer(m, 0) && lm_model_forward(m, tok + off, tgt + off, 0, &lm) == LM_ERR_ARG,
              "an evaluation forward with layer by layer off accepted");
    }
    /* the plan of a rank */
    CHECK(!lm_model_plan(&c, Bm, T, LM_DEVICE_CPU, &p), "%s", lm_last_error());
    if (p && R > 1) {
        CHECK(!lm_model_expert_layer_bytes(p), "a whole plan's layer bytes");
        CHECK(!lm_model_keep_expert_grads(p, R, 0) && !lm_model_keep_expert_weights(p), "%s", lm_last_error());
        CHECK(lm_model_expert_layer_bytes(p) == layer, "the plan's layer bytes %zu, expected %zu",
              lm_model_expert_layer_bytes(p), layer);
    }
    printf("     rank %d of %d: an evaluation holds %zu gathered bytes at most (one of %zu MoE layers' experts; the "
           "whole gather %zu)\n", me, R, peak, nmoe, ex * sizeof(float));
out:
    lm_model_free(w);
    lm_model_free(m);
    lm_model_free(p);
    free(tok);
    free(tgt);
    free(aw);
    free(am);
    free(nw);
    free(nm);
    free(gw);
    free(gm);
}

/* The memory plan of a rank of EP 1, 2 and 4 (lm_model_plan, then
 * lm_model_keep_expert_grads at each position): its gradient entry is the
 * whole block less (G - 1) / G of the routed experts'; the parameters stay
 * whole. Group sizes that do not divide the experts, and positions outside
 * the group, are refused. */
static void test_the_memory_plan_of_a_rank_holds_its_experts_gradients(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.expert_ffn = 256; /* wide experts: most of the model */
    lm_model *p = NULL;
    CHECK(!lm_model_plan(&c, c.batch_size, c.seq_len, LM_DEVICE_CPU, &p), "%s", lm_last_error());
    if (!p) return;
    const size_t np = lm_model_num_params(p), ex = routed_expert_floats(p), whole = plan_gradient_bytes(p);
    lm_model_free(p);
    CHECK(whole == np * sizeof(float), "one process's gradients: %zu bytes, expected %zu", whole, np * sizeof(float));
    for (int G = 1; G <= 4; G *= 2)
        for (int pos = 0; pos < G; pos++) {
            CHECK(!lm_model_plan(&c, c.batch_size, c.seq_len, LM_DEVICE_CPU, &p), "%s", lm_last_error());
            if (!p) return;
            CHECK(!lm_model_keep_expert_grads(p, G, pos), "G %d, position %d: %s", G, pos, lm_last_error());
            const size_t want = (np - ex + ex / (size_t)G) * sizeof(float), got = plan_gradient_bytes(p);
            CHECK(got == want, "G %d, position %d: %zu bytes of gradients, expected %zu", G, pos, got, want);
            CHECK(lm_model_buffer_at(p, 0)->bytes == np * sizeof(float), "the parameters are not whole");
            /* owner-only weights: the parameter entry the same share */
            CHECK(!lm_model_keep_expert_weights(p), "G %d, position %d: %s", G, pos, lm_last_error());
            const size_t wb = lm_model_buffer_at(p, 0)->bytes;
            CHECK(wb == want && lm_model_num_kept_params(p) * sizeof(float) == want,
                  "G %d, position %d: %zu bytes of parameters, expected %zu", G, pos, wb, want);
            CHECK(plan_gradient_bytes(p) == want, "the weights' cut changed the gradients");
            if (pos == 0)
                printf("     EP %d: gradients and weights %zu bytes each a rank instead of %zu (routed experts %zu of "
                       "them)\n", G, got, whole, ex * sizeof(float));
            lm_model_free(p);
        }
    CHECK(!lm_model_plan(&c, c.batch_size, c.seq_len, LM_DEVICE_CPU, &p), "%s", lm_last_error());
    if (!p) return;
    CHECK(lm_model_keep_expert_grads(p, 3, 0) == LM_ERR_ARG && strstr(lm_last_error(), "8 routed experts"),
          "3 groups of 8 experts: %s", lm_last_error());
    CHECK(lm_model_keep_expert_grads(p, 2, 2) == LM_ERR_ARG && strstr(lm_last_error(), "out of range"),
          "position 2 of 2: %s", lm_last_error());
    lm_model_free(p);
}

/* The ledgers of two models (or plans) name the same buffers with the same bytes. */
static int same_ledger(const lm_model *a, const lm_model *b) {
    if (lm_model_num_buffers(a) != lm_model_num_buffers(b)) return 0;
    for (int i = 0; i < lm_model_num_buffers(a); i++) {
        const lm_model_buffer *x = lm_model_buffer_at(a, i), *y = lm_model_buffer_at(b, i);
        if (x->bytes != y->bytes || strcmp(x->name, y->name)) return 0;
    }
    return 1;
}

/* A model created owner-only (lm_model_create_expert_owned, then
 * lm_model_set_expert_parallel) allocates the replicated tensors and its own
 * experts' slices only: its parameter and gradient blocks, their memory plan
 * entries and the most block bytes it ever held (lm_model_block_peak_bytes)
 * are those shares, where a rank that creates the model whole and then cuts
 * it (lm_model_keep_expert_grads, lm_model_keep_expert_weights) held both
 * whole blocks first. Otherwise it is the cut model bit for bit: initialised
 * weights (one process's bits), training loss and gradients, evaluation
 * layer by layer (loss and scores), a plan's ledger
 * (lm_model_plan_expert_owned), and lm_model_copy_state into a new stage's
 * owner-only model; with plain experts and with a latent projection (every
 * part of the MoE's parameters placed through the cut layout). Misuse is
 * refused. */
static void test_a_model_created_owner_only_allocates_only_its_share(void) {
    for (int variant = 0; variant < 2; variant++) {
        lm_config c = test_dp_config(LM_QB_HISTOGRAM);
        if (variant) c.latent_dim = 16;
        const int B = c.batch_size, T = c.seq_len, Bm = B / R;
        const size_t off = (size_t)me * Bm * T, N = (size_t)Bm * T;
        int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
        int32_t *aw = malloc(N * sizeof *aw), *ao = malloc(N * sizeof *ao);
        double *nw = malloc(N * sizeof *nw), *no = malloc(N * sizeof *no);
        lm_rng rng;
        lm_rng_seed(&rng, 29);
        for (int i = 0; tok && tgt && i < B * T; i++) {
            tok[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
            tgt[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)c.vocab_size);
        }
        lm_model *one = NULL, *w = NULL, *o = NULL, *o2 = NULL, *p = NULL;
        CHECK(tok && tgt && aw && ao && nw && no, "out of memory");
        CHECK(!lm_model_create(&c, B, T, &one) && !lm_model_create(&c, Bm, T, &w), "%s", lm_last_error());
        CHECK(!lm_model_create_expert_owned(&c, Bm, T, NULL, R, me, &o) &&
              !lm_model_create_expert_owned(&c, Bm, 2 * T, NULL, R, me, &o2), "%s", lm_last_error());
        if (!one || !w || !o || !o2 || !tok || !tgt || !aw || !ao || !nw || !no) goto out;
        const size_t np = lm_model_num_params(one), ex = routed_expert_floats(one), want = np - ex + ex / (size_t)R;
        /* what it allocated: the shares from the start */
        CHECK(lm_model_num_params(o) == np && lm_model_num_kept_params(o) == want && lm_model_num_grads(o) == want,
              "variant %d, rank %d: %zu parameters and %zu gradients kept of %zu, expected %zu", variant, me,
              lm_model_num_kept_params(o), lm_model_num_grads(o), np, want);
        CHECK(lm_model_buffer_at(o, 0)->bytes == want * sizeof(float) && plan_gradient_bytes(o) == want * sizeof(float),
              "the ledger's blocks: %zu and %zu bytes, expected %zu", lm_model_buffer_at(o, 0)->bytes,
              plan_gradient_bytes(o), want * sizeof(float));
        CHECK(lm_model_block_peak_bytes(o) == 2 * want * sizeof(float), "variant %d, rank %d: %zu block bytes held at "
              "most, its two blocks are %zu", variant, me, lm_model_block_peak_bytes(o), 2 * want * sizeof(float));
        CHECK(lm_model_block_peak_bytes(one) == 2 * np * sizeof(float), "one process held %zu block bytes, expected %zu",
              lm_model_block_peak_bytes(one), 2 * np * sizeof(float));
        /* the same layout by the cut: the whole blocks were held first */
        CHECK(!lm_model_set_expert_parallel(w, comm) && !lm_model_keep_expert_grads(w, R, me) &&
              !lm_model_keep_expert_weights(w), "%s", lm_last_error());
        CHECK(lm_model_block_peak_bytes(w) >= 2 * np * sizeof(float) &&
              lm_model_num_kept_params(w) == want && lm_model_num_grads(w) == want,
              "the cut model held %zu block bytes at most", lm_model_block_peak_bytes(w));
        if (R > 1) CHECK(lm_model_block_peak_bytes(o) < 2 * np * sizeof(float), "no saving at creation");
        CHECK(same_ledger(o, w), "variant %d: the owner-only model's ledger differs from the cut model's", variant);
        CHECK(!lm_model_plan_expert_owned(&c, Bm, T, LM_DEVICE_CPU, R, me, &p), "%s", lm_last_error());
        CHECK(p && same_ledger(o, p) && !lm_model_block_peak_bytes(p), "variant %d: the plan differs from the model",
              variant);
        CHECK(!lm_model_set_expert_parallel(o, comm) && !lm_model_set_expert_parallel(o2, comm), "%s",
              lm_last_error());
        /* initialised: one process's bits in every kept weight, and the cut model's block */
        lm_model_init(one, 11);
        lm_model_init(w, 11);
        lm_model_init(o, 11);
        const float *ow = lm_model_params(one);
        for (int i = 0; i < lm_model_num_tensors(o); i++) {
            const lm_model_tensor *t = lm_model_tensor_at(o, i);
            size_t first, count;
            const float *x = lm_model_param_part(o, i, &first, &count);
            CHECK(x && !memcmp(x, ow + t->offset + first, count * sizeof *x),
                  "%s: rank %d's weights differ from one process's", t->name, me);
        }
        CHECK(!memcmp(lm_model_params(o), lm_model_params(w), want * sizeof(float)),
              "variant %d, rank %d: the initialised block differs from the cut model's", variant, me);
        /* training: the cut model's loss and gradient bits */
        float lw = 0, lo = 0;
        lm_status st = lm_model_forward(w, tok + off, tgt + off, 1, &lw);
        if (!st) st = lm_model_backward(w, 1.0f / (float)R);
        if (!st) st = lm_model_forward(o, tok + off, tgt + off, 1, &lo);
        if (!st) st = lm_model_backward(o, 1.0f / (float)R);
        CHECK(!st, "rank %d: %s", me, lm_last_error());
        if (st) goto out;
        CHECK(!memcmp(&lw, &lo, sizeof lw), "loss %.9g owner-only from creation, %.9g cut", lo, lw);
        CHECK(!memcmp(lm_model_grads(o), lm_model_grads(w), want * sizeof(float)),
              "variant %d, rank %d: the gradients differ from the cut model's", variant, me);
        /* evaluation layer by layer: the cut model's bits */
        CHECK(!lm_model_gather_experts_by_layer(w, 1) && !lm_model_gather_experts_by_layer(o, 1), "%s",
              lm_last_error());
        st = lm_model_forward(w, tok + off, tgt + off, 0, &lw);
        if (!st) st = lm_model_forward(o, tok + off, tgt + off, 0, &lo);
        if (!st) st = lm_model_score(w, tok + off, tgt + off, nw, aw);
        if (!st) st = lm_model_score(o, tok + off, tgt + off, no, ao);
        CHECK(!st, "rank %d: %s", me, lm_last_error());
        CHECK(!st && !memcmp(&lw, &lo, sizeof lw) && !memcmp(nw, no, N * sizeof *nw) &&
              !memcmp(aw, ao, N * sizeof *aw), "variant %d, rank %d: the evaluation differs from the cut model's",
              variant, me);
        /* a new stage's owner-only model takes the state */
        CHECK(!lm_model_copy_state(o2, o) && !memcmp(lm_model_params(o2), lm_model_params(o), want * sizeof(float)),
              "copying into a new stage's model: %s", lm_last_error());
        printf("     variant %d, rank %d of %d: %zu block bytes at most from creation (cut after creating whole: "
               "%zu)\n", variant, me, R, lm_model_block_peak_bytes(o), lm_model_block_peak_bytes(w));
    out:
        lm_model_free(one);
        lm_model_free(w);
        lm_model_free(o);
        lm_model_free(o2);
        lm_model_free(p);
        free(tok);
        free(tgt);
        free(aw);
        free(ao);
        free(nw);
        free(no);
    }
}

/* Bad layouts for a model created owner-only are refused, naming the cause. */
static void test_bad_owner_only_layouts_are_refused(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    const int Bm = c.batch_size / R, T = c.seq_len;
    lm_model *m = NULL;
    CHECK(lm_model_create_expert_owned(&c, Bm, T, NULL, 3, 0, &m) == LM_ERR_ARG && !m &&
          strstr(lm_last_error(), "8 routed experts"), "3 groups of 8 experts: %s", lm_last_error());
    CHECK(lm_model_create_expert_owned(&c, Bm, T, NULL, 2, 2, &m) == LM_ERR_ARG && !m &&
          strstr(lm_last_error(), "out of range"), "position 2 of 2: %s", lm_last_error());
    CHECK(lm_model_create_expert_owned(&c, Bm, T, NULL, 0, 0, &m) == LM_ERR_ARG && !m, "a group of 0 ranks");
    CHECK(lm_model_plan_expert_owned(&c, Bm, T, LM_DEVICE_CPU, 2, -1, &m) == LM_ERR_ARG && !m,
          "position -1 of 2 planned");
    lm_config dense = c;
    dense.first_k_dense = dense.n_layers;
    CHECK(lm_model_create_expert_owned(&dense, Bm, T, NULL, 2, 0, &m) == LM_ERR_ARG && !m &&
          strstr(lm_last_error(), "MoE layers"), "a model without MoE layers: %s", lm_last_error());
    /* cut already; a handle of another position */
    CHECK(!lm_model_create_expert_owned(&c, Bm, T, NULL, R, (me + 1) % R, &m), "%s", lm_last_error());
    if (!m) return;
    CHECK(lm_model_keep_expert_grads(m, R, (me + 1) % R) == LM_ERR_ARG && strstr(lm_last_error(), "already"),
          "gradients cut again: %s", lm_last_error());
    CHECK(lm_model_keep_expert_weights(m) == LM_ERR_ARG && strstr(lm_last_error(), "already"),
          "weights cut again: %s", lm_last_error());
    if (R > 1)
        CHECK(lm_model_set_expert_parallel(m, comm) == LM_ERR_ARG && strstr(lm_last_error(), "position"),
              "expert parallelism over a handle on which this rank has another position: %s", lm_last_error());
    lm_model_free(m);
}

/* Bytes of the plan entry whose name starts with `name` (0: none). */
static size_t entry_bytes(const lm_model *m, const char *name) {
    for (int i = 0; i < lm_model_num_buffers(m); i++)
        if (!strncmp(lm_model_buffer_at(m, i)->name, name, strlen(name))) return lm_model_buffer_at(m, i)->bytes;
    return 0;
}

/* An owner-only plan on the GPU (a build with the CUDA backend): the fp32
 * parameters and gradients and the bf16 product-format copy all at the kept
 * size (the replicated tensors and the position's experts), the activations
 * the whole plan's; a build without CUDA refuses the GPU plan, naming it. */
static void test_an_owner_only_gpu_plan_keeps_the_slices_in_every_block(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.kda_head_dim = c.qk_head_dim = c.v_head_dim = 32; /* head dimensions the CUDA kernels run */
    lm_model *whole = NULL, *own = NULL;
    if (!lm_backend_cuda_ops()) {
        CHECK(lm_model_plan_expert_owned(&c, 2, 32, LM_DEVICE_CUDA, 2, 0, &own) == LM_ERR_ARG && !own &&
              strstr(lm_last_error(), "CUDA"), "a build without CUDA planned a GPU model: %s", lm_last_error());
        SKIP("this build has no CUDA backend (the plan is refused, as checked)");
    }
    CHECK(!lm_model_plan(&c, 2, 32, LM_DEVICE_CUDA, &whole), "%s", lm_last_error());
    CHECK(!lm_model_plan_expert_owned(&c, 2, 32, LM_DEVICE_CUDA, 4, 1, &own), "%s", lm_last_error());
    if (!whole || !own) goto out;
    const size_t n = lm_model_num_params(own), kept = lm_model_num_kept_params(own);
    size_t experts = 0;
    for (int i = 0; i < lm_model_num_tensors(own); i++) {
        const char *d = strstr(lm_model_tensor_at(own, i)->name, ".moe.");
        if (d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down")))
            experts += lm_model_tensor_at(own, i)->numel;
    }
    CHECK(experts > 0 && kept == n - experts + experts / 4, "kept %zu of %zu floats, experts %zu", kept, n, experts);
    CHECK(entry_bytes(own, "parameters (fp32") == kept * 4 && entry_bytes(own, "gradients (fp32") == kept * 4,
          "fp32 blocks %zu and %zu bytes, kept %zu floats", entry_bytes(own, "parameters (fp32"),
          entry_bytes(own, "gradients (fp32"), kept);
    CHECK(entry_bytes(own, "parameters (product format") == kept * 2 &&
              entry_bytes(whole, "parameters (product format") == n * 2,
          "bf16 copies %zu and %zu bytes, kept %zu of %zu", entry_bytes(own, "parameters (product format"),
          entry_bytes(whole, "parameters (product format"), kept, n);
    CHECK(lm_model_activation_bytes(own) == lm_model_activation_bytes(whole), "activations %zu vs %zu",
          lm_model_activation_bytes(own), lm_model_activation_bytes(whole));
out:
    lm_model_free(whole);
    lm_model_free(own);
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        if (lm_comm_open(LM_COMM_SELF, &comm)) {
            fprintf(stderr, "cannot open the one-rank engine: %s\n", lm_last_error());
            return 1;
        }
    } else if (!lm_comm_engine_available(LM_COMM_MPI)) {
        test_skip_all("built without MPI (the MPI engine is not compiled)");
    } else if (lm_comm_open(LM_COMM_MPI, &comm)) {
        fprintf(stderr, "cannot open MPI: %s\n", lm_last_error());
        return 1;
    } else {
        R = lm_comm_size(comm);
        me = lm_comm_rank(comm);
        if (me) freopen("/dev/null", "w", stdout);
        if (R != want_ranks) {
            fprintf(stderr, "started on %d ranks, expected %d\n", R, want_ranks);
            lm_comm_close(comm);
            return 1;
        }
    }
    RUN(test_plain_layer_equals_one_process);
    RUN(test_latent_and_shared_experts_equal_one_process);
    RUN(test_empty_experts_and_one_expert_taking_most_rows);
    RUN(test_ranks_without_tokens);
    RUN(test_indivisible_experts_are_refused);
    RUN(test_model_keeps_only_its_own_experts_gradients);
    RUN(test_model_keeps_only_its_own_experts_weights);
    RUN(test_evaluation_gathers_one_layer_at_a_time);
    RUN(test_the_memory_plan_of_a_rank_holds_its_experts_gradients);
    RUN(test_a_model_created_owner_only_allocates_only_its_share);
    RUN(test_bad_owner_only_layouts_are_refused);
    RUN(test_an_owner_only_gpu_plan_keeps_the_slices_in_every_block);
    if (comm) {
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(comm);
    }
    return test_summary();
}
