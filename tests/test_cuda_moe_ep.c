/* Expert parallelism of the MoE layer on GPU ranks (lm_cuda_moe_forward_ep /
 * lm_cuda_moe_backward_ep) against the one-process GPU layer on the same
 * global tokens: every rank draws the same weights and the tokens of all
 * ranks, runs the whole layer on all of them (the reference) and then its own
 * block of tokens with expert parallelism, each rank holding the expert
 * weights of its slice only. Outputs and input gradients of the rank's tokens,
 * the expert weight gradients of its slice and the replicated gradients summed
 * over the ranks equal the reference's (relative error below 2e-3; the rows
 * an expert receives are the same in the same order, so most come out bit for
 * bit); the routing is the same; each owner receives exactly its experts' rows
 * and writes no gradient outside its slice. Cases: SwiGLU and SiTU-GLU,
 * LatentMoE with a shared expert, a bias that sends every token to rank 0's
 * experts (the other owners receive nothing), a rank without tokens, every kind
 * of expert product; the reserve (no growth after it, the plan's bytes), two
 * layers sharing their call-time buffers (the separate handles' bits), and
 * the refusals.
 *
 * Runs on the staged engine over a CUDA backend: alone (one rank) or under
 * mpirun (`mpirun -np 2 test_cuda_moe_ep --ranks 2`; processes may share one
 * GPU). Without a GPU every case reports skipped. */
#include <string.h>

#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "longmoe/cuda_context.h"
#include "longmoe/moe.h"
#include "longmoe/moe_cuda.h"
#include "test.h"
#include "test_cuda.h"

static lm_comm *comm, *host;
static lm_backend *be;
static const lm_cuda_context *ctx;
static int R = 1, me = 0;

#define GPU_OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

#define EP_RTOL 2e-3

static void *dev_upload(const void *h, size_t bytes) {
    void *d = NULL;
    if (lm_cuda_alloc(&d, bytes ? bytes : 4) || (bytes && lm_cuda_upload(d, h, bytes))) {
        fprintf(stderr, "device buffer of %zu bytes: %s\n", bytes, lm_last_error());
        exit(1);
    }
    return d;
}

static void *dev_zero(size_t bytes) {
    void *h = calloc(bytes ? bytes : 4, 1), *d = dev_upload(h, bytes);
    free(h);
    return d;
}

static void download(void *h, const void *d, size_t bytes) {
    if (bytes && lm_cuda_download(h, d, bytes)) {
        fprintf(stderr, "download of %zu bytes: %s\n", bytes, lm_last_error());
        exit(1);
    }
}

/* The expert tensors' offsets (floats) and sizes in the parameter block. */
typedef struct {
    size_t off[3], whole[3], slice[3];
} expert_span;

static expert_span experts_of(const lm_moe_config *c, const lm_moe_params *hp, const float *base, int nl) {
    const int de = c->d_latent > 0 ? c->d_latent : c->d;
    const size_t per = (size_t)c->d_ff * de;
    expert_span e;
    const float *t[3] = {hp->gate, hp->up, hp->down};
    for (int i = 0; i < 3; i++) {
        e.off[i] = (size_t)(t[i] - base);
        e.whole[i] = per * c->n_experts;
        e.slice[i] = per * nl;
    }
    return e;
}

/* bias_mode: 0 none, 1 rank 0's experts first for every token */
static void ep_case(const lm_moe_config *cfg, const int64_t *m_of, int bias_mode, uint64_t seed, int reserve,
                    const char *what) {
    const int n = cfg->n_experts, k = cfg->top_k, d = cfg->d, nl = n / R;
    const int de = cfg->d_latent > 0 ? cfg->d_latent : d;
    int64_t M = 0, off = 0;
    for (int q = 0; q < R; q++) {
        if (q == me) off = M;
        M += m_of[q];
    }
    const int64_t m = m_of[me];
    const size_t count = lm_moe_param_count(cfg);
    float *params = malloc(count * 4);
    lm_moe_params hp;
    lm_moe_params_carve(cfg, params, &hp);
    lm_rng r;
    lm_rng_seed(&r, seed);
    for (size_t i = 0; i < count; i++) params[i] = bf16_round((float)(0.08 * lm_rng_normal(&r)));
    for (size_t i = 0; i < (size_t)n * d; i++) hp.router[i] = bf16_round((float)(0.3 * lm_rng_normal(&r)));
    if (hp.lat_norm)
        for (int i = 0; i < cfg->d_latent; i++) hp.lat_norm[i] = bf16_round((float)(1.0 + 0.2 * lm_rng_normal(&r)));
    float *x = host_normal((size_t)M * d, 1.0, 0.0, 1, &r), *dy = host_normal((size_t)M * d, 1.0, 0.0, 1, &r);
    float *bias = calloc((size_t)n, 4);
    if (bias_mode == 1)
        for (int j = 0; j < nl && j < n; j++) bias[j] = 8.0f;
    expert_span es = experts_of(cfg, &hp, params, nl);
    const int first = me * nl;

    /* the weights: fp32 masters and the bf16 copy, whole */
    float *d_params = dev_upload(params, count * 4);
    uint16_t *d_bf16 = NULL;
    GPU_OK(lm_cuda_alloc((void **)&d_bf16, count * 2));
    GPU_OK(lm_cuda_upload_bf16(d_bf16, params, count));
    lm_moe_params pf;
    lm_moe_params_carve(cfg, d_params, &pf);
    lm_moe_params_bf16 pb, pb_ep;
    {
        float *const *src = &hp.router;
        uint16_t **dst = &pb.router;
        for (int i = 0; i < 10; i++) dst[i] = src[i] ? d_bf16 + (src[i] - params) : NULL;
    }
    pb_ep = pb;
    const size_t per = (size_t)cfg->d_ff * de;
    pb_ep.gate = pb.gate + (size_t)first * per;
    pb_ep.up = pb.up + (size_t)first * per;
    pb_ep.down = pb.down + (size_t)first * per;
    float *d_bias = dev_upload(bias, (size_t)n * 4);
    const float *bias_arg = bias_mode ? d_bias : NULL;

    /* the reference: the whole layer on all M tokens */
    float *d_x = dev_upload(x, (size_t)M * d * 4), *d_dy = dev_upload(dy, (size_t)M * d * 4);
    float *d_y = dev_zero((size_t)M * d * 4), *d_dx = dev_zero((size_t)M * d * 4);
    float *d_g = dev_zero(count * 4);
    lm_moe_params g_ref;
    lm_moe_params_carve(cfg, d_g, &g_ref);
    size_t ab = lm_cuda_moe_acts_bytes(cfg, M), sbb = lm_cuda_moe_scratch_bytes(cfg, M);
    void *ablk = dev_zero(ab), *sblk = dev_zero(sbb);
    lm_cuda_moe_acts ra;
    lm_cuda_moe_scratch rs;
    GPU_OK(lm_cuda_moe_acts_carve(&ra, cfg, M, ablk, ab));
    GPU_OK(lm_cuda_moe_scratch_carve(&rs, cfg, M, sblk, sbb));
    GPU_OK(lm_cuda_moe_forward(ctx, d_y, d_x, NULL, bias_arg, cfg, &pf, &pb, &ra, M));
    GPU_OK(lm_cuda_moe_backward(ctx, d_dx, &g_ref, d_dy, NULL, d_x, NULL, cfg, &pf, &pb, &ra, &rs, 0));

    /* this rank's tokens with expert parallelism */
    const int64_t mcap = m > 0 ? m : 1;
    size_t eab = lm_cuda_moe_acts_bytes(cfg, mcap), esb = lm_cuda_moe_scratch_bytes(cfg, mcap);
    void *eablk = dev_zero(eab), *esblk = dev_zero(esb);
    lm_cuda_moe_acts ea;
    lm_cuda_moe_scratch esc;
    GPU_OK(lm_cuda_moe_acts_carve(&ea, cfg, mcap, eablk, eab));
    GPU_OK(lm_cuda_moe_scratch_carve(&esc, cfg, mcap, esblk, esb));
    float *d_ye = dev_zero((size_t)mcap * d * 4), *d_dxe = dev_zero((size_t)mcap * d * 4);
    float *d_ge = dev_zero(count * 4);
    lm_moe_params g_ep;
    lm_moe_params_carve(cfg, d_ge, &g_ep);
    g_ep.gate += (size_t)first * per;
    g_ep.up += (size_t)first * per;
    g_ep.down += (size_t)first * per;
    lm_cuda_moe_ep *ep = NULL;
    GPU_OK(lm_cuda_moe_ep_create(ctx, comm, cfg, &ep));
    if (!ep) goto out;
    CHECK(lm_cuda_moe_ep_first_expert(ep) == first && lm_cuda_moe_ep_local_experts(ep) == nl, "%s: owned experts",
          what);
    /* the worst case: every token of every rank to this rank's experts, (M - m) k rows from the
     * other ranks and m k of its own; the reserve counts rows from every source with its own share
     * 1/R (rounded down), so ask for rows_w, the fewest whose other ranks' part covers theirs */
    int64_t rows_w = M * k;
    if (R > 1) {
        const int64_t others = (M - m) * k, w = (others * R + R - 2) / (R - 1);
        rows_w = w > rows_w ? w : rows_w;
    }
    if (reserve) GPU_OK(lm_cuda_moe_ep_reserve(ep, rows_w));
    const size_t held = lm_cuda_moe_ep_bytes(ep, 0) + lm_cuda_moe_ep_bytes(ep, 1);
    if (reserve)
        CHECK(lm_cuda_moe_ep_bytes(ep, 0) == lm_cuda_moe_ep_plan_bytes(cfg, R, rows_w, 0) &&
                  lm_cuda_moe_ep_bytes(ep, 1) == lm_cuda_moe_ep_plan_bytes(cfg, R, rows_w, 1),
              "%s: the reserved handle holds %zu + %zu bytes, the plan says %zu + %zu", what, lm_cuda_moe_ep_bytes(ep, 0),
              lm_cuda_moe_ep_bytes(ep, 1), lm_cuda_moe_ep_plan_bytes(cfg, R, rows_w, 0),
              lm_cuda_moe_ep_plan_bytes(cfg, R, rows_w, 1));
    GPU_OK(lm_cuda_moe_forward_ep(ctx, d_ye, m ? d_x + off * d : NULL, NULL, bias_arg, cfg, &pf, &pb_ep, &ea, m, ep));
    GPU_OK(lm_cuda_moe_backward_ep(ctx, m ? d_dxe : NULL, &g_ep, m ? d_dy + off * d : NULL, NULL, m ? d_x + off * d : NULL,
                                   NULL, cfg, &pf, &pb_ep, &ea, &esc, ep));
    GPU_OK(lm_cuda_context_sync(ctx));
    if (reserve)
        CHECK(lm_cuda_moe_ep_bytes(ep, 0) + lm_cuda_moe_ep_bytes(ep, 1) == held,
              "%s: the handle grew after reserving the worst case (%zu -> %zu bytes)", what, held,
              lm_cuda_moe_ep_bytes(ep, 0) + lm_cuda_moe_ep_bytes(ep, 1));

    {
        /* rows received: this rank's experts' rows in the reference routing */
        int32_t *offs = malloc((size_t)(n + 1) * 4);
        download(offs, ra.offsets, (size_t)(n + 1) * 4);
        const int64_t want = offs[first + nl] - offs[first];
        CHECK(lm_cuda_moe_ep_rows_received(ep) == want, "%s: rank %d received %lld rows, its experts have %lld", what,
              me, (long long)lm_cuda_moe_ep_rows_received(ep), (long long)want);
        if (bias_mode == 1 && me > 0)
            CHECK(want == 0, "%s: the bias should leave rank %d's experts without rows", what, me);
        free(offs);
    }
    float *y_ref = malloc((size_t)M * d * 4), *dx_ref = malloc((size_t)M * d * 4);
    float *y_ep = malloc((size_t)mcap * d * 4), *dx_ep = malloc((size_t)mcap * d * 4);
    float *g_r = malloc(count * 4), *g_e = malloc(count * 4);
    download(y_ref, d_y, (size_t)M * d * 4);
    download(dx_ref, d_dx, (size_t)M * d * 4);
    download(y_ep, d_ye, (size_t)m * d * 4);
    download(dx_ep, d_dxe, (size_t)m * d * 4);
    download(g_r, d_g, count * 4);
    download(g_e, d_ge, count * 4);
    if (m > 0) {
        int32_t *tk_ref = malloc((size_t)M * k * 4), *tk_ep = malloc((size_t)m * k * 4);
        download(tk_ref, ra.topk, (size_t)M * k * 4);
        download(tk_ep, ea.topk, (size_t)m * k * 4);
        CHECK(!memcmp(tk_ref + off * k, tk_ep, (size_t)m * k * 4), "%s: the routing differs from the reference's",
              what);
        free(tk_ref);
        free(tk_ep);
        double ey = rel_err(y_ep, y_ref + off * d, (size_t)m * d), ex = rel_err(dx_ep, dx_ref + off * d, (size_t)m * d);
        CHECK(ey < EP_RTOL, "%s: rank %d outputs rel err %.3g", what, me, ey);
        CHECK(ex < EP_RTOL, "%s: rank %d input gradients rel err %.3g", what, me, ex);
        printf("    %s: y %.2g, dx %.2g", what, ey, ex);
    }
    /* the expert gradients: this rank's slice, nothing outside it */
    static const char *const names[3] = {"gate", "up", "down"};
    for (int i = 0; i < 3; i++) {
        const size_t o = es.off[i], s0 = (size_t)first * per;
        double e = rel_err(g_e + o + s0, g_r + o + s0, es.slice[i]);
        CHECK(e < EP_RTOL || (bias_mode == 1 && me > 0), "%s: rank %d d%s rel err %.3g", what, me, names[i], e);
        if (bias_mode == 1 && me > 0) {
            double mx = 0;
            for (size_t t = 0; t < es.slice[i]; t++) mx = fmax(mx, fabs(g_e[o + s0 + t]));
            CHECK(mx == 0, "%s: rank %d's experts received no rows but have a d%s of %g", what, me, names[i], mx);
        }
        int64_t outside = 0;
        for (size_t t = 0; t < es.whole[i]; t++)
            if ((t < s0 || t >= s0 + es.slice[i]) && g_e[o + t] != 0) outside++;
        CHECK(outside == 0, "%s: rank %d wrote %lld d%s values outside its slice", what, me, (long long)outside,
              names[i]);
        if (!(bias_mode == 1 && me > 0)) printf(", d%s %.2g", names[i], e);
        /* the rest of the block is compared after the sum: zero the expert tensors */
        for (size_t t = 0; t < es.whole[i]; t++) g_e[o + t] = g_r[o + t] = 0.0f;
    }
    /* the replicated gradients summed over the ranks */
    GPU_OK(lm_comm_all_reduce_sum(host, g_e, g_e, count, LM_DTYPE_F32));
    double eg = rel_err(g_e, g_r, count);
    CHECK(eg < EP_RTOL, "%s: replicated gradients summed over the ranks rel err %.3g", what, eg);
    printf(", replicated %.2g\n", eg);
    free(y_ref);
    free(dx_ref);
    free(y_ep);
    free(dx_ep);
    free(g_r);
    free(g_e);
out:
    lm_cuda_moe_ep_free(ep);
    lm_cuda_free(eablk);
    lm_cuda_free(esblk);
    lm_cuda_free(d_ye);
    lm_cuda_free(d_dxe);
    lm_cuda_free(d_ge);
    lm_cuda_free(ablk);
    lm_cuda_free(sblk);
    lm_cuda_free(d_x);
    lm_cuda_free(d_dy);
    lm_cuda_free(d_y);
    lm_cuda_free(d_dx);
    lm_cuda_free(d_g);
    lm_cuda_free(d_bias);
    lm_cuda_free(d_params);
    lm_cuda_free(d_bf16);
    free(params);
    free(x);
    free(dy);
    free(bias);
}

static void tokens(int64_t *m_of, int64_t base, int64_t step) {
    for (int q = 0; q < R; q++) m_of[q] = base + step * q;
}

static void test_swiglu_equals_the_one_process_layer_for_every_kind(void) {
    lm_moe_config c = lm_moe_config_default(64, 8, 2, 32);
    int64_t m_of[64];
    tokens(m_of, 37, 11);
    static const lm_moe_gemm_kind kinds[] = {LM_MOE_GEMM_BATCHED, LM_MOE_GEMM_GROUPED, LM_MOE_GEMM_LOOP,
                                             LM_MOE_GEMM_WMMA, LM_MOE_GEMM_WGMMA};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        GPU_OK(lm_cuda_moe_set_gemm(kinds[i]));
        char what[64];
        snprintf(what, sizeof what, "swiglu 8x top-2, %s", lm_cuda_moe_gemm_name(kinds[i]));
        ep_case(&c, m_of, 0, 11 + i, 0, what);
    }
    GPU_OK(lm_cuda_moe_set_gemm(LM_MOE_GEMM_BATCHED));
}

static void test_latent_situ_with_a_shared_expert(void) {
    lm_moe_config c = lm_moe_config_default(96, 16, 4, 64);
    c.act = LM_EXPERT_SITU_GLU;
    c.d_latent = 48;
    c.n_shared = 1;
    c.d_ff_shared = 40;
    int64_t m_of[64];
    tokens(m_of, 150, 23);
    ep_case(&c, m_of, 0, 21, 0, "latent situ 16x top-4 + shared");
    /* many rows an expert: several row tiles, and the reserve */
    tokens(m_of, 700, 57);
    ep_case(&c, m_of, 0, 22, 1, "latent situ, 700+ tokens a rank, reserved");
}

static void test_every_token_to_rank_0s_experts(void) {
    lm_moe_config c = lm_moe_config_default(64, 8, 2, 32);
    int64_t m_of[64];
    tokens(m_of, 45, 9);
    ep_case(&c, m_of, 1, 31, 0, "bias to rank 0's experts");
}

static void test_a_rank_without_tokens_still_takes_part(void) {
    lm_moe_config c = lm_moe_config_default(64, 8, 2, 32);
    int64_t m_of[64];
    tokens(m_of, 40, 13);
    m_of[0] = 0;
    if (R == 1) m_of[0] = 1; /* alone, a rank without tokens has nothing to compare */
    ep_case(&c, m_of, 0, 41, 0, "rank 0 without tokens");
}

/* One MoE layer of the sharing case: weights, activations, scratch, results. */
typedef struct {
    size_t count;
    float *d_params, *d_g, *d_y, *d_dx, *d_bias;
    uint16_t *d_bf16;
    lm_moe_params pf, g;
    lm_moe_params_bf16 pb;
    void *ablk, *sblk;
    lm_cuda_moe_acts a;
    lm_cuda_moe_scratch s;
    lm_cuda_moe_ep *ep;
} layer;

static void layer_init(layer *L, const lm_moe_config *cfg, int64_t m, uint64_t seed, int skew) {
    memset(L, 0, sizeof *L);
    const int n = cfg->n_experts, nl = n / R, de = cfg->d_latent > 0 ? cfg->d_latent : cfg->d;
    L->count = lm_moe_param_count(cfg);
    float *params = malloc(L->count * 4), *bias = calloc((size_t)n, 4);
    lm_moe_params hp;
    lm_moe_params_carve(cfg, params, &hp);
    lm_rng r;
    lm_rng_seed(&r, seed);
    for (size_t i = 0; i < L->count; i++) params[i] = bf16_round((float)(0.08 * lm_rng_normal(&r)));
    if (hp.lat_norm)
        for (int i = 0; i < cfg->d_latent; i++) hp.lat_norm[i] = 1.0f;
    /* skew: every token to rank 0's experts (it receives every row) */
    for (int j = 0; skew && j < nl; j++) bias[j] = 8.0f;
    L->d_params = dev_upload(params, L->count * 4);
    L->d_bias = dev_upload(bias, (size_t)n * 4);
    GPU_OK(lm_cuda_alloc((void **)&L->d_bf16, L->count * 2));
    GPU_OK(lm_cuda_upload_bf16(L->d_bf16, params, L->count));
    lm_moe_params_carve(cfg, L->d_params, &L->pf);
    float *const *src = &hp.router;
    uint16_t **dst = &L->pb.router;
    for (int i = 0; i < 10; i++) dst[i] = src[i] ? L->d_bf16 + (src[i] - params) : NULL;
    const size_t per = (size_t)cfg->d_ff * de, first = (size_t)me * nl;
    L->pb.gate += first * per, L->pb.up += first * per, L->pb.down += first * per;
    L->d_g = dev_zero(L->count * 4);
    lm_moe_params_carve(cfg, L->d_g, &L->g);
    L->g.gate += first * per, L->g.up += first * per, L->g.down += first * per;
    L->d_y = dev_zero((size_t)m * cfg->d * 4);
    L->d_dx = dev_zero((size_t)m * cfg->d * 4);
    size_t ab = lm_cuda_moe_acts_bytes(cfg, m), sb = lm_cuda_moe_scratch_bytes(cfg, m);
    L->ablk = dev_zero(ab);
    L->sblk = dev_zero(sb);
    GPU_OK(lm_cuda_moe_acts_carve(&L->a, cfg, m, L->ablk, ab));
    GPU_OK(lm_cuda_moe_scratch_carve(&L->s, cfg, m, L->sblk, sb));
    GPU_OK(lm_cuda_moe_ep_create(ctx, comm, cfg, &L->ep));
    free(params);
    free(bias);
}

static void layer_free(layer *L) {
    lm_cuda_moe_ep_free(L->ep);
    void *b[] = {L->d_params, L->d_g, L->d_y, L->d_dx, L->d_bias, L->d_bf16, L->ablk, L->sblk};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) lm_cuda_free(b[i]);
}

/* forward A, forward B, backward B, backward A (a model's order) on x; the
 * results of both layers (y, dx, the gradient blocks) into out [2][...] */
static void two_layers(const lm_moe_config *cfg, int64_t m, const float *d_x, const float *d_dy, int share,
                       float **out) {
    layer L[2];
    layer_init(&L[0], cfg, m, 51, 0);
    layer_init(&L[1], cfg, m, 52, 1);
    if (share) GPU_OK(lm_cuda_moe_ep_share(L[1].ep, L[0].ep));
    for (int i = 0; i < 2; i++)
        GPU_OK(lm_cuda_moe_forward_ep(ctx, L[i].d_y, d_x, NULL, L[i].d_bias, cfg, &L[i].pf, &L[i].pb, &L[i].a, m,
                                      L[i].ep));
    for (int i = 1; i >= 0; i--)
        GPU_OK(lm_cuda_moe_backward_ep(ctx, L[i].d_dx, &L[i].g, d_dy, NULL, d_x, NULL, cfg, &L[i].pf, &L[i].pb, &L[i].a,
                                       &L[i].s, L[i].ep));
    GPU_OK(lm_cuda_context_sync(ctx));
    if (share)
        CHECK(lm_cuda_moe_ep_bytes(L[0].ep, 1) == lm_cuda_moe_ep_bytes(L[1].ep, 1),
              "the sharing handles hold call buffers of %zu and %zu bytes", lm_cuda_moe_ep_bytes(L[0].ep, 1),
              lm_cuda_moe_ep_bytes(L[1].ep, 1));
    const size_t md = (size_t)m * cfg->d;
    for (int i = 0; i < 2; i++) {
        out[i] = malloc((2 * md + L[i].count) * 4);
        download(out[i], L[i].d_y, md * 4);
        download(out[i] + md, L[i].d_dx, md * 4);
        download(out[i] + 2 * md, L[i].d_g, L[i].count * 4);
        layer_free(&L[i]);
    }
}

/* Two layers' handles sharing one set of call-time buffers (lm_cuda_moe_ep_share,
 * as a model's layers do), the second layer's skewed load growing them between
 * the first layer's forward and backward: every result the separate handles'
 * bits. */
static void test_layers_sharing_call_buffers_give_their_own_bits(void) {
    lm_moe_config c = lm_moe_config_default(64, 8, 2, 32);
    c.d_latent = 32;
    c.n_shared = 1;
    c.d_ff_shared = 48;
    const int64_t m = 300 + 40 * me;
    lm_rng r;
    lm_rng_seed(&r, 61 + (uint64_t)me);
    float *x = host_normal((size_t)m * c.d, 1.0, 0.0, 1, &r), *dy = host_normal((size_t)m * c.d, 1.0, 0.0, 1, &r);
    float *d_x = dev_upload(x, (size_t)m * c.d * 4), *d_dy = dev_upload(dy, (size_t)m * c.d * 4);
    float *own[2], *shared[2];
    two_layers(&c, m, d_x, d_dy, 0, own);
    two_layers(&c, m, d_x, d_dy, 1, shared);
    const size_t n = 2 * (size_t)m * c.d + lm_moe_param_count(&c);
    for (int i = 0; i < 2; i++) {
        CHECK(!memcmp(own[i], shared[i], n * 4), "layer %d: results differ with shared call buffers", i);
        free(own[i]);
        free(shared[i]);
    }
    lm_cuda_free(d_x);
    lm_cuda_free(d_dy);
    free(x);
    free(dy);
}

static void test_refusals(void) {
    lm_moe_config c = lm_moe_config_default(64, 8, 2, 32);
    lm_cuda_moe_ep *ep = NULL;
    GPU_OK(lm_cuda_moe_ep_create(ctx, comm, &c, &ep));
    lm_moe_config other = c;
    other.d_ff = 48;
    lm_cuda_moe_acts a;
    memset(&a, 0, sizeof a);
    CHECK(lm_cuda_moe_forward_ep(ctx, NULL, NULL, NULL, NULL, &other, NULL, NULL, &a, 0, ep) == LM_ERR_ARG &&
              strstr(lm_last_error(), "made for"),
          "a layer of another shape: %s", lm_last_error());
    CHECK(lm_cuda_moe_ep_reserve(ep, -1) == LM_ERR_ARG, "negative reserve");
    lm_cuda_moe_ep *wide = NULL;
    GPU_OK(lm_cuda_moe_ep_create(ctx, comm, &other, &wide));
    CHECK(lm_cuda_moe_ep_share(wide, ep) == LM_ERR_ARG && strstr(lm_last_error(), "cannot use"),
          "sharing the buffers of other expert shapes: %s", lm_last_error());
    lm_cuda_moe_ep_free(wide);
    lm_cuda_moe_ep_free(ep);
    if (R > 1) {
        lm_moe_config odd = lm_moe_config_default(64, 2 * R + 1, 2, 32);
        lm_cuda_moe_ep *bad = NULL;
        CHECK(lm_cuda_moe_ep_create(ctx, comm, &odd, &bad) == LM_ERR_ARG && !bad &&
                  strstr(lm_last_error(), "divisible"),
              "%d experts over %d ranks: %s", 2 * R + 1, R, lm_last_error());
    }
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) want_ranks = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: test_cuda_moe_ep [--ranks N]\n");
            return 2;
        }
    }
    test_skip_without_cuda();
    if (!test_skip_all_reason && want_ranks && !lm_comm_engine_available(LM_COMM_MPI)) {
        fprintf(stderr, "--ranks %d needs the MPI engine, which this build lacks\n", want_ranks);
        return 1;
    }
    if (!test_skip_all_reason) {
        int local = 0;
        if (lm_comm_open(want_ranks ? LM_COMM_MPI : LM_COMM_SELF, &host) || lm_comm_local_rank(host, &local) ||
            lm_backend_cuda_create_local(local, &be) || lm_comm_open_staged(host, be, &comm)) {
            fprintf(stderr, "cannot open the staged engine: %s\n", lm_last_error());
            return 1;
        }
        ctx = (const lm_cuda_context *)be->ctx;
        R = lm_comm_size(comm);
        me = lm_comm_rank(comm);
        if (me) freopen("/dev/null", "w", stdout); /* one rank prints the cases; every rank prints failures */
        if (want_ranks && R != want_ranks) {
            fprintf(stderr, "started on %d ranks, expected %d\n", R, want_ranks);
            return 1;
        }
        if (R > 64) {
            fprintf(stderr, "at most 64 ranks\n");
            return 1;
        }
    } else {
        fprintf(stderr, "test_cuda_moe_ep: %s: every case skips\n", test_skip_all_reason);
    }
    RUN(test_swiglu_equals_the_one_process_layer_for_every_kind);
    RUN(test_latent_situ_with_a_shared_expert);
    RUN(test_every_token_to_rank_0s_experts);
    RUN(test_a_rank_without_tokens_still_takes_part);
    RUN(test_layers_sharing_call_buffers_give_their_own_bits);
    RUN(test_refusals);
    if (comm) {
        /* a failure on any rank fails the job's summary */
        int32_t failed = test_failed_count;
        if (lm_comm_all_reduce_sum(host, &failed, &failed, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = failed;
        lm_comm_close(comm);
        lm_backend_free(be);
        lm_comm_close(host);
    }
    return test_summary();
}
