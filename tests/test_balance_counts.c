/* Quantile balancing with the counting done elsewhere (the GPU path):
 * lm_balance_bin_geometry + the documented bin rule reproduce
 * lm_balance_observe's histograms exactly, and lm_balance_observe_counts fed
 * with them ends the step with the same bias, bit for bit. */
#include "longmoe/balance.h"
#include "longmoe/moe.h"
#include "test.h"

enum { M = 700, N = 32, K = 4, BINS = 64 };

static void random_scores(float *s, lm_rng *r, int64_t m, int n) {
    for (int64_t q = 0; q < m * n; q++) s[q] = (float)lm_rng_uniform(r);
}

/* the rule of include/longmoe/moe_cuda.h (lm_cuda_balance_histogram), on the CPU */
static void count_by_rule(int32_t *counts, int32_t *load, const float *s, const float *b, const float *lo,
                          const float *w, int64_t m, int n, int k, int bins, int zoom) {
    for (int64_t i = 0; i < m; i++) {
        int32_t idx[LM_MOE_MAX_TOPK + 1];
        float val[LM_MOE_MAX_TOPK + 1];
        lm_topk_row(idx, val, s + i * n, b, n, k + 1);
        for (int t = 0; t < k; t++) load[idx[t]]++;
        float a = val[k];
        for (int j = 0; j < n; j++) {
            float x = (a - s[i * n + j] - lo[j]) * (1.0f / w[j]);
            int bin = zoom ? (x < 0.0f ? 0 : x >= (float)(bins - 2) ? bins - 1 : 1 + (int)x)
                           : (x < 0.0f ? 0 : x >= (float)bins ? bins - 1 : (int)x);
            counts[(int64_t)j * bins + bin]++;
        }
    }
}

static void check_estimator(lm_qb_estimator est) {
    lm_balance_config c = lm_balance_config_default(LM_BALANCE_QUANTILE, N, K, M);
    c.estimator = est;
    c.bins = BINS;
    lm_balance_state a, b;
    CHECK(!lm_balance_init(&a, &c) && !lm_balance_init(&b, &c), "%s", lm_last_error());
    static float s[M * N], lo[N], w[N];
    static int32_t counts[N * BINS], load[N];
    lm_rng r;
    lm_rng_seed(&r, 77 + est);
    for (int step = 0; step < 3; step++) {
        CHECK(!lm_balance_bin_geometry(&b, lo, w), "%s", lm_last_error());
        for (int mb = 0; mb < 2; mb++) {
            random_scores(s, &r, M, N);
            CHECK(!lm_balance_observe(&a, s, M, 1), "%s", lm_last_error());
            memset(counts, 0, sizeof counts);
            memset(load, 0, sizeof load);
            count_by_rule(counts, load, s, b.bias, lo, w, M, N, K, BINS, est == LM_QB_ZOOM);
            CHECK(!lm_balance_observe_counts(&b, counts, load, M, 1, 0.0), "%s", lm_last_error());
        }
        CHECK(!memcmp(a.counts, b.counts, sizeof counts), "step %d: histograms equal the CPU pass's", step);
        CHECK(!memcmp(a.load, b.load, sizeof load), "step %d: loads equal", step);
        lm_balance_stats sa, sb;
        CHECK(!lm_balance_step_end(&a, 1, &sa) && !lm_balance_step_end(&b, 1, &sb), "%s", lm_last_error());
        CHECK(sa.updated && sb.updated, "both updated b");
        CHECK(!memcmp(a.bias, b.bias, N * sizeof(float)), "step %d: the same b bit for bit", step);
    }
    lm_balance_free(&a);
    lm_balance_free(&b);
}

static void test_counts_from_outside_give_the_same_bias_k3(void) { check_estimator(LM_QB_HISTOGRAM); }
static void test_counts_from_outside_give_the_same_bias_zoom(void) { check_estimator(LM_QB_ZOOM); }

static void test_observe_counts_refuses_bad_input(void) {
    lm_balance_config c = lm_balance_config_default(LM_BALANCE_QUANTILE, N, K, M);
    c.bins = BINS;
    lm_balance_state st;
    CHECK(!lm_balance_init(&st, &c), "%s", lm_last_error());
    static int32_t counts[N * BINS], load[N];
    load[0] = 3; /* sums to 3, not m k = 4 */
    CHECK(lm_balance_observe_counts(&st, counts, load, 1, 1, 0.0) == LM_ERR_ARG, "load sum checked");
    load[0] = K;
    CHECK(lm_balance_observe_counts(&st, NULL, load, 1, 1, 0.0) == LM_ERR_ARG, "counts required when training");
    CHECK(lm_balance_observe_counts(&st, counts, load, 1, 0, 0.0) == LM_ERR_ARG, "no counts in eval");
    CHECK(!lm_balance_observe_counts(&st, NULL, load, 1, 0, 0.0), "eval: load only: %s", lm_last_error());
    CHECK(st.load[0] == K && st.tokens == 1, "load added");
    lm_balance_free(&st);
    c.estimator = LM_QB_EXACT;
    CHECK(!lm_balance_init(&st, &c), "%s", lm_last_error());
    float lo[N], w[N];
    CHECK(lm_balance_bin_geometry(&st, lo, w) == LM_ERR_ARG, "exact estimator has no bins");
    lm_balance_free(&st);
}

int main(void) {
    RUN(test_counts_from_outside_give_the_same_bias_k3);
    RUN(test_counts_from_outside_give_the_same_bias_zoom);
    RUN(test_observe_counts_refuses_bad_input);
    return test_summary();
}
