/* The training report (include/longmoe/report.h, docs/report.md): read
 * metrics.jsonl one line at a time, keep bounded summaries of it, and draw one
 * self-contained HTML page of inline SVG. */
#include "longmoe/report.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "files.h"
#include "json.h"
#include "longmoe/config.h"
#include "longmoe/safetensors.h"

/* growable text: lm_text (src/core/files.h) */
typedef lm_text text_buf;

/* Text for HTML content and attribute values. */
static void tb_escape(text_buf *b, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '<': lm_text_puts(b, "&lt;"); break;
        case '>': lm_text_puts(b, "&gt;"); break;
        case '&': lm_text_puts(b, "&amp;"); break;
        case '"': lm_text_puts(b, "&quot;"); break;
        case '\'': lm_text_puts(b, "&#39;"); break;
        default: lm_text_put(b, s, 1);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* what the log holds                                                         */

typedef struct {
    double *x, *y;
    size_t n, cap;
} series;

typedef struct {
    int64_t step, seq_len;
    int stage;
    char name[64];
} stage_mark;

/* accuracy[xi * ny + yi] over x values (context lengths) and y values (depths or queries) */
typedef struct {
    int present;
    int64_t step;
    int nx, ny;
    double *xs, *ys, *acc;
} grid;

/* Expert load, averaged into step columns: column c holds steps (c*width, (c+1)*width].
 * When a step falls beyond the last column, neighbouring columns are merged pairwise
 * and the width doubles, so the columns stay between cap/2 and cap. */
typedef struct {
    int layers, experts, cap, used;
    int64_t width;                   /* steps per column */
    int *layer_index;                /* [layers] model layer of each MoE layer */
    double *load;                    /* [layers][cap][experts] sums of load */
    double *vio_batch, *vio_global;  /* [layers][cap] sums */
    int64_t *count;                  /* [cap] records summed in each column */
} moe_columns;

typedef struct {
    series loss, lr, grad, max_logit, tokps, val_loss, val_acc;
    series mfu; /* GPU runs: model FLOPs utilisation per step */
    /* agentic RL (docs/rl.md): per step, the warm start's loss, held-out success per environment */
    series rl_reward, rl_success, rl_length, rl_kl_ref, rl_kl_old, rl_entropy, rl_clipped, rl_warm_loss;
    series rl_eval[3];
    int rl_eval_select; /* the evaluations were on the selection split ("split": "select") */
    int has_max_logit;
    stage_mark *stages;
    int n_stages, cap_stages;
    grid passkey, mqar;
    moe_columns moe;
    int moe_started;
    int64_t moe_mismatch;            /* train records whose moe list had another shape */
    int64_t bad_lines[8];            /* the first malformed line numbers */
    int n_bad_listed;
    char first_bad_reason[200];
    int64_t x_lo, x_hi;              /* step range of all records */
    int have_x;
    int out_of_memory;
    lm_report_summary sum;
} report;

static void series_add(report *r, series *s, double x, double y) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 256;
        double *nx = realloc(s->x, cap * sizeof *nx);
        if (nx) s->x = nx;
        double *ny = realloc(s->y, cap * sizeof *ny);
        if (ny) s->y = ny;
        if (!nx || !ny) {
            r->out_of_memory = 1;
            return;
        }
        s->cap = cap;
    }
    s->x[s->n] = x;
    s->y[s->n] = y;
    s->n++;
}

static void series_free(series *s) {
    free(s->x);
    free(s->y);
}

static void grid_free(grid *g) {
    free(g->xs);
    free(g->ys);
    free(g->acc);
    memset(g, 0, sizeof *g);
}

static void note_step(report *r, int64_t step) {
    if (!r->have_x || step < r->x_lo) r->x_lo = step;
    if (!r->have_x || step > r->x_hi) r->x_hi = step;
    r->have_x = 1;
}

static int get_number(const lm_json *o, const char *key, double *out) {
    const lm_json *v = lm_json_get(o, key);
    if (!v || v->kind != LM_JSON_NUMBER) return 0;
    *out = v->number;
    return 1;
}

/* A record's step: a non-negative integer. */
static int get_step(const lm_json *o, int64_t *out) {
    const lm_json *v = lm_json_get(o, "step");
    if (!v || v->kind != LM_JSON_NUMBER || !v->number_is_integer || !(v->number >= 0 && v->number < 1e15)) return 0;
    *out = v->integer;
    return 1;
}

/* Numbers of a JSON array into a new array of `n` doubles (n = its length). */
static int get_numbers(const lm_json *a, double **out, int *n) {
    if (!a || a->kind != LM_JSON_ARRAY || a->count == 0 || a->count > 100000) return 0;
    double *v = malloc(a->count * sizeof *v);
    if (!v) return 0;
    int i = 0;
    for (const lm_json *e = a->child; e; e = e->next) {
        if (e->kind != LM_JSON_NUMBER) {
            free(v);
            return 0;
        }
        v[i++] = e->number;
    }
    *out = v;
    *n = i;
    return 1;
}

/* ---- MoE columns ---- */

static int moe_start(report *r, const lm_json *moe, int max_columns) {
    moe_columns *m = &r->moe;
    m->layers = (int)moe->count;
    const lm_json *first_load = lm_json_get(moe->child, "load");
    if (!first_load || first_load->kind != LM_JSON_ARRAY || first_load->count == 0) return 0;
    m->experts = (int)first_load->count;
    /* keep the embedded images of very wide models near 2M cells in all */
    long budget = 2000000L / ((long)m->layers * m->experts);
    m->cap = max_columns < budget ? max_columns : (int)(budget < 16 ? 16 : budget);
    m->width = 1;
    size_t cells = (size_t)m->layers * m->cap * m->experts;
    m->layer_index = calloc((size_t)m->layers, sizeof *m->layer_index);
    m->load = calloc(cells, sizeof *m->load);
    m->vio_batch = calloc((size_t)m->layers * m->cap, sizeof *m->vio_batch);
    m->vio_global = calloc((size_t)m->layers * m->cap, sizeof *m->vio_global);
    m->count = calloc((size_t)m->cap, sizeof *m->count);
    if (!m->layer_index || !m->load || !m->vio_batch || !m->vio_global || !m->count) {
        r->out_of_memory = 1;
        return 0;
    }
    int i = 0;
    for (const lm_json *e = moe->child; e; e = e->next, i++) {
        double layer;
        m->layer_index[i] = get_number(e, "layer", &layer) ? (int)layer : i;
    }
    r->moe_started = 1;
    return 1;
}

/* Merge neighbouring columns pairwise; the width doubles. */
static void moe_halve(moe_columns *m) {
    int half = (m->cap + 1) / 2;
    for (int c = 0; c < half; c++) {
        int a = 2 * c, b = 2 * c + 1;
        m->count[c] = m->count[a] + (b < m->cap ? m->count[b] : 0);
        for (int l = 0; l < m->layers; l++) {
            double *dst = m->load + ((size_t)l * m->cap + c) * m->experts;
            const double *sa = m->load + ((size_t)l * m->cap + a) * m->experts;
            const double *sb = b < m->cap ? m->load + ((size_t)l * m->cap + b) * m->experts : NULL;
            for (int e = 0; e < m->experts; e++) dst[e] = sa[e] + (sb ? sb[e] : 0);
            size_t o = (size_t)l * m->cap;
            m->vio_batch[o + c] = m->vio_batch[o + a] + (b < m->cap ? m->vio_batch[o + b] : 0);
            m->vio_global[o + c] = m->vio_global[o + a] + (b < m->cap ? m->vio_global[o + b] : 0);
        }
    }
    for (int c = half; c < m->cap; c++) {
        m->count[c] = 0;
        for (int l = 0; l < m->layers; l++) {
            memset(m->load + ((size_t)l * m->cap + c) * m->experts, 0, (size_t)m->experts * sizeof(double));
            m->vio_batch[(size_t)l * m->cap + c] = 0;
            m->vio_global[(size_t)l * m->cap + c] = 0;
        }
    }
    m->width *= 2;
    m->used = (m->used + 1) / 2;
}

/* Check the moe list has the first record's shape; then add it to its column. */
static void moe_add(report *r, int64_t step, const lm_json *moe) {
    moe_columns *m = &r->moe;
    if ((int)moe->count != m->layers) {
        r->moe_mismatch++;
        return;
    }
    for (const lm_json *e = moe->child; e; e = e->next) {
        const lm_json *load = lm_json_get(e, "load");
        if (!load || load->kind != LM_JSON_ARRAY || (int)load->count != m->experts) {
            r->moe_mismatch++;
            return;
        }
        for (const lm_json *v = load->child; v; v = v->next)
            if (v->kind != LM_JSON_NUMBER || v->number < 0) {
                r->moe_mismatch++;
                return;
            }
    }
    int64_t s = step < 1 ? 1 : step;
    while ((s - 1) / m->width >= m->cap) moe_halve(m);
    int c = (int)((s - 1) / m->width);
    if (c + 1 > m->used) m->used = c + 1;
    m->count[c]++;
    int l = 0;
    for (const lm_json *e = moe->child; e; e = e->next, l++) {
        double *dst = m->load + ((size_t)l * m->cap + c) * m->experts;
        int j = 0;
        for (const lm_json *v = lm_json_get(e, "load")->child; v; v = v->next) dst[j++] += v->number;
        double x;
        if (get_number(e, "maxvio_batch", &x)) m->vio_batch[(size_t)l * m->cap + c] += x;
        if (get_number(e, "maxvio_global", &x)) m->vio_global[(size_t)l * m->cap + c] += x;
    }
}

static void moe_free(moe_columns *m) {
    free(m->layer_index);
    free(m->load);
    free(m->vio_batch);
    free(m->vio_global);
    free(m->count);
}

/* ---- records ---- */

/* Accuracy grids: {"lengths": [...], <second>: [...], "accuracy": [[per second] per length]}. */
static int read_grid(report *r, const lm_json *o, const char *second, grid *g) {
    grid n;
    memset(&n, 0, sizeof n);
    if (!get_step(o, &n.step)) n.step = -1;
    if (!get_numbers(lm_json_get(o, "lengths"), &n.xs, &n.nx)) return 0;
    if (!get_numbers(lm_json_get(o, second), &n.ys, &n.ny)) {
        grid_free(&n);
        return 0;
    }
    const lm_json *acc = lm_json_get(o, "accuracy");
    n.acc = malloc((size_t)n.nx * n.ny * sizeof *n.acc);
    if (!n.acc || !acc || acc->kind != LM_JSON_ARRAY || (int)acc->count != n.nx) {
        grid_free(&n);
        return 0;
    }
    int i = 0;
    for (const lm_json *row = acc->child; row; row = row->next, i++) {
        if (row->kind != LM_JSON_ARRAY || (int)row->count != n.ny) {
            grid_free(&n);
            return 0;
        }
        int j = 0;
        for (const lm_json *v = row->child; v; v = v->next, j++) {
            /* null: a cell that does not fit its length (drawn as n/a) */
            if (v->kind != LM_JSON_NUMBER && v->kind != LM_JSON_NULL) {
                grid_free(&n);
                return 0;
            }
            n.acc[(size_t)i * n.ny + j] = v->kind == LM_JSON_NULL ? NAN : v->number;
        }
    }
    n.present = 1;
    grid_free(g);
    *g = n;
    if (n.step >= 0) note_step(r, n.step);
    return 1;
}

/* One parsed line. Returns 1 for a valid record, 0 for a malformed one (reason set). */
static int read_record(report *r, const lm_json *o, int max_columns, const char **reason) {
    if (o->kind != LM_JSON_OBJECT) {
        *reason = "not a JSON object";
        return 0;
    }
    const lm_json *type = lm_json_get(o, "type");
    if (!type || type->kind != LM_JSON_STRING) {
        *reason = "no \"type\" string";
        return 0;
    }
    const char *t = type->string;
    int64_t step;
    double x;
    if (!strcmp(t, "train")) {
        double loss;
        if (!get_step(o, &step) || !get_number(o, "loss", &loss)) {
            *reason = "train record without an integer step and a loss";
            return 0;
        }
        note_step(r, step);
        series_add(r, &r->loss, (double)step, loss);
        if (get_number(o, "lr", &x)) series_add(r, &r->lr, (double)step, x);
        if (get_number(o, "grad_norm", &x)) series_add(r, &r->grad, (double)step, x);
        if (get_number(o, "tokens_per_s", &x)) series_add(r, &r->tokps, (double)step, x);
        if (get_number(o, "mfu", &x)) series_add(r, &r->mfu, (double)step, x);
        if (get_number(o, "max_logit", &x)) {
            series_add(r, &r->max_logit, (double)step, x);
            r->has_max_logit = 1;
        }
        const lm_json *moe = lm_json_get(o, "moe");
        if (moe && moe->kind == LM_JSON_ARRAY && moe->count > 0 && moe->child->kind == LM_JSON_OBJECT) {
            if (!r->moe_started && !r->out_of_memory) moe_start(r, moe, max_columns);
            if (r->moe_started) moe_add(r, step, moe);
        }
        r->sum.train_records++;
        if (step > r->sum.last_step) r->sum.last_step = step;
    } else if (!strcmp(t, "eval")) {
        if (!get_step(o, &step)) {
            *reason = "eval record without an integer step";
            return 0;
        }
        note_step(r, step);
        if (get_number(o, "val_loss", &x)) series_add(r, &r->val_loss, (double)step, x);
        if (get_number(o, "answer_accuracy", &x)) series_add(r, &r->val_acc, (double)step, x);
        r->sum.eval_records++;
    } else if (!strcmp(t, "rl")) {
        double reward;
        if (!get_step(o, &step) || !get_number(o, "reward", &reward)) {
            *reason = "rl record without an integer step and a reward";
            return 0;
        }
        note_step(r, step);
        series_add(r, &r->rl_reward, (double)step, reward);
        if (get_number(o, "success", &x)) series_add(r, &r->rl_success, (double)step, x);
        if (get_number(o, "length", &x)) series_add(r, &r->rl_length, (double)step, x);
        if (get_number(o, "kl_ref", &x)) series_add(r, &r->rl_kl_ref, (double)step, x);
        if (get_number(o, "kl_old", &x)) series_add(r, &r->rl_kl_old, (double)step, x);
        if (get_number(o, "entropy", &x)) series_add(r, &r->rl_entropy, (double)step, x);
        if (get_number(o, "clipped_frac", &x)) series_add(r, &r->rl_clipped, (double)step, x);
        if (get_number(o, "grad_norm", &x)) series_add(r, &r->grad, (double)step, x);
        r->sum.rl_records++;
        if (step > r->sum.last_step) r->sum.last_step = step;
    } else if (!strcmp(t, "rl_warm")) {
        if (!get_step(o, &step) || !get_number(o, "loss", &x)) {
            *reason = "rl_warm record without an integer step and a loss";
            return 0;
        }
        note_step(r, step);
        series_add(r, &r->rl_warm_loss, (double)step, x);
        r->sum.rl_records++;
        if (step > r->sum.last_step) r->sum.last_step = step;
    } else if (!strcmp(t, "rl_eval")) {
        if (!get_step(o, &step)) {
            *reason = "rl_eval record without an integer step";
            return 0;
        }
        note_step(r, step);
        static const char *const envs[3] = {"lookup", "calc", "grid"};
        for (int e = 0; e < 3; e++)
            if (get_number(o, envs[e], &x)) series_add(r, &r->rl_eval[e], (double)step, x);
        const lm_json *split = lm_json_get(o, "split");
        if (split && split->kind == LM_JSON_STRING && !strcmp(split->string, "select")) r->rl_eval_select = 1;
        r->sum.rl_records++;
    } else if (!strcmp(t, "stage")) {
        if (!get_step(o, &step)) {
            *reason = "stage record without an integer step";
            return 0;
        }
        if (r->n_stages == r->cap_stages) {
            int cap = r->cap_stages ? 2 * r->cap_stages : 16;
            stage_mark *s = realloc(r->stages, (size_t)cap * sizeof *s);
            if (!s) {
                r->out_of_memory = 1;
                return 1;
            }
            r->stages = s;
            r->cap_stages = cap;
        }
        stage_mark *s = &r->stages[r->n_stages++];
        memset(s, 0, sizeof *s);
        s->step = step;
        s->stage = get_number(o, "stage", &x) ? (int)x : r->n_stages - 1;
        s->seq_len = get_number(o, "seq_len", &x) ? (int64_t)x : 0;
        const lm_json *name = lm_json_get(o, "name");
        if (name && name->kind == LM_JSON_STRING) snprintf(s->name, sizeof s->name, "%s", name->string);
        note_step(r, step);
        r->sum.stage_records++;
    } else if (!strcmp(t, "skip")) {
        if (!get_step(o, &step)) {
            *reason = "skip record without an integer step";
            return 0;
        }
        r->sum.skip_records++;
    } else if (!strcmp(t, "checkpoint")) {
        if (!get_step(o, &step)) {
            *reason = "checkpoint record without an integer step";
            return 0;
        }
        r->sum.checkpoint_records++;
    } else if (!strcmp(t, "passkey")) {
        if (!read_grid(r, o, "depths", &r->passkey)) {
            *reason = "passkey record without lengths, depths and a lengths x depths accuracy array";
            return 0;
        }
        r->sum.passkey_records++;
    } else if (!strcmp(t, "mqar")) {
        if (!read_grid(r, o, "queries", &r->mqar)) {
            *reason = "mqar record without lengths, queries and a lengths x queries accuracy array";
            return 0;
        }
        r->sum.mqar_records++;
    }
    /* other types (written by newer tools) are valid records this report does not draw */
    return 1;
}

static void note_malformed(report *r, int64_t line, const char *reason) {
    r->sum.malformed++;
    if (r->n_bad_listed < (int)(sizeof r->bad_lines / sizeof r->bad_lines[0])) r->bad_lines[r->n_bad_listed++] = line;
    if (!r->first_bad_reason[0]) snprintf(r->first_bad_reason, sizeof r->first_bad_reason, "line %lld: %s",
                                          (long long)line, reason);
}

static lm_status read_metrics(report *r, const char *path, int max_columns) {
    int fd;
    if (lm_open_regular(path, &fd, NULL)) {
        char msg[1024]; /* lm_error writes the buffer lm_last_error reads: copy first */
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        return lm_error(LM_ERR_IO, "%s (is the directory a training run? `longmoe train` writes metrics.jsonl)", msg);
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return lm_error(LM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int64_t number = 0;
    lm_status s = LM_OK;
    while ((len = getline(&line, &cap, f)) >= 0) {
        number++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ' ||
                           line[len - 1] == '\t'))
            line[--len] = 0;
        size_t start = 0;
        while ((ssize_t)start < len && (line[start] == ' ' || line[start] == '\t')) start++;
        if ((ssize_t)start == len) continue;
        r->sum.lines++;
        lm_json_doc *doc;
        char what[64];
        snprintf(what, sizeof what, "line %lld", (long long)number);
        lm_status ps = lm_json_parse(line + start, (size_t)len - start, what, &doc);
        if (ps) {
            if (ps == LM_ERR_MEMORY) {
                s = lm_error(LM_ERR_MEMORY, "out of memory reading line %lld of '%s'", (long long)number, path);
                break;
            }
            note_malformed(r, number, "invalid JSON");
            continue;
        }
        const char *reason = NULL;
        if (read_record(r, lm_json_root(doc), max_columns, &reason)) r->sum.records++;
        else note_malformed(r, number, reason);
        lm_json_free(doc);
        if (r->out_of_memory) break;
    }
    lm_clear_error();
    free(line);
    fclose(f);
    if (s) return s;
    if (r->out_of_memory) return lm_error(LM_ERR_MEMORY, "out of memory reading '%s'", path);
    if (r->sum.lines == 0)
        return lm_error(LM_ERR_FORMAT, "'%s' is empty: the run has not logged anything yet", path);
    if (r->sum.records == 0)
        return lm_error(LM_ERR_FORMAT, "'%s' has no valid record: all %lld lines are malformed (first: %s)", path,
                        (long long)r->sum.lines, r->first_bad_reason);
    return LM_OK;
}

/* ------------------------------------------------------------------------- */
/* numbers and axes                                                           */

/* 1, 2 or 5 times a power of ten, near `x`. */
static double nice_step(double x) {
    double p = pow(10, floor(log10(x)));
    double m = x / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

static void format_number(char *buf, size_t n, double v) {
    double a = fabs(v);
    if (v == 0) snprintf(buf, n, "0");
    else if (a >= 1e6 && fmod(a, 1e5) == 0) snprintf(buf, n, "%gM", v / 1e6);
    else if (a >= 1e4 && fmod(a, 1e3) == 0) snprintf(buf, n, "%gk", v / 1e3);
    else if (a >= 1e-3 && a < 1e5) snprintf(buf, n, "%.4g", v);
    else snprintf(buf, n, "%.3g", v);
}

/* Context lengths: 1024 -> 1K, 1048576 -> 1M. */
static void format_length(char *buf, size_t n, double v) {
    if (v >= 1048576 && fmod(v, 1048576) == 0) snprintf(buf, n, "%gM", v / 1048576);
    else if (v >= 1024 && fmod(v, 1024) == 0) snprintf(buf, n, "%gK", v / 1024);
    else snprintf(buf, n, "%g", v);
}

/* x of every plot's left edge, so that an expert heatmap and its MaxVio chart line up */
#define PLOT_LEFT 72

typedef struct {
    double lo, hi;
    int log;
    double ticks[32];
    int n_ticks;
} axis;

/* A linear axis over [lo, hi] widened to whole ticks of a nice step. */
static void axis_linear(axis *a, double lo, double hi, int want, int snap) {
    if (!(hi > lo)) {
        double d = fabs(lo) > 0 ? 0.1 * fabs(lo) : 1;
        lo -= d;
        hi += d;
    }
    double step = nice_step((hi - lo) / want);
    if (snap) {
        lo = floor(lo / step + 1e-9) * step;
        hi = ceil(hi / step - 1e-9) * step;
    }
    a->lo = lo;
    a->hi = hi;
    a->log = 0;
    a->n_ticks = 0;
    for (double t = ceil(lo / step - 1e-9) * step; t <= hi + 1e-9 * step && a->n_ticks < 32; t += step)
        a->ticks[a->n_ticks++] = fabs(t) < 1e-12 * step ? 0 : t;
}

/* A logarithmic axis over [lo, hi] (both > 0); ticks at 1-2-5 (or finer) times powers of ten. */
static void axis_log(axis *a, double lo, double hi) {
    if (!(hi > lo)) {
        lo /= 1.5;
        hi *= 1.5;
    }
    lo /= pow(hi / lo, 0.03);
    hi *= pow(hi / lo, 0.03);
    a->lo = lo;
    a->hi = hi;
    a->log = 1;
    static const double coarse[] = {1, 2, 5}, fine[] = {1, 1.5, 2, 3, 4, 5, 6, 8};
    for (int pass = 0; pass < 2; pass++) {
        const double *m = pass ? fine : coarse;
        int nm = pass ? 8 : 3;
        a->n_ticks = 0;
        for (int e = (int)floor(log10(lo)); e <= (int)ceil(log10(hi)); e++)
            for (int i = 0; i < nm && a->n_ticks < 32; i++) {
                double t = m[i] * pow(10, e);
                if (t >= lo && t <= hi) a->ticks[a->n_ticks++] = t;
            }
        if (a->n_ticks >= 3) break;
    }
}

/* Position of value v on an axis drawn from p0 (at lo) to p1 (at hi). */
static double axis_map(const axis *a, double v, double p0, double p1) {
    double f = a->log ? (log(v) - log(a->lo)) / (log(a->hi) - log(a->lo)) : (v - a->lo) / (a->hi - a->lo);
    return p0 + f * (p1 - p0);
}

/* ------------------------------------------------------------------------- */
/* line charts                                                                */

typedef struct {
    const char *name;
    const series *s;
    const char *color;
    int markers; /* draw a dot at each point (sparse series such as evaluations) */
} plot_line;

typedef struct {
    const char *title, *y_label;
    int width, height, margin_right;
    double x_lo, x_hi;
    int log_y;
    double hline; /* a horizontal reference (NAN: none) */
    const char *hline_label;
    double y_lo, y_hi; /* a fixed y range (NAN: from the data) */
    int max_points;
} chart_spec;

static chart_spec chart_default(const char *title, const char *y_label, int width, int height, double x_lo,
                                double x_hi, int max_points) {
    chart_spec c = {title, y_label, width, height, 16, x_lo, x_hi, 0, NAN, NULL, NAN, NAN, max_points};
    return c;
}

/* A series averaged into at most `buckets` buckets of equal step width:
 * mean x and y of each bucket and the y range (min, max) it covered. */
typedef struct {
    double *x, *y, *lo, *hi;
    int n, averaged;
} plot_points;

static int points_make(plot_points *p, const series *s, double x_lo, double x_hi, int buckets, int log_y) {
    memset(p, 0, sizeof *p);
    size_t cap = s->n < (size_t)buckets ? s->n : (size_t)buckets;
    if (cap == 0) return 1;
    p->x = malloc(cap * sizeof(double));
    p->y = malloc(cap * sizeof(double));
    p->lo = malloc(cap * sizeof(double));
    p->hi = malloc(cap * sizeof(double));
    int *count = calloc(cap, sizeof(int));
    if (!p->x || !p->y || !p->lo || !p->hi || !count) {
        free(count);
        return 0;
    }
    if (s->n <= (size_t)buckets) {
        for (size_t i = 0; i < s->n; i++) {
            if (!isfinite(s->y[i]) || (log_y && s->y[i] <= 0)) continue;
            p->x[p->n] = s->x[i];
            p->y[p->n] = p->lo[p->n] = p->hi[p->n] = s->y[i];
            p->n++;
        }
        free(count);
        return 1;
    }
    p->averaged = 1;
    for (size_t b = 0; b < cap; b++) p->x[b] = p->y[b] = 0;
    double span = x_hi > x_lo ? x_hi - x_lo : 1;
    for (size_t i = 0; i < s->n; i++) {
        double v = s->y[i];
        if (!isfinite(v) || (log_y && v <= 0)) continue;
        long b = (long)((s->x[i] - x_lo) / span * (double)cap);
        if (b < 0) b = 0;
        if (b >= (long)cap) b = (long)cap - 1;
        if (count[b] == 0 || v < p->lo[b]) p->lo[b] = v;
        if (count[b] == 0 || v > p->hi[b]) p->hi[b] = v;
        p->x[b] += s->x[i];
        p->y[b] += log_y ? log(v) : v; /* on a log axis the geometric mean */
        count[b]++;
    }
    for (size_t b = 0; b < cap; b++) {
        if (!count[b]) continue;
        p->x[p->n] = p->x[b] / count[b];
        p->y[p->n] = log_y ? exp(p->y[b] / count[b]) : p->y[b] / count[b];
        p->lo[p->n] = p->lo[b];
        p->hi[p->n] = p->hi[b];
        p->n++;
    }
    free(count);
    return 1;
}

static void points_free(plot_points *p) {
    free(p->x);
    free(p->y);
    free(p->lo);
    free(p->hi);
}

static void draw_stage_lines(text_buf *b, const report *r, const axis *ax, double left, double right, double top,
                             double bottom) {
    double last_end = -1e9;
    int level = 0;
    for (int i = 0; i < r->n_stages; i++) {
        const stage_mark *s = &r->stages[i];
        if (s->step < ax->lo || s->step > ax->hi) continue;
        double x = axis_map(ax, (double)s->step, left, right);
        lm_text_printf(b, "<line class=\"stage\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", x, top, x, bottom);
        char len[32] = "";
        if (s->seq_len > 0) format_length(len, sizeof len, (double)s->seq_len);
        /* labels that would overlap the previous one go one line lower */
        level = x + 3 < last_end ? (level + 1) % 4 : 0;
        last_end = x + 3 + 6.0 * ((double)strlen(s->name) + strlen(len) + 4);
        lm_text_printf(b, "<text class=\"stage-label\" x=\"%.1f\" y=\"%.1f\">", x + 3, top + 10 + 11 * level);
        if (s->name[0]) tb_escape(b, s->name);
        else lm_text_printf(b, "stage %d", s->stage);
        if (len[0] && strcmp(len, s->name)) lm_text_printf(b, " \xc2\xb7 %s", len);
        lm_text_puts(b, "</text>");
    }
}

static void draw_x_axis(text_buf *b, const axis *ax, double left, double right, double top, double bottom,
                        const char *label) {
    char num[32];
    for (int i = 0; i < ax->n_ticks; i++) {
        double x = axis_map(ax, ax->ticks[i], left, right);
        format_number(num, sizeof num, ax->ticks[i]);
        lm_text_printf(b, "<line class=\"grid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", x, top, x, bottom);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>", x, bottom + 14,
                  num);
    }
    lm_text_printf(b, "<text class=\"axis-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>",
              (left + right) / 2, bottom + 30, label);
}

static void draw_y_axis(text_buf *b, const axis *ay, double left, double right, double top, double bottom,
                        const char *label) {
    char num[32];
    for (int i = 0; i < ay->n_ticks; i++) {
        double y = axis_map(ay, ay->ticks[i], bottom, top);
        format_number(num, sizeof num, ay->ticks[i]);
        lm_text_printf(b, "<line class=\"grid\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", left, y, right, y);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>", left - 5, y + 4,
                  num);
    }
    if (label && label[0]) {
        lm_text_printf(b, "<text class=\"axis-label\" transform=\"translate(%.1f %.1f) rotate(-90)\" "
                  "text-anchor=\"middle\">", left - 56, (top + bottom) / 2);
        tb_escape(b, label);
        lm_text_puts(b, "</text>");
    }
}

static void render_line_chart(text_buf *b, report *r, const chart_spec *c, const plot_line *lines, int n_lines) {
    const double left = PLOT_LEFT, right = c->width - c->margin_right, top = 40, bottom = c->height - 40;
    plot_points pts[8];
    if (n_lines > 8) n_lines = 8;
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < n_lines; i++) {
        if (!points_make(&pts[i], lines[i].s, c->x_lo, c->x_hi, c->max_points, c->log_y)) r->out_of_memory = 1;
        for (int k = 0; k < pts[i].n; k++) {
            lo = fmin(lo, pts[i].lo[k]);
            hi = fmax(hi, pts[i].hi[k]);
        }
    }
    if (!isfinite(lo)) {
        lo = c->log_y ? 1 : 0;
        hi = c->log_y ? 10 : 1;
    }
    if (isfinite(c->y_lo) && isfinite(c->y_hi)) {
        lo = fmin(lo, c->y_lo);
        hi = fmax(hi, c->y_hi);
    }
    /* a reference line far outside the data is named in the title instead of squashing the curves */
    int show_hline = isfinite(c->hline) && (!c->log_y || c->hline > 0) &&
                     c->hline <= hi + (hi - lo) && c->hline >= lo - (hi - lo);
    if (show_hline) {
        lo = fmin(lo, c->hline);
        hi = fmax(hi, c->hline);
    }
    axis ax, ay;
    axis_linear(&ax, c->x_lo, c->x_hi, 8, 0);
    if (c->log_y) axis_log(&ay, lo, hi);
    else axis_linear(&ay, lo, hi, 5, 1);

    lm_text_printf(b, "<figure class=\"chart\"><svg viewBox=\"0 0 %d %d\" width=\"%d\" height=\"%d\" role=\"img\">",
              c->width, c->height, c->width, c->height);
    lm_text_puts(b, "<text class=\"title\" x=\"8\" y=\"18\">");
    tb_escape(b, c->title);
    if (c->log_y) lm_text_puts(b, " (log scale)");
    if (isfinite(c->hline) && !show_hline && c->hline_label) {
        lm_text_puts(b, "<tspan class=\"axis-label\"> \xc2\xb7 ");
        tb_escape(b, c->hline_label);
        lm_text_puts(b, " (off the scale)</tspan>");
    }
    lm_text_puts(b, "</text>");
    draw_x_axis(b, &ax, left, right, top, bottom, "step");
    draw_y_axis(b, &ay, left, right, top, bottom, c->y_label);
    lm_text_printf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>", left, top,
              right - left, bottom - top);
    draw_stage_lines(b, r, &ax, left, right, top, bottom);
    if (show_hline) {
        double y = axis_map(&ay, c->hline, bottom, top);
        lm_text_printf(b, "<line class=\"ref\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", left, y, right, y);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">", right - 4, y - 4);
        tb_escape(b, c->hline_label ? c->hline_label : "");
        lm_text_puts(b, "</text>");
    }
    for (int i = 0; i < n_lines; i++) {
        const plot_points *p = &pts[i];
        if (p->n == 0) continue;
        /* the min-max band of averaged buckets, then the mean line */
        if (p->averaged) {
            lm_text_printf(b, "<polygon class=\"band\" fill=\"%s\" points=\"", lines[i].color);
            for (int k = 0; k < p->n; k++)
                lm_text_printf(b, "%.1f,%.1f ", axis_map(&ax, p->x[k], left, right), axis_map(&ay, p->hi[k], bottom, top));
            for (int k = p->n - 1; k >= 0; k--)
                lm_text_printf(b, "%.1f,%.1f ", axis_map(&ax, p->x[k], left, right), axis_map(&ay, p->lo[k], bottom, top));
            lm_text_puts(b, "\"/>");
        }
        lm_text_printf(b, "<polyline class=\"line\" stroke=\"%s\" points=\"", lines[i].color);
        for (int k = 0; k < p->n; k++)
            lm_text_printf(b, "%.1f,%.1f ", axis_map(&ax, p->x[k], left, right), axis_map(&ay, p->y[k], bottom, top));
        lm_text_puts(b, "\"/>");
        if (lines[i].markers)
            for (int k = 0; k < p->n; k++)
                lm_text_printf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>",
                          axis_map(&ax, p->x[k], left, right), axis_map(&ay, p->y[k], bottom, top), lines[i].color);
    }
    /* legend, right-aligned above the plot */
    double x = right;
    for (int i = n_lines - 1; i >= 0; i--) {
        x -= 12 + 7.0 * (double)strlen(lines[i].name) + 18;
        lm_text_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"14\" height=\"4\" fill=\"%s\"/>", x, top - 14,
                  lines[i].color);
        lm_text_printf(b, "<text class=\"legend\" x=\"%.1f\" y=\"%.1f\">", x + 18, top - 9);
        tb_escape(b, lines[i].name);
        lm_text_puts(b, "</text>");
    }
    lm_text_puts(b, "</svg></figure>\n");
    for (int i = 0; i < n_lines; i++) points_free(&pts[i]);
}

/* ------------------------------------------------------------------------- */
/* indexed PNG images (stored, uncompressed deflate blocks) and base64        */

typedef struct {
    uint32_t table[256];
} crc32_table;

static void crc32_init(crc32_table *t) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
        t->table[n] = c;
    }
}

static uint32_t crc32_of(const crc32_table *t, const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) c = t->table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

static void put_be32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Append a chunk: length, type, data, CRC of type and data. */
static size_t png_chunk(uint8_t *out, const crc32_table *t, const char *type, const uint8_t *data, size_t n) {
    put_be32(out, (uint32_t)n);
    memcpy(out + 4, type, 4);
    if (n) memcpy(out + 8, data, n);
    put_be32(out + 8 + n, crc32_of(t, out + 4, n + 4));
    return n + 12;
}

/* An 8-bit palette PNG of w x h pixel indices (row-major, top row first) into a
 * new buffer; the pixel data travels in stored (uncompressed) deflate blocks. */
static uint8_t *png_indexed(const uint8_t *pixels, int w, int h, const uint8_t (*palette)[3], int n_palette,
                            size_t *size) {
    size_t raw = (size_t)h * (w + 1);
    size_t blocks = raw / 65535 + 1;
    size_t zlen = 2 + raw + 5 * blocks + 4;
    size_t total = 8 + (12 + 13) + (12 + 3 * (size_t)n_palette) + (12 + zlen) + 12;
    uint8_t *out = malloc(total), *z = malloc(zlen);
    if (!out || !z) {
        free(out);
        free(z);
        return NULL;
    }
    crc32_table t;
    crc32_init(&t);
    static const uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    memcpy(out, signature, 8);
    size_t o = 8;
    uint8_t ihdr[13];
    put_be32(ihdr, (uint32_t)w);
    put_be32(ihdr + 4, (uint32_t)h);
    ihdr[8] = 8;  /* bit depth */
    ihdr[9] = 3;  /* colour type: palette */
    ihdr[10] = ihdr[11] = ihdr[12] = 0;
    o += png_chunk(out + o, &t, "IHDR", ihdr, 13);
    o += png_chunk(out + o, &t, "PLTE", (const uint8_t *)palette, 3 * (size_t)n_palette);
    /* zlib: header, stored blocks of the filtered rows (filter byte 0 each), Adler-32 */
    size_t zo = 0;
    z[zo++] = 0x78;
    z[zo++] = 0x01;
    uint32_t a = 1, bsum = 0;
    size_t done = 0, row_pos = 0;
    int row = 0;
    while (done < raw || done == 0) {
        size_t n = raw - done < 65535 ? raw - done : 65535;
        z[zo++] = done + n == raw ? 1 : 0;
        z[zo++] = (uint8_t)n;
        z[zo++] = (uint8_t)(n >> 8);
        z[zo++] = (uint8_t)~n;
        z[zo++] = (uint8_t)(~n >> 8);
        for (size_t i = 0; i < n; i++) {
            uint8_t v = row_pos == 0 ? 0 : pixels[(size_t)row * w + row_pos - 1];
            if (++row_pos == (size_t)w + 1) {
                row_pos = 0;
                row++;
            }
            z[zo++] = v;
            a = (a + v) % 65521;
            bsum = (bsum + a) % 65521;
        }
        done += n;
        if (raw == 0) break;
    }
    put_be32(z + zo, (bsum << 16) | a);
    zo += 4;
    o += png_chunk(out + o, &t, "IDAT", z, zo);
    o += png_chunk(out + o, &t, "IEND", NULL, 0);
    free(z);
    *size = o;
    return out;
}

static void tb_base64(text_buf *b, const uint8_t *p, size_t n) {
    static const char digits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    if (!lm_text_reserve(b, (n + 2) / 3 * 4)) return;
    char *o = b->s + b->n;
    size_t i = 0;
    for (; i + 2 < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];
        *o++ = digits[v >> 18];
        *o++ = digits[(v >> 12) & 63];
        *o++ = digits[(v >> 6) & 63];
        *o++ = digits[v & 63];
    }
    if (i < n) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0);
        *o++ = digits[v >> 18];
        *o++ = digits[(v >> 12) & 63];
        *o++ = i + 1 < n ? digits[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    b->n = (size_t)(o - b->s);
    b->s[b->n] = 0;
}

/* ------------------------------------------------------------------------- */
/* colours                                                                    */

typedef struct {
    double at;
    uint8_t rgb[3];
} colour_stop;

static void colour_at(const colour_stop *stops, int n, double f, uint8_t rgb[3]) {
    if (!(f > 0)) f = 0;
    if (f > 1) f = 1;
    int i = 0;
    while (i < n - 2 && f > stops[i + 1].at) i++;
    double u = (f - stops[i].at) / (stops[i + 1].at - stops[i].at);
    for (int k = 0; k < 3; k++)
        rgb[k] = (uint8_t)lround(stops[i].rgb[k] + u * (stops[i + 1].rgb[k] - stops[i].rgb[k]));
}

/* load / mean load on a log2 axis from 1/4 (blue) through 1 (white) to 4 (red) */
static const colour_stop load_colours[] = {
    {0.00, {33, 102, 172}}, {0.25, {146, 197, 222}}, {0.50, {247, 247, 247}},
    {0.75, {244, 165, 130}}, {1.00, {178, 24, 43}}};
/* accuracy from 0 (red) through yellow to 1 (green) */
static const colour_stop accuracy_colours[] = {
    {0.0, {215, 48, 39}}, {0.25, {252, 141, 89}}, {0.5, {254, 224, 139}},
    {0.75, {145, 207, 96}}, {1.0, {26, 152, 80}}};

#define LOAD_LEVELS 255 /* palette entries 0..254; 255 marks a column with no record */
#define LOAD_RATIO_MAX 4.0

static int load_level(double ratio) {
    if (!(ratio > 0)) return 0;
    double f = (log2(ratio) / log2(LOAD_RATIO_MAX) + 1) / 2;
    long v = lround(f * (LOAD_LEVELS - 1));
    return (int)(v < 0 ? 0 : v > LOAD_LEVELS - 1 ? LOAD_LEVELS - 1 : v);
}

/* ------------------------------------------------------------------------- */
/* heatmaps                                                                   */

/* A vertical colour bar with labelled stops, at (x, top)..(x+12, bottom). */
static void draw_colour_bar(text_buf *b, const colour_stop *stops, int n_stops, double x, double top, double bottom,
                            const double *label_at, const char *const *labels, int n_labels, const char *title) {
    const int steps = 32;
    double h = (bottom - top) / steps;
    for (int i = 0; i < steps; i++) {
        uint8_t rgb[3];
        colour_at(stops, n_stops, 1 - (i + 0.5) / steps, rgb);
        lm_text_printf(b, "<rect x=\"%.1f\" y=\"%.2f\" width=\"12\" height=\"%.2f\" fill=\"#%02x%02x%02x\"/>", x,
                  top + i * h, h + 0.3, rgb[0], rgb[1], rgb[2]);
    }
    lm_text_printf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"12\" height=\"%.1f\"/>", x, top, bottom - top);
    for (int i = 0; i < n_labels; i++) {
        double y = bottom - label_at[i] * (bottom - top);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">%s</text>", x + 16, y + 4, labels[i]);
    }
    lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\">%s</text>", x - 2, top - 8, title);
}

static void render_expert_heatmap(text_buf *b, report *r, int l, int width) {
    const moe_columns *m = &r->moe;
    int cols = m->used, E = m->experts;
    int hh = E * 14 < 84 ? 84 : E * 14 > 336 ? 336 : E * 14;
    const double left = PLOT_LEFT, right = width - 96, top = 40, bottom = top + hh;
    int height = (int)bottom + 44;
    uint8_t *pixels = malloc((size_t)cols * E);
    if (!pixels) {
        r->out_of_memory = 1;
        return;
    }
    /* colour = load / mean load of the column (the column's counts cancel) */
    for (int c = 0; c < cols; c++) {
        const double *load = m->load + ((size_t)l * m->cap + c) * E;
        double mean = 0;
        for (int e = 0; e < E; e++) mean += load[e];
        mean /= E;
        for (int e = 0; e < E; e++)
            pixels[(size_t)e * cols + c] = m->count[c] == 0 || mean <= 0 ? 255 : (uint8_t)load_level(load[e] / mean);
    }
    uint8_t palette[256][3];
    for (int i = 0; i < LOAD_LEVELS; i++) colour_at(load_colours, 5, (double)i / (LOAD_LEVELS - 1), palette[i]);
    palette[255][0] = palette[255][1] = palette[255][2] = 200;
    size_t png_size;
    uint8_t *png = png_indexed(pixels, cols, E, (const uint8_t(*)[3])palette, 256, &png_size);
    free(pixels);
    if (!png) {
        r->out_of_memory = 1;
        return;
    }
    lm_text_printf(b, "<figure class=\"chart heatmap expert-load\"><svg viewBox=\"0 0 %d %d\" width=\"%d\" height=\"%d\" "
              "role=\"img\">", width, height, width, height);
    lm_text_printf(b, "<text class=\"title\" x=\"8\" y=\"18\">Expert load, layer %d (MoE layer %d of %d): load / mean "
              "load per step column</text>", m->layer_index[l], l + 1, m->layers);
    lm_text_printf(b, "<image x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" preserveAspectRatio=\"none\" "
              "style=\"image-rendering:pixelated\" href=\"data:image/png;base64,", left, top, right - left,
              bottom - top);
    tb_base64(b, png, png_size);
    lm_text_puts(b, "\"/>");
    free(png);
    lm_text_printf(b, "<rect class=\"frame\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/>", left, top,
              right - left, bottom - top);
    /* x: steps (column c spans steps (c*width, (c+1)*width]) */
    axis ax;
    axis_linear(&ax, 0, (double)cols * m->width, 8, 0);
    char num[32];
    for (int i = 0; i < ax.n_ticks; i++) {
        double x = axis_map(&ax, ax.ticks[i], left, right);
        format_number(num, sizeof num, ax.ticks[i]);
        lm_text_printf(b, "<line class=\"tickmark\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>", x, bottom, x,
                  bottom + 4);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>", x, bottom + 16,
                  num);
    }
    lm_text_printf(b, "<text class=\"axis-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step (%d column%s of %lld "
              "step%s)</text>", (left + right) / 2, bottom + 32, cols, cols == 1 ? "" : "s", (long long)m->width,
              m->width == 1 ? "" : "s");
    /* y: experts, 0 at the top */
    int every = E <= 16 ? 1 : (int)nice_step(E / 8.0);
    double row = (bottom - top) / E;
    for (int e = 0; e < E; e += every)
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%d</text>", left - 5,
                  top + (e + 0.5) * row + 4, e);
    lm_text_printf(b, "<text class=\"axis-label\" transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">"
              "expert</text>", left - 48, (top + bottom) / 2);
    static const double at[] = {0, 0.25, 0.5, 0.75, 1};
    static const char *const labels[] = {"\xe2\x89\xa4" "1/4", "1/2", "1", "2", "\xe2\x89\xa5" "4"};
    draw_colour_bar(b, load_colours, 5, right + 14, top + 8, bottom, at, labels, 5, "load/mean");
    lm_text_puts(b, "</svg></figure>\n");
}

/* MaxVio of one MoE layer, averaged over the heatmap's step columns (aligned with it). */
static void render_maxvio(text_buf *b, report *r, int l, int width) {
    const moe_columns *m = &r->moe;
    series sb = {0}, sg = {0};
    for (int c = 0; c < m->used; c++) {
        if (!m->count[c]) continue;
        double x = (c + 0.5) * m->width;
        series_add(r, &sb, x, m->vio_batch[(size_t)l * m->cap + c] / m->count[c]);
        series_add(r, &sg, x, m->vio_global[(size_t)l * m->cap + c] / m->count[c]);
    }
    char title[160];
    snprintf(title, sizeof title, "MaxVio, layer %d (max load / mean load - 1)", m->layer_index[l]);
    chart_spec c = chart_default(title, "MaxVio", width, 200, 0, (double)m->used * m->width, m->cap);
    c.margin_right = 96;
    plot_line lines[2] = {{"MaxVio_batch", &sb, "#d95f02", 0}, {"MaxVio_global", &sg, "#1b9e77", 0}};
    render_line_chart(b, r, &c, lines, 2);
    series_free(&sb);
    series_free(&sg);
}

/* An accuracy grid: x = context length, y = the second dimension (top row first). */
static void render_accuracy_grid(text_buf *b, const grid *g, const char *title, const char *y_label,
                                 int y_is_fraction) {
    int cell_w = g->nx <= 8 ? 84 : g->nx <= 16 ? 56 : 36, cell_h = g->ny <= 12 ? 28 : 18;
    const double left = 84, top = 40;
    double right = left + (double)g->nx * cell_w, bottom = top + (double)g->ny * cell_h;
    int width = (int)right + 110, height = (int)bottom + 48;
    if (width < 420) width = 420;
    lm_text_printf(b, "<figure class=\"chart heatmap accuracy-grid\"><svg viewBox=\"0 0 %d %d\" width=\"%d\" "
              "height=\"%d\" role=\"img\">", width, height, width, height);
    lm_text_puts(b, "<text class=\"title\" x=\"8\" y=\"18\">");
    tb_escape(b, title);
    if (g->step >= 0) lm_text_printf(b, " at step %lld", (long long)g->step);
    lm_text_puts(b, "</text>");
    char label[32];
    for (int i = 0; i < g->nx; i++)
        for (int j = 0; j < g->ny; j++) {
            double v = g->acc[(size_t)i * g->ny + j];
            double x = left + (double)i * cell_w, y = top + (double)j * cell_h;
            if (!isfinite(v)) {
                lm_text_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%d\" height=\"%d\" fill=\"#dddddd\" "
                          "stroke=\"#fff\"><title>does not fit</title></rect>", x, y, cell_w, cell_h);
                if (cell_w >= 36 && cell_h >= 18)
                    lm_text_printf(b, "<text class=\"cell\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">n/a</text>",
                              x + cell_w / 2.0, y + cell_h / 2.0 + 4);
                continue;
            }
            uint8_t rgb[3];
            colour_at(accuracy_colours, 5, v, rgb);
            lm_text_printf(b, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%d\" height=\"%d\" fill=\"#%02x%02x%02x\" "
                      "stroke=\"#fff\"><title>%.1f%%</title></rect>", x, y, cell_w, cell_h, rgb[0], rgb[1], rgb[2],
                      100 * v);
            if (cell_w >= 36 && cell_h >= 18)
                lm_text_printf(b, "<text class=\"cell\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>",
                          x + cell_w / 2.0, y + cell_h / 2.0 + 4, 100 * v);
        }
    for (int i = 0; i < g->nx; i++) {
        format_length(label, sizeof label, g->xs[i]);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>",
                  left + (i + 0.5) * cell_w, bottom + 14, label);
    }
    lm_text_printf(b, "<text class=\"axis-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">context length "
              "(tokens)</text>", (left + right) / 2, bottom + 32);
    for (int j = 0; j < g->ny; j++) {
        if (y_is_fraction) snprintf(label, sizeof label, "%.0f%%", 100 * g->ys[j]);
        else snprintf(label, sizeof label, "%g", g->ys[j]);
        lm_text_printf(b, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>", left - 5,
                  top + (j + 0.5) * cell_h + 4, label);
    }
    lm_text_printf(b, "<text class=\"axis-label\" transform=\"translate(%.1f %.1f) rotate(-90)\" text-anchor=\"middle\">",
              left - 58, (top + bottom) / 2);
    tb_escape(b, y_label);
    lm_text_puts(b, "</text>");
    static const double at[] = {0, 0.5, 1};
    static const char *const labels[] = {"0%", "50%", "100%"};
    double bar_bottom = bottom > top + 80 ? bottom : top + 80;
    draw_colour_bar(b, accuracy_colours, 5, right + 24, top + 8, bar_bottom, at, labels, 3, "accuracy");
    lm_text_puts(b, "</svg></figure>\n");
}

/* ------------------------------------------------------------------------- */
/* the page                                                                   */

static int compare_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int compare_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void row_text(text_buf *b, const char *name, const char *value) {
    lm_text_puts(b, "<tr><th>");
    tb_escape(b, name);
    lm_text_puts(b, "</th><td>");
    tb_escape(b, value);
    lm_text_puts(b, "</td></tr>\n");
}

/* checkpoint-<step> directories of the run (complete ones: no suffix). */
static int list_checkpoints(const char *run_dir, int64_t *steps, int cap) {
    DIR *d = opendir(run_dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < cap) {
        long long st;
        char tail[8];
        if (sscanf(e->d_name, "checkpoint-%lld%7s", &st, tail) == 1) steps[n++] = st;
    }
    closedir(d);
    qsort(steps, (size_t)n, sizeof *steps, compare_i64);
    return n;
}

static const char page_style[] =
    "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#222;background:#fff;"
    "max-width:1160px;margin:24px auto;padding:0 16px}"
    "h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;"
    "padding-bottom:4px}.sub{color:#666;font-size:13px;margin:0 0 16px}"
    "table.summary{border-collapse:collapse;font-size:13px}table.summary th{text-align:left;font-weight:600;"
    "padding:3px 16px 3px 0;color:#444;vertical-align:top}table.summary td{padding:3px 0;"
    "font-variant-numeric:tabular-nums}"
    ".note{background:#fff4e5;border-left:4px solid #f0a030;padding:6px 10px;font-size:13px;margin:8px 0}"
    ".row{display:flex;flex-wrap:wrap;gap:8px 24px}figure{margin:4px 0}"
    "svg text{font-size:11px;fill:#333}svg .title{font-size:13px;font-weight:600;fill:#222}"
    "svg .axis-label{font-size:11px;fill:#555}svg .legend{font-size:11px}"
    "svg .stage-label{font-size:10px;fill:#7a3e9d}svg .cell{font-size:11px;fill:#111}"
    "svg .grid{stroke:#e6e6e6;stroke-width:1}svg .tickmark{stroke:#888}svg .frame{fill:none;stroke:#999}"
    "svg .stage{stroke:#7a3e9d;stroke-width:1.2;stroke-dasharray:5 3}"
    "svg .ref{stroke:#c00;stroke-width:1;stroke-dasharray:2 3}"
    "svg .line{fill:none;stroke-width:1.6;stroke-linejoin:round}svg .band{opacity:.18;stroke:none}";

static void render_page(text_buf *b, report *r, const lm_report_options *opt, const lm_config *cfg, int have_cfg,
                        const char *cfg_error) {
    const int full = 1120, half = 552, pts = opt->max_points > 0 ? opt->max_points : 600;
    char v[256];
    lm_text_puts(b, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
               "<meta name=\"viewport\" content=\"width=device-width\"><title>longmoe report: ");
    tb_escape(b, opt->run_dir);
    lm_text_printf(b, "</title><style>%s</style></head><body>\n<h1>Training report</h1><p class=\"sub\">run ",
              page_style);
    tb_escape(b, opt->run_dir);
    lm_text_printf(b, " \xc2\xb7 %lld records from %lld lines of metrics.jsonl</p>\n", (long long)r->sum.records,
              (long long)r->sum.lines);
    if (r->sum.malformed) {
        lm_text_printf(b, "<p class=\"note\">%lld malformed line%s skipped (line", (long long)r->sum.malformed,
                  r->sum.malformed == 1 ? "" : "s");
        for (int i = 0; i < r->n_bad_listed; i++) lm_text_printf(b, "%s %lld", i ? "," : "", (long long)r->bad_lines[i]);
        if (r->sum.malformed > r->n_bad_listed) lm_text_puts(b, ", ...");
        lm_text_puts(b, "; first: ");
        tb_escape(b, r->first_bad_reason);
        lm_text_puts(b, ").</p>\n");
    }
    if (r->moe_mismatch)
        lm_text_printf(b, "<p class=\"note\">%lld train record%s had a list of MoE layers or experts of another shape "
                  "than the first and %s left out of the expert heatmaps.</p>\n", (long long)r->moe_mismatch,
                  r->moe_mismatch == 1 ? "" : "s", r->moe_mismatch == 1 ? "was" : "were");
    if (cfg_error) {
        lm_text_puts(b, "<p class=\"note\">config.json could not be read: ");
        tb_escape(b, cfg_error);
        lm_text_puts(b, "</p>\n");
    }

    /* ---- summary ---- */
    lm_text_puts(b, "<h2>Summary</h2><table class=\"summary\">\n");
    snprintf(v, sizeof v, "%lld", (long long)r->sum.last_step);
    if (have_cfg && !r->sum.rl_records) /* an RL run counts its own steps (rl.json) */
        snprintf(v + strlen(v), sizeof v - strlen(v), " of %lld", (long long)lm_config_total_steps(cfg));
    row_text(b, "steps", v);
    if (r->loss.n) {
        snprintf(v, sizeof v, "%.4f", r->loss.y[r->loss.n - 1]);
        row_text(b, "final train loss", v);
    }
    if (r->val_loss.n) {
        size_t best = 0;
        for (size_t i = 1; i < r->val_loss.n; i++)
            if (r->val_loss.y[i] < r->val_loss.y[best]) best = i;
        snprintf(v, sizeof v, "%.4f at step %.0f", r->val_loss.y[best], r->val_loss.x[best]);
        row_text(b, "best validation loss", v);
        snprintf(v, sizeof v, "%.4f at step %.0f", r->val_loss.y[r->val_loss.n - 1], r->val_loss.x[r->val_loss.n - 1]);
        row_text(b, "final validation loss", v);
    }
    if (r->val_acc.n) {
        snprintf(v, sizeof v, "%.1f%% at step %.0f", 100 * r->val_acc.y[r->val_acc.n - 1],
                 r->val_acc.x[r->val_acc.n - 1]);
        row_text(b, "last answer accuracy", v);
    }
    if (r->tokps.n) {
        double *sorted = malloc(r->tokps.n * sizeof *sorted);
        if (sorted) {
            memcpy(sorted, r->tokps.y, r->tokps.n * sizeof *sorted);
            qsort(sorted, r->tokps.n, sizeof *sorted, compare_double);
            size_t n = r->tokps.n;
            double med = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
            snprintf(v, sizeof v, "%.0f (median of %zu steps)", med, n);
            row_text(b, "tokens / s", v);
            free(sorted);
        } else {
            r->out_of_memory = 1;
        }
    }
    if (r->mfu.n) {
        double *sorted = malloc(r->mfu.n * sizeof *sorted);
        if (sorted) {
            memcpy(sorted, r->mfu.y, r->mfu.n * sizeof *sorted);
            qsort(sorted, r->mfu.n, sizeof *sorted, compare_double);
            size_t n = r->mfu.n;
            double med = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
            snprintf(v, sizeof v, "%.2f%% of 989 TFLOP/s (median of %zu GPU steps)", 100 * med, n);
            row_text(b, "MFU", v);
            free(sorted);
        } else {
            r->out_of_memory = 1;
        }
    }
    snprintf(v, sizeof v, "%lld", (long long)r->sum.skip_records);
    row_text(b, "skipped steps (non-finite)", v);
    if (have_cfg) {
        lm_plan p;
        lm_config_plan(cfg, cfg->seq_len, &p);
        snprintf(v, sizeof v, "%.4g M stored, %.4g M active per token (from config.json)", p.total_params / 1e6,
                 p.total_active / 1e6);
        row_text(b, "parameters", v);
        int n_mla = 0, n_moe = 0;
        for (int l = 0; l < cfg->n_layers; l++) {
            n_mla += lm_config_mixer(cfg, l) == LM_MIXER_MLA;
            n_moe += lm_config_is_moe(cfg, l);
        }
        snprintf(v, sizeof v, "%d layers (%d KDA, %d MLA), d_model %d, %d MoE layers of %d experts top-%d, "
                 "seq_len %d", cfg->n_layers, cfg->n_layers - n_mla, n_mla, cfg->d_model, n_moe,
                 cfg->n_routed_experts, cfg->top_k, cfg->seq_len);
        row_text(b, "model", v);
    }
    if (r->n_stages) {
        lm_text_puts(b, "<tr><th>stages</th><td>");
        for (int i = 0; i < r->n_stages; i++) {
            const stage_mark *s = &r->stages[i];
            lm_text_printf(b, "%s%d", i ? "; " : "", s->stage);
            if (s->name[0]) {
                lm_text_puts(b, " ");
                tb_escape(b, s->name);
            }
            char len[32];
            format_length(len, sizeof len, (double)s->seq_len);
            if (s->seq_len > 0) lm_text_printf(b, " (%s tokens)", len);
            lm_text_printf(b, " from step %lld", (long long)s->step);
        }
        lm_text_puts(b, "</td></tr>\n");
    }
    int64_t ck[512];
    int n_ck = list_checkpoints(opt->run_dir, ck, 512);
    lm_text_puts(b, "<tr><th>checkpoints</th><td>");
    if (!n_ck) lm_text_puts(b, "none in the directory");
    for (int i = 0; i < n_ck; i++) lm_text_printf(b, "%scheckpoint-%08lld", i ? ", " : "", (long long)ck[i]);
    if (r->sum.checkpoint_records > n_ck)
        lm_text_printf(b, " (%lld written during the run)", (long long)r->sum.checkpoint_records);
    lm_text_puts(b, "</td></tr>\n</table>\n");

    /* ---- curves ---- */
    double x_lo = (double)r->x_lo, x_hi = (double)r->x_hi;
    if (r->loss.n || r->val_loss.n || r->lr.n) {
        lm_text_puts(b, "<h2>Loss and learning rate</h2><div class=\"row\">\n");
        chart_spec c = chart_default("Loss", "loss (nats / token)", half, 300, x_lo, x_hi, pts);
        c.log_y = opt->log_loss;
        plot_line lines[2] = {{"train", &r->loss, "#1f77b4", 0}, {"validation", &r->val_loss, "#d62728", 1}};
        render_line_chart(b, r, &c, lines, 2);
        if (r->lr.n) {
            chart_spec cl = chart_default("Learning rate", "lr (Muon)", half, 300, x_lo, x_hi, pts);
            plot_line l1 = {"lr", &r->lr, "#2ca02c", 0};
            render_line_chart(b, r, &cl, &l1, 1);
        }
        lm_text_puts(b, "</div>\n");
    }
    if (r->grad.n || r->has_max_logit || r->val_acc.n || r->tokps.n) {
        lm_text_puts(b, "<h2>Optimisation</h2><div class=\"row\">\n");
        if (r->grad.n) {
            chart_spec c = chart_default("Gradient norm (before clipping)", "global L2 norm", half, 280, x_lo, x_hi,
                                         pts);
            if (have_cfg && cfg->grad_clip > 0) {
                c.hline = cfg->grad_clip;
                c.hline_label = "clip";
            }
            plot_line l1 = {"grad norm", &r->grad, "#9467bd", 0};
            render_line_chart(b, r, &c, &l1, 1);
        }
        if (r->has_max_logit) {
            char tau[48];
            snprintf(tau, sizeof tau, "QK-Clip \xcf\x84 = %g", have_cfg ? cfg->qk_clip_tau : 0.0);
            chart_spec c = chart_default("Max attention logit", "max logit", half, 280, x_lo, x_hi, pts);
            if (have_cfg && cfg->qk_clip_tau > 0) {
                c.hline = cfg->qk_clip_tau;
                c.hline_label = tau;
            }
            plot_line l1 = {"max logit", &r->max_logit, "#8c564b", 0};
            render_line_chart(b, r, &c, &l1, 1);
        }
        if (r->val_acc.n) {
            chart_spec c = chart_default("Answer accuracy (validation)", "accuracy", half, 280, x_lo, x_hi, pts);
            c.y_lo = 0;
            c.y_hi = 1;
            plot_line l1 = {"answer accuracy", &r->val_acc, "#e377c2", 1};
            render_line_chart(b, r, &c, &l1, 1);
        }
        if (r->tokps.n) {
            chart_spec c = chart_default("Throughput", "tokens / s", half, 280, x_lo, x_hi, pts);
            plot_line l1 = {"tokens/s", &r->tokps, "#7f7f7f", 0};
            render_line_chart(b, r, &c, &l1, 1);
        }
        lm_text_puts(b, "</div>\n");
    }

    /* ---- agentic RL ---- */
    if (r->rl_reward.n || r->rl_warm_loss.n) {
        lm_text_puts(b, "<h2>Agentic RL</h2><p class=\"sub\">Per RL step: the mean reward and success of the "
                   "step's rollouts, their length in tokens, the KL to the frozen reference and the k3 estimate of "
                   "KL(\xcf\x80_old \xe2\x80\x96 \xcf\x80_\xce\xb8) after the step's last update, the sampling "
                   "policy's entropy estimate and the fraction of clipped ratios (docs/rl.md). Held-out (or "
                   "selection-split) success is greedy, on seeds never trained on.</p><div class=\"row\">\n");
        if (r->rl_eval[0].n || r->rl_eval[1].n || r->rl_eval[2].n) {
            const char *title = r->rl_eval_select ? "Selection-split success (greedy)" : "Held-out success (greedy)";
            chart_spec c = chart_default(title, "success rate", half, 280, x_lo, x_hi, pts);
            c.y_lo = 0;
            c.y_hi = 1;
            plot_line l[3] = {{"lookup", &r->rl_eval[0], "#1f77b4", 1}, {"calc", &r->rl_eval[1], "#ff7f0e", 1},
                              {"grid", &r->rl_eval[2], "#2ca02c", 1}};
            render_line_chart(b, r, &c, l, 3);
        }
        if (r->rl_reward.n) {
            chart_spec c = chart_default("Reward and success (rollouts)", "mean per trajectory", half, 280, x_lo,
                                         x_hi, pts);
            plot_line l[2] = {{"reward", &r->rl_reward, "#1f77b4", 0}, {"success", &r->rl_success, "#d62728", 0}};
            render_line_chart(b, r, &c, l, 2);
            chart_spec cl = chart_default("Trajectory length", "tokens", half, 280, x_lo, x_hi, pts);
            plot_line l1 = {"length", &r->rl_length, "#8c564b", 0};
            render_line_chart(b, r, &cl, &l1, 1);
            chart_spec ck = chart_default("KL", "nats / token", half, 280, x_lo, x_hi, pts);
            plot_line l2[2] = {{"to the reference", &r->rl_kl_ref, "#9467bd", 0},
                               {"to the sampling policy", &r->rl_kl_old, "#e377c2", 0}};
            render_line_chart(b, r, &ck, l2, 2);
            chart_spec ce = chart_default("Entropy (sampling policy)", "nats / token", half, 280, x_lo, x_hi, pts);
            plot_line l3 = {"entropy", &r->rl_entropy, "#17becf", 0};
            render_line_chart(b, r, &ce, &l3, 1);
            chart_spec cc = chart_default("Clipped fraction", "fraction of model tokens", half, 280, x_lo, x_hi, pts);
            plot_line l4 = {"clipped", &r->rl_clipped, "#7f7f7f", 0};
            render_line_chart(b, r, &cc, &l4, 1);
        }
        if (r->rl_warm_loss.n) {
            chart_spec c = chart_default("Warm start (demonstrations)", "loss on model bytes", half, 280, x_lo, x_hi,
                                         pts);
            plot_line l1 = {"warm-start loss", &r->rl_warm_loss, "#bcbd22", 0};
            render_line_chart(b, r, &c, &l1, 1);
        }
        lm_text_puts(b, "</div>\n");
    }

    /* ---- experts ---- */
    if (r->moe_started && r->moe.used > 0) {
        lm_text_printf(b, "<h2>Expert load (%d MoE layers \xc3\x97 %d experts)</h2>\n<p class=\"sub\">Each column averages "
                  "%lld step%s; colour is the expert's share of the routed tokens over the mean share (white: "
                  "balanced, blue: under-used, red: over-used, grey: no record). MaxVio_batch is the step's "
                  "max load / mean load - 1; MaxVio_global the same over the run so far.</p>\n",
                  r->moe.layers, r->moe.experts, (long long)r->moe.width, r->moe.width == 1 ? "" : "s");
        for (int l = 0; l < r->moe.layers && !b->failed; l++) {
            render_expert_heatmap(b, r, l, full);
            render_maxvio(b, r, l, full);
        }
    }

    /* ---- long-context evaluations ---- */
    if (r->passkey.present || r->mqar.present) {
        lm_text_puts(b, "<h2>Long-context evaluation</h2><div class=\"row\">\n");
        if (r->passkey.present)
            render_accuracy_grid(b, &r->passkey, "Passkey retrieval accuracy (%)", "needle depth", 1);
        if (r->mqar.present) render_accuracy_grid(b, &r->mqar, "MQAR accuracy (%)", "queries", 0);
        lm_text_puts(b, "</div>\n");
    }
    lm_text_puts(b, "</body></html>\n");
}

/* ------------------------------------------------------------------------- */

lm_report_options lm_report_options_default(const char *run_dir) {
    lm_report_options o;
    memset(&o, 0, sizeof o);
    o.run_dir = run_dir;
    o.max_points = 600;
    o.max_columns = 300;
    return o;
}

static void report_free(report *r) {
    series_free(&r->loss);
    series_free(&r->lr);
    series_free(&r->grad);
    series_free(&r->max_logit);
    series_free(&r->tokps);
    series_free(&r->mfu);
    series_free(&r->val_loss);
    series_free(&r->val_acc);
    series_free(&r->rl_reward);
    series_free(&r->rl_success);
    series_free(&r->rl_length);
    series_free(&r->rl_kl_ref);
    series_free(&r->rl_kl_old);
    series_free(&r->rl_entropy);
    series_free(&r->rl_clipped);
    series_free(&r->rl_warm_loss);
    for (int e = 0; e < 3; e++) series_free(&r->rl_eval[e]);
    free(r->stages);
    grid_free(&r->passkey);
    grid_free(&r->mqar);
    moe_free(&r->moe);
}

lm_status lm_report_write(const lm_report_options *opt, lm_report_summary *summary) {
    if (!opt || !opt->run_dir || !opt->run_dir[0]) return lm_error(LM_ERR_ARG, "report: no run directory given");
    if (opt->max_points < 0 || opt->max_points == 1 || opt->max_columns < 0 || opt->max_columns == 1)
        return lm_error(LM_ERR_ARG, "report: max_points (%d) and max_columns (%d) must be 0 (default) or >= 2",
                        opt->max_points, opt->max_columns);
    struct stat st;
    if (stat(opt->run_dir, &st) != 0)
        return lm_error(LM_ERR_IO, "run directory '%s' does not exist (%s)", opt->run_dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return lm_error(LM_ERR_ARG, "'%s' is not a directory (give the run directory)",
                                              opt->run_dir);
    size_t dn = strlen(opt->run_dir) + 32;
    char *metrics = malloc(dn), *cfg_path = malloc(dn), *out = NULL;
    report *r = calloc(1, sizeof *r);
    text_buf b = {0};
    lm_status s = LM_OK;
    if (!metrics || !cfg_path || !r) {
        s = lm_error(LM_ERR_MEMORY, "out of memory");
        goto done;
    }
    snprintf(metrics, dn, "%s/metrics.jsonl", opt->run_dir);
    snprintf(cfg_path, dn, "%s/config.json", opt->run_dir);
    if ((s = read_metrics(r, metrics, opt->max_columns > 0 ? opt->max_columns : 300))) goto done;

    lm_config cfg;
    int have_cfg = 0;
    char cfg_error[512] = "";
    if (stat(cfg_path, &st) == 0) {
        if (lm_config_load(cfg_path, &cfg) == LM_OK) have_cfg = 1;
        else snprintf(cfg_error, sizeof cfg_error, "%s", lm_last_error());
        lm_clear_error();
    }
    render_page(&b, r, opt, &cfg, have_cfg, cfg_error[0] ? cfg_error : NULL);
    if (b.failed || r->out_of_memory) {
        s = lm_error(LM_ERR_MEMORY, "out of memory drawing the report of '%s'", opt->run_dir);
        goto done;
    }
    if (!opt->out_path) {
        out = malloc(dn);
        if (!out) {
            s = lm_error(LM_ERR_MEMORY, "out of memory");
            goto done;
        }
        snprintf(out, dn, "%s/report.html", opt->run_dir);
    }
    const void *parts[1] = {b.s};
    size_t sizes[1] = {b.n};
    if ((s = lm_write_file_atomic(out ? out : opt->out_path, parts, sizes, 1))) goto done;
    r->sum.moe_layers = r->moe_started ? r->moe.layers : 0;
    r->sum.experts = r->moe_started ? r->moe.experts : 0;
    r->sum.heatmap_columns = r->moe_started ? r->moe.used : 0;
    r->sum.html_bytes = b.n;
    if (summary) *summary = r->sum;
done:
    if (r) report_free(r);
    free(r);
    free(b.s);
    free(metrics);
    free(cfg_path);
    free(out);
    return s;
}
