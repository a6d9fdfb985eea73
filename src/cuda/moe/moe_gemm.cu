/* Grouped bf16 products of the MoE experts (WMMA, fp32 accumulation) and the
 * fp32 product of the router (src/cuda/moe/moe_internal.cuh). */
#include <stdint.h>

#include <mma.h>

#include "cuda/cuda_check.h"
#include "cuda/moe/moe_internal.cuh"
#include "longmoe/moe_cuda.h"

using namespace nvcuda;

/* Tile of the bf16 product: 128 x 128 outputs, 32 of the contraction per
 * step, 8 warps as 2 x 4, each warp 64 x 32 (4 x 2 fragments of 16 x 16). */
#define GB_M LM_MOE_CUDA_ROW_TILE
#define GB_N 128
#define GB_K 32
#define GB_PAD 8
#define GB_THREADS 256
/* elements of one operand buffer: max of [128][32+8] and [32][128+8] */
#define GB_BUF_ELEMS (GB_M * (GB_K + GB_PAD) > GB_K * (GB_N + GB_PAD) ? GB_M * (GB_K + GB_PAD) : GB_K * (GB_N + GB_PAD))

static_assert(GB_M == 128 && GB_N == 128, "the tile loaders assume 128 x 32 tiles");

/* A tile of OUTER x INNER bf16 from a row-major global array, element (o, e)
 * at g[(o0 + o) ld + e0 + e], zero outside o < olim, e < elim. 512 vectors of
 * 8 elements, two per thread, staged in registers. */
template <int OUTER, int INNER>
struct tile_loader {
    static_assert(OUTER * INNER == 8 * 2 * GB_THREADS, "two 8-wide vectors per thread");
    uint4 v[2];
    __device__ void load(const bf16 *g, int64_t ld, int64_t o0, int64_t olim, int64_t e0, int64_t elim,
                         bool vec) {
        #pragma unroll
        for (int q = 0; q < 2; q++) {
            int idx = threadIdx.x + q * GB_THREADS;
            int o = idx / (INNER / 8), e = (idx % (INNER / 8)) * 8;
            int64_t go = o0 + o, ge = e0 + e;
            if (go < olim && vec && ge + 8 <= elim) {
                v[q] = *reinterpret_cast<const uint4 *>(g + go * ld + ge);
            } else {
                unsigned short h[8];
                #pragma unroll
                for (int t = 0; t < 8; t++)
                    h[t] = (go < olim && ge + t < elim) ? __bfloat16_as_ushort(g[go * ld + ge + t]) : (unsigned short)0;
                v[q].x = h[0] | ((unsigned)h[1] << 16);
                v[q].y = h[2] | ((unsigned)h[3] << 16);
                v[q].z = h[4] | ((unsigned)h[5] << 16);
                v[q].w = h[6] | ((unsigned)h[7] << 16);
            }
        }
    }
    __device__ void store(bf16 *s) const {
        #pragma unroll
        for (int q = 0; q < 2; q++) {
            int idx = threadIdx.x + q * GB_THREADS;
            int o = idx / (INNER / 8), e = (idx % (INNER / 8)) * 8;
            *reinterpret_cast<uint4 *>(s + o * (INNER + GB_PAD) + e) = v[q];
        }
    }
};

template <lm_gemm_layout L>
__global__ void __launch_bounds__(GB_THREADS) gemm_bf16_kernel(lm_gemm_bf16_args g, bool vec_a, bool vec_b) {
    constexpr bool AT = L == LM_GEMM_TN;  /* A stored [K][M] */
    constexpr bool BT = L == LM_GEMM_NT;  /* B stored [N][K] */
    __shared__ __align__(128) bf16 smem[2][2][GB_BUF_ELEMS];

    const int64_t row0 = (int64_t)blockIdx.y * GB_M, col0 = (int64_t)blockIdx.x * GB_N;
    const bf16 *b = g.b;
    float *c = g.c;
    bf16 *cb = g.cb;
    int64_t kbeg = 0, kend = g.K;
    if (AT) {
        if (g.group_offsets) {
            int j = blockIdx.z;
            kbeg = g.group_offsets[j];
            kend = g.group_offsets[j + 1];
            if (c) c += (int64_t)j * g.c_group_stride;
            if (cb) cb += (int64_t)j * g.c_group_stride;
        }
    } else if (g.group_offsets) {
        if (row0 >= (int64_t)g.group_offsets[g.groups]) return;
        b += (int64_t)group_of_row(g.group_offsets, g.groups, row0) * g.b_group_stride;
    }

    tile_loader<AT ? GB_K : GB_M, AT ? GB_M : GB_K> la;
    tile_loader<BT ? GB_N : GB_K, BT ? GB_K : GB_N> lb;
    auto load = [&](int64_t k0) {
        if (AT) la.load(g.a, g.lda, k0, kend, row0, g.M, vec_a);
        else la.load(g.a, g.lda, row0, g.M, k0, kend, vec_a);
        if (BT) lb.load(b, g.ldb, col0, g.N, k0, kend, vec_b);
        else lb.load(b, g.ldb, k0, kend, col0, g.N, vec_b);
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / 4, wn = warp % 4;
    typedef typename std::conditional<AT, wmma::col_major, wmma::row_major>::type a_layout;
    typedef typename std::conditional<BT, wmma::col_major, wmma::row_major>::type b_layout;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
    #pragma unroll
    for (int i = 0; i < 4; i++)
        #pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);

    const int64_t nk = kend > kbeg ? (kend - kbeg + GB_K - 1) / GB_K : 0;
    if (nk > 0) {
        load(kbeg);
        la.store(smem[0][0]);
        lb.store(smem[0][1]);
    }
    __syncthreads();
    for (int64_t t = 0; t < nk; t++) {
        const int cur = (int)(t & 1);
        if (t + 1 < nk) load(kbeg + (t + 1) * GB_K);
        const bf16 *As = smem[cur][0], *Bs = smem[cur][1];
        #pragma unroll
        for (int kk = 0; kk < GB_K; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, a_layout> fa[4];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, b_layout> fb[2];
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = wm * 64 + i * 16;
                if (AT) wmma::load_matrix_sync(fa[i], As + kk * (GB_M + GB_PAD) + r, GB_M + GB_PAD);
                else wmma::load_matrix_sync(fa[i], As + r * (GB_K + GB_PAD) + kk, GB_K + GB_PAD);
            }
            #pragma unroll
            for (int j = 0; j < 2; j++) {
                int cc = wn * 32 + j * 16;
                if (BT) wmma::load_matrix_sync(fb[j], Bs + cc * (GB_K + GB_PAD) + kk, GB_K + GB_PAD);
                else wmma::load_matrix_sync(fb[j], Bs + kk * (GB_N + GB_PAD) + cc, GB_N + GB_PAD);
            }
            #pragma unroll
            for (int i = 0; i < 4; i++)
                #pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        if (t + 1 < nk) {
            la.store(smem[cur ^ 1][0]);
            lb.store(smem[cur ^ 1][1]);
        }
        __syncthreads();
    }

    /* epilogue through a per-warp 16 x 16 fp32 staging tile (the operand
     * buffers are free: the loop ended with a barrier) */
    float *stage = reinterpret_cast<float *>(&smem[0][0][0]) + warp * 256;
    const int sr = lane >> 1, sc = (lane & 1) * 8;
    #pragma unroll
    for (int i = 0; i < 4; i++)
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            int64_t r = row0 + wm * 64 + i * 16 + sr, col = col0 + wn * 32 + j * 16 + sc;
            if (r < g.M) {
                #pragma unroll
                for (int q = 0; q < 8; q++) {
                    if (col + q >= g.N) break;
                    float v = stage[sr * 16 + sc + q];
                    int64_t o = r * g.ldc + col + q;
                    if (c) c[o] = g.accumulate ? c[o] + v : v;
                    else cb[o] = __float2bfloat16_rn(g.accumulate ? __bfloat162float(cb[o]) + v : v);
                }
            }
            __syncwarp();
        }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

lm_status lm_moe_gemm_bf16(cudaStream_t stream, const lm_gemm_bf16_args *g) {
    if (g->M <= 0 || g->N <= 0) return LM_OK;
    if ((g->c == NULL) == (g->cb == NULL)) return lm_error(LM_ERR_ARG, "moe gemm: exactly one of c, cb");
    bool vec_a = aligned16(g->a) && g->lda % 8 == 0;
    bool vec_b = aligned16(g->b) && g->ldb % 8 == 0 && g->b_group_stride % 8 == 0;
    int64_t ytiles = (g->M + GB_M - 1) / GB_M, xtiles = (g->N + GB_N - 1) / GB_N;
    if (ytiles > 65535) return lm_error(LM_ERR_ARG, "moe gemm: %lld rows exceed the grid", (long long)g->M);
    dim3 grid((unsigned)xtiles, (unsigned)ytiles, 1);
    if (g->layout == LM_GEMM_TN && g->group_offsets) grid.z = (unsigned)g->groups;
    switch (g->layout) {
    case LM_GEMM_NT: gemm_bf16_kernel<LM_GEMM_NT><<<grid, GB_THREADS, 0, stream>>>(*g, vec_a, vec_b); break;
    case LM_GEMM_NN: gemm_bf16_kernel<LM_GEMM_NN><<<grid, GB_THREADS, 0, stream>>>(*g, vec_a, vec_b); break;
    case LM_GEMM_TN: gemm_bf16_kernel<LM_GEMM_TN><<<grid, GB_THREADS, 0, stream>>>(*g, vec_a, vec_b); break;
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

/* fp32 product: 64 x 64 outputs per block of 256 threads, 4 x 4 each
 * (rows ty + 16 r, columns tx + 16 c), 16 of the contraction per step. */
#define GF_T 64
#define GF_K 16

template <lm_gemm_layout L>
__global__ void __launch_bounds__(256) gemm_f32_kernel(const float *a, int64_t lda, const float *b, int64_t ldb,
                                                       float *c, int64_t ldc, int accumulate, int64_t M,
                                                       int64_t N, int64_t K) {
    __shared__ float As[GF_K][GF_T + 4], Bs[GF_K][GF_T + 4];
    const int64_t row0 = (int64_t)blockIdx.y * GF_T, col0 = (int64_t)blockIdx.x * GF_T;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {};
    for (int64_t k0 = 0; k0 < K; k0 += GF_K) {
        #pragma unroll
        for (int q = 0; q < 4; q++) {
            int e = threadIdx.x + q * 256;
            int i, kk;
            if (L == LM_GEMM_TN) { kk = e / GF_T; i = e % GF_T; }
            else { i = e / GF_K; kk = e % GF_K; }
            int64_t gi = row0 + i, gk = k0 + kk;
            float v = 0.0f;
            if (gi < M && gk < K) v = L == LM_GEMM_TN ? a[gk * lda + gi] : a[gi * lda + gk];
            As[kk][i] = v;
            int cc;
            if (L == LM_GEMM_NT) { cc = e / GF_K; kk = e % GF_K; }
            else { kk = e / GF_T; cc = e % GF_T; }
            int64_t gc = col0 + cc;
            gk = k0 + kk;
            v = 0.0f;
            if (gc < N && gk < K) v = L == LM_GEMM_NT ? b[gc * ldb + gk] : b[gk * ldb + gc];
            Bs[kk][cc] = v;
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < GF_K; kk++) {
            float av[4], bv[4];
            #pragma unroll
            for (int r = 0; r < 4; r++) av[r] = As[kk][ty + 16 * r];
            #pragma unroll
            for (int q = 0; q < 4; q++) bv[q] = Bs[kk][tx + 16 * q];
            #pragma unroll
            for (int r = 0; r < 4; r++)
                #pragma unroll
                for (int q = 0; q < 4; q++) acc[r][q] = fmaf(av[r], bv[q], acc[r][q]);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 4; r++)
        #pragma unroll
        for (int q = 0; q < 4; q++) {
            int64_t gi = row0 + ty + 16 * r, gc = col0 + tx + 16 * q;
            if (gi < M && gc < N) {
                float *o = c + gi * ldc + gc;
                *o = accumulate ? *o + acc[r][q] : acc[r][q];
            }
        }
}

lm_status lm_moe_gemm_f32(cudaStream_t stream, lm_gemm_layout layout, const float *a, int64_t lda,
                          const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M,
                          int64_t N, int64_t K) {
    if (M <= 0 || N <= 0) return LM_OK;
    int64_t ytiles = (M + GF_T - 1) / GF_T, xtiles = (N + GF_T - 1) / GF_T;
    if (ytiles > 65535) return lm_error(LM_ERR_ARG, "router gemm: %lld rows exceed the grid", (long long)M);
    dim3 grid((unsigned)xtiles, (unsigned)ytiles);
    switch (layout) {
    case LM_GEMM_NT: gemm_f32_kernel<LM_GEMM_NT><<<grid, 256, 0, stream>>>(a, lda, b, ldb, c, ldc, accumulate, M, N, K); break;
    case LM_GEMM_NN: gemm_f32_kernel<LM_GEMM_NN><<<grid, 256, 0, stream>>>(a, lda, b, ldb, c, ldc, accumulate, M, N, K); break;
    case LM_GEMM_TN: gemm_f32_kernel<LM_GEMM_TN><<<grid, 256, 0, stream>>>(a, lda, b, ldb, c, ldc, accumulate, M, N, K); break;
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
