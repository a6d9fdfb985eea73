/* RMSNorm on the GPU (include/longmoe/linear_cuda.h), the CUDA twin of
 * lm_rmsnorm_forward / lm_rmsnorm_backward (src/ops/linear/linear.c).
 *
 * Fast path (d <= 8192 when d % 4 == 0 and the pointers are 16-byte aligned,
 * else d <= 2048): a block of T threads holds whole rows in registers, each
 * thread VPT items of W = 4 (float4) or W = 1 floats; one read of every input
 * and one write of every output per pass. Row sums (sum of squares, the
 * backward's dot product) are fixed warp butterflies, then the warp sums are
 * added in warp order from shared memory, every thread in the same order:
 * the same bits everywhere and on every run. Statistics fp32.
 *
 * The backward is ONE pass: block p takes rows [p*R, (p+1)*R) in order,
 * writes dinp for them and keeps its share of dweight (dout * x * rstd,
 * rows ascending) in registers, written once to partial[p][:]; a second,
 * small kernel adds the partials in p order (each column by 16 fixed strided
 * groups, the group sums then added in group order). R depends on n only, so
 * the bits do not depend on the GPU's size; no float atomics. When rstd is
 * not given it is recomputed from the same registers (sum of squares beside
 * the dot product), not by another pass.
 *
 * Larger d falls back to one warp per row (scalar, any d) and a dweight pass
 * of its own, with the same fixed-order reduction of the partials. */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

#define RMS_ROWS_PER_BLOCK 8 /* warps per block of the fallback row kernels */
#define RMS_PARTS_MAX 512    /* at most this many row ranges for dweight */
#define RMS_MIN_PART_ROWS 16
#define RMS_COL_THREADS 128
#define RMS_MAX_THREADS 256 /* threads of a fast-path block */
#define RMS_MAX_VPT 8       /* items per thread of the fast path */
#define RMS_FIN_COLS 32     /* finish kernel: columns per block */
#define RMS_FIN_GROUPS 16   /* finish kernel: strided groups of partials per column */

/* Rows per dweight partial for n rows. */
static int64_t rms_part_rows(int64_t n) {
    int64_t r = (n + RMS_PARTS_MAX - 1) / RMS_PARTS_MAX;
    return r < RMS_MIN_PART_ROWS ? RMS_MIN_PART_ROWS : r;
}

static int64_t rms_parts(int64_t n) {
    int64_t r = rms_part_rows(n);
    return n > 0 ? (n + r - 1) / r : 0;
}

/* ------------------------------------------------------------ fast path */

template <int W> __device__ __forceinline__ void rms_load(float (&r)[W], const float *p) {
    if constexpr (W == 4) {
        float4 v = __ldg((const float4 *)p);
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else {
        r[0] = __ldg(p);
    }
}

/* loads of data this kernel also writes (dinp): no read-only cache path */
template <int W> __device__ __forceinline__ void rms_load_rw(float (&r)[W], const float *p) {
    if constexpr (W == 4) {
        float4 v = *(const float4 *)p;
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else {
        r[0] = *p;
    }
}

template <int W> __device__ __forceinline__ void rms_store(float *p, const float (&r)[W]) {
    if constexpr (W == 4) *(float4 *)p = make_float4(r[0], r[1], r[2], r[3]);
    else *p = r[0];
}

template <int W> __device__ __forceinline__ void rms_store_bf16(uint16_t *p, const float (&r)[W]) {
    if constexpr (W == 4) {
        uint2 v;
        v.x = (uint32_t)lin_f32_to_bf16(r[0]) | ((uint32_t)lin_f32_to_bf16(r[1]) << 16);
        v.y = (uint32_t)lin_f32_to_bf16(r[2]) | ((uint32_t)lin_f32_to_bf16(r[3]) << 16);
        *(uint2 *)p = v;
    } else {
        *p = lin_f32_to_bf16(r[0]);
    }
}

/* Sums of K values over the block, the same bits on every thread: warp
 * butterflies, then the warp sums added in warp order. sh holds 2 x K x 32
 * floats; alternate `parity` between calls so that one barrier a call is
 * enough (a warp cannot overwrite a buffer another warp still reads). */
template <int K> __device__ __forceinline__ void rms_block_sum(float (&v)[K], float *sh, int parity) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int k = 0; k < K; k++) v[k] = lin_warp_sum(v[k]);
    float *buf = sh + parity * K * 32;
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < K; k++) buf[k * 32 + warp] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; k++) {
        float s = 0.0f;
        for (int w = 0; w < nw; w++) s += buf[k * 32 + w];
        v[k] = s;
    }
}

/* Rows two at a time (ROWS = 2) when the registers allow, for more loads in
 * flight; grid-stride over row pairs. */
template <int W, int VPT, int ROWS>
__global__ void __launch_bounds__(RMS_MAX_THREADS)
    rms_forward_fast_kernel(float *out, uint16_t *out_bf16, float *rstd, const float *inp, const float *weight,
                            int64_t n, int d, float eps) {
    __shared__ float sh[2 * ROWS * 32];
    const int T = blockDim.x;
    float w[VPT][W];
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        int c = (k * T + threadIdx.x) * W;
        if (c < d && weight) rms_load<W>(w[k], weight + c);
        else {
#pragma unroll
            for (int e = 0; e < W; e++) w[k][e] = 1.0f;
        }
    }
    int parity = 0;
    for (int64_t r0 = (int64_t)blockIdx.x * ROWS; r0 < n; r0 += (int64_t)gridDim.x * ROWS, parity ^= 1) {
        float x[ROWS][VPT][W], ss[ROWS];
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            ss[q] = 0.0f;
            int64_t row = r0 + q;
#pragma unroll
            for (int k = 0; k < VPT; k++) {
                int c = (k * T + threadIdx.x) * W;
                if (row < n && c < d) rms_load<W>(x[q][k], inp + row * d + c);
                else {
#pragma unroll
                    for (int e = 0; e < W; e++) x[q][k][e] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < ROWS; q++)
#pragma unroll
            for (int k = 0; k < VPT; k++)
#pragma unroll
                for (int e = 0; e < W; e++) ss[q] += x[q][k][e] * x[q][k][e];
        rms_block_sum<ROWS>(ss, sh, parity);
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            int64_t row = r0 + q;
            if (row >= n) break;
            float s = 1.0f / sqrtf(ss[q] / (float)d + eps);
            if (rstd && threadIdx.x == 0) rstd[row] = s;
#pragma unroll
            for (int k = 0; k < VPT; k++) {
                int c = (k * T + threadIdx.x) * W;
                if (c >= d) continue;
                float y[W];
#pragma unroll
                for (int e = 0; e < W; e++) y[e] = x[q][k][e] * s * w[k][e];
                if (out) rms_store<W>(out + row * d + c, y);
                if (out_bf16) rms_store_bf16<W>(out_bf16 + row * d + c, y);
            }
        }
    }
}

/* Block p: rows [p*part_rows, ...) in order; dinp += dx for each, and
 * partial[p][:] = sum over those rows (ascending) of dout * x * rstd. */
template <int W, int VPT, int ROWS>
__global__ void __launch_bounds__(RMS_MAX_THREADS)
    rms_backward_fast_kernel(float *dinp, float *partial, const float *dout, const float *inp, const float *weight,
                             const float *rstd, int64_t n, int d, float eps, int64_t part_rows, int accumulate) {
    __shared__ float sh[2 * 2 * ROWS * 32];
    const int T = blockDim.x;
    float w[VPT][W], acc[VPT][W];
#pragma unroll
    for (int k = 0; k < VPT; k++) {
        int c = (k * T + threadIdx.x) * W;
#pragma unroll
        for (int e = 0; e < W; e++) acc[k][e] = 0.0f;
        if (c < d && weight) rms_load<W>(w[k], weight + c);
        else {
#pragma unroll
            for (int e = 0; e < W; e++) w[k][e] = 1.0f;
        }
    }
    int64_t p = blockIdx.x, rb = p * part_rows, re = rb + part_rows < n ? rb + part_rows : n;
    int parity = 0;
    for (int64_t r0 = rb; r0 < re; r0 += ROWS, parity ^= 1) {
        float x[ROWS][VPT][W], g[ROWS][VPT][W], dx[ROWS][VPT][W], red[2 * ROWS];
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            int64_t row = r0 + q;
#pragma unroll
            for (int k = 0; k < VPT; k++) {
                int c = (k * T + threadIdx.x) * W;
                if (row < re && c < d) {
                    rms_load<W>(x[q][k], inp + row * d + c);
                    rms_load<W>(g[q][k], dout + row * d + c);
                    if (dinp && accumulate) rms_load_rw<W>(dx[q][k], dinp + row * d + c);
                    else {
#pragma unroll
                        for (int e = 0; e < W; e++) dx[q][k][e] = 0.0f; /* dinp written, not added to */
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < W; e++) x[q][k][e] = g[q][k][e] = dx[q][k][e] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            float dot = 0.0f, ss = 0.0f;
#pragma unroll
            for (int k = 0; k < VPT; k++)
#pragma unroll
                for (int e = 0; e < W; e++) {
                    dot += g[q][k][e] * w[k][e] * x[q][k][e];
                    ss += x[q][k][e] * x[q][k][e];
                }
            red[2 * q] = dot, red[2 * q + 1] = ss;
        }
        rms_block_sum<2 * ROWS>(red, sh, parity);
#pragma unroll
        for (int q = 0; q < ROWS; q++) {
            int64_t row = r0 + q;
            if (row >= re) break;
            float s = rstd ? __ldg(rstd + row) : 1.0f / sqrtf(red[2 * q + 1] / (float)d + eps);
            float cc = red[2 * q] * s * s * s / (float)d;
#pragma unroll
            for (int k = 0; k < VPT; k++) {
                int c = (k * T + threadIdx.x) * W;
                if (c >= d) continue;
#pragma unroll
                for (int e = 0; e < W; e++) {
                    dx[q][k][e] += s * g[q][k][e] * w[k][e] - cc * x[q][k][e];
                    acc[k][e] += g[q][k][e] * x[q][k][e] * s;
                }
                if (dinp) rms_store<W>(dinp + row * d + c, dx[q][k]);
            }
        }
    }
    if (partial) {
#pragma unroll
        for (int k = 0; k < VPT; k++) {
            int c = (k * T + threadIdx.x) * W;
            if (c < d) rms_store<W>(partial + p * d + c, acc[k]);
        }
    }
}

/* -------------------------------------------------------- fallback path */

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
                                          const float *rstd, int64_t n, int d, int accumulate) {
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
    for (int i = lane; i < d; i += 32) {
        const float v = s * g[i] * (weight ? weight[i] : 1.0f) - c * x[i];
        dx[i] = accumulate ? dx[i] + v : v;
    }
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

/* dweight[i] += sum over p of partial[p][i]: thread (c, g) of a block adds
 * p = g, g + G, ... (ascending) for column c, then thread (c, 0) adds the G
 * group sums in group order. Fixed order, no atomics. */
__global__ void rms_dweight_finish_kernel(float *dweight, const float *partial, int64_t parts, int d) {
    __shared__ float sums[RMS_FIN_GROUPS][RMS_FIN_COLS];
    int c = threadIdx.x, g = threadIdx.y;
    int i = blockIdx.x * RMS_FIN_COLS + c;
    float acc = 0.0f;
    if (i < d)
        for (int64_t p = g; p < parts; p += RMS_FIN_GROUPS) acc += partial[p * d + i];
    sums[g][c] = acc;
    __syncthreads();
    if (g == 0 && i < d) {
        float t = 0.0f;
        for (int k = 0; k < RMS_FIN_GROUPS; k++) t += sums[k][c];
        dweight[i] += t;
    }
}

/* ------------------------------------------------------------- dispatch */

static lm_status check_shape(const lm_cuda_context *ctx, int64_t n, int d, float eps, const char *fn) {
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n < 0) return lm_error(LM_ERR_ARG, "%s: n = %lld is negative", fn, (long long)n);
    if (d < 1) return lm_error(LM_ERR_ARG, "%s: d = %d must be >= 1", fn, d);
    if (!(eps >= 0.0f)) return lm_error(LM_ERR_ARG, "%s: eps = %g must be >= 0", fn, (double)eps);
    return LM_OK;
}

static unsigned row_blocks(int64_t n) { return (unsigned)((n + RMS_ROWS_PER_BLOCK - 1) / RMS_ROWS_PER_BLOCK); }

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Fast-path shape for d: item width W (4 or 1), items per thread VPT (a
 * power of two <= RMS_MAX_VPT), threads T (a multiple of 32). 0 when d is
 * too large for the fast path. */
typedef struct {
    int W, VPT, T;
} rms_plan;

static rms_plan rms_plan_for(int d, int vec4) {
    rms_plan pl = {0, 0, 0};
    int W = vec4 ? 4 : 1;
    int64_t items = (d + W - 1) / W;
    for (int vpt = 1; vpt <= RMS_MAX_VPT; vpt *= 2)
        if (items <= (int64_t)vpt * RMS_MAX_THREADS) {
            int64_t t = (items + vpt - 1) / vpt;
            pl.W = W;
            pl.VPT = vpt;
            pl.T = (int)((t + 31) / 32 * 32);
            return pl;
        }
    return pl;
}

template <int W, int VPT>
static void rms_launch_forward(const rms_plan &pl, unsigned grid_cap, cudaStream_t s, float *out,
                               uint16_t *out_bf16, float *rstd, const float *inp, const float *weight, int64_t n,
                               int d, float eps) {
    constexpr int ROWS = VPT <= 2 ? 2 : 1;
    int64_t steps = (n + ROWS - 1) / ROWS;
    unsigned grid = (unsigned)(steps < (int64_t)grid_cap ? steps : (int64_t)grid_cap);
    rms_forward_fast_kernel<W, VPT, ROWS><<<grid, pl.T, 0, s>>>(out, out_bf16, rstd, inp, weight, n, d, eps);
}

template <int W, int VPT>
static void rms_launch_backward(const rms_plan &pl, int64_t parts, cudaStream_t s, float *dinp, float *partial,
                                const float *dout, const float *inp, const float *weight, const float *rstd,
                                int64_t n, int d, float eps, int64_t part_rows, int accumulate) {
    constexpr int ROWS = VPT <= 2 ? 2 : 1;
    rms_backward_fast_kernel<W, VPT, ROWS>
        <<<(unsigned)parts, pl.T, 0, s>>>(dinp, partial, dout, inp, weight, rstd, n, d, eps, part_rows, accumulate);
}

#define RMS_DISPATCH(W, fn, ...)                                                                                     \
    switch (pl.VPT) {                                                                                                \
    case 1: fn<W, 1>(__VA_ARGS__); break;                                                                            \
    case 2: fn<W, 2>(__VA_ARGS__); break;                                                                            \
    case 4: fn<W, 4>(__VA_ARGS__); break;                                                                            \
    default: fn<W, 8>(__VA_ARGS__); break;                                                                           \
    }

extern "C" lm_status lm_cuda_rmsnorm_forward(const lm_cuda_context *ctx, float *out, uint16_t *out_bf16,
                                             float *rstd, const float *inp, const float *weight, int64_t n, int d,
                                             float eps) {
    const char *fn = "lm_cuda_rmsnorm_forward";
    lm_status st = check_shape(ctx, n, d, eps, fn);
    if (st || n == 0) return st;
    if (!inp) return lm_error(LM_ERR_ARG, "%s: inp is NULL", fn);
    if (!out && !out_bf16) return lm_error(LM_ERR_ARG, "%s: out and out_bf16 are both NULL", fn);
    cudaStream_t s = lin_stream(ctx);
    int vec4 = d % 4 == 0 && aligned16(inp) && (!weight || aligned16(weight)) && (!out || aligned16(out)) &&
               (!out_bf16 || ((uintptr_t)out_bf16 & 7u) == 0);
    rms_plan pl = rms_plan_for(d, vec4);
    if (pl.VPT) {
        /* enough blocks for several per multiprocessor, grid-stride beyond */
        unsigned cap = (unsigned)((ctx->sm_count > 0 ? ctx->sm_count : 132) * (2048 / pl.T));
        if (pl.W == 4) {
            RMS_DISPATCH(4, rms_launch_forward, pl, cap, s, out, out_bf16, rstd, inp, weight, n, d, eps);
        } else {
            RMS_DISPATCH(1, rms_launch_forward, pl, cap, s, out, out_bf16, rstd, inp, weight, n, d, eps);
        }
    } else {
        rms_forward_kernel<<<row_blocks(n), 32 * RMS_ROWS_PER_BLOCK, 0, s>>>(out, out_bf16, rstd, inp, weight, n,
                                                                              d, eps);
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" size_t lm_cuda_rmsnorm_scratch_floats(int64_t n, int d) {
    if (n <= 0 || d <= 0) return 0;
    return (size_t)rms_parts(n) * (size_t)d + (size_t)n;
}

static lm_status rmsnorm_backward(const lm_cuda_context *ctx, float *dinp, float *dweight, const float *dout,
                                  const float *inp, const float *weight, const float *rstd, int64_t n, int d,
                                  float eps, float *scratch, int accumulate, const char *fn) {
    lm_status st = check_shape(ctx, n, d, eps, fn);
    if (st || n == 0 || (!dinp && !dweight)) return st;
    if (!dout || !inp) return lm_error(LM_ERR_ARG, "%s: dout or inp is NULL", fn);
    int64_t parts = rms_parts(n), part_rows = rms_part_rows(n);
    if (!scratch && (dweight || !rstd))
        return lm_error(LM_ERR_ARG, "%s: scratch is NULL (lm_cuda_rmsnorm_scratch_floats)", fn);
    cudaStream_t s = lin_stream(ctx);
    int vec4 = d % 4 == 0 && aligned16(inp) && aligned16(dout) && (!weight || aligned16(weight)) &&
               (!dinp || aligned16(dinp)) && (!dweight || aligned16(scratch));
    rms_plan pl = rms_plan_for(d, vec4);
    float *partial = dweight ? scratch : NULL;
    if (pl.VPT) {
        if (pl.W == 4) {
            RMS_DISPATCH(4, rms_launch_backward, pl, parts, s, dinp, partial, dout, inp, weight, rstd, n, d, eps,
                         part_rows, accumulate);
        } else {
            RMS_DISPATCH(1, rms_launch_backward, pl, parts, s, dinp, partial, dout, inp, weight, rstd, n, d, eps,
                         part_rows, accumulate);
        }
        LM_CUDA_TRY(cudaGetLastError());
    } else {
        if (!rstd) {
            float *r = scratch + (size_t)parts * (size_t)d;
            rms_rstd_kernel<<<row_blocks(n), 32 * RMS_ROWS_PER_BLOCK, 0, s>>>(r, inp, n, d, eps);
            LM_CUDA_TRY(cudaGetLastError());
            rstd = r;
        }
        if (dinp) {
            rms_backward_input_kernel<<<row_blocks(n), 32 * RMS_ROWS_PER_BLOCK, 0, s>>>(dinp, dout, inp, weight,
                                                                                         rstd, n, d, accumulate);
            LM_CUDA_TRY(cudaGetLastError());
        }
        if (dweight) {
            unsigned col_blocks = (unsigned)((d + RMS_COL_THREADS - 1) / RMS_COL_THREADS);
            dim3 grid((unsigned)parts, col_blocks);
            rms_dweight_partial_kernel<<<grid, RMS_COL_THREADS, 0, s>>>(scratch, dout, inp, rstd, n, d, part_rows);
            LM_CUDA_TRY(cudaGetLastError());
        }
    }
    if (dweight) {
        dim3 block(RMS_FIN_COLS, RMS_FIN_GROUPS);
        unsigned grid = (unsigned)((d + RMS_FIN_COLS - 1) / RMS_FIN_COLS);
        rms_dweight_finish_kernel<<<grid, block, 0, s>>>(dweight, scratch, parts, d);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_rmsnorm_backward(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                              const float *dout, const float *inp, const float *weight,
                                              const float *rstd, int64_t n, int d, float eps, float *scratch) {
    return rmsnorm_backward(ctx, dinp, dweight, dout, inp, weight, rstd, n, d, eps, scratch, 1,
                            "lm_cuda_rmsnorm_backward");
}

extern "C" lm_status lm_cuda_rmsnorm_backward_set(const lm_cuda_context *ctx, float *dinp, float *dweight,
                                                  const float *dout, const float *inp, const float *weight,
                                                  const float *rstd, int64_t n, int d, float eps, float *scratch) {
    return rmsnorm_backward(ctx, dinp, dweight, dout, inp, weight, rstd, n, d, eps, scratch, 0,
                            "lm_cuda_rmsnorm_backward_set");
}
