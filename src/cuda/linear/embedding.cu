/* The token embedding on the GPU (include/longmoe/linear_cuda.h): the gather
 * of lm_model_forward and the scatter-add of lm_model_backward.
 *
 * The backward adds each position's gradient row into its token's row, in
 * position order, without float atomics:
 *  1. a stable LSD radix sort of the positions by token (8-bit digits, as
 *     many passes as the vocabulary needs): per tile of 1024 positions a
 *     digit histogram, one exclusive scan over (digit, tile), then a stable
 *     scatter by one warp per tile (32 positions a step, ranks among equal
 *     digits by __match_any_sync);
 *  2. one block per run of equal tokens in the sorted order: each thread owns
 *     columns of the token's row and adds the run's gradient rows in
 *     position order, exactly as the CPU loop does (row += g, i ascending).
 * Integer atomics count the histograms; counts do not depend on order. */
#include <stdint.h>

#include "cuda/cuda_check.h"
#include "cuda/linear/linear_common.cuh"
#include "longmoe/linear_cuda.h"

#define EMB_TILE 1024 /* positions per tile of the radix sort */
#define EMB_RADIX 256 /* 8-bit digits */
#define EMB_SCAN_THREADS 1024

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

static int64_t emb_tiles(int64_t n) { return (n + EMB_TILE - 1) / EMB_TILE; }

/* Scratch layout: keys and values twice (ping-pong), then the counts. */
typedef struct {
    int32_t *keys[2], *vals[2], *counts;
} emb_scratch;

static emb_scratch emb_carve(void *base, int64_t n) {
    emb_scratch s;
    char *p = (char *)base;
    size_t b = align256((size_t)n * sizeof(int32_t));
    s.keys[0] = (int32_t *)p;
    s.vals[0] = (int32_t *)(p + b);
    s.keys[1] = (int32_t *)(p + 2 * b);
    s.vals[1] = (int32_t *)(p + 3 * b);
    s.counts = (int32_t *)(p + 4 * b);
    return s;
}

extern "C" size_t lm_cuda_embedding_scratch_bytes(int64_t n, int vocab) {
    if (n <= 0) return 0;
    return 4 * align256((size_t)n * sizeof(int32_t)) +
           align256((size_t)EMB_RADIX * (size_t)emb_tiles(n) * sizeof(int32_t));
}

__global__ void emb_forward_kernel(float *out, const float *table, const int32_t *tokens, int d) {
    // out (n,d); table (V,d); one block per row
    int64_t row = blockIdx.x;
    const float *src = table + (int64_t)tokens[row] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[row * d + i] = src[i];
}

/* keys = tokens (outside [0, vocab): vocab, sorted last and skipped), values = positions */
__global__ void emb_init_kernel(int32_t *keys, int32_t *vals, const int32_t *tokens, int64_t n, int vocab) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int32_t t = tokens[i];
        keys[i] = (t >= 0 && t < vocab) ? t : vocab;
        vals[i] = (int32_t)i;
    }
}

/* counts[digit * tiles + tile] = occurrences of digit in the tile; one warp a tile */
__global__ void emb_histogram_kernel(int32_t *counts, const int32_t *keys, int64_t n, int shift, int64_t tiles) {
    __shared__ int hist[EMB_RADIX];
    for (int b = threadIdx.x; b < EMB_RADIX; b += 32) hist[b] = 0;
    __syncwarp();
    int64_t tile = blockIdx.x, i0 = tile * EMB_TILE, i1 = i0 + EMB_TILE < n ? i0 + EMB_TILE : n;
    for (int64_t i = i0 + threadIdx.x; i < i1; i += 32) atomicAdd(&hist[(keys[i] >> shift) & (EMB_RADIX - 1)], 1);
    __syncwarp();
    for (int b = threadIdx.x; b < EMB_RADIX; b += 32) counts[(int64_t)b * tiles + tile] = hist[b];
}

/* In-place exclusive prefix sum of counts[0, len) by one block: each thread
 * sums a contiguous slice, the slice sums are scanned in shared memory, then
 * each thread writes its slice's prefixes. */
__global__ void emb_scan_kernel(int32_t *counts, int64_t len) {
    __shared__ int32_t sums[EMB_SCAN_THREADS];
    int t = threadIdx.x;
    int64_t per = (len + EMB_SCAN_THREADS - 1) / EMB_SCAN_THREADS;
    int64_t a = t * per, b = a + per < len ? a + per : len;
    int32_t local = 0;
    for (int64_t i = a; i < b; i++) local += counts[i];
    sums[t] = local;
    __syncthreads();
    for (int o = 1; o < EMB_SCAN_THREADS; o <<= 1) {
        int32_t v = t >= o ? sums[t - o] : 0;
        __syncthreads();
        sums[t] += v;
        __syncthreads();
    }
    int32_t run = sums[t] - local; /* exclusive prefix of this slice */
    for (int64_t i = a; i < b; i++) {
        int32_t c = counts[i];
        counts[i] = run;
        run += c;
    }
}

/* Stable scatter of one tile by one warp: 32 positions a step, in order. */
__global__ void emb_scatter_kernel(int32_t *keys_out, int32_t *vals_out, const int32_t *keys_in,
                                   const int32_t *vals_in, const int32_t *offsets, int64_t n, int shift,
                                   int64_t tiles) {
    __shared__ int32_t next[EMB_RADIX];
    int lane = threadIdx.x;
    int64_t tile = blockIdx.x, i0 = tile * EMB_TILE, i1 = i0 + EMB_TILE < n ? i0 + EMB_TILE : n;
    for (int b = lane; b < EMB_RADIX; b += 32) next[b] = offsets[(int64_t)b * tiles + tile];
    __syncwarp();
    const unsigned lower = (1u << lane) - 1u;
    for (int64_t base = i0; base < i1; base += 32) {
        int64_t i = base + lane;
        int valid = i < i1;
        int32_t key = valid ? keys_in[i] : 0, val = valid ? vals_in[i] : 0;
        int digit = (key >> shift) & (EMB_RADIX - 1);
        /* lanes past the end get unique labels (256 + lane): they match nobody */
        unsigned peers = __match_any_sync(0xffffffffu, valid ? digit : EMB_RADIX + lane);
        int32_t dst = valid ? next[digit] + __popc(peers & lower) : 0;
        __syncwarp();
        if (valid && lane == 31 - __clz(peers)) next[digit] += __popc(peers);
        __syncwarp();
        if (valid) {
            keys_out[dst] = key;
            vals_out[dst] = val;
        }
    }
}

/* One block per sorted index; the block that starts a run of equal tokens
 * adds the run's rows into the token's row, positions ascending. */
__global__ void emb_accumulate_kernel(float *dtable, const float *dout, const int32_t *keys, const int32_t *vals,
                                      int64_t n, int d, int vocab) {
    int64_t b = blockIdx.x;
    int32_t tok = keys[b];
    if (tok >= vocab || (b > 0 && keys[b - 1] == tok)) return;
    float *row = dtable + (int64_t)tok * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = row[i];
        for (int64_t j = b; j < n && keys[j] == tok; j++) v += dout[(int64_t)vals[j] * d + i];
        row[i] = v;
    }
}

static int threads_for_columns(int d) {
    int t = (d + 31) / 32 * 32;
    return t > 256 ? 256 : t;
}

extern "C" lm_status lm_cuda_embedding_forward(const lm_cuda_context *ctx, float *out, const float *table,
                                               const int32_t *tokens, int64_t n, int d) {
    const char *fn = "lm_cuda_embedding_forward";
    if (!ctx) return lm_error(LM_ERR_ARG, "%s: ctx is NULL", fn);
    if (n < 0 || n > INT32_MAX) return lm_error(LM_ERR_ARG, "%s: n = %lld out of range", fn, (long long)n);
    if (d < 1) return lm_error(LM_ERR_ARG, "%s: d = %d must be >= 1", fn, d);
    if (n == 0) return LM_OK;
    if (!out || !table || !tokens) return lm_error(LM_ERR_ARG, "%s: out, table or tokens is NULL", fn);
    emb_forward_kernel<<<(unsigned)n, threads_for_columns(d), 0, lin_stream(ctx)>>>(out, table, tokens, d);
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
    cudaStream_t s = lin_stream(ctx);
    emb_scratch sc = emb_carve(scratch, n);
    int64_t tiles = emb_tiles(n);
    /* keys run up to vocab (the skip label): digits to cover it */
    int bits = 1;
    while (bits < 31 && ((int64_t)vocab >> bits) != 0) bits++;
    emb_init_kernel<<<lin_grid_for(ctx, (size_t)n, 256), 256, 0, s>>>(sc.keys[0], sc.vals[0], tokens, n, vocab);
    LM_CUDA_TRY(cudaGetLastError());
    int cur = 0;
    for (int shift = 0; shift < bits; shift += 8) {
        emb_histogram_kernel<<<(unsigned)tiles, 32, 0, s>>>(sc.counts, sc.keys[cur], n, shift, tiles);
        LM_CUDA_TRY(cudaGetLastError());
        emb_scan_kernel<<<1, EMB_SCAN_THREADS, 0, s>>>(sc.counts, (int64_t)EMB_RADIX * tiles);
        LM_CUDA_TRY(cudaGetLastError());
        emb_scatter_kernel<<<(unsigned)tiles, 32, 0, s>>>(sc.keys[cur ^ 1], sc.vals[cur ^ 1], sc.keys[cur],
                                                          sc.vals[cur], sc.counts, n, shift, tiles);
        LM_CUDA_TRY(cudaGetLastError());
        cur ^= 1;
    }
    emb_accumulate_kernel<<<(unsigned)n, threads_for_columns(d), 0, s>>>(dtable, dout, sc.keys[cur], sc.vals[cur],
                                                                          n, d, vocab);
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
