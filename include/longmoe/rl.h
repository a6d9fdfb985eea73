/* The RL objective (SPEC §10, docs/rl.md): group-relative advantages, the
 * clipped token-level policy loss with an optional KL to a frozen reference,
 * and its gradient with respect to each token's log-probability, which
 * lm_model_backward_weighted takes through the model.
 *
 * Token arrays are [N] over the positions of a batch of trajectories; mask[t]
 * = 1 marks the tokens the model wrote (they carry loss), 0 the prompt,
 * observations and padding (context: zero gradient). Sums over tokens run in
 * index order in float64 (deterministic). */
#ifndef LONGMOE_RL_H
#define LONGMOE_RL_H

#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How rewards become advantages over a long trajectory. */
typedef enum {
    LM_CREDIT_OUTCOME = 0, /* every model token of trajectory i gets A_i from its outcome reward */
    LM_CREDIT_TURN         /* the tokens of turn k get the normalised discounted return from turn k */
} lm_rl_credit;

/* A_i = (r_i - mean r) / (std r + eps) within each group of G samples of one
 * task (std the population standard deviation); rewards, adv [n_groups, G].
 * A group whose rewards are all equal gets A = 0 (no signal). */
lm_status lm_grpo_advantages(const float *rewards, int n_groups, int G, float eps, float *adv);

/* Discounted returns over turns: R_k = sum_{j >= k} gamma^{j-k} r_j for
 * turn_rewards, returns [n]; 0 <= gamma <= 1. */
lm_status lm_rl_turn_returns(const float *turn_rewards, int n, float gamma, float *returns);

/* Normalise the per-turn returns of one group: values [n] (all turns of the
 * group's G trajectories, pooled) -> (v - mean) / (std + eps). */
lm_status lm_rl_normalise(const float *values, int n, float eps, float *out);

typedef struct {
    float clip_low, clip_high; /* the ratio is clipped to [1 - clip_low, 1 + clip_high] */
    float kl_coef;             /* beta: weight of the KL to the reference (0: none; logp_ref may be NULL) */
} lm_grpo_config;

typedef struct {
    double loss;         /* the objective below */
    double kl_ref;       /* mean KL_t to the reference over model tokens (0 without one) */
    double kl_old;       /* mean k3 estimate of KL(pi_old || pi_theta): rho' - log rho' - 1, rho' = pi_old / pi_theta */
    double clipped_frac; /* fraction of model tokens whose ratio was clipped (zero policy gradient) */
    double entropy;      /* mean -log pi_old(y_t) over model tokens: the sampling policy's entropy estimate */
    double ratio_mean;   /* mean rho_t */
    int64_t n_tokens;    /* model tokens */
} lm_grpo_stats;

/* The token-level clipped objective (DAPO normalisation):
 *   L = (1 / n) sum_{t: mask} [ -min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t) + beta KL_t ]
 *   rho_t = exp(logp_t - logp_old_t),  KL_t = rho_ref - log rho_ref - 1,  rho_ref = exp(logp_ref_t - logp_t)
 * with n the number of model tokens. logp (current policy), logp_old (the
 * sampling policy), logp_ref (the reference; may be NULL when beta = 0), adv
 * (each token's advantage) and mask are [N]; dlogp [N] receives dL/dlogp_t
 * (exactly 0 where mask = 0). stats may be NULL. N >= 1; with no model token
 * L = 0 and dlogp = 0. */
lm_status lm_grpo_loss(const lm_grpo_config *cfg, const float *logp, const float *logp_old, const float *logp_ref,
                       const float *adv, const uint8_t *mask, int64_t N, float *dlogp, lm_grpo_stats *stats);

#ifdef __cplusplus
}
#endif
#endif
