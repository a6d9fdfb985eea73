/* The KDA token mixer under context parallelism
 * (include/longmoe/kda_layer_context_parallel.h, docs/scaleout.md): the
 * layer of src/model/kda_layer.c with the short convolution's halo exchanged
 * and the operator's state scanned across ranks. Written with the CPU
 * backend's ops in the order of lm_kda_layer_forward / _backward. */
#include "longmoe/kda_layer_context_parallel.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cp_internal.h"
#include "longmoe/backend.h"
#include "longmoe/kda_state_map.h"

/* Sizes: N = B n own rows, E = B (W-1+n) rows with the halo in front of each
 * sequence, blk = one rank's tail block [B, W-1, 3 HK] (q, k, v projections). */
typedef struct {
    size_t proj, ext_in, ext_pre, ext_post, ext_rn, q, k, v, z, beta, o, o_rstd, gate, gated, S_in, tail, tails;
    size_t total;
} cp_layer_acts;

typedef struct {
    size_t d_gated, d_o, dq, dk, dv, dz, tmp, dbeta, dgate, dout_ext, din_ext, din, send, recv, total;
} cp_layer_scratch;

#define PLACE(s, f, n) ((s).f = off, off += ((size_t)(n) + 15) & ~(size_t)15) /* 64-byte starts */

static size_t hk_of(const lm_kda_layer_config *c) { return (size_t)c->heads * c->head_dim; }
static size_t blk_of(const lm_kda_layer_config *c, int B) { return (size_t)B * (c->conv_width - 1) * 3 * hk_of(c); }

static cp_layer_acts acts_of(const lm_kda_layer_config *c, int R, int B, int n) {
    const size_t N = (size_t)B * n, E = (size_t)B * (c->conv_width - 1 + n), H = c->heads, HK = hk_of(c);
    const size_t K = c->head_dim;
    cp_layer_acts a;
    size_t off = 0;
    PLACE(a, proj, N * HK);
    PLACE(a, ext_in, 3 * E * HK);   /* q, k, v projections, halo rows first */
    PLACE(a, ext_pre, 3 * E * HK);  /* conv outputs */
    PLACE(a, ext_post, 3 * E * HK); /* after SiLU (and the L2 norm for q, k) */
    PLACE(a, ext_rn, 2 * E * H);
    PLACE(a, q, N * HK);
    PLACE(a, k, N * HK);
    PLACE(a, v, N * HK);
    PLACE(a, z, N * HK);
    PLACE(a, beta, N * H);
    PLACE(a, o, N * HK);
    PLACE(a, o_rstd, N * H);
    PLACE(a, gate, N * HK);
    PLACE(a, gated, N * HK);
    PLACE(a, S_in, (size_t)B * H * K * K);
    PLACE(a, tail, blk_of(c, B));
    PLACE(a, tails, (size_t)R * blk_of(c, B));
    a.total = off;
    return a;
}

static cp_layer_scratch scratch_of(const lm_kda_layer_config *c, int R, int B, int n) {
    const size_t N = (size_t)B * n, E = (size_t)B * (c->conv_width - 1 + n), H = c->heads, HK = hk_of(c);
    cp_layer_scratch s;
    size_t off = 0;
    PLACE(s, d_gated, N * HK);
    PLACE(s, d_o, N * HK);
    PLACE(s, dq, N * HK);
    PLACE(s, dk, N * HK);
    PLACE(s, dv, N * HK);
    PLACE(s, dz, N * HK);
    PLACE(s, tmp, E * HK);
    PLACE(s, dbeta, N * H);
    PLACE(s, dgate, N * HK);
    PLACE(s, dout_ext, E * HK);
    PLACE(s, din_ext, 3 * E * HK);
    PLACE(s, din, N * HK);
    PLACE(s, send, (size_t)R * blk_of(c, B));
    PLACE(s, recv, (size_t)R * blk_of(c, B));
    s.total = off;
    return s;
}
#undef PLACE

static int config_ok(const lm_kda_layer_config *c) {
    return c && c->d_model >= 1 && c->heads >= 1 && c->head_dim >= 1 && c->conv_width >= 1 && c->conv_width <= 64;
}

size_t lm_kda_layer_cp_act_floats(const lm_kda_layer_config *c, int R, int B, int n) {
    if (!config_ok(c) || R < 1 || B < 1 || n < 1) return 0;
    return acts_of(c, R, B, n).total;
}

size_t lm_kda_layer_cp_scratch_floats(const lm_kda_layer_config *c, int R, int B, int n) {
    if (!config_ok(c) || R < 1 || B < 1 || n < 1) return 0;
    return scratch_of(c, R, B, n).total;
}

static lm_kda_config op_config(const lm_kda_layer_config *c, int B, int n) {
    lm_kda_config k = lm_kda_config_default(B, n, c->heads, c->head_dim, c->head_dim);
    k.gate = c->gate;
    k.g_min = c->g_min;
    k.chunk = c->chunk;
    k.workspace = c->workspace;
    k.workspace_bytes = c->workspace_bytes;
    return k;
}

static lm_status check_args(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p, int B, int t0,
                            int n, const char *what) {
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    if (!config_ok(c)) return lm_error(LM_ERR_ARG, "%s: invalid layer config (conv_width 1..64, dims >= 1)", what);
    if (c->backend && (c->backend->device != LM_DEVICE_CPU || c->backend->lp_bytes != sizeof(float)))
        return lm_error(LM_ERR_ARG, "%s: runs on the CPU backend only", what);
    if (!p || !p->W_q || !p->W_o) return lm_error(LM_ERR_ARG, "%s: params are NULL (use lm_kda_layer_params_map)", what);
    if (B < 1 || t0 < 0 || n < 1) return lm_error(LM_ERR_ARG, "%s: B=%d, t0=%d, n=%d (need B, n >= 1, t0 >= 0)", what, B, t0, n);
    return LM_OK;
}

/* The rank owning global position pos (< t0 of this rank) and the row of its tail block holding it. */
static int owner_of(const int32_t *seg, int me, int64_t pos, int W1, int *row) {
    for (int p = me - 1; p >= 0; p--) {
        const int ts = seg[3 * p + 1], ns = seg[3 * p + 2];
        if (pos >= ts) {
            *row = (int)(pos - ts) - (ns - W1); /* the tail's last W-1 rows: ns - W1 .. ns - 1 */
            return p;
        }
    }
    return -1;
}

static lm_status forward_body(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                              const float *x, int B, int t0, int n, float *y, float *acts, const int32_t *seg) {
    lm_backend *be = lm_backend_cpu();
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width, W1 = W - 1;
    const int Tn = W1 + n;
    const int64_t N = (int64_t)B * n, E = (int64_t)B * Tn;
    cp_layer_acts L = acts_of(c, R, B, n);
    float *proj = acts + L.proj, *tail = acts + L.tail, *tails = acts + L.tails;
    const float *Wm[3] = {p->W_q, p->W_k, p->W_v}, *conv_w[3] = {p->conv_q, p->conv_k, p->conv_v};
    float *own[3] = {acts + L.q, acts + L.k, acts + L.v};
    /* the projections, into the own rows of the extended buffers */
    for (int j = 0; j < 3; j++) {
        float *ext = acts + L.ext_in + (size_t)j * E * HK;
        TRY(op->matmul_forward(be, proj, x, Wm[j], N, d, HK));
        for (int b = 0; b < B; b++)
            memcpy(ext + ((size_t)b * Tn + W1) * HK, proj + (size_t)b * n * HK, (size_t)n * HK * sizeof(float));
    }
    /* the halo: every rank's last W-1 projections (zero rows where it has fewer), gathered */
    if (W1 > 0) {
        for (int b = 0; b < B; b++)
            for (int h = 0; h < W1; h++)
                for (int j = 0; j < 3; j++) {
                    float *dst = tail + (((size_t)b * W1 + h) * 3 + j) * HK;
                    const int local = n - W1 + h;
                    if (local < 0) memset(dst, 0, (size_t)HK * sizeof(float));
                    else memcpy(dst, acts + L.ext_in + (size_t)j * E * HK + ((size_t)b * Tn + W1 + local) * HK,
                                (size_t)HK * sizeof(float));
                }
        TRY(lm_comm_all_gather(comm, tail, tails, blk_of(c, B) * sizeof(float)));
        for (int b = 0; b < B; b++)
            for (int h = 0; h < W1; h++) {
                const int64_t pos = (int64_t)t0 - W1 + h;
                int row = 0;
                const int s = pos >= 0 ? owner_of(seg, me, pos, W1, &row) : -1;
                for (int j = 0; j < 3; j++) {
                    float *dst = acts + L.ext_in + (size_t)j * E * HK + ((size_t)b * Tn + h) * HK;
                    if (s < 0) memset(dst, 0, (size_t)HK * sizeof(float)); /* before the sequence start */
                    else memcpy(dst, tails + (size_t)s * blk_of(c, B) + (((size_t)b * W1 + row) * 3 + j) * HK,
                                (size_t)HK * sizeof(float));
                }
            }
    }
    /* q, k = L2Norm(SiLU(ShortConv(.))), v = SiLU(ShortConv(.)) over the extended rows */
    for (int j = 0; j < 3; j++) {
        const size_t o = (size_t)j * E * HK;
        float *rn = j < 2 ? acts + L.ext_rn + (size_t)j * E * H : NULL;
        TRY(op->conv_silu_forward(be, acts + L.ext_pre + o, acts + L.ext_post + o, rn, acts + L.ext_in + o, conv_w[j],
                                  B, Tn, HK, W, K));
        for (int b = 0; b < B; b++)
            memcpy(own[j] + (size_t)b * n * HK, acts + L.ext_post + o + ((size_t)b * Tn + W1) * HK,
                   (size_t)n * HK * sizeof(float));
    }
    TRY(op->matmul_forward(be, acts + L.z, x, p->W_z, N, d, HK));
    TRY(op->matmul_forward(be, acts + L.beta, x, p->W_beta, N, d, H));
    TRY(op->sigmoid_forward(be, acts + L.beta, acts + L.beta, (size_t)N * H));
    lm_kda_config kc = op_config(c, B, n);
    lm_kda_inputs in = {own[0], own[1], own[2], acts + L.z, acts + L.beta, p->A_log, p->dt_bias, NULL};
    TRY(lm_kda_cp_forward(comm, &kc, &in, acts + L.o, acts + L.S_in, NULL));
    /* y = W_o( sigmoid(W_g x) ⊙ RMSNorm_head(o) ) */
    TRY(op->matmul_forward(be, acts + L.gate, x, p->W_g, N, d, HK));
    TRY(op->kda_output_forward(be, acts + L.gated, acts + L.gated, acts + L.o_rstd, acts + L.gate, acts + L.gate,
                               acts + L.o, p->o_norm, N, H, K, c->eps));
    TRY(op->matmul_forward(be, y, acts + L.gated, p->W_o, N, HK, d));
    return LM_OK;
}

lm_status lm_kda_layer_cp_forward(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                  const float *x, int B, int t0, int n, float *y, float *acts) {
    const char *what = "kda layer context parallel forward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = check_args(comm, c, p, B, t0, n, what);
    if (!local && (!x || !y || !acts)) local = lm_error(LM_ERR_ARG, "%s: x, y and acts are required", what);
    const size_t bytes = (size_t)lm_comm_size(comm) * 3 * sizeof(int32_t);
    int32_t *seg;
    LM_TRY_ALLOC(seg, bytes);
    lm_status st = lm_cp_gather_segments(comm, B, t0, n, local, seg, what);
    if (!st) st = forward_body(comm, c, p, x, B, t0, n, y, acts, seg);
    free(seg);
    return st;
}

static lm_status backward_body(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                               const lm_kda_layer_params *g, const float *x, const float *acts, const float *dy,
                               int B, int t0, int n, float *dx, float *scratch, const int32_t *seg, size_t *cnt) {
    lm_backend *be = lm_backend_cpu();
    const lm_ops *op = be->ops;
    const int R = lm_comm_size(comm), me = lm_comm_rank(comm);
    const int d = c->d_model, H = c->heads, K = c->head_dim, HK = H * K, W = c->conv_width, W1 = W - 1;
    const int Tn = W1 + n;
    const int64_t N = (int64_t)B * n, E = (int64_t)B * Tn;
    const size_t blk = blk_of(c, B);
    cp_layer_acts L = acts_of(c, R, B, n);
    cp_layer_scratch S = scratch_of(c, R, B, n);
    memset(scratch, 0, S.total * sizeof(float));
    float *d_gated = scratch + S.d_gated, *tmp = scratch + S.tmp, *dbeta = scratch + S.dbeta;
    float *dgate = scratch + S.dgate, *din = scratch + S.din, *dz = scratch + S.dz;
    float *dqkv[3] = {scratch + S.dq, scratch + S.dk, scratch + S.dv};
    TRY(op->matmul_backward(be, d_gated, g->W_o, dy, acts + L.gated, p->W_o, N, HK, d));
    TRY(op->kda_output_backward(be, scratch + S.d_o, dgate, NULL, g->o_norm, d_gated, acts + L.o, acts + L.o_rstd,
                                acts + L.gate, p->o_norm, N, H, K, c->eps, tmp));
    TRY(op->matmul_backward(be, dx, g->W_g, dgate, x, p->W_g, N, d, HK));
    /* the operator across the ranks */
    lm_kda_config kc = op_config(c, B, n);
    lm_kda_inputs in = {acts + L.q, acts + L.k, acts + L.v, acts + L.z, acts + L.beta, p->A_log, p->dt_bias, NULL};
    lm_kda_grads kg = {dqkv[0], dqkv[1], dqkv[2], dz, dbeta, g->A_log, g->dt_bias, NULL};
    TRY(lm_kda_cp_backward(comm, &kc, &in, acts + L.S_in, scratch + S.d_o, NULL, &kg));
    TRY(op->matmul_backward(be, dx, g->W_z, dz, x, p->W_z, N, d, HK));
    TRY(op->sigmoid_backward(be, dbeta, dbeta, acts + L.beta, (size_t)N * H));
    TRY(op->matmul_backward(be, dx, g->W_beta, dbeta, x, p->W_beta, N, d, H));
    /* the convolutions over the extended rows (the halo rows' outputs are the earlier ranks': no gradient) */
    const float *conv_w[3] = {p->conv_q, p->conv_k, p->conv_v};
    float *conv_g[3] = {g->conv_q, g->conv_k, g->conv_v};
    float *dout = scratch + S.dout_ext;
    for (int j = 0; j < 3; j++) {
        const size_t o = (size_t)j * E * HK;
        const float *rn = j < 2 ? acts + L.ext_rn + (size_t)j * E * H : NULL;
        memset(dout, 0, (size_t)E * HK * sizeof(float));
        for (int b = 0; b < B; b++)
            memcpy(dout + ((size_t)b * Tn + W1) * HK, dqkv[j] + (size_t)b * n * HK, (size_t)n * HK * sizeof(float));
        TRY(op->conv_silu_backward(be, scratch + S.din_ext + o, conv_g[j], dout, acts + L.ext_pre + o,
                                   acts + L.ext_post + o, rn, acts + L.ext_in + o, conv_w[j], B, Tn, HK, W, K, tmp));
    }
    /* the halo rows' gradients back to their owners, added there in rank order */
    if (W1 > 0) {
        float *send = scratch + S.send, *recv = scratch + S.recv;
        for (int b = 0; b < B; b++)
            for (int h = 0; h < W1; h++) {
                const int64_t pos = (int64_t)t0 - W1 + h;
                int row = 0;
                const int s = pos >= 0 ? owner_of(seg, me, pos, W1, &row) : -1;
                if (s < 0) continue;
                for (int j = 0; j < 3; j++)
                    memcpy(send + (size_t)s * blk + (((size_t)b * W1 + row) * 3 + j) * HK,
                           scratch + S.din_ext + (size_t)j * E * HK + ((size_t)b * Tn + h) * HK,
                           (size_t)HK * sizeof(float));
            }
        size_t *sb = cnt, *so = sb + R, *rb = so + R, *ro = rb + R;
        for (int s = 0; s < R; s++) {
            sb[s] = s < me ? blk * sizeof(float) : 0;
            so[s] = s * blk * sizeof(float);
            rb[s] = s > me ? blk * sizeof(float) : 0;
            ro[s] = s * blk * sizeof(float);
        }
        TRY(lm_comm_all_to_allv(comm, send, sb, so, recv, rb, ro));
        for (int s = me + 1; s < R; s++)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < W1; h++) {
                    const int local = n - W1 + h;
                    if (local < 0) continue;
                    for (int j = 0; j < 3; j++) {
                        float *dst = scratch + S.din_ext + (size_t)j * E * HK + ((size_t)b * Tn + W1 + local) * HK;
                        const float *src = recv + (size_t)s * blk + (((size_t)b * W1 + h) * 3 + j) * HK;
                        for (int e = 0; e < HK; e++) dst[e] += src[e];
                    }
                }
    }
    /* the projections */
    const float *Wm[3] = {p->W_q, p->W_k, p->W_v};
    float *Wg[3] = {g->W_q, g->W_k, g->W_v};
    for (int j = 0; j < 3; j++) {
        for (int b = 0; b < B; b++)
            memcpy(din + (size_t)b * n * HK, scratch + S.din_ext + (size_t)j * E * HK + ((size_t)b * Tn + W1) * HK,
                   (size_t)n * HK * sizeof(float));
        TRY(op->matmul_backward(be, dx, Wg[j], din, x, Wm[j], N, d, HK));
    }
    return LM_OK;
}

lm_status lm_kda_layer_cp_backward(lm_comm *comm, const lm_kda_layer_config *c, const lm_kda_layer_params *p,
                                   const lm_kda_layer_params *g, const float *x, const float *acts, const float *dy,
                                   int B, int t0, int n, float *dx, float *scratch) {
    const char *what = "kda layer context parallel backward";
    if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", what);
    lm_status local = check_args(comm, c, p, B, t0, n, what);
    if (!local && (!g || !g->A_log || !g->dt_bias || !x || !acts || !dy || !scratch))
        local = lm_error(LM_ERR_ARG, "%s: g, x, acts, dy and scratch are required", what);
    const int R = lm_comm_size(comm);
    const size_t bytes = (size_t)R * (3 * sizeof(int32_t) + 4 * sizeof(size_t)) + 8;
    void *buf;
    LM_TRY_ALLOC(buf, bytes);
    int32_t *seg = buf;
    size_t *cnt = (size_t *)(seg + 3 * R + (R & 1)); /* 8-byte aligned */
    lm_status st = lm_cp_gather_segments(comm, B, t0, n, local, seg, what);
    if (!st) st = backward_body(comm, c, p, g, x, acts, dy, B, t0, n, dx, scratch, seg, cnt);
    free(buf);
    return st;
}
