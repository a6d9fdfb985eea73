/* Internals of the communication layer (docs/scaleout.md): an engine is a
 * table of data-movement functions; the deterministic reductions are built on
 * top of them once, in comm.c, for every host engine. A device engine sets its
 * own reduce-scatter (a summing kernel in rank order) in the table. */
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
     * ranks of this color (>= 0), or set *in_group 0 for a negative color */
    lm_status (*split)(lm_comm *c, int color, lm_comm *out, int *in_group);
    void (*close)(lm_comm *c);
} lm_comm_ops;

struct lm_comm {
    const lm_comm_ops *ops;
    lm_comm_engine engine;
    int rank, size;
    void *stream;         /* device engines: the stream calls are ordered on */
    void *engine_state;   /* the engine's own data (MPI: the communicator) */
    unsigned char *scratch; /* reductions' scratch, grown on need */
    size_t scratch_bytes;
    size_t *tables;       /* 6 * size entries: counts and offsets of the collectives */
};

/* The MPI engine (comm_mpi.c, built with LONGMOE_HAVE_MPI): fills ops, rank,
 * size and engine_state of a zeroed handle. */
lm_status lm_comm_mpi_attach(lm_comm *c);
/* End every process of the job with exit code `code` (MPI_Abort). */
void lm_comm_mpi_abort(lm_comm *c, int code);

#endif
