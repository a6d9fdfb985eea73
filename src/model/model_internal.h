/* The model's internal state, shared by the files of src/model (model.c:
 * planning, forward, backward; decode.c: prefill and one-token steps). Not a
 * public API. */
#ifndef LONGMOE_MODEL_INTERNAL_H
#define LONGMOE_MODEL_INTERNAL_H

#include "longmoe/attnres.h"
#include "longmoe/backend.h"
#include "longmoe/kda_layer.h"
#include "longmoe/mla.h"
#include "longmoe/model.h"
#include "longmoe/moe.h"
#include "longmoe/moe_ep.h"


typedef struct {
    lm_mixer_kind mixer;
    int moe;
    size_t mixer_norm_off, ffn_norm_off, mixer_off, ffn_off;
    /* KDA */
    lm_kda_layer_config kda_cfg;
    /* parameter views: *_p into the host parameters (decode, QK-Clip); *_P, *_PL
     * and *_G into what the backend's ops read (the same pointers on the CPU) */
    lm_kda_layer_params kda_p, kda_P, kda_PL, kda_G;
    lm_kda_layer_acts kda_a;
    /* MLA */
    lm_mla_config mla_cfg;
    lm_mla_params mla_p, mla_P, mla_PL, mla_G;
    float *mla_acts;
    float *smax, *smax_tmp; /* [H] largest logit per head over the step, and of one forward */
    /* dense FFN: W_gate [f,d], W_up [f,d], W_down [d,f]; activations [N,f] */
    float *ffn_a, *ffn_u, *ffn_h;
    /* MoE */
    lm_moe_config moe_cfg;
    lm_moe_params moe_p, moe_P, moe_PL, moe_G;
    void *moe_acts; /* the backend's MoE activations */
    lm_balance_state bal;
    int bal_ready, owns_moe_acts;
    int moe_i; /* this MoE layer's index among the model's (its balancer's in bal_set) */
    float *dscores; /* aux loss gradient [N,n] (balance = aux), backend memory */
    /* expert parallelism (lm_model_set_expert_parallel): the backend's
     * exchange (ops->moe_ep_create), the views of this rank's expert slice
     * (fp32, product format, gradients), and whether the last forward used it */
    void *moe_ep;
    lm_moe_params moe_Pep, moe_PLep, moe_Gep;
    int moe_ep_fwd;
    /* the routed experts' weight gradients were left out of the last zeroing:
     * the layer's next MoE backward writes them (model.c, dw_layer) */
    int dw_fresh;
    /* where the routed experts' gate, up and down lie in the whole parameter
     * layout (lm_model_tensor.offset; set with the views) */
    size_t moe_xoff[3];
    /* context parallelism (lm_model_set_context_parallel): the token mixer's
     * activations for the rank's segment (one set per mixer kind with recompute) */
    float *cp_acts;
    /* sequence segments (train.seq_segment): KDA: the state [B,H,K,K] and the
     * conv history [3,B,W-1,HK] at the start of segments 1 .. n-1, and two
     * sets (this segment's, the one before's) of their gradients; attention:
     * the keys and values of the whole rows and their gradient accumulators */
    float *seg_h, *seg_halo, *seg_dh[2], *seg_dhalo[2];
    void *seg_k, *seg_v;
    float *seg_dk, *seg_dv;
    /* MLA whose latent is smaller than its keys and values keeps that instead (lm_mla_seg) */
    int seg_latent;
    void *seg_c;
    float *seg_kr, *seg_dc, *seg_dkr;
    /* attention: its output and log-sum-exp of the whole rows, kept by the
     * forward for the backward's recomputation, which reuses them instead of
     * running the attention again (lm_mla_keep; with train.seq_segment, or
     * train.recompute on one rank; else NULL) */
    void *keep_o;
    float *keep_lse;
} layer_state;

struct lm_model {
    lm_config cfg;
    lm_backend *be; /* where the tensors live and whose ops compute the layers */
    int sep;        /* the backend's product format is a separate copy (bf16) */
    int B, T, L2; /* L2 = 2 * n_layers sublayers */
    int64_t N;
    int d;
    lm_model_tensor *tensors;
    int n_tensors, cap_tensors;
    size_t n_params;
    float *params, *grads; /* host: the optimizer's, the checkpoints' */
    /* the gradient block: n_grads floats, every tensor's gradient in table
     * order, except that of each tensor in gcuts only the elements [first,
     * first + count) are kept (owner-only expert gradients,
     * lm_model_keep_expert_grads or lm_model_create_expert_owned; n_gcuts =
     * 0: the whole layout, n_grads =
     * n_params); gcuts in table order, offsets in the parameter block */
    size_t n_grads;
    struct gcut {
        size_t offset, numel, first, count;
    } *gcuts;
    int n_gcuts;
    /* owner-only expert weights (lm_model_keep_expert_weights, or from
     * creation: lm_model_create_expert_owned): the parameter
     * block is cut with the same table, so it holds n_grads floats in the
     * gradient block's layout (an element's place is the same in both);
     * xwhole: the routed experts' tensors whole, gathered for an evaluation or
     * a checkpoint (lm_model_gather_experts; NULL otherwise), in table order */
    int pcut;
    float *xwhole;
    /* bytes of parameter and gradient blocks (host and backend) held now and
     * at most since creation (lm_model_block_peak_bytes) */
    size_t block_held, block_peak;
    /* evaluation forwards of a cut model gather one MoE layer's experts at a
     * time (lm_model_gather_experts_by_layer): xlayer holds that layer's
     * three tensors whole during its channel mixer (NULL otherwise); xheld,
     * xpeak: the bytes of gathered expert weights held now and at most since
     * lm_model_gathered_peak_bytes last reset it */
    int xstream;
    /* evaluation forwards of a cut model run the MoE layers through the
     * expert-parallel exchange instead (lm_model_evaluate_by_exchange): no
     * gathered weights, the same collective agreement per layer */
    int xexchange;
    float *xlayer;
    size_t xheld, xpeak;
    int params_buffer, grads_buffer; /* the parameter and gradient blocks' entries in the memory plan */
    /* what the ops use: params, grads themselves on the CPU; else backend memory
     * (fp32 parameters P, gradients G, product-format parameters PL) */
    float *P, *G;
    void *PL;
    int params_on_host_newer; /* upload before the next forward */
    int params_on_backend_newer; /* an optimizer on the backend changed P: the host copy is stale */
    int grads_zero_pending;   /* zero G before the next forward */
    int dw_set;               /* lm_model_set_expert_grads_written */
    layer_state *layers;
    /* named parameters outside the layers */
    size_t embed_off, head_off, final_norm_off, ar_query_off, ar_key_off;
    int has_attnres_params;
    /* activations */
    float *act_block;
    size_t act_floats;
    float *x0, *hin, *xn, *rstd, *hf, *hn, *rstd_final, *lse_rows, *target_logit, *row_scale;
    float *y, *dy, *dxn, *dh, *dx0, *dhn, *dhf, *logits, *scratch;
    const float *dy_cur; /* the backward's dLoss/dy_l: dy, or the AttnRes state's own accumulator */
    const void *dy_lp_cur; /* dy_cur in the product format where the AttnRes state wrote it, else NULL */
    double *score_nll;   /* [N] evaluation's scores on a backend with memory of its own (else NULL) */
    int32_t *score_arg;  /* [N] */
    size_t scratch_floats;
    int32_t *tokens, *targets;
    int have_targets;
    /* lm_model_set_head_backward: the loss scale a training forward runs the
     * LM head's backward with (0: none); head_done: the last forward did, with
     * head_done_scale, so the backward takes dhn and the head's gradient as they are */
    float head_scale;
    int head_done;
    float head_done_scale;
    float aux_loss;
    double seconds[LM_TIME_COUNT];
    void *timer; /* the backend's part timer (lm_backend timer_create), or NULL */
    int checks_pending; /* deferred non-finite checks noted and not yet taken (defers_checks) */
    lm_fault fault; /* one-shot fault injection */
    /* lm_model_set_grad_ready_hook: told of each range of the gradient block
     * after its last write in a backward (NULL: nobody asks) */
    lm_grad_ready_fn grad_ready;
    void *grad_ready_user;
    /* residual stream */
    void *ar; /* the backend's residual-stream state */
    /* separate product format only: the model's own lp buffers, host copies */
    void *lp_block, *xn_lp, *hn_lp, *ffn_h_lp, *ffn_da_lp, *ffn_du_lp, *dy_lp;
    float *hn_host, *aux_host;
    /* the backend's deferred balance counts of every MoE layer (moe_balance_set_create; NULL: moe_balance_observe
     * adds into the host states at once) */
    void *bal_set;
    struct lm_comm *ep_comm; /* expert parallelism over these ranks (NULL: off) */
    int ep_next;     /* the forward's first sublayer whose EP agreement this rank has not joined */
    int ep_together; /* the forward failed at an agreement: every rank knows */
    /* context parallelism: this rank holds tokens [cp_t0, cp_t0 + T) of every
     * row of a sequence split over cp_ranks (0: not planned so); the
     * activation block then holds the token mixers' segment activations
     * (ls->cp_acts) in place of the one-rank ones, and their backward scratch
     * is the model's (cp_scratch = scratch) */
    struct lm_comm *cp_comm;
    int cp_t0, cp_ranks;
    float *cp_scratch;
    /* the activation block's entries in the memory plan: [act_ledger_first, + act_ledger_n) */
    int act_ledger_first, act_ledger_n;
    /* the memory plan: every backend buffer by name (lm_model_buffer_at) */
    lm_model_buffer *buffers;
    int n_buffers, cap_buffers;
    int dry;                 /* a plan only (lm_model_plan): nothing allocated */
    struct lm_backend plan_be; /* the plan's backend: its device, product format and ops */
    int64_t chunk;           /* tokens per chunk of the dense FFN and MoE (N: not chunked) */
    int lean_hin;            /* one sublayer input buffer, recomputed from the residual state */
    int fuse_norm;           /* the backend runs each sublayer's AttnRes input with its RMSNorm (no input buffer) */
    int replay;              /* the residual state keeps one block's partial sums: the backward replays each block */
    /* sequence segments (train.seq_segment < T): the layers run on tokens
     * [seg_t0, seg_t0 + T) of every row; B, T, N above are the current
     * segment's (the buffers are sized for S), Tq and Nq the whole rows' */
    int seg_on, seg_active; /* segmented; inside the loop over the segments */
    int S, n_seg, seg, seg_t0, seg_parity, Tq;
    int64_t Nq;
    /* the kept attention outputs (layer_state.keep_o) hold every segment's of
     * the last segmented forward (seg_kept); the segmented backward's
     * forwards reuse them (seg_reuse) */
    int seg_kept, seg_reuse;
    /* the buffers still hold the last segment's activations from the last
     * segmented forward: the backward starts there without its forward again */
    int seg_live;
    /* the last run of the layers finished: the shared activation buffers of
     * the recomputed kinds hold their last layer's (model_backward starts
     * each kind there without its forward again) */
    int fwd_live;
    void *ar_full, *ar_tail;       /* residual states of S tokens a row and of the last, shorter segment */
    float *seg_block;              /* backend memory: the carries, stores and accumulators */
    size_t seg_floats;
    float *seg_ht_junk;            /* the last segment's final KDA state (asked for, not kept) */
    void *seg_dk_tmp, *seg_dv_tmp; /* one row's attention gradient of every key and value */
    void *seg_k_work, *seg_v_work; /* one row's keys and values up-projected from MLA latents */
    int32_t *q_tok, *q_tgt, *seg_tok, *seg_tgt; /* host: the whole rows' tokens, targets; one segment's */
    double *seg_nll;                            /* host: one segment's scores (lm_model_score) */
    int32_t *seg_arg;
};

/* The element at offset `off` of the whole parameter layout in a block of
 * that layout cut by m->gcuts (the gradient block; the parameter block when
 * m->pcut): NULL where the cut drops it (another rank's experts). */
static inline float *lm_model_cut_at(const struct lm_model *m, float *block, size_t off) {
    size_t dropped = 0;
    for (int i = 0; i < m->n_gcuts; i++) {
        const struct gcut *c = &m->gcuts[i];
        if (off < c->offset) break;
        if (off < c->offset + c->numel) {
            if (off < c->offset + c->first || off >= c->offset + c->first + c->count) return NULL;
            return block + (off - dropped - c->first);
        }
        dropped += c->numel - c->count;
    }
    return block + (off - dropped);
}

/* The host parameter at offset `off` of the whole layout (NULL: cut away). */
static inline float *lm_model_host_param(const struct lm_model *m, size_t off) {
    return m->pcut ? lm_model_cut_at(m, m->params, off) : m->params + off;
}

#endif
