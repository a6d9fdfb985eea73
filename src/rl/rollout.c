/* Batched rollouts through the decoder (include/longmoe/rl_rollout.h, docs/rl.md). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/rl_rollout.h"

struct lm_rollout_work {
    lm_decoder *dec;
    int V;
    float *logits;  /* [B, V] */
    int32_t *feed;  /* [B] the tokens of one step; [B, T0] for the prefill */
    int *known;     /* [B] bytes written so far (forced ones may run ahead of the decoder) */
    int *done;      /* [B] */
    int *line_n;    /* [B] bytes of the model line being written */
    char *line;     /* [B, LM_ENV_MAX_LINE + 2] */
    lm_rng *rng;    /* [B] */
    void *sample_work;
};

void lm_rollout_free(lm_rollout *r) {
    if (!r) return;
    if (r->work) {
        lm_decoder_free(r->work->dec);
        free(r->work->logits);
        free(r->work->feed);
        free(r->work->known);
        free(r->work->done);
        free(r->work->line_n);
        free(r->work->line);
        free(r->work->rng);
        free(r->work->sample_work);
        free(r->work);
    }
    free(r->tokens);
    free(r->mask);
    free(r->logp);
    free(r->turn);
    free(r->turn_reward);
    free(r->len);
    free(r->n_turns);
    free(r->success);
    free(r->malformed);
    free(r->truncated);
    free(r->env);
    free(r);
}

lm_status lm_rollout_create(lm_model *m, int B, int max_len, lm_rollout **out) {
    if (!out || !m) return lm_error(LM_ERR_ARG, "lm_rollout_create: model and out are required");
    *out = NULL;
    if (B < 1 || max_len < 2 || (int64_t)B * max_len > (1 << 26))
        return lm_error(LM_ERR_ARG, "lm_rollout_create: B=%d, max_len=%d out of range (B >= 1, max_len >= 2)", B,
                        max_len);
    lm_rollout *r = calloc(1, sizeof *r);
    lm_rollout_work *w = calloc(1, sizeof *w);
    if (!r || !w) {
        free(r);
        free(w);
        return lm_error(LM_ERR_MEMORY, "out of memory (rollout)");
    }
    r->work = w;
    r->B = B;
    r->max_len = max_len;
    const size_t n = (size_t)B * max_len;
    w->V = lm_model_config(m)->vocab_size;
    r->tokens = malloc(n * sizeof *r->tokens);
    r->mask = malloc(n);
    r->logp = malloc(n * sizeof *r->logp);
    r->turn = malloc(n * sizeof *r->turn);
    r->turn_reward = malloc(n * sizeof *r->turn_reward);
    r->len = calloc((size_t)B, sizeof(int));
    r->n_turns = calloc((size_t)B, sizeof(int));
    r->success = calloc((size_t)B, sizeof(int));
    r->malformed = calloc((size_t)B, sizeof(int));
    r->truncated = calloc((size_t)B, sizeof(int));
    r->env = malloc((size_t)B * sizeof *r->env);
    w->logits = malloc((size_t)B * w->V * sizeof(float));
    w->feed = malloc(n * sizeof(int32_t));
    w->known = calloc((size_t)B, sizeof(int));
    w->done = calloc((size_t)B, sizeof(int));
    w->line_n = calloc((size_t)B, sizeof(int));
    w->line = malloc((size_t)B * (LM_ENV_MAX_LINE + 2));
    w->rng = malloc((size_t)B * sizeof(lm_rng));
    w->sample_work = malloc(lm_sample_work_bytes(w->V));
    if (!r->tokens || !r->mask || !r->logp || !r->turn || !r->turn_reward || !r->len || !r->n_turns || !r->success ||
        !r->malformed || !r->truncated || !r->env || !w->logits || !w->feed || !w->known || !w->done || !w->line_n ||
        !w->line || !w->rng || !w->sample_work) {
        lm_rollout_free(r);
        return lm_error(LM_ERR_MEMORY, "out of memory (rollout of %d x %d tokens)", B, max_len);
    }
    lm_status s = lm_decoder_create(m, B, max_len, &w->dec);
    if (s) {
        lm_rollout_free(r);
        return s;
    }
    *out = r;
    return LM_OK;
}

/* log softmax(z)[tok] over V logits, in double. */
static float log_prob(const float *z, int V, int tok) {
    float mx = z[0];
    for (int v = 1; v < V; v++) mx = z[v] > mx ? z[v] : mx;
    double s = 0;
    for (int v = 0; v < V; v++) s += exp((double)z[v] - mx);
    return (float)((double)z[tok] - mx - log(s));
}

/* Append forced bytes (context) to sequence b; an overflow of max_len ends
 * the episode there (truncated). Returns 1 when everything fitted. */
static int push_forced(lm_rollout *r, int b, const char *bytes, int n) {
    lm_rollout_work *w = r->work;
    const size_t row = (size_t)b * r->max_len;
    for (int i = 0; i < n; i++) {
        if (w->known[b] >= r->max_len) {
            r->truncated[b] = 1;
            return 0;
        }
        int k = w->known[b]++;
        r->tokens[row + k] = (unsigned char)bytes[i];
        r->mask[row + k] = 0;
        r->turn[row + k] = -1;
    }
    return 1;
}

/* Sequence b samples the byte at position pos from its logits; a finished
 * line goes to the environment and its answer is queued. */
static lm_status sample_byte(lm_rollout *r, int b, int pos, const lm_rollout_config *cfg) {
    lm_rollout_work *w = r->work;
    const size_t row = (size_t)b * r->max_len;
    const float *z = w->logits + (size_t)b * w->V;
    int32_t tok;
    TRY(lm_sample_token(z, w->V, cfg->temperature, cfg->top_p, &w->rng[b], w->sample_work, &tok));
    r->tokens[row + pos] = tok;
    r->mask[row + pos] = 1;
    r->logp[row + pos] = log_prob(z, w->V, tok);
    r->turn[row + pos] = (int16_t)(r->n_turns[b] < 32767 ? r->n_turns[b] : 32767);
    w->known[b] = pos + 1;
    char *line = w->line + (size_t)b * (LM_ENV_MAX_LINE + 2);
    int over = 0;
    if (tok != '\n') {
        line[w->line_n[b]++] = (char)tok;
        over = w->line_n[b] > LM_ENV_MAX_LINE;
        if (!over) return LM_OK;
    }
    /* the line is complete (or cut): the environment answers */
    lm_env_turn t;
    TRY(lm_env_step(&r->env[b], line, w->line_n[b], &t));
    w->line_n[b] = 0;
    r->turn_reward[row + r->n_turns[b]] = t.reward;
    r->n_turns[b]++;
    r->malformed[b] += t.malformed;
    int fits = 1;
    if (over) fits = push_forced(r, b, "\n", 1);
    if (fits) fits = push_forced(r, b, t.text, t.len);
    if (t.done || !fits) {
        w->done[b] = 1;
        r->success[b] = t.success;
    }
    return LM_OK;
}

lm_status lm_rollout_run(lm_rollout *r, const lm_env_config *envs, const uint64_t *seeds,
                         const lm_rollout_config *cfg, uint64_t sample_seed) {
    if (!r || !envs || !seeds || !cfg) return lm_error(LM_ERR_ARG, "lm_rollout_run: NULL argument");
    if (!(cfg->temperature >= 0) || !(cfg->top_p > 0 && cfg->top_p <= 1))
        return lm_error(LM_ERR_ARG, "lm_rollout_run: temperature %g must be >= 0 and top_p %g in (0, 1]",
                        (double)cfg->temperature, (double)cfg->top_p);
    lm_rollout_work *w = r->work;
    const int B = r->B, L = r->max_len;
    const size_t n = (size_t)B * L;
    memset(r->mask, 0, n);
    memset(r->logp, 0, n * sizeof *r->logp);
    memset(r->turn_reward, 0, n * sizeof *r->turn_reward);
    for (size_t i = 0; i < n; i++) {
        r->tokens[i] = 0;
        r->turn[i] = -1;
    }
    /* the prompts, and the length all of them share (prefilled at once) */
    int T0 = L;
    for (int b = 0; b < B; b++) {
        char prompt[LM_ENV_MAX_PROMPT];
        int plen;
        TRY(lm_env_reset(&r->env[b], &envs[b], seeds[b], prompt, (int)sizeof prompt, &plen));
        if (plen >= L)
            return lm_error(LM_ERR_ARG, "lm_rollout_run: episode %d's prompt has %d bytes, max_len is %d", b, plen, L);
        w->known[b] = 0;
        w->done[b] = 0;
        w->line_n[b] = 0;
        r->n_turns[b] = r->success[b] = r->malformed[b] = r->truncated[b] = 0;
        push_forced(r, b, prompt, plen);
        T0 = plen < T0 ? plen : T0;
        lm_rng_seed(&w->rng[b], lm_mix64(sample_seed ^ lm_mix64((uint64_t)b + 1)));
    }
    for (int b = 0; b < B; b++) memcpy(w->feed + (size_t)b * T0, r->tokens + (size_t)b * L, (size_t)T0 * sizeof(int32_t));
    TRY(lm_decoder_prefill(w->dec, w->feed, T0, w->logits));
    /* lockstep: the decoder has consumed pos tokens of every sequence; its
     * logits predict position pos */
    for (int pos = T0;; pos++) {
        int live = 0;
        for (int b = 0; b < B; b++) {
            if (w->done[b] || w->known[b] > pos) continue;
            if (pos >= L) { /* no room for the model's next byte */
                w->done[b] = 1;
                r->truncated[b] = 1;
                continue;
            }
            TRY(sample_byte(r, b, pos, cfg));
        }
        for (int b = 0; b < B; b++) live += !w->done[b];
        if (!live || pos + 1 >= L) {
            /* a sequence still waiting for its next byte has no room left */
            for (int b = 0; b < B; b++)
                if (!w->done[b]) {
                    w->done[b] = 1;
                    r->truncated[b] = 1;
                }
            break;
        }
        /* step in every sequence's byte at pos (a finished one feeds padding) */
        for (int b = 0; b < B; b++) w->feed[b] = w->known[b] > pos ? r->tokens[(size_t)b * L + pos] : 0;
        TRY(lm_decoder_step(w->dec, w->feed, w->logits));
    }
    for (int b = 0; b < B; b++) r->len[b] = w->known[b];
    return LM_OK;
}
