/* The communication layer's engine-independent part (docs/scaleout.md): the
 * handle, argument checks, the deterministic sums built from all-to-all and
 * all-gather, and the one-rank engine "self". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "comm_internal.h"

const char *lm_comm_engine_name(lm_comm_engine engine) {
    switch (engine) {
    case LM_COMM_SELF: return "self";
    case LM_COMM_MPI: return "mpi";
    case LM_COMM_NCCL: return "nccl";
    case LM_COMM_STAGED: return "staged";
    }
    return "?";
}

int lm_comm_engine_available(lm_comm_engine engine) {
    if (engine == LM_COMM_SELF || engine == LM_COMM_STAGED) return 1;
#ifdef LONGMOE_HAVE_MPI
    if (engine == LM_COMM_MPI) return 1;
#endif
#ifdef LONGMOE_HAVE_NCCL
    if (engine == LM_COMM_NCCL) return 1;
#endif
    return 0;
}

/* Why this build lacks an engine, for lm_comm_open's message. */
static const char *missing_engine_hint(lm_comm_engine engine) {
    if (engine == LM_COMM_MPI) return " (configure with an MPI library and -DLONGMOE_MPI=ON)";
    if (engine == LM_COMM_NCCL) {
#ifdef LONGMOE_HAVE_CUDA
        return " (CMake found no NCCL library, nccl.h and libnccl.so: install it or give -DNCCL_ROOT=DIR "
               "or NCCL_HOME, then reconfigure with -DLONGMOE_NCCL=ON)";
#else
        return " (it needs the CUDA toolkit and the NCCL library, nccl.h and libnccl.so; this build has "
               "neither CUDA nor NCCL)";
#endif
    }
    return "";
}

/* ---- the self engine: one rank, every collective a copy ---- */

static lm_status self_all_to_allv(lm_comm *c, const void *send, const size_t *send_bytes,
                                  const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_offsets) {
    if (send_bytes[0])
        memmove((char *)recv + recv_offsets[0], (const char *)send + send_offsets[0], send_bytes[0]);
    return LM_OK;
}

static lm_status self_all_gatherv(lm_comm *c, const void *send, size_t send_bytes, void *recv,
                                  const size_t *recv_bytes, const size_t *recv_offsets) {
    if (send_bytes) memmove((char *)recv + recv_offsets[0], send, send_bytes);
    return LM_OK;
}

static lm_status self_broadcast(lm_comm *c, void *buf, size_t bytes, int root) { return LM_OK; }
static lm_status self_barrier(lm_comm *c) { return LM_OK; }
static void self_close(lm_comm *c) {}
static lm_status self_split(lm_comm *c, int color, lm_comm *out, int *in_group);

static const lm_comm_ops self_ops = {.name = "self",
                                     .all_to_allv = self_all_to_allv,
                                     .all_gatherv = self_all_gatherv,
                                     .broadcast = self_broadcast,
                                     .barrier = self_barrier,
                                     .split = self_split,
                                     .close = self_close};

static lm_status self_split(lm_comm *c, int color, lm_comm *out, int *in_group) {
    *in_group = color >= 0;
    out->ops = &self_ops;
    out->rank = 0;
    out->size = 1;
    return LM_OK;
}

/* ---- the handle ---- */

lm_status lm_comm_open(lm_comm_engine engine, lm_comm **out) {
    if (!out) return lm_error(LM_ERR_ARG, "comm open: out is NULL");
    *out = NULL;
    if (engine == LM_COMM_STAGED)
        return lm_error(LM_ERR_ARG, "comm open: the staged engine carries a backend's buffers over a host handle: "
                        "open it with lm_comm_open_staged(host, backend)");
    if (!lm_comm_engine_available(engine))
        return lm_error(LM_ERR_ARG, "comm open: engine '%s' is not in this build%s", lm_comm_engine_name(engine),
                        missing_engine_hint(engine));
    lm_comm *c = calloc(1, sizeof *c);
    if (!c) return lm_error(LM_ERR_MEMORY, "comm open: out of memory");
    c->engine = engine;
    if (engine == LM_COMM_SELF) {
        c->ops = &self_ops;
        c->rank = 0;
        c->size = 1;
    }
#ifdef LONGMOE_HAVE_MPI
    if (engine == LM_COMM_MPI) {
        lm_status st = lm_comm_mpi_attach(c);
        if (st) {
            free(c);
            return st;
        }
    }
#endif
#ifdef LONGMOE_HAVE_NCCL
    if (engine == LM_COMM_NCCL) {
        lm_status st = lm_comm_nccl_attach(c);
        if (st) {
            free(c);
            return st;
        }
    }
#endif
    c->tables = calloc(6 * (size_t)c->size, sizeof(size_t));
    if (!c->tables) {
        int size = c->size;
        c->ops->close(c);
        free(c);
        return lm_error(LM_ERR_MEMORY, "comm open: out of memory for %d ranks' tables", size);
    }
    *out = c;
    return LM_OK;
}

lm_status lm_comm_split(lm_comm *comm, int color, lm_comm **out) {
    if (!comm || !out) return lm_error(LM_ERR_ARG, "comm split: comm and out must not be NULL");
    *out = NULL;
    lm_comm *c = calloc(1, sizeof *c);
    if (!c) return lm_error(LM_ERR_MEMORY, "comm split: out of memory");
    c->engine = comm->engine;
    int in_group = 0;
    lm_status st = comm->ops->split ? comm->ops->split(comm, color, c, &in_group)
                                    : lm_error(LM_ERR_ARG, "comm split: the %s engine cannot split its ranks",
                                               comm->ops->name);
    if (st || !in_group) {
        free(c);
        return st;
    }
    c->tables = calloc(6 * (size_t)c->size, sizeof(size_t));
    if (!c->tables) {
        c->ops->close(c);
        free(c);
        return lm_error(LM_ERR_MEMORY, "comm split: out of memory");
    }
    *out = c;
    return LM_OK;
}

void lm_comm_close(lm_comm *comm) {
    if (!comm) return;
    comm->ops->close(comm);
    if (!comm->ops->scratch_resize) free(comm->scratch); /* a device engine's close freed its own */
    free(comm->tables);
    free(comm);
}

void lm_comm_abort(lm_comm *comm, int code) {
    if (comm && comm->engine == LM_COMM_STAGED) comm = lm_comm_staged_host(comm); /* a host engine's handle */
#ifdef LONGMOE_HAVE_MPI
    if (comm && comm->engine == LM_COMM_MPI) lm_comm_mpi_abort(comm, code);
#endif
#ifdef LONGMOE_HAVE_NCCL
    if (comm && comm->engine == LM_COMM_NCCL) lm_comm_nccl_abort(comm, code);
#endif
    exit(code);
}

lm_comm *lm_comm_host(lm_comm *comm) {
#ifdef LONGMOE_HAVE_NCCL
    if (comm && comm->engine == LM_COMM_NCCL) return lm_comm_nccl_host(comm);
#endif
    if (comm && comm->engine == LM_COMM_STAGED) return lm_comm_staged_host(comm);
    return comm;
}

lm_status lm_comm_local_rank(lm_comm *host, int *local) {
    enum { NAME = 256 };
    if (!host || !local) return lm_error(LM_ERR_ARG, "comm local_rank: host and local must not be NULL");
    const int R = lm_comm_size(host), me = lm_comm_rank(host);
    *local = 0;
    if (host->ops->sum_rows)
        return lm_error(LM_ERR_ARG, "comm local_rank: the %s engine's buffers are not host memory; give its "
                        "lm_comm_host", host->ops->name);
    if (R == 1) return LM_OK;
    char mine[NAME];
    memset(mine, 0, sizeof mine);
    if (gethostname(mine, NAME - 1)) snprintf(mine, sizeof mine, "unknown");
    char *all = malloc((size_t)R * NAME);
    if (!all) return lm_error(LM_ERR_MEMORY, "comm local_rank: out of memory for %d host names", R);
    lm_status st = lm_comm_all_gather(host, mine, all, NAME);
    int n = 0;
    for (int p = 0; p < me && !st; p++) n += !strcmp(all + (size_t)p * NAME, mine);
    free(all);
    *local = n;
    return st;
}

int lm_comm_rank(const lm_comm *comm) { return comm->rank; }
int lm_comm_size(const lm_comm *comm) { return comm->size; }
lm_comm_engine lm_comm_engine_of(const lm_comm *comm) { return comm->engine; }
void lm_comm_set_stream(lm_comm *comm, void *stream) { comm->stream = stream; }

/* ---- checks ---- */

static lm_status check_sum_dtype(const char *what, lm_dtype dtype) {
    if (dtype == LM_DTYPE_F32 || dtype == LM_DTYPE_F64 || dtype == LM_DTYPE_I32) return LM_OK;
    return lm_error(LM_ERR_ARG, "%s: dtype must be F32, F64 or I32, got %s", what,
                    (unsigned)dtype < LM_DTYPE_COUNT ? lm_dtype_name(dtype) : "invalid");
}

#define CHECK_COMM(what)                                                        \
    do {                                                                        \
        if (!comm) return lm_error(LM_ERR_ARG, "%s: comm is NULL", (what));     \
    } while (0)

#define CHECK_PTR(what, p, needed)                                                          \
    do {                                                                                    \
        if ((needed) && !(p)) return lm_error(LM_ERR_ARG, "%s: %s is NULL", (what), #p);    \
    } while (0)

/* Element range of rank r's chunk when n elements are split over R ranks. */
static size_t chunk_start(size_t n, int r, int R) { return (size_t)((uint64_t)n * (uint64_t)r / (uint64_t)R); }

static lm_status scratch_grow(lm_comm *c, size_t bytes) {
    if (bytes <= c->scratch_bytes) return LM_OK;
    if (c->ops->scratch_resize) return c->ops->scratch_resize(c, bytes);
    unsigned char *p = realloc(c->scratch, bytes);
    if (!p) return lm_error(LM_ERR_MEMORY, "comm: out of memory growing the scratch to %zu bytes", bytes);
    c->scratch = p;
    c->scratch_bytes = bytes;
    return LM_OK;
}

/* Scratch bytes of an all-reduce of n elements: R received copies of the
 * largest chunk plus the chunk's sum. */
static size_t all_reduce_scratch_bytes(size_t n, int R, size_t es) {
    return ((size_t)R + 1) * (n / (size_t)R + 1) * es;
}
/* Scratch bytes of a reduce-scatter of n elements: R received copies of n. */
static size_t reduce_scatter_scratch_bytes(size_t n, int R, size_t es) { return (size_t)R * n * es; }
/* Either of the two, whichever is larger. */
static size_t sum_scratch_bytes(size_t n, int R, size_t es) {
    size_t ar = all_reduce_scratch_bytes(n, R, es), rs = reduce_scatter_scratch_bytes(n, R, es);
    return ar > rs ? ar : rs;
}

lm_status lm_comm_reserve(lm_comm *comm, size_t count, lm_dtype dtype) {
    CHECK_COMM("comm reserve");
    TRY(check_sum_dtype("comm reserve", dtype));
    if (comm->size == 1) return LM_OK;
    return scratch_grow(comm, sum_scratch_bytes(count, comm->size, lm_dtype_size(dtype)));
}

/* memmove on the engine's memory */
static lm_status engine_copy(lm_comm *c, void *dst, const void *src, size_t bytes) {
    if (c->ops->copy) return c->ops->copy(c, dst, src, bytes);
    memmove(dst, src, bytes);
    return LM_OK;
}

lm_status lm_comm_copy(lm_comm *comm, void *dst, const void *src, size_t bytes) {
    CHECK_COMM("comm copy");
    if (!bytes || dst == src) return LM_OK;
    CHECK_PTR("comm copy", dst, bytes);
    CHECK_PTR("comm copy", src, bytes);
    const char *d = dst, *s = src;
    if (d < s + bytes && s < d + bytes) return lm_error(LM_ERR_ARG, "comm copy: the regions overlap");
    return engine_copy(comm, dst, src, bytes);
}

/* one element type's loop: each element's rank-order additions on their own,
 * so the threads' split of the elements changes no bit */
#define SUM_ROWS(T)                                                                   \
    do {                                                                              \
        T *a = acc;                                                                   \
        const T *x = rows;                                                            \
        _Pragma("omp parallel for schedule(static) if (m >= SUM_THREADED_MIN)")       \
        for (size_t i = 0; i < m; i++) {                                              \
            T v = x[i];                                                               \
            for (int p = 1; p < R; p++) v += x[(size_t)p * m + i];                    \
            a[i] = v;                                                                 \
        }                                                                             \
    } while (0)

/* below this many elements one thread sums (the team's start costs more) */
#define SUM_THREADED_MIN ((size_t)1 << 16)

/* acc[0..m) = rows[0] + rows[1] + ... + rows[R-1] (each row m elements),
 * added in rank order; int32 wraps. A device engine's kernel does the same
 * additions in the same order (src/cuda/comm/rank_order_sum.cu). */
void lm_comm_sum_rows_host(void *acc, const void *rows, size_t m, int R, lm_dtype dtype) {
    if (dtype == LM_DTYPE_F32) SUM_ROWS(float);
    else if (dtype == LM_DTYPE_F64) SUM_ROWS(double);
    else SUM_ROWS(uint32_t); /* int32 wraps: added as unsigned */
}

/* Owner-computes sum. Rank q owns elements [off[q], off[q] + len[q]) of each
 * rank's `send` (element offsets, len in elements): every rank sends that
 * range to q, q adds the R copies in rank order into `acc` (len[rank]). */
static lm_status sum_by_owner(lm_comm *c, const void *send, const size_t *len, const size_t *off, void *acc,
                              unsigned char *rows, lm_dtype dtype) {
    const int R = c->size;
    const size_t es = lm_dtype_size(dtype), m = len[c->rank];
    size_t *sb = c->tables, *so = sb + R, *rb = so + R, *ro = rb + R;
    for (int q = 0; q < R; q++) {
        sb[q] = len[q] * es;
        so[q] = off[q] * es;
        rb[q] = m * es;
        ro[q] = (size_t)q * m * es;
    }
    TRY(c->ops->all_to_allv(c, send, sb, so, rows, rb, ro));
    if (c->ops->sum_rows) return m ? c->ops->sum_rows(c, acc, rows, m, R, dtype) : LM_OK;
    lm_comm_sum_rows_host(acc, rows, m, R, dtype);
    return LM_OK;
}

lm_status lm_comm_all_reduce_sum(lm_comm *comm, const void *send, void *recv, size_t count, lm_dtype dtype) {
    const char *what = "comm all_reduce_sum";
    CHECK_COMM(what);
    TRY(check_sum_dtype(what, dtype));
    CHECK_PTR(what, send, count);
    CHECK_PTR(what, recv, count);
    if (!count) return LM_OK;
    const int R = comm->size;
    const size_t es = lm_dtype_size(dtype);
    if (R == 1) return send != recv ? engine_copy(comm, recv, send, count * es) : LM_OK;
    TRY(scratch_grow(comm, all_reduce_scratch_bytes(count, R, es)));
    /* each rank's chunk: len/off live past the 4R entries sum_by_owner rewrites */
    size_t *len = comm->tables + 4 * (size_t)R, *off = len + R;
    for (int q = 0; q < R; q++) {
        off[q] = chunk_start(count, q, R);
        len[q] = chunk_start(count, q + 1, R) - off[q];
    }
    const size_t m = len[comm->rank];
    unsigned char *rows = comm->scratch, *acc = rows + (size_t)R * m * es;
    lm_status st = sum_by_owner(comm, send, len, off, acc, rows, dtype);
    if (!st) {
        /* every owner's sum to every rank, at its place */
        size_t *rb = comm->tables, *ro = rb + R;
        for (int q = 0; q < R; q++) {
            rb[q] = len[q] * es;
            ro[q] = off[q] * es;
        }
        st = comm->ops->all_gatherv(comm, acc, m * es, recv, rb, ro);
    }
    return st;
}

lm_status lm_comm_reduce_scatter_sum(lm_comm *comm, const void *send, void *recv, size_t count,
                                     lm_dtype dtype) {
    const char *what = "comm reduce_scatter_sum";
    CHECK_COMM(what);
    TRY(check_sum_dtype(what, dtype));
    CHECK_PTR(what, send, count);
    CHECK_PTR(what, recv, count);
    if (!count) return LM_OK;
    const int R = comm->size;
    const size_t es = lm_dtype_size(dtype);
    const char *s = send, *r = recv;
    if (s < r + count * es && r < s + (size_t)R * count * es)
        return lm_error(LM_ERR_ARG, "%s: send and recv overlap", what);
    if (R == 1) return engine_copy(comm, recv, send, count * es);
    TRY(scratch_grow(comm, reduce_scatter_scratch_bytes(count, R, es)));
    /* each rank's chunk: len/off live past the 4R entries sum_by_owner rewrites */
    size_t *len = comm->tables + 4 * (size_t)R, *off = len + R;
    for (int q = 0; q < R; q++) {
        len[q] = count;
        off[q] = (size_t)q * count;
    }
    return sum_by_owner(comm, send, len, off, recv, comm->scratch, dtype);
}

lm_status lm_comm_reduce_scatterv_sum(lm_comm *comm, const void *send, void *recv, const size_t *counts,
                                      lm_dtype dtype) {
    const char *what = "comm reduce_scatterv_sum";
    CHECK_COMM(what);
    TRY(check_sum_dtype(what, dtype));
    CHECK_PTR(what, counts, 1);
    const int R = comm->size;
    const size_t es = lm_dtype_size(dtype);
    size_t total = 0;
    for (int q = 0; q < R; q++) total += counts[q];
    const size_t m = counts[comm->rank];
    CHECK_PTR(what, send, total);
    CHECK_PTR(what, recv, m);
    if (!total) return LM_OK;
    const char *s = send, *r = recv;
    if (m && s < r + m * es && r < s + total * es) return lm_error(LM_ERR_ARG, "%s: send and recv overlap", what);
    if (R == 1) return m ? engine_copy(comm, recv, send, m * es) : LM_OK; /* the engine's memory */
    TRY(scratch_grow(comm, (size_t)R * m * es + 1));
    /* each rank's block: len/off live past the 4R entries sum_by_owner rewrites */
    size_t *len = comm->tables + 4 * (size_t)R, *off = len + R;
    size_t at = 0;
    for (int q = 0; q < R; q++) {
        len[q] = counts[q];
        off[q] = at;
        at += counts[q];
    }
    /* a rank with no share still takes part (its sum is of nothing; recv may be NULL) */
    return sum_by_owner(comm, send, len, off, m ? recv : comm->scratch, comm->scratch, dtype);
}

lm_status lm_comm_all_gather(lm_comm *comm, const void *send, void *recv, size_t bytes) {
    const char *what = "comm all_gather";
    CHECK_COMM(what);
    CHECK_PTR(what, send, bytes);
    CHECK_PTR(what, recv, bytes);
    if (!bytes) return LM_OK;
    const int R = comm->size;
    size_t *rb = comm->tables, *ro = rb + R;
    for (int q = 0; q < R; q++) {
        rb[q] = bytes;
        ro[q] = (size_t)q * bytes;
    }
    return comm->ops->all_gatherv(comm, send, bytes, recv, rb, ro);
}

lm_status lm_comm_all_gatherv(lm_comm *comm, const void *send, size_t send_bytes, void *recv,
                              const size_t *recv_bytes, const size_t *recv_offsets) {
    const char *what = "comm all_gatherv";
    CHECK_COMM(what);
    CHECK_PTR(what, send, send_bytes);
    CHECK_PTR(what, recv_bytes, 1);
    CHECK_PTR(what, recv_offsets, 1);
    if (recv_bytes[comm->rank] != send_bytes)
        return lm_error(LM_ERR_ARG, "%s: send_bytes %zu differs from recv_bytes[%d] = %zu", what, send_bytes,
                        comm->rank, recv_bytes[comm->rank]);
    size_t total = 0;
    for (int q = 0; q < comm->size; q++) total += recv_bytes[q];
    CHECK_PTR(what, recv, total);
    return comm->ops->all_gatherv(comm, send, send_bytes, recv, recv_bytes, recv_offsets);
}

lm_status lm_comm_all_to_allv(lm_comm *comm, const void *send, const size_t *send_bytes,
                              const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                              const size_t *recv_offsets) {
    const char *what = "comm all_to_allv";
    CHECK_COMM(what);
    CHECK_PTR(what, send_bytes, 1);
    CHECK_PTR(what, send_offsets, 1);
    CHECK_PTR(what, recv_bytes, 1);
    CHECK_PTR(what, recv_offsets, 1);
    size_t ns = 0, nr = 0;
    for (int q = 0; q < comm->size; q++) {
        ns += send_bytes[q];
        nr += recv_bytes[q];
    }
    CHECK_PTR(what, send, ns);
    CHECK_PTR(what, recv, nr);
    if (comm->size == 1 && send_bytes[0] != recv_bytes[0])
        return lm_error(LM_ERR_ARG, "%s: send_bytes[0] = %zu but recv_bytes[0] = %zu on one rank", what,
                        send_bytes[0], recv_bytes[0]);
    return comm->ops->all_to_allv(comm, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);
}

lm_status lm_comm_exchange_counts(lm_comm *comm, const int64_t *send_counts, int64_t *recv_counts) {
    const char *what = "comm exchange_counts";
    CHECK_COMM(what);
    CHECK_PTR(what, send_counts, 1);
    CHECK_PTR(what, recv_counts, 1);
    if (send_counts == recv_counts) return lm_error(LM_ERR_ARG, "%s: send_counts and recv_counts are one array", what);
    if (comm->ops->exchange_counts) return comm->ops->exchange_counts(comm, send_counts, recv_counts);
    const int R = comm->size;
    size_t *sb = comm->tables, *so = sb + R, *rb = so + R, *ro = rb + R;
    for (int q = 0; q < R; q++) {
        sb[q] = rb[q] = sizeof(int64_t);
        so[q] = ro[q] = (size_t)q * sizeof(int64_t);
    }
    return comm->ops->all_to_allv(comm, send_counts, sb, so, recv_counts, rb, ro);
}

lm_status lm_comm_broadcast(lm_comm *comm, void *buf, size_t bytes, int root) {
    const char *what = "comm broadcast";
    CHECK_COMM(what);
    CHECK_PTR(what, buf, bytes);
    if (root < 0 || root >= comm->size)
        return lm_error(LM_ERR_ARG, "%s: root %d is not a rank of %d", what, root, comm->size);
    if (!bytes) return LM_OK;
    return comm->ops->broadcast(comm, buf, bytes, root);
}

lm_status lm_comm_barrier(lm_comm *comm) {
    CHECK_COMM("comm barrier");
    return comm->ops->barrier(comm);
}
