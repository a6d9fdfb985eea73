/* Shared by the context-parallel layers (src/comm/mla_context_parallel.c, kda_layer_context_parallel.c). */
#ifndef LONGMOE_CP_INTERNAL_H
#define LONGMOE_CP_INTERNAL_H

#include <stdint.h>

#include "longmoe/comm.h"

/* Every rank's (B, t0, n), all-gathered into seg (3 ints a rank) and checked:
 * segments in rank order without gaps, n >= 1, the same B. Collective: every
 * rank sees the same table and so the same verdict. */
lm_status lm_cp_gather_segments(lm_comm *comm, int B, int t0, int n, int32_t *seg, const char *what);

#endif
