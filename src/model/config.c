/* Configuration: one table of keys (type, range, default, doc) drives parsing,
 * validation and writing (include/longmoe/config.h, docs/config.md). */
#include "longmoe/config.h"

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "files.h"
#include "json.h"

/* KEY_RECOMPUTE: true, false or one of the names "channel", "token" (lm_recompute_kind) */
typedef enum {
    KEY_INT, KEY_INT64, KEY_U64, KEY_FLOAT, KEY_BOOL, KEY_ENUM, KEY_LAYOUT, KEY_STRING, KEY_STAGES, KEY_RECOMPUTE
} key_type;

typedef struct {
    const char *section, *name;
    key_type type;
    size_t offset;
    double lo, hi;
    const char *enum_names; /* "a|b|c" for KEY_ENUM, in enum order */
} key_spec;

#define K_(sec, nm, ty, field, lo, hi, en) {sec, nm, ty, offsetof(lm_config, field), lo, hi, en}
static const key_spec keys[] = {
    K_("model", "vocab_size", KEY_INT, vocab_size, 2, 1 << 24, NULL),
    K_("model", "d_model", KEY_INT, d_model, 1, 65536, NULL),
    K_("model", "n_layers", KEY_INT, n_layers, 1, LM_MAX_LAYERS, NULL),
    K_("model", "mla_every", KEY_INT, mla_every, 0, LM_MAX_LAYERS, NULL),
    K_("model", "last_layer_mla", KEY_BOOL, last_layer_mla, 0, 1, NULL),
    K_("model", "layout", KEY_LAYOUT, layout, 0, 0, NULL),
    K_("model", "first_k_dense", KEY_INT, first_k_dense, 0, LM_MAX_LAYERS, NULL),
    K_("model", "dense_ffn", KEY_INT, dense_ffn, 1, 1 << 20, NULL),
    K_("model", "tie_embeddings", KEY_BOOL, tie_embeddings, 0, 1, NULL),
    K_("model", "norm_eps", KEY_FLOAT, norm_eps, 1e-12, 1e-2, NULL),
    K_("kda", "heads", KEY_INT, kda_heads, 1, 1024, NULL),
    K_("kda", "head_dim", KEY_INT, kda_head_dim, 1, 1024, NULL),
    K_("kda", "chunk", KEY_INT, kda_chunk, 16, 64, NULL),
    K_("kda", "conv_width", KEY_INT, kda_conv_width, 1, 16, NULL),
    K_("kda", "gate", KEY_ENUM, kda_gate_softplus, 0, 0, "bounded|softplus"),
    K_("kda", "g_min", KEY_FLOAT, kda_g_min, -5, -1e-3, NULL),
    K_("attention", "kind", KEY_ENUM, attn_kind, 0, 0, "mla|gqa"),
    K_("attention", "heads", KEY_INT, attn_heads, 1, 1024, NULL),
    K_("attention", "kv_heads", KEY_INT, attn_kv_heads, 1, 1024, NULL),
    K_("attention", "q_lora_rank", KEY_INT, q_lora_rank, 1, 65536, NULL),
    K_("attention", "kv_lora_rank", KEY_INT, kv_lora_rank, 1, 65536, NULL),
    K_("attention", "qk_head_dim", KEY_INT, qk_head_dim, 1, 1024, NULL),
    K_("attention", "v_head_dim", KEY_INT, v_head_dim, 1, 1024, NULL),
    K_("attention", "rope_dims", KEY_INT, rope_dims, 0, 1024, NULL),
    K_("moe", "routed_experts", KEY_INT, n_routed_experts, 4, 1024, NULL),
    K_("moe", "top_k", KEY_INT, top_k, 1, 16, NULL),
    K_("moe", "shared_experts", KEY_INT, n_shared_experts, 0, 16, NULL),
    K_("moe", "expert_ffn", KEY_INT, expert_ffn, 1, 1 << 20, NULL),
    K_("moe", "shared_ffn", KEY_INT, shared_ffn, 1, 1 << 20, NULL),
    K_("moe", "latent_dim", KEY_INT, latent_dim, 0, 65536, NULL),
    K_("moe", "activation", KEY_ENUM, activation, 0, 0, "swiglu|situ"),
    K_("moe", "route_scale", KEY_FLOAT, route_scale, 1e-3, 1e3, NULL),
    K_("moe", "balance", KEY_ENUM, balance, 0, 0, "none|quantile|sign|aux"),
    K_("moe", "balance_estimator", KEY_ENUM, balance_estimator, 0, 0, "histogram|exact|zoom"),
    K_("moe", "balance_bins", KEY_INT, balance_bins, 8, 1 << 16, NULL),
    K_("moe", "balance_ema", KEY_FLOAT, balance_ema, 0, 0.999, NULL),
    K_("moe", "sign_rate", KEY_FLOAT, sign_rate, 0, 1, NULL),
    K_("moe", "aux_alpha", KEY_FLOAT, aux_alpha, 0, 1, NULL),
    K_("residual", "kind", KEY_ENUM, residual, 0, 0, "standard|block_attnres|full_attnres"),
    K_("residual", "block_sublayers", KEY_INT, attnres_block, 1, 2 * LM_MAX_LAYERS, NULL),
    K_("train", "seq_len", KEY_INT, seq_len, 1, 1 << 24, NULL),
    K_("train", "batch_size", KEY_INT, batch_size, 1, 1 << 16, NULL),
    K_("train", "grad_accum", KEY_INT, grad_accum, 1, 1 << 16, NULL),
    K_("train", "steps", KEY_INT64, steps, 1, 1e15, NULL),
    K_("train", "optimizer", KEY_ENUM, optimizer, 0, 0, "muon|adamw"),
    K_("train", "lr", KEY_FLOAT, lr, 0, 10, NULL),
    K_("train", "adam_lr", KEY_FLOAT, adam_lr, 0, 10, NULL),
    K_("train", "min_lr_ratio", KEY_FLOAT, min_lr_ratio, 0, 1, NULL),
    K_("train", "warmup_frac", KEY_FLOAT, warmup_frac, 0, 1, NULL),
    K_("train", "decay_frac", KEY_FLOAT, decay_frac, 0, 1, NULL),
    K_("train", "schedule", KEY_ENUM, schedule, 0, 0, "cosine|wsd"),
    K_("train", "weight_decay", KEY_FLOAT, weight_decay, 0, 10, NULL),
    K_("train", "grad_clip", KEY_FLOAT, grad_clip, 0, 1e6, NULL),
    K_("train", "qk_clip_tau", KEY_FLOAT, qk_clip_tau, 0, 1e6, NULL),
    K_("train", "answer_loss_weight", KEY_FLOAT, answer_loss_weight, 1, 1e6, NULL),
    K_("train", "grid_rows", KEY_INT, grid_rows, 0, 1 << 16, NULL),
    K_("train", "seed", KEY_U64, seed, 0, 1.8e19, NULL),
    K_("train", "log_every", KEY_INT, log_every, 1, 1 << 30, NULL),
    K_("train", "eval_every", KEY_INT, eval_every, 0, 1 << 30, NULL),
    K_("train", "ckpt_every", KEY_INT, ckpt_every, 0, 1 << 30, NULL),
    K_("train", "keep_checkpoints", KEY_INT, keep_checkpoints, 1, 1000, NULL),
    K_("train", "recompute", KEY_RECOMPUTE, recompute, 0, 3, NULL),
    K_("train", "recompute_chunk", KEY_INT, recompute_chunk, 0, 1 << 26, NULL),
    K_("train", "seq_segment", KEY_INT, seq_segment, 0, 1 << 26, NULL),
    K_("train", "grad_bucket_mb", KEY_FLOAT, grad_bucket_mb, 0, 1e6, NULL),
    K_("train", "data", KEY_STRING, data, 0, 0, NULL),
    K_("train", "stages", KEY_STAGES, stages, 0, 0, NULL),
};
#undef K_
static const int n_keys = (int)(sizeof keys / sizeof keys[0]);
static const char *const sections[] = {"model", "kda", "attention", "moe", "residual", "train"};

void lm_config_defaults(lm_config *c) {
    memset(c, 0, sizeof *c);
    c->vocab_size = 256;
    c->d_model = 64;
    c->n_layers = 4;
    c->mla_every = 4;
    c->last_layer_mla = 1;
    c->first_k_dense = 1;
    c->dense_ffn = 128;
    c->tie_embeddings = 0;
    c->norm_eps = 1e-6f;
    c->kda_heads = 2;
    c->kda_head_dim = 32;
    c->kda_chunk = 64;
    c->kda_conv_width = 4;
    c->kda_g_min = -5.0f;
    c->attn_kind = LM_ATTN_MLA;
    c->attn_heads = 2;
    c->attn_kv_heads = 2;
    c->q_lora_rank = 32;
    c->kv_lora_rank = 16;
    c->qk_head_dim = 32;
    c->v_head_dim = 32;
    c->n_routed_experts = 8;
    c->top_k = 2;
    c->n_shared_experts = 1;
    c->expert_ffn = 32;
    c->shared_ffn = 64;
    c->activation = LM_ACT_SWIGLU;
    c->route_scale = 1.0f;
    c->balance = LM_BALANCE_QUANTILE;
    c->balance_estimator = LM_QB_ZOOM;
    c->balance_bins = 1000;
    c->sign_rate = 1e-3f;
    c->aux_alpha = 1e-2f;
    c->residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c->attnres_block = 4;
    c->seq_len = 256;
    c->batch_size = 8;
    c->grad_accum = 1;
    c->steps = 1000;
    c->optimizer = LM_TRAIN_MUON;
    c->lr = 2e-2f;
    c->adam_lr = 3e-3f;
    c->min_lr_ratio = 0.1f;
    c->warmup_frac = 0.01f;
    c->decay_frac = 0.2f;
    c->schedule = LM_SCHEDULE_COSINE;
    c->weight_decay = 0.1f;
    c->grad_clip = 1.0f;
    c->grad_bucket_mb = 64.0f;
    c->qk_clip_tau = 100.0f;
    c->answer_loss_weight = 1.0f;
    c->grid_rows = 4;
    c->seed = 1234;
    c->log_every = 10;
    c->eval_every = 100;
    c->ckpt_every = 0;
    c->keep_checkpoints = 3;
    strcpy(c->data, "copy");
}

const char *lm_recompute_name(int recompute) {
    switch (recompute) {
    case LM_RECOMPUTE_NONE: return "false";
    case LM_RECOMPUTE_ALL: return "true";
    case LM_RECOMPUTE_CHANNEL: return "channel";
    case LM_RECOMPUTE_TOKEN: return "token";
    default: return "invalid";
    }
}

const char *lm_recompute_json(int recompute) {
    switch (recompute) {
    case LM_RECOMPUTE_CHANNEL: return "\"channel\"";
    case LM_RECOMPUTE_TOKEN: return "\"token\"";
    default: return lm_recompute_name(recompute);
    }
}

int lm_recompute_from_name(const char *name) {
    if (!name) return -1;
    if (!strcmp(name, "false") || !strcmp(name, "none")) return LM_RECOMPUTE_NONE;
    if (!strcmp(name, "true") || !strcmp(name, "all")) return LM_RECOMPUTE_ALL;
    if (!strcmp(name, "channel")) return LM_RECOMPUTE_CHANNEL;
    if (!strcmp(name, "token")) return LM_RECOMPUTE_TOKEN;
    return -1;
}

static int enum_index(const char *names, const char *value) {
    int i = 0;
    size_t n = strlen(value);
    for (const char *p = names; *p; i++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && !strncmp(p, value, n)) return i;
        if (!bar) break;
        p = bar + 1;
    }
    return -1;
}

/* train.stages: [{"name", "seq_len", "steps", "batch_tokens", "lr_scale", "data": {source: weight}}] */
static lm_status parse_stages(lm_config *c, const lm_json *v, const char *what) {
    if (v->kind != LM_JSON_ARRAY || v->count > LM_MAX_STAGES)
        return lm_error(LM_ERR_ARG, "%s: train.stages must be an array of at most %d stage objects", what, LM_MAX_STAGES);
    memset(c->stages, 0, sizeof c->stages);
    c->n_stages = 0; /* []: one stage from the train.* keys */
    int i = 0;
    for (const lm_json *e = v->child; e; e = e->next, i++) {
        lm_stage *st = &c->stages[i];
        snprintf(st->name, sizeof st->name, "stage%d", i + 1);
        st->lr_scale = 1.0f;
        if (e->kind != LM_JSON_OBJECT) return lm_error(LM_ERR_ARG, "%s: train.stages[%d] must be an object", what, i);
        for (const lm_json *m = e->child; m; m = m->next) {
            int is_int = m->kind == LM_JSON_NUMBER && m->number_is_integer;
            if (!strcmp(m->key, "name")) {
                if (m->kind != LM_JSON_STRING || m->string_length == 0 || m->string_length >= sizeof st->name ||
                    strlen(m->string) != m->string_length)
                    return lm_error(LM_ERR_ARG, "%s: train.stages[%d].name must be a string of 1 to 31 bytes", what, i);
                for (size_t j = 0; j < m->string_length; j++)
                    if (m->string[j] == '"' || m->string[j] == '\\' || (unsigned char)m->string[j] < 0x20)
                        return lm_error(LM_ERR_ARG, "%s: train.stages[%d].name has a character that needs escaping",
                                        what, i);
                memcpy(st->name, m->string, m->string_length + 1);
            } else if (!strcmp(m->key, "seq_len")) {
                if (!is_int || m->integer < 1 || m->integer > (1 << 24))
                    return lm_error(LM_ERR_ARG, "%s: train.stages[%d].seq_len must be an integer in [1, 16777216]", what, i);
                st->seq_len = (int)m->integer;
            } else if (!strcmp(m->key, "steps")) {
                if (!is_int || m->integer < 1 || m->integer > (int64_t)1e15)
                    return lm_error(LM_ERR_ARG, "%s: train.stages[%d].steps must be an integer in [1, 1e15] (as "
                                    "train.steps)", what, i);
                st->steps = m->integer;
            } else if (!strcmp(m->key, "batch_tokens")) {
                if (!is_int || m->integer < 1 || m->integer > (1 << 26))
                    return lm_error(LM_ERR_ARG, "%s: train.stages[%d].batch_tokens must be an integer in [1, 2^26]", what, i);
                st->batch_tokens = m->integer;
            } else if (!strcmp(m->key, "lr_scale")) {
                if (m->kind != LM_JSON_NUMBER || !(m->number > 0 && m->number <= 10))
                    return lm_error(LM_ERR_ARG, "%s: train.stages[%d].lr_scale must be a number in (0, 10]", what, i);
                st->lr_scale = (float)m->number;
            } else if (!strcmp(m->key, "data")) {
                if (m->kind != LM_JSON_OBJECT || m->count < 1 || m->count > LM_MAX_STAGE_DATA)
                    return lm_error(LM_ERR_ARG, "%s: train.stages[%d].data must be an object of 1 to %d "
                                    "\"source\": weight pairs", what, i, LM_MAX_STAGE_DATA);
                for (const lm_json *d = m->child; d; d = d->next) {
                    if (strlen(d->key) >= 64 || !d->key[0])
                        return lm_error(LM_ERR_ARG, "%s: train.stages[%d].data: a source name must have 1 to 63 "
                                        "bytes", what, i);
                    /* checked as stored (a float), so that config.json reads back */
                    if (d->kind != LM_JSON_NUMBER || !(d->number > 0 && d->number <= 1e30 && (float)d->number > 0))
                        return lm_error(LM_ERR_ARG, "%s: train.stages[%d].data: the weight of '%s' must be a number "
                                        "in (0, 1e30], got %s%g", what, i, d->key,
                                        d->kind == LM_JSON_NUMBER ? "" : "a non-number ",
                                        d->kind == LM_JSON_NUMBER ? d->number : 0.0);
                    for (const char *q = d->key; *q; q++)
                        if (*q == '"' || *q == '\\' || (unsigned char)*q < 0x20)
                            return lm_error(LM_ERR_ARG, "%s: train.stages[%d].data: a source name needs escaping", what, i);
                    snprintf(st->data[st->n_data], sizeof st->data[0], "%s", d->key);
                    st->weights[st->n_data++] = (float)d->number;
                }
            } else if (strcmp(m->key, "comment")) {
                return lm_error(LM_ERR_ARG, "%s: unknown key 'train.stages[%d].%s' (name, seq_len, steps, "
                                "batch_tokens, lr_scale, data)", what, i, m->key);
            }
        }
        if (!st->seq_len || !st->steps)
            return lm_error(LM_ERR_ARG, "%s: train.stages[%d] needs seq_len and steps", what, i);
    }
    c->n_stages = i;
    return LM_OK;
}

static lm_status set_key(lm_config *c, const key_spec *k, const lm_json *v, const char *what) {
    char *field = (char *)c + k->offset;
    if (k->type == KEY_ENUM) {
        int idx = v->kind == LM_JSON_STRING ? enum_index(k->enum_names, v->string) : -1;
        if (idx < 0)
            return lm_error(LM_ERR_ARG, "%s: %s.%s must be one of %s", what, k->section, k->name,
                            k->enum_names);
        memcpy(field, &idx, sizeof idx);
        return LM_OK;
    }
    if (k->type == KEY_LAYOUT) {
        if (v->kind != LM_JSON_STRING || v->string_length > LM_MAX_LAYERS)
            return lm_error(LM_ERR_ARG, "%s: %s.%s must be a string of at most %d letters "
                            "k (KDA) or m (MLA), one per layer", what, k->section, k->name, LM_MAX_LAYERS);
        for (size_t i = 0; i < v->string_length; i++)
            if (v->string[i] != 'k' && v->string[i] != 'm')
                return lm_error(LM_ERR_ARG, "%s: %s.%s has '%c' at layer %zu; use k (KDA) or m (MLA)",
                                what, k->section, k->name, v->string[i], i + 1);
        memcpy(field, v->string, v->string_length + 1);
        return LM_OK;
    }
    if (k->type == KEY_STRING) {
        if (v->kind != LM_JSON_STRING || v->string_length == 0 || v->string_length >= 64 ||
            strlen(v->string) != v->string_length)
            return lm_error(LM_ERR_ARG, "%s: %s.%s must be a non-empty string of at most 63 bytes", what,
                            k->section, k->name);
        memcpy(field, v->string, v->string_length + 1);
        return LM_OK;
    }
    if (k->type == KEY_STAGES) return parse_stages(c, v, what);
    if (k->type == KEY_RECOMPUTE) {
        int x = -1;
        if (v->kind == LM_JSON_BOOL) x = v->boolean ? LM_RECOMPUTE_ALL : LM_RECOMPUTE_NONE;
        else if (v->kind == LM_JSON_STRING && !strcmp(v->string, "channel")) x = LM_RECOMPUTE_CHANNEL;
        else if (v->kind == LM_JSON_STRING && !strcmp(v->string, "token")) x = LM_RECOMPUTE_TOKEN;
        if (x < 0)
            return lm_error(LM_ERR_ARG, "%s: %s.%s must be true (every sublayer), false (none), \"channel\" (the MoE "
                            "and dense FFN) or \"token\" (the KDA and attention)", what, k->section, k->name);
        memcpy(field, &x, sizeof x);
        return LM_OK;
    }
    if (k->type == KEY_BOOL) {
        if (v->kind != LM_JSON_BOOL)
            return lm_error(LM_ERR_ARG, "%s: %s.%s must be true or false", what, k->section, k->name);
        int b = v->boolean;
        memcpy(field, &b, sizeof b);
        return LM_OK;
    }
    if (v->kind != LM_JSON_NUMBER)
        return lm_error(LM_ERR_ARG, "%s: %s.%s must be a number", what, k->section, k->name);
    if (k->type != KEY_FLOAT && !v->number_is_integer)
        return lm_error(LM_ERR_ARG, "%s: %s.%s must be an integer, got %g", what, k->section, k->name,
                        v->number);
    /* float keys are checked as stored (float), so that the value written back to a
     * checkpoint's config.json reads back (1e-12 rounds to a float below 1e-12) */
    int in_range = k->type == KEY_FLOAT
                       ? (fabs(v->number) <= FLT_MAX && (float)v->number >= (float)k->lo &&
                          (float)v->number <= (float)k->hi)
                       : (v->number >= k->lo && v->number <= k->hi);
    if (!in_range)
        return lm_error(LM_ERR_ARG, "%s: %s.%s must lie in [%g, %g], got %g", what, k->section,
                        k->name, k->lo, k->hi, v->number);
    switch (k->type) {
    case KEY_INT: { int x = (int)v->integer; memcpy(field, &x, sizeof x); break; }
    case KEY_INT64: { int64_t x = v->integer; memcpy(field, &x, sizeof x); break; }
    case KEY_U64: { uint64_t x = (uint64_t)v->integer; memcpy(field, &x, sizeof x); break; }
    default: { float x = (float)v->number; memcpy(field, &x, sizeof x); break; }
    }
    return LM_OK;
}

lm_status lm_config_parse(const char *text, size_t len, const char *what, lm_config *c) {
    lm_json_doc *doc;
    lm_status s = lm_json_parse(text, len, what, &doc);
    if (s) return s;
    const lm_json *root = lm_json_root(doc);
    if (root->kind != LM_JSON_OBJECT) {
        lm_json_free(doc);
        return lm_error(LM_ERR_ARG, "%s: the config must be a JSON object of sections", what);
    }
    for (const lm_json *sec = root->child; sec && !s; sec = sec->next) {
        int known = 0;
        for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) known |= !strcmp(sec->key, sections[i]);
        if (!strcmp(sec->key, "comment")) continue;
        if (!known) {
            s = lm_error(LM_ERR_ARG, "%s: unknown section '%s' (known: model, kda, attention, moe, "
                         "residual, train)", what, sec->key);
            break;
        }
        if (sec->kind != LM_JSON_OBJECT) {
            s = lm_error(LM_ERR_ARG, "%s: section '%s' must be an object", what, sec->key);
            break;
        }
        for (const lm_json *m = sec->child; m && !s; m = m->next) {
            const key_spec *k = NULL;
            for (int i = 0; i < n_keys; i++)
                if (!strcmp(keys[i].section, sec->key) && !strcmp(keys[i].name, m->key)) k = &keys[i];
            if (!k && !strcmp(m->key, "comment")) continue;
            if (!k) {
                s = lm_error(LM_ERR_ARG, "%s: unknown key '%s.%s' (docs/config.md lists the keys)",
                             what, sec->key, m->key);
                break;
            }
            s = set_key(c, k, m, what);
        }
    }
    lm_json_free(doc);
    if (s) return s;
    s = lm_config_validate(c);
    if (s) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        return lm_error(s, "%s: %s", what, msg);
    }
    return LM_OK;
}

lm_status lm_config_load(const char *path, lm_config *c) {
    char *buf;
    size_t n;
    lm_status s = lm_read_file(path, (size_t)1 << 24, &buf, &n);
    if (s) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        return lm_error(s, "cannot open config (%s)", msg);
    }
    lm_config_defaults(c);
    s = lm_config_parse(buf, n, path, c);
    free(buf);
    return s;
}

lm_mixer_kind lm_config_mixer(const lm_config *c, int layer) {
    if (c->layout[0]) return c->layout[layer] == 'm' ? LM_MIXER_MLA : LM_MIXER_KDA;
    if (c->last_layer_mla && layer == c->n_layers - 1) return LM_MIXER_MLA;
    if (c->mla_every > 0 && (layer + 1) % c->mla_every == 0) return LM_MIXER_MLA;
    return LM_MIXER_KDA;
}

int lm_config_is_moe(const lm_config *c, int layer) { return layer >= c->first_k_dense; }

lm_status lm_config_validate(const lm_config *c) {
    if (c->layout[0] && (int)strlen(c->layout) != c->n_layers)
        return lm_error(LM_ERR_ARG, "model.layout has %zu letters but model.n_layers is %d",
                        strlen(c->layout), c->n_layers);
    if (c->first_k_dense > c->n_layers)
        return lm_error(LM_ERR_ARG, "model.first_k_dense (%d) exceeds model.n_layers (%d)",
                        c->first_k_dense, c->n_layers);
    if (c->kda_chunk != 16 && c->kda_chunk != 32 && c->kda_chunk != 64)
        return lm_error(LM_ERR_ARG, "kda.chunk must be 16, 32 or 64, got %d", c->kda_chunk);
    if (c->top_k >= c->n_routed_experts)
        return lm_error(LM_ERR_ARG, "moe.top_k (%d) must be smaller than moe.routed_experts (%d)",
                        c->top_k, c->n_routed_experts);
    if (c->attn_kind == LM_ATTN_GQA && c->attn_heads % c->attn_kv_heads)
        return lm_error(LM_ERR_ARG, "attention.heads (%d) must be a multiple of attention.kv_heads (%d)",
                        c->attn_heads, c->attn_kv_heads);
    if (c->rope_dims > c->qk_head_dim || c->rope_dims % 2)
        return lm_error(LM_ERR_ARG, "attention.rope_dims (%d) must be even and at most "
                        "attention.qk_head_dim (%d)", c->rope_dims, c->qk_head_dim);
    if (c->latent_dim > c->d_model)
        return lm_error(LM_ERR_ARG, "moe.latent_dim (%d) must not exceed model.d_model (%d)",
                        c->latent_dim, c->d_model);
    if (c->recompute < LM_RECOMPUTE_NONE || c->recompute > LM_RECOMPUTE_TOKEN)
        return lm_error(LM_ERR_ARG, "train.recompute (%d) must be one of none 0, all 1, channel 2, token 3",
                        c->recompute);
    if (c->recompute_chunk > 0 && !lm_recompute_sublayer(c->recompute, 1))
        return lm_error(LM_ERR_ARG, "train.recompute_chunk (%d) needs train.recompute = true or \"channel\" (the "
                        "chunked MoE and dense FFN are recomputed chunk by chunk)", c->recompute_chunk);
    if (c->recompute_chunk > 0 && c->balance == LM_BALANCE_AUX)
        return lm_error(LM_ERR_ARG, "train.recompute_chunk (%d) does not run with moe.balance = aux (its loss "
                        "couples every token of the batch); use 0", c->recompute_chunk);
    if (c->seq_segment < 0)
        return lm_error(LM_ERR_ARG, "train.seq_segment (%d) must be >= 0 (0: off)", c->seq_segment);
    if (c->answer_loss_weight != 1.0f && c->seq_segment > 0)
        return lm_error(LM_ERR_ARG, "train.answer_loss_weight (%g) does not run with train.seq_segment (%d): the "
                        "weighted loss needs each position's log-probability; use 1 or seq_segment 0",
                        (double)c->answer_loss_weight, c->seq_segment);
    if (c->answer_loss_weight != 1.0f && c->balance == LM_BALANCE_AUX)
        return lm_error(LM_ERR_ARG, "train.answer_loss_weight (%g) does not run with moe.balance = aux; use 1",
                        (double)c->answer_loss_weight);
    if (c->seq_segment > 0 && c->balance == LM_BALANCE_AUX)
        return lm_error(LM_ERR_ARG, "train.seq_segment (%d) does not run with moe.balance = aux (its loss "
                        "couples every token of the batch); use 0", c->seq_segment);
    lm_stage st[LM_MAX_STAGES];
    int ns = lm_config_stages(c, st);
    for (int i = 0; i < ns; i++)
        if (st[i].batch_tokens % st[i].seq_len)
            return lm_error(LM_ERR_ARG, "train.stages[%d]: batch_tokens (%lld) must be a multiple of seq_len (%d)", i,
                            (long long)st[i].batch_tokens, st[i].seq_len);
    if (c->warmup_frac + (c->schedule == LM_SCHEDULE_WSD ? c->decay_frac : 0) > 1)
        return lm_error(LM_ERR_ARG, "train.warmup_frac + train.decay_frac must not exceed 1");
    return LM_OK;
}

char *lm_config_to_json(const lm_config *c) {
    size_t cap = 8192, n = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    n += (size_t)snprintf(out + n, cap - n, "{");
    for (size_t si = 0; si < sizeof sections / sizeof sections[0]; si++) {
        n += (size_t)snprintf(out + n, cap - n, "%s\n  \"%s\": {", si ? "," : "", sections[si]);
        int first = 1;
        for (int i = 0; i < n_keys; i++) {
            const key_spec *k = &keys[i];
            if (strcmp(k->section, sections[si])) continue;
            const char *field = (const char *)c + k->offset;
            n += (size_t)snprintf(out + n, cap - n, "%s\n    \"%s\": ", first ? "" : ",", k->name);
            first = 0;
            switch (k->type) {
            case KEY_INT: { int x; memcpy(&x, field, sizeof x); n += (size_t)snprintf(out + n, cap - n, "%d", x); break; }
            case KEY_INT64: { int64_t x; memcpy(&x, field, sizeof x); n += (size_t)snprintf(out + n, cap - n, "%lld", (long long)x); break; }
            case KEY_U64: { uint64_t x; memcpy(&x, field, sizeof x); n += (size_t)snprintf(out + n, cap - n, "%llu", (unsigned long long)x); break; }
            case KEY_FLOAT: { float x; memcpy(&x, field, sizeof x); n += (size_t)snprintf(out + n, cap - n, "%.9g", (double)x); break; }
            case KEY_BOOL: { int x; memcpy(&x, field, sizeof x); n += (size_t)snprintf(out + n, cap - n, "%s", x ? "true" : "false"); break; }
            case KEY_RECOMPUTE: {
                int x;
                memcpy(&x, field, sizeof x);
                n += (size_t)snprintf(out + n, cap - n, "%s", lm_recompute_json(x));
                break;
            }
            case KEY_LAYOUT:
            case KEY_STRING: n += (size_t)snprintf(out + n, cap - n, "\"%s\"", field); break;
            case KEY_STAGES: {
                if (!c->n_stages) {
                    n += (size_t)snprintf(out + n, cap - n, "[]");
                    break;
                }
                n += (size_t)snprintf(out + n, cap - n, "[");
                for (int si = 0; si < c->n_stages; si++) {
                    const lm_stage *st = &c->stages[si];
                    if (n + 2048 > cap) {
                        cap *= 2;
                        char *o2 = realloc(out, cap);
                        if (!o2) { free(out); return NULL; }
                        out = o2;
                    }
                    n += (size_t)snprintf(out + n, cap - n, "%s\n      {\"name\": \"%s\", \"seq_len\": %d, \"steps\": %lld, "
                                          "\"lr_scale\": %.9g", si ? "," : "", st->name, st->seq_len,
                                          (long long)st->steps, (double)st->lr_scale);
                    if (st->batch_tokens)
                        n += (size_t)snprintf(out + n, cap - n, ", \"batch_tokens\": %lld", (long long)st->batch_tokens);
                    if (st->n_data) {
                        n += (size_t)snprintf(out + n, cap - n, ", \"data\": {");
                        for (int j = 0; j < st->n_data; j++)
                            n += (size_t)snprintf(out + n, cap - n, "%s\"%s\": %.9g", j ? ", " : "", st->data[j],
                                                  (double)st->weights[j]);
                        n += (size_t)snprintf(out + n, cap - n, "}");
                    }
                    n += (size_t)snprintf(out + n, cap - n, "}");
                }
                n += (size_t)snprintf(out + n, cap - n, "]");
                break;
            }
            case KEY_ENUM: {
                int x;
                memcpy(&x, field, sizeof x);
                const char *p = k->enum_names;
                for (int j = 0; j < x && p; j++) { p = strchr(p, '|'); if (p) p++; }
                size_t len = p ? (strchr(p, '|') ? (size_t)(strchr(p, '|') - p) : strlen(p)) : 0;
                n += (size_t)snprintf(out + n, cap - n, "\"%.*s\"", (int)len, p ? p : "");
                break;
            }
            }
            if (n + 600 > cap) {
                cap *= 2;
                char *o2 = realloc(out, cap);
                if (!o2) { free(out); return NULL; }
                out = o2;
            }
        }
        n += (size_t)snprintf(out + n, cap - n, "\n  }");
    }
    snprintf(out + n, cap - n, "\n}\n");
    return out;
}

/* ---- accounting ---- */

static const char *const part_names[LM_PART_COUNT] = {
    "embedding", "kda", "mla", "router", "routed experts", "shared experts", "dense ffn",
    "norms + attnres", "lm head"};
const char *lm_part_name(lm_part p) { return (unsigned)p < LM_PART_COUNT ? part_names[p] : "?"; }

void lm_config_plan(const lm_config *c, int64_t context, lm_plan *p) {
    memset(p, 0, sizeof *p);
    double d = c->d_model, V = c->vocab_size;
    double avg_ctx = (double)(context + 1) / 2.0; /* causal: mean number of keys per query */
    p->params[LM_PART_EMBEDDING] = V * d;
    p->active_params[LM_PART_EMBEDDING] = d;
    if (!c->tie_embeddings) p->params[LM_PART_LM_HEAD] = V * d;
    p->active_params[LM_PART_LM_HEAD] = V * d;
    p->flops_per_token[LM_PART_LM_HEAD] = 2 * V * d;
    int n_sub = 2 * c->n_layers;
    /* a pre-norm weight per sublayer; with AttnRes a pseudo-query and a key-norm weight
     * per sublayer and for the final AttnRes */
    p->params[LM_PART_ATTNRES_NORMS] = (double)n_sub * d;
    if (c->residual != LM_RESIDUAL_STANDARD) p->params[LM_PART_ATTNRES_NORMS] += (double)(n_sub + 1) * 2 * d;
    for (int l = 0; l < c->n_layers; l++) {
        if (lm_config_mixer(c, l) == LM_MIXER_KDA) {
            double hk = (double)c->kda_heads * c->kda_head_dim; /* K = V = head_dim */
            /* W_q, W_k, W_v, W_z, W_g (d -> hk), W_o (hk -> d), W_beta (d -> H) */
            double mat = 6 * d * hk + d * c->kda_heads;
            double vec = 3 * hk * c->kda_conv_width + c->kda_heads + hk + c->kda_head_dim;
            p->params[LM_PART_KDA] += mat + vec;
            p->active_params[LM_PART_KDA] += mat + vec;
            /* projections + chunked recurrence (~ 4 K*V multiply-adds per token per head) */
            p->flops_per_token[LM_PART_KDA] += 2 * mat + 2 * 4.0 * c->kda_heads * c->kda_head_dim * c->kda_head_dim;
            p->state_bytes_per_token[LM_PART_KDA] += 0; /* constant-size state, not per token */
        } else {
            double H = c->attn_heads, dq = c->qk_head_dim, dv = c->v_head_dim, mat;
            if (c->attn_kind == LM_ATTN_MLA) {
                mat = d * c->q_lora_rank + c->q_lora_rank * H * dq + d * c->kv_lora_rank +
                      c->kv_lora_rank * H * (dq + dv) + d * H * dv + H * dv * d;
                p->params[LM_PART_MLA] += mat + c->q_lora_rank + c->kv_lora_rank;
                p->state_bytes_per_token[LM_PART_MLA] += 2.0 * c->kv_lora_rank; /* latent cache */
            } else {
                double Hkv = c->attn_kv_heads;
                mat = d * H * dq + d * Hkv * (dq + dv) + d * H * dv + H * dv * d;
                p->params[LM_PART_MLA] += mat;
                p->state_bytes_per_token[LM_PART_MLA] += 2.0 * Hkv * (dq + dv);
            }
            p->active_params[LM_PART_MLA] += mat;
            p->flops_per_token[LM_PART_MLA] += 2 * mat + 2 * H * (dq + dv) * avg_ctx;
        }
        if (lm_config_is_moe(c, l)) {
            double n = c->n_routed_experts, k = c->top_k;
            double din = c->latent_dim ? c->latent_dim : d;
            double expert = 3 * din * c->expert_ffn;
            double lat = c->latent_dim ? 2 * d * c->latent_dim + c->latent_dim : 0;
            p->params[LM_PART_ROUTER] += n * d;
            p->active_params[LM_PART_ROUTER] += n * d;
            p->flops_per_token[LM_PART_ROUTER] += 2 * n * d;
            p->params[LM_PART_ROUTED_EXPERTS] += n * expert + lat;
            p->active_params[LM_PART_ROUTED_EXPERTS] += k * expert + lat;
            p->flops_per_token[LM_PART_ROUTED_EXPERTS] += 2 * (k * expert + lat - c->latent_dim);
            double shared = (double)c->n_shared_experts * 3 * d * c->shared_ffn;
            p->params[LM_PART_SHARED_EXPERTS] += shared;
            p->active_params[LM_PART_SHARED_EXPERTS] += shared;
            p->flops_per_token[LM_PART_SHARED_EXPERTS] += 2 * shared;
        } else {
            double ffn = 3 * d * c->dense_ffn;
            p->params[LM_PART_DENSE_FFN] += ffn;
            p->active_params[LM_PART_DENSE_FFN] += ffn;
            p->flops_per_token[LM_PART_DENSE_FFN] += 2 * ffn;
        }
    }
    p->params[LM_PART_ATTNRES_NORMS] += d; /* final norm */
    p->active_params[LM_PART_ATTNRES_NORMS] = p->params[LM_PART_ATTNRES_NORMS];
    for (int i = 0; i < LM_PART_COUNT; i++) {
        p->total_params += p->params[i];
        p->total_active += p->active_params[i];
        p->total_flops += p->flops_per_token[i];
    }
}

lm_status lm_config_cp_split(const lm_config *c, int64_t T, int R, lm_cp_split kind, int64_t *start) {
    if (!c || !start) return lm_error(LM_ERR_ARG, "context-parallel split: config or start is NULL");
    if (R < 1 || T < R)
        return lm_error(LM_ERR_ARG, "context parallelism: %lld tokens cannot give each of %d ranks a segment of at "
                        "least one token", (long long)T, R);
    if (kind != LM_CP_SPLIT_EVEN && kind != LM_CP_SPLIT_BALANCED)
        return lm_error(LM_ERR_ARG, "context-parallel split: unknown kind %d", (int)kind);
    const int64_t q = T / R, rem = T % R;
    for (int r = 0; r <= R; r++) start[r] = (int64_t)r * q + (r < rem ? r : rem);
    if (kind == LM_CP_SPLIT_EVEN) return LM_OK;
    /* the cost of tokens [0, b): b a + w b (b + 1) / 2, with a the FLOPs of a token without its
     * attention and w those of one query-key pair (lm_config_plan is linear in the mean context) */
    lm_plan p1, p2;
    lm_config_plan(c, 1, &p1);
    lm_config_plan(c, 3, &p2);
    const double w = p2.total_flops - p1.total_flops, a = p1.total_flops - w; /* mean contexts 1 and 2 */
    if (!(w > 0) || !(a >= 0)) return LM_OK; /* no attention: every token costs the same */
    const double total = (double)T * a + w * (double)T * (double)(T + 1) / 2.0;
    for (int r = 1; r < R; r++) {
        /* the b whose cumulative cost is nearest r / R of the whole: the positive root, then its neighbours */
        const double C = total * r / R, A = w / 2.0, Bq = a + w / 2.0;
        double bx = (-Bq + sqrt(Bq * Bq + 4.0 * A * C)) / (2.0 * A);
        int64_t b = (int64_t)floor(bx);
        double best = -1;
        int64_t pick = b;
        for (int64_t cand = b - 1; cand <= b + 2; cand++) {
            const double cost = (double)cand * a + w * (double)cand * (double)(cand + 1) / 2.0, dev = fabs(cost - C);
            if (best < 0 || dev < best) best = dev, pick = cand;
        }
        /* at least one token a segment, before and after */
        const int64_t lo = start[r - 1] + 1, hi = T - (R - r);
        start[r] = pick < lo ? lo : pick > hi ? hi : pick;
    }
    return LM_OK;
}

lm_status lm_cp_split_from_name(const char *name, lm_cp_split *kind) {
    if (name && !strcmp(name, "even")) *kind = LM_CP_SPLIT_EVEN;
    else if (name && !strcmp(name, "balanced")) *kind = LM_CP_SPLIT_BALANCED;
    else return lm_error(LM_ERR_ARG, "context-parallel split '%s': use even or balanced", name ? name : "(null)");
    return LM_OK;
}

const char *lm_cp_split_name(lm_cp_split kind) { return kind == LM_CP_SPLIT_BALANCED ? "balanced" : "even"; }

int lm_config_stages(const lm_config *c, lm_stage *out) {
    int64_t default_tokens = (int64_t)c->batch_size * c->seq_len;
    if (!c->n_stages) {
        memset(out, 0, sizeof *out);
        snprintf(out->name, sizeof out->name, "main");
        out->seq_len = c->seq_len;
        out->steps = c->steps;
        out->batch_tokens = default_tokens;
        out->lr_scale = 1.0f;
        return 1;
    }
    for (int i = 0; i < c->n_stages; i++) {
        out[i] = c->stages[i];
        if (!out[i].batch_tokens) out[i].batch_tokens = default_tokens;
    }
    return c->n_stages;
}

int64_t lm_config_total_steps(const lm_config *c) {
    lm_stage st[LM_MAX_STAGES];
    int n = lm_config_stages(c, st);
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += st[i].steps;
    return total;
}
