/* The CUDA backend (include/longmoe/backend.h; docs/cuda.md, "The CUDA
 * backend"): device memory, one stream, and the operators of src/cuda behind
 * the lm_ops table, with the CPU backend's semantics (src/ops/backend_cpu.c).
 *
 * Formats: every `void *` tensor of the table (the lp views, q, k, v, z, o and
 * their gradients) is bf16 on the device; every `float *` is fp32 device
 * memory; token ids are int32 device memory. Host values cross only where the
 * table says so (a loss sum, head maxima, a non-finite index, the balancer's
 * host state), and those calls synchronise.
 *
 * Scratch: the ops that need scratch beyond their arguments (RMSNorm and
 * embedding backward, the short-conv and KDA output backward, the KDA
 * operator's workspace, attention backward, the balancer's device counts)
 * take it from one arena owned by the backend. It grows only: a call needing
 * more than it holds waits for the stream, frees it and allocates the larger
 * size, which is then kept. All work runs on one stream, so consecutive ops
 * reusing the arena are ordered. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "cuda/backend/backend_internal.h"
#include "cuda/cuda_check.h"
#include "cuda/optim/optim_internal.h"
#include "longmoe/attention_cuda.h"
#include "longmoe/attnres_cuda.h"
#include "longmoe/backend.h"
#include "longmoe/balance.h"
#include "longmoe/cuda_context.h"
#include "longmoe/kda_cuda.h"
#include "longmoe/kda_layer_cuda.h"
#include "longmoe/linear_cuda.h"
#include "longmoe/moe_cuda.h"

/* arena sizes are rounded up to this (fewer regrowths while a step warms up) */
#define ARENA_GRANULE ((size_t)1 << 20)
/* logits of one cross-entropy chunk: at most this many bytes (fp32 + bf16) */
#define CE_CHUNK_BUDGET ((size_t)256 << 20)

typedef struct {
    float loss;                  /* the cross-entropy's loss sum */
    int finite;                  /* lm_cuda_all_finite's flag */
    unsigned long long first;    /* the first non-finite index */
} cuda_scalars;

typedef struct {
    lm_backend be;               /* first: an lm_backend * is a cuda_backend * */
    lm_cuda_context ctx;         /* be.ctx points here */
    void *arena;
    size_t arena_bytes;
    cuda_scalars *scalars;       /* device */
    double *sumsq_parts;         /* device, LM_CUDA_SUMSQ_PARTS: sum_squares' partial sums */
    unsigned long long *nonfinite; /* device, LM_NONFINITE_SLOTS: the deferred checks' slots (all ones: none) */
} cuda_backend;

static cuda_backend *cb_of(lm_backend *be) { return (cuda_backend *)be; }
static const lm_cuda_context *ctx_of(lm_backend *be) { return &cb_of(be)->ctx; }
static cudaStream_t stream_of(lm_backend *be) { return (cudaStream_t)cb_of(be)->ctx.stream; }
static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* The arena, at least `bytes` long (grown after a stream sync). */
static lm_status arena_get(lm_backend *be, size_t bytes, void **out) {
    cuda_backend *cb = cb_of(be);
    *out = NULL;
    if (bytes == 0) bytes = 256;
    if (bytes > cb->arena_bytes) {
        size_t grown = (bytes + ARENA_GRANULE - 1) / ARENA_GRANULE * ARENA_GRANULE;
        LM_CUDA_TRY(cudaStreamSynchronize(stream_of(be)));
        if (cb->arena) cudaFree(cb->arena);
        cb->arena = NULL;
        cb->arena_bytes = 0;
        LM_CUDA_TRY(cudaMalloc(&cb->arena, grown));
        cb->arena_bytes = grown;
    }
    *out = cb->arena;
    return LM_OK;
}

/* ---- memory ---- */

static lm_status cuda_alloc(lm_backend *be, size_t bytes, void **out) {
    *out = NULL;
    size_t n = bytes ? bytes : 64;
    void *p = NULL;
    LM_CUDA_TRY(cudaMalloc(&p, n)); /* 256-byte aligned */
    cudaError_t e = cudaMemsetAsync(p, 0, n, stream_of(be));
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_of(be));
    if (e != cudaSuccess) {
        cudaFree(p);
        LM_CUDA_TRY(e);
    }
    *out = p;
    return LM_OK;
}

static void cuda_release(lm_backend *be, void *ptr) {
    /* cudaFree waits for the device; finish the stream's work on ptr first */
    if (!ptr) return;
    cudaStreamSynchronize(stream_of(be));
    cudaFree(ptr);
}

static lm_status cuda_memory(lm_backend *be, size_t *used, size_t *total) {
    (void)be;
    size_t free_b = 0, total_b = 0;
    LM_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    *used = total_b - free_b;
    *total = total_b;
    return LM_OK;
}

static lm_status cuda_zero(lm_backend *be, void *ptr, size_t bytes) {
    if (!bytes) return LM_OK;
    if (!ptr) return lm_error(LM_ERR_ARG, "cuda zero: ptr is NULL");
    LM_CUDA_TRY(cudaMemsetAsync(ptr, 0, bytes, stream_of(be)));
    return LM_OK;
}

static lm_status cuda_copy(lm_backend *be, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return LM_OK;
    if (!dst || !src) return lm_error(LM_ERR_ARG, "cuda copy: dst or src is NULL");
    LM_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(be)));
    return LM_OK;
}

/* after the stream's earlier work; returns once the data is on the device */
static lm_status cuda_upload(lm_backend *be, void *dst, const void *host_src, size_t bytes) {
    if (!bytes) return LM_OK;
    if (!dst || !host_src) return lm_error(LM_ERR_ARG, "cuda upload: dst or host_src is NULL");
    LM_CUDA_TRY(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_of(be)));
    LM_CUDA_TRY(cudaStreamSynchronize(stream_of(be)));
    return LM_OK;
}

/* sees every op enqueued before it */
static lm_status cuda_download(lm_backend *be, void *host_dst, const void *src, size_t bytes) {
    if (!bytes) return LM_OK;
    if (!host_dst || !src) return lm_error(LM_ERR_ARG, "cuda download: host_dst or src is NULL");
    LM_CUDA_TRY(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(be)));
    LM_CUDA_TRY(cudaStreamSynchronize(stream_of(be)));
    return LM_OK;
}

static lm_status cuda_sync(lm_backend *be) { return lm_cuda_context_sync(ctx_of(be)); }

/* ---- products ---- */

static lm_status cuda_matmul_forward(lm_backend *be, float *out, const void *inp, const void *w, int64_t n, int ic,
                                     int oc) {
    return lm_cuda_matmul_forward(ctx_of(be), out, (const uint16_t *)inp, (const uint16_t *)w, n, ic, oc, 0);
}

static lm_status cuda_matmul_forward_lp(lm_backend *be, void *out, const void *inp, const void *w, int64_t n,
                                        int ic, int oc) {
    return lm_cuda_matmul_forward_bf16(ctx_of(be), (uint16_t *)out, (const uint16_t *)inp, (const uint16_t *)w, n,
                                       ic, oc);
}

static lm_status cuda_matmul_backward_set(lm_backend *be, float *dinp, float *dw, const void *dout,
                                          const void *inp, const void *w, int64_t n, int ic, int oc) {
    return lm_cuda_matmul_backward_set(ctx_of(be), dinp, dw, (const uint16_t *)dout, (const uint16_t *)inp,
                                       (const uint16_t *)w, n, ic, oc);
}

static lm_status cuda_matmul_backward(lm_backend *be, float *dinp, float *dw, const void *dout, const void *inp,
                                      const void *w, int64_t n, int ic, int oc) {
    return lm_cuda_matmul_backward(ctx_of(be), dinp, dw, (const uint16_t *)dout, (const uint16_t *)inp,
                                   (const uint16_t *)w, n, ic, oc);
}

static lm_status cuda_matmul_backward_ld(lm_backend *be, float *dinp, float *dw, const void *dout, int64_t ld_dout,
                                         const void *inp, const void *w, int64_t n, int ic, int oc, int set) {
    return lm_cuda_matmul_backward_ld(ctx_of(be), dinp, dw, (const uint16_t *)dout, ld_dout, (const uint16_t *)inp,
                                      (const uint16_t *)w, n, ic, oc, set);
}

static lm_status cuda_to_lp_rows(lm_backend *be, void *dst, int64_t ld_dst, const float *src, int64_t rows,
                                 int64_t cols) {
    return lm_cuda_f32_to_bf16_rows(ctx_of(be), (uint16_t *)dst, ld_dst, src, rows, cols);
}

static lm_status cuda_to_lp(lm_backend *be, void *dst, const float *src, size_t n) {
    /* a bf16 element i overlaps the fp32 element i/2 another thread reads */
    if (n && dst == (const void *)src)
        return lm_error(LM_ERR_ARG, "to_lp: dst == src; on the GPU the bf16 view needs its own buffer");
    return lm_cuda_f32_to_bf16(ctx_of(be), (uint16_t *)dst, src, n);
}

/* ---- norms, embedding, activations ---- */

static lm_status cuda_rmsnorm_forward(lm_backend *be, float *out, void *out_lp, float *rstd, const float *inp,
                                      const float *w, int64_t n, int d, float eps) {
    if (out_lp && out_lp == (void *)out) return lm_error(LM_ERR_ARG, "rmsnorm_forward: out_lp == out on the GPU");
    return lm_cuda_rmsnorm_forward(ctx_of(be), out, (uint16_t *)out_lp, rstd, inp, w, n, d, eps);
}

static lm_status cuda_rmsnorm_backward(lm_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                                       const float *w, const float *rstd, int64_t n, int d, float eps) {
    void *scratch;
    lm_status st = arena_get(be, lm_cuda_rmsnorm_scratch_floats(n, d) * sizeof(float), &scratch);
    if (st) return st;
    return lm_cuda_rmsnorm_backward(ctx_of(be), dinp, dw, dout, inp, w, rstd, n, d, eps, (float *)scratch);
}

static lm_status cuda_rmsnorm_backward_set(lm_backend *be, float *dinp, float *dw, const float *dout,
                                           const float *inp, const float *w, const float *rstd, int64_t n, int d,
                                           float eps) {
    void *scratch;
    lm_status st = arena_get(be, lm_cuda_rmsnorm_scratch_floats(n, d) * sizeof(float), &scratch);
    if (st) return st;
    return lm_cuda_rmsnorm_backward_set(ctx_of(be), dinp, dw, dout, inp, w, rstd, n, d, eps, (float *)scratch);
}

static lm_status cuda_embedding_forward(lm_backend *be, float *out, const float *table, const int32_t *tokens,
                                        int64_t n, int d) {
    return lm_cuda_embedding_forward(ctx_of(be), out, table, tokens, n, d);
}

static lm_status cuda_embedding_backward(lm_backend *be, float *dtable, const float *dout, const int32_t *tokens,
                                         int64_t n, int d, int vocab) {
    void *scratch;
    lm_status st = arena_get(be, lm_cuda_embedding_scratch_bytes(n, vocab), &scratch);
    if (st) return st;
    return lm_cuda_embedding_backward(ctx_of(be), dtable, dout, tokens, n, d, vocab, scratch);
}

static lm_status cuda_glu_forward(lm_backend *be, lm_glu_kind act, float *h, void *h_lp, const float *a,
                                  const float *u, size_t n) {
    if (h_lp && h_lp == (void *)h) return lm_error(LM_ERR_ARG, "glu_forward: h_lp == h on the GPU");
    return lm_cuda_backend_glu_forward(ctx_of(be), act, h, (uint16_t *)h_lp, a, u, n);
}

static lm_status cuda_glu_backward(lm_backend *be, lm_glu_kind act, float *da, float *du, void *da_lp, void *du_lp,
                                   const float *dh, const float *a, const float *u, size_t n) {
    if ((da_lp && da_lp == (void *)da) || (du_lp && du_lp == (void *)du))
        return lm_error(LM_ERR_ARG, "glu_backward: da_lp == da or du_lp == du on the GPU");
    return lm_cuda_backend_glu_backward(ctx_of(be), act, da, du, (uint16_t *)da_lp, (uint16_t *)du_lp, dh, a, u, n);
}

static lm_status cuda_sigmoid_forward(lm_backend *be, float *out, const float *in, size_t n) {
    return lm_cuda_sigmoid_forward(ctx_of(be), out, in, n);
}

static lm_status cuda_sigmoid_backward(lm_backend *be, float *dlogit, const float *dout, const float *y, size_t n) {
    return lm_cuda_sigmoid_backward(ctx_of(be), dlogit, dout, y, n);
}

/* ---- the LM head with a chunked cross-entropy ---- */

/* rows of one logits chunk: as many as CE_CHUNK_BUDGET holds (fp32 + bf16 per logit) */
static int64_t ce_rows(int64_t n, int vocab) {
    int64_t rows = (int64_t)(CE_CHUNK_BUDGET / ((size_t)(vocab > 0 ? vocab : 1) * 6));
    if (rows < 1) rows = 1;
    return rows < n ? rows : n;
}

static size_t cuda_ce_work_bytes(lm_backend *be, int64_t n, int d, int vocab) {
    (void)be;
    if (n <= 0) return 0;
    return lm_cuda_cross_entropy_workspace_bytes(n, d, vocab, ce_rows(n, vocab));
}

/* The forward's tail: the target logits when asked, the loss sum to the host. */
static lm_status ce_forward_tail(lm_backend *be, float *target_logit, double *loss_sum, const void *hn_lp,
                                 const void *head_lp, const int32_t *targets, int64_t n, int d) {
    cuda_backend *cb = cb_of(be);
    lm_status st;
    if (target_logit &&
        (st = lm_cuda_backend_target_logit(ctx_of(be), target_logit, (const uint16_t *)hn_lp,
                                           (const uint16_t *)head_lp, targets, n, d)))
        return st;
    float loss = 0.0f;
    if ((st = cuda_download(be, &loss, &cb->scalars->loss, sizeof loss))) return st;
    *loss_sum = (double)loss;
    return LM_OK;
}

static lm_status cuda_ce_forward(lm_backend *be, float *lse, float *target_logit, double *loss_sum, const void *hn_lp,
                                 const void *head_lp, const int32_t *targets, int64_t n, int d, int V, void *work) {
    cuda_backend *cb = cb_of(be);
    if (!loss_sum) return lm_error(LM_ERR_ARG, "cross_entropy_forward: loss_sum is NULL");
    *loss_sum = 0.0;
    lm_status st = lm_cuda_cross_entropy_forward(ctx_of(be), lse, &cb->scalars->loss, (const uint16_t *)hn_lp,
                                                 (const uint16_t *)head_lp, targets, n, d, V, work,
                                                 cuda_ce_work_bytes(be, n, d, V));
    return st ? st : ce_forward_tail(be, target_logit, loss_sum, hn_lp, head_lp, targets, n, d);
}

static lm_status cuda_ce_backward(lm_backend *be, float *dhn, float *dhead, const void *hn_lp, const void *head_lp,
                                  const int32_t *targets, const float *lse, const float *row_scale, float scale,
                                  int64_t n, int d, int V, void *work) {
    return lm_cuda_cross_entropy_backward(ctx_of(be), dhn, dhead, (const uint16_t *)hn_lp, (const uint16_t *)head_lp,
                                          targets, lse, row_scale, scale, n, d, V, work,
                                          cuda_ce_work_bytes(be, n, d, V));
}

static lm_status cuda_ce_forward_backward(lm_backend *be, float *lse, float *target_logit, double *loss_sum,
                                         float *dhn, float *dhead, const void *hn_lp, const void *head_lp,
                                         const int32_t *targets, float scale, int64_t n, int d, int V, void *work) {
    cuda_backend *cb = cb_of(be);
    if (!loss_sum) return lm_error(LM_ERR_ARG, "cross_entropy_forward_backward: loss_sum is NULL");
    *loss_sum = 0.0;
    lm_status st = lm_cuda_cross_entropy_forward_backward(ctx_of(be), lse, &cb->scalars->loss, dhn, dhead,
                                                          (const uint16_t *)hn_lp, (const uint16_t *)head_lp, targets,
                                                          scale, n, d, V, work, cuda_ce_work_bytes(be, n, d, V));
    return st ? st : ce_forward_tail(be, target_logit, loss_sum, hn_lp, head_lp, targets, n, d);
}

static lm_status cuda_score_forward(lm_backend *be, double *nll, int32_t *argmax, const void *hn_lp,
                                   const void *head_lp, const int32_t *targets, int64_t n, int d, int V, void *work) {
    return lm_cuda_score_forward(ctx_of(be), nll, argmax, (const uint16_t *)hn_lp, (const uint16_t *)head_lp,
                                 targets, n, d, V, work, cuda_ce_work_bytes(be, n, d, V));
}

/* ---- the KDA token mixer's pieces ---- */

static lm_status cuda_conv_silu_forward(lm_backend *be, float *conv_out, void *out_lp, float *rnorm, const float *in,
                                        const float *w, int B, int T, int C, int W, int head_dim) {
    return lm_cuda_short_conv_silu_forward(ctx_of(be), conv_out, (uint16_t *)out_lp, rnorm, in, w, B, T, C, W,
                                           head_dim);
}

static lm_status cuda_conv_silu_backward(lm_backend *be, float *din, float *dw, const void *dout_lp,
                                         const float *conv_out, const void *out_lp, const float *rnorm,
                                         const float *in, const float *w, int B, int T, int C, int W, int head_dim,
                                         float *tmp) {
    /* the GPU recomputes SiLU(c) * rnorm from conv_out (c itself from in and w when conv_out is NULL):
     * out_lp and tmp are not read */
    (void)out_lp;
    (void)tmp;
    void *scratch;
    lm_status st = arena_get(be, lm_cuda_short_conv_silu_backward_scratch_bytes(B, T, C, W), &scratch);
    if (st) return st;
    return lm_cuda_short_conv_silu_backward(ctx_of(be), din, dw, (const uint16_t *)dout_lp, conv_out, rnorm, in, w,
                                            B, T, C, W, head_dim, scratch);
}

static lm_status cuda_conv_silu_backward_lp(lm_backend *be, void *din_lp, float *dw, const void *dout_lp,
                                            const float *conv_out, const void *out_lp, const float *rnorm,
                                            const float *in, const float *w, int B, int T, int C, int W,
                                            int head_dim, int ld_din, float *tmp) {
    if (!lm_cuda_short_conv_silu_backward_bf16_takes(W, head_dim)) {
        /* the two-pass path writes fp32: into tmp (B*T*C floats), then rounded into din's rows */
        lm_status st = cuda_conv_silu_backward(be, tmp, dw, dout_lp, conv_out, out_lp, rnorm, in, w, B, T, C, W,
                                               head_dim, NULL);
        if (st) return st;
        return lm_cuda_f32_to_bf16_rows(ctx_of(be), (uint16_t *)din_lp, ld_din, tmp, (int64_t)B * T, C);
    }
    void *scratch;
    lm_status st = arena_get(be, lm_cuda_short_conv_silu_backward_scratch_bytes(B, T, C, W), &scratch);
    if (st) return st;
    return lm_cuda_short_conv_silu_backward_bf16(ctx_of(be), (uint16_t *)din_lp, dw, (const uint16_t *)dout_lp,
                                                 conv_out, rnorm, in, w, B, T, C, W, head_dim, ld_din, scratch);
}

static lm_kda_cuda_inputs kda_inputs(const void *q, const void *k, const void *v, const void *z, const float *beta,
                                     const float *A_log, const float *dt_bias, const float *h0) {
    lm_kda_cuda_inputs in;
    in.q = (const uint16_t *)q;
    in.k = (const uint16_t *)k;
    in.v = (const uint16_t *)v;
    in.z = (const uint16_t *)z;
    in.beta = beta;
    in.A_log = A_log;
    in.dt_bias = dt_bias;
    in.h0 = h0;
    return in;
}

static lm_status cuda_kda_forward(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k,
                                  const void *v, const void *z, const float *beta, const float *A_log,
                                  const float *dt_bias, const float *h0, void *o, float *ht) {
    lm_status st = lm_kda_cuda_check(cfg);
    if (st) return st;
    /* a backward-sized workspace: one arena size for both directions */
    size_t bytes = lm_kda_cuda_workspace_bytes(cfg, 1);
    lm_kda_cuda_inputs in = kda_inputs(q, k, v, z, beta, A_log, dt_bias, h0);
    void *ws;
    if (cfg->kept) { /* the intermediates in the caller's buffer, the rest in the arena */
        size_t kb = lm_kda_cuda_kept_bytes(cfg);
        if ((st = arena_get(be, bytes - kb, &ws))) return st;
        return lm_kda_cuda_chunk_forward_kept(cfg, &in, (uint16_t *)o, ht, cfg->kept, cfg->kept_bytes, ws,
                                              bytes - kb, cb_of(be)->ctx.stream);
    }
    if ((st = arena_get(be, bytes, &ws))) return st;
    return lm_kda_cuda_chunk_forward(cfg, &in, (uint16_t *)o, ht, ws, bytes, cb_of(be)->ctx.stream);
}

static lm_status cuda_kda_state_apply(lm_backend *be, int n_pairs, int K, int V, const float *P, const float *Q,
                                      const float *S, float *out, int transposed) {
    return lm_kda_cuda_state_apply(n_pairs, K, V, P, Q, S, out, transposed, cb_of(be)->ctx.stream);
}

static size_t cuda_kda_kept_bytes(lm_backend *be, const lm_kda_config *cfg) {
    (void)be;
    return lm_kda_cuda_check(cfg) ? 0 : lm_kda_cuda_kept_bytes(cfg);
}

static lm_status cuda_kda_backward(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k,
                                   const void *v, const void *z, const float *beta, const float *A_log,
                                   const float *dt_bias, const float *h0, const void *d_o, const float *dht,
                                   void *dq, void *dk, void *dv, void *dz, float *dbeta, float *dA_log,
                                   float *ddt_bias, float *dh0) {
    lm_status st = lm_kda_cuda_check(cfg);
    if (st) return st;
    /* with the forward's intermediates kept by the caller, the arena holds the rest */
    size_t kb = cfg->kept ? lm_kda_cuda_kept_bytes(cfg) : 0, bytes = lm_kda_cuda_workspace_bytes(cfg, 1) - kb;
    void *ws;
    if ((st = arena_get(be, bytes, &ws))) return st;
    lm_kda_cuda_inputs in = kda_inputs(q, k, v, z, beta, A_log, dt_bias, h0);
    lm_kda_cuda_grads g;
    g.dq = (uint16_t *)dq;
    g.dk = (uint16_t *)dk;
    g.dv = (uint16_t *)dv;
    g.dz = (uint16_t *)dz;
    g.dbeta = dbeta;
    g.dA_log = dA_log;
    g.ddt_bias = ddt_bias;
    g.dh0 = dh0;
    if (cfg->kept) /* the forward's intermediates kept in the caller's buffer: no recompute */
        return lm_kda_cuda_chunk_backward_kept(cfg, &in, (const uint16_t *)d_o, dht, &g, cfg->kept, cfg->kept_bytes,
                                               ws, bytes, cb_of(be)->ctx.stream);
    /* other ops may have used the arena since the forward: recompute (forward_saved = 0) */
    return lm_kda_cuda_chunk_backward(cfg, &in, (const uint16_t *)d_o, dht, &g, ws, bytes, 0,
                                      cb_of(be)->ctx.stream);
}

static lm_status cuda_kda_output_forward(lm_backend *be, float *gated, void *gated_lp, float *o_rstd, float *gate,
                                         const float *gate_logits, const void *o_lp, const float *o_norm, int64_t N,
                                         int H, int K, float eps) {
    if (!gated_lp) return lm_error(LM_ERR_ARG, "kda_output_forward: gated_lp is NULL (the GPU writes it)");
    if (gated && gated == gated_lp) return lm_error(LM_ERR_ARG, "kda_output_forward: gated == gated_lp on the GPU");
    lm_status st = lm_cuda_kda_output_forward(ctx_of(be), (uint16_t *)gated_lp, o_rstd, gate,
                                              (const uint16_t *)o_lp, gate_logits, o_norm, N, H, K, eps);
    if (st || !gated) return st;
    /* the fp32 copy, when asked for, holds the bf16 values */
    return lm_cuda_bf16_to_f32(ctx_of(be), gated, (const uint16_t *)gated_lp, (size_t)N * H * K);
}

static lm_status cuda_kda_output_backward(lm_backend *be, void *d_o_lp, float *dgate_logits, void *dgate_logits_lp,
                                          int64_t ld_dgate_lp, float *do_norm, const float *d_gated, const void *o_lp, const float *o_rstd,
                                          const float *gate, const float *o_norm, int64_t N, int H, int K, float eps,
                                          float *tmp) {
    (void)tmp;
    if (dgate_logits_lp && dgate_logits_lp == (void *)dgate_logits)
        return lm_error(LM_ERR_ARG, "kda_output_backward: dgate_logits_lp == dgate_logits on the GPU");
    void *scratch;
    lm_status st = arena_get(be, lm_cuda_kda_output_backward_scratch_bytes(N, H, K), &scratch);
    if (st) return st;
    return lm_cuda_kda_output_backward(ctx_of(be), (uint16_t *)d_o_lp, NULL, dgate_logits, (uint16_t *)dgate_logits_lp,
                                       ld_dgate_lp, do_norm, d_gated, (const uint16_t *)o_lp, o_rstd, gate, o_norm, N, H, K, eps,
                                       scratch);
}

/* ---- gated attention ---- */

static lm_status cuda_attention_forward(lm_backend *be, const lm_attention_config *cfg, const void *q, const void *k,
                                        const void *v, void *o, float *lse, float *rowmax) {
    /* rowmax's first H floats receive the per-head maxima (attention_head_max reads them) */
    return lm_cuda_attention_forward(ctx_of(be), cfg, (const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v,
                                     (uint16_t *)o, lse, rowmax);
}

static lm_status cuda_attention_backward(lm_backend *be, const lm_attention_config *c, const void *q, const void *k,
                                         const void *v, const void *o, const float *lse, const void *d_o, void *dq,
                                         void *dk, void *dv) {
    if (!c) return lm_error(LM_ERR_ARG, "attention_backward: cfg is NULL");
    /* the bytes of the kind the backward runs: cuDNN's workspace when it is chosen
     * (LONGMOE_ATTENTION, LONGMOE_CUDNN_WORKSPACE_MB; docs/cuda.md) */
    size_t bytes = lm_cuda_attention_backward_workspace_bytes(c);
    if (bytes == 0) return lm_error(LM_ERR_ARG, "attention_backward: %s", lm_last_error());
    void *ws;
    lm_status st = arena_get(be, bytes, &ws);
    if (st) return st;
    return lm_cuda_attention_backward(ctx_of(be), c, (const uint16_t *)q, (const uint16_t *)k, (const uint16_t *)v,
                                      (const uint16_t *)o, (const uint16_t *)d_o, lse, (uint16_t *)dq,
                                      (uint16_t *)dk, (uint16_t *)dv, ws, bytes);
}

/* Attention with the queries at an offset (sequence segments): q_offset 0 is
 * the causal attention above (bit for bit); the backward's arena holds the
 * chosen kind's workspace at this offset. */
static lm_status cuda_attention_forward_offset(lm_backend *be, const lm_attention_config *cfg, int q_offset,
                                               const void *q, const void *k, const void *v, void *o, float *lse,
                                               float *rowmax) {
    if (q_offset == 0) return cuda_attention_forward(be, cfg, q, k, v, o, lse, rowmax);
    return lm_cuda_attention_forward_offset(ctx_of(be), cfg, q_offset, (const uint16_t *)q, (const uint16_t *)k,
                                            (const uint16_t *)v, (uint16_t *)o, lse, rowmax);
}

static lm_status cuda_attention_backward_offset(lm_backend *be, const lm_attention_config *c, int q_offset,
                                                const void *q, const void *k, const void *v, const void *o,
                                                const float *lse, const void *d_o, void *dq, void *dk, void *dv) {
    if (q_offset == 0) return cuda_attention_backward(be, c, q, k, v, o, lse, d_o, dq, dk, dv);
    if (!c) return lm_error(LM_ERR_ARG, "attention_backward_offset: cfg is NULL");
    size_t bytes = lm_cuda_attention_backward_workspace_bytes_offset(c, q_offset);
    if (bytes == 0) return lm_error(LM_ERR_ARG, "attention_backward_offset: %s", lm_last_error());
    void *ws;
    lm_status st = arena_get(be, bytes, &ws);
    if (st) return st;
    return lm_cuda_attention_backward_offset(ctx_of(be), c, q_offset, (const uint16_t *)q, (const uint16_t *)k,
                                             (const uint16_t *)v, (const uint16_t *)o, (const uint16_t *)d_o, lse,
                                             (uint16_t *)dq, (uint16_t *)dk, (uint16_t *)dv, ws, bytes);
}

static lm_status cuda_accumulate(lm_backend *be, float *acc, const void *x, size_t n, int lp) {
    return lm_cuda_backend_accumulate(ctx_of(be), acc, x, n, lp);
}

static lm_status cuda_attention_head_max(lm_backend *be, const lm_attention_config *c, const float *rowmax,
                                         float *head_max) {
    if (!c || !rowmax || !head_max) return lm_error(LM_ERR_ARG, "attention_head_max: cfg, rowmax or head_max is NULL");
    return cuda_download(be, head_max, rowmax, (size_t)c->H * sizeof(float));
}

static lm_status cuda_gate_forward(lm_backend *be, float *gated, void *gated_lp, const float *gp, const void *o_lp,
                                   size_t n) {
    if (gated_lp && gated_lp == (void *)gated) return lm_error(LM_ERR_ARG, "gate_forward: gated_lp == gated on the GPU");
    return lm_cuda_backend_gate_forward(ctx_of(be), gated, (uint16_t *)gated_lp, gp, (const uint16_t *)o_lp, n);
}

static lm_status cuda_gate_backward(lm_backend *be, void *d_o_lp, float *dgp, void *dgp_lp, const float *dgated,
                                    const float *gp, const void *o_lp, size_t n) {
    if (dgp_lp && dgp_lp == (void *)dgp)
        return lm_error(LM_ERR_ARG, "gate_backward: dgate_logits_lp == dgate_logits on the GPU");
    return lm_cuda_backend_gate_backward(ctx_of(be), (uint16_t *)d_o_lp, dgp, (uint16_t *)dgp_lp, dgated, gp,
                                         (const uint16_t *)o_lp, n);
}

/* ---- the MoE layer and its balancing ---- */

typedef struct {
    lm_moe_config cfg;
    int64_t m_max;
    void *acts_block, *scratch_block; /* device */
    lm_cuda_moe_acts acts;
    lm_cuda_moe_scratch scratch;
    float *bias;                      /* [n] device: the forward's balancing bias */
    /* host buffers for the paths that run on the host */
    float *host_scores;               /* [m_max, n] */
    int32_t *host_topk;               /* [m_max, k] */
    float *host_dscores;              /* [m_max, n] */
    float *host_ent;                  /* [m_max] */
    float *host_lo, *host_width;      /* [n] the balancer's bin geometry */
    int32_t *host_counts;             /* [n, bins] + load [n] (grown with the balancer's bins) */
    size_t host_counts_len;
} cuda_moe;

static void cuda_moe_acts_free(lm_backend *be, void *p) {
    cuda_moe *a = (cuda_moe *)p;
    if (!a) return;
    cudaStreamSynchronize(stream_of(be));
    if (a->acts_block) cudaFree(a->acts_block);
    if (a->scratch_block) cudaFree(a->scratch_block);
    if (a->bias) cudaFree(a->bias);
    free(a->host_scores);
    free(a->host_topk);
    free(a->host_dscores);
    free(a->host_ent);
    free(a->host_lo);
    free(a->host_width);
    free(a->host_counts);
    free(a);
}

/* device bytes of cuda_moe_acts_create: the activations, the scratch, the bias */
static size_t cuda_moe_acts_bytes(const lm_moe_config *cfg, int64_t m_max) {
    size_t a = lm_cuda_moe_acts_bytes(cfg, m_max), s = a ? lm_cuda_moe_scratch_bytes(cfg, m_max) : 0;
    return a && s ? a + s + (size_t)cfg->n_experts * sizeof(float) : 0; /* 0: refused, lm_last_error says why */
}

static lm_status cuda_moe_acts_create(lm_backend *be, const lm_moe_config *cfg, int64_t m_max, void **out) {
    *out = NULL;
    lm_status st = lm_moe_check(cfg);
    if (st) return st;
    size_t ab = lm_cuda_moe_acts_bytes(cfg, m_max), sb = lm_cuda_moe_scratch_bytes(cfg, m_max);
    if (!ab || !sb) return lm_error(LM_ERR_ARG, "moe_acts_create: m_max = %lld is out of range", (long long)m_max);
    cuda_moe *a = (cuda_moe *)calloc(1, sizeof *a);
    if (!a) return lm_error(LM_ERR_MEMORY, "out of memory for the MoE activations");
    a->cfg = *cfg;
    a->m_max = m_max;
    size_t mn = (size_t)m_max * cfg->n_experts, mk = (size_t)m_max * cfg->top_k;
    a->host_scores = (float *)malloc(mn * sizeof(float));
    a->host_topk = (int32_t *)malloc(mk * sizeof(int32_t));
    a->host_dscores = (float *)malloc(mn * sizeof(float));
    a->host_ent = (float *)malloc((size_t)m_max * sizeof(float));
    a->host_lo = (float *)malloc((size_t)cfg->n_experts * sizeof(float));
    a->host_width = (float *)malloc((size_t)cfg->n_experts * sizeof(float));
    if (!a->host_scores || !a->host_topk || !a->host_dscores || !a->host_ent || !a->host_lo || !a->host_width) {
        cuda_moe_acts_free(be, a);
        return lm_error(LM_ERR_MEMORY, "out of host memory for the MoE activations (m_max = %lld)",
                        (long long)m_max);
    }
    if ((st = cuda_alloc(be, ab, &a->acts_block)) || (st = cuda_alloc(be, sb, &a->scratch_block)) ||
        (st = cuda_alloc(be, (size_t)cfg->n_experts * sizeof(float), (void **)&a->bias)) ||
        (st = lm_cuda_moe_acts_carve(&a->acts, cfg, m_max, a->acts_block, ab)) ||
        (st = lm_cuda_moe_scratch_carve(&a->scratch, cfg, m_max, a->scratch_block, sb))) {
        cuda_moe_acts_free(be, a);
        return st;
    }
    *out = a;
    return LM_OK;
}

/* p_lp holds bf16 device pointers typed float *: the same fields as uint16_t * */
static lm_moe_params_bf16 moe_bf16_view(const lm_moe_params *p) {
    lm_moe_params_bf16 b;
    b.router = (uint16_t *)p->router;
    b.gate = (uint16_t *)p->gate;
    b.up = (uint16_t *)p->up;
    b.down = (uint16_t *)p->down;
    b.lat_down = (uint16_t *)p->lat_down;
    b.lat_norm = (uint16_t *)p->lat_norm;
    b.lat_up = (uint16_t *)p->lat_up;
    b.shared_gate = (uint16_t *)p->shared_gate;
    b.shared_up = (uint16_t *)p->shared_up;
    b.shared_down = (uint16_t *)p->shared_down;
    return b;
}

static lm_status cuda_moe_forward(lm_backend *be, float *y, const float *x, const void *x_lp,
                                  const float *bias_host, const lm_moe_config *cfg, const lm_moe_params *p,
                                  const lm_moe_params *p_lp, void *acts, int64_t m) {
    cuda_moe *a = (cuda_moe *)acts;
    if (!a || !cfg || !p || !p_lp) return lm_error(LM_ERR_ARG, "moe_forward: acts, cfg, p or p_lp is NULL");
    if (x_lp && x_lp == (const void *)x) return lm_error(LM_ERR_ARG, "moe_forward: x_lp aliases the fp32 x");
    if (cfg->n_experts != a->cfg.n_experts || cfg->top_k != a->cfg.top_k)
        return lm_error(LM_ERR_ARG, "moe_forward: cfg differs from the one the activations were made for");
    lm_status st;
    if (bias_host && (st = cuda_upload(be, a->bias, bias_host, (size_t)cfg->n_experts * sizeof(float)))) return st;
    lm_moe_params_bf16 pb = moe_bf16_view(p_lp);
    return lm_cuda_moe_forward(ctx_of(be), y, x, (const uint16_t *)x_lp, bias_host ? a->bias : NULL, cfg, p, &pb,
                               &a->acts, m);
}

static lm_status cuda_moe_backward(lm_backend *be, float *dx, const lm_moe_params *g, const float *dy,
                                   const void *dy_lp, const float *x, const float *dscores_extra, const lm_moe_config *cfg, const lm_moe_params *p,
                                   const lm_moe_params *p_lp, void *acts, int expert_grads_set) {
    cuda_moe *a = (cuda_moe *)acts;
    if (!a || !cfg || !p || !p_lp || !g) return lm_error(LM_ERR_ARG, "moe_backward: acts, cfg, p, p_lp or g is NULL");
    lm_moe_params_bf16 pb = moe_bf16_view(p_lp);
    return lm_cuda_moe_backward(ctx_of(be), dx, g, dy, (const uint16_t *)dy_lp, x, dscores_extra, cfg, p, &pb, &a->acts,
                                &a->scratch, expert_grads_set);
}

/* expert parallelism: moe_ep.cu's exchange over a device engine */
static lm_status cuda_moe_ep_create(lm_backend *be, lm_comm *comm, const lm_moe_config *cfg, void **out) {
    *out = NULL;
    if (!comm) return lm_error(LM_ERR_ARG, "moe_ep_create: comm is NULL");
    const lm_comm_engine e = lm_comm_engine_of(comm);
    if (e != LM_COMM_NCCL && e != LM_COMM_STAGED)
        return lm_error(LM_ERR_ARG, "expert parallelism on the CUDA backend exchanges device memory: it needs a device "
                        "engine (nccl, or staged over this backend), not %s", lm_comm_engine_name(e));
    lm_cuda_moe_ep *ep = NULL;
    lm_status st = lm_cuda_moe_ep_create(ctx_of(be), comm, cfg, &ep);
    *out = ep;
    return st;
}

static lm_status cuda_moe_ep_share(lm_backend *be, void *ep, void *with) {
    (void)be;
    return lm_cuda_moe_ep_share((lm_cuda_moe_ep *)ep, (lm_cuda_moe_ep *)with);
}

static void cuda_moe_ep_free(lm_backend *be, void *ep) {
    (void)be;
    lm_cuda_moe_ep_free((lm_cuda_moe_ep *)ep);
}

static lm_status cuda_moe_forward_ep(lm_backend *be, float *y, const float *x, const void *x_lp,
                                     const float *bias_host, const lm_moe_config *cfg, const lm_moe_params *p,
                                     const lm_moe_params *p_lp, void *acts, int64_t m, void *ep) {
    cuda_moe *a = (cuda_moe *)acts;
    if (!a || !cfg || !p || !p_lp || !ep)
        return lm_error(LM_ERR_ARG, "moe_forward_ep: acts, cfg, p, p_lp or ep is NULL");
    if (x_lp && x_lp == (const void *)x) return lm_error(LM_ERR_ARG, "moe_forward_ep: x_lp aliases the fp32 x");
    if (cfg->n_experts != a->cfg.n_experts || cfg->top_k != a->cfg.top_k)
        return lm_error(LM_ERR_ARG, "moe_forward_ep: cfg differs from the one the activations were made for");
    lm_status st;
    if (bias_host && (st = cuda_upload(be, a->bias, bias_host, (size_t)cfg->n_experts * sizeof(float)))) return st;
    lm_moe_params_bf16 pb = moe_bf16_view(p_lp);
    return lm_cuda_moe_forward_ep(ctx_of(be), y, x, (const uint16_t *)x_lp, bias_host ? a->bias : NULL, cfg, p, &pb,
                                  &a->acts, m, (lm_cuda_moe_ep *)ep);
}

static lm_status cuda_moe_backward_ep(lm_backend *be, float *dx, const lm_moe_params *g, const float *dy,
                                      const void *dy_lp, const float *x, const float *dscores_extra, const lm_moe_config *cfg,
                                      const lm_moe_params *p, const lm_moe_params *p_lp, void *acts, void *ep) {
    cuda_moe *a = (cuda_moe *)acts;
    if (!a || !cfg || !p || !p_lp || !g || !ep)
        return lm_error(LM_ERR_ARG, "moe_backward_ep: acts, cfg, p, p_lp, g or ep is NULL");
    lm_moe_params_bf16 pb = moe_bf16_view(p_lp);
    return lm_cuda_moe_backward_ep(ctx_of(be), dx, g, dy, (const uint16_t *)dy_lp, x, dscores_extra, cfg, p, &pb, &a->acts, &a->scratch,
                                   (lm_cuda_moe_ep *)ep);
}

static float *cuda_moe_scores(lm_backend *be, void *acts) {
    (void)be;
    return acts ? ((cuda_moe *)acts)->acts.s : NULL;
}

/* The histogram estimators (K3, zoom) count on the device: bin geometry from
 * the host state, lm_cuda_balance_histogram and lm_cuda_expert_load into
 * arena counts, downloaded and added by lm_balance_observe_counts. Every other
 * mode (exact, sign, none, aux) runs lm_balance_observe on downloaded scores. */
static lm_status cuda_moe_balance_observe(lm_backend *be, lm_balance_state *bal, void *acts, int64_t m) {
    cuda_moe *a = (cuda_moe *)acts;
    if (!a || !bal) return lm_error(LM_ERR_ARG, "moe_balance_observe: bal or acts is NULL");
    int n = bal->cfg.n_experts, k = bal->cfg.top_k, B = bal->cfg.bins;
    if (n != a->cfg.n_experts || k != a->cfg.top_k)
        return lm_error(LM_ERR_ARG, "moe_balance_observe: the balancer has n = %d, k = %d, the layer %d, %d", n, k,
                        a->cfg.n_experts, a->cfg.top_k);
    if (m < 0 || m > a->acts.m)
        return lm_error(LM_ERR_ARG, "moe_balance_observe: m = %lld exceeds the last forward's %lld tokens",
                        (long long)m, (long long)a->acts.m);
    lm_status st;
    int histogram = bal->cfg.mode == LM_BALANCE_QUANTILE && bal->cfg.estimator != LM_QB_EXACT;
    if (!histogram || m == 0) {
        if ((st = cuda_download(be, a->host_scores, a->acts.s, (size_t)m * n * sizeof(float)))) return st;
        return lm_balance_observe(bal, a->host_scores, m, 1);
    }
    size_t nb = (size_t)n * (size_t)B;
    if (a->host_counts_len < nb + n) {
        int32_t *c = (int32_t *)realloc(a->host_counts, (nb + n) * sizeof(int32_t));
        if (!c) return lm_error(LM_ERR_MEMORY, "out of host memory for %zu balance counts", nb);
        a->host_counts = c;
        a->host_counts_len = nb + n;
    }
    /* arena: counts [n,B] | load [n] (int32) | lo, width, bias [n] | entropy [m] */
    size_t o_counts = 0, o_load = align256(nb * 4), o_lo = o_load + align256((size_t)n * 4);
    size_t o_width = o_lo + align256((size_t)n * 4), o_bias = o_width + align256((size_t)n * 4);
    size_t o_ent = o_bias + align256((size_t)n * 4), total = o_ent + align256((size_t)m * 4);
    void *base;
    if ((st = arena_get(be, total, &base))) return st;
    char *w = (char *)base;
    int32_t *d_counts = (int32_t *)(w + o_counts), *d_load = (int32_t *)(w + o_load);
    float *d_lo = (float *)(w + o_lo), *d_width = (float *)(w + o_width), *d_bias = (float *)(w + o_bias);
    float *d_ent = (float *)(w + o_ent);
    /* the bin geometry (fixed by b for the step), uploaded with b itself */
    float *lo = a->host_lo, *width = a->host_width;
    if ((st = lm_balance_bin_geometry(bal, lo, width))) return st;
    if ((st = cuda_upload(be, d_lo, lo, (size_t)n * 4)) || (st = cuda_upload(be, d_width, width, (size_t)n * 4)) ||
        (st = cuda_upload(be, d_bias, bal->bias, (size_t)n * 4)))
        return st;
    const lm_cuda_context *ctx = ctx_of(be);
    LM_CUDA_TRY(cudaMemsetAsync(d_counts, 0, nb * 4, stream_of(be)));
    LM_CUDA_TRY(cudaMemsetAsync(d_load, 0, (size_t)n * 4, stream_of(be)));
    if ((st = lm_cuda_backend_router_entropy(ctx, d_ent, a->acts.s, m, n)) ||
        (st = lm_cuda_balance_histogram(ctx, d_counts, a->acts.s, d_bias, d_lo, d_width, m, n, k, B,
                                        bal->cfg.estimator == LM_QB_ZOOM)) ||
        (st = lm_cuda_expert_load(ctx, d_load, a->acts.topk, m, n, k)))
        return st;
    int32_t *counts = a->host_counts, *load = a->host_counts + nb;
    if ((st = cuda_download(be, a->host_ent, d_ent, (size_t)m * 4)) ||
        (st = cuda_download(be, counts, d_counts, nb * 4)) || (st = cuda_download(be, load, d_load, (size_t)n * 4)))
        return st;
    /* the same refusal as lm_balance_observe: a score outside [0, 1] or not finite */
    double entropy = 0.0;
    for (int64_t i = 0; i < m; i++) {
        if (isnan(a->host_ent[i]))
            return lm_error(LM_ERR_NUMERIC, "balance: token %lld has a score outside [0, 1] or not finite",
                            (long long)i);
        entropy += (double)a->host_ent[i];
    }
    return lm_balance_observe_counts(bal, counts, load, m, 1, entropy);
}

/* ---- a step's balance observations counted on the device ----
 *
 * The histogram estimators' counts, the loads and the router entropy of every
 * MoE layer add into one device block during the step's forwards (all its
 * micro-batches: b and the bins are fixed for the step); the host sees them
 * once, at the flush. The first observation after a flush uploads every
 * layer's bin geometry and b (one copy from pinned memory, no wait); the flush
 * downloads every layer's results (one copy, one wait). Other modes (exact,
 * sign, none, aux) take moe_balance_observe's host path at each observation.
 *
 * geometry (fp32): per counted layer lo [n] | width [n] | b [n];
 * results: entropy [count] (int64, units of 2^-32 nats) | first bad token
 * [count] (u64: observation << 32 | token; all ones: none) | per counted
 * layer counts [n, B] | load [n] (int32). */
typedef struct {
    int count;
    lm_balance_state **bal; /* [count] the model's host states */
    int *dev;               /* [count] 1: counted on the device */
    int *obs;               /* [count] observations since the last flush */
    int64_t *tokens;        /* [count] their tokens */
    size_t *geo_off;        /* [count] lo's float offset in the geometry */
    size_t *cnt_off;        /* [count] counts' int32 offset after the two u64 arrays */
    int pending;            /* observations counted on the device since the last flush */
    size_t geo_bytes, res_bytes;
    float *geo_d, *geo_h;   /* device, pinned host */
    void *res_d, *res_h;    /* device, pinned host */
} cuda_balance_set;

static void cuda_moe_balance_set_free(lm_backend *be, void *p) {
    cuda_balance_set *b = (cuda_balance_set *)p;
    if (!b) return;
    cudaStreamSynchronize(stream_of(be));
    if (b->geo_d) cudaFree(b->geo_d);
    if (b->res_d) cudaFree(b->res_d);
    if (b->geo_h) cudaFreeHost(b->geo_h);
    if (b->res_h) cudaFreeHost(b->res_h);
    free(b->bal);
    free(b->dev);
    free(b->obs);
    free(b->tokens);
    free(b->geo_off);
    free(b->cnt_off);
    free(b);
}

static lm_status cuda_moe_balance_set_create(lm_backend *be, lm_balance_state *const *bal, int count, void **out) {
    *out = NULL;
    if (count < 0 || (count > 0 && !bal)) return lm_error(LM_ERR_ARG, "moe_balance_set_create: bad balancers");
    cuda_balance_set *b = (cuda_balance_set *)calloc(1, sizeof *b);
    if (!b) return lm_error(LM_ERR_MEMORY, "out of memory for the balance set");
    size_t c = count > 0 ? (size_t)count : 1;
    b->count = count;
    b->bal = (lm_balance_state **)calloc(c, sizeof *b->bal);
    b->dev = (int *)calloc(c, sizeof *b->dev);
    b->obs = (int *)calloc(c, sizeof *b->obs);
    b->tokens = (int64_t *)calloc(c, sizeof *b->tokens);
    b->geo_off = (size_t *)calloc(c, sizeof *b->geo_off);
    b->cnt_off = (size_t *)calloc(c, sizeof *b->cnt_off);
    if (!b->bal || !b->dev || !b->obs || !b->tokens || !b->geo_off || !b->cnt_off) {
        cuda_moe_balance_set_free(be, b);
        return lm_error(LM_ERR_MEMORY, "out of memory for the balance set");
    }
    size_t geo = 0, cnt = 0;
    for (int i = 0; i < count; i++) {
        if (!bal[i]) {
            cuda_moe_balance_set_free(be, b);
            return lm_error(LM_ERR_ARG, "moe_balance_set_create: balancer %d is NULL", i);
        }
        const lm_balance_config *bc = &bal[i]->cfg;
        b->bal[i] = bal[i];
        b->dev[i] = bc->mode == LM_BALANCE_QUANTILE && bc->estimator != LM_QB_EXACT;
        if (!b->dev[i]) continue;
        b->geo_off[i] = geo;
        b->cnt_off[i] = cnt;
        geo += 3 * (size_t)bc->n_experts;
        cnt += (size_t)bc->n_experts * (size_t)bc->bins + (size_t)bc->n_experts;
    }
    b->geo_bytes = (geo ? geo : 1) * sizeof(float);
    b->res_bytes = 2 * c * sizeof(unsigned long long) + cnt * sizeof(int32_t);
    cudaError_t e = cudaMalloc((void **)&b->geo_d, b->geo_bytes);
    if (e == cudaSuccess) e = cudaMalloc(&b->res_d, b->res_bytes);
    if (e == cudaSuccess) e = cudaMallocHost((void **)&b->geo_h, b->geo_bytes);
    if (e == cudaSuccess) e = cudaMallocHost(&b->res_h, b->res_bytes);
    if (e != cudaSuccess) {
        cuda_moe_balance_set_free(be, b);
        LM_CUDA_TRY(e);
    }
    *out = b;
    return LM_OK;
}

/* the first observation after a flush: every counted layer's bins and b up,
 * the results zeroed (the bad tokens to all ones) */
static lm_status balance_set_begin(lm_backend *be, cuda_balance_set *b) {
    lm_status st;
    for (int i = 0; i < b->count; i++) {
        if (!b->dev[i]) continue;
        int n = b->bal[i]->cfg.n_experts;
        float *g = b->geo_h + b->geo_off[i];
        if ((st = lm_balance_bin_geometry(b->bal[i], g, g + n))) return st;
        memcpy(g + 2 * n, b->bal[i]->bias, (size_t)n * sizeof(float));
    }
    /* pinned: the copy runs in stream order; the host writes geo_h again only
     * after the flush, which waits for it */
    size_t c = b->count > 0 ? (size_t)b->count : 1;
    cudaStream_t s = stream_of(be);
    LM_CUDA_TRY(cudaMemcpyAsync(b->geo_d, b->geo_h, b->geo_bytes, cudaMemcpyHostToDevice, s));
    LM_CUDA_TRY(cudaMemsetAsync(b->res_d, 0, b->res_bytes, s));
    LM_CUDA_TRY(cudaMemsetAsync((unsigned long long *)b->res_d + c, 0xff, c * sizeof(unsigned long long), s));
    return LM_OK;
}

static lm_status cuda_moe_balance_set_observe(lm_backend *be, void *p, int i, void *acts, int64_t m) {
    cuda_balance_set *b = (cuda_balance_set *)p;
    cuda_moe *a = (cuda_moe *)acts;
    if (!b || !a) return lm_error(LM_ERR_ARG, "moe_balance_set_observe: set or acts is NULL");
    if (i < 0 || i >= b->count)
        return lm_error(LM_ERR_ARG, "moe_balance_set_observe: balancer %d of %d", i, b->count);
    lm_balance_state *bal = b->bal[i];
    if (!b->dev[i]) return cuda_moe_balance_observe(be, bal, acts, m);
    int n = bal->cfg.n_experts, k = bal->cfg.top_k, B = bal->cfg.bins;
    if (n != a->cfg.n_experts || k != a->cfg.top_k)
        return lm_error(LM_ERR_ARG, "moe_balance_observe: the balancer has n = %d, k = %d, the layer %d, %d", n, k,
                        a->cfg.n_experts, a->cfg.top_k);
    if (m < 0 || m > a->acts.m)
        return lm_error(LM_ERR_ARG, "moe_balance_observe: m = %lld exceeds the last forward's %lld tokens",
                        (long long)m, (long long)a->acts.m);
    if (m > bal->cfg.max_tokens)
        return lm_error(LM_ERR_ARG, "balance: micro-batch of %lld tokens exceeds max_tokens %lld", (long long)m,
                        (long long)bal->cfg.max_tokens);
    if (bal->tokens + b->tokens[i] + m > INT32_MAX / k)
        return lm_error(LM_ERR_ARG, "balance: %lld tokens in one step overflow the int32 counts",
                        (long long)(bal->tokens + b->tokens[i] + m));
    if (m == 0) return LM_OK;
    if (b->obs[i] == INT32_MAX) return lm_error(LM_ERR_ARG, "moe_balance_set_observe: too many observations");
    lm_status st;
    if (!b->pending && (st = balance_set_begin(be, b))) return st;
    size_t c = b->count > 0 ? (size_t)b->count : 1;
    unsigned long long *ent = (unsigned long long *)b->res_d, *bad = ent + c;
    int32_t *counts = (int32_t *)(bad + c) + b->cnt_off[i], *load = counts + (size_t)n * B;
    const float *lo = b->geo_d + b->geo_off[i], *width = lo + n, *bias = lo + 2 * n;
    const lm_cuda_context *ctx = ctx_of(be);
    if ((st = lm_cuda_backend_router_entropy_sum(ctx, ent + i, bad + i, a->acts.s, m, n,
                                                 (unsigned long long)b->obs[i] << 32)) ||
        (st = lm_cuda_balance_histogram(ctx, counts, a->acts.s, bias, lo, width, m, n, k, B,
                                        bal->cfg.estimator == LM_QB_ZOOM)) ||
        (st = lm_cuda_expert_load(ctx, load, a->acts.topk, m, n, k)))
        return st;
    b->obs[i]++;
    b->tokens[i] += m;
    b->pending++;
    return LM_OK;
}

static lm_status cuda_moe_balance_set_flush(lm_backend *be, void *p) {
    cuda_balance_set *b = (cuda_balance_set *)p;
    if (!b) return lm_error(LM_ERR_ARG, "moe_balance_set_flush: set is NULL");
    if (!b->pending) return LM_OK;
    b->pending = 0;
    LM_CUDA_TRY(cudaMemcpyAsync(b->res_h, b->res_d, b->res_bytes, cudaMemcpyDeviceToHost, stream_of(be)));
    LM_CUDA_TRY(cudaStreamSynchronize(stream_of(be)));
    size_t c = b->count > 0 ? (size_t)b->count : 1;
    const unsigned long long *ent = (const unsigned long long *)b->res_h, *bad = ent + c;
    const int32_t *cnt = (const int32_t *)(bad + c);
    lm_status first = LM_OK;
    char why[512] = "";
    for (int i = 0; i < b->count; i++) {
        if (!b->dev[i] || !b->obs[i]) continue;
        int64_t m = b->tokens[i];
        b->obs[i] = 0;
        b->tokens[i] = 0;
        lm_status st;
        if (bad[i] != ~0ull)
            /* the same refusal as lm_balance_observe, found at the flush: the layer, the observation, the token */
            st = lm_error(LM_ERR_NUMERIC, "balance: MoE layer %d: token %lld of the step's observation %llu has a "
                          "score outside [0, 1] or not finite", i, (long long)(bad[i] & 0xffffffffull), bad[i] >> 32);
        else {
            const lm_balance_state *bal = b->bal[i];
            const int32_t *counts = cnt + b->cnt_off[i], *load = counts + (size_t)bal->cfg.n_experts * bal->cfg.bins;
            /* units of 2^-32 nats: exact in a double below 2^53 units */
            double entropy = (double)(long long)ent[i] * 0x1p-32;
            st = lm_balance_observe_counts(b->bal[i], counts, load, m, 1, entropy);
        }
        if (st && !first) {
            first = st;
            snprintf(why, sizeof why, "%s", lm_last_error());
        }
    }
    return first ? lm_error(first, "%s", why) : LM_OK;
}

static lm_status cuda_moe_aux_loss(lm_backend *be, float *loss, float *dscores, void *acts, int64_t m, int n, int k,
                                   float alpha) {
    cuda_moe *a = (cuda_moe *)acts;
    if (!a || !loss || !dscores) return lm_error(LM_ERR_ARG, "moe_aux_loss: loss, dscores or acts is NULL");
    if (n != a->cfg.n_experts || k != a->cfg.top_k || m < 0 || m > a->acts.m)
        return lm_error(LM_ERR_ARG, "moe_aux_loss: (m, n, k) = (%lld, %d, %d) do not match the last forward",
                        (long long)m, n, k);
    size_t mn = (size_t)m * n;
    lm_status st;
    if ((st = cuda_download(be, a->host_scores, a->acts.s, mn * sizeof(float))) ||
        (st = cuda_download(be, a->host_topk, a->acts.topk, (size_t)m * k * sizeof(int32_t))))
        return st;
    memset(a->host_dscores, 0, mn * sizeof(float));
    if ((st = lm_balance_aux_loss(loss, a->host_dscores, a->host_scores, a->host_topk, m, n, k, alpha))) return st;
    return cuda_upload(be, dscores, a->host_dscores, mn * sizeof(float));
}

/* ---- the residual stream over depth ---- */

typedef struct {
    lm_cuda_attnres_state st;
    void *workspace; /* device */
} cuda_attnres;

static lm_status cuda_attnres_create(lm_backend *be, const lm_attnres_config *cfg, void **out) {
    *out = NULL;
    lm_attnres_memory_plan plan;
    lm_status st = lm_cuda_attnres_memory(cfg, &plan);
    if (st) return st;
    cuda_attnres *a = (cuda_attnres *)calloc(1, sizeof *a);
    if (!a) return lm_error(LM_ERR_MEMORY, "out of memory for the residual state");
    if ((st = cuda_alloc(be, plan.total, &a->workspace)) ||
        (st = lm_cuda_attnres_init(&a->st, cfg, a->workspace, plan.total ? plan.total : 64))) {
        if (a->workspace) cudaFree(a->workspace);
        free(a);
        return st;
    }
    *out = a;
    return LM_OK;
}

static void cuda_attnres_free(lm_backend *be, void *state) {
    cuda_attnres *a = (cuda_attnres *)state;
    if (!a) return;
    cuda_release(be, a->workspace);
    free(a);
}

#define AR(s) (&((cuda_attnres *)(s))->st)
static lm_status cuda_ar_begin(lm_backend *be, void *s, const float *e) {
    return lm_cuda_attnres_begin(ctx_of(be), AR(s), e);
}
static lm_status cuda_ar_input(lm_backend *be, void *s, int l, const lm_attnres_params *p, float *h) {
    return lm_cuda_attnres_input(ctx_of(be), AR(s), l, p, h);
}
static lm_status cuda_ar_recompute_input(lm_backend *be, void *s, int l, float *h) {
    return lm_cuda_attnres_recompute_input(ctx_of(be), AR(s), l, h);
}
static lm_status cuda_ar_replay_block(lm_backend *be, void *s, int k) {
    (void)be;
    return lm_cuda_attnres_replay_block(AR(s), k);
}
/* the arena the KDA operator and the attention backward take (arena_get's rounding) */
static size_t cuda_op_scratch_bytes(const lm_kda_config *kda, const lm_attention_config *attn) {
    size_t b = 0;
    if (kda) b = lm_kda_cuda_workspace_bytes(kda, 1);
    if (attn) {
        size_t a = lm_cuda_attention_backward_workspace_bytes(attn);
        b = a > b ? a : b;
    }
    return (b + ARENA_GRANULE - 1) / ARENA_GRANULE * ARENA_GRANULE;
}
static lm_status cuda_ar_add_output(lm_backend *be, void *s, int l, const float *y) {
    return lm_cuda_attnres_add_output(ctx_of(be), AR(s), l, y);
}
static lm_status cuda_ar_add_output_note(lm_backend *be, void *s, int l, const float *y, int slot) {
    if (slot < 0 || slot >= LM_NONFINITE_SLOTS)
        return lm_error(LM_ERR_ARG, "attnres_add_output_note: slot %d outside [0, %d)", slot, LM_NONFINITE_SLOTS);
    return lm_cuda_attnres_add_output_note(ctx_of(be), AR(s), l, y, cb_of(be)->nonfinite + slot);
}
static lm_status cuda_ar_final(lm_backend *be, void *s, const lm_attnres_params *p, float *h) {
    return lm_cuda_attnres_final(ctx_of(be), AR(s), p, h);
}
static lm_status cuda_ar_final_backward(lm_backend *be, void *s, const lm_attnres_params *p, const float *dh,
                                        lm_attnres_grads *g) {
    return lm_cuda_attnres_final_backward(ctx_of(be), AR(s), p, dh, g);
}
static lm_status cuda_ar_output_backward(lm_backend *be, void *s, int l, float *dy) {
    return lm_cuda_attnres_output_backward(ctx_of(be), AR(s), l, dy);
}
static lm_status cuda_ar_output_grad(lm_backend *be, void *s, int l, const float **dy, const void **dy_lp) {
    return lm_cuda_attnres_output_grad(ctx_of(be), AR(s), l, dy, dy_lp);
}
static lm_status cuda_ar_input_backward(lm_backend *be, void *s, int l, const lm_attnres_params *p, const float *dh,
                                        lm_attnres_grads *g) {
    return lm_cuda_attnres_input_backward(ctx_of(be), AR(s), l, p, dh, g);
}
static lm_status cuda_ar_embedding_backward(lm_backend *be, void *s, float *de) {
    return lm_cuda_attnres_embedding_backward(ctx_of(be), AR(s), de);
}
static lm_status cuda_ar_input_norm(lm_backend *be, void *s, int l, const lm_attnres_params *p, const float *norm_w,
                                    float eps, float *xn, void *xn_lp, float *rstd, int recompute) {
    lm_cuda_attnres_norm nm = {norm_w, eps, xn, (uint16_t *)xn_lp, rstd};
    if (recompute) return lm_cuda_attnres_recompute_input_norm(ctx_of(be), AR(s), l, &nm);
    return lm_cuda_attnres_input_norm(ctx_of(be), AR(s), l, p, &nm);
}
static lm_status cuda_ar_input_norm_backward(lm_backend *be, void *s, int l, const lm_attnres_params *p,
                                             const float *dxn, const float *norm_w, const float *rstd, float *dnorm_w,
                                             lm_attnres_grads *g) {
    lm_cuda_attnres_norm_grad ng = {norm_w, rstd, dxn, dnorm_w};
    return lm_cuda_attnres_input_norm_backward(ctx_of(be), AR(s), l, p, &ng, g);
}
#undef AR

/* ---- checks ---- */

/* lm_cuda_all_finite into a device flag; only when it says no, the first index */
static lm_status cuda_find_nonfinite(lm_backend *be, const float *x, size_t n, int64_t *first) {
    cuda_backend *cb = cb_of(be);
    if (!first) return lm_error(LM_ERR_ARG, "find_nonfinite: first is NULL");
    *first = -1;
    if (n == 0) return LM_OK;
    if (!x) return lm_error(LM_ERR_ARG, "find_nonfinite: x is NULL");
    lm_status st = lm_cuda_all_finite(ctx_of(be), x, n, &cb->scalars->finite);
    int finite = 1;
    if (st || (st = cuda_download(be, &finite, &cb->scalars->finite, sizeof finite))) return st;
    if (finite) return LM_OK;
    unsigned long long idx = 0;
    if ((st = lm_cuda_backend_first_nonfinite(ctx_of(be), &cb->scalars->first, x, n)) ||
        (st = cuda_download(be, &idx, &cb->scalars->first, sizeof idx)))
        return st;
    *first = idx < (unsigned long long)n ? (int64_t)idx : -1;
    return LM_OK;
}

/* the deferred checks: a kernel a note, one download a take (lm_ops nonfinite_note) */
static lm_status cuda_nonfinite_note(lm_backend *be, const float *x, size_t n, int64_t base, int slot) {
    if (slot < 0 || slot >= LM_NONFINITE_SLOTS)
        return lm_error(LM_ERR_ARG, "nonfinite_note: slot %d outside [0, %d)", slot, LM_NONFINITE_SLOTS);
    if (base < 0) return lm_error(LM_ERR_ARG, "nonfinite_note: base %lld < 0", (long long)base);
    if (n == 0) return LM_OK;
    if (!x) return lm_error(LM_ERR_ARG, "nonfinite_note: x is NULL");
    return lm_cuda_backend_note_nonfinite(ctx_of(be), cb_of(be)->nonfinite + slot, x, n, (unsigned long long)base);
}
static lm_status cuda_nonfinite_take(lm_backend *be, int64_t *first, int nslots) {
    if (nslots < 0 || nslots > LM_NONFINITE_SLOTS || (nslots > 0 && !first))
        return lm_error(LM_ERR_ARG, "nonfinite_take: %d slots (at most %d) into %p", nslots, LM_NONFINITE_SLOTS,
                        (void *)first);
    if (nslots == 0) return LM_OK;
    unsigned long long got[LM_NONFINITE_SLOTS];
    lm_status st = cuda_download(be, got, cb_of(be)->nonfinite, (size_t)nslots * sizeof got[0]);
    if (st) return st;
    for (int i = 0; i < nslots; i++) first[i] = got[i] == ~0ull ? -1 : (int64_t)got[i];
    LM_CUDA_TRY(cudaMemsetAsync(cb_of(be)->nonfinite, 0xff, (size_t)nslots * sizeof got[0], stream_of(be)));
    return LM_OK;
}

/* ---- the optimizer's pieces (src/cuda/optim) ---- */

static lm_status cuda_sum_squares(lm_backend *be, const float *x, size_t n, double *out) {
    return lm_cuda_sum_squares(ctx_of(be), x, n, cb_of(be)->sumsq_parts, out);
}
static lm_status cuda_scale(lm_backend *be, float *x, size_t n, float s) { return lm_cuda_scale(ctx_of(be), x, n, s); }
static lm_status cuda_scale_exact(lm_backend *be, float *x, size_t n, double f) {
    return lm_cuda_scale_exact(ctx_of(be), x, n, f);
}
static lm_status cuda_adamw_update(lm_backend *be, float *w, const float *g, float *m, float *v, int64_t n, float lr,
                                   float beta1, float beta2, float eps, float wd, int64_t t) {
    return lm_cuda_adamw_update(ctx_of(be), w, g, m, v, n, lr, beta1, beta2, eps, wd, t);
}
static size_t cuda_muon_scratch_bytes(lm_backend *be, int64_t rows, int64_t cols, int n_blocks) {
    (void)be;
    return lm_cuda_muon_scratch_bytes(rows, cols, n_blocks);
}
static lm_status cuda_muon_update(lm_backend *be, float *w, const float *g, float *momentum, int64_t rows,
                                  int64_t cols, int n_blocks, float lr, float wd, const lm_optim_config *cfg,
                                  void *scratch, size_t scratch_bytes) {
    return lm_cuda_muon_update(ctx_of(be), w, g, momentum, rows, cols, n_blocks, lr, wd, cfg, scratch, scratch_bytes);
}

static lm_ops make_cuda_ops(void) {
    lm_ops o;
    memset(&o, 0, sizeof o);
    o.matmul_forward = cuda_matmul_forward;
    o.matmul_forward_lp = cuda_matmul_forward_lp;
    o.matmul_backward = cuda_matmul_backward;
    o.matmul_backward_set = cuda_matmul_backward_set;
    o.to_lp = cuda_to_lp;
    o.matmul_backward_ld = cuda_matmul_backward_ld;
    o.to_lp_rows = cuda_to_lp_rows;
    o.rmsnorm_forward = cuda_rmsnorm_forward;
    o.rmsnorm_backward = cuda_rmsnorm_backward;
    o.rmsnorm_backward_set = cuda_rmsnorm_backward_set;
    o.embedding_forward = cuda_embedding_forward;
    o.embedding_backward = cuda_embedding_backward;
    o.glu_forward = cuda_glu_forward;
    o.glu_backward = cuda_glu_backward;
    o.sigmoid_forward = cuda_sigmoid_forward;
    o.sigmoid_backward = cuda_sigmoid_backward;
    o.cross_entropy_work_bytes = cuda_ce_work_bytes;
    o.cross_entropy_forward = cuda_ce_forward;
    o.cross_entropy_backward = cuda_ce_backward;
    o.cross_entropy_forward_backward = cuda_ce_forward_backward;
    o.score_forward = cuda_score_forward;
    o.conv_silu_forward = cuda_conv_silu_forward;
    o.conv_silu_backward = cuda_conv_silu_backward;
    o.conv_silu_backward_lp = cuda_conv_silu_backward_lp;
    o.kda_forward = cuda_kda_forward;
    o.kda_backward = cuda_kda_backward;
    o.kda_state_apply = cuda_kda_state_apply;
    o.kda_kept_bytes = cuda_kda_kept_bytes;
    o.kda_output_forward = cuda_kda_output_forward;
    o.kda_output_backward = cuda_kda_output_backward;
    o.attention_forward = cuda_attention_forward;
    o.attention_backward = cuda_attention_backward;
    o.attention_forward_offset = cuda_attention_forward_offset;
    o.attention_backward_offset = cuda_attention_backward_offset;
    o.accumulate = cuda_accumulate;
    o.attention_head_max = cuda_attention_head_max;
    o.gate_forward = cuda_gate_forward;
    o.gate_backward = cuda_gate_backward;
    o.moe_acts_create = cuda_moe_acts_create;
    o.moe_acts_bytes = cuda_moe_acts_bytes;
    o.moe_acts_free = cuda_moe_acts_free;
    o.moe_forward = cuda_moe_forward;
    o.moe_backward = cuda_moe_backward;
    o.moe_ep_create = cuda_moe_ep_create;
    o.moe_ep_free = cuda_moe_ep_free;
    o.moe_ep_bytes = lm_cuda_moe_ep_plan_bytes;
    o.moe_ep_share = cuda_moe_ep_share;
    o.moe_forward_ep = cuda_moe_forward_ep;
    o.moe_backward_ep = cuda_moe_backward_ep;
    o.moe_scores = cuda_moe_scores;
    o.moe_balance_observe = cuda_moe_balance_observe;
    o.moe_balance_set_create = cuda_moe_balance_set_create;
    o.moe_balance_set_free = cuda_moe_balance_set_free;
    o.moe_balance_set_observe = cuda_moe_balance_set_observe;
    o.moe_balance_set_flush = cuda_moe_balance_set_flush;
    o.moe_aux_loss = cuda_moe_aux_loss;
    o.attnres_create = cuda_attnres_create;
    o.attnres_memory = lm_cuda_attnres_memory;
    o.attnres_recompute_input = cuda_ar_recompute_input;
    o.attnres_replay_block = cuda_ar_replay_block;
    o.op_scratch_bytes = cuda_op_scratch_bytes;
    o.attnres_free = cuda_attnres_free;
    o.attnres_begin = cuda_ar_begin;
    o.attnres_input = cuda_ar_input;
    o.attnres_add_output = cuda_ar_add_output;
    o.attnres_final = cuda_ar_final;
    o.attnres_final_backward = cuda_ar_final_backward;
    o.attnres_output_backward = cuda_ar_output_backward;
    o.attnres_output_grad = cuda_ar_output_grad;
    o.attnres_input_backward = cuda_ar_input_backward;
    o.attnres_embedding_backward = cuda_ar_embedding_backward;
    o.attnres_norm_fusable = lm_cuda_attnres_norm_fusable;
    o.attnres_input_norm = cuda_ar_input_norm;
    o.attnres_input_norm_backward = cuda_ar_input_norm_backward;
    o.find_nonfinite = cuda_find_nonfinite;
    o.sum_squares = cuda_sum_squares;
    o.scale = cuda_scale;
    o.scale_exact = cuda_scale_exact;
    o.adamw_update = cuda_adamw_update;
    o.muon_scratch_bytes = cuda_muon_scratch_bytes;
    o.muon_update = cuda_muon_update;
    return o;
}

static const lm_ops cuda_ops = make_cuda_ops();
/* the same with the non-finite checks deferred (the default; LONGMOE_FINITE_CHECKS=at-once: cuda_ops) */
static lm_ops make_cuda_ops_deferred(void) {
    lm_ops o = make_cuda_ops();
    o.nonfinite_note = cuda_nonfinite_note;
    o.nonfinite_take = cuda_nonfinite_take;
    o.attnres_add_output_note = cuda_ar_add_output_note;
    return o;
}
static const lm_ops cuda_ops_deferred = make_cuda_ops_deferred();

static void cuda_destroy(lm_backend *be) {
    cuda_backend *cb = cb_of(be);
    if (!cb) return;
    if (cb->ctx.stream) cudaStreamSynchronize((cudaStream_t)cb->ctx.stream);
    if (cb->arena) cudaFree(cb->arena);
    if (cb->scalars) cudaFree(cb->scalars);
    if (cb->sumsq_parts) cudaFree(cb->sumsq_parts);
    if (cb->nonfinite) cudaFree(cb->nonfinite);
    lm_cuda_context_destroy(&cb->ctx);
    free(cb);
}

extern "C" const lm_ops *lm_backend_cuda_ops(void) { return &cuda_ops; }

/* ---- the part timer (lm_backend timer_*): CUDA events on the stream ---- */

#define TIMER_EVENTS 256 /* marks between two takes before one folds the ring (one wait) */
#define TIMER_PARTS 32

typedef struct {
    cudaEvent_t ev[TIMER_EVENTS];
    int part[TIMER_EVENTS]; /* part[i]: what the interval (ev[i-1], ev[i]) is charged to; -1 none */
    int n;                  /* events recorded; ev[0] starts the chain */
    double acc[TIMER_PARTS];
} part_timer;

static void cuda_timer_free(lm_backend *be, void *p) {
    (void)be;
    part_timer *t = (part_timer *)p;
    if (!t) return;
    for (int i = 0; i < TIMER_EVENTS; i++)
        if (t->ev[i]) cudaEventDestroy(t->ev[i]);
    free(t);
}

static lm_status cuda_timer_create(lm_backend *be, void **out) {
    *out = NULL;
    part_timer *t = (part_timer *)calloc(1, sizeof *t);
    if (!t) return lm_error(LM_ERR_MEMORY, "out of memory for the part timer");
    for (int i = 0; i < TIMER_EVENTS; i++) {
        cudaError_t e = cudaEventCreate(&t->ev[i]);
        if (e != cudaSuccess) {
            t->ev[i] = NULL;
            cuda_timer_free(be, t);
            return lm_error(LM_ERR_IO, "part timer: cudaEventCreate: %s", cudaGetErrorString(e));
        }
    }
    *out = t;
    return LM_OK;
}

/* Wait for the last mark, add every interval to its part, keep the last event as the chain's start. */
static lm_status timer_fold(part_timer *t) {
    if (t->n <= 1) return LM_OK;
    LM_CUDA_TRY(cudaEventSynchronize(t->ev[t->n - 1]));
    for (int i = 1; i < t->n; i++) {
        if (t->part[i] < 0 || t->part[i] >= TIMER_PARTS) continue;
        float ms = 0;
        LM_CUDA_TRY(cudaEventElapsedTime(&ms, t->ev[i - 1], t->ev[i]));
        t->acc[t->part[i]] += ms * 1e-3;
    }
    cudaEvent_t last = t->ev[t->n - 1];
    t->ev[t->n - 1] = t->ev[0];
    t->ev[0] = last;
    t->part[0] = -1;
    t->n = 1;
    return LM_OK;
}

static lm_status cuda_timer_mark(lm_backend *be, void *p, int part) {
    part_timer *t = (part_timer *)p;
    if (!t) return lm_error(LM_ERR_ARG, "part timer: NULL");
    lm_status st;
    if (t->n == TIMER_EVENTS && (st = timer_fold(t))) return st;
    LM_CUDA_TRY(cudaEventRecord(t->ev[t->n], stream_of(be)));
    t->part[t->n] = t->n == 0 ? -1 : part;
    t->n++;
    return LM_OK;
}

static lm_status cuda_timer_take(lm_backend *be, void *p, double *seconds, int nparts) {
    (void)be;
    part_timer *t = (part_timer *)p;
    if (!t) return lm_error(LM_ERR_ARG, "part timer: NULL");
    lm_status st = timer_fold(t);
    if (st) return st;
    for (int i = 0; i < nparts && i < TIMER_PARTS; i++) {
        seconds[i] += t->acc[i];
        t->acc[i] = 0;
    }
    return LM_OK;
}

/* An environment switch read when the backend is created: 1 when unset,
 * empty or `on`, 0 when `off`; anything else is said on stderr and taken as 1. */
static int env_switch(const char *name, const char *on, const char *off) {
    const char *e = getenv(name);
    if (!e || !*e || !strcmp(e, on)) return 1;
    if (!strcmp(e, off)) return 0;
    fprintf(stderr, "longmoe: %s=%s ignored: use %s or %s\n", name, e, off, on);
    return 1;
}

/* By default a model notes its non-finite checks and takes them once a forward;
 * LONGMOE_FINITE_CHECKS=at-once waits for each */
static int deferred_checks_wanted(void) { return env_switch("LONGMOE_FINITE_CHECKS", "deferred", "at-once"); }

/* By default the part timer (CUDA events, no waits); LONGMOE_PART_TIMING=sync: a model
 * waits at each part's end */
static int part_timer_wanted(void) { return env_switch("LONGMOE_PART_TIMING", "events", "sync"); }

extern "C" lm_status lm_backend_cuda_create_local(int local, lm_backend **out) {
    if (!out) return lm_error(LM_ERR_ARG, "lm_backend_cuda_create_local: out is NULL");
    *out = NULL;
    if (local < 0) return lm_error(LM_ERR_ARG, "lm_backend_cuda_create_local: local index %d < 0", local);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        return lm_error(LM_ERR_IO, "no GPU can be used: %s", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    e = cudaSetDevice(local % count);
    if (e != cudaSuccess)
        return lm_error(LM_ERR_IO, "cannot use GPU %d of %d: %s", local % count, count, cudaGetErrorString(e));
    return lm_backend_cuda_create(out);
}

extern "C" lm_status lm_backend_cuda_create(lm_backend **out) {
    if (!out) return lm_error(LM_ERR_ARG, "lm_backend_cuda_create: out is NULL");
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0)
        return lm_error(LM_ERR_IO, "no GPU can be used: %s", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    cuda_backend *cb = (cuda_backend *)calloc(1, sizeof *cb);
    if (!cb) return lm_error(LM_ERR_MEMORY, "out of memory for the CUDA backend");
    lm_status st = lm_cuda_context_create(&cb->ctx);
    if (st) {
        char why[256];
        snprintf(why, sizeof why, "%s", lm_last_error());
        lm_cuda_context_destroy(&cb->ctx);
        free(cb);
        return lm_error(LM_ERR_IO, "no GPU can be used: %s", why);
    }
    cb->be.device = LM_DEVICE_CUDA;
    cb->be.lp_bytes = 2;
    cb->be.ops = deferred_checks_wanted() ? &cuda_ops_deferred : &cuda_ops;
    cb->be.ctx = &cb->ctx;
    cb->be.alloc = cuda_alloc;
    cb->be.release = cuda_release;
    cb->be.zero = cuda_zero;
    cb->be.copy = cuda_copy;
    cb->be.upload = cuda_upload;
    cb->be.download = cuda_download;
    cb->be.sync = cuda_sync;
    cb->be.destroy = cuda_destroy;
    cb->be.memory = cuda_memory;
    if (part_timer_wanted()) {
        cb->be.timer_create = cuda_timer_create;
        cb->be.timer_mark = cuda_timer_mark;
        cb->be.timer_take = cuda_timer_take;
        cb->be.timer_free = cuda_timer_free;
    }
    if ((st = cuda_alloc(&cb->be, sizeof(cuda_scalars), (void **)&cb->scalars)) ||
        (st = cuda_alloc(&cb->be, LM_CUDA_SUMSQ_PARTS * sizeof(double), (void **)&cb->sumsq_parts)) ||
        (st = cuda_alloc(&cb->be, LM_NONFINITE_SLOTS * sizeof(unsigned long long), (void **)&cb->nonfinite))) {
        cuda_destroy(&cb->be);
        return st;
    }
    cudaError_t me = cudaMemsetAsync(cb->nonfinite, 0xff, LM_NONFINITE_SLOTS * sizeof(unsigned long long),
                                     stream_of(&cb->be));
    if (me == cudaSuccess) me = cudaStreamSynchronize(stream_of(&cb->be));
    if (me != cudaSuccess) {
        cuda_destroy(&cb->be);
        return lm_error(LM_ERR_IO, "CUDA backend: clearing the check slots: %s", cudaGetErrorString(me));
    }
    *out = &cb->be;
    return LM_OK;
}
