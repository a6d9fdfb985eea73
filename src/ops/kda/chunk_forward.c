/* KDA chunked form, forward (SPEC §2 "Chunked form"; docs/kda.md).
 *
 * Per (batch, head) pair, chunks of C tokens run in order carrying the state
 * S [K][V]. Inside a chunk, positions are split into sub-chunks of 16; every
 * score k_i . k_j e^{G_i - G_j} (and q_i . k_j e^{G_i - G_j}) of a row block a
 * is anchored on the block's first row n <= i:
 *   (x_i o e^{G_i - G_n}) . (k_j o e^{G_n - G_j}).
 * For j < n both exponents are <= 0. For j in the block itself (the diagonal
 * sub-chunk) the column exponent is in [0, 15 |g_min|]: the FACTORED path uses
 * the same product there, the PAIRWISE path computes e^{G_i - G_j} per pair. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kda_internal.h"

/* Carves the workspace's arrays out of base and returns the floats used;
 * with base == NULL it only counts (one list of sizes for both). */
static size_t kda_ws_layout(kda_chunk_ws *w, float *base, int C, int K, int V, int backward) {
    size_t ck = (size_t)C * K, cv = (size_t)C * V, cc = (size_t)C * C, kv = (size_t)K * V;
    size_t off = 0;
    memset(w, 0, sizeof *w);
    w->C = C;
    w->K = K;
    w->V = V;
#define TAKE(field, count) (w->field = base ? base + off : NULL, off += (count))
    TAKE(q, ck); TAKE(k, ck); TAKE(u, ck); TAKE(G, ck); TAKE(eG, ck); TAKE(Er, ck);
    TAKE(Kr, ck); TAKE(Qr, ck); TAKE(Kc, ck); TAKE(Ec, ck); TAKE(Kd, ck); TAKE(W, ck);
    TAKE(v, cv); TAKE(U, cv); TAKE(Vp, cv);
    TAKE(beta, C);
    TAKE(Bkk, cc); TAKE(Akk, cc); TAKE(Aqk, cc);
    TAKE(S, kv);
    TAKE(tmp, (size_t)(C > K ? C : K));
    if (backward) {
        TAKE(dO, cv); TAKE(dVp, cv); TAKE(Ru, cv); TAKE(dv, cv);
        TAKE(dq, ck); TAKE(dk, ck); TAKE(dG, ck); TAKE(Rw, ck); TAKE(dKc, ck);
        TAKE(dB, cc); TAKE(dAqk, cc);
        TAKE(dbeta, C);
        TAKE(dS, kv); TAKE(dSn, kv); TAKE(ST, kv); TAKE(dST, kv);
        TAKE(gtmp, K); TAKE(dKr, K); TAKE(dQr, K);
    }
#undef TAKE
    return off;
}

size_t kda_ws_floats(int C, int K, int V, int backward) {
    kda_chunk_ws w;
    return kda_ws_layout(&w, NULL, C, K, V, backward);
}

void kda_ws_carve(kda_chunk_ws *w, float *base, int C, int K, int V, int backward) {
    kda_ws_layout(w, base, C, K, V, backward);
}

void kda_chunk_load(const lm_kda_config *cfg, const lm_kda_inputs *in, int b, int h, int t0,
                    int L, float eA, kda_chunk_ws *w) {
    // rows t0 .. t0+L-1 of pair (b,h): q, k, u, G are (L,K); v is (L,V); beta is (L)
    const int T = cfg->T, H = cfg->H, K = cfg->K, V = cfg->V;
    const float *bias = in->dt_bias + (size_t)h * K;
    for (int i = 0; i < L; i++) {
        const size_t row = ((size_t)b * T + t0 + i) * H + h;
        memcpy(w->q + (size_t)i * K, in->q + row * K, (size_t)K * sizeof(float));
        memcpy(w->k + (size_t)i * K, in->k + row * K, (size_t)K * sizeof(float));
        memcpy(w->v + (size_t)i * V, in->v + row * V, (size_t)V * sizeof(float));
        w->beta[i] = in->beta[row];
        const float *z = in->z + row * K;
        float *u = w->u + (size_t)i * K, *G = w->G + (size_t)i * K;
        /* G_i = sum_{t <= i in chunk} g_t, accumulated in fp32 in token order */
        for (int d = 0; d < K; d++) {
            u[d] = z[d] + bias[d];
            float g = kda_gate_value(cfg->gate, cfg->g_min, eA, u[d]);
            G[d] = i ? G[d - K] + g : g;
        }
    }
}

void kda_chunk_columns(kda_chunk_ws *w, int a0, int jend) {
    // Kc, Ec are (jend,K): Ec_j = e^{G_n - G_j}, Kc_j = k_j o Ec_j with n = a0
    const int K = w->K;
    const float *Gn = w->G + (size_t)a0 * K;
    for (int j = 0; j < jend; j++) {
        const float *Gj = w->G + (size_t)j * K, *kj = w->k + (size_t)j * K;
        float *Ec = w->Ec + (size_t)j * K, *Kc = w->Kc + (size_t)j * K;
        for (int d = 0; d < K; d++) {
            Ec[d] = kda_expf(Gn[d] - Gj[d]);
            Kc[d] = kj[d] * Ec[d];
        }
    }
}

void kda_chunk_operands(kda_chunk_ws *w, int L) {
    // G, q, k are (L,K); eG, Kd, Er, Kr, Qr are (L,K)
    const int K = w->K;
    const float *GL = w->G + (size_t)(L - 1) * K;
    for (int i = 0; i < L; i++) {
        const float *Gi = w->G + (size_t)i * K, *ki = w->k + (size_t)i * K;
        float *eG = w->eG + (size_t)i * K, *Kd = w->Kd + (size_t)i * K;
        for (int d = 0; d < K; d++) {
            eG[d] = kda_expf(Gi[d]);
            Kd[d] = ki[d] * kda_expf(GL[d] - Gi[d]);
        }
    }
    /* row operands, anchored on the first row n of each sub-chunk: n <= i, exponents <= 0 */
    for (int a0 = 0; a0 < L; a0 += LM_KDA_SUBCHUNK) {
        const int a1 = a0 + LM_KDA_SUBCHUNK < L ? a0 + LM_KDA_SUBCHUNK : L;
        const float *Gn = w->G + (size_t)a0 * K;
        for (int i = a0; i < a1; i++) {
            const float *Gi = w->G + (size_t)i * K;
            float *Er = w->Er + (size_t)i * K, *Kr = w->Kr + (size_t)i * K, *Qr = w->Qr + (size_t)i * K;
            for (int d = 0; d < K; d++) {
                Er[d] = kda_expf(Gi[d] - Gn[d]);
                Kr[d] = w->k[(size_t)i * K + d] * Er[d];
                Qr[d] = w->q[(size_t)i * K + d] * Er[d];
            }
        }
    }
}

void kda_chunk_prepare(kda_chunk_ws *w, int L, int factored) {
    // q, k, G are (L,K); Bkk, Akk, Aqk are (L,L); W is (L,K); U is (L,V)
    const int K = w->K, V = w->V, C = w->C;
    kda_chunk_operands(w, L);
    for (int a0 = 0; a0 < L; a0 += LM_KDA_SUBCHUNK) {
        const int a1 = a0 + LM_KDA_SUBCHUNK < L ? a0 + LM_KDA_SUBCHUNK : L;
        /* column operands: j < n always; j in [n, a1) too on the factored path
         * (exponents in [0, 15|g_min|], finite for g_min >= -5) */
        kda_chunk_columns(w, a0, factored ? a1 : a0);
        for (int i = a0; i < a1; i++) {
            const float *Kr = w->Kr + (size_t)i * K, *Qr = w->Qr + (size_t)i * K;
            float *Bi = w->Bkk + (size_t)i * C, *Qi = w->Aqk + (size_t)i * C;
            /* off-diagonal sub-chunks: one product per (i, j), j < n */
            for (int j = 0; j < a0; j++) {
                Bi[j] = kda_dot(Kr, w->Kc + (size_t)j * K, K);
                Qi[j] = kda_dot(Qr, w->Kc + (size_t)j * K, K);
            }
            if (factored) {
                /* diagonal sub-chunk as the same matrix product; j > i never computed */
                for (int j = a0; j <= i; j++) {
                    if (j < i) Bi[j] = kda_dot(Kr, w->Kc + (size_t)j * K, K);
                    Qi[j] = kda_dot(Qr, w->Kc + (size_t)j * K, K);
                }
            } else {
                /* diagonal sub-chunk per position pair: e^{G_i - G_j}, i >= j */
                const float *Gi = w->G + (size_t)i * K, *ki = w->k + (size_t)i * K,
                            *qi = w->q + (size_t)i * K;
                for (int j = a0; j <= i; j++) {
                    const float *Gj = w->G + (size_t)j * K, *kj = w->k + (size_t)j * K;
                    float sb = 0.0f, sq = 0.0f;
                    for (int d = 0; d < K; d++) {
                        float e = kj[d] * kda_expf(Gi[d] - Gj[d]);
                        sb += ki[d] * e;
                        sq += qi[d] * e;
                    }
                    if (j < i) Bi[j] = sb;
                    Qi[j] = sq;
                }
            }
        }
    }
    /* WY/UT transform: (I + Akk) W = Diag(beta) (K o e^G), (I + Akk) U = Diag(beta) V,
     * Akk[i,j] = beta_i Bkk[i,j], solved by forward substitution */
    for (int i = 0; i < L; i++) {
        const float bi = w->beta[i];
        float *Ai = w->Akk + (size_t)i * C;
        float *Wi = w->W + (size_t)i * K, *Ui = w->U + (size_t)i * V;
        const float *ki = w->k + (size_t)i * K, *eG = w->eG + (size_t)i * K, *vi = w->v + (size_t)i * V;
        for (int d = 0; d < K; d++) Wi[d] = bi * ki[d] * eG[d];
        for (int c = 0; c < V; c++) Ui[c] = bi * vi[c];
        for (int j = 0; j < i; j++) Ai[j] = bi * w->Bkk[(size_t)i * C + j];
        kda_axpy_rows(Wi, -1.0f, Ai, 1, w->W, K, i, K);
        kda_axpy_rows(Ui, -1.0f, Ai, 1, w->U, V, i, V);
    }
}

void kda_chunk_apply(kda_chunk_ws *w, int L, float scale, float *o, size_t ostride,
                     int update_state) {
    // S is (K,V); W is (L,K); U, Vp are (L,V); o rows are (V) at stride ostride
    const int K = w->K, V = w->V, C = w->C;
    float *S = w->S;
    /* V' = U - W S */
    for (int i = 0; i < L; i++) {
        float *Vi = w->Vp + (size_t)i * V;
        const float *Wi = w->W + (size_t)i * K;
        memcpy(Vi, w->U + (size_t)i * V, (size_t)V * sizeof(float));
        kda_axpy_rows(Vi, -1.0f, Wi, 1, S, V, K, V);
    }
    /* O = scale ((Q o e^G) S + Aqk V'), Aqk lower with diagonal */
    if (o) {
        for (int i = 0; i < L; i++) {
            float *oi = o + (size_t)i * ostride;
            const float *qi = w->q + (size_t)i * K, *eG = w->eG + (size_t)i * K;
            memset(oi, 0, (size_t)V * sizeof(float));
            for (int d = 0; d < K; d++) w->tmp[d] = qi[d] * eG[d];
            kda_axpy_rows(oi, 1.0f, w->tmp, 1, S, V, K, V);
            kda_axpy_rows(oi, 1.0f, w->Aqk + (size_t)i * C, 1, w->Vp, V, i + 1, V);
            for (int c = 0; c < V; c++) oi[c] *= scale;
        }
    }
    if (!update_state) return;
    /* S_out = Diag(e^{G_L}) S + (K o e^{G_L - G})^T V' */
    const float *eGL = w->eG + (size_t)(L - 1) * K;
    for (int d = 0; d < K; d++) {
        float *Sd = S + (size_t)d * V;
        for (int c = 0; c < V; c++) Sd[c] *= eGL[d];
        kda_axpy_rows(Sd, 1.0f, w->Kd + d, K, w->Vp, V, L, V);
    }
}

lm_status lm_kda_chunk_forward(const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                               float *ht) {
    // q, k, z are (B,T,H,K); v, o are (B,T,H,V); beta is (B,T,H); h0, ht are (B,H,K,V)
    lm_status st = kda_check_inputs(cfg, in, 1);
    if (st) return st;
    if (!o) return lm_error(LM_ERR_ARG, "kda chunk forward: output o is NULL");
    const int B = cfg->B, T = cfg->T, H = cfg->H, K = cfg->K, V = cfg->V, C = cfg->chunk;
    const float scale = kda_scale(cfg);
    const int factored = lm_kda_diag_path(cfg) == LM_KDA_DIAG_FACTORED;
    const int nthreads = omp_get_max_threads();
    const size_t per_thread = kda_ws_floats(C, K, V, 0);
    float *scratch;
    const size_t bytes = (size_t)nthreads * per_thread * sizeof(float);
    const int own = !(cfg->workspace && cfg->workspace_bytes >= bytes);
    if (own) LM_TRY_ALLOC(scratch, bytes);
    else scratch = cfg->workspace;

#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < B * H; p++) {
        const int b = p / H, h = p % H;
        kda_chunk_ws w;
        kda_ws_carve(&w, scratch + (size_t)omp_get_thread_num() * per_thread, C, K, V, 0);
        if (in->h0) memcpy(w.S, in->h0 + (size_t)p * K * V, (size_t)K * V * sizeof(float));
        else memset(w.S, 0, (size_t)K * V * sizeof(float));
        const float eA = kda_expf(in->A_log[h]);
        for (int t0 = 0; t0 < T; t0 += C) {
            const int L = T - t0 < C ? T - t0 : C;
            kda_chunk_load(cfg, in, b, h, t0, L, eA, &w);
            kda_chunk_prepare(&w, L, factored);
            kda_chunk_apply(&w, L, scale, o + (((size_t)b * T + t0) * H + h) * V, (size_t)H * V, 1);
        }
        if (ht) memcpy(ht + (size_t)p * K * V, w.S, (size_t)K * V * sizeof(float));
    }
    if (own) free(scratch);
    return LM_OK;
}
