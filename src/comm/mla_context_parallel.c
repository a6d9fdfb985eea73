/* The gated attention layer (MLA or GQA) under context parallelism
 * (include/longmoe/mla_context_parallel.h, docs/scaleout.md; SPEC §9), on any
 * backend: the layer's own segment functions (src/model/mla.c), the stored
 * rows of the earlier ranks exchanged, the queries attending by global
 * position, the stored rows' gradients returned to their owners. Also the
 * context-parallel agreements the KDA layer shares (cp_internal.h). */
#include "longmoe/mla_context_parallel.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cp_internal.h"
#include "longmoe/backend.h"

static int is_mla(const lm_mla_config *c) { return c->kind == LM_ATTN_MLA; }
static int kv_heads_of(const lm_mla_config *c) { return is_mla(c) ? c->n_heads : c->n_kv_heads; }

lm_status lm_cp_agree(lm_comm *comm, lm_status local, const char *what) {
    const int R = lm_comm_size(comm);
    int32_t *all = malloc((size_t)R * sizeof(int32_t)), mine = (int32_t)local;
    if (!all) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    lm_status st = lm_comm_all_gather(comm, &mine, all, sizeof mine);
    int bad = -1;
    lm_status why = LM_OK;
    for (int p = 0; !st && p < R && bad < 0; p++)
        if (all[p]) bad = p, why = (lm_status)all[p];
    free(all);
    if (st) return st;
    if (local) return local;
    /* the failing rank's status: a non-finite input there (LM_ERR_NUMERIC) is one here too, so a trainer
     * skips the step on every rank as it does on one */
    if (bad >= 0 && why == LM_ERR_NUMERIC)
        return lm_error(LM_ERR_NUMERIC, "%s: rank %d met a non-finite value", what, bad);
    if (bad >= 0) return lm_error(why, "%s: rank %d refused its arguments", what, bad);
    return LM_OK;
}

lm_status lm_cp_gather_segments(lm_comm *comm, int B, int t0, int n, lm_status local, int32_t *seg,
                                const char *what) {
    TRY(lm_cp_agree(comm, local, what));
    const int R = lm_comm_size(comm);
    int32_t mine[3] = {B, t0, n};
    TRY(lm_comm_all_gather(comm, mine, seg, sizeof mine));
    int64_t next = 0;
    for (int p = 0; p < R; p++) {
        const int32_t *s = seg + 3 * p;
        if (s[0] != seg[0])
            return lm_error(LM_ERR_ARG, "%s: rank %d has B=%d, rank 0 B=%d (the same sequences on every rank)", what,
                            p, s[0], seg[0]);
        if (s[2] < 1 || s[1] != next)
            return lm_error(LM_ERR_ARG,
                            "%s: rank %d holds tokens [%d, %d): segments must follow rank order without gaps "
                            "(expected t0 = %lld and n >= 1)",
                            what, p, s[1], s[1] + s[2], (long long)next);
        next += s[2];
    }
    if (next > INT32_MAX) return lm_error(LM_ERR_ARG, "%s: %lld tokens do not fit an int", what, (long long)next);
    return LM_OK;
}

lm_status lm_cp_segment_table(lm_comm *comm, int B, int t0, int n, lm_status local, const char *what, int32_t **seg) {
    *seg = malloc(3 * (size_t)lm_comm_size(comm) * sizeof(int32_t));
    if (!*seg) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    lm_status st = lm_cp_gather_segments(lm_comm_host(comm), B, t0, n, local, *seg, what);
    if (st) {
        free(*seg);
        *seg = NULL;
    }
    return st;
}

/* ---------------------------------------------------------------- the layer
 * lm_mla_forward_seg, _backward_seg, _seg_store_rows and _seg_stores_backward
 * through the backend's ops, every buffer in the backend's memory and every
 * collective on `comm`'s engine. MLA keeps the latent form of the stores (c,
 * and the rotary key with RoPE), GQA the keys and values. */

static lm_backend *backend_of_cfg(const lm_mla_config *c) { return c->backend ? c->backend : lm_backend_cpu(); }

/* The two stored arrays of a token: their element counts and element bytes
 * (the latent in the product format and the rotary key in fp32; or the keys
 * and values, both in the product format). */
static void store_rows(const lm_mla_config *c, size_t *ea, size_t *ba, size_t *eb, size_t *bb) {
    const size_t lpb = backend_of_cfg(c)->lp_bytes;
    if (is_mla(c)) {
        *ea = (size_t)c->kv_lora, *ba = lpb, *eb = (size_t)c->rope_dims, *bb = sizeof(float);
    } else {
        const size_t Hk = (size_t)c->n_kv_heads;
        *ea = Hk * c->head_dim_qk, *ba = lpb, *eb = Hk * c->head_dim_v, *bb = lpb;
    }
}

static size_t fl(size_t bytes) { return (bytes + sizeof(float) - 1) / sizeof(float); }

typedef struct {
    size_t acts, sa, sb, total;
} lp_cp_acts;

typedef struct {
    size_t scr, kw, vw, dkt, dvt, acc_a, acc_b, send, recv, total;
} lp_cp_scratch;

#define PLACE(s, f, n) ((s).f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */

static lp_cp_acts lp_cp_acts_of(const lm_mla_config *c, int B, int t0, int n) {
    size_t ea, ba, eb, bb, off = 0;
    store_rows(c, &ea, &ba, &eb, &bb);
    const size_t rows = (size_t)B * ((size_t)t0 + n);
    lp_cp_acts a;
    PLACE(a, acts, lm_mla_acts_floats(c, B, n));
    PLACE(a, sa, fl(rows * ea * ba));
    PLACE(a, sb, fl(rows * eb * bb));
    a.total = off;
    return a;
}

static lp_cp_scratch lp_cp_scratch_of(const lm_mla_config *c, int R, int B, int t0, int n) {
    size_t ea, ba, eb, bb, off = 0;
    store_rows(c, &ea, &ba, &eb, &bb);
    const size_t lpb = backend_of_cfg(c)->lp_bytes, P = (size_t)t0 + n, Hk = (size_t)kv_heads_of(c);
    const size_t w = ea * ba > eb * bb ? ea * ba : eb * bb; /* the wider row in bytes (fp32 for the sums) */
    const size_t wf = ea > eb ? ea : eb;
    lp_cp_scratch s;
    PLACE(s, scr, lm_mla_scratch_floats(c, B, n));
    PLACE(s, kw, is_mla(c) ? fl(P * c->n_heads * c->head_dim_qk * lpb) : 0);
    PLACE(s, vw, is_mla(c) ? fl(P * c->n_heads * c->head_dim_v * lpb) : 0);
    PLACE(s, dkt, fl(P * Hk * c->head_dim_qk * lpb));
    PLACE(s, dvt, fl(P * Hk * c->head_dim_v * lpb));
    PLACE(s, acc_a, (size_t)B * P * ea);
    PLACE(s, acc_b, (size_t)B * P * eb);
    /* the exchanges: forward, this segment's rows out and the earlier ones' in; backward, the earlier
     * segments' gradient rows out and the later ranks' parts of this segment's in */
    const size_t fwd_send = fl((size_t)B * n * w), fwd_recv = fl((size_t)B * t0 * w);
    const size_t bwd_send = (size_t)B * t0 * wf, bwd_recv = (size_t)(R - 1) * B * n * wf;
    PLACE(s, send, fwd_send > bwd_send ? fwd_send : bwd_send);
    PLACE(s, recv, fwd_recv > bwd_recv ? fwd_recv : bwd_recv);
    s.total = off;
    return s;
}
#undef PLACE

size_t lm_mla_cp_lp_acts_floats(const lm_mla_config *c, int B, int t0, int n) {
    if (lm_mla_check(c) || B < 1 || t0 < 0 || n < 1) return 0;
    return lp_cp_acts_of(c, B, t0, n).total;
}

size_t lm_mla_cp_lp_scratch_floats(const lm_mla_config *c, int comm_size, int B, int t0, int n) {
    if (lm_mla_check(c) || comm_size < 1 || B < 1 || t0 < 0 || n < 1) return 0;
    return lp_cp_scratch_of(c, comm_size, B, t0, n).total;
}

static lm_mla_seg lp_seg_of(const lm_mla_config *c, int B, int t0, int n, float *acts, float *scratch) {
    const lp_cp_acts A = lp_cp_acts_of(c, B, t0, n);
    const lp_cp_scratch S = lp_cp_scratch_of(c, 1, B, t0, n); /* the offsets before the exchange buffers */
    lm_mla_seg g;
    memset(&g, 0, sizeof g);
    g.t0 = t0;
    g.T_all = t0 + n;
    g.dk_tmp = scratch + S.dkt;
    g.dv_tmp = scratch + S.dvt;
    if (is_mla(c)) {
        g.c_store = acts + A.sa;
        g.kr_store = c->rope_dims ? acts + A.sb : NULL;
        g.dc_acc = scratch + S.acc_a;
        g.dkr_acc = c->rope_dims ? scratch + S.acc_b : NULL;
        g.k_work = scratch + S.kw;
        g.v_work = scratch + S.vw;
    } else {
        g.k_store = acts + A.sa;
        g.v_store = acts + A.sb;
        g.dk_acc = scratch + S.acc_a;
        g.dv_acc = scratch + S.acc_b;
    }
    return g;
}

static lm_status lp_cp_check(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p, const lm_mla_params *pl,
                             const void *x, int B, int t0, int n, const char *what) {
    (void)comm;
    TRY(lm_mla_check(c));
    const int missing = is_mla(c) ? !p || !p->W_dq || !p->q_norm || !p->W_uq || !p->W_dkv || !p->kv_norm || !p->W_uk ||
                                        !p->W_uv || (c->rope_dims && !p->W_kr)
                                  : !p || !p->W_q || !p->W_k || !p->W_v;
    if (missing || !p->W_g || !p->W_o || !pl)
        return lm_error(LM_ERR_ARG, "%s: a parameter tensor is NULL (use lm_mla_params_map)", what);
    if (!x) return lm_error(LM_ERR_ARG, "%s: x is NULL", what);
    if (B < 1 || t0 < 0 || n < 1) return lm_error(LM_ERR_ARG, "%s: B=%d, t0=%d, n=%d (need B, n >= 1, t0 >= 0)", what, B, t0, n);
    return LM_OK;
}

static lm_status lp_forward_body(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p,
                                 const lm_mla_params *pl, const void *x, int B, int t0, int n, float *y, float *acts,
                                 float *scratch, const int32_t *seg) {
    lm_backend *be = backend_of_cfg(c);
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const lp_cp_acts A = lp_cp_acts_of(c, B, t0, n);
    const lp_cp_scratch S = lp_cp_scratch_of(c, R, B, t0, n);
    lm_mla_seg g = lp_seg_of(c, B, t0, n, acts, scratch);
    size_t e[2], by[2];
    store_rows(c, &e[0], &by[0], &e[1], &by[1]);
    if (R > 1) {
        /* this segment's rows of the stores, then every earlier segment's from its owner */
        if (me < R - 1) TRY(lm_mla_seg_store_rows(c, p, pl, x, B, n, &g, acts + A.acts));
        size_t *tab = malloc(4 * (size_t)R * sizeof(size_t));
        if (!tab) return lm_error(LM_ERR_MEMORY, "mla context parallel forward: out of memory");
        size_t *sb = tab, *so = tab + R, *rb = tab + 2 * R, *ro = tab + 3 * R;
        lm_status st = LM_OK;
        char *store[2] = {(char *)(acts + A.sa), (char *)(acts + A.sb)};
        char *send = (char *)(scratch + S.send), *recv = (char *)(scratch + S.recv);
        for (int k = 0; k < 2 && !st; k++) {
            const size_t row = e[k] * by[k], P = (size_t)t0 + n;
            if (!row) continue;
            for (int b = 0; b < B && !st && me < R - 1; b++)
                st = be->copy(be, send + (size_t)b * n * row, store[k] + ((size_t)b * P + t0) * row, (size_t)n * row);
            for (int q = 0; q < R; q++) {
                sb[q] = q > me ? (size_t)B * n * row : 0, so[q] = 0;
                rb[q] = q < me ? (size_t)B * seg[3 * q + 2] * row : 0, ro[q] = (size_t)B * seg[3 * q + 1] * row;
            }
            if (!st) st = lm_comm_all_to_allv(comm, send, sb, so, recv, rb, ro);
            for (int q = 0; q < me && !st; q++)
                for (int b = 0; b < B && !st; b++) {
                    const size_t tq = (size_t)seg[3 * q + 1], nq = (size_t)seg[3 * q + 2];
                    st = be->copy(be, store[k] + ((size_t)b * P + tq) * row, recv + ro[q] + (size_t)b * nq * row,
                                  nq * row);
                }
        }
        free(tab);
        TRY(st);
    }
    return lm_mla_forward_seg(c, p, pl, x, B, n, &g, y, acts + A.acts);
}

lm_status lm_mla_cp_forward_lp(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p,
                               const lm_mla_params *p_lp, const void *x_lp, int B, int t0, int n, float *y,
                               float *acts, float *scratch) {
    const char *what = "mla context parallel forward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = lp_cp_check(comm, c, p, p_lp, x_lp, B, t0, n, what);
    if (!local && (!y || !acts || !scratch))
        local = lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !y ? "y" : !acts ? "acts" : "scratch");
    int32_t *seg = NULL;
    lm_status st = lm_cp_segment_table(comm, B, t0, n, local, what, &seg);
    if (!st) st = lp_forward_body(comm, c, p, p_lp, x_lp, B, t0, n, y, acts, scratch, seg);
    free(seg);
    return st;
}

static lm_status lp_backward_body(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p,
                                  const lm_mla_params *pl, const void *x, const float *acts, const float *dy, int B,
                                  int t0, int n, float *dx, const lm_mla_params *g, float *scratch,
                                  const int32_t *seg) {
    lm_backend *be = backend_of_cfg(c);
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const lp_cp_acts A = lp_cp_acts_of(c, B, t0, n);
    const lp_cp_scratch S = lp_cp_scratch_of(c, R, B, t0, n);
    lm_mla_seg sg = lp_seg_of(c, B, t0, n, (float *)acts, scratch);
    size_t e[2], by[2];
    store_rows(c, &e[0], &by[0], &e[1], &by[1]);
    const size_t P = (size_t)t0 + n;
    float *acc[2] = {scratch + S.acc_a, scratch + S.acc_b};
    for (int k = 0; k < 2; k++) TRY(be->zero(be, acc[k], (size_t)B * P * e[k] * sizeof(float)));
    TRY(lm_mla_backward_seg(c, p, pl, x, acts + A.acts, dy, B, n, &sg, dx, g, scratch + S.scr));
    if (R == 1) return LM_OK;
    /* the gradients of the earlier segments' rows to their owners; the later ranks' parts of this one's */
    size_t *tab = malloc(4 * (size_t)R * sizeof(size_t));
    if (!tab) return lm_error(LM_ERR_MEMORY, "mla context parallel backward: out of memory");
    size_t *sb = tab, *so = tab + R, *rb = tab + 2 * R, *ro = tab + 3 * R;
    lm_status st = LM_OK;
    float *send = scratch + S.send, *recv = scratch + S.recv;
    for (int k = 0; k < 2 && !st; k++) {
        const size_t w = e[k];
        if (!w) continue;
        for (int q = 0; q < R; q++) {
            const size_t tq = (size_t)seg[3 * q + 1], nq = (size_t)seg[3 * q + 2];
            sb[q] = q < me ? (size_t)B * nq * w * sizeof(float) : 0, so[q] = (size_t)B * tq * w * sizeof(float);
            rb[q] = q > me ? (size_t)B * n * w * sizeof(float) : 0;
            ro[q] = q > me ? (size_t)(q - me - 1) * B * n * w * sizeof(float) : 0;
            for (int b = 0; b < B && !st && q < me; b++)
                st = be->copy(be, send + (size_t)B * tq * w + (size_t)b * nq * w, acc[k] + ((size_t)b * P + tq) * w,
                              nq * w * sizeof(float));
        }
        if (!st) st = lm_comm_all_to_allv(comm, send, sb, so, recv, rb, ro);
        /* this segment's rows: only the later ranks' parts, added in rank order */
        for (int b = 0; b < B && !st && me < R - 1; b++) {
            float *own = acc[k] + ((size_t)b * P + t0) * w;
            st = be->zero(be, own, (size_t)n * w * sizeof(float));
            for (int q = me + 1; q < R && !st; q++)
                st = op->accumulate(be, own, recv + (size_t)(q - me - 1) * B * n * w + (size_t)b * n * w,
                                    (size_t)n * w, 0);
        }
    }
    free(tab);
    TRY(st);
    if (me == R - 1) return LM_OK;
    return lm_mla_seg_stores_backward(c, p, pl, x, acts + A.acts, B, n, &sg, dx, g, scratch + S.scr);
}

lm_status lm_mla_cp_backward_lp(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p,
                                const lm_mla_params *p_lp, const void *x_lp, const float *acts, const float *dy, int B,
                                int t0, int n, float *dx, const lm_mla_params *g, float *scratch) {
    const char *what = "mla context parallel backward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = lp_cp_check(comm, c, p, p_lp, x_lp, B, t0, n, what);
    if (!local && (!acts || !dy || !dx || !scratch))
        local = lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !acts ? "acts" : !dy ? "dy" : !dx ? "dx" : "scratch");
    int32_t *seg = NULL;
    lm_status st = lm_cp_segment_table(comm, B, t0, n, local, what, &seg);
    if (!st) st = lp_backward_body(comm, c, p, p_lp, x_lp, acts, dy, B, t0, n, dx, g, scratch, seg);
    free(seg);
    return st;
}

lm_status lm_mla_cp_head_max_lp(lm_comm *comm, const lm_mla_config *c, float *acts, int B, int t0, int n,
                                float *head_max) {
    const char *what = "mla context parallel head max";
    if (!comm || !c || !acts || !head_max) return lm_error(LM_ERR_ARG, "%s: an argument is NULL", what);
    const int R = lm_comm_size(comm), H = c->n_heads;
    lm_comm *host = lm_comm_host(comm);
    float *all = malloc((size_t)R * H * sizeof(float));
    if (!all) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    lm_status st = lm_mla_seg_head_max(c, acts + lp_cp_acts_of(c, B, t0, n).acts, B, n, head_max);
    if (!st) st = lm_comm_all_gather(host, head_max, all, (size_t)H * sizeof(float));
    for (int h = 0; h < H && !st; h++) {
        float m = all[h];
        for (int r = 1; r < R; r++) m = all[(size_t)r * H + h] > m ? all[(size_t)r * H + h] : m;
        head_max[h] = m;
    }
    free(all);
    return st;
}
