/* A rank that dies stops the job (docs/scaleout.md, "When a rank dies").
 *
 * `mpirun -np 2 longmoe train --comm mpi` on a micro model with a checkpoint
 * every step; once a few checkpoints exist, one rank's process is killed with
 * SIGKILL. The job must end by itself within a bounded time (no rank left
 * waiting in a collective), with a non-zero status and the launcher's line
 * naming the killed process; `latest` then names a checkpoint, and
 * `mpirun -np 2 longmoe train --resume` from it ends with the same loss lines
 * and the same checkpoint bytes as an uninterrupted 2-rank run.
 *
 * The program launches mpirun itself (built with MPI: LONGMOE_MPIEXEC); built
 * without MPI it reports its case skipped. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test.h"

enum { STEPS = 40, KILL_AFTER_STEP = 3, JOB_SECONDS = 120 };

static char root[256];

static const char micro_config[] =
    "{\"model\": {\"d_model\": 8, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1, \"dense_ffn\": 8},\n"
    " \"kda\": {\"heads\": 1, \"head_dim\": 8, \"chunk\": 16},\n"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 4, \"kv_lora_rank\": 4, \"qk_head_dim\": 8, \"v_head_dim\": 8},\n"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 4, \"shared_ffn\": 4, \"balance_bins\": 16},\n"
    " \"train\": {\"seq_len\": 16, \"batch_size\": 2, \"steps\": 40, \"eval_every\": 0, \"log_every\": 1000,\n"
    "           \"ckpt_every\": 1, \"keep_checkpoints\": 2}}\n";

static const char *in_root(const char *name) { return test_path(root, name); }

static void sleep_seconds(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

#ifdef LONGMOE_MPIEXEC
static const char *mpiexec = LONGMOE_MPIEXEC;
#else
static const char *mpiexec = NULL; /* built without MPI: the case is skipped */
#endif

/* Start `mpirun -np 2 longmoe train --comm mpi` on run directory `out` (resuming when asked), in
 * its own process group, its output to `log`. */
static pid_t start_job(const char *out, int resume, const char *log) {
    fflush(stdout); /* or the child's freopen writes this process's buffered lines a second time */
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        if (!freopen(log, "wb", stdout)) _exit(127);
        dup2(fileno(stdout), 2);
        setenv("OMP_NUM_THREADS", "1", 1);
        /* MPI's own start-up allocations outlive the program (sanitizer builds) */
        setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
        setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
        if (!mpiexec) _exit(127);
        if (resume)
            execl(mpiexec, mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "2", LONGMOE_CLI, "train",
                  "--comm", "mpi", "--out", out, "--resume", "--quiet", (char *)NULL);
        else
            execl(mpiexec, mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", "2", LONGMOE_CLI, "train",
                  "--comm", "mpi", "--config", in_root("micro.json"), "--out", out, "--quiet", (char *)NULL);
        _exit(127);
    }
    if (pid > 0) setpgid(pid, pid);
    return pid;
}

/* Wait for `pid` at most `seconds`; its wait status, or -1 when it is still running then (the
 * whole process group is killed and reaped). */
static int wait_job(pid_t pid, double seconds) {
    int st = 0;
    for (double t = 0; t < seconds; t += 0.05) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) return st;
        sleep_seconds(0.05);
    }
    kill(-pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

/* 1 when /proc/<pid>/cmdline is longmoe's binary training on run directory `run`; `rank` then holds
 * the process's OMPI_COMM_WORLD_RANK from its environment (-1 if absent). */
static int is_rank_of(const char *pid, const char *run, int *rank) {
    char path[300], buf[8192];
    snprintf(path, sizeof path, "/proc/%s/cmdline", pid);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    if (strcmp(buf, LONGMOE_CLI) != 0) return 0; /* argv[0]: mpirun's own line names the binary later */
    int has_run = 0;
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1) has_run |= !strcmp(buf + i, run);
    if (!has_run) return 0;
    *rank = -1;
    snprintf(path, sizeof path, "/proc/%s/environ", pid);
    f = fopen(path, "rb");
    if (!f) return 1;
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    for (size_t i = 0; i < n; i += strlen(buf + i) + 1)
        if (!strncmp(buf + i, "OMPI_COMM_WORLD_RANK=", 21)) *rank = atoi(buf + i + 21);
    return 1;
}

/* The pid of rank `want`'s process training on `run`, or -1. */
static pid_t find_rank(const char *run, int want) {
    DIR *d = opendir("/proc");
    if (!d) return -1;
    pid_t found = -1;
    struct dirent *e;
    while ((e = readdir(d)) && found < 0) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        int rank;
        if (is_rank_of(e->d_name, run, &rank) && rank == want) found = (pid_t)atoi(e->d_name);
    }
    closedir(d);
    return found;
}

static void test_a_killed_rank_ends_the_job_and_it_resumes_bit_exact(void) {
    char ref[600], run[600], log[600];
    snprintf(ref, sizeof ref, "%s", in_root("uninterrupted"));
    snprintf(run, sizeof run, "%s", in_root("killed"));
    /* the uninterrupted run */
    snprintf(log, sizeof log, "%s", in_root("uninterrupted.log"));
    int st = wait_job(start_job(ref, 0, log), 4 * JOB_SECONDS);
    if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        char *text = test_slurp(log, NULL);
        CHECK(0, "the uninterrupted 2-rank run failed (status %d): %s", st, text ? text : "(no output)");
        free(text);
        return;
    }
    /* the run whose rank 1 is killed once a few checkpoints exist */
    snprintf(log, sizeof log, "%s", in_root("killed.log"));
    pid_t job = start_job(run, 0, log);
    CHECK(job > 0, "fork failed");
    if (job <= 0) return;
    pid_t victim = -1;
    int early = 0;
    for (double t = 0; t < JOB_SECONDS && victim < 0; t += 0.01) {
        if (test_latest_step(run) >= KILL_AFTER_STEP) victim = find_rank(run, 1);
        if (victim < 0) {
            if (waitpid(job, &st, WNOHANG) == job) {
                early = 1;
                break;
            }
            sleep_seconds(0.01);
        }
    }
    CHECK(!early, "the job ended before rank 1 could be killed (status %d)", st);
    CHECK(early || victim > 0, "no process of rank 1 found after %d s", (int)JOB_SECONDS);
    if (early || victim <= 0) {
        if (!early) wait_job(job, 0);
        return;
    }
    long long killed_after = test_latest_step(run);
    CHECK(kill(victim, SIGKILL) == 0, "kill(%d) failed", (int)victim);
    st = wait_job(job, JOB_SECONDS);
    char *text = test_slurp(log, NULL);
    CHECK(st >= 0, "the job went on for %d s after its rank 1 was killed: a rank is left waiting", (int)JOB_SECONDS);
    CHECK(st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0, "the job exited 0 after a rank was killed");
    /* the launcher names the process that died and how */
    CHECK(text && (strstr(text, "signal 9") || strstr(text, "Killed") || strstr(text, "killed")),
          "no line says a process was killed: %s", text ? text : "(no output)");
    if (text) {
        const char *line = strstr(text, "signal 9");
        if (!line) line = strstr(text, "illed");
        if (line) {
            while (line > text && line[-1] != '\n') line--;
            const char *end = strchr(line, '\n');
            printf("    the job's last words: %.*s\n", end ? (int)(end - line) : (int)strlen(line), line);
        }
    }
    free(text);
    long long last = test_latest_step(run);
    CHECK(last >= killed_after && last < STEPS, "latest names step %lld (killed after %lld of %d)", last,
          killed_after, STEPS);
    /* resumed on 2 ranks: it ends as the uninterrupted run did, bit for bit */
    snprintf(log, sizeof log, "%s", in_root("resumed.log"));
    st = wait_job(start_job(run, 1, log), 4 * JOB_SECONDS);
    text = test_slurp(log, NULL);
    CHECK(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the resumed job failed (status %d): %s", st,
          text ? text : "(no output)");
    free(text);
    CHECK(test_latest_step(run) == STEPS, "the resumed run ended at step %lld", test_latest_step(run));
    static const char *files[] = {"model.safetensors", "trainer.safetensors", "trainer.json"};
    for (int i = 0; i < 3; i++) {
        char fa[800], fb[800];
        snprintf(fa, sizeof fa, "%s/checkpoint-%08d/%s", ref, STEPS, files[i]);
        snprintf(fb, sizeof fb, "%s/checkpoint-%08d/%s", run, STEPS, files[i]);
        CHECK(test_same_file(fa, fb), "the final %s differs from the uninterrupted run's", files[i]);
    }
    /* the last step's train line up to its timings (step, loss, lr, gradient norm) */
    char ra[700], rb[700];
    snprintf(ra, sizeof ra, "%s/metrics.jsonl", ref);
    snprintf(rb, sizeof rb, "%s/metrics.jsonl", run);
    char *a = test_slurp(ra, NULL), *b = test_slurp(rb, NULL);
    CHECK(a && b, "metrics.jsonl missing");
    if (a && b) {
        char key[32];
        snprintf(key, sizeof key, "\"step\": %d,", STEPS);
        char *la = strstr(a, key), *lb = strstr(b, key);
        CHECK(la && lb, "no train line of step %d", STEPS);
        if (la && lb) {
            char *ea = strstr(la, "\"tokens_per_s\""), *eb = strstr(lb, "\"tokens_per_s\"");
            size_t na = ea ? (size_t)(ea - la) : 0, nb = eb ? (size_t)(eb - lb) : 0;
            CHECK(na > 0 && na == nb && !memcmp(la, lb, na), "step %d's lines differ:\n%.*s\n%.*s", STEPS, (int)na,
                  la, (int)nb, lb);
        }
    }
    free(a);
    free(b);
}

int main(void) {
    if (!mpiexec) test_skip_all("built without MPI (no mpirun to start the ranks)");
    snprintf(root, sizeof root, "/tmp/longmoe_test_rank_death_%d", (int)getpid());
    mkdir(root, 0755);
    FILE *f = fopen(in_root("micro.json"), "wb");
    if (!f || fputs(micro_config, f) < 0 || fclose(f)) {
        fprintf(stderr, "cannot write %s\n", in_root("micro.json"));
        return 1;
    }
    RUN(test_a_killed_rank_ends_the_job_and_it_resumes_bit_exact);
    if (!test_failed_count) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", root);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", root);
    }
    return test_summary();
}
