/* The token embedding on the GPU (include/longmoe/linear_cuda.h): the gather
 * of lm_model_forward and the scatter-add of lm_model_backward.
 *
 * Forward: one warp per row (grid-stride), 16-byte loads and stores when d
 * % 4 == 0 and the pointers allow, up to 8 per lane in flight; one read of
 * each gathered row, one write of each output row.
 *
 * The backward adds each position's gradient row into its token's row, in
 * position order, without float atomics:
 *  1. a stable radix sort of (token, position) pairs by token
 *     (cub::DeviceRadixSort, only the bits the vocabulary needs): positions
 *     of one token come out ascending;
 *  2. one warp per (sorted index, slice of 256 columns); the warps at the
 *     start of a run of equal tokens load their slice of the token's row
 *     (float4 per lane), add the run's gradient rows in position order, 4
 *     rows' loads in flight, exactly as the CPU loop does (row += g, i
 *     ascending), and write the slice once. Each gradient row is read once, each touched table row read and
 *     written once. The sort's histograms count with integer atomics; counts
 *     do not depend on order.
 * Step 2 has two kernels with the same bits (LONGMOE_EMBEDDING_BACKWARD):
 * gather (the default: a run's keys and positions in one load, then the
 * table slice and the rows together) and chain (the first version). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cub/device/device_radix_sort.cuh>

#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

#define EMB_WARPS 8 /* warps per block */
#define EMB_ITEMS 8 /* forward: items (float4 or float) per lane held at once */
#define EMB_SLICE_ITEMS 2 /* backward: items per lane of a warp's column slice */
#define EMB_RUN_ROWS 4    /* backward: gradient rows in flight per warp */

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

/* Bits of the sort keys: tokens run up to vocab (the skip label). */
static int emb_key_bits(int vocab) {
    int bits = 1;
    while (bits < 31 && ((int64_t)vocab >> bits) != 0) bits++;
    return bits;
}

/* Scratch layout: keys and values in and out, then cub's temporary storage. */
typedef struct {
    int32_t *keys[2], *vals[2];
    void *temp;
} emb_scratch;

static emb_scratch emb_carve(void *base, int64_t n) {
    emb_scratch s;
    char *p = (char *)base;
    size_t b = align256((size_t)n * sizeof(int32_t));
    s.keys[0] = (int32_t *)p;
    s.vals[0] = (int32_t *)(p + b);
    s.keys[1] = (int32_t *)(p + 2 * b);
    s.vals[1] = (int32_t *)(p + 3 * b);
    s.temp = p + 4 * b;
    return s;
}

/* cub's temporary bytes for n pairs of `bits`-bit keys (no work is done). */
static cudaError_t emb_sort_temp_bytes(int64_t n, int bits, size_t *bytes) {
    *bytes = 0;
    return cub::DeviceRadixSort::SortPairs(NULL, *bytes, (const int32_t *)NULL, (int32_t *)NULL,
                                           (const int32_t *)NULL, (int32_t *)NULL, (int)n, 0, bits);
}

extern "C" size_t lm_cuda_embedding_scratch_bytes(int64_t n, int vocab) {
    if (n <= 0 || n > INT32_MAX) return 0;
    size_t temp = 0;
    if (vocab < 1 || emb_sort_temp_bytes(n, emb_key_bits(vocab), &temp) != cudaSuccess) {
        (void)cudaGetLastError();
        /* no device to ask: a generous bound; the backward asks again and fails cleanly */
        temp = 2 * align256((size_t)n * 8) + ((size_t)1 << 20);
    }
    return 4 * align256((size_t)n * sizeof(int32_t)) + align256(temp);
}

template <int W> __device__ __forceinline__ void emb_load(float (&r)[W], const float *p) {
    if constexpr (W == 4) {
        float4 v = __ldg((const float4 *)p);
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else {
        r[0] = __ldg(p);
    }
}

template <int W> __device__ __forceinline__ void emb_load_rw(float (&r)[W], const float *p) {
    if constexpr (W == 4) {
        float4 v = *(const float4 *)p;
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
    } else {
        r[0] = *p;
    }
}

template <int W> __device__ __forceinline__ void emb_store(float *p, const float (&r)[W]) {
    if constexpr (W == 4) *(float4 *)p = make_float4(r[0], r[1], r[2], r[3]);
    else *p = r[0];
}

/* out (n,d) = table[tokens]: one warp per row, grid-stride over rows */
template <int W> __global__ void emb_forward_kernel(float *out, const float *table, const int32_t *tokens, int64_t n,
                                                    int d) {
    int lane = threadIdx.x & 31;
    int64_t warps = (int64_t)gridDim.x * EMB_WARPS;
    for (int64_t row = (int64_t)blockIdx.x * EMB_WARPS + (threadIdx.x >> 5); row < n; row += warps) {
        const float *src = table + (int64_t)__ldg(tokens + row) * d;
        float *dst = out + row * d;
        for (int c0 = 0; c0 < d; c0 += 32 * W * EMB_ITEMS) {
            float v[EMB_ITEMS][W];
#pragma unroll
            for (int k = 0; k < EMB_ITEMS; k++) {
                int c = c0 + (k * 32 + lane) * W;
                if (c < d) emb_load<W>(v[k], src + c);
            }
#pragma unroll
            for (int k = 0; k < EMB_ITEMS; k++) {
                int c = c0 + (k * 32 + lane) * W;
                if (c < d) emb_store<W>(dst + c, v[k]);
            }
        }
    }
}

/* keys = tokens (outside [0, vocab): vocab, sorted last and skipped), values = positions */
__global__ void emb_init_kernel(int32_t *keys, int32_t *vals, const int32_t *tokens, int64_t n, int vocab) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int32_t t = tokens[i];
        keys[i] = (t >= 0 && t < vocab) ? t : vocab;
        vals[i] = (int32_t)i;
    }
}

/* Warp (b, slice): b a sorted index, slice a range of EMB_SLICE_ITEMS
 * items a lane (256 columns with float4). The warps at the start of a run of
 * equal tokens load their slice of the token's row, add the run's gradient
 * rows in position order, EMB_RUN_ROWS rows' loads in flight at a time (added
 * in order), and write the slice once. Slices split a long run's work across
 * warps; the order of the additions of every column stays the CPU's. */
template <int W>
__global__ void emb_accumulate_kernel(float *dtable, const float *dout, const int32_t *keys, const int32_t *vals,
                                      int64_t n, int d, int vocab) {
    int lane = threadIdx.x & 31;
    int64_t b = (int64_t)blockIdx.x * EMB_WARPS + (threadIdx.x >> 5);
    if (b >= n) return;
    int32_t tok = keys[b];
    if (tok >= vocab || (b > 0 && keys[b - 1] == tok)) return;
    const int c0 = blockIdx.y * (32 * W * EMB_SLICE_ITEMS);
    float *row = dtable + (int64_t)tok * d;
    float acc[EMB_SLICE_ITEMS][W];
#pragma unroll
    for (int k = 0; k < EMB_SLICE_ITEMS; k++) {
        int c = c0 + (k * 32 + lane) * W;
        if (c < d) emb_load_rw<W>(acc[k], row + c);
    }
    for (int64_t j = b;; j += EMB_RUN_ROWS) {
        /* the next EMB_RUN_ROWS positions of the run (a prefix of them) */
        bool in[EMB_RUN_ROWS];
        const float *gp[EMB_RUN_ROWS];
        bool more = true;
#pragma unroll
        for (int q = 0; q < EMB_RUN_ROWS; q++) {
            more = more && (q == 0 || (j + q < n && keys[j + q] == tok));
            in[q] = more;
            gp[q] = more ? dout + (int64_t)vals[j + q] * d : dout;
        }
        float v[EMB_RUN_ROWS][EMB_SLICE_ITEMS][W];
#pragma unroll
        for (int q = 0; q < EMB_RUN_ROWS; q++)
#pragma unroll
            for (int k = 0; k < EMB_SLICE_ITEMS; k++) {
                int c = c0 + (k * 32 + lane) * W;
                if (in[q] && c < d) emb_load<W>(v[q][k], gp[q] + c);
            }
#pragma unroll
        for (int q = 0; q < EMB_RUN_ROWS; q++) {
            if (!in[q]) break;
#pragma unroll
            for (int k = 0; k < EMB_SLICE_ITEMS; k++)
#pragma unroll
                for (int e = 0; e < W; e++) acc[k][e] += v[q][k][e];
        }
        if (!in[EMB_RUN_ROWS - 1] || j + EMB_RUN_ROWS >= n || keys[j + EMB_RUN_ROWS] != tok) break;
    }
#pragma unroll
    for (int k = 0; k < EMB_SLICE_ITEMS; k++) {
        int c = c0 + (k * 32 + lane) * W;
        if (c < d) emb_store<W>(row + c, acc[k]);
    }
}

/* emb_accumulate_kernel's sums, bit for bit (the table slice, then the run's
 * rows in sorted = position order), with fewer dependent round trips a warp.
 * emb_accumulate_kernel reads keys[b] and keys[b - 1], then the table slice
 * and, one key at a time (each comparison decides whether the next key is
 * read), the run's next keys and positions, then the gradient rows: 3 to 5
 * dependent trips to memory per warp, and at 72 registers only 24 warps an SM
 * to overlap them. Here one load instruction gathers keys[j-1 .. j+R] (lanes
 * 0 .. R+1) and vals[j .. j+R-1] (lanes 8 .. 8+R-1), shared by shuffles;
 * the table slice and the batch's R gradient rows are then loaded together,
 * and a longer run's next gather is issued with them: 2 trips for a run of at
 * most R = EMB_RUN_ROWS rows (99% of runs with uniform tokens at n = vocab),
 * 1 more per further R rows. At most 64 registers: 32 warps an SM. */
template <int W>
__global__ void __launch_bounds__(32 * EMB_WARPS, 4)
    emb_accumulate_gather_kernel(float *dtable, const float *__restrict__ dout, const int32_t *__restrict__ keys,
                                 const int32_t *__restrict__ vals, int64_t n, int d, int vocab) {
    constexpr int R = EMB_RUN_ROWS, VL = 8; /* vals' first lane */
    static_assert(R + 2 <= VL && VL + R <= 32, "gather lanes");
    const int lane = threadIdx.x & 31;
    const int64_t b = (int64_t)blockIdx.x * EMB_WARPS + (threadIdx.x >> 5);
    if (b >= n) return; /* whole warps leave together */
    /* lane l <= R + 1: keys[j - 1 + l]; lane VL + q (q < R): vals[j + q]; -1 outside [0, n) */
    auto gather = [&](int64_t j) -> int32_t {
        int64_t idx = -1;
        const int32_t *p = keys;
        if (lane <= R + 1) idx = j - 1 + lane;
        else if (lane >= VL && lane < VL + R) idx = j + (lane - VL), p = vals;
        return idx >= 0 && idx < n ? __ldg(p + idx) : -1;
    };
    int32_t gv = gather(b);
    const int32_t tok = __shfl_sync(0xffffffffu, gv, 1), prev = __shfl_sync(0xffffffffu, gv, 0);
    if (tok >= vocab || prev == tok) return; /* past the vocabulary, or not the start of a run */
    const int c0 = blockIdx.y * (32 * W * EMB_SLICE_ITEMS);
    float *row = dtable + (int64_t)tok * d;
    float acc[EMB_SLICE_ITEMS][W];
#pragma unroll
    for (int k = 0; k < EMB_SLICE_ITEMS; k++) {
        int c = c0 + (k * 32 + lane) * W;
        if (c < d) emb_load_rw<W>(acc[k], row + c);
    }
    for (int64_t j = b;; j += R) {
        /* this batch: positions j .. j+R-1 of the run (a prefix of them) */
        bool in[R];
        const float *gp[R];
        bool more = true;
#pragma unroll
        for (int q = 0; q < R; q++) {
            const int32_t kq = __shfl_sync(0xffffffffu, gv, 1 + q), vq = __shfl_sync(0xffffffffu, gv, VL + q);
            more = more && kq == tok;
            in[q] = more;
            gp[q] = more ? dout + (int64_t)vq * d : dout;
        }
        const bool cont = in[R - 1] && __shfl_sync(0xffffffffu, gv, 1 + R) == tok;
        if (cont) gv = gather(j + R); /* in flight with this batch's rows */
        float v[R][EMB_SLICE_ITEMS][W];
#pragma unroll
        for (int q = 0; q < R; q++)
#pragma unroll
            for (int k = 0; k < EMB_SLICE_ITEMS; k++) {
                int c = c0 + (k * 32 + lane) * W;
                if (in[q] && c < d) emb_load<W>(v[q][k], gp[q] + c);
            }
#pragma unroll
        for (int q = 0; q < R; q++) {
            if (!in[q]) break;
#pragma unroll
            for (int k = 0; k < EMB_SLICE_ITEMS; k++)
#pragma unroll
                for (int e = 0; e < W; e++) acc[k][e] += v[q][k][e];
        }
        if (!cont) break;
    }
#pragma unroll
    for (int k = 0; k < EMB_SLICE_ITEMS; k++) {
        int c = c0 + (k * 32 + lane) * W;
        if (c < d) emb_store<W>(row + c, acc[k]);
    }
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

static unsigned emb_blocks(int64_t rows) { return (unsigned)((rows + EMB_WARPS - 1) / EMB_WARPS); }

extern "C" lm_status lm_cuda_embedding_forward(const lm_cuda_context *ctx, float *out, const float *table,
                                               const int32_t *tokens, int64_t n, int d) {
    const char *fn = "lm_cuda_embedding_forward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n < 0 || n > INT32_MAX) return lm_error(LM_ERR_ARG, "%s: n = %lld out of range", fn, (long long)n);
    if (d < 1) return lm_error(LM_ERR_ARG, "%s: d = %d must be >= 1", fn, d);
    if (n == 0) return LM_OK;
    if (!out || !table || !tokens) return lm_error(LM_ERR_ARG, "%s: out, table or tokens is NULL", fn);
    unsigned grid = emb_blocks(n), cap = (unsigned)((ctx->sm_count > 0 ? ctx->sm_count : 132) * 8);
    if (grid > cap) grid = cap;
    if (d % 4 == 0 && aligned16(out) && aligned16(table))
        emb_forward_kernel<4><<<grid, 32 * EMB_WARPS, 0, lin_stream(ctx)>>>(out, table, tokens, n, d);
    else
        emb_forward_kernel<1><<<grid, 32 * EMB_WARPS, 0, lin_stream(ctx)>>>(out, table, tokens, n, d);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}

extern "C" lm_status lm_cuda_embedding_backward(const lm_cuda_context *ctx, float *dtable, const float *dout,
                                                const int32_t *tokens, int64_t n, int d, int vocab, void *scratch) {
    const char *fn = "lm_cuda_embedding_backward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n < 0 || n > INT32_MAX) return lm_error(LM_ERR_ARG, "%s: n = %lld out of range", fn, (long long)n);
    if (d < 1) return lm_error(LM_ERR_ARG, "%s: d = %d must be >= 1", fn, d);
    if (vocab < 1 || vocab == INT32_MAX) return lm_error(LM_ERR_ARG, "%s: vocab = %d out of range", fn, vocab);
    if (n == 0) return LM_OK;
    if (!dtable || !dout || !tokens) return lm_error(LM_ERR_ARG, "%s: dtable, dout or tokens is NULL", fn);
    if (!scratch) return lm_error(LM_ERR_ARG, "%s: scratch is NULL (lm_cuda_embedding_scratch_bytes)", fn);
    const char *kind = getenv("LONGMOE_EMBEDDING_BACKWARD");
    if (kind && *kind && strcmp(kind, "gather") && strcmp(kind, "chain"))
        return lm_error(LM_ERR_ARG, "%s: LONGMOE_EMBEDDING_BACKWARD=%s: expected gather or chain", fn, kind);
    cudaStream_t s = lin_stream(ctx);
    emb_scratch sc = emb_carve(scratch, n);
    int bits = emb_key_bits(vocab);
    size_t temp_bytes = 0;
    LM_CUDA_TRY(emb_sort_temp_bytes(n, bits, &temp_bytes));
    emb_init_kernel<<<lin_grid_for(ctx, (size_t)n, 256), 256, 0, s>>>(sc.keys[0], sc.vals[0], tokens, n, vocab);
    LM_CUDA_TRY(cudaGetLastError());
    LM_CUDA_TRY(cub::DeviceRadixSort::SortPairs(sc.temp, temp_bytes, (const int32_t *)sc.keys[0], sc.keys[1],
                                                (const int32_t *)sc.vals[0], sc.vals[1], (int)n, 0, bits, s));
    /* LONGMOE_EMBEDDING_BACKWARD: gather (the default) or chain (emb_accumulate_kernel); the same bits */
    const int chain = kind && !strcmp(kind, "chain");
    if (d % 4 == 0 && aligned16(dtable) && aligned16(dout)) {
        dim3 grid(emb_blocks(n), (unsigned)((d + 32 * 4 * EMB_SLICE_ITEMS - 1) / (32 * 4 * EMB_SLICE_ITEMS)));
        if (chain)
            emb_accumulate_kernel<4><<<grid, 32 * EMB_WARPS, 0, s>>>(dtable, dout, sc.keys[1], sc.vals[1], n, d, vocab);
        else
            emb_accumulate_gather_kernel<4>
                <<<grid, 32 * EMB_WARPS, 0, s>>>(dtable, dout, sc.keys[1], sc.vals[1], n, d, vocab);
    } else {
        dim3 grid(emb_blocks(n), (unsigned)((d + 32 * EMB_SLICE_ITEMS - 1) / (32 * EMB_SLICE_ITEMS)));
        if (chain)
            emb_accumulate_kernel<1><<<grid, 32 * EMB_WARPS, 0, s>>>(dtable, dout, sc.keys[1], sc.vals[1], n, d, vocab);
        else
            emb_accumulate_gather_kernel<1>
                <<<grid, 32 * EMB_WARPS, 0, s>>>(dtable, dout, sc.keys[1], sc.vals[1], n, d, vocab);
    }
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
