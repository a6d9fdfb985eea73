/* The KDA token mixer under context parallelism
 * (include/longmoe/kda_layer_context_parallel.h, docs/scaleout.md; SPEC §9),
 * on any backend: the layer's own segment functions (src/model/kda_layer.c,
 * lm_kda_layer_forward_seg / _backward_seg) through the backend's ops, every
 * buffer in the backend's memory and every collective on `comm`'s engine; the
 * short convolution's halo exchanged and the operator's state scanned across
 * ranks through the segments' state maps. */
#include "longmoe/kda_layer_context_parallel.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cp_internal.h"
#include "longmoe/backend.h"

static size_t hk_of(const lm_kda_layer_config *c) { return (size_t)c->heads * c->head_dim; }
/* one rank's tail or halo block [3, B, W-1, HK] (q, k, v projections) */
static size_t blk_of(const lm_kda_layer_config *c, int B) { return (size_t)B * (c->conv_width - 1) * 3 * hk_of(c); }

static int config_ok(const lm_kda_layer_config *c) {
    return c && c->d_model >= 1 && c->heads >= 1 && c->head_dim >= 1 && c->conv_width >= 1 && c->conv_width <= 64;
}

/* Floats of n elements in the backend's product format. */
static size_t lp_f(const lm_kda_layer_config *c, size_t n) {
    const lm_backend *be = c->backend ? c->backend : lm_backend_cpu();
    return (n * be->lp_bytes + sizeof(float) - 1) / sizeof(float);
}

typedef struct {
    size_t seg, S_in, P, halo, ident, total;
} lp_acts;

typedef struct {
    size_t seg, pk, all, s0, s1, vzero, otmp, junk, tail, tails, dtail, dtail_lp, total;
} lp_scratch;

#define PLACE(s, f, n) ((s).f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */

static size_t states_of(const lm_kda_layer_config *c, int B) {
    return (size_t)B * c->heads * c->head_dim * c->head_dim;
}

static lp_acts lp_acts_of(const lm_kda_layer_config *c, int B, int n) {
    lp_acts a;
    size_t off = 0;
    PLACE(a, seg, lm_kda_layer_seg_act_floats(c, B, n));
    PLACE(a, S_in, states_of(c, B));
    PLACE(a, P, states_of(c, B));
    PLACE(a, halo, blk_of(c, B));
    PLACE(a, ident, states_of(c, B)); /* constant: the identity the map's run starts from */
    a.total = off;
    return a;
}

static lp_scratch lp_scratch_of(const lm_kda_layer_config *c, int R, int B, int n) {
    const size_t N = (size_t)B * n, HK = hk_of(c), ns = states_of(c, B), blk = blk_of(c, B);
    lp_scratch s;
    size_t off = 0;
    PLACE(s, seg, lm_kda_layer_seg_scratch_floats(c, B, n));
    PLACE(s, pk, 2 * ns); /* this rank's [P | Q] (forward) or [P | D] (backward) */
    PLACE(s, all, (size_t)R * 2 * ns);
    PLACE(s, s0, ns);
    PLACE(s, s1, ns);
    PLACE(s, vzero, lp_f(c, N * HK));
    PLACE(s, otmp, lp_f(c, N * HK)); /* the map run's outputs */
    PLACE(s, junk, lm_kda_layer_seg_state_grad_junk_floats(c));
    PLACE(s, tail, blk);             /* the own tail's projections, or the halo's gradient */
    PLACE(s, tails, (size_t)R * blk); /* every rank's */
    PLACE(s, dtail, blk);
    PLACE(s, dtail_lp, lp_f(c, blk));
    s.total = off;
    return s;
}
#undef PLACE

size_t lm_kda_layer_cp_lp_act_floats(const lm_kda_layer_config *c, int B, int n) {
    if (!config_ok(c) || B < 1 || n < 1) return 0;
    return lp_acts_of(c, B, n).total;
}

lm_status lm_kda_layer_cp_lp_acts_init(const lm_kda_layer_config *c, int B, int n, float *acts) {
    if (!config_ok(c) || B < 1 || n < 1 || !acts)
        return lm_error(LM_ERR_ARG, "kda layer context parallel: acts init needs a valid config, B, n and acts");
    lm_backend *be = c->backend ? c->backend : lm_backend_cpu();
    const size_t ns = states_of(c, B), K = (size_t)c->head_dim;
    float *id = calloc(ns, sizeof(float));
    if (!id) return lm_error(LM_ERR_MEMORY, "kda layer context parallel: out of memory");
    for (size_t q = 0; q < (size_t)B * c->heads; q++)
        for (size_t i = 0; i < K; i++) id[(q * K + i) * K + i] = 1.0f;
    lm_status st = be->upload(be, acts + lp_acts_of(c, B, n).ident, id, ns * sizeof(float));
    free(id);
    return st;
}

size_t lm_kda_layer_cp_lp_scratch_floats(const lm_kda_layer_config *c, int comm_size, int B, int n) {
    if (!config_ok(c) || comm_size < 1 || B < 1 || n < 1) return 0;
    return lp_scratch_of(c, comm_size, B, n).total;
}

static lm_status lp_check_args(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               const lm_kda_layer_params *pl, const void *x, int B, int t0, int n, const char *what) {
    if (!config_ok(c)) return lm_error(LM_ERR_ARG, "%s: invalid layer config (conv_width 1..64, dims >= 1)", what);
    if (!p || !p->W_q || !p->W_o || !pl || !pl->W_q || !pl->W_o)
        return lm_error(LM_ERR_ARG, "%s: params are NULL (use lm_kda_layer_params_map)", what);
    if (!x) return lm_error(LM_ERR_ARG, "%s: x is NULL", what);
    if (B < 1 || t0 < 0 || n < 1) return lm_error(LM_ERR_ARG, "%s: B=%d, t0=%d, n=%d (need B, n >= 1, t0 >= 0)", what, B, t0, n);
    (void)comm;
    return LM_OK;
}

/* The owner of global position pos (0 <= pos < t0 of rank `below`) among the earlier ranks. */
static int owner_below(const int32_t *seg, int below, int64_t pos) {
    for (int p = below - 1; p >= 0; p--)
        if (pos >= seg[3 * p + 1]) return p;
    return -1;
}

/* Forward: the halo from the earlier ranks' tails, the segment's map, the scan, the segment from its state. */
static lm_status lp_forward_body(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                 const lm_kda_layer_params *pl, const void *x, int B, int t0, int n, float *y,
                                 float *acts, float *scratch, const int32_t *seg) {
    lm_backend *be = c->backend ? c->backend : lm_backend_cpu();
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W1 = c->conv_width - 1;
    const size_t lpb = be->lp_bytes, ns = states_of(c, B), blk = blk_of(c, B), row = (size_t)HK * sizeof(float);
    const lp_acts A = lp_acts_of(c, B, n);
    const lp_scratch S = lp_scratch_of(c, R, B, n);
    lm_kda_layer_acts a;
    lm_kda_layer_seg_acts_map(c, B, n, acts + A.seg, &a);
    float *halo = acts + A.halo, *tail = scratch + S.tail, *tails = scratch + S.tails, *pk = scratch + S.pk;
    /* the tail: this rank's last m = min(n, W-1) projections of q, k, v, right-aligned in [3,B,W-1,HK] */
    if (W1 > 0 && R > 1) {
        const int m = n < W1 ? n : W1;
        const float *Wm[3] = {pl->W_q, pl->W_k, pl->W_v};
        if (m < W1) TRY(be->zero(be, tail, blk * sizeof(float)));
        for (int j = 0; j < 3; j++)
            for (int b = 0; b < B; b++)
                TRY(op->matmul_forward(be, tail + (((size_t)j * B + b) * W1 + W1 - m) * HK,
                                       (const char *)x + ((size_t)b * n + n - m) * d * lpb, Wm[j], m, d, HK));
        TRY(lm_comm_all_gather(comm, tail, tails, blk * sizeof(float)));
    }
    /* the halo: position t0 - W1 + i from its owner's tail (zero before the sequence start) */
    for (int i = 0; i < W1;) {
        const int64_t pos = (int64_t)t0 - W1 + i;
        const int s = pos >= 0 ? owner_below(seg, me, pos) : -1;
        int len = 1; /* a run of positions from the same owner: consecutive rows of its tail */
        while (i + len < W1 && (pos + len >= 0 ? owner_below(seg, me, pos + len) : -1) == s) len++;
        for (int j = 0; j < 3; j++)
            for (int b = 0; b < B; b++) {
                float *dst = halo + (((size_t)j * B + b) * W1 + i) * HK;
                if (s < 0) {
                    TRY(be->zero(be, dst, (size_t)len * row));
                } else {
                    const int r = W1 - (int)(seg[3 * s + 1] + seg[3 * s + 2] - pos);
                    TRY(be->copy(be, dst, tails + (size_t)s * blk + (((size_t)j * B + b) * W1 + r) * HK,
                                 (size_t)len * row));
                }
            }
        i += len;
    }
    const float *halo_in = W1 > 0 ? halo : NULL;
    if (R == 1) { /* the whole sequence */
        lm_kda_layer_carry cr = {NULL, NULL, halo_in, NULL};
        TRY(be->zero(be, acts + A.S_in, ns * sizeof(float)));
        return lm_kda_layer_forward_seg(c, p, pl, &a, x, B, n, &cr, y);
    }
    if (me == 0) {
        /* from a zero state: the outputs, and the map's Q */
        lm_kda_layer_carry c0 = {NULL, pk + ns, halo_in, NULL};
        TRY(lm_kda_layer_forward_seg(c, p, pl, &a, x, B, n, &c0, y));
    } else if (me < R - 1) {
        /* a middle rank: the operator's inputs and, from a zero state, the map's Q alone (no outputs:
         * the segment runs again from its incoming state below, over the same inputs) */
        lm_kda_layer_carry c0 = {NULL, pk + ns, halo_in, NULL};
        TRY(lm_kda_layer_seg_final_state(c, p, pl, &a, x, B, n, &c0));
    }
    if (me < R - 1) {
        /* the map's P: the operator from the identity with zero values */
        TRY(be->zero(be, scratch + S.vzero, (size_t)B * n * HK * lpb));
        TRY(lm_kda_layer_seg_state_map(c, p, &a, B, n, scratch + S.vzero, acts + A.ident, scratch + S.otmp, pk));
    } else {
        /* the last segment's map is never applied */
        TRY(be->zero(be, pk, 2 * ns * sizeof(float)));
    }
    TRY(be->copy(be, acts + A.P, pk, ns * sizeof(float)));
    TRY(lm_comm_all_gather(comm, pk, scratch + S.all, 2 * ns * sizeof(float)));
    /* the state entering this segment: the earlier maps applied in rank order to zero */
    float *cur = NULL, *nxt = scratch + S.s0;
    for (int q = 0; q < me; q++) {
        const float *mq = scratch + S.all + (size_t)q * 2 * ns;
        TRY(op->kda_state_apply(be, B * H, K, K, mq, mq + ns, cur, nxt, 0));
        cur = nxt;
        nxt = nxt == scratch + S.s0 ? scratch + S.s1 : scratch + S.s0;
    }
    if (!cur) return be->zero(be, acts + A.S_in, ns * sizeof(float)); /* rank 0: y is final */
    TRY(be->copy(be, acts + A.S_in, cur, ns * sizeof(float)));
    lm_kda_layer_carry c1 = {acts + A.S_in, NULL, halo_in, NULL};
    if (me < R - 1) return lm_kda_layer_forward_seg_prepared(c, p, pl, &a, x, B, n, &c1, y);
    return lm_kda_layer_forward_seg(c, p, pl, &a, x, B, n, &c1, y);
}

lm_status lm_kda_layer_cp_forward_lp(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                     const lm_kda_layer_params *p_lp, const void *x_lp, int B, int t0, int n, float *y,
                                     float *acts, float *scratch) {
    const char *what = "kda layer context parallel forward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = lp_check_args(comm, c, p, p_lp, x_lp, B, t0, n, what);
    if (!local && (!y || !acts || !scratch))
        local = lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !y ? "y" : !acts ? "acts" : "scratch");
    int32_t *seg = NULL;
    lm_status st = lm_cp_segment_table(comm, B, t0, n, local, what, &seg);
    if (!st) st = lp_forward_body(comm, c, p, p_lp, x_lp, B, t0, n, y, acts, scratch, seg);
    free(seg);
    return st;
}

/* Backward: D, the gradient of the incoming state from the segment's own outputs (ranks after the
 * first: the output path's backward and the operator's from it), the maps [P | D] gathered and
 * scanned last first for the gradient of the outgoing state, then the rest of the segment's
 * backward with it; the halo's gradient to its owners. */
static lm_status lp_backward_body(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                  const lm_kda_layer_params *pl, const lm_kda_layer_params *g, const void *x,
                                  const float *acts, const float *dy, int B, int t0, int n, float *dx, float *scratch,
                                  const int32_t *seg) {
    lm_backend *be = c->backend ? c->backend : lm_backend_cpu();
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W1 = c->conv_width - 1;
    const size_t lpb = be->lp_bytes, ns = states_of(c, B), blk = blk_of(c, B);
    const lp_acts A = lp_acts_of(c, B, n);
    const lp_scratch S = lp_scratch_of(c, R, B, n);
    lm_kda_layer_acts a;
    lm_kda_layer_seg_acts_map(c, B, n, (float *)acts + A.seg, &a);
    float *pk = scratch + S.pk, *dhalo = scratch + S.tail, *tails = scratch + S.tails;
    lm_kda_layer_carry cr = {me > 0 ? acts + A.S_in : NULL, NULL, W1 > 0 ? acts + A.halo : NULL, NULL};
    const float *dS_out = NULL;
    if (R > 1) {
        /* D (rank 0's is never applied: zero), with the output path's backward, which is not run again */
        if (me > 0)
            TRY(lm_kda_layer_seg_state_grad(c, p, pl, g, &a, x, dy, B, n, &cr, dx, pk + ns, scratch + S.junk,
                                            scratch + S.seg));
        else
            TRY(be->zero(be, pk + ns, ns * sizeof(float)));
        TRY(be->copy(be, pk, acts + A.P, ns * sizeof(float)));
        TRY(lm_comm_all_gather(comm, pk, scratch + S.all, 2 * ns * sizeof(float)));
        /* the outgoing state's gradient: the later segments' maps, last first, from zero */
        float *cur = NULL, *nxt = scratch + S.s0;
        for (int q = R - 1; q > me; q--) {
            const float *mq = scratch + S.all + (size_t)q * 2 * ns;
            TRY(op->kda_state_apply(be, B * H, K, K, mq, mq + ns, cur, nxt, 1));
            cur = nxt;
            nxt = nxt == scratch + S.s0 ? scratch + S.s1 : scratch + S.s0;
        }
        dS_out = cur;
    }
    /* the segment's backward: its own outputs and, through the outgoing state, the later ones */
    lm_kda_layer_carry_grad cg = {dS_out, NULL, NULL, W1 > 0 ? dhalo : NULL};
    if (R > 1 && me > 0)
        TRY(lm_kda_layer_backward_seg_after_state(c, p, pl, g, &a, x, B, n, &cr, &cg, dx, scratch + S.seg));
    else
        TRY(lm_kda_layer_backward_seg(c, p, pl, g, &a, x, dy, B, n, &cr, &cg, dx, scratch + S.seg));
    if (R == 1 || W1 == 0) return LM_OK;
    /* the halo's gradient to its owners: each adds the later ranks' parts of its last rows in rank order */
    TRY(lm_comm_all_gather(comm, dhalo, tails, blk * sizeof(float)));
    float *dtail = scratch + S.dtail;
    int any = 0;
    for (int q = me + 1; q < R; q++) {
        const int64_t first = (int64_t)seg[3 * q + 1] - W1; /* the position of q's halo row 0 */
        int i0 = (int)((int64_t)t0 > first ? t0 - first : 0), i1 = (int)((int64_t)t0 + n - first);
        if (i1 > W1) i1 = W1;
        if (i0 >= i1) continue;
        if (!any) TRY(be->zero(be, dtail, blk * sizeof(float)));
        any = 1;
        const int r0 = W1 - (int)((int64_t)t0 + n - (first + i0)); /* the tail row of position first + i0 */
        for (int j = 0; j < 3; j++)
            for (int b = 0; b < B; b++)
                TRY(op->accumulate(be, dtail + (((size_t)j * B + b) * W1 + r0) * HK,
                                   tails + (size_t)q * blk + (((size_t)j * B + b) * W1 + i0) * HK,
                                   (size_t)(i1 - i0) * HK, 0));
    }
    if (!any) return LM_OK;
    /* through the projections of the last m rows: dx and dW_q, dW_k, dW_v */
    const int m = n < W1 ? n : W1;
    const float *Wm[3] = {pl->W_q, pl->W_k, pl->W_v};
    float *Wg[3] = {g->W_q, g->W_k, g->W_v};
    void *dl = scratch + S.dtail_lp;
    const void *dlp = dtail;
    if (lpb != sizeof(float)) {
        TRY(op->to_lp(be, dl, dtail, blk));
        dlp = dl;
    }
    for (int j = 0; j < 3; j++)
        for (int b = 0; b < B; b++)
            TRY(op->matmul_backward(be, dx + ((size_t)b * n + n - m) * d, Wg[j],
                                    (const char *)dlp + (((size_t)j * B + b) * W1 + W1 - m) * HK * lpb,
                                    (const char *)x + ((size_t)b * n + n - m) * d * lpb, Wm[j], m, d, HK));
    return LM_OK;
}

lm_status lm_kda_layer_cp_backward_lp(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                      const lm_kda_layer_params *p_lp, const lm_kda_layer_params *g, const void *x_lp,
                                      const float *acts, const float *dy, int B, int t0, int n, float *dx,
                                      float *scratch) {
    const char *what = "kda layer context parallel backward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = lp_check_args(comm, c, p, p_lp, x_lp, B, t0, n, what);
    if (!local && (!g || !acts || !dy || !dx || !scratch))
        local = lm_error(LM_ERR_ARG, "%s: %s is NULL", what,
                         !g ? "g" : !acts ? "acts" : !dy ? "dy" : !dx ? "dx" : "scratch");
    int32_t *seg = NULL;
    lm_status st = lm_cp_segment_table(comm, B, t0, n, local, what, &seg);
    if (!st) st = lp_backward_body(comm, c, p, p_lp, g, x_lp, acts, dy, B, t0, n, dx, scratch, seg);
    free(seg);
    return st;
}
