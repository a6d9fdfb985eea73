/* The quantile balancer's per-micro-batch histogram and the expert loads on
 * the GPU (include/longmoe/moe_cuda.h; the CPU pass is lm_balance_observe in
 * src/ops/balance/balance.c). Integer counts: the result is exact and
 * independent of the order of the atomic increments. */
#include <math.h>
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "longmoe/moe.h"
#include "longmoe/moe_cuda.h"

/* Tokens a block of the histogram: 128 made 256 blocks at 32768 tokens, two
 * a multiprocessor, whose warps each found 16 thresholds one after the other
 * (a latency-bound chain of warp shuffles). Measured on the H200 at k3-mini's
 * shape (bench_cuda_moe, bench/RESULTS.md): 128 us a launch with 128 tokens,
 * 101 with 64, 87 with 32, 77 with 16; the rest is the global atomics. */
static int hist_tokens = 16;

extern "C" lm_status lm_cuda_balance_set_hist_tokens(int tokens) {
    if (tokens != 8 && tokens != 16 && tokens != 32 && tokens != 64 && tokens != 128)
        return lm_error(LM_ERR_ARG, "balance histogram: %d tokens a block (expected 8, 16, 32, 64 or 128)", tokens);
    hist_tokens = tokens;
    return LM_OK;
}

/* The (k+1)-th largest s + b of one token's n scores, by one warp (EPL scores
 * a lane): k+1 rounds of a warp maximum, each taking one instance of the
 * largest value left. Only the value is used, so ties do not matter. */
template <int EPL>
__device__ float kth_value_warp(const float *si, const float *bias, int n, int kk, int lane) {
    float v[EPL];
    unsigned live = 0;
#pragma unroll
    for (int e = 0; e < EPL; e++) {
        const int j = e * 32 + lane;
        v[e] = 0.0f;
        if (j < n) {
            v[e] = __fadd_rn(si[j], bias ? bias[j] : 0.0f);
            live |= 1u << e;
        }
    }
    float best = 0.0f;
    for (int t = 0; t < kk; t++) {
        int bj = -1;
        float bv = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++)
            if ((live >> e & 1u) && (bj < 0 || v[e] > bv)) {
                bj = e * 32 + lane;
                bv = v[e];
            }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const int oj = __shfl_xor_sync(0xffffffffu, bj, off);
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            if (oj >= 0 && (bj < 0 || ov > bv || (ov == bv && oj < bj))) {
                bj = oj;
                bv = ov;
            }
        }
        if (bj >= 0 && (bj & 31) == lane) live &= ~(1u << (bj >> 5));
        best = bv;
    }
    return best;
}

/* One block: TOK tokens, 256 threads. First each token's threshold
 * alpha = the (k+1)-th largest s + b (the value only, so ties do not matter;
 * -inf when k == n): one warp a token for n <= 512 (EPL = ceil(n / 32)), one
 * thread a token beyond (EPL = 0). Then the block bins every (token, expert)
 * pair. All arithmetic is rounded like the CPU's: x = ((alpha - s) - lo) * (1 / w);
 * lo and 1 / w are read once a block into shared memory. */
template <int EPL, int TOK>
__global__ void balance_histogram_kernel(int32_t *counts, const float *scores, const float *bias, const float *lo,
                                         const float *width, int64_t m, int n, int k, int bins, int zoom) {
    __shared__ float alpha[TOK];
    __shared__ float lo_s[LM_MOE_MAX_EXPERTS], inv_s[LM_MOE_MAX_EXPERTS];
    const int64_t i0 = (int64_t)blockIdx.x * TOK;
    const int kk = k < n ? k + 1 : k;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        lo_s[j] = lo[j];
        inv_s[j] = __fdiv_rn(1.0f, width[j]);
    }
    if constexpr (EPL > 0) {
        const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
        for (int t = threadIdx.x >> 5; t < TOK; t += warps) {
            if (i0 + t >= m) break;
            float a = kth_value_warp<(EPL > 0 ? EPL : 1)>(scores + (i0 + t) * n, bias, n, kk, lane);
            if (lane == 0) alpha[t] = kk > k ? a : -INFINITY;
        }
    } else if (threadIdx.x < TOK && i0 + threadIdx.x < m) {
        const float *si = scores + (i0 + threadIdx.x) * n;
        float val[LM_MOE_MAX_TOPK + 1];
        int have = 0;
        for (int j = 0; j < n; j++) {
            float v = __fadd_rn(si[j], bias ? bias[j] : 0.0f);
            if (have == kk && !(v > val[kk - 1])) continue;
            int pos = have < kk ? have : kk - 1;
            while (pos > 0 && val[pos - 1] < v) {
                val[pos] = val[pos - 1];
                pos--;
            }
            val[pos] = v;
            if (have < kk) have++;
        }
        alpha[threadIdx.x] = kk > k ? val[k] : -INFINITY;
    }
    __syncthreads();
    const int tokens = m - i0 < TOK ? (int)(m - i0) : TOK;
    const int pairs = tokens * n; /* at most 128 x 1024 */
    const float fb = (float)bins, fb2 = (float)(bins - 2);
    const float *sb = scores + i0 * n;
    for (int q = threadIdx.x; q < pairs; q += blockDim.x) {
        const int t = q / n, j = q - t * n;
        float x = __fmul_rn(__fsub_rn(__fsub_rn(alpha[t], sb[q]), lo_s[j]), inv_s[j]);
        int bin;
        if (zoom) bin = x < 0.0f ? 0 : x >= fb2 ? bins - 1 : 1 + (int)x;
        else bin = x < 0.0f ? 0 : x >= fb ? bins - 1 : (int)x;
        atomicAdd(&counts[(int64_t)j * bins + bin], 1);
    }
}

template <int TOK>
static void launch_histogram(cudaStream_t st, int32_t *counts, const float *scores, const float *bias,
                             const float *lo, const float *width, int64_t m, int n, int k, int bins, int z) {
    const unsigned grid = (unsigned)((m + TOK - 1) / TOK);
    if (n <= 128)
        balance_histogram_kernel<4, TOK><<<grid, 256, 0, st>>>(counts, scores, bias, lo, width, m, n, k, bins, z);
    else if (n <= 256)
        balance_histogram_kernel<8, TOK><<<grid, 256, 0, st>>>(counts, scores, bias, lo, width, m, n, k, bins, z);
    else if (n <= 512)
        balance_histogram_kernel<16, TOK><<<grid, 256, 0, st>>>(counts, scores, bias, lo, width, m, n, k, bins, z);
    else balance_histogram_kernel<0, TOK><<<grid, 256, 0, st>>>(counts, scores, bias, lo, width, m, n, k, bins, z);
}

extern "C" lm_status lm_cuda_balance_histogram(const lm_cuda_context *ctx, int32_t *counts, const float *scores,
                                               const float *bias, const float *lo, const float *width, int64_t m,
                                               int n, int k, int bins, int zoom) {
    // scores is (m,n); bias, lo, width (n); counts (n,bins) +=
    if (!ctx || !counts || !lo || !width || (m > 0 && !scores))
        return lm_error(LM_ERR_ARG, "balance histogram: ctx, counts, scores, lo and width must not be NULL");
    if (m < 0) return lm_error(LM_ERR_ARG, "balance histogram: m must be >= 0, got %lld", (long long)m);
    if (n < 2 || n > LM_MOE_MAX_EXPERTS)
        return lm_error(LM_ERR_ARG, "balance histogram: n must lie in [2, %d], got %d", LM_MOE_MAX_EXPERTS, n);
    if (k < 1 || k > n || k > LM_MOE_MAX_TOPK)
        return lm_error(LM_ERR_ARG, "balance histogram: k must lie in [1, min(%d, n)], got %d", LM_MOE_MAX_TOPK, k);
    if (bins < 4) return lm_error(LM_ERR_ARG, "balance histogram: bins must be >= 4, got %d", bins);
    if (m == 0) return LM_OK;
    cudaStream_t st = (cudaStream_t)ctx->stream;
    const int z = zoom ? 1 : 0;
    switch (hist_tokens) {
    case 8: launch_histogram<8>(st, counts, scores, bias, lo, width, m, n, k, bins, z); break;
    case 16: launch_histogram<16>(st, counts, scores, bias, lo, width, m, n, k, bins, z); break;
    case 32: launch_histogram<32>(st, counts, scores, bias, lo, width, m, n, k, bins, z); break;
    case 64: launch_histogram<64>(st, counts, scores, bias, lo, width, m, n, k, bins, z); break;
    default: launch_histogram<128>(st, counts, scores, bias, lo, width, m, n, k, bins, z); break;
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* Each block counts LOAD_SLOTS slots into shared counters, then adds its
 * non-zero counts to load: one global atomic an expert a block instead of one
 * a slot (the 128 counters of k3-mini were a point of contention). */
#define LOAD_SLOTS 4096
__global__ void expert_load_kernel(int32_t *load, const int32_t *topk, int64_t mk, int n) {
    __shared__ int32_t part[LM_MOE_MAX_EXPERTS];
    for (int j = threadIdx.x; j < n; j += blockDim.x) part[j] = 0;
    __syncthreads();
    int64_t g0 = (int64_t)blockIdx.x * LOAD_SLOTS, g1 = g0 + LOAD_SLOTS < mk ? g0 + LOAD_SLOTS : mk;
    for (int64_t g = g0 + threadIdx.x; g < g1; g += blockDim.x) atomicAdd(&part[topk[g]], 1);
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        if (part[j]) atomicAdd(&load[j], part[j]);
}

extern "C" lm_status lm_cuda_expert_load(const lm_cuda_context *ctx, int32_t *load, const int32_t *topk, int64_t m,
                                         int n, int k) {
    // topk is (m,k); load (n) +=
    if (!ctx || !load || (m > 0 && !topk))
        return lm_error(LM_ERR_ARG, "expert load: ctx, load and topk must not be NULL");
    if (m < 0 || n < 1 || k < 1 || k > n)
        return lm_error(LM_ERR_ARG, "expert load: need m >= 0 and 1 <= k <= n; got m %lld n %d k %d", (long long)m,
                        n, k);
    if (m == 0) return LM_OK;
    int64_t mk = m * k;
    if (n > LM_MOE_MAX_EXPERTS)
        return lm_error(LM_ERR_ARG, "expert load: n = %d exceeds %d experts", n, LM_MOE_MAX_EXPERTS);
    expert_load_kernel<<<(unsigned)((mk + LOAD_SLOTS - 1) / LOAD_SLOTS), 256, 0, (cudaStream_t)ctx->stream>>>(
        load, topk, mk, n);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
