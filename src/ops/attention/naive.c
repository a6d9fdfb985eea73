/* Naive causal softmax attention: the definition written out with a full
 * [T,T] probability matrix per (batch, head). O(T^2) memory; for tests and
 * benchmarks only (the model uses the tiled form in attention.c). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/attention.h"

#define IDX4(b, t, h, d, T, H, D) ((((size_t)(b) * (T) + (t)) * (H) + (h)) * (D) + (d))

lm_status lm_attention_naive_forward(const lm_attention_config *cfg, const float *q,
                                     const float *k, const float *v, float *o, float *lse) {
    // q (B,T,H,Dk), k (B,T,Hkv,Dk), v (B,T,Hkv,Dv) -> o (B,T,H,Dv), lse (B,H,T); P is (T,T)
    lm_status st = lm_attention_check(cfg);
    if (st) return st;
    const int B = cfg->B, T = cfg->T, H = cfg->H, Hkv = cfg->Hkv, Dk = cfg->Dk, Dv = cfg->Dv;
    const int group = H / Hkv;
    const float scale = lm_attention_scale(cfg);
    const size_t matrix_bytes = (size_t)T * T * sizeof(float);
    float *P;
    LM_TRY_ALLOC(P, matrix_bytes);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int hk = h / group;
#pragma omp parallel for schedule(dynamic, 16)
            for (int i = 0; i < T; i++) {
                float *p = P + (size_t)i * T;
                float mx = -INFINITY;
                for (int j = 0; j <= i; j++) {
                    float s = 0.0f;
                    for (int d = 0; d < Dk; d++)
                        s += q[IDX4(b, i, h, d, T, H, Dk)] * k[IDX4(b, j, hk, d, T, Hkv, Dk)];
                    p[j] = scale * s;
                    mx = p[j] > mx ? p[j] : mx;
                }
                float sum = 0.0f;
                for (int j = 0; j <= i; j++) sum += (p[j] = expf(p[j] - mx));
                for (int j = 0; j <= i; j++) p[j] /= sum;
                for (int e = 0; e < Dv; e++) {
                    float acc = 0.0f;
                    for (int j = 0; j <= i; j++) acc += p[j] * v[IDX4(b, j, hk, e, T, Hkv, Dv)];
                    o[IDX4(b, i, h, e, T, H, Dv)] = acc;
                }
                if (lse) lse[((size_t)b * H + h) * T + i] = mx + logf(sum);
            }
        }
    free(P);
    return LM_OK;
}

lm_status lm_attention_naive_backward(const lm_attention_config *cfg, const float *q,
                                      const float *k, const float *v, const float *o,
                                      const float *lse, const float *d_o, float *dq, float *dk,
                                      float *dv) {
    // P and dS are (T,T) per (batch, head); gradients accumulate (+=)
    lm_status st = lm_attention_check(cfg);
    if (st) return st;
    const int B = cfg->B, T = cfg->T, H = cfg->H, Hkv = cfg->Hkv, Dk = cfg->Dk, Dv = cfg->Dv;
    const int group = H / Hkv;
    const float scale = lm_attention_scale(cfg);
    const size_t matrix_bytes = (size_t)T * T * sizeof(float);
    float *P, *dS;
    LM_TRY_ALLOC(P, matrix_bytes);
    dS = malloc(matrix_bytes);
    if (!dS) {
        free(P);
        return lm_error(LM_ERR_MEMORY, "attention naive backward: out of memory for T=%d", T);
    }
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int hk = h / group;
            // P_ij = exp(s_ij - lse_i); dS_ij = P_ij (dO_i . v_j - dO_i . O_i)
#pragma omp parallel for schedule(dynamic, 16)
            for (int i = 0; i < T; i++) {
                float Di = 0.0f;
                for (int e = 0; e < Dv; e++)
                    Di += d_o[IDX4(b, i, h, e, T, H, Dv)] * o[IDX4(b, i, h, e, T, H, Dv)];
                const float l = lse[((size_t)b * H + h) * T + i];
                for (int j = 0; j < T; j++) {
                    if (j > i) {
                        P[(size_t)i * T + j] = dS[(size_t)i * T + j] = 0.0f;
                        continue;
                    }
                    float s = 0.0f, dp = 0.0f;
                    for (int d = 0; d < Dk; d++)
                        s += q[IDX4(b, i, h, d, T, H, Dk)] * k[IDX4(b, j, hk, d, T, Hkv, Dk)];
                    for (int e = 0; e < Dv; e++)
                        dp += d_o[IDX4(b, i, h, e, T, H, Dv)] * v[IDX4(b, j, hk, e, T, Hkv, Dv)];
                    const float p = expf(scale * s - l);
                    P[(size_t)i * T + j] = p;
                    dS[(size_t)i * T + j] = p * (dp - Di);
                }
            }
            if (dq) {
#pragma omp parallel for schedule(static)
                for (int i = 0; i < T; i++)
                    for (int d = 0; d < Dk; d++) {
                        float acc = 0.0f;
                        for (int j = 0; j <= i; j++)
                            acc += dS[(size_t)i * T + j] * k[IDX4(b, j, hk, d, T, Hkv, Dk)];
                        dq[IDX4(b, i, h, d, T, H, Dk)] += scale * acc;
                    }
            }
            /* dk, dv rows are shared by the heads of a group: heads run one after another */
#pragma omp parallel for schedule(static)
            for (int j = 0; j < T; j++) {
                if (dk)
                    for (int d = 0; d < Dk; d++) {
                        float acc = 0.0f;
                        for (int i = j; i < T; i++)
                            acc += dS[(size_t)i * T + j] * q[IDX4(b, i, h, d, T, H, Dk)];
                        dk[IDX4(b, j, hk, d, T, Hkv, Dk)] += scale * acc;
                    }
                if (dv)
                    for (int e = 0; e < Dv; e++) {
                        float acc = 0.0f;
                        for (int i = j; i < T; i++)
                            acc += P[(size_t)i * T + j] * d_o[IDX4(b, i, h, e, T, H, Dv)];
                        dv[IDX4(b, j, hk, e, T, Hkv, Dv)] += acc;
                    }
            }
        }
    free(P);
    free(dS);
    return LM_OK;
}
