/* bf16 conversions and the non-finite check (include/longmoe/linear_cuda.h). */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

__global__ void lin_f32_to_bf16_kernel(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = lin_f32_to_bf16(src[i]);
}

__global__ void lin_bf16_to_f32_kernel(float *dst, const uint16_t *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = lin_bf16_to_f32(src[i]);
}

__global__ void lin_flag_set_kernel(int *flag) { *flag = 1; }

/* Every thread that meets an infinity or NaN writes 0: all writers write the
 * same value, so the result does not depend on their order. The test is on
 * the exponent bits (immune to fast-math assumptions). */
__global__ void lin_all_finite_kernel(const float *x, size_t n, int *flag) {
    int bad = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *flag = 0;
}

static lm_status check_ctx(const lm_cuda_context *ctx, const void *a, const void *b, size_t n, const char *fn) {
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n > 0 && (!a || !b)) return lm_error(LM_ERR_ARG, "%s: dst or src is NULL", fn);
    return LM_OK;
}

extern "C" lm_status lm_cuda_f32_to_bf16(const lm_cuda_context *ctx, uint16_t *dst, const float *src, size_t n) {
    lm_status st = check_ctx(ctx, dst, src, n, "lm_cuda_f32_to_bf16");
    if (st || n == 0) return st;
    lin_f32_to_bf16_kernel<<<lin_grid_for(ctx, n, 256), 256, 0, lin_stream(ctx)>>>(dst, src, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_bf16_to_f32(const lm_cuda_context *ctx, float *dst, const uint16_t *src, size_t n) {
    lm_status st = check_ctx(ctx, dst, src, n, "lm_cuda_bf16_to_f32");
    if (st || n == 0) return st;
    lin_bf16_to_f32_kernel<<<lin_grid_for(ctx, n, 256), 256, 0, lin_stream(ctx)>>>(dst, src, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_all_finite(const lm_cuda_context *ctx, const float *x, size_t n, int *flag_device) {
    if (!ctx) return lm_error(LM_ERR_ARG, "lm_cuda_all_finite: ctx is NULL");
    if (!flag_device) return lm_error(LM_ERR_ARG, "lm_cuda_all_finite: flag_device is NULL");
    if (n > 0 && !x) return lm_error(LM_ERR_ARG, "lm_cuda_all_finite: x is NULL");
    lin_flag_set_kernel<<<1, 1, 0, lin_stream(ctx)>>>(flag_device);
    LM_CUDA_TRY(cudaGetLastError());
    if (n == 0) return LM_OK;
    lin_all_finite_kernel<<<lin_grid_for(ctx, n, 256), 256, 0, lin_stream(ctx)>>>(x, n, flag_device);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
