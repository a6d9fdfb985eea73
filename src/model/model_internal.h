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


typedef struct {
    lm_mixer_kind mixer;
    int moe;
    size_t mixer_norm_off, ffn_norm_off, mixer_off, ffn_off;
    /* KDA */
    lm_kda_layer_config kda_cfg;
    lm_kda_layer_params kda_p, kda_g;
    lm_kda_layer_acts kda_a;
    /* MLA */
    lm_mla_config mla_cfg;
    lm_mla_params mla_p, mla_g;
    float *mla_acts;
    float *smax, *smax_tmp; /* [H] largest logit per head over the step, and of one forward */
    /* dense FFN: W_gate [f,d], W_up [f,d], W_down [d,f]; activations [N,f] */
    float *ffn_a, *ffn_u, *ffn_h;
    /* MoE */
    lm_moe_config moe_cfg;
    lm_moe_params moe_p, moe_g;
    lm_moe_acts moe_a;
    lm_balance_state bal;
    int bal_ready, owns_moe_acts;
    float *dscores; /* aux loss gradient [N,n] (balance = aux) */
} layer_state;

struct lm_model {
    lm_config cfg;
    lm_backend *be; /* where the tensors live and whose ops compute the layers */
    int B, T, L2; /* L2 = 2 * n_layers sublayers */
    int64_t N;
    int d;
    lm_model_tensor *tensors;
    int n_tensors, cap_tensors;
    size_t n_params;
    float *params, *grads;
    layer_state *layers;
    /* named parameters outside the layers */
    size_t embed_off, head_off, final_norm_off, ar_query_off, ar_key_off;
    int has_attnres_params;
    /* activations */
    float *act_block;
    size_t act_floats;
    float *x0, *hin, *xn, *rstd, *hf, *hn, *rstd_final, *lse_rows, *target_logit;
    float *y, *dy, *dxn, *dh, *dx0, *dhn, *dhf, *logits, *scratch;
    size_t scratch_floats;
    int32_t *tokens, *targets;
    int have_targets;
    float aux_loss;
    double seconds[LM_TIME_COUNT];
    lm_fault fault; /* one-shot fault injection */
    /* residual stream */
    lm_attnres_state ar;
    void *ar_workspace;
};

#endif
