/* Router balancing (quantile, sign, aux) and its monitoring: properties of
 * SPEC §4 and of include/longmoe/balance.h. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/balance.h"
#include "longmoe/moe.h"
#include "test.h"

/* Router scores s = sigmoid(tok * N(0,1) + offset_j) with per-expert offsets
 * offset_j = spread * N(0,1) (drawn from dist_seed: the distribution), plus
 * `favour` on expert 0 for every token; the token noise comes from
 * batch_seed (fresh batches of one distribution share dist_seed). Rows are
 * seeded separately so the generation runs in parallel. */
static float *make_scores_batch(int64_t m, int n, double tok, double spread, double favour,
                                uint64_t dist_seed, uint64_t seed) {
    float *s = mallocCheck((size_t)m * n * sizeof *s);
    double *off = mallocCheck((size_t)n * sizeof *off);
    lm_rng r;
    lm_rng_seed(&r, dist_seed * 7919 + 1);
    for (int j = 0; j < n; j++) off[j] = spread * lm_rng_normal(&r);
    off[0] += favour;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        lm_rng ri;
        lm_rng_seed(&ri, seed * 1000003ull + (uint64_t)i);
        for (int j = 0; j < n; j++) {
            double logit = tok * lm_rng_normal(&ri) + off[j];
            s[i * n + j] = (float)(1.0 / (1.0 + exp(-logit)));
        }
    }
    free(off);
    return s;
}

static float *make_scores(int64_t m, int n, double tok, double spread, double favour, uint64_t seed) {
    return make_scores_batch(m, n, tok, spread, favour, seed, seed);
}

/* Repeat the update on one fixed batch (as an offline solver would); curve[t]
 * is the MaxVio_batch after t updates. Stops once it is below `stop` (0: never);
 * returns the number of points written. */
static int fixed_batch_curve(const float *s, int64_t m, int n, int k, lm_qb_estimator est, int steps,
                             double stop, double *curve) {
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, m);
    cfg.estimator = est;
    lm_balance_state st;
    CHECK(lm_balance_init(&st, &cfg) == LM_OK, "%s", lm_last_error());
    lm_balance_stats stats;
    for (int t = 0; t <= steps; t++) {
        CHECK(lm_balance_observe(&st, s, m, 1) == LM_OK, "%s", lm_last_error());
        lm_balance_step_end(&st, 1, &stats);
        curve[t] = stats.maxvio_batch; /* routed with the b before this update */
        if (curve[t] < stop) {
            lm_balance_free(&st);
            return t + 1;
        }
    }
    lm_balance_free(&st);
    return steps + 1;
}

static void print_curve(const char *what, const double *c, int len) {
    printf("    %-28s", what);
    for (int t = 0; t < len; t++) printf(" %.3f", c[t]);
    printf("\n");
}

static void test_hand_histograms_give_the_spec_bias(void) {
    /* SPEC §4 step 4-5 by hand: n = 2, k = 1, B = 4 bins over [-1, 1] (b = 0):
     * expert 0 counts [0,2,2,0] -> bin 1 reaches q = 2: b = -1 + 2 * 0.5 = 0;
     * expert 1 counts [2,2,0,0] -> bin 0: b = -1 + 1 * 0.5 = -0.5; centred: [0.25, -0.25] */
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, 2, 1, 4);
    cfg.bins = 4;
    lm_balance_state st;
    CHECK(lm_balance_init(&st, &cfg) == LM_OK, "%s", lm_last_error());
    size_t count;
    int32_t *buf = lm_balance_reduce_buffer(&st, &count);
    CHECK(count == 2 * 4 + 2, "reduce buffer holds n*B + n ints, got %zu", count);
    const int32_t hand[10] = {0, 2, 2, 0, 2, 2, 0, 0, /* loads */ 2, 2};
    memcpy(buf, hand, sizeof hand); /* as the data-parallel all-reduce would deliver */
    lm_balance_stats stats;
    lm_balance_step_end(&st, 1, &stats);
    CHECK_CLOSE(st.bias[0], 0.25, 1e-7, 0, "b[0]");
    CHECK_CLOSE(st.bias[1], -0.25, 1e-7, 0, "b[1]");
    CHECK(stats.updated == 1 && stats.tokens == 4, "updated %d tokens %lld", stats.updated,
          (long long)stats.tokens);
    /* the estimator alone, with a fractional target: q = 1.5 in counts [0,2,2,0] -> bin 1, frac 0.75 */
    CHECK_CLOSE(lm_qb_histogram_quantile(hand, 4, -1.0, 0.5, 1.5), -1.0 + 1.75 * 0.5, 1e-12, 0, "q=1.5");
    lm_balance_free(&st);
}

static void test_exact_quantile_settles_mild_fixed_batch(void) {
    /* (m, n, k) = (16384, 256, 8), mild scores: MaxVio_batch < 0.03 within 10 updates */
    int64_t m = 16384;
    int n = 256, k = 8;
    float *s = make_scores(m, n, 1.0, 0.3, 0.0, 11);
    double curve[11];
    int len = fixed_batch_curve(s, m, n, k, LM_QB_EXACT, 10, 0.03, curve);
    print_curve("exact, mild (16384,256,8):", curve, len);
    double best = curve[len - 1];
    CHECK(curve[0] > 0.3, "the batch starts imbalanced (MaxVio %.3f)", curve[0]);
    CHECK(best < 0.03, "MaxVio_batch within 10 updates: best %.4f", best);
    free(s);
}

static void test_exact_quantile_settles_skewed_fixed_batch_1024_experts(void) {
    /* (16384, 1024, 16), strongly skewed scores: MaxVio_batch < 0.05 within 25 updates */
    int64_t m = 16384;
    int n = 1024, k = 16;
    float *s = make_scores(m, n, 1.0, 1.5, 0.0, 12);
    double curve[26];
    int len = fixed_batch_curve(s, m, n, k, LM_QB_EXACT, 25, 0.05, curve);
    print_curve("exact, skewed (16384,1024,16):", curve, len);
    double best = curve[len - 1];
    CHECK(curve[0] > 5.0, "the batch starts strongly imbalanced (MaxVio %.3f)", curve[0]);
    CHECK(best < 0.05, "MaxVio_batch within 25 updates: best %.4f", best);
    free(s);
}

static void test_quantile_beats_sign_on_fresh_adversarial_batches(void) {
    /* one expert favoured by every token; a fresh batch each step */
    int64_t m = 16384;
    int n = 64, k = 4, steps = 6;
    lm_balance_state q, sg;
    lm_balance_config cq = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, m);
    lm_balance_config cs = lm_balance_config_default(LM_BALANCE_SIGN, n, k, m);
    CHECK(lm_balance_init(&q, &cq) == LM_OK && lm_balance_init(&sg, &cs) == LM_OK, "%s", lm_last_error());
    double cur_q[6], cur_s[6];
    for (int t = 0; t < steps; t++) {
        float *s = make_scores_batch(m, n, 1.0, 0.2, 4.0, 100, 200 + (uint64_t)t);
        lm_balance_stats a, b;
        lm_balance_observe(&q, s, m, 1);
        lm_balance_step_end(&q, 1, &a);
        lm_balance_observe(&sg, s, m, 1);
        lm_balance_step_end(&sg, 1, &b);
        cur_q[t] = a.maxvio_batch;
        cur_s[t] = b.maxvio_batch;
        free(s);
    }
    print_curve("fresh adversarial, quantile:", cur_q, steps);
    print_curve("fresh adversarial, sign:", cur_s, steps);
    CHECK(cur_q[0] > 5.0 && cur_s[0] > 5.0, "expert 0 starts overloaded: %.2f", cur_q[0]);
    int within = 0;
    for (int t = 1; t <= 5; t++) within |= cur_q[t] < 0.2;
    CHECK(within, "quantile MaxVio_batch under 0.2 within 5 steps (step 5: %.3f)", cur_q[5]);
    CHECK(cur_q[5] < 0.2, "quantile stays balanced at step 5: %.3f", cur_q[5]);
    CHECK(cur_s[5] > 2.0, "sign rule still far from balance after 5 steps: %.3f", cur_s[5]);
    lm_balance_free(&q);
    lm_balance_free(&sg);
}

static void test_bias_frozen_in_eval_and_without_tokens(void) {
    int64_t m = 512;
    int n = 32, k = 4;
    float *s = make_scores(m, n, 1.0, 1.0, 0.0, 21);
    lm_balance_mode modes[2] = {LM_BALANCE_QUANTILE, LM_BALANCE_SIGN};
    for (int mi = 0; mi < 2; mi++) {
        lm_balance_config cfg = lm_balance_config_default(modes[mi], n, k, m);
        lm_balance_state st;
        lm_balance_init(&st, &cfg);
        /* one training step first, so b is not trivially zero */
        lm_balance_observe(&st, s, m, 1);
        lm_balance_step_end(&st, 1, NULL);
        float before[32];
        memcpy(before, st.bias, sizeof before);
        int moved = 0;
        for (int j = 0; j < n; j++) moved |= before[j] != 0.0f;
        CHECK(moved, "%s: a training step moved b", lm_balance_mode_name(modes[mi]));
        lm_balance_stats stats;
        for (int t = 0; t < 3; t++) {
            lm_balance_observe(&st, s, m, 0);
            lm_balance_step_end(&st, 0, &stats);
        }
        CHECK(!memcmp(before, st.bias, sizeof before), "%s: b changed in eval mode",
              lm_balance_mode_name(modes[mi]));
        CHECK(stats.updated == 0 && stats.tokens == m, "eval steps are monitored, not applied");
        /* a layer that saw no tokens keeps b */
        lm_balance_step_end(&st, 1, &stats);
        CHECK(!memcmp(before, st.bias, sizeof before), "%s: b changed without tokens",
              lm_balance_mode_name(modes[mi]));
        lm_balance_free(&st);
    }
    free(s);
}

static void test_microbatches_and_rank_sum_equal_one_batch(void) {
    /* accumulating two micro-batches, or summing two ranks' buffers, gives the
     * same b as observing the whole batch at once (histogram and zoom estimators) */
    int64_t m = 2048;
    int n = 64, k = 6;
    float *s = make_scores(m, n, 1.0, 0.8, 0.0, 31);
    lm_qb_estimator ests[2] = {LM_QB_HISTOGRAM, LM_QB_ZOOM};
    for (int e = 0; e < 2; e++) {
        lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, m);
        cfg.estimator = ests[e];
        lm_balance_state whole, micro, r0, r1;
        lm_balance_init(&whole, &cfg);
        lm_balance_init(&micro, &cfg);
        lm_balance_init(&r0, &cfg);
        lm_balance_init(&r1, &cfg);
        for (int step = 0; step < 3; step++) {
            lm_balance_observe(&whole, s, m, 1);
            lm_balance_observe(&micro, s, 700, 1);
            lm_balance_observe(&micro, s + 700 * n, m - 700, 1);
            lm_balance_observe(&r0, s, 1000, 1);
            lm_balance_observe(&r1, s + 1000 * n, m - 1000, 1);
            /* the all-reduce: SUM of the integer buffers, then every rank ends the step */
            size_t cnt;
            int32_t *b0 = lm_balance_reduce_buffer(&r0, &cnt), *b1 = lm_balance_reduce_buffer(&r1, NULL);
            for (size_t q = 0; q < cnt; q++) {
                int32_t sum = b0[q] + b1[q];
                b0[q] = b1[q] = sum;
            }
            lm_balance_step_end(&whole, 1, NULL);
            lm_balance_step_end(&micro, 1, NULL);
            lm_balance_step_end(&r0, 1, NULL);
            lm_balance_step_end(&r1, 1, NULL);
        }
        size_t bytes = (size_t)n * sizeof(float);
        CHECK(!memcmp(whole.bias, micro.bias, bytes), "estimator %d: micro-batches differ", e);
        CHECK(!memcmp(whole.bias, r0.bias, bytes) && !memcmp(r0.bias, r1.bias, bytes),
              "estimator %d: summed ranks differ", e);
        double mean = 0;
        for (int j = 0; j < n; j++) mean += whole.bias[j];
        CHECK(fabs(mean / n) < 1e-6, "b is mean-centred: mean %.3g", mean / n);
        lm_balance_free(&whole);
        lm_balance_free(&micro);
        lm_balance_free(&r0);
        lm_balance_free(&r1);
    }
    free(s);
}

static void test_sign_rule_moves_each_bias_by_u_toward_the_mean(void) {
    int64_t m = 1024;
    int n = 16, k = 2;
    float *s = make_scores(m, n, 1.0, 1.0, 0.0, 41);
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_SIGN, n, k, m);
    lm_balance_state st;
    lm_balance_init(&st, &cfg);
    lm_balance_stats stats;
    lm_balance_observe(&st, s, m, 1);
    lm_balance_step_end(&st, 1, &stats);
    double mean = (double)m * k / n;
    for (int j = 0; j < n; j++) {
        double want = stats.load[j] < mean ? 1e-3 : stats.load[j] > mean ? -1e-3 : 0.0;
        CHECK_CLOSE(st.bias[j], want, 1e-9, 0, "sign-rule b_j");
    }
    lm_balance_free(&st);
    free(s);
}

static void test_monitoring_numbers(void) {
    /* the definitions, on a hand load: [0, 2, 4, 6], mean 3 */
    const int32_t load[4] = {0, 2, 4, 6};
    double mv, cv;
    int32_t lo, hi;
    int dead;
    lm_balance_load_stats(load, 4, &mv, &cv, &lo, &hi, &dead);
    CHECK_CLOSE(mv, 1.0, 1e-12, 0, "MaxVio = 6/3 - 1");
    CHECK_CLOSE(cv, sqrt(5.0) / 3.0, 1e-12, 0, "CV = std/mean");
    CHECK(lo == 0 && hi == 6 && dead == 1, "min %d max %d dead %d", lo, hi, dead);

    /* step stats: uniform scores have entropy log n; two steps whose loads
     * complement each other have MaxVio_global 0 while each batch is imbalanced */
    int n = 4, k = 1;
    int64_t m = 8;
    float s1[8 * 4], s2[8 * 4];
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++) {
            /* step 1: tokens go to experts 0 or 1; step 2: to experts 2 or 3 */
            int win1 = i % 2, win2 = 2 + i % 2;
            s1[i * 4 + j] = j == win1 ? 0.6f : 0.5f;
            s2[i * 4 + j] = j == win2 ? 0.6f : 0.5f;
        }
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_NONE, n, k, m);
    cfg.interval = 2;
    lm_balance_state st;
    lm_balance_init(&st, &cfg);
    lm_balance_stats a, b;
    lm_balance_observe(&st, s1, m, 1);
    lm_balance_step_end(&st, 1, &a);
    lm_balance_observe(&st, s2, m, 1);
    lm_balance_step_end(&st, 1, &b);
    CHECK_CLOSE(a.maxvio_batch, 1.0, 1e-12, 0, "step 1 MaxVio_batch");
    CHECK(a.dead == 2 && a.min_load == 0 && a.max_load == 4, "dead %d min %d max %d", a.dead, a.min_load,
          a.max_load);
    CHECK_CLOSE(b.maxvio_batch, 1.0, 1e-12, 0, "step 2 MaxVio_batch");
    CHECK_CLOSE(b.maxvio_global, 0.0, 1e-12, 0, "MaxVio_global over the interval");
    double pi_hi = 0.6 / 2.1, pi_lo = 0.5 / 2.1;
    double want_h = -(pi_hi * log(pi_hi) + 3 * pi_lo * log(pi_lo));
    CHECK_CLOSE(a.router_entropy, want_h, 1e-6, 0, "router entropy");
    CHECK(b.step == 2 && b.tokens == 8 && b.load[2] == 4, "step %lld tokens %lld", (long long)b.step,
          (long long)b.tokens);
    lm_balance_free(&st);
}

static void test_aux_loss_gradient_matches_finite_differences(void) {
    int64_t m = 24;
    int n = 8, k = 2;
    float alpha = 0.01f;
    float *s = make_scores(m, n, 1.0, 0.5, 0.0, 51);
    int32_t topk[24 * 2];
    lm_router_select(topk, NULL, s, NULL, m, n, k, 1.0f);
    float *grad = callocCheck((size_t)(m * n), sizeof *grad);
    float loss;
    CHECK(lm_balance_aux_loss(&loss, grad, s, topk, m, n, k, alpha) == LM_OK, "%s", lm_last_error());
    /* float64 reference of the loss, as a function of s with f fixed */
    double f[8] = {0};
    for (int g = 0; g < m * k; g++) f[topk[g]] += 1.0 / ((double)m * k);
    double *sd = mallocCheck((size_t)(m * n) * sizeof *sd);
    for (int q = 0; q < m * n; q++) sd[q] = s[q];
#define AUX_REF(out)                                                              \
    do {                                                                          \
        double L_ = 0;                                                            \
        for (int i_ = 0; i_ < m; i_++) {                                          \
            double S_ = 0;                                                        \
            for (int j_ = 0; j_ < n; j_++) S_ += sd[i_ * n + j_];                 \
            for (int j_ = 0; j_ < n; j_++) L_ += f[j_] * sd[i_ * n + j_] / S_ / m; \
        }                                                                         \
        (out) = alpha * n * L_;                                                   \
    } while (0)
    double L;
    AUX_REF(L);
    CHECK_CLOSE(loss, L, 1e-7, 1e-5, "aux loss");
    double worst = 0;
    for (int q = 0; q < m * n; q += 7) {
        double keep = sd[q], hp, hm, h = 1e-5;
        sd[q] = keep + h;
        AUX_REF(hp);
        sd[q] = keep - h;
        AUX_REF(hm);
        sd[q] = keep;
        double fd = (hp - hm) / (2 * h), err = fabs(fd - grad[q]) / (fabs(fd) + 1e-6);
        worst = err > worst ? err : worst;
    }
#undef AUX_REF
    CHECK(worst < 1e-3, "aux gradient vs finite differences: worst relative error %.3g", worst);
    free(sd);
    free(grad);
    free(s);
}

static void test_zoom_removes_the_histogram_floor_on_init_like_scores(void) {
    /* scores concentrated as at initialisation (logits ~ 0.02 N(0,1)): the K3
     * histogram's bins are coarse against the spread; the zoom windows are not */
    int64_t m = 16384;
    int n = 256, k = 8, steps = 10;
    float *s = make_scores(m, n, 0.02, 0.01, 0.0, 61);
    double hist[11], zoom[11], exact[11];
    fixed_batch_curve(s, m, n, k, LM_QB_HISTOGRAM, steps, 0, hist);
    fixed_batch_curve(s, m, n, k, LM_QB_ZOOM, steps, 0, zoom);
    fixed_batch_curve(s, m, n, k, LM_QB_EXACT, steps, 0, exact);
    print_curve("init-like, histogram:", hist, steps + 1);
    print_curve("init-like, zoom:", zoom, steps + 1);
    print_curve("init-like, exact:", exact, steps + 1);
    double hist_floor = 1e9, zoom_last = zoom[steps];
    for (int t = steps - 4; t <= steps; t++) hist_floor = hist[t] < hist_floor ? hist[t] : hist_floor;
    CHECK(hist_floor > 0.04, "the K3 histogram has a floor here (best of the last 5: %.3f)", hist_floor);
    CHECK(zoom_last < 0.03 && zoom_last < hist_floor / 2, "zoom settles below the floor: %.3f", zoom_last);
    free(s);
}

static void test_config_errors_name_the_bad_value(void) {
    lm_balance_state st;
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, 8, 8, 16);
    CHECK(lm_balance_init(&st, &cfg) == LM_ERR_ARG && strstr(lm_last_error(), "top_k"), "k = n in quantile");
    cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, 8, 2, 16);
    cfg.bins = 2;
    CHECK(lm_balance_init(&st, &cfg) == LM_ERR_ARG && strstr(lm_last_error(), "bins"), "bins 2");
    cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, 8, 2, 16);
    cfg.ema = 1.0f;
    CHECK(lm_balance_init(&st, &cfg) == LM_ERR_ARG && strstr(lm_last_error(), "ema"), "ema 1");
    cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, 8, 2, 16);
    CHECK(lm_balance_init(&st, &cfg) == LM_OK, "%s", lm_last_error());
    float s[32 * 8];
    for (int q = 0; q < 32 * 8; q++) s[q] = 0.5f;
    CHECK(lm_balance_observe(&st, s, 32, 1) == LM_ERR_ARG && strstr(lm_last_error(), "max_tokens"),
          "too many tokens");
    s[3] = NAN;
    CHECK(lm_balance_observe(&st, s, 16, 1) == LM_ERR_NUMERIC && strstr(lm_last_error(), "token 0"),
          "NaN score");
    lm_balance_free(&st);
    lm_balance_mode mode;
    CHECK(lm_balance_mode_from_name("quantile", &mode) == 0 && mode == LM_BALANCE_QUANTILE, "name");
    CHECK(lm_balance_mode_from_name("quantiles", &mode) != 0, "bad name rejected");
}

static void test_ema_blends_old_and_new_bias(void) {
    /* from b = 0, EMA e gives (1 - e) times the plain update (centring is linear) */
    int64_t m = 1024;
    int n = 32, k = 4;
    float *s = make_scores(m, n, 1.0, 1.0, 0.0, 71);
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, m);
    lm_balance_state plain, ema;
    lm_balance_init(&plain, &cfg);
    cfg.ema = 0.75f;
    lm_balance_init(&ema, &cfg);
    lm_balance_observe(&plain, s, m, 1);
    lm_balance_step_end(&plain, 1, NULL);
    lm_balance_observe(&ema, s, m, 1);
    lm_balance_step_end(&ema, 1, NULL);
    double worst = 0, size = 0;
    for (int j = 0; j < n; j++) {
        worst = fmax(worst, fabs(ema.bias[j] - 0.25 * plain.bias[j]));
        size = fmax(size, fabs(plain.bias[j]));
    }
    CHECK(size > 0.01 && worst < 1e-6, "EMA 0.75: max |b_ema - b/4| = %.3g (|b| up to %.3g)", worst, size);
    lm_balance_free(&plain);
    lm_balance_free(&ema);
    free(s);
}

static void test_zero_scores_from_sigmoid_underflow_are_accepted(void) {
    /* sigmoid of a very negative logit is exactly 0 in fp32: a valid score */
    int n = 4, k = 1;
    float s[2 * 4] = {0.0f, 0.9f, 0.2f, 0.1f, 0.0f, 0.0f, 0.0f, 0.0f};
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, 2);
    lm_balance_state st;
    lm_balance_init(&st, &cfg);
    lm_balance_stats stats;
    CHECK(lm_balance_observe(&st, s, 2, 1) == LM_OK, "%s", lm_last_error());
    lm_balance_step_end(&st, 1, &stats);
    CHECK(isfinite(stats.router_entropy) && stats.tokens == 2, "entropy %g", stats.router_entropy);
    for (int j = 0; j < n; j++) CHECK(isfinite(st.bias[j]), "b[%d] finite", j);
    lm_balance_free(&st);
}

int main(void) {
    RUN(test_hand_histograms_give_the_spec_bias);
    RUN(test_monitoring_numbers);
    RUN(test_sign_rule_moves_each_bias_by_u_toward_the_mean);
    RUN(test_bias_frozen_in_eval_and_without_tokens);
    RUN(test_microbatches_and_rank_sum_equal_one_batch);
    RUN(test_aux_loss_gradient_matches_finite_differences);
    RUN(test_config_errors_name_the_bad_value);
    RUN(test_ema_blends_old_and_new_bias);
    RUN(test_zero_scores_from_sigmoid_underflow_are_accepted);
    RUN(test_quantile_beats_sign_on_fresh_adversarial_batches);
    RUN(test_exact_quantile_settles_mild_fixed_batch);
    RUN(test_zoom_removes_the_histogram_floor_on_init_like_scores);
    RUN(test_exact_quantile_settles_skewed_fixed_batch_1024_experts);
    return test_summary();
}
