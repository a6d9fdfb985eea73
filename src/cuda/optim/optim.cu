/* Elementwise optimizer kernels and the deterministic sum of squares
 * (src/cuda/optim/optim_internal.h; docs/optim.md, "On a backend").
 *
 * The library is compiled with --use_fast_math, which would contract a*b + c
 * into FMAs and replace division and square root by approximations. The
 * update rules here spell every fp32 operation with its IEEE round-to-nearest
 * intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn), so each step
 * rounds as the C source of src/train/optim.c reads. Double arithmetic is not
 * affected by the flag. */
#include <math.h>
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/optim/optim_internal.h"

#define OPT_THREADS 256
#define SUMSQ_THREADS 512

static cudaStream_t stream_of(const lm_cuda_context *ctx) { return (cudaStream_t)ctx->stream; }

/* enough blocks of `threads` to cover n with a grid-stride loop, at most 8 per SM */
static unsigned grid_for(const lm_cuda_context *ctx, size_t n, int threads) {
    size_t want = (n + (size_t)threads - 1) / (size_t)threads;
    size_t cap = (size_t)(ctx->sm_count > 0 ? ctx->sm_count : 132) * 8;
    if (want > cap) want = cap;
    return (unsigned)(want ? want : 1);
}

/* ---- sum of squares ---- */

/* Fixed tree over the block's SUMSQ_THREADS doubles in shared memory. */
__device__ static double block_tree_sum(double *sh, double v) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = SUMSQ_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    return sh[0];
}

/* part[b] = sum over i = (k * PARTS + b) * THREADS + t of x[i]^2, each
 * thread in ascending k, then the block's fixed tree. */
__global__ static void sumsq_parts_kernel(const float *x, size_t n, double *part) {
    __shared__ double sh[SUMSQ_THREADS];
    double s = 0.0;
    const size_t stride = (size_t)LM_CUDA_SUMSQ_PARTS * SUMSQ_THREADS;
    for (size_t i = (size_t)blockIdx.x * SUMSQ_THREADS + threadIdx.x; i < n; i += stride) {
        double v = (double)x[i];
        s += v * v;
    }
    double t = block_tree_sum(sh, s);
    if (threadIdx.x == 0) part[blockIdx.x] = t;
}

__global__ static void sumsq_final_kernel(const double *part, double *out) {
    __shared__ double sh[SUMSQ_THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < LM_CUDA_SUMSQ_PARTS; i += SUMSQ_THREADS) s += part[i];
    double t = block_tree_sum(sh, s);
    if (threadIdx.x == 0) *out = t;
}

lm_status lm_cuda_sum_squares(const lm_cuda_context *ctx, const float *x, size_t n, double *partials,
                                         double *out) {
    if (!ctx || !out || !partials || (n && !x)) return lm_error(LM_ERR_ARG, "sum_squares: a pointer is NULL");
    /* n == 0 runs too: every part is 0, *out = 0 */
    sumsq_parts_kernel<<<LM_CUDA_SUMSQ_PARTS, SUMSQ_THREADS, 0, stream_of(ctx)>>>(x, n, partials);
    LM_CUDA_TRY(cudaGetLastError());
    sumsq_final_kernel<<<1, SUMSQ_THREADS, 0, stream_of(ctx)>>>(partials, out);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* ---- scaling ---- */

__global__ static void scale_kernel(float *x, size_t n, float s) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], s);
}

__global__ static void scale_exact_kernel(float *x, size_t n, double f) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = (float)((double)x[i] * f);
}

lm_status lm_cuda_scale(const lm_cuda_context *ctx, float *x, size_t n, float s) {
    if (!ctx || (n && !x)) return lm_error(LM_ERR_ARG, "scale: x is NULL");
    if (!n) return LM_OK;
    scale_kernel<<<grid_for(ctx, n, OPT_THREADS), OPT_THREADS, 0, stream_of(ctx)>>>(x, n, s);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_scale_exact(const lm_cuda_context *ctx, float *x, size_t n, double f) {
    if (!ctx || (n && !x)) return lm_error(LM_ERR_ARG, "scale_exact: x is NULL");
    if (!n) return LM_OK;
    scale_exact_kernel<<<grid_for(ctx, n, OPT_THREADS), OPT_THREADS, 0, stream_of(ctx)>>>(x, n, f);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* ---- AdamW ---- */

/* src/train/optim.c's lm_adamw_update, operation by operation:
 *   m = b1 m + (1-b1) g;  v = b2 v + ((1-b2) g) g
 *   w -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * w) */
__global__ static void adamw_kernel(float *w, const float *g, float *m, float *v, size_t n, float lr, float b1,
                                    float b2, float omb1, float omb2, float bc1, float bc2, float eps, float wd) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float gi = g[i], wi = w[i];
        float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi));
        float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
        m[i] = mi;
        v[i] = vi;
        float mhat = __fdiv_rn(mi, bc1), vhat = __fdiv_rn(vi, bc2);
        float upd = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), eps)), __fmul_rn(wd, wi));
        w[i] = __fadd_rn(wi, -__fmul_rn(lr, upd));
    }
}

lm_status lm_cuda_adamw_update(const lm_cuda_context *ctx, float *w, const float *g, float *m, float *v,
                                          int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                                          int64_t t) {
    if (!ctx || n < 0 || (n && (!w || !g || !m || !v)))
        return lm_error(LM_ERR_ARG, "adamw_update: n %lld with a NULL array", (long long)n);
    if (t < 1) return lm_error(LM_ERR_ARG, "adamw_update: step %lld must be >= 1", (long long)t);
    if (!n) return LM_OK;
    /* the bias corrections exactly as the CPU computes them (host double pow) */
    float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
    float omb1 = 1.0f - beta1, omb2 = 1.0f - beta2;
    adamw_kernel<<<grid_for(ctx, (size_t)n, OPT_THREADS), OPT_THREADS, 0, stream_of(ctx)>>>(
        w, g, m, v, (size_t)n, lr, beta1, beta2, omb1, omb2, bc1, bc2, eps, wd);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
