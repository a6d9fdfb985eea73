/* The model's per-token interface for policy gradients: the targets'
 * log-probabilities equal log-softmax of the logits, the weighted backward is
 * the gradient of sum_i w_i log p(target_i) (finite differences), it is
 * bit-identical to the mean cross-entropy's backward for uniform weights, and
 * a position of weight zero contributes nothing (its target may change). */
#include "longmoe/model.h"
#include "test.h"
#include "test_models.h"

typedef struct {
    lm_model *m;
    int B, T, N, V;
    int32_t *tok, *tgt;
} fixture;

static fixture make(uint64_t seed) {
    fixture f;
    lm_config c = test_micro_config();
    f.B = 2;
    f.T = 24;
    CHECK(lm_model_create(&c, f.B, f.T, &f.m) == LM_OK, "%s", lm_last_error());
    lm_model_init(f.m, seed);
    f.N = f.B * f.T;
    f.V = c.vocab_size;
    f.tok = malloc((size_t)f.N * sizeof(int32_t));
    f.tgt = malloc((size_t)f.N * sizeof(int32_t));
    lm_rng r;
    lm_rng_seed(&r, seed + 1);
    for (int i = 0; i < f.N; i++) {
        f.tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)f.V);
        f.tgt[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)f.V);
    }
    return f;
}

static void done(fixture *f) {
    lm_model_free(f->m);
    free(f->tok);
    free(f->tgt);
}

static void test_token_logprobs_are_log_softmax_of_the_logits(void) {
    fixture f = make(11);
    float loss = 0, *logp = malloc((size_t)f.N * sizeof(float)), *z = malloc((size_t)f.N * f.V * sizeof(float));
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, &loss) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_token_logprobs(f.m, logp) == LM_OK, "%s", lm_last_error());
    double mean = 0;
    for (int i = 0; i < f.N; i++) mean -= logp[i] / (double)f.N;
    CHECK_CLOSE(mean, loss, 1e-5, 1e-5, "mean of -log p equals the cross-entropy");
    CHECK(lm_model_logits(f.m, f.tok, z) == LM_OK, "%s", lm_last_error());
    for (int i = 0; i < f.N; i++) {
        double mx = -INFINITY, s = 0;
        for (int v = 0; v < f.V; v++) mx = fmax(mx, z[(size_t)i * f.V + v]);
        for (int v = 0; v < f.V; v++) s += exp(z[(size_t)i * f.V + v] - mx);
        double want = z[(size_t)i * f.V + f.tgt[i]] - mx - log(s);
        CHECK_CLOSE(logp[i], want, 2e-5, 1e-5, "log p(target) at a position");
    }
    /* after lm_model_logits (no targets) there is nothing to report */
    CHECK(lm_model_token_logprobs(f.m, logp) == LM_ERR_ARG, "needs a forward with targets");
    free(logp);
    free(z);
    done(&f);
}

static void test_uniform_weights_equal_the_mean_cross_entropy_backward_bitwise(void) {
    fixture f = make(12);
    size_t P = lm_model_num_params(f.m);
    float *g1 = malloc(P * sizeof(float)), *w = malloc((size_t)f.N * sizeof(float));
    const float loss_scale = 0.37f;
    float s = loss_scale / (float)f.N;
    for (int i = 0; i < f.N; i++) w[i] = -s;
    lm_model_zero_grads(f.m);
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward(f.m, loss_scale) == LM_OK, "%s", lm_last_error());
    memcpy(g1, lm_model_grads(f.m), P * sizeof(float));
    lm_model_zero_grads(f.m);
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward_weighted(f.m, w) == LM_OK, "%s", lm_last_error());
    CHECK(memcmp(g1, lm_model_grads(f.m), P * sizeof(float)) == 0, "weighted backward differs from lm_model_backward");
    double norm = 0;
    for (size_t i = 0; i < P; i++) norm += (double)g1[i] * g1[i];
    CHECK(norm > 0, "a gradient at all");
    free(g1);
    free(w);
    done(&f);
}

static void test_zero_weight_position_contributes_nothing(void) {
    fixture f = make(13);
    size_t P = lm_model_num_params(f.m);
    float *g1 = malloc(P * sizeof(float)), *w = malloc((size_t)f.N * sizeof(float));
    lm_rng r;
    lm_rng_seed(&r, 5);
    for (int i = 0; i < f.N; i++) w[i] = (float)lm_rng_normal(&r);
    const int j = 17;
    w[j] = 0;
    lm_model_zero_grads(f.m);
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward_weighted(f.m, w) == LM_OK, "%s", lm_last_error());
    memcpy(g1, lm_model_grads(f.m), P * sizeof(float));
    /* another target at j: with weight 0 the gradient is bit-identical */
    f.tgt[j] = (f.tgt[j] + 1 + (int32_t)(lm_rng_u64(&r) % 200)) % f.V;
    lm_model_zero_grads(f.m);
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward_weighted(f.m, w) == LM_OK, "%s", lm_last_error());
    CHECK(memcmp(g1, lm_model_grads(f.m), P * sizeof(float)) == 0, "the target of a zero-weight position changed the gradient");
    /* control: with a non-zero weight the same change does change it */
    w[j] = 1.0f;
    f.tgt[j] = (f.tgt[j] + 3) % f.V;
    lm_model_zero_grads(f.m);
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward_weighted(f.m, w) == LM_OK, "%s", lm_last_error());
    CHECK(memcmp(g1, lm_model_grads(f.m), P * sizeof(float)) != 0, "a weighted position moves the gradient");
    free(g1);
    free(w);
    done(&f);
}

/* d/dtheta of sum_i w_i log p(target_i) by central differences, on the LM
 * head and the final norm (past the routers, so the function is smooth). */
static void test_weighted_backward_matches_finite_differences(void) {
    fixture f = make(14);
    size_t P = lm_model_num_params(f.m);
    float *w = malloc((size_t)f.N * sizeof(float)), *logp = malloc((size_t)f.N * sizeof(float));
    float *grad = malloc(P * sizeof(float));
    lm_rng r;
    lm_rng_seed(&r, 6);
    for (int i = 0; i < f.N; i++) w[i] = (float)lm_rng_normal(&r) / (float)f.N;
    lm_model_zero_grads(f.m);
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward_weighted(f.m, w) == LM_OK, "%s", lm_last_error());
    memcpy(grad, lm_model_grads(f.m), P * sizeof(float));
    const char *names[] = {"final_norm", "lm_head", "embed"};
    float *theta = lm_model_params(f.m);
    int checked = 0;
    for (int t = 0; t < 3; t++) {
        const lm_model_tensor *ten = lm_model_find(f.m, names[t]);
        if (!ten) continue;
        for (int k = 0; k < 6; k++) {
            size_t idx = ten->offset + (size_t)(lm_rng_u64(&r) % ten->numel);
            if (t == 2) idx = ten->offset + (size_t)f.tok[k] * (size_t)ten->shape[1] + (size_t)k; /* a row the batch uses */
            double obj[2];
            const float h = 2e-3f;
            float keep = theta[idx];
            for (int side = 0; side < 2; side++) {
                theta[idx] = keep + (side ? h : -h);
                CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
                lm_model_token_logprobs(f.m, logp);
                double o = 0;
                for (int i = 0; i < f.N; i++) o += (double)w[i] * logp[i];
                obj[side] = o;
            }
            theta[idx] = keep;
            double fd = (obj[1] - obj[0]) / (2.0 * h);
            /* dlogp = w is the loss sum_i w_i log p_i: its gradient is d obj / d theta */
            CHECK_CLOSE(grad[idx], fd, 2e-4, 3e-2, names[t]);
            checked++;
        }
    }
    CHECK(checked >= 12, "checked %d parameters", checked);
    free(w);
    free(logp);
    free(grad);
    done(&f);
}

static void test_bad_arguments_are_errors(void) {
    fixture f = make(15);
    float *w = calloc((size_t)f.N, sizeof(float));
    CHECK(lm_model_backward_weighted(f.m, w) == LM_ERR_ARG, "no forward with targets yet");
    CHECK(lm_model_forward(f.m, f.tok, f.tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_backward_weighted(f.m, NULL) == LM_ERR_ARG, "NULL weights");
    w[3] = NAN;
    CHECK(lm_model_backward_weighted(f.m, w) == LM_ERR_ARG, "non-finite weight");
    CHECK(lm_model_token_logprobs(f.m, NULL) == LM_ERR_ARG, "NULL output");
    free(w);
    done(&f);
}

int main(void) {
    RUN(test_token_logprobs_are_log_softmax_of_the_logits);
    RUN(test_uniform_weights_equal_the_mean_cross_entropy_backward_bitwise);
    RUN(test_zero_weight_position_contributes_nothing);
    RUN(test_weighted_backward_matches_finite_differences);
    RUN(test_bad_arguments_are_errors);
    return test_summary();
}
