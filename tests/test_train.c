/* Training end to end on a micro model: resume is bit-exact, the loss falls on
 * a learnable task, non-finite steps are skipped and never reach a checkpoint,
 * checkpoints are complete safetensors files and old ones are pruned. */
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/backend.h"
#include "longmoe/data.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"

static char root[256];

static lm_config micro(void) {
    lm_config c = test_micro_config();
    c.grad_accum = 2;
    c.ckpt_every = 3;
    c.keep_checkpoints = 2;
    return c;
}

static const char *dir(const char *name) {
    static char buf[4][512];
    static int slot;
    slot = (slot + 1) % 4;
    snprintf(buf[slot], sizeof buf[slot], "%s/%s", root, name);
    return buf[slot];
}

/* The "loss" fields of the train lines of a metrics file, as text. */
static int read_losses(const char *run, char losses[][32], int max) {
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[65536];
    int n = 0;
    while (fgets(line, sizeof line, f) && n < max) {
        if (!strstr(line, "\"type\": \"train\"")) continue;
        const char *p = strstr(line, "\"loss\": ");
        if (!p) continue;
        sscanf(p + 8, "%31[^,]", losses[n++]);
    }
    fclose(f);
    return n;
}

static int same_file_tensors(const char *a, const char *b) {
    lm_safetensors *x = NULL, *y = NULL;
    if (lm_safetensors_open(a, &x) || lm_safetensors_open(b, &y)) {
        lm_safetensors_close(x);
        return 0;
    }
    int same = lm_safetensors_count(x) == lm_safetensors_count(y);
    for (int i = 0; same && i < lm_safetensors_count(x); i++) {
        const lm_st_tensor *t = lm_safetensors_at(x, i), *u = lm_safetensors_find(y, t->name);
        same = u && u->nbytes == t->nbytes && !memcmp(u->data, t->data, t->nbytes);
        if (!same) fprintf(stderr, "  tensor %s differs\n", t->name);
    }
    lm_safetensors_close(x);
    lm_safetensors_close(y);
    return same;
}

static void test_resume_is_bit_exact(void) {
    lm_config c = micro();
    lm_train_options o = lm_train_options_default(dir("straight"));
    o.progress = NULL;
    o.steps = 8;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    /* 4 steps, stop (the checkpoint at step 3 and the final one at 4), resume to 8 */
    o.out_dir = dir("resumed");
    o.stop_after = 4;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    CHECK(r.step == 4, "stopped after %lld steps", (long long)r.step);
    o.resume = 1;
    o.stop_after = 0;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    char a[16][32], b[16][32];
    int na = read_losses(dir("straight"), a, 16), nb = read_losses(dir("resumed"), b, 16);
    CHECK(na == 8 && nb == 8, "train lines: %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK(!strcmp(a[i], b[i]), "step %d: loss %s vs %s", i + 1, a[i], b[i]);
    char pa[600], pb[600];
    snprintf(pa, sizeof pa, "%s/checkpoint-00000008/model.safetensors", dir("straight"));
    snprintf(pb, sizeof pb, "%s/checkpoint-00000008/model.safetensors", dir("resumed"));
    CHECK(same_file_tensors(pa, pb), "final parameters identical");
    snprintf(pa, sizeof pa, "%s/checkpoint-00000008/trainer.safetensors", dir("straight"));
    snprintf(pb, sizeof pb, "%s/checkpoint-00000008/trainer.safetensors", dir("resumed"));
    CHECK(same_file_tensors(pa, pb), "final optimizer and balancing state identical");
    /* keep_checkpoints = 2: steps 6 and 8 remain, 3 is gone */
    struct stat sb;
    snprintf(pa, sizeof pa, "%s/checkpoint-00000003", dir("straight"));
    CHECK(stat(pa, &sb) != 0, "old checkpoint pruned");
    snprintf(pa, sizeof pa, "%s/checkpoint-00000006/config.json", dir("straight"));
    CHECK(stat(pa, &sb) == 0, "checkpoint 6 kept");
    /* Python's safetensors opens the checkpoint (when numpy and safetensors are installed) */
    if (system("python3 -c 'import safetensors.numpy, numpy' > /dev/null 2>&1") == 0) {
        char cmd[800];
        snprintf(cmd, sizeof cmd, "python3 tests/interop/check_checkpoint.py %s/checkpoint-00000008", dir("straight"));
        CHECK(system(cmd) == 0, "Python's safetensors could not read the checkpoint: %s", cmd);
    } else {
        printf("skipped: python safetensors/numpy not installed (checkpoint interop check)\n");
    }
}

static void test_loss_falls_on_the_copy_task(void) {
    lm_config c = micro();
    c.ckpt_every = 0;
    c.steps = 60;
    lm_train_options o = lm_train_options_default(dir("learn"));
    o.progress = NULL;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    char l[64][32];
    int n = read_losses(dir("learn"), l, 64);
    CHECK(n == 60, "train lines %d", n);
    double first = atof(l[0]), last = r.val_loss;
    /* from ln(256) = 5.5 at initialisation to the letters' entropy and below */
    CHECK(first > 5.0 && last < first - 1.5, "loss %.3f -> validation %.3f", first, last);
}

static void test_non_finite_step_is_skipped_and_never_saved(void) {
    const lm_fault faults[] = {LM_FAULT_LOSS, LM_FAULT_BATCH, LM_FAULT_ROUTER, LM_FAULT_GRADIENT};
    const char *names[] = {"loss", "batch", "router", "gradient"};
    for (int f = 0; f < 4; f++) {
        lm_config c = micro();
        c.ckpt_every = 1;
        c.keep_checkpoints = 5;
        char run[64];
        snprintf(run, sizeof run, "nan-%s", names[f]);
        lm_train_options o = lm_train_options_default(dir(run));
        o.progress = NULL;
        o.steps = 4;
        o.inject_fault_step = 1;
        o.inject_fault = faults[f];
        lm_train_result r;
        CHECK(!lm_train(&c, &o, &r), "%s: %s", names[f], lm_last_error());
        CHECK(r.skipped == 1 && r.step == 4, "%s: skipped %lld, steps %lld", names[f], (long long)r.skipped,
              (long long)r.step);
        char path[600];
        snprintf(path, sizeof path, "%s/metrics.jsonl", dir(run));
        FILE *fp = fopen(path, "r");
        char line[65536];
        int skips = 0;
        while (fp && fgets(line, sizeof line, fp)) skips += strstr(line, "\"type\": \"skip\"") != NULL;
        if (fp) fclose(fp);
        CHECK(skips == 1, "%s: one skip logged, got %d", names[f], skips);
        /* every checkpoint kept holds finite values only, the trainer state too */
        for (int st = 1; st <= 4; st++) {
            const char *files[2] = {"model.safetensors", "trainer.safetensors"};
            for (int k = 0; k < 2; k++) {
                snprintf(path, sizeof path, "%s/checkpoint-%08d/%s", dir(run), st, files[k]);
                lm_safetensors *sf = NULL;
                CHECK(!lm_safetensors_open(path, &sf), "%s", lm_last_error());
                for (int i = 0; sf && i < lm_safetensors_count(sf); i++) {
                    const lm_st_tensor *t = lm_safetensors_at(sf, i);
                    if (t->dtype != LM_DTYPE_F32) continue;
                    for (int64_t j = 0; j < t->numel; j++) {
                        float v;
                        memcpy(&v, (const char *)t->data + 4 * j, 4);
                        if (!isfinite(v)) {
                            CHECK(0, "%s: non-finite value in %s", path, t->name);
                            break;
                        }
                    }
                }
                lm_safetensors_close(sf);
            }
        }
    }
    /* a run whose every step is bad stops with a clear message */
    lm_config c = micro();
    lm_train_options o = lm_train_options_default(dir("nan-stop"));
    o.progress = NULL;
    o.steps = 4;
    o.max_bad_steps = 1;
    o.inject_fault_step = 0;
    lm_train_result r;
    CHECK(lm_train(&c, &o, &r) == LM_ERR_NUMERIC && strstr(lm_last_error(), "consecutive"), "%s", lm_last_error());
}

/* train.answer_loss_weight W: the first step's loss is sum_i w_i nll_i / sum_i w_i (W at the copy
 * task's answer positions, 1 elsewhere) of the initial model on the first batch, computed here apart
 * from the trainer (its data mix and initialisation rebuilt); and a weight of 1 + 2^-20 (the weighted
 * path with nearly uniform weights) trains like the plain mean, to 1e-5, with gradient accumulation. */
static void test_answer_loss_weight(void) {
    lm_config c = micro();
    c.ckpt_every = 0;
    c.grad_accum = 1;
    c.answer_loss_weight = 8.0f;
    lm_train_options o = lm_train_options_default(dir("weighted"));
    o.progress = NULL;
    o.steps = 2;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    char l[4][32];
    CHECK(read_losses(dir("weighted"), l, 4) == 2, "train lines");
    const int B = c.batch_size, T = c.seq_len;
    lm_data_mix mix;
    memset(&mix, 0, sizeof mix);
    mix.seed = c.seed ^ 0x6d69787365656421ull;
    mix.weights[0] = 1.0;
    mix.n = 1;
    CHECK(!lm_data_open(c.data, c.seed, &mix.sources[0]), "%s", lm_last_error());
    int32_t *seq = malloc((size_t)B * (T + 1) * sizeof *seq), *inp = malloc((size_t)B * T * sizeof *inp),
            *tgt = malloc((size_t)B * T * sizeof *tgt);
    uint8_t *ans = calloc((size_t)B * T, 1);
    float *logp = malloc((size_t)B * T * sizeof *logp), loss = 0;
    CHECK(!lm_data_mix_batch(&mix, 0, B, T, seq, ans), "%s", lm_last_error());
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            inp[b * T + t] = seq[b * (T + 1) + t];
            tgt[b * T + t] = seq[b * (T + 1) + t + 1];
        }
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    lm_model_init(m, c.seed);
    CHECK(!lm_model_forward(m, inp, tgt, 1, &loss) && !lm_model_token_logprobs(m, logp), "%s", lm_last_error());
    double sw = 0, swn = 0;
    int answers = 0;
    for (int i = 0; i < B * T; i++) {
        const double w = ans[i] ? c.answer_loss_weight : 1.0;
        answers += ans[i] != 0;
        sw += w;
        swn -= w * logp[i];
    }
    const double want = swn / sw, got = atof(l[0]);
    CHECK(answers > 0 && answers < B * T, "%d answer positions of %d", answers, B * T);
    CHECK(fabs(got - want) <= 1e-6 * fabs(want), "first weighted loss %.9g, computed apart %.9g", got, want);
    CHECK(fabs(want - loss) > 1e-3 * fabs(loss), "weighted %.6f and plain %.6f losses do not differ", want, loss);
    lm_model_free(m);
    lm_data_close(mix.sources[0]);
    free(seq), free(inp), free(tgt), free(ans), free(logp);

    /* nearly uniform weights through the weighted path = the plain mean */
    c = micro();
    c.ckpt_every = 0;
    lm_train_result ra, rb;
    o = lm_train_options_default(dir("plain4"));
    o.progress = NULL;
    o.steps = 4;
    CHECK(!lm_train(&c, &o, &ra), "%s", lm_last_error());
    c.answer_loss_weight = 1.0f + 1.0f / 1048576.0f;
    o.out_dir = dir("nearly4");
    CHECK(!lm_train(&c, &o, &rb), "%s", lm_last_error());
    char a[4][32], b[4][32];
    CHECK(read_losses(dir("plain4"), a, 4) == 4 && read_losses(dir("nearly4"), b, 4) == 4, "train lines");
    for (int i = 0; i < 4; i++)
        CHECK(fabs(atof(a[i]) - atof(b[i])) <= 1e-5 * fabs(atof(a[i])), "step %d: plain %s, weighted %s", i + 1, a[i],
              b[i]);
    CHECK(fabs(ra.val_loss - rb.val_loss) <= 1e-5 * fabs(ra.val_loss), "validation: plain %.7f, weighted %.7f",
          ra.val_loss, rb.val_loss);
}

static void test_resume_without_checkpoint_fails_clearly(void) {
    lm_config c = micro();
    lm_train_options o = lm_train_options_default(dir("empty"));
    o.progress = NULL;
    o.resume = 1;
    lm_train_result r;
    mkdir(dir("empty"), 0755);
    CHECK(lm_train(&c, &o, &r) == LM_ERR_IO && strstr(lm_last_error(), "no checkpoint"), "%s", lm_last_error());
}

/* A model that does not fit its backend's memory: the run fails with LM_ERR_MEMORY, naming what
 * the settings plan and what train.recompute "channel" and true would plan instead (smaller), and
 * the command that lists every buffer (the model's own hint). The backend is the CPU's with every allocation above a
 * limit refused (the activation block's size less one byte). */
static size_t alloc_limit;
static lm_status limited_alloc(lm_backend *be, size_t bytes, void **out) {
    if (bytes > alloc_limit) {
        *out = NULL;
        return lm_error(LM_ERR_MEMORY, "test backend: %zu bytes refused (limit %zu)", bytes, alloc_limit);
    }
    return lm_backend_cpu()->alloc(be, bytes, out);
}

static void test_a_model_too_large_names_the_recompute_settings_that_plan_less(void) {
    lm_config c = micro();
    c.n_layers = 4;
    strcpy(c.layout, "kmkm");
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, c.batch_size, c.seq_len, &m), "%s", lm_last_error());
    if (!m) return;
    alloc_limit = lm_model_activation_bytes(m) - 1;
    lm_model_free(m);
    lm_backend lb = *lm_backend_cpu();
    lb.alloc = limited_alloc;
    lm_train_options o = lm_train_options_default(dir("too-large"));
    o.progress = NULL;
    o.backend = &lb;
    lm_train_result r;
    const lm_status st = lm_train(&c, &o, &r);
    const char *e = lm_last_error();
    printf("    %s\n", e);
    CHECK(st == LM_ERR_MEMORY && strstr(e, "the model's plan on cpu at 2 x 40 tokens: ") &&
              strstr(e, "with these settings, with train.recompute = \"channel\" ") &&
              strstr(e, ", with train.recompute = true ") && strstr(e, "longmoe plan --memory"),
          "status %d: %s", (int)st, e);
    /* with every sublayer recomputed there is nothing smaller to name */
    c.recompute = LM_RECOMPUTE_ALL;
    lm_model *a = NULL;
    CHECK(!lm_model_create(&c, c.batch_size, c.seq_len, &a), "%s", lm_last_error());
    if (!a) return;
    alloc_limit = lm_model_activation_bytes(a) - 1;
    lm_model_free(a);
    o = lm_train_options_default(dir("too-large-all"));
    o.progress = NULL;
    o.backend = &lb;
    CHECK(lm_train(&c, &o, &r) == LM_ERR_MEMORY && strstr(lm_last_error(), "with these settings") &&
              !strstr(lm_last_error(), "with train.recompute ="),
          "recompute true: %s", lm_last_error());
}

static int count_lines(const char *run, const char *needle) {
    char path[600], line[65536];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    FILE *f = fopen(path, "r");
    int n = 0;
    while (f && fgets(line, sizeof line, f)) n += strstr(line, needle) != NULL;
    if (f) fclose(f);
    return n;
}

static lm_config staged(void) {
    lm_config c = micro();
    c.ckpt_every = 0;
    c.keep_checkpoints = 5;
    const char *json = "{\"train\": {\"stages\": ["
                       "{\"name\": \"short\", \"seq_len\": 16, \"steps\": 3, \"batch_tokens\": 64},"
                       "{\"name\": \"long\", \"seq_len\": 32, \"steps\": 4, \"batch_tokens\": 64, "
                       "\"lr_scale\": 0.5, \"data\": {\"copy\": 1}}]}}";
    if (lm_config_parse(json, strlen(json), "staged", &c)) fprintf(stderr, "%s\n", lm_last_error());
    return c;
}

static void test_stages_change_length_checkpoint_and_resume_mid_stage(void) {
    lm_config c = staged();
    lm_train_options o = lm_train_options_default(dir("staged"));
    o.progress = NULL;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    CHECK(r.step == 7, "7 steps over two stages, got %lld", (long long)r.step);
    CHECK(count_lines(dir("staged"), "\"type\": \"stage\"") == 2, "two stage records");
    CHECK(count_lines(dir("staged"), "\"type\": \"stage\", \"step\": 3") == 1, "the second stage starts at step 3");
    /* the long-context grids after each stage: lengths 16, then 16 and 32 */
    CHECK(count_lines(dir("staged"), "\"type\": \"passkey\"") == 2, "passkey grids after both stages");
    CHECK(count_lines(dir("staged"), "\"lengths\": [16, 32]") == 2, "the last grids span both lengths");
    CHECK(count_lines(dir("staged"), "\"rows\": 4}") == 4, "grids of train.grid_rows = 4 rows a cell (the default)");
    char p[600];
    struct stat sb;
    snprintf(p, sizeof p, "%s/checkpoint-00000003/model.safetensors", dir("staged"));
    CHECK(stat(p, &sb) == 0, "a checkpoint at the stage end");
    /* stop in the middle of the second stage, resume, compare */
    o.out_dir = dir("staged2");
    o.stop_after = 5;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    o.stop_after = 0;
    o.resume = 1;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    char a[16][32], b[16][32];
    int na = read_losses(dir("staged"), a, 16), nb = read_losses(dir("staged2"), b, 16);
    CHECK(na == 7 && nb == 7, "train lines: %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK(!strcmp(a[i], b[i]), "step %d: loss %s vs %s", i + 1, a[i], b[i]);
    char pa[600], pb[600];
    snprintf(pa, sizeof pa, "%s/checkpoint-00000007/model.safetensors", dir("staged"));
    snprintf(pb, sizeof pb, "%s/checkpoint-00000007/model.safetensors", dir("staged2"));
    CHECK(same_file_tensors(pa, pb), "final parameters identical");
    /* --steps cannot rewrite a staged schedule */
    o.resume = 0;
    o.out_dir = dir("staged3");
    o.steps = 10;
    CHECK(lm_train(&c, &o, &r) == LM_ERR_ARG && strstr(lm_last_error(), "train.stages"), "%s", lm_last_error());
}

/* train.grid_rows sets the rows a cell of the stage-end grids (rounded up to
 * pairs of rows); 0 evaluates none. */
static void test_grid_rows_size_the_stage_end_grids(void) {
    lm_config c = staged();
    c.grid_rows = 5;
    lm_train_options o = lm_train_options_default(dir("grid6"));
    o.progress = NULL;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    CHECK(count_lines(dir("grid6"), "\"type\": \"passkey\"") == 2 && count_lines(dir("grid6"), "\"rows\": 6}") == 4,
          "grids of 6 rows a cell after both stages");
    c.grid_rows = 0;
    o.out_dir = dir("grid0");
    CHECK(!lm_train(&c, &o, &r), "%s", lm_last_error());
    CHECK(count_lines(dir("grid0"), "\"type\": \"passkey\"") == 0 && count_lines(dir("grid0"), "\"type\": \"mqar\"") == 0,
          "train.grid_rows = 0 still evaluated grids");
    const char *bad = "{\"train\": {\"grid_rows\": -1}}";
    lm_config d = staged();
    CHECK(lm_config_parse(bad, strlen(bad), "bad", &d) == LM_ERR_ARG && strstr(lm_last_error(), "grid_rows"),
          "train.grid_rows = -1 accepted: %s", lm_last_error());
}

int main(void) {
    snprintf(root, sizeof root, "/tmp/longmoe-test-train-%ld", (long)getpid());
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", root, root);
    if (system(cmd) != 0) return 1;
    RUN(test_resume_is_bit_exact);
    RUN(test_loss_falls_on_the_copy_task);
    RUN(test_non_finite_step_is_skipped_and_never_saved);
    RUN(test_resume_without_checkpoint_fails_clearly);
    RUN(test_a_model_too_large_names_the_recompute_settings_that_plan_less);
    RUN(test_answer_loss_weight);
    RUN(test_stages_change_length_checkpoint_and_resume_mid_stage);
    RUN(test_grid_rows_size_the_stage_end_grids);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0) return 1;
    return test_summary();
}
