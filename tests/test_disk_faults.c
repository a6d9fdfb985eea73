/* Disk faults while saving: a write that fails (full disk, file size limit,
 * missing or non-directory parent, a directory in the way) gives an
 * LM_ERR_IO naming the file and the cause, leaves an existing file untouched
 * and no temporary file behind; a training run whose checkpoint cannot be
 * written stops with that message (exit code 1), keeps the previous checkpoint
 * and `latest` intact, and resumes from them to the same result as a run that
 * never failed. A full disk is simulated with RLIMIT_FSIZE (everywhere) and
 * with a small tmpfs (where mounting is allowed; skipped with a message
 * otherwise). */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/safetensors.h"
#include "test.h"

static char root[256];

static const char micro_config[] =
    "{\"model\": {\"d_model\": 8, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1, \"dense_ffn\": 8},\n"
    " \"kda\": {\"heads\": 1, \"head_dim\": 8, \"chunk\": 16},\n"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 4, \"kv_lora_rank\": 4, \"qk_head_dim\": 8, \"v_head_dim\": 8},\n"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 4, \"shared_ffn\": 4, \"balance_bins\": 16},\n"
    " \"train\": {\"seq_len\": 16, \"batch_size\": 2, \"steps\": 4, \"eval_every\": 0, \"log_every\": 1000,\n"
    "           \"ckpt_every\": 1, \"keep_checkpoints\": 2}}\n";

static const char *in_root(const char *name) { return test_path(root, name); }


static void spit(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}


/* Files in `dir` whose name contains ".tmp". */
static int temp_files_in(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) n += strstr(e->d_name, ".tmp") != NULL;
    closedir(d);
    return n;
}

static int file_contains(const char *path, const char *phrase) {
    char *text = test_slurp(path, NULL);
    int has = text && strstr(text, phrase);
    if (!has) fprintf(stderr, "  %s does not contain '%s'; it holds: %s\n", path, phrase, text ? text : "(nothing)");
    free(text);
    return has;
}

/* Write `n` bytes to `path` with lm_write_file_atomic; 0 or the status. */
static lm_status write_bytes(const char *path, size_t n) {
    char *buf = malloc(n ? n : 1);
    if (!buf) return LM_ERR_MEMORY;
    for (size_t i = 0; i < n; i++) buf[i] = (char)('a' + i % 26);
    const void *parts[2] = {buf, buf + n / 2};
    size_t sizes[2] = {n / 2, n - n / 2};
    lm_status s = lm_write_file_atomic(path, parts, sizes, 2);
    free(buf);
    return s;
}

/* Run the atomic writer in a child limited to `limit` bytes per file (a disk
 * that fills up); returns the child's failure count. */
static int child_write_over_limit(const char *path, size_t n, rlim_t limit) {
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGXFSZ, SIG_IGN); /* writes past the limit fail with EFBIG instead */
        struct rlimit rl = {limit, limit};
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(100);
        lm_status s = write_bytes(path, n);
        int bad = 0;
        if (s != LM_ERR_IO) bad++, fprintf(stderr, "  status %d, want LM_ERR_IO\n", (int)s);
        if (!strstr(lm_last_error(), "writing") || !strstr(lm_last_error(), path))
            bad++, fprintf(stderr, "  message: %s\n", lm_last_error());
        _exit(bad);
    }
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 99;
}

static void test_atomic_write_failures_keep_the_old_file(void) {
    const char *dir = in_root("atomic"), *target = in_root("atomic/file.bin");
    mkdir(dir, 0755);
    CHECK(write_bytes(target, 1000) == LM_OK, "%s", lm_last_error());
    /* the old content, off the heap (a forked child inherits no allocation to account for) */
    char before[1024] = "";
    char *b0 = test_slurp(target, NULL);
    if (b0) snprintf(before, sizeof before, "%s", b0);
    free(b0);

    /* a file larger than the disk allows */
    CHECK(child_write_over_limit(target, 1 << 20, 64 << 10) == 0, "over the size limit: wrong status or message");
    char *after = test_slurp(target, NULL);
    CHECK(before[0] && after && !strcmp(before, after), "the old file changed");
    free(after);
    CHECK(temp_files_in(dir) == 0, "a temporary file is left behind");

    /* the directory does not exist */
    const char *missing = in_root("atomic/no-such-dir/file.bin");
    lm_status s = write_bytes(missing, 10);
    CHECK(s == LM_ERR_IO && strstr(lm_last_error(), "cannot create") && strstr(lm_last_error(), "no-such-dir"),
          "missing directory: status %d, message %s", (int)s, lm_last_error());

    /* the parent is a regular file (unwritable even for root) */
    const char *under_file = in_root("atomic/file.bin/x");
    s = write_bytes(under_file, 10);
    CHECK(s == LM_ERR_IO && strstr(lm_last_error(), "Not a directory"),
          "parent is a file: status %d, message %s", (int)s, lm_last_error());

    /* a directory is in the way of the rename */
    const char *in_way = in_root("atomic/a-directory");
    mkdir(in_way, 0755);
    s = write_bytes(in_way, 10);
    CHECK(s == LM_ERR_IO && strstr(lm_last_error(), "renaming"), "directory in the way: status %d, message %s", (int)s,
          lm_last_error());
    CHECK(temp_files_in(dir) == 0, "a temporary file is left behind after the failed rename");
    after = test_slurp(target, NULL);
    CHECK(before[0] && after && !strcmp(before, after), "the old file changed");
    free(after);
}

/* Run `longmoe train ARGS` with stdout+stderr to log.txt, each file limited to
 * `fsize_limit` bytes (0: no limit); returns the exit code. */
static int run_train(const char *args, rlim_t fsize_limit) {
    pid_t pid = fork();
    if (pid == 0) {
        if (fsize_limit) {
            signal(SIGXFSZ, SIG_IGN);
            struct rlimit rl = {fsize_limit, fsize_limit};
            if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(100);
        }
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 %s train %s --quiet > %s 2>&1", LONGMOE_CLI, args,
                 in_root("log.txt"));
        int st = system(cmd);
        _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 99);
    }
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The files of a checkpoint, to compare before and after a failure. */
static const char *const ckpt_files[] = {"model.safetensors", "trainer.safetensors", "trainer.json", "config.json"};

/* Copy the checkpoint's files and `latest` of `run` to directory `to`. */
static void snapshot(const char *run, const char *ckpt, const char *to) {
    char a[800], b[800];
    mkdir(to, 0755);
    for (int i = 0; i < 5; i++) {
        if (i < 4) snprintf(a, sizeof a, "%s/%s/%s", run, ckpt, ckpt_files[i]);
        else snprintf(a, sizeof a, "%s/latest", run);
        snprintf(b, sizeof b, "%s/%s", to, i < 4 ? ckpt_files[i] : "latest");
        size_t n;
        char *bytes = test_slurp(a, &n);
        FILE *f = bytes ? fopen(b, "wb") : NULL;
        if (f) {
            fwrite(bytes, 1, n, f);
            fclose(f);
        }
        free(bytes);
    }
}

/* 1 when the checkpoint and `latest` of `run` hold the bytes saved in `from`
 * and both safetensors files still parse. */
static int unchanged(const char *run, const char *ckpt, const char *from) {
    char a[800], b[800];
    int same = 1;
    for (int i = 0; i < 5; i++) {
        if (i < 4) snprintf(a, sizeof a, "%s/%s/%s", run, ckpt, ckpt_files[i]);
        else snprintf(a, sizeof a, "%s/latest", run);
        snprintf(b, sizeof b, "%s/%s", from, i < 4 ? ckpt_files[i] : "latest");
        int eq = test_same_file(a, b);
        if (!eq) fprintf(stderr, "  %s changed or is missing\n", a);
        same &= eq;
        if (i < 2) {
            lm_safetensors *st = NULL;
            same &= lm_safetensors_open(a, &st) == LM_OK;
            lm_safetensors_close(st);
        }
    }
    return same;
}

static void test_failed_save_keeps_the_previous_checkpoint(void) {
    spit(in_root("micro.json"), micro_config);
    char args[1500];
    /* the run that never fails */
    snprintf(args, sizeof args, "--config %s --out %s", in_root("micro.json"), in_root("ref"));
    CHECK(run_train(args, 0) == 0, "the reference run failed");
    /* two steps, then a resume on a disk too small for the next checkpoint */
    const char *run = in_root("limited");
    snprintf(args, sizeof args, "--config %s --out %s --stop-after 2", in_root("micro.json"), run);
    CHECK(run_train(args, 0) == 0, "the first two steps failed");
    snapshot(run, "checkpoint-00000002", in_root("saved2"));
    snprintf(args, sizeof args, "--out %s --resume", run);
    int rc = run_train(args, 8 << 10);
    CHECK(rc == 1, "a save past the size limit exited with %d, want 1", rc);
    CHECK(file_contains(in_root("log.txt"), "longmoe train: error: writing"), "no clear message");
    CHECK(file_contains(in_root("log.txt"), "File too large"), "the cause is not named");
    CHECK(unchanged(run, "checkpoint-00000002", in_root("saved2")), "the previous checkpoint was touched");
    CHECK(temp_files_in(run) == 0, "the failed save left a partial checkpoint behind");
    /* with room again, the run resumes from it and ends as the run that never failed */
    CHECK(run_train(args, 0) == 0, "resuming after the failure failed");
    char a[800], b[800];
    snprintf(a, sizeof a, "%s/checkpoint-00000004/model.safetensors", in_root("ref"));
    snprintf(b, sizeof b, "%s/checkpoint-00000004/model.safetensors", run);
    CHECK(test_same_file(a, b), "the final model differs from the run that never failed");
}

static void test_full_tmpfs_keeps_the_previous_checkpoint(void) {
    /* the size of one checkpoint, from the reference run of the test above */
    size_t total = 0, n;
    char path[800];
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/checkpoint-00000004/%s", in_root("ref"), ckpt_files[i]);
        char *b = test_slurp(path, &n);
        CHECK(b != NULL, "no reference checkpoint");
        total += b ? n : 0;
        free(b);
    }
    if (!total) return;
    /* room for the run's files and one checkpoint, not two */
    size_t size = ((total * 3 / 2) / 4096 + 1) * 4096 + 4 * 4096;
    const char *mnt = in_root("tmpfs");
    mkdir(mnt, 0755);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "mount -t tmpfs -o size=%zu tmpfs %s 2>/dev/null", size, mnt);
    if (system(cmd) != 0) {
        SKIP("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); RLIMIT_FSIZE covers a full disk");
    }
    char args[1500];
    snprintf(path, sizeof path, "%s/run", mnt);
    snprintf(args, sizeof args, "--config %s --out %s", in_root("micro.json"), path);
    int rc = run_train(args, 0);
    CHECK(rc == 1, "training on a full disk exited with %d, want 1", rc);
    CHECK(file_contains(in_root("log.txt"), "No space left on device"), "the cause is not named");
    char latest[900];
    snprintf(latest, sizeof latest, "%s/latest", path);
    char *text = test_slurp(latest, NULL);
    CHECK(text && !strcmp(text, "checkpoint-00000001\n"), "latest is '%s', want checkpoint-00000001",
          text ? text : "(missing)");
    free(text);
    /* it is complete, and a resume on the still-full disk fails the same way without touching it */
    snapshot(path, "checkpoint-00000001", in_root("saved1"));
    char cfg[900];
    snprintf(cfg, sizeof cfg, "%s/checkpoint-00000001/config.json", path);
    CHECK(file_contains(cfg, "\"vocab_size\""), "config.json of the checkpoint is not complete");
    snprintf(args, sizeof args, "--out %s --resume", path);
    rc = run_train(args, 0);
    CHECK(rc == 1, "resuming on a full disk exited with %d, want 1", rc);
    CHECK(file_contains(in_root("log.txt"), "No space left on device"), "the cause is not named");
    CHECK(unchanged(path, "checkpoint-00000001", in_root("saved1")), "the previous checkpoint is not intact");
    snprintf(cmd, sizeof cmd, "umount %s", mnt);
    CHECK(system(cmd) == 0, "cannot unmount %s", mnt);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/longmoe-disk-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_atomic_write_failures_keep_the_old_file);
    RUN(test_failed_save_keeps_the_previous_checkpoint);
    RUN(test_full_tmpfs_keeps_the_previous_checkpoint);
    int rc = test_summary();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (rc == 0 && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", root);
    if (rc) fprintf(stderr, "files kept in %s\n", root);
    return rc;
}
