/* The dense CUDA operators (include/longmoe/linear_cuda.h) against the CPU.
 *
 * Both sides see identical inputs: what the GPU takes as bf16 is rounded to
 * bf16 first. Matrix products are held against lm_matmul_forward/backward,
 * RMSNorm against lm_rmsnorm_*, the embedding against the CPU loops of
 * lm_model_forward/backward and the cross-entropy against a float64
 * reference written here. Tolerances (relative error ||got - want|| /
 * ||want||, for gradients ||got - want|| / ||want - initial||): 1e-2 for
 * results of bf16 products, 1e-5 for the fp32-only RMSNorm, 1e-4 for the
 * log-sum-exp and the loss (fp32 statistics of logits accumulated in fp32),
 * bit equality for the embedding (the GPU adds in the CPU's order). Every
 * output and gradient is computed twice and compared bit for bit. Gradients
 * start from random non-zero values (the ops accumulate). Needs a CUDA GPU
 * (ctest label cuda). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/linear.h"
#include "longmoe/linear_cuda.h"
#include "test.h"
#include "test_cuda.h"

static lm_cuda_context ctx;
static lm_rng rng;

/* n normal values times `scale`, rounded to bf16 when `bf16` */
static float *host_random(size_t n, float scale, int bf16) { return host_normal(n, scale, 0.0, bf16, &rng); }

static void put_f32(float *d, const float *h, size_t n) {
    if (lm_cuda_upload(d, h, n * sizeof(float))) dieAt("upload: %s", lm_last_error());
}

static float *get_f32(const float *d, size_t n) {
    float *h = mallocCheck((n ? n : 1) * sizeof(float));
    if (lm_cuda_context_sync(&ctx)) dieAt("sync: %s", lm_last_error());
    if (lm_cuda_download(h, d, n * sizeof(float))) dieAt("download: %s", lm_last_error());
    return h;
}

static float *copy_f32(const float *x, size_t n) {
    float *y = mallocCheck((n ? n : 1) * sizeof(float));
    memcpy(y, x, n * sizeof(float));
    return y;
}

/* error of an accumulated gradient, relative to the size of what was added */
static double rel_err_added(const float *got, const float *want, const float *init, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(got[i])) return INFINITY;
        num += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        den += ((double)want[i] - init[i]) * ((double)want[i] - init[i]);
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int same_bits(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

/* ---------------------------------------------------------------- matmul */

static const int matmul_shapes[][3] = {{1, 32, 96}, {37, 96, 32}, {37, 1024, 1024}, {1000, 1024, 96},
                                       {1000, 96, 1024}, {1000, 32, 32}};

static void test_matmul_forward_matches_cpu_and_accumulates(void) {
    for (size_t s = 0; s < sizeof matmul_shapes / sizeof matmul_shapes[0]; s++) {
        int n = matmul_shapes[s][0], ic = matmul_shapes[s][1], oc = matmul_shapes[s][2];
        size_t no = (size_t)n * oc;
        float *x = host_random((size_t)n * ic, 1.0f, 1), *w = host_random((size_t)oc * ic, 0.1f, 1);
        float *init = host_random(no, 1.0f, 0), *want = mallocCheck(no * sizeof(float));
        lm_matmul_forward(want, x, w, NULL, n, ic, oc);
        uint16_t *dx = dev_upload_bf16(x, (size_t)n * ic), *dw = dev_upload_bf16(w, (size_t)oc * ic);
        float *dout = dev_alloc(no * sizeof(float));
        uint16_t *dout16 = dev_alloc(no * sizeof(uint16_t));
        char what[96];
        snprintf(what, sizeof what, "n=%d ic=%d oc=%d", n, ic, oc);

        /* out = x . w^T, twice: same bits */
        put_f32(dout, init, no);
        CHECK(lm_cuda_matmul_forward(&ctx, dout, dx, dw, n, ic, oc, 0) == LM_OK, "%s", lm_last_error());
        float *got1 = get_f32(dout, no);
        CHECK(lm_cuda_matmul_forward(&ctx, dout, dx, dw, n, ic, oc, 0) == LM_OK, "%s", lm_last_error());
        float *got2 = get_f32(dout, no);
        double e = rel_err(got1, want, no);
        CHECK(e <= 1e-2, "%s: forward rel error %.3g", what, e);
        CHECK(same_bits(got1, got2, no * sizeof(float)), "%s: forward differs between runs", what);

        /* accumulate: out = init + x . w^T */
        float *want_acc = mallocCheck(no * sizeof(float));
        for (size_t i = 0; i < no; i++) want_acc[i] = init[i] + want[i];
        put_f32(dout, init, no);
        CHECK(lm_cuda_matmul_forward(&ctx, dout, dx, dw, n, ic, oc, 1) == LM_OK, "%s", lm_last_error());
        float *got_acc = get_f32(dout, no);
        e = rel_err_added(got_acc, want_acc, init, no);
        CHECK(e <= 1e-2, "%s: accumulating forward rel error %.3g", what, e);

        /* bf16 output: the fp32 product rounded once */
        CHECK(lm_cuda_matmul_forward_bf16(&ctx, dout16, dx, dw, n, ic, oc) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "%s", lm_last_error());
        float *got16 = mallocCheck(no * sizeof(float)), *got16b = mallocCheck(no * sizeof(float));
        CHECK(lm_cuda_download_bf16(got16, dout16, no) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_matmul_forward_bf16(&ctx, dout16, dx, dw, n, ic, oc) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_download_bf16(got16b, dout16, no) == LM_OK, "%s", lm_last_error());
        e = rel_err(got16, want, no);
        CHECK(e <= 1e-2, "%s: bf16 forward rel error %.3g", what, e);
        CHECK(same_bits(got16, got16b, no * sizeof(float)), "%s: bf16 forward differs between runs", what);

        free(x), free(w), free(init), free(want), free(got1), free(got2), free(want_acc), free(got_acc);
        free(got16), free(got16b);
        lm_cuda_free(dx), lm_cuda_free(dw), lm_cuda_free(dout), lm_cuda_free(dout16);
    }
}

static void test_matmul_backward_matches_cpu_and_accumulates(void) {
    for (size_t s = 0; s < sizeof matmul_shapes / sizeof matmul_shapes[0]; s++) {
        int n = matmul_shapes[s][0], ic = matmul_shapes[s][1], oc = matmul_shapes[s][2];
        size_t ni = (size_t)n * ic, nw = (size_t)oc * ic, no = (size_t)n * oc;
        float *x = host_random(ni, 1.0f, 1), *w = host_random(nw, 0.1f, 1), *g = host_random(no, 1.0f, 1);
        float *dx0 = host_random(ni, 1.0f, 0), *dw0 = host_random(nw, 1.0f, 0);
        float *want_dx = copy_f32(dx0, ni), *want_dw = copy_f32(dw0, nw);
        lm_matmul_backward(want_dx, want_dw, NULL, g, x, w, n, ic, oc);
        uint16_t *d_x = dev_upload_bf16(x, ni), *d_w = dev_upload_bf16(w, nw), *d_g = dev_upload_bf16(g, no);
        float *d_dx = dev_upload_f32(dx0, ni), *d_dw = dev_upload_f32(dw0, nw);
        char what[96];
        snprintf(what, sizeof what, "n=%d ic=%d oc=%d", n, ic, oc);

        CHECK(lm_cuda_matmul_backward(&ctx, d_dx, d_dw, d_g, d_x, d_w, n, ic, oc) == LM_OK, "%s", lm_last_error());
        float *dx1 = get_f32(d_dx, ni), *dw1 = get_f32(d_dw, nw);
        double e = rel_err_added(dx1, want_dx, dx0, ni);
        CHECK(e <= 1e-2, "%s: dinp rel error %.3g", what, e);
        e = rel_err_added(dw1, want_dw, dw0, nw);
        CHECK(e <= 1e-2, "%s: dweight rel error %.3g", what, e);

        /* again from the same start: the same bits */
        put_f32(d_dx, dx0, ni);
        put_f32(d_dw, dw0, nw);
        CHECK(lm_cuda_matmul_backward(&ctx, d_dx, d_dw, d_g, d_x, d_w, n, ic, oc) == LM_OK, "%s", lm_last_error());
        float *dx2 = get_f32(d_dx, ni), *dw2 = get_f32(d_dw, nw);
        CHECK(same_bits(dx1, dx2, ni * 4) && same_bits(dw1, dw2, nw * 4), "%s: backward differs between runs",
              what);

        /* one gradient at a time: the other pointer NULL, the same bits */
        put_f32(d_dw, dw0, nw);
        CHECK(lm_cuda_matmul_backward(&ctx, NULL, d_dw, d_g, d_x, d_w, n, ic, oc) == LM_OK, "%s", lm_last_error());
        float *dw3 = get_f32(d_dw, nw);
        CHECK(same_bits(dw1, dw3, nw * 4), "%s: dweight alone differs", what);
        put_f32(d_dx, dx0, ni);
        CHECK(lm_cuda_matmul_backward(&ctx, d_dx, NULL, d_g, d_x, d_w, n, ic, oc) == LM_OK, "%s", lm_last_error());
        float *dx3 = get_f32(d_dx, ni);
        CHECK(same_bits(dx1, dx3, ni * 4), "%s: dinp alone differs", what);

        /* _set: dinp written over NaN (beta 0: not read), the increment of the accumulating call;
         * dweight its bits */
        {
            float *nan_fill = mallocCheck(ni * 4), *zero = calloc(ni, 4), *want_set = calloc(ni, 4);
            for (size_t i = 0; i < ni; i++) nan_fill[i] = NAN;
            lm_matmul_backward(want_set, NULL, NULL, g, x, w, n, ic, oc);
            put_f32(d_dx, nan_fill, ni);
            put_f32(d_dw, dw0, nw);
            CHECK(lm_cuda_matmul_backward_set(&ctx, d_dx, d_dw, d_g, d_x, d_w, n, ic, oc) == LM_OK, "%s",
                  lm_last_error());
            float *dx4 = get_f32(d_dx, ni), *dw4 = get_f32(d_dw, nw);
            e = rel_err_added(dx4, want_set, zero, ni);
            CHECK(e <= 1e-2, "%s: _set dinp rel error %.3g", what, e);
            CHECK(same_bits(dw1, dw4, nw * 4), "%s: _set dweight differs", what);
            free(nan_fill), free(zero), free(want_set), free(dx4), free(dw4);
        }
        free(x), free(w), free(g), free(dx0), free(dw0), free(want_dx), free(want_dw);
        free(dx1), free(dw1), free(dx2), free(dw2), free(dw3), free(dx3);
        lm_cuda_free(d_x), lm_cuda_free(d_w), lm_cuda_free(d_g), lm_cuda_free(d_dx), lm_cuda_free(d_dw);
    }
}

/* ----------------------------------------------------- conversions, checks */

static void test_bf16_conversions_round_like_the_host(void) {
    size_t n = 4099;
    float *x = host_random(n, 3.0f, 0);
    uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0x3f808000u,
                           0x3f818000u, 0x00000001u, 0x80000000u, 0x7f7fffffu};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) memcpy(&x[i * 7], &specials[i], 4);
    float *dx = dev_upload_f32(x, n), *back = dev_alloc(n * sizeof(float));
    uint16_t *d16 = dev_alloc(n * sizeof(uint16_t)), *h16 = mallocCheck(n * sizeof(uint16_t));
    CHECK(lm_cuda_f32_to_bf16(&ctx, d16, dx, n) == LM_OK, "%s", lm_last_error());
    CHECK(lm_cuda_bf16_to_f32(&ctx, back, d16, n) == LM_OK, "%s", lm_last_error());
    CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "%s", lm_last_error());
    CHECK(lm_cuda_download(h16, d16, n * sizeof(uint16_t)) == LM_OK, "%s", lm_last_error());
    float *hb = get_f32(back, n);
    int bad16 = 0, bad32 = 0;
    for (size_t i = 0; i < n; i++) {
        bad16 += h16[i] != lm_f32_to_bf16(x[i]);
        float want = lm_bf16_to_f32(h16[i]);
        bad32 += memcmp(&hb[i], &want, 4) != 0;
    }
    CHECK(bad16 == 0, "%d of %zu bf16 roundings differ from lm_f32_to_bf16", bad16, n);
    CHECK(bad32 == 0, "%d of %zu bf16 -> fp32 conversions are not exact", bad32, n);
    /* unaligned (the element-wise kernel) and aligned (8 a thread, then a tail) starts */
    for (size_t off = 1; off <= 8; off += 7) {
        memset(h16, 0xff, n * sizeof(uint16_t));
        CHECK(lm_cuda_upload(d16, h16, n * sizeof(uint16_t)) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_f32_to_bf16(&ctx, d16 + off, dx + off, n - off) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_download(h16, d16, n * sizeof(uint16_t)) == LM_OK, "%s", lm_last_error());
        bad16 = 0;
        for (size_t i = 0; i < n; i++) bad16 += h16[i] != (i < off ? 0xffff : lm_f32_to_bf16(x[i]));
        CHECK(bad16 == 0, "from element %zu: %d of %zu bf16 roundings wrong", off, bad16, n);
    }
    free(x), free(h16), free(hb);
    lm_cuda_free(dx), lm_cuda_free(back), lm_cuda_free(d16);
}

static int finite_flag(const float *dx, size_t n) {
    int *flag = dev_alloc(sizeof(int)), h = -1;
    if (lm_cuda_all_finite(&ctx, dx, n, flag)) dieAt("all_finite: %s", lm_last_error());
    if (lm_cuda_context_sync(&ctx) || lm_cuda_download(&h, flag, sizeof h)) dieAt("%s", lm_last_error());
    lm_cuda_free(flag);
    return h;
}

static void test_all_finite_flags_every_nan_and_inf(void) {
    size_t n = 100003;
    float *x = host_random(n, 1e30f, 0);
    float *dx = dev_upload_f32(x, n);
    CHECK(finite_flag(dx, n) == 1, "finite values flagged");
    CHECK(finite_flag(dx, 0) == 1, "an empty array flagged");
    float bad[] = {INFINITY, -INFINITY, NAN};
    size_t where[] = {0, n / 2, n - 1};
    for (int b = 0; b < 3; b++)
        for (int w = 0; w < 3; w++) {
            put_f32(dx, x, n);
            put_f32(dx + where[w], &bad[b], 1);
            CHECK(finite_flag(dx, n) == 0, "%g at %zu not flagged", (double)bad[b], where[w]);
            /* an unaligned start (the element-wise kernel) */
            CHECK(finite_flag(dx + 1, n - 1) == (where[w] == 0), "%g at %zu, from element 1", (double)bad[b],
                  where[w]);
        }
    free(x);
    lm_cuda_free(dx);
}

/* --------------------------------------------------------------- rmsnorm */

/* d % 4 == 0 (float4 path) and not (scalar path), odd n (row pairs with a
 * tail), items per thread 1..8, d past the register path (2051 scalar, 8200
 * float4: the warp-per-row fallback), many dweight partials (40001 rows) */
static const int rms_shapes[][2] = {{1, 32},   {37, 64},    {1000, 1024}, {37, 1000}, {300, 128}, {5, 3},
                                    {2049, 96}, {65, 1001}, {129, 2048},  {33, 4100}, {7, 2051},  {3, 8200},
                                    {40001, 8}, {17, 8192}};

static void test_rmsnorm_forward_matches_cpu(void) {
    const float eps = 1e-6f;
    for (size_t s = 0; s < sizeof rms_shapes / sizeof rms_shapes[0]; s++)
        for (int with_weight = 0; with_weight < 2; with_weight++) {
            int n = rms_shapes[s][0], d = rms_shapes[s][1];
            size_t nx = (size_t)n * d;
            float *x = host_random(nx, 2.0f, 0), *w = host_random((size_t)d, 1.0f, 0);
            float *want = mallocCheck(nx * 4), *want_r = mallocCheck((size_t)n * 4);
            lm_rmsnorm_forward(want, want_r, x, with_weight ? w : NULL, n, d, eps);
            float *dx = dev_upload_f32(x, nx), *dw = dev_upload_f32(w, (size_t)d), *dy = dev_alloc(nx * 4);
            float *dr = dev_alloc((size_t)n * 4);
            uint16_t *dy16 = dev_alloc(nx * 2);
            char what[64];
            snprintf(what, sizeof what, "n=%d d=%d weight=%d", n, d, with_weight);
            float *got[2], *got_r[2];
            for (int run = 0; run < 2; run++) {
                CHECK(lm_cuda_rmsnorm_forward(&ctx, dy, dy16, dr, dx, with_weight ? dw : NULL, n, d, eps) == LM_OK,
                      "%s", lm_last_error());
                got[run] = get_f32(dy, nx);
                got_r[run] = get_f32(dr, (size_t)n);
            }
            double e = rel_err(got[0], want, nx), er = rel_err(got_r[0], want_r, (size_t)n);
            CHECK(e <= 1e-5, "%s: out rel error %.3g", what, e);
            CHECK(er <= 1e-5, "%s: rstd rel error %.3g", what, er);
            CHECK(same_bits(got[0], got[1], nx * 4) && same_bits(got_r[0], got_r[1], (size_t)n * 4),
                  "%s: differs between runs", what);
            uint16_t *h16 = mallocCheck(nx * 2);
            CHECK(lm_cuda_download(h16, dy16, nx * 2) == LM_OK, "%s", lm_last_error());
            int bad = 0;
            for (size_t i = 0; i < nx; i++) bad += h16[i] != lm_f32_to_bf16(got[0][i]);
            CHECK(bad == 0, "%s: %d bf16 outputs are not the fp32 output rounded", what, bad);
            free(x), free(w), free(want), free(want_r), free(got[0]), free(got[1]), free(got_r[0]);
            free(got_r[1]), free(h16);
            lm_cuda_free(dx), lm_cuda_free(dw), lm_cuda_free(dy), lm_cuda_free(dr), lm_cuda_free(dy16);
        }
}

static void test_rmsnorm_backward_matches_cpu_and_accumulates(void) {
    const float eps = 1e-6f;
    for (size_t s = 0; s < sizeof rms_shapes / sizeof rms_shapes[0]; s++)
        for (int variant = 0; variant < 3; variant++) {
            /* 0: weight and saved rstd; 1: weight, rstd recomputed; 2: no weight, no dweight */
            int n = rms_shapes[s][0], d = rms_shapes[s][1];
            size_t nx = (size_t)n * d;
            float *x = host_random(nx, 2.0f, 0), *w = host_random((size_t)d, 1.0f, 0);
            float *g = host_random(nx, 1.0f, 0), *dx0 = host_random(nx, 1.0f, 0);
            float *dw0 = host_random((size_t)d, 1.0f, 0), *r = mallocCheck((size_t)n * 4);
            float *tmp = mallocCheck(nx * 4);
            const float *wp = variant == 2 ? NULL : w;
            lm_rmsnorm_forward(tmp, r, x, wp, n, d, eps);
            float *want_dx = copy_f32(dx0, nx), *want_dw = copy_f32(dw0, (size_t)d);
            lm_rmsnorm_backward(want_dx, variant == 2 ? NULL : want_dw, g, x, wp, variant == 1 ? NULL : r, n, d,
                                eps);
            float *d_x = dev_upload_f32(x, nx), *d_w = dev_upload_f32(w, (size_t)d), *d_g = dev_upload_f32(g, nx);
            float *d_r = dev_upload_f32(r, (size_t)n), *d_dx = dev_alloc(nx * 4), *d_dw = dev_alloc((size_t)d * 4);
            float *scratch = dev_alloc(lm_cuda_rmsnorm_scratch_floats(n, d) * 4);
            char what[80];
            snprintf(what, sizeof what, "n=%d d=%d variant=%d", n, d, variant);
            float *got_dx[2], *got_dw[2];
            for (int run = 0; run < 2; run++) {
                put_f32(d_dx, dx0, nx);
                put_f32(d_dw, dw0, (size_t)d);
                CHECK(lm_cuda_rmsnorm_backward(&ctx, d_dx, variant == 2 ? NULL : d_dw, d_g, d_x,
                                               variant == 2 ? NULL : d_w, variant == 1 ? NULL : d_r, n, d, eps,
                                               scratch) == LM_OK,
                      "%s", lm_last_error());
                got_dx[run] = get_f32(d_dx, nx);
                got_dw[run] = get_f32(d_dw, (size_t)d);
            }
            double e = rel_err_added(got_dx[0], want_dx, dx0, nx);
            CHECK(e <= 1e-5, "%s: dinp rel error %.3g", what, e);
            if (variant != 2) {
                e = rel_err_added(got_dw[0], want_dw, dw0, (size_t)d);
                CHECK(e <= 1e-5, "%s: dweight rel error %.3g", what, e);
            } else {
                CHECK(same_bits(got_dw[0], dw0, (size_t)d * 4), "%s: dweight written though NULL", what);
            }
            CHECK(same_bits(got_dx[0], got_dx[1], nx * 4) && same_bits(got_dw[0], got_dw[1], (size_t)d * 4),
                  "%s: differs between runs", what);
            {
                /* the _set form writes dinp: NaN there beforehand must not show; dweight still adds */
                float *zero = calloc(nx, 4), *want_set = calloc(nx, 4), *nan_fill = mallocCheck(nx * 4);
                for (size_t i = 0; i < nx; i++) nan_fill[i] = NAN;
                lm_rmsnorm_backward(want_set, NULL, g, x, wp, variant == 1 ? NULL : r, n, d, eps);
                put_f32(d_dx, nan_fill, nx);
                put_f32(d_dw, dw0, (size_t)d);
                CHECK(lm_cuda_rmsnorm_backward_set(&ctx, d_dx, variant == 2 ? NULL : d_dw, d_g, d_x,
                                                   variant == 2 ? NULL : d_w, variant == 1 ? NULL : d_r, n, d, eps,
                                                   scratch) == LM_OK,
                      "%s", lm_last_error());
                float *got_set = get_f32(d_dx, nx), *got_set_dw = get_f32(d_dw, (size_t)d);
                e = rel_err_added(got_set, want_set, zero, nx);
                CHECK(e <= 1e-5, "%s: _set dinp rel error %.3g", what, e);
                CHECK(same_bits(got_set_dw, got_dw[0], (size_t)d * 4), "%s: _set dweight differs", what);
                free(zero), free(want_set), free(nan_fill), free(got_set), free(got_set_dw);
            }
            free(x), free(w), free(g), free(dx0), free(dw0), free(r), free(tmp), free(want_dx), free(want_dw);
            free(got_dx[0]), free(got_dx[1]), free(got_dw[0]), free(got_dw[1]);
            lm_cuda_free(d_x), lm_cuda_free(d_w), lm_cuda_free(d_g), lm_cuda_free(d_r), lm_cuda_free(d_dx);
            lm_cuda_free(d_dw), lm_cuda_free(scratch);
        }
}

/* ------------------------------------------------------------- embedding */

static int32_t *random_tokens(int64_t n, int vocab, int skewed) {
    int32_t *t = mallocCheck((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) {
        /* skewed: every other position the same token (a run across sort tiles) */
        t[i] = skewed && (i % 2 == 0) ? vocab / 3 : (int32_t)(lm_rng_u64(&rng) % (uint64_t)vocab);
    }
    return t;
}

/* d % 4 == 0 (float4) and odd d (scalar); d past one register step of
 * columns (1028 float4, 301 scalar); odd n; a vocabulary of one token */
static const int emb_shapes[][3] = {{1, 32, 256},    {37, 64, 1000},  {1000, 1000, 256}, {1000, 64, 1000},
                                    {5000, 32, 1000}, {3000, 96, 32768}, {777, 33, 500},   {301, 1028, 300},
                                    {101, 301, 50},   {9, 7, 1}};

static void test_embedding_forward_gathers_rows(void) {
    for (size_t s = 0; s < sizeof emb_shapes / sizeof emb_shapes[0]; s++) {
        int n = emb_shapes[s][0], d = emb_shapes[s][1], V = emb_shapes[s][2];
        float *table = host_random((size_t)V * d, 1.0f, 0);
        int32_t *tok = random_tokens(n, V, 0);
        float *want = mallocCheck((size_t)n * d * 4);
        for (int i = 0; i < n; i++) memcpy(want + (size_t)i * d, table + (size_t)tok[i] * d, (size_t)d * 4);
        float *d_t = dev_upload_f32(table, (size_t)V * d), *d_o = dev_alloc((size_t)n * d * 4);
        int32_t *d_tok = dev_alloc((size_t)n * 4);
        CHECK(lm_cuda_upload(d_tok, tok, (size_t)n * 4) == LM_OK, "%s", lm_last_error());
        CHECK(lm_cuda_embedding_forward(&ctx, d_o, d_t, d_tok, n, d) == LM_OK, "%s", lm_last_error());
        float *got = get_f32(d_o, (size_t)n * d);
        CHECK(same_bits(got, want, (size_t)n * d * 4), "n=%d d=%d: rows not copied exactly", n, d);
        free(table), free(tok), free(want), free(got);
        lm_cuda_free(d_t), lm_cuda_free(d_o), lm_cuda_free(d_tok);
    }
}

static void test_embedding_backward_adds_in_position_order_like_the_cpu(void) {
    for (size_t s = 0; s < sizeof emb_shapes / sizeof emb_shapes[0]; s++)
        for (int skewed = 0; skewed < 2; skewed++) {
            int n = emb_shapes[s][0], d = emb_shapes[s][1], V = emb_shapes[s][2];
            size_t nt = (size_t)V * d;
            float *t0 = host_random(nt, 1.0f, 0), *g = host_random((size_t)n * d, 1.0f, 0);
            int32_t *tok = random_tokens(n, V, skewed);
            /* the CPU loop of lm_model_backward */
            float *want = copy_f32(t0, nt);
            for (int i = 0; i < n; i++)
                for (int j = 0; j < d; j++) want[(size_t)tok[i] * d + j] += g[(size_t)i * d + j];
            float *d_t = dev_upload_f32(t0, nt), *d_g = dev_upload_f32(g, (size_t)n * d);
            int32_t *d_tok = dev_alloc((size_t)n * 4);
            void *scratch = dev_alloc(lm_cuda_embedding_scratch_bytes(n, V));
            CHECK(lm_cuda_upload(d_tok, tok, (size_t)n * 4) == LM_OK, "%s", lm_last_error());
            /* runs 0 and 1: the default (gather) kernel; run 2: LONGMOE_EMBEDDING_BACKWARD=chain */
            float *got[3];
            for (int run = 0; run < 3; run++) {
                if (run == 2) setenv("LONGMOE_EMBEDDING_BACKWARD", "chain", 1);
                put_f32(d_t, t0, nt);
                CHECK(lm_cuda_embedding_backward(&ctx, d_t, d_g, d_tok, n, d, V, scratch) == LM_OK, "%s",
                      lm_last_error());
                got[run] = get_f32(d_t, nt);
                unsetenv("LONGMOE_EMBEDDING_BACKWARD");
            }
            size_t bad = 0;
            for (size_t i = 0; i < nt; i++) bad += memcmp(&got[0][i], &want[i], 4) != 0;
            CHECK(bad == 0, "n=%d d=%d V=%d skewed=%d: %zu values differ from the CPU loop (e.g. rel %.3g)", n, d,
                  V, skewed, bad, rel_err_added(got[0], want, t0, nt));
            CHECK(same_bits(got[0], got[1], nt * 4), "n=%d d=%d V=%d: differs between runs", n, d, V);
            CHECK(same_bits(got[0], got[2], nt * 4), "n=%d d=%d V=%d skewed=%d: the chain kernel differs", n, d, V,
                  skewed);
            free(t0), free(g), free(tok), free(want), free(got[0]), free(got[1]), free(got[2]);
            lm_cuda_free(d_t), lm_cuda_free(d_g), lm_cuda_free(d_tok), lm_cuda_free(scratch);
        }
}

/* --------------------------------------------------------- cross-entropy */

typedef struct {
    int n, d, V, rows_per_chunk, with_row_scale;
} ce_shape;

static const ce_shape ce_shapes[] = {{1, 32, 1000, 1, 0},      {37, 64, 256, 7, 1},     {1000, 96, 1000, 1000, 0},
                                     {1000, 96, 1000, 300, 1}, {37, 1024, 256, 16, 0}, {200, 32, 1000, 64, 1},
                                     /* a row in 128 KB of shared memory (the fused pass above 48 KB), and one
                                      * above a block's shared memory (the separate kernels run) */
                                     {37, 64, 32768, 16, 0},   {9, 32, 65536, 4, 0}};

static void test_cross_entropy_matches_float64_reference(void) {
    for (size_t s = 0; s < sizeof ce_shapes / sizeof ce_shapes[0]; s++) {
        ce_shape c = ce_shapes[s];
        int n = c.n, d = c.d, V = c.V;
        size_t nh = (size_t)n * d, nw = (size_t)V * d;
        float *hn = host_random(nh, 1.0f, 1), *head = host_random(nw, 2.0f / sqrtf((float)d), 1);
        int32_t *tg = random_tokens(n, V, 0);
        float *rs = host_random((size_t)n, 1.0f, 0), *dh0 = host_random(nh, 0.01f, 0);
        float *dw0 = host_random(nw, 0.01f, 0);
        const float scale = 1.0f / (float)n;
        /* float64 reference: logits, lse, loss, dlogits, the two products */
        double *z = mallocCheck((size_t)V * 8), loss = 0;
        double *want_lse = mallocCheck((size_t)n * 8), *want_dh = mallocCheck(nh * 8), *want_dw = mallocCheck(nw * 8);
        for (size_t i = 0; i < nh; i++) want_dh[i] = dh0[i];
        for (size_t i = 0; i < nw; i++) want_dw[i] = dw0[i];
        for (int r = 0; r < n; r++) {
            double mx = -INFINITY, se = 0;
            for (int v = 0; v < V; v++) {
                double a = 0;
                for (int k = 0; k < d; k++) a += (double)hn[(size_t)r * d + k] * head[(size_t)v * d + k];
                z[v] = a;
                mx = a > mx ? a : mx;
            }
            for (int v = 0; v < V; v++) se += exp(z[v] - mx);
            double lse = mx + log(se);
            want_lse[r] = lse;
            loss += lse - z[tg[r]];
            double sr = scale * (c.with_row_scale ? rs[r] : 1.0);
            for (int v = 0; v < V; v++) {
                double gz = (exp(z[v] - lse) - (v == tg[r])) * sr;
                for (int k = 0; k < d; k++) {
                    want_dh[(size_t)r * d + k] += gz * head[(size_t)v * d + k];
                    want_dw[(size_t)v * d + k] += gz * hn[(size_t)r * d + k];
                }
            }
        }
        uint16_t *d_hn = dev_upload_bf16(hn, nh), *d_head = dev_upload_bf16(head, nw);
        int32_t *d_tg = dev_alloc((size_t)n * 4);
        CHECK(lm_cuda_upload(d_tg, tg, (size_t)n * 4) == LM_OK, "%s", lm_last_error());
        float *d_rs = dev_upload_f32(rs, (size_t)n), *d_lse = dev_alloc((size_t)n * 4), *d_loss = dev_alloc(4);
        float *d_dh = dev_alloc(nh * 4), *d_dw = dev_alloc(nw * 4);
        size_t wsb = lm_cuda_cross_entropy_workspace_bytes(n, d, V, c.rows_per_chunk);
        void *ws = dev_alloc(wsb);
        char what[96];
        snprintf(what, sizeof what, "n=%d d=%d V=%d rows=%d row_scale=%d", n, d, V, c.rows_per_chunk,
                 c.with_row_scale);
        float *lse[2], loss_got[2], *dh[2], *dw[2];
        for (int run = 0; run < 2; run++) {
            put_f32(d_dh, dh0, nh);
            put_f32(d_dw, dw0, nw);
            CHECK(lm_cuda_cross_entropy_forward(&ctx, d_lse, d_loss, d_hn, d_head, d_tg, n, d, V, ws, wsb) == LM_OK,
                  "%s", lm_last_error());
            CHECK(lm_cuda_cross_entropy_backward(&ctx, d_dh, d_dw, d_hn, d_head, d_tg, d_lse,
                                                 c.with_row_scale ? d_rs : NULL, scale, n, d, V, ws, wsb) == LM_OK,
                  "%s", lm_last_error());
            lse[run] = get_f32(d_lse, (size_t)n);
            float *l = get_f32(d_loss, 1);
            loss_got[run] = *l;
            free(l);
            dh[run] = get_f32(d_dh, nh);
            dw[run] = get_f32(d_dw, nw);
        }
        double e = test_rel_error_f(lse[0], want_lse, (size_t)n);
        CHECK(e <= 1e-4, "%s: lse rel error %.3g", what, e);
        CHECK_CLOSE(loss_got[0], loss, 0.0, 1e-4, "loss sum");
        double num = 0, den = 0;
        for (size_t i = 0; i < nh; i++) {
            num += (dh[0][i] - want_dh[i]) * (dh[0][i] - want_dh[i]);
            den += (want_dh[i] - dh0[i]) * (want_dh[i] - dh0[i]);
        }
        CHECK(sqrt(num / den) <= 1e-2, "%s: dhn rel error %.3g", what, sqrt(num / den));
        num = den = 0;
        for (size_t i = 0; i < nw; i++) {
            num += (dw[0][i] - want_dw[i]) * (dw[0][i] - want_dw[i]);
            den += (want_dw[i] - dw0[i]) * (want_dw[i] - dw0[i]);
        }
        CHECK(sqrt(num / den) <= 1e-2, "%s: dhead rel error %.3g", what, sqrt(num / den));
        CHECK(same_bits(lse[0], lse[1], (size_t)n * 4) && same_bits(&loss_got[0], &loss_got[1], 4) &&
                  same_bits(dh[0], dh[1], nh * 4) && same_bits(dw[0], dw[1], nw * 4),
              "%s: differs between runs", what);
        if (!c.with_row_scale) {
            /* forward and backward in one pass over the chunks: the two calls' bits */
            put_f32(d_dh, dh0, nh);
            put_f32(d_dw, dw0, nw);
            CHECK(lm_cuda_upload(d_lse, dh0, (size_t)n * 4) == LM_OK, "%s", lm_last_error()); /* not zeros */
            CHECK(lm_cuda_cross_entropy_forward_backward(&ctx, d_lse, d_loss, d_dh, d_dw, d_hn, d_head, d_tg, scale, n,
                                                         d, V, ws, wsb) == LM_OK,
                  "%s", lm_last_error());
            float *f_lse = get_f32(d_lse, (size_t)n), *f_loss = get_f32(d_loss, 1), *f_dh = get_f32(d_dh, nh),
                  *f_dw = get_f32(d_dw, nw);
            CHECK(same_bits(f_lse, lse[0], (size_t)n * 4) && same_bits(f_loss, &loss_got[0], 4),
                  "%s: the fused pass's lse or loss differ from the forward's", what);
            CHECK(same_bits(f_dh, dh[0], nh * 4) && same_bits(f_dw, dw[0], nw * 4),
                  "%s: the fused pass's dhn or dhead differ from the backward's", what);
            free(f_lse), free(f_loss), free(f_dh), free(f_dw);
        }
        free(hn), free(head), free(tg), free(rs), free(dh0), free(dw0), free(z), free(want_lse), free(want_dh);
        free(want_dw);
        for (int run = 0; run < 2; run++) free(lse[run]), free(dh[run]), free(dw[run]);
        lm_cuda_free(d_hn), lm_cuda_free(d_head), lm_cuda_free(d_tg), lm_cuda_free(d_rs), lm_cuda_free(d_lse);
        lm_cuda_free(d_loss), lm_cuda_free(d_dh), lm_cuda_free(d_dw), lm_cuda_free(ws);
    }
}

/* ------------------------------------------------------------ the products' profile */

/* While on, each product is noted by shape (cuBLAS's m n k: the forward's oc, n, ic) with its
 * calls; off, nothing is noted; print empties the records. */
static void test_matmul_profile_counts_products_by_shape(void) {
    const int n = 96, ic = 64, oc = 48;
    float *x = host_random((size_t)n * ic, 1.0f, 0), *w = host_random((size_t)oc * ic, 1.0f, 0);
    uint16_t *dx = dev_upload_bf16(x, (size_t)n * ic), *dw = dev_upload_bf16(w, (size_t)oc * ic);
    float *dy = dev_alloc((size_t)n * oc * 4);
    CHECK(lm_cuda_matmul_forward(&ctx, dy, dx, dw, n, ic, oc, 0) == LM_OK, "%s", lm_last_error()); /* off */
    lm_cuda_matmul_profile(1);
    for (int i = 0; i < 3; i++)
        CHECK(lm_cuda_matmul_forward(&ctx, dy, dx, dw, n, ic, oc, i > 0) == LM_OK, "%s", lm_last_error());
    lm_cuda_matmul_profile(0);
    CHECK(lm_cuda_matmul_forward(&ctx, dy, dx, dw, n, ic, oc, 1) == LM_OK, "%s", lm_last_error()); /* off */
    for (int round = 0; round < 2; round++) {
        FILE *f = tmpfile();
        CHECK(f != NULL, "tmpfile");
        if (!f) break;
        CHECK(lm_cuda_matmul_profile_print(f, 1) == LM_OK, "print: %s", lm_last_error());
        rewind(f);
        char line[512];
        int rows = 0, set = 0, acc = 0;
        while (fgets(line, sizeof line, f)) {
            char kind[16], op[8], d[8];
            unsigned long long m, nn, k;
            double beta, calls;
            if (sscanf(line, " %15s %llu %llu %llu %7s %lf %7s %lf", kind, &m, &nn, &k, op, &beta, d, &calls) != 8)
                continue;
            rows++;
            CHECK(!strcmp(kind, "lt") && m == (unsigned long long)oc && nn == (unsigned long long)n &&
                      k == (unsigned long long)ic && !strcmp(op, "TN") && !strcmp(d, "fp32"),
                  "round %d: unexpected row: %s", round, line);
            if (beta == 0) set += (int)calls;
            if (beta == 1) acc += (int)calls;
        }
        fclose(f);
        if (round == 0) CHECK(rows == 2 && set == 1 && acc == 2, "%d rows, %d and %d calls (want 2 rows, 1 and 2)",
                              rows, set, acc);
        else CHECK(rows == 0, "the records outlived print: %d rows", rows);
    }
    CHECK(lm_cuda_matmul_profile_print(NULL, 1) == LM_ERR_ARG, "a NULL file accepted");
    free(x), free(w);
    lm_cuda_free(dx), lm_cuda_free(dw), lm_cuda_free(dy);
}

/* ------------------------------------------------------------ arguments */

static void test_bad_arguments_are_refused(void) {
    float *f = dev_alloc(4096);
    uint16_t *h = dev_alloc(4096);
    CHECK(lm_cuda_matmul_forward(&ctx, f, h, h, 4, 0, 8, 0) == LM_ERR_ARG, "ic = 0 accepted");
    CHECK(lm_cuda_matmul_forward(&ctx, f, h, h, -1, 8, 8, 0) == LM_ERR_ARG, "n < 0 accepted");
    CHECK(lm_cuda_matmul_forward(NULL, f, h, h, 4, 8, 8, 0) == LM_ERR_ARG, "NULL ctx accepted");
    CHECK(lm_cuda_matmul_backward(&ctx, f, f, NULL, h, h, 4, 8, 8) == LM_ERR_ARG, "NULL dout accepted");
    CHECK(lm_cuda_rmsnorm_forward(&ctx, NULL, NULL, NULL, f, NULL, 4, 8, 1e-6f) == LM_ERR_ARG,
          "no output accepted");
    CHECK(lm_cuda_rmsnorm_forward(&ctx, f, NULL, NULL, f, NULL, 4, 0, 1e-6f) == LM_ERR_ARG, "d = 0 accepted");
    CHECK(lm_cuda_rmsnorm_backward(&ctx, f, f, f, f, NULL, f, 4, 8, 1e-6f, NULL) == LM_ERR_ARG,
          "dweight without scratch accepted");
    CHECK(lm_cuda_embedding_backward(&ctx, f, f, (const int32_t *)f, 4, 8, 0, f) == LM_ERR_ARG,
          "vocab = 0 accepted");
    setenv("LONGMOE_EMBEDDING_BACKWARD", "sorted", 1);
    CHECK(lm_cuda_embedding_backward(&ctx, f, f, (const int32_t *)f, 4, 8, 8, f) == LM_ERR_ARG,
          "LONGMOE_EMBEDDING_BACKWARD=sorted accepted");
    unsetenv("LONGMOE_EMBEDDING_BACKWARD");
    size_t small = lm_cuda_cross_entropy_workspace_bytes(4, 8, 16, 1) - 1;
    CHECK(lm_cuda_cross_entropy_forward(&ctx, f, f, h, h, (const int32_t *)f, 4, 8, 16, f, small) == LM_ERR_ARG,
          "a workspace below one row accepted");
    CHECK(lm_cuda_all_finite(&ctx, f, 4, NULL) == LM_ERR_ARG, "NULL flag accepted");
    CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "%s", lm_last_error());
    lm_cuda_free(f), lm_cuda_free(h);
}

int main(void) {
    test_skip_without_cuda();
    if (!test_skip_all_reason && lm_cuda_context_create(&ctx) != LM_OK) {
        fprintf(stderr, "no CUDA device: %s\n", lm_last_error());
        return 1;
    }
    lm_rng_seed(&rng, 20240917);
    RUN(test_matmul_forward_matches_cpu_and_accumulates);
    RUN(test_matmul_backward_matches_cpu_and_accumulates);
    RUN(test_bf16_conversions_round_like_the_host);
    RUN(test_all_finite_flags_every_nan_and_inf);
    RUN(test_rmsnorm_forward_matches_cpu);
    RUN(test_rmsnorm_backward_matches_cpu_and_accumulates);
    RUN(test_embedding_forward_gathers_rows);
    RUN(test_embedding_backward_adds_in_position_order_like_the_cpu);
    RUN(test_cross_entropy_matches_float64_reference);
    RUN(test_matmul_profile_counts_products_by_shape);
    RUN(test_bad_arguments_are_refused);
    lm_cuda_context_destroy(&ctx);
    return test_summary();
}
