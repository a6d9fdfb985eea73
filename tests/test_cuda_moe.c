/* The MoE layer on the GPU against the CPU layer (lm_moe_forward/backward) on
 * the same bf16-representable weights and inputs: routing identical, y, dx
 * and every parameter gradient within bf16 tolerance; run-to-run bit
 * identity; each of it for every kind of expert product (cuBLAS batched by
 * padded size, cuBLAS grouped, cuBLAS per-expert loop, wmma, wgmma), on
 * activation buffers that start full of NaN bytes (the batched and wgmma
 * kinds' padding rows zero after the forward and backward); a caller's bf16
 * copy of x gives the bits of the layer's own conversion; the router's sparse
 * input gradient (no dscores_extra) equals the dense product to 1e-6; the
 * balance histogram's integer counts equal the CPU's. */
#include "longmoe/balance.h"
#include "longmoe/cuda_context.h"
#include "longmoe/moe.h"
#include "longmoe/moe_cuda.h"
#include "test.h"
#include "test_cuda.h"

static lm_cuda_context ctx;
static lm_moe_gemm_kind kind_now; /* the kind of expert product the parity tests run */

#define GPU_OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

typedef struct {
    lm_moe_config cfg;
    size_t count;           /* parameter floats */
    float *params;          /* host, bf16-representable */
    void *d_params, *d_params_bf16, *d_grads;
    lm_moe_params pf, grads;
    lm_moe_params_bf16 pb;
} model;

static int tie_rows; /* model_init: pairs of equal router rows (exact ties in the routing) */

static void model_init(model *md, const lm_moe_config *cfg, uint64_t seed) {
    memset(md, 0, sizeof *md);
    md->cfg = *cfg;
    md->count = lm_moe_param_count(cfg);
    md->params = malloc(md->count * sizeof(float));
    lm_moe_params hp;
    lm_moe_params_carve(cfg, md->params, &hp);
    lm_rng r;
    lm_rng_seed(&r, seed);
    for (size_t i = 0; i < md->count; i++) md->params[i] = bf16_round((float)(0.08 * lm_rng_normal(&r)));
    /* router rows spread so that the scores of one token are well apart */
    for (size_t i = 0; i < (size_t)cfg->n_experts * cfg->d; i++) hp.router[i] = bf16_round((float)(0.3 * lm_rng_normal(&r)));
    /* exact ties: expert 2i + 1's router row equals expert 2i's, so their scores are equal */
    if (tie_rows)
        for (int j = 1; j < cfg->n_experts; j += 2)
            memcpy(hp.router + (size_t)j * cfg->d, hp.router + (size_t)(j - 1) * cfg->d, (size_t)cfg->d * sizeof(float));
    if (hp.lat_norm)
        for (int i = 0; i < cfg->d_latent; i++) hp.lat_norm[i] = bf16_round((float)(1.0 + 0.2 * lm_rng_normal(&r)));
    GPU_OK(lm_cuda_alloc(&md->d_params, md->count * 4));
    GPU_OK(lm_cuda_alloc(&md->d_params_bf16, md->count * 2));
    GPU_OK(lm_cuda_alloc(&md->d_grads, md->count * 4));
    GPU_OK(lm_cuda_upload(md->d_params, md->params, md->count * 4));
    GPU_OK(lm_cuda_upload_bf16(md->d_params_bf16, md->params, md->count));
    lm_moe_params_carve(cfg, (float *)md->d_params, &md->pf);
    lm_moe_params_carve(cfg, (float *)md->d_grads, &md->grads);
    /* the bf16 copy: the same offsets in elements */
    float *const *src = &hp.router;
    uint16_t **dst = &md->pb.router;
    for (int i = 0; i < 10; i++)
        dst[i] = src[i] ? (uint16_t *)md->d_params_bf16 + (src[i] - md->params) : NULL;
}

static void model_free(model *md) {
    free(md->params);
    lm_cuda_free(md->d_params);
    lm_cuda_free(md->d_params_bf16);
    lm_cuda_free(md->d_grads);
}

/* Fill a device block with 0xff bytes (NaN in bf16 and fp32): a kernel that
 * reads what nobody wrote then shows up as NaN in the results. */
static void poison(void *d, size_t bytes) {
    unsigned char *h = malloc(bytes);
    memset(h, 0xff, bytes);
    GPU_OK(lm_cuda_upload(d, h, bytes));
    free(h);
}

/* The batched kind's promise (moe_cuda.h): the padding rows of the grouped
 * intermediates are zero, whatever the buffers held before. */
static void check_padding_rows_zero(const lm_cuda_moe_acts *ga, const lm_cuda_moe_scratch *gs,
                                    const lm_moe_config *cfg, const char *what) {
    int n = cfg->n_experts, f = cfg->d_ff, de = cfg->d_latent > 0 ? cfg->d_latent : cfg->d;
    int32_t *padded = malloc((size_t)(n + 1) * 4);
    GPU_OK(lm_cuda_download(padded, ga->padded_offsets, (size_t)(n + 1) * 4));
    int64_t P = padded[n];
    int32_t *order = malloc((size_t)(P > 0 ? P : 1) * 4);
    GPU_OK(lm_cuda_download(order, ga->order, (size_t)P * 4));
    const uint16_t *bufs[8] = {ga->xg, ga->ga, ga->gu, ga->gh, ga->gout, gs->dgout, gs->da, gs->du};
    const char *names[8] = {"xg", "ga", "gu", "gh", "gout", "dgout", "da", "du"};
    const int widths[8] = {de, f, f, f, de, de, f, f};
    int64_t padding = 0;
    for (int b = 0; b < 8; b++) {
        uint16_t *h = malloc((size_t)(P > 0 ? P : 1) * widths[b] * 2);
        GPU_OK(lm_cuda_download(h, bufs[b], (size_t)P * widths[b] * 2));
        int64_t bad = 0;
        for (int64_t r = 0; r < P; r++) {
            if (order[r] >= 0) continue;
            padding += b == 0;
            for (int e = 0; e < widths[b]; e++) bad += h[r * widths[b] + e] != 0 && h[r * widths[b] + e] != 0x8000;
        }
        CHECK(bad == 0, "%s: %lld nonzero padding elements in %s", what, (long long)bad, names[b]);
        free(h);
    }
    CHECK(padding > 0, "%s: the case has no padding rows to check", what);
    free(order);
    free(padded);
}

static const char *const param_names[10] = {"router", "gate", "up", "down", "lat_down",
                                            "lat_norm", "lat_up", "shared_gate", "shared_up", "shared_down"};

/* One comparison: CPU forward + backward (accumulating onto a random base)
 * against the GPU on the same inputs. bias may be NULL. */
static int case_empty, case_most; /* loads of the last compare_case: experts without rows, largest expert */

static void compare_case(const lm_moe_config *cfg, int64_t m, const float *bias, int with_extra, uint64_t seed,
                         const char *what) {
    model md;
    model_init(&md, cfg, seed);
    int d = cfg->d, n = cfg->n_experts, k = cfg->top_k;
    size_t md_ = (size_t)m * d, mn = (size_t)m * n;
    float *x = malloc(md_ * 4), *dy = malloc(md_ * 4), *extra = malloc(mn * 4);
    float *y_cpu = malloc(md_ * 4), *y_gpu = malloc(md_ * 4);
    float *dx_base = malloc(md_ * 4), *dx_cpu = malloc(md_ * 4), *dx_gpu = malloc(md_ * 4);
    float *g_base = malloc(md.count * 4), *g_cpu = malloc(md.count * 4), *g_gpu = malloc(md.count * 4);
    lm_rng r;
    lm_rng_seed(&r, seed * 7 + 1);
    for (size_t i = 0; i < md_; i++) {
        x[i] = bf16_round((float)lm_rng_normal(&r));
        dy[i] = bf16_round((float)lm_rng_normal(&r));
        dx_base[i] = (float)lm_rng_normal(&r); /* garbage: dx is written */
    }
    for (size_t i = 0; i < mn; i++) extra[i] = (float)(0.5 * lm_rng_normal(&r));
    for (size_t i = 0; i < md.count; i++) g_base[i] = (float)(0.01 * lm_rng_normal(&r));

    /* CPU reference */
    lm_moe_params hp, hg;
    lm_moe_params_carve(cfg, md.params, &hp);
    memcpy(g_cpu, g_base, md.count * 4);
    memcpy(dx_cpu, dx_base, md_ * 4);
    lm_moe_params_carve(cfg, g_cpu, &hg);
    lm_moe_acts ca;
    CHECK(!lm_moe_acts_alloc(&ca, cfg, m), "%s", lm_last_error());
    CHECK(!lm_moe_forward(y_cpu, x, bias, cfg, &hp, &ca, m), "%s", lm_last_error());
    CHECK(!lm_moe_backward(dx_cpu, &hg, dy, x, with_extra ? extra : NULL, cfg, &hp, &ca), "%s", lm_last_error());

    /* GPU */
    size_t ab = lm_cuda_moe_acts_bytes(cfg, m), sb = lm_cuda_moe_scratch_bytes(cfg, m);
    CHECK(ab > 0 && sb > 0, "planned bytes");
    void *ablock = NULL, *sblock = NULL, *dxd = NULL, *dyd = NULL, *yd = NULL, *xd = NULL, *bd = NULL, *ed = NULL;
    GPU_OK(lm_cuda_alloc(&ablock, ab));
    GPU_OK(lm_cuda_alloc(&sblock, sb));
    GPU_OK(lm_cuda_alloc(&xd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&yd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&dyd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&dxd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&ed, mn * 4));
    GPU_OK(lm_cuda_alloc(&bd, (size_t)n * 4));
    GPU_OK(lm_cuda_upload(xd, x, md_ * 4));
    GPU_OK(lm_cuda_upload(dyd, dy, md_ * 4));
    GPU_OK(lm_cuda_upload(dxd, dx_base, md_ * 4));
    GPU_OK(lm_cuda_upload(ed, extra, mn * 4));
    if (bias) GPU_OK(lm_cuda_upload(bd, bias, (size_t)n * 4));
    GPU_OK(lm_cuda_upload(md.d_grads, g_base, md.count * 4));
    lm_cuda_moe_acts ga;
    lm_cuda_moe_scratch gs;
    GPU_OK(lm_cuda_moe_acts_carve(&ga, cfg, m, ablock, ab));
    GPU_OK(lm_cuda_moe_scratch_carve(&gs, cfg, m, sblock, sb));
    poison(ablock, ab);
    poison(sblock, sb);
    GPU_OK(lm_cuda_moe_forward(&ctx, yd, xd, NULL, bias ? bd : NULL, cfg, &md.pf, &md.pb, &ga, m));
    GPU_OK(lm_cuda_moe_backward(&ctx, dxd, &md.grads, dyd, NULL, xd, with_extra ? ed : NULL, cfg, &md.pf, &md.pb, &ga,
                                &gs, 0));
    GPU_OK(lm_cuda_context_sync(&ctx));
    if (kind_now == LM_MOE_GEMM_BATCHED || kind_now == LM_MOE_GEMM_WGMMA) check_padding_rows_zero(&ga, &gs, cfg, what);
    GPU_OK(lm_cuda_download(y_gpu, yd, md_ * 4));
    GPU_OK(lm_cuda_download(dx_gpu, dxd, md_ * 4));
    GPU_OK(lm_cuda_download(g_gpu, md.d_grads, md.count * 4));
    int32_t *topk = malloc((size_t)m * k * 4);
    float *s_gpu = malloc(mn * 4);
    int32_t *offs = malloc((size_t)(n + 1) * 4);
    GPU_OK(lm_cuda_download(topk, ga.topk, (size_t)m * k * 4));
    GPU_OK(lm_cuda_download(s_gpu, ga.s, mn * 4));
    GPU_OK(lm_cuda_download(offs, ga.offsets, (size_t)(n + 1) * 4));

    /* routing on the GPU's own scores: for every token (ties included) the top-k of
     * s + b equals the CPU's rule (decreasing, ties to the lower index) on those
     * scores, and the weights its formula within an ulp or two (the division) */
    {
        float *w_gpu = malloc((size_t)m * k * 4);
        GPU_OK(lm_cuda_download(w_gpu, ga.weights, (size_t)m * k * 4));
        int64_t wrong = 0;
        double werr = 0.0;
        for (int64_t i = 0; i < m; i++) {
            int32_t idx[LM_MOE_MAX_TOPK];
            float val[LM_MOE_MAX_TOPK], sum = 0.0f;
            const float *si = s_gpu + (size_t)i * n;
            lm_topk_row(idx, val, si, bias, n, k);
            wrong += memcmp(idx, topk + i * k, (size_t)k * 4) != 0;
            for (int t = 0; t < k; t++) sum += si[idx[t]];
            for (int t = 0; t < k; t++) {
                double want = (double)si[idx[t]] * (double)(cfg->route_scale / sum);
                double e = fabs((double)w_gpu[i * k + t] - want) / (fabs(want) + 1e-30);
                if (e > werr) werr = e;
            }
        }
        CHECK(wrong == 0, "%s: %lld of %lld tokens' top-k differ from the rule on the GPU's scores", what,
              (long long)wrong, (long long)m);
        CHECK(werr < 1e-6, "%s: routing weights rel err %.3g against the GPU's scores", what, werr);
        free(w_gpu);
    }

    /* routing: identical wherever the CPU's order of s + b is clear */
    int64_t unclear = 0, differ = 0;
    for (int64_t i = 0; i < m; i++) {
        int32_t idx[LM_MOE_MAX_TOPK + 1];
        float val[LM_MOE_MAX_TOPK + 1];
        int kk = k < n ? k + 1 : k;
        lm_topk_row(idx, val, ca.s + i * n, bias, n, kk);
        int clear = 1;
        for (int t = 0; t + 1 < kk; t++) clear &= val[t] - val[t + 1] > 1e-5f;
        if (!clear) {
            unclear++;
            continue;
        }
        differ += memcmp(topk + i * k, ca.topk + i * k, (size_t)k * 4) != 0;
    }
    CHECK(differ == 0, "%s: %lld of %lld tokens routed differently", what, (long long)differ, (long long)m);
    /* tokens whose top-k order is closer than 1e-5 (the fp32 router products differ in
     * summation order) are not compared; random inputs leave few of them */
    CHECK(tie_rows || unclear <= 1 + m / 50, "%s: %lld tokens with near-ties (inputs should avoid them)", what,
          (long long)unclear);
    for (int j = 0; j <= n; j++)
        CHECK(offs[j] == (int32_t)ca.offsets[j], "%s: offsets[%d] %d vs %lld", what, j, offs[j], (long long)ca.offsets[j]);
    double e;
    CHECK((e = rel_err_increment(s_gpu, ca.s, NULL, mn)) < 1e-5, "%s: scores rel err %.3g", what, e);
    CHECK((e = rel_err_increment(y_gpu, y_cpu, NULL, md_)) < 1e-2, "%s: y rel err %.3g", what, e);
    /* dx is written by both (from dx_base, which must not show) */
    CHECK((e = rel_err_increment(dx_gpu, dx_cpu, NULL, md_)) < 1e-2, "%s: dx rel err %.3g", what, e);
    lm_moe_params pc, pg, pbase;
    lm_moe_params_carve(cfg, g_cpu, &pc);
    lm_moe_params_carve(cfg, g_gpu, &pg);
    lm_moe_params_carve(cfg, g_base, &pbase);
    size_t sizes[10];
    {
        /* sizes from consecutive offsets of the carve */
        float *const *pp = &pc.router;
        size_t off[11];
        for (int i = 0; i < 10; i++) off[i] = pp[i] ? (size_t)(pp[i] - g_cpu) : (size_t)-1;
        off[10] = md.count;
        for (int i = 0; i < 10; i++) {
            sizes[i] = 0;
            if (off[i] == (size_t)-1) continue;
            size_t next = md.count;
            for (int j = i + 1; j < 10; j++)
                if (off[j] != (size_t)-1) {
                    next = off[j];
                    break;
                }
            sizes[i] = next - off[i];
        }
    }
    float *const *cp = &pc.router, *const *gp = &pg.router, *const *bp = &pbase.router;
    for (int i = 0; i < 10; i++) {
        if (!cp[i]) continue;
        e = rel_err_increment(gp[i], cp[i], bp[i], sizes[i]);
        CHECK(e < 1e-2, "%s: d%s rel err %.3g", what, param_names[i], e);
    }
    {
        /* the same backward again with expert_grads_set: the routed experts' gradients (gate, up,
         * down; NaN before the call) are written, the CPU's increments, zero for experts without
         * rows; everything else the first call's bits (the same products, added to the same base) */
        float *g_set = malloc(md.count * 4), *dx_set = malloc(md_ * 4);
        GPU_OK(lm_cuda_upload(md.d_grads, g_base, md.count * 4));
        float *const *dp = &md.grads.router;
        for (int i = 1; i <= 3; i++) poison(dp[i], sizes[i] * 4);
        GPU_OK(lm_cuda_moe_backward(&ctx, dxd, &md.grads, dyd, NULL, xd, with_extra ? ed : NULL, cfg, &md.pf, &md.pb,
                                    &ga, &gs, 1));
        GPU_OK(lm_cuda_context_sync(&ctx));
        GPU_OK(lm_cuda_download(g_set, md.d_grads, md.count * 4));
        GPU_OK(lm_cuda_download(dx_set, dxd, md_ * 4));
        CHECK(!memcmp(dx_set, dx_gpu, md_ * 4), "%s: dx of the expert_grads_set call differs", what);
        lm_moe_params ps;
        lm_moe_params_carve(cfg, g_set, &ps);
        float *const *sp = &ps.router;
        for (int i = 0; i < 10; i++) {
            if (!cp[i]) continue;
            if (i < 1 || i > 3) {
                CHECK(!memcmp(sp[i], gp[i], sizes[i] * 4), "%s: d%s of the expert_grads_set call differs", what,
                      param_names[i]);
                continue;
            }
            float *inc = malloc(sizes[i] * 4);
            for (size_t q = 0; q < sizes[i]; q++) inc[q] = cp[i][q] - bp[i][q];
            e = rel_err_increment(sp[i], inc, NULL, sizes[i]);
            CHECK(e < 1e-2, "%s: d%s written (expert_grads_set) rel err %.3g", what, param_names[i], e);
            const size_t per = sizes[i] / (size_t)n;
            int64_t nonzero = 0;
            for (int j = 0; j < n; j++)
                for (size_t q = 0; offs[j + 1] == offs[j] && q < per; q++) nonzero += sp[i][(size_t)j * per + q] != 0.0f;
            CHECK(nonzero == 0, "%s: d%s written: %lld values of experts without rows are not zero", what,
                  param_names[i], (long long)nonzero);
            free(inc);
        }
        free(g_set);
        free(dx_set);
    }
    /* the loads this case meant to produce: experts without rows, one expert with most */
    int empty = 0, most = 0;
    for (int j = 0; j < n; j++) {
        int rows = offs[j + 1] - offs[j];
        empty += rows == 0;
        if (rows > most) most = rows;
    }
    case_empty = empty;
    case_most = most;
    printf("  %-8s %-52s y %.2e dx %.2e unclear %lld, %d empty experts, largest %d of %lld rows\n",
           lm_cuda_moe_gemm_name(kind_now), what, rel_err_increment(y_gpu, y_cpu, NULL, md_),
           rel_err_increment(dx_gpu, dx_cpu, NULL, md_), (long long)unclear, empty, most, (long long)m * k);

    lm_moe_acts_free(&ca);
    free(topk);
    free(s_gpu);
    free(offs);
    lm_cuda_free(ablock);
    lm_cuda_free(sblock);
    lm_cuda_free(xd);
    lm_cuda_free(yd);
    lm_cuda_free(dyd);
    lm_cuda_free(dxd);
    lm_cuda_free(ed);
    lm_cuda_free(bd);
    free(x), free(dy), free(extra), free(y_cpu), free(y_gpu), free(dx_base), free(dx_cpu), free(dx_gpu);
    free(g_base), free(g_cpu), free(g_gpu);
    model_free(&md);
}

/* no LatentMoE, no shared expert; d not a multiple of 8 (the loaders' scalar path) */
static lm_moe_config plain_config(lm_expert_act act) {
    lm_moe_config c = lm_moe_config_default(100, 16, 4, 72);
    c.act = act;
    c.route_scale = 2.5f;
    return c;
}

/* the k3-mini shape scaled down: LatentMoE and one shared expert */
static lm_moe_config latent_config(lm_expert_act act) {
    lm_moe_config c = lm_moe_config_default(128, 16, 4, 64);
    c.d_latent = 64;
    c.n_shared = 1;
    c.d_ff_shared = 96;
    c.act = act;
    return c;
}

static void test_forward_backward_match_the_cpu_without_latent(void) {
    const int64_t ms[3] = {1, 37, 513};
    char what[96];
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 3; i++) {
            lm_moe_config c = plain_config((lm_expert_act)a);
            snprintf(what, sizeof what, "plain %s m=%lld", a ? "situ" : "swiglu", (long long)ms[i]);
            compare_case(&c, ms[i], NULL, 0, 100 + 10 * a + i, what);
        }
}

/* widths over several tiles of the wgmma kernel: K = 256 and 328 (the
 * three-stage pipeline refilled, a last block of 8 of 64), N = 328 and 256
 * (a partial tile), several row tiles an expert */
static void test_forward_backward_match_the_cpu_wide(void) {
    char what[96];
    for (int a = 0; a < 2; a++) {
        lm_moe_config c = lm_moe_config_default(256, 8, 2, 328);
        c.act = (lm_expert_act)a;
        snprintf(what, sizeof what, "wide %s m=700", a ? "situ" : "swiglu");
        compare_case(&c, 700, NULL, 0, 130 + a, what);
    }
}

static void test_forward_backward_match_the_cpu_with_latent_and_shared(void) {
    const int64_t ms[3] = {1, 37, 513};
    char what[96];
    for (int a = 0; a < 2; a++)
        for (int i = 0; i < 3; i++) {
            lm_moe_config c = latent_config((lm_expert_act)a);
            snprintf(what, sizeof what, "latent+shared %s m=%lld", a ? "situ" : "swiglu", (long long)ms[i]);
            compare_case(&c, ms[i], NULL, 0, 200 + 10 * a + i, what);
        }
}

/* one or two shared experts, with and without LatentMoE, of widths 40 and 36 (not a multiple of 8:
 * the scalar GLU kernels, the backward's at a row stride of the side-by-side input gradients that dx
 * takes in one product); without LatentMoE the experts' slots go straight into dx's fp32 rows. Two
 * shared experts found the forward's second expert written at the wrong offset (its bf16
 * pre-activations typed fp32 in the acts). Latent widths 60 (not a multiple of 8: the separate latent
 * sum, norm and norm-gradient kernels) and 264 (33 chunks of 8: the fused ones with one lane holding
 * two chunks and the rest one) beside 64 (the fused ones, a chunk on 8 lanes). */
static void test_forward_backward_match_the_cpu_with_shared_experts(void) {
    /* (n_shared, d_ff_shared, d_latent) */
    static const int v[8][3] = {{1, 40, 0}, {1, 36, 0}, {2, 40, 0}, {2, 36, 0},
                                {2, 40, 64}, {1, 36, 64}, {1, 40, 60}, {1, 40, 264}};
    char what[96];
    for (int q = 0; q < 8; q++)
        for (int a = 0; a < 2; a++) {
            lm_moe_config c = plain_config((lm_expert_act)a);
            c.n_shared = v[q][0];
            c.d_ff_shared = v[q][1];
            c.d_latent = v[q][2];
            snprintf(what, sizeof what, "%d shared f %d lat %d %s m=37", v[q][0], v[q][1], v[q][2],
                     a ? "situ" : "swiglu");
            compare_case(&c, 37, NULL, 0, 230 + 10 * a + q, what);
        }
}

/* the routing kernels: one warp a token for n <= 128, 256 and 512 experts, one
 * thread a token beyond; every router row paired with an equal one, so every
 * token meets exact ties (the CPU rule: the lower index first); top-k up to 16 */
static void test_routing_with_exact_ties_and_many_experts(void) {
    const int ns[4] = {128, 200, 400, 600}, ks[4] = {8, 16, 5, 16};
    char what[96];
    tie_rows = 1;
    for (int i = 0; i < 4; i++) {
        lm_moe_config c = lm_moe_config_default(32, ns[i], ks[i], 16);
        snprintf(what, sizeof what, "ties n=%d k=%d m=300", ns[i], ks[i]);
        compare_case(&c, 300, NULL, 0, 400 + i, what);
    }
    tie_rows = 0;
}

static void test_bias_and_extra_score_gradient_match_the_cpu(void) {
    lm_moe_config c = latent_config(LM_EXPERT_SITU_GLU);
    float bias[16];
    lm_rng r;
    lm_rng_seed(&r, 9);
    for (int j = 0; j < 16; j++) bias[j] = (float)(0.1 * lm_rng_normal(&r));
    compare_case(&c, 200, bias, 1, 300, "latent+shared biased, dscores_extra");
    lm_moe_config p = plain_config(LM_EXPERT_SWIGLU);
    compare_case(&p, 77, bias, 1, 301, "plain biased, dscores_extra");
}

static void test_all_tokens_to_the_same_experts_is_dropless(void) {
    /* a bias that sends every token to experts 3, 7, 11, 15: 513 rows each */
    float bias[16] = {0};
    for (int j = 3; j < 16; j += 4) bias[j] = 5.0f;
    lm_moe_config c = latent_config(LM_EXPERT_SWIGLU);
    compare_case(&c, 513, bias, 0, 400, "latent+shared all tokens to 4 experts");
    lm_moe_config p = plain_config(LM_EXPERT_SITU_GLU);
    compare_case(&p, 513, bias, 0, 401, "plain all tokens to 4 experts");
}

static void test_experts_without_tokens_and_one_crowded_expert(void) {
    /* experts 0..9 pushed down: they receive no token; odd token counts */
    float bias[16];
    for (int j = 0; j < 16; j++) bias[j] = j < 10 ? -6.0f : 0.0f;
    lm_moe_config p = plain_config(LM_EXPERT_SWIGLU);
    compare_case(&p, 201, bias, 1, 410, "plain 10 of 16 experts without tokens");
    CHECK(case_empty >= 10, "%d experts without rows, expected at least 10", case_empty);
    lm_moe_config c = latent_config(LM_EXPERT_SITU_GLU);
    compare_case(&c, 37, bias, 0, 411, "latent+shared 10 of 16 experts without tokens");
    CHECK(case_empty >= 10, "%d experts without rows, expected at least 10", case_empty);
    /* expert 6 pulled up: every token takes it, the other 3 slots spread over 15 */
    for (int j = 0; j < 16; j++) bias[j] = j == 6 ? 6.0f : 0.0f;
    compare_case(&p, 333, bias, 0, 412, "plain one expert with every token");
    CHECK(case_most == 333, "the crowded expert has %d rows, expected 333", case_most);
    compare_case(&c, 255, bias, 1, 413, "latent+shared one expert with every token");
    CHECK(case_most == 255, "the crowded expert has %d rows, expected 255", case_most);
    /* a single expert with rows beyond the top-1 one: top_k = 1 and one favoured expert */
    lm_moe_config one = plain_config(LM_EXPERT_SITU_GLU);
    one.top_k = 1;
    /* with top-1 the weight p is route_scale whatever s is, so the router's gradient
     * through p is zero up to rounding: dscores_extra gives it a real part to compare */
    compare_case(&one, 129, bias, 1, 414, "plain top-1, all tokens to one expert");
    CHECK(case_empty == 15 && case_most == 129, "top-1: %d empty experts, largest %d", case_empty, case_most);
}

/* One forward and backward of the latent+shared layer (the k3-mini shape
 * scaled down) on x (m tokens) with gradients from zero: out[0] = y, out[1]
 * = dx, out[2] = the parameter gradients (host, malloc'd). x_bf16 (host bits,
 * may be NULL) is given to the forward as its bf16 x; the activation block is
 * poisoned first, so a forward that read its own x_own instead would give NaN. */
static int latent_run_set; /* latent_run's backward: expert_grads_set */
static void latent_run(const lm_moe_config *c, model *md, const float *x, const float *dy, const uint16_t *x_bf16,
                       int64_t m, float *out[3]) {
    size_t md_ = (size_t)m * c->d;
    size_t ab = lm_cuda_moe_acts_bytes(c, m), sb = lm_cuda_moe_scratch_bytes(c, m);
    void *ablock, *sblock, *xd, *xbd = NULL, *yd, *dyd, *dxd;
    GPU_OK(lm_cuda_alloc(&ablock, ab));
    GPU_OK(lm_cuda_alloc(&sblock, sb));
    GPU_OK(lm_cuda_alloc(&xd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&yd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&dyd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&dxd, md_ * 4));
    GPU_OK(lm_cuda_upload(xd, x, md_ * 4));
    GPU_OK(lm_cuda_upload(dyd, dy, md_ * 4));
    if (x_bf16) {
        GPU_OK(lm_cuda_alloc(&xbd, md_ * 2));
        GPU_OK(lm_cuda_upload(xbd, x_bf16, md_ * 2));
    }
    lm_cuda_moe_acts ga;
    lm_cuda_moe_scratch gs;
    GPU_OK(lm_cuda_moe_acts_carve(&ga, c, m, ablock, ab));
    GPU_OK(lm_cuda_moe_scratch_carve(&gs, c, m, sblock, sb));
    poison(ablock, ab);
    poison(sblock, sb);
    float *zero = calloc(md->count > md_ ? md->count : md_, 4);
    GPU_OK(lm_cuda_upload(md->d_grads, zero, md->count * 4));
    GPU_OK(lm_cuda_upload(dxd, zero, md_ * 4));
    free(zero);
    GPU_OK(lm_cuda_moe_forward(&ctx, yd, xd, xbd, NULL, c, &md->pf, &md->pb, &ga, m));
    CHECK(ga.x_bf16 == (xbd ? (const uint16_t *)xbd : ga.x_own), "the forward records the bf16 x it read");
    GPU_OK(lm_cuda_moe_backward(&ctx, dxd, &md->grads, dyd, NULL, xd, NULL, c, &md->pf, &md->pb, &ga, &gs,
                                latent_run_set));
    GPU_OK(lm_cuda_context_sync(&ctx));
    out[0] = malloc(md_ * 4);
    out[1] = malloc(md_ * 4);
    out[2] = malloc(md->count * 4);
    GPU_OK(lm_cuda_download(out[0], yd, md_ * 4));
    GPU_OK(lm_cuda_download(out[1], dxd, md_ * 4));
    GPU_OK(lm_cuda_download(out[2], md->d_grads, md->count * 4));
    lm_cuda_free(ablock), lm_cuda_free(sblock), lm_cuda_free(xd), lm_cuda_free(yd), lm_cuda_free(dyd),
        lm_cuda_free(dxd);
    if (xbd) lm_cuda_free(xbd);
}

/* Two runs give the same bits; a caller's bf16 x (x rounded to nearest even on
 * the host: what the model's RMSNorm writes beside its fp32 output) gives the
 * bits of the layer's own conversion in y, dx and every gradient; and the
 * caller's copy is what the latent and shared products read: a different one
 * changes y, dx and lat_down's and the shared experts' gradients. */
static void test_runs_are_bit_identical(void) {
    lm_moe_config c = latent_config(LM_EXPERT_SITU_GLU);
    int64_t m = 513;
    model md;
    model_init(&md, &c, 500);
    size_t md_ = (size_t)m * c.d;
    float *x = malloc(md_ * 4), *dy = malloc(md_ * 4);
    uint16_t *xb = malloc(md_ * 2), *xb_other = malloc(md_ * 2);
    lm_rng r;
    lm_rng_seed(&r, 501);
    for (size_t i = 0; i < md_; i++) {
        x[i] = (float)lm_rng_normal(&r);
        dy[i] = (float)lm_rng_normal(&r);
        xb[i] = lm_f32_to_bf16(x[i]);
        xb_other[i] = lm_f32_to_bf16(i % 3 ? x[i] : -x[i]);
    }
    float *out[4][3];
    latent_run(&c, &md, x, dy, NULL, m, out[0]);
    latent_run(&c, &md, x, dy, NULL, m, out[1]);
    latent_run(&c, &md, x, dy, xb, m, out[2]);
    latent_run(&c, &md, x, dy, xb_other, m, out[3]);
    for (int run = 1; run <= 2; run++) {
        const char *what = run == 1 ? "from run to run" : "with the caller's bf16 x";
        CHECK(!memcmp(out[0][0], out[run][0], md_ * 4), "y bit-identical %s", what);
        CHECK(!memcmp(out[0][1], out[run][1], md_ * 4), "dx bit-identical %s", what);
        CHECK(!memcmp(out[0][2], out[run][2], md.count * 4), "parameter gradients bit-identical %s", what);
    }
    lm_moe_params g0, g3;
    lm_moe_params_carve(&c, out[0][2], &g0);
    lm_moe_params_carve(&c, out[3][2], &g3);
    const size_t lat = (size_t)c.d_latent * c.d, sh = (size_t)c.d_ff_shared * c.d;
    CHECK(memcmp(out[0][0], out[3][0], md_ * 4) != 0, "a different bf16 x leaves y unchanged: not read");
    CHECK(memcmp(out[0][1], out[3][1], md_ * 4) != 0, "a different bf16 x leaves dx unchanged: not read");
    CHECK(memcmp(g0.lat_down, g3.lat_down, lat * 4) != 0, "a different bf16 x leaves d lat_down unchanged");
    CHECK(memcmp(g0.shared_gate, g3.shared_gate, sh * 4) != 0, "a different bf16 x leaves d shared_gate unchanged");
    CHECK(memcmp(g0.shared_up, g3.shared_up, sh * 4) != 0, "a different bf16 x leaves d shared_up unchanged");
    for (int run = 0; run < 4; run++)
        for (int q = 0; q < 3; q++) free(out[run][q]);
    free(x), free(dy), free(xb), free(xb_other);
    model_free(&md);
}

/* Without LatentMoE the kernels by token only copy or round what the kernels by row do (the
 * gather of x's bf16 rows into the grouped rows; the combination's backward: dy's rows into the
 * slots' rows and their dots), so y, dx and every gradient are the same bits either way; widths
 * 128 and 1024 (one and four 8-float chunks a lane). */
static void test_by_token_gives_the_by_row_bits_without_latent(void) {
    const int widths[2] = {128, 1024};
    const int was = lm_cuda_moe_by_token();
    for (int w = 0; w < 2; w++) {
        lm_moe_config c = lm_moe_config_default(widths[w], 8, 2, 64);
        c.act = LM_EXPERT_SITU_GLU;
        const int64_t m = 300;
        model md;
        model_init(&md, &c, 600 + (uint64_t)w);
        const size_t md_ = (size_t)m * c.d;
        float *x = malloc(md_ * 4), *dy = malloc(md_ * 4);
        lm_rng r;
        lm_rng_seed(&r, 610 + (uint64_t)w);
        for (size_t i = 0; i < md_; i++) {
            x[i] = (float)lm_rng_normal(&r);
            dy[i] = (float)lm_rng_normal(&r);
        }
        float *out[2][3];
        for (int bt = 0; bt < 2; bt++) {
            CHECK(lm_cuda_moe_set_by_token(bt) == LM_OK, "rows setting %d", bt);
            latent_run(&c, &md, x, dy, NULL, m, out[bt]);
        }
        CHECK(!memcmp(out[0][0], out[1][0], md_ * 4), "d %d: y by token differs from y by row", widths[w]);
        CHECK(!memcmp(out[0][1], out[1][1], md_ * 4), "d %d: dx by token differs from dx by row", widths[w]);
        CHECK(!memcmp(out[0][2], out[1][2], md.count * 4), "d %d: the gradients by token differ from by row",
              widths[w]);
        for (int bt = 0; bt < 2; bt++)
            for (int q = 0; q < 3; q++) free(out[bt][q]);
        free(x), free(dy);
        model_free(&md);
    }
    lm_cuda_moe_set_by_token(was);
}

/* The layer on the context's side stream (the default: in the forward the latent and shared
 * experts' products beside the router and routing, in the backward the weight gradients beside
 * the input gradients) and on its stream alone (lm_cuda_moe_set_side_stream(0)) give the same
 * bits: y, dx and every gradient, added to and written (expert_grads_set), over 2048 tokens of
 * the latent+shared layer (products large enough to run beside each other). The activations and
 * scratch are NaN before each run, so a product that ran before the other stream had written its
 * input would show. Only the layer's stream is synchronised before the download: it waits for the
 * side stream itself. */
static void test_side_stream_gives_the_inline_bits(void) {
    CHECK(ctx.side_stream && ctx.side_cublas && ctx.side_fork && ctx.side_join, "the context has a side stream");
    lm_moe_config c = latent_config(LM_EXPERT_SITU_GLU);
    c.n_experts = 32;
    const int64_t m = 2048;
    model md;
    model_init(&md, &c, 700);
    const size_t md_ = (size_t)m * c.d;
    float *x = malloc(md_ * 4), *dy = malloc(md_ * 4);
    lm_rng r;
    lm_rng_seed(&r, 701);
    for (size_t i = 0; i < md_; i++) {
        x[i] = (float)lm_rng_normal(&r);
        dy[i] = (float)lm_rng_normal(&r);
    }
    const int was = lm_cuda_moe_side_stream(), was_tiles = lm_cuda_moe_batched_tiles(),
              was_by_token = lm_cuda_moe_by_token();
    lm_moe_gemm_kind was_kind = LM_MOE_GEMM_BATCHED;
    CHECK(lm_cuda_moe_gemm(&was_kind) == LM_OK, "the gemm kind");
    /* the defaults: batched in 128-row tiles, rows by token */
    CHECK(lm_cuda_moe_set_gemm(LM_MOE_GEMM_BATCHED) == LM_OK && lm_cuda_moe_set_batched_tiles(1) == LM_OK &&
              lm_cuda_moe_set_by_token(1) == LM_OK,
          "the default settings");
    for (int set = 0; set < 2; set++) {
        float *out[3][3];
        latent_run_set = set;
        for (int run = 0; run < 3; run++) { /* side, inline, side */
            CHECK(lm_cuda_moe_set_side_stream(run != 1) == LM_OK, "side stream setting %d", run != 1);
            latent_run(&c, &md, x, dy, NULL, m, out[run]);
        }
        for (int run = 1; run < 3; run++) {
            const char *what = run == 1 ? "on the stream" : "on the side stream again";
            CHECK(!memcmp(out[0][0], out[run][0], md_ * 4), "set %d: y %s differs", set, what);
            CHECK(!memcmp(out[0][1], out[run][1], md_ * 4), "set %d: dx %s differs", set, what);
            CHECK(!memcmp(out[0][2], out[run][2], md.count * 4), "set %d: the gradients %s differ", set, what);
        }
        lm_moe_params g0;
        lm_moe_params_carve(&c, out[0][2], &g0);
        size_t nonzero = 0, nonfinite = 0;
        for (size_t i = 0; i < lm_moe_expert_tensor_floats(&c); i++) {
            nonzero += g0.gate[i] != 0.0f && g0.up[i] != 0.0f && g0.down[i] != 0.0f;
            nonfinite += !isfinite(g0.gate[i]) || !isfinite(g0.up[i]) || !isfinite(g0.down[i]);
        }
        CHECK(nonfinite == 0, "set %d: %zu non-finite expert weight gradients", set, nonfinite);
        CHECK(nonzero > lm_moe_expert_tensor_floats(&c) / 2, "set %d: only %zu nonzero expert weight gradients", set,
              nonzero);
        for (int run = 0; run < 3; run++)
            for (int q = 0; q < 3; q++) free(out[run][q]);
    }
    latent_run_set = 0;
    lm_cuda_moe_set_side_stream(was);
    lm_cuda_moe_set_gemm(was_kind);
    lm_cuda_moe_set_batched_tiles(was_tiles);
    lm_cuda_moe_set_by_token(was_by_token);
    CHECK(lm_cuda_moe_set_side_stream(2) == LM_ERR_ARG, "side stream setting 2 refused");
    free(x), free(dy);
    model_free(&md);
}

/* Without dscores_extra the router's input gradient dx += dr W_r runs over
 * each token's k chosen rows of W_r only (dr is zero elsewhere); with it, the
 * dense product over all n. On one forward, a zero dscores_extra (the same dr
 * to the bit) gives the dense product: the two dx increments agree to 1e-6
 * relative (fp32, sums in another order), every parameter gradient is the
 * same bits (dW_r stays dense), and the sparse path repeats bit for bit. */
static void test_sparse_router_dx_equals_the_dense_product(void) {
    lm_moe_config c = latent_config(LM_EXPERT_SITU_GLU);
    c.n_experts = 64;
    c.top_k = 6;
    int64_t m = 300;
    model md;
    model_init(&md, &c, 700);
    size_t md_ = (size_t)m * c.d, mn = (size_t)m * c.n_experts;
    float *x = malloc(md_ * 4), *dy = malloc(md_ * 4), *dx0 = malloc(md_ * 4), *zero = calloc(mn, 4);
    lm_rng r;
    lm_rng_seed(&r, 701);
    for (size_t i = 0; i < md_; i++) {
        x[i] = (float)lm_rng_normal(&r);
        dy[i] = (float)lm_rng_normal(&r);
        dx0[i] = (float)lm_rng_normal(&r);
    }
    size_t ab = lm_cuda_moe_acts_bytes(&c, m), sb = lm_cuda_moe_scratch_bytes(&c, m);
    void *ablock, *sblock, *xd, *yd, *dyd, *dxd, *exd;
    GPU_OK(lm_cuda_alloc(&ablock, ab));
    GPU_OK(lm_cuda_alloc(&sblock, sb));
    GPU_OK(lm_cuda_alloc(&xd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&yd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&dyd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&dxd, md_ * 4));
    GPU_OK(lm_cuda_alloc(&exd, mn * 4));
    GPU_OK(lm_cuda_upload(xd, x, md_ * 4));
    GPU_OK(lm_cuda_upload(dyd, dy, md_ * 4));
    GPU_OK(lm_cuda_upload(exd, zero, mn * 4));
    lm_cuda_moe_acts ga;
    lm_cuda_moe_scratch gs;
    GPU_OK(lm_cuda_moe_acts_carve(&ga, &c, m, ablock, ab));
    GPU_OK(lm_cuda_moe_scratch_carve(&gs, &c, m, sblock, sb));
    GPU_OK(lm_cuda_moe_forward(&ctx, yd, xd, NULL, NULL, &c, &md.pf, &md.pb, &ga, m));
    float *dx[3], *gr[3], *gzero = calloc(md.count, 4);
    for (int run = 0; run < 3; run++) {
        /* runs 0 and 2: sparse (no extra); run 1: dense (a zero extra) */
        GPU_OK(lm_cuda_upload(dxd, dx0, md_ * 4));
        GPU_OK(lm_cuda_upload(md.d_grads, gzero, md.count * 4));
        GPU_OK(lm_cuda_moe_backward(&ctx, dxd, &md.grads, dyd, NULL, xd, run == 1 ? exd : NULL, &c, &md.pf, &md.pb, &ga,
                                    &gs, 0));
        GPU_OK(lm_cuda_context_sync(&ctx));
        dx[run] = malloc(md_ * 4);
        gr[run] = malloc(md.count * 4);
        GPU_OK(lm_cuda_download(dx[run], dxd, md_ * 4));
        GPU_OK(lm_cuda_download(gr[run], md.d_grads, md.count * 4));
    }
    double num = 0, den = 0;
    for (size_t i = 0; i < md_; i++) {
        double a = (double)dx[0][i] - dx0[i], b = (double)dx[1][i] - dx0[i];
        num += (a - b) * (a - b);
        den += b * b;
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    printf("    sparse vs dense router dx: relative difference %.3e\n", rel);
    CHECK(den > 0 && rel <= 1e-6, "sparse router dx differs from the dense product by %.3e relative", rel);
    CHECK(!memcmp(gr[0], gr[1], md.count * 4), "the parameter gradients differ between the sparse and dense paths");
    CHECK(!memcmp(dx[0], dx[2], md_ * 4) && !memcmp(gr[0], gr[2], md.count * 4),
          "the sparse path is not bit-identical from run to run");
    for (int run = 0; run < 3; run++) free(dx[run]), free(gr[run]);
    lm_cuda_free(ablock), lm_cuda_free(sblock), lm_cuda_free(xd), lm_cuda_free(yd), lm_cuda_free(dyd),
        lm_cuda_free(dxd), lm_cuda_free(exd);
    free(x), free(dy), free(dx0), free(zero), free(gzero);
    model_free(&md);
}

/* The GPU histogram and loads of one micro-batch equal lm_balance_observe's
 * after two CPU steps have moved b (and, for zoom, narrowed the windows so
 * that residuals fall outside them and are clamped into the tail bins), for
 * expert counts that take each way of finding a token's threshold (one warp a
 * token with 4, 8 and 16 scores a lane; one thread a token beyond 512). */
static void check_histogram_n(lm_qb_estimator est, int N, int K, int M) {
    enum { BINS = 64 };
    lm_balance_config c = lm_balance_config_default(LM_BALANCE_QUANTILE, N, K, M);
    c.estimator = est;
    c.bins = BINS;
    lm_balance_state st;
    CHECK(!lm_balance_init(&st, &c), "%s", lm_last_error());
    const size_t sb = (size_t)M * N * 4, cb = (size_t)N * BINS * 4, lb = (size_t)N * 4, tb = (size_t)M * K * 4;
    float *s = malloc(sb), *lo = malloc(lb), *w = malloc(lb);
    int32_t *counts = malloc(cb), *load = malloc(lb), *topk = malloc(tb);
    lm_rng r;
    lm_rng_seed(&r, 600 + est + 7 * N);
    for (int step = 0; step < 3; step++) {
        for (size_t q = 0; q < (size_t)M * N; q++) s[q] = (float)lm_rng_uniform(&r) * (float)lm_rng_uniform(&r);
        if (step < 2) {
            CHECK(!lm_balance_observe(&st, s, M, 1), "%s", lm_last_error());
            CHECK(!lm_balance_step_end(&st, 1, NULL), "%s", lm_last_error());
        }
    }
    CHECK(!lm_balance_bin_geometry(&st, lo, w), "%s", lm_last_error());
    CHECK(!lm_router_select(topk, NULL, s, st.bias, M, N, K, 1.0f), "%s", lm_last_error());
    void *sd, *bd, *lod, *wd, *cd, *ld, *td;
    GPU_OK(lm_cuda_alloc(&sd, sb));
    GPU_OK(lm_cuda_alloc(&bd, lb));
    GPU_OK(lm_cuda_alloc(&lod, lb));
    GPU_OK(lm_cuda_alloc(&wd, lb));
    GPU_OK(lm_cuda_alloc(&cd, cb));
    GPU_OK(lm_cuda_alloc(&ld, lb));
    GPU_OK(lm_cuda_alloc(&td, tb));
    GPU_OK(lm_cuda_upload(sd, s, sb));
    GPU_OK(lm_cuda_upload(bd, st.bias, lb));
    GPU_OK(lm_cuda_upload(lod, lo, lb));
    GPU_OK(lm_cuda_upload(wd, w, lb));
    GPU_OK(lm_cuda_upload(td, topk, tb));
    /* accumulated: the same batch twice gives twice the counts */
    for (int rep = 0; rep < 2; rep++) {
        GPU_OK(lm_cuda_balance_histogram(&ctx, cd, sd, bd, lod, wd, M, N, K, BINS, est == LM_QB_ZOOM));
        GPU_OK(lm_cuda_expert_load(&ctx, ld, td, M, N, K));
    }
    GPU_OK(lm_cuda_context_sync(&ctx));
    GPU_OK(lm_cuda_download(counts, cd, cb));
    GPU_OK(lm_cuda_download(load, ld, lb));
    CHECK(!lm_balance_observe(&st, s, M, 1), "%s", lm_last_error());
    CHECK(!lm_balance_observe(&st, s, M, 1), "%s", lm_last_error());
    int64_t bad = 0, tails = 0;
    for (int q = 0; q < N * BINS; q++) bad += counts[q] != st.counts[q];
    for (int j = 0; j < N; j++) tails += st.counts[j * BINS] + st.counts[j * BINS + BINS - 1];
    CHECK(bad == 0, "%s, %d experts: %lld histogram cells differ from the CPU's", est == LM_QB_ZOOM ? "zoom" : "k3",
          N, (long long)bad);
    CHECK(!memcmp(load, st.load, lb), "%d experts: expert loads equal the CPU's", N);
    if (est == LM_QB_ZOOM) CHECK(tails > 0, "zoom, %d experts: some residuals clamped into the tail bins", N);
    lm_cuda_free(sd), lm_cuda_free(bd), lm_cuda_free(lod), lm_cuda_free(wd), lm_cuda_free(cd), lm_cuda_free(ld),
        lm_cuda_free(td);
    free(s), free(lo), free(w), free(counts), free(load), free(topk);
    lm_balance_free(&st);
}

/* every tokens-a-block setting (the last block partial in most cases), then the default back */
static void check_histogram(lm_qb_estimator est) {
    const int tok[5] = {8, 32, 64, 128, 16};
    for (int q = 0; q < 5; q++) {
        GPU_OK(lm_cuda_balance_set_hist_tokens(tok[q]));
        check_histogram_n(est, 32, 4, 1000);
        check_histogram_n(est, 200, 8, 333);
        check_histogram_n(est, 300, 16, 257);
        check_histogram_n(est, 600, 8, 130);
    }
    CHECK(lm_cuda_balance_set_hist_tokens(48) == LM_ERR_ARG, "48 tokens a block refused");
}

/* Expert loads over many blocks (each counts its slots in shared memory, then
 * adds them): equal to the host's count of a random routing, accumulated. */
static void test_expert_load_over_many_blocks(void) {
    enum { M = 5003, N = 300, K = 8 };
    static int32_t topk[M * K], load[N], want[N];
    lm_rng r;
    lm_rng_seed(&r, 610);
    for (int j = 0; j < N; j++) want[j] = 7 * (j % 3); /* a start the counts add to */
    memcpy(load, want, sizeof load);
    for (int q = 0; q < M * K; q++) {
        /* a skewed routing: half the slots on the first ten experts */
        int j = lm_rng_uniform(&r) < 0.5 ? (int)(lm_rng_uniform(&r) * 10) : (int)(lm_rng_uniform(&r) * N);
        topk[q] = j;
        want[j]++;
    }
    void *td, *ld;
    GPU_OK(lm_cuda_alloc(&td, sizeof topk));
    GPU_OK(lm_cuda_alloc(&ld, sizeof load));
    GPU_OK(lm_cuda_upload(td, topk, sizeof topk));
    GPU_OK(lm_cuda_upload(ld, load, sizeof load));
    GPU_OK(lm_cuda_expert_load(&ctx, ld, td, M, N, K));
    GPU_OK(lm_cuda_context_sync(&ctx));
    GPU_OK(lm_cuda_download(load, ld, sizeof load));
    int bad = 0;
    for (int j = 0; j < N; j++) bad += load[j] != want[j];
    CHECK(bad == 0, "%d of %d expert loads differ from the host's count", bad, N);
    CHECK(lm_cuda_expert_load(&ctx, ld, td, M, LM_MOE_MAX_EXPERTS + 1, K) == LM_ERR_ARG, "too many experts refused");
    lm_cuda_free(td), lm_cuda_free(ld);
}

static void test_balance_histogram_equals_the_cpu_k3(void) { check_histogram(LM_QB_HISTOGRAM); }
static void test_balance_histogram_equals_the_cpu_zoom(void) { check_histogram(LM_QB_ZOOM); }

static void test_gemm_selector(void) {
    CHECK(lm_cuda_moe_gemm_parse("batched") == LM_MOE_GEMM_BATCHED, "parse batched");
    CHECK(lm_cuda_moe_gemm_parse("grouped") == LM_MOE_GEMM_GROUPED, "parse grouped");
    CHECK(lm_cuda_moe_gemm_parse("loop") == LM_MOE_GEMM_LOOP, "parse loop");
    CHECK(lm_cuda_moe_gemm_parse("wmma") == LM_MOE_GEMM_WMMA, "parse wmma");
    CHECK(lm_cuda_moe_gemm_parse("wgmma") == LM_MOE_GEMM_WGMMA, "parse wgmma");
    CHECK(lm_cuda_moe_gemm_parse("cublas") == -1 && lm_cuda_moe_gemm_parse(NULL) == -1, "unknown names refused");
    CHECK(lm_cuda_moe_set_gemm((lm_moe_gemm_kind)7) == LM_ERR_ARG, "kind 7 refused");
    CHECK(lm_cuda_moe_set_wgmma_tile(64) == LM_ERR_ARG, "wgmma tile of 64 columns refused");
    CHECK(lm_cuda_moe_set_batched_tiles(2) == LM_ERR_ARG, "batched entries 2 refused");
    CHECK(lm_cuda_moe_set_batched_tiles(1) == LM_OK && lm_cuda_moe_batched_tiles() == 1, "batched tiles read back");
    CHECK(lm_cuda_moe_set_batched_tiles(0) == LM_OK && lm_cuda_moe_batched_tiles() == 0, "batched experts read back");
    CHECK(lm_cuda_moe_set_by_token(2) == LM_ERR_ARG, "rows setting 2 refused");
    CHECK(lm_cuda_moe_set_by_token(1) == LM_OK && lm_cuda_moe_by_token() == 1, "rows by token read back");
    CHECK(lm_cuda_moe_set_by_token(0) == LM_OK && lm_cuda_moe_by_token() == 0, "rows by row read back");
    const char *names[LM_MOE_GEMM_KINDS] = {"grouped", "loop", "wmma", "batched", "wgmma"};
    for (int q = 0; q < LM_MOE_GEMM_KINDS; q++) {
        lm_moe_gemm_kind got = (lm_moe_gemm_kind)-1;
        CHECK(lm_cuda_moe_set_gemm((lm_moe_gemm_kind)q) == LM_OK, "set %d", q);
        CHECK(lm_cuda_moe_gemm(&got) == LM_OK && got == (lm_moe_gemm_kind)q, "kind %d read back as %d", q, (int)got);
        CHECK(!strcmp(lm_cuda_moe_gemm_name(got), names[q]), "name of %d", q);
    }
}

static void test_bad_arguments_are_refused(void) {
    lm_moe_config c = plain_config(LM_EXPERT_SWIGLU);
    CHECK(lm_cuda_moe_acts_bytes(&c, 0) == 0, "m_max 0 refused");
    lm_cuda_moe_acts a;
    char dummy[16];
    CHECK(lm_cuda_moe_acts_carve(&a, &c, 10, dummy + 1, 1 << 20) == LM_ERR_ARG, "unaligned block refused");
    c.top_k = 0;
    CHECK(lm_cuda_moe_acts_bytes(&c, 10) == 0, "bad config refused");
}

/* the layer against the CPU and against itself, under the current settings */
static void run_parity_tests(void) {
    RUN(test_forward_backward_match_the_cpu_without_latent);
    RUN(test_forward_backward_match_the_cpu_with_latent_and_shared);
    RUN(test_forward_backward_match_the_cpu_with_shared_experts);
    RUN(test_forward_backward_match_the_cpu_wide);
    RUN(test_bias_and_extra_score_gradient_match_the_cpu);
    RUN(test_all_tokens_to_the_same_experts_is_dropless);
    RUN(test_experts_without_tokens_and_one_crowded_expert);
    RUN(test_runs_are_bit_identical);
}

int main(void) {
    test_skip_without_cuda();
    if (!test_skip_all_reason && lm_cuda_context_create(&ctx)) {
        fprintf(stderr, "no GPU: %s\n", lm_last_error());
        return 1;
    }
    /* every parity test once per kind of expert product, set through the API,
     * the rows moved by grouped row (by token comes after); batched twice (one entry an expert, then one a 128-row tile), wgmma
     * twice (its 128 x 256 tiles, then its 128 x 128 tiles) */
    const struct {
        lm_moe_gemm_kind kind;
        int wgmma_tile, batched_tiles;
    } variants[] = {{LM_MOE_GEMM_BATCHED, 256, 0}, {LM_MOE_GEMM_BATCHED, 256, 1}, {LM_MOE_GEMM_GROUPED, 256, 0},
                    {LM_MOE_GEMM_LOOP, 256, 0},    {LM_MOE_GEMM_WMMA, 256, 0},    {LM_MOE_GEMM_WGMMA, 256, 0},
                    {LM_MOE_GEMM_WGMMA, 128, 0}};
    for (size_t q = 0; q < sizeof variants / sizeof variants[0]; q++) {
        kind_now = variants[q].kind;
        const int tile = variants[q].wgmma_tile, tiles = variants[q].batched_tiles;
        if (!test_skip_all_reason &&
            (lm_cuda_moe_set_gemm(kind_now) != LM_OK || lm_cuda_moe_set_wgmma_tile(tile) != LM_OK ||
             lm_cuda_moe_set_batched_tiles(tiles) != LM_OK || lm_cuda_moe_set_by_token(0) != LM_OK)) {
            fprintf(stderr, "set gemm kind: %s\n", lm_last_error());
            return 1;
        }
        if (kind_now == LM_MOE_GEMM_WGMMA) printf("expert products: wgmma, tiles of 128 x %d\n", tile);
        else if (kind_now == LM_MOE_GEMM_BATCHED)
            printf("expert products: batched, one entry %s\n", tiles ? "a 128-row tile" : "an expert");
        else printf("expert products: %s\n", lm_cuda_moe_gemm_name(kind_now));
        run_parity_tests();
        RUN(test_sparse_router_dx_equals_the_dense_product);
    }
    /* the rows moved by token (the gather, the combination with the latent norm and their
     * backwards: lm_cuda_moe_set_by_token), with the default kind, batched in 128-row tiles;
     * the passes above ran them by grouped row */
    kind_now = LM_MOE_GEMM_BATCHED;
    if (!test_skip_all_reason && (lm_cuda_moe_set_gemm(kind_now) != LM_OK || lm_cuda_moe_set_batched_tiles(1) ||
                                  lm_cuda_moe_set_by_token(1))) {
        fprintf(stderr, "set rows by token: %s\n", lm_last_error());
        return 1;
    }
    printf("rows by token: expert products batched, one entry a 128-row tile\n");
    run_parity_tests();
    if (!test_skip_all_reason && lm_cuda_moe_set_by_token(0)) return 1;
    /* the routing does not depend on the kind of product: once, with batched */
    kind_now = LM_MOE_GEMM_BATCHED;
    if (!test_skip_all_reason && (lm_cuda_moe_set_gemm(kind_now) != LM_OK || lm_cuda_moe_set_batched_tiles(0))) {
        fprintf(stderr, "set gemm kind: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_routing_with_exact_ties_and_many_experts);
    if (!test_skip_all_reason && lm_cuda_moe_grouped_refused())
        printf("note: cuBLAS refused %ld grouped calls (run per expert instead)\n", lm_cuda_moe_grouped_refused());
    RUN(test_gemm_selector);
    RUN(test_by_token_gives_the_by_row_bits_without_latent);
    RUN(test_side_stream_gives_the_inline_bits);
    RUN(test_balance_histogram_equals_the_cpu_k3);
    RUN(test_balance_histogram_equals_the_cpu_zoom);
    RUN(test_expert_load_over_many_blocks);
    RUN(test_bad_arguments_are_refused);
    lm_cuda_context_destroy(&ctx);
    return test_summary();
}
