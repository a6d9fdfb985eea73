/* Decoding a trained micro model: a chunked prefill of the first P tokens and
 * then one token per step give the logits of the full chunked forward
 * (lm_model_logits) at every decoded position, within fp32 rounding, for
 * KDA + MLA/GQA layouts, MoE layers with a non-zero balancing bias, Block /
 * Full AttnRes and the standard residual, both KDA gates; P = 1, in the middle,
 * not a multiple of the KDA chunk, a multiple of it, and the whole sequence.
 * Also: re-prefill reuses the decoder, misuse is reported, cache sizes are
 * those of the layers, and sampling (greedy, temperature, nucleus) is correct
 * and reproducible. */
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/model.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"

static char root[256];

enum { B = 2, T = 40 };

/* The shared micro model (test_models.h) with another layout: KDA and
 * attention layers, MoE after the first `dense` layers, batches of B x T. */
static lm_config micro(const char *layout, int dense) {
    lm_config c = test_micro_config();
    c.n_layers = (int)strlen(layout);
    strcpy(c.layout, layout);
    c.first_k_dense = dense;
    c.seq_len = T;
    c.batch_size = B;
    return c;
}

/* Train `c` for 3 steps into root/name and load the final checkpoint for
 * batches of B x T; the MoE balancing biases get random values (spread like
 * the router scores, so they change choices), which both paths must use. */
static lm_model *trained(const lm_config *c, const char *name, uint64_t seed) {
    char run[512], path[700], latest[128] = {0};
    snprintf(run, sizeof run, "%s/%s", root, name);
    lm_train_options o = lm_train_options_default(run);
    o.progress = NULL;
    o.steps = 3;
    lm_train_result r;
    lm_status s = lm_train(c, &o, &r);
    CHECK(!s, "train %s: %s", name, lm_last_error());
    if (s) return NULL;
    snprintf(path, sizeof path, "%s/latest", run);
    FILE *f = fopen(path, "r");
    CHECK(f && fscanf(f, "%127s", latest) == 1, "%s readable", path);
    if (f) fclose(f);
    snprintf(path, sizeof path, "%s/%s", run, latest);
    lm_config lc;
    lm_model *m = NULL;
    s = lm_checkpoint_load_model(path, B, T, &lc, &m);
    CHECK(!s, "load %s: %s", path, lm_last_error());
    if (s) return NULL;
    lm_rng rng;
    lm_rng_seed(&rng, seed);
    for (int i = 0; i < lm_model_num_moe_layers(m); i++) {
        lm_balance_state *bal = lm_model_balance(m, i);
        for (int j = 0; j < bal->cfg.n_experts; j++) bal->bias[j] = 0.2f * (float)lm_rng_normal(&rng);
    }
    return m;
}

/* max |a - b| over n floats, and max |b| */
static void diff_scale(const float *a, const float *b, size_t n, double *diff, double *scale) {
    for (size_t i = 0; i < n; i++) {
        double e = isnan(a[i]) ? INFINITY : fabs((double)a[i] - b[i]);
        *diff = e > *diff ? e : *diff;
        *scale = fabs(b[i]) > *scale ? fabs(b[i]) : *scale;
    }
}

/* Decode with prefixes P and compare with the full forward at positions P-1..T-1. */
static void check_decode_equals_forward(lm_model *m, const char *what, uint64_t seed) {
    if (!m) return;
    const int V = lm_model_config(m)->vocab_size;
    lm_rng rng;
    lm_rng_seed(&rng, seed);
    int32_t tokens[B * T], prompt[B * T], step_tok[B];
    for (int i = 0; i < B * T; i++) tokens[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)V);
    float *full = malloc(sizeof(float) * B * T * V), *logits = malloc(sizeof(float) * B * V);
    CHECK(!lm_model_logits(m, tokens, full), "%s: %s", what, lm_last_error());
    lm_decoder *dec = NULL;
    CHECK(!lm_decoder_create(m, B, T, &dec), "%s: %s", what, lm_last_error());
    if (!dec) return;
    const int prefixes[] = {1, 20, 27, 32, T};
    for (size_t pi = 0; pi < sizeof prefixes / sizeof prefixes[0]; pi++) {
        const int P = prefixes[pi];
        double diff = 0, scale = 0;
        for (int b = 0; b < B; b++) memcpy(prompt + b * P, tokens + b * T, sizeof(int32_t) * P);
        CHECK(!lm_decoder_prefill(dec, prompt, P, logits), "%s: %s", what, lm_last_error());
        for (int b = 0; b < B; b++)
            diff_scale(logits + (size_t)b * V, full + ((size_t)b * T + P - 1) * V, (size_t)V, &diff, &scale);
        for (int t = P; t < T; t++) {
            for (int b = 0; b < B; b++) step_tok[b] = tokens[b * T + t];
            lm_status s = lm_decoder_step(dec, step_tok, logits);
            CHECK(!s, "%s, step at %d: %s", what, t, lm_last_error());
            if (s) break;
            for (int b = 0; b < B; b++)
                diff_scale(logits + (size_t)b * V, full + ((size_t)b * T + t) * V, (size_t)V, &diff, &scale);
        }
        CHECK(lm_decoder_length(dec) == T, "%s: length %d after %d tokens", what, lm_decoder_length(dec), T);
        CHECK(scale > 0.1, "%s: logit scale %.3g", what, scale);
        CHECK(diff <= 1e-4 * scale, "%s, prefix %d: max |logit diff| %.3g (scale %.3g)", what, P, diff, scale);
        if (getenv("LM_TEST_VERBOSE"))
            printf("  %s P=%2d: max |diff| %.3g, logit scale %.3g\n", what, P, diff, scale);
    }
    lm_decoder_free(dec);
    free(full);
    free(logits);
}

static lm_config config_a(void) {
    /* KDA (bounded gate), MLA, KDA; dense then MoE; Block AttnRes of 3 sublayers */
    lm_config c = micro("kmk", 1);
    c.residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c.attnres_block = 3;
    return c;
}

static lm_config config_b(void) {
    /* GQA with RoPE, KDA (softplus gate, conv width 3), GQA; all MoE (LatentMoE,
     * SiTU-GLU); Full AttnRes; tied embeddings */
    lm_config c = micro("mkm", 0);
    c.attn_kind = LM_ATTN_GQA;
    c.attn_kv_heads = 1;
    c.rope_dims = 4;
    c.kda_gate_softplus = 1;
    c.kda_conv_width = 3;
    c.latent_dim = 8;
    c.activation = LM_ACT_SITU;
    c.residual = LM_RESIDUAL_FULL_ATTNRES;
    c.tie_embeddings = 1;
    return c;
}

static lm_config config_c(void) {
    /* the standard residual, MLA with RoPE, KDA chunk 32 */
    lm_config c = micro("kkm", 1);
    c.residual = LM_RESIDUAL_STANDARD;
    c.rope_dims = 4;
    c.kda_chunk = 32;
    return c;
}

static void test_decode_equals_forward_mla_bounded_block_attnres(void) {
    lm_config c = config_a();
    lm_model *m = trained(&c, "a", 101);
    check_decode_equals_forward(m, "kmk/MLA/bounded/block", 1);
    lm_model_free(m);
}

static void test_decode_equals_forward_gqa_softplus_full_attnres(void) {
    lm_config c = config_b();
    lm_model *m = trained(&c, "b", 102);
    check_decode_equals_forward(m, "mkm/GQA/softplus/full", 2);
    lm_model_free(m);
}

static void test_decode_equals_forward_standard_residual(void) {
    lm_config c = config_c();
    lm_model *m = trained(&c, "c", 103);
    check_decode_equals_forward(m, "kkm/MLA+rope/standard", 3);
    lm_model_free(m);
}

/* A second prefill starts over: the same prompt gives bit-identical logits,
 * and steps continue from the new prompt. Errors name the bad value. */
static void test_decoder_reuse_and_errors(void) {
    lm_config c = config_a();
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 7);
    const int V = c.vocab_size;
    lm_decoder *dec = NULL;
    CHECK(!lm_decoder_create(m, B, 8, &dec), "%s", lm_last_error());
    if (!dec) return;
    int32_t prompt[B * 5] = {1, 2, 3, 4, 5, 9, 8, 7, 6, 5}, tok[B] = {3, 4};
    float a[B * 256], b[B * 256], sa[B * 256], sb[B * 256];
    CHECK(!lm_decoder_prefill(dec, prompt, 5, a), "%s", lm_last_error());
    CHECK(!lm_decoder_step(dec, tok, sa), "%s", lm_last_error());
    CHECK(!lm_decoder_prefill(dec, prompt, 5, b), "%s", lm_last_error());
    CHECK(lm_decoder_length(dec) == 5, "length %d after a new prefill", lm_decoder_length(dec));
    CHECK(!lm_decoder_step(dec, tok, sb), "%s", lm_last_error());
    CHECK(!memcmp(a, b, sizeof a) && !memcmp(sa, sb, sizeof sa), "a second prefill reproduces the first");
    /* misuse */
    int32_t bad[B] = {3, V};
    CHECK(lm_decoder_step(dec, bad, sa) == LM_ERR_ARG && strstr(lm_last_error(), "256"), "bad token: %s",
          lm_last_error());
    CHECK(lm_decoder_prefill(dec, prompt, 9, a) == LM_ERR_ARG && strstr(lm_last_error(), "max_T=8"),
          "long prompt: %s", lm_last_error());
    CHECK(lm_decoder_prefill(dec, prompt, 0, a) == LM_ERR_ARG, "empty prompt accepted");
    CHECK(!lm_decoder_prefill(dec, prompt, 5, a), "%s", lm_last_error());
    for (int i = 0; i < 3; i++) CHECK(!lm_decoder_step(dec, tok, sa), "%s", lm_last_error());
    CHECK(lm_decoder_step(dec, tok, sa) == LM_ERR_ARG && strstr(lm_last_error(), "max_T=8"), "full: %s",
          lm_last_error());
    /* after a reset the first step is a sequence's first token: equal to a prefill of 1 */
    lm_decoder_reset(dec);
    int32_t first[B] = {1, 9};
    CHECK(!lm_decoder_step(dec, first, sa), "%s", lm_last_error());
    CHECK(!lm_decoder_prefill(dec, first, 1, a), "%s", lm_last_error());
    double diff = 0, scale = 0;
    diff_scale(sa, a, (size_t)B * V, &diff, &scale);
    CHECK(diff <= 1e-5 * scale, "step from empty vs prefill of 1: %.3g", diff);
    lm_decoder *none = NULL;
    CHECK(lm_decoder_create(m, 0, 8, &none) == LM_ERR_ARG && !none, "B = 0 accepted");
    /* cache memory: KDA conv tails + states (fixed), the MLA latent per token */
    size_t fixed = 0, per_token = 0;
    lm_decoder_cache_bytes(dec, &fixed, &per_token);
    size_t HK = (size_t)c.kda_heads * c.kda_head_dim;
    size_t state = (size_t)c.kda_heads * c.kda_head_dim * c.kda_head_dim;
    size_t want_fixed = 2 * B * (3 * (c.kda_conv_width - 1) * HK + state) * 4;
    CHECK(fixed == want_fixed, "fixed cache %zu bytes, want %zu", fixed, want_fixed);
    CHECK(per_token == (size_t)B * (c.kv_lora_rank + c.rope_dims) * 4, "per token %zu bytes", per_token);
    lm_decoder_free(dec);
    lm_model_free(m);
}

/* Greedy takes the argmax; a tiny top_p keeps only the most likely token; the
 * sampled frequencies follow softmax(logits / temperature) (within 5 standard
 * errors); top_p = 0.6 never draws outside the smallest set of mass >= 0.6;
 * the same seed draws the same tokens. */
static void test_sampling(void) {
    enum { V = 6, DRAWS = 20000 };
    const float logits[V] = {0.5f, 2.0f, -1.0f, 1.5f, 0.0f, 1.0f};
    char work[V * 16];
    CHECK(lm_sample_work_bytes(V) <= sizeof work, "work %zu bytes", lm_sample_work_bytes(V));
    int32_t tok = -1;
    CHECK(!lm_sample_token(logits, V, 0.0f, 1.0f, NULL, NULL, &tok) && tok == 1, "greedy gave %d", tok);
    lm_rng rng;
    lm_rng_seed(&rng, 5);
    int ok = 1;
    for (int i = 0; i < 200; i++) {
        lm_sample_token(logits, V, 1.0f, 0.05f, &rng, work, &tok);
        ok &= tok == 1;
    }
    CHECK(ok, "top_p 0.05 drew a token other than the argmax");
    const float temp = 0.7f;
    double p[V], z = 0;
    for (int v = 0; v < V; v++) z += p[v] = exp(logits[v] / temp);
    int count[V] = {0};
    for (int i = 0; i < DRAWS; i++) {
        CHECK(!lm_sample_token(logits, V, temp, 1.0f, &rng, work, &tok), "%s", lm_last_error());
        if (tok >= 0 && tok < V) count[tok]++;
    }
    for (int v = 0; v < V; v++) {
        double want = p[v] / z, got = (double)count[v] / DRAWS, se = sqrt(want * (1 - want) / DRAWS);
        CHECK(fabs(got - want) <= 5 * se + 1e-4, "token %d: frequency %.4f, want %.4f", v, got, want);
    }
    /* nucleus at 0.6 with temperature 1: tokens 1 (0.39) and 3 (0.24) reach it */
    for (int v = 0; v < V; v++) count[v] = 0;
    for (int i = 0; i < 4000; i++) {
        lm_sample_token(logits, V, 1.0f, 0.6f, &rng, work, &tok);
        if (tok >= 0 && tok < V) count[tok]++;
    }
    CHECK(count[1] + count[3] == 4000 && count[1] > count[3] && count[3] > 0, "nucleus draws %d %d %d %d %d %d",
          count[0], count[1], count[2], count[3], count[4], count[5]);
    /* reproducible by seed */
    lm_rng r1, r2;
    lm_rng_seed(&r1, 9);
    lm_rng_seed(&r2, 9);
    int same = 1;
    for (int i = 0; i < 100; i++) {
        int32_t t1, t2;
        lm_sample_token(logits, V, 1.3f, 0.9f, &r1, work, &t1);
        lm_sample_token(logits, V, 1.3f, 0.9f, &r2, work, &t2);
        same &= t1 == t2;
    }
    CHECK(same, "the same seed drew different tokens");
    CHECK(lm_sample_token(logits, V, -1.0f, 1.0f, &rng, work, &tok) == LM_ERR_ARG, "negative temperature");
    CHECK(lm_sample_token(logits, V, 1.0f, 0.0f, &rng, work, &tok) == LM_ERR_ARG, "top_p 0");
    CHECK(lm_sample_token(logits, V, 1.0f, 1.5f, &rng, work, &tok) == LM_ERR_ARG, "top_p 1.5");
}

int main(void) {
    snprintf(root, sizeof root, "/tmp/longmoe-test-decode-%ld", (long)getpid());
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", root, root);
    if (system(cmd)) return 1;
    RUN(test_decode_equals_forward_mla_bounded_block_attnres);
    RUN(test_decode_equals_forward_gqa_softplus_full_attnres);
    RUN(test_decode_equals_forward_standard_residual);
    RUN(test_decoder_reuse_and_errors);
    RUN(test_sampling);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd)) return 1;
    return test_summary();
}
