/* Crash safety of training: `longmoe train` killed with SIGKILL at random
 * moments (half of them while a checkpoint is being written) and resumed with
 * --resume each time ends with the same losses and the same final weights, bit
 * for bit, as an uninterrupted run; after every kill `latest` names a complete
 * checkpoint (all four files parse and agree on the step) or is absent
 * (killed before the first checkpoint), never a torn one. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "longmoe/config.h"
#include "longmoe/safetensors.h"
#include "test.h"

enum { STEPS = 40, KILLS = 16 };

static char root[256];

static const char micro_config[] =
    "{\"model\": {\"d_model\": 8, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1, \"dense_ffn\": 8},\n"
    " \"kda\": {\"heads\": 1, \"head_dim\": 8, \"chunk\": 16},\n"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 4, \"kv_lora_rank\": 4, \"qk_head_dim\": 8, \"v_head_dim\": 8},\n"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 4, \"shared_ffn\": 4, \"balance_bins\": 16},\n"
    " \"train\": {\"seq_len\": 16, \"batch_size\": 2, \"steps\": 40, \"eval_every\": 0, \"log_every\": 1000,\n"
    "           \"ckpt_every\": 1, \"keep_checkpoints\": 2}}\n";

static const char *in_root(const char *name) { return test_path(root, name); }


/* Start `longmoe train` on run directory `out` (resuming when asked); output to run.log. */
static pid_t start_train(const char *out, int resume) {
    pid_t pid = fork();
    if (pid == 0) {
        FILE *log = freopen(in_root("run.log"), "ab", stdout);
        if (log) dup2(fileno(stdout), 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        if (resume)
            execl(LONGMOE_CLI, "longmoe", "train", "--out", out, "--resume", "--quiet", (char *)NULL);
        else
            execl(LONGMOE_CLI, "longmoe", "train", "--config", in_root("micro.json"), "--out", out, "--quiet",
                  (char *)NULL);
        _exit(127);
    }
    return pid;
}

static void sleep_seconds(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* 1 when a checkpoint is being written: a checkpoint-*.tmp directory exists. */
static int writing_checkpoint(const char *run) {
    DIR *d = opendir(run);
    if (!d) return 0;
    int found = 0;
    struct dirent *e;
    while ((e = readdir(d)) && !found) found = strstr(e->d_name, ".tmp") != NULL && !strncmp(e->d_name, "checkpoint-", 11);
    closedir(d);
    return found;
}

/* The step `latest` names, after checking that its directory is complete:
 * config.json reads as a config, both safetensors files parse, trainer.json
 * parses and holds the same step as the directory name. -1 when there is no
 * `latest` yet; -2 (with a failed CHECK) when it names a torn checkpoint. */
static long long check_latest(const char *run) {
    char path[800], dir[600];
    snprintf(path, sizeof path, "%s/latest", run);
    char *text = test_slurp(path, NULL);
    if (!text) return -1;
    long long step = -1;
    char name[64] = "";
    int ok = sscanf(text, "%63s", name) == 1 && sscanf(name, "checkpoint-%lld", &step) == 1;
    CHECK(ok, "latest holds '%s'", text);
    free(text);
    if (!ok) return -2;
    snprintf(dir, sizeof dir, "%s/%s", run, name);
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        /* killed between the two renames of a re-saved step: the copy is <name>.old */
        snprintf(path, sizeof path, "%s.old", dir);
        CHECK(stat(path, &sb) == 0, "latest names %s, which is missing (and no .old copy)", name);
        snprintf(dir, sizeof dir, "%s", path);
    }
    lm_config c;
    snprintf(path, sizeof path, "%s/config.json", dir);
    ok = lm_config_load(path, &c) == LM_OK;
    CHECK(ok, "torn checkpoint: %s", lm_last_error());
    const char *st_files[2] = {"model.safetensors", "trainer.safetensors"};
    for (int i = 0; i < 2 && ok; i++) {
        lm_safetensors *st = NULL;
        snprintf(path, sizeof path, "%s/%s", dir, st_files[i]);
        ok = lm_safetensors_open(path, &st) == LM_OK;
        CHECK(ok, "torn checkpoint: %s", lm_last_error());
        lm_safetensors_close(st);
    }
    if (ok) {
        size_t n;
        snprintf(path, sizeof path, "%s/trainer.json", dir);
        char *json = test_slurp(path, &n);
        lm_json_doc *doc = NULL;
        ok = json && lm_json_parse(json, n, path, &doc) == LM_OK;
        CHECK(ok, "torn checkpoint: %s", json ? lm_last_error() : "trainer.json missing");
        const lm_json *s = ok ? lm_json_get(lm_json_root(doc), "step") : NULL;
        if (ok) CHECK(s && s->integer == step, "trainer.json of %s holds another step", name);
        lm_json_free(doc);
        free(json);
    }
    return ok ? step : -2;
}

/* The text of the "loss" fields of the train lines, in order. */
static int read_losses(const char *run, char losses[][32], int max) {
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    static char line[1 << 16];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strstr(line, "\"type\": \"train\"")) continue;
        const char *p = strstr(line, "\"loss\": ");
        if (!p || n >= max) {
            n = max + 1;
            break;
        }
        sscanf(p + 8, "%31[^,]", losses[n++]);
    }
    fclose(f);
    return n;
}


static void test_sigkill_and_resume_is_bit_identical(void) {
    FILE *f = fopen(in_root("micro.json"), "wb");
    CHECK(f != NULL, "cannot write the config");
    if (!f) return;
    fputs(micro_config, f);
    fclose(f);

    /* the uninterrupted run, timed to spread the kills over a run */
    const char *ref = in_root("ref"), *run = in_root("crash");
    double t0 = lm_time_seconds();
    int st;
    waitpid(start_train(ref, 0), &st, 0);
    double t_run = lm_time_seconds() - t0;
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the uninterrupted run failed (see %s)", in_root("run.log"));

    lm_rng r;
    lm_rng_seed(&r, 2027);
    int kills = 0, kills_writing = 0, launches = 0, done = 0;
    long long last_step = -1;
    while (!done && launches < 200) {
        long long before = check_latest(run);
        if (before == -2) break;
        pid_t pid = start_train(run, before >= 0);
        launches++;
        int status = 0;
        if (kills < KILLS) {
            /* kill at a random moment: of the step after this launch's first checkpoint
             * (computing, writing, committing, pruning), of the writing of a checkpoint,
             * or of the start (reading the checkpoint back) */
            int mode = kills % 4 == 3 ? 2 : kills % 2;
            double t_step = t_run / STEPS, give_up = lm_time_seconds() + 10 * t_run + 5;
            pid_t got;
            while ((got = waitpid(pid, &status, WNOHANG)) == 0 && lm_time_seconds() < give_up &&
                   !(mode == 0 && test_latest_step(run) > before) && !(mode == 1 && writing_checkpoint(run)) && mode != 2)
                sleep_seconds(1e-4);
            if (got == 0) {
                sleep_seconds(lm_rng_uniform(&r) * (mode == 1 ? t_step / 2 : t_step));
                got = waitpid(pid, &status, WNOHANG);
            }
            if (got == 0) {
                kills_writing += writing_checkpoint(run);
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                kills++;
            }
        } else {
            waitpid(pid, &status, 0);
        }
        if (WIFEXITED(status)) {
            CHECK(WEXITSTATUS(status) == 0, "a run exited with %d (see %s)", WEXITSTATUS(status), in_root("run.log"));
            if (WEXITSTATUS(status) != 0) break;
            done = 1;
        }
        long long after = check_latest(run);
        if (after == -2) break;
        /* the newest complete checkpoint never goes back */
        CHECK(after >= last_step, "latest went back from step %lld to %lld", last_step, after);
        last_step = after;
    }
    printf("  %d launches, %d kills (%d while a checkpoint was being written), uninterrupted run %.2f s\n",
           launches, kills, kills_writing, t_run);
    CHECK(done, "the killed run did not finish");
    CHECK(kills == KILLS, "only %d kills landed before a run finished", kills);

    static char la[STEPS + 2][32], lb[STEPS + 2][32];
    int na = read_losses(ref, la, STEPS + 1), nb = read_losses(run, lb, STEPS + 1);
    CHECK(na == STEPS && nb == STEPS, "train lines: %d uninterrupted, %d resumed; want %d each", na, nb, STEPS);
    for (int i = 0; i < na && i < nb; i++)
        CHECK(!strcmp(la[i], lb[i]), "step %d: loss %s uninterrupted, %s after kills", i + 1, la[i], lb[i]);
    char a[600], b[600];
    const char *files[3] = {"model.safetensors", "trainer.safetensors", "trainer.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(a, sizeof a, "%s/checkpoint-%08d/%s", ref, STEPS, files[i]);
        snprintf(b, sizeof b, "%s/checkpoint-%08d/%s", run, STEPS, files[i]);
        CHECK(test_same_file(a, b), "the final %s differs from the uninterrupted run's", files[i]);
    }
}

/* A crash inside the commit of a step that already had a checkpoint (a finished
 * run resumed saves its last step again): between moving the old copy aside
 * and renaming the new one into place, `latest` names a missing directory.
 * That state, made by hand, resumes from the .old copy to the same result. */
static void test_crash_between_renames_resumes_from_the_old_copy(void) {
    const char *ref = in_root("ref"), *run = in_root("crash");
    char final[600], old[700], tmp[700], path[800], a[800];
    snprintf(final, sizeof final, "%s/checkpoint-%08d", run, STEPS);
    snprintf(old, sizeof old, "%s.old", final);
    snprintf(tmp, sizeof tmp, "%s.tmp", final);
    CHECK(rename(final, old) == 0, "cannot rename %s (did the first test finish?)", final);
    /* and a torn new copy */
    mkdir(tmp, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", tmp);
    FILE *f = fopen(path, "wb");
    if (f) {
        fputs("torn", f);
        fclose(f);
    }
    CHECK(check_latest(run) == STEPS, "latest does not reach the .old copy");
    int st;
    waitpid(start_train(run, 1), &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "resuming failed (see %s)", in_root("run.log"));
    struct stat sb;
    CHECK(stat(old, &sb) != 0, "%s is left behind", old);
    CHECK(stat(tmp, &sb) != 0, "%s is left behind", tmp);
    snprintf(a, sizeof a, "%s/checkpoint-%08d/model.safetensors", ref, STEPS);
    snprintf(path, sizeof path, "%s/model.safetensors", final);
    CHECK(test_same_file(a, path), "the re-saved model differs from the uninterrupted run's");
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/longmoe-crash-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_sigkill_and_resume_is_bit_identical);
    RUN(test_crash_between_renames_resumes_from_the_old_copy);
    int rc = test_summary();
    if (rc == 0) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", root);
    } else {
        fprintf(stderr, "run directories kept in %s\n", root);
    }
    return rc;
}
