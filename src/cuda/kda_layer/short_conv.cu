/* Short causal depthwise convolution, SiLU and the per-head L2 norm of the
 * KDA layer's q, k, v (include/longmoe/kda_layer_cuda.h; the CPU versions are
 * lm_short_conv_* and lm_silu_l2_* in src/ops/linear/short_conv.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* The backward's per-channel pieces, shared by silu_l2_backward_kernel and
 * the fused kernel so that both give the same bits: y = SiLU(x) s (the
 * forward's output, recomputed) and dc from y, g and the head's y.g. */
__device__ __forceinline__ float silu_l2_y(float x, float s) { return x * kl_sigmoid(x) * s; }

__device__ __forceinline__ float silu_l2_dc(float x, float g, float y, float dot, float s, bool norm) {
    /* y = u s with u = silu(x): du = s (g - y (y.g)) */
    const float du = norm ? s * (g - y * dot) : g;
    const float sg = kl_sigmoid(x);
    return du * sg * (1.0f + x * (1.0f - sg));
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

/* The same outputs, bit for bit (the same sums in the same order), with each
 * input row read once: one warp per (sequence, head, CONV_FWD_TOKENS tokens)
 * keeps the last WT-1 inputs of its channels in registers as it walks the
 * tokens, where the kernel above reads W rows for every token. */
#define CONV_FWD_TOKENS 16
template <int PER, int WT>
__global__ void conv_silu_l2_forward_window_kernel(float *conv_out, uint16_t *out, float *rnorm, const float *in,
                                                   const float *w, int T, int C, int head_dim, int64_t warps) {
    const int64_t wid = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (wid >= warps) return; /* whole warps leave together */
    const int lane = threadIdx.x & 31, heads = C / head_dim;
    const int blocks_per_seq = (T + CONV_FWD_TOKENS - 1) / CONV_FWD_TOKENS;
    const int h = (int)(wid % heads);
    const int64_t sb = wid / heads;
    const int64_t b = sb / blocks_per_seq;
    const int t0 = (int)(sb % blocks_per_seq) * CONV_FWD_TOKENS;
    const int t1 = t0 + CONV_FWD_TOKENS < T ? t0 + CONV_FWD_TOKENS : T;
    float wr[PER][WT], win[PER][WT > 1 ? WT - 1 : 1];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int ch = h * head_dim + j * 32 + lane;
#pragma unroll
        for (int i = 0; i < WT; i++) wr[j][i] = w[(size_t)ch * WT + i];
#pragma unroll
        for (int i = 0; i < WT - 1; i++) {
            const int src = t0 - (WT - 1) + i;
            win[j][i] = src >= 0 ? in[(b * T + src) * C + ch] : 0.0f;
        }
    }
    for (int t = t0; t < t1; t++) {
        const int64_t n = b * T + t;
        float y[PER];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int ch = h * head_dim + j * 32 + lane;
            const float x = in[n * C + ch];
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < WT; i++) {
                if (t - (WT - 1) + i < 0) continue; /* conv_at's order and skips */
                acc += wr[j][i] * (i < WT - 1 ? win[j][i] : x);
            }
#pragma unroll
            for (int i = 0; i + 1 < WT - 1; i++) win[j][i] = win[j][i + 1];
            if (WT > 1) win[j][WT - 2] = x;
            if (conv_out) conv_out[n * C + ch] = acc;
            y[j] = acc * kl_sigmoid(acc);
            ss += y[j] * y[j];
        }
        float s = 1.0f;
        if (rnorm) {
            ss = kl_warp_sum(ss);
            s = 1.0f / sqrtf(ss + L2_EPS);
            if (lane == 0) rnorm[n * heads + h] = s;
        }
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int ch = h * head_dim + j * 32 + lane;
            out[n * C + ch] = kl_f32_to_bf16(rnorm ? y[j] * s : y[j]);
        }
    }
}

/* cp.async (global -> shared, no registers held while the copy is in flight). */
__device__ __forceinline__ void conv_cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void conv_cp_async4(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void conv_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void conv_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* The window kernel's sums (the same bits) with the loads in flight in a
 * per-warp ring of shared memory: a warp takes one head of CONV_RING_TOKENS
 * consecutive tokens and keeps CONV_RING_DEPTH - 1 tokens' rows of `in` in
 * flight (16-byte cp.async, 512 bytes a token at head_dim 128) while it
 * computes the current one; no registers are held by the copies. The window
 * kernel has one token's loads (512 bytes a warp) in flight at a time and
 * waits for them before its arithmetic, shuffles and stores, so each SM has
 * at most ~16 KB outstanding (32 warps at its 56 registers); here ~32 warps x
 * 7 x 512 B = 112 KB. The halo (WT - 1 rows before a warp's first token) is
 * 3/64 of the reads instead of 3/16. */
#define CONV_RING_TOKENS 64
#define CONV_RING_DEPTH 8 /* a power of 2 */
template <int PER, int WT>
__global__ void __launch_bounds__(KL_ROW_WARPS * 32, 4)
    conv_silu_l2_forward_ring_kernel(float *__restrict__ conv_out, uint16_t *__restrict__ out,
                                     float *__restrict__ rnorm, const float *__restrict__ in,
                                     const float *__restrict__ w, int T, int C, int64_t warps) {
    constexpr int HD = PER * 32, D = CONV_RING_DEPTH;
    extern __shared__ float4 conv_ring_smem[];
    const int64_t wid = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (wid >= warps) return; /* whole warps leave together */
    const int lane = threadIdx.x & 31, heads = C / HD;
    float *ring = (float *)conv_ring_smem + (threadIdx.x / 32) * (D * HD);
    const int tiles = (T + CONV_RING_TOKENS - 1) / CONV_RING_TOKENS;
    const int h = (int)(wid % heads);
    const int64_t sb = wid / heads;
    const int64_t b = sb / tiles;
    const int t0 = (int)(sb % tiles) * CONV_RING_TOKENS;
    const int t1 = t0 + CONV_RING_TOKENS < T ? t0 + CONV_RING_TOKENS : T;
    const float *src = in + b * T * C + (int64_t)h * HD; /* row t at src + t * C */
    float wr[PER][WT], win[PER][WT > 1 ? WT - 1 : 1];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int ch = h * HD + j * 32 + lane;
#pragma unroll
        for (int i = 0; i < WT; i++) wr[j][i] = w[(size_t)ch * WT + i];
#pragma unroll
        for (int i = 0; i < WT - 1; i++) {
            const int s = t0 - (WT - 1) + i;
            win[j][i] = s >= 0 ? src[(int64_t)s * C + j * 32 + lane] : 0.0f;
        }
    }
    /* token t's row goes to slot (t - t0) % D; one commit group per token (empty past t1) */
    auto issue = [&](int t) {
        if (t < t1 && lane < HD / 4)
            conv_cp_async16(ring + ((t - t0) & (D - 1)) * HD + 4 * lane, src + (int64_t)t * C + 4 * lane);
        conv_cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < D - 1; k++) issue(t0 + k);
    for (int t = t0; t < t1; t++) {
        __syncwarp(); /* every lane has read token t - 1's slot, which the next copy refills */
        issue(t + D - 1);
        conv_cp_async_wait<D - 1>(); /* this lane's copies of token t landed */
        __syncwarp();                /* and every lane's */
        const float *row = ring + ((t - t0) & (D - 1)) * HD;
        const int64_t n = b * T + t;
        float y[PER];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int ch = h * HD + j * 32 + lane;
            const float x = row[j * 32 + lane];
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < WT; i++) {
                if (t - (WT - 1) + i < 0) continue; /* conv_at's order and skips */
                acc += wr[j][i] * (i < WT - 1 ? win[j][i] : x);
            }
#pragma unroll
            for (int i = 0; i + 1 < WT - 1; i++) win[j][i] = win[j][i + 1];
            if (WT > 1) win[j][WT - 2] = x;
            if (conv_out) conv_out[n * C + ch] = acc;
            y[j] = acc * kl_sigmoid(acc);
            ss += y[j] * y[j];
        }
        float s = 1.0f;
        if (rnorm) {
            ss = kl_warp_sum(ss);
            s = 1.0f / sqrtf(ss + L2_EPS);
            if (lane == 0) rnorm[n * heads + h] = s;
        }
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int ch = h * HD + j * 32 + lane;
            out[n * C + ch] = kl_f32_to_bf16(rnorm ? y[j] * s : y[j]);
        }
    }
    conv_cp_async_wait<0>(); /* no copy outlives the warp (the last groups are empty) */
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
        y[j] = silu_l2_y(x[j], s); /* the forward's output, recomputed */
        dot += y[j] * g[j];
    }
    if (rnorm) dot = kl_warp_sum(dot);
#pragma unroll
    for (int j = 0; j < KL_MAX_PER_LANE; j++) {
        if (j >= per) break;
        int ch = h * head_dim + j * 32 + lane;
        dc[n * C + ch] = silu_l2_dc(x[j], g[j], y[j], dot, s, rnorm != NULL);
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

/* The whole backward in ONE pass, when W <= 4 and head_dim <= 128: a warp
 * takes one head and a chunk of tokens [n0, n1) in order (lane l holds
 * channels l, l + 32, ... of the head, as silu_l2_backward_kernel). Per token
 * m it forms dc[m] in registers exactly as silu_l2_backward_kernel does (same
 * bits), adds dw's partial (the conv_dw_partial_kernel's order) and, with the
 * last WT values of in and dc in registers, writes din[m-(W-1)] (the
 * conv_backward_input_kernel's order); dc is formed for W - 1 tokens past the
 * chunk too (the halo din needs), and never goes to memory. c is the saved
 * conv_out or, when conv_out is NULL, recomputed from the last WT values of
 * in (read for the halo tokens too, which add nothing to dw) with the
 * forward's sum: the same bits. The next token's loads are issued before the
 * current token's arithmetic. The chunks are dw_chunks', so dw has the
 * two-pass path's bits. */
/* din stores: fp32, or bf16 for a product that takes it next (round to nearest even) */
__device__ __forceinline__ void conv_store_din(float *p, float v) { *p = v; }
__device__ __forceinline__ void conv_store_din(uint16_t *p, float v) { *p = kl_f32_to_bf16(v); }

/* x mod T in [0, T) for any x (a token index, negative before the data) */
__device__ __forceinline__ int conv_pos(int64_t x, int T) {
    const int64_t r = x % T;
    return (int)(r < 0 ? r + T : r);
}

/* The backward kernels' shared parts (fused and ring: the same arithmetic in the same order).
 * Begin: channel ch[j] = ch0 + 32 j, its W taps, zero sums, the taps of the chunk's first token. */
template <int PER, int WT>
__device__ __forceinline__ void conv_bwd_begin(int (&ch)[PER], float (&wr)[PER][WT], float (&acc)[PER][WT],
                                               float (&xin)[PER][WT], float (&dcw)[PER][WT],
                                               const float *__restrict__ w, const float *__restrict__ in, int ch0,
                                               int64_t n0, int64_t N, int C) {
#pragma unroll
    for (int j = 0; j < PER; j++) {
        ch[j] = ch0 + j * 32;
#pragma unroll
        for (int i = 0; i < WT; i++) {
            wr[j][i] = w[(size_t)ch[j] * WT + i];
            acc[j][i] = 0.0f;
            dcw[j][i] = 0.0f;
            /* xin[j][i] = in[n0 - WT + i] for i >= 1: the taps of the first token */
            const int64_t src = n0 - WT + i;
            xin[j][i] = (i >= 1 && src >= 0 && src < N) ? in[src * C + ch[j]] : 0.0f;
        }
    }
}

/* One token m of a chunk [n0, n1): x = c (not read when recompute: then c is formed
 * from the window of in), g = dout, xi = in of token m (0 past the data, and past the
 * chunk unless recompute), s = 1/||y|| (1 without the norm): dc of m into the window,
 * dw's partial sums, and din of token m - (W - 1). tm and ttm are m % T and (m - (W - 1)) mod T,
 * kept by the caller as running positions (a 64-bit remainder a token cost more than the rest
 * of the step's integer work). INTERIOR: the caller has checked that every condition below holds
 * (m >= n0 + W - 1, m < n1 and tm >= W - 1: the token, its window and token m - (W - 1) inside
 * the chunk and the sequence), so they are left out: the same operations in the same order, without
 * the per-element tests that made most of the step's instructions. */
template <int PER, int WT, typename DT, bool INTERIOR>
__device__ __forceinline__ void conv_bwd_step(float (&xin)[PER][WT], float (&dcw)[PER][WT], float (&acc)[PER][WT],
                                              const float (&wr)[PER][WT], const float (&x)[PER],
                                              const float (&g)[PER], const float (&xi)[PER], float s, bool norm,
                                              bool recompute, int64_t m, int64_t n0, int64_t n1, int64_t N, int T,
                                              int C, const int (&ch)[PER], DT *__restrict__ din, int64_t ldo,
                                              int tm, int ttm) {
#pragma unroll
        for (int j = 0; j < PER; j++) {
#pragma unroll
            for (int i = 0; i + 1 < WT; i++) {
                xin[j][i] = xin[j][i + 1];
                dcw[j][i] = dcw[j][i + 1];
            }
            xin[j][WT - 1] = xi[j];
        }
        const int t = tm;
        if (INTERIOR || m < N) { /* warp-uniform */
            float c[PER], y[PER];
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                c[j] = x[j];
                if (recompute) { /* the forward kernels' sum (conv_at's order and skips): their bits */
                    float a = 0.0f;
#pragma unroll
                    for (int i = 0; i < WT; i++) {
                        if (!INTERIOR && t - (WT - 1) + i < 0) continue;
                        a += wr[j][i] * xin[j][i];
                    }
                    c[j] = a;
                }
                y[j] = silu_l2_y(c[j], s); /* the forward's output, recomputed */
                dot += y[j] * g[j];
            }
            if (norm) dot = kl_warp_sum(dot);
#pragma unroll
            for (int j = 0; j < PER; j++) dcw[j][WT - 1] = silu_l2_dc(c[j], g[j], y[j], dot, s, norm);
        } else {
#pragma unroll
            for (int j = 0; j < PER; j++) dcw[j][WT - 1] = 0.0f;
        }
        if (INTERIOR || m < n1) {
#pragma unroll
            for (int j = 0; j < PER; j++)
#pragma unroll
                for (int i = 0; i < WT; i++)
                    if (INTERIOR || t >= WT - 1 - i) acc[j][i] += xin[j][i] * dcw[j][WT - 1];
        }
        const int64_t tt = m - (WT - 1);
        if (INTERIOR || (tt >= n0 && tt < n1)) {
            const int t = ttm;
#pragma unroll
            for (int j = 0; j < PER; j++) {
                float a = 0.0f;
#pragma unroll
                for (int i = 0; i < WT; i++)
                    if (INTERIOR || t + (WT - 1) - i < T) a += wr[j][i] * dcw[j][WT - 1 - i];
                conv_store_din(din + tt * ldo + ch[j], a);
            }
        }
}

/* conv_bwd_step for token m in its interior form where every condition holds, else the general
 * one; then tm and ttm move on to token m + 1 */
template <int PER, int WT, typename DT>
__device__ __forceinline__ void conv_bwd_token(float (&xin)[PER][WT], float (&dcw)[PER][WT], float (&acc)[PER][WT],
                                               const float (&wr)[PER][WT], const float (&x)[PER],
                                               const float (&g)[PER], const float (&xi)[PER], float s, bool norm,
                                               bool recompute, int64_t m, int64_t n0, int64_t n1, int64_t N, int T,
                                               int C, const int (&ch)[PER], DT *__restrict__ din, int64_t ldo,
                                               int &tm, int &ttm) {
    if (m >= n0 + (WT - 1) && m < n1 && tm >= WT - 1)
        conv_bwd_step<PER, WT, DT, true>(xin, dcw, acc, wr, x, g, xi, s, norm, recompute, m, n0, n1, N, T, C, ch, din,
                                         ldo, tm, ttm);
    else
        conv_bwd_step<PER, WT, DT, false>(xin, dcw, acc, wr, x, g, xi, s, norm, recompute, m, n0, n1, N, T, C, ch,
                                          din, ldo, tm, ttm);
    if (++tm == T) tm = 0;
    if (++ttm == T) ttm = 0;
}

template <int PER, int WT, typename DT>
__global__ void __launch_bounds__(KL_ROW_WARPS * 32)
    conv_silu_l2_backward_fused_kernel(DT *__restrict__ din, float *__restrict__ partial,
                                       const uint16_t *__restrict__ dout,
                                       const float *__restrict__ conv_out,
                                       const float *__restrict__ rnorm, const float *__restrict__ in,
                                       const float *__restrict__ w, int T, int C, int head_dim,
                                       int64_t N, int64_t rows_per_chunk, int64_t chunks, int64_t ldo) {
    const int heads = C / head_dim, lane = threadIdx.x & 31;
    const int64_t gw = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (gw >= chunks * heads) return; /* whole warps leave together */
    const int h = (int)(gw % heads);
    const int64_t chunk = gw / heads, n0 = chunk * rows_per_chunk;
    const int64_t n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
    int ch[PER];
    float wr[PER][WT], acc[PER][WT], xin[PER][WT], dcw[PER][WT];
    conv_bwd_begin<PER, WT>(ch, wr, acc, xin, dcw, w, in, h * head_dim + lane, n0, N, C);
    const int64_t m_end = n1 + (WT - 1);
    const bool recompute = conv_out == NULL; /* c from in: in of the halo tokens too */
    /* loads of token m (prefetched one token ahead) */
    float px[PER], pg[PER], pin[PER], ps = 1.0f;
    auto load = [&](int64_t m) {
        const bool ok = m < N && m < m_end;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int64_t e = m * C + ch[j];
            px[j] = ok && !recompute ? conv_out[e] : 0.0f;
            pg[j] = ok ? kl_bf16_to_f32(dout[e]) : 0.0f;
            pin[j] = ok && (m < n1 || recompute) ? in[e] : 0.0f;
        }
        ps = ok && rnorm ? rnorm[m * heads + h] : 1.0f;
    };
    load(n0);
    int tm = (int)(n0 % T), ttm = conv_pos(n0 - (WT - 1), T);
    for (int64_t m = n0; m < m_end; m++) {
        float x[PER], g[PER], xi[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) x[j] = px[j], g[j] = pg[j], xi[j] = pin[j];
        const float s = ps;
        load(m + 1);
        conv_bwd_token<PER, WT>(xin, dcw, acc, wr, x, g, xi, s, rnorm != NULL, recompute, m, n0, n1, N, T, C, ch,
                                din, ldo, tm, ttm);
    }
#pragma unroll
    for (int j = 0; j < PER; j++)
#pragma unroll
        for (int i = 0; i < WT; i++) partial[((size_t)chunk * C + ch[j]) * WT + i] = acc[j][i];
}

/* conv_silu_l2_backward_fused_kernel's work and bits (the same chunks, the
 * same per-token arithmetic in the same order) with its loads in flight in a
 * per-warp ring of shared memory instead of one token ahead in registers:
 * CONV_BWD_RING_DEPTH - 1 tokens' rows (c unless recomputed, and in: 16-byte
 * cp.async, dout: 16 bytes a lane over half the lanes, 1/||y||: 4 bytes) are
 * on their way while the current token is computed. The fused kernel keeps one token (~1.3 KB a
 * warp at head_dim 128) outstanding; at dw's 256 chunks x 8 heads = 2048
 * warps (16 a SM) that is ~21 KB a SM, too little to cover the memory's
 * latency; here ~16 x 7 x 1.3 KB = 145 KB. The prefetch registers go too
 * (125 -> fewer), so two blocks still fit an SM. */
#define CONV_BWD_RING_DEPTH 8 /* a power of 2 */
template <int PER> struct conv_bwd_slot {
    /* floats of one token's slot: c [32 PER], in [32 PER], dout bf16 [32 PER] (16 PER floats), 1/||y|| (+3 pad) */
    static constexpr int C_OFF = 0, IN_OFF = 32 * PER, G_OFF = 64 * PER, S_OFF = 80 * PER, FLOATS = 80 * PER + 4;
};

template <int PER>
static size_t conv_bwd_ring_smem_bytes(void) {
    return (size_t)KL_ROW_WARPS * CONV_BWD_RING_DEPTH * conv_bwd_slot<PER>::FLOATS * sizeof(float);
}

template <int PER, int WT, typename DT>
__global__ void __launch_bounds__(KL_ROW_WARPS * 32, 2)
    conv_silu_l2_backward_ring_kernel(DT *__restrict__ din, float *__restrict__ partial,
                                      const uint16_t *__restrict__ dout, const float *__restrict__ conv_out,
                                      const float *__restrict__ rnorm, const float *__restrict__ in,
                                      const float *__restrict__ w, int T, int C, int64_t N,
                                      int64_t rows_per_chunk, int64_t chunks, int64_t ldo) {
    constexpr int HD = PER * 32, D = CONV_BWD_RING_DEPTH;
    typedef conv_bwd_slot<PER> SL;
    extern __shared__ float4 conv_bwd_ring_smem[];
    const int heads = C / HD, lane = threadIdx.x & 31;
    const int64_t gw = (int64_t)blockIdx.x * KL_ROW_WARPS + threadIdx.x / 32;
    if (gw >= chunks * heads) return; /* whole warps leave together */
    float *ring = (float *)conv_bwd_ring_smem + (threadIdx.x / 32) * (D * SL::FLOATS);
    const int h = (int)(gw % heads);
    const int64_t chunk = gw / heads, n0 = chunk * rows_per_chunk;
    const int64_t n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
    int ch[PER];
    float wr[PER][WT], acc[PER][WT], xin[PER][WT], dcw[PER][WT];
    conv_bwd_begin<PER, WT>(ch, wr, acc, xin, dcw, w, in, h * HD + lane, n0, N, C);
    const int64_t m_end = n1 + (WT - 1);
    const bool recompute = conv_out == NULL; /* c from in: in of the halo tokens too, no c rows */
    /* token m's rows go to slot (m - n0) % D; one commit group per token (empty when nothing is due) */
    auto issue = [&](int64_t m) {
        float *sl = ring + (int)((m - n0) & (D - 1)) * SL::FLOATS;
        if (m < N && m < m_end) {
            const int64_t e = m * C + (int64_t)h * HD;
            if (!recompute && lane < HD / 4) conv_cp_async16(sl + SL::C_OFF + 4 * lane, conv_out + e + 4 * lane);
            if (lane < HD / 8) conv_cp_async16(sl + SL::G_OFF + 4 * lane, dout + e + 8 * lane);
            if (rnorm && lane == 0) conv_cp_async4(sl + SL::S_OFF, rnorm + m * heads + h);
            if ((m < n1 || recompute) && lane < HD / 4)
                conv_cp_async16(sl + SL::IN_OFF + 4 * lane, in + e + 4 * lane);
        }
        conv_cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < D - 1; k++) issue(n0 + k);
    int tm = (int)(n0 % T), ttm = conv_pos(n0 - (WT - 1), T);
    for (int64_t m = n0; m < m_end; m++) {
        __syncwarp(); /* every lane has read token m - 1's slot, which the next copy refills */
        issue(m + D - 1);
        conv_cp_async_wait<D - 1>(); /* this lane's copies of token m landed */
        __syncwarp();                /* and every lane's */
        const float *sl = ring + (int)((m - n0) & (D - 1)) * SL::FLOATS;
        const uint16_t *sg = (const uint16_t *)(sl + SL::G_OFF);
        /* the fused kernel's loads give 0 (s: 1) otherwise */
        const bool ok = m < N, inok = ok && (m < n1 || recompute);
        float x[PER], g[PER], xi[PER];
#pragma unroll
        for (int j = 0; j < PER; j++) {
            x[j] = ok && !recompute ? sl[SL::C_OFF + j * 32 + lane] : 0.0f;
            g[j] = ok ? kl_bf16_to_f32(sg[j * 32 + lane]) : 0.0f;
            xi[j] = inok ? sl[SL::IN_OFF + j * 32 + lane] : 0.0f;
        }
        const float s = ok && rnorm ? sl[SL::S_OFF] : 1.0f;
        conv_bwd_token<PER, WT>(xin, dcw, acc, wr, x, g, xi, s, rnorm != NULL, recompute, m, n0, n1, N, T, C, ch,
                                din, ldo, tm, ttm);
    }
    conv_cp_async_wait<0>(); /* no copy outlives the warp (the last groups are empty) */
#pragma unroll
    for (int j = 0; j < PER; j++)
#pragma unroll
        for (int i = 0; i < WT; i++) partial[((size_t)chunk * C + ch[j]) * WT + i] = acc[j][i];
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

static int use_fused(int W, int head_dim) { return W <= 4 && head_dim <= 128; }

static int64_t dw_chunks(int64_t N) { return kl_chunks(N, DW_MIN_ROWS, DW_MAX_CHUNKS); }

/* One launch of the backward ring kernel; its shared memory (83 KB at head_dim 128) is above the
 * default 48 KB limit, raised once per instance. */
template <int PER, int WT, typename DT>
static lm_status conv_bwd_ring_launch(unsigned grid, cudaStream_t stream, DT *din, float *partial,
                                      const uint16_t *dout, const float *conv_out, const float *rnorm,
                                      const float *in, const float *w, int T, int C, int64_t N, int64_t rows,
                                      int64_t chunks, int64_t ldo) {
    static int raised = 0; /* a benign race: two threads set the same value */
    const size_t smem = conv_bwd_ring_smem_bytes<PER>();
    if (!raised && smem > 48 * 1024) {
        LM_CUDA_TRY(cudaFuncSetAttribute((const void *)conv_silu_l2_backward_ring_kernel<PER, WT, DT>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        raised = 1;
    }
    conv_silu_l2_backward_ring_kernel<PER, WT, DT><<<grid, KL_ROW_WARPS * 32, smem, stream>>>(
        din, partial, dout, conv_out, rnorm, in, w, T, C, N, rows, chunks, ldo);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

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
    /* LONGMOE_CONV_FORWARD: ring (the default), window or row. ring and window need W <= 4 and
     * head_dim <= 128 (ring also a 16-byte aligned `in`); where a kernel does not apply the next one
     * down the list runs: ring -> window -> row. All three give the same bits. */
    const char *kind = getenv("LONGMOE_CONV_FORWARD");
    if (kind && *kind && strcmp(kind, "ring") && strcmp(kind, "window") && strcmp(kind, "row"))
        return lm_error(LM_ERR_ARG, "%s: LONGMOE_CONV_FORWARD=%s: expected ring, window or row", fn, kind);
    const int is_row = kind && !strcmp(kind, "row"), is_window = kind && !strcmp(kind, "window");
    if (!is_row && !is_window && W <= 4 && head_dim <= 128 && aligned16(in)) {
        const int64_t warps = (int64_t)B * ((T + CONV_RING_TOKENS - 1) / CONV_RING_TOKENS) * (C / head_dim);
        const unsigned grid = kl_blocks(warps, KL_ROW_WARPS);
        const size_t smem = (size_t)KL_ROW_WARPS * CONV_RING_DEPTH * head_dim * sizeof(float);
#define CONV_RING(P, WT)                                                                           \
    conv_silu_l2_forward_ring_kernel<P, WT><<<grid, KL_ROW_WARPS * 32, smem, stream>>>(          \
        conv_out, out_bf16, rnorm, in, w, T, C, warps)
#define CONV_RING_W(P)                                                                             \
    switch (W) {                                                                                   \
    case 1: CONV_RING(P, 1); break;                                                                \
    case 2: CONV_RING(P, 2); break;                                                                \
    case 3: CONV_RING(P, 3); break;                                                                \
    default: CONV_RING(P, 4); break;                                                               \
    }
        switch (head_dim / 32) {
        case 1: CONV_RING_W(1); break;
        case 2: CONV_RING_W(2); break;
        case 3: CONV_RING_W(3); break;
        default: CONV_RING_W(4); break;
        }
#undef CONV_RING_W
#undef CONV_RING
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
    if (!is_row && W <= 4 && head_dim <= 128) {
        const int64_t warps = (int64_t)B * ((T + CONV_FWD_TOKENS - 1) / CONV_FWD_TOKENS) * (C / head_dim);
        const unsigned grid = kl_blocks(warps, KL_ROW_WARPS);
#define CONV_WIN(P, WT)                                                                            \
    conv_silu_l2_forward_window_kernel<P, WT><<<grid, KL_ROW_WARPS * 32, 0, stream>>>(            \
        conv_out, out_bf16, rnorm, in, w, T, C, head_dim, warps)
#define CONV_WIN_W(P)                                                                              \
    switch (W) {                                                                                   \
    case 1: CONV_WIN(P, 1); break;                                                                 \
    case 2: CONV_WIN(P, 2); break;                                                                 \
    case 3: CONV_WIN(P, 3); break;                                                                 \
    default: CONV_WIN(P, 4); break;                                                                \
    }
        switch (head_dim / 32) {
        case 1: CONV_WIN_W(1); break;
        case 2: CONV_WIN_W(2); break;
        case 3: CONV_WIN_W(3); break;
        default: CONV_WIN_W(4); break;
        }
#undef CONV_WIN_W
#undef CONV_WIN
        LM_CUDA_TRY(cudaGetLastError());
        return LM_OK;
    }
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

/* The one-pass backward (ring or fused kernel, then the fixed-order sum of dw) with din of
 * type DT, c saved (conv_out) or recomputed (conv_out NULL); *done = 0 when it does not apply
 * (W > 4 or head_dim > 128). */
template <typename DT>
static lm_status conv_backward_one_pass(const lm_cuda_context *ctx, DT *din, float *dw, const uint16_t *dout_bf16,
                                        const float *conv_out, const float *rnorm, const float *in, const float *w,
                                        int B, int T, int C, int W, int head_dim, int64_t ldo, void *scratch,
                                        const char *fn, int *done) {
    *done = 0;
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const int64_t N = (int64_t)B * T;
    /* LONGMOE_CONV_BACKWARD: ring (the default) or fused; both apply when W <= 4 and head_dim <= 128
     * (ring also needs 16-byte aligned conv_out (when given), in and dout, else fused runs); they give
     * the same bits, with c saved or recomputed alike. Otherwise the two-pass path. */
    const char *kind = getenv("LONGMOE_CONV_BACKWARD");
    if (kind && *kind && strcmp(kind, "ring") && strcmp(kind, "fused"))
        return lm_error(LM_ERR_ARG, "%s: LONGMOE_CONV_BACKWARD=%s: expected ring or fused", fn, kind);
    if (use_fused(W, head_dim) && !(kind && !strcmp(kind, "fused")) && aligned16(conv_out) &&
        aligned16(in) && aligned16(dout_bf16)) {
        const int64_t fchunks = dw_chunks(N), frows = (N + fchunks - 1) / fchunks;
        const int64_t warps = fchunks * (C / head_dim);
        const unsigned grid = kl_blocks(warps, KL_ROW_WARPS);
        float *partial = (float *)scratch;
        lm_status lst = LM_OK;
#define CONV_BRING(P, WT) lst = conv_bwd_ring_launch<P, WT, DT>(grid, stream, din, partial, dout_bf16, conv_out, rnorm, \
                                                           in, w, T, C, N, frows, fchunks, ldo)
#define CONV_BRING_W(P)                                                                            \
    switch (W) {                                                                                   \
    case 1: CONV_BRING(P, 1); break;                                                               \
    case 2: CONV_BRING(P, 2); break;                                                               \
    case 3: CONV_BRING(P, 3); break;                                                               \
    default: CONV_BRING(P, 4); break;                                                              \
    }
        switch (head_dim / 32) {
        case 1: CONV_BRING_W(1); break;
        case 2: CONV_BRING_W(2); break;
        case 3: CONV_BRING_W(3); break;
        default: CONV_BRING_W(4); break;
        }
#undef CONV_BRING_W
#undef CONV_BRING
        if (lst) return lst;
        const int64_t len = (int64_t)C * W;
        kl_ordered_partial_sum_kernel<<<kl_partial_sum_grid(len), kl_partial_sum_block(), 0, stream>>>(
            dw, partial, len, fchunks);
        LM_CUDA_TRY(cudaGetLastError());
        *done = 1;
        return LM_OK;
    }
    if (use_fused(W, head_dim)) {
        /* dw's chunks as the two-pass path: the same bits, with or without saved c */
        const int64_t fchunks = dw_chunks(N), frows = (N + fchunks - 1) / fchunks;
        const int64_t warps = fchunks * (C / head_dim);
        const unsigned grid = kl_blocks(warps, KL_ROW_WARPS);
        float *partial = (float *)scratch;
#define CONV_FUSED(P, WT)                                                                          \
    conv_silu_l2_backward_fused_kernel<P, WT, DT><<<grid, KL_ROW_WARPS * 32, 0, stream>>>(            \
        din, partial, dout_bf16, conv_out, rnorm, in, w, T, C, head_dim, N, frows, fchunks, ldo)
#define CONV_FUSED_W(P)                                                                            \
    switch (W) {                                                                                   \
    case 1: CONV_FUSED(P, 1); break;                                                               \
    case 2: CONV_FUSED(P, 2); break;                                                               \
    case 3: CONV_FUSED(P, 3); break;                                                               \
    default: CONV_FUSED(P, 4); break;                                                              \
    }
        switch (head_dim / 32) {
        case 1: CONV_FUSED_W(1); break;
        case 2: CONV_FUSED_W(2); break;
        case 3: CONV_FUSED_W(3); break;
        default: CONV_FUSED_W(4); break;
        }
#undef CONV_FUSED_W
#undef CONV_FUSED
        LM_CUDA_TRY(cudaGetLastError());
        const int64_t len = (int64_t)C * W;
        kl_ordered_partial_sum_kernel<<<kl_partial_sum_grid(len), kl_partial_sum_block(), 0, stream>>>(
            dw, partial, len, fchunks);
        LM_CUDA_TRY(cudaGetLastError());
        *done = 1;
        return LM_OK;
    }
    return LM_OK;
}

extern "C" int lm_cuda_short_conv_silu_backward_bf16_takes(int W, int head_dim) { return use_fused(W, head_dim); }

extern "C" lm_status lm_cuda_short_conv_silu_backward_bf16(const lm_cuda_context *ctx, uint16_t *din_bf16,
                                                           float *dw, const uint16_t *dout_bf16,
                                                           const float *conv_out, const float *rnorm,
                                                           const float *in, const float *w, int B, int T, int C,
                                                           int W, int head_dim, int ld_din, void *scratch) {
    const char *fn = "short_conv_silu_backward_bf16";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (!din_bf16 || !dw || !dout_bf16 || !in || !w || !scratch)
        return lm_error(LM_ERR_ARG, "%s: din_bf16, dw, dout_bf16, in, w and scratch are required", fn);
    lm_status st = check_shape(fn, B, T, C, W, head_dim);
    if (st) return st;
    if (ld_din < C) return lm_error(LM_ERR_ARG, "%s: ld_din = %d is below C = %d", fn, ld_din, C);
    if (!use_fused(W, head_dim))
        return lm_error(LM_ERR_ARG, "%s: needs the one-pass kernels (W <= 4, head_dim <= 128); got W=%d, head_dim=%d",
                        fn, W, head_dim);
    int done = 0;
    if ((st = conv_backward_one_pass<uint16_t>(ctx, din_bf16, dw, dout_bf16, conv_out, rnorm, in, w, B, T, C, W,
                                               head_dim, ld_din, scratch, fn, &done)))
        return st;
    if (!done) return lm_error(LM_ERR_ARG, "%s: the one-pass kernels did not run", fn);
    return LM_OK;
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
    int done = 0;
    if ((st = conv_backward_one_pass<float>(ctx, din, dw, dout_bf16, conv_out, rnorm, in, w, B, T, C, W, head_dim,
                                            C, scratch, fn, &done)))
        return st;
    if (done) return LM_OK;
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
