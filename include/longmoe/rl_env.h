/* Environments for agentic RL (SPEC §10, docs/rl.md): tasks solved by
 * calling tools over a plain text protocol of byte tokens (vocab 256).
 *
 * A trajectory is a sequence of lines, each ended by '\n':
 *   T:<task>          written by the environment (the prompt)
 *   C:<tool> <args>   written by the model: a tool call
 *   R:<result>        written by the environment: the tool's result
 *   E:<error>         written by the environment: a malformed or failed call
 *   A:<answer>        written by the model: the final answer (ends the episode)
 * Bytes written by the environment are context and are never trained on.
 *
 * Kinds (difficulty d >= 1 sets the number of steps; trajectories grow
 * linearly in d, from a few dozen bytes to many thousands):
 *   lookup: a hidden key-value table of 2-letter keys. "T:hop ab 3" asks for
 *           the key reached from ab after 3 lookups; the tool "get <key>"
 *           returns the key's value (another key), "A:<key>" answers.
 *   calc:   "T:calc 3+4*5-2" (evaluated left to right, d operators, operands
 *           1..9, every partial result in [0, 999]); the tool "calc a<op>b"
 *           (op one of + - *) returns the result, "A:<number>" answers.
 *   grid:   a partially observed grid [0, gx] x [0, gy] with hidden walls,
 *           start (0, 0), "T:grid gx,gy" names the goal (gx + gy = d). The
 *           tool "move <n|s|e|w>" returns the new position "x,y" or the error
 *           "wall" (the position is unchanged); "A:done" answers, correct
 *           when standing on the goal.
 * Every episode is a pure function of (kind, difficulty, seed). Every line the
 * model writes gets an answer: a malformed line (unknown tool, bad argument,
 * missing prefix, a byte outside printable ASCII, too long) is an "E:" line,
 * never a failure of the call. The episode ends at the answer, after
 * max_turns model lines, or when the caller stops it.
 *
 * Rewards: outcome = 1 when the answer is correct, else 0. Per-turn rewards
 * measure progress: each turn that brings the task one step nearer (a new hop
 * of the chain, the next partial result, a cell nearer the goal) earns 1/d,
 * and the answer turn earns the outcome; so a solved episode's turn rewards
 * sum to 2. */
#ifndef LONGMOE_RL_ENV_H
#define LONGMOE_RL_ENV_H

#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_ENV_LOOKUP = 0, LM_ENV_CALC, LM_ENV_GRID, LM_ENV_COUNT } lm_env_kind;

#define LM_ENV_MAX_DIFFICULTY 256
#define LM_ENV_MAX_LINE 32  /* bytes of one model line before its '\n'; longer is malformed */
#define LM_ENV_MAX_TEXT 48  /* bytes of an observation line, '\n' included */
#define LM_ENV_MAX_PROMPT (2 * LM_ENV_MAX_DIFFICULTY + 16) /* bytes of a prompt line (calc is long) */
#define LM_ENV_MAX_KEYS 512 /* lookup table entries */

typedef struct {
    lm_env_kind kind;
    int difficulty; /* 1..LM_ENV_MAX_DIFFICULTY */
    int max_turns;  /* model lines before the episode is cut; 0: 3 d + 4 */
} lm_env_config;

/* The whole state of one episode (no allocation; copyable). */
typedef struct {
    lm_env_config cfg;
    uint64_t seed;
    int turns, done, success, progress; /* progress: steps achieved, 0..d */
    /* lookup */
    int n_keys;
    uint16_t keys[LM_ENV_MAX_KEYS], values[LM_ENV_MAX_KEYS]; /* 2-letter keys as 26*a+b */
    uint16_t chain[LM_ENV_MAX_DIFFICULTY + 1];                 /* chain[0] start, chain[d] answer */
    /* calc */
    int operands[LM_ENV_MAX_DIFFICULTY + 1];
    char ops[LM_ENV_MAX_DIFFICULTY];
    int partial[LM_ENV_MAX_DIFFICULTY + 1]; /* partial[i]: value after i operators */
    int last_result;                        /* the latest result the tool returned (-1: none) */
    /* grid */
    int gx, gy, x, y, blocked_east; /* blocked_east: the last move east from (x, y) hit a wall */
    uint8_t wall[(LM_ENV_MAX_DIFFICULTY + 1) * (LM_ENV_MAX_DIFFICULTY + 1)]; /* [(gy+1), (gx+1)] row-major */
} lm_env;

/* What the environment answers to one model line. */
typedef struct {
    char text[LM_ENV_MAX_TEXT]; /* the observation line, '\n' included ("" after an answer) */
    int len;
    float reward; /* this turn's reward (see above) */
    int done, success, malformed;
} lm_env_turn;

int lm_env_kind_from_name(const char *name, lm_env_kind *out); /* 0 on success */
const char *lm_env_kind_name(lm_env_kind kind);

/* Start an episode: fills the prompt line (its '\n' included, at most
 * LM_ENV_MAX_PROMPT bytes) into prompt[cap], cap >= LM_ENV_MAX_PROMPT. */
lm_status lm_env_reset(lm_env *env, const lm_env_config *cfg, uint64_t seed, char *prompt, int cap, int *len);

/* One model line (bytes line[0..n), without its '\n'; any bytes, any n >= 0)
 * -> the environment's answer. After the episode is done it is an error. */
lm_status lm_env_step(lm_env *env, const char *line, int n, lm_env_turn *turn);

/* The solver: the next model line (without '\n') for the episode's current
 * state, using only what the model has seen (for grid: the position and
 * whether the last move east from here hit a wall). Returns its length. */
int lm_env_solver_line(const lm_env *env, char *line, int cap);

/* A full demonstration: the solver's episode as text (prompt, model lines and
 * observations), with model_mask[i] = 1 for the bytes the model writes (its
 * lines and their '\n'). *len receives the length; LM_ERR_ARG when cap is too
 * small. */
lm_status lm_env_demo(const lm_env_config *cfg, uint64_t seed, char *text, uint8_t *model_mask, int cap, int *len);

#ifdef __cplusplus
}
#endif
#endif
