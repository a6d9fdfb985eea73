/* Long-context evaluation (include/longmoe/eval.h, docs/eval.md). */
#include "longmoe/eval.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "files.h"
#include "json.h"
#include "longmoe/comm.h"
#include "longmoe/config.h"
#include "longmoe/linear.h"
#include "longmoe/tasks.h"
#include "longmoe/train.h"
#include "train/checkpoint.h"

/* The held-out stream's seed is the run's seed xor this constant. */
#define VAL_SEED_SALT 0x7e57da7a5eedull

lm_status lm_eval_open_validation(const char *spec, uint64_t run_seed, lm_data_source **out) {
    *out = NULL;
    if (strncmp(spec, "shards:", 7)) return lm_data_open(spec, run_seed ^ VAL_SEED_SALT, out);
    /* a token corpus: its val split, never the training split */
    size_t n = strlen(spec) + 8;
    char *val = malloc(n);
    if (!val) return lm_error(LM_ERR_MEMORY, "out of memory opening the validation split of '%s'", spec);
    snprintf(val, n, "shards-val:%s", spec + 7);
    lm_status s = lm_data_open(val, run_seed ^ VAL_SEED_SALT, out);
    free(val);
    return s;
}

lm_eval_options lm_eval_options_default(void) {
    lm_eval_options o;
    memset(&o, 0, sizeof o);
    o.tasks = LM_EVAL_VAL | LM_EVAL_PASSKEY | LM_EVAL_MQAR;
    o.n_lengths = 3;
    o.lengths[0] = 256, o.lengths[1] = 1024, o.lengths[2] = 4096;
    o.n_depths = 5;
    for (int i = 0; i < 5; i++) o.depths[i] = 0.25 * i;
    o.n_queries = 3;
    o.queries[0] = 2, o.queries[1] = 8, o.queries[2] = 16; /* 16 + 16 items fit 256 */
    o.mqar_pairs = 0;
    o.batches = 2;
    o.batch_size = 4;
    o.n_buckets = 8;
    o.val_length = 0;
    o.val_data = NULL;
    o.seed = 0x5eed; /* one fixed evaluation set for every checkpoint */
    return o;
}

lm_status lm_eval_options_check(const lm_eval_options *o) {
    if (!o->tasks || (o->tasks & ~(LM_EVAL_VAL | LM_EVAL_PASSKEY | LM_EVAL_MQAR)))
        return lm_error(LM_ERR_ARG, "eval: tasks must be a non-empty set of val, passkey, mqar (bits %d)", o->tasks);
    if (o->tasks & (LM_EVAL_PASSKEY | LM_EVAL_MQAR)) {
        if (o->n_lengths < 1 || o->n_lengths > LM_EVAL_MAX_GRID)
            return lm_error(LM_ERR_ARG, "eval: between 1 and %d lengths, got %d", LM_EVAL_MAX_GRID, o->n_lengths);
        for (int i = 0; i < o->n_lengths; i++)
            if (o->lengths[i] < 1 || o->lengths[i] > (1 << 24))
                return lm_error(LM_ERR_ARG, "eval: length %d is outside [1, 16777216]", o->lengths[i]);
    }
    if (o->tasks & LM_EVAL_PASSKEY) {
        if (o->n_depths < 1 || o->n_depths > LM_EVAL_MAX_GRID)
            return lm_error(LM_ERR_ARG, "eval: between 1 and %d depths, got %d", LM_EVAL_MAX_GRID, o->n_depths);
        for (int i = 0; i < o->n_depths; i++)
            if (!(o->depths[i] >= 0 && o->depths[i] <= 1))
                return lm_error(LM_ERR_ARG, "eval: depth %g is outside [0, 1]", o->depths[i]);
    }
    if (o->tasks & LM_EVAL_MQAR) {
        if (o->n_queries < 1 || o->n_queries > LM_EVAL_MAX_GRID)
            return lm_error(LM_ERR_ARG, "eval: between 1 and %d query counts, got %d", LM_EVAL_MAX_GRID, o->n_queries);
        for (int i = 0; i < o->n_queries; i++)
            if (o->queries[i] < 1 || o->queries[i] > LM_MQAR_MAX_PAIRS)
                return lm_error(LM_ERR_ARG, "eval: mqar queries %d is outside [1, %d]", o->queries[i], LM_MQAR_MAX_PAIRS);
        if (o->mqar_pairs < -1 || o->mqar_pairs > LM_MQAR_MAX_PAIRS)
            return lm_error(LM_ERR_ARG, "eval: mqar pairs %d is outside [-1, %d] (0: as many as the queries, -1: as "
                            "many as fit)", o->mqar_pairs, LM_MQAR_MAX_PAIRS);
    }
    if (o->batches < 1 || o->batches > 100000)
        return lm_error(LM_ERR_ARG, "eval: batches %d is outside [1, 100000]", o->batches);
    if (o->batch_size < 1 || o->batch_size > 4096)
        return lm_error(LM_ERR_ARG, "eval: batch size %d is outside [1, 4096]", o->batch_size);
    if (o->n_buckets < 1 || o->n_buckets > LM_EVAL_MAX_BUCKETS)
        return lm_error(LM_ERR_ARG, "eval: buckets %d is outside [1, %d]", o->n_buckets, LM_EVAL_MAX_BUCKETS);
    if (o->val_length < 0 || o->val_length > (1 << 24))
        return lm_error(LM_ERR_ARG, "eval: validation length %d is outside [0, 16777216] (0: the checkpoint's)",
                        o->val_length);
    return LM_OK;
}

/* ---- scoring ---- */

lm_status lm_eval_tally_init(lm_eval_tally *t, int T, int n_buckets) {
    memset(t, 0, sizeof *t);
    if (T < 1) return lm_error(LM_ERR_ARG, "eval: length %d must be positive", T);
    if (n_buckets < 1 || n_buckets > LM_EVAL_MAX_BUCKETS)
        return lm_error(LM_ERR_ARG, "eval: buckets %d is outside [1, %d]", n_buckets, LM_EVAL_MAX_BUCKETS);
    t->T = T;
    t->n_buckets = n_buckets;
    return LM_OK;
}

int lm_eval_bucket_edge(const lm_eval_tally *t, int i) { return (int)((int64_t)i * t->T / t->n_buckets); }

/* One position's loss and argmax against its target into the tally. */
static lm_status tally_position(lm_eval_tally *t, int b, int pos, double loss, int right, int is_answer, int *bucket,
                                int *has_answer, int *all_right) {
    if (!isfinite(loss)) return lm_error(LM_ERR_NUMERIC, "eval: non-finite logits at row %d position %d", b, pos);
    while (*bucket + 1 < t->n_buckets && pos >= lm_eval_bucket_edge(t, *bucket + 1)) (*bucket)++;
    t->loss_sum[*bucket] += loss;
    t->loss_count[*bucket]++;
    if (is_answer) {
        *has_answer = 1;
        t->answers++;
        t->answers_right += right;
        *all_right &= right;
    }
    return LM_OK;
}

static void tally_row_end(lm_eval_tally *t, int has_answer, int all_right) {
    if (has_answer) {
        t->rows++;
        t->rows_right += all_right;
    }
}

lm_status lm_eval_score(lm_eval_tally *t, const float *logits, const int32_t *targets, const uint8_t *answer, int B,
                        int V) {
    // logits is (B,T,V), targets and answer are (B,T)
    const int T = t->T;
    if (B < 1 || V < 1) return lm_error(LM_ERR_ARG, "eval: batch %d and vocabulary %d must be positive", B, V);
    for (int b = 0; b < B; b++) {
        int bucket = 0, has_answer = 0, all_right = 1;
        for (int pos = 0; pos < T; pos++) {
            size_t i = (size_t)b * T + pos;
            int y = targets[i];
            if (y < 0 || y >= V)
                return lm_error(LM_ERR_ARG, "eval: target %d at row %d position %d is outside [0, %d)", y, b, pos, V);
            double loss;
            int32_t arg;
            lm_score_row(logits + i * (size_t)V, V, y, &loss, &arg);
            TRY(tally_position(t, b, pos, loss, arg == y, answer && answer[i], &bucket, &has_answer, &all_right));
        }
        tally_row_end(t, has_answer, all_right);
    }
    return LM_OK;
}

lm_status lm_eval_score_tokens(lm_eval_tally *t, const double *nll, const int32_t *argmax, const int32_t *targets,
                               const uint8_t *answer, int B) {
    const int T = t->T;
    if (B < 1) return lm_error(LM_ERR_ARG, "eval: batch %d must be positive", B);
    for (int b = 0; b < B; b++) {
        int bucket = 0, has_answer = 0, all_right = 1;
        for (int pos = 0; pos < T; pos++) {
            size_t i = (size_t)b * T + pos;
            TRY(tally_position(t, b, pos, nll[i], argmax[i] == targets[i], answer && answer[i], &bucket, &has_answer,
                               &all_right));
        }
        tally_row_end(t, has_answer, all_right);
    }
    return LM_OK;
}

double lm_eval_tally_loss(const lm_eval_tally *t) {
    double s = 0;
    int64_t n = 0;
    for (int i = 0; i < t->n_buckets; i++) s += t->loss_sum[i], n += t->loss_count[i];
    return n ? s / (double)n : NAN;
}

double lm_eval_tally_answer_accuracy(const lm_eval_tally *t) {
    return t->answers ? (double)t->answers_right / (double)t->answers : NAN;
}

double lm_eval_tally_row_accuracy(const lm_eval_tally *t) {
    return t->rows ? (double)t->rows_right / (double)t->rows : NAN;
}

double lm_eval_tally_bucket_loss(const lm_eval_tally *t, int i) {
    return i >= 0 && i < t->n_buckets && t->loss_count[i] ? t->loss_sum[i] / (double)t->loss_count[i] : NAN;
}

/* ---- one model ---- */

/* Batch buffers for the model's shape: tokens and each position's scores,
 * never logits (lm_model_score runs the LM head chunk by chunk where the
 * model lives). */
typedef struct {
    int B, T, V;
    int32_t *seq, *inp, *tgt, *argmax;
    uint8_t *answer;
    double *nll;
} eval_buffers;

static void buffers_free(eval_buffers *e) {
    free(e->seq);
    free(e->inp);
    free(e->tgt);
    free(e->argmax);
    free(e->answer);
    free(e->nll);
}

static lm_status buffers_alloc(eval_buffers *e, lm_model *m) {
    memset(e, 0, sizeof *e);
    lm_model_shape(m, &e->B, &e->T);
    e->V = lm_model_config(m)->vocab_size;
    size_t N = (size_t)e->B * e->T;
    e->seq = malloc((size_t)e->B * (e->T + 1) * sizeof(int32_t));
    e->inp = malloc(N * sizeof(int32_t));
    e->tgt = malloc(N * sizeof(int32_t));
    e->argmax = malloc(N * sizeof(int32_t));
    e->answer = malloc(N);
    e->nll = malloc(N * sizeof(double));
    if (!e->seq || !e->inp || !e->tgt || !e->argmax || !e->answer || !e->nll) {
        buffers_free(e);
        return lm_error(LM_ERR_MEMORY, "out of memory (evaluation buffers for %d x %d tokens)", e->B, e->T);
    }
    return LM_OK;
}

/* Inputs seq[:, :T], targets seq[:, 1:], one forward, score into t. */
static lm_status forward_and_score(lm_model *m, eval_buffers *e, lm_eval_tally *t) {
    for (int b = 0; b < e->B; b++) {
        memcpy(e->inp + (size_t)b * e->T, e->seq + (size_t)b * (e->T + 1), (size_t)e->T * sizeof(int32_t));
        memcpy(e->tgt + (size_t)b * e->T, e->seq + (size_t)b * (e->T + 1) + 1, (size_t)e->T * sizeof(int32_t));
    }
    TRY(lm_model_score(m, e->inp, e->tgt, e->nll, e->argmax));
    return lm_eval_score_tokens(t, e->nll, e->argmax, e->tgt, e->answer, e->B);
}

lm_status lm_eval_loss(lm_model *m, lm_data_source *src, int n_batches, int n_buckets, lm_eval_tally *tally) {
    int B, T;
    lm_model_shape(m, &B, &T);
    return lm_eval_loss_rows(m, src, n_batches, n_buckets, B, 0, tally);
}

lm_status lm_eval_loss_rows(lm_model *m, lm_data_source *src, int n_batches, int n_buckets, int batch_rows,
                            int first_row, lm_eval_tally *tally) {
    eval_buffers e;
    TRY(buffers_alloc(&e, m));
    lm_status s = lm_eval_tally_init(tally, e.T, n_buckets);
    if (!s && src->vocab_size > e.V)
        s = lm_error(LM_ERR_ARG, "eval: data '%s' has tokens up to %d but the model's vocabulary is %d", src->name,
                     src->vocab_size, e.V);
    if (!s && (batch_rows < e.B || first_row < 0 || first_row > batch_rows - e.B))
        s = lm_error(LM_ERR_ARG, "eval: rows [%d, %d) of batches of %d do not fit (the model takes %d rows)",
                     first_row, first_row + e.B, batch_rows, e.B);
    /* the model's rows of each batch alone */
    for (int bi = 0; bi < n_batches && !s; bi++) {
        s = lm_data_rows(src, bi, batch_rows, e.T, first_row, e.B, e.seq, e.answer);
        if (!s) s = forward_and_score(m, &e, tally);
    }
    buffers_free(&e);
    return s;
}

lm_status lm_eval_loss_segment(lm_model *m, lm_data_source *src, int n_batches, int n_buckets, int batch_rows,
                               int first_row, int T, int t0, lm_comm *group, lm_eval_tally *tally) {
    eval_buffers e;
    TRY(buffers_alloc(&e, m));
    const int B = e.B, len = e.T; /* the model's rows and segment */
    lm_status s = lm_eval_tally_init(tally, T, n_buckets);
    if (!s && src->vocab_size > e.V)
        s = lm_error(LM_ERR_ARG, "eval: data '%s' has tokens up to %d but the model's vocabulary is %d", src->name,
                     src->vocab_size, e.V);
    if (!s && (batch_rows < B || first_row < 0 || first_row > batch_rows - B))
        s = lm_error(LM_ERR_ARG, "eval: rows [%d, %d) of batches of %d do not fit (the model takes %d rows)",
                     first_row, first_row + B, batch_rows, B);
    if (!s && (t0 < 0 || t0 > T - len))
        s = lm_error(LM_ERR_ARG, "eval: the segment [%d, %d) does not lie in sequences of %d tokens", t0, t0 + len, T);
    int32_t *seq = NULL, *count = NULL;
    uint8_t *answer = NULL;
    if (!s) {
        /* the model's rows of each batch alone, whole */
        seq = malloc((size_t)B * ((size_t)T + 1) * sizeof(int32_t));
        answer = malloc((size_t)B * (size_t)T);
        count = malloc((2 * (size_t)B + 1) * sizeof(int32_t));
        if (!seq || !answer || !count)
            s = lm_error(LM_ERR_MEMORY, "out of memory (evaluation batch of %d x %d tokens)", batch_rows, T);
    }
    /* the group's ranks agree before their first collective forward */
    int32_t any = s != LM_OK;
    if (group && !lm_comm_all_reduce_sum(group, &any, &any, 1, LM_DTYPE_I32) && any && !s)
        s = lm_error(LM_ERR_ARG, "eval: another rank of the context-parallel group could not start");
    for (int bi = 0; bi < n_batches && !s; bi++) {
        s = lm_data_rows(src, bi, batch_rows, T, first_row, B, seq, answer);
        for (int b = 0; b < B && !s; b++) {
            const int32_t *row = seq + (size_t)b * ((size_t)T + 1) + t0;
            memcpy(e.inp + (size_t)b * len, row, (size_t)len * sizeof(int32_t));
            memcpy(e.tgt + (size_t)b * len, row + 1, (size_t)len * sizeof(int32_t));
            memcpy(e.answer + (size_t)b * len, answer + (size_t)b * T + t0, (size_t)len);
        }
        if (!s) s = lm_model_score(m, e.inp, e.tgt, e.nll, e.argmax);
        memset(count, 0, (2 * (size_t)B + 1) * sizeof(int32_t));
        for (int b = 0; b < B && !s; b++) {
            int bucket = 0, has_answer = 0, all_right = 1;
            for (int j = 0; j < len && !s; j++) {
                size_t i = (size_t)b * len + j;
                int right = e.argmax[i] == e.tgt[i];
                s = tally_position(tally, b, t0 + j, e.nll[i], right, e.answer[i], &bucket, &has_answer, &all_right);
                count[2 * b] += e.answer[i] != 0;
                count[2 * b + 1] += e.answer[i] && right;
            }
        }
        /* the rows' answers over the group's segments; a failure on any rank stops every rank */
        count[2 * B] = s != LM_OK;
        lm_status cs = group ? lm_comm_all_reduce_sum(group, count, count, 2 * (size_t)B + 1, LM_DTYPE_I32) : LM_OK;
        if (!s && cs) s = cs;
        if (!s && count[2 * B])
            s = lm_error(LM_ERR_NUMERIC, "eval: scoring failed on another rank of the context-parallel group");
        for (int b = 0; b < B && !s && t0 == 0; b++)
            tally_row_end(tally, count[2 * b] > 0, count[2 * b + 1] == count[2 * b]);
    }
    free(seq);
    free(answer);
    free(count);
    buffers_free(&e);
    return s;
}

lm_status lm_eval_passkey(lm_model *m, const double *depths, int n_depths, int n_batches, uint64_t seed,
                          double *accuracy, double *digit_accuracy) {
    eval_buffers e;
    TRY(buffers_alloc(&e, m));
    lm_status s = e.V < 256 ? lm_error(LM_ERR_ARG, "eval: passkey needs byte tokens (vocabulary >= 256), the model "
                                       "has %d", e.V) : LM_OK;
    for (int d = 0; d < n_depths && !s; d++) {
        lm_eval_tally t;
        s = lm_eval_tally_init(&t, e.T, 1);
        /* the same keys at every depth: batch bi's digits do not depend on the depth */
        for (int bi = 0; bi < n_batches && !s; bi++) {
            s = lm_task_passkey_batch(seed, bi, e.B, e.T, depths[d], e.seq, e.answer);
            if (!s) s = forward_and_score(m, &e, &t);
        }
        accuracy[d] = lm_eval_tally_row_accuracy(&t);
        if (digit_accuracy) digit_accuracy[d] = lm_eval_tally_answer_accuracy(&t);
    }
    buffers_free(&e);
    return s;
}

/* Pairs of an MQAR row with q queries at length T, or 0 when it does not fit. */
static int mqar_fit(int T, int q, int pairs) {
    int64_t p = pairs == 0 ? q : pairs > 0 ? pairs : (int64_t)(T + 1) / 7 - q;
    if (p > LM_MQAR_MAX_PAIRS) p = LM_MQAR_MAX_PAIRS;
    if (p < q || 7 * (p + q) > (int64_t)T + 1) return 0;
    return (int)p;
}

lm_status lm_eval_mqar(lm_model *m, const int *queries, int n_queries, int pairs, int n_batches, uint64_t seed,
                       double *accuracy) {
    eval_buffers e;
    TRY(buffers_alloc(&e, m));
    lm_status s = e.V < 256 ? lm_error(LM_ERR_ARG, "eval: mqar needs byte tokens (vocabulary >= 256), the model "
                                       "has %d", e.V) : LM_OK;
    for (int qi = 0; qi < n_queries && !s; qi++) {
        int p = mqar_fit(e.T, queries[qi], pairs);
        accuracy[qi] = NAN;
        if (!p) continue;
        lm_eval_tally t;
        s = lm_eval_tally_init(&t, e.T, 1);
        for (int bi = 0; bi < n_batches && !s; bi++) {
            s = lm_task_mqar_batch(seed, bi, e.B, e.T, p, queries[qi], e.seq, e.answer);
            if (!s) s = forward_and_score(m, &e, &t);
        }
        accuracy[qi] = lm_eval_tally_answer_accuracy(&t);
    }
    buffers_free(&e);
    return s;
}

/* ---- a checkpoint ---- */

static int is_file(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

lm_status lm_eval_resolve_checkpoint(const char *dir, char *out, size_t n) {
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (is_file(path)) {
        if ((size_t)snprintf(out, n, "%s", dir) >= n) return lm_error(LM_ERR_ARG, "eval: path '%s' is too long", dir);
        return LM_OK;
    }
    snprintf(path, sizeof path, "%s/latest", dir);
    if (is_file(path)) return lm_checkpoint_latest(dir, out, n);
    return lm_error(LM_ERR_IO, "'%s' is neither a checkpoint directory (no model.safetensors) nor a run directory "
                    "(no latest)", dir);
}

/* The step of trainer.json (0 when the checkpoint has none). */
static lm_status checkpoint_step(const char *dir, int64_t *step) {
    char path[4200], *text;
    size_t len;
    *step = 0;
    snprintf(path, sizeof path, "%s/trainer.json", dir);
    if (!is_file(path)) return LM_OK;
    TRY(lm_read_file(path, LM_TEXT_FILE_MAX, &text, &len));
    lm_json_doc *doc;
    lm_status s = lm_json_parse(text, len, path, &doc);
    free(text);
    if (s) return s;
    const lm_json *v = lm_json_get(lm_json_root(doc), "step");
    if (v && v->kind == LM_JSON_NUMBER && v->number_is_integer && v->integer >= 0) *step = v->integer;
    else s = lm_error(LM_ERR_FORMAT, "%s: 'step' is missing or not a non-negative integer", path);
    lm_json_free(doc);
    return s;
}

/* The stage that trained step `step` (its last step, step - 1). */
static const lm_stage *stage_of_step(const lm_stage *stages, int n, int64_t step) {
    int64_t end = 0;
    for (int i = 0; i < n; i++) {
        end += stages[i].steps;
        if (step <= end) return &stages[i];
    }
    return &stages[n - 1];
}

static int index_of(const int *v, int n, int x) {
    for (int i = 0; i < n; i++)
        if (v[i] == x) return i;
    return -1;
}

/* Everything measured at one length with one loaded model. */
static lm_status eval_length(const char *ckpt, const lm_eval_options *opt, int L, lm_data_source *val,
                             lm_eval_result *r) {
    lm_config cfg;
    lm_model *m;
    TRY(lm_checkpoint_load_model_on(ckpt, opt->batch_size, L, opt->backend, &cfg, &m));
    lm_status s = LM_OK;
    int li = index_of(opt->lengths, opt->n_lengths, L);
    if (val && L == r->val_length) {
        lm_eval_tally t;
        s = lm_eval_loss(m, val, opt->batches, opt->n_buckets, &t);
        if (!s) lm_eval_result_set_validation(r, &t);
    }
    if (!s && li >= 0 && (opt->tasks & LM_EVAL_PASSKEY))
        s = lm_eval_passkey(m, opt->depths, opt->n_depths, opt->batches, opt->seed, r->passkey_accuracy[li],
                            r->passkey_digit_accuracy[li]);
    if (!s && li >= 0 && (opt->tasks & LM_EVAL_MQAR))
        s = lm_eval_mqar(m, opt->queries, opt->n_queries, opt->mqar_pairs, opt->batches, opt->seed,
                         r->mqar_accuracy[li]);
    lm_model_free(m);
    return s;
}

lm_status lm_eval_run(const char *checkpoint_dir, const lm_eval_options *opt, lm_eval_result *r) {
    double t0 = lm_time_seconds();
    memset(r, 0, sizeof *r);
    r->val_loss = r->answer_accuracy = NAN;
    for (int i = 0; i < LM_EVAL_MAX_GRID; i++)
        for (int j = 0; j < LM_EVAL_MAX_GRID; j++)
            r->passkey_accuracy[i][j] = r->passkey_digit_accuracy[i][j] = r->mqar_accuracy[i][j] = NAN;
    TRY(lm_eval_options_check(opt));
    char ckpt[4096], path[4200];
    TRY(lm_eval_resolve_checkpoint(checkpoint_dir, ckpt, sizeof ckpt));
    TRY(checkpoint_step(ckpt, &r->step));
    lm_config cfg;
    snprintf(path, sizeof path, "%s/config.json", ckpt);
    TRY(lm_config_load(path, &cfg));
    /* validation data and length: those of the stage the checkpoint ends */
    lm_stage stages[LM_MAX_STAGES];
    int n_stages = lm_config_stages(&cfg, stages);
    const lm_stage *st = stage_of_step(stages, n_stages, r->step);
    const char *val_spec = opt->val_data ? opt->val_data : st->n_data ? st->data[0] : cfg.data;
    snprintf(r->val_data, sizeof r->val_data, "%s", val_spec);
    r->val_length = opt->val_length ? opt->val_length : st->seq_len;
    lm_data_source *val = NULL;
    if (opt->tasks & LM_EVAL_VAL) TRY(lm_eval_open_validation(val_spec, cfg.seed, &val));
    /* one model per distinct length */
    int todo[LM_EVAL_MAX_GRID + 1], n_todo = 0;
    if (val) todo[n_todo++] = r->val_length;
    if (opt->tasks & (LM_EVAL_PASSKEY | LM_EVAL_MQAR))
        for (int i = 0; i < opt->n_lengths; i++)
            if (index_of(todo, n_todo, opt->lengths[i]) < 0) todo[n_todo++] = opt->lengths[i];
    lm_status s = LM_OK;
    for (int i = 0; i < n_todo && !s; i++) s = eval_length(ckpt, opt, todo[i], val, r);
    lm_data_close(val);
    r->seconds = lm_time_seconds() - t0;
    return s;
}

/* ---- output ---- */

static void put_number(FILE *f, double x) {
    if (isfinite(x)) fprintf(f, "%.6g", x);
    else fputs("null", f);
}

static void put_grid(FILE *f, const double (*g)[LM_EVAL_MAX_GRID], int rows, int cols) {
    fputc('[', f);
    for (int i = 0; i < rows; i++) {
        fputs(i ? ", [" : "[", f);
        for (int j = 0; j < cols; j++) {
            if (j) fputs(", ", f);
            put_number(f, g[i][j]);
        }
        fputc(']', f);
    }
    fputc(']', f);
}

static void put_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

void lm_eval_result_set_validation(lm_eval_result *r, const lm_eval_tally *t) {
    r->val_loss = lm_eval_tally_loss(t);
    r->answer_accuracy = lm_eval_tally_answer_accuracy(t);
    r->n_buckets = t->n_buckets;
    for (int i = 0; i <= t->n_buckets; i++) r->bucket_edges[i] = lm_eval_bucket_edge(t, i);
    for (int i = 0; i < t->n_buckets; i++) r->loss_by_position[i] = lm_eval_tally_bucket_loss(t, i);
}

void lm_eval_write_validation(const lm_eval_result *r, FILE *f) {
    /* val_loss with 9 digits: a float's value survives the round trip */
    fprintf(f, "{\"type\": \"eval\", \"step\": %lld, \"val_loss\": ", (long long)r->step);
    if (isfinite(r->val_loss)) fprintf(f, "%.9g", r->val_loss);
    else fputs("null", f);
    fputs(", \"answer_accuracy\": ", f);
    put_number(f, r->answer_accuracy);
    fputs(", \"bucket_edges\": [", f);
    for (int i = 0; i <= r->n_buckets; i++) fprintf(f, "%s%d", i ? ", " : "", r->bucket_edges[i]);
    fputs("], \"loss_by_position\": [", f);
    for (int i = 0; i < r->n_buckets; i++) {
        if (i) fputs(", ", f);
        put_number(f, r->loss_by_position[i]);
    }
    fputs("], \"data\": ", f);
    put_json_string(f, r->val_data);
    fprintf(f, ", \"seq_len\": %d}\n", r->val_length);
}

void lm_eval_write_jsonl(const lm_eval_result *r, const lm_eval_options *opt, FILE *f) {
    if (opt->tasks & LM_EVAL_VAL) lm_eval_write_validation(r, f);
    if (opt->tasks & LM_EVAL_PASSKEY) {
        fprintf(f, "{\"type\": \"passkey\", \"step\": %lld, \"lengths\": [", (long long)r->step);
        for (int i = 0; i < opt->n_lengths; i++) fprintf(f, "%s%d", i ? ", " : "", opt->lengths[i]);
        fputs("], \"depths\": [", f);
        for (int i = 0; i < opt->n_depths; i++) fprintf(f, "%s%.6g", i ? ", " : "", opt->depths[i]);
        fputs("], \"accuracy\": ", f);
        put_grid(f, (const double(*)[LM_EVAL_MAX_GRID])r->passkey_accuracy, opt->n_lengths, opt->n_depths);
        fputs(", \"digit_accuracy\": ", f);
        put_grid(f, (const double(*)[LM_EVAL_MAX_GRID])r->passkey_digit_accuracy, opt->n_lengths, opt->n_depths);
        fprintf(f, ", \"rows\": %lld}\n", (long long)opt->batches * opt->batch_size);
    }
    if (opt->tasks & LM_EVAL_MQAR) {
        fprintf(f, "{\"type\": \"mqar\", \"step\": %lld, \"lengths\": [", (long long)r->step);
        for (int i = 0; i < opt->n_lengths; i++) fprintf(f, "%s%d", i ? ", " : "", opt->lengths[i]);
        fputs("], \"queries\": [", f);
        for (int i = 0; i < opt->n_queries; i++) fprintf(f, "%s%d", i ? ", " : "", opt->queries[i]);
        fputs("], \"accuracy\": ", f);
        put_grid(f, (const double(*)[LM_EVAL_MAX_GRID])r->mqar_accuracy, opt->n_lengths, opt->n_queries);
        fprintf(f, ", \"pairs\": %d, \"rows\": %lld}\n", opt->mqar_pairs, (long long)opt->batches * opt->batch_size);
    }
    fflush(f);
}

static void put_percent(FILE *f, double x, int width) {
    if (isfinite(x)) fprintf(f, "%*.1f", width, 100.0 * x);
    else fprintf(f, "%*s", width, "-");
}

void lm_eval_write_table(const lm_eval_result *r, const lm_eval_options *opt, FILE *f) {
    fprintf(f, "evaluation at step %lld (%.1f s)\n", (long long)r->step, r->seconds);
    if (opt->tasks & LM_EVAL_VAL) {
        fprintf(f, "validation on %s at length %d: loss %.4f, answer accuracy ", r->val_data, r->val_length,
                r->val_loss);
        put_percent(f, r->answer_accuracy, 1);
        fputs("%\n  loss by position:", f);
        for (int i = 0; i < r->n_buckets; i++) {
            fprintf(f, "%s [%d,%d) ", i % 4 ? "" : "\n   ", r->bucket_edges[i], r->bucket_edges[i + 1]);
            if (isfinite(r->loss_by_position[i])) fprintf(f, "%.3f", r->loss_by_position[i]);
            else fputs("-", f);
        }
        fputc('\n', f);
    }
    if (opt->tasks & LM_EVAL_PASSKEY) {
        fprintf(f, "passkey accuracy %%, all five digits right (digits right), by length and needle depth (%lld rows "
                "a cell)\n", (long long)opt->batches * opt->batch_size);
        fprintf(f, "  %8s", "length");
        for (int j = 0; j < opt->n_depths; j++) {
            char label[32];
            snprintf(label, sizeof label, "depth %.2f", opt->depths[j]);
            fprintf(f, "%15s", label);
        }
        fputc('\n', f);
        for (int i = 0; i < opt->n_lengths; i++) {
            fprintf(f, "  %8d", opt->lengths[i]);
            for (int j = 0; j < opt->n_depths; j++) {
                put_percent(f, r->passkey_accuracy[i][j], 7);
                fputs(" (", f);
                put_percent(f, r->passkey_digit_accuracy[i][j], 5);
                fputs(")", f);
            }
            fputc('\n', f);
        }
    }
    if (opt->tasks & LM_EVAL_MQAR) {
        fprintf(f, "mqar accuracy %% of value digits, by length and queries (pairs: %s; %lld rows a cell)\n",
                opt->mqar_pairs == 0 ? "as many as queries" : opt->mqar_pairs < 0 ? "as many as fit" : "fixed",
                (long long)opt->batches * opt->batch_size);
        fprintf(f, "  %8s", "length");
        for (int j = 0; j < opt->n_queries; j++) {
            char label[32];
            snprintf(label, sizeof label, "q=%d", opt->queries[j]);
            fprintf(f, "%9s", label);
        }
        fputc('\n', f);
        for (int i = 0; i < opt->n_lengths; i++) {
            fprintf(f, "  %8d", opt->lengths[i]);
            for (int j = 0; j < opt->n_queries; j++) put_percent(f, r->mqar_accuracy[i][j], 9);
            fputc('\n', f);
        }
    }
    fflush(f);
}

lm_status lm_eval_checkpoint(const char *checkpoint_dir, const lm_eval_options *opt, FILE *jsonl, FILE *table) {
    lm_eval_result *r = malloc(sizeof *r);
    if (!r) return lm_error(LM_ERR_MEMORY, "out of memory (evaluation result)");
    lm_status s = lm_eval_run(checkpoint_dir, opt, r);
    if (!s && jsonl) lm_eval_write_jsonl(r, opt, jsonl);
    if (!s && table) lm_eval_write_table(r, opt, table);
    free(r);
    return s;
}
