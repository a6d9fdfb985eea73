/* Pieces of the gated attention layer shared with its context-parallel form
 * (src/comm/mla_context_parallel.c). */
#ifndef LONGMOE_MLA_INTERNAL_H
#define LONGMOE_MLA_INTERNAL_H

#include <stdint.h>

/* RoPE on the last r dims of each of the `heads` head vectors (head_dim
 * floats) of the n rows of x; row i sits at position pos0 + i % T; inverse = 1
 * rotates back (the backward). */
void lm_mla_rope_apply(float *x, int64_t n, int T, int heads, int head_dim, int r, float base, int64_t pos0,
                       int inverse);

#endif
