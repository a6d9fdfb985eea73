/* MoE router: top-k selection with the balancing bias, renormalised weights,
 * and grouping of tokens by expert (include/longmoe/moe.h; SPEC §4). */
#include <math.h>
#include <string.h>

#include "longmoe/moe.h"

void lm_topk_row(int32_t *idx, float *val, const float *s, const float *b, int n, int k) {
    // s, b are (n); idx, val are (k): the k largest s + b, decreasing, ties to the lower index
    int have = 0;
    for (int j = 0; j < n; j++) {
        float v = s[j] + (b ? b[j] : 0.0f);
        if (have == k && !(v > val[k - 1])) continue;
        /* insertion point: after every kept value >= v (so equal values keep index order) */
        int pos = have < k ? have : k - 1;
        while (pos > 0 && val[pos - 1] < v) {
            val[pos] = val[pos - 1];
            idx[pos] = idx[pos - 1];
            pos--;
        }
        val[pos] = v;
        idx[pos] = j;
        if (have < k) have++;
    }
}

lm_status lm_router_select(int32_t *topk, float *weights, const float *s, const float *b,
                           int64_t m, int n, int k, float route_scale) {
    // s is (m,n), b is (n); topk, weights are (m,k)
    if (m < 0) return lm_error(LM_ERR_ARG, "router: token count m must be >= 0, got %lld", (long long)m);
    if (n < 1) return lm_error(LM_ERR_ARG, "router: expert count n must be >= 1, got %d", n);
    if (k < 1 || k > n || k > LM_MOE_MAX_TOPK)
        return lm_error(LM_ERR_ARG, "router: top_k must lie in [1, min(%d, n = %d)], got %d",
                        LM_MOE_MAX_TOPK, n, k);
    if (!isfinite(route_scale))
        return lm_error(LM_ERR_ARG, "router: route_scale must be finite, got %g", (double)route_scale);
    if (b)
        for (int j = 0; j < n; j++)
            if (!isfinite(b[j]))
                return lm_error(LM_ERR_NUMERIC, "router: bias b[%d] = %g is not finite", j, (double)b[j]);
    int64_t bad = -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        const float *si = s + i * n;
        int ok = 1;
        for (int j = 0; j < n; j++) ok &= isfinite(si[j]) != 0;
        if (!ok) {
#pragma omp critical(lm_router_bad)
            if (bad < 0 || i < bad) bad = i;
            continue;
        }
        float val[LM_MOE_MAX_TOPK];
        int32_t *ti = topk + i * k;
        lm_topk_row(ti, val, si, b, n, k);
        if (weights) {
            /* p_it = scale * s_{i,T_it} / sum_{j in T_i} s_ij (SPEC §4) */
            float sum = 0.0f;
            for (int t = 0; t < k; t++) sum += si[ti[t]];
            float inv = sum > 0.0f ? route_scale / sum : 0.0f;
            for (int t = 0; t < k; t++) weights[i * k + t] = si[ti[t]] * inv;
        }
    }
    if (bad >= 0)
        return lm_error(LM_ERR_NUMERIC, "router: token %lld has a non-finite score", (long long)bad);
    return LM_OK;
}

void lm_moe_group_by_expert(int64_t *offsets, int32_t *order, int32_t *slot_row,
                            const int32_t *topk, int64_t m, int n, int k) {
    // topk is (m,k); offsets (n+1); order, slot_row (m*k)
    /* stable counting sort of the (token, slot) pairs by expert */
    memset(offsets, 0, (size_t)(n + 1) * sizeof *offsets);
    int64_t mk = m * k;
    for (int64_t g = 0; g < mk; g++) offsets[topk[g] + 1]++;
    for (int j = 0; j < n; j++) offsets[j + 1] += offsets[j];
    /* offsets[j] is reused as the fill cursor, then restored */
    for (int64_t g = 0; g < mk; g++) {
        int64_t row = offsets[topk[g]]++;
        order[row] = (int32_t)g;
        slot_row[g] = (int32_t)row;
    }
    for (int j = n; j > 0; j--) offsets[j] = offsets[j - 1];
    offsets[0] = 0;
}
