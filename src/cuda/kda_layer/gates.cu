/* The KDA layer's gates on the GPU (include/longmoe/kda_layer_cuda.h): the
 * sigmoid of beta, and the output stage gate ⊙ RMSNorm(o) with its backward
 * (the CPU formulas of lm_kda_layer_forward/backward, src/model/kda_layer.c,
 * and lm_rmsnorm_*, src/ops/linear/linear.c). */
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/kda_layer/kda_layer_common.cuh"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/kda_layer_cuda.h"

#define ELEM_THREADS 256
/* do_norm: each warp of the backward sums at least NORM_MIN_ROWS rows of K
 * values; at most NORM_MAX_CHUNKS partials per channel (enough warps to keep
 * the memory busy: 8192 warps are several waves over 132 multiprocessors) */
#define NORM_MIN_ROWS 16
#define NORM_MAX_CHUNKS 8192

__global__ void sigmoid_forward_kernel(float *out, const float *in, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = kl_sigmoid(in[i]);
}

__global__ void sigmoid_backward_kernel(float *din, const float *dout, const float *out, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float y = out[i];
        din[i] = dout[i] * y * (1.0f - y);
    }
}

/* 1/rms of a row held by a warp, per-lane values x[0..per). */
__device__ __forceinline__ float row_rstd(const float *x, int per, int K, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        ss += x[j] * x[j];
    }
    ss = kl_warp_sum(ss);
    return 1.0f / sqrtf(ss / (float)K + eps);
}

/* One warp per (token, head) row r of K values (element r*K + k). */
__global__ void output_forward_kernel(uint16_t *gated, float *o_rstd, float *gate,
                                      const uint16_t *o, const float *gate_logits,
                                      const float *o_norm, int K, float eps, int64_t rows) {
    int64_t row = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31, per = K / 32;
    float x[KL_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        x[j] = kl_bf16_to_f32(o[row * K + j * 32 + lane]);
    }
    const float s = row_rstd(x, per, K, eps);
    if (lane == 0) o_rstd[row] = s;
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        const int k = j * 32 + lane;
        const int64_t e = row * K + k;
        float gt = kl_sigmoid(gate_logits[e]);
        gate[e] = gt;
        gated[e] = kl_f32_to_bf16(x[j] * s * o_norm[k] * gt);
    }
}

/* One warp per chunk of rows [c*R, (c+1)*R), in order, two rows' loads in
 * flight at a time; per row: dgate_logits = d_gated n gate (1 - gate) with
 * n = o rstd o_norm (into fp32 and/or bf16, the same value rounded as
 * lm_cuda_f32_to_bf16 rounds); dn = d_gated gate; the RMSNorm backward
 * d_o = s (dn w) - x s^3/K sum_j (dn_j w_j x_j); and, in the same pass, the
 * lane's share of do_norm: partial[c][k] = sum over the chunk's rows (in
 * order) of dn[r,k] o[r,k] rstd[r]. One read of every input, one write of
 * every output. */
template <int PER>
__global__ void __launch_bounds__(KL_ROW_WARPS * 32)
    output_backward_kernel(uint16_t *d_o_bf16, float *d_o_f32, float *dgate_logits,
                                       uint16_t *dgate_bf16, int64_t ld_dg, float *partial, const float *d_gated,
                                       const uint16_t *o, const float *o_rstd, const float *gate,
                                       const float *o_norm, int H, int K, float eps, int64_t rows,
                                       int64_t rows_per_chunk, int64_t chunks) {
    const int64_t chunk = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (chunk >= chunks) return; /* whole warps leave together */
    const int lane = threadIdx.x & 31, per = PER; /* K / 32 */
    const int64_t r0 = chunk * rows_per_chunk;
    const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float w[PER], acc[PER];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        acc[j] = 0.0f;
        w[j] = j < per ? o_norm[j * 32 + lane] : 0.0f;
    }
    for (int64_t rb = r0; rb < r1; rb += 2) {
        float x[2][PER], dg[2][PER], gt[2][PER];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int64_t row = rb + q < r1 ? rb + q : rb;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                if (j >= per) break;
                const int64_t e = row * K + j * 32 + lane;
                x[q][j] = kl_bf16_to_f32(o[e]);
                dg[q][j] = d_gated[e];
                gt[q][j] = gate[e];
            }
        }
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const int64_t row = rb + q;
            if (row >= r1) break;
            const float s = o_rstd ? o_rstd[row] : row_rstd(x[q], per, K, eps);
            /* dgate_bf16's rows (tokens) are ld_dg elements apart: head h of token t at t ld_dg + h K */
            const int64_t gbase = (row / H) * ld_dg + (row % H) * K;
            float dn[PER];
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                if (j >= per) break;
                const int64_t e = row * K + j * 32 + lane;
                const float n = x[q][j] * s * w[j];
                const float dgl = dg[q][j] * n * gt[q][j] * (1.0f - gt[q][j]);
                if (dgate_logits) dgate_logits[e] = dgl;
                if (dgate_bf16) dgate_bf16[gbase + j * 32 + lane] = lin_f32_to_bf16(dgl);
                dn[j] = dg[q][j] * gt[q][j];
                dot += dn[j] * w[j] * x[q][j];
                acc[j] += dn[j] * x[q][j] * s;
            }
            dot = kl_warp_sum(dot);
            const float c = dot * s * s * s / (float)K;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                if (j >= per) break;
                const int64_t e = row * K + j * 32 + lane;
                const float d = s * dn[j] * w[j] - c * x[q][j];
                if (d_o_f32) d_o_f32[e] = d;
                if (d_o_bf16) d_o_bf16[e] = kl_f32_to_bf16(d);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < PER; j++) {
        if (j >= per) break;
        partial[chunk * K + j * 32 + lane] = acc[j];
    }
}

static int64_t norm_chunks(int64_t rows) { return kl_chunks(rows, NORM_MIN_ROWS, NORM_MAX_CHUNKS); }

static lm_status check_output_shape(const char *fn, int64_t N, int H, int K) {
    if (N < 1 || H < 1) return lm_error(LM_ERR_ARG, "%s: N=%lld H=%d must be >= 1", fn, (long long)N, H);
    if (K < 32 || K % 32 || K > LM_KDA_LAYER_CUDA_MAX_HEAD_DIM)
        return lm_error(LM_ERR_ARG, "%s: K=%d must be a multiple of 32 in [32, %d]", fn, K,
                        LM_KDA_LAYER_CUDA_MAX_HEAD_DIM);
    return LM_OK;
}

extern "C" lm_status lm_cuda_sigmoid_forward(const lm_cuda_context *ctx, float *out,
                                             const float *in, size_t n) {
    if (!ctx) return lm_error(LM_ERR_ARG, "sigmoid_forward: ctx is NULL");
    if (!out || !in) return lm_error(LM_ERR_ARG, "sigmoid_forward: out and in are required");
    if (n == 0) return LM_OK;
    sigmoid_forward_kernel<<<kl_blocks((int64_t)n, ELEM_THREADS), ELEM_THREADS, 0,
                             (cudaStream_t)ctx->stream>>>(out, in, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_sigmoid_backward(const lm_cuda_context *ctx, float *din,
                                              const float *dout, const float *out, size_t n) {
    if (!ctx) return lm_error(LM_ERR_ARG, "sigmoid_backward: ctx is NULL");
    if (!din || !dout || !out)
        return lm_error(LM_ERR_ARG, "sigmoid_backward: din, dout and out are required");
    if (n == 0) return LM_OK;
    sigmoid_backward_kernel<<<kl_blocks((int64_t)n, ELEM_THREADS), ELEM_THREADS, 0,
                              (cudaStream_t)ctx->stream>>>(din, dout, out, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_kda_output_forward(const lm_cuda_context *ctx, uint16_t *gated_bf16,
                                                float *o_rstd, float *gate, const uint16_t *o,
                                                const float *gate_logits, const float *o_norm,
                                                int64_t N, int H, int K, float eps) {
    // o, gate_logits, gate, gated_bf16 are (N,H,K); o_rstd is (N,H); o_norm is (K)
    const char *fn = "kda_output_forward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (!gated_bf16 || !o_rstd || !gate || !o || !gate_logits || !o_norm)
        return lm_error(LM_ERR_ARG, "%s: gated_bf16, o_rstd, gate, o, gate_logits and o_norm are required", fn);
    lm_status st = check_output_shape(fn, N, H, K);
    if (st) return st;
    const int64_t rows = N * H;
    output_forward_kernel<<<kl_blocks(rows, KL_ROW_WARPS), KL_ROW_WARPS * 32, 0,
                            (cudaStream_t)ctx->stream>>>(gated_bf16, o_rstd, gate, o, gate_logits,
                                                         o_norm, K, eps, rows);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" size_t lm_cuda_kda_output_backward_scratch_bytes(int64_t N, int H, int K) {
    if (N < 1 || H < 1 || K < 1) return 0;
    return (size_t)norm_chunks(N * H) * (size_t)K * sizeof(float);
}

extern "C" lm_status lm_cuda_kda_output_backward(const lm_cuda_context *ctx, uint16_t *d_o_bf16,
                                                 float *d_o_f32, float *dgate_logits,
                                                 uint16_t *dgate_bf16, int64_t ld_dgate_bf16, float *do_norm,
                                                 const float *d_gated,
                                                 const uint16_t *o, const float *o_rstd,
                                                 const float *gate, const float *o_norm, int64_t N,
                                                 int H, int K, float eps, void *scratch) {
    // d_gated, o, gate, dgate_logits, d_o are (N,H,K); o_rstd is (N,H); o_norm, do_norm are (K)
    const char *fn = "kda_output_backward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (!d_o_bf16 && !d_o_f32) return lm_error(LM_ERR_ARG, "%s: d_o_bf16 or d_o_f32 is required", fn);
    if (!dgate_logits && !dgate_bf16) return lm_error(LM_ERR_ARG, "%s: dgate_logits or dgate_bf16 is required", fn);
    if (!do_norm || !d_gated || !o || !gate || !o_norm || !scratch)
        return lm_error(LM_ERR_ARG, "%s: do_norm, d_gated, o, gate, o_norm and scratch are required", fn);
    lm_status st = check_output_shape(fn, N, H, K);
    if (st) return st;
    if (ld_dgate_bf16 == 0) ld_dgate_bf16 = (int64_t)H * K;
    if (ld_dgate_bf16 < (int64_t)H * K)
        return lm_error(LM_ERR_ARG, "%s: ld_dgate_bf16 = %lld is below H*K = %lld", fn, (long long)ld_dgate_bf16,
                        (long long)H * K);
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const int64_t rows = N * H, chunks = norm_chunks(rows), rows_per_chunk = (rows + chunks - 1) / chunks;
    float *partial = (float *)scratch;
    const unsigned grid = kl_blocks(chunks, KL_ROW_WARPS);
#define OUT_BWD(P)                                                                                   \
    output_backward_kernel<P><<<grid, KL_ROW_WARPS * 32, 0, stream>>>(                               \
        d_o_bf16, d_o_f32, dgate_logits, dgate_bf16, ld_dgate_bf16, partial, d_gated, o, o_rstd, gate, o_norm, H, \
        K, eps, rows, rows_per_chunk, chunks)
    switch (K / 32) {
    case 1: OUT_BWD(1); break;
    case 2: OUT_BWD(2); break;
    case 3: OUT_BWD(3); break;
    case 4: OUT_BWD(4); break;
    case 5: OUT_BWD(5); break;
    case 6: OUT_BWD(6); break;
    case 7: OUT_BWD(7); break;
    default: OUT_BWD(8); break;
    }
#undef OUT_BWD
    LM_CUDA_TRY(cudaGetLastError());
    kl_ordered_partial_sum_kernel<<<kl_partial_sum_grid(K), kl_partial_sum_block(), 0, stream>>>(
        do_norm, partial, K, chunks);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
