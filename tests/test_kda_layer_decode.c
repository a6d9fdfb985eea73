/* KDA layer decode: a chunked prefill of the first P tokens followed by
 * one-token recurrent steps gives the full chunked forward's outputs at every
 * position (fp32 tolerance), for both gates, several prefix lengths (1, not a
 * multiple of the chunk, a whole chunk) and conv widths; the state is captured
 * per sequence; misuse is reported. */
#include "longmoe/kda_layer.h"
#include "test.h"

enum { B = 2, T = 41, D = 12, H = 2, KD = 8 };

static float *random_params(const lm_kda_layer_config *c, lm_rng *rng) {
    lm_tensor_spec specs[LM_KDA_LAYER_NPARAMS];
    size_t np = lm_kda_layer_specs(c, specs), off = 0;
    float *params = malloc(np * sizeof(float));
    /* weights larger than the init: outputs well above rounding, gates in range */
    for (int s = 0; s < LM_KDA_LAYER_NPARAMS; s++) {
        size_t n = (size_t)(specs[s].rows * specs[s].cols);
        for (size_t i = 0; i < n; i++)
            params[off + i] = specs[s].init_value +
                              (specs[s].role == LM_ROLE_MATRIX ? 0.3f : 0.3f) * (float)lm_rng_normal(rng);
        off += n;
    }
    return params;
}

/* max |a - b| / max |b| over n floats */
static double rel_max_diff(const float *a, const float *b, size_t n) {
    double mx = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (isnan(a[i])) return INFINITY;
        mx = e > mx ? e : mx;
        scale = fabs(b[i]) > scale ? fabs(b[i]) : scale;
    }
    return mx / (scale > 0 ? scale : 1);
}

static void check_decode(lm_kda_gate gate, int W, int chunk, uint64_t seed) {
    lm_kda_layer_config c = {D, H, KD, W, chunk, gate, -5.0f, 1e-6f, NULL, 0, NULL};
    lm_rng rng;
    lm_rng_seed(&rng, seed);
    float *params = random_params(&c, &rng);
    lm_kda_layer_params p;
    lm_kda_layer_params_map(&c, params, &p);
    float *x = malloc(sizeof(float) * B * T * D), *y = malloc(sizeof(float) * B * T * D);
    for (int i = 0; i < B * T * D; i++) x[i] = (float)lm_rng_normal(&rng);
    float *acts = malloc(lm_kda_layer_act_floats(&c, B, T) * sizeof(float));
    lm_kda_layer_acts a;
    lm_kda_layer_acts_map(&c, B, T, acts, &a);
    CHECK(!lm_kda_layer_forward(&c, &p, &a, x, B, T, y), "%s", lm_last_error());

    float *cache_mem = malloc(lm_kda_layer_cache_floats(&c, B) * sizeof(float));
    float *scratch = malloc(lm_kda_layer_step_scratch_floats(&c, B) * sizeof(float));
    float *xp = malloc(sizeof(float) * B * T * D), *yp = malloc(sizeof(float) * B * T * D);
    float *yd = malloc(sizeof(float) * B * T * D); /* decoded outputs in [B,T,d] */
    float xs[B * D], ys[B * D];
    const int prefixes[] = {0, 1, 5, chunk, chunk + 3, T};
    for (size_t pi = 0; pi < sizeof prefixes / sizeof prefixes[0]; pi++) {
        int P = prefixes[pi];
        lm_kda_layer_cache cache;
        CHECK(!lm_kda_layer_cache_init(&c, &cache, B, cache_mem), "%s", lm_last_error());
        if (P > 0) {
            for (int b = 0; b < B; b++)
                memcpy(xp + (size_t)b * P * D, x + (size_t)b * T * D, sizeof(float) * P * D);
            lm_kda_layer_acts ap;
            lm_kda_layer_acts_map(&c, B, P, acts, &ap);
            CHECK(!lm_kda_layer_prefill(&c, &p, &ap, &cache, xp, P, yp), "%s", lm_last_error());
            CHECK(cache.len == P, "cache length %d after a prefill of %d", cache.len, P);
            for (int b = 0; b < B; b++)
                memcpy(yd + (size_t)b * T * D, yp + (size_t)b * P * D, sizeof(float) * P * D);
        }
        for (int t = P; t < T; t++) {
            for (int b = 0; b < B; b++) memcpy(xs + b * D, x + ((size_t)b * T + t) * D, sizeof xs / B);
            CHECK(!lm_kda_layer_step(&c, &p, &cache, xs, ys, scratch), "%s", lm_last_error());
            for (int b = 0; b < B; b++) memcpy(yd + ((size_t)b * T + t) * D, ys + b * D, sizeof ys / B);
        }
        CHECK(cache.len == T, "cache length %d after %d tokens", cache.len, T);
        double e = rel_max_diff(yd, y, (size_t)B * T * D);
        CHECK(e < 2e-5, "%s gate, W=%d, chunk %d, prefix %d: max diff %.3g of the output scale",
              gate ? "softplus" : "bounded", W, chunk, P, e);
    }
    /* a second prefill into a filled cache is an error, and so is T = 0 */
    lm_kda_layer_cache cache;
    lm_kda_layer_cache_init(&c, &cache, B, cache_mem);
    lm_kda_layer_acts ap;
    lm_kda_layer_acts_map(&c, B, 3, acts, &ap);
    CHECK(lm_kda_layer_prefill(&c, &p, &ap, &cache, x, 0, yp) == LM_ERR_ARG, "T = 0 accepted");
    CHECK(!lm_kda_layer_prefill(&c, &p, &ap, &cache, x, 3, yp), "%s", lm_last_error());
    CHECK(lm_kda_layer_prefill(&c, &p, &ap, &cache, x, 3, yp) == LM_ERR_ARG, "prefill into a filled cache accepted");
    CHECK(strstr(lm_last_error(), "already holds 3") != NULL, "message: %s", lm_last_error());
    free(params); free(x); free(y); free(acts); free(cache_mem); free(scratch); free(xp); free(yp); free(yd);
}

/* Sequences are independent: changing sequence 1's tokens leaves sequence 0's
 * decoded outputs unchanged (the state and conv tails are per sequence). */
static void test_sequences_keep_separate_states(void) {
    lm_kda_layer_config c = {D, H, KD, 4, 16, LM_KDA_GATE_BOUNDED, -5.0f, 1e-6f, NULL, 0, NULL};
    lm_rng rng;
    lm_rng_seed(&rng, 77);
    float *params = random_params(&c, &rng);
    lm_kda_layer_params p;
    lm_kda_layer_params_map(&c, params, &p);
    float *cache_mem = malloc(lm_kda_layer_cache_floats(&c, B) * sizeof(float));
    float *scratch = malloc(lm_kda_layer_step_scratch_floats(&c, B) * sizeof(float));
    float x[6][B * D], y0[6][D];
    for (int t = 0; t < 6; t++)
        for (int i = 0; i < B * D; i++) x[t][i] = (float)lm_rng_normal(&rng);
    for (int pass = 0; pass < 2; pass++) {
        lm_kda_layer_cache cache;
        lm_kda_layer_cache_init(&c, &cache, B, cache_mem);
        for (int t = 0; t < 6; t++) {
            float ys[B * D];
            if (pass)
                for (int i = D; i < B * D; i++) x[t][i] = (float)lm_rng_normal(&rng);
            CHECK(!lm_kda_layer_step(&c, &p, &cache, x[t], ys, scratch), "%s", lm_last_error());
            if (!pass) memcpy(y0[t], ys, sizeof y0[t]);
            else
                for (int i = 0; i < D; i++)
                    CHECK(ys[i] == y0[t][i], "t %d channel %d: %g vs %g", t, i, ys[i], y0[t][i]);
        }
    }
    free(params); free(cache_mem); free(scratch);
}

static void test_prefill_then_steps_equal_forward_bounded(void) {
    check_decode(LM_KDA_GATE_BOUNDED, 4, 16, 11);
    check_decode(LM_KDA_GATE_BOUNDED, 2, 32, 12);
}
static void test_prefill_then_steps_equal_forward_softplus(void) {
    check_decode(LM_KDA_GATE_SOFTPLUS, 4, 16, 13);
    check_decode(LM_KDA_GATE_SOFTPLUS, 1, 16, 14);
}

int main(void) {
    RUN(test_prefill_then_steps_equal_forward_bounded);
    RUN(test_prefill_then_steps_equal_forward_softplus);
    RUN(test_sequences_keep_separate_states);
    return test_summary();
}
