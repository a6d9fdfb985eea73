/* Owner-only expert state under expert parallelism (docs/scaleout.md,
 * "Expert parallelism (CPU ranks)").
 *
 * Under mpirun (`mpirun -np N test_ep_state --mpi N`, ctest's
 * test_ep_state_mpi2 and test_ep_state_mpi4): a 20-step run with --ep on N
 * ranks, each rank holding only its routed experts' optimizer state, against
 * the same run with the experts' state replicated (the layout before
 * owner-only state: bit for bit the losses, gradient norms, checkpoints of
 * steps 5 to 20 and state hashes) and one process (1e-5 relative); the
 * bytes of state and of gradients a rank holds (the replicated tensors' plus
 * 1/N of the experts'), a rank's model created with that share of the
 * parameter and gradient blocks (the whole blocks never allocated); the
 * checkpoints' files the replicated layout's bytes,
 * written with one expert tensor at a time crossing to rank 0; a diverged
 * replica of a replicated tensor refused before a checkpoint; the balancing state on every rank the same; a bit-exact resume
 * on the same layout; checkpoints across layouts (replicated-state EP and
 * ZeRO-1 EP checkpoints resumed with owner-only state bit for bit, the
 * owner-only checkpoint on one process, one process's on the N ranks and, on
 * 4 ranks, the 4-rank checkpoint on 2 ranks of a split handle and back);
 * expert tensors whose norm blocks cross the owners' slices; a staged run
 * (the second stage's model under EP too); a NaN in an
 * owner's expert gradient skipping the step on every rank as the
 * replicated layout does; gradient buckets of one tensor and of 4 KiB
 * bit-identical to the one pass after the backward (6 steps, owner-only
 * state). Alone, or built without MPI, every case is skipped.
 * The runs of test_dp_config last DP_STEPS steps: the 20 steps said here (and
 * the steps 10, 8 and 15 within them) are the Release suite's; a sanitizer
 * build runs 10 (5, 4 and 7; tests/test_models.h). */
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/comm.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"
#include "test_ranks.h"


/* test_dp.c's model (test_models.h: MoE of 8 experts, histogram estimator)
 * with gradient clipping acting, so the global norm matters. */
static lm_config ep_config(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.grad_clip = 1.0f;
    return c;
}

enum { ONE, EP, EP_REPLICATED, EP_ZERO };

/* When set (>= 0): the runs' train.grad_bucket_mb, and short runs of 6 steps
 * with one checkpoint, at the end (the bucket cases). */
static float bucket_mb = -1.0f;
enum { BUCKET_STEPS = 6 };

/* The backend the runs train on (NULL: the host path; lm_backend_cpu(): the device path on the CPU). */
static lm_backend *run_backend;

/* One run over handle `on` (NULL: this process alone, without EP) in layout `how`. */
static lm_status train(const char *run, lm_comm *on, int how, int resume, int64_t stop_after, lm_train_result *r) {
    lm_config c = ep_config();
    if (bucket_mb >= 0) {
        c.grad_bucket_mb = bucket_mb;
        c.steps = BUCKET_STEPS;
        c.eval_every = 0;
        c.ckpt_every = 0;
    }
    lm_train_options o = lm_train_options_default(dir(run));
    o.backend = run_backend;
    o.progress = NULL;
    o.val_batches = 2;
    o.stage_eval_batches = 0;
    o.resume = resume;
    o.stop_after = stop_after;
    o.comm = on;
    o.expert_parallel = how != ONE;
    o.ep_replicated_state = how == EP_REPLICATED;
    o.zero = how == EP_ZERO;
    memset(r, 0, sizeof *r);
    return lm_train(&c, &o, r);
}
static lm_train_result ep_result, rep_result;
static int runs_ok;

/* "ep" (owner-only), "rep" (replicated expert state), "one" (one process): the
 * same global batch, 20 steps. */
static void test_owner_only_state_equals_replicated_state_bit_for_bit(void) {
    lm_train_result one;
    CHECK(!train("ep", comm, EP, 0, 0, &ep_result), "ep: %s", lm_last_error());
    CHECK(!train("rep", comm, EP_REPLICATED, 0, 0, &rep_result), "rep: %s", lm_last_error());
    if (me == 0) CHECK(!train("one", NULL, ONE, 0, 0, &one), "one: %s", lm_last_error());
    runs_ok = all_ok();
    if (!runs_ok) return;
    CHECK(ep_result.step == DP_STEPS && ep_result.skipped == 0, "ep: %lld steps, %lld skipped",
          (long long)ep_result.step, (long long)ep_result.skipped);
    /* parameters, every tensor's optimizer state (gathered from the owners), counters */
    CHECK(ep_result.params_hash == rep_result.params_hash, "parameters or optimizer state differ from replicated");
    CHECK(ep_result.grad_norm_hash == rep_result.grad_norm_hash, "the global gradient norms differ in their bits");
    CHECK(ep_result.balance_hash == rep_result.balance_hash, "balancing state differs from replicated");
    if (me != 0) return;
    double a[32], b[32];
    int na = read_metric("ep", "train", "loss", a, 32), nb = read_metric("rep", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK(a[i] == b[i], "step %d: loss %.9g vs %.9g", i + 1, a[i], b[i]);
    na = read_metric("ep", "train", "grad_norm", a, 32);
    nb = read_metric("rep", "train", "grad_norm", b, 32);
    int clipped = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK(a[i] == b[i], "step %d: gradient norm %.9g vs %.9g", i + 1, a[i], b[i]);
        clipped += b[i] > 1.0;
    }
    CHECK(clipped > 0, "clipping acted in none of %d steps: the test does not see it", nb);
    na = read_metric("ep", "eval", "val_loss", a, 32);
    nb = read_metric("rep", "eval", "val_loss", b, 32);
    CHECK(na == 2 && nb == 2, "eval lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK(a[i] == b[i], "validation loss %.9g vs %.9g", a[i], b[i]);
    double w;
    for (int step = 5; step <= DP_STEPS; step += 5) {
        CHECK(tensors_close("ep", "rep", step, "model.safetensors", 0, &w), "parameters at step %d", step);
        CHECK(tensors_close("ep", "rep", step, "trainer.safetensors", 0, &w), "trainer state at step %d", step);
        /* the files themselves, header and checksum included: the owner-only run streams its experts to rank 0 */
        CHECK(same_checkpoint_files("ep", "rep", step), "the files of checkpoint %d differ", step);
    }
    double wp, ws, worst = 0;
    na = read_metric("ep", "train", "loss", a, 32);
    nb = read_metric("one", "train", "loss", b, 32);
    CHECK(na == DP_STEPS && nb == DP_STEPS, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) {
        CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss vs one process");
        worst = fmax(worst, fabs(a[i] - b[i]) / fabs(b[i]));
    }
    CHECK(b[DP_STEPS - 1] < b[0] - 0.5, "the run learns: loss %.3f -> %.3f", b[0], b[DP_STEPS - 1]);
    CHECK(tensors_close("ep", "one", DP_STEPS, "model.safetensors", 1e-5, &wp), "parameters vs one process");
    CHECK(tensors_close("ep", "one", DP_STEPS, "trainer.safetensors", 1e-5, &ws), "optimizer state vs one process");
    printf("     owner-only EP on %d ranks = replicated-state EP bit for bit; vs one process: loss %.2e, "
           "parameters %.2e, optimizer/balance %.2e relative\n", R, worst, wp, ws);
}

/* A rank holds the replicated tensors' state and 1/N of the experts' (Muon: one
 * float a weight); the same on every rank. */
static void test_a_rank_holds_only_its_experts_state(void) {
    if (!runs_ok) SKIP("the runs failed");
    const size_t experts = expert_floats(ep_config()) * sizeof(float), whole = rep_result.optimizer_state_bytes;
    CHECK(experts > 0, "no expert tensors");
    const size_t want = whole - experts + experts / (size_t)R;
    CHECK(ep_result.optimizer_state_bytes == want, "rank %d holds %zu bytes of optimizer state, expected %zu (%zu "
          "replicated, experts %zu)", me, ep_result.optimizer_state_bytes, want, whole, experts);
    CHECK(ep_result.optimizer_state_bytes < whole, "no saving");
    printf("     optimizer state a rank: %zu bytes instead of %zu (experts' %zu split %d ways)\n",
           ep_result.optimizer_state_bytes, whole, experts, R);
}

/* A rank's gradient block holds the replicated tensors and only its own
 * experts' slices (lm_train_result.gradient_bytes: 1/N of the experts'), while
 * the run equals the replicated layout bit for bit and one process within
 * 1e-5 (the case above); the replicated layout, whose expert gradients go
 * through the all-reduce, keeps one process's whole block. */
static void test_a_rank_holds_only_its_experts_gradients(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_expert_share("gradients", rep_result.gradient_bytes, ep_result.gradient_bytes,
                       param_floats(ep_config()) * sizeof(float), expert_floats(ep_config()) * sizeof(float),
                       R);
}

/* A rank's parameter block holds the replicated tensors and only its own
 * experts' slices of the weights too (lm_train_result.parameter_bytes: 1/N of
 * the experts'), the run still the replicated layout's bits (above: its
 * checkpoints and hashes gather the experts whole, its evaluations one MoE
 * layer's experts at a time, lm_train_result.eval_gathered_bytes); the
 * replicated layout keeps every weight. */
static void test_a_rank_holds_only_its_experts_weights(void) {
    if (!runs_ok) SKIP("the runs failed");
    const size_t experts = expert_floats(ep_config()) * sizeof(float);
    check_expert_share("parameters", rep_result.parameter_bytes, ep_result.parameter_bytes,
                       param_floats(ep_config()) * sizeof(float), experts, R);
    /* the evaluations gathered one MoE layer's experts at a time; the replicated layout nothing */
    lm_config c = ep_config();
    lm_model *p = NULL;
    CHECK(!lm_model_plan(&c, c.batch_size, c.seq_len, LM_DEVICE_CPU, &p), "%s", lm_last_error());
    const size_t nmoe = p ? (size_t)lm_model_num_moe_layers(p) : 0;
    lm_model_free(p);
    CHECK(rep_result.eval_gathered_bytes == 0, "the replicated layout gathered %zu bytes", rep_result.eval_gathered_bytes);
    CHECK(nmoe > 1 && ep_result.eval_gathered_bytes == (R > 1 ? experts / nmoe : 0),
          "rank %d's evaluations held %zu gathered bytes at most, one of %zu MoE layers' experts is %zu", me,
          ep_result.eval_gathered_bytes, nmoe, nmoe ? experts / nmoe : 0);
    printf("     an evaluation gathers %zu bytes at most (one of %zu MoE layers' experts; whole %zu)\n",
           ep_result.eval_gathered_bytes, nmoe, experts);
}

/* A rank's model is created with only its share of the blocks
 * (lm_model_create_expert_owned): the most parameter and gradient bytes it
 * ever held are its two kept blocks, never the whole model's, while the run
 * equals the replicated layout bit for bit (above: losses, norms, hashes,
 * checkpoint files). */
static void test_a_rank_never_allocates_the_whole_model(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_created_share(&ep_result, &rep_result, ep_config(), R);
}

/* A checkpoint under owner-only experts reaches rank 0's files one routed
 * experts' tensor at a time (its files are the replicated layout's bytes,
 * above): rank 0 holds one expert tensor beyond its slices while it writes,
 * at most one MoE layer's experts, the other ranks nothing more. */
static void test_a_checkpoint_holds_one_expert_tensor_at_a_time(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_checkpoint_buffer(&ep_result, &rep_result, ep_config(), R);
}

/* A replica that diverged is refused before the checkpoint, on every rank
 * and naming it: the last rank's copy of a replicated tensor (the experts'
 * slices are held once here, so there is no copy of them to compare). */
static void test_a_diverged_replica_is_refused(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_options o = lm_train_options_default(dir("diverged"));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    o.comm = comm;
    o.expert_parallel = 1;
    check_diverged_replica_refused(ep_config(), o, R - 1, "embed");
}

/* The parameters, optimizer-state hash and QB balancing state (bias, loads) the same on every rank. */
static void test_every_rank_holds_the_same_parameters_and_bias(void) {
    if (!runs_ok) SKIP("the runs failed");
    CHECK(same_on_every_rank(ep_result.params_hash), "parameters or optimizer state differ between ranks");
    CHECK(same_on_every_rank(ep_result.balance_hash), "balancing state differs between ranks");
    if (me == 0) {
        double h = largest_bias("ep", DP_STEPS);
        CHECK(h > 1e-3, "the balancing bias moved: largest |b| %.3g", h);
    }
}

static void test_resume_on_the_same_layout_is_bit_exact(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result r;
    CHECK(!train("ep-resumed", comm, EP, 0, DP_STOP, &r) && r.step == DP_STOP, "first part: %s", lm_last_error());
    CHECK(!train("ep-resumed", comm, EP, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    CHECK(r.params_hash == ep_result.params_hash && r.balance_hash == ep_result.balance_hash,
          "the resumed run's state differs from the uninterrupted run's");
    /* the resumed model was created with its share and loaded its slices */
    CHECK(r.block_peak_bytes == ep_result.block_peak_bytes, "the resumed rank held %zu block bytes, the run %zu",
          r.block_peak_bytes, ep_result.block_peak_bytes);
    if (me != 0) return;
    double w;
    CHECK(tensors_close("ep", "ep-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(tensors_close("ep", "ep-resumed", DP_STEPS, "trainer.safetensors", 0, &w), "trainer state bit-identical");
}

/* Checkpoints of the replicated-state layout and of ZeRO-1 with EP (both the
 * same bits) resumed with owner-only state, and the owner-only checkpoint
 * resumed with replicated state: the uninterrupted run's bits. */
static void test_checkpoints_of_the_other_ep_layouts_resume_bit_for_bit(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result r, z;
    CHECK(!train("zero", comm, EP_ZERO, 0, DP_HALF, &z) && z.step == DP_HALF, "ZeRO-1 EP: %s", lm_last_error());
    copy_run_at("rep", "rep-then-ep", DP_HALF);
    CHECK(!train("rep-then-ep", comm, EP, 1, 0, &r) && r.step == DP_STEPS, "rep then ep: %s", lm_last_error());
    CHECK(r.params_hash == ep_result.params_hash, "replicated-state checkpoint resumed owner-only: state differs");
    CHECK(!train("zero", comm, EP, 1, 0, &r) && r.step == DP_STEPS, "zero then ep: %s", lm_last_error());
    CHECK(r.params_hash == ep_result.params_hash, "ZeRO-1 EP checkpoint resumed owner-only: state differs");
    copy_run_at("ep", "ep-then-rep", DP_HALF);
    CHECK(!train("ep-then-rep", comm, EP_REPLICATED, 1, 0, &r) && r.step == DP_STEPS, "ep then rep: %s",
          lm_last_error());
    CHECK(r.params_hash == ep_result.params_hash, "owner-only checkpoint resumed replicated: state differs");
    if (me != 0) return;
    double w;
    CHECK(tensors_close("rep-then-ep", "ep", DP_STEPS, "trainer.safetensors", 0, &w), "rep then ep: trainer state");
    CHECK(tensors_close("zero", "ep", DP_STEPS, "trainer.safetensors", 0, &w), "zero then ep: trainer state");
    CHECK(tensors_close("ep-then-rep", "ep", DP_STEPS, "model.safetensors", 0, &w), "ep then rep: parameters");
}

/* Run `run` ended at step 20 within 1e-5 of the uninterrupted runs (rank 0). */
static void close_to_uninterrupted(const char *run) {
    double w1, w2;
    CHECK(tensors_close(run, "one", DP_STEPS, "model.safetensors", 1e-5, &w1), "%s: parameters vs one process", run);
    CHECK(tensors_close(run, "ep", DP_STEPS, "model.safetensors", 1e-5, &w2), "%s: parameters vs EP", run);
    CHECK(tensors_close(run, "one", DP_STEPS, "trainer.safetensors", 1e-5, &w2), "%s: optimizer state vs one process",
          run);
    losses_close(run, "one", DP_STEPS, 1e-5);
    printf("     %s: parameters within %.2e (one process), %.2e (EP) relative\n", run, w1, w2);
}

/* The owner-only checkpoint of step 10 on one process without EP, and one
 * process's checkpoint on the N ranks with owner-only state. */
static void test_checkpoints_resume_between_one_process_and_the_ranks(void) {
    if (!runs_ok) SKIP("the runs failed");
    copy_run_at("ep", "ep-then-one", DP_HALF);
    copy_run_at("one", "one-then-ep", DP_HALF);
    lm_train_result r;
    CHECK(!train("one-then-ep", comm, EP, 1, 0, &r) && r.step == DP_STEPS, "ranks: %s", lm_last_error());
    CHECK(same_on_every_rank(r.params_hash) && same_on_every_rank(r.balance_hash), "the ranks' hashes differ");
    if (me != 0) return;
    CHECK(!train("ep-then-one", NULL, ONE, 1, 0, &r) && r.step == DP_STEPS, "one process: %s", lm_last_error());
    close_to_uninterrupted("ep-then-one");
    close_to_uninterrupted("one-then-ep");
}

/* On 4 ranks: the 4-rank checkpoint resumed on 2 EP ranks (ranks 0 and 1 of a
 * split handle: 4 experts a rank instead of 2) to step 15, and that on the 4
 * ranks again. */
static void test_checkpoint_resumes_on_another_number_of_ranks(void) {
    if (!runs_ok) SKIP("the runs failed");
    if (R < 4) SKIP("needs 4 ranks (2 of them resume)");
    copy_run_at("ep", "ep-four-then-two", DP_HALF);
    lm_comm *two = NULL;
    CHECK(!lm_comm_split(comm, me < 2 ? 0 : -1, &two), "%s", lm_last_error());
    lm_train_result r;
    if (two) {
        CHECK(!train("ep-four-then-two", two, EP, 1, DP_LATE, &r) && r.step == DP_LATE, "2 ranks: %s", lm_last_error());
        CHECK(r.optimizer_state_bytes > ep_result.optimizer_state_bytes, "2 ranks hold more than 4: %zu vs %zu",
              r.optimizer_state_bytes, ep_result.optimizer_state_bytes);
        lm_comm_close(two);
    }
    lm_comm_barrier(comm);
    CHECK(!train("ep-four-then-two", comm, EP, 1, 0, &r) && r.step == DP_STEPS, "4 ranks again: %s", lm_last_error());
    if (me == 0) close_to_uninterrupted("ep-four-then-two");
}

/* Experts whose tensors' numel (8 x 15 x 9 = 1080, LatentMoE of 9) is not a
 * multiple of lm_sum_squares's 64 blocks: blocks of 17 elements cross the
 * owners' slices (540 or 270), so the norm sums such blocks from several
 * owners' parts; still the replicated layout's bits (clipping acts). */
static void test_norm_blocks_that_cross_the_owners_slices(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = ep_config();
    c.latent_dim = 9;
    c.expert_ffn = 15;
    c.steps = 10;
    c.eval_every = 0;
    c.ckpt_every = 0;
    lm_train_result r[2];
    for (int rep = 0; rep < 2; rep++) {
        lm_train_options o = lm_train_options_default(dir(rep ? "rep-odd" : "ep-odd"));
        o.progress = NULL;
        o.val_batches = 1;
        o.stage_eval_batches = 0;
        o.comm = comm;
        o.expert_parallel = 1;
        o.ep_replicated_state = rep;
        CHECK(!lm_train(&c, &o, &r[rep]), "%s: %s", rep ? "rep" : "ep", lm_last_error());
        CHECK(r[rep].step == 10 && r[rep].skipped == 0, "%s: %lld steps", rep ? "rep" : "ep", (long long)r[rep].step);
    }
    CHECK(r[0].grad_norm_hash == r[1].grad_norm_hash, "the global gradient norms differ in their bits");
    CHECK(r[0].params_hash == r[1].params_hash && r[0].balance_hash == r[1].balance_hash,
          "the owner-only run's state differs from the replicated run's");
    CHECK(r[0].optimizer_state_bytes < r[1].optimizer_state_bytes, "no saving: %zu vs %zu bytes",
          r[0].optimizer_state_bytes, r[1].optimizer_state_bytes);
    if (me != 0) return;
    double a[16], b[16];
    int na = read_metric("ep-odd", "train", "grad_norm", a, 16), nb = read_metric("rep-odd", "train", "grad_norm", b, 16);
    CHECK(na == 10 && nb == 10, "train lines %d and %d", na, nb);
    int clipped = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK(a[i] == b[i], "step %d: gradient norm %.9g vs %.9g", i + 1, a[i], b[i]);
        clipped += b[i] > 1.0;
    }
    CHECK(clipped > 0, "clipping acted in none of %d steps", nb);
}

/* A staged run (two sequence lengths): the second stage's model runs the
 * experts over the ranks too, so owner-only state stays the replicated
 * layout's bits across the switch, and one process's run within 1e-5. */
static void test_a_staged_run_keeps_expert_parallelism_across_stages(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = ep_config();
    c.eval_every = 0;
    c.ckpt_every = 0;
    c.n_stages = 2;
    memset(c.stages, 0, sizeof c.stages);
    for (int i = 0; i < 2; i++) {
        lm_stage *st = &c.stages[i];
        snprintf(st->name, sizeof st->name, "s%d", i);
        st->seq_len = i ? 48 : 32;
        st->steps = 4;
        st->batch_tokens = 4 * (int64_t)st->seq_len;
        st->lr_scale = 1;
    }
    lm_train_result r[2];
    for (int rep = 0; rep < 2; rep++) {
        lm_train_options o = lm_train_options_default(dir(rep ? "rep-staged" : "ep-staged"));
        o.progress = NULL;
        o.val_batches = 1;
        o.stage_eval_batches = 0;
        o.comm = comm;
        o.expert_parallel = 1;
        o.ep_replicated_state = rep;
        CHECK(!lm_train(&c, &o, &r[rep]), "%s: %s", rep ? "rep" : "ep", lm_last_error());
        CHECK(r[rep].step == 8 && r[rep].skipped == 0, "%s: %lld steps", rep ? "rep" : "ep", (long long)r[rep].step);
    }
    CHECK(r[0].params_hash == r[1].params_hash && r[0].grad_norm_hash == r[1].grad_norm_hash,
          "the owner-only run differs from the replicated run");
    /* both stages' models created with the rank's share */
    check_created_share(&r[0], &r[1], c, R);
    if (me != 0) return;
    lm_train_options o = lm_train_options_default(dir("one-staged"));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    lm_train_result one;
    CHECK(!lm_train(&c, &o, &one) && one.step == 8, "one process: %s", lm_last_error());
    double a[16], b[16];
    int na = read_metric("ep-staged", "train", "loss", a, 16), nb = read_metric("one-staged", "train", "loss", b, 16);
    CHECK(na == 8 && nb == 8, "train lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "loss vs one process");
    na = read_metric("ep-staged", "train", "grad_norm", a, 16);
    nb = read_metric("one-staged", "train", "grad_norm", b, 16);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "gradient norm vs one process");
}

/* The model of the NaN case: wider experts, so that the middle of the
 * parameter block, where LM_FAULT_GRADIENT writes its NaN, is an expert's. */
static lm_config fault_config(void) {
    lm_config c = ep_config();
    c.expert_ffn = 48;
    c.eval_every = 0;
    c.ckpt_every = 0;
    c.steps = 8;
    return c;
}

/* A NaN left in the gradient of a routed expert on its owner alone (step 4):
 * the owner's block sums, hence the global norm, are non-finite on every
 * rank, and every rank skips the step, as the replicated layout (the NaN
 * summed into every rank's gradients) does; the runs then go on alike. */
static void test_a_non_finite_expert_gradient_skips_the_step_on_every_rank(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = fault_config();
    lm_model *m;
    CHECK(!lm_model_create(&c, 1, c.seq_len, &m), "%s", lm_last_error());
    if (!m) return;
    const int64_t elem = (int64_t)lm_model_num_params(m) / 2; /* where LM_FAULT_GRADIENT writes */
    const lm_model_tensor *t = NULL;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *u = lm_model_tensor_at(m, i);
        if (elem >= (int64_t)u->offset && elem < (int64_t)(u->offset + u->numel)) t = u;
    }
    const char *d = t ? strstr(t->name, ".moe.") : NULL;
    const int expert = d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down"));
    CHECK(expert, "the NaN lands in %s, not in a routed expert", t ? t->name : "?");
    const int victim = expert ? (int)((elem - (int64_t)t->offset) / (int64_t)(t->numel / (size_t)R)) : 0;
    printf("     the NaN lands in %s, owned by rank %d\n", t ? t->name : "?", victim);
    lm_model_free(m);
    if (!expert) return;
    lm_train_result r[2];
    for (int rep = 0; rep < 2; rep++) {
        lm_train_options o = lm_train_options_default(dir(rep ? "rep-fault" : "ep-fault"));
        o.progress = NULL;
        o.val_batches = 1;
        o.stage_eval_batches = 0;
        o.comm = comm;
        o.expert_parallel = 1;
        o.ep_replicated_state = rep;
        o.inject_fault = LM_FAULT_GRADIENT;
        o.inject_fault_step = me == victim ? 3 : -1;
        CHECK(!lm_train(&c, &o, &r[rep]), "%s: %s", rep ? "rep" : "ep", lm_last_error());
        CHECK(r[rep].skipped == 1 && r[rep].step == 8, "%s: %lld skipped of %lld", rep ? "rep" : "ep",
              (long long)r[rep].skipped, (long long)r[rep].step);
    }
    CHECK(r[0].params_hash == r[1].params_hash && r[0].balance_hash == r[1].balance_hash,
          "the owner-only run's state differs from the replicated run's");
    CHECK(same_on_every_rank(r[0].params_hash), "the ranks differ after the skipped step");
}

/* Gradient buckets under expert parallelism: with owner-only state each
 * bucket's replicated tensors are summed over the world and this rank's expert
 * slices over their replicas (none when the group is the world) while the
 * backward's all-to-alls run on the same handle; buckets of one tensor and of
 * 4 KiB give the one pass's bits after the backward (train.grad_bucket_mb 0).
 * (With the experts' state replicated the sums are data parallelism's, whose
 * buckets test_grad_buckets covers; the other cases here run bucketed, the
 * default.) */
static void test_gradient_buckets_give_the_one_passs_bits(void) {
    if (!runs_ok) SKIP("the runs failed");
    static const struct {
        const char *run, *base;
        int how;
        float mb;
    } v[] = {{"ep-b0", NULL, EP, 0},
             {"ep-b1", "ep-b0", EP, 1e-6f},
             {"ep-b2", "ep-b0", EP, 0.004f}};
    lm_train_result base = {0}, r;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        bucket_mb = v[i].mb;
        CHECK(!train(v[i].run, comm, v[i].how, 0, 0, &r) && r.step == BUCKET_STEPS, "%s: %s", v[i].run,
              lm_last_error());
        bucket_mb = -1.0f;
        if (!v[i].base) {
            base = r;
            continue;
        }
        CHECK(r.params_hash == base.params_hash && r.balance_hash == base.balance_hash,
              "%s: the state differs from the unbucketed run's", v[i].run);
        /* the files but config.json (which holds train.grad_bucket_mb) */
        if (me == 0)
            CHECK(same_checkpoint_bytes(v[i].run, v[i].base, BUCKET_STEPS, 0), "%s: the checkpoint differs from %s's",
                  v[i].run, v[i].base);
    }
}

/* Expert parallelism on the device path (the layer's exchange through the
 * backend's op table and the device engine, here the staged engine over the
 * CPU backend). With the experts' state replicated (--ep-replicated-state)
 * and with ZeRO-1 the run is the host path's replicated-state run bit for bit
 * (losses, gradient norms, checkpoints, state hashes). With owner-only state
 * (the default) a rank holds the host path's owner-only share of weights,
 * gradients and optimizer state, created so; the slices' sums of squares are
 * summed over the group, so the norm is the replicated one to double rounding
 * and the run within 1e-5 of the replicated one (losses, evaluations,
 * checkpoints); it is deterministic (a stop and resume gives the
 * uninterrupted bits), and the host path's owner-only checkpoint resumes
 * on it. */
static void test_expert_parallelism_on_the_device_path(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result dev, devr, devz, r;
    run_backend = lm_backend_cpu();
    CHECK(!train("dev-ep", comm, EP, 0, 0, &dev), "device path, --ep: %s", lm_last_error());
    CHECK(!train("dev-rep", comm, EP_REPLICATED, 0, 0, &devr), "device path, --ep --ep-replicated-state: %s",
          lm_last_error());
    CHECK(!train("dev-ep-zero", comm, EP_ZERO, 0, 0, &devz), "device path, --ep --zero 1: %s", lm_last_error());
    CHECK(!train("dev-ep-resumed", comm, EP, 0, DP_STOP, &r) && r.step == DP_STOP, "device path, first part: %s",
          lm_last_error());
    lm_train_result res;
    CHECK(!train("dev-ep-resumed", comm, EP, 1, 0, &res) && res.step == DP_STEPS, "device path, resumed: %s",
          lm_last_error());
    copy_run_at("ep", "ep-then-dev", DP_HALF);
    lm_train_result across;
    CHECK(!train("ep-then-dev", comm, EP, 1, 0, &across) && across.step == DP_STEPS,
          "the host path's owner-only checkpoint on the device path: %s", lm_last_error());
    run_backend = NULL;
    if (!all_ok()) return;
    CHECK(dev.step == DP_STEPS && devr.step == DP_STEPS && devz.step == DP_STEPS, "%lld, %lld and %lld steps",
          (long long)dev.step, (long long)devr.step, (long long)devz.step);
    CHECK(devr.params_hash == rep_result.params_hash && devr.balance_hash == rep_result.balance_hash &&
              devr.grad_norm_hash == rep_result.grad_norm_hash,
          "device-path EP with replicated state differs from the host path's replicated-state run");
    CHECK(devz.params_hash == rep_result.params_hash && devz.balance_hash == rep_result.balance_hash,
          "device-path EP with ZeRO-1 differs from the host path's replicated-state run");
    CHECK(devr.gradient_bytes == rep_result.gradient_bytes && devr.parameter_bytes == rep_result.parameter_bytes,
          "the replicated device layout keeps %zu / %zu bytes of gradients / weights, the host's %zu / %zu",
          devr.gradient_bytes, devr.parameter_bytes, rep_result.gradient_bytes, rep_result.parameter_bytes);
    /* owner-only on the device path: the host's owner-only share, from the model's creation */
    CHECK(dev.gradient_bytes == ep_result.gradient_bytes && dev.parameter_bytes == ep_result.parameter_bytes &&
              dev.optimizer_state_bytes == ep_result.optimizer_state_bytes,
          "the device path keeps %zu / %zu / %zu bytes of gradients / weights / state, the host's owner-only layout "
          "%zu / %zu / %zu", dev.gradient_bytes, dev.parameter_bytes, dev.optimizer_state_bytes,
          ep_result.gradient_bytes, ep_result.parameter_bytes, ep_result.optimizer_state_bytes);
    check_created_share(&dev, &devr, ep_config(), R);
    CHECK(dev.eval_gathered_bytes == 0, "the device path's evaluations gathered %zu bytes (they run the exchange)",
          dev.eval_gathered_bytes);
    CHECK(res.params_hash == dev.params_hash && res.balance_hash == dev.balance_hash,
          "device path: the resumed owner-only run's state differs from the uninterrupted run's");
    CHECK(same_on_every_rank(dev.params_hash) && same_on_every_rank(dev.balance_hash),
          "device path: the ranks' hashes differ");
    if (me == 0) {
        double wl = losses_close("dev-ep", "rep", DP_STEPS, 1e-5), wp, ws, we = 0, a[4], b[4];
        CHECK(tensors_close("dev-ep", "rep", DP_STEPS, "model.safetensors", 1e-5, &wp), "parameters vs replicated");
        CHECK(tensors_close("dev-ep", "rep", DP_STEPS, "trainer.safetensors", 1e-5, &ws), "state vs replicated");
        int na = read_metric("dev-ep", "eval", "val_loss", a, 4), nb = read_metric("rep", "eval", "val_loss", b, 4);
        CHECK(na == 2 && nb == 2, "eval lines %d and %d", na, nb);
        for (int i = 0; i < na && i < nb; i++) {
            CHECK_CLOSE(a[i], b[i], 0, 1e-5, "validation loss vs replicated");
            we = fmax(we, fabs(a[i] - b[i]) / fabs(b[i]));
        }
        double w;
        CHECK(tensors_close("dev-ep", "dev-ep-resumed", DP_STEPS, "model.safetensors", 0, &w), "resumed: parameters");
        close_to_uninterrupted("ep-then-dev");
        printf("     device-path owner-only EP vs replicated state: losses %.2e, validation %.2e, parameters "
               "%.2e, state %.2e relative; its resume bit-exact\n", wl, we, wp, ws);
    }
    for (int step = 5; me == 0 && step <= DP_STEPS; step += 5) {
        CHECK(same_checkpoint_files("dev-rep", "rep", step), "the files of checkpoint %d differ (replicated)", step);
        CHECK(same_checkpoint_files("dev-ep-zero", "rep", step), "the files of checkpoint %d differ (ZeRO-1)", step);
    }
    printf("     device-path EP (CPU backend, staged engine) with replicated state and with ZeRO-1 = the host "
           "path's replicated-state run bit for bit\n");
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        test_skip_all("needs ranks: mpirun -np N test_ep_state --mpi N");
    } else {
        int rc = ranks_open(want_ranks, "ep_state");
        if (rc) return rc;
        test_dp_steps_note();
    }
    RUN(test_owner_only_state_equals_replicated_state_bit_for_bit);
    RUN(test_a_rank_holds_only_its_experts_state);
    RUN(test_a_rank_holds_only_its_experts_gradients);
    RUN(test_a_rank_holds_only_its_experts_weights);
    RUN(test_a_rank_never_allocates_the_whole_model);
    RUN(test_a_checkpoint_holds_one_expert_tensor_at_a_time);
    RUN(test_a_diverged_replica_is_refused);
    RUN(test_every_rank_holds_the_same_parameters_and_bias);
    RUN(test_resume_on_the_same_layout_is_bit_exact);
    RUN(test_checkpoints_of_the_other_ep_layouts_resume_bit_for_bit);
    RUN(test_checkpoints_resume_between_one_process_and_the_ranks);
    RUN(test_checkpoint_resumes_on_another_number_of_ranks);
    RUN(test_norm_blocks_that_cross_the_owners_slices);
    RUN(test_a_staged_run_keeps_expert_parallelism_across_stages);
    RUN(test_a_non_finite_expert_gradient_skips_the_step_on_every_rank);
    RUN(test_gradient_buckets_give_the_one_passs_bits);
    RUN(test_expert_parallelism_on_the_device_path);
    ranks_close();
    return test_summary();
}
