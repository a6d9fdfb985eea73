/* The CUDA backend against the CPU backend, op by op (include/longmoe/backend.h):
 * both backends side by side in one program; every op of lm_ops gets fresh
 * random inputs (fp32 on the host; inputs in the product format rounded to
 * bf16 for both sides, so both compute on the same numbers), runs on each
 * backend, and the results are compared as ||got - want|| / ||want||, or for
 * accumulated outputs (+=, started from random non-zero values) as the same
 * error of the increments: 1e-5 for fp32-only results, 1e-2 for results
 * through bf16 (1e-4 / 1e-3 where a result is fp32 but its products' sums run
 * in another order, as in the operators' own tests). Outputs the CUDA op must
 * WRITE start from random values on the device, so an unwritten element fails.
 * The balancer's bias after lm_balance_step_end is bit-identical between
 * backends (K3, zoom; the exact estimator through the host fallback), and the
 * balance set's once-a-step counts equal the per-observation path's bits. Needs a
 * CUDA GPU (ctest label cuda); skips otherwise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/attention.h"
#include "longmoe/attnres.h"
#include "longmoe/backend.h"
#include "longmoe/balance.h"
#include "longmoe/kda.h"
#include "longmoe/moe.h"
#include "test.h"
#include "test_cuda.h"

static lm_backend *cpu, *gpu;

#define OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

#define TOL_F32 1e-5
#define TOL_BF16 1e-2

/* ---- buffers: host and device, freed at the end of each case ---- */

static void *host_list[512], *dev_list[512];
static int n_host, n_dev;

static void *hmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 4);
    if (p && n_host < 512) host_list[n_host++] = p;
    return p;
}

static void free_all(void) {
    for (int i = 0; i < n_host; i++) free(host_list[i]);
    for (int i = 0; i < n_dev; i++) gpu->release(gpu, dev_list[i]);
    n_host = n_dev = 0;
}

static void *dalloc(size_t bytes) {
    void *p = NULL;
    OK(gpu->alloc(gpu, bytes, &p));
    if (p && n_dev < 512) dev_list[n_dev++] = p;
    return p;
}

/* n normal values * scale (+ shift), rounded to bf16 when round != 0 */
static float *rnd(lm_rng *r, size_t n, double scale, double shift, int round) {
    float *x = hmalloc(n * sizeof(float));
    fill_normal(x, n, r, scale, shift, round);
    return x;
}

static float *copy_of(const float *x, size_t n) {
    float *y = hmalloc(n * sizeof(float));
    memcpy(y, x, n * sizeof(float));
    return y;
}

static float *up_f32(const float *h, size_t n) {
    float *d = dalloc(n * sizeof(float));
    OK(gpu->upload(gpu, d, h, n * sizeof(float)));
    return d;
}

static void *up_bf16(const float *h, size_t n) {
    uint16_t *b = hmalloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) b[i] = lm_f32_to_bf16(h[i]);
    void *d = dalloc(n * sizeof(uint16_t));
    OK(gpu->upload(gpu, d, b, n * sizeof(uint16_t)));
    return d;
}

static int32_t *up_i32(const int32_t *h, size_t n) {
    int32_t *d = dalloc(n * sizeof(int32_t));
    OK(gpu->upload(gpu, d, h, n * sizeof(int32_t)));
    return d;
}

static float *down_f32(const void *d, size_t n) {
    float *h = hmalloc(n * sizeof(float));
    OK(gpu->download(gpu, h, d, n * sizeof(float)));
    return h;
}

static float *down_bf16(const void *d, size_t n) {
    uint16_t *b = hmalloc(n * sizeof(uint16_t));
    float *h = hmalloc(n * sizeof(float));
    OK(gpu->download(gpu, b, d, n * sizeof(uint16_t)));
    for (size_t i = 0; i < n; i++) h[i] = lm_bf16_to_f32(b[i]);
    return h;
}

/* Whether the bf16 values at device d are the fp32 host values f rounded to
 * nearest even (lm_f32_to_bf16: what to_lp gives), bit for bit. */
static int lp_is_rounded(const void *d, const float *f, size_t n) {
    uint16_t *b = hmalloc(n * sizeof(uint16_t));
    OK(gpu->download(gpu, b, d, n * sizeof(uint16_t)));
    for (size_t i = 0; i < n; i++)
        if (b[i] != lm_f32_to_bf16(f[i])) return 0;
    return 1;
}

#define CMP(got, want, base, n, tol, what)                                                          \
    do {                                                                                            \
        double e_ = rel_err_increment((got), (want), (base), (n));                                 \
        CHECK(e_ <= (tol), "%s: relative error %.3g > %.3g", (what), e_, (double)(tol));            \
    } while (0)

/* ---- memory ---- */

static void test_memory_alloc_zero_copy_upload_download_round_trip(void) {
    lm_rng r;
    lm_rng_seed(&r, 1);
    const size_t n = 1000;
    float *a = rnd(&r, n, 1.0, 0.0, 0), *got = hmalloc(n * 4);
    float *d1 = dalloc(n * 4), *d2 = dalloc(n * 4);
    /* alloc returns zeroed memory */
    OK(gpu->download(gpu, got, d1, n * 4));
    int zero = 1;
    for (size_t i = 0; i < n; i++) zero &= got[i] == 0.0f;
    CHECK(zero, "alloc did not return zeroed memory");
    /* upload then download gives the same bits */
    OK(gpu->upload(gpu, d1, a, n * 4));
    OK(gpu->download(gpu, got, d1, n * 4));
    CHECK(!memcmp(got, a, n * 4), "upload/download round trip changed the data");
    /* copy, then zero a middle range of the source: the copy keeps the data (stream order) */
    OK(gpu->copy(gpu, d2, d1, n * 4));
    OK(gpu->zero(gpu, d1 + 100, 300 * 4));
    OK(gpu->download(gpu, got, d2, n * 4));
    CHECK(!memcmp(got, a, n * 4), "copy did not copy the data before the zero");
    OK(gpu->download(gpu, got, d1, n * 4));
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= (i >= 100 && i < 400) ? got[i] == 0.0f : got[i] == a[i];
    CHECK(ok, "zero of [100, 400) wrote outside its range or missed part of it");
    /* a host buffer reused right after upload: the first upload already landed */
    float *b = copy_of(a, n);
    OK(gpu->upload(gpu, d1, b, n * 4));
    for (size_t i = 0; i < n; i++) b[i] = -1.0f;
    OK(gpu->sync(gpu));
    OK(gpu->download(gpu, got, d1, n * 4));
    CHECK(!memcmp(got, a, n * 4), "upload returned before its data was on the device");
    CHECK(gpu->device == LM_DEVICE_CUDA && gpu->lp_bytes == 2, "device %d lp_bytes %zu", (int)gpu->device,
          gpu->lp_bytes);
    free_all();
}

/* ---- products ---- */

static void test_to_lp_and_matmul_match_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 2);
    const int64_t n = 150;
    const int ic = 96, oc = 80;
    /* to_lp: the same bits as the host rounding */
    float *x = rnd(&r, n * ic, 1.0, 0.0, 0);
    float *dx = up_f32(x, n * ic);
    void *dlp = dalloc(n * ic * 2);
    OK(gpu->ops->to_lp(gpu, dlp, dx, n * ic));
    float *lp = down_bf16(dlp, n * ic);
    int same = 1;
    for (int64_t i = 0; i < n * ic; i++) same &= lp[i] == bf16_round(x[i]);
    CHECK(same, "to_lp differs from lm_f32_to_bf16");
    CHECK(gpu->ops->to_lp(gpu, dx, dx, 16) == LM_ERR_ARG, "to_lp with dst == src accepted on the GPU");

    float *inp = rnd(&r, n * ic, 1.0, 0.0, 1), *w = rnd(&r, (size_t)oc * ic, 0.1, 0.0, 1);
    float *dout = rnd(&r, n * oc, 1.0, 0.0, 1);
    void *g_inp = up_bf16(inp, n * ic), *g_w = up_bf16(w, (size_t)oc * ic), *g_dout = up_bf16(dout, n * oc);
    /* forward (=): the device output starts from random values */
    float *out_c = hmalloc(n * oc * 4), *g_out = up_f32(rnd(&r, n * oc, 1.0, 0.0, 0), n * oc);
    OK(cpu->ops->matmul_forward(cpu, out_c, inp, w, n, ic, oc));
    OK(gpu->ops->matmul_forward(gpu, g_out, g_inp, g_w, n, ic, oc));
    CMP(down_f32(g_out, n * oc), out_c, NULL, n * oc, TOL_BF16, "matmul_forward out");
    /* in the product format: the fp32 product rounded once */
    void *g_out_lp = dalloc(n * oc * 2);
    OK(gpu->ops->matmul_forward_lp(gpu, g_out_lp, g_inp, g_w, n, ic, oc));
    CMP(down_bf16(g_out_lp, n * oc), out_c, NULL, n * oc, TOL_BF16, "matmul_forward_lp out");
    /* backward (+=) from random gradients */
    float *dinp0 = rnd(&r, n * ic, 0.5, 0.0, 0), *dw0 = rnd(&r, (size_t)oc * ic, 0.5, 0.0, 0);
    float *dinp_c = copy_of(dinp0, n * ic), *dw_c = copy_of(dw0, (size_t)oc * ic);
    float *g_dinp = up_f32(dinp0, n * ic), *g_dw = up_f32(dw0, (size_t)oc * ic);
    OK(cpu->ops->matmul_backward(cpu, dinp_c, dw_c, dout, inp, w, n, ic, oc));
    OK(gpu->ops->matmul_backward(gpu, g_dinp, g_dw, g_dout, g_inp, g_w, n, ic, oc));
    CMP(down_f32(g_dinp, n * ic), dinp_c, dinp0, n * ic, TOL_BF16, "matmul_backward dinp +=");
    CMP(down_f32(g_dw, (size_t)oc * ic), dw_c, dw0, (size_t)oc * ic, TOL_BF16, "matmul_backward dw +=");

    /* dout as a column block of a wider operand (rows L apart, from column 16): matmul_backward_ld with
     * dinp written (set 1) and added to (set 0), dw added to, against the CPU's product on the block */
    const int64_t L = oc + 24, c0 = 16;
    float *wide = rnd(&r, n * L, 1.0, 0.0, 1);
    float *blk = hmalloc(n * oc * 4);
    for (int64_t i = 0; i < n; i++) memcpy(blk + i * oc, wide + i * L + c0, (size_t)oc * 4);
    void *g_wide = up_bf16(wide, n * L);
    const void *g_blk = (const char *)g_wide + c0 * 2;
    for (int set = 0; set < 2; set++) {
        float *di_c = copy_of(dinp0, n * ic), *dw2_c = copy_of(dw0, (size_t)oc * ic);
        float *g_di = up_f32(dinp0, n * ic), *g_dw2 = up_f32(dw0, (size_t)oc * ic);
        if (set) OK(cpu->ops->matmul_backward_set(cpu, di_c, dw2_c, blk, inp, w, n, ic, oc));
        else OK(cpu->ops->matmul_backward(cpu, di_c, dw2_c, blk, inp, w, n, ic, oc));
        OK(gpu->ops->matmul_backward_ld(gpu, g_di, g_dw2, g_blk, L, g_inp, g_w, n, ic, oc, set));
        CMP(down_f32(g_di, n * ic), di_c, set ? NULL : dinp0, n * ic, TOL_BF16,
            set ? "matmul_backward_ld dinp (written)" : "matmul_backward_ld dinp +=");
        CMP(down_f32(g_dw2, (size_t)oc * ic), dw2_c, dw0, (size_t)oc * ic, TOL_BF16, "matmul_backward_ld dw +=");
    }
    CHECK(gpu->ops->matmul_backward_ld(gpu, g_dinp, NULL, g_blk, L - 4, g_inp, g_w, n, ic, oc, 1) == LM_ERR_ARG,
          "matmul_backward_ld with ld_dout not a multiple of 8 accepted");
    CHECK(gpu->ops->matmul_backward_ld(gpu, g_dinp, NULL, g_blk, oc - 8, g_inp, g_w, n, ic, oc, 1) == LM_ERR_ARG,
          "matmul_backward_ld with ld_dout < oc accepted");
    /* to_lp_rows: the block's bits are to_lp's, every other column untouched */
    float *src = rnd(&r, n * oc, 1.0, 0.0, 0);
    uint16_t *before = hmalloc(n * L * 2), *after = hmalloc(n * L * 2), *want = hmalloc(n * oc * 2);
    for (int64_t i = 0; i < n * oc; i++) want[i] = lm_f32_to_bf16(src[i]);
    OK(gpu->download(gpu, before, g_wide, n * L * 2));
    OK(gpu->ops->to_lp_rows(gpu, (char *)g_wide + c0 * 2, L, up_f32(src, n * oc), n, oc));
    OK(gpu->download(gpu, after, g_wide, n * L * 2));
    size_t bad_in, bad_out;
    block_diffs(after, before, want, (size_t)n, (size_t)L, (size_t)c0, (size_t)oc, &bad_in, &bad_out);
    CHECK(bad_in == 0 && bad_out == 0, "to_lp_rows: %zu values not to_lp's, %zu outside the block changed", bad_in,
          bad_out);
    CHECK(!cpu->ops->matmul_backward_ld && !cpu->ops->to_lp_rows,
          "the CPU offers the strided ops (its product format is the fp32 tensor itself)");
    free_all();
}

/* ---- norms, embedding, activations ---- */

static void test_rmsnorm_and_embedding_match_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 3);
    const int64_t n = 130;
    const int d = 192, vocab = 50;
    const float eps = 1e-6f;
    float *x = rnd(&r, n * d, 1.0, 0.3, 0), *w = rnd(&r, d, 0.2, 1.0, 0);
    float *out_c = hmalloc(n * d * 4), *rstd_c = hmalloc(n * 4);
    float *g_x = up_f32(x, n * d), *g_w = up_f32(w, d), *g_out = dalloc(n * d * 4), *g_rstd = dalloc(n * 4);
    void *g_lp = dalloc(n * d * 2);
    OK(cpu->ops->rmsnorm_forward(cpu, out_c, NULL, rstd_c, x, w, n, d, eps));
    OK(gpu->ops->rmsnorm_forward(gpu, g_out, g_lp, g_rstd, g_x, g_w, n, d, eps));
    CMP(down_f32(g_out, n * d), out_c, NULL, n * d, TOL_F32, "rmsnorm_forward out");
    CMP(down_bf16(g_lp, n * d), out_c, NULL, n * d, TOL_BF16, "rmsnorm_forward out_lp");
    CMP(down_f32(g_rstd, n), rstd_c, NULL, n, TOL_F32, "rmsnorm_forward rstd");

    float *dout = rnd(&r, n * d, 1.0, 0.0, 0), *dinp0 = rnd(&r, n * d, 0.5, 0.0, 0), *dw0 = rnd(&r, d, 0.5, 0.0, 0);
    float *dinp_c = copy_of(dinp0, n * d), *dw_c = copy_of(dw0, d);
    float *g_dout = up_f32(dout, n * d), *g_dinp = up_f32(dinp0, n * d), *g_dw = up_f32(dw0, d);
    OK(cpu->ops->rmsnorm_backward(cpu, dinp_c, dw_c, dout, x, w, rstd_c, n, d, eps));
    OK(gpu->ops->rmsnorm_backward(gpu, g_dinp, g_dw, g_dout, g_x, g_w, g_rstd, n, d, eps));
    CMP(down_f32(g_dinp, n * d), dinp_c, dinp0, n * d, TOL_F32, "rmsnorm_backward dinp +=");
    CMP(down_f32(g_dw, d), dw_c, dw0, d, TOL_F32, "rmsnorm_backward dw +=");

    /* embedding: repeated tokens, so rows of dtable sum several positions */
    int32_t *tok = hmalloc(n * 4);
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % vocab);
    float *table = rnd(&r, (size_t)vocab * d, 1.0, 0.0, 0), *emb_c = hmalloc(n * d * 4);
    int32_t *g_tok = up_i32(tok, n);
    float *g_table = up_f32(table, (size_t)vocab * d), *g_emb = up_f32(rnd(&r, n * d, 1.0, 0.0, 0), n * d);
    OK(cpu->ops->embedding_forward(cpu, emb_c, table, tok, n, d));
    OK(gpu->ops->embedding_forward(gpu, g_emb, g_table, g_tok, n, d));
    CMP(down_f32(g_emb, n * d), emb_c, NULL, n * d, 0.0, "embedding_forward (exact)");
    float *dt0 = rnd(&r, (size_t)vocab * d, 0.5, 0.0, 0), *dt_c = copy_of(dt0, (size_t)vocab * d);
    float *g_dt = up_f32(dt0, (size_t)vocab * d);
    OK(cpu->ops->embedding_backward(cpu, dt_c, dout, tok, n, d, vocab));
    OK(gpu->ops->embedding_backward(gpu, g_dt, g_dout, g_tok, n, d, vocab));
    CMP(down_f32(g_dt, (size_t)vocab * d), dt_c, dt0, (size_t)vocab * d, TOL_F32, "embedding_backward dtable +=");
    free_all();
}

static void test_glu_and_sigmoid_match_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 4);
    const size_t n = 150 * 96 + 7; /* not a multiple of a block */
    for (int act = 0; act < 2; act++) {
        const char *name = act == LM_EXPERT_SITU_GLU ? "situ-glu" : "swiglu";
        char what[96];
        float *a = rnd(&r, n, 2.0, 0.0, 0), *u = rnd(&r, n, 2.0, 0.0, 0), *dh = rnd(&r, n, 1.0, 0.0, 0);
        float *h_c = hmalloc(n * 4), *da_c = hmalloc(n * 4), *du_c = hmalloc(n * 4);
        float *g_a = up_f32(a, n), *g_u = up_f32(u, n), *g_dh = up_f32(dh, n);
        float *g_h = up_f32(rnd(&r, n, 1.0, 0.0, 0), n), *g_da = up_f32(rnd(&r, n, 1.0, 0.0, 0), n);
        float *g_du = up_f32(rnd(&r, n, 1.0, 0.0, 0), n);
        void *g_hlp = dalloc(n * 2);
        OK(cpu->ops->glu_forward(cpu, act, h_c, h_c, a, u, n));
        OK(gpu->ops->glu_forward(gpu, act, g_h, g_hlp, g_a, g_u, n));
        snprintf(what, sizeof what, "glu_forward %s h", name);
        CMP(down_f32(g_h, n), h_c, NULL, n, TOL_F32, what);
        snprintf(what, sizeof what, "glu_forward %s h_lp", name);
        CMP(down_bf16(g_hlp, n), h_c, NULL, n, TOL_BF16, what);
        OK(cpu->ops->glu_backward(cpu, act, da_c, du_c, NULL, NULL, dh, a, u, n));
        OK(gpu->ops->glu_backward(gpu, act, g_da, g_du, NULL, NULL, g_dh, g_a, g_u, n));
        snprintf(what, sizeof what, "glu_backward %s da", name);
        float *da_g = down_f32(g_da, n), *du_g = down_f32(g_du, n);
        CMP(da_g, da_c, NULL, n, TOL_F32, what);
        snprintf(what, sizeof what, "glu_backward %s du", name);
        CMP(du_g, du_c, NULL, n, TOL_F32, what);
        /* da, du in the product format only (the dense FFN's call): the fp32 call's values rounded, bit for
         * bit; with both outputs, the same fp32 bits and their rounding */
        void *g_dalp = up_bf16(rnd(&r, n, 1.0, 0.0, 0), n), *g_dulp = up_bf16(rnd(&r, n, 1.0, 0.0, 0), n);
        OK(gpu->ops->glu_backward(gpu, act, NULL, NULL, g_dalp, g_dulp, g_dh, g_a, g_u, n));
        CHECK(lp_is_rounded(g_dalp, da_g, n), "glu_backward %s da_lp only: not the fp32 da rounded", name);
        CHECK(lp_is_rounded(g_dulp, du_g, n), "glu_backward %s du_lp only: not the fp32 du rounded", name);
        float *g_da2 = up_f32(rnd(&r, n, 1.0, 0.0, 0), n), *g_du2 = up_f32(rnd(&r, n, 1.0, 0.0, 0), n);
        g_dalp = up_bf16(rnd(&r, n, 1.0, 0.0, 0), n);
        OK(gpu->ops->glu_backward(gpu, act, g_da2, g_du2, g_dalp, NULL, g_dh, g_a, g_u, n));
        CHECK(!memcmp(down_f32(g_da2, n), da_g, n * 4), "glu_backward %s da differs beside da_lp", name);
        CHECK(!memcmp(down_f32(g_du2, n), du_g, n * 4), "glu_backward %s du differs beside da_lp", name);
        CHECK(lp_is_rounded(g_dalp, da_g, n), "glu_backward %s da_lp beside da: not da rounded", name);
        CHECK(gpu->ops->glu_backward(gpu, act, NULL, g_du, NULL, NULL, g_dh, g_a, g_u, n) == LM_ERR_ARG,
              "glu_backward %s without any da output accepted", name);
        CHECK(gpu->ops->glu_backward(gpu, act, g_da, g_du, g_da, NULL, g_dh, g_a, g_u, n) == LM_ERR_ARG,
              "glu_backward %s with da_lp == da accepted on the GPU", name);
        /* the CPU's product format is fp32: da_lp receives da's values */
        float *da_c2 = hmalloc(n * 4), *du_c2 = hmalloc(n * 4);
        OK(cpu->ops->glu_backward(cpu, act, NULL, NULL, da_c2, du_c2, dh, a, u, n));
        CHECK(!memcmp(da_c2, da_c, n * 4) && !memcmp(du_c2, du_c, n * 4), "cpu glu_backward %s lp outputs", name);
    }
    /* sigmoid in place on both backends (out == in), backward in place (dlogit == dout) */
    float *x = rnd(&r, n, 3.0, 0.0, 0), *y_c = copy_of(x, n), *dout = rnd(&r, n, 1.0, 0.0, 0);
    float *g_y = up_f32(x, n), *g_d = up_f32(dout, n);
    OK(cpu->ops->sigmoid_forward(cpu, y_c, y_c, n));
    OK(gpu->ops->sigmoid_forward(gpu, g_y, g_y, n));
    CMP(down_f32(g_y, n), y_c, NULL, n, TOL_F32, "sigmoid_forward (in place)");
    float *dl_c = copy_of(dout, n);
    OK(cpu->ops->sigmoid_backward(cpu, dl_c, dl_c, y_c, n));
    OK(gpu->ops->sigmoid_backward(gpu, g_d, g_d, g_y, n));
    CMP(down_f32(g_d, n), dl_c, NULL, n, TOL_F32, "sigmoid_backward (dlogit == dout)");
    free_all();
}

/* ---- the LM head ---- */

static void test_cross_entropy_matches_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 5);
    const int64_t n = 150;
    const int d = 64, V = 300;
    float *hn = rnd(&r, n * d, 1.0, 0.0, 1), *head = rnd(&r, (size_t)V * d, 0.2, 0.0, 1);
    int32_t *tg = hmalloc(n * 4);
    for (int64_t i = 0; i < n; i++) tg[i] = (int32_t)(lm_rng_u64(&r) % V);
    float *row_scale = hmalloc(n * 4);
    for (int64_t i = 0; i < n; i++) row_scale[i] = (float)(0.5 + lm_rng_uniform(&r));
    size_t wc = cpu->ops->cross_entropy_work_bytes(cpu, n, d, V), wg = gpu->ops->cross_entropy_work_bytes(gpu, n, d, V);
    CHECK(wg > 0, "cross_entropy_work_bytes is 0");
    void *work_c = hmalloc(wc), *work_g = dalloc(wg);
    float *lse_c = hmalloc(n * 4), *tl_c = hmalloc(n * 4);
    double loss_c = 0, loss_g = 0;
    void *g_hn = up_bf16(hn, n * d), *g_head = up_bf16(head, (size_t)V * d);
    int32_t *g_tg = up_i32(tg, n);
    float *g_lse = up_f32(rnd(&r, n, 1.0, 0.0, 0), n), *g_tl = up_f32(rnd(&r, n, 1.0, 0.0, 0), n);
    float *g_rs = up_f32(row_scale, n);
    OK(cpu->ops->cross_entropy_forward(cpu, lse_c, tl_c, &loss_c, hn, head, tg, n, d, V, work_c));
    OK(gpu->ops->cross_entropy_forward(gpu, g_lse, g_tl, &loss_g, g_hn, g_head, g_tg, n, d, V, work_g));
    /* fp32 results of bf16 products summed in another order */
    CMP(down_f32(g_lse, n), lse_c, NULL, n, 1e-4, "cross_entropy_forward lse");
    CMP(down_f32(g_tl, n), tl_c, NULL, n, 1e-4, "cross_entropy_forward target_logit");
    CHECK_CLOSE(loss_g, loss_c, 0.0, 1e-4, "cross_entropy_forward loss_sum");

    const float scale = 1.0f / (float)n;
    float *dhn0 = rnd(&r, n * d, 0.01, 0.0, 0), *dhead0 = rnd(&r, (size_t)V * d, 0.01, 0.0, 0);
    float *dhn_c = copy_of(dhn0, n * d), *dhead_c = copy_of(dhead0, (size_t)V * d);
    float *g_dhn = up_f32(dhn0, n * d), *g_dhead = up_f32(dhead0, (size_t)V * d);
    OK(cpu->ops->cross_entropy_backward(cpu, dhn_c, dhead_c, hn, head, tg, lse_c, row_scale, scale, n, d, V, work_c));
    OK(gpu->ops->cross_entropy_backward(gpu, g_dhn, g_dhead, g_hn, g_head, g_tg, g_lse, g_rs, scale, n, d, V, work_g));
    CMP(down_f32(g_dhn, n * d), dhn_c, dhn0, n * d, TOL_BF16, "cross_entropy_backward dhn +=");
    CMP(down_f32(g_dhead, (size_t)V * d), dhead_c, dhead0, (size_t)V * d, TOL_BF16, "cross_entropy_backward dhead +=");
    free_all();
}

/* ---- gated attention ---- */

static void test_attention_and_gate_match_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 6);
    const int B = 2, T = 100, H = 4, Hkv = 2, D = 64;
    lm_attention_config cfg = lm_attention_config_default(B, T, H, Hkv, D, D);
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * Hkv * D, nr = (size_t)B * H * T;
    float *q = rnd(&r, nq, 1.0, 0.0, 1), *k = rnd(&r, nk, 1.0, 0.0, 1), *v = rnd(&r, nk, 1.0, 0.0, 1);
    float *o_c = hmalloc(nq * 4), *lse_c = hmalloc(nr * 4), *rm_c = hmalloc(nr * 4);
    void *g_q = up_bf16(q, nq), *g_k = up_bf16(k, nk), *g_v = up_bf16(v, nk), *g_o = dalloc(nq * 2);
    float *g_lse = dalloc(nr * 4), *g_rm = dalloc(nr * 4);
    OK(cpu->ops->attention_forward(cpu, &cfg, q, k, v, o_c, lse_c, rm_c));
    OK(gpu->ops->attention_forward(gpu, &cfg, g_q, g_k, g_v, g_o, g_lse, g_rm));
    float *o_g = down_bf16(g_o, nq);
    CMP(o_g, o_c, NULL, nq, TOL_BF16, "attention_forward o");
    CMP(down_f32(g_lse, nr), lse_c, NULL, nr, 1e-3, "attention_forward lse");
    float hm_c[4], hm_g[4];
    OK(cpu->ops->attention_head_max(cpu, &cfg, rm_c, hm_c));
    OK(gpu->ops->attention_head_max(gpu, &cfg, g_rm, hm_g));
    CMP(hm_g, hm_c, NULL, (size_t)H, 1e-3, "attention_head_max");

    /* backward: the CPU on the GPU's bf16 o (both sides see the same o) */
    float *d_o = rnd(&r, nq, 1.0, 0.0, 1);
    void *g_do = up_bf16(d_o, nq);
    float *dq_c = hmalloc(nq * 4), *dk_c = hmalloc(nk * 4), *dv_c = hmalloc(nk * 4);
    void *g_dq = up_bf16(rnd(&r, nq, 1.0, 0.0, 1), nq), *g_dk = up_bf16(rnd(&r, nk, 1.0, 0.0, 1), nk);
    void *g_dv = up_bf16(rnd(&r, nk, 1.0, 0.0, 1), nk);
    void *g_o2 = up_bf16(o_g, nq);
    OK(cpu->ops->attention_backward(cpu, &cfg, q, k, v, o_g, lse_c, d_o, dq_c, dk_c, dv_c));
    OK(gpu->ops->attention_backward(gpu, &cfg, g_q, g_k, g_v, g_o2, g_lse, g_do, g_dq, g_dk, g_dv));
    CMP(down_bf16(g_dq, nq), dq_c, NULL, nq, TOL_BF16, "attention_backward dq (written)");
    CMP(down_bf16(g_dk, nk), dk_c, NULL, nk, TOL_BF16, "attention_backward dk (written)");
    CMP(down_bf16(g_dv, nk), dv_c, NULL, nk, TOL_BF16, "attention_backward dv (written)");

    /* the queries of a later segment over all earlier keys (sequence segments): offset 0 is the plain call;
     * a later segment's runs the CUDA attention's offset form (lm_cuda_attention_forward_offset) */
    OK(gpu->ops->attention_forward_offset(gpu, &cfg, 0, g_q, g_k, g_v, g_o, g_lse, g_rm));
    CMP(down_bf16(g_o, nq), o_c, NULL, nq, TOL_BF16, "attention_forward_offset at 0: o");
    OK(gpu->ops->attention_backward_offset(gpu, &cfg, 0, g_q, g_k, g_v, g_o2, g_lse, g_do, g_dq, g_dk, g_dv));
    CMP(down_bf16(g_dk, nk), dk_c, NULL, nk, TOL_BF16, "attention_backward_offset at 0: dk");
    {
        const int off = 37, Tq = T - off; /* the last 63 queries of each row over all 100 keys */
        lm_attention_config c1 = lm_attention_config_default(1, Tq, H, Hkv, D, D);
        size_t nq1 = (size_t)Tq * H * D;
        float *o1 = hmalloc(nq1 * 4), *lse1 = hmalloc((size_t)H * Tq * 4);
        float *q1 = q + (size_t)off * H * D; /* row 0's queries from position 37 */
        OK(cpu->ops->attention_forward_offset(cpu, &c1, off, q1, k, v, o1, lse1, NULL));
        /* the CPU's offset form is the whole row's attention at those queries */
        CMP(o1, o_c + (size_t)off * H * D, NULL, nq1, TOL_F32, "cpu attention_forward_offset vs the whole row");
        void *g_o1 = dalloc(nq1 * 2);
        float *g_l1 = dalloc((size_t)H * Tq * 4);
        lm_status st = gpu->ops->attention_forward_offset(gpu, &c1, off, (char *)g_q + (size_t)off * H * D * 2, g_k, g_v,
                                                          g_o1, g_l1, NULL);
        CHECK(st == LM_OK, "attention_forward_offset %d: %s", off, lm_last_error());
        if (!st) {
            CMP(down_bf16(g_o1, nq1), o1, NULL, nq1, TOL_BF16, "attention_forward_offset o");
            CMP(down_f32(g_l1, (size_t)H * Tq), lse1, NULL, (size_t)H * Tq, 1e-3, "attention_forward_offset lse");
            /* backward at the offset: dq of the 63 queries, dk and dv of all 100 keys of row 0 */
            const size_t nk1 = (size_t)T * Hkv * D;
            float *dq1 = hmalloc(nq1 * 4), *dk1 = hmalloc(nk1 * 4), *dv1 = hmalloc(nk1 * 4);
            OK(cpu->ops->attention_backward_offset(cpu, &c1, off, q1, k, v, o1, lse1, d_o + (size_t)off * H * D,
                                                   dq1, dk1, dv1));
            void *g_dq1 = dalloc(nq1 * 2), *g_dk1 = dalloc(nk1 * 2), *g_dv1 = dalloc(nk1 * 2);
            OK(gpu->ops->attention_backward_offset(gpu, &c1, off, (char *)g_q + (size_t)off * H * D * 2, g_k, g_v,
                                                   g_o1, g_l1, (char *)g_do + (size_t)off * H * D * 2, g_dq1,
                                                   g_dk1, g_dv1));
            CMP(down_bf16(g_dq1, nq1), dq1, NULL, nq1, TOL_BF16, "attention_backward_offset dq");
            CMP(down_bf16(g_dk1, nk1), dk1, NULL, nk1, TOL_BF16, "attention_backward_offset dk");
            CMP(down_bf16(g_dv1, nk1), dv1, NULL, nk1, TOL_BF16, "attention_backward_offset dv");
        }
    }

    /* the MLA output gate on o */
    float *gp = rnd(&r, nq, 2.0, 0.0, 0), *gated_c = hmalloc(nq * 4), *dgated = rnd(&r, nq, 1.0, 0.0, 0);
    float *g_gp = up_f32(gp, nq), *g_gated = up_f32(rnd(&r, nq, 1.0, 0.0, 0), nq), *g_dgated = up_f32(dgated, nq);
    void *g_glp = dalloc(nq * 2);
    OK(cpu->ops->gate_forward(cpu, gated_c, gated_c, gp, o_g, nq));
    OK(gpu->ops->gate_forward(gpu, g_gated, g_glp, g_gp, g_o2, nq));
    CMP(down_f32(g_gated, nq), gated_c, NULL, nq, TOL_F32, "gate_forward gated");
    CMP(down_bf16(g_glp, nq), gated_c, NULL, nq, TOL_BF16, "gate_forward gated_lp");
    float *ddo_c = hmalloc(nq * 4), *dgp_c = hmalloc(nq * 4);
    void *g_ddo = up_bf16(rnd(&r, nq, 1.0, 0.0, 1), nq);
    float *g_dgp = up_f32(rnd(&r, nq, 1.0, 0.0, 0), nq);
    OK(cpu->ops->gate_backward(cpu, ddo_c, dgp_c, NULL, dgated, gp, o_g, nq));
    OK(gpu->ops->gate_backward(gpu, g_ddo, g_dgp, NULL, g_dgated, g_gp, g_o2, nq));
    CMP(down_bf16(g_ddo, nq), ddo_c, NULL, nq, TOL_BF16, "gate_backward d_o (written)");
    float *dgp_g = down_f32(g_dgp, nq);
    CMP(dgp_g, dgp_c, NULL, nq, TOL_F32, "gate_backward dgate_logits (written)");
    /* dgate_logits in the product format only (MLA's call): the fp32 call's values rounded, bit for bit;
     * with both, the same fp32 bits beside their rounding */
    void *g_dgplp = up_bf16(rnd(&r, nq, 1.0, 0.0, 0), nq);
    OK(gpu->ops->gate_backward(gpu, g_ddo, NULL, g_dgplp, g_dgated, g_gp, g_o2, nq));
    CHECK(lp_is_rounded(g_dgplp, dgp_g, nq), "gate_backward dgate_logits_lp only: not the fp32 values rounded");
    CMP(down_bf16(g_ddo, nq), ddo_c, NULL, nq, TOL_BF16, "gate_backward d_o beside dgate_logits_lp");
    float *g_dgp2 = up_f32(rnd(&r, nq, 1.0, 0.0, 0), nq);
    g_dgplp = up_bf16(rnd(&r, nq, 1.0, 0.0, 0), nq);
    OK(gpu->ops->gate_backward(gpu, g_ddo, g_dgp2, g_dgplp, g_dgated, g_gp, g_o2, nq));
    CHECK(!memcmp(down_f32(g_dgp2, nq), dgp_g, nq * 4), "gate_backward dgate_logits differ beside the lp copy");
    CHECK(lp_is_rounded(g_dgplp, dgp_g, nq), "gate_backward dgate_logits_lp beside fp32: not the values rounded");
    CHECK(gpu->ops->gate_backward(gpu, g_ddo, NULL, NULL, g_dgated, g_gp, g_o2, nq) == LM_ERR_ARG,
          "gate_backward without a dgate_logits output accepted");
    float *dgp_c2 = hmalloc(nq * 4);
    OK(cpu->ops->gate_backward(cpu, ddo_c, NULL, dgp_c2, dgated, gp, o_g, nq));
    CHECK(!memcmp(dgp_c2, dgp_c, nq * 4), "cpu gate_backward: the lp output differs from the fp32 one");
    free_all();
}

/* ---- the KDA token mixer's pieces ---- */

static void test_conv_silu_matches_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 7);
    const int B = 2, T = 100, C = 128, W = 4, hd = 64;
    size_t n = (size_t)B * T * C, rows = n / hd;
    float *in = rnd(&r, n, 1.0, 0.0, 0), *w = rnd(&r, (size_t)C * W, 0.5, 0.0, 0);
    float *conv_c = hmalloc(n * 4), *out_c = hmalloc(n * 4), *rn_c = hmalloc(rows * 4);
    float *g_in = up_f32(in, n), *g_w = up_f32(w, (size_t)C * W), *g_conv = dalloc(n * 4), *g_rn = dalloc(rows * 4);
    void *g_out = dalloc(n * 2);
    OK(cpu->ops->conv_silu_forward(cpu, conv_c, out_c, rn_c, in, w, B, T, C, W, hd));
    OK(gpu->ops->conv_silu_forward(gpu, g_conv, g_out, g_rn, g_in, g_w, B, T, C, W, hd));
    CMP(down_f32(g_conv, n), conv_c, NULL, n, TOL_F32, "conv_silu_forward conv_out");
    CMP(down_bf16(g_out, n), out_c, NULL, n, TOL_BF16, "conv_silu_forward out_lp");
    CMP(down_f32(g_rn, rows), rn_c, NULL, rows, TOL_F32, "conv_silu_forward rnorm");

    float *dout = rnd(&r, n, 1.0, 0.0, 1), *dw0 = rnd(&r, (size_t)C * W, 0.5, 0.0, 0);
    float *din_c = hmalloc(n * 4), *dw_c = copy_of(dw0, (size_t)C * W), *tmp_c = hmalloc(n * 4);
    void *g_dout = up_bf16(dout, n);
    float *g_din = up_f32(rnd(&r, n, 1.0, 0.0, 0), n), *g_dw = up_f32(dw0, (size_t)C * W), *g_tmp = dalloc(n * 4);
    OK(cpu->ops->conv_silu_backward(cpu, din_c, dw_c, dout, conv_c, out_c, rn_c, in, w, B, T, C, W, hd, tmp_c));
    OK(gpu->ops->conv_silu_backward(gpu, g_din, g_dw, g_dout, g_conv, g_out, g_rn, g_in, g_w, B, T, C, W, hd, g_tmp));
    CMP(down_f32(g_din, n), din_c, NULL, n, TOL_F32, "conv_silu_backward din (written)");
    CMP(down_f32(g_dw, (size_t)C * W), dw_c, dw0, (size_t)C * W, TOL_F32, "conv_silu_backward dw +=");
    free_all();
}

/* conv_out NULL (the KDA layer's call: the forward does not write it, the
 * backward recomputes it): the same operator input and 1/||.||, and din (fp32
 * from conv_silu_backward, lp from conv_silu_backward_lp) and dw (+=) of the
 * stored conv output, bit for bit, with and without the norm; on the one-pass
 * kernels' shapes (W <= 4, head_dim <= 128) and the two-pass path's (W 6,
 * head_dim 256: conv_silu_backward_lp through tmp); the lp din is the fp32 din
 * rounded. */
static void test_conv_silu_without_the_conv_output_equals_the_stored_one(void) {
    lm_rng r;
    lm_rng_seed(&r, 17);
    static const int shapes[][5] = {{3, 37, 128, 4, 64}, {1, 513, 256, 2, 128}, {2, 21, 96, 1, 32},
                                    {2, 45, 512, 6, 256}}; /* (B, T, C, W, head_dim) */
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int B = shapes[si][0], T = shapes[si][1], C = shapes[si][2], W = shapes[si][3], hd = shapes[si][4];
        const size_t n = (size_t)B * T * C, rows = n / hd, cw = (size_t)C * W;
        for (int norm = 1; norm >= 0; norm--) {
            float *in = rnd(&r, n, 1.0, 0.0, 0), *w = rnd(&r, cw, 0.5, 0.0, 0);
            float *dout = rnd(&r, n, 1.0, 0.0, 1), *dw0 = rnd(&r, cw, 0.5, 0.0, 0);
            float *g_in = up_f32(in, n), *g_w = up_f32(w, cw), *g_conv = dalloc(n * 4);
            float *g_rn = norm ? dalloc(rows * 4) : NULL, *g_rn2 = norm ? dalloc(rows * 4) : NULL;
            void *g_out = dalloc(n * 2), *g_out2 = dalloc(n * 2), *g_dout = up_bf16(dout, n);
            OK(gpu->ops->conv_silu_forward(gpu, g_conv, g_out, g_rn, g_in, g_w, B, T, C, W, hd));
            OK(gpu->ops->conv_silu_forward(gpu, NULL, g_out2, g_rn2, g_in, g_w, B, T, C, W, hd));
            CHECK(!memcmp(down_bf16(g_out, n), down_bf16(g_out2, n), n * 4),
                  "(%d,%d,%d,%d,%d) norm %d: conv_silu_forward out_lp differs without conv_out", B, T, C, W, hd, norm);
            if (norm)
                CHECK(!memcmp(down_f32(g_rn, rows), down_f32(g_rn2, rows), rows * 4),
                      "(%d,%d,%d,%d,%d): conv_silu_forward rnorm differs without conv_out", B, T, C, W, hd);
            float *din[2], *dw[2], *dwl[2];
            void *dinl[2];
            for (int rc = 0; rc < 2; rc++) {
                const float *conv = rc ? NULL : g_conv;
                float *g_din = up_f32(rnd(&r, n, 1.0, 0.0, 0), n), *g_dw = up_f32(dw0, cw), *g_tmp = dalloc(n * 4);
                OK(gpu->ops->conv_silu_backward(gpu, g_din, g_dw, g_dout, conv, g_out, g_rn, g_in, g_w, B, T, C, W,
                                                hd, g_tmp));
                din[rc] = down_f32(g_din, n), dw[rc] = down_f32(g_dw, cw);
                void *g_dinl = up_bf16(rnd(&r, n, 1.0, 0.0, 0), n);
                float *g_dwl = up_f32(dw0, cw);
                OK(gpu->ops->conv_silu_backward_lp(gpu, g_dinl, g_dwl, g_dout, conv, g_out, g_rn, g_in, g_w, B, T, C,
                                                   W, hd, C, g_tmp));
                dinl[rc] = g_dinl, dwl[rc] = down_f32(g_dwl, cw);
            }
            {
                /* din as the middle column block of a [B T, 3 C] operand (the KDA layer's q, k, v side by
                 * side): the dense din's bits there, the other columns untouched */
                const size_t rows_t = (size_t)B * T, w3 = 3 * (size_t)C;
                float *poison = rnd(&r, rows_t * w3, 1.0, 0.0, 1);
                void *g_wide = up_bf16(poison, rows_t * w3);
                float *g_dww = up_f32(dw0, cw), *g_tmp = dalloc(n * 4);
                OK(gpu->ops->conv_silu_backward_lp(gpu, (uint16_t *)g_wide + C, g_dww, g_dout, NULL, g_out, g_rn, g_in,
                                                   g_w, B, T, C, W, hd, (int)w3, g_tmp));
                uint16_t *wide = hmalloc(rows_t * w3 * 2), *dense = hmalloc(n * 2), *before = hmalloc(rows_t * w3 * 2);
                OK(gpu->download(gpu, wide, g_wide, rows_t * w3 * 2));
                OK(gpu->download(gpu, dense, dinl[1], n * 2));
                for (size_t i = 0; i < rows_t * w3; i++) before[i] = lm_f32_to_bf16(poison[i]);
                size_t bad, touched;
                block_diffs(wide, before, dense, rows_t, w3, (size_t)C, (size_t)C, &bad, &touched);
                CHECK(bad == 0 && touched == 0 && !memcmp(down_f32(g_dww, cw), dw[0], cw * 4),
                      "(%d,%d,%d,%d,%d) norm %d: conv_silu_backward_lp at row stride 3C: %zu values not the dense "
                      "din's, %zu values outside its columns written, or dw differs", B, T, C, W, hd, norm, bad,
                      touched);
            }
            CHECK(!memcmp(din[0], din[1], n * 4), "(%d,%d,%d,%d,%d) norm %d: conv_silu_backward din differs with the "
                  "conv recomputed", B, T, C, W, hd, norm);
            CHECK(!memcmp(dw[0], dw[1], cw * 4), "(%d,%d,%d,%d,%d) norm %d: conv_silu_backward dw differs with the "
                  "conv recomputed", B, T, C, W, hd, norm);
            CHECK(!memcmp(dwl[0], dw[0], cw * 4) && !memcmp(dwl[1], dw[0], cw * 4),
                  "(%d,%d,%d,%d,%d) norm %d: conv_silu_backward_lp dw differs", B, T, C, W, hd, norm);
            CHECK(lp_is_rounded(dinl[0], din[0], n) && lp_is_rounded(dinl[1], din[0], n),
                  "(%d,%d,%d,%d,%d) norm %d: conv_silu_backward_lp din is not the fp32 din rounded", B, T, C, W, hd,
                  norm);
            free_all();
        }
    }
}

static void test_kda_operator_matches_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 8);
    const int B = 1, T = 150, H = 2, K = 64;
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, K);
    size_t nt = (size_t)B * T * H, n = nt * K;
    float *q = hmalloc(n * 4), *k = hmalloc(n * 4);
    /* q and k L2-normalised per head, as the layer gives them */
    for (size_t i = 0; i < nt; i++) {
        double sq = 0, sk = 0;
        float tq[64], tk[64];
        for (int c = 0; c < K; c++) {
            tq[c] = (float)lm_rng_normal(&r);
            tk[c] = (float)lm_rng_normal(&r);
            sq += tq[c] * tq[c];
            sk += tk[c] * tk[c];
        }
        for (int c = 0; c < K; c++) {
            q[i * K + c] = bf16_round(tq[c] / (float)sqrt(sq));
            k[i * K + c] = bf16_round(tk[c] / (float)sqrt(sk));
        }
    }
    float *v = rnd(&r, n, 1.0, 0.0, 1), *z = rnd(&r, n, 1.0, 0.0, 1), *beta = hmalloc(nt * 4);
    for (size_t i = 0; i < nt; i++) beta[i] = (float)(0.1 + 0.8 * lm_rng_uniform(&r));
    float *A = rnd(&r, H, 0.3, 0.0, 0), *dt = rnd(&r, (size_t)H * K, 0.5, 0.0, 0);
    float *o_c = hmalloc(n * 4);
    void *g_q = up_bf16(q, n), *g_k = up_bf16(k, n), *g_v = up_bf16(v, n), *g_z = up_bf16(z, n);
    void *g_o = dalloc(n * 2);
    float *g_beta = up_f32(beta, nt), *g_A = up_f32(A, H), *g_dt = up_f32(dt, (size_t)H * K);
    OK(cpu->ops->kda_forward(cpu, &cfg, q, k, v, z, beta, A, dt, NULL, o_c, NULL));
    OK(gpu->ops->kda_forward(gpu, &cfg, g_q, g_k, g_v, g_z, g_beta, g_A, g_dt, NULL, g_o, NULL));
    CMP(down_bf16(g_o, n), o_c, NULL, n, TOL_BF16, "kda_forward o");

    float *d_o = rnd(&r, n, 1.0, 0.0, 1);
    float *dq_c = hmalloc(n * 4), *dk_c = hmalloc(n * 4), *dv_c = hmalloc(n * 4), *dz_c = hmalloc(n * 4);
    float *dbeta_c = hmalloc(nt * 4), *dA0 = rnd(&r, H, 0.5, 0.0, 0), *ddt0 = rnd(&r, (size_t)H * K, 0.5, 0.0, 0);
    float *dA_c = copy_of(dA0, H), *ddt_c = copy_of(ddt0, (size_t)H * K);
    void *g_do = up_bf16(d_o, n);
    void *g_dq = up_bf16(rnd(&r, n, 1.0, 0.0, 1), n), *g_dk = up_bf16(rnd(&r, n, 1.0, 0.0, 1), n);
    void *g_dv = up_bf16(rnd(&r, n, 1.0, 0.0, 1), n), *g_dz = up_bf16(rnd(&r, n, 1.0, 0.0, 1), n);
    float *g_dbeta = up_f32(rnd(&r, nt, 1.0, 0.0, 0), nt), *g_dA = up_f32(dA0, H), *g_ddt = up_f32(ddt0, (size_t)H * K);
    OK(cpu->ops->kda_backward(cpu, &cfg, q, k, v, z, beta, A, dt, NULL, d_o, NULL, dq_c, dk_c, dv_c, dz_c, dbeta_c, dA_c,
                              ddt_c, NULL));
    OK(gpu->ops->kda_backward(gpu, &cfg, g_q, g_k, g_v, g_z, g_beta, g_A, g_dt, NULL, g_do, NULL, g_dq, g_dk, g_dv, g_dz,
                              g_dbeta, g_dA, g_ddt, NULL));
    CMP(down_bf16(g_dq, n), dq_c, NULL, n, TOL_BF16, "kda_backward dq (written)");
    CMP(down_bf16(g_dk, n), dk_c, NULL, n, TOL_BF16, "kda_backward dk (written)");
    CMP(down_bf16(g_dv, n), dv_c, NULL, n, TOL_BF16, "kda_backward dv (written)");
    CMP(down_bf16(g_dz, n), dz_c, NULL, n, TOL_BF16, "kda_backward dz (written)");
    CMP(down_f32(g_dbeta, nt), dbeta_c, NULL, nt, TOL_BF16, "kda_backward dbeta (written)");
    CMP(down_f32(g_dA, H), dA_c, dA0, H, TOL_BF16, "kda_backward dA_log +=");
    /* ddt_bias = the sum over tokens of dz: a sum whose terms cancel, judged as
     * in test_cuda_kda against the sum of its terms' magnitudes (its condition) */
    {
        const size_t HK = (size_t)H * K;
        const float *g = down_f32(g_ddt, HK);
        double num = 0, den = 0, plain = 0;
        for (size_t j = 0; j < HK; j++) {
            double dg = (double)g[j] - ddt0[j], dc = (double)ddt_c[j] - ddt0[j], mag = 0;
            for (size_t t = 0; t < (size_t)B * T; t++) mag += fabs(dz_c[t * HK + j]);
            num += (dg - dc) * (dg - dc);
            den += mag * mag;
            plain += dc * dc;
        }
        printf("    kda_backward ddt_bias +=: error %.3e of its terms' magnitudes (%.3e of its norm)\n",
               sqrt(num / den), sqrt(num / plain));
        CHECK(sqrt(num / den) <= TOL_BF16, "kda_backward ddt_bias: error %.3e of its terms' magnitudes", sqrt(num / den));
    }

    /* with the states of sequence segments: h0 in, ht out; dht in, dh0 out (written) */
    const size_t ns = (size_t)B * H * K * K;
    float *h0 = rnd(&r, ns, 0.3, 0.0, 0), *ht_c = hmalloc(ns * 4), *dht = rnd(&r, ns, 0.3, 0.0, 0);
    float *dh0_c = hmalloc(ns * 4), *g_h0 = up_f32(h0, ns), *g_ht = dalloc(ns * 4), *g_dht = up_f32(dht, ns);
    float *g_dh0 = up_f32(rnd(&r, ns, 1.0, 0.0, 0), ns);
    OK(cpu->ops->kda_forward(cpu, &cfg, q, k, v, z, beta, A, dt, h0, o_c, ht_c));
    OK(gpu->ops->kda_forward(gpu, &cfg, g_q, g_k, g_v, g_z, g_beta, g_A, g_dt, g_h0, g_o, g_ht));
    CMP(down_bf16(g_o, n), o_c, NULL, n, TOL_BF16, "kda_forward o from h0");
    CMP(down_f32(g_ht, ns), ht_c, NULL, ns, TOL_BF16, "kda_forward ht from h0");
    OK(cpu->ops->kda_backward(cpu, &cfg, q, k, v, z, beta, A, dt, h0, d_o, dht, dq_c, dk_c, dv_c, dz_c, dbeta_c, dA_c,
                              ddt_c, dh0_c));
    OK(gpu->ops->kda_backward(gpu, &cfg, g_q, g_k, g_v, g_z, g_beta, g_A, g_dt, g_h0, g_do, g_dht, g_dq, g_dk, g_dv,
                              g_dz, g_dbeta, g_dA, g_ddt, g_dh0));
    CMP(down_bf16(g_dk, n), dk_c, NULL, n, TOL_BF16, "kda_backward dk with h0, dht");
    CMP(down_bf16(g_dv, n), dv_c, NULL, n, TOL_BF16, "kda_backward dv with h0, dht");
    CMP(down_f32(g_dh0, ns), dh0_c, NULL, ns, TOL_BF16, "kda_backward dh0 (written)");
    free_all();
}

/* acc += x, x fp32 or in the product format (sequence segments' gradient sums) */
static void test_accumulate_matches_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 18);
    const size_t n = 100003;
    float *acc0 = rnd(&r, n, 1.0, 0.0, 0), *x = rnd(&r, n, 1.0, 0.0, 1), *acc_c = copy_of(acc0, n);
    float *g_acc = up_f32(acc0, n), *g_x = up_f32(x, n);
    void *g_xl = up_bf16(x, n);
    OK(cpu->ops->accumulate(cpu, acc_c, x, n, 0));
    OK(gpu->ops->accumulate(gpu, g_acc, g_x, n, 0));
    CMP(down_f32(g_acc, n), acc_c, acc0, n, TOL_F32, "accumulate fp32 +=");
    OK(cpu->ops->accumulate(cpu, acc_c, x, n, 1)); /* x holds values bf16 holds exactly */
    OK(gpu->ops->accumulate(gpu, g_acc, g_xl, n, 1));
    CMP(down_f32(g_acc, n), acc_c, acc0, n, TOL_F32, "accumulate bf16 +=");
    free_all();
}

static void test_kda_output_stage_matches_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 9);
    const int64_t N = 150;
    const int H = 2, K = 64;
    const float eps = 1e-6f;
    size_t n = (size_t)N * H * K, rows = (size_t)N * H;
    float *gl = rnd(&r, n, 2.0, 0.0, 0), *o = rnd(&r, n, 1.0, 0.0, 1), *onorm = rnd(&r, K, 0.2, 1.0, 0);
    float *gated_c = hmalloc(n * 4), *rstd_c = hmalloc(rows * 4), *gate_c = hmalloc(n * 4);
    float *g_gl = up_f32(gl, n), *g_onorm = up_f32(onorm, K), *g_gated = up_f32(rnd(&r, n, 1.0, 0.0, 0), n);
    float *g_rstd = dalloc(rows * 4), *g_gate = dalloc(n * 4);
    void *g_o = up_bf16(o, n), *g_glp = dalloc(n * 2);
    OK(cpu->ops->kda_output_forward(cpu, gated_c, gated_c, rstd_c, gate_c, gl, o, onorm, N, H, K, eps));
    OK(gpu->ops->kda_output_forward(gpu, g_gated, g_glp, g_rstd, g_gate, g_gl, g_o, g_onorm, N, H, K, eps));
    CMP(down_f32(g_gated, n), gated_c, NULL, n, TOL_BF16, "kda_output_forward gated (the bf16 values)");
    CMP(down_bf16(g_glp, n), gated_c, NULL, n, TOL_BF16, "kda_output_forward gated_lp");
    CMP(down_f32(g_rstd, rows), rstd_c, NULL, rows, TOL_F32, "kda_output_forward o_rstd");
    CMP(down_f32(g_gate, n), gate_c, NULL, n, TOL_F32, "kda_output_forward gate");
    /* gated may be NULL on the GPU, and gate may overwrite gate_logits */
    OK(gpu->ops->kda_output_forward(gpu, NULL, g_glp, g_rstd, g_gl, g_gl, g_o, g_onorm, N, H, K, eps));
    CMP(down_f32(g_gl, n), gate_c, NULL, n, TOL_F32, "kda_output_forward gate in place");

    float *dg = rnd(&r, n, 1.0, 0.0, 0), *dn0 = rnd(&r, K, 0.5, 0.0, 0);
    float *do_c = hmalloc(n * 4), *dgl_c = hmalloc(n * 4), *dn_c = copy_of(dn0, K), *tmp_c = hmalloc(n * 4);
    float *g_dg = up_f32(dg, n), *g_dgl = up_f32(rnd(&r, n, 1.0, 0.0, 0), n), *g_dn = up_f32(dn0, K);
    void *g_do = up_bf16(rnd(&r, n, 1.0, 0.0, 1), n);
    float *g_tmp = dalloc(n * 4);
    OK(cpu->ops->kda_output_backward(cpu, do_c, dgl_c, NULL, 0, dn_c, dg, o, rstd_c, gate_c, onorm, N, H, K, eps,
                                     tmp_c));
    OK(gpu->ops->kda_output_backward(gpu, g_do, g_dgl, NULL, 0, g_dn, g_dg, g_o, g_rstd, g_gate, g_onorm, N, H, K, eps,
                                     g_tmp));
    CMP(down_bf16(g_do, n), do_c, NULL, n, TOL_BF16, "kda_output_backward d_o (written)");
    float *dgl_g = down_f32(g_dgl, n), *dn_g = down_f32(g_dn, K);
    CMP(dgl_g, dgl_c, NULL, n, TOL_F32, "kda_output_backward dgate_logits (written)");
    CMP(dn_g, dn_c, dn0, K, TOL_F32, "kda_output_backward do_norm +=");
    /* dgate_logits in the product format only (the KDA layer's call): the fp32 call's values rounded, bit
     * for bit; d_o and the do_norm increment the same bits */
    void *g_dgllp = up_bf16(rnd(&r, n, 1.0, 0.0, 0), n), *g_do2 = up_bf16(rnd(&r, n, 1.0, 0.0, 1), n);
    float *g_dn2 = up_f32(dn0, K);
    OK(gpu->ops->kda_output_backward(gpu, g_do2, NULL, g_dgllp, 0, g_dn2, g_dg, g_o, g_rstd, g_gate, g_onorm, N, H, K,
                                     eps, g_tmp));
    CHECK(lp_is_rounded(g_dgllp, dgl_g, n), "kda_output_backward dgate_logits_lp only: not the fp32 values rounded");
    CHECK(!memcmp(down_f32(g_dn2, K), dn_g, (size_t)K * 4), "kda_output_backward do_norm differs beside the lp copy");
    CHECK(!memcmp(down_bf16(g_do2, n), down_bf16(g_do, n), n * 4),
          "kda_output_backward d_o differs beside the lp copy");
    CHECK(gpu->ops->kda_output_backward(gpu, g_do2, NULL, NULL, 0, g_dn2, g_dg, g_o, g_rstd, g_gate, g_onorm, N, H, K,
                                        eps, g_tmp) == LM_ERR_ARG,
          "kda_output_backward without a dgate_logits output accepted");
    CHECK(gpu->ops->kda_output_backward(gpu, g_do2, g_dgl, g_dgl, 0, g_dn2, g_dg, g_o, g_rstd, g_gate, g_onorm, N, H, K,
                                        eps, g_tmp) == LM_ERR_ARG,
          "kda_output_backward with dgate_logits_lp == dgate_logits accepted on the GPU");
    float *dgl_c2 = hmalloc(n * 4), *do_c2 = hmalloc(n * 4), *dn_c2 = copy_of(dn0, K);
    OK(cpu->ops->kda_output_backward(cpu, do_c2, NULL, dgl_c2, 0, dn_c2, dg, o, rstd_c, gate_c, onorm, N, H, K, eps,
                                     tmp_c));
    CHECK(!memcmp(dgl_c2, dgl_c, n * 4), "cpu kda_output_backward: the lp output differs from the fp32 one");
    free_all();
}

/* ---- the MoE layer and its balancing ---- */

typedef struct {
    lm_moe_config cfg;
    int64_t m;
    size_t count;
    float *params, *x;                    /* host (bf16-representable) */
    lm_moe_params hp;                     /* host fp32 */
    lm_moe_params gp, gp_lp;              /* device fp32, device bf16 (typed float *) */
    float *g_x;
    void *acts_c, *acts_g;
} moe_fixture;

static void moe_setup(moe_fixture *f, lm_rng *r, int64_t m) {
    memset(f, 0, sizeof *f);
    lm_moe_config c = lm_moe_config_default(128, 16, 4, 64);
    c.d_latent = 64;
    c.n_shared = 1;
    c.d_ff_shared = 96;
    c.act = LM_EXPERT_SITU_GLU;
    f->cfg = c;
    f->m = m;
    f->count = lm_moe_param_count(&c);
    f->params = rnd(r, f->count, 0.08, 0.0, 1);
    lm_moe_params_carve(&c, f->params, &f->hp);
    /* router rows spread so that each token's scores are well apart */
    for (size_t i = 0; i < (size_t)c.n_experts * c.d; i++) f->hp.router[i] = bf16_round((float)(0.3 * lm_rng_normal(r)));
    for (int i = 0; i < c.d_latent; i++) f->hp.lat_norm[i] = bf16_round((float)(1.0 + 0.2 * lm_rng_normal(r)));
    float *g_params = up_f32(f->params, f->count);
    uint16_t *g_bf = up_bf16(f->params, f->count);
    lm_moe_params_carve(&c, g_params, &f->gp);
    float *const *src = &f->hp.router;
    float **dst = &f->gp_lp.router;
    for (int i = 0; i < 10; i++) dst[i] = src[i] ? (float *)(void *)(g_bf + (src[i] - f->params)) : NULL;
    f->x = rnd(r, (size_t)m * c.d, 1.0, 0.0, 1);
    f->g_x = up_f32(f->x, (size_t)m * c.d);
    OK(cpu->ops->moe_acts_create(cpu, &c, m, &f->acts_c));
    OK(gpu->ops->moe_acts_create(gpu, &c, m, &f->acts_g));
}

static void moe_teardown(moe_fixture *f) {
    cpu->ops->moe_acts_free(cpu, f->acts_c);
    gpu->ops->moe_acts_free(gpu, f->acts_g);
}

/* top-k of each row of s [m, n] (ties to the lower index), as the router picks with b = 0 */
static void host_topk(int32_t *idx, const float *s, int64_t m, int n, int k) {
    for (int64_t i = 0; i < m; i++)
        for (int t = 0; t < k; t++) {
            int best = -1;
            for (int j = 0; j < n; j++) {
                int taken = 0;
                for (int u = 0; u < t; u++) taken |= idx[i * k + u] == j;
                if (!taken && (best < 0 || s[i * n + j] > s[i * n + best])) best = j;
            }
            idx[i * k + t] = best;
        }
}

static void test_moe_forward_backward_and_aux_loss_match_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 10);
    moe_fixture f;
    moe_setup(&f, &r, 96);
    const lm_moe_config *c = &f.cfg;
    int n = c->n_experts, k = c->top_k, d = c->d;
    size_t md = (size_t)f.m * d, mn = (size_t)f.m * n;
    float *y_c = hmalloc(md * 4), *g_y = up_f32(rnd(&r, md, 1.0, 0.0, 0), md);
    OK(cpu->ops->moe_forward(cpu, y_c, f.x, NULL, NULL, c, &f.hp, &f.hp, f.acts_c, f.m));
    OK(gpu->ops->moe_forward(gpu, g_y, f.g_x, NULL, NULL, c, &f.gp, &f.gp_lp, f.acts_g, f.m));
    float *s_c = cpu->ops->moe_scores(cpu, f.acts_c), *s_g = down_f32(gpu->ops->moe_scores(gpu, f.acts_g), mn);
    CMP(s_g, s_c, NULL, mn, TOL_F32, "moe scores (fp32 router)");
    int32_t *t_c = hmalloc((size_t)f.m * k * 4), *t_g = hmalloc((size_t)f.m * k * 4);
    host_topk(t_c, s_c, f.m, n, k);
    host_topk(t_g, s_g, f.m, n, k);
    int64_t differ = 0;
    for (int64_t i = 0; i < f.m * k; i++) differ += t_c[i] != t_g[i];
    CHECK(differ == 0, "moe: %lld routing slots differ (a near-tie in the scores?)", (long long)differ);
    CMP(down_f32(g_y, md), y_c, NULL, md, TOL_BF16, "moe_forward y");

    /* backward from random non-zero gradients, with an extra score gradient */
    float *dy = rnd(&r, md, 1.0, 0.0, 1), *extra = rnd(&r, mn, 0.5, 0.0, 0);
    float *dx0 = rnd(&r, md, 0.1, 0.0, 0), *g0 = rnd(&r, f.count, 0.01, 0.0, 0);
    float *dx_c = copy_of(dx0, md), *gr_c = copy_of(g0, f.count);
    float *g_dy = up_f32(dy, md), *g_extra = up_f32(extra, mn), *g_dx = up_f32(dx0, md), *g_gr = up_f32(g0, f.count);
    lm_moe_params hg, gg;
    lm_moe_params_carve(c, gr_c, &hg);
    lm_moe_params_carve(c, g_gr, &gg);
    OK(cpu->ops->moe_backward(cpu, dx_c, &hg, dy, NULL, f.x, extra, c, &f.hp, &f.hp, f.acts_c, 0));
    OK(gpu->ops->moe_backward(gpu, g_dx, &gg, g_dy, NULL, f.g_x, g_extra, c, &f.gp, &f.gp_lp, f.acts_g, 0));
    CMP(down_f32(g_dx, md), dx_c, NULL, md, TOL_BF16, "moe_backward dx (written over dx0)");
    float *gr_g = down_f32(g_gr, f.count);
    /* each parameter's gradient on its own: [offset of field i, offset of the next field) */
    static const char *const names[10] = {"router", "gate", "up", "down", "lat_down",
                                          "lat_norm", "lat_up", "shared_gate", "shared_up", "shared_down"};
    float *const *fields = &hg.router;
    for (int i = 0; i < 10; i++) {
        if (!fields[i]) continue;
        size_t off = (size_t)(fields[i] - gr_c), end = f.count;
        for (int j = 0; j < 10; j++)
            if (fields[j] && (size_t)(fields[j] - gr_c) > off && (size_t)(fields[j] - gr_c) < end)
                end = (size_t)(fields[j] - gr_c);
        char what[64];
        snprintf(what, sizeof what, "moe_backward d%s +=", names[i]);
        CMP(gr_g + off, gr_c + off, g0 + off, end - off, TOL_BF16, what);
    }
    {
        /* expert_grads_set on both backends: gate, up, down (NaN before) written, the rest added to g0 */
        const size_t e0 = (size_t)(fields[1] - gr_c), per = (size_t)(fields[2] - fields[1]);
        const size_t e1 = e0 + 3 * per; /* gate, up, down: consecutive, of one size (the carve) */
        CHECK(fields[3] - fields[2] == (ptrdiff_t)per && e1 <= f.count, "moe: the expert gradients' layout");
        float *gs_c = copy_of(g0, f.count), *g_gs = up_f32(g0, f.count), *nan_h = hmalloc(per * 3 * 4);
        for (size_t q = 0; q < 3 * per; q++) nan_h[q] = NAN;
        memcpy(gs_c + e0, nan_h, 3 * per * 4);
        OK(lm_cuda_upload(g_gs + e0, nan_h, 3 * per * 4));
        lm_moe_params hs, gs;
        lm_moe_params_carve(c, gs_c, &hs);
        lm_moe_params_carve(c, g_gs, &gs);
        OK(cpu->ops->moe_backward(cpu, dx_c, &hs, dy, NULL, f.x, extra, c, &f.hp, &f.hp, f.acts_c, 1));
        OK(gpu->ops->moe_backward(gpu, g_dx, &gs, g_dy, NULL, f.g_x, g_extra, c, &f.gp, &f.gp_lp, f.acts_g, 1));
        float *gs_g = down_f32(g_gs, f.count);
        /* the CPU: the bits of the accumulating call on zeroed expert gradients (the rest g0) */
        float *gz_c = copy_of(g0, f.count);
        memset(gz_c + e0, 0, 3 * per * 4);
        lm_moe_params hz;
        lm_moe_params_carve(c, gz_c, &hz);
        OK(cpu->ops->moe_backward(cpu, dx_c, &hz, dy, NULL, f.x, extra, c, &f.hp, &f.hp, f.acts_c, 0));
        CHECK(!memcmp(gs_c, gz_c, f.count * 4), "moe_backward expert_grads_set on the CPU: not the bits of zeroing "
              "and adding");
        for (int i = 1; i <= 3; i++) {
            char what[64];
            snprintf(what, sizeof what, "moe_backward d%s written (expert_grads_set)", names[i]);
            CMP(gs_g + e0 + (size_t)(i - 1) * per, gs_c + e0 + (size_t)(i - 1) * per, NULL, per, TOL_BF16, what);
        }
        /* the GPU's other gradients: the accumulating call's bits */
        CHECK(!memcmp(gs_g, gr_g, e0 * 4) && !memcmp(gs_g + e1, gr_g + e1, (f.count - e1) * 4),
              "moe_backward expert_grads_set: a gradient other than the experts' differs from the accumulating call's");
    }

    /* the auxiliary loss on each backend's scores (fp32: equal to 1e-5) */
    float loss_c = 0, loss_g = 0;
    float *ds_c = hmalloc(mn * 4), *g_ds = up_f32(rnd(&r, mn, 1.0, 0.0, 0), mn);
    OK(cpu->ops->moe_aux_loss(cpu, &loss_c, ds_c, f.acts_c, f.m, n, k, 1e-2f));
    OK(gpu->ops->moe_aux_loss(gpu, &loss_g, g_ds, f.acts_g, f.m, n, k, 1e-2f));
    CHECK_CLOSE(loss_g, loss_c, 0.0, TOL_F32, "moe_aux_loss loss");
    CMP(down_f32(g_ds, mn), ds_c, NULL, mn, TOL_F32, "moe_aux_loss dscores (written)");

    /* x_lp given (the model passes its RMSNorm's product-format copy; here to_lp's, the same
     * rounding), and dy_lp to the backward (the model passes the AttnRes state's copy): y, dx
     * and every gradient have the bits of the run that converted x and dy itself */
    float *y1 = down_f32(g_y, md), *dx1 = down_f32(g_dx, md);
    void *g_xlp = dalloc(md * 2), *g_dylp = dalloc(md * 2);
    OK(gpu->ops->to_lp(gpu, g_xlp, f.g_x, md));
    OK(gpu->ops->to_lp(gpu, g_dylp, g_dy, md));
    float *g_y2 = up_f32(rnd(&r, md, 1.0, 0.0, 0), md), *g_dx2 = up_f32(dx0, md), *g_gr2 = up_f32(g0, f.count);
    lm_moe_params gg2;
    lm_moe_params_carve(c, g_gr2, &gg2);
    OK(gpu->ops->moe_forward(gpu, g_y2, f.g_x, g_xlp, NULL, c, &f.gp, &f.gp_lp, f.acts_g, f.m));
    OK(gpu->ops->moe_backward(gpu, g_dx2, &gg2, g_dy, g_dylp, f.g_x, g_extra, c, &f.gp, &f.gp_lp, f.acts_g, 0));
    CHECK(!memcmp(down_f32(g_y2, md), y1, md * 4), "moe_forward with x_lp: y differs from the own conversion's");
    CHECK(!memcmp(down_f32(g_dx2, md), dx1, md * 4), "moe_backward after x_lp, with dy_lp: dx differs");
    CHECK(!memcmp(down_f32(g_gr2, f.count), gr_g, f.count * 4), "moe_backward after x_lp, with dy_lp: gradients differ");
    CHECK(gpu->ops->moe_forward(gpu, g_y2, f.g_x, f.g_x, NULL, c, &f.gp, &f.gp_lp, f.acts_g, f.m) == LM_ERR_ARG,
          "moe_forward accepted x_lp aliasing the fp32 x");
    moe_teardown(&f);
    free_all();
}

/* Two training steps of the balancer fed through each backend with the same
 * scores (the CPU's, uploaded into the GPU's score buffer): b must be the same bits. */
static void balance_case(lm_balance_mode mode, lm_qb_estimator est, const char *what) {
    lm_rng r;
    lm_rng_seed(&r, 11 + (uint64_t)est);
    moe_fixture f;
    moe_setup(&f, &r, 120);
    const lm_moe_config *c = &f.cfg;
    int n = c->n_experts, k = c->top_k;
    size_t md = (size_t)f.m * c->d, mn = (size_t)f.m * n;
    lm_balance_config bc = lm_balance_config_default(mode, n, k, f.m);
    bc.estimator = est;
    bc.bins = 256;
    lm_balance_state bal_c, bal_g;
    OK(lm_balance_init(&bal_c, &bc));
    OK(lm_balance_init(&bal_g, &bc));
    float *y_c = hmalloc(md * 4), *g_y = dalloc(md * 4);
    for (int step = 0; step < 2; step++) {
        /* route with each state's b (equal), as the model does */
        OK(cpu->ops->moe_forward(cpu, y_c, f.x, NULL, bal_c.bias, c, &f.hp, &f.hp, f.acts_c, f.m));
        OK(gpu->ops->moe_forward(gpu, g_y, f.g_x, NULL, bal_g.bias, c, &f.gp, &f.gp_lp, f.acts_g, f.m));
        OK(gpu->upload(gpu, gpu->ops->moe_scores(gpu, f.acts_g), cpu->ops->moe_scores(cpu, f.acts_c), mn * 4));
        OK(cpu->ops->moe_balance_observe(cpu, &bal_c, f.acts_c, f.m));
        OK(gpu->ops->moe_balance_observe(gpu, &bal_g, f.acts_g, f.m));
        lm_balance_stats st_c, st_g;
        OK(lm_balance_step_end(&bal_c, 1, &st_c));
        OK(lm_balance_step_end(&bal_g, 1, &st_g));
        CHECK(!memcmp(bal_c.bias, bal_g.bias, (size_t)n * 4), "%s step %d: the bias differs between backends", what,
              step);
        CHECK(st_c.tokens == st_g.tokens && st_c.updated == st_g.updated, "%s step %d: tokens %lld/%lld", what, step,
              (long long)st_c.tokens, (long long)st_g.tokens);
        /* the load is the forward's routing on the GPU: equal unless a score near-tie */
        int64_t diff = 0;
        for (int j = 0; j < n; j++) diff += labs((long)st_c.load[j] - (long)st_g.load[j]);
        CHECK(diff <= 2, "%s step %d: loads differ by %lld", what, step, (long long)diff);
        CHECK_CLOSE(st_g.router_entropy, st_c.router_entropy, 0.0, 1e-4, "router entropy");
        if (mode == LM_BALANCE_QUANTILE) CHECK(st_c.updated, "%s step %d: b was not updated", what, step);
    }
    lm_balance_free(&bal_c);
    lm_balance_free(&bal_g);
    moe_teardown(&f);
    free_all();
}

static void test_balance_observe_gives_the_cpu_bias_k3(void) { balance_case(LM_BALANCE_QUANTILE, LM_QB_HISTOGRAM, "K3"); }
static void test_balance_observe_gives_the_cpu_bias_zoom(void) { balance_case(LM_BALANCE_QUANTILE, LM_QB_ZOOM, "zoom"); }
static void test_balance_observe_gives_the_cpu_bias_exact_fallback(void) {
    balance_case(LM_BALANCE_QUANTILE, LM_QB_EXACT, "exact");
}
static void test_balance_observe_gives_the_cpu_bias_sign_fallback(void) {
    balance_case(LM_BALANCE_SIGN, LM_QB_HISTOGRAM, "sign");
}

/* The balance set (moe_balance_set_*): a step's observations counted on the
 * device and taken by the host at the flush. Two steps of two observations
 * each (the second of 120 - 17 tokens, its scores the first's rows reversed),
 * against the per-observation path (moe_balance_observe, which downloads at
 * each call) on the same scores: after the flush the counts, loads and tokens
 * are the same integers and the entropy sum the same bits (each token's
 * entropy a multiple of 2^-32: the fixed-point sum is exact), and after
 * lm_balance_step_end b and the stats are the same bits. Balancer 1 of the
 * set is a sign balancer (the host fallback inside the set), held to its
 * per-observation twin too. Then a score of 1.5 (outside [0, 1]) at token 7
 * and a NaN at token 3 of a step's second observation: both observations
 * return LM_OK, the flush LM_ERR_NUMERIC naming MoE layer 0, observation 1
 * and token 3; the next step's observation and flush succeed. */
static void balance_set_case(lm_qb_estimator est, const char *what) {
    lm_rng r;
    lm_rng_seed(&r, 31 + (uint64_t)est);
    moe_fixture f;
    moe_setup(&f, &r, 120);
    const lm_moe_config *c = &f.cfg;
    int n = c->n_experts, k = c->top_k;
    size_t md = (size_t)f.m * c->d, mn = (size_t)f.m * n;
    lm_balance_config bq = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, f.m);
    bq.estimator = est;
    bq.bins = 256;
    lm_balance_config bs = lm_balance_config_default(LM_BALANCE_SIGN, n, k, f.m);
    lm_balance_state ref, set_q, ref_s, set_s;
    OK(lm_balance_init(&ref, &bq));
    OK(lm_balance_init(&set_q, &bq));
    OK(lm_balance_init(&ref_s, &bs));
    OK(lm_balance_init(&set_s, &bs));
    lm_balance_state *members[2] = {&set_q, &set_s};
    void *set = NULL;
    OK(gpu->ops->moe_balance_set_create(gpu, members, 2, &set));
    CHECK(set != NULL, "%s: no set", what);
    float *y_c = hmalloc(md * 4), *g_y = dalloc(md * 4), *rev = hmalloc(mn * 4);
    const int64_t m2 = f.m - 17;
    for (int step = 0; step < 2 && set; step++) {
        OK(cpu->ops->moe_forward(cpu, y_c, f.x, NULL, ref.bias, c, &f.hp, &f.hp, f.acts_c, f.m));
        OK(gpu->ops->moe_forward(gpu, g_y, f.g_x, NULL, ref.bias, c, &f.gp, &f.gp_lp, f.acts_g, f.m));
        const float *sc = cpu->ops->moe_scores(cpu, f.acts_c);
        for (int64_t i = 0; i < f.m; i++) memcpy(rev + i * n, sc + (f.m - 1 - i) * n, (size_t)n * 4);
        for (int obs = 0; obs < 2; obs++) {
            int64_t m = obs ? m2 : f.m;
            OK(gpu->upload(gpu, gpu->ops->moe_scores(gpu, f.acts_g), obs ? rev : sc, mn * 4));
            OK(gpu->ops->moe_balance_observe(gpu, &ref, f.acts_g, m));
            OK(gpu->ops->moe_balance_observe(gpu, &ref_s, f.acts_g, m));
            OK(gpu->ops->moe_balance_set_observe(gpu, set, 0, f.acts_g, m));
            OK(gpu->ops->moe_balance_set_observe(gpu, set, 1, f.acts_g, m));
            if (!obs)
                CHECK(set_q.tokens == 0, "%s step %d: the quantile state saw tokens before the flush", what, step);
        }
        OK(gpu->ops->moe_balance_set_flush(gpu, set));
        size_t cnt;
        int32_t *rb = lm_balance_reduce_buffer(&ref, &cnt);
        CHECK(!memcmp(rb, lm_balance_reduce_buffer(&set_q, NULL), cnt * 4), "%s step %d: counts or loads differ",
              what, step);
        CHECK(ref.tokens == set_q.tokens && ref.tokens == f.m + m2, "%s step %d: tokens %lld / %lld", what, step,
              (long long)ref.tokens, (long long)set_q.tokens);
        CHECK(!memcmp(&ref.entropy_sum, &set_q.entropy_sum, sizeof ref.entropy_sum),
              "%s step %d: entropy sum %.17g per observation, %.17g in the set", what, step, ref.entropy_sum,
              set_q.entropy_sum);
        CHECK(!memcmp(ref_s.load, set_s.load, (size_t)n * 4) && ref_s.tokens == set_s.tokens &&
                  !memcmp(&ref_s.entropy_sum, &set_s.entropy_sum, sizeof ref_s.entropy_sum),
              "%s step %d: the sign balancer differs", what, step);
        lm_balance_stats a, b, as, bs2;
        OK(lm_balance_step_end(&ref, 1, &a));
        OK(lm_balance_step_end(&set_q, 1, &b));
        OK(lm_balance_step_end(&ref_s, 1, &as));
        OK(lm_balance_step_end(&set_s, 1, &bs2));
        CHECK(a.updated && !memcmp(ref.bias, set_q.bias, (size_t)n * 4), "%s step %d: b differs", what, step);
        CHECK(!memcmp(ref_s.bias, set_s.bias, (size_t)n * 4), "%s step %d: the sign balancer's b differs", what, step);
        CHECK(!memcmp(&a.maxvio_batch, &b.maxvio_batch, sizeof a.maxvio_batch) &&
                  !memcmp(&a.maxvio_global, &b.maxvio_global, sizeof a.maxvio_global) &&
                  !memcmp(&a.router_entropy, &b.router_entropy, sizeof a.router_entropy) && a.tokens == b.tokens,
              "%s step %d: stats differ", what, step);
    }
    OK(gpu->ops->moe_balance_set_flush(gpu, set)); /* nothing observed: nothing to do */

    /* scores outside [0, 1] or not finite: found at the flush */
    if (set) {
        OK(gpu->ops->moe_forward(gpu, g_y, f.g_x, NULL, set_q.bias, c, &f.gp, &f.gp_lp, f.acts_g, f.m));
        float *bad = hmalloc(mn * 4);
        memcpy(bad, cpu->ops->moe_scores(cpu, f.acts_c), mn * 4);
        OK(gpu->upload(gpu, gpu->ops->moe_scores(gpu, f.acts_g), bad, mn * 4));
        OK(gpu->ops->moe_balance_set_observe(gpu, set, 0, f.acts_g, f.m));
        bad[7 * n + 2] = 1.5f;
        bad[3 * n + 5] = NAN;
        OK(gpu->upload(gpu, gpu->ops->moe_scores(gpu, f.acts_g), bad, mn * 4));
        OK(gpu->ops->moe_balance_set_observe(gpu, set, 0, f.acts_g, f.m));
        lm_status st = gpu->ops->moe_balance_set_flush(gpu, set);
        CHECK(st == LM_ERR_NUMERIC && strstr(lm_last_error(), "MoE layer 0") &&
                  strstr(lm_last_error(), "token 3 ") && strstr(lm_last_error(), "observation 1"),
              "%s: a bad score: status %d, %s", what, (int)st, lm_last_error());
        CHECK(set_q.tokens == 0, "%s: the refused layer took %lld tokens", what, (long long)set_q.tokens);
        OK(lm_balance_step_end(&set_q, 0, NULL));
        memcpy(bad, cpu->ops->moe_scores(cpu, f.acts_c), mn * 4);
        OK(gpu->upload(gpu, gpu->ops->moe_scores(gpu, f.acts_g), bad, mn * 4));
        OK(gpu->ops->moe_balance_set_observe(gpu, set, 0, f.acts_g, f.m));
        OK(gpu->ops->moe_balance_set_flush(gpu, set));
        CHECK(set_q.tokens == f.m, "%s: after a refusal the next step took %lld tokens", what,
              (long long)set_q.tokens);
        CHECK(gpu->ops->moe_balance_set_observe(gpu, set, 2, f.acts_g, f.m) == LM_ERR_ARG,
              "%s: balancer 2 of 2 accepted", what);
    }
    gpu->ops->moe_balance_set_free(gpu, set);
    lm_balance_free(&ref);
    lm_balance_free(&set_q);
    lm_balance_free(&ref_s);
    lm_balance_free(&set_s);
    moe_teardown(&f);
    free_all();
}

static void test_balance_set_equals_the_per_observation_path_k3(void) { balance_set_case(LM_QB_HISTOGRAM, "K3 set"); }
static void test_balance_set_equals_the_per_observation_path_zoom(void) { balance_set_case(LM_QB_ZOOM, "zoom set"); }

/* ---- the residual stream over depth ---- */

static void test_attnres_sequence_matches_the_cpu(void) {
    lm_rng r;
    lm_rng_seed(&r, 12);
    const int L = 4, d = 64;
    const int64_t n = 150;
    lm_attnres_config cfg = {LM_ATTNRES_BLOCK, L, 2, d, n, 1e-6f, 0, 0};
    size_t nd = (size_t)n * d, pd = (size_t)(L + 1) * d;
    void *st_c = NULL, *st_g = NULL;
    OK(cpu->ops->attnres_create(cpu, &cfg, &st_c));
    OK(gpu->ops->attnres_create(gpu, &cfg, &st_g));
    if (!st_c || !st_g) {
        free_all();
        return;
    }
    float *query = rnd(&r, pd, 0.5, 0.0, 0), *knorm = rnd(&r, pd, 0.2, 1.0, 0), *emb = rnd(&r, nd, 1.0, 0.0, 0);
    float *g_query = up_f32(query, pd), *g_knorm = up_f32(knorm, pd), *g_emb = up_f32(emb, nd);
    lm_attnres_params pc = {query, knorm}, pg = {g_query, g_knorm};
    float *h_c = hmalloc(nd * 4), *g_h = dalloc(nd * 4);
    char what[64];
    OK(cpu->ops->attnres_begin(cpu, st_c, emb));
    OK(gpu->ops->attnres_begin(gpu, st_g, g_emb));
    for (int l = 0; l < L; l++) {
        OK(cpu->ops->attnres_input(cpu, st_c, l, &pc, h_c));
        OK(gpu->ops->attnres_input(gpu, st_g, l, &pg, g_h));
        snprintf(what, sizeof what, "attnres_input h, layer %d", l);
        CMP(down_f32(g_h, nd), h_c, NULL, nd, TOL_F32, what);
        float *y = rnd(&r, nd, 1.0, 0.0, 0);
        OK(cpu->ops->attnres_add_output(cpu, st_c, l, y));
        OK(gpu->ops->attnres_add_output(gpu, st_g, l, up_f32(y, nd)));
    }
    OK(cpu->ops->attnres_final(cpu, st_c, &pc, h_c));
    OK(gpu->ops->attnres_final(gpu, st_g, &pg, g_h));
    CMP(down_f32(g_h, nd), h_c, NULL, nd, TOL_F32, "attnres_final h");

    float *gq0 = rnd(&r, pd, 0.1, 0.0, 0), *gk0 = rnd(&r, pd, 0.1, 0.0, 0);
    float *gq_c = copy_of(gq0, pd), *gk_c = copy_of(gk0, pd);
    float *g_gq = up_f32(gq0, pd), *g_gk = up_f32(gk0, pd);
    lm_attnres_grads gc = {gq_c, gk_c}, gg = {g_gq, g_gk};
    float *dh = rnd(&r, nd, 1.0, 0.0, 0);
    OK(cpu->ops->attnres_final_backward(cpu, st_c, &pc, dh, &gc));
    OK(gpu->ops->attnres_final_backward(gpu, st_g, &pg, up_f32(dh, nd), &gg));
    for (int l = L - 1; l >= 0; l--) {
        float *dy0 = rnd(&r, nd, 0.1, 0.0, 0), *dy_c = copy_of(dy0, nd), *g_dy = up_f32(dy0, nd);
        OK(cpu->ops->attnres_output_backward(cpu, st_c, l, dy_c));
        OK(gpu->ops->attnres_output_backward(gpu, st_g, l, g_dy));
        snprintf(what, sizeof what, "attnres_output_backward dy +=, layer %d", l);
        CMP(down_f32(g_dy, nd), dy_c, dy0, nd, TOL_F32, what);
        float *dhl = rnd(&r, nd, 1.0, 0.0, 0);
        OK(cpu->ops->attnres_input_backward(cpu, st_c, l, &pc, dhl, &gc));
        OK(gpu->ops->attnres_input_backward(gpu, st_g, l, &pg, up_f32(dhl, nd), &gg));
    }
    float *de0 = rnd(&r, nd, 0.1, 0.0, 0), *de_c = copy_of(de0, nd), *g_de = up_f32(de0, nd);
    OK(cpu->ops->attnres_embedding_backward(cpu, st_c, de_c));
    OK(gpu->ops->attnres_embedding_backward(gpu, st_g, g_de));
    CMP(down_f32(g_de, nd), de_c, de0, nd, TOL_F32, "attnres_embedding_backward dembedding +=");
    CMP(down_f32(g_gq, pd), gq_c, gq0, pd, TOL_F32, "attnres grads query +=");
    CMP(down_f32(g_gk, pd), gk_c, gk0, pd, TOL_F32, "attnres grads key_norm +=");
    cpu->ops->attnres_free(cpu, st_c);
    gpu->ops->attnres_free(gpu, st_g);
    free_all();
}

/* The residual add with the deferred non-finite check in its pass (attnres_add_output_note):
 * what it notes reaches the backend's slots that nonfinite_take reads (slot 2 l + 1 for
 * sublayer l, as the model uses them): the first of two planted values in one output, nothing
 * for the finite ones; the take clears them; a slot out of range is refused. */
static void test_attnres_add_output_note_reaches_the_backend_slots(void) {
    lm_rng r;
    lm_rng_seed(&r, 15);
    const int L = 4, d = 64;
    const int64_t n = 150;
    lm_attnres_config cfg = {LM_ATTNRES_BLOCK, L, 2, d, n, 1e-6f, 0, 0};
    const size_t nd = (size_t)n * d, pd = (size_t)(L + 1) * d;
    if (!gpu->ops->nonfinite_take) SKIP("the checks at once (LONGMOE_FINITE_CHECKS=at-once): no slots");
    CHECK(gpu->ops->attnres_add_output_note != NULL, "the GPU backend's deferred checks lack attnres_add_output_note");
    if (!gpu->ops->attnres_add_output_note) return;
    void *st_g = NULL;
    OK(gpu->ops->attnres_create(gpu, &cfg, &st_g));
    if (!st_g) {
        free_all();
        return;
    }
    float *query = rnd(&r, pd, 0.5, 0.0, 0), *knorm = rnd(&r, pd, 0.2, 1.0, 0), *emb = rnd(&r, nd, 1.0, 0.0, 0);
    lm_attnres_params pg = {up_f32(query, pd), up_f32(knorm, pd)};
    float *g_h = dalloc(nd * 4);
    int64_t first[2 * 4];
    OK(gpu->ops->nonfinite_take(gpu, first, 2 * L)); /* whatever earlier tests left */
    OK(gpu->ops->attnres_begin(gpu, st_g, up_f32(emb, nd)));
    for (int l = 0; l < L; l++) {
        OK(gpu->ops->attnres_input(gpu, st_g, l, &pg, g_h));
        float *y = rnd(&r, nd, 1.0, 0.0, 0);
        if (l == 2) y[5000] = INFINITY, y[777] = NAN;
        if (l == 0)
            CHECK(gpu->ops->attnres_add_output_note(gpu, st_g, l, up_f32(y, nd), LM_NONFINITE_SLOTS) == LM_ERR_ARG,
                  "slot %d accepted", LM_NONFINITE_SLOTS);
        OK(gpu->ops->attnres_add_output_note(gpu, st_g, l, up_f32(y, nd), 2 * l + 1));
    }
    OK(gpu->ops->nonfinite_take(gpu, first, 2 * L));
    for (int s = 0; s < 2 * L; s++)
        CHECK(first[s] == (s == 5 ? 777 : -1), "slot %d: %lld, want %d", s, (long long)first[s], s == 5 ? 777 : -1);
    OK(gpu->ops->nonfinite_take(gpu, first, 2 * L));
    for (int s = 0; s < 2 * L; s++) CHECK(first[s] == -1, "slot %d after the take: %lld", s, (long long)first[s]);
    gpu->ops->attnres_free(gpu, st_g);
    free_all();
}

/* ---- checks ---- */

static void test_find_nonfinite_finds_the_first_planted_value(void) {
    lm_rng r;
    lm_rng_seed(&r, 13);
    const size_t n = 100000 + 3;
    float *x = rnd(&r, n, 1.0, 0.0, 0);
    float *g_x = up_f32(x, n);
    int64_t first_c = 7, first_g = 7;
    OK(cpu->ops->find_nonfinite(cpu, x, n, &first_c));
    OK(gpu->ops->find_nonfinite(gpu, g_x, n, &first_g));
    CHECK(first_c == -1 && first_g == -1, "all finite: cpu %lld gpu %lld", (long long)first_c, (long long)first_g);
    const size_t at[3] = {77777, 4321, 99999};
    const float bad[3] = {INFINITY, NAN, -INFINITY};
    size_t want = n;
    for (int i = 0; i < 3; i++) {
        x[at[i]] = bad[i];
        want = at[i] < want ? at[i] : want;
        OK(gpu->upload(gpu, g_x, x, n * 4));
        OK(cpu->ops->find_nonfinite(cpu, x, n, &first_c));
        OK(gpu->ops->find_nonfinite(gpu, g_x, n, &first_g));
        CHECK(first_g == (int64_t)want && first_c == (int64_t)want, "planted %d: want %zu, cpu %lld gpu %lld", i,
              want, (long long)first_c, (long long)first_g);
    }
    free_all();
}

int main(void) {
    test_skip_without_cuda();
    cpu = lm_backend_cpu();
    if (!test_skip_all_reason && lm_backend_cuda_create(&gpu) != LM_OK) {
        fprintf(stderr, "lm_backend_cuda_create: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_memory_alloc_zero_copy_upload_download_round_trip);
    RUN(test_to_lp_and_matmul_match_the_cpu);
    RUN(test_rmsnorm_and_embedding_match_the_cpu);
    RUN(test_glu_and_sigmoid_match_the_cpu);
    RUN(test_cross_entropy_matches_the_cpu);
    RUN(test_attention_and_gate_match_the_cpu);
    RUN(test_conv_silu_matches_the_cpu);
    RUN(test_conv_silu_without_the_conv_output_equals_the_stored_one);
    RUN(test_kda_operator_matches_the_cpu);
    RUN(test_accumulate_matches_the_cpu);
    RUN(test_kda_output_stage_matches_the_cpu);
    RUN(test_moe_forward_backward_and_aux_loss_match_the_cpu);
    RUN(test_balance_observe_gives_the_cpu_bias_k3);
    RUN(test_balance_observe_gives_the_cpu_bias_zoom);
    RUN(test_balance_observe_gives_the_cpu_bias_exact_fallback);
    RUN(test_balance_observe_gives_the_cpu_bias_sign_fallback);
    RUN(test_balance_set_equals_the_per_observation_path_k3);
    RUN(test_balance_set_equals_the_per_observation_path_zoom);
    RUN(test_attnres_sequence_matches_the_cpu);
    RUN(test_attnres_add_output_note_reaches_the_backend_slots);
    RUN(test_find_nonfinite_finds_the_first_planted_value);
    if (gpu) lm_backend_free(gpu);
    return test_summary();
}
