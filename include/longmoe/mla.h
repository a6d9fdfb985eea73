/* The gated full-attention layer: MLA (multi-head latent attention) or GQA,
 * NoPE by default (docs/attention.md; SPEC §3).
 *
 * x, y [B,T,d] (d = d_model); H heads of key dim Dk and value dim Dv; N = B*T.
 *
 * MLA (kind LM_ATTN_MLA), with r = rope_dims and Dn = Dk - r:
 *   q   = W_uq RMSNorm(W_dq x; q_norm)          W_dq [q_lora,d], W_uq [H*Dk,q_lora]
 *   c   = RMSNorm(W_dkv x; kv_norm)             W_dkv [kv_lora,d]   (the latent: cached)
 *   k_h = [W_uk,h c ; kr]                       W_uk [H*Dn,kv_lora]
 *   v_h = W_uv,h c                              W_uv [H*Dv,kv_lora]
 *   kr  = RoPE(W_kr x), one r-dim key shared by all heads (only when r > 0), W_kr [r,d]
 * GQA (kind LM_ATTN_GQA), n_kv_heads = Hkv:
 *   q = W_q x [H*Dk,d];  k = W_k x [Hkv*Dk,d];  v = W_v x [Hkv*Dv,d]
 * Both: RoPE on the last r dims of every q and k head (r = 0: NoPE, the
 * default), o = causal softmax attention (scale Dk^-1/2 unless set), and
 *   y = W_o (sigmoid(W_g x) * o)                W_g [H*Dv,d], W_o [d,H*Dv]
 *
 * Memory is planned by the caller (llm.c style): parameters and gradients are
 * lm_mla_params structs of pointers into caller memory (lm_mla_params_map);
 * the forward saves its activations in a caller buffer of
 * lm_mla_acts_floats() floats; the backward needs lm_mla_scratch_floats()
 * floats of scratch; decode needs a cache of lm_mla_cache_floats() and a step
 * scratch of lm_mla_decode_scratch_floats(). The only allocation inside is the
 * attention core's small per-thread workspace (include/longmoe/attention.h).
 *
 * Decode caches the latent [c ; kr] per token (MLA: kv_lora + r floats per
 * token for all heads) or k and v (GQA: Hkv*(Dk+Dv) floats per token). The MLA
 * step attends in the latent space ("absorbed" form): per head the query
 * becomes [W_uk,h^T q_h,nope ; q_h,rope] and the value W_uv,h (sum_s p_s c_s),
 * equal to the forward up to fp32 rounding. */
#ifndef LONGMOE_MLA_H
#define LONGMOE_MLA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_ATTN_MLA = 0, LM_ATTN_GQA = 1 } lm_attn_kind;

typedef struct {
    lm_attn_kind kind;
    int d_model;
    int n_heads;    /* H */
    int n_kv_heads; /* Hkv (GQA only; H a multiple of it) */
    int head_dim_qk; /* Dk, including the rope_dims */
    int head_dim_v;  /* Dv */
    int q_lora;      /* MLA query latent rank */
    int kv_lora;     /* MLA key/value latent rank */
    int rope_dims;   /* r: rotary dims at the end of each q/k head; 0 = NoPE (default) */
    float rope_base; /* RoPE base (default 10000) */
    float norm_eps;  /* RMSNorm epsilon (default 1e-6) */
    float scale;     /* attention scale; 0 = Dk^-1/2 */
    void *workspace; /* the attention core's scratch, planned by the caller (NULL: per call) */
    size_t workspace_bytes;
    struct lm_backend *backend; /* whose ops compute the layer (NULL: the CPU's; backend.h) */
} lm_mla_config;

/* Parameter tensors (also used for their gradients). Unused ones are NULL:
 * MLA uses W_dq q_norm W_uq W_dkv kv_norm W_uk W_uv (W_kr when rope_dims > 0),
 * GQA uses W_q W_k W_v; both use W_g W_o. */
typedef struct {
    float *W_dq, *q_norm, *W_uq;
    float *W_dkv, *kv_norm, *W_uk, *W_uv, *W_kr;
    float *W_q, *W_k, *W_v;
    float *W_g, *W_o;
} lm_mla_params;

/* MLA config with the defaults (NoPE, eps 1e-6, base 10000, default scale). */
lm_mla_config lm_mla_config_mla(int d_model, int n_heads, int head_dim_qk, int head_dim_v,
                                int q_lora, int kv_lora);
/* GQA config with the same defaults. */
lm_mla_config lm_mla_config_gqa(int d_model, int n_heads, int n_kv_heads, int head_dim_qk,
                                int head_dim_v);

lm_status lm_mla_check(const lm_mla_config *cfg);

/* Number of parameters (floats), and the carving of `mem` (that many floats)
 * into the tensors in the order listed above. */
size_t lm_mla_param_count(const lm_mla_config *cfg);
lm_status lm_mla_params_map(const lm_mla_config *cfg, float *mem, lm_mla_params *p);
/* Fill a parameter block: matrices N(0, 1/fan_in), norm weights 1. */
void lm_mla_params_init(const lm_mla_config *cfg, const lm_mla_params *p, lm_rng *rng);

/* Floats of saved activations for B sequences of T tokens, and of backward scratch. */
size_t lm_mla_acts_floats(const lm_mla_config *cfg, int B, int T);
size_t lm_mla_scratch_floats(const lm_mla_config *cfg, int B, int T);

/* y [B,T,d] from x [B,T,d]; acts receives what the backward needs. */
lm_status lm_mla_forward(const lm_mla_config *cfg, const lm_mla_params *p, const float *x, int B,
                         int T, float *y, float *acts);

/* Given dy [B,T,d], WRITE dx [B,T,d] (may be NULL; its first product sets
 * it: no zeroing pass) and ACCUMULATE (+=) into every gradient in g (pointers
 * from lm_mla_params_map over a gradient block).
 * x and acts must be those of the forward; scratch is overwritten. */
lm_status lm_mla_backward(const lm_mla_config *cfg, const lm_mla_params *p, const float *x,
                          const float *acts, const float *dy, int B, int T, float *dx,
                          const lm_mla_params *g, float *scratch);

/* The forward and backward on any backend (config.backend): p_lp holds the
 * parameters in the backend's product format (on the CPU: p), x_lp the input
 * (on the CPU: x); the backward reads only x_lp of the input. */
lm_status lm_mla_forward_lp(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                            const void *x_lp, int B, int T, float *y, float *acts);
/* dy_lp (may be NULL): dy in the product format where the caller has it (the
 * bits the backend's to_lp gives), read instead of converting dy. */
lm_status lm_mla_backward_lp(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                             const void *x_lp, const float *acts, const float *dy, const void *dy_lp, int B, int T,
                             float *dx, const lm_mla_params *g, float *scratch);

/* The attention's output and log-sum-exp kept outside the layer's activations,
 * so that a second forward of the same input and weights (the backward's
 * recomputation) takes them from there instead of running the attention
 * again. The attention forward is deterministic: where the second forward's
 * input has the first one's bits, the backward reads the same bits either
 * way. Rows are those of the whole sequences (T_all a sequence: lm_mla_seg's
 * T_all in a segment, else T). */
typedef struct {
    void *o;    /* [B,T_all,H,Dv] product format: the attention output before its gate */
    float *lse; /* [B,T_all,H] fp32: each sequence's [H,n] block of the rows t0 .. t0+n-1 at (b*T_all + t0)*H */
    int reuse;  /* 0: the forward runs the attention and writes o, lse here; 1: it reads them from here */
} lm_mla_keep;
/* Floats (rounded up to whole floats) of keep.o and keep.lse for B sequences of T_all tokens. */
size_t lm_mla_keep_o_floats(const lm_mla_config *c, size_t lp_bytes, int B, int T_all);
size_t lm_mla_keep_lse_floats(const lm_mla_config *c, int B, int T_all);
/* lm_mla_forward_lp with the attention's output kept (keep != NULL) or reused (keep->reuse). */
lm_status lm_mla_forward_lp_keep(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                                 const void *x_lp, int B, int T, float *y, float *acts, const lm_mla_keep *keep);

/* smax [H] = each head's largest scaled pre-softmax logit in the forward that
 * filled `acts` (for QK-Clip, include/longmoe/optim.h); CPU layers only (any
 * backend: the backend's attention_head_max). */
lm_status lm_mla_max_logits(const lm_mla_config *cfg, const float *acts, int B, int T, float *smax);
/* The attention's row-maximum buffer inside `acts` ([B,H,T] floats; what a
 * backend's attention_forward leaves there is read by its attention_head_max). */
float *lm_mla_acts_rowmax(const lm_mla_config *cfg, float *acts, int B, int T);

/* ---- sequence segments (docs/model.md, "Sequence segments") ----
 * The layer on tokens [t0, t0 + n) of every sequence, x [B,n,d], over the
 * keys and values of all earlier tokens: the forward writes the segment's
 * keys and values into stores of the whole sequence (rows t0 .. t0+n-1 of
 * each) and its queries attend rows 0 .. t0+n-1 there (RoPE at the global
 * positions). The backward adds the attention's gradient of every key and
 * value it read into fp32 accumulators of the whole sequence and takes the
 * segment's own rows from them: run the segments in reverse order (the later
 * ones' contributions are in the accumulators by then); zero them first. */
typedef struct {
    int t0, T_all;          /* the segment's start; the stores' rows per sequence */
    void *k_store, *v_store; /* [B,T_all,Hk,Dk], [B,T_all,Hk,Dv], product format (Hk: the core's key heads) */
    float *dk_acc, *dv_acc;  /* the same shapes, fp32: the gradients of every key and value, accumulated */
    void *dk_tmp, *dv_tmp;   /* [T_all,Hk,Dk], [T_all,Hk,Dv], product format: one sequence's attention gradient */
    /* MLA may keep its latent instead (c_store != NULL; k_store, v_store, dk_acc, dv_acc unused): each
     * sequence's keys and values up-projected from the stored latents into k_work, v_work per segment,
     * their gradients taken back to the latents' (and the rotary keys') accumulators */
    void *c_store;           /* [B,T_all,kv_lora], product format: c = RMSNorm(W_dkv x) */
    float *kr_store;         /* [B,T_all,r] fp32: the rotary key after RoPE (rope_dims > 0) */
    float *dc_acc, *dkr_acc; /* the same shapes, fp32 */
    void *k_work, *v_work;   /* [T_all,H,Dk], [T_all,H,Dv], product format: one sequence's keys, values */
    /* the attention's output of the whole rows, kept or reused (NULL: neither; lm_mla_keep). With
     * keep->reuse the forward writes the segment's rows of the stores as always but builds no keys and
     * values and runs no attention */
    const lm_mla_keep *keep;
} lm_mla_seg;

/* Bytes a token of the whole rows takes in each form: the keys and values
 * (stores and accumulators) or, MLA only, the latent and rotary key (0 for GQA). */
void lm_mla_seg_token_bytes(const lm_mla_config *c, size_t lp_bytes, size_t *kv, size_t *latent);
/* Elements of one row (token) of the key and value stores: Hk*Dk and Hk*Dv. */
void lm_mla_seg_row_elems(const lm_mla_config *c, size_t *k_elems, size_t *v_elems);
lm_status lm_mla_forward_seg(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                             const void *x_lp, int B, int n, const lm_mla_seg *seg, float *y, float *acts);
/* The segment's backward ACCUMULATES into dx (unlike the whole rows' backward) and g. */
lm_status lm_mla_backward_seg(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                              const void *x_lp, const float *acts, const float *dy, int B, int n,
                              const lm_mla_seg *seg, float *dx, const lm_mla_params *g, float *scratch);
/* Only the segment's rows of the stores (the forward's first part: its
 * latents and rotary keys, or keys and values, into the stores at seg->t0),
 * no attention and no output; acts serve as the forward's temporaries.
 * lm_mla_forward_seg then computes the same rows again (the same bits). */
lm_status lm_mla_seg_store_rows(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                                const void *x_lp, int B, int n, const lm_mla_seg *seg, float *acts);
/* Only the key/value side of the backward: the segment's own rows of the
 * accumulators (dc_acc and dkr_acc, or dk_acc and dv_acc) taken through the
 * token-local maps that made the stored rows, into dx and g (ACCUMULATE);
 * no attention, no query side, no output. The backward is linear in these
 * rows, so a gradient that reaches them after lm_mla_backward_seg (another
 * rank's part, under context parallelism) is added this way. */
lm_status lm_mla_seg_stores_backward(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *p_lp,
                                     const void *x_lp, const float *acts, int B, int n, const lm_mla_seg *seg,
                                     float *dx, const lm_mla_params *g, float *scratch);
/* head_max [H] (host): each head's largest scaled logit in the segment's forward (backend's attention_head_max) */
lm_status lm_mla_seg_head_max(const lm_mla_config *c, float *acts, int B, int n, float *head_max);

/* ---- decode ---- */
typedef struct {
    int B, max_T, len; /* len tokens cached per sequence */
    int row;           /* floats per token in `kv` (MLA: kv_lora + r; GQA: Hkv*Dk) */
    float *kv;         /* MLA: [B,max_T,kv_lora+r] = [c ; RoPE(kr)]; GQA: k [B,max_T,Hkv,Dk] */
    float *v;          /* GQA: v [B,max_T,Hkv,Dv]; MLA: NULL */
} lm_mla_cache;

size_t lm_mla_cache_floats(const lm_mla_config *cfg, int B, int max_T);
lm_status lm_mla_cache_init(const lm_mla_config *cfg, lm_mla_cache *cache, int B, int max_T,
                            float *mem);
size_t lm_mla_decode_scratch_floats(const lm_mla_config *cfg, int B, int max_T);

/* Run the forward on a prompt x [B,T,d] (y [B,T,d], acts as for the forward)
 * into an empty cache, which then holds T tokens. */
lm_status lm_mla_prefill(const lm_mla_config *cfg, const lm_mla_params *p, lm_mla_cache *cache,
                         const float *x, int T, float *y, float *acts);
/* One token per sequence: x [B,d] at position cache->len -> y [B,d]; appends to the cache. */
lm_status lm_mla_decode_step(const lm_mla_config *cfg, const lm_mla_params *p,
                             lm_mla_cache *cache, const float *x, float *y, float *scratch);

#ifdef __cplusplus
}
#endif
#endif
