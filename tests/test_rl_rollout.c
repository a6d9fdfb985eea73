/* Batched rollouts: the same seeds give the same trajectories bit for bit;
 * the bytes the model did not write are exactly the environment's prompt and
 * answers to the model's lines (replayed on a fresh episode), carrying mask 0;
 * the sampling log-probabilities recorded while stepping equal the full
 * forward's over the finished trajectory (no prefix recomputed, none needed);
 * malformed and over-long lines end in error observations, never a failure;
 * a model that follows the protocol solves the episodes. */
#include "longmoe/model.h"
#include "longmoe/rl_rollout.h"
#include "test.h"
#include "test_models.h"

enum { B = 4, L = 160 };

static lm_model *micro_model(uint64_t seed, int Bm, int Tm) {
    lm_config c = test_micro_config();
    lm_model *m = NULL;
    CHECK(lm_model_create(&c, Bm, Tm, &m) == LM_OK, "%s", lm_last_error());
    lm_model_init(m, seed);
    return m;
}

static void episodes(lm_env_config *envs, uint64_t *seeds) {
    for (int b = 0; b < B; b++) {
        envs[b].kind = (lm_env_kind)(b % LM_ENV_COUNT);
        envs[b].difficulty = 1 + b % 2;
        envs[b].max_turns = 0;
        seeds[b] = 1000 + 7 * (uint64_t)b;
    }
}

/* Scale the LM head rows of some bytes: their logits vary more, so they are
 * sometimes the likely ones and lines end inside the limit now and then. */
static void favour_bytes(lm_model *m, const char *bytes, float scale) {
    const lm_model_tensor *t = lm_model_find(m, "lm_head");
    if (!t) t = lm_model_find(m, "embed");
    float *w = lm_model_params(m) + t->offset;
    const int d = (int)t->shape[1];
    for (const char *p = bytes; *p; p++)
        for (int j = 0; j < d; j++) w[(size_t)(unsigned char)*p * d + j] *= scale;
}

static void test_rollouts_are_deterministic_given_the_seeds(void) {
    lm_model *m = micro_model(3, 1, 8);
    favour_bytes(m, "\nC:A", 6.0f);
    lm_rollout *r1, *r2;
    CHECK(lm_rollout_create(m, B, L, &r1) == LM_OK, "%s", lm_last_error());
    CHECK(lm_rollout_create(m, B, L, &r2) == LM_OK, "%s", lm_last_error());
    lm_env_config envs[B];
    uint64_t seeds[B];
    episodes(envs, seeds);
    lm_rollout_config rc = {1.0f, 0.95f};
    CHECK(lm_rollout_run(r1, envs, seeds, &rc, 42) == LM_OK, "%s", lm_last_error());
    CHECK(lm_rollout_run(r2, envs, seeds, &rc, 42) == LM_OK, "%s", lm_last_error());
    const size_t n = (size_t)B * L;
    CHECK(!memcmp(r1->tokens, r2->tokens, n * sizeof(int32_t)), "same seeds, same tokens");
    CHECK(!memcmp(r1->mask, r2->mask, n), "same masks");
    CHECK(!memcmp(r1->logp, r2->logp, n * sizeof(float)), "same log-probabilities");
    CHECK(!memcmp(r1->len, r2->len, B * sizeof(int)), "same lengths");
    /* a second run on the same buffers starts afresh */
    CHECK(lm_rollout_run(r1, envs, seeds, &rc, 42) == LM_OK, "%s", lm_last_error());
    CHECK(!memcmp(r1->tokens, r2->tokens, n * sizeof(int32_t)), "reused buffers give the same tokens");
    /* another sampling seed draws other bytes */
    CHECK(lm_rollout_run(r2, envs, seeds, &rc, 43) == LM_OK, "%s", lm_last_error());
    CHECK(memcmp(r1->tokens, r2->tokens, n * sizeof(int32_t)) != 0, "another seed, other tokens");
    lm_rollout_free(r1);
    lm_rollout_free(r2);
    lm_model_free(m);
}

/* Replay the model's lines on a fresh episode: every forced byte must be the
 * environment's, and every model byte carries mask 1 and its turn. */
static void check_replay(const lm_rollout *r, int b, const lm_env_config *ec, uint64_t seed) {
    const int32_t *tok = r->tokens + (size_t)b * r->max_len;
    const uint8_t *mask = r->mask + (size_t)b * r->max_len;
    const int16_t *turn = r->turn + (size_t)b * r->max_len;
    lm_env env;
    char text[LM_ENV_MAX_PROMPT + LM_ENV_MAX_TEXT + 2];
    int n, pos = 0, turns = 0, malformed = 0, ok = 1;
    CHECK(lm_env_reset(&env, ec, seed, text, (int)sizeof text, &n) == LM_OK, "%s", lm_last_error());
    for (int i = 0; i < n && pos < r->len[b]; i++, pos++) ok &= tok[pos] == (unsigned char)text[i] && !mask[pos];
    CHECK(ok, "sequence %d starts with its prompt, mask 0", b);
    while (pos < r->len[b] && !env.done) {
        char line[LM_ENV_MAX_LINE + 2];
        int k = 0, nl = 0;
        while (pos < r->len[b] && mask[pos] && !nl && k <= LM_ENV_MAX_LINE) {
            ok &= turn[pos] == turns;
            if (tok[pos] == '\n') nl = 1;
            else line[k++] = (char)tok[pos];
            pos++;
        }
        CHECK(ok, "model bytes carry their turn index (sequence %d)", b);
        if (!nl && k <= LM_ENV_MAX_LINE) break; /* cut by max_len while writing */
        lm_env_turn t;
        CHECK(lm_env_step(&env, line, k, &t) == LM_OK, "%s", lm_last_error());
        CHECK(r->turn_reward[(size_t)b * r->max_len + turns] == t.reward, "turn %d's reward", turns);
        turns++;
        malformed += t.malformed;
        int m = 0;
        if (!nl) text[m++] = '\n'; /* the cut line's forced end */
        memcpy(text + m, t.text, (size_t)t.len);
        m += t.len;
        for (int i = 0; i < m && pos < r->len[b]; i++, pos++) ok &= tok[pos] == (unsigned char)text[i] && !mask[pos];
        CHECK(ok, "the observation after turn %d of sequence %d is the environment's, mask 0", turns, b);
        if (t.done) CHECK(r->success[b] == t.success, "the episode's outcome");
    }
    CHECK(pos == r->len[b], "sequence %d: the replay covers the trajectory (%d of %d)", b, pos, r->len[b]);
    CHECK(turns == r->n_turns[b] && malformed == r->malformed[b], "turns %d/%d, malformed %d/%d", turns,
          r->n_turns[b], malformed, r->malformed[b]);
    CHECK(env.done || r->truncated[b], "an unfinished episode is marked truncated");
    for (int i = r->len[b]; i < r->max_len; i++) CHECK(!mask[i] && tok[i] == 0, "padding");
}

static void test_forced_bytes_are_the_environment_s_and_carry_no_mask(void) {
    lm_model *m = micro_model(5, 1, 8);
    favour_bytes(m, "\nC:A", 6.0f);
    lm_rollout *r;
    CHECK(lm_rollout_create(m, B, L, &r) == LM_OK, "%s", lm_last_error());
    lm_env_config envs[B];
    uint64_t seeds[B];
    episodes(envs, seeds);
    lm_rollout_config rc = {1.0f, 1.0f};
    int total_turns = 0, total_malformed = 0;
    for (uint64_t s = 0; s < 3; s++) {
        CHECK(lm_rollout_run(r, envs, seeds, &rc, 100 + s) == LM_OK, "%s", lm_last_error());
        for (int b = 0; b < B; b++) {
            check_replay(r, b, &envs[b], seeds[b]);
            total_turns += r->n_turns[b];
            total_malformed += r->malformed[b];
        }
    }
    CHECK(total_turns > 0 && total_malformed > 0, "lines reached the environment (%d) and malformed ones were "
          "answered with errors (%d)", total_turns, total_malformed);
    lm_rollout_free(r);
    lm_model_free(m);
}

static void test_stepped_logprobs_equal_the_full_forward(void) {
    lm_model *m = micro_model(9, B, L);
    favour_bytes(m, "\nC:A", 4.0f);
    lm_rollout *r;
    CHECK(lm_rollout_create(m, B, L, &r) == LM_OK, "%s", lm_last_error());
    lm_env_config envs[B];
    uint64_t seeds[B];
    episodes(envs, seeds);
    lm_rollout_config rc = {0.8f, 0.9f};
    CHECK(lm_rollout_run(r, envs, seeds, &rc, 7) == LM_OK, "%s", lm_last_error());
    int32_t *tgt = calloc((size_t)B * L, sizeof(int32_t));
    float *logp = malloc((size_t)B * L * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int t = 0; t + 1 < r->len[b]; t++) tgt[(size_t)b * L + t] = r->tokens[(size_t)b * L + t + 1];
    float loss;
    CHECK(lm_model_forward(m, r->tokens, tgt, 0, &loss) == LM_OK, "%s", lm_last_error());
    CHECK(lm_model_token_logprobs(m, logp) == LM_OK, "%s", lm_last_error());
    int checked = 0;
    double worst = 0;
    for (int b = 0; b < B; b++)
        for (int t = 1; t < r->len[b]; t++)
            if (r->mask[(size_t)b * L + t]) {
                double e = fabs(r->logp[(size_t)b * L + t] - logp[(size_t)b * L + t - 1]);
                worst = e > worst ? e : worst;
                checked++;
            }
    CHECK(checked > 20, "model tokens to compare (%d)", checked);
    CHECK(worst < 2e-4, "decoder and forward log-probabilities agree (worst %.3g)", worst);
    free(tgt);
    free(logp);
    lm_rollout_free(r);
    lm_model_free(m);
}

static void test_bad_arguments_are_errors(void) {
    lm_model *m = micro_model(1, 1, 8);
    lm_rollout *r = NULL;
    CHECK(lm_rollout_create(m, 0, L, &r) == LM_ERR_ARG, "B = 0");
    CHECK(lm_rollout_create(m, 1, 8, &r) == LM_OK, "%s", lm_last_error());
    lm_env_config ec = {LM_ENV_CALC, 8, 0};
    uint64_t seed = 1;
    lm_rollout_config rc = {1.0f, 1.0f};
    CHECK(lm_rollout_run(r, &ec, &seed, &rc, 1) == LM_ERR_ARG, "a prompt longer than max_len");
    ec.difficulty = 1;
    rc.top_p = 0;
    CHECK(lm_rollout_run(r, &ec, &seed, &rc, 1) == LM_ERR_ARG, "top_p = 0");
    lm_rollout_free(r);
    lm_model_free(m);
}

int main(void) {
    RUN(test_rollouts_are_deterministic_given_the_seeds);
    RUN(test_forced_bytes_are_the_environment_s_and_carry_no_mask);
    RUN(test_stepped_logprobs_equal_the_full_forward);
    RUN(test_bad_arguments_are_errors);
    return test_summary();
}
