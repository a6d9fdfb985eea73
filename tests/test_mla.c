/* The gated attention layer (src/model/mla.c): MLA and GQA, NoPE and RoPE. */
#include <string.h>

#include "longmoe/mla.h"
#include "test.h"

static float *rand_floats(lm_rng *r, size_t n, double sd) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)(sd * lm_rng_normal(r));
    return x;
}

/* The configurations every property is checked on. */
static lm_mla_config config_at(int i) {
    lm_mla_config c;
    switch (i) {
    case 0: c = lm_mla_config_mla(12, 2, 8, 6, 10, 7); break; /* MLA, NoPE */
    case 1: c = lm_mla_config_mla(12, 3, 8, 5, 9, 6); c.rope_dims = 4; break;
    case 2: c = lm_mla_config_gqa(12, 4, 2, 6, 5); break; /* GQA, NoPE */
    default: c = lm_mla_config_gqa(10, 2, 1, 8, 4); c.rope_dims = 6; c.scale = 0.3f; break;
    }
    return c;
}
#define NCONFIGS 4

static const char *config_name(int i) {
    static const char *names[] = {"MLA NoPE", "MLA RoPE(4)", "GQA NoPE", "GQA RoPE(6) scale 0.3"};
    return names[i];
}

typedef struct {
    lm_mla_config c;
    float *pmem;
    lm_mla_params p;
    size_t np;
} layer;

static layer make_layer(int ci, lm_rng *r) {
    layer L;
    L.c = config_at(ci);
    L.np = lm_mla_param_count(&L.c);
    L.pmem = malloc(L.np * sizeof(float));
    CHECK(lm_mla_params_map(&L.c, L.pmem, &L.p) == LM_OK, "%s", lm_last_error());
    lm_mla_params_init(&L.c, &L.p, r);
    /* norm weights away from 1 so their gradients are exercised */
    if (L.p.q_norm)
        for (int i = 0; i < L.c.q_lora; i++) L.p.q_norm[i] = (float)(1 + 0.3 * lm_rng_normal(r));
    if (L.p.kv_norm)
        for (int i = 0; i < L.c.kv_lora; i++) L.p.kv_norm[i] = (float)(1 + 0.3 * lm_rng_normal(r));
    return L;
}

/* L = sum(dy * forward(x)) in double. */
static double loss_of(const layer *L, const float *x, const float *dy, int B, int T, float *y,
                      float *acts) {
    CHECK(lm_mla_forward(&L->c, &L->p, x, B, T, y, acts) == LM_OK, "%s", lm_last_error());
    double s = 0;
    for (size_t i = 0; i < (size_t)B * T * L->c.d_model; i++) s += (double)dy[i] * y[i];
    return s;
}

/* Central differences of L agree with the backward for every weight tensor and
 * for x; the backward adds to gradients that start non-zero. */
static void test_layer_gradients_equal_finite_differences(void) {
    const int B = 2, T = 5;
    double worst = 0;
    for (int ci = 0; ci < NCONFIGS; ci++) {
        lm_rng r;
        lm_rng_seed(&r, 100 + ci);
        layer L = make_layer(ci, &r);
        const int d = L.c.d_model;
        const size_t nx = (size_t)B * T * d;
        float *x = rand_floats(&r, nx, 1.0), *dy = rand_floats(&r, nx, 1.0);
        float *y = malloc(nx * 4), *acts = malloc(lm_mla_acts_floats(&L.c, B, T) * 4);
        float *scratch = malloc(lm_mla_scratch_floats(&L.c, B, T) * 4);
        float *gmem = rand_floats(&r, L.np, 1.0), *g0 = malloc(L.np * 4);
        float *dx = rand_floats(&r, nx, 1.0);
        memcpy(g0, gmem, L.np * 4);
        lm_mla_params g;
        lm_mla_params_map(&L.c, gmem, &g);
        loss_of(&L, x, dy, B, T, y, acts);
        CHECK(lm_mla_backward(&L.c, &L.p, x, acts, dy, B, T, dx, &g, scratch) == LM_OK, "%s",
              lm_last_error());
        /* every tensor of the parameter block, then x */
        float *tensors[14] = {L.p.W_dq, L.p.q_norm, L.p.W_uq, L.p.W_dkv, L.p.kv_norm, L.p.W_uk,
                              L.p.W_uv, L.p.W_kr, L.p.W_q, L.p.W_k, L.p.W_v, L.p.W_g, L.p.W_o, x};
        const char *names[14] = {"W_dq", "q_norm", "W_uq", "W_dkv", "kv_norm", "W_uk", "W_uv",
                                 "W_kr", "W_q", "W_k", "W_v", "W_g", "W_o", "x"};
        int checked = 0;
        for (int t = 0; t < 14; t++) {
            if (!tensors[t]) continue;
            float *base = t < 13 ? tensors[t] : x;
            size_t n, goff = 0;
            if (t < 13) {
                /* this tensor's extent: up to the next non-NULL tensor or the block end */
                goff = (size_t)(base - L.pmem);
                size_t end = L.np;
                for (int u = t + 1; u < 13; u++)
                    if (tensors[u]) { end = (size_t)(tensors[u] - L.pmem); break; }
                n = end - goff;
            } else {
                n = nx;
            }
            double num = 0, den = 0;
            for (size_t i = 0; i < n; i++) {
                const float keep = base[i], h = 2e-3f;
                base[i] = keep + h;
                double lp = loss_of(&L, x, dy, B, T, y, acts);
                base[i] = keep - h;
                double lm = loss_of(&L, x, dy, B, T, y, acts);
                base[i] = keep;
                const double fd = (lp - lm) / (2.0 * h);
                /* the gradients accumulate; dx is written (its earlier random values must not show) */
                const double an = t < 13 ? (double)gmem[goff + i] - g0[goff + i] : (double)dx[i];
                num += (fd - an) * (fd - an), den += fd * fd;
            }
            char what[96];
            snprintf(what, sizeof what, "%s: d%s rel err vs finite differences", config_name(ci), names[t]);
            CHECK_CLOSE(sqrt(num / (den > 0 ? den : 1)), 0, 5e-3, 0, what);
            worst = fmax(worst, sqrt(num / (den > 0 ? den : 1)));
            CHECK(den > 0, "%s: d%s is identically zero", config_name(ci), names[t]);
            checked++;
        }
        CHECK(checked == (L.c.kind == LM_ATTN_MLA ? 9 + (L.c.rope_dims > 0) : 5) + 1,
              "%s: checked %d tensors", config_name(ci), checked);
        free(x), free(dy), free(y), free(acts), free(scratch), free(gmem), free(g0), free(dx);
        free(L.pmem);
    }
    printf("     worst gradient rel err vs finite differences: %.2e\n", worst);
}

/* Prefill of T0 tokens then T - T0 one-token steps give the full forward's outputs. */
static void test_prefill_and_decode_steps_equal_full_forward(void) {
    const int B = 2, T = 37, T0 = 13;
    for (int ci = 0; ci < NCONFIGS; ci++) {
        lm_rng r;
        lm_rng_seed(&r, 200 + ci);
        layer L = make_layer(ci, &r);
        const int d = L.c.d_model;
        const size_t nx = (size_t)B * T * d;
        float *x = rand_floats(&r, nx, 1.0), *y = malloc(nx * 4), *yd = malloc(nx * 4);
        float *acts = malloc(lm_mla_acts_floats(&L.c, B, T) * 4);
        CHECK(lm_mla_forward(&L.c, &L.p, x, B, T, y, acts) == LM_OK, "%s", lm_last_error());
        float *cmem = malloc(lm_mla_cache_floats(&L.c, B, T) * 4);
        float *scratch = malloc(lm_mla_decode_scratch_floats(&L.c, B, T) * 4);
        lm_mla_cache cache;
        CHECK(lm_mla_cache_init(&L.c, &cache, B, T, cmem) == LM_OK, "%s", lm_last_error());
        /* the prompt: rows [b, 0:T0) of x, packed */
        float *xp = malloc((size_t)B * T0 * d * 4), *yp = malloc((size_t)B * T0 * d * 4);
        for (int b = 0; b < B; b++) memcpy(xp + (size_t)b * T0 * d, x + (size_t)b * T * d, (size_t)T0 * d * 4);
        CHECK(lm_mla_prefill(&L.c, &L.p, &cache, xp, T0, yp, acts) == LM_OK, "%s", lm_last_error());
        for (int b = 0; b < B; b++) memcpy(yd + (size_t)b * T * d, yp + (size_t)b * T0 * d, (size_t)T0 * d * 4);
        float *xs = malloc((size_t)B * d * 4), *ys = malloc((size_t)B * d * 4);
        for (int t = T0; t < T; t++) {
            for (int b = 0; b < B; b++) memcpy(xs + (size_t)b * d, x + ((size_t)b * T + t) * d, (size_t)d * 4);
            CHECK(lm_mla_decode_step(&L.c, &L.p, &cache, xs, ys, scratch) == LM_OK, "%s", lm_last_error());
            for (int b = 0; b < B; b++) memcpy(yd + ((size_t)b * T + t) * d, ys + (size_t)b * d, (size_t)d * 4);
        }
        CHECK(cache.len == T, "cache holds %d tokens, want %d", cache.len, T);
        double maxdiff = 0, maxy = 0;
        for (size_t i = 0; i < nx; i++) {
            maxdiff = fmax(maxdiff, fabs((double)yd[i] - y[i]));
            maxy = fmax(maxy, fabs((double)y[i]));
        }
        char what[96];
        snprintf(what, sizeof what, "%s: max |decode - forward| / max |y|", config_name(ci));
        CHECK_CLOSE(maxdiff / maxy, 0, 2e-5, 0, what);
        /* a full cache refuses another step */
        CHECK(lm_mla_decode_step(&L.c, &L.p, &cache, xs, ys, scratch) == LM_ERR_ARG, "full cache accepted a step");
        free(x), free(y), free(yd), free(acts), free(cmem), free(scratch), free(xp), free(yp), free(xs), free(ys);
        free(L.pmem);
    }
}

/* Changing x at t >= t0 leaves y at t < t0 bit-identical (the whole layer is causal). */
static void test_layer_past_outputs_bit_identical_when_future_changes(void) {
    const int B = 2, T = 70, t0 = 41;
    for (int ci = 0; ci < NCONFIGS; ci++) {
        lm_rng r;
        lm_rng_seed(&r, 300 + ci);
        layer L = make_layer(ci, &r);
        const int d = L.c.d_model;
        const size_t nx = (size_t)B * T * d;
        float *x = rand_floats(&r, nx, 1.0), *y1 = malloc(nx * 4), *y2 = malloc(nx * 4);
        float *acts = malloc(lm_mla_acts_floats(&L.c, B, T) * 4);
        lm_mla_forward(&L.c, &L.p, x, B, T, y1, acts);
        for (int b = 0; b < B; b++)
            for (size_t i = ((size_t)b * T + t0) * d; i < ((size_t)b + 1) * T * d; i++) x[i] = -2 * x[i] + 1;
        lm_mla_forward(&L.c, &L.p, x, B, T, y2, acts);
        int same = 1, differs = 0;
        for (int b = 0; b < B; b++) {
            same &= !memcmp(y1 + (size_t)b * T * d, y2 + (size_t)b * T * d, (size_t)t0 * d * 4);
            differs |= memcmp(y1 + ((size_t)b * T + t0) * d, y2 + ((size_t)b * T + t0) * d, (size_t)(T - t0) * d * 4) != 0;
        }
        CHECK(same, "%s: outputs before t0 changed", config_name(ci));
        CHECK(differs, "%s: outputs after t0 did not change", config_name(ci));
        free(x), free(y1), free(y2), free(acts), free(L.pmem);
    }
}

/* The K3 shape [SPEC §1]: d=7168, 96 heads x 128, q_lora 1536, kv_lora 512. */
static void test_parameter_count_of_k3_shape(void) {
    lm_mla_config c = lm_mla_config_mla(7168, 96, 128, 128, 1536, 512);
    const size_t d = 7168, hd = 96 * 128;
    const size_t want = 1536 * d + 1536 + hd * 1536 + 512 * d + 512 + 2 * hd * 512 + 2 * hd * d;
    CHECK(lm_mla_param_count(&c) == want, "MLA count %zu, want %zu", lm_mla_param_count(&c), want);
    lm_mla_config g = lm_mla_config_gqa(64, 8, 2, 16, 8);
    const size_t gwant = 8 * 16 * 64 + 2 * 16 * 64 + 2 * 8 * 64 + 2 * 8 * 8 * 64;
    CHECK(lm_mla_param_count(&g) == gwant, "GQA count %zu, want %zu", lm_mla_param_count(&g), gwant);
    /* the latent cache is (kv_lora + r) floats per token for all heads */
    CHECK(lm_mla_cache_floats(&c, 1, 1000) == 512 * 1000, "MLA cache %zu floats", lm_mla_cache_floats(&c, 1, 1000));
}

static void test_bad_configs_are_rejected_with_clear_errors(void) {
    lm_mla_config c = lm_mla_config_gqa(16, 6, 4, 8, 8);
    CHECK(lm_mla_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "n_kv_heads=4"), "%s", lm_last_error());
    c = lm_mla_config_mla(16, 2, 8, 8, 4, 4);
    c.rope_dims = 3;
    CHECK(lm_mla_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "rope_dims=3"), "%s", lm_last_error());
    c.rope_dims = 8; /* MLA needs a latent key part */
    CHECK(lm_mla_check(&c) == LM_ERR_ARG, "rope_dims = head_dim_qk accepted for MLA");
    c = lm_mla_config_mla(16, 2, 8, 8, 0, 4);
    CHECK(lm_mla_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "q_lora=0"), "%s", lm_last_error());
    c = lm_mla_config_mla(16, 2, 8, 8, 4, 4);
    CHECK(lm_mla_check(&c) == LM_OK, "valid config rejected: %s", lm_last_error());
}

int main(void) {
    RUN(test_layer_gradients_equal_finite_differences);
    RUN(test_prefill_and_decode_steps_equal_full_forward);
    RUN(test_layer_past_outputs_bit_identical_when_future_changes);
    RUN(test_parameter_count_of_k3_shape);
    RUN(test_bad_configs_are_rejected_with_clear_errors);
    return test_summary();
}
