/* The optimizer on the GPU (include/longmoe/optim_device.h, the optimizer ops
 * of the CUDA backend) against the host optimizer of include/longmoe/optim.h.
 *
 * Tolerances:
 *   AdamW, momentum, clipping, scaling: 1e-6 relative. The kernels spell every
 *     fp32 operation with IEEE intrinsics, so the only differences from the
 *     CPU come from the CPU compiler contracting a*b + c into an FMA.
 *   Muon update (the change of the weights), TF32 products: 2e-2 relative
 *     (Frobenius). TF32 keeps 10 mantissa bits (unit roundoff 2^-11 = 4.9e-4)
 *     in each product operand, fp32 accumulation; 15 products of quintic
 *     Newton–Schulz on normalised random matrices give ~3-4e-3 relative error
 *     in the orthogonalised factor (8e-3 for a 3 x 5 block), measured with a
 *     float64 simulation of TF32 operand rounding; 2e-2 leaves a margin.
 *   Muon update with muon_ns_fp32 = 1 (full fp32 products): 1e-4 (the same
 *     simulation in fp32 gives ~1e-6).
 *   Global gradient norm: 1e-12 relative to a float64 sum (both sum in double,
 *     in different orders).
 * Bit-identity is required where it must hold: the same inputs twice, a state
 * download -> upload that continues, untouched gradients on a non-finite norm,
 * QK-Clip rows (one rounding of an exact double product on both sides). */
#include <omp.h>

#include "test.h"
#include "test_cuda.h"
#include "test_models.h"

#include "longmoe/backend.h"
#include "longmoe/model.h"
#include "longmoe/optim.h"
#include "longmoe/optim_device.h"

static lm_backend *gpu;

#define OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

#define TOL_ELEM 1e-6
#define TOL_MUON_TF32 2e-2
#define TOL_MUON_FP32 1e-4

/* ---- a parameter table on the host and its copy on the device ---- */

#define NP 10
typedef struct {
    lm_param h[NP], d[NP];  /* host descriptors, device descriptors */
    float *hdata, *hgrad;   /* host blocks */
    float *ddata, *dgrad;   /* device blocks */
    size_t n;
} table;

static float *alloc_f(size_t n) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* Mixed shapes: a whole matrix, per-head Q/K/V blocks (wide), per-expert
 * stacks (tall blocks, transposed inside Newton–Schulz), odd sizes, a tiny
 * 3 x 5, an embedding, vectors, a norm, a scalar. only: -1 all, else the
 * optimizer every parameter is forced to (AdamW takes any shape). */
static void table_make(table *t, lm_rng *r, lm_optimizer_kind only) {
    struct { int64_t rows, cols; int blocks; lm_param_kind kind; int ndim; } spec[NP] = {
        {64, 48, 1, LM_PARAM_MATRIX, 2},     {4 * 16, 40, 4, LM_PARAM_MATRIX, 2},
        {3 * 24, 10, 3, LM_PARAM_MATRIX, 2}, {33, 17, 1, LM_PARAM_MATRIX, 2},
        {7, 129, 1, LM_PARAM_MATRIX, 2},     {3, 5, 1, LM_PARAM_MATRIX, 2},
        {101, 24, 1, LM_PARAM_EMBEDDING, 2}, {48, 1, 1, LM_PARAM_NORM, 1},
        {37, 1, 1, LM_PARAM_VECTOR, 1},      {1, 1, 1, LM_PARAM_SCALAR, 0}};
    size_t n = 0;
    for (int i = 0; i < NP; i++) n += (size_t)(spec[i].rows * spec[i].cols);
    t->n = n;
    t->hdata = host_normal(n, 0.5, 0.0, 0, r);
    t->hgrad = host_normal(n, 0.1, 0.0, 0, r);
    OK(gpu->alloc(gpu, n * sizeof(float), (void **)&t->ddata));
    OK(gpu->alloc(gpu, n * sizeof(float), (void **)&t->dgrad));
    OK(gpu->upload(gpu, t->ddata, t->hdata, n * sizeof(float)));
    OK(gpu->upload(gpu, t->dgrad, t->hgrad, n * sizeof(float)));
    size_t off = 0;
    for (int i = 0; i < NP; i++) {
        lm_param p;
        if (spec[i].ndim == 2)
            p = lm_param_matrix("m", t->hdata + off, t->hgrad + off, spec[i].rows, spec[i].cols, spec[i].kind);
        else
            p = lm_param_vector("v", t->hdata + off, t->hgrad + off, spec[i].rows, spec[i].kind);
        p.n_blocks = spec[i].blocks;
        if ((int)only >= 0) p.optimizer = only;
        t->h[i] = p;
        t->d[i] = p;
        t->d[i].data = t->ddata + off;
        t->d[i].grad = t->dgrad + off;
        off += (size_t)(spec[i].rows * spec[i].cols);
    }
}

static void table_free(table *t) {
    free(t->hdata);
    free(t->hgrad);
    gpu->release(gpu, t->ddata);
    gpu->release(gpu, t->dgrad);
}

/* fresh gradients on both sides */
static void new_grads(table *t, lm_rng *r, double scale) {
    fill_normal(t->hgrad, t->n, r, scale, 0.0, 0);
    OK(gpu->upload(gpu, t->dgrad, t->hgrad, t->n * sizeof(float)));
}

static float *down(const float *d, size_t n) {
    float *h = alloc_f(n);
    OK(gpu->download(gpu, h, d, n * sizeof(float)));
    return h;
}

/* ---- cases ---- */

static void test_adamw_matches_the_cpu_over_steps(void) {
    lm_rng r;
    lm_rng_seed(&r, 11);
    table t;
    table_make(&t, &r, LM_OPT_ADAMW);
    lm_optim_config cfg = lm_optim_config_default();
    size_t sn = lm_optim_state_floats(t.h, NP);
    float *state = calloc(sn, sizeof(float));
    lm_optimizer host;
    OK(lm_optimizer_init(&host, &cfg, t.h, NP, state, sn, NULL, 0));
    lm_device_optimizer *dev = NULL;
    OK(lm_optimizer_create_on(gpu, &cfg, t.d, NP, &dev));
    for (int s = 0; s < 6; s++) {
        new_grads(&t, &r, 0.05 * (s + 1));
        OK(lm_optimizer_step(&host, 1e-2f));
        OK(lm_device_optimizer_step(dev, 1e-2f));
    }
    float *w = down(t.ddata, t.n), *st = alloc_f(sn);
    int64_t k = 0;
    OK(lm_device_optimizer_download_state(dev, st, sn, &k));
    double ew = rel_err(w, t.hdata, t.n), es = rel_err(st, state, sn);
    printf("  adamw: weights %.3g, state %.3g relative\n", ew, es);
    CHECK(ew <= TOL_ELEM && es <= TOL_ELEM, "AdamW weights %.3g, state %.3g > %.1g", ew, es, TOL_ELEM);
    CHECK(k == 6, "steps %lld", (long long)k);
    free(w);
    free(st);
    free(state);
    lm_device_optimizer_free(dev);
    table_free(&t);
}

/* Muon (and AdamW on the non-matrices) for 4 steps: each step from the same
 * weights on both sides (the device weights reset to the host's), so the
 * error of each step's update is measured on its own. */
static void run_muon(int fp32, double tol) {
    lm_rng r;
    lm_rng_seed(&r, 22 + (uint64_t)fp32);
    table t;
    table_make(&t, &r, (lm_optimizer_kind)-1);
    lm_optim_config cfg = lm_optim_config_default();
    cfg.muon_ns_fp32 = fp32;
    size_t sn = lm_optim_state_floats(t.h, NP), cn = lm_optim_scratch_floats(t.h, NP);
    float *state = calloc(sn, sizeof(float)), *scratch = alloc_f(cn);
    lm_optimizer host;
    OK(lm_optimizer_init(&host, &cfg, t.h, NP, state, sn, scratch, cn));
    lm_device_optimizer *dev = NULL;
    OK(lm_optimizer_create_on(gpu, &cfg, t.d, NP, &dev));
    float *before = alloc_f(t.n), *st = alloc_f(sn);
    double worst = 0;
    for (int s = 0; s < 4; s++) {
        new_grads(&t, &r, 0.1);
        memcpy(before, t.hdata, t.n * sizeof(float));
        OK(gpu->upload(gpu, t.ddata, t.hdata, t.n * sizeof(float)));
        OK(lm_optimizer_step(&host, 2e-2f));
        OK(lm_device_optimizer_step(dev, 2e-2f));
        float *w = down(t.ddata, t.n);
        for (int i = 0; i < NP; i++) {
            size_t off = (size_t)(t.h[i].data - t.hdata), n = (size_t)lm_param_numel(&t.h[i]);
            int muon = lm_param_optimizer(&t.h[i]) == LM_OPT_MUON;
            double e = rel_err_increment(w + off, t.hdata + off, before + off, n);
            if (muon) worst = e > worst ? e : worst;
            CHECK(e <= (muon ? tol : TOL_ELEM), "step %d param %d [%lld x %lld / %d] %s: update error %.3g", s, i,
                  (long long)t.h[i].rows, (long long)t.h[i].cols, t.h[i].n_blocks, muon ? "muon" : "adamw", e);
        }
        free(w);
    }
    /* the momentum depends on the gradients only: elementwise agreement */
    int64_t k = 0;
    OK(lm_device_optimizer_download_state(dev, st, sn, &k));
    double es = rel_err(st, state, sn);
    printf("  muon (%s products): worst update error %.3g, state %.3g\n", fp32 ? "fp32" : "TF32", worst, es);
    CHECK(es <= TOL_ELEM, "state %.3g", es);
    free(before);
    free(st);
    free(state);
    free(scratch);
    lm_device_optimizer_free(dev);
    table_free(&t);
}

static void test_muon_tf32_matches_the_cpu_per_step(void) { run_muon(0, TOL_MUON_TF32); }
static void test_muon_fp32_matches_the_cpu_per_step(void) { run_muon(1, TOL_MUON_FP32); }

static void test_grad_norm_and_clipping_match_float64(void) {
    lm_rng r;
    lm_rng_seed(&r, 33);
    table t;
    table_make(&t, &r, (lm_optimizer_kind)-1);
    void *work = NULL;
    OK(gpu->alloc(gpu, lm_grad_norm_work_bytes(NP), &work));
    double ref = 0;
    for (size_t i = 0; i < t.n; i++) ref += (double)t.hgrad[i] * t.hgrad[i];
    ref = sqrt(ref);
    double nd = -1;
    OK(lm_grad_global_norm_on(gpu, t.d, NP, work, &nd));
    CHECK(fabs(nd - ref) <= 1e-12 * ref, "norm %.17g vs float64 %.17g", nd, ref);
    CHECK(fabs(nd - lm_grad_global_norm(t.h, NP)) <= 1e-12 * ref, "norm vs the CPU's");
    /* no clip above the norm: gradients untouched */
    OK(lm_grad_clip_on(gpu, t.d, NP, (float)(2 * ref), work, &nd));
    float *g = down(t.dgrad, t.n);
    CHECK(!memcmp(g, t.hgrad, t.n * 4), "gradients changed without clipping");
    free(g);
    /* clip to a quarter */
    float mx = (float)(0.25 * ref);
    double nh = 0;
    OK(lm_grad_clip(t.h, NP, mx, &nh));
    OK(lm_grad_clip_on(gpu, t.d, NP, mx, work, &nd));
    g = down(t.dgrad, t.n);
    double e = rel_err(g, t.hgrad, t.n);
    CHECK(e <= TOL_ELEM, "clipped gradients %.3g", e);
    double after = 0;
    for (size_t i = 0; i < t.n; i++) after += (double)g[i] * g[i];
    CHECK(fabs(sqrt(after) - mx) <= 1e-5 * mx, "norm after clipping %.9g, want %.9g", sqrt(after), (double)mx);
    free(g);
    /* a norm over a large odd-sized tensor (many partial blocks) */
    size_t big = 3000017;
    float *hx = host_normal(big, 1.5, 0.2, 0, &r), *dx = NULL;
    OK(gpu->alloc(gpu, big * 4, (void **)&dx));
    OK(gpu->upload(gpu, dx, hx, big * 4));
    lm_param bp = lm_param_vector("big", dx + 1, dx, (int64_t)big, LM_PARAM_VECTOR); /* data unused */
    double bref = 0;
    for (size_t i = 0; i < big; i++) bref += (double)hx[i] * hx[i];
    bref = sqrt(bref);
    OK(lm_grad_global_norm_on(gpu, &bp, 1, work, &nd));
    CHECK(fabs(nd - bref) <= 1e-12 * bref, "big norm %.17g vs %.17g", nd, bref);
    double nd2 = -1;
    OK(lm_grad_global_norm_on(gpu, &bp, 1, work, &nd2));
    CHECK(nd == nd2, "the same norm twice differs: %.17g vs %.17g", nd, nd2);
    free(hx);
    gpu->release(gpu, dx);
    gpu->release(gpu, work);
    table_free(&t);
}

static void test_non_finite_gradient_is_reported_and_left_untouched(void) {
    lm_rng r;
    lm_rng_seed(&r, 44);
    table t;
    table_make(&t, &r, (lm_optimizer_kind)-1);
    void *work = NULL;
    OK(gpu->alloc(gpu, lm_grad_norm_work_bytes(NP), &work));
    const float bad[2] = {NAN, INFINITY};
    for (int b = 0; b < 2; b++) {
        OK(gpu->upload(gpu, t.dgrad, t.hgrad, t.n * 4));
        size_t at = t.n / 3 + (size_t)b * 17;
        float keep = t.hgrad[at];
        t.hgrad[at] = bad[b];
        OK(gpu->upload(gpu, t.dgrad + at, &t.hgrad[at], 4));
        double nd = 0;
        lm_status st = lm_grad_clip_on(gpu, t.d, NP, 0.1f, work, &nd);
        CHECK(st == LM_ERR_NUMERIC, "%s gradient: status %d", b ? "inf" : "NaN", (int)st);
        CHECK(!isfinite(nd), "norm %g", nd);
        float *g = down(t.dgrad, t.n);
        CHECK(!memcmp(g, t.hgrad, t.n * 4), "gradients changed despite the non-finite norm");
        free(g);
        t.hgrad[at] = keep;
    }
    gpu->release(gpu, work);
    table_free(&t);
}

/* n steps of a fresh device optimizer from the table's initial values with
 * gradients drawn from seed; returns the final device weights */
static float *device_run(uint64_t seed, int steps) {
    lm_rng r;
    lm_rng_seed(&r, seed);
    table t;
    table_make(&t, &r, (lm_optimizer_kind)-1);
    lm_optim_config cfg = lm_optim_config_default();
    lm_device_optimizer *dev = NULL;
    OK(lm_optimizer_create_on(gpu, &cfg, t.d, NP, &dev));
    for (int s = 0; s < steps; s++) {
        new_grads(&t, &r, 0.1);
        OK(lm_device_optimizer_step(dev, 2e-2f));
    }
    float *w = down(t.ddata, t.n);
    lm_device_optimizer_free(dev);
    table_free(&t);
    return w;
}

static void test_same_inputs_twice_are_bit_identical(void) {
    float *a = device_run(55, 4), *b = device_run(55, 4);
    lm_rng r;
    lm_rng_seed(&r, 55);
    table t;
    table_make(&t, &r, (lm_optimizer_kind)-1);
    CHECK(!memcmp(a, b, t.n * 4), "two runs on the same inputs differ");
    free(a);
    free(b);
    table_free(&t);
}

static void test_state_download_upload_continues_bit_identically(void) {
    lm_rng r;
    lm_rng_seed(&r, 66);
    table a, b;
    table_make(&a, &r, (lm_optimizer_kind)-1);
    lm_rng_seed(&r, 66);
    table_make(&b, &r, (lm_optimizer_kind)-1);
    lm_optim_config cfg = lm_optim_config_default();
    lm_device_optimizer *o1 = NULL, *o2 = NULL;
    OK(lm_optimizer_create_on(gpu, &cfg, a.d, NP, &o1));
    OK(lm_optimizer_create_on(gpu, &cfg, b.d, NP, &o2));
    for (int s = 0; s < 3; s++) {
        new_grads(&a, &r, 0.1);
        OK(lm_device_optimizer_step(o1, 2e-2f));
    }
    /* a checkpoint: weights and state to the host, into the second optimizer */
    size_t sn = lm_device_optimizer_state_floats(o1);
    float *w = down(a.ddata, a.n), *st = alloc_f(sn);
    int64_t k = 0;
    OK(lm_device_optimizer_download_state(o1, st, sn, &k));
    OK(gpu->upload(gpu, b.ddata, w, a.n * 4));
    OK(lm_device_optimizer_upload_state(o2, st, sn, k));
    for (int s = 0; s < 3; s++) {
        new_grads(&a, &r, 0.1);
        OK(gpu->upload(gpu, b.dgrad, a.hgrad, a.n * 4));
        OK(lm_device_optimizer_step(o1, 2e-2f));
        OK(lm_device_optimizer_step(o2, 2e-2f));
    }
    float *w1 = down(a.ddata, a.n), *w2 = down(b.ddata, a.n);
    CHECK(!memcmp(w1, w2, a.n * 4), "the resumed optimizer diverged");
    CHECK(lm_device_optimizer_steps(o2) == 6, "steps %lld", (long long)lm_device_optimizer_steps(o2));
    free(w);
    free(st);
    free(w1);
    free(w2);
    lm_device_optimizer_free(o1);
    lm_device_optimizer_free(o2);
    table_free(&a);
    table_free(&b);
}

static void test_qk_clip_on_the_device_equals_the_host(void) {
    lm_rng r;
    lm_rng_seed(&r, 77);
    int H = 4, Dk = 24, rope = 8, ql = 40, kvl = 32, Dn = Dk - rope;
    size_t nq = (size_t)H * Dk * ql, nk = (size_t)H * Dn * kvl;
    float *q = host_normal(nq, 1, 0, 0, &r), *k = host_normal(nk, 1, 0, 0, &r), *dq = NULL, *dk = NULL;
    OK(gpu->alloc(gpu, nq * 4, (void **)&dq));
    OK(gpu->alloc(gpu, nk * 4, (void **)&dk));
    OK(gpu->upload(gpu, dq, q, nq * 4));
    OK(gpu->upload(gpu, dk, k, nk * 4));
    float smax[4] = {180.f, 30.f, 100.5f, 250.f};
    int c1 = 0, c2 = 0;
    OK(lm_qk_clip_mla(q, k, H, Dk, rope, ql, kvl, smax, 100.f, NULL, &c1));
    OK(lm_qk_clip_mla_on(gpu, dq, dk, H, Dk, rope, ql, kvl, smax, 100.f, NULL, &c2));
    float *gq = down(dq, nq), *gk = down(dk, nk);
    CHECK(c1 == 3 && c2 == 3, "clipped %d and %d heads, want 3", c1, c2);
    CHECK(!memcmp(gq, q, nq * 4) && !memcmp(gk, k, nk * 4), "MLA rows differ from the host's");
    free(gq);
    free(gk);
    /* GQA with shared key heads: only the query rows */
    OK(lm_qk_clip_gqa(q, k, 4, 2, 8, 40, smax, 60.f, NULL, &c1));
    OK(lm_qk_clip_gqa_on(gpu, dq, dk, 4, 2, 8, 40, smax, 60.f, NULL, &c2));
    gq = down(dq, nq);
    gk = down(dk, nk);
    CHECK(!memcmp(gq, q, nq * 4) && !memcmp(gk, k, nk * 4), "GQA rows differ from the host's");
    free(gq);
    free(gk);
    free(q);
    free(k);
    gpu->release(gpu, dq);
    gpu->release(gpu, dk);
}

/* A device model trained two ways from the same start: the host optimizer
 * (gradients down, parameters up) and the device optimizer on the model's
 * backend blocks (lm_model_backend_params, lm_model_params_changed_on_backend),
 * with QK-Clip every step (tau = 1e-9: far below the logits of a fresh model, so heads clip). AdamW
 * everywhere, so both paths compute the same numbers: the clipped heads agree,
 * losses and norms to 1e-4, the final parameters to 1e-6. */
static void test_model_trained_on_the_device_matches_the_host_path(void) {
    lm_config c = test_small_hybrid_config(); /* head sizes the GPU operators take */
    int B = 2, T = 64;
    lm_model *a = NULL, *b = NULL;
    OK(lm_model_create_on(&c, B, T, gpu, &a));
    OK(lm_model_create_on(&c, B, T, gpu, &b));
    if (!a || !b) return;
    lm_model_init(a, 9);
    lm_model_init(b, 9);
    int np = lm_model_num_tensors(a);
    size_t n = lm_model_num_params(a);
    lm_param *pa = calloc((size_t)np, sizeof *pa), *pb = calloc((size_t)np, sizeof *pb);
    lm_model_optimizer_params(a, pa, LM_TRAIN_ADAMW);
    lm_model_backend_params(b, pb, LM_TRAIN_ADAMW);
    lm_optim_config cfg = lm_optim_config_default();
    size_t sn = lm_optim_state_floats(pa, np);
    float *state = calloc(sn + 1, sizeof(float));
    lm_optimizer host;
    OK(lm_optimizer_init(&host, &cfg, pa, np, state, sn, NULL, 0));
    lm_device_optimizer *dev = NULL;
    OK(lm_optimizer_create_on(gpu, &cfg, pb, np, &dev));
    void *work = NULL;
    OK(gpu->alloc(gpu, lm_grad_norm_work_bytes(np), &work));
    lm_rng r;
    lm_rng_seed(&r, 99);
    size_t N = (size_t)B * T;
    int32_t *tok = malloc(N * sizeof *tok), *tgt = malloc(N * sizeof *tgt);
    int clipped = 0;
    for (int s = 0; s < 3 && dev; s++) {
        for (size_t i = 0; i < N; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)c.vocab_size);
        for (size_t i = 0; i < N; i++) tgt[i] = i % (size_t)T ? tok[i - 1] : tok[i];
        float la = NAN, lb = NAN, mxa = 0, mxb = 0;
        int ca = 0, cb = 0;
        double na = 0, nb = 0;
        /* host path */
        lm_model_zero_grads(a);
        OK(lm_model_forward(a, tok, tgt, 1, &la));
        OK(lm_model_backward(a, 1.0f));
        OK(lm_model_download_grads(a));
        OK(lm_grad_clip(pa, np, 1.0f, &na));
        OK(lm_optimizer_step(&host, 3e-3f));
        OK(lm_model_qk_clip(a, 1e-9f, &mxa, &ca));
        OK(lm_model_upload_params(a));
        /* device path */
        lm_model_zero_grads(b);
        OK(lm_model_forward(b, tok, tgt, 1, &lb));
        OK(lm_model_backward(b, 1.0f));
        OK(lm_grad_clip_on(gpu, pb, np, 1.0f, work, &nb));
        OK(lm_device_optimizer_step(dev, 3e-3f));
        OK(lm_model_params_changed_on_backend(b));
        CHECK(lm_model_host_params_stale(b) == 1, "host copy not marked stale");
        OK(lm_model_qk_clip(b, 1e-9f, &mxb, &cb));
        printf("  step %d: loss host path %.7f device %.7f, norm %.7g %.7g, clipped %d %d\n", s, la, lb, na, nb, ca,
               cb);
        /* 1e-4: a last-bit difference of a weight (CPU FMA contraction) can move a
         * bf16 copy or a routing tie; a stale bf16 copy would be off by far more */
        CHECK(fabs(la - lb) <= 1e-4 * fabs(la), "step %d: loss %.7f vs %.7f", s, la, lb);
        CHECK(fabs(na - nb) <= 1e-4 * na, "step %d: norm %.9g vs %.9g", s, na, nb);
        CHECK(ca == cb, "step %d: clipped heads %d vs %d", s, ca, cb);
        clipped += ca;
    }
    CHECK(clipped > 0, "no head was clipped in 3 steps: QK-Clip on the device untested");
    lm_model *c2 = NULL;
    OK(lm_model_create_on(&c, B, T, gpu, &c2));
    if (c2) CHECK(lm_model_copy_state(c2, b) == LM_ERR_ARG, "copy_state accepted a stale host copy");
    OK(lm_model_download_params(b));
    CHECK(lm_model_host_params_stale(b) == 0, "host copy still stale after the download");
    if (c2) OK(lm_model_copy_state(c2, b));
    double e = rel_err(lm_model_params(b), lm_model_params(a), n);
    printf("  parameters after 3 steps: relative difference %.3g\n", e);
    CHECK(e <= TOL_ELEM, "parameters differ by %.3g", e);
    lm_model_free(c2);
    gpu->release(gpu, work);
    lm_device_optimizer_free(dev);
    free(tok);
    free(tgt);
    free(state);
    free(pa);
    free(pb);
    lm_model_free(a);
    lm_model_free(b);
}

int main(void) {
    test_skip_without_cuda();
    if (test_skip_all_reason) fprintf(stderr, "test_cuda_optim: %s: every case skips\n", test_skip_all_reason);
    if (!test_skip_all_reason && lm_backend_cuda_create(&gpu) != LM_OK) {
        fprintf(stderr, "lm_backend_cuda_create: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_adamw_matches_the_cpu_over_steps);
    RUN(test_muon_tf32_matches_the_cpu_per_step);
    RUN(test_muon_fp32_matches_the_cpu_per_step);
    RUN(test_grad_norm_and_clipping_match_float64);
    RUN(test_non_finite_gradient_is_reported_and_left_untouched);
    RUN(test_same_inputs_twice_are_bit_identical);
    RUN(test_state_download_upload_continues_bit_identically);
    RUN(test_qk_clip_on_the_device_equals_the_host);
    RUN(test_model_trained_on_the_device_matches_the_host_path);
    if (gpu) lm_backend_free(gpu);
    return test_summary();
}
