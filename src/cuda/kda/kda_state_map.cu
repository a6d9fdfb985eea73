// The KDA state map's step across context-parallel segments on the GPU
// (include/longmoe/kda_cuda.h, lm_kda_cuda_state_apply), the mirror of
// lm_kda_state_map_apply / _apply_transposed (src/ops/kda/chunk_state_map.c):
// per pair out = P S + Q, or P^T S + Q, fp32. Each output element is one
// thread's dot product over K in a fixed order, so the result depends only
// on the inputs (the same bits on every rank that applies the same maps).
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "longmoe/kda_cuda.h"

namespace {

constexpr int TILE = 32; // a block: a 32 x 32 tile of one pair's output, 32 x 8 threads, 4 rows a thread

template <bool TRANSPOSED>
__global__ void state_apply_kernel(int K, int V, const float *__restrict__ P, const float *__restrict__ Q,
                                   const float *__restrict__ S, float *__restrict__ out) {
    __shared__ float ps[TILE][TILE + 1]; // ps[r][i]: the factor of output row r0 + r from S row i0 + i
    __shared__ float ss[TILE][TILE + 1]; // ss[i][c]: S[i0 + i, c0 + c]
    const int pair = blockIdx.z, r0 = blockIdx.y * TILE, c0 = blockIdx.x * TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const float *Pp = P + (size_t)pair * K * K;
    const float *Sp = S ? S + (size_t)pair * K * V : nullptr;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (Sp) {
        for (int i0 = 0; i0 < K; i0 += TILE) {
            for (int rr = ty; rr < TILE; rr += 8) {
                const int r = r0 + rr, i = i0 + tx;
                float pv = 0.f;
                if (r < K && i < K) pv = TRANSPOSED ? Pp[(size_t)i * K + r] : Pp[(size_t)r * K + i];
                ps[rr][tx] = pv;
                const int si = i0 + rr, sc = c0 + tx;
                ss[rr][tx] = si < K && sc < V ? Sp[(size_t)si * V + sc] : 0.f;
            }
            __syncthreads();
#pragma unroll 8
            for (int i = 0; i < TILE; i++) {
                const float s = ss[i][tx];
#pragma unroll
                for (int j = 0; j < 4; j++) acc[j] = fmaf(ps[ty + 8 * j][i], s, acc[j]);
            }
            __syncthreads();
        }
    }
    const int c = c0 + tx;
    if (c >= V) return;
    for (int j = 0; j < 4; j++) {
        const int r = r0 + ty + 8 * j;
        if (r >= K) continue;
        const size_t at = (size_t)pair * K * V + (size_t)r * V + c;
        out[at] = acc[j] + Q[at];
    }
}

} // namespace

extern "C" lm_status lm_kda_cuda_state_apply(int n_pairs, int K, int V, const float *P, const float *Q,
                                             const float *S, float *out, int transposed, void *stream) {
    const char *what = "kda state map apply (cuda)";
    if (n_pairs < 1 || K < 1 || V < 1 || n_pairs > 65535)
        return lm_error(LM_ERR_ARG, "%s: n_pairs %d (1..65535), K %d, V %d must be positive", what, n_pairs, K, V);
    if (!P || !Q || !out) return lm_error(LM_ERR_ARG, "%s: %s is NULL", what, !P ? "P" : !Q ? "Q" : "out");
    const size_t nv = (size_t)n_pairs * K * V * sizeof(float);
    if (S && (const char *)out < (const char *)S + nv && (const char *)S < (const char *)out + nv)
        return lm_error(LM_ERR_ARG, "%s: out overlaps S", what);
    dim3 grid((unsigned)((V + TILE - 1) / TILE), (unsigned)((K + TILE - 1) / TILE), (unsigned)n_pairs);
    dim3 block(TILE, 8);
    cudaStream_t s = (cudaStream_t)stream;
    if (transposed) state_apply_kernel<true><<<grid, block, 0, s>>>(K, V, P, Q, S, out);
    else state_apply_kernel<false><<<grid, block, 0, s>>>(K, V, P, Q, S, out);
    (void)what;
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
