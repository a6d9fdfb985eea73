/* KDA recurrent form: the definition, token by token (SPEC §2 "Recurrence").
 * Used for decode and as the fp32 reference of the chunked form. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kda_internal.h"

lm_status lm_kda_recurrent_forward(const lm_kda_config *cfg, const lm_kda_inputs *in, float *o,
                                   float *ht) {
    // q, k, z are (B,T,H,K); v, o are (B,T,H,V); beta is (B,T,H); h0, ht are (B,H,K,V)
    lm_status st = kda_check_inputs(cfg, in, 0);
    if (st) return st;
    if (!o) return lm_error(LM_ERR_ARG, "kda recurrent: output o is NULL");
    const int B = cfg->B, T = cfg->T, H = cfg->H, K = cfg->K, V = cfg->V;
    const float scale = kda_scale(cfg);
    const int nthreads = omp_get_max_threads();
    const size_t per_thread = (size_t)K * V + 2 * (size_t)V + (size_t)K;
    float *scratch;
    const size_t bytes = (size_t)nthreads * per_thread * sizeof(float);
    LM_TRY_ALLOC(scratch, bytes);

#pragma omp parallel for schedule(dynamic, 1)
    for (int p = 0; p < B * H; p++) {
        const int b = p / H, h = p % H;
        float *S = scratch + (size_t)omp_get_thread_num() * per_thread; /* [K][V] */
        float *kS = S + (size_t)K * V, *delta = kS + V, *decay = delta + V;
        if (in->h0) memcpy(S, in->h0 + (size_t)p * K * V, (size_t)K * V * sizeof(float));
        else memset(S, 0, (size_t)K * V * sizeof(float));
        const float eA = kda_expf(in->A_log[h]);
        for (int t = 0; t < T; t++) {
            const size_t row = ((size_t)b * T + t) * H + h;
            const float *q = in->q + row * K, *k = in->k + row * K, *z = in->z + row * K;
            const float *v = in->v + row * V;
            const float beta = in->beta[row];
            for (int d = 0; d < K; d++)
                decay[d] = kda_expf(kda_gate_value(cfg->gate, cfg->g_min, eA, z[d] + in->dt_bias[h * K + d]));
            /* S = Diag(e^g) S; kS = S^T k */
            for (int d = 0; d < K; d++) {
                float *Sd = S + (size_t)d * V;
                for (int j = 0; j < V; j++) Sd[j] *= decay[d];
            }
            memset(kS, 0, (size_t)V * sizeof(float));
            kda_axpy_rows(kS, 1.0f, k, 1, S, V, K, V);
            /* S += beta k (v - S^T k)^T */
            for (int j = 0; j < V; j++) delta[j] = beta * (v[j] - kS[j]);
            for (int d = 0; d < K; d++) kda_axpy(S + (size_t)d * V, k[d], delta, V);
            /* o = scale S^T q */
            float *out = o + row * V;
            memset(out, 0, (size_t)V * sizeof(float));
            kda_axpy_rows(out, scale, q, 1, S, V, K, V);
        }
        if (ht) memcpy(ht + (size_t)p * K * V, S, (size_t)K * V * sizeof(float));
    }
    free(scratch);
    return LM_OK;
}
