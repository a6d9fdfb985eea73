/* Model and training configuration: one struct, read from a JSON file whose
 * keys are documented in docs/config.md. Every key has a type, a range and a
 * default in one table (src/model/config.c); unknown keys and bad values are
 * errors that name the key ("model.moe.top_k must lie in [1, 16], got 20"). */
#ifndef LONGMOE_CONFIG_H
#define LONGMOE_CONFIG_H

#include <stdint.h>

#include "longmoe/balance.h"
#include "longmoe/core.h"
#include "longmoe/mla.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_MAX_LAYERS 256

/* train.recompute: false (none), true (all), "channel" (the MoE and dense
 * FFN sublayers), "token" (the KDA and attention sublayers). Any value but
 * none keeps one normalised sublayer input for the recomputed sublayers. */
typedef enum {
    LM_RECOMPUTE_NONE = 0,
    LM_RECOMPUTE_ALL = 1,
    LM_RECOMPUTE_CHANNEL = 2,
    LM_RECOMPUTE_TOKEN = 3
} lm_recompute_kind;
/* Whether the backward repeats sublayer idx's forward (even idx: the layer's
 * token mixer, odd: its channel mixer). */
static inline int lm_recompute_sublayer(int recompute, int idx) {
    return recompute == LM_RECOMPUTE_ALL || (recompute == LM_RECOMPUTE_TOKEN && idx % 2 == 0) ||
           (recompute == LM_RECOMPUTE_CHANNEL && idx % 2 == 1);
}
/* A recompute value's name ("false", "true", "channel", "token"), and as
 * config.json writes it (the names quoted: false, true, "channel", "token"). */
const char *lm_recompute_name(int recompute);
const char *lm_recompute_json(int recompute);
/* A command line's recompute value: false or none, true or all, channel, token; -1 for anything else. */
int lm_recompute_from_name(const char *name);

typedef enum { LM_MIXER_KDA = 0, LM_MIXER_MLA = 1 } lm_mixer_kind;
typedef enum { LM_RESIDUAL_STANDARD = 0, LM_RESIDUAL_BLOCK_ATTNRES, LM_RESIDUAL_FULL_ATTNRES } lm_residual_kind;
typedef enum { LM_ACT_SWIGLU = 0, LM_ACT_SITU } lm_activation_kind;
typedef enum { LM_SCHEDULE_COSINE = 0, LM_SCHEDULE_WSD } lm_schedule_kind;
typedef enum { LM_TRAIN_MUON = 0, LM_TRAIN_ADAMW } lm_train_optimizer;

#define LM_MAX_STAGES 8
#define LM_MAX_STAGE_DATA 8

/* One stage of staged context extension (docs/config.md, SPEC §6). */
typedef struct {
    char name[32];
    int seq_len;            /* tokens per sequence in this stage */
    int64_t steps;          /* optimizer steps of the stage */
    int64_t batch_tokens;   /* tokens per micro-batch: batch size = batch_tokens / seq_len */
    float lr_scale;         /* multiplies the run's schedule during the stage */
    int n_data;             /* data mix: sources and weights (0: train.data) */
    char data[LM_MAX_STAGE_DATA][64];
    float weights[LM_MAX_STAGE_DATA];
} lm_stage;

typedef struct {
    /* model */
    int vocab_size, d_model, n_layers;
    int mla_every;          /* layer l (1-based) is MLA when l % mla_every == 0 or l == n_layers; 0: no MLA */
    int last_layer_mla;     /* 1: the last layer is MLA whatever mla_every says */
    char layout[LM_MAX_LAYERS + 1]; /* optional explicit layout, one char a layer: 'k' KDA, 'm' MLA */
    int first_k_dense, dense_ffn;
    int tie_embeddings;
    float norm_eps;
    /* KDA */
    int kda_heads, kda_head_dim, kda_chunk, kda_conv_width;
    int kda_gate_softplus;  /* 0 bounded, 1 softplus */
    float kda_g_min;
    /* MLA / GQA */
    lm_attn_kind attn_kind;
    int attn_heads, attn_kv_heads, q_lora_rank, kv_lora_rank, qk_head_dim, v_head_dim, rope_dims;
    /* MoE */
    int n_routed_experts, top_k, n_shared_experts, expert_ffn, shared_ffn, latent_dim;
    lm_activation_kind activation;
    float route_scale;
    lm_balance_mode balance;
    lm_qb_estimator balance_estimator;
    int balance_bins;
    float balance_ema, sign_rate, aux_alpha;
    /* residual */
    lm_residual_kind residual;
    int attnres_block;      /* block size in SUBLAYERS (token mixer and channel mixer count one each) */
    /* training */
    int seq_len, batch_size, grad_accum;
    int64_t steps;
    lm_train_optimizer optimizer;
    float lr, adam_lr, min_lr_ratio, warmup_frac, decay_frac, weight_decay, grad_clip, qk_clip_tau;
    /* the training loss's weight of task data's answer positions (tasks.h "answer") against the
     * other positions' 1: the loss is sum w_i nll_i / sum w_i; 1 (default) is the plain mean */
    float answer_loss_weight;
    /* rows per cell of the passkey and MQAR grids evaluated after each stage
     * (byte-vocabulary models; 0: none) */
    int grid_rows;
    lm_schedule_kind schedule;
    uint64_t seed;
    int log_every, eval_every, ckpt_every, keep_checkpoints;
    /* which sublayers' forwards the backward repeats instead of keeping their
     * activations (lm_recompute_kind; docs/model.md, "Recomputation") */
    int recompute;
    /* with recompute: tokens per chunk of the per-token sublayers (dense FFN, MoE)
     * in the forward and the recomputing backward, and the sublayer inputs are
     * recomputed from the residual state; 0 = off (docs/model.md, "Memory") */
    int recompute_chunk;
    /* tokens per sequence segment: every layer runs on S tokens of each row at
     * a time, the token mixers carrying their state from segment to segment,
     * and the backward recomputes each segment's forward in reverse order; 0 =
     * off (docs/model.md, "Sequence segments") */
    int seq_segment;
    /* data parallelism: MiB of the gradient buckets summed over the ranks as the
     * backward finishes them (docs/scaleout.md); 0 = one sum after the backward */
    float grad_bucket_mb;
    char data[64];          /* default data source: a built-in task or shards:DIR */
    int n_stages;           /* 0: one stage of train.seq_len, train.batch_size, train.steps */
    lm_stage stages[LM_MAX_STAGES];
} lm_config;

/* The stages of a run: the configured ones, or one stage made of the train.*
 * keys. Returns the number of stages written to `out` (LM_MAX_STAGES room). */
int lm_config_stages(const lm_config *c, lm_stage *out);
/* Total steps over all stages. */
int64_t lm_config_total_steps(const lm_config *c);

/* The defaults of every key (a small model). */
void lm_config_defaults(lm_config *c);
/* Parse JSON text over the defaults; `what` names the file in messages. */
lm_status lm_config_parse(const char *text, size_t len, const char *what, lm_config *c);
lm_status lm_config_load(const char *path, lm_config *c);
/* Cross-key checks (heads divide, k <= n, layout length, ...). Called by parse. */
lm_status lm_config_validate(const lm_config *c);
/* Write the config as JSON (every key), e.g. config.json beside a checkpoint.
 * Returns a malloc'd NUL-terminated string. */
char *lm_config_to_json(const lm_config *c);

/* Mixer of layer l (0-based) and whether its channel mixer is a MoE. */
lm_mixer_kind lm_config_mixer(const lm_config *c, int layer);
int lm_config_is_moe(const lm_config *c, int layer);

/* Parameter, FLOP and memory accounting by component (for `longmoe plan`). */
typedef enum {
    LM_PART_EMBEDDING = 0, LM_PART_KDA, LM_PART_MLA, LM_PART_ROUTER, LM_PART_ROUTED_EXPERTS,
    LM_PART_SHARED_EXPERTS, LM_PART_DENSE_FFN, LM_PART_ATTNRES_NORMS, LM_PART_LM_HEAD, LM_PART_COUNT
} lm_part;
const char *lm_part_name(lm_part p);

typedef struct {
    double params[LM_PART_COUNT];        /* stored parameters */
    double active_params[LM_PART_COUNT]; /* used by one token */
    double flops_per_token[LM_PART_COUNT];       /* forward, at context length `context` */
    double state_bytes_per_token[LM_PART_COUNT]; /* inference cache per token of context (bf16) */
    double total_params, total_active, total_flops;
} lm_plan;

/* Forward FLOPs are 2 per multiply-add; attention FLOPs average over a causal
 * context of `context` tokens. Training is about 3x the forward. */
void lm_config_plan(const lm_config *c, int64_t context, lm_plan *p);

/* How context parallelism cuts a sequence of T tokens over R ranks
 * (docs/scaleout.md, "Context parallelism in the trainer"): rank r holds
 * tokens [start[r], start[r+1]) (start[0] = 0, start[R] = T, every segment at
 * least one token; T >= R >= 1).
 *   LM_CP_SPLIT_EVEN: as equal as possible, the first T mod R segments one
 *     token longer;
 *   LM_CP_SPLIT_BALANCED: equal work by lm_config_plan's FLOPs: token t
 *     costs the token-local layers' FLOPs plus the attention's over its t + 1
 *     keys, so earlier segments (short prefixes) are longer; each boundary is
 *     the token where the cumulative cost is nearest its share. Equal to the
 *     even split when the model has no attention layer. */
typedef enum { LM_CP_SPLIT_EVEN = 0, LM_CP_SPLIT_BALANCED } lm_cp_split;
lm_status lm_config_cp_split(const lm_config *c, int64_t T, int R, lm_cp_split kind, int64_t *start);
/* "even" or "balanced" -> kind (LM_ERR_ARG naming the choices otherwise). */
lm_status lm_cp_split_from_name(const char *name, lm_cp_split *kind);
const char *lm_cp_split_name(lm_cp_split kind);

#ifdef __cplusplus
}
#endif
#endif
