/* The affine state map of a KDA segment (SPEC §9; docs/scaleout.md).
 *
 * Per (batch, head) pair the map [P | Q] is carried as an augmented state
 * X [K][K+V], starting at [I | 0]: a chunk with products W, U (SPEC §2) takes
 *   X <- Diag(e^{G_L}) X - Kd^T (W X - [0 | U]),   Kd_i = k_i o e^{G_L - G_i},
 * which is the chunk's S_out = Diag(e^{G_L}) S + Kd^T (U - W S) applied to
 * S = P S_in + Q, collected by S_in and the constant. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kda_internal.h"
#include "longmoe/kda_state_map.h"

/* Floats of one thread: the chunk workspace, X [K][K+V] and Y [C][K+V]. */
static size_t map_thread_floats(const lm_kda_config *cfg) {
    size_t KV = (size_t)cfg->K + cfg->V;
    return kda_ws_floats(cfg->chunk, cfg->K, cfg->V, 0) + (size_t)cfg->K * KV + (size_t)cfg->chunk * KV;
}

size_t lm_kda_state_map_workspace_bytes(const lm_kda_config *cfg) {
    if (kda_check_config(cfg, 1)) return 0;
    return (size_t)omp_get_max_threads() * map_thread_floats(cfg) * sizeof(float);
}

/* One chunk (loaded and prepared in w) applied to the augmented state X. */
static void map_chunk_update(const kda_chunk_ws *w, int L, float *X, float *Y) {
    // X is (K, K+V); Y is (L, K+V); W, Kd are (L,K); U is (L,V)
    const int K = w->K, V = w->V, KV = K + V;
    /* Y = W X - [0 | U] */
    for (int i = 0; i < L; i++) {
        float *Yi = Y + (size_t)i * KV;
        memset(Yi, 0, (size_t)KV * sizeof(float));
        kda_axpy_rows(Yi, 1.0f, w->W + (size_t)i * K, 1, X, KV, K, KV);
        kda_axpy(Yi + K, -1.0f, w->U + (size_t)i * V, V);
    }
    /* X = Diag(e^{G_L}) X - Kd^T Y */
    const float *eGL = w->eG + (size_t)(L - 1) * K;
    for (int d = 0; d < K; d++) {
        float *Xd = X + (size_t)d * KV;
        for (int c = 0; c < KV; c++) Xd[c] *= eGL[d];
        kda_axpy_rows(Xd, -1.0f, w->Kd + d, K, Y, KV, L, KV);
    }
}

lm_status lm_kda_state_map(const lm_kda_config *cfg, const lm_kda_inputs *in, float *P, float *Q) {
    // q, k, z are (B,T,H,K); v is (B,T,H,V); P is (B,H,K,K); Q is (B,H,K,V)
    lm_status st = kda_check_inputs(cfg, in, 1);
    if (st) return st;
    if (!P || !Q) return lm_error(LM_ERR_ARG, "kda state map: output %s is NULL", !P ? "P" : "Q");
    const int B = cfg->B, T = cfg->T, H = cfg->H, K = cfg->K, V = cfg->V, C = cfg->chunk, KV = K + V;
    const int factored = lm_kda_diag_path(cfg) == LM_KDA_DIAG_FACTORED;
    const size_t per_thread = map_thread_floats(cfg);
    const size_t bytes = (size_t)omp_get_max_threads() * per_thread * sizeof(float);
    float *scratch;
    const int own = !(cfg->workspace && cfg->workspace_bytes >= bytes);
    if (own) LM_TRY_ALLOC(scratch, bytes);
    else scratch = cfg->workspace;

#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < B * H; p++) {
        const int b = p / H, h = p % H;
        float *base = scratch + (size_t)omp_get_thread_num() * per_thread;
        kda_chunk_ws w;
        kda_ws_carve(&w, base, C, K, V, 0);
        float *X = base + kda_ws_floats(C, K, V, 0), *Y = X + (size_t)K * KV;
        /* X = [I | 0]: the map of an empty segment */
        memset(X, 0, (size_t)K * KV * sizeof(float));
        for (int d = 0; d < K; d++) X[(size_t)d * KV + d] = 1.0f;
        const float eA = kda_expf(in->A_log[h]);
        for (int t0 = 0; t0 < T; t0 += C) {
            const int L = T - t0 < C ? T - t0 : C;
            kda_chunk_load(cfg, in, b, h, t0, L, eA, &w);
            kda_chunk_prepare(&w, L, factored);
            map_chunk_update(&w, L, X, Y);
        }
        for (int d = 0; d < K; d++) {
            memcpy(P + ((size_t)p * K + d) * K, X + (size_t)d * KV, (size_t)K * sizeof(float));
            memcpy(Q + ((size_t)p * K + d) * V, X + (size_t)d * KV + K, (size_t)V * sizeof(float));
        }
    }
    if (own) free(scratch);
    return LM_OK;
}

static int overlaps(const float *a, size_t na, const float *b, size_t nb) {
    return a && b && a < b + nb && b < a + na;
}

static lm_status check_map_dims(const char *what, int n_pairs, int K, int V) {
    if (n_pairs < 1 || n_pairs > KDA_MAX_BH) return lm_error(LM_ERR_ARG, "%s: n_pairs = %d out of range", what, n_pairs);
    if (K < 1 || K > KDA_MAX_KV) return lm_error(LM_ERR_ARG, "%s: K = %d out of range", what, K);
    if (V < 1 || V > KDA_MAX_KV) return lm_error(LM_ERR_ARG, "%s: V = %d out of range", what, V);
    return LM_OK;
}

lm_status lm_kda_state_map_compose(int n_pairs, int K, int V, const float *P1, const float *Q1, const float *P2,
                                   const float *Q2, float *P, float *Q) {
    const char *what = "kda state map compose";
    TRY(check_map_dims(what, n_pairs, K, V));
    if (!P1 || !Q1 || !P2 || !Q2 || !P || !Q) return lm_error(LM_ERR_ARG, "%s: a map is NULL", what);
    const size_t nk = (size_t)n_pairs * K * K, nv = (size_t)n_pairs * K * V;
    if (overlaps(P, nk, P1, nk) || overlaps(P, nk, P2, nk) || overlaps(P, nk, Q1, nv) || overlaps(P, nk, Q2, nv) ||
        overlaps(Q, nv, P1, nk) || overlaps(Q, nv, P2, nk) || overlaps(Q, nv, Q1, nv) || overlaps(Q, nv, Q2, nv) ||
        overlaps(P, nk, Q, nv))
        return lm_error(LM_ERR_ARG, "%s: the outputs overlap an input", what);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < n_pairs; p++) {
        // per pair: P1, P2, P are (K,K); Q1, Q2, Q are (K,V)
        const float *p1 = P1 + (size_t)p * K * K, *p2 = P2 + (size_t)p * K * K;
        const float *q1 = Q1 + (size_t)p * K * V, *q2 = Q2 + (size_t)p * K * V;
        float *po = P + (size_t)p * K * K, *qo = Q + (size_t)p * K * V;
        for (int d = 0; d < K; d++) {
            float *pd = po + (size_t)d * K, *qd = qo + (size_t)d * V;
            memset(pd, 0, (size_t)K * sizeof(float));
            memcpy(qd, q2 + (size_t)d * V, (size_t)V * sizeof(float));
            kda_axpy_rows(pd, 1.0f, p2 + (size_t)d * K, 1, p1, K, K, K);
            kda_axpy_rows(qd, 1.0f, p2 + (size_t)d * K, 1, q1, V, K, V);
        }
    }
    return LM_OK;
}

lm_status lm_kda_state_map_apply(int n_pairs, int K, int V, const float *P, const float *Q, const float *S_in,
                                 float *S_out) {
    const char *what = "kda state map apply";
    TRY(check_map_dims(what, n_pairs, K, V));
    if (!P || !Q || !S_out) return lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !P ? "P" : !Q ? "Q" : "S_out");
    const size_t nv = (size_t)n_pairs * K * V;
    if (overlaps(S_out, nv, S_in, nv)) return lm_error(LM_ERR_ARG, "%s: S_out overlaps S_in", what);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < n_pairs; p++) {
        // per pair: P is (K,K); Q, S_in, S_out are (K,V)
        const float *pp = P + (size_t)p * K * K;
        float *so = S_out + (size_t)p * K * V;
        memcpy(so, Q + (size_t)p * K * V, (size_t)K * V * sizeof(float));
        if (!S_in) continue;
        const float *si = S_in + (size_t)p * K * V;
        for (int d = 0; d < K; d++) kda_axpy_rows(so + (size_t)d * V, 1.0f, pp + (size_t)d * K, 1, si, V, K, V);
    }
    return LM_OK;
}

lm_status lm_kda_state_map_apply_transposed(int n_pairs, int K, int V, const float *P, const float *D,
                                            const float *dS_out, float *dS_in) {
    const char *what = "kda state map apply (transposed)";
    TRY(check_map_dims(what, n_pairs, K, V));
    if (!P || !D || !dS_in) return lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !P ? "P" : !D ? "D" : "dS_in");
    const size_t nv = (size_t)n_pairs * K * V;
    if (overlaps(dS_in, nv, dS_out, nv)) return lm_error(LM_ERR_ARG, "%s: dS_in overlaps dS_out", what);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < n_pairs; p++) {
        // per pair: P is (K,K); D, dS_out, dS_in are (K,V); dS_in[j,:] = D[j,:] + sum_i P[i,j] dS_out[i,:]
        const float *pp = P + (size_t)p * K * K;
        float *out = dS_in + (size_t)p * K * V;
        memcpy(out, D + (size_t)p * K * V, (size_t)K * V * sizeof(float));
        if (!dS_out) continue;
        const float *g = dS_out + (size_t)p * K * V;
        for (int j = 0; j < K; j++) kda_axpy_rows(out + (size_t)j * V, 1.0f, pp + j, (size_t)K, g, V, K, V);
    }
    return LM_OK;
}

/* ---- the incoming state's gradient from a segment's outputs ----
 * Chunks last to first, carrying dS from zero at the segment's end; per chunk
 * the state-gradient step of the chunked backward (chunk_backward.c):
 *   dV' = scale Aqk^T dO + Kd dS,   dS <- Diag(e^{G_L}) dS + scale (Q o e^G)^T dO - W^T dV'.
 * Nothing here reads the state: Aqk, W and Kd come from the chunk alone. */
static size_t dgrad_thread_floats(const lm_kda_config *cfg) { return kda_ws_floats(cfg->chunk, cfg->K, cfg->V, 1); }

static void dgrad_chunk_update(kda_chunk_ws *w, int L, float scale) {
    // Kd, W, q, eG are (L,K); dO, dVp are (L,V); dS, dSn are (K,V); Aqk is (L,L) at stride C
    const int K = w->K, V = w->V, C = w->C;
    const float *dS = w->dS, *eGL = w->eG + (size_t)(L - 1) * K;
    for (int j = 0; j < L; j++) {
        float *dVj = w->dVp + (size_t)j * V;
        memset(dVj, 0, (size_t)V * sizeof(float));
        kda_axpy_rows(dVj, 1.0f, w->Kd + (size_t)j * K, 1, dS, V, K, V);
        kda_axpy_rows(dVj, scale, w->Aqk + (size_t)j * C + j, C, w->dO + (size_t)j * V, V, L - j, V);
    }
    for (int d = 0; d < K; d++) {
        float *dSd = w->dSn + (size_t)d * V;
        const float *dSo = dS + (size_t)d * V;
        for (int c = 0; c < V; c++) dSd[c] = eGL[d] * dSo[c];
        for (int i = 0; i < L; i++) w->tmp[i] = w->q[(size_t)i * K + d] * w->eG[(size_t)i * K + d];
        kda_axpy_rows(dSd, scale, w->tmp, 1, w->dO, V, L, V);
        kda_axpy_rows(dSd, -1.0f, w->W + d, K, w->dVp, V, L, V);
    }
    float *t = w->dS;
    w->dS = w->dSn;
    w->dSn = t;
}

lm_status lm_kda_state_map_dgrad(const lm_kda_config *cfg, const lm_kda_inputs *in, const float *d_o, float *D) {
    // q, k, z are (B,T,H,K); v, d_o are (B,T,H,V); D is (B,H,K,V)
    lm_status st = kda_check_inputs(cfg, in, 1);
    if (st) return st;
    if (!d_o || !D) return lm_error(LM_ERR_ARG, "kda state map dgrad: %s is NULL", !d_o ? "d_o" : "D");
    const int B = cfg->B, T = cfg->T, H = cfg->H, K = cfg->K, V = cfg->V, C = cfg->chunk;
    const int factored = lm_kda_diag_path(cfg) == LM_KDA_DIAG_FACTORED;
    const float scale = kda_scale(cfg);
    const size_t per_thread = dgrad_thread_floats(cfg);
    const size_t bytes = (size_t)omp_get_max_threads() * per_thread * sizeof(float);
    float *scratch;
    LM_TRY_ALLOC(scratch, bytes);
    const int nchunks = (T + C - 1) / C;
#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < B * H; p++) {
        const int b = p / H, h = p % H;
        kda_chunk_ws w;
        kda_ws_carve(&w, scratch + (size_t)omp_get_thread_num() * per_thread, C, K, V, 1);
        memset(w.dS, 0, (size_t)K * V * sizeof(float));
        const float eA = kda_expf(in->A_log[h]);
        for (int c = nchunks - 1; c >= 0; c--) {
            const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
            kda_chunk_load(cfg, in, b, h, t0, L, eA, &w);
            kda_chunk_prepare(&w, L, factored);
            for (int i = 0; i < L; i++) {
                const size_t row = ((size_t)b * T + t0 + i) * H + h;
                memcpy(w.dO + (size_t)i * V, d_o + row * V, (size_t)V * sizeof(float));
            }
            dgrad_chunk_update(&w, L, scale);
        }
        memcpy(D + (size_t)p * K * V, w.dS, (size_t)K * V * sizeof(float));
    }
    free(scratch);
    return LM_OK;
}
