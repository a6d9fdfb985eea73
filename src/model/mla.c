/* The gated full-attention layer, MLA or GQA, NoPE by default
 * (include/longmoe/mla.h, docs/attention.md, SPEC §3). */
#include "longmoe/mla.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include "longmoe/attention.h"
#include "check.h"
#include "longmoe/backend.h"
#include "longmoe/linear.h"
#include "mla_internal.h"

lm_mla_config lm_mla_config_mla(int d_model, int n_heads, int head_dim_qk, int head_dim_v,
                                int q_lora, int kv_lora) {
    lm_mla_config c;
    memset(&c, 0, sizeof c);
    c.kind = LM_ATTN_MLA;
    c.d_model = d_model, c.n_heads = n_heads, c.n_kv_heads = n_heads;
    c.head_dim_qk = head_dim_qk, c.head_dim_v = head_dim_v;
    c.q_lora = q_lora, c.kv_lora = kv_lora;
    c.rope_base = 10000.0f, c.norm_eps = 1e-6f;
    return c;
}

lm_mla_config lm_mla_config_gqa(int d_model, int n_heads, int n_kv_heads, int head_dim_qk,
                                int head_dim_v) {
    lm_mla_config c = lm_mla_config_mla(d_model, n_heads, head_dim_qk, head_dim_v, 0, 0);
    c.kind = LM_ATTN_GQA;
    c.n_kv_heads = n_kv_heads;
    return c;
}

lm_status lm_mla_check(const lm_mla_config *c) {
    if (!c) return lm_error(LM_ERR_ARG, "mla: config is NULL");
    if (c->kind != LM_ATTN_MLA && c->kind != LM_ATTN_GQA)
        return lm_error(LM_ERR_ARG, "mla: kind must be MLA (0) or GQA (1), got %d", (int)c->kind);
    if (c->d_model < 1 || c->n_heads < 1 || c->head_dim_qk < 1 || c->head_dim_v < 1)
        return lm_error(LM_ERR_ARG, "mla: d_model=%d n_heads=%d head_dim_qk=%d head_dim_v=%d must be >= 1",
                        c->d_model, c->n_heads, c->head_dim_qk, c->head_dim_v);
    if (c->kind == LM_ATTN_MLA && (c->q_lora < 1 || c->kv_lora < 1))
        return lm_error(LM_ERR_ARG, "mla: q_lora=%d and kv_lora=%d must be >= 1 for MLA", c->q_lora,
                        c->kv_lora);
    if (c->kind == LM_ATTN_GQA && (c->n_kv_heads < 1 || c->n_heads % c->n_kv_heads))
        return lm_error(LM_ERR_ARG, "mla: GQA needs n_heads=%d to be a multiple of n_kv_heads=%d >= 1",
                        c->n_heads, c->n_kv_heads);
    const int rmax = c->kind == LM_ATTN_MLA ? c->head_dim_qk - 1 : c->head_dim_qk;
    if (c->rope_dims < 0 || c->rope_dims % 2 || c->rope_dims > rmax)
        return lm_error(LM_ERR_ARG,
                        "mla: rope_dims=%d must be even and in [0, %d] (head_dim_qk=%d%s)",
                        c->rope_dims, rmax, c->head_dim_qk,
                        c->kind == LM_ATTN_MLA ? "; MLA keeps at least one latent key dim" : "");
    if (c->rope_dims > 0 && !(c->rope_base > 1.0f && isfinite(c->rope_base)))
        return lm_error(LM_ERR_ARG, "mla: rope_base must be finite and > 1, got %g", (double)c->rope_base);
    if (!(c->norm_eps > 0 && isfinite(c->norm_eps)))
        return lm_error(LM_ERR_ARG, "mla: norm_eps must be finite and > 0, got %g", (double)c->norm_eps);
    if (!isfinite(c->scale) || c->scale < 0)
        return lm_error(LM_ERR_ARG, "mla: scale must be finite and >= 0 (0 = Dk^-1/2), got %g",
                        (double)c->scale);
    return LM_OK;
}

/* Heads of k and v as the attention core sees them: MLA expands the latent per head. */
static int kv_heads(const lm_mla_config *c) { return c->kind == LM_ATTN_MLA ? c->n_heads : c->n_kv_heads; }

/* ---------------------------------------------------------------- parameters */

typedef struct {
    size_t W_dq, q_norm, W_uq, W_dkv, kv_norm, W_uk, W_uv, W_kr, W_q, W_k, W_v, W_g, W_o;
} param_sizes;

static param_sizes sizes_of(const lm_mla_config *c) {
    param_sizes s;
    memset(&s, 0, sizeof s);
    const size_t d = c->d_model, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v,
                 r = c->rope_dims;
    if (c->kind == LM_ATTN_MLA) {
        const size_t ql = c->q_lora, kl = c->kv_lora;
        s.W_dq = ql * d, s.q_norm = ql, s.W_uq = H * Dk * ql;
        s.W_dkv = kl * d, s.kv_norm = kl, s.W_uk = H * (Dk - r) * kl, s.W_uv = H * Dv * kl;
        s.W_kr = r * d;
    } else {
        const size_t Hkv = c->n_kv_heads;
        s.W_q = H * Dk * d, s.W_k = Hkv * Dk * d, s.W_v = Hkv * Dv * d;
    }
    s.W_g = H * Dv * d, s.W_o = d * H * Dv;
    return s;
}

size_t lm_mla_param_count(const lm_mla_config *c) {
    param_sizes s = sizes_of(c);
    return s.W_dq + s.q_norm + s.W_uq + s.W_dkv + s.kv_norm + s.W_uk + s.W_uv + s.W_kr + s.W_q +
           s.W_k + s.W_v + s.W_g + s.W_o;
}

lm_status lm_mla_params_map(const lm_mla_config *c, float *mem, lm_mla_params *p) {
    lm_status st = lm_mla_check(c);
    if (st) return st;
    if (!mem || !p) return lm_error(LM_ERR_ARG, "mla params_map: memory and params are required");
    param_sizes s = sizes_of(c);
    memset(p, 0, sizeof *p);
    float *m = mem;
#define TAKE(f) (p->f = s.f ? m : NULL, m += s.f)
    TAKE(W_dq), TAKE(q_norm), TAKE(W_uq), TAKE(W_dkv), TAKE(kv_norm), TAKE(W_uk), TAKE(W_uv);
    TAKE(W_kr), TAKE(W_q), TAKE(W_k), TAKE(W_v), TAKE(W_g), TAKE(W_o);
#undef TAKE
    return LM_OK;
}

static void fill_normal(float *w, size_t n, int fan_in, lm_rng *rng) {
    const double sd = 1.0 / sqrt((double)fan_in);
    for (size_t i = 0; i < n; i++) w[i] = (float)(sd * lm_rng_normal(rng));
}

void lm_mla_params_init(const lm_mla_config *c, const lm_mla_params *p, lm_rng *rng) {
    param_sizes s = sizes_of(c);
    const int d = c->d_model, HDv = c->n_heads * c->head_dim_v;
    if (c->kind == LM_ATTN_MLA) {
        fill_normal(p->W_dq, s.W_dq, d, rng);
        for (size_t i = 0; i < s.q_norm; i++) p->q_norm[i] = 1.0f;
        fill_normal(p->W_uq, s.W_uq, c->q_lora, rng);
        fill_normal(p->W_dkv, s.W_dkv, d, rng);
        for (size_t i = 0; i < s.kv_norm; i++) p->kv_norm[i] = 1.0f;
        fill_normal(p->W_uk, s.W_uk, c->kv_lora, rng);
        fill_normal(p->W_uv, s.W_uv, c->kv_lora, rng);
        if (s.W_kr) fill_normal(p->W_kr, s.W_kr, d, rng);
    } else {
        fill_normal(p->W_q, s.W_q, d, rng);
        fill_normal(p->W_k, s.W_k, d, rng);
        fill_normal(p->W_v, s.W_v, d, rng);
    }
    fill_normal(p->W_g, s.W_g, d, rng);
    fill_normal(p->W_o, s.W_o, HDv, rng);
}

/* ---------------------------------------------------------------- activations */

/* Offsets (in floats) of the saved activations; absent ones have size 0. */
typedef struct {
    size_t ql, qn, q_rstd, kvl, c, kv_rstd, kn, kr, q, k, v, o, lse, rowmax, gp, gated;
    size_t qn_lp, c_lp, q_lp, k_lp, v_lp; /* product-format copies (separate product format only) */
    size_t total;
} acts_layout;

static lm_backend *backend_of(const lm_mla_config *c) { return c->backend ? c->backend : lm_backend_cpu(); }
/* Whether the backend's product format is a separate (bf16) copy (backend.h):
 * then o and gated hold that format and the lp slots exist. */
static int lp_separate(const lm_mla_config *c) { return backend_of(c)->lp_bytes != sizeof(float); }

/* Floats that hold n values of the product format (the separate copies only). */
static size_t lp_floats(const lm_mla_config *c, size_t n) {
    return (n * backend_of(c)->lp_bytes + sizeof(float) - 1) / sizeof(float);
}

static acts_layout layout_acts(const lm_mla_config *c, int B, int T) {
    const size_t N = (size_t)B * T, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v;
    const size_t Hk = kv_heads(c), r = c->rope_dims;
    const int mla = c->kind == LM_ATTN_MLA;
    acts_layout a;
    size_t off = 0;
#define PLACE(f, n) (a.f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */
    PLACE(ql, mla ? N * c->q_lora : 0);
    PLACE(qn, mla ? N * c->q_lora : 0);
    PLACE(q_rstd, mla ? N : 0);
    PLACE(kvl, mla ? N * c->kv_lora : 0);
    PLACE(c, mla ? N * c->kv_lora : 0);
    PLACE(kv_rstd, mla ? N : 0);
    PLACE(kn, mla && r ? N * H * (Dk - r) : 0); /* per-head latent keys before assembly */
    PLACE(kr, mla ? N * r : 0);                 /* shared rotary key (after RoPE) */
    PLACE(q, N * H * Dk);
    PLACE(k, N * Hk * Dk);
    PLACE(v, N * Hk * Dv);
    PLACE(o, N * H * Dv);
    PLACE(lse, N * H);
    PLACE(rowmax, N * H);
    PLACE(gp, N * H * Dv);
    PLACE(gated, N * H * Dv);
    const size_t sep = lp_separate(c);
    /* the separate product-format copies: lp_bytes each, in floats */
    PLACE(qn_lp, sep && mla ? lp_floats(c, N * c->q_lora) : 0);
    PLACE(c_lp, sep && mla ? lp_floats(c, N * c->kv_lora) : 0);
    PLACE(q_lp, sep ? lp_floats(c, N * H * Dk) : 0);
    PLACE(k_lp, sep ? lp_floats(c, N * Hk * Dk) : 0);
    PLACE(v_lp, sep ? lp_floats(c, N * Hk * Dv) : 0);
#undef PLACE
    a.total = off;
    if (!sep) {
        a.qn_lp = a.qn;
        a.c_lp = a.c;
        a.q_lp = a.q;
        a.k_lp = a.k;
        a.v_lp = a.v;
    }
    return a;
}

size_t lm_mla_acts_floats(const lm_mla_config *c, int B, int T) { return layout_acts(c, B, T).total; }

typedef struct {
    size_t dgated, dgp, d_o, dq, dk, dv, dkn, dkr, dc, dkvl, dqn, dql;
    size_t dy_lp, dgp_lp, dkvl_lp, dql_lp, wcat; /* separate product format only */
    size_t total;
} scratch_layout;

/* The whole rows' low-rank input gradients side by side (cat_lora): [dkvl | dql], kv_lora + q_lora
 * wide in the product format, rows cat_ld elements apart (a multiple of 8) */
static size_t cat_ld(const lm_mla_config *c) { return ((size_t)c->kv_lora + c->q_lora + 7) & ~(size_t)7; }

static scratch_layout layout_scratch(const lm_mla_config *c, int B, int T) {
    const size_t N = (size_t)B * T, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v;
    const size_t Hk = kv_heads(c), r = c->rope_dims;
    const int mla = c->kind == LM_ATTN_MLA;
    scratch_layout s;
    size_t off = 0;
#define PLACE(f, n) (s.f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */
    PLACE(dgated, N * H * Dv);
    PLACE(dgp, N * H * Dv);
    PLACE(d_o, N * H * Dv);
    PLACE(dq, N * H * Dk);
    PLACE(dk, N * Hk * Dk);
    PLACE(dv, N * Hk * Dv);
    PLACE(dkn, mla && r ? N * H * (Dk - r) : 0);
    /* dkr, dc, dkvl, dqn, dql: consecutive, the backward zeroes them as one range */
    PLACE(dkr, mla ? N * r : 0);
    PLACE(dc, mla ? N * c->kv_lora : 0);
    PLACE(dkvl, mla ? N * c->kv_lora : 0);
    PLACE(dqn, mla ? N * c->q_lora : 0);
    PLACE(dql, mla ? N * c->q_lora : 0);
    const size_t sep = lp_separate(c);
    PLACE(dy_lp, sep ? lp_floats(c, N * (size_t)c->d_model) : 0);
    PLACE(dgp_lp, sep ? lp_floats(c, N * H * Dv) : 0);
    /* dkvl_lp and dql_lp consecutive: together (at least N cat_ld elements) they hold the side-by-side
     * operand of cat_lora; wcat its two weights stacked */
    const size_t lat = lp_floats(c, N * c->kv_lora), qlat = lp_floats(c, N * c->q_lora);
    const size_t cat = lp_floats(c, N * cat_ld(c)), room = ((lat + 15) & ~(size_t)15) + qlat;
    PLACE(dkvl_lp, sep && mla ? lat : 0);
    PLACE(dql_lp, sep && mla ? (cat > room ? qlat + cat - room : qlat) : 0);
    PLACE(wcat, sep && mla ? lp_floats(c, ((size_t)c->kv_lora + c->q_lora) * (size_t)c->d_model) : 0);
#undef PLACE
    s.total = off;
    return s;
}

size_t lm_mla_scratch_floats(const lm_mla_config *c, int B, int T) {
    return layout_scratch(c, B, T).total;
}

/* ---------------------------------------------------------------- RoPE */

/* Rotate the last r dims of each of the `heads` head vectors (head_dim floats)
 * in each of the n rows of x; row i sits at position pos0 + i % T. Pairs are
 * (j, j + r/2) with angle pos * base^(-2j/r) (rotate-half convention);
 * inverse = 1 applies the transpose (rotation by -angle): the backward. */
static void rope_apply(float *x, int64_t n, int T, int heads, int head_dim, int r, float base,
                       int64_t pos0, int inverse) {
    if (r == 0) return;
    const int half = r / 2, off = head_dim - r;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const double pos = (double)(pos0 + i % T);
        for (int j = 0; j < half; j++) {
            const double ang = pos * pow((double)base, -2.0 * j / r);
            const float cs = (float)cos(ang), sn = inverse ? -(float)sin(ang) : (float)sin(ang);
            for (int h = 0; h < heads; h++) {
                float *v = x + ((size_t)i * heads + h) * head_dim + off;
                const float a = v[j], b = v[j + half];
                v[j] = a * cs - b * sn;
                v[j + half] = a * sn + b * cs;
            }
        }
    }
}

void lm_mla_rope_apply(float *x, int64_t n, int T, int heads, int head_dim, int r, float base, int64_t pos0,
                       int inverse) {
    rope_apply(x, n, T, heads, head_dim, r, base, pos0, inverse);
}

/* ---------------------------------------------------------------- forward */

static lm_status check_run(const lm_mla_config *c, const lm_mla_params *p, int B, int T) {
    lm_status st = lm_mla_check(c);
    if (st) return st;
    if (!p) return lm_error(LM_ERR_ARG, "mla: params are NULL");
    if (B < 1 || T < 1) return lm_error(LM_ERR_ARG, "mla: B=%d and T=%d must be >= 1", B, T);
    const int mla = c->kind == LM_ATTN_MLA;
    if (!p->W_g || !p->W_o || (mla && (!p->W_dq || !p->q_norm || !p->W_uq || !p->W_dkv ||
                                       !p->kv_norm || !p->W_uk || !p->W_uv ||
                                       (c->rope_dims && !p->W_kr))) ||
        (!mla && (!p->W_q || !p->W_k || !p->W_v)))
        return lm_error(LM_ERR_ARG, "mla: a parameter tensor of the %s layer is NULL (use lm_mla_params_map)",
                        mla ? "MLA" : "GQA");
    return LM_OK;
}

static lm_attention_config core_config(const lm_mla_config *c, int B, int T) {
    lm_attention_config a = lm_attention_config_default(B, T, c->n_heads, kv_heads(c),
                                                        c->head_dim_qk, c->head_dim_v);
    a.scale = c->scale;
    a.workspace = c->workspace;
    a.workspace_bytes = c->workspace_bytes;
    return a;
}

/* The products and norms of the layer, through the backend's ops (backend.h). */
#define MM_F(out, inp, w, bias, n, ic, oc) TRY(op->matmul_forward(be, out, inp, w, n, ic, oc))
#define MM_B(dinp, dw, dbias, dout, inp, w, n, ic, oc) TRY(op->matmul_backward(be, dinp, dw, dout, inp, w, n, ic, oc))
#define RMS_F(out, rstd, inp, w, n, d, eps) TRY(op->rmsnorm_forward(be, out, NULL, rstd, inp, w, n, d, eps))
#define RMS_B(dinp, dw, dout, inp, w, rstd, n, d, eps) TRY(op->rmsnorm_backward(be, dinp, dw, dout, inp, w, rstd, n, d, eps))

/* The lp view of fp32 `x` (n floats): x itself on the CPU, else the slot
 * `buf` filled by to_lp. */
static lm_status lp_view(lm_backend *be, const float *x, void *buf, size_t n, const void **out) {
    if (be->lp_bytes == sizeof(float)) {
        *out = x;
        return LM_OK;
    }
    *out = buf;
    return be->ops->to_lp(be, buf, x, n);
}

/* A pointer `rows` rows of `width` elements of `bytes` each past p. */
static void *at(const void *p, size_t rows, size_t width, size_t bytes) { return (char *)p + rows * width * bytes; }

void lm_mla_seg_row_elems(const lm_mla_config *c, size_t *k_elems, size_t *v_elems) {
    *k_elems = (size_t)kv_heads(c) * c->head_dim_qk;
    *v_elems = (size_t)kv_heads(c) * c->head_dim_v;
}

void lm_mla_seg_token_bytes(const lm_mla_config *c, size_t lp_bytes, size_t *kv, size_t *latent) {
    size_t ke, ve;
    lm_mla_seg_row_elems(c, &ke, &ve);
    *kv = (ke + ve) * (lp_bytes + sizeof(float));
    *latent = c->kind == LM_ATTN_MLA ? (size_t)c->kv_lora * (lp_bytes + sizeof(float)) +
                                           (size_t)c->rope_dims * 2 * sizeof(float)
                                     : 0;
}

size_t lm_mla_keep_o_floats(const lm_mla_config *c, size_t lp_bytes, int B, int T_all) {
    return ((size_t)B * T_all * c->n_heads * c->head_dim_v * lp_bytes + sizeof(float) - 1) / sizeof(float);
}

size_t lm_mla_keep_lse_floats(const lm_mla_config *c, int B, int T_all) {
    return (size_t)B * T_all * c->n_heads;
}

/* The attention's output o [B*T,H*Dv] and lse (each sequence's [H,T]) of the
 * activations to the kept rows t0 .. t0+T-1 of every sequence (to_keep), or back. */
static lm_status keep_copy(lm_backend *be, const lm_mla_config *c, const lm_mla_keep *kp, int B, int T, int T_all,
                           int t0, void *o, float *lse, int to_keep) {
    const size_t lpb = be->lp_bytes, H = (size_t)c->n_heads, OE = H * c->head_dim_v;
    for (int b = 0; b < B; b++) {
        void *ko = at(kp->o, (size_t)b * T_all + t0, OE, lpb), *ao = at(o, (size_t)b * T, OE, lpb);
        float *kl = kp->lse + ((size_t)b * T_all + t0) * H, *al = lse + (size_t)b * H * T;
        TRY(be->copy(be, to_keep ? ko : ao, to_keep ? ao : ko, (size_t)T * OE * lpb));
        TRY(be->copy(be, to_keep ? kl : al, to_keep ? al : kl, (size_t)T * H * sizeof(float)));
    }
    return LM_OK;
}

static lm_status check_seg(const lm_mla_config *c, const lm_mla_seg *seg, int n) {
    if (!seg) return LM_OK;
    if (seg->t0 < 0 || seg->t0 + n > seg->T_all)
        return lm_error(LM_ERR_ARG, "mla segment: t0=%d n=%d past T_all=%d", seg->t0, n, seg->T_all);
    if (seg->c_store) {
        if (c->kind != LM_ATTN_MLA || !seg->k_work || !seg->v_work || (c->rope_dims && !seg->kr_store))
            return lm_error(LM_ERR_ARG, "mla segment: a latent store needs MLA, k_work, v_work (and kr_store with RoPE)");
    } else if (!seg->k_store || !seg->v_store) {
        return lm_error(LM_ERR_ARG, "mla segment: the key and value stores are missing");
    }
    return LM_OK;
}

/* Latent form: sequence b's keys and values of rows 0 .. P-1 from the stored
 * latents (and rotary keys) into seg->k_work, v_work, C rows at a time (with
 * RoPE the keys through the fp32 slots tk [C,H,Dk] and tn [C,H,Dk-r]). */
static lm_status seg_build_kv(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                              const lm_mla_seg *seg, int b, size_t P, float *tk, float *tn, size_t C) {
    lm_backend *be = backend_of(c);
    const lm_ops *op = be->ops;
    const size_t lpb = be->lp_bytes, kl = (size_t)c->kv_lora, H = (size_t)c->n_heads, Dk = (size_t)c->head_dim_qk,
                 Dv = (size_t)c->head_dim_v, r = (size_t)c->rope_dims, Dn = Dk - r;
    for (size_t j0 = 0; j0 < P; j0 += C) {
        const size_t n = P - j0 < C ? P - j0 : C, row = (size_t)b * seg->T_all + j0;
        const void *cb = at(seg->c_store, row, kl, lpb);
        if (r == 0) {
            /* straight in the product format (as matmul_forward then to_lp, one rounding) */
            TRY(op->matmul_forward_lp(be, at(seg->k_work, j0, H * Dk, lpb), cb, pl->W_uk, (int64_t)n, (int)kl,
                                      (int)(H * Dk)));
        } else {
            /* the CPU's form (RoPE runs on the CPU only): per head the latent part and the shared rotary key */
            TRY(op->matmul_forward(be, tn, cb, p->W_uk, (int64_t)n, (int)kl, (int)(H * Dn)));
            const float *kr = seg->kr_store + row * r;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < (int64_t)n; i++)
                for (size_t h = 0; h < H; h++) {
                    memcpy(tk + ((size_t)i * H + h) * Dk, tn + ((size_t)i * H + h) * Dn, Dn * sizeof(float));
                    memcpy(tk + ((size_t)i * H + h) * Dk + Dn, kr + (size_t)i * r, r * sizeof(float));
                }
            TRY(op->to_lp(be, at(seg->k_work, j0, H * Dk, lpb), tk, n * H * Dk));
        }
        TRY(op->matmul_forward_lp(be, at(seg->v_work, j0, H * Dv, lpb), cb, pl->W_uv, (int64_t)n, (int)kl,
                                  (int)(H * Dv)));
    }
    return LM_OK;
}

/* store_only (a segment): only the segment's rows of the stores (no attention, no output) */
static lm_status mla_forward(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl, const void *x,
                             int B, int T, float *y, float *acts, const lm_mla_seg *seg, int store_only,
                             const lm_mla_keep *kp) {
    // x (B,T,d) in the product format -> y (B,T,d); acts (lm_mla_acts_floats)
    lm_status st = check_run(c, p, B, T);
    if (!st) st = check_seg(c, seg, T);
    if (st) return st;
    if (!x || (!y && !store_only) || !acts || !pl)
        return lm_error(LM_ERR_ARG, "mla forward: x, y, acts and p_lp are required");
    if (kp && (!kp->o || !kp->lse)) return lm_error(LM_ERR_ARG, "mla forward: a kept output needs o and lse");
    lm_backend *be = backend_of(c);
    const lm_ops *op = be->ops;
    if (c->rope_dims && be->device != LM_DEVICE_CPU)
        return lm_error(LM_ERR_ARG, "mla: rope_dims=%d: RoPE runs on the CPU only (the recipe's MLA is NoPE)",
                        c->rope_dims);
    const int64_t N = (int64_t)B * T;
    const int d = c->d_model, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v;
    const int r = c->rope_dims, Dn = Dk - r, Hk = kv_heads(c);
    const float eps = c->norm_eps;
    acts_layout L = layout_acts(c, B, T);
    const int sep = lp_separate(c);
    const int64_t pos0 = seg ? seg->t0 : 0; /* RoPE's position of the first row */
    const int latent = seg && seg->c_store;  /* the keys and values come from the stored latents */
    float *q = acts + L.q, *k = acts + L.k, *v = acts + L.v;
    /* without RoPE (the recipe's NoPE, and always on a GPU) q, k and v feed the attention alone: their
     * products write the product format straight (one rounding of the fp32 sums; on the CPU the fp32
     * buffers themselves), with RoPE they are formed in fp32 first and converted */
    const int direct = r == 0;
#define MM_LP(out_lp, inp, w, n, ic, oc) TRY(op->matmul_forward_lp(be, out_lp, inp, w, n, ic, oc))
    if (c->kind == LM_ATTN_MLA) {
        float *ql = acts + L.ql, *qn = acts + L.qn, *kvl = acts + L.kvl, *lat = acts + L.c;
        // q = W_uq RMSNorm(W_dq x); c = RMSNorm(W_dkv x)   (SPEC §3)
        MM_F(ql, x, pl->W_dq, NULL, N, d, c->q_lora);
        TRY(op->rmsnorm_forward(be, qn, sep ? acts + L.qn_lp : NULL, acts + L.q_rstd, ql, p->q_norm, N, c->q_lora,
                                eps));
        if (direct) MM_LP(acts + L.q_lp, acts + L.qn_lp, pl->W_uq, N, c->q_lora, H * Dk);
        else MM_F(q, acts + L.qn_lp, pl->W_uq, NULL, N, c->q_lora, H * Dk);
        MM_F(kvl, x, pl->W_dkv, NULL, N, d, c->kv_lora);
        TRY(op->rmsnorm_forward(be, lat, sep ? acts + L.c_lp : NULL, acts + L.kv_rstd, kvl, p->kv_norm, N,
                                c->kv_lora, eps));
        // k_h = W_uk,h c (+ the shared rotary key kr), v_h = W_uv,h c
        if (latent) {
            /* the keys and values are up-projected from the stores below; the rotary key goes there too */
            if (r) {
                float *kr = acts + L.kr;
                MM_F(kr, x, p->W_kr, NULL, N, d, r);
                rope_apply(kr, N, T, 1, r, r, c->rope_base, pos0, 0);
                rope_apply(q, N, T, H, Dk, r, c->rope_base, pos0, 0);
            }
        } else if (direct) {
            MM_LP(acts + L.k_lp, acts + L.c_lp, pl->W_uk, N, c->kv_lora, H * Dk);
            MM_LP(acts + L.v_lp, acts + L.c_lp, pl->W_uv, N, c->kv_lora, H * Dv);
        } else {
            float *kn = acts + L.kn, *kr = acts + L.kr;
            MM_F(kn, lat, p->W_uk, NULL, N, c->kv_lora, H * Dn);
            MM_F(kr, x, p->W_kr, NULL, N, d, r);
            rope_apply(kr, N, T, 1, r, r, c->rope_base, pos0, 0);
            rope_apply(q, N, T, H, Dk, r, c->rope_base, pos0, 0);
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < N; i++)
                for (int h = 0; h < H; h++) {
                    float *kh = k + ((size_t)i * H + h) * Dk;
                    memcpy(kh, kn + ((size_t)i * H + h) * Dn, (size_t)Dn * sizeof(float));
                    memcpy(kh + Dn, kr + (size_t)i * r, (size_t)r * sizeof(float));
                }
            MM_F(v, acts + L.c_lp, pl->W_uv, NULL, N, c->kv_lora, H * Dv);
        }
    } else if (direct) {
        MM_LP(acts + L.q_lp, x, pl->W_q, N, d, H * Dk);
        MM_LP(acts + L.k_lp, x, pl->W_k, N, d, Hk * Dk);
        MM_LP(acts + L.v_lp, x, pl->W_v, N, d, Hk * Dv);
    } else {
        MM_F(q, x, pl->W_q, NULL, N, d, H * Dk);
        MM_F(k, x, pl->W_k, NULL, N, d, Hk * Dk);
        MM_F(v, x, pl->W_v, NULL, N, d, Hk * Dv);
        rope_apply(q, N, T, H, Dk, r, c->rope_base, pos0, 0);
        rope_apply(k, N, T, Hk, Dk, r, c->rope_base, pos0, 0);
    }
#undef MM_LP
    if (sep && !direct) TRY(op->to_lp(be, acts + L.q_lp, q, (size_t)N * H * Dk));
    if (sep && !direct && !latent) {
        TRY(op->to_lp(be, acts + L.k_lp, k, (size_t)N * Hk * Dk));
        TRY(op->to_lp(be, acts + L.v_lp, v, (size_t)N * Hk * Dv));
    }
    /* o and gated are in the product format */
    float *o = acts + L.o, *gp = acts + L.gp, *gated = acts + L.gated;
    lm_attention_config ac = core_config(c, B, T);
    /* a kept output reused: the attention's inputs as always (the stores' rows included), not the attention */
    const int reuse = kp && kp->reuse;
    if (!seg) {
        if (!reuse)
            TRY(op->attention_forward(be, &ac, acts + L.q_lp, acts + L.k_lp, acts + L.v_lp, o, acts + L.lse,
                                      acts + L.rowmax));
    } else if (latent) {
        /* the segment's latents (and rotary keys) into the stores, then per sequence the keys and values of
         * its prefix up-projected and its queries over them */
        const size_t lpb = be->lp_bytes, kl = (size_t)c->kv_lora;
        lm_attention_config a1 = core_config(c, 1, T);
        for (int b = 0; b < B; b++) {
            const size_t row = (size_t)b * seg->T_all + seg->t0;
            TRY(be->copy(be, at(seg->c_store, row, kl, lpb), at(acts + L.c_lp, (size_t)b * T, kl, lpb),
                         (size_t)T * kl * lpb));
            if (r)
                TRY(be->copy(be, seg->kr_store + row * r, acts + L.kr + (size_t)b * T * r,
                             (size_t)T * r * sizeof(float)));
        }
        if (store_only) return LM_OK;
        for (int b = 0; b < B && !reuse; b++) {
            TRY(seg_build_kv(c, p, pl, seg, b, (size_t)seg->t0 + T, k, acts + L.kn, (size_t)N));
            TRY(op->attention_forward_offset(be, &a1, seg->t0, at(acts + L.q_lp, (size_t)b * T, (size_t)H * Dk, lpb),
                                             seg->k_work, seg->v_work, at(o, (size_t)b * T, (size_t)H * Dv, lpb),
                                             acts + L.lse + (size_t)b * H * T, acts + L.rowmax + (size_t)b * H * T));
        }
    } else {
        /* the segment's keys and values into the stores, then each sequence's queries over its stored prefix */
        const size_t lpb = be->lp_bytes, KE = (size_t)Hk * Dk, VE = (size_t)Hk * Dv;
        lm_attention_config a1 = core_config(c, 1, T);
        for (int b = 0; b < B; b++) {
            const size_t row = (size_t)b * seg->T_all + seg->t0;
            TRY(be->copy(be, at(seg->k_store, row, KE, lpb), at(acts + L.k_lp, (size_t)b * T, KE, lpb),
                         (size_t)T * KE * lpb));
            TRY(be->copy(be, at(seg->v_store, row, VE, lpb), at(acts + L.v_lp, (size_t)b * T, VE, lpb),
                         (size_t)T * VE * lpb));
        }
        if (store_only) return LM_OK;
        for (int b = 0; b < B && !reuse; b++)
            TRY(op->attention_forward_offset(be, &a1, seg->t0, at(acts + L.q_lp, (size_t)b * T, (size_t)H * Dk, lpb),
                                             at(seg->k_store, (size_t)b * seg->T_all, KE, lpb),
                                             at(seg->v_store, (size_t)b * seg->T_all, VE, lpb),
                                             at(o, (size_t)b * T, (size_t)H * Dv, lpb),
                                             acts + L.lse + (size_t)b * H * T, acts + L.rowmax + (size_t)b * H * T));
    }
    if (kp)
        TRY(keep_copy(be, c, kp, B, T, seg ? seg->T_all : T, seg ? seg->t0 : 0, o, acts + L.lse, !reuse));
    // y = W_o (sigmoid(W_g x) * o)
    MM_F(gp, x, pl->W_g, NULL, N, d, H * Dv);
    TRY(op->gate_forward(be, sep ? NULL : gated, gated, gp, o, (size_t)N * H * Dv));
    MM_F(y, gated, pl->W_o, NULL, N, H * Dv, d);
    return LM_OK;
}

lm_status lm_mla_forward_lp(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl, const void *x,
                            int B, int T, float *y, float *acts) {
    return mla_forward(c, p, pl, x, B, T, y, acts, NULL, 0, NULL);
}

lm_status lm_mla_forward_lp_keep(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                                 const void *x, int B, int T, float *y, float *acts, const lm_mla_keep *keep) {
    return mla_forward(c, p, pl, x, B, T, y, acts, NULL, 0, keep);
}

lm_status lm_mla_forward_seg(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl, const void *x,
                             int B, int n, const lm_mla_seg *seg, float *y, float *acts) {
    if (!seg) return lm_error(LM_ERR_ARG, "mla segment forward: seg is NULL");
    return mla_forward(c, p, pl, x, B, n, y, acts, seg, 0, seg->keep);
}

lm_status lm_mla_seg_store_rows(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                                const void *x, int B, int n, const lm_mla_seg *seg, float *acts) {
    if (!seg) return lm_error(LM_ERR_ARG, "mla segment store rows: seg is NULL");
    return mla_forward(c, p, pl, x, B, n, NULL, acts, seg, 1, NULL);
}

lm_status lm_mla_seg_head_max(const lm_mla_config *c, float *acts, int B, int n, float *head_max) {
    lm_backend *be = backend_of(c);
    const int H = c->n_heads;
    float one[512];
    if (H > 512) return lm_error(LM_ERR_ARG, "mla segment head max: %d heads (at most 512)", H);
    lm_attention_config a1 = core_config(c, 1, n);
    float *rowmax = acts + layout_acts(c, B, n).rowmax;
    for (int h = 0; h < H; h++) head_max[h] = -INFINITY;
    for (int b = 0; b < B; b++) {
        TRY(be->ops->attention_head_max(be, &a1, rowmax + (size_t)b * H * n, one));
        for (int h = 0; h < H; h++) head_max[h] = one[h] > head_max[h] ? one[h] : head_max[h];
    }
    return LM_OK;
}

lm_status lm_mla_forward(const lm_mla_config *c, const lm_mla_params *p, const float *x, int B, int T, float *y,
                         float *acts) {
    if (lp_separate(c)) return lm_error(LM_ERR_ARG, "mla forward: this backend needs lm_mla_forward_lp");
    return lm_mla_forward_lp(c, p, p, x, B, T, y, acts);
}

/* ---------------------------------------------------------------- backward */

/* stores_only (a segment): only the key/value side, from the accumulators' rows of the segment */
static lm_status mla_backward(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                              const void *x, const float *acts, const float *dy, const void *dy_given, int B,
                              int T, float *dx, const lm_mla_params *g, float *scratch, const lm_mla_seg *seg,
                              int stores_only) {
    // x (B,T,d) in the product format; dy, dx (B,T,d); acts from the forward; gradients accumulate (+=),
    // dx too in a segment's backward (seg), and the whole rows' backward writes dx
    lm_status st = check_run(c, p, B, T);
    if (!st) st = check_seg(c, seg, T);
    if (!st && seg && !seg->c_store && (!seg->dk_acc || !seg->dv_acc || !seg->dk_tmp || !seg->dv_tmp))
        st = lm_error(LM_ERR_ARG, "mla segment backward: the accumulators and dk_tmp, dv_tmp are required");
    if (!st && seg && seg->c_store && (!seg->dc_acc || (c->rope_dims && !seg->dkr_acc) || !seg->dk_tmp || !seg->dv_tmp))
        st = lm_error(LM_ERR_ARG, "mla segment backward: the latent accumulators and dk_tmp, dv_tmp are required");
    if (st) return st;
    if (!x || !acts || (!dy && !stores_only) || !scratch || !pl)
        return lm_error(LM_ERR_ARG, "mla backward: x, acts, dy, scratch and p_lp are required");
    lm_backend *be = backend_of(c);
    const lm_ops *op = be->ops;
    lm_mla_params none;
    memset(&none, 0, sizeof none);
    if (!g) g = &none;
    const int64_t N = (int64_t)B * T;
    const int d = c->d_model, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v;
    const int r = c->rope_dims, Dn = Dk - r, Hk = kv_heads(c);
    const float eps = c->norm_eps;
    acts_layout L = layout_acts(c, B, T);
    scratch_layout S = layout_scratch(c, B, T);
    /* zero only what is accumulated into (dgated, and dkr ... dql: dkr, dc, dkvl, dqn, dql, consecutive);
     * every other scratch buffer is written whole before it is read (d_o, dgp, dq, dk, dv, dkn, the lp
     * copies) */
    TRY(be->zero(be, scratch + S.dgated, (S.dgp - S.dgated) * sizeof(float)));
    TRY(be->zero(be, scratch + S.dkr, (S.dy_lp - S.dkr) * sizeof(float)));
    const float *o = acts + L.o, *gp = acts + L.gp;
    /* d_o, dq, dk, dv are in the product format */
    float *dgated = scratch + S.dgated, *dgp = scratch + S.dgp, *d_o = scratch + S.d_o;
    float *dq = scratch + S.dq, *dk = scratch + S.dk, *dv = scratch + S.dv;
    const void *dy_lp, *dgp_lp;
    const int sep = lp_separate(c);
    lm_attention_config ac = core_config(c, B, T);
    const int64_t pos0 = seg ? seg->t0 : 0;
    const int latent = seg && seg->c_store;
    if (stores_only) goto stores;
    if (dy_given && sep) dy_lp = dy_given;
    else TRY(lp_view(be, dy, scratch + S.dy_lp, (size_t)N * d, &dy_lp));
    // through y = W_o (sigmoid(gp) * o)
    MM_B(dgated, g->W_o, NULL, dy_lp, acts + L.gated, pl->W_o, N, H * Dv, d);
    /* dgp straight in the product format where that is a separate copy (no fp32 dgp, no conversion) */
    TRY(op->gate_backward(be, d_o, sep ? NULL : dgp, sep ? scratch + S.dgp_lp : NULL, dgated, gp, o,
                          (size_t)N * H * Dv));
    dgp_lp = sep ? (const void *)(scratch + S.dgp_lp) : (const void *)dgp;
    /* the whole rows' backward writes dx (this first product sets it); a segment's adds to it */
    if (seg) MM_B(dx, g->W_g, NULL, dgp_lp, x, pl->W_g, N, d, H * Dv);
    else TRY(op->matmul_backward_set(be, dx, g->W_g, dgp_lp, x, pl->W_g, N, d, H * Dv));
    if (!seg) {
        TRY(op->attention_backward(be, &ac, acts + L.q_lp, acts + L.k_lp, acts + L.v_lp, o, acts + L.lse, d_o, dq,
                                   dk, dv));
    } else if (latent) {
        /* per sequence: its prefix's keys and values again, the attention's gradient of them, taken through
         * the up-projections into the latents' (and rotary keys') accumulators; the weights' gradients add
         * every row's part. dk, dv, dkn serve as the fp32 slots of the up-projection ([N] rows). */
        const size_t lpb = be->lp_bytes, kl = (size_t)c->kv_lora, P = (size_t)seg->t0 + T;
        lm_attention_config a1 = core_config(c, 1, T);
        for (int b = 0; b < B; b++) {
            const size_t row0 = (size_t)b * seg->T_all;
            const void *cb = at(seg->c_store, row0, kl, lpb);
            TRY(seg_build_kv(c, p, pl, seg, b, P, dk, scratch + S.dkn, (size_t)N));
            TRY(op->attention_backward_offset(
                be, &a1, seg->t0, at(acts + L.q_lp, (size_t)b * T, (size_t)H * Dk, lpb), seg->k_work, seg->v_work,
                at(o, (size_t)b * T, (size_t)H * Dv, lpb), acts + L.lse + (size_t)b * H * T,
                at(d_o, (size_t)b * T, (size_t)H * Dv, lpb), at(dq, (size_t)b * T, (size_t)H * Dk, lpb), seg->dk_tmp,
                seg->dv_tmp));
            float *dcb = seg->dc_acc + row0 * kl;
            MM_B(dcb, g->W_uv, NULL, seg->dv_tmp, cb, pl->W_uv, (int64_t)P, (int)kl, H * Dv);
            if (r == 0) {
                MM_B(dcb, g->W_uk, NULL, seg->dk_tmp, cb, pl->W_uk, (int64_t)P, (int)kl, H * Dk);
            } else {
                /* per head the latent part; the rotary key's, summed over the heads, into its accumulator */
                float *dkn = scratch + S.dkn, *dkrb = seg->dkr_acc + row0 * r;
                const float *dkt = seg->dk_tmp;
                for (size_t j0 = 0; j0 < P; j0 += (size_t)N) {
                    const size_t n = P - j0 < (size_t)N ? P - j0 : (size_t)N;
#pragma omp parallel for schedule(static)
                    for (int64_t i = 0; i < (int64_t)n; i++)
                        for (int h = 0; h < H; h++) {
                            const float *dkh = dkt + ((j0 + (size_t)i) * H + h) * Dk;
                            memcpy(dkn + ((size_t)i * H + h) * Dn, dkh, (size_t)Dn * sizeof(float));
                            for (int j = 0; j < r; j++) dkrb[(j0 + (size_t)i) * r + j] += dkh[Dn + j];
                        }
                    MM_B(dcb + j0 * kl, g->W_uk, NULL, dkn, at(cb, j0, kl, lpb), p->W_uk, (int64_t)n, (int)kl,
                         H * Dn);
                }
            }
        }
    } else {
        /* per sequence: the gradients of all keys and values it read into the accumulators; its own rows'
         * (every later segment's part already there) into dk, dv */
        const size_t lpb = be->lp_bytes, KE = (size_t)Hk * Dk, VE = (size_t)Hk * Dv, P = (size_t)seg->t0 + T;
        lm_attention_config a1 = core_config(c, 1, T);
        for (int b = 0; b < B; b++) {
            const size_t row0 = (size_t)b * seg->T_all;
            TRY(op->attention_backward_offset(
                be, &a1, seg->t0, at(acts + L.q_lp, (size_t)b * T, (size_t)H * Dk, lpb),
                at(seg->k_store, row0, KE, lpb), at(seg->v_store, row0, VE, lpb), at(o, (size_t)b * T, (size_t)H * Dv, lpb),
                acts + L.lse + (size_t)b * H * T, at(d_o, (size_t)b * T, (size_t)H * Dv, lpb),
                at(dq, (size_t)b * T, (size_t)H * Dk, lpb), seg->dk_tmp, seg->dv_tmp));
            TRY(op->accumulate(be, seg->dk_acc + row0 * KE, seg->dk_tmp, P * KE, 1));
            TRY(op->accumulate(be, seg->dv_acc + row0 * VE, seg->dv_tmp, P * VE, 1));
        }
    }
stores:
    if (seg && !latent) {
        /* the segment's own rows of the keys' and values' gradients (every later segment's part in them) */
        const size_t lpb = be->lp_bytes, KE = (size_t)Hk * Dk, VE = (size_t)Hk * Dv;
        for (int b = 0; b < B; b++) {
            const size_t row0 = (size_t)b * seg->T_all;
            TRY(op->to_lp(be, at(dk, (size_t)b * T, KE, lpb), seg->dk_acc + (row0 + seg->t0) * KE, (size_t)T * KE));
            TRY(op->to_lp(be, at(dv, (size_t)b * T, VE, lpb), seg->dv_acc + (row0 + seg->t0) * VE, (size_t)T * VE));
        }
    }
    if (c->kind == LM_ATTN_MLA) {
        const float *lat = acts + L.c_lp;
        float *dc = scratch + S.dc, *dkvl = scratch + S.dkvl, *dqn = scratch + S.dqn,
              *dql = scratch + S.dql;
        const void *dkvl_lp, *dql_lp;
        if (latent) {
            /* the segment's own rows of the latents' (and rotary keys') gradients: every later segment's part
             * and this one's are in the accumulators */
            const size_t kl = (size_t)c->kv_lora;
            for (int b = 0; b < B; b++) {
                const size_t row = (size_t)b * seg->T_all + seg->t0;
                TRY(be->copy(be, dc + (size_t)b * T * kl, seg->dc_acc + row * kl, (size_t)T * kl * sizeof(float)));
                if (r)
                    TRY(be->copy(be, scratch + S.dkr + (size_t)b * T * r, seg->dkr_acc + row * r,
                                 (size_t)T * r * sizeof(float)));
            }
            if (r) {
                float *dkr = scratch + S.dkr;
                rope_apply(dkr, N, T, 1, r, r, c->rope_base, pos0, 1);
                MM_B(dx, g->W_kr, NULL, dkr, x, p->W_kr, N, d, r);
                if (!stores_only) rope_apply(dq, N, T, H, Dk, r, c->rope_base, pos0, 1);
            }
        } else {
            MM_B(dc, g->W_uv, NULL, dv, lat, pl->W_uv, N, c->kv_lora, H * Dv);
            if (r == 0) {
                MM_B(dc, g->W_uk, NULL, dk, lat, pl->W_uk, N, c->kv_lora, H * Dk);
            } else {
                float *dkn = scratch + S.dkn, *dkr = scratch + S.dkr;
                // split dk into the per-head latent part and the shared rotary key (summed over heads)
#pragma omp parallel for schedule(static)
                for (int64_t i = 0; i < N; i++)
                    for (int h = 0; h < H; h++) {
                        const float *dkh = dk + ((size_t)i * H + h) * Dk;
                        memcpy(dkn + ((size_t)i * H + h) * Dn, dkh, (size_t)Dn * sizeof(float));
                        for (int j = 0; j < r; j++) dkr[(size_t)i * r + j] += dkh[Dn + j];
                    }
                MM_B(dc, g->W_uk, NULL, dkn, lat, p->W_uk, N, c->kv_lora, H * Dn);
                rope_apply(dkr, N, T, 1, r, r, c->rope_base, pos0, 1);
                MM_B(dx, g->W_kr, NULL, dkr, x, p->W_kr, N, d, r);
                rope_apply(dq, N, T, H, Dk, r, c->rope_base, pos0, 1);
            }
        }
        RMS_B(dkvl, g->kv_norm, dc, acts + L.kvl, p->kv_norm, acts + L.kv_rstd, N,
                            c->kv_lora, eps);
        /* the whole rows on a backend with a separate product format and strided writes: the two low-rank
         * input gradients side by side, [dkvl | dql], and dx takes one product against W_dkv and W_dq
         * stacked (a device copy) instead of two that each read and write its fp32 rows */
        const int cat = !seg && sep && op->matmul_backward_ld && op->to_lp_rows;
        const size_t ld = cat_ld(c), lpb = be->lp_bytes, kl = (size_t)c->kv_lora, ql = (size_t)c->q_lora;
        char *dcat = (char *)(scratch + S.dkvl_lp);
        if (cat) {
            TRY(op->to_lp_rows(be, dcat, (int64_t)ld, dkvl, N, (int64_t)kl));
        } else {
            TRY(lp_view(be, dkvl, scratch + S.dkvl_lp, (size_t)N * kl, &dkvl_lp));
            MM_B(dx, g->W_dkv, NULL, dkvl_lp, x, pl->W_dkv, N, d, c->kv_lora);
        }
        if (stores_only) return LM_OK;
        MM_B(dqn, g->W_uq, NULL, dq, acts + L.qn_lp, pl->W_uq, N, c->q_lora, H * Dk);
        RMS_B(dql, g->q_norm, dqn, acts + L.ql, p->q_norm, acts + L.q_rstd, N,
                            c->q_lora, eps);
        if (cat) {
            TRY(op->to_lp_rows(be, dcat + kl * lpb, (int64_t)ld, dql, N, (int64_t)ql));
            char *wcat = (char *)(scratch + S.wcat);
            TRY(be->copy(be, wcat, pl->W_dkv, kl * d * lpb));
            TRY(be->copy(be, wcat + kl * d * lpb, pl->W_dq, ql * d * lpb));
            TRY(op->matmul_backward_ld(be, dx, NULL, dcat, (int64_t)ld, x, wcat, N, d, (int)(kl + ql), 0));
            TRY(op->matmul_backward_ld(be, NULL, g->W_dkv, dcat, (int64_t)ld, x, pl->W_dkv, N, d, (int)kl, 0));
            TRY(op->matmul_backward_ld(be, NULL, g->W_dq, dcat + kl * lpb, (int64_t)ld, x, pl->W_dq, N, d, (int)ql,
                                       0));
        } else {
            TRY(lp_view(be, dql, scratch + S.dql_lp, (size_t)N * ql, &dql_lp));
            MM_B(dx, g->W_dq, NULL, dql_lp, x, pl->W_dq, N, d, c->q_lora);
        }
    } else {
        if (!stores_only) rope_apply(dq, N, T, H, Dk, r, c->rope_base, pos0, 1);
        rope_apply(dk, N, T, Hk, Dk, r, c->rope_base, pos0, 1);
        if (!stores_only) MM_B(dx, g->W_q, NULL, dq, x, pl->W_q, N, d, H * Dk);
        MM_B(dx, g->W_k, NULL, dk, x, pl->W_k, N, d, Hk * Dk);
        MM_B(dx, g->W_v, NULL, dv, x, pl->W_v, N, d, Hk * Dv);
    }
    return LM_OK;
}

lm_status lm_mla_backward_lp(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                             const void *x, const float *acts, const float *dy, const void *dy_lp, int B, int T,
                             float *dx, const lm_mla_params *g, float *scratch) {
    return mla_backward(c, p, pl, x, acts, dy, dy_lp, B, T, dx, g, scratch, NULL, 0);
}

lm_status lm_mla_backward_seg(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                              const void *x, const float *acts, const float *dy, int B, int n,
                              const lm_mla_seg *seg, float *dx, const lm_mla_params *g, float *scratch) {
    if (!seg) return lm_error(LM_ERR_ARG, "mla segment backward: seg is NULL");
    return mla_backward(c, p, pl, x, acts, dy, NULL, B, n, dx, g, scratch, seg, 0);
}

lm_status lm_mla_seg_stores_backward(const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                                     const void *x, const float *acts, int B, int n, const lm_mla_seg *seg, float *dx,
                                     const lm_mla_params *g, float *scratch) {
    if (!seg) return lm_error(LM_ERR_ARG, "mla segment stores backward: seg is NULL");
    return mla_backward(c, p, pl, x, acts, NULL, NULL, B, n, dx, g, scratch, seg, 1);
}

lm_status lm_mla_backward(const lm_mla_config *c, const lm_mla_params *p, const float *x, const float *acts,
                          const float *dy, int B, int T, float *dx, const lm_mla_params *g, float *scratch) {
    if (lp_separate(c)) return lm_error(LM_ERR_ARG, "mla backward: this backend needs lm_mla_backward_lp");
    return lm_mla_backward_lp(c, p, p, x, acts, dy, NULL, B, T, dx, g, scratch);
}

#undef MM_F
#undef MM_B
#undef RMS_F
#undef RMS_B

/* ---------------------------------------------------------------- decode */

size_t lm_mla_cache_floats(const lm_mla_config *c, int B, int max_T) {
    const size_t n = (size_t)B * max_T;
    if (c->kind == LM_ATTN_MLA) return n * (c->kv_lora + c->rope_dims);
    return n * c->n_kv_heads * (c->head_dim_qk + c->head_dim_v);
}

lm_status lm_mla_cache_init(const lm_mla_config *c, lm_mla_cache *cache, int B, int max_T,
                            float *mem) {
    lm_status st = lm_mla_check(c);
    if (st) return st;
    if (!cache || !mem) return lm_error(LM_ERR_ARG, "mla cache_init: cache and memory are required");
    if (B < 1 || max_T < 1)
        return lm_error(LM_ERR_ARG, "mla cache_init: B=%d and max_T=%d must be >= 1", B, max_T);
    cache->B = B, cache->max_T = max_T, cache->len = 0;
    if (c->kind == LM_ATTN_MLA) {
        cache->row = c->kv_lora + c->rope_dims;
        cache->kv = mem, cache->v = NULL;
    } else {
        cache->row = c->n_kv_heads * c->head_dim_qk;
        cache->kv = mem;
        cache->v = mem + (size_t)B * max_T * cache->row;
    }
    return LM_OK;
}

typedef struct {
    size_t ql, qn, q, kvl, lat, kr, k, v, gp, o, qa, ob, scores, total;
} decode_layout;

static decode_layout layout_decode(const lm_mla_config *c, int B, int max_T) {
    const size_t H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v, r = c->rope_dims;
    const int mla = c->kind == LM_ATTN_MLA;
    const size_t ql = mla ? c->q_lora : 0, kl = mla ? c->kv_lora : 0;
    const size_t Hkv = mla ? 0 : c->n_kv_heads;
    decode_layout s;
    size_t off = 0;
#define PLACE(f, n) (s.f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */
    PLACE(ql, B * ql);
    PLACE(qn, B * ql);
    PLACE(q, B * H * Dk);
    PLACE(kvl, B * kl);
    PLACE(lat, B * kl);
    PLACE(kr, mla ? B * r : 0);
    PLACE(k, B * Hkv * Dk);
    PLACE(v, B * Hkv * Dv);
    PLACE(gp, B * H * Dv);
    PLACE(o, B * H * Dv);
    PLACE(qa, mla ? B * H * (kl + r) : 0); /* absorbed queries */
    PLACE(ob, B * H * kl);                 /* per-head outputs in the latent space */
    PLACE(scores, (size_t)B * H * max_T);
#undef PLACE
    s.total = off;
    return s;
}

size_t lm_mla_decode_scratch_floats(const lm_mla_config *c, int B, int max_T) {
    return layout_decode(c, B, max_T).total;
}

lm_status lm_mla_prefill(const lm_mla_config *c, const lm_mla_params *p, lm_mla_cache *cache,
                         const float *x, int T, float *y, float *acts) {
    // x (B,T,d) -> y (B,T,d); the cache receives T tokens per sequence
    if (!cache) return lm_error(LM_ERR_ARG, "mla prefill: cache is NULL");
    if (cache->len != 0) return lm_error(LM_ERR_ARG, "mla prefill: cache already holds %d tokens", cache->len);
    if (T > cache->max_T)
        return lm_error(LM_ERR_ARG, "mla prefill: T=%d exceeds the cache's max_T=%d", T, cache->max_T);
    const int B = cache->B;
    lm_status st = lm_mla_forward(c, p, x, B, T, y, acts);
    if (st) return st;
    acts_layout L = layout_acts(c, B, T);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const size_t i = (size_t)b * T + t, slot = (size_t)b * cache->max_T + t;
            if (c->kind == LM_ATTN_MLA) {
                float *row = cache->kv + slot * cache->row;
                memcpy(row, acts + L.c + i * c->kv_lora, (size_t)c->kv_lora * sizeof(float));
                if (c->rope_dims)
                    memcpy(row + c->kv_lora, acts + L.kr + i * c->rope_dims,
                           (size_t)c->rope_dims * sizeof(float));
            } else {
                const size_t kw = (size_t)c->n_kv_heads * c->head_dim_qk;
                const size_t vw = (size_t)c->n_kv_heads * c->head_dim_v;
                memcpy(cache->kv + slot * kw, acts + L.k + i * kw, kw * sizeof(float));
                memcpy(cache->v + slot * vw, acts + L.v + i * vw, vw * sizeof(float));
            }
        }
    cache->len = T;
    return LM_OK;
}

/* One query against n cached rows: out[0:dv] = softmax(scale q.keys) vals, fp32. */
static void decode_attend(float *out, const float *qv, int dk, const float *keys, size_t kstride,
                          const float *vals, size_t vstride, int dv, int n, float scale,
                          float *scores) {
    float mx = -INFINITY;
    for (int s = 0; s < n; s++) {
        const float *kr = keys + (size_t)s * kstride;
        float dot = 0.0f;
        for (int i = 0; i < dk; i++) dot += qv[i] * kr[i];
        scores[s] = scale * dot;
        mx = scores[s] > mx ? scores[s] : mx;
    }
    float sum = 0.0f;
    for (int s = 0; s < n; s++) sum += (scores[s] = expf(scores[s] - mx));
    for (int e = 0; e < dv; e++) out[e] = 0.0f;
    for (int s = 0; s < n; s++) {
        const float pr = scores[s] / sum, *vr = vals + (size_t)s * vstride;
        for (int e = 0; e < dv; e++) out[e] += pr * vr[e];
    }
}

lm_status lm_mla_decode_step(const lm_mla_config *c, const lm_mla_params *p,
                             lm_mla_cache *cache, const float *x, float *y, float *scratch) {
    // x (B,d) -> y (B,d) at position cache->len; scratch (lm_mla_decode_scratch_floats)
    if (!cache) return lm_error(LM_ERR_ARG, "mla decode: cache is NULL");
    const int B = cache->B;
    lm_status st = check_run(c, p, B, 1);
    if (st) return st;
    if (!x || !y || !scratch) return lm_error(LM_ERR_ARG, "mla decode: x, y and scratch are required");
    if (cache->len >= cache->max_T)
        return lm_error(LM_ERR_ARG, "mla decode: cache is full (max_T=%d)", cache->max_T);
    const int d = c->d_model, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v;
    const int r = c->rope_dims, Dn = Dk - r, pos = cache->len, n = pos + 1;
    const float scale = c->scale > 0 ? c->scale : 1.0f / sqrtf((float)Dk);
    decode_layout S = layout_decode(c, B, cache->max_T);
    float *q = scratch + S.q, *gp = scratch + S.gp, *o = scratch + S.o, *scores = scratch + S.scores;
    if (c->kind == LM_ATTN_MLA) {
        const int kl = c->kv_lora, row = cache->row;
        float *ql = scratch + S.ql, *qn = scratch + S.qn, *kvl = scratch + S.kvl;
        float *lat = scratch + S.lat, *kr = scratch + S.kr, *qa = scratch + S.qa, *ob = scratch + S.ob;
        lm_matmul_forward(ql, x, p->W_dq, NULL, B, d, c->q_lora);
        lm_rmsnorm_forward(qn, NULL, ql, p->q_norm, B, c->q_lora, c->norm_eps);
        lm_matmul_forward(q, qn, p->W_uq, NULL, B, c->q_lora, H * Dk);
        lm_matmul_forward(kvl, x, p->W_dkv, NULL, B, d, kl);
        lm_rmsnorm_forward(lat, NULL, kvl, p->kv_norm, B, kl, c->norm_eps);
        if (r) {
            lm_matmul_forward(kr, x, p->W_kr, NULL, B, d, r);
            rope_apply(kr, B, 1, 1, r, r, c->rope_base, pos, 0);
            rope_apply(q, B, 1, H, Dk, r, c->rope_base, pos, 0);
        }
        for (int b = 0; b < B; b++) {
            float *dst = cache->kv + ((size_t)b * cache->max_T + pos) * row;
            memcpy(dst, lat + (size_t)b * kl, (size_t)kl * sizeof(float));
            if (r) memcpy(dst + kl, kr + (size_t)b * r, (size_t)r * sizeof(float));
        }
        // absorbed attention in the latent space: score = [W_uk,h^T q_nope ; q_rope] . [c ; kr]
#pragma omp parallel for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            const int b = bh / H, h = bh % H;
            const float *qh = q + (size_t)bh * Dk;
            float *qah = qa + (size_t)bh * row, *obh = ob + (size_t)bh * kl;
            for (int l = 0; l < kl; l++) qah[l] = 0.0f;
            for (int i = 0; i < Dn; i++) {
                const float *w = p->W_uk + ((size_t)h * Dn + i) * kl;
                for (int l = 0; l < kl; l++) qah[l] += qh[i] * w[l];
            }
            for (int i = 0; i < r; i++) qah[kl + i] = qh[Dn + i];
            const float *base = cache->kv + (size_t)b * cache->max_T * row;
            decode_attend(obh, qah, row, base, row, base, row, kl, n, scale,
                          scores + (size_t)bh * cache->max_T);
            // o_h = W_uv,h (sum_s p_s c_s)
            float *oh = o + (size_t)bh * Dv;
            for (int e = 0; e < Dv; e++) {
                const float *w = p->W_uv + ((size_t)h * Dv + e) * kl;
                float s = 0.0f;
                for (int l = 0; l < kl; l++) s += w[l] * obh[l];
                oh[e] = s;
            }
        }
    } else {
        const int Hkv = c->n_kv_heads, G = H / Hkv;
        float *k = scratch + S.k, *v = scratch + S.v;
        lm_matmul_forward(q, x, p->W_q, NULL, B, d, H * Dk);
        lm_matmul_forward(k, x, p->W_k, NULL, B, d, Hkv * Dk);
        lm_matmul_forward(v, x, p->W_v, NULL, B, d, Hkv * Dv);
        rope_apply(q, B, 1, H, Dk, r, c->rope_base, pos, 0);
        rope_apply(k, B, 1, Hkv, Dk, r, c->rope_base, pos, 0);
        const size_t kw = (size_t)Hkv * Dk, vw = (size_t)Hkv * Dv;
        for (int b = 0; b < B; b++) {
            memcpy(cache->kv + ((size_t)b * cache->max_T + pos) * kw, k + b * kw, kw * sizeof(float));
            memcpy(cache->v + ((size_t)b * cache->max_T + pos) * vw, v + b * vw, vw * sizeof(float));
        }
#pragma omp parallel for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            const int b = bh / H, hk = (bh % H) / G;
            const float *keys = cache->kv + (size_t)b * cache->max_T * kw + (size_t)hk * Dk;
            const float *vals = cache->v + (size_t)b * cache->max_T * vw + (size_t)hk * Dv;
            decode_attend(o + (size_t)bh * Dv, q + (size_t)bh * Dk, Dk, keys, kw, vals, vw, Dv, n,
                          scale, scores + (size_t)bh * cache->max_T);
        }
    }
    // y = W_o (sigmoid(W_g x) * o)
    lm_matmul_forward(gp, x, p->W_g, NULL, B, d, H * Dv);
    for (size_t i = 0; i < (size_t)B * H * Dv; i++) o[i] *= lm_sigmoidf(gp[i]);
    lm_matmul_forward(y, o, p->W_o, NULL, B, H * Dv, d);
    cache->len++;
    return LM_OK;
}

float *lm_mla_acts_rowmax(const lm_mla_config *c, float *acts, int B, int T) { return acts + layout_acts(c, B, T).rowmax; }

lm_status lm_mla_max_logits(const lm_mla_config *c, const float *acts, int B, int T, float *smax) {
    // acts from lm_mla_forward -> smax (H): the largest scaled q.k logit of each head
    lm_status st = lm_mla_check(c);
    if (st) return st;
    const acts_layout L = layout_acts(c, B, T);
    const int H = c->n_heads;
    const float *rm = acts + L.rowmax; /* [B,H,T] */
    for (int h = 0; h < H; h++) {
        float mx = -INFINITY;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                float v = rm[((size_t)b * H + h) * T + t];
                mx = v > mx ? v : mx;
            }
        smax[h] = mx;
    }
    return LM_OK;
}
