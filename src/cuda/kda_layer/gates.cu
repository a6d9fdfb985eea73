/* The KDA layer's gates on the GPU (include/longmoe/kda_layer_cuda.h): the
 * sigmoid of beta, and the output stage gate ⊙ RMSNorm(o) with its backward
 * (the CPU formulas of lm_kda_layer_forward/backward, src/model/kda_layer.c,
 * and lm_rmsnorm_*, src/ops/linear/linear.c). */
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/kda_layer/kda_layer_common.cuh"
#include "longmoe/kda_layer_cuda.h"

#define ELEM_THREADS 256
/* do_norm: each block sums at least NORM_MIN_ROWS rows of K values; at most
 * NORM_MAX_CHUNKS partials per channel */
#define NORM_MIN_ROWS 64
#define NORM_MAX_CHUNKS 1024

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

/* One warp per row: dgate_logits = d_gated n gate (1 - gate) with
 * n = o rstd o_norm; dn = d_gated gate; the RMSNorm backward
 * d_o = s (dn w) - x s^3/K sum_j (dn_j w_j x_j). */
__global__ void output_backward_kernel(uint16_t *d_o_bf16, float *d_o_f32, float *dgate_logits,
                                       const float *d_gated, const uint16_t *o,
                                       const float *o_rstd, const float *gate,
                                       const float *o_norm, int K, float eps, int64_t rows) {
    int64_t row = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31, per = K / 32;
    float x[KL_MAX_PER_LANE], dn[KL_MAX_PER_LANE];
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        x[j] = kl_bf16_to_f32(o[row * K + j * 32 + lane]);
    }
    const float s = o_rstd ? o_rstd[row] : row_rstd(x, per, K, eps);
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        const int k = j * 32 + lane;
        const int64_t e = row * K + k;
        const float gt = gate[e], dg = d_gated[e], w = o_norm[k];
        const float n = x[j] * s * w;
        dgate_logits[e] = dg * n * gt * (1.0f - gt);
        dn[j] = dg * gt;
        dot += dn[j] * w * x[j];
    }
    dot = kl_warp_sum(dot);
    const float c = dot * s * s * s / (float)K;
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        const int k = j * 32 + lane;
        const int64_t e = row * K + k;
        const float d = s * dn[j] * o_norm[k] - c * x[j];
        if (d_o_f32) d_o_f32[e] = d;
        if (d_o_bf16) d_o_bf16[e] = kl_f32_to_bf16(d);
    }
}

/* partial[chunk][k] = sum over the chunk's rows r (in order) of
 * (d_gated gate)[r,k] o[r,k] rstd[r]; one block of K threads per chunk. */
__global__ void output_dnorm_partial_kernel(float *partial, const float *d_gated,
                                            const float *gate, const uint16_t *o,
                                            const float *o_rstd, int K, float eps, int64_t rows,
                                            int64_t rows_per_chunk) {
    const int k = threadIdx.x, lane = threadIdx.x & 31, per = K / 32;
    const int64_t chunk = blockIdx.x, r0 = chunk * rows_per_chunk;
    const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t e = r * K + k;
        const float x = kl_bf16_to_f32(o[e]);
        float s;
        if (o_rstd) {
            s = o_rstd[r];
        } else {
            /* the block's K threads recompute the row's 1/rms: a warp each */
            __shared__ float warp_ss[LM_KDA_LAYER_CUDA_MAX_HEAD_DIM / 32];
            float ss = kl_warp_sum(x * x);
            __syncthreads(); /* the previous row's reads of warp_ss are done */
            if (lane == 0) warp_ss[k / 32] = ss;
            __syncthreads();
            ss = 0.0f;
            for (int j = 0; j < per; j++) ss += warp_ss[j];
            s = 1.0f / sqrtf(ss / (float)K + eps);
        }
        acc += (d_gated[e] * gate[e]) * x * s;
    }
    partial[chunk * K + k] = acc;
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
                                                 float *do_norm, const float *d_gated,
                                                 const uint16_t *o, const float *o_rstd,
                                                 const float *gate, const float *o_norm, int64_t N,
                                                 int H, int K, float eps, void *scratch) {
    // d_gated, o, gate, dgate_logits, d_o are (N,H,K); o_rstd is (N,H); o_norm, do_norm are (K)
    const char *fn = "kda_output_backward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (!d_o_bf16 && !d_o_f32) return lm_error(LM_ERR_ARG, "%s: d_o_bf16 or d_o_f32 is required", fn);
    if (!dgate_logits || !do_norm || !d_gated || !o || !gate || !o_norm || !scratch)
        return lm_error(LM_ERR_ARG,
                        "%s: dgate_logits, do_norm, d_gated, o, gate, o_norm and scratch are required", fn);
    lm_status st = check_output_shape(fn, N, H, K);
    if (st) return st;
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const int64_t rows = N * H, chunks = norm_chunks(rows), rows_per_chunk = (rows + chunks - 1) / chunks;
    float *partial = (float *)scratch;
    output_backward_kernel<<<kl_blocks(rows, KL_ROW_WARPS), KL_ROW_WARPS * 32, 0, stream>>>(
        d_o_bf16, d_o_f32, dgate_logits, d_gated, o, o_rstd, gate, o_norm, K, eps, rows);
    LM_CUDA_TRY(cudaGetLastError());
    output_dnorm_partial_kernel<<<(unsigned)chunks, K, 0, stream>>>(partial, d_gated, gate, o, o_rstd,
                                                                   K, eps, rows, rows_per_chunk);
    LM_CUDA_TRY(cudaGetLastError());
    kl_ordered_partial_sum_kernel<<<kl_blocks(K, ELEM_THREADS), ELEM_THREADS, 0, stream>>>(
        do_norm, partial, K, chunks);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
