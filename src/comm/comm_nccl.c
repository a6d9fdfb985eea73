/* The NCCL engine of the communication layer (docs/scaleout.md): GPU ranks,
 * one process a GPU. Compiled to nothing unless CMake found CUDA and NCCL
 * (LONGMOE_HAVE_NCCL).
 *
 * Buffers are device pointers and every call is enqueued on the stream given
 * by lm_comm_set_stream (NULL: the default stream); only the barrier and the
 * count exchange wait for it. Data moves by grouped ncclSend/ncclRecv (the
 * all-to-all-v and all-gather-v, with size_t byte counts) and ncclBroadcast.
 * The sums are comm.c's owner-computes algorithm unchanged: the all-to-all of
 * chunks by NCCL, the rank-order addition by a kernel on the device
 * (src/cuda/comm/rank_order_sum.cu), the all-gather by NCCL; NCCL's own
 * reductions are never used, so every rank holds the bits of the serial
 * rank-order loop.
 *
 * Bootstrap: a process that mpirun started (or that runs MPI already) opens
 * an MPI handle; its rank 0 creates the ncclUniqueId and broadcasts it. The
 * GPU is the local rank (among the job's processes on this host) modulo the
 * visible devices. A lone process builds a one-rank communicator. */
#ifdef LONGMOE_HAVE_NCCL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "check.h"
#include "comm_internal.h"
#include "cuda/comm/rank_order_sum.h"

typedef struct {
    ncclComm_t nccl;
    lm_comm *boot;       /* the MPI handle the id came over (NULL: a lone process) */
    lm_comm *host;       /* lm_comm_host: boot, or a one-rank handle of its own */
    int device;          /* this process's CUDA device */
    int *barrier_word;   /* one device int the barrier sums */
    int64_t *counts_dev; /* 2 * size device int64: the count exchange */
} nccl_state;

static lm_status nccl_fail(const nccl_state *s, const char *what, ncclResult_t r) {
    /* NCCL's last error message of this process (an init failure has no comm yet) */
    const char *detail = ncclGetLastError(s ? s->nccl : NULL);
    return lm_error(LM_ERR_IO, "comm nccl: %s failed: %s%s%s", what, ncclGetErrorString(r),
                    detail && *detail ? ": " : "", detail ? detail : "");
}

static lm_status cuda_fail(const char *what, cudaError_t e) {
    return lm_error(e == cudaErrorMemoryAllocation ? LM_ERR_MEMORY : LM_ERR_IO, "comm nccl: %s: CUDA error %s (%s)",
                    what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define NCCL_TRY(s, what, call)                                 \
    do {                                                        \
        ncclResult_t r_ = (call);                               \
        if (r_ != ncclSuccess) return nccl_fail((s), (what), r_); \
    } while (0)

#define CUDA_TRY(what, call)                                \
    do {                                                    \
        cudaError_t e_ = (call);                            \
        if (e_ != cudaSuccess) return cuda_fail((what), e_); \
    } while (0)

static cudaStream_t stream_of(const lm_comm *c) { return (cudaStream_t)c->stream; }

/* ---- data movement ---- */

static lm_status nccl_copy(lm_comm *c, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return LM_OK;
    const char *d = dst, *s = src;
    if (d < s + bytes && s < d + bytes) {
        /* overlapping: cudaMemcpyAsync does not promise memmove; through the scratch */
        lm_status st = c->scratch_bytes >= bytes ? LM_OK : c->ops->scratch_resize(c, bytes);
        if (st) return st;
        CUDA_TRY("copy", cudaMemcpyAsync(c->scratch, src, bytes, cudaMemcpyDeviceToDevice, stream_of(c)));
        src = c->scratch;
    }
    CUDA_TRY("copy", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(c)));
    return LM_OK;
}

/* The peers' sends and receives of one collective, in one NCCL group (so
 * their order cannot deadlock); this rank's own part is a device copy. */
static lm_status nccl_all_to_allv(lm_comm *c, const void *send, const size_t *send_bytes,
                                  const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_offsets) {
    nccl_state *s = c->engine_state;
    const int R = c->size, me = c->rank;
    if (send_bytes[me] != recv_bytes[me])
        return lm_error(LM_ERR_ARG, "comm all_to_allv: rank %d sends itself %zu bytes but expects %zu", me,
                        send_bytes[me], recv_bytes[me]);
    if (send_bytes[me])
        CUDA_TRY("all_to_allv (own part)",
                 cudaMemcpyAsync((char *)recv + recv_offsets[me], (const char *)send + send_offsets[me],
                                 send_bytes[me], cudaMemcpyDeviceToDevice, stream_of(c)));
    if (R == 1) return LM_OK;
    NCCL_TRY(s, "ncclGroupStart", ncclGroupStart());
    ncclResult_t r = ncclSuccess;
    const char *failed = NULL;
    for (int q = 0; q < R && r == ncclSuccess; q++) {
        if (q == me) continue;
        if (recv_bytes[q]) {
            r = ncclRecv((char *)recv + recv_offsets[q], recv_bytes[q], ncclUint8, q, s->nccl, stream_of(c));
            failed = "ncclRecv";
        }
        if (r == ncclSuccess && send_bytes[q]) {
            r = ncclSend((const char *)send + send_offsets[q], send_bytes[q], ncclUint8, q, s->nccl, stream_of(c));
            failed = "ncclSend";
        }
    }
    ncclResult_t e = ncclGroupEnd(); /* always close the group */
    if (r != ncclSuccess) return nccl_fail(s, failed, r);
    if (e != ncclSuccess) return nccl_fail(s, "ncclGroupEnd (all_to_allv)", e);
    return LM_OK;
}

static lm_status nccl_all_gatherv(lm_comm *c, const void *send, size_t send_bytes, void *recv,
                                  const size_t *recv_bytes, const size_t *recv_offsets) {
    nccl_state *s = c->engine_state;
    const int R = c->size, me = c->rank;
    char *mine = (char *)recv + recv_offsets[me];
    if (send_bytes && (const char *)send != mine)
        CUDA_TRY("all_gatherv (own part)",
                 cudaMemcpyAsync(mine, send, send_bytes, cudaMemcpyDeviceToDevice, stream_of(c)));
    if (R == 1) return LM_OK;
    NCCL_TRY(s, "ncclGroupStart", ncclGroupStart());
    ncclResult_t r = ncclSuccess;
    const char *failed = NULL;
    for (int q = 0; q < R && r == ncclSuccess; q++) {
        if (q == me) continue;
        if (recv_bytes[q]) {
            r = ncclRecv((char *)recv + recv_offsets[q], recv_bytes[q], ncclUint8, q, s->nccl, stream_of(c));
            failed = "ncclRecv";
        }
        if (r == ncclSuccess && send_bytes) {
            r = ncclSend(send, send_bytes, ncclUint8, q, s->nccl, stream_of(c));
            failed = "ncclSend";
        }
    }
    ncclResult_t e = ncclGroupEnd();
    if (r != ncclSuccess) return nccl_fail(s, failed, r);
    if (e != ncclSuccess) return nccl_fail(s, "ncclGroupEnd (all_gatherv)", e);
    return LM_OK;
}

static lm_status nccl_broadcast(lm_comm *c, void *buf, size_t bytes, int root) {
    nccl_state *s = c->engine_state;
    if (c->size == 1) return LM_OK;
    NCCL_TRY(s, "ncclBroadcast", ncclBroadcast(buf, buf, bytes, ncclUint8, root, s->nccl, stream_of(c)));
    return LM_OK;
}

/* NCCL has no barrier: a one-int all-reduce cannot finish before every rank
 * enqueued it; waiting for the stream then returns after every rank entered
 * (and after the work enqueued before it on this stream). */
static lm_status nccl_barrier(lm_comm *c) {
    nccl_state *s = c->engine_state;
    NCCL_TRY(s, "ncclAllReduce (barrier)",
             ncclAllReduce(s->barrier_word, s->barrier_word, 1, ncclInt32, ncclSum, s->nccl, stream_of(c)));
    CUDA_TRY("barrier (waiting for the stream)", cudaStreamSynchronize(stream_of(c)));
    return LM_OK;
}

/* Host counts in, host counts out: staged through device memory, an
 * all-to-all of one int64 a peer, then a wait for the stream. */
static lm_status nccl_exchange_counts(lm_comm *c, const int64_t *send_counts, int64_t *recv_counts) {
    nccl_state *s = c->engine_state;
    const int R = c->size;
    const size_t row = (size_t)R * sizeof(int64_t);
    int64_t *dsend = s->counts_dev, *drecv = dsend + R;
    CUDA_TRY("exchange_counts (upload)",
             cudaMemcpyAsync(dsend, send_counts, row, cudaMemcpyHostToDevice, stream_of(c)));
    size_t *sb = c->tables, *so = sb + R, *rb = so + R, *ro = rb + R;
    for (int q = 0; q < R; q++) {
        sb[q] = rb[q] = sizeof(int64_t);
        so[q] = ro[q] = (size_t)q * sizeof(int64_t);
    }
    TRY(nccl_all_to_allv(c, dsend, sb, so, drecv, rb, ro));
    CUDA_TRY("exchange_counts (download)",
             cudaMemcpyAsync(recv_counts, drecv, row, cudaMemcpyDeviceToHost, stream_of(c)));
    CUDA_TRY("exchange_counts (waiting for the stream)", cudaStreamSynchronize(stream_of(c)));
    return LM_OK;
}

static lm_status nccl_sum_rows(lm_comm *c, void *acc, const void *rows, size_t m, int R, lm_dtype dtype) {
    return lm_cuda_rank_order_sum(acc, rows, m, R, dtype, c->stream);
}

/* Grow the device scratch: wait for the work that may still read the old one
 * (on any stream of this device), then replace it. */
static lm_status nccl_scratch_resize(lm_comm *c, size_t bytes) {
    if (bytes <= c->scratch_bytes) return LM_OK;
    CUDA_TRY("scratch (waiting for the device)", cudaDeviceSynchronize());
    if (c->scratch) cudaFree(c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear the allocation error */
        return lm_error(LM_ERR_MEMORY, "comm nccl: out of device memory growing the scratch to %zu bytes (%s)",
                        bytes, cudaGetErrorString(e));
    }
    c->scratch = p;
    c->scratch_bytes = bytes;
    return LM_OK;
}

static void nccl_close(lm_comm *c) {
    nccl_state *s = c->engine_state;
    if (!s) return;
    cudaStreamSynchronize(stream_of(c));
    if (s->nccl) ncclCommDestroy(s->nccl);
    if (c->scratch) cudaFree(c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    if (s->barrier_word) cudaFree(s->barrier_word);
    if (s->counts_dev) cudaFree(s->counts_dev);
    if (s->host != s->boot) lm_comm_close(s->host);
    lm_comm_close(s->boot);
    free(s);
    c->engine_state = NULL;
}

static lm_status nccl_split(lm_comm *c, int color, lm_comm *out, int *in_group);

static const lm_comm_ops nccl_ops = {.name = "nccl",
                                     .all_to_allv = nccl_all_to_allv,
                                     .all_gatherv = nccl_all_gatherv,
                                     .broadcast = nccl_broadcast,
                                     .barrier = nccl_barrier,
                                     .split = nccl_split,
                                     .close = nccl_close,
                                     .copy = nccl_copy,
                                     .sum_rows = nccl_sum_rows,
                                     .scratch_resize = nccl_scratch_resize,
                                     .exchange_counts = nccl_exchange_counts};

/* A part: its host handle is the host handle's part of the same color (its
 * ranks in the same order, key = the parent rank), its NCCL communicator
 * ncclCommSplit's; both collective over every rank of c. */
static lm_status nccl_split(lm_comm *c, int color, lm_comm *out, int *in_group) {
    nccl_state *s = c->engine_state;
    lm_comm *host = NULL;
    TRY(lm_comm_split(s->host, color, &host));
    ncclComm_t nc = NULL;
    ncclResult_t r = ncclCommSplit(s->nccl, color >= 0 ? color : NCCL_SPLIT_NOCOLOR, c->rank, &nc, NULL);
    if (r != ncclSuccess) {
        lm_comm_close(host);
        return nccl_fail(s, "ncclCommSplit", r);
    }
    *in_group = host != NULL;
    if (!host) return LM_OK;
    nccl_state *p = calloc(1, sizeof *p);
    if (!p) {
        ncclCommDestroy(nc);
        lm_comm_close(host);
        return lm_error(LM_ERR_MEMORY, "comm nccl split: out of memory");
    }
    p->nccl = nc;
    p->host = host; /* owned: closed with the part (boot stays NULL) */
    p->device = s->device;
    out->ops = &nccl_ops;
    out->engine_state = p;
    out->rank = lm_comm_rank(host);
    out->size = lm_comm_size(host);
    out->stream = c->stream;
    cudaError_t e = cudaMalloc((void **)&p->barrier_word, sizeof(int));
    if (e == cudaSuccess) e = cudaMemset(p->barrier_word, 0, sizeof(int));
    if (e == cudaSuccess) e = cudaMalloc((void **)&p->counts_dev, 2 * (size_t)out->size * sizeof(int64_t));
    if (e != cudaSuccess) {
        lm_status st = cuda_fail("a split's buffers", e);
        nccl_close(out);
        return st;
    }
    return LM_OK;
}

lm_comm *lm_comm_nccl_host(lm_comm *c) {
    nccl_state *s = c->engine_state;
    return s->host;
}

void lm_comm_nccl_abort(lm_comm *c, int code) {
    nccl_state *s = c ? c->engine_state : NULL;
    if (s && s->boot) lm_comm_abort(s->boot, code);
    if (s && s->host && lm_comm_size(s->host) > 1) lm_comm_abort(s->host, code); /* a split part's */
    exit(code);
}

/* ---- bootstrap ---- */

/* The processes of the job a launcher started this one in (Open MPI's and
 * MPICH's mpirun say so in the environment); 0 when none says. */
static long launched_ranks(void) {
    const char *names[2] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
    for (int i = 0; i < 2; i++) {
        const char *v = getenv(names[i]);
        if (v && atol(v) > 0) return atol(v);
    }
    return 0;
}

#ifdef LONGMOE_HAVE_MPI
/* Rank 0's unique id (or its failure) to every rank over MPI. */
static lm_status share_unique_id(lm_comm *boot, ncclUniqueId *id) {
    struct {
        int32_t result; /* rank 0's ncclResult_t */
        ncclUniqueId id;
    } msg;
    memset(&msg, 0, sizeof msg);
    if (lm_comm_rank(boot) == 0) msg.result = (int32_t)ncclGetUniqueId(&msg.id);
    TRY(lm_comm_broadcast(boot, &msg, sizeof msg, 0));
    if (msg.result != ncclSuccess)
        return lm_error(LM_ERR_IO, "comm nccl: ncclGetUniqueId failed on rank 0: %s",
                        ncclGetErrorString((ncclResult_t)msg.result));
    *id = msg.id;
    return LM_OK;
}
#endif

static lm_status nccl_setup(lm_comm *c, nccl_state *s) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0)
        return lm_error(LM_ERR_IO, "comm open: the nccl engine needs a CUDA device: %s",
                        e != cudaSuccess ? cudaGetErrorString(e) : "none is visible");
    int rank = 0, size = 1, local = 0;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    const long launched = launched_ranks();
#ifdef LONGMOE_HAVE_MPI
    if (launched > 0 || lm_comm_mpi_is_initialized()) {
        TRY(lm_comm_open(LM_COMM_MPI, &s->boot));
        rank = lm_comm_rank(s->boot);
        size = lm_comm_size(s->boot);
        TRY(lm_comm_local_rank(s->boot, &local));
        TRY(share_unique_id(s->boot, &id));
    } else
#endif
    {
        if (launched > 1)
            return lm_error(LM_ERR_ARG,
                            "comm open: started by mpirun as one of %ld processes, but this build has no MPI to "
                            "share the NCCL id over (CMake found no MPI library)",
                            launched);
        NCCL_TRY(s, "ncclGetUniqueId", ncclGetUniqueId(&id));
    }
    /* one process a GPU: the local rank picks it */
    s->device = local % ndev;
    CUDA_TRY("cudaSetDevice", cudaSetDevice(s->device));
    NCCL_TRY(s, "ncclCommInitRank", ncclCommInitRank(&s->nccl, size, id, rank));
    CUDA_TRY("allocating the barrier word", cudaMalloc((void **)&s->barrier_word, sizeof(int)));
    CUDA_TRY("clearing the barrier word", cudaMemset(s->barrier_word, 0, sizeof(int)));
    CUDA_TRY("allocating the count exchange",
             cudaMalloc((void **)&s->counts_dev, 2 * (size_t)size * sizeof(int64_t)));
    if (s->boot) s->host = s->boot;
    else TRY(lm_comm_open(LM_COMM_SELF, &s->host));
    c->rank = rank;
    c->size = size;
    return LM_OK;
}

lm_status lm_comm_nccl_attach(lm_comm *c) {
    nccl_state *s = calloc(1, sizeof *s);
    if (!s) return lm_error(LM_ERR_MEMORY, "comm open: out of memory");
    c->engine_state = s;
    c->ops = &nccl_ops;
    lm_status st = nccl_setup(c, s);
    if (st) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        nccl_close(c); /* may record errors of its own: keep the first */
        c->ops = NULL;
        c->rank = 0;
        c->size = 0;
        return lm_error(st, "%s", msg);
    }
    return LM_OK;
}
#endif
