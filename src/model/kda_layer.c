/* The KDA token mixer: projections, short convolutions, normalisations, the
 * operator, output norm and gate (include/longmoe/kda_layer.h). */
#include "longmoe/kda_layer.h"

#include <math.h>
#include <string.h>

#include "check.h"
#include "longmoe/backend.h"
#include "longmoe/linear.h"

size_t lm_kda_layer_specs(const lm_kda_layer_config *c, lm_tensor_spec *s) {
    int64_t d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    float w = 0.02f, cw = 1.0f / sqrtf((float)W);
    lm_tensor_spec t[LM_KDA_LAYER_NPARAMS] = {
        {"W_q", HK, d, LM_ROLE_MATRIX, (int)H, 0, w},
        {"W_k", HK, d, LM_ROLE_MATRIX, (int)H, 0, w},
        {"W_v", HK, d, LM_ROLE_MATRIX, (int)H, 0, w},
        {"conv_q", HK, W, LM_ROLE_VECTOR, 1, 0, cw},
        {"conv_k", HK, W, LM_ROLE_VECTOR, 1, 0, cw},
        {"conv_v", HK, W, LM_ROLE_VECTOR, 1, 0, cw},
        {"W_z", HK, d, LM_ROLE_MATRIX, 1, 0, w},
        {"W_beta", H, d, LM_ROLE_MATRIX, 1, 0, w},
        {"A_log", H, 1, LM_ROLE_VECTOR, 1, 0, 0},
        /* sigmoid(dt_bias) around 0.05: the bounded gate starts near g_min/20 per step */
        {"dt_bias", HK, 1, LM_ROLE_VECTOR, 1, -3.0f, 1.0f},
        {"W_g", HK, d, LM_ROLE_MATRIX, 1, 0, w},
        {"o_norm", K, 1, LM_ROLE_VECTOR, 1, 1.0f, 0},
        {"W_o", d, HK, LM_ROLE_MATRIX, 1, 0, w},
    };
    size_t total = 0;
    for (int i = 0; i < LM_KDA_LAYER_NPARAMS; i++) {
        if (s) s[i] = t[i];
        total += (size_t)(t[i].rows * t[i].cols);
    }
    return total;
}

void lm_kda_layer_params_map(const lm_kda_layer_config *c, float *base, lm_kda_layer_params *p) {
    lm_tensor_spec s[LM_KDA_LAYER_NPARAMS];
    lm_kda_layer_specs(c, s);
    float **slots[LM_KDA_LAYER_NPARAMS] = {&p->W_q, &p->W_k, &p->W_v, &p->conv_q, &p->conv_k,
                                           &p->conv_v, &p->W_z, &p->W_beta, &p->A_log,
                                           &p->dt_bias, &p->W_g, &p->o_norm, &p->W_o};
    for (int i = 0; i < LM_KDA_LAYER_NPARAMS; i++) {
        *slots[i] = base;
        base += s[i].rows * s[i].cols;
    }
}

static lm_backend *backend_of(const lm_kda_layer_config *c) { return c->backend ? c->backend : lm_backend_cpu(); }

/* Whether the backend's product format is a separate (bf16) copy: then the
 * layer keeps lp buffers of its own; on the CPU every lp view is the fp32
 * tensor itself (backend.h). */
static int lp_separate(const lm_kda_layer_config *c) { return backend_of(c)->lp_bytes != sizeof(float); }

/* Floats that hold n values of the product format: n on the CPU (the lp view
 * is the fp32 tensor), n * lp_bytes / 4 rounded up to 16 floats (64-byte
 * starts) where the format is separate (bf16 on the GPU). */
static size_t lp_floats(const lm_kda_layer_config *c, size_t n) {
    if (!lp_separate(c)) return n;
    size_t f = (n * backend_of(c)->lp_bytes + sizeof(float) - 1) / sizeof(float);
    return (f + 15) & ~(size_t)15;
}

size_t lm_kda_layer_act_floats(const lm_kda_layer_config *c, int B, int T) {
    size_t N = (size_t)B * T, H = (size_t)c->heads, HK = H * (size_t)c->head_dim;
    /* 4 fp32 [N,HK] (projections, gate; the conv outputs are not kept: the backward recomputes them from the
     * projections), 6 in the product format (q, k, v, z, o, gated) */
    return 4 * N * HK + 6 * lp_floats(c, N * HK) + N * H /* beta */ + N * H /* o_rstd */ +
           2 * N * H /* qk_rnorm */;
}

void lm_kda_layer_acts_map(const lm_kda_layer_config *c, int B, int T, float *base,
                           lm_kda_layer_acts *a) {
    size_t N = (size_t)B * T, H = (size_t)c->heads, HK = H * (size_t)c->head_dim, LP = lp_floats(c, N * HK);
    float *q, *k, *v, *z, *o, *gated;
    struct {
        float **slot;
        size_t n;
    } big[] = {{&a->qp, N * HK}, {&a->kp, N * HK}, {&a->vp, N * HK}, {&q, LP}, {&k, LP},
               {&v, LP},         {&z, LP},         {&o, LP},         {&a->gate, N * HK}, {&gated, LP}};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        *big[i].slot = base;
        base += big[i].n;
    }
    a->q = q;
    a->k = k;
    a->v = v;
    a->o = o;
    a->gated = gated;
    a->beta = base;
    base += N * H;
    a->o_rstd = base;
    base += N * H;
    a->qk_rnorm = base;
    base += 2 * N * H;
    a->z_lp = z;
    a->q_op = a->q;
    a->k_op = a->k;
    a->v_op = a->v;
    a->kept = NULL;
    a->kept_bytes = 0;
}

/* A segment's acts: the whole-sequence layout for W-1+n rows per sequence,
 * then the operator's q, k, v of the n rows (separate buffers: the history
 * rows sit between the sequences). */
size_t lm_kda_layer_seg_act_floats(const lm_kda_layer_config *c, int B, int n) {
    size_t NHK = (size_t)B * n * c->heads * c->head_dim;
    return ((lm_kda_layer_act_floats(c, B, n + c->conv_width - 1) + 15) & ~(size_t)15) +
           3 * ((lp_floats(c, NHK) + 15) & ~(size_t)15);
}

void lm_kda_layer_seg_acts_map(const lm_kda_layer_config *c, int B, int n, float *base, lm_kda_layer_acts *a) {
    size_t NHK = (size_t)B * n * c->heads * c->head_dim, lp = (lp_floats(c, NHK) + 15) & ~(size_t)15;
    lm_kda_layer_acts_map(c, B, n + c->conv_width - 1, base, a);
    base += (lm_kda_layer_act_floats(c, B, n + c->conv_width - 1) + 15) & ~(size_t)15; /* 64-byte starts */
    a->q_op = base;
    a->k_op = base + lp;
    a->v_op = base + 2 * lp;
}

/* Backward scratch: fp32 slots, then (separate product format only) lp slots. */
typedef struct {
    size_t d_gated, d_o, dq, dk, dv, dz, tmp, dbeta, dgate, din, dy_lp, dgate_lp, din_lp, dbeta_lp, dout_ext, wcat,
        total;
} scratch_layout;

/* The side-by-side input gradients of the whole rows' backward where the product format is separate
 * (cat_inputs): [q | k | v | gate | z | beta] of widths HK, HK, HK, HK, HK, H, in the product format,
 * rows cat_ld(c) elements apart (a multiple of 8, as the products want) */
static size_t cat_width(const lm_kda_layer_config *c) { return 5 * (size_t)c->heads * c->head_dim + c->heads; }
static size_t cat_ld(const lm_kda_layer_config *c) { return (cat_width(c) + 7) & ~(size_t)7; }

/* ext: a segment's W-1 history rows per sequence in the convolutions' slots */
static scratch_layout layout_scratch(const lm_kda_layer_config *c, int B, int T, int ext) {
    size_t N = (size_t)B * T, H = (size_t)c->heads, HK = H * (size_t)c->head_dim, sep = lp_separate(c);
    size_t NE = ext ? (size_t)B * (T + c->conv_width - 1) : N;
    scratch_layout s;
    size_t off = 0;
#define PLACE(f, n) (s.f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */
    PLACE(d_gated, N * HK);
    PLACE(d_o, lp_floats(c, N * HK)); /* d_o, dq, dk, dv, dz: the operator's gradients, in the product format */
    PLACE(dq, lp_floats(c, N * HK));
    PLACE(dk, lp_floats(c, N * HK));
    PLACE(dv, lp_floats(c, N * HK));
    PLACE(dz, lp_floats(c, N * HK));
    PLACE(tmp, NE * HK);
    PLACE(dbeta, N * H);
    /* dgate, din, then din_lp right after them: with a separate product format and no history rows, the
     * three together hold the side-by-side input gradients [N, cat_ld] in the product format (cat_inputs;
     * the fp32 dgate and din are not used then; at least 2.5 N HK floats, about what the operand needs),
     * and wcat their weights stacked [cat_width, d] */
    PLACE(dgate, N * HK);
    PLACE(din, NE * HK);
    const size_t two = ((N * HK + 15) & ~(size_t)15) + ((NE * HK + 15) & ~(size_t)15);
    size_t din_lp = sep ? lp_floats(c, NE * HK) : 0, cat = lp_floats(c, N * cat_ld(c));
    if (sep && !ext && cat > two + din_lp) din_lp = cat - two;
    PLACE(din_lp, din_lp);
    PLACE(wcat, sep && !ext ? lp_floats(c, cat_width(c) * (size_t)c->d_model) : 0);
    PLACE(dy_lp, sep ? lp_floats(c, N * (size_t)c->d_model) : 0);
    PLACE(dgate_lp, sep ? lp_floats(c, N * HK) : 0);
    PLACE(dbeta_lp, sep ? lp_floats(c, N * H) : 0);
    PLACE(dout_ext, ext ? lp_floats(c, NE * HK) : 0);
#undef PLACE
    s.total = off;
    return s;
}

size_t lm_kda_layer_scratch_floats(const lm_kda_layer_config *c, int B, int T) {
    return layout_scratch(c, B, T, 0).total;
}

size_t lm_kda_layer_seg_scratch_floats(const lm_kda_layer_config *c, int B, int n) {
    return layout_scratch(c, B, n, 1).total;
}

static lm_kda_config op_config(const lm_kda_layer_config *c, int B, int T) {
    lm_kda_config k = lm_kda_config_default(B, T, c->heads, c->head_dim, c->head_dim);
    k.gate = c->gate;
    k.g_min = c->g_min;
    k.chunk = c->chunk;
    k.workspace = c->workspace;
    k.workspace_bytes = c->workspace_bytes;
    return k;
}

size_t lm_kda_layer_kept_bytes(const lm_kda_layer_config *c, int B, int T) {
    lm_backend *be = backend_of(c);
    if (!be->ops->kda_kept_bytes) return 0;
    lm_kda_config k = op_config(c, B, T);
    return be->ops->kda_kept_bytes(be, &k);
}

/* The operator's config for the layer's whole rows, with the kept intermediates when the acts have them. */
static lm_kda_config op_config_kept(const lm_kda_layer_config *c, const lm_kda_layer_acts *a, int B, int T) {
    lm_kda_config k = op_config(c, B, T);
    k.kept = a->kept;
    k.kept_bytes = a->kept_bytes;
    return k;
}

/* The lp view of fp32 `x`: x itself on the CPU, else `buf` filled by to_lp. */
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

/* Which parts of a segment's forward run: all of it; the operator's inputs
 * and the operator alone (its final state, no output path); or the operator
 * and the output path over inputs an earlier FWD_STATE left in the acts. */
enum { FWD_ALL, FWD_STATE, FWD_PREPARED };

/* The layer's forward through the backend's ops; ht (may be NULL) receives
 * the operator's final state [B,H,K,K]. carry != NULL: a segment (its
 * history and state in, its own out), of which `part` runs. */
static lm_status layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               const lm_kda_layer_params *pl, lm_kda_layer_acts *a, const void *x, int B, int T,
                               float *y, float *ht, const lm_kda_layer_carry *carry, int part) {
    // x is (B,T,d) in the product format, y is (B,T,d)
    lm_backend *be = backend_of(c);
    const lm_ops *op = be->ops;
    int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    size_t N = (size_t)B * T, lpb = be->lp_bytes;
    const float *Wm[3] = {pl->W_q, pl->W_k, pl->W_v}, *conv_w[3] = {p->conv_q, p->conv_k, p->conv_v};
    float *proj[3] = {a->qp, a->kp, a->vp};
    void *post[3] = {a->q, a->k, a->v}, *opin[3] = {a->q_op, a->k_op, a->v_op};
    if (part == FWD_PREPARED) {
        /* q_op, k_op, v_op, z and beta are the acts' already (they do not depend on the state) */
    } else if (!carry) {
        /* q, k = L2Norm(SiLU(ShortConv(.))), v = SiLU(ShortConv(.))   (SPEC §2, layer); the conv's output
         * is not kept (NULL): the backward recomputes it from the projection */
        for (int j = 0; j < 3; j++) TRY(op->matmul_forward(be, proj[j], x, Wm[j], (int64_t)N, d, HK));
        for (int j = 0; j < 3; j++)
            TRY(op->conv_silu_forward(be, NULL, post[j], j < 2 ? a->qk_rnorm + j * N * H : NULL, proj[j],
                                      conv_w[j], B, T, HK, W, K));
    } else {
        /* a segment: W-1 history rows before each sequence's n rows, then the conv over both */
        const int W1 = W - 1, Tn = T + W1;
        const size_t NE = (size_t)B * Tn;
        for (int j = 0; j < 3; j++) {
            for (int b = 0; b < B; b++) {
                TRY(op->matmul_forward(be, proj[j] + ((size_t)b * Tn + W1) * HK, at(x, (size_t)b * T, d, lpb), Wm[j],
                                       T, d, HK));
                if (!W1) continue;
                float *hist = proj[j] + (size_t)b * Tn * HK;
                if (carry->halo)
                    TRY(be->copy(be, hist, carry->halo + ((size_t)j * B + b) * W1 * HK, (size_t)W1 * HK * sizeof(float)));
                else
                    TRY(be->zero(be, hist, (size_t)W1 * HK * sizeof(float)));
            }
            TRY(op->conv_silu_forward(be, NULL, post[j], j < 2 ? a->qk_rnorm + j * NE * H : NULL, proj[j],
                                      conv_w[j], B, Tn, HK, W, K));
            for (int b = 0; b < B; b++) {
                TRY(be->copy(be, at(opin[j], (size_t)b * T, HK, lpb), at(post[j], (size_t)b * Tn + W1, HK, lpb),
                             N / B * HK * lpb));
                if (carry->halo_out && W1)
                    TRY(be->copy(be, carry->halo_out + ((size_t)j * B + b) * W1 * HK,
                                 proj[j] + ((size_t)b * Tn + T) * HK, (size_t)W1 * HK * sizeof(float)));
            }
        }
    }
    if (part != FWD_PREPARED) {
        TRY(op->matmul_forward_lp(be, a->z_lp, x, pl->W_z, (int64_t)N, d, HK));
        TRY(op->matmul_forward(be, a->beta, x, pl->W_beta, (int64_t)N, d, H));
        TRY(op->sigmoid_forward(be, a->beta, a->beta, N * H));
    }
    /* a segment recomputes (its acts keep nothing) */
    lm_kda_config kc = carry ? op_config(c, B, T) : op_config_kept(c, a, B, T);
    TRY(op->kda_forward(be, &kc, opin[0], opin[1], opin[2], a->z_lp, a->beta, p->A_log, p->dt_bias,
                        carry ? carry->h0 : NULL, a->o, carry ? carry->ht : ht));
    if (part == FWD_STATE) return LM_OK;
    /* y = W_o( sigmoid(W_g x) ⊙ RMSNorm_head(o) ) */
    TRY(op->matmul_forward(be, a->gate, x, pl->W_g, (int64_t)N, d, HK));
    TRY(op->kda_output_forward(be, lp_separate(c) ? NULL : (float *)a->gated, a->gated, a->o_rstd, a->gate, a->gate,
                               a->o, p->o_norm, (int64_t)N, H, K, c->eps));
    TRY(op->matmul_forward(be, y, a->gated, pl->W_o, (int64_t)N, HK, d));
    return LM_OK;
}

lm_status lm_kda_layer_forward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               lm_kda_layer_acts *a, const float *x, int B, int T, float *y) {
    if (lp_separate(c)) return lm_error(LM_ERR_ARG, "kda layer: this backend needs lm_kda_layer_forward_lp");
    return layer_forward(c, p, p, a, x, B, T, y, NULL, NULL, FWD_ALL);
}

lm_status lm_kda_layer_forward_lp(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                  const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp, int B,
                                  int T, float *y) {
    return layer_forward(c, p, p_lp, a, x_lp, B, T, y, NULL, NULL, FWD_ALL);
}

/* Which parts of a segment's backward run: all of it; the output path's
 * backward (d_o kept in the scratch) and the operator's from it alone, for
 * cg->dh0 (the operator's A_log and dt_bias gradients to `jg`); or the rest
 * after that: the operator's backward with cg's gradients and everything
 * before it, the output path's not again. */
enum { BWD_ALL, BWD_STATE, BWD_AFTER_STATE };

/* Whether the whole rows' backward takes its input gradients on the x side as one operand [N,
 * cat_width] (rows cat_ld apart, in the product format): q's, k's and v's (the conv's input gradients
 * written there at that stride), the output gate's and z's (the output stage's and the operator's
 * backward write them there) and beta's. Then dx takes one product, which writes it, instead of six
 * that each write or read and write its fp32 rows, against the six weights' product-format copies
 * stacked in wcat (a device copy each backward), and W_q, W_k, W_v's gradients one product. Needs a
 * backend with a separate product format that offers those strided writes and matmul_backward_ld, the
 * whole rows (no history rows), W_q, W_k, W_v consecutive in the gradients (as the parameter table
 * lays them out) and the scratch that layout_scratch plans. */
static int cat_inputs(const lm_kda_layer_config *c, const lm_kda_layer_params *g, const scratch_layout *S,
                      size_t N, int ext) {
    lm_backend *be = backend_of(c);
    const lm_ops *op = be->ops;
    if (ext || !lp_separate(c) || !op->conv_silu_backward_lp || !op->matmul_backward_ld || !op->to_lp_rows) return 0;
    const size_t blk = (size_t)c->heads * c->head_dim * (size_t)c->d_model;
    if (g->W_k != g->W_q + blk || g->W_v != g->W_q + 2 * blk) return 0;
    return (S->wcat - S->dgate) * sizeof(float) >= N * cat_ld(c) * be->lp_bytes;
}

/* The backward; carry != NULL: a segment's (cg: its carry's gradients), of which `part` runs. */
static lm_status layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                const lm_kda_layer_params *pl, const lm_kda_layer_params *g,
                                const lm_kda_layer_acts *a, const void *x, const float *dy, const void *dy_given,
                                int B, int T, float *dx, float *scratch, const lm_kda_layer_carry *carry,
                                const lm_kda_layer_carry_grad *cg, int part, const lm_kda_layer_params *jg) {
    // x is (B,T,d) in the product format; dy is (B,T,d); g accumulates; dx (B,T,d) is written by the
    // whole rows' backward (carry NULL: its first product sets it) and accumulated by a segment's
    lm_backend *be = backend_of(c);
    const lm_ops *op = be->ops;
    int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    const int W1 = carry ? W - 1 : 0, Tn = T + W1;
    size_t N = (size_t)B * T, NHK = N * HK, NE = (size_t)B * Tn, lpb = be->lp_bytes;
    scratch_layout S = layout_scratch(c, B, T, carry != NULL);
    float *d_gated = scratch + S.d_gated, *tmp = scratch + S.tmp, *dbeta = scratch + S.dbeta,
          *dgate = scratch + S.dgate, *din = scratch + S.din;
    void *d_o = scratch + S.d_o, *dq = scratch + S.dq, *dk = scratch + S.dk, *dv = scratch + S.dv,
         *dz = scratch + S.dz;
    const void *dy_lp, *dgate_lp, *dbeta_lp, *din_lp;
    /* cat: the input gradients on the x side side by side (cat_inputs): q, k, v, gate, z, beta */
    const int cat = cat_inputs(c, g, &S, N, carry != NULL);
    const size_t ld = cat_ld(c);
    char *dcat = (char *)(scratch + S.dgate);
    if (part != BWD_AFTER_STATE) {
        if (dy_given && lp_separate(c)) dy_lp = dy_given;
        else TRY(lp_view(be, dy, scratch + S.dy_lp, N * d, &dy_lp));
        TRY(op->matmul_backward_set(be, d_gated, g->W_o, dy_lp, a->gated, pl->W_o, (int64_t)N, HK, d));
        /* the output gate and head norm: d gate-logits, d_o */
        /* dgate straight in the product format where that is a separate copy (no fp32 dgate, no conversion);
         * on the CPU the lp view is dgate itself */
        const int sep = lp_separate(c);
        if (cat) {
            /* into its columns of the side-by-side operand; its products come with the others' below */
            TRY(op->kda_output_backward(be, d_o, NULL, dcat + 3 * (size_t)HK * lpb, (int64_t)ld, g->o_norm, d_gated,
                                        a->o, a->o_rstd, a->gate, p->o_norm, (int64_t)N, H, K, c->eps, tmp));
        } else {
            TRY(op->kda_output_backward(be, d_o, sep ? NULL : dgate, sep ? scratch + S.dgate_lp : NULL, 0,
                                        g->o_norm, d_gated, a->o, a->o_rstd, a->gate, p->o_norm, (int64_t)N, H, K,
                                        c->eps, tmp));
            dgate_lp = sep ? (const void *)(scratch + S.dgate_lp) : (const void *)dgate;
            if (carry) TRY(op->matmul_backward(be, dx, g->W_g, dgate_lp, x, pl->W_g, (int64_t)N, d, HK));
            else TRY(op->matmul_backward_set(be, dx, g->W_g, dgate_lp, x, pl->W_g, (int64_t)N, d, HK));
        }
    }
    /* the operator (BWD_STATE: from d_o alone, for dh0; its parameter gradients to jg) */
    lm_kda_config kc = carry ? op_config(c, B, T) : op_config_kept(c, a, B, T);
    if (cat) { /* dz into its columns */
        dz = dcat + 4 * (size_t)HK * lpb;
        kc.dz_ld = (int64_t)ld;
    }
    const lm_kda_layer_params *go = part == BWD_STATE ? jg : g;
    TRY(op->kda_backward(be, &kc, a->q_op, a->k_op, a->v_op, a->z_lp, a->beta, p->A_log, p->dt_bias,
                         carry ? carry->h0 : NULL, d_o, cg && part != BWD_STATE ? cg->dht : NULL, dq, dk, dv, dz,
                         dbeta, go->A_log, go->dt_bias, cg ? cg->dh0 : NULL));
    if (part == BWD_STATE) return LM_OK;
    if (!cat) TRY(op->matmul_backward(be, dx, g->W_z, dz, x, pl->W_z, (int64_t)N, d, HK));
    TRY(op->sigmoid_backward(be, dbeta, dbeta, a->beta, N * H));
    if (cat) {
        TRY(op->to_lp_rows(be, dcat + 5 * (size_t)HK * lpb, (int64_t)ld, dbeta, (int64_t)N, H));
    } else {
        TRY(lp_view(be, dbeta, scratch + S.dbeta_lp, N * H, &dbeta_lp));
        TRY(op->matmul_backward(be, dx, g->W_beta, dbeta_lp, x, pl->W_beta, (int64_t)N, d, H));
    }
    /* q, k, v: normalisation and SiLU, the short convolution (its output recomputed from the projection:
     * conv_out NULL), the projections */
    void *const douts[3] = {dq, dk, dv};
    const float *const proj[3] = {a->qp, a->kp, a->vp};
    const void *const post[3] = {a->q, a->k, a->v};
    const float *const rn[3] = {a->qk_rnorm, a->qk_rnorm + NE * H, NULL};
    const float *const conv_w[3] = {p->conv_q, p->conv_k, p->conv_v};
    const float *const Wm[3] = {pl->W_q, pl->W_k, pl->W_v};
    float *const conv_g[3] = {g->conv_q, g->conv_k, g->conv_v}, *const Wg[3] = {g->W_q, g->W_k, g->W_v};
    if (cat) {
        /* q, k and v's input gradients into their columns, the six weights stacked in wcat in the columns'
         * order; dx = [q k v gate z beta] wcat, one product with K = cat_width that writes it; the weight
         * gradients from the columns: W_q, W_k, W_v's one product (consecutive in g), the others' one each */
        for (int j = 0; j < 3; j++)
            TRY(op->conv_silu_backward_lp(be, dcat + (size_t)j * HK * lpb, conv_g[j], douts[j], NULL, post[j], rn[j],
                                          proj[j], conv_w[j], B, T, HK, W, K, (int)ld, tmp));
        char *wcat = (char *)(scratch + S.wcat);
        const size_t blk = (size_t)HK * d * lpb;
        const void *const wsrc[6] = {pl->W_q, pl->W_k, pl->W_v, pl->W_g, pl->W_z, pl->W_beta};
        for (int j = 0; j < 6; j++) TRY(be->copy(be, wcat + (size_t)j * blk, wsrc[j], j < 5 ? blk : (size_t)H * d * lpb));
        TRY(op->matmul_backward_ld(be, dx, NULL, dcat, (int64_t)ld, x, wcat, (int64_t)N, d, (int)cat_width(c), 1));
        TRY(op->matmul_backward_ld(be, NULL, g->W_q, dcat, (int64_t)ld, x, pl->W_q, (int64_t)N, d, 3 * HK, 0));
        float *const wg[3] = {g->W_g, g->W_z, g->W_beta};
        const void *const wl[3] = {pl->W_g, pl->W_z, pl->W_beta};
        for (int j = 0; j < 3; j++)
            TRY(op->matmul_backward_ld(be, NULL, wg[j], dcat + (3 + (size_t)j) * HK * lpb, (int64_t)ld, x, wl[j],
                                       (int64_t)N, d, j < 2 ? HK : H, 0));
        return LM_OK;
    }
    for (int j = 0; j < 3; j++) {
        if (!carry) {
            if (lp_separate(c) && op->conv_silu_backward_lp) {
                /* din straight in the product format */
                TRY(op->conv_silu_backward_lp(be, scratch + S.din_lp, conv_g[j], douts[j], NULL, post[j], rn[j],
                                              proj[j], conv_w[j], B, T, HK, W, K, HK, tmp));
                din_lp = scratch + S.din_lp;
            } else {
                TRY(op->conv_silu_backward(be, din, conv_g[j], douts[j], NULL, post[j], rn[j], proj[j], conv_w[j],
                                           B, T, HK, W, K, tmp));
                TRY(lp_view(be, din, scratch + S.din_lp, NHK, &din_lp));
            }
            TRY(op->matmul_backward(be, dx, Wg[j], din_lp, x, Wm[j], (int64_t)N, d, HK));
            continue;
        }
        /* a segment: the operator's gradient into the own rows (the history rows' outputs are the earlier
         * segment's: none), the conv over both, the next segment's gradient of this one's last W-1 rows
         * added, the history rows' gradient handed back */
        void *dout = scratch + S.dout_ext;
        TRY(be->zero(be, dout, NE * HK * lpb));
        for (int b = 0; b < B; b++)
            TRY(be->copy(be, at(dout, (size_t)b * Tn + W1, HK, lpb), at(douts[j], (size_t)b * T, HK, lpb),
                         (size_t)T * HK * lpb));
        TRY(op->conv_silu_backward(be, din, conv_g[j], dout, NULL, post[j], rn[j], proj[j], conv_w[j], B, Tn, HK,
                                   W, K, tmp));
        for (int b = 0; W1 && b < B; b++) {
            const size_t hb = ((size_t)j * B + b) * W1 * HK;
            if (cg && cg->dhalo_out)
                TRY(op->accumulate(be, din + ((size_t)b * Tn + T) * HK, cg->dhalo_out + hb, (size_t)W1 * HK, 0));
            if (cg && cg->dhalo)
                TRY(be->copy(be, cg->dhalo + hb, din + (size_t)b * Tn * HK, (size_t)W1 * HK * sizeof(float)));
        }
        TRY(lp_view(be, din, scratch + S.din_lp, NE * HK, &din_lp));
        for (int b = 0; b < B; b++)
            TRY(op->matmul_backward(be, (float *)at(dx, (size_t)b * T, d, sizeof(float)), Wg[j],
                                    at(din_lp, (size_t)b * Tn + W1, HK, lpb), at(x, (size_t)b * T, d, lpb), Wm[j], T,
                                    d, HK));
    }
    return LM_OK;
}

lm_status lm_kda_layer_backward_lp(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                   const lm_kda_layer_params *pl, const lm_kda_layer_params *g,
                                   const lm_kda_layer_acts *a, const void *x, const float *dy, const void *dy_lp,
                                   int B, int T, float *dx, float *scratch) {
    return layer_backward(c, p, pl, g, a, x, dy, dy_lp, B, T, dx, scratch, NULL, NULL, BWD_ALL, NULL);
}

lm_status lm_kda_layer_forward_seg(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                   const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp, int B,
                                   int n, const lm_kda_layer_carry *carry, float *y) {
    if (!carry) return lm_error(LM_ERR_ARG, "kda layer segment forward: carry is NULL");
    return layer_forward(c, p, p_lp, a, x_lp, B, n, y, NULL, carry, FWD_ALL);
}

lm_status lm_kda_layer_seg_final_state(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                       const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp,
                                       int B, int n, const lm_kda_layer_carry *carry) {
    if (!carry || !carry->ht) return lm_error(LM_ERR_ARG, "kda layer segment final state: carry or its ht is NULL");
    return layer_forward(c, p, p_lp, a, x_lp, B, n, NULL, NULL, carry, FWD_STATE);
}

lm_status lm_kda_layer_forward_seg_prepared(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                            const lm_kda_layer_params *p_lp, lm_kda_layer_acts *a, const void *x_lp,
                                            int B, int n, const lm_kda_layer_carry *carry, float *y) {
    if (!carry) return lm_error(LM_ERR_ARG, "kda layer segment forward: carry is NULL");
    return layer_forward(c, p, p_lp, a, x_lp, B, n, y, NULL, carry, FWD_PREPARED);
}

lm_status lm_kda_layer_backward_seg(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                    const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                    const lm_kda_layer_acts *a, const void *x_lp, const float *dy, int B, int n,
                                    const lm_kda_layer_carry *carry, const lm_kda_layer_carry_grad *cg, float *dx,
                                    float *scratch) {
    if (!carry) return lm_error(LM_ERR_ARG, "kda layer segment backward: carry is NULL");
    return layer_backward(c, p, p_lp, g, a, x_lp, dy, NULL, B, n, dx, scratch, carry, cg, BWD_ALL, NULL);
}

size_t lm_kda_layer_seg_state_grad_junk_floats(const lm_kda_layer_config *c) {
    return 2 * (((size_t)c->heads + 15) & ~(size_t)15);
}

lm_status lm_kda_layer_seg_state_grad(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                      const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                      const lm_kda_layer_acts *a, const void *x_lp, const float *dy, int B, int n,
                                      const lm_kda_layer_carry *carry, float *dx, float *dh0, float *junk,
                                      float *scratch) {
    if (!carry || !g || !dx || !dh0 || !junk)
        return lm_error(LM_ERR_ARG, "kda layer state gradient: carry, g, dx, dh0 or junk is NULL");
    lm_kda_layer_params j;
    memset(&j, 0, sizeof j);
    j.A_log = junk;
    j.dt_bias = junk + lm_kda_layer_seg_state_grad_junk_floats(c) / 2;
    lm_kda_layer_carry_grad cg = {NULL, dh0, NULL, NULL};
    return layer_backward(c, p, p_lp, g, a, x_lp, dy, NULL, B, n, dx, scratch, carry, &cg, BWD_STATE, &j);
}

lm_status lm_kda_layer_backward_seg_after_state(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                                const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g,
                                                const lm_kda_layer_acts *a, const void *x_lp, int B, int n,
                                                const lm_kda_layer_carry *carry, const lm_kda_layer_carry_grad *cg,
                                                float *dx, float *scratch) {
    if (!carry) return lm_error(LM_ERR_ARG, "kda layer segment backward: carry is NULL");
    return layer_backward(c, p, p_lp, g, a, x_lp, NULL, NULL, B, n, dx, scratch, carry, cg, BWD_AFTER_STATE, NULL);
}

lm_status lm_kda_layer_seg_state_map(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                     const lm_kda_layer_acts *a, int B, int n, const void *v_zero_lp,
                                     const float *ident, void *o_lp, float *P) {
    if (!a || !v_zero_lp || !ident || !o_lp || !P) return lm_error(LM_ERR_ARG, "kda layer state map: a buffer is NULL");
    lm_backend *be = backend_of(c);
    lm_kda_config kc = op_config(c, B, n);
    return be->ops->kda_forward(be, &kc, a->q_op, a->k_op, v_zero_lp, a->z_lp, a->beta, p->A_log, p->dt_bias, ident,
                                o_lp, P);
}

lm_status lm_kda_layer_backward(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                const lm_kda_layer_params *g, const lm_kda_layer_acts *a,
                                const float *x, const float *dy, int B, int T, float *dx,
                                float *scratch) {
    if (lp_separate(c)) return lm_error(LM_ERR_ARG, "kda layer: this backend needs lm_kda_layer_backward_lp");
    return lm_kda_layer_backward_lp(c, p, p, g, a, x, dy, NULL, B, T, dx, scratch);
}

/* ---- decode ---- */

size_t lm_kda_layer_cache_floats(const lm_kda_layer_config *c, int B) {
    size_t H = (size_t)c->heads, K = (size_t)c->head_dim, HK = H * K, W1 = (size_t)(c->conv_width - 1);
    return 3 * (size_t)B * W1 * HK + (size_t)B * H * K * K;
}

lm_status lm_kda_layer_cache_init(const lm_kda_layer_config *c, lm_kda_layer_cache *cache, int B,
                                  float *mem) {
    if (!cache || !mem) return lm_error(LM_ERR_ARG, "kda layer cache_init: cache and memory are required");
    if (B < 1) return lm_error(LM_ERR_ARG, "kda layer cache_init: B=%d must be >= 1", B);
    if (c->conv_width < 1)
        return lm_error(LM_ERR_ARG, "kda layer cache_init: conv_width=%d must be >= 1", c->conv_width);
    size_t HK = (size_t)c->heads * c->head_dim, tail = (size_t)B * (c->conv_width - 1) * HK;
    memset(mem, 0, lm_kda_layer_cache_floats(c, B) * sizeof(float));
    cache->B = B;
    cache->len = 0;
    cache->tail_q = mem;
    cache->tail_k = mem + tail;
    cache->tail_v = mem + 2 * tail;
    cache->S = mem + 3 * tail;
    return LM_OK;
}

size_t lm_kda_layer_step_scratch_floats(const lm_kda_layer_config *c, int B) {
    size_t H = (size_t)c->heads, K = (size_t)c->head_dim, HK = H * K;
    return 10 * (size_t)B * HK + 4 * (size_t)B * H + (size_t)B * H * K * K;
}

lm_status lm_kda_layer_prefill(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               lm_kda_layer_acts *a, lm_kda_layer_cache *cache, const float *x,
                               int T, float *y) {
    // x is (B,T,d), y is (B,T,d); the cache receives the state after T tokens
    if (!cache) return lm_error(LM_ERR_ARG, "kda layer prefill: cache is NULL");
    if (cache->len != 0) return lm_error(LM_ERR_ARG, "kda layer prefill: cache already holds %d tokens", cache->len);
    if (T < 1) return lm_error(LM_ERR_ARG, "kda layer prefill: T=%d must be >= 1", T);
    const int B = cache->B, HK = c->heads * c->head_dim, W = c->conv_width;
    /* the layer's forward, keeping the operator's final state */
    lm_status s = layer_forward(c, p, p, a, x, B, T, y, cache->S, NULL, FWD_ALL);
    if (s) return s;
    /* the conv history: projections of the last W-1 tokens (zero before the start) */
    const float *proj[3] = {a->qp, a->kp, a->vp};
    float *tails[3] = {cache->tail_q, cache->tail_k, cache->tail_v};
    for (int j = 0; j < 3; j++)
        for (int b = 0; b < B; b++)
            for (int i = 0; i < W - 1; i++) {
                int src = T - (W - 1) + i;
                float *dst = tails[j] + ((size_t)b * (W - 1) + i) * HK;
                if (src < 0) memset(dst, 0, (size_t)HK * sizeof(float));
                else memcpy(dst, proj[j] + ((size_t)b * T + src) * HK, (size_t)HK * sizeof(float));
            }
    cache->len = T;
    return LM_OK;
}

/* One step of the causal conv: out = sum_i w[:,i] [tail ; cur]_i, then the
 * tail shifts by one and takes cur (short_conv_forward at the last position). */
static void short_conv_step(float *out, float *tail, const float *cur, const float *w, int B, int C, int W) {
    // cur, out are (B,C); tail is (B,W-1,C); w is (C,W)
    for (int b = 0; b < B; b++) {
        float *o = out + (size_t)b * C, *tb = tail + (size_t)b * (W - 1) * C;
        const float *xc = cur + (size_t)b * C;
        for (int ch = 0; ch < C; ch++) o[ch] = 0.0f;
        for (int i = 0; i < W; i++) {
            const float *xi = i < W - 1 ? tb + (size_t)i * C : xc;
            for (int ch = 0; ch < C; ch++) o[ch] += w[(size_t)ch * W + i] * xi[ch];
        }
        if (W > 1) {
            memmove(tb, tb + C, (size_t)(W - 2) * C * sizeof(float));
            memcpy(tb + (size_t)(W - 2) * C, xc, (size_t)C * sizeof(float));
        }
    }
}

lm_status lm_kda_layer_step(const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                            lm_kda_layer_cache *cache, const float *x, float *y, float *scratch) {
    // x is (B,d), y is (B,d); scratch holds lm_kda_layer_step_scratch_floats floats
    if (!cache || !x || !y || !scratch)
        return lm_error(LM_ERR_ARG, "kda layer step: cache, x, y and scratch are required");
    const int B = cache->B, d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width;
    const size_t BHK = (size_t)B * HK, BH = (size_t)B * H;
    float *qp = scratch, *kp = qp + BHK, *vp = kp + BHK, *cq = vp + BHK, *q = cq + BHK, *k = q + BHK,
          *v = k + BHK, *z = v + BHK, *o = z + BHK, *gated = o + BHK, *beta = gated + BHK,
          *rnorm = beta + BH, *rstd = rnorm + 2 * BH, *ht = rstd + BH;
    lm_matmul_forward(qp, x, p->W_q, NULL, B, d, HK);
    lm_matmul_forward(kp, x, p->W_k, NULL, B, d, HK);
    lm_matmul_forward(vp, x, p->W_v, NULL, B, d, HK);
    /* q, k: L2Norm(SiLU(ShortConv(.))); v: SiLU(ShortConv(.)) */
    short_conv_step(cq, cache->tail_q, qp, p->conv_q, B, HK, W);
    lm_silu_l2_forward(q, rnorm, cq, BH, K);
    short_conv_step(cq, cache->tail_k, kp, p->conv_k, B, HK, W);
    lm_silu_l2_forward(k, rnorm + BH, cq, BH, K);
    short_conv_step(cq, cache->tail_v, vp, p->conv_v, B, HK, W);
    lm_silu_l2_forward(v, NULL, cq, BH, K);
    lm_matmul_forward(z, x, p->W_z, NULL, B, d, HK);
    lm_matmul_forward(beta, x, p->W_beta, NULL, B, d, H);
    for (size_t i = 0; i < BH; i++) beta[i] = lm_sigmoidf(beta[i]);
    /* SPEC §2 recurrence, one token: S_{t-1} -> S_t, o_t (T = 1, h0 = S) */
    lm_kda_config kc = op_config(c, B, 1);
    lm_kda_inputs in = {q, k, v, z, beta, p->A_log, p->dt_bias, cache->S};
    lm_status s = lm_kda_recurrent_forward(&kc, &in, o, ht);
    if (s) return s;
    memcpy(cache->S, ht, BH * (size_t)K * K * sizeof(float));
    /* head RMSNorm, output gate sigmoid(W_g x), W_o */
    lm_rmsnorm_forward(gated, rstd, o, p->o_norm, (int64_t)BH, K, c->eps);
    lm_matmul_forward(cq, x, p->W_g, NULL, B, d, HK);
    for (size_t i = 0; i < BHK; i++) gated[i] *= lm_sigmoidf(cq[i]);
    lm_matmul_forward(y, gated, p->W_o, NULL, B, HK, d);
    cache->len++;
    return LM_OK;
}
