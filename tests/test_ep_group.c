/* Expert parallelism in groups smaller than the world (docs/scaleout.md,
 * "Expert parallelism (CPU ranks)", `--ep G`).
 *
 * Under mpirun (`mpirun -np N test_ep_group --mpi N`, ctest's
 * test_ep_group_mpi2 and test_ep_group_mpi4): 20 steps with EP groups of
 * G = N / 2 ranks (2 groups: on 4 ranks G = 2, on 2 ranks G = 1, every rank
 * running every expert), the owner-only expert state against the same run
 * with the experts' state replicated (bit for bit: losses, every step's
 * gradient norm, checkpoints, state hashes), against one process and against
 * EP over the whole world (1e-5 relative: losses, parameters, optimizer
 * state); the checkpoints' files the replicated layout's bytes, one expert
 * tensor at a time crossing to rank 0; a diverged replica of an expert slice
 * refused before a checkpoint; the bytes of state and of gradients a rank holds,
 * and the parameter and gradient bytes its model ever allocated (its share, from
 * creation); the same
 * parameters and QB bias on every rank; a bit-exact resume; checkpoints across layouts (G ranks a group
 * to one process, one process to G, the whole-world EP to G and back, ZeRO-1
 * in groups to owner-only bit for bit); norm
 * blocks that cross the owners' slices; a staged run; gradient buckets of one
 * tensor bit-identical to the one pass after the backward; the refusals (G not
 * dividing the ranks or the experts, G < 1, a group size without --ep); the
 * CLI's `--ep G`.
 * Alone, or built without MPI, every case is skipped.
 * The runs of test_dp_config last DP_STEPS steps: the 20 steps said here (and
 * the steps 10, 8 and 15 within them) are the Release suite's; a sanitizer
 * build runs 10 (5, 4 and 7; tests/test_models.h). */
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/comm.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"
#include "test_ranks.h"

static int G = 1; /* ranks of an EP group */

/* test_dp.c's model (test_models.h: MoE of 8 experts, histogram estimator)
 * with gradient clipping acting. */
static lm_config ep_config(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.grad_clip = 1.0f;
    return c;
}

/* The backend the runs train on (NULL: the host path; lm_backend_cpu(): the device path on the CPU). */
static lm_backend *run_backend;

static lm_train_options options(const char *run, lm_comm *on, int group, int replicated) {
    lm_train_options o = lm_train_options_default(dir(run));
    o.backend = run_backend;
    o.progress = NULL;
    o.val_batches = 2;
    o.stage_eval_batches = 0;
    o.comm = on;
    o.expert_parallel = on != NULL;
    o.ep_group = on ? group : 0;
    o.ep_replicated_state = replicated;
    return o;
}

/* One run of the test config over `on` (NULL: this process alone, without EP)
 * in EP groups of `group` ranks (0: all). */
static lm_status train(const char *run, lm_comm *on, int group, int replicated, int resume, int64_t stop_after,
                       lm_train_result *r) {
    lm_config c = ep_config();
    lm_train_options o = options(run, on, group, replicated);
    o.resume = resume;
    o.stop_after = stop_after;
    memset(r, 0, sizeof *r);
    return lm_train(&c, &o, r);
}

static lm_train_result g_result, grep_result;
static int runs_ok;

/* "g" (groups of G, owner-only state), "grep" (groups of G, replicated
 * state), "w" (EP over the whole world), "one" (one process): the same global
 * batch, 20 steps. */
static void test_groups_equal_replicated_state_one_process_and_whole_world_ep(void) {
    lm_train_result w, one;
    CHECK(!train("g", comm, G, 0, 0, 0, &g_result), "g: %s", lm_last_error());
    CHECK(!train("grep", comm, G, 1, 0, 0, &grep_result), "grep: %s", lm_last_error());
    CHECK(!train("w", comm, 0, 0, 0, 0, &w), "w: %s", lm_last_error());
    if (me == 0) CHECK(!train("one", NULL, 0, 0, 0, 0, &one), "one: %s", lm_last_error());
    runs_ok = all_ok();
    if (!runs_ok) return;
    CHECK(g_result.step == DP_STEPS && g_result.skipped == 0, "g: %lld steps, %lld skipped", (long long)g_result.step,
          (long long)g_result.skipped);
    CHECK(g_result.params_hash == grep_result.params_hash, "parameters or optimizer state differ from replicated");
    CHECK(g_result.grad_norm_hash == grep_result.grad_norm_hash, "the global gradient norms differ in their bits");
    CHECK(g_result.balance_hash == grep_result.balance_hash, "balancing state differs from replicated");
    if (me != 0) return;
    losses_close("g", "grep", DP_STEPS, 0);
    double a[32], b[32];
    int na = read_metric("g", "train", "grad_norm", a, 32), nb = read_metric("grep", "train", "grad_norm", b, 32);
    int clipped = 0;
    for (int i = 0; i < na && i < nb; i++) {
        CHECK(a[i] == b[i], "step %d: gradient norm %.9g vs %.9g", i + 1, a[i], b[i]);
        clipped += b[i] > 1.0;
    }
    CHECK(clipped > 0, "clipping acted in none of %d steps: the test does not see it", nb);
    double wd;
    for (int step = 5; step <= DP_STEPS; step += 5) {
        CHECK(tensors_close("g", "grep", step, "model.safetensors", 0, &wd), "parameters at step %d", step);
        CHECK(tensors_close("g", "grep", step, "trainer.safetensors", 0, &wd), "trainer state at step %d", step);
        CHECK(same_checkpoint_files("g", "grep", step), "the files of checkpoint %d differ", step);
    }
    /* against one process and the whole-world EP: float rounding */
    const double l1 = losses_close("g", "one", DP_STEPS, 1e-5), lw = losses_close("g", "w", DP_STEPS, 1e-5);
    nb = read_metric("one", "train", "loss", b, 32);
    CHECK(nb == DP_STEPS && b[DP_STEPS - 1] < b[0] - 0.5, "the run learns: loss %.3f -> %.3f", b[0], b[DP_STEPS - 1]);
    na = read_metric("g", "eval", "val_loss", a, 32);
    nb = read_metric("one", "eval", "val_loss", b, 32);
    CHECK(na == 2 && nb == 2, "eval lines %d and %d", na, nb);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "validation loss vs one process");
    na = read_metric("g", "train", "grad_norm", a, 32);
    nb = read_metric("one", "train", "grad_norm", b, 32);
    for (int i = 0; i < na && i < nb; i++) CHECK_CLOSE(a[i], b[i], 0, 1e-5, "gradient norm vs one process");
    double p1, s1, pw, sw;
    CHECK(tensors_close("g", "one", DP_STEPS, "model.safetensors", 1e-5, &p1), "parameters vs one process");
    CHECK(tensors_close("g", "one", DP_STEPS, "trainer.safetensors", 1e-5, &s1), "optimizer state vs one process");
    CHECK(tensors_close("g", "w", DP_STEPS, "model.safetensors", 1e-5, &pw), "parameters vs whole-world EP");
    CHECK(tensors_close("g", "w", DP_STEPS, "trainer.safetensors", 1e-5, &sw), "optimizer state vs whole-world EP");
    printf("     EP groups of %d on %d ranks = replicated state bit for bit; vs one process: loss %.2e, parameters "
           "%.2e, state %.2e; vs EP %d: loss %.2e, parameters %.2e, state %.2e relative\n",
           G, R, l1, p1, s1, R, lw, pw, sw);
}

/* A rank holds the replicated tensors' state and 1/G of the experts' (G = 1: all of it). */
static void test_a_rank_holds_its_groups_share_of_the_experts_state(void) {
    if (!runs_ok) SKIP("the runs failed");
    const size_t experts = expert_floats(ep_config()) * sizeof(float), whole = grep_result.optimizer_state_bytes;
    CHECK(experts > 0, "no expert tensors");
    const size_t want = whole - experts + experts / (size_t)G;
    CHECK(g_result.optimizer_state_bytes == want, "rank %d holds %zu bytes of optimizer state, expected %zu (%zu "
          "replicated, experts %zu)", me, g_result.optimizer_state_bytes, want, whole, experts);
    printf("     optimizer state a rank: %zu bytes instead of %zu (experts' %zu split %d ways)\n",
           g_result.optimizer_state_bytes, whole, experts, G);
}

/* A rank's gradient block holds the replicated tensors and its position's
 * experts only (1/G of the experts'; G = 1: the whole block, as the
 * replicated layout's). */
static void test_a_rank_holds_its_groups_share_of_the_experts_gradients(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_expert_share("gradients", grep_result.gradient_bytes, g_result.gradient_bytes,
                       param_floats(ep_config()) * sizeof(float), expert_floats(ep_config()) * sizeof(float),
                       G);
}

/* A rank's parameter block holds the replicated tensors and its position's
 * experts' weights only (1/G of the experts'; G = 1: every weight, as the
 * replicated layout's). */
static void test_a_rank_holds_its_groups_share_of_the_experts_weights(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_expert_share("parameters", grep_result.parameter_bytes, g_result.parameter_bytes,
                       param_floats(ep_config()) * sizeof(float), expert_floats(ep_config()) * sizeof(float),
                       G);
}

/* A rank's model is created with its position's share of the blocks (G = 1:
 * every expert, the whole blocks, as the replicated layout's): the most
 * parameter and gradient bytes it ever held are its two kept blocks. */
static void test_a_rank_never_allocates_more_than_its_share(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_created_share(&g_result, &grep_result, ep_config(), G);
}

/* The parameters, optimizer-state hash and QB balancing state the same on every rank, the bias moved. */
/* A checkpoint reaches rank 0's files one routed experts' tensor at a time
 * from the owners of its group (G = 1: every rank holds every expert, nothing
 * crosses). */
static void test_a_checkpoint_holds_one_expert_tensor_at_a_time(void) {
    if (!runs_ok) SKIP("the runs failed");
    check_checkpoint_buffer(&g_result, &grep_result, ep_config(), G);
}

/* The first rank of the second group holds a replica of rank 0's experts:
 * its slice of an expert tensor moved by an ulp is refused before the
 * checkpoint on every rank, naming it (the hash of each rank covers its
 * group's slices, each taken an expert at a time). */
static void test_a_diverged_expert_replica_is_refused(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_options o = options("diverged", comm, G, 0);
    o.val_batches = 1;
    check_diverged_replica_refused(ep_config(), o, G, "layers.1.moe.up");
}

static void test_every_rank_holds_the_same_parameters_and_bias(void) {
    if (!runs_ok) SKIP("the runs failed");
    CHECK(same_on_every_rank(g_result.params_hash), "parameters or optimizer state differ between ranks");
    CHECK(same_on_every_rank(g_result.balance_hash), "balancing state (the QB bias) differs between ranks");
    if (me == 0) {
        double h = largest_bias("g", DP_STEPS);
        CHECK(h > 1e-3, "the balancing bias moved: largest |b| %.3g", h);
    }
}

static void test_resume_on_the_same_layout_is_bit_exact(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result r;
    CHECK(!train("g-resumed", comm, G, 0, 0, DP_STOP, &r) && r.step == DP_STOP, "first part: %s", lm_last_error());
    CHECK(!train("g-resumed", comm, G, 0, 1, 0, &r) && r.step == DP_STEPS, "resumed: %s", lm_last_error());
    CHECK(r.params_hash == g_result.params_hash && r.balance_hash == g_result.balance_hash,
          "the resumed run's state differs from the uninterrupted run's");
    CHECK(r.block_peak_bytes == g_result.block_peak_bytes, "the resumed rank held %zu block bytes, the run %zu",
          r.block_peak_bytes, g_result.block_peak_bytes);
    if (me != 0) return;
    double w;
    CHECK(tensors_close("g", "g-resumed", DP_STEPS, "model.safetensors", 0, &w), "parameters bit-identical");
    CHECK(tensors_close("g", "g-resumed", DP_STEPS, "trainer.safetensors", 0, &w), "trainer state bit-identical");
}

/* ZeRO-1 with EP groups (the expert gradients reduce-scattered over the world
 * with the rest, the replicas' sum included) to step 10, resumed owner-only in
 * the groups to 20: the uninterrupted run's bits. */
static void test_zero1_with_groups_resumes_owner_only_bit_for_bit(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_config c = ep_config();
    lm_train_options o = options("gzero", comm, G, 0);
    o.zero = 1;
    o.stop_after = DP_HALF;
    lm_train_result r;
    CHECK(!lm_train(&c, &o, &r) && r.step == DP_HALF, "ZeRO-1 in groups: %s", lm_last_error());
    CHECK(!train("gzero", comm, G, 0, 1, 0, &r) && r.step == DP_STEPS, "resumed owner-only: %s", lm_last_error());
    CHECK(r.params_hash == g_result.params_hash && r.balance_hash == g_result.balance_hash,
          "ZeRO-1 checkpoint in groups resumed owner-only: state differs from the uninterrupted run");
}

/* Run `run` ended at step 20 within 1e-5 of one process and of the groups' run (rank 0). */
static void close_to_uninterrupted(const char *run) {
    double w1, w2, w3;
    CHECK(tensors_close(run, "one", DP_STEPS, "model.safetensors", 1e-5, &w1), "%s: parameters vs one process", run);
    CHECK(tensors_close(run, "g", DP_STEPS, "model.safetensors", 1e-5, &w2), "%s: parameters vs groups", run);
    CHECK(tensors_close(run, "one", DP_STEPS, "trainer.safetensors", 1e-5, &w3), "%s: optimizer state vs one process",
          run);
    losses_close(run, "one", DP_STEPS, 1e-5);
    printf("     %s: parameters within %.2e (one process), %.2e (groups of %d) relative\n", run, w1, w2, G);
}

/* Checkpoints of step 10 across layouts: groups of G on one process, one
 * process's on groups of G, whole-world EP's on groups of G and the groups'
 * on whole-world EP; each run to 20 within 1e-5 of the uninterrupted runs. */
static void test_checkpoints_resume_across_group_sizes_and_one_process(void) {
    if (!runs_ok) SKIP("the runs failed");
    copy_run_at("g", "g-then-one", DP_HALF);
    copy_run_at("one", "one-then-g", DP_HALF);
    copy_run_at("w", "w-then-g", DP_HALF);
    copy_run_at("g", "g-then-w", DP_HALF);
    lm_train_result r;
    CHECK(!train("one-then-g", comm, G, 0, 1, 0, &r) && r.step == DP_STEPS, "one then g: %s", lm_last_error());
    CHECK(same_on_every_rank(r.params_hash) && same_on_every_rank(r.balance_hash), "the ranks' hashes differ");
    CHECK(!train("w-then-g", comm, G, 0, 1, 0, &r) && r.step == DP_STEPS, "w then g: %s", lm_last_error());
    CHECK(same_on_every_rank(r.params_hash) && same_on_every_rank(r.balance_hash), "the ranks' hashes differ");
    CHECK(!train("g-then-w", comm, 0, 0, 1, 0, &r) && r.step == DP_STEPS, "g then w: %s", lm_last_error());
    if (me != 0) return;
    CHECK(!train("g-then-one", NULL, 0, 0, 1, 0, &r) && r.step == DP_STEPS, "g then one: %s", lm_last_error());
    close_to_uninterrupted("g-then-one");
    close_to_uninterrupted("one-then-g");
    close_to_uninterrupted("w-then-g");
    close_to_uninterrupted("g-then-w");
}

/* LatentMoE of 9 with experts of 15: expert tensors of 1080 weights, whose
 * 17-weight norm blocks cross the owners' slices within a group; owner-only
 * in groups is the replicated layout's bits (norms included). */
static void test_norm_blocks_that_cross_the_owners_slices(void) {
    if (!runs_ok) SKIP("the runs failed");
    if (G < 2) SKIP("groups of one rank own every expert (no slices)");
    lm_config c = ep_config();
    c.latent_dim = 9;
    c.expert_ffn = 15;
    c.steps = 10;
    c.eval_every = 0;
    c.ckpt_every = 0;
    lm_train_result r[2];
    for (int rep = 0; rep < 2; rep++) {
        lm_train_options o = options(rep ? "grep-odd" : "g-odd", comm, G, rep);
        o.val_batches = 1;
        CHECK(!lm_train(&c, &o, &r[rep]), "%s: %s", rep ? "rep" : "owner", lm_last_error());
        CHECK(r[rep].step == 10 && r[rep].skipped == 0, "%lld steps", (long long)r[rep].step);
    }
    CHECK(r[0].grad_norm_hash == r[1].grad_norm_hash, "the global gradient norms differ in their bits");
    CHECK(r[0].params_hash == r[1].params_hash && r[0].balance_hash == r[1].balance_hash,
          "the owner-only run's state differs from the replicated run's");
}

/* A staged run (two sequence lengths): the second stage's model runs the
 * experts in the same groups; owner-only = replicated state bit for bit. */
static void test_a_staged_run_keeps_the_groups_across_stages(void) {
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
        st->steps = 3;
        st->batch_tokens = 4 * (int64_t)st->seq_len;
        st->lr_scale = 1;
    }
    lm_train_result r[2];
    for (int rep = 0; rep < 2; rep++) {
        lm_train_options o = options(rep ? "grep-staged" : "g-staged", comm, G, rep);
        o.val_batches = 1;
        CHECK(!lm_train(&c, &o, &r[rep]), "%s: %s", rep ? "rep" : "owner", lm_last_error());
        CHECK(r[rep].step == 6 && r[rep].skipped == 0, "%lld steps", (long long)r[rep].step);
    }
    CHECK(r[0].params_hash == r[1].params_hash && r[0].grad_norm_hash == r[1].grad_norm_hash,
          "the owner-only run differs from the replicated run");
    CHECK(same_on_every_rank(r[0].params_hash), "the ranks differ");
    check_created_share(&r[0], &r[1], c, G);
}

/* Refused before anything is written, with a message naming the sizes. */
static void refused(const char *what, lm_config c, int group, int ep, const char *needle) {
    lm_train_options o = options("refused", comm, group, 0);
    o.expert_parallel = ep;
    lm_train_result r;
    lm_status s = lm_train(&c, &o, &r);
    CHECK(s != LM_OK, "%s: accepted", what);
    if (s) CHECK(strstr(lm_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", what, lm_last_error(), needle);
    if (me == 0) {
        char p[700];
        snprintf(p, sizeof p, "%s/metrics.jsonl", dir("refused"));
        CHECK(access(p, F_OK) != 0, "%s: the run wrote %s", what, p);
    }
    printf("     %s: %s\n", what, lm_last_error());
}

/* Gradient buckets with EP groups: each bucket's replicated tensors summed
 * over the world, this rank's expert slices over their replicas (one a group:
 * a handle of its own) during the backward; buckets of one tensor give the one
 * pass's bits after the backward (train.grad_bucket_mb 0), 6 steps. */
static void test_gradient_buckets_give_the_one_passs_bits(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result r[2];
    for (int b = 0; b < 2; b++) {
        lm_config c = ep_config();
        c.grad_bucket_mb = b ? 1e-6f : 0.0f;
        c.steps = 6;
        c.eval_every = 0;
        c.ckpt_every = 0; /* one checkpoint, at the end */
        lm_train_options o = options(b ? "g-b1" : "g-b0", comm, G, 0);
        memset(&r[b], 0, sizeof r[b]);
        CHECK(!lm_train(&c, &o, &r[b]) && r[b].step == 6, "%s: %s", b ? "g-b1" : "g-b0", lm_last_error());
    }
    CHECK(r[1].params_hash == r[0].params_hash && r[1].balance_hash == r[0].balance_hash,
          "buckets of one tensor: the state differs from the unbucketed run's");
    /* the files but config.json (which holds train.grad_bucket_mb) */
    if (me == 0) CHECK(same_checkpoint_bytes("g-b1", "g-b0", 6, 0), "buckets of one tensor: the checkpoint differs");
}

/* EP groups on the device path (the group's part of the device engine: the
 * staged engine over the CPU backend, split): the experts' state whole on
 * every rank, each group's owners writing their slices' gradients from the
 * group's tokens and the world's sum adding the groups', so the run is the
 * host path's replicated-state run in groups ("grep") bit for bit. */
/* On the device path (the CPU backend, the staged engine): with the
 * experts' state replicated the groups are the host path's replicated-state
 * groups bit for bit; with owner-only state (the default) a rank holds the
 * host path's owner-only share and the run is within 1e-5 of it (the
 * device path's norm sums the owners' slice sums: the same norm to double
 * rounding), its ranks in agreement. */
static void test_groups_on_the_device_path(void) {
    if (!runs_ok) SKIP("the runs failed");
    lm_train_result dev, devr;
    run_backend = lm_backend_cpu();
    CHECK(!train("dev-grep", comm, G, 1, 0, 0, &devr), "device path in groups of %d, replicated state: %s", G,
          lm_last_error());
    CHECK(!train("dev-g", comm, G, 0, 0, 0, &dev), "device path in groups of %d: %s", G, lm_last_error());
    run_backend = NULL;
    if (!all_ok()) return;
    CHECK(dev.step == DP_STEPS && devr.step == DP_STEPS, "%lld and %lld steps", (long long)dev.step,
          (long long)devr.step);
    CHECK(devr.params_hash == grep_result.params_hash && devr.balance_hash == grep_result.balance_hash &&
              devr.grad_norm_hash == grep_result.grad_norm_hash,
          "device-path EP in groups of %d with replicated state differs from the host path's", G);
    CHECK(dev.gradient_bytes == g_result.gradient_bytes && dev.parameter_bytes == g_result.parameter_bytes &&
              dev.optimizer_state_bytes == g_result.optimizer_state_bytes,
          "the device path's groups keep %zu / %zu / %zu bytes of gradients / weights / state, the host's %zu / %zu / "
          "%zu", dev.gradient_bytes, dev.parameter_bytes, dev.optimizer_state_bytes, g_result.gradient_bytes,
          g_result.parameter_bytes, g_result.optimizer_state_bytes);
    CHECK(same_on_every_rank(dev.params_hash) && same_on_every_rank(dev.balance_hash),
          "device path in groups: the ranks' hashes differ");
    if (me != 0) return;
    losses_close("dev-grep", "grep", DP_STEPS, 0);
    for (int step = 5; step <= DP_STEPS; step += 5)
        CHECK(same_checkpoint_files("dev-grep", "grep", step), "the files of checkpoint %d differ", step);
    double wl = losses_close("dev-g", "g", DP_STEPS, 1e-5), wp;
    CHECK(tensors_close("dev-g", "g", DP_STEPS, "model.safetensors", 1e-5, &wp), "owner-only parameters");
    printf("     device-path EP in groups of %d: replicated state = the host's bit for bit; owner-only state within "
           "%.2e (losses), %.2e (parameters) of the host's\n", G, wl, wp);
}

static void test_bad_group_sizes_are_refused(void) {
    lm_config c = ep_config();
    refused("a group of 3", c, 3, 1, "not a multiple of 3");
    refused("a group of -1", c, -1, 1, "at least 1");
    refused("a group size without --ep", c, G, 0, "without expert parallelism");
    const int g = G > 1 ? G : R; /* groups of g ranks cannot split 2 g + 1 experts */
    c.n_routed_experts = 2 * g + 1;
    refused("experts not divisible by the group", c, g, 1, "is not divisible by");
}

/* The CLI (rank 0): `--ep G` takes the group size (so `--ep 2` without --comm mpi is refused for the
 * missing --comm, not for a stray argument), `--ep 0` is refused, --help describes it. */
static void test_cli_takes_the_group_size(void) {
    if (me != 0) return;
    char out[16384], args[900];
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --ep 2", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--ep (expert parallelism) runs over the processes of "
          "--comm mpi"), "%s", out);
    snprintf(args, sizeof args, "train --config configs/tiny.json --out %s --ep 0 --comm mpi", dir("cli"));
    CHECK(run_cli(args, out, sizeof out) == 2 && strstr(out, "--ep must lie in [1, 4096], got 0"), "%s", out);
    CHECK(access(dir("cli"), F_OK) != 0, "a refused run created its directory");
    CHECK(run_cli("train --help", out, sizeof out) == 0 && strstr(out, "--ep [G]") && strstr(out, "groups of G"),
          "--help lacks --ep G");
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        test_skip_all("needs ranks: mpirun -np N test_ep_group --mpi N");
    } else {
        int rc = ranks_open(want_ranks, "ep_group");
        if (rc) return rc;
        if (comm && R % 2) {
            fprintf(stderr, "started on %d ranks, expected an even number\n", R);
            ranks_close();
            return 1;
        }
        G = R / 2 > 0 ? R / 2 : 1;
        test_dp_steps_note();
    }
    RUN(test_groups_equal_replicated_state_one_process_and_whole_world_ep);
    RUN(test_a_rank_holds_its_groups_share_of_the_experts_state);
    RUN(test_a_rank_holds_its_groups_share_of_the_experts_gradients);
    RUN(test_a_rank_holds_its_groups_share_of_the_experts_weights);
    RUN(test_a_rank_never_allocates_more_than_its_share);
    RUN(test_a_checkpoint_holds_one_expert_tensor_at_a_time);
    RUN(test_a_diverged_expert_replica_is_refused);
    RUN(test_every_rank_holds_the_same_parameters_and_bias);
    RUN(test_resume_on_the_same_layout_is_bit_exact);
    RUN(test_checkpoints_resume_across_group_sizes_and_one_process);
    RUN(test_zero1_with_groups_resumes_owner_only_bit_for_bit);
    RUN(test_norm_blocks_that_cross_the_owners_slices);
    RUN(test_a_staged_run_keeps_the_groups_across_stages);
    RUN(test_gradient_buckets_give_the_one_passs_bits);
    RUN(test_groups_on_the_device_path);
    RUN(test_bad_group_sizes_are_refused);
    RUN(test_cli_takes_the_group_size);
    ranks_close();
    return test_summary();
}
