/* `longmoe eval`: long-context evaluation of a checkpoint (docs/eval.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "longmoe/backend.h"
#include "longmoe/eval.h"
#include "longmoe/tasks.h"

static const char *const eval_usage =
    "usage: longmoe eval --checkpoint DIR [--tasks val,passkey,mqar] [--lengths 256,1024,4096]\n"
    "                    [--depths 0,0.25,0.5,0.75,1] [--queries 2,8,16] [--batches N] [--out FILE.jsonl]\n"
    "                    [--device cpu|cuda]\n"
    "\n"
    "Evaluates a checkpoint (DIR/model.safetensors; a run directory means its latest\n"
    "checkpoint): validation loss and loss by position bucket on the data the checkpoint\n"
    "was trained on, passkey accuracy on the grid length x needle depth, MQAR accuracy by\n"
    "length and number of queries. Accuracies are teacher-forced greedy argmax at the\n"
    "answer positions. Appends JSON lines to FILE (default: metrics.jsonl of the run\n"
    "directory, the checkpoint's parent) and prints a table.\n"
    "\n"
    "options:\n"
    "  --checkpoint DIR   checkpoint or run directory (required)\n"
    "  --tasks LIST       any of val, passkey, mqar (default: all)\n"
    "  --lengths LIST     context lengths of the passkey and MQAR grids (default 256,1024,4096)\n"
    "  --depths LIST      passkey needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)\n"
    "  --queries LIST     MQAR queries per row (default 2,8,16)\n"
    "  --pairs N          MQAR pairs per row: 0 as many as the queries (default), -1 as many as fit\n"
    "  --batches N        batches per grid cell and for the validation loss (default 2)\n"
    "  --batch-size B     rows per batch (default 4)\n"
    "  --buckets N        position buckets of the validation loss (default 8)\n"
    "  --val-data SPEC    validation data (default: the data of the checkpoint's stage)\n"
    "  --val-length T     validation length (default: the sequence length of that stage)\n"
    "  --seed S           seed of the passkey and MQAR rows\n"
    "  --out FILE         JSON lines file to append to\n"
    "  --device D         where the models run: cpu (default, the exact reference) or cuda\n"
    "                     (bf16 products: accuracies as the GPU model computes them)\n"
    "  --quiet            no table\n";

/* Split a comma-separated list into at most LM_EVAL_MAX_GRID items. */
static int split_list(const char *cmd, const char *flag, const char *text, char items[][64], int *n) {
    *n = 0;
    const char *p = text;
    for (;;) {
        const char *c = strchr(p, ',');
        size_t len = c ? (size_t)(c - p) : strlen(p);
        if (len == 0 || len >= 64) return cli_fail(cmd, "%s: empty or overlong item in '%s'", flag, text);
        if (*n == LM_EVAL_MAX_GRID) return cli_fail(cmd, "%s: at most %d items, got more in '%s'", flag,
                                                     LM_EVAL_MAX_GRID, text);
        memcpy(items[*n], p, len);
        items[(*n)++][len] = 0;
        if (!c) return 0;
        p = c + 1;
    }
}

static int parse_ints(const char *cmd, const char *flag, const char *text, long lo, long hi, int *out, int *n) {
    char items[LM_EVAL_MAX_GRID][64];
    if (split_list(cmd, flag, text, items, n)) return 1;
    for (int i = 0; i < *n; i++) {
        long v;
        if (cli_parse_int(cmd, flag, items[i], lo, hi, &v)) return 1;
        out[i] = (int)v;
    }
    return 0;
}

static int parse_depths(const char *cmd, const char *text, double *out, int *n) {
    char items[LM_EVAL_MAX_GRID][64];
    if (split_list(cmd, "--depths", text, items, n)) return 1;
    for (int i = 0; i < *n; i++) {
        if (cli_parse_double(cmd, "--depths", items[i], &out[i])) return 1;
        if (out[i] < 0 || out[i] > 1) return cli_fail(cmd, "--depths: %s is outside [0, 1]", items[i]);
    }
    return 0;
}

static int parse_tasks(const char *cmd, const char *text, int *tasks) {
    char items[LM_EVAL_MAX_GRID][64];
    int n;
    if (split_list(cmd, "--tasks", text, items, &n)) return 1;
    *tasks = 0;
    for (int i = 0; i < n; i++) {
        if (!strcmp(items[i], "val")) *tasks |= LM_EVAL_VAL;
        else if (!strcmp(items[i], "passkey")) *tasks |= LM_EVAL_PASSKEY;
        else if (!strcmp(items[i], "mqar")) *tasks |= LM_EVAL_MQAR;
        else return cli_fail(cmd, "--tasks: unknown task '%s' (known: val, passkey, mqar)", items[i]);
    }
    return 0;
}

/* The run directory of a checkpoint: its parent ("." when it has none). */
static void parent_dir(const char *path, char *out, size_t n) {
    snprintf(out, n, "%s", path);
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/') out[--len] = 0;
    char *slash = strrchr(out, '/');
    if (!slash) snprintf(out, n, ".");
    else if (slash == out) out[1] = 0;
    else *slash = 0;
}

int cmd_eval(int argc, char **argv) {
    const char *cmd = "eval", *checkpoint = NULL, *out = NULL;
    lm_eval_options opt = lm_eval_options_default();
    int quiet = 0;
    lm_device device = LM_DEVICE_CPU;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(eval_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint")) {
            if (!(checkpoint = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--tasks")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || parse_tasks(cmd, v, &opt.tasks)) return 2;
        } else if (!strcmp(a, "--lengths")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) ||
                parse_ints(cmd, a, v, 1, 1L << 24, opt.lengths, &opt.n_lengths))
                return 2;
        } else if (!strcmp(a, "--depths")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || parse_depths(cmd, v, opt.depths, &opt.n_depths)) return 2;
        } else if (!strcmp(a, "--queries")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) ||
                parse_ints(cmd, a, v, 1, LM_MQAR_MAX_PAIRS, opt.queries, &opt.n_queries))
                return 2;
        } else if (!strcmp(a, "--pairs")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, -1, LM_MQAR_MAX_PAIRS, &x)) return 2;
            opt.mqar_pairs = (int)x;
        } else if (!strcmp(a, "--batches")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 100000, &x)) return 2;
            opt.batches = (int)x;
        } else if (!strcmp(a, "--batch-size")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 4096, &x)) return 2;
            opt.batch_size = (int)x;
        } else if (!strcmp(a, "--buckets")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, LM_EVAL_MAX_BUCKETS, &x))
                return 2;
            opt.n_buckets = (int)x;
        } else if (!strcmp(a, "--val-data")) {
            if (!(opt.val_data = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--val-length")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 24, &x)) return 2;
            opt.val_length = (int)x;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 0x7fffffffL, &x)) return 2;
            opt.seed = (uint64_t)x;
        } else if (!strcmp(a, "--device")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (lm_device_from_name(v, &device)) return cli_fail(cmd, "--device must be cpu or cuda, got '%s'", v);
        } else if (!strcmp(a, "--quiet")) {
            quiet = 1;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", a);
            return 2;
        }
    }
    if (!checkpoint) {
        cli_fail(cmd, "--checkpoint DIR is required (see --help)");
        return 2;
    }
    if (lm_eval_options_check(&opt)) return cli_fail(cmd, "%s", lm_last_error());
    char ckpt[4096], path[4200];
    if (lm_eval_resolve_checkpoint(checkpoint, ckpt, sizeof ckpt)) return cli_fail(cmd, "%s", lm_last_error());
    if (!out) {
        char run[4096];
        parent_dir(ckpt, run, sizeof run);
        snprintf(path, sizeof path, "%s/metrics.jsonl", run);
        out = path;
    }
    lm_backend *be = NULL;
    if (device == LM_DEVICE_CUDA && lm_backend_cuda_create(&be)) return cli_fail(cmd, "--device cuda: %s", lm_last_error());
    opt.backend = be;
    /* evaluate first: a failed evaluation leaves the log untouched */
    lm_eval_result *r = malloc(sizeof *r);
    if (!r) {
        lm_backend_free(be);
        return cli_fail(cmd, "out of memory");
    }
    lm_status s = lm_eval_run(ckpt, &opt, r);
    lm_backend_free(be);
    if (s) {
        free(r);
        return cli_fail(cmd, "%s", lm_last_error());
    }
    FILE *f = fopen(out, "ab");
    if (!f) {
        free(r);
        return cli_fail(cmd, "cannot open '%s' for appending", out);
    }
    lm_eval_write_jsonl(r, &opt, f);
    int bad = ferror(f) | fclose(f);
    if (!quiet) {
        printf("checkpoint %s\n", ckpt);
        lm_eval_write_table(r, &opt, stdout);
        printf("results appended to %s\n", out);
    }
    free(r);
    return bad ? cli_fail(cmd, "writing '%s' failed", out) : 0;
}
