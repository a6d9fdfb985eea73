/* Expert parallelism of the MoE layer on GPU ranks (include/longmoe/moe_cuda.h,
 * docs/scaleout.md; the CPU mirror is src/comm/moe_ep.c).
 *
 * Layouts, with nl = n / R experts a rank and pad(c) = c rounded up to the
 * row tile (LM_MOE_CUDA_ROW_TILE):
 *   sender:   the layer's grouped rows (acts->xg, gout; scratch dgout, dxg),
 *             expert j at padded_offsets[j]; owner q's experts are the one
 *             range [padded[q nl], padded[(q+1) nl]), sent whole (padding
 *             rows included: at most nl (tile - 1) rows a peer);
 *   received: source s's range after source s-1's; in it local expert j's
 *             pad(cnt[s][j]) rows after expert j-1's (block (s, j) starts at
 *             recv_blk[s nl + j]), the first cnt[s][j] of them real; this
 *             rank's own blocks are empty (no rows set aside for them);
 *   local:    expert j's rows from every source, source after source
 *             (cum[j][s] rows before source s's), padded to the tile at
 *             padded_loc[j]: the layout the layer's grouped products take,
 *             with zero padding rows as the batched kind wants.
 * regroup_kernel copies received -> local (zeroing local padding rows),
 * ungroup_kernel local -> received (zeroing received padding rows). Both are
 * copies: the owner's expert products see exactly the rows the sender had.
 * A rank's rows for its own experts do not travel: the exchanges skip them,
 * regroup_kernel reads them in place from the sender's layout (self_blk[j]:
 * local expert j's block within this rank's own range there) and
 * ungroup_self_kernel writes their results straight back into it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cuda/cuda_check.h"
#include "cuda/moe/moe_internal.cuh"
#include "longmoe/moe_cuda.h"

#define TILE LM_MOE_CUDA_ROW_TILE
#define ALIGN_BYTES 256

/* The buffers an exchange needs only during one call (forward or backward):
 * a model's handles may share one set (lm_cuda_moe_ep_share), since its MoE
 * layers run one after the other on one stream. */
typedef struct {
    int refs;                 /* handles using it */
    int de, f;
    int64_t rcap, lcap;       /* row capacities: received layout, local layout */
    void *block;              /* device: everything below */
    size_t bytes;
    bf16 *buf, *buf2;         /* [rcap, de] rows as received, rows to send back */
    bf16 *dgout, *dh, *da, *du, *dxg; /* [lcap, .] the owner's backward */
} ep_transient;

struct lm_cuda_moe_ep {
    const lm_cuda_context *ctx;
    lm_comm *comm, *host;
    int R, r, n, nl, de, f;
    int64_t *cnt_send;        /* [n] real rows this rank sends to each expert */
    int64_t *cnt_recv;        /* [R][nl] real rows source s sends to each local expert */
    size_t *sb, *so, *rb, *ro;/* [R] the dispatch's bytes and offsets (the return swaps them) */
    int64_t rows;             /* real rows received in the last forward */
    int64_t recv_rows;        /* received-layout rows (padding included) */
    int64_t lcap;             /* row capacity of the local layout's activations */
    void *block;              /* device: the activations below (kept from a forward to its backward) */
    size_t block_bytes;
    lm_cuda_moe_acts loc;     /* the local view: offsets, padded offsets, xg, ga, gu, gh, gout, blas_ptrs */
    ep_transient *tr;         /* this handle's, or shared */
    int32_t *tables;          /* device: padded_loc [nl+1], offsets_loc [nl+1], cum [nl][R+1], recv_blk [R nl + 1],
                                 self_blk [nl + 1] */
    int64_t self_first;       /* this rank's own range in the sender's layout: its first row */
    int32_t *htables;         /* pinned host copy */
    size_t table_count;
};

static int64_t pad_rows(int64_t c) { return (c + TILE - 1) / TILE * TILE; }
static size_t align_up(size_t b) { return (b + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES; }

/* ---- kernels: one warp a row, 8 bf16 a lane when the width allows ---- */

__device__ __forceinline__ void copy_row(bf16 *dst, const bf16 *src, int width, int lane) {
    if ((width & 7) == 0 && ((uintptr_t)dst & 15) == 0 && ((uintptr_t)src & 15) == 0) {
        uint4 *d = (uint4 *)dst;
        const uint4 *s = (const uint4 *)src;
        for (int e = lane; e < width / 8; e += 32) d[e] = src ? s[e] : make_uint4(0, 0, 0, 0);
        return;
    }
    for (int e = lane; e < width; e += 32) dst[e] = src ? src[e] : __float2bfloat16_rn(0.0f);
}

/* local row r <- its received row (or zero on padding); this rank's own rows
 * from self_src (its own range of the sender's layout) */
__global__ void regroup_kernel(bf16 *dst, const bf16 *src, const bf16 *self_src, const int32_t *padded_loc,
                               const int32_t *cum, const int32_t *recv_blk, const int32_t *self_blk, int me, int nl,
                               int R, int64_t rows, int width) {
    const int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const int j = group_of_row(padded_loc, nl, r);
    const int64_t idx = r - padded_loc[j];
    const int32_t *cj = cum + (size_t)j * (R + 1);
    const bf16 *from = NULL;
    if (idx < cj[R]) {
        int s = 0;
        while (s + 1 < R && cj[s + 1] <= idx) s++;
        from = s == me ? self_src + ((int64_t)self_blk[j] + (idx - cj[s])) * width
                       : src + ((int64_t)recv_blk[s * nl + j] + (idx - cj[s])) * width;
    }
    copy_row(dst + r * width, from, width, lane);
}

/* received-layout row q <- its local row (or zero on padding); the layout
 * has no rows of this rank's own (ungroup_self_kernel writes those) */
__global__ void ungroup_kernel(bf16 *dst, const bf16 *src, const int32_t *padded_loc, const int32_t *cum,
                               const int32_t *recv_blk, int me, int nl, int R, int64_t rows, int width) {
    const int64_t q = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (q >= rows) return;
    const int g = group_of_row(recv_blk, R * nl, q);
    const int s = g / nl, j = g % nl;
    if (s == me) return;
    const int64_t idx = q - recv_blk[g];
    const int32_t *cj = cum + (size_t)j * (R + 1);
    const bf16 *from = idx < cj[s + 1] - cj[s] ? src + ((int64_t)padded_loc[j] + cj[s] + idx) * width : NULL;
    copy_row(dst + q * width, from, width, lane);
}

/* row q of this rank's own range of the sender's layout <- its local row (or
 * zero on padding) */
__global__ void ungroup_self_kernel(bf16 *dst, const bf16 *src, const int32_t *padded_loc, const int32_t *cum,
                                    const int32_t *self_blk, int me, int nl, int R, int64_t rows, int width) {
    const int64_t q = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (q >= rows) return;
    const int j = group_of_row(self_blk, nl, q);
    const int64_t idx = q - self_blk[j];
    const int32_t *cj = cum + (size_t)j * (R + 1);
    const bf16 *from = idx < cj[me + 1] - cj[me] ? src + ((int64_t)padded_loc[j] + cj[me] + idx) * width : NULL;
    copy_row(dst + q * width, from, width, lane);
}

/* ---- the handle ---- */

static int32_t *t_padded(lm_cuda_moe_ep *ep, int32_t *t) { (void)ep; return t; }
static int32_t *t_offsets(lm_cuda_moe_ep *ep, int32_t *t) { return t + ep->nl + 1; }
static int32_t *t_cum(lm_cuda_moe_ep *ep, int32_t *t) { return t + 2 * (ep->nl + 1); }
static int32_t *t_recv(lm_cuda_moe_ep *ep, int32_t *t) { return t + 2 * (ep->nl + 1) + (size_t)ep->nl * (ep->R + 1); }
static int32_t *t_self(lm_cuda_moe_ep *ep, int32_t *t) { return t_recv(ep, t) + (size_t)ep->R * ep->nl + 1; }

/* The capacity a need of `rows` grows to (a quarter more, whole tiles, at
 * least one tile), from the current one. */
static int64_t grown_cap(int64_t rows, int64_t cap) {
    if (rows > cap) cap = pad_rows(rows + rows / 4);
    return cap < TILE ? TILE : cap;
}

/* A block's buffers, one after the other, each aligned: their total bytes,
 * and (base not NULL) each pointer set into base. */
typedef struct {
    void **p;
    size_t bytes;
} slot;

static size_t carve(const slot *t, size_t count, char *base) {
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        if (base) *t[i].p = base + total;
        total += align_up(t[i].bytes);
    }
    return total;
}

/* The persistent activations of lcap local rows in one block: their bytes,
 * and (base not NULL) ep's pointers into it. One table for the layout and the plan. */
static size_t kept_layout(lm_cuda_moe_ep *ep, int nl, int de_, int f_, int64_t lcap, char *base) {
    lm_cuda_moe_acts dummy;
    lm_cuda_moe_acts *a = base ? &ep->loc : &dummy;
    const size_t de = (size_t)de_ * 2, f = (size_t)f_ * 2;
    const size_t ptrs = 3 * (size_t)lm_moe_blas_ptr_capacity(nl, lcap) * sizeof(void *);
    const slot t[] = {
        {(void **)&a->xg, lcap * de}, {(void **)&a->gout, lcap * de}, {(void **)&a->ga, lcap * f},
        {(void **)&a->gu, lcap * f},  {(void **)&a->gh, lcap * f},    {(void **)&a->blas_ptrs, ptrs},
    };
    return carve(t, sizeof t / sizeof t[0], base);
}

/* The transient buffers of capacities rcap, lcap likewise. */
static size_t transient_layout(ep_transient *tr, int de_, int f_, int64_t rcap, int64_t lcap, char *base) {
    ep_transient dummy;
    ep_transient *e = base ? tr : &dummy;
    const size_t de = (size_t)de_ * 2, f = (size_t)f_ * 2;
    const slot t[] = {
        {(void **)&e->buf, rcap * de}, {(void **)&e->buf2, rcap * de}, {(void **)&e->dgout, lcap * de},
        {(void **)&e->dxg, lcap * de}, {(void **)&e->dh, lcap * f},    {(void **)&e->da, lcap * f},
        {(void **)&e->du, lcap * f},
    };
    return carve(t, sizeof t / sizeof t[0], base);
}

static lm_status device_block(size_t bytes, int64_t rows, void **out) {
    if (cudaMalloc(out, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        *out = NULL;
        return lm_error(LM_ERR_MEMORY, "moe cuda ep: cannot allocate %.1f MiB for %lld received rows",
                        (double)bytes / (1 << 20), (long long)rows);
    }
    return LM_OK;
}

static void transient_release(ep_transient *tr) {
    if (!tr || --tr->refs > 0) return;
    if (tr->block) cudaFree(tr->block);
    free(tr);
}

/* Buffers for rrows received and lrows local rows (padding included); each
 * part grows with a margin, never shrinks (waiting for the stream first: a
 * shared part may be in use by another handle's enqueued work). */
static lm_status ensure_rows(lm_cuda_moe_ep *ep, int64_t rrows, int64_t lrows) {
    if (lrows > INT32_MAX || rrows > INT32_MAX)
        return lm_error(LM_ERR_ARG, "moe cuda ep: %lld rows received, more than an int32 row index holds",
                        (long long)(lrows > rrows ? lrows : rrows));
    cudaStream_t st = (cudaStream_t)ep->ctx->stream;
    if (lrows > ep->lcap || !ep->block) {
        const int64_t lcap = grown_cap(lrows, ep->lcap);
        const size_t total = kept_layout(ep, ep->nl, ep->de, ep->f, lcap, NULL);
        LM_CUDA_TRY(cudaStreamSynchronize(st));
        if (ep->block) cudaFree(ep->block);
        ep->block = NULL;
        ep->block_bytes = 0;
        ep->lcap = 0;
        TRY(device_block(total, lrows, &ep->block));
        kept_layout(ep, ep->nl, ep->de, ep->f, lcap, (char *)ep->block);
        ep->block_bytes = total;
        ep->lcap = lcap;
        ep->loc.rows_max = lcap;
    }
    ep_transient *tr = ep->tr;
    if (rrows > tr->rcap || lrows > tr->lcap || !tr->block) {
        const int64_t rcap = grown_cap(rrows, tr->rcap), lcap = grown_cap(lrows, tr->lcap);
        const size_t total = transient_layout(tr, tr->de, tr->f, rcap, lcap, NULL);
        LM_CUDA_TRY(cudaStreamSynchronize(st));
        if (tr->block) cudaFree(tr->block);
        tr->block = NULL;
        tr->bytes = 0;
        tr->rcap = tr->lcap = 0;
        TRY(device_block(total, lrows, &tr->block));
        transient_layout(tr, tr->de, tr->f, rcap, lcap, (char *)tr->block);
        tr->bytes = total;
        tr->rcap = rcap;
        tr->lcap = lcap;
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_moe_ep_create(const lm_cuda_context *ctx, lm_comm *comm, const lm_moe_config *cfg,
                                           lm_cuda_moe_ep **out) {
    if (!out) return lm_error(LM_ERR_ARG, "moe cuda ep: out is NULL");
    *out = NULL;
    if (!ctx || !comm) return lm_error(LM_ERR_ARG, "moe cuda ep: ctx and comm must not be NULL");
    TRY(lm_moe_check(cfg));
    const int R = lm_comm_size(comm);
    if (R < 1 || cfg->n_experts % R)
        return lm_error(LM_ERR_ARG,
                        "moe cuda ep: %d routed experts cannot be split over %d ranks (expert parallelism needs "
                        "n_routed_experts divisible by the number of ranks)",
                        cfg->n_experts, R);
    lm_cuda_moe_ep *ep = (lm_cuda_moe_ep *)calloc(1, sizeof *ep);
    if (!ep) return lm_error(LM_ERR_MEMORY, "moe cuda ep: out of memory");
    ep->ctx = ctx;
    ep->comm = comm;
    ep->host = lm_comm_host(comm);
    ep->R = R;
    ep->r = lm_comm_rank(comm);
    ep->n = cfg->n_experts;
    ep->nl = cfg->n_experts / R;
    ep->de = cfg->d_latent > 0 ? cfg->d_latent : cfg->d;
    ep->f = cfg->d_ff;
    ep->cnt_send = (int64_t *)calloc((size_t)ep->n, sizeof(int64_t));
    ep->cnt_recv = (int64_t *)calloc((size_t)ep->n, sizeof(int64_t)); /* R nl = n */
    ep->sb = (size_t *)calloc((size_t)R * 4, sizeof(size_t));
    ep->table_count = 3 * ((size_t)ep->nl + 1) + (size_t)ep->nl * (R + 1) + (size_t)R * ep->nl + 1;
    lm_status st = LM_OK;
    ep->tr = (ep_transient *)calloc(1, sizeof *ep->tr);
    if (ep->tr) {
        ep->tr->refs = 1;
        ep->tr->de = ep->de;
        ep->tr->f = ep->f;
    }
    if (!ep->cnt_send || !ep->cnt_recv || !ep->sb || !ep->tr)
        st = lm_error(LM_ERR_MEMORY, "moe cuda ep: out of memory");
    if (!st && cudaMalloc((void **)&ep->tables, ep->table_count * 4) != cudaSuccess)
        st = lm_error(LM_ERR_MEMORY, "moe cuda ep: cannot allocate the row tables");
    if (!st && cudaMallocHost((void **)&ep->htables, ep->table_count * 4) != cudaSuccess)
        st = lm_error(LM_ERR_MEMORY, "moe cuda ep: cannot allocate the pinned row tables");
    if (st) {
        (void)cudaGetLastError();
        lm_cuda_moe_ep_free(ep);
        return st;
    }
    ep->so = ep->sb + R;
    ep->rb = ep->sb + 2 * R;
    ep->ro = ep->sb + 3 * R;
    ep->loc.padded_offsets = t_padded(ep, ep->tables);
    ep->loc.offsets = t_offsets(ep, ep->tables);
    if ((st = ensure_rows(ep, TILE, TILE))) {
        lm_cuda_moe_ep_free(ep);
        return st;
    }
    *out = ep;
    return LM_OK;
}

extern "C" void lm_cuda_moe_ep_free(lm_cuda_moe_ep *ep) {
    if (!ep) return;
    if (ep->ctx) (void)cudaStreamSynchronize((cudaStream_t)ep->ctx->stream);
    if (ep->block) cudaFree(ep->block);
    transient_release(ep->tr);
    if (ep->tables) cudaFree(ep->tables);
    if (ep->htables) cudaFreeHost(ep->htables);
    free(ep->cnt_send);
    free(ep->cnt_recv);
    free(ep->sb);
    free(ep);
}

extern "C" int lm_cuda_moe_ep_first_expert(const lm_cuda_moe_ep *ep) { return ep->r * ep->nl; }
extern "C" int lm_cuda_moe_ep_local_experts(const lm_cuda_moe_ep *ep) { return ep->nl; }
extern "C" int64_t lm_cuda_moe_ep_rows_received(const lm_cuda_moe_ep *ep) { return ep->rows; }
extern "C" size_t lm_cuda_moe_ep_bytes(const lm_cuda_moe_ep *ep, int shared_part) {
    return shared_part ? ep->tr->bytes : ep->block_bytes + ep->table_count * 4;
}

extern "C" lm_status lm_cuda_moe_ep_share(lm_cuda_moe_ep *ep, lm_cuda_moe_ep *with) {
    if (!ep || !with) return lm_error(LM_ERR_ARG, "moe cuda ep share: ep and with must not be NULL");
    if (ep->tr == with->tr) return LM_OK;
    if (ep->de != with->de || ep->f != with->f)
        return lm_error(LM_ERR_ARG, "moe cuda ep share: experts of %d -> %d cannot use the buffers of %d -> %d", ep->de,
                        ep->f, with->de, with->f);
    if (ep->ctx != with->ctx) return lm_error(LM_ERR_ARG, "moe cuda ep share: the handles are on other contexts");
    LM_CUDA_TRY(cudaStreamSynchronize((cudaStream_t)ep->ctx->stream));
    transient_release(ep->tr);
    ep->tr = with->tr;
    ep->tr->refs++;
    return LM_OK;
}

/* rows received by the owner's experts from every source together, its own
 * share 1/R of them (a balanced load; also the dropless worst case R m k, where
 * its own m k are at most that share): the received layout holds the other
 * sources' (this rank's own rows never leave the sender's layout), with the
 * padding of the worst case: each other source's block of each local expert;
 * the local layout all of them, each local expert padded once */
static void reserve_rows(int64_t rows, int nl, int R, int64_t *rrows, int64_t *lrows) {
    const int64_t slack = (int64_t)(TILE - 1) * nl;
    *rrows = rows - rows / R + slack * (R - 1);
    *lrows = rows + slack;
}

extern "C" lm_status lm_cuda_moe_ep_reserve(lm_cuda_moe_ep *ep, int64_t rows) {
    if (!ep) return lm_error(LM_ERR_ARG, "moe cuda ep reserve: ep is NULL");
    if (rows < 0) return lm_error(LM_ERR_ARG, "moe cuda ep reserve: rows = %lld", (long long)rows);
    int64_t rr, lr;
    reserve_rows(rows, ep->nl, ep->R, &rr, &lr);
    return ensure_rows(ep, rr, lr);
}

extern "C" size_t lm_cuda_moe_ep_plan_bytes(const lm_moe_config *cfg, int R, int64_t rows, int shared_part) {
    if (!cfg || R < 1 || rows < 0 || lm_moe_check(cfg) || cfg->n_experts % R) return 0;
    const int nl = cfg->n_experts / R, de = cfg->d_latent > 0 ? cfg->d_latent : cfg->d;
    int64_t rr, lr;
    reserve_rows(rows, nl, R, &rr, &lr);
    /* a handle's first buffers (a tile), then what the reserve grows them to */
    const int64_t lcap = grown_cap(lr, grown_cap(TILE, 0)), rcap = grown_cap(rr, grown_cap(TILE, 0));
    if (shared_part) return transient_layout(NULL, de, cfg->d_ff, rcap, lcap, NULL);
    const size_t tables = 3 * ((size_t)nl + 1) + (size_t)nl * (R + 1) + (size_t)R * nl + 1;
    return kept_layout(NULL, nl, de, cfg->d_ff, lcap, NULL) + tables * 4;
}

lm_status lm_moe_ep_check_config(const lm_cuda_moe_ep *ep, const lm_moe_config *c) {
    const int de = c->d_latent > 0 ? c->d_latent : c->d;
    if (c->n_experts != ep->n || de != ep->de || c->d_ff != ep->f)
        return lm_error(LM_ERR_ARG, "moe cuda ep: the handle was made for %d experts of %d -> %d, the layer has %d of "
                        "%d -> %d", ep->n, ep->de, ep->f, c->n_experts, de, c->d_ff);
    return LM_OK;
}

/* ---- the exchanges ---- */

static unsigned rows_grid(int64_t rows) { return (unsigned)((rows + 7) / 8); }

static lm_status launch_regroup(const lm_cuda_moe_ep *ep, cudaStream_t st, bf16 *dst, const bf16 *src,
                                const bf16 *grouped, int width) {
    const int64_t rows = ep->loc.host_padded[ep->nl];
    if (rows == 0) return LM_OK;
    lm_cuda_moe_ep *e = (lm_cuda_moe_ep *)ep;
    int32_t *t = ep->tables;
    regroup_kernel<<<rows_grid(rows), 256, 0, st>>>(dst, src, grouped + ep->self_first * width, t, t_cum(e, t),
                                                     t_recv(e, t), t_self(e, t), ep->r, ep->nl, ep->R, rows, width);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

static lm_status launch_ungroup(const lm_cuda_moe_ep *ep, cudaStream_t st, bf16 *dst, const bf16 *src,
                                bf16 *grouped, int width) {
    lm_cuda_moe_ep *e = (lm_cuda_moe_ep *)ep;
    int32_t *t = ep->tables;
    const int64_t rows = ep->recv_rows, own = t_self(e, ep->htables)[ep->nl];
    if (rows > 0) {
        ungroup_kernel<<<rows_grid(rows), 256, 0, st>>>(dst, src, t, t_cum(e, t), t_recv(e, t), ep->r, ep->nl, ep->R,
                                                         rows, width);
        LM_CUDA_TRY(cudaGetLastError());
    }
    if (own > 0) {
        ungroup_self_kernel<<<rows_grid(own), 256, 0, st>>>(grouped + ep->self_first * width, src, t, t_cum(e, t),
                                                             t_self(e, t), ep->r, ep->nl, ep->R, own, width);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}

/* The forward's bookkeeping: counts to the owners, the byte tables of both
 * exchanges, the local layout and its device tables, the buffers. */
static lm_status plan_exchange(lm_cuda_moe_ep *ep, const lm_cuda_moe_acts *a, int kind) {
    const int R = ep->R, nl = ep->nl, n = ep->n;
    const size_t row = (size_t)ep->de * 2;
    for (int e = 0; e < n; e++) ep->cnt_send[e] = a->host_offsets[e + 1] - a->host_offsets[e];
    for (int q = 0; q < R; q++) {
        ep->sb[q] = ep->rb[q] = (size_t)nl * sizeof(int64_t);
        ep->so[q] = ep->ro[q] = (size_t)q * nl * sizeof(int64_t);
    }
    TRY(lm_comm_all_to_allv(ep->host, ep->cnt_send, ep->sb, ep->so, ep->cnt_recv, ep->rb, ep->ro));
    /* everything the last upload read has been copied */
    LM_CUDA_TRY(cudaStreamSynchronize((cudaStream_t)ep->ctx->stream));
    int32_t *h = ep->htables, *hp = t_padded(ep, h), *ho = t_offsets(ep, h), *hc = t_cum(ep, h),
            *hr = t_recv(ep, h);
    int64_t recv = 0, real = 0;
    for (int s = 0; s < R; s++) {
        const int64_t start = recv;
        for (int j = 0; j < nl; j++) { /* this rank's own blocks are empty: its rows stay in the sender's layout */
            hr[s * nl + j] = (int32_t)recv;
            if (s != ep->r) recv += pad_rows(ep->cnt_recv[(size_t)s * nl + j]);
        }
        ep->ro[s] = (size_t)start * row;
        ep->rb[s] = (size_t)(recv - start) * row;
        const int64_t first = a->host_padded[s * nl], last = a->host_padded[(s + 1) * nl];
        ep->so[s] = (size_t)first * row;
        ep->sb[s] = (size_t)(last - first) * row;
    }
    hr[R * nl] = (int32_t)recv;
    /* this rank's own rows stay where they are: no bytes to itself either way */
    int32_t *hs = t_self(ep, h);
    ep->self_first = a->host_padded[ep->r * nl];
    for (int j = 0; j <= nl; j++) hs[j] = (int32_t)(a->host_padded[ep->r * nl + j] - ep->self_first);
    ep->sb[ep->r] = ep->rb[ep->r] = 0;
    int64_t lrows = 0;
    for (int j = 0; j < nl; j++) {
        int32_t *cj = hc + (size_t)j * (R + 1);
        int64_t c = 0;
        for (int s = 0; s < R; s++) {
            cj[s] = (int32_t)c;
            c += ep->cnt_recv[(size_t)s * nl + j];
        }
        cj[R] = (int32_t)c;
        hp[j] = (int32_t)lrows;
        ho[j] = (int32_t)real;
        lrows += pad_rows(c);
        real += c;
    }
    hp[nl] = (int32_t)lrows;
    ho[nl] = (int32_t)real;
    if (recv > INT32_MAX || lrows > INT32_MAX)
        return lm_error(LM_ERR_ARG, "moe cuda ep: %lld rows received, more than an int32 row index holds",
                        (long long)recv);
    TRY(ensure_rows(ep, recv, lrows));
    ep->rows = real;
    ep->recv_rows = recv;
    for (int j = 0; j <= nl; j++) {
        ep->loc.host_padded[j] = hp[j];
        ep->loc.host_offsets[j] = ho[j];
    }
    ep->loc.gemm_kind = kind;
    ep->loc.m = real;
    LM_CUDA_TRY(cudaMemcpyAsync(ep->tables, ep->htables, ep->table_count * 4, cudaMemcpyHostToDevice,
                                (cudaStream_t)ep->ctx->stream));
    return LM_OK;
}

/* rows in the sender's layout (a's grouped rows) -> the owners' local rows in `local` */
static lm_status dispatch(lm_cuda_moe_ep *ep, cudaStream_t st, const void *grouped, bf16 *local) {
    lm_comm_set_stream(ep->comm, st);
    TRY(lm_comm_all_to_allv(ep->comm, grouped, ep->sb, ep->so, ep->tr->buf, ep->rb, ep->ro));
    return launch_regroup(ep, st, local, ep->tr->buf, (const bf16 *)grouped, ep->de);
}

/* the owners' local rows -> the very grouped rows they came from */
static lm_status give_back(lm_cuda_moe_ep *ep, cudaStream_t st, const bf16 *local, void *grouped) {
    TRY(launch_ungroup(ep, st, ep->tr->buf2, local, (bf16 *)grouped, ep->de));
    lm_comm_set_stream(ep->comm, st);
    return lm_comm_all_to_allv(ep->comm, ep->tr->buf2, ep->rb, ep->ro, grouped, ep->sb, ep->so);
}

lm_status lm_moe_ep_experts_forward_cuda(const lm_moe_runner *r, const lm_moe_config *c, const lm_moe_params_bf16 *pb,
                                         lm_cuda_moe_acts *a, lm_cuda_moe_ep *ep) {
    TRY(plan_exchange(ep, a, r->kind));
    TRY(dispatch(ep, r->st, a->xg, (bf16 *)ep->loc.xg));
    const lm_moe_runner local = {r->ctx, r->st, r->kind, &ep->loc, ep->nl, NULL, 0, 0};
    if (ep->loc.host_padded[ep->nl] > 0) TRY(lm_moe_experts_forward(&local, c, pb, &ep->loc));
    return give_back(ep, r->st, (const bf16 *)ep->loc.gout, a->gout);
}

lm_status lm_moe_ep_experts_backward_cuda(const lm_moe_runner *r, const lm_moe_config *c,
                                          const lm_moe_params_bf16 *pb, const lm_moe_params *g,
                                          const lm_cuda_moe_acts *a, lm_cuda_moe_scratch *s, lm_cuda_moe_ep *ep) {
    (void)a;
    /* the transient buffers may have been another layer's since the forward: size them again */
    int64_t rr = ep->recv_rows, lr = ep->loc.host_padded[ep->nl];
    TRY(ensure_rows(ep, rr, lr));
    ep_transient *tr = ep->tr;
    TRY(dispatch(ep, r->st, s->dgout, tr->dgout));
    const lm_moe_runner local = {r->ctx, r->st, ep->loc.gemm_kind, &ep->loc, ep->nl, r->dw_tmp, r->dw_set, 0};
    if (lr > 0) {
        lm_moe_expert_grads e = {tr->dgout, tr->dh, tr->da, tr->du, tr->dxg};
        TRY(lm_moe_experts_backward(&local, c, pb, g, &ep->loc, &e));
    }
    return give_back(ep, r->st, tr->dxg, s->dxg);
}
