/* Expert parallelism for the CPU MoE layer: the dispatch and combine
 * all-to-alls and the owners' expert products (include/longmoe/moe_ep.h,
 * docs/scaleout.md). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/moe_ep.h"
#include "ops/moe/moe_internal.h"

struct lm_moe_ep {
    lm_comm *comm;
    int R, r, n, nl, de, f;
    int64_t *cnt_send;  /* [n] rows this rank sends to each expert (its grouped offsets) */
    int64_t *cnt_recv;  /* [R][nl] rows source p sends to each of this rank's experts */
    size_t *sb, *so;    /* [R] bytes and offsets of the grouped rows sent to each owner */
    size_t *rb, *ro;    /* [R] bytes and offsets of the rows received from each source */
    int64_t *loc_off;   /* [nl + 1] owner-grouped rows of each local expert */
    int64_t rows;       /* rows received in the last forward */
    int64_t cap;        /* row capacity of the buffers below */
    int64_t *perm;      /* [cap] owner-grouped row g came in as received row perm[g] */
    float *buf;         /* [cap, de] rows as received / as sent back */
    float *xo, *out;    /* [cap, de] expert inputs and outputs, grouped by local expert */
    float *ga, *gu, *gh;/* [cap, f] pre-activations and hidden (kept for the backward) */
    float *dgo, *dxo;   /* [cap, de] backward: output and input gradients */
    float *dh, *da, *du;/* [cap, f] backward scratch */
};

lm_status lm_moe_ep_create(lm_comm *comm, const lm_moe_config *cfg, lm_moe_ep **out) {
    *out = NULL;
    if (!comm) return lm_error(LM_ERR_ARG, "moe ep: no communicator");
    TRY(lm_moe_check(cfg));
    int R = lm_comm_size(comm);
    if (R < 1 || cfg->n_experts % R)
        return lm_error(LM_ERR_ARG,
                        "moe ep: %d routed experts cannot be split over %d ranks (expert parallelism needs "
                        "n_routed_experts divisible by the number of ranks)",
                        cfg->n_experts, R);
    lm_moe_ep *ep = calloc(1, sizeof *ep);
    if (!ep) return lm_error(LM_ERR_MEMORY, "moe ep: out of memory");
    ep->comm = comm;
    ep->R = R;
    ep->r = lm_comm_rank(comm);
    ep->n = cfg->n_experts;
    ep->nl = cfg->n_experts / R;
    ep->de = cfg->d_latent > 0 ? cfg->d_latent : cfg->d;
    ep->f = cfg->d_ff;
    ep->cnt_send = calloc((size_t)ep->n, sizeof(int64_t));
    ep->cnt_recv = calloc((size_t)ep->n, sizeof(int64_t)); /* R * nl = n */
    ep->sb = calloc((size_t)R * 4, sizeof(size_t));
    ep->loc_off = calloc((size_t)ep->nl + 1, sizeof(int64_t));
    if (!ep->cnt_send || !ep->cnt_recv || !ep->sb || !ep->loc_off) {
        lm_moe_ep_free(ep);
        return lm_error(LM_ERR_MEMORY, "moe ep: out of memory");
    }
    ep->so = ep->sb + R;
    ep->rb = ep->sb + 2 * R;
    ep->ro = ep->sb + 3 * R;
    *out = ep;
    return LM_OK;
}

static void free_rows(lm_moe_ep *ep) {
    float **b[] = {&ep->buf, &ep->xo, &ep->out, &ep->ga, &ep->gu, &ep->gh, &ep->dgo, &ep->dxo, &ep->dh, &ep->da, &ep->du};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) {
        free(*b[i]);
        *b[i] = NULL;
    }
    free(ep->perm);
    ep->perm = NULL;
    ep->cap = 0;
}

void lm_moe_ep_free(lm_moe_ep *ep) {
    if (!ep) return;
    free_rows(ep);
    free(ep->cnt_send);
    free(ep->cnt_recv);
    free(ep->sb);
    free(ep->loc_off);
    free(ep);
}

int lm_moe_ep_first_expert(const lm_moe_ep *ep) { return ep->r * ep->nl; }
int lm_moe_ep_local_experts(const lm_moe_ep *ep) { return ep->nl; }
int64_t lm_moe_ep_rows_received(const lm_moe_ep *ep) { return ep->rows; }

/* The capacity the owner's buffers grow to for `rows` received rows. */
static int64_t grown_cap(int64_t rows) { return rows + rows / 4 + 16; }

/* Bytes of the owner's buffers at capacity cap (the table of grow). */
static size_t rows_bytes(int64_t cap, int de, int f) {
    return (size_t)cap * ((size_t)de * 5 + (size_t)f * 6) * sizeof(float) + (size_t)cap * sizeof(int64_t);
}

size_t lm_moe_ep_plan_bytes(const lm_moe_config *cfg, int R, int64_t rows) {
    if (!cfg || R < 1 || rows < 0 || lm_moe_check(cfg) || cfg->n_experts % R) return 0;
    return rows_bytes(grown_cap(rows), cfg->d_latent > 0 ? cfg->d_latent : cfg->d, cfg->d_ff);
}

/* Grow the owner's buffers to `rows` rows; 0 on success. */
static int grow(lm_moe_ep *ep, int64_t rows) {
    if (rows <= ep->cap) return 0;
    int64_t cap = grown_cap(rows);
    free_rows(ep);
    size_t de = (size_t)cap * ep->de * sizeof(float), f = (size_t)cap * ep->f * sizeof(float);
    struct { float **p; size_t bytes; } t[] = {{&ep->buf, de}, {&ep->xo, de}, {&ep->out, de}, {&ep->ga, f},
                                               {&ep->gu, f},   {&ep->gh, f},  {&ep->dgo, de}, {&ep->dxo, de},
                                               {&ep->dh, f},   {&ep->da, f},  {&ep->du, f}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!(*t[i].p = malloc(t[i].bytes))) {
            free_rows(ep);
            return 1;
        }
    if (!(ep->perm = malloc((size_t)cap * sizeof(int64_t)))) {
        free_rows(ep);
        return 1;
    }
    ep->cap = cap;
    return 0;
}

lm_status lm_moe_ep_agree(lm_moe_ep *ep, lm_status mine) { return lm_moe_ep_agree_on(ep->comm, mine); }

lm_status lm_moe_ep_agree_on(lm_comm *comm, lm_status mine) {
    int32_t bad = mine != LM_OK, any = 0;
    lm_status cs = lm_comm_all_reduce_sum(comm, &bad, &any, 1, LM_DTYPE_I32);
    if (mine) return mine;
    if (cs) return cs;
    if (any) return lm_error(LM_ERR_NUMERIC, "moe ep: the routing failed on another rank");
    return LM_OK;
}

lm_status lm_moe_ep_experts_forward(lm_moe_ep *ep, lm_moe_acts *a, const lm_moe_config *c,
                                    const lm_moe_params *p) {
    int R = ep->R, nl = ep->nl, n = ep->n, de = ep->de, f = ep->f;
    if (c->n_experts != n || c->d_ff != f || (c->d_latent > 0 ? c->d_latent : c->d) != de)
        return lm_error(LM_ERR_ARG, "moe ep: the layer's config differs from the handle's");
    size_t row_bytes = (size_t)de * sizeof(float);

    /* 1. counts: rows per expert, the nl counts of owner q's experts to q */
    for (int j = 0; j < n; j++) ep->cnt_send[j] = a->offsets[j + 1] - a->offsets[j];
    size_t cb[LM_MOE_MAX_EXPERTS], co[LM_MOE_MAX_EXPERTS];
    for (int q = 0; q < R; q++) {
        cb[q] = (size_t)nl * sizeof(int64_t);
        co[q] = (size_t)q * nl * sizeof(int64_t);
    }
    TRY(lm_comm_all_to_allv(ep->comm, ep->cnt_send, cb, co, ep->cnt_recv, cb, co));

    /* 2. byte counts of the dispatch: the grouped rows of owner q's experts
     * are contiguous (experts [q nl, (q+1) nl)) */
    int64_t rows = 0;
    for (int q = 0; q < R; q++) {
        int64_t lo = a->offsets[(int64_t)q * nl], hi = a->offsets[(int64_t)(q + 1) * nl];
        ep->sb[q] = (size_t)(hi - lo) * row_bytes;
        ep->so[q] = (size_t)lo * row_bytes;
        int64_t from = 0;
        for (int jl = 0; jl < nl; jl++) from += ep->cnt_recv[(int64_t)q * nl + jl];
        ep->ro[q] = (size_t)rows * row_bytes;
        ep->rb[q] = (size_t)from * row_bytes;
        rows += from;
    }
    /* an allocation failure on one rank is agreed on before the next collective */
    int32_t failed = grow(ep, rows), any = 0;
    TRY(lm_comm_all_reduce_sum(ep->comm, &failed, &any, 1, LM_DTYPE_I32));
    if (any)
        return lm_error(LM_ERR_MEMORY, "moe ep: out of memory for the rows of the owned experts (%lld rows on rank %d)",
                        (long long)rows, ep->r);
    ep->rows = rows;

    /* 3. dispatch */
    TRY(lm_comm_all_to_allv(ep->comm, a->xg, ep->sb, ep->so, ep->buf, ep->rb, ep->ro));

    /* 4. regroup by local expert: expert jl, then source rank, then the source's order */
    int64_t g = 0;
    for (int jl = 0; jl < nl; jl++) {
        ep->loc_off[jl] = g;
        for (int q = 0; q < R; q++) {
            int64_t start = (int64_t)(ep->ro[q] / row_bytes);
            for (int jj = 0; jj < jl; jj++) start += ep->cnt_recv[(int64_t)q * nl + jj];
            int64_t cnt = ep->cnt_recv[(int64_t)q * nl + jl];
            for (int64_t i = 0; i < cnt; i++) ep->perm[g++] = start + i;
        }
    }
    ep->loc_off[nl] = g;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) memcpy(ep->xo + i * de, ep->buf + ep->perm[i] * de, row_bytes);

    /* 5. the owned experts, one dense product each */
    for (int jl = 0; jl < nl; jl++) {
        int64_t o = ep->loc_off[jl], cnt = ep->loc_off[jl + 1] - o;
        if (!cnt) continue;
        size_t wo = (size_t)jl * f * de;
        lm_moe_glu_forward(ep->out + o * de, ep->ga + o * f, ep->gu + o * f, ep->gh + o * f, ep->xo + o * de,
                           p->gate + wo, p->up + wo, p->down + wo, cnt, de, f, de, c->act);
    }

    /* 6. combine: back to received order, then the reverse all-to-all into
     * the sources' grouped rows */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) memcpy(ep->buf + ep->perm[i] * de, ep->out + i * de, row_bytes);
    TRY(lm_comm_all_to_allv(ep->comm, ep->buf, ep->rb, ep->ro, a->gout, ep->sb, ep->so));
    return LM_OK;
}

lm_status lm_moe_ep_experts_backward(lm_moe_ep *ep, lm_moe_acts *a, const lm_moe_config *c,
                                     const lm_moe_params *p, lm_moe_params *g) {
    int nl = ep->nl, de = ep->de, f = ep->f;
    int64_t rows = ep->rows;
    size_t row_bytes = (size_t)de * sizeof(float);
    /* the forward's byte counts hold: the same routing, the same rows */
    TRY(lm_comm_all_to_allv(ep->comm, a->dgout, ep->sb, ep->so, ep->buf, ep->rb, ep->ro));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) memcpy(ep->dgo + i * de, ep->buf + ep->perm[i] * de, row_bytes);
    if (rows) memset(ep->dxo, 0, (size_t)rows * row_bytes);
    for (int jl = 0; jl < nl; jl++) {
        int64_t o = ep->loc_off[jl], cnt = ep->loc_off[jl + 1] - o;
        if (!cnt) continue;
        size_t wo = (size_t)jl * f * de;
        lm_moe_glu_backward(ep->dxo + o * de, g->gate ? g->gate + wo : NULL, g->up ? g->up + wo : NULL,
                            g->down ? g->down + wo : NULL, ep->dh + o * f, ep->da + o * f, ep->du + o * f,
                            ep->dgo + o * de, ep->xo + o * de, ep->ga + o * f, ep->gu + o * f, ep->gh + o * f,
                            p->gate + wo, p->up + wo, p->down + wo, cnt, de, f, de, c->act);
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) memcpy(ep->buf + ep->perm[i] * de, ep->dxo + i * de, row_bytes);
    TRY(lm_comm_all_to_allv(ep->comm, ep->buf, ep->rb, ep->ro, a->dxg, ep->sb, ep->so));
    return LM_OK;
}
