/* The router's fp32 products on tensor cores: 3xTF32 (src/cuda/moe/moe_internal.cuh).
 *
 * Each fp32 operand x is split into big = tf32(x) (round to nearest) and
 * small = tf32(x - big); a product is then small_a big_b + big_a small_b +
 * big_a big_b with fp32 accumulation (mma.sync m16n8k8 tf32). The dropped
 * small_a small_b term and the rounding of small are about 2^-21 of |a b|, so
 * the result is as close to the float64 product as a plain fp32 product is
 * (tests/test_cuda_moe.c measures both against float64), at tensor-core speed
 * instead of the fp32 SIMT units'. Every output element is summed in a fixed
 * order; the split-K partials of the weight gradient are added in split order:
 * deterministic. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_check.h"
#include "cuda/moe/moe_internal.cuh"

/* 128 x 128 outputs a block of 8 warps (2 x 4, each 64 x 32), 32 of the
 * contraction per step. A k-contiguous operand sits in shared memory as
 * [128][32 + 4], an m- or n-contiguous one as [32][128 + 8]: both give
 * conflict-free fragment reads. */
#define RG_T 128
#define RG_K 32
#define RG_THREADS 256
#define RG_KPAD 4
#define RG_TPAD 8
#define RG_ELEMS (RG_T * (RG_K + RG_KPAD) > RG_K * (RG_T + RG_TPAD) ? RG_T * (RG_K + RG_KPAD) : RG_K * (RG_T + RG_TPAD))

__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void split3(float x, uint32_t &big, uint32_t &small) {
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}

__device__ __forceinline__ void mma_tf32(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* One operand's tile: KMAJOR (the contraction is contiguous in memory): OUTER
 * = 128 rows (or columns) x INNER = 32 of the contraction; otherwise OUTER =
 * 32 of the contraction x INNER = 128. Element (o, i) at g[(o0 + o) ld + i0 + i],
 * zero outside o0 + o < olim, i0 + i < ilim. Four 4-float vectors a thread,
 * staged in registers so the next tile loads while this one is used. */
template <bool KMAJOR>
struct rg_loader {
    static constexpr int INNER = KMAJOR ? RG_K : RG_T;
    static constexpr int STRIDE = KMAJOR ? RG_K + RG_KPAD : RG_T + RG_TPAD;
    float4 v[4];
    __device__ void load(const float *g, int64_t ld, int64_t o0, int64_t olim, int64_t i0, int64_t ilim, bool vec) {
        #pragma unroll
        for (int q = 0; q < 4; q++) {
            int idx = threadIdx.x + q * RG_THREADS;
            int o = idx / (INNER / 4), i = (idx % (INNER / 4)) * 4;
            int64_t go = o0 + o, gi = i0 + i;
            if (vec && go < olim && gi + 4 <= ilim) {
                v[q] = *reinterpret_cast<const float4 *>(g + go * ld + gi);
            } else {
                float t[4];
                #pragma unroll
                for (int e = 0; e < 4; e++) t[e] = (go < olim && gi + e < ilim) ? g[go * ld + gi + e] : 0.0f;
                v[q] = make_float4(t[0], t[1], t[2], t[3]);
            }
        }
    }
    /* the tile split once into its TF32 parts (big, small), each element
     * once a block rather than once a warp that reads it */
    __device__ void store(uint32_t *big, uint32_t *small) const {
        #pragma unroll
        for (int q = 0; q < 4; q++) {
            int idx = threadIdx.x + q * RG_THREADS;
            int o = idx / (INNER / 4), i = (idx % (INNER / 4)) * 4;
            uint4 b, sm;
            split3(v[q].x, b.x, sm.x);
            split3(v[q].y, b.y, sm.y);
            split3(v[q].z, b.z, sm.z);
            split3(v[q].w, b.w, sm.w);
            *reinterpret_cast<uint4 *>(big + o * STRIDE + i) = b;
            *reinterpret_cast<uint4 *>(small + o * STRIDE + i) = sm;
        }
    }
    /* element (row-or-column r of the tile, contraction k) of a stored part */
    static __device__ __forceinline__ uint32_t at(const uint32_t *s, int r, int k) {
        return KMAJOR ? s[r * STRIDE + k] : s[k * STRIDE + r];
    }
};

/* C (+)= A B over the contraction range of split blockIdx.z (k_chunk long);
 * with ws, the block's partial goes to ws[z][M][N] instead. Layouts as
 * lm_moe_gemm_f32: NT A[i][k] = a[i lda + k], B[k][j] = b[j ldb + k]; NN
 * A = a[i lda + k], B = b[k ldb + j]; TN A = a[k lda + i], B = b[k ldb + j]. */
template <lm_gemm_layout L, int MINB>
__global__ void __launch_bounds__(RG_THREADS, MINB) router_3xtf32_kernel(const float *a, int64_t lda, const float *b,
                                                                   int64_t ldb, float *c, int64_t ldc, int accumulate,
                                                                   int64_t M, int64_t N, int64_t K, int64_t k_chunk,
                                                                   float *ws, bool vec_a, bool vec_b) {
    constexpr bool AK = L != LM_GEMM_TN; /* A's contraction contiguous */
    constexpr bool BK = L == LM_GEMM_NT; /* B's contraction contiguous */
    extern __shared__ __align__(16) uint32_t rg_smem[];
    uint32_t *Ab = rg_smem, *As = Ab + RG_ELEMS, *Bb = As + RG_ELEMS, *Bs = Bb + RG_ELEMS;
    const int64_t row0 = (int64_t)blockIdx.y * RG_T, col0 = (int64_t)blockIdx.x * RG_T;
    const int64_t kb = (int64_t)blockIdx.z * k_chunk, ke = kb + k_chunk < K ? kb + k_chunk : K;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int wm = (warp % 2) * 64, wn = (warp / 2) * 32;
    rg_loader<AK> la;
    rg_loader<BK> lb;
    float acc[4][4][4] = {};
    auto load = [&](int64_t k0) {
        if (AK) la.load(a, lda, row0, M, k0, ke, vec_a);
        else la.load(a, lda, k0, ke, row0, M, vec_a);
        if (BK) lb.load(b, ldb, col0, N, k0, ke, vec_b);
        else lb.load(b, ldb, k0, ke, col0, N, vec_b);
    };
    if (kb < ke) load(kb);
    for (int64_t k0 = kb; k0 < ke; k0 += RG_K) {
        la.store(Ab, As);
        lb.store(Bb, Bs);
        __syncthreads();
        if (k0 + RG_K < ke) load(k0 + RG_K);
        #pragma unroll
        for (int kk = 0; kk < RG_K; kk += 8) {
            uint32_t ab[4][4], as[4][4], bb[4][2], bs[4][2];
            #pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                int r = wm + mi * 16 + g;
                ab[mi][0] = rg_loader<AK>::at(Ab, r, kk + t);
                ab[mi][1] = rg_loader<AK>::at(Ab, r + 8, kk + t);
                ab[mi][2] = rg_loader<AK>::at(Ab, r, kk + t + 4);
                ab[mi][3] = rg_loader<AK>::at(Ab, r + 8, kk + t + 4);
                as[mi][0] = rg_loader<AK>::at(As, r, kk + t);
                as[mi][1] = rg_loader<AK>::at(As, r + 8, kk + t);
                as[mi][2] = rg_loader<AK>::at(As, r, kk + t + 4);
                as[mi][3] = rg_loader<AK>::at(As, r + 8, kk + t + 4);
            }
            #pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                int cc = wn + ni * 8 + g;
                bb[ni][0] = rg_loader<BK>::at(Bb, cc, kk + t);
                bb[ni][1] = rg_loader<BK>::at(Bb, cc, kk + t + 4);
                bs[ni][0] = rg_loader<BK>::at(Bs, cc, kk + t);
                bs[ni][1] = rg_loader<BK>::at(Bs, cc, kk + t + 4);
            }
            /* the three part products in passes over all 16 accumulators (the
             * small ones first), so no mma waits on the one before it */
            #pragma unroll
            for (int mi = 0; mi < 4; mi++)
                #pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_tf32(acc[mi][ni], as[mi], bb[ni]);
            #pragma unroll
            for (int mi = 0; mi < 4; mi++)
                #pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_tf32(acc[mi][ni], ab[mi], bs[ni]);
            #pragma unroll
            for (int mi = 0; mi < 4; mi++)
                #pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_tf32(acc[mi][ni], ab[mi], bb[ni]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int mi = 0; mi < 4; mi++)
        #pragma unroll
        for (int ni = 0; ni < 4; ni++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                int64_t gi = row0 + wm + mi * 16 + g + (e >= 2 ? 8 : 0), gc = col0 + wn + ni * 8 + 2 * t + (e & 1);
                if (gi >= M || gc >= N) continue;
                if (ws) {
                    ws[((int64_t)blockIdx.z * M + gi) * N + gc] = acc[mi][ni][e];
                } else {
                    float *o = c + gi * ldc + gc;
                    *o = accumulate ? *o + acc[mi][ni][e] : acc[mi][ni][e];
                }
            }
}

/* shared memory of a block: the big and small parts of both tiles */
#define RG_SMEM (4 * RG_ELEMS * (int)sizeof(uint32_t))

/* c[i][j] (+)= the splits' partials, added in split order */
__global__ void router_split_sum_kernel(float *c, int64_t ldc, int accumulate, const float *ws, int splits, int64_t M,
                                        int64_t N) {
    int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= M * N) return;
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s += ws[(int64_t)z * M * N + q];
    float *o = c + (q / N) * ldc + q % N;
    *o = accumulate ? *o + s : s;
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Blocks the split-K aims at when the output has few tiles (about two a
 * multiprocessor of an H100/H200); fixed, so the bits do not depend on the GPU. */
#define RG_SPLIT_TARGET 256
#define RG_MAX_SPLITS 64

extern "C" int lm_cuda_router_splits(int64_t M, int64_t N, int64_t K, size_t ws_floats) {
    int64_t tiles = ((M + RG_T - 1) / RG_T) * ((N + RG_T - 1) / RG_T);
    if (tiles >= RG_SPLIT_TARGET / 2 || M * N <= 0) return 1;
    int64_t s = (RG_SPLIT_TARGET + tiles - 1) / tiles;
    int64_t by_k = K / (4 * RG_K); /* at least four steps a split */
    int64_t by_ws = (int64_t)(ws_floats / (size_t)(M * N));
    if (s > by_k) s = by_k;
    if (s > by_ws) s = by_ws;
    if (s > RG_MAX_SPLITS) s = RG_MAX_SPLITS;
    return s < 2 ? 1 : (int)s;
}

template <int MINB>
static cudaError_t set_smem() {
    cudaError_t e = cudaFuncSetAttribute(router_3xtf32_kernel<LM_GEMM_NT, MINB>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, RG_SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(router_3xtf32_kernel<LM_GEMM_NN, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 RG_SMEM);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(router_3xtf32_kernel<LM_GEMM_TN, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 RG_SMEM);
    return e;
}

template <int MINB>
static void launch(dim3 grid, cudaStream_t stream, lm_gemm_layout layout, const float *a, int64_t lda, const float *b,
                   int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M, int64_t N, int64_t K,
                   int64_t k_chunk, float *part, bool vec_a, bool vec_b) {
    switch (layout) {
    case LM_GEMM_NT:
        router_3xtf32_kernel<LM_GEMM_NT, MINB><<<grid, RG_THREADS, RG_SMEM, stream>>>(
            a, lda, b, ldb, c, ldc, accumulate, M, N, K, k_chunk, part, vec_a, vec_b);
        break;
    case LM_GEMM_NN:
        router_3xtf32_kernel<LM_GEMM_NN, MINB><<<grid, RG_THREADS, RG_SMEM, stream>>>(
            a, lda, b, ldb, c, ldc, accumulate, M, N, K, k_chunk, part, vec_a, vec_b);
        break;
    case LM_GEMM_TN:
        router_3xtf32_kernel<LM_GEMM_TN, MINB><<<grid, RG_THREADS, RG_SMEM, stream>>>(
            a, lda, b, ldb, c, ldc, accumulate, M, N, K, k_chunk, part, vec_a, vec_b);
        break;
    }
}

lm_status lm_moe_gemm_3xtf32(cudaStream_t stream, lm_gemm_layout layout, const float *a, int64_t lda, const float *b,
                             int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M, int64_t N, int64_t K,
                             float *ws, size_t ws_floats) {
    if (M <= 0 || N <= 0) return LM_OK;
    if (K < 0) return lm_error(LM_ERR_ARG, "router gemm: K = %lld", (long long)K);
    int64_t ytiles = (M + RG_T - 1) / RG_T, xtiles = (N + RG_T - 1) / RG_T;
    if (ytiles > 65535) return lm_error(LM_ERR_ARG, "router gemm: %lld rows exceed the grid", (long long)M);
    int splits = ws ? lm_cuda_router_splits(M, N, K, ws_floats) : 1;
    int64_t k_chunk = K;
    if (splits > 1) {
        int64_t steps = (K + RG_K - 1) / RG_K;
        k_chunk = (steps + splits - 1) / splits * RG_K;
        splits = (int)((K + k_chunk - 1) / k_chunk);
    }
    static int minb = 0;
    if (!minb) {
        const char *env = getenv("LONGMOE_ROUTER_BLOCKS");
        minb = env && !strcmp(env, "2") ? 2 : 1;
        LM_CUDA_TRY(set_smem<1>());
        LM_CUDA_TRY(set_smem<2>());
    }
    bool vec_a = aligned16(a) && lda % 4 == 0, vec_b = aligned16(b) && ldb % 4 == 0;
    float *part = splits > 1 ? ws : NULL;
    dim3 grid((unsigned)xtiles, (unsigned)ytiles, (unsigned)splits);
    if (minb == 2) launch<2>(grid, stream, layout, a, lda, b, ldb, c, ldc, accumulate, M, N, K, k_chunk, part, vec_a, vec_b);
    else launch<1>(grid, stream, layout, a, lda, b, ldb, c, ldc, accumulate, M, N, K, k_chunk, part, vec_a, vec_b);
    LM_CUDA_TRY(cudaGetLastError());
    if (part) {
        int64_t n = M * N;
        router_split_sum_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(c, ldc, accumulate, part, splits, M,
                                                                                  N);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_router_product(const lm_cuda_context *ctx, int layout, const float *a, int64_t lda,
                                            const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate,
                                            int64_t M, int64_t N, int64_t K, float *ws, size_t ws_floats) {
    if (!ctx) return lm_error(LM_ERR_ARG, "router product: ctx must not be NULL");
    if (layout < LM_GEMM_NT || layout > LM_GEMM_TN)
        return lm_error(LM_ERR_ARG, "router product: layout %d (expected 0 NT, 1 NN or 2 TN)", layout);
    if (M > 0 && N > 0 && (!a || !b || !c)) return lm_error(LM_ERR_ARG, "router product: a, b and c must not be NULL");
    return lm_moe_gemm_3xtf32((cudaStream_t)ctx->stream, (lm_gemm_layout)layout, a, lda, b, ldb, c, ldc, accumulate,
                              M, N, K, ws, ws_floats);
}

/* ---- the selector ---- */

static int router_kind = -1; /* -1: not read yet, -2: a bad environment value */
static char router_bad_env[64];

extern "C" lm_status lm_cuda_router_gemm(lm_router_gemm_kind *kind) {
    if (router_kind == -1) {
        const char *env = getenv("LONGMOE_ROUTER_GEMM");
        router_kind = LM_ROUTER_GEMM_3XTF32;
        if (env && *env) {
            if (!strcmp(env, "3xtf32")) router_kind = LM_ROUTER_GEMM_3XTF32;
            else if (!strcmp(env, "fp32")) router_kind = LM_ROUTER_GEMM_FP32;
            else {
                snprintf(router_bad_env, sizeof router_bad_env, "%s", env);
                router_kind = -2;
            }
        }
    }
    if (router_kind == -2)
        return lm_error(LM_ERR_ARG, "LONGMOE_ROUTER_GEMM=%s: expected 3xtf32 or fp32", router_bad_env);
    if (kind) *kind = (lm_router_gemm_kind)router_kind;
    return LM_OK;
}

extern "C" lm_status lm_cuda_set_router_gemm(lm_router_gemm_kind kind) {
    if (kind != LM_ROUTER_GEMM_3XTF32 && kind != LM_ROUTER_GEMM_FP32)
        return lm_error(LM_ERR_ARG, "router gemm kind %d: expected 3xtf32 (0) or fp32 (1)", (int)kind);
    router_kind = kind;
    return LM_OK;
}
