/* KDA configuration: defaults, validation, the choice of the diagonal path and
 * the reciprocal-bound condition of the factored path (docs/kda.md). */
#include <string.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "kda_internal.h"

lm_kda_config lm_kda_config_default(int B, int T, int H, int K, int V) {
    lm_kda_config c;
    memset(&c, 0, sizeof c);
    c.B = B;
    c.T = T;
    c.H = H;
    c.K = K;
    c.V = V;
    c.gate = LM_KDA_GATE_BOUNDED;
    c.g_min = LM_KDA_G_MIN_DEFAULT;
    c.scale = 0.0f;
    c.chunk = 64;
    c.diag = LM_KDA_DIAG_AUTO;
    return c;
}

static lm_status check_dim(const char *name, int value, long long max) {
    if (value <= 0) return lm_error(LM_ERR_ARG, "kda: %s = %d must be positive", name, value);
    if (value > max)
        return lm_error(LM_ERR_ARG, "kda: %s = %d is absurdly large (at most %lld)", name, value, max);
    return LM_OK;
}

lm_status kda_check_config(const lm_kda_config *cfg, int need_chunk) {
    if (!cfg) return lm_error(LM_ERR_ARG, "kda: config is NULL");
    lm_status st;
    if ((st = check_dim("B", cfg->B, KDA_MAX_BH)) || (st = check_dim("T", cfg->T, KDA_MAX_T)) ||
        (st = check_dim("H", cfg->H, KDA_MAX_BH)) || (st = check_dim("K", cfg->K, KDA_MAX_KV)) ||
        (st = check_dim("V", cfg->V, KDA_MAX_KV)))
        return st;
    /* element count of the largest tensor must stay addressable */
    double elems = (double)cfg->B * cfg->T * cfg->H * (cfg->K > cfg->V ? cfg->K : cfg->V);
    if (elems > (double)((size_t)1 << 40) || (double)cfg->B * cfg->H > (double)KDA_MAX_BH)
        return lm_error(LM_ERR_ARG,
                        "kda: B*T*H*max(K,V) = %.3g elements (B=%d T=%d H=%d) is absurdly large",
                        elems, cfg->B, cfg->T, cfg->H);
    if (cfg->gate != LM_KDA_GATE_BOUNDED && cfg->gate != LM_KDA_GATE_SOFTPLUS)
        return lm_error(LM_ERR_ARG, "kda: gate = %d is not bounded (0) or softplus (1)", (int)cfg->gate);
    if (cfg->gate == LM_KDA_GATE_BOUNDED && !(cfg->g_min >= -5.0f && cfg->g_min < 0.0f))
        return lm_error(LM_ERR_ARG, "kda: g_min = %g must lie in [-5, 0) for the bounded gate",
                        (double)cfg->g_min);
    if (!isfinite(cfg->scale))
        return lm_error(LM_ERR_ARG, "kda: scale = %g must be finite (0 means K^-1/2)", (double)cfg->scale);
    if (cfg->diag != LM_KDA_DIAG_AUTO && cfg->diag != LM_KDA_DIAG_FACTORED &&
        cfg->diag != LM_KDA_DIAG_PAIRWISE)
        return lm_error(LM_ERR_ARG, "kda: diag = %d is not auto (0), factored (1) or pairwise (2)",
                        (int)cfg->diag);
    if (need_chunk && cfg->chunk != 16 && cfg->chunk != 32 && cfg->chunk != 64)
        return lm_error(LM_ERR_ARG, "kda: chunk = %d must be 16, 32 or 64", cfg->chunk);
    return LM_OK;
}

lm_status kda_check_inputs(const lm_kda_config *cfg, const lm_kda_inputs *in, int need_chunk) {
    lm_status st = kda_check_config(cfg, need_chunk);
    if (st) return st;
    if (!in) return lm_error(LM_ERR_ARG, "kda: inputs struct is NULL");
    const char *missing = !in->q ? "q" : !in->k ? "k" : !in->v ? "v" : !in->z ? "z"
                        : !in->beta ? "beta" : !in->A_log ? "A_log" : !in->dt_bias ? "dt_bias" : NULL;
    if (missing) return lm_error(LM_ERR_ARG, "kda: input %s is NULL", missing);
    for (int h = 0; h < cfg->H; h++)
        if (!isfinite(in->A_log[h]))
            return lm_error(LM_ERR_NUMERIC, "kda: A_log[%d] = %g is not finite", h, (double)in->A_log[h]);
    for (int i = 0; i < cfg->H * cfg->K; i++)
        if (!isfinite(in->dt_bias[i]))
            return lm_error(LM_ERR_NUMERIC, "kda: dt_bias[%d] = %g is not finite", i,
                            (double)in->dt_bias[i]);
    /* beta: the closed interval [0, 1] (a sigmoid in fp32 reaches 0 and 1
     * exactly for large logits; the recurrence is defined there), one pass */
    size_t n_beta = (size_t)cfg->B * cfg->T * cfg->H;
    for (size_t i = 0; i < n_beta; i++) {
        float b = in->beta[i];
        if (!(b >= 0.0f && b <= 1.0f)) {
            int h = (int)(i % (size_t)cfg->H), t = (int)(i / (size_t)cfg->H % (size_t)cfg->T);
            int bb = (int)(i / ((size_t)cfg->H * cfg->T));
            return lm_error(isfinite(b) ? LM_ERR_ARG : LM_ERR_NUMERIC,
                            "kda: beta[%d,%d,%d] (flat index %zu) = %g %s", bb, t, h, i, (double)b,
                            isfinite(b) ? "lies outside [0, 1]" : "is not finite");
        }
    }
    return LM_OK;
}

lm_status lm_kda_check(const lm_kda_config *cfg, const lm_kda_inputs *in) {
    return kda_check_inputs(cfg, in, 1);
}

float kda_scale(const lm_kda_config *cfg) {
    return cfg->scale != 0.0f ? cfg->scale : 1.0f / sqrtf((float)cfg->K);
}

/* The factored diagonal block multiplies k_i e^{G_i - G_n} by k_j e^{G_n - G_j}
 * with n the first row of the sub-chunk: exponents span |g_min| * 15 at most. */
int lm_kda_factored_safe(float g_min, lm_dtype format) {
    double max_finite, min_normal;
    switch (format) {
    case LM_DTYPE_F32: max_finite = 3.4028234663852886e38; min_normal = 1.1754943508222875e-38; break;
    case LM_DTYPE_BF16: max_finite = 3.3895313892515355e38; min_normal = 1.1754943508222875e-38; break;
    case LM_DTYPE_F16: max_finite = 65504.0; min_normal = 6.103515625e-05; break;
    default: return 0;
    }
    if (!isfinite(g_min) || g_min > 0.0f) return 0;
    double span = fabs((double)g_min) * (LM_KDA_SUBCHUNK - 1);
    return exp(span) <= max_finite && exp(-span) >= min_normal;
}

lm_kda_diag lm_kda_diag_path(const lm_kda_config *cfg) {
    if (cfg->diag == LM_KDA_DIAG_FACTORED || cfg->diag == LM_KDA_DIAG_PAIRWISE) return cfg->diag;
    return cfg->gate == LM_KDA_GATE_BOUNDED && lm_kda_factored_safe(cfg->g_min, LM_DTYPE_F32)
               ? LM_KDA_DIAG_FACTORED
               : LM_KDA_DIAG_PAIRWISE;
}

size_t lm_kda_workspace_bytes(const lm_kda_config *cfg) {
    if (kda_check_config(cfg, 1)) return 0;
    size_t nchunks = ((size_t)cfg->T + cfg->chunk - 1) / cfg->chunk;
    size_t per_thread = kda_ws_floats(cfg->chunk, cfg->K, cfg->V, 1) +
                        nchunks * ((size_t)cfg->K * cfg->V + kda_chunk_cache_floats(cfg->chunk, cfg->K, cfg->V));
    size_t partial = (size_t)cfg->B * cfg->H * (1 + (size_t)cfg->K);
    return ((size_t)omp_get_max_threads() * per_thread + partial) * sizeof(float);
}
