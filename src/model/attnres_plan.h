/* The geometry of Block Attention Residuals shared by the CPU module
 * (src/model/attnres.c, where it is defined) and the GPU state
 * (src/cuda/attnres/attnres_api.cu): both plan their buffers and index the
 * saved logits with these functions, so they agree by construction. */
#ifndef LONGMOE_MODEL_ATTNRES_PLAN_H
#define LONGMOE_MODEL_ATTNRES_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/attnres.h"

#ifdef __cplusplus
extern "C" {
#endif

/* block size S in sublayers: 1 for full AttnRes, L for the standard residual */
int attnres_effective_block(const lm_attnres_config *c);

/* sources read by sublayer l (l = L: the final AttnRes) for block size S over L sublayers */
int attnres_n_sources_of(int l, int S, int L);

/* saved partial sums the state keeps (L - n_blocks, or S - 1 with replay), and
 * the slot of sublayer l's (l % S > 0) */
int attnres_partial_slots(const lm_attnres_config *c);
int attnres_partial_slot(const lm_attnres_config *c, int l);

/* offset (in floats) of sublayer l's logits: sum over j < l of n_sources_j * n */
size_t attnres_logits_offset(int l, int S, int L, int64_t n);

/* checks every field of the config; error messages start with `who` ("attnres", "attnres cuda") */
lm_status attnres_check_config(const lm_attnres_config *c, const char *who);

#ifdef __cplusplus
}
#endif

#endif
