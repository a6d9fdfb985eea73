/* Group-relative advantages and the clipped token-level objective (SPEC §10,
 * include/longmoe/rl.h, docs/rl.md). */
#include <math.h>
#include <string.h>

#include "longmoe/rl.h"

lm_status lm_rl_normalise(const float *values, int n, float eps, float *out) {
    if (!values || !out || n < 1) return lm_error(LM_ERR_ARG, "lm_rl_normalise: NULL array or n = %d < 1", n);
    if (!(eps >= 0)) return lm_error(LM_ERR_ARG, "lm_rl_normalise: eps %g must be >= 0", (double)eps);
    double mean = 0, var = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(values[i])) return lm_error(LM_ERR_ARG, "lm_rl_normalise: value %d is not finite", i);
        mean += values[i];
    }
    mean /= n;
    for (int i = 0; i < n; i++) var += (values[i] - mean) * (values[i] - mean);
    double sd = sqrt(var / n);
    for (int i = 0; i < n; i++) {
        double c = values[i] - mean;
        /* all equal (up to rounding): no preference within the group */
        out[i] = sd <= 1e-12 * (fabs(mean) + 1) ? 0.0f : (float)(c / (sd + eps));
    }
    return LM_OK;
}

lm_status lm_grpo_advantages(const float *rewards, int n_groups, int G, float eps, float *adv) {
    if (n_groups < 1 || G < 1) return lm_error(LM_ERR_ARG, "lm_grpo_advantages: n_groups %d, G %d must be >= 1", n_groups, G);
    for (int g = 0; g < n_groups; g++) {
        lm_status st = lm_rl_normalise(rewards ? rewards + (size_t)g * G : NULL, G, eps, adv ? adv + (size_t)g * G : NULL);
        if (st) return st;
    }
    return LM_OK;
}

lm_status lm_rl_turn_returns(const float *turn_rewards, int n, float gamma, float *returns) {
    if (!turn_rewards || !returns || n < 0) return lm_error(LM_ERR_ARG, "lm_rl_turn_returns: NULL array or n < 0");
    if (!(gamma >= 0 && gamma <= 1)) return lm_error(LM_ERR_ARG, "lm_rl_turn_returns: gamma %g outside [0, 1]", (double)gamma);
    double acc = 0;
    for (int k = n - 1; k >= 0; k--) {
        acc = turn_rewards[k] + (double)gamma * acc;
        returns[k] = (float)acc;
    }
    return LM_OK;
}

lm_status lm_grpo_loss(const lm_grpo_config *cfg, const float *logp, const float *logp_old, const float *logp_ref,
                       const float *adv, const uint8_t *mask, int64_t N, float *dlogp, lm_grpo_stats *stats) {
    if (!cfg || !logp || !logp_old || !adv || !mask || !dlogp || N < 1)
        return lm_error(LM_ERR_ARG, "lm_grpo_loss: NULL array or N = %lld < 1", (long long)N);
    if (!(cfg->clip_low >= 0 && cfg->clip_low < 1 && cfg->clip_high >= 0))
        return lm_error(LM_ERR_ARG, "lm_grpo_loss: clip_low %g must be in [0, 1), clip_high %g >= 0",
                        (double)cfg->clip_low, (double)cfg->clip_high);
    if (!(cfg->kl_coef >= 0)) return lm_error(LM_ERR_ARG, "lm_grpo_loss: kl_coef %g must be >= 0", (double)cfg->kl_coef);
    if (cfg->kl_coef > 0 && !logp_ref) return lm_error(LM_ERR_ARG, "lm_grpo_loss: kl_coef > 0 needs logp_ref");
    int64_t n = 0;
    for (int64_t t = 0; t < N; t++) n += mask[t] != 0;
    memset(dlogp, 0, (size_t)N * sizeof(float));
    lm_grpo_stats s = {0};
    s.n_tokens = n;
    if (n == 0) {
        if (stats) *stats = s;
        return LM_OK;
    }
    const double inv = 1.0 / (double)n, lo = 1.0 - cfg->clip_low, hi = 1.0 + cfg->clip_high, beta = cfg->kl_coef;
    double loss = 0, kl_ref = 0, kl_old = 0, clipped = 0, ent = 0, ratio = 0;
    for (int64_t t = 0; t < N; t++) {
        if (!mask[t]) continue;
        double lp = logp[t], lo_old = logp_old[t], A = adv[t];
        if (!isfinite(lp) || !isfinite(lo_old) || !isfinite(A))
            return lm_error(LM_ERR_NUMERIC, "lm_grpo_loss: non-finite input at token %lld", (long long)t);
        double rho = exp(lp - lo_old);
        double rc = rho < lo ? lo : rho > hi ? hi : rho;
        double unclipped = rho * A, clip_term = rc * A;
        /* min(rho A, clip(rho) A): the clipped branch is constant in logp */
        int is_clipped = clip_term < unclipped;
        double surrogate = is_clipped ? clip_term : unclipped;
        double g = is_clipped ? 0.0 : -unclipped; /* d(-surrogate)/dlogp = -rho A */
        double term = -surrogate;
        if (beta > 0) {
            double lr = (double)logp_ref[t] - lp;
            double rr = exp(lr);
            double kl = rr - lr - 1.0;
            term += beta * kl;
            g += beta * (1.0 - rr); /* dKL/dlogp: d(rho_ref - log rho_ref)/dlogp = -rho_ref + 1 */
            kl_ref += kl;
        }
        loss += term;
        dlogp[t] = (float)(g * inv);
        double lo2 = lo_old - lp;
        kl_old += exp(lo2) - lo2 - 1.0;
        clipped += is_clipped;
        ent -= lo_old;
        ratio += rho;
    }
    s.loss = loss * inv;
    s.kl_ref = kl_ref * inv;
    s.kl_old = kl_old * inv;
    s.clipped_frac = clipped * inv;
    s.entropy = ent * inv;
    s.ratio_mean = ratio * inv;
    if (stats) *stats = s;
    return LM_OK;
}
