/* The `rl` config section: defaults, reader, writer (include/longmoe/rl_run.h,
 * docs/config.md). */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "files.h"
#include "json.h"
#include "longmoe/rl_run.h"

void lm_rl_config_defaults(lm_rl_config *c) {
    memset(c, 0, sizeof *c);
    c->n_envs = LM_ENV_COUNT;
    for (int k = 0; k < LM_ENV_COUNT; k++) c->envs[k] = (lm_env_kind)k;
    c->difficulty_min = 1;
    c->difficulty_max = 2;
    c->tasks = 8;
    c->group = 8;
    c->max_len = 192;
    c->temperature = 1.0f;
    c->top_p = 1.0f;
    c->clip_low = 0.2f;
    c->clip_high = 0.28f;
    c->kl_coef = 0.0f;
    c->credit = LM_CREDIT_OUTCOME;
    c->gamma = 1.0f;
    c->epochs = 2;
    c->lr = 0.002f;
    c->adam_lr = 0.0005f;
    c->grad_clip = 1.0f;
    c->steps = 100;
    c->warm_steps = 100;
    c->warm_lr = 0.02f;
    c->warm_adam_lr = 0.003f;
    c->eval_every = 0;
    c->eval_episodes = 64;
    c->ckpt_every = 0;
    c->keep_checkpoints = 2;
    c->log_every = 10;
    c->seed = 1;
}

typedef enum { RK_INT, RK_INT64, RK_U64, RK_FLOAT } rl_key_type;
typedef struct {
    const char *name;
    rl_key_type type;
    size_t offset;
    double lo, hi;
} rl_key;

#define RK(nm, ty, field, lo, hi) {nm, ty, offsetof(lm_rl_config, field), lo, hi}
static const rl_key keys[] = {
    RK("difficulty_min", RK_INT, difficulty_min, 1, LM_ENV_MAX_DIFFICULTY),
    RK("difficulty_max", RK_INT, difficulty_max, 1, LM_ENV_MAX_DIFFICULTY),
    RK("tasks", RK_INT, tasks, 1, 4096),
    RK("group", RK_INT, group, 2, 1024),
    RK("max_len", RK_INT, max_len, 16, 1 << 20),
    RK("temperature", RK_FLOAT, temperature, 0, 10),
    RK("top_p", RK_FLOAT, top_p, 1e-6, 1),
    RK("clip_low", RK_FLOAT, clip_low, 0, 0.999),
    RK("clip_high", RK_FLOAT, clip_high, 0, 100),
    RK("kl_coef", RK_FLOAT, kl_coef, 0, 100),
    RK("gamma", RK_FLOAT, gamma, 0, 1),
    RK("epochs", RK_INT, epochs, 1, 64),
    RK("lr", RK_FLOAT, lr, 0, 10),
    RK("adam_lr", RK_FLOAT, adam_lr, 0, 10),
    RK("grad_clip", RK_FLOAT, grad_clip, 0, 1e6),
    RK("steps", RK_INT64, steps, 0, 1e12),
    RK("warm_steps", RK_INT, warm_steps, 0, 1 << 30),
    RK("warm_lr", RK_FLOAT, warm_lr, 0, 10),
    RK("warm_adam_lr", RK_FLOAT, warm_adam_lr, 0, 10),
    RK("eval_every", RK_INT, eval_every, 0, 1 << 30),
    RK("eval_episodes", RK_INT, eval_episodes, 1, 1 << 20),
    RK("ckpt_every", RK_INT, ckpt_every, 0, 1 << 30),
    RK("keep_checkpoints", RK_INT, keep_checkpoints, 1, 1 << 20),
    RK("log_every", RK_INT, log_every, 1, 1 << 30),
    RK("seed", RK_U64, seed, 0, 9007199254740992.0),
};
#undef RK
static const int n_keys = (int)(sizeof keys / sizeof keys[0]);

static lm_status parse_key(const rl_key *k, const lm_json *v, const char *what, lm_rl_config *c) {
    if (v->kind != LM_JSON_NUMBER) return lm_error(LM_ERR_ARG, "%s: rl.%s must be a number", what, k->name);
    if (k->type != RK_FLOAT && !v->number_is_integer)
        return lm_error(LM_ERR_ARG, "%s: rl.%s must be an integer, got %g", what, k->name, v->number);
    if (!(v->number >= k->lo && v->number <= k->hi))
        return lm_error(LM_ERR_ARG, "%s: rl.%s must lie in [%g, %g], got %g", what, k->name, k->lo, k->hi, v->number);
    char *p = (char *)c + k->offset;
    switch (k->type) {
    case RK_INT: *(int *)p = (int)v->integer; break;
    case RK_INT64: *(int64_t *)p = v->integer; break;
    case RK_U64: *(uint64_t *)p = (uint64_t)v->integer; break;
    default: *(float *)p = (float)v->number; break;
    }
    return LM_OK;
}

static lm_status parse_section(const lm_json *sec, const char *what, lm_rl_config *c) {
    if (sec->kind != LM_JSON_OBJECT) return lm_error(LM_ERR_ARG, "%s: section 'rl' must be an object", what);
    for (const lm_json *m = sec->child; m; m = m->next) {
        if (!strcmp(m->key, "comment")) continue;
        if (!strcmp(m->key, "envs")) {
            if (m->kind != LM_JSON_ARRAY || m->count < 1 || m->count > LM_ENV_COUNT)
                return lm_error(LM_ERR_ARG, "%s: rl.envs must be an array of 1 to %d environment names", what,
                                LM_ENV_COUNT);
            int n = 0;
            for (const lm_json *e = m->child; e; e = e->next) {
                lm_env_kind k;
                if (e->kind != LM_JSON_STRING || lm_env_kind_from_name(e->string, &k))
                    return lm_error(LM_ERR_ARG, "%s: rl.envs: unknown environment (known: lookup, calc, grid)", what);
                for (int j = 0; j < n; j++)
                    if (c->envs[j] == k) return lm_error(LM_ERR_ARG, "%s: rl.envs names '%s' twice", what, e->string);
                c->envs[n++] = k;
            }
            c->n_envs = n;
            continue;
        }
        if (!strcmp(m->key, "credit")) {
            if (m->kind == LM_JSON_STRING && !strcmp(m->string, "outcome")) c->credit = LM_CREDIT_OUTCOME;
            else if (m->kind == LM_JSON_STRING && !strcmp(m->string, "turn")) c->credit = LM_CREDIT_TURN;
            else return lm_error(LM_ERR_ARG, "%s: rl.credit must be \"outcome\" or \"turn\"", what);
            continue;
        }
        const rl_key *k = NULL;
        for (int i = 0; i < n_keys; i++)
            if (!strcmp(keys[i].name, m->key)) k = &keys[i];
        if (!k) return lm_error(LM_ERR_ARG, "%s: unknown key 'rl.%s' (docs/config.md lists the keys)", what, m->key);
        lm_status s = parse_key(k, m, what, c);
        if (s) return s;
    }
    if (c->difficulty_min > c->difficulty_max)
        return lm_error(LM_ERR_ARG, "%s: rl.difficulty_min %d exceeds rl.difficulty_max %d", what, c->difficulty_min,
                        c->difficulty_max);
    return LM_OK;
}

lm_status lm_rl_config_parse(const char *text, size_t len, const char *what, lm_rl_config *c) {
    lm_json_doc *doc;
    lm_status s = lm_json_parse(text, len, what, &doc);
    if (s) return s;
    const lm_json *root = lm_json_root(doc);
    const lm_json *sec = root->kind == LM_JSON_OBJECT ? lm_json_get(root, "rl") : NULL;
    if (root->kind != LM_JSON_OBJECT) s = lm_error(LM_ERR_ARG, "%s: the config must be a JSON object", what);
    else if (sec) s = parse_section(sec, what, c);
    lm_json_free(doc);
    return s;
}

char *lm_rl_config_to_json(const lm_rl_config *c) {
    lm_text t = {0};
    lm_text_puts(&t, "{\"rl\": {\"envs\": [");
    for (int i = 0; i < c->n_envs; i++) lm_text_printf(&t, "%s\"%s\"", i ? ", " : "", lm_env_kind_name(c->envs[i]));
    lm_text_printf(&t, "], \"credit\": \"%s\"", c->credit == LM_CREDIT_TURN ? "turn" : "outcome");
    for (int i = 0; i < n_keys; i++) {
        const char *p = (const char *)c + keys[i].offset;
        switch (keys[i].type) {
        case RK_INT: lm_text_printf(&t, ", \"%s\": %d", keys[i].name, *(const int *)p); break;
        case RK_INT64: lm_text_printf(&t, ", \"%s\": %lld", keys[i].name, (long long)*(const int64_t *)p); break;
        case RK_U64: lm_text_printf(&t, ", \"%s\": %llu", keys[i].name, (unsigned long long)*(const uint64_t *)p); break;
        default: lm_text_printf(&t, ", \"%s\": %.9g", keys[i].name, (double)*(const float *)p); break;
        }
    }
    lm_text_puts(&t, "}}\n");
    if (t.failed) {
        lm_text_free(&t);
        return NULL;
    }
    return t.s;
}

/* Write a JSON value back as text (the config minus its `rl` section). */
static void write_json(lm_text *t, const lm_json *v, const char *skip_key) {
    switch (v->kind) {
    case LM_JSON_NULL: lm_text_puts(t, "null"); break;
    case LM_JSON_BOOL: lm_text_puts(t, v->boolean ? "true" : "false"); break;
    case LM_JSON_NUMBER:
        if (v->number_is_integer && fabs(v->number) < 9e15) lm_text_printf(t, "%lld", (long long)v->integer);
        else lm_text_printf(t, "%.17g", v->number);
        break;
    case LM_JSON_STRING:
        lm_text_puts(t, "\"");
        for (size_t i = 0; i < v->string_length; i++) {
            unsigned char ch = (unsigned char)v->string[i];
            if (ch == '"' || ch == '\\') lm_text_printf(t, "\\%c", ch);
            else if (ch < 32) lm_text_printf(t, "\\u%04x", ch);
            else lm_text_put(t, (const char *)&ch, 1);
        }
        lm_text_puts(t, "\"");
        break;
    case LM_JSON_ARRAY:
    case LM_JSON_OBJECT: {
        int obj = v->kind == LM_JSON_OBJECT, first = 1;
        lm_text_puts(t, obj ? "{" : "[");
        for (const lm_json *e = v->child; e; e = e->next) {
            if (obj && skip_key && !strcmp(e->key, skip_key)) continue;
            if (!first) lm_text_puts(t, ", ");
            first = 0;
            if (obj) {
                lm_json key = {0};
                key.kind = LM_JSON_STRING;
                key.string = e->key;
                key.string_length = strlen(e->key);
                write_json(t, &key, NULL);
                lm_text_puts(t, ": ");
            }
            write_json(t, e, NULL);
        }
        lm_text_puts(t, obj ? "}" : "]");
        break;
    }
    }
}

lm_status lm_rl_config_load(const char *path, lm_config *model, lm_rl_config *rl) {
    char *text;
    size_t len;
    lm_status s = lm_read_file(path, LM_TEXT_FILE_MAX, &text, &len);
    if (s) return s;
    lm_json_doc *doc = NULL;
    s = lm_json_parse(text, len, path, &doc);
    if (!s) s = lm_rl_config_parse(text, len, path, rl);
    free(text);
    if (s) {
        lm_json_free(doc);
        return s;
    }
    lm_text t = {0};
    write_json(&t, lm_json_root(doc), "rl");
    lm_json_free(doc);
    if (t.failed || !t.s) {
        lm_text_free(&t);
        return lm_error(LM_ERR_MEMORY, "out of memory reading '%s'", path);
    }
    s = lm_config_parse(t.s, t.n, path, model);
    lm_text_free(&t);
    return s;
}
