/* Batched rollouts of the tool-use environments through the decoder (SPEC
 * §10, docs/rl.md).
 *
 * B episodes run in lockstep, one token each per decoder step: a sequence
 * either feeds its next forced byte (the prompt, an observation: context,
 * mask 0) or samples a byte from the model (temperature, top-p; mask 1). A
 * '\n' ends a model line and hands it to lm_env_step; the observation is
 * queued as forced bytes and stepped in with the recurrent KDA state and the
 * MLA latent cache, so no prefix is ever recomputed. A line that reaches
 * LM_ENV_MAX_LINE + 1 bytes without '\n' is cut: a forced '\n', then the
 * environment's "E:too long". An episode that would outgrow max_len tokens
 * ends there, unsolved (truncated).
 *
 * The prompts' common length goes through the chunked prefill; the rest is
 * stepped. Everything is a pure function of the model, the episodes' (kind,
 * difficulty, seed) and sample_seed: sequence b draws from its own generator
 * seeded from (sample_seed, b). */
#ifndef LONGMOE_RL_ROLLOUT_H
#define LONGMOE_RL_ROLLOUT_H

#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/model.h"
#include "longmoe/rl_env.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature; /* 0: greedy */
    float top_p;       /* (0, 1] */
} lm_rollout_config;

/* The rollout buffers and their results; arrays are [B, max_len] row-major
 * unless said otherwise. Turn k is the k-th model line (0-based). */
typedef struct lm_rollout_work lm_rollout_work;
typedef struct {
    int B, max_len;
    int32_t *tokens;    /* the trajectory's bytes */
    uint8_t *mask;      /* 1: the model wrote it (carries loss); 0: prompt, observation, padding */
    float *logp;        /* log pi(token) of the sampling model (softmax of its logits at temperature 1,
                           without the top-p cut); 0 at forced positions */
    int16_t *turn;      /* the turn a model token belongs to; -1 for forced bytes and padding */
    float *turn_reward; /* [B, max_len]: reward of turn k at [b, k] (k < n_turns[b]) */
    int *len;           /* [B] tokens of the trajectory */
    int *n_turns;       /* [B] model lines answered by the environment */
    int *success;       /* [B] the answer was correct */
    int *malformed;     /* [B] model lines answered with a malformed-call error */
    int *truncated;     /* [B] the episode hit max_len before it ended */
    lm_env *env;        /* [B] the episodes' final states */
    lm_rollout_work *work;
} lm_rollout;

/* Buffers and a decoder for B sequences of at most max_len tokens of model m
 * (it borrows m's parameters: rollouts after an update use the new ones). */
lm_status lm_rollout_create(lm_model *m, int B, int max_len, lm_rollout **out);
void lm_rollout_free(lm_rollout *r);

/* Run B episodes: envs[b] and seeds[b] describe episode b (each prompt must
 * be shorter than max_len). Fills every array of r. */
lm_status lm_rollout_run(lm_rollout *r, const lm_env_config *envs, const uint64_t *seeds,
                         const lm_rollout_config *cfg, uint64_t sample_seed);

#ifdef __cplusplus
}
#endif
#endif
