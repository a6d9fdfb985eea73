/* Router load balancing: quantile (K3 histogram, exact, zoom), sign and aux
 * modes, and the per-step monitoring (include/longmoe/balance.h; SPEC §4). */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/balance.h"
#include "longmoe/moe.h"

/* Experts per parallel work item of the histogram pass. */
#define EXPERT_BLOCK 16
/* Zoom estimator: smallest window half width, growth when the quantile falls
 * in a tail bin, and margin of the window over the last step's move. */
#define ZOOM_MIN_HALFWIDTH 1e-5f
#define ZOOM_GROW 4.0f
#define ZOOM_MARGIN 4.0f

lm_balance_config lm_balance_config_default(lm_balance_mode mode, int n_experts, int top_k,
                                            int64_t max_tokens) {
    lm_balance_config c;
    memset(&c, 0, sizeof c);
    c.mode = mode;
    c.estimator = LM_QB_HISTOGRAM;
    c.n_experts = n_experts;
    c.top_k = top_k;
    c.bins = LM_QB_BINS_DEFAULT;
    c.max_tokens = max_tokens;
    c.ema = 0.0f;
    c.sign_rate = LM_SIGN_RATE_DEFAULT;
    c.aux_alpha = 1e-3f;
    c.interval = 100;
    return c;
}

static const char *const mode_names[] = {"none", "quantile", "sign", "aux"};

const char *lm_balance_mode_name(lm_balance_mode mode) {
    return (unsigned)mode < 4 ? mode_names[mode] : "?";
}

int lm_balance_mode_from_name(const char *name, lm_balance_mode *out) {
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, mode_names[i])) {
            *out = (lm_balance_mode)i;
            return 0;
        }
    return 1;
}

lm_status lm_balance_check(const lm_balance_config *c) {
    if ((unsigned)c->mode > LM_BALANCE_AUX)
        return lm_error(LM_ERR_ARG, "balance: unknown mode %d (none, quantile, sign, aux)", (int)c->mode);
    if (c->n_experts < 2 || c->n_experts > LM_MOE_MAX_EXPERTS)
        return lm_error(LM_ERR_ARG, "balance: n_experts must lie in [2, %d], got %d", LM_MOE_MAX_EXPERTS,
                        c->n_experts);
    if (c->top_k < 1 || c->top_k > LM_MOE_MAX_TOPK || c->top_k > c->n_experts)
        return lm_error(LM_ERR_ARG, "balance: top_k must lie in [1, min(%d, n_experts = %d)], got %d",
                        LM_MOE_MAX_TOPK, c->n_experts, c->top_k);
    if (c->mode == LM_BALANCE_QUANTILE && c->top_k >= c->n_experts)
        return lm_error(LM_ERR_ARG,
                        "balance: quantile mode needs top_k < n_experts (the threshold is the "
                        "(k+1)-th score), got top_k %d with %d experts",
                        c->top_k, c->n_experts);
    if ((unsigned)c->estimator > LM_QB_ZOOM)
        return lm_error(LM_ERR_ARG, "balance: unknown quantile estimator %d", (int)c->estimator);
    if (c->mode == LM_BALANCE_QUANTILE && c->estimator != LM_QB_EXACT && (c->bins < 4 || c->bins > 1 << 20))
        return lm_error(LM_ERR_ARG, "balance: bins must lie in [4, 2^20], got %d", c->bins);
    if (c->max_tokens < 1 || c->max_tokens > INT32_MAX / LM_MOE_MAX_TOPK)
        return lm_error(LM_ERR_ARG, "balance: max_tokens must lie in [1, %d], got %lld",
                        INT32_MAX / LM_MOE_MAX_TOPK, (long long)c->max_tokens);
    if (c->max_step_tokens < 0 || c->max_step_tokens > INT32_MAX / LM_MOE_MAX_TOPK)
        return lm_error(LM_ERR_ARG, "balance: max_step_tokens must lie in [0, %d], got %lld",
                        INT32_MAX / LM_MOE_MAX_TOPK, (long long)c->max_step_tokens);
    if (!(c->ema >= 0.0f && c->ema < 1.0f))
        return lm_error(LM_ERR_ARG, "balance: ema must lie in [0, 1), got %g", (double)c->ema);
    if (!(c->sign_rate >= 0.0f) || !isfinite(c->sign_rate))
        return lm_error(LM_ERR_ARG, "balance: sign_rate must be finite and >= 0, got %g", (double)c->sign_rate);
    if (!(c->aux_alpha >= 0.0f) || !isfinite(c->aux_alpha))
        return lm_error(LM_ERR_ARG, "balance: aux_alpha must be finite and >= 0, got %g", (double)c->aux_alpha);
    if (c->interval < 1) return lm_error(LM_ERR_ARG, "balance: interval must be >= 1, got %d", c->interval);
    return LM_OK;
}

static int uses_histogram(const lm_balance_config *c) {
    return c->mode == LM_BALANCE_QUANTILE && c->estimator != LM_QB_EXACT;
}

lm_status lm_balance_init(lm_balance_state *s, const lm_balance_config *c) {
    memset(s, 0, sizeof *s);
    lm_status st = lm_balance_check(c);
    if (st) return st;
    size_t n = (size_t)c->n_experts, k = (size_t)c->top_k, B = uses_histogram(c) ? (size_t)c->bins : 0;
    size_t cap = c->mode == LM_BALANCE_QUANTILE && c->estimator == LM_QB_EXACT
                     ? (size_t)(c->max_step_tokens ? c->max_step_tokens : c->max_tokens)
                     : 0;
    size_t mt = (size_t)c->max_tokens;
    struct { void **ptr; size_t bytes; } t[] = {
        {(void **)&s->bias, n * 4},          {(void **)&s->reduce, (n * B + n) * 4},
        {(void **)&s->halfwidth, n * 4},     {(void **)&s->residuals, n * cap * 4},
        {(void **)&s->alpha, mt * 4},        {(void **)&s->bin_lo, n * 4},
        {(void **)&s->bin_width, n * 4},     {(void **)&s->last_load, n * 4},
        {(void **)&s->interval_load, n * 8}, {(void **)&s->scratch_topk, mt * k * 4},
    };
    size_t count = sizeof t / sizeof t[0], total = 0;
    for (size_t i = 0; i < count; i++) total += (t[i].bytes + 63) / 64 * 64;
    char *block;
    LM_TRY_ALLOC(block, total);
    memset(block, 0, total);
    size_t off = 0;
    for (size_t i = 0; i < count; i++) {
        *t[i].ptr = t[i].bytes ? block + off : NULL;
        off += (t[i].bytes + 63) / 64 * 64;
    }
    s->block = block;
    s->cfg = *c;
    s->counts = s->reduce;
    s->load = s->reduce + n * B;
    /* zoom windows start as wide as the K3 range around b = 0 */
    for (size_t j = 0; j < n; j++) s->halfwidth[j] = 1.0f;
    return LM_OK;
}

void lm_balance_free(lm_balance_state *s) {
    free(s->block);
    memset(s, 0, sizeof *s);
}

int32_t *lm_balance_reduce_buffer(lm_balance_state *s, size_t *count) {
    size_t B = uses_histogram(&s->cfg) ? (size_t)s->cfg.bins : 0;
    if (count) *count = (size_t)s->cfg.n_experts * B + (size_t)s->cfg.n_experts;
    return s->reduce;
}

static void bias_range(const float *b, int n, float *lo, float *hi) {
    float a = b[0], z = b[0];
    for (int j = 1; j < n; j++) {
        a = b[j] < a ? b[j] : a;
        z = b[j] > z ? b[j] : z;
    }
    *lo = a;
    *hi = z;
}

/* The bin geometry of this step, fixed by b before the first micro-batch. */
static void set_bins(lm_balance_state *s) {
    int n = s->cfg.n_experts, B = s->cfg.bins;
    float bmin, bmax;
    bias_range(s->bias, n, &bmin, &bmax);
    for (int j = 0; j < n; j++) {
        if (s->cfg.estimator == LM_QB_ZOOM) {
            /* bins 1..B-2 cover [b_j - w_j, b_j + w_j); bins 0 and B-1 are the tails */
            s->bin_lo[j] = s->bias[j] - s->halfwidth[j];
            s->bin_width[j] = 2.0f * s->halfwidth[j] / (float)(B - 2);
        } else {
            /* SPEC §4 step 4: B uniform bins over [min b - 1, max b + 1] */
            s->bin_lo[j] = bmin - 1.0f;
            s->bin_width[j] = (bmax - bmin + 2.0f) / (float)B;
        }
    }
}

lm_status lm_balance_observe(lm_balance_state *s, const float *sc, int64_t m, int training) {
    // sc is (m,n) router scores of one micro-batch
    const lm_balance_config *c = &s->cfg;
    int n = c->n_experts, k = c->top_k, B = c->bins;
    if (m < 0 || m > c->max_tokens)
        return lm_error(LM_ERR_ARG, "balance: micro-batch of %lld tokens exceeds max_tokens %lld",
                        (long long)m, (long long)c->max_tokens);
    if (s->tokens + m > INT32_MAX / k)
        return lm_error(LM_ERR_ARG, "balance: %lld tokens in one step overflow the int32 counts",
                        (long long)(s->tokens + m));
    int quantile = training && c->mode == LM_BALANCE_QUANTILE;
    int exact = quantile && c->estimator == LM_QB_EXACT;
    int64_t cap = c->max_step_tokens ? c->max_step_tokens : c->max_tokens;
    if (exact && s->n_residuals + m > cap)
        return lm_error(LM_ERR_ARG, "balance: exact estimator holds %lld tokens per step, got %lld",
                        (long long)cap, (long long)(s->n_residuals + m));
    if (m == 0) return LM_OK;
    /* the bins are a function of b and the windows, fixed for the whole step */
    if (quantile && !exact) set_bins(s);

    /* 1. route with the old b; 2. alpha_i = (k+1)-th largest s_i + b */
    int kk = k < n ? k + 1 : k;
    const float *b = s->bias;
    int64_t bad = -1;
    double ent = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : ent)
    for (int64_t i = 0; i < m; i++) {
        const float *si = sc + i * n;
        int32_t idx[LM_MOE_MAX_TOPK + 1];
        float val[LM_MOE_MAX_TOPK + 1];
        float sum = 0.0f, slog = 0.0f;
        int ok = 1;
        for (int j = 0; j < n; j++) {
            float v = si[j];
            ok &= v >= 0.0f && v <= 1.0f; /* sigmoid may underflow to 0 */
            sum += v;
            slog += v > 0.0f ? v * logf(v) : 0.0f;
        }
        if (!ok) {
#pragma omp critical(lm_balance_bad)
            if (bad < 0 || i < bad) bad = i;
            continue;
        }
        /* entropy of pi = s / sum s: log S - sum s log s / S */
        if (sum > 0.0f) ent += (double)(logf(sum) - slog / sum);
        lm_topk_row(idx, val, si, b, n, kk);
        memcpy(s->scratch_topk + i * k, idx, (size_t)k * sizeof *idx);
        s->alpha[i] = kk > k ? val[k] : -INFINITY;
    }
    if (bad >= 0)
        return lm_error(LM_ERR_NUMERIC, "balance: token %lld has a score outside [0, 1] or not finite",
                        (long long)bad);
    for (int64_t g = 0; g < m * k; g++) s->load[s->scratch_topk[g]]++;
    s->entropy_sum += ent;

    if (quantile) {
        /* 3. r_ij = alpha_i - s_ij; expert j wins token i exactly when b_j > r_ij */
        int nblocks = (n + EXPERT_BLOCK - 1) / EXPERT_BLOCK;
        int zoom = c->estimator == LM_QB_ZOOM;
        int64_t base = s->n_residuals;
#pragma omp parallel for schedule(dynamic, 1)
        for (int blk = 0; blk < nblocks; blk++) {
            int j0 = blk * EXPERT_BLOCK, j1 = j0 + EXPERT_BLOCK < n ? j0 + EXPERT_BLOCK : n;
            float lo[EXPERT_BLOCK], inv[EXPERT_BLOCK];
            if (!exact)
                for (int j = j0; j < j1; j++) {
                    lo[j - j0] = s->bin_lo[j];
                    inv[j - j0] = 1.0f / s->bin_width[j];
                }
            for (int64_t i = 0; i < m; i++) {
                float a = s->alpha[i];
                const float *si = sc + i * n;
                if (exact) {
                    for (int j = j0; j < j1; j++) s->residuals[(int64_t)j * cap + base + i] = a - si[j];
                    continue;
                }
                for (int j = j0; j < j1; j++) {
                    float x = (a - si[j] - lo[j - j0]) * inv[j - j0];
                    int bin;
                    if (zoom) {
                        /* interior bins 1..B-2; below the window 0, above it B-1 */
                        bin = x < 0.0f ? 0 : x >= (float)(B - 2) ? B - 1 : 1 + (int)x;
                    } else {
                        bin = x < 0.0f ? 0 : x >= (float)B ? B - 1 : (int)x;
                    }
                    s->counts[(int64_t)j * B + bin]++;
                }
            }
        }
        if (exact) s->n_residuals += m;
    }
    s->tokens += m;
    return LM_OK;
}

lm_status lm_balance_bin_geometry(lm_balance_state *s, float *lo, float *width) {
    if (!uses_histogram(&s->cfg))
        return lm_error(LM_ERR_ARG, "balance: bin geometry needs quantile mode with the histogram or zoom estimator");
    set_bins(s);
    memcpy(lo, s->bin_lo, (size_t)s->cfg.n_experts * sizeof *lo);
    memcpy(width, s->bin_width, (size_t)s->cfg.n_experts * sizeof *width);
    return LM_OK;
}

lm_status lm_balance_observe_counts(lm_balance_state *s, const int32_t *counts, const int32_t *load, int64_t m,
                                    int training, double entropy_sum) {
    // counts is (n,B) or NULL; load (n); m the tokens of one or more micro-batches
    const lm_balance_config *c = &s->cfg;
    int n = c->n_experts, k = c->top_k;
    if (m < 0) return lm_error(LM_ERR_ARG, "balance: %lld tokens observed", (long long)m);
    if (s->tokens + m > INT32_MAX / k)
        return lm_error(LM_ERR_ARG, "balance: %lld tokens in one step overflow the int32 counts",
                        (long long)(s->tokens + m));
    int histogram = training && uses_histogram(c);
    if (training && c->mode == LM_BALANCE_QUANTILE && !histogram)
        return lm_error(LM_ERR_ARG, "balance: the exact estimator cannot take counts made elsewhere");
    if (histogram != (counts != NULL))
        return lm_error(LM_ERR_ARG, "balance: counts must be given exactly when training with a histogram estimator");
    if (!load) return lm_error(LM_ERR_ARG, "balance: load must not be NULL");
    int64_t sum = 0;
    for (int j = 0; j < n; j++) {
        if (load[j] < 0) return lm_error(LM_ERR_ARG, "balance: load[%d] = %d is negative", j, load[j]);
        sum += load[j];
    }
    if (sum != m * k)
        return lm_error(LM_ERR_ARG, "balance: loads sum to %lld, expected m k = %lld", (long long)sum,
                        (long long)(m * k));
    for (int j = 0; j < n; j++) s->load[j] += load[j];
    if (histogram) {
        size_t nb = (size_t)n * (size_t)c->bins;
        for (size_t q = 0; q < nb; q++) s->counts[q] += counts[q];
    }
    s->entropy_sum += entropy_sum;
    s->tokens += m;
    return LM_OK;
}

double lm_qb_histogram_quantile(const int32_t *counts, int bins, double lo, double width, double q) {
    /* SPEC §4 step 4: first bin l with cumulative count >= ceil(q), h its count,
     * c' the count before it: b = lo + (l + clip((q - c') / h, 0, 1)) w */
    double target = ceil(q);
    int64_t cum = 0;
    for (int l = 0; l < bins; l++) {
        int64_t h = counts[l];
        if ((double)(cum + h) >= target && h > 0) {
            double frac = (q - (double)cum) / (double)h;
            frac = frac < 0.0 ? 0.0 : frac > 1.0 ? 1.0 : frac;
            return lo + ((double)l + frac) * width;
        }
        cum += h;
    }
    return cum > 0 ? lo + (double)bins * width : lo;
}

/* Zoom estimator for expert j: the K3 interpolation on the interior bins,
 * clamped to the window (and the window grown) when the quantile is in a tail. */
static float zoom_quantile(lm_balance_state *s, int j, double q, float hw_max) {
    int B = s->cfg.bins;
    const int32_t *cj = s->counts + (int64_t)j * B;
    double target = ceil(q), lo = s->bin_lo[j], w = s->bin_width[j];
    float hw = s->halfwidth[j];
    int64_t cum = cj[0];
    if ((double)cum >= target) {
        s->halfwidth[j] = fminf(hw * ZOOM_GROW, hw_max);
        return (float)lo;
    }
    for (int l = 1; l < B - 1; l++) {
        int64_t h = cj[l];
        if ((double)(cum + h) >= target && h > 0) {
            double frac = (q - (double)cum) / (double)h;
            frac = frac < 0.0 ? 0.0 : frac > 1.0 ? 1.0 : frac;
            float bnew = (float)(lo + ((double)(l - 1) + frac) * w);
            /* next window: a margin over this move, shrinking at most 4x a step */
            float want = fmaxf(ZOOM_MARGIN * fabsf(bnew - s->bias[j]), hw / ZOOM_GROW);
            s->halfwidth[j] = fminf(fmaxf(want, ZOOM_MIN_HALFWIDTH), hw_max);
            return bnew;
        }
        cum += h;
    }
    s->halfwidth[j] = fminf(hw * ZOOM_GROW, hw_max);
    return (float)(lo + (double)(B - 2) * w);
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Quickselect: afterwards v[c] holds the c-th smallest (0-based), v[<c] <= v[c] <= v[>c]. */
static void select_nth(float *v, int64_t len, int64_t c) {
    int64_t lo = 0, hi = len - 1;
    while (hi - lo > 16) {
        int64_t mid = lo + (hi - lo) / 2;
        /* median of three as the pivot */
        float a = v[lo], b = v[mid], d = v[hi];
        float piv = a < b ? (b < d ? b : (a < d ? d : a)) : (a < d ? a : (b < d ? d : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < piv) i++;
            while (v[j] > piv) j--;
            if (i <= j) {
                float t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        }
        if (c <= j) hi = j;
        else if (c >= i) lo = i;
        else return;
    }
    qsort(v + lo, (size_t)(hi - lo + 1), sizeof *v, cmp_float);
}

/* Exact k/n quantile of expert j's residuals: halfway between the ceil(q)-th
 * smallest r and the next, so exactly ceil(q) residuals lie below it. */
static float exact_quantile(float *r, int64_t len, double q) {
    int64_t c = (int64_t)ceil(q);
    if (c < 1) c = 1;
    if (c > len) c = len;
    select_nth(r, len, c - 1);
    float below = r[c - 1];
    if (c == len) return below + fmaxf(fabsf(below) * FLT_EPSILON, FLT_MIN);
    float above = r[c];
    for (int64_t i = c + 1; i < len; i++) above = r[i] < above ? r[i] : above;
    return 0.5f * (below + above);
}

void lm_balance_load_stats(const int32_t *load, int n, double *maxvio, double *cv, int32_t *min_load,
                           int32_t *max_load, int *dead) {
    double sum = 0.0, sq = 0.0;
    int32_t lo = load[0], hi = load[0];
    int zero = 0;
    for (int j = 0; j < n; j++) {
        sum += load[j];
        sq += (double)load[j] * load[j];
        lo = load[j] < lo ? load[j] : lo;
        hi = load[j] > hi ? load[j] : hi;
        zero += load[j] == 0;
    }
    double mean = sum / n;
    double var = sq / n - mean * mean;
    if (maxvio) *maxvio = mean > 0 ? hi / mean - 1.0 : 0.0;
    if (cv) *cv = mean > 0 ? sqrt(var > 0 ? var : 0) / mean : 0.0;
    if (min_load) *min_load = lo;
    if (max_load) *max_load = hi;
    if (dead) *dead = zero;
}

lm_status lm_balance_step_end(lm_balance_state *s, int training, lm_balance_stats *stats) {
    const lm_balance_config *c = &s->cfg;
    int n = c->n_experts, k = c->top_k, B = c->bins;
    int64_t total_load = 0;
    for (int j = 0; j < n; j++) total_load += s->load[j];
    /* tokens of the (possibly all-reduced) step: each token adds k to the loads */
    int64_t tokens = total_load / k;
    int updated = 0;
    if (training && tokens > 0 && c->mode == LM_BALANCE_QUANTILE) {
        float bmin, bmax;
        bias_range(s->bias, n, &bmin, &bmax);
        float hw_max = 1.0f + (bmax - bmin);
        /* the bins are a function of b, unchanged since the step began */
        if (c->estimator != LM_QB_EXACT) set_bins(s);
        double sum = 0.0;
        /* 4. per expert, the k/n quantile of r_{:,j}: target q = m k / n tokens below b_j */
        /* every expert's histogram counts every training token: one row total tells */
        int64_t seen = 0;
        if (c->estimator == LM_QB_EXACT) seen = s->n_residuals;
        else
            for (int l = 0; l < B; l++) seen += s->counts[l];
        int ok = seen > 0;
        int64_t cap = c->max_step_tokens ? c->max_step_tokens : c->max_tokens;
        double q = (double)seen * k / n;
#pragma omp parallel for schedule(dynamic, 8) if (ok)
        for (int j = 0; j < n; j++) {
            if (!ok) continue;
            float v;
            if (c->estimator == LM_QB_EXACT)
                v = exact_quantile(s->residuals + (int64_t)j * cap, seen, q);
            else if (c->estimator == LM_QB_ZOOM)
                v = zoom_quantile(s, j, q, hw_max);
            else
                v = (float)lm_qb_histogram_quantile(s->counts + (int64_t)j * B, B, s->bin_lo[j],
                                                    s->bin_width[j], q);
            /* bin_lo is free once expert j's estimate is taken: keep the new b there */
            s->bin_lo[j] = v;
        }
        if (ok) {
            for (int j = 0; j < n; j++) {
                /* optional EMA across steps */
                float v = c->ema > 0.0f ? c->ema * s->bias[j] + (1.0f - c->ema) * s->bin_lo[j] : s->bin_lo[j];
                s->bin_lo[j] = v;
                sum += v;
            }
            /* 5. centre: b <- b - mean(b) (routing is invariant to a common shift) */
            float mean = (float)(sum / n);
            for (int j = 0; j < n; j++) s->bias[j] = s->bin_lo[j] - mean;
            updated = 1;
        }
    } else if (training && tokens > 0 && c->mode == LM_BALANCE_SIGN) {
        /* loss-free balancing [LFB]: b_j += u sign(mean load - load_j) */
        double mean = (double)total_load / n;
        for (int j = 0; j < n; j++) {
            double e = mean - s->load[j];
            s->bias[j] += e > 0 ? c->sign_rate : e < 0 ? -c->sign_rate : 0.0f;
        }
        updated = 1;
    }

    s->step++;
    memcpy(s->last_load, s->load, (size_t)n * sizeof *s->load);
    if (training)
        for (int j = 0; j < n; j++) s->interval_load[j] += s->load[j];
    if (stats) {
        memset(stats, 0, sizeof *stats);
        stats->step = s->step;
        stats->tokens = tokens;
        stats->load = s->last_load;
        lm_balance_load_stats(s->last_load, n, &stats->maxvio_batch, &stats->cv, &stats->min_load,
                              &stats->max_load, &stats->dead);
        /* MaxVio_global: the same ratio over the loads summed over the interval */
        double isum = 0.0, imax = 0.0;
        for (int j = 0; j < n; j++) {
            isum += (double)s->interval_load[j];
            imax = (double)s->interval_load[j] > imax ? (double)s->interval_load[j] : imax;
        }
        stats->maxvio_global = isum > 0 ? imax / (isum / n) - 1.0 : stats->maxvio_batch;
        stats->router_entropy = s->tokens > 0 ? s->entropy_sum / (double)s->tokens : 0.0;
        float bmin, bmax;
        bias_range(s->bias, n, &bmin, &bmax);
        stats->bias_min = bmin;
        stats->bias_max = bmax;
        stats->updated = updated;
    }
    if (training && ++s->interval_steps >= c->interval) {
        s->interval_steps = 0;
        memset(s->interval_load, 0, (size_t)n * sizeof *s->interval_load);
    }
    size_t count;
    lm_balance_reduce_buffer(s, &count);
    memset(s->reduce, 0, count * sizeof *s->reduce);
    s->tokens = 0;
    s->n_residuals = 0;
    s->entropy_sum = 0.0;
    return LM_OK;
}

lm_status lm_balance_aux_loss(float *loss, float *dscores, const float *s, const int32_t *topk, int64_t m,
                              int n, int k, float alpha) {
    // s is (m,n), topk (m,k), dscores (m,n) +=
    if (m < 1 || n < 2 || k < 1 || k > n)
        return lm_error(LM_ERR_ARG, "aux loss: need m >= 1, n >= 2, 1 <= k <= n; got m %lld n %d k %d",
                        (long long)m, n, k);
    double *f = calloc((size_t)n * 2, sizeof *f);
    if (!f) return lm_error(LM_ERR_MEMORY, "aux loss: out of memory for %d experts", n);
    double *P = f + n;
    for (int64_t g = 0; g < m * k; g++) {
        int j = topk[g];
        if (j < 0 || j >= n) {
            free(f);
            return lm_error(LM_ERR_ARG, "aux loss: topk[%lld] = %d is not an expert index in [0, %d)",
                            (long long)g, j, n);
        }
        f[j] += 1.0;
    }
    /* f_j = fraction of routed tokens, P_j = mean normalised score */
    for (int j = 0; j < n; j++) f[j] /= (double)m * k;
#pragma omp parallel for schedule(static) reduction(+ : P[:n])
    for (int64_t i = 0; i < m; i++) {
        const float *si = s + i * n;
        double S = 0.0;
        for (int j = 0; j < n; j++) S += si[j];
        if (S > 0.0)
            for (int j = 0; j < n; j++) P[j] += si[j] / S;
    }
    double L = 0.0;
    for (int j = 0; j < n; j++) L += f[j] * P[j] / (double)m;
    L *= (double)alpha * n;
    if (loss) *loss = (float)L;
    if (dscores) {
        /* dL/ds_il = alpha n / m * (f_l - sum_j f_j pi_ij) / S_i */
        double scale = (double)alpha * n / (double)m;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            const float *si = s + i * n;
            double S = 0.0, fp = 0.0;
            for (int j = 0; j < n; j++) S += si[j];
            if (!(S > 0.0)) continue;
            for (int j = 0; j < n; j++) fp += f[j] * si[j] / S;
            for (int j = 0; j < n; j++) dscores[i * n + j] += (float)(scale * (f[j] - fp) / S);
        }
    }
    free(f);
    return LM_OK;
}
