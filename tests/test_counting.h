/* A CPU backend whose MoE, KDA-operator and attention forwards count their
 * calls (the CPU's ops otherwise): what a step runs again, counted, for the
 * recomputation and sequence-segment tests. One per test program (static). */
#ifndef LONGMOE_TEST_COUNTING_H
#define LONGMOE_TEST_COUNTING_H

#include "longmoe/backend.h"

typedef struct {
    int moe, kda, attention; /* moe_forward; kda_forward; attention_forward and attention_forward_offset */
} test_op_counts;

static test_op_counts test_counts;

static lm_status count_moe_forward(lm_backend *be, float *y, const float *x, const void *x_lp, const float *bias,
                                   const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                                   void *acts, int64_t n) {
    test_counts.moe++;
    return lm_backend_cpu()->ops->moe_forward(be, y, x, x_lp, bias, cfg, p, p_lp, acts, n);
}

static lm_status count_kda_forward(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k,
                                   const void *v, const void *z, const float *beta, const float *A_log,
                                   const float *dt_bias, const float *h0, void *o, float *ht) {
    test_counts.kda++;
    return lm_backend_cpu()->ops->kda_forward(be, cfg, q, k, v, z, beta, A_log, dt_bias, h0, o, ht);
}

static lm_status count_attention_forward(lm_backend *be, const lm_attention_config *cfg, const void *q,
                                         const void *k, const void *v, void *o, float *lse, float *rowmax) {
    test_counts.attention++;
    return lm_backend_cpu()->ops->attention_forward(be, cfg, q, k, v, o, lse, rowmax);
}

static lm_status count_attention_forward_offset(lm_backend *be, const lm_attention_config *cfg, int q_offset,
                                                const void *q, const void *k, const void *v, void *o, float *lse,
                                                float *rowmax) {
    test_counts.attention++;
    return lm_backend_cpu()->ops->attention_forward_offset(be, cfg, q_offset, q, k, v, o, lse, rowmax);
}

/* *be: the CPU backend with `ops` (filled here: the CPU's, the four forwards counting) as its table. */
static inline void test_counting_backend(lm_backend *be, lm_ops *ops) {
    *ops = *lm_backend_cpu()->ops;
    ops->moe_forward = count_moe_forward;
    ops->kda_forward = count_kda_forward;
    ops->attention_forward = count_attention_forward;
    ops->attention_forward_offset = count_attention_forward_offset;
    *be = *lm_backend_cpu();
    be->ops = ops;
}

#endif
