/* The whole model: planning, initialisation, forward, backward
 * (include/longmoe/model.h, docs/model.md). */
#include "longmoe/model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/attention.h"
#include "longmoe/attnres.h"
#include "longmoe/kda_layer.h"
#include "longmoe/kda_layer_context_parallel.h"
#include "longmoe/linear.h"
#include "longmoe/mla.h"
#include "longmoe/mla_context_parallel.h"
#include "longmoe/moe.h"
#include "longmoe/optim_device.h"
#include "model_internal.h"


/* ---- tensor table ---- */

static lm_status add_tensor(lm_model *m, const char *name, int ndim, int64_t s0, int64_t s1, int64_t s2,
                            lm_param_kind kind, int n_blocks, float mean, float std, size_t *offset) {
    if (m->n_tensors == m->cap_tensors) {
        int cap = m->cap_tensors ? 2 * m->cap_tensors : 64;
        lm_model_tensor *t = realloc(m->tensors, (size_t)cap * sizeof *t);
        if (!t) return lm_error(LM_ERR_MEMORY, "out of memory planning the model");
        m->tensors = t;
        m->cap_tensors = cap;
    }
    lm_model_tensor *t = &m->tensors[m->n_tensors++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = s0;
    t->shape[1] = s1;
    t->shape[2] = s2;
    t->numel = (size_t)s0 * (size_t)(ndim > 1 ? s1 : 1) * (size_t)(ndim > 2 ? s2 : 1);
    t->offset = m->n_params;
    t->kind = kind;
    t->n_blocks = n_blocks;
    t->init_mean = mean;
    t->init_std = std;
    m->n_params += t->numel;
    if (offset) *offset = t->offset;
    return LM_OK;
}

static float fan_in_std(int64_t fan_in) { return (float)(1.0 / sqrt((double)fan_in)); }

static lm_status plan_kda(lm_model *m, int l, layer_state *ls) {
    const lm_config *c = &m->cfg;
    lm_kda_layer_config kc = {c->d_model, c->kda_heads, c->kda_head_dim, c->kda_conv_width, c->kda_chunk,
                              c->kda_gate_softplus ? LM_KDA_GATE_SOFTPLUS : LM_KDA_GATE_BOUNDED,
                              c->kda_g_min, c->norm_eps, NULL, 0, m->be};
    ls->kda_cfg = kc;
    lm_tensor_spec specs[LM_KDA_LAYER_NPARAMS];
    lm_kda_layer_specs(&kc, specs);
    ls->mixer_off = m->n_params;
    for (int i = 0; i < LM_KDA_LAYER_NPARAMS; i++) {
        char name[96];
        snprintf(name, sizeof name, "layers.%d.kda.%s", l, specs[i].name);
        int matrix = specs[i].role == LM_ROLE_MATRIX;
        int is_vec = specs[i].cols == 1;
        float std = matrix ? fan_in_std(specs[i].cols) : specs[i].init_std;
        if (matrix && !strcmp(specs[i].name, "W_o")) std /= sqrtf(2.0f * c->n_layers);
        TRY(add_tensor(m, name, is_vec ? 1 : 2, specs[i].rows, specs[i].cols, 0,
                       matrix ? LM_PARAM_MATRIX : (strcmp(specs[i].name, "o_norm") ? LM_PARAM_VECTOR : LM_PARAM_NORM),
                       specs[i].heads, specs[i].init_value, std, NULL));
    }
    return LM_OK;
}

static lm_status plan_mla(lm_model *m, int l, layer_state *ls) {
    const lm_config *c = &m->cfg;
    lm_mla_config mc = c->attn_kind == LM_ATTN_MLA
                           ? lm_mla_config_mla(c->d_model, c->attn_heads, c->qk_head_dim, c->v_head_dim,
                                               c->q_lora_rank, c->kv_lora_rank)
                           : lm_mla_config_gqa(c->d_model, c->attn_heads, c->attn_kv_heads, c->qk_head_dim,
                                               c->v_head_dim);
    mc.rope_dims = c->rope_dims;
    mc.norm_eps = c->norm_eps;
    mc.backend = m->be;
    TRY(lm_mla_check(&mc));
    ls->mla_cfg = mc;
    ls->mixer_off = m->n_params;
    int64_t d = c->d_model, H = c->attn_heads, Dk = c->qk_head_dim, Dv = c->v_head_dim, r = c->rope_dims;
    int64_t ql = c->q_lora_rank, kl = c->kv_lora_rank, Hkv = c->attn_kv_heads;
    struct { const char *name; int64_t rows, cols; lm_param_kind kind; int heads; } t[13];
    int n = 0;
#define T_(nm, R, C, K, Hh) (t[n].name = nm, t[n].rows = R, t[n].cols = C, t[n].kind = K, t[n].heads = Hh, n++)
    if (mc.kind == LM_ATTN_MLA) {
        T_("W_dq", ql, d, LM_PARAM_MATRIX, 1);
        T_("q_norm", ql, 1, LM_PARAM_NORM, 1);
        T_("W_uq", H * Dk, ql, LM_PARAM_MATRIX, (int)H);
        T_("W_dkv", kl, d, LM_PARAM_MATRIX, 1);
        T_("kv_norm", kl, 1, LM_PARAM_NORM, 1);
        T_("W_uk", H * (Dk - r), kl, LM_PARAM_MATRIX, (int)H);
        T_("W_uv", H * Dv, kl, LM_PARAM_MATRIX, (int)H);
        if (r) T_("W_kr", r, d, LM_PARAM_MATRIX, 1);
    } else {
        T_("W_q", H * Dk, d, LM_PARAM_MATRIX, (int)H);
        T_("W_k", Hkv * Dk, d, LM_PARAM_MATRIX, (int)Hkv);
        T_("W_v", Hkv * Dv, d, LM_PARAM_MATRIX, (int)Hkv);
    }
    T_("W_g", H * Dv, d, LM_PARAM_MATRIX, 1);
    T_("W_o", d, H * Dv, LM_PARAM_MATRIX, 1);
#undef T_
    for (int i = 0; i < n; i++) {
        char name[96];
        snprintf(name, sizeof name, "layers.%d.mla.%s", l, t[i].name);
        int norm = t[i].kind == LM_PARAM_NORM;
        float std = norm ? 0 : fan_in_std(t[i].cols);
        if (!strcmp(t[i].name, "W_o")) std /= sqrtf(2.0f * c->n_layers);
        TRY(add_tensor(m, name, norm ? 1 : 2, t[i].rows, t[i].cols, 0, t[i].kind, t[i].heads,
                       norm ? 1.0f : 0.0f, std, NULL));
    }
    if (m->n_params - ls->mixer_off != lm_mla_param_count(&mc))
        return lm_error(LM_ERR_ARG, "internal: MLA parameter table disagrees with lm_mla_param_count");
    return LM_OK;
}

static lm_status plan_ffn(lm_model *m, int l, layer_state *ls) {
    const lm_config *c = &m->cfg;
    int64_t d = c->d_model;
    char name[96];
    ls->ffn_off = m->n_params;
    if (!ls->moe) {
        int64_t f = c->dense_ffn;
        snprintf(name, sizeof name, "layers.%d.ffn.W_gate", l);
        TRY(add_tensor(m, name, 2, f, d, 0, LM_PARAM_MATRIX, 1, 0, fan_in_std(d), NULL));
        snprintf(name, sizeof name, "layers.%d.ffn.W_up", l);
        TRY(add_tensor(m, name, 2, f, d, 0, LM_PARAM_MATRIX, 1, 0, fan_in_std(d), NULL));
        snprintf(name, sizeof name, "layers.%d.ffn.W_down", l);
        TRY(add_tensor(m, name, 2, d, f, 0, LM_PARAM_MATRIX, 1, 0,
                       fan_in_std(f) / sqrtf(2.0f * c->n_layers), NULL));
        return LM_OK;
    }
    lm_moe_config mc = lm_moe_config_default(c->d_model, c->n_routed_experts, c->top_k, c->expert_ffn);
    mc.d_latent = c->latent_dim;
    mc.n_shared = c->n_shared_experts;
    mc.d_ff_shared = c->shared_ffn;
    mc.act = c->activation == LM_ACT_SITU ? LM_EXPERT_SITU_GLU : LM_EXPERT_SWIGLU;
    mc.route_scale = c->route_scale;
    mc.norm_eps = c->norm_eps;
    TRY(lm_moe_check(&mc));
    ls->moe_cfg = mc;
    int64_t n = mc.n_experts, f = mc.d_ff, de = mc.d_latent ? mc.d_latent : d, dl = mc.d_latent;
    int64_t ns = mc.n_shared, fs = mc.d_ff_shared;
    float down_scale = 1.0f / sqrtf(2.0f * c->n_layers);
#define ADD(nm, nd, a, b, cc, kind, blocks, mean, std)                                  \
    do {                                                                                \
        snprintf(name, sizeof name, "layers.%d.moe.%s", l, nm);                         \
        TRY(add_tensor(m, name, nd, a, b, cc, kind, blocks, mean, std, NULL));         \
    } while (0)
    ADD("router", 2, n, d, 0, LM_PARAM_MATRIX, 1, 0, fan_in_std(d));
    ADD("gate", 3, n, f, de, LM_PARAM_MATRIX, (int)n, 0, fan_in_std(de));
    ADD("up", 3, n, f, de, LM_PARAM_MATRIX, (int)n, 0, fan_in_std(de));
    ADD("down", 3, n, de, f, LM_PARAM_MATRIX, (int)n, 0, fan_in_std(f) * down_scale);
    if (dl) {
        ADD("lat_down", 2, dl, d, 0, LM_PARAM_MATRIX, 1, 0, fan_in_std(d));
        ADD("lat_norm", 1, dl, 0, 0, LM_PARAM_NORM, 1, 1.0f, 0);
        ADD("lat_up", 2, d, dl, 0, LM_PARAM_MATRIX, 1, 0, fan_in_std(dl) * down_scale);
    }
    if (ns) {
        ADD("shared_gate", 3, ns, fs, d, LM_PARAM_MATRIX, (int)ns, 0, fan_in_std(d));
        ADD("shared_up", 3, ns, fs, d, LM_PARAM_MATRIX, (int)ns, 0, fan_in_std(d));
        ADD("shared_down", 3, ns, d, fs, LM_PARAM_MATRIX, (int)ns, 0, fan_in_std(fs) * down_scale);
    }
#undef ADD
    if (m->n_params - ls->ffn_off != lm_moe_param_count(&mc))
        return lm_error(LM_ERR_ARG, "internal: MoE parameter table disagrees with lm_moe_param_count");
    return LM_OK;
}

static size_t dense_ffn_scratch(const lm_config *c, int64_t N) { return 3 * (size_t)N * (size_t)c->dense_ffn; }

/* n floats rounded up to 16 (64 bytes): the start of every planned buffer */
#define PAD16(n) (((size_t)(n) + 15) & ~(size_t)15)

/* The product-format view of a parameter view into m->P (the same offset in m->PL). */
static float *lp_param(const lm_model *m, const float *p) {
    return p ? (float *)((char *)m->PL + (size_t)(p - m->P) * m->be->lp_bytes) : NULL;
}

/* The gradient of the parameter at offset `off` of the parameter block in
 * the gradient block G (m->G or m->grads), whose layout leaves out what the
 * cuts of lm_model_keep_expert_grads drop: NULL there (another rank's
 * experts). */
static float *grad_in(const lm_model *m, float *G, size_t off) { return lm_model_cut_at(m, G, off); }

/* The same in the gradient block the ops write. */
static float *grad_at(const lm_model *m, size_t off) { return grad_in(m, m->G, off); }

/* The cut of the tensor at parameter offset `offset` (NULL: kept whole). */
static const struct gcut *gcut_of(const lm_model *m, size_t offset) {
    for (int i = 0; i < m->n_gcuts; i++)
        if (m->gcuts[i].offset == offset) return &m->gcuts[i];
    return NULL;
}

/* The parameter at offset `off` of the whole layout in the block the ops read
 * (m->P; NULL where owner-only expert weights drop it). */
static float *par_at(const lm_model *m, size_t off) { return m->pcut ? lm_model_cut_at(m, m->P, off) : m->P + off; }

/* The gradient view of a parameter view into m->P (a cut parameter block has
 * the gradient block's layout: the same place). */
static float *grad_param(const lm_model *m, const float *p) {
    if (!p) return NULL;
    return m->pcut ? m->G + (p - m->P) : grad_at(m, (size_t)(p - m->P));
}

/* Map every pointer of a params struct (lm_kda_layer_params, lm_mla_params,
 * lm_moe_params: structs of float pointers only) from m->P to m->PL or m->G. */
static void map_views(const lm_model *m, const void *src, void *dst, size_t bytes, int grads) {
    float *const *from = src;
    float **to = dst;
    for (size_t i = 0; i < bytes / sizeof(float *); i++) to[i] = grads ? grad_param(m, from[i]) : lp_param(m, from[i]);
}

/* The lp view of an fp32 buffer: the buffer itself when the product format is fp32. */
static void *lp_or(const lm_model *m, float *f32, void *lp) { return m->sep ? lp : (void *)f32; }

/* Add a named buffer of `bytes` to the model's ledger (lm_model_buffer_at). */
static lm_status ledger_add(lm_model *m, size_t bytes, const char *fmt, ...) {
    if (m->n_buffers == m->cap_buffers) {
        int cap = m->cap_buffers ? 2 * m->cap_buffers : 32;
        lm_model_buffer *b = realloc(m->buffers, (size_t)cap * sizeof *b);
        if (!b) return lm_error(LM_ERR_MEMORY, "out of memory planning the model");
        m->buffers = b;
        m->cap_buffers = cap;
    }
    lm_model_buffer *b = &m->buffers[m->n_buffers++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->name, sizeof b->name, fmt, ap);
    va_end(ap);
    b->bytes = bytes;
    return LM_OK;
}

/* The activation block, buffer by buffer: with base NULL it names every buffer
 * in the ledger and returns the floats of the block; with the block it points
 * the model's buffers into it (the same order, the same sizes). Every buffer
 * starts on a 64-byte boundary (PAD16 floats): GPU kernels move 16 bytes at a time. */
/* Whether sublayer idx reads its normalised input in fp32: where the product
 * format is a separate copy (bf16 on the GPU) only the MoE does (its fp32
 * router); the mixers and the dense FFN read the copy alone. */
static int xn_f32_needed(const lm_model *m, int idx) {
    return !m->sep || (idx % 2 == 1 && lm_config_is_moe(&m->cfg, idx / 2));
}

/* Whether the backward repeats sublayer idx's forward (train.recompute: all, the channel or the token mixers). */
static int rc_sub(const lm_model *m, int idx) { return lm_recompute_sublayer(m->cfg.recompute, idx); }

/* The kept normalised sublayer inputs, the product-format copies (f32 = 0)
 * or the fp32 ones (f32 = 1: only where xn_f32_needed): the recomputed
 * sublayers share slot 0 (the backward forms each one's input again before
 * its own backward), every other sublayer has a slot of its own. The slot of
 * sublayer idx; idx = L2 gives the number of slots. */
static int xn_slot(const lm_model *m, int idx, int f32) {
    int shared = 0, k = 0;
    for (int i = 0; i < m->L2; i++) shared |= rc_sub(m, i) && (!f32 || xn_f32_needed(m, i));
    if (idx < m->L2 && rc_sub(m, idx)) return 0;
    for (int i = 0; i < idx; i++) k += !rc_sub(m, i) && (!f32 || xn_f32_needed(m, i));
    return shared + k;
}

static size_t plan_activations(lm_model *m, float *base) {
    const lm_config *cfg = &m->cfg;
    const int64_t N = m->N, C = m->chunk;
    const int64_t d = m->d, V = cfg->vocab_size;
    const int B = m->B, T = m->T, L2 = m->L2;
    size_t off = 0;
    /* with recompute, the sublayers of one kind share one activation buffer:
     * the backward recomputes each sublayer's forward from its saved input;
     * the normalised input is recomputed too, and with recompute_chunk the
     * input itself (from the residual state) */
    const size_t n_xn = (size_t)xn_slot(m, L2, 1), n_hin = m->fuse_norm ? 0 : m->lean_hin ? 1 : (size_t)L2;
#define CARVE(ptr, n, ...)                                                       \
    do {                                                                         \
        size_t n_ = (n);                                                         \
        if (base) (ptr) = base + off;                                            \
        else (void)ledger_add(m, PAD16(n_) * sizeof(float), __VA_ARGS__);        \
        off += PAD16(n_);                                                        \
    } while (0)
    if (n_hin)
        CARVE(m->hin, n_hin * N * d,
              n_hin > 1 ? "hin: sublayer inputs [2L,N,d]" : "hin: sublayer input [N,d] (recomputed)");
    if (n_xn)
        CARVE(m->xn, n_xn * N * d,
              cfg->recompute == LM_RECOMPUTE_ALL ? "xn: normalised sublayer input [N,d] (recomputed)"
              : cfg->recompute                   ? "xn: normalised sublayer inputs, one shared by the recomputed "
                                                   "sublayers, one each kept [%zu,N,d]"
              : m->sep ? "xn: normalised MoE sublayer inputs, fp32 for the router [MoE layers,N,d]"
                       : "xn: normalised sublayer inputs [2L,N,d]",
              n_xn);
    CARVE(m->rstd, (size_t)L2 * N, "rstd: sublayer norms' 1/rms [2L,N]");
    CARVE(m->hf, (size_t)N * d, "hf: final residual [N,d]");
    CARVE(m->hn, (size_t)N * d, "hn: final norm [N,d]");
    CARVE(m->rstd_final, (size_t)N, "rstd_final [N]");
    CARVE(m->lse_rows, (size_t)N, "lse_rows [N]");
    CARVE(m->target_logit, (size_t)N, "target_logit [N]");
    CARVE(m->row_scale, (size_t)N, "row_scale [N]");
    /* buffers whose lifetimes do not overlap share memory: the embedding
     * output lives until the residual state copies it, before the first
     * sublayer output; the final norm's gradients are consumed before the
     * sublayers' backward starts; the embedding's gradient comes after it */
    CARVE(m->y, (size_t)N * d, "y: sublayer output, x0: embedding output [N,d]");
    CARVE(m->dy, (size_t)N * d, "dy, dx0 [N,d]");
    CARVE(m->dxn, (size_t)N * d, "dxn, dhn [N,d]");
    CARVE(m->dh, (size_t)N * d, "dh, dhf [N,d]");
    if (base) {
        m->x0 = m->y;
        m->dx0 = m->dy;
        m->dhn = m->dxn;
        m->dhf = m->dh;
    }
    size_t ce_floats = (m->be->ops->cross_entropy_work_bytes(m->be, N, (int)d, (int)V) + sizeof(float) - 1) /
                       sizeof(float);
    CARVE(m->logits, ce_floats, "LM head logits (one chunk of rows)");
    /* evaluation's per-position scores where they come back from a device (lm_model_score) */
    if (m->be->device != LM_DEVICE_CPU) {
        float *nll = NULL, *arg = NULL;
        CARVE(nll, 2 * (size_t)N, "evaluation scores: nll [N] double");
        CARVE(arg, (size_t)N, "evaluation scores: argmax [N] int32");
        if (base) m->score_nll = (double *)nll, m->score_arg = (int32_t *)arg;
    }
    int n_kda = 0, n_mla = 0, n_ffn = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        n_kda += m->layers[l].mixer == LM_MIXER_KDA;
        n_mla += m->layers[l].mixer == LM_MIXER_MLA;
        n_ffn += !m->layers[l].moe;
    }
    size_t scratch = 0;
    layer_state *first_kda = NULL, *first_mla = NULL, *first_ffn = NULL;
    for (int l = 0; l < cfg->n_layers; l++) {
        layer_state *ls = &m->layers[l];
        /* the recomputed kind's layers share one set (the token mixers: even sublayers, the channel mixers: odd) */
        const int share = rc_sub(m, 2 * l), share_ch = rc_sub(m, 2 * l + 1);
        if (base && !m->seg_on) ls->keep_o = NULL, ls->keep_lse = NULL;
        if (m->cp_ranks > 0) {
            /* context parallelism: the token mixer's segment activations only (the attention's
             * for its prefix too), one set per mixer kind with recompute */
            const int kda = ls->mixer == LM_MIXER_KDA;
            size_t a = kda ? lm_kda_layer_cp_lp_act_floats(&ls->kda_cfg, B, T)
                           : lm_mla_cp_lp_acts_floats(&ls->mla_cfg, B, m->cp_t0, T);
            size_t s = kda ? lm_kda_layer_cp_lp_scratch_floats(&ls->kda_cfg, m->cp_ranks, B, T)
                           : lm_mla_cp_lp_scratch_floats(&ls->mla_cfg, m->cp_ranks, B, m->cp_t0, T);
            scratch = s > scratch ? s : scratch;
            layer_state **first = kda ? &first_kda : &first_mla;
            if (*first && share) {
                ls->cp_acts = (*first)->cp_acts;
            } else {
                const int n_kind = kda ? n_kda : n_mla;
                if (share && n_kind > 1)
                    CARVE(ls->cp_acts, a, "%s segment activations, context parallel (shared by %d layers)",
                          kda ? "KDA" : "attention", n_kind);
                else
                    CARVE(ls->cp_acts, a, "layers.%d %s segment activations, context parallel", l,
                          kda ? "KDA" : "attention");
                *first = ls;
            }
        } else if (ls->mixer == LM_MIXER_KDA) {
            /* a segment's layer keeps the conv history rows too (lm_kda_layer_seg_acts_map) */
            size_t s = m->seg_on ? lm_kda_layer_seg_scratch_floats(&ls->kda_cfg, B, T)
                                 : lm_kda_layer_scratch_floats(&ls->kda_cfg, B, T);
            scratch = s > scratch ? s : scratch;
            if (first_kda && share) {
                ls->kda_a = first_kda->kda_a;
            } else {
                size_t n = m->seg_on ? lm_kda_layer_seg_act_floats(&ls->kda_cfg, B, T)
                                     : lm_kda_layer_act_floats(&ls->kda_cfg, B, T);
                if (base && m->seg_on) lm_kda_layer_seg_acts_map(&ls->kda_cfg, B, T, base + off, &ls->kda_a);
                else if (base) lm_kda_layer_acts_map(&ls->kda_cfg, B, T, base + off, &ls->kda_a);
                else if (share)
                    (void)ledger_add(m, PAD16(n) * sizeof(float), "KDA activations (shared by %d layers)", n_kda);
                else (void)ledger_add(m, PAD16(n) * sizeof(float), "layers.%d KDA activations", l);
                off += PAD16(n);
                /* the operator's forward intermediates, kept for its backward where the backend can
                 * (whole rows only: a segment's backward recomputes them from its carry) */
                size_t kb = m->seg_on ? 0 : lm_kda_layer_kept_bytes(&ls->kda_cfg, B, T);
                if (kb) {
                    float *kept = NULL;
                    if (share)
                        CARVE(kept, (kb + sizeof(float) - 1) / sizeof(float),
                              "KDA operator intermediates for the backward (shared by %d layers)", n_kda);
                    else
                        CARVE(kept, (kb + sizeof(float) - 1) / sizeof(float),
                              "layers.%d KDA operator intermediates for the backward", l);
                    if (base) ls->kda_a.kept = kept, ls->kda_a.kept_bytes = kb;
                }
                first_kda = ls;
            }
        } else {
            size_t s = lm_mla_scratch_floats(&ls->mla_cfg, B, T);
            scratch = s > scratch ? s : scratch;
            if (first_mla && share) {
                ls->mla_acts = first_mla->mla_acts;
            } else {
                if (share) CARVE(ls->mla_acts, lm_mla_acts_floats(&ls->mla_cfg, B, T),
                                 "attention activations (shared by %d layers)", n_mla);
                else CARVE(ls->mla_acts, lm_mla_acts_floats(&ls->mla_cfg, B, T), "layers.%d attention activations", l);
                first_mla = ls;
            }
            if ((share || m->replay) && !m->seg_on) {
                /* each layer's attention output for the recomputation and the Block AttnRes replay, which
                 * runs every sublayer of a block again (segments: plan_segments) */
                CARVE(ls->keep_o, lm_mla_keep_o_floats(&ls->mla_cfg, m->be->lp_bytes, B, T),
                      "layers.%d attention output kept for the recomputation [N,H,Dv]", l);
                CARVE(ls->keep_lse, lm_mla_keep_lse_floats(&ls->mla_cfg, B, T),
                      "layers.%d attention log-sum-exp kept for the recomputation [N,H]", l);
            }
        }
        if (!ls->moe) {
            /* the dense FFN runs C tokens at a time (C = N without recompute_chunk) */
            scratch = dense_ffn_scratch(cfg, C) > scratch ? dense_ffn_scratch(cfg, C) : scratch;
            if (first_ffn && share_ch) {
                ls->ffn_a = first_ffn->ffn_a;
                ls->ffn_u = first_ffn->ffn_u;
                ls->ffn_h = first_ffn->ffn_h;
            } else {
                CARVE(ls->ffn_a, (size_t)C * cfg->dense_ffn, "layers.%d dense FFN a [%lld tokens]%s", l, (long long)C,
                      share_ch && n_ffn > 1 ? " (shared)" : "");
                CARVE(ls->ffn_u, (size_t)C * cfg->dense_ffn, "layers.%d dense FFN u [%lld tokens]", l, (long long)C);
                CARVE(ls->ffn_h, (size_t)C * cfg->dense_ffn, "layers.%d dense FFN h [%lld tokens]", l, (long long)C);
                first_ffn = ls;
            }
        } else if (cfg->balance == LM_BALANCE_AUX) {
            CARVE(ls->dscores, (size_t)N * cfg->n_routed_experts, "layers.%d auxiliary loss dscores [N,n]", l);
        }
    }
    CARVE(m->scratch, scratch, "backward scratch (largest sublayer's)");
    m->scratch_floats = scratch;
    if (base) m->cp_scratch = m->cp_ranks > 0 ? m->scratch : NULL;
    /* one scratch for the KDA and attention operators (they run one at a time),
     * sized for this process's OpenMP thread count (the CPU's; a GPU's are the backend's) */
    size_t op_bytes = 0;
    for (int l = 0; l < cfg->n_layers && m->be->device == LM_DEVICE_CPU; l++) {
        const layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) {
            lm_kda_config kc = lm_kda_config_default(B, T, cfg->kda_heads, cfg->kda_head_dim, cfg->kda_head_dim);
            kc.chunk = cfg->kda_chunk;
            size_t b = lm_kda_workspace_bytes(&kc);
            op_bytes = b > op_bytes ? b : op_bytes;
        } else {
            const lm_mla_config *mc = &ls->mla_cfg;
            lm_attention_config ac = lm_attention_config_default(
                B, T, mc->n_heads, mc->kind == LM_ATTN_MLA ? mc->n_heads : mc->n_kv_heads, mc->head_dim_qk,
                mc->head_dim_v);
            size_t f = lm_attention_forward_workspace_bytes(&ac, 0), b = lm_attention_backward_workspace_bytes(&ac, 0);
            op_bytes = f > op_bytes ? f : op_bytes;
            op_bytes = b > op_bytes ? b : op_bytes;
        }
    }
    size_t op_floats = (op_bytes + sizeof(float) - 1) / sizeof(float);
    float *op_ws = NULL;
    CARVE(op_ws, op_floats, "KDA / attention operator workspace");
    if (base)
        for (int l = 0; l < cfg->n_layers; l++) {
            m->layers[l].kda_cfg.workspace = m->layers[l].mla_cfg.workspace = op_ws;
            m->layers[l].kda_cfg.workspace_bytes = m->layers[l].mla_cfg.workspace_bytes = op_floats * sizeof(float);
        }
#undef CARVE
    return off;
}

/* The sequence segments' memory (m->seg_on), as plan_activations: with base
 * NULL it names the buffers in the ledger and returns the floats; with the
 * block it points the layers' carries, stores and accumulators into it. */
static size_t plan_segments(lm_model *m, float *base) {
    const lm_config *cfg = &m->cfg;
    const size_t B = (size_t)m->B, Tq = (size_t)m->Tq, n1 = (size_t)m->n_seg - 1, lpb = m->be->lp_bytes;
    int n_kda = 0, n_kv = 0, n_lat = 0;
    size_t kst = 0, khalo = 0, KE = 0, VE = 0, HK = 0, HV = 0, kl = 0, r = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) {
            const lm_kda_layer_config *kc = &ls->kda_cfg;
            n_kda++;
            kst = B * kc->heads * kc->head_dim * kc->head_dim;
            khalo = 3 * B * (kc->conv_width - 1) * kc->heads * kc->head_dim;
            continue;
        }
        /* the attention's whole rows: its keys and values, or (MLA) its latent when that is smaller */
        const lm_mla_config *mc = &ls->mla_cfg;
        size_t ke, ve, kvb, latb;
        lm_mla_seg_row_elems(mc, &ke, &ve);
        lm_mla_seg_token_bytes(mc, lpb, &kvb, &latb);
        ls->seg_latent = mc->kind == LM_ATTN_MLA && latb < kvb;
        if (ls->seg_latent) {
            n_lat++;
            kl = (size_t)mc->kv_lora;
            r = (size_t)mc->rope_dims;
            HK = (size_t)mc->n_heads * mc->head_dim_qk > HK ? (size_t)mc->n_heads * mc->head_dim_qk : HK;
            HV = (size_t)mc->n_heads * mc->head_dim_v > HV ? (size_t)mc->n_heads * mc->head_dim_v : HV;
        } else {
            n_kv++;
        }
        KE = ke > KE ? ke : KE;
        VE = ve > VE ? ve : VE;
    }
    /* floats of n values in the product format */
#define LPF(n) PAD16(((size_t)(n) * lpb + sizeof(float) - 1) / sizeof(float))
    const size_t kst_f = PAD16(kst), khalo_f = PAD16(khalo);
    const size_t ks_f = LPF(B * Tq * KE), vs_f = LPF(B * Tq * VE), ka_f = PAD16(B * Tq * KE), va_f = PAD16(B * Tq * VE);
    const size_t cs_f = LPF(B * Tq * kl), krs_f = PAD16(B * Tq * r);
    const size_t kt_f = LPF(Tq * KE), vt_f = LPF(Tq * VE), kw_f = LPF(Tq * HK), vw_f = LPF(Tq * HV);
    size_t off = 0;
#define TAKE(n) (base && (n) ? (void *)(base + (off += (n)) - (n)) : (off += (n), (void *)NULL))
    for (int l = 0; l < cfg->n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) {
            ls->seg_h = TAKE(PAD16(n1 * kst));
            ls->seg_halo = TAKE(PAD16(n1 * khalo));
            for (int k = 0; k < 2; k++) {
                ls->seg_dh[k] = TAKE(kst_f);
                ls->seg_dhalo[k] = TAKE(khalo_f);
            }
            continue;
        }
        /* the attention's output and log-sum-exp of the whole rows, for the backward's forwards */
        ls->keep_o = TAKE(PAD16(lm_mla_keep_o_floats(&ls->mla_cfg, lpb, (int)B, (int)Tq)));
        ls->keep_lse = TAKE(PAD16(lm_mla_keep_lse_floats(&ls->mla_cfg, (int)B, (int)Tq)));
        if (ls->seg_latent) {
            ls->seg_c = TAKE(cs_f);
            ls->seg_dc = TAKE(PAD16(B * Tq * kl));
            ls->seg_kr = TAKE(r ? krs_f : 0);
            ls->seg_dkr = TAKE(r ? krs_f : 0);
        } else {
            ls->seg_k = TAKE(ks_f);
            ls->seg_v = TAKE(vs_f);
            ls->seg_dk = TAKE(ka_f);
            ls->seg_dv = TAKE(va_f);
        }
    }
    m->seg_ht_junk = TAKE(n_kda ? kst_f : 0);
    m->seg_dk_tmp = TAKE(n_kv + n_lat ? kt_f : 0);
    m->seg_dv_tmp = TAKE(n_kv + n_lat ? vt_f : 0);
    m->seg_k_work = TAKE(n_lat ? kw_f : 0);
    m->seg_v_work = TAKE(n_lat ? vw_f : 0);
#undef TAKE
    if (!base) {
        const size_t F = sizeof(float);
        if (n_kda) {
            (void)ledger_add(m, n_kda * PAD16(n1 * kst) * F,
                             "segments: KDA states at %zu segment starts, %d layers x [B,H,K,K] fp32", n1, n_kda);
            (void)ledger_add(m, n_kda * PAD16(n1 * khalo) * F,
                             "segments: KDA conv histories at %zu segment starts, %d layers x [3,B,W-1,HK]", n1, n_kda);
            (void)ledger_add(m, n_kda * 2 * (kst_f + khalo_f) * F + kst_f * F,
                             "segments: KDA state and history gradients, %d layers x 2", n_kda);
        }
        if (n_lat) {
            (void)ledger_add(m, n_lat * (cs_f + (r ? krs_f : 0)) * F,
                             "segments: MLA latents%s of the whole rows, %d layers x [B,T,%zu%s]",
                             r ? " and rotary keys" : "", n_lat, kl, r ? "+r" : "");
            (void)ledger_add(m, n_lat * (PAD16(B * Tq * kl) + (r ? krs_f : 0)) * F,
                             "segments: MLA latent gradient sums, %d layers x [B,T,%zu%s] fp32", n_lat, kl,
                             r ? "+r" : "");
            (void)ledger_add(m, (kw_f + vw_f) * F, "segments: one row's keys, values up-projected [T,H,Dk+Dv]");
        }
        if (n_kv) {
            (void)ledger_add(m, n_kv * (ks_f + vs_f) * F,
                             "segments: attention K, V of the whole rows, %d layers x [B,T,Hk,Dk+Dv]", n_kv);
            (void)ledger_add(m, n_kv * (ka_f + va_f) * F,
                             "segments: attention K, V gradient sums, %d layers x [B,T,Hk,Dk+Dv] fp32", n_kv);
        }
        if (n_kv + n_lat) {
            (void)ledger_add(m, (kt_f + vt_f) * F, "segments: one row's attention K, V gradients [T,Hk,Dk+Dv]");
            size_t keep_f = 0;
            for (int l = 0; l < cfg->n_layers; l++)
                if (m->layers[l].mixer != LM_MIXER_KDA)
                    keep_f += PAD16(lm_mla_keep_o_floats(&m->layers[l].mla_cfg, lpb, (int)B, (int)Tq)) +
                              PAD16(lm_mla_keep_lse_floats(&m->layers[l].mla_cfg, (int)B, (int)Tq));
            (void)ledger_add(m, keep_f * F,
                             "segments: attention outputs and log-sum-exp of the whole rows, kept for the "
                             "backward, %d layers x [B,T,H,Dv+1]",
                             n_kv + n_lat);
        }
    }
#undef LPF
    return off;
}

static lm_status model_build(const lm_config *cfg, int B, int T, lm_backend *backend, const lm_ops *plan_ops,
                             int xG, int xpos, lm_model **out);
static lm_status plan_expert_cuts(lm_model *m, int G, int pos);
static void bind_whole_expert_views(lm_model *m);
static void map_grad_views(lm_model *m);

lm_status lm_model_create(const lm_config *cfg, int B, int T, lm_model **out) {
    return lm_model_create_on(cfg, B, T, NULL, out);
}

lm_status lm_model_create_on(const lm_config *cfg, int B, int T, lm_backend *backend, lm_model **out) {
    return model_build(cfg, B, T, backend ? backend : lm_backend_cpu(), NULL, 0, 0, out);
}

lm_status lm_model_create_expert_owned(const lm_config *cfg, int B, int T, lm_backend *backend, int G, int pos,
                                       lm_model **out) {
    *out = NULL;
    if (G < 1 || pos < 0 || pos >= G)
        return lm_error(LM_ERR_ARG, "owner-only experts: position %d of a group of %d ranks is out of range", pos, G);
    return model_build(cfg, B, T, backend ? backend : lm_backend_cpu(), NULL, G, pos, out);
}

/* The ops a plan of `device` sizes its buffers with (NULL and an error: none). */
static const lm_ops *plan_ops_of(lm_device device) {
    if (device != LM_DEVICE_CPU && device != LM_DEVICE_CUDA) {
        lm_error(LM_ERR_ARG, "model plan: unknown device %d", (int)device);
        return NULL;
    }
    const lm_ops *ops = device == LM_DEVICE_CPU ? lm_backend_cpu()->ops : lm_backend_cuda_ops();
    if (!ops)
        lm_error(LM_ERR_ARG, "model plan: this build has no CUDA backend (nvcc was not found when it was "
                             "configured), so it cannot size the GPU's buffers");
    return ops;
}

lm_status lm_model_plan(const lm_config *cfg, int B, int T, lm_device device, lm_model **out) {
    *out = NULL;
    const lm_ops *ops = plan_ops_of(device);
    if (!ops) return LM_ERR_ARG;
    return model_build(cfg, B, T, NULL, ops, 0, 0, out);
}

lm_status lm_model_plan_expert_owned(const lm_config *cfg, int B, int T, lm_device device, int G, int pos,
                                     lm_model **out) {
    *out = NULL;
    if (G < 1 || pos < 0 || pos >= G)
        return lm_error(LM_ERR_ARG, "owner-only experts: position %d of a group of %d ranks is out of range", pos, G);
    const lm_ops *ops = plan_ops_of(device);
    if (!ops) return LM_ERR_ARG;
    return model_build(cfg, B, T, NULL, ops, G, pos, out);
}

/* Parameter and gradient block bytes allocated (add) or freed, and their peak. */
static void block_bytes(lm_model *m, size_t bytes, int add) {
    m->block_held = add ? m->block_held + bytes : m->block_held - bytes;
    m->block_peak = m->block_held > m->block_peak ? m->block_held : m->block_peak;
}

size_t lm_model_block_peak_bytes(const lm_model *m) { return m->block_peak; }

/* The MoE layer's parameters in lm_moe_params order (lm_moe_params_carve's,
 * which plan_ffn's table follows): each part's offset in the whole parameter
 * layout, (size_t)-1 for a part the config leaves out. */
static void moe_offsets(const lm_model *m, const layer_state *ls, size_t off[10]) {
    static const char *const part[10] = {"router", "gate", "up", "down", "lat_down", "lat_norm", "lat_up",
                                         "shared_gate", "shared_up", "shared_down"};
    int j = 0;
    while (j < m->n_tensors && m->tensors[j].offset != ls->ffn_off) j++;
    for (int k = 0; k < 10; k++) {
        const char *d = j < m->n_tensors ? strstr(m->tensors[j].name, ".moe.") : NULL;
        off[k] = d && !strcmp(d + 5, part[k]) ? m->tensors[j++].offset : (size_t)-1;
    }
}

/* A MoE layer's views into `block`, a block of the parameter layout (whole,
 * or cut when m->pcut): every part at its element's place, a routed expert
 * tensor at its first kept element when the cut keeps the tensor's start
 * (else NULL; bind_whole_expert_views then gives the whole views). */
static void moe_views_in(const lm_model *m, const layer_state *ls, float *block, lm_moe_params *p) {
    _Static_assert(sizeof(lm_moe_params) == 10 * sizeof(float *), "lm_moe_params is ten float pointers");
    size_t off[10];
    moe_offsets(m, ls, off);
    float **v = (float **)p;
    for (int k = 0; k < 10; k++)
        v[k] = off[k] == (size_t)-1 ? NULL : m->pcut ? lm_model_cut_at(m, block, off[k]) : block + off[k];
}

/* A model on `backend`, or (backend NULL) a plan only on a backend of `plan_ops`:
 * the tables and the ledger of buffers, no memory (lm_model_plan). xG > 0:
 * the parameter and gradient blocks hold only the routed experts' slice of
 * position xpos of xG ranks, and the rest whole, from the start
 * (lm_model_create_expert_owned). */
static lm_status model_build(const lm_config *cfg, int B, int T, lm_backend *backend, const lm_ops *plan_ops,
                             int xG, int xpos, lm_model **out) {
    *out = NULL;
    TRY(lm_config_validate(cfg));
    if (B < 1 || T < 1 || (int64_t)B * T > (1 << 26))
        return lm_error(LM_ERR_ARG, "model: batch %d x sequence %d tokens is out of range", B, T);
    lm_model *m = calloc(1, sizeof *m);
    if (!m) return lm_error(LM_ERR_MEMORY, "out of memory creating the model");
    lm_status st = LM_OK;
    m->cfg = *cfg;
    if (backend) {
        m->be = backend;
    } else {
        /* a backend of the device's kind that nothing allocates on: the plan asks its ops for sizes only */
        m->dry = 1;
        m->plan_be.device = plan_ops == lm_backend_cpu()->ops ? LM_DEVICE_CPU : LM_DEVICE_CUDA;
        m->plan_be.lp_bytes = m->plan_be.device == LM_DEVICE_CPU ? sizeof(float) : 2;
        m->plan_be.ops = plan_ops;
        m->be = &m->plan_be;
    }
    m->sep = m->be->lp_bytes != sizeof(float);
    m->B = B;
    m->T = T;
    m->N = (int64_t)B * T;
    m->Tq = T;
    m->Nq = m->N;
    /* sequence segments: the buffers hold S tokens of each row (S >= T: off, the whole rows) */
    if (cfg->seq_segment > 0 && cfg->seq_segment < T) {
        m->seg_on = 1;
        m->S = cfg->seq_segment;
        m->n_seg = (T + m->S - 1) / m->S;
        m->T = m->S;
        m->N = (int64_t)B * m->S;
    }
    /* per-token sublayers run `chunk` tokens at a time (train.recompute_chunk) */
    m->chunk = cfg->recompute_chunk > 0 && cfg->recompute_chunk < m->N ? cfg->recompute_chunk : m->N;
    m->lean_hin = cfg->recompute_chunk > 0 && cfg->residual != LM_RESIDUAL_STANDARD;
    m->d = cfg->d_model;
    m->L2 = 2 * cfg->n_layers;
    /* with recompute_chunk, Block AttnRes keeps the partial sums of one block
     * only and the backward replays each block's forward, where the backend can */
    m->replay = m->lean_hin && cfg->residual == LM_RESIDUAL_BLOCK_ATTNRES && m->be->ops->attnres_replay_block &&
                cfg->attnres_block > 1 && cfg->attnres_block < m->L2;
    const int64_t d = cfg->d_model, V = cfg->vocab_size, N = m->N;
    T = m->T;
    /* each sublayer's AttnRes input with its RMSNorm in one pass where the backend offers it:
     * then no sublayer input is stored (docs/attnres.md, "The input with its norm") */
    if (cfg->residual != LM_RESIDUAL_STANDARD && m->be->ops->attnres_norm_fusable &&
        m->be->ops->attnres_input_norm && m->be->ops->attnres_input_norm_backward) {
        lm_attnres_config fc = {(lm_attnres_mode)cfg->residual, m->L2, cfg->attnres_block, (int)d, N, cfg->norm_eps, 1,
                                0};
        m->fuse_norm = m->be->ops->attnres_norm_fusable(&fc);
    }
    m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->layers) {
        st = lm_error(LM_ERR_MEMORY, "out of memory creating the model");
        goto fail;
    }
    /* the parameter table (order = layout of the parameter block) */
    if ((st = add_tensor(m, "embed", 2, V, d, 0, LM_PARAM_EMBEDDING, 1, 0, 1.0f, &m->embed_off))) goto fail;
    for (int l = 0; l < cfg->n_layers; l++) {
        layer_state *ls = &m->layers[l];
        char name[96];
        ls->mixer = lm_config_mixer(cfg, l);
        ls->moe = lm_config_is_moe(cfg, l);
        snprintf(name, sizeof name, "layers.%d.mixer_norm", l);
        if ((st = add_tensor(m, name, 1, d, 0, 0, LM_PARAM_NORM, 1, 1.0f, 0, &ls->mixer_norm_off))) goto fail;
        if ((st = ls->mixer == LM_MIXER_KDA ? plan_kda(m, l, ls) : plan_mla(m, l, ls))) goto fail;
        snprintf(name, sizeof name, "layers.%d.ffn_norm", l);
        if ((st = add_tensor(m, name, 1, d, 0, 0, LM_PARAM_NORM, 1, 1.0f, 0, &ls->ffn_norm_off))) goto fail;
        if ((st = plan_ffn(m, l, ls))) goto fail;
    }
    m->has_attnres_params = cfg->residual != LM_RESIDUAL_STANDARD;
    if (m->has_attnres_params) {
        if ((st = add_tensor(m, "attnres.query", 2, m->L2 + 1, d, 0, LM_PARAM_VECTOR, 1, 0, 0, &m->ar_query_off)))
            goto fail;
        if ((st = add_tensor(m, "attnres.key_norm", 2, m->L2 + 1, d, 0, LM_PARAM_NORM, 1, 1.0f, 0, &m->ar_key_off)))
            goto fail;
    }
    if ((st = add_tensor(m, "final_norm", 1, d, 0, 0, LM_PARAM_NORM, 1, 1.0f, 0, &m->final_norm_off))) goto fail;
    if (!cfg->tie_embeddings &&
        (st = add_tensor(m, "lm_head", 2, V, d, 0, LM_PARAM_EMBEDDING, 1, 0, fan_in_std(d), &m->head_off)))
        goto fail;
    if (cfg->tie_embeddings) m->head_off = m->embed_off;

    /* owner-only experts from the start: the cut table of the routed experts
     * (the gradient block's and, pcut, the parameter block's layout) */
    m->n_grads = m->n_params;
    if (xG) {
        if ((st = plan_expert_cuts(m, xG, xpos))) goto fail;
        m->pcut = 1;
    }
    /* the ledger of backend buffers (lm_model_buffer_at) starts with the parameter blocks */
    const size_t kept = m->pcut ? m->n_grads : m->n_params;
    m->params_buffer = m->n_buffers;
    m->grads_buffer = m->n_buffers + 1;
    const int nx = cfg->n_routed_experts;
    if ((st = xG ? ledger_add(m, kept * sizeof(float), "parameters (fp32; of the routed experts only %d of %d a layer, "
                              "position %d of %d)", nx / xG, nx, xpos, xG)
                 : ledger_add(m, kept * sizeof(float), "parameters (fp32)")) ||
        (st = xG ? ledger_add(m, m->n_grads * sizeof(float), "gradients (fp32; of the routed experts only %d of %d a "
                              "layer, position %d of %d)", nx / xG, nx, xpos, xG)
                 : ledger_add(m, m->n_grads * sizeof(float), "gradients (fp32)")))
        goto fail;
    if (m->sep && (st = ledger_add(m, kept * m->be->lp_bytes, "parameters (product format copy%s)",
                                   xG ? "; the kept part" : "")))
        goto fail;
    if (!m->dry) {
        m->params = calloc(kept, sizeof(float));
        m->grads = calloc(m->n_grads, sizeof(float));
        if (!m->params || !m->grads) {
            st = lm_error(LM_ERR_MEMORY, "out of memory for %zu parameters (and %zu gradients)", kept, m->n_grads);
            goto fail;
        }
        block_bytes(m, (kept + m->n_grads) * sizeof(float), 1);
        /* what the ops read and write: the host arrays themselves on the CPU; on a
         * backend of its own memory, fp32 parameters and gradients there and a
         * product-format copy of the parameters */
        if (!m->sep && m->be->device == LM_DEVICE_CPU) {
            m->P = m->params;
            m->G = m->grads;
            m->PL = m->params;
        } else {
            /* in the layout of the host blocks (owner-only experts: the kept part) */
            void *P, *G, *PL;
            if ((st = m->be->alloc(m->be, kept * sizeof(float), &P))) goto fail;
            m->P = P;
            if ((st = m->be->alloc(m->be, m->n_grads * sizeof(float), &G))) goto fail;
            m->G = G;
            if ((st = m->be->alloc(m->be, kept * m->be->lp_bytes, &PL))) goto fail;
            m->PL = PL;
            block_bytes(m, kept * (sizeof(float) + m->be->lp_bytes) + m->n_grads * sizeof(float), 1);
            m->dw_set = 1; /* the zeroing is a pass over the backend's memory: it leaves the expert gradients out */
        }
    }

    /* activations and scratch: one plan (plan_activations) counts the block, then carves it */
    m->act_ledger_first = m->n_buffers;
    size_t act = plan_activations(m, NULL);
    m->act_ledger_n = m->n_buffers - m->act_ledger_first;
    m->act_floats = act;
    if ((st = ledger_add(m, 2 * (size_t)N * sizeof(int32_t), "tokens, targets [N] int32"))) goto fail;
    if (!m->dry) {
        void *ab = NULL, *tk = NULL, *tg = NULL;
        st = m->be->alloc(m->be, act * sizeof(float), &ab);
        if (!st) st = m->be->alloc(m->be, (size_t)N * sizeof(int32_t), &tk);
        if (!st) st = m->be->alloc(m->be, (size_t)N * sizeof(int32_t), &tg);
        m->act_block = ab;
        m->tokens = tk;
        m->targets = tg;
        if (st) {
            st = lm_error(LM_ERR_MEMORY, "out of memory for %zu activation floats (%.2f GiB) at B=%d T=%d; "
                          "`longmoe plan --memory` lists what a shape needs; hint: a smaller batch or sequence, "
                          "train.recompute (true, or \"channel\": the MoE and dense FFN alone), train.recompute_chunk or "
                          "train.seq_segment (docs/model.md, Memory)",
                          act, (double)act * sizeof(float) / (1u << 30), B, T);
            goto fail;
        }
        plan_activations(m, m->act_block);
    }
    /* the model's own product-format buffers (separate product format only):
     * the normalised sublayer inputs, the final norm, the dense FFN's hidden
     * and its backward's operands */
    if (m->sep) {
        size_t f = (size_t)cfg->dense_ffn, e = m->be->lp_bytes, C = (size_t)m->chunk;
        const int n_lp = xn_slot(m, m->L2, 0);
        size_t n_xn = (size_t)n_lp * N * d;
        size_t lpn = n_xn + (size_t)N * d /* hn */ + 3 * C * f /* ffn h, da, du */ + (size_t)N * d /* dy */;
        char name[128];
        if (m->cfg.recompute == LM_RECOMPUTE_ALL)
            snprintf(name, sizeof name, "xn, product format: normalised sublayer input (one, recomputed)");
        else if (m->cfg.recompute)
            snprintf(name, sizeof name, "xn, product format: normalised sublayer inputs, one shared by the "
                     "recomputed sublayers, one each kept [%d]", n_lp);
        else
            snprintf(name, sizeof name, "xn, product format: normalised sublayer inputs [2L]");
        if ((st = ledger_add(m, n_xn * e, "%s", name)) || (st = ledger_add(m, (size_t)N * d * e, "hn, product format")) ||
            (st = ledger_add(m, 3 * C * f * e, "dense FFN h, da, du, product format [%zu tokens]", C)) ||
            (st = ledger_add(m, (size_t)N * d * e, "dy, product format")))
            goto fail;
        if (!m->dry) {
            void *lb;
            if ((st = m->be->alloc(m->be, lpn * e, &lb))) goto fail;
            m->lp_block = lb;
            char *q = lb;
            m->xn_lp = q, q += n_xn * e;
            m->hn_lp = q, q += (size_t)N * d * e;
            m->ffn_h_lp = q, q += C * f * e;
            m->ffn_da_lp = q, q += C * f * e;
            m->ffn_du_lp = q, q += C * f * e;
            m->dy_lp = q;
            m->hn_host = malloc((size_t)N * d * sizeof(float));
            if (!m->hn_host) {
                st = lm_error(LM_ERR_MEMORY, "out of memory for the host copy of the final hidden states");
                goto fail;
            }
        }
    }
    /* the layers' parameter views, the backend's MoE activations (one set with
     * recompute) and the balancing states */
    layer_state *first_moe = NULL;
    int n_moe = 0;
    for (int l = 0; l < cfg->n_layers; l++) n_moe += m->layers[l].moe;
    for (int l = 0; l < cfg->n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_MLA && !m->dry) {
            ls->smax = malloc(2 * (size_t)cfg->attn_heads * sizeof(float));
            if (!ls->smax) {
                st = lm_error(LM_ERR_MEMORY, "out of memory creating the model");
                goto fail;
            }
            ls->smax_tmp = ls->smax + cfg->attn_heads;
            for (int h = 0; h < cfg->attn_heads; h++) ls->smax[h] = -INFINITY;
        }
        if (!m->dry) {
            /* the token mixer's tensors are never cut: one run of the block whatever the layout */
            float *pp = lm_model_host_param(m, ls->mixer_off), *pP = par_at(m, ls->mixer_off);
            if (ls->mixer == LM_MIXER_KDA) {
                lm_kda_layer_params_map(&ls->kda_cfg, pp, &ls->kda_p);
                lm_kda_layer_params_map(&ls->kda_cfg, pP, &ls->kda_P);
                map_views(m, &ls->kda_P, &ls->kda_PL, sizeof ls->kda_P, 0);
                map_views(m, &ls->kda_P, &ls->kda_G, sizeof ls->kda_P, 1);
            } else {
                if ((st = lm_mla_params_map(&ls->mla_cfg, pp, &ls->mla_p)) ||
                    (st = lm_mla_params_map(&ls->mla_cfg, pP, &ls->mla_P)))
                    goto fail;
                map_views(m, &ls->mla_P, &ls->mla_PL, sizeof ls->mla_P, 0);
                map_views(m, &ls->mla_P, &ls->mla_G, sizeof ls->mla_P, 1);
            }
        }
        if (!ls->moe) continue;
        if (!m->dry) {
            size_t off[10];
            moe_offsets(m, ls, off);
            ls->moe_xoff[0] = off[1], ls->moe_xoff[1] = off[2], ls->moe_xoff[2] = off[3];
            moe_views_in(m, ls, m->params, &ls->moe_p);
            moe_views_in(m, ls, m->P, &ls->moe_P);
            map_views(m, &ls->moe_P, &ls->moe_PL, sizeof ls->moe_P, 0);
            map_views(m, &ls->moe_P, &ls->moe_G, sizeof ls->moe_P, 1);
        }
        const int share_moe = rc_sub(m, 2 * l + 1); /* the channel mixers are recomputed */
        if (first_moe && share_moe) {
            ls->moe_acts = first_moe->moe_acts; /* owned by first_moe */
        } else {
            size_t b = m->be->ops->moe_acts_bytes(&ls->moe_cfg, m->chunk);
            if (!b && m->dry) {
                /* the plan goes on, so the table shows the rest; creating this model fails here */
                char why[128];
                snprintf(why, sizeof why, "%s", lm_last_error());
                if ((st = ledger_add(m, 0, "MoE activations REFUSED: %s", why))) goto fail;
                first_moe = ls;
                continue;
            }
            if ((st = share_moe
                          ? ledger_add(m, b, "MoE routing and expert activations [%lld tokens] (shared by %d layers)",
                                       (long long)m->chunk, n_moe)
                          : ledger_add(m, b, "layers.%d MoE routing and expert activations [%lld tokens]", l,
                                       (long long)m->chunk)))
                goto fail;
            if (!m->dry) {
                if ((st = m->be->ops->moe_acts_create(m->be, &ls->moe_cfg, m->chunk, &ls->moe_acts))) goto fail;
                ls->owns_moe_acts = 1;
            }
            first_moe = ls;
        }
        if (m->dry) continue;
        if (cfg->balance == LM_BALANCE_AUX && m->sep && !m->aux_host &&
            !(m->aux_host = malloc((size_t)N * cfg->n_routed_experts * sizeof(float)))) {
            st = lm_error(LM_ERR_MEMORY, "out of memory for the auxiliary loss's host scores");
            goto fail;
        }
        lm_balance_config bc = lm_balance_config_default(cfg->balance, cfg->n_routed_experts, cfg->top_k, m->Nq);
        bc.bins = cfg->balance_bins;
        bc.estimator = cfg->balance_estimator;
        bc.max_step_tokens = m->Nq * cfg->grad_accum; /* the exact estimator keeps a step's residuals */
        bc.ema = cfg->balance_ema;
        bc.sign_rate = cfg->sign_rate;
        bc.aux_alpha = cfg->aux_alpha;
        if ((st = lm_balance_init(&ls->bal, &bc))) goto fail;
        ls->bal_ready = 1;
    }
    /* the part timer, where the backend has one (no waits for the time by part) */
    if (!m->dry && m->be->timer_create && (st = m->be->timer_create(m->be, &m->timer))) goto fail;
    /* the backend counts a step's balance observations where it can, the host takes them once (lm_model_balance_sync) */
    if (!m->dry && n_moe > 0 && m->be->ops->moe_balance_set_create) {
        lm_balance_state **bals = malloc((size_t)n_moe * sizeof *bals);
        if (!bals) {
            st = lm_error(LM_ERR_MEMORY, "out of memory for the balancers' list");
            goto fail;
        }
        int i = 0;
        for (int l = 0; l < cfg->n_layers; l++)
            if (m->layers[l].moe) {
                m->layers[l].moe_i = i;
                bals[i++] = &m->layers[l].bal;
            }
        st = m->be->ops->moe_balance_set_create(m->be, bals, n_moe, &m->bal_set);
        free(bals);
        if (st) goto fail;
    }

    /* owner-only experts: a cut routed expert tensor has no whole view (until
     * gathered) and its gradient only this rank's slice (lm_model_set_expert_parallel
     * binds the views of the slice) */
    if (m->pcut && !m->dry) {
        bind_whole_expert_views(m);
        map_grad_views(m);
    }

    /* the residual stream */
    lm_attnres_config ac = {(lm_attnres_mode)cfg->residual, m->L2, cfg->attnres_block, (int)d, N,
                            cfg->norm_eps, 1, m->replay};
    {
        lm_attnres_memory_plan arp;
        if ((st = m->be->ops->attnres_memory(&ac, &arp))) goto fail;
        const char *mode = lm_attnres_mode_name((lm_attnres_mode)cfg->residual);
        const int H = arp.n_history_sources, L2 = m->L2, nb = arp.n_blocks;
        if ((st = ledger_add(m, arp.history, "residual stream (%s): sources, %d x [N,d]", mode, H)) ||
            (st = ledger_add(m, arp.history_grad, "residual stream: source gradients, %d x [N,d]", H)) ||
            (st = ledger_add(m, arp.saved_partials, "residual stream: saved partial block sums, %d x [N,d]%s",
                             cfg->residual == LM_RESIDUAL_STANDARD ? 0 : m->replay ? cfg->attnres_block - 1 : L2 - nb,
                             m->replay ? " (one block's, replayed)" : "")) ||
            (st = ledger_add(m, arp.saved_scores, "residual stream: saved scores")) ||
            (st = ledger_add(m, arp.phase1, "residual stream: two-phase accumulators")) ||
            (st = ledger_add(m, arp.queries + arp.param_grad, "residual stream: queries, parameter gradient partials")) ||
            (arp.deferred && (st = ledger_add(m, arp.deferred, "residual stream: deferred backward terms, %d x [N,d]",
                                              cfg->attnres_block - 1))))
            goto fail;
        /* whatever the parts leave out (a backend's own rounding) */
        size_t parts = arp.history + arp.history_grad + arp.saved_partials + arp.saved_scores + arp.phase1 +
                       arp.queries + arp.param_grad + arp.deferred;
        if (arp.total > parts && (st = ledger_add(m, arp.total - parts, "residual stream: other")))
            goto fail;
    }
    if (!m->dry && (st = m->be->ops->attnres_create(m->be, &ac, &m->ar))) goto fail;
    m->ar_full = m->ar;
    if (m->seg_on) {
        /* the last segment's residual state when S does not divide T, its carries, stores and accumulators */
        const int tail = m->Tq % m->S;
        if (tail) {
            lm_attnres_config at = ac;
            at.n_tokens = (int64_t)B * tail;
            lm_attnres_memory_plan atp;
            if ((st = m->be->ops->attnres_memory(&at, &atp)) ||
                (st = ledger_add(m, atp.total, "residual stream of the last segment (%d tokens a row)", tail)))
                goto fail;
            if (!m->dry && (st = m->be->ops->attnres_create(m->be, &at, &m->ar_tail))) goto fail;
        }
        m->seg_floats = plan_segments(m, NULL);
        if (!m->dry) {
            void *sb = NULL;
            if ((st = m->be->alloc(m->be, m->seg_floats * sizeof(float), &sb))) {
                st = lm_error(LM_ERR_MEMORY, "out of memory for %zu floats of sequence segment carries and stores",
                              m->seg_floats);
                goto fail;
            }
            m->seg_block = sb;
            plan_segments(m, m->seg_block);
            const size_t nq = (size_t)m->Nq, ns = (size_t)m->N;
            m->q_tok = malloc(nq * sizeof(int32_t));
            m->q_tgt = malloc(nq * sizeof(int32_t));
            m->seg_tok = malloc(ns * sizeof(int32_t));
            m->seg_tgt = malloc(ns * sizeof(int32_t));
            m->seg_nll = malloc(ns * sizeof(double));
            m->seg_arg = malloc(ns * sizeof(int32_t));
            if (!m->q_tok || !m->q_tgt || !m->seg_tok || !m->seg_tgt || !m->seg_nll || !m->seg_arg) {
                st = lm_error(LM_ERR_MEMORY, "out of memory for the sequence segments' token copies");
                goto fail;
            }
        }
    }
    /* the scratch the backend takes for the KDA and attention operators itself (GPU) */
    {
        size_t ob = 0;
        for (int l = 0; l < cfg->n_layers; l++) {
            const layer_state *ls = &m->layers[l];
            size_t b;
            if (ls->mixer == LM_MIXER_KDA) {
                lm_kda_config kc = lm_kda_config_default(B, T, cfg->kda_heads, cfg->kda_head_dim, cfg->kda_head_dim);
                kc.chunk = cfg->kda_chunk;
                kc.gate = ls->kda_cfg.gate;
                kc.g_min = ls->kda_cfg.g_min;
                b = m->be->ops->op_scratch_bytes(&kc, NULL);
            } else {
                const lm_mla_config *mc = &ls->mla_cfg;
                lm_attention_config atc = lm_attention_config_default(
                    B, T, mc->n_heads, mc->kind == LM_ATTN_MLA ? mc->n_heads : mc->n_kv_heads, mc->head_dim_qk,
                    mc->head_dim_v);
                b = m->be->ops->op_scratch_bytes(NULL, &atc);
            }
            ob = b > ob ? b : ob;
        }
        if (ob && (st = ledger_add(m, ob, "backend scratch of the KDA / attention operators (grown on first use)")))
            goto fail;
    }
    *out = m;
    return LM_OK;
fail:
    lm_model_free(m);
    return st;
}

void lm_model_free(lm_model *m) {
    if (!m) return;
    if (m->bal_set) m->be->ops->moe_balance_set_free(m->be, m->bal_set);
    if (m->timer) m->be->timer_free(m->be, m->timer);
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
        if (m->layers[l].moe_ep) m->be->ops->moe_ep_free(m->be, m->layers[l].moe_ep);
        if (m->layers[l].owns_moe_acts) m->be->ops->moe_acts_free(m->be, m->layers[l].moe_acts);
        free(m->layers[l].smax);
        if (m->layers[l].bal_ready) lm_balance_free(&m->layers[l].bal);
    }
    free(m->layers);
    free(m->gcuts);
    free(m->xwhole);
    free(m->xlayer);
    free(m->tensors);
    free(m->buffers);
    if (m->ar_full) m->be->ops->attnres_free(m->be, m->ar_full);
    else if (m->ar) m->be->ops->attnres_free(m->be, m->ar);
    if (m->ar_tail) m->be->ops->attnres_free(m->be, m->ar_tail);
    if (m->seg_block) m->be->release(m->be, m->seg_block);
    free(m->q_tok);
    free(m->q_tgt);
    free(m->seg_tok);
    free(m->seg_tgt);
    free(m->seg_nll);
    free(m->seg_arg);
    if (m->P && m->P != m->params) m->be->release(m->be, m->P);
    if (m->G && m->G != m->grads) m->be->release(m->be, m->G);
    if (m->PL && m->PL != (void *)m->params) m->be->release(m->be, m->PL);
    free(m->params);
    free(m->grads);
    if (m->act_block) m->be->release(m->be, m->act_block);
    if (m->tokens) m->be->release(m->be, m->tokens);
    if (m->targets) m->be->release(m->be, m->targets);
    if (m->lp_block) m->be->release(m->be, m->lp_block);
    free(m->hn_host);
    free(m->aux_host);
    free(m);
}

void lm_model_init(lm_model *m, uint64_t seed) {
    if (m->dry) return; /* a plan has no parameters */
    lm_rng rng;
    lm_rng_seed(&rng, seed);
    /* One stream over all tensors in table order, two draws a normal. The draws are cheap and
     * sequential; their Box-Muller transform is not (a billion-parameter preset spent most of a
     * minute here), so each block of draws is transformed by all threads: the same values bit
     * for bit as drawing one normal at a time (lm_rng_normal_of). */
    enum { BLOCK = 1 << 20 };
    uint64_t *draws = NULL;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_model_tensor *t = &m->tensors[i];
        /* owner-only expert weights keep elements [lo, hi) of a routed expert
         * tensor (at w[j - lo]), but the whole tensor's draws are taken: every
         * kept weight has one process's bits, and the stream goes on as there */
        size_t lo, cnt;
        float *w = lm_model_param_part(m, i, &lo, &cnt);
        const size_t hi = lo + cnt;
        const float mean = t->init_mean, std = t->init_std;
        if (!(std > 0)) {
            for (size_t j = 0; j < cnt; j++) w[j] = mean + 0.0f;
            continue;
        }
        if (!draws && !(draws = malloc(2 * (size_t)BLOCK * sizeof *draws))) {
            /* no scratch: draw and transform one at a time (same values) */
            for (size_t j = 0; j < t->numel; j++) {
                const float v = mean + std * (float)lm_rng_normal(&rng);
                if (j >= lo && j < hi) w[j - lo] = v;
            }
            continue;
        }
        for (size_t j0 = 0; j0 < t->numel; j0 += BLOCK) {
            const long n = (long)(t->numel - j0 < BLOCK ? t->numel - j0 : BLOCK);
            for (long j = 0; j < 2 * n; j++) draws[j] = lm_rng_u64(&rng);
            /* the kept elements of this block: [a, z) of it */
            const long a = (long)(lo > j0 ? (lo - j0 < (size_t)n ? lo - j0 : (size_t)n) : 0);
            const long z = (long)(hi > j0 ? (hi - j0 < (size_t)n ? hi - j0 : (size_t)n) : 0);
            if (a >= z) continue;
            float *wb = w + (j0 + (size_t)a - lo);
#pragma omp parallel for schedule(static) if (z - a >= 65536)
            for (long j = a; j < z; j++)
                wb[j - a] = mean + std * (float)lm_rng_normal_of(draws[2 * j], draws[2 * j + 1]);
        }
    }
    free(draws);
    memset(m->grads, 0, m->n_grads * sizeof(float));
    m->params_on_host_newer = 1;
    m->params_on_backend_newer = 0;
    m->grads_zero_pending = 1;
    /* counts still on the backend go to the old states, which are then reset */
    (void)lm_model_balance_sync(m);
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].bal_ready) {
            lm_balance_config bc = m->layers[l].bal.cfg;
            lm_balance_free(&m->layers[l].bal);
            lm_balance_init(&m->layers[l].bal, &bc);
        }
}

const lm_config *lm_model_config(const lm_model *m) { return &m->cfg; }
int lm_model_num_tensors(const lm_model *m) { return m->n_tensors; }
const lm_model_tensor *lm_model_tensor_at(const lm_model *m, int i) {
    return i >= 0 && i < m->n_tensors ? &m->tensors[i] : NULL;
}
const lm_model_tensor *lm_model_find(const lm_model *m, const char *name) {
    for (int i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
    return NULL;
}
size_t lm_model_num_params(const lm_model *m) { return m->n_params; }
size_t lm_model_num_grads(const lm_model *m) { return m->n_grads; }
size_t lm_model_num_kept_params(const lm_model *m) { return m->pcut ? m->n_grads : m->n_params; }
float *lm_model_params(lm_model *m) { return m->params; }
float *lm_model_grads(lm_model *m) { return m->grads; }
float *lm_model_backend_grads(lm_model *m) { return m->G; }
float *lm_model_backend_param_block(lm_model *m) { return m->P; }
size_t lm_model_activation_bytes(const lm_model *m) { return m->act_floats * sizeof(float); }
int lm_model_num_buffers(const lm_model *m) { return m->n_buffers; }
const lm_model_buffer *lm_model_buffer_at(const lm_model *m, int i) {
    return i >= 0 && i < m->n_buffers ? &m->buffers[i] : NULL;
}
size_t lm_model_plan_bytes(const lm_model *m) {
    size_t b = 0;
    for (int i = 0; i < m->n_buffers; i++) b += m->buffers[i].bytes;
    return b;
}
/* ---- the routed experts' weight gradients, written by the first backward after a zeroing ----
 * With dw_set (lm_model_set_expert_grads_written; on by default on a backend with memory of its
 * own) a zeroing of the gradients leaves out the routed experts' gate, up and down gradients of the
 * MoE layers that run here whole (no expert parallelism, every expert's gradient kept) and marks
 * them fresh; the layer's first MoE backward after it writes them (the op's expert_grads_set)
 * instead of adding to zeros, and clears the mark. For k3-mini they are 1.61B of the 1.75B
 * gradients: the zeroing's pass over them and the products' reads of them go. Whatever is still
 * fresh when the backward reports the layer's gradients final (a layer without an MoE backward call)
 * is zeroed then, and before lm_model_download_grads and any change of the gradient views (an EP
 * layer's backward adds: lm_model_set_expert_parallel settles every layer before it sets one). */
static int dw_layer(const lm_model *m, const layer_state *ls) {
    return m->dw_set && ls->moe && !ls->moe_ep && !m->n_gcuts;
}

typedef struct {
    size_t off, n;
} grad_range;

/* Layer ls's expert gradients as ranges of G: up to three. */
static int dw_ranges(const lm_model *m, const layer_state *ls, grad_range *r) {
    const size_t n = lm_moe_expert_tensor_floats(&ls->moe_cfg);
    float *w[3] = {ls->moe_G.gate, ls->moe_G.up, ls->moe_G.down};
    int k = 0;
    for (int i = 0; i < 3; i++)
        if (w[i]) r[k++] = (grad_range){(size_t)(w[i] - m->G), n};
    return k;
}

static int range_order(const void *a, const void *b) {
    const size_t x = ((const grad_range *)a)->off, y = ((const grad_range *)b)->off;
    return (x > y) - (x < y);
}

static lm_status zero_g(lm_model *m, size_t off, size_t n) {
    return n ? m->be->zero(m->be, m->G + off, n * sizeof(float)) : LM_OK;
}

/* Zero G, but for the expert gradients of the dw layers, which become fresh. */
static lm_status zero_grads_now(lm_model *m) {
    grad_range r[3 * LM_MAX_LAYERS];
    int k = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        ls->dw_fresh = dw_layer(m, ls);
        if (ls->dw_fresh) k += dw_ranges(m, ls, r + k);
    }
    qsort(r, (size_t)k, sizeof *r, range_order);
    size_t at = 0;
    for (int i = 0; i < k; i++) {
        if (r[i].off < at || r[i].off + r[i].n > m->n_grads) {
            for (int l = 0; l < m->cfg.n_layers; l++) m->layers[l].dw_fresh = 0;
            return lm_error(LM_ERR_ARG, "the expert gradients' ranges overlap or pass the gradient block's end "
                            "(%zu floats at %zu)", r[i].n, r[i].off);
        }
        TRY(zero_g(m, at, r[i].off - at));
        at = r[i].off + r[i].n;
    }
    return zero_g(m, at, m->n_grads - at);
}

/* Zero layer ls's expert gradients if no backward has written them since the zeroing. */
static lm_status dw_settle(lm_model *m, layer_state *ls) {
    if (!ls->dw_fresh) return LM_OK;
    grad_range r[3];
    const int k = dw_ranges(m, ls, r);
    for (int i = 0; i < k; i++) TRY(zero_g(m, r[i].off, r[i].n));
    ls->dw_fresh = 0;
    return LM_OK;
}

static lm_status dw_settle_all(lm_model *m) {
    for (int l = 0; m->layers && l < m->cfg.n_layers; l++) TRY(dw_settle(m, &m->layers[l]));
    return LM_OK;
}

lm_status lm_model_set_expert_grads_written(lm_model *m, int on) {
    if (!m) return lm_error(LM_ERR_ARG, "set_expert_grads_written: model is NULL");
    TRY(dw_settle_all(m)); /* the gradients as a whole zeroing would have left them */
    m->dw_set = on != 0 && !m->dry;
    return LM_OK;
}

int lm_model_expert_grads_written(const lm_model *m) { return m->dw_set; }

void lm_model_zero_grads(lm_model *m) {
    /* on a backend with memory of its own the gradients live there (zeroed before
     * the next forward); the host copy is current only after lm_model_download_grads,
     * which overwrites all of it: zeroing it here would cost a pass over n_params
     * floats of host memory every step (7 GB for k3-mini) */
    if (m->G != m->grads) m->grads_zero_pending = 1;
    else if (!m->dw_set) memset(m->grads, 0, m->n_grads * sizeof(float));
    else if (zero_grads_now(m)) memset(m->grads, 0, m->n_grads * sizeof(float)); /* (only a bad range fails) */
}

lm_backend *lm_model_backend(const lm_model *m) { return m->be; }

lm_status lm_model_upload_params(lm_model *m) {
    if (m->P != m->params) {
        const size_t kept = lm_model_num_kept_params(m);
        TRY(m->be->upload(m->be, m->P, m->params, kept * sizeof(float)));
        if (m->PL != (void *)m->P) TRY(m->be->ops->to_lp(m->be, m->PL, m->P, kept));
    }
    m->params_on_host_newer = 0;
    m->params_on_backend_newer = 0;
    return LM_OK;
}

lm_status lm_model_params_changed_on_backend(lm_model *m) {
    if (m->P == m->params) return LM_OK;
    if (m->PL != (void *)m->P) TRY(m->be->ops->to_lp(m->be, m->PL, m->P, lm_model_num_kept_params(m)));
    m->params_on_host_newer = 0;
    m->params_on_backend_newer = 1;
    return LM_OK;
}

lm_status lm_model_download_params(lm_model *m) {
    if (m->P != m->params && m->params_on_backend_newer)
        TRY(m->be->download(m->be, m->params, m->P, lm_model_num_kept_params(m) * sizeof(float)));
    m->params_on_backend_newer = 0;
    return LM_OK;
}

int lm_model_host_params_stale(const lm_model *m) { return m->params_on_backend_newer; }

lm_status lm_model_download_grads(lm_model *m) {
    TRY(dw_settle_all(m));
    if (m->G != m->grads) TRY(m->be->download(m->be, m->grads, m->G, m->n_grads * sizeof(float)));
    return LM_OK;
}

/* Before a forward: the backend sees the host's latest parameters and zeroed gradients. */
static lm_status sync_before_forward(lm_model *m) {
    if (m->params_on_host_newer) TRY(lm_model_upload_params(m));
    if (m->grads_zero_pending && m->G != m->grads) TRY(zero_grads_now(m));
    m->grads_zero_pending = 0;
    return LM_OK;
}
float lm_model_aux_loss(const lm_model *m) { return m->aux_loss; }

int lm_model_num_moe_layers(const lm_model *m) {
    int n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) n += m->layers[l].moe;
    return n;
}
int lm_model_moe_layer_index(const lm_model *m, int i) {
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].moe && i-- == 0) return l;
    return -1;
}
lm_balance_state *lm_model_balance(lm_model *m, int i) {
    int l = lm_model_moe_layer_index(m, i);
    return l < 0 ? NULL : &m->layers[l].bal;
}

lm_status lm_model_balance_sync(lm_model *m) {
    return m->bal_set ? m->be->ops->moe_balance_set_flush(m->be, m->bal_set) : LM_OK;
}

lm_status lm_model_balance_step_end(lm_model *m, int training, lm_balance_stats *stats) {
    /* the counts still on the backend first; a refused one keeps b (training) or is dropped with the rest */
    lm_status fs = lm_model_balance_sync(m);
    if (fs && training) return fs;
    int i = 0;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].moe) {
            TRY(lm_balance_step_end(&m->layers[l].bal, training, stats ? &stats[i] : NULL));
            i++;
        }
    return fs;
}

/* The descriptors with data and grad in the blocks P (parameters) and G (gradients). */
static void optimizer_params_in(lm_model *m, float *P, float *G, lm_param *params, lm_train_optimizer which) {
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_model_tensor *t = &m->tensors[i];
        /* NULL: a plan's descriptors; a tensor whose gradient is cut has no whole gradient (lm_model_grad_part),
         * and with owner-only weights no whole data either (lm_model_param_part) */
        const int cut = gcut_of(m, t->offset) != NULL;
        float *w = P && !(cut && m->pcut) ? (m->pcut ? lm_model_cut_at(m, P, t->offset) : P + t->offset) : NULL;
        float *g = G && !cut ? grad_in(m, G, t->offset) : NULL;
        lm_param p;
        if (t->ndim >= 2) {
            int64_t rows = t->ndim == 3 ? t->shape[0] * t->shape[1] : t->shape[0];
            int64_t cols = t->ndim == 3 ? t->shape[2] : t->shape[1];
            p = lm_param_matrix(t->name, w, g, rows, cols, t->kind);
            p.n_blocks = t->n_blocks > 1 ? t->n_blocks : 1;
        } else {
            p = lm_param_vector(t->name, w, g, t->shape[0], t->kind);
        }
        if (which == LM_TRAIN_ADAMW) p.optimizer = LM_OPT_ADAMW;
        params[i] = p;
    }
}

void lm_model_optimizer_params(lm_model *m, lm_param *params, lm_train_optimizer which) {
    optimizer_params_in(m, m->params, m->grads, params, which);
}

void lm_model_backend_params(lm_model *m, lm_param *params, lm_train_optimizer which) {
    optimizer_params_in(m, m->P, m->G, params, which);
}

static const char *const time_names[LM_TIME_COUNT] = {"kda", "attention", "moe", "dense ffn", "attnres",
                                                      "embedding + norms", "lm head"};
const char *lm_time_part_name(lm_time_part p) { return (unsigned)p < LM_TIME_COUNT ? time_names[p] : "?"; }
/* the part timer's intervals so far into m->seconds (a timer that fails leaves them out) */
static void take_timer(lm_model *m) {
    if (m->timer) (void)m->be->timer_take(m->be, m->timer, m->seconds, LM_TIME_COUNT);
}
void lm_model_timings(lm_model *m, double seconds[LM_TIME_COUNT]) {
    take_timer(m);
    memcpy(seconds, m->seconds, sizeof m->seconds);
}
void lm_model_reset_timings(lm_model *m) {
    take_timer(m);
    memset(m->seconds, 0, sizeof m->seconds);
}

/* The start of a timed pass: the clock, and with a part timer a mark charged to none. */
static double time_start(lm_model *m) {
    if (m->timer) (void)m->be->timer_mark(m->be, m->timer, -1);
    return lm_time_seconds();
}

/* Charge the time since *t0 to `part` and restart the clock; with a part timer, a mark
 * that charges the work enqueued since the last one (nothing waits). */
static void charge(lm_model *m, lm_time_part part, double *t0) {
    if (m->timer) {
        (void)m->be->timer_mark(m->be, m->timer, (int)part);
        return;
    }
    /* on a device, the work enqueued so far must finish to be charged to its part */
    if (m->be->device != LM_DEVICE_CPU) (void)m->be->sync(m->be);
    double t = lm_time_seconds();
    m->seconds[part] += t - *t0;
    *t0 = t;
}

static lm_time_part sublayer_part(const layer_state *ls, int idx) {
    if (idx % 2 == 0) return ls->mixer == LM_MIXER_KDA ? LM_TIME_KDA : LM_TIME_ATTENTION;
    return ls->moe ? LM_TIME_MOE : LM_TIME_DENSE_FFN;
}

/* ---- the dense FFN ---- */

/* The dense FFN on n tokens (n <= the model's chunk): x (n,d) in the product
 * format -> y (n,d); the activations of these n tokens in ls->ffn_a, _u, _h. */
static lm_status dense_ffn_forward(const lm_model *m, layer_state *ls, const void *x, float *y, int64_t n) {
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    int d = m->d, f = m->cfg.dense_ffn;
    const float *Wg = lp_param(m, par_at(m, ls->ffn_off)), *Wu = lp_param(m, par_at(m, ls->ffn_off) + (size_t)f * d),
                *Wd = lp_param(m, par_at(m, ls->ffn_off) + 2 * (size_t)f * d);
    lm_expert_act act = m->cfg.activation == LM_ACT_SITU ? LM_EXPERT_SITU_GLU : LM_EXPERT_SWIGLU;
    void *h_lp = lp_or(m, ls->ffn_h, m->ffn_h_lp);
    TRY(op->matmul_forward(be, ls->ffn_a, x, Wg, n, d, f));
    TRY(op->matmul_forward(be, ls->ffn_u, x, Wu, n, d, f));
    TRY(op->glu_forward(be, act, ls->ffn_h, h_lp, ls->ffn_a, ls->ffn_u, (size_t)n * f));
    TRY(op->matmul_forward(be, y, h_lp, Wd, n, f, d));
    return LM_OK;
}

/* Its backward on the same n tokens: x (n,d) in the product format, dy (n,d);
 * dx written (W_gate's product sets it), the weight gradients accumulate. */
static lm_status dense_ffn_backward(lm_model *m, layer_state *ls, const void *x, const float *dy,
                                    const void *dy_given, float *dx, int64_t n) {
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    int d = m->d, f = m->cfg.dense_ffn;
    size_t nf = (size_t)n * f;
    const float *Wg = lp_param(m, par_at(m, ls->ffn_off)), *Wu = lp_param(m, par_at(m, ls->ffn_off) + (size_t)f * d),
                *Wd = lp_param(m, par_at(m, ls->ffn_off) + 2 * (size_t)f * d);
    float *gWg = grad_at(m, ls->ffn_off), *gWu = gWg + (size_t)f * d, *gWd = gWu + (size_t)f * d;
    float *dh = m->scratch, *da = dh + nf, *du = da + nf;
    void *dy_lp = lp_or(m, (float *)dy, m->dy_lp), *da_lp = lp_or(m, da, m->ffn_da_lp),
         *du_lp = lp_or(m, du, m->ffn_du_lp);
    lm_expert_act act = m->cfg.activation == LM_ACT_SITU ? LM_EXPERT_SITU_GLU : LM_EXPERT_SWIGLU;
    /* dy in the product format: the AttnRes state's copy where it wrote one, else converted here */
    if (m->sep && dy_given) dy_lp = (void *)dy_given;
    else if (m->sep) TRY(op->to_lp(be, dy_lp, dy, (size_t)n * d));
    TRY(op->matmul_backward_set(be, dh, gWd, dy_lp, lp_or(m, ls->ffn_h, m->ffn_h_lp), Wd, n, f, d));
    /* da, du straight in the product format where that is a separate copy (no fp32 da, du; no conversion) */
    TRY(op->glu_backward(be, act, m->sep ? NULL : da, m->sep ? NULL : du, m->sep ? da_lp : NULL,
                         m->sep ? du_lp : NULL, dh, ls->ffn_a, ls->ffn_u, nf));
    TRY(op->matmul_backward_set(be, dx, gWg, da_lp, x, Wg, n, d, f));
    TRY(op->matmul_backward(be, dx, gWu, du_lp, x, Wu, n, d, f));
    return LM_OK;
}

/* ---- forward and backward ---- */

static lm_attnres_params attnres_params(const lm_model *m) {
    lm_attnres_params p = {NULL, NULL};
    if (m->has_attnres_params) {
        p.query = par_at(m, m->ar_query_off);
        p.key_norm = par_at(m, m->ar_key_off);
    }
    return p;
}

/* Token rows [t0, t0 + n) of an (N, d) buffer, fp32 or in the product format. */
static float *rows_f32(const lm_model *m, const float *x, int64_t t0) {
    return x ? (float *)x + (size_t)t0 * m->d : NULL;
}
static void *rows_lp(const lm_model *m, const void *x, int64_t t0) {
    return (char *)x + (size_t)t0 * m->d * m->be->lp_bytes;
}

/* Whether the forward notes its non-finite checks (the backend's nonfinite_note) and takes
 * them once after the layers instead of waiting for each: not under context or expert
 * parallelism, whose ranks agree on each sublayer's or MoE layer's verdict. Slot 2 idx is
 * sublayer idx's router scores, 2 idx + 1 its output: execution order. */
static int defers_checks(const lm_model *m) {
    return m->be->ops->nonfinite_note && m->be->ops->nonfinite_take && !m->cp_comm && !m->ep_comm &&
           2 * m->L2 <= LM_NONFINITE_SLOTS;
}

/* The noted checks: the first failing one in execution order, with the message the check at
 * once gives (clear: drop them, as after a forward that stopped early). */
static lm_status take_checks(lm_model *m, int clear) {
    if (!m->checks_pending) return LM_OK;
    int64_t first[LM_NONFINITE_SLOTS];
    const int n = 2 * m->L2;
    m->checks_pending = 0;
    TRY(m->be->ops->nonfinite_take(m->be, first, n));
    for (int s = 0; s < n && !clear; s++) {
        if (first[s] < 0) continue;
        const int idx = s / 2;
        if (s % 2 == 0)
            return lm_error(LM_ERR_NUMERIC, "non-finite router score in layer %d (token %lld)", idx / 2,
                            (long long)(first[s] / m->cfg.n_routed_experts));
        return lm_error(LM_ERR_NUMERIC, "non-finite output of sublayer %d (layer %d, %s)", idx, idx / 2,
                        idx % 2 ? "channel mixer" : "token mixer");
    }
    return LM_OK;
}

/* The ranks of the expert-parallel handle agree on a failure, over its host
 * handle (moe_ep.h; the handle's exchanges may move device memory). */
static lm_status ep_agree(lm_model *m, lm_status mine) {
    return lm_moe_ep_agree_on(lm_comm_host(m->ep_comm), mine);
}

static int ep_eval_exchange(const lm_model *m);

/* The channel mixer (dense FFN or MoE) of sublayer idx on the tokens [t0, t0 +
 * n) of its normalised input, n = min(chunk, N - t0): y's same rows; fills the
 * activations of these tokens. The balancer observes every chunk, so a step's
 * statistics are the whole batch's (its counts add up). */
static lm_status channel_forward(lm_model *m, layer_state *ls, int idx, const float *xn_all, const void *xn_lp_all,
                                 float *y_all, int64_t t0, int training, int recompute) {
    const int64_t n = m->N - t0 < m->chunk ? m->N - t0 : m->chunk;
    const float *xn = rows_f32(m, xn_all, t0);
    const void *xn_lp = rows_lp(m, xn_lp_all, t0);
    float *y = rows_f32(m, y_all, t0);
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    if (!ls->moe) return dense_ffn_forward(m, ls, xn_lp, y, n);
    const int nx = m->cfg.n_routed_experts;
    /* expert parallelism in training (and its recomputation): an evaluation
     * forward may run on some ranks alone and the replicated expert weights
     * let it run the whole layer; a cut model's evaluation forward runs it
     * too where asked (lm_model_evaluate_by_exchange: collective then) */
    ls->moe_ep_fwd = ls->moe_ep && (training || recompute || ep_eval_exchange(m));
    if (ls->moe_ep_fwd) {
        /* did every rank reach this layer? (lm_model_forward); never chunked */
        lm_status st = ep_agree(m, LM_OK);
        if (!recompute) m->ep_next = idx + 1;
        if (!st)
            st = op->moe_forward_ep(be, y, xn, m->sep ? xn_lp : NULL, ls->bal.bias, &ls->moe_cfg, &ls->moe_Pep,
                                    &ls->moe_PLep, ls->moe_acts, n, ls->moe_ep);
        if (st) {
            m->ep_together = 1; /* failures in the layer are agreed on */
            return st;
        }
    } else {
        if (!ls->moe_P.gate)
            return lm_error(LM_ERR_ARG, "layer %d: this rank keeps only its own experts' weights "
                            "(lm_model_keep_expert_weights): a forward that runs every expert locally (evaluation) "
                            "needs them gathered first (lm_model_gather_experts, or layer by layer: "
                            "lm_model_gather_experts_by_layer)", idx / 2);
        /* the norm's own product-format copy of xn: no conversion in the MoE (kept until its backward) */
        TRY(op->moe_forward(be, y, xn, m->sep ? xn_lp : NULL, ls->bal.bias, &ls->moe_cfg, &ls->moe_P, &ls->moe_PL,
                            ls->moe_acts, n));
    }
    float *scores = op->moe_scores(be, ls->moe_acts);
    if (m->fault == LM_FAULT_ROUTER && !recompute) {
        const float nan = NAN;
        TRY(be->upload(be, scores, &nan, sizeof nan));
        m->fault = LM_FAULT_NONE;
    }
    /* a non-finite score would poison the balancer's statistics: refuse it first. With the
     * counts kept on the backend until the step's sync (which refuses such a score itself),
     * the check may be deferred; the recomputing forward repeats the checked scores */
    int64_t bad = -1;
    if (m->bal_set && !ls->moe_ep_fwd && defers_checks(m)) {
        if (!recompute) {
            TRY(op->nonfinite_note(be, scores, (size_t)n * nx, t0 * nx, 2 * idx));
            m->checks_pending = 1;
        }
    } else {
        TRY(op->find_nonfinite(be, scores, (size_t)n * nx, &bad));
    }
    if (ls->moe_ep_fwd) {
        /* the ranks agree, so all stop at this layer and none waits in the next exchange */
        int32_t mine = bad >= 0, any = 0;
        TRY(lm_comm_all_reduce_sum(lm_comm_host(m->ep_comm), &mine, &any, 1, LM_DTYPE_I32));
        if (any) m->ep_together = 1;
        if (any && !mine)
            return lm_error(LM_ERR_NUMERIC, "non-finite router score in layer %d on another rank", idx / 2);
    }
    if (bad >= 0)
        return lm_error(LM_ERR_NUMERIC, "non-finite router score in layer %d (token %lld)", idx / 2,
                        (long long)(t0 + bad / nx));
    if (training && !recompute)
        TRY(m->bal_set ? op->moe_balance_set_observe(be, m->bal_set, ls->moe_i, ls->moe_acts, n)
                       : op->moe_balance_observe(be, &ls->bal, ls->moe_acts, n));
    if (m->cfg.balance == LM_BALANCE_AUX && !recompute) {
        /* never chunked (lm_config_validate) */
        float aux = 0;
        TRY(op->moe_aux_loss(be, &aux, ls->dscores, ls->moe_acts, n, nx, m->cfg.top_k, m->cfg.aux_alpha));
        m->aux_loss += aux;
    }
    return LM_OK;
}

/* The backward of the channel mixer on the tokens [t0, t0 + n) (after
 * channel_forward of the same tokens): dxn's rows written, weight gradients
 * accumulated. */
static lm_status channel_backward(lm_model *m, layer_state *ls, const float *xn_all, const void *xn_lp_all,
                                  int64_t t0, float loss_scale) {
    const int64_t n = m->N - t0 < m->chunk ? m->N - t0 : m->chunk;
    const float *xn = rows_f32(m, xn_all, t0), *dy = m->dy_cur + (size_t)t0 * m->d;
    const void *dy_lp = m->dy_lp_cur ? rows_lp(m, m->dy_lp_cur, t0) : NULL;
    float *dxn = rows_f32(m, m->dxn, t0);
    lm_backend *be = m->be;
    if (!ls->moe) return dense_ffn_backward(m, ls, rows_lp(m, xn_lp_all, t0), dy, dy_lp, dxn, n);
    /* the MoE's saved routing is that of its last forward: these tokens' */
    float *extra = NULL;
    if (m->cfg.balance == LM_BALANCE_AUX) {
        size_t k = (size_t)n * m->cfg.n_routed_experts;
        if (be->device == LM_DEVICE_CPU) {
            for (size_t i = 0; i < k; i++) ls->dscores[i] *= loss_scale;
        } else {
            /* the auxiliary loss is a baseline: scaled on the host */
            TRY(be->download(be, m->aux_host, ls->dscores, k * sizeof(float)));
            for (size_t i = 0; i < k; i++) m->aux_host[i] *= loss_scale;
            TRY(be->upload(be, ls->dscores, m->aux_host, k * sizeof(float)));
        }
        extra = ls->dscores;
    }
    if (ls->moe_ep_fwd)
        return be->ops->moe_backward_ep(be, dxn, &ls->moe_Gep, dy, dy_lp, xn, extra, &ls->moe_cfg, &ls->moe_Pep,
                                        &ls->moe_PLep, ls->moe_acts, ls->moe_ep);
    if (m->n_gcuts)
        return lm_error(LM_ERR_ARG, "layer %d: this rank keeps only its own experts' gradients "
                        "(lm_model_keep_expert_grads): a backward follows a training forward, whose experts "
                        "run on their owners", (int)(ls - m->layers));
    /* the first call after a zeroing writes the expert gradients (dw_layer) */
    TRY(be->ops->moe_backward(be, dxn, &ls->moe_G, dy, dy_lp, xn, extra, &ls->moe_cfg, &ls->moe_P, &ls->moe_PL,
                              ls->moe_acts, ls->dw_fresh));
    ls->dw_fresh = 0;
    return LM_OK;
}

/* ---- sequence segments: the carries of the current segment ---- */

/* Floats of one KDA state [B,H,K,K] and of one conv history [3,B,W-1,HK]. */
static void seg_kda_sizes(const lm_model *m, const layer_state *ls, size_t *state, size_t *halo) {
    const lm_kda_layer_config *kc = &ls->kda_cfg;
    *state = (size_t)m->B * kc->heads * kc->head_dim * kc->head_dim;
    *halo = 3 * (size_t)m->B * (kc->conv_width - 1) * kc->heads * kc->head_dim;
}

/* Segment m->seg's carry of a KDA layer: slot s-1 in (none for the first
 * segment: zero state, zero history), slot s out (the last segment's state
 * goes to a spare buffer: asking for it keeps the operator on one path). */
static lm_kda_layer_carry seg_kda_carry(const lm_model *m, const layer_state *ls) {
    size_t st, ha;
    seg_kda_sizes(m, ls, &st, &ha);
    const int s = m->seg, last = s + 1 == m->n_seg;
    lm_kda_layer_carry c;
    c.h0 = s ? ls->seg_h + (size_t)(s - 1) * st : NULL;
    c.ht = last ? m->seg_ht_junk : ls->seg_h + (size_t)s * st;
    c.halo = s && ha ? ls->seg_halo + (size_t)(s - 1) * ha : NULL;
    c.halo_out = !last && ha ? ls->seg_halo + (size_t)s * ha : NULL;
    return c;
}

static lm_mla_seg seg_mla(const lm_model *m, const layer_state *ls) {
    lm_mla_seg g;
    memset(&g, 0, sizeof g);
    g.t0 = m->seg_t0;
    g.T_all = m->Tq;
    g.dk_tmp = m->seg_dk_tmp;
    g.dv_tmp = m->seg_dv_tmp;
    if (ls->seg_latent) {
        g.c_store = ls->seg_c;
        g.kr_store = ls->seg_kr;
        g.dc_acc = ls->seg_dc;
        g.dkr_acc = ls->seg_dkr;
        g.k_work = m->seg_k_work;
        g.v_work = m->seg_v_work;
    } else {
        g.k_store = ls->seg_k;
        g.v_store = ls->seg_v;
        g.dk_acc = ls->seg_dk;
        g.dv_acc = ls->seg_dv;
    }
    return g;
}

/* Evaluation forwards of a cut model, one MoE layer's experts at a time (below). */
static int ep_streams(const lm_model *m);
static lm_status gather_layer_experts(lm_model *m, layer_state *ls, int idx);
static void release_layer_experts(lm_model *m, layer_state *ls);
static lm_status ep_join(lm_model *m, lm_status s);

/* Sublayer idx on its normalised input xn -> y; fills the sublayer's
 * activations. `training` feeds the balancer and the logit maxima;
 * `recompute` marks the backward's second forward, which repeats the
 * activations only (the same routing: b changes only at the step's end). */
static lm_status sublayer_forward(lm_model *m, layer_state *ls, int idx, const float *xn, const void *xn_lp, float *y,
                                  int training, int recompute) {
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    if (idx % 2 == 0 && m->cp_comm) {
        /* context parallelism: the rank's segment of every row, in the segment form (any backend) */
        if (ls->mixer == LM_MIXER_KDA) {
            TRY(lm_kda_layer_cp_forward_lp(m->cp_comm, &ls->kda_cfg, &ls->kda_P, &ls->kda_PL, xn_lp, m->B, m->cp_t0,
                                           m->T, y, ls->cp_acts, m->cp_scratch));
        } else {
            const lm_mla_config *mc = &ls->mla_cfg;
            TRY(lm_mla_cp_forward_lp(m->cp_comm, mc, &ls->mla_P, &ls->mla_PL, xn_lp, m->B, m->cp_t0, m->T, y,
                                     ls->cp_acts, m->cp_scratch));
            if (training && !recompute) {
                /* the whole sequence's maxima, the same bits on every rank */
                TRY(lm_mla_cp_head_max_lp(m->cp_comm, mc, ls->cp_acts, m->B, m->cp_t0, m->T, ls->smax_tmp));
                for (int h = 0; h < m->cfg.attn_heads; h++)
                    ls->smax[h] = ls->smax_tmp[h] > ls->smax[h] ? ls->smax_tmp[h] : ls->smax[h];
            }
        }
    } else if (idx % 2 == 0 && m->seg_active && ls->mixer == LM_MIXER_KDA) {
        /* a sequence segment: the state and conv history of the segment before in, this one's out */
        lm_kda_layer_carry cr = seg_kda_carry(m, ls);
        TRY(lm_kda_layer_forward_seg(&ls->kda_cfg, &ls->kda_P, &ls->kda_PL, &ls->kda_a, xn_lp, m->B, m->T, &cr, y));
    } else if (idx % 2 == 0 && m->seg_active) {
        /* a sequence segment: its queries over the stored keys and values of every earlier token */
        const lm_mla_config *mc = &ls->mla_cfg;
        lm_mla_seg sg = seg_mla(m, ls);
        /* the backward's forwards reuse the attention output the segment's first forward kept */
        const lm_mla_keep kp = {ls->keep_o, ls->keep_lse, recompute || m->seg_reuse};
        sg.keep = &kp;
        TRY(lm_mla_forward_seg(mc, &ls->mla_P, &ls->mla_PL, xn_lp, m->B, m->T, &sg, y, ls->mla_acts));
        if (training && !recompute) {
            /* the maxima over the segments: the whole sequence's */
            TRY(lm_mla_seg_head_max(mc, ls->mla_acts, m->B, m->T, ls->smax_tmp));
            for (int h = 0; h < m->cfg.attn_heads; h++)
                ls->smax[h] = ls->smax_tmp[h] > ls->smax[h] ? ls->smax_tmp[h] : ls->smax[h];
        }
    } else if (idx % 2 == 0 && ls->mixer == LM_MIXER_KDA) {
        TRY(lm_kda_layer_forward_lp(&ls->kda_cfg, &ls->kda_P, &ls->kda_PL, &ls->kda_a, xn_lp, m->B, m->T, y));
    } else if (idx % 2 == 0) {
        const lm_mla_config *mc = &ls->mla_cfg;
        /* with recompute, the recomputation reuses the attention output the forward kept */
        const lm_mla_keep kp = {ls->keep_o, ls->keep_lse, recompute};
        TRY(lm_mla_forward_lp_keep(mc, &ls->mla_P, &ls->mla_PL, xn_lp, m->B, m->T, y, ls->mla_acts,
                                   ls->keep_o ? &kp : NULL));
        if (training && !recompute) {
            lm_attention_config ac = lm_attention_config_default(
                m->B, m->T, mc->n_heads, mc->kind == LM_ATTN_MLA ? mc->n_heads : mc->n_kv_heads, mc->head_dim_qk,
                mc->head_dim_v);
            TRY(op->attention_head_max(be, &ac, lm_mla_acts_rowmax(mc, ls->mla_acts, m->B, m->T), ls->smax_tmp));
            for (int h = 0; h < m->cfg.attn_heads; h++)
                ls->smax[h] = ls->smax_tmp[h] > ls->smax[h] ? ls->smax_tmp[h] : ls->smax[h];
        }
    } else {
        /* the channel mixer: per token, so `chunk` tokens at a time; an
         * evaluation forward of a cut model gathers this layer's experts for
         * it (every chunk runs on them) and frees them after */
        const int gather = ls->moe && !(ls->moe_ep && (training || recompute)) && ep_streams(m) && !m->xexchange;
        if (gather) TRY(gather_layer_experts(m, ls, idx));
        lm_status st = LM_OK;
        for (int64_t t0 = 0; t0 < m->N && !st; t0 += m->chunk)
            st = channel_forward(m, ls, idx, xn, xn_lp, y, t0, training, recompute);
        if (gather) release_layer_experts(m, ls);
        TRY(st);
    }
    return LM_OK;
}

/* The lp view of sublayer idx's normalised input. */
static void *xn_lp_of(const lm_model *m, int idx) {
    size_t nd = (size_t)m->N * m->d;
    return m->sep ? (char *)m->xn_lp + (size_t)xn_slot(m, idx, 0) * nd * m->be->lp_bytes
                  : (void *)(m->xn + (size_t)xn_slot(m, idx, 1) * nd);
}

/* Sublayer idx's input and normalised input: one buffer each with recompute
 * (the normalised input) and recompute_chunk (the input), else one per sublayer. */
static float *hin_of(const lm_model *m, int idx) {
    if (m->fuse_norm) return NULL;
    return m->hin + (m->lean_hin ? 0 : (size_t)idx * m->N * m->d);
}
static float *xn_of(const lm_model *m, int idx) {
    if (!xn_f32_needed(m, idx)) return NULL;
    return m->xn + (size_t)xn_slot(m, idx, 1) * m->N * m->d;
}

/* Under context parallelism every rank must reach the same collectives: the
 * ranks share their verdicts (a one-integer sum). This rank's failure st is
 * returned with its own message; a rank that is fine fails with status
 * `other` when another rank is not, naming `what`. Without it: st. */
static lm_status cp_agree(lm_model *m, lm_status st, lm_status other, const char *what) {
    if (!m->cp_comm) return st;
    char why[1024] = "";
    if (st) snprintf(why, sizeof why, "%s", lm_last_error());
    int32_t mine = st != LM_OK, any = 0;
    TRY(lm_comm_all_reduce_sum(lm_comm_host(m->cp_comm), &mine, &any, 1, LM_DTYPE_I32));
    if (st) return lm_error(st, "%s", why);
    if (any) return lm_error(other, "context parallelism: %s on another rank", what);
    return LM_OK;
}

/* Sublayer idx's input from the residual state and its RMSNorm: xn (fp32,
 * NULL where no op reads it: xn_of), xn_lp, the norm's 1/rms; hin receives
 * the input unless the backend runs both in one pass (m->fuse_norm).
 * recompute = 1: in the backward, from the saved scores (hin: recompute_chunk's
 * one buffer, else the forward's stored input). */
static lm_status sublayer_input(lm_model *m, int idx, const lm_attnres_params *arp, float *hin, float *xn,
                                void *xn_lp, int recompute, double *t0) {
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    const layer_state *ls = &m->layers[idx / 2];
    const float *w = par_at(m, idx % 2 ? ls->ffn_norm_off : ls->mixer_norm_off);
    float *rstd = m->rstd + (size_t)idx * m->N;
    if (m->fuse_norm) {
        TRY(op->attnres_input_norm(be, m->ar, idx, arp, w, m->cfg.norm_eps, xn, m->sep ? xn_lp : NULL, rstd,
                                   recompute));
        charge(m, LM_TIME_ATTNRES, t0);
        return LM_OK;
    }
    if (!recompute) TRY(op->attnres_input(be, m->ar, idx, arp, hin));
    else if (m->lean_hin) TRY(op->attnres_recompute_input(be, m->ar, idx, hin));
    charge(m, LM_TIME_ATTNRES, t0);
    TRY(op->rmsnorm_forward(be, xn, m->sep ? xn_lp : NULL, rstd, hin, w, m->N, m->d, m->cfg.norm_eps));
    charge(m, LM_TIME_NORMS, t0);
    return LM_OK;
}

/* The sublayers of a forward, with the residual state between them (run_layers_forward). */
static lm_status run_sublayers(lm_model *m, int training, int defer, const lm_attnres_params *ap, double *tp) {
    const int64_t N = m->N;
    const int d = m->d;
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    lm_attnres_params arp = *ap;
    double t0 = *tp;
    for (int idx = 0; idx < m->L2; idx++) {
        layer_state *ls = &m->layers[idx / 2];
        float *hin = hin_of(m, idx), *xn = xn_of(m, idx);
        void *xn_lp = xn_lp_of(m, idx);
        TRY(sublayer_input(m, idx, &arp, hin, xn, xn_lp, 0, &t0));
        /* under context parallelism the ranks agree after every sublayer, so a
         * failing rank leaves none waiting in the next token mixer */
        lm_status ss = sublayer_forward(m, ls, idx, xn, xn_lp, m->y, training, 0);
        int64_t bad = -1;
        /* a deferred check in the residual stream's own pass over y where the backend has one */
        const int note_in_add = defer && op->attnres_add_output_note;
        if (!ss && note_in_add) {
            /* noted below */
        } else if (!ss && defer) {
            ss = op->nonfinite_note(be, m->y, (size_t)N * d, 0, 2 * idx + 1);
            m->checks_pending = 1;
        } else if (!ss) {
            ss = op->find_nonfinite(be, m->y, (size_t)N * d, &bad);
        }
        if (!ss && bad >= 0)
            ss = lm_error(LM_ERR_NUMERIC, "non-finite output of sublayer %d (layer %d, %s)", idx, idx / 2,
                          idx % 2 ? "channel mixer" : "token mixer");
        TRY(cp_agree(m, ss, LM_ERR_NUMERIC, "a failed sublayer"));
        charge(m, sublayer_part(ls, idx), &t0);
        if (note_in_add) {
            TRY(op->attnres_add_output_note(be, m->ar, idx, m->y, 2 * idx + 1));
            m->checks_pending = 1;
        } else {
            TRY(op->attnres_add_output(be, m->ar, idx, m->y));
        }
        charge(m, LM_TIME_ATTNRES, &t0);
    }
    *tp = t0;
    return LM_OK;
}

static lm_status run_layers_forward(lm_model *m, const int32_t *tokens, int training) {
    const int64_t N = m->N;
    const int d = m->d, V = m->cfg.vocab_size;
    lm_status vs = LM_OK;
    for (int64_t i = 0; i < N && !vs; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            vs = lm_error(LM_ERR_ARG, "token %d at position %lld is outside the vocabulary [0, %d)", tokens[i],
                          (long long)i, V);
    TRY(cp_agree(m, vs, LM_ERR_ARG, "a token outside the vocabulary"));
    if (m->dry) return lm_error(LM_ERR_ARG, "model: a plan (lm_model_plan) has no memory to run on");
    m->fwd_live = 0;
    TRY(sync_before_forward(m));
    /* checks a forward that stopped early left noted are dropped; this one's are taken after the layers */
    TRY(take_checks(m, 1));
    const int defer = defers_checks(m);
    double t0 = time_start(m);
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    TRY(be->upload(be, m->tokens, tokens, (size_t)N * sizeof(int32_t)));
    TRY(op->embedding_forward(be, m->x0, par_at(m, m->embed_off), m->tokens, N, d));
    if (m->fault == LM_FAULT_BATCH) {
        const float nan = NAN;
        TRY(be->upload(be, m->x0, &nan, sizeof nan));
        m->fault = LM_FAULT_NONE;
    }
    charge(m, LM_TIME_NORMS, &t0);
    lm_attnres_params arp = attnres_params(m);
    TRY(op->attnres_begin(be, m->ar, m->x0));
    m->aux_loss = 0;
    lm_status ss = run_sublayers(m, training, defer, &arp, &t0);
    /* the deferred checks, one wait for every sublayer's: the first failure they noted comes
     * before a later op's own refusal of the NaN it was handed, and is the one reported */
    if (m->checks_pending) {
        char why[512];
        snprintf(why, sizeof why, "%s", ss ? lm_last_error() : "");
        lm_status ck = take_checks(m, 0);
        if (ck == LM_ERR_NUMERIC) return ck;
        if (ss) return lm_error(ss, "%s", why);
        TRY(ck);
    }
    TRY(ss);
    TRY(op->attnres_final(be, m->ar, &arp, m->hf));
    charge(m, LM_TIME_ATTNRES, &t0);
    TRY(op->rmsnorm_forward(be, m->hn, m->sep ? m->hn_lp : NULL, m->rstd_final, m->hf, par_at(m, m->final_norm_off), N,
                            d, m->cfg.norm_eps));
    charge(m, LM_TIME_NORMS, &t0);
    m->fwd_live = 1;
    return LM_OK;
}

static lm_status model_forward(lm_model *m, const int32_t *tokens, const int32_t *targets, int training,
                               float *loss);

/* ---- sequence segments: the loops ---- */

static lm_status model_backward(lm_model *m, const float *dlogp, float loss_scale);

static lm_status seg_check_tokens(const lm_model *m, const int32_t *tokens) {
    const int V = m->cfg.vocab_size;
    if (!tokens) return lm_error(LM_ERR_ARG, "model: tokens is NULL");
    for (int64_t i = 0; i < m->Nq; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return lm_error(LM_ERR_ARG, "token %d at position %lld is outside the vocabulary [0, %d)", tokens[i],
                            (long long)i, V);
    return LM_OK;
}

/* Enter segment s: its sizes, its residual state, its rows of the tokens (and targets). */
static void seg_enter(lm_model *m, int s, int with_targets) {
    /* with_targets: q_tgt holds the rows' targets */
    const int t0 = s * m->S, n = m->Tq - t0 < m->S ? m->Tq - t0 : m->S;
    m->seg_active = 1;
    m->seg = s;
    m->seg_t0 = t0;
    m->T = n;
    m->N = (int64_t)m->B * n;
    m->ar = n == m->S ? m->ar_full : m->ar_tail;
    for (int b = 0; b < m->B; b++) {
        memcpy(m->seg_tok + (size_t)b * n, m->q_tok + (size_t)b * m->Tq + t0, (size_t)n * sizeof(int32_t));
        if (with_targets)
            memcpy(m->seg_tgt + (size_t)b * n, m->q_tgt + (size_t)b * m->Tq + t0, (size_t)n * sizeof(int32_t));
    }
}

/* Back to the sizes of the buffers. */
static void seg_leave(lm_model *m) {
    m->seg_active = 0;
    m->seg = 0;
    m->seg_t0 = 0;
    m->T = m->S;
    m->N = (int64_t)m->B * m->S;
    m->ar = m->ar_full;
}

/* Segment s's forward: every layer, then (loss_sum != NULL) the sum of its cross-entropy. */
/* The LM head and the chunked cross-entropy (log-sum-exp in fp32) on the
 * final hidden states: *loss_sum and what the backward needs. With
 * head_scale > 0 its backward too, with the arguments model_backward would
 * pass (the same bits; the backend's fused pass computes each chunk's logits
 * once), which model_backward then takes as done. */
static lm_status head_forward(lm_model *m, float head_scale, double *loss_sum) {
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    const int64_t N = m->N;
    const int d = m->d, V = m->cfg.vocab_size;
    double t0 = time_start(m);
    const void *hn_lp = lp_or(m, m->hn, m->hn_lp), *head_lp = lp_param(m, par_at(m, m->head_off));
    m->head_done = 0;
    if (head_scale > 0.0f) {
        const float g = head_scale / (float)m->Nq;
        float *dhead = grad_at(m, m->head_off);
        TRY(be->zero(be, m->dhn, (size_t)N * d * sizeof(float)));
        if (op->cross_entropy_forward_backward) {
            TRY(op->cross_entropy_forward_backward(be, m->lse_rows, m->target_logit, loss_sum, m->dhn, dhead, hn_lp,
                                                   head_lp, m->targets, g, N, d, V, m->logits));
        } else {
            TRY(op->cross_entropy_forward(be, m->lse_rows, m->target_logit, loss_sum, hn_lp, head_lp, m->targets, N,
                                          d, V, m->logits));
            TRY(op->cross_entropy_backward(be, m->dhn, dhead, hn_lp, head_lp, m->targets, m->lse_rows, NULL, g, N, d,
                                           V, m->logits));
        }
        m->head_done = 1;
        m->head_done_scale = head_scale;
    } else {
        TRY(op->cross_entropy_forward(be, m->lse_rows, m->target_logit, loss_sum, hn_lp, head_lp, m->targets, N, d, V,
                                      m->logits));
    }
    charge(m, LM_TIME_LM_HEAD, &t0);
    return LM_OK;
}

/* Segment s's layers (not with layers = 0: the buffers still hold them); with
 * loss_sum its head too (head_scale > 0: and the head's backward, for the
 * segmented backward, which knows its scale). */
static lm_status seg_run(lm_model *m, int s, int layers, int training, double *loss_sum, float head_scale) {
    seg_enter(m, s, 1);
    if (layers) TRY(run_layers_forward(m, m->seg_tok, training));
    if (!loss_sum) return LM_OK;
    lm_backend *be = m->be;
    TRY(be->upload(be, m->targets, m->seg_tgt, (size_t)m->N * sizeof(int32_t)));
    return head_forward(m, head_scale, loss_sum);
}

/* The forward in segments: the loss is the mean over every token of the rows,
 * the balancer counts each token once, the logit maxima are the rows'. */
static lm_status seg_forward(lm_model *m, const int32_t *tokens, const int32_t *targets, int training,
                             float *loss) {
    if (!targets)
        return lm_error(LM_ERR_ARG, "model: with train.seq_segment a forward needs targets (a segmented forward "
                                    "gives a loss, not the final hidden states of the whole rows)");
    TRY(seg_check_tokens(m, tokens));
    memcpy(m->q_tok, tokens, (size_t)m->Nq * sizeof(int32_t));
    memcpy(m->q_tgt, targets, (size_t)m->Nq * sizeof(int32_t));
    m->seg_kept = m->seg_live = 0;
    double total = 0;
    lm_status st = LM_OK;
    for (int s = 0; s < m->n_seg && !st; s++) {
        double part = 0;
        st = seg_run(m, s, 1, training, &part, 0.0f);
        total += part;
    }
    seg_leave(m);
    TRY(st);
    m->seg_kept = 1; /* every segment's attention output, for the backward */
    m->seg_live = 1; /* and the last segment's activations */
    float ce = (float)(total / (double)m->Nq);
    if (!isfinite(ce)) return lm_error(LM_ERR_NUMERIC, "non-finite loss");
    m->have_targets = 1;
    if (loss) *loss = ce;
    return LM_OK;
}

/* The backward in segments, last to first: each segment's forward again from
 * its saved carries, then its backward, which hands the gradients of its
 * incoming carry to the segment before and adds its attention's key and value
 * gradients to the whole rows' accumulators. */
static lm_status seg_backward(lm_model *m, float loss_scale) {
    lm_backend *be = m->be;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) {
            size_t st, ha;
            seg_kda_sizes(m, ls, &st, &ha);
            TRY(be->zero(be, ls->seg_dh[0], st * sizeof(float)));
            if (ha) TRY(be->zero(be, ls->seg_dhalo[0], ha * sizeof(float)));
        } else if (ls->seg_latent) {
            const size_t kl = (size_t)ls->mla_cfg.kv_lora, r = (size_t)ls->mla_cfg.rope_dims;
            TRY(be->zero(be, ls->seg_dc, (size_t)m->Nq * kl * sizeof(float)));
            if (r) TRY(be->zero(be, ls->seg_dkr, (size_t)m->Nq * r * sizeof(float)));
        } else {
            size_t ke, ve;
            lm_mla_seg_row_elems(&ls->mla_cfg, &ke, &ve);
            TRY(be->zero(be, ls->seg_dk, (size_t)m->Nq * ke * sizeof(float)));
            TRY(be->zero(be, ls->seg_dv, (size_t)m->Nq * ve * sizeof(float)));
        }
    }
    m->seg_parity = 0;
    /* the forward's kept attention outputs serve every segment's forward again */
    m->seg_reuse = m->seg_kept;
    const int live = m->seg_live;
    m->seg_live = 0;
    lm_status st = LM_OK;
    for (int s = m->n_seg - 1; s >= 0 && !st; s--) {
        double unused = 0;
        /* the segment's forward again (but the forward's last segment, still in the buffers), its head's
         * backward with it (each chunk's logits once) */
        st = seg_run(m, s, !(s == m->n_seg - 1 && live), 0, &unused, loss_scale);
        m->have_targets = 1;
        if (!st) st = model_backward(m, NULL, loss_scale);
        m->seg_parity ^= 1;
    }
    seg_leave(m);
    m->seg_reuse = 0;
    m->have_targets = 0;
    return st;
}

/* lm_model_score in segments. */
static lm_status seg_score(lm_model *m, const int32_t *tokens, const int32_t *targets, double *nll,
                           int32_t *argmax) {
    TRY(seg_check_tokens(m, tokens));
    memcpy(m->q_tok, tokens, (size_t)m->Nq * sizeof(int32_t));
    memcpy(m->q_tgt, targets, (size_t)m->Nq * sizeof(int32_t));
    m->seg_kept = m->seg_live = 0; /* its forwards overwrite the kept attention outputs and activations */
    lm_backend *be = m->be;
    const int on_host = be->device == LM_DEVICE_CPU;
    lm_status st = LM_OK;
    for (int s = 0; s < m->n_seg && !st; s++) {
        st = seg_run(m, s, 1, 0, NULL, 0.0f);
        const int64_t N = m->N;
        const int n = m->T, t0 = m->seg_t0;
        double t1 = lm_time_seconds();
        if (!st) st = be->upload(be, m->targets, m->seg_tgt, (size_t)N * sizeof(int32_t));
        if (!st)
            st = be->ops->score_forward(be, on_host ? m->seg_nll : m->score_nll, on_host ? m->seg_arg : m->score_arg,
                                        lp_or(m, m->hn, m->hn_lp), lp_param(m, par_at(m, m->head_off)), m->targets, N,
                                        m->d, m->cfg.vocab_size, m->logits);
        if (!st && !on_host) st = be->download(be, m->seg_nll, m->score_nll, (size_t)N * sizeof(double));
        if (!st && !on_host) st = be->download(be, m->seg_arg, m->score_arg, (size_t)N * sizeof(int32_t));
        charge(m, LM_TIME_LM_HEAD, &t1);
        for (int b = 0; !st && b < m->B; b++) {
            memcpy(nll + (size_t)b * m->Tq + t0, m->seg_nll + (size_t)b * n, (size_t)n * sizeof(double));
            memcpy(argmax + (size_t)b * m->Tq + t0, m->seg_arg + (size_t)b * n, (size_t)n * sizeof(int32_t));
        }
    }
    seg_leave(m);
    m->have_targets = 0;
    return st;
}

/* Under expert parallelism a training forward is collective: every MoE layer
 * starts with an agreement of the ranks. A rank that fails before the last
 * MoE layer joins the agreement of the next MoE layer it has not reached, so
 * the other ranks learn of the failure there instead of waiting in the
 * exchange (and fail too). With context parallelism as well, the ranks of a
 * context-parallel group fail together at each sublayer's agreement (cp_agree)
 * and each then joins that next agreement of its own expert-parallel group,
 * whatever the two groupings: every rank of an EP group meets the failure at
 * the same MoE layer, so none waits in an exchange. */
lm_status lm_model_forward(lm_model *m, const int32_t *tokens, const int32_t *targets, int training,
                           float *loss) {
    m->ep_next = 0;
    m->ep_together = 0;
    lm_status s = model_forward(m, tokens, targets, training, loss);
    return m->ep_comm && (training || ep_streams(m)) ? ep_join(m, s) : s;
}

static lm_status model_forward(lm_model *m, const int32_t *tokens, const int32_t *targets, int training,
                               float *loss) {
    const int64_t N = m->N;
    const int V = m->cfg.vocab_size;
    m->have_targets = 0;
    m->head_done = 0;
    lm_status vs = LM_OK;
    for (int64_t i = 0; targets && i < m->Nq && !vs; i++)
        if (targets[i] < 0 || targets[i] >= V)
            vs = lm_error(LM_ERR_ARG, "target %d at position %lld is outside the vocabulary [0, %d)", targets[i],
                          (long long)i, V);
    TRY(cp_agree(m, vs, LM_ERR_ARG, "a target outside the vocabulary"));
    if (m->seg_on) return seg_forward(m, tokens, targets, training, loss);
    TRY(run_layers_forward(m, tokens, training));
    if (!targets) return LM_OK;
    TRY(m->be->upload(m->be, m->targets, targets, (size_t)N * sizeof(int32_t)));
    /* the head; with a loss scale set for training (lm_model_set_head_backward), its backward too */
    double total = 0;
    TRY(head_forward(m, training ? m->head_scale : 0.0f, &total));
    float ce = (float)(total / (double)N);
    if (!isfinite(ce)) return lm_error(LM_ERR_NUMERIC, "non-finite loss");
    m->have_targets = 1;
    if (loss) *loss = ce;
    return LM_OK;
}

lm_status lm_model_token_logprobs(const lm_model *m, float *logp) {
    if (!m->have_targets) return lm_error(LM_ERR_ARG, "token log-probabilities need a forward with targets first");
    if (!logp) return lm_error(LM_ERR_ARG, "logp is NULL");
    if (m->seg_on)
        return lm_error(LM_ERR_ARG, "token log-probabilities do not come out of a forward with train.seq_segment");
    if (m->be->device != LM_DEVICE_CPU) {
        /* both rows come back to the host in one copy each (hn_host holds N*d >= N floats) */
        TRY(m->be->download(m->be, logp, m->target_logit, (size_t)m->N * sizeof(float)));
        TRY(m->be->download(m->be, m->hn_host, m->lse_rows, (size_t)m->N * sizeof(float)));
        for (int64_t i = 0; i < m->N; i++) logp[i] -= m->hn_host[i];
        return LM_OK;
    }
    for (int64_t i = 0; i < m->N; i++) logp[i] = m->target_logit[i] - m->lse_rows[i];
    return LM_OK;
}

/* The forward of Block AttnRes block k again, before its backward (m->replay):
 * each sublayer's input from the residual state (the forward's own
 * arithmetic, so the same bits), its norm and its recomputed forward, whose
 * output rebuilds the block's partial sums in the state. */
static lm_status replay_block(lm_model *m, int k) {
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    const int S = m->cfg.attnres_block;
    const int last = (k + 1) * S - 1 < m->L2 - 1 ? (k + 1) * S - 1 : m->L2 - 1;
    lm_attnres_params arp = attnres_params(m);
    double t0 = time_start(m);
    TRY(op->attnres_replay_block(be, m->ar, k));
    for (int l = k * S; l <= last; l++) {
        layer_state *ls = &m->layers[l / 2];
        float *hin = hin_of(m, l), *xn = xn_of(m, l);
        void *xn_lp = xn_lp_of(m, l);
        TRY(sublayer_input(m, l, &arp, hin, xn, xn_lp, 0, &t0));
        TRY(sublayer_forward(m, ls, l, xn, xn_lp, m->y, 0, 1));
        charge(m, sublayer_part(ls, l), &t0);
        TRY(op->attnres_add_output(be, m->ar, l, m->y));
        charge(m, LM_TIME_ATTNRES, &t0);
    }
    return LM_OK;
}

void lm_model_set_grad_ready_hook(lm_model *m, lm_grad_ready_fn fn, void *user) {
    m->grad_ready = fn;
    m->grad_ready_user = user;
}

/* The backward has written [off, end) of the gradient block for the last time
 * (lm_model_set_grad_ready_hook). In segments only the first segment's
 * backward, the last to run, counts. LM_FAULT_GRADIENT's NaN goes in here,
 * after the last write to its element, so that a hook summing the range sees it. */
static lm_status grads_final(lm_model *m, size_t off, size_t end, double *t0) {
    if (m->seg_active && m->seg != 0) return LM_OK;
    const size_t mid = m->n_params / 2;
    if (m->fault == LM_FAULT_GRADIENT && mid >= off && mid < end) {
        /* the middle element of the parameter block, where this rank keeps its gradient */
        const float nan = NAN;
        float *g = grad_at(m, mid);
        if (g) TRY(m->be->upload(m->be, g, &nan, sizeof nan));
        m->fault = LM_FAULT_NONE;
    }
    if (!m->grad_ready || end <= off) return LM_OK;
    /* the hook's time (a sum over ranks) is charged to no part of the model */
    const double h = lm_time_seconds();
    lm_status st = m->grad_ready(m->grad_ready_user, off, end - off);
    *t0 += lm_time_seconds() - h;
    return st;
}

/* Where layer l's tensors end: the next layer's, the AttnRes tensors' or final_norm's start. */
static size_t layer_end(const lm_model *m, int l) {
    if (l + 1 < m->cfg.n_layers) return m->layers[l + 1].mixer_norm_off;
    return m->has_attnres_params ? m->ar_query_off : m->final_norm_off;
}

/* dlogp NULL: the mean cross-entropy scaled by loss_scale, i.e. dLoss/dlog p
 * = -loss_scale / N at every position; else dlogp[i] per position. loss_scale
 * also scales the auxiliary balance loss. */
static lm_status model_backward(lm_model *m, const float *dlogp, float loss_scale) {
    if (!m->have_targets) return lm_error(LM_ERR_ARG, "backward needs a forward with targets first");
    if (m->seg_on && !m->seg_active) {
        if (dlogp)
            return lm_error(LM_ERR_ARG, "a backward with per-position weights does not run with train.seq_segment");
        return seg_backward(m, loss_scale);
    }
    const int64_t N = m->N;
    const int d = m->d, V = m->cfg.vocab_size;
    const float eps = m->cfg.norm_eps;
    /* LM head: recompute each chunk's logits, dlogits = (softmax - onehot) * g with
     * g = -dLoss/dlog p(target) (scale / N for the mean cross-entropy) */
    lm_backend *be = m->be;
    const lm_ops *op = be->ops;
    double t0 = time_start(m);
    if (m->head_done) {
        /* the forward ran the head's backward (lm_model_set_head_backward): dhn and dhead are done */
        if (dlogp || loss_scale != m->head_done_scale)
            return lm_error(LM_ERR_ARG,
                            "backward: the forward ran the LM head's backward with loss scale %g "
                            "(lm_model_set_head_backward); this backward asks %s %g",
                            (double)m->head_done_scale, dlogp ? "per-position weights, not" : "loss scale",
                            (double)loss_scale);
        m->head_done = 0;
    } else {
        TRY(be->zero(be, m->dhn, (size_t)N * d * sizeof(float)));
        const float *row_scale = dlogp;
        if (dlogp && be->device != LM_DEVICE_CPU) {
            TRY(be->upload(be, m->row_scale, dlogp, (size_t)N * sizeof(float)));
            row_scale = m->row_scale;
        }
        TRY(op->cross_entropy_backward(be, m->dhn, grad_at(m, m->head_off), lp_or(m, m->hn, m->hn_lp),
                                       lp_param(m, par_at(m, m->head_off)), m->targets, m->lse_rows, row_scale,
                                       dlogp ? -1.0f : loss_scale / (float)m->Nq, N, d, V, m->logits));
    }
    charge(m, LM_TIME_LM_HEAD, &t0);
    /* a tied head is the embedding, written again at the end */
    if (!m->cfg.tie_embeddings) TRY(grads_final(m, m->head_off, m->head_off + (size_t)V * d, &t0));
    TRY(be->zero(be, m->dhf, (size_t)N * d * sizeof(float)));
    TRY(op->rmsnorm_backward(be, m->dhf, grad_at(m, m->final_norm_off), m->dhn, m->hf, par_at(m, m->final_norm_off),
                             m->rstd_final, N, d, eps));
    charge(m, LM_TIME_NORMS, &t0);
    TRY(grads_final(m, m->final_norm_off, m->final_norm_off + (size_t)d, &t0));
    lm_attnres_params arp = attnres_params(m);
    lm_attnres_grads arg = {NULL, NULL};
    if (m->has_attnres_params) {
        arg.query = grad_at(m, m->ar_query_off);
        arg.key_norm = grad_at(m, m->ar_key_off);
    }
    TRY(op->attnres_final_backward(be, m->ar, &arp, m->dhf, &arg));
    charge(m, LM_TIME_ATTNRES, &t0);
    const int S = m->cfg.attnres_block;
    /* recompute: each shared activation set (KDA, attention, dense FFN, MoE) still holds the forward's last
     * layer of its kind, the first this backward meets, which then skips its forward again (not under
     * context or expert parallelism, whose forwards exchange, nor for chunked channel mixers: the set
     * holds the last chunk only) */
    unsigned live = m->fwd_live && !m->cp_comm && !m->ep_comm ? 0xfu : 0u;
    m->fwd_live = 0;
    for (int idx = m->L2 - 1; idx >= 0; idx--) {
        layer_state *ls = &m->layers[idx / 2];
        float *hin = hin_of(m, idx), *xn = xn_of(m, idx);
        void *xn_lp = xn_lp_of(m, idx);
        if (m->replay && (idx % S == S - 1 || idx == m->L2 - 1)) TRY(replay_block(m, idx / S));
        if (op->attnres_output_grad) {
            /* a view of the state's accumulator: no zeroing, no copy */
            TRY(op->attnres_output_grad(be, m->ar, idx, &m->dy_cur, &m->dy_lp_cur));
        } else {
            TRY(be->zero(be, m->dy, (size_t)N * d * sizeof(float)));
            TRY(op->attnres_output_backward(be, m->ar, idx, m->dy));
            m->dy_cur = m->dy;
            m->dy_lp_cur = NULL;
        }
        charge(m, LM_TIME_ATTNRES, &t0);
        const size_t norm_off = idx % 2 ? ls->ffn_norm_off : ls->mixer_norm_off;
        if (rc_sub(m, idx)) {
            /* the sublayer's input again (recompute_chunk, or with its norm: from the residual
             * state), then its normalised input: the forward's own op on it */
            TRY(sublayer_input(m, idx, &arp, hin, xn, xn_lp, 1, &t0));
        } else if (m->lean_hin && !m->fuse_norm) {
            /* a sublayer not recomputed keeps its normalised input; its norm's backward reads the input,
             * of which recompute_chunk keeps one buffer */
            TRY(op->attnres_recompute_input(be, m->ar, idx, hin));
            charge(m, LM_TIME_ATTNRES, &t0);
        }
        /* dxn is written by the whole rows' KDA and MLA backwards (their first product sets it) and by the
         * channel mixers (each chunk's rows: the dense FFN's first product sets them, the MoE writes them);
         * the segments' and context parallelism's token mixers add to it */
        if (idx % 2 == 0 && (m->cp_comm || m->seg_active))
            TRY(be->zero(be, m->dxn, (size_t)N * d * sizeof(float)));
        /* the shared set of this sublayer's kind: 1 KDA, 2 attention, 4 dense FFN, 8 MoE */
        const unsigned set = idx % 2 == 0 ? (ls->mixer == LM_MIXER_KDA ? 1u : 2u) : (ls->moe ? 8u : 4u);
        const int again = rc_sub(m, idx) && !((live & set) && (idx % 2 == 0 || m->chunk >= N));
        live &= ~set;
        if (idx % 2 == 0) {
            /* the recomputed output goes to y, unused in the backward */
            if (again) TRY(sublayer_forward(m, ls, idx, xn, xn_lp, m->y, 0, 1));
            if (m->cp_comm && ls->mixer == LM_MIXER_KDA)
                TRY(lm_kda_layer_cp_backward_lp(m->cp_comm, &ls->kda_cfg, &ls->kda_P, &ls->kda_PL, &ls->kda_G, xn_lp,
                                                ls->cp_acts, m->dy_cur, m->B, m->cp_t0, m->T, m->dxn, m->cp_scratch));
            else if (m->cp_comm)
                TRY(lm_mla_cp_backward_lp(m->cp_comm, &ls->mla_cfg, &ls->mla_P, &ls->mla_PL, xn_lp, ls->cp_acts,
                                          m->dy_cur, m->B, m->cp_t0, m->T, m->dxn, &ls->mla_G, m->cp_scratch));
            else if (m->seg_active && ls->mixer == LM_MIXER_KDA) {
                /* the gradients of this segment's outgoing carry in (set seg_parity), of its incoming one out */
                lm_kda_layer_carry cr = seg_kda_carry(m, ls);
                const int c0 = m->seg_parity;
                lm_kda_layer_carry_grad cg = {ls->seg_dh[c0], ls->seg_dh[!c0], ls->seg_dhalo[c0], ls->seg_dhalo[!c0]};
                TRY(lm_kda_layer_backward_seg(&ls->kda_cfg, &ls->kda_P, &ls->kda_PL, &ls->kda_G, &ls->kda_a, xn_lp,
                                              m->dy_cur, m->B, m->T, &cr, &cg, m->dxn, m->scratch));
            } else if (m->seg_active) {
                lm_mla_seg sg = seg_mla(m, ls);
                TRY(lm_mla_backward_seg(&ls->mla_cfg, &ls->mla_P, &ls->mla_PL, xn_lp, ls->mla_acts, m->dy_cur, m->B, m->T,
                                        &sg, m->dxn, &ls->mla_G, m->scratch));
            } else if (ls->mixer == LM_MIXER_KDA)
                TRY(lm_kda_layer_backward_lp(&ls->kda_cfg, &ls->kda_P, &ls->kda_PL, &ls->kda_G, &ls->kda_a, xn_lp,
                                             m->dy_cur, m->dy_lp_cur, m->B, m->T, m->dxn, m->scratch));
            else
                TRY(lm_mla_backward_lp(&ls->mla_cfg, &ls->mla_P, &ls->mla_PL, xn_lp, ls->mla_acts, m->dy_cur,
                                       m->dy_lp_cur, m->B, m->T, m->dxn, &ls->mla_G, m->scratch));
        } else {
            /* the channel mixer chunk by chunk: each chunk's forward again, then its backward */
            for (int64_t c0 = 0; c0 < N; c0 += m->chunk) {
                if (again) TRY(channel_forward(m, ls, idx, xn, xn_lp, m->y, c0, 0, 1));
                TRY(channel_backward(m, ls, xn, xn_lp, c0, loss_scale));
            }
        }
        charge(m, sublayer_part(ls, idx), &t0);
        if (m->fuse_norm) {
            TRY(op->attnres_input_norm_backward(be, m->ar, idx, &arp, m->dxn, par_at(m, norm_off),
                                                m->rstd + (size_t)idx * N, grad_at(m, norm_off), &arg));
        } else {
            TRY(op->rmsnorm_backward_set(be, m->dh, grad_at(m, norm_off), m->dxn, hin, par_at(m, norm_off),
                                         m->rstd + (size_t)idx * N, N, d, eps));
            charge(m, LM_TIME_NORMS, &t0);
            TRY(op->attnres_input_backward(be, m->ar, idx, &arp, m->dh, &arg));
        }
        charge(m, LM_TIME_ATTNRES, &t0);
        /* the sublayer's norm and tensors are done (the AttnRes rows are not: every sublayer writes its own) */
        if (idx % 2) TRY(dw_settle(m, ls));
        if (idx % 2) TRY(grads_final(m, ls->ffn_norm_off, layer_end(m, idx / 2), &t0));
        else TRY(grads_final(m, ls->mixer_norm_off, ls->ffn_norm_off, &t0));
    }
    if (m->has_attnres_params) TRY(grads_final(m, m->ar_query_off, m->final_norm_off, &t0));
    TRY(be->zero(be, m->dx0, (size_t)N * d * sizeof(float)));
    TRY(op->attnres_embedding_backward(be, m->ar, m->dx0));
    charge(m, LM_TIME_ATTNRES, &t0);
    /* scatter into the embedding rows, in token order (deterministic) */
    TRY(op->embedding_backward(be, grad_at(m, m->embed_off), m->dx0, m->tokens, N, d, V));
    charge(m, LM_TIME_NORMS, &t0);
    TRY(grads_final(m, m->embed_off, m->embed_off + (size_t)V * d, &t0));
    m->have_targets = 0;
    return LM_OK;
}

lm_status lm_model_backward(lm_model *m, float loss_scale) { return model_backward(m, NULL, loss_scale); }

lm_status lm_model_set_head_backward(lm_model *m, float loss_scale) {
    if (!m) return lm_error(LM_ERR_ARG, "set_head_backward: model is NULL");
    if (!(loss_scale >= 0.0f) || !isfinite(loss_scale))
        return lm_error(LM_ERR_ARG, "set_head_backward: loss scale %g (expected a finite value >= 0; 0: off)",
                        (double)loss_scale);
    m->head_scale = loss_scale;
    return LM_OK;
}

lm_status lm_model_backward_weighted(lm_model *m, const float *dlogp) {
    lm_status vs = dlogp ? LM_OK : lm_error(LM_ERR_ARG, "dlogp is NULL");
    if (!vs && m->seg_on)
        vs = lm_error(LM_ERR_ARG, "a backward with per-position weights does not run with train.seq_segment");
    for (int64_t i = 0; !vs && i < m->N; i++)
        if (!isfinite(dlogp[i])) vs = lm_error(LM_ERR_ARG, "dlogp[%lld] is not finite", (long long)i);
    TRY(cp_agree(m, vs, LM_ERR_ARG, "a bad dlogp"));
    return model_backward(m, dlogp, 1.0f);
}

/* lm_model_logits and lm_model_score on a model whose evaluation forwards
 * gather layer by layer are collective over the expert-parallel group: a
 * failure joins the group's next agreement (ep_join, as lm_model_forward). */
static lm_status model_logits(lm_model *m, const int32_t *tokens, float *logits);
static lm_status model_score(lm_model *m, const int32_t *tokens, const int32_t *targets, double *nll,
                             int32_t *argmax);
lm_status lm_model_logits(lm_model *m, const int32_t *tokens, float *logits) {
    m->ep_next = 0;
    m->ep_together = 0;
    lm_status s = model_logits(m, tokens, logits);
    return ep_streams(m) ? ep_join(m, s) : s;
}
lm_status lm_model_score(lm_model *m, const int32_t *tokens, const int32_t *targets, double *nll, int32_t *argmax) {
    m->ep_next = 0;
    m->ep_together = 0;
    lm_status s = model_score(m, tokens, targets, nll, argmax);
    return ep_streams(m) ? ep_join(m, s) : s;
}

static lm_status model_logits(lm_model *m, const int32_t *tokens, float *logits) {
    if (m->seg_on)
        return lm_error(LM_ERR_ARG, "lm_model_logits does not run with train.seq_segment (use lm_model_score)");
    TRY(run_layers_forward(m, tokens, 0));
    m->have_targets = 0;
    const float *hn = m->hn;
    if (m->be->device != LM_DEVICE_CPU) {
        /* evaluation sizes: the final states come back, the head runs on the host */
        TRY(m->be->download(m->be, m->hn_host, m->hn, (size_t)m->N * m->d * sizeof(float)));
        hn = m->hn_host;
    }
    lm_matmul_forward(logits, hn, lm_model_host_param(m, m->head_off), NULL, m->N, m->d, m->cfg.vocab_size);
    return LM_OK;
}

static lm_status model_score(lm_model *m, const int32_t *tokens, const int32_t *targets, double *nll,
                             int32_t *argmax) {
    const int64_t N = m->N;
    const int d = m->d, V = m->cfg.vocab_size;
    lm_status vs = LM_OK;
    if (!tokens || !targets || !nll || !argmax)
        vs = lm_error(LM_ERR_ARG, "lm_model_score: tokens, targets, nll and argmax must not be NULL");
    for (int64_t i = 0; !vs && i < m->Nq; i++)
        if (targets[i] < 0 || targets[i] >= V)
            vs = lm_error(LM_ERR_ARG, "target %d at position %lld is outside the vocabulary [0, %d)", targets[i],
                          (long long)i, V);
    TRY(cp_agree(m, vs, LM_ERR_ARG, "a bad argument of lm_model_score"));
    if (m->seg_on) return seg_score(m, tokens, targets, nll, argmax);
    TRY(run_layers_forward(m, tokens, 0));
    m->have_targets = 0; /* nothing here for a backward */
    lm_backend *be = m->be;
    double t0 = time_start(m);
    TRY(be->upload(be, m->targets, targets, (size_t)N * sizeof(int32_t)));
    const int on_host = be->device == LM_DEVICE_CPU;
    TRY(be->ops->score_forward(be, on_host ? nll : m->score_nll, on_host ? argmax : m->score_arg,
                               lp_or(m, m->hn, m->hn_lp), lp_param(m, par_at(m, m->head_off)), m->targets, N, d, V,
                               m->logits));
    if (!on_host) {
        TRY(be->download(be, nll, m->score_nll, (size_t)N * sizeof(double)));
        TRY(be->download(be, argmax, m->score_arg, (size_t)N * sizeof(int32_t)));
    }
    charge(m, LM_TIME_LM_HEAD, &t0);
    return LM_OK;
}

lm_status lm_model_qk_clip(lm_model *m, float tau, float *max_logit, int *n_clipped) {
    float mx = -INFINITY;
    int clipped = 0, changed = 0;
    const int on_backend = m->params_on_backend_newer && m->P != m->params;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer != LM_MIXER_MLA) continue;
        const lm_mla_config *c = &ls->mla_cfg;
        int H = c->n_heads, seen = 1, k = 0;
        for (int h = 0; h < H; h++) {
            mx = ls->smax[h] > mx ? ls->smax[h] : mx;
            seen &= isfinite(ls->smax[h]);
        }
        if (tau > 0 && seen && on_backend) {
            /* the newest parameters are the backend's: clip the same rows there */
            if (c->kind == LM_ATTN_MLA)
                TRY(lm_qk_clip_mla_on(m->be, ls->mla_P.W_uq, ls->mla_P.W_uk, H, c->head_dim_qk,
                                      c->rope_dims, c->q_lora, c->kv_lora, ls->smax, tau, NULL, &k));
            else
                TRY(lm_qk_clip_gqa_on(m->be, ls->mla_P.W_q, ls->mla_P.W_k, H, c->n_kv_heads,
                                      c->head_dim_qk, c->d_model, ls->smax, tau, NULL, &k));
            clipped += k;
            changed |= k > 0;
        } else if (tau > 0 && seen) {
            if (c->kind == LM_ATTN_MLA)
                TRY(lm_qk_clip_mla(ls->mla_p.W_uq, ls->mla_p.W_uk, H, c->head_dim_qk, c->rope_dims, c->q_lora,
                                   c->kv_lora, ls->smax, tau, NULL, &k));
            else
                TRY(lm_qk_clip_gqa(ls->mla_p.W_q, ls->mla_p.W_k, H, c->n_kv_heads, c->head_dim_qk, c->d_model,
                                   ls->smax, tau, NULL, &k));
            clipped += k;
        }
        for (int h = 0; h < H; h++) ls->smax[h] = -INFINITY;
    }
    /* the product-format copy follows the clipped rows */
    if (on_backend && changed) TRY(lm_model_params_changed_on_backend(m));
    if (max_logit) *max_logit = mx;
    if (n_clipped) *n_clipped = clipped;
    return LM_OK;
}

int lm_model_qk_max_count(const lm_model *m) {
    int n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].mixer == LM_MIXER_MLA) n += m->layers[l].mla_cfg.n_heads;
    return n;
}

void lm_model_qk_max_get(const lm_model *m, float *out) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const layer_state *ls = &m->layers[l];
        if (ls->mixer != LM_MIXER_MLA) continue;
        memcpy(out, ls->smax, (size_t)ls->mla_cfg.n_heads * sizeof(float));
        out += ls->mla_cfg.n_heads;
    }
}

void lm_model_qk_max_set(lm_model *m, const float *in) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer != LM_MIXER_MLA) continue;
        memcpy(ls->smax, in, (size_t)ls->mla_cfg.n_heads * sizeof(float));
        in += ls->mla_cfg.n_heads;
    }
}

void lm_model_shape(const lm_model *m, int *B, int *T) {
    *B = m->B;
    *T = m->Tq;
}

lm_status lm_model_copy_state(lm_model *dst, const lm_model *src) {
    if (dst->n_params != src->n_params || dst->n_tensors != src->n_tensors)
        return lm_error(LM_ERR_ARG, "copying model state between different architectures (%zu vs %zu parameters)",
                        dst->n_params, src->n_params);
    if (src->params_on_backend_newer)
        return lm_error(LM_ERR_ARG, "copying model state: the source's newest parameters are on its backend "
                                    "(lm_model_download_params first)");
    if (!dst->pcut && !src->pcut) {
        memcpy(dst->params, src->params, src->n_params * sizeof(float));
    } else {
        /* owner-only expert weights on either side: each tensor's kept part of
         * dst from src, which must hold it (the same cut, or src whole) */
        for (int i = 0; i < dst->n_tensors; i++) {
            size_t a, n, sa, sn;
            float *to = lm_model_param_part(dst, i, &a, &n);
            const float *from = lm_model_param_part((lm_model *)src, i, &sa, &sn);
            if (a < sa || a + n > sa + sn)
                return lm_error(LM_ERR_ARG, "copying model state: the destination keeps elements [%zu, %zu) of %s, "
                                "the source only [%zu, %zu) (owner-only expert weights of another position)", a,
                                a + n, dst->tensors[i].name, sa, sa + sn);
            memcpy(to, from + (a - sa), n * sizeof(float));
        }
    }
    dst->params_on_host_newer = 1;
    dst->params_on_backend_newer = 0;
    for (int l = 0; l < src->cfg.n_layers; l++) {
        const lm_balance_state *a = &src->layers[l].bal;
        lm_balance_state *b = &dst->layers[l].bal;
        if (!src->layers[l].bal_ready || !dst->layers[l].bal_ready) continue;
        size_t n = (size_t)a->cfg.n_experts;
        memcpy(b->bias, a->bias, n * sizeof *b->bias);
        memcpy(b->halfwidth, a->halfwidth, n * sizeof *b->halfwidth);
        memcpy(b->last_load, a->last_load, n * sizeof *b->last_load);
        memcpy(b->interval_load, a->interval_load, n * sizeof *b->interval_load);
        b->interval_steps = a->interval_steps;
        b->step = a->step;
    }
    return LM_OK;
}

void lm_model_inject_fault(lm_model *m, lm_fault fault) { m->fault = fault; }

lm_status lm_model_set_expert_parallel(lm_model *m, lm_comm *comm) {
    TRY(dw_settle_all(m)); /* the layers' gradient views may change */
    if (!comm) return lm_error(LM_ERR_ARG, "expert parallelism needs a communicator");
    if (m->n_gcuts && !m->pcut)
        return lm_error(LM_ERR_ARG, "expert parallelism is set before the gradients are cut to the owned experts "
                                    "(lm_model_keep_expert_grads after lm_model_set_expert_parallel)");
    if (m->pcut) {
        /* owner-only experts (from creation, or cut): the handle's ranks are the cut's */
        const int G = (int)(m->gcuts[0].numel / m->gcuts[0].count), pos = (int)(m->gcuts[0].first / m->gcuts[0].count);
        if (lm_comm_size(comm) != G || lm_comm_rank(comm) != pos)
            return lm_error(LM_ERR_ARG, "expert parallelism over rank %d of %d ranks on a model that keeps only the "
                            "experts of position %d of %d (its blocks hold that slice): the handle must be that "
                            "group", lm_comm_rank(comm), lm_comm_size(comm), pos, G);
    }
    if (m->seg_on)
        return lm_error(LM_ERR_ARG, "expert parallelism together with train.seq_segment is not supported (set "
                                    "train.seq_segment to 0)");
    if (m->chunk < m->N)
        return lm_error(LM_ERR_ARG, "expert parallelism runs the MoE on the whole micro-batch: set "
                                    "train.recompute_chunk to 0 (or at least the micro-batch's %lld tokens)",
                        (long long)m->N);
    if (!m->be->ops->moe_ep_create)
        return lm_error(LM_ERR_ARG, "expert parallelism: the %s backend has no expert-parallel MoE layer",
                        lm_device_name(m->be->device));
    int R = lm_comm_size(comm);
    if (m->cfg.n_routed_experts % R)
        return lm_error(LM_ERR_ARG,
                        "expert parallelism: model.n_routed_experts = %d is not divisible by the %d ranks (each "
                        "rank owns n / R experts)",
                        m->cfg.n_routed_experts, R);
    void *first_ep = NULL;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (!ls->moe || ls->moe_ep) continue;
        TRY(m->be->ops->moe_ep_create(m->be, comm, &ls->moe_cfg, &ls->moe_ep));
        /* the layers run one after the other: one set of call-time buffers for all */
        if (first_ep && m->be->ops->moe_ep_share) TRY(m->be->ops->moe_ep_share(m->be, ls->moe_ep, first_ep));
        if (!first_ep) first_ep = ls->moe_ep;
        const lm_moe_config *mc = &ls->moe_cfg;
        const int first = lm_comm_rank(comm) * (mc->n_experts / R);
        size_t wo = (size_t)first * mc->d_ff * (mc->d_latent ? mc->d_latent : mc->d);
        ls->moe_Pep = ls->moe_P;
        if (m->pcut) {
            /* the owned slices: the first kept element of each routed expert tensor */
            ls->moe_Pep.gate = par_at(m, ls->moe_xoff[0] + wo);
            ls->moe_Pep.up = par_at(m, ls->moe_xoff[1] + wo);
            ls->moe_Pep.down = par_at(m, ls->moe_xoff[2] + wo);
        } else {
            ls->moe_Pep.gate += wo, ls->moe_Pep.up += wo, ls->moe_Pep.down += wo;
        }
        /* the gradients and the product-format copy: the same elements */
        map_views(m, &ls->moe_Pep, &ls->moe_Gep, sizeof ls->moe_Pep, 1);
        map_views(m, &ls->moe_Pep, &ls->moe_PLep, sizeof ls->moe_Pep, 0);
    }
    m->ep_comm = comm;
    return LM_OK;
}

/* Every layer's gradient views again, in the current gradient layout. */
static void map_grad_views(lm_model *m) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA) map_views(m, &ls->kda_P, &ls->kda_G, sizeof ls->kda_P, 1);
        else map_views(m, &ls->mla_P, &ls->mla_G, sizeof ls->mla_P, 1);
        if (!ls->moe) continue;
        map_views(m, &ls->moe_P, &ls->moe_G, sizeof ls->moe_P, 1);
        if (ls->moe_ep) map_views(m, &ls->moe_Pep, &ls->moe_Gep, sizeof ls->moe_Pep, 1);
        /* a cut expert tensor has no whole gradient, only this rank's slice (moe_Gep) */
        if (gcut_of(m, ls->moe_xoff[0])) ls->moe_G.gate = ls->moe_G.up = ls->moe_G.down = NULL;
    }
}

/* A routed expert tensor of a MoE layer: layers.L.moe.gate, .up or .down, [n, ., .]. */
static int is_routed_expert_tensor(const lm_model *m, const lm_model_tensor *t) {
    const char *d = strstr(t->name, ".moe.");
    return d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down")) && t->ndim == 3 &&
           t->shape[0] == m->cfg.n_routed_experts;
}

/* The cut table of owner-only experts (m->gcuts, m->n_grads) of position pos
 * of G ranks: of each routed expert tensor the slice of experts [pos n / G,
 * (pos+1) n / G), every other tensor whole. The checks of every way to it
 * (lm_model_keep_expert_grads, lm_model_create_expert_owned); no block
 * changes here. */
static lm_status plan_expert_cuts(lm_model *m, int G, int pos) {
    const int n = m->cfg.n_routed_experts;
    if (G < 1 || pos < 0 || pos >= G)
        return lm_error(LM_ERR_ARG, "owner-only experts: position %d of a group of %d ranks is out of range", pos, G);
    if (!lm_model_num_moe_layers(m) || n % G)
        return lm_error(LM_ERR_ARG, "owner-only experts: %d routed experts cannot be split over %d ranks "
                        "(model.n_routed_experts must be divisible by the expert-parallel group%s)", n, G,
                        lm_model_num_moe_layers(m) ? "" : ", and the model needs MoE layers");
    int cuts = 0;
    for (int i = 0; i < m->n_tensors; i++) cuts += is_routed_expert_tensor(m, &m->tensors[i]);
    struct gcut *gc = calloc((size_t)cuts, sizeof *gc);
    if (!gc) return lm_error(LM_ERR_MEMORY, "out of memory cutting the expert tensors");
    size_t kept = m->n_params;
    for (int i = 0, k = 0; i < m->n_tensors; i++) {
        const lm_model_tensor *t = &m->tensors[i];
        if (!is_routed_expert_tensor(m, t)) continue;
        const size_t slice = t->numel / (size_t)G;
        gc[k++] = (struct gcut){t->offset, t->numel, (size_t)pos * slice, slice};
        kept -= t->numel - slice;
    }
    m->gcuts = gc;
    m->n_gcuts = cuts;
    m->n_grads = kept;
    return LM_OK;
}

lm_status lm_model_keep_expert_grads(lm_model *m, int G, int pos) {
    TRY(dw_settle_all(m)); /* the gradient block changes */
    const int n = m->cfg.n_routed_experts;
    if (m->n_gcuts) return lm_error(LM_ERR_ARG, "the model keeps only its own experts' gradients already");
    if (G < 1 || pos < 0 || pos >= G)
        return lm_error(LM_ERR_ARG, "owner-only expert gradients: position %d of a group of %d ranks is out of range",
                        pos, G);
    if (!m->dry && (!m->ep_comm || lm_comm_size(m->ep_comm) != G || lm_comm_rank(m->ep_comm) != pos))
        return lm_error(LM_ERR_ARG, "owner-only expert gradients of position %d of %d need the model under expert "
                        "parallelism over those ranks (lm_model_set_expert_parallel first; its handle has %s)", pos, G,
                        m->ep_comm ? "another size or rank" : "not been set");
    if (m->be->device != LM_DEVICE_CPU || m->sep)
        return lm_error(LM_ERR_ARG, "cutting the gradients of a model after its creation runs on the CPU backend; on "
                        "a %s create the model cut (lm_model_create_expert_owned)", lm_device_name(m->be->device));
    /* the table first, the block after: a failure leaves the model whole */
    TRY(plan_expert_cuts(m, G, pos));
    const size_t kept = m->n_grads;
    if (!m->dry) {
        float *g = calloc(kept, sizeof(float));
        if (!g) {
            free(m->gcuts);
            m->gcuts = NULL;
            m->n_gcuts = 0;
            m->n_grads = m->n_params;
            return lm_error(LM_ERR_MEMORY, "out of memory for %zu gradients (the owned experts' and the rest)", kept);
        }
        block_bytes(m, kept * sizeof(float), 1);
        free(m->grads);
        block_bytes(m, m->n_params * sizeof(float), 0);
        m->grads = m->G = g; /* the CPU: the ops write the host block */
        m->grads_zero_pending = 0;
    }
    lm_model_buffer *b = &m->buffers[m->grads_buffer];
    b->bytes = kept * sizeof(float);
    snprintf(b->name, sizeof b->name, "gradients (fp32; of the routed experts only %d of %d a layer, position %d of "
             "%d)", n / G, n, pos, G);
    if (!m->dry) map_grad_views(m);
    return LM_OK;
}

float *lm_model_grad_part(lm_model *m, int i, size_t *first, size_t *count) {
    const lm_model_tensor *t = lm_model_tensor_at(m, i);
    *first = *count = 0;
    if (!t) return NULL;
    const struct gcut *c = gcut_of(m, t->offset);
    *first = c ? c->first : 0;
    *count = c ? c->count : t->numel;
    return m->grads ? grad_in(m, m->grads, t->offset + *first) : NULL;
}

float *lm_model_param_part(lm_model *m, int i, size_t *first, size_t *count) {
    const lm_model_tensor *t = lm_model_tensor_at(m, i);
    *first = *count = 0;
    if (!t) return NULL;
    const struct gcut *c = m->pcut ? gcut_of(m, t->offset) : NULL;
    *first = c ? c->first : 0;
    *count = c ? c->count : t->numel;
    return m->params ? lm_model_host_param(m, t->offset + *first) : NULL;
}

float *lm_model_backend_param_part(lm_model *m, int i, size_t *first, size_t *count) {
    float *host = lm_model_param_part(m, i, first, count);
    return host && m->P ? m->P + (host - m->params) : NULL;
}

float *lm_model_backend_grad_part(lm_model *m, int i, size_t *first, size_t *count) {
    float *host = lm_model_grad_part(m, i, first, count);
    return host && m->G ? m->G + (host - m->grads) : NULL;
}

/* The place of routed expert tensor `offset` in m->xwhole (floats). */
static size_t xwhole_at(const lm_model *m, size_t offset) {
    size_t at = 0;
    for (int i = 0; i < m->n_gcuts && m->gcuts[i].offset != offset; i++) at += m->gcuts[i].numel;
    return at;
}

/* A MoE layer's whole views of its routed experts (moe_p, moe_P, moe_PL
 * gate, up, down): into `layer` (the layer's three tensors whole, gathered by
 * gather_layer_experts), m->xwhole, the block (a cut that keeps the whole
 * tensor: a group of one rank), or NULL (cut, not gathered). */
static void bind_layer_expert_views(lm_model *m, layer_state *ls, float *layer) {
    float *w[3];
    for (int k = 0; k < 3; k++) {
        const struct gcut *c = gcut_of(m, ls->moe_xoff[k]);
        w[k] = layer ? layer : m->xwhole ? m->xwhole + xwhole_at(m, ls->moe_xoff[k])
             : c->count == c->numel ? lm_model_cut_at(m, m->P, c->offset) : NULL;
        if (layer) layer += c->numel;
    }
    ls->moe_p.gate = ls->moe_P.gate = ls->moe_PL.gate = w[0];
    ls->moe_p.up = ls->moe_P.up = ls->moe_PL.up = w[1];
    ls->moe_p.down = ls->moe_P.down = ls->moe_PL.down = w[2];
}

/* Every MoE layer's whole views (above), from m->xwhole or the block. */
static void bind_whole_expert_views(lm_model *m) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->moe && gcut_of(m, ls->moe_xoff[0])) bind_layer_expert_views(m, ls, NULL);
    }
}

/* The gathered expert bytes held: `bytes` more (add) or fewer, and the peak. */
static void held_bytes(lm_model *m, size_t bytes, int add) {
    m->xheld = add ? m->xheld + bytes : m->xheld - bytes;
    m->xpeak = m->xheld > m->xpeak ? m->xheld : m->xpeak;
}

/* Do this model's evaluation forwards gather each MoE layer's experts in turn
 * (lm_model_gather_experts_by_layer, the experts cut over more than one rank
 * and not gathered whole)? Then such a forward is collective over the group. */
static int ep_streams(const lm_model *m) {
    return (m->xstream || m->xexchange) && m->pcut && !m->xwhole && m->ep_comm && m->n_gcuts &&
           m->gcuts[0].count < m->gcuts[0].numel;
}

/* Does an evaluation forward of this model run its MoE layers through the
 * expert-parallel exchange (lm_model_evaluate_by_exchange) instead of
 * gathering each layer's experts? */
static int ep_eval_exchange(const lm_model *m) { return m->xexchange && ep_streams(m); }

/* One cut expert tensor c whole at x + *at (floats) on every rank of the group
 * (each position's slice from its owners: one lm_comm_all_gatherv); tab holds 2G
 * size_t of scratch for the counts and offsets; *at advances by the tensor. */
static lm_status gather_cut(lm_model *m, lm_comm *comm, const struct gcut *c, size_t *tab, float *x, int *at) {
    const int G = lm_comm_size(comm), me = lm_comm_rank(comm);
    for (int q = 0; q < G; q++) {
        tab[q] = c->count * sizeof(float);
        tab[G + q] = ((size_t)*at + (size_t)q * c->count) * sizeof(float);
    }
    lm_status st = lm_comm_all_gatherv(comm, lm_model_cut_at(m, m->params, c->offset + c->first), tab[me], x, tab,
                                       tab + G);
    *at += (int)c->numel;
    return st;
}

/* MoE layer ls's (sublayer idx's) routed experts whole in m->xlayer, for an
 * evaluation forward: collective over the expert-parallel handle. The ranks
 * first agree (ep_agree) that each reached the layer and could
 * allocate: a rank that failed earlier in the forward joins this agreement
 * with its failure (ep_join), so none waits alone in the gather. Then one
 * lm_comm_all_gatherv a tensor (the bytes lm_model_gather_experts gives). */
static lm_status gather_layer_experts(lm_model *m, layer_state *ls, int idx) {
    lm_comm *comm = m->ep_comm;
    const int G = lm_comm_size(comm);
    size_t total = 0;
    for (int k = 0; k < 3; k++) total += gcut_of(m, ls->moe_xoff[k])->numel;
    float *x = malloc((total ? total : 1) * sizeof(float));
    size_t *tab = malloc(2 * (size_t)G * sizeof *tab);
    lm_status mine = x && tab ? LM_OK
                   : lm_error(LM_ERR_MEMORY, "layer %d: out of memory gathering the layer's routed experts' weights "
                              "(%zu floats)", idx / 2, total);
    m->ep_next = idx + 1;
    lm_status st = ep_agree(m, mine);
    if (st && !mine)
        st = lm_error(st, "layer %d: the evaluation forward failed on another rank of the expert-parallel group "
                      "(before gathering the layer's experts)", idx / 2);
    for (int k = 0, at = 0; k < 3 && !st; k++) st = gather_cut(m, comm, gcut_of(m, ls->moe_xoff[k]), tab, x, &at);
    free(tab);
    if (st) {
        m->ep_together = 1; /* every rank of the group stops at this layer */
        free(x);
        return st;
    }
    m->xlayer = x;
    held_bytes(m, total * sizeof(float), 1);
    bind_layer_expert_views(m, ls, x);
    return LM_OK;
}

static void release_layer_experts(lm_model *m, layer_state *ls) {
    size_t total = 0;
    for (int k = 0; k < 3; k++) total += gcut_of(m, ls->moe_xoff[k])->numel;
    free(m->xlayer);
    m->xlayer = NULL;
    held_bytes(m, total * sizeof(float), 0);
    bind_layer_expert_views(m, ls, NULL);
}

/* A forward that failed on this rank (status s) under expert parallelism,
 * collective over the group (training, or an evaluation gathering layer by
 * layer): unless the failure was agreed on already, join the agreement of the
 * next MoE layer this rank has not reached, where the other ranks stop. */
static lm_status ep_join(lm_model *m, lm_status s) {
    if (!s || m->ep_together) return s;
    char why[1024];
    snprintf(why, sizeof why, "%s", lm_last_error());
    /* the others stop at that agreement: one is all this rank joins */
    for (int idx = m->ep_next; idx < m->L2; idx++)
        if (idx % 2 && m->layers[idx / 2].moe_ep) {
            (void)ep_agree(m, s);
            break;
        }
    return lm_error(s, "%s", why); /* the message of this rank's failure, not of the agreements */
}

/* Map every pointer of a params struct (structs of float pointers only) from
 * the whole block `from` to the cut block `to` of m's cut (NULL where it drops). */
static void cut_views(const lm_model *m, void *views, size_t bytes, const float *from, float *to) {
    float **v = views;
    for (size_t k = 0; k < bytes / sizeof(float *); k++)
        if (v[k]) v[k] = lm_model_cut_at(m, to, (size_t)(v[k] - from));
}

lm_status lm_model_keep_expert_weights(lm_model *m) {
    if (m->pcut) return lm_error(LM_ERR_ARG, "the model keeps only its own experts' weights already");
    if (!m->n_gcuts)
        return lm_error(LM_ERR_ARG, "owner-only expert weights are cut with the gradients' table: "
                        "lm_model_keep_expert_grads first");
    if (m->params_on_backend_newer || m->P != m->params)
        return lm_error(LM_ERR_ARG, "owner-only expert weights run on the CPU (as expert parallelism does)");
    const int n = m->cfg.n_routed_experts, G = (int)(m->gcuts[0].numel / m->gcuts[0].count);
    const int pos = (int)(m->gcuts[0].first / m->gcuts[0].count);
    lm_model_buffer *b = &m->buffers[m->params_buffer];
    if (!m->dry) {
        float *old = m->params, *p = malloc((m->n_grads ? m->n_grads : 1) * sizeof(float));
        if (!p)
            return lm_error(LM_ERR_MEMORY, "out of memory for %zu parameters (the owned experts' and the rest)",
                            m->n_grads);
        block_bytes(m, m->n_grads * sizeof(float), 1); /* both blocks held while the kept part is copied */
        for (int i = 0; i < m->n_tensors; i++) {
            const lm_model_tensor *t = &m->tensors[i];
            const struct gcut *c = gcut_of(m, t->offset);
            const size_t a = c ? c->first : 0, cnt = c ? c->count : t->numel;
            memcpy(lm_model_cut_at(m, p, t->offset + a), old + t->offset + a, cnt * sizeof(float));
        }
        /* every view into the block, to the same element's new place (the CPU: P = PL = params) */
        for (int l = 0; l < m->cfg.n_layers; l++) {
            layer_state *ls = &m->layers[l];
            if (ls->mixer == LM_MIXER_KDA) {
                cut_views(m, &ls->kda_p, sizeof ls->kda_p, old, p);
                cut_views(m, &ls->kda_P, sizeof ls->kda_P, old, p);
                cut_views(m, &ls->kda_PL, sizeof ls->kda_PL, old, p);
            } else {
                cut_views(m, &ls->mla_p, sizeof ls->mla_p, old, p);
                cut_views(m, &ls->mla_P, sizeof ls->mla_P, old, p);
                cut_views(m, &ls->mla_PL, sizeof ls->mla_PL, old, p);
            }
            if (!ls->moe) continue;
            cut_views(m, &ls->moe_p, sizeof ls->moe_p, old, p);
            cut_views(m, &ls->moe_P, sizeof ls->moe_P, old, p);
            cut_views(m, &ls->moe_PL, sizeof ls->moe_PL, old, p);
            if (ls->moe_ep) {
                cut_views(m, &ls->moe_Pep, sizeof ls->moe_Pep, old, p);
                cut_views(m, &ls->moe_PLep, sizeof ls->moe_PLep, old, p);
            }
        }
        free(old);
        block_bytes(m, m->n_params * sizeof(float), 0);
        m->params = m->P = p;
        m->PL = p;
    }
    m->pcut = 1;
    if (!m->dry) {
        bind_whole_expert_views(m); /* a cut tensor has no whole view until gathered */
        map_grad_views(m);
    }
    b->bytes = m->n_grads * sizeof(float);
    snprintf(b->name, sizeof b->name, "parameters (fp32; of the routed experts only %d of %d a layer, position %d of "
             "%d)", n / G, n, pos, G);
    return LM_OK;
}

int lm_model_experts_gathered(const lm_model *m) { return !m->pcut || m->xwhole; }

lm_status lm_model_gather_experts(lm_model *m) {
    if (!m->pcut || m->xwhole) return LM_OK;
    if (m->dry) return lm_error(LM_ERR_ARG, "a plan has no expert weights to gather");
    lm_comm *comm = m->ep_comm;
    const int G = lm_comm_size(comm);
    size_t total = 0;
    for (int i = 0; i < m->n_gcuts; i++) total += m->gcuts[i].numel;
    float *x = malloc((total ? total : 1) * sizeof(float));
    size_t *tab = malloc(2 * (size_t)G * sizeof *tab);
    /* every rank of the group gathers or none does: nobody waits alone in a gather */
    int32_t mine = !x || !tab, any = 0;
    lm_status st = lm_comm_all_reduce_sum(comm, &mine, &any, 1, LM_DTYPE_I32);
    if (!st && any)
        st = lm_error(LM_ERR_MEMORY, mine ? "out of memory gathering the routed experts' weights (%zu floats)"
                                          : "out of memory gathering the routed experts' weights on another rank "
                                            "(%zu floats)", total);
    for (int i = 0, at = 0; i < m->n_gcuts && !st; i++) st = gather_cut(m, comm, &m->gcuts[i], tab, x, &at);
    free(tab);
    if (st) {
        free(x);
        return st;
    }
    m->xwhole = x;
    held_bytes(m, total * sizeof(float), 1);
    bind_whole_expert_views(m);
    return LM_OK;
}

void lm_model_release_experts(lm_model *m) {
    if (!m->xwhole) return;
    free(m->xwhole);
    m->xwhole = NULL;
    size_t total = 0;
    for (int i = 0; i < m->n_gcuts; i++) total += m->gcuts[i].numel;
    held_bytes(m, total * sizeof(float), 0);
    bind_whole_expert_views(m);
}

lm_status lm_model_gather_experts_by_layer(lm_model *m, int on) {
    if (on && !m->dry && (!m->pcut || !m->ep_comm))
        return lm_error(LM_ERR_ARG, "gathering the experts layer by layer needs a model under expert parallelism "
                        "that keeps only its own experts' weights (lm_model_set_expert_parallel, then "
                        "lm_model_keep_expert_grads and lm_model_keep_expert_weights)");
    m->xstream = on != 0;
    return LM_OK;
}

lm_status lm_model_evaluate_by_exchange(lm_model *m, int on) {
    if (on && !m->dry && (!m->pcut || !m->ep_comm))
        return lm_error(LM_ERR_ARG, "evaluating through the expert-parallel exchange needs a model under expert "
                        "parallelism that keeps only its own experts' weights (lm_model_create_expert_owned, then "
                        "lm_model_set_expert_parallel)");
    m->xexchange = on != 0;
    return LM_OK;
}

size_t lm_model_ep_exchange_bytes(const lm_model *m, int R) {
    if (R < 2 || !m->be->ops->moe_ep_bytes) return 0;
    size_t sum = 0, shared = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const layer_state *ls = &m->layers[l];
        if (!ls->moe) continue;
        const int64_t rows = m->chunk * ls->moe_cfg.top_k;
        sum += m->be->ops->moe_ep_bytes(&ls->moe_cfg, R, rows, 0);
        /* the call-time part: one set for all layers (moe_ep_share), the largest layer's */
        const size_t s = m->be->ops->moe_ep_bytes(&ls->moe_cfg, R, rows, 1);
        shared = s > shared ? s : shared;
    }
    return sum + shared;
}

size_t lm_model_expert_layer_bytes(const lm_model *m) {
    /* by the tensor table (a plan has no layer views): layers.L.moe.gate, .up, .down cut */
    size_t most = 0, sum = 0;
    int last = -1;
    for (int i = 0; m->pcut && i < m->n_tensors; i++) {
        const lm_model_tensor *t = &m->tensors[i];
        const struct gcut *c = gcut_of(m, t->offset);
        int l;
        if (!c || c->count == c->numel || sscanf(t->name, "layers.%d.", &l) != 1) continue;
        sum = l == last ? sum + t->numel * sizeof(float) : t->numel * sizeof(float);
        last = l;
        most = sum > most ? sum : most;
    }
    return most;
}

size_t lm_model_gathered_peak_bytes(lm_model *m, int reset) {
    const size_t peak = m->xpeak;
    if (reset) m->xpeak = m->xheld;
    return peak;
}

const float *lm_model_tensor_data(const lm_model *m, int i) {
    const lm_model_tensor *t = lm_model_tensor_at(m, i);
    if (!t || !m->params) return NULL;
    const struct gcut *c = m->pcut ? gcut_of(m, t->offset) : NULL;
    if (c && c->count < c->numel) return m->xwhole ? m->xwhole + xwhole_at(m, t->offset) : NULL;
    return lm_model_host_param(m, t->offset);
}

/* Whether every token mixer of the model can run on a segment (R ranks, this
 * one's segment, the model's B x T, at t0). */
static lm_status cp_check_mixers(const lm_model *m, int R, int t0) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const layer_state *ls = &m->layers[l];
        size_t s = ls->mixer == LM_MIXER_KDA ? lm_kda_layer_cp_lp_scratch_floats(&ls->kda_cfg, R, m->B, m->T)
                                             : lm_mla_cp_lp_scratch_floats(&ls->mla_cfg, R, m->B, t0, m->T);
        if (!s) return lm_error(LM_ERR_ARG, "context parallelism: layer %d's token mixer cannot run on a segment", l);
    }
    return LM_OK;
}

/* The activation block planned anew for context parallelism over R ranks with
 * this rank's segment at t0 (R = 0: the one-rank layout): the memory plan's
 * activation entries replaced in place; on a model (not a plan) the block
 * released, allocated at its new size and carved, and the KDA layers'
 * segment activations given their constant identity. */
static lm_status replan_activations(lm_model *m, int R, int t0) {
    const int first = m->act_ledger_first, n_old = m->act_ledger_n, end0 = m->n_buffers;
    m->cp_ranks = R;
    m->cp_t0 = t0;
    size_t act = plan_activations(m, NULL);
    const int n_new = m->n_buffers - end0;
    lm_model_buffer *tmp = malloc((size_t)(n_new > 0 ? n_new : 1) * sizeof *tmp);
    if (!tmp) return lm_error(LM_ERR_MEMORY, "out of memory planning the model");
    memcpy(tmp, m->buffers + end0, (size_t)n_new * sizeof *tmp);
    memmove(m->buffers + first + n_new, m->buffers + first + n_old, (size_t)(end0 - first - n_old) * sizeof *tmp);
    memcpy(m->buffers + first, tmp, (size_t)n_new * sizeof *tmp);
    free(tmp);
    m->n_buffers = end0 - n_old + n_new;
    m->act_ledger_n = n_new;
    m->act_floats = act;
    if (m->dry) return LM_OK;
    /* the old block goes first: the two are never held together */
    m->be->release(m->be, m->act_block);
    m->act_block = NULL;
    void *ab = NULL;
    if (m->be->alloc(m->be, act * sizeof(float), &ab))
        return lm_error(LM_ERR_MEMORY, "out of memory for %zu activation floats (%.2f GiB) %s", act,
                        (double)act * sizeof(float) / (1u << 30),
                        R ? "with context parallelism" : "of the one-rank layout");
    m->act_block = ab;
    plan_activations(m, m->act_block);
    /* with the token mixers recomputed the KDA layers share the first one's set: initialised once */
    for (int l = 0, kda_seen = 0; R && l < m->cfg.n_layers; l++) {
        layer_state *ls = &m->layers[l];
        if (ls->mixer == LM_MIXER_KDA && !(rc_sub(m, 2 * l) && kda_seen++))
            TRY(lm_kda_layer_cp_lp_acts_init(&ls->kda_cfg, m->B, m->T, ls->cp_acts));
    }
    return LM_OK;
}

lm_status lm_model_plan_context_parallel(lm_model *m, int ranks, int t0) {
    if (!m || !m->dry) return lm_error(LM_ERR_ARG, "lm_model_plan_context_parallel takes a plan (lm_model_plan)");
    if (ranks < 2 || t0 < 0 || (int64_t)t0 + m->T > (1 << 26))
        return lm_error(LM_ERR_ARG, "context parallelism: %d ranks, a segment at %d of %d tokens: out of range", ranks,
                        t0, m->T);
    if (m->cp_ranks) return lm_error(LM_ERR_ARG, "context parallelism is already planned on this model");
    if (m->seg_on)
        return lm_error(LM_ERR_ARG, "context parallelism together with train.seq_segment is not supported");
    TRY(cp_check_mixers(m, ranks, t0));
    return replan_activations(m, ranks, t0);
}

lm_status lm_model_set_context_parallel(lm_model *m, lm_comm *comm) {
    if (!comm) return lm_error(LM_ERR_ARG, "context parallelism needs a communicator");
    if (m->cp_comm) return lm_error(LM_ERR_ARG, "context parallelism is already set on this model");
    /* every rank's verdict on its own model first, so none waits in the exchange below */
    lm_status vs = LM_OK;
    if (m->dry) vs = lm_error(LM_ERR_ARG, "context parallelism: a plan (lm_model_plan) has no memory to run on");
    else if (m->seg_on)
        vs = lm_error(LM_ERR_ARG, "context parallelism together with train.seq_segment is not supported (set "
                                  "train.seq_segment to 0, or at least the sequence length)");
    int32_t mine[2] = {m->B, m->T}, *all = malloc(2 * (size_t)lm_comm_size(comm) * sizeof(int32_t));
    if (!all) return lm_error(LM_ERR_MEMORY, "out of memory setting context parallelism");
    m->cp_comm = comm; /* for the agreement */
    lm_status st = cp_agree(m, vs, LM_ERR_ARG, "a model unfit for context parallelism");
    if (!st) st = lm_comm_all_gather(lm_comm_host(comm), mine, all, sizeof mine);
    m->cp_comm = NULL;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    int64_t t0 = 0;
    for (int r = 0; !st && r < R; r++) {
        if (all[2 * r] != m->B)
            st = lm_error(LM_ERR_ARG, "context parallelism: rank %d has %d rows, rank %d has %d (every rank holds "
                          "a segment of the same rows)", r, all[2 * r], me, m->B);
        if (r < me) t0 += all[2 * r + 1];
    }
    free(all);
    TRY(st);
    if (t0 + m->T > (1 << 26)) return lm_error(LM_ERR_ARG, "context parallelism: the sequence is too long");
    TRY(cp_check_mixers(m, R, (int)t0));
    /* the activation block with the segment activations in place of the one-rank mixers' */
    lm_status ps = replan_activations(m, R, (int)t0);
    if (ps) {
        /* back to the one-rank layout where memory allows; the error stands either way */
        char why[512];
        snprintf(why, sizeof why, "%s", lm_last_error());
        (void)replan_activations(m, 0, 0);
        return lm_error(ps, "%s", why);
    }
    m->cp_comm = comm;
    return LM_OK;
}
