/* The KDA token mixer: projections, short convolutions, normalisations, the
 * operator, output norm and gate (include/longmoe/kda_layer.h). */
#include "longmoe/kda_layer.h"

#include <math.h>
#include <string.h>

#include "longmoe/linear.h"
#include "model/kda_layer_internal.h"

#define L2_EPS 1e-6f

size_t lm_kda_layer_specs(const lm_kda_layer_config *c, lm_tensor_spec *s) {
    int64_t d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    float w = 0.02f, cw = 1.0f / sqrtf((float)W);
    lm_tensor_spec t[LM_KDA_LAYER_NPARAMS] = {
        {"W_q", HK, d, LM_ROLE_MATRIX, (int)H, 0, w},
        {"W_k", HK, d, LM_ROLE_MATRIX, (int)H, 0, w},
        {"W_v", HK, d, LM_ROLE_MATRIX, (int)H, 0, w},
        {"conv_q", HK, W, LM_ROLE_VECTOR, 1, 0, cw},
        {"conv_k", HK, W, LM_ROLE_VECTOR, 1, 0, cw},
        {"conv_v", HK, W, LM_ROLE_VECTOR, 1, 0, cw},
        {"W_z", HK, d, LM_ROLE_MATRIX, 1, 0, w},
        {"W_beta", H, d, LM_ROLE_MATRIX, 1, 0, w},
        {"A_log", H, 1, LM_ROLE_VECTOR, 1, 0, 0},
        /* sigmoid(dt_bias) around 0.05: the bounded gate starts near g_min/20 per step */
        {"dt_bias", HK, 1, LM_ROLE_VECTOR, 1, -3.0f, 1.0f},
        {"W_g", HK, d, LM_ROLE_MATRIX, 1, 0, w},
        {"o_norm", K, 1, LM_ROLE_VECTOR, 1, 1.0f, 0},
        {"W_o", d, HK, LM_ROLE_MATRIX, 1, 0, w},
    };
    size_t total = 0;
    for (int i = 0; i < LM_KDA_LAYER_NPARAMS; i++) {
        if (s) s[i] = t[i];
        total += (size_t)(t[i].rows * t[i].cols);
    }
    return total;
}

void lm_kda_layer_params_map(const lm_kda_layer_config *c, float *base, lm_kda_layer_params *p) {
    lm_tensor_spec s[LM_KDA_LAYER_NPARAMS];
    lm_kda_layer_specs(c, s);
    float **slots[LM_KDA_LAYER_NPARAMS] = {&p->W_q, &p->W_k, &p->W_v, &p->conv_q, &p->conv_k,
                                           &p->conv_v, &p->W_z, &p->W_beta, &p->A_log,
                                           &p->dt_bias, &p->W_g, &p->o_norm, &p->W_o};
    for (int i = 0; i < LM_KDA_LAYER_NPARAMS; i++) {
        *slots[i] = base;
        base += s[i].rows * s[i].cols;
    }
}

size_t lm_kda_layer_act_floats(const lm_kda_layer_config *c, int B, int T) {
    size_t N = (size_t)B * T, H = (size_t)c->heads, HK = H * (size_t)c->head_dim;
    return 13 * N * HK + N * H /* beta */ + N * H /* o_rstd */ + 2 * N * H /* qk_rnorm */;
}

void lm_kda_layer_acts_map(const lm_kda_layer_config *c, int B, int T, float *base,
                           lm_kda_layer_acts *a) {
    size_t N = (size_t)B * T, H = (size_t)c->heads, HK = H * (size_t)c->head_dim;
    float **big[] = {&a->qp, &a->kp, &a->vp, &a->qc, &a->kc, &a->vc, &a->q, &a->k,
                     &a->v, &a->z, &a->o, &a->gate, &a->gated};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        *big[i] = base;
        base += N * HK;
    }
    a->beta = base;
    base += N * H;
    a->o_rstd = base;
    base += N * H;
    a->qk_rnorm = base;
}

size_t lm_kda_layer_scratch_floats(const lm_kda_layer_config *c, int B, int T) {
    size_t N = (size_t)B * T, H = (size_t)c->heads, HK = H * (size_t)c->head_dim;
    return 7 * N * HK + N * H;
}

/* Causal depthwise convolution: out[t,c] = sum_i w[c,i] in[t-(W-1)+i, c]. */
void lm_kda_short_conv_forward(float *out, const float *in, const float *w, int B, int T, int C, int W) {
    // in, out are (B,T,C); w is (C,W)
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            for (int ch = 0; ch < C; ch++) o[ch] = 0.0f;
            for (int i = 0; i < W; i++) {
                int src = t - (W - 1) + i;
                if (src < 0) continue;
                const float *x = in + ((size_t)b * T + src) * C;
                for (int ch = 0; ch < C; ch++) o[ch] += w[(size_t)ch * W + i] * x[ch];
            }
        }
}

/* din[t,c] = sum_i w[c,i] dout[t+(W-1)-i, c] (written, not accumulated);
 * dw[c,i] += sum_t in[t-(W-1)+i, c] dout[t,c]. */
void lm_kda_short_conv_backward(float *din, float *dw, const float *dout, const float *in,
                                const float *w, int B, int T, int C, int W) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *dx = din + ((size_t)b * T + t) * C;
            for (int ch = 0; ch < C; ch++) dx[ch] = 0.0f;
            for (int i = 0; i < W; i++) {
                int dst = t + (W - 1) - i;
                if (dst >= T) continue;
                const float *g = dout + ((size_t)b * T + dst) * C;
                for (int ch = 0; ch < C; ch++) dx[ch] += w[(size_t)ch * W + i] * g[ch];
            }
        }
    /* each thread owns whole channels: a fixed summation order */
#pragma omp parallel for schedule(static)
    for (int ch = 0; ch < C; ch++)
        for (int i = 0; i < W; i++) {
            float s = 0.0f;
            for (int b = 0; b < B; b++)
                for (int t = W - 1 - i; t < T; t++)
                    s += in[((size_t)b * T + t - (W - 1) + i) * C + ch] * dout[((size_t)b * T + t) * C + ch];
            dw[(size_t)ch * W + i] += s;
        }
}

/* SiLU then (optionally) L2 normalisation per head of K channels. */
void lm_kda_silu_l2_forward(float *out, float *rnorm, const float *in, size_t rows, int K) {
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++) {
        const float *x = in + r * K;
        float *y = out + r * K, ss = 0.0f;
        for (int d = 0; d < K; d++) {
            y[d] = lm_siluf(x[d]);
            ss += y[d] * y[d];
        }
        if (rnorm) {
            float s = 1.0f / sqrtf(ss + L2_EPS);
            rnorm[r] = s;
            for (int d = 0; d < K; d++) y[d] *= s;
        }
    }
}

/* Backward of silu_l2_forward: din = dSiLU(in) * (L2 backward of dout). */
void lm_kda_silu_l2_backward(float *din, const float *dout, const float *in, const float *out,
                             const float *rnorm, size_t rows, int K) {
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++) {
        const float *x = in + r * K, *g = dout + r * K, *y = out + r * K;
        float *dx = din + r * K;
        float dot = 0.0f, s = rnorm ? rnorm[r] : 1.0f;
        if (rnorm)
            for (int d = 0; d < K; d++) dot += y[d] * g[d];
        for (int d = 0; d < K; d++) {
            /* y = u s with u = silu(x): du = s (g - y (y.g)) */
            float du = rnorm ? s * (g[d] - y[d] * dot) : g[d];
            float sg = lm_sigmoidf(x[d]);
            dx[d] = du * sg * (1.0f + x[d] * (1.0f - sg));
        }
    }
}

static lm_kda_config op_config(const lm_kda_layer_config *c, int B, int T) {
    lm_kda_config k = lm_kda_config_default(B, T, c->heads, c->head_dim, c->head_dim);
    k.gate = c->gate;
    k.g_min = c->g_min;
    k.chunk = c->chunk;
    k.workspace = c->workspace;
    k.workspace_bytes = c->workspace_bytes;
    return k;
}

/* The layer's forward; ht (may be NULL) receives the operator's final state [B,H,K,K]. */
static lm_status layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_params *p, lm_kda_layer_acts *a,
                               const float *x, int B, int T, float *y, float *ht) {
    // x is (B,T,d), y is (B,T,d)
    int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    size_t N = (size_t)B * T;
    lm_matmul_forward(a->qp, x, p->W_q, NULL, (int64_t)N, d, HK);
    lm_matmul_forward(a->kp, x, p->W_k, NULL, (int64_t)N, d, HK);
    lm_matmul_forward(a->vp, x, p->W_v, NULL, (int64_t)N, d, HK);
    lm_kda_short_conv_forward(a->qc, a->qp, p->conv_q, B, T, HK, W);
    lm_kda_short_conv_forward(a->kc, a->kp, p->conv_k, B, T, HK, W);
    lm_kda_short_conv_forward(a->vc, a->vp, p->conv_v, B, T, HK, W);
    lm_kda_silu_l2_forward(a->q, a->qk_rnorm, a->qc, N * H, K);
    lm_kda_silu_l2_forward(a->k, a->qk_rnorm + N * H, a->kc, N * H, K);
    lm_kda_silu_l2_forward(a->v, NULL, a->vc, N * H, K);
    lm_matmul_forward(a->z, x, p->W_z, NULL, (int64_t)N, d, HK);
    lm_matmul_forward(a->beta, x, p->W_beta, NULL, (int64_t)N, d, H);
    for (size_t i = 0; i < N * H; i++) a->beta[i] = lm_sigmoidf(a->beta[i]);
    lm_kda_config kc = op_config(c, B, T);
    lm_kda_inputs in = {a->q, a->k, a->v, a->z, a->beta, p->A_log, p->dt_bias, NULL};
    lm_status s = lm_kda_chunk_forward(&kc, &in, a->o, ht);
    if (s) return s;
    /* head RMSNorm into `gated`, then the output gate */
    lm_rmsnorm_forward(a->gated, a->o_rstd, a->o, p->o_norm, (int64_t)(N * H), K, c->eps);
    lm_matmul_forward(a->gate, x, p->W_g, NULL, (int64_t)N, d, HK);
    for (size_t i = 0; i < N * HK; i++) {
        a->gate[i] = lm_sigmoidf(a->gate[i]);
        a->gated[i] *= a->gate[i];
    }
    lm_matmul_forward(y, a->gated, p->W_o, NULL, (int64_t)N, HK, d);
    return LM_OK;
}

lm_status lm_kda_layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               lm_kda_layer_acts *a, const float *x, int B, int T, float *y) {
    return layer_forward(c, p, a, x, B, T, y, NULL);
}

lm_status lm_kda_layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                const lm_kda_layer_params *g, const lm_kda_layer_acts *a,
                                const float *x, const float *dy, int B, int T, float *dx,
                                float *scratch) {
    // dy is (B,T,d); dx (B,T,d) and g accumulate
    int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    size_t N = (size_t)B * T, NHK = N * HK;
    float *d_gated = scratch, *d_o = scratch + NHK, *dq = scratch + 2 * NHK, *dk = scratch + 3 * NHK,
          *dv = scratch + 4 * NHK, *dz = scratch + 5 * NHK, *tmp = scratch + 6 * NHK,
          *dbeta = scratch + 7 * NHK;
    memset(d_gated, 0, NHK * sizeof(float));
    lm_matmul_backward(d_gated, g->W_o, NULL, dy, a->gated, p->W_o, (int64_t)N, HK, d);
    /* gated = gate ⊙ n with n = RMSNorm(o): d gate-logit = d_gated n gate (1 - gate) */
    for (size_t i = 0; i < NHK; i++) {
        float gt = a->gate[i], n = a->o[i] * a->o_rstd[i / K] * p->o_norm[i % K];
        tmp[i] = d_gated[i] * n * gt * (1.0f - gt);
        d_gated[i] *= gt; /* now d n */
    }
    lm_matmul_backward(dx, g->W_g, NULL, tmp, x, p->W_g, (int64_t)N, d, HK);
    memset(d_o, 0, NHK * sizeof(float));
    lm_rmsnorm_backward(d_o, g->o_norm, d_gated, a->o, p->o_norm, a->o_rstd, (int64_t)(N * H), K, c->eps);
    /* the operator */
    memset(dq, 0, 5 * NHK * sizeof(float));
    memset(dbeta, 0, N * H * sizeof(float));
    lm_kda_config kc = op_config(c, B, T);
    lm_kda_inputs in = {a->q, a->k, a->v, a->z, a->beta, p->A_log, p->dt_bias, NULL};
    lm_kda_grads kg = {dq, dk, dv, dz, dbeta, g->A_log, g->dt_bias, NULL};
    lm_status s = lm_kda_chunk_backward(&kc, &in, d_o, NULL, &kg);
    if (s) return s;
    lm_matmul_backward(dx, g->W_z, NULL, dz, x, p->W_z, (int64_t)N, d, HK);
    for (size_t i = 0; i < N * H; i++) dbeta[i] *= a->beta[i] * (1.0f - a->beta[i]);
    lm_matmul_backward(dx, g->W_beta, NULL, dbeta, x, p->W_beta, (int64_t)N, d, H);
    /* q, k, v: normalisation and SiLU, the short convolution, the projections */
    float *const douts[3] = {dq, dk, dv};
    const float *const pre[3] = {a->qc, a->kc, a->vc}, *const post[3] = {a->q, a->k, a->v},
                       *const proj[3] = {a->qp, a->kp, a->vp};
    const float *const rn[3] = {a->qk_rnorm, a->qk_rnorm + N * H, NULL};
    const float *const conv_w[3] = {p->conv_q, p->conv_k, p->conv_v}, *const Wm[3] = {p->W_q, p->W_k, p->W_v};
    float *const conv_g[3] = {g->conv_q, g->conv_k, g->conv_v}, *const Wg[3] = {g->W_q, g->W_k, g->W_v};
    for (int j = 0; j < 3; j++) {
        lm_kda_silu_l2_backward(tmp, douts[j], pre[j], post[j], rn[j], N * H, K);
        lm_kda_short_conv_backward(douts[j], conv_g[j], tmp, proj[j], conv_w[j], B, T, HK, W);
        lm_matmul_backward(dx, Wg[j], NULL, douts[j], x, Wm[j], (int64_t)N, d, HK);
    }
    return LM_OK;
}

/* ---- decode ---- */

size_t lm_kda_layer_cache_floats(const lm_kda_layer_config *c, int B) {
    size_t H = (size_t)c->heads, K = (size_t)c->head_dim, HK = H * K, W1 = (size_t)(c->conv_width - 1);
    return 3 * (size_t)B * W1 * HK + (size_t)B * H * K * K;
}

lm_status lm_kda_layer_cache_init(const lm_kda_layer_config *c, lm_kda_layer_cache *cache, int B,
                                  float *mem) {
    if (!cache || !mem) return lm_error(LM_ERR_ARG, "kda layer cache_init: cache and memory are required");
    if (B < 1) return lm_error(LM_ERR_ARG, "kda layer cache_init: B=%d must be >= 1", B);
    if (c->conv_width < 1)
        return lm_error(LM_ERR_ARG, "kda layer cache_init: conv_width=%d must be >= 1", c->conv_width);
    size_t HK = (size_t)c->heads * c->head_dim, tail = (size_t)B * (c->conv_width - 1) * HK;
    memset(mem, 0, lm_kda_layer_cache_floats(c, B) * sizeof(float));
    cache->B = B;
    cache->len = 0;
    cache->tail_q = mem;
    cache->tail_k = mem + tail;
    cache->tail_v = mem + 2 * tail;
    cache->S = mem + 3 * tail;
    return LM_OK;
}

size_t lm_kda_layer_step_scratch_floats(const lm_kda_layer_config *c, int B) {
    size_t H = (size_t)c->heads, K = (size_t)c->head_dim, HK = H * K;
    return 10 * (size_t)B * HK + 4 * (size_t)B * H + (size_t)B * H * K * K;
}

lm_status lm_kda_layer_prefill(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               lm_kda_layer_acts *a, lm_kda_layer_cache *cache, const float *x,
                               int T, float *y) {
    // x is (B,T,d), y is (B,T,d); the cache receives the state after T tokens
    if (!cache) return lm_error(LM_ERR_ARG, "kda layer prefill: cache is NULL");
    if (cache->len != 0) return lm_error(LM_ERR_ARG, "kda layer prefill: cache already holds %d tokens", cache->len);
    if (T < 1) return lm_error(LM_ERR_ARG, "kda layer prefill: T=%d must be >= 1", T);
    const int B = cache->B, HK = c->heads * c->head_dim, W = c->conv_width;
    /* the layer's forward, keeping the operator's final state */
    lm_status s = layer_forward(c, p, a, x, B, T, y, cache->S);
    if (s) return s;
    /* the conv history: projections of the last W-1 tokens (zero before the start) */
    const float *proj[3] = {a->qp, a->kp, a->vp};
    float *tails[3] = {cache->tail_q, cache->tail_k, cache->tail_v};
    for (int j = 0; j < 3; j++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < W - 1; i++) {
                int src = T - (W - 1) + i;
                float *dst = tails[j] + ((size_t)b * (W - 1) + i) * HK;
                if (src < 0) memset(dst, 0, (size_t)HK * sizeof(float));
                else memcpy(dst, proj[j] + ((size_t)b * T + src) * HK, (size_t)HK * sizeof(float));
            }
    cache->len = T;
    return LM_OK;
}

/* One step of the causal conv: out = sum_i w[:,i] [tail ; cur]_i, then the
 * tail shifts by one and takes cur (short_conv_forward at the last position). */
static void short_conv_step(float *out, float *tail, const float *cur, const float *w, int B, int C, int W) {
    // cur, out are (B,C); tail is (B,W-1,C); w is (C,W)
    for (int b = 0; b < B; b++) {
        float *o = out + (size_t)b * C, *tb = tail + (size_t)b * (W - 1) * C;
        const float *xc = cur + (size_t)b * C;
        for (int ch = 0; ch < C; ch++) o[ch] = 0.0f;
        for (int i = 0; i < W; i++) {
            const float *xi = i < W - 1 ? tb + (size_t)i * C : xc;
            for (int ch = 0; ch < C; ch++) o[ch] += w[(size_t)ch * W + i] * xi[ch];
        }
        if (W > 1) {
            memmove(tb, tb + C, (size_t)(W - 2) * C * sizeof(float));
            memcpy(tb + (size_t)(W - 2) * C, xc, (size_t)C * sizeof(float));
        }
    }
}

lm_status lm_kda_layer_step(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                            lm_kda_layer_cache *cache, const float *x, float *y, float *scratch) {
    // x is (B,d), y is (B,d); scratch holds lm_kda_layer_step_scratch_floats floats
    if (!cache || !x || !y || !scratch)
        return lm_error(LM_ERR_ARG, "kda layer step: cache, x, y and scratch are required");
    const int B = cache->B, d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    const size_t BHK = (size_t)B * HK, BH = (size_t)B * H;
    float *qp = scratch, *kp = qp + BHK, *vp = kp + BHK, *cq = vp + BHK, *q = cq + BHK, *k = q + BHK,
          *v = k + BHK, *z = v + BHK, *o = z + BHK, *gated = o + BHK, *beta = gated + BHK,
          *rnorm = beta + BH, *rstd = rnorm + 2 * BH, *ht = rstd + BH;
    lm_matmul_forward(qp, x, p->W_q, NULL, B, d, HK);
    lm_matmul_forward(kp, x, p->W_k, NULL, B, d, HK);
    lm_matmul_forward(vp, x, p->W_v, NULL, B, d, HK);
    /* q, k: L2Norm(SiLU(ShortConv(.))); v: SiLU(ShortConv(.)) */
    short_conv_step(cq, cache->tail_q, qp, p->conv_q, B, HK, W);
    lm_kda_silu_l2_forward(q, rnorm, cq, BH, K);
    short_conv_step(cq, cache->tail_k, kp, p->conv_k, B, HK, W);
    lm_kda_silu_l2_forward(k, rnorm + BH, cq, BH, K);
    short_conv_step(cq, cache->tail_v, vp, p->conv_v, B, HK, W);
    lm_kda_silu_l2_forward(v, NULL, cq, BH, K);
    lm_matmul_forward(z, x, p->W_z, NULL, B, d, HK);
    lm_matmul_forward(beta, x, p->W_beta, NULL, B, d, H);
    for (size_t i = 0; i < BH; i++) beta[i] = lm_sigmoidf(beta[i]);
    /* SPEC §2 recurrence, one token: S_{t-1} -> S_t, o_t (T = 1, h0 = S) */
    lm_kda_config kc = op_config(c, B, 1);
    lm_kda_inputs in = {q, k, v, z, beta, p->A_log, p->dt_bias, cache->S};
    lm_status s = lm_kda_recurrent_forward(&kc, &in, o, ht);
    if (s) return s;
    memcpy(cache->S, ht, BH * (size_t)K * K * sizeof(float));
    /* head RMSNorm, output gate sigmoid(W_g x), W_o */
    lm_rmsnorm_forward(gated, rstd, o, p->o_norm, (int64_t)BH, K, c->eps);
    lm_matmul_forward(cq, x, p->W_g, NULL, B, d, HK);
    for (size_t i = 0; i < BHK; i++) gated[i] *= lm_sigmoidf(cq[i]);
    lm_matmul_forward(y, gated, p->W_o, NULL, B, HK, d);
    cache->len++;
    return LM_OK;
}
