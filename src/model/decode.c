/* Decoding: chunked prefill of a prompt, then one token per step with the
 * KDA recurrent states and the attention caches (include/longmoe/model.h,
 * docs/sampling.md). The sublayer sequence is the model's: embedding, for
 * each sublayer AttnRes input -> RMSNorm -> mixer -> AttnRes output, final
 * AttnRes -> RMSNorm -> LM head; the residual over depth works per token, so
 * the step runs it on B tokens. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/attnres.h"
#include "longmoe/kda_layer.h"
#include "longmoe/linear.h"
#include "longmoe/mla.h"
#include "longmoe/model.h"
#include "longmoe/moe.h"
#include "model_internal.h"

struct lm_decoder {
    lm_model *m;
    int B, max_T, len;
    lm_kda_layer_cache *kda; /* [n_layers]; used by KDA layers */
    lm_mla_cache *mla;       /* [n_layers]; used by attention layers */
    float *cache_block;      /* every layer's cache */
    size_t cache_floats, fixed_floats, per_token_floats;
    /* prefill: B*max_T tokens; the activations of one sublayer at a time */
    float *x0, *h, *xn, *y, *last;       /* [B*max_T, d] (last: [B,d]) */
    float *kda_acts, *mla_acts;          /* one layer's saved activations */
    float *ffn_a, *ffn_u, *ffn_h;        /* dense FFN [B*max_T, dense_ffn] */
    /* step: B tokens */
    float *sx0, *sh, *sxn, *sy;          /* [B,d] */
    float *step_scratch;                 /* the largest KDA or attention step scratch */
    float *work_block;
    lm_moe_acts moe_a;                   /* routing and expert buffers for B*max_T tokens */
    int have_moe_acts;
    lm_attnres_state ar_prefill, ar_step;
    void *ar_prefill_ws, *ar_step_ws;
    size_t ar_prefill_bytes;
};

static lm_attnres_config attnres_config(const lm_model *m, int64_t n) {
    lm_attnres_config ac = {(lm_attnres_mode)m->cfg.residual, m->L2, m->cfg.attnres_block, m->d, n,
                            m->cfg.norm_eps, 1, 0};
    return ac;
}

static lm_attnres_params attnres_params(const lm_model *m) {
    lm_attnres_params p = {NULL, NULL};
    if (m->has_attnres_params) {
        p.query = lm_model_host_param(m, m->ar_query_off);
        p.key_norm = lm_model_host_param(m, m->ar_key_off);
    }
    return p;
}

static void *alloc64(size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, bytes ? bytes : 64);
}

lm_status lm_decoder_create(lm_model *m, int B, int max_T, lm_decoder **out) {
    if (!out) return lm_error(LM_ERR_ARG, "decoder: out is NULL");
    *out = NULL;
    if (!m) return lm_error(LM_ERR_ARG, "decoder: model is NULL");
    if (m->be->device != LM_DEVICE_CPU)
        return lm_error(LM_ERR_ARG, "decoding runs on a CPU model; this model is on the %s backend (load its "
                        "checkpoint into a CPU model to sample)", lm_device_name(m->be->device));
    if (B < 1 || max_T < 1 || (int64_t)B * max_T > (1 << 26))
        return lm_error(LM_ERR_ARG, "decoder: B=%d sequences of max_T=%d tokens is out of range (each >= 1, "
                        "B*max_T <= 2^26)", B, max_T);
    const lm_config *c = &m->cfg;
    const size_t d = (size_t)m->d, Nmax = (size_t)B * max_T, nl = (size_t)c->n_layers;
    lm_decoder *dec = calloc(1, sizeof *dec);
    if (!dec) return lm_error(LM_ERR_MEMORY, "out of memory creating the decoder");
    lm_status st = LM_OK;
    dec->m = m;
    dec->B = B;
    dec->max_T = max_T;
    dec->kda = calloc(nl, sizeof *dec->kda);
    dec->mla = calloc(nl, sizeof *dec->mla);
    if (!dec->kda || !dec->mla) {
        st = lm_error(LM_ERR_MEMORY, "out of memory creating the decoder");
        goto fail;
    }
    /* sizes: caches, one layer's activations, step scratch */
    size_t kda_acts = 0, mla_acts = 0, scratch = 0, ffn = 0;
    for (size_t l = 0; l < nl; l++) {
        const layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) {
            size_t f = lm_kda_layer_cache_floats(&ls->kda_cfg, B);
            dec->fixed_floats += f;
            size_t a = lm_kda_layer_act_floats(&ls->kda_cfg, B, max_T);
            size_t s = lm_kda_layer_step_scratch_floats(&ls->kda_cfg, B);
            kda_acts = a > kda_acts ? a : kda_acts;
            scratch = s > scratch ? s : scratch;
        } else {
            dec->per_token_floats += lm_mla_cache_floats(&ls->mla_cfg, B, 1);
            size_t a = lm_mla_acts_floats(&ls->mla_cfg, B, max_T);
            size_t s = lm_mla_decode_scratch_floats(&ls->mla_cfg, B, max_T);
            mla_acts = a > mla_acts ? a : mla_acts;
            scratch = s > scratch ? s : scratch;
        }
        if (!ls->moe) ffn = Nmax * (size_t)c->dense_ffn;
    }
    dec->cache_floats = dec->fixed_floats + dec->per_token_floats * (size_t)max_T;
    dec->cache_block = malloc((dec->cache_floats ? dec->cache_floats : 1) * sizeof(float));
    size_t work = 4 * Nmax * d + B * d + kda_acts + mla_acts + 3 * ffn + 4 * (size_t)B * d + scratch;
    dec->work_block = malloc(work * sizeof(float));
    if (!dec->cache_block || !dec->work_block) {
        st = lm_error(LM_ERR_MEMORY, "out of memory for the decoder (%zu cache and %zu work floats); hint: "
                      "fewer sequences or a shorter max_T", dec->cache_floats, work);
        goto fail;
    }
    float *p = dec->work_block;
#define CARVE(ptr, n) (ptr = p, p += (n))
    CARVE(dec->x0, Nmax * d);
    CARVE(dec->h, Nmax * d);
    CARVE(dec->xn, Nmax * d);
    CARVE(dec->y, Nmax * d);
    CARVE(dec->last, (size_t)B * d);
    CARVE(dec->kda_acts, kda_acts);
    CARVE(dec->mla_acts, mla_acts);
    CARVE(dec->ffn_a, ffn);
    CARVE(dec->ffn_u, ffn);
    CARVE(dec->ffn_h, ffn);
    CARVE(dec->sx0, (size_t)B * d);
    CARVE(dec->sh, (size_t)B * d);
    CARVE(dec->sxn, (size_t)B * d);
    CARVE(dec->sy, (size_t)B * d);
    CARVE(dec->step_scratch, scratch);
#undef CARVE
    /* MoE routing and expert buffers, shared by the MoE layers (no backward) */
    for (size_t l = 0; l < nl; l++)
        if (m->layers[l].moe) {
            if ((st = lm_moe_acts_alloc(&dec->moe_a, &m->layers[l].moe_cfg, (int64_t)Nmax))) goto fail;
            dec->have_moe_acts = 1;
            break;
        }
    /* the residual over depth: one state for prompts (up to B*max_T tokens), one for steps */
    lm_attnres_memory_plan plan;
    lm_attnres_config ac = attnres_config(m, (int64_t)Nmax);
    if ((st = lm_attnres_memory(&ac, &plan))) goto fail;
    dec->ar_prefill_bytes = (plan.total + 63) / 64 * 64;
    dec->ar_prefill_ws = alloc64(plan.total);
    ac = attnres_config(m, B);
    if ((st = lm_attnres_memory(&ac, &plan))) goto fail;
    size_t step_bytes = (plan.total + 63) / 64 * 64;
    dec->ar_step_ws = alloc64(plan.total);
    if (!dec->ar_prefill_ws || !dec->ar_step_ws) {
        st = lm_error(LM_ERR_MEMORY, "out of memory for the decoder's residual history");
        goto fail;
    }
    if ((st = lm_attnres_init(&dec->ar_step, &ac, dec->ar_step_ws, step_bytes))) goto fail;
    lm_decoder_reset(dec);
    *out = dec;
    return LM_OK;
fail:
    lm_decoder_free(dec);
    return st;
}

void lm_decoder_free(lm_decoder *dec) {
    if (!dec) return;
    if (dec->have_moe_acts) lm_moe_acts_free(&dec->moe_a);
    free(dec->kda);
    free(dec->mla);
    free(dec->cache_block);
    free(dec->work_block);
    free(dec->ar_prefill_ws);
    free(dec->ar_step_ws);
    free(dec);
}

void lm_decoder_reset(lm_decoder *dec) {
    const lm_model *m = dec->m;
    float *p = dec->cache_block;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) {
            lm_kda_layer_cache_init(&ls->kda_cfg, &dec->kda[l], dec->B, p);
            p += lm_kda_layer_cache_floats(&ls->kda_cfg, dec->B);
        } else {
            lm_mla_cache_init(&ls->mla_cfg, &dec->mla[l], dec->B, dec->max_T, p);
            p += lm_mla_cache_floats(&ls->mla_cfg, dec->B, dec->max_T);
        }
    }
    dec->len = 0;
}

int lm_decoder_length(const lm_decoder *dec) { return dec->len; }

void lm_decoder_cache_bytes(const lm_decoder *dec, size_t *fixed_bytes, size_t *bytes_per_token) {
    if (fixed_bytes) *fixed_bytes = dec->fixed_floats * sizeof(float);
    if (bytes_per_token) *bytes_per_token = dec->per_token_floats * sizeof(float);
}

/* The dense SwiGLU / SiTU-GLU FFN on n tokens (the model's dense_ffn_forward). */
static void dense_ffn(const lm_decoder *dec, const layer_state *ls, const float *x, float *y, int64_t n) {
    // x, y are (n,d)
    const lm_model *m = dec->m;
    int d = m->d, f = m->cfg.dense_ffn;
    const float *Wg = lm_model_host_param(m, ls->ffn_off), *Wu = Wg + (size_t)f * d, *Wd = Wu + (size_t)f * d;
    lm_expert_act act = m->cfg.activation == LM_ACT_SITU ? LM_EXPERT_SITU_GLU : LM_EXPERT_SWIGLU;
    lm_matmul_forward(dec->ffn_a, x, Wg, NULL, n, d, f);
    lm_matmul_forward(dec->ffn_u, x, Wu, NULL, n, d, f);
    for (size_t i = 0; i < (size_t)n * f; i++)
        dec->ffn_h[i] = lm_expert_act_forward(act, dec->ffn_a[i], dec->ffn_u[i]);
    lm_matmul_forward(y, dec->ffn_h, Wd, NULL, n, f, d);
}

static lm_status check_tokens(const lm_model *m, const int32_t *tokens, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            return lm_error(LM_ERR_ARG, "decoder: token %d at index %lld is outside the vocabulary [0, %d)",
                            tokens[i], (long long)i, m->cfg.vocab_size);
    return LM_OK;
}

/* The sublayer loop on n tokens whose embeddings are in x0; T is the prompt
 * length (prefill) or 0 (one step). Leaves the final normalised states in xn. */
static lm_status run_sublayers(lm_decoder *dec, lm_attnres_state *ar, float *x0, float *h, float *xn, float *y,
                               int64_t n, int T) {
    lm_model *m = dec->m;
    const int d = m->d;
    lm_attnres_params arp = attnres_params(m);
    TRY(lm_attnres_begin(ar, x0));
    for (int idx = 0; idx < m->L2; idx++) {
        const int l = idx / 2;
        layer_state *ls = &m->layers[l];
        /* SPEC §5: the sublayer input is attention over the depth sources */
        TRY(lm_attnres_input(ar, idx, &arp, h));
        lm_rmsnorm_forward(xn, NULL, h, lm_model_host_param(m, idx % 2 ? ls->ffn_norm_off : ls->mixer_norm_off), n, d,
                           m->cfg.norm_eps);
        if (idx % 2 == 0 && ls->mixer == LM_MIXER_KDA) {
            if (T) {
                lm_kda_layer_acts a;
                lm_kda_layer_acts_map(&ls->kda_cfg, dec->B, T, dec->kda_acts, &a);
                TRY(lm_kda_layer_prefill(&ls->kda_cfg, &ls->kda_p, &a, &dec->kda[l], xn, T, y));
            } else {
                TRY(lm_kda_layer_step(&ls->kda_cfg, &ls->kda_p, &dec->kda[l], xn, y, dec->step_scratch));
            }
        } else if (idx % 2 == 0) {
            if (T) TRY(lm_mla_prefill(&ls->mla_cfg, &ls->mla_p, &dec->mla[l], xn, T, y, dec->mla_acts));
            else TRY(lm_mla_decode_step(&ls->mla_cfg, &ls->mla_p, &dec->mla[l], xn, y, dec->step_scratch));
        } else if (!ls->moe) {
            dense_ffn(dec, ls, xn, y, n);
        } else {
            /* SPEC §4.6: route with the model's balancing bias, frozen at inference */
            if (!ls->moe_p.gate)
                return lm_error(LM_ERR_ARG, "decoding: layer %d's routed experts are cut to this rank's "
                                "(lm_model_keep_expert_weights): gather them first (lm_model_gather_experts)", l);
            TRY(lm_moe_forward(y, xn, ls->bal.bias, &ls->moe_cfg, &ls->moe_p, &dec->moe_a, n));
        }
        TRY(lm_attnres_add_output(ar, idx, y));
    }
    TRY(lm_attnres_final(ar, &arp, h));
    lm_rmsnorm_forward(xn, NULL, h, lm_model_host_param(m, m->final_norm_off), n, d, m->cfg.norm_eps);
    return LM_OK;
}

static lm_status lm_head(const lm_decoder *dec, const float *hn, float *logits) {
    // hn is (B,d), logits (B,V)
    const lm_model *m = dec->m;
    const int V = m->cfg.vocab_size;
    lm_matmul_forward(logits, hn, lm_model_host_param(m, m->head_off), NULL, dec->B, m->d, V);
    for (size_t i = 0; i < (size_t)dec->B * V; i++)
        if (!isfinite(logits[i]))
            return lm_error(LM_ERR_NUMERIC, "decoder: non-finite logit at sequence %zu, token %zu", i / V, i % V);
    return LM_OK;
}

lm_status lm_decoder_prefill(lm_decoder *dec, const int32_t *tokens, int T, float *logits_last) {
    // tokens is (B,T), logits_last (B,V)
    if (!dec || !tokens) return lm_error(LM_ERR_ARG, "decoder prefill: decoder and tokens are required");
    if (T < 1 || T > dec->max_T)
        return lm_error(LM_ERR_ARG, "decoder prefill: prompt length %d must lie in [1, max_T=%d]", T, dec->max_T);
    lm_model *m = dec->m;
    const int B = dec->B, d = m->d;
    const int64_t n = (int64_t)B * T;
    TRY(check_tokens(m, tokens, n));
    lm_decoder_reset(dec);
    const float *E = lm_model_host_param(m, m->embed_off);
    for (int64_t i = 0; i < n; i++) memcpy(dec->x0 + i * d, E + (size_t)tokens[i] * d, (size_t)d * sizeof(float));
    lm_attnres_config ac = attnres_config(m, n);
    TRY(lm_attnres_init(&dec->ar_prefill, &ac, dec->ar_prefill_ws, dec->ar_prefill_bytes));
    lm_status s = run_sublayers(dec, &dec->ar_prefill, dec->x0, dec->h, dec->xn, dec->y, n, T);
    if (s) {
        lm_decoder_reset(dec);
        return s;
    }
    dec->len = T;
    if (!logits_last) return LM_OK;
    for (int b = 0; b < B; b++)
        memcpy(dec->last + (size_t)b * d, dec->xn + ((size_t)b * T + T - 1) * d, (size_t)d * sizeof(float));
    return lm_head(dec, dec->last, logits_last);
}

lm_status lm_decoder_step(lm_decoder *dec, const int32_t *tokens, float *logits) {
    // tokens is (B), logits (B,V)
    if (!dec || !tokens || !logits)
        return lm_error(LM_ERR_ARG, "decoder step: decoder, tokens and logits are required");
    if (dec->len >= dec->max_T)
        return lm_error(LM_ERR_ARG, "decoder step: the sequences already hold max_T=%d tokens", dec->max_T);
    lm_model *m = dec->m;
    const int B = dec->B, d = m->d;
    TRY(check_tokens(m, tokens, B));
    const float *E = lm_model_host_param(m, m->embed_off);
    for (int b = 0; b < B; b++) memcpy(dec->sx0 + (size_t)b * d, E + (size_t)tokens[b] * d, (size_t)d * sizeof(float));
    lm_status s = run_sublayers(dec, &dec->ar_step, dec->sx0, dec->sh, dec->sxn, dec->sy, B, 0);
    if (s) {
        /* a failed step leaves some layers advanced: start over */
        lm_decoder_reset(dec);
        return s;
    }
    dec->len++;
    return lm_head(dec, dec->sxn, logits);
}

/* ---- sampling ---- */

typedef struct {
    float p;
    int32_t i;
} prob_index;

static int by_prob_desc(const void *a, const void *b) {
    const prob_index *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

size_t lm_sample_work_bytes(int V) { return (size_t)(V > 0 ? V : 1) * sizeof(prob_index); }

lm_status lm_sample_token(const float *logits, int V, float temperature, float top_p, lm_rng *rng, void *work,
                          int32_t *token) {
    if (!logits || !token || V < 1) return lm_error(LM_ERR_ARG, "sample: logits, token and V >= 1 are required");
    if (!(temperature >= 0) || !isfinite(temperature))
        return lm_error(LM_ERR_ARG, "sample: temperature must be finite and >= 0, got %g", (double)temperature);
    if (!(top_p > 0 && top_p <= 1))
        return lm_error(LM_ERR_ARG, "sample: top_p must lie in (0, 1], got %g", (double)top_p);
    int best = 0;
    for (int v = 1; v < V; v++) best = logits[v] > logits[best] ? v : best;
    if (temperature == 0) {
        *token = best;
        return LM_OK;
    }
    if (!rng || !work) return lm_error(LM_ERR_ARG, "sample: rng and work are required when temperature > 0");
    prob_index *pi = work;
    /* softmax(logits / temperature) in fp32 with the maximum subtracted, sums in double */
    double total = 0;
    for (int v = 0; v < V; v++) {
        pi[v].p = expf((logits[v] - logits[best]) / temperature);
        pi[v].i = v;
        total += pi[v].p;
    }
    int n = V;
    if (top_p < 1) {
        /* nucleus: the most likely tokens until their mass reaches top_p */
        qsort(pi, (size_t)V, sizeof *pi, by_prob_desc);
        double mass = 0;
        for (n = 0; n < V;) {
            mass += pi[n++].p;
            if (mass >= top_p * total) break;
        }
        total = mass;
    }
    double u = lm_rng_uniform(rng) * total, acc = 0;
    for (int j = 0; j < n; j++) {
        acc += pi[j].p;
        if (u < acc) {
            *token = pi[j].i;
            return LM_OK;
        }
    }
    /* u within rounding of the total: the last candidate of non-zero probability */
    while (n > 1 && pi[n - 1].p == 0) n--;
    *token = pi[n - 1].i;
    return LM_OK;
}
