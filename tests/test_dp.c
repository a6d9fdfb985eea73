/* Data-parallel training (docs/scaleout.md, "Data parallelism").
 *
 * Alone (`test_dp`): the pieces that need no second rank: evaluating shares
 * of a batch and adding the tallies equals evaluating the batch; the CLI's
 * refusals of --comm.
 * Under mpirun (`mpirun -np N test_dp --mpi N`, ctest's test_dp_mpi2 and
 * test_dp_mpi4): a run over N ranks against one process with the same global
 * batch (losses, evaluation and parameters within 1e-5 relative after 20
 * steps), every rank holding the same parameters and balancing bias, a
 * bit-exact resume on N ranks, a resume of the N-rank checkpoint on one
 * process, a step failing on one rank skipped on all as on one process (also with the weighted
 * answer loss, whose sum over the ranks the failing rank joins), and
 * the refusals (a batch the ranks cannot share, the exact estimator, a GPU).
 * Built without MPI, `--mpi N` reports every case skipped.
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



/* One run of lm_train: over the ranks (dp = 1) or in this process alone. */
static lm_status train(const lm_config *c, const char *run, int dp, int resume, int64_t stop_after,
                       lm_train_result *r) {
    lm_train_options o = lm_train_options_default(dir(run));
    o.progress = NULL;
    o.val_batches = 2;
    o.stage_eval_batches = 0;
    o.resume = resume;
    o.stop_after = stop_after;
    o.comm = dp ? comm : NULL;
    memset(r, 0, sizeof *r);
    return lm_train(c, &o, r);
}

/* The same over the ranks with expert parallelism (or asking for it alone). */
static lm_status train_ep(const lm_config *c, const char *run, int dp, int resume, int64_t stop_after,
                          lm_train_result *r) {
    lm_train_options o = lm_train_options_default(dir(run));
    o.progress = NULL;
    o.val_batches = 2;
    o.stage_eval_batches = 0;
    o.resume = resume;
    o.stop_after = stop_after;
    o.comm = dp ? comm : NULL;
    o.expert_parallel = 1;
    memset(r, 0, sizeof *r);
    return lm_train(c, &o, r);
}

/* ---- alone ---- */

static void test_evaluating_shares_and_adding_the_tallies_equals_the_whole_batch(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    lm_model *whole = NULL, *half = NULL;
    CHECK(!lm_model_create(&c, 4, c.seq_len, &whole) && !lm_model_create(&c, 2, c.seq_len, &half), "%s",
          lm_last_error());
    if (!whole || !half) goto out;
    lm_model_init(whole, 11);
    lm_model_init(half, 11);
    lm_data_source *src;
    CHECK(!lm_data_open("copy", 5, &src), "%s", lm_last_error());
    lm_eval_tally all, a, b;
    CHECK(!lm_eval_loss(whole, src, 3, 4, &all), "%s", lm_last_error());
    CHECK(!lm_eval_loss_rows(half, src, 3, 4, 4, 0, &a) && !lm_eval_loss_rows(half, src, 3, 4, 4, 2, &b), "%s",
          lm_last_error());
    int64_t n = 0;
    double sum = 0;
    for (int i = 0; i < 4; i++) {
        CHECK(a.loss_count[i] + b.loss_count[i] == all.loss_count[i], "bucket %d counts", i);
        CHECK_CLOSE(a.loss_sum[i] + b.loss_sum[i], all.loss_sum[i], 0, 1e-6, "bucket loss sum");
        n += a.loss_count[i];
        sum += a.loss_sum[i];
    }
    CHECK(a.answers + b.answers == all.answers && a.answers_right + b.answers_right == all.answers_right &&
              a.rows + b.rows == all.rows && all.answers > 0,
          "answers %lld + %lld vs %lld", (long long)a.answers, (long long)b.answers, (long long)all.answers);
    /* the halves are different sequences: their losses differ */
    double other = 0;
    for (int i = 0; i < 4; i++) other += b.loss_sum[i];
    CHECK(n == 2 * 3 * c.seq_len && fabs(sum - other) > 1e-3, "share losses %.6f and %.6f", sum, other);
    /* rows outside the batch are refused */
    CHECK(lm_eval_loss_rows(half, src, 1, 4, 4, 3, &a) == LM_ERR_ARG, "rows 3..5 of 4 accepted");
    CHECK(lm_eval_loss_rows(half, src, 1, 4, 1, 0, &a) == LM_ERR_ARG, "a batch smaller than the model accepted");
    lm_data_close(src);
out:
    lm_model_free(whole);
    lm_model_free(half);
}

static void test_cli_refuses_bad_comm_and_mpirun_without_it(void) {
    char out[16384], args[900];
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm gloo", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--comm must be mpi, nccl"), "%s", out);
    /* NCCL sums device gradients: refused on the CPU before anything is opened or written */
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm nccl", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--device cuda"), "%s", out);
    if (!lm_comm_engine_available(LM_COMM_NCCL)) {
        snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm nccl --device cuda", dir("cli"));
        CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "NCCL"), "%s", out);
    }
    /* GPU ranks over MPI (the staged engine) are accepted: with no GPU here the run stops at the
     * device, naming it, before it writes a run */
    lm_backend *gpu = NULL;
    if (lm_comm_engine_available(LM_COMM_MPI) && lm_backend_cuda_create(&gpu) != LM_OK) {
        snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm mpi --device cuda",
                 dir("cli-staged"));
        CHECK(run_cli(args, out, sizeof out) == 1 && strstr(out, "--device cuda: ") && !strstr(out, "--comm"), "%s",
              out);
        char metrics[1200];
        snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", dir("cli-staged"));
        CHECK(access(metrics, F_OK) != 0, "the run without a GPU wrote %s", metrics);
    }
    lm_backend_free(gpu);
    /* started by a launcher that says 2 processes, without --comm mpi: refused before anything is written */
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s", dir("cli"));
    char env[1000];
    snprintf(env, sizeof env, "env OMPI_COMM_WORLD_SIZE=2 %s", LONGMOE_CLI);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", env, args);
    FILE *p = popen(cmd, "r");
    size_t got = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[got] = 0;
    int st = p ? pclose(p) : -1;
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2 && strstr(out, "--comm mpi"), "%s", out);
    struct stat sb;
    CHECK(stat(dir("cli"), &sb) != 0, "the refused run created its directory");
    CHECK(run_cli("train --help", out, sizeof out) == 0 && strstr(out, "--comm mpi"), "--help lacks --comm");
    CHECK(strstr(out, "--ep "), "--help lacks --ep");
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --ep", dir("cli-ep"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--comm mpi"), "%s", out);
    if (!lm_comm_engine_available(LM_COMM_MPI)) {
        snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm mpi", dir("cli"));
        CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "no MPI engine"), "%s", out);
    }
}

/* ---- over the ranks ---- */

/* The runs the cases compare, made once: "dp" (N ranks, 20 steps), "one" (one
 * process, the same config), "dp-zoom" (N ranks, the zoom estimator). */
static lm_train_result dp_result, zoom_result;
static int runs_ok;

static void make_runs(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    lm_status s = train(&c, "dp", 1, 0, 0, &dp_result);
    CHECK(!s, "dp: %s", lm_last_error());
    lm_train_result r;
    if (me == 0) CHECK(!train(&c, "one", 0, 0, 0, &r), "one: %s", lm_last_error());
    lm_config z = test_dp_config(LM_QB_ZOOM);
    CHECK(!train(&z, "dp-zoom", 1, 0, 0, &zoom_result), "dp-zoom: %s", lm_last_error());
    int32_t bad = test_current_failures, any = 0;
    lm_comm_all_reduce_sum(comm, &bad, &any, 1, LM_DTYPE_I32);
    runs_ok = any == 0;
}

static void test_data_parallel_equals_one_process_with_the_same_batch(void) {
    make_runs();
    if (!runs_ok) return;
    CHECK(dp_result.step == DP_STEPS && dp_result.skipped == 0, "dp: %lld steps, %lld skipped",
          (long long)dp_result.step, (long long)dp_result.skipped);
    if (me != 0) return;
    double a[32], b[32];
    int na = read_metric("dp", "train", "loss", a, 32), nb = read_metric("one", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    double worst = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss");
        worst = fmax(worst, fabs(a[i] - b[i]) / fabs(b[i]));
    }
    CHECK(b[DP_STEPS - 1] < b[0] - 0.5, "the run learns: loss %.3f -> %.3f", b[0], b[DP_STEPS - 1]);
    /* the QK-Clip statistic is the largest logit over the whole batch: the ranks' maximum */
    na = read_metric("dp", "train", "max_logit", a, 32);
    nb = read_metric("one", "train", "max_logit", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS && b[0] > 0, "max_logit lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "largest attention logit");
    na = read_metric("one", "train", "qk_clipped_heads", a, 32);
    double clipped = 0;
    for (int i = 0; i < na; i++) clipped += a[i];
    CHECK(clipped > 0, "QK-Clip scaled no head: the test does not see it");
    na = read_metric("dp", "eval", "val_loss", a, 32);
    nb = read_metric("one", "eval", "val_loss", b, 32);
    CHECK(na == 2 && nb == 2, "eval lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "validation loss");
    double wp, wb;
    CHECK(tensors_close("dp", "one", DP_STEPS, "model.safetensors", 1e-5, &wp), "parameters");
    CHECK(tensors_close("dp", "one", DP_STEPS, "trainer.safetensors", 1e-5, &wb), "optimizer and balancing state");
    printf("     %d ranks vs one process after %d steps: loss %.2e, parameters %.2e, optimizer/balance %.2e "
           "relative\n", R, DP_STEPS, worst, wp, wb);
}

/* train.answer_loss_weight: the weighted loss's sums run over every rank's rows, so the ranks train
 * as one process with the same batch (losses and parameters to 1e-5). */
static void test_weighted_loss_data_parallel_equals_one_process(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.answer_loss_weight = 6.0f;
    lm_train_result r;
    CHECK(!train(&c, "dp-weighted", 1, 0, 0, &r), "dp-weighted: %s", lm_last_error());
    if (me == 0) CHECK(!train(&c, "one-weighted", 0, 0, 0, &r), "one-weighted: %s", lm_last_error());
    if (me != 0) return;
    losses_close("dp-weighted", "one-weighted", DP_STEPS, 1e-5);
    double wp;
    CHECK(tensors_close("dp-weighted", "one-weighted", DP_STEPS, "model.safetensors", 1e-5, &wp), "parameters");
    printf("     weighted loss, %d ranks vs one process after %d steps: parameters %.2e relative\n", R, DP_STEPS,
           wp);
}

static void test_every_rank_holds_the_same_parameters_and_balancing_bias(void) {
    if (!runs_ok) SKIP("the runs failed");
    CHECK(same_on_every_rank(dp_result.params_hash), "parameters or optimizer state differ between ranks");
    CHECK(same_on_every_rank(dp_result.balance_hash), "balancing state differs between ranks (histogram)");
    CHECK(same_on_every_rank(zoom_result.params_hash), "parameters differ between ranks (zoom)");
    CHECK(same_on_every_rank(zoom_result.balance_hash), "balancing state differs between ranks (zoom)");
    /* the hashes see the state: the two runs' differ */
    CHECK(dp_result.balance_hash != zoom_result.balance_hash, "the balance hash ignores the bias");
    if (me == 0) {
        double h = largest_bias("dp", DP_STEPS), z = largest_bias("dp-zoom", DP_STEPS);
        CHECK(h > 1e-3 && z > 1e-3, "the balancing bias moved: largest |b| %.3g (histogram), %.3g (zoom)", h, z);
    }
}

static void test_resume_on_the_same_ranks_is_bit_exact(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    lm_train_result r;
    CHECK(!train(&c, "dp-resumed", 1, 0, DP_STOP, &r) && r.step == DP_STOP, "first half: %s", lm_last_error());
    CHECK(!train(&c, "dp-resumed", 1, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    CHECK(r.params_hash == dp_result.params_hash && r.balance_hash == dp_result.balance_hash,
          "the resumed run's state differs from the uninterrupted run's");
    if (me != 0) return;
    double w;
    CHECK(tensors_close("dp", "dp-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(tensors_close("dp", "dp-resumed", DP_STEPS, "trainer.safetensors", 0, &w), "trainer state bit-identical");
    losses_close("dp", "dp-resumed", DP_STEPS, 0);
}

static void test_checkpoint_of_the_ranks_resumes_on_one_process(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    lm_train_result r;
    CHECK(!train(&c, "dp-then-one", 1, 0, DP_HALF, &r) && r.step == DP_HALF, "ranks: %s", lm_last_error());
    if (me != 0) return;
    CHECK(!train(&c, "dp-then-one", 0, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
    double w;
    CHECK(tensors_close("dp-then-one", "one", DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
    CHECK(tensors_close("dp-then-one", "dp", DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
    double a[32];
    CHECK(read_metric("dp-then-one", "train", "loss", a, 32) == DP_STEPS, "a train line per step");
}

/* A forward that fails on one rank only (a NaN in the rows of its first micro-batch of step 4)
 * skips the step on every rank and consumes the failing micro-batch, as one process with the same
 * NaN does; the runs then continue alike. With the weighted answer loss (answer_weight != 1) its
 * per-micro-batch sum over the ranks is a collective the failing rank still joins, so no rank
 * waits for it. Runs "<tag>" (the ranks) and "<tag>-one" (one process). */
static void check_a_failing_rank_is_skipped_on_every_rank(const char *tag, float answer_weight) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.answer_loss_weight = answer_weight;
    c.eval_every = 0;
    c.ckpt_every = 0;
    char one[64];
    snprintf(one, sizeof one, "%s-one", tag);
    lm_train_options o = lm_train_options_default(dir(tag));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    o.comm = comm;
    o.inject_fault = LM_FAULT_BATCH;
    o.inject_fault_step = me == R - 1 ? 3 : -1;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "ranks: %s", lm_last_error());
    CHECK(r.skipped == 1 && r.step == DP_STEPS, "ranks: %lld skipped of %lld", (long long)r.skipped, (long long)r.step);
    CHECK(same_on_every_rank(r.params_hash), "the ranks differ after the skipped step");
    if (me != 0) return;
    o.out_dir = dir(one);
    o.comm = NULL;
    o.inject_fault_step = 3;
    CHECK(!lm_train(&c, &o, &r), "one process: %s", lm_last_error());
    CHECK(r.skipped == 1, "one process: %lld skipped", (long long)r.skipped);
    double a[32], b[32];
    int na = read_metric(tag, "train", "loss", a, 32), nb = read_metric(one, "train", "loss", b, 32);
    CHECK(na == DP_STEPS - 1 && nb == DP_STEPS - 1, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss");
    double w;
    CHECK(tensors_close(tag, one, DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
}

static void test_a_step_failing_on_one_rank_is_skipped_on_every_rank(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_a_failing_rank_is_skipped_on_every_rank("dp-fault", 1.0f);
    if (me != 0) return;
    /* the skip changed the run: its last loss is not the unskipped run's */
    double a[32], u[32];
    CHECK(read_metric("dp-fault", "train", "loss", a, 32) == DP_STEPS - 1 &&
              read_metric("dp", "train", "loss", u, 32) == DP_STEPS &&
              fabs(u[DP_STEPS - 1] - a[DP_STEPS - 2]) > 1e-4 * fabs(u[DP_STEPS - 1]),
          "the skip changed nothing: last loss %.9g and %.9g", u[DP_STEPS - 1], a[DP_STEPS - 2]);
}

static void test_a_failing_rank_with_the_weighted_loss_is_skipped_on_every_rank(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_a_failing_rank_is_skipped_on_every_rank("dpw-fault", 6.0f);
}

/* ---- expert parallelism (EP = the N ranks: 8 experts, 4 or 2 a rank) ---- */

static lm_train_result ep_result;
static int ep_ok;

/* The same global batch as "dp" and "one" with the experts split over the
 * ranks: equal to both to float rounding. */
static void test_expert_parallel_equals_data_parallel_and_one_process(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    CHECK(!train_ep(&c, "ep", 1, 0, 0, &ep_result), "ep: %s", lm_last_error());
    int32_t bad = test_current_failures, any = 0;
    lm_comm_all_reduce_sum(comm, &bad, &any, 1, LM_DTYPE_I32);
    ep_ok = any == 0;
    if (!ep_ok) return;
    CHECK(ep_result.step == DP_STEPS && ep_result.skipped == 0, "ep: %lld steps, %lld skipped",
          (long long)ep_result.step, (long long)ep_result.skipped);
    if (me != 0) return;
    double a[32], b[32], d[32];
    int na = read_metric("ep", "train", "loss", a, 32), nb = read_metric("one", "train", "loss", b, 32);
    int nd = read_metric("dp", "train", "loss", d, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS && nd == DP_STEPS, "train lines %d, %d and %d", na, nb, nd);
    double worst = 0;
    for (int i = 0; i < na && i < nb && i < nd; i++) {
        CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss (ep vs one process)");
        CHECK_CLOSE(a[i], d[i], 0, 1e-5, "loss (ep vs dp)");
        worst = fmax(worst, fabs(a[i] - b[i]) / fabs(b[i]));
    }
    na = read_metric("ep", "eval", "val_loss", a, 32);
    nb = read_metric("one", "eval", "val_loss", b, 32);
    CHECK(na == 2 && nb == 2, "eval lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "validation loss");
    double wp, wd, wb;
    CHECK(tensors_close("ep", "one", DP_STEPS, "model.safetensors", 1e-5, &wp), "parameters (ep vs one process)");
    CHECK(tensors_close("ep", "dp", DP_STEPS, "model.safetensors", 1e-5, &wd), "parameters (ep vs dp)");
    CHECK(tensors_close("ep", "one", DP_STEPS, "trainer.safetensors", 1e-5, &wb), "optimizer and balancing state");
    /* the experts' rows crossed ranks: the runs are not the data-parallel run's bits */
    printf("     EP over %d ranks after %d steps: loss %.2e, parameters %.2e (vs dp %.2e), optimizer/balance "
           "%.2e relative to one process\n", R, DP_STEPS, worst, wp, wd, wb);
}

static void test_expert_parallel_ranks_hold_the_same_state_and_bias(void) {
    if (!ep_ok) SKIP("the expert-parallel run failed");
    CHECK(same_on_every_rank(ep_result.params_hash), "parameters or optimizer state differ between ranks");
    CHECK(same_on_every_rank(ep_result.balance_hash), "balancing state differs between ranks");
    if (me == 0) {
        double h = largest_bias("ep", DP_STEPS);
        CHECK(h > 1e-3, "the balancing bias moved: largest |b| %.3g", h);
    }
}

/* An EP checkpoint is an ordinary one: it resumes with EP bit-exactly, and on
 * one process (without EP) within rounding of the uninterrupted runs. */
static void test_expert_parallel_checkpoint_resumes_with_and_without_it(void) {
    if (!ep_ok) SKIP("the expert-parallel run failed");
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    lm_train_result r;
    CHECK(!train_ep(&c, "ep-resumed", 1, 0, DP_STOP, &r) && r.step == DP_STOP, "first part: %s", lm_last_error());
    CHECK(!train_ep(&c, "ep-resumed", 1, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    CHECK(r.params_hash == ep_result.params_hash && r.balance_hash == ep_result.balance_hash,
          "the resumed EP run's state differs from the uninterrupted run's");
    CHECK(!train_ep(&c, "ep-then-one", 1, 0, DP_HALF, &r) && r.step == DP_HALF, "ranks: %s", lm_last_error());
    if (me != 0) return;
    double w;
    CHECK(tensors_close("ep", "ep-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(!train(&c, "ep-then-one", 0, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
    CHECK(tensors_close("ep-then-one", "one", DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
    CHECK(tensors_close("ep-then-one", "ep", DP_STEPS, "model.safetensors", 1e-5, &w), "parameters");
}

/* A NaN in one rank's rows stops that rank's routing: the ranks agree before
 * the exchange, skip the step together and go on as one process does. */
static void test_expert_parallel_step_failing_on_one_rank_is_skipped_on_every_rank(void) {
    if (!ep_ok) SKIP("the expert-parallel run failed");
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.eval_every = 0;
    c.ckpt_every = 0;
    lm_train_options o = lm_train_options_default(dir("ep-fault"));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    o.comm = comm;
    o.expert_parallel = 1;
    o.inject_fault = LM_FAULT_BATCH;
    o.inject_fault_step = me == R - 1 ? 3 : -1;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r), "ranks: %s", lm_last_error());
    CHECK(r.skipped == 1 && r.step == DP_STEPS, "ranks: %lld skipped of %lld", (long long)r.skipped, (long long)r.step);
    CHECK(same_on_every_rank(r.params_hash), "the ranks differ after the skipped step");
    if (me != 0) return;
    losses_close("ep-fault", "dp-fault-one", DP_STEPS - 1, 1e-5);
}

static void test_expert_parallel_refuses_experts_it_cannot_split(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.n_routed_experts = 5; /* divisible by neither 2 nor 4 */
    lm_train_result r;
    lm_status s = train_ep(&c, "ep-indivisible", 1, 0, 0, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "n_routed_experts = 5 is not divisible"), "status %d: %s",
          (int)s, lm_last_error());
    lm_comm_barrier(comm);
    if (me == 0) {
        char p[700];
        struct stat sb;
        snprintf(p, sizeof p, "%s/config.json", dir("ep-indivisible"));
        CHECK(stat(p, &sb) != 0, "the refused run wrote its config");
    }
}

static void test_what_the_ranks_cannot_share_is_refused(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.batch_size = R + 1;
    lm_train_result r;
    lm_status s = train(&c, "indivisible", 1, 0, 0, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "divisible"), "status %d: %s", (int)s, lm_last_error());
    c = test_dp_config(LM_QB_EXACT);
    s = train(&c, "exact", 1, 0, 0, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "exact"), "status %d: %s", (int)s, lm_last_error());
    /* GPU ranks over MPI are taken (the staged engine): this config's KDA head dimension (16) is
     * refused at the device, by name, on every rank, with a GPU or without */
    c = test_dp_config(LM_QB_HISTOGRAM);
    lm_train_options o = lm_train_options_default(dir("on-gpu"));
    o.progress = NULL;
    o.comm = comm;
    o.device = LM_DEVICE_CUDA;
    s = lm_train(&c, &o, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "--device cuda: kda.head_dim is 16"), "status %d: %s", (int)s,
          lm_last_error());
    lm_comm_barrier(comm);
    if (me == 0) {
        char p[700];
        struct stat sb;
        snprintf(p, sizeof p, "%s/config.json", dir("indivisible"));
        CHECK(stat(p, &sb) != 0, "the refused run wrote its config");
    }
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        snprintf(root, sizeof root, "/tmp/longmoe_test_dp_%d", (int)getpid());
        mkdir(root, 0755);
        RUN(test_evaluating_shares_and_adding_the_tallies_equals_the_whole_batch);
        RUN(test_cli_refuses_bad_comm_and_mpirun_without_it);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", root);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", root);
        return test_summary();
    }
    int rc = ranks_open(want_ranks, "dp");
    if (rc) return rc;
    test_dp_steps_note();
    RUN(test_data_parallel_equals_one_process_with_the_same_batch);
    RUN(test_every_rank_holds_the_same_parameters_and_balancing_bias);
    RUN(test_weighted_loss_data_parallel_equals_one_process);
    RUN(test_resume_on_the_same_ranks_is_bit_exact);
    RUN(test_checkpoint_of_the_ranks_resumes_on_one_process);
    RUN(test_a_step_failing_on_one_rank_is_skipped_on_every_rank);
    RUN(test_a_failing_rank_with_the_weighted_loss_is_skipped_on_every_rank);
    RUN(test_what_the_ranks_cannot_share_is_refused);
    RUN(test_expert_parallel_equals_data_parallel_and_one_process);
    RUN(test_expert_parallel_ranks_hold_the_same_state_and_bias);
    RUN(test_expert_parallel_checkpoint_resumes_with_and_without_it);
    RUN(test_expert_parallel_step_failing_on_one_rank_is_skipped_on_every_rank);
    RUN(test_expert_parallel_refuses_experts_it_cannot_split);
    ranks_close();
    return test_summary();
}
