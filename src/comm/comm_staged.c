/* The staged engine of the communication layer (include/longmoe/comm.h,
 * docs/scaleout.md "The staged engine"): buffers in a backend's memory,
 * messages over a host handle (SELF or MPI). Each data movement downloads the
 * regions it sends into host staging buffers laid out at the same offsets,
 * runs the host handle's collective on them and uploads the regions it
 * received, so bytes outside those regions are never written. It is a device
 * engine for comm.c: the sums run comm.c's owner-computes algorithm with the
 * hooks below (the rank-order additions on the host, after a download), so
 * every result has the bits of the other engines. No byte of the backend's
 * memory is touched on the host except through the backend's copies. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "comm_internal.h"
#include "longmoe/backend.h"

typedef struct {
    lm_comm *host;   /* the handle the messages go over */
    int owns_host;   /* a split part's own host handle, closed with it */
    lm_backend *be;  /* whose memory the buffers are in */
    unsigned char *hs, *hr; /* host staging: what is sent, what is received */
    size_t hs_bytes, hr_bytes;
} staged_state;

lm_comm *lm_comm_staged_host(lm_comm *c) { return ((staged_state *)c->engine_state)->host; }

/* Grow a staging buffer to at least `bytes` (contents need not survive). */
static lm_status stage_grow(unsigned char **buf, size_t *have, size_t bytes) {
    if (bytes <= *have) return LM_OK;
    unsigned char *p = malloc(bytes);
    if (!p) return lm_error(LM_ERR_MEMORY, "comm staged: out of memory for %zu bytes of host staging", bytes);
    free(*buf);
    *buf = p;
    *have = bytes;
    return LM_OK;
}

/* The end of the furthest non-empty region of a table. */
static size_t extent_of(const size_t *bytes, const size_t *offsets, int R) {
    size_t end = 0;
    for (int q = 0; q < R; q++)
        if (bytes[q] && offsets[q] + bytes[q] > end) end = offsets[q] + bytes[q];
    return end;
}

static lm_status staged_all_to_allv(lm_comm *c, const void *send, const size_t *send_bytes,
                                    const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                    const size_t *recv_offsets) {
    staged_state *s = c->engine_state;
    const int R = c->size;
    TRY(stage_grow(&s->hs, &s->hs_bytes, extent_of(send_bytes, send_offsets, R) + 1));
    TRY(stage_grow(&s->hr, &s->hr_bytes, extent_of(recv_bytes, recv_offsets, R) + 1));
    for (int q = 0; q < R; q++)
        if (send_bytes[q])
            TRY(s->be->download(s->be, s->hs + send_offsets[q], (const char *)send + send_offsets[q], send_bytes[q]));
    TRY(lm_comm_all_to_allv(s->host, s->hs, send_bytes, send_offsets, s->hr, recv_bytes, recv_offsets));
    for (int p = 0; p < R; p++)
        if (recv_bytes[p])
            TRY(s->be->upload(s->be, (char *)recv + recv_offsets[p], s->hr + recv_offsets[p], recv_bytes[p]));
    return LM_OK;
}

static lm_status staged_all_gatherv(lm_comm *c, const void *send, size_t send_bytes, void *recv,
                                    const size_t *recv_bytes, const size_t *recv_offsets) {
    staged_state *s = c->engine_state;
    const int R = c->size, me = c->rank;
    TRY(stage_grow(&s->hr, &s->hr_bytes, extent_of(recv_bytes, recv_offsets, R) + 1));
    /* this rank's part goes straight into its place of the host copy */
    if (send_bytes) TRY(s->be->download(s->be, s->hr + recv_offsets[me], send, send_bytes));
    TRY(lm_comm_all_gatherv(s->host, s->hr + recv_offsets[me], send_bytes, s->hr, recv_bytes, recv_offsets));
    const int in_place = send_bytes && (const char *)send == (const char *)recv + recv_offsets[me];
    for (int p = 0; p < R; p++)
        if (recv_bytes[p] && !(p == me && in_place))
            TRY(s->be->upload(s->be, (char *)recv + recv_offsets[p], s->hr + recv_offsets[p], recv_bytes[p]));
    return LM_OK;
}

static lm_status staged_broadcast(lm_comm *c, void *buf, size_t bytes, int root) {
    staged_state *s = c->engine_state;
    TRY(stage_grow(&s->hs, &s->hs_bytes, bytes));
    if (c->rank == root) TRY(s->be->download(s->be, s->hs, buf, bytes));
    TRY(lm_comm_broadcast(s->host, s->hs, bytes, root));
    if (c->rank != root) TRY(s->be->upload(s->be, buf, s->hs, bytes));
    return LM_OK;
}

static lm_status staged_barrier(lm_comm *c) {
    staged_state *s = c->engine_state;
    TRY(s->be->sync(s->be));
    return lm_comm_barrier(s->host);
}

static void staged_close(lm_comm *c) {
    staged_state *s = c->engine_state;
    if (!s) return;
    if (c->scratch) s->be->release(s->be, c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    if (s->owns_host) lm_comm_close(s->host);
    free(s->hs);
    free(s->hr);
    free(s);
    c->engine_state = NULL;
}

static lm_status staged_copy(lm_comm *c, void *dst, const void *src, size_t bytes) {
    staged_state *s = c->engine_state;
    return bytes && dst != src ? s->be->copy(s->be, dst, src, bytes) : LM_OK;
}

static lm_status staged_sum_rows(lm_comm *c, void *acc, const void *rows, size_t m, int R, lm_dtype dtype) {
    staged_state *s = c->engine_state;
    const size_t es = lm_dtype_size(dtype);
    TRY(stage_grow(&s->hs, &s->hs_bytes, (size_t)R * m * es));
    TRY(stage_grow(&s->hr, &s->hr_bytes, m * es));
    TRY(s->be->download(s->be, s->hs, rows, (size_t)R * m * es));
    lm_comm_sum_rows_host(s->hr, s->hs, m, R, dtype);
    return s->be->upload(s->be, acc, s->hr, m * es);
}

static lm_status staged_scratch_resize(lm_comm *c, size_t bytes) {
    staged_state *s = c->engine_state;
    void *p = NULL;
    if (c->scratch) s->be->release(s->be, c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    TRY(s->be->alloc(s->be, bytes, &p));
    c->scratch = p;
    c->scratch_bytes = bytes;
    return LM_OK;
}

static lm_status staged_exchange_counts(lm_comm *c, const int64_t *send_counts, int64_t *recv_counts) {
    return lm_comm_exchange_counts(((staged_state *)c->engine_state)->host, send_counts, recv_counts);
}

static lm_status staged_split(lm_comm *c, int color, lm_comm *out, int *in_group);

static const lm_comm_ops staged_ops = {.name = "staged",
                                       .all_to_allv = staged_all_to_allv,
                                       .all_gatherv = staged_all_gatherv,
                                       .broadcast = staged_broadcast,
                                       .barrier = staged_barrier,
                                       .split = staged_split,
                                       .close = staged_close,
                                       .copy = staged_copy,
                                       .sum_rows = staged_sum_rows,
                                       .scratch_resize = staged_scratch_resize,
                                       .exchange_counts = staged_exchange_counts};

/* Fill the zeroed handle c over `host` (owned when owns_host). */
static lm_status staged_attach(lm_comm *c, lm_comm *host, int owns_host, lm_backend *be) {
    staged_state *s = calloc(1, sizeof *s);
    if (!s) return lm_error(LM_ERR_MEMORY, "comm staged: out of memory");
    s->host = host;
    s->owns_host = owns_host;
    s->be = be;
    c->ops = &staged_ops;
    c->engine = LM_COMM_STAGED;
    c->engine_state = s;
    c->rank = lm_comm_rank(host);
    c->size = lm_comm_size(host);
    return LM_OK;
}

static lm_status staged_split(lm_comm *c, int color, lm_comm *out, int *in_group) {
    staged_state *s = c->engine_state;
    lm_comm *part = NULL;
    TRY(lm_comm_split(s->host, color, &part));
    *in_group = part != NULL;
    if (!part) return LM_OK;
    lm_status st = staged_attach(out, part, 1, s->be);
    if (st) lm_comm_close(part);
    return st;
}

lm_status lm_comm_open_staged(lm_comm *host, lm_backend *be, lm_comm **out) {
    if (!out) return lm_error(LM_ERR_ARG, "comm open_staged: out is NULL");
    *out = NULL;
    if (!host || !be) return lm_error(LM_ERR_ARG, "comm open_staged: host and backend must not be NULL");
    if (host->ops->sum_rows)
        return lm_error(LM_ERR_ARG, "comm open_staged: the host handle must move host memory (self or mpi), not "
                        "the %s engine's", host->ops->name);
    if (!be->alloc || !be->release || !be->copy || !be->upload || !be->download || !be->sync)
        return lm_error(LM_ERR_ARG, "comm open_staged: the %s backend lacks a memory function",
                        lm_device_name(be->device));
    lm_comm *c = calloc(1, sizeof *c);
    if (!c) return lm_error(LM_ERR_MEMORY, "comm open_staged: out of memory");
    lm_status st = staged_attach(c, host, 0, be);
    if (!st) {
        c->tables = calloc(6 * (size_t)c->size, sizeof(size_t));
        if (!c->tables) {
            staged_close(c);
            st = lm_error(LM_ERR_MEMORY, "comm open_staged: out of memory for %d ranks' tables", c->size);
        }
    }
    if (st) {
        free(c);
        return st;
    }
    *out = c;
    return LM_OK;
}
