/* RL environments: episodes are pure functions of (kind, difficulty, seed);
 * the solvers succeed on every episode at every difficulty, their per-turn
 * rewards add up to 1 + outcome; any line the model writes, however
 * malformed, is answered with an observation and never fails the call. */
#include "longmoe/rl_env.h"
#include "test.h"

static const int difficulties[] = {1, 2, 5, 16, 64, 256};
#define N_DIFF 6

static void test_episodes_are_deterministic_given_the_seed(void) {
    static char a[1 << 16], b[1 << 16];
    static uint8_t ma[1 << 16], mb[1 << 16];
    for (int k = 0; k < LM_ENV_COUNT; k++)
        for (int di = 0; di < N_DIFF; di++) {
            lm_env_config cfg = {(lm_env_kind)k, difficulties[di], 0};
            int na = 0, nb = 0, differ = 0;
            for (uint64_t seed = 1; seed <= 5; seed++) {
                CHECK(lm_env_demo(&cfg, seed * 7919, a, ma, (int)sizeof a, &na) == LM_OK, "%s", lm_last_error());
                CHECK(lm_env_demo(&cfg, seed * 7919, b, mb, (int)sizeof b, &nb) == LM_OK, "%s", lm_last_error());
                CHECK(na == nb && memcmp(a, b, (size_t)na) == 0 && memcmp(ma, mb, (size_t)na) == 0,
                      "%s d=%d seed %llu: two runs differ", lm_env_kind_name((lm_env_kind)k), difficulties[di],
                      (unsigned long long)seed);
                /* another seed gives another episode (grid d=1 has only 2 goals, lookups 676 keys) */
                CHECK(lm_env_demo(&cfg, seed * 7919 + 1, b, mb, (int)sizeof b, &nb) == LM_OK, "%s", lm_last_error());
                differ += na != nb || memcmp(a, b, (size_t)na) != 0;
            }
            CHECK(differ >= 2, "%s d=%d: seeds give the same episodes", lm_env_kind_name((lm_env_kind)k),
                  difficulties[di]);
        }
}

/* The solver, run through lm_env_step: success on 200 seeds per kind and
 * difficulty, turns within max_turns, rewards summing to 2, and (grid) some
 * episodes recovering from a wall. */
static void test_solvers_always_succeed(void) {
    for (int k = 0; k < LM_ENV_COUNT; k++) {
        int walls_hit = 0;
        for (int di = 0; di < N_DIFF; di++)
            for (uint64_t seed = 0; seed < 200; seed++) {
                lm_env_config cfg = {(lm_env_kind)k, difficulties[di], 0};
                lm_env env;
                char prompt[LM_ENV_MAX_PROMPT];
                int n = 0;
                CHECK(lm_env_reset(&env, &cfg, seed, prompt, (int)sizeof prompt, &n) == LM_OK, "%s", lm_last_error());
                CHECK(n > 2 && prompt[0] == 'T' && prompt[1] == ':' && prompt[n - 1] == '\n', "prompt format");
                double total = 0;
                int steps = 0;
                lm_env_turn t = {0};
                while (!env.done && steps < 10000) {
                    char line[LM_ENV_MAX_TEXT];
                    int m = lm_env_solver_line(&env, line, (int)sizeof line);
                    CHECK(m > 2 && m <= LM_ENV_MAX_LINE, "solver line length %d", m);
                    CHECK(lm_env_step(&env, line, m, &t) == LM_OK, "%s", lm_last_error());
                    CHECK(!t.malformed, "the solver wrote a malformed line %.*s", m, line);
                    if (!t.done)
                        CHECK(t.len >= 3 && (t.text[0] == 'R' || t.text[0] == 'E') && t.text[1] == ':' &&
                                  t.text[t.len - 1] == '\n',
                              "observation format");
                    walls_hit += t.len > 0 && strncmp(t.text, "E:wall", 6) == 0;
                    total += t.reward;
                    steps++;
                }
                CHECK(env.success && t.success, "%s d=%d seed %llu: the solver failed",
                      lm_env_kind_name((lm_env_kind)k), difficulties[di], (unsigned long long)seed);
                CHECK(env.turns <= env.cfg.max_turns, "turns %d > %d", env.turns, env.cfg.max_turns);
                CHECK_CLOSE(total, 2.0, 1e-4, 0, "turn rewards of a solved episode");
            }
        if (k == LM_ENV_GRID) CHECK(walls_hit > 100, "grid solver met walls only %d times", walls_hit);
    }
}

/* Demonstration text: the mask marks exactly the model's lines (those
 * starting "C:" or "A:") with their '\n'; the environment's bytes are 0. */
static void test_demo_mask_marks_model_lines(void) {
    static char text[1 << 16];
    static uint8_t mask[1 << 16];
    for (int k = 0; k < LM_ENV_COUNT; k++) {
        lm_env_config cfg = {(lm_env_kind)k, 7, 0};
        int n = 0;
        CHECK(lm_env_demo(&cfg, 42, text, mask, (int)sizeof text, &n) == LM_OK, "%s", lm_last_error());
        int start = 0, model_lines = 0;
        for (int i = 0; i < n; i++) {
            if (text[i] != '\n') continue;
            int model = text[start] == 'C' || text[start] == 'A';
            model_lines += model;
            for (int j = start; j <= i; j++) CHECK(mask[j] == model, "mask at byte %d of %.*s", j, i - start, text + start);
            start = i + 1;
        }
        CHECK(start == n, "demo ends with a newline");
        CHECK(model_lines >= 8, "%d model lines for difficulty 7", model_lines);
        CHECK(lm_env_demo(&cfg, 42, text, mask, 10, &n) == LM_ERR_ARG, "small capacity is an error");
    }
}

/* Random and hostile lines: every one is answered (an "E:" line, malformed
 * or failed call) or ends the episode as an answer; nothing fails. */
static void test_malformed_calls_get_an_error_observation(void) {
    lm_rng r;
    lm_rng_seed(&r, 77);
    const char *fixed[] = {"", "C:", "C:get", "C:get ", "C:get abc", "C:calc 1+", "C:calc +1", "C:calc 99999+1",
                           "C:calc 1/2", "C:move x", "C:move ", "C:moven", "X:get ab", "C:get AB", "c:get ab",
                           "C:calc 1+2+3", "C:move ee", "C:frobnicate"};
    int n_fixed = (int)(sizeof fixed / sizeof fixed[0]);
    for (int k = 0; k < LM_ENV_COUNT; k++)
        for (int trial = 0; trial < 400; trial++) {
            lm_env_config cfg = {(lm_env_kind)k, 3, 1000};
            lm_env env;
            char prompt[LM_ENV_MAX_PROMPT], line[64];
            int n = 0;
            CHECK(lm_env_reset(&env, &cfg, (uint64_t)trial, prompt, (int)sizeof prompt, &n) == LM_OK, "reset");
            int m;
            if (trial < n_fixed) {
                m = (int)strlen(fixed[trial]);
                memcpy(line, fixed[trial], (size_t)m);
            } else {
                m = (int)(lm_rng_u64(&r) % 48);
                for (int i = 0; i < m; i++) line[i] = (char)(lm_rng_u64(&r) & 0xff);
                if (trial % 3 == 0 && m >= 2) { /* keep a valid prefix, garble the rest */
                    line[0] = 'C';
                    line[1] = ':';
                }
            }
            lm_env_turn t;
            lm_status st = lm_env_step(&env, line, m, &t);
            CHECK(st == LM_OK, "line of %d bytes: %s", m, lm_last_error());
            int is_answer = m >= 2 && line[0] == 'A' && line[1] == ':';
            if (!is_answer) {
                CHECK(!t.done && t.len >= 3 && t.text[0] == 'E' && t.text[1] == ':' && t.text[t.len - 1] == '\n',
                      "%s trial %d: want an E: observation, got '%.*s'", lm_env_kind_name((lm_env_kind)k), trial,
                      t.len, t.text);
                CHECK(t.reward == 0, "no reward for a malformed line");
                /* the episode goes on: the solver still finishes it */
                while (!env.done) {
                    char s[LM_ENV_MAX_TEXT];
                    int sm = lm_env_solver_line(&env, s, (int)sizeof s);
                    CHECK(lm_env_step(&env, s, sm, &t) == LM_OK, "%s", lm_last_error());
                }
                CHECK(env.success, "recovered after a malformed line");
            }
        }
    /* stepping a finished episode, bad configs: errors, not crashes */
    lm_env env;
    char prompt[LM_ENV_MAX_PROMPT];
    int n;
    lm_env_config cfg = {LM_ENV_CALC, 2, 0};
    CHECK(lm_env_reset(&env, &cfg, 1, prompt, (int)sizeof prompt, &n) == LM_OK, "reset");
    lm_env_turn t;
    CHECK(lm_env_step(&env, "A:0", 3, &t) == LM_OK && t.done, "an answer ends the episode");
    CHECK(lm_env_step(&env, "A:0", 3, &t) == LM_ERR_ARG, "no step after the end");
    CHECK(lm_env_step(&env, NULL, 3, &t) == LM_ERR_ARG, "NULL line");
    lm_env_config bad = {LM_ENV_GRID, 0, 0};
    CHECK(lm_env_reset(&env, &bad, 1, prompt, (int)sizeof prompt, &n) == LM_ERR_ARG, "difficulty 0");
    bad.difficulty = LM_ENV_MAX_DIFFICULTY + 1;
    CHECK(lm_env_reset(&env, &bad, 1, prompt, (int)sizeof prompt, &n) == LM_ERR_ARG, "difficulty too large");
    bad = (lm_env_config){(lm_env_kind)7, 1, 0};
    CHECK(lm_env_reset(&env, &bad, 1, prompt, (int)sizeof prompt, &n) == LM_ERR_ARG, "unknown kind");
    /* max_turns cuts the episode */
    cfg = (lm_env_config){LM_ENV_LOOKUP, 4, 2};
    CHECK(lm_env_reset(&env, &cfg, 3, prompt, (int)sizeof prompt, &n) == LM_OK, "reset");
    CHECK(lm_env_step(&env, "hello", 5, &t) == LM_OK && !t.done, "turn 1");
    CHECK(lm_env_step(&env, "hello", 5, &t) == LM_OK && t.done && !t.success, "turn 2 ends the episode");
}

/* A wrong answer scores 0; the right one 1. */
static void test_answers_are_checked(void) {
    for (int k = 0; k < LM_ENV_COUNT; k++) {
        lm_env_config cfg = {(lm_env_kind)k, 4, 0};
        lm_env env, copy;
        char prompt[LM_ENV_MAX_PROMPT], line[LM_ENV_MAX_TEXT];
        int n;
        CHECK(lm_env_reset(&env, &cfg, 5, prompt, (int)sizeof prompt, &n) == LM_OK, "reset");
        lm_env_turn t;
        for (;;) {
            int m = lm_env_solver_line(&env, line, (int)sizeof line);
            if (line[0] == 'A') {
                copy = env;
                CHECK(lm_env_step(&copy, "A:zz9", 5, &t) == LM_OK && t.done && !t.success && t.reward == 0,
                      "wrong answer");
                CHECK(lm_env_step(&env, line, m, &t) == LM_OK && t.done && t.success && t.reward == 1, "right answer");
                break;
            }
            CHECK(lm_env_step(&env, line, m, &t) == LM_OK, "step");
        }
    }
}

int main(void) {
    RUN(test_episodes_are_deterministic_given_the_seed);
    RUN(test_solvers_always_succeed);
    RUN(test_demo_mask_marks_model_lines);
    RUN(test_malformed_calls_get_an_error_observation);
    RUN(test_answers_are_checked);
    return test_summary();
}
