/* Helpers shared by the KDA layer kernels (include/longmoe/kda_layer_cuda.h). */
#ifndef LONGMOE_KDA_LAYER_COMMON_CUH
#define LONGMOE_KDA_LAYER_COMMON_CUH

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "longmoe/kda_layer_cuda.h"

/* Per-head kernels: one warp per row of head_dim values, each lane holding
 * head_dim / 32 of them (lane, lane + 32, ...: coalesced); ROW_WARPS rows a block. */
#define KL_ROW_WARPS 8
#define KL_MAX_PER_LANE (LM_KDA_LAYER_CUDA_MAX_HEAD_DIM / 32)

/* Rows of a partial sum: token reductions run in blocks of rows; each block
 * writes its partial, and one ordered pass sums the partials (deterministic). */
static inline int64_t kl_chunks(int64_t rows, int64_t rows_per_chunk_min, int64_t max_chunks) {
    int64_t c = (rows + rows_per_chunk_min - 1) / rows_per_chunk_min;
    if (c > max_chunks) c = max_chunks;
    return c < 1 ? 1 : c;
}

__device__ __forceinline__ float kl_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* The CPU's lm_sigmoidf: stable for any finite x. */
__device__ __forceinline__ float kl_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

__device__ __forceinline__ float kl_bf16_to_f32(uint16_t b) {
    return __uint_as_float((unsigned)b << 16);
}

__device__ __forceinline__ uint16_t kl_f32_to_bf16(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

/* acc[e] += sum over chunks c of partial[c * len + e], in double, in a fixed
 * order: thread (x, y) of a block adds chunks y, y + KL_SUM_GROUPS, ...
 * (ascending) of element blockIdx.x * KL_SUM_COLS + x, then thread (x, 0)
 * adds the KL_SUM_GROUPS group sums in group order. The fixed-order second
 * pass of a token reduction, parallel over chunks (launch with
 * kl_partial_sum_grid / kl_partial_sum_block). */
#define KL_SUM_COLS 32
#define KL_SUM_GROUPS 16
static __global__ void kl_ordered_partial_sum_kernel(float *acc, const float *partial, int64_t len,
                                                     int64_t chunks) {
    __shared__ double sums[KL_SUM_GROUPS][KL_SUM_COLS];
    const int x = threadIdx.x, y = threadIdx.y;
    const int64_t e = (int64_t)blockIdx.x * KL_SUM_COLS + x;
    double s = 0.0;
    /* unrolled so that 8 loads are in flight (the adds stay in chunk order) */
    if (e < len) {
#pragma unroll 8
        for (int64_t c = y; c < chunks; c += KL_SUM_GROUPS) s += (double)partial[c * len + e];
    }
    sums[y][x] = s;
    __syncthreads();
    if (y == 0 && e < len) {
        double t = 0.0;
        for (int g = 0; g < KL_SUM_GROUPS; g++) t += sums[g][x];
        acc[e] += (float)t;
    }
}

static inline unsigned kl_partial_sum_grid(int64_t len) {
    return (unsigned)((len + KL_SUM_COLS - 1) / KL_SUM_COLS);
}

static inline dim3 kl_partial_sum_block(void) { return dim3(KL_SUM_COLS, KL_SUM_GROUPS); }

static inline unsigned kl_blocks(int64_t n, int per_block) {
    return (unsigned)((n + per_block - 1) / per_block);
}

#endif
