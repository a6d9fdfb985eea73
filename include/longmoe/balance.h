/* Load balancing of the MoE router and its monitoring (docs/moe.md; SPEC §4).
 *
 * Sign convention: b is ADDED to the scores for selection, T_i =
 * argtop_k(s_i + b). A larger b_j gives expert j more tokens. (Megatron
 * stores -b; we do not.)
 *
 * Modes (config `balance`):
 *   quantile  quantile balancing: b_j = the k/n quantile of r_ij = alpha_i - s_ij,
 *             alpha_i = (k+1)-th largest s_i + b (the old b), then b -= mean(b).
 *             Estimators: LM_QB_HISTOGRAM (the K3 estimator, B uniform bins over
 *             [min b - 1, max b + 1]), LM_QB_EXACT (sorting; tests only: not
 *             reducible across ranks), LM_QB_ZOOM (ours: B bins over a window
 *             around each b_j that adapts from step to step; see docs/moe.md).
 *   sign      loss-free balancing [LFB]: b_j += u sign(mean load - load_j).
 *   aux       auxiliary loss alpha n sum_j f_j P_j (lm_balance_aux_loss); b stays 0.
 *   none      b stays 0; monitoring only.
 *
 * Use per layer and training step:
 *   for each micro-batch: lm_balance_observe(state, s, m, training)
 *   (data-parallel run: SUM all-reduce of lm_balance_reduce_buffer, n*B + n int32)
 *   lm_balance_step_end(state, training, &stats)
 * b changes only in lm_balance_step_end with training = 1 and at least one
 * token observed; the new b routes the next step. */
#ifndef LONGMOE_BALANCE_H
#define LONGMOE_BALANCE_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    LM_BALANCE_NONE = 0,
    LM_BALANCE_QUANTILE = 1,
    LM_BALANCE_SIGN = 2,
    LM_BALANCE_AUX = 3
} lm_balance_mode;

typedef enum {
    LM_QB_HISTOGRAM = 0, /* K3: B uniform bins over [min b - 1, max b + 1] */
    LM_QB_EXACT = 1,     /* sort-based quantile (single process; tests) */
    LM_QB_ZOOM = 2       /* B bins over [b_j - w_j, b_j + w_j] (+ two tail bins), w_j adaptive */
} lm_qb_estimator;

#define LM_QB_BINS_DEFAULT 1000
#define LM_SIGN_RATE_DEFAULT 1e-3f

typedef struct {
    lm_balance_mode mode;
    lm_qb_estimator estimator;
    int n_experts;       /* n >= 2 */
    int top_k;           /* 1 <= k < n for quantile; k <= n otherwise */
    int bins;            /* B >= 4 (quantile histogram / zoom) */
    int64_t max_tokens;  /* most tokens of one lm_balance_observe call */
    int64_t max_step_tokens; /* exact estimator: most tokens in one step (0: max_tokens) */
    float ema;           /* 0 = off; else b = ema b_old + (1 - ema) b_new, in [0, 1) */
    float sign_rate;     /* u of the sign rule */
    float aux_alpha;     /* alpha of the auxiliary loss */
    int interval;        /* training steps per MaxVio_global interval (>= 1) */
} lm_balance_config;

/* Monitoring of one layer at one step (SPEC §4, "Monitoring"). */
typedef struct {
    int64_t step;           /* steps ended so far, this one included */
    int64_t tokens;         /* tokens routed this step */
    const int32_t *load;    /* [n] tokens per expert this step (owned by the state,
                               valid until the next lm_balance_step_end) */
    double maxvio_batch;    /* max_j load_j / mean load - 1 */
    double maxvio_global;   /* the same over the loads summed over the current interval */
    double cv;              /* std / mean of load (population std) */
    int32_t min_load, max_load;
    int dead;               /* experts with no token this step */
    double router_entropy;  /* mean over tokens of H(s_i / sum_j s_ij), nats */
    double bias_min, bias_max; /* b after this step's update */
    int updated;            /* 1 when b changed at this step */
} lm_balance_stats;

typedef struct {
    lm_balance_config cfg;
    float *bias;          /* [n] b, routes the next step (checkpointed) */
    int32_t *reduce;      /* [n*B + n] the one integer buffer a data-parallel run sums */
    int32_t *counts;      /* = reduce: [n, B] histograms of r (quantile) */
    int32_t *load;        /* = reduce + n*B: [n] tokens per expert this step */
    float *halfwidth;     /* [n] zoom windows' half widths (state, checkpointed) */
    float *residuals;     /* [n, max_step_tokens] exact estimator's r, this step */
    int64_t n_residuals;
    float *alpha;         /* [max_tokens] scratch: thresholds of one micro-batch */
    int32_t *scratch_topk; /* [max_tokens, k] scratch: the routing of one micro-batch */
    float *bin_lo, *bin_width; /* [n] this step's bin geometry per expert */
    int32_t *last_load;   /* [n] the load reported by the last stats */
    int64_t *interval_load; /* [n] loads summed over the current interval */
    int interval_steps;
    int64_t step;
    int64_t tokens;       /* tokens observed this step (this rank) */
    double entropy_sum;
    void *block;
} lm_balance_state;

/* Defaults: K3 histogram with 1000 bins, no EMA, u = 1e-3, alpha 1e-3, interval 100. */
lm_balance_config lm_balance_config_default(lm_balance_mode mode, int n_experts, int top_k,
                                            int64_t max_tokens);
lm_status lm_balance_check(const lm_balance_config *cfg);
lm_status lm_balance_init(lm_balance_state *state, const lm_balance_config *cfg);
void lm_balance_free(lm_balance_state *state);

/* Parse "none" | "quantile" | "sign" | "aux" (0 on success). */
int lm_balance_mode_from_name(const char *name, lm_balance_mode *out);
const char *lm_balance_mode_name(lm_balance_mode mode);

/* Accumulate one micro-batch of router scores s [m, n] (fp32, in [0,1]),
 * routed with the current b. Always counts the load and the entropy; with
 * training = 1 in quantile mode also the histograms (or residuals). */
lm_status lm_balance_observe(lm_balance_state *state, const float *s, int64_t m, int training);

/* Counting done elsewhere (lm_cuda_balance_histogram, lm_cuda_expert_load on
 * the GPU). lm_balance_bin_geometry gives this step's bins, lo[n] and
 * width[n] (quantile mode with the histogram or zoom estimator; fixed by b
 * for the whole step), exactly as lm_balance_observe bins r.
 * lm_balance_observe_counts then ADDS m tokens, of one micro-batch or the sum
 * of several of the step's (a backend that counts a whole step on the device
 * adds it at once; m may then exceed max_tokens): load [n] (tokens per expert,
 * k per token) and, with training = 1 in those modes, counts [n, B] (NULL
 * otherwise); entropy_sum is the sum over the m tokens of the router entropy
 * (0 when not measured: the stat then reads low). */
lm_status lm_balance_bin_geometry(lm_balance_state *state, float *lo, float *width);
lm_status lm_balance_observe_counts(lm_balance_state *state, const int32_t *counts, const int32_t *load, int64_t m,
                                    int training, double entropy_sum);

/* The buffer to SUM across data-parallel ranks before lm_balance_step_end. */
int32_t *lm_balance_reduce_buffer(lm_balance_state *state, size_t *count);

/* End of a step: with training = 1 update b (quantile / sign, SPEC §4 steps
 * 4-5), then report the monitoring stats (may be NULL) and clear the
 * accumulators. With training = 0, or when no token was observed, b is kept. */
lm_status lm_balance_step_end(lm_balance_state *state, int training, lm_balance_stats *stats);

/* K3 estimator (SPEC §4 step 4) for one expert's histogram counts[B] over
 * [lo, lo + B w): the first bin l whose cumulative count reaches ceil(q),
 * b = lo + (l + clip((q - c') / h, 0, 1)) w. Returns lo when the histogram is empty. */
double lm_qb_histogram_quantile(const int32_t *counts, int bins, double lo, double width, double q);

/* Monitoring numbers of a load vector (used by the stats and the tools). */
void lm_balance_load_stats(const int32_t *load, int n, double *maxvio, double *cv, int32_t *min_load,
                           int32_t *max_load, int *dead);

/* Auxiliary loss alpha * n * sum_j f_j P_j with f_j = load_j / (m k) over the
 * top-k in topk [m,k] and P_j = mean_i s_ij / sum_l s_il. Returns the loss in
 * *loss and ADDS its gradient with respect to s into dscores [m, n] (may be
 * NULL), to be passed to lm_moe_backward as dscores_extra (f is held fixed:
 * it is piecewise constant). */
lm_status lm_balance_aux_loss(float *loss, float *dscores, const float *s, const int32_t *topk, int64_t m,
                              int n, int k, float alpha);

#ifdef __cplusplus
}
#endif
#endif
