/* ZeRO-1: the optimizer state sharded over data-parallel ranks
 * (docs/scaleout.md, "ZeRO-1").
 *
 * Alone (`test_zero`): the refusals (no ranks, another stage, the CLI's
 * --zero without --comm mpi, --help).
 * Under mpirun (`mpirun -np N test_zero --mpi N`, ctest's test_zero_mpi2 and
 * test_zero_mpi4): a 20-step run with --zero 1 on N ranks against replicated
 * data parallelism on the same ranks (bit for bit: losses, checkpoints, state
 * hashes) and one process (1e-5 relative), every rank holding a share of the
 * optimizer state that adds up to the whole, a bit-exact resume on the same
 * layout, a NaN gradient on one rank skipping the step on all as replicated
 * does, and checkpoints across layouts: the N-rank ZeRO checkpoint resumed
 * on one process (and, on 4 ranks, on 2 ZeRO ranks of a split handle), and
 * one process's checkpoint resumed on N ZeRO ranks, each ending within 1e-5 of
 * the uninterrupted runs. The device path (lm_train_options.backend: the
 * model, the optimizer and the gradient sums in a backend's memory, here the
 * CPU backend's, summed by the staged engine): replicated it ends with the
 * host path's bits, and ZeRO-1 on it (the device optimizer over this rank's
 * range, the reduce-scatter and all-gather on the backend's blocks, the norm
 * from the device sums) equals it bit for bit, resumes bit-exactly, and its
 * checkpoint continues on one process's host path. Built without MPI,
 * `--mpi N` reports every case skipped.
 * The runs of test_dp_config last DP_STEPS steps: the 20 steps said here (and
 * the steps 10, 8 and 15 within them) are the Release suite's; a sanitizer
 * build runs 10 (5, 4 and 7; tests/test_models.h). */
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"
#include "test_ranks.h"


/* test_dp.c's model (test_models.h) with gradient clipping acting (norms 1.0
 * to 1.4): the scale takes the global norm across ranks. */
static lm_config zero_config(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.grad_clip = 1.0f;
    return c;
}

/* The backend the runs train on (NULL: the host path; lm_backend_cpu(): the device path on the CPU). */
static lm_backend *run_backend;

/* zero_config in two stages (32 then 64 tokens a sequence, 4 sequences a micro-batch): the stage
 * change makes a new model and points the optimizer at it. */
static int two_stages;

/* One run over handle `on` (NULL: this process alone), ZeRO stage `zero`. */
static lm_status train(const char *run, lm_comm *on, int zero, int resume, int64_t stop_after, lm_train_result *r) {
    lm_config c = zero_config();
    if (two_stages) {
        c.n_stages = 2;
        for (int i = 0; i < 2; i++) {
            lm_stage *st = &c.stages[i];
            memset(st, 0, sizeof *st);
            snprintf(st->name, sizeof st->name, "%d", 32 << i);
            st->seq_len = 32 << i;
            st->steps = i ? DP_STEPS - DP_HALF : DP_HALF;
            st->batch_tokens = 4 * (int64_t)st->seq_len;
            st->lr_scale = 1.0f;
        }
    }
    lm_train_options o = lm_train_options_default(dir(run));
    o.backend = run_backend;
    o.progress = NULL;
    o.val_batches = 2;
    o.stage_eval_batches = 0;
    o.resume = resume;
    o.stop_after = stop_after;
    o.comm = on;
    o.zero = zero;
    memset(r, 0, sizeof *r);
    return lm_train(&c, &o, r);
}

/* ---- alone ---- */

static void test_zero_without_ranks_or_of_another_stage_is_refused(void) {
    lm_train_result r;
    lm_status s = train("alone", NULL, 1, 0, 0, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "--comm mpi"), "status %d: %s", (int)s, lm_last_error());
    lm_comm *self;
    CHECK(!lm_comm_open(LM_COMM_SELF, &self), "%s", lm_last_error());
    s = train("stage2", self, 2, 0, 0, &r);
    CHECK(s == LM_ERR_ARG && strstr(lm_last_error(), "stage 2"), "status %d: %s", (int)s, lm_last_error());
    lm_comm_close(self);
    CHECK(access(dir("alone/config.json"), F_OK) != 0 && access(dir("stage2/config.json"), F_OK) != 0,
          "a refused run wrote its config");
    char out[16384], args[900];
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --zero 1", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--comm mpi"), "%s", out);
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --comm mpi --zero 3", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--zero"), "%s", out);
    CHECK(run_cli("train --help", out, sizeof out) == 0 && strstr(out, "--zero S") && strstr(out, "ZeRO-1"),
          "--help lacks --zero");
}

/* On the one-rank engine ZeRO-1 holds the whole state and is the plain run, bit for bit. */
static void test_zero_on_one_rank_is_the_plain_run(void) {
    lm_comm *self;
    CHECK(!lm_comm_open(LM_COMM_SELF, &self), "%s", lm_last_error());
    lm_train_result a, b;
    CHECK(!train("self-plain", NULL, 0, 0, 6, &a) && a.step == 6, "plain: %s", lm_last_error());
    CHECK(!train("self-zero", self, 1, 0, 6, &b) && b.step == 6, "zero: %s", lm_last_error());
    lm_comm_close(self);
    CHECK(a.params_hash == b.params_hash && a.balance_hash == b.balance_hash, "the states differ");
    CHECK(a.optimizer_state_bytes == b.optimizer_state_bytes && a.optimizer_state_bytes > 0,
          "optimizer bytes %zu and %zu", a.optimizer_state_bytes, b.optimizer_state_bytes);
    double w;
    CHECK(tensors_close("self-plain", "self-zero", 6, "trainer.safetensors", 0, &w), "trainer state");
}

/* ---- over the ranks ---- */

static lm_train_result dp_result, zero_result, one_result;
static int runs_ok;

/* "dp" (replicated, N ranks), "zero" (ZeRO-1, N ranks), "one" (one process):
 * the same global batch, 20 steps. */
static void test_zero1_equals_replicated_data_parallel_bit_for_bit(void) {
    CHECK(!train("dp", comm, 0, 0, 0, &dp_result), "dp: %s", lm_last_error());
    CHECK(!train("zero", comm, 1, 0, 0, &zero_result), "zero: %s", lm_last_error());
    if (me == 0) CHECK(!train("one", NULL, 0, 0, 0, &one_result), "one: %s", lm_last_error());
    runs_ok = all_ok();
    if (!runs_ok) return;
    CHECK(zero_result.step == DP_STEPS && zero_result.skipped == 0, "zero: %lld steps, %lld skipped",
          (long long)zero_result.step, (long long)zero_result.skipped);
    /* the state hashes cover parameters, every tensor's optimizer state (gathered from the owners) and counters */
    CHECK(zero_result.params_hash == dp_result.params_hash, "parameters or optimizer state differ from replicated");
    CHECK(zero_result.balance_hash == dp_result.balance_hash, "balancing state differs from replicated");
    CHECK(same_on_every_rank(zero_result.params_hash) && same_on_every_rank(zero_result.balance_hash),
          "the ranks' hashes differ");
    /* the checkpoints' state crossed to rank 0 one piece of an owner's range at a time: rank 0 held no more
     * than the largest other rank's range, never the whole state; the others, and the replicated run, nothing */
    size_t shares[64] = {0}, most = 0;
    CHECK(R <= 64 && !lm_comm_all_gather(comm, &zero_result.optimizer_state_bytes, shares, sizeof(size_t)),
          "%s", lm_last_error());
    for (int q = 1; q < R && q < 64; q++) most = shares[q] > most ? shares[q] : most;
    CHECK(me == 0 ? zero_result.ckpt_gathered_bytes > 0 && zero_result.ckpt_gathered_bytes <= most &&
                        zero_result.ckpt_gathered_bytes < dp_result.optimizer_state_bytes
                  : zero_result.ckpt_gathered_bytes == 0,
          "rank %d held %zu bytes for the checkpoints (the largest other range %zu, the whole state %zu)", me,
          zero_result.ckpt_gathered_bytes, most, dp_result.optimizer_state_bytes);
    CHECK(dp_result.ckpt_gathered_bytes == 0, "the replicated run held %zu bytes", dp_result.ckpt_gathered_bytes);
    if (me != 0) return;
    printf("     a checkpoint held %zu bytes of received state at most (the whole state %zu)\n",
           zero_result.ckpt_gathered_bytes, dp_result.optimizer_state_bytes);
    double a[32], b[32];
    int na = read_metric("zero", "train", "loss", a, 32), nb = read_metric("dp", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK(a[i] == b[i], "step %d: loss %.9g vs %.9g", i + 1, a[i], b[i]);
    na = read_metric("zero", "train", "grad_norm", a, 32);
    nb = read_metric("dp", "train", "grad_norm", b, 32);
    int clipped = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK(a[i] == b[i], "step %d: gradient norm %.9g vs %.9g", i + 1, a[i], b[i]);
        clipped += b[i] > 1.0;
    }
    CHECK(clipped > 0, "clipping acted in none of %d steps: the test does not see it", nb);
    double w;
    for (int step = 5; step <= DP_STEPS; step += 5) {
        CHECK(tensors_close("zero", "dp", step, "model.safetensors", 0, &w), "parameters at step %d", step);
        CHECK(tensors_close("zero", "dp", step, "trainer.safetensors", 0, &w), "trainer state at step %d", step);
        CHECK(same_checkpoint_files("zero", "dp", step), "the files of checkpoint %d differ", step);
    }
    double wp, ws, worst = 0;
    na = read_metric("zero", "train", "loss", a, 32);
    nb = read_metric("one", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) {
        CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss vs one process");
        worst = fmax(worst, fabs(a[i] - b[i]) / fabs(b[i]));
    }
    CHECK(b[DP_STEPS - 1] < b[0] - 0.5, "the run learns: loss %.3f -> %.3f", b[0], b[DP_STEPS - 1]);
    CHECK(tensors_close("zero", "one", DP_STEPS, "model.safetensors", 1e-5, &wp), "parameters vs one process");
    CHECK(tensors_close("zero", "one", DP_STEPS, "trainer.safetensors", 1e-5, &ws), "optimizer state vs one process");
    printf("     ZeRO-1 on %d ranks = replicated bit for bit; vs one process: loss %.2e, parameters %.2e, "
           "optimizer/balance %.2e relative\n", R, worst, wp, ws);
}

/* Each rank holds a share of the optimizer state; the shares add up to the whole. */
static void test_every_rank_holds_a_share_of_the_optimizer_state(void) {
    if (!runs_ok) SKIP("the runs failed");
    uint64_t mine = zero_result.optimizer_state_bytes, all[64];
    CHECK(R <= 64 && !lm_comm_all_gather(comm, &mine, all, sizeof mine), "%s", lm_last_error());
    uint64_t sum = 0, most = 0;
    for (int r = 0; r < R; r++) {
        sum += all[r];
        most = all[r] > most ? all[r] : most;
        CHECK(all[r] > 0, "rank %d holds no optimizer state", r);
    }
    CHECK(sum == dp_result.optimizer_state_bytes, "the shares add up to %llu bytes, the whole is %zu",
          (unsigned long long)sum, dp_result.optimizer_state_bytes);
    /* balanced to whole tensors: the largest share well under the whole */
    CHECK(most * (uint64_t)R < 2 * sum, "the largest share %llu of %llu bytes over %d ranks", (unsigned long long)most,
          (unsigned long long)sum, R);
    printf("     optimizer state a rank: %llu bytes at most of %zu replicated\n", (unsigned long long)most,
           dp_result.optimizer_state_bytes);
}

static void test_zero1_resume_on_the_same_layout_is_bit_exact(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result r;
    CHECK(!train("zero-resumed", comm, 1, 0, DP_STOP, &r) && r.step == DP_STOP, "first part: %s", lm_last_error());
    CHECK(!train("zero-resumed", comm, 1, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    CHECK(r.params_hash == zero_result.params_hash && r.balance_hash == zero_result.balance_hash,
          "the resumed run's state differs from the uninterrupted run's");
    if (me != 0) return;
    double w;
    CHECK(tensors_close("zero", "zero-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(tensors_close("zero", "zero-resumed", DP_STEPS, "trainer.safetensors", 0, &w), "trainer state bit-identical");
    losses_close("zero", "zero-resumed", DP_STEPS, 0);
}

/* A NaN left in a gradient on the last rank only (step 4) reaches one owner's
 * range through the reduce-scatter: its partial norm, hence the global norm,
 * is non-finite on every rank, and every rank skips the step, as the
 * replicated run does; the runs then go on alike. */
static void test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result r[2];
    for (int zero = 0; zero < 2; zero++) {
        lm_config c = zero_config();
        c.eval_every = 0;
        c.ckpt_every = 0;
        c.steps = 8;
        lm_train_options o = lm_train_options_default(dir(zero ? "zero-fault" : "dp-fault"));
        o.progress = NULL;
        o.val_batches = 1;
        o.stage_eval_batches = 0;
        o.comm = comm;
        o.zero = zero;
        o.inject_fault = LM_FAULT_GRADIENT;
        o.inject_fault_step = me == R - 1 ? 3 : -1;
        CHECK(!lm_train(&c, &o, &r[zero]), "%s: %s", zero ? "zero" : "dp", lm_last_error());
        CHECK(r[zero].skipped == 1 && r[zero].step == 8, "%s: %lld skipped of %lld", zero ? "zero" : "dp",
              (long long)r[zero].skipped, (long long)r[zero].step);
    }
    CHECK(r[1].params_hash == r[0].params_hash && r[1].balance_hash == r[0].balance_hash,
          "the ZeRO-1 run's state differs from the replicated run's");
    CHECK(same_on_every_rank(r[1].params_hash), "the ranks differ after the skipped step");
    if (me == 0) {
        double a[16];
        CHECK(read_metric("zero-fault", "skip", "step", a, 16) == 1 && a[0] == 3, "the skip line of step 4");
    }
}

/* Run `run` ended at step 20 within 1e-5 of the uninterrupted runs (rank 0). */
static void close_to_uninterrupted(const char *run) {
    double w1, w2;
    CHECK(tensors_close(run, "one", DP_STEPS, "model.safetensors", 1e-5, &w1), "%s: parameters vs one process", run);
    CHECK(tensors_close(run, "zero", DP_STEPS, "model.safetensors", 1e-5, &w2), "%s: parameters vs ZeRO-1", run);
    losses_close(run, "one", DP_STEPS, 1e-5);
    printf("     %s: parameters within %.2e (one process), %.2e (ZeRO-1) relative\n", run, w1, w2);
}

/* The N-rank ZeRO-1 checkpoint of step 10 resumed on one process without ZeRO. */
static void test_zero1_checkpoint_resumes_on_one_process(void) {
    if (!runs_ok) SKIP("the runs failed");
    copy_run_at("zero", "zero-then-one", DP_HALF);
    if (me != 0) return;
    lm_train_result r;
    CHECK(!train("zero-then-one", NULL, 0, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
    close_to_uninterrupted("zero-then-one");
}

/* One process's checkpoint of step 10 resumed on the N ranks with ZeRO-1. */
static void test_one_process_checkpoint_resumes_on_zero1_ranks(void) {
    if (!runs_ok) SKIP("the runs failed");
    copy_run_at("one", "one-then-zero", DP_HALF);
    lm_train_result r;
    CHECK(!train("one-then-zero", comm, 1, 1, 0, &r) && r.step == DP_STEPS, "ranks: %s", lm_last_error());
    CHECK(same_on_every_rank(r.params_hash), "the ranks' hashes differ");
    if (me == 0) close_to_uninterrupted("one-then-zero");
}

/* On 4 ranks: the 4-rank ZeRO-1 checkpoint resumed on 2 ranks with ZeRO-1
 * (ranks 0 and 1 of a split handle; another cut of the tensors), and that
 * 2-rank run's checkpoint resumed on the 4 ranks again. */
static void test_zero1_checkpoint_resumes_on_another_number_of_ranks(void) {
    if (!runs_ok) SKIP("the runs failed");
    if (R < 4) SKIP("needs 4 ranks (2 of them resume)");
    copy_run_at("zero", "zero-four-then-two", DP_HALF);
    lm_comm *two = NULL;
    CHECK(!lm_comm_split(comm, me < 2 ? 0 : -1, &two), "%s", lm_last_error());
    CHECK((me < 2) == (two != NULL), "rank %d: split handle %p", me, (void *)two);
    lm_train_result r;
    if (two) {
        CHECK(lm_comm_size(two) == 2 && lm_comm_rank(two) == me, "split: rank %d of %d", lm_comm_rank(two),
              lm_comm_size(two));
        CHECK(!train("zero-four-then-two", two, 1, 1, DP_LATE, &r) && r.step == DP_LATE, "2 ranks: %s",
              lm_last_error());
        lm_comm_close(two);
    }
    lm_comm_barrier(comm);
    CHECK(!train("zero-four-then-two", comm, 1, 1, 0, &r) && r.step == DP_STEPS, "4 ranks again: %s", lm_last_error());
    if (me == 0) close_to_uninterrupted("zero-four-then-two");
}

/* ---- the device path, on the CPU backend ---- */

static lm_train_result dev_result, devz_result;
static int dev_ok;

/* The same runs on the device path (staged gradient sums, the device optimizer, its clipping):
 * replicated, the host path's bits; ZeRO-1, the replicated device run's bits. */
static void test_zero1_on_the_device_path_equals_its_replicated_run(void) {
    if (!runs_ok) SKIP("the runs failed");
    run_backend = lm_backend_cpu();
    CHECK(!train("dev", comm, 0, 0, 0, &dev_result), "dev: %s", lm_last_error());
    CHECK(!train("dev-zero", comm, 1, 0, 0, &devz_result), "dev-zero: %s", lm_last_error());
    run_backend = NULL;
    dev_ok = all_ok();
    if (!dev_ok) return;
    CHECK(dev_result.step == DP_STEPS && devz_result.step == DP_STEPS && devz_result.skipped == 0,
          "%lld and %lld steps", (long long)dev_result.step, (long long)devz_result.step);
    CHECK(dev_result.params_hash == dp_result.params_hash && dev_result.balance_hash == dp_result.balance_hash,
          "the device path's state differs from the host path's");
    CHECK(devz_result.params_hash == dev_result.params_hash && devz_result.balance_hash == dev_result.balance_hash,
          "ZeRO-1 on the device path differs from the replicated device run");
    CHECK(same_on_every_rank(devz_result.params_hash), "the ranks' hashes differ");
    CHECK(devz_result.optimizer_state_bytes == zero_result.optimizer_state_bytes,
          "rank %d holds %zu bytes of state on the device path, %zu on the host path", me,
          devz_result.optimizer_state_bytes, zero_result.optimizer_state_bytes);
    if (me != 0) return;
    losses_close("dev-zero", "dev", DP_STEPS, 0);
    losses_close("dev", "dp", DP_STEPS, 0);
    for (int step = 5; step <= DP_STEPS; step += 5) {
        CHECK(same_checkpoint_files("dev-zero", "dev", step), "the files of checkpoint %d differ (ZeRO-1)", step);
        CHECK(same_checkpoint_files("dev", "dp", step), "the files of checkpoint %d differ (device path)", step);
    }
    printf("     the device path on the CPU backend: replicated = the host path, ZeRO-1 = replicated, bit for bit\n");
}

/* A ZeRO-1 device-path run stopped between checkpoints resumes on the same layout to the same bits, and
 * its checkpoint at the half continues on one process's host path. */
static void test_zero1_on_the_device_path_resumes(void) {
    if (!dev_ok) SKIP("the device-path runs failed");
    lm_train_result r;
    run_backend = lm_backend_cpu();
    CHECK(!train("dev-zero-resumed", comm, 1, 0, DP_STOP, &r) && r.step == DP_STOP, "first part: %s",
          lm_last_error());
    CHECK(!train("dev-zero-resumed", comm, 1, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    run_backend = NULL;
    CHECK(r.params_hash == devz_result.params_hash && r.balance_hash == devz_result.balance_hash,
          "the resumed run's state differs from the uninterrupted run's");
    copy_run_at("dev-zero", "dev-zero-then-one", DP_HALF);
    if (me != 0) return;
    double w;
    CHECK(tensors_close("dev-zero", "dev-zero-resumed", DP_STEPS, "trainer.safetensors", 0, &w),
          "trainer state bit-identical");
    CHECK(!train("dev-zero-then-one", NULL, 0, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
    close_to_uninterrupted("dev-zero-then-one");
}

/* Two stages: the device optimizer over this rank's range, pointed at the second stage's model, keeps
 * ZeRO-1 on the device path equal to the host path's replicated run, bit for bit. */
static void test_zero1_on_the_device_path_through_a_stage_change(void) {
    if (!dev_ok) SKIP("the device-path runs failed");
    lm_train_result host, devz;
    two_stages = 1;
    CHECK(!train("staged-dp", comm, 0, 0, 0, &host), "host path: %s", lm_last_error());
    run_backend = lm_backend_cpu();
    CHECK(!train("staged-dev-zero", comm, 1, 0, 0, &devz), "device path, ZeRO-1: %s", lm_last_error());
    run_backend = NULL;
    two_stages = 0;
    if (!all_ok()) return;
    CHECK(host.step == DP_STEPS && devz.step == DP_STEPS, "%lld and %lld steps", (long long)host.step,
          (long long)devz.step);
    CHECK(devz.params_hash == host.params_hash && devz.balance_hash == host.balance_hash,
          "ZeRO-1 on the device path differs from the host path's replicated run after the stage change");
    if (me != 0) return;
    losses_close("staged-dev-zero", "staged-dp", DP_STEPS, 0);
    CHECK(same_checkpoint_files("staged-dev-zero", "staged-dp", DP_STEPS), "the final checkpoints differ");
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        snprintf(root, sizeof root, "/tmp/longmoe_test_zero_%d", (int)getpid());
        mkdir(root, 0755);
        RUN(test_zero_without_ranks_or_of_another_stage_is_refused);
        RUN(test_zero_on_one_rank_is_the_plain_run);
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", root);
        if (system(cmd)) fprintf(stderr, "could not remove %s\n", root);
        return test_summary();
    }
    int rc = ranks_open(want_ranks, "zero");
    if (rc) return rc;
    test_dp_steps_note();
    RUN(test_zero1_equals_replicated_data_parallel_bit_for_bit);
    RUN(test_every_rank_holds_a_share_of_the_optimizer_state);
    RUN(test_zero1_resume_on_the_same_layout_is_bit_exact);
    RUN(test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank);
    RUN(test_zero1_checkpoint_resumes_on_one_process);
    RUN(test_one_process_checkpoint_resumes_on_zero1_ranks);
    RUN(test_zero1_checkpoint_resumes_on_another_number_of_ranks);
    RUN(test_zero1_on_the_device_path_equals_its_replicated_run);
    RUN(test_zero1_on_the_device_path_resumes);
    RUN(test_zero1_on_the_device_path_through_a_stage_change);
    ranks_close();
    return test_summary();
}
