/* The whole K3-style model (SPEC §1): token embedding, L layers of a token
 * mixer (KDA or gated MLA) and a channel mixer (dense SwiGLU FFN for the
 * first `first_k_dense` layers, MoE after), every sublayer pre-norm and joined
 * by the residual of the config (standard, Block or Full AttnRes), a final
 * RMSNorm and the LM head with a chunked cross-entropy.
 *
 * Memory is planned at creation from the config and the batch shape: one block
 * of parameters, one of gradients (the same layout; under expert parallelism
 * with owner-only experts both hold only the rank's own experts' slices,
 * lm_model_create_expert_owned), one of activations and scratch; the only
 * other allocations are made once there too (MoE routing buffers, balancing
 * state), including one scratch that the KDA and attention operators share. The project allocates nothing inside a step (the OpenMP
 * runtime keeps its own small per-region bookkeeping).
 *
 * Parameter names (checkpoints, docs/model.md):
 *   embed [V,d]; lm_head [V,d] (absent when tied); final_norm [d];
 *   attnres.query, attnres.key_norm [2L+1, d] (absent for the standard residual);
 *   layers.<l>.mixer_norm, layers.<l>.ffn_norm [d];
 *   layers.<l>.kda.<W_q|W_k|W_v|conv_q|conv_k|conv_v|W_z|W_beta|A_log|dt_bias|W_g|o_norm|W_o>;
 *   layers.<l>.mla.<W_dq|q_norm|W_uq|W_dkv|kv_norm|W_uk|W_uv|W_kr|W_q|W_k|W_v|W_g|W_o>;
 *   layers.<l>.ffn.<W_gate|W_up|W_down>;
 *   layers.<l>.moe.<router|gate|up|down|lat_down|lat_norm|lat_up|shared_gate|shared_up|shared_down>;
 * and, not trained, the balancing bias layers.<l>.moe.bias [n] (trainer state). */
#ifndef LONGMOE_MODEL_H
#define LONGMOE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/backend.h"
#include "longmoe/balance.h"
#include "longmoe/config.h"
#include "longmoe/core.h"
#include "longmoe/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[3];
    size_t offset, numel;  /* in floats, within the parameter (and, unless cut, gradient) block */
    lm_param_kind kind;    /* decides Muon or AdamW and weight decay */
    int n_blocks;          /* Muon's row blocks (heads, experts) */
    float init_mean, init_std;
} lm_model_tensor;

typedef struct lm_model lm_model;

/* Plan and allocate a model for micro-batches of B sequences of T tokens, on
 * the CPU. */
lm_status lm_model_create(const lm_config *cfg, int B, int T, lm_model **out);
/* The same on a backend (backend.h; NULL: the CPU). The model keeps the
 * parameters and gradients of lm_model_params / lm_model_grads on the host
 * (the optimizer's and the checkpoints'); a backend with memory of its own
 * also holds fp32 copies and a product-format (bf16) copy of the parameters,
 * and the gradients, there. lm_model_init and lm_model_copy_state mark the
 * host parameters newer: the next forward uploads them. After changing host
 * parameters in any other way (an optimizer step, QK-Clip, loading), call
 * lm_model_upload_params; after a backward, lm_model_download_grads brings
 * the gradients to the host. On the CPU both are no-ops. The backend must
 * outlive the model. */
lm_status lm_model_create_on(const lm_config *cfg, int B, int T, struct lm_backend *backend, lm_model **out);
struct lm_backend *lm_model_backend(const lm_model *m);
lm_status lm_model_upload_params(lm_model *m);
lm_status lm_model_download_grads(lm_model *m);
/* The gradient block in the backend's memory (lm_model_num_grads floats, the
 * layout of lm_model_grads; the same pointer on the CPU): what a device engine
 * of the communication layer sums over ranks. Zeroed before the next forward. */
float *lm_model_backend_grads(lm_model *m);
/* The fp32 parameter block in the backend's memory (lm_model_num_kept_params
 * floats, the layout of lm_model_params; the same pointer on the CPU): what
 * ZeRO-1's all-gather on a device fills. After writing it, call
 * lm_model_params_changed_on_backend. */
float *lm_model_backend_param_block(lm_model *m);
void lm_model_free(lm_model *m);

/* Expert parallelism over the ranks of comm (docs/scaleout.md; through the
 * backend's moe_forward_ep / moe_backward_ep: comm a host engine on the CPU
 * backend, a device engine (NCCL, staged) on CUDA): rank r computes the
 * routed experts [r n / R, (r+1) n / R) of every MoE layer for the tokens of all ranks, which reach it by all-to-all in the
 * training forward and backward (lm_model_forward with training = 1 and
 * lm_model_backward are then collective over comm). The weights stay whole
 * unless cut (lm_model_keep_expert_weights, or lm_model_create_expert_owned):
 * evaluation forwards run every expert locally. The expert weight
 * gradients of this rank's backward are complete for its experts and zero for
 * the others (lm_model_keep_expert_grads keeps only its experts'). n_routed_experts
 * not divisible by R is LM_ERR_ARG. comm must outlive the model. */
struct lm_comm;
lm_status lm_model_set_expert_parallel(lm_model *m, struct lm_comm *comm);
/* Owner-only expert gradients (docs/scaleout.md, "Expert parallelism"): the
 * gradient block keeps, of each routed expert tensor (layers.L.moe.gate, .up,
 * .down, [n, ., .]), only the slice of experts [pos n / G, (pos+1) n / G),
 * and every other tensor whole: lm_model_num_grads = lm_model_num_params less
 * (G - 1) / G of the routed experts' weights. A model that trains needs
 * expert parallelism over G ranks at position pos first
 * (lm_model_set_expert_parallel over a handle of G ranks, this rank pos): its
 * backward writes exactly that slice; a backward after a forward that ran
 * every expert locally is then refused. The new block starts at zero. On a
 * plan (lm_model_plan) only the memory plan's gradient entry changes (what a
 * rank of such a run holds). CPU backend only (on a device the model is
 * created cut: lm_model_create_expert_owned); n_routed_experts must be divisible by
 * G; once per model. */
lm_status lm_model_keep_expert_grads(lm_model *m, int G, int pos);
/* Floats of the gradient block: lm_model_num_params unless cut above. */
size_t lm_model_num_grads(const lm_model *m);
/* Where tensor i's gradient lies in lm_model_grads: its elements [*first,
 * *first + *count) in order from the returned pointer (the whole tensor, 0 and
 * numel, unless cut above; NULL on a plan). In lm_model_optimizer_params the
 * descriptor of a cut tensor has no gradient (grad NULL). */
float *lm_model_grad_part(lm_model *m, int i, size_t *first, size_t *count);
/* Owner-only expert weights (docs/scaleout.md, "Expert parallelism"): the
 * parameter block is cut with the table of lm_model_keep_expert_grads (call
 * that first): of each routed expert tensor only this rank's slice of experts
 * is kept, every other tensor whole, in the gradient block's layout
 * (lm_model_num_kept_params = lm_model_num_grads floats; the training forward
 * and backward run the owned experts on their slice). Everything the model
 * reads from the block goes through that layout; the whole tensors' place
 * (lm_model_tensor.offset) is unchanged. A forward that runs every expert
 * locally (evaluation, lm_model_logits, lm_model_score) needs the experts
 * gathered first (lm_model_gather_experts), else it is refused; decoding
 * and lm_model_params at a tensor offset need the whole layout (use
 * lm_model_param_part and lm_model_tensor_data). lm_model_init draws the
 * whole random stream and stores the kept part (every kept weight one
 * process's bits); lm_model_copy_state copies between models that keep the
 * same parts (or from a whole source). On a plan only the memory plan's
 * parameter entry changes (what a rank of such a run holds). Once per model. */
lm_status lm_model_keep_expert_weights(lm_model *m);
/* Floats of the parameter block: lm_model_num_params unless cut above. */
size_t lm_model_num_kept_params(const lm_model *m);
/* A model that keeps only its own experts from the start (docs/scaleout.md,
 * "Expert parallelism"): the model of lm_model_create_on whose parameter and
 * gradient blocks are allocated in the layout that lm_model_keep_expert_grads
 * (G, pos) and then lm_model_keep_expert_weights leave (the replicated
 * tensors whole, of each routed expert tensor the slice of experts [pos n /
 * G, (pos+1) n / G)), so the whole blocks are never held: a rank's peak at
 * creation is its own share (lm_model_block_peak_bytes). The same tensor
 * table, views and behaviour as the cut model; lm_model_set_expert_parallel
 * follows, over a handle of G ranks on which this rank is pos (another is
 * LM_ERR_ARG), before training. On any backend (on a device its own
 * blocks are the kept size too; evaluation there goes through
 * lm_model_evaluate_by_exchange); n_routed_experts must be
 * divisible by G; the model needs MoE layers. */
lm_status lm_model_create_expert_owned(const lm_config *cfg, int B, int T, struct lm_backend *backend, int G, int pos,
                                       lm_model **out);
/* The memory plan of such a model (lm_model_plan's tables and ledger, the
 * parameter and gradient entries a rank at position pos of G allocates). */
lm_status lm_model_plan_expert_owned(const lm_config *cfg, int B, int T, lm_device device, int G, int pos,
                                     lm_model **out);
/* The most bytes of parameter and gradient blocks (host, and a backend's own
 * copies) the model held at once since its creation: both whole blocks for a
 * model created whole (more while lm_model_keep_expert_grads or
 * lm_model_keep_expert_weights copies into the smaller block), the kept
 * blocks only for lm_model_create_expert_owned; 0 for a plan. */
size_t lm_model_block_peak_bytes(const lm_model *m);
/* Where tensor i lies in lm_model_params: its elements [*first, *first +
 * *count) in order from the returned pointer (the whole tensor unless its
 * weights are cut above; NULL on a plan). */
float *lm_model_param_part(lm_model *m, int i, size_t *first, size_t *count);
/* The same parts in the backend's blocks (lm_model_backend_param_block,
 * lm_model_backend_grads: the same layouts; the host pointers on the CPU):
 * what a device optimizer over this rank's slices updates. */
float *lm_model_backend_param_part(lm_model *m, int i, size_t *first, size_t *count);
float *lm_model_backend_grad_part(lm_model *m, int i, size_t *first, size_t *count);
/* The cut experts' weights whole, for an evaluation or a checkpoint:
 * collective over the expert-parallel handle (lm_comm_all_gatherv of every
 * routed expert tensor; the ranks agree on an allocation failure first, so
 * none waits alone). The model then holds the experts twice (its slice, the
 * whole tensors) until lm_model_release_experts; the training step writes the
 * slice only. Nothing to do (LM_OK) when the weights are not cut or already
 * gathered. */
lm_status lm_model_gather_experts(lm_model *m);
void lm_model_release_experts(lm_model *m);
/* Evaluation forwards (lm_model_forward with training = 0, lm_model_score,
 * lm_model_logits) of a model that keeps only its own experts' weights
 * gather, with on = 1, each MoE layer's routed experts just before that
 * layer's channel mixer and free them after it, instead of refusing: the
 * extra memory is one layer's experts (lm_model_expert_layer_bytes), not the
 * whole model's, and the numbers are those of a forward on the experts
 * gathered whole (the same local computation). Such a forward is then
 * collective over the expert-parallel handle, every rank of it running the
 * same number of forwards: each MoE layer starts with an agreement of the
 * ranks, which a rank that failed earlier in the forward joins with its
 * failure, so none waits alone. on = 0 restores the refusal. Nothing changes
 * while the experts are gathered whole (lm_model_gather_experts). */
lm_status lm_model_gather_experts_by_layer(lm_model *m, int on);
/* Evaluation forwards of such a model run, with on = 1, each MoE layer
 * through the expert-parallel exchange (the training forward's path: each
 * owner computes its experts for every rank's tokens) instead of gathering
 * the layer's experts: no expert weights beyond the model's slice, the same
 * collective agreement per layer and the same requirement that every rank of
 * the group runs the same number of forwards. The numbers are the exchange's
 * (on a GPU equal to the local layer's to the products' rounding). What a
 * model in a backend's own memory (a GPU) uses, where the gather above would
 * need host copies; on = 0 restores the gather or the refusal. */
lm_status lm_model_evaluate_by_exchange(lm_model *m, int on);
/* Bytes of the largest MoE layer's routed experts whole (its gate, up and
 * down tensors) when the model keeps only its own experts' weights (what an
 * evaluation forward gathering layer by layer holds at most besides the
 * model; on a plan too); 0 otherwise. */
size_t lm_model_expert_layer_bytes(const lm_model *m);
/* The expert-parallel exchange's memory of every MoE layer of m over R ranks
 * at a balanced load (each owner receiving the rank's micro-batch chunk x
 * top_k rows a layer; an uneven load grows it): the backend's handles
 * (lm_ops moe_ep_bytes) summed; 0 for R < 2 or a model without MoE layers.
 * `longmoe plan --memory --ep G` shows it. */
size_t lm_model_ep_exchange_bytes(const lm_model *m, int R);
/* The most bytes of gathered expert weights (lm_model_gather_experts, or a
 * layer in an evaluation forward) the model held at once since the last
 * reset (reset = 1 starts a new count at what it holds now). */
size_t lm_model_gathered_peak_bytes(lm_model *m, int reset);
/* 1 when every tensor is whole on this rank (not cut, or gathered). */
int lm_model_experts_gathered(const lm_model *m);
/* Tensor i's numel floats whole (in the parameter block, or gathered), in the
 * layout of the checkpoints; NULL for a cut expert tensor not gathered (or a
 * plan). */
const float *lm_model_tensor_data(const lm_model *m, int i);

/* Context parallelism over the ranks of comm (docs/scaleout.md "Context
 * parallelism in the model"), on the model's backend: comm's engine works on
 * its memory (MPI for the CPU; NCCL or the staged engine for a GPU, on the
 * backend's stream). The model's B x T is this
 * rank's segment: rank r holds tokens [t0_r, t0_r + T_r) of each of the B
 * rows, segments in rank order without gaps (t0_r = T_0 + ... + T_{r-1}),
 * every rank the same B. The KDA and attention sublayers run
 * lm_kda_layer_cp_*_lp and lm_mla_cp_*_lp (the QK-Clip maxima
 * lm_mla_cp_head_max_lp);
 * everything else is token-local and unchanged. Every forward and backward
 * is then collective over comm. The loss is the mean over the rank's own
 * B T tokens; the parameter gradients are the rank's part: with loss_scale
 * T_r / (T_0 + ... + T_{R-1}) on rank r their sum over the ranks is the whole
 * sequence's. Call once, after creating the model (collective: the ranks
 * exchange B and T). The activation block is planned anew: the token
 * mixers' segment activations (the attention's for its prefix too) take the
 * place of their one-rank activations, which a context-parallel model never
 * uses, and their backward scratch is the model's (the old block is released
 * before the new one is allocated). With expert parallelism too
 * (lm_model_set_expert_parallel after this, over its own handle): the MoE
 * layers exchange tokens over the expert-parallel ranks, which may hold
 * segments of other rows or positions. comm must outlive the model. */
lm_status lm_model_set_context_parallel(lm_model *m, struct lm_comm *comm);
/* The same memory plan on a plan (lm_model_plan) for the rank of `ranks`
 * (>= 2) whose segment, the plan's B x T, starts at token t0 (the attention's
 * stores grow with t0, the KDA layers' part with T): its activation entries
 * replaced by the context-parallel layout. `longmoe plan --memory --cp N`. */
lm_status lm_model_plan_context_parallel(lm_model *m, int ranks, int t0);

/* Initialise every parameter from `seed` (reproducible) and reset the balancing. */
void lm_model_init(lm_model *m, uint64_t seed);

const lm_config *lm_model_config(const lm_model *m);
/* The micro-batch shape the model was planned for. */
void lm_model_shape(const lm_model *m, int *B, int *T);
/* Copy the parameters and the balancing state (biases, windows, counters) of
 * `src` into `dst`, a model of the same config planned for another shape (a
 * new stage of context extension). */
lm_status lm_model_copy_state(lm_model *dst, const lm_model *src);
int lm_model_num_tensors(const lm_model *m);
const lm_model_tensor *lm_model_tensor_at(const lm_model *m, int i);
const lm_model_tensor *lm_model_find(const lm_model *m, const char *name);
size_t lm_model_num_params(const lm_model *m);
/* The parameter block: lm_model_num_kept_params floats (the whole layout,
 * tensor i at lm_model_tensor_at(m, i)->offset, unless the expert weights are
 * cut: lm_model_param_part). */
float *lm_model_params(lm_model *m);
float *lm_model_grads(lm_model *m);
size_t lm_model_activation_bytes(const lm_model *m);

/* The memory plan: every buffer the model holds in its backend's memory, by
 * name, in the order it is planned (parameters, gradients, their product-
 * format copy, each activation and scratch buffer, tokens, the MoE routing
 * buffers, the residual stream's state, the backend's operator scratch).
 * The model allocates from this very plan. */
typedef struct {
    char name[160];
    size_t bytes;
} lm_model_buffer;
int lm_model_num_buffers(const lm_model *m);
const lm_model_buffer *lm_model_buffer_at(const lm_model *m, int i);
/* The plan's total: the bytes of every buffer above. */
size_t lm_model_plan_bytes(const lm_model *m);
/* Plan a model for a device without allocating it (no GPU needed, a build
 * with CUDA for LM_DEVICE_CUDA): the parameter table and the memory plan of
 * lm_model_create_on at B x T. Only the tables may be read (lm_model_num_*,
 * lm_model_tensor_at, lm_model_buffer_at, lm_model_activation_bytes,
 * lm_model_optimizer_params: descriptors with NULL data); free with
 * lm_model_free. */
lm_status lm_model_plan(const lm_config *cfg, int B, int T, lm_device device, lm_model **out);

/* Forward over tokens [B,T] (ids < vocab_size). With targets [B,T] it returns
 * the mean cross-entropy in *loss and keeps what the backward needs; in
 * training mode it also feeds the MoE balancers. */
lm_status lm_model_forward(lm_model *m, const int32_t *tokens, const int32_t *targets, int training,
                           float *loss);
/* Backward of the last forward with targets: ACCUMULATES into the gradients,
 * scaled by `loss_scale` (1 / micro-batches for gradient accumulation). */
lm_status lm_model_backward(lm_model *m, float loss_scale);
/* For training steps whose loss scale is known before the forward: each
 * training forward with targets (training = 1) then runs the LM head's
 * backward with `loss_scale` too, computing each chunk's logits once instead
 * of again in the backward (on a backend with the fused op; elsewhere the two
 * in turn). The next lm_model_backward must pass the same scale, and
 * lm_model_backward_weighted is refused (LM_ERR_ARG), until the next forward.
 * Gradients and losses are the same bits as without. With train.seq_segment
 * the forward keeps no segment's head; the segmented backward, which runs
 * each segment's forward again (but the last's, left in the buffers by the
 * forward: its head alone), always runs that segment's head backward with
 * it. 0 (the default) turns it off; a negative or non-finite scale is
 * LM_ERR_ARG. */
lm_status lm_model_set_head_backward(lm_model *m, float loss_scale);
/* Log-probabilities of the targets of the last forward with targets (before
 * its backward): logp [B,T], log p(target_i) = z_i[target_i] - logsumexp(z_i). */
lm_status lm_model_token_logprobs(const lm_model *m, float *logp);
/* Backward of a loss given per position as dlogp [B,T] = dLoss / dlog p(target_i)
 * (policy-gradient objectives; a zero weight takes nothing from that
 * position's target). ACCUMULATES like lm_model_backward, which is the case
 * dlogp[i] = -loss_scale / (B T); the auxiliary balance loss enters with scale 1. */
lm_status lm_model_backward_weighted(lm_model *m, const float *dlogp);
/* Told during a backward that a range of the gradient block is final:
 * [offset, offset + count) in the parameter table's layout (tensor offsets,
 * lm_model_tensor_at; the gradient block itself unless the model keeps
 * owner-only expert slices), after the last operation that writes it has been
 * run (CPU) or enqueued on the backend's stream (GPU: the writes are complete
 * once that stream reaches this point). Each backward (lm_model_backward,
 * lm_model_backward_weighted) reports every element of [0, n_params) exactly
 * once, in whole tensors, in this order: lm_head (when not tied), final_norm;
 * for each layer from the last to the first, its channel mixer's range
 * (ffn_norm and the FFN or MoE tensors), then its token mixer's (mixer_norm
 * and the KDA or attention tensors); the AttnRes queries and key norms (their
 * rows are written by every sublayer's backward, so after the last layer's);
 * the embedding last (with a tied LM head, which the cross-entropy writes
 * first). With train.seq_segment the backward runs every segment's, last to
 * first: the ranges are reported in the first segment's (the last to write).
 * A backward ACCUMULATES: with several micro-batches a range is final for the
 * step only in the last one's backward, so set the hook for that backward alone.
 * A non-OK status from fn stops the backward and is returned by it. fn NULL:
 * none. */
typedef lm_status (*lm_grad_ready_fn)(void *user, size_t offset, size_t count);
void lm_model_set_grad_ready_hook(lm_model *m, lm_grad_ready_fn fn, void *user);
/* Zero the gradients (on a backend with memory of its own: there, before the
 * next forward; the host copy, lm_model_grads, is then current only after
 * lm_model_download_grads). */
void lm_model_zero_grads(lm_model *m);
/* on (the default on a backend with memory of its own, where the zeroing is a
 * pass over the device's memory): a zeroing of the gradients leaves out the
 * routed experts' weight gradients of the MoE layers that run here whole (no
 * expert parallelism, all experts' gradients kept), and the layer's first
 * backward after it writes them instead of adding to zeros. The gradients a
 * backward gives are the same either way (the ops' expert_grads_set); what a
 * backward did not reach is zeroed by its end and before
 * lm_model_download_grads. 0: zeroed with the rest (the CPU's default). */
lm_status lm_model_set_expert_grads_written(lm_model *m, int on);
int lm_model_expert_grads_written(const lm_model *m);

/* Logits [B,T,V] of the last forward's positions (for evaluation and tests;
 * allocates nothing: `logits` is the caller's). Runs its own forward. */
lm_status lm_model_logits(lm_model *m, const int32_t *tokens, float *logits);
/* Evaluation's scores without logits: a forward over tokens [B,T] (not
 * training), then the LM head chunk by chunk on the model's backend (the
 * chunks of the training cross-entropy; no [B,T,V] logits anywhere): per
 * position nll[i] = -log p(targets[i]) (log-sum-exp around the maximum, in
 * double) and argmax[i], the lowest index among equal maxima; both [B,T] on
 * the host. On the CPU these are lm_score_row of lm_model_logits' logits bit
 * for bit; on a GPU the logits are the bf16 products' (docs/eval.md). */
lm_status lm_model_score(lm_model *m, const int32_t *tokens, const int32_t *targets, double *nll, int32_t *argmax);

/* MoE balancing: number of MoE layers, their states (bias, histograms).
 * A training forward on a backend that counts on the device (CUDA, the
 * histogram estimators) leaves the step's counts there: a state's counts,
 * loads, tokens and entropy include them after lm_model_balance_sync (b and
 * the configuration are always current). */
int lm_model_num_moe_layers(const lm_model *m);
int lm_model_moe_layer_index(const lm_model *m, int i); /* model layer of the i-th MoE layer */
lm_balance_state *lm_model_balance(lm_model *m, int i);
/* Add the counts of the training forwards since the last call into the
 * states (one download for every layer; nothing to do on the CPU). A score
 * outside [0, 1] or not finite among them: LM_ERR_NUMERIC naming the MoE
 * layer (the other layers still take theirs). */
lm_status lm_model_balance_sync(lm_model *m);
/* End the training step for every MoE layer (updates b when training = 1),
 * after lm_model_balance_sync (whose error it returns: with training = 1
 * before ending, b kept; with training = 0 after ending every layer);
 * stats (may be NULL) receives lm_model_num_moe_layers entries. */
lm_status lm_model_balance_step_end(lm_model *m, int training, lm_balance_stats *stats);
/* Auxiliary balance loss of the last forward (0 unless balance = aux). */
float lm_model_aux_loss(const lm_model *m);

/* Fault injection (tests of the trainer's handling of non-finite values):
 * the next forward puts a NaN into the embedded batch (LM_FAULT_BATCH) or into
 * a router score of the first MoE layer (LM_FAULT_ROUTER); the next backward
 * leaves a NaN in a gradient (LM_FAULT_GRADIENT); LM_FAULT_LOSS is the
 * trainer's own (a non-finite loss). Forwards report non-finite sublayer
 * outputs and router scores as LM_ERR_NUMERIC. */
typedef enum { LM_FAULT_NONE = 0, LM_FAULT_BATCH, LM_FAULT_ROUTER, LM_FAULT_GRADIENT, LM_FAULT_LOSS } lm_fault;
void lm_model_inject_fault(lm_model *m, lm_fault fault);

/* QK-Clip (SPEC §6): apply to every attention layer the largest logit per
 * head seen by the training forwards since the last call (tau <= 0: only
 * measure), then reset. *max_logit receives the largest over all heads (-inf
 * without attention layers), *n_clipped the heads scaled. */
lm_status lm_model_qk_clip(lm_model *m, float tau, float *max_logit, int *n_clipped);
/* The per-head maxima QK-Clip will use (one float per head of each attention
 * layer, in layer then head order; -inf where nothing was seen): a
 * data-parallel trainer takes the largest over the ranks before
 * lm_model_qk_clip, so every replica clips the same heads. */
int lm_model_qk_max_count(const lm_model *m);
void lm_model_qk_max_get(const lm_model *m, float *out);
void lm_model_qk_max_set(lm_model *m, const float *in);

/* Wall time spent by component since the last reset (forward + backward). On
 * a device backend with a part timer (lm_backend timer_*) the parts are the
 * device's time between marks, taken when read here; without one the model
 * waits for the device at each part's end. */
typedef enum {
    LM_TIME_KDA = 0, LM_TIME_ATTENTION, LM_TIME_MOE, LM_TIME_DENSE_FFN, LM_TIME_ATTNRES, LM_TIME_NORMS,
    LM_TIME_LM_HEAD, LM_TIME_COUNT
} lm_time_part;
const char *lm_time_part_name(lm_time_part p);
void lm_model_timings(lm_model *m, double seconds[LM_TIME_COUNT]);
void lm_model_reset_timings(lm_model *m);

/* The optimizer's view of the parameters: one lm_param per tensor, pointing
 * into the model's blocks (n = lm_model_num_tensors). */
void lm_model_optimizer_params(lm_model *m, lm_param *params, lm_train_optimizer which);

/* ---- an optimizer on the model's backend (optim_device.h; docs/optim.md) ----
 * lm_model_backend_params: the same descriptors with data and grad in the
 * backend's fp32 parameter and gradient blocks (on the CPU, the host blocks).
 * After the backend's parameters were changed there (lm_device_optimizer_step),
 * lm_model_params_changed_on_backend refreshes the product-format copy and
 * marks the host parameters stale: the next forward uses the backend's, and
 * lm_model_qk_clip then clips the backend's rows. lm_model_download_params
 * brings them to the host (before a checkpoint, an evaluation through
 * lm_model_logits, or lm_model_copy_state, which refuses a source whose host
 * copy is stale); lm_model_upload_params (host -> backend) clears the mark.
 * On the CPU these calls do nothing. */
void lm_model_backend_params(lm_model *m, lm_param *params, lm_train_optimizer which);
lm_status lm_model_params_changed_on_backend(lm_model *m);
lm_status lm_model_download_params(lm_model *m);
/* 1 while the host parameters are older than the backend's */
int lm_model_host_params_stale(const lm_model *m);

/* ---- decoding (docs/sampling.md) ----
 * A decoder runs a model token by token for B sequences of at most max_T
 * tokens. It borrows the model's parameters and frozen MoE balancing bias (the
 * model must outlive it; nothing of the model is changed) and owns its caches:
 * per KDA layer the short-conv history and the recurrent state (a fixed size
 * per sequence), per attention layer the latent (MLA) or key/value (GQA) cache
 * (a fixed size per token). All memory is planned at creation; a step
 * allocates nothing beyond the operators' small per-thread scratch. */
typedef struct lm_decoder lm_decoder;

lm_status lm_decoder_create(lm_model *m, int B, int max_T, lm_decoder **out);
void lm_decoder_free(lm_decoder *dec);

/* Start B new sequences with prompts tokens [B,T] (1 <= T <= max_T): the
 * chunked forward over the prompts fills the caches; logits_last [B,V] (may be
 * NULL) receives the logits of each prompt's last position. */
lm_status lm_decoder_prefill(lm_decoder *dec, const int32_t *tokens, int T, float *logits_last);
/* Empty the caches: the next step is each sequence's first token. */
void lm_decoder_reset(lm_decoder *dec);
/* One token per sequence, tokens [B], at position lm_decoder_length -> logits [B,V]. */
lm_status lm_decoder_step(lm_decoder *dec, const int32_t *tokens, float *logits);
/* Tokens held per sequence. */
int lm_decoder_length(const lm_decoder *dec);
/* Cache memory for all B sequences: *fixed_bytes (KDA states and conv tails,
 * independent of the length) and *bytes_per_token (attention caches per
 * token of every sequence). */
void lm_decoder_cache_bytes(const lm_decoder *dec, size_t *fixed_bytes, size_t *bytes_per_token);

/* Sampling from logits [V]: temperature 0 is greedy (the lowest index among
 * equal maxima); otherwise softmax(logits / temperature) restricted to the
 * smallest set of most likely tokens whose mass reaches top_p (0 < top_p <= 1),
 * renormalised, drawn with `rng`. `work` holds lm_sample_work_bytes(V) bytes. */
size_t lm_sample_work_bytes(int V);
lm_status lm_sample_token(const float *logits, int V, float temperature, float top_p, lm_rng *rng,
                          void *work, int32_t *token);

#ifdef __cplusplus
}
#endif
#endif
