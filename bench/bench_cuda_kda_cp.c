/* What the KDA layer's context parallelism costs a rank after the first
 * (docs/scaleout.md, "KDA context parallelism"), at configs/k3-mini.json's
 * KDA shapes (d 1024, 8 heads of 128, a convolution of width 4, chunk 64) on
 * one segment of B x n tokens, on the CUDA backend, the two forms side by
 * side in one run:
 *   forward, a middle rank:
 *     one-call: lm_kda_layer_forward_seg from zero (the map's Q), the state map
 *               (the operator from the identity), lm_kda_layer_forward_seg from
 *               the incoming state;
 *     two-call: lm_kda_layer_seg_final_state, the state map,
 *               lm_kda_layer_forward_seg_prepared (the operator's inputs and
 *               the output path once);
 *   backward, every rank after the first:
 *     one-call: lm_kda_layer_seg_state_grad (D) then the whole
 *               lm_kda_layer_backward_seg (the output path's backward again);
 *     two-call: lm_kda_layer_seg_state_grad then
 *               lm_kda_layer_backward_seg_after_state.
 * The collectives between them (the maps' all-gather, the scan: O(B H K^2) a
 * rank) are left out. Both forms give the same bits (test_kda_layer,
 * test_cuda_cp); this times them.
 *
 *   bench_cuda_kda_cp [--tokens n] [--batch B] [--reps N] [--out results.json]
 *
 * Median of N repetitions (default 10) after 2 warm-ups, each timed on the
 * host around the calls with the backend's stream synchronised. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/backend.h"
#include "longmoe/core.h"
#include "longmoe/kda_layer.h"
#include "longmoe/tensor_spec.h"

static lm_backend *be;

static void *dev(size_t bytes) {
    void *p = NULL;
    if (be->alloc(be, bytes ? bytes : 4, &p)) dieAt("device buffer of %zu bytes: %s", bytes, lm_last_error());
    return p;
}

static float *dev_random(size_t n, double scale, double shift, lm_rng *r) {
    float *h = mallocCheck(n * 4), *d = dev(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = (float)(shift + scale * lm_rng_normal(r));
    if (be->upload(be, d, h, n * 4)) dieAt("upload: %s", lm_last_error());
    free(h);
    return d;
}

typedef struct {
    lm_kda_layer_config c;
    lm_kda_layer_params p, pl, g;
    lm_kda_layer_acts a;
    void *x;
    float *y, *dy, *dx, *S, *ident, *vzero, *otmp, *P, *Q, *D, *dS, *junk, *scratch, *halo, *dhalo;
    int B, n;
} cp_args;

static void ok(lm_status st) {
    if (st) dieAt("%s", lm_last_error());
}

static void fwd_one_call(cp_args *t) {
    lm_kda_layer_carry z = {NULL, t->Q, t->halo, NULL}, s = {t->S, NULL, t->halo, NULL};
    ok(lm_kda_layer_forward_seg(&t->c, &t->p, &t->pl, &t->a, t->x, t->B, t->n, &z, t->y));
    ok(lm_kda_layer_seg_state_map(&t->c, &t->p, &t->a, t->B, t->n, t->vzero, t->ident, t->otmp, t->P));
    ok(lm_kda_layer_forward_seg(&t->c, &t->p, &t->pl, &t->a, t->x, t->B, t->n, &s, t->y));
}

static void fwd_two_call(cp_args *t) {
    lm_kda_layer_carry z = {NULL, t->Q, t->halo, NULL}, s = {t->S, NULL, t->halo, NULL};
    ok(lm_kda_layer_seg_final_state(&t->c, &t->p, &t->pl, &t->a, t->x, t->B, t->n, &z));
    ok(lm_kda_layer_seg_state_map(&t->c, &t->p, &t->a, t->B, t->n, t->vzero, t->ident, t->otmp, t->P));
    ok(lm_kda_layer_forward_seg_prepared(&t->c, &t->p, &t->pl, &t->a, t->x, t->B, t->n, &s, t->y));
}

static void bwd(cp_args *t, int two_call) {
    lm_kda_layer_carry s = {t->S, NULL, t->halo, NULL};
    lm_kda_layer_carry_grad cg = {t->dS, NULL, NULL, t->dhalo};
    ok(lm_kda_layer_seg_state_grad(&t->c, &t->p, &t->pl, &t->g, &t->a, t->x, t->dy, t->B, t->n, &s, t->dx, t->D,
                                   t->junk, t->scratch));
    if (two_call)
        ok(lm_kda_layer_backward_seg_after_state(&t->c, &t->p, &t->pl, &t->g, &t->a, t->x, t->B, t->n, &s, &cg, t->dx,
                                                 t->scratch));
    else
        ok(lm_kda_layer_backward_seg(&t->c, &t->p, &t->pl, &t->g, &t->a, t->x, t->dy, t->B, t->n, &s, &cg, t->dx,
                                     t->scratch));
}

static void bwd_one_call(cp_args *t) { bwd(t, 0); }
static void bwd_two_call(cp_args *t) { bwd(t, 1); }

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double time_ms(void (*fn)(cp_args *), cp_args *t, int reps) {
    for (int i = 0; i < 2; i++) fn(t);
    ok(be->sync(be));
    double *ms = mallocCheck((size_t)reps * sizeof(double));
    for (int r = 0; r < reps; r++) {
        double t0 = lm_time_seconds();
        fn(t);
        ok(be->sync(be));
        ms[r] = 1e3 * (lm_time_seconds() - t0);
    }
    qsort(ms, (size_t)reps, sizeof(double), cmp_double);
    double med = ms[reps / 2];
    free(ms);
    return med;
}

int main(int argc, char **argv) {
    int n = 32768, B = 1, reps = 10;
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--tokens n] [--batch B] [--reps N] [--out results.json]\n", argv[0]);
            return 2;
        }
    }
    if (n < 1 || B < 1 || reps < 1 || (int64_t)n * B > (1 << 26))
        dieAt("--tokens and --batch must be >= 1 (at most 2^26 tokens together), --reps >= 1");
    if (lm_backend_cuda_create(&be)) {
        fprintf(stderr, "bench_cuda_kda_cp: %s\n", lm_last_error());
        return 1;
    }
    cp_args t;
    memset(&t, 0, sizeof t);
    t.B = B, t.n = n;
    const int d = 1024, H = 8, K = 128, W = 4, HK = H * K;
    t.c = (lm_kda_layer_config){d, H, K, W, 64, LM_KDA_GATE_BOUNDED, -5.0f, 1e-6f, NULL, 0, be};
    lm_tensor_spec specs[LM_KDA_LAYER_NPARAMS];
    const size_t np = lm_kda_layer_specs(&t.c, specs);
    lm_rng rng;
    lm_rng_seed(&rng, 20261205);
    float *hp = mallocCheck(np * 4);
    size_t off = 0;
    for (int s = 0; s < LM_KDA_LAYER_NPARAMS; s++) {
        const size_t m = (size_t)(specs[s].rows * specs[s].cols);
        const double sc = specs[s].role == LM_ROLE_MATRIX ? 1.0 / sqrt((double)specs[s].cols) : 0.3;
        for (size_t i = 0; i < m; i++) hp[off + i] = specs[s].init_value + (float)(sc * lm_rng_normal(&rng));
        off += m;
    }
    float *par = dev(np * 4), *grad = dev(np * 4);
    ok(be->upload(be, par, hp, np * 4));
    ok(be->zero(be, grad, np * 4));
    free(hp);
    void *plp = dev(np * be->lp_bytes);
    ok(be->ops->to_lp(be, plp, par, np));
    lm_kda_layer_params_map(&t.c, par, &t.p);
    lm_kda_layer_params_map(&t.c, grad, &t.g);
    /* the product-format views: the same offsets in the bf16 copy */
    float *const *from = (float *const *)&t.p;
    float **to = (float **)&t.pl;
    for (size_t i = 0; i < sizeof t.p / sizeof(float *); i++)
        to[i] = from[i] ? (float *)((char *)plp + (size_t)(from[i] - par) * be->lp_bytes) : NULL;
    const size_t N = (size_t)B * n, ns = (size_t)B * H * K * K, nh = (size_t)3 * B * (W - 1) * HK;
    float *xf = dev_random(N * d, 1.0, 0.0, &rng);
    t.x = dev(N * d * be->lp_bytes);
    ok(be->ops->to_lp(be, t.x, xf, N * d));
    be->release(be, xf);
    t.y = dev(N * d * 4);
    t.dx = dev(N * d * 4);
    ok(be->zero(be, t.dx, N * d * 4));
    t.dy = dev_random(N * d, 1.0, 0.0, &rng);
    t.S = dev_random(ns, 0.3, 0.0, &rng);
    t.dS = dev_random(ns, 1.0, 0.0, &rng);
    t.halo = dev_random(nh, 1.0, 0.0, &rng);
    t.dhalo = dev(nh * 4);
    t.Q = dev(ns * 4), t.P = dev(ns * 4), t.D = dev(ns * 4);
    float *id = calloc(ns, sizeof(float));
    if (!id) dieAt("out of memory");
    for (size_t q = 0; q < (size_t)B * H; q++)
        for (int i = 0; i < K; i++) id[(q * K + i) * K + i] = 1.0f;
    t.ident = dev(ns * 4);
    ok(be->upload(be, t.ident, id, ns * 4));
    free(id);
    t.vzero = dev(N * HK * be->lp_bytes);
    ok(be->zero(be, t.vzero, N * HK * be->lp_bytes));
    t.otmp = dev(N * HK * be->lp_bytes);
    t.junk = dev(lm_kda_layer_seg_state_grad_junk_floats(&t.c) * 4);
    t.scratch = dev(lm_kda_layer_seg_scratch_floats(&t.c, B, n) * 4);
    float *acts = dev(lm_kda_layer_seg_act_floats(&t.c, B, n) * 4);
    lm_kda_layer_seg_acts_map(&t.c, B, n, acts, &t.a);

    const double f1 = time_ms(fwd_one_call, &t, reps), f2 = time_ms(fwd_two_call, &t, reps);
    fwd_two_call(&t); /* the activations the backward reads */
    const double b1 = time_ms(bwd_one_call, &t, reps), b2 = time_ms(bwd_two_call, &t, reps);
    printf("KDA layer under context parallelism, B %d x %d tokens a rank, d %d, %d heads of %d (median of %d):\n", B,
           n, d, H, K, reps);
    printf("  forward, a middle rank:          one-call %8.3f ms   two-call %8.3f ms   (%.2fx)\n", f1, f2, f1 / f2);
    printf("  backward, a rank after the first: one-call %8.3f ms   two-call %8.3f ms   (%.2fx)\n", b1, b2, b1 / b2);
    int rc = 0;
    if (out) {
        FILE *f = fopen(out, "w");
        if (!f) {
            fprintf(stderr, "bench_cuda_kda_cp: cannot write %s\n", out);
            rc = 1;
        } else {
            fprintf(f,
                    "{\"batch\": %d, \"tokens\": %d, \"reps\": %d, \"forward_one_call_ms\": %.4f, "
                    "\"forward_two_call_ms\": %.4f, \"backward_one_call_ms\": %.4f, \"backward_two_call_ms\": %.4f}\n",
                    B, n, reps, f1, f2, b1, b2);
            fclose(f);
        }
    }
    lm_backend_free(be);
    return rc;
}
