/* Cross-entropy with the LM head on the GPU (include/longmoe/linear_cuda.h),
 * the CUDA twin of the chunked loop of lm_model_forward / lm_model_backward:
 * the [n, V] logits never exist at once; a chunk of R rows is computed (fp32,
 * cuBLASLt), reduced to its log-sum-exp, and, in the backward, turned into
 * dlogits = (softmax - onehot) * scale (* row_scale[r]) rounded to bf16 for
 * the two products dhn += dlogits . head and dhead += dlogits^T . hn.
 *
 * Memory: the log-sum-exp reads each chunk's logits once (a running max and
 * sum of exponentials, 16-byte loads); dlogits reads them once and writes
 * bf16 once (16-byte loads, 8-byte stores). Forward and backward in one call
 * (the training step) read each row once: ce_fused_kernel copies the row into
 * shared memory (cp.async) and works from there (vocab a multiple of 4 and a row within a
 * block's shared memory: up to about 56K on sm_90), with the same bits.
 *
 * Determinism: each row's max and sum of exponentials are fixed trees over a
 * block; the loss is the sum of per-row losses by one block (a fixed stride
 * over rows, then a fixed tree, in fp64); dhead sums over chunks in order
 * (cuBLASLt with beta = 1, one chunk after another). */
#include <stdint.h>

#include "cuda/common/cp_async.cuh"
#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

#define CE_THREADS 256
#define CE_SUM_THREADS 1024

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

static size_t ce_bytes(int64_t n, int vocab, int64_t rows) {
    return align256((size_t)n * sizeof(float)) + align256((size_t)rows * (size_t)vocab * sizeof(float)) +
           align256((size_t)rows * (size_t)vocab * sizeof(uint16_t));
}

extern "C" size_t lm_cuda_cross_entropy_workspace_bytes(int64_t n, int d, int vocab, int64_t rows_per_chunk) {
    if (n <= 0 || vocab <= 0) return 0;
    if (rows_per_chunk < 1) rows_per_chunk = 1;
    if (rows_per_chunk > n) rows_per_chunk = n;
    return ce_bytes(n, vocab, rows_per_chunk);
}

/* The most rows a chunk can have in `bytes` of workspace (0: too small). */
static int64_t ce_chunk_rows(int64_t n, int vocab, size_t bytes) {
    size_t fixed = align256((size_t)n * sizeof(float));
    if (bytes <= fixed) return 0;
    int64_t rows = (int64_t)((bytes - fixed) / ((size_t)vocab * 6));
    if (rows > n) rows = n;
    while (rows > 0 && ce_bytes(n, vocab, rows) > bytes) rows--;
    return rows;
}

typedef struct {
    float *row_loss; /* [n] */
    float *logits;   /* [R, V] */
    uint16_t *dlogits; /* [R, V] bf16 */
} ce_workspace;

static ce_workspace ce_carve(void *base, int64_t n, int vocab, int64_t rows) {
    ce_workspace w;
    char *p = (char *)base;
    w.row_loss = (float *)p;
    p += align256((size_t)n * sizeof(float));
    w.logits = (float *)p;
    p += align256((size_t)rows * (size_t)vocab * sizeof(float));
    w.dlogits = (uint16_t *)p;
    return w;
}

/* (m, s) of a running log-sum-exp: the max so far and sum exp(z - m) */
__device__ __forceinline__ void ce_lse_push(float &m, float &s, float z) {
    if (z > m) {
        s = s * expf(m - z) + 1.0f;
        m = z;
    } else {
        s += expf(z - m);
    }
}

/* the union of two (m, s); commutative bit for bit, so a butterfly leaves
 * every lane with the same bits */
__device__ __forceinline__ void ce_lse_merge(float &m, float &s, float m2, float s2) {
    float M = fmaxf(m, m2);
    s = M == -INFINITY ? 0.0f : s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}

/* The row's lse from every thread's (m, s): a fixed warp butterfly, then warp by
 * warp in order (wm, ws: CE_THREADS / 32 floats of shared memory each); the
 * value is thread 0's (the others return 0). Both row kernels reduce through it,
 * so their lse agree bit for bit. */
__device__ __forceinline__ float ce_block_lse(float m, float s, float *wm, float *ws) {
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ce_lse_merge(m, s, m2, s2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) wm[warp] = m, ws[warp] = s;
    __syncthreads();
    if (threadIdx.x != 0) return 0.0f;
    float M = wm[0], S = ws[0];
    for (int k = 1; k < CE_THREADS / 32; k++) ce_lse_merge(M, S, wm[k], ws[k]);
    return M + logf(S);
}

/* One block per row of the chunk, ONE pass over the row (a running max and
 * sum of exponentials per thread, VEC floats a load, merged by a fixed warp
 * butterfly and then warp by warp in order): lse[r] and row_loss[r] = lse[r]
 * - z[target]. */
template <int VEC>
__global__ void ce_lse_kernel(float *lse, float *row_loss, const float *logits, const int32_t *targets, int vocab) {
    __shared__ float wm[CE_THREADS / 32], ws[CE_THREADS / 32];
    const float *z = logits + (int64_t)blockIdx.x * vocab;
    float m = -INFINITY, s = 0.0f;
#pragma unroll 4
    for (int v = threadIdx.x * VEC; v < vocab; v += CE_THREADS * VEC) {
        if constexpr (VEC == 4) {
            float4 q = __ldg((const float4 *)(z + v));
            ce_lse_push(m, s, q.x);
            ce_lse_push(m, s, q.y);
            ce_lse_push(m, s, q.z);
            ce_lse_push(m, s, q.w);
        } else {
            ce_lse_push(m, s, __ldg(z + v));
        }
    }
    const float l = ce_block_lse(m, s, wm, ws);
    if (threadIdx.x == 0) {
        lse[blockIdx.x] = l;
        row_loss[blockIdx.x] = l - z[targets[blockIdx.x]];
    }
}

/* *out = sum of x[0, n): thread t adds rows t, t + T, ... (fp64), then a fixed tree. */
__global__ void ce_sum_kernel(float *out, const float *x, int64_t n) {
    __shared__ double part[CE_SUM_THREADS];
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += CE_SUM_THREADS) acc += (double)x[i];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = CE_SUM_THREADS / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = (float)part[0];
}

/* Four dlogits from four logits q (at columns v .. v + 3, tk = target - v), one 8-byte store of
 * their bf16: bf16((exp(z - l) - [column == target]) * s). Both dlogits kernels write through it. */
__device__ __forceinline__ void ce_dlogits4(uint16_t *g, float4 q, float l, int tk, float s) {
    const float e[4] = {q.x, q.y, q.z, q.w};
    uint16_t b[4];
#pragma unroll
    for (int k = 0; k < 4; k++) b[k] = lin_f32_to_bf16((expf(e[k] - l) - (k == tk ? 1.0f : 0.0f)) * s);
    uint2 u;
    u.x = (uint32_t)b[0] | ((uint32_t)b[1] << 16);
    u.y = (uint32_t)b[2] | ((uint32_t)b[3] << 16);
    *(uint2 *)g = u;
}

/* dlogits[r, v] = bf16((exp(z - lse[r]) - [v == target]) * scale * row_scale[r]);
 * VEC logits a load (16 bytes), VEC bf16 a store */
template <int VEC>
__global__ void ce_dlogits_kernel(uint16_t *dlogits, const float *logits, const float *lse, const int32_t *targets,
                                  const float *row_scale, float scale, int vocab) {
    int64_t r = blockIdx.x;
    const float *z = logits + r * vocab;
    uint16_t *g = dlogits + r * vocab;
    float l = lse[r], s = scale * (row_scale ? row_scale[r] : 1.0f);
    int t = targets[r];
#pragma unroll 4
    for (int v = threadIdx.x * VEC; v < vocab; v += CE_THREADS * VEC) {
        if constexpr (VEC == 4) {
            ce_dlogits4(g + v, __ldg((const float4 *)(z + v)), l, t - v, s);
        } else {
            float p = expf(__ldg(z + v) - l);
            g[v] = lin_f32_to_bf16((p - (v == t ? 1.0f : 0.0f)) * s);
        }
    }
}

/* Forward and backward of one row in one read of its logits: ce_lse_kernel<4>'s
 * pass (the same elements a thread in the same order, the same merges: its lse
 * and row loss bit for bit) over a copy of the row in shared memory, and
 * ce_dlogits_kernel<4>'s arithmetic then from there (its bits). The separate
 * kernels read each row from DRAM twice (the chunk is far larger than L2). A row
 * takes vocab * 4 bytes of shared memory (128 KB at 32768: one block an SM), so
 * each thread puts the whole row's copies in flight at once (cp.async, its own
 * 16-byte pieces, in CE_FUSED_GROUPS commit groups) and works through a group as
 * soon as it has landed; a thread reads only the pieces it copied itself. */
#define CE_FUSED_GROUPS 4
static_assert(CE_FUSED_GROUPS == 4, "ce_fused_wait names each group's wait");
__device__ __forceinline__ void ce_fused_wait(int g) { /* until group g of the CE_FUSED_GROUPS landed */
    switch (g) {
    case 0: lm_cp_async_wait<CE_FUSED_GROUPS - 1>(); break;
    case 1: lm_cp_async_wait<CE_FUSED_GROUPS - 2>(); break;
    case 2: lm_cp_async_wait<CE_FUSED_GROUPS - 3>(); break;
    default: lm_cp_async_wait<0>(); break;
    }
}

__global__ void __launch_bounds__(CE_THREADS) ce_fused_kernel(uint16_t *dlogits, float *lse, float *row_loss,
                                                              const float *logits, const int32_t *targets,
                                                              float scale, int vocab) {
    extern __shared__ float4 ce_row[]; /* [vocab / 4] */
    __shared__ float wm[CE_THREADS / 32], ws[CE_THREADS / 32], row_lse;
    const int64_t r = blockIdx.x;
    const float *z = logits + r * vocab;
    /* thread t's pieces: v = 4 t + 4 CE_THREADS k, k < nk; group g: k in [g per, (g + 1) per) */
    const int nk = (vocab / 4 + CE_THREADS - 1) / CE_THREADS, per = (nk + CE_FUSED_GROUPS - 1) / CE_FUSED_GROUPS;
    for (int g = 0; g < CE_FUSED_GROUPS; g++) {
        for (int k = g * per; k < (g + 1) * per && k < nk; k++) {
            const int v = threadIdx.x * 4 + k * CE_THREADS * 4;
            if (v < vocab) lm_cp_async16(&ce_row[v / 4], z + v);
        }
        lm_cp_async_commit();
    }
    float m = -INFINITY, s = 0.0f;
    for (int g = 0; g < CE_FUSED_GROUPS; g++) {
        ce_fused_wait(g);
        for (int k = g * per; k < (g + 1) * per && k < nk; k++) {
            const int v = threadIdx.x * 4 + k * CE_THREADS * 4;
            if (v >= vocab) break;
            const float4 q = ce_row[v / 4];
            ce_lse_push(m, s, q.x);
            ce_lse_push(m, s, q.y);
            ce_lse_push(m, s, q.z);
            ce_lse_push(m, s, q.w);
        }
    }
    const float l0 = ce_block_lse(m, s, wm, ws);
    if (threadIdx.x == 0) {
        lse[r] = l0;
        row_loss[r] = l0 - z[targets[r]];
        row_lse = l0;
    }
    __syncthreads();
    const float l = row_lse;
    const int t = targets[r];
    uint16_t *g = dlogits + r * vocab;
#pragma unroll 4
    for (int v = threadIdx.x * 4; v < vocab; v += CE_THREADS * 4) ce_dlogits4(g + v, ce_row[v / 4], l, t - v, scale);
}

/* The shared memory ce_fused_kernel needs for a row, or 0 where it does not run (vocab not a
 * multiple of 4, or a row above what a block may take); the limit is raised once per size. */
static size_t ce_fused_smem(int vocab) {
    static int optin = -1; /* a benign race: every thread reads the same value */
    static size_t raised = 48 * 1024;
    if (vocab % 4) return 0;
    if (optin < 0) {
        int dev = 0, v = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
            (void)cudaGetLastError(); /* not left for the next launch's check */
            v = 48 * 1024;
        }
        optin = v;
    }
    const size_t bytes = (size_t)vocab * sizeof(float), statics = (2 * (CE_THREADS / 32) + 1) * sizeof(float);
    if (bytes + statics > (size_t)optin) return 0;
    if (bytes > raised) {
        if (cudaFuncSetAttribute((const void *)ce_fused_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)bytes) != cudaSuccess) {
            (void)cudaGetLastError(); /* the separate kernels run instead */
            return 0;
        }
        raised = bytes;
    }
    return bytes;
}

static lm_status check_args(const lm_cuda_context *ctx, const uint16_t *hn, const uint16_t *head,
                            const int32_t *targets, int64_t n, int d, int vocab, void *workspace,
                            size_t workspace_bytes, int64_t *rows, const char *fn) {
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n < 0 || n > INT32_MAX) return lm_error(LM_ERR_ARG, "%s: n = %lld out of range", fn, (long long)n);
    if (d < 1) return lm_error(LM_ERR_ARG, "%s: d = %d must be >= 1", fn, d);
    if (vocab < 1) return lm_error(LM_ERR_ARG, "%s: vocab = %d must be >= 1", fn, vocab);
    if (n == 0) return LM_OK;
    if (!hn || !head || !targets) return lm_error(LM_ERR_ARG, "%s: hn, head or targets is NULL", fn);
    if (!workspace) return lm_error(LM_ERR_ARG, "%s: workspace is NULL", fn);
    *rows = ce_chunk_rows(n, vocab, workspace_bytes);
    if (*rows < 1)
        return lm_error(LM_ERR_ARG, "%s: workspace_bytes = %zu is below one row's (%zu bytes)", fn, workspace_bytes,
                        ce_bytes(n, vocab, 1));
    return LM_OK;
}

/* The chunk loop of the three calls below: each chunk's logits once; with
 * `fwd` reduced to lse and the row losses (then summed into
 * *loss_sum_device), with `bwd` turned into dlogits (reading lse, just
 * written when fwd) and the two products. Forward then backward and both at
 * once run the same kernels on the same inputs in the same order. */
static lm_status ce_pass(const lm_cuda_context *ctx, int fwd, int bwd, float *lse, float *loss_sum_device,
                         float *dhn, float *dhead, const uint16_t *hn, const uint16_t *head, const int32_t *targets,
                         const float *row_scale, float scale, int64_t n, int d, int vocab, void *workspace,
                         size_t workspace_bytes, const char *fn) {
    int64_t rows = 0;
    lm_status st = check_args(ctx, hn, head, targets, n, d, vocab, workspace, workspace_bytes, &rows, fn);
    if (st) return st;
    bwd = bwd && (dhn || dhead);
    if (!fwd && (n == 0 || !bwd)) return LM_OK; /* a backward with nothing to do */
    if (!lse || (fwd && !loss_sum_device))
        return lm_error(LM_ERR_ARG, "%s: lse%s is NULL", fn, fwd ? " or loss_sum_device" : "");
    cudaStream_t s = lin_stream(ctx);
    if (n == 0) {
        LM_CUDA_TRY(cudaMemsetAsync(loss_sum_device, 0, sizeof(float), s));
        return LM_OK;
    }
    ce_workspace w = ce_carve(workspace, n, vocab, rows);
    for (int64_t r0 = 0; r0 < n; r0 += rows) {
        int64_t R = n - r0 < rows ? n - r0 : rows;
        if ((st = lm_cuda_matmul_forward(ctx, w.logits, hn + r0 * d, head, R, d, vocab, 0))) return st;
        const size_t fused = fwd && bwd && !row_scale ? ce_fused_smem(vocab) : 0;
        if (fused) {
            ce_fused_kernel<<<(unsigned)R, CE_THREADS, fused, s>>>(w.dlogits, lse + r0, w.row_loss + r0, w.logits,
                                                                  targets + r0, scale, vocab);
            LM_CUDA_TRY(cudaGetLastError());
        }
        if (fwd && !fused) {
            if (vocab % 4 == 0)
                ce_lse_kernel<4><<<(unsigned)R, CE_THREADS, 0, s>>>(lse + r0, w.row_loss + r0, w.logits, targets + r0,
                                                                    vocab);
            else
                ce_lse_kernel<1><<<(unsigned)R, CE_THREADS, 0, s>>>(lse + r0, w.row_loss + r0, w.logits, targets + r0,
                                                                    vocab);
            LM_CUDA_TRY(cudaGetLastError());
        }
        if (!bwd) continue;
        if (!fused) { /* else the fused kernel above wrote dlogits */
            const float *rs = row_scale ? row_scale + r0 : NULL;
            if (vocab % 4 == 0)
                ce_dlogits_kernel<4><<<(unsigned)R, CE_THREADS, 0, s>>>(w.dlogits, w.logits, lse + r0, targets + r0,
                                                                        rs, scale, vocab);
            else
                ce_dlogits_kernel<1><<<(unsigned)R, CE_THREADS, 0, s>>>(w.dlogits, w.logits, lse + r0, targets + r0,
                                                                        rs, scale, vocab);
            LM_CUDA_TRY(cudaGetLastError());
        }
        if ((st = lm_cuda_matmul_backward(ctx, dhn ? dhn + r0 * d : NULL, dhead, w.dlogits, hn + r0 * d, head, R, d,
                                          vocab)))
            return st;
    }
    if (fwd) {
        ce_sum_kernel<<<1, CE_SUM_THREADS, 0, s>>>(loss_sum_device, w.row_loss, n);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}

extern "C" lm_status lm_cuda_cross_entropy_forward(const lm_cuda_context *ctx, float *lse, float *loss_sum_device,
                                                   const uint16_t *hn, const uint16_t *head, const int32_t *targets,
                                                   int64_t n, int d, int vocab, void *workspace,
                                                   size_t workspace_bytes) {
    return ce_pass(ctx, 1, 0, lse, loss_sum_device, NULL, NULL, hn, head, targets, NULL, 0.0f, n, d, vocab, workspace,
                   workspace_bytes, "lm_cuda_cross_entropy_forward");
}

extern "C" lm_status lm_cuda_cross_entropy_backward(const lm_cuda_context *ctx, float *dhn, float *dhead,
                                                    const uint16_t *hn, const uint16_t *head, const int32_t *targets,
                                                    const float *lse, const float *row_scale, float scale, int64_t n,
                                                    int d, int vocab, void *workspace, size_t workspace_bytes) {
    return ce_pass(ctx, 0, 1, (float *)lse, NULL, dhn, dhead, hn, head, targets, row_scale, scale, n, d, vocab,
                   workspace, workspace_bytes, "lm_cuda_cross_entropy_backward");
}

extern "C" lm_status lm_cuda_cross_entropy_forward_backward(const lm_cuda_context *ctx, float *lse,
                                                            float *loss_sum_device, float *dhn, float *dhead,
                                                            const uint16_t *hn, const uint16_t *head,
                                                            const int32_t *targets, float scale, int64_t n, int d,
                                                            int vocab, void *workspace, size_t workspace_bytes) {
    return ce_pass(ctx, 1, 1, lse, loss_sum_device, dhn, dhead, hn, head, targets, NULL, scale, n, d, vocab,
                   workspace, workspace_bytes, "lm_cuda_cross_entropy_forward_backward");
}

/* ---- evaluation's scores ---- */

/* (value, index) of the larger; equal values keep the lower index */
__device__ __forceinline__ void score_arg_merge(float &m, int &i, float m2, int i2) {
    if (m2 > m || (m2 == m && i2 < i)) m = m2, i = i2;
}

/* One block per row of the chunk: the maximum and its lowest index (a fixed
 * warp butterfly, then warp by warp in order), then sum exp(z - max) in
 * double the same way; nll[r] and argmax[r]. */
__global__ void score_kernel(double *nll, int32_t *argmax, const float *logits, const int32_t *targets, int vocab) {
    __shared__ float wm[CE_THREADS / 32];
    __shared__ int wi[CE_THREADS / 32];
    __shared__ double ws[CE_THREADS / 32];
    __shared__ float row_max;
    const float *z = logits + (int64_t)blockIdx.x * vocab;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    /* a thread's values in ascending index: strict > keeps its lowest index;
     * a thread with no value holds (-inf, vocab) and loses every merge */
    float m = -INFINITY;
    int idx = vocab;
    for (int v = threadIdx.x; v < vocab; v += CE_THREADS) {
        float x = z[v];
        if (idx == vocab || x > m) m = x, idx = v;
    }
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        score_arg_merge(m, idx, m2, i2);
    }
    if (lane == 0) wm[warp] = m, wi[warp] = idx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float M = wm[0];
        int I = wi[0];
        for (int k = 1; k < CE_THREADS / 32; k++) score_arg_merge(M, I, wm[k], wi[k]);
        row_max = M;
        argmax[blockIdx.x] = I;
    }
    __syncthreads();
    const double mx = (double)row_max;
    double s = 0.0;
    for (int v = threadIdx.x; v < vocab; v += CE_THREADS) s += exp((double)z[v] - mx);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) ws[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double S = ws[0];
        for (int k = 1; k < CE_THREADS / 32; k++) S += ws[k];
        nll[blockIdx.x] = mx + log(S) - (double)z[targets[blockIdx.x]];
    }
}

extern "C" lm_status lm_cuda_score_forward(const lm_cuda_context *ctx, double *nll, int32_t *argmax,
                                           const uint16_t *hn, const uint16_t *head, const int32_t *targets,
                                           int64_t n, int d, int vocab, void *workspace, size_t workspace_bytes) {
    const char *fn = "lm_cuda_score_forward";
    int64_t rows = 0;
    lm_status st = check_args(ctx, hn, head, targets, n, d, vocab, workspace, workspace_bytes, &rows, fn);
    if (st || n == 0) return st;
    if (!nll || !argmax) return lm_error(LM_ERR_ARG, "%s: nll or argmax is NULL", fn);
    cudaStream_t s = lin_stream(ctx);
    ce_workspace w = ce_carve(workspace, n, vocab, rows);
    for (int64_t r0 = 0; r0 < n; r0 += rows) {
        int64_t R = n - r0 < rows ? n - r0 : rows;
        if ((st = lm_cuda_matmul_forward(ctx, w.logits, hn + r0 * d, head, R, d, vocab, 0))) return st;
        score_kernel<<<(unsigned)R, CE_THREADS, 0, s>>>(nll + r0, argmax + r0, w.logits, targets + r0, vocab);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}
