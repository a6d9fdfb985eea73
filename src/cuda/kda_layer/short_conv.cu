/* Short causal depthwise convolution, SiLU and the per-head L2 norm of the
 * KDA layer's q, k, v (include/longmoe/kda_layer_cuda.h; the CPU versions are
 * short_conv_* and silu_l2_* in src/model/kda_layer.c). */
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/kda_layer/kda_layer_common.cuh"
#include "longmoe/kda_layer_cuda.h"

#define L2_EPS 1e-6f
#define ELEM_THREADS 256
/* dw: each block sums at least DW_MIN_ROWS tokens of 128 channels; at most
 * DW_MAX_CHUNKS partials per (channel, tap) */
#define DW_THREADS 128
#define DW_MIN_ROWS 64
#define DW_MAX_CHUNKS 256

/* c[t,ch] = sum_i w[ch,i] in[t-(W-1)+i, ch] of token n = b*T + t (taps before
 * the sequence's start are zero), in the CPU's order of i. */
__device__ __forceinline__ float conv_at(const float *in, const float *w, int64_t n, int t, int ch,
                                         int C, int W) {
    float acc = 0.0f;
    for (int i = 0; i < W; i++) {
        int src = t - (W - 1) + i;
        if (src < 0) continue;
        acc += w[(size_t)ch * W + i] * in[(n - (W - 1) + i) * C + ch];
    }
    return acc;
}

/* One warp per (token, head) row: conv, SiLU, optional L2 norm. */
__global__ void conv_silu_l2_forward_kernel(float *conv_out, uint16_t *out, float *rnorm,
                                            const float *in, const float *w, int T, int C, int W,
                                            int head_dim, int64_t rows) {
    int64_t row = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (row >= rows) return; /* whole warps leave together */
    const int lane = threadIdx.x & 31, heads = C / head_dim, per = head_dim / 32;
    const int64_t n = row / heads;
    const int h = (int)(row % heads), t = (int)(n % T);
    float y[KL_MAX_PER_LANE];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        int ch = h * head_dim + j * 32 + lane;
        float c = conv_at(in, w, n, t, ch, C, W);
        if (conv_out) conv_out[n * C + ch] = c;
        y[j] = c * kl_sigmoid(c);
        ss += y[j] * y[j];
    }
    float s = 1.0f;
    if (rnorm) {
        ss = kl_warp_sum(ss);
        s = 1.0f / sqrtf(ss + L2_EPS);
        if (lane == 0) rnorm[row] = s;
    }
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        int ch = h * head_dim + j * 32 + lane;
        out[n * C + ch] = kl_f32_to_bf16(rnorm ? y[j] * s : y[j]);
    }
}

/* One warp per row: dc = dSiLU(c) * (L2 backward of dout), the gradient of
 * the conv output (silu_l2_backward of the CPU). */
__global__ void silu_l2_backward_kernel(float *dc, const uint16_t *dout, const float *conv_out,
                                        const float *rnorm, const float *in, const float *w, int T,
                                        int C, int W, int head_dim, int64_t rows) {
    int64_t row = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31, heads = C / head_dim, per = head_dim / 32;
    const int64_t n = row / heads;
    const int h = (int)(row % heads), t = (int)(n % T);
    const float s = rnorm ? rnorm[row] : 1.0f;
    float x[KL_MAX_PER_LANE], y[KL_MAX_PER_LANE], g[KL_MAX_PER_LANE];
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        int ch = h * head_dim + j * 32 + lane;
        x[j] = conv_out ? conv_out[n * C + ch] : conv_at(in, w, n, t, ch, C, W);
        g[j] = kl_bf16_to_f32(dout[n * C + ch]);
        y[j] = x[j] * kl_sigmoid(x[j]) * s; /* the forward's output, recomputed */
        dot += y[j] * g[j];
    }
    if (rnorm) dot = kl_warp_sum(dot);
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        int ch = h * head_dim + j * 32 + lane;
        /* y = u s with u = silu(x): du = s (g - y (y.g)) */
        float du = rnorm ? s * (g[j] - y[j] * dot) : g[j];
        float sg = kl_sigmoid(x[j]);
        dc[n * C + ch] = du * sg * (1.0f + x[j] * (1.0f - sg));
    }
}

/* din[t,ch] = sum_i w[ch,i] dc[t+(W-1)-i, ch] (taps past the end are zero). */
__global__ void conv_backward_input_kernel(float *din, const float *dc, const float *w, int T,
                                           int C, int W, int64_t total) {
    int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t n = idx / C;
    const int ch = (int)(idx % C), t = (int)(n % T);
    float acc = 0.0f;
    for (int i = 0; i < W; i++) {
        int dst = t + (W - 1) - i;
        if (dst >= T) continue;
        acc += w[(size_t)ch * W + i] * dc[(n + (W - 1) - i) * C + ch];
    }
    din[idx] = acc;
}

/* partial[chunk][ch][i] = sum over the chunk's tokens n (in order) of
 * in[n-(W-1)+i, ch] dc[n, ch]; grid (channel blocks, chunks, taps). */
__global__ void conv_dw_partial_kernel(float *partial, const float *dc, const float *in, int T,
                                       int C, int W, int64_t N, int64_t rows_per_chunk) {
    const int ch = blockIdx.x * DW_THREADS + threadIdx.x, i = blockIdx.z;
    if (ch >= C) return;
    const int64_t chunk = blockIdx.y, n0 = chunk * rows_per_chunk;
    const int64_t n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
    float acc = 0.0f;
    for (int64_t n = n0; n < n1; n++) {
        int t = (int)(n % T);
        if (t < W - 1 - i) continue; /* the tap reads before the sequence's start */
        acc += in[(n - (W - 1) + i) * C + ch] * dc[n * C + ch];
    }
    partial[((size_t)chunk * C + ch) * W + i] = acc;
}

/* din and dw's partials in ONE pass over dc and in: thread = channel, block
 * row = chunk of tokens [n0, n1), walked in order with the last WT values
 * of in and of dc in registers (a halo of WT - 1 tokens read past the chunk's
 * end for din). Per token m: partial[chunk][ch][i] += in[m-(W-1)+i] dc[m]
 * (taps before the sequence's start skipped; the conv_dw_partial_kernel's
 * order), and din[t] for t = m - (W-1) = sum_i w[ch,i] dc[t+(W-1)-i] (taps
 * past the sequence's end skipped; the conv_backward_input_kernel's order):
 * the same bits as those two kernels, in a third of their traffic. */
template <int WT>
__global__ void conv_backward_window_kernel(float *__restrict__ din, float *__restrict__ partial,
                                            const float *__restrict__ dc, const float *__restrict__ in,
                                            const float *__restrict__ w, int T, int C, int64_t N,
                                            int64_t rows_per_chunk) {
    const int ch = blockIdx.x * DW_THREADS + threadIdx.x;
    if (ch >= C) return;
    const int64_t chunk = blockIdx.y, n0 = chunk * rows_per_chunk;
    const int64_t n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
    float wr[WT], acc[WT], xin[WT], dcw[WT];
#pragma unroll
    for (int i = 0; i < WT; i++) {
        wr[i] = w[(size_t)ch * WT + i];
        acc[i] = 0.0f;
        dcw[i] = 0.0f;
        /* xin[i] = in[n0 - WT + i] for i >= 1: the taps of the first token */
        const int64_t src = n0 - WT + i;
        xin[i] = (i >= 1 && src >= 0) ? in[src * C + ch] : 0.0f;
    }
    const int64_t m_end = n1 + (WT - 1);
#pragma unroll 4
    for (int64_t m = n0; m < m_end; m++) {
#pragma unroll
        for (int i = 0; i + 1 < WT; i++) {
            xin[i] = xin[i + 1];
            dcw[i] = dcw[i + 1];
        }
        const bool in_chunk = m < n1;
        xin[WT - 1] = in_chunk ? in[m * C + ch] : 0.0f;
        dcw[WT - 1] = m < N ? dc[m * C + ch] : 0.0f;
        if (in_chunk) {
            const int t = (int)(m % T);
            const float g = dcw[WT - 1];
#pragma unroll
            for (int i = 0; i < WT; i++)
                if (t >= WT - 1 - i) acc[i] += xin[i] * g;
        }
        const int64_t tt = m - (WT - 1);
        if (tt >= n0 && tt < n1) {
            const int t = (int)(tt % T);
            float a = 0.0f;
#pragma unroll
            for (int i = 0; i < WT; i++)
                if (t + (WT - 1) - i < T) a += wr[i] * dcw[WT - 1 - i];
            din[tt * C + ch] = a;
        }
    }
#pragma unroll
    for (int i = 0; i < WT; i++) partial[((size_t)chunk * C + ch) * WT + i] = acc[i];
}

static int64_t dw_chunks(int64_t N) { return kl_chunks(N, DW_MIN_ROWS, DW_MAX_CHUNKS); }

static lm_status check_shape(const char *fn, int B, int T, int C, int W, int head_dim) {
    if (B < 1 || T < 1 || C < 1 || W < 1)
        return lm_error(LM_ERR_ARG, "%s: B=%d T=%d C=%d W=%d must all be >= 1", fn, B, T, C, W);
    if (W > 65535) return lm_error(LM_ERR_ARG, "%s: W=%d must be at most 65535", fn, W);
    if (head_dim < 32 || head_dim % 32 || head_dim > LM_KDA_LAYER_CUDA_MAX_HEAD_DIM)
        return lm_error(LM_ERR_ARG, "%s: head_dim=%d must be a multiple of 32 in [32, %d]", fn,
                        head_dim, LM_KDA_LAYER_CUDA_MAX_HEAD_DIM);
    if (C % head_dim)
        return lm_error(LM_ERR_ARG, "%s: C=%d must be a multiple of head_dim=%d", fn, C, head_dim);
    return LM_OK;
}

extern "C" lm_status lm_cuda_short_conv_silu_forward(const lm_cuda_context *ctx, float *conv_out,
                                                     uint16_t *out_bf16, float *rnorm,
                                                     const float *in, const float *w, int B,
                                                     int T, int C, int W, int head_dim) {
    // in, conv_out, out_bf16 are (B,T,C); w is (C,W); rnorm is (B,T,C/head_dim)
    const char *fn = "short_conv_silu_forward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (!out_bf16 || !in || !w) return lm_error(LM_ERR_ARG, "%s: out_bf16, in and w are required", fn);
    lm_status st = check_shape(fn, B, T, C, W, head_dim);
    if (st) return st;
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    int64_t rows = (int64_t)B * T * (C / head_dim);
    conv_silu_l2_forward_kernel<<<kl_blocks(rows, KL_ROW_WARPS), KL_ROW_WARPS * 32, 0, stream>>>(
        conv_out, out_bf16, rnorm, in, w, T, C, W, head_dim, rows);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" size_t lm_cuda_short_conv_silu_backward_scratch_bytes(int B, int T, int C, int W) {
    if (B < 1 || T < 1 || C < 1 || W < 1) return 0;
    int64_t N = (int64_t)B * T;
    return ((size_t)N * C + (size_t)dw_chunks(N) * C * W) * sizeof(float);
}

extern "C" lm_status lm_cuda_short_conv_silu_backward(const lm_cuda_context *ctx, float *din,
                                                      float *dw, const uint16_t *dout_bf16,
                                                      const float *conv_out, const float *rnorm,
                                                      const float *in, const float *w, int B,
                                                      int T, int C, int W, int head_dim,
                                                      void *scratch) {
    // dout_bf16, din, in, conv_out are (B,T,C); w, dw are (C,W)
    const char *fn = "short_conv_silu_backward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (!din || !dw || !dout_bf16 || !in || !w || !scratch)
        return lm_error(LM_ERR_ARG, "%s: din, dw, dout_bf16, in, w and scratch are required", fn);
    lm_status st = check_shape(fn, B, T, C, W, head_dim);
    if (st) return st;
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const int64_t N = (int64_t)B * T, rows = N * (C / head_dim), total = N * C;
    const int64_t chunks = dw_chunks(N), rows_per_chunk = (N + chunks - 1) / chunks;
    float *dc = (float *)scratch, *partial = dc + total;
    silu_l2_backward_kernel<<<kl_blocks(rows, KL_ROW_WARPS), KL_ROW_WARPS * 32, 0, stream>>>(
        dc, dout_bf16, conv_out, rnorm, in, w, T, C, W, head_dim, rows);
    LM_CUDA_TRY(cudaGetLastError());
    if (W <= 8) {
        dim3 grid(kl_blocks(C, DW_THREADS), (unsigned)chunks);
#define CONV_BWD(WT)                                                                               \
    conv_backward_window_kernel<WT><<<grid, DW_THREADS, 0, stream>>>(din, partial, dc, in, w, T, C, \
                                                                     N, rows_per_chunk)
        switch (W) {
        case 1: CONV_BWD(1); break;
        case 2: CONV_BWD(2); break;
        case 3: CONV_BWD(3); break;
        case 4: CONV_BWD(4); break;
        case 5: CONV_BWD(5); break;
        case 6: CONV_BWD(6); break;
        case 7: CONV_BWD(7); break;
        default: CONV_BWD(8); break;
        }
#undef CONV_BWD
        LM_CUDA_TRY(cudaGetLastError());
    } else {
        conv_backward_input_kernel<<<kl_blocks(total, ELEM_THREADS), ELEM_THREADS, 0, stream>>>(
            din, dc, w, T, C, W, total);
        LM_CUDA_TRY(cudaGetLastError());
        dim3 grid(kl_blocks(C, DW_THREADS), (unsigned)chunks, (unsigned)W);
        conv_dw_partial_kernel<<<grid, DW_THREADS, 0, stream>>>(partial, dc, in, T, C, W, N,
                                                                rows_per_chunk);
        LM_CUDA_TRY(cudaGetLastError());
    }
    const int64_t len = (int64_t)C * W;
    kl_ordered_partial_sum_kernel<<<kl_partial_sum_grid(len), kl_partial_sum_block(), 0, stream>>>(
        dw, partial, len, chunks);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
