/* A hostile but realistic user: each case is one class of mistake that used
 * to lose data, hang or be accepted silently (docs/RELIABILITY.md, "Hostile
 * use"), and the property that now holds. Every CLI run has a time limit, so
 * a hang fails the case instead of the suite. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "files.h"
#include "train/checkpoint.h"
#include "longmoe/config.h"
#include "longmoe/data.h"
#include "longmoe/safetensors.h"
#include "longmoe/shards.h"
#include "longmoe/train.h"
#include "test.h"

static char root[256];

static const char micro_config[] =
    "{\"model\": {\"d_model\": 8, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1, \"dense_ffn\": 8},\n"
    " \"kda\": {\"heads\": 1, \"head_dim\": 8, \"chunk\": 16},\n"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 4, \"kv_lora_rank\": 4, \"qk_head_dim\": 8, \"v_head_dim\": 8},\n"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 4, \"shared_ffn\": 4, \"balance_bins\": 16},\n"
    " \"train\": {\"seq_len\": 16, \"batch_size\": 2, \"steps\": 4, \"eval_every\": 0, \"log_every\": 1,\n"
    "           \"ckpt_every\": 1, \"keep_checkpoints\": 2}}\n";

static void spit(const char *path, const char *bytes) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(bytes, 1, strlen(bytes), f);
    fclose(f);
}

/* A new directory root/<name> with micro.json in it; its path (static, one per name slot). */
static const char *case_dir(const char *name) {
    static char dirs[32][400];
    static int slot;
    char *d = dirs[slot++ % 32];
    snprintf(d, 400, "%s/%s", root, name);
    mkdir(d, 0755);
    char p[600];
    snprintf(p, sizeof p, "%s/micro.json", d);
    spit(p, micro_config);
    return d;
}

/* Run `longmoe ARGS` (every %s of fmt filled from the varargs) with a time
 * limit of `seconds` (then SIGKILL: exit code 137 through timeout), stdout and
 * stderr into d/out.txt and d/err.txt; the exit code. */
static int cli(const char *d, int seconds, const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 timeout -s KILL %d %s %s > '%s/out.txt' 2> '%s/err.txt'", seconds,
             LONGMOE_CLI, args, d, d);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void sh(const char *cmd) {
    if (system(cmd) != 0) fprintf(stderr, "  setup command failed: %s\n", cmd);
}

static int exists(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0;
}

/* ---- classes ---- */

/* A FIFO (or directory) where a file is read is refused at once, never waited on. */
static void test_readers_refuse_non_regular_files_without_blocking(void) {
    const char *d = case_dir("fifo");
    char args[2048];
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --quiet", d, d);
    CHECK(cli(d, 60, args) == 0, "the base run failed");
    char ck[600];
    snprintf(ck, sizeof ck, "%s/run/checkpoint-00000004/trainer.json", d);
    unlink(ck);
    CHECK(mkfifo(ck, 0644) == 0, "mkfifo: %s", strerror(errno));
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet", d);
    int code = cli(d, 20, args);
    CHECK(code == 1, "train --resume with a FIFO as trainer.json: exit %d (137: it hung)", code);
    CHECK(test_file_has(test_path(d, "err.txt"), "not a regular file"), "no message naming the FIFO");
    /* the one whole-file reader, directly */
    char *bytes = NULL;
    size_t n;
    alarm(20);
    lm_status s = lm_read_file(ck, 0, &bytes, &n);
    alarm(0);
    CHECK(s == LM_ERR_IO && strstr(lm_last_error(), "FIFO"), "lm_read_file of a FIFO: %d %s", s, lm_last_error());
    s = lm_read_file(d, 0, &bytes, &n);
    CHECK(s == LM_ERR_IO && strstr(lm_last_error(), "a directory, not a regular file"), "directory: %s",
          lm_last_error());
    int fd;
    alarm(20);
    s = lm_open_regular(ck, &fd, NULL);
    alarm(0);
    CHECK(s == LM_ERR_IO, "lm_open_regular of a FIFO accepted it");
}


/* A fresh `train --out R` into a directory that holds a run is refused and
 * leaves every byte of the run as it was. */
static void test_a_fresh_run_never_touches_an_existing_run(void) {
    const char *d = case_dir("fresh");
    char args[2048], cmd[2048];
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --quiet", d, d);
    CHECK(cli(d, 60, args) == 0, "the base run failed");
    snprintf(cmd, sizeof cmd, "cp -a '%s/run' '%s/before'", d, d);
    sh(cmd);
    int code = cli(d, 60, args);
    CHECK(code == 1, "a second fresh run into the same --out: exit %d", code);
    CHECK(test_file_has(test_path(d, "err.txt"), "already holds a run"), "no message");
    CHECK(test_file_has(test_path(d, "err.txt"), "--resume"), "the message does not name --resume");
    snprintf(cmd, sizeof cmd, "diff -r '%s/run' '%s/before' > /dev/null", d, d);
    CHECK(system(cmd) == 0, "the existing run changed");
}

/* Two trainers on one run directory: the second is refused while the first runs. */
static void test_a_second_trainer_on_one_run_is_refused(void) {
    const char *d = case_dir("lock");
    char cfg[600], run[600];
    snprintf(cfg, sizeof cfg, "%s/long.json", d);
    snprintf(run, sizeof run, "%s/run", d);
    /* the micro run with 100000 steps: far more than the test waits */
    char text[4096];
    const char *at = strstr(micro_config, "\"steps\": 4");
    snprintf(text, sizeof text, "%.*s\"steps\": 100000%s", (int)(at - micro_config), micro_config, at + 10);
    spit(cfg, text);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("OMP_NUM_THREADS", "1", 1);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        execl(LONGMOE_CLI, "longmoe", "train", "--config", cfg, "--out", run, "--quiet", (char *)NULL);
        _exit(127);
    }
    /* wait for its first checkpoint */
    char latest[700];
    snprintf(latest, sizeof latest, "%s/latest", run);
    for (int i = 0; i < 600 && !exists(latest); i++) nanosleep(&(struct timespec){0, 50000000}, NULL);
    CHECK(exists(latest), "the first trainer wrote no checkpoint");
    char args[2048];
    snprintf(args, sizeof args, "train --out %s --resume --quiet", run);
    int code = cli(d, 30, args);
    CHECK(code == 1, "a second trainer on a running run: exit %d", code);
    CHECK(test_file_has(test_path(d, "err.txt"), "in use by another trainer"), "no message");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    /* once the first is gone (its lock with it), the run resumes */
    snprintf(args, sizeof args, "train --out %s --resume --quiet --stop-after 3", run);
    code = cli(d, 60, args);
    CHECK(code == 0, "resuming after the first trainer ended: exit %d", code);
}

/* Pruning removes only real checkpoint directories of this run older than
 * the one just written: a link into another run is never followed, a newer
 * checkpoint is never removed, and `latest` always names a checkpoint. */
static void test_pruning_never_leaves_the_run_nor_removes_the_newest(void) {
    const char *d = case_dir("prune");
    char args[2048], cmd[2400], path[700];
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/other --quiet", d, d);
    CHECK(cli(d, 60, args) == 0, "the other run failed");
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --quiet --stop-after 1", d, d);
    CHECK(cli(d, 60, args) == 0, "the first step failed");
    /* checkpoint-00000000: a link to the other run's checkpoint 3 */
    snprintf(cmd, sizeof cmd, "ln -s '%s/other/checkpoint-00000003' '%s/run/checkpoint-00000000'", d, d);
    sh(cmd);
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet", d);
    CHECK(cli(d, 60, args) == 0, "the resumed run failed");
    snprintf(path, sizeof path, "%s/other/checkpoint-00000003/model.safetensors", d);
    CHECK(exists(path), "pruning deleted the other run's files through a link");
    snprintf(path, sizeof path, "%s/run/checkpoint-00000004/model.safetensors", d);
    CHECK(exists(path), "the newest checkpoint is missing");
    /* directly: a checkpoint newer than the one just written is kept, as are
     * the newest keep - 1 before it; a name with a suffix is not a checkpoint */
    const char *names[] = {"checkpoint-00000001", "checkpoint-00000002", "checkpoint-00000003",
                           "checkpoint-00000099", "checkpoint-00000001.keep"};
    char dir[600];
    snprintf(dir, sizeof dir, "%s/direct", d);
    mkdir(dir, 0755);
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        mkdir(path, 0755);
        snprintf(path, sizeof path, "%s/%s/f", dir, names[i]);
        spit(path, "x");
    }
    CHECK(lm_checkpoint_prune(dir, 3, 2) == LM_OK, "prune failed");
    int want[] = {0, 1, 1, 1, 1};
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s/f", dir, names[i]);
        CHECK(exists(path) == want[i], "%s: exists %d, want %d", names[i], exists(path), want[i]);
    }
}

/* Rewrite run/checkpoint-<step>/FILE of d: tensor `name` gets element 0 set
 * to `value` (when not NULL) and, when `transpose`, its two dimensions swapped. */
static void rewrite_tensor(const char *d, int step, const char *file, const char *name, const float *value,
                           int transpose) {
    char path[700];
    snprintf(path, sizeof path, "%s/run/checkpoint-%08d/%s", d, step, file);
    lm_safetensors *st = NULL;
    if (lm_safetensors_open(path, &st)) {
        fprintf(stderr, "  setup: %s\n", lm_last_error());
        return;
    }
    lm_st_writer *w = lm_st_writer_new();
    int n = lm_safetensors_count(st);
    void **copies = calloc((size_t)n, sizeof *copies);
    for (int i = 0; i < n; i++) {
        const lm_st_tensor *t = lm_safetensors_at(st, i);
        copies[i] = malloc(t->nbytes + 8);
        memcpy(copies[i], t->data, t->nbytes);
        int64_t shape[LM_ST_MAX_DIMS];
        memcpy(shape, t->shape, sizeof shape);
        if (!strcmp(t->name, name)) {
            if (value) memcpy(copies[i], value, 4);
            if (transpose && t->ndim == 2) shape[0] = t->shape[1], shape[1] = t->shape[0];
        }
        lm_st_writer_add(w, t->name, t->dtype, t->ndim, shape, copies[i]);
    }
    if (lm_st_writer_save(w, path)) fprintf(stderr, "  setup: %s\n", lm_last_error());
    lm_st_writer_free(w);
    for (int i = 0; i < n; i++) free(copies[i]);
    free(copies);
    lm_safetensors_close(st);
}

/* A finished 4-step micro run in d/run; 1 on success. */
static int base_run(const char *d) {
    char args[2048];
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --quiet", d, d);
    return cli(d, 60, args) == 0;
}

/* Resume d/run to 6 steps; the exit code (stderr in d/err.txt). */
static int resume(const char *d) {
    char args[2048];
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet --steps 6", d);
    return cli(d, 60, args);
}

/* Everything a resume loads is validated: a NaN or a huge value in the
 * optimizer state, a tensor of the right size in another shape, a trainer
 * state whose step disagrees with its directory: each refused, named. */
static void test_resume_validates_everything_it_loads(void) {
    const float nan = NAN, huge = 1.7e38f;
    struct {
        const char *name, *file, *tensor;
        const float *value;
        int transpose;
        const char *message;
    } cases[] = {
        {"adam-nan", "trainer.safetensors", "optim.adam_state", &nan, 0, "'optim.adam_state' holds a non-finite"},
        {"adam-huge", "trainer.safetensors", "optim.adam_state", &huge, 0, "'optim.adam_state' holds 1.7e+38"},
        {"muon-huge", "trainer.safetensors", "optim.muon_state", &huge, 0, "'optim.muon_state' holds 1.7e+38"},
        {"bias-nan", "trainer.safetensors", "layers.1.moe.bias", &nan, 0, "'layers.1.moe.bias' holds a non-finite"},
        {"embed-transposed", "model.safetensors", "embed", NULL, 1, "tensor 'embed' has shape [8,256], expected [256,8]"},
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        const char *d = case_dir(cases[i].name);
        CHECK(base_run(d), "%s: base run failed", cases[i].name);
        rewrite_tensor(d, 4, cases[i].file, cases[i].tensor, cases[i].value, cases[i].transpose);
        int code = resume(d);
        CHECK(code == 1, "%s: resume exit %d", cases[i].name, code);
        CHECK(test_file_has(test_path(d, "err.txt"), cases[i].message), "%s: message", cases[i].name);
    }
    /* trainer.json of step 3 inside checkpoint-00000004 */
    const char *d = case_dir("step-name");
    CHECK(base_run(d), "base run failed");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cp '%s/run/checkpoint-00000003/trainer.json' '%s/run/checkpoint-00000004/'", d, d);
    sh(cmd);
    CHECK(resume(d) == 1, "a trainer state of another step was accepted");
    CHECK(test_file_has(test_path(d, "err.txt"), "step 3 disagrees with its checkpoint's name 'checkpoint-00000004'"),
          "message");
}

/* A non-finite parameter never reaches a checkpoint, and the good ones stay. */
static void test_a_non_finite_parameter_is_never_checkpointed(void) {
    const char *d = case_dir("nan-param");
    char run[600];
    snprintf(run, sizeof run, "%s/run", d);
    lm_config cfg;
    lm_config_defaults(&cfg);
    if (lm_config_parse(micro_config, strlen(micro_config), "micro", &cfg)) {
        CHECK(0, "%s", lm_last_error());
        return;
    }
    lm_train_options o = lm_train_options_default(run);
    o.progress = NULL;
    o.inject_nan_param_step = 2; /* the update of the third step */
    lm_status s = lm_train(&cfg, &o, NULL);
    CHECK(s == LM_ERR_NUMERIC && strstr(lm_last_error(), "the checkpoint is not written"), "lm_train: %d %s", s,
          lm_last_error());
    char *latest = test_slurp(test_path(run, "latest"), NULL);
    CHECK(latest && !strcmp(latest, "checkpoint-00000002\n"), "latest is %s", latest ? latest : "(none)");
    free(latest);
    CHECK(exists(test_path(run, "checkpoint-00000001/model.safetensors")) &&
              exists(test_path(run, "checkpoint-00000002/model.safetensors")),
          "the good checkpoints were pruned");
    CHECK(!exists(test_path(run, "checkpoint-00000003")) && !exists(test_path(run, "checkpoint-00000003.tmp")),
          "a checkpoint of the bad step exists");
}

/* A config value that would be saved as something unreadable (a stage weight
 * of 1e39 is inf as a float) is refused where it is read, naming the key; a
 * config made in code that holds one is refused by the trainer's read-back
 * before training. Nothing is written either way. */
static void test_a_config_that_does_not_survive_saving_is_refused(void) {
    const char *d = case_dir("roundtrip");
    char cfg[600], text[4096];
    snprintf(cfg, sizeof cfg, "%s/weights.json", d);
    const char *at = strstr(micro_config, "\"ckpt_every\"");
    snprintf(text, sizeof text, "%.*s\"stages\": [{\"name\": \"a\", \"seq_len\": 16, \"steps\": 2, \"data\": "
             "{\"copy\": 1e39, \"mqar\": 1}}], %s", (int)(at - micro_config), micro_config, at);
    spit(cfg, text);
    char args[2048];
    snprintf(args, sizeof args, "train --config %s --out %s/run --quiet", cfg, d);
    int code = cli(d, 60, args);
    CHECK(code == 1, "exit %d", code);
    CHECK(test_file_has(test_path(d, "err.txt"), "train.stages[0].data: the weight of 'copy' must be a number in "
                        "(0, 1e30], got 1e+39"), "message");
    CHECK(!exists(test_path(d, "run/checkpoint-00000002")) && !exists(test_path(d, "run/config.json")),
          "a checkpoint or config was written");
    /* the second line: the trainer's read-back */
    lm_config c;
    CHECK(lm_config_parse(micro_config, strlen(micro_config), "micro", &c) == LM_OK, "%s", lm_last_error());
    c.n_stages = 1;
    memset(&c.stages[0], 0, sizeof c.stages[0]);
    snprintf(c.stages[0].name, sizeof c.stages[0].name, "a");
    c.stages[0].seq_len = 16;
    c.stages[0].steps = 2;
    c.stages[0].lr_scale = 1;
    c.stages[0].n_data = 2;
    snprintf(c.stages[0].data[0], sizeof c.stages[0].data[0], "copy");
    snprintf(c.stages[0].data[1], sizeof c.stages[0].data[1], "mqar");
    c.stages[0].weights[0] = INFINITY;
    c.stages[0].weights[1] = 1;
    char out[700];
    snprintf(out, sizeof out, "%s/run2", d);
    lm_train_options opt = lm_train_options_default(out);
    opt.progress = NULL;
    lm_train_result res;
    CHECK(lm_train(&c, &opt, &res) != LM_OK && strstr(lm_last_error(), "does not survive saving"), "read-back: %s",
          lm_last_error());
    CHECK(!exists(test_path(d, "run2/config.json")), "the read-back wrote a config");
}

/* Count the lines of `path` that contain `a` and `b`. */
static int count_lines(const char *path, const char *a, const char *b) {
    char *text = test_slurp(path, NULL);
    int n = 0;
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        n += strstr(line, a) && strstr(line, b);
        if (!nl) break;
        line = nl + 1;
    }
    free(text);
    return n;
}

/* SIGINT, SIGTERM and SIGHUP end the run at the next step boundary with a
 * checkpoint of that step and a line saying how to resume; the run resumes. */
static void test_a_signal_ends_the_run_with_a_checkpoint(void) {
    const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
    for (int k = 0; k < 3; k++) {
        char name[32];
        snprintf(name, sizeof name, "signal%d", sigs[k]);
        const char *d = case_dir(name);
        char cfg[600], run[600], out[600], text[4096];
        snprintf(cfg, sizeof cfg, "%s/long.json", d);
        snprintf(run, sizeof run, "%s/run", d);
        snprintf(out, sizeof out, "%s/train.txt", d);
        /* checkpoints only every 1000 steps: the signal's checkpoint is the only one */
        const char *at = strstr(micro_config, "\"steps\": 4");
        snprintf(text, sizeof text, "%.*s\"steps\": 100000%s", (int)(at - micro_config), micro_config, at + 10);
        char *ck = strstr(text, "\"ckpt_every\": 1,");
        memcpy(ck, "\"ckpt_every\": 0,", 16);
        spit(cfg, text);
        pid_t pid = fork();
        if (pid == 0) {
            setenv("OMP_NUM_THREADS", "1", 1);
            int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            dup2(fd, 1);
            dup2(fd, 2);
            execl(LONGMOE_CLI, "longmoe", "train", "--config", cfg, "--out", run, (char *)NULL);
            _exit(127);
        }
        /* wait until a few steps are in the log, then signal */
        const char *metrics = test_path(run, "metrics.jsonl");
        for (int i = 0; i < 600 && count_lines(metrics, "\"type\": \"train\"", "") < 3; i++)
            nanosleep(&(struct timespec){0, 20000000}, NULL);
        kill(pid, sigs[k]);
        int st = 0;
        waitpid(pid, &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 128 + sigs[k], "signal %d: status %d", sigs[k], st);
        CHECK(test_file_has(out, "--resume"), "signal %d: no line saying how to resume", sigs[k]);
        char *latest = test_slurp(test_path(run, "latest"), NULL);
        long long step = -1;
        CHECK(latest && sscanf(latest, "checkpoint-%lld", &step) == 1 && step >= 3, "signal %d: latest %s", sigs[k],
              latest ? latest : "(none)");
        free(latest);
        /* the log holds every step up to the checkpoint, once */
        char want[64];
        snprintf(want, sizeof want, "\"step\": %lld,", step);
        CHECK(count_lines(metrics, "\"type\": \"train\"", want) == 1, "signal %d: step %lld logged %d times", sigs[k],
              step, count_lines(metrics, "\"type\": \"train\"", want));
        char args[1400];
        snprintf(args, sizeof args, "train --out %s --resume --quiet --stop-after %lld", run, step + 2);
        CHECK(cli(d, 60, args) == 0, "signal %d: the resume failed", sigs[k]);
    }
}

/* Every step's metrics reach the file at once (a kill loses none), and
 * resuming a finished run adds no duplicate records. */
static void test_metrics_survive_kills_and_finished_resumes(void) {
    const char *d = case_dir("metrics");
    CHECK(base_run(d), "base run failed");
    const char *metrics = test_path(d, "run/metrics.jsonl");
    char *before = test_slurp(metrics, NULL);
    char args[1400];
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet", d);
    for (int i = 0; i < 2; i++) CHECK(cli(d, 60, args) == 0, "resume %d of the finished run failed", i);
    char *after = test_slurp(metrics, NULL);
    CHECK(before && after && !strcmp(before, after), "resuming a finished run changed its metrics:\n%s\nvs\n%s",
          before ? before : "", after ? after : "");
    free(before);
    free(after);
    /* a SIGKILL right after a step's progress line: that step is in the log */
    const char *d2 = case_dir("metrics-kill");
    char cfg[600], run[600], out[600], text[4096];
    snprintf(cfg, sizeof cfg, "%s/long.json", d2);
    snprintf(run, sizeof run, "%s/run", d2);
    snprintf(out, sizeof out, "%s/train.txt", d2);
    const char *at = strstr(micro_config, "\"steps\": 4");
    snprintf(text, sizeof text, "%.*s\"steps\": 100000%s", (int)(at - micro_config), micro_config, at + 10);
    char *ck = strstr(text, "\"ckpt_every\": 1,");
    memcpy(ck, "\"ckpt_every\": 0,", 16);
    spit(cfg, text);
    int fds[2];
    CHECK(pipe(fds) == 0, "pipe");
    pid_t pid = fork();
    if (pid == 0) {
        setenv("OMP_NUM_THREADS", "1", 1);
        close(fds[0]);
        dup2(fds[1], 1);
        execl(LONGMOE_CLI, "longmoe", "train", "--config", cfg, "--out", run, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    FILE *progress = fdopen(fds[0], "r");
    char line[1024];
    long long seen = -1;
    while (progress && fgets(line, sizeof line, progress))
        if (sscanf(line, "step %lld/", &seen) == 1 && seen >= 5) break;
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    if (progress) fclose(progress);
    char want[64];
    snprintf(want, sizeof want, "\"step\": %lld,", seen);
    CHECK(seen >= 5 && count_lines(test_path(run, "metrics.jsonl"), "\"type\": \"train\"", want) == 1,
          "step %lld was printed but is not in metrics.jsonl", seen);
}

/* The CLI makes idle OpenMP threads sleep unless the user chose otherwise
 * (spinning threads stall a run on a shared machine). */
static void test_the_cli_chooses_passive_waiting_unless_told(void) {
    const char *d = case_dir("threads");
    char args[2048];
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --steps 1", d, d);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "env -u OMP_WAIT_POLICY OMP_NUM_THREADS=2 %s %s > '%s/out.txt' 2>&1", LONGMOE_CLI, args,
             d);
    CHECK(system(cmd) == 0, "the run failed");
    CHECK(test_file_has(test_path(d, "out.txt"), "2 threads (OMP_WAIT_POLICY=passive)"), "not passive by default");
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run2 --steps 1", d, d);
    snprintf(cmd, sizeof cmd, "OMP_WAIT_POLICY=active OMP_NUM_THREADS=2 %s %s > '%s/out.txt' 2>&1", LONGMOE_CLI, args, d);
    CHECK(system(cmd) == 0, "the run failed");
    CHECK(test_file_has(test_path(d, "out.txt"), "(OMP_WAIT_POLICY=active)"), "the user's choice was not kept");
}

/* Checkpoints carry a checksum that every reader verifies: one flipped bit
 * in a weight is refused (before, it loaded as a wrong finite value); a file
 * without a checksum (another writer) is accepted as it is. */
static void test_a_flipped_bit_in_a_checkpoint_is_refused(void) {
    const char *d = case_dir("bitflip");
    CHECK(base_run(d), "base run failed");
    const char *path = test_path(d, "run/checkpoint-00000004/model.safetensors");
    size_t n;
    char *bytes = test_slurp(path, &n);
    CHECK(bytes && n > 100, "no model.safetensors");
    if (!bytes) return;
    bytes[n - 3] ^= 0x10; /* a mantissa bit of the last weight: still finite */
    FILE *f = fopen(path, "wb");
    fwrite(bytes, 1, n, f);
    fclose(f);
    CHECK(resume(d) == 1, "a flipped bit was accepted by train --resume");
    CHECK(test_file_has(test_path(d, "err.txt"), "checksum mismatch"), "message");
    char args[1400];
    snprintf(args, sizeof args, "eval --checkpoint %s/run", d);
    CHECK(cli(d, 60, args) == 1 && test_file_has(test_path(d, "err.txt"), "checksum mismatch"),
          "eval accepted a flipped bit");
    /* the checksum is of the data section: the same data hashes the same */
    lm_safetensors *st = NULL;
    bytes[n - 3] ^= 0x10;
    CHECK(lm_safetensors_parse(bytes, n, "restored", &st) == LM_OK, "%s", lm_last_error());
    CHECK(st && lm_safetensors_metadata(st, LM_ST_CHECKSUM_KEY) != NULL, "no checksum recorded");
    lm_safetensors_close(st);
    /* a file without one: accepted */
    static const char plain[] = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    unsigned char file[8 + sizeof plain - 1 + 4] = {0};
    file[0] = (unsigned char)(sizeof plain - 1);
    memcpy(file + 8, plain, sizeof plain - 1);
    CHECK(lm_safetensors_parse(file, sizeof file, "plain", &st) == LM_OK, "a file without checksum: %s",
          lm_last_error());
    lm_safetensors_close(st);
    free(bytes);
}

/* A `data prepare` killed midway leaves a directory that training refuses as
 * incomplete and that the same `data prepare` then completes. */
static void test_an_interrupted_data_prepare_is_never_taken_for_complete(void) {
    const char *d = case_dir("prepare");
    char text[700], cmd[3000], args[2400];
    snprintf(text, sizeof text, "%s/text.txt", d);
    FILE *f = fopen(text, "wb");
    for (int i = 0; i < 4000; i++) fprintf(f, "the quick brown fox %d jumps over the lazy dog\n", i);
    fclose(f);
    snprintf(args, sizeof args, "tokenizer train --input %s --vocab 300 --out %s/tok.json", text, d);
    CHECK(cli(d, 60, args) == 0, "tokenizer train failed");
    /* two tokens a shard: tens of thousands of shards, each written atomically */
    snprintf(cmd, sizeof cmd, "%s data prepare --input %s --tokenizer %s/tok.json --out %s/shards --shard-tokens 2 "
             "> /dev/null 2>&1 & pid=$!; while [ ! -e %s/shards/train_000100.bin ]; do sleep 0.01; done; "
             "kill -9 $pid; wait $pid 2>/dev/null; true", LONGMOE_CLI, text, d, d, d);
    sh(cmd);
    CHECK(!exists(test_path(d, "shards/tokenizer.json")), "the preparation finished before the kill");
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --data shards:%s/shards", d, d, d);
    int code = cli(d, 60, args);
    CHECK(code == 2 && test_file_has(test_path(d, "err.txt"), "did not finish"),
          "training accepted a partial directory: exit %d", code);
    snprintf(args, sizeof args, "data prepare --input %s --tokenizer %s/tok.json --out %s/shards --shard-tokens 100000",
             text, d, d);
    code = cli(d, 120, args);
    CHECK(code == 0, "a second data prepare of the interrupted directory: exit %d", code);
    CHECK(!exists(test_path(d, "shards/train_000100.bin")), "the partial shards were left");
    char spec[700];
    snprintf(spec, sizeof spec, "shards:%s/shards", d);
    lm_data_source *src = NULL;
    CHECK(lm_data_open(spec, 1, &src) == LM_OK, "the completed directory does not open: %s", lm_last_error());
    lm_data_close(src);
}

/* Shards replaced under a run between resumes are refused, naming the shard;
 * --accept-data-change continues on them and records the new fingerprint. */
static void write_shard(const char *d, const char *name, uint64_t seed) {
    char path[700];
    snprintf(path, sizeof path, "%s/shards/%s", d, name);
    int32_t tok[400];
    lm_rng r;
    lm_rng_seed(&r, seed);
    for (int i = 0; i < 400; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % 256);
    CHECK(lm_shard_write(path, tok, 400, 256) == LM_OK, "%s", lm_last_error());
}

static void test_shards_replaced_between_resumes_are_refused(void) {
    const char *d = case_dir("reshard");
    char args[2400], path[700];
    snprintf(path, sizeof path, "%s/shards", d);
    mkdir(path, 0755);
    write_shard(d, "train_000000.bin", 1);
    write_shard(d, "train_000001.bin", 2);
    write_shard(d, "val_000000.bin", 3);
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run --data shards:%s/shards --quiet "
             "--stop-after 2", d, d, d);
    CHECK(cli(d, 60, args) == 0, "the base run failed");
    CHECK(test_file_has(test_path(d, "run/checkpoint-00000002/trainer.json"), "train_000001.bin"),
          "trainer.json records no fingerprint of the shards");
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet --stop-after 3", d);
    CHECK(cli(d, 60, args) == 0, "an unchanged resume failed");
    /* the same size, other tokens */
    write_shard(d, "train_000001.bin", 99);
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet", d);
    int code = cli(d, 60, args);
    CHECK(code == 1 && test_file_has(test_path(d, "err.txt"), "shard 'train_000001.bin' changed"),
          "a replaced shard was accepted: exit %d", code);
    CHECK(exists(test_path(d, "run/checkpoint-00000003")) && !exists(test_path(d, "run/checkpoint-00000004")),
          "the refused resume trained");
    /* the shard restored, and a val shard added */
    write_shard(d, "train_000001.bin", 2);
    write_shard(d, "val_000001.bin", 3);
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet", d);
    code = cli(d, 60, args);
    CHECK(code == 1 && test_file_has(test_path(d, "err.txt"), "'val_000001.bin'"), "an added shard was accepted: "
          "exit %d", code);
    snprintf(args, sizeof args, "rm %s/shards/val_000001.bin", d);
    sh(args);
    /* accepted explicitly: the run goes on and records the new fingerprint */
    write_shard(d, "train_000001.bin", 99);
    snprintf(args, sizeof args, "train --out %s/run --resume --accept-data-change", d);
    code = cli(d, 60, args);
    CHECK(code == 0 && test_file_has(test_path(d, "out.txt"), "warning: data"), "--accept-data-change: exit %d",
          code);
    snprintf(args, sizeof args, "train --out %s/run --resume --quiet", d);
    CHECK(cli(d, 60, args) == 0, "the new fingerprint was not recorded");
    snprintf(args, sizeof args, "train --config %s/micro.json --out %s/run2 --accept-data-change", d, d);
    CHECK(cli(d, 60, args) == 2, "--accept-data-change without --resume was accepted");
}

int main(void) {
    if (test_make_tmpdir(root, sizeof root, "hostile")) return 1;
    RUN(test_readers_refuse_non_regular_files_without_blocking);
    RUN(test_a_fresh_run_never_touches_an_existing_run);
    RUN(test_a_second_trainer_on_one_run_is_refused);
    RUN(test_pruning_never_leaves_the_run_nor_removes_the_newest);
    RUN(test_resume_validates_everything_it_loads);
    RUN(test_a_non_finite_parameter_is_never_checkpointed);
    RUN(test_a_config_that_does_not_survive_saving_is_refused);
    RUN(test_a_signal_ends_the_run_with_a_checkpoint);
    RUN(test_metrics_survive_kills_and_finished_resumes);
    RUN(test_the_cli_chooses_passive_waiting_unless_told);
    RUN(test_a_flipped_bit_in_a_checkpoint_is_refused);
    RUN(test_an_interrupted_data_prepare_is_never_taken_for_complete);
    RUN(test_shards_replaced_between_resumes_are_refused);
    int rc = test_summary();
    if (rc == 0) test_remove_tree(root);
    else fprintf(stderr, "files kept in %s\n", root);
    return rc;
}
