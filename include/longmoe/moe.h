/* Ultra-sparse Mixture-of-Experts layer on the CPU (docs/moe.md; SPEC §4).
 *
 * Shapes (row-major, fp32): m tokens, model width d, n routed experts, top-k
 * experts per token, expert hidden width f, routed-expert width d_e (= d_lat
 * with LatentMoE, else d), n_shared shared experts of hidden width f_s.
 *
 * Router (fp32):  r = W_r x,  s = sigmoid(r) in (0,1)^n
 *                 T_i = argtop_k(s_i + b)          (b: the balancing bias)
 *                 p_it = route_scale * s_{i,T_it} / sum_{j in T_i} s_ij
 * b only selects; it never enters p, so the router gradient reaches W_r
 * through p only. Every token gets exactly k distinct experts (dropless).
 * Ties in s + b go to the lower expert index; each token's k experts are
 * listed by decreasing s + b.
 *
 * Experts (GLU), a = W_gate x, u = W_up x:
 *   SwiGLU:   h = silu(a) * u
 *   SiTU-GLU: h = 4 tanh(a/4) sigmoid(a) * 25 tanh(u/25)      (|h| < 100)
 *   E(x) = W_down h
 * Layer:
 *   y = sum_shared S_e(x) + W_up_lat RMSNorm( sum_t p_it E_{T_it}(W_down_lat x) )
 * and without LatentMoE (d_lat = 0) the routed sum is added directly:
 *   y = sum_shared S_e(x) + sum_t p_it E_{T_it}(x).
 *
 * Tokens are grouped by expert (a stable counting sort of the m*k
 * (token, slot) pairs with per-expert offsets), so each expert runs as one
 * dense product over its contiguous rows: the layout of a grouped GEMM and of
 * expert parallelism. */
#ifndef LONGMOE_MOE_H
#define LONGMOE_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LM_MOE_MIN_EXPERTS 4
#define LM_MOE_MAX_EXPERTS 1024
#define LM_MOE_MAX_TOPK 16

typedef enum { LM_EXPERT_SWIGLU = 0, LM_EXPERT_SITU_GLU = 1 } lm_expert_act;

typedef struct {
    int d;             /* model width */
    int n_experts;     /* routed experts n, 4..1024 */
    int top_k;         /* experts per token k, 1..16, k <= n */
    int d_ff;          /* routed expert hidden width f */
    int d_latent;      /* LatentMoE width d_lat; 0 = no latent projection */
    int n_shared;      /* shared experts (full width d), 0.. */
    int d_ff_shared;   /* shared expert hidden width f_s */
    lm_expert_act act; /* SwiGLU or SiTU-GLU, for routed and shared experts */
    float route_scale; /* multiplies the renormalised weights p */
    float norm_eps;    /* RMSNorm epsilon of the latent norm */
} lm_moe_config;

/* Parameters (and, with the same layout, their gradients). Pointers of parts
 * the config does not use are NULL.
 *   router       [n, d]
 *   gate, up     [n, f, d_e]       down [n, d_e, f]
 *   lat_down     [d_lat, d]        lat_norm [d_lat]     lat_up [d, d_lat]
 *   shared_gate, shared_up [n_shared, f_s, d]   shared_down [n_shared, d, f_s] */
typedef struct {
    float *router;
    float *gate, *up, *down;
    float *lat_down, *lat_norm, *lat_up;
    float *shared_gate, *shared_up, *shared_down;
} lm_moe_params;

/* Activations saved by the forward for the backward, plus the backward's
 * scratch: one allocation carved into named buffers (lm_moe_acts_alloc). */
typedef struct {
    int64_t m_max, m;   /* capacity in tokens; tokens of the last forward */
    float *s;           /* [m, n] router scores sigmoid(W_r x) */
    int32_t *topk;      /* [m, k] chosen experts, by decreasing s + b */
    float *weights;     /* [m, k] p (route scale included) */
    int64_t *offsets;   /* [n + 1] expert j owns grouped rows offsets[j]..offsets[j+1]-1 */
    int32_t *order;     /* [m k] grouped row g holds slot order[g] = i*k + t */
    int32_t *slot_row;  /* [m k] inverse: slot i*k + t sits at grouped row slot_row[.] */
    float *x_lat;       /* [m, d_lat] W_down_lat x (LatentMoE only) */
    float *xg;          /* [m k, d_e] expert inputs, grouped */
    float *ga, *gu, *gh;/* [m k, f] gate / up pre-activations and hidden, grouped */
    float *gout;        /* [m k, d_e] expert outputs E_j(x), grouped */
    float *z;           /* [m, d_e] sum_t p_it E(x) */
    float *rstd;        /* [m] 1/rms(z) (LatentMoE only) */
    float *zn;          /* [m, d_lat] RMSNorm(z) (LatentMoE only) */
    float *sa, *su, *sh;/* [n_shared, m, f_s] shared experts' a, u, h */
    float *ytmp;        /* [m, d] one shared expert's output before it is added */
    /* backward scratch */
    float *dz, *dzn, *dgout, *dh, *da, *du, *dxg, *dx_lat, *dp, *dr;
    float *dsh, *dsa, *dsu;
    void *block;        /* the one allocation */
} lm_moe_acts;

/* Defaults: SwiGLU, route scale 1, eps 1e-6, no latent, no shared experts. */
lm_moe_config lm_moe_config_default(int d, int n_experts, int top_k, int d_ff);
/* Validate every size: n in [4, 1024], k in [1, min(16, n)], widths > 0. */
lm_status lm_moe_check(const lm_moe_config *cfg);

/* Number of floats of all parameters, and carving them out of one buffer of
 * that many floats (llm.c style). Unused parts get NULL. */
size_t lm_moe_param_count(const lm_moe_config *cfg);
/* Floats of each routed-expert tensor (gate, up, down): n f d_e, d_e = d_lat or d. */
static inline size_t lm_moe_expert_tensor_floats(const lm_moe_config *c) {
    return (size_t)c->n_experts * (size_t)c->d_ff * (size_t)(c->d_latent > 0 ? c->d_latent : c->d);
}
void lm_moe_params_carve(const lm_moe_config *cfg, float *memory, lm_moe_params *out);

lm_status lm_moe_acts_alloc(lm_moe_acts *acts, const lm_moe_config *cfg, int64_t m_max);
/* Bytes lm_moe_acts_alloc takes for m_max tokens (0 for a bad config). */
size_t lm_moe_acts_bytes(const lm_moe_config *cfg, int64_t m_max);
void lm_moe_acts_free(lm_moe_acts *acts);

/* Top-k selection: topk[m,k] = argtop_k(s + b) per token (b may be NULL:
 * zero), by decreasing s + b, ties to the lower index; weights[m,k] =
 * route_scale * s / (sum of s over the chosen set); weights may be NULL. */
lm_status lm_router_select(int32_t *topk, float *weights, const float *s, const float *b,
                           int64_t m, int n, int k, float route_scale);

/* One row: idx[k], val[k] = the k largest s[j] + b[j] (b may be NULL), by
 * decreasing value, ties to the lower index. k <= LM_MOE_MAX_TOPK + 1 (the
 * balancer asks for k + 1 to find the threshold). */
void lm_topk_row(int32_t *idx, float *val, const float *s, const float *b, int n, int k);

/* Group the m*k (token, slot) pairs by expert: offsets[n+1], order[m k]
 * (stable: token order within an expert) and its inverse slot_row[m k]. */
void lm_moe_group_by_expert(int64_t *offsets, int32_t *order, int32_t *slot_row,
                            const int32_t *topk, int64_t m, int n, int k);

/* Expert activations: h = act(a, u) and its partial derivatives. */
float lm_expert_act_forward(lm_expert_act act, float a, float u);
void lm_expert_act_backward(lm_expert_act act, float a, float u, float *dh_da, float *dh_du);

/* Forward: y[m,d] from x[m,d] with bias b[n] (NULL: zero). Routing, grouping
 * and everything the backward needs are saved in acts (m <= acts->m_max). */
lm_status lm_moe_forward(float *y, const float *x, const float *b, const lm_moe_config *cfg,
                         const lm_moe_params *params, lm_moe_acts *acts, int64_t m);

/* Backward of the last forward (same x, params, acts). WRITES dx[m,d] (may be
 * NULL; its old values are not read) and ACCUMULATES (+=) into every non-NULL
 * pointer of grads. The routing is
 * held fixed (top-k is piecewise constant). dscores_extra (may be NULL) is an
 * additional gradient [m,n] with respect to the scores s, e.g. of an
 * auxiliary balance loss (lm_balance_aux_loss); without it the router
 * gradient flows only through the k weights of each token. */
lm_status lm_moe_backward(float *dx, lm_moe_params *grads, const float *dy, const float *x,
                          const float *dscores_extra, const lm_moe_config *cfg,
                          const lm_moe_params *params, lm_moe_acts *acts);

#ifdef __cplusplus
}
#endif
#endif
