/* Where the CUDA KDA backward's error in dA_log and ddt_bias comes from
 * (docs/cuda.md, Precision): a replay of the CPU chunked backward
 * (src/ops/kda/chunk_backward.c, copied below with hooks) into which the bf16
 * roundings of the CUDA per-column kernel are injected, a group at a time,
 * measured against the unmodified fp32 operator (lm_kda_chunk_backward).
 *
 *   bench_kda_gate_precision [--dim D] [--shape B,T,H] [--seeds N]
 *
 * Groups: off = the off-diagonal score operands in bf16 (the row side's key
 * operand, the column side's query-side operands; anchors as the CPU
 * operator's); diag = the diagonal blocks' operands in bf16 (the kernel keeps a
 * second bf16 part there, so this shows what that buys); dA = dAqk rounded
 * once, dAkk rounded apart for the two sides as the kernels did (row side
 * bf16(dAkk) times beta, column side bf16(beta dAkk)); dA1 = dAkk rounded once
 * for both sides; state = h, dh, V', dV' and dO' in bf16 in the state terms;
 * split = every block's score operands as two bf16 parts (hi + lo, what the
 * kernels do now). Rows "K: ..." replay the kernel's column side as it is
 * computed (operands anchored at the key block's last row m, beta_i folded into
 * the k operand where dAkk is rounded once, the diagonal of dAqk in fp32), the
 * others the CPU operator's anchors: "K: split+dA1+state" is the kernels'
 * arithmetic, "K: off+dA1+state" the kernels with LONGMOE_KDA_GATE_SPLIT=0,
 * "K: off+dA+state" the kernels before the split and the single rounding.
 * Prints the plain relative errors of dz, ddt_bias and dA_log and, after the
 * '/', the error of the two sums against the sum of their terms' magnitudes
 * (as tests/test_cuda_kda.c judges them). CPU only; q, k, v, z, d_o drawn as
 * that test draws them. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/core.h"
#include "longmoe/kda.h"
#include "ops/kda/kda_internal.h"

enum { R_OFF = 1, R_DIAG = 2, R_DA = 4, R_STATE = 8, R_DA1 = 16, R_SPLIT = 32, R_KANCHOR = 64 };
static int replay_mode;
static float r16(float x) { return lm_bf16_to_f32(lm_f32_to_bf16(x)); }
/* x as two bf16 parts, hi + lo (lo = bf16(x - hi)), as the kernels' split operands */
static float s16(float x) {
    const float hi = r16(x);
    return hi + r16(x - hi);
}
/* a score operand as the mode rounds it: split (every block), or bf16 on the
 * off-diagonal or diagonal blocks, or exact */
static float op_round(float x, int diag) {
    if (replay_mode & R_SPLIT) return s16(x);
    return (replay_mode & (diag ? R_DIAG : R_OFF)) ? r16(x) : x;
}
/* per-thread operand copies (chunk 64, K <= 128) */
static float bufKc[64 * 128], bufKr[64 * 128], bufQr[64 * 128], bufBrow[64 * 64], bufBcol[64 * 64],
    bufQ[64 * 64];
#pragma omp threadprivate(bufKc, bufKr, bufQr, bufBrow, bufBcol, bufQ)

/* Backward of one chunk. On entry: w prepared for the chunk (kda_chunk_prepare
 * and kda_chunk_apply without state update), w->S the incoming state, w->dO
 * the output gradient, w->dS the gradient of the outgoing state. On exit:
 * w->dq, dk, dv, dG, dbeta hold the chunk's gradients (dG w.r.t. the cumsum G)
 * and w->dSn the gradient of the incoming state. */
static void kda_chunk_backward_one(kda_chunk_ws *w, int L, float scale, int factored) {
    // q, k, G, W, Kd are (L,K); v, U, Vp, dO are (L,V); S, dS, dSn are (K,V); Akk, Aqk are (L,L)
    const int K = w->K, V = w->V, C = w->C;
    const float *S = w->S, *dS = w->dS;
    const float *GL = w->G + (size_t)(L - 1) * K, *eGL = w->eG + (size_t)(L - 1) * K;
    memset(w->dq, 0, (size_t)L * K * sizeof(float));
    memset(w->dk, 0, (size_t)L * K * sizeof(float));
    memset(w->dG, 0, (size_t)L * K * sizeof(float));
    memset(w->dv, 0, (size_t)L * V * sizeof(float));
    memset(w->dbeta, 0, (size_t)L * sizeof(float));
    memset(w->gtmp, 0, (size_t)K * sizeof(float)); /* gradient of G_L through e^{G_L} terms */

    /* dV' = scale Aqk^T dO + (K o e^{G_L - G}) dS_out */
    for (int j = 0; j < L; j++) {
        float *dVj = w->dVp + (size_t)j * V;
        memset(dVj, 0, (size_t)V * sizeof(float));
        kda_axpy_rows(dVj, 1.0f, w->Kd + (size_t)j * K, 1, dS, V, K, V);
        kda_axpy_rows(dVj, scale, w->Aqk + (size_t)j * C + j, C, w->dO + (size_t)j * V, V, L - j, V);
    }
    /* dS_in = Diag(e^{G_L}) dS_out + scale (Q o e^G)^T dO - W^T dV' */
    for (int d = 0; d < K; d++) {
        float *dSd = w->dSn + (size_t)d * V;
        const float *dSo = dS + (size_t)d * V;
        for (int c = 0; c < V; c++) dSd[c] = eGL[d] * dSo[c];
        for (int i = 0; i < L; i++) w->tmp[i] = w->q[(size_t)i * K + d] * w->eG[(size_t)i * K + d];
        kda_axpy_rows(dSd, scale, w->tmp, 1, w->dO, V, L, V);
        kda_axpy_rows(dSd, -1.0f, w->W + d, K, w->dVp, V, L, V);
    }
    /* S^T and dS_out^T [V][K], so the row products below run over K without reductions */
    float *ST = w->ST, *dST = w->dST;
    for (int d = 0; d < K; d++)
        for (int c = 0; c < V; c++) {
            ST[(size_t)c * K + d] = S[(size_t)d * V + c];
            dST[(size_t)c * K + d] = dS[(size_t)d * V + c];
            if (replay_mode & R_STATE) {
                ST[(size_t)c * K + d] = r16(ST[(size_t)c * K + d]);
                dST[(size_t)c * K + d] = r16(dST[(size_t)c * K + d]);
            }
        }
    for (int i = 0; i < L; i++) {
        const float *qi = w->q + (size_t)i * K;
        const float *Gi = w->G + (size_t)i * K, *eG = w->eG + (size_t)i * K;
        const float *dOi = w->dO + (size_t)i * V, *Vi = w->Vp + (size_t)i * V;
        const float *dVi = w->dVp + (size_t)i * V;
        float *dq = w->dq + (size_t)i * K, *dk = w->dk + (size_t)i * K, *dG = w->dG + (size_t)i * K;
        float *Rw = w->Rw + (size_t)i * K, *dQg = w->dKr, *dKd = w->dQr;
        /* O <- scale (Q o e^G) S: dQg = scale dO S^T; S_out <- (K o e^{G_L - G})^T V':
         * dKd = V' dS_out^T; V' = U - W S: dW = -dV' S^T */
        memset(dQg, 0, (size_t)K * sizeof(float));
        memset(dKd, 0, (size_t)K * sizeof(float));
        memset(Rw, 0, (size_t)K * sizeof(float));
        float dOr[128], Vr[128], dVr[128];
        for (int c = 0; c < V; c++) {
            dOr[c] = (replay_mode & R_STATE) ? r16(scale * dOi[c]) / scale : dOi[c];
            Vr[c] = (replay_mode & R_STATE) ? r16(Vi[c]) : Vi[c];
            dVr[c] = (replay_mode & R_STATE) ? r16(dVi[c]) : dVi[c];
        }
        kda_axpy_rows(dQg, scale, dOr, 1, ST, K, V, K);
        kda_axpy_rows(dKd, 1.0f, Vr, 1, dST, K, V, K);
        kda_axpy_rows(Rw, -1.0f, dVr, 1, ST, K, V, K);
        const float *Kdi = w->Kd + (size_t)i * K;
        for (int d = 0; d < K; d++) {
            dq[d] += dQg[d] * eG[d];
            dG[d] += dQg[d] * qi[d] * eG[d];
            dk[d] += dKd[d] * kda_expf(GL[d] - Gi[d]);
            dG[d] -= dKd[d] * Kdi[d];
            w->gtmp[d] += dKd[d] * Kdi[d];
        }
    }
    /* S_out <- Diag(e^{G_L}) S */
    for (int d = 0; d < K; d++)
        if (replay_mode & R_STATE) {
            float acc = 0;
            for (int c = 0; c < V; c++) acc += r16(S[(size_t)d * V + c]) * r16(dS[(size_t)d * V + c]);
            w->gtmp[d] += eGL[d] * acc;
        } else
        w->gtmp[d] += eGL[d] * kda_dot(S + (size_t)d * V, dS + (size_t)d * V, V);
    for (int d = 0; d < K; d++) w->dG[(size_t)(L - 1) * K + d] += w->gtmp[d];

    /* W = (I + Akk)^{-1} Diag(beta) (K o e^G), U likewise with V: R = (I + Akk)^{-T} dW,
     * by back substitution */
    memcpy(w->Ru, w->dVp, (size_t)L * V * sizeof(float));
    for (int i = L - 1; i >= 0; i--) {
        float *Rwi = w->Rw + (size_t)i * K, *Rui = w->Ru + (size_t)i * V;
        const float *Acol = w->Akk + (size_t)(i + 1) * C + i; /* Akk[j][i], j > i */
        kda_axpy_rows(Rwi, -1.0f, Acol, C, w->Rw + (size_t)(i + 1) * K, K, L - 1 - i, K);
        kda_axpy_rows(Rui, -1.0f, Acol, C, w->Ru + (size_t)(i + 1) * V, V, L - 1 - i, V);
    }
    for (int i = 0; i < L; i++) {
        const float bi = w->beta[i];
        const float *ki = w->k + (size_t)i * K, *eG = w->eG + (size_t)i * K, *vi = w->v + (size_t)i * V;
        const float *Rwi = w->Rw + (size_t)i * K, *Rui = w->Ru + (size_t)i * V;
        float *dk = w->dk + (size_t)i * K, *dG = w->dG + (size_t)i * K;
        /* right-hand sides Diag(beta) (K o e^G) and Diag(beta) V */
        float db = kda_dot(Rui, vi, V);
        for (int d = 0; d < K; d++) {
            const float kg = ki[d] * eG[d];
            db += Rwi[d] * kg;
            dk[d] += bi * Rwi[d] * eG[d];
            dG[d] += bi * Rwi[d] * kg;
        }
        kda_axpy(w->dv + (size_t)i * V, bi, Rui, V);
        /* Akk through the inverse: dAkk = -(Rw W^T + Ru U^T), strictly lower */
        float *dBi = w->dB + (size_t)i * C;
        for (int j = 0; j < i; j++) {
            float dA = -(kda_dot(Rwi, w->W + (size_t)j * K, K) + kda_dot(Rui, w->U + (size_t)j * V, V));
            db += dA * w->Bkk[(size_t)i * C + j];
            dBi[j] = bi * dA;
        }
        w->dbeta[i] += db;
        /* O <- scale Aqk V': dAqk = scale dO V'^T, lower with diagonal */
        float *dQi = w->dAqk + (size_t)i * C;
        for (int j = 0; j <= i; j++)
            dQi[j] = scale * kda_dot(w->dO + (size_t)i * V, w->Vp + (size_t)j * V, V);
    }

    /* Scores: per row block anchored on its first row n; the gradients of the
     * anchor's own exponent cancel exactly between row and column operands. */
    for (int a0 = 0; a0 < L; a0 += LM_KDA_SUBCHUNK) {
        const int a1 = a0 + LM_KDA_SUBCHUNK < L ? a0 + LM_KDA_SUBCHUNK : L;
        const int jend = factored ? a1 : a0;
        kda_chunk_columns(w, a0, jend);
        memset(w->dKc, 0, (size_t)jend * K * sizeof(float));
        for (int j = 0; j < jend; j++)
            for (int d = 0; d < K; d++) {
                bufKc[j * K + d] = op_round(w->Kc[(size_t)j * K + d], j >= a0);
            }
        for (int i = a0; i < a1; i++)
            for (int d = 0; d < K; d++) {
                bufKr[i * K + d] = w->Kr[(size_t)i * K + d];
                bufQr[i * K + d] = w->Qr[(size_t)i * K + d];
            }
        for (int i = 0; i < L; i++)
            for (int j = 0; j < L; j++) {
                float db = j < i ? w->dB[(size_t)i * C + j] : 0.f, bi = w->beta[i];
                bufBrow[i * 64 + j] = (replay_mode & R_DA) ? bi * r16(db / bi) : db;
                bufBcol[i * 64 + j] = (replay_mode & R_DA) ? r16(db) : db;
                if (replay_mode & R_DA1) bufBrow[i * 64 + j] = bufBcol[i * 64 + j] = bi * r16(db / bi);
                float dq = j <= i ? w->dAqk[(size_t)i * C + j] : 0.f;
                bufQ[i * 64 + j] = (replay_mode & (R_DA | R_DA1)) ? r16(dq) : dq;
            }
        for (int i = a0; i < a1; i++) {
            const float *Kr = w->Kr + (size_t)i * K, *Qr = w->Qr + (size_t)i * K;
            const float *Er = w->Er + (size_t)i * K;
            const float *dBi = bufBrow + (size_t)i * 64, *dQi = bufQ + (size_t)i * 64;
            memset(w->dKr, 0, (size_t)K * sizeof(float));
            memset(w->dQr, 0, (size_t)K * sizeof(float));
            /* columns with an operand: j < jend, j < i (Akk) and j <= i (Aqk) */
            kda_axpy_rows(w->dKr, 1.0f, dBi, 1, bufKc, K, jend < i ? jend : i, K);
            /* kernel: the diagonal of dAqk (fp32) applied exactly, e^0 = 1, nothing to dG */
            const int kq = (replay_mode & R_KANCHOR) && factored ? i : i + 1;
            kda_axpy_rows(w->dQr, 1.0f, dQi, 1, bufKc, K, jend < kq ? jend : kq, K);
            float *dq = w->dq + (size_t)i * K, *dk = w->dk + (size_t)i * K, *dG = w->dG + (size_t)i * K;
            if (kq == i) {
                const float dii = w->dAqk[(size_t)i * C + i];
                for (int d = 0; d < K; d++) {
                    dq[d] += dii * w->k[(size_t)i * K + d];
                    dk[d] += dii * w->q[(size_t)i * K + d];
                }
            }
            for (int d = 0; d < K; d++) {
                dk[d] += w->dKr[d] * Er[d];
                dq[d] += w->dQr[d] * Er[d];
                dG[d] += w->dKr[d] * Kr[d] + w->dQr[d] * Qr[d];
            }
            if (!factored) {
                /* diagonal sub-chunk per position pair, e^{G_i - G_j} with j <= i */
                const float *qi = w->q + (size_t)i * K, *ki = w->k + (size_t)i * K;
                const float *Gi = w->G + (size_t)i * K;
                for (int j = a0; j <= i; j++) {
                    const float db = j < i ? dBi[j] : 0.0f, da = dQi[j];
                    const float *kj = w->k + (size_t)j * K, *Gj = w->G + (size_t)j * K;
                    float *dkj = w->dk + (size_t)j * K, *dGj = w->dG + (size_t)j * K;
                    for (int d = 0; d < K; d++) {
                        const float e = kda_expf(Gi[d] - Gj[d]);
                        const float row = (db * ki[d] + da * qi[d]) * e; /* d score / d k_j */
                        const float col = kj[d] * e;
                        dk[d] += db * col;
                        dq[d] += da * col;
                        dkj[d] += row;
                        dG[d] += row * kj[d];
                        dGj[d] -= row * kj[d];
                    }
                }
            }
        }
        /* column operands: dKc_j = sum_{i in block, i > j} dB_ij Kr_i + sum_{i >= j} dAqk_ij Qr_i */
        for (int j = 0; j < jend; j++) {
            float *dKcj = w->dKc + (size_t)j * K;
            const int ib = j + 1 > a0 ? j + 1 : a0, iq = j > a0 ? j : a0;
            if (replay_mode & R_KANCHOR) {
                /* the kernel's column side: operands anchored at the last row m of
                 * j's 16-row block (G constant past T), q_i e^{G_i - G_m} and, with
                 * dAkk rounded once (dA1), beta_i k_i e^{G_i - G_m} times bf16(dAkk)
                 * (dA: k_i e^{G_i - G_m} times bf16(beta_i dAkk)), then e^{G_m - G_j};
                 * the diagonal of dAqk applied exactly on the row side above */
                const int mj = (j / LM_KDA_SUBCHUNK) * LM_KDA_SUBCHUNK + LM_KDA_SUBCHUNK - 1 < L - 1
                                   ? (j / LM_KDA_SUBCHUNK) * LM_KDA_SUBCHUNK + LM_KDA_SUBCHUNK - 1
                                   : L - 1;
                const float *Gm = w->G + (size_t)mj * K, *Gj = w->G + (size_t)j * K;
                const float *kj = w->k + (size_t)j * K;
                float *dk = w->dk + (size_t)j * K, *dG = w->dG + (size_t)j * K;
                float acc[128];
                for (int d = 0; d < K; d++) acc[d] = 0.f;
                for (int i = ib; i < a1; i++) {
                    const float bi = w->beta[i], db = w->dB[(size_t)i * C + j];
                    const float coef = (replay_mode & R_DA1) ? r16(db / bi) : (replay_mode & R_DA) ? r16(db) : db / bi;
                    const float bop = (replay_mode & R_DA1) || !(replay_mode & R_DA) ? bi : 1.f;
                    const float *ki = w->k + (size_t)i * K, *qi = w->q + (size_t)i * K, *Gi = w->G + (size_t)i * K;
                    const float dq = bufQ[i * 64 + j];
                    for (int d = 0; d < K; d++) {
                        const float ex = kda_expf(Gi[d] - Gm[d]);
                        acc[d] += coef * op_round(ki[d] * ex * bop, j >= a0) + dq * op_round(qi[d] * ex, j >= a0);
                    }
                }
                for (int d = 0; d < K; d++) {
                    const float c = acc[d] * kda_expf(Gm[d] - Gj[d]);
                    dk[d] += c;
                    dG[d] -= c * kj[d];
                }
                continue;
            }
            int rr = j < a0 ? (replay_mode & R_OFF) : (replay_mode & R_DIAG);
            for (int i = ib; i < a1; i++)
                for (int d = 0; d < K; d++) {
                    float x = w->Kr[(size_t)i * K + d];
                    dKcj[d] += bufBcol[i * 64 + j] * ((replay_mode & R_SPLIT) ? s16(x) : rr ? r16(x) : x);
                }
            for (int i = iq; i < a1; i++)
                for (int d = 0; d < K; d++) {
                    float x = w->Qr[(size_t)i * K + d];
                    dKcj[d] += bufQ[i * 64 + j] * ((replay_mode & R_SPLIT) ? s16(x) : rr ? r16(x) : x);
                }
        }
        for (int j = 0; j < jend; j++) {
            const float *dKc = w->dKc + (size_t)j * K, *Kc = w->Kc + (size_t)j * K;
            const float *Ec = w->Ec + (size_t)j * K;
            float *dk = w->dk + (size_t)j * K, *dG = w->dG + (size_t)j * K;
            for (int d = 0; d < K; d++) {
                dk[d] += dKc[d] * Ec[d];
                dG[d] -= dKc[d] * Kc[d];
            }
        }
    }
}

/* Point the chunk's cached arrays (Bkk, Aqk, W, U, V') at one cache slot. */
static void kda_point_cache(kda_chunk_ws *w, float *slot) {
    const size_t cc = (size_t)w->C * w->C;
    w->Bkk = slot;
    w->Aqk = slot + cc;
    w->W = slot + 2 * cc;
    w->U = w->W + (size_t)w->C * w->K;
    w->Vp = w->U + (size_t)w->C * w->V;
}

static lm_status replay_backward(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                const float *d_o, const float *dht, lm_kda_grads *grads) {
    // q, k, z, dq, dk, dz are (B,T,H,K); v, d_o, dv are (B,T,H,V); beta, dbeta are (B,T,H);
    // A_log, dA_log are (H); dt_bias, ddt_bias are (H,K); h0, dht, dh0 are (B,H,K,V)
    lm_status st = kda_check_inputs(cfg, in, 1);
    if (st) return st;
    if (!d_o) return lm_error(LM_ERR_ARG, "kda chunk backward: d_o is NULL");
    if (!grads) return lm_error(LM_ERR_ARG, "kda chunk backward: grads struct is NULL");
    const char *missing = !grads->dq ? "dq" : !grads->dk ? "dk" : !grads->dv ? "dv"
                        : !grads->dz ? "dz" : !grads->dbeta ? "dbeta" : !grads->dA_log ? "dA_log"
                        : !grads->ddt_bias ? "ddt_bias" : NULL;
    if (missing) return lm_error(LM_ERR_ARG, "kda chunk backward: gradient %s is NULL", missing);
    const int B = cfg->B, T = cfg->T, H = cfg->H, K = cfg->K, V = cfg->V, C = cfg->chunk;
    const float scale = kda_scale(cfg);
    const int factored = lm_kda_diag_path(cfg) == LM_KDA_DIAG_FACTORED;
    const int nchunks = (T + C - 1) / C;
    const size_t kv = (size_t)K * V;
    const int nthreads = omp_get_max_threads();
    const size_t cache = kda_chunk_cache_floats(C, K, V);
    const size_t per_thread = kda_ws_floats(C, K, V, 1) + (size_t)nchunks * (kv + cache);
    const size_t npairs = (size_t)B * H;
    float *scratch;
    const size_t bytes = ((size_t)nthreads * per_thread + npairs * (1 + (size_t)K)) * sizeof(float);
    const int own = !(cfg->workspace && cfg->workspace_bytes >= bytes);
    if (own) LM_TRY_ALLOC(scratch, bytes);
    else scratch = cfg->workspace;
    float *dA_part = scratch + (size_t)nthreads * per_thread; /* [B*H] */
    float *ddt_part = dA_part + npairs;                        /* [B*H][K] */
    memset(dA_part, 0, npairs * (1 + (size_t)K) * sizeof(float));

#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < B * H; p++) {
        const int b = p / H, h = p % H;
        float *base = scratch + (size_t)omp_get_thread_num() * per_thread;
        kda_chunk_ws w;
        kda_ws_carve(&w, base, C, K, V, 1);
        float *states = base + kda_ws_floats(C, K, V, 1); /* [nchunks][K][V] */
        float *cached = states + (size_t)nchunks * kv;     /* [nchunks][cache] */
        const float eA = kda_expf(in->A_log[h]);
        /* forward over the chunks: the state entering each chunk, and each chunk's
         * scores, W, U and V' written straight into its cache slot */
        if (in->h0) memcpy(w.S, in->h0 + (size_t)p * kv, kv * sizeof(float));
        else memset(w.S, 0, kv * sizeof(float));
        for (int c = 0; c < nchunks; c++) {
            const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
            memcpy(states + (size_t)c * kv, w.S, kv * sizeof(float));
            kda_point_cache(&w, cached + (size_t)c * cache);
            kda_chunk_load(cfg, in, b, h, t0, L, eA, &w);
            kda_chunk_prepare(&w, L, factored);
            kda_chunk_apply(&w, L, scale, NULL, 0, c < nchunks - 1);
        }
        /* backward over the chunks, carrying dS; only the exponent operands are recomputed */
        if (dht) memcpy(w.dS, dht + (size_t)p * kv, kv * sizeof(float));
        else memset(w.dS, 0, kv * sizeof(float));
        for (int c = nchunks - 1; c >= 0; c--) {
            const int t0 = c * C, L = T - t0 < C ? T - t0 : C;
            memcpy(w.S, states + (size_t)c * kv, kv * sizeof(float));
            kda_point_cache(&w, cached + (size_t)c * cache);
            kda_chunk_load(cfg, in, b, h, t0, L, eA, &w);
            kda_chunk_operands(&w, L);
            for (int i = 0; i < L; i++)
                for (int j = 0; j < i; j++) w.Akk[(size_t)i * C + j] = w.beta[i] * w.Bkk[(size_t)i * C + j];
            for (int i = 0; i < L; i++) {
                const size_t row = ((size_t)b * T + t0 + i) * H + h;
                memcpy(w.dO + (size_t)i * V, d_o + row * V, (size_t)V * sizeof(float));
            }
            kda_chunk_backward_one(&w, L, scale, factored);
            /* G = inclusive cumsum of g: dg_t = sum_{i >= t} dG_i */
            for (int i = L - 2; i >= 0; i--)
                kda_axpy(w.dG + (size_t)i * K, 1.0f, w.dG + (size_t)(i + 1) * K, K);
            float dA = 0.0f;
            for (int i = 0; i < L; i++) {
                const size_t row = ((size_t)b * T + t0 + i) * H + h;
                const float *dg = w.dG + (size_t)i * K, *u = w.u + (size_t)i * K;
                float *dz = grads->dz + row * K, *ddt = ddt_part + (size_t)p * K;
                for (int d = 0; d < K; d++) {
                    float dg_du, dg_dA;
                    kda_gate_grad(cfg->gate, cfg->g_min, eA, u[d], &dg_du, &dg_dA);
                    dz[d] += dg[d] * dg_du;
                    ddt[d] += dg[d] * dg_du;
                    dA += dg[d] * dg_dA;
                }
                kda_axpy(grads->dq + row * K, 1.0f, w.dq + (size_t)i * K, K);
                kda_axpy(grads->dk + row * K, 1.0f, w.dk + (size_t)i * K, K);
                kda_axpy(grads->dv + row * V, 1.0f, w.dv + (size_t)i * V, V);
                grads->dbeta[row] += w.dbeta[i];
            }
            dA_part[p] += dA;
            float *tmp = w.dS;
            w.dS = w.dSn;
            w.dSn = tmp;
        }
        if (grads->dh0) kda_axpy(grads->dh0 + (size_t)p * kv, 1.0f, w.dS, (int)kv);
    }
    /* per-head parameters: sum the pairs' partial gradients in a fixed order */
    for (int h = 0; h < H; h++)
        for (int b = 0; b < B; b++) {
            const size_t p = (size_t)b * H + h;
            grads->dA_log[h] += dA_part[p];
            kda_axpy(grads->ddt_bias + (size_t)h * K, 1.0f, ddt_part + p * K, K);
        }
    if (own) free(scratch);
    return LM_OK;
}

static double rel(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - (double)b[i]) * (a[i] - (double)b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void alloc_grads(lm_kda_grads *g, size_t n, size_t nb, int H, int D, size_t ns) {
    g->dq = callocCheck(n, 4);
    g->dk = callocCheck(n, 4);
    g->dv = callocCheck(n, 4);
    g->dz = callocCheck(n, 4);
    g->dbeta = callocCheck(nb, 4);
    g->dA_log = callocCheck((size_t)H, 4);
    g->ddt_bias = callocCheck((size_t)H * D, 4);
    g->dh0 = callocCheck(ns, 4);
}
static void free_grads(lm_kda_grads *g) {
    free(g->dq);
    free(g->dk);
    free(g->dv);
    free(g->dz);
    free(g->dbeta);
    free(g->dA_log);
    free(g->ddt_bias);
    free(g->dh0);
}

int main(int argc, char **argv) {
    int B = 2, T = 100, H = 2, D = 64, seeds = 3;
    long test_seed = -1; /* >= 0: draw as tests/test_cuda_kda.c does with this seed base */
    const char *only = NULL; /* a mode's name prefix: run that mode only */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dim") && i + 1 < argc) {
            D = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            if (sscanf(argv[++i], "%d,%d,%d", &B, &T, &H) != 3) dieAt("--shape wants B,T,H (got %s)", argv[i]);
        } else if (!strcmp(argv[i], "--seeds") && i + 1 < argc) {
            seeds = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--test-seed") && i + 1 < argc) {
            test_seed = atol(argv[++i]);
            seeds = 1;
        } else if (!strcmp(argv[i], "--mode") && i + 1 < argc) {
            only = argv[++i];
        } else {
            fprintf(stderr, "usage: %s [--dim D] [--shape B,T,H] [--seeds N] [--test-seed S] [--mode NAME]\n"
                            "  --test-seed S: one draw per gate, made as tests/test_cuda_kda.c makes it\n"
                            "    (inputs seeded S + gate, d_o and dht seeded 77 + T)\n"
                            "  --mode NAME: only the modes whose name starts with NAME\n", argv[0]);
            return 2;
        }
    }
    if (D < 1 || D > 128 || B < 1 || T < 1 || H < 1 || seeds < 1)
        dieAt("need 1 <= D <= 128 and B, T, H, seeds >= 1 (got D %d B %d T %d H %d seeds %d)", D, B, T, H, seeds);
    const struct {
        const char *name;
        int mode;
    } modes[] = {{"none", 0},
                 {"off", R_OFF},
                 {"diag", R_DIAG},
                 {"dA", R_DA},
                 {"state", R_STATE},
                 {"off+dA+state (the kernels)", R_OFF | R_DA | R_STATE},
                 {"dA1+state (off exact)", R_DA1 | R_STATE},
                 {"dA+state (off exact)", R_DA | R_STATE},
                 {"off+dA1+state", R_OFF | R_DA1 | R_STATE},
                 /* the kernels' own anchors and diagonal of dAqk (R_KANCHOR) */
                 {"K: off+dA+state (before)", R_KANCHOR | R_OFF | R_DA | R_STATE},
                 {"K: off+dA1+state (SPLIT=0)", R_KANCHOR | R_OFF | R_DA1 | R_STATE},
                 {"K: split+dA+state", R_KANCHOR | R_SPLIT | R_DA | R_STATE},
                 {"K: split+dA1+state (kernels)", R_KANCHOR | R_SPLIT | R_DA1 | R_STATE},
                 {"K: split+dA1 (state exact)", R_KANCHOR | R_SPLIT | R_DA1},
                 {"K: split (dA, state exact)", R_KANCHOR | R_SPLIT},
                 {"K: split+state (dA exact)", R_KANCHOR | R_SPLIT | R_STATE}};
    const int nmodes = (int)(sizeof modes / sizeof modes[0]);
    const size_t n = (size_t)B * T * H * D, nb = (size_t)B * T * H, ns = (size_t)B * H * D * D;
    printf("KDA backward replay: bf16 roundings of the CUDA per-column kernel, B %d T %d H %d D %d\n", B, T, H, D);
    printf("%-28s %-8s %4s  %-9s %-17s %-17s\n", "rounded", "gate", "seed", "dz", "ddt_bias/terms", "dA_log/terms");
    for (int m = 0; m < nmodes; m++)
        for (int gate = 0; gate < 2 && (!only || !strncmp(modes[m].name, only, strlen(only))); gate++)
            for (int seed = 0; seed < seeds; seed++) {
                lm_kda_config cfg = lm_kda_config_default(B, T, H, D, D);
                cfg.gate = (lm_kda_gate)gate;
                lm_rng r;
                lm_rng_seed(&r, test_seed >= 0 ? (uint64_t)test_seed + gate : (uint64_t)(2000 + 10 * seed + gate));
                float *q = mallocCheck(n * 4), *k = mallocCheck(n * 4), *v = mallocCheck(n * 4);
                float *z = mallocCheck(n * 4), *beta = mallocCheck(nb * 4), *A = mallocCheck((size_t)H * 4);
                float *dt = mallocCheck((size_t)H * D * 4), *h0 = mallocCheck(ns * 4);
                float *d_o = mallocCheck(n * 4), *dht = mallocCheck(ns * 4);
                for (size_t row = 0; row < nb; row++) {
                    double nq = 0, nk = 0;
                    for (int d = 0; d < D; d++) {
                        q[row * D + d] = (float)lm_rng_normal(&r);
                        k[row * D + d] = (float)lm_rng_normal(&r);
                        nq += q[row * D + d] * q[row * D + d];
                        nk += k[row * D + d] * k[row * D + d];
                    }
                    for (int d = 0; d < D; d++) {
                        q[row * D + d] = r16((float)(q[row * D + d] / sqrt(nq)));
                        k[row * D + d] = r16((float)(k[row * D + d] / sqrt(nk)));
                        v[row * D + d] = r16((float)lm_rng_normal(&r));
                        z[row * D + d] = r16((float)lm_rng_normal(&r));
                    }
                    beta[row] = (float)(1.0 / (1.0 + exp(-lm_rng_normal(&r))));
                }
                for (int h = 0; h < H; h++) A[h] = (float)(0.5 * lm_rng_normal(&r));
                for (int i = 0; i < H * D; i++) dt[i] = (float)(0.5 * lm_rng_normal(&r));
                for (size_t i = 0; i < ns; i++) h0[i] = (float)(0.3 * lm_rng_normal(&r));
                if (test_seed >= 0) lm_rng_seed(&r, (uint64_t)(77 + T)); /* as check_backward_gates */
                for (size_t i = 0; i < n; i++) d_o[i] = r16((float)lm_rng_normal(&r));
                for (size_t i = 0; i < ns; i++) dht[i] = (float)(0.1 * lm_rng_normal(&r));
                lm_kda_inputs in = {q, k, v, z, beta, A, dt, h0};
                lm_kda_grads g[2];
                alloc_grads(&g[0], n, nb, H, D, ns);
                alloc_grads(&g[1], n, nb, H, D, ns);
                if (lm_kda_chunk_backward(&cfg, &in, d_o, dht, &g[0])) dieAt("%s", lm_last_error());
                replay_mode = modes[m].mode;
                if (replay_backward(&cfg, &in, d_o, dht, &g[1])) dieAt("%s", lm_last_error());
                /* the sums' conditions: the sums of their terms' magnitudes */
                double *sdt = callocCheck((size_t)H * D, sizeof(double)), *sA = callocCheck((size_t)H, sizeof(double));
                for (size_t bt = 0; bt < (size_t)B * T; bt++)
                    for (int h = 0; h < H; h++)
                        for (int d = 0; d < D; d++) {
                            size_t i = (bt * H + h) * D + d;
                            double x = (double)z[i] + dt[h * D + d];
                            double ratio = gate == 0 ? x : (x > 30 ? x : log1p(exp(x))) * (1 + exp(-x));
                            sdt[h * D + d] += fabs(g[0].dz[i]);
                            sA[h] += fabs(g[0].dz[i] * ratio);
                        }
                double n1 = 0, d1 = 0, n2 = 0, d2 = 0;
                for (int j = 0; j < H * D; j++) {
                    double e = g[1].ddt_bias[j] - (double)g[0].ddt_bias[j];
                    n1 += e * e;
                    d1 += sdt[j] * sdt[j];
                }
                for (int j = 0; j < H; j++) {
                    double e = g[1].dA_log[j] - (double)g[0].dA_log[j];
                    n2 += e * e;
                    d2 += sA[j] * sA[j];
                }
                printf("%-28s %-8s %4d  %.2e  %.2e/%.1e  %.2e/%.1e\n", modes[m].name, gate ? "softplus" : "bounded",
                       seed, rel(g[1].dz, g[0].dz, n), rel(g[1].ddt_bias, g[0].ddt_bias, (size_t)H * D),
                       sqrt(n1 / d1), rel(g[1].dA_log, g[0].dA_log, (size_t)H), sqrt(n2 / d2));
                free(sdt);
                free(sA);
                free_grads(&g[0]);
                free_grads(&g[1]);
                free(q);
                free(k);
                free(v);
                free(z);
                free(beta);
                free(A);
                free(dt);
                free(h0);
                free(d_o);
                free(dht);
            }
    return 0;
}
