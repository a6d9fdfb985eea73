/* Agentic RL post-training: the warm start, the GRPO step, evaluation on
 * held-out seeds, checkpoints and resume (include/longmoe/rl_run.h, docs/rl.md). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "files.h"
#include "json.h"
#include "longmoe/model.h"
#include "longmoe/optim.h"
#include "longmoe/rl_run.h"
#include "longmoe/safetensors.h"
#include "longmoe/train.h"
#include "train/checkpoint.h"

/* ---- positions, advantages ---- */

void lm_rl_targets(const lm_rollout *r, int32_t *tgt, uint8_t *model_mask) {
    const int L = r->max_len;
    for (int b = 0; b < r->B; b++)
        for (int t = 0; t < L; t++) {
            size_t i = (size_t)b * L + t;
            int in = t + 1 < r->len[b];
            tgt[i] = in ? r->tokens[i + 1] : 0;
            model_mask[i] = in ? r->mask[i + 1] : 0;
        }
}

lm_status lm_rl_advantages(const lm_rollout *r, int G, lm_rl_credit credit, float gamma, float *adv) {
    const int B = r->B, L = r->max_len;
    if (G < 1 || B % G) return lm_error(LM_ERR_ARG, "lm_rl_advantages: group %d must divide the batch %d", G, B);
    const float eps = 1e-6f;
    memset(adv, 0, (size_t)B * L * sizeof(float));
    float *per = malloc((size_t)G * L * sizeof(float)), *norm = malloc((size_t)G * L * sizeof(float));
    if (!per || !norm) {
        free(per);
        free(norm);
        return lm_error(LM_ERR_MEMORY, "out of memory (advantages)");
    }
    lm_status s = LM_OK;
    for (int g0 = 0; g0 < B && !s; g0 += G) {
        if (credit == LM_CREDIT_OUTCOME) {
            /* A_i = (r_i - mean r) / (std r + eps) over the group's outcomes */
            for (int i = 0; i < G; i++) per[i] = (float)r->success[g0 + i];
            s = lm_grpo_advantages(per, 1, G, eps, norm);
            for (int i = 0; i < G && !s; i++)
                for (int t = 0; t + 1 < r->len[g0 + i]; t++) {
                    size_t k = (size_t)(g0 + i) * L + t;
                    if (r->mask[k + 1]) adv[k] = norm[i];
                }
        } else {
            /* R_k = sum_{j >= k} gamma^{j-k} r_j per trajectory, normalised over all turns of the group */
            int n = 0;
            for (int i = 0; i < G && !s; i++) {
                s = lm_rl_turn_returns(r->turn_reward + (size_t)(g0 + i) * L, r->n_turns[g0 + i], gamma, per + n);
                n += r->n_turns[g0 + i];
            }
            if (!s && n > 0) s = lm_rl_normalise(per, n, eps, norm);
            int base = 0;
            for (int i = 0; i < G && !s && n > 0; i++) {
                for (int t = 0; t + 1 < r->len[g0 + i]; t++) {
                    size_t k = (size_t)(g0 + i) * L + t;
                    int turn = r->turn[k + 1];
                    /* a model token after the last answered turn (cut by max_len) has no return */
                    if (r->mask[k + 1] && turn >= 0 && turn < r->n_turns[g0 + i]) adv[k] = norm[base + turn];
                }
                base += r->n_turns[g0 + i];
            }
        }
    }
    free(per);
    free(norm);
    return s;
}

/* ---- the run ---- */

typedef struct {
    lm_config cfg;
    lm_rl_config rc;
    lm_rl_options opt;
    lm_model *m, *ref;
    lm_rollout *ro;
    int B, T;
    lm_param *all, *muon_p, *adam_p;
    int n_all, n_muon, n_adam;
    lm_optimizer muon, adam;
    float *muon_state, *adam_state, *scratch;
    size_t muon_state_n, adam_state_n, scratch_n;
    int32_t *inp, *tgt;
    uint8_t *wmask;
    float *adv, *logp, *logp_old, *logp_ref, *dlogp;
    lm_env_config *envs;
    uint64_t *seeds;
    char *demo;
    uint8_t *demo_mask;
    int demo_cap;
    int64_t step, total;
    FILE *metrics;
    char metrics_path[4200];
} rl_run;

static void run_free(rl_run *r) {
    lm_rollout_free(r->ro);
    lm_model_free(r->m);
    lm_model_free(r->ref);
    free(r->all);
    free(r->muon_p);
    free(r->adam_p);
    free(r->muon_state);
    free(r->adam_state);
    free(r->scratch);
    free(r->inp);
    free(r->tgt);
    free(r->wmask);
    free(r->adv);
    free(r->logp);
    free(r->logp_old);
    free(r->logp_ref);
    free(r->dlogp);
    free(r->envs);
    free(r->seeds);
    free(r->demo);
    free(r->demo_mask);
    if (r->metrics) fclose(r->metrics);
}

/* Fresh optimizer state (the warm start's, then RL's). */
static lm_status init_optimizers(rl_run *r) {
    lm_optim_config oc = lm_optim_config_default();
    oc.weight_decay = r->cfg.weight_decay;
    TRY(lm_optimizer_init(&r->muon, &oc, r->muon_p, r->n_muon, r->muon_state, r->muon_state_n, r->scratch,
                          r->scratch_n));
    TRY(lm_optimizer_init(&r->adam, &oc, r->adam_p, r->n_adam, r->adam_state, r->adam_state_n, r->scratch,
                          r->scratch_n));
    return LM_OK;
}

/* Buffers, optimizers and the rollout for the model r->m. */
static lm_status run_setup(rl_run *r) {
    r->n_all = lm_model_num_tensors(r->m);
    r->all = calloc((size_t)r->n_all, sizeof *r->all);
    r->muon_p = calloc((size_t)r->n_all, sizeof *r->muon_p);
    r->adam_p = calloc((size_t)r->n_all, sizeof *r->adam_p);
    if (!r->all || !r->muon_p || !r->adam_p) return lm_error(LM_ERR_MEMORY, "out of memory (rl)");
    lm_model_optimizer_params(r->m, r->all, r->cfg.optimizer);
    for (int i = 0; i < r->n_all; i++) {
        if (lm_param_optimizer(&r->all[i]) == LM_OPT_MUON) r->muon_p[r->n_muon++] = r->all[i];
        else r->adam_p[r->n_adam++] = r->all[i];
    }
    r->muon_state_n = lm_optim_state_floats(r->muon_p, r->n_muon);
    r->adam_state_n = lm_optim_state_floats(r->adam_p, r->n_adam);
    r->scratch_n = lm_optim_scratch_floats(r->muon_p, r->n_muon);
    r->muon_state = calloc(r->muon_state_n + 1, sizeof(float));
    r->adam_state = calloc(r->adam_state_n + 1, sizeof(float));
    r->scratch = calloc(r->scratch_n + 1, sizeof(float));
    const size_t n = (size_t)r->B * r->T;
    r->inp = calloc(n, sizeof(int32_t));
    r->tgt = calloc(n, sizeof(int32_t));
    r->wmask = calloc(n, 1);
    r->adv = calloc(n, sizeof(float));
    r->logp = calloc(n, sizeof(float));
    r->logp_old = calloc(n, sizeof(float));
    r->logp_ref = calloc(n, sizeof(float));
    r->dlogp = calloc(n, sizeof(float));
    r->envs = calloc((size_t)r->B, sizeof *r->envs);
    r->seeds = calloc((size_t)r->B, sizeof *r->seeds);
    /* a demonstration of the largest difficulty: about 16 bytes a step for 3 d + 4 turns, plus the prompt */
    r->demo_cap = LM_ENV_MAX_PROMPT + (3 * LM_ENV_MAX_DIFFICULTY + 4) * (LM_ENV_MAX_LINE + 1 + LM_ENV_MAX_TEXT);
    r->demo = malloc((size_t)r->demo_cap);
    r->demo_mask = malloc((size_t)r->demo_cap);
    if (!r->muon_state || !r->adam_state || !r->scratch || !r->inp || !r->tgt || !r->wmask || !r->adv || !r->logp ||
        !r->logp_old || !r->logp_ref || !r->dlogp || !r->envs || !r->seeds || !r->demo || !r->demo_mask)
        return lm_error(LM_ERR_MEMORY, "out of memory (rl buffers for %d x %d tokens)", r->B, r->T);
    TRY(init_optimizers(r));
    TRY(lm_rollout_create(r->m, r->B, r->T, &r->ro));
    if (r->rc.kl_coef > 0) {
        TRY(lm_model_create(&r->cfg, r->B, r->T, &r->ref));
        TRY(lm_model_copy_state(r->ref, r->m));
    }
    return LM_OK;
}

/* ---- episodes: training seeds are even; held-out and selection seeds odd,
 * from two streams that share no seed over j < 2^20 (tests/test_rl_run.c) ---- */

static void train_episode(const rl_run *r, uint64_t stream, int64_t index, lm_env_config *ec, uint64_t *seed) {
    const lm_rl_config *c = &r->rc;
    uint64_t h = lm_mix64(c->seed ^ lm_mix64(stream + 0x9e3779b97f4a7c15ull * (uint64_t)(index + 1)));
    ec->kind = c->envs[(uint64_t)index % (uint64_t)c->n_envs];
    ec->difficulty = c->difficulty_min + (int)((h >> 32) % (uint64_t)(c->difficulty_max - c->difficulty_min + 1));
    ec->max_turns = 0;
    *seed = lm_mix64(h) & ~1ull;
}

uint64_t lm_rl_eval_seed(lm_rl_split split, lm_env_kind kind, int j) {
    /* "select" and "holdout" in ASCII */
    uint64_t stream = split == LM_RL_SPLIT_SELECT ? 0x73656c656374ull : 0x686f6c646f7574ull;
    return lm_mix64(stream ^ ((uint64_t)kind << 40) ^ (uint64_t)j) | 1ull;
}

static void eval_episode(const lm_rl_config *c, lm_rl_split split, lm_env_kind kind, int j, lm_env_config *ec,
                         uint64_t *seed) {
    ec->kind = kind;
    ec->difficulty = c->difficulty_min + j % (c->difficulty_max - c->difficulty_min + 1);
    ec->max_turns = 0;
    *seed = lm_rl_eval_seed(split, kind, j);
}

/* ---- one update: gradients in the model, clipping, both optimizers ---- */

static lm_status apply_update(rl_run *r, float lr, float adam_lr, double *gnorm) {
    lm_status s = lm_grad_clip(r->all, r->n_all, r->rc.grad_clip, gnorm);
    if (s) return lm_error(s, "non-finite gradient at step %lld", (long long)r->step);
    TRY(lm_optimizer_step(&r->muon, lr));
    TRY(lm_optimizer_step(&r->adam, adam_lr));
    return LM_OK;
}

/* Supervised step on B demonstrations: the loss -sum_t w_t log p(y_t) / sum w
 * with w the model mask (environment bytes carry none). */
static lm_status warm_step(rl_run *r, double *loss_out, double *gnorm) {
    const int B = r->B, T = r->T;
    memset(r->inp, 0, (size_t)B * T * sizeof(int32_t));
    memset(r->tgt, 0, (size_t)B * T * sizeof(int32_t));
    memset(r->wmask, 0, (size_t)B * T);
    int64_t weight = 0;
    for (int b = 0; b < B; b++) {
        lm_env_config ec;
        uint64_t seed;
        int len;
        train_episode(r, 0x7761726dull, r->step * B + b, &ec, &seed);
        TRY(lm_env_demo(&ec, seed, r->demo, r->demo_mask, r->demo_cap, &len));
        for (int t = 0; t < T && t < len; t++) {
            size_t i = (size_t)b * T + t;
            r->inp[i] = (unsigned char)r->demo[t];
            if (t + 1 < len) {
                r->tgt[i] = (unsigned char)r->demo[t + 1];
                r->wmask[i] = r->demo_mask[t + 1];
                weight += r->wmask[i];
            }
        }
    }
    if (weight == 0) return lm_error(LM_ERR_ARG, "warm start: no model bytes within rl.max_len");
    TRY(lm_model_forward(r->m, r->inp, r->tgt, 0, NULL));
    TRY(lm_model_token_logprobs(r->m, r->logp));
    double loss = 0;
    for (size_t i = 0; i < (size_t)B * T; i++) {
        r->dlogp[i] = r->wmask[i] ? -1.0f / (float)weight : 0.0f;
        if (r->wmask[i]) loss -= r->logp[i];
    }
    *loss_out = loss / (double)weight;
    lm_model_zero_grads(r->m);
    TRY(lm_model_backward_weighted(r->m, r->dlogp));
    return apply_update(r, r->rc.warm_lr, r->rc.warm_adam_lr, gnorm);
}

typedef struct {
    double reward, success, turn_reward, length, model_tokens, turns, malformed, truncated, logp_gap, grad_norm;
    double succ_env[LM_ENV_COUNT];
    int n_env[LM_ENV_COUNT];
    lm_grpo_stats first, last; /* the objective at the first and the last update of the step */
} rl_step_stats;

/* One RL step: G rollouts per task, advantages, `epochs` clipped updates. */
static lm_status rl_step(rl_run *r, rl_step_stats *st) {
    const lm_rl_config *c = &r->rc;
    const int B = r->B, T = r->T, G = c->group;
    const int64_t N = (int64_t)B * T;
    memset(st, 0, sizeof *st);
    for (int i = 0; i < c->tasks; i++) {
        lm_env_config ec;
        uint64_t seed;
        train_episode(r, 0x72756e73ull, r->step * c->tasks + i, &ec, &seed);
        for (int g = 0; g < G; g++) {
            r->envs[i * G + g] = ec;
            r->seeds[i * G + g] = seed;
        }
    }
    lm_rollout_config rcfg = {c->temperature, c->top_p};
    TRY(lm_rollout_run(r->ro, r->envs, r->seeds, &rcfg, lm_mix64(c->seed ^ lm_mix64(0x73616d70ull + (uint64_t)r->step))));
    const lm_rollout *ro = r->ro;
    for (int b = 0; b < B; b++) {
        double tr = 0;
        for (int k = 0; k < ro->n_turns[b]; k++) tr += ro->turn_reward[(size_t)b * T + k];
        st->success += ro->success[b];
        st->turn_reward += tr;
        st->length += ro->len[b];
        st->turns += ro->n_turns[b];
        st->malformed += ro->malformed[b];
        st->truncated += ro->truncated[b];
        st->succ_env[r->envs[b].kind] += ro->success[b];
        st->n_env[r->envs[b].kind]++;
    }
    st->reward = (c->credit == LM_CREDIT_TURN ? st->turn_reward : st->success) / B;
    st->success /= B;
    st->turn_reward /= B;
    st->length /= B;
    st->turns /= B;
    st->malformed /= B;
    st->truncated /= B;
    lm_rl_targets(ro, r->tgt, r->wmask);
    TRY(lm_rl_advantages(ro, G, c->credit, c->gamma, r->adv));
    /* pi_old: the sampling parameters' log-probabilities by the full forward
     * (the decoder's agree to rounding: logp_gap) */
    TRY(lm_model_forward(r->m, ro->tokens, r->tgt, 0, NULL));
    TRY(lm_model_token_logprobs(r->m, r->logp_old));
    for (int64_t i = 0; i < N; i++)
        if (r->wmask[i]) {
            double gap = fabs((double)r->logp_old[i] - ro->logp[i + 1]);
            st->logp_gap = gap > st->logp_gap ? gap : st->logp_gap;
            st->model_tokens++;
        }
    st->model_tokens /= B;
    if (r->ref) {
        TRY(lm_model_forward(r->ref, ro->tokens, r->tgt, 0, NULL));
        TRY(lm_model_token_logprobs(r->ref, r->logp_ref));
    }
    lm_grpo_config gc = {c->clip_low, c->clip_high, c->kl_coef};
    for (int e = 0; e < c->epochs; e++) {
        if (e > 0) {
            TRY(lm_model_forward(r->m, ro->tokens, r->tgt, 0, NULL));
            TRY(lm_model_token_logprobs(r->m, r->logp));
        } else {
            memcpy(r->logp, r->logp_old, (size_t)N * sizeof(float));
        }
        lm_grpo_stats gs;
        TRY(lm_grpo_loss(&gc, r->logp, r->logp_old, r->ref ? r->logp_ref : NULL, r->adv, r->wmask, N, r->dlogp, &gs));
        if (e == 0) st->first = gs;
        st->last = gs;
        lm_model_zero_grads(r->m);
        TRY(lm_model_backward_weighted(r->m, r->dlogp));
        TRY(apply_update(r, c->lr, c->adam_lr, &st->grad_norm));
    }
    return LM_OK;
}

/* Greedy success on the evaluation split's seeds, per environment of rl.envs. */
static lm_status evaluate(rl_run *r, const char *phase, double *success) {
    const lm_rl_config *c = &r->rc;
    const int B = r->B;
    lm_rollout_config greedy = {0.0f, 1.0f};
    double mean = 0;
    const int sel = r->opt.eval_split == LM_RL_SPLIT_SELECT;
    fprintf(r->metrics, "{\"type\": \"rl_eval\", \"step\": %lld, \"phase\": \"%s\"%s", (long long)r->step, phase,
            sel ? ", \"split\": \"select\"" : "");
    for (int e = 0; e < c->n_envs; e++) {
        int solved = 0;
        double length = 0;
        for (int j0 = 0; j0 < c->eval_episodes; j0 += B) {
            for (int b = 0; b < B; b++) {
                int j = j0 + b < c->eval_episodes ? j0 + b : j0; /* the batch's tail repeats an episode, uncounted */
                eval_episode(c, r->opt.eval_split, c->envs[e], j, &r->envs[b], &r->seeds[b]);
            }
            TRY(lm_rollout_run(r->ro, r->envs, r->seeds, &greedy, 0));
            for (int b = 0; b < B && j0 + b < c->eval_episodes; b++) {
                solved += r->ro->success[b];
                length += r->ro->len[b];
            }
        }
        success[e] = (double)solved / c->eval_episodes;
        mean += success[e] / c->n_envs;
        const char *name = lm_env_kind_name(c->envs[e]);
        fprintf(r->metrics, ", \"%s\": %.6g, \"%s_length\": %.6g", name, success[e], name, length / c->eval_episodes);
    }
    fprintf(r->metrics, ", \"success\": %.6g}\n", mean);
    fflush(r->metrics);
    if (r->opt.progress) {
        fprintf(r->opt.progress, "eval  step %lld (%s) | %s greedy success", (long long)r->step, phase,
                sel ? "selection" : "held-out");
        for (int e = 0; e < c->n_envs; e++)
            fprintf(r->opt.progress, " | %s %.1f%%", lm_env_kind_name(c->envs[e]), 100 * success[e]);
        fprintf(r->opt.progress, "\n");
        fflush(r->opt.progress);
    }
    return LM_OK;
}

/* ---- checkpoints ---- */

static lm_status write_files(rl_run *r, const char *tmp, long long metrics_bytes) {
    char path[4300];
    lm_status s = LM_OK;
    /* model.safetensors and config.json: the trainer's writer */
    if ((s = lm_checkpoint_write_model(r->m, &r->cfg, tmp))) return s;
    /* trainer.safetensors: optimizer moments, balancing state, the reference */
    lm_st_writer *w = lm_st_writer_new();
    if (!w) return lm_error(LM_ERR_MEMORY, "out of memory (checkpoint)");
    int64_t n_m[1] = {(int64_t)r->muon_state_n}, n_a[1] = {(int64_t)r->adam_state_n};
    int64_t n_p[1] = {(int64_t)lm_model_num_params(r->m)};
    s = lm_st_writer_add(w, "optim.muon_state", LM_DTYPE_F32, 1, n_m, r->muon_state);
    if (!s) s = lm_st_writer_add(w, "optim.adam_state", LM_DTYPE_F32, 1, n_a, r->adam_state);
    if (!s) s = lm_checkpoint_add_balance(w, r->m);
    if (!s && r->ref && r->step > r->rc.warm_steps)
        s = lm_st_writer_add(w, "rl.reference", LM_DTYPE_F32, 1, n_p, lm_model_params(r->ref));
    snprintf(path, sizeof path, "%s/trainer.safetensors", tmp);
    if (!s) s = lm_st_writer_save(w, path);
    lm_st_writer_free(w);
    if (s) return s;
    /* rl.json: counters and the rl section */
    char *rl = lm_rl_config_to_json(&r->rc);
    if (!rl) return lm_error(LM_ERR_MEMORY, "out of memory writing rl.json");
    lm_text t = {0};
    lm_text_printf(&t, "{\"step\": %lld, \"muon_step\": %lld, \"adam_step\": %lld, \"metrics_bytes\": %lld, %s",
                   (long long)r->step, (long long)r->muon.step, (long long)r->adam.step, metrics_bytes, rl + 1);
    free(rl);
    snprintf(path, sizeof path, "%s/rl.json", tmp);
    s = t.failed ? lm_error(LM_ERR_MEMORY, "out of memory writing rl.json") : lm_write_text_atomic(path, t.s);
    lm_text_free(&t);
    return s;
}

static lm_status save_checkpoint(rl_run *r) {
    char tmp[4096];
    fflush(r->metrics);
    long long bytes = ftell(r->metrics);
    TRY(lm_checkpoint_begin(r->opt.out_dir, r->step, tmp, sizeof tmp));
    lm_status s = write_files(r, tmp, bytes);
    if (s) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        lm_checkpoint_abort(tmp);
        return lm_error(s, "%s", msg);
    }
    TRY(lm_checkpoint_commit(r->opt.out_dir, r->step, tmp, r->rc.keep_checkpoints));
    fprintf(r->metrics, "{\"type\": \"checkpoint\", \"step\": %lld}\n", (long long)r->step);
    fflush(r->metrics);
    return LM_OK;
}

static lm_status load_f32(const lm_safetensors *st, const char *path, const char *name, float *dst, size_t n) {
    const lm_st_tensor *t = lm_safetensors_find(st, name);
    if (!t) return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' is missing", path, name);
    if (t->dtype != LM_DTYPE_F32 || (size_t)t->numel != n)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' is %s with %lld elements, expected F32 with %zu", path, name,
                        lm_dtype_name(t->dtype), (long long)t->numel, n);
    memcpy(dst, t->data, t->nbytes);
    return LM_OK;
}

/* The counters and the rl section of a checkpoint's rl.json. */
static lm_status read_rl_json(const char *dir, lm_rl_config *rc, int64_t counters[4]) {
    char path[4300];
    snprintf(path, sizeof path, "%s/rl.json", dir);
    char *text;
    size_t len;
    TRY(lm_read_file(path, LM_TEXT_FILE_MAX, &text, &len));
    lm_rl_config_defaults(rc);
    lm_status s = lm_rl_config_parse(text, len, path, rc);
    lm_json_doc *doc = NULL;
    if (!s) s = lm_json_parse(text, len, path, &doc);
    free(text);
    if (s) return s;
    const char *names[4] = {"step", "muon_step", "adam_step", "metrics_bytes"};
    for (int i = 0; i < 4 && !s; i++) {
        const lm_json *v = lm_json_get(lm_json_root(doc), names[i]);
        if (!v || v->kind != LM_JSON_NUMBER || !v->number_is_integer || v->integer < 0)
            s = lm_error(LM_ERR_FORMAT, "%s: missing or bad counter '%s'", path, names[i]);
        else counters[i] = v->integer;
    }
    lm_json_free(doc);
    return s;
}

/* The optimizer state and the reference of a checkpoint into a set-up run. */
static lm_status load_state(rl_run *r, const char *dir, const int64_t counters[4]) {
    char path[4300];
    snprintf(path, sizeof path, "%s/trainer.safetensors", dir);
    lm_safetensors *st;
    TRY(lm_safetensors_open(path, &st));
    lm_status s = load_f32(st, path, "optim.muon_state", r->muon_state, r->muon_state_n);
    if (!s) s = load_f32(st, path, "optim.adam_state", r->adam_state, r->adam_state_n);
    if (!s && r->ref && counters[0] > r->rc.warm_steps)
        s = load_f32(st, path, "rl.reference", lm_model_params(r->ref), lm_model_num_params(r->ref));
    lm_safetensors_close(st);
    r->step = counters[0];
    r->muon.step = counters[1];
    r->adam.step = counters[2];
    return s;
}

/* Cut metrics.jsonl back to what was written when the checkpoint was. */
static lm_status truncate_metrics(const char *path, int64_t bytes) {
    if (truncate(path, (off_t)bytes) != 0) return lm_error(LM_ERR_IO, "cannot cut '%s' back to %lld bytes", path, (long long)bytes);
    return LM_OK;
}

static void log_step(rl_run *r, const rl_step_stats *st, double seconds) {
    const lm_rl_config *c = &r->rc;
    fprintf(r->metrics,
            "{\"type\": \"rl\", \"step\": %lld, \"reward\": %.6g, \"success\": %.6g, \"turn_reward\": %.6g, "
            "\"length\": %.6g, \"model_tokens\": %.6g, \"turns\": %.6g, \"malformed\": %.6g, \"truncated\": %.6g, "
            "\"loss\": %.9g, \"kl_ref\": %.6g, \"kl_old\": %.6g, \"clipped_frac\": %.6g, \"entropy\": %.6g, "
            "\"ratio_mean\": %.6g, \"grad_norm\": %.6g, \"logp_gap\": %.3g, \"lr\": %.6g, \"step_seconds\": %.4g",
            (long long)r->step, st->reward, st->success, st->turn_reward, st->length, st->model_tokens, st->turns,
            st->malformed, st->truncated, st->first.loss, st->last.kl_ref, st->last.kl_old, st->last.clipped_frac,
            st->first.entropy, st->last.ratio_mean, st->grad_norm, st->logp_gap, c->lr, seconds);
    for (int e = 0; e < c->n_envs; e++) {
        int k = c->envs[e];
        fprintf(r->metrics, ", \"success_%s\": %.6g", lm_env_kind_name(c->envs[e]),
                st->n_env[k] ? st->succ_env[k] / st->n_env[k] : 0.0);
    }
    fprintf(r->metrics, "}\n");
    if (r->opt.progress && (r->step % c->log_every == 0 || r->step == r->total)) {
        fprintf(r->opt.progress,
                "rl    step %lld/%lld | success %.3f | reward %.3f | len %.0f | kl_old %.4f | clip %.3f | "
                "entropy %.3f | grad %.3f | %.2f s\n",
                (long long)r->step, (long long)r->total, st->success, st->reward, st->length, st->last.kl_old,
                st->last.clipped_frac, st->first.entropy, st->grad_norm, seconds);
        fflush(r->opt.progress);
    }
}

lm_status lm_rl_run(const lm_config *model_cfg, const lm_rl_config *rl_cfg, const lm_rl_options *opt,
                    lm_rl_result *result) {
    rl_run r;
    memset(&r, 0, sizeof r);
    if (!opt || !opt->out_dir || (!opt->resume && (!model_cfg || !rl_cfg)))
        return lm_error(LM_ERR_ARG, "lm_rl_run: out_dir, and the configs unless resuming, are required");
    r.opt = *opt;
    double t_start = lm_time_seconds();
    if (result) {
        memset(result, 0, sizeof *result);
        for (int e = 0; e < LM_ENV_COUNT; e++) result->warm_success[e] = result->final_success[e] = NAN;
    }
    char ckpt[4096];
    int64_t counters[4] = {0, 0, 0, 0};
    lm_status s = lm_ensure_dir(opt->out_dir);
    if (s) goto done;
    snprintf(r.metrics_path, sizeof r.metrics_path, "%s/metrics.jsonl", opt->out_dir);
    if (opt->resume) {
        if ((s = lm_checkpoint_latest(opt->out_dir, ckpt, sizeof ckpt))) goto done;
        if ((s = read_rl_json(ckpt, &r.rc, counters))) goto done;
    } else {
        r.rc = *rl_cfg;
    }
    r.B = r.rc.tasks * r.rc.group;
    r.T = r.rc.max_len;
    /* the model: the checkpoint resumed, the --init checkpoint, or a fresh one */
    if (opt->resume || opt->init) {
        if ((s = lm_checkpoint_load_model(opt->resume ? ckpt : opt->init, r.B, r.T, &r.cfg, &r.m))) goto done;
    } else {
        r.cfg = *model_cfg;
        r.cfg.batch_size = r.B; /* as a checkpoint's config reads back */
        r.cfg.seq_len = r.T;
        if ((s = lm_model_create(&r.cfg, r.B, r.T, &r.m))) goto done;
        lm_model_init(r.m, r.cfg.seed);
    }
    if (r.cfg.vocab_size < 256) {
        s = lm_error(LM_ERR_ARG, "rl: the environments speak bytes; model.vocab_size is %d < 256", r.cfg.vocab_size);
        goto done;
    }
    if ((s = run_setup(&r))) goto done;
    if (opt->resume) {
        if ((s = load_state(&r, ckpt, counters))) goto done;
        if ((s = truncate_metrics(r.metrics_path, counters[3]))) goto done;
    } else {
        char path[4300], *json = lm_config_to_json(&r.cfg);
        snprintf(path, sizeof path, "%s/config.json", opt->out_dir);
        s = json ? lm_write_text_atomic(path, json) : lm_error(LM_ERR_MEMORY, "out of memory");
        free(json);
        json = s ? NULL : lm_rl_config_to_json(&r.rc);
        snprintf(path, sizeof path, "%s/rl.json", opt->out_dir);
        if (!s) s = json ? lm_write_text_atomic(path, json) : lm_error(LM_ERR_MEMORY, "out of memory");
        free(json);
        if (!s) s = lm_write_text_atomic(r.metrics_path, "");
        if (s) goto done;
    }
    r.metrics = fopen(r.metrics_path, "ab");
    if (!r.metrics) {
        s = lm_error(LM_ERR_IO, "cannot open '%s' for appending", r.metrics_path);
        goto done;
    }
    const lm_rl_config *c = &r.rc;
    r.total = c->warm_steps + c->steps;
    int64_t stop = opt->stop_after > 0 && opt->stop_after < r.total ? opt->stop_after : r.total;
    if (opt->progress)
        fprintf(opt->progress, "%s rl: %zu parameters, %d warm-start steps then %lld RL steps of %d tasks x %d samples\n",
                opt->resume ? "resumed" : "starting", lm_model_num_params(r.m), c->warm_steps, (long long)c->steps,
                c->tasks, c->group);
    double succ[LM_ENV_COUNT];
    int begun = 0;
    for (;;) {
        /* RL begins: the warm start's success is the baseline; the reference
         * freezes here; the optimizer starts afresh. A run stopped right at the
         * boundary does this when resumed. */
        if (r.step == c->warm_steps && !begun && (r.step < stop || r.step == r.total)) {
            begun = 1;
            if ((s = evaluate(&r, "warm", succ))) goto done;
            if (result)
                for (int e = 0; e < c->n_envs; e++) result->warm_success[e] = succ[e];
            if ((s = init_optimizers(&r))) goto done;
            if (r.ref && (s = lm_model_copy_state(r.ref, r.m))) goto done;
        }
        if (r.step >= stop) break;
        double t0 = lm_time_seconds(), gnorm = 0;
        if (r.step < c->warm_steps) {
            double loss = 0;
            if ((s = warm_step(&r, &loss, &gnorm))) goto done;
            r.step++;
            double dt = lm_time_seconds() - t0;
            fprintf(r.metrics, "{\"type\": \"rl_warm\", \"step\": %lld, \"loss\": %.9g, \"grad_norm\": %.6g, "
                    "\"step_seconds\": %.4g}\n", (long long)r.step, loss, gnorm, dt);
            if (opt->progress && (r.step % c->log_every == 0 || r.step == c->warm_steps))
            {
                fprintf(opt->progress, "warm  step %lld/%d | loss %.4f | grad %.3f | %.2f s\n", (long long)r.step,
                        c->warm_steps, loss, gnorm, dt);
                fflush(opt->progress);
            }
        } else {
            rl_step_stats st;
            if ((s = rl_step(&r, &st))) goto done;
            r.step++;
            log_step(&r, &st, lm_time_seconds() - t0);
            int64_t rl_done = r.step - c->warm_steps;
            if (c->eval_every > 0 && rl_done % c->eval_every == 0 && r.step < r.total && (s = evaluate(&r, "rl", succ)))
                goto done;
        }
        fflush(r.metrics);
        if (c->ckpt_every > 0 && r.step % c->ckpt_every == 0 && r.step < stop && (s = save_checkpoint(&r))) goto done;
    }
    if (r.step == r.total && c->steps > 0) {
        if ((s = evaluate(&r, "final", succ))) goto done;
        if (result)
            for (int e = 0; e < c->n_envs; e++) result->final_success[e] = succ[e];
    }
    if ((s = save_checkpoint(&r))) goto done;
    if (opt->progress)
        fprintf(opt->progress, "done: step %lld in %.1f s, checkpoint in %s\n", (long long)r.step,
                lm_time_seconds() - t_start, opt->out_dir);
    if (result) {
        result->step = r.step;
        result->n_envs = c->n_envs;
        memcpy(result->envs, c->envs, sizeof c->envs);
        result->seconds = lm_time_seconds() - t_start;
    }
done:
    run_free(&r);
    return s;
}
