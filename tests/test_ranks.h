/* What the tests of training over CPU ranks share (test_dp.c, test_zero.c,
 * test_cp_train.c, test_ep_state.c, test_ep_group.c): the world's handle and
 * this rank, the run directories under `root`, reading a run's metrics and
 * checkpoints, agreement across the ranks and the CLI. A test file includes it
 * once and sets comm, R, me and root in its main. */
#ifndef LONGMOE_TEST_RANKS_H
#define LONGMOE_TEST_RANKS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/comm.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "test.h"

static lm_comm *comm;      /* the world (NULL alone) */
static int R = 1, me = 0;  /* its size and this rank */
static char root[256];     /* the runs' parent directory */

/* The ranks of `mpirun -np N <test> --mpi N`: opens the MPI engine (built without it every case
 * is skipped), sets comm, R and me, silences the other ranks' stdout (one rank prints the cases;
 * every rank prints failures) and makes the job's directory root, rank 0's
 * /tmp/longmoe_test_<tag><R>_<pid>. 0, or the exit status when the ranks cannot start as asked. */
static inline int ranks_open(int want_ranks, const char *tag) {
    if (!lm_comm_engine_available(LM_COMM_MPI)) {
        test_skip_all("built without MPI (the MPI engine is not compiled)");
        return 0;
    }
    if (lm_comm_open(LM_COMM_MPI, &comm)) {
        fprintf(stderr, "cannot open MPI: %s\n", lm_last_error());
        return 1;
    }
    R = lm_comm_size(comm);
    me = lm_comm_rank(comm);
    if (me && !freopen("/dev/null", "w", stdout)) fprintf(stderr, "rank %d: cannot silence stdout\n", me);
    if (R != want_ranks) {
        fprintf(stderr, "started on %d ranks, expected %d\n", R, want_ranks);
        lm_comm_close(comm);
        comm = NULL;
        return 1;
    }
    if (me == 0) {
        snprintf(root, sizeof root, "/tmp/longmoe_test_%s%d_%d", tag, R, (int)getpid());
        mkdir(root, 0755);
    }
    lm_comm_broadcast(comm, root, sizeof root, 0);
    return 0;
}

/* The job's end: every rank's failures summed into this one's count (a failure on any rank fails
 * the job's summary), root removed by rank 0 when none failed, the engine closed. */
static inline void ranks_close(void) {
    if (!comm) return;
    int32_t failed = test_failed_count, total = 0;
    if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
    if (me == 0 && !total) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", root);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", root);
    }
    lm_comm_close(comm);
    comm = NULL;
}

/* root/name (eight results may be in use at once) */
static inline const char *dir(const char *name) {
    static char buf[8][512];
    static int slot;
    slot = (slot + 1) % 8;
    snprintf(buf[slot], sizeof buf[slot], "%s/%s", root, name);
    return buf[slot];
}

/* The numbers of key `key` of the lines of `type` in a run's metrics. */
static inline int read_metric(const char *run, const char *type, const char *key, double *v, int max) {
    char path[600], line[65536], want[64], k[64];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir(run));
    snprintf(want, sizeof want, "\"type\": \"%s\"", type);
    snprintf(k, sizeof k, "\"%s\": ", key);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int n = 0;
    while (fgets(line, sizeof line, f) && n < max) {
        if (!strstr(line, want)) continue;
        const char *p = strstr(line, k);
        if (p) v[n++] = atof(p + strlen(k));
    }
    fclose(f);
    return n;
}

/* The training losses of runs a and b: `lines` lines each, within rtol
 * relative (rtol 0: equal bits); returns the worst relative difference. */
static inline double losses_close(const char *a, const char *b, int lines, double rtol) {
    double x[32], y[32], worst = 0;
    int na = read_metric(a, "train", "loss", x, 32), nb = read_metric(b, "train", "loss", y, 32);
    CHECK(na == lines && nb == lines, "%s, %s: train lines %d and %d, expected %d", a, b, na, nb, lines);
    for (int i = 0; i < na && i < nb; i++) {
        if (rtol == 0) CHECK(x[i] == y[i], "%s vs %s, step %d: loss %.9g vs %.9g", a, b, i + 1, x[i], y[i]);
        else CHECK_CLOSE(x[i], y[i], 0, rtol, "loss");
        worst = fmax(worst, fabs(x[i] - y[i]) / fabs(y[i]));
    }
    return worst;
}

/* Every tensor of file `file` of checkpoint `step` of runs a and b: max |a - b|
 * <= rtol max |b| per tensor; rtol 0: the bytes of every tensor equal. */
static inline int tensors_close(const char *a, const char *b, int step, const char *file, double rtol, double *worst) {
    char pa[700], pb[700];
    snprintf(pa, sizeof pa, "%s/checkpoint-%08d/%s", dir(a), step, file);
    snprintf(pb, sizeof pb, "%s/checkpoint-%08d/%s", dir(b), step, file);
    lm_safetensors *x = NULL, *y = NULL;
    if (lm_safetensors_open(pa, &x) || lm_safetensors_open(pb, &y)) {
        fprintf(stderr, "  %s\n", lm_last_error());
        lm_safetensors_close(x);
        return 0;
    }
    int ok = lm_safetensors_count(x) == lm_safetensors_count(y), bad = 0;
    *worst = 0;
    for (int i = 0; ok && i < lm_safetensors_count(x); i++) {
        const lm_st_tensor *t = lm_safetensors_at(x, i), *u = lm_safetensors_find(y, t->name);
        if (!u || u->nbytes != t->nbytes || u->dtype != t->dtype || u->ndim != t->ndim) {
            fprintf(stderr, "  %s: tensor %s is missing or of another size, shape or type\n", file, t->name);
            ok = 0;
            break;
        }
        if (rtol == 0) {
            if (memcmp(t->data, u->data, t->nbytes)) {
                fprintf(stderr, "  %s: tensor %s differs\n", file, t->name);
                ok = 0;
            }
            continue;
        }
        if (t->dtype != LM_DTYPE_F32) continue;
        const float *p = (const float *)t->data, *q = (const float *)u->data;
        double diff = 0, scale = 0;
        for (int64_t e = 0; e < t->numel; e++) {
            double d = fabs((double)p[e] - q[e]);
            diff = d > diff || isnan(d) ? d : diff;
            scale = fabs(q[e]) > scale ? fabs(q[e]) : scale;
        }
        double rel = scale > 0 ? diff / scale : diff;
        if (!(rel <= rtol)) {
            fprintf(stderr, "  %s: tensor %s differs by %.3g relative (max |x| %.3g)\n", file, t->name, rel, scale);
            bad = 1;
        }
        *worst = rel > *worst ? rel : *worst;
    }
    ok &= !bad;
    lm_safetensors_close(x);
    lm_safetensors_close(y);
    return ok;
}

/* The files of checkpoint `step` of runs a and b hold the same bytes:
 * model.safetensors, trainer.safetensors, trainer.json and, unless
 * with_config is 0 (runs whose configs differ in a setting that changes no
 * bit, such as train.grad_bucket_mb), config.json. */
static inline int same_checkpoint_bytes(const char *a, const char *b, int step, int with_config) {
    static const char *const files[] = {"model.safetensors", "trainer.safetensors", "trainer.json", "config.json"};
    int ok = 1;
    for (int i = 0; i < (with_config ? 4 : 3); i++) {
        char pa[700], pb[700];
        snprintf(pa, sizeof pa, "%s/checkpoint-%08d/%s", dir(a), step, files[i]);
        snprintf(pb, sizeof pb, "%s/checkpoint-%08d/%s", dir(b), step, files[i]);
        if (!test_same_file(pa, pb)) {
            fprintf(stderr, "  %s of step %d: %s and %s differ (or one is missing)\n", files[i], step, a, b);
            ok = 0;
        }
    }
    return ok;
}

/* Every file of checkpoint `step` of runs a and b holds the same bytes. */
static inline int same_checkpoint_files(const char *a, const char *b, int step) {
    return same_checkpoint_bytes(a, b, step, 1);
}

/* Copy run `from` to `to` with `latest` naming its checkpoint of `step`: a
 * run to resume from that checkpoint (rank 0; the others wait). */
static inline void copy_run_at(const char *from, const char *to, int step) {
    if (me == 0) {
        char cmd[1600], path[700];
        snprintf(cmd, sizeof cmd, "rm -rf %s && cp -r %s %s && rm -f %s/lock", dir(to), dir(from), dir(to), dir(to));
        CHECK(system(cmd) == 0, "%s", cmd);
        snprintf(path, sizeof path, "%s/latest", dir(to));
        FILE *f = fopen(path, "w");
        CHECK(f != NULL, "cannot write %s", path);
        if (f) {
            fprintf(f, "checkpoint-%08d\n", step);
            fclose(f);
        }
    }
    if (comm) lm_comm_barrier(comm);
}

/* The same 64-bit value on every rank. */
static inline int same_on_every_rank(uint64_t v) {
    uint64_t all[64];
    if (R > 64 || lm_comm_all_gather(comm, &v, all, sizeof v)) return 0;
    for (int r = 1; r < R; r++)
        if (all[r] != all[0]) return 0;
    return 1;
}

/* Every rank passed so far (failures on any rank count). */
static inline int all_ok(void) {
    int32_t bad = test_current_failures, any = 0;
    if (lm_comm_all_reduce_sum(comm, &bad, &any, 1, LM_DTYPE_I32)) return 0;
    return any == 0;
}

/* The largest |b| of the MoE balancing biases in a run's checkpoint (rank 0). */
static inline double largest_bias(const char *run, int step) {
    char p[700];
    snprintf(p, sizeof p, "%s/checkpoint-%08d/trainer.safetensors", dir(run), step);
    lm_safetensors *st;
    if (lm_safetensors_open(p, &st)) return -1;
    double mx = 0;
    for (int i = 0; i < lm_safetensors_count(st); i++) {
        const lm_st_tensor *t = lm_safetensors_at(st, i);
        if (!strstr(t->name, ".moe.bias")) continue;
        for (int64_t e = 0; e < t->numel; e++) {
            double v = fabs(((const float *)t->data)[e]);
            mx = v > mx ? v : mx;
        }
    }
    lm_safetensors_close(st);
    return mx;
}

/* The routed experts' parameters (layers.L.moe.gate, .up, .down) of a model of config c. */
static inline size_t expert_floats(lm_config c) {
    lm_model *m;
    if (lm_model_create(&c, 1, c.seq_len, &m)) return 0;
    size_t n = 0;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        const char *d = strstr(t->name, ".moe.");
        if (d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down"))) n += t->numel;
    }
    lm_model_free(m);
    return n;
}

/* Every parameter of a model of config c (one process's gradient block). */
static inline size_t param_floats(lm_config c) {
    lm_model *m;
    if (lm_model_create(&c, 1, c.seq_len, &m)) return 0;
    size_t n = lm_model_num_params(m);
    lm_model_free(m);
    return n;
}

/* The largest routed experts' tensor of a model of config c (*largest) and
 * the most bytes of one MoE layer's routed experts (*layer). */
static inline void expert_tensor_bytes(lm_config c, size_t *largest, size_t *layer) {
    *largest = *layer = 0;
    lm_model *m;
    if (lm_model_create(&c, 1, c.seq_len, &m)) return;
    size_t sum = 0;
    int last = -1;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        const char *d = strstr(t->name, ".moe.");
        int l;
        if (!d || (strcmp(d, ".moe.gate") && strcmp(d, ".moe.up") && strcmp(d, ".moe.down")) ||
            sscanf(t->name, "layers.%d.", &l) != 1)
            continue;
        const size_t b = t->numel * sizeof(float);
        *largest = b > *largest ? b : *largest;
        sum = l == last ? sum + b : b;
        last = l;
        *layer = sum > *layer ? sum : *layer;
    }
    lm_model_free(m);
}

/* What a checkpoint write held beyond a rank's own state
 * (lm_train_result.ckpt_gathered_bytes) with the experts cut `ways` ways
 * (owner-only): rank 0 the largest routed experts' tensor, which it receives
 * from the owners one at a time, no more than one MoE layer's experts; the
 * other ranks nothing; the replicated layout (`replicated`) nothing. */
static inline void check_checkpoint_buffer(const lm_train_result *owner_only, const lm_train_result *replicated,
                                           lm_config c, int ways) {
    size_t largest, layer;
    expert_tensor_bytes(c, &largest, &layer);
    CHECK(largest > 0 && layer > largest, "no MoE layer of several expert tensors");
    const size_t want = me == 0 && ways > 1 ? largest : 0;
    CHECK(owner_only->ckpt_gathered_bytes == want, "rank %d held %zu bytes for the checkpoints, expected %zu", me,
          owner_only->ckpt_gathered_bytes, want);
    CHECK(owner_only->ckpt_gathered_bytes <= layer, "rank %d held %zu bytes for a checkpoint, one MoE layer's "
          "experts are %zu", me, owner_only->ckpt_gathered_bytes, layer);
    CHECK(replicated->ckpt_gathered_bytes == 0, "the replicated layout held %zu bytes for a checkpoint",
          replicated->ckpt_gathered_bytes);
    printf("     a checkpoint held %zu bytes at most beyond a rank's own (one expert tensor; a MoE layer's "
           "experts %zu)\n", owner_only->ckpt_gathered_bytes, layer);
}

/* A run whose rank `victim` moves one element it holds of tensor `tensor` by
 * an ulp after step 4's update (lm_train_options.inject_diverge_step), just
 * before the hash check of step 4's checkpoint (moved earlier, a later update
 * can round both replicas to the same value again, depending on the build's
 * floating-point contraction): the check refuses it on every rank, naming the
 * rank, and the checkpoint is not written. `o` is the run's options (stopping
 * after 4 steps is set here). */
static inline void check_diverged_replica_refused(lm_config c, lm_train_options o, int victim, const char *tensor) {
    o.stop_after = 4;
    o.inject_diverge_step = 3; /* 0-based: the fourth step's update */
    o.inject_diverge_rank = victim;
    o.inject_diverge_tensor = tensor;
    lm_train_result r;
    memset(&r, 0, sizeof r);
    char want[160];
    snprintf(want, sizeof want, "rank %d's parameters or optimizer state differs from rank 0's", victim);
    const lm_status s = lm_train(&c, &o, &r);
    CHECK(s == LM_ERR_NUMERIC && strstr(lm_last_error(), want) && strstr(lm_last_error(), "no checkpoint written"),
          "rank %d moved in %s: lm_train gave %d: %s", victim, tensor, s, s ? lm_last_error() : "no error");
    if (me == 0) {
        char p[700];
        snprintf(p, sizeof p, "%s/checkpoint-00000004", o.out_dir);
        CHECK(access(p, F_OK) != 0, "the checkpoint of the diverged step was written");
    }
    printf("     rank %d's %s moved by an ulp: %s\n", victim, tensor, s ? lm_last_error() : "accepted");
}

/* A rank's share of a block under expert parallelism (`what`: "gradients" or
 * "parameters"): the replicated layout keeps one process's `whole` bytes
 * (`replicated`), an owner-only rank `got` = the replicated tensors plus 1/ways of
 * the experts' `experts` bytes. */
static inline void check_expert_share(const char *what, size_t replicated, size_t got, size_t whole, size_t experts,
                                      int ways) {
    CHECK(experts > 0 && whole > experts, "no expert tensors");
    CHECK(replicated == whole, "the replicated layout holds %zu bytes of %s, one process %zu", replicated, what, whole);
    const size_t want = whole - experts + experts / (size_t)ways;
    CHECK(got == want, "rank %d holds %zu bytes of %s, expected %zu (%zu whole, experts %zu)", me, got, what, want,
          whole, experts);
    printf("     %s a rank: %zu bytes instead of %zu (experts' %zu split %d ways)\n", what, got, whole, experts, ways);
}

/* The most bytes of parameter and gradient blocks a rank's model held at once
 * (lm_train_result.block_peak_bytes): under owner-only expert state (`own`,
 * experts split `ways` ways) its two kept blocks, the replicated tensors and
 * its own experts' slices, from the model's creation on; the replicated
 * layout (`rep`) the whole model's two blocks. */
static inline void check_created_share(const lm_train_result *own, const lm_train_result *rep, lm_config c, int ways) {
    const size_t whole = param_floats(c) * sizeof(float), experts = expert_floats(c) * sizeof(float);
    const size_t share = whole - experts + experts / (size_t)ways;
    CHECK(experts > 0 && whole > experts, "no expert tensors");
    CHECK(rep->block_peak_bytes == 2 * whole, "the replicated layout held %zu block bytes at most, the whole "
          "model's two blocks are %zu", rep->block_peak_bytes, 2 * whole);
    CHECK(own->block_peak_bytes == 2 * share && own->block_peak_bytes == own->parameter_bytes + own->gradient_bytes,
          "rank %d held %zu block bytes at most, expected its two blocks, %zu (parameters %zu, gradients %zu; the "
          "whole model's %zu)", me, own->block_peak_bytes, 2 * share, own->parameter_bytes, own->gradient_bytes,
          2 * whole);
    printf("     parameter and gradient blocks a rank ever held: %zu bytes instead of %zu (created so)\n",
           own->block_peak_bytes, 2 * whole);
}

/* `longmoe ARGS` outside the job's environment (without the launcher's
 * variables it does not take itself for a rank): its exit status, its output
 * (stdout and stderr) in out. A run with --comm mpi starts MPI, whose start-up
 * allocations outlive the program: no leak report for it (as for the rank
 * tests), so its exit status is the program's. */
static inline int run_cli(const char *args, char *out, size_t n) {
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "env -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE %s%s %s 2>&1",
             strstr(args, "--comm mpi") ? "ASAN_OPTIONS=detect_leaks=0 " : "", LONGMOE_CLI, args);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t got = fread(out, 1, n - 1, p);
    out[got] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif
