/* Block Attention Residuals (SPEC §5, docs/attnres.md): the residual stream of
 * the model as softmax attention over depth.
 *
 * Every sublayer (token mixer or channel mixer) is one AttnRes layer l = 0..L-1.
 * Its input is
 *     h_l = sum_i softmax_i( w_l . RMSNorm_{g_l}(v_i) ) v_i
 * over the sources v_i: v_0 = the token embedding, then the sums b_1..b_k of the
 * sublayer outputs of each completed block, then the partial sum of the current
 * block (when non-empty). w_l (pseudo-query) and g_l (key RMSNorm weight) are
 * d-vectors, one pair per sublayer plus one pair for the final AttnRes that
 * feeds the LM head (index L). Keys are normalised, values are not.
 *
 * BLOCK SIZE IS COUNTED IN SUBLAYERS: block_size = S means S consecutive
 * AttnRes layers (S/2 transformer layers when S is even) form one block.
 * K3's "block size 12" is ambiguous: read as layers it is S = 24 (93 layers:
 * 186 sublayers, 8 blocks), read as sublayers it is S = 12 (16 blocks).
 *
 * Modes:
 *   LM_ATTNRES_STANDARD  plain residual: h_l = v_0 + sum_{j<l} y_j, no parameters.
 *   LM_ATTNRES_BLOCK     Block AttnRes with block_size S sublayers.
 *   LM_ATTNRES_FULL      Full AttnRes: every sublayer output is its own source
 *                        (identical to LM_ATTNRES_BLOCK with S = 1).
 * The values equal config.h's lm_residual_kind (standard, block_attnres,
 * full_attnres) in that order.
 *
 * Use (one sequence batch of n tokens; the state is reused step after step):
 *
 *   forward:   lm_attnres_begin(st, embedding)
 *              for l in 0..L-1:
 *                  lm_attnres_input(st, l, &params, h)      h [n,d] feeds sublayer l
 *                  y = sublayer_l(h)
 *                  lm_attnres_add_output(st, l, y)
 *              lm_attnres_final(st, &params, h_final)      h_final feeds norm + LM head
 *   backward:  lm_attnres_final_backward(st, &params, dh_final, &grads)
 *              for l in L-1..0:
 *                  lm_attnres_output_backward(st, l, dy)   dy [n,d] += dLoss/dy_l
 *                  dh = sublayer_l_backward(dy)
 *                  lm_attnres_input_backward(st, l, &params, dh, &grads)
 *              lm_attnres_embedding_backward(st, dembedding)
 *
 * Calls out of this order are errors (LM_ERR_ARG naming the expected call).
 * Backward functions ACCUMULATE (+=) into every gradient they write; gradient
 * pointers may be NULL to skip them. Softmax statistics are fp32.
 *
 * Memory is planned up front: lm_attnres_memory() gives the bytes of every
 * buffer, lm_attnres_init() carves them out of one caller-provided workspace;
 * nothing is allocated afterwards. The block history holds 1 + ceil(L/S)
 * sources of [n,d] (O(N d) per token for N blocks, not O(L d)). */
#ifndef LONGMOE_ATTNRES_H
#define LONGMOE_ATTNRES_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_ATTNRES_STANDARD = 0, LM_ATTNRES_BLOCK = 1, LM_ATTNRES_FULL = 2 } lm_attnres_mode;

/* "standard" | "block_attnres" | "full_attnres" (the config's names). 0 on success. */
int lm_attnres_mode_from_name(const char *name, lm_attnres_mode *out);
const char *lm_attnres_mode_name(lm_attnres_mode m);

typedef struct {
    lm_attnres_mode mode;
    int n_sublayers;    /* L: AttnRes layers before the final one (2 per transformer layer) */
    int block_size;     /* S, in SUBLAYERS; used by LM_ATTNRES_BLOCK only (FULL means 1) */
    int d;              /* model width */
    int64_t n_tokens;   /* tokens per call (batch x sequence length) */
    float eps;          /* key RMSNorm: rms = sqrt(mean(v^2) + eps), as in linear.h */
    int two_phase;      /* 1: two-phase computation [AR]; 0: direct softmax per sublayer */
    int replay;         /* 1 (BLOCK mode): keep the partial sums of one block only (S - 1 of
                         * them, not L - n_blocks): the backward replays each block's forward
                         * (lm_attnres_replay_block) before its backward; 0: keep them all */
} lm_attnres_config;

/* Learned parameters, both [L+1, d] row-major: row l is sublayer l, row L the
 * final AttnRes before the LM head. Unused (may be NULL) in STANDARD mode. */
typedef struct {
    const float *query;    /* w_l, initialised to zero */
    const float *key_norm; /* g_l, RMSNorm weight of the keys, initialised to one */
} lm_attnres_params;

typedef struct {
    float *query;    /* [L+1, d] or NULL */
    float *key_norm; /* [L+1, d] or NULL */
} lm_attnres_grads;

/* Bytes of each buffer of the workspace (each rounded up to 64 bytes). */
typedef struct {
    size_t history;        /* (1 + n_blocks) sources x [n,d] + their rms: the block history */
    size_t history_grad;   /* same shape: gradient accumulators of the sources */
    size_t saved_partials; /* partial sums at each mid-block sublayer, for the backward */
    size_t saved_scores;   /* logits [n, n_sources_l] and log-sum-exp [n] of every AttnRes layer */
    size_t phase1;         /* two-phase: per-query running (max, sum, value accumulator) of a block */
    size_t queries;        /* S effective query vectors w (.) g, d floats each */
    size_t param_grad;     /* partial sums of the query/key-norm gradients, d per 64 tokens */
    size_t deferred;       /* GPU, when on: one block's deferred backward terms (0 on the CPU) */
    size_t total;
    double history_bytes_per_token; /* the same without the 64-byte rounding, per token */
    double total_bytes_per_token;   /* (for planners; excludes the n-independent queries) */
    int n_blocks;          /* N = ceil(L/S) (L for FULL, 0 for STANDARD) */
    int n_history_sources; /* 1 + N: the embedding and the block sums (1 for STANDARD) */
} lm_attnres_memory_plan;

lm_status lm_attnres_memory(const lm_attnres_config *cfg, lm_attnres_memory_plan *plan);

/* The state of one sequence batch. Fields are private; read them only through
 * the functions below. */
typedef struct {
    lm_attnres_config cfg;
    int S;                   /* effective block size (1 for FULL, L for STANDARD) */
    int n_blocks;
    float *hist;             /* [1+N, n, d]: v_0 then b_1..b_N (the open block's partial sum grows in place) */
    float *hist_rstd;        /* [1+N, n]: 1/rms of each closed source */
    float *dhist;            /* [1+N, n, d] */
    float *partials;         /* [L - N, n, d] */
    float *partial_rstd;     /* [L, n] */
    float *logits;           /* sum over layers of [n, n_sources_l] */
    float *lse;              /* [L+1, n] */
    float *acc;              /* [S, n, d] two-phase value accumulators */
    float *acc_max, *acc_sum;/* [S, n] */
    float *u;                /* [S, d] w_l (.) g_l for the queries of the open block */
    float *qpart;            /* [ceil(n/64), d] parameter-gradient partial sums */
    int step;                /* position in the call sequence (see attnres.c) */
    int replaying, replay_last, replay_step; /* a block's replay: its last sublayer, the step to go back to */
} lm_attnres_state;

/* Carve the buffers out of `workspace` (at least plan.total bytes, aligned to
 * 64 bytes). The state keeps pointers into it; the caller frees it. */
lm_status lm_attnres_init(lm_attnres_state *st, const lm_attnres_config *cfg, void *workspace,
                          size_t workspace_bytes);

/* Number of sources sublayer l reads (l = L: the final AttnRes). */
int lm_attnres_n_sources(const lm_attnres_state *st, int l);

/* ---- forward ---- */
/* embedding [n,d] is copied: v_0. Starts a new forward. */
lm_status lm_attnres_begin(lm_attnres_state *st, const float *embedding);
/* h [n,d] = input of sublayer l (the next one in order). */
lm_status lm_attnres_input(lm_attnres_state *st, int l, const lm_attnres_params *p, float *h);
/* Adds the output y [n,d] of sublayer l to its block; closes the block at its boundary. */
lm_status lm_attnres_add_output(lm_attnres_state *st, int l, const float *y);
/* h [n,d] = the final AttnRes over the embedding and every block (query row L). */
lm_status lm_attnres_final(lm_attnres_state *st, const lm_attnres_params *p, float *h);
/* Both below read what the forward saved for layer l (L: final); they are
 * available from that layer's forward until its backward (input_backward(l),
 * or final_backward for L) and not in STANDARD mode (errors otherwise). */
/* weights [n, n_sources_l] = softmax weights of each source (diagnostics of
 * depth routing; uniform 1 / n_sources when w_l = 0). */
lm_status lm_attnres_weights(const lm_attnres_state *st, int l, float *weights);
/* h [n,d] = the input of layer l again, from the saved scores (for activation
 * recomputation: the model need not keep h_l). Equal to the forward's h_l up
 * to fp32 rounding (the softmax is evaluated as exp(s - lse)). */
lm_status lm_attnres_recompute_input(const lm_attnres_state *st, int l, float *h);

/* With cfg.replay: before the backward of block k (when the next call would
 * be lm_attnres_output_backward of its last sublayer), go back to the block's
 * forward: the caller runs lm_attnres_input(l) and lm_attnres_add_output(l)
 * for every sublayer l of block k again, with the same outputs, and the state
 * holds that block's partial sums (the same bits as in the first forward);
 * the last add_output returns to the backward where it stopped. */
lm_status lm_attnres_replay_block(lm_attnres_state *st, int k);

/* ---- backward (after lm_attnres_final, in reverse order) ---- */
lm_status lm_attnres_final_backward(lm_attnres_state *st, const lm_attnres_params *p,
                                    const float *dh, lm_attnres_grads *g);
/* dy [n,d] += dLoss/dy_l, complete once every later sublayer's input backward ran. */
lm_status lm_attnres_output_backward(lm_attnres_state *st, int l, float *dy);
lm_status lm_attnres_input_backward(lm_attnres_state *st, int l, const lm_attnres_params *p,
                                    const float *dh, lm_attnres_grads *g);
/* dembedding [n,d] += dLoss/dv_0. Ends the backward. */
lm_status lm_attnres_embedding_backward(lm_attnres_state *st, float *dembedding);

#ifdef __cplusplus
}
#endif
#endif
