/* The training report: one self-contained HTML file (inline SVG and CSS, no
 * scripts, nothing fetched from elsewhere) drawn from a run directory's
 * metrics.jsonl (docs/training.md) and, when present, its config.json.
 *
 * Contents (docs/report.md): a summary table; loss (train and validation),
 * learning rate, gradient norm and the largest attention logit over steps with
 * the context-extension stages as vertical lines; per MoE layer the expert load
 * over steps as a heatmap (colour = load / mean load) and MaxVio_batch and
 * MaxVio_global; the passkey grid (context length x needle depth) and the MQAR
 * grid (length x queries) of the last evaluation that wrote them; for an RL run
 * (`longmoe rl`) held-out success, reward, trajectory length, KL, entropy and
 * the clipped fraction over steps.
 *
 * The log is read one line at a time with the strict JSON parser; a line that
 * is not a valid record is skipped, counted and named in the report. Memory and
 * file size do not grow with the run: line charts are averaged into at most
 * `max_points` buckets (with a min-max band), heatmaps into at most
 * `max_columns` step columns, and the expert heatmaps are embedded as indexed
 * PNG images inside the SVG. */
#ifndef LONGMOE_REPORT_H
#define LONGMOE_REPORT_H

#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *run_dir;  /* holds metrics.jsonl; config.json and checkpoint-* are optional */
    const char *out_path; /* NULL: run_dir/report.html */
    int log_loss;         /* 1: the loss chart has a logarithmic y axis */
    int max_points;       /* buckets per line chart; 0: 600 */
    int max_columns;      /* step columns per heatmap; 0: 300 (fewer for very many layers x experts) */
} lm_report_options;

/* What the report was drawn from (for the CLI's one-line summary and tests). */
typedef struct {
    int64_t lines;           /* non-blank lines of metrics.jsonl */
    int64_t records;         /* lines that were valid records (of any known type) */
    int64_t malformed;       /* lines skipped: invalid JSON or a record missing required fields */
    int64_t train_records, eval_records, stage_records, skip_records, checkpoint_records;
    int64_t passkey_records, mqar_records;
    int64_t rl_records;      /* rl, rl_warm and rl_eval records (agentic RL, docs/rl.md) */
    int moe_layers, experts; /* shape of the first train record's moe list */
    int heatmap_columns;     /* step columns of the expert heatmaps */
    int64_t last_step;
    size_t html_bytes;
} lm_report_summary;

lm_report_options lm_report_options_default(const char *run_dir);

/* Read run_dir/metrics.jsonl, draw the report and write it atomically to
 * opt->out_path. A missing run directory, a missing or empty metrics file, or
 * one without a single valid record is an error (LM_ERR_IO / LM_ERR_FORMAT)
 * naming the path; no file is written then. `summary` may be NULL. */
lm_status lm_report_write(const lm_report_options *opt, lm_report_summary *summary);

#ifdef __cplusplus
}
#endif
#endif
