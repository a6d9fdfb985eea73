/* The MPI engine of the communication layer (docs/scaleout.md): CPU ranks
 * started by mpirun. Compiled to nothing unless CMake found MPI
 * (LONGMOE_HAVE_MPI). Data moves by point-to-point messages in pieces of at
 * most 1 GiB, so sizes and offsets are size_t (MPI's collectives take int
 * counts and displacements); the sums are built on top in comm.c. */
#ifdef LONGMOE_HAVE_MPI
#include <limits.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_internal.h"

#define MPI_PIECE_BYTES ((size_t)1 << 30)

typedef struct {
    MPI_Comm comm;
    MPI_Request *requests; /* 2 * size */
    size_t *tables;        /* 3 * size: the all-gather's counts and offsets */
    int finalize;          /* this handle initialised MPI */
} mpi_state;

/* Handles alive that this library opened with MPI_Init (finalise at the last). */
static int mpi_handles_we_initialised;

static lm_status mpi_fail(const char *what, int code) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "error %d", code);
    return lm_error(LM_ERR_IO, "comm mpi: %s failed: %s", what, msg);
}

static size_t pieces_of(size_t bytes) { return (bytes + MPI_PIECE_BYTES - 1) / MPI_PIECE_BYTES; }

/* Piece k of a message of `bytes`: its offset and length (0 past the end). */
static int piece_len(size_t bytes, size_t k) {
    size_t start = k * MPI_PIECE_BYTES;
    if (start >= bytes) return 0;
    size_t n = bytes - start;
    return (int)(n < MPI_PIECE_BYTES ? n : MPI_PIECE_BYTES);
}

static lm_status mpi_all_to_allv(lm_comm *c, const void *send, const size_t *send_bytes,
                                 const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                 const size_t *recv_offsets) {
    mpi_state *s = c->engine_state;
    const int R = c->size, me = c->rank;
    /* this rank's own part is a copy */
    if (send_bytes[me] != recv_bytes[me])
        return lm_error(LM_ERR_ARG, "comm all_to_allv: rank %d sends itself %zu bytes but expects %zu", me,
                        send_bytes[me], recv_bytes[me]);
    if (send_bytes[me])
        memcpy((char *)recv + recv_offsets[me], (const char *)send + send_offsets[me], send_bytes[me]);
    size_t waves = 0;
    for (int q = 0; q < R; q++) {
        size_t a = pieces_of(send_bytes[q]), b = pieces_of(recv_bytes[q]);
        if (a > waves) waves = a;
        if (b > waves) waves = b;
    }
    /* every rank must run the same number of waves: agree on the largest */
    unsigned long long w = waves, wmax = 0;
    int rc = MPI_Allreduce(&w, &wmax, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, s->comm);
    if (rc != MPI_SUCCESS) return mpi_fail("MPI_Allreduce (pieces)", rc);
    for (size_t k = 0; k < (size_t)wmax; k++) {
        int n = 0;
        const int tag = (int)(k % 32768);
        for (int q = 0; q < R; q++) {
            int len = q == me ? 0 : piece_len(recv_bytes[q], k);
            if (!len) continue;
            rc = MPI_Irecv((char *)recv + recv_offsets[q] + k * MPI_PIECE_BYTES, len, MPI_BYTE, q, tag, s->comm,
                           &s->requests[n++]);
            if (rc != MPI_SUCCESS) return mpi_fail("MPI_Irecv", rc);
        }
        for (int q = 0; q < R; q++) {
            int len = q == me ? 0 : piece_len(send_bytes[q], k);
            if (!len) continue;
            rc = MPI_Isend((const char *)send + send_offsets[q] + k * MPI_PIECE_BYTES, len, MPI_BYTE, q, tag,
                           s->comm, &s->requests[n++]);
            if (rc != MPI_SUCCESS) return mpi_fail("MPI_Isend", rc);
        }
        rc = MPI_Waitall(n, s->requests, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail("MPI_Waitall", rc);
    }
    return LM_OK;
}

static lm_status mpi_all_gatherv(lm_comm *c, const void *send, size_t send_bytes, void *recv,
                                 const size_t *recv_bytes, const size_t *recv_offsets) {
    /* an all-to-all that sends the same bytes to every peer */
    mpi_state *s = c->engine_state;
    const int R = c->size;
    size_t *sb = s->tables, *so = sb + R, *rb = so + R;
    for (int q = 0; q < R; q++) {
        sb[q] = send_bytes;
        so[q] = 0;
        rb[q] = recv_bytes[q];
    }
    if (send_bytes && (const char *)send == (const char *)recv + recv_offsets[c->rank]) {
        /* in place: this rank's part is already where it belongs */
        sb[c->rank] = 0;
        rb[c->rank] = 0;
    }
    return mpi_all_to_allv(c, send, sb, so, recv, rb, recv_offsets);
}

static lm_status mpi_broadcast(lm_comm *c, void *buf, size_t bytes, int root) {
    mpi_state *s = c->engine_state;
    for (size_t k = 0; k < pieces_of(bytes); k++) {
        int rc = MPI_Bcast((char *)buf + k * MPI_PIECE_BYTES, piece_len(bytes, k), MPI_BYTE, root, s->comm);
        if (rc != MPI_SUCCESS) return mpi_fail("MPI_Bcast", rc);
    }
    return LM_OK;
}

static lm_status mpi_barrier(lm_comm *c) {
    mpi_state *s = c->engine_state;
    int rc = MPI_Barrier(s->comm);
    return rc == MPI_SUCCESS ? LM_OK : mpi_fail("MPI_Barrier", rc);
}

static void mpi_close(lm_comm *c) {
    mpi_state *s = c->engine_state;
    if (!s) return;
    MPI_Comm_free(&s->comm);
    free(s->requests);
    free(s->tables);
    if (s->finalize && --mpi_handles_we_initialised == 0) MPI_Finalize();
    free(s);
    c->engine_state = NULL;
}

static lm_status mpi_split(lm_comm *c, int color, lm_comm *out, int *in_group);
static lm_status attach_comm(lm_comm *c, MPI_Comm mc, int we_init);

static const lm_comm_ops mpi_ops = {.name = "mpi",
                                    .all_to_allv = mpi_all_to_allv,
                                    .all_gatherv = mpi_all_gatherv,
                                    .broadcast = mpi_broadcast,
                                    .barrier = mpi_barrier,
                                    .split = mpi_split,
                                    .close = mpi_close};

/* Fill handle c with communicator `mc` (the handle owns it from here). */
static lm_status attach_comm(lm_comm *c, MPI_Comm mc, int we_init) {
    mpi_state *s = calloc(1, sizeof *s);
    if (!s) {
        MPI_Comm_free(&mc);
        return lm_error(LM_ERR_MEMORY, "comm open: out of memory");
    }
    s->comm = mc;
    MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(s->comm, &c->rank);
    MPI_Comm_size(s->comm, &c->size);
    s->requests = malloc(2 * (size_t)c->size * sizeof *s->requests);
    s->tables = malloc(3 * (size_t)c->size * sizeof *s->tables);
    if (!s->requests || !s->tables) {
        MPI_Comm_free(&s->comm);
        free(s->requests);
        free(s->tables);
        free(s);
        return lm_error(LM_ERR_MEMORY, "comm open: out of memory for %d ranks", c->size);
    }
    s->finalize = we_init;
    if (we_init) mpi_handles_we_initialised++;
    c->engine_state = s;
    c->ops = &mpi_ops;
    return LM_OK;
}

static lm_status mpi_split(lm_comm *c, int color, lm_comm *out, int *in_group) {
    mpi_state *s = c->engine_state;
    MPI_Comm mc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(s->comm, color >= 0 ? color : MPI_UNDEFINED, c->rank, &mc);
    if (rc != MPI_SUCCESS) return mpi_fail("MPI_Comm_split", rc);
    *in_group = mc != MPI_COMM_NULL;
    if (!*in_group) return LM_OK;
    /* MPI stays up while the part is open when this library started it */
    return attach_comm(out, mc, s->finalize);
}

int lm_comm_mpi_is_initialized(void) {
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    return initialised && !finalised;
}

void lm_comm_mpi_abort(lm_comm *c, int code) {
    mpi_state *s = c->engine_state;
    MPI_Abort(s ? s->comm : MPI_COMM_WORLD, code);
}

lm_status lm_comm_mpi_attach(lm_comm *c) {
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (finalised) return lm_error(LM_ERR_ARG, "comm open: MPI was already finalised in this process");
    int we_init = 0;
    if (!initialised) {
        int provided = 0;
        int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail("MPI_Init_thread", rc);
        we_init = 1;
    } else if (mpi_handles_we_initialised) {
        we_init = 1; /* MPI is ours: keep it up until our last handle closes */
    }
    MPI_Comm dup;
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    if (rc != MPI_SUCCESS) return mpi_fail("MPI_Comm_dup", rc);
    return attach_comm(c, dup, we_init);
}
#endif
