/* The RL objective: group-relative advantages are normalised per group, the
 * discounted turn returns follow their definition, the clipped token-level
 * loss's gradient matches finite differences (with and without the KL), the
 * clip zeroes exactly the tokens it should, and environment tokens get zero
 * gradient, through the objective and through the model. */
#include "longmoe/model.h"
#include "longmoe/rl.h"
#include "longmoe/rl_env.h"
#include "test.h"
#include "test_models.h"

static void test_advantages_have_zero_mean_and_unit_std_per_group(void) {
    lm_rng r;
    lm_rng_seed(&r, 1);
    enum { NG = 7, G = 8 };
    float rew[NG * G], adv[NG * G];
    for (int i = 0; i < NG * G; i++) rew[i] = (float)(lm_rng_uniform(&r) < 0.4) + 0.1f * (float)lm_rng_normal(&r);
    for (int i = 0; i < G; i++) rew[3 * G + i] = 0.75f; /* one group with no signal */
    CHECK(lm_grpo_advantages(rew, NG, G, 1e-6f, adv) == LM_OK, "%s", lm_last_error());
    for (int g = 0; g < NG; g++) {
        double m = 0, v = 0, mr = 0, vr = 0;
        for (int i = 0; i < G; i++) mr += rew[g * G + i] / (double)G;
        for (int i = 0; i < G; i++) vr += (rew[g * G + i] - mr) * (rew[g * G + i] - mr) / G;
        for (int i = 0; i < G; i++) m += adv[g * G + i] / (double)G;
        for (int i = 0; i < G; i++) v += (adv[g * G + i] - m) * (adv[g * G + i] - m) / G;
        CHECK_CLOSE(m, 0, 1e-6, 0, "group mean of the advantages");
        if (g == 3) {
            for (int i = 0; i < G; i++) CHECK(adv[g * G + i] == 0, "equal rewards give zero advantage");
        } else {
            CHECK_CLOSE(sqrt(v), 1, 1e-4, 0, "group std of the advantages");
            for (int i = 0; i < G; i++)
                CHECK_CLOSE(adv[g * G + i], (rew[g * G + i] - mr) / (sqrt(vr) + 1e-6), 1e-5, 1e-5, "(r - mean) / (std + eps)");
        }
    }
    /* order within the group is kept: a better reward, a larger advantage */
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < G; i++)
            for (int j = 0; j < G; j++)
                if (rew[g * G + i] > rew[g * G + j]) CHECK(adv[g * G + i] > adv[g * G + j], "monotone");
    CHECK(lm_grpo_advantages(NULL, 1, 4, 1e-6f, adv) == LM_ERR_ARG, "NULL rewards");
    CHECK(lm_grpo_advantages(rew, 1, 0, 1e-6f, adv) == LM_ERR_ARG, "G = 0");
}

static void test_turn_returns_are_discounted_sums(void) {
    lm_rng r;
    lm_rng_seed(&r, 2);
    float rw[13], ret[13];
    for (int i = 0; i < 13; i++) rw[i] = (float)lm_rng_normal(&r);
    const float gammas[] = {0.0f, 0.5f, 0.9f, 1.0f};
    for (int gi = 0; gi < 4; gi++) {
        CHECK(lm_rl_turn_returns(rw, 13, gammas[gi], ret) == LM_OK, "%s", lm_last_error());
        for (int k = 0; k < 13; k++) {
            double want = 0;
            for (int j = k; j < 13; j++) want += pow(gammas[gi], j - k) * rw[j];
            CHECK_CLOSE(ret[k], want, 1e-5, 1e-5, "R_k");
        }
    }
    CHECK(lm_rl_turn_returns(rw, 13, 1.5f, ret) == LM_ERR_ARG, "gamma > 1");
}

typedef struct {
    int64_t N;
    float lp[64], old[64], ref[64], adv[64];
    uint8_t mask[64];
} batch;

/* Ratios drawn away from the clip edges by more than the finite-difference step. */
static void make_batch(batch *b, lm_rng *r, float clip) {
    b->N = 64;
    for (int t = 0; t < b->N; t++) {
        b->old[t] = (float)(-0.2 - 3.0 * lm_rng_uniform(r));
        double lr;
        do lr = 0.6 * lm_rng_normal(r);
        while (fabs(exp(lr) - (1 - clip)) < 0.02 || fabs(exp(lr) - (1 + clip)) < 0.02);
        b->lp[t] = b->old[t] + (float)lr;
        b->ref[t] = b->old[t] + (float)(0.3 * lm_rng_normal(r));
        b->adv[t] = (float)lm_rng_normal(r);
        b->mask[t] = lm_rng_uniform(r) < 0.7;
    }
}

static void test_clipped_loss_gradient_matches_finite_differences(void) {
    lm_rng r;
    lm_rng_seed(&r, 3);
    for (int with_kl = 0; with_kl < 2; with_kl++) {
        lm_grpo_config cfg = {0.2f, 0.28f, with_kl ? 0.05f : 0.0f};
        batch b;
        make_batch(&b, &r, 0.2f);
        float d[64], dd[64];
        lm_grpo_stats s;
        CHECK(lm_grpo_loss(&cfg, b.lp, b.old, with_kl ? b.ref : NULL, b.adv, b.mask, b.N, d, &s) == LM_OK, "%s",
              lm_last_error());
        CHECK(s.clipped_frac > 0.05 && s.clipped_frac < 0.95, "a mix of clipped and free tokens (%g)", s.clipped_frac);
        int checked = 0;
        for (int t = 0; t < b.N; t++) {
            const float h = 1e-3f;
            float keep = b.lp[t];
            double L[2];
            for (int side = 0; side < 2; side++) {
                b.lp[t] = keep + (side ? h : -h);
                lm_grpo_stats s2;
                lm_grpo_loss(&cfg, b.lp, b.old, with_kl ? b.ref : NULL, b.adv, b.mask, b.N, dd, &s2);
                L[side] = s2.loss;
            }
            double hh = ((double)(keep + h) - (double)(keep - h)) / 2; /* the step as rounded in float */
            b.lp[t] = keep;
            CHECK_CLOSE(d[t], (L[1] - L[0]) / (2 * hh), 2e-6, 2e-3, with_kl ? "dL/dlogp with KL" : "dL/dlogp");
            checked += b.mask[t] && d[t] != 0;
        }
        CHECK(checked > 20, "non-zero gradients checked: %d", checked);
    }
}

static void test_clip_zeroes_exactly_the_tokens_moved_too_far(void) {
    lm_grpo_config cfg = {0.2f, 0.2f, 0.0f};
    /* rho = 1.5 with A > 0 and rho = 0.5 with A < 0: clipped; the opposite signs: not */
    float old[4] = {-1, -1, -1, -1};
    float lp[4] = {(float)(-1 + log(1.5)), (float)(-1 + log(0.5)), (float)(-1 + log(1.5)), (float)(-1 + log(0.5))};
    float adv[4] = {1, -1, -1, 1}, d[4];
    uint8_t mask[4] = {1, 1, 1, 1};
    lm_grpo_stats s;
    CHECK(lm_grpo_loss(&cfg, lp, old, NULL, adv, mask, 4, d, &s) == LM_OK, "%s", lm_last_error());
    CHECK(d[0] == 0 && d[1] == 0, "clipped tokens have zero gradient (%g %g)", d[0], d[1]);
    CHECK_CLOSE(d[2], -1.5 * -1 / 4, 1e-6, 1e-5, "rho > 1 + eps with A < 0 keeps -rho A / n");
    CHECK_CLOSE(d[3], -0.5 * 1 / 4, 1e-6, 1e-5, "rho < 1 - eps with A > 0 keeps -rho A / n");
    CHECK_CLOSE(s.clipped_frac, 0.5, 1e-12, 0, "clipped fraction");
    CHECK_CLOSE(s.loss, (-1.2 * 1 - 0.8 * -1 - 1.5 * -1 - 0.5 * 1) / 4, 1e-6, 1e-5, "loss");
}

/* On the sampling policy (rho = 1) without KL: L = -mean A and dL/dlogp = -A/n,
 * nothing clipped, KL to the sampler 0. */
static void test_on_policy_loss_is_minus_the_mean_advantage(void) {
    lm_rng r;
    lm_rng_seed(&r, 4);
    batch b;
    make_batch(&b, &r, 0.2f);
    lm_grpo_config cfg = {0.2f, 0.28f, 0.0f};
    float d[64];
    lm_grpo_stats s;
    CHECK(lm_grpo_loss(&cfg, b.old, b.old, NULL, b.adv, b.mask, b.N, d, &s) == LM_OK, "%s", lm_last_error());
    double m = 0, ent = 0;
    int n = 0;
    for (int t = 0; t < b.N; t++)
        if (b.mask[t]) {
            m += b.adv[t];
            ent -= b.old[t];
            n++;
        }
    CHECK(s.n_tokens == n, "model tokens");
    CHECK_CLOSE(s.loss, -m / n, 1e-6, 1e-6, "L = -mean A");
    CHECK_CLOSE(s.entropy, ent / n, 1e-6, 1e-6, "entropy estimate");
    CHECK(s.clipped_frac == 0 && s.kl_old == 0 && s.ratio_mean == 1, "on-policy monitors");
    for (int t = 0; t < b.N; t++) CHECK_CLOSE(d[t], b.mask[t] ? -b.adv[t] / n : 0, 1e-7, 1e-6, "-A/n");
}

/* Environment tokens (mask 0): dlogp exactly 0 whatever their inputs, and the
 * loss does not depend on them. */
static void test_masked_tokens_carry_no_loss(void) {
    lm_rng r;
    lm_rng_seed(&r, 5);
    batch b;
    make_batch(&b, &r, 0.2f);
    lm_grpo_config cfg = {0.2f, 0.28f, 0.1f};
    float d[64], d2[64];
    lm_grpo_stats s, s2;
    CHECK(lm_grpo_loss(&cfg, b.lp, b.old, b.ref, b.adv, b.mask, b.N, d, &s) == LM_OK, "%s", lm_last_error());
    for (int t = 0; t < b.N; t++) {
        if (b.mask[t]) continue;
        CHECK(d[t] == 0, "masked token %d has gradient %g", t, d[t]);
        b.lp[t] += 3;
        b.adv[t] = 100;
        b.ref[t] -= 2;
    }
    CHECK(lm_grpo_loss(&cfg, b.lp, b.old, b.ref, b.adv, b.mask, b.N, d2, &s2) == LM_OK, "%s", lm_last_error());
    CHECK(s.loss == s2.loss && memcmp(d, d2, sizeof d) == 0, "masked inputs change nothing");
    memset(b.mask, 0, sizeof b.mask);
    CHECK(lm_grpo_loss(&cfg, b.lp, b.old, b.ref, b.adv, b.mask, b.N, d2, &s2) == LM_OK && s2.loss == 0 &&
              s2.n_tokens == 0,
          "no model token: zero loss");
    cfg.kl_coef = 0.1f;
    CHECK(lm_grpo_loss(&cfg, b.lp, b.old, NULL, b.adv, b.mask, b.N, d2, &s2) == LM_ERR_ARG, "KL without reference");
    cfg.clip_low = 1.5f;
    CHECK(lm_grpo_loss(&cfg, b.lp, b.old, b.ref, b.adv, b.mask, b.N, d2, &s2) == LM_ERR_ARG, "clip_low >= 1");
}

/* Through the model: a demonstration's environment bytes (prompt and
 * observations) are masked; the parameter gradient does not change when the
 * targets at those positions do. */
static void test_environment_tokens_get_zero_gradient_through_the_model(void) {
    lm_config c = test_micro_config();
    const int T = 48;
    lm_model *m = NULL;
    CHECK(lm_model_create(&c, 1, T, &m) == LM_OK, "%s", lm_last_error());
    lm_model_init(m, 9);
    char text[4096];
    uint8_t mask[4096];
    int n = 0;
    lm_env_config ec = {LM_ENV_CALC, 3, 0};
    CHECK(lm_env_demo(&ec, 3, text, mask, (int)sizeof text, &n) == LM_OK, "%s", lm_last_error());
    CHECK(n >= T + 1, "demo of %d bytes", n);
    int32_t tok[48], tgt[48];
    uint8_t tmask[48];
    float lp[48], old[48], adv[48], d[48];
    int env_positions = 0;
    for (int t = 0; t < T; t++) {
        tok[t] = (uint8_t)text[t];
        tgt[t] = (uint8_t)text[t + 1];
        tmask[t] = mask[t + 1]; /* the loss at t predicts byte t + 1 */
        env_positions += !tmask[t];
        adv[t] = 0.8f;
    }
    CHECK(env_positions > 10 && env_positions < T - 5, "both kinds of positions (%d env)", env_positions);
    size_t P = lm_model_num_params(m);
    float *g1 = malloc(P * sizeof(float));
    lm_grpo_config gc = {0.2f, 0.28f, 0.0f};
    for (int pass = 0; pass < 2; pass++) {
        lm_model_zero_grads(m);
        CHECK(lm_model_forward(m, tok, tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
        CHECK(lm_model_token_logprobs(m, lp) == LM_OK, "%s", lm_last_error());
        for (int t = 0; t < T; t++) old[t] = lp[t] - 0.05f * (float)((t % 5) - 2);
        CHECK(lm_grpo_loss(&gc, lp, old, NULL, adv, tmask, T, d, NULL) == LM_OK, "%s", lm_last_error());
        CHECK(lm_model_backward_weighted(m, d) == LM_OK, "%s", lm_last_error());
        if (pass == 0) {
            memcpy(g1, lm_model_grads(m), P * sizeof(float));
            for (int t = 0; t < T; t++)
                if (!tmask[t]) tgt[t] = (tgt[t] * 7 + 13) % c.vocab_size; /* other environment text */
        } else {
            CHECK(memcmp(g1, lm_model_grads(m), P * sizeof(float)) == 0,
                  "the environment's targets changed the gradient");
        }
    }
    double norm = 0;
    for (size_t i = 0; i < P; i++) norm += (double)g1[i] * g1[i];
    CHECK(norm > 0, "the model tokens give a gradient");
    free(g1);
    lm_model_free(m);
}

int main(void) {
    RUN(test_advantages_have_zero_mean_and_unit_std_per_group);
    RUN(test_turn_returns_are_discounted_sums);
    RUN(test_clipped_loss_gradient_matches_finite_differences);
    RUN(test_clip_zeroes_exactly_the_tokens_moved_too_far);
    RUN(test_on_policy_loss_is_minus_the_mean_advantage);
    RUN(test_masked_tokens_carry_no_loss);
    RUN(test_environment_tokens_get_zero_gradient_through_the_model);
    return test_summary();
}
