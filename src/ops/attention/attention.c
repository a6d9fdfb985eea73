/* Causal softmax attention, tiled with an online softmax
 * (include/longmoe/attention.h, docs/attention.md, SPEC §3).
 *
 * Forward: one work item per (batch, head, query tile); the item walks the key
 * tiles up to the diagonal and keeps, per query row, the running max m, the
 * running sum l and the unnormalised output acc (all fp32):
 *   m' = max(m, max_j s_ij);  l' = e^{m-m'} l + sum_j e^{s_ij-m'};
 *   acc' = e^{m-m'} acc + sum_j e^{s_ij-m'} v_j;  finally o = acc/l, lse = m + log l.
 * Backward (flash-attention style): p_ij = e^{s_ij - lse_i} is recomputed tile by
 * tile; with D_i = rowsum(dO_i * O_i), dS_ij = p_ij (dO_i . v_j - D_i),
 * dq_i = scale sum_j dS_ij k_j, dk_j = scale sum_i dS_ij q_i, dv_j = sum_i p_ij dO_i.
 * Two passes keep every write private to one work item (no atomics, same
 * result for any thread count): pass 1 over (batch, head, query tile) gives dq,
 * pass 2 over (batch, kv head, key tile) gives dk and dv. */
#include "longmoe/attention.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define TQ LM_ATTN_TILE_Q
#define TK LM_ATTN_TILE_K

lm_attention_config lm_attention_config_default(int B, int T, int H, int Hkv, int Dk, int Dv) {
    lm_attention_config c = {B, T, H, Hkv, Dk, Dv, 0.0f, NULL, 0};
    return c;
}

lm_status lm_attention_check(const lm_attention_config *cfg) {
    if (!cfg) return lm_error(LM_ERR_ARG, "attention: config is NULL");
    if (cfg->B < 1 || cfg->T < 1 || cfg->H < 1 || cfg->Hkv < 1 || cfg->Dk < 1 || cfg->Dv < 1)
        return lm_error(LM_ERR_ARG,
                        "attention: every dim must be >= 1, got B=%d T=%d H=%d Hkv=%d Dk=%d Dv=%d",
                        cfg->B, cfg->T, cfg->H, cfg->Hkv, cfg->Dk, cfg->Dv);
    if (cfg->H % cfg->Hkv)
        return lm_error(LM_ERR_ARG,
                        "attention: query heads H=%d must be a multiple of key/value heads Hkv=%d",
                        cfg->H, cfg->Hkv);
    if (!isfinite(cfg->scale) || cfg->scale < 0)
        return lm_error(LM_ERR_ARG, "attention: scale must be finite and >= 0 (0 = Dk^-1/2), got %g",
                        (double)cfg->scale);
    return LM_OK;
}

float lm_attention_scale(const lm_attention_config *cfg) {
    return cfg->scale > 0 ? cfg->scale : 1.0f / sqrtf((float)cfg->Dk);
}

/* Round a float count up to a 64-byte multiple so per-thread blocks stay aligned. */
static size_t round16(size_t n) { return (n + 15) & ~(size_t)15; }

static size_t forward_floats_per_thread(const lm_attention_config *c) {
    // qs (TQ,Dk), kt (Dk,TK), s (TQ,TK), acc (TQ,Dv), m (TQ), l (TQ)
    return round16((size_t)TQ * c->Dk + (size_t)c->Dk * TK + (size_t)TQ * TK +
                   (size_t)TQ * c->Dv + 2 * (size_t)TQ);
}

static size_t backward_floats_per_thread(const lm_attention_config *c) {
    // qs (TQ,Dk), kt (Dk,TK), vt (Dv,TK), s and dp (TQ,TK), acc_a (max(TQ,TK),Dk), acc_b (TK,Dv)
    size_t tmax = TQ > TK ? TQ : TK;
    return round16((size_t)TQ * c->Dk + (size_t)c->Dk * TK + (size_t)c->Dv * TK +
                   2 * (size_t)TQ * TK + tmax * c->Dk + (size_t)TK * c->Dv);
}

static int threads_or_max(int nthreads) { return nthreads > 0 ? nthreads : omp_get_max_threads(); }

size_t lm_attention_forward_workspace_bytes(const lm_attention_config *cfg, int nthreads) {
    return (size_t)threads_or_max(nthreads) * forward_floats_per_thread(cfg) * sizeof(float);
}

size_t lm_attention_backward_workspace_bytes(const lm_attention_config *cfg, int nthreads) {
    size_t rows = (size_t)cfg->B * cfg->H * cfg->T; /* D_i */
    return (round16(rows) + (size_t)threads_or_max(nthreads) * backward_floats_per_thread(cfg)) *
           sizeof(float);
}

/* The shared arguments of every tile routine. */
typedef struct {
    int B, T, H, Hkv, Dk, Dv, group;
    int off, Tk; /* queries sit at positions off .. off+T-1 of Tk = off+T keys */
    float scale;
    const float *q, *k, *v, *o, *lse, *d_o, *D;
} attn_args;

static attn_args make_args(const lm_attention_config *c) {
    attn_args a;
    memset(&a, 0, sizeof a);
    a.B = c->B, a.T = c->T, a.H = c->H, a.Hkv = c->Hkv, a.Dk = c->Dk, a.Dv = c->Dv;
    a.group = c->H / c->Hkv;
    a.scale = lm_attention_scale(c);
    a.off = 0, a.Tk = c->T;
    return a;
}

static inline const float *q_row(const attn_args *a, int b, int t, int h) {
    return a->q + (((size_t)b * a->T + t) * a->H + h) * a->Dk;
}
static inline const float *k_row(const attn_args *a, int b, int t, int hk) {
    return a->k + (((size_t)b * a->Tk + t) * a->Hkv + hk) * a->Dk;
}
static inline const float *v_row(const attn_args *a, int b, int t, int hk) {
    return a->v + (((size_t)b * a->Tk + t) * a->Hkv + hk) * a->Dv;
}
static inline size_t o_off(const attn_args *a, int b, int t, int h) {
    return (((size_t)b * a->T + t) * a->H + h) * a->Dv;
}

/* qs[i,:] = scale * q[b, i0+i, h, :] for the n_i rows of a query tile. */
static void load_scaled_queries(const attn_args *a, int b, int h, int i0, int n_i, float *qs) {
    for (int i = 0; i < n_i; i++) {
        const float *src = q_row(a, b, i0 + i, h);
        float *dst = qs + (size_t)i * a->Dk;
        for (int d = 0; d < a->Dk; d++) dst[d] = a->scale * src[d];
    }
}

/* dst[d, j] = rows[j0+j][d] (transpose of a key or value tile), zero past n_j. */
static void load_transposed(const attn_args *a, const float *base, int width, int b, int hk,
                            int j0, int n_j, float *dst) {
    for (int j = 0; j < TK; j++) {
        if (j < n_j) {
            const float *src = base + (((size_t)b * a->Tk + j0 + j) * a->Hkv + hk) * width;
            for (int d = 0; d < width; d++) dst[(size_t)d * TK + j] = src[d];
        } else {
            for (int d = 0; d < width; d++) dst[(size_t)d * TK + j] = 0.0f;
        }
    }
}

/* out[i, 0:TK] = rows[i, :] . colsT[:, 0:TK] for n_i rows (rows have `width` floats
 * at stride `stride`): a tile of scores written as row-times-matrix axpys. */
static void tile_product(float *restrict out, const float *restrict rows, size_t stride, int n_i,
                         const float *restrict colsT, int width) {
    for (int i = 0; i < n_i; i++) {
        float *restrict srow = out + (size_t)i * TK;
        const float *r = rows + (size_t)i * stride;
#pragma omp simd
        for (int j = 0; j < TK; j++) srow[j] = 0.0f;
        for (int d = 0; d < width; d++) {
            const float x = r[d];
            const float *restrict c = colsT + (size_t)d * TK;
#pragma omp simd
            for (int j = 0; j < TK; j++) srow[j] += x * c[j];
        }
    }
}

/* Valid keys of tile j0 for query i (causal: key j <= query i), clamped to [0, n_j]. */
static inline int causal_limit(int query, int j0, int n_j) {
    int lim = query - j0 + 1;
    return lim < 0 ? 0 : (lim > n_j ? n_j : lim);
}

static void forward_tile(const attn_args *a, float *o, float *lse, float *rowmax, int b, int h, int i0,
                         float *w) {
    // one query tile: rows i0..i0+n_i-1 of head h against keys 0..i0+n_i-1 of head h/group
    const int Dk = a->Dk, Dv = a->Dv, hk = h / a->group;
    const int n_i = a->T - i0 < TQ ? a->T - i0 : TQ;
    float *qs = w, *kt = qs + (size_t)TQ * Dk, *s = kt + (size_t)Dk * TK;
    float *acc = s + (size_t)TQ * TK, *m = acc + (size_t)TQ * Dv, *l = m + TQ;
    load_scaled_queries(a, b, h, i0, n_i, qs);
    for (int i = 0; i < n_i; i++) m[i] = -INFINITY, l[i] = 0.0f;
    memset(acc, 0, (size_t)n_i * Dv * sizeof(float));
    const int j_end = a->off + i0 + n_i;
    for (int j0 = 0; j0 < j_end; j0 += TK) {
        const int n_j = j_end - j0 < TK ? j_end - j0 : TK;
        load_transposed(a, a->k, Dk, b, hk, j0, n_j, kt);
        tile_product(s, qs, Dk, n_i, kt, Dk);
        for (int i = 0; i < n_i; i++) {
            const int lim = causal_limit(a->off + i0 + i, j0, n_j);
            if (lim == 0) continue;
            float *srow = s + (size_t)i * TK;
            // online softmax: new running max, rescale of the old sum and output
            float mx = m[i];
            for (int j = 0; j < lim; j++) mx = srow[j] > mx ? srow[j] : mx;
            const float corr = expf(m[i] - mx);
            float sum = 0.0f;
            for (int j = 0; j < lim; j++) {
                srow[j] = expf(srow[j] - mx);
                sum += srow[j];
            }
            l[i] = l[i] * corr + sum;
            m[i] = mx;
            float *arow = acc + (size_t)i * Dv;
            if (corr != 1.0f) {
#pragma omp simd
                for (int e = 0; e < Dv; e++) arow[e] *= corr;
            }
            for (int j = 0; j < lim; j++) {
                const float p = srow[j];
                const float *vr = v_row(a, b, j0 + j, hk);
#pragma omp simd
                for (int e = 0; e < Dv; e++) arow[e] += p * vr[e];
            }
        }
    }
    for (int i = 0; i < n_i; i++) {
        const float inv = 1.0f / l[i];
        float *orow = o + o_off(a, b, i0 + i, h);
        const float *arow = acc + (size_t)i * Dv;
        for (int e = 0; e < Dv; e++) orow[e] = arow[e] * inv;
        if (lse) lse[((size_t)b * a->H + h) * a->T + i0 + i] = m[i] + logf(l[i]);
        if (rowmax) rowmax[((size_t)b * a->H + h) * a->T + i0 + i] = m[i];
    }
}

lm_status lm_attention_forward(const lm_attention_config *cfg, const float *q, const float *k,
                               const float *v, float *o, float *lse) {
    return lm_attention_forward_rowmax(cfg, q, k, v, o, lse, NULL);
}

static lm_status check_offset(const lm_attention_config *cfg, int q_offset, const char *what) {
    if (q_offset < 0 || (int64_t)q_offset + cfg->T > INT32_MAX)
        return lm_error(LM_ERR_ARG, "attention %s: q_offset %d must be >= 0 and q_offset + T fit an int", what,
                        q_offset);
    return LM_OK;
}

static lm_status forward_offset(const lm_attention_config *cfg, int q_offset, const float *q, const float *k,
                                const float *v, float *o, float *lse, float *rowmax);

lm_status lm_attention_forward_rowmax(const lm_attention_config *cfg, const float *q, const float *k,
                                      const float *v, float *o, float *lse, float *rowmax) {
    return forward_offset(cfg, 0, q, k, v, o, lse, rowmax);
}

lm_status lm_attention_forward_offset(const lm_attention_config *cfg, int q_offset, const float *q, const float *k,
                                      const float *v, float *o, float *lse, float *rowmax) {
    return forward_offset(cfg, q_offset, q, k, v, o, lse, rowmax);
}

static lm_status forward_offset(const lm_attention_config *cfg, int q_offset, const float *q, const float *k,
                                const float *v, float *o, float *lse, float *rowmax) {
    // q (B,T,H,Dk), k (B,Tk,Hkv,Dk), v (B,Tk,Hkv,Dv) -> o (B,T,H,Dv), lse, rowmax (B,H,T); Tk = q_offset + T
    lm_status st = lm_attention_check(cfg);
    if (st) return st;
    TRY(check_offset(cfg, q_offset, "forward"));
    if (!q || !k || !v || !o) return lm_error(LM_ERR_ARG, "attention forward: q, k, v and o are required");
    attn_args a = make_args(cfg);
    a.off = q_offset, a.Tk = q_offset + cfg->T;
    a.q = q, a.k = k, a.v = v;
    const int nthreads = omp_get_max_threads();
    const size_t per = forward_floats_per_thread(cfg);
    float *ws;
    const size_t bytes = lm_attention_forward_workspace_bytes(cfg, nthreads);
    const int own = !(cfg->workspace && cfg->workspace_bytes >= bytes);
    if (own) LM_TRY_ALLOC(ws, bytes);
    else ws = cfg->workspace;
    const int nq = (a.T + TQ - 1) / TQ;
    const int64_t items = (int64_t)a.B * a.H * nq;
#pragma omp parallel num_threads(nthreads)
    {
        float *w = ws + (size_t)omp_get_thread_num() * per;
        /* the longest query tiles (most keys) first, for load balance */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int qt = nq - 1 - (int)(it % nq);
            const int64_t bh = it / nq;
            forward_tile(&a, o, lse, rowmax, (int)(bh / a.H), (int)(bh % a.H), qt * TQ, w);
        }
    }
    if (own) free(ws);
    return LM_OK;
}

/* Pass 1 of the backward: dq for one (batch, head, query tile). */
static void backward_dq_tile(const attn_args *a, float *dq, int b, int h, int i0, float *w) {
    const int Dk = a->Dk, Dv = a->Dv, hk = h / a->group;
    const int n_i = a->T - i0 < TQ ? a->T - i0 : TQ;
    float *qs = w, *kt = qs + (size_t)TQ * Dk, *vt = kt + (size_t)Dk * TK;
    float *s = vt + (size_t)Dv * TK, *dp = s + (size_t)TQ * TK, *acc = dp + (size_t)TQ * TK;
    const float *lse = a->lse + ((size_t)b * a->H + h) * a->T + i0;
    const float *D = a->D + ((size_t)b * a->H + h) * a->T + i0;
    const float *dorows = a->d_o + o_off(a, b, i0, h);
    const size_t dostride = (size_t)a->H * Dv;
    load_scaled_queries(a, b, h, i0, n_i, qs);
    memset(acc, 0, (size_t)n_i * Dk * sizeof(float));
    const int j_end = a->off + i0 + n_i;
    for (int j0 = 0; j0 < j_end; j0 += TK) {
        const int n_j = j_end - j0 < TK ? j_end - j0 : TK;
        load_transposed(a, a->k, Dk, b, hk, j0, n_j, kt);
        load_transposed(a, a->v, Dv, b, hk, j0, n_j, vt);
        tile_product(s, qs, Dk, n_i, kt, Dk);
        tile_product(dp, dorows, dostride, n_i, vt, Dv);
        for (int i = 0; i < n_i; i++) {
            const int lim = causal_limit(a->off + i0 + i, j0, n_j);
            const float *srow = s + (size_t)i * TK, *dprow = dp + (size_t)i * TK;
            float *arow = acc + (size_t)i * Dk;
            for (int j = 0; j < lim; j++) {
                // dS_ij = p_ij (dO_i . v_j - D_i), p recomputed from lse
                const float ds = expf(srow[j] - lse[i]) * (dprow[j] - D[i]);
                const float *kr = k_row(a, b, j0 + j, hk);
#pragma omp simd
                for (int d = 0; d < Dk; d++) arow[d] += ds * kr[d];
            }
        }
    }
    for (int i = 0; i < n_i; i++) {
        float *dst = dq + (((size_t)b * a->T + i0 + i) * a->H + h) * Dk;
        const float *arow = acc + (size_t)i * Dk;
        for (int d = 0; d < Dk; d++) dst[d] += a->scale * arow[d];
    }
}

/* Pass 2 of the backward: dk and dv for one (batch, kv head, key tile), summed
 * over the query heads of its group and the query tiles at or after it. */
static void backward_dkv_tile(const attn_args *a, float *dk, float *dv, int b, int hk, int j0,
                              float *w) {
    const int Dk = a->Dk, Dv = a->Dv;
    const int n_j = a->Tk - j0 < TK ? a->Tk - j0 : TK;
    float *qs = w, *kt = qs + (size_t)TQ * Dk, *vt = kt + (size_t)Dk * TK;
    float *s = vt + (size_t)Dv * TK, *dp = s + (size_t)TQ * TK, *dkacc = dp + (size_t)TQ * TK;
    float *dvacc = dkacc + (size_t)(TQ > TK ? TQ : TK) * Dk;
    const size_t dostride = (size_t)a->H * Dv;
    load_transposed(a, a->k, Dk, b, hk, j0, n_j, kt);
    load_transposed(a, a->v, Dv, b, hk, j0, n_j, vt);
    memset(dkacc, 0, (size_t)n_j * Dk * sizeof(float));
    memset(dvacc, 0, (size_t)n_j * Dv * sizeof(float));
    for (int h = hk * a->group; h < (hk + 1) * a->group; h++) {
        const float *lse = a->lse + ((size_t)b * a->H + h) * a->T;
        const float *D = a->D + ((size_t)b * a->H + h) * a->T;
        /* the query tiles at or after the key tile (global position off + i) */
        for (int i0 = ((j0 > a->off ? j0 - a->off : 0) / TQ) * TQ; i0 < a->T; i0 += TQ) {
            const int n_i = a->T - i0 < TQ ? a->T - i0 : TQ;
            const float *dorows = a->d_o + o_off(a, b, i0, h);
            load_scaled_queries(a, b, h, i0, n_i, qs);
            tile_product(s, qs, Dk, n_i, kt, Dk);
            tile_product(dp, dorows, dostride, n_i, vt, Dv);
            for (int i = 0; i < n_i; i++) {
                const int lim = causal_limit(a->off + i0 + i, j0, n_j);
                const float *srow = s + (size_t)i * TK, *dprow = dp + (size_t)i * TK;
                const float *dorow = dorows + (size_t)i * dostride, *qrow = qs + (size_t)i * Dk;
                for (int j = 0; j < lim; j++) {
                    const float p = expf(srow[j] - lse[i0 + i]);
                    const float ds = p * (dprow[j] - D[i0 + i]);
                    float *dvr = dvacc + (size_t)j * Dv, *dkr = dkacc + (size_t)j * Dk;
#pragma omp simd
                    for (int e = 0; e < Dv; e++) dvr[e] += p * dorow[e];
                    /* qs is already scaled: dk_j = scale sum_i dS_ij q_i */
#pragma omp simd
                    for (int d = 0; d < Dk; d++) dkr[d] += ds * qrow[d];
                }
            }
        }
    }
    for (int j = 0; j < n_j; j++) {
        if (dk) {
            float *dst = dk + (((size_t)b * a->Tk + j0 + j) * a->Hkv + hk) * Dk;
            for (int d = 0; d < Dk; d++) dst[d] += dkacc[(size_t)j * Dk + d];
        }
        if (dv) {
            float *dst = dv + (((size_t)b * a->Tk + j0 + j) * a->Hkv + hk) * Dv;
            for (int e = 0; e < Dv; e++) dst[e] += dvacc[(size_t)j * Dv + e];
        }
    }
}

lm_status lm_attention_backward(const lm_attention_config *cfg, const float *q, const float *k,
                                const float *v, const float *o, const float *lse,
                                const float *d_o, float *dq, float *dk, float *dv) {
    return lm_attention_backward_offset(cfg, 0, q, k, v, o, lse, d_o, dq, dk, dv);
}

lm_status lm_attention_backward_offset(const lm_attention_config *cfg, int q_offset, const float *q, const float *k,
                                       const float *v, const float *o, const float *lse, const float *d_o,
                                       float *dq, float *dk, float *dv) {
    // q (B,T,H,Dk), k (B,Tk,Hkv,Dk), v (B,Tk,Hkv,Dv), o and d_o (B,T,H,Dv), lse (B,H,T); Tk = q_offset + T
    lm_status st = lm_attention_check(cfg);
    if (st) return st;
    TRY(check_offset(cfg, q_offset, "backward"));
    if (!q || !k || !v || !o || !lse || !d_o)
        return lm_error(LM_ERR_ARG, "attention backward: q, k, v, o, lse and d_o are required");
    if (!dq && !dk && !dv) return LM_OK;
    attn_args a = make_args(cfg);
    a.off = q_offset, a.Tk = q_offset + cfg->T;
    a.q = q, a.k = k, a.v = v, a.o = o, a.lse = lse, a.d_o = d_o;
    const int nthreads = omp_get_max_threads();
    const size_t per = backward_floats_per_thread(cfg);
    const size_t rows = (size_t)a.B * a.H * a.T;
    float *ws;
    const size_t bytes = lm_attention_backward_workspace_bytes(cfg, nthreads);
    const int own = !(cfg->workspace && cfg->workspace_bytes >= bytes);
    if (own) LM_TRY_ALLOC(ws, bytes);
    else ws = cfg->workspace;
    float *D = ws, *thread_ws = ws + round16(rows);
    a.D = D;
    // D_i = rowsum(dO_i * O_i), laid out like lse (B,H,T)
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < (int64_t)rows; r++) {
        const int t = (int)(r % a.T), h = (int)(r / a.T % a.H), b = (int)(r / a.T / a.H);
        const size_t off = o_off(&a, b, t, h);
        float sum = 0.0f;
        for (int e = 0; e < a.Dv; e++) sum += d_o[off + e] * o[off + e];
        D[r] = sum;
    }
    const int nq = (a.T + TQ - 1) / TQ, nk = (a.Tk + TK - 1) / TK;
#pragma omp parallel num_threads(nthreads)
    {
        float *w = thread_ws + (size_t)omp_get_thread_num() * per;
        if (dq) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < (int64_t)a.B * a.H * nq; it++) {
                const int qt = nq - 1 - (int)(it % nq);
                const int64_t bh = it / nq;
                backward_dq_tile(&a, dq, (int)(bh / a.H), (int)(bh % a.H), qt * TQ, w);
            }
        }
        if (dk || dv) {
            /* early key tiles see the most queries: schedule them first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < (int64_t)a.B * a.Hkv * nk; it++) {
                const int kt = (int)(it % nk);
                const int64_t bh = it / nk;
                backward_dkv_tile(&a, dk, dv, (int)(bh / a.Hkv), (int)(bh % a.Hkv), kt * TK, w);
            }
        }
    }
    if (own) free(ws);
    return LM_OK;
}
