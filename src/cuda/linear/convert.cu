/* bf16 conversions and the non-finite check (include/longmoe/linear_cuda.h). */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

__global__ void lin_f32_to_bf16_kernel(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = lin_f32_to_bf16(src[i]);
}

/* The same conversion 8 elements a thread (two 16-byte loads, one 16-byte
 * store): src and dst 16-byte aligned, n8 groups of 8. */
__global__ void lin_f32_to_bf16_vec8_kernel(uint4 *dst, const float4 *src, size_t n8) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        const float4 a = src[2 * i], b = src[2 * i + 1];
        uint4 r;
        r.x = (uint32_t)lin_f32_to_bf16(a.x) | ((uint32_t)lin_f32_to_bf16(a.y) << 16);
        r.y = (uint32_t)lin_f32_to_bf16(a.z) | ((uint32_t)lin_f32_to_bf16(a.w) << 16);
        r.z = (uint32_t)lin_f32_to_bf16(b.x) | ((uint32_t)lin_f32_to_bf16(b.y) << 16);
        r.w = (uint32_t)lin_f32_to_bf16(b.z) | ((uint32_t)lin_f32_to_bf16(b.w) << 16);
        dst[i] = r;
    }
}

/* dst[r * ld + c] = bf16(src[r * cols + c]) */
__global__ void lin_f32_to_bf16_rows_kernel(uint16_t *dst, int64_t ld, const float *src, int64_t cols, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int64_t r = (int64_t)(i / (size_t)cols), c = (int64_t)(i % (size_t)cols);
        dst[r * ld + c] = lin_f32_to_bf16(src[i]);
    }
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

/* The same test 4 elements a load (x 16-byte aligned, n4 groups of 4). */
__global__ void lin_all_finite_vec4_kernel(const float4 *x, size_t n4, int *flag) {
    uint32_t bad = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        const float4 v = x[i];
        const uint32_t m = 0x7f800000u;
        bad |= ((__float_as_uint(v.x) & m) == m) | ((__float_as_uint(v.y) & m) == m) |
               ((__float_as_uint(v.z) & m) == m) | ((__float_as_uint(v.w) & m) == m);
    }
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
    size_t done = 0;
    if ((((uintptr_t)dst | (uintptr_t)src) & 15) == 0 && n >= 8) {
        const size_t n8 = n / 8;
        lin_f32_to_bf16_vec8_kernel<<<lin_grid_for(ctx, n8, 256), 256, 0, lin_stream(ctx)>>>(
            (uint4 *)dst, (const float4 *)src, n8);
        done = n8 * 8;
    }
    if (done < n)
        lin_f32_to_bf16_kernel<<<lin_grid_for(ctx, n - done, 256), 256, 0, lin_stream(ctx)>>>(dst + done, src + done,
                                                                                            n - done);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_f32_to_bf16_rows(const lm_cuda_context *ctx, uint16_t *dst, int64_t ld_dst,
                                              const float *src, int64_t rows, int64_t cols) {
    const char *fn = "lm_cuda_f32_to_bf16_rows";
    if (rows < 0 || cols < 1 || ld_dst < cols)
        return lm_error(LM_ERR_ARG, "%s: rows = %lld, cols = %lld, ld_dst = %lld (expected rows >= 0, cols >= 1, "
                        "ld_dst >= cols)", fn, (long long)rows, (long long)cols, (long long)ld_dst);
    const size_t n = (size_t)rows * (size_t)cols;
    lm_status st = check_ctx(ctx, dst, src, n, fn);
    if (st || n == 0) return st;
    if (ld_dst == cols) return lm_cuda_f32_to_bf16(ctx, dst, src, n);
    lin_f32_to_bf16_rows_kernel<<<lin_grid_for(ctx, n, 256), 256, 0, lin_stream(ctx)>>>(dst, ld_dst, src, cols, n);
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
    size_t done = 0;
    if (((uintptr_t)x & 15) == 0 && n >= 4) {
        const size_t n4 = n / 4;
        lin_all_finite_vec4_kernel<<<lin_grid_for(ctx, n4, 256), 256, 0, lin_stream(ctx)>>>((const float4 *)x, n4,
                                                                                          flag_device);
        done = n4 * 4;
    }
    if (done < n)
        lin_all_finite_kernel<<<lin_grid_for(ctx, n - done, 256), 256, 0, lin_stream(ctx)>>>(x + done, n - done,
                                                                                           flag_device);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
