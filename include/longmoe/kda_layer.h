/* The KDA token mixer (SPEC §2, layer):
 *   q = L2Norm(SiLU(ShortConv(W_q x))),  k = L2Norm(SiLU(ShortConv(W_k x))),
 *   v = SiLU(ShortConv(W_v x)),  beta = sigmoid(W_beta x),  z = W_z x (full rank),
 *   o = KDA(q, k, v, z, beta; A_log, dt_bias)            (include/longmoe/kda.h)
 *   y = W_o( sigmoid(W_g x) ⊙ RMSNorm_head(o) )
 * ShortConv is a causal depthwise convolution of width conv_width per channel
 * (zero history at each sequence start). Heads H, K = V = head_dim. */
#ifndef LONGMOE_KDA_LAYER_H
#define LONGMOE_KDA_LAYER_H

#include <stddef.h>

#include "longmoe/core.h"
#include "longmoe/kda.h"
#include "longmoe/tensor_spec.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int d_model, heads, head_dim, conv_width, chunk;
    lm_kda_gate gate;
    float g_min, eps;
    void *workspace;        /* the operator's scratch, planned by the caller (NULL: per call) */
    size_t workspace_bytes;
    struct lm_backend *backend; /* whose ops compute the layer (NULL: the CPU's; backend.h) */
} lm_kda_layer_config;

/* Parameters, in this order (lm_kda_layer_specs):
 * W_q, W_k, W_v [HK,d]; conv_q, conv_k, conv_v [HK,W]; W_z [HK,d]; W_beta [H,d];
 * A_log [H]; dt_bias [HK]; W_g [HK,d]; o_norm [K]; W_o [d,HK]. */
typedef struct {
    float *W_q, *W_k, *W_v, *conv_q, *conv_k, *conv_v, *W_z, *W_beta, *A_log, *dt_bias, *W_g,
        *o_norm, *W_o;
} lm_kda_layer_params;

#define LM_KDA_LAYER_NPARAMS 13
/* Fill `specs` (LM_KDA_LAYER_NPARAMS entries); returns the total float count. */
size_t lm_kda_layer_specs(const lm_kda_layer_config *c, lm_tensor_spec *specs);
/* Point `p` into `base`, which holds the tensors contiguously in spec order. */
void lm_kda_layer_params_map(const lm_kda_layer_config *c, float *base, lm_kda_layer_params *p);

/* Activations the backward needs, for N = B*T tokens. */
typedef struct {
    float *qp, *kp, *vp;   /* projections before the conv [N,HK]; the conv's output is not kept (the
                            * backward recomputes it from these) */
    void *q, *k, *v;       /* operator inputs [N,HK], in the backend's product format */
    void *z_lp;            /* W_z x [N,HK], in the product format (the operator's gate input) */
    float *beta;           /* sigmoid(W_beta x) [N,H] */
    void *o;               /* operator output [N,HK], product format */
    float *o_rstd;         /* head RMSNorm 1/rms [N*H] */
    float *gate;           /* sigmoid(W_g x) [N,HK] */
    void *gated;           /* gate ⊙ RMSNorm(o) [N,HK], product format (the input of W_o) */
    float *qk_rnorm;       /* 1/||SiLU(conv)|| for q then k [2*N*H] */
    void *q_op, *k_op, *v_op; /* the operator's q, k, v: q, k, v themselves, except on a segment (below) */
    /* the operator's forward intermediates kept for its backward (lm_kda_config
     * kept; NULL, as the maps leave it: the backward recomputes them). A model
     * that keeps the activations points it at lm_kda_layer_kept_bytes of its own. */
    void *kept;
    size_t kept_bytes;
} lm_kda_layer_acts;

/* Bytes of the operator's intermediates the backend can keep between the
 * layer's forward and backward on B x T tokens (0: none; the CPU's). */
size_t lm_kda_layer_kept_bytes(const lm_kda_layer_config *c, int B, int T);

size_t lm_kda_layer_act_floats(const lm_kda_layer_config *c, int B, int T);
void lm_kda_layer_acts_map(const lm_kda_layer_config *c, int B, int T, float *base,
                           lm_kda_layer_acts *a);
/* Scratch the backward needs (floats), shared between layers by the caller. */
size_t lm_kda_layer_scratch_floats(const lm_kda_layer_config *c, int B, int T);

/* x [B,T,d] -> y [B,T,d]; fills `a`. The CPU's form (fp32 operands); a
 * backend with a separate product format (config.backend) needs the _lp forms. */
lm_status lm_kda_layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               lm_kda_layer_acts *a, const float *x, int B, int T, float *y);
/* Given dy [B,T,d], ACCUMULATES into the gradients `g` (same layout as the
 * params) and WRITES dx [B,T,d] (its first product sets it: no zeroing pass).
 * `scratch` holds lm_kda_layer_scratch_floats floats. */
lm_status lm_kda_layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                const lm_kda_layer_params *g, const lm_kda_layer_acts *a,
                                const float *x, const float *dy, int B, int T, float *dx,
                                float *scratch);

/* The same on any backend: p_lp holds the parameters in the backend's product
 * format (on the CPU: p), x_lp the input (on the CPU: x). The backward reads
 * only x_lp of the input; dy_lp (may be NULL) is dy in the product format
 * where the caller has it (the bits the backend's to_lp gives), which it
 * then reads instead of converting dy (ignored where the format is fp32). */
lm_status lm_kda_layer_forward_lp(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                  const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp, int B,
                                  int T, float *y);
lm_status lm_kda_layer_backward_lp(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                   const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                   const lm_kda_layer_acts *a, const void *x_lp, const float *dy, const void *dy_lp,
                                   int B, int T, float *dx, float *scratch);

/* ---- sequence segments (docs/model.md, "Sequence segments") ----
 * The layer on tokens [t0, t0 + n) of every sequence, x [B,n,d], given what
 * the earlier tokens left: the operator's state and the short convolution's
 * history (the q, k, v projections of the W-1 tokens before the segment; zero
 * before the sequence start). A sequence run segment after segment, each
 * handing its carry to the next, computes what the whole-sequence layer
 * computes (to float rounding); the backward runs the segments in reverse,
 * each handing the gradients of its incoming carry to the one before.
 * The projections, conv outputs and their norms are kept for W-1+n rows per
 * sequence (the history first), the operator's q, k, v (q_op, k_op, v_op)
 * for the n rows. */
typedef struct {
    const float *h0;      /* [B,H,K,K] the state before the segment (NULL: zero) */
    float *ht;            /* [B,H,K,K] the state after it (written; NULL: not kept) */
    const float *halo;    /* [3,B,W-1,HK] q, k, v projections of the W-1 tokens before it (NULL: zero) */
    float *halo_out;      /* [3,B,W-1,HK] those of its last W-1 positions (written; may be NULL) */
} lm_kda_layer_carry;

typedef struct {
    const float *dht;       /* the gradient of ht (NULL: zero) */
    float *dh0;             /* the gradient of h0 (written; may be NULL) */
    const float *dhalo_out; /* the gradient of halo_out (NULL: zero) */
    float *dhalo;           /* the gradient of halo (written; may be NULL) */
} lm_kda_layer_carry_grad;

size_t lm_kda_layer_seg_act_floats(const lm_kda_layer_config *c, int B, int n);
void lm_kda_layer_seg_acts_map(const lm_kda_layer_config *c, int B, int n, float *base, lm_kda_layer_acts *a);
size_t lm_kda_layer_seg_scratch_floats(const lm_kda_layer_config *c, int B, int n);
/* x_lp [B,n,d] -> y [B,n,d]; fills `a` (lm_kda_layer_seg_acts_map for at least n). */
lm_status lm_kda_layer_forward_seg(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                   const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp, int B,
                                   int n, const lm_kda_layer_carry *carry, float *y);
/* The forward in two calls, for a segment run twice from different incoming
 * states (context parallelism's middle ranks): lm_kda_layer_seg_final_state
 * computes the operator's inputs (projections, convolution, norms, gates,
 * betas, kept in `a`; carry->halo read, halo_out written) and runs the
 * operator from carry->h0 to carry->ht (required) without the output path (y
 * is not computed); lm_kda_layer_forward_seg_prepared then runs the operator
 * from its own carry's h0 over the inputs kept in `a` (x and the halo as
 * before; they are not recomputed) and the output path to y. The pair leaves
 * `a` and y as lm_kda_layer_forward_seg with the second carry would, bit for
 * bit. */
lm_status lm_kda_layer_seg_final_state(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                       const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp,
                                       int B, int n, const lm_kda_layer_carry *carry);
lm_status lm_kda_layer_forward_seg_prepared(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                            const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp,
                                            int B, int n, const lm_kda_layer_carry *carry, float *y);
/* After lm_kda_layer_forward_seg of the same segment (carry's h0 and halo
 * read): dx and g ACCUMULATE; cg's dh0 and dhalo are written. */
lm_status lm_kda_layer_backward_seg(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                    const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                    const lm_kda_layer_acts *a, const void *x_lp, const float *dy, int B, int n,
                                    const lm_kda_layer_carry *carry, const lm_kda_layer_carry_grad *cg, float *dx,
                                    float *scratch);

/* lm_kda_layer_backward_seg in two calls, for a segment whose outgoing
 * state's gradient is known only after the gradient of its incoming state
 * from its own outputs (context parallelism's ranks after the first).
 * lm_kda_layer_seg_state_grad, after lm_kda_layer_forward_seg of the same
 * segment and carry, runs the output path's backward (W_o, o_norm and W_g's
 * gradients into g, W_g's part of dx into dx: both accumulate) and the
 * operator's from it alone (the outgoing state's gradient zero): dh0
 * [B,H,K,K] is written; what that operator backward adds to A_log and dt_bias
 * goes to `junk` (lm_kda_layer_seg_state_grad_junk_floats floats of the
 * backend's memory). lm_kda_layer_backward_seg_after_state then finishes with
 * cg (the scratch as the first call left it; dy is not read again): the
 * operator's backward with cg->dht and the rest. The pair adds to g and dx
 * what lm_kda_layer_backward_seg adds, bit for bit. */
size_t lm_kda_layer_seg_state_grad_junk_floats(const lm_kda_layer_config *c);
lm_status lm_kda_layer_seg_state_grad(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                      const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                      const lm_kda_layer_acts *a, const void *x_lp, const float *dy, int B, int n,
                                      const lm_kda_layer_carry *carry, float *dx, float *dh0, float *junk,
                                      float *scratch);
lm_status lm_kda_layer_backward_seg_after_state(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                                const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                                const lm_kda_layer_acts *a, const void *x_lp, int B, int n,
                                                const lm_kda_layer_carry *carry, const lm_kda_layer_carry_grad *cg,
                                                float *dx, float *scratch);

/* The operator's state map over the segment after lm_kda_layer_forward_seg
 * or lm_kda_layer_seg_final_state (its q, k, gates and betas in `a`): P [B,H,K,K] such that the segment maps
 * an incoming state S to P S + Q (Q: the outgoing state from a zero state,
 * the forward's ht with h0 NULL). Runs the operator once with zero values
 * (v_zero_lp [B,n,H*K] in the product format, zero) from the identity
 * (ident [B,H,K,K] fp32) and writes its final state to P; its outputs go to
 * o_lp [B,n,H*K] (the product format; scratch). `a` is not changed. */
lm_status lm_kda_layer_seg_state_map(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                     const lm_kda_layer_acts *a, int B, int n, const void *v_zero_lp,
                                     const float *ident, void *o_lp, float *P);

/* ---- decode (docs/sampling.md) ----
 * The layer's whole memory of the past is a fixed-size state per sequence:
 * the last W-1 projections of q, k, v before the short convolution (its
 * causal history) and the operator's recurrent state S [H,K,V] (fp32).
 * Prefill runs the chunked forward on a prompt and captures both; each step
 * then takes one token per sequence through the recurrent form (T = 1). */
typedef struct {
    int B, len;                     /* sequences; tokens seen per sequence */
    float *tail_q, *tail_k, *tail_v; /* [B,W-1,HK]: projections of the last W-1 tokens, oldest first */
    float *S;                       /* [B,H,K,K] recurrent state */
} lm_kda_layer_cache;

/* Floats of the cache for B sequences (independent of the length). */
size_t lm_kda_layer_cache_floats(const lm_kda_layer_config *c, int B);
/* Carve the cache out of `mem` (lm_kda_layer_cache_floats floats) and zero it:
 * an empty history (what the forward assumes at each sequence start). */
lm_status lm_kda_layer_cache_init(const lm_kda_layer_config *c, lm_kda_layer_cache *cache, int B,
                                  float *mem);
/* Scratch floats of one step for B sequences. */
size_t lm_kda_layer_step_scratch_floats(const lm_kda_layer_config *c, int B);

/* The forward on a prompt x [B,T,d] -> y [B,T,d] (acts as for the forward, for
 * B and T) into an empty cache, which then holds the state after T tokens. */
lm_status lm_kda_layer_prefill(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               lm_kda_layer_acts *a, lm_kda_layer_cache *cache, const float *x,
                               int T, float *y);
/* One token per sequence: x [B,d] -> y [B,d]; advances the cache. */
lm_status lm_kda_layer_step(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                            lm_kda_layer_cache *cache, const float *x, float *y, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
