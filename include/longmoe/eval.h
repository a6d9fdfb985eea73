/* Long-context evaluation of a checkpoint (docs/eval.md): validation loss and
 * loss by position bucket on the checkpoint's training data, passkey accuracy
 * on a grid of context length x needle depth, MQAR accuracy by context length
 * and number of queries. Every accuracy is teacher-forced: one forward over
 * the whole sequence, the greedy argmax of the logits at each answer position
 * compared with the target there.
 *
 * The model is planned for a fixed micro-batch shape, so a checkpoint is
 * loaded once per distinct context length (lm_checkpoint_load_model). Results
 * go to a JSON-lines log (one object per line, formats in docs/eval.md):
 *   {"type": "eval", "step": S, "val_loss": x, "answer_accuracy": y,
 *    "bucket_edges": [..], "loss_by_position": [..], ...}
 *   {"type": "passkey", "step": S, "lengths": [..], "depths": [..],
 *    "accuracy": [[..per depth..] per length], "digit_accuracy": [[..]], ...}
 *   {"type": "mqar", "step": S, "lengths": [..], "queries": [..],
 *    "accuracy": [[..per queries..] per length], ...}
 * A value that could not be measured (a grid cell whose task does not fit the
 * length, a bucket without positions) is written as null. */
#ifndef LONGMOE_EVAL_H
#define LONGMOE_EVAL_H

#include <stdint.h>
#include <stdio.h>

#include "longmoe/core.h"
#include "longmoe/data.h"
#include "longmoe/model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_EVAL_MAX_GRID 16    /* lengths, depths and query counts, each */
#define LM_EVAL_MAX_BUCKETS 64 /* position buckets of the validation loss */

enum { LM_EVAL_VAL = 1, LM_EVAL_PASSKEY = 2, LM_EVAL_MQAR = 4 };

typedef struct {
    int tasks;                          /* LM_EVAL_* bits */
    int n_lengths;                      /* context lengths of the passkey and MQAR grids */
    int lengths[LM_EVAL_MAX_GRID];
    int n_depths;                       /* passkey needle depths, each in [0, 1] */
    double depths[LM_EVAL_MAX_GRID];
    int n_queries;                      /* MQAR queries per row */
    int queries[LM_EVAL_MAX_GRID];
    int mqar_pairs;                     /* MQAR pairs per row: 0 as many as the queries, -1 as many as fit */
    int batches;                        /* batches per grid cell and for the validation loss */
    int batch_size;                     /* B of the planned model */
    int n_buckets;                      /* position buckets of the validation loss */
    int val_length;                     /* 0: the sequence length of the checkpoint's stage */
    const char *val_data;               /* NULL: the data of the checkpoint's stage (lm_data_open spec) */
    uint64_t seed;                      /* seed of the passkey and MQAR rows */
    struct lm_backend *backend;         /* where the models run (NULL: the CPU); it must outlive the call */
} lm_eval_options;

/* Defaults: all three tasks, lengths 256, 1024, 4096, depths 0, 0.25, 0.5,
 * 0.75, 1, queries 2, 8, 16 with as many pairs, 2 batches of 4 rows,
 * 8 buckets, the checkpoint's data and length for the validation loss. */
lm_eval_options lm_eval_options_default(void);
/* Ranges and sizes of every field, with messages naming the bad value. */
lm_status lm_eval_options_check(const lm_eval_options *opt);

/* The held-out stream of training data `spec` in a run seeded `run_seed`: a
 * token corpus "shards:DIR" reads its val split ("shards-val:DIR"), a task its
 * stream under the seed run_seed xor a fixed constant. The trainer's
 * evaluations and lm_eval_run both open their validation data here, so they
 * score the same tokens. */
lm_status lm_eval_open_validation(const char *spec, uint64_t run_seed, lm_data_source **out);

/* ---- scoring logits (the accuracy definitions) ---- */

/* Running sums over batches of one length T. */
typedef struct {
    int T, n_buckets;                               /* bucket i holds positions [edge(i), edge(i+1)) */
    double loss_sum[LM_EVAL_MAX_BUCKETS];           /* cross-entropy (nats) summed per bucket */
    int64_t loss_count[LM_EVAL_MAX_BUCKETS];
    int64_t answers, answers_right;                 /* answer positions; argmax equal to the target */
    int64_t rows, rows_right;                       /* rows with answers; all of them right */
} lm_eval_tally;

/* Start a tally for length T with n_buckets buckets (1..LM_EVAL_MAX_BUCKETS). */
lm_status lm_eval_tally_init(lm_eval_tally *t, int T, int n_buckets);
/* The first position of bucket i (0 <= i <= n_buckets): floor(i * T / n_buckets). */
int lm_eval_bucket_edge(const lm_eval_tally *t, int i);
/* Add logits [B,T,V] against targets [B,T] (ids < V) with answer [B,T] (may be
 * NULL). The argmax is the lowest index among equal maxima. Non-finite logits
 * are an error (LM_ERR_NUMERIC). */
lm_status lm_eval_score(lm_eval_tally *t, const float *logits, const int32_t *targets, const uint8_t *answer, int B,
                        int V);
/* The same from each position's scores instead of its logits: nll [B,T]
 * (-log p of the target) and argmax [B,T] as lm_model_score gives them; with
 * the nll and argmax of lm_score_row on the same logits the tally is
 * lm_eval_score's bit for bit. A non-finite nll is an error (LM_ERR_NUMERIC). */
lm_status lm_eval_score_tokens(lm_eval_tally *t, const double *nll, const int32_t *argmax, const int32_t *targets,
                               const uint8_t *answer, int B);
/* Mean loss over all positions; fraction of answer positions right; fraction
 * of rows with every answer right (NaN when there is nothing to average). */
double lm_eval_tally_loss(const lm_eval_tally *t);
double lm_eval_tally_answer_accuracy(const lm_eval_tally *t);
double lm_eval_tally_row_accuracy(const lm_eval_tally *t);
double lm_eval_tally_bucket_loss(const lm_eval_tally *t, int i);

/* ---- one model at its planned shape (lm_model_shape) ---- */

/* Loss by position bucket and answer accuracy on batches 0..n_batches-1 of
 * `src`; *tally is started here (n_buckets buckets over the model's length). */
lm_status lm_eval_loss(lm_model *m, lm_data_source *src, int n_batches, int n_buckets, lm_eval_tally *tally);
/* The same over a share of each batch: batches of batch_rows sequences are
 * drawn and the model (of B rows) scores rows [first_row, first_row + B).
 * Data-parallel ranks each score their share and sum the tallies, which then
 * cover the sequences one rank of batch_rows would score. */
lm_status lm_eval_loss_rows(lm_model *m, lm_data_source *src, int n_batches, int n_buckets, int batch_rows,
                            int first_row, lm_eval_tally *tally);
/* The same for a context-parallel model (lm_model_set_context_parallel over
 * `group`) holding tokens [t0, t0 + T_c) of its B rows: batches of
 * batch_rows sequences of T tokens are drawn, the model scores positions
 * [t0, t0 + T_c) of rows [first_row, first_row + B) against the whole
 * sequence's targets, into buckets over the whole length T. Collective over
 * group (every rank of it calls with the same arguments but t0). A row's
 * answers lie on several ranks: their counts are summed over the group and
 * the rank with t0 = 0 alone counts the row (rows, rows_right), so the
 * tallies of the group's ranks add up to the whole rows' tally. */
struct lm_comm;
lm_status lm_eval_loss_segment(lm_model *m, lm_data_source *src, int n_batches, int n_buckets, int batch_rows,
                               int first_row, int T, int t0, struct lm_comm *group, lm_eval_tally *tally);
/* Passkey at each depth: accuracy[i] the fraction of rows whose five digits
 * are all right, digit_accuracy[i] the fraction of digits right. */
lm_status lm_eval_passkey(lm_model *m, const double *depths, int n_depths, int n_batches, uint64_t seed,
                          double *accuracy, double *digit_accuracy);
/* MQAR at each query count: accuracy[i] the fraction of value digits right
 * (NaN where the block does not fit the model's length). `pairs` as in
 * lm_eval_options.mqar_pairs. */
lm_status lm_eval_mqar(lm_model *m, const int *queries, int n_queries, int pairs, int n_batches, uint64_t seed,
                       double *accuracy);

/* ---- a checkpoint ---- */

typedef struct {
    int64_t step;                                   /* from trainer.json (0 when absent) */
    char val_data[64];
    int val_length;
    double val_loss, answer_accuracy;
    int n_buckets;
    int bucket_edges[LM_EVAL_MAX_BUCKETS + 1];
    double loss_by_position[LM_EVAL_MAX_BUCKETS];
    double passkey_accuracy[LM_EVAL_MAX_GRID][LM_EVAL_MAX_GRID];       /* [length][depth] */
    double passkey_digit_accuracy[LM_EVAL_MAX_GRID][LM_EVAL_MAX_GRID]; /* [length][depth] */
    double mqar_accuracy[LM_EVAL_MAX_GRID][LM_EVAL_MAX_GRID];          /* [length][queries] */
    double seconds;
} lm_eval_result;

/* Resolve a checkpoint: `dir` itself when it holds model.safetensors, else
 * the checkpoint its `latest` file names (a run directory). */
lm_status lm_eval_resolve_checkpoint(const char *dir, char *out, size_t n);

/* Evaluate checkpoint `checkpoint_dir` (or a run directory: its latest
 * checkpoint): the model is loaded once per distinct length with B =
 * opt->batch_size. */
lm_status lm_eval_run(const char *checkpoint_dir, const lm_eval_options *opt, lm_eval_result *result);

/* The validation fields of r (val_loss, answer_accuracy, buckets) from a tally. */
void lm_eval_result_set_validation(lm_eval_result *r, const lm_eval_tally *t);
/* The {"type": "eval"} line of r's step and validation fields: the one writer
 * of that line (lm_eval_write_jsonl and the trainer's evaluations). */
void lm_eval_write_validation(const lm_eval_result *r, FILE *f);
/* Write the result's JSON lines (those of opt->tasks) to `jsonl`. */
void lm_eval_write_jsonl(const lm_eval_result *r, const lm_eval_options *opt, FILE *jsonl);
/* Write a readable table of the result to `table`. */
void lm_eval_write_table(const lm_eval_result *r, const lm_eval_options *opt, FILE *table);

/* lm_eval_run, then its JSON lines to `jsonl` and its table to `table`
 * (either may be NULL). Meant for the trainer at each stage end, with the
 * stage's checkpoint, its metrics.jsonl and its progress stream. */
lm_status lm_eval_checkpoint(const char *checkpoint_dir, const lm_eval_options *opt, FILE *jsonl, FILE *table);

#ifdef __cplusplus
}
#endif
#endif
