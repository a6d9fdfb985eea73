/* The CPU backend (include/longmoe/backend.h): host memory and the fp32
 * operators of src/ops. The product format is fp32, so every lp view is the
 * fp32 tensor itself and the model computes exactly what the CPU operators
 * compute when called directly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/attention.h"
#include "longmoe/attnres.h"
#include "longmoe/balance.h"
#include "longmoe/backend.h"
#include "longmoe/kda.h"
#include "longmoe/kda_state_map.h"
#include "longmoe/linear.h"
#include "longmoe/moe.h"
#include "longmoe/moe_ep.h"

/* rows of logits the chunked cross-entropy holds at once */
#define CE_CHUNK 32

static const char *const device_names[] = {"cpu", "cuda"};

const char *lm_device_name(lm_device d) { return (unsigned)d < 2 ? device_names[d] : "?"; }

int lm_device_from_name(const char *name, lm_device *out) {
    for (int i = 0; i < 2; i++)
        if (name && !strcmp(name, device_names[i])) {
            *out = (lm_device)i;
            return 0;
        }
    return -1;
}

/* ---- memory ---- */

static lm_status cpu_alloc(lm_backend *be, size_t bytes, void **out) {
    (void)be;
    size_t n = (bytes + 63) / 64 * 64;
    *out = aligned_alloc(64, n ? n : 64);
    if (!*out) return lm_error(LM_ERR_MEMORY, "out of host memory for %zu bytes", bytes);
    memset(*out, 0, n ? n : 64);
    return LM_OK;
}

static void cpu_release(lm_backend *be, void *ptr) {
    (void)be;
    free(ptr);
}

static lm_status cpu_zero(lm_backend *be, void *ptr, size_t bytes) {
    (void)be;
    if (bytes) memset(ptr, 0, bytes);
    return LM_OK;
}

static lm_status cpu_copy(lm_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes && dst != src) memmove(dst, src, bytes);
    return LM_OK;
}

static lm_status cpu_sync(lm_backend *be) {
    (void)be;
    return LM_OK;
}

/* ---- products ---- */

static lm_status cpu_matmul_forward(lm_backend *be, float *out, const void *inp, const void *w, int64_t n, int ic,
                                    int oc) {
    (void)be;
    lm_matmul_forward(out, (const float *)inp, (const float *)w, NULL, n, ic, oc);
    return LM_OK;
}

static lm_status cpu_matmul_forward_lp(lm_backend *be, void *out, const void *inp, const void *w, int64_t n,
                                       int ic, int oc) {
    return cpu_matmul_forward(be, (float *)out, inp, w, n, ic, oc);
}

static lm_status cpu_matmul_backward(lm_backend *be, float *dinp, float *dw, const void *dout, const void *inp,
                                     const void *w, int64_t n, int ic, int oc) {
    (void)be;
    lm_matmul_backward(dinp, dw, NULL, (const float *)dout, (const float *)inp, (const float *)w, n, ic, oc);
    return LM_OK;
}

/* dinp written: zeroed, then the accumulating product (the bits of both in turn) */
static lm_status cpu_matmul_backward_set(lm_backend *be, float *dinp, float *dw, const void *dout, const void *inp,
                                         const void *w, int64_t n, int ic, int oc) {
    if (dinp) memset(dinp, 0, (size_t)n * ic * sizeof(float));
    return cpu_matmul_backward(be, dinp, dw, dout, inp, w, n, ic, oc);
}

static lm_status cpu_to_lp(lm_backend *be, void *dst, const float *src, size_t n) {
    (void)be;
    if (dst != (const void *)src) memcpy(dst, src, n * sizeof(float));
    return LM_OK;
}

/* ---- norms, embedding, activations ---- */

static lm_status cpu_rmsnorm_forward(lm_backend *be, float *out, void *out_lp, float *rstd, const float *inp,
                                     const float *w, int64_t n, int d, float eps) {
    (void)be;
    lm_rmsnorm_forward(out, rstd, inp, w, n, d, eps);
    if (out_lp && out_lp != (void *)out) memcpy(out_lp, out, (size_t)n * d * sizeof(float));
    return LM_OK;
}

static lm_status cpu_rmsnorm_backward(lm_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                                      const float *w, const float *rstd, int64_t n, int d, float eps) {
    (void)be;
    lm_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, n, d, eps);
    return LM_OK;
}

static lm_status cpu_rmsnorm_backward_set(lm_backend *be, float *dinp, float *dw, const float *dout,
                                          const float *inp, const float *w, const float *rstd, int64_t n, int d,
                                          float eps) {
    if (dinp) memset(dinp, 0, (size_t)n * d * sizeof(float));
    return cpu_rmsnorm_backward(be, dinp, dw, dout, inp, w, rstd, n, d, eps);
}

static lm_status cpu_embedding_forward(lm_backend *be, float *out, const float *table, const int32_t *tokens,
                                       int64_t n, int d) {
    (void)be;
    for (int64_t i = 0; i < n; i++) memcpy(out + i * d, table + (size_t)tokens[i] * d, (size_t)d * sizeof(float));
    return LM_OK;
}

static lm_status cpu_embedding_backward(lm_backend *be, float *dtable, const float *dout, const int32_t *tokens,
                                        int64_t n, int d, int vocab) {
    (void)be;
    (void)vocab;
    /* in token order: deterministic */
    for (int64_t i = 0; i < n; i++) {
        float *row = dtable + (size_t)tokens[i] * d;
        const float *g = dout + i * d;
        for (int j = 0; j < d; j++) row[j] += g[j];
    }
    return LM_OK;
}

static lm_status cpu_glu_forward(lm_backend *be, lm_glu_kind act, float *h, void *h_lp, const float *a,
                                 const float *u, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) h[i] = lm_expert_act_forward((lm_expert_act)act, a[i], u[i]);
    if (h_lp && h_lp != (void *)h) memcpy(h_lp, h, n * sizeof(float));
    return LM_OK;
}

/* An fp32 output with an optional copy in the product format (fp32 here):
 * the op writes into f32_or_lp (the fp32 buffer, or the copy when that is
 * NULL), then fill_lp copies into the lp buffer when it is another one. */
static float *f32_or_lp(float *f32, void *lp) { return f32 ? f32 : (float *)lp; }
static void fill_lp(void *lp, const float *f32, size_t n) {
    if (lp && lp != (const void *)f32) memcpy(lp, f32, n * sizeof(float));
}

static lm_status cpu_glu_backward(lm_backend *be, lm_glu_kind act, float *da, float *du, void *da_lp, void *du_lp,
                                  const float *dh, const float *a, const float *u, size_t n) {
    (void)be;
    float *ga = f32_or_lp(da, da_lp), *gu = f32_or_lp(du, du_lp);
    if (!ga || !gu) return lm_error(LM_ERR_ARG, "glu_backward: da or du has neither an fp32 nor an lp output");
    for (size_t i = 0; i < n; i++) {
        float ha, hu;
        lm_expert_act_backward((lm_expert_act)act, a[i], u[i], &ha, &hu);
        ga[i] = dh[i] * ha;
        gu[i] = dh[i] * hu;
    }
    fill_lp(da_lp, ga, n);
    fill_lp(du_lp, gu, n);
    return LM_OK;
}

static lm_status cpu_sigmoid_forward(lm_backend *be, float *out, const float *in, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) out[i] = lm_sigmoidf(in[i]);
    return LM_OK;
}

static lm_status cpu_sigmoid_backward(lm_backend *be, float *dlogit, const float *dout, const float *y, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) dlogit[i] = dout[i] * (y[i] * (1.0f - y[i]));
    return LM_OK;
}

/* ---- the LM head with a chunked cross-entropy ---- */

static size_t cpu_ce_work_bytes(lm_backend *be, int64_t n, int d, int vocab) {
    (void)be;
    (void)d;
    return (size_t)(n < CE_CHUNK ? n : CE_CHUNK) * (size_t)vocab * sizeof(float);
}

static lm_status cpu_ce_forward(lm_backend *be, float *lse_rows, float *target_logit, double *loss_sum,
                                const void *hn_lp, const void *head_lp, const int32_t *targets, int64_t n, int d,
                                int V, void *work) {
    (void)be;
    const float *hn = hn_lp, *W = head_lp;
    float *logits = work;
    double total = 0;
    /* CE_CHUNK rows of logits at a time, log-sum-exp in fp32 */
    for (int64_t r0 = 0; r0 < n; r0 += CE_CHUNK) {
        int rows = (int)(n - r0 < CE_CHUNK ? n - r0 : CE_CHUNK);
        lm_matmul_forward(logits, hn + r0 * d, W, NULL, rows, d, V);
        for (int r = 0; r < rows; r++) {
            const float *z = logits + (size_t)r * V;
            float mx = z[0];
            for (int v = 1; v < V; v++) mx = z[v] > mx ? z[v] : mx;
            float s = 0;
            for (int v = 0; v < V; v++) s += expf(z[v] - mx);
            float lse = mx + logf(s);
            lse_rows[r0 + r] = lse;
            if (target_logit) target_logit[r0 + r] = z[targets[r0 + r]];
            total += (double)(lse - z[targets[r0 + r]]);
        }
    }
    *loss_sum = total;
    return LM_OK;
}

static lm_status cpu_ce_backward(lm_backend *be, float *dhn, float *dhead, const void *hn_lp, const void *head_lp,
                                 const int32_t *targets, const float *lse_rows, const float *row_scale, float scale,
                                 int64_t n, int d, int V, void *work) {
    (void)be;
    const float *hn = hn_lp, *W = head_lp;
    float *logits = work;
    /* recompute each chunk's logits, dlogits = (softmax - onehot) * s */
    for (int64_t r0 = 0; r0 < n; r0 += CE_CHUNK) {
        int rows = (int)(n - r0 < CE_CHUNK ? n - r0 : CE_CHUNK);
        lm_matmul_forward(logits, hn + r0 * d, W, NULL, rows, d, V);
        for (int r = 0; r < rows; r++) {
            float *z = logits + (size_t)r * V, lse = lse_rows[r0 + r];
            float s = row_scale ? scale * row_scale[r0 + r] : scale;
            for (int v = 0; v < V; v++) z[v] = expf(z[v] - lse) * s;
            z[targets[r0 + r]] -= s;
        }
        lm_matmul_backward(dhn + r0 * d, dhead, NULL, logits, hn + r0 * d, W, rows, d, V);
    }
    return LM_OK;
}

/* evaluation's scores: the chunks of the forward above, each row scored by
 * lm_score_row (the rows of a chunk in parallel: each is its own) */
static lm_status cpu_score_forward(lm_backend *be, double *nll, int32_t *argmax, const void *hn_lp,
                                   const void *head_lp, const int32_t *targets, int64_t n, int d, int V, void *work) {
    (void)be;
    const float *hn = hn_lp, *W = head_lp;
    float *logits = work;
    for (int64_t r0 = 0; r0 < n; r0 += CE_CHUNK) {
        int rows = (int)(n - r0 < CE_CHUNK ? n - r0 : CE_CHUNK);
        lm_matmul_forward(logits, hn + r0 * d, W, NULL, rows, d, V);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < rows; r++)
            lm_score_row(logits + (size_t)r * V, V, targets[r0 + r], &nll[r0 + r], &argmax[r0 + r]);
    }
    return LM_OK;
}

/* ---- the KDA token mixer's pieces ---- */

/* conv_out NULL: the convolution goes into out (fp32 here), SiLU and the norm then run in place */
static lm_status cpu_conv_silu_forward(lm_backend *be, float *conv_out, void *out_lp, float *rnorm, const float *in,
                                       const float *w, int B, int T, int C, int W, int head_dim) {
    (void)be;
    float *c = conv_out ? conv_out : out_lp;
    lm_short_conv_forward(c, in, w, B, T, C, W);
    lm_silu_l2_forward(out_lp, rnorm, c, (size_t)B * T * C / (size_t)head_dim, head_dim);
    return LM_OK;
}

static lm_status cpu_conv_silu_backward(lm_backend *be, float *din, float *dw, const void *dout_lp,
                                        const float *conv_out, const void *out_lp, const float *rnorm,
                                        const float *in, const float *w, int B, int T, int C, int W, int head_dim,
                                        float *tmp) {
    (void)be;
    /* conv_out NULL: recomputed by the forward's function into din, which is written only after it is read */
    if (!conv_out) {
        lm_short_conv_forward(din, in, w, B, T, C, W);
        conv_out = din;
    }
    lm_silu_l2_backward(tmp, dout_lp, conv_out, out_lp, rnorm, (size_t)B * T * C / (size_t)head_dim, head_dim);
    lm_short_conv_backward(din, dw, tmp, in, w, B, T, C, W);
    return LM_OK;
}

static lm_status cpu_kda_forward(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k,
                                 const void *v, const void *z, const float *beta, const float *A_log,
                                 const float *dt_bias, const float *h0, void *o, float *ht) {
    (void)be;
    lm_kda_inputs in = {q, k, v, z, beta, A_log, dt_bias, h0};
    return lm_kda_chunk_forward(cfg, &in, o, ht);
}

static lm_status cpu_kda_backward(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k,
                                  const void *v, const void *z, const float *beta, const float *A_log,
                                  const float *dt_bias, const float *h0, const void *d_o, const float *dht,
                                  void *dq, void *dk, void *dv, void *dz, float *dbeta, float *dA_log,
                                  float *ddt_bias, float *dh0) {
    (void)be;
    if (cfg->dz_ld != 0 && cfg->dz_ld != (int64_t)cfg->H * cfg->K)
        return lm_error(LM_ERR_ARG, "kda_backward: dz_ld = %lld; the CPU writes dense rows (0 or H*K)",
                        (long long)cfg->dz_ld);
    size_t n = (size_t)cfg->B * cfg->T * cfg->H;
    memset(dq, 0, n * cfg->K * sizeof(float));
    memset(dk, 0, n * cfg->K * sizeof(float));
    memset(dv, 0, n * cfg->V * sizeof(float));
    memset(dz, 0, n * cfg->K * sizeof(float));
    memset(dbeta, 0, n * sizeof(float));
    if (dh0) memset(dh0, 0, (size_t)cfg->B * cfg->H * cfg->K * cfg->V * sizeof(float));
    lm_kda_inputs in = {q, k, v, z, beta, A_log, dt_bias, h0};
    lm_kda_grads g = {dq, dk, dv, dz, dbeta, dA_log, ddt_bias, dh0};
    return lm_kda_chunk_backward(cfg, &in, d_o, dht, &g);
}

static lm_status cpu_kda_state_apply(lm_backend *be, int n_pairs, int K, int V, const float *P, const float *Q,
                                     const float *S, float *out, int transposed) {
    (void)be;
    return transposed ? lm_kda_state_map_apply_transposed(n_pairs, K, V, P, Q, S, out)
                      : lm_kda_state_map_apply(n_pairs, K, V, P, Q, S, out);
}

static lm_status cpu_kda_output_forward(lm_backend *be, float *gated, void *gated_lp, float *o_rstd, float *gate,
                                        const float *gate_logits, const void *o_lp, const float *o_norm, int64_t N,
                                        int H, int K, float eps) {
    (void)be;
    /* head RMSNorm into `gated`, then the output gate */
    lm_rmsnorm_forward(gated, o_rstd, o_lp, o_norm, N * H, K, eps);
    size_t n = (size_t)N * H * K;
    for (size_t i = 0; i < n; i++) {
        gate[i] = lm_sigmoidf(gate_logits[i]);
        gated[i] *= gate[i];
    }
    if (gated_lp && gated_lp != (void *)gated) memcpy(gated_lp, gated, n * sizeof(float));
    return LM_OK;
}

static lm_status cpu_kda_output_backward(lm_backend *be, void *d_o_lp, float *dgate_f32, void *dgate_lp,
                                         int64_t ld_dgate_lp, float *do_norm, const float *d_gated, const void *o_lp, const float *o_rstd,
                                         const float *gate, const float *o_norm, int64_t N, int H, int K, float eps,
                                         float *tmp) {
    (void)be;
    const float *o = o_lp;
    size_t n = (size_t)N * H * K;
    float *dgate_logits = f32_or_lp(dgate_f32, dgate_lp);
    if (!dgate_logits) return lm_error(LM_ERR_ARG, "kda_output_backward: dgate_logits and its lp copy are NULL");
    if (ld_dgate_lp != 0 && ld_dgate_lp != (int64_t)H * K)
        return lm_error(LM_ERR_ARG, "kda_output_backward: ld_dgate_lp = %lld; the CPU writes dense rows (0 or H*K)",
                        (long long)ld_dgate_lp);
    /* gated = gate ⊙ nrm with nrm = RMSNorm(o): d gate-logit = d_gated nrm gate (1 - gate); d nrm = d_gated gate */
    for (size_t i = 0; i < n; i++) {
        float gt = gate[i], nrm = o[i] * o_rstd[i / K] * o_norm[i % K];
        dgate_logits[i] = d_gated[i] * nrm * gt * (1.0f - gt);
        tmp[i] = d_gated[i] * gt;
    }
    memset(d_o_lp, 0, n * sizeof(float));
    lm_rmsnorm_backward(d_o_lp, do_norm, tmp, o, o_norm, o_rstd, N * H, K, eps);
    fill_lp(dgate_lp, dgate_logits, n);
    return LM_OK;
}

/* ---- gated attention ---- */

static lm_status cpu_attention_forward(lm_backend *be, const lm_attention_config *cfg, const void *q, const void *k,
                                       const void *v, void *o, float *lse, float *rowmax) {
    (void)be;
    return lm_attention_forward_rowmax(cfg, q, k, v, o, lse, rowmax);
}

static lm_status cpu_attention_backward(lm_backend *be, const lm_attention_config *c, const void *q, const void *k,
                                        const void *v, const void *o, const float *lse, const void *d_o, void *dq,
                                        void *dk, void *dv) {
    (void)be;
    size_t nq = (size_t)c->B * c->T * c->H, nk = (size_t)c->B * c->T * c->Hkv;
    memset(dq, 0, nq * c->Dk * sizeof(float));
    memset(dk, 0, nk * c->Dk * sizeof(float));
    memset(dv, 0, nk * c->Dv * sizeof(float));
    return lm_attention_backward(c, q, k, v, o, lse, d_o, dq, dk, dv);
}

static lm_status cpu_attention_forward_offset(lm_backend *be, const lm_attention_config *cfg, int q_offset,
                                              const void *q, const void *k, const void *v, void *o, float *lse,
                                              float *rowmax) {
    (void)be;
    return lm_attention_forward_offset(cfg, q_offset, q, k, v, o, lse, rowmax);
}

static lm_status cpu_attention_backward_offset(lm_backend *be, const lm_attention_config *c, int q_offset,
                                               const void *q, const void *k, const void *v, const void *o,
                                               const float *lse, const void *d_o, void *dq, void *dk, void *dv) {
    (void)be;
    if (!c || q_offset < 0) return lm_error(LM_ERR_ARG, "attention_backward_offset: cfg is NULL or q_offset < 0");
    size_t nq = (size_t)c->B * c->T * c->H, nk = (size_t)c->B * ((size_t)q_offset + c->T) * c->Hkv;
    memset(dq, 0, nq * c->Dk * sizeof(float));
    memset(dk, 0, nk * c->Dk * sizeof(float));
    memset(dv, 0, nk * c->Dv * sizeof(float));
    return lm_attention_backward_offset(c, q_offset, q, k, v, o, lse, d_o, dq, dk, dv);
}

static lm_status cpu_accumulate(lm_backend *be, float *acc, const void *x, size_t n, int lp) {
    (void)be;
    (void)lp; /* the CPU's product format is fp32 */
    const float *xf = x;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) acc[i] += xf[i];
    return LM_OK;
}

static lm_status cpu_gate_forward(lm_backend *be, float *gated, void *gated_lp, const float *gp, const void *o_lp,
                                  size_t n) {
    (void)be;
    const float *o = o_lp;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)n; i++) gated[i] = lm_sigmoidf(gp[i]) * o[i];
    if (gated_lp && gated_lp != (void *)gated) memcpy(gated_lp, gated, n * sizeof(float));
    return LM_OK;
}

static lm_status cpu_gate_backward(lm_backend *be, void *d_o_lp, float *dgp_f32, void *dgp_lp, const float *dgated,
                                   const float *gp, const void *o_lp, size_t n) {
    (void)be;
    const float *o = o_lp;
    float *d_o = d_o_lp, *dgp = f32_or_lp(dgp_f32, dgp_lp);
    if (!dgp) return lm_error(LM_ERR_ARG, "gate_backward: dgate_logits and its lp copy are NULL");
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)n; i++) {
        const float s = lm_sigmoidf(gp[i]);
        d_o[i] = dgated[i] * s;
        dgp[i] = dgated[i] * o[i] * s * (1.0f - s);
    }
    fill_lp(dgp_lp, dgp, n);
    return LM_OK;
}

static lm_status cpu_attention_head_max(lm_backend *be, const lm_attention_config *c, const float *rm,
                                        float *head_max) {
    (void)be;
    for (int h = 0; h < c->H; h++) {
        float mx = -INFINITY;
        for (int b = 0; b < c->B; b++)
            for (int t = 0; t < c->T; t++) {
                float v = rm[((size_t)b * c->H + h) * c->T + t];
                mx = v > mx ? v : mx;
            }
        head_max[h] = mx;
    }
    return LM_OK;
}

/* ---- the MoE layer and its balancing ---- */

static lm_status cpu_moe_acts_create(lm_backend *be, const lm_moe_config *cfg, int64_t m_max, void **out) {
    (void)be;
    *out = NULL;
    lm_moe_acts *a = calloc(1, sizeof *a);
    if (!a) return lm_error(LM_ERR_MEMORY, "out of memory for the MoE activations");
    lm_status st = lm_moe_acts_alloc(a, cfg, m_max);
    if (st) {
        free(a);
        return st;
    }
    *out = a;
    return LM_OK;
}

static size_t cpu_moe_acts_bytes(const lm_moe_config *cfg, int64_t m_max) { return lm_moe_acts_bytes(cfg, m_max); }

static void cpu_moe_acts_free(lm_backend *be, void *acts) {
    (void)be;
    if (!acts) return;
    lm_moe_acts_free(acts);
    free(acts);
}

/* x_lp is x's view (x itself): the operator reads x */
static lm_status cpu_moe_forward(lm_backend *be, float *y, const float *x, const void *x_lp, const float *bias,
                                 const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                                 void *acts, int64_t m) {
    (void)be;
    (void)x_lp;
    (void)p_lp;
    return lm_moe_forward(y, x, bias, cfg, p, acts, m);
}

static lm_status cpu_moe_backward(lm_backend *be, float *dx, const lm_moe_params *g, const float *dy,
                                  const void *dy_lp, const float *x, const float *dscores_extra,
                                  const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                                  void *acts, int expert_grads_set) {
    (void)be;
    (void)dy_lp;
    (void)p_lp;
    if (expert_grads_set && cfg) {
        /* zeroed, then added to: the bits of the accumulating call after a zeroing */
        const size_t n = lm_moe_expert_tensor_floats(cfg);
        float *dw[3] = {g->gate, g->up, g->down};
        for (int i = 0; i < 3; i++)
            if (dw[i]) memset(dw[i], 0, n * sizeof(float));
    }
    return lm_moe_backward(dx, (lm_moe_params *)g, dy, x, dscores_extra, cfg, p, acts);
}

/* expert parallelism: the exchange of src/comm/moe_ep.c over a host engine */
static lm_status cpu_moe_ep_create(lm_backend *be, lm_comm *comm, const lm_moe_config *cfg, void **out) {
    (void)be;
    *out = NULL;
    if (comm && lm_comm_engine_of(comm) == LM_COMM_NCCL)
        return lm_error(LM_ERR_ARG, "expert parallelism on the CPU backend exchanges host memory: it needs a host "
                        "engine (self, MPI, or staged over the CPU backend), not nccl");
    lm_moe_ep *ep = NULL;
    lm_status st = lm_moe_ep_create(comm, cfg, &ep);
    *out = ep;
    return st;
}

/* nothing of the CPU handle is shared */
static size_t cpu_moe_ep_bytes(const lm_moe_config *cfg, int R, int64_t rows, int shared_part) {
    return shared_part ? 0 : lm_moe_ep_plan_bytes(cfg, R, rows);
}

static void cpu_moe_ep_free(lm_backend *be, void *ep) {
    (void)be;
    lm_moe_ep_free(ep);
}

static lm_status cpu_moe_forward_ep(lm_backend *be, float *y, const float *x, const void *x_lp, const float *bias,
                                    const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                                    void *acts, int64_t m, void *ep) {
    (void)be;
    (void)x_lp;
    (void)p_lp;
    return lm_moe_forward_ep(y, x, bias, cfg, p, acts, m, ep);
}

static lm_status cpu_moe_backward_ep(lm_backend *be, float *dx, const lm_moe_params *g, const float *dy,
                                     const void *dy_lp, const float *x, const float *dscores_extra,
                                     const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                                     void *acts, void *ep) {
    (void)be;
    (void)dy_lp;
    (void)p_lp;
    return lm_moe_backward_ep(dx, (lm_moe_params *)g, dy, x, dscores_extra, cfg, p, acts, ep);
}

static float *cpu_moe_scores(lm_backend *be, void *acts) {
    (void)be;
    return ((lm_moe_acts *)acts)->s;
}

static lm_status cpu_moe_balance_observe(lm_backend *be, lm_balance_state *bal, void *acts, int64_t m) {
    (void)be;
    return lm_balance_observe(bal, ((lm_moe_acts *)acts)->s, m, 1);
}

static lm_status cpu_moe_aux_loss(lm_backend *be, float *loss, float *dscores, void *acts, int64_t m, int n, int k,
                                  float alpha) {
    (void)be;
    const lm_moe_acts *a = acts;
    memset(dscores, 0, (size_t)m * n * sizeof(float));
    return lm_balance_aux_loss(loss, dscores, a->s, a->topk, m, n, k, alpha);
}

/* ---- the residual stream over depth ---- */

typedef struct {
    lm_attnres_state st;
    void *workspace;
} cpu_attnres;

/* every part of the plan is a multiple of 64 bytes, so is its total */
static size_t cpu_attnres_bytes(const lm_attnres_config *cfg) {
    lm_attnres_memory_plan plan;
    if (lm_attnres_memory(cfg, &plan)) return 0;
    return (plan.total + 63) / 64 * 64;
}

static lm_status cpu_attnres_create(lm_backend *be, const lm_attnres_config *cfg, void **out) {
    (void)be;
    *out = NULL;
    lm_attnres_memory_plan plan;
    lm_status st = lm_attnres_memory(cfg, &plan);
    if (st) return st;
    cpu_attnres *a = calloc(1, sizeof *a);
    size_t bytes = cpu_attnres_bytes(cfg);
    if (a) a->workspace = aligned_alloc(64, bytes ? bytes : 64);
    if (!a || !a->workspace) {
        free(a);
        return lm_error(LM_ERR_MEMORY, "out of memory for the residual history (%zu bytes)", bytes);
    }
    if ((st = lm_attnres_init(&a->st, cfg, a->workspace, bytes))) {
        free(a->workspace);
        free(a);
        return st;
    }
    *out = a;
    return LM_OK;
}

static void cpu_attnres_free(lm_backend *be, void *state) {
    (void)be;
    cpu_attnres *a = state;
    if (!a) return;
    free(a->workspace);
    free(a);
}

#define AR(state) (&((cpu_attnres *)(state))->st)
static lm_status cpu_ar_begin(lm_backend *be, void *s, const float *e) { (void)be; return lm_attnres_begin(AR(s), e); }
static lm_status cpu_ar_input(lm_backend *be, void *s, int l, const lm_attnres_params *p, float *h) {
    (void)be;
    return lm_attnres_input(AR(s), l, p, h);
}
static lm_status cpu_ar_recompute_input(lm_backend *be, void *s, int l, float *h) {
    (void)be;
    return lm_attnres_recompute_input(AR(s), l, h);
}
static lm_status cpu_ar_replay_block(lm_backend *be, void *s, int k) {
    (void)be;
    return lm_attnres_replay_block(AR(s), k);
}
/* the model passes the KDA and attention operators their workspace on the CPU */
static size_t cpu_op_scratch_bytes(const lm_kda_config *kda, const lm_attention_config *attn) {
    (void)kda;
    (void)attn;
    return 0;
}
static lm_status cpu_ar_add_output(lm_backend *be, void *s, int l, const float *y) {
    (void)be;
    return lm_attnres_add_output(AR(s), l, y);
}
static lm_status cpu_ar_final(lm_backend *be, void *s, const lm_attnres_params *p, float *h) {
    (void)be;
    return lm_attnres_final(AR(s), p, h);
}
static lm_status cpu_ar_final_backward(lm_backend *be, void *s, const lm_attnres_params *p, const float *dh,
                                       lm_attnres_grads *g) {
    (void)be;
    return lm_attnres_final_backward(AR(s), p, dh, g);
}
static lm_status cpu_ar_output_backward(lm_backend *be, void *s, int l, float *dy) {
    (void)be;
    return lm_attnres_output_backward(AR(s), l, dy);
}
static lm_status cpu_ar_input_backward(lm_backend *be, void *s, int l, const lm_attnres_params *p, const float *dh,
                                       lm_attnres_grads *g) {
    (void)be;
    return lm_attnres_input_backward(AR(s), l, p, dh, g);
}
static lm_status cpu_ar_embedding_backward(lm_backend *be, void *s, float *de) {
    (void)be;
    return lm_attnres_embedding_backward(AR(s), de);
}
#undef AR

static lm_status cpu_find_nonfinite(lm_backend *be, const float *x, size_t n, int64_t *first) {
    (void)be;
    *first = -1;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) {
            *first = (int64_t)i;
            break;
        }
    return LM_OK;
}

/* ---- the optimizer's pieces: the functions of src/train/optim.c themselves ---- */

static lm_status cpu_sum_squares(lm_backend *be, const float *x, size_t n, double *out) {
    (void)be;
    if (!out || (n && !x)) return lm_error(LM_ERR_ARG, "sum_squares: x or out is NULL");
    *out = lm_sum_squares(x, (int64_t)n);
    return LM_OK;
}

static lm_status cpu_scale(lm_backend *be, float *x, size_t n, float s) {
    (void)be;
    if (n && !x) return lm_error(LM_ERR_ARG, "scale: x is NULL");
    /* lm_grads_scale's loop on one tensor */
    lm_param p = lm_param_vector(NULL, x, x, (int64_t)n, LM_PARAM_VECTOR);
    if (n) lm_grads_scale(&p, 1, s);
    return LM_OK;
}

static lm_status cpu_scale_exact(lm_backend *be, float *x, size_t n, double f) {
    (void)be;
    if (n && !x) return lm_error(LM_ERR_ARG, "scale_exact: x is NULL");
    for (size_t i = 0; i < n; i++) x[i] = (float)((double)x[i] * f);
    return LM_OK;
}

static lm_status cpu_adamw_update(lm_backend *be, float *w, const float *g, float *m, float *v, int64_t n, float lr,
                                  float beta1, float beta2, float eps, float wd, int64_t t) {
    (void)be;
    if (n < 0 || (n && (!w || !g || !m || !v)))
        return lm_error(LM_ERR_ARG, "adamw_update: n %lld with a NULL array", (long long)n);
    if (t < 1) return lm_error(LM_ERR_ARG, "adamw_update: step %lld must be >= 1", (long long)t);
    lm_adamw_update(w, g, m, v, n, lr, beta1, beta2, eps, wd, t);
    return LM_OK;
}

static size_t cpu_muon_scratch_bytes(lm_backend *be, int64_t rows, int64_t cols, int n_blocks) {
    (void)be;
    return lm_muon_scratch_floats(rows, cols, n_blocks) * sizeof(float);
}

static lm_status cpu_muon_update(lm_backend *be, float *w, const float *g, float *momentum, int64_t rows,
                                 int64_t cols, int n_blocks, float lr, float wd, const lm_optim_config *cfg,
                                 void *scratch, size_t scratch_bytes) {
    (void)be;
    return lm_muon_update(w, g, momentum, rows, cols, n_blocks, lr, wd, cfg, (float *)scratch,
                          scratch_bytes / sizeof(float));
}

static const lm_ops cpu_ops = {
    .matmul_forward = cpu_matmul_forward,
    .matmul_forward_lp = cpu_matmul_forward_lp,
    .matmul_backward = cpu_matmul_backward,
    .matmul_backward_set = cpu_matmul_backward_set,
    .to_lp = cpu_to_lp,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .rmsnorm_backward_set = cpu_rmsnorm_backward_set,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .glu_forward = cpu_glu_forward,
    .glu_backward = cpu_glu_backward,
    .sigmoid_forward = cpu_sigmoid_forward,
    .sigmoid_backward = cpu_sigmoid_backward,
    .cross_entropy_work_bytes = cpu_ce_work_bytes,
    .cross_entropy_forward = cpu_ce_forward,
    .cross_entropy_backward = cpu_ce_backward,
    .score_forward = cpu_score_forward,
    .conv_silu_forward = cpu_conv_silu_forward,
    .conv_silu_backward = cpu_conv_silu_backward,
    .kda_forward = cpu_kda_forward,
    .kda_backward = cpu_kda_backward,
    .kda_state_apply = cpu_kda_state_apply,
    .kda_output_forward = cpu_kda_output_forward,
    .kda_output_backward = cpu_kda_output_backward,
    .attention_forward = cpu_attention_forward,
    .attention_backward = cpu_attention_backward,
    .attention_forward_offset = cpu_attention_forward_offset,
    .attention_backward_offset = cpu_attention_backward_offset,
    .accumulate = cpu_accumulate,
    .gate_forward = cpu_gate_forward,
    .gate_backward = cpu_gate_backward,
    .attention_head_max = cpu_attention_head_max,
    .moe_acts_create = cpu_moe_acts_create,
    .moe_acts_bytes = cpu_moe_acts_bytes,
    .moe_acts_free = cpu_moe_acts_free,
    .moe_forward = cpu_moe_forward,
    .moe_backward = cpu_moe_backward,
    .moe_ep_create = cpu_moe_ep_create,
    .moe_ep_free = cpu_moe_ep_free,
    .moe_ep_bytes = cpu_moe_ep_bytes,
    .moe_forward_ep = cpu_moe_forward_ep,
    .moe_backward_ep = cpu_moe_backward_ep,
    .moe_scores = cpu_moe_scores,
    .moe_balance_observe = cpu_moe_balance_observe,
    .moe_aux_loss = cpu_moe_aux_loss,
    .attnres_create = cpu_attnres_create,
    .attnres_memory = lm_attnres_memory,
    .attnres_recompute_input = cpu_ar_recompute_input,
    .attnres_replay_block = cpu_ar_replay_block,
    .op_scratch_bytes = cpu_op_scratch_bytes,
    .attnres_free = cpu_attnres_free,
    .attnres_begin = cpu_ar_begin,
    .attnres_input = cpu_ar_input,
    .attnres_add_output = cpu_ar_add_output,
    .attnres_final = cpu_ar_final,
    .attnres_final_backward = cpu_ar_final_backward,
    .attnres_output_backward = cpu_ar_output_backward,
    .attnres_input_backward = cpu_ar_input_backward,
    .attnres_embedding_backward = cpu_ar_embedding_backward,
    .find_nonfinite = cpu_find_nonfinite,
    .sum_squares = cpu_sum_squares,
    .scale = cpu_scale,
    .scale_exact = cpu_scale_exact,
    .adamw_update = cpu_adamw_update,
    .muon_scratch_bytes = cpu_muon_scratch_bytes,
    .muon_update = cpu_muon_update,
};

static lm_backend cpu_backend = {
    .device = LM_DEVICE_CPU,
    .lp_bytes = sizeof(float),
    .ops = &cpu_ops,
    .ctx = NULL,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sync = cpu_sync,
};

lm_backend *lm_backend_cpu(void) { return &cpu_backend; }

void lm_backend_free(lm_backend *be) {
    if (be && be != &cpu_backend && be->destroy) be->destroy(be);
}

#ifndef LONGMOE_HAVE_CUDA
const lm_ops *lm_backend_cuda_ops(void) { return NULL; }

lm_status lm_backend_cuda_create(lm_backend **out) {
    *out = NULL;
    return lm_error(LM_ERR_ARG, "this build has no CUDA backend (nvcc was not found when it was "
                                        "configured; see README)");
}

lm_status lm_backend_cuda_create_local(int local, lm_backend **out) {
    (void)local;
    return lm_backend_cuda_create(out);
}
#endif
