/* The CUDA backend's own small kernels (src/cuda/backend/backend_internal.h):
 * elementwise GLU and gate ops with the CPU backend's formulas, the LM head's
 * target logit, the router entropy and the first non-finite index. */
#include <math.h>
#include <stdint.h>

#include "cuda/backend/backend_internal.h"
#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/moe.h"

#define BK_THREADS 256

/* sigmoid, stable for any finite x (lm_sigmoidf's two branches) */
__device__ __forceinline__ float bk_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
}

/* h = act(a, u): SwiGLU silu(a) u, or SiTU-GLU 4 tanh(a/4) sigmoid(a) 25 tanh(u/25) */
__device__ __forceinline__ float bk_act(int act, float a, float u) {
    if (act == LM_EXPERT_SITU_GLU) return 4.0f * tanhf(0.25f * a) * bk_sigmoid(a) * 25.0f * tanhf(u * 0.04f);
    return a * bk_sigmoid(a) * u;
}

__global__ void bk_glu_forward_kernel(int act, float *h, uint16_t *h_bf16, const float *a, const float *u,
                                      size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = bk_act(act, a[i], u[i]);
        if (h) h[i] = v;
        if (h_bf16) h_bf16[i] = lin_f32_to_bf16(v);
    }
}

__global__ void bk_glu_backward_kernel(int act, float *da, float *du, uint16_t *da_bf16, uint16_t *du_bf16,
                                       const float *dh, const float *a, const float *u, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = a[i], y = u[i], sg = bk_sigmoid(x), ha, hu;
        if (act == LM_EXPERT_SITU_GLU) {
            float ta = tanhf(0.25f * x), tu = tanhf(y * 0.04f);
            float fa = 4.0f * ta * sg, gu = 25.0f * tu;
            /* d/da [4 tanh(a/4) sigma(a)] = (1 - tanh^2) sigma + 4 tanh sigma (1 - sigma) */
            ha = ((1.0f - ta * ta) * sg + fa * (1.0f - sg)) * gu;
            hu = fa * (1.0f - tu * tu);
        } else {
            ha = y * sg * (1.0f + x * (1.0f - sg));
            hu = x * sg;
        }
        float g = dh[i], ga = g * ha, gu = g * hu;
        if (da) da[i] = ga;
        if (du) du[i] = gu;
        if (da_bf16) da_bf16[i] = lin_f32_to_bf16(ga);
        if (du_bf16) du_bf16[i] = lin_f32_to_bf16(gu);
    }
}

__global__ void bk_gate_forward_kernel(float *gated, uint16_t *gated_bf16, const float *gp, const uint16_t *o,
                                       size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = bk_sigmoid(gp[i]) * lin_bf16_to_f32(o[i]);
        if (gated) gated[i] = v;
        if (gated_bf16) gated_bf16[i] = lin_f32_to_bf16(v);
    }
}

__global__ void bk_gate_backward_kernel(uint16_t *d_o, float *dgp, uint16_t *dgp_bf16, const float *dgated,
                                        const float *gp, const uint16_t *o, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float s = bk_sigmoid(gp[i]), g = dgated[i];
        float ov = lin_bf16_to_f32(o[i]);
        float v = g * ov * s * (1.0f - s);
        d_o[i] = lin_f32_to_bf16(g * s);
        if (dgp) dgp[i] = v;
        if (dgp_bf16) dgp_bf16[i] = lin_f32_to_bf16(v);
    }
}

/* one warp per row: lane l sums columns l, l + 32, ...; then a fixed butterfly */
__global__ void bk_target_logit_kernel(float *target_logit, const uint16_t *hn, const uint16_t *head,
                                       const int32_t *targets, int64_t n, int d) {
    int64_t r = (int64_t)blockIdx.x * (BK_THREADS / 32) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (r >= n) return; /* the whole warp leaves together */
    const uint16_t *x = hn + r * d, *w = head + (int64_t)targets[r] * d;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) acc += lin_bf16_to_f32(x[c]) * lin_bf16_to_f32(w[c]);
    acc = lin_warp_sum(acc);
    if (lane == 0) target_logit[r] = acc;
}

/* one thread per token, experts in order j = 0..n-1 as on the CPU */
__global__ void bk_router_entropy_kernel(float *ent, const float *scores, int64_t m, int n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (int64_t)gridDim.x * blockDim.x) {
        const float *si = scores + i * n;
        float sum = 0.0f, slog = 0.0f;
        int ok = 1;
        for (int j = 0; j < n; j++) {
            float v = si[j];
            ok &= v >= 0.0f && v <= 1.0f; /* false for NaN too */
            sum += v;
            slog += v > 0.0f ? v * logf(v) : 0.0f;
        }
        ent[i] = !ok ? __int_as_float(0x7fc00000) : sum > 0.0f ? logf(sum) - slog / sum : 0.0f;
    }
}

/* The same entropy per token, summed in fixed point: e * 2^32 rounded to an
 * integer (exact for e a multiple of 2^-32, every e >= 2^-9), added in int64.
 * Integer sums do not depend on the order of the additions, so the blocks'
 * atomic adds give the same bits every run. A token with a score outside
 * [0, 1] or not finite adds nothing and lowers *bad to key | i at most.
 * Thread t of a block takes token base + t; its scores come through shared
 * memory ENT_COLS columns at a time, read by the block row after row (each
 * row's columns by neighbouring threads: coalesced; one thread a row read
 * rows n floats apart), and each token's arithmetic is the same sequence as
 * bk_router_entropy_kernel's. */
#define ENT_COLS 32
__global__ void __launch_bounds__(BK_THREADS)
bk_router_entropy_sum_kernel(unsigned long long *sum, unsigned long long *bad, const float *scores, int64_t m, int n,
                             unsigned long long key) {
    __shared__ float tile[BK_THREADS][ENT_COLS + 1];
    __shared__ long long part[BK_THREADS / 32];
    long long acc = 0;
    for (int64_t base = (int64_t)blockIdx.x * BK_THREADS; base < m; base += (int64_t)gridDim.x * BK_THREADS) {
        const int64_t i = base + threadIdx.x;
        const int rows = m - base < BK_THREADS ? (int)(m - base) : BK_THREADS;
        float sum_s = 0.0f, slog = 0.0f;
        int ok = 1;
        for (int j0 = 0; j0 < n; j0 += ENT_COLS) {
            const int cols = n - j0 < ENT_COLS ? n - j0 : ENT_COLS;
            __syncthreads(); /* the last columns' reads are done */
            for (int q = threadIdx.x; q < rows * cols; q += BK_THREADS) {
                const int r = q / cols, c = q - r * cols;
                tile[r][c] = scores[(base + r) * n + j0 + c];
            }
            __syncthreads();
            if (i < m)
                for (int c = 0; c < cols; c++) {
                    const float v = tile[threadIdx.x][c];
                    ok &= v >= 0.0f && v <= 1.0f; /* false for NaN too */
                    sum_s += v;
                    slog += v > 0.0f ? v * logf(v) : 0.0f;
                }
        }
        if (i >= m) continue;
        if (!ok) {
            atomicMin(bad, key | (unsigned long long)i);
            continue;
        }
        float e = sum_s > 0.0f ? logf(sum_s) - slog / sum_s : 0.0f;
        acc += __float2ll_rn(e * 4294967296.0f);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long t = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) t += part[w];
        if (t) atomicAdd(sum, (unsigned long long)t); /* two's complement: a negative t subtracts */
    }
}

__global__ void bk_fill_u64_kernel(unsigned long long *p, unsigned long long v) { *p = v; }

__global__ void bk_first_nonfinite_kernel(unsigned long long *first, const float *x, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        if (!isfinite(x[i])) atomicMin(first, (unsigned long long)i);
}

/* *slot = min(*slot, base + the first non-finite index of x) (16-byte rows when x is aligned) */
__global__ void bk_note_nonfinite_kernel(unsigned long long *slot, const float *x, size_t n, unsigned long long base) {
    const size_t n4 = ((uintptr_t)x & 15) == 0 ? n / 4 : 0, stride = (size_t)gridDim.x * blockDim.x;
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 v = x4[i];
        if (isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w)) continue;
        const size_t j = 4 * i + (!isfinite(v.x) ? 0 : !isfinite(v.y) ? 1 : !isfinite(v.z) ? 2 : 3);
        atomicMin(slot, base + (unsigned long long)j);
    }
    for (size_t i = 4 * n4 + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        if (!isfinite(x[i])) atomicMin(slot, base + (unsigned long long)i);
}

static lm_status bk_check(const lm_cuda_context *ctx, const char *fn) {
    if (!ctx || !ctx->stream) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    return LM_OK;
}

lm_status lm_cuda_backend_glu_forward(const lm_cuda_context *ctx, int act, float *h, uint16_t *h_bf16,
                                                   const float *a, const float *u, size_t n) {
    lm_status st = bk_check(ctx, "glu_forward");
    if (st || n == 0) return st;
    if (act != LM_EXPERT_SWIGLU && act != LM_EXPERT_SITU_GLU)
        return lm_error(LM_ERR_ARG, "glu_forward: act = %d is not an expert activation", act);
    if (!a || !u || (!h && !h_bf16)) return lm_error(LM_ERR_ARG, "glu_forward: a, u or both outputs are NULL");
    bk_glu_forward_kernel<<<lin_grid_for(ctx, n, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(act, h, h_bf16, a,
                                                                                                 u, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_glu_backward(const lm_cuda_context *ctx, int act, float *da, float *du,
                                                    uint16_t *da_bf16, uint16_t *du_bf16, const float *dh,
                                                    const float *a, const float *u, size_t n) {
    lm_status st = bk_check(ctx, "glu_backward");
    if (st || n == 0) return st;
    if (act != LM_EXPERT_SWIGLU && act != LM_EXPERT_SITU_GLU)
        return lm_error(LM_ERR_ARG, "glu_backward: act = %d is not an expert activation", act);
    if ((!da && !da_bf16) || (!du && !du_bf16) || !dh || !a || !u)
        return lm_error(LM_ERR_ARG, "glu_backward: an input, or both outputs of da or of du, are NULL");
    bk_glu_backward_kernel<<<lin_grid_for(ctx, n, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(
        act, da, du, da_bf16, du_bf16, dh, a, u, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_gate_forward(const lm_cuda_context *ctx, float *gated, uint16_t *gated_bf16,
                                                    const float *gp, const uint16_t *o, size_t n) {
    lm_status st = bk_check(ctx, "gate_forward");
    if (st || n == 0) return st;
    if (!gp || !o || (!gated && !gated_bf16))
        return lm_error(LM_ERR_ARG, "gate_forward: gate_logits, o or both outputs are NULL");
    bk_gate_forward_kernel<<<lin_grid_for(ctx, n, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(gated, gated_bf16,
                                                                                                  gp, o, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_gate_backward(const lm_cuda_context *ctx, uint16_t *d_o, float *dgp,
                                                     uint16_t *dgp_bf16, const float *dgated, const float *gp,
                                                     const uint16_t *o, size_t n) {
    lm_status st = bk_check(ctx, "gate_backward");
    if (st || n == 0) return st;
    if (!d_o || (!dgp && !dgp_bf16) || !dgated || !gp || !o)
        return lm_error(LM_ERR_ARG, "gate_backward: an input, d_o, or both outputs of dgp are NULL");
    bk_gate_backward_kernel<<<lin_grid_for(ctx, n, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(
        d_o, dgp, dgp_bf16, dgated, gp, o, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_target_logit(const lm_cuda_context *ctx, float *target_logit,
                                                    const uint16_t *hn, const uint16_t *head, const int32_t *targets,
                                                    int64_t n, int d) {
    lm_status st = bk_check(ctx, "target_logit");
    if (st || n <= 0) return st;
    const int rows_per_block = BK_THREADS / 32;
    int64_t blocks = (n + rows_per_block - 1) / rows_per_block;
    if (blocks > INT32_MAX) return lm_error(LM_ERR_ARG, "target_logit: n = %lld too large", (long long)n);
    bk_target_logit_kernel<<<(unsigned)blocks, BK_THREADS, 0, lin_stream(ctx)>>>(target_logit, hn, head, targets, n,
                                                                                  d);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_router_entropy(const lm_cuda_context *ctx, float *ent, const float *scores,
                                                      int64_t m, int n) {
    lm_status st = bk_check(ctx, "router_entropy");
    if (st || m <= 0) return st;
    bk_router_entropy_kernel<<<lin_grid_for(ctx, (size_t)m, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(ent, scores,
                                                                                                            m, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_router_entropy_sum(const lm_cuda_context *ctx, unsigned long long *sum,
                                             unsigned long long *bad, const float *scores, int64_t m, int n,
                                             unsigned long long key) {
    lm_status st = bk_check(ctx, "router_entropy_sum");
    if (st || m <= 0) return st;
    if (m > (int64_t)UINT32_MAX) return lm_error(LM_ERR_ARG, "router_entropy_sum: m = %lld too large", (long long)m);
    bk_router_entropy_sum_kernel<<<lin_grid_for(ctx, (size_t)m, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(
        sum, bad, scores, m, n, key);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_first_nonfinite(const lm_cuda_context *ctx, unsigned long long *first_device,
                                                       const float *x, size_t n) {
    lm_status st = bk_check(ctx, "first_nonfinite");
    if (st) return st;
    cudaStream_t s = lin_stream(ctx);
    bk_fill_u64_kernel<<<1, 1, 0, s>>>(first_device, (unsigned long long)n);
    LM_CUDA_TRY(cudaGetLastError());
    if (n == 0) return LM_OK;
    bk_first_nonfinite_kernel<<<lin_grid_for(ctx, n, BK_THREADS), BK_THREADS, 0, s>>>(first_device, x, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

lm_status lm_cuda_backend_note_nonfinite(const lm_cuda_context *ctx, unsigned long long *slot_device, const float *x,
                                         size_t n, unsigned long long base) {
    lm_status st = bk_check(ctx, "note_nonfinite");
    if (st || n == 0) return st;
    bk_note_nonfinite_kernel<<<lin_grid_for(ctx, (n + 3) / 4, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(
        slot_device, x, n, base);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

__global__ void bk_accumulate_kernel(float *acc, const float *x, const uint16_t *x_bf16, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc[i] += x ? x[i] : lin_bf16_to_f32(x_bf16[i]);
}

lm_status lm_cuda_backend_accumulate(const lm_cuda_context *ctx, float *acc, const void *x, size_t n, int lp) {
    lm_status st = bk_check(ctx, "accumulate");
    if (st || n == 0) return st;
    if (!acc || !x) return lm_error(LM_ERR_ARG, "accumulate: acc or x is NULL");
    bk_accumulate_kernel<<<lin_grid_for(ctx, n, BK_THREADS), BK_THREADS, 0, lin_stream(ctx)>>>(
        acc, lp ? NULL : (const float *)x, lp ? (const uint16_t *)x : NULL, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
