/* Agentic RL post-training (SPEC §10, docs/rl.md): a short supervised warm
 * start on the solvers' demonstrations, then group-relative policy
 * optimisation on rollouts of the tool-use environments, with its own config
 * section, metrics, checkpoints and bit-exact resume.
 *
 * A run directory holds:
 *   config.json              the model config; rl.json beside it: the rl section
 *   metrics.jsonl            {"type": "rl_warm"} per warm-start step, {"type": "rl"} per RL step,
 *                            {"type": "rl_eval"} per evaluation (held-out seeds, greedy; or
 *                            the selection seeds, "split": "select"),
 *                            {"type": "checkpoint"}
 *   checkpoint-<step>/       model.safetensors, config.json (loadable by `longmoe sample`,
 *                            `longmoe eval`), trainer.safetensors (optimizer moments, the MoE
 *                            balancing state, the frozen reference's parameters), rl.json
 *                            (counters and the rl section)
 *   latest
 * written with the trainer's atomic checkpoint writer (src/train/checkpoint.c).
 *
 * Steps count the warm start's first: steps 0 .. warm_steps - 1 are
 * supervised, the next `steps` are RL. Every random choice (tasks, episode
 * seeds, sampling) is a pure function of (seed, step), so a resumed run
 * repeats an uninterrupted one bit for bit. */
#ifndef LONGMOE_RL_RUN_H
#define LONGMOE_RL_RUN_H

#include <stdint.h>
#include <stdio.h>

#include "longmoe/config.h"
#include "longmoe/core.h"
#include "longmoe/rl.h"
#include "longmoe/rl_env.h"
#include "longmoe/rl_rollout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The `rl` section of a config file (docs/config.md, docs/rl.md). */
typedef struct {
    int n_envs;
    lm_env_kind envs[LM_ENV_COUNT]; /* rl.envs: tasks cycle through them */
    int difficulty_min, difficulty_max;
    int tasks;           /* tasks per RL step */
    int group;           /* G samples per task */
    int max_len;         /* tokens per trajectory */
    float temperature, top_p;
    float clip_low, clip_high, kl_coef;
    lm_rl_credit credit; /* "outcome" or "turn" */
    float gamma;         /* discount over turns (credit "turn") */
    int epochs;          /* updates per batch of rollouts (> 1: the ratio and its clip matter) */
    float lr, adam_lr, grad_clip;
    int64_t steps;       /* RL steps */
    int warm_steps;      /* supervised steps on demonstrations before RL */
    float warm_lr, warm_adam_lr;
    int eval_every;      /* RL steps between evaluations (0: at the start and the end only) */
    int eval_episodes;   /* held-out episodes per environment */
    int ckpt_every, keep_checkpoints, log_every;
    uint64_t seed;
} lm_rl_config;

void lm_rl_config_defaults(lm_rl_config *c);
/* Keys of the object `rl` of a JSON document over the defaults; an absent
 * section keeps them. Unknown keys and bad values are errors naming the key. */
lm_status lm_rl_config_parse(const char *text, size_t len, const char *what, lm_rl_config *c);
/* {"rl": {...every key...}} as a malloc'd string (rl.json). */
char *lm_rl_config_to_json(const lm_rl_config *c);
/* A config file with an `rl` section: the model config (every other section,
 * lm_config_parse) and the rl config. */
lm_status lm_rl_config_load(const char *path, lm_config *model, lm_rl_config *rl);

/* Positions of a batch of rollouts as the model sees them (inputs are
 * r->tokens [B, max_len]): tgt[t] = tokens[t + 1] (0 past the end) and
 * model_mask[t] = mask[t + 1]: 1 where the target is a byte the model wrote. */
void lm_rl_targets(const lm_rollout *r, int32_t *tgt, uint8_t *model_mask);
/* Each position's advantage (aligned with the targets; 0 where model_mask is
 * 0) for groups of G consecutive trajectories: outcome credit normalises the
 * episodes' outcomes within each group; turn credit the discounted returns of
 * the per-turn rewards over all turns of the group (docs/rl.md). */
lm_status lm_rl_advantages(const lm_rollout *r, int G, lm_rl_credit credit, float gamma, float *adv);

/* The evaluation episodes' seeds (docs/rl.md, "Seeds"). Training draws even
 * seeds only; both evaluation splits draw odd ones, from two different
 * streams, so neither meets a training seed; tests/test_rl_run.c checks that
 * the two splits share no seed over every episode count rl.eval_episodes
 * allows (j < 2^20 for every environment). */
typedef enum { LM_RL_SPLIT_HELDOUT = 0, LM_RL_SPLIT_SELECT = 1 } lm_rl_split;

/* The seed of evaluation episode j of environment `kind` in `split`. */
uint64_t lm_rl_eval_seed(lm_rl_split split, lm_env_kind kind, int j);

typedef struct {
    const char *out_dir;
    const char *init;    /* checkpoint directory to start from (NULL: initialise the model config) */
    int resume;          /* continue from out_dir/latest */
    int64_t stop_after;  /* stop with a checkpoint once this many steps are done (0: at the end) */
    FILE *progress;      /* progress lines (NULL: none) */
    lm_rl_split eval_split; /* which seeds evaluations use (default held-out); not recorded in
                             * checkpoints: a resumed run is given it again */
} lm_rl_options;

typedef struct {
    int64_t step;
    int n_envs;
    lm_env_kind envs[LM_ENV_COUNT]; /* the run's rl.envs */
    /* held-out greedy success per environment of the config (index as rl.envs)
     * after the warm start and at the end (NaN when not evaluated in this call) */
    double warm_success[LM_ENV_COUNT], final_success[LM_ENV_COUNT];
    double seconds;
} lm_rl_result;

lm_status lm_rl_run(const lm_config *model, const lm_rl_config *rl, const lm_rl_options *opt, lm_rl_result *result);

#ifdef __cplusplus
}
#endif
#endif
