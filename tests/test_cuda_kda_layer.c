/* The KDA layer's non-product CUDA kernels (include/longmoe/kda_layer_cuda.h)
 * against the CPU layer's formulas (src/model/kda_layer.c through
 * lm_short_conv_*, lm_silu_l2_* and lm_rmsnorm_* of longmoe/linear.h).
 *
 * Both sides see identical inputs: whatever the kernels take in bf16 (the
 * operator's o and the gradients dq/dk/dv) is rounded to bf16 first and the
 * CPU runs in fp32 on the rounded values. Tolerances, as relative error
 * ||got - want|| / ||want||: 1e-5 for fp32 results, 1e-2 for bf16 results.
 * The token-reduced gradients (dw, do_norm) must be bit-identical from run to
 * run. Every output buffer is poisoned with NaN first, so an element the
 * kernels do not write fails the comparison. Needs a CUDA GPU (ctest label cuda). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "longmoe/cuda_context.h"
#include "longmoe/kda_layer_cuda.h"
#include "longmoe/linear.h"
#include "test.h"
#include "test_cuda.h"

#define TOL_F32 1e-5
#define TOL_BF16 1e-2
#define OUT_EPS 1e-5f

static lm_cuda_context ctx;

/* (B, T, C, W, head_dim): one token; odd T; W = 3; a long sequence of wide
 * rows; head sizes of 3 and 8 values a lane (96, 256) with odd T; many
 * token chunks of an odd number of rows (4097 x 8 heads); head_dim 32 (the
 * CPU presets) over several sequences and three heads */
static const int shapes[][5] = {{1, 1, 64, 4, 32},      {2, 37, 256, 4, 128}, {1, 300, 128, 3, 64},
                                {1, 1000, 1024, 4, 128}, {3, 333, 288, 4, 96}, {1, 257, 512, 2, 256},
                                {1, 4097, 256, 4, 32},   {3, 131, 96, 4, 32}};
#define NSHAPES (int)(sizeof shapes / sizeof shapes[0])

/* The helpers below copy and set memory on the default stream, the kernels
 * run on the context's (non-blocking) stream: wait for both in between. */
static void settle(void) { CHECK(cudaDeviceSynchronize() == cudaSuccess, "device synchronisation failed"); }

/* Device buffer filled with all-ones bits (NaN as fp32 and as bf16). */
static void *dev_poisoned(size_t bytes) {
    void *p = NULL;
    if (lm_cuda_alloc(&p, bytes)) {
        fprintf(stderr, "device allocation of %zu bytes: %s\n", bytes, lm_last_error());
        exit(EXIT_FAILURE);
    }
    if (cudaMemset(p, 0xFF, bytes ? bytes : 16) != cudaSuccess) exit(EXIT_FAILURE);
    settle();
    return p;
}

static void *dev_from(const float *h, size_t n) {
    void *p = dev_poisoned(n * sizeof(float));
    CHECK(lm_cuda_upload(p, h, n * sizeof(float)) == LM_OK, "upload: %s", lm_last_error());
    settle();
    return p;
}

static uint16_t *dev_bf16_from(const float *h, size_t n) {
    uint16_t *p = dev_poisoned(n * sizeof(uint16_t));
    CHECK(lm_cuda_upload_bf16(p, h, n) == LM_OK, "upload bf16: %s", lm_last_error());
    settle();
    return p;
}

static float *host_from(const void *d, size_t n) {
    float *h = mallocCheck(n * sizeof(float));
    settle();
    CHECK(lm_cuda_download(h, d, n * sizeof(float)) == LM_OK, "download: %s", lm_last_error());
    return h;
}

static float *host_from_bf16(const uint16_t *d, size_t n) {
    float *h = mallocCheck(n * sizeof(float));
    settle();
    CHECK(lm_cuda_download_bf16(h, d, n) == LM_OK, "download bf16: %s", lm_last_error());
    return h;
}

static void check_rel(const float *got, const float *want, size_t n, double tol, const char *what,
                      const int *s) {
    double e = rel_err(got, want, n);
    printf("    (%d,%d,%d,%d,%d) %-34s %.2e\n", s[0], s[1], s[2], s[3], s[4], what, e);
    CHECK(e <= tol, "(%d,%d,%d,%d,%d) %s: relative error %.3g > %.3g", s[0], s[1], s[2], s[3], s[4],
          what, e, tol);
}

/* conv, SiLU and L2 norm: the saved conv output and 1/||.|| (fp32) and the
 * operator's bf16 input equal the CPU's silu_l2_forward(short_conv_forward). */
static void test_short_conv_silu_forward_matches_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 101);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si], B = s[0], T = s[1], C = s[2], W = s[3], hd = s[4];
        const size_t N = (size_t)B * T, NC = N * C, rows = N * (C / hd);
        for (int norm = 1; norm >= 0; norm--) {
            float *in = host_normal(NC, 1.0, 0.0, 0, &r), *w = host_normal((size_t)C * W, 1.0 / sqrt(W), 0, 0, &r);
            float *conv = mallocCheck(NC * 4), *y = mallocCheck(NC * 4), *rn = mallocCheck(rows * 4);
            lm_short_conv_forward(conv, in, w, B, T, C, W);
            lm_silu_l2_forward(y, norm ? rn : NULL, conv, rows, hd);
            float *d_in = dev_from(in, NC), *d_w = dev_from(w, (size_t)C * W);
            float *d_conv = dev_poisoned(NC * 4), *d_rn = dev_poisoned(rows * 4);
            uint16_t *d_out = dev_poisoned(NC * 2), *d_out2 = dev_poisoned(NC * 2);
            lm_status st = lm_cuda_short_conv_silu_forward(&ctx, d_conv, d_out, norm ? d_rn : NULL, d_in,
                                                           d_w, B, T, C, W, hd);
            CHECK(st == LM_OK, "forward: %s", lm_last_error());
            /* without saving the conv output: the same operator input */
            st = lm_cuda_short_conv_silu_forward(&ctx, NULL, d_out2, norm ? d_rn : NULL, d_in, d_w, B, T,
                                                 C, W, hd);
            CHECK(st == LM_OK, "forward without conv_out: %s", lm_last_error());
            CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
            float *g_conv = host_from(d_conv, NC), *g_out = host_from_bf16(d_out, NC);
            float *g_out2 = host_from_bf16(d_out2, NC);
            check_rel(g_conv, conv, NC, TOL_F32, "conv output (fp32)", s);
            check_rel(g_out, y, NC, TOL_BF16, norm ? "L2(SiLU(conv)) (bf16)" : "SiLU(conv) (bf16)", s);
            CHECK(memcmp(g_out, g_out2, NC * 4) == 0, "output differs when conv_out is not saved");
            if (norm) {
                float *g_rn = host_from(d_rn, rows);
                check_rel(g_rn, rn, rows, TOL_F32, "rnorm (fp32)", s);
                free(g_rn);
            }
            free(in), free(w), free(conv), free(y), free(rn), free(g_conv), free(g_out), free(g_out2);
            lm_cuda_free(d_in), lm_cuda_free(d_w), lm_cuda_free(d_conv), lm_cuda_free(d_rn);
            lm_cuda_free(d_out), lm_cuda_free(d_out2);
        }
    }
}

/* The ring kernel (the default; LONGMOE_CONV_FORWARD=ring) and the
 * register-window kernel (LONGMOE_CONV_FORWARD=window) give the row kernel's
 * bits (LONGMOE_CONV_FORWARD=row): conv output, operator input and 1/||.||,
 * on every shape (T under and over their 16- and 64-token stretches, odd T,
 * several sequences, W 2 to 4, head dims 32 to 128; the shapes they do not
 * take, W > 4 or head_dim > 128, run the row kernel); an `in` that is not
 * 16-byte aligned (ring falls back to window) gives the same bits too; an
 * unknown value is refused. */
static const char *const fwd_kinds[] = {"row", "window", "ring"};
#define NFWD 3

static void test_short_conv_window_kernel_equals_row_kernel(void) {
    lm_rng r;
    lm_rng_seed(&r, 105);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si], B = s[0], T = s[1], C = s[2], W = s[3], hd = s[4];
        const size_t N = (size_t)B * T, NC = N * C, rows = N * (C / hd);
        float *in = host_normal(NC, 1.0, 0.0, 0, &r), *w = host_normal((size_t)C * W, 1.0 / sqrt(W), 0, 0, &r);
        float *d_in = dev_from(in, NC), *d_w = dev_from(w, (size_t)C * W);
        /* the same input one float past a 16-byte boundary */
        float *d_in_odd = dev_poisoned((NC + 1) * sizeof(float));
        CHECK(lm_cuda_upload(d_in_odd + 1, in, NC * sizeof(float)) == LM_OK, "upload: %s", lm_last_error());
        settle();
        float *d_conv[NFWD + 1], *d_rn[NFWD + 1];
        uint16_t *d_out[NFWD + 1];
        for (int k = 0; k <= NFWD; k++) {
            const char *kind = k < NFWD ? fwd_kinds[k] : "ring";
            setenv("LONGMOE_CONV_FORWARD", kind, 1);
            d_conv[k] = dev_poisoned(NC * 4);
            d_rn[k] = dev_poisoned(rows * 4);
            d_out[k] = dev_poisoned(NC * 2);
            CHECK(lm_cuda_short_conv_silu_forward(&ctx, d_conv[k], d_out[k], d_rn[k], k < NFWD ? d_in : d_in_odd + 1,
                                                  d_w, B, T, C, W, hd) == LM_OK,
                  "forward (%s%s): %s", kind, k < NFWD ? "" : ", unaligned in", lm_last_error());
        }
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *c0 = host_from(d_conv[0], NC), *r0 = host_from(d_rn[0], rows), *o0 = host_from_bf16(d_out[0], NC);
        for (int k = 1; k <= NFWD; k++) {
            const char *kind = k < NFWD ? fwd_kinds[k] : "ring on an unaligned in";
            float *c1 = host_from(d_conv[k], NC), *r1 = host_from(d_rn[k], rows);
            float *o1 = host_from_bf16(d_out[k], NC);
            CHECK(memcmp(c0, c1, NC * 4) == 0, "(%d,%d,%d,%d,%d) %s: conv output differs from row", B, T, C, W, hd,
                  kind);
            CHECK(memcmp(r0, r1, rows * 4) == 0, "(%d,%d,%d,%d,%d) %s: rnorm differs from row", B, T, C, W, hd, kind);
            CHECK(memcmp(o0, o1, NC * 4) == 0, "(%d,%d,%d,%d,%d) %s: output differs from row", B, T, C, W, hd, kind);
            free(c1), free(r1), free(o1);
        }
        free(in), free(w), free(c0), free(r0), free(o0);
        lm_cuda_free(d_in), lm_cuda_free(d_w), lm_cuda_free(d_in_odd);
        for (int k = 0; k <= NFWD; k++) lm_cuda_free(d_conv[k]), lm_cuda_free(d_rn[k]), lm_cuda_free(d_out[k]);
    }
    setenv("LONGMOE_CONV_FORWARD", "diagonal", 1);
    float *f = dev_poisoned(64 * 4 * 4);
    uint16_t *b = dev_poisoned(64 * 4 * 2);
    CHECK(lm_cuda_short_conv_silu_forward(&ctx, f, b, NULL, f, f, 1, 4, 64, 4, 32) == LM_ERR_ARG,
          "LONGMOE_CONV_FORWARD=diagonal accepted");
    lm_cuda_free(f), lm_cuda_free(b);
    unsetenv("LONGMOE_CONV_FORWARD");
}

/* The conv backward tests' inputs: on the host in, w, dout (bf16-representable) and dw's start,
 * drawn in that order; on the device in, w, dout (bf16), and the forward's outputs (conv, 1/||y||,
 * y) poisoned until it writes them. */
static void conv_backward_inputs(lm_rng *r, size_t NC, size_t CW, size_t rows, int W, float **in, float **w,
                                 float **dout, float **dw0, float **d_in, float **d_w, float **d_conv, float **d_rn,
                                 uint16_t **d_y, uint16_t **d_dout) {
    *in = host_normal(NC, 1.0, 0.0, 0, r), *w = host_normal(CW, 1.0 / sqrt(W), 0, 0, r);
    *dout = host_normal(NC, 1.0, 0.0, 1, r), *dw0 = host_normal(CW, 0.1, 0.0, 0, r);
    *d_in = dev_from(*in, NC), *d_w = dev_from(*w, CW), *d_conv = dev_poisoned(NC * 4);
    *d_rn = dev_poisoned(rows * 4);
    *d_y = dev_poisoned(NC * 2), *d_dout = dev_bf16_from(*dout, NC);
}

/* The ring backward (the default; LONGMOE_CONV_BACKWARD=ring) gives the
 * one-pass fused kernel's bits (LONGMOE_CONV_BACKWARD=fused): din and dw
 * (+= onto the same start), with and without the L2 norm, on every shape
 * (the shapes neither takes run the two-pass path under both values), and
 * with dout one bf16 past a 16-byte boundary (ring falls back to fused); an
 * unknown value is refused. */
static void test_short_conv_backward_ring_equals_fused(void) {
    lm_rng r;
    lm_rng_seed(&r, 207);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si], B = s[0], T = s[1], C = s[2], W = s[3], hd = s[4];
        const size_t N = (size_t)B * T, NC = N * C, CW = (size_t)C * W, rows = N * (C / hd);
        for (int norm = 1; norm >= 0; norm--) {
            float *in, *w, *dout, *dw0, *d_in, *d_w, *d_conv, *d_rn;
            uint16_t *d_y, *d_dout;
            conv_backward_inputs(&r, NC, CW, rows, W, &in, &w, &dout, &dw0, &d_in, &d_w, &d_conv, &d_rn, &d_y, &d_dout);
            float *rnp = norm ? d_rn : NULL;
            uint16_t *d_dout_odd = dev_poisoned((NC + 1) * 2);
            CHECK(lm_cuda_upload_bf16(d_dout_odd + 1, dout, NC) == LM_OK, "upload bf16: %s", lm_last_error());
            settle();
            void *d_scratch = dev_poisoned(lm_cuda_short_conv_silu_backward_scratch_bytes(B, T, C, W));
            CHECK(lm_cuda_short_conv_silu_forward(&ctx, d_conv, d_y, rnp, d_in, d_w, B, T, C, W, hd) == LM_OK,
                  "forward: %s", lm_last_error());
            float *g_din[3], *g_dw[3];
            const char *what[3] = {"fused", "ring", "ring on an unaligned dout"};
            for (int k = 0; k < 3; k++) {
                float *d_din = dev_poisoned(NC * 4), *d_dw = dev_from(dw0, CW);
                setenv("LONGMOE_CONV_BACKWARD", k ? "ring" : "fused", 1);
                CHECK(lm_cuda_short_conv_silu_backward(&ctx, d_din, d_dw, k < 2 ? d_dout : d_dout_odd + 1, d_conv, rnp,
                                                       d_in, d_w, B, T, C, W, hd, d_scratch) == LM_OK,
                      "backward (%s): %s", what[k], lm_last_error());
                CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
                g_din[k] = host_from(d_din, NC), g_dw[k] = host_from(d_dw, CW);
                lm_cuda_free(d_din), lm_cuda_free(d_dw);
            }
            for (int k = 1; k < 3; k++) {
                CHECK(memcmp(g_din[0], g_din[k], NC * 4) == 0, "(%d,%d,%d,%d,%d) norm %d %s: din differs from fused", B,
                      T, C, W, hd, norm, what[k]);
                CHECK(memcmp(g_dw[0], g_dw[k], CW * 4) == 0, "(%d,%d,%d,%d,%d) norm %d %s: dw differs from fused", B, T,
                      C, W, hd, norm, what[k]);
            }
            /* din in bf16 (ring, then fused): fused's fp32 din rounded, bit for bit; dw the same bits */
            for (int k = 0; k < 2; k++) {
                uint16_t *d_din16 = dev_poisoned(NC * 2);
                float *d_dw = dev_from(dw0, CW);
                setenv("LONGMOE_CONV_BACKWARD", k ? "fused" : "ring", 1);
                lm_status bst = lm_cuda_short_conv_silu_backward_bf16(&ctx, d_din16, d_dw, d_dout, d_conv, rnp, d_in,
                                                                      d_w, B, T, C, W, hd, C, d_scratch);
                if (!lm_cuda_short_conv_silu_backward_bf16_takes(W, hd)) {
                    CHECK(bst == LM_ERR_ARG, "(%d,%d,%d,%d,%d): bf16 din accepted where the one-pass kernels do not run",
                          B, T, C, W, hd);
                } else {
                    CHECK(bst == LM_OK, "backward bf16 (%s): %s", k ? "fused" : "ring", lm_last_error());
                    CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
                    uint16_t *h16 = mallocCheck(NC * 2);
                    CHECK(lm_cuda_download(h16, d_din16, NC * 2) == LM_OK, "download: %s", lm_last_error());
                    float *h_dw = host_from(d_dw, CW);
                    size_t bad = 0;
                    for (size_t i = 0; i < NC; i++) bad += h16[i] != lm_f32_to_bf16(g_din[0][i]);
                    CHECK(bad == 0, "(%d,%d,%d,%d,%d) norm %d bf16 din (%s): %zu values not fused's din rounded", B, T,
                          C, W, hd, norm, k ? "fused" : "ring", bad);
                    CHECK(memcmp(h_dw, g_dw[0], CW * 4) == 0, "(%d,%d,%d,%d,%d) norm %d bf16 din (%s): dw differs", B,
                          T, C, W, hd, norm, k ? "fused" : "ring");
                    free(h16), free(h_dw);
                }
                lm_cuda_free(d_din16), lm_cuda_free(d_dw);
            }
            unsetenv("LONGMOE_CONV_BACKWARD");
            for (int k = 0; k < 3; k++) free(g_din[k]), free(g_dw[k]);
            free(in), free(w), free(dout), free(dw0);
            lm_cuda_free(d_in), lm_cuda_free(d_w), lm_cuda_free(d_conv), lm_cuda_free(d_rn), lm_cuda_free(d_y);
            lm_cuda_free(d_dout), lm_cuda_free(d_dout_odd), lm_cuda_free(d_scratch);
        }
    }
    setenv("LONGMOE_CONV_BACKWARD", "sideways", 1);
    float *f = dev_poisoned(64 * 4 * 4);
    uint16_t *b = dev_poisoned(64 * 4 * 2);
    void *sc = dev_poisoned(lm_cuda_short_conv_silu_backward_scratch_bytes(1, 4, 64, 4));
    CHECK(lm_cuda_short_conv_silu_backward(&ctx, f, f, b, f, NULL, f, f, 1, 4, 64, 4, 32, sc) == LM_ERR_ARG,
          "LONGMOE_CONV_BACKWARD=sideways accepted");
    lm_cuda_free(f), lm_cuda_free(b), lm_cuda_free(sc);
    unsetenv("LONGMOE_CONV_BACKWARD");
}

/* Backward of conv + SiLU + L2 from a bf16 dout: din (written) and dw (+=)
 * equal the CPU's silu_l2_backward then short_conv_backward; dw is
 * bit-identical on a second run; recomputing the conv output (conv_out NULL)
 * gives the same gradients, bit for bit. */
static void test_short_conv_silu_backward_matches_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 202);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si], B = s[0], T = s[1], C = s[2], W = s[3], hd = s[4];
        const size_t N = (size_t)B * T, NC = N * C, CW = (size_t)C * W, rows = N * (C / hd);
        for (int norm = 1; norm >= 0; norm--) {
            float *in = host_normal(NC, 1.0, 0.0, 0, &r), *w = host_normal(CW, 1.0 / sqrt(W), 0, 0, &r);
            float *dout = host_normal(NC, 1.0, 0.0, 1, &r), *dw0 = host_normal(CW, 0.1, 0.0, 0, &r);
            float *conv = mallocCheck(NC * 4), *y = mallocCheck(NC * 4), *rn = mallocCheck(rows * 4);
            float *dc = mallocCheck(NC * 4), *din = mallocCheck(NC * 4), *dw = mallocCheck(CW * 4);
            lm_short_conv_forward(conv, in, w, B, T, C, W);
            lm_silu_l2_forward(y, norm ? rn : NULL, conv, rows, hd);
            lm_silu_l2_backward(dc, dout, conv, y, norm ? rn : NULL, rows, hd);
            memcpy(dw, dw0, CW * 4);
            lm_short_conv_backward(din, dw, dc, in, w, B, T, C, W);

            float *d_in = dev_from(in, NC), *d_w = dev_from(w, CW), *d_conv = dev_poisoned(NC * 4);
            float *d_rn = dev_poisoned(rows * 4), *d_din = dev_poisoned(NC * 4), *d_dw = dev_from(dw0, CW);
            uint16_t *d_y = dev_poisoned(NC * 2), *d_dout = dev_bf16_from(dout, NC);
            size_t sb = lm_cuda_short_conv_silu_backward_scratch_bytes(B, T, C, W);
            void *d_scratch = dev_poisoned(sb);
            float *rnp = norm ? d_rn : NULL;
            lm_status st = lm_cuda_short_conv_silu_forward(&ctx, d_conv, d_y, rnp, d_in, d_w, B, T, C, W, hd);
            CHECK(st == LM_OK, "forward: %s", lm_last_error());
            st = lm_cuda_short_conv_silu_backward(&ctx, d_din, d_dw, d_dout, d_conv, rnp, d_in, d_w, B, T,
                                                  C, W, hd, d_scratch);
            CHECK(st == LM_OK, "backward: %s", lm_last_error());
            CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
            float *g_din = host_from(d_din, NC), *g_dw = host_from(d_dw, CW);
            check_rel(g_din, din, NC, TOL_F32, norm ? "din (q/k, fp32)" : "din (v, fp32)", s);
            check_rel(g_dw, dw, CW, TOL_F32, norm ? "dw += (q/k, fp32)" : "dw += (v, fp32)", s);

            /* run to run with c saved (the one-pass kernel where it applies): the same bits */
            CHECK(lm_cuda_upload(d_dw, dw0, CW * 4) == LM_OK, "upload: %s", lm_last_error());
            cudaMemset(d_din, 0xFF, NC * 4);
            settle();
            st = lm_cuda_short_conv_silu_backward(&ctx, d_din, d_dw, d_dout, d_conv, rnp, d_in, d_w, B, T, C,
                                                  W, hd, d_scratch);
            CHECK(st == LM_OK, "backward again: %s", lm_last_error());
            CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
            float *g_din1 = host_from(d_din, NC), *g_dw1 = host_from(d_dw, CW);
            CHECK(memcmp(g_dw, g_dw1, CW * 4) == 0 && memcmp(g_din, g_din1, NC * 4) == 0,
                  "dw or din is not bit-identical from run to run");
            free(g_din1), free(g_dw1);

            /* c not saved (recomputed from in and w, in the one-pass kernels where they apply, else in
             * the two-pass path): the same din and dw bits */
            CHECK(lm_cuda_upload(d_dw, dw0, CW * 4) == LM_OK, "upload: %s", lm_last_error());
            cudaMemset(d_din, 0xFF, NC * 4);
            settle();
            st = lm_cuda_short_conv_silu_backward(&ctx, d_din, d_dw, d_dout, NULL, rnp, d_in, d_w, B, T, C,
                                                  W, hd, d_scratch);
            CHECK(st == LM_OK, "backward (recompute): %s", lm_last_error());
            CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
            float *g_din2 = host_from(d_din, NC), *g_dw2 = host_from(d_dw, CW);
            CHECK(memcmp(g_dw, g_dw2, CW * 4) == 0, "dw differs between saved and recomputed c");
            CHECK(memcmp(g_din, g_din2, NC * 4) == 0, "din differs between saved and recomputed c");
            check_rel(g_din2, din, NC, TOL_F32, "din, conv recomputed", s);

            free(in), free(w), free(dout), free(dw0), free(conv), free(y), free(rn), free(dc);
            free(din), free(dw), free(g_din), free(g_dw), free(g_din2), free(g_dw2);
            lm_cuda_free(d_in), lm_cuda_free(d_w), lm_cuda_free(d_conv), lm_cuda_free(d_rn);
            lm_cuda_free(d_din), lm_cuda_free(d_dw), lm_cuda_free(d_y), lm_cuda_free(d_dout);
            lm_cuda_free(d_scratch);
        }
    }
}

/* The backward with the conv output recomputed (conv_out NULL: c formed from
 * in and w inside the one-pass kernels, with the forward's sum) gives the bits
 * of the backward from the saved conv output: din in fp32 and in bf16, and dw
 * (+= onto the same start), under both one-pass kernels (ring, fused), with
 * and without the L2 norm, on fresh inputs for every W in 1..4 and head_dim
 * 32, 64, 128, over one long sequence (chunks of dw that end inside it, so
 * their W-1 halo tokens need c too), several sequences of odd T (chunk ends
 * inside a sequence and next to its start) and T shorter than W; and in the
 * two-pass path (head_dim 256, W 6). */
static void test_short_conv_backward_recompute_equals_saved(void) {
    lm_rng r;
    lm_rng_seed(&r, 211);
    static const int bt[][2] = {{1, 1031}, {3, 37}, {4, 129}, {2, 3}}; /* (B, T) */
    static const int wide[][2] = {{4, 256}, {6, 64}};                  /* (W, head_dim) of the two-pass path */
    const int nbt = (int)(sizeof bt / sizeof bt[0]), nfast = 4 * 3;
    const char *const kinds[2] = {"ring", "fused"};
    for (int ci = 0; ci < nfast + 2; ci++)
        for (int bi = 0; bi < nbt; bi++) {
            const int W = ci < nfast ? 1 + ci % 4 : wide[ci - nfast][0];
            const int hd = ci < nfast ? 32 << (ci / 4) : wide[ci - nfast][1];
            const int B = bt[bi][0], T = bt[bi][1], C = (bi % 2 ? 3 : 2) * hd;
            const size_t N = (size_t)B * T, NC = N * C, CW = (size_t)C * W, rows = N * (C / hd);
            const int fast = lm_cuda_short_conv_silu_backward_bf16_takes(W, hd);
            CHECK(fast == (ci < nfast), "W=%d head_dim=%d: one-pass kernels %s", W, hd, fast ? "taken" : "not taken");
            for (int norm = 1; norm >= 0; norm--) {
                float *in, *w, *dout, *dw0, *d_in, *d_w, *d_conv, *d_rn;
                uint16_t *d_y, *d_dout;
                conv_backward_inputs(&r, NC, CW, rows, W, &in, &w, &dout, &dw0, &d_in, &d_w, &d_conv, &d_rn, &d_y,
                                     &d_dout);
                float *rnp = norm ? d_rn : NULL;
                void *d_scratch = dev_poisoned(lm_cuda_short_conv_silu_backward_scratch_bytes(B, T, C, W));
                CHECK(lm_cuda_short_conv_silu_forward(&ctx, d_conv, d_y, rnp, d_in, d_w, B, T, C, W, hd) == LM_OK,
                      "forward: %s", lm_last_error());
                for (int k = 0; k < (fast ? 2 : 1); k++) {
                    setenv("LONGMOE_CONV_BACKWARD", kinds[k], 1);
                    /* [0]: conv_out saved, [1]: recomputed; fp32 din, then (one-pass) bf16 din */
                    float *g_din[2], *g_dw[2], *g_dw16[2];
                    uint16_t *g_din16[2];
                    for (int rc = 0; rc < 2; rc++) {
                        const float *conv = rc ? NULL : d_conv;
                        float *d_din = dev_poisoned(NC * 4), *d_dw = dev_from(dw0, CW);
                        CHECK(lm_cuda_short_conv_silu_backward(&ctx, d_din, d_dw, d_dout, conv, rnp, d_in, d_w, B, T,
                                                               C, W, hd, d_scratch) == LM_OK,
                              "backward (%s, conv %s): %s", kinds[k], rc ? "recomputed" : "saved", lm_last_error());
                        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
                        g_din[rc] = host_from(d_din, NC), g_dw[rc] = host_from(d_dw, CW);
                        lm_cuda_free(d_din), lm_cuda_free(d_dw);
                        g_din16[rc] = NULL, g_dw16[rc] = NULL;
                        if (!fast) continue;
                        uint16_t *d_din16 = dev_poisoned(NC * 2);
                        d_dw = dev_from(dw0, CW);
                        CHECK(lm_cuda_short_conv_silu_backward_bf16(&ctx, d_din16, d_dw, d_dout, conv, rnp, d_in, d_w,
                                                                    B, T, C, W, hd, C, d_scratch) == LM_OK,
                              "backward bf16 (%s, conv %s): %s", kinds[k], rc ? "recomputed" : "saved",
                              lm_last_error());
                        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
                        g_din16[rc] = mallocCheck(NC * 2);
                        CHECK(lm_cuda_download(g_din16[rc], d_din16, NC * 2) == LM_OK, "download: %s",
                              lm_last_error());
                        g_dw16[rc] = host_from(d_dw, CW);
                        lm_cuda_free(d_din16), lm_cuda_free(d_dw);
                    }
                    CHECK(memcmp(g_din[0], g_din[1], NC * 4) == 0,
                          "(%d,%d,%d,%d,%d) norm %d %s: din differs with c recomputed", B, T, C, W, hd, norm, kinds[k]);
                    CHECK(memcmp(g_dw[0], g_dw[1], CW * 4) == 0,
                          "(%d,%d,%d,%d,%d) norm %d %s: dw differs with c recomputed", B, T, C, W, hd, norm, kinds[k]);
                    CHECK(memcmp(g_dw[0], dw0, CW * 4) != 0, "(%d,%d,%d,%d,%d) norm %d %s: dw did not change", B, T,
                          C, W, hd, norm, kinds[k]);
                    if (fast) {
                        CHECK(memcmp(g_din16[0], g_din16[1], NC * 2) == 0,
                              "(%d,%d,%d,%d,%d) norm %d %s: bf16 din differs with c recomputed", B, T, C, W, hd, norm,
                              kinds[k]);
                        CHECK(memcmp(g_dw16[1], g_dw[0], CW * 4) == 0,
                              "(%d,%d,%d,%d,%d) norm %d %s: dw beside bf16 din differs with c recomputed", B, T, C, W,
                              hd, norm, kinds[k]);
                    }
                    for (int rc = 0; rc < 2; rc++) free(g_din[rc]), free(g_dw[rc]), free(g_din16[rc]), free(g_dw16[rc]);
                }
                unsetenv("LONGMOE_CONV_BACKWARD");
                free(in), free(w), free(dout), free(dw0);
                lm_cuda_free(d_in), lm_cuda_free(d_w), lm_cuda_free(d_conv), lm_cuda_free(d_rn), lm_cuda_free(d_y);
                lm_cuda_free(d_dout), lm_cuda_free(d_scratch);
            }
        }
    printf("    %d (W, head_dim) x %d (B, T) x 2 norms: din (fp32, bf16) and dw equal with c recomputed\n",
           nfast + 2, nbt);
}

/* beta = sigmoid(logit) and dlogit = dbeta beta (1 - beta), as the CPU layer. */
static void test_sigmoid_matches_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 303);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si];
        const size_t n = (size_t)s[0] * s[1] * (s[2] / s[4]);
        float *logit = host_normal(n, 4.0, 0.0, 0, &r), *dbeta = host_normal(n, 1.0, 0.0, 0, &r);
        float *beta = mallocCheck(n * 4), *dlogit = mallocCheck(n * 4);
        for (size_t i = 0; i < n; i++) {
            beta[i] = lm_sigmoidf(logit[i]);
            dlogit[i] = dbeta[i] * beta[i] * (1.0f - beta[i]);
        }
        float *d_logit = dev_from(logit, n), *d_beta = dev_poisoned(n * 4), *d_g = dev_from(dbeta, n);
        CHECK(lm_cuda_sigmoid_forward(&ctx, d_beta, d_logit, n) == LM_OK, "forward: %s", lm_last_error());
        /* in place, as the layer uses it: dbeta becomes the logit's gradient */
        CHECK(lm_cuda_sigmoid_backward(&ctx, d_g, d_g, d_beta, n) == LM_OK, "backward: %s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *g_beta = host_from(d_beta, n), *g_dlogit = host_from(d_g, n);
        check_rel(g_beta, beta, n, TOL_F32, "beta = sigmoid (fp32)", s);
        check_rel(g_dlogit, dlogit, n, TOL_F32, "dbeta logit (fp32)", s);
        free(logit), free(dbeta), free(beta), free(dlogit), free(g_beta), free(g_dlogit);
        lm_cuda_free(d_logit), lm_cuda_free(d_beta), lm_cuda_free(d_g);
    }
}

/* CPU output stage of lm_kda_layer_forward/backward, on fp32 arrays. */
static void cpu_output_forward(float *gated, float *rstd, float *gate, const float *o,
                               const float *logits, const float *o_norm, size_t N, int H, int K) {
    size_t NHK = N * H * K;
    lm_rmsnorm_forward(gated, rstd, o, o_norm, (int64_t)(N * H), K, OUT_EPS);
    for (size_t i = 0; i < NHK; i++) {
        gate[i] = lm_sigmoidf(logits[i]);
        gated[i] *= gate[i];
    }
}

static void cpu_output_backward(float *d_o, float *dgate, float *do_norm, const float *d_gated,
                                const float *o, const float *rstd, const float *gate,
                                const float *o_norm, size_t N, int H, int K) {
    size_t NHK = N * H * K;
    float *dn = mallocCheck(NHK * 4);
    for (size_t i = 0; i < NHK; i++) {
        float gt = gate[i], n = o[i] * rstd[i / K] * o_norm[i % K];
        dgate[i] = d_gated[i] * n * gt * (1.0f - gt);
        dn[i] = d_gated[i] * gt;
    }
    memset(d_o, 0, NHK * 4);
    lm_rmsnorm_backward(d_o, do_norm, dn, o, o_norm, rstd, (int64_t)(N * H), K, OUT_EPS);
    free(dn);
}

/* gate ⊙ RMSNorm(o): 1/rms and the gate (fp32) and W_o's bf16 input equal the CPU's. */
static void test_output_forward_matches_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 404);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si], K = s[4], H = s[2] / K;
        const size_t N = (size_t)s[0] * s[1], NHK = N * H * K;
        float *o = host_normal(NHK, 0.5, 0.0, 1, &r), *logits = host_normal(NHK, 2.0, 0.0, 0, &r);
        float *o_norm = host_normal((size_t)K, 0.2, 1.0, 0, &r);
        float *gated = mallocCheck(NHK * 4), *rstd = mallocCheck(N * H * 4), *gate = mallocCheck(NHK * 4);
        cpu_output_forward(gated, rstd, gate, o, logits, o_norm, N, H, K);
        uint16_t *d_o = dev_bf16_from(o, NHK), *d_gated = dev_poisoned(NHK * 2);
        float *d_logits = dev_from(logits, NHK), *d_onorm = dev_from(o_norm, (size_t)K);
        float *d_rstd = dev_poisoned(N * H * 4), *d_gate = dev_poisoned(NHK * 4);
        lm_status st = lm_cuda_kda_output_forward(&ctx, d_gated, d_rstd, d_gate, d_o, d_logits, d_onorm,
                                                  (int64_t)N, H, K, OUT_EPS);
        CHECK(st == LM_OK, "forward: %s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *g_gated = host_from_bf16(d_gated, NHK), *g_rstd = host_from(d_rstd, N * H);
        float *g_gate = host_from(d_gate, NHK);
        check_rel(g_rstd, rstd, N * H, TOL_F32, "o_rstd (fp32)", s);
        check_rel(g_gate, gate, NHK, TOL_F32, "gate (fp32)", s);
        check_rel(g_gated, gated, NHK, TOL_BF16, "gated (bf16)", s);
        /* in place: the gate over its logits */
        st = lm_cuda_kda_output_forward(&ctx, d_gated, d_rstd, d_logits, d_o, d_logits, d_onorm,
                                        (int64_t)N, H, K, OUT_EPS);
        CHECK(st == LM_OK, "forward in place: %s", lm_last_error());
        float *g_gate2 = host_from(d_logits, NHK);
        CHECK(memcmp(g_gate, g_gate2, NHK * 4) == 0, "the in-place gate differs");
        free(o), free(logits), free(o_norm), free(gated), free(rstd), free(gate);
        free(g_gated), free(g_rstd), free(g_gate), free(g_gate2);
        lm_cuda_free(d_o), lm_cuda_free(d_gated), lm_cuda_free(d_logits), lm_cuda_free(d_onorm);
        lm_cuda_free(d_rstd), lm_cuda_free(d_gate);
    }
}

/* Backward of the output stage: d_o (fp32 and bf16), the gate logits'
 * gradient and do_norm (+=) equal the CPU's; do_norm is bit-identical on a
 * second run; recomputing 1/rms (o_rstd NULL) gives the same gradients. */
static void test_output_backward_matches_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 505);
    for (int si = 0; si < NSHAPES; si++) {
        const int *s = shapes[si], K = s[4], H = s[2] / K;
        const size_t N = (size_t)s[0] * s[1], NHK = N * H * K;
        float *o = host_normal(NHK, 0.5, 0.0, 1, &r), *logits = host_normal(NHK, 2.0, 0.0, 0, &r);
        float *o_norm = host_normal((size_t)K, 0.2, 1.0, 0, &r), *dgd = host_normal(NHK, 1.0, 0.0, 0, &r);
        float *dnorm0 = host_normal((size_t)K, 0.1, 0.0, 0, &r);
        float *gated = mallocCheck(NHK * 4), *rstd = mallocCheck(N * H * 4), *gate = mallocCheck(NHK * 4);
        float *d_o = mallocCheck(NHK * 4), *dgate = mallocCheck(NHK * 4), *dnorm = mallocCheck((size_t)K * 4);
        cpu_output_forward(gated, rstd, gate, o, logits, o_norm, N, H, K);
        memcpy(dnorm, dnorm0, (size_t)K * 4);
        cpu_output_backward(d_o, dgate, dnorm, dgd, o, rstd, gate, o_norm, N, H, K);

        uint16_t *dv_o = dev_bf16_from(o, NHK), *dv_gated = dev_poisoned(NHK * 2), *dv_do16 = dev_poisoned(NHK * 2);
        float *dv_logits = dev_from(logits, NHK), *dv_onorm = dev_from(o_norm, (size_t)K);
        float *dv_rstd = dev_poisoned(N * H * 4), *dv_gate = dev_poisoned(NHK * 4), *dv_dgd = dev_from(dgd, NHK);
        float *dv_do32 = dev_poisoned(NHK * 4), *dv_dgate = dev_poisoned(NHK * 4);
        uint16_t *dv_dgate16 = dev_poisoned(NHK * 2);
        float *dv_dnorm = dev_from(dnorm0, (size_t)K);
        size_t sb = lm_cuda_kda_output_backward_scratch_bytes((int64_t)N, H, K);
        void *dv_scratch = dev_poisoned(sb);
        lm_status st = lm_cuda_kda_output_forward(&ctx, dv_gated, dv_rstd, dv_gate, dv_o, dv_logits,
                                                  dv_onorm, (int64_t)N, H, K, OUT_EPS);
        CHECK(st == LM_OK, "forward: %s", lm_last_error());
        st = lm_cuda_kda_output_backward(&ctx, dv_do16, dv_do32, dv_dgate, dv_dgate16, 0, dv_dnorm, dv_dgd, dv_o,
                                         dv_rstd, dv_gate, dv_onorm, (int64_t)N, H, K, OUT_EPS, dv_scratch);
        CHECK(st == LM_OK, "backward: %s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *g_do32 = host_from(dv_do32, NHK), *g_do16 = host_from_bf16(dv_do16, NHK);
        float *g_dgate = host_from(dv_dgate, NHK), *g_dnorm = host_from(dv_dnorm, (size_t)K);
        check_rel(g_do32, d_o, NHK, TOL_F32, "d_o (fp32)", s);
        check_rel(g_do16, d_o, NHK, TOL_BF16, "d_o (bf16)", s);
        check_rel(g_dgate, dgate, NHK, TOL_F32, "d gate logits (fp32)", s);
        check_rel(g_dnorm, dnorm, (size_t)K, TOL_F32, "do_norm += (fp32)", s);
        /* the bf16 d gate logits: the fp32 ones of the same call rounded to nearest even, bit for bit */
        uint16_t *h16 = mallocCheck(NHK * 2);
        settle();
        CHECK(lm_cuda_download(h16, dv_dgate16, NHK * 2) == LM_OK, "download: %s", lm_last_error());
        size_t bad16 = 0;
        for (size_t i = 0; i < NHK; i++) bad16 += h16[i] != lm_f32_to_bf16(g_dgate[i]);
        CHECK(bad16 == 0, "(%d,%d,%d,%d,%d) %zu of %zu bf16 d gate logits are not the fp32 ones rounded", s[0], s[1],
              s[2], s[3], s[4], bad16, NHK);

        /* run to run, and with 1/rms recomputed (bf16 d_o only this time) */
        CHECK(lm_cuda_upload(dv_dnorm, dnorm0, (size_t)K * 4) == LM_OK, "upload: %s", lm_last_error());
        cudaMemset(dv_dgate, 0xFF, NHK * 4);
        settle();
        st = lm_cuda_kda_output_backward(&ctx, NULL, dv_do32, dv_dgate, NULL, 0, dv_dnorm, dv_dgd, dv_o, NULL,
                                         dv_gate, dv_onorm, (int64_t)N, H, K, OUT_EPS, dv_scratch);
        CHECK(st == LM_OK, "backward (rstd recomputed): %s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *g_do32b = host_from(dv_do32, NHK), *g_dgate2 = host_from(dv_dgate, NHK);
        float *g_dnorm2 = host_from(dv_dnorm, (size_t)K);
        check_rel(g_do32b, d_o, NHK, TOL_F32, "d_o, rstd recomputed", s);
        check_rel(g_dgate2, dgate, NHK, TOL_F32, "d gate logits, rstd recomputed", s);
        check_rel(g_dnorm2, dnorm, (size_t)K, TOL_F32, "do_norm, rstd recomputed", s);
        /* run to run with the saved rstd: the same do_norm bits; the call the layer made before the bf16
         * d gate logits (bf16 d_o, fp32 d gate logits), then the one it makes now (bf16 d_o and d gate
         * logits only): the second's bf16 values are the first's fp32 rounded, bit for bit */
        CHECK(lm_cuda_upload(dv_dnorm, dnorm0, (size_t)K * 4) == LM_OK, "upload: %s", lm_last_error());
        cudaMemset(dv_dgate, 0xFF, NHK * 4);
        settle();
        st = lm_cuda_kda_output_backward(&ctx, dv_do16, NULL, dv_dgate, NULL, 0, dv_dnorm, dv_dgd, dv_o, dv_rstd,
                                         dv_gate, dv_onorm, (int64_t)N, H, K, OUT_EPS, dv_scratch);
        CHECK(st == LM_OK, "backward again: %s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *g_dnorm3 = host_from(dv_dnorm, (size_t)K), *g_dgate3 = host_from(dv_dgate, NHK);
        CHECK(memcmp(g_dnorm, g_dnorm3, (size_t)K * 4) == 0, "do_norm is not bit-identical from run to run");
        CHECK(memcmp(g_dgate, g_dgate3, NHK * 4) == 0, "d gate logits (fp32) differ with and without the bf16 copy");
        CHECK(lm_cuda_upload(dv_dnorm, dnorm0, (size_t)K * 4) == LM_OK, "upload: %s", lm_last_error());
        cudaMemset(dv_dgate16, 0xFF, NHK * 2);
        settle();
        st = lm_cuda_kda_output_backward(&ctx, dv_do16, NULL, NULL, dv_dgate16, 0, dv_dnorm, dv_dgd, dv_o, dv_rstd,
                                         dv_gate, dv_onorm, (int64_t)N, H, K, OUT_EPS, dv_scratch);
        CHECK(st == LM_OK, "backward, bf16 d gate logits only: %s", lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
        float *g_dnorm4 = host_from(dv_dnorm, (size_t)K);
        CHECK(memcmp(g_dnorm, g_dnorm4, (size_t)K * 4) == 0, "do_norm differs with bf16 d gate logits only");
        CHECK(lm_cuda_download(h16, dv_dgate16, NHK * 2) == LM_OK, "download: %s", lm_last_error());
        bad16 = 0;
        for (size_t i = 0; i < NHK; i++) bad16 += h16[i] != lm_f32_to_bf16(g_dgate3[i]);
        CHECK(bad16 == 0, "(%d,%d,%d,%d,%d) %zu of %zu bf16-only d gate logits are not the fp32 path's rounded", s[0],
              s[1], s[2], s[3], s[4], bad16, NHK);
        /* the bf16 d gate logits as a column block of a wider operand (the layer's side-by-side input
         * gradients): rows ld apart from column 8 on, the same bits there, every other column untouched */
        {
            const size_t HK = (size_t)H * K, ld = HK + 24, wide = (size_t)N * ld;
            uint16_t *dv_wide = NULL, *hw = malloc(wide * 2);
            CHECK(lm_cuda_alloc((void **)&dv_wide, wide * 2) == LM_OK, "alloc: %s", lm_last_error());
            cudaMemset(dv_wide, 0xFF, wide * 2);
            CHECK(lm_cuda_upload(dv_dnorm, dnorm0, (size_t)K * 4) == LM_OK, "upload: %s", lm_last_error());
            st = lm_cuda_kda_output_backward(&ctx, dv_do16, NULL, NULL, dv_wide + 8, (int64_t)ld, dv_dnorm, dv_dgd,
                                             dv_o, dv_rstd, dv_gate, dv_onorm, (int64_t)N, H, K, OUT_EPS, dv_scratch);
            CHECK(st == LM_OK, "backward, strided bf16 d gate logits: %s", lm_last_error());
            CHECK(lm_cuda_download(hw, dv_wide, wide * 2) == LM_OK, "download: %s", lm_last_error());
            uint16_t *before = malloc(wide * 2);
            memset(before, 0xFF, wide * 2);
            size_t bad_in, bad_out;
            block_diffs(hw, before, h16, (size_t)N, ld, 8, HK, &bad_in, &bad_out);
            free(before);
            CHECK(bad_in == 0 && bad_out == 0,
                  "(%d,%d,%d,%d,%d) strided d gate logits: %zu values differ from the dense call's, %zu columns "
                  "outside the block written", s[0], s[1], s[2], s[3], s[4], bad_in, bad_out);
            CHECK(lm_cuda_kda_output_backward(&ctx, dv_do16, NULL, NULL, dv_wide, (int64_t)HK - 1, dv_dnorm, dv_dgd,
                                              dv_o, dv_rstd, dv_gate, dv_onorm, (int64_t)N, H, K, OUT_EPS,
                                              dv_scratch) == LM_ERR_ARG,
                  "an ld_dgate_bf16 below H*K accepted");
            lm_cuda_free(dv_wide);
            free(hw);
        }

        free(o), free(logits), free(o_norm), free(dgd), free(dnorm0), free(gated), free(rstd), free(gate);
        free(d_o), free(dgate), free(dnorm), free(g_do32), free(g_do16), free(g_dgate), free(g_dnorm);
        free(g_do32b), free(g_dgate2), free(g_dnorm2), free(g_dnorm3), free(g_dgate3), free(g_dnorm4), free(h16);
        lm_cuda_free(dv_o), lm_cuda_free(dv_gated), lm_cuda_free(dv_do16), lm_cuda_free(dv_logits);
        lm_cuda_free(dv_onorm), lm_cuda_free(dv_rstd), lm_cuda_free(dv_gate), lm_cuda_free(dv_dgd);
        lm_cuda_free(dv_do32), lm_cuda_free(dv_dgate), lm_cuda_free(dv_dnorm), lm_cuda_free(dv_scratch);
        lm_cuda_free(dv_dgate16);
    }
}

/* Unsupported head sizes, mismatched C and missing buffers are LM_ERR_ARG. */
static void test_rejects_bad_arguments(void) {
    float *f = dev_poisoned(1 << 16);
    uint16_t *b = dev_poisoned(1 << 16);
    CHECK(lm_cuda_short_conv_silu_forward(&ctx, f, b, f, f, f, 1, 4, 96, 4, 48) == LM_ERR_ARG,
          "head_dim 48 accepted");
    CHECK(lm_cuda_short_conv_silu_forward(&ctx, f, b, f, f, f, 1, 4, 96, 4, 64) == LM_ERR_ARG,
          "C not a multiple of head_dim accepted");
    CHECK(lm_cuda_short_conv_silu_forward(&ctx, f, b, f, f, f, 1, 4, 512, 4, 512) == LM_ERR_ARG,
          "head_dim 512 accepted");
    CHECK(lm_cuda_short_conv_silu_forward(&ctx, f, b, f, f, f, 1, 4, 64, 0, 32) == LM_ERR_ARG, "W 0 accepted");
    CHECK(lm_cuda_short_conv_silu_forward(&ctx, f, NULL, f, f, f, 1, 4, 64, 4, 32) == LM_ERR_ARG,
          "missing out_bf16 accepted");
    CHECK(lm_cuda_short_conv_silu_backward(&ctx, f, f, b, f, f, f, f, 1, 4, 64, 4, 32, NULL) == LM_ERR_ARG,
          "missing scratch accepted");
    CHECK(lm_cuda_kda_output_forward(&ctx, b, f, f, b, f, f, 4, 2, 40, OUT_EPS) == LM_ERR_ARG, "K 40 accepted");
    CHECK(lm_cuda_kda_output_backward(&ctx, NULL, NULL, f, NULL, 0, f, f, b, f, f, f, 4, 2, 64, OUT_EPS, f) ==
              LM_ERR_ARG,
          "no d_o output accepted");
    CHECK(lm_cuda_kda_output_backward(&ctx, b, NULL, NULL, NULL, 0, f, f, b, f, f, f, 4, 2, 64, OUT_EPS, f) ==
              LM_ERR_ARG,
          "no d gate logits output accepted");
    CHECK(lm_cuda_sigmoid_forward(NULL, f, f, 4) == LM_ERR_ARG, "missing context accepted");
    CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
    lm_cuda_free(f);
    lm_cuda_free(b);
}

int main(void) {
    test_skip_without_cuda();
    if (!test_skip_all_reason && lm_cuda_context_create(&ctx) != LM_OK) {
        fprintf(stderr, "no CUDA context: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_rejects_bad_arguments);
    RUN(test_short_conv_silu_forward_matches_cpu);
    RUN(test_short_conv_window_kernel_equals_row_kernel);
    RUN(test_short_conv_silu_backward_matches_cpu);
    RUN(test_short_conv_backward_ring_equals_fused);
    RUN(test_short_conv_backward_recompute_equals_saved);
    RUN(test_sigmoid_matches_cpu);
    RUN(test_output_forward_matches_cpu);
    RUN(test_output_backward_matches_cpu);
    lm_cuda_context_destroy(&ctx);
    return test_summary();
}
