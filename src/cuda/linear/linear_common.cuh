/* Helpers shared by the dense CUDA operators (src/cuda/linear). */
#ifndef LONGMOE_CUDA_LINEAR_COMMON_CUH
#define LONGMOE_CUDA_LINEAR_COMMON_CUH

#include <stdint.h>

#include <cuda_runtime.h>

#include "longmoe/cuda_context.h"

/* bf16 bit pattern of x, round to nearest even, NaN kept quiet: the same
 * bits as lm_f32_to_bf16 on the host. */
__device__ __forceinline__ uint16_t lin_f32_to_bf16(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float lin_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

/* Sum over the 32 lanes of a warp, a fixed butterfly: every lane gets the
 * same bits, the same on every run. */
__device__ __forceinline__ float lin_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float lin_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Blocks for a grid-stride loop over `count` items, `threads` a block: no
 * more than 8 blocks per multiprocessor. At least 1. */
static inline unsigned lin_grid_for(const lm_cuda_context *ctx, size_t count, int threads) {
    size_t blocks = (count + (size_t)threads - 1) / (size_t)threads;
    size_t cap = (size_t)(ctx->sm_count > 0 ? ctx->sm_count : 132) * 8;
    if (blocks > cap) blocks = cap;
    return (unsigned)(blocks ? blocks : 1);
}

static inline cudaStream_t lin_stream(const lm_cuda_context *ctx) { return (cudaStream_t)ctx->stream; }

#endif
