/* The whole model: every parameter kind's gradient against finite differences
 * (central; where a step flips an expert choice, the one-sided difference of
 * the side that flips nothing, or a 4x smaller step; an entry where all of
 * them cross a routing kink is printed with its estimates and at most 1 in
 * 100 may be left so), the chunked cross-entropy against full logits, reproducible
 * initialisation, and parameter counts that agree with `longmoe plan`. */
#include "longmoe/model.h"
#include "test.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static lm_config micro_config(lm_residual_kind residual) {
    lm_config c;
    lm_config_defaults(&c);
    c.vocab_size = 16;
    c.d_model = 8;
    c.n_layers = 3;
    strcpy(c.layout, "kmk");
    c.first_k_dense = 1;
    c.dense_ffn = 12;
    c.kda_heads = 2;
    c.kda_head_dim = 4;
    c.kda_chunk = 16;
    c.attn_heads = 2;
    c.q_lora_rank = 6;
    c.kv_lora_rank = 5;
    c.qk_head_dim = 4;
    c.v_head_dim = 4;
    c.n_routed_experts = 4;
    c.top_k = 2;
    c.n_shared_experts = 1;
    c.expert_ffn = 6;
    c.shared_ffn = 6;
    c.latent_dim = 6;
    c.balance = LM_BALANCE_NONE;
    c.residual = residual;
    c.attnres_block = 2;
    return c;
}

enum { B = 2, T = 19 };

static void random_tokens(lm_rng *r, int32_t *x, int n, int V) {
    for (int i = 0; i < n; i++) x[i] = (int32_t)(lm_rng_u64(r) % (uint64_t)V);
}

/* Two estimates of one derivative from steps h and h/2 agree: neither step
 * crossed a kink of the loss (a flipped expert choice). */
static int agree(double at_h, double at_half) { return fabs(at_h - at_half) <= 0.05 * fabs(at_half) + 2e-3; }

static float loss_at(lm_model *m, const int32_t *tok, const int32_t *tgt, float *p, float value) {
    float keep = *p, l = NAN;
    *p = value;
    lm_model_forward(m, tok, tgt, 0, &l);
    *p = keep;
    return l;
}

/* The derivative of the loss along parameter *p by finite differences. Routing
 * is piecewise constant, so a step may cross a point where an expert choice
 * flips; such a crossing shows as disagreement between the estimates at steps
 * h and h/2. In order: central differences (Richardson, error O(h^4)); the
 * one-sided differences of the side that crosses nothing (Richardson, O(h^2));
 * then the same at a 4x smaller h. Returns the method used (1 central, 2
 * forward, 3 backward; +3 at the smaller step) with *d, or 0 when every
 * estimate crosses a kink (*why then says what disagreed). */
static int fd_derivative(lm_model *m, const int32_t *tok, const int32_t *tgt, float *p, double *d, char *why,
                         size_t why_n) {
    const float x = *p;
    const double f0 = loss_at(m, tok, tgt, p, x);
    float h = 3e-3f;
    for (int scale = 0; scale < 2; scale++, h *= 0.25f) {
        const float hh = 0.5f * h;
        /* the steps actually taken, after rounding x +- h to float */
        const double up = (double)(float)(x + h) - x, dn = x - (double)(float)(x - h);
        const double up2 = (double)(float)(x + hh) - x, dn2 = x - (double)(float)(x - hh);
        const double fp = loss_at(m, tok, tgt, p, x + h), fm = loss_at(m, tok, tgt, p, x - h);
        const double fp2 = loss_at(m, tok, tgt, p, x + hh), fm2 = loss_at(m, tok, tgt, p, x - hh);
        const double central = (fp - fm) / (up + dn), central2 = (fp2 - fm2) / (up2 + dn2);
        const double fwd = (fp - f0) / up, fwd2 = (fp2 - f0) / up2;
        const double bwd = (f0 - fm) / dn, bwd2 = (f0 - fm2) / dn2;
        if (agree(central, central2)) {
            *d = (4.0 * central2 - central) / 3.0;
            return 1 + 3 * scale;
        }
        if (agree(fwd, fwd2)) {
            *d = 2.0 * fwd2 - fwd;
            return 2 + 3 * scale;
        }
        if (agree(bwd, bwd2)) {
            *d = 2.0 * bwd2 - bwd;
            return 3 + 3 * scale;
        }
        snprintf(why, why_n, "h %.2g: central %.4g vs %.4g, forward %.4g vs %.4g, backward %.4g vs %.4g", h, central,
                 central2, fwd, fwd2, bwd, bwd2);
    }
    return 0;
}

static void check_gradients(lm_residual_kind residual) {
    lm_config c = micro_config(residual);
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 5);
    lm_rng r;
    lm_rng_seed(&r, 6 + residual);
    float *w = lm_model_params(m);
    /* perturb the init so that zero-initialised tensors (AttnRes queries) have gradients of every kind */
    for (size_t i = 0; i < lm_model_num_params(m); i++) w[i] += 0.2f * (float)lm_rng_normal(&r);
    int32_t tok[B * T], tgt[B * T];
    random_tokens(&r, tok, B * T, c.vocab_size);
    random_tokens(&r, tgt, B * T, c.vocab_size);
    float loss;
    lm_model_zero_grads(m);
    CHECK(!lm_model_forward(m, tok, tgt, 0, &loss), "%s", lm_last_error());
    CHECK(!lm_model_backward(m, 1.0f), "%s", lm_last_error());
    const float *g = lm_model_grads(m);
    int unchecked = 0, checked = 0, by_method[7] = {0};
    for (int ti = 0; ti < lm_model_num_tensors(m); ti++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, ti);
        double num = 0, den = 0;
        size_t stride = t->numel > 5 ? t->numel / 5 : 1;
        for (size_t j = (size_t)ti % stride; j < t->numel; j += stride) {
            double fr;
            char why[256];
            int method = fd_derivative(m, tok, tgt, w + t->offset + j, &fr, why, sizeof why);
            if (!method) {
                /* every step, on both sides and at both sizes, flips an expert choice */
                unchecked++;
                printf("    unchecked: residual %d, %s[%zu]: a routing kink within 0.75e-3 on both sides (%s)\n",
                       residual, t->name, j, why);
                continue;
            }
            by_method[method]++;
            checked++;
            num += (fr - g[t->offset + j]) * (fr - g[t->offset + j]);
            den += fr * fr;
        }
        double rel = sqrt(num / (den > 1e-12 ? den : 1e-12));
        CHECK(rel < 3e-2 || sqrt(num) < 2e-3, "residual %d: %s rel error %.3g (|g| %.3g)", residual, t->name, rel,
              sqrt(den));
    }
    printf("    residual %d: %d entries checked (central %d, one-sided %d, at the smaller step %d), %d unchecked\n",
           residual, checked, by_method[1], by_method[2] + by_method[3], by_method[4] + by_method[5] + by_method[6],
           unchecked);
    /* at most 1 entry in 100 left unchecked (each named above) */
    CHECK(unchecked * 100 <= checked, "%d of %d entries unchecked", unchecked, checked + unchecked);
    lm_model_free(m);
}
static void test_gradients_block_attnres(void) { check_gradients(LM_RESIDUAL_BLOCK_ATTNRES); }
static void test_gradients_standard_residual(void) { check_gradients(LM_RESIDUAL_STANDARD); }
static void test_gradients_full_attnres(void) { check_gradients(LM_RESIDUAL_FULL_ATTNRES); }

static void test_chunked_cross_entropy_equals_full_logits(void) {
    lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
    c.vocab_size = 50;
    lm_model *m = NULL;
    /* B*T = 2*19 = 38 rows: one full chunk of 32 and a partial one */
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 9);
    lm_rng r;
    lm_rng_seed(&r, 10);
    int32_t tok[B * T], tgt[B * T];
    random_tokens(&r, tok, B * T, c.vocab_size);
    random_tokens(&r, tgt, B * T, c.vocab_size);
    float loss, *logits = malloc(sizeof(float) * B * T * 50);
    CHECK(!lm_model_forward(m, tok, tgt, 0, &loss), "%s", lm_last_error());
    CHECK(!lm_model_logits(m, tok, logits), "%s", lm_last_error());
    double ref = 0;
    for (int i = 0; i < B * T; i++) {
        double mx = -1e30, s = 0;
        for (int v = 0; v < 50; v++) mx = fmax(mx, logits[i * 50 + v]);
        for (int v = 0; v < 50; v++) s += exp(logits[i * 50 + v] - mx);
        ref += mx + log(s) - logits[i * 50 + tgt[i]];
    }
    CHECK_CLOSE(loss, ref / (B * T), 1e-5, 1e-5, "cross-entropy");
    free(logits);
    lm_model_free(m);
}

static void test_initialisation_is_reproducible_and_seeded(void) {
    lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, B, T, &a) && !lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) return;
    lm_model_init(a, 1);
    lm_model_init(b, 1);
    size_t n = lm_model_num_params(a);
    CHECK(!memcmp(lm_model_params(a), lm_model_params(b), n * 4), "same seed, same weights");
    lm_model_init(b, 2);
    CHECK(memcmp(lm_model_params(a), lm_model_params(b), n * 4), "another seed, other weights");
    /* zero-initialised pseudo-queries, unit norms, A_log = 0 */
    const lm_model_tensor *q = lm_model_find(a, "attnres.query"), *A = lm_model_find(a, "layers.0.kda.A_log");
    CHECK(q && A, "named tensors exist");
    for (size_t i = 0; q && i < q->numel; i++) CHECK(lm_model_params(a)[q->offset + i] == 0.0f, "query %zu", i);
    for (size_t i = 0; A && i < A->numel; i++) CHECK(lm_model_params(a)[A->offset + i] == 0.0f, "A_log %zu", i);
    lm_model_free(a);
    lm_model_free(b);
}

/* lm_model_init draws one stream in table order and transforms it in blocks by all threads:
 * the weights must equal drawing one normal at a time, with the embedding (1.2M entries) crossing
 * a block boundary and taking the threaded path. */
static void test_initialisation_equals_the_serial_stream(void) {
    lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
    c.vocab_size = 150001;
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, 1, 4, &m), "%s", lm_last_error());
    if (!m) return;
#ifdef _OPENMP
    int threads = omp_get_max_threads();
    omp_set_num_threads(4);
#endif
    lm_model_init(m, 77);
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
    lm_rng r;
    lm_rng_seed(&r, 77);
    const float *w = lm_model_params(m);
    size_t bad = 0, drawn = 0;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        for (size_t j = 0; j < t->numel; j++) {
            float v = t->init_mean + (t->init_std > 0 ? t->init_std * (float)lm_rng_normal(&r) : 0.0f);
            drawn += t->init_std > 0;
            bad += memcmp(&v, &w[t->offset + j], sizeof v) != 0;
        }
    }
    CHECK(drawn > (1u << 20) + 1000, "a tensor crosses a block (%zu draws)", drawn);
    CHECK(bad == 0, "%zu of %zu weights differ from the serial stream", bad, lm_model_num_params(m));
    lm_model_free(m);
}

static void test_parameter_count_agrees_with_the_plan(void) {
    const char *presets[] = {"configs/tiny.json", "configs/small.json"};
    for (int i = 0; i < 2; i++) {
        lm_config c;
        CHECK(!lm_config_load(presets[i], &c), "%s", lm_last_error());
        lm_model *m = NULL;
        CHECK(!lm_model_create(&c, 1, 64, &m), "%s", lm_last_error());
        if (!m) continue;
        lm_plan p;
        lm_config_plan(&c, 64, &p);
        CHECK(fabs((double)lm_model_num_params(m) - p.total_params) < 1e-6 * p.total_params + 1,
              "%s: model %zu vs plan %.0f", presets[i], lm_model_num_params(m), p.total_params);
        lm_model_free(m);
    }
}

static void test_bad_tokens_are_rejected_by_position(void) {
    lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 3);
    int32_t tok[B * T] = {0}, tgt[B * T] = {0};
    tok[7] = 16;
    float loss;
    CHECK(lm_model_forward(m, tok, tgt, 0, &loss) == LM_ERR_ARG && strstr(lm_last_error(), "position 7"),
          "%s", lm_last_error());
    lm_model_free(m);
}

static void test_qk_clip_bounds_the_largest_logit(void) {
    lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 21);
    /* blow up the query up-projection so logits exceed tau */
    const lm_model_tensor *uq = lm_model_find(m, "layers.1.mla.W_uq");
    CHECK(uq != NULL, "W_uq");
    if (!uq) return;
    for (size_t i = 0; i < uq->numel; i++) lm_model_params(m)[uq->offset + i] *= 400.0f;
    lm_rng r;
    lm_rng_seed(&r, 22);
    int32_t tok[B * T], tgt[B * T];
    random_tokens(&r, tok, B * T, c.vocab_size);
    random_tokens(&r, tgt, B * T, c.vocab_size);
    float loss, before, after;
    int clipped;
    CHECK(!lm_model_forward(m, tok, tgt, 1, &loss), "%s", lm_last_error());
    CHECK(!lm_model_qk_clip(m, 20.0f, &before, &clipped), "%s", lm_last_error());
    CHECK(before > 20.0f && clipped >= 1, "max logit %g, clipped %d", before, clipped);
    CHECK(!lm_model_forward(m, tok, tgt, 1, &loss), "%s", lm_last_error());
    CHECK(!lm_model_qk_clip(m, 0.0f, &after, &clipped), "%s", lm_last_error());
    CHECK(after <= 20.0f * 1.0001f && after > 19.0f && clipped == 0, "after the clip: %g (clipped %d)", after, clipped);
    lm_model_free(m);
}

static void test_recompute_gives_identical_gradients_with_less_memory(void) {
    lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
    c.balance = LM_BALANCE_AUX; /* the aux-loss gradient must survive the recompute too */
    strcpy(c.layout, "kmkm");
    c.n_layers = 4;
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, B, T, &a), "%s", lm_last_error());
    c.recompute = 1;
    CHECK(!lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) return;
    lm_model_init(a, 31);
    lm_model_init(b, 31);
    lm_rng r;
    lm_rng_seed(&r, 32);
    int32_t tok[B * T], tgt[B * T];
    random_tokens(&r, tok, B * T, c.vocab_size);
    random_tokens(&r, tgt, B * T, c.vocab_size);
    float la, lb;
    CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && !lm_model_backward(a, 1.0f), "%s", lm_last_error());
    CHECK(!lm_model_forward(b, tok, tgt, 1, &lb) && !lm_model_backward(b, 1.0f), "%s", lm_last_error());
    CHECK(la == lb && lm_model_aux_loss(a) == lm_model_aux_loss(b), "loss %g vs %g", la, lb);
    CHECK(!memcmp(lm_model_grads(a), lm_model_grads(b), lm_model_num_params(a) * sizeof(float)),
          "gradients differ with recompute");
    CHECK(lm_model_activation_bytes(b) < lm_model_activation_bytes(a), "activations %zu vs %zu",
          lm_model_activation_bytes(b), lm_model_activation_bytes(a));
    lm_model_free(a);
    lm_model_free(b);
}

/* lm_model_set_head_backward: the head's backward inside the forward gives
 * the losses and gradient bits of forward then backward, over two
 * micro-batches (accumulated, the second with another scale) and with a tied
 * head (the embedding's gradient written by both); a backward that asks
 * another scale or per-position weights is refused; 0 turns it off. */
static void test_head_backward_in_the_forward_gives_the_same_bits(void) {
    for (int tied = 0; tied < 2; tied++) {
        lm_config c = micro_config(LM_RESIDUAL_BLOCK_ATTNRES);
        c.balance = LM_BALANCE_AUX;
        c.tie_embeddings = tied;
        lm_model *a = NULL, *b = NULL;
        CHECK(!lm_model_create(&c, B, T, &a) && !lm_model_create(&c, B, T, &b), "%s", lm_last_error());
        if (!a || !b) return;
        lm_model_init(a, 41);
        lm_model_init(b, 41);
        lm_rng r;
        lm_rng_seed(&r, 42);
        int32_t tok[2][B * T], tgt[2][B * T];
        for (int q = 0; q < 2; q++) {
            random_tokens(&r, tok[q], B * T, c.vocab_size);
            random_tokens(&r, tgt[q], B * T, c.vocab_size);
        }
        const float scale[2] = {0.5f, 0.25f};
        for (int q = 0; q < 2; q++) {
            float la, lb;
            CHECK(!lm_model_forward(a, tok[q], tgt[q], 1, &la) && !lm_model_backward(a, scale[q]), "%s",
                  lm_last_error());
            CHECK(!lm_model_set_head_backward(b, scale[q]), "%s", lm_last_error());
            CHECK(!lm_model_forward(b, tok[q], tgt[q], 1, &lb) && !lm_model_backward(b, scale[q]), "%s",
                  lm_last_error());
            CHECK(la == lb, "tied %d, micro-batch %d: loss %.9g vs %.9g", tied, q, la, lb);
        }
        CHECK(!memcmp(lm_model_grads(a), lm_model_grads(b), lm_model_num_params(a) * sizeof(float)),
              "tied %d: gradients differ with the head's backward in the forward", tied);
        /* the forward really did the head's work: a backward with another scale is refused */
        float l, dlogp[B * T];
        for (int i = 0; i < B * T; i++) dlogp[i] = -0.1f;
        CHECK(!lm_model_forward(b, tok[0], tgt[0], 1, &l), "%s", lm_last_error());
        CHECK(lm_model_backward(b, 0.5f) == LM_ERR_ARG && strstr(lm_last_error(), "loss scale 0.25"),
              "a backward with another scale accepted: %s", lm_last_error());
        CHECK(!lm_model_forward(b, tok[0], tgt[0], 1, &l), "%s", lm_last_error());
        CHECK(lm_model_backward_weighted(b, dlogp) == LM_ERR_ARG, "a weighted backward accepted");
        /* evaluation forwards leave it alone; 0 turns it off; bad scales refused */
        CHECK(!lm_model_forward(b, tok[0], tgt[0], 0, &l) && !lm_model_backward_weighted(b, dlogp), "%s",
              lm_last_error());
        CHECK(!lm_model_set_head_backward(b, 0.0f), "%s", lm_last_error());
        CHECK(!lm_model_forward(b, tok[0], tgt[0], 1, &l) && !lm_model_backward(b, 0.5f), "%s", lm_last_error());
        CHECK(lm_model_set_head_backward(b, -1.0f) == LM_ERR_ARG && lm_model_set_head_backward(b, NAN) == LM_ERR_ARG,
              "negative and NaN scales accepted");
        lm_model_free(a);
        lm_model_free(b);
    }
}

int main(void) {
    RUN(test_gradients_block_attnres);
    RUN(test_gradients_standard_residual);
    RUN(test_gradients_full_attnres);
    RUN(test_chunked_cross_entropy_equals_full_logits);
    RUN(test_initialisation_is_reproducible_and_seeded);
    RUN(test_initialisation_equals_the_serial_stream);
    RUN(test_parameter_count_agrees_with_the_plan);
    RUN(test_bad_tokens_are_rejected_by_position);
    RUN(test_qk_clip_bounds_the_largest_logit);
    RUN(test_recompute_gives_identical_gradients_with_less_memory);
    RUN(test_head_backward_in_the_forward_gives_the_same_bits);
    return test_summary();
}
