/* The MLA layer under context parallelism (include/longmoe/mla_context_parallel.h,
 * docs/scaleout.md; SPEC §9): the latent of the earlier ranks is gathered, the
 * queries attend by global position, and the latent gradients go back to their
 * owners. Written with the CPU backend's ops in the order of lm_mla_forward and
 * lm_mla_backward (src/model/mla.c). */
#include "longmoe/mla_context_parallel.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cp_internal.h"
#include "longmoe/attention.h"
#include "longmoe/backend.h"
#include "model/mla_internal.h"

/* What a token sends to the later ranks, in two parts of widths wa and wb:
 * MLA [c ; RoPE(kr)] (kv_lora + rope_dims floats), GQA [RoPE(k) ; v]
 * (Hkv (Dk + Dv) floats). "own" holds the rank's tokens' parts, "all" those
 * of every position up to the segment's end (for GQA, k and v themselves). */
static int is_mla(const lm_mla_config *c) { return c->kind == LM_ATTN_MLA; }
static size_t width_a(const lm_mla_config *c) {
    return is_mla(c) ? (size_t)c->kv_lora : (size_t)c->n_kv_heads * c->head_dim_qk;
}
static size_t width_b(const lm_mla_config *c) {
    return is_mla(c) ? (size_t)c->rope_dims : (size_t)c->n_kv_heads * c->head_dim_v;
}
/* Heads of k and v as the attention core sees them. */
static int kv_heads_of(const lm_mla_config *c) { return is_mla(c) ? c->n_heads : c->n_kv_heads; }

typedef struct {
    size_t ql, qn, q_rstd, kvl, kv_rstd, own_a, own_b, pack, recv, all_a, all_b, kn, q, k, v, o, lse, rowmax, gp;
    size_t gated, total;
} cp_acts;

typedef struct {
    size_t dgated, dgp, d_o, dq, dk, dv, dkn, dkr, dc, down_a, down_b, dkvl, dqn, dql, send, recv, total;
} cp_scratch;

#define PLACE(s, f, n) ((s).f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */

static cp_acts acts_of(const lm_mla_config *c, int B, int t0, int n) {
    const size_t N = (size_t)B * n, M = (size_t)B * (t0 + n), H = c->n_heads, Dk = c->head_dim_qk;
    const size_t Dv = c->head_dim_v, r = c->rope_dims, mla = is_mla(c);
    const size_t kl = mla ? c->kv_lora : 0, ql = mla ? c->q_lora : 0, wa = width_a(c), wb = width_b(c);
    cp_acts a;
    size_t off = 0;
    PLACE(a, ql, N * ql);
    PLACE(a, qn, N * ql);
    PLACE(a, q_rstd, mla ? N : 0);
    PLACE(a, kvl, N * kl);
    PLACE(a, kv_rstd, mla ? N : 0);
    PLACE(a, own_a, N * wa);
    PLACE(a, own_b, N * wb);
    PLACE(a, pack, N * (wa + wb));           /* the own tokens' parts: what the later ranks receive */
    PLACE(a, recv, (size_t)B * t0 * (wa + wb)); /* the same of the earlier ranks, as received */
    PLACE(a, all_a, M * wa);                 /* every position up to the segment's end */
    PLACE(a, all_b, M * wb);
    PLACE(a, kn, mla && r ? M * H * (Dk - r) : 0);
    PLACE(a, q, N * H * Dk);
    PLACE(a, k, mla ? M * H * Dk : 0); /* MLA: the expanded keys and values; GQA: all_a, all_b */
    PLACE(a, v, mla ? M * H * Dv : 0);
    PLACE(a, o, N * H * Dv);
    PLACE(a, lse, N * H);
    PLACE(a, rowmax, N * H); /* each query's largest scaled logit (QK-Clip) */
    PLACE(a, gp, N * H * Dv);
    PLACE(a, gated, N * H * Dv);
    a.total = off;
    return a;
}

static cp_scratch scratch_of(const lm_mla_config *c, int R, int B, int t0, int n) {
    const size_t N = (size_t)B * n, M = (size_t)B * (t0 + n), H = c->n_heads, Dk = c->head_dim_qk;
    const size_t Dv = c->head_dim_v, r = c->rope_dims, mla = is_mla(c), Hk = kv_heads_of(c);
    const size_t kl = mla ? c->kv_lora : 0, ql = mla ? c->q_lora : 0, wa = width_a(c), wb = width_b(c);
    cp_scratch s;
    size_t off = 0;
    PLACE(s, dgated, N * H * Dv);
    PLACE(s, dgp, N * H * Dv);
    PLACE(s, d_o, N * H * Dv);
    PLACE(s, dq, N * H * Dk);
    PLACE(s, dk, M * Hk * Dk);
    PLACE(s, dv, M * Hk * Dv);
    PLACE(s, dkn, mla && r ? M * H * (Dk - r) : 0);
    PLACE(s, dkr, mla ? M * r : 0);
    PLACE(s, dc, M * kl);
    PLACE(s, down_a, N * wa); /* the own tokens' part gradients, every rank's added */
    PLACE(s, down_b, N * wb);
    PLACE(s, dkvl, N * kl);
    PLACE(s, dqn, N * ql);
    PLACE(s, dql, N * ql);
    PLACE(s, send, (size_t)B * t0 * (wa + wb));                   /* the earlier positions' gradients */
    PLACE(s, recv, (size_t)(R > 1 ? R - 1 : 0) * N * (wa + wb)); /* one block from each later rank */
    s.total = off;
    return s;
}
#undef PLACE

static int config_ok(const lm_mla_config *c) { return c && lm_mla_check(c) == LM_OK; }

size_t lm_mla_cp_acts_floats(const lm_mla_config *c, int B, int t0, int n) {
    if (!config_ok(c) || B < 1 || t0 < 0 || n < 1) return 0;
    return acts_of(c, B, t0, n).total;
}

size_t lm_mla_cp_scratch_floats(const lm_mla_config *c, int comm_size, int B, int t0, int n) {
    if (!config_ok(c) || comm_size < 1 || B < 1 || t0 < 0 || n < 1) return 0;
    return scratch_of(c, comm_size, B, t0, n).total;
}

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

static lm_status check_args(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p, int B, int t0, int n,
                            const char *what) {
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    TRY(lm_mla_check(c));
    if (c->backend && (c->backend->device != LM_DEVICE_CPU || c->backend->lp_bytes != sizeof(float)))
        return lm_error(LM_ERR_ARG, "%s: runs on the CPU backend only", what);
    const int missing = is_mla(c) ? !p || !p->W_dq || !p->q_norm || !p->W_uq || !p->W_dkv || !p->kv_norm || !p->W_uk ||
                                        !p->W_uv || (c->rope_dims && !p->W_kr)
                                  : !p || !p->W_q || !p->W_k || !p->W_v;
    if (missing || !p->W_g || !p->W_o)
        return lm_error(LM_ERR_ARG, "%s: a parameter tensor is NULL (use lm_mla_params_map)", what);
    if (B < 1 || t0 < 0 || n < 1) return lm_error(LM_ERR_ARG, "%s: B=%d, t0=%d, n=%d (need B, n >= 1, t0 >= 0)", what, B, t0, n);
    return LM_OK;
}

static lm_attention_config core_of(const lm_mla_config *c, int B, int n) {
    lm_attention_config a =
        lm_attention_config_default(B, n, c->n_heads, kv_heads_of(c), c->head_dim_qk, c->head_dim_v);
    a.scale = c->scale;
    a.workspace = c->workspace;
    a.workspace_bytes = c->workspace_bytes;
    return a;
}

static lm_status forward_body(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p, const float *x, int B,
                              int t0, int n, float *y, float *acts, const int32_t *seg, size_t *cnt) {
    lm_backend *be = lm_backend_cpu();
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int64_t N = (int64_t)B * n, Tk = (int64_t)t0 + n, M = (int64_t)B * Tk;
    const int d = c->d_model, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v, r = c->rope_dims;
    const int Dn = Dk - r, kl = c->kv_lora, ql = c->q_lora, Hkv = c->n_kv_heads;
    const size_t wa = width_a(c), wb = width_b(c), w = wa + wb;
    const float eps = c->norm_eps;
    cp_acts L = acts_of(c, B, t0, n);
    float *q = acts + L.q, *all_a = acts + L.all_a, *all_b = acts + L.all_b;
    float *own_a = acts + L.own_a, *own_b = acts + L.own_b, *pack = acts + L.pack;
    if (is_mla(c)) {
        /* the token-local part: q = W_uq RMSNorm(W_dq x), c = RMSNorm(W_dkv x), kr = RoPE(W_kr x) */
        TRY(op->matmul_forward(be, acts + L.ql, x, p->W_dq, N, d, ql));
        TRY(op->rmsnorm_forward(be, acts + L.qn, NULL, acts + L.q_rstd, acts + L.ql, p->q_norm, N, ql, eps));
        TRY(op->matmul_forward(be, q, acts + L.qn, p->W_uq, N, ql, H * Dk));
        TRY(op->matmul_forward(be, acts + L.kvl, x, p->W_dkv, N, d, kl));
        TRY(op->rmsnorm_forward(be, own_a, NULL, acts + L.kv_rstd, acts + L.kvl, p->kv_norm, N, kl, eps));
        if (r) {
            TRY(op->matmul_forward(be, own_b, x, p->W_kr, N, d, r));
            lm_mla_rope_apply(own_b, N, n, 1, r, r, c->rope_base, t0, 0);
            lm_mla_rope_apply(q, N, n, H, Dk, r, c->rope_base, t0, 0);
        }
    } else {
        /* q = W_q x, k = W_k x, v = W_v x; RoPE on q and k at the global positions */
        TRY(op->matmul_forward(be, q, x, p->W_q, N, d, H * Dk));
        TRY(op->matmul_forward(be, own_a, x, p->W_k, N, d, Hkv * Dk));
        TRY(op->matmul_forward(be, own_b, x, p->W_v, N, d, Hkv * Dv));
        lm_mla_rope_apply(q, N, n, H, Dk, r, c->rope_base, t0, 0);
        lm_mla_rope_apply(own_a, N, n, Hkv, Dk, r, c->rope_base, t0, 0);
    }
    for (int64_t i = 0; i < N; i++) {
        memcpy(pack + i * w, own_a + i * wa, wa * sizeof(float));
        memcpy(pack + i * w + wa, own_b + i * wb, wb * sizeof(float));
    }
    /* the earlier ranks' parts: rank p's block [B, n_p, w] lands at B t0_p w */
    size_t *sb = cnt, *so = sb + R, *rb = so + R, *ro = rb + R;
    for (int s = 0; s < R; s++) {
        sb[s] = s > me ? (size_t)N * w * sizeof(float) : 0;
        so[s] = 0;
        rb[s] = s < me ? (size_t)B * seg[3 * s + 2] * w * sizeof(float) : 0;
        ro[s] = (size_t)B * seg[3 * s + 1] * w * sizeof(float);
    }
    float *recv = acts + L.recv;
    TRY(lm_comm_all_to_allv(comm, pack, sb, so, recv, rb, ro));
    for (int s = 0; s <= me; s++) {
        const int ts = seg[3 * s + 1], ns = seg[3 * s + 2];
        const float *src = s == me ? pack : recv + (size_t)B * ts * w;
        for (int b = 0; b < B; b++)
            for (int i = 0; i < ns; i++) {
                const float *row = src + ((size_t)b * ns + i) * w;
                const size_t t = (size_t)b * Tk + ts + i;
                memcpy(all_a + t * wa, row, wa * sizeof(float));
                memcpy(all_b + t * wb, row + wa, wb * sizeof(float));
            }
    }
    /* MLA: k_h = [W_uk,h c ; kr], v_h = W_uv,h c over every position up to the segment's end */
    float *k = is_mla(c) ? acts + L.k : all_a, *v = is_mla(c) ? acts + L.v : all_b;
    const float *lat = all_a, *kr = all_b;
    if (!is_mla(c)) {
        /* GQA: k and v as gathered */
    } else if (r == 0) {
        TRY(op->matmul_forward(be, k, lat, p->W_uk, M, kl, H * Dk));
    } else {
        float *kn = acts + L.kn;
        TRY(op->matmul_forward(be, kn, lat, p->W_uk, M, kl, H * Dn));
        for (int64_t i = 0; i < M; i++)
            for (int h = 0; h < H; h++) {
                float *kh = k + ((size_t)i * H + h) * Dk;
                memcpy(kh, kn + ((size_t)i * H + h) * Dn, (size_t)Dn * sizeof(float));
                memcpy(kh + Dn, kr + (size_t)i * r, (size_t)r * sizeof(float));
            }
    }
    if (is_mla(c)) TRY(op->matmul_forward(be, v, lat, p->W_uv, M, kl, H * Dv));
    lm_attention_config ac = core_of(c, B, n);
    TRY(lm_attention_forward_offset(&ac, t0, q, k, v, acts + L.o, acts + L.lse, acts + L.rowmax));
    /* y = W_o (sigmoid(W_g x) * o) */
    TRY(op->matmul_forward(be, acts + L.gp, x, p->W_g, N, d, H * Dv));
    TRY(op->gate_forward(be, acts + L.gated, acts + L.gated, acts + L.gp, acts + L.o, (size_t)N * H * Dv));
    TRY(op->matmul_forward(be, y, acts + L.gated, p->W_o, N, H * Dv, d));
    return LM_OK;
}

lm_status lm_mla_cp_forward(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p, const float *x, int B,
                            int t0, int n, float *y, float *acts) {
    const char *what = "mla context parallel forward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = check_args(comm, c, p, B, t0, n, what);
    if (!local && (!x || !y || !acts)) local = lm_error(LM_ERR_ARG, "%s: x, y and acts are required", what);
    const int R = lm_comm_size(comm);
    void *buf;
    const size_t bytes = (size_t)R * (3 * sizeof(int32_t) + 4 * sizeof(size_t)) + 8;
    LM_TRY_ALLOC(buf, bytes);
    int32_t *seg = buf;
    size_t *cnt = (size_t *)(seg + 3 * R + (R & 1)); /* 8-byte aligned */
    lm_status st = lm_cp_gather_segments(comm, B, t0, n, local, seg, what);
    if (!st) st = forward_body(comm, c, p, x, B, t0, n, y, acts, seg, cnt);
    free(buf);
    return st;
}

static lm_status backward_body(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p, const float *x,
                               const float *acts, const float *dy, int B, int t0, int n, float *dx,
                               const lm_mla_params *g, float *scratch, const int32_t *seg, size_t *cnt) {
    lm_backend *be = lm_backend_cpu();
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm), mla = is_mla(c);
    const int64_t N = (int64_t)B * n, Tk = (int64_t)t0 + n, M = (int64_t)B * Tk;
    const int d = c->d_model, H = c->n_heads, Dk = c->head_dim_qk, Dv = c->head_dim_v, r = c->rope_dims;
    const int Dn = Dk - r, kl = c->kv_lora, ql = c->q_lora, Hkv = c->n_kv_heads;
    const size_t wa = width_a(c), wb = width_b(c), w = wa + wb;
    const float eps = c->norm_eps;
    cp_acts L = acts_of(c, B, t0, n);
    cp_scratch S = scratch_of(c, R, B, t0, n);
    memset(scratch, 0, S.total * sizeof(float));
    const float *o = acts + L.o, *gp = acts + L.gp, *lat = acts + L.all_a;
    const float *k = mla ? acts + L.k : acts + L.all_a, *v = mla ? acts + L.v : acts + L.all_b;
    float *dgated = scratch + S.dgated, *dgp = scratch + S.dgp, *d_o = scratch + S.d_o;
    float *dq = scratch + S.dq, *dk = scratch + S.dk, *dv = scratch + S.dv, *dc = scratch + S.dc;
    float *dkr = scratch + S.dkr, *down_a = scratch + S.down_a, *down_b = scratch + S.down_b;
    /* through y = W_o (sigmoid(gp) * o) */
    TRY(op->matmul_backward(be, dgated, g->W_o, dy, acts + L.gated, p->W_o, N, H * Dv, d));
    TRY(op->gate_backward(be, d_o, dgp, NULL, dgated, gp, o, (size_t)N * H * Dv));
    TRY(op->matmul_backward(be, dx, g->W_g, dgp, x, p->W_g, N, d, H * Dv));
    lm_attention_config ac = core_of(c, B, n);
    TRY(lm_attention_backward_offset(&ac, t0, acts + L.q, k, v, o, acts + L.lse, d_o, dq, dk, dv));
    /* the parts' gradients at every position up to the segment's end: MLA dc and dkr (and the
     * rank's part of dW_uk, dW_uv); GQA dk and dv themselves */
    const float *ga = dk, *gb = dv;
    if (mla) {
        TRY(op->matmul_backward(be, dc, g->W_uv, dv, lat, p->W_uv, M, kl, H * Dv));
        if (r == 0) {
            TRY(op->matmul_backward(be, dc, g->W_uk, dk, lat, p->W_uk, M, kl, H * Dk));
        } else {
            float *dkn = scratch + S.dkn;
            for (int64_t i = 0; i < M; i++)
                for (int h = 0; h < H; h++) {
                    const float *dkh = dk + ((size_t)i * H + h) * Dk;
                    memcpy(dkn + ((size_t)i * H + h) * Dn, dkh, (size_t)Dn * sizeof(float));
                    for (int j = 0; j < r; j++) dkr[(size_t)i * r + j] += dkh[Dn + j];
                }
            TRY(op->matmul_backward(be, dc, g->W_uk, dkn, lat, p->W_uk, M, kl, H * Dn));
        }
        ga = dc, gb = dkr;
    }
    /* back to the owners: the rows of rank s < me, packed [B, n_s, w] at B t0_s w */
    float *send = scratch + S.send, *recv = scratch + S.recv;
    for (int s = 0; s < me; s++) {
        const int ts = seg[3 * s + 1], ns = seg[3 * s + 2];
        for (int b = 0; b < B; b++)
            for (int i = 0; i < ns; i++) {
                float *row = send + ((size_t)B * ts + (size_t)b * ns + i) * w;
                const size_t t = (size_t)b * Tk + ts + i;
                memcpy(row, ga + t * wa, wa * sizeof(float));
                memcpy(row + wa, gb + t * wb, wb * sizeof(float));
            }
    }
    size_t *sb = cnt, *so = sb + R, *rb = so + R, *ro = rb + R;
    for (int s = 0; s < R; s++) {
        sb[s] = s < me ? (size_t)B * seg[3 * s + 2] * w * sizeof(float) : 0;
        so[s] = (size_t)B * seg[3 * s + 1] * w * sizeof(float);
        rb[s] = s > me ? (size_t)N * w * sizeof(float) : 0;
        ro[s] = s > me ? (size_t)(s - me - 1) * N * w * sizeof(float) : 0;
    }
    TRY(lm_comm_all_to_allv(comm, send, sb, so, recv, rb, ro));
    /* own rows: this rank's part, then each later rank's in rank order */
    for (int b = 0; b < B; b++)
        for (int i = 0; i < n; i++) {
            const size_t t = (size_t)b * Tk + t0 + i, u = (size_t)b * n + i;
            float *au = down_a + u * wa, *bu = down_b + u * wb;
            memcpy(au, ga + t * wa, wa * sizeof(float));
            memcpy(bu, gb + t * wb, wb * sizeof(float));
            for (int s = me + 1; s < R; s++) {
                const float *row = recv + ((size_t)(s - me - 1) * N + u) * w;
                for (size_t e = 0; e < wa; e++) au[e] += row[e];
                for (size_t e = 0; e < wb; e++) bu[e] += row[wa + e];
            }
        }
    if (!mla) {
        /* GQA: through RoPE and the three projections */
        lm_mla_rope_apply(dq, N, n, H, Dk, r, c->rope_base, t0, 1);
        lm_mla_rope_apply(down_a, N, n, Hkv, Dk, r, c->rope_base, t0, 1);
        TRY(op->matmul_backward(be, dx, g->W_q, dq, x, p->W_q, N, d, H * Dk));
        TRY(op->matmul_backward(be, dx, g->W_k, down_a, x, p->W_k, N, d, Hkv * Dk));
        TRY(op->matmul_backward(be, dx, g->W_v, down_b, x, p->W_v, N, d, Hkv * Dv));
        return LM_OK;
    }
    if (r) {
        lm_mla_rope_apply(down_b, N, n, 1, r, r, c->rope_base, t0, 1);
        TRY(op->matmul_backward(be, dx, g->W_kr, down_b, x, p->W_kr, N, d, r));
        lm_mla_rope_apply(dq, N, n, H, Dk, r, c->rope_base, t0, 1);
    }
    float *dkvl = scratch + S.dkvl, *dqn = scratch + S.dqn, *dql = scratch + S.dql;
    TRY(op->rmsnorm_backward(be, dkvl, g->kv_norm, down_a, acts + L.kvl, p->kv_norm, acts + L.kv_rstd, N, kl, eps));
    TRY(op->matmul_backward(be, dx, g->W_dkv, dkvl, x, p->W_dkv, N, d, kl));
    TRY(op->matmul_backward(be, dqn, g->W_uq, dq, acts + L.qn, p->W_uq, N, ql, H * Dk));
    TRY(op->rmsnorm_backward(be, dql, g->q_norm, dqn, acts + L.ql, p->q_norm, acts + L.q_rstd, N, ql, eps));
    TRY(op->matmul_backward(be, dx, g->W_dq, dql, x, p->W_dq, N, d, ql));
    return LM_OK;
}

lm_status lm_mla_cp_backward(lm_comm *comm, const lm_mla_config *c, const lm_mla_params *p, const float *x,
                             const float *acts, const float *dy, int B, int t0, int n, float *dx,
                             const lm_mla_params *g, float *scratch) {
    const char *what = "mla context parallel backward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = check_args(comm, c, p, B, t0, n, what);
    if (!local && (!x || !acts || !dy || !scratch))
        local = lm_error(LM_ERR_ARG, "%s: x, acts, dy and scratch are required", what);
    lm_mla_params none;
    memset(&none, 0, sizeof none);
    if (!g) g = &none;
    const int R = lm_comm_size(comm);
    void *buf;
    const size_t bytes = (size_t)R * (3 * sizeof(int32_t) + 4 * sizeof(size_t)) + 8;
    LM_TRY_ALLOC(buf, bytes);
    int32_t *seg = buf;
    size_t *cnt = (size_t *)(seg + 3 * R + (R & 1)); /* 8-byte aligned */
    lm_status st = lm_cp_gather_segments(comm, B, t0, n, local, seg, what);
    if (!st) st = backward_body(comm, c, p, x, acts, dy, B, t0, n, dx, g, scratch, seg, cnt);
    free(buf);
    return st;
}

lm_status lm_mla_cp_max_logits(lm_comm *comm, const lm_mla_config *c, const float *acts, int B, int t0, int n,
                               float *smax) {
    const char *what = "mla context parallel max logits";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    if (!config_ok(c)) return lm_error(LM_ERR_ARG, "%s: needs a valid MLA config", what);
    if (!acts || !smax || B < 1 || t0 < 0 || n < 1)
        return lm_error(LM_ERR_ARG, "%s: acts and smax are required, B=%d t0=%d n=%d", what, B, t0, n);
    const int R = lm_comm_size(comm), H = c->n_heads;
    const float *rm = acts + acts_of(c, B, t0, n).rowmax; /* [B,H,n] */
    float *all;
    const size_t bytes = (size_t)(R + 1) * H * sizeof(float);
    LM_TRY_ALLOC(all, bytes);
    float *mine = all + (size_t)R * H;
    for (int h = 0; h < H; h++) {
        float mx = -INFINITY;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < n; t++) {
                const float v = rm[((size_t)b * H + h) * n + t];
                mx = v > mx ? v : mx;
            }
        mine[h] = mx;
    }
    lm_status st = lm_comm_all_gather(comm, mine, all, (size_t)H * sizeof(float));
    if (!st)
        for (int h = 0; h < H; h++) {
            float mx = -INFINITY;
            for (int p = 0; p < R; p++) mx = all[(size_t)p * H + h] > mx ? all[(size_t)p * H + h] : mx;
            smax[h] = mx;
        }
    free(all);
    return st;
}

/* ================================================================ any backend
 * The segment form (include/longmoe/mla_context_parallel.h,
 * lm_mla_cp_forward_lp): the layer's own segment functions (lm_mla_forward_seg,
 * _backward_seg, _seg_store_rows, _seg_stores_backward) through the backend's
 * ops, every buffer in the backend's memory and every collective on `comm`'s
 * engine. MLA keeps the latent form of the stores (c, and the rotary key with
 * RoPE), GQA the keys and values. */

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
    const int R = lm_comm_size(comm);
    int32_t *seg = malloc(3 * (size_t)R * sizeof(int32_t));
    if (!seg) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    lm_status st = lm_cp_gather_segments(lm_comm_host(comm), B, t0, n, local, seg, what);
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
    const int R = lm_comm_size(comm);
    int32_t *seg = malloc(3 * (size_t)R * sizeof(int32_t));
    if (!seg) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    lm_status st = lm_cp_gather_segments(lm_comm_host(comm), B, t0, n, local, seg, what);
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
