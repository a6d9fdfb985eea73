/* The backend optimizer path on the CPU backend (include/longmoe/optim_device.h
 * and the optimizer ops of include/longmoe/backend.h) against the host
 * optimizer of include/longmoe/optim.h: every result bit for bit. */
#include <omp.h>

#include "longmoe/backend.h"
#include "longmoe/model.h"
#include "longmoe/optim.h"
#include "longmoe/optim_device.h"
#include "test.h"
#include "test_models.h"

#define OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

static float *alloc_f(size_t n) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static void fill(lm_rng *r, float *x, size_t n, double s) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(s * lm_rng_normal(r));
}

/* A parameter table of mixed shapes: whole matrices, per-head and per-expert
 * row blocks (wide and tall blocks), odd sizes, vectors, norms, a scalar and an
 * embedding, with data and grad in two flat blocks. */
#define NP 9
typedef struct {
    lm_param p[NP];
    float *data, *grad;
    size_t n;
} table;

static void table_make(table *t, lm_rng *r) {
    struct { int64_t rows, cols; int blocks; lm_param_kind kind; int ndim; } spec[NP] = {
        {48, 40, 1, LM_PARAM_MATRIX, 2},  {4 * 12, 33, 4, LM_PARAM_MATRIX, 2}, /* per head, wide blocks */
        {3 * 20, 7, 3, LM_PARAM_MATRIX, 2}, /* per expert, tall blocks (transposed) */
        {17, 29, 1, LM_PARAM_MATRIX, 2},  {97, 16, 1, LM_PARAM_EMBEDDING, 2},
        {40, 1, 1, LM_PARAM_NORM, 1},     {31, 1, 1, LM_PARAM_VECTOR, 1},
        {1, 1, 1, LM_PARAM_SCALAR, 0},    {5, 3, 1, LM_PARAM_MATRIX, 2}};
    size_t n = 0;
    for (int i = 0; i < NP; i++) n += (size_t)(spec[i].rows * spec[i].cols);
    t->n = n;
    t->data = alloc_f(n);
    t->grad = alloc_f(n);
    fill(r, t->data, n, 0.5);
    size_t off = 0;
    for (int i = 0; i < NP; i++) {
        float *d = t->data + off, *g = t->grad + off;
        if (spec[i].ndim == 2)
            t->p[i] = lm_param_matrix("m", d, g, spec[i].rows, spec[i].cols, spec[i].kind);
        else
            t->p[i] = lm_param_vector("v", d, g, spec[i].rows, spec[i].kind);
        t->p[i].n_blocks = spec[i].blocks;
        off += (size_t)(spec[i].rows * spec[i].cols);
    }
}

/* a copy of a with its own blocks */
static void table_copy(table *b, const table *a) {
    *b = *a;
    b->data = alloc_f(a->n);
    b->grad = alloc_f(a->n);
    memcpy(b->data, a->data, a->n * sizeof(float));
    memcpy(b->grad, a->grad, a->n * sizeof(float));
    for (int i = 0; i < NP; i++) {
        b->p[i].data = b->data + (a->p[i].data - a->data);
        b->p[i].grad = b->grad + (a->p[i].grad - a->grad);
    }
}

static void table_free(table *t) {
    free(t->data);
    free(t->grad);
}

static void test_ops_equal_the_host_functions(void) {
    lm_backend *be = lm_backend_cpu();
    lm_rng r;
    lm_rng_seed(&r, 101);
    size_t n = 70001; /* above the parallel threshold, not a multiple of the blocks */
    float *x = alloc_f(n), *y = alloc_f(n);
    fill(&r, x, n, 1.3);
    double got = -1;
    OK(be->ops->sum_squares(be, x, n, &got));
    CHECK(got == lm_sum_squares(x, (int64_t)n), "sum_squares %.17g vs %.17g", got, lm_sum_squares(x, (int64_t)n));
    memcpy(y, x, n * sizeof(float));
    OK(be->ops->scale(be, y, n, 0.37f));
    lm_param p = lm_param_vector("x", y, x, (int64_t)n, LM_PARAM_VECTOR); /* x is the gradient */
    lm_grads_scale(&p, 1, 0.37f);
    CHECK(!memcmp(x, y, n * sizeof(float)), "scale differs from lm_grads_scale");
    /* AdamW and Muon through the ops vs the functions */
    table a, b;
    table_make(&a, &r);
    fill(&r, a.grad, a.n, 0.1);
    table_copy(&b, &a);
    lm_optim_config cfg = lm_optim_config_default();
    float *m1 = calloc(a.n * 2, sizeof(float)), *m2 = calloc(a.n * 2, sizeof(float));
    lm_param *pa = &a.p[4], *pb = &b.p[4];
    int64_t ne = lm_param_numel(pa);
    lm_adamw_update(pa->data, pa->grad, m1, m1 + ne, ne, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 3);
    OK(be->ops->adamw_update(be, pb->data, pb->grad, m2, m2 + ne, ne, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 3));
    CHECK(!memcmp(pa->data, pb->data, (size_t)ne * 4) && !memcmp(m1, m2, (size_t)ne * 8), "adamw op differs");
    pa = &a.p[1];
    pb = &b.p[1];
    size_t sf = lm_muon_scratch_floats(pa->rows, pa->cols, pa->n_blocks);
    CHECK(be->ops->muon_scratch_bytes(be, pa->rows, pa->cols, pa->n_blocks) == sf * sizeof(float),
          "muon scratch bytes");
    float *s1 = alloc_f(sf), *s2 = alloc_f(sf);
    OK(lm_muon_update(pa->data, pa->grad, m1, pa->rows, pa->cols, pa->n_blocks, 2e-2f, 0.1f, &cfg, s1, sf));
    OK(be->ops->muon_update(be, pb->data, pb->grad, m2, pb->rows, pb->cols, pb->n_blocks, 2e-2f, 0.1f, &cfg, s2,
                            sf * sizeof(float)));
    CHECK(!memcmp(pa->data, pb->data, (size_t)lm_param_numel(pa) * 4), "muon op differs");
    free(s1);
    free(s2);
    free(m1);
    free(m2);
    free(x);
    free(y);
    table_free(&a);
    table_free(&b);
}

/* Steps of lm_optimizer with lm_grad_clip vs lm_device_optimizer with
 * lm_grad_clip_on on the CPU backend, fresh gradients each step, clipping on
 * some steps: parameters, state and norms bit for bit. */
static void run_host_vs_backend(int threads) {
    omp_set_num_threads(threads);
    lm_backend *be = lm_backend_cpu();
    lm_rng r;
    lm_rng_seed(&r, 202 + (uint64_t)threads);
    table a, b;
    table_make(&a, &r);
    table_copy(&b, &a);
    lm_optim_config cfg = lm_optim_config_default();
    size_t sn = lm_optim_state_floats(a.p, NP), cn = lm_optim_scratch_floats(a.p, NP);
    float *state = alloc_f(sn), *scratch = alloc_f(cn);
    lm_optimizer host;
    OK(lm_optimizer_init(&host, &cfg, a.p, NP, state, sn, scratch, cn));
    lm_device_optimizer *dev = NULL;
    OK(lm_optimizer_create_on(be, &cfg, b.p, NP, &dev));
    if (!dev) return;
    CHECK(lm_device_optimizer_state_floats(dev) == sn, "state floats %zu vs %zu",
          lm_device_optimizer_state_floats(dev), sn);
    double work[NP];
    CHECK(lm_grad_norm_work_bytes(NP) <= sizeof work, "work bytes");
    for (int step = 0; step < 6; step++) {
        fill(&r, a.grad, a.n, 0.05 * (step + 1));
        memcpy(b.grad, a.grad, a.n * sizeof(float));
        float max_norm = step % 2 ? 0.5f : 1e6f; /* clip on odd steps */
        double n1 = -1, n2 = -2;
        OK(lm_grad_clip(a.p, NP, max_norm, &n1));
        OK(lm_grad_clip_on(be, b.p, NP, max_norm, work, &n2));
        CHECK(n1 == n2, "step %d: norm %.17g vs %.17g", step, n1, n2);
        CHECK(!memcmp(a.grad, b.grad, a.n * 4), "step %d: clipped gradients differ", step);
        float lr = 0.01f * (float)(step + 1);
        OK(lm_optimizer_step(&host, lr));
        OK(lm_device_optimizer_step(dev, lr));
        CHECK(!memcmp(a.data, b.data, a.n * 4), "step %d (%d threads): parameters differ", step, threads);
    }
    float *st2 = alloc_f(sn);
    int64_t steps = -1;
    OK(lm_device_optimizer_download_state(dev, st2, sn, &steps));
    CHECK(!memcmp(state, st2, sn * 4), "state differs from the host optimizer's");
    CHECK(steps == host.step, "steps %lld vs %lld", (long long)steps, (long long)host.step);
    free(st2);
    free(state);
    free(scratch);
    lm_device_optimizer_free(dev);
    table_free(&a);
    table_free(&b);
}

static void test_backend_optimizer_equals_host_optimizer_one_thread(void) { run_host_vs_backend(1); }
static void test_backend_optimizer_equals_host_optimizer_two_threads(void) { run_host_vs_backend(2); }

static void test_state_round_trip_continues_identically(void) {
    lm_backend *be = lm_backend_cpu();
    lm_rng r;
    lm_rng_seed(&r, 303);
    table a, b;
    table_make(&a, &r);
    lm_optim_config cfg = lm_optim_config_default();
    lm_device_optimizer *o1 = NULL, *o2 = NULL;
    OK(lm_optimizer_create_on(be, &cfg, a.p, NP, &o1));
    for (int s = 0; s < 3; s++) {
        fill(&r, a.grad, a.n, 0.1);
        OK(lm_device_optimizer_step(o1, 0.02f));
    }
    table_copy(&b, &a);
    OK(lm_optimizer_create_on(be, &cfg, b.p, NP, &o2));
    size_t sn = lm_device_optimizer_state_floats(o1);
    float *st = alloc_f(sn);
    int64_t k = 0;
    OK(lm_device_optimizer_download_state(o1, st, sn, &k));
    OK(lm_device_optimizer_upload_state(o2, st, sn, k));
    CHECK(lm_device_optimizer_upload_state(o2, st, sn - 1, k) == LM_ERR_ARG, "a short state was accepted");
    for (int s = 0; s < 3; s++) {
        fill(&r, a.grad, a.n, 0.1);
        memcpy(b.grad, a.grad, a.n * 4);
        OK(lm_device_optimizer_step(o1, 0.02f));
        OK(lm_device_optimizer_step(o2, 0.02f));
    }
    CHECK(!memcmp(a.data, b.data, a.n * 4), "the resumed optimizer diverged");
    /* rebind: same layout accepted, another shape refused */
    OK(lm_device_optimizer_rebind(o2, a.p, NP));
    lm_param bad[NP];
    memcpy(bad, b.p, sizeof bad);
    bad[0].cols = 39;
    CHECK(lm_device_optimizer_rebind(o2, bad, NP) == LM_ERR_ARG, "rebind to another shape accepted");
    free(st);
    lm_device_optimizer_free(o1);
    lm_device_optimizer_free(o2);
    table_free(&a);
    table_free(&b);
}

static void test_non_finite_gradients_are_reported_untouched(void) {
    lm_backend *be = lm_backend_cpu();
    lm_rng r;
    lm_rng_seed(&r, 404);
    table a;
    table_make(&a, &r);
    fill(&r, a.grad, a.n, 1.0);
    a.grad[a.n / 2] = NAN;
    float *keep = alloc_f(a.n);
    memcpy(keep, a.grad, a.n * 4);
    double work[NP], norm = 0;
    CHECK(lm_grad_clip_on(be, a.p, NP, 0.1f, work, &norm) == LM_ERR_NUMERIC, "NaN gradient not reported");
    CHECK(!isfinite(norm), "norm %g", norm);
    CHECK(!memcmp(keep, a.grad, a.n * 4), "gradients changed despite the non-finite norm");
    free(keep);
    table_free(&a);
}

static void test_qk_clip_on_the_cpu_backend_equals_host(void) {
    lm_rng r;
    lm_rng_seed(&r, 505);
    int H = 3, Dk = 8, rope = 2, ql = 12, kvl = 10, Dn = Dk - rope;
    size_t nq = (size_t)H * Dk * ql, nk = (size_t)H * Dn * kvl;
    float *q1 = alloc_f(nq), *k1 = alloc_f(nk), *q2 = alloc_f(nq), *k2 = alloc_f(nk);
    fill(&r, q1, nq, 1);
    fill(&r, k1, nk, 1);
    memcpy(q2, q1, nq * 4);
    memcpy(k2, k1, nk * 4);
    float smax[3] = {150.f, 20.f, 101.5f}, e1[3], e2[3];
    int c1 = 0, c2 = 0;
    OK(lm_qk_clip_mla(q1, k1, H, Dk, rope, ql, kvl, smax, 100.f, e1, &c1));
    OK(lm_qk_clip_mla_on(lm_backend_cpu(), q2, k2, H, Dk, rope, ql, kvl, smax, 100.f, e2, &c2));
    CHECK(c1 == 2 && c2 == 2, "clipped %d %d", c1, c2);
    CHECK(!memcmp(q1, q2, nq * 4) && !memcmp(k1, k2, nk * 4) && !memcmp(e1, e2, sizeof e1), "MLA clip differs");
    OK(lm_qk_clip_gqa(q1, k1, 3, 3, 4, 12, smax, 50.f, NULL, &c1));
    OK(lm_qk_clip_gqa_on(lm_backend_cpu(), q2, k2, 3, 3, 4, 12, smax, 50.f, NULL, &c2));
    CHECK(!memcmp(q1, q2, nq * 4) && !memcmp(k1, k2, nk * 4), "GQA clip differs");
    free(q1);
    free(k1);
    free(q2);
    free(k2);
}

/* On a CPU model the backend descriptors are the host ones and the helpers
 * for backend parameters change nothing. */
static void test_model_backend_helpers_on_the_cpu(void) {
    lm_config c = test_micro_config();
    lm_model *m = NULL;
    OK(lm_model_create(&c, 2, 16, &m));
    if (!m) return;
    lm_model_init(m, 3);
    int n = lm_model_num_tensors(m);
    lm_param *a = calloc((size_t)n, sizeof *a), *b = calloc((size_t)n, sizeof *b);
    lm_model_optimizer_params(m, a, LM_TRAIN_MUON);
    lm_model_backend_params(m, b, LM_TRAIN_MUON);
    int same = 1;
    for (int i = 0; i < n; i++)
        same &= a[i].data == b[i].data && a[i].grad == b[i].grad && a[i].rows == b[i].rows &&
                a[i].cols == b[i].cols && a[i].n_blocks == b[i].n_blocks;
    CHECK(same, "backend descriptors differ from the host ones on the CPU");
    size_t np = lm_model_num_params(m);
    float *keep = alloc_f(np);
    memcpy(keep, lm_model_params(m), np * 4);
    OK(lm_model_params_changed_on_backend(m));
    CHECK(lm_model_host_params_stale(m) == 0, "a CPU model's host copy marked stale");
    OK(lm_model_download_params(m));
    CHECK(!memcmp(keep, lm_model_params(m), np * 4), "download changed a CPU model's parameters");
    free(keep);
    free(a);
    free(b);
    lm_model_free(m);
}

int main(void) {
    RUN(test_ops_equal_the_host_functions);
    RUN(test_backend_optimizer_equals_host_optimizer_one_thread);
    RUN(test_backend_optimizer_equals_host_optimizer_two_threads);
    RUN(test_state_round_trip_continues_identically);
    RUN(test_non_finite_gradients_are_reported_untouched);
    RUN(test_qk_clip_on_the_cpu_backend_equals_host);
    RUN(test_model_backend_helpers_on_the_cpu);
    return test_summary();
}
