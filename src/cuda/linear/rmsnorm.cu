/* RMSNorm on the GPU (include/longmoe/linear_cuda.h), the CUDA twin of
 * lm_rmsnorm_forward / lm_rmsnorm_backward (src/ops/linear/linear.c).
 *
 * One warp per row for the row-wise parts (any d: lanes stride over the
 * row, the sum of squares and the backward's dot product are fixed warp
 * butterflies); statistics fp32. dweight is summed over rows in two fixed
 * steps: block p adds rows [p*R, (p+1)*R) column by column in row order into
 * partial[p][:], then one pass adds the partials in p order. R depends on n
 * only, so the bits do not depend on the GPU's size. */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

#define RMS_ROWS_PER_BLOCK 8 /* warps per block of the row kernels */
#define RMS_PARTS_MAX 512    /* at most this many row ranges for dweight */
#define RMS_MIN_PART_ROWS 32
#define RMS_COL_THREADS 128

/* Rows per dweight partial for n rows. */
static int64_t rms_part_rows(int64_t n) {
    int64_t r = (n + RMS_PARTS_MAX - 1) / RMS_PARTS_MAX;
    return r < RMS_MIN_PART_ROWS ? RMS_MIN_PART_ROWS : r;
}

static int64_t rms_parts(int64_t n) {
    int64_t r = rms_part_rows(n);
    return n > 0 ? (n + r - 1) / r : 0;
}

/* 1/rms of a row of length d, on all lanes of the calling warp. */
__device__ __forceinline__ float rms_row_rstd(const float *x, int d, float eps, int lane) {
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += x[i] * x[i];
    ss = lin_warp_sum(ss);
    return 1.0f / sqrtf(ss / (float)d + eps);
}

__global__ void rms_forward_kernel(float *out, uint16_t *out_bf16, float *rstd, const float *inp,
                                   const float *weight, int64_t n, int d, float eps) {
    // inp, out (n,d); weight (d); rstd (n)
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= n) return;
    const float *x = inp + row * d;
    float s = rms_row_rstd(x, d, eps, lane);
    if (rstd && lane == 0) rstd[row] = s;
    for (int i = lane; i < d; i += 32) {
        float y = x[i] * s * (weight ? weight[i] : 1.0f);
        if (out) out[row * d + i] = y;
        if (out_bf16) out_bf16[row * d + i] = lin_f32_to_bf16(y);
    }
}

__global__ void rms_rstd_kernel(float *rstd, const float *inp, int64_t n, int d, float eps) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= n) return;
    float s = rms_row_rstd(inp + row * d, d, eps, lane);
    if (lane == 0) rstd[row] = s;
}

/* dx_i += s w_i dy_i - x_i s^3 / d * sum_j (w_j dy_j x_j)  (docs/ops, linear.c) */
__global__ void rms_backward_input_kernel(float *dinp, const float *dout, const float *inp, const float *weight,
                                          const float *rstd, int64_t n, int d) {
    int lane = threadIdx.x & 31;
    int64_t row = (int64_t)blockIdx.x * RMS_ROWS_PER_BLOCK + (threadIdx.x >> 5);
    if (row >= n) return;
    const float *x = inp + row * d, *g = dout + row * d;
    float s = rstd[row];
    float dot = 0.0f;
    for (int i = lane; i < d; i += 32) dot += g[i] * (weight ? weight[i] : 1.0f) * x[i];
    dot = lin_warp_sum(dot);
    float c = dot * s * s * s / (float)d;
    float *dx = dinp + row * d;
    for (int i = lane; i < d; i += 32) dx[i] += s * g[i] * (weight ? weight[i] : 1.0f) - c * x[i];
}

/* partial[p][i] = sum over rows r of part p (ascending) of dy[r][i] x[r][i] s[r] */
__global__ void rms_dweight_partial_kernel(float *partial, const float *dout, const float *inp, const float *rstd,
                                           int64_t n, int d, int64_t part_rows) {
    int i = blockIdx.y * RMS_COL_THREADS + threadIdx.x;
    if (i >= d) return;
    int64_t p = blockIdx.x, r0 = p * part_rows, r1 = r0 + part_rows < n ? r0 + part_rows : n;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; r++) acc += dout[r * d + i] * inp[r * d + i] * rstd[r];
    partial[p * d + i] = acc;
}

__global__ void rms_dweight_finish_kernel(float *dweight, const float *partial, int64_t parts, int d) {
    int i = blockIdx.x * RMS_COL_THREADS + threadIdx.x;
    if (i >= d) return;
    float acc = 0.0f;
    for (int64_t p = 0; p < parts; p++) acc += partial[p * d + i];
    dweight[i] += acc;
}

static lm_status check_shape(const lm_cuda_context *ctx, int64_t n, int d, float eps, const char *fn) {
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n < 0) return lm_error(LM_ERR_ARG, "%s: n = %lld is negative", fn, (long long)n);
    if (d < 1) return lm_error(LM_ERR_ARG, "%s: d = %d must be >= 1", fn, d);
    if (!(eps >= 0.0f)) return lm_error(LM_ERR_ARG, "%s: eps = %g must be >= 0", fn, (double)eps);
    return LM_OK;
}

static unsigned row_blocks(int64_t n) { return (unsigned)((n + RMS_ROWS_PER_BLOCK - 1) / RMS_ROWS_PER_BLOCK); }

extern "C" lm_status lm_cuda_rmsnorm_forward(const lm_cuda_context *ctx, float *out, uint16_t *out_bf16,
                                             float *rstd, const float *inp, const float *weight, int64_t n, int d,
                                             float eps) {
    const char *fn = "lm_cuda_rmsnorm_forward";
    lm_status st = check_shape(ctx, n, d, eps, fn);
    if (st || n == 0) return st;
    if (!inp) return lm_error(LM_ERR_ARG, "%s: inp is NULL", fn);
    if (!out && !out_bf16) return lm_error(LM_ERR_ARG, "%s: out and out_bf16 are both NULL", fn);
    rms_forward_kernel<<<row_blocks(n), 32 * RMS_ROWS_PER_BLOCK, 0, lin_stream(ctx)>>>(out, out_bf16, rstd, inp,
                                                                                        weight, n, d, eps);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" size_t lm_cuda_rmsnorm_scratch_floats(int64_t n, int d) {
    if (n <= 0 || d <= 0) return 0;
    return (size_t)rms_parts(n) * (size_t)d + (size_t)n;
}

extern "C" lm_status lm_cuda_rmsnorm_backward(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                              const float *dout, const float *inp, const float *weight,
                                              const float *rstd, int64_t n, int d, float eps, float *scratch) {
    const char *fn = "lm_cuda_rmsnorm_backward";
    lm_status st = check_shape(ctx, n, d, eps, fn);
    if (st || n == 0 || (!dinp && !dweight)) return st;
    if (!dout || !inp) return lm_error(LM_ERR_ARG, "%s: dout or inp is NULL", fn);
    int64_t parts = rms_parts(n);
    if (!scratch && (dweight || !rstd))
        return lm_error(LM_ERR_ARG, "%s: scratch is NULL (lm_cuda_rmsnorm_scratch_floats)", fn);
    cudaStream_t s = lin_stream(ctx);
    if (!rstd) {
        float *r = scratch + (size_t)parts * (size_t)d;
        rms_rstd_kernel<<<row_blocks(n), 32 * RMS_ROWS_PER_BLOCK, 0, s>>>(r, inp, n, d, eps);
        LM_CUDA_TRY(cudaGetLastError());
        rstd = r;
    }
    if (dinp) {
        rms_backward_input_kernel<<<row_blocks(n), 32 * RMS_ROWS_PER_BLOCK, 0, s>>>(dinp, dout, inp, weight, rstd,
                                                                                     n, d);
        LM_CUDA_TRY(cudaGetLastError());
    }
    if (dweight) {
        unsigned col_blocks = (unsigned)((d + RMS_COL_THREADS - 1) / RMS_COL_THREADS);
        dim3 grid((unsigned)parts, col_blocks);
        rms_dweight_partial_kernel<<<grid, RMS_COL_THREADS, 0, s>>>(scratch, dout, inp, rstd, n, d,
                                                                    rms_part_rows(n));
        LM_CUDA_TRY(cudaGetLastError());
        rms_dweight_finish_kernel<<<col_blocks, RMS_COL_THREADS, 0, s>>>(dweight, scratch, parts, d);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}
