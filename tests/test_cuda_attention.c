/* Causal attention on the GPU (include/longmoe/attention_cuda.h) against the
 * CPU operator (include/longmoe/attention.h), for every implementation built:
 * flash (our kernels), cudnn, cudnn-fast and cudnn-blocked (cuDNN's fused
 * attention; the blocked backward in blocks of 64 rows here; a kind not built,
 * or a shape cuDNN refuses, prints "skipped"). Offsets (queries at
 * positions q_offset.. of longer key/value rows) against
 * lm_attention_forward_offset / _backward_offset.
 *
 * Both sides see identical inputs: q, k, v and d_o are rounded to bf16 first
 * (the kernels' input format); the CPU operator then runs in fp32. The CPU
 * backward gets its own fp32 o and lse, the GPU backward the GPU's bf16 o and
 * fp32 lse (as in training). Tolerances: relative error ||got - want|| /
 * ||want|| <= 1e-2 for the bf16 outputs (o, dq, dk, dv), <= 1e-3 for lse and
 * the per-head maximum logit. Output buffers are filled with bf16 NaN before
 * each call, so every element must be written. Needs a CUDA GPU (label cuda). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/attention.h"
#include "longmoe/attention_cuda.h"
#include "test.h"
#include "test_cuda.h"

static lm_cuda_context ctx;

/* the implementation the cases run (each case loops over KINDS) */
static lm_attention_kind kind = LM_ATTENTION_FLASH;
static const lm_attention_kind KINDS[] = {LM_ATTENTION_FLASH, LM_ATTENTION_CUDNN, LM_ATTENTION_CUDNN_FAST,
                                          LM_ATTENTION_CUDNN_BLOCKED};
#define NKINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

/* 1 when `kind` is built; prints "skipped" otherwise */
static int kind_built(lm_attention_kind k, const char *what) {
    if (k == LM_ATTENTION_FLASH || lm_cuda_attention_cudnn_built()) return 1;
    printf("    %-10s %s: skipped (the cuDNN attention is not built)\n", lm_attention_kind_name(k), what);
    return 0;
}

typedef struct {
    lm_attention_config cfg;
    int q_offset;              /* queries at positions q_offset .. q_offset+T-1; keys Tk = q_offset + T */
    size_t nq, nk, nv, no, nl; /* element counts of q, k, v, o (= d_o), lse */
    float *q, *k, *v, *d_o;    /* host, bf16-rounded */
    uint16_t *q_dev, *k_dev, *v_dev, *do_dev, *o_gpu, *dq_gpu, *dk_gpu, *dv_gpu; /* device bf16 */
    float *lse_gpu, *hmax_gpu, *ws;                                      /* device fp32 */
    size_t ws_bytes;
} problem;

/* The context's stream does not wait for the legacy stream: finish the copy first. */
static void upload(uint16_t *d, const float *h, size_t n) {
    if (lm_cuda_upload_bf16(d, h, n)) dieAt("upload: %s", lm_last_error());
    cudaCheck(cudaDeviceSynchronize());
}

/* Fresh random bf16 inputs (q and k normal: scores about N(0, 1) at the
 * default scale), device buffers for everything; keys and values have
 * q_offset + T rows. The workspace is the current kind's. */
static problem make_problem_offset(int B, int T, int H, int Hkv, int Dk, int Dv, int q_offset, uint64_t seed) {
    problem p;
    memset(&p, 0, sizeof p);
    p.cfg = lm_attention_config_default(B, T, H, Hkv, Dk, Dv);
    p.q_offset = q_offset;
    const int Tk = q_offset + T;
    p.nq = (size_t)B * T * H * Dk;
    p.nk = (size_t)B * Tk * Hkv * Dk;
    p.nv = (size_t)B * Tk * Hkv * Dv;
    p.no = (size_t)B * T * H * Dv;
    p.nl = (size_t)B * H * T;
    lm_rng r;
    lm_rng_seed(&r, seed);
    p.q = mallocCheck(p.nq * 4);
    p.k = mallocCheck(p.nk * 4);
    p.v = mallocCheck(p.nv * 4);
    p.d_o = mallocCheck(p.no * 4);
    fill_normal(p.q, p.nq, &r, 1.0, 0.0, 1);
    fill_normal(p.k, p.nk, &r, 1.0, 0.0, 1);
    fill_normal(p.v, p.nv, &r, 1.0, 0.0, 1);
    fill_normal(p.d_o, p.no, &r, 1.0, 0.0, 1);
    p.q_dev = dev_alloc(p.nq * 2);
    p.k_dev = dev_alloc(p.nk * 2);
    p.v_dev = dev_alloc(p.nv * 2);
    p.do_dev = dev_alloc(p.no * 2);
    p.o_gpu = dev_alloc(p.no * 2);
    p.dq_gpu = dev_alloc(p.nq * 2);
    p.dk_gpu = dev_alloc(p.nk * 2);
    p.dv_gpu = dev_alloc(p.nv * 2);
    p.lse_gpu = dev_alloc(p.nl * 4);
    p.hmax_gpu = dev_alloc((size_t)H * 4);
    p.ws_bytes = lm_cuda_attention_backward_workspace_bytes_kind(&p.cfg, kind, q_offset);
    if (p.ws_bytes == 0) dieAt("%s: no backward workspace for this shape: %s", lm_attention_kind_name(kind),
                               lm_last_error());
    p.ws = dev_alloc(p.ws_bytes);
    upload(p.q_dev, p.q, p.nq);
    upload(p.k_dev, p.k, p.nk);
    upload(p.v_dev, p.v, p.nv);
    upload(p.do_dev, p.d_o, p.no);
    return p;
}

static problem make_problem(int B, int T, int H, int Hkv, int Dk, int Dv, uint64_t seed) {
    return make_problem_offset(B, T, H, Hkv, Dk, Dv, 0, seed);
}

static void free_problem(problem *p) {
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->d_o);
    uint16_t *d16[] = {p->q_dev, p->k_dev, p->v_dev, p->do_dev, p->o_gpu, p->dq_gpu, p->dk_gpu, p->dv_gpu};
    for (int i = 0; i < 8; i++) lm_cuda_free(d16[i]);
    lm_cuda_free(p->lse_gpu);
    lm_cuda_free(p->hmax_gpu);
    lm_cuda_free(p->ws);
}

/* bf16 NaN (0xFFFF) everywhere in the outputs, fp32 NaN in lse. */
static void poison_outputs(problem *p) {
    cudaCheck(cudaMemset(p->o_gpu, 0xFF, p->no * 2));
    cudaCheck(cudaMemset(p->dq_gpu, 0xFF, p->nq * 2));
    cudaCheck(cudaMemset(p->dk_gpu, 0xFF, p->nk * 2));
    cudaCheck(cudaMemset(p->dv_gpu, 0xFF, p->nv * 2));
    cudaCheck(cudaMemset(p->lse_gpu, 0xFF, p->nl * 4));
    cudaCheck(cudaMemset(p->hmax_gpu, 0xFF, (size_t)p->cfg.H * 4));
    cudaCheck(cudaDeviceSynchronize());
}

static lm_status gpu_forward(problem *p) {
    lm_status st = lm_cuda_attention_forward_kind(&ctx, &p->cfg, kind, p->q_offset, p->q_dev, p->k_dev, p->v_dev,
                                                  p->o_gpu, p->lse_gpu, p->hmax_gpu);
    return st ? st : lm_cuda_context_sync(&ctx);
}

static lm_status gpu_backward(problem *p) {
    lm_status st = lm_cuda_attention_backward_kind(&ctx, &p->cfg, kind, p->q_offset, p->q_dev, p->k_dev,
                                                   p->v_dev, p->o_gpu, p->do_dev, p->lse_gpu, p->dq_gpu,
                                                   p->dk_gpu, p->dv_gpu, p->ws, p->ws_bytes);
    return st ? st : lm_cuda_context_sync(&ctx);
}

static int same_device_bytes(const void *a, const void *b_host, size_t bytes) {
    void *h = mallocCheck(bytes ? bytes : 1);
    lm_cuda_download(h, a, bytes);
    int same = !memcmp(h, b_host, bytes);
    free(h);
    return same;
}

static void *copy_device(const void *d, size_t bytes) {
    void *h = mallocCheck(bytes ? bytes : 1);
    lm_cuda_download(h, d, bytes);
    return h;
}

/* 1 when the current kind runs this shape forward and backward; prints
 * "skipped" with cuDNN's reason otherwise. */
static int kind_runs(const lm_attention_config *c, int q_offset, const char *what) {
    if (kind == LM_ATTENTION_FLASH) return 1;
    if (lm_cuda_attention_kind_supported(c, q_offset, kind, 0) &&
        lm_cuda_attention_kind_supported(c, q_offset, kind, 1))
        return 1;
    printf("    %-10s %s: skipped (%s)\n", lm_attention_kind_name(kind), what, lm_last_error());
    return 0;
}

/* Forward (o, lse, per-head max logit) and backward (dq, dk, dv) of the GPU
 * (the current kind) against the CPU operator on one shape; scale 0 is the
 * default Dk^-1/2. */
static void check_case(int B, int T, int H, int Hkv, int Dk, int Dv, int q_offset, float scale, uint64_t seed) {
    char what[128];
    snprintf(what, sizeof what, "B%d T%d H%d Hkv%d Dk%d Dv%d off%d scale%g", B, T, H, Hkv, Dk, Dv, q_offset,
             (double)scale);
    lm_attention_config probe = lm_attention_config_default(B, T, H, Hkv, Dk, Dv);
    probe.scale = scale;
    if (!kind_runs(&probe, q_offset, what)) return;
    problem p = make_problem_offset(B, T, H, Hkv, Dk, Dv, q_offset, seed);
    p.cfg.scale = scale;
    const lm_attention_config *c = &p.cfg;

    float *o_cpu = mallocCheck(p.no * 4), *lse_cpu = mallocCheck(p.nl * 4);
    float *rowmax = mallocCheck(p.nl * 4);
    lm_status st = lm_attention_forward_offset(c, q_offset, p.q, p.k, p.v, o_cpu, lse_cpu, rowmax);
    CHECK(st == LM_OK, "%s: cpu forward: %s", what, lm_last_error());
    float *hmax_cpu = mallocCheck((size_t)H * 4);
    for (int h = 0; h < H; h++) {
        hmax_cpu[h] = -INFINITY;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++)
                hmax_cpu[h] = fmaxf(hmax_cpu[h], rowmax[((size_t)b * H + h) * T + t]);
    }

    poison_outputs(&p);
    st = gpu_forward(&p);
    CHECK(st == LM_OK, "%s: cuda forward: %s", what, lm_last_error());
    float *o_gpu = host_download_bf16(p.o_gpu, p.no), *lse_gpu = host_download_f32(p.lse_gpu, p.nl);
    float *hmax_gpu = host_download_f32(p.hmax_gpu, (size_t)H);
    double eo = rel_err(o_gpu, o_cpu, p.no), el = rel_err(lse_gpu, lse_cpu, p.nl);
    double eh = rel_err(hmax_gpu, hmax_cpu, (size_t)H);

    /* without the head max (another cuDNN plan: lse straight from cuDNN) and without lse */
    cudaCheck(cudaMemset(p.lse_gpu, 0xFF, p.nl * 4));
    st = lm_cuda_attention_forward_kind(&ctx, c, kind, q_offset, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu,
                                        NULL);
    if (!st) st = lm_cuda_context_sync(&ctx);
    CHECK(st == LM_OK, "%s: cuda forward without head max: %s", what, lm_last_error());
    float *lse2 = host_download_f32(p.lse_gpu, p.nl);
    double el2 = rel_err(lse2, lse_cpu, p.nl);
    cudaCheck(cudaMemset(p.o_gpu, 0xFF, p.no * 2));
    st = lm_cuda_attention_forward_kind(&ctx, c, kind, q_offset, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, NULL, NULL);
    if (!st) st = lm_cuda_context_sync(&ctx);
    CHECK(st == LM_OK, "%s: cuda forward without lse: %s", what, lm_last_error());
    float *o3 = host_download_bf16(p.o_gpu, p.no);
    double eo3 = rel_err(o3, o_cpu, p.no);
    /* the backward reads the full forward's o and lse again */
    st = gpu_forward(&p);
    CHECK(st == LM_OK, "%s: cuda forward: %s", what, lm_last_error());

    float *dq_cpu = calloc(p.nq, 4), *dk_cpu = calloc(p.nk, 4), *dv_cpu = calloc(p.nv, 4);
    if (!dq_cpu || !dk_cpu || !dv_cpu) dieAt("out of memory");
    st = lm_attention_backward_offset(c, q_offset, p.q, p.k, p.v, o_cpu, lse_cpu, p.d_o, dq_cpu, dk_cpu, dv_cpu);
    CHECK(st == LM_OK, "%s: cpu backward: %s", what, lm_last_error());
    st = gpu_backward(&p);
    CHECK(st == LM_OK, "%s: cuda backward: %s", what, lm_last_error());
    float *dq_gpu = host_download_bf16(p.dq_gpu, p.nq), *dk_gpu = host_download_bf16(p.dk_gpu, p.nk);
    float *dv_gpu = host_download_bf16(p.dv_gpu, p.nv);
    double eq = rel_err(dq_gpu, dq_cpu, p.nq), ek = rel_err(dk_gpu, dk_cpu, p.nk);
    double ev = rel_err(dv_gpu, dv_cpu, p.nv);
    printf("    %-10s %-44s o %.1e lse %.1e hmax %.1e | dq %.1e dk %.1e dv %.1e\n", lm_attention_kind_name(kind),
           what, eo, el, eh, eq, ek, ev);
    CHECK(eo <= 1e-2, "%s %s: o relative error %.3g", lm_attention_kind_name(kind), what, eo);
    CHECK(eo3 <= 1e-2, "%s %s: o (no lse) relative error %.3g", lm_attention_kind_name(kind), what, eo3);
    CHECK(el <= 1e-3, "%s %s: lse relative error %.3g", lm_attention_kind_name(kind), what, el);
    CHECK(el2 <= 1e-3, "%s %s: lse (no head max) relative error %.3g", lm_attention_kind_name(kind), what, el2);
    CHECK(eh <= 1e-3, "%s %s: head max logit relative error %.3g", lm_attention_kind_name(kind), what, eh);
    CHECK(eq <= 1e-2, "%s %s: dq relative error %.3g", lm_attention_kind_name(kind), what, eq);
    CHECK(ek <= 1e-2, "%s %s: dk relative error %.3g", lm_attention_kind_name(kind), what, ek);
    CHECK(ev <= 1e-2, "%s %s: dv relative error %.3g", lm_attention_kind_name(kind), what, ev);

    free(o_cpu);
    free(lse_cpu);
    free(rowmax);
    free(hmax_cpu);
    free(o_gpu);
    free(lse_gpu);
    free(lse2);
    free(o3);
    free(hmax_gpu);
    free(dq_cpu);
    free(dk_cpu);
    free(dv_cpu);
    free(dq_gpu);
    free(dk_gpu);
    free(dv_gpu);
    free_problem(&p);
}

/* check_case for every kind built */
static void check_shape_offset(int B, int T, int H, int Hkv, int Dk, int Dv, int q_offset, float scale,
                               uint64_t seed) {
    for (int i = 0; i < NKINDS; i++) {
        if (!kind_built(KINDS[i], "this shape")) continue;
        kind = KINDS[i];
        check_case(B, T, H, Hkv, Dk, Dv, q_offset, scale, seed);
    }
    kind = LM_ATTENTION_FLASH;
}

static void check_shape(int B, int T, int H, int Hkv, int Dk, int Dv, uint64_t seed) {
    check_shape_offset(B, T, H, Hkv, Dk, Dv, 0, 0.f, seed);
}

static void test_forward_and_backward_match_cpu_operator(void) {
    /* T = 1, odd T (partial tiles), T past several tiles, GQA, every head dim */
    const int shapes[][6] = {{1, 1, 2, 2, 64, 64},     {2, 37, 4, 2, 64, 64},
                             {1, 200, 2, 2, 128, 128}, {1, 300, 2, 2, 32, 32},
                             {2, 130, 8, 8, 128, 128}, {1, 256, 4, 1, 64, 64},
                             {1, 333, 6, 2, 128, 128}};
    for (int s = 0; s < (int)(sizeof shapes / sizeof shapes[0]); s++)
        check_shape(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], shapes[s][4],
                    shapes[s][5], 100 + s);
}

static void test_key_and_value_dims_may_differ(void) {
    check_shape(1, 150, 4, 1, 64, 128, 201);
    check_shape(2, 97, 2, 2, 128, 32, 202);
    check_shape(1, 70, 2, 1, 32, 64, 203);
}

/* A scale other than the default (cuDNN's max logit must be of the scaled scores). */
static void test_explicit_scale(void) {
    check_shape_offset(2, 129, 4, 2, 64, 64, 0, 0.3f, 211);
    check_shape_offset(1, 77, 2, 1, 128, 128, 0, 0.05f, 212);
}

/* Queries at positions q_offset .. q_offset+T-1 of longer sequences, against
 * lm_attention_forward_offset / _backward_offset: offsets inside and across
 * tiles, T = 1, T smaller and larger than the offset, GQA, Dk != Dv. */
static void test_offsets_match_cpu_operator(void) {
    check_shape_offset(1, 100, 4, 2, 64, 64, 37, 0.f, 601);
    check_shape_offset(2, 64, 2, 2, 128, 128, 128, 0.f, 602);
    check_shape_offset(1, 1, 2, 1, 64, 64, 200, 0.f, 603);
    check_shape_offset(1, 250, 4, 4, 32, 32, 13, 0.f, 604);
    check_shape_offset(2, 33, 6, 2, 128, 64, 301, 0.4f, 605);
    check_shape_offset(1, 130, 2, 1, 64, 128, 64, 0.f, 606);
}

/* The _offset calls with q_offset 0 are the plain calls, bit for bit. */
static void test_offset_zero_is_the_plain_call(void) {
    problem p = make_problem(2, 141, 4, 2, 64, 64, 611);
    const lm_attention_config *c = &p.cfg;
    lm_status st = lm_cuda_attention_forward(&ctx, c, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, p.hmax_gpu);
    CHECK(st == LM_OK, "forward: %s", lm_last_error());
    size_t ws = lm_cuda_attention_backward_workspace_bytes(c);
    CHECK(ws == lm_cuda_attention_backward_workspace_bytes_offset(c, 0), "workspace sizes differ at offset 0");
    void *wsd = dev_alloc(ws);
    st = lm_cuda_attention_backward(&ctx, c, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.do_dev, p.lse_gpu, p.dq_gpu,
                                    p.dk_gpu, p.dv_gpu, wsd, ws);
    CHECK(st == LM_OK, "backward: %s", lm_last_error());
    cudaCheck(cudaDeviceSynchronize());
    void *o = copy_device(p.o_gpu, p.no * 2), *l = copy_device(p.lse_gpu, p.nl * 4);
    void *hm = copy_device(p.hmax_gpu, (size_t)c->H * 4), *dq = copy_device(p.dq_gpu, p.nq * 2);
    void *dk = copy_device(p.dk_gpu, p.nk * 2), *dv = copy_device(p.dv_gpu, p.nv * 2);
    poison_outputs(&p);
    st = lm_cuda_attention_forward_offset(&ctx, c, 0, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, p.hmax_gpu);
    CHECK(st == LM_OK, "forward_offset: %s", lm_last_error());
    st = lm_cuda_attention_backward_offset(&ctx, c, 0, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.do_dev, p.lse_gpu,
                                           p.dq_gpu, p.dk_gpu, p.dv_gpu, wsd, ws);
    CHECK(st == LM_OK, "backward_offset: %s", lm_last_error());
    cudaCheck(cudaDeviceSynchronize());
    CHECK(same_device_bytes(p.o_gpu, o, p.no * 2), "o differs");
    CHECK(same_device_bytes(p.lse_gpu, l, p.nl * 4), "lse differs");
    CHECK(same_device_bytes(p.hmax_gpu, hm, (size_t)c->H * 4), "head max differs");
    CHECK(same_device_bytes(p.dq_gpu, dq, p.nq * 2), "dq differs");
    CHECK(same_device_bytes(p.dk_gpu, dk, p.nk * 2), "dk differs");
    CHECK(same_device_bytes(p.dv_gpu, dv, p.nv * 2), "dv differs");
    free(o);
    free(l);
    free(hm);
    free(dq);
    free(dk);
    free(dv);
    lm_cuda_free(wsd);
    free_problem(&p);
}

/* Changing token t0's q, k and v (every head) leaves the outputs and lse of
 * every earlier token bit-identical, and does change token t0's. */
static void future_tokens_case(void) {
    const int B = 2, T = 211, H = 4, Hkv = 2, D = 64, t0 = 150;
    lm_attention_config probe = lm_attention_config_default(B, T, H, Hkv, D, D);
    if (!kind_runs(&probe, 0, "causality")) return;
    problem p = make_problem(B, T, H, Hkv, D, D, 301);
    CHECK(gpu_forward(&p) == LM_OK, "forward: %s", lm_last_error());
    uint16_t *o1 = mallocCheck(p.no * 2), *o2 = mallocCheck(p.no * 2);
    float *l1 = mallocCheck(p.nl * 4), *l2 = mallocCheck(p.nl * 4);
    lm_cuda_download(o1, p.o_gpu, p.no * 2);
    lm_cuda_download(l1, p.lse_gpu, p.nl * 4);
    lm_rng r;
    lm_rng_seed(&r, 302);
    for (int b = 0; b < B; b++) {
        fill_normal(p.q + ((size_t)b * T + t0) * H * D, (size_t)H * D, &r, 1.0, 0.0, 1);
        fill_normal(p.k + ((size_t)b * T + t0) * Hkv * D, (size_t)Hkv * D, &r, 1.0, 0.0, 1);
        fill_normal(p.v + ((size_t)b * T + t0) * Hkv * D, (size_t)Hkv * D, &r, 1.0, 0.0, 1);
    }
    upload(p.q_dev, p.q, p.nq);
    upload(p.k_dev, p.k, p.nk);
    upload(p.v_dev, p.v, p.nv);
    CHECK(gpu_forward(&p) == LM_OK, "forward: %s", lm_last_error());
    lm_cuda_download(o2, p.o_gpu, p.no * 2);
    lm_cuda_download(l2, p.lse_gpu, p.nl * 4);
    int earlier_same = 1, later_changed = 1;
    for (int b = 0; b < B; b++) {
        const size_t row = (size_t)H * D, at = (size_t)b * T * row;
        if (memcmp(o1 + at, o2 + at, (size_t)t0 * row * 2)) earlier_same = 0;
        if (!memcmp(o1 + at + (size_t)t0 * row, o2 + at + (size_t)t0 * row, row * 2)) later_changed = 0;
        for (int h = 0; h < H; h++) {
            const size_t l = ((size_t)b * H + h) * T;
            if (memcmp(l1 + l, l2 + l, (size_t)t0 * 4)) earlier_same = 0;
            if (l1[l + t0] == l2[l + t0]) later_changed = 0;
        }
    }
    CHECK(earlier_same, "%s: outputs of tokens < %d changed when token %d changed", lm_attention_kind_name(kind),
          t0, t0);
    CHECK(later_changed, "%s: token %d's outputs did not change with its inputs", lm_attention_kind_name(kind), t0);
    free(o1);
    free(o2);
    free(l1);
    free(l2);
    free_problem(&p);
}

static void test_future_tokens_do_not_change_earlier_outputs(void) {
    for (int i = 0; i < NKINDS; i++) {
        if (!kind_built(KINDS[i], "causality")) continue;
        kind = KINDS[i];
        future_tokens_case();
    }
    kind = LM_ATTENTION_FLASH;
}

/* Two runs on the same inputs give bit-identical o, lse, head max, dq, dk, dv
 * (GQA, so dk and dv sum over a group of query heads). */
static void bit_identity_case(int q_offset) {
    lm_attention_config probe = lm_attention_config_default(2, 300, 8, 2, 128, 128);
    if (!kind_runs(&probe, q_offset, "bit identity")) return;
    problem p = make_problem_offset(2, 300, 8, 2, 128, 128, q_offset, 401);
    CHECK(gpu_forward(&p) == LM_OK, "forward: %s", lm_last_error());
    CHECK(gpu_backward(&p) == LM_OK, "backward: %s", lm_last_error());
    void *o = copy_device(p.o_gpu, p.no * 2), *l = copy_device(p.lse_gpu, p.nl * 4);
    void *hm = copy_device(p.hmax_gpu, (size_t)p.cfg.H * 4);
    void *dq = copy_device(p.dq_gpu, p.nq * 2), *dk = copy_device(p.dk_gpu, p.nk * 2);
    void *dv = copy_device(p.dv_gpu, p.nv * 2);
    for (int rep = 0; rep < 3; rep++) {
        poison_outputs(&p);
        CHECK(gpu_forward(&p) == LM_OK, "forward: %s", lm_last_error());
        CHECK(gpu_backward(&p) == LM_OK, "backward: %s", lm_last_error());
        const char *n = lm_attention_kind_name(kind);
        CHECK(same_device_bytes(p.o_gpu, o, p.no * 2), "%s off %d: o differs in run %d", n, q_offset, rep + 2);
        CHECK(same_device_bytes(p.lse_gpu, l, p.nl * 4), "%s off %d: lse differs in run %d", n, q_offset, rep + 2);
        CHECK(same_device_bytes(p.hmax_gpu, hm, (size_t)p.cfg.H * 4), "%s off %d: head max differs in run %d", n,
              q_offset, rep + 2);
        CHECK(same_device_bytes(p.dq_gpu, dq, p.nq * 2), "%s off %d: dq differs in run %d", n, q_offset, rep + 2);
        CHECK(same_device_bytes(p.dk_gpu, dk, p.nk * 2), "%s off %d: dk differs in run %d", n, q_offset, rep + 2);
        CHECK(same_device_bytes(p.dv_gpu, dv, p.nv * 2), "%s off %d: dv differs in run %d", n, q_offset, rep + 2);
    }
    free(o);
    free(l);
    free(hm);
    free(dq);
    free(dk);
    free(dv);
    free_problem(&p);
}

/* The deterministic kinds (flash, cudnn, cudnn-blocked; not cudnn-fast), with and without an offset. */
static void test_runs_are_bit_identical(void) {
    const lm_attention_kind det[] = {LM_ATTENTION_FLASH, LM_ATTENTION_CUDNN, LM_ATTENTION_CUDNN_BLOCKED};
    for (int i = 0; i < 3; i++) {
        if (!kind_built(det[i], "bit identity")) continue;
        kind = det[i];
        bit_identity_case(0);
        bit_identity_case(77);
    }
    kind = LM_ATTENTION_FLASH;
}

/* Head dims outside {32, 64, 128}, H not a multiple of Hkv, a missing or
 * small workspace and NULL tensors are refused with LM_ERR_ARG. */
static void test_bad_arguments_are_refused(void) {
    problem p = make_problem(1, 20, 2, 2, 64, 64, 501);
    lm_attention_config bad = p.cfg;
    bad.Dk = 96;
    CHECK(lm_cuda_attention_forward(&ctx, &bad, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) ==
              LM_ERR_ARG, "Dk = 96 accepted");
    bad = p.cfg;
    bad.Dv = 16;
    CHECK(lm_cuda_attention_forward(&ctx, &bad, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) ==
              LM_ERR_ARG, "Dv = 16 accepted");
    bad = p.cfg;
    bad.H = 3;
    CHECK(lm_cuda_attention_forward(&ctx, &bad, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) ==
              LM_ERR_ARG, "H = 3 with Hkv = 2 accepted");
    CHECK(lm_cuda_attention_forward(&ctx, &p.cfg, NULL, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) ==
              LM_ERR_ARG, "q = NULL accepted");
    CHECK(lm_cuda_attention_backward(&ctx, &p.cfg, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.do_dev, p.lse_gpu,
                                     p.dq_gpu, p.dk_gpu, p.dv_gpu, p.ws, p.ws_bytes - 4) ==
              LM_ERR_ARG, "a workspace 4 bytes short accepted");
    CHECK(lm_cuda_attention_backward(&ctx, &p.cfg, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.do_dev, NULL,
                                     p.dq_gpu, p.dk_gpu, p.dv_gpu, p.ws, p.ws_bytes) == LM_ERR_ARG,
          "lse = NULL accepted");
    CHECK(lm_cuda_attention_backward_workspace_bytes(&p.cfg) >= (size_t)1 * 2 * 20 * 4,
          "workspace smaller than B*H*T floats");
    CHECK(lm_cuda_attention_forward_offset(&ctx, &p.cfg, -1, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) ==
              LM_ERR_ARG, "q_offset = -1 accepted");
    for (int i = 0; i < NKINDS; i++) {
        if (!kind_built(KINDS[i], "short workspace")) continue;
        const size_t need = lm_cuda_attention_backward_workspace_bytes_kind(&p.cfg, KINDS[i], 0);
        if (need < 4) continue; /* nothing to cut */
        CHECK(lm_cuda_attention_backward_kind(&ctx, &p.cfg, KINDS[i], 0, p.q_dev, p.k_dev, p.v_dev, p.o_gpu,
                                              p.do_dev, p.lse_gpu, p.dq_gpu, p.dk_gpu, p.dv_gpu, p.ws,
                                              need - 4) == LM_ERR_ARG,
              "%s: a workspace 4 bytes short accepted", lm_attention_kind_name(KINDS[i]));
    }
    free_problem(&p);
}

/* LONGMOE_ATTENTION / LONGMOE_ATTENTION_BWD / LONGMOE_CUDNN_WORKSPACE_MB:
 * unknown values are refused by the plain calls, known ones choose the kind,
 * and auto takes the blocked cuDNN backward when the whole one's workspace is over the limit,
 * the flash backward when even the blocked one's is. */
static void test_selection_by_environment(void) {
    problem p = make_problem(1, 90, 4, 2, 64, 64, 701);
    const lm_attention_config *c = &p.cfg;
    lm_attention_kind k;
    setenv("LONGMOE_ATTENTION", "fastest", 1);
    CHECK(lm_cuda_attention_forward(&ctx, c, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) == LM_ERR_ARG,
          "LONGMOE_ATTENTION=fastest accepted");
    CHECK(strstr(lm_last_error(), "LONGMOE_ATTENTION") != NULL, "the error does not name the variable: %s",
          lm_last_error());
    setenv("LONGMOE_ATTENTION", "cudnn-fast", 1); /* only the backward's variable takes it */
    CHECK(lm_cuda_attention_env_kind(0, &k) == LM_ERR_ARG, "LONGMOE_ATTENTION=cudnn-fast accepted");
    setenv("LONGMOE_ATTENTION", "flash", 1);
    CHECK(lm_cuda_attention_resolve(c, 0, 0, &k) == LM_OK && k == LM_ATTENTION_FLASH, "flash: forward is %s",
          lm_attention_kind_name(k));
    CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_OK && k == LM_ATTENTION_FLASH, "flash: backward is %s",
          lm_attention_kind_name(k));
    setenv("LONGMOE_ATTENTION_BWD", "sometimes", 1);
    CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_ERR_ARG, "LONGMOE_ATTENTION_BWD=sometimes accepted");
    CHECK(lm_cuda_attention_backward_workspace_bytes(c) == 0, "a workspace size under a bad LONGMOE_ATTENTION_BWD");
    unsetenv("LONGMOE_ATTENTION_BWD");
    setenv("LONGMOE_ATTENTION", "cudnn", 1);
    if (!lm_cuda_attention_cudnn_built()) {
        CHECK(lm_cuda_attention_forward(&ctx, c, p.q_dev, p.k_dev, p.v_dev, p.o_gpu, p.lse_gpu, NULL) == LM_ERR_ARG,
              "LONGMOE_ATTENTION=cudnn accepted without cuDNN");
        printf("    cudnn selection: skipped (the cuDNN attention is not built)\n");
    } else {
        CHECK(lm_cuda_attention_resolve(c, 0, 0, &k) == LM_OK && k == LM_ATTENTION_CUDNN, "cudnn: forward is %s",
              lm_attention_kind_name(k));
        CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_OK && k == LM_ATTENTION_CUDNN, "cudnn: backward is %s",
              lm_attention_kind_name(k));
        setenv("LONGMOE_ATTENTION_BWD", "cudnn-fast", 1);
        CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_OK && k == LM_ATTENTION_CUDNN_FAST,
              "cudnn-fast: backward is %s", lm_attention_kind_name(k));
        unsetenv("LONGMOE_ATTENTION_BWD");
        setenv("LONGMOE_ATTENTION", "auto", 1);
        /* auto takes cuDNN where it runs the shape (the forward with the head max) */
        const int fwd_ok = lm_cuda_attention_kind_supported(c, 0, LM_ATTENTION_CUDNN, 0);
        CHECK(lm_cuda_attention_resolve(c, 0, 0, &k) == LM_OK &&
                  k == (fwd_ok ? LM_ATTENTION_CUDNN : LM_ATTENTION_FLASH),
              "auto: forward is %s", lm_attention_kind_name(k));
        const int bwd_ok = lm_cuda_attention_kind_supported(c, 0, LM_ATTENTION_CUDNN, 1);
        const size_t cudnn_ws = lm_cuda_attention_backward_workspace_bytes_kind(c, LM_ATTENTION_CUDNN, 0);
        const int bwd_cudnn = bwd_ok && cudnn_ws <= ((size_t)4096 << 20);
        CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_OK &&
                  k == (bwd_cudnn ? LM_ATTENTION_CUDNN : LM_ATTENTION_FLASH),
              "auto: backward is %s", lm_attention_kind_name(k));
        if (bwd_cudnn)
            CHECK(lm_cuda_attention_backward_workspace_bytes(c) == cudnn_ws, "auto: workspace %zu, cudnn's %zu",
                  lm_cuda_attention_backward_workspace_bytes(c), cudnn_ws);
        if (bwd_cudnn && cudnn_ws > 0) {
            setenv("LONGMOE_CUDNN_WORKSPACE_MB", "0", 1);
            CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_OK && k == LM_ATTENTION_FLASH,
                  "auto under a 0 MiB limit: backward is %s", lm_attention_kind_name(k));
            CHECK(lm_cuda_attention_backward_workspace_bytes(c) ==
                      lm_cuda_attention_backward_workspace_bytes_kind(c, LM_ATTENTION_FLASH, 0),
                  "auto under a 0 MiB limit: not the flash workspace");
            setenv("LONGMOE_CUDNN_WORKSPACE_MB", "lots", 1);
            CHECK(lm_cuda_attention_resolve(c, 0, 1, &k) == LM_ERR_ARG, "LONGMOE_CUDNN_WORKSPACE_MB=lots accepted");
            unsetenv("LONGMOE_CUDNN_WORKSPACE_MB");
        }
        /* a longer row whose whole dP buffer (1*4*4096*4096*2 bytes = 128 MiB) is over the limit:
         * auto takes the blocked backward (blocks of 64 rows here) while its workspace fits, and
         * flash when not even that fits */
        lm_attention_config lc = *c;
        lc.T = 4096;
        const size_t whole_ws = lm_cuda_attention_backward_workspace_bytes_kind(&lc, LM_ATTENTION_CUDNN, 0);
        const size_t block_ws = lm_cuda_attention_backward_workspace_bytes_kind(&lc, LM_ATTENTION_CUDNN_BLOCKED, 0);
        if (lm_cuda_attention_kind_supported(&lc, 0, LM_ATTENTION_CUDNN, 1) &&
            lm_cuda_attention_kind_supported(&lc, 0, LM_ATTENTION_CUDNN_BLOCKED, 1)) {
            CHECK(whole_ws > ((size_t)64 << 20) && block_ws < ((size_t)64 << 20),
                  "workspaces: whole %zu bytes, blocked %zu: the case needs whole > 64 MiB > blocked", whole_ws,
                  block_ws);
            setenv("LONGMOE_CUDNN_WORKSPACE_MB", "64", 1);
            CHECK(lm_cuda_attention_resolve(&lc, 0, 1, &k) == LM_OK && k == LM_ATTENTION_CUDNN_BLOCKED,
                  "auto over the limit: backward is %s, not cudnn-blocked", lm_attention_kind_name(k));
            CHECK(lm_cuda_attention_backward_workspace_bytes(&lc) == block_ws,
                  "auto over the limit: workspace %zu, cudnn-blocked's %zu",
                  lm_cuda_attention_backward_workspace_bytes(&lc), block_ws);
            setenv("LONGMOE_CUDNN_WORKSPACE_MB", "0", 1);
            CHECK(lm_cuda_attention_resolve(&lc, 0, 1, &k) == LM_OK && k == LM_ATTENTION_FLASH,
                  "auto under a 0 MiB limit (long row): backward is %s", lm_attention_kind_name(k));
            unsetenv("LONGMOE_CUDNN_WORKSPACE_MB");
        } else {
            printf("    blocked fallback: skipped (cuDNN has no backward plan for (1,4096,4,64): %s)\n",
                   lm_last_error());
        }
    }
    unsetenv("LONGMOE_ATTENTION");
    unsetenv("LONGMOE_ATTENTION_BWD");
    unsetenv("LONGMOE_CUDNN_WORKSPACE_MB");
    free_problem(&p);
}

int main(void) {
    /* the cases pick kinds themselves; the plain calls follow these */
    unsetenv("LONGMOE_ATTENTION");
    unsetenv("LONGMOE_ATTENTION_BWD");
    unsetenv("LONGMOE_CUDNN_WORKSPACE_MB");
    /* cudnn-blocked in blocks of 64 rows: the cases' 100-333 queries and offsets up to 301 run as many
     * blocks (keys before the queries, diagonal and later blocks, short last blocks) */
    setenv("LONGMOE_CUDNN_BLOCK", "64", 1);
    test_skip_without_cuda();
    if (!test_skip_all_reason && lm_cuda_context_create(&ctx)) {
        fprintf(stderr, "no usable CUDA device: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_forward_and_backward_match_cpu_operator);
    RUN(test_key_and_value_dims_may_differ);
    RUN(test_explicit_scale);
    RUN(test_offsets_match_cpu_operator);
    RUN(test_offset_zero_is_the_plain_call);
    RUN(test_future_tokens_do_not_change_earlier_outputs);
    RUN(test_runs_are_bit_identical);
    RUN(test_bad_arguments_are_refused);
    RUN(test_selection_by_environment);
    lm_cuda_context_destroy(&ctx);
    return test_summary();
}
