/* Experiments: variants of one technique trained with the same seed, data and
 * budget, summarised in a table (include/longmoe/experiment.h). */
#define _POSIX_C_SOURCE 200809L
#include "longmoe/experiment.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "files.h"
#include "json.h"
#include "longmoe/attnres.h"
#include "longmoe/report.h"
#include "longmoe/train.h"

#define MAX_VARIANTS 12

typedef struct {
    char name[48];
    lm_config cfg;
} variant;

typedef struct {
    int steps;
    double first_loss, final_loss, worst_spike;
    double maxvio_at[4];  /* MaxVio_batch (worst layer) after 1, 5, 20 steps and the last */
    double maxvio_tail;   /* mean over the second half of the run */
    double maxvio_global; /* last interval's, worst layer */
    int dead;             /* dead experts at the last step, all layers */
} run_summary;

int lm_experiment_known(const char *name) {
    const char *names[] = {"balance", "residual", "gate", "hybrid", "context"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(name, names[i])) return 1;
    return 0;
}

static double num(const lm_json *o, const char *key) {
    const lm_json *v = lm_json_get(o, key);
    return v && v->kind == LM_JSON_NUMBER ? v->number : NAN;
}

/* Read a run's metrics.jsonl into a summary. */
static lm_status summarise(const char *run_dir, run_summary *r) {
    memset(r, 0, sizeof *r);
    for (int i = 0; i < 4; i++) r->maxvio_at[i] = NAN;
    r->maxvio_tail = r->maxvio_global = NAN;
    char path[4400], *text;
    size_t len;
    snprintf(path, sizeof path, "%s/metrics.jsonl", run_dir);
    lm_status s = lm_read_file(path, LM_TEXT_FILE_MAX, &text, &len);
    if (s) return s;
    double *vio = NULL, ema = NAN;
    int cap = 0, n = 0, saw_moe = 0;
    for (char *line = text; *line;) {
        char *nl = strchr(line, '\n');
        if (!nl) break;
        lm_json_doc *doc;
        if (lm_json_parse(line, (size_t)(nl - line), path, &doc) == LM_OK) {
            const lm_json *o = lm_json_root(doc);
            const lm_json *type = lm_json_get(o, "type");
            if (type && type->kind == LM_JSON_STRING && !strcmp(type->string, "train")) {
                double loss = num(o, "loss");
                if (n == 0) r->first_loss = loss;
                r->final_loss = loss;
                /* a spike: the loss above the moving average of the steps before it */
                if (n >= 10 && loss - ema > r->worst_spike) r->worst_spike = loss - ema;
                ema = n ? 0.9 * ema + 0.1 * loss : loss;
                double worst = 0, worst_global = 0;
                int dead = 0;
                const lm_json *moe = lm_json_get(o, "moe");
                for (const lm_json *l = moe ? moe->child : NULL; l; l = l->next) {
                    saw_moe = 1;
                    worst = fmax(worst, num(l, "maxvio_batch"));
                    worst_global = fmax(worst_global, num(l, "maxvio_global"));
                    dead += (int)num(l, "dead");
                }
                if (n == cap) {
                    cap = cap ? 2 * cap : 256;
                    double *v2 = realloc(vio, (size_t)cap * sizeof *v2);
                    if (!v2) {
                        free(vio);
                        free(text);
                        lm_json_free(doc);
                        return lm_error(LM_ERR_MEMORY, "out of memory summarising '%s'", path);
                    }
                    vio = v2;
                }
                vio[n++] = worst;
                r->maxvio_global = worst_global;
                r->dead = dead;
            }
            lm_json_free(doc);
        }
        line = nl + 1;
    }
    free(text);
    r->steps = n;
    if (n && saw_moe) {
        int at[3] = {1, 5, 20};
        for (int i = 0; i < 3; i++) r->maxvio_at[i] = n >= at[i] ? vio[at[i] - 1] : NAN;
        r->maxvio_at[3] = vio[n - 1];
        double sum = 0;
        for (int i = n / 2; i < n; i++) sum += vio[i];
        r->maxvio_tail = sum / (n - n / 2);
    }
    free(vio);
    return LM_OK;
}

/* The variants of each experiment, made from the base config. */
static int make_variants(const char *name, const lm_config *base, variant *v) {
    int n = 0;
#define ADD(label) (snprintf(v[n].name, sizeof v[n].name, "%s", label), v[n].cfg = *base, &v[n++].cfg)
    if (!strcmp(name, "balance")) {
        const int experts[2][2] = {{64, 4}, {256, 8}};
        const lm_balance_mode modes[4] = {LM_BALANCE_NONE, LM_BALANCE_AUX, LM_BALANCE_SIGN, LM_BALANCE_QUANTILE};
        const char *mode_names[4] = {"none", "aux", "sign", "quantile"};
        for (int e = 0; e < 2; e++)
            for (int m = 0; m < 4; m++) {
                char label[48];
                snprintf(label, sizeof label, "%s-n%d-k%d", mode_names[m], experts[e][0], experts[e][1]);
                lm_config *c = ADD(label);
                c->n_routed_experts = experts[e][0];
                c->top_k = experts[e][1];
                c->balance = modes[m];
            }
    } else if (!strcmp(name, "residual")) {
        ADD("standard")->residual = LM_RESIDUAL_STANDARD;
        lm_config *c = ADD("block-2");
        c->residual = LM_RESIDUAL_BLOCK_ATTNRES;
        c->attnres_block = 2;
        c = ADD("block-4");
        c->residual = LM_RESIDUAL_BLOCK_ATTNRES;
        c->attnres_block = 4;
        ADD("full")->residual = LM_RESIDUAL_FULL_ATTNRES;
    } else if (!strcmp(name, "gate")) {
        ADD("bounded")->kda_gate_softplus = 0;
        ADD("softplus")->kda_gate_softplus = 1;
    } else if (!strcmp(name, "hybrid")) {
        const char *layouts[4][2] = {{"all-kda", "kkkkkkkk"}, {"3to1", "kkkmkkkm"}, {"7to1", "kkkkkkkm"},
                                     {"all-mla", "mmmmmmmm"}};
        for (int i = 0; i < 4; i++) {
            lm_config *c = ADD(layouts[i][0]);
            c->n_layers = 8;
            strcpy(c->layout, layouts[i][1]);
        }
    } else if (!strcmp(name, "context")) {
        /* equal tokens: three stages growing 4x each vs the final length throughout */
        int64_t total = base->steps, tokens = (int64_t)base->batch_size * base->seq_len * 4;
        lm_config *c = ADD("staged");
        c->n_stages = 3;
        for (int i = 0; i < 3; i++) {
            lm_stage *st = &c->stages[i];
            memset(st, 0, sizeof *st);
            snprintf(st->name, sizeof st->name, "%d", base->seq_len << (2 * i) >> 2);
            st->seq_len = (base->seq_len << (2 * i)) >> 2;
            st->steps = i < 2 ? total / 3 : total - 2 * (total / 3);
            st->batch_tokens = tokens;
            st->lr_scale = 1.0f;
        }
        c = ADD("direct");
        c->n_stages = 1;
        memset(&c->stages[0], 0, sizeof c->stages[0]);
        snprintf(c->stages[0].name, sizeof c->stages[0].name, "direct");
        c->stages[0].seq_len = base->seq_len * 4;
        c->stages[0].steps = total;
        c->stages[0].batch_tokens = tokens;
        c->stages[0].lr_scale = 1.0f;
    }
#undef ADD
    return n;
}

lm_status lm_experiment_run(const char *name, const lm_config *base_in, int64_t steps, const char *out_dir,
                            FILE *progress) {
    if (!lm_experiment_known(name))
        return lm_error(LM_ERR_ARG, "unknown experiment '%s' (balance, residual, gate, hybrid, context)", name);
    lm_config base = *base_in;
    if (steps > 0) base.steps = steps;
    base.n_stages = 0;
    base.ckpt_every = 0;
    base.eval_every = 0;
    lm_status s = lm_ensure_dir(out_dir);
    if (s) return s;
    variant *v = calloc(MAX_VARIANTS, sizeof *v);
    if (!v) return lm_error(LM_ERR_MEMORY, "out of memory");
    int n = make_variants(name, &base, v);
    char path[4200];
    snprintf(path, sizeof path, "%s/results.jsonl", out_dir);
    FILE *jl = fopen(path, "wb");
    snprintf(path, sizeof path, "%s/results.md", out_dir);
    FILE *md = fopen(path, "wb");
    if (!jl || !md) {
        if (jl) fclose(jl);
        if (md) fclose(md);
        free(v);
        return lm_error(LM_ERR_IO, "cannot write results into '%s'", out_dir);
    }
    fprintf(md, "| variant | steps | first loss | final train loss | val loss | answer acc | s/step | kda s | "
                "MaxVio@1 | @5 | @20 | last | tail mean | global | dead | worst spike | residual history B/token |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n && !s; i++) {
        char run[4200];
        snprintf(run, sizeof run, "%s/%s", out_dir, v[i].name);
        if (progress) fprintf(progress, "== %s: variant %s (%d of %d)\n", name, v[i].name, i + 1, n);
        lm_train_options o = lm_train_options_default(run);
        o.progress = progress;
        o.val_batches = 4;
        lm_train_result r;
        if ((s = lm_train(&v[i].cfg, &o, &r))) break;
        run_summary sm;
        if ((s = summarise(run, &sm))) break;
        /* the variant's curves and expert-load heatmaps: DIR/<variant>/report.html */
        lm_report_options ro = lm_report_options_default(run);
        if ((s = lm_report_write(&ro, NULL))) break;
        /* memory of the residual history per token (the AttnRes block sources) */
        lm_attnres_config ac = {(lm_attnres_mode)v[i].cfg.residual, 2 * v[i].cfg.n_layers, v[i].cfg.attnres_block,
                                v[i].cfg.d_model, 1, v[i].cfg.norm_eps, 1, 0};
        lm_attnres_memory_plan plan;
        double hist = lm_attnres_memory(&ac, &plan) == LM_OK ? (double)plan.history : NAN;
        double sps = r.step ? r.step_seconds / (double)r.step : NAN;
        fprintf(md, "| %s | %lld | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | "
                    "%d | %.3f | %.0f |\n",
                v[i].name, (long long)r.step, sm.first_loss, sm.final_loss, r.val_loss, r.val_answer_acc, sps,
                r.component_seconds[LM_TIME_KDA], sm.maxvio_at[0], sm.maxvio_at[1], sm.maxvio_at[2], sm.maxvio_at[3],
                sm.maxvio_tail, sm.maxvio_global, sm.dead, sm.worst_spike, hist);
        fprintf(jl, "{\"experiment\": \"%s\", \"variant\": \"%s\", \"steps\": %lld, \"first_loss\": %.6g, "
                    "\"final_loss\": %.6g, \"val_loss\": %.6g, \"answer_accuracy\": %.6g, \"seconds_per_step\": %.6g, "
                    "\"kda_seconds\": %.6g, \"attention_seconds\": %.6g, \"moe_seconds\": %.6g, "
                    "\"maxvio_batch\": [%.6g, %.6g, %.6g, %.6g], \"maxvio_tail_mean\": %.6g, "
                    "\"maxvio_global\": %.6g, \"dead_experts\": %d, \"worst_spike\": %.6g, "
                    "\"residual_history_bytes_per_token\": %.0f}\n",
                name, v[i].name, (long long)r.step, sm.first_loss, sm.final_loss, r.val_loss, r.val_answer_acc, sps,
                r.component_seconds[LM_TIME_KDA], r.component_seconds[LM_TIME_ATTENTION],
                r.component_seconds[LM_TIME_MOE], sm.maxvio_at[0], sm.maxvio_at[1], sm.maxvio_at[2], sm.maxvio_at[3],
                sm.maxvio_tail, sm.maxvio_global, sm.dead, sm.worst_spike, hist);
        fflush(md);
        fflush(jl);
    }
    fclose(jl);
    fclose(md);
    free(v);
    if (!s && progress) fprintf(progress, "results: %s/results.md\n", out_dir);
    return s;
}
