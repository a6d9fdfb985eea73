/* Context parallelism in the trainer (docs/scaleout.md, "Context parallelism
 * in the trainer").
 *
 * Alone (`test_cp_train`): what needs no second rank: the CLI's refusals of
 * --cp (without --comm mpi) and its --help; lm_train refusing a
 * context-parallel run without a communicator; the segment evaluation of a
 * one-rank group equals the plain evaluation; `longmoe plan --memory --cp N`.
 * Under mpirun (`mpirun -np N test_cp_train --mpi N`, ctest's
 * test_cp_train_mpi2 and test_cp_train_mpi4): the model of test_dp_config
 * with sequences of 31 tokens (segments of unequal length: 16 + 15 on 2
 * ranks, 8 + 8 + 8 + 7 on 4) trained 20 steps with one context-parallel group
 * of N ranks (and on 4 ranks with 2 groups of 2: CP 2 x DP 2) against one
 * process with the same global batch: losses, validation losses, parameters,
 * optimizer and balancing state within 1e-5 relative; every rank holding the
 * same parameters and balancing bias (which moved); a bit-exact resume on the
 * same layout; a checkpoint of the ranks resumed on one process and one
 * process's resumed over the ranks, both within 1e-5 of the uninterrupted
 * run; ZeRO-1 over the whole world bit-identical to the replicated state;
 * gradient buckets of one tensor and of 4 KiB bit-identical to one sum after
 * the backward over 6 steps, replicated and (one tensor) with ZeRO-1; a
 * NaN in one rank's segment skipping the step on every rank as one process
 * with the same NaN does; a run of two stages with recompute (the stage
 * change makes the next stage's context-parallel model). Context and expert
 * parallelism together (--cp with --ep [G]: CP 2 x EP 2 on 2 ranks; CP 2 x EP 4,
 * CP 2 with EP groups of 2 and CP 4 with EP groups of 2 on 4 ranks) against one
 * process within 1e-5, with owner-only expert state, a bit-exact resume, checkpoints
 * resumed on one process and the other way round, ZeRO-1, a skipped NaN step
 * and a staged run with recompute. The refusals (ranks not a multiple of the
 * group or of the EP group, sequences shorter than the group). Built without
 * MPI, `--mpi N` reports every case skipped.
 * The runs of test_dp_config last DP_STEPS steps: the 20 steps said here (and
 * the steps 10, 8 and 15 within them) are the Release suite's; a sanitizer
 * build runs 10 (5, 4 and 7; tests/test_models.h). */
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "longmoe/eval.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"
#include "test_ranks.h"


/* test_dp_config with 31-token sequences: no rank count divides them; with
 * heavy = 1 heavier attention (three MLA layers of 8 heads of 64), enough that
 * the balanced split of the 31 tokens is not the even one (17 + 14 on 2 ranks,
 * 9 + 8 + 7 + 7 on 4). */
static lm_config cp_config_of(int heavy) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.seq_len = 31;
    if (heavy) {
        c.attn_heads = 8;
        c.qk_head_dim = c.v_head_dim = 64;
        strcpy(c.layout, "kmmm");
    }
    return c;
}
static lm_config cp_config(void) { return cp_config_of(0); }

/* One run of lm_train: over the ranks in groups of cp (cp = 0: this process
 * alone), ZeRO stage zero, expert parallelism in groups of ep ranks (0: off,
 * R: over every rank). */
/* The backend of the runs (NULL: the host path; lm_backend_cpu(): the device path on the CPU). */
static lm_backend *run_backend;
/* How the runs cut the sequences (lm_train_options.cp_split). */
static lm_cp_split run_split = LM_CP_SPLIT_EVEN;

static lm_status train_ep(const lm_config *c, const char *run, int cp, int ep, int zero, int resume,
                          int64_t stop_after, lm_train_result *r) {
    lm_train_options o = lm_train_options_default(dir(run));
    o.backend = run_backend;
    o.progress = NULL;
    o.val_batches = 2;
    o.stage_eval_batches = 0;
    o.resume = resume;
    o.stop_after = stop_after;
    o.comm = cp ? comm : NULL;
    o.context_parallel = cp;
    o.cp_split = run_split;
    o.zero = zero;
    o.expert_parallel = ep > 0;
    o.ep_group = ep == R ? 0 : ep;
    memset(r, 0, sizeof *r);
    return lm_train(c, &o, r);
}

static lm_status train(const lm_config *c, const char *run, int cp, int zero, int resume, int64_t stop_after,
                       lm_train_result *r) {
    return train_ep(c, run, cp, 0, zero, resume, stop_after, r);
}

/* Whether every rank passed every check so far. */
static int all_ranks_ok(void) {
    int32_t bad = test_current_failures, any = 0;
    lm_comm_all_reduce_sum(comm, &bad, &any, 1, LM_DTYPE_I32);
    return any == 0;
}

/* Run `run` (on rank 0's files) against `one`, the same config on one
 * process: the 20 train losses and the validation losses within 1e-5, the
 * parameters within prtol and the optimizer and balancing state within 1e-5
 * of each tensor's largest value. */
static void compare_with(const char *run, const char *one, const char *what, double prtol) {
    double a[32], b[32];
    int na = read_metric(run, "train", "loss", a, 32), nb = read_metric(one, "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "%s: train lines %d and %d", what, na, nb);
    double worst = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK_CLOSE(a[i], b[i], 0, 1e-5, "train loss");
        worst = fmax(worst, fabs(a[i] - b[i]) / fabs(b[i]));
    }
    /* the losses moved: the comparison sees training */
    CHECK(na == DP_STEPS && fabs(a[DP_STEPS - 1] - a[0]) > 1e-2 * fabs(a[0]),
          "%s: the loss did not move (%.6g to %.6g)", what, a[0], a[DP_STEPS - 1]);
    na = read_metric(run, "eval", "val_loss", a, 32);
    nb = read_metric(one, "eval", "val_loss", b, 32);
    CHECK(na == 2 && nb == 2, "%s: eval lines %d and %d", what, na, nb);
    double wv = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK_CLOSE(a[i], b[i], 0, 1e-5, "validation loss");
        wv = fmax(wv, fabs(a[i] - b[i]) / fabs(b[i]));
    }
    na = read_metric(run, "eval", "answer_accuracy", a, 32);
    nb = read_metric(one, "eval", "answer_accuracy", b, 32);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-12, "validation answer accuracy");
    double wp = 0, wb = 0, wq[32], oq[32];
    CHECK(tensors_close(run, one, DP_STEPS, "model.safetensors", prtol, &wp), "%s: parameters", what);
    CHECK(tensors_close(run, one, DP_STEPS, "trainer.safetensors", 1e-5, &wb), "%s: optimizer and balancing state",
          what);
    na = read_metric(run, "train", "grad_norm", wq, 32);
    nb = read_metric(one, "train", "grad_norm", oq, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "%s: grad_norm lines %d and %d", what, na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(wq[i], oq[i], 0, 1e-5, "gradient norm");
    na = read_metric(run, "train", "max_logit", wq, 32);
    nb = read_metric(one, "train", "max_logit", oq, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "%s: max_logit lines %d and %d", what, na, nb);
    /* written with 6 significant digits: one unit of the last is up to 1e-5 of the value */
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(wq[i], oq[i], 0, 2e-5, "largest attention logit");
    printf("     %s vs one process after %d steps: loss %.2e, val loss %.2e, parameters %.2e, optimizer/balance "
           "%.2e relative\n", what, DP_STEPS, worst, wv, wp, wb);
}

static void compare_with_one_process(const char *run, const char *what) { compare_with(run, "one", what, 1e-5); }

/* ---- alone ---- */

static void test_cli_and_trainer_refuse_cp_without_mpi(void) {
    char out[16384], args[900];
    CHECK(run_cli("train --help", out, sizeof out) == 0 && strstr(out, "--cp C"), "--help lacks --cp");
    CHECK(strstr(out, "[--ep [G]] [--cp C [--cp-split even|balanced]]"), "--help does not say that --ep and --cp combine: %s",
          out);
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --cp 2", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--comm mpi"), "%s", out);
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm mpi --cp 0", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2, "%s", out);
    struct stat sb;
    CHECK(stat(dir("cli"), &sb) != 0, "a refused run created its directory");
    lm_config c = cp_config();
    lm_train_result r;
    lm_train_options o = lm_train_options_default(dir("cp-no-comm"));
    o.progress = NULL;
    o.context_parallel = 2;
    lm_status s = lm_train(&c, &o, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "--comm mpi"), "status %d: %s", (int)s, lm_last_error());
}

/* A one-rank group: the segment evaluation of the whole sequence (t0 = 0,
 * no group) is the plain evaluation bit for bit; a segment that does not lie
 * in the sequence is refused. */
static void test_segment_evaluation_of_the_whole_sequence_is_the_plain_one(void) {
    lm_config c = cp_config();
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, 2, c.seq_len, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 7);
    lm_data_source *src;
    CHECK(!lm_data_open("copy", 5, &src), "%s", lm_last_error());
    lm_eval_tally a, b;
    CHECK(!lm_eval_loss_rows(m, src, 2, 4, 4, 2, &a), "%s", lm_last_error());
    CHECK(!lm_eval_loss_segment(m, src, 2, 4, 4, 2, c.seq_len, 0, NULL, &b), "%s", lm_last_error());
    CHECK(!memcmp(a.loss_sum, b.loss_sum, sizeof a.loss_sum) && !memcmp(a.loss_count, b.loss_count,
                                                                        sizeof a.loss_count),
          "bucket losses differ");
    CHECK(a.answers == b.answers && a.answers_right == b.answers_right && a.rows == b.rows &&
              a.rows_right == b.rows_right && a.answers > 0,
          "answers %lld/%lld rows %lld/%lld", (long long)a.answers, (long long)b.answers, (long long)a.rows,
          (long long)b.rows);
    CHECK(lm_eval_loss_segment(m, src, 1, 4, 4, 2, c.seq_len, 1, NULL, &b) == LM_ERR_ARG,
          "a segment past the sequence's end accepted");
    lm_data_close(src);
    lm_model_free(m);
}

/* `longmoe plan --memory --cp N`: one rank's segment and the context-parallel
 * block, for the rank that needs the most; the block grows with the
 * segment's offset (the attention's prefix), and a longer segment needs more
 * than a later one a token shorter (the KDA layers' part). */
static void test_plan_memory_counts_the_segment_activations(void) {
    char out[65536];
    CHECK(run_cli("plan --memory --config configs/tiny.json --seq 999 --cp 3", out, sizeof out) == 0, "%s", out);
    CHECK(strstr(out, "B=8 x T=333 ") && strstr(out, "holds tokens [666, 999) of 999") &&
              strstr(out, "segment activations, context parallel") && !strstr(out, "KDA activations"),
          "%s", out);
    CHECK(run_cli("plan --memory --config configs/tiny.json --seq 1001 --cp 2", out, sizeof out) == 0 &&
              strstr(out, "T=501 ") && strstr(out, "[0, 501)"), /* the longer segment: the KDA layers' part outweighs */
          "%s", out);
    CHECK(run_cli("plan --memory --config configs/tiny.json --seq 2 --cp 3", out, sizeof out) == 1 &&
              strstr(out, "at least one token"),
          "%s", out);
    CHECK(run_cli("plan --config configs/tiny.json --cp 3", out, sizeof out) != 0 && strstr(out, "--memory"), "%s", out);
    lm_config c;
    CHECK(!lm_config_load("configs/tiny.json", &c), "%s", lm_last_error());
    /* the plan of a rank: the mixers' segment activations in place of the one-rank ones */
    lm_model *one = NULL, *at0 = NULL, *at667 = NULL;
    CHECK(!lm_model_plan(&c, 8, 333, LM_DEVICE_CPU, &one) && !lm_model_plan(&c, 8, 333, LM_DEVICE_CPU, &at0) &&
              !lm_model_plan(&c, 8, 333, LM_DEVICE_CPU, &at667),
          "%s", lm_last_error());
    if (!one || !at0 || !at667) return;
    CHECK(lm_model_plan_context_parallel(at0, 1, 0) == LM_ERR_ARG, "one rank accepted");
    CHECK(!lm_model_plan_context_parallel(at0, 3, 0) && !lm_model_plan_context_parallel(at667, 3, 667), "%s",
          lm_last_error());
    CHECK(lm_model_plan_context_parallel(at0, 3, 0) == LM_ERR_ARG, "planned twice");
    double b_one = 0, b0 = 0, b667 = 0;
    int one_rank_acts = 0, seg_acts = 0, n0 = lm_model_num_buffers(at0);
    for (int i = 0; i < lm_model_num_buffers(one); i++) {
        b_one += (double)lm_model_buffer_at(one, i)->bytes;
        one_rank_acts += strstr(lm_model_buffer_at(one, i)->name, "KDA activations") != NULL;
    }
    for (int i = 0; i < n0; i++) {
        const lm_model_buffer *b = lm_model_buffer_at(at0, i);
        b0 += (double)b->bytes;
        seg_acts += strstr(b->name, "segment activations, context parallel") != NULL;
        CHECK(!strstr(b->name, "KDA activations") && !strstr(b->name, "attention activations"),
              "a one-rank mixer's buffer in the context-parallel plan: %s", b->name);
    }
    for (int i = 0; i < lm_model_num_buffers(at667); i++) b667 += (double)lm_model_buffer_at(at667, i)->bytes;
    CHECK(one_rank_acts > 0 && seg_acts > 0, "buffers: %d one-rank KDA, %d segment", one_rank_acts, seg_acts);
    CHECK(b667 > b0, "the plan at 667 (%.0f bytes) is not larger than at 0 (%.0f)", b667, b0);
    /* the same buffers before and after the activations (the tokens, the residual stream) */
    CHECK(!strcmp(lm_model_buffer_at(at0, n0 - 1)->name,
                  lm_model_buffer_at(one, lm_model_num_buffers(one) - 1)->name) &&
              !strcmp(lm_model_buffer_at(at0, 0)->name, lm_model_buffer_at(one, 0)->name),
          "the plan's other entries moved");
    printf("  tiny, 8 x 333 tokens: one rank %.3f MiB, the first of 3 context-parallel ranks %.3f MiB, the last "
           "%.3f MiB\n", b_one / 1048576.0, b0 / 1048576.0, b667 / 1048576.0);
    lm_model_free(one);
    lm_model_free(at0);
    lm_model_free(at667);
}

/* The cost of token t (0-based): lm_config_plan's FLOPs at a mean context of t + 1 keys. */
static double token_cost(const lm_config *c, int64_t t) {
    lm_plan p;
    lm_config_plan(c, 2 * t + 1, &p);
    return p.total_flops;
}

/* lm_config_cp_split: the even split as before; the balanced one with every
 * rank's FLOPs (summed token by token from lm_config_plan) within one token's
 * cost of its share, earlier segments no shorter (but for a token of
 * rounding); the even one where nothing
 * attends; refusals. */
static void test_the_sequence_split(void) {
    lm_config c = cp_config_of(1);
    int64_t st[9];
    const int64_t Ts[] = {31, 999, 4096};
    for (int ti = 0; ti < 3; ti++)
        for (int Rr = 1; Rr <= 8; Rr++) {
            const int64_t T = Ts[ti];
            CHECK(!lm_config_cp_split(&c, T, Rr, LM_CP_SPLIT_EVEN, st), "%s", lm_last_error());
            for (int r = 0; r <= Rr; r++)
                CHECK(st[r] == (int64_t)r * (T / Rr) + (r < T % Rr ? r : T % Rr), "even, T %lld, %d ranks: start %d "
                      "%lld", (long long)T, Rr, r, (long long)st[r]);
            CHECK(!lm_config_cp_split(&c, T, Rr, LM_CP_SPLIT_BALANCED, st), "%s", lm_last_error());
            CHECK(st[0] == 0 && st[Rr] == T, "balanced, T %lld: [%lld, %lld]", (long long)T, (long long)st[0],
                  (long long)st[Rr]);
            double total = 0, most = 0;
            for (int64_t t = 0; t < T; t++) {
                const double x = token_cost(&c, t);
                total += x;
                most = x > most ? x : most;
            }
            for (int r = 0; r < Rr; r++) {
                CHECK(st[r + 1] > st[r], "balanced, T %lld, %d ranks: segment %d empty", (long long)T, Rr, r);
                if (r > 0) /* each boundary rounded to the nearest token: one token of slack */
                    CHECK(st[r + 1] - st[r] <= st[r] - st[r - 1] + 1, "balanced, T %lld, %d ranks: segment %d longer "
                          "than %d by more than a token", (long long)T, Rr, r, r - 1);
                double cost = 0;
                for (int64_t t = st[r]; t < st[r + 1]; t++) cost += token_cost(&c, t);
                /* a boundary is off its ideal place by at most half a token on each side */
                CHECK(fabs(cost - total / Rr) <= most * 1.0001, "balanced, T %lld, %d ranks: rank %d's %.6g FLOPs, "
                      "the share %.6g (a token at most %.6g)", (long long)T, Rr, r, cost, total / Rr, most);
            }
        }
    /* attention-heavy enough that 31 tokens are cut unevenly (the ranks' runs below rely on it) */
    CHECK(!lm_config_cp_split(&c, 31, 2, LM_CP_SPLIT_BALANCED, st) && st[1] == 17, "31 over 2: %lld", (long long)st[1]);
    /* 4096 tokens over 4: the first segment the longest by far */
    CHECK(!lm_config_cp_split(&c, 4096, 4, LM_CP_SPLIT_BALANCED, st) && st[1] > 1400, "4096 over 4: first %lld",
          (long long)st[1]);
    printf("  4096 tokens over 4 ranks, balanced: %lld, %lld, %lld, %lld\n", (long long)st[1],
           (long long)(st[2] - st[1]), (long long)(st[3] - st[2]), (long long)(st[4] - st[3]));
    /* no attention layer: every token costs the same, the even split */
    lm_config k = c;
    strcpy(k.layout, "kkkk");
    k.last_layer_mla = 0;
    int64_t ev[5];
    CHECK(!lm_config_cp_split(&k, 4096, 4, LM_CP_SPLIT_BALANCED, st) &&
              !lm_config_cp_split(&k, 4096, 4, LM_CP_SPLIT_EVEN, ev) && !memcmp(st, ev, sizeof ev),
          "no attention: the balanced split is not the even one (%lld)", (long long)st[1]);
    CHECK(lm_config_cp_split(&c, 3, 4, LM_CP_SPLIT_BALANCED, st) == LM_ERR_ARG && strstr(lm_last_error(), "at least "
          "one token"), "3 tokens over 4 ranks: %s", lm_last_error());
    CHECK(lm_config_cp_split(&c, 8, 4, (lm_cp_split)7, st) == LM_ERR_ARG, "an unknown kind accepted");
    lm_cp_split kind;
    CHECK(lm_cp_split_from_name("zigzag", &kind) == LM_ERR_ARG && strstr(lm_last_error(), "even or balanced"),
          "%s", lm_last_error());
    CHECK(!lm_cp_split_from_name("balanced", &kind) && kind == LM_CP_SPLIT_BALANCED, "balanced");
    /* the CLI: the option's refusals and the plan's split */
    char out[65536];
    CHECK(run_cli("train --config configs/tiny.json --out /nonexistent --cp-split zigzag", out, sizeof out) == 2 &&
              strstr(out, "even or balanced"),
          "%s", out);
    CHECK(run_cli("train --config configs/tiny.json --out /nonexistent --cp-split balanced", out, sizeof out) == 2 &&
              strstr(out, "--cp C"),
          "%s", out);
    CHECK(run_cli("plan --memory --config configs/k3-mini.json --batch 1 --seq 32768 --seq-segment 0 --cp 4 "
                  "--cp-split balanced", out, sizeof out) == 0 &&
              strstr(out, "(balanced split): rank ") && strstr(out, "holds tokens ["),
          "%s", out);
}

/* ---- over the ranks ---- */

/* The runs the cases compare, made once: "cp" (one group of N ranks), "one"
 * (rank 0 alone, the same config), on 4 ranks "cpdp" (2 groups of 2). */
static lm_train_result cp_result, cpdp_result;
static int runs_ok;

static void make_runs(void) {
    lm_config c = cp_config();
    CHECK(!train(&c, "cp", R, 0, 0, 0, &cp_result), "cp: %s", lm_last_error());
    lm_train_result r;
    if (me == 0) CHECK(!train(&c, "one", 0, 0, 0, 0, &r), "one: %s", lm_last_error());
    if (R == 4) CHECK(!train(&c, "cpdp", 2, 0, 0, 0, &cpdp_result), "cpdp: %s", lm_last_error());
    runs_ok = all_ranks_ok();
}

/* The balanced split (17 + 14 tokens on 2 ranks, 9 + 8 + 7 + 7 on 4) trains
 * the same run as one process, of the attention-heavy config. */
static void test_a_balanced_split_equals_one_process(void) {
    lm_config c = cp_config_of(1);
    int64_t st[5];
    CHECK(!lm_config_cp_split(&c, c.seq_len, R, LM_CP_SPLIT_BALANCED, st), "%s", lm_last_error());
    CHECK(st[1] != (c.seq_len + R - 1) / R, "the balanced split is the even one (%lld)", (long long)st[1]);
    run_split = LM_CP_SPLIT_BALANCED;
    lm_train_result r;
    CHECK(!train(&c, "bal", R, 0, 0, 0, &r), "bal: %s", lm_last_error());
    run_split = LM_CP_SPLIT_EVEN;
    if (me == 0) CHECK(!train(&c, "one-heavy", 0, 0, 0, 0, &r), "one-heavy: %s", lm_last_error());
    if (!all_ranks_ok() || me != 0) return;
    char what[64];
    snprintf(what, sizeof what, "CP %d, balanced split", R);
    /* the parameters within 3e-5: the LM head's, updated by AdamW, whose step normalises away the size of
     * its smallest gradient elements, so the summation order's rounding of those moves them by up to 1.5e-5
     * of the tensor's largest value in 20 steps here (7.6e-6 on 2 ranks; the even split of this config
     * 6.3e-6 on 4), the losses within 2e-7 */
    compare_with("bal", "one-heavy", what, 3e-5);
}

static void test_context_parallel_equals_one_process_with_the_same_batch(void) {
    make_runs();
    if (!runs_ok) return;
    CHECK(cp_result.step == DP_STEPS && cp_result.skipped == 0, "cp: %lld steps, %lld skipped",
          (long long)cp_result.step, (long long)cp_result.skipped);
    if (me != 0) return;
    char what[64];
    snprintf(what, sizeof what, "CP %d", R);
    compare_with_one_process("cp", what);
    if (R == 4) compare_with_one_process("cpdp", "CP 2 x DP 2");
}

/* The device path (the model's buffers in a backend's memory, the layers'
 * exchanges and the gradient sums over the staged engine; here the CPU
 * backend, as GPU ranks run it): the host path's run ("cp") bit for bit. */
static void test_the_device_path_is_the_host_paths_run(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = cp_config();
    lm_train_result r;
    run_backend = lm_backend_cpu();
    lm_status s = train(&c, "dev-cp", R, 0, 0, 0, &r);
    run_backend = NULL;
    CHECK(!s && r.step == DP_STEPS, "device path, CP %d: %s", R, lm_last_error());
    if (s) return;
    CHECK(r.params_hash == cp_result.params_hash && r.balance_hash == cp_result.balance_hash,
          "the device path's parameters or balancing state differ from the host path's");
    if (me != 0) return;
    double a[32], b[32];
    int na = read_metric("dev-cp", "train", "loss", a, 32), nb = read_metric("cp", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK(a[i] == b[i], "step %d: loss %.9g on the device path, %.9g", i, a[i], b[i]);
    char what[64];
    snprintf(what, sizeof what, "device path, CP %d", R);
    compare_with_one_process("dev-cp", what);
}

static void test_every_rank_holds_the_same_parameters_and_balancing_bias(void) {
    if (!runs_ok) SKIP("the runs failed");
    CHECK(same_on_every_rank(cp_result.params_hash), "parameters or optimizer state differ between ranks");
    CHECK(same_on_every_rank(cp_result.balance_hash), "balancing state differs between ranks");
    if (R == 4) {
        CHECK(same_on_every_rank(cpdp_result.params_hash), "CP 2 x DP 2: parameters differ between ranks");
        CHECK(same_on_every_rank(cpdp_result.balance_hash), "CP 2 x DP 2: balancing state differs between ranks");
    }
    if (me == 0) {
        double h = largest_bias("cp", DP_STEPS);
        CHECK(h > 1e-3, "the balancing bias moved: largest |b| %.3g", h);
    }
}

static void test_resume_on_the_same_layout_is_bit_exact(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = cp_config();
    lm_train_result r;
    CHECK(!train(&c, "cp-resumed", R, 0, 0, DP_STOP, &r) && r.step == DP_STOP, "first part: %s", lm_last_error());
    CHECK(!train(&c, "cp-resumed", R, 0, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    CHECK(r.params_hash == cp_result.params_hash && r.balance_hash == cp_result.balance_hash,
          "the resumed run's state differs from the uninterrupted run's");
    if (me != 0) return;
    double w;
    CHECK(tensors_close("cp", "cp-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(tensors_close("cp", "cp-resumed", DP_STEPS, "trainer.safetensors", 0, &w), "trainer state bit-identical");
}

/* Checkpoints are the ordinary ones: a context-parallel checkpoint resumes on
 * one process, and one process's resumes context-parallel (on 4 ranks in 2
 * groups of 2), both ending within 1e-5 of the uninterrupted one process. */
static void test_checkpoints_resume_across_layouts(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = cp_config();
    lm_train_result r;
    const int cp = R == 4 ? 2 : R;
    CHECK(!train(&c, "cp-then-one", R, 0, 0, DP_HALF, &r) && r.step == DP_HALF, "ranks: %s", lm_last_error());
    if (me == 0) {
        CHECK(!train(&c, "cp-then-one", 0, 0, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
        CHECK(!train(&c, "one-then-cp", 0, 0, 0, DP_HALF, &r) && r.step == DP_HALF, "one process: %s", lm_last_error());
    }
    lm_comm_barrier(comm);
    CHECK(!train(&c, "one-then-cp", cp, 0, 1, 0, &r) && r.step == DP_STEPS, "ranks: %s", lm_last_error());
    CHECK(same_on_every_rank(r.params_hash), "the resumed ranks differ");
    if (me != 0) return;
    double w1, w2;
    CHECK(tensors_close("cp-then-one", "one", DP_STEPS, "model.safetensors", 1e-5, &w1), "CP then one: parameters");
    CHECK(tensors_close("one-then-cp", "one", DP_STEPS, "model.safetensors", 1e-5, &w2), "one then CP: parameters");
    double a[32], b[32];
    int na = read_metric("cp-then-one", "train", "loss", a, 32), nb = read_metric("one-then-cp", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    printf("     CP %d then one process: parameters %.2e; one process then CP %d: %.2e relative\n", R, w1, cp, w2);
}

/* ZeRO-1 shards the optimizer state over all R ranks: the same bits as the
 * replicated state of the same layout. */
static void test_zero_over_the_world_is_the_replicated_run(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = cp_config();
    lm_train_result r;
    const int cp = R == 4 ? 2 : R;
    CHECK(!train(&c, "cp-zero", cp, 1, 0, 0, &r) && r.step == DP_STEPS, "zero: %s", lm_last_error());
    const lm_train_result *want = R == 4 ? &cpdp_result : &cp_result;
    CHECK(r.params_hash == want->params_hash && r.balance_hash == want->balance_hash,
          "ZeRO-1 differs from the replicated run");
    CHECK(r.optimizer_state_bytes < want->optimizer_state_bytes, "ZeRO-1 holds %zu bytes, replicated %zu",
          r.optimizer_state_bytes, want->optimizer_state_bytes);
    if (me != 0) return;
    double w;
    CHECK(tensors_close("cp-zero", R == 4 ? "cpdp" : "cp", DP_STEPS, "trainer.safetensors", 0, &w),
          "trainer state bit-identical");
}

/* Gradient buckets under context parallelism (the world's sum a bucket at a
 * time during the last backward, while the KDA and attention layers exchange
 * their states over the groups' handles): buckets of one tensor and of 4 KiB
 * give the unbucketed run's bits (train.grad_bucket_mb 0), replicated and with
 * ZeRO-1 (each bucket reduce-scattered; one-tensor buckets), over 6 steps. The
 * other cases run with the default (one bucket of this model). */
static void test_gradient_buckets_give_the_one_sums_bits(void) {
    if (!runs_ok) SKIP("the runs failed");
    const int cp = R == 4 ? 2 : R;
    static const float sizes[] = {1e-6f, 0.004f};
    enum { STEPS = 6 }; /* short runs: the sums of every step are compared through the final state */
    for (int zero = 0; zero <= 1; zero++) {
        lm_config c = cp_config();
        c.steps = STEPS;
        c.eval_every = 0;
        c.ckpt_every = 0; /* one checkpoint, at the end */
        lm_train_result plain, r;
        char base[64], run[64];
        snprintf(base, sizeof base, "cp-b0-z%d", zero);
        c.grad_bucket_mb = 0;
        CHECK(!train(&c, base, cp, zero, 0, 0, &plain) && plain.step == STEPS, "%s: %s", base, lm_last_error());
        for (int k = 0; k < (zero ? 1 : 2); k++) {
            snprintf(run, sizeof run, "cp-b%d-z%d", k + 1, zero);
            c.grad_bucket_mb = sizes[k];
            CHECK(!train(&c, run, cp, zero, 0, 0, &r) && r.step == STEPS, "%s: %s", run, lm_last_error());
            CHECK(r.params_hash == plain.params_hash && r.balance_hash == plain.balance_hash,
                  "%s: the state differs from the unbucketed run's", run);
            if (me != 0) continue;
            double w;
            CHECK(tensors_close(run, base, STEPS, "model.safetensors", 0, &w), "%s: parameters", run);
            CHECK(tensors_close(run, base, STEPS, "trainer.safetensors", 0, &w), "%s: trainer state", run);
        }
    }
    if (me == 0)
        printf("     CP %d%s: buckets of one tensor and of 4 KiB equal the one sum (ZeRO-1: of one tensor)\n", cp,
               R == 4 ? " x DP 2" : "");
}

/* A NaN in the last rank's segment at step 4 fails the group's forward: the
 * step is skipped on every rank and the run goes on as one process's with the
 * same NaN (in its first token, the last rank's NaN in its own first). */
static void test_a_step_failing_on_one_rank_is_skipped_on_every_rank(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = cp_config();
    c.eval_every = 0;
    c.ckpt_every = 0;
    lm_train_options o = lm_train_options_default(dir("cp-fault"));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    o.comm = comm;
    o.context_parallel = R;
    o.inject_fault = LM_FAULT_BATCH;
    o.inject_fault_step = me == R - 1 ? 3 : -1;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "ranks: %s", lm_last_error());
    CHECK(r.skipped == 1 && r.step == DP_STEPS, "ranks: %lld skipped of %lld", (long long)r.skipped, (long long)r.step);
    CHECK(same_on_every_rank(r.params_hash), "the ranks differ after the skipped step");
    if (me != 0) return;
    o.out_dir = dir("one-fault");
    o.comm = NULL;
    o.context_parallel = 0;
    o.inject_fault_step = 3;
    CHECK(!lm_train(&c, &o, &r), "one process: %s", lm_last_error());
    CHECK(r.skipped == 1, "one process: %lld skipped", (long long)r.skipped);
    double a[32], b[32], u[32];
    int na = read_metric("cp-fault", "train", "loss", a, 32), nb = read_metric("one-fault", "train", "loss", b, 32);
    CHECK(na == DP_STEPS - 1 && nb == DP_STEPS - 1, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss");
    double w;
    CHECK(tensors_close("cp-fault", "one-fault", DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
    CHECK(read_metric("cp", "train", "loss", u, 32) == DP_STEPS &&
              fabs(u[DP_STEPS - 1] - a[DP_STEPS - 2]) > 1e-4 * fabs(u[DP_STEPS - 1]),
          "the skip changed nothing: last loss %.9g and %.9g", u[DP_STEPS - 1], a[DP_STEPS - 2]);
}

/* Two stages of 5 steps (24 then 31 tokens a row, 4 rows) with recompute. */
static lm_config staged_config(void) {
    lm_config c = cp_config();
    c.recompute = 1;
    c.eval_every = 0;
    c.n_stages = 2;
    memset(c.stages, 0, sizeof c.stages);
    for (int i = 0; i < 2; i++) {
        lm_stage *st = &c.stages[i];
        snprintf(st->name, sizeof st->name, "s%d", i);
        st->seq_len = i ? 31 : 24;
        st->steps = 5;
        st->batch_tokens = 4 * (int64_t)st->seq_len;
        st->lr_scale = 1;
    }
    return c;
}

/* Two stages (24 then 31 tokens: segments 12 + 12 then 16 + 15 on 2 ranks,
 * 6 each then 8, 8, 8, 7 on 4) with recompute: the stage change makes the new
 * stage's context-parallel model, and the run equals one process's. */
static void test_a_staged_run_with_recompute_equals_one_process(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = staged_config();
    lm_train_result r;
    CHECK(!train(&c, "staged-cp", R, 0, 0, 0, &r) && r.step == 10, "ranks: %s", lm_last_error());
    CHECK(same_on_every_rank(r.params_hash) && same_on_every_rank(r.balance_hash), "the ranks differ");
    if (me != 0) return;
    CHECK(!train(&c, "staged-one", 0, 0, 0, 0, &r) && r.step == 10, "one process: %s", lm_last_error());
    double a[32], b[32];
    int na = read_metric("staged-cp", "train", "loss", a, 32), nb = read_metric("staged-one", "train", "loss", b, 32);
    CHECK(na == 10 && nb == 10, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "train loss");
    na = read_metric("staged-cp", "eval", "val_loss", a, 32);
    nb = read_metric("staged-one", "eval", "val_loss", b, 32);
    CHECK(na == 2 && nb == 2, "eval lines %d and %d (the stage end and the run's end)", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "validation loss");
    double w5, w10;
    CHECK(tensors_close("staged-cp", "staged-one", 5, "model.safetensors", 1e-5, &w5), "parameters at the stage end");
    CHECK(tensors_close("staged-cp", "staged-one", 10, "model.safetensors", 1e-5, &w10), "parameters at the end");
    printf("     two stages with recompute, CP %d vs one process: parameters %.2e (stage end), %.2e (end)\n", R, w5,
           w10);
}

/* ---- context and expert parallelism together ---- */

/* The layouts: on 2 ranks CP 2 x EP 2 (the EP group is the CP group); on 4
 * CP 2 x EP 4 (one EP group over both CP groups: an owner runs its experts on
 * both groups' rows), CP 2 with EP groups of 2 (each the CP group; the experts'
 * replicas in the other group) and CP 4 with EP groups of 2 (two EP groups
 * inside the CP group, each with half of every row's positions). */
typedef struct {
    const char *run, *what;
    int cp, ep;
} cpep_layout;
static const cpep_layout cpep2[] = {{"cpep", "CP 2 x EP 2", 2, 2}};
static const cpep_layout cpep4[] = {{"cpep", "CP 2 x EP 4", 2, 4},
                                    {"cpep-g2", "CP 2 x EP groups of 2", 2, 2},
                                    {"cp4ep-g2", "CP 4 x EP groups of 2", 4, 2}};
static lm_train_result cpep_result[3];
static int cpep_ok;

static int cpep_layouts(const cpep_layout **l) {
    *l = R == 4 ? cpep4 : cpep2;
    return R == 4 ? 3 : 1;
}

/* Each layout trains 20 steps and equals one process with the same global
 * batch within 1e-5 (losses, validation losses, gradient norms, QK-Clip
 * maxima, parameters, optimizer and balancing state); every rank holds the
 * same parameters and balancing state; the experts' optimizer state lives
 * on their owners only (a rank holds the replicated tensors' and 1/G of the
 * experts'). */
static void test_context_and_expert_parallel_equal_one_process(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = cp_config();
    const cpep_layout *l;
    int n = cpep_layouts(&l);
    for (int i = 0; i < n; i++)
        CHECK(!train_ep(&c, l[i].run, l[i].cp, l[i].ep, 0, 0, 0, &cpep_result[i]) && cpep_result[i].step == DP_STEPS &&
                  cpep_result[i].skipped == 0,
              "%s: %s", l[i].what, lm_last_error());
    cpep_ok = all_ranks_ok();
    if (!cpep_ok) return;
    const size_t experts = expert_floats(c) * sizeof(float), whole = cp_result.optimizer_state_bytes;
    CHECK(experts > 0, "no expert tensors");
    for (int i = 0; i < n; i++) {
        CHECK(same_on_every_rank(cpep_result[i].params_hash), "%s: parameters or optimizer state differ between "
              "ranks", l[i].what);
        CHECK(same_on_every_rank(cpep_result[i].balance_hash), "%s: balancing state differs between ranks",
              l[i].what);
        const size_t want = whole - experts + experts / (size_t)l[i].ep;
        CHECK(cpep_result[i].optimizer_state_bytes == want, "%s: rank %d holds %zu bytes of optimizer state, "
              "expected %zu", l[i].what, me, cpep_result[i].optimizer_state_bytes, want);
    }
    if (me != 0) return;
    for (int i = 0; i < n; i++) compare_with_one_process(l[i].run, l[i].what);
    CHECK(largest_bias(l[0].run, DP_STEPS) > 1e-3, "the balancing bias did not move");
}

/* On the same layout, 8 steps, stop, resume to 20: the uninterrupted run's
 * bits. A CP x EP checkpoint of step 10 finished on one process, and one
 * process's finished under CP x EP, both within 1e-5 of one process. ZeRO-1
 * over the world (the experts' state in its ranges instead of on their owners)
 * is the owner-only run bit for bit. */
static void test_context_and_expert_parallel_checkpoints_resume_across_layouts(void) {
    if (!cpep_ok) SKIP("the context and expert parallel runs failed");
    lm_config c = cp_config();
    const cpep_layout *l;
    cpep_layouts(&l);
    const int last = R == 4 ? 1 : 0; /* on 4 ranks the EP groups of 2 with CP 2 */
    lm_train_result r;
    CHECK(!train_ep(&c, "cpep-resumed", l[last].cp, l[last].ep, 0, 0, DP_STOP, &r) && r.step == DP_STOP,
          "first part: %s", lm_last_error());
    CHECK(!train_ep(&c, "cpep-resumed", l[last].cp, l[last].ep, 0, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s",
          lm_last_error());
    CHECK(r.params_hash == cpep_result[last].params_hash && r.balance_hash == cpep_result[last].balance_hash,
          "%s: the resumed run's state differs from the uninterrupted run's", l[last].what);
    CHECK(!train_ep(&c, "cpep-zero", l[0].cp, l[0].ep, 1, 0, 0, &r) && r.step == DP_STEPS, "zero: %s", lm_last_error());
    CHECK(r.params_hash == cpep_result[0].params_hash && r.balance_hash == cpep_result[0].balance_hash,
          "%s with ZeRO-1 differs from the owner-only run", l[0].what);
    CHECK(!train_ep(&c, "cpep-then-one", l[0].cp, l[0].ep, 0, 0, DP_HALF, &r) && r.step == DP_HALF, "ranks: %s",
          lm_last_error());
    if (me == 0) {
        CHECK(!train(&c, "cpep-then-one", 0, 0, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
        CHECK(!train(&c, "one-then-cpep", 0, 0, 0, DP_HALF, &r) && r.step == DP_HALF, "one process: %s",
              lm_last_error());
    }
    lm_comm_barrier(comm);
    CHECK(!train_ep(&c, "one-then-cpep", l[0].cp, l[0].ep, 0, 1, 0, &r) && r.step == DP_STEPS, "ranks: %s",
          lm_last_error());
    CHECK(same_on_every_rank(r.params_hash), "the resumed ranks differ");
    if (me != 0) return;
    double w;
    CHECK(tensors_close(l[last].run, "cpep-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(tensors_close(l[last].run, "cpep-resumed", DP_STEPS, "trainer.safetensors", 0, &w),
          "trainer state bit-identical");
    CHECK(tensors_close(l[0].run, "cpep-zero", DP_STEPS, "trainer.safetensors", 0, &w), "ZeRO-1: trainer state "
          "bit-identical");
    double w1, w2;
    CHECK(tensors_close("cpep-then-one", "one", DP_STEPS, "model.safetensors", 1e-5, &w1),
          "CP x EP then one: parameters");
    CHECK(tensors_close("cpep-then-one", "one", DP_STEPS, "trainer.safetensors", 1e-5, &w), "CP x EP then one: state");
    CHECK(tensors_close("one-then-cpep", "one", DP_STEPS, "model.safetensors", 1e-5, &w2),
          "one then CP x EP: parameters");
    CHECK(tensors_close("one-then-cpep", "one", DP_STEPS, "trainer.safetensors", 1e-5, &w), "one then CP x EP: state");
    printf("     %s then one process: parameters %.2e; one process then %s: %.2e relative\n", l[0].what, w1,
           l[0].what, w2);
}

/* A NaN in the last rank's segment at step 4 under CP x EP: on 4 ranks with
 * CP 2 x EP 4 only the last CP group's forward fails, and the first group
 * learns of it in the MoE layers' agreement; the step is skipped on every
 * rank and the run equals one process's with the same NaN. */
static void test_context_and_expert_parallel_skip_a_failing_step_on_every_rank(void) {
    if (!cpep_ok) SKIP("the context and expert parallel runs failed");
    lm_config c = cp_config();
    c.eval_every = 0;
    c.ckpt_every = 0;
    const cpep_layout *l;
    cpep_layouts(&l);
    lm_train_options o = lm_train_options_default(dir("cpep-fault"));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    o.comm = comm;
    o.context_parallel = l[0].cp;
    o.expert_parallel = 1;
    o.inject_fault = LM_FAULT_BATCH;
    o.inject_fault_step = me == R - 1 ? 3 : -1;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "ranks: %s", lm_last_error());
    CHECK(r.skipped == 1 && r.step == DP_STEPS, "ranks: %lld skipped of %lld", (long long)r.skipped, (long long)r.step);
    CHECK(same_on_every_rank(r.params_hash), "the ranks differ after the skipped step");
    if (me != 0) return;
    /* one-fault: the one process with the same NaN (the context-parallel case above) */
    losses_close("cpep-fault", "one-fault", DP_STEPS - 1, 1e-5);
    double w;
    CHECK(tensors_close("cpep-fault", "one-fault", DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
}

/* The staged run with recompute under CP x EP (the recomputed MoE layers
 * exchange again in the backward; the next stage's model is set up for both)
 * equals one process's (staged-one, the context-parallel case above). */
static void test_context_and_expert_parallel_staged_with_recompute(void) {
    if (!cpep_ok) SKIP("the context and expert parallel runs failed");
    lm_config c = staged_config();
    const cpep_layout *l;
    cpep_layouts(&l);
    lm_train_result r;
    CHECK(!train_ep(&c, "staged-cpep", l[0].cp, l[0].ep, 0, 0, 0, &r) && r.step == 10, "ranks: %s",
          lm_last_error());
    CHECK(same_on_every_rank(r.params_hash) && same_on_every_rank(r.balance_hash), "the ranks differ");
    if (me != 0) return;
    losses_close("staged-cpep", "staged-one", 10, 1e-5);
    double w;
    CHECK(tensors_close("staged-cpep", "staged-one", 10, "model.safetensors", 1e-5, &w), "parameters at the end");
    printf("     two stages with recompute, %s vs one process: parameters %.2e\n", l[0].what, w);
}

/* Refused on every rank before anything is written. */
static void test_what_the_groups_cannot_run_is_refused(void) {
    lm_config c = cp_config();
    lm_train_result r;
    lm_status s = train_ep(&c, "cp-ep", R, 3, 0, 0, 0, &r); /* EP groups of 3 divide neither 2 nor 4 ranks */
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "multiple of 3"), "--cp with --ep 3: status %d: %s", (int)s,
          lm_last_error());
    s = train(&c, "cp3", 3, 0, 0, 0, &r); /* 3 divides neither 2 nor 4 */
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "multiple of 3"), "groups of 3: status %d: %s", (int)s,
          lm_last_error());
    c.seq_len = R - 1; /* fewer tokens than ranks in the group */
    s = train(&c, "short", R, 0, 0, 0, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "at least one token"), "short sequences: status %d: %s", (int)s,
          lm_last_error());
    c = cp_config();
    c.batch_size = 3; /* 2 groups of 2 on 4 ranks cannot share 3 rows */
    if (R == 4) {
        s = train(&c, "rows", 2, 0, 0, 0, &r);
        CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "divisible by 2"), "3 rows over 2 groups: status %d: %s",
              (int)s, lm_last_error());
    }
    lm_comm_barrier(comm);
    if (me == 0) {
        const char *runs[4] = {"cp-ep", "cp3", "short", "rows"};
        for (int i = 0; i < 4; i++) {
            char p[700];
            struct stat sb;
            snprintf(p, sizeof p, "%s/config.json", dir(runs[i]));
            CHECK(stat(p, &sb) != 0, "the refused run %s wrote its config", runs[i]);
        }
    }
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        snprintf(root, sizeof root, "/tmp/longmoe_test_cp_train_%d", (int)getpid());
        mkdir(root, 0755);
        RUN(test_cli_and_trainer_refuse_cp_without_mpi);
        RUN(test_segment_evaluation_of_the_whole_sequence_is_the_plain_one);
        RUN(test_plan_memory_counts_the_segment_activations);
        RUN(test_the_sequence_split);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", root);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", root);
        return test_summary();
    }
    int rc = ranks_open(want_ranks, "cp_train");
    if (rc) return rc;
    test_dp_steps_note();
    RUN(test_context_parallel_equals_one_process_with_the_same_batch);
    RUN(test_the_device_path_is_the_host_paths_run);
    RUN(test_a_balanced_split_equals_one_process);
    RUN(test_every_rank_holds_the_same_parameters_and_balancing_bias);
    RUN(test_resume_on_the_same_layout_is_bit_exact);
    RUN(test_checkpoints_resume_across_layouts);
    RUN(test_zero_over_the_world_is_the_replicated_run);
    RUN(test_gradient_buckets_give_the_one_sums_bits);
    RUN(test_a_step_failing_on_one_rank_is_skipped_on_every_rank);
    RUN(test_a_staged_run_with_recompute_equals_one_process);
    RUN(test_context_and_expert_parallel_equal_one_process);
    RUN(test_context_and_expert_parallel_checkpoints_resume_across_layouts);
    RUN(test_context_and_expert_parallel_skip_a_failing_step_on_every_rank);
    RUN(test_context_and_expert_parallel_staged_with_recompute);
    RUN(test_what_the_groups_cannot_run_is_refused);
    ranks_close();
    return test_summary();
}
