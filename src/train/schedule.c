/* Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay or
 * constant (include/longmoe/optim.h; docs/optim.md). Pure functions of the
 * 0-based step; computed in double, returned as float. */
#include <math.h>
#include <string.h>

#include "longmoe/optim.h"

#define LM_PI 3.14159265358979323846

lm_lr_schedule lm_lr_schedule_default(float peak_lr) {
    lm_lr_schedule s;
    s.kind = LM_LR_COSINE;
    s.peak_lr = peak_lr;
    s.warmup_frac = 0.01f; /* 1% warmup [K3] */
    s.min_lr_ratio = 0.1f;
    s.decay_frac = 0.2f;
    return s;
}

static const char *const schedule_names[] = {"cosine", "wsd", "constant"};

const char *lm_lr_schedule_name(lm_lr_schedule_kind k) {
    return (int)k >= 0 && k <= LM_LR_CONSTANT ? schedule_names[k] : "unknown";
}

int lm_lr_schedule_from_name(const char *name, lm_lr_schedule_kind *out) {
    if (!name) return -1;
    for (int k = 0; k <= LM_LR_CONSTANT; k++)
        if (strcmp(name, schedule_names[k]) == 0) {
            if (out) *out = (lm_lr_schedule_kind)k;
            return 0;
        }
    return -1;
}

lm_status lm_lr_schedule_check(const lm_lr_schedule *s) {
    if (!s) return lm_error(LM_ERR_ARG, "lr schedule is NULL");
    if ((int)s->kind < 0 || s->kind > LM_LR_CONSTANT)
        return lm_error(LM_ERR_ARG, "lr schedule kind %d unknown (cosine, wsd, constant)",
                        (int)s->kind);
    if (!(s->peak_lr > 0.0f) || !isfinite(s->peak_lr))
        return lm_error(LM_ERR_ARG, "peak lr %g must be finite and > 0", (double)s->peak_lr);
    if (!(s->warmup_frac >= 0.0f && s->warmup_frac < 1.0f))
        return lm_error(LM_ERR_ARG, "warmup fraction %g must be in [0, 1)",
                        (double)s->warmup_frac);
    if (!(s->min_lr_ratio >= 0.0f && s->min_lr_ratio <= 1.0f))
        return lm_error(LM_ERR_ARG, "min lr ratio %g must be in [0, 1]", (double)s->min_lr_ratio);
    if (s->kind == LM_LR_WSD) {
        if (!(s->decay_frac > 0.0f && s->decay_frac <= 1.0f))
            return lm_error(LM_ERR_ARG, "WSD decay fraction %g must be in (0, 1]",
                            (double)s->decay_frac);
        if ((double)s->warmup_frac + (double)s->decay_frac > 1.0 + 1e-6)
            return lm_error(LM_ERR_ARG, "WSD warmup fraction %g + decay fraction %g exceed 1",
                            (double)s->warmup_frac, (double)s->decay_frac);
    }
    return LM_OK;
}

/* ceil(frac * total), where a product within 1e-6 (relative) of an integer counts
 * as that integer: 0.3f * 10 is 3.0000001 in binary and means 3 steps. */
static int64_t frac_steps(int64_t total, float frac) {
    double x = (double)frac * (double)total;
    double r = nearbyint(x);
    if (fabs(x - r) <= 1e-6 * (r > 1.0 ? r : 1.0)) return (int64_t)r;
    return (int64_t)ceil(x);
}

int64_t lm_lr_warmup_steps(int64_t total_steps, float warmup_frac) {
    if (total_steps < 1 || !(warmup_frac > 0.0f)) return 0;
    int64_t w = frac_steps(total_steps, warmup_frac);
    return w < total_steps ? w : total_steps;
}

/* Linear warmup: peak * (step+1) / W, so the first step does not get lr 0. */
static double warmup_lr(int64_t step, int64_t w, double peak) {
    return peak * (double)(step + 1) / (double)w;
}

float lm_lr_cosine(int64_t step, int64_t total_steps, float peak_lr, float warmup_frac,
                   float min_lr_ratio) {
    double peak = peak_lr, lo = (double)min_lr_ratio * peak;
    if (step < 0) step = 0;
    if (total_steps < 1 || step >= total_steps) return (float)lo;
    int64_t w = lm_lr_warmup_steps(total_steps, warmup_frac);
    if (step < w) return (float)warmup_lr(step, w, peak);
    // cosine from peak at step W to the minimum at the last step, total-1
    int64_t span = total_steps - 1 - w;
    double p = span > 0 ? (double)(step - w) / (double)span : 1.0;
    return (float)(lo + (peak - lo) * 0.5 * (1.0 + cos(LM_PI * p)));
}

float lm_lr_wsd(int64_t step, int64_t total_steps, float peak_lr, float warmup_frac,
                float decay_frac, float min_lr_ratio) {
    double peak = peak_lr, lo = (double)min_lr_ratio * peak;
    if (step < 0) step = 0;
    if (total_steps < 1 || step >= total_steps) return (float)lo;
    int64_t w = lm_lr_warmup_steps(total_steps, warmup_frac);
    if (step < w) return (float)warmup_lr(step, w, peak);
    int64_t d = decay_frac > 0.0f ? frac_steps(total_steps, decay_frac) : 0;
    if (d > total_steps) d = total_steps;
    int64_t start = total_steps - d;
    if (step < start) return (float)peak;
    // linear decay from peak at `start` to the minimum at the last step
    double p = d > 1 ? (double)(step - start) / (double)(d - 1) : 1.0;
    return (float)(peak + (lo - peak) * p);
}

float lm_lr_at(const lm_lr_schedule *s, int64_t step, int64_t total_steps) {
    switch (s->kind) {
    case LM_LR_WSD:
        return lm_lr_wsd(step, total_steps, s->peak_lr, s->warmup_frac, s->decay_frac,
                         s->min_lr_ratio);
    case LM_LR_CONSTANT: {
        int64_t w = lm_lr_warmup_steps(total_steps, s->warmup_frac);
        if (step < 0) step = 0;
        return step < w ? (float)warmup_lr(step, w, s->peak_lr) : s->peak_lr;
    }
    case LM_LR_COSINE:
    default:
        return lm_lr_cosine(step, total_steps, s->peak_lr, s->warmup_frac, s->min_lr_ratio);
    }
}
