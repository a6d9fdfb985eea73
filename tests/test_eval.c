/* Evaluation: the scoring counts exactly the greedy hits at answer positions
 * (checked on hand-made oracle logits) and the loss per position bucket
 * equals a float64 reference; a checkpoint of a micro model trained for a few
 * steps evaluates to well-formed JSON lines with the documented fields, grid
 * shapes and accuracies in [0, 1]; validation follows the data and length of
 * the checkpoint's stage; on token shards, `longmoe eval` of a run scores the
 * same held-out split as the trainer's own evaluation (the same number); bad
 * options and paths fail clearly. */
#include <sys/wait.h>
#include <unistd.h>

#include "json.h"
#include "longmoe/eval.h"
#include "longmoe/linear.h"
#include "longmoe/shards.h"
#include "longmoe/tasks.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"

static char root[256];

static const char *dir(const char *name) {
    static char buf[4][512];
    static int slot;
    slot = (slot + 1) % 4;
    snprintf(buf[slot], sizeof buf[slot], "%s/%s", root, name);
    return buf[slot];
}

static lm_config micro(void) {
    lm_config c = test_micro_config();
    c.seq_len = 48;
    c.steps = 4;
    c.keep_checkpoints = 8;
    strcpy(c.data, "mix");
    return c;
}

/* The micro run at dir("run") (4 steps on mix), trained by the first test that
 * needs it; 0 when it is there. */
static int trained_run(void) {
    static int state; /* 0 not yet, 1 trained, -1 failed */
    if (!state) {
        lm_config c = micro();
        lm_train_options to = lm_train_options_default(dir("run"));
        to.progress = NULL;
        lm_train_result tr;
        state = lm_train(&c, &to, &tr) ? -1 : 1;
        CHECK(state == 1, "training the micro run: %s", lm_last_error());
    }
    return state == 1 ? 0 : -1;
}

/* ---- scoring on oracle logits ---- */

static void test_scoring_counts_greedy_hits_at_answer_positions_and_whole_rows(void) {
    enum { B = 3, T = 23, V = 11 };
    static float logits[B * T * V];
    static int32_t tgt[B * T];
    static uint8_t ans[B * T];
    lm_rng r;
    lm_rng_seed(&r, 17);
    int n_ans = 0, rows_with = 0;
    for (int b = 0; b < B; b++) {
        int any = 0;
        for (int t = 0; t < T; t++) {
            int i = b * T + t;
            tgt[i] = (int32_t)(lm_rng_u64(&r) % V);
            ans[i] = b < 2 && lm_rng_uniform(&r) < 0.4; /* row 2 has no answers */
            n_ans += ans[i];
            any |= ans[i];
            for (int v = 0; v < V; v++) logits[i * V + v] = (float)lm_rng_normal(&r);
        }
        rows_with += any;
    }
    /* the oracle: the target is the strict maximum everywhere */
    for (int i = 0; i < B * T; i++) logits[i * V + tgt[i]] = 10;
    lm_eval_tally t;
    CHECK(!lm_eval_tally_init(&t, T, 4), "%s", lm_last_error());
    CHECK(!lm_eval_score(&t, logits, tgt, ans, B, V), "%s", lm_last_error());
    CHECK(t.answers == n_ans && t.answers_right == n_ans, "right %lld of %lld, want %d", (long long)t.answers_right,
          (long long)t.answers, n_ans);
    CHECK(t.rows == rows_with && t.rows_right == rows_with, "rows %lld/%lld", (long long)t.rows_right,
          (long long)t.rows);
    CHECK_CLOSE(lm_eval_tally_answer_accuracy(&t), 1.0, 0, 0, "oracle accuracy");
    CHECK_CLOSE(lm_eval_tally_row_accuracy(&t), 1.0, 0, 0, "oracle row accuracy");
    /* one wrong answer in row 0: one digit and one row lost */
    int first = -1;
    for (int i = 0; i < T && first < 0; i++)
        if (ans[i]) first = i;
    logits[first * V + (tgt[first] + 1) % V] = 20;
    CHECK(!lm_eval_tally_init(&t, T, 4) && !lm_eval_score(&t, logits, tgt, ans, B, V), "%s", lm_last_error());
    CHECK(t.answers_right == n_ans - 1 && t.rows_right == rows_with - 1, "after one miss: %lld right, %lld rows",
          (long long)t.answers_right, (long long)t.rows_right);
    /* the anti-oracle: another token is the maximum everywhere */
    for (int i = 0; i < B * T; i++) logits[i * V + (tgt[i] + 3) % V] = 30;
    CHECK(!lm_eval_tally_init(&t, T, 4) && !lm_eval_score(&t, logits, tgt, ans, B, V), "%s", lm_last_error());
    CHECK_CLOSE(lm_eval_tally_answer_accuracy(&t), 0.0, 0, 0, "anti-oracle accuracy");
    CHECK_CLOSE(lm_eval_tally_row_accuracy(&t), 0.0, 0, 0, "anti-oracle row accuracy");
    /* ties go to the lowest index */
    for (int i = 0; i < B * T * V; i++) logits[i] = 0.5f;
    for (int i = 0; i < B * T; i++) tgt[i] = (i % 2) ? 0 : 1;
    CHECK(!lm_eval_tally_init(&t, T, 4) && !lm_eval_score(&t, logits, tgt, NULL, B, V), "%s", lm_last_error());
    CHECK(t.answers == 0 && isnan(lm_eval_tally_answer_accuracy(&t)), "no answers must give NaN accuracy");
    memset(ans, 1, sizeof ans);
    CHECK(!lm_eval_tally_init(&t, T, 4) && !lm_eval_score(&t, logits, tgt, ans, B, V), "%s", lm_last_error());
    int zeros = 0;
    for (int i = 0; i < B * T; i++) zeros += tgt[i] == 0;
    CHECK(t.answers_right == zeros, "ties: %lld right, want %d (index 0 wins)", (long long)t.answers_right, zeros);
    /* a non-finite logit is an error, not a silent number */
    logits[5] = NAN;
    CHECK(lm_eval_score(&t, logits, tgt, ans, B, V) == LM_ERR_NUMERIC, "NaN logits accepted");
    tgt[0] = V;
    logits[5] = 0;
    CHECK(lm_eval_score(&t, logits, tgt, ans, B, V) == LM_ERR_ARG, "target outside the vocabulary accepted");
}

static void test_loss_by_position_bucket_equals_a_float64_reference(void) {
    enum { B = 2, T = 37, V = 9, NB = 5 };
    static float logits[B * T * V];
    static int32_t tgt[B * T];
    lm_rng r;
    lm_rng_seed(&r, 23);
    for (int i = 0; i < B * T * V; i++) logits[i] = (float)(3 * lm_rng_normal(&r));
    for (int i = 0; i < B * T; i++) tgt[i] = (int32_t)(lm_rng_u64(&r) % V);
    lm_eval_tally t;
    CHECK(!lm_eval_tally_init(&t, T, NB) && !lm_eval_score(&t, logits, tgt, NULL, B, V), "%s", lm_last_error());
    double total = 0;
    for (int k = 0; k < NB; k++) {
        int lo = k * T / NB, hi = (k + 1) * T / NB;
        CHECK(lm_eval_bucket_edge(&t, k) == lo && lm_eval_bucket_edge(&t, k + 1) == hi, "edges of bucket %d", k);
        double sum = 0;
        for (int b = 0; b < B; b++)
            for (int p = lo; p < hi; p++) {
                const float *z = logits + ((size_t)b * T + p) * V;
                double s = 0;
                for (int v = 0; v < V; v++) s += exp((double)z[v]);
                sum += log(s) - z[tgt[b * T + p]];
            }
        total += sum;
        CHECK_CLOSE(lm_eval_tally_bucket_loss(&t, k), sum / (B * (hi - lo)), 1e-12, 1e-9, "bucket loss");
    }
    CHECK_CLOSE(lm_eval_tally_loss(&t), total / (B * T), 1e-12, 1e-9, "mean loss");
    /* more buckets than positions: the empty ones are NaN, the loss unchanged */
    CHECK(!lm_eval_tally_init(&t, 3, 8) && !lm_eval_score(&t, logits, tgt, NULL, 1, V), "%s", lm_last_error());
    int empty = 0;
    for (int k = 0; k < 8; k++) empty += isnan(lm_eval_tally_bucket_loss(&t, k));
    CHECK(empty == 5, "%d empty buckets of 8 over 3 positions, want 5", empty);
}

/* ---- scoring without logits (lm_model_score) ---- */

/* lm_model_score on the CPU gives the nll and argmax of lm_score_row on
 * lm_model_logits' logits bit for bit, and lm_eval_score_tokens on them the
 * same tally as lm_eval_score on the logits: a model initialised at random, a
 * vocabulary of 300 (no multiple of 4 or 32) and 2 x 43 positions (the
 * chunks of 32 rows end in a partial one), random tokens, targets and answer
 * mask. */
static void test_model_scores_equal_the_logits_path_bit_for_bit(void) {
    lm_config c = test_micro_config();
    c.vocab_size = 300;
    enum { B = 2, T = 43, N = B * T };
    const int V = 300;
    lm_model *m;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_rng r;
    lm_rng_seed(&r, 0x5c0e);
    lm_model_init(m, lm_rng_u64(&r));
    static int32_t tok[N], tgt[N], arg[N], arg_ref[N];
    static uint8_t ans[N];
    static double nll[N], nll_ref[N];
    float *logits = malloc((size_t)N * V * sizeof(float));
    CHECK(logits != NULL, "out of memory");
    if (!logits) {
        lm_model_free(m);
        return;
    }
    for (int i = 0; i < N; i++) {
        tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)V);
        tgt[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)V);
        ans[i] = lm_rng_uniform(&r) < 0.3;
    }
    CHECK(!lm_model_logits(m, tok, logits), "%s", lm_last_error());
    for (int i = 0; i < N; i++) lm_score_row(logits + (size_t)i * V, V, tgt[i], &nll_ref[i], &arg_ref[i]);
    CHECK(!lm_model_score(m, tok, tgt, nll, arg), "%s", lm_last_error());
    int diff = 0, right = 0;
    for (int i = 0; i < N; i++) {
        diff += memcmp(&nll[i], &nll_ref[i], sizeof(double)) != 0 || arg[i] != arg_ref[i];
        right += arg[i] == tgt[i];
        /* the reference itself: log-sum-exp of the row, in double */
        double mx = -INFINITY, s = 0;
        for (int v = 0; v < V; v++) mx = logits[(size_t)i * V + v] > mx ? logits[(size_t)i * V + v] : mx;
        for (int v = 0; v < V; v++) s += exp(logits[(size_t)i * V + v] - mx);
        CHECK_CLOSE(nll[i], mx + log(s) - logits[(size_t)i * V + tgt[i]], 1e-12, 1e-12, "nll");
        CHECK(logits[(size_t)i * V + arg[i]] == mx, "position %d: argmax %d is not a maximum", i, arg[i]);
    }
    CHECK(diff == 0, "%d of %d positions differ from the logits path", diff, N);
    CHECK(nll[0] > 0 && nll[0] < 20, "nll %g of a random model is not near log V", nll[0]);
    lm_eval_tally a, b;
    CHECK(!lm_eval_tally_init(&a, T, 5) && !lm_eval_tally_init(&b, T, 5), "%s", lm_last_error());
    CHECK(!lm_eval_score(&a, logits, tgt, ans, B, V), "%s", lm_last_error());
    CHECK(!lm_eval_score_tokens(&b, nll, arg, tgt, ans, B), "%s", lm_last_error());
    CHECK(!memcmp(&a, &b, sizeof a), "the tallies differ: loss %.17g vs %.17g, answers %lld/%lld vs %lld/%lld",
          lm_eval_tally_loss(&a), lm_eval_tally_loss(&b), (long long)a.answers_right, (long long)a.answers,
          (long long)b.answers_right, (long long)b.answers);
    CHECK(a.answers > 0 && a.loss_count[4] > 0, "the mask and buckets are exercised");
    /* a second call on other tokens gives that call's scores (nothing kept from the first) */
    for (int i = 0; i < N; i++) tok[i] = (tok[i] + 1 + i) % V;
    CHECK(!lm_model_logits(m, tok, logits), "%s", lm_last_error());
    CHECK(!lm_model_score(m, tok, tgt, nll, arg), "%s", lm_last_error());
    diff = 0;
    for (int i = 0; i < N; i++) {
        lm_score_row(logits + (size_t)i * V, V, tgt[i], &nll_ref[i], &arg_ref[i]);
        diff += memcmp(&nll[i], &nll_ref[i], sizeof(double)) != 0 || arg[i] != arg_ref[i];
    }
    CHECK(diff == 0, "second call: %d of %d positions differ", diff, N);
    /* bad input: a target outside the vocabulary; a non-finite score */
    tgt[7] = V;
    CHECK(lm_model_score(m, tok, tgt, nll, arg) == LM_ERR_ARG && strstr(lm_last_error(), "target 300"),
          "a target outside the vocabulary must be refused, got: %s", lm_last_error());
    tgt[7] = 0;
    nll[N - 1] = NAN;
    lm_eval_tally t;
    lm_eval_tally_init(&t, T, 1);
    CHECK(lm_eval_score_tokens(&t, nll, arg, tgt, ans, B) == LM_ERR_NUMERIC &&
              strstr(lm_last_error(), "row 1 position 42"),
          "a non-finite score must be refused naming its place, got: %s", lm_last_error());
    free(logits);
    lm_model_free(m);
}

/* ---- a checkpoint ---- */

/* Every line of `path` from line `skip` on, parsed; returns the count. */
static int read_lines(const char *path, int skip, lm_json_doc **docs, int max) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    static char line[1 << 16];
    int n = 0, k = 0;
    while (fgets(line, sizeof line, f)) {
        if (k++ < skip) continue;
        if (n == max || lm_json_parse(line, strlen(line), path, &docs[n])) {
            fclose(f);
            return -1;
        }
        n++;
    }
    fclose(f);
    return n;
}

static int count_lines(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    fclose(f);
    return n;
}

static const char *str(const lm_json *o, const char *key) {
    const lm_json *v = lm_json_get(o, key);
    return v && v->kind == LM_JSON_STRING ? v->string : "";
}

static double num(const lm_json *o, const char *key) {
    const lm_json *v = lm_json_get(o, key);
    return v && v->kind == LM_JSON_NUMBER ? v->number : NAN;
}

/* A [rows][cols] grid of numbers in [0, 1] (or null); returns the cells that are numbers. */
static int check_grid(const lm_json *g, int rows, int cols, const char *what) {
    int ok = g && g->kind == LM_JSON_ARRAY && (int)g->count == rows, numbers = 0;
    CHECK(ok, "%s: not an array of %d rows", what, rows);
    if (!ok) return 0;
    for (const lm_json *row = g->child; row; row = row->next) {
        CHECK(row->kind == LM_JSON_ARRAY && (int)row->count == cols, "%s: a row is not %d cells", what, cols);
        for (const lm_json *c = row->child; c; c = c->next) {
            CHECK(c->kind == LM_JSON_NULL || (c->kind == LM_JSON_NUMBER && c->number >= 0 && c->number <= 1),
                  "%s: a cell is neither null nor in [0, 1]", what);
            numbers += c->kind == LM_JSON_NUMBER;
        }
    }
    return numbers;
}

static lm_eval_options small_options(void) {
    lm_eval_options o = lm_eval_options_default();
    o.n_lengths = 2;
    o.lengths[0] = 64, o.lengths[1] = 96;
    o.n_depths = 3;
    o.depths[0] = 0, o.depths[1] = 0.5, o.depths[2] = 1;
    o.n_queries = 3;
    o.queries[0] = 1, o.queries[1] = 3, o.queries[2] = 6; /* 6 + 6 pairs do not fit 64 */
    o.batches = 1;
    o.batch_size = 2;
    o.n_buckets = 4;
    return o;
}

static void test_eval_of_a_trained_checkpoint_writes_the_documented_lines(void) {
    if (trained_run()) return;
    lm_eval_options o = small_options();
    const char *log = dir("eval.jsonl");
    FILE *f = fopen(log, "wb"), *table = fopen(dir("table.txt"), "wb");
    CHECK(f && table, "cannot create the output files");
    if (!f || !table) return;
    CHECK(!lm_eval_checkpoint(dir("run"), &o, f, table), "%s", lm_last_error());
    fclose(f);
    fclose(table);
    lm_json_doc *docs[8];
    int n = read_lines(log, 0, docs, 8);
    CHECK(n == 3, "%d well-formed lines, want 3 (eval, passkey, mqar)", n);
    for (int i = 0; i < n && n == 3; i++) {
        const lm_json *o_ = lm_json_root(docs[i]);
        const char *type = str(o_, "type");
        CHECK(num(o_, "step") == 4, "%s: step %g, want 4", type, num(o_, "step"));
        if (!strcmp(type, "eval")) {
            CHECK(isfinite(num(o_, "val_loss")) && num(o_, "val_loss") > 0, "val_loss %g", num(o_, "val_loss"));
            double acc = num(o_, "answer_accuracy");
            CHECK(acc >= 0 && acc <= 1, "answer_accuracy %g", acc);
            const lm_json *e = lm_json_get(o_, "bucket_edges"), *l = lm_json_get(o_, "loss_by_position");
            CHECK(e && e->count == 5 && l && l->count == 4, "4 buckets need 5 edges and 4 losses");
            int prev = -1, bad = 0;
            for (const lm_json *x = e ? e->child : NULL; x; x = x->next) bad += x->integer <= prev, prev = (int)x->integer;
            CHECK(!bad && e && e->child->integer == 0 && prev == 48, "edges must rise from 0 to the length 48");
            for (const lm_json *x = l ? l->child : NULL; x; x = x->next)
                CHECK(x->kind == LM_JSON_NUMBER && x->number > 0, "a bucket loss is not a positive number");
            CHECK(!strcmp(str(o_, "data"), "mix") && num(o_, "seq_len") == 48, "validation on %s at %g",
                  str(o_, "data"), num(o_, "seq_len"));
        } else if (!strcmp(type, "passkey")) {
            CHECK(lm_json_get(o_, "lengths")->count == 2 && lm_json_get(o_, "depths")->count == 3, "passkey axes");
            CHECK(check_grid(lm_json_get(o_, "accuracy"), 2, 3, "passkey accuracy") == 6, "passkey cells missing");
            CHECK(check_grid(lm_json_get(o_, "digit_accuracy"), 2, 3, "passkey digits") == 6, "digit cells missing");
        } else if (!strcmp(type, "mqar")) {
            CHECK(lm_json_get(o_, "queries")->count == 3, "mqar axes");
            /* 6 queries with 6 pairs take 84 bytes: null at 64, a number at 96 */
            CHECK(check_grid(lm_json_get(o_, "accuracy"), 2, 3, "mqar accuracy") == 5, "mqar: want exactly 1 null");
            const lm_json *row0 = lm_json_get(o_, "accuracy")->child;
            CHECK(row0->child->next->next->kind == LM_JSON_NULL, "the cell that does not fit must be null");
        } else {
            CHECK(0, "unexpected line type '%s'", type);
        }
    }
    for (int i = 0; i < n; i++) lm_json_free(docs[i]);
    /* the same checkpoint evaluates to the same numbers */
    lm_eval_result *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    CHECK(!lm_eval_run(dir("run"), &o, a) && !lm_eval_run(dir("run"), &o, b), "%s", lm_last_error());
    CHECK(a->val_loss == b->val_loss && !memcmp(a->passkey_digit_accuracy, b->passkey_digit_accuracy,
                                                 sizeof a->passkey_digit_accuracy),
          "two evaluations differ");
    free(a);
    free(b);
}

static void test_validation_follows_the_data_and_length_of_the_checkpoints_stage(void) {
    lm_config c = micro();
    c.n_stages = 2;
    memset(c.stages, 0, sizeof c.stages);
    const char *data[2] = {"copy", "vcopy"};
    for (int i = 0; i < 2; i++) {
        lm_stage *s = &c.stages[i];
        snprintf(s->name, sizeof s->name, "s%d", i);
        s->seq_len = 32 + 16 * i;
        s->steps = 2;
        s->batch_tokens = 2 * s->seq_len;
        s->lr_scale = 1;
        s->n_data = 1;
        snprintf(s->data[0], sizeof s->data[0], "%s", data[i]);
        s->weights[0] = 1;
    }
    lm_train_options to = lm_train_options_default(dir("staged"));
    to.progress = NULL;
    lm_train_result tr;
    CHECK(!lm_train(&c, &to, &tr), "%s", lm_last_error());
    lm_eval_options o = small_options();
    o.tasks = LM_EVAL_VAL;
    lm_eval_result *r = malloc(sizeof *r);
    char ckpt[600];
    snprintf(ckpt, sizeof ckpt, "%s/checkpoint-%08d", dir("staged"), 2);
    CHECK(!lm_eval_run(ckpt, &o, r), "%s", lm_last_error());
    CHECK(r->step == 2 && !strcmp(r->val_data, "copy") && r->val_length == 32,
          "end of stage 1: step %lld, %s at %d; want copy at 32", (long long)r->step, r->val_data, r->val_length);
    CHECK(!lm_eval_run(dir("staged"), &o, r), "%s", lm_last_error());
    CHECK(r->step == 4 && !strcmp(r->val_data, "vcopy") && r->val_length == 48,
          "latest: step %lld, %s at %d; want vcopy at 48", (long long)r->step, r->val_data, r->val_length);
    CHECK(isfinite(r->val_loss) && r->answer_accuracy >= 0 && r->answer_accuracy <= 1, "vcopy validation numbers");
    free(r);
}

static int run_cli(const char *args) { return test_run_cli(args, dir("out.txt"), dir("err.txt")); }

/* val_loss of the last {"type": "eval"} line of a JSON-lines file (NaN if none). */
static double last_val_loss(const char *path) {
    lm_json_doc *docs[64];
    int n = read_lines(path, 0, docs, 64);
    double v = NAN;
    for (int i = 0; i < n; i++) {
        const lm_json *o = lm_json_root(docs[i]);
        if (!strcmp(str(o, "type"), "eval")) v = num(o, "val_loss");
        lm_json_free(docs[i]);
    }
    return v;
}

static void test_eval_of_a_shards_run_scores_the_split_the_trainer_validated_on(void) {
    /* train and val shards of different byte statistics: scoring the wrong
     * split gives a visibly different loss */
    char shards[600], args[1600];
    snprintf(shards, sizeof shards, "%s", dir("shards"));
    snprintf(args, sizeof args, "mkdir -p %s", shards);
    CHECK(system(args) == 0, "mkdir %s", shards);
    lm_rng r;
    lm_rng_seed(&r, 0x5a4d);
    enum { N = 6000 };
    int32_t *tok = malloc(N * sizeof *tok);
    for (int split = 0; split < 2; split++) {
        /* train: 8 byte values; val: any byte of the high half */
        for (int i = 0; i < N; i++) tok[i] = split ? (int32_t)(128 + lm_rng_u64(&r) % 128) : (int32_t)(lm_rng_u64(&r) % 8);
        char p[700];
        snprintf(p, sizeof p, "%s/%s_000000.bin", shards, split ? "val" : "train");
        CHECK(lm_shard_write(p, tok, N, 256) == LM_OK, "%s", lm_last_error());
    }
    free(tok);
    lm_config c = micro();
    snprintf(c.data, sizeof c.data, "shards:%s", shards);
    CHECK(strlen(shards) + 7 < sizeof c.data, "the shard path does not fit train.data");
    c.steps = 6;
    lm_train_options to = lm_train_options_default(dir("shards-run"));
    to.progress = NULL;
    to.val_batches = 3;
    lm_train_result tr;
    CHECK(!lm_train(&c, &to, &tr), "%s", lm_last_error());
    char metrics[700];
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", dir("shards-run"));
    double trainer_loss = last_val_loss(metrics);
    CHECK(isfinite(trainer_loss) && fabs(trainer_loss - tr.val_loss) <= 1e-6 * tr.val_loss,
          "the trainer's log says %.9g, its result %.9g", trainer_loss, tr.val_loss);
    /* the CLI on the run directory, with the trainer's batches x rows */
    snprintf(args, sizeof args, "eval --checkpoint %s --tasks val --batches %d --batch-size %d --out %s --quiet",
             dir("shards-run"), to.val_batches, c.batch_size, dir("shards-eval.jsonl"));
    CHECK(run_cli(args) == 0, "eval of the shards run failed");
    double eval_loss = last_val_loss(dir("shards-eval.jsonl"));
    CHECK_CLOSE(eval_loss, trainer_loss, 0, 1e-6, "longmoe eval's val_loss against the trainer's");
    /* and it is the val split's loss: the train split scores differently */
    lm_eval_options o = small_options();
    o.tasks = LM_EVAL_VAL;
    o.batches = to.val_batches;
    o.batch_size = c.batch_size;
    lm_eval_result *res = malloc(sizeof *res);
    char spec[700];
    snprintf(spec, sizeof spec, "shards-val:%s", shards);
    o.val_data = spec;
    CHECK(!lm_eval_run(dir("shards-run"), &o, res), "%s", lm_last_error());
    CHECK_CLOSE(res->val_loss, trainer_loss, 0, 1e-6, "val split given explicitly");
    lm_data_source *train_split = NULL;
    snprintf(spec, sizeof spec, "shards:%s", shards);
    CHECK(lm_data_open(spec, c.seed, &train_split) == LM_OK, "%s", lm_last_error());
    lm_model *m = NULL;
    lm_config lc;
    CHECK(lm_checkpoint_load_model(dir("shards-run/checkpoint-00000006"), c.batch_size, c.seq_len, &lc, &m) == LM_OK,
          "%s", lm_last_error());
    lm_eval_tally t;
    if (m && train_split) {
        CHECK(lm_eval_loss(m, train_split, to.val_batches, 4, &t) == LM_OK, "%s", lm_last_error());
        CHECK(fabs(lm_eval_tally_loss(&t) - trainer_loss) > 1e-2, "the train split scores %.9g, the same as val",
              lm_eval_tally_loss(&t));
    }
    lm_model_free(m);
    lm_data_close(train_split);
    free(res);
}

static int file_has(const char *path, const char *phrase) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    if (!strstr(buf, phrase)) fprintf(stderr, "  %s was: %s\n", path, buf);
    return strstr(buf, phrase) != NULL;
}

static void test_cli_appends_to_the_run_log_and_prints_a_table(void) {
    if (trained_run()) return;
    char metrics[600], args[1400];
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", dir("run"));
    int before = count_lines(metrics);
    snprintf(args, sizeof args, "eval --checkpoint %s --lengths 64 --depths 0,1 --queries 2 --batches 1 --batch-size 2",
             dir("run"));
    CHECK(run_cli(args) == 0, "eval failed");
    CHECK(count_lines(metrics) == before + 3, "metrics.jsonl grew by %d lines, want 3", count_lines(metrics) - before);
    lm_json_doc *docs[4];
    int n = read_lines(metrics, before, docs, 4);
    CHECK(n == 3, "the appended lines are not JSON");
    for (int i = 0; i < n; i++) lm_json_free(docs[i]);
    CHECK(file_has(dir("out.txt"), "passkey accuracy") && file_has(dir("out.txt"), "mqar accuracy") &&
              file_has(dir("out.txt"), "loss by position"),
          "the table is incomplete");
    /* --out and --tasks */
    snprintf(args, sizeof args, "eval --checkpoint %s --tasks mqar --lengths 64 --queries 1,2 --batches 1 "
             "--batch-size 2 --out %s --quiet", dir("run"), dir("mqar.jsonl"));
    CHECK(run_cli(args) == 0, "eval --tasks mqar failed");
    CHECK(count_lines(dir("mqar.jsonl")) == 1 && file_has(dir("mqar.jsonl"), "\"type\": \"mqar\""),
          "--tasks mqar must write one mqar line");
}

static void test_bad_options_and_paths_fail_clearly(void) {
    if (trained_run()) return;
    lm_eval_options o = small_options();
    o.depths[1] = 1.5;
    CHECK(lm_eval_options_check(&o) == LM_ERR_ARG && strstr(lm_last_error(), "1.5"), "depth 1.5: %s",
          lm_last_error());
    o = small_options();
    o.n_buckets = 0;
    CHECK(lm_eval_options_check(&o) == LM_ERR_ARG && strstr(lm_last_error(), "buckets"), "0 buckets accepted");
    o = small_options();
    o.n_lengths = 0;
    CHECK(lm_eval_options_check(&o) == LM_ERR_ARG, "no lengths accepted");
    o = small_options();
    lm_eval_result *r = malloc(sizeof *r);
    CHECK(lm_eval_run(dir("no-such-run"), &o, r) == LM_ERR_IO && strstr(lm_last_error(), "no-such-run"),
          "missing checkpoint: %s", lm_last_error());
    o.val_data = "nonsense";
    CHECK(lm_eval_run(dir("run"), &o, r) == LM_ERR_ARG && strstr(lm_last_error(), "nonsense"),
          "unknown validation data: %s", lm_last_error());
    free(r);
    char args[1400];
    int before = count_lines(dir("mqar.jsonl"));
    snprintf(args, sizeof args, "eval --checkpoint %s --out %s", dir("no-such-run"), dir("mqar.jsonl"));
    CHECK(run_cli(args) == 1 && file_has(dir("err.txt"), "no-such-run"), "missing checkpoint must exit 1");
    CHECK(count_lines(dir("mqar.jsonl")) == before, "a failed evaluation wrote to the log");
    snprintf(args, sizeof args, "eval --checkpoint %s --depths 0,2", dir("run"));
    CHECK(run_cli(args) == 2 && file_has(dir("err.txt"), "--depths"), "depth 2 must exit 2");
    snprintf(args, sizeof args, "eval --checkpoint %s --tasks val,needle", dir("run"));
    CHECK(run_cli(args) == 2 && file_has(dir("err.txt"), "needle"), "unknown task must exit 2");
    snprintf(args, sizeof args, "eval --checkpoint %s --lengths 64,,96", dir("run"));
    CHECK(run_cli(args) == 2 && file_has(dir("err.txt"), "--lengths"), "empty list item must exit 2");
    CHECK(run_cli("eval --lengths 64") == 2 && file_has(dir("err.txt"), "--checkpoint"), "no --checkpoint: exit 2");
    CHECK(run_cli("eval --checkpoint x --bogus") == 2 && file_has(dir("err.txt"), "--bogus"), "unknown flag: exit 2");
}

int main(void) {
    snprintf(root, sizeof root, "/tmp/longmoe-test-eval-%ld", (long)getpid());
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", root, root);
    if (system(cmd) != 0) return 1;
    RUN(test_scoring_counts_greedy_hits_at_answer_positions_and_whole_rows);
    RUN(test_loss_by_position_bucket_equals_a_float64_reference);
    RUN(test_model_scores_equal_the_logits_path_bit_for_bit);
    RUN(test_eval_of_a_trained_checkpoint_writes_the_documented_lines);
    RUN(test_validation_follows_the_data_and_length_of_the_checkpoints_stage);
    RUN(test_cli_appends_to_the_run_log_and_prints_a_table);
    RUN(test_eval_of_a_shards_run_scores_the_split_the_trainer_validated_on);
    RUN(test_bad_options_and_paths_fail_clearly);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0) return 1;
    return test_summary();
}
