/* The rank-order sum of the communication layer on the GPU (docs/scaleout.md,
 * "Determinism"): the owner's step of the device engine's all-reduce and
 * reduce-scatter. C-callable. */
#ifndef LONGMOE_CUDA_RANK_ORDER_SUM_H
#define LONGMOE_CUDA_RANK_ORDER_SUM_H

#include <stddef.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* acc[i] = rows[0][i] + rows[1][i] + ... + rows[R-1][i] for i < m, rows laid
 * out [R][m], added left to right in the element type: F32 and F64 in IEEE
 * round-to-nearest with subnormals kept (no flush to zero, no fused
 * operations), I32 modulo 2^32. So the result is bit-identical to the host
 * loop `a = x_0; a += x_1; ...`. acc must not overlap rows. Device pointers;
 * enqueued on `stream` (a cudaStream_t, NULL: the default stream). */
lm_status lm_cuda_rank_order_sum(void *acc, const void *rows, size_t m, int R, lm_dtype dtype, void *stream);

#ifdef __cplusplus
}
#endif
#endif
