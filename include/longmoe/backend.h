/* A backend: where the model's tensors live and which kernels compute its
 * layers (docs/model.md, "Backends"). One description of the model (the
 * parameter table, the layer order, the residual stream, routing and
 * balancing) runs on every backend; a backend supplies memory and the ops
 * below, nothing else.
 *
 *   lm_backend_cpu()   fp32 everywhere, OpenMP; the exact reference
 *   (CUDA)             device memory, bf16 products (src/cuda, later)
 *
 * Tensors are plain pointers into the backend's memory. Every op takes the
 * backend first. Shapes are row-major, N = tokens of the micro-batch.
 *
 * The product format ("lp", low precision). A matrix product reads its two
 * operands in the backend's product format: fp32 on the CPU (lp_bytes = 4),
 * bf16 on the GPU (lp_bytes = 2). Layers keep an lp view of each tensor
 * that feeds a product; on the CPU the view IS the fp32 tensor (to_lp with
 * dst == src does nothing), so the CPU path computes exactly what it always
 * did. Everything else (gates, beta, state, norms' statistics, softmax
 * statistics, the router, the residual stream, gradients) stays fp32.
 *
 * Backward ops ACCUMULATE (+=) into fp32 parameter gradients; an op says
 * when it writes (=) an activation gradient instead. Gradient pointers may be
 * NULL to skip them.
 *
 * Token ids (int32) live in the backend's memory too. Ops enqueue their work
 * in order (a GPU backend on one stream: an op that also uses a second one
 * waits for it there before returning); results that come back to the host
 * (a loss sum, a head maximum, a non-finite index) synchronise. Scratch that
 * an op needs beyond its arguments is the backend's own (planned once per
 * size: the CUDA backend grows one arena on first use and keeps it). */
#ifndef LONGMOE_BACKEND_H
#define LONGMOE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/attention.h"
#include "longmoe/attnres.h"
#include "longmoe/balance.h"
#include "longmoe/kda.h"
#include "longmoe/moe.h"
#include "longmoe/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_DEVICE_CPU = 0, LM_DEVICE_CUDA = 1 } lm_device;
/* "cpu" | "cuda" */
const char *lm_device_name(lm_device d);
int lm_device_from_name(const char *name, lm_device *out); /* 0 on success */

typedef struct lm_backend lm_backend;
struct lm_comm; /* include/longmoe/comm.h */

/* The most slots of a backend's list of deferred non-finite checks (lm_ops nonfinite_note). */
#define LM_NONFINITE_SLOTS 1024

/* The expert activation of the GLU layers (moe.h's lm_expert_act values). */
typedef int lm_glu_kind;

typedef struct {
    /* ---- products ---- */
    /* out[n,oc] = inp[n,ic] . w[oc,ic]^T (written) */
    lm_status (*matmul_forward)(lm_backend *be, float *out, const void *inp_lp, const void *w_lp, int64_t n,
                                int ic, int oc);
    /* the same product written in the product format (one rounding of the fp32
     * sums), for outputs that only feed other products or ops taking that
     * format; on the CPU the product format is fp32 and this is matmul_forward */
    lm_status (*matmul_forward_lp)(lm_backend *be, void *out_lp, const void *inp_lp, const void *w_lp, int64_t n,
                                   int ic, int oc);
    /* dinp[n,ic] += dout . w;  dw[oc,ic] += dout^T . inp */
    lm_status (*matmul_backward)(lm_backend *be, float *dinp, float *dw, const void *dout_lp, const void *inp_lp,
                                 const void *w_lp, int64_t n, int ic, int oc);
    /* the same with dinp written instead of added to (no zeroing pass on the
     * GPU); dw accumulates */
    lm_status (*matmul_backward_set)(lm_backend *be, float *dinp, float *dw, const void *dout_lp,
                                     const void *inp_lp, const void *w_lp, int64_t n, int ic, int oc);
    /* dst (product format) = src; on the CPU dst == src is allowed and free */
    lm_status (*to_lp)(lm_backend *be, void *dst_lp, const float *src, size_t n);
    /* Optional (NULL: not offered, as on the CPU, whose product format is the
     * fp32 tensor itself). Side-by-side operands in the product format:
     * matmul_backward (set 0) or matmul_backward_set (set 1) with dout's rows
     * ld_dout elements apart (>= oc; the GPU's: a multiple of 8), a column
     * block of a wider matrix; and to_lp of rows x cols values (dense in src)
     * into rows ld_dst (>= cols) elements apart in dst. */
    lm_status (*matmul_backward_ld)(lm_backend *be, float *dinp, float *dw, const void *dout_lp, int64_t ld_dout,
                                    const void *inp_lp, const void *w_lp, int64_t n, int ic, int oc, int set);
    lm_status (*to_lp_rows)(lm_backend *be, void *dst_lp, int64_t ld_dst, const float *src, int64_t rows,
                            int64_t cols);

    /* ---- norms, embedding, activations ---- */
    /* out = inp / rms(inp) * w (w may be NULL), rstd[n] = 1/rms; out_lp (may be
     * NULL) receives out in the product format too */
    lm_status (*rmsnorm_forward)(lm_backend *be, float *out, void *out_lp, float *rstd, const float *inp,
                                 const float *w, int64_t n, int d, float eps);
    lm_status (*rmsnorm_backward)(lm_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                                  const float *w, const float *rstd, int64_t n, int d, float eps);
    /* the same with dinp written instead of added to; dw accumulates */
    lm_status (*rmsnorm_backward_set)(lm_backend *be, float *dinp, float *dw, const float *dout, const float *inp,
                                      const float *w, const float *rstd, int64_t n, int d, float eps);
    /* out[n,d] = table[tokens[i]] (=); dtable[tokens[i]] += dout[i] in token order */
    lm_status (*embedding_forward)(lm_backend *be, float *out, const float *table, const int32_t *tokens,
                                   int64_t n, int d);
    lm_status (*embedding_backward)(lm_backend *be, float *dtable, const float *dout, const int32_t *tokens,
                                    int64_t n, int d, int vocab);
    /* h = act(a, u) elementwise, h also in the product format (h_lp may equal h on the CPU) */
    lm_status (*glu_forward)(lm_backend *be, lm_glu_kind act, float *h, void *h_lp, const float *a, const float *u,
                             size_t n);
    /* da = dh * dact/da, du = dh * dact/du (written) into da, du (fp32) and/or
     * da_lp, du_lp (the product format, the same values rounded: what to_lp
     * of da, du gives); each fp32 output may be NULL when its lp one is given,
     * each lp one NULL (on the CPU it may equal its fp32 output) */
    lm_status (*glu_backward)(lm_backend *be, lm_glu_kind act, float *da, float *du, void *da_lp, void *du_lp,
                              const float *dh, const float *a, const float *u, size_t n);
    /* out = sigmoid(in) (in-place allowed) */
    lm_status (*sigmoid_forward)(lm_backend *be, float *out, const float *in, size_t n);
    /* dlogit = dout * y * (1 - y), y = sigmoid output (written; dlogit may equal dout) */
    lm_status (*sigmoid_backward)(lm_backend *be, float *dlogit, const float *dout, const float *y, size_t n);

    /* ---- the LM head with a chunked cross-entropy (never [N, V] logits) ---- */
    /* bytes of `work` the two calls below need */
    size_t (*cross_entropy_work_bytes)(lm_backend *be, int64_t n, int d, int vocab);
    /* lse[n] (fp32), target_logit[n] (may be NULL) and *loss_sum = sum over
     * rows of lse - logit[target] (host double) */
    lm_status (*cross_entropy_forward)(lm_backend *be, float *lse, float *target_logit, double *loss_sum,
                                       const void *hn_lp, const void *head_lp, const int32_t *targets, int64_t n,
                                       int d, int vocab, void *work);
    /* dlogits = (softmax - onehot(target)) * g_r with g_r = scale * row_scale[r]
     * (row_scale NULL: scale); dhn += dlogits . head, dhead += dlogits^T . hn */
    lm_status (*cross_entropy_backward)(lm_backend *be, float *dhn, float *dhead, const void *hn_lp,
                                        const void *head_lp, const int32_t *targets, const float *lse,
                                        const float *row_scale, float scale, int64_t n, int d, int vocab,
                                        void *work);
    /* Both above in one pass (row_scale NULL), for a training forward whose
     * loss scale is known in advance (lm_model_set_head_backward): a backend
     * that computes each chunk's logits once instead of twice; the outputs are
     * the two calls' bits. NULL where a backend has nothing better than the
     * two calls, which the model then makes in turn (the CPU). */
    lm_status (*cross_entropy_forward_backward)(lm_backend *be, float *lse, float *target_logit, double *loss_sum,
                                                float *dhn, float *dhead, const void *hn_lp, const void *head_lp,
                                                const int32_t *targets, float scale, int64_t n, int d, int vocab,
                                                void *work);
    /* evaluation's scoring through the same chunks (the same `work`): per row
     * r of z = hn . head^T, nll[r] = max z + log(sum_v exp(z_v - max z)) -
     * z[target] (double) and argmax[r] (the lowest index among equal maxima),
     * both written in the backend's memory. On the CPU the logits are those of
     * matmul_forward and the sum of exponentials is in double in vocabulary
     * order (lm_eval_score's arithmetic, bit for bit); a non-finite logit
     * gives a non-finite nll. */
    lm_status (*score_forward)(lm_backend *be, double *nll, int32_t *argmax, const void *hn_lp,
                               const void *head_lp, const int32_t *targets, int64_t n, int d, int vocab, void *work);

    /* ---- gated attention (src/model/mla.c) ---- */
    /* causal softmax attention (attention.h's shapes): o (lp), lse [B,H,T],
     * rowmax [B,H,T] (each query's largest scaled score, may be NULL) */
    lm_status (*attention_forward)(lm_backend *be, const lm_attention_config *cfg, const void *q, const void *k,
                                   const void *v, void *o, float *lse, float *rowmax);
    /* dq, dk, dv (lp) WRITTEN */
    lm_status (*attention_backward)(lm_backend *be, const lm_attention_config *cfg, const void *q, const void *k,
                                    const void *v, const void *o, const float *lse, const void *d_o, void *dq,
                                    void *dk, void *dv);
    /* queries at positions q_offset .. q_offset+T-1 over keys 0 .. q_offset+T-1
     * (attention.h's lm_attention_forward_offset): q, o, lse, rowmax of the T
     * queries, k and v of the q_offset+T keys; q_offset 0 is attention_forward */
    lm_status (*attention_forward_offset)(lm_backend *be, const lm_attention_config *cfg, int q_offset,
                                          const void *q, const void *k, const void *v, void *o, float *lse,
                                          float *rowmax);
    /* dq [the T queries], dk, dv [the q_offset+T keys] (lp) WRITTEN */
    lm_status (*attention_backward_offset)(lm_backend *be, const lm_attention_config *cfg, int q_offset,
                                           const void *q, const void *k, const void *v, const void *o,
                                           const float *lse, const void *d_o, void *dq, void *dk, void *dv);
    /* the largest scaled score per head over the batch, head_max [H] on the
     * host, from the `rowmax` buffer that attention_forward filled (its
     * contents are the backend's own: per query on the CPU, the maximum of
     * each query; on the GPU, the per-head maxima themselves in its first H
     * floats, which this call downloads (synchronising)) */
    lm_status (*attention_head_max)(lm_backend *be, const lm_attention_config *cfg, const float *rowmax,
                                    float *head_max);
    /* gated = sigmoid(gate_logits) ⊙ o (fp32, and gated_lp for W_o) */
    lm_status (*gate_forward)(lm_backend *be, float *gated, void *gated_lp, const float *gate_logits,
                              const void *o_lp, size_t n);
    /* d_o (lp) and dgate_logits WRITTEN from d_gated; dgate_logits into fp32
     * and/or dgate_logits_lp (the product format, the bits to_lp would give):
     * either may be NULL, not both (on the CPU the lp one may equal the fp32) */
    lm_status (*gate_backward)(lm_backend *be, void *d_o_lp, float *dgate_logits, void *dgate_logits_lp,
                               const float *d_gated, const float *gate_logits, const void *o_lp, size_t n);

    /* ---- the KDA token mixer's pieces (src/model/kda_layer.c) ---- */
    /* conv_out = ShortConv(in) (causal, depthwise, width W, zero history per
     * sequence), out = SiLU(conv_out), L2-normalised per head of head_dim
     * channels when rnorm != NULL (rnorm[rows] = 1/||SiLU(conv)||). in [B,T,C];
     * out in the KDA operator's input format (lp); conv_out [B,T,C] fp32, or
     * NULL: not written (the backward recomputes it) */
    lm_status (*conv_silu_forward)(lm_backend *be, float *conv_out, void *out_lp, float *rnorm, const float *in,
                                   const float *w, int B, int T, int C, int W, int head_dim);
    /* din (written) and dw += from dout (the operator's gradient, lp); out is
     * the forward's output; conv_out the forward's, or NULL: recomputed from
     * in and w with the forward's arithmetic (the same bits, so the same din
     * and dw); tmp holds B*T*C floats of scratch */
    lm_status (*conv_silu_backward)(lm_backend *be, float *din, float *dw, const void *dout_lp,
                                    const float *conv_out, const void *out_lp, const float *rnorm, const float *in,
                                    const float *w, int B, int T, int C, int W, int head_dim, float *tmp);
    /* optional (NULL: conv_silu_backward, then to_lp): the same with din written
     * in the product format for the product that takes it next, its rows
     * ld_din >= C elements apart (more than C: a column block of a wider
     * operand, whose other columns are not written) */
    lm_status (*conv_silu_backward_lp)(lm_backend *be, void *din_lp, float *dw, const void *dout_lp,
                                       const float *conv_out, const void *out_lp, const float *rnorm,
                                       const float *in, const float *w, int B, int T, int C, int W, int head_dim,
                                       int ld_din, float *tmp);
    /* the operator (SPEC §2): o (lp) from q, k, v, z (lp), beta, A_log, dt_bias
     * (fp32); h0 [B,H,K,V] the initial state (NULL: zero), ht (NULL: not
     * written) the final state, both fp32 (sequence segments, docs/model.md) */
    lm_status (*kda_forward)(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k, const void *v,
                             const void *z, const float *beta, const float *A_log, const float *dt_bias,
                             const float *h0, void *o, float *ht);
    /* optional (NULL: none kept): bytes of the training forward's
     * intermediates that kda_forward keeps in cfg->kept for kda_backward, so
     * that the backward does not recompute them (lm_kda_config) */
    size_t (*kda_kept_bytes)(lm_backend *be, const lm_kda_config *cfg);
    /* dq, dk, dv, dz (lp), dbeta WRITTEN; dA_log, ddt_bias ACCUMULATED; h0 the
     * forward's, dht the final state's gradient (NULL: zero), dh0 (NULL: not
     * wanted) the initial state's, WRITTEN */
    lm_status (*kda_backward)(lm_backend *be, const lm_kda_config *cfg, const void *q, const void *k,
                              const void *v, const void *z, const float *beta, const float *A_log,
                              const float *dt_bias, const float *h0, const void *d_o, const float *dht, void *dq,
                              void *dk, void *dv, void *dz, float *dbeta, float *dA_log, float *ddt_bias,
                              float *dh0);
    /* The KDA state map's step across context-parallel segments
     * (include/longmoe/kda_state_map.h), n_pairs maps of P [K,K] with Q, S,
     * out [K,V], fp32: out = P S + Q, or (transposed) out = P^T S + Q. S NULL:
     * zero. out must not overlap S. */
    lm_status (*kda_state_apply)(lm_backend *be, int n_pairs, int K, int V, const float *P, const float *Q,
                                 const float *S, float *out, int transposed);
    /* gate = sigmoid(gate_logits) (in place: gate may equal gate_logits),
     * gated = gate ⊙ RMSNorm_head(o; o_norm) into gated_lp (the input of W_o)
     * and, when gated != NULL, in fp32; o_rstd [N*H] */
    lm_status (*kda_output_forward)(lm_backend *be, float *gated, void *gated_lp, float *o_rstd, float *gate,
                                    const float *gate_logits, const void *o_lp, const float *o_norm, int64_t N, int H,
                                    int K, float eps);
    /* from d_gated: dgate_logits (written, fp32 and/or dgate_logits_lp in the
     * product format, as gate_backward; dgate_logits_lp's rows ld_dgate_lp
     * elements apart, 0: H*K, more only where the backend offers
     * matmul_backward_ld), d_o (lp, written), do_norm += */
    lm_status (*kda_output_backward)(lm_backend *be, void *d_o_lp, float *dgate_logits, void *dgate_logits_lp,
                                     int64_t ld_dgate_lp, float *do_norm, const float *d_gated, const void *o_lp, const float *o_rstd,
                                     const float *gate, const float *o_norm, int64_t N, int H, int K, float eps,
                                     float *tmp);

    /* ---- the MoE layer (moe.h) and its balancing (balance.h) ---- */
    /* the backend's activations for up to m_max tokens (opaque to the model) */
    lm_status (*moe_acts_create)(lm_backend *be, const lm_moe_config *cfg, int64_t m_max, void **acts);
    void (*moe_acts_free)(lm_backend *be, void *acts);
    /* bytes of the backend's memory moe_acts_create takes for m_max tokens
     * (the memory plan, lm_model_plan; no backend needed) */
    size_t (*moe_acts_bytes)(const lm_moe_config *cfg, int64_t m_max);
    /* y[m,d] = MoE(x) (written); bias_host [n] (host, may be NULL) selects, as
     * in moe.h; p (fp32) and p_lp (the same layout in the product format).
     * x_lp (may be NULL): x in the product format, which the products that
     * take x read instead of a copy the backend would make (on the CPU the
     * view is x itself and this is ignored); moe_backward reads it too, so it
     * must keep its values until then */
    lm_status (*moe_forward)(lm_backend *be, float *y, const float *x, const void *x_lp, const float *bias_host,
                             const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                             void *acts, int64_t m);
    /* dx = ... (written), g += ... for the last forward (its x and x_lp); dscores_extra [m,n] may be NULL;
     * dy_lp (may be NULL): dy in the product format (what to_lp gives), read instead of a copy the
     * backend would make (on the CPU ignored). expert_grads_set 1: g's routed expert gradients (gate,
     * up, down) are written, not added to (their old values are not read; the same values as zeroing
     * them first), so the first backward after a zeroing of the gradients need not zero them */
    lm_status (*moe_backward)(lm_backend *be, float *dx, const lm_moe_params *g, const float *dy,
                              const void *dy_lp, const float *x,
                              const float *dscores_extra, const lm_moe_config *cfg, const lm_moe_params *p,
                              const lm_moe_params *p_lp, void *acts, int expert_grads_set);
    /* Expert parallelism (include/longmoe/moe_ep.h, moe_cuda.h): a handle of
     * the layer's exchanges over comm's ranks (the CPU: a host engine; CUDA: a
     * device engine, NCCL or staged), and the layer with the routed experts on
     * their owners: p's and p_lp's (and g's) gate, up, down point at this
     * rank's slice of experts [r n / R, (r+1) n / R); the rest as in
     * moe_forward / moe_backward. Collective over comm's ranks (m may be 0). */
    lm_status (*moe_ep_create)(lm_backend *be, struct lm_comm *comm, const lm_moe_config *cfg, void **ep);
    /* the handle's memory once a forward received `rows` rows, 1/R of them its own (the memory plan; no backend
     * needed): its own part, or (shared_part 1) the part handles may share (moe_ep_share) */
    size_t (*moe_ep_bytes)(const lm_moe_config *cfg, int R, int64_t rows, int shared_part);
    /* optional (NULL: nothing shared): ep uses the call-time buffers of `with`, a handle whose
     * calls never overlap its own (a model's MoE layers) */
    lm_status (*moe_ep_share)(lm_backend *be, void *ep, void *with);
    void (*moe_ep_free)(lm_backend *be, void *ep);
    lm_status (*moe_forward_ep)(lm_backend *be, float *y, const float *x, const void *x_lp, const float *bias_host,
                                const lm_moe_config *cfg, const lm_moe_params *p, const lm_moe_params *p_lp,
                                void *acts, int64_t m, void *ep);
    lm_status (*moe_backward_ep)(lm_backend *be, float *dx, const lm_moe_params *g, const float *dy,
                                 const void *dy_lp, const float *x,
                                 const float *dscores_extra, const lm_moe_config *cfg, const lm_moe_params *p,
                                 const lm_moe_params *p_lp, void *acts, void *ep);
    /* the router scores s [m,n] of the last forward, in the backend's memory */
    float *(*moe_scores)(lm_backend *be, void *acts);
    /* feed the balancer (a host state) with the last forward's scores */
    lm_status (*moe_balance_observe)(lm_backend *be, lm_balance_state *bal, void *acts, int64_t m);
    /* optional (NULL: the model calls moe_balance_observe, which adds into
     * the host state at once; the CPU): a step's observations counted in the
     * backend's memory for the balancers bal[0..count) (a model's MoE layers,
     * in order; the set keeps the pointers, not the states' contents).
     * set_observe is moe_balance_observe of balancer i, without a wait for
     * the device where the backend counts there (the histogram estimators);
     * set_flush adds every balancer's counts of the observations since the
     * last flush into its host state (one wait; nothing to do: none) and
     * reports a score outside [0, 1] or not finite there as LM_ERR_NUMERIC
     * (the other balancers still take theirs). Between the first
     * observation and the flush the states' b and bin geometry must not
     * change (lm_balance_step_end comes after the flush). */
    lm_status (*moe_balance_set_create)(lm_backend *be, lm_balance_state *const *bal, int count, void **set);
    void (*moe_balance_set_free)(lm_backend *be, void *set);
    lm_status (*moe_balance_set_observe)(lm_backend *be, void *set, int i, void *acts, int64_t m);
    lm_status (*moe_balance_set_flush)(lm_backend *be, void *set);
    /* the auxiliary balance loss of the last forward (balance = aux): *loss and
     * dscores [m,n] (backend memory, written) */
    lm_status (*moe_aux_loss)(lm_backend *be, float *loss, float *dscores, void *acts, int64_t m, int n, int k,
                              float alpha);

    /* ---- the residual stream over depth (attnres.h): the same calls, a backend state ---- */
    lm_status (*attnres_create)(lm_backend *be, const lm_attnres_config *cfg, void **state);
    void (*attnres_free)(lm_backend *be, void *state);
    /* the backend's plan of the memory attnres_create takes, by part (no backend needed) */
    lm_status (*attnres_memory)(const lm_attnres_config *cfg, lm_attnres_memory_plan *plan);
    /* h = sublayer l's input again, from the state saved by its forward (valid
     * until its input_backward): the softmax of the saved scores over the
     * sources, not the forward's arithmetic, so equal to float rounding;
     * block and full AttnRes only */
    lm_status (*attnres_recompute_input)(lm_backend *be, void *state, int l, float *h);
    /* with cfg.replay: lm_attnres_replay_block (NULL: the backend keeps every
     * partial sum, and the model plans replay = 0 for it) */
    lm_status (*attnres_replay_block)(lm_backend *be, void *state, int k);
    lm_status (*attnres_begin)(lm_backend *be, void *state, const float *embedding);
    lm_status (*attnres_input)(lm_backend *be, void *state, int l, const lm_attnres_params *p, float *h);
    lm_status (*attnres_add_output)(lm_backend *be, void *state, int l, const float *y);
    /* optional (NULL: the model calls nonfinite_note and attnres_add_output):
     * both in one pass, attnres_add_output(l, y) and nonfinite_note(y, n d, 0,
     * slot), for a backend that has nonfinite_note */
    lm_status (*attnres_add_output_note)(lm_backend *be, void *state, int l, const float *y, int slot);
    lm_status (*attnres_final)(lm_backend *be, void *state, const lm_attnres_params *p, float *h);
    lm_status (*attnres_final_backward)(lm_backend *be, void *state, const lm_attnres_params *p, const float *dh,
                                        lm_attnres_grads *g);
    lm_status (*attnres_output_backward)(lm_backend *be, void *state, int l, float *dy);
    /* optional (NULL: the model zeroes a buffer and calls output_backward):
     * *dy = the state's own accumulator holding dLoss/dy_l, unchanged until
     * the next call on the state; no copy. dy_lp (may be NULL): *dy_lp = the
     * same gradient in the product format (what to_lp would give) where the
     * state wrote one along with it, else NULL */
    lm_status (*attnres_output_grad)(lm_backend *be, void *state, int l, const float **dy, const void **dy_lp);
    lm_status (*attnres_input_backward)(lm_backend *be, void *state, int l, const lm_attnres_params *p,
                                        const float *dh, lm_attnres_grads *g);
    lm_status (*attnres_embedding_backward)(lm_backend *be, void *state, float *dembedding);
    /* optional, all three or none (NULL: the model runs attnres_input or
     * attnres_recompute_input, then rmsnorm_forward; rmsnorm_backward_set,
     * then attnres_input_backward): sublayer l's input and its RMSNorm in
     * one pass each way, h never stored. norm_fusable: whether cfg's
     * sublayers can take them (asked once, for the memory plan). input_norm:
     * xn = h / rms(h) (.) norm_w (xn may be NULL), xn_lp the same in the
     * product format, rstd [n] = 1/rms(h); recompute = 1: h again from the
     * saved scores (attnres_recompute_input's place; p unused).
     * input_norm_backward: from dxn, the norm's output gradient, with the
     * forward's rstd; dnorm_w [d] accumulates; attnres_input_backward's place */
    int (*attnres_norm_fusable)(const lm_attnres_config *cfg);
    lm_status (*attnres_input_norm)(lm_backend *be, void *state, int l, const lm_attnres_params *p,
                                    const float *norm_w, float eps, float *xn, void *xn_lp, float *rstd,
                                    int recompute);
    lm_status (*attnres_input_norm_backward)(lm_backend *be, void *state, int l, const lm_attnres_params *p,
                                             const float *dxn, const float *norm_w, const float *rstd,
                                             float *dnorm_w, lm_attnres_grads *g);

    /* bytes of scratch the backend itself takes for the KDA operator and for
     * attention at these shapes (either may be NULL): 0 where the model passes
     * the workspace (the CPU); on the GPU the arena those ops grow */
    size_t (*op_scratch_bytes)(const lm_kda_config *kda, const lm_attention_config *attn);

    /* acc[i] += x[i] for i < n: x fp32 (lp = 0) or in the product format (lp = 1) */
    lm_status (*accumulate)(lm_backend *be, float *acc, const void *x, size_t n, int lp);

    /* ---- checks ---- */
    /* *first = the index of the first non-finite value of x[n], or -1 */
    lm_status (*find_nonfinite)(lm_backend *be, const float *x, size_t n, int64_t *first);
    /* optional (NULL: the model checks with find_nonfinite at once): checks
     * that do not wait. nonfinite_note records base + the index of x's first
     * non-finite element, if any, in slot `slot` of the backend's list (a slot
     * keeps the smallest noted); nonfinite_take returns slots 0 .. nslots-1
     * (-1: nothing noted) and clears them. At most LM_NONFINITE_SLOTS slots. */
    lm_status (*nonfinite_note)(lm_backend *be, const float *x, size_t n, int64_t base, int slot);
    lm_status (*nonfinite_take)(lm_backend *be, int64_t *first, int nslots);

    /* ---- the optimizer's pieces (optim.h, optim_device.h; docs/optim.md) ---- */
    /* *out (backend memory, one double) = sum of x[i]^2 in double in a fixed
     * order: the same bits on every run; on the CPU exactly lm_sum_squares */
    lm_status (*sum_squares)(lm_backend *be, const float *x, size_t n, double *out);
    /* x[i] *= s (one fp32 product each, as lm_grads_scale) */
    lm_status (*scale)(lm_backend *be, float *x, size_t n, float s);
    /* x[i] = (float)((double)x[i] * f): the exact product rounded once (QK-Clip) */
    lm_status (*scale_exact)(lm_backend *be, float *x, size_t n, double f);
    /* lm_adamw_update on backend memory (t >= 1, the step after increment) */
    lm_status (*adamw_update)(lm_backend *be, float *w, const float *g, float *m, float *v, int64_t n, float lr,
                              float beta1, float beta2, float eps, float wd, int64_t t);
    /* bytes of backend scratch muon_update needs for [rows, cols] in n_blocks row blocks */
    size_t (*muon_scratch_bytes)(lm_backend *be, int64_t rows, int64_t cols, int n_blocks);
    /* lm_muon_update on backend memory: momentum buffer, Nesterov, Newton–Schulz
     * per block, scaled update and decoupled decay; scratch (backend memory, at
     * least muon_scratch_bytes) is overwritten */
    lm_status (*muon_update)(lm_backend *be, float *w, const float *g, float *momentum, int64_t rows, int64_t cols,
                             int n_blocks, float lr, float wd, const lm_optim_config *cfg, void *scratch,
                             size_t scratch_bytes);
} lm_ops;

struct lm_backend {
    lm_device device;
    size_t lp_bytes;     /* bytes of one product-format element: 4 (CPU) or 2 (bf16, GPU) */
    const lm_ops *ops;
    void *ctx;           /* the backend's own state (the CUDA context) */
    /* memory: alloc returns zeroed memory aligned to 64 bytes */
    lm_status (*alloc)(lm_backend *be, size_t bytes, void **out);
    void (*release)(lm_backend *be, void *ptr);
    lm_status (*zero)(lm_backend *be, void *ptr, size_t bytes);
    lm_status (*copy)(lm_backend *be, void *dst, const void *src, size_t bytes);         /* within the backend */
    lm_status (*upload)(lm_backend *be, void *dst, const void *host_src, size_t bytes);  /* host -> backend */
    lm_status (*download)(lm_backend *be, void *host_dst, const void *src, size_t bytes);/* backend -> host */
    lm_status (*sync)(lm_backend *be);
    void (*destroy)(lm_backend *be); /* NULL for the CPU backend */
    /* optional (NULL: a model times its parts on the host, waiting for the device
     * at each part's end): a part timer that does not wait. timer_mark ends an
     * interval of the work enqueued so far and charges it to `part` (-1: to none,
     * only starting the next interval); timer_take waits for the marks so far and
     * adds each interval's device time to seconds[part] (nparts entries). A model
     * creates one at its creation and frees it with itself. */
    lm_status (*timer_create)(lm_backend *be, void **timer);
    lm_status (*timer_mark)(lm_backend *be, void *timer, int part);
    lm_status (*timer_take)(lm_backend *be, void *timer, double *seconds, int nparts);
    void (*timer_free)(lm_backend *be, void *timer);
    /* optional (NULL: none to tell): the device's memory in use (by every
     * process on it) and its size, in bytes, as the driver counts them */
    lm_status (*memory)(lm_backend *be, size_t *used, size_t *total);
};

/* The CPU backend (a process-wide constant: stateless, thread-safe). */
lm_backend *lm_backend_cpu(void);

/* The CUDA backend on the current device (src/cuda/backend): its own stream,
 * cuBLASLt handle and scratch arena. LM_ERR_ARG in a build without
 * CUDA, LM_ERR_IO when no GPU can be used. Free with lm_backend_free. */
lm_status lm_backend_cuda_create(lm_backend **out);
/* The same on GPU number `local` modulo the visible devices (made the
 * process's current device first): the GPU of a process that is the
 * local-th on its machine (lm_comm_local_rank); processes share a GPU when
 * there are more of them than GPUs. */
lm_status lm_backend_cuda_create_local(int local, lm_backend **out);
/* The CUDA backend's op table without a GPU (for planning: the *_bytes ops
 * only); NULL in a build without CUDA. */
const lm_ops *lm_backend_cuda_ops(void);
/* Free a backend made by a *_create call (the CPU backend is left alone). */
void lm_backend_free(lm_backend *be);

#ifdef __cplusplus
}
#endif
#endif
