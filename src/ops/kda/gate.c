/* The KDA gate on its own (SPEC §2 "Gate"): g [B,T,H,K] from z, A_log, dt_bias.
 * The operators fuse the same scalar function (kda_gate_value). */
#include <math.h>

#include "kda_internal.h"

lm_status lm_kda_gate_forward(const lm_kda_config *cfg, const float *z, const float *A_log,
                              const float *dt_bias, float *g) {
    // z, g are (B,T,H,K); A_log is (H); dt_bias is (H,K)
    lm_status st = kda_check_config(cfg, 0);
    if (st) return st;
    if (!z || !A_log || !dt_bias || !g)
        return lm_error(LM_ERR_ARG, "kda gate: %s is NULL",
                        !z ? "z" : !A_log ? "A_log" : !dt_bias ? "dt_bias" : "g");
    const int H = cfg->H, K = cfg->K;
    for (int h = 0; h < H; h++)
        if (!isfinite(A_log[h]))
            return lm_error(LM_ERR_NUMERIC, "kda gate: A_log[%d] = %g is not finite", h, (double)A_log[h]);
    for (int i = 0; i < H * K; i++)
        if (!isfinite(dt_bias[i]))
            return lm_error(LM_ERR_NUMERIC, "kda gate: dt_bias[%d] = %g is not finite", i,
                            (double)dt_bias[i]);
    const size_t rows = (size_t)cfg->B * cfg->T;
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++) {
        for (int h = 0; h < H; h++) {
            const float eA = kda_expf(A_log[h]);
            const size_t base = (r * H + h) * K;
            for (int d = 0; d < K; d++)
                g[base + d] = kda_gate_value(cfg->gate, cfg->g_min, eA, z[base + d] + dt_bias[h * K + d]);
        }
    }
    return LM_OK;
}
