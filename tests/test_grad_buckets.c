/* Gradient buckets (docs/scaleout.md, "Gradient buckets"): the model's
 * grad-ready hook and the trainer's bucketed sums over the ranks.
 *
 * Alone (`test_grad_buckets`): the hook on the CPU backend. Over the last of
 * two accumulated backwards, every element of the gradient block is reported
 * exactly once, in whole tensors, and a range's contents when it is reported
 * are already its final bits (so nothing writes it after the report); checked
 * with Block and Full AttnRes (whose queries and key norms every sublayer
 * writes), a tied LM head (written by the cross-entropy and by the
 * embedding's backward), sequence segments (every layer's backward runs once a
 * segment), recompute with chunks and the standard residual. The check would
 * see a late report: at the first report the embedding's gradient is not yet
 * final. A gradient fault's NaN is in its range when that is reported; a
 * hook's error stops the backward.
 * Under mpirun (`mpirun -np N test_grad_buckets --mpi N`, ctest's
 * test_grad_buckets_mpi2 and _mpi4): data-parallel training with buckets of
 * one tensor (smaller than the smallest tensor), of a few KiB, and larger than
 * the whole block gives the unbucketed run's losses and checkpoint bytes bit
 * for bit with gradient accumulation (2 micro-batches); with buckets of one
 * tensor, also with sequence segments, with recompute (chunked), with a
 * forward failing on one rank in
 * the first micro-batch (that rank joins the others' agreement from after its
 * loop) and with a gradient NaN on one rank. With ZeRO-1 (each bucket
 * reduce-scattered to its pieces' owners) the same against ZeRO-1's one
 * reduce-scatter, on the host path and on the device path through the CPU
 * backend (with a gradient NaN too). Built without MPI, `--mpi N` reports
 * every case skipped. */
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

/* ---- the hook, alone ---- */

typedef struct {
    lm_model *m;
    size_t n;
    unsigned char *seen;  /* [n] times reported */
    float *at_report;     /* [n] each element's gradient when its range was reported */
    float *first_whole;   /* [n] the whole block at the first report */
    int calls, not_whole, fail_at;
    size_t first_off, last_off;
} hook_log;

/* Is x a tensor boundary (or the block's end)? */
static int tensor_edge(const lm_model *m, size_t x) {
    if (x == lm_model_num_params(m)) return 1;
    for (int i = 0; i < lm_model_num_tensors(m); i++)
        if (lm_model_tensor_at(m, i)->offset == x) return 1;
    return 0;
}

static lm_status record(void *user, size_t off, size_t count) {
    hook_log *h = user;
    if (h->fail_at && h->calls + 1 == h->fail_at) return lm_error(LM_ERR_IO, "the hook refuses");
    const float *g = lm_model_grads(h->m);
    if (h->calls == 0) {
        memcpy(h->first_whole, g, h->n * sizeof(float));
        h->first_off = off;
    }
    h->last_off = off;
    h->calls++;
    if (!tensor_edge(h->m, off) || !tensor_edge(h->m, off + count) || off + count > h->n) {
        h->not_whole++;
        return LM_OK;
    }
    for (size_t i = off; i < off + count; i++) {
        h->seen[i]++;
        h->at_report[i] = g[i];
    }
    return LM_OK;
}

static void fill_batch(int32_t *tok, int32_t *tgt, int n, int V, unsigned seed) {
    uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (int i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        tok[i] = (int32_t)(x % (uint64_t)V);
        tgt[i] = (int32_t)((x >> 20) % (uint64_t)V);
    }
}

/* Two micro-batches, the hook on the second's backward; checks as the file's comment says. */
static void hook_case(const char *what, lm_config c, lm_fault fault) {
    const int B = 2, T = c.seq_len;
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s: %s", what, lm_last_error());
    if (!m) return;
    lm_model_init(m, 7);
    hook_log h = {m, lm_model_num_params(m), NULL, NULL, NULL, 0, 0, 0, 0, 0};
    h.seen = calloc(h.n, 1);
    h.at_report = calloc(h.n, sizeof(float));
    h.first_whole = calloc(h.n, sizeof(float));
    int32_t *tok = malloc((size_t)B * T * sizeof *tok), *tgt = malloc((size_t)B * T * sizeof *tgt);
    lm_model_zero_grads(m);
    float loss;
    for (int micro = 0; micro < 2; micro++) {
        fill_batch(tok, tgt, B * T, c.vocab_size, 3 + micro);
        CHECK(!lm_model_forward(m, tok, tgt, 1, &loss), "%s: forward: %s", what, lm_last_error());
        if (micro == 1) {
            lm_model_set_grad_ready_hook(m, record, &h);
            if (fault != LM_FAULT_NONE) lm_model_inject_fault(m, fault);
        }
        CHECK(!lm_model_backward(m, 0.5f), "%s: backward: %s", what, lm_last_error());
        /* the first backward is not hooked */
        if (micro == 0) CHECK(h.calls == 0, "%s: the hook ran without being set", what);
    }
    lm_model_set_grad_ready_hook(m, NULL, NULL);
    const float *g = lm_model_grads(m);
    size_t twice = 0, never = 0, moved = 0;
    for (size_t i = 0; i < h.n; i++) {
        never += h.seen[i] == 0;
        twice += h.seen[i] > 1;
        if (h.seen[i] == 1 && memcmp(&h.at_report[i], &g[i], sizeof(float))) moved++;
    }
    CHECK(h.not_whole == 0, "%s: %d ranges are not whole tensors", what, h.not_whole);
    CHECK(never == 0 && twice == 0, "%s: %zu elements never reported, %zu more than once (of %zu)", what, never,
          twice, h.n);
    CHECK(moved == 0, "%s: %zu elements changed after their range was reported", what, moved);
    /* the order's ends: the LM head or the final norm first, the embedding (with a tied head) last */
    const lm_model_tensor *first = lm_model_tensor_at(m, lm_model_num_tensors(m) - 1);
    CHECK(h.first_off == first->offset, "%s: the first range starts at %zu, not at %s (%zu)", what, h.first_off,
          first->name, first->offset);
    CHECK(h.last_off == lm_model_find(m, "embed")->offset, "%s: the last range starts at %zu, not at the embedding",
          what, h.last_off);
    /* the comparison is sensitive: the embedding's rows were written after the first report */
    const lm_model_tensor *e = lm_model_find(m, "embed");
    size_t later = 0;
    for (size_t i = e->offset; i < e->offset + e->numel; i++) later += memcmp(&h.first_whole[i], &g[i], sizeof(float)) != 0;
    CHECK(later > 0, "%s: the embedding's gradient did not change after the first report", what);
    if (fault == LM_FAULT_GRADIENT) {
        const size_t mid = h.n / 2;
        CHECK(isnan(h.at_report[mid]) && isnan(g[mid]), "%s: the gradient fault's NaN is not in its reported range",
              what);
    } else {
        size_t nonfinite = 0;
        for (size_t i = 0; i < h.n; i++) nonfinite += !isfinite(g[i]);
        CHECK(nonfinite == 0, "%s: %zu non-finite gradients", what, nonfinite);
    }
    printf("     %s: %d ranges cover %zu gradients once, each final when reported\n", what, h.calls, h.n);
    free(tok);
    free(tgt);
    free(h.seen);
    free(h.at_report);
    free(h.first_whole);
    lm_model_free(m);
}

static void test_every_gradient_is_reported_once_after_its_last_write(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    hook_case("block attnres", c, LM_FAULT_NONE);
    lm_config t = c;
    t.tie_embeddings = 1;
    t.residual = LM_RESIDUAL_FULL_ATTNRES;
    hook_case("tied head, full attnres", t, LM_FAULT_NONE);
    lm_config s = c;
    s.seq_segment = 12; /* three segments of 32 tokens: 12, 12, 8 */
    hook_case("sequence segments", s, LM_FAULT_NONE);
    lm_config r = c;
    r.recompute = 1;
    r.recompute_chunk = 24;
    hook_case("recompute, chunked", r, LM_FAULT_NONE);
    lm_config p = c;
    p.residual = LM_RESIDUAL_STANDARD;
    p.tie_embeddings = 1;
    hook_case("standard residual, tied head", p, LM_FAULT_NONE);
    hook_case("gradient fault", c, LM_FAULT_GRADIENT);
}

static void test_a_hook_error_stops_the_backward(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    const int B = 2, T = c.seq_len;
    lm_model *m = NULL;
    CHECK(!lm_model_create(&c, B, T, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 7);
    hook_log h = {m, lm_model_num_params(m), NULL, NULL, NULL, 0, 0, 3, 0, 0};
    h.seen = calloc(h.n, 1);
    h.at_report = calloc(h.n, sizeof(float));
    h.first_whole = calloc(h.n, sizeof(float));
    int32_t tok[64], tgt[64];
    fill_batch(tok, tgt, B * T, c.vocab_size, 1);
    float loss;
    lm_model_zero_grads(m);
    CHECK(!lm_model_forward(m, tok, tgt, 1, &loss), "%s", lm_last_error());
    lm_model_set_grad_ready_hook(m, record, &h);
    lm_status s = lm_model_backward(m, 1.0f);
    CHECK(s == LM_ERR_IO && strstr(lm_last_error(), "the hook refuses"), "status %d: %s", (int)s, lm_last_error());
    CHECK(h.calls == 2, "the backward went on after the hook's error: %d calls", h.calls);
    free(h.seen);
    free(h.at_report);
    free(h.first_whole);
    lm_model_free(m);
}

/* ---- over the ranks ---- */

static int with_zero;           /* the runs below with ZeRO-1 (--zero 1) */
static lm_backend *with_backend; /* the device path on this backend (NULL: the host path) */

static lm_status train_b(const lm_config *c, const char *run, lm_fault fault, int fault_rank, int fault_step,
                         lm_train_result *r) {
    lm_train_options o = lm_train_options_default(dir(run));
    o.progress = NULL;
    o.val_batches = 1;
    o.stage_eval_batches = 0;
    o.comm = comm;
    o.zero = with_zero;
    o.backend = with_backend;
    if (fault != LM_FAULT_NONE) {
        o.inject_fault = fault;
        o.inject_fault_step = me == fault_rank ? fault_step : -1;
    }
    memset(r, 0, sizeof *r);
    return lm_train(c, &o, r);
}

/* Files `file` of checkpoint `step` of runs a and b hold the same bytes. */
static int same_file(const char *a, const char *b, int step, const char *file) {
    char pa[700], pb[700];
    snprintf(pa, sizeof pa, "%s/checkpoint-%08d/%s", dir(a), step, file);
    snprintf(pb, sizeof pb, "%s/checkpoint-%08d/%s", dir(b), step, file);
    return test_same_file(pa, pb);
}

static lm_config small_run(void) {
    lm_config c = test_dp_config(LM_QB_HISTOGRAM);
    c.steps = 6;
    c.eval_every = 0;
    c.ckpt_every = 0; /* one checkpoint, at the end */
    return c;
}

/* Run `c` unbucketed, then with the first `nsizes` bucket sizes (one tensor a bucket, the most
 * reports and sums; a few KiB; the whole block), and compare. */
static void bucketed_equals_unbucketed(const char *name, lm_config c, lm_fault fault, int skipped, int nsizes) {
    static const float sizes[] = {1e-6f, 0.004f, 1000.0f};
    const char *tag[] = {"one-tensor", "4KiB", "whole"};
    char base[64], run[96];
    snprintf(base, sizeof base, "%s-plain", name);
    lm_train_result plain, r;
    c.grad_bucket_mb = 0;
    CHECK(!train_b(&c, base, fault, R - 1, 2, &plain), "%s: %s", base, lm_last_error());
    CHECK(plain.step == c.steps && plain.skipped == skipped, "%s: %lld steps, %lld skipped", base,
          (long long)plain.step, (long long)plain.skipped);
    for (int k = 0; k < nsizes; k++) {
        snprintf(run, sizeof run, "%s-%s", name, tag[k]);
        c.grad_bucket_mb = sizes[k];
        CHECK(!train_b(&c, run, fault, R - 1, 2, &r), "%s: %s", run, lm_last_error());
        CHECK(r.step == c.steps && r.skipped == skipped, "%s: %lld steps, %lld skipped", run, (long long)r.step,
              (long long)r.skipped);
        CHECK(r.params_hash == plain.params_hash && r.balance_hash == plain.balance_hash,
              "%s: the state differs from the unbucketed run's", run);
        CHECK(same_on_every_rank(r.params_hash), "%s: the ranks differ", run);
        if (me != 0) continue;
        losses_close(run, base, (int)c.steps - skipped, 0);
        CHECK(same_file(run, base, (int)c.steps, "model.safetensors"), "%s: model.safetensors differs", run);
        CHECK(same_file(run, base, (int)c.steps, "trainer.safetensors"), "%s: trainer.safetensors differs", run);
    }
    if (me == 0)
        printf("     %s on %d ranks: buckets of %s equal the one sum\n", name, R,
               nsizes == 3 ? "1 tensor, 4 KiB and the whole block" : "1 tensor");
}

static void test_bucketed_sums_equal_the_one_sum(void) { bucketed_equals_unbucketed("accum2", small_run(), LM_FAULT_NONE, 0, 3); }

static void test_bucketed_sums_with_sequence_segments(void) {
    lm_config c = small_run();
    c.seq_segment = 12;
    bucketed_equals_unbucketed("segments", c, LM_FAULT_NONE, 0, 1);
}

static void test_bucketed_sums_with_recompute(void) {
    lm_config c = small_run();
    c.recompute = 1;
    c.recompute_chunk = 24;
    bucketed_equals_unbucketed("recompute", c, LM_FAULT_NONE, 0, 1);
}

/* ZeRO-1: each bucket reduce-scattered to the owners of its pieces (a bucket may span several
 * ranks' ranges, and a range several buckets) gives the one reduce-scatter's bits. */
static void test_zero1_buckets_equal_the_one_reduce_scatter(void) {
    with_zero = 1;
    bucketed_equals_unbucketed("zero1", small_run(), LM_FAULT_NONE, 0, 3);
    with_zero = 0;
}

/* The same on the device path (the CPU backend standing in for a GPU: the device engine's
 * reduce-scatter into the backend's buffer, then its copy), and a gradient NaN on one rank
 * still skipping the step on every rank (it reaches the other ranks through the norm). */
static void test_zero1_buckets_on_the_device_path(void) {
    with_zero = 1;
    with_backend = lm_backend_cpu();
    bucketed_equals_unbucketed("zero1-dev", small_run(), LM_FAULT_NONE, 0, 3);
    bucketed_equals_unbucketed("zero1-dev-nan", small_run(), LM_FAULT_GRADIENT, 1, 1);
    with_backend = NULL;
    with_zero = 0;
}

/* A NaN in the last rank's rows in the first micro-batch of a step: that rank leaves its loop early and
 * joins the agreement the others hold before their last backward; every rank skips the step. */
static void test_a_forward_failing_on_one_rank_skips_the_step(void) {
    bucketed_equals_unbucketed("batch-fault", small_run(), LM_FAULT_BATCH, 1, 1);
}

/* A NaN in one rank's gradient reaches every rank through its bucket's sum: every rank skips. */
static void test_a_gradient_nan_on_one_rank_skips_the_step(void) {
    bucketed_equals_unbucketed("grad-fault", small_run(), LM_FAULT_GRADIENT, 1, 1);
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        RUN(test_every_gradient_is_reported_once_after_its_last_write);
        RUN(test_a_hook_error_stops_the_backward);
        return test_summary();
    }
    int rc = ranks_open(want_ranks, "grad_buckets");
    if (rc) return rc;
    RUN(test_bucketed_sums_equal_the_one_sum);
    RUN(test_bucketed_sums_with_sequence_segments);
    RUN(test_bucketed_sums_with_recompute);
    RUN(test_a_forward_failing_on_one_rank_skips_the_step);
    RUN(test_a_gradient_nan_on_one_rank_skips_the_step);
    RUN(test_zero1_buckets_equal_the_one_reduce_scatter);
    RUN(test_zero1_buckets_on_the_device_path);
    ranks_close();
    return test_summary();
}
