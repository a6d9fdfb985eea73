/* The RL run: the `rl` config section reads back what it writes and rejects
 * unknown keys; advantages are normalised within each group (outcome credit)
 * or over the group's turns (turn credit) and are zero off the model's bytes;
 * environment bytes get zero gradient through the whole RL objective and the
 * model (changing them as targets changes nothing); a run stopped twice and
 * resumed ends bit-identical to an uninterrupted one, and the report draws
 * its curves; the RL presets load with the settings the docs state; the
 * selection split's seeds meet neither a training nor a held-out seed, and the
 * held-out seeds are the ones the demonstration's numbers were measured on. */
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/model.h"
#include "longmoe/report.h"
#include "longmoe/rl_run.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"

static void test_rl_config_round_trips_and_rejects_unknown_keys(void) {
    const char *text = "{\"model\": {\"d_model\": 32}, \"rl\": {\"envs\": [\"grid\", \"lookup\"], \"credit\": \"turn\", "
                       "\"gamma\": 0.5, \"tasks\": 3, \"group\": 4, \"max_len\": 80, \"steps\": 7, \"seed\": 12, "
                       "\"top_p\": 0.9}}";
    lm_rl_config c, d;
    lm_rl_config_defaults(&c);
    CHECK(lm_rl_config_parse(text, strlen(text), "t", &c) == LM_OK, "%s", lm_last_error());
    CHECK(c.n_envs == 2 && c.envs[0] == LM_ENV_GRID && c.envs[1] == LM_ENV_LOOKUP, "envs in order");
    CHECK(c.credit == LM_CREDIT_TURN && c.gamma == 0.5f && c.tasks == 3 && c.group == 4 && c.steps == 7 &&
          c.seed == 12 && c.top_p == 0.9f, "keys read");
    char *json = lm_rl_config_to_json(&c);
    lm_rl_config_defaults(&d);
    CHECK(json && lm_rl_config_parse(json, strlen(json), "round trip", &d) == LM_OK, "%s", lm_last_error());
    CHECK(!memcmp(&c, &d, sizeof c), "what is written reads back the same");
    free(json);
    const char *bad[] = {"{\"rl\": {\"lr2\": 1}}", "{\"rl\": {\"credit\": \"later\"}}", "{\"rl\": {\"envs\": [\"maze\"]}}",
                         "{\"rl\": {\"group\": 1}}", "{\"rl\": {\"difficulty_min\": 3, \"difficulty_max\": 2}}"};
    for (int i = 0; i < 5; i++) {
        lm_rl_config_defaults(&d);
        CHECK(lm_rl_config_parse(bad[i], strlen(bad[i]), "bad", &d) == LM_ERR_ARG, "rejected: %s", bad[i]);
    }
    /* a file: the model sections go to the model config, rl to the rl config */
    char root[256];
    if (test_make_tmpdir(root, sizeof root, "rl-config")) SKIP("no temporary directory");
    const char *path = test_path(root, "c.json");
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
    lm_config mc;
    lm_config_defaults(&mc);
    lm_rl_config_defaults(&d);
    CHECK(lm_rl_config_load(path, &mc, &d) == LM_OK, "%s", lm_last_error());
    CHECK(mc.d_model == 32 && d.tasks == 3, "both sections read from one file");
    unlink(path);
    rmdir(root);
}

/* A hand-made batch of 2 groups of 3 trajectories of 12 positions. */
typedef struct {
    lm_rollout r;
    int32_t tokens[6 * 12];
    uint8_t mask[6 * 12];
    float logp[6 * 12], turn_reward[6 * 12];
    int16_t turn[6 * 12];
    int len[6], n_turns[6], success[6], malformed[6], truncated[6];
} fake_batch;

static void make_fake(fake_batch *f, lm_rng *g) {
    memset(f, 0, sizeof *f);
    f->r.B = 6;
    f->r.max_len = 12;
    f->r.tokens = f->tokens;
    f->r.mask = f->mask;
    f->r.logp = f->logp;
    f->r.turn = f->turn;
    f->r.turn_reward = f->turn_reward;
    f->r.len = f->len;
    f->r.n_turns = f->n_turns;
    f->r.success = f->success;
    f->r.malformed = f->malformed;
    f->r.truncated = f->truncated;
    for (int b = 0; b < 6; b++) {
        f->len[b] = 6 + (int)(lm_rng_u64(g) % 7);
        f->success[b] = lm_rng_uniform(g) < 0.5;
        int turn = -1;
        for (int t = 0; t < 12; t++) {
            f->turn[b * 12 + t] = -1;
            if (t < 2 || t >= f->len[b]) continue;
            f->tokens[b * 12 + t] = 65 + t;
            f->mask[b * 12 + t] = (t % 3) != 0; /* two model bytes, then one environment byte */
            if (f->mask[b * 12 + t]) {
                if (t % 3 == 1 || turn < 0) turn++;
                f->turn[b * 12 + t] = (int16_t)turn;
            }
        }
        f->n_turns[b] = turn + 1;
        for (int k = 0; k < f->n_turns[b]; k++) f->turn_reward[b * 12 + k] = (float)lm_rng_uniform(g);
    }
    f->success[0] = 1;
    f->success[1] = 0; /* group 0 has signal */
}

static void test_advantages_are_normalised_per_group_and_zero_off_model_bytes(void) {
    lm_rng g;
    lm_rng_seed(&g, 5);
    fake_batch f;
    make_fake(&f, &g);
    float adv[72];
    const float eps = 1e-6f;
    CHECK(lm_rl_advantages(&f.r, 3, LM_CREDIT_OUTCOME, 1.0f, adv) == LM_OK, "%s", lm_last_error());
    for (int g0 = 0; g0 < 6; g0 += 3) {
        double m = 0, v = 0;
        for (int i = 0; i < 3; i++) m += f.success[g0 + i] / 3.0;
        for (int i = 0; i < 3; i++) v += (f.success[g0 + i] - m) * (f.success[g0 + i] - m) / 3.0;
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < 12; t++) {
                int b = g0 + i, model = t + 1 < f.len[b] && f.mask[b * 12 + t + 1];
                double want = !model || v == 0 ? 0 : (f.success[b] - m) / (sqrt(v) + eps);
                CHECK_CLOSE(adv[b * 12 + t], want, 1e-5, 1e-5, "outcome advantage");
            }
    }
    /* turn credit with a discount: the return of the token's turn, normalised over the group's turns */
    const float gamma = 0.7f;
    CHECK(lm_rl_advantages(&f.r, 3, LM_CREDIT_TURN, gamma, adv) == LM_OK, "%s", lm_last_error());
    for (int g0 = 0; g0 < 6; g0 += 3) {
        double R[3][12], m = 0, v = 0;
        int n = 0;
        for (int i = 0; i < 3; i++)
            for (int k = 0; k < f.n_turns[g0 + i]; k++) {
                R[i][k] = 0;
                for (int j = k; j < f.n_turns[g0 + i]; j++) R[i][k] += pow(gamma, j - k) * f.turn_reward[(g0 + i) * 12 + j];
                m += R[i][k];
                n++;
            }
        m /= n;
        for (int i = 0; i < 3; i++)
            for (int k = 0; k < f.n_turns[g0 + i]; k++) v += (R[i][k] - m) * (R[i][k] - m) / n;
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < 12; t++) {
                int b = g0 + i, model = t + 1 < f.len[b] && f.mask[b * 12 + t + 1];
                double want = model ? (R[i][f.turn[b * 12 + t + 1]] - m) / (sqrt(v) + eps) : 0;
                CHECK_CLOSE(adv[b * 12 + t], want, 1e-4, 1e-5, "turn advantage");
            }
    }
    CHECK(lm_rl_advantages(&f.r, 4, LM_CREDIT_OUTCOME, 1.0f, adv) == LM_ERR_ARG, "a group that does not divide B");
}

/* The RL objective's gradient through the model: the targets at environment
 * positions (model_mask 0) may be anything; the gradient is bit-identical. */
static void test_environment_bytes_get_zero_gradient_through_the_model(void) {
    lm_config c = test_micro_config();
    enum { B = 4, L = 64 };
    lm_model *m;
    CHECK(lm_model_create(&c, B, L, &m) == LM_OK, "%s", lm_last_error());
    lm_model_init(m, 21);
    lm_rollout *r;
    CHECK(lm_rollout_create(m, B, L, &r) == LM_OK, "%s", lm_last_error());
    lm_env_config envs[B];
    uint64_t seeds[B];
    for (int b = 0; b < B; b++) {
        envs[b] = (lm_env_config){(lm_env_kind)(b % 3), 1, 0};
        seeds[b] = 2 * (uint64_t)b;
    }
    lm_rollout_config rc = {1.0f, 1.0f};
    CHECK(lm_rollout_run(r, envs, seeds, &rc, 3) == LM_OK, "%s", lm_last_error());
    int32_t tgt[B * L];
    uint8_t wm[B * L];
    float adv[B * L], lp[B * L], dl[B * L];
    lm_rl_targets(r, tgt, wm);
    lm_rng g;
    lm_rng_seed(&g, 8);
    int env_positions = 0;
    for (int i = 0; i < B * L; i++) {
        adv[i] = wm[i] ? (float)lm_rng_normal(&g) : 0.0f; /* any advantages: here random */
        env_positions += !wm[i];
    }
    CHECK(env_positions > 10, "environment positions to test (%d)", env_positions);
    size_t P = lm_model_num_params(m);
    float *g1 = malloc(P * sizeof(float));
    lm_grpo_config gc = {0.2f, 0.2f, 0.0f};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            for (int i = 0; i < B * L; i++)
                if (!wm[i]) tgt[i] = (int32_t)(lm_rng_u64(&g) % 256);
        CHECK(lm_model_forward(m, r->tokens, tgt, 0, NULL) == LM_OK, "%s", lm_last_error());
        CHECK(lm_model_token_logprobs(m, lp) == LM_OK, "%s", lm_last_error());
        /* old log-probabilities a little off the current ones: ratios != 1 */
        float old[B * L];
        lm_rng h;
        lm_rng_seed(&h, 99);
        for (int i = 0; i < B * L; i++) old[i] = lp[i] + 0.05f * (float)lm_rng_normal(&h);
        for (int i = 0; i < B * L; i++)
            if (!wm[i]) old[i] = lp[i] = 0; /* unused there */
        CHECK(lm_grpo_loss(&gc, lp, old, NULL, adv, wm, B * L, dl, NULL) == LM_OK, "%s", lm_last_error());
        for (int i = 0; i < B * L; i++)
            if (!wm[i]) CHECK(dl[i] == 0, "dL/dlogp is 0 at an environment position");
        lm_model_zero_grads(m);
        CHECK(lm_model_backward_weighted(m, dl) == LM_OK, "%s", lm_last_error());
        if (pass == 0) memcpy(g1, lm_model_grads(m), P * sizeof(float));
        else CHECK(!memcmp(g1, lm_model_grads(m), P * sizeof(float)), "other environment targets, same gradient");
    }
    free(g1);
    lm_rollout_free(r);
    lm_model_free(m);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Training seeds are even (run.c clears bit 0); both evaluation splits are
 * odd, and no selection seed equals a held-out seed, of any environment, over
 * every episode index rl.eval_episodes allows (up to 2^20). The held-out seeds
 * are still those of the formula the documented numbers were measured with. */
static void test_selection_seeds_meet_no_training_or_held_out_seed(void) {
    const int J = 1 << 20; /* rl.eval_episodes' upper bound (src/rl/config.c) */
    const size_t n = (size_t)LM_ENV_COUNT * J;
    uint64_t *held = malloc(n * sizeof *held), *sel = malloc(n * sizeof *sel);
    CHECK(held && sel, "memory");
    if (!held || !sel) return;
    int odd = 1, same_as_before = 1, differ_by_split = 1;
    for (int k = 0; k < LM_ENV_COUNT; k++)
        for (int j = 0; j < J; j++) {
            size_t i = (size_t)k * J + j;
            held[i] = lm_rl_eval_seed(LM_RL_SPLIT_HELDOUT, (lm_env_kind)k, j);
            sel[i] = lm_rl_eval_seed(LM_RL_SPLIT_SELECT, (lm_env_kind)k, j);
            odd &= (int)(held[i] & sel[i] & 1);
            same_as_before &= held[i] == (lm_mix64(0x686f6c646f7574ull ^ ((uint64_t)k << 40) ^ (uint64_t)j) | 1ull);
            differ_by_split &= held[i] != sel[i];
        }
    CHECK(odd, "every evaluation seed is odd, so none is a training seed");
    CHECK(same_as_before, "the held-out seeds are unchanged");
    CHECK(differ_by_split, "the two splits differ episode by episode");
    qsort(held, n, sizeof *held, cmp_u64);
    qsort(sel, n, sizeof *sel, cmp_u64);
    size_t a = 0, b = 0, common = 0;
    while (a < n && b < n) {
        if (held[a] == sel[b]) common++, a++, b++;
        else if (held[a] < sel[b]) a++;
        else b++;
    }
    CHECK(common == 0, "%zu selection seeds are also held-out seeds", common);
    free(held);
    free(sel);
}

/* A run whose RL steps carry signal: a warm start long enough that the micro
 * model solves some grid episodes, then RL with a KL to the reference. */
static lm_rl_config small_rl(void) {
    lm_rl_config rc;
    lm_rl_config_defaults(&rc);
    rc.n_envs = 1;
    rc.envs[0] = LM_ENV_GRID;
    rc.difficulty_min = 1;
    rc.difficulty_max = 3;
    rc.tasks = 2;
    rc.group = 4;
    rc.max_len = 48;
    rc.warm_steps = 120;
    rc.warm_lr = 0.05f;
    rc.steps = 4;
    rc.eval_episodes = 4;
    rc.kl_coef = 0.05f;
    rc.epochs = 2;
    rc.keep_checkpoints = 5;
    rc.seed = 4;
    return rc;
}

/* metrics.jsonl without its timings: every "step_seconds": value removed */
static char *metrics_without_timings(const char *path) {
    size_t n;
    char *s = test_slurp(path, &n);
    if (!s) return NULL;
    char *w = s;
    for (char *p = s; *p;) {
        if (!strncmp(p, "\"step_seconds\": ", 16)) {
            p += 16;
            while (*p && *p != ',' && *p != '}') p++;
            continue;
        }
        *w++ = *p++;
    }
    *w = 0;
    return s;
}

static void test_resumed_run_is_bit_identical(void) {
    lm_config mc = test_micro_config();
    lm_rl_config rc = small_rl();
    char root[256], cmd[600];
    if (test_make_tmpdir(root, sizeof root, "rl-resume")) SKIP("no temporary directory");
    char a[300], b[300];
    snprintf(a, sizeof a, "%s/a", root);
    snprintf(b, sizeof b, "%s/b", root);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    lm_rl_options oa = {a, NULL, 0, 0, NULL, LM_RL_SPLIT_HELDOUT};
    lm_rl_result ra;
    CHECK(lm_rl_run(&mc, &rc, &oa, &ra) == LM_OK, "%s", lm_last_error());
    CHECK(ra.step == 124 && !isnan(ra.warm_success[0]) && !isnan(ra.final_success[0]), "the whole run");
    /* the same run stopped inside the warm start, then right after RL began, then finished */
    lm_rl_options ob = {b, NULL, 0, 60, NULL, LM_RL_SPLIT_HELDOUT};
    lm_rl_result rb;
    CHECK(lm_rl_run(&mc, &rc, &ob, &rb) == LM_OK && rb.step == 60, "%s", lm_last_error());
    ob.resume = 1;
    ob.stop_after = 122;
    CHECK(lm_rl_run(NULL, NULL, &ob, &rb) == LM_OK && rb.step == 122, "%s", lm_last_error());
    ob.stop_after = 0;
    CHECK(lm_rl_run(NULL, NULL, &ob, &rb) == LM_OK && rb.step == 124, "%s", lm_last_error());
    const char *files[] = {"model.safetensors", "trainer.safetensors", "rl.json", "config.json"};
    for (int i = 0; i < 4; i++) {
        char pa[256], pb[256];
        snprintf(pa, sizeof pa, "%s/checkpoint-00000124/%s", a, files[i]);
        snprintf(pb, sizeof pb, "%s/checkpoint-00000124/%s", b, files[i]);
        if (i == 2) continue; /* rl.json holds the metrics' byte count: compared below */
        CHECK(test_same_file(pa, pb), "%s is bit-identical after two resumes", files[i]);
    }
    char pa[256], pb[256];
    snprintf(pa, sizeof pa, "%s/metrics.jsonl", a);
    snprintf(pb, sizeof pb, "%s/metrics.jsonl", b);
    char *ma = metrics_without_timings(pa), *mb = metrics_without_timings(pb);
    CHECK(ma && mb && strstr(ma, "\"type\": \"rl\"") && strstr(ma, "\"type\": \"rl_eval\""), "metrics written");
    /* the RL steps had something to learn from: a batch with successes and failures */
    int mixed = 0;
    for (const char *line = ma; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        const char *v = strstr(line, "\"success\": ");
        if (!strncmp(line, "{\"type\": \"rl\",", 14) && v) mixed |= atof(v + 11) > 0 && atof(v + 11) < 1;
    }
    CHECK(mixed, "some RL batch mixed solved and unsolved episodes");
    /* a resume cuts the log back to its checkpoint: the log is the uninterrupted one's */
    CHECK(ma && mb && !strcmp(ma, mb), "every metrics line (timings aside) equals the uninterrupted run's");
    free(ma);
    free(mb);
    /* the report draws the RL curves */
    lm_report_options ro = lm_report_options_default(a);
    lm_report_summary sum;
    CHECK(lm_report_write(&ro, &sum) == LM_OK, "%s", lm_last_error());
    CHECK(sum.rl_records == 120 + 4 + 2 && sum.malformed == 0, "rl records drawn (%lld)", (long long)sum.rl_records);
    snprintf(pa, sizeof pa, "%s/report.html", a);
    size_t n;
    char *html = test_slurp(pa, &n);
    CHECK(html && strstr(html, "Held-out success") && strstr(html, "Clipped fraction") && strstr(html, "Entropy") &&
          strstr(html, "Trajectory length") && strstr(html, "KL"), "the report has the RL charts");
    free(html);
    CHECK(system(cmd) == 0, "clean");
}

/* The RL presets load (both sections) and hold the settings docs/rl.md
 * states for its demonstrations: the model of configs/tiny.json; rl-small on
 * the three environments, rl-lookup (the first stage of the lookup-and-grid
 * run: lookup demonstrations only, no RL) and rl-lookup-grid (3 more
 * warm-start steps, then 250 RL steps on lookup and grid), the same RL
 * hyperparameters in all three. */
static void test_rl_presets_load_with_the_documented_settings(void) {
    const char *paths[] = {"configs/rl-small.json", "configs/rl-lookup.json", "configs/rl-lookup-grid.json"};
    const int n_envs[] = {3, 1, 2}, warm[] = {75, 22, 3}, steps[] = {200, 0, 250};
    lm_config tiny;
    CHECK(lm_config_load("configs/tiny.json", &tiny) == LM_OK, "%s", lm_last_error());
    for (int i = 0; i < 3; i++) {
        lm_config mc;
        lm_rl_config c;
        lm_config_defaults(&mc);
        lm_rl_config_defaults(&c);
        CHECK(lm_rl_config_load(paths[i], &mc, &c) == LM_OK, "%s", lm_last_error());
        CHECK(mc.d_model == tiny.d_model && mc.n_layers == tiny.n_layers && mc.vocab_size == 256, "%s: the tiny model",
              paths[i]);
        CHECK(c.n_envs == n_envs[i] && c.envs[0] == LM_ENV_LOOKUP && c.warm_steps == warm[i] && c.steps == steps[i],
              "%s: environments and lengths", paths[i]);
        CHECK(c.credit == LM_CREDIT_TURN && c.tasks == 4 && c.group == 8 && c.max_len == 96 && c.epochs == 2 &&
              c.lr == 0.0005f && c.adam_lr == 0.0003f && c.difficulty_min == 1 && c.difficulty_max == 2 &&
              c.eval_episodes == 64 && c.seed == 1, "%s: the RL hyperparameters", paths[i]);
    }
    lm_config mc;
    lm_rl_config c;
    lm_config_defaults(&mc);
    lm_rl_config_defaults(&c);
    CHECK(lm_rl_config_load("configs/rl-lookup-grid.json", &mc, &c) == LM_OK && c.envs[1] == LM_ENV_GRID,
          "rl-lookup-grid: lookup and grid");
}

/* `longmoe rl` end to end on a micro model, and its usage errors. */
static void test_cli_runs_resumes_and_refuses_bad_usage(void) {
    char root[256];
    if (test_make_tmpdir(root, sizeof root, "rl-cli")) SKIP("no temporary directory");
    lm_config mc = test_micro_config();
    char *json = lm_config_to_json(&mc);
    char *end = strrchr(json, '}');
    *end = 0;
    FILE *f = fopen(test_path(root, "c.json"), "w");
    fprintf(f, "%s, \"rl\": {\"tasks\": 2, \"group\": 2, \"max_len\": 48, \"warm_steps\": 2, \"steps\": 2, "
            "\"eval_episodes\": 2, \"credit\": \"turn\", \"gamma\": 0.9}}\n", json);
    fclose(f);
    free(json);
    char args[2048];
    const char *out = test_path(root, "out.txt"), *err = test_path(root, "err.txt");
    snprintf(args, sizeof args, "rl --config %s/c.json --out %s/run --steps 1", root, root);
    CHECK(test_run_cli(args, out, err) == 0, "a run");
    CHECK(test_file_has(out, "held-out greedy success, warm start -> after RL"), "the summary line");
    snprintf(args, sizeof args, "%s/run/metrics.jsonl", root);
    CHECK(test_file_has(args, "\"rl_eval\"") && !test_file_has(args, "\"split\""), "held-out by default");
    /* a checkpoint evaluated alone on the selection split, then on held-out as by default */
    snprintf(args, sizeof args, "rl --config %s/c.json --init %s/run/checkpoint-00000003 --warm-steps 0 --steps 0 "
             "--out %s/sel --eval-split select", root, root, root);
    CHECK(test_run_cli(args, out, err) == 0 && test_file_has(out, "selection greedy success"), "--eval-split select");
    snprintf(args, sizeof args, "%s/sel/metrics.jsonl", root);
    CHECK(test_file_has(args, "\"split\": \"select\""), "the evaluation says its split");
    /* a run that evaluates on the selection split: its report names the split */
    snprintf(args, sizeof args, "rl --config %s/c.json --out %s/selrun --steps 1 --eval-split select --quiet", root,
             root);
    CHECK(test_run_cli(args, out, err) == 0, "a run on the selection split");
    snprintf(args, sizeof args, "report %s/selrun", root);
    CHECK(test_run_cli(args, out, err) == 0, "its report");
    snprintf(args, sizeof args, "%s/selrun/report.html", root);
    CHECK(test_file_has(args, "Selection-split success"), "the report names the split");
    snprintf(args, sizeof args, "report %s/run", root);
    CHECK(test_run_cli(args, out, err) == 0, "the held-out run's report");
    snprintf(args, sizeof args, "%s/run/report.html", root);
    CHECK(test_file_has(args, "Held-out success (greedy)") && !test_file_has(args, "Selection-split success"),
          "held-out by default");
    snprintf(args, sizeof args, "rl --config %s/c.json --out %s/x --eval-split test", root, root);
    CHECK(test_run_cli(args, out, err) == 2 && test_file_has(err, "--eval-split must be heldout or select"),
          "bad --eval-split");
    snprintf(args, sizeof args, "%s/run/checkpoint-00000003/model.safetensors", root);
    CHECK(access(args, F_OK) == 0, "its checkpoint (2 warm + 1 RL steps)");
    snprintf(args, sizeof args, "rl --out %s/run --resume --config %s/c.json", root, root);
    CHECK(test_run_cli(args, out, err) == 2 && test_file_has(err, "--resume continues the run"), "--resume with --config");
    snprintf(args, sizeof args, "rl --config %s/c.json", root);
    CHECK(test_run_cli(args, out, err) == 2 && test_file_has(err, "--out and --config are required"), "no --out");
    snprintf(args, sizeof args, "rl --config %s/c.json --out %s/x --credit sideways", root, root);
    CHECK(test_run_cli(args, out, err) == 2 && test_file_has(err, "--credit must be outcome or turn"), "bad --credit");
    snprintf(args, sizeof args, "rl --out %s/x --frobnicate", root);
    CHECK(test_run_cli(args, out, err) == 2 && test_file_has(err, "unknown option"), "unknown option");
    snprintf(args, sizeof args, "rm -rf %s", root);
    CHECK(system(args) == 0, "clean");
}

int main(void) {
    RUN(test_rl_config_round_trips_and_rejects_unknown_keys);
    RUN(test_selection_seeds_meet_no_training_or_held_out_seed);
    RUN(test_advantages_are_normalised_per_group_and_zero_off_model_bytes);
    RUN(test_environment_bytes_get_zero_gradient_through_the_model);
    RUN(test_resumed_run_is_bit_identical);
    RUN(test_cli_runs_resumes_and_refuses_bad_usage);
    RUN(test_rl_presets_load_with_the_documented_settings);
    return test_summary();
}
