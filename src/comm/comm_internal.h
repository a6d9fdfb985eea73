/* Internals of the communication layer (docs/scaleout.md): an engine is a
 * table of data-movement functions; the deterministic reductions are built on
 * top of them once, in comm.c, for every engine. A device engine (NCCL) adds
 * the hooks that make comm.c's algorithm run on device memory: a copy, the
 * rank-order summing kernel and a device scratch; the algorithm itself (which
 * chunk goes where, the order of the additions) is the same for all. */
#ifndef LONGMOE_COMM_INTERNAL_H
#define LONGMOE_COMM_INTERNAL_H

#include "longmoe/comm.h"

typedef struct {
    const char *name;
    /* Rank r sends send_bytes[q] at send + send_offsets[q] to rank q; receives
     * recv_bytes[p] at recv + recv_offsets[p] from rank p. */
    lm_status (*all_to_allv)(lm_comm *c, const void *send, const size_t *send_bytes,
                             const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                             const size_t *recv_offsets);
    lm_status (*all_gatherv)(lm_comm *c, const void *send, size_t send_bytes, void *recv,
                             const size_t *recv_bytes, const size_t *recv_offsets);
    lm_status (*broadcast)(lm_comm *c, void *buf, size_t bytes, int root);
    lm_status (*barrier)(lm_comm *c);
    /* fill the zeroed handle `out` (ops, rank, size, engine_state) with the
     * ranks of this color (>= 0), or set *in_group 0 for a negative color;
     * NULL: the engine cannot split (lm_comm_split says so) */
    lm_status (*split)(lm_comm *c, int color, lm_comm *out, int *in_group);
    void (*close)(lm_comm *c); /* releases engine_state (and a device scratch) */

    /* Device engines only; NULL for host engines (comm.c then uses memmove,
     * its host loop, realloc and an all-to-all of the host arrays). */
    /* memmove of `bytes` on the engine's memory, ordered on the stream */
    lm_status (*copy)(lm_comm *c, void *dst, const void *src, size_t bytes);
    /* acc[0..m) = rows[0] + ... + rows[R-1] (rows [R][m]), added in rank order */
    lm_status (*sum_rows)(lm_comm *c, void *acc, const void *rows, size_t m, int R, lm_dtype dtype);
    /* replace c->scratch by a buffer of at least `bytes` (contents need not survive) */
    lm_status (*scratch_resize)(lm_comm *c, size_t bytes);
    /* lm_comm_exchange_counts with host arrays (the counts size host tables) */
    lm_status (*exchange_counts)(lm_comm *c, const int64_t *send_counts, int64_t *recv_counts);
} lm_comm_ops;

struct lm_comm {
    const lm_comm_ops *ops;
    lm_comm_engine engine;
    int rank, size;
    void *stream;         /* device engines: the stream calls are ordered on */
    void *engine_state;   /* the engine's own data (MPI: the communicator) */
    unsigned char *scratch; /* reductions' scratch, grown on need (engine memory) */
    size_t scratch_bytes;
    size_t *tables;       /* 6 * size entries: counts and offsets of the collectives */
};

/* acc[0..m) = rows[0] + ... + rows[R-1] (rows [R][m]) in rank order on the
 * host: the host engines' sums, and the staged engine's after its download. */
void lm_comm_sum_rows_host(void *acc, const void *rows, size_t m, int R, lm_dtype dtype);

/* The staged engine (comm_staged.c): the host handle its messages go over. */
lm_comm *lm_comm_staged_host(lm_comm *c);

/* The MPI engine (comm_mpi.c, built with LONGMOE_HAVE_MPI): fills ops, rank,
 * size and engine_state of a zeroed handle. */
lm_status lm_comm_mpi_attach(lm_comm *c);
/* End every process of the job with exit code `code` (MPI_Abort). */
void lm_comm_mpi_abort(lm_comm *c, int code);
/* 1 when MPI is initialised (and not finalised) in this process. */
int lm_comm_mpi_is_initialized(void);

/* The NCCL engine (comm_nccl.c, built with LONGMOE_HAVE_NCCL): picks this
 * process's GPU, creates the NCCL communicator (its id sent over MPI when the
 * process is one of several) and fills ops, rank, size and engine_state. */
lm_status lm_comm_nccl_attach(lm_comm *c);
/* End every process of the job (MPI_Abort through the bootstrap handle, else exit). */
void lm_comm_nccl_abort(lm_comm *c, int code);
/* The host handle of the same ranks (lm_comm_host). */
lm_comm *lm_comm_nccl_host(lm_comm *c);

#endif
