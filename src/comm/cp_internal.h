/* Shared by the context-parallel layers (src/comm/mla_context_parallel.c, kda_layer_context_parallel.c). */
#ifndef LONGMOE_CP_INTERNAL_H
#define LONGMOE_CP_INTERNAL_H

#include <stdint.h>

#include "longmoe/comm.h"

/* Every rank's (B, t0, n), all-gathered into seg (3 ints a rank) and checked:
 * segments in rank order without gaps, n >= 1, the same B; with each rank's
 * verdict on its own arguments (`local`, an lm_status): when any rank refused
 * its arguments every rank returns an error (its own, or one naming the
 * rank), so none is left waiting in a later collective. Collective: every
 * rank sees the same table and so the same verdict. */
lm_status lm_cp_gather_segments(lm_comm *comm, int B, int t0, int n, lm_status local, int32_t *seg,
                                const char *what);

/* lm_cp_gather_segments over lm_comm_host(comm) into a new table *seg (3
 * ints a rank; the caller frees it; NULL after an error). Collective. */
lm_status lm_cp_segment_table(lm_comm *comm, int B, int t0, int n, lm_status local, const char *what, int32_t **seg);

/* Each rank's verdict on its own arguments, shared: LM_OK on every rank when
 * all are LM_OK, else an error on every rank (its own, or one naming the
 * first rank that refused, with that rank's status: LM_ERR_NUMERIC for a
 * non-finite input stays LM_ERR_NUMERIC). Collective. */
lm_status lm_cp_agree(lm_comm *comm, lm_status local, const char *what);

#endif
