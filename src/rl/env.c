/* Tool-use environments for agentic RL (include/longmoe/rl_env.h, docs/rl.md). */
#include <stdio.h>
#include <string.h>

#include "longmoe/rl_env.h"

static const char *const kind_names[LM_ENV_COUNT] = {"lookup", "calc", "grid"};

int lm_env_kind_from_name(const char *name, lm_env_kind *out) {
    for (int k = 0; k < LM_ENV_COUNT; k++)
        if (name && strcmp(name, kind_names[k]) == 0) {
            *out = (lm_env_kind)k;
            return 0;
        }
    return 1;
}

const char *lm_env_kind_name(lm_env_kind kind) {
    return kind >= 0 && kind < LM_ENV_COUNT ? kind_names[kind] : "?";
}

static int rng_below(lm_rng *r, int n) { return (int)(lm_rng_u64(r) % (uint64_t)n); }

static void key_text(uint16_t key, char out[3]) {
    out[0] = (char)('a' + key / 26);
    out[1] = (char)('a' + key % 26);
    out[2] = 0;
}

static int apply_op(int a, char op, int b) { return op == '+' ? a + b : op == '-' ? a - b : a * b; }

/* ---- generation ---- */

static void lookup_generate(lm_env *env, lm_rng *r) {
    const int d = env->cfg.difficulty;
    /* the chain d + 1 distinct keys, then distractor entries on other keys */
    uint8_t used[26 * 26] = {0};
    for (int i = 0; i <= d; i++) {
        uint16_t k;
        do k = (uint16_t)rng_below(r, 26 * 26);
        while (used[k]);
        used[k] = 1;
        env->chain[i] = k;
    }
    int n = 0;
    for (int i = 0; i < d; i++) {
        env->keys[n] = env->chain[i];
        env->values[n++] = env->chain[i + 1];
    }
    int distractors = d / 2 + 2;
    for (int i = 0; i < distractors && n < LM_ENV_MAX_KEYS; i++) {
        uint16_t k;
        do k = (uint16_t)rng_below(r, 26 * 26);
        while (used[k]);
        used[k] = 1;
        env->keys[n] = k;
        env->values[n++] = (uint16_t)rng_below(r, 26 * 26);
    }
    env->n_keys = n;
}

static void calc_generate(lm_env *env, lm_rng *r) {
    const int d = env->cfg.difficulty;
    env->operands[0] = 1 + rng_below(r, 9);
    env->partial[0] = env->operands[0];
    for (int i = 0; i < d; i++) {
        int b = 1 + rng_below(r, 9), a = env->partial[i];
        char op;
        /* an operator that keeps the partial result in [0, 999]: draw, fall back to the first that fits */
        const char all[3] = {'+', '-', '*'};
        int first = rng_below(r, 3), k = 0;
        for (; k < 3; k++) {
            op = all[(first + k) % 3];
            int v = apply_op(a, op, b);
            if (v >= 0 && v <= 999) break;
        }
        if (k == 3) { /* a + b > 999, a - b < 0 and a * b > 999 cannot all hold for b in 1..9 */
            op = '-';
            b = 1;
        }
        env->ops[i] = op;
        env->operands[i + 1] = b;
        env->partial[i + 1] = apply_op(a, op, b);
    }
    env->last_result = -1;
}

static int grid_is_wall(const lm_env *env, int x, int y) {
    if (x < 0 || y < 0 || x > env->gx || y > env->gy) return 1;
    return env->wall[y * (env->gx + 1) + x];
}

/* The solver's move from (x, y): east while short of gx and not just blocked
 * there, else north. */
static char grid_policy(const lm_env *env) {
    if (env->x < env->gx && !env->blocked_east) return 'e';
    return 'n';
}

static void grid_generate(lm_env *env, lm_rng *r) {
    const int d = env->cfg.difficulty;
    env->gx = rng_below(r, d + 1);
    env->gy = d - env->gx;
    int W = env->gx + 1;
    memset(env->wall, 0, sizeof env->wall);
    for (int y = 0; y <= env->gy; y++)
        for (int x = 0; x < W; x++) env->wall[y * W + x] = lm_rng_uniform(r) < 0.25;
    env->wall[0] = 0;
    env->wall[env->gy * W + env->gx] = 0;
    /* walk the solver's policy and open any dead end it meets (north, or east
     * on the top row), so every episode is solvable by it */
    int x = 0, y = 0, blocked = 0;
    while (x != env->gx || y != env->gy) {
        if (x < env->gx && !blocked) {
            if (env->wall[y * W + x + 1]) {
                if (y == env->gy) env->wall[y * W + x + 1] = 0; /* no way north: open east */
                else blocked = 1;
                continue;
            }
            x++;
        } else {
            if (env->wall[(y + 1) * W + x]) env->wall[(y + 1) * W + x] = 0; /* dead end: open north */
            y++;
            blocked = 0;
        }
    }
    env->x = env->y = 0;
    env->blocked_east = 0;
}

lm_status lm_env_reset(lm_env *env, const lm_env_config *cfg, uint64_t seed, char *prompt, int cap, int *len) {
    if (!env || !cfg || !prompt || !len) return lm_error(LM_ERR_ARG, "lm_env_reset: NULL argument");
    if (cfg->kind < 0 || cfg->kind >= LM_ENV_COUNT) return lm_error(LM_ERR_ARG, "env kind %d unknown", cfg->kind);
    if (cfg->difficulty < 1 || cfg->difficulty > LM_ENV_MAX_DIFFICULTY)
        return lm_error(LM_ERR_ARG, "env difficulty %d outside [1, %d]", cfg->difficulty, LM_ENV_MAX_DIFFICULTY);
    if (cfg->max_turns < 0) return lm_error(LM_ERR_ARG, "env max_turns %d is negative", cfg->max_turns);
    if (cap < LM_ENV_MAX_PROMPT) return lm_error(LM_ERR_ARG, "prompt capacity %d < %d", cap, LM_ENV_MAX_PROMPT);
    memset(env, 0, sizeof *env);
    env->cfg = *cfg;
    if (env->cfg.max_turns == 0) env->cfg.max_turns = 3 * cfg->difficulty + 4;
    env->seed = seed;
    lm_rng r;
    lm_rng_seed(&r, seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(cfg->kind + 1)) ^ ((uint64_t)cfg->difficulty << 48));
    char k[3];
    switch (cfg->kind) {
    case LM_ENV_LOOKUP:
        lookup_generate(env, &r);
        key_text(env->chain[0], k);
        *len = snprintf(prompt, (size_t)cap, "T:hop %s %d\n", k, cfg->difficulty);
        break;
    case LM_ENV_CALC: {
        calc_generate(env, &r);
        /* "T:calc " then the expression: 2 d + 9 bytes with its '\n' */
        int n = snprintf(prompt, (size_t)cap, "T:calc %d", env->operands[0]);
        for (int i = 0; i < cfg->difficulty; i++)
            n += snprintf(prompt + n, (size_t)(cap - n), "%c%d", env->ops[i], env->operands[i + 1]);
        prompt[n++] = '\n';
        prompt[n] = 0;
        *len = n;
        break;
    }
    default:
        grid_generate(env, &r);
        *len = snprintf(prompt, (size_t)cap, "T:grid %d,%d\n", env->gx, env->gy);
        break;
    }
    return LM_OK;
}

/* ---- stepping ---- */

static void say(lm_env_turn *t, const char *fmt, const char *a, int b) {
    char buf[LM_ENV_MAX_TEXT];
    snprintf(buf, sizeof buf, fmt, a, b);
    t->len = snprintf(t->text, sizeof t->text, "%s\n", buf);
}

/* Parse a non-negative decimal of 1..4 digits at s[*i]; -1 if none. */
static int parse_number(const char *s, int n, int *i) {
    int v = 0, digits = 0;
    while (*i < n && s[*i] >= '0' && s[*i] <= '9' && digits < 5) {
        v = v * 10 + (s[*i] - '0');
        (*i)++;
        digits++;
    }
    return digits == 0 || digits > 4 ? -1 : v;
}

static void lookup_call(lm_env *env, const char *args, int n, lm_env_turn *t) {
    const int d = env->cfg.difficulty;
    if (n != 2 || args[0] < 'a' || args[0] > 'z' || args[1] < 'a' || args[1] > 'z') {
        say(t, "E:bad key%s", "", 0);
        t->malformed = 1;
        return;
    }
    uint16_t key = (uint16_t)((args[0] - 'a') * 26 + (args[1] - 'a'));
    for (int i = 0; i < env->n_keys; i++)
        if (env->keys[i] == key) {
            char v[3];
            key_text(env->values[i], v);
            say(t, "R:%s", v, 0);
            /* progress: the next hop of the chain */
            if (env->progress < d && key == env->chain[env->progress]) {
                env->progress++;
                t->reward = 1.0f / (float)d;
            }
            return;
        }
    char k[3];
    key_text(key, k);
    say(t, "E:no key %s", k, 0);
}

static void calc_call(lm_env *env, const char *args, int n, lm_env_turn *t) {
    const int d = env->cfg.difficulty;
    int i = 0;
    int a = parse_number(args, n, &i);
    char op = i < n ? args[i] : 0;
    if (a < 0 || (op != '+' && op != '-' && op != '*')) {
        say(t, "E:bad expr%s", "", 0);
        t->malformed = 1;
        return;
    }
    i++;
    int b = parse_number(args, n, &i);
    if (b < 0 || i != n) {
        say(t, "E:bad expr%s", "", 0);
        t->malformed = 1;
        return;
    }
    int v = apply_op(a, op, b);
    say(t, "R:%s%d", "", v);
    env->last_result = v;
    /* progress: the next partial result, computed from the previous one */
    int p = env->progress;
    if (p < d && a == env->partial[p] && op == env->ops[p] && b == env->operands[p + 1]) {
        env->progress++;
        t->reward = 1.0f / (float)d;
    }
}

static void grid_call(lm_env *env, const char *args, int n, lm_env_turn *t) {
    const int d = env->cfg.difficulty;
    int dx = 0, dy = 0;
    if (n == 1 && args[0] == 'n') dy = 1;
    else if (n == 1 && args[0] == 's') dy = -1;
    else if (n == 1 && args[0] == 'e') dx = 1;
    else if (n == 1 && args[0] == 'w') dx = -1;
    else {
        say(t, "E:bad dir%s", "", 0);
        t->malformed = 1;
        return;
    }
    if (grid_is_wall(env, env->x + dx, env->y + dy)) {
        if (dx == 1) env->blocked_east = 1;
        say(t, "E:wall%s", "", 0);
        return;
    }
    int before = (env->gx - env->x > 0 ? env->gx - env->x : env->x - env->gx) +
                 (env->gy - env->y > 0 ? env->gy - env->y : env->y - env->gy);
    env->x += dx;
    env->y += dy;
    env->blocked_east = 0;
    int after = (env->gx - env->x > 0 ? env->gx - env->x : env->x - env->gx) +
                (env->gy - env->y > 0 ? env->gy - env->y : env->y - env->gy);
    /* progress: the nearest the agent has come to the goal */
    int reached = d - after;
    if (after < before && reached > env->progress) {
        t->reward = (float)(reached - env->progress) / (float)d;
        env->progress = reached;
    }
    char pos[LM_ENV_MAX_TEXT];
    snprintf(pos, sizeof pos, "%d,%d", env->x, env->y);
    say(t, "R:%s", pos, 0);
}

static int answer_correct(const lm_env *env, const char *s, int n) {
    char want[16];
    int w;
    switch (env->cfg.kind) {
    case LM_ENV_LOOKUP:
        key_text(env->chain[env->cfg.difficulty], want);
        w = 2;
        break;
    case LM_ENV_CALC:
        w = snprintf(want, sizeof want, "%d", env->partial[env->cfg.difficulty]);
        break;
    default:
        if (env->x != env->gx || env->y != env->gy) return 0;
        w = snprintf(want, sizeof want, "done");
        break;
    }
    return n == w && memcmp(s, want, (size_t)w) == 0;
}

lm_status lm_env_step(lm_env *env, const char *line, int n, lm_env_turn *t) {
    if (!env || !t || (n > 0 && !line) || n < 0) return lm_error(LM_ERR_ARG, "lm_env_step: bad line or NULL argument");
    if (env->done) return lm_error(LM_ERR_ARG, "lm_env_step: the episode is over");
    memset(t, 0, sizeof *t);
    env->turns++;
    int printable = 1;
    for (int i = 0; i < n; i++) printable &= line[i] >= 32 && line[i] < 127;
    if (n > LM_ENV_MAX_LINE || !printable) {
        say(t, n > LM_ENV_MAX_LINE ? "E:too long%s" : "E:bad byte%s", "", 0);
        t->malformed = 1;
    } else if (n >= 2 && line[0] == 'A' && line[1] == ':') {
        t->success = answer_correct(env, line + 2, n - 2);
        t->reward = t->success ? 1.0f : 0.0f;
        t->done = 1;
        t->len = 0;
        t->text[0] = 0;
    } else if (n >= 2 && line[0] == 'C' && line[1] == ':') {
        static const char *const tool[LM_ENV_COUNT] = {"get ", "calc ", "move "};
        const char *want = tool[env->cfg.kind];
        int w = (int)strlen(want);
        if (n - 2 < w || memcmp(line + 2, want, (size_t)w) != 0) {
            say(t, "E:unknown tool%s", "", 0);
            t->malformed = 1;
        } else if (env->cfg.kind == LM_ENV_LOOKUP) {
            lookup_call(env, line + 2 + w, n - 2 - w, t);
        } else if (env->cfg.kind == LM_ENV_CALC) {
            calc_call(env, line + 2 + w, n - 2 - w, t);
        } else {
            grid_call(env, line + 2 + w, n - 2 - w, t);
        }
    } else {
        say(t, "E:want C: or A:%s", "", 0);
        t->malformed = 1;
    }
    if (!t->done && env->turns >= env->cfg.max_turns) t->done = 1;
    env->done = t->done;
    env->success = t->success;
    return LM_OK;
}

/* ---- the solver ---- */

int lm_env_solver_line(const lm_env *env, char *line, int cap) {
    const int d = env->cfg.difficulty, p = env->progress;
    char k[3];
    int n;
    switch (env->cfg.kind) {
    case LM_ENV_LOOKUP:
        key_text(env->chain[p], k);
        n = snprintf(line, (size_t)cap, p < d ? "C:get %s" : "A:%s", k);
        break;
    case LM_ENV_CALC:
        if (p < d)
            n = snprintf(line, (size_t)cap, "C:calc %d%c%d", env->partial[p], env->ops[p], env->operands[p + 1]);
        else
            n = snprintf(line, (size_t)cap, "A:%d", env->partial[d]);
        break;
    default:
        if (env->x == env->gx && env->y == env->gy) n = snprintf(line, (size_t)cap, "A:done");
        else n = snprintf(line, (size_t)cap, "C:move %c", grid_policy(env));
        break;
    }
    return n < cap ? n : cap - 1;
}

lm_status lm_env_demo(const lm_env_config *cfg, uint64_t seed, char *text, uint8_t *model_mask, int cap, int *len) {
    if (!text || !model_mask || !len) return lm_error(LM_ERR_ARG, "lm_env_demo: NULL argument");
    lm_env env;
    char buf[LM_ENV_MAX_PROMPT];
    int n;
    lm_status st = lm_env_reset(&env, cfg, seed, buf, (int)sizeof buf, &n);
    if (st) return st;
    int pos = 0;
#define EMIT(src, cnt, who)                                                                        \
    do {                                                                                           \
        if (pos + (cnt) > cap) return lm_error(LM_ERR_ARG, "lm_env_demo: capacity %d too small", cap); \
        memcpy(text + pos, (src), (size_t)(cnt));                                                  \
        memset(model_mask + pos, (who), (size_t)(cnt));                                            \
        pos += (cnt);                                                                              \
    } while (0)
    EMIT(buf, n, 0);
    while (!env.done) {
        char line[LM_ENV_MAX_TEXT];
        int m = lm_env_solver_line(&env, line, (int)sizeof line);
        line[m] = '\n';
        EMIT(line, m + 1, 1);
        lm_env_turn t;
        if ((st = lm_env_step(&env, line, m, &t))) return st;
        EMIT(t.text, t.len, 0);
    }
#undef EMIT
    *len = pos;
    return env.success ? LM_OK : lm_error(LM_ERR_ARG, "lm_env_demo: the solver failed (seed %llu)",
                                          (unsigned long long)seed);
}
