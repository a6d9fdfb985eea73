/* Collective communication between ranks (docs/scaleout.md; SPEC §9).
 *
 * One handle, lm_comm, gives every rank of a job the same collectives:
 *   all-reduce (sum), reduce-scatter (sum), all-gather (equal or variable
 *   sizes), all-to-all with variable byte counts, broadcast, barrier.
 * Engines behind it:
 *   LM_COMM_SELF  one rank, no dependency (the default of a build without MPI)
 *   LM_COMM_MPI   CPU ranks started by mpirun (built when CMake finds MPI:
 *                 LONGMOE_MPI=ON, then LONGMOE_HAVE_MPI is defined)
 *   LM_COMM_NCCL  GPU ranks, one process a GPU (built when CMake finds CUDA and
 *                 NCCL: LONGMOE_HAVE_NCCL); started by mpirun (the NCCL id goes
 *                 over MPI) or alone (one rank)
 *   LM_COMM_STAGED buffers in a backend's memory, messages over a host handle
 *                 (lm_comm_open_staged): each collective copies its data to the
 *                 host, runs the host handle's collective and copies the
 *                 results back. Always built; GPU ranks without NCCL, and
 *                 several processes sharing one GPU (NCCL refuses that).
 *
 * Memory. Buffers live where the engine works: host memory for SELF and MPI,
 * device memory for NCCL, whose calls are enqueued on the stream set by
 * lm_comm_set_stream (NULL: the default stream; host engines ignore it) and
 * return before the data has moved (read the results after the stream). The
 * counts of lm_comm_exchange_counts and every count and offset table are host
 * arrays on every engine. Each handle keeps one scratch buffer (engine memory)
 * that the reductions use, grown on first need; call lm_comm_reserve before a
 * step to keep allocation out of it.
 *
 * Determinism. Every sum is computed in a fixed order that depends only on
 * the number of ranks and the count, never on timing or the MPI library's
 * algorithm: the elements are split into one contiguous chunk per rank
 * (rank r owns [n r / R, n (r+1) / R)), each owner adds the ranks'
 * contributions of its chunk in rank order 0, 1, ..., R-1, and the sums are
 * gathered. So all ranks receive bit-identical results, equal to the serial
 * loop `acc = x_0; acc += x_1; ...; acc += x_{R-1}` in the element type
 * (int32 sums wrap modulo 2^32).
 *
 * Every collective must be called by all ranks of the handle in the same
 * order with matching sizes; counts are in elements of `dtype` for the
 * reductions and in bytes for the data movement. */
#ifndef LONGMOE_COMM_H
#define LONGMOE_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { LM_COMM_SELF = 0, LM_COMM_MPI = 1, LM_COMM_NCCL = 2, LM_COMM_STAGED = 3 } lm_comm_engine;

struct lm_backend; /* include/longmoe/backend.h */

typedef struct lm_comm lm_comm;

/* Name of an engine ("self", "mpi", "nccl", "staged"). */
const char *lm_comm_engine_name(lm_comm_engine engine);
/* 1 when this build has the engine. */
int lm_comm_engine_available(lm_comm_engine engine);

/* Open a handle on all ranks of the job. MPI: initialises MPI when nobody has
 * (then lm_comm_close finalises it) and works on a duplicate of
 * MPI_COMM_WORLD. NCCL: a process started by mpirun (or running MPI already)
 * opens MPI the same way and gets the NCCL id from rank 0; it selects its GPU
 * (cudaSetDevice: its rank among the job's processes on this host, modulo the
 * visible devices); a lone process makes a one-rank communicator. An engine
 * this build lacks is an LM_ERR_ARG error naming the missing library. */
lm_status lm_comm_open(lm_comm_engine engine, lm_comm **out);
/* The staged engine: a handle on the ranks of `host` (a SELF or MPI handle,
 * which stays the caller's and must outlive this one) for buffers in the
 * memory of backend `be`. Every collective downloads the data it sends to host
 * staging buffers (kept and grown on need), runs host's collective on them
 * and uploads what it received; the sums are comm.c's owner-computes
 * algorithm, the rank-order additions done on the host, so every result has
 * the bits of the host engines' and the NCCL engine's. Scratch is `be`'s
 * memory (lm_comm_reserve). The copies go through be's upload and download,
 * which wait for the work enqueued before them on be's stream: a buffer is
 * read after everything before the call, and the results are in place when
 * the call returns (lm_comm_set_stream is ignored). lm_comm_host gives
 * `host`; lm_comm_split splits it (the part's host handle is the part's own). */
lm_status lm_comm_open_staged(lm_comm *host, struct lm_backend *be, lm_comm **out);

/* This rank's index among the ranks of `host` that run on the same machine
 * (host names compared; collective on every rank of a host-memory handle):
 * the GPU a process takes is this index modulo the visible devices. */
lm_status lm_comm_local_rank(lm_comm *host, int *local);

/* Release the handle (NULL is allowed); collective on all ranks. */
void lm_comm_close(lm_comm *comm);

/* End every process of the job with exit code `code` (a failure on one rank
 * that the others cannot learn of: they would wait in their next collective).
 * MPI: MPI_Abort; one rank: exit. Does not return. */
void lm_comm_abort(lm_comm *comm, int code);

/* A handle on the same ranks, in the same order, for host buffers: `comm`
 * itself for the host engines; for NCCL the MPI handle its id came over, or a
 * one-rank handle for a lone process (owned by `comm`, closed with it); for
 * the staged engine its host handle (its opener's; a split part's own). Small
 * values that live on the host (losses, flags, counts) go over it while the
 * device engine moves device buffers. */
lm_comm *lm_comm_host(lm_comm *comm);

int lm_comm_rank(const lm_comm *comm);
int lm_comm_size(const lm_comm *comm);
lm_comm_engine lm_comm_engine_of(const lm_comm *comm);

/* The stream (a cudaStream_t for a device engine) that later calls are
 * ordered on; host engines ignore it. */
void lm_comm_set_stream(lm_comm *comm, void *stream);

/* Grow the handle's scratch to at least the bytes that a sum of `count`
 * elements of `dtype` needs (all_reduce or reduce_scatter of that count:
 * the larger, R * count elements). One rank needs none. */
lm_status lm_comm_reserve(lm_comm *comm, size_t count, lm_dtype dtype);

/* Copy `bytes` within the engine's memory (device buffers for a device
 * engine), ordered on its stream like its collectives; the regions must not
 * overlap. Local: no other rank takes part. */
lm_status lm_comm_copy(lm_comm *comm, void *dst, const void *src, size_t bytes);

/* Sum over ranks of `count` elements (F32, F64 or I32); send == recv is
 * allowed (in place). Every rank receives the same bits. */
lm_status lm_comm_all_reduce_sum(lm_comm *comm, const void *send, void *recv, size_t count, lm_dtype dtype);

/* send [R][count] on every rank; recv [count] on rank r = sum over ranks of
 * their send[r] (in rank order). send and recv must not overlap. */
lm_status lm_comm_reduce_scatter_sum(lm_comm *comm, const void *send, void *recv, size_t count,
                                     lm_dtype dtype);

/* Variable shares: send holds the ranks' blocks one after the other, rank q's
 * counts[q] elements at element offset counts[0] + ... + counts[q-1] (the
 * same counts on every rank; zeros allowed); recv [counts[r]] on rank r = the
 * sum over ranks of their block r, added in rank order as above (so each
 * element has the bits an all-reduce gives it). send and recv must not
 * overlap. */
lm_status lm_comm_reduce_scatterv_sum(lm_comm *comm, const void *send, void *recv, const size_t *counts,
                                      lm_dtype dtype);

/* send [bytes] on every rank; recv [R][bytes] in rank order. */
lm_status lm_comm_all_gather(lm_comm *comm, const void *send, void *recv, size_t bytes);

/* Variable sizes: rank r sends send_bytes (= recv_bytes[r] on every rank),
 * placed at recv + recv_offsets[r]. */
lm_status lm_comm_all_gatherv(lm_comm *comm, const void *send, size_t send_bytes, void *recv,
                              const size_t *recv_bytes, const size_t *recv_offsets);

/* Rank r sends send_bytes[q] bytes from send + send_offsets[q] to rank q,
 * which receives them at recv + recv_offsets[r] and must have
 * recv_bytes[r] == that count (lm_comm_exchange_counts gives it). Counts may
 * be zero. send and recv must not overlap. Arrays have lm_comm_size entries. */
lm_status lm_comm_all_to_allv(lm_comm *comm, const void *send, const size_t *send_bytes,
                              const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                              const size_t *recv_offsets);

/* recv_counts[p] = the send_counts[r] of rank p, for this rank r: the counts
 * an all_to_allv will deliver (one int64 per peer). Host arrays on every
 * engine; NCCL stages them through the device and waits for its stream. */
lm_status lm_comm_exchange_counts(lm_comm *comm, const int64_t *send_counts, int64_t *recv_counts);

/* Copy `bytes` at buf on rank `root` into buf on every rank. */
lm_status lm_comm_broadcast(lm_comm *comm, void *buf, size_t bytes, int root);

/* A handle on a subset of the ranks: the ranks that give the same color >= 0
 * form one group, numbered in their order in `comm`; a rank giving a negative
 * color gets *out = NULL. Collective on every rank of `comm`. The new handle
 * is closed with lm_comm_close (before `comm`'s last handle closes MPI). */
lm_status lm_comm_split(lm_comm *comm, int color, lm_comm **out);

/* Return when every rank has entered (NCCL: and the work enqueued before it
 * on the stream has finished). */
lm_status lm_comm_barrier(lm_comm *comm);

#ifdef __cplusplus
}
#endif
#endif
